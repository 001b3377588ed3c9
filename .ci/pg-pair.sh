#!/usr/bin/env bash
# A PostgreSQL primary (127.0.0.1:5433) and its streaming-replication standby (127.0.0.1:5434),
# replicating synchronously (a commit returns once the standby has flushed it), for the failover
# test (crates/outbox-cli/tests/daemon/failover.rs; docs/scaling.md, "Database failover").
# Two more clusters of the installed PostgreSQL (Debian's pg_createcluster), trust auth on
# loopback, as the main test cluster.
#
# Usage (as root):
#   pg-pair.sh reset          drop both if present, create them afresh, start, wait for streaming (~5 s)
#   pg-pair.sh stop-primary   stop the primary at once (-m immediate: the server crashes)
#   pg-pair.sh drop           stop and drop both
set -euo pipefail

# shellcheck source=pg-clusters.sh
. "$(dirname "$0")/pg-clusters.sh"
pg_clusters_init pg-pair.sh pg_basebackup
P=outbox_primary
S=outbox_standby
PP=5433
SP=5434

drop_all() {
  for c in "$S" "$P"; do
    if exists "$c"; then pg_dropcluster --stop "$V" "$c"; fi
  done
}

hba() { trust_loopback "$1" "host replication all 127.0.0.1/32 trust"; }

case "${1:-}" in
  reset)
    drop_all
    pg_createcluster "$V" "$P" -p "$PP" >/dev/null
    hba "$P"
    cat >> "/etc/postgresql/$V/$P/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
wal_level = replica
max_wal_senders = 4
synchronous_standby_names = '*'
synchronous_commit = on
max_connections = 100
CONF
    pg_ctlcluster "$V" "$P" start
    pg_createcluster "$V" "$S" -p "$SP" >/dev/null
    hba "$S"
    echo "listen_addresses = '127.0.0.1'" >> "/etc/postgresql/$V/$S/postgresql.conf"
    data="/var/lib/postgresql/$V/$S"
    find "$data" -mindepth 1 -delete
    runuser -u postgres -- pg_basebackup -h 127.0.0.1 -p "$PP" -U postgres -D "$data" -R -X stream -c fast
    chmod 700 "$data"
    pg_ctlcluster "$V" "$S" start
    for _ in $(seq 1 300); do
      n="$(psql -h 127.0.0.1 -p "$PP" -U postgres -Atc "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'" 2>/dev/null || echo 0)"
      [ "$n" = 1 ] && { echo "primary 127.0.0.1:$PP, standby 127.0.0.1:$SP streaming"; exit 0; }
      sleep 0.1
    done
    echo "error: the standby on 127.0.0.1:$SP is not streaming from 127.0.0.1:$PP after 30 s" >&2
    exit 1
    ;;
  stop-primary)
    pg_ctlcluster "$V" "$P" stop -m immediate
    ;;
  drop)
    drop_all
    ;;
  *)
    echo "usage: $0 reset|stop-primary|drop" >&2
    exit 2
    ;;
esac
