//! The `outbox` binary as an operator runs it: plain-SQL producers, the relay daemon with a TOML
//! file, SIGTERM and kill -9, configuration errors, and one relay routing topics to two brokers.
//! Needs the PostgreSQL and NATS JetStream servers (`OUTBOX_TEST_POSTGRES_URL`,
//! `OUTBOX_TEST_NATS_URL`) and, with the `redis` feature, Redis (`OUTBOX_TEST_REDIS_URL`).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use futures::StreamExt;
use outbox::Status;
use sqlx::PgPool;

/// Poll until `$cond` (which may `.await`) holds, every `$every`; past `$within` (or the instant
/// after `until`), fail with the message (`assert!`'s format arguments). Defined before the
/// modules, which use it.
macro_rules! eventually {
    (until $deadline:expr, $every:expr, $cond:expr, $($msg:tt)+) => {{
        let deadline: tokio::time::Instant = $deadline;
        while !$cond {
            assert!(tokio::time::Instant::now() < deadline, $($msg)+);
            tokio::time::sleep($every).await;
        }
    }};
    ($within:expr, $every:expr, $cond:expr, $($msg:tt)+) => {
        eventually!(until tokio::time::Instant::now() + $within, $every, $cond, $($msg)+)
    };
}

mod dashboard;
mod databases;
mod failover;
mod lifecycle;
mod logs;
mod messages;
mod metrics;
mod routing;
mod traces;

fn pg_url() -> String {
    std::env::var("OUTBOX_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

fn nats_url() -> String {
    std::env::var("OUTBOX_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

async fn pg() -> PgPool {
    PgPool::connect(&pg_url()).await.unwrap_or_else(|e| {
        panic!(
            "PostgreSQL is required at {} (set OUTBOX_TEST_POSTGRES_URL): {e}",
            pg_url()
        )
    })
}

async fn nats() -> async_nats::jetstream::Context {
    let client = async_nats::connect(nats_url()).await.unwrap_or_else(|e| {
        panic!(
            "NATS JetStream is required at {} (set OUTBOX_TEST_NATS_URL): {e}",
            nats_url()
        )
    });
    async_nats::jetstream::new(client)
}

fn outbox() -> Command {
    Command::new(env!("CARGO_BIN_EXE_outbox"))
}

/// `outbox relay --config <config>`.
fn relay_cmd(config: &Path) -> Command {
    let mut cmd = outbox();
    cmd.args(["relay", "--config"]).arg(config);
    cmd
}

/// A SQLite database `<fixture dir>/<file>` made by `outbox migrate`, holding one row per
/// `(status, attempts, last_error)`, ids from 1 in order: its URL.
fn sqlite_with_rows(f: &Fixture, file: &str, rows: &[(Status, i64, Option<&str>)]) -> String {
    let db = format!("sqlite://{}", f.dir.join(file).display());
    succeeds(outbox().args(["migrate", "--database", &db]));
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let pool = sqlx::SqlitePool::connect(&db).await.unwrap();
        for (i, (status, attempts, error)) in rows.iter().enumerate() {
            sqlx::query(
                "INSERT INTO outbox (message_id, topic, payload, status, attempts, last_error) \
                 VALUES (?1, 't', x'00', ?2, ?3, ?4)",
            )
            .bind(format!("00000000-0000-7000-8000-{:012}", i + 1))
            .bind(status.as_i16())
            .bind(attempts)
            .bind(error)
            .execute(&pool)
            .await
            .unwrap();
        }
    });
    db
}

/// Run `cmd` to its end, which must be a success; its standard output.
fn succeeds(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Run `cmd` to its end, which must be a failure; its standard error.
fn fails(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(!out.status.success(), "{cmd:?} succeeded");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

struct Fixture {
    dir: PathBuf,
    table: String,
    stream: String,
    subject: String,
}

impl Fixture {
    fn new(name: &str) -> Fixture {
        let suffix = format!("{:08x}", rand::random::<u32>());
        let dir = std::env::temp_dir().join(format!("outbox-daemon-{name}-{suffix}"));
        std::fs::create_dir_all(&dir).unwrap();
        Fixture {
            dir,
            table: format!("daemon_{name}_{suffix}"),
            stream: format!("DAEMON_{}_{suffix}", name.to_uppercase()),
            subject: format!("daemon.{name}.{suffix}"),
        }
    }

    /// The daemon's TOML: this fixture's database and NATS stream, `relay` as the body of the
    /// `[relay]` section, then `routes`.
    fn toml(&self, relay: &str, routes: &str) -> String {
        format!(
            r#"
[database]
url = "{pg}"
table = "{table}"
inbox_table = "{table}_inbox"

[relay]
{relay}
[transports.bus]
kind = "nats"
url = "{nats}"
stream = "{stream}"
subjects = ["{subject}.>"]
{routes}"#,
            pg = pg_url(),
            nats = nats_url(),
            table = self.table,
            stream = self.stream,
            subject = self.subject,
        )
    }

    /// A route of `topics` to the fixture's stream, subject `<subject>.<topic>`.
    fn route(&self, topics: &str) -> String {
        format!(
            "\n[[routes]]\ntopics = \"{topics}\"\ntransport = \"bus\"\ndestination = \"{}.{{topic}}\"\n",
            self.subject
        )
    }

    /// A fixture named `name` whose tables are migrated, with a PostgreSQL pool and NATS
    /// JetStream.
    async fn started(name: &str) -> (Fixture, PgPool, async_nats::jetstream::Context) {
        let f = Fixture::new(name);
        f.migrate();
        (f, pg().await, nats().await)
    }

    /// Write `text` to `<dir>/<name>`: its path.
    fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    fn config(&self, lease: &str, publish_timeout: &str) -> PathBuf {
        let path = self.dir.join("outbox.toml");
        let relay = format!(
            "poll_interval = \"30s\"\nlease = \"{lease}\"\npublish_timeout = \"{publish_timeout}\"\n\
             maintenance_interval = \"500ms\"\nbatch_size = 200\n"
        );
        std::fs::write(&path, self.toml(&relay, &self.route("*"))).unwrap();
        path
    }

    fn spawn_relay(&self, config: &Path) -> Child {
        outbox()
            .args(["relay", "--config"])
            .arg(config)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start outbox relay")
    }

    fn migrate(&self) {
        succeeds(
            outbox()
                .args(["migrate", "--database", &pg_url(), "--table", &self.table])
                .arg("--inbox-table")
                .arg(format!("{}_inbox", self.table)),
        );
    }
}

async fn count(pool: &PgPool, table: &str, status: Status) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {table} WHERE status = $1"
    )))
    .bind(status.as_i16())
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn wait_until_sent(pool: &PgPool, table: &str, n: i64, within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let sent = count(pool, table, Status::Sent).await;
        if sent == n {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {sent} of {n} rows SENT within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An ephemeral pull consumer of `stream` that acknowledges nothing.
async fn unacked_consumer(
    stream: &async_nats::jetstream::stream::Stream,
) -> async_nats::jetstream::consumer::Consumer<async_nats::jetstream::consumer::pull::Config> {
    stream
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            ack_policy: async_nats::jetstream::consumer::AckPolicy::None,
            ..Default::default()
        })
        .await
        .unwrap()
}

/// Up to `max` messages of `consumer`, as they come within `expires`.
async fn fetch(
    consumer: &async_nats::jetstream::consumer::Consumer<
        async_nats::jetstream::consumer::pull::Config,
    >,
    max: usize,
    expires: Duration,
) -> async_nats::jetstream::consumer::pull::Batch {
    consumer
        .fetch()
        .max_messages(max)
        .expires(expires)
        .messages()
        .await
        .unwrap()
}

/// Header `name` of `m`, which must carry it.
fn header(m: &async_nats::Message, name: &str) -> String {
    m.headers
        .as_ref()
        .and_then(|h| h.get(name))
        .map(|v| v.to_string())
        .unwrap_or_else(|| panic!("no {name} header on the message"))
}

/// The message ids in the stream, read with an ephemeral consumer; panics on a duplicate.
async fn stream_ids(
    js: &async_nats::jetstream::Context,
    stream: &str,
    expected: usize,
) -> HashSet<String> {
    let stream = js.get_stream(stream).await.unwrap();
    let consumer = unacked_consumer(&stream).await;
    let mut ids = HashSet::new();
    let mut messages = fetch(&consumer, expected + 10, Duration::from_secs(2)).await;
    while let Some(m) = messages.next().await {
        let id = header(&m.unwrap(), "Nats-Msg-Id");
        assert!(
            ids.insert(id.clone()),
            "message {id} is in the stream twice"
        );
    }
    ids
}

fn nix_kill(child: &Child, signal: &str) {
    let ok = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(child.id().to_string())
        .status()
        .unwrap();
    assert!(ok.success());
}

fn wait_exit(child: &mut Child, within: Duration) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + within;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("process did not exit within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl Fixture {
    /// A relay configuration named `name` routing exactly `patterns` to the fixture's stream
    /// (lease 3 s: a membership round every second).
    fn routes_config(&self, name: &str, patterns: &[&str]) -> PathBuf {
        let path = self.dir.join(format!("{name}.toml"));
        let routes: String = patterns.iter().map(|p| self.route(p)).collect();
        let relay = format!(
            "name = \"{name}\"\npoll_interval = \"300ms\"\nlease = \"3s\"\npublish_timeout = \"1s\"\n\
             reap_interval = \"500ms\" # the name before 0.2, still accepted\nbatch_size = 100\n"
        );
        std::fs::write(&path, self.toml(&relay, &routes)).unwrap();
        path
    }
}

impl Fixture {
    /// Start `outbox relay` with `config`, its log (`RUST_LOG=info`) in `<dir>/<name>.log`.
    fn spawn_relay_logged(&self, config: &Path, name: &str) -> Child {
        let log = std::fs::File::create(self.dir.join(format!("{name}.log"))).unwrap();
        outbox()
            .args(["relay", "--config"])
            .arg(config)
            .env("RUST_LOG", "info,sqlx=warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start outbox relay")
    }
}

/// Kills the relays when dropped (a failing test leaves no relay running).
struct Relays(Vec<Child>);

impl Drop for Relays {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Waits until the relays `names` all heartbeat in the membership table.
async fn wait_live(pool: &PgPool, table: &str, names: &[&str]) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let live: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT name FROM {table}_relays WHERE heartbeat_at > now() - interval '3 seconds'"
        )))
        .fetch_all(pool)
        .await
        .unwrap();
        if names.iter().all(|n| live.iter().any(|l| l == n)) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "relays {names:?} not live within 20 s (live: {live:?})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A plain-SQL message on `topic` with `payload`, written through `executor` (a pool or a
/// transaction).
async fn insert_message<'c>(
    executor: impl sqlx::PgExecutor<'c>,
    table: &str,
    topic: &str,
    payload: impl Into<Vec<u8>>,
) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {table} (topic, payload) VALUES ($1, $2)"
    )))
    .bind(topic)
    .bind(payload.into())
    .execute(executor)
    .await
    .unwrap();
}

/// Plain-SQL `n` messages on each of `topics`, without partition key (spread over the buckets).
async fn enqueue_topics(pool: &PgPool, table: &str, topics: &[&str], n: i64) {
    for t in topics {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {table} (topic, payload) SELECT $1, convert_to(g::text, 'UTF8') \
             FROM generate_series(1, $2) g"
        )))
        .bind(*t)
        .bind(n)
        .execute(pool)
        .await
        .unwrap();
    }
}

/// Waits until every row is SENT; fails at once, with the reason, when one is FAILED.
async fn wait_all_sent_none_failed(pool: &PgPool, table: &str, within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let rows: Vec<(i16, Option<String>, String)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT status, last_error, topic FROM {table} WHERE status <> {} ORDER BY status DESC",
            Status::Sent.as_i16()
        )))
        .fetch_all(pool)
        .await
        .unwrap();
        let failed: Vec<_> = rows.iter().filter(|r| r.0 == 4).collect();
        assert!(
            failed.is_empty(),
            "{} message(s) dead-lettered, e.g. topic {:?}: {:?}",
            failed.len(),
            failed[0].2,
            failed[0].1
        );
        if rows.is_empty() {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} message(s) not SENT within {within:?}",
            rows.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A free loopback port: bound, then released, so nothing listens on it.
fn closed_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Listen on `port` and forward every connection to `upstream` (`host:port`): the broker "comes
/// back" on the address the daemon was configured with.
async fn forward(port: u16, upstream: String) -> tokio::task::JoinHandle<()> {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .expect("bind the forwarder on the closed port");
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            let upstream = upstream.clone();
            tokio::spawn(async move {
                if let Ok(mut server) = tokio::net::TcpStream::connect(&upstream).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
        }
    })
}
