//! Database failover (issue 18): the daemon on a PostgreSQL primary with a streaming-replication
//! standby (`.ci/pg-pair.sh`: two more clusters of the installed PostgreSQL, 127.0.0.1:5433 and
//! :5434, replicating synchronously), its URL naming both hosts as libpq does
//! (`target_session_attrs=read-write`). In the middle of a drain, with a producer writing, the
//! primary crashes (immediate stop); while no host accepts writes the relay writes nowhere and is
//! not ready; the standby is promoted; the relay follows it without a restart. Every message
//! committed (hence on the standby) is published, each once in the stream; none is dead-lettered.
//!
//! MariaDB (`.ci/mariadb-pair.sh`: a primary on 127.0.0.1:3317 and a semi-synchronous replica
//! on :3318): the daemon reaches the database through a TCP proxy, as behind a virtual IP or
//! HAProxy that follows the primary. The primary crashes (SIGKILL), the proxy moves to the
//! replica before it is promoted (the relay meets a read-only server: a clear error, no writes,
//! not ready), then the replica is promoted; the same daemon goes on.
//!
//! Needs root (to create the servers), PostgreSQL's and MariaDB's server packages and NATS
//! JetStream.

use std::sync::{Arc, Mutex};

use super::metrics::{free_addr, get, wait_status};
use super::*;

const PRIMARY: u16 = 5433;
const STANDBY: u16 = 5434;

fn url(port: u16) -> String {
    format!("postgres://postgres@127.0.0.1:{port}/postgres")
}

fn pair(action: &str) {
    script("pg-pair.sh", "PostgreSQL primary/standby pair", action);
}

/// Run `.ci/<name> <action>`, which must succeed (`what` names the servers it makes).
fn script(name: &str, what: &str, action: &str) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../.ci")
        .join(name);
    let out = Command::new("bash")
        .arg(&script)
        .arg(action)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the {what} of the failover test is required: `{} {action}` failed: {}{}",
        script.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A connection to whichever of the pair accepts writes now, if any.
async fn writable() -> Option<sqlx::PgConnection> {
    use sqlx::Connection as _;
    for port in [PRIMARY, STANDBY] {
        if let Ok(Ok(mut c)) = tokio::time::timeout(
            Duration::from_secs(2),
            sqlx::PgConnection::connect(&url(port)),
        )
        .await
        {
            let recovery: Result<bool, _> = sqlx::query_scalar("SELECT pg_is_in_recovery()")
                .fetch_one(&mut c)
                .await;
            if matches!(recovery, Ok(false)) {
                return Some(c);
            }
        }
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn daemon_follows_a_promoted_standby_without_a_restart() {
    let backlog: i64 = std::env::var("OUTBOX_FAILOVER_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5_000);
    pair("reset");
    let f = Fixture::new("failover");
    let table = &f.table;
    succeeds(
        outbox()
            .args(["migrate", "--database", &url(PRIMARY), "--table", table])
            .arg("--inbox-table")
            .arg(format!("{table}_inbox")),
    );
    let js = nats().await;
    let primary = PgPool::connect(&url(PRIMARY)).await.unwrap();
    enqueue_topics(&primary, table, &["order-created"], backlog).await;
    primary.close().await;

    let addr = free_addr();
    let relay = "name = \"failover\"\npoll_interval = \"200ms\"\nlease = \"3s\"\npublish_timeout = \"1s\"\nbatch_size = 200\n";
    let multi = format!(
        "postgres://postgres@127.0.0.1:{PRIMARY},127.0.0.1:{STANDBY}/postgres?target_session_attrs=read-write"
    );
    let toml = f.toml(relay, &f.route("*")).replacen(&pg_url(), &multi, 1)
        + &format!("\n[admin]\nlisten = \"{addr}\"\n");
    let config = f.write("failover.toml", &toml);
    let mut relays = Relays(vec![f.spawn_relay_logged(&config, "failover")]);
    wait_status(&addr, "/readyz", 200, &f.dir).await;

    // A producer writing one message every 5 ms to whichever server accepts writes: the payloads
    // of the commits that returned (the standby has them: replication is synchronous).
    let committed: Arc<Mutex<Vec<String>>> = Arc::default();
    let stop = tokio_util::sync::CancellationToken::new();
    let producer = {
        let (committed, stop, table) = (committed.clone(), stop.clone(), table.clone());
        tokio::spawn(async move {
            let mut conn = None;
            let mut seq = 0u64;
            while !stop.is_cancelled() {
                tokio::time::sleep(Duration::from_millis(5)).await;
                if conn.is_none() {
                    conn = writable().await;
                    continue;
                }
                let payload = format!("live-{seq}");
                let r = sqlx::query(sqlx::AssertSqlSafe(format!(
                    "INSERT INTO {table} (topic, payload) VALUES ('order-live', $1)"
                )))
                .bind(payload.as_bytes())
                .execute(conn.as_mut().unwrap())
                .await;
                match r {
                    Ok(_) => {
                        committed.lock().unwrap().push(payload);
                        seq += 1;
                    }
                    // The outcome of this one is unknown; the table tells at the end.
                    Err(_) => {
                        conn = None;
                        seq += 1;
                    }
                }
            }
        })
    };

    // The drain is under way: then the primary crashes.
    let standby = PgPool::connect(&url(STANDBY)).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while count(&standby, table, Status::Sent).await < backlog / 4 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the drain did not start; log in {}",
            f.dir.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    pair("stop-primary");
    let crashed = std::time::Instant::now();
    // No host accepts writes: the watcher says so once, the relay is not ready (the standby
    // does not qualify: the relay does not write to it).
    let log_path = f.dir.join("failover.log");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(&log_path)
        .unwrap()
        .contains("no database host qualifies")
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no warning that no host qualifies within 30 s; log in {}",
            log_path.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let stranded_after = crashed.elapsed();
    let body = wait_status(&addr, "/readyz", 503, &f.dir).await;
    eprintln!("not ready after the crash: {body}");
    let unready_after = crashed.elapsed();
    let promoted: bool = sqlx::query_scalar("SELECT pg_promote()")
        .fetch_one(&standby)
        .await
        .unwrap();
    assert!(promoted);
    let promoted_at = std::time::Instant::now();
    wait_status(&addr, "/readyz", 200, &f.dir).await;
    let ready_after = promoted_at.elapsed();
    // A while of traffic on the new primary, then the producer stops.
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.cancel();
    producer.await.unwrap();
    wait_all_sent_none_failed(&standby, table, Duration::from_secs(120)).await;
    let drained_after = promoted_at.elapsed();

    assert!(
        relays.0[0].try_wait().unwrap().is_none(),
        "the daemon is the one started before the failover (no restart)"
    );
    let rows: Vec<(String, Vec<u8>)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT message_id::text, payload FROM {table}"
    )))
    .fetch_all(&standby)
    .await
    .unwrap();
    let committed = committed.lock().unwrap().clone();
    nothing_lost(&rows, &committed, &js, &f.stream).await;
    let log = std::fs::read_to_string(&log_path).unwrap();
    assert!(
        log.contains("database failover"),
        "the failover is logged: {log}"
    );
    assert_eq!(
        log.matches("no database host qualifies").count(),
        1,
        "one warning while no host qualifies, not one per attempt"
    );
    assert_eq!(get(&addr, "/healthz").await.map(|(c, _)| c), Some(200));
    eprintln!(
        "failover: {} messages ({} live), no host qualified {:.1} s and not ready {:.1} s after the crash, ready {:.1} s and drained {:.1} s after the promotion",
        rows.len(),
        committed.len(),
        stranded_after.as_secs_f64(),
        unready_after.as_secs_f64(),
        ready_after.as_secs_f64(),
        drained_after.as_secs_f64()
    );
    drop(relays);
    standby.close().await;
    js.delete_stream(&f.stream).await.unwrap();
    pair("drop");
}

const MARIA_PRIMARY: u16 = 3317;
const MARIA_REPLICA: u16 = 3318;

fn maria_url(port: u16) -> String {
    format!("mysql://relay@127.0.0.1:{port}/test")
}

/// A connection to whichever MariaDB server accepts writes now (not `read_only`), if any.
async fn maria_writable() -> Option<sqlx::MySqlConnection> {
    use sqlx::Connection as _;
    for port in [MARIA_PRIMARY, MARIA_REPLICA] {
        if let Ok(Ok(mut c)) = tokio::time::timeout(
            Duration::from_secs(2),
            sqlx::MySqlConnection::connect(&maria_url(port)),
        )
        .await
        {
            let read_only: Result<i64, _> = sqlx::query_scalar("SELECT @@global.read_only")
                .fetch_one(&mut c)
                .await;
            if matches!(read_only, Ok(0)) {
                return Some(c);
            }
        }
    }
    None
}

/// A TCP proxy on a free port forwarding each new connection to the port in `upstream`
/// (changed by the test, as a virtual IP moves); its port.
async fn switchable_proxy(upstream: Arc<std::sync::atomic::AtomicU16>) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let Ok((mut client, _)) = listener.accept().await else {
                return;
            };
            let to = upstream.load(std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(async move {
                if let Ok(mut server) = tokio::net::TcpStream::connect(("127.0.0.1", to)).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
        }
    });
    port
}

/// Rows of `table` not SENT: `(status, last_error)`.
async fn maria_unsent(pool: &sqlx::MySqlPool, table: &str) -> Vec<(i16, Option<String>)> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT status, last_error FROM {table} WHERE status <> {}",
        Status::Sent.as_i16()
    )))
    .fetch_all(pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn daemon_follows_a_promoted_mariadb_replica_behind_a_proxy() {
    use std::sync::atomic::{AtomicU16, Ordering};
    let backlog: i64 = std::env::var("OUTBOX_FAILOVER_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5_000);
    let maria = |action: &str| script("mariadb-pair.sh", "MariaDB primary/replica pair", action);
    maria("reset");
    let f = Fixture::new("mfailover");
    let table = &f.table;
    succeeds(
        outbox()
            .args(["migrate", "--database", &maria_url(MARIA_PRIMARY)])
            .args(["--table", table])
            .arg("--inbox-table")
            .arg(format!("{table}_inbox")),
    );
    let js = nats().await;
    let primary = sqlx::MySqlPool::connect(&maria_url(MARIA_PRIMARY))
        .await
        .unwrap();
    for chunk in 0..(backlog + 999) / 1_000 {
        let n = 1_000.min(backlog - chunk * 1_000);
        let values = vec!["('order-created', 'backlog')"; n as usize].join(",");
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {table} (topic, payload) VALUES {values}"
        )))
        .execute(&primary)
        .await
        .unwrap();
    }
    primary.close().await;

    let upstream = Arc::new(AtomicU16::new(MARIA_PRIMARY));
    let proxy = switchable_proxy(upstream.clone()).await;
    let addr = free_addr();
    let relay = "name = \"mfailover\"\npoll_interval = \"200ms\"\nlease = \"3s\"\npublish_timeout = \"1s\"\nbatch_size = 200\n";
    let toml = f.toml(relay, &f.route("*")).replacen(
        &pg_url(),
        &format!("mysql://relay@127.0.0.1:{proxy}/test"),
        1,
    ) + &format!("\n[admin]\nlisten = \"{addr}\"\n");
    let config = f.write("mfailover.toml", &toml);
    let mut relays = Relays(vec![f.spawn_relay_logged(&config, "mfailover")]);
    wait_status(&addr, "/readyz", 200, &f.dir).await;

    // A producer writing one message every 5 ms to whichever server accepts writes: the payloads
    // of the commits that returned (semi-synchronous: the replica received them).
    let committed: Arc<Mutex<Vec<String>>> = Arc::default();
    let stop = tokio_util::sync::CancellationToken::new();
    let producer = {
        let (committed, stop, table) = (committed.clone(), stop.clone(), table.clone());
        tokio::spawn(async move {
            let mut conn = None;
            let mut seq = 0u64;
            while !stop.is_cancelled() {
                tokio::time::sleep(Duration::from_millis(5)).await;
                if conn.is_none() {
                    conn = maria_writable().await;
                    continue;
                }
                let payload = format!("live-{seq}");
                let r = sqlx::query(sqlx::AssertSqlSafe(format!(
                    "INSERT INTO {table} (topic, payload) VALUES ('order-live', ?)"
                )))
                .bind(payload.as_bytes())
                .execute(conn.as_mut().unwrap())
                .await;
                seq += 1;
                match r {
                    Ok(_) => committed.lock().unwrap().push(payload),
                    // The outcome of this one is unknown; the table tells at the end.
                    Err(_) => conn = None,
                }
            }
        })
    };

    let replica = sqlx::MySqlPool::connect(&maria_url(MARIA_REPLICA))
        .await
        .unwrap();
    let sent = |pool: sqlx::MySqlPool| {
        let table = table.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!(
                "SELECT COUNT(*) FROM {table} WHERE status = {}",
                Status::Sent.as_i16()
            )))
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while sent(replica.clone()).await < backlog / 4 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the drain did not start; log in {}",
            f.dir.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    maria("stop-primary");
    let crashed = std::time::Instant::now();
    // The proxy follows the surviving server before it is promoted: the relay meets a
    // read-only server, writes nothing there, and is not ready.
    upstream.store(MARIA_REPLICA, Ordering::SeqCst);
    let body = wait_status(&addr, "/readyz", 503, &f.dir).await;
    eprintln!("not ready after the crash: {body}");
    let unready_after = crashed.elapsed();
    let log_path = f.dir.join("mfailover.log");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(&log_path)
        .unwrap()
        .contains("read-only")
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no error naming the read-only server within 30 s; log in {}",
            log_path.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let read_only_after = crashed.elapsed();
    maria("promote");
    let promoted_at = std::time::Instant::now();
    wait_status(&addr, "/readyz", 200, &f.dir).await;
    let ready_after = promoted_at.elapsed();
    // A while of traffic on the new primary, then the producer stops.
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.cancel();
    producer.await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let unsent = maria_unsent(&replica, table).await;
        let failed: Vec<_> = unsent
            .iter()
            .filter(|r| r.0 == Status::Failed.as_i16())
            .collect();
        assert!(failed.is_empty(), "dead-lettered: {failed:?}");
        if unsent.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} message(s) not SENT within 120 s; log in {}",
            unsent.len(),
            f.dir.display()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let drained_after = promoted_at.elapsed();

    assert!(
        relays.0[0].try_wait().unwrap().is_none(),
        "the daemon is the one started before the failover (no restart)"
    );
    let rows: Vec<(String, Vec<u8>)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT message_id, payload FROM {table}"
    )))
    .fetch_all(&replica)
    .await
    .unwrap();
    let committed = committed.lock().unwrap().clone();
    nothing_lost(&rows, &committed, &js, &f.stream).await;
    assert_eq!(get(&addr, "/healthz").await.map(|(c, _)| c), Some(200));
    eprintln!(
        "MariaDB failover: {} messages ({} live), not ready {:.1} s and the read-only server named {:.1} s after the crash, ready {:.1} s and drained {:.1} s after the promotion",
        rows.len(),
        committed.len(),
        unready_after.as_secs_f64(),
        read_only_after.as_secs_f64(),
        ready_after.as_secs_f64(),
        drained_after.as_secs_f64()
    );
    drop(relays);
    replica.close().await;
    js.delete_stream(&f.stream).await.unwrap();
    maria("drop");
}

/// After a failover: every payload in `committed` (commits the producer saw return) is among
/// `rows` (`(message_id, payload)` of the new primary's table), the producer wrote on both sides
/// of it, and the stream holds every message of the table exactly once.
async fn nothing_lost(
    rows: &[(String, Vec<u8>)],
    committed: &[String],
    js: &async_nats::jetstream::Context,
    stream: &str,
) {
    let payloads: HashSet<String> = rows
        .iter()
        .map(|(_, p)| String::from_utf8_lossy(p).into_owned())
        .collect();
    let lost: Vec<&String> = committed
        .iter()
        .filter(|p| !payloads.contains(*p))
        .collect();
    assert!(
        lost.is_empty(),
        "committed messages missing on the promoted server: {lost:?}"
    );
    assert!(
        committed.len() > 100,
        "the producer wrote on both sides of the failover"
    );
    let ids = stream_ids(js, stream, rows.len()).await;
    let in_table: HashSet<String> = rows.iter().map(|(id, _)| id.clone()).collect();
    assert_eq!(
        ids, in_table,
        "every message of the table in the stream, each once"
    );
}
