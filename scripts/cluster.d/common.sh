# shellcheck shell=bash
# Small helpers every part of scripts/cluster uses: telling our own processes from strangers by
# their pid files, stopping them, reading and writing the KEY=value files in DIR, quoting, free
# ports, waiting for several things at once, and the shape of the lines start and status print.
# Sourced by scripts/cluster first after scripts/lib.sh; functions only, needing nothing else.

# running PID NAME...: PID is a live (not zombie) process whose command line mentions one of the
# NAMEs. Checked before every signal, so a stale pid file never makes us signal an unrelated
# process.
running() {
  local pid=$1 stat args name
  shift
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  stat=$(ps -o stat= -p "$pid" 2>/dev/null) || return 1
  [[ $stat == Z* ]] && return 1
  args=$(ps -o args= -p "$pid" 2>/dev/null) || return 1
  for name in "$@"; do
    [[ $args == *"$name"* ]] && return 0
  done
  return 1
}

# running_as NAME[|NAME...] PID: running, with the NAMEs in one word as stop_processes takes them.
running_as() {
  local names
  IFS='|' read -r -a names <<<"$1"
  running "$2" "${names[@]}"
}

# pids_in FILE...: the pids listed in pid files (nothing for a file that does not exist).
pids_in() {
  local f
  for f in "$@"; do
    if [ -f "$f" ]; then tr -s '[:space:]' '\n' <"$f" | grep -E '^[0-9]+$' || true; fi
  done
}

# first_pid FILE: the first pid of a pid file, which names one process.
first_pid() {
  pids_in "$1" | head -1
}

# any_running NAME[|NAME...] FILE...: whether a process named by one of the pid files is alive.
any_running() {
  local name=$1 pid
  shift
  for pid in $(pids_in "$@"); do running_as "$name" "$pid" && return 0; done
  return 1
}

# stop_processes NAME[|NAME...] TIMEOUT PID...: SIGTERM, then SIGKILL for whatever is left after
# TIMEOUT seconds. Prints how each one ended.
stop_processes() {
  local name=$1 timeout=$2 pid deadline left names
  IFS='|' read -r -a names <<<"$name"
  shift 2
  local pids=()
  for pid in "$@"; do
    if running "$pid" "${names[@]}"; then
      kill -TERM "$pid" 2>/dev/null && pids+=("$pid")
    fi
  done
  [ ${#pids[@]} -eq 0 ] && return 0
  deadline=$((SECONDS + timeout))
  while :; do
    left=()
    for pid in "${pids[@]}"; do running "$pid" "${names[@]}" && left+=("$pid"); done
    [ ${#left[@]} -eq 0 ] && break
    if [ $SECONDS -ge $deadline ]; then
      echo "  ${names[0]}: ${left[*]} still running after ${timeout}s, sending SIGKILL"
      kill -KILL "${left[@]}" 2>/dev/null || true
      sleep 0.2
      break
    fi
    sleep 0.1
  done
  echo "  stopped ${names[0]} (pid ${pids[*]})"
}

# env_value FILE KEY: KEY's value in a cluster.env file, without surrounding double quotes.
env_value() {
  sed -n "s/^$2=//p" "$1" 2>/dev/null | head -1 | sed 's/^"\(.*\)"$/\1/'
}

# set_env_line FILE KEY VALUE: replaces the KEY= line of a cluster.env file.
set_env_line() {
  awk -v key="$2" -v value="$3" 'index($0, key "=") == 1 { print key "=" value; next } { print }' "$1" >"$1.tmp"
  install_private "$1"
}

# install_private FILE: moves FILE.tmp, just written, to FILE, readable by its owner only (the
# files in DIR hold the secrets). Whoever reads FILE sees the old one or the new one, never half.
install_private() {
  chmod 600 "$1.tmp"
  mv "$1.tmp" "$1"
}

# q VALUE: VALUE quoted for the shell only when it needs it, so plain values stay plain.
q() {
  if [[ $1 =~ ^[A-Za-z0-9_./:@+=,-]*$ ]]; then printf '%s' "$1"; else printf '%q' "$1"; fi
}

random_hex() {
  python3 -c "import secrets; print(secrets.token_hex($1))"
}

# free_ports N: N distinct free TCP ports on 127.0.0.1 (all held at once while choosing).
free_ports() {
  python3 - "$1" <<'PY'
import socket, sys
held = []
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    held.append(s)
print(" ".join(str(s.getsockname()[1]) for s in held))
PY
}

# poll_each DEADLINE INTERVAL CHECK ITEM...: runs CHECK ITEM for every ITEM that has not yet passed,
# every INTERVAL seconds, until each one has passed once (a check may also die, when waiting on is
# pointless). Fails once $SECONDS has reached DEADLINE, leaving the ITEMs still failing in PENDING
# for the caller's message.
poll_each() {
  local deadline=$1 interval=$2 check=$3 item still
  shift 3
  PENDING=("$@")
  while [ ${#PENDING[@]} -gt 0 ]; do
    still=()
    for item in "${PENDING[@]}"; do
      "$check" "$item" || still+=("$item")
    done
    PENDING=("${still[@]+"${still[@]}"}")
    [ ${#PENDING[@]} -eq 0 ] && break
    [ $SECONDS -lt "$deadline" ] || return 1
    sleep "$interval"
  done
}

# seconds_between TIME TIME: the seconds from one $EPOCHREALTIME to a later one, as 1.23.
seconds_between() {
  awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'
}

# status_line WIDTH NAME ADDRESS PID STATE: one line of `status`, "-" for a missing pid.
status_line() {
  printf "%-${1}s %-28s pid %-7s %s\n" "$2" "$3" "${4:--}" "$5"
}

# summary_line NAME ADDRESS PORT PID NOTE: one process in what `start` prints, ADDRESS ending
# in "127.0.0.1:" so that the ports line up.
summary_line() {
  printf '  %-13s  %s%-5s  pid %-7s %s\n' "$1" "$2" "$3" "$4" "$5"
}
