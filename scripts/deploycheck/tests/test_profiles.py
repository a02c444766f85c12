"""profiles.py: the "sentinel" and "cluster" profiles of docker-compose.yml."""

import unittest

from deploycheck import compose, profiles
from deploycheck.tests.support import CLUSTER_CONF, SENTINEL_CONF, TreeCase, compose_text


class ProfileTests(TreeCase):
    def check(self, changes=None):
        tree = self.tree(changes)
        found = tree.document(compose.COMPOSE)
        profiles.check_sentinel(tree, found)
        profiles.check_cluster(tree, found)
        return tree

    def replaced(self, name, text, old, new):
        self.assertIn(old, text)
        return self.check({name: text.replace(old, new)})

    def test_good_profiles_pass(self):
        tree = self.check()
        self.assertClean(tree)
        self.assertIn(
            "ok    docker-compose.yml: the Sentinel URL in its comments: PRESENCE_* names and values are ones the "
            "gateway accepts",
            tree.report.lines,
        )

    def test_minority_quorum_fails(self):
        tree = self.replaced("deploy/sentinel/sentinel.conf", SENTINEL_CONF, "6379 2", "6379 1")
        self.assertFails(tree, "with Q a majority of the 3 Sentinels")

    def test_sentinel_url_naming_another_primary_fails(self):
        tree = self.replaced("docker-compose.yml", compose_text(), "sentinel-3/primary/0", "sentinel-3/other/0")
        self.assertFails(tree, "its comments must give the gateways redis+sentinel://")

    def test_profile_service_without_a_profile_fails(self):
        tree = self.replaced("docker-compose.yml", compose_text(), "redis-replica: {profiles: [sentinel], ", "redis-replica: {")
        self.assertFails(tree, "the services without a profile must be", "needs a replica of redis")

    def test_node_timeout_too_long_for_the_lease_fails(self):
        # The fixture's PRESENCE_LEASE_TTL is 10 s: twice the timeout must be at most 5 s.
        tree = self.replaced("deploy/cluster/redis.conf", CLUSTER_CONF, "timeout 2000", "timeout 3000")
        self.assertFails(tree, "a cluster-node-timeout whose double is at most half of PRESENCE_LEASE_TTL's default (10 s")

    def test_node_announcing_another_name_fails(self):
        tree = self.replaced("docker-compose.yml", compose_text(), "hostname: redis-c4", "hostname: redis-c9")
        self.assertFails(tree, 'not so: ["redis-c4 (command')

    def test_cluster_create_missing_a_node_fails(self):
        tree = self.replaced("docker-compose.yml", compose_text(), ", redis-c6:6379, --cluster-replicas", ", --cluster-replicas")
        self.assertFails(tree, "the cluster profile needs a one-shot service")

    def test_cluster_url_naming_a_stranger_fails(self):
        tree = self.replaced("docker-compose.yml", compose_text(), "redis-c2:6379\n", "redis-x:6379\n")
        self.assertFails(tree, "redis+cluster://<cluster node service>:6379")

    def test_missing_configuration_fails(self):
        tree = self.check({"deploy/cluster/redis.conf": None})
        self.assertFails(tree, "deploy/cluster/redis.conf: missing (the cluster profile's Redis nodes read it)")


if __name__ == "__main__":
    unittest.main()
