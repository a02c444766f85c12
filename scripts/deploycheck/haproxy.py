"""deploy/haproxy.cfg (compose's load balancer) and deploy/haproxy.cfg.template (scripts/cluster's):
the same balancing, checks and timeouts in both, a server for each gateway, and `haproxy -c`."""

import os
import re
import tempfile

from . import GATEWAY_PORT
from .compose import gateway_services

CONFIG = "deploy/haproxy.cfg"
TEMPLATE = "deploy/haproxy.cfg.template"
PLACEHOLDERS = ["@LB_PORT@", "@SERVERS@", "@STATS_PORT@"]


def haproxy_directives(text):
    """{section header: [directive lines]} with comments and blank lines dropped."""
    sections, current = {}, None
    for line in text.splitlines():
        line = line.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        if not line[0].isspace():
            current = " ".join(line.split())
            sections.setdefault(current, [])
        elif current is not None:
            sections[current].append(" ".join(line.split()))
    return sections


def directives(sections):
    """Every directive line, whatever its section."""
    return [d for lines in sections.values() for d in lines]


def essentials(sections):
    """The settings both configurations must share."""
    everything = directives(sections)

    def first(prefix):
        return next((d for d in everything if d.startswith(prefix)), None)

    return {
        "mode": first("mode "),
        "timeout tunnel": first("timeout tunnel "),
        "timeout client": first("timeout client "),
        "timeout server": first("timeout server "),
        "balance": first("balance "),
        "option httpchk": first("option httpchk"),
        "http-check expect": first("http-check expect"),
        "default-server": " ".join(
            w
            for w in (first("default-server") or "").split()
            if w in ("inter", "fall", "rise") or re.fullmatch(r"\d+m?s?", w)
        )
        or None,
    }


def setting_problems(sections):
    """What each configuration needs, as a list of what is missing; and its essentials."""
    found = essentials(sections)
    problems = []
    if found["mode"] != "mode http":
        problems.append(f"mode http (found {found['mode']})")
    if not found["timeout tunnel"]:
        problems.append("timeout tunnel (WebSockets are cut after timeout client/server without it)")
    if not (found["timeout client"] and found["timeout server"]):
        problems.append("timeout client and timeout server")
    if found["balance"] != "balance leastconn":
        problems.append(f"balance leastconn (found {found['balance']})")
    if found["option httpchk"] not in ("option httpchk GET /readyz",):
        problems.append(f"option httpchk GET /readyz (found {found['option httpchk']})")
    if found["http-check expect"] != "http-check expect status 200":
        problems.append(f"http-check expect status 200 (found {found['http-check expect']})")
    if found["default-server"] != "inter 1s fall 2 rise 2":
        problems.append(f"default-server inter 1s fall 2 rise 2 (found {found['default-server']})")
    everything = directives(sections)
    if not any(d.startswith("stats uri") for d in everything) or not any(
        d.startswith("monitor-uri") for d in everything
    ):
        problems.append("a stats page (stats uri) and a health endpoint (monitor-uri)")
    return problems, found


def check_settings(tree, name, text):
    """Returns the configuration's sections and essentials."""
    sections = haproxy_directives(text)
    problems, found = setting_problems(sections)
    tree.report.check(
        not problems,
        f"{name}: mode http, timeout tunnel, leastconn, /readyz checks, stats",
        f"{name}: needs " + "; ".join(problems),
    )
    return sections, found


def render_template(text, lb_port, stats_port, servers):
    return (
        text.replace("@LB_PORT@", str(lb_port))
        .replace("@STATS_PORT@", str(stats_port))
        .replace("@SERVERS@", "\n".join(f"    server {n} 127.0.0.1:{p}" for n, p in servers))
    )


def check_servers(tree, sections, gateways):
    """A server line for each gateway on its port, and none for anything else."""
    servers = {}
    for d in directives(sections):
        words = d.split()
        if words[0] == "server" and len(words) >= 3:
            servers[words[2].rsplit(":", 1)[0]] = words[2]
    absent = [g for g in gateways if g not in servers]
    wrong_port = [servers[g] for g in gateways if g in servers and not servers[g].endswith(f":{GATEWAY_PORT}")]
    tree.report.check(
        not absent and not wrong_port,
        f"{CONFIG}: a server line for each of {', '.join(gateways)}",
        f"{CONFIG}: "
        + "; ".join(
            ([f"no server line for {', '.join(absent)}"] if absent else [])
            + ([f"{', '.join(wrong_port)} must use port {GATEWAY_PORT}"] if wrong_port else [])
        ),
    )
    extra = [h for h in servers if h not in gateways]
    tree.report.check(
        not extra,
        f"{CONFIG}: every server is a compose service",
        f"{CONFIG}: servers {', '.join(extra)} are not services in docker-compose.yml",
    )
    defaults = " ".join(d for d in directives(sections) if d.startswith("default-server"))
    tree.report.check(
        "init-addr" in defaults and "none" in defaults and "resolvers" in defaults,
        f"{CONFIG}: servers use Docker DNS with init-addr none (HAProxy starts while a node is down)",
        f"{CONFIG}: default-server needs `resolvers` and `init-addr last,libc,none`, or HAProxy "
        "refuses to start while a gateway's name does not resolve",
    )


def check_haproxy(tree, compose):
    text, template = tree.read(CONFIG), tree.read(TEMPLATE)
    for name, content in ((CONFIG, text), (TEMPLATE, template)):
        if content is None:
            tree.report.fail(f"{name}: missing")
            return
    sections, compose_settings = check_settings(tree, CONFIG, text)
    check_servers(tree, sections, gateway_services(compose))
    template_settings = check_settings(tree, TEMPLATE, template)[1]
    differ = [k for k in compose_settings if compose_settings[k] != template_settings[k]]
    tree.report.check(
        not differ,
        f"{TEMPLATE}: same balancing, checks and timeouts as {CONFIG}",
        f"{TEMPLATE}: differs from {CONFIG} in "
        + "; ".join(f"{k}: {template_settings[k]!r} vs {compose_settings[k]!r}" for k in differ),
    )
    placeholders = sorted(set(re.findall(r"@[A-Z_]+@", template)))
    tree.report.check(
        placeholders == PLACEHOLDERS,
        f"{TEMPLATE}: placeholders @LB_PORT@ @STATS_PORT@ @SERVERS@",
        f"{TEMPLATE}: expected the placeholders @LB_PORT@ @STATS_PORT@ @SERVERS@ (scripts/cluster fills them), found {placeholders}",
    )
    with tempfile.TemporaryDirectory() as scratch:
        rendered = os.path.join(scratch, "haproxy.cfg")
        with open(rendered, "w", encoding="utf-8") as f:
            f.write(render_template(template, 18080, 18404, [(f"node-{i}", 18080 + i) for i in (1, 2, 3)]))
        tree.lint(
            TEMPLATE,
            "rendered for 3 loopback nodes, `haproxy -c` accepts it",
            ["haproxy", "-c", "-f", rendered],
            "apt-get install haproxy",
        )
    # The compose names resolve only inside compose; init-addr none lets haproxy -c check the rest.
    tree.lint(CONFIG, "`haproxy -c` accepts it", ["haproxy", "-c", "-f", CONFIG], "apt-get install haproxy")


def check_scripts(tree):
    """scripts/cluster, which fills the template's placeholders, must be there to run."""
    path = tree.path("scripts/cluster")
    tree.report.check(
        os.path.isfile(path) and os.access(path, os.X_OK),
        "scripts/cluster: present and executable",
        "scripts/cluster: missing or not executable",
    )
