# Shared by the scripts that start a throwaway redis-server or a gateway node: one way to pick a
# port, start and stop Redis, and wait for an HTTP answer. Source it: `. "$(dirname "$0")/lib.sh"`.

# free_port: a free TCP port on 127.0.0.1 (bound by the kernel, then released).
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# redis_start PORT DIR [ARG...]: a daemonized redis-server on 127.0.0.1:PORT, its pid file and log
# in DIR (its data too, unless ARGs say otherwise), with no persistence unless ARGs turn it on.
# Returns once it answers PING; fails with the log's tail after 5 s.
redis_start() {
  local port=$1 dir=$2
  shift 2
  redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$dir" \
    --daemonize yes --pidfile "$dir/redis.pid" --logfile "$dir/redis.log" "$@" </dev/null >>"$dir/redis.log" 2>&1 \
    || { echo "redis-server did not start: $(tail -5 "$dir/redis.log")" >&2; return 1; }
  local deadline=$((SECONDS + 5))
  until redis-cli -h 127.0.0.1 -p "$port" ping >/dev/null 2>&1; do
    if [ $SECONDS -ge $deadline ]; then
      echo "redis-server on port $port did not answer within 5 s: $(tail -5 "$dir/redis.log")" >&2
      return 1
    fi
    sleep 0.05
  done
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
