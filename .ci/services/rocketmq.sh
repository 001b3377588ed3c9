# RocketMQ (the Rust name server and broker from crates.io), sourced by .ci/run.
#
# The caller defines `log`, `port_open` and `wait_port` and runs with `set -euo pipefail`.
# Sourcing this twice is harmless: the binaries are installed only when missing (cached in
# ~/.cargo/bin between runs), each server is started only when its port is closed, and the
# readiness check passes at once when both are already up.
#
# Ports: name server 127.0.0.1:19876, broker 127.0.0.1:20911 (HA 20912). State and logs in
# $ROCKETMQ_CI_DIR (default /var/tmp/outbox-rocketmq). Exports OUTBOX_TEST_ROCKETMQ_URL.

ROCKETMQ_CI_DIR="${ROCKETMQ_CI_DIR:-/var/tmp/outbox-rocketmq}"
ROCKETMQ_NAMESRV_PORT=19876
ROCKETMQ_BROKER_PORT=20911

rocketmq_install() {
  local missing=()
  command -v rocketmq-namesrv-rust >/dev/null 2>&1 || missing+=(rocketmq-namesrv)
  command -v rocketmq-broker-rust >/dev/null 2>&1 || missing+=(rocketmq-broker)
  if ((${#missing[@]} > 0)); then
    echo "installing ${missing[*]} (about 10 minutes each, cached in ~/.cargo/bin afterwards)"
    cargo install --locked "${missing[@]}"
  fi
}

# Byte offset of the name server log where this run's readiness check starts reading.
ROCKETMQ_LOG_FROM=1

rocketmq_start() {
  mkdir -p "$ROCKETMQ_CI_DIR/home" "$ROCKETMQ_CI_DIR/store"
  if ! port_open "$ROCKETMQ_NAMESRV_PORT"; then
    # A fresh name server: only what it logs from now on counts.
    ROCKETMQ_LOG_FROM=$(($(stat -c %s "$ROCKETMQ_CI_DIR/namesrv.log" 2>/dev/null || echo 0) + 1))
    echo "starting the RocketMQ name server on 127.0.0.1:$ROCKETMQ_NAMESRV_PORT"
    (
      cd "$ROCKETMQ_CI_DIR"
      NO_COLOR=1 HOME="$ROCKETMQ_CI_DIR/home" ROCKETMQ_HOME="$ROCKETMQ_CI_DIR/home" nohup rocketmq-namesrv-rust \
        --bindAddress 127.0.0.1 --listenPort "$ROCKETMQ_NAMESRV_PORT" \
        --rocketmqHome "$ROCKETMQ_CI_DIR/home" >>"$ROCKETMQ_CI_DIR/namesrv.log" 2>&1 &
    )
  fi
  wait_port "RocketMQ name server" "$ROCKETMQ_NAMESRV_PORT" 60
  if ! port_open "$ROCKETMQ_BROKER_PORT"; then
    # Only a TOML configuration works with the Rust broker (a Java-style properties file fails).
    cat >"$ROCKETMQ_CI_DIR/broker.toml" <<EOF
[broker]
namesrvAddr = "127.0.0.1:$ROCKETMQ_NAMESRV_PORT"
brokerIp1 = "127.0.0.1"
brokerIp2 = "127.0.0.1"
listenPort = $ROCKETMQ_BROKER_PORT
storePathRootDir = "$ROCKETMQ_CI_DIR/store"
enableControllerMode = false
autoCreateTopicEnable = true
autoCreateSubscriptionGroup = true

[broker.brokerServerConfig]
bindAddress = "127.0.0.1"

[broker.brokerIdentity]
brokerName = "outbox-ci"
brokerClusterName = "DefaultCluster"
brokerId = 0

[store]
storePathRootDir = "$ROCKETMQ_CI_DIR/store"
haListenPort = 20912
haListenAddress = "127.0.0.1"
EOF
    echo "starting the RocketMQ broker on 127.0.0.1:$ROCKETMQ_BROKER_PORT"
    (
      cd "$ROCKETMQ_CI_DIR"
      NO_COLOR=1 HOME="$ROCKETMQ_CI_DIR/home" ROCKETMQ_HOME="$ROCKETMQ_CI_DIR/home" nohup rocketmq-broker-rust \
        -c "$ROCKETMQ_CI_DIR/broker.toml" >>"$ROCKETMQ_CI_DIR/broker.log" 2>&1 &
    )
  fi
  if ! wait_port "RocketMQ broker" "$ROCKETMQ_BROKER_PORT" 60; then
    # The broker rolls its start-up back ("Service lifecycle operation failed", after "disk
    # capacity requires reclaim") when the disk of its store is 75 % full or more (RocketMQ's
    # diskMaxUsedSpaceRatio): say so instead of leaving only the port time-out.
    local used
    used=$(df --output=pcent "$ROCKETMQ_CI_DIR" | tail -n 1 | tr -dc '0-9')
    echo "error: the RocketMQ broker did not start; its log: $ROCKETMQ_CI_DIR/broker.log" >&2
    if [ "${used:-0}" -ge 75 ]; then
      echo "error: the disk holding $ROCKETMQ_CI_DIR is ${used}% full; the RocketMQ broker refuses to start at 75% or more: free disk space (old cargo target directories)" >&2
    fi
    return 1
  fi
}

# An open broker port is not enough: a producer can send to a new topic only once the broker has
# registered with the name server, which then routes the default topic TBW102 (the route the
# client borrows for topics it does not know; the broker registers it because
# autoCreateTopicEnable is true). The name server logs that registration.
rocketmq_wait_ready() {
  local i
  for ((i = 0; i < 600; i++)); do
    # (Process substitution, not a pipe: under pipefail a tail cut short by grep -q would fail.)
    if grep -aqE 'new topic registered, TBW102|Register topic route:TBW102' \
      < <(tail -c +"$ROCKETMQ_LOG_FROM" "$ROCKETMQ_CI_DIR/namesrv.log" 2>/dev/null); then
      return 0
    fi
    sleep 0.1
  done
  echo "error: the RocketMQ broker did not register with the name server within 60 s" >&2
  tail -n 20 "$ROCKETMQ_CI_DIR/namesrv.log" "$ROCKETMQ_CI_DIR/broker.log" >&2 || true
  return 1
}

rocketmq_install
rocketmq_start
rocketmq_wait_ready
export OUTBOX_TEST_ROCKETMQ_URL="${OUTBOX_TEST_ROCKETMQ_URL:-rocketmq://127.0.0.1:$ROCKETMQ_NAMESRV_PORT}"
echo "RocketMQ ready: $OUTBOX_TEST_ROCKETMQ_URL"
