#!/usr/bin/env bash
# Broker clusters on loopback for the cluster tests (issue 18, docs/scaling.md):
#   NATS      3 nodes, JetStream clustered      clients 4241-4243, routes 6241-6243, monitor 8241-8243
#   RabbitMQ  3 nodes (outbox1..3@localhost)    AMQP 5681-5683, distribution 25681-25683
#   Redis     Cluster of 3 masters + 3 replicas 7001-7006
#
# Usage: .ci/clusters.sh up [nats|rabbitmq|redis]...   start what is not running (idempotent)
#        .ci/clusters.sh stop KIND N                   kill node N (1-based) at once (SIGKILL)
#        .ci/clusters.sh start KIND N                  start node N again (its data is kept)
#        .ci/clusters.sh leader rabbitmq QUEUE         print the node number of a quorum queue's leader
#        .ci/clusters.sh leader redis KEY              print the node number of the primary of KEY's slot
#        .ci/clusters.sh info redis N                  print node N's replication section
#        .ci/clusters.sh urls                          print the seed URLs (one export per kind)
#        .ci/clusters.sh down                          stop every node and delete the data
# Runs as root; each node's data and log live under $OUTBOX_CLUSTERS_DIR
# (default /var/lib/outbox-clusters). The tests call stop/start through OUTBOX_TEST_CLUSTERS.
set -euo pipefail

BASE="${OUTBOX_CLUSTERS_DIR:-/var/lib/outbox-clusters}"
RABBIT_BIN=/usr/lib/rabbitmq/bin

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
poll() { # seconds error command...: run the command every 0.1 s until it succeeds; after
  # `seconds`, print the error and fail
  local seconds=$1 error=$2 i
  shift 2
  for ((i = 0; i < seconds * 10; i++)); do
    if "$@"; then return 0; fi
    sleep 0.1
  done
  echo "error: $error" >&2
  return 1
}
wait_port() { # what port seconds
  poll "$3" "$1 is not listening on 127.0.0.1:$2 after $3 s (log under $BASE)" port_open "$2"
}
alive() { # pidfile: is the process it names running?
  [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}
fresh_if_all_dead() { # kind count: after a machine restart no node of KIND is alive and its
  # data are stale (a clustered node may wait for peers that never come): start a new cluster.
  local n
  for ((n = 1; n <= $2; n++)); do alive "$BASE/$1-$n/pid" && return 0; done
  for ((n = 1; n <= $2; n++)); do rm -rf "${BASE:?}/$1-$n"; done
}
node_stop() { # kind n: kill node n of KIND at once
  kill_pidfile "$BASE/$1-$2/pid"
}
kill_pidfile() {
  local pid
  [ -f "$1" ] || return 0
  pid="$(cat "$1")"
  kill -9 "$pid" 2>/dev/null || true
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  rm -f "$1"
}

# ---- NATS -------------------------------------------------------------------------------------
nats_start() {
  local n=$1 dir="$BASE/nats-$1"
  port_open "424$n" && return 0
  mkdir -p "$dir"
  setsid nohup nats-server -a 127.0.0.1 -p "424$n" -n "nats-$n" -js -sd "$dir/store" \
    --cluster_name outbox --cluster "nats://127.0.0.1:624$n" \
    --routes nats://127.0.0.1:6241,nats://127.0.0.1:6242,nats://127.0.0.1:6243 \
    -m "824$n" -P "$dir/pid" -l "$dir/log" </dev/null >/dev/null 2>&1 &
  wait_port "NATS node $n" "424$n" 20
}
jetstream_leader() { # JetStream is ready once the meta group has a leader: /jsz on any node names it
  curl -fsS "http://127.0.0.1:8241/jsz" 2>/dev/null | grep -q '"leader"'
}
nats_up() {
  local n
  fresh_if_all_dead nats 3
  for n in 1 2 3; do nats_start "$n"; done
  poll 30 "the NATS cluster elected no JetStream meta leader within 30 s" jetstream_leader
}

# ---- RabbitMQ ---------------------------------------------------------------------------------
rabbit_env() { # n: the environment of node n
  local n=$1 dir="$BASE/rabbitmq-$1"
  echo HOME="$BASE/rabbitmq-home" RABBITMQ_NODENAME="outbox$n@localhost" \
    RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 RABBITMQ_NODE_PORT="568$n" RABBITMQ_DIST_PORT="2568$n" \
    RABBITMQ_MNESIA_BASE="$dir/mnesia" RABBITMQ_LOG_BASE="$dir/log" \
    RABBITMQ_PID_FILE="$dir/pid" RABBITMQ_ENABLED_PLUGINS_FILE="$BASE/rabbitmq-home/enabled_plugins" \
    RABBITMQ_CONFIG_FILE="$BASE/rabbitmq-home/rabbitmq" RABBITMQ_ADVANCED_CONFIG_FILE="$BASE/rabbitmq-home/advanced.config"
}
rabbitctl() { # n args...: rabbitmqctl against node n
  local n=$1
  shift
  env HOME="$BASE/rabbitmq-home" "$RABBIT_BIN/rabbitmqctl" -n "outbox$n@localhost" "$@"
}
rabbit_alive() { alive "$BASE/rabbitmq-$1/pid"; } # n: node n's VM runs (booting or up)
rabbit_launch() { # n: start node n in the background, not waiting for it
  local n=$1 dir="$BASE/rabbitmq-$1"
  port_open "568$n" && return 0
  rabbit_alive "$n" && return 0
  mkdir -p "$dir/mnesia" "$dir/log" "$BASE/rabbitmq-home"
  chmod 700 "$BASE/rabbitmq-home"
  if [ ! -f "$BASE/rabbitmq-home/.erlang.cookie" ]; then
    head -c 20 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$BASE/rabbitmq-home/.erlang.cookie"
    chmod 400 "$BASE/rabbitmq-home/.erlang.cookie"
  fi
  echo '[].' >"$BASE/rabbitmq-home/enabled_plugins"
  # Guests may connect over loopback only, which is all we use.
  echo 'loopback_users = none' >"$BASE/rabbitmq-home/rabbitmq.conf"
  echo '[].' >"$BASE/rabbitmq-home/advanced.config"
  # shellcheck disable=SC2046
  # In a session of its own with no descriptor of the caller's: a caller that reads this
  # script's output (the tests) sees it end, and the node outlives the caller.
  (cd "$dir" && env $(rabbit_env "$n") setsid nohup "$RABBIT_BIN/rabbitmq-server" \
    </dev/null >"$dir/console.log" 2>&1 &)
}
rabbit_start() {
  rabbit_launch "$1"
  wait_port "RabbitMQ node $1" "568$1" 120
}
rabbit_up() {
  local n
  # A clustered node that restarts waits (up to 5 minutes) for the peers that were running when
  # it stopped before it opens its port: start every missing node before waiting for any.
  fresh_if_all_dead rabbitmq 3
  for n in 1 2 3; do rabbit_launch "$n"; done
  for n in 1 2 3; do wait_port "RabbitMQ node $n" "568$n" 120; done
  for n in 2 3; do
    if ! rabbitctl 1 cluster_status 2>/dev/null | grep -q "outbox$n@localhost"; then
      rabbitctl "$n" stop_app >/dev/null
      rabbitctl "$n" reset >/dev/null
      rabbitctl "$n" join_cluster outbox1@localhost >/dev/null
      rabbitctl "$n" start_app >/dev/null
      wait_port "RabbitMQ node $n" "568$n" 60
    fi
  done
  rabbitctl 1 await_online_nodes 3 --timeout 60 >/dev/null
}

# ---- Redis Cluster ----------------------------------------------------------------------------
redis_start() {
  local n=$1 dir="$BASE/redis-$1"
  port_open "700$n" && return 0
  mkdir -p "$dir"
  redis-server --daemonize yes --bind 127.0.0.1 --port "700$n" --dir "$dir" \
    --cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout 2000 \
    --appendonly yes --save "" --pidfile "$dir/pid" --logfile "$dir/log"
  wait_port "Redis node $n" "700$n" 20
}
redis_ok() { redis-cli -p 7001 cluster info | grep -q 'cluster_state:ok'; }
redis_up() {
  local n
  fresh_if_all_dead redis 6
  for n in 1 2 3 4 5 6; do redis_start "$n"; done
  if ! redis_ok; then
    if [ "$(redis-cli -p 7001 cluster info | sed -n 's/^cluster_known_nodes:\([0-9]*\).*/\1/p')" = 1 ]; then
      redis-cli --cluster create 127.0.0.1:7001 127.0.0.1:7002 127.0.0.1:7003 \
        127.0.0.1:7004 127.0.0.1:7005 127.0.0.1:7006 --cluster-replicas 1 --cluster-yes >/dev/null
    fi
    poll 30 "the Redis cluster is not in state ok after 30 s" redis_ok
  fi
}

rabbit_leader() { # queue
  local n leader
  for n in 1 2 3; do
    port_open "568$n" || continue
    leader="$(rabbitctl "$n" list_queues -q --no-table-headers name leader 2>/dev/null | awk -v q="$1" '$1 == q { print $2 }')"
    [ -n "$leader" ] || continue
    leader="${leader#outbox}"
    echo "${leader%@*}"
    return 0
  done
  echo "error: no RabbitMQ node names a leader for queue $1" >&2
  return 1
}
redis_leader() { # key
  local n slot
  for n in 1 2 3 4 5 6; do
    port_open "700$n" || continue
    slot="$(redis-cli -p "700$n" cluster keyslot "$1")"
    redis-cli -p "700$n" cluster nodes | awk -v slot="$slot" '
      $3 ~ /master/ && $3 !~ /fail/ {
        for (i = 9; i <= NF; i++) {
          split($i, r, "-")
          if (r[2] == "") r[2] = r[1]
          if (slot + 0 >= r[1] + 0 && slot + 0 <= r[2] + 0) {
            split($2, a, "[:@]"); print a[2] - 7000; exit
          }
        }
      }'
    return 0
  done
  echo "error: no Redis cluster node answers" >&2
  return 1
}

urls() {
  echo "export OUTBOX_TEST_NATS_CLUSTER_URL=nats://127.0.0.1:4241,nats://127.0.0.1:4242,nats://127.0.0.1:4243"
  echo "export OUTBOX_TEST_RABBITMQ_CLUSTER_URL=amqp://guest:guest@127.0.0.1:5681/%2f,amqp://guest:guest@127.0.0.1:5682/%2f,amqp://guest:guest@127.0.0.1:5683/%2f"
  echo "export OUTBOX_TEST_REDIS_CLUSTER_URL=redis://127.0.0.1:7001,redis://127.0.0.1:7002,redis://127.0.0.1:7003"
}

node_fn() { # kind verb
  case "$1" in
  nats) echo "nats_$2" ;;
  rabbitmq) echo "rabbit_$2" ;;
  redis) echo "redis_$2" ;;
  *) echo "error: unknown kind $1 (nats, rabbitmq, redis)" >&2; exit 2 ;;
  esac
}

cmd="${1:-up}"
shift || true
case "$cmd" in
up)
  kinds=("$@")
  [ ${#kinds[@]} -gt 0 ] || kinds=(nats rabbitmq redis)
  for kind in "${kinds[@]}"; do "$(node_fn "$kind" up)"; done
  ;;
stop) node_fn "$1" stop >/dev/null && node_stop "$1" "$2" ;;
start) "$(node_fn "$1" start)" "$2" ;;
leader) "$(node_fn "$1" leader)" "$2" ;;
info)
  [ "$1" = redis ] || { echo "error: info is for redis" >&2; exit 2; }
  redis-cli -p "700$2" info replication
  ;;
urls) urls ;;
down)
  for n in 1 2 3; do node_stop nats "$n"; node_stop rabbitmq "$n"; done
  for n in 1 2 3 4 5 6; do node_stop redis "$n"; done
  rm -rf "$BASE"
  ;;
*) echo "usage: $0 up [KIND...] | stop KIND N | start KIND N | leader KIND NAME | urls | down" >&2; exit 2 ;;
esac
