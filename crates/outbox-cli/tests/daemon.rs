//! The `outbox` binary as an operator runs it: plain-SQL producers, the relay daemon with a TOML
//! file, SIGTERM and kill -9, configuration errors, and one relay routing topics to two brokers.
//! Needs the PostgreSQL and NATS JetStream servers (`OUTBOX_TEST_POSTGRES_URL`,
//! `OUTBOX_TEST_NATS_URL`) and, with the `redis` feature, Redis (`OUTBOX_TEST_REDIS_URL`).

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use futures::StreamExt;
use sqlx::PgPool;

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

    fn config(&self, lease: &str, publish_timeout: &str) -> PathBuf {
        let path = self.dir.join("outbox.toml");
        std::fs::write(
            &path,
            format!(
                r#"
[database]
url = "{pg}"
table = "{table}"
inbox_table = "{table}_inbox"

[relay]
poll_interval = "30s"
lease = "{lease}"
publish_timeout = "{publish_timeout}"
maintenance_interval = "500ms"
batch_size = 200

[transports.bus]
kind = "nats"
url = "{nats}"
stream = "{stream}"
subjects = ["{subject}.>"]

[[routes]]
topics = "*"
transport = "bus"
destination = "{subject}.{{topic}}"
"#,
                pg = pg_url(),
                nats = nats_url(),
                table = self.table,
                stream = self.stream,
                subject = self.subject,
            ),
        )
        .unwrap();
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
        let out = outbox()
            .args([
                "migrate",
                "--database",
                &pg_url(),
                "--table",
                &self.table,
                "--inbox-table",
            ])
            .arg(format!("{}_inbox", self.table))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "migrate failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

async fn count(pool: &PgPool, table: &str, status: i16) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {table} WHERE status = $1"
    )))
    .bind(status)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn wait_until_sent(pool: &PgPool, table: &str, n: i64, within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let sent = count(pool, table, 2).await;
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

/// The message ids in the stream, read with an ephemeral consumer; panics on a duplicate.
async fn stream_ids(
    js: &async_nats::jetstream::Context,
    stream: &str,
    expected: usize,
) -> HashSet<String> {
    let stream = js.get_stream(stream).await.unwrap();
    let consumer = stream
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            ack_policy: async_nats::jetstream::consumer::AckPolicy::None,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut ids = HashSet::new();
    let mut messages = consumer
        .fetch()
        .max_messages(expected + 10)
        .expires(Duration::from_secs(2))
        .messages()
        .await
        .unwrap();
    while let Some(m) = messages.next().await {
        let m = m.unwrap();
        let id = m
            .headers
            .as_ref()
            .and_then(|h| h.get("Nats-Msg-Id"))
            .map(|v| v.to_string())
            .expect("Nats-Msg-Id");
        assert!(
            ids.insert(id.clone()),
            "message {id} is in the stream twice"
        );
    }
    ids
}

#[tokio::test]
async fn plain_sql_rows_are_published_to_nats_and_sigterm_exits_cleanly() {
    let f = Fixture::new("sql");
    f.migrate();
    let pool = pg().await;
    let js = nats().await;
    let config = f.config("30s", "5s");
    let mut relay = f.spawn_relay(&config);
    // A producer in another language: plain SQL, its own transaction, no library involved.
    let mut tx = pool.begin().await.unwrap();
    for i in 0..50 {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {} (topic, partition_key, payload) VALUES ('order-created', $1, $2)",
            f.table
        )))
        .bind(format!("order-{i}"))
        .bind(format!("{{\"order\":{i}}}").into_bytes())
        .execute(&mut *tx)
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    // poll_interval is 30 s: only the NOTIFY wake-up can deliver this fast.
    wait_until_sent(&pool, &f.table, 50, Duration::from_secs(10)).await;
    let ids = stream_ids(&js, &f.stream, 50).await;
    let rows: Vec<uuid::Uuid> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT message_id FROM {}",
        f.table
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    let expected: HashSet<String> = rows.iter().map(|u| u.to_string()).collect();
    assert_eq!(ids, expected);

    nix_kill(&relay, "TERM");
    let status = wait_exit(&mut relay, Duration::from_secs(20));
    assert_eq!(
        status.code(),
        Some(0),
        "relay did not exit 0 on SIGTERM: {status:?}"
    );
    assert_eq!(
        count(&pool, &f.table, 1).await,
        0,
        "rows left SENDING after shutdown"
    );
    js.delete_stream(&f.stream).await.unwrap();
}

#[tokio::test]
async fn relay_killed_with_sigkill_mid_stream_loses_nothing() {
    let f = Fixture::new("kill");
    f.migrate();
    let pool = pg().await;
    let js = nats().await;
    let n = 20_000i64;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {} (topic, payload) SELECT 'order-created', convert_to(g::text, 'UTF8') FROM generate_series(1, $1) g",
        f.table
    )))
    .bind(n)
    .execute(&pool)
    .await
    .unwrap();
    let config = f.config("3s", "1s");
    for round in 0..3 {
        let mut relay = f.spawn_relay(&config);
        // Kill it once it has made progress, wherever it is.
        let target = (round + 1) * n / 5;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while count(&pool, &f.table, 2).await < target {
            assert!(
                tokio::time::Instant::now() < deadline,
                "relay made no progress in round {round}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        nix_kill(&relay, "KILL");
        wait_exit(&mut relay, Duration::from_secs(5));
    }
    let mut relay = f.spawn_relay(&config);
    wait_until_sent(&pool, &f.table, n, Duration::from_secs(60)).await;
    nix_kill(&relay, "TERM");
    wait_exit(&mut relay, Duration::from_secs(20));
    // Every row is in the stream once: re-publishes carry the same Nats-Msg-Id and JetStream
    // drops them within its duplicate window.
    let ids = stream_ids(&js, &f.stream, n as usize).await;
    assert_eq!(ids.len() as i64, n);
    let failed = count(&pool, &f.table, 4).await;
    assert_eq!(failed, 0);
    js.delete_stream(&f.stream).await.unwrap();
}

#[test]
fn bad_configuration_is_named_and_exits_non_zero() {
    let f = Fixture::new("badcfg");
    let path = f.dir.join("bad.toml");
    std::fs::write(
        &path,
        "[database]\nurl = \"sqlite://x.db\"\n[relay]\nlease = \"1s\"\n[transports.t]\nkind = \"webhook\"\nurl = \"http://127.0.0.1:9/\"\n[[routes]]\ntopics = \"*\"\ntransport = \"t\"\n",
    )
    .unwrap();
    let out = outbox()
        .args(["relay", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("relay.lease"), "{err}");

    std::fs::write(&path, "[database]\nurl = \"sqlite://x.db\"\nbogus = 1\n").unwrap();
    let out = outbox()
        .args(["relay", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("bogus"));

    // Environment overrides use OUTBOX_<SECTION>__<FIELD>, upper case as documented.
    std::fs::write(
        &path,
        "[relay]\nbatch_size = 100\n[transports.t]\nkind = \"webhook\"\nurl = \"http://127.0.0.1:9/\"\n[[routes]]\ntopics = \"*\"\ntransport = \"t\"\n",
    )
    .unwrap();
    let out = outbox()
        .args(["relay", "--config"])
        .arg(&path)
        .env("OUTBOX_DATABASE__URL", "sqlite://x.db")
        .env("OUTBOX_RELAY__BATCH_SIZE", "0")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("relay.batch_size"),
        "upper-case env override ignored: {err}"
    );
    let out = outbox()
        .args(["relay", "--config"])
        .arg(&path)
        .env_remove("OUTBOX_DATABASE_URL")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("database.url"));

    let out = outbox()
        .args(["status", "--database", "oracle://nope"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unsupported database URL"));
    // MySQL/MariaDB URLs are supported; an unreachable one names the URL.
    let out = outbox()
        .args(["status", "--database", "mysql://nope@127.0.0.1:1/x"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cannot open mysql://nope@127.0.0.1:1/x")
    );

    let db = format!("sqlite://{}", f.dir.join("empty.db").display());
    let out = outbox()
        .args(["status", "--database", &db])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("outbox migrate"),
        "missing-table error must say how to fix it"
    );
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

#[test]
fn requeue_moves_dead_letters_back_to_pending() {
    let f = Fixture::new("requeue");
    let db = format!("sqlite://{}", f.dir.join("rq.db").display());
    assert!(
        outbox()
            .args(["migrate", "--database", &db])
            .output()
            .unwrap()
            .status
            .success()
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let pool = sqlx::SqlitePool::connect(&db).await.unwrap();
        sqlx::query(
            "INSERT INTO outbox (message_id, topic, payload, status, attempts, last_error) VALUES \
             ('00000000-0000-7000-8000-000000000001', 't', x'00', 4, 16, 'attempts exhausted'), \
             ('00000000-0000-7000-8000-000000000002', 't', x'00', 4, 16, 'attempts exhausted'), \
             ('00000000-0000-7000-8000-000000000003', 't', x'00', 2, 1, NULL)",
        )
        .execute(&pool)
        .await
        .unwrap();
    });
    let out = outbox()
        .args(["requeue", "--database", &db, "--id", "1", "--id", "3"])
        .output()
        .unwrap();
    // The SENT row is not requeued: named, and the command fails (issue 11 item 12).
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("id 3: SENT, not FAILED"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("requeued 1 "),
        "a SENT row must not be requeued"
    );
    let out = outbox()
        .args(["requeue", "--database", &db])
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "requeue without --id or --all must be refused"
    );
    rt.block_on(async {
        let pool = sqlx::SqlitePool::connect(&db).await.unwrap();
        let rows: Vec<(i64, i64, i64, Option<String>)> =
            sqlx::query_as("SELECT id, status, attempts, last_error FROM outbox ORDER BY id")
                .fetch_all(&pool)
                .await
                .unwrap();
        assert_eq!(rows[0], (1, 0, 0, Some("attempts exhausted".into())));
        assert_eq!(rows[1].1, 4);
        assert_eq!(rows[2].1, 2);
    });
    let out = outbox()
        .args(["requeue", "--database", &db, "--all"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("requeued 1 "));
}

/// The daemon with a route that requires confirmation and a NATS confirmation listener: a
/// consumer that confirms gets its message CONFIRMED (or REJECTED with the reason); a message
/// nobody confirms is checked back (published again with the same id) and, after the configured
/// check-backs, FAILED as unconfirmed.
#[tokio::test]
async fn daemon_applies_confirmations_and_checks_back_the_unconfirmed() {
    let f = Fixture::new("confirm");
    f.migrate();
    let pool = pg().await;
    let js = nats().await;
    // Outside the stream's subjects, so confirmations are not stored as messages.
    let reply = format!("replies.{}", f.table);
    let config = f.config("30s", "5s");
    let mut toml = std::fs::read_to_string(&config).unwrap();
    toml = toml.replace(
        "destination = \"daemon.confirm.",
        &format!("confirm = {{ reply_to = \"{reply}\", timeout = \"1s\" }}\ndestination = \"daemon.confirm."),
    );
    toml = toml.replace("batch_size = 200", "batch_size = 200\nmax_check_backs = 1");
    toml.push_str(&format!(
        "\n[confirmations]\nkind = \"nats\"\nurl = \"{}\"\nsubject = \"{reply}\"\n",
        nats_url()
    ));
    std::fs::write(&config, toml).unwrap();
    let mut relay = f.spawn_relay(&config);
    for payload in ["confirm-me", "reject-me", "ignore-me"] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {} (topic, payload) VALUES ('order-created', $1)",
            f.table
        )))
        .bind(payload.as_bytes())
        .execute(&pool)
        .await
        .unwrap();
    }
    // A consumer reading the stream: answers the first two, never the third.
    let client = async_nats::connect(nats_url()).await.unwrap();
    let started = tokio::time::Instant::now();
    let stream = loop {
        // The relay creates the stream at start-up.
        match js.get_stream(&f.stream).await {
            Ok(s) => break s,
            Err(e) => assert!(
                started.elapsed() < Duration::from_secs(10),
                "stream never created: {e}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let consumer = stream
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            ack_policy: async_nats::jetstream::consumer::AckPolicy::None,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut copies_of_ignored = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let status_of = |payload: &'static str| {
        let pool = pool.clone();
        let table = f.table.clone();
        async move {
            let (status, err): (i16, Option<String>) = sqlx::query_as(sqlx::AssertSqlSafe(
                format!("SELECT status, last_error FROM {table} WHERE payload = $1"),
            ))
            .bind(payload.as_bytes())
            .fetch_one(&pool)
            .await
            .unwrap();
            (status, err)
        }
    };
    loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "confirmations not applied in time"
        );
        let mut batch = consumer
            .fetch()
            .max_messages(10)
            .expires(Duration::from_millis(300))
            .messages()
            .await
            .unwrap();
        while let Some(m) = batch.next().await {
            let m = m.unwrap();
            let h = m.headers.clone().unwrap();
            let id = h.get("outbox-message-id").unwrap().to_string();
            let reply_to = h
                .get("outbox-reply-to")
                .expect("reply-to header")
                .to_string();
            assert_eq!(reply_to, reply);
            let body = match &m.payload[..] {
                b"confirm-me" => format!(
                    "{{\"message_id\":\"{id}\",\"consumer\":\"c\",\"outcome\":\"processed\"}}"
                ),
                b"reject-me" => format!(
                    "{{\"message_id\":\"{id}\",\"consumer\":\"c\",\"outcome\":\"rejected\",\"reason\":\"no stock\"}}"
                ),
                _ => {
                    copies_of_ignored += 1;
                    continue;
                }
            };
            client.publish(reply_to, body.into()).await.unwrap();
        }
        client.flush().await.unwrap();
        if status_of("confirm-me").await.0 == 3
            && status_of("reject-me").await.0 == 6
            && status_of("ignore-me").await.0 == 4
        {
            break;
        }
    }
    let (_, reason) = status_of("reject-me").await;
    assert!(reason.unwrap().contains("no stock"));
    let (_, reason) = status_of("ignore-me").await;
    assert!(reason.unwrap().starts_with("unconfirmed"));
    assert_eq!(
        copies_of_ignored, 2,
        "the unconfirmed message is published once, then once per check-back"
    );
    let out = outbox()
        .args(["status", "--database", &pg_url(), "--table", &f.table])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("CONFIRMED") && text.contains("SENT awaiting confirmation: 0"),
        "{text}"
    );
    nix_kill(&relay, "TERM");
    assert_eq!(
        wait_exit(&mut relay, Duration::from_secs(20)).code(),
        Some(0)
    );
    js.delete_stream(&f.stream).await.unwrap();
}

/// Routing: one `outbox relay` with a TOML file that sends `order-*` topics to Redis Streams and
/// every other topic to NATS JetStream delivers both, each message to its own broker once.
#[cfg(feature = "redis")]
#[tokio::test]
async fn one_relay_routes_two_topics_to_two_brokers() {
    let redis_url =
        std::env::var("OUTBOX_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let f = Fixture::new("route");
    f.migrate();
    let pool = pg().await;
    let js = nats().await;
    let nats_config = f.config("30s", "5s");
    let redis_stream = format!("daemon:{}:orders", f.table);
    let config = std::fs::read_to_string(&nats_config).unwrap().replace(
        "[[routes]]",
        &format!(
            "[transports.streams]\nkind = \"redis\"\nurl = \"{redis_url}\"\n\n\
                 [[routes]]\ntopics = \"order-*\"\ntransport = \"streams\"\n\
                 destination = \"{redis_stream}\"\n\n[[routes]]"
        ),
    );
    std::fs::write(&nats_config, config).unwrap();
    let mut relay = f.spawn_relay(&nats_config);
    let mut tx = pool.begin().await.unwrap();
    for (topic, n) in [("order-created", 20), ("audit", 15)] {
        for i in 0..n {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {} (topic, payload) VALUES ($1, $2)",
                f.table
            )))
            .bind(topic)
            .bind(format!("{{\"n\":{i}}}").into_bytes())
            .execute(&mut *tx)
            .await
            .unwrap();
        }
    }
    tx.commit().await.unwrap();
    wait_until_sent(&pool, &f.table, 35, Duration::from_secs(15)).await;
    let ids_of = |topic: &'static str| {
        let pool = pool.clone();
        let table = f.table.clone();
        async move {
            let ids: Vec<uuid::Uuid> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT message_id FROM {table} WHERE topic = $1"
            )))
            .bind(topic)
            .fetch_all(&pool)
            .await
            .unwrap();
            ids.into_iter()
                .map(|u| u.to_string())
                .collect::<HashSet<_>>()
        }
    };
    assert_eq!(stream_ids(&js, &f.stream, 15).await, ids_of("audit").await);
    let client = redis::Client::open(redis_url.as_str()).unwrap();
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| {
            panic!("Redis is required at {redis_url} (set OUTBOX_TEST_REDIS_URL): {e}")
        });
    let entries: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
        .arg(&redis_stream)
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .unwrap();
    let in_redis: Vec<String> = entries
        .ids
        .iter()
        .map(|e| e.get::<String>("id").expect("id field"))
        .collect();
    assert_eq!(in_redis.len(), 20, "each order message in Redis once");
    assert_eq!(
        in_redis.into_iter().collect::<HashSet<_>>(),
        ids_of("order-created").await
    );
    nix_kill(&relay, "TERM");
    assert_eq!(
        wait_exit(&mut relay, Duration::from_secs(20)).code(),
        Some(0)
    );
    js.delete_stream(&f.stream).await.unwrap();
    redis::cmd("DEL")
        .arg(&redis_stream)
        .query_async::<i64>(&mut conn)
        .await
        .unwrap();
}

impl Fixture {
    /// A relay configuration named `name` routing exactly `patterns` to the fixture's stream
    /// (lease 3 s: a membership round every second).
    fn routes_config(&self, name: &str, patterns: &[&str]) -> PathBuf {
        let path = self.dir.join(format!("{name}.toml"));
        let mut routes = String::new();
        for p in patterns {
            routes.push_str(&format!(
                "\n[[routes]]\ntopics = \"{p}\"\ntransport = \"bus\"\ndestination = \"{}.{{topic}}\"\n",
                self.subject
            ));
        }
        std::fs::write(
            &path,
            format!(
                r#"
[database]
url = "{pg}"
table = "{table}"
inbox_table = "{table}_inbox"

[relay]
name = "{name}"
poll_interval = "300ms"
lease = "3s"
publish_timeout = "1s"
reap_interval = "500ms" # the name before 0.2, still accepted
batch_size = 100

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
            ),
        )
        .unwrap();
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
            "SELECT status, last_error, topic FROM {table} WHERE status <> 2 ORDER BY status DESC"
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

/// Issue 11 item 10, rolling upgrade: relay A routes `a-*`, relay B (the new version) routes
/// `a-*` and `b-*`, on one table. Every message is delivered and none is dead-lettered although
/// A holds half the buckets, `b-…` messages among them (A hands those buckets to B); then A
/// stops and B alone drains the rest. Before the fix A dead-lettered the `b-…` messages of its
/// buckets as "no route".
#[tokio::test]
async fn defect_10_rolling_upgrade_adding_a_route_dead_letters_nothing() {
    let f = Fixture::new("upgrade");
    f.migrate();
    let pool = pg().await;
    let js = nats().await;
    let a_cfg = f.routes_config("relay-a", &["a-*"]);
    let b_cfg = f.routes_config("relay-b", &["a-*", "b-*"]);
    let mut relays = Relays(vec![f.spawn_relay_logged(&a_cfg, "relay-a")]);
    wait_live(&pool, &f.table, &["relay-a"]).await;
    relays.0.push(f.spawn_relay_logged(&b_cfg, "relay-b"));
    wait_live(&pool, &f.table, &["relay-a", "relay-b"]).await;

    enqueue_topics(&pool, &f.table, &["a-created", "b-created"], 300).await;
    wait_all_sent_none_failed(&pool, &f.table, Duration::from_secs(60)).await;

    // A stops (the upgrade goes on): what comes now is drained by B alone.
    nix_kill(&relays.0[0], "TERM");
    assert_eq!(
        wait_exit(&mut relays.0[0], Duration::from_secs(20)).code(),
        Some(0)
    );
    enqueue_topics(&pool, &f.table, &["a-created", "b-created"], 100).await;
    wait_all_sent_none_failed(&pool, &f.table, Duration::from_secs(60)).await;
    let ids = stream_ids(&js, &f.stream, 800).await;
    assert_eq!(ids.len(), 800, "every message in the stream once");

    nix_kill(&relays.0[1], "TERM");
    assert_eq!(
        wait_exit(&mut relays.0[1], Duration::from_secs(20)).code(),
        Some(0)
    );
    js.delete_stream(&f.stream).await.unwrap();
}

/// Issue 11 item 10, disjoint routes: relay A routes only `a-*`, relay B only `b-*`. Each
/// holds buckets with the other's messages; nothing is dead-lettered and everything is
/// delivered (each hands such buckets to the other). Before the fix each dead-lettered the
/// other's topics as "no route". A topic that no live relay routes is still dead-lettered.
#[tokio::test]
async fn defect_10_relays_with_disjoint_routes_dead_letter_nothing() {
    let f = Fixture::new("disjoint");
    f.migrate();
    let pool = pg().await;
    let js = nats().await;
    let mut relays = Relays(vec![
        f.spawn_relay_logged(&f.routes_config("relay-a", &["a-*"]), "relay-a"),
        f.spawn_relay_logged(&f.routes_config("relay-b", &["b-*"]), "relay-b"),
    ]);
    wait_live(&pool, &f.table, &["relay-a", "relay-b"]).await;

    enqueue_topics(&pool, &f.table, &["a-created", "b-created"], 300).await;
    wait_all_sent_none_failed(&pool, &f.table, Duration::from_secs(60)).await;
    let ids = stream_ids(&js, &f.stream, 600).await;
    assert_eq!(ids.len(), 600, "every message in the stream once");

    // Nobody routes `c-…`: dead-lettered, with the reason.
    enqueue_topics(&pool, &f.table, &["c-created"], 1).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let reason: String = loop {
        let r: Option<Option<String>> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT last_error FROM {} WHERE topic = 'c-created' AND status = 4",
            f.table
        )))
        .fetch_optional(&pool)
        .await
        .unwrap();
        if let Some(r) = r {
            break r.unwrap_or_default();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "an unroutable message was not dead-lettered"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(reason.contains("no route"), "{reason}");

    for r in relays.0.iter_mut() {
        nix_kill(r, "TERM");
        assert_eq!(wait_exit(r, Duration::from_secs(20)).code(), Some(0));
    }
    js.delete_stream(&f.stream).await.unwrap();
}

/// Issue 11 item 12: `requeue --id` names every id it could not requeue, with the reason (no
/// such row, or its state), and exits non-zero; the FAILED ones among them are requeued.
/// Before the fix it printed "requeued 1" and exited 0.
#[test]
fn defect_12_requeue_names_the_ids_it_could_not_requeue() {
    let f = Fixture::new("rqnames");
    let db = format!("sqlite://{}", f.dir.join("rq.db").display());
    assert!(
        outbox()
            .args(["migrate", "--database", &db])
            .output()
            .unwrap()
            .status
            .success()
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let pool = sqlx::SqlitePool::connect(&db).await.unwrap();
        sqlx::query(
            "INSERT INTO outbox (message_id, topic, payload, status, attempts, last_error) VALUES \
             ('00000000-0000-7000-8000-000000000001', 't', x'00', 4, 16, 'attempts exhausted'), \
             ('00000000-0000-7000-8000-000000000002', 't', x'00', 2, 1, NULL), \
             ('00000000-0000-7000-8000-000000000003', 't', x'00', 0, 0, NULL)",
        )
        .execute(&pool)
        .await
        .unwrap();
    });
    let out = outbox()
        .args(["requeue", "--database", &db])
        .args(["--id", "1", "--id", "2", "--id", "3", "--id", "99"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "ids not requeued must fail: {err}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("requeued 1 "));
    for want in [
        "3 of 4 id(s) not requeued",
        "id 2: SENT, not FAILED",
        "id 3: PENDING, not FAILED",
        "id 99: no such row",
    ] {
        assert!(err.contains(want), "stderr lacks {want:?}: {err}");
    }
    assert!(!err.contains("id 1:"), "id 1 was requeued: {err}");
    // All requeued: success.
    rt.block_on(async {
        let pool = sqlx::SqlitePool::connect(&db).await.unwrap();
        sqlx::query("UPDATE outbox SET status = 4 WHERE id = 1")
            .execute(&pool)
            .await
            .unwrap();
    });
    let out = outbox()
        .args(["requeue", "--database", &db, "--id", "1"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Issue 11 item 12: `status`, `requeue` and the relay daemon on a SQLite path that does not
/// exist fail naming the path and create no file; only `migrate` creates the database. Before
/// the fix `status` and `requeue` left an empty database file behind.
#[test]
fn defect_12_operator_commands_never_create_a_database() {
    let f = Fixture::new("nocreate");
    let path = f.dir.join("typo.db");
    let db = format!("sqlite://{}", path.display());
    let path_text = path.display().to_string();
    let config = f.dir.join("relay.toml");
    std::fs::write(
        &config,
        format!(
            "[database]\nurl = \"{db}\"\n[transports.t]\nkind = \"webhook\"\nurl = \"http://127.0.0.1:9/\"\n[[routes]]\ntopics = \"*\"\ntransport = \"t\"\n"
        ),
    )
    .unwrap();
    let runs: [(&str, Vec<String>); 4] = [
        (
            "status",
            vec!["status".into(), "--database".into(), db.clone()],
        ),
        (
            "requeue --all",
            vec![
                "requeue".into(),
                "--database".into(),
                db.clone(),
                "--all".into(),
            ],
        ),
        (
            "requeue --id",
            vec![
                "requeue".into(),
                "--database".into(),
                db.clone(),
                "--id".into(),
                "1".into(),
            ],
        ),
        (
            "relay",
            vec![
                "relay".into(),
                "--config".into(),
                config.display().to_string(),
            ],
        ),
    ];
    for (what, args) in runs {
        let out = outbox().args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "{what} on a missing database succeeded"
        );
        assert!(
            err.contains(&path_text) && err.contains("does not exist"),
            "{what}: the error must name the path: {err}"
        );
        assert!(!path.exists(), "{what} created {path_text}");
    }
    let out = outbox()
        .args(["migrate", "--database", &db])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(path.exists(), "migrate creates the database");
    let out = outbox()
        .args(["status", "--database", &db])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
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

/// Issue 11 item 6: a broker that is down when the daemon starts does not stop it. Before: the
/// daemon exited at once with "invalid configuration field transports.bus.url" and no cause
/// (a restart during an outage crash-looped). Now it starts, logs the cause (the connection
/// error), keeps running, and publishes every row once the broker answers on its address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_06_daemon_starts_while_the_broker_is_down_and_publishes_once_it_is_back() {
    let f = Fixture::new("down");
    f.migrate();
    let pool = pg().await;
    let js = nats().await;
    let port = closed_port();
    let config = f.config("30s", "5s");
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace(&nats_url(), &format!("nats://127.0.0.1:{port}"));
    std::fs::write(&config, text).unwrap();
    let log = f.dir.join("relay.log");
    let mut relay = outbox()
        .args(["relay", "--config"])
        .arg(&config)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("start outbox relay");
    for i in 0..30 {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {} (topic, payload) VALUES ('order-created', $1)",
            f.table
        )))
        .bind(format!("{{\"order\":{i}}}").into_bytes())
        .execute(&pool)
        .await
        .unwrap();
    }
    // The cause is logged, and the daemon is still running after it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains("transport unreachable at start") {
            assert!(
                text.to_lowercase().contains("connection refused"),
                "the log names the cause: {text}"
            );
            break;
        }
        if let Some(status) = relay.try_wait().unwrap() {
            panic!("the daemon exited ({status:?}) while the broker was down:\n{text}");
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no start-up warning within 20 s:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        relay.try_wait().unwrap().is_none(),
        "the daemon exited while the broker was down"
    );
    assert_eq!(
        count(&pool, &f.table, 2).await,
        0,
        "nothing can be SENT yet"
    );
    let attempts: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT COALESCE(SUM(attempts), 0)::bigint FROM {}",
        f.table
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(attempts, 0, "an outage burns no attempt");
    // The broker comes back on the configured address.
    let upstream = nats_url().trim_start_matches("nats://").to_owned();
    let forwarder = forward(port, upstream).await;
    wait_until_sent(&pool, &f.table, 30, Duration::from_secs(30)).await;
    let ids = stream_ids(&js, &f.stream, 30).await;
    assert_eq!(ids.len(), 30);
    nix_kill(&relay, "TERM");
    let status = wait_exit(&mut relay, Duration::from_secs(20));
    assert_eq!(status.code(), Some(0), "{status:?}");
    forwarder.abort();
    js.delete_stream(&f.stream).await.unwrap();
}

/// Issue 11 item 6, the other half: a configuration error is still an error. A NATS URL that is
/// not a URL exits non-zero at once, naming the field.
#[test]
fn defect_06_config_error_still_exits_non_zero_naming_the_field() {
    let f = Fixture::new("badurl");
    let path = f.dir.join("bad.toml");
    std::fs::write(
        &path,
        "[database]\nurl = \"sqlite://x.db\"\n[transports.bus]\nkind = \"nats\"\nurl = \"127.0.0.1:4222\"\n[[routes]]\ntopics = \"*\"\ntransport = \"bus\"\n",
    )
    .unwrap();
    let out = outbox()
        .args(["relay", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("transports.bus.url"), "{err}");
}
