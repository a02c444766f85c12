"""docker-compose.yml's profiles "sentinel" and "cluster": the Redis servers each starts, the
configuration file they read, and the URL the file's comments give the gateways for them."""

import os
import re

from .compose import COMPOSE, DEFAULT_SERVICES, mounts, services
from .gateway import check_variables
from .values import command_line, dig

SENTINEL_CONF = "deploy/sentinel/sentinel.conf"
CLUSTER_CONF = "deploy/cluster/redis.conf"


def in_profile(compose, profile):
    """{service: definition} of the services that only that profile starts."""
    return {s: d or {} for s, d in services(compose).items() if profile in ((d or {}).get("profiles") or [])}


def read_conf(tree, name, readers):
    """A Redis configuration file without its comments; None, failing, if it is missing."""
    text = tree.read(name)
    if text is None:
        tree.report.fail(f"{name}: missing (the {readers} read it)")
        return None
    return re.sub(r"#.*", "", text)


def url_in_comments(tree, scheme):
    """The first scheme://... URL in docker-compose.yml's comments (a re match), or None."""
    text = tree.read(COMPOSE, default="")
    comments = "\n".join(l for l in text.splitlines() if l.lstrip().startswith("#"))
    return re.search(re.escape(scheme) + r"://[^\s'\"]+", comments)


def check_url_variables(tree, kind, url):
    if url:
        check_variables(tree, f"{COMPOSE}: the {kind} URL in its comments", {"PRESENCE_REDIS_URL": url.group(0)})


def check_sentinel(tree, compose):
    """The "sentinel" profile: the default `docker compose up` leaves it off; the Sentinels
    monitor the redis service by name with a majority quorum, from a copy of
    deploy/sentinel/sentinel.conf; a replica follows redis; and the URL the file's comments give
    the gateways names those Sentinels and that primary."""
    found = services(compose)
    if not found:
        return
    check = tree.report.check
    wanted = sorted(DEFAULT_SERVICES)
    default = sorted(s for s, d in found.items() if not (d or {}).get("profiles"))
    check(
        default == wanted,
        f"{COMPOSE}: without a profile, `docker compose up` starts {', '.join(wanted)}",
        f"{COMPOSE}: the services without a profile must be {', '.join(wanted)} (found {', '.join(default)})",
    )
    profiled = in_profile(compose, "sentinel")
    sentinels = sorted(s for s in profiled if s.startswith("sentinel"))
    if not profiled:
        return
    conf = read_conf(tree, SENTINEL_CONF, "sentinel profile's Sentinels")
    if conf is None:
        return
    monitor = re.search(r"^\s*sentinel\s+monitor\s+(\S+)\s+(\S+)\s+(\d+)\s+(\d+)\s*$", conf, re.M)
    hostnames = all(
        re.search(rf"^\s*sentinel\s+{o}\s+yes\s*$", conf, re.M) for o in ("resolve-hostnames", "announce-hostnames")
    )
    primary, port, quorum = (monitor.group(2), monitor.group(3), int(monitor.group(4))) if monitor else (None, None, 0)
    majority = len(sentinels) / 2 < quorum <= len(sentinels)
    check(
        monitor and primary in found and port == "6379" and majority and hostnames,
        f"{SENTINEL_CONF}: monitors {primary}:{port} as {monitor and monitor.group(1)}, quorum {quorum} of "
        f"{len(sentinels)}, resolve-hostnames and announce-hostnames yes",
        f"{SENTINEL_CONF}: needs `sentinel monitor NAME <a compose service> 6379 Q` with Q a majority of the "
        f"{len(sentinels)} Sentinels, and `sentinel resolve-hostnames yes` and `sentinel announce-hostnames yes` "
        f"(found monitor {monitor and monitor.group(0).strip()!r}, hostnames {'yes' if hostnames else 'no'})",
    )
    unmounted = [
        s for s in sentinels
        if not mounts(profiled[s], SENTINEL_CONF) or "--sentinel" not in command_line(profiled[s])
    ]
    check(
        len(sentinels) >= 3 and not unmounted,
        f"{COMPOSE}: {', '.join(sentinels)} run {SENTINEL_CONF} with --sentinel",
        f"{COMPOSE}: the sentinel profile needs at least 3 Sentinels, each mounting {SENTINEL_CONF} "
        f"and running --sentinel (found {sentinels}; not so: {unmounted})",
    )
    replicas = [s for s, d in profiled.items() if f"replicaof {primary} {port}" in command_line(d)]
    check(
        replicas,
        f"{COMPOSE}: {', '.join(replicas)} replicates {primary}",
        f"{COMPOSE}: the sentinel profile needs a replica of {primary} (`replicaof {primary} {port}`): "
        "a Sentinel can only promote a replica",
    )
    url = url_in_comments(tree, "redis+sentinel")
    named, hosts = None, []
    if url:
        parts = url.group(0).split("://", 1)[1].split("/")
        hosts = sorted(h.split(":")[0] for h in parts[0].split(","))
        bad_port = [h for h in parts[0].split(",") if ":" in h and h.split(":")[1] != "26379"]
        named = parts[1] if len(parts) > 1 and not bad_port else None
    check(
        url and hosts == sentinels and monitor and named == monitor.group(1),
        f"{COMPOSE}: the gateways' Sentinel URL in its comments names {', '.join(sentinels)} and {named}",
        f"{COMPOSE}: its comments must give the gateways redis+sentinel://<each Sentinel service>/"
        f"{monitor and monitor.group(1)}/0 (found {url and url.group(0)!r})",
    )
    check_url_variables(tree, "Sentinel", url)


def node_timeout_fits(timeout, lease):
    """A replica takes over the node timeout plus an election (up to a second or so) after its
    primary dies; meanwhile the leases on that primary's slots cannot be renewed. Twice the
    timeout (milliseconds), to be safe, must fit in half the lease TTL (seconds)."""
    return timeout.isdigit() and lease is not None and 2 * int(timeout) <= lease * 1000 / 2


def mounted_conf(definition):
    """Where the service mounts deploy/cluster/redis.conf, or None."""
    for volume in definition.get("volumes") or []:
        parts = str(volume).split(":")
        if len(parts) >= 2 and os.path.normpath(parts[0]) == CLUSTER_CONF:
            return parts[1]
    return None


def announced(definition):
    """The hostname the service's node announces: --cluster-announce-hostname's value, with
    $HOSTNAME (written $$HOSTNAME for Compose) being the service's hostname."""
    found = re.search(r"--cluster-announce-hostname[\s=]+[\"']?([^\s\"']+)", command_line(definition))
    value = found.group(1) if found else None
    return definition.get("hostname") if value in ("$$HOSTNAME", "$${HOSTNAME}") else value


def check_cluster(tree, compose):
    """The "cluster" profile: an even number (at least 6) of Redis Cluster nodes running
    deploy/cluster/redis.conf (cluster mode, a node timeout that lets a replica take over well
    within the gateways' lease TTL, hostname endpoints), each announcing its own service name,
    with a healthcheck; a one-shot service that joins exactly those nodes, a replica per primary,
    once they are healthy; and the URL the file's comments give the gateways names some of them."""
    profiled = in_profile(compose, "cluster")
    if not profiled:
        return
    conf = read_conf(tree, CLUSTER_CONF, "cluster profile's Redis nodes")
    if conf is None:
        return
    check = tree.report.check
    settings = dict(re.findall(r"^\s*([\w-]+)\s+(.*?)\s*$", conf, re.M))
    port = settings.get("port", "6379")
    timeout = settings.get("cluster-node-timeout", "15000")  # Redis's default
    lease = tree.facts.lease_ttl()
    check(
        settings.get("cluster-enabled") == "yes" and node_timeout_fits(timeout, lease)
        and settings.get("cluster-preferred-endpoint-type") == "hostname",
        f"{CLUSTER_CONF}: cluster-enabled yes, cluster-node-timeout {timeout} ms (a replica takes over within"
        f" half of PRESENCE_LEASE_TTL's {lease} s), cluster-preferred-endpoint-type hostname",
        f"{CLUSTER_CONF}: needs `cluster-enabled yes`, `cluster-preferred-endpoint-type hostname` (the gateways "
        f"reach the nodes at the names they announce) and a cluster-node-timeout whose double is at most half of "
        f"PRESENCE_LEASE_TTL's default ({lease} s, from the gateway's schema) (found enabled "
        f"{settings.get('cluster-enabled')!r}, timeout {timeout!r}, endpoint type "
        f"{settings.get('cluster-preferred-endpoint-type')!r})",
    )
    nodes = sorted(s for s, d in profiled.items() if mounted_conf(d))
    wrong = [
        f"{s} (command {command_line(profiled[s])!r})"
        for s in nodes
        if mounted_conf(profiled[s]) not in command_line(profiled[s])
        or announced(profiled[s]) != s
        or not dig(profiled[s], "healthcheck", "test")
    ]
    check(
        len(nodes) >= 6 and len(nodes) % 2 == 0 and not wrong,
        f"{COMPOSE}: {', '.join(nodes)} run {CLUSTER_CONF}, each announcing its service name, with a healthcheck",
        f"{COMPOSE}: the cluster profile needs an even number (at least 6: 3 primaries and their replicas) of "
        f"services that mount {CLUSTER_CONF}, run redis-server with it, announce their own service name "
        f"(--cluster-announce-hostname \"$$HOSTNAME\" with hostname: the service's name) and have a "
        f"healthcheck (found {nodes}; not so: {wrong})",
    )
    check_cluster_create(tree, profiled, nodes, port)
    url = url_in_comments(tree, "redis+cluster")
    seeds, database = url.group(0).split("://", 1)[1].partition("/")[::2] if url else ("", "")
    seeds = seeds.split(",") if seeds else []
    check(
        seeds
        and all(h.split(":")[0] in nodes and h.split(":")[1:] in ([], [port]) for h in seeds)
        and database in ("", "0"),
        f"{COMPOSE}: the gateways' cluster URL in its comments names {', '.join(seeds)}",
        f"{COMPOSE}: its comments must give the gateways redis+cluster://<cluster node service>:{port},... naming "
        f"nodes of the cluster profile ({', '.join(nodes)}), with no path but /0 (a cluster has database 0 "
        f"only) (found {url and url.group(0)!r})",
    )
    check_url_variables(tree, "cluster", url)


def check_cluster_create(tree, profiled, nodes, port):
    """The one-shot service that joins the nodes into a cluster."""
    creators = {s: d for s, d in profiled.items() if "--cluster create" in command_line(d)}
    creator = sorted(creators)[0] if creators else None
    command = command_line(creators.get(creator, {}))
    listed = re.search(r"--cluster create((?:\s+[\w.-]+:\d+)+)", command)
    addresses = listed.group(1).split() if listed else []
    joined = sorted(a.split(":")[0] for a in addresses)
    waits = [n for n in nodes if dig(creators.get(creator), "depends_on", n, "condition") == "service_healthy"]
    restart = str(creators.get(creator, {}).get("restart", "no"))
    tree.report.check(
        creator
        and joined == nodes
        and all(a.split(":")[1] == port for a in addresses)
        and re.search(r"--cluster-replicas\s+1\b", command)
        and "--cluster-yes" in command
        and waits == nodes
        and restart in ("no", "on-failure"),
        f"{COMPOSE}: {creator} joins {', '.join(nodes)} with a replica per primary once they are healthy, once",
        f"{COMPOSE}: the cluster profile needs a one-shot service (restart: \"no\") running `redis-cli --cluster "
        f"create <each node>:{port} ... --cluster-replicas 1 --cluster-yes` that depends_on every node with "
        f"condition: service_healthy (found {creator}: joins {joined}, waits for {waits}, restart {restart})",
    )
