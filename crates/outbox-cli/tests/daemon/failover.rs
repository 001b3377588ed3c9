//! Database failover (issue 18): the daemon on a PostgreSQL primary with a streaming-replication
//! standby (`.ci/pg-pair.sh`: two more clusters of the installed PostgreSQL, 127.0.0.1:5433 and
//! :5434, replicating synchronously), its URL naming both hosts as libpq does
//! (`target_session_attrs=read-write`). In the middle of a drain, with a producer writing, the
//! primary crashes (immediate stop); while no host accepts writes the relay writes nowhere and is
//! not ready; the standby is promoted; the relay follows it without a restart. Every message
//! committed (hence on the standby) is published, each once in the stream; none is dead-lettered.
//! Needs root (to create the clusters), PostgreSQL's server packages and NATS JetStream.

use std::sync::{Arc, Mutex};

use super::metrics::{free_addr, get, wait_status};
use super::*;

const PRIMARY: u16 = 5433;
const STANDBY: u16 = 5434;

fn url(port: u16) -> String {
    format!("postgres://postgres@127.0.0.1:{port}/postgres")
}

fn pair(action: &str) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.ci/pg-pair.sh");
    let out = Command::new("bash")
        .arg(&script)
        .arg(action)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the PostgreSQL primary/standby pair of the failover test is required: `{} {action}` failed: {}{}",
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
    let payloads: HashSet<String> = rows
        .iter()
        .map(|(_, p)| String::from_utf8_lossy(p).into_owned())
        .collect();
    let committed = committed.lock().unwrap().clone();
    let lost: Vec<&String> = committed
        .iter()
        .filter(|p| !payloads.contains(*p))
        .collect();
    assert!(
        lost.is_empty(),
        "committed messages missing on the promoted standby: {lost:?}"
    );
    assert!(
        committed.len() > 100,
        "the producer wrote on both sides of the failover"
    );
    let ids = stream_ids(&js, &f.stream, rows.len()).await;
    let in_table: HashSet<String> = rows.iter().map(|(id, _)| id.clone()).collect();
    assert_eq!(
        ids, in_table,
        "every message of the table in the stream, each once"
    );
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
