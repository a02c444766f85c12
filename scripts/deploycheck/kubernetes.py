"""deploy/k8s: every manifest against the Kubernetes schemas, the Kustomization, and the objects
around the Deployment (deployment.py): a Service, a HorizontalPodAutoscaler and a
PodDisruptionBudget that select its pods or name it."""

import os

from . import GATEWAY_PORT
from .deployment import check_deployment, is_gateway_port
from .tree import last_lines
from .values import dig, matches, short

FOLDER = "deploy/k8s"
# Kubernetes versions the manifests are validated for: the oldest schemas kubernetes-validate
# carries (deploy/k8s/README.md says 1.23 or later; it has none older than 1.25) and the newest
# that the version install-deps pins has.
KUBERNETES_VERSIONS = ["1.25.0", "1.37.0"]


def no_warning(code, output):
    return code == 0 and "WARN" not in output


def manifests(tree):
    """The files of deploy/k8s; {kind: [(file, object)]}; and the Kustomization as (file, object)."""
    folder = tree.path(FOLDER)
    files = sorted(p for p in tree.parsed if os.path.dirname(p) == folder)
    objects, kustomization = {}, None
    for path in files:
        for document in tree.parsed[path]:
            if not isinstance(document, dict):
                continue  # kubernetes-validate reports it
            if document.get("kind") == "Kustomization":
                kustomization = (path, document)
            else:
                objects.setdefault(document.get("kind"), []).append((path, document))
    return files, objects, kustomization


def check_kubernetes(tree):
    files, objects, kustomization = manifests(tree)
    if not files:
        tree.report.fail(f"{FOLDER}: no manifests")
        return
    check_schemas(tree, files, kustomization)
    nameless = [tree.rel(p) for found in objects.values() for p, o in found if not dig(o, "metadata", "name")]
    tree.report.check(
        not nameless,
        f"{FOLDER}: every object has a metadata.name",
        f"{FOLDER}: no metadata.name in {', '.join(nameless)} (the schemas allow it, kubectl apply does not)",
    )
    if kustomization:
        check_kustomization(tree, files, *kustomization)
    else:
        tree.report.fail(f"{FOLDER}/kustomization.yaml: missing")
    deployments = objects.get("Deployment") or []
    if len(deployments) != 1:
        tree.report.fail(f"{FOLDER}: expected one Deployment, found {len(deployments)}")
        return
    path, deployment = deployments[0]
    labels, ports = check_deployment(tree, tree.rel(path), deployment, objects)
    check_service(tree, objects, labels, ports)
    check_autoscaler(tree, objects, dig(deployment, "metadata", "name"))
    check_disruption_budget(tree, objects, labels)
    kubectl = tree.which("kubectl")
    if kubectl and kustomization:
        code, output = tree.run([kubectl, "kustomize", tree.path(FOLDER)], timeout=60)
        tree.report.check(
            code == 0,
            f"{FOLDER}: `kubectl kustomize` builds it",
            f"{FOLDER}: kubectl kustomize: {last_lines(output)}",
        )
    else:
        tree.report.skip(f"{FOLDER}: kubectl not installed; kustomize build not run")


def check_schemas(tree, files, kustomization):
    """Every manifest against the schemas of each of KUBERNETES_VERSIONS, rejecting unknown
    fields. kubernetes-validate only warns (exit 0) about a kind or apiVersion it has no schema
    for, such as a misspelt apps/v2: a warning fails here. The Kustomization has no schema."""
    names = [tree.rel(p) for p in files if not kustomization or p != kustomization[0]]
    for version in KUBERNETES_VERSIONS:
        tree.lint(
            FOLDER,
            f"kubernetes-validate --strict, Kubernetes {version}",
            ["kubernetes-validate", "--strict", "--quiet", "-k", version, *names],
            "pip install kubernetes-validate",
            clean=no_warning,
        )


def check_kustomization(tree, files, path, kustomization):
    folder = tree.path(FOLDER)
    name = tree.rel(path)
    resources = kustomization.get("resources") or []
    absent = [r for r in resources if not os.path.exists(os.path.join(folder, r))]
    listed = {os.path.join(folder, r) for r in resources}
    unlisted = [
        tree.rel(p) for p in files if p not in listed and p != path and not os.path.basename(p).startswith("secret.example")
    ]
    tree.report.check(
        not absent and not unlisted,
        f"{name}: lists every manifest ({len(resources)})",
        f"{name}: "
        + "; ".join(
            ([f"lists missing files {absent}"] if absent else [])
            + ([f"does not list {unlisted}"] if unlisted else [])
        ),
    )
    tree.report.check(
        not any(r.startswith("secret.example") for r in resources),
        f"{name}: leaves secret.example.yaml out (no placeholder secrets applied)",
        f"{name}: must not list secret.example.yaml: applying it would install placeholder secrets",
    )


def each(tree, objects, kind):
    """(file name, object) for each object of kind; FAIL if there is none."""
    found = objects.get(kind) or []
    if not found:
        tree.report.fail(f"{FOLDER}: no {kind}")
    return [(tree.rel(p), o) for p, o in found]


def check_selects_pods(tree, name, selector, labels):
    tree.report.check(
        matches(selector, labels),
        f"{name}: selector {short(selector)} matches the Deployment's pods",
        f"{name}: selector {short(selector)} does not match the Deployment's labels {short(labels)}",
    )


def check_service(tree, objects, labels, ports):
    for name, service in each(tree, objects, "Service"):
        check_selects_pods(tree, name, dig(service, "spec", "selector", default={}) or {}, labels)
        service_ports = dig(service, "spec", "ports", default=[]) or []
        target = dig(service_ports, 0, "targetPort")
        tree.report.check(
            dig(service_ports, 0, "port") == 80 and is_gateway_port(target, ports),
            f"{name}: port 80 -> {target}",
            f"{name}: needs port 80 with targetPort {GATEWAY_PORT} or the container port's name (found {service_ports})",
        )
        tree.report.check(
            dig(service, "spec", "sessionAffinity", default="None") == "None",
            f"{name}: no session affinity (stateless nodes)",
            f"{name}: sessionAffinity is not needed: any node serves any client",
        )


def check_autoscaler(tree, objects, deployment):
    for name, hpa in each(tree, objects, "HorizontalPodAutoscaler"):
        ref = dig(hpa, "spec", "scaleTargetRef", default={}) or {}
        tree.report.check(
            ref.get("kind") == "Deployment" and ref.get("name") == deployment,
            f"{name}: scales the Deployment {deployment}",
            f"{name}: scaleTargetRef {short(ref)} does not name the Deployment {deployment}",
        )
        low, high = dig(hpa, "spec", "minReplicas"), dig(hpa, "spec", "maxReplicas")
        tree.report.check(
            hpa.get("apiVersion") == "autoscaling/v2" and low == 3 and high == 10,
            f"{name}: autoscaling/v2, 3 to 10 replicas",
            f"{name}: expected autoscaling/v2 with minReplicas 3 and maxReplicas 10 (found {hpa.get('apiVersion')}, {low} to {high})",
        )
        cpu = [m for m in dig(hpa, "spec", "metrics", default=[]) or [] if dig(m, "resource", "name") == "cpu"]
        tree.report.check(
            cpu and dig(cpu[0], "resource", "target", "averageUtilization") == 70,
            f"{name}: CPU target 70%",
            f"{name}: needs a cpu resource metric with averageUtilization 70 (found {cpu})",
        )


def check_disruption_budget(tree, objects, labels):
    for name, pdb in each(tree, objects, "PodDisruptionBudget"):
        check_selects_pods(tree, name, dig(pdb, "spec", "selector", "matchLabels", default={}) or {}, labels)
        tree.report.check(
            pdb.get("apiVersion") == "policy/v1" and dig(pdb, "spec", "maxUnavailable") == 1,
            f"{name}: policy/v1, maxUnavailable 1",
            f"{name}: expected policy/v1 with maxUnavailable 1 (found {pdb.get('apiVersion')}, {dig(pdb, 'spec')})",
        )
