"""The checks behind scripts/check-deploy, a module per concern. Each check takes a Tree (tree.py):
the copy of the repository it reads, the report it writes its ok / FAIL / skip lines to, and what
the gateway accepts and exports. The unit tests are in tests/ (make deploy-check-unit)."""

# The gateway services of docker-compose.yml, the port every gateway listens on in a container or
# pod, and how long a node waits for its sessions to close after SIGTERM: compose, HAProxy,
# Prometheus and Kubernetes must all agree with these.
GATEWAYS = ["gateway-1", "gateway-2", "gateway-3"]
GATEWAY_PORT = 8080
DRAIN_SECONDS = 5
