"""haproxy.py: the compose load balancer's configuration and scripts/cluster's template."""

import unittest

from deploycheck import haproxy
from deploycheck.tests.support import TreeCase, compose_text

SHARED = """\
defaults
    mode http
    timeout client 1h
    timeout server 1h
    timeout tunnel 1h

listen stats
    bind :8404
    stats uri /stats
    monitor-uri /healthz

backend gateways
    balance leastconn
    option httpchk GET /readyz
    http-check expect status 200
"""

CONFIG = SHARED + """\
    default-server inter 1s fall 2 rise 2 resolvers docker init-addr last,libc,none
    server gateway-1 gateway-1:8080 check  # a comment
    server gateway-2 gateway-2:8080 check
    server gateway-3 gateway-3:8080 check
"""

TEMPLATE = SHARED.replace("bind :8404", "bind :@STATS_PORT@") + """\
    default-server inter 1s fall 2 rise 2
@SERVERS@

frontend clients
    bind :@LB_PORT@
    default_backend gateways
"""


class HAProxyTests(TreeCase):
    def check(self, config=CONFIG, template=TEMPLATE):
        tree = self.tree({"deploy/haproxy.cfg": config, "deploy/haproxy.cfg.template": template})
        haproxy.check_haproxy(tree, tree.document("docker-compose.yml"))
        return tree

    def test_good_configurations_pass(self):
        tree = self.check()
        self.assertClean(tree)
        # Both go to haproxy -c, the template once rendered.
        self.assertEqual([c[:3] for c in self.linted], [["haproxy", "-c", "-f"]] * 2)
        self.assertEqual(self.linted[1][3], "deploy/haproxy.cfg")

    def test_server_on_another_port_fails(self):
        tree = self.check(config=CONFIG.replace("gateway-3:8080", "gateway-3:9090"))
        self.assertFails(tree, "deploy/haproxy.cfg: gateway-3:9090 must use port 8080")

    def test_missing_and_unknown_servers_fail(self):
        tree = self.check(config=CONFIG.replace("gateway-2 gateway-2:8080", "gateway-9 gateway-9:8080"))
        self.assertFails(tree, "no server line for gateway-2", "servers gateway-9 are not services in docker-compose.yml")

    def test_server_names_follow_the_compose_services(self):
        # A fourth gateway in compose needs its own server line.
        text = compose_text().replace("  lb:", "  gateway-4: {image: x}\n  lb:")
        tree = self.tree({"docker-compose.yml": text, "deploy/haproxy.cfg": CONFIG, "deploy/haproxy.cfg.template": TEMPLATE})
        haproxy.check_haproxy(tree, tree.document("docker-compose.yml"))
        self.assertFails(tree, "no server line for gateway-4")

    def test_template_balancing_otherwise_fails(self):
        tree = self.check(template=TEMPLATE.replace("balance leastconn", "balance roundrobin"))
        self.assertFails(
            tree,
            "deploy/haproxy.cfg.template: needs balance leastconn (found balance roundrobin)",
            "differs from deploy/haproxy.cfg in balance",
        )

    def test_health_checks_and_tunnel_timeout_are_required(self):
        config = CONFIG.replace("    timeout tunnel 1h\n", "").replace("GET /readyz", "GET /healthz")
        tree = self.check(config=config)
        self.assertFails(tree, "needs timeout tunnel", "option httpchk GET /readyz (found option httpchk GET /healthz)")

    def test_servers_without_init_addr_none_fail(self):
        tree = self.check(config=CONFIG.replace(" init-addr last,libc,none", ""))
        self.assertFails(tree, "default-server needs `resolvers` and `init-addr last,libc,none`")

    def test_template_missing_a_placeholder_fails(self):
        tree = self.check(template=TEMPLATE.replace("@SERVERS@", "    server one 127.0.0.1:1"))
        self.assertFails(tree, "expected the placeholders @LB_PORT@ @STATS_PORT@ @SERVERS@")

    def test_render_fills_every_placeholder(self):
        text = haproxy.render_template(TEMPLATE, 1, 2, [("node-1", 3)])
        self.assertNotIn("@", text)
        self.assertIn("    server node-1 127.0.0.1:3", text)


if __name__ == "__main__":
    unittest.main()
