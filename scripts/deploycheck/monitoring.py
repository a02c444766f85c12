"""deploy/prometheus.yml (promtool, and that it scrapes every gateway) and the Grafana dashboard
(that every panel queries metrics the gateway exports, in valid PromQL) with its provisioning."""

import json
import os
import re
import tempfile

from . import GATEWAY_PORT
from .compose import gateway_services
from .values import dig

PROMETHEUS = "deploy/prometheus.yml"
DASHBOARD = "deploy/grafana/dashboard.json"
DATASOURCES = "deploy/grafana/provisioning/datasources/prometheus.yml"
PROVIDERS = "deploy/grafana/provisioning/dashboards/presence.yml"
INSTALL_PROMTOOL = "apt-get install --no-install-recommends prometheus"
# The panels the dashboard must have, by the metric (or `up`) each one shows.
DASHBOARD_SHOWS = [
    "presence_sessions",
    "presence_transitions_total",
    "presence_frames_sent_total",
    "presence_delivery_latency_seconds",
    "presence_redis_latency_seconds",
    "presence_errors_total",
    "up",
]


def check_prometheus(tree, compose):
    # Without --syntax-only: the files the configuration names (rules, secrets) must exist too.
    tree.lint(PROMETHEUS, "promtool check config", ["promtool", "check", "config", PROMETHEUS], INSTALL_PROMTOOL)
    config = tree.document(PROMETHEUS)
    if not isinstance(config, dict):
        tree.report.fail(f"{PROMETHEUS}: cannot check (missing or not valid YAML)")
        return
    gateways = gateway_services(compose)
    targets, intervals = set(), set()
    for job in config.get("scrape_configs") or []:
        job_targets = {t for sc in job.get("static_configs") or [] for t in sc.get("targets") or []}
        if any(t.split(":")[0] in gateways for t in job_targets):
            targets |= job_targets
            intervals.add(job.get("scrape_interval") or dig(config, "global", "scrape_interval", default="1m"))
            tree.report.check(
                job.get("metrics_path", "/metrics") == "/metrics",
                f"{PROMETHEUS}: scrapes /metrics",
                f"{PROMETHEUS}: metrics_path must be /metrics (found {job.get('metrics_path')})",
            )
    wanted = {f"{g}:{GATEWAY_PORT}" for g in gateways}
    tree.report.check(
        wanted <= targets,
        f"{PROMETHEUS}: scrapes {', '.join(sorted(wanted))}",
        f"{PROMETHEUS}: does not scrape {', '.join(sorted(wanted - targets))}",
    )
    tree.report.check(
        intervals == {"5s"},
        f"{PROMETHEUS}: every 5 s",
        f"{PROMETHEUS}: the gateways' scrape_interval must be 5s (found {sorted(map(str, intervals)) or 'no job'})",
    )


def dashboard_panels(panels):
    for panel in panels or []:
        yield panel
        yield from dashboard_panels(panel.get("panels"))


def expression_problems(expr, metrics):
    """Problems with one PromQL expression: unknown metric names, quantiles not over buckets."""
    problems = []
    for metric in re.findall(r"\b((?:presence|redis)_[a-z_]+)\b", expr):
        if metric not in metrics:
            problems.append(f"unknown metric {metric}")
    for argument in re.findall(r"histogram_quantile\(\s*[\d.]+\s*,(.*)", expr):
        if "_bucket" not in argument or not re.search(r"by\s*\([^)]*\ble\b", argument):
            problems.append("histogram_quantile needs rate(..._bucket[...]) summed by (le, ...)")
    return problems


def dashboard_problems(dashboard):
    problems = []
    if dashboard.get("title") != "Presence gateway":
        problems.append(f"title must be 'Presence gateway' (found {dashboard.get('title')!r})")
    if not dashboard.get("uid"):
        problems.append("no uid")
    if not isinstance(dashboard.get("schemaVersion"), int) or dashboard["schemaVersion"] < 36:
        problems.append(f"schemaVersion must be a number of 36 or more (found {dashboard.get('schemaVersion')!r})")
    variables = dig(dashboard, "templating", "list", default=[]) or []
    if not any(v.get("type") == "datasource" and v.get("query") == "prometheus" for v in variables):
        problems.append("no Prometheus data source variable (templating: type datasource, query prometheus)")
    return problems


def check_panels(tree, panels):
    """Each panel queries the gateway's metrics; returns each expression as a recording rule,
    named after its panel, for promtool."""
    metrics, check = tree.facts.metrics, tree.report.check
    check(panels, f"{DASHBOARD}: {len(panels)} panels", f"{DASHBOARD}: has no panels")
    ids = [p.get("id") for p in panels]
    check(
        len(set(ids)) == len(ids) and None not in ids,
        f"{DASHBOARD}: panel ids are unique",
        f"{DASHBOARD}: panel ids must be present and unique (found {ids})",
    )
    exprs, records = [], []
    for panel in panels:
        title = panel.get("title") or f"panel {panel.get('id')}"
        targets = [t.get("expr", "") for t in panel.get("targets") or []]
        shown = sorted({m for e in targets for m in re.findall(r"\b[a-z_]+\b", e) if m in metrics or m == "up"})
        issues = [f"{e!r}: {p}" for e in targets for p in expression_problems(e, metrics)]
        if not panel.get("gridPos"):
            issues.append("no gridPos")
        check(
            shown and not issues,
            f"{DASHBOARD}: panel '{title}' queries {', '.join(shown)}",
            f"{DASHBOARD}: panel '{title}': "
            + ("; ".join(issues) if issues else f"no target queries a gateway metric or up (targets: {targets})"),
        )
        exprs += targets
        records += [{"record": f"panel_{panel.get('id')}:expr_{k}", "expr": e} for k, e in enumerate(targets)]
    missing = [m for m in DASHBOARD_SHOWS if not any(re.search(rf"\b{m}(_bucket)?\b", e) for e in exprs)]
    check(
        not missing,
        f"{DASHBOARD}: sessions, transitions, frames, delivery and Redis latency, errors and up are all shown",
        f"{DASHBOARD}: no panel shows {', '.join(missing)}",
    )
    return records


def check_grafana(tree, compose):
    try:
        with open(tree.path(DASHBOARD), encoding="utf-8") as f:
            dashboard = json.load(f)
    except FileNotFoundError:
        tree.report.fail(f"{DASHBOARD}: missing")
        return
    except json.JSONDecodeError as error:
        tree.report.fail(f"{DASHBOARD}: not valid JSON: {error}")
        return
    tree.report.ok(f"{DASHBOARD}: valid JSON")
    problems = dashboard_problems(dashboard)
    tree.report.check(
        not problems,
        f"{DASHBOARD}: title, uid, schemaVersion {dashboard.get('schemaVersion')}, data source variable",
        f"{DASHBOARD}: " + "; ".join(problems),
    )
    records = check_panels(tree, [p for p in dashboard_panels(dashboard.get("panels")) if p.get("type") != "row"])
    # Recording rules are the one place promtool parses PromQL offline (JSON is YAML).
    with tempfile.TemporaryDirectory() as scratch:
        rules = os.path.join(scratch, "dashboard-rules.yml")
        with open(rules, "w", encoding="utf-8") as f:
            json.dump({"groups": [{"name": "dashboard", "rules": records}]}, f)
        tree.lint(
            DASHBOARD,
            "every expression is valid PromQL (promtool check rules)",
            ["promtool", "check", "rules", rules],
            INSTALL_PROMTOOL,
        )
    check_provisioning(tree, compose)


def check_provisioning(tree, compose):
    """The data source, and the folder Grafana loads dashboards from holding the one compose mounts."""
    prometheus = [d for d in tree.document(DATASOURCES, {}).get("datasources") or [] if d.get("type") == "prometheus"]
    tree.report.check(
        prometheus and str(prometheus[0].get("url", "")).startswith("http://prometheus:9090"),
        f"{DATASOURCES}: Prometheus at http://prometheus:9090",
        f"{DATASOURCES}: needs a prometheus data source at http://prometheus:9090 (found {prometheus})",
    )
    folders = [dig(p, "options", "path") for p in tree.document(PROVIDERS, {}).get("providers") or []]
    if not compose:
        tree.report.skip(f"{PROVIDERS}: docker-compose.yml unreadable; mount path not compared")
        return
    mounts = [str(v).split(":") for v in dig(compose, "services", "grafana", "volumes", default=[]) or []]
    targets = [m[1] for m in mounts if len(m) > 1 and m[0].endswith("dashboard.json")]
    tree.report.check(
        folders and targets and any(t.startswith(str(f).rstrip("/") + "/") for t in targets for f in folders),
        f"{PROVIDERS}: loads the folder compose mounts dashboard.json into",
        f"{PROVIDERS}: provider path {folders} does not hold the dashboard compose mounts at {targets}",
    )
