#!/usr/bin/env bash
# Model-check the bucket-lease protocol (model/leases.pml) with Spin; see docs/lease-model.md.
#
#   model/check.sh              the suite: safety and liveness checks that must pass, the known
#                               defects and the mutants, which must fail (each must be found)
#   model/check.sh --extended   also the larger configurations (3 relays, 2 buckets in safety,
#                               more faults before liveness), several minutes
#   JOBS=n model/check.sh       checks run n at a time (default: the number of CPUs, at most 2)
#
# Exits non-zero when a check that must pass finds an error (assertion violation, acceptance
# cycle, invalid end state, incomplete search) or a check that must fail finds none.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
model="$here/leases.pml"
extended=0
case "${1:-}" in
  --extended) extended=1 ;;
  "") ;;
  *) echo "usage: $0 [--extended]" >&2; exit 2 ;;
esac
cpus=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
jobs=${JOBS:-$(( cpus < 2 ? cpus : 2 ))}

if ! command -v spin >/dev/null 2>&1; then
  echo "spin is not installed: apt-get install -y spin"
  if ! apt-get install -y spin >/dev/null 2>&1; then
    apt-get update >/dev/null 2>&1 || true
    apt-get install -y spin >/dev/null 2>&1 || { echo "could not install spin" >&2; exit 1; }
  fi
fi
command -v gcc >/dev/null 2>&1 || { echo "gcc is needed to compile Spin's verifier" >&2; exit 1; }
echo "$(spin -V 2>&1 | head -1); gcc $(gcc -dumpversion); $jobs job(s) at a time"

work=$(mktemp -d "${TMPDIR:-/tmp}/lease-model.XXXXXX")
trap 'rm -rf "$work"' EXIT

# The common configurations (docs/lease-model.md, "Configurations").
ONE_BUCKET_CORE="-DNB=1 -DNM=2 -DLEASE=1 -DMAXATT=1 -DNO_UNAVAILABLE -DNO_LOST_ANSWER -DNO_HANDOFF"
ONE_BUCKET_ALL="-DNB=1 -DNM=1 -DLEASE=1 -DMAXATT=2"
TWO_BUCKETS_LIVE="-DLIVE -DNB=2 -DNM=2 -DLEASE=2 -DMAXATT=1 -DCHAOS=1"

SAFETY_C="-O1 -DSAFETY -DNOBOUNDCHECK"
SAFETY_P="-m2000000 -w24"
LIVE_C="-O1 -DNOBOUNDCHECK -DNFAIR=3"
LIVE_P="-a -f -m2000000 -w24"

# name | expect (pass, or fail:<regex the error line must match>) | spin -D flags | gcc flags |
# pan flags | narrative (replay the counterexample's printf lines)
checks=(
  # --- must pass: the code as written (the completion share-locks the bucket rows it fences
  #     on until it commits, on PostgreSQL and MySQL/MariaDB)
  "safety-2msg|pass|$ONE_BUCKET_CORE|$SAFETY_C|$SAFETY_P|"
  "safety-allfaults|pass|$ONE_BUCKET_ALL|$SAFETY_C|$SAFETY_P|"
  # --- must pass: check-back (attempts start again at 0) within attempts <= max_attempts + 1
  "checkback|pass|-DCHECK_BACK -DNB=1 -DNM=1 -DLEASE=1 -DMAXATT=1|$SAFETY_C|$SAFETY_P|"
  # --- must pass: take_batch separate from the read, no completion lowers attempts
  "take-gap-monotonic|pass|-DMONO -DTAKE_GAP -DNB=1 -DNM=1 -DLEASE=1 -DMAXATT=1 -DNO_LOST_ANSWER|$SAFETY_C|$SAFETY_P|"
  # --- must pass: liveness under weak fairness (assertions are checked on the way too)
  "liveness|pass|$TWO_BUCKETS_LIVE|$LIVE_C|$LIVE_P|"
  "liveness-retries|pass|${TWO_BUCKETS_LIVE/-DNM=2 -DLEASE=2 -DMAXATT=1/-DNM=1 -DLEASE=2 -DMAXATT=2}|$LIVE_C|$LIVE_P|"
  # --- fixed defects: the code before each fix must still fail (docs/lease-model.md, "Findings")
  "D1-pg-stale-commit|fail:assertion violated.*ph\[\(own|-DFENCE=1 -DP2_OTHER_OWNER $ONE_BUCKET_CORE|-O0 -DSAFETY -DREACH|-i -m40 -w20|narrative"
  "D1-pg-strict-fence|fail:assertion violated.*bt\[r\]==2\)\) \(at depth|-DFENCE=1 $ONE_BUCKET_CORE|-O0 -DSAFETY|-m100000 -w20|"
  "D2-checkback-attempts|fail:assertion violated.*att\[br\[r\]\]<=|-DCB_KEEP -DFENCE=1 -DP2_SNAPSHOT -DCHECK_BACK -DNB=1 -DNM=1 -DLEASE=1 -DMAXATT=1 -DNO_HANDOFF -DNO_LOST_ANSWER|-O0 -DSAFETY -DREACH|-m60 -w20|narrative"
  "D3-take-batch-token|fail:assertion violated.*x>=att|-DTAKE_NOW -DMONO -DTAKE_GAP -DNB=1 -DNM=2 -DLEASE=1 -DMAXATT=1 -DNO_LOST_ANSWER -DNO_HANDOFF|-O0 -DSAFETY -DREACH|-m60 -w20|narrative"
  "D4-pg-cut-off-session|fail:acceptance cycle|-DFENCE=1 -DP2_SNAPSHOT -DZOMBIE $TWO_BUCKETS_LIVE|-O0 -DNOBOUNDCHECK -DNFAIR=3|$LIVE_P|narrative"
  "N1-exclusive-publish-claim|fail:assertion violated.*&&\(rem\[|-DCLAIM_EXCLUSIVE_PUBLISH $ONE_BUCKET_CORE|-O0 -DSAFETY -DREACH|-i -m60 -w20|narrative"
  # --- mutants: each property can fail
  "M1-no-token-check|fail:assertion violated.*&&\(rem\[|-DBUG_NO_TOKEN $ONE_BUCKET_CORE|-O0 -DSAFETY -DREACH|-i -m60 -w20|narrative"
  "M2-no-expiry-check|fail:assertion violated.*own\[j\]==0|-DBUG_NO_EXPIRY $ONE_BUCKET_CORE|-O0 -DSAFETY|-m100000 -w20|"
  "M3-precount-uncapped|fail:assertion violated.*att\[br\[r\]\]<=|-DBUG_PRECOUNT_UNCAPPED $ONE_BUCKET_CORE|-O0 -DSAFETY|-m100000 -w20|"
  "M4-no-takeover|fail:acceptance cycle|-DBUG_NO_TAKEOVER $TWO_BUCKETS_LIVE|-O0 -DNOBOUNDCHECK -DNFAIR=3|$LIVE_P|"

)
if [ "$extended" = 1 ]; then
  checks+=(
    "x-safety-2msg-maxatt2|pass|${ONE_BUCKET_CORE/-DMAXATT=1/-DMAXATT=2}|$SAFETY_C|$SAFETY_P|"
    "x-take-gap-2msg|pass|-DMONO -DTAKE_GAP $ONE_BUCKET_CORE|$SAFETY_C|$SAFETY_P|"
    "x-checkback-maxatt2|pass|-DCHECK_BACK -DNB=1 -DNM=1 -DLEASE=1 -DMAXATT=2|$SAFETY_C|$SAFETY_P|"
    "x-liveness-maxatt2|pass|${TWO_BUCKETS_LIVE/-DMAXATT=1/-DMAXATT=2}|$LIVE_C|$LIVE_P|"
    "x-liveness-chaos2|pass|${TWO_BUCKETS_LIVE/-DCHAOS=1/-DCHAOS=2}|$LIVE_C|$LIVE_P|"
    "x-D4-locked-cut-off-session|fail:acceptance cycle|-DZOMBIE $TWO_BUCKETS_LIVE|-O0 -DNOBOUNDCHECK -DNFAIR=3|$LIVE_P|"
    "x-liveness-idle-timeout|pass|-DZOMBIE -DIDLE_TIMEOUT $TWO_BUCKETS_LIVE|-O1 -DNOBOUNDCHECK -DNFAIR=4|$LIVE_P|"
    "x-liveness-3relays|pass|-DLIVE -DNR=3 -DNB=2 -DNM=2 -DLEASE=2 -DMAXATT=1 -DCHAOS=1|-O1 -DNOBOUNDCHECK -DNFAIR=5|$LIVE_P|"
  )
fi

now() { date +%s.%N; }

run_check() {
  local spec=$1
  local name expect dflags cflags pflags narrative
  IFS='|' read -r name expect dflags cflags pflags narrative <<<"$spec"
  local dir="$work/$name"
  mkdir -p "$dir"
  cp "$model" "$dir/leases.pml"
  (
    cd "$dir"
    local t0 t1 verdict="" detail=""
    t0=$(now)
    # shellcheck disable=SC2086
    if ! spin -a $dflags leases.pml >spin.out 2>&1; then
      echo "ERROR|spin -a failed: $(head -3 spin.out | tr '\n' ' ')" >result; exit 0
    fi
    # shellcheck disable=SC2086
    if ! gcc $cflags -w -o pan pan.c >gcc.out 2>&1; then
      echo "ERROR|gcc failed: $(head -3 gcc.out | tr '\n' ' ')" >result; exit 0
    fi
    # shellcheck disable=SC2086
    if [ -x /usr/bin/time ]; then
      /usr/bin/time -f '%U' -o cpu.txt ./pan $pflags >pan.out 2>&1 || true
    else
      ./pan $pflags >pan.out 2>&1 || true
    fi
    t1=$(now)
    local errors stored trans
    errors=$(sed -n 's/.*errors: \([0-9]*\).*/\1/p' pan.out | tail -1)
    stored=$(awk '/states, stored/ {print $1; exit}' pan.out)
    trans=$(awk '/transitions \(= / {print $1; exit}' pan.out)
    local first
    first=$(grep -m1 -E '^pan:[0-9]+:|^pan: .*(violated|cycle|invalid end)' pan.out || true)
    local incomplete=""
    if grep -q -E 'max search depth too small|Search not completed' pan.out && [ "${errors:-0}" = 0 ]; then
      incomplete="search incomplete (raise -m)"
    fi
    case "$expect" in
      pass)
        if [ -z "$errors" ]; then verdict=ERROR; detail="no verifier result: $(tail -2 pan.out | tr '\n' ' ')"
        elif [ "$errors" = 0 ] && [ -z "$incomplete" ]; then verdict=ok; detail="no errors"
        else verdict=FAILED; detail="${first:-$incomplete}"
        fi ;;
      fail:*)
        local want=${expect#fail:}
        if [ "${errors:-0}" != 0 ] && echo "$first" | grep -q -E "$want"; then
          verdict=ok; detail="found: $first"
        elif [ "${errors:-0}" != 0 ]; then
          verdict=FAILED; detail="another error than expected: $first"
        else
          verdict=FAILED; detail="expected a counterexample, found none"
        fi ;;
    esac
    if [ "$verdict" = ok ] && [ -n "$narrative" ] && ls ./*.trail >/dev/null 2>&1; then
      # shellcheck disable=SC2086
      spin -t $dflags leases.pml 2>&1 | grep -E '^ +(R[0-9]|tick|    m[0-9]|    broker|server|check-back)|^spin: text of failed|START OF CYCLE' \
        | sed -e 's/^ *//' | awk '/^spin: text of failed/ { stop = NR + 2 } stop && NR > stop { exit } { print }' \
        >narrative.txt || true
    fi
    local cpu=-
    [ -s cpu.txt ] && cpu=$(tail -1 cpu.txt)
    printf '%s|%s|%s|%s|%.1f|%s|%s\n' "$verdict" "$expect" "${stored:--}" "${trans:--}" \
      "$(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }')" "$cpu" "$detail" >result
  )
}

start=$(now)
running=0
for spec in "${checks[@]}"; do
  run_check "$spec" &
  running=$((running + 1))
  if [ "$running" -ge "$jobs" ]; then
    wait -n || true
    running=$((running - 1))
  fi
done
wait
total=$(awk -v a="$start" -v b="$(now)" 'BEGIN { print b - a }')

status=0
printf '\n%-28s %-7s %-6s %10s %13s %9s %9s\n' check result expect states transitions "wall s" "pan cpu s"
for spec in "${checks[@]}"; do
  name=${spec%%|*}
  if [ ! -f "$work/$name/result" ]; then
    printf '%-28s %-7s\n' "$name" ERROR; status=1; continue
  fi
  IFS='|' read -r verdict expect stored trans secs cpu detail <"$work/$name/result"
  short=${expect%%:*}
  printf '%-28s %-7s %-6s %10s %13s %9s %9s\n' "$name" "$verdict" "$short" "$stored" "$trans" "$secs" "$cpu"
  [ "$verdict" = ok ] || { status=1; echo "    $detail"; }
done
for spec in "${checks[@]}"; do
  name=${spec%%|*}
  if [ -s "$work/$name/narrative.txt" ]; then
    echo
    echo "--- $name: counterexample"
    sed -e 's/^/    /' "$work/$name/narrative.txt"
  fi
done
printf '\ntotal %.1f s wall, %d check(s), %s\n' "$total" "${#checks[@]}" \
  "$([ "$status" = 0 ] && echo 'all as expected' || echo 'NOT as expected')"
exit "$status"
