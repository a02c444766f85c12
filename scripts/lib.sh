# Shared by the scripts that start a throwaway redis-server, Redis Cluster or gateway node: one way
# to pick a port, start and stop Redis, make a cluster, and wait for an HTTP answer or a condition.
# Source it: `. "$(dirname "$0")/lib.sh"`.

# free_port: a free TCP port on 127.0.0.1 (bound by the kernel, then released).
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# retry_until DEADLINE INTERVAL COMMAND...: runs COMMAND every INTERVAL seconds until it succeeds;
# fails once $SECONDS has reached DEADLINE (a point in time, so that several waits can share one).
retry_until() {
  local deadline=$1 interval=$2
  shift 2
  until "$@"; do
    [ $SECONDS -lt "$deadline" ] || return 1
    sleep "$interval"
  done
}

# redis_answers PORT: the redis-server (or Sentinel) on 127.0.0.1:PORT answers PING.
redis_answers() {
  redis-cli -h 127.0.0.1 -p "$1" ping >/dev/null 2>&1
}

# redis_launch NAME PORT LOG ARG...: runs redis-server ARG..., which must daemonize it on
# 127.0.0.1:PORT with LOG as its log file (what it prints while starting goes there too). Returns
# once it answers PING; fails naming it NAME, with the log's tail, if it does not start or does
# not answer within 5 s.
redis_launch() {
  local name=$1 port=$2 log=$3
  shift 3
  redis-server "$@" </dev/null >>"$log" 2>&1 || { echo "$name did not start: $(tail -5 "$log")" >&2; return 1; }
  retry_until $((SECONDS + 5)) 0.05 redis_answers "$port" \
    || { echo "$name on port $port did not answer within 5 s: $(tail -5 "$log")" >&2; return 1; }
}

# redis_start PORT DIR [ARG...]: a daemonized redis-server on 127.0.0.1:PORT, its pid file and log
# in DIR (its data too, unless ARGs say otherwise), with no persistence unless ARGs turn it on.
# Returns once it answers PING; fails with the log's tail after 5 s.
redis_start() {
  local port=$1 dir=$2
  shift 2
  redis_launch redis-server "$port" "$dir/redis.log" --port "$port" --bind 127.0.0.1 --save '' --appendonly no \
    --dir "$dir" --daemonize yes --pidfile "$dir/redis.pid" --logfile "$dir/redis.log" "$@"
}

# redis_stop PORT DIR: stops a server redis_start started, without saving; SIGKILL if it does not
# answer.
redis_stop() {
  local port=$1 dir=$2
  redis-cli -h 127.0.0.1 -p "$port" shutdown nosave >/dev/null 2>&1 \
    || { [ -f "$dir/redis.pid" ] && kill -9 "$(cat "$dir/redis.pid")" 2>/dev/null; } || true
}

# http_code URL: the HTTP status of a GET, or 000 when nothing answers.
http_code() {
  curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$1" 2>/dev/null || true
}

# wait_http URL CODE SECONDS [PID]: returns once URL answers CODE; fails after SECONDS, or at once
# if the process PID has exited.
wait_http() {
  local url=$1 code=$2 deadline=$((SECONDS + $3)) pid=${4:-}
  until [ "$(http_code "$url")" = "$code" ]; do
    if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then return 1; fi
    [ $SECONDS -lt $deadline ] || return 1
    sleep 0.1
  done
}

# free_cluster_ports N [PORT...]: N distinct free TCP ports on 127.0.0.1 whose cluster bus ports
# (port + 10000) are free too, none of them one of the PORTs (all held at once while choosing).
free_cluster_ports() {
  python3 - "$@" <<'PY'
import socket, sys
wanted, avoid = int(sys.argv[1]), {int(p) for p in sys.argv[2:] if p}
held, chosen = [], []
while len(chosen) < wanted and len(held) < 2000:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    held.append(s)
    port = s.getsockname()[1]
    if port > 55535 or port in avoid or port + 10000 in avoid:
        continue
    bus = socket.socket()
    try:
        bus.bind(("127.0.0.1", port + 10000))
    except OSError:
        bus.close()
        continue
    held.append(bus)
    chosen.append(port)
if len(chosen) < wanted:
    sys.exit(f"found only {len(chosen)} of {wanted} free ports with a free cluster bus port")
print(" ".join(map(str, chosen)))
PY
}

# wait_until SECONDS WHAT COMMAND...: runs COMMAND every 100 ms until it succeeds; fails saying
# that WHAT was not reached after SECONDS.
wait_until() {
  local seconds=$1 what=$2
  shift 2
  retry_until $((SECONDS + seconds)) 0.1 "$@" || { echo "$what not reached within $seconds s" >&2; return 1; }
}

# redis_cluster_node_start PORT DIR: redis_start for a Redis Cluster node: cluster mode on, its
# nodes.conf in DIR, and a 2 s node timeout so that a failover takes seconds.
redis_cluster_node_start() {
  redis_start "$1" "$2" --cluster-enabled yes --cluster-config-file "$2/nodes.conf" --cluster-node-timeout 2000
}

# cluster_state_ok PORT...: every node on 127.0.0.1:PORT answers cluster_state:ok.
cluster_state_ok() {
  local port
  for port in "$@"; do
    redis-cli -h 127.0.0.1 -p "$port" cluster info 2>/dev/null | grep -q '^cluster_state:ok' || return 1
  done
}

# replica_links_up PORT...: every server on 127.0.0.1:PORT is a replica whose link is up.
replica_links_up() {
  local port
  for port in "$@"; do
    redis-cli -h 127.0.0.1 -p "$port" info replication 2>/dev/null | grep -q '^master_link_status:up' || return 1
  done
}

# redis_cluster_create SECONDS LOG PORT...: makes one Redis Cluster of the empty cluster nodes on
# 127.0.0.1:PORT... (half primaries, a replica each) with `redis-cli --cluster create`, its
# output in LOG. Waits up to SECONDS for cluster_state:ok on every node, then as long again for
# every replica's link. Sets REDIS_CLUSTER_PRIMARIES and REDIS_CLUSTER_REPLICAS to their ports, in
# the order of PORT..., as ROLE answers (whatever order redis-cli chose).
redis_cluster_create() {
  local seconds=$1 log=$2 port
  shift 2
  # shellcheck disable=SC2046 # one address per word
  redis-cli --cluster create $(printf '127.0.0.1:%s ' "$@") --cluster-replicas 1 --cluster-yes >"$log" 2>&1 \
    || { echo "redis-cli --cluster create failed: $(tail -5 "$log")" >&2; return 1; }
  wait_until "$seconds" "Redis Cluster: cluster_state:ok on every node" cluster_state_ok "$@" || return 1
  REDIS_CLUSTER_PRIMARIES=""
  REDIS_CLUSTER_REPLICAS=""
  for port in "$@"; do
    if [ "$(redis-cli -h 127.0.0.1 -p "$port" role | head -1)" = master ]; then
      REDIS_CLUSTER_PRIMARIES="$REDIS_CLUSTER_PRIMARIES $port"
    else
      REDIS_CLUSTER_REPLICAS="$REDIS_CLUSTER_REPLICAS $port"
    fi
  done
  REDIS_CLUSTER_PRIMARIES=${REDIS_CLUSTER_PRIMARIES# }
  REDIS_CLUSTER_REPLICAS=${REDIS_CLUSTER_REPLICAS# }
  # shellcheck disable=SC2086 # one port per word
  wait_until "$seconds" "Redis Cluster: replica sync (master_link_status:up)" replica_links_up $REDIS_CLUSTER_REPLICAS
}
