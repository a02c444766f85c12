# shellcheck shell=bash
# The Redis of scripts/cluster: what its three topologies share, and the simplest of them, one
# standalone redis-server. Sourced by scripts/cluster after common.sh, before sentinel.sh and
# redis-cluster.sh; expects DIR and die.
#
# Each topology MODE (standalone here, sentinel and cluster in the files named after them) gives
# the functions the rest of the script calls as redis_MODE_...; all but status and failover work
# on the values start chooses, and all of them on DIR:
#   plan PORT...     takes what it needs of the free ports start chose (it asks for four more
#                    with Sentinel: the last four) and sets REDIS_URL, or leaves it empty for
#                    start to fill in once the servers run
#   start            starts the servers and waits until they are ready; sets their pids
#   env              its lines of cluster.env
#   headline         its words in start's first line; servers: its lines in start's list of
#                    processes; try: its commands in start's "Try" list
#   status FILE      its lines of `status` (FILE is cluster.env); fails unless all is well
#   failover FILE    `failover`

# Set by start, or read from cluster.env by status and failover; server_label reads them all.
REDIS_PORT=""
REPLICA_PORT=""
CLUSTER_PORTS=()

# replication_field PORT FIELD: FIELD of INFO replication on the Redis at PORT (role,
# master_port, master_link_status, ...); nothing if it does not answer.
replication_field() {
  redis-cli -h 127.0.0.1 -p "$1" info replication 2>/dev/null | tr -d '\r' | sed -n "s/^$2://p"
}

# server_label PORT: redis-1 or redis-2 for this cluster's data servers (REDIS_PORT and
# REPLICA_PORT must be set), redis-cK for the K-th of CLUSTER_PORTS, else 127.0.0.1:PORT.
server_label() {
  local i
  for i in "${!CLUSTER_PORTS[@]}"; do
    [ "$1" = "${CLUSTER_PORTS[i]}" ] && { echo "redis-c$((i + 1))"; return; }
  done
  case $1 in
    "$REDIS_PORT") echo redis-1 ;;
    "$REPLICA_PORT") echo redis-2 ;;
    *) echo "127.0.0.1:$1" ;;
  esac
}

# server_role PID PORT: master or slave, as the redis-server PID on PORT answers; nothing if that
# process is not running (or does not answer).
server_role() {
  if running "$1" redis-server; then replication_field "$2" role; fi
}

# replica_state PORT: the state `status` gives the replica on PORT ("up, replica of redis-1 (link
# up)"); fails unless its link to the primary is up.
replica_state() {
  local link
  link=$(replication_field "$1" master_link_status)
  echo "up, replica of $(server_label "$(replication_field "$1" master_port)") (link $link)"
  [ "$link" = up ]
}

# start_numbered PREFIX "PORT..." START [ARG...]: START PORT DIR/PREFIXK ARG... for the K-th PORT,
# each in a new folder of its own; dies naming the one that did not start. Sets STARTED_PIDS to
# their pids, in order.
start_numbered() {
  local prefix=$1 ports k=0 port
  read -r -a ports <<<"$2"
  shift 2
  STARTED_PIDS=()
  for port in "${ports[@]}"; do
    k=$((k + 1))
    mkdir -p "$DIR/$prefix$k"
    "$1" "$port" "$DIR/$prefix$k" "${@:2}" || die "$prefix$k did not start"
    STARTED_PIDS+=("$(first_pid "$DIR/$prefix$k/redis.pid")")
  done
}

# --- standalone: one redis-server on REDIS_PORT, its AOF in DIR/redis.

redis_standalone_plan() {
  :
}

# Also the primary of the Sentinel topology. AOF only (no RDB snapshots), like the compose service.
redis_standalone_start() {
  redis_start "$REDIS_PORT" "$DIR" --appendonly yes --dir "$DIR/redis" || die "Redis did not start"
  REDIS_PID=$(first_pid "$DIR/redis.pid")
}

redis_standalone_env() {
  echo "REDIS_PORT=$REDIS_PORT"
  echo "REDIS_PID=$REDIS_PID"
}

redis_standalone_headline() {
  :
}

redis_standalone_servers() {
  echo "  redis          $REDIS_URL   pid $REDIS_PID (AOF in $DIR/redis)"
}

redis_standalone_try() {
  :
}

redis_standalone_status() {
  local port pid state=DOWN
  port=$(env_value "$1" REDIS_PORT)
  pid=$(env_value "$1" REDIS_PID)
  if running "$pid" redis-server && redis_answers "$port"; then state=up; fi
  status_line 8 redis "redis://127.0.0.1:$port/0" "$pid" "$state"
  [ "$state" = up ]
}

redis_standalone_failover() {
  die "the cluster in $DIR runs one standalone Redis: failover needs one started with --redis sentinel or --redis cluster"
}
