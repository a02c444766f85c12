"""gateway.py: reading the gateway's schema and metric names, and holding PRESENCE_* names and
values against them."""

import json
import os
import stat
import unittest

from deploycheck import gateway
from deploycheck.tests.support import SCHEMA, TreeCase, settings

REDIS_CONFIGURATION = """\
guard ["redis", "rediss"].contains(scheme) || scheme == "redis+sentinel" else { throw Bad.scheme }
"""
METRICS_SOURCE = """\
let errors = Counter(label: "presence_errors_total", dimensions: [("code", code)])
let delivery = Timer(
    label: "presence_message_delivery_latency_seconds")
let deliveries = LatencyHistogram(name: "presence_delivery_latency_seconds")
"""


class ReadSourcesTests(TreeCase):
    def read(self, schema_settings=None, sources=True):
        """read_sources on a tree with a stand-in binary printing schema_settings (the fixture's
        by default), and a little Swift to read schemes and metrics from."""
        files = {}
        if sources:
            files["Sources/RedisClient/RedisConfiguration.swift"] = REDIS_CONFIGURATION
            files["Sources/PresenceGateway/Metrics.swift"] = METRICS_SOURCE
        files["schema.json"] = {"settings": schema_settings if schema_settings is not None else settings()}
        tree = self.tree(files)
        tree.facts = gateway.Facts()  # read, not given
        binary = os.path.join(tree.root, "presence-gateway")
        with open(binary, "w", encoding="utf-8") as f:
            f.write(f"#!/bin/sh\ncat '{tree.path('schema.json')}'\n")
        os.chmod(binary, os.stat(binary).st_mode | stat.S_IXUSR)
        gateway.read_sources(tree, binary)
        return tree

    def test_schema_and_sources_are_read(self):
        tree = self.read()
        self.assertClean(tree)
        self.assertEqual(
            tree.report.lines[0],
            "ok    presence-gateway --print-config-schema: 10 PRESENCE_* settings (3 ranges, 1 choices;"
            " Redis URLs redis://, redis+sentinel://, rediss://)",
        )
        self.assertEqual(tree.facts.variables["PRESENCE_LINGER"], (0, 3600))
        self.assertEqual(tree.facts.variables["PRESENCE_VISIBILITY"], {"conversations", "open"})
        self.assertEqual(tree.facts.lease_ttl(), 10)
        self.assertIn("presence_delivery_latency_seconds_bucket", tree.facts.metrics)
        self.assertIn("presence_delivery_latency_seconds_sum", tree.facts.metrics)
        self.assertIn("presence_message_delivery_latency_seconds_count", tree.facts.metrics)
        self.assertIn("presence_errors_total", tree.facts.metrics)

    def test_schema_without_a_checked_setting_fails(self):
        tree = self.read([s for s in settings() if s["name"] != "PRESENCE_NODE_ID"])
        self.assertFails(tree, "missing ['PRESENCE_NODE_ID']")
        # Nothing is then held against a partial schema.
        self.assertEqual(tree.facts.variables, {})

    def test_missing_binary_and_sources_fail(self):
        tree = self.tree()
        tree.facts = gateway.Facts()
        gateway.read_sources(tree, os.path.join(tree.root, "nowhere"))
        self.assertFails(tree, "nowhere is missing: build it first", "found no Counter/Gauge/Timer(label: ...)")

    def test_fixture_is_in_the_printed_shape(self):
        with open(SCHEMA, encoding="utf-8") as f:
            printed = json.load(f)
        self.assertEqual(list(printed), ["settings"])
        for setting in printed["settings"]:
            self.assertTrue({"name", "flag", "type", "help", "default"} <= set(setting), setting)


class VariableTests(TreeCase):
    def problems(self, values):
        return gateway.variable_problems(self.tree().facts, values)

    def test_accepted_values_pass(self):
        self.assertEqual(
            self.problems({
                "PRESENCE_PORT": "8080", "PRESENCE_VISIBILITY": "open", "PRESENCE_NODE_ID": "node-1.a@b",
                "PRESENCE_REDIS_URL": "redis+sentinel://s1,s2/primary/0", "PRESENCE_JWT_SECRET": "",
                "PRESENCE_LINGER": "${LINGER}", "OTHER": "not the gateway's",
            }),
            [],
        )

    def test_refused_values_fail(self):
        found = self.problems({
            "PRESENCE_PORT": "80a", "PRESENCE_LEASE_TTL": "0", "PRESENCE_VISIBILITY": "all",
            "PRESENCE_NODE_ID": "a b", "PRESENCE_KEY_PREFIX": "{p}", "PRESENCE_REDIS_URL": "http://x",
            "PRESENCE_NOPE": "1",
        })
        self.assertEqual(len(found), 7, found)
        self.assertIn("PRESENCE_LEASE_TTL=0 must be a whole number from 1 to 3600", found)

    def test_check_reports_where(self):
        tree = self.tree()
        gateway.check_variables(tree, "here", {"PRESENCE_PORT": "70000"})
        self.assertEqual(tree.report.lines, ["FAIL  here: PRESENCE_PORT=70000 must be a whole number from 0 to 65535"])
        # Before the schema is read, nothing is checked (read_sources has failed already).
        tree.facts = gateway.Facts()
        gateway.check_variables(tree, "here", {"PRESENCE_PORT": "70000"})
        self.assertEqual(len(tree.report.lines), 1)


if __name__ == "__main__":
    unittest.main()
