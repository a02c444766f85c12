"""docker-compose.yml's default services (redis, the gateways, HAProxy, Prometheus, Grafana),
deploy/env.example, and the Compose schema; the profiles are in profiles.py."""

import os
import re
import shutil
import tempfile

from . import DRAIN_SECONDS, GATEWAYS
from .gateway import check_variables
from .tree import last_lines
from .values import compose_default, dig, env_dict, seconds

COMPOSE = "docker-compose.yml"
# What `docker compose up` starts without a profile.
DEFAULT_SERVICES = ["redis", *GATEWAYS, "lb", "prometheus", "grafana"]


def services(compose):
    return (compose or {}).get("services") or {}


def gateway_services(compose):
    """The compose file's gateway services, or GATEWAYS when it has none to read."""
    return [s for s in services(compose) if s.startswith("gateway")] or GATEWAYS


def mount_sources(definition):
    """The host side of each of a service's short-syntax volumes."""
    return [str(v).split(":")[0] for v in definition.get("volumes") or []]


def mounts(definition, name):
    """Whether the service bind-mounts the repository's file name (./name or name)."""
    return any(source in ("./" + name, name) for source in mount_sources(definition))


def check_compose(tree, image_healthcheck):
    """Returns the compose file's content, for the checks that compare other files with it."""
    report = tree.report
    compose = tree.document(COMPOSE)
    if compose is None:
        report.fail(f"{COMPOSE}: cannot check (missing or not valid YAML)")
        return None
    found = compose.get("services") or {}
    missing = [s for s in DEFAULT_SERVICES if s not in found]
    report.check(
        not missing,
        f"{COMPOSE}: services {', '.join(DEFAULT_SERVICES)}",
        f"{COMPOSE}: missing services {', '.join(missing)}",
    )
    text = tree.read(COMPOSE, default="")
    report.check(
        re.search(r"^x-gateway:\s*&gateway\b", text, re.M) and text.count("<<: *gateway") >= len(GATEWAYS),
        f"{COMPOSE}: gateways share x-gateway (&gateway, <<: *gateway)",
        f"{COMPOSE}: define the gateway once as `x-gateway: &gateway` and merge it with `<<: *gateway` in each gateway service",
    )
    check_redis(tree, compose)
    node_ids = {}
    for service in GATEWAYS:
        if isinstance(found.get(service), dict):
            node_ids[service] = check_gateway(tree, f"{COMPOSE}: {service}", found[service], image_healthcheck)
    ids = [i for i in node_ids.values() if i]
    report.check(
        len(ids) == len(GATEWAYS) and len(set(ids)) == len(ids),
        f"{COMPOSE}: distinct PRESENCE_NODE_ID per gateway ({', '.join(ids)})",
        f"{COMPOSE}: every gateway needs its own PRESENCE_NODE_ID (found {node_ids})",
    )
    check_lb(tree, found.get("lb") or {})
    check_bind_mounts(tree, found)
    check_env_example(tree)
    return compose


def check_redis(tree, compose):
    redis = services(compose).get("redis") or {}
    command = redis.get("command", "")
    tokens = command.split() if isinstance(command, str) else [str(t) for t in command]
    joined = " ".join(t.lstrip("-") for t in tokens)
    tree.report.check(
        re.search(r"\bappendonly yes\b", joined),
        f"{COMPOSE}: redis runs with --appendonly yes",
        f"{COMPOSE}: redis command must include --appendonly yes (found {command!r})",
    )
    volumes = [str(v) for v in redis.get("volumes") or []]
    named = [v.split(":")[0] for v in volumes if ":/data" in v and not v.startswith((".", "/"))]
    tree.report.check(
        named and all(n in (compose.get("volumes") or {}) for n in named),
        f"{COMPOSE}: redis keeps /data in the named volume {', '.join(named)}",
        f"{COMPOSE}: redis needs a named volume on /data, declared under top-level volumes (found {volumes})",
    )
    tree.report.check(
        dig(redis, "healthcheck", "test"),
        f"{COMPOSE}: redis has a healthcheck",
        f"{COMPOSE}: redis needs a healthcheck (the gateways wait for it to be healthy)",
    )


def check_gateway(tree, where, gateway, image_healthcheck):
    """One gateway service; returns its PRESENCE_NODE_ID."""
    check = tree.report.check
    raw = env_dict(gateway.get("environment"))
    env = {k: compose_default(v) for k, v in raw.items()}
    dockerfile = dig(gateway, "build", "dockerfile")
    context = dig(gateway, "build", "context", default=".")
    check(
        dockerfile
        and os.path.normpath(os.path.join(tree.root, context, dockerfile)) == tree.path("deploy/Dockerfile"),
        f"{where}: built from deploy/Dockerfile",
        f"{where}: build must use deploy/Dockerfile with the repository as context (found {gateway.get('build')})",
    )
    check(
        env.get("PRESENCE_HOST") == "0.0.0.0",
        f"{where}: PRESENCE_HOST=0.0.0.0",
        f"{where}: PRESENCE_HOST must be 0.0.0.0 (found {env.get('PRESENCE_HOST')!r}); 127.0.0.1 is unreachable from HAProxy",
    )
    redis_url = env.get("PRESENCE_REDIS_URL", "")
    overrides = re.findall(r"\$\{(\w+)", raw.get("PRESENCE_REDIS_URL", ""))
    check(
        re.match(r"redis://([^@]*@)?redis(:\d+)?(/\d+)?$", redis_url),
        f"{where}: PRESENCE_REDIS_URL points at the redis service"
        + (f" (unless {', '.join(overrides)} is set)" if overrides else ""),
        f"{where}: PRESENCE_REDIS_URL must point at the redis service (found {redis_url!r})",
    )
    env_files = gateway.get("env_file")
    env_files = (
        [env_files] if isinstance(env_files, str) else [dig(e, "path", default=e) for e in env_files or []]
    )
    check(
        ".env" in env_files,
        f"{where}: secrets from env_file .env",
        f"{where}: needs env_file: .env for PRESENCE_JWT_SECRET and PRESENCE_ADMIN_TOKEN (found {env_files})",
    )
    check(
        dig(gateway, "depends_on", "redis", "condition") == "service_healthy",
        f"{where}: waits for redis to be healthy",
        f"{where}: depends_on redis needs condition: service_healthy (found {gateway.get('depends_on')})",
    )
    grace = seconds(gateway.get("stop_grace_period", "10s"))
    check(
        grace is not None and grace > DRAIN_SECONDS + 2,
        f"{where}: stop_grace_period {gateway.get('stop_grace_period')} leaves time to drain",
        f"{where}: stop_grace_period must exceed the {DRAIN_SECONDS} s drain with room to spare (found {gateway.get('stop_grace_period', '10s (default)')})",
    )
    own = dig(gateway, "healthcheck", "test")
    disabled = dig(gateway, "healthcheck", "disable") or (isinstance(own, list) and own[:1] == ["NONE"])
    check(
        not disabled and (own or image_healthcheck),
        f"{where}: has a healthcheck ({'its own' if own else 'the image HEALTHCHECK'})",
        f"{where}: has no healthcheck (neither in the service nor as the image's HEALTHCHECK)",
    )
    check_variables(tree, where, env)
    return env.get("PRESENCE_NODE_ID")


def check_lb(tree, lb):
    check = tree.report.check
    check(
        str(lb.get("image", "")).startswith("haproxy:"),
        f"{COMPOSE}: lb is HAProxy ({lb.get('image')})",
        f"{COMPOSE}: lb must use a haproxy image (found {lb.get('image')!r})",
    )
    check(
        mounts(lb, "deploy/haproxy.cfg"),
        f"{COMPOSE}: lb mounts deploy/haproxy.cfg",
        f"{COMPOSE}: lb must mount ./deploy/haproxy.cfg (found {[str(v) for v in lb.get('volumes') or []]})",
    )
    ports = [str(p) for p in lb.get("ports") or []]
    check(
        any(p.split(":")[-2:-1] == ["8080"] or p == "8080" for p in ports),
        f"{COMPOSE}: lb publishes 8080",
        f"{COMPOSE}: lb must publish port 8080 (found {ports})",
    )


def check_bind_mounts(tree, found):
    """Every bind mount's source must exist, or Docker would create an empty directory in its place."""
    missing = []
    for service, definition in found.items():
        for volume in (definition or {}).get("volumes") or []:
            source = str(volume).split(":")[0] if isinstance(volume, str) else dig(volume, "source", default="")
            if source.startswith((".", "/")) and not os.path.exists(os.path.join(tree.root, source)):
                missing.append(f"{service}: {source}")
    tree.report.check(
        not missing,
        f"{COMPOSE}: every bind-mounted file exists",
        f"{COMPOSE}: bind-mount sources missing: {', '.join(missing)}",
    )


def check_env_example(tree):
    content = tree.read("deploy/env.example")
    if content is None:
        tree.report.fail("deploy/env.example: missing (docker-compose.yml reads .env, copied from it)")
        return
    values = dict(l.split("=", 1) for l in content.splitlines() if re.match(r"^[A-Z_]+=", l))
    tree.report.check(
        "PRESENCE_JWT_SECRET" in values and "PRESENCE_ADMIN_TOKEN" in values and ".env" in content,
        "deploy/env.example: documents PRESENCE_JWT_SECRET and PRESENCE_ADMIN_TOKEN, copied to .env",
        "deploy/env.example: must set PRESENCE_JWT_SECRET and PRESENCE_ADMIN_TOKEN and say to copy it to .env",
    )
    commented = dict(re.findall(r"^#\s*(PRESENCE_[A-Z_]+)=(\S*)", content, re.M))
    check_variables(tree, "deploy/env.example", {**commented, **values})


def check_compose_schema(tree):
    """The Compose Specification's schema (bundled with check-jsonschema); then `docker compose
    config -q` where Docker is installed, in a scratch project folder so that no .env is needed."""
    tree.lint(
        COMPOSE,
        "check-jsonschema: valid for the Compose Specification",
        ["check-jsonschema", "--builtin-schema", "vendor.compose-spec", COMPOSE],
        "pip install check-jsonschema",
    )
    docker = tree.which("docker")
    command = None
    if docker and tree.run([docker, "compose", "version"], timeout=30)[0] == 0:
        command = [docker, "compose"]
    elif tree.which("docker-compose"):
        command = [tree.which("docker-compose")]
    if not command:
        tree.report.skip(f"{COMPOSE}: no `docker compose` plugin or docker-compose; config -q not run")
        return
    with tempfile.TemporaryDirectory() as scratch:
        shutil.copy(tree.path(COMPOSE), scratch)
        os.symlink(tree.path("deploy"), os.path.join(scratch, "deploy"))
        shutil.copy(tree.path("deploy/env.example"), os.path.join(scratch, ".env"))
        code, output = tree.run([*command, "-f", os.path.join(scratch, COMPOSE), "config", "-q"], cwd=scratch)
    label = " ".join(os.path.basename(c) for c in command)
    tree.report.check(
        code == 0,
        f"{COMPOSE}: `{label} config -q` accepts it",
        f"{COMPOSE}: `{label} config -q`: {last_lines(output)}",
    )
