"""What the tests share: a scratch repository tree holding small deployment files that pass every
cross-check, the gateway's facts from a fixture schema, and a TestCase that checks the lines."""

import json
import os
import shutil
import tempfile
import unittest

import yaml

from deploycheck.gateway import variable_rules
from deploycheck.report import Report
from deploycheck.tree import Tree, load_yaml

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
SCHEMA = os.path.join(FIXTURES, "schema.json")
SCHEMES = ["redis", "redis+cluster", "redis+sentinel", "rediss"]
METRICS = {
    "presence_sessions",
    "presence_transitions_total",
    "presence_errors_total",
    *(f"presence_delivery_latency_seconds{s}" for s in ("", "_bucket", "_count", "_sum")),
}
NODES = [f"redis-c{i}" for i in range(1, 7)]


def settings():
    with open(SCHEMA, encoding="utf-8") as f:
        return json.load(f)["settings"]


def compose_text():
    """A docker-compose.yml with the default services and both profiles, written as a person
    would (anchors, merge keys, comments): the checks read its text as well as its YAML."""
    gateways = "".join(
        f"  gateway-{i}: {{<<: *gateway, environment: {{<<: *env, PRESENCE_NODE_ID: gateway-{i}}}}}\n"
        for i in (1, 2, 3)
    )
    sentinels = "".join(f"  sentinel-{i}: {{<<: *sentinel}}\n" for i in (1, 2, 3))
    nodes = "".join(f"  {n}: {{<<: *node, hostname: {n}}}\n" for n in NODES)
    waits = ", ".join(f"{n}: {{condition: service_healthy}}" for n in NODES)
    addresses = ", ".join(f"{n}:6379" for n in NODES)
    return f"""\
# GATEWAY_REDIS_URL=redis+sentinel://sentinel-1,sentinel-2,sentinel-3/primary/0
# GATEWAY_REDIS_URL=redis+cluster://redis-c1:6379,redis-c2:6379
x-gateway: &gateway
  build: {{context: ., dockerfile: deploy/Dockerfile}}
  env_file: .env
  environment: &env
    PRESENCE_HOST: 0.0.0.0
    PRESENCE_REDIS_URL: ${{GATEWAY_REDIS_URL:-redis://redis:6379/0}}
    PRESENCE_VISIBILITY: open
  depends_on: {{redis: {{condition: service_healthy}}}}
  healthcheck: {{test: [CMD, curl, -f, "http://127.0.0.1:8080/healthz"]}}
  stop_grace_period: 30s
x-sentinel: &sentinel
  profiles: [sentinel]
  command: [redis-server, /etc/sentinel.conf, --sentinel]
  volumes: ["./deploy/sentinel/sentinel.conf:/etc/sentinel.conf"]
x-node: &node
  profiles: [cluster]
  command: [redis-server, /etc/redis.conf, --cluster-announce-hostname, $$HOSTNAME]
  volumes: ["./deploy/cluster/redis.conf:/etc/redis.conf"]
  healthcheck: {{test: [CMD, redis-cli, ping]}}
services:
  redis:
    command: [redis-server, --appendonly, "yes"]
    volumes: ["redis-data:/data"]
    healthcheck: {{test: [CMD, redis-cli, ping]}}
{gateways}\
  lb: {{image: "haproxy:2.8", ports: ["8080:8080"], volumes: ["./deploy/haproxy.cfg:/etc/haproxy.cfg:ro"]}}
  prometheus: {{image: prom/prometheus}}
  grafana: {{image: grafana/grafana, volumes: ["./deploy/grafana/dashboard.json:/dashboards/presence.json:ro"]}}
  redis-replica: {{profiles: [sentinel], command: [redis-server, --replicaof, redis, "6379"]}}
{sentinels}{nodes}\
  redis-cluster-create:
    profiles: [cluster]
    command: [redis-cli, --cluster, create, {addresses}, --cluster-replicas, "1", --cluster-yes]
    depends_on: {{{waits}}}
    restart: "no"
volumes:
  redis-data: {{}}
"""


SENTINEL_CONF = """\
port 26379
sentinel resolve-hostnames yes
sentinel announce-hostnames yes
sentinel monitor primary redis 6379 2
"""

CLUSTER_CONF = """\
port 6379
cluster-enabled yes
cluster-node-timeout 2000  # a comment
cluster-preferred-endpoint-type hostname
"""

ENV_EXAMPLE = """\
# Copy to .env.
PRESENCE_JWT_SECRET=change-me
PRESENCE_ADMIN_TOKEN=change-me
# PRESENCE_LEASE_TTL=10
"""


def base_files():
    """The files every scratch tree starts with; each test replaces the ones it breaks."""
    return {
        "docker-compose.yml": compose_text(),
        "deploy/env.example": ENV_EXAMPLE,
        "deploy/sentinel/sentinel.conf": SENTINEL_CONF,
        "deploy/cluster/redis.conf": CLUSTER_CONF,
        "deploy/haproxy.cfg": "",
        "deploy/grafana/dashboard.json": "{}",
    }


class TreeCase(unittest.TestCase):
    """Each test builds a scratch tree (base_files() with its own changes), runs one module's
    checks on it with the linters only recorded, and looks at the FAIL lines."""

    def tree(self, changes=None, metrics=METRICS):
        root = tempfile.mkdtemp(prefix="deploycheck-")
        self.addCleanup(shutil.rmtree, root, True)
        files = {**base_files(), **(changes or {})}
        for name, content in files.items():
            if content is None:
                continue  # a test removing a file
            path = os.path.join(root, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                if isinstance(content, str):
                    f.write(content)
                elif name.endswith(".json"):
                    json.dump(content, f)
                else:
                    yaml.safe_dump_all(content if isinstance(content, list) else [content], f)
        tree = Tree(root, Report(echo=False), linter=self.record, which=lambda name: None)
        tree.facts.schema.extend(settings())
        tree.facts.accept(variable_rules(settings()), SCHEMES)
        tree.facts.metrics.update(metrics)
        self.linted = []
        load_yaml(tree)
        self.yamllint, self.linted = self.linted, []  # what a test's own checks lint comes after
        return tree

    def record(self, tree, where, what, command, installed_by, clean):
        self.linted.append(command)

    def assertClean(self, tree):
        self.assertEqual(tree.report.failures(), [])
        self.assertGreater(tree.report.passed, 0)

    def assertFails(self, tree, *texts):
        """Some FAIL line holds each of texts."""
        failures = tree.report.failures()
        for text in texts:
            self.assertTrue(any(text in line for line in failures), f"no FAIL with {text!r} in {failures}")
