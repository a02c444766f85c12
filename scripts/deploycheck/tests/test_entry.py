"""scripts/check-deploy itself: its command line."""

import importlib.machinery
import importlib.util
import os
import sys
import unittest

ENTRY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "check-deploy")


def entry():
    """scripts/check-deploy as a module (its name has no .py, so it is loaded by path)."""
    loader = importlib.machinery.SourceFileLoader("check_deploy", ENTRY)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("check_deploy", loader))
    written, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = written
    return module


class CommandLineTests(unittest.TestCase):
    def test_root_and_gateway(self):
        arguments = entry().arguments
        self.assertEqual(arguments([], "/repo"), ("/repo", "/repo/.build/debug/presence-gateway"))
        self.assertEqual(arguments(["--root", "/copy"], "/repo"), ("/copy", "/copy/.build/debug/presence-gateway"))
        self.assertEqual(arguments(["--gateway", "/bin/gw", "--root", "/copy"], "/repo"), ("/copy", "/bin/gw"))

    def test_anything_else_is_refused(self):
        arguments = entry().arguments
        self.assertIsNone(arguments(["--root"], "/repo"))
        self.assertIsNone(arguments(["--verbose"], "/repo"))
        self.assertIsNone(arguments(["--root", "/copy", "extra"], "/repo"))


if __name__ == "__main__":
    unittest.main()
