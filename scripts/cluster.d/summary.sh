# shellcheck shell=bash
# What `scripts/cluster start` prints once everything is up. Sourced by scripts/cluster after
# common.sh and the topology files; expects ROOT, DIR and the values start chose (REDIS_MODE,
# NODES, NODE_IDS, NODE_PORTS, NODE_PIDS, LB_PORT, STATS_PORT, HAPROXY_PID, GATEWAY_BIN,
# REDIS_URL, KEY_PREFIX).

# print_summary: every process with its address, pid and log, then commands to try on the cluster.
print_summary() {
  local ctl rel_ctl i lb="http://127.0.0.1:$LB_PORT"
  ctl="$(dirname "$GATEWAY_BIN")/presencectl"
  rel_ctl=${ctl#"$ROOT"/}
  [ -x "$ctl" ] || rel_ctl="swift run presencectl"
  echo "Presence cluster up: $NODES node(s) behind HAProxy$("redis_${REDIS_MODE}_headline"), state in $DIR"
  echo
  echo "  load balancer  $lb   (ws://127.0.0.1:$LB_PORT/api/presence/subscribe)"
  echo "  haproxy stats  http://127.0.0.1:$STATS_PORT/stats   pid $HAPROXY_PID"
  for i in "${!NODE_IDS[@]}"; do
    summary_line "${NODE_IDS[i]}" http://127.0.0.1: "${NODE_PORTS[i]}" "${NODE_PIDS[i]}" "log $DIR/${NODE_IDS[i]}.log"
  done
  "redis_${REDIS_MODE}_servers"
  echo "  env file       $DIR/env   (machine-readable: $DIR/cluster.env)"
  echo
  echo "Try (from $ROOT):"
  echo "  . $DIR/env"
  echo "  curl -H \"Authorization: Bearer \$PRESENCE_ADMIN_TOKEN\" $lb/api/admin/nodes"
  echo "  curl -X PUT -H \"Authorization: Bearer \$PRESENCE_ADMIN_TOKEN\" $lb/api/admin/conversations/demo -d '{\"member_ids\":[\"alice\",\"bob\"]}'"
  echo "  scripts/ws-client \"ws://127.0.0.1:$LB_PORT/api/presence/subscribe?token=\$(scripts/token bob)&device_id=bob-laptop\""
  echo "  curl -X POST -H \"Authorization: Bearer \$(scripts/token alice)\" $lb/api/presence/status -d '{\"status\":\"online\"}'"
  echo "  $rel_ctl nodes --redis-url $REDIS_URL --key-prefix $KEY_PREFIX"
  "redis_${REDIS_MODE}_try"
  echo "  scripts/cluster status --dir $DIR"
  echo "  scripts/cluster stop --dir $DIR"
}
