"""What the gateway accepts and exports: its PRESENCE_* settings, read from its own schema
(`presence-gateway --print-config-schema`), and its metric names, read from the Swift sources.
check_variables() holds every PRESENCE_* name and value of the deployment files against them."""

import glob
import json
import os
import re
import subprocess

# Values the gateway checks only in validate(), in code too involved to read here
# (PresenceConfiguration.validate, PresenceID.isValid): a pattern and what it means. The Redis
# URL's schemes are read from RedisConfiguration.swift (Facts.accept adds them).
FORMATS = {
    "PRESENCE_KEY_PREFIX": (r"[^\s{}]+", "must have no spaces or braces"),
    "PRESENCE_NODE_ID": (
        r"[A-Za-z0-9._:@-]{1,128}",
        "must be 1-128 characters of A-Z a-z 0-9 . _ : @ -",
    ),
}


class Facts:
    """schema: the settings as the binary prints them; variables: {PRESENCE_* name: rule}, empty
    while the schema is unread (check_variables then checks nothing, read_sources having failed
    already); formats: FORMATS plus the Redis URL's; metrics: every series name exported."""

    def __init__(self):
        self.schema = []
        self.variables = {}
        self.formats = dict(FORMATS)
        self.metrics = set()

    def accept(self, rules, schemes):
        self.variables.update(rules)
        self.formats["PRESENCE_REDIS_URL"] = (
            rf"({'|'.join(map(re.escape, schemes))})://.*",
            "must start with " + " or ".join(f"{s}://" for s in schemes),
        )

    def lease_ttl(self):
        """PRESENCE_LEASE_TTL's default in seconds, from the gateway's schema; None if unknown."""
        return next((s.get("default") for s in self.schema if s["name"] == "PRESENCE_LEASE_TTL"), None)


def print_config_schema(binary):
    """The gateway's settings as `presence-gateway --print-config-schema` prints them (a list of
    {name, flag, type, minimum, maximum, choices, default, ...}); None, with the reason, if the
    binary is missing or its answer unreadable."""
    if not os.access(binary, os.X_OK):
        return None, f"{binary} is missing: build it first (swift build --product presence-gateway), or pass --gateway PATH"
    try:
        done = subprocess.run([binary, "--print-config-schema"], capture_output=True, text=True, timeout=60)
        return json.loads(done.stdout)["settings"], None
    except (OSError, subprocess.SubprocessError, ValueError, KeyError) as error:
        return None, f"{binary} --print-config-schema: {error}"


def variable_rules(settings):
    """{name: rule} for each PRESENCE_* setting: a (low, high) range for an integer, the set of
    values for a choice, else None."""
    rules = {}
    for setting in settings:
        if setting["type"] == "integer":
            rules[setting["name"]] = (setting["minimum"], setting["maximum"])
        elif setting["type"] == "choice":
            rules[setting["name"]] = set(setting["choices"])
        else:
            rules[setting["name"]] = None
    return rules


def metric_names(tree):
    """Every metric name a swift-metrics Counter, Gauge, Timer... is created with in Sources/, and
    every LatencyHistogram's (the gateway's own, written beside the registry). The Prometheus
    backend exports timers and recorders as histograms: _bucket, _count and _sum."""
    created = r'\b(Counter|FloatingPointCounter|Gauge|Meter|Timer|Recorder|LatencyHistogram)\(\s*(?:label|name):\s*"([^"]+)"'
    histograms = ("Timer", "Recorder", "LatencyHistogram")
    names = set()
    for path in glob.glob(os.path.join(tree.root, "Sources/**/*.swift"), recursive=True):
        with open(path, encoding="utf-8") as f:
            for kind, name in re.findall(created, f.read()):
                suffixes = ("", "_bucket", "_count", "_sum") if kind in histograms else ("",)
                names |= {name + s for s in suffixes}
    return names


def redis_schemes(tree):
    """The URL schemes RedisConfiguration(url:) accepts: the list its guard checks the scheme
    against, and any `scheme == "..."` comparison."""
    text = tree.read("Sources/RedisClient/RedisConfiguration.swift", default="")
    scheme = r'"([a-z][a-z0-9+.-]*)"'
    listed = re.search(r"\[([^\]]*)\]\.contains\(scheme\)", text)
    schemes = set(re.findall(scheme, listed.group(1))) if listed else set()
    schemes |= set(re.findall(r"scheme == " + scheme, text))
    return sorted(schemes)


def read_sources(tree, binary):
    """Fills tree.facts. Finding none fails loudly: a refactor that breaks the reading must turn
    this script red, not leave it checking nothing."""
    settings, problem = print_config_schema(binary)
    facts = tree.facts
    facts.schema.extend(settings or [])
    rules = variable_rules(settings or [])
    ranges = sum(isinstance(r, tuple) for r in rules.values())
    choices = sum(isinstance(r, set) for r in rules.values())
    schemes = redis_schemes(tree)
    unread = [n for n in ("PRESENCE_REDIS_URL", *FORMATS) if n not in rules]
    if tree.report.check(
        rules and schemes and not unread,
        f"presence-gateway --print-config-schema: {len(rules)} PRESENCE_* settings ({ranges} ranges, {choices} choices;"
        f" Redis URLs {', '.join(s + '://' for s in schemes)})",
        problem or f"presence-gateway --print-config-schema: {len(rules)} settings, Redis URL schemes {schemes}; "
        f"missing {unread}",
    ):
        facts.accept(rules, schemes)
    facts.metrics.update(metric_names(tree))
    tree.report.check(
        facts.metrics,
        f"Sources/: {len(facts.metrics)} metric series names the gateway exports",
        "Sources/: found no Counter/Gauge/Timer(label: ...) to read the metric names from: "
        "update metric_names() in scripts/deploycheck/gateway.py to the new code",
    )


def variable_problems(facts, values):
    """What is wrong with each PRESENCE_* name and value of values ({name: value})."""
    problems = []
    for name, value in values.items():
        if not name.startswith("PRESENCE_"):
            continue
        if name not in facts.variables:
            problems.append(f"{name} is not a gateway variable (known: {', '.join(sorted(facts.variables))})")
            continue
        rule, value = facts.variables[name], str(value)
        if value == "" or "$" in value:
            continue  # empty means unset; ${...} is filled in elsewhere
        if isinstance(rule, tuple):
            if not re.fullmatch(r"\d+", value) or not rule[0] <= int(value) <= rule[1]:
                problems.append(f"{name}={value} must be a whole number from {rule[0]} to {rule[1]}")
        elif isinstance(rule, set):
            if value not in rule:
                problems.append(f"{name}={value} must be one of {', '.join(sorted(rule))}")
        elif name in facts.formats and not re.fullmatch(facts.formats[name][0], value):
            problems.append(f"{name}={value!r} {facts.formats[name][1]}")
    return problems


def check_variables(tree, where, values):
    """Each PRESENCE_* name is one the gateway reads, and each value one it accepts."""
    if not tree.facts.variables:
        return  # read_sources() has failed already
    problems = variable_problems(tree.facts, values)
    tree.report.check(
        not problems,
        f"{where}: PRESENCE_* names and values are ones the gateway accepts",
        f"{where}: " + "; ".join(problems),
    )
