"""deploy/k8s's Deployment: its selector, the gateway container's port, probes, environment,
preStop and security, and a grace period long enough for a pod to drain."""

import os
import re

from . import DRAIN_SECONDS, GATEWAY_PORT
from .gateway import check_variables
from .values import dig, matches, short

DEFAULT_LINGER = 3  # PRESENCE_LINGER's default, when the ConfigMap does not set it


def is_gateway_port(port, ports):
    """Whether a probe's or Service's port is the gateway's: its number, or the name the container
    gives it (ports: {name: containerPort})."""
    return port == GATEWAY_PORT or (isinstance(port, str) and ports.get(port) == GATEWAY_PORT)


def pre_stop_sleep(pre_stop):
    """The seconds a preStop hook sleeps (the sleep action, or an exec of sleep); None if neither."""
    command = [str(c) for c in dig(pre_stop, "exec", "command", default=[]) or []]
    sleep = dig(pre_stop, "sleep", "seconds")
    if sleep is None and command and os.path.basename(command[0]) == "sleep" and len(command) > 1:
        sleep = float(command[1]) if re.fullmatch(r"\d+(\.\d+)?", command[1]) else None
    return sleep


def check_deployment(tree, where, deployment, objects):
    """Returns the pod template's labels and the container's {port name: number}, for the
    Service and PodDisruptionBudget checks."""
    check = tree.report.check
    pod = dig(deployment, "spec", "template", default={})
    labels = dig(pod, "metadata", "labels", default={}) or {}
    selector = dig(deployment, "spec", "selector", "matchLabels", default={}) or {}
    check(
        matches(selector, labels),
        f"{where}: selector {short(selector)} matches its pod labels",
        f"{where}: spec.selector.matchLabels {short(selector)} does not match the pod template's labels {short(labels)}",
    )
    check(
        dig(deployment, "spec", "replicas") == 3,
        f"{where}: replicas 3",
        f"{where}: replicas must be 3 (found {dig(deployment, 'spec', 'replicas')})",
    )
    containers = dig(pod, "spec", "containers", default=[]) or []
    gateway = next(
        (c for c in containers if "presence-gateway" in str(c.get("image", ""))),
        containers[0] if containers else {},
    )
    cname = f"{where}: container {gateway.get('name')}"
    ports = {p.get("name"): p.get("containerPort") for p in gateway.get("ports") or []}
    check(
        GATEWAY_PORT in ports.values(),
        f"{cname}: containerPort {GATEWAY_PORT}",
        f"{cname}: needs containerPort {GATEWAY_PORT} (found {list(ports.values())})",
    )
    for kind, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = dig(gateway, kind, "httpGet", default={}) or {}
        port = get.get("port")
        check(
            get.get("path") == path and is_gateway_port(port, ports),
            f"{cname}: {kind} GET {path} on port {port}",
            f"{cname}: {kind} must be httpGet path {path} on port {GATEWAY_PORT} (found {get or gateway.get(kind)})",
        )
    env = {e.get("name"): e for e in gateway.get("env") or []}
    field = dig(env.get("PRESENCE_NODE_ID"), "valueFrom", "fieldRef", "fieldPath")
    check(
        field == "metadata.name",
        f"{cname}: PRESENCE_NODE_ID from the pod name (fieldRef metadata.name)",
        f"{cname}: PRESENCE_NODE_ID must come from valueFrom.fieldRef.fieldPath metadata.name (found {env.get('PRESENCE_NODE_ID')})",
    )
    host = dig(env.get("PRESENCE_HOST"), "value")
    check(
        host == "0.0.0.0",
        f"{cname}: PRESENCE_HOST=0.0.0.0",
        f"{cname}: PRESENCE_HOST must be 0.0.0.0 (found {host!r}); the default 127.0.0.1 is unreachable for probes and the Service",
    )
    check_variables(tree, cname, {k: dig(v, "value", default="") for k, v in env.items()})
    pre_stop = dig(gateway, "lifecycle", "preStop", default={}) or {}
    sleep = pre_stop_sleep(pre_stop)
    check(
        pre_stop and sleep,
        f"{cname}: preStop sleeps {sleep} s before SIGTERM",
        f"{cname}: needs a lifecycle.preStop sleep so the endpoint leaves the Service before SIGTERM (found {pre_stop or 'none'})",
    )
    settings = check_env_from(tree, cname, gateway, objects)
    grace = dig(pod, "spec", "terminationGracePeriodSeconds", default=30)
    linger_text = settings.get("PRESENCE_LINGER", str(DEFAULT_LINGER))
    linger = int(linger_text) if linger_text.isdigit() else DEFAULT_LINGER
    needed = (sleep or 0) + DRAIN_SECONDS
    check(
        grace > linger and grace > needed,
        f"{where}: terminationGracePeriodSeconds {grace} > linger {linger} s and preStop + drain {needed:g} s",
        f"{where}: terminationGracePeriodSeconds {grace} must exceed PRESENCE_LINGER ({linger} s) and the preStop sleep plus the {DRAIN_SECONDS} s drain ({needed:g} s)",
    )
    check_hardening(tree, where, cname, pod, gateway)
    return labels, ports


def check_env_from(tree, cname, gateway, objects):
    """The container reads the ConfigMap and the Secret of deploy/k8s, whose PRESENCE_* names and
    values are the gateway's; returns the ConfigMaps' settings."""
    config_maps = {dig(o, "metadata", "name"): o for _, o in objects.get("ConfigMap") or []}
    secrets = {dig(o, "metadata", "name"): o for _, o in objects.get("Secret") or []}
    env_from = gateway.get("envFrom") or []
    cm_refs = [dig(e, "configMapRef", "name") for e in env_from if "configMapRef" in e]
    secret_refs = [dig(e, "secretRef", "name") for e in env_from if "secretRef" in e]
    tree.report.check(
        cm_refs and all(r in config_maps for r in cm_refs),
        f"{cname}: envFrom the ConfigMap {', '.join(map(str, cm_refs))}",
        f"{cname}: envFrom must name the ConfigMap in deploy/k8s ({', '.join(config_maps) or 'none'}), found {cm_refs}",
    )
    tree.report.check(
        secret_refs and all(r in secrets for r in secret_refs),
        f"{cname}: envFrom the Secret {', '.join(map(str, secret_refs))}",
        f"{cname}: envFrom must name the Secret of secret.example.yaml ({', '.join(secrets) or 'none'}), found {secret_refs}",
    )
    settings = {}
    for config_map in config_maps.values():
        data = {k: str(v) for k, v in (config_map.get("data") or {}).items()}
        check_variables(tree, f"deploy/k8s: ConfigMap {dig(config_map, 'metadata', 'name')}", data)
        settings.update(data)
    for secret in secrets.values():
        check_variables(
            tree,
            f"deploy/k8s: Secret {dig(secret, 'metadata', 'name')}",
            {k: "" for k in (secret.get("stringData") or secret.get("data") or {})},
        )
    return settings


def check_hardening(tree, where, cname, pod, gateway):
    """Non-root, read-only, bounded, and scraped."""
    security = dig(gateway, "securityContext", default={}) or {}
    pod_security = dig(pod, "spec", "securityContext", default={}) or {}
    non_root = security.get("runAsNonRoot", pod_security.get("runAsNonRoot"))
    tree.report.check(
        non_root is True and security.get("readOnlyRootFilesystem") is True,
        f"{cname}: runAsNonRoot and readOnlyRootFilesystem",
        f"{cname}: securityContext needs runAsNonRoot: true and readOnlyRootFilesystem: true (found {security}, pod {pod_security})",
    )
    resources = gateway.get("resources") or {}
    tree.report.check(
        resources.get("requests") and resources.get("limits"),
        f"{cname}: resource requests and limits",
        f"{cname}: needs resources.requests and resources.limits (found {resources})",
    )
    annotations = dig(pod, "metadata", "annotations", default={}) or {}
    tree.report.check(
        annotations.get("prometheus.io/scrape") == "true"
        and str(annotations.get("prometheus.io/port")) == str(GATEWAY_PORT),
        f"{where}: pods carry prometheus.io scrape annotations",
        f'{where}: pod template needs prometheus.io/scrape: "true" and prometheus.io/port: "{GATEWAY_PORT}" (found {annotations})',
    )
