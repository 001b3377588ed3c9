#!/usr/bin/env bash
# Run the fuzz targets (docs/reliability.md, "Fuzzing").
#
#   fuzz/run.sh              every target for 20 s (the CI run), corpus in fuzz/corpus/<target>
#   fuzz/run.sh 1000000      every target for 1,000,000 executions
#   TARGETS="inbound" fuzz/run.sh 300s   one target for 300 seconds
#
# New inputs the fuzzer finds interesting are added to the corpus directories; commit the ones
# worth keeping (`cargo fuzz cmin <target>` first). A crash leaves its input in
# fuzz/artifacts/<target>/ and the script exits non-zero; replay it with
# `cargo +nightly fuzz run <target> fuzz/artifacts/<target>/<file>`.
set -euo pipefail
cd "$(dirname "$0")"

limit=${1:-20s}
targets=${TARGETS:-"row_to_wire inbound confirmations config"}
case "$limit" in
  *s) flag="-max_total_time=${limit%s}" ;;
  *) flag="-runs=$limit" ;;
esac

if ! rustup toolchain list | grep -q '^nightly'; then
  echo "error: cargo fuzz needs the nightly toolchain (rustup toolchain install nightly)" >&2
  exit 1
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
  echo "installing cargo-fuzz"
  cargo install --locked cargo-fuzz
fi
# Keep the instrumented build between runs (a fresh clone otherwise builds every broker's
# client again).
export CARGO_TARGET_DIR="${OUTBOX_FUZZ_TARGET_DIR:-${CARGO_TARGET_DIR:-target}-fuzz}"
# No sanitizer: the code is safe Rust; what is looked for is a panic (an assertion of a
# dependency, an overflow: the build has debug assertions) or a broken property.
cargo +nightly fuzz build -s none
mkdir -p "$CARGO_TARGET_DIR"
for t in $targets; do
  echo "==> fuzz $t ($limit)"
  mkdir -p "corpus/$t"
  log="$CARGO_TARGET_DIR/fuzz-$t.log"
  if ! cargo +nightly fuzz run -s none "$t" "corpus/$t" -- "$flag" -print_final_stats=1 >"$log" 2>&1; then
    tail -n 40 "$log"
    echo "error: fuzz target $t failed (its input is in fuzz/artifacts/$t)" >&2
    exit 1
  fi
  grep -E "^stat::(number_of_executed_units|average_exec_per_sec|new_units_added)|^Done " "$log" || true
done
