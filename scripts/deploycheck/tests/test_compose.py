"""compose.py: the default services, each gateway's settings, and deploy/env.example."""

import unittest

from deploycheck import compose
from deploycheck.tests.support import ENV_EXAMPLE, TreeCase, compose_text
from deploycheck.values import compose_default, seconds

HEALTHCHECK = "CMD curl -f http://127.0.0.1:8080/healthz"


class ComposeTests(TreeCase):
    def check(self, changes=None, image_healthcheck=HEALTHCHECK):
        tree = self.tree(changes)
        compose.check_compose(tree, image_healthcheck)
        return tree

    def broken(self, old, new):
        """The fixture's docker-compose.yml with old replaced by new (which must be there)."""
        text = compose_text()
        self.assertIn(old, text)
        return self.check({"docker-compose.yml": text.replace(old, new)})

    def test_good_compose_passes(self):
        tree = self.check()
        self.assertClean(tree)
        self.assertIn(
            "ok    docker-compose.yml: distinct PRESENCE_NODE_ID per gateway (gateway-1, gateway-2, gateway-3)",
            tree.report.lines,
        )

    def test_shared_node_id_fails(self):
        tree = self.broken("PRESENCE_NODE_ID: gateway-3", "PRESENCE_NODE_ID: gateway-1")
        self.assertFails(tree, "every gateway needs its own PRESENCE_NODE_ID")

    def test_node_id_the_gateway_refuses_fails(self):
        tree = self.broken("PRESENCE_NODE_ID: gateway-2", "PRESENCE_NODE_ID: 'gateway 2'")
        self.assertFails(tree, "gateway-2: PRESENCE_NODE_ID='gateway 2' must be 1-128 characters")

    def test_grace_period_shorter_than_the_drain_fails(self):
        tree = self.broken("stop_grace_period: 30s", "stop_grace_period: 6s")
        self.assertFails(tree, "gateway-1: stop_grace_period must exceed the 5 s drain")

    def test_no_healthcheck_anywhere_fails(self):
        text = compose_text().replace('healthcheck: {test: [CMD, curl, -f, "http://127.0.0.1:8080/healthz"]}', "")
        tree = self.check({"docker-compose.yml": text}, image_healthcheck=None)
        self.assertFails(tree, "gateway-1: has no healthcheck")
        # The image's HEALTHCHECK is enough when the service has none of its own.
        self.assertClean(self.check({"docker-compose.yml": text}))

    def test_redis_url_not_at_the_redis_service_fails(self):
        tree = self.broken("redis://redis:6379/0", "redis://elsewhere:6379/0")
        self.assertFails(tree, "PRESENCE_REDIS_URL must point at the redis service")

    def test_unknown_or_refused_variables_fail(self):
        tree = self.broken("PRESENCE_VISIBILITY: open", "PRESENCE_VISIBILITY: everyone\n    PRESENCE_COLOUR: red")
        self.assertFails(tree, "PRESENCE_VISIBILITY=everyone must be one of conversations, open",
                         "PRESENCE_COLOUR is not a gateway variable")

    def test_lb_port_and_missing_bind_mount_fail(self):
        tree = self.broken('ports: ["8080:8080"]', 'ports: ["9000:9000"]')
        self.assertFails(tree, "lb must publish port 8080")
        tree = self.check({"deploy/haproxy.cfg": None})
        self.assertFails(tree, "bind-mount sources missing: lb: ./deploy/haproxy.cfg")

    def test_redis_without_aof_fails(self):
        tree = self.broken('--appendonly, "yes"', '--appendonly, "no"')
        self.assertFails(tree, "redis command must include --appendonly yes")

    def test_env_example_without_secrets_fails(self):
        tree = self.check({"deploy/env.example": ENV_EXAMPLE.replace("PRESENCE_ADMIN_TOKEN=change-me\n", "")})
        self.assertFails(tree, "deploy/env.example: must set PRESENCE_JWT_SECRET and PRESENCE_ADMIN_TOKEN")
        tree = self.check({"deploy/env.example": ENV_EXAMPLE.replace("LEASE_TTL=10", "LEASE_TTL=0")})
        self.assertFails(tree, "PRESENCE_LEASE_TTL=0 must be a whole number from 1 to 3600")


class ValueTests(unittest.TestCase):
    def test_durations(self):
        self.assertEqual(seconds("1m30s"), 90)
        self.assertEqual(seconds("500ms"), 0.5)
        self.assertEqual(seconds(10), 10)
        self.assertIsNone(seconds("soon"))

    def test_compose_defaults(self):
        self.assertEqual(compose_default("${URL:-redis://redis}/0"), "redis://redis/0")
        self.assertEqual(compose_default("$$HOST ${UNSET}"), "$HOST ")


if __name__ == "__main__":
    unittest.main()
