# shellcheck shell=bash
# The Redis Cluster topology of scripts/cluster (--redis cluster): redis-c1..c6 on CLUSTER_PORTS,
# each in DIR/redis-cK with no persistence, made one cluster of three primaries with a replica
# each (lib.sh does the making). redis_cluster_plan, _start, _env, _headline, _servers, _try,
# _status and _failover are the topology's functions that redis.sh lists; the others read CLUSTER
# NODES and CLUSTER INFO. Sourced by scripts/cluster after lib.sh, common.sh and redis.sh; expects
# DIR, LB_PORT (for plan), REDIS_SETUP_TIMEOUT, FAILOVER_TIMEOUT and die.

REDIS_CLUSTER_SIZE=6 # redis-c1..c6: 3 primaries and a replica each

# cluster_nodes_line ASK PORT: the line of CLUSTER NODES that the server on 127.0.0.1:ASK gives
# for the one on 127.0.0.1:PORT (id, address, flags, primary id, ..., slots); nothing if ASK does
# not answer or does not know it.
cluster_nodes_line() {
  redis-cli -h 127.0.0.1 -p "$1" cluster nodes 2>/dev/null | tr -d '\r' |
    awk -v address="127.0.0.1:$2" '{ split($2, a, "@") } a[1] == address { print; exit }'
}

# cluster_slots PORT: the slot ranges the server on 127.0.0.1:PORT says it serves ("0-5460").
cluster_slots() {
  cluster_nodes_line "$1" "$1" | cut -d' ' -f9- | sed 's/ /, /g'
}

# cluster_state PORT: cluster_state of CLUSTER INFO on 127.0.0.1:PORT (ok, fail); nothing if it
# does not answer.
cluster_state() {
  redis-cli -h 127.0.0.1 -p "$1" cluster info 2>/dev/null | tr -d '\r' | sed -n 's/^cluster_state://p'
}

# redis_cluster_switched OLD NEW: ROLE says the server on port NEW is a primary and the one on OLD
# its replica, and every server of CLUSTER_PORTS that answers lists NEW as a primary that is not
# failing. Sets SWITCH_WITNESSES to how many servers answered.
redis_cluster_switched() {
  local old=$1 new=$2 port flags
  [ "$(replication_field "$new" role)" = master ] || return 1
  [ "$(replication_field "$old" role)" = slave ] && [ "$(replication_field "$old" master_port)" = "$new" ] || return 1
  SWITCH_WITNESSES=0
  for port in "${CLUSTER_PORTS[@]}"; do
    flags=$(cluster_nodes_line "$port" "$new" | cut -d' ' -f3)
    [ -n "$flags" ] || continue # down, or not answering
    [[ ,$flags, == *,master,* && ,$flags, != *,fail* ]] || return 1
    SWITCH_WITNESSES=$((SWITCH_WITNESSES + 1))
  done
}

# PORT...: ports whose cluster bus port (+10000) is free too, none of them one of the PORTs start
# chose nor LB_PORT; REDIS_PORT stays unused. REDIS_URL is set once the cluster has formed: it
# names the primaries.
redis_cluster_plan() {
  read -r -a CLUSTER_PORTS <<<"$(free_cluster_ports "$REDIS_CLUSTER_SIZE" "$@" "$LB_PORT")"
  [ ${#CLUSTER_PORTS[@]} -eq "$REDIS_CLUSTER_SIZE" ] || die "no $REDIS_CLUSTER_SIZE free ports for the Redis Cluster"
  CLUSTER_PIDS=()
  CLUSTER_PRIMARY_PORTS=()
  # shellcheck disable=SC2034 # server_label (redis.sh) reads it
  REDIS_PORT=""
  REDIS_URL=""
}

# Returns once every server says cluster_state:ok and every replica's link is up. Sets
# CLUSTER_PIDS, CLUSTER_PRIMARY_PORTS and REDIS_URL (the primaries, in redis-cK order).
redis_cluster_start() {
  local port url=redis+cluster://
  start_numbered redis-c "${CLUSTER_PORTS[*]}" redis_cluster_node_start
  CLUSTER_PIDS=("${STARTED_PIDS[@]}")
  redis_cluster_create "$REDIS_SETUP_TIMEOUT" "$DIR/cluster-create.log" "${CLUSTER_PORTS[@]}" \
    || die "the Redis Cluster did not form; see $DIR/cluster-create.log and $DIR/redis-c*/redis.log"
  read -r -a CLUSTER_PRIMARY_PORTS <<<"$REDIS_CLUSTER_PRIMARIES"
  for port in "${CLUSTER_PRIMARY_PORTS[@]}"; do url+="127.0.0.1:$port,"; done
  REDIS_URL=${url%,}
}

# No REDIS_PORT and REDIS_PID: the servers in redis-c1..c6 order, and the primaries at start.
redis_cluster_env() {
  echo "CLUSTER_PORTS=\"${CLUSTER_PORTS[*]}\""
  echo "CLUSTER_PIDS=\"${CLUSTER_PIDS[*]}\""
  echo "CLUSTER_PRIMARY_PORTS=\"${CLUSTER_PRIMARY_PORTS[*]}\""
}

redis_cluster_headline() {
  echo " over a Redis Cluster (${#CLUSTER_PRIMARY_PORTS[@]} primaries, a replica each)"
}

redis_cluster_servers() {
  local i role
  for i in "${!CLUSTER_PORTS[@]}"; do
    if [[ " ${CLUSTER_PRIMARY_PORTS[*]} " == *" ${CLUSTER_PORTS[i]} "* ]]; then
      role="primary, slots $(cluster_slots "${CLUSTER_PORTS[i]}")"
    else
      role="replica of $(server_label "$(replication_field "${CLUSTER_PORTS[i]}" master_port)")"
    fi
    summary_line "redis-c$((i + 1))" 127.0.0.1: "${CLUSTER_PORTS[i]}" "${CLUSTER_PIDS[i]}" "$role; log $DIR/redis-c$((i + 1))/redis.log"
  done
  echo "  nodes use      $REDIS_URL"
}

redis_cluster_try() {
  echo "  redis-cli -p ${CLUSTER_PORTS[0]} cluster nodes"
  echo "  scripts/cluster failover --dir $DIR"
}

# One line per server; fails unless every one is up with cluster_state:ok, each primary serves
# slots and each replica's link is up.
redis_cluster_status() {
  local file=$1 healthy=0 i port pid state cluster pids slots
  read -r -a CLUSTER_PORTS <<<"$(env_value "$file" CLUSTER_PORTS)"
  read -r -a pids <<<"$(env_value "$file" CLUSTER_PIDS)"
  for i in "${!CLUSTER_PORTS[@]}"; do
    port=${CLUSTER_PORTS[i]}
    pid=${pids[i]:-}
    case $(server_role "$pid" "$port") in
      master)
        slots=$(cluster_slots "$port")
        state="up, primary, slots ${slots:-none}"
        [ -n "$slots" ] || healthy=1
        ;;
      slave) state=$(replica_state "$port") || healthy=1 ;;
      *) state=DOWN; healthy=1 ;;
    esac
    if [ "$state" != DOWN ]; then
      cluster=$(cluster_state "$port")
      [ "$cluster" = ok ] || { state="$state, cluster_state ${cluster:-unknown}"; healthy=1; }
    fi
    status_line 8 "redis-c$((i + 1))" "127.0.0.1:$port" "$pid" "$state"
  done
  return $healthy
}

# CLUSTER FAILOVER on the replica of the first primary (in redis-c1..c6 order) that has one with
# its link up; returns once redis_cluster_switched. Prints old -> new, the slots that moved and
# the seconds it took.
redis_cluster_failover() {
  local file=$1 old new="" port reply began now slots
  read -r -a CLUSTER_PORTS <<<"$(env_value "$file" CLUSTER_PORTS)"
  for old in "${CLUSTER_PORTS[@]}"; do
    [ "$(replication_field "$old" role)" = master ] || continue
    for port in "${CLUSTER_PORTS[@]}"; do
      if [ "$(replication_field "$port" master_port)" = "$old" ] && [ "$(replication_field "$port" role)" = slave ] \
        && [ "$(replication_field "$port" master_link_status)" = up ]; then
        new=$port
        break 2
      fi
    done
  done
  [ -n "$new" ] || die "no primary of the Redis Cluster has a replica with its link up (scripts/cluster status --dir $DIR)"
  slots=$(cluster_slots "$old")
  began=${EPOCHREALTIME/,/.}
  reply=$(redis-cli -h 127.0.0.1 -p "$new" cluster failover 2>&1 | tr -d '\r')
  [ "$reply" = OK ] || die "CLUSTER FAILOVER on $(server_label "$new") (127.0.0.1:$new): $reply"
  retry_until $((SECONDS + FAILOVER_TIMEOUT)) 0.02 redis_cluster_switched "$old" "$new" \
    || die "$(server_label "$new") (127.0.0.1:$new) had not taken over from $(server_label "$old") everywhere ${FAILOVER_TIMEOUT}s after CLUSTER FAILOVER; see $DIR/redis-c*/redis.log"
  now=${EPOCHREALTIME/,/.}
  echo "failover: $(server_label "$old") (127.0.0.1:$old) -> $(server_label "$new") (127.0.0.1:$new) in $(seconds_between "$began" "$now") s: slots ${slots:-none}; $(server_label "$old") is its replica; $SWITCH_WITNESSES server(s) list it as a primary"
}
