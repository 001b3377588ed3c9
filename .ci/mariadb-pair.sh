#!/usr/bin/env bash
# A MariaDB primary (127.0.0.1:3317) and its replica (127.0.0.1:3318), GTID replication with
# semi-synchronous acknowledgement (a commit returns once the replica has received it), for
# the MariaDB failover test (crates/outbox-cli/tests/daemon/failover.rs; docs/scaling.md,
# "Database failover"). Two more servers of the installed MariaDB, data under
# /var/lib/outbox-mariadb, on loopback: root without a password, and `relay` (no password,
# every privilege on database `test` and none that passes `read_only`) for the relay.
#
# Usage (as root):
#   mariadb-pair.sh reset          stop and remove both if present, create them afresh, start,
#                                  wait until the replica replicates (~10 s)
#   mariadb-pair.sh stop-primary   kill the primary at once (SIGKILL: the server crashes)
#   mariadb-pair.sh promote        make the replica a primary (replication stopped, writable)
#   mariadb-pair.sh drop           stop and remove both
set -euo pipefail

if [ "$(id -u)" != 0 ]; then
  echo "error: mariadb-pair.sh creates MariaDB servers and must run as root" >&2
  exit 1
fi
for tool in mariadbd mariadb-install-db mariadb; do
  command -v "$tool" >/dev/null || [ -x "/usr/sbin/$tool" ] || { echo "error: $tool is required (Debian mariadb-server)" >&2; exit 1; }
done
MARIADBD="$(command -v mariadbd || echo /usr/sbin/mariadbd)"
ROOT=/var/lib/outbox-mariadb
PP=3317
RP=3318

sql() { # port statement…
  local port="$1"
  shift
  mariadb --protocol=tcp -h 127.0.0.1 -P "$port" -u root -N -B -e "$*"
}

pidfile() { echo "$ROOT/$1.pid"; }

stop_one() { # name signal
  local p pid
  p="$(pidfile "$1")"
  if [ -f "$p" ]; then
    pid="$(cat "$p")"
    kill "-$2" "$pid" 2>/dev/null || true
    for _ in $(seq 1 300); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    rm -f "$p"
  fi
}

start_one() { # name port server-id extra-options…
  local name="$1" port="$2" id="$3"
  shift 3
  local data="$ROOT/$name"
  mkdir -p "$data"
  chown -R mysql:mysql "$ROOT"
  mariadb-install-db --user=mysql --datadir="$data" --auth-root-authentication-method=normal \
    --skip-test-db >"$ROOT/$name-install.log" 2>&1
  setsid "$MARIADBD" --no-defaults --user=mysql --datadir="$data" --port="$port" --bind-address=127.0.0.1 \
    --socket="$ROOT/$name.sock" --pid-file="$(pidfile "$name")" --log-error="$ROOT/$name.err" \
    --server-id="$id" --log-bin=binlog --binlog-format=ROW --gtid-strict-mode=1 \
    --skip-name-resolve --innodb-buffer-pool-size=64M --max-connections=200 "$@" \
    </dev/null >>"$ROOT/$name.out" 2>&1 &
  for _ in $(seq 1 300); do
    sql "$port" "SELECT 1" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "error: MariaDB $name is not answering on 127.0.0.1:$port after 30 s (log: $ROOT/$name.err)" >&2
  exit 1
}

drop_all() {
  stop_one replica TERM
  stop_one primary TERM
  rm -rf "$ROOT"
}

case "${1:-}" in
  reset)
    drop_all
    mkdir -p "$ROOT"
    start_one primary "$PP" 1 --rpl-semi-sync-master-enabled=1 --rpl-semi-sync-master-timeout=60000
    # `relay`: what an application's account is, without the privileges that pass read_only
    # (root's would write to a replica as if it were the primary).
    sql "$PP" "CREATE DATABASE test; CREATE USER 'relay'@'127.0.0.1' IDENTIFIED BY ''; GRANT ALL ON test.* TO 'relay'@'127.0.0.1'"
    start_one replica "$RP" 2 --log-slave-updates=1 --read-only=1 --rpl-semi-sync-slave-enabled=1
    sql "$RP" "CHANGE MASTER TO MASTER_HOST='127.0.0.1', MASTER_PORT=$PP, MASTER_USER='root', MASTER_PASSWORD='', MASTER_USE_GTID=slave_pos; START SLAVE"
    for _ in $(seq 1 300); do
      if [ "$(sql "$RP" "SELECT count(*) FROM information_schema.schemata WHERE schema_name = 'test'")" = 1 ] \
        && [ "$(sql "$PP" "SHOW STATUS LIKE 'Rpl_semi_sync_master_clients'" | awk '{print $2}')" = 1 ]; then
        echo "primary 127.0.0.1:$PP, replica 127.0.0.1:$RP replicating (semi-synchronous)"
        exit 0
      fi
      sleep 0.1
    done
    echo "error: the replica on 127.0.0.1:$RP is not replicating from 127.0.0.1:$PP after 30 s" >&2
    sql "$RP" "SHOW SLAVE STATUS\G" >&2 || true
    exit 1
    ;;
  stop-primary)
    stop_one primary KILL
    ;;
  promote)
    sql "$RP" "STOP SLAVE; RESET SLAVE ALL; SET GLOBAL read_only = 0"
    ;;
  drop)
    drop_all
    ;;
  *)
    echo "usage: $0 reset|stop-primary|promote|drop" >&2
    exit 2
    ;;
esac
