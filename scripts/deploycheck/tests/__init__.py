"""Unit tests of the deploycheck modules; run with make deploy-check-unit."""
