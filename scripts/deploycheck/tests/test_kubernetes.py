"""kubernetes.py and deployment.py: the manifests of deploy/k8s agree with each other (selectors,
names, ports) and with the gateway (probes, node ids, variables, drain time)."""

import unittest

from deploycheck import kubernetes
from deploycheck.tests.support import TreeCase

LABELS = {"app": "presence", "component": "gateway"}


def deployment():
    container = {
        "name": "gateway",
        "image": "presence-gateway:local",
        "ports": [{"name": "http", "containerPort": 8080}],
        "envFrom": [{"configMapRef": {"name": "presence"}}, {"secretRef": {"name": "presence"}}],
        "env": [
            {"name": "PRESENCE_HOST", "value": "0.0.0.0"},
            {"name": "PRESENCE_NODE_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": 8080}},
        "lifecycle": {"preStop": {"exec": {"command": ["/bin/sleep", "5"]}}},
        "resources": {"requests": {"cpu": "250m"}, "limits": {"cpu": "2"}},
        "securityContext": {"readOnlyRootFilesystem": True},
    }
    pod = {
        "metadata": {"labels": {**LABELS, "part-of": "presence"},
                     "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": "8080"}},
        "spec": {"terminationGracePeriodSeconds": 30, "securityContext": {"runAsNonRoot": True},
                 "containers": [container]},
    }
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "presence"},
            "spec": {"replicas": 3, "selector": {"matchLabels": dict(LABELS)}, "template": pod}}


def manifests():
    """{file name: object}: the Deployment and everything around it."""
    return {
        "deployment.yaml": deployment(),
        "service.yaml": {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "presence"},
                         "spec": {"selector": dict(LABELS), "ports": [{"port": 80, "targetPort": "http"}]}},
        "hpa.yaml": {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "presence"},
                     "spec": {"scaleTargetRef": {"kind": "Deployment", "name": "presence"}, "minReplicas": 3,
                              "maxReplicas": 10, "metrics": [{"resource": {"name": "cpu",
                                                                           "target": {"averageUtilization": 70}}}]}},
        "pdb.yaml": {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "presence"},
                     "spec": {"maxUnavailable": 1, "selector": {"matchLabels": dict(LABELS)}}},
        "configmap.yaml": {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "presence"},
                           "data": {"PRESENCE_LINGER": "3", "PRESENCE_REDIS_URL": "redis://redis:6379/0"}},
        "secret.example.yaml": {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "presence"},
                                "stringData": {"PRESENCE_JWT_SECRET": "x", "PRESENCE_ADMIN_TOKEN": "y"}},
        "kustomization.yaml": {"kind": "Kustomization",
                               "resources": ["deployment.yaml", "service.yaml", "hpa.yaml", "pdb.yaml", "configmap.yaml"]},
    }


class KubernetesTests(TreeCase):
    def check(self, found):
        tree = self.tree({f"deploy/k8s/{name}": o for name, o in found.items()})
        kubernetes.check_kubernetes(tree)
        return tree

    def test_good_manifests_pass(self):
        tree = self.check(manifests())
        self.assertClean(tree)
        # Validated for each version, without the Kustomization; kubectl is not looked for here.
        self.assertEqual([c[4] for c in self.linted], kubernetes.KUBERNETES_VERSIONS)
        self.assertNotIn("deploy/k8s/kustomization.yaml", self.linted[0])
        self.assertEqual(tree.report.lines[-1], "skip  deploy/k8s: kubectl not installed; kustomize build not run")

    def test_service_selecting_other_pods_fails(self):
        found = manifests()
        found["service.yaml"]["spec"]["selector"]["component"] = "worker"
        self.assertFails(self.check(found), "deploy/k8s/service.yaml: selector {app: presence, component: worker} does not match")

    def test_deployment_selector_and_budget_selector_must_match_the_pods(self):
        found = manifests()
        found["deployment.yaml"]["spec"]["selector"]["matchLabels"] = {"app": "other"}
        found["pdb.yaml"]["spec"]["selector"]["matchLabels"] = {}
        self.assertFails(self.check(found), "spec.selector.matchLabels {app: other} does not match",
                         "deploy/k8s/pdb.yaml: selector {} does not match")

    def test_grace_period_shorter_than_pre_stop_and_drain_fails(self):
        found = manifests()
        found["deployment.yaml"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 10
        self.assertFails(self.check(found), "terminationGracePeriodSeconds 10 must exceed PRESENCE_LINGER (3 s) and the "
                         "preStop sleep plus the 5 s drain (10 s)")

    def test_grace_period_must_exceed_the_configured_linger(self):
        found = manifests()
        found["configmap.yaml"]["data"]["PRESENCE_LINGER"] = "40"
        self.assertFails(self.check(found), "terminationGracePeriodSeconds 30 must exceed PRESENCE_LINGER (40 s)")

    def test_fixed_node_id_fails(self):
        found = manifests()
        found["deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]["env"][1] = {
            "name": "PRESENCE_NODE_ID", "value": "node"}
        self.assertFails(self.check(found), "PRESENCE_NODE_ID must come from valueFrom.fieldRef.fieldPath metadata.name")

    def test_probe_and_service_on_another_port_fail(self):
        found = manifests()
        found["deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["port"] = 9090
        found["service.yaml"]["spec"]["ports"][0]["targetPort"] = "metrics"
        self.assertFails(self.check(found), "livenessProbe must be httpGet path /healthz on port 8080",
                         "service.yaml: needs port 80 with targetPort 8080")

    def test_variables_the_gateway_refuses_fail(self):
        found = manifests()
        found["configmap.yaml"]["data"].update(PRESENCE_LINGER="99999", PRESENCE_REDIS_URL="http://redis")
        found["secret.example.yaml"]["stringData"]["PRESENCE_TOKEN"] = "z"
        self.assertFails(self.check(found), "ConfigMap presence: PRESENCE_LINGER=99999 must be a whole number from 0 to 3600",
                         "PRESENCE_REDIS_URL='http://redis' must start with redis:// or redis+cluster://",
                         "Secret presence: PRESENCE_TOKEN is not a gateway variable")

    def test_kustomization_listing_and_references_fail(self):
        found = manifests()
        found["kustomization.yaml"]["resources"] = ["deployment.yaml", "service.yaml", "secret.example.yaml", "gone.yaml"]
        found["hpa.yaml"]["spec"]["scaleTargetRef"]["name"] = "other"
        found["deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]["envFrom"][0]["configMapRef"]["name"] = "x"
        self.assertFails(self.check(found), "lists missing files ['gone.yaml']", "does not list ['deploy/k8s/configmap.yaml'",
                         "must not list secret.example.yaml", "scaleTargetRef {kind: Deployment, name: other}",
                         "envFrom must name the ConfigMap in deploy/k8s (presence), found ['x']")

    def test_missing_objects_fail(self):
        found = manifests()
        del found["pdb.yaml"], found["hpa.yaml"]
        self.assertFails(self.check(found), "deploy/k8s: no PodDisruptionBudget", "deploy/k8s: no HorizontalPodAutoscaler")
        del found["deployment.yaml"]
        self.assertFails(self.check(found), "deploy/k8s: expected one Deployment, found 0")


if __name__ == "__main__":
    unittest.main()
