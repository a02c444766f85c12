# shellcheck shell=bash
# The gateway nodes of scripts/cluster: which binary they run, the settings they all share
# (DIR/node.env, so that `restart` starts a node exactly like its siblings), starting one, waiting
# until nodes answer /readyz, and their lines in `status`. Sourced by scripts/cluster after
# common.sh; expects ROOT, DIR, START_TIMEOUT and die, and for write_node_env the values start
# chose (GATEWAY_BIN, REDIS_URL, KEY_PREFIX, JWT_SECRET, ADMIN_TOKEN).

# choose_gateway_bin: sets GATEWAY_BIN to $PRESENCE_GATEWAY_BIN, else the release build if there
# is one, else the debug build; dies if that is not an executable.
choose_gateway_bin() {
  GATEWAY_BIN=${PRESENCE_GATEWAY_BIN:-}
  if [ -z "$GATEWAY_BIN" ]; then
    GATEWAY_BIN="$ROOT/.build/release/presence-gateway"
    [ -x "$GATEWAY_BIN" ] || GATEWAY_BIN="$ROOT/.build/debug/presence-gateway"
  fi
  [ -x "$GATEWAY_BIN" ] || die "no gateway binary at $GATEWAY_BIN: run 'swift build --product presence-gateway' or set PRESENCE_GATEWAY_BIN"
}

# gateway_names DIR: what a node's command line may contain: the file name of the binary the
# cluster in DIR was started with, or presence-gateway (what a wrapper script may exec).
gateway_names() {
  local bin=""
  [ -f "$1/cluster.env" ] && bin=$(env_value "$1/cluster.env" GATEWAY_BIN)
  echo "$(basename "${bin:-presence-gateway}")|presence-gateway"
}

# node_running PID: PID is a node of the cluster in DIR.
node_running() {
  running_as "$(gateway_names "$DIR")" "$1"
}

# write_node_env FILE: what every node runs with: the caller's PRESENCE_* variables, then the
# cluster's own values.
write_node_env() {
  local file=$1 name
  {
    echo "# Written by scripts/cluster start: the settings of every node (restart uses them too)."
    echo "GATEWAY_BIN=$(q "$GATEWAY_BIN")"
    while IFS= read -r name; do
      case $name in
        PRESENCE_HOST | PRESENCE_PORT | PRESENCE_NODE_ID | PRESENCE_REDIS_URL | PRESENCE_KEY_PREFIX | \
          PRESENCE_JWT_SECRET | PRESENCE_ADMIN_TOKEN | PRESENCE_GATEWAY_BIN) ;;
        *) echo "export $name=$(q "${!name}")" ;;
      esac
    done < <(compgen -e | grep '^PRESENCE_' || true)
    echo "export PRESENCE_REDIS_URL=$(q "$REDIS_URL")"
    echo "export PRESENCE_KEY_PREFIX=$(q "$KEY_PREFIX")"
    echo "export PRESENCE_JWT_SECRET=$(q "$JWT_SECRET")"
    echo "export PRESENCE_ADMIN_TOKEN=$(q "$ADMIN_TOKEN")"
  } >"$file.tmp"
  install_private "$file"
}

# spawn_node K PORT: starts node-K on 127.0.0.1:PORT with DIR/node.env, appending to
# DIR/node-K.log, and writes its pid to DIR/node-K.pid.
spawn_node() {
  local k=$1 port=$2
  (
    # Only the recorded settings, so that a restarted node cannot differ from its siblings.
    while IFS= read -r name; do unset "$name"; done < <(compgen -e | grep '^PRESENCE_' || true)
    # shellcheck disable=SC1091
    . "$DIR/node.env"
    export PRESENCE_HOST=127.0.0.1 PRESENCE_PORT="$port" PRESENCE_NODE_ID="node-$k"
    exec nohup "$GATEWAY_BIN" </dev/null >>"$DIR/node-$k.log" 2>&1
  ) &
  echo "$!" >"$DIR/node-$k.pid"
}

# node_ready K:PORT: node-K answers 200 on /readyz. Dies with its last log lines if it has exited:
# it will not become ready by waiting.
node_ready() {
  local k=${1%%:*} port=${1#*:}
  if ! node_running "$(first_pid "$DIR/node-$k.pid")"; then
    echo "--- last lines of $DIR/node-$k.log:" >&2
    tail -n 20 "$DIR/node-$k.log" >&2 || true
    die "node-$k exited during start"
  fi
  [ "$(http_code "http://127.0.0.1:$port/readyz")" = 200 ]
}

# wait_ready DEADLINE K:PORT...: waits until every node-K is ready; dies naming the laggards at
# DEADLINE (in $SECONDS).
wait_ready() {
  local deadline=$1 item names=()
  shift
  poll_each "$deadline" 0.2 node_ready "$@" && return 0
  for item in "${PENDING[@]}"; do
    names+=("node-${item%%:*} (port ${item#*:}, /readyz $(http_code "http://127.0.0.1:${item#*:}/readyz"))")
  done
  die "not ready after ${START_TIMEOUT}s: ${names[*]}; see the logs in $DIR"
}

# node_port K: checks that node-K belongs to the cluster in DIR; prints its port.
node_port() {
  local k=$1 ports
  [ -f "$DIR/cluster.env" ] || die "no cluster in $DIR"
  read -r -a ports <<<"$(env_value "$DIR/cluster.env" NODE_PORTS)"
  if ! [[ $k =~ ^[0-9]+$ ]] || [ "$k" -lt 1 ] || [ "$k" -gt ${#ports[@]} ]; then
    die "no node-$k in $DIR (nodes 1 to ${#ports[@]})"
  fi
  echo "${ports[k - 1]}"
}

# nodes_status FILE WIDTH: a status line for every node of the cluster whose cluster.env is FILE;
# fails unless each one runs and is ready.
nodes_status() {
  local file=$1 width=$2 healthy=0 ids ports pids i code state
  read -r -a ids <<<"$(env_value "$file" NODE_IDS)"
  read -r -a ports <<<"$(env_value "$file" NODE_PORTS)"
  read -r -a pids <<<"$(env_value "$file" NODE_PIDS)"
  for i in "${!ids[@]}"; do
    if node_running "${pids[i]:-}"; then
      code=$(http_code "http://127.0.0.1:${ports[i]}/readyz")
      if [ "$code" = 200 ]; then state=ready; else state="NOT READY (/readyz $code)"; healthy=1; fi
    else
      state=DOWN
      healthy=1
    fi
    status_line "$width" "${ids[i]}" "http://127.0.0.1:${ports[i]}" "${pids[i]:-}" "$state"
  done
  return $healthy
}
