#!/usr/bin/env bash
# N PostgreSQL clusters of the installed PostgreSQL on this machine (127.0.0.1:5441, 5442, …),
# each with a database `test`, trust auth on loopback, for `outbox bench --only databases`
# (docs/scaling.md, "Capacity"). Debian's pg_createcluster, as .ci/pg-pair.sh.
#
# Usage (as root):
#   pg-fleet.sh up N     create and start clusters 1..N that are missing (N from 1 to 8), then
#                        print the URLs of all N, one per line
#   pg-fleet.sh urls N   print the URLs of clusters 1..N
#   pg-fleet.sh drop     stop and drop every cluster of the fleet
set -euo pipefail

# shellcheck source=pg-clusters.sh
. "$(dirname "$0")/pg-clusters.sh"
pg_clusters_init pg-fleet.sh pg_isready
BASE=5440

url() { echo "postgres://postgres@127.0.0.1:$((BASE + $1))/test"; }

count() {
  local n="${1:-}"
  if ! [[ "$n" =~ ^[1-8]$ ]]; then
    echo "error: give the number of clusters, 1 to 8 (got '${n}')" >&2
    exit 2
  fi
  echo "$n"
}

case "${1:-}" in
  up)
    n="$(count "${2:-}")"
    for i in $(seq 1 "$n"); do
      c="outbox_fleet$i"
      port=$((BASE + i))
      if ! exists "$c"; then
        pg_createcluster "$V" "$c" -p "$port" >/dev/null
        trust_loopback "$c"
        cat >> "/etc/postgresql/$V/$c/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
max_connections = 100
CONF
      fi
      pg_ctlcluster "$V" "$c" start 2>/dev/null || true
      for _ in $(seq 1 300); do
        pg_isready -q -h 127.0.0.1 -p "$port" && break
        sleep 0.1
      done
      pg_isready -q -h 127.0.0.1 -p "$port" || { echo "error: cluster $c is not ready on 127.0.0.1:$port after 30 s" >&2; exit 1; }
      if [ "$(psql -h 127.0.0.1 -p "$port" -U postgres -Atc "SELECT count(*) FROM pg_database WHERE datname = 'test'")" = 0 ]; then
        psql -h 127.0.0.1 -p "$port" -U postgres -qc "CREATE DATABASE test"
      fi
    done
    for i in $(seq 1 "$n"); do url "$i"; done
    ;;
  urls)
    n="$(count "${2:-}")"
    for i in $(seq 1 "$n"); do url "$i"; done
    ;;
  drop)
    for c in $(pg_lsclusters -h | awk -v v="$V" '$1 == v && $2 ~ /^outbox_fleet[0-9]+$/ {print $2}'); do
      pg_dropcluster --stop "$V" "$c"
    done
    ;;
  *)
    echo "usage: $0 up N|urls N|drop" >&2
    exit 2
    ;;
esac
