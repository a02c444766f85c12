# shellcheck shell=bash
# The Sentinel topology of scripts/cluster (--redis sentinel): redis-1, the primary, on REDIS_PORT
# (started like the standalone server); redis-2, its replica, on REPLICA_PORT; and sentinel-1..3
# monitoring them as SENTINEL_NAME. redis_sentinel_plan, _start, _env, _headline, _servers, _try,
# _status and _failover are the topology's functions that redis.sh lists; the others ask a
# Sentinel what it thinks. Sourced by scripts/cluster after lib.sh, common.sh and redis.sh;
# expects DIR, REDIS_SETUP_TIMEOUT, FAILOVER_TIMEOUT and die.

SENTINEL_NAME=presence-primary
SENTINEL_QUORUM=2
SENTINEL_DOWN_AFTER_MS=1000
SENTINEL_FAILOVER_TIMEOUT_MS=3000

# sentinel_start PORT DIR PRIMARY_PORT: a daemonized Sentinel on 127.0.0.1:PORT monitoring the
# primary on PRIMARY_PORT as $SENTINEL_NAME, with its configuration file (which it rewrites with
# what it learns), pid file and log in DIR. Returns once it answers PING; fails with the log's
# tail after 5 s. redis_start (lib.sh) cannot start one: a Sentinel's configuration file must
# come first on redis-server's command line.
sentinel_start() {
  local port=$1 dir=$2 primary_port=$3
  cat >"$dir/sentinel.conf" <<EOF
# Written by scripts/cluster start; the Sentinel rewrites it.
port $port
bind 127.0.0.1
daemonize yes
pidfile "$dir/redis.pid"
logfile "$dir/redis.log"
dir "$dir"
sentinel monitor $SENTINEL_NAME 127.0.0.1 $primary_port $SENTINEL_QUORUM
sentinel down-after-milliseconds $SENTINEL_NAME $SENTINEL_DOWN_AFTER_MS
sentinel failover-timeout $SENTINEL_NAME $SENTINEL_FAILOVER_TIMEOUT_MS
sentinel parallel-syncs $SENTINEL_NAME 1
EOF
  redis_launch "the Sentinel" "$port" "$dir/redis.log" "$dir/sentinel.conf" --sentinel
}

# sentinel_primary PORT: HOST:PORT of the primary the Sentinel at PORT names; nothing if it does
# not answer or names none.
sentinel_primary() {
  local answer
  answer=$(redis-cli -h 127.0.0.1 -p "$1" sentinel get-master-addr-by-name "$SENTINEL_NAME" 2>/dev/null |
    tr -d '\r' | paste -sd: -) || true
  if [[ $answer =~ ^[^:]+:[0-9]+$ ]]; then echo "$answer"; fi
}

# sentinel_field PORT FIELD: FIELD of SENTINEL MASTER (num-slaves, num-other-sentinels, flags, ...)
# on the Sentinel at PORT; nothing if it does not answer.
sentinel_field() {
  redis-cli -h 127.0.0.1 -p "$1" sentinel master "$SENTINEL_NAME" 2>/dev/null | tr -d '\r' |
    awk -v field="$2" 'previous == field { print; exit } { previous = $0 }'
}

# sentinel_quorum PORT: the Sentinel's answer to SENTINEL CKQUORUM (starts with OK when a
# failover can be authorized).
sentinel_quorum() {
  redis-cli -h 127.0.0.1 -p "$1" sentinel ckquorum "$SENTINEL_NAME" 2>&1 | tr -d '\r' | head -1
}

# sentinel_ready PORT: the Sentinel can authorize a failover and knows the replica (a failover
# needs one).
sentinel_ready() {
  [[ $(sentinel_quorum "$1") == OK* ]] && [ "$(sentinel_field "$1" num-slaves)" = 1 ]
}

# sentinels_switched OLD PORT...: the Sentinel on the first PORT names a primary other than OLD
# (HOST:PORT), that server says it is the primary, and the Sentinels on the other PORTs name it
# too. Sets NEW_PRIMARY to it.
sentinels_switched() {
  local old=$1 port
  shift
  NEW_PRIMARY=$(sentinel_primary "$1")
  [ -n "$NEW_PRIMARY" ] && [ "$NEW_PRIMARY" != "$old" ] || return 1
  [ "$(replication_field "${NEW_PRIMARY##*:}" role)" = master ] || return 1
  for port in "${@:2}"; do
    [ "$(sentinel_primary "$port")" = "$NEW_PRIMARY" ] || return 1
  done
}

# PORT...: the replica's port and the Sentinels' are the last four.
redis_sentinel_plan() {
  local ports=("$@")
  REPLICA_PORT=${ports[-4]}
  SENTINEL_PORTS=("${ports[@]: -3}")
  REPLICA_PID=""
  SENTINEL_PIDS=()
  REDIS_URL="redis+sentinel://127.0.0.1:${SENTINEL_PORTS[0]},127.0.0.1:${SENTINEL_PORTS[1]},127.0.0.1:${SENTINEL_PORTS[2]}/$SENTINEL_NAME/0"
}

# The primary, then its replica, then the Sentinels; returns once the replica has synced and every
# Sentinel can authorize a failover and knows the replica, or dies naming what is missing after
# REDIS_SETUP_TIMEOUT seconds.
redis_sentinel_start() {
  redis_standalone_start
  local deadline=$((SECONDS + REDIS_SETUP_TIMEOUT)) link port why=()
  mkdir -p "$DIR/redis-2"
  redis_start "$REPLICA_PORT" "$DIR/redis-2" --appendonly yes --replicaof 127.0.0.1 "$REDIS_PORT" \
    || die "the replica (redis-2) did not start"
  REPLICA_PID=$(first_pid "$DIR/redis-2/redis.pid")
  # Synced before the Sentinels start, so that the first INFO they get from the primary lists it.
  if ! retry_until "$deadline" 0.1 replica_links_up "$REPLICA_PORT"; then
    link=$(replication_field "$REPLICA_PORT" master_link_status)
    die "redis-2 did not sync with the primary within ${REDIS_SETUP_TIMEOUT}s (master_link_status ${link:-unknown}): $(tail -3 "$DIR/redis-2/redis.log")"
  fi
  start_numbered sentinel- "${SENTINEL_PORTS[*]}" sentinel_start "$REDIS_PORT"
  SENTINEL_PIDS=("${STARTED_PIDS[@]}")
  # The Sentinels find each other through the primary's hello channel (every 2 s).
  poll_each "$deadline" 0.2 sentinel_ready "${SENTINEL_PORTS[@]}" && return 0
  for port in "${PENDING[@]}"; do
    why+=("port $port: CKQUORUM '$(sentinel_quorum "$port")', $(sentinel_field "$port" num-slaves) replica(s) known")
  done
  die "the Sentinels did not agree within ${REDIS_SETUP_TIMEOUT}s ($(IFS=';' && echo "${why[*]}")); see $DIR/sentinel-*/redis.log"
}

# REDIS_PORT is the server started as the primary: ask the Sentinels which one is now.
redis_sentinel_env() {
  redis_standalone_env
  echo "REPLICA_PORT=$REPLICA_PORT"
  echo "REPLICA_PID=$REPLICA_PID"
  echo "SENTINEL_NAME=$SENTINEL_NAME"
  echo "SENTINEL_PORTS=\"${SENTINEL_PORTS[*]}\""
  echo "SENTINEL_PIDS=\"${SENTINEL_PIDS[*]}\""
}

redis_sentinel_headline() {
  echo " over Redis with Sentinel"
}

redis_sentinel_servers() {
  local i
  echo "  redis-1        redis://127.0.0.1:$REDIS_PORT/0   pid $REDIS_PID (the primary; AOF in $DIR/redis)"
  echo "  redis-2        redis://127.0.0.1:$REPLICA_PORT/0   pid $REPLICA_PID (its replica; AOF in $DIR/redis-2)"
  for i in "${!SENTINEL_PORTS[@]}"; do
    summary_line "sentinel-$((i + 1))" 127.0.0.1: "${SENTINEL_PORTS[i]}" "${SENTINEL_PIDS[i]}" "log $DIR/sentinel-$((i + 1))/redis.log"
  done
  echo "  nodes use      $REDIS_URL"
}

redis_sentinel_try() {
  echo "  redis-cli -p ${SENTINEL_PORTS[0]} sentinel get-master-addr-by-name $SENTINEL_NAME"
  echo "  scripts/cluster failover --dir $DIR"
}

# Fails unless the server the Sentinels name is the primary, the other its replica with its link
# up, and every Sentinel names that one and can authorize a failover.
redis_sentinel_status() {
  local file=$1 healthy=0 port pid i state chosen="" named quorum pids sentinel_ports sentinel_pids
  REDIS_PORT=$(env_value "$file" REDIS_PORT)
  REPLICA_PORT=$(env_value "$file" REPLICA_PORT)
  local ports=("$REDIS_PORT" "$REPLICA_PORT")
  pids=("$(env_value "$file" REDIS_PID)" "$(env_value "$file" REPLICA_PID)")
  read -r -a sentinel_ports <<<"$(env_value "$file" SENTINEL_PORTS)"
  read -r -a sentinel_pids <<<"$(env_value "$file" SENTINEL_PIDS)"
  # The primary as the first Sentinel that answers names it.
  for port in "${sentinel_ports[@]}"; do
    chosen=$(sentinel_primary "$port")
    [ -n "$chosen" ] && break
  done
  chosen=${chosen##*:}
  for i in 0 1; do
    port=${ports[i]}
    pid=${pids[i]}
    case $(server_role "$pid" "$port") in
      master)
        state="up, primary"
        if [ "$port" != "$chosen" ]; then
          # After a failover the Sentinels wait ~10 s before they make the old primary a replica.
          state="up, still a primary (the Sentinels name $(server_label "$chosen"); they demote it within ~10 s)"
          healthy=1
        fi
        ;;
      slave) state=$(replica_state "$port") || healthy=1 ;;
      *) state=DOWN; healthy=1 ;;
    esac
    status_line 10 "redis-$((i + 1))" "redis://127.0.0.1:$port/0" "$pid" "$state"
  done
  for i in "${!sentinel_ports[@]}"; do
    port=${sentinel_ports[i]}
    pid=${sentinel_pids[i]:-}
    named=""
    running "$pid" redis-server && named=$(sentinel_primary "$port")
    if [ -z "$named" ]; then
      state=DOWN
      running "$pid" redis-server && state="up, names no primary"
      healthy=1
    else
      state="up, primary $(server_label "${named##*:}")"
      if [ "$(replication_field "${named##*:}" role)" != master ]; then
        state="$state (not a primary now)"
        healthy=1
      elif [ "${named##*:}" != "$chosen" ]; then
        state="$state (the others name $(server_label "$chosen"))"
        healthy=1
      fi
      quorum=$(sentinel_quorum "$port")
      if [[ $quorum == OK* ]]; then state="$state, quorum OK"; else state="$state, $quorum"; healthy=1; fi
    fi
    status_line 10 "sentinel-$((i + 1))" "127.0.0.1:$port" "$pid" "$state"
  done
  return $healthy
}

# SENTINEL FAILOVER, then waits until every Sentinel that answers names the other server and that
# server says it is the primary. Prints old -> new and the seconds it took.
redis_sentinel_failover() {
  local file=$1 sentinels live=() port old reply began now
  REDIS_PORT=$(env_value "$file" REDIS_PORT)
  REPLICA_PORT=$(env_value "$file" REPLICA_PORT)
  read -r -a sentinels <<<"$(env_value "$file" SENTINEL_PORTS)"
  for port in "${sentinels[@]}"; do
    redis_answers "$port" && live+=("$port")
  done
  [ ${#live[@]} -gt 0 ] || die "no Sentinel answers (ports ${sentinels[*]})"
  old=$(sentinel_primary "${live[0]}")
  [ -n "$old" ] || die "the Sentinel on port ${live[0]} names no primary $SENTINEL_NAME"
  began=${EPOCHREALTIME/,/.}
  reply=$(redis-cli -h 127.0.0.1 -p "${live[0]}" sentinel failover "$SENTINEL_NAME" 2>&1 | tr -d '\r')
  # NOGOODSLAVE: no synced replica yet (just after a failover, the demoted server is still
  # resyncing); INPROG: one is under way.
  [ "$reply" = OK ] || die "SENTINEL FAILOVER $SENTINEL_NAME: $reply (scripts/cluster status --dir $DIR shows the replica's link)"
  retry_until $((SECONDS + FAILOVER_TIMEOUT)) 0.05 sentinels_switched "$old" "${live[@]}" \
    || die "the Sentinels still name $(server_label "${old##*:}") ($old) ${FAILOVER_TIMEOUT}s after SENTINEL FAILOVER; see $DIR/sentinel-*/redis.log"
  now=${EPOCHREALTIME/,/.}
  echo "failover: $(server_label "${old##*:}") ($old) -> $(server_label "${NEW_PRIMARY##*:}") ($NEW_PRIMARY) in $(seconds_between "$began" "$now") s (${#live[@]} Sentinel(s) name it)"
  if [ "$(replication_field "${old##*:}" role)" = master ]; then
    echo "$(server_label "${old##*:}") still answers as a primary; the Sentinels make it a replica within about 10 s (scripts/cluster status --dir $DIR)"
  fi
}
