# shellcheck shell=bash
# What scripts/cluster keeps in DIR (README.md beside this file lists it): clearing it before a
# start, writing cluster.env and env, and finding and stopping the processes its pid files name.
# Sourced by scripts/cluster after common.sh and nodes.sh; expects NODE_STOP_TIMEOUT, and for the
# writers DIR and the values start chose (REDIS_MODE, REDIS_URL, LB_PORT, ..., ADMIN_TOKEN).

# redis_mode FILE: the Redis topology of the cluster whose cluster.env is FILE: sentinel, cluster,
# or standalone (also for a file that names none).
redis_mode() {
  case $(env_value "$1" REDIS_MODE) in
    sentinel) echo sentinel ;;
    cluster) echo cluster ;;
    *) echo standalone ;;
  esac
}

# prepare_dir KEEP_DATA: removes what an earlier cluster left in DIR (KEEP_DATA 1: except the AOF in
# DIR/redis), and makes the folder for the AOF unless a Redis Cluster, which keeps none, is to run.
prepare_dir() {
  rm -f "$DIR"/node-*.log "$DIR"/node-*.pid "$DIR"/haproxy.* "$DIR"/redis.pid "$DIR"/redis.log \
    "$DIR"/cluster.env "$DIR"/env "$DIR"/node.env
  rm -rf "$DIR/redis-2" "$DIR"/sentinel-[0-9]* "$DIR"/redis-c[0-9]* "$DIR/cluster-create.log"
  if [ "$REDIS_MODE" != cluster ]; then
    [ "$1" -eq 1 ] || rm -rf "$DIR/redis"
    mkdir -p "$DIR/redis"
  fi
}

# write_cluster_env FILE: the machine-readable state of the cluster, for status, failover,
# restart and the tests; the Redis part as the topology's redis_MODE_env writes it.
write_cluster_env() {
  local file=$1
  {
    echo "# Written by scripts/cluster start. Machine-readable: KEY=value, lists in double quotes."
    echo "DIR=$(q "$DIR")"
    echo "REDIS_MODE=$REDIS_MODE"
    echo "REDIS_URL=$(q "$REDIS_URL")"
    "redis_${REDIS_MODE}_env"
    echo "LB_PORT=$LB_PORT"
    echo "LB_URL=http://127.0.0.1:$LB_PORT"
    echo "STATS_PORT=$STATS_PORT"
    echo "NODE_COUNT=$NODES"
    echo "NODE_IDS=\"${NODE_IDS[*]}\""
    echo "NODE_PORTS=\"${NODE_PORTS[*]}\""
    echo "NODE_PIDS=\"${NODE_PIDS[*]}\""
    echo "HAPROXY_PID=$HAPROXY_PID"
    echo "GATEWAY_BIN=$(q "$GATEWAY_BIN")"
    echo "PRESENCE_JWT_SECRET=$(q "$JWT_SECRET")"
    echo "PRESENCE_ADMIN_TOKEN=$(q "$ADMIN_TOKEN")"
    echo "PRESENCE_KEY_PREFIX=$(q "$KEY_PREFIX")"
  } >"$file.tmp"
  install_private "$file"
}

# write_env FILE: `export` lines that point a shell at the cluster.
write_env() {
  local file=$1
  {
    echo "# . $file"
    echo "# makes scripts/token, presencectl and the curl examples use this cluster."
    [ -n "$JWT_SECRET" ] && echo "export PRESENCE_JWT_SECRET=$(q "$JWT_SECRET")"
    echo "export PRESENCE_ADMIN_TOKEN=$(q "$ADMIN_TOKEN")"
    echo "export PRESENCE_REDIS_URL=$(q "$REDIS_URL")"
    echo "export PRESENCE_KEY_PREFIX=$(q "$KEY_PREFIX")"
    echo "export PRESENCE_LB_URL=http://127.0.0.1:$LB_PORT"
  } >"$file.tmp"
  install_private "$file"
}

# stop_cluster DIR: stops whatever the pid files in DIR name, in the order that keeps the
# sessions' clean shutdown possible: HAProxy (no new connections), the nodes (they close their
# sessions with 1001 and give up their leases, in Redis), then the Sentinels, then Redis (every
# server of a Redis Cluster at once: none is left to fail over another).
# shellcheck disable=SC2046 # pids are numbers, one per word
stop_cluster() {
  local dir=$1
  stop_processes haproxy 5 $(pids_in "$dir/haproxy.pid")
  stop_processes "$(gateway_names "$dir")" "$NODE_STOP_TIMEOUT" $(pids_in "$dir"/node-*.pid)
  # The Sentinels before Redis: with the primary gone and the Sentinels still up, they would
  # promote the replica (and rewrite their configuration) on the way out.
  stop_processes "sentinel|redis-server" 5 $(pids_in "$dir"/sentinel-*/redis.pid)
  # SIGTERM makes redis-server write out its AOF and exit, like SHUTDOWN.
  stop_processes redis-server 10 $(pids_in "$dir/redis.pid" "$dir/redis-2/redis.pid" "$dir"/redis-c*/redis.pid)
  rm -f "$dir/haproxy.pid" "$dir"/node-*.pid "$dir/redis.pid" "$dir/redis-2/redis.pid" \
    "$dir"/sentinel-*/redis.pid "$dir"/redis-c*/redis.pid "$dir/cluster.env" "$dir/node.env"
}

# anything_running DIR: whether a process named by a pid file in DIR is alive.
anything_running() {
  local dir=$1
  any_running haproxy "$dir/haproxy.pid" \
    || any_running redis-server "$dir/redis.pid" "$dir/redis-2/redis.pid" "$dir"/sentinel-*/redis.pid "$dir"/redis-c*/redis.pid \
    || any_running "$(gateway_names "$dir")" "$dir"/node-*.pid
}
