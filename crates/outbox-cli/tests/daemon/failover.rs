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

use std::future::Future;
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

/// The backlog the drain starts from: `OUTBOX_FAILOVER_MESSAGES`, 5,000 by default.
fn backlog() -> i64 {
    std::env::var("OUTBOX_FAILOVER_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5_000)
}

/// The daemon's configuration `<name>.toml` for a failover test: the fixture's stream, the
/// database at `database`, quick polls and leases, the admin listener on `addr`.
fn failover_config(f: &Fixture, name: &str, database: &str, addr: &str) -> PathBuf {
    let relay = format!(
        "name = \"{name}\"\npoll_interval = \"200ms\"\nlease = \"3s\"\npublish_timeout = \"1s\"\nbatch_size = 200\n"
    );
    let toml = f
        .toml(&relay, &f.route("*"))
        .replacen(&pg_url(), database, 1)
        + &format!("\n[admin]\nlisten = \"{addr}\"\n");
    f.write(&format!("{name}.toml"), &toml)
}

/// Wait until the log at `path` contains `needle` (30 s at most; `what` names it).
async fn wait_logged(path: &Path, needle: &str, what: &str) {
    eventually!(
        Duration::from_secs(30),
        Duration::from_millis(50),
        std::fs::read_to_string(path).unwrap().contains(needle),
        "no {what} within 30 s; log in {}",
        path.display()
    );
}

/// A connection to a server of a primary/replica pair, as the live producer uses it.
trait PairServer: sqlx::Connection + Send + 'static {
    /// The pair's ports, primary first.
    const PORTS: [u16; 2];

    /// The URL of the server on `port`.
    fn url(port: u16) -> String;

    /// Whether the server accepts writes now.
    fn accepts_writes(&mut self) -> impl Future<Output = bool> + Send;

    /// Insert one message of topic `order-live` with `payload` into `table`.
    fn insert_live(
        &mut self,
        table: &str,
        payload: &str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
}

impl PairServer for sqlx::PgConnection {
    const PORTS: [u16; 2] = [PRIMARY, STANDBY];

    fn url(port: u16) -> String {
        url(port)
    }

    async fn accepts_writes(&mut self) -> bool {
        let recovery: Result<bool, _> = sqlx::query_scalar("SELECT pg_is_in_recovery()")
            .fetch_one(self)
            .await;
        matches!(recovery, Ok(false))
    }

    async fn insert_live(&mut self, table: &str, payload: &str) -> Result<(), sqlx::Error> {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {table} (topic, payload) VALUES ('order-live', $1)"
        )))
        .bind(payload.as_bytes())
        .execute(self)
        .await
        .map(drop)
    }
}

impl PairServer for sqlx::MySqlConnection {
    const PORTS: [u16; 2] = [MARIA_PRIMARY, MARIA_REPLICA];

    fn url(port: u16) -> String {
        maria_url(port)
    }

    /// Not `read_only`.
    async fn accepts_writes(&mut self) -> bool {
        let read_only: Result<i64, _> = sqlx::query_scalar("SELECT @@global.read_only")
            .fetch_one(self)
            .await;
        matches!(read_only, Ok(0))
    }

    async fn insert_live(&mut self, table: &str, payload: &str) -> Result<(), sqlx::Error> {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {table} (topic, payload) VALUES ('order-live', ?)"
        )))
        .bind(payload.as_bytes())
        .execute(self)
        .await
        .map(drop)
    }
}

/// A connection to whichever server of the pair accepts writes now, if any.
async fn writable<C: PairServer>() -> Option<C> {
    for port in C::PORTS {
        if let Ok(Ok(mut c)) =
            tokio::time::timeout(Duration::from_secs(2), C::connect(&C::url(port))).await
            && c.accepts_writes().await
        {
            return Some(c);
        }
    }
    None
}

/// A producer writing one message every 5 ms to whichever server of the pair accepts writes,
/// keeping the payloads of the commits that returned (the replica has them: replication is
/// synchronous or semi-synchronous).
struct LiveProducer {
    committed: Arc<Mutex<Vec<String>>>,
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl LiveProducer {
    fn start<C: PairServer>(table: &str) -> LiveProducer {
        let committed: Arc<Mutex<Vec<String>>> = Arc::default();
        let stop = tokio_util::sync::CancellationToken::new();
        let task = {
            let (committed, stop, table) = (committed.clone(), stop.clone(), table.to_owned());
            tokio::spawn(async move {
                let mut conn: Option<C> = None;
                let mut seq = 0u64;
                while !stop.is_cancelled() {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    let Some(c) = conn.as_mut() else {
                        conn = writable().await;
                        continue;
                    };
                    let payload = format!("live-{seq}");
                    let r = c.insert_live(&table, &payload).await;
                    seq += 1;
                    match r {
                        Ok(()) => committed.lock().unwrap().push(payload),
                        // The outcome of this one is unknown; the table tells at the end.
                        Err(_) => conn = None,
                    }
                }
            })
        };
        LiveProducer {
            committed,
            stop,
            task,
        }
    }

    /// Stop the producer: the payloads of its commits that returned.
    async fn stop(self) -> Vec<String> {
        self.stop.cancel();
        self.task.await.unwrap();
        self.committed.lock().unwrap().clone()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn daemon_follows_a_promoted_standby_without_a_restart() {
    let backlog = backlog();
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
    let multi = format!(
        "postgres://postgres@127.0.0.1:{PRIMARY},127.0.0.1:{STANDBY}/postgres?target_session_attrs=read-write"
    );
    let config = failover_config(&f, "failover", &multi, &addr);
    let mut relays = Relays(vec![f.spawn_relay_logged(&config, "failover")]);
    wait_status(&addr, "/readyz", 200, &f.dir).await;
    let producer = LiveProducer::start::<sqlx::PgConnection>(table);

    // The drain is under way: then the primary crashes.
    let standby = PgPool::connect(&url(STANDBY)).await.unwrap();
    eventually!(
        Duration::from_secs(60),
        Duration::from_millis(20),
        count(&standby, table, Status::Sent).await >= backlog / 4,
        "the drain did not start; log in {}",
        f.dir.display()
    );
    pair("stop-primary");
    let crashed = std::time::Instant::now();
    // No host accepts writes: the watcher says so once, the relay is not ready (the standby
    // does not qualify: the relay does not write to it).
    let log_path = f.dir.join("failover.log");
    wait_logged(
        &log_path,
        "no database host qualifies",
        "warning that no host qualifies",
    )
    .await;
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
    let committed = producer.stop().await;
    wait_all_sent_none_failed(&standby, table, Duration::from_secs(120)).await;
    let drained_after = promoted_at.elapsed();

    let rows: Vec<(String, Vec<u8>)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT message_id::text, payload FROM {table}"
    )))
    .fetch_all(&standby)
    .await
    .unwrap();
    nothing_lost(&mut relays, &rows, &committed, &js, &f.stream).await;
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
    let backlog = backlog();
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
    let through_proxy = format!("mysql://relay@127.0.0.1:{proxy}/test");
    let config = failover_config(&f, "mfailover", &through_proxy, &addr);
    let mut relays = Relays(vec![f.spawn_relay_logged(&config, "mfailover")]);
    wait_status(&addr, "/readyz", 200, &f.dir).await;
    let producer = LiveProducer::start::<sqlx::MySqlConnection>(table);

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
    eventually!(
        Duration::from_secs(60),
        Duration::from_millis(20),
        sent(replica.clone()).await >= backlog / 4,
        "the drain did not start; log in {}",
        f.dir.display()
    );
    maria("stop-primary");
    let crashed = std::time::Instant::now();
    // The proxy follows the surviving server before it is promoted: the relay meets a
    // read-only server, writes nothing there, and is not ready.
    upstream.store(MARIA_REPLICA, Ordering::SeqCst);
    let body = wait_status(&addr, "/readyz", 503, &f.dir).await;
    eprintln!("not ready after the crash: {body}");
    let unready_after = crashed.elapsed();
    let log_path = f.dir.join("mfailover.log");
    wait_logged(&log_path, "read-only", "error naming the read-only server").await;
    let read_only_after = crashed.elapsed();
    maria("promote");
    let promoted_at = std::time::Instant::now();
    wait_status(&addr, "/readyz", 200, &f.dir).await;
    let ready_after = promoted_at.elapsed();
    // A while of traffic on the new primary, then the producer stops.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let committed = producer.stop().await;
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

    let rows: Vec<(String, Vec<u8>)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT message_id, payload FROM {table}"
    )))
    .fetch_all(&replica)
    .await
    .unwrap();
    nothing_lost(&mut relays, &rows, &committed, &js, &f.stream).await;
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

/// After a failover: the daemon is the one started before it (no restart), every payload in
/// `committed` (commits the producer saw return) is among `rows` (`(message_id, payload)` of the
/// new primary's table), the producer wrote on both sides of it, and the stream holds every
/// message of the table exactly once.
async fn nothing_lost(
    relays: &mut Relays,
    rows: &[(String, Vec<u8>)],
    committed: &[String],
    js: &async_nats::jetstream::Context,
    stream: &str,
) {
    assert!(
        relays.0[0].try_wait().unwrap().is_none(),
        "the daemon is the one started before the failover (no restart)"
    );
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
