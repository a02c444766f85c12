# shellcheck shell=bash
# HAProxy in front of the nodes of scripts/cluster: its configuration from
# deploy/haproxy.cfg.template, starting it, and reading its stats page (which nodes it has in
# rotation) for `status` and `restart`. Sourced by scripts/cluster after common.sh; expects
# TEMPLATE, DIR, START_TIMEOUT and die, and for haproxy_start the ports start chose (LB_PORT,
# STATS_PORT, NODE_IDS, NODE_PORTS).

# haproxy_start DEADLINE: HAProxy on LB_PORT and STATS_PORT with the nodes as its servers, its
# configuration, pid file and log in DIR; sets HAPROXY_PID. Returns once the load balancer answers
# 200 on /readyz (so at least one node is in rotation) and the stats page on /healthz; dies at
# DEADLINE (in $SECONDS).
haproxy_start() {
  local deadline=$1 servers="" cfg i
  for i in "${!NODE_IDS[@]}"; do
    servers+="    server ${NODE_IDS[i]} 127.0.0.1:${NODE_PORTS[i]}"$'\n'
  done
  cfg=$(<"$TEMPLATE")
  cfg=${cfg//@LB_PORT@/$LB_PORT}
  cfg=${cfg//@STATS_PORT@/$STATS_PORT}
  cfg=${cfg//@SERVERS@/${servers%$'\n'}}
  printf '%s\n' "$cfg" >"$DIR/haproxy.cfg"
  haproxy -c -f "$DIR/haproxy.cfg" >>"$DIR/haproxy.log" 2>&1 || die "the generated $DIR/haproxy.cfg is invalid: $(tail -5 "$DIR/haproxy.log")"
  haproxy -f "$DIR/haproxy.cfg" -D -p "$DIR/haproxy.pid" </dev/null >>"$DIR/haproxy.log" 2>&1 \
    || die "haproxy did not start (is port $LB_PORT or $STATS_PORT taken?): $(tail -5 "$DIR/haproxy.log")"
  HAPROXY_PID=$(first_pid "$DIR/haproxy.pid")
  retry_until "$deadline" 0.2 lb_answers \
    || die "the load balancer on port $LB_PORT did not answer 200 within ${START_TIMEOUT}s: $(tail -5 "$DIR/haproxy.log")"
}

# lb_answers: the load balancer and the stats page answer 200; dies if HAProxy has exited.
lb_answers() {
  [ "$(http_code "http://127.0.0.1:$LB_PORT/readyz")" = 200 ] && [ "$(http_code "http://127.0.0.1:$STATS_PORT/healthz")" = 200 ] \
    && return 0
  running "$HAPROXY_PID" haproxy || die "haproxy exited: $(tail -5 "$DIR/haproxy.log")"
  return 1
}

# server_status STATS_PORT NAME: HAProxy's view of server NAME (UP, DOWN, "UP 1/2", ...), from
# its stats page (CSV: field 18 is the status).
server_status() {
  curl -s --max-time 2 "http://127.0.0.1:$1/stats;csv" 2>/dev/null |
    awk -F, -v name="$2" '$1 == "gateways" && $2 == name { print $18 }'
}

# in_rotation STATS_PORT NAME: HAProxy has server NAME up.
in_rotation() {
  [ "$(server_status "$1" "$2")" = UP ]
}

# lb_status FILE WIDTH: the status line of HAProxy for the cluster whose cluster.env is FILE; fails
# unless it runs, has every node in rotation and answers 200 on /readyz.
lb_status() {
  local file=$1 width=$2 lb_port stats_port haproxy_pid ids i up code state healthy=0
  lb_port=$(env_value "$file" LB_PORT)
  stats_port=$(env_value "$file" STATS_PORT)
  haproxy_pid=$(env_value "$file" HAPROXY_PID)
  read -r -a ids <<<"$(env_value "$file" NODE_IDS)"
  if running "$haproxy_pid" haproxy; then
    up=0
    for i in "${!ids[@]}"; do
      [[ $(server_status "$stats_port" "${ids[i]}") == UP* ]] && up=$((up + 1))
    done
    code=$(http_code "http://127.0.0.1:$lb_port/readyz")
    state="up, $up of ${#ids[@]} nodes in rotation"
    if [ "$code" != 200 ]; then state="$state, /readyz through it: $code"; healthy=1; fi
    [ "$up" = "${#ids[@]}" ] || healthy=1
  else
    state=DOWN
    healthy=1
  fi
  status_line "$width" lb "http://127.0.0.1:$lb_port" "$haproxy_pid" "$state"
  return $healthy
}
