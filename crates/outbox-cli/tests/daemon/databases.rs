//! `[[databases]]`: one daemon relaying several databases (issue 18). Four PostgreSQL databases
//! and a MariaDB one, producers writing to each, one PostgreSQL database cut off from the
//! daemon (its connections cut and refused, through a TCP proxy) and brought back: every message
//! of every database reaches the stream once, the others go on while it is away, `/readyz`
//! names it and `/healthz` does not; a database whose table is migrated only after the start is
//! picked up without a restart. And tenant schemas discovered on PostgreSQL: added and dropped
//! while the daemon runs. Needs PostgreSQL, MariaDB (`OUTBOX_TEST_MYSQL_URL`) and NATS.

use std::sync::{Arc, Mutex};

use super::metrics::{free_addr, get, samples, wait_status};
use super::*;

fn mysql_url() -> String {
    std::env::var("OUTBOX_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

/// `pg_url()` with its database replaced by `db`, and its host by `host` when given.
fn pg_url_of(db: &str, host: Option<&str>) -> String {
    let base = pg_url();
    let (server, _) = base
        .rsplit_once('/')
        .expect("a database in OUTBOX_TEST_POSTGRES_URL");
    let server = match host {
        Some(h) => {
            let (scheme_user, _) = server.rsplit_once('@').expect("user@host in the URL");
            format!("{scheme_user}@{h}")
        }
        None => server.to_owned(),
    };
    format!("{server}/{db}")
}

impl Fixture {
    /// The daemon's TOML as [`Fixture::toml`] with the route of every topic, its `[database]`
    /// section replaced by `databases` (`[[databases]]` entries).
    fn toml_with_databases(&self, relay: &str, databases: &str) -> String {
        let database = format!(
            "[database]\nurl = \"{}\"\ntable = \"{}\"\ninbox_table = \"{}_inbox\"\n",
            pg_url(),
            self.table,
            self.table
        );
        let toml = self
            .toml(relay, &self.route("*"))
            .replace(&database, databases);
        assert!(toml.contains("[[databases]]"), "{toml}");
        toml
    }
}

/// One received message: its database, sequence number, and commit → receipt in ms.
#[derive(Clone, Debug)]
struct Receipt {
    db: String,
    seq: u64,
    latency_ms: f64,
    /// Received while the cut-off database was away.
    phase: Phase,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    AllUp,
    OneAway,
    After,
}

fn unix_micros() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

/// p50 / p99 / max of `v` (ms), as text.
fn percentiles(mut v: Vec<f64>) -> String {
    if v.is_empty() {
        return "none".into();
    }
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() as f64 * q) as usize).min(v.len() - 1)];
    format!(
        "n={} p50={:.1} p99={:.1} max={:.1} ms",
        v.len(),
        at(0.5),
        at(0.99),
        v[v.len() - 1]
    )
}

enum Producer {
    Pg(PgPool),
    My(sqlx::MySqlPool),
}

impl Producer {
    /// Insert message `seq` of `db` on topic `db`, its payload `<db>:<seq>:<unix µs>`.
    async fn insert(&self, table: &str, db: &str, seq: u64) {
        let payload = format!("{db}:{seq}:{}", unix_micros()).into_bytes();
        match self {
            Producer::Pg(p) => {
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "INSERT INTO {table} (topic, payload) VALUES ($1, $2)"
                )))
                .bind(db)
                .bind(payload)
                .execute(p)
                .await
                .unwrap();
            }
            Producer::My(p) => {
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "INSERT INTO {table} (message_id, topic, payload) VALUES (?, ?, ?)"
                )))
                .bind(uuid::Uuid::now_v7().to_string())
                .bind(db)
                .bind(payload)
                .execute(p)
                .await
                .unwrap();
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn daemon_relays_many_databases_and_one_away_delays_no_other() {
    let (f, admin_pool, js) = Fixture::started("dbs").await;
    let suffix = f.table.rsplit('_').next().unwrap().to_owned();
    // Five PostgreSQL databases: pg1..pg4 migrated now, pg5 only once the daemon runs.
    let dbs: Vec<String> = (1..=5)
        .map(|i| format!("outbox_dbs_{suffix}_{i}"))
        .collect();
    for db in &dbs {
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}")))
            .execute(&admin_pool)
            .await
            .unwrap();
    }
    for db in &dbs[..4] {
        succeeds(outbox().args(["migrate", "--database", &pg_url_of(db, None)]));
    }
    let my_table = format!("dbs_{suffix}");
    succeeds(outbox().args(["migrate", "--database", &mysql_url(), "--table", &my_table]));
    // pg4 is reached through a proxy that can cut it off.
    let proxy = outbox_testkit::FaultProxy::start("127.0.0.1:5432".into()).await;
    let proxy_host = proxy.addr.to_string();
    let names = ["pg1", "pg2", "pg3", "pg4", "pg5", "maria"];
    let mut entries = String::new();
    for (i, name) in names.iter().enumerate() {
        let (url, table) = match i {
            3 => (pg_url_of(&dbs[3], Some(&proxy_host)), "outbox".to_owned()),
            5 => (mysql_url(), my_table.clone()),
            _ => (pg_url_of(&dbs[i], None), "outbox".to_owned()),
        };
        entries.push_str(&format!(
            "\n[[databases]]\nname = \"{name}\"\nurl = \"{url}\"\ntable = \"{table}\"\n"
        ));
    }
    let addr = free_addr();
    let relay =
        "name = \"dbs\"\npoll_interval = \"200ms\"\nlease = \"3s\"\npublish_timeout = \"1s\"\n";
    let toml = f.toml_with_databases(relay, &entries)
        + &format!("\n[admin]\nlisten = \"{addr}\"\nbacklog_sample_interval = \"200ms\"\n");
    let config = f.write("dbs.toml", &toml);
    let _relays = Relays(vec![f.spawn_relay_logged(&config, "dbs")]);

    // The stream's reader: every message once, by id, with its latency.
    let phase = Arc::new(Mutex::new(Phase::AllUp));
    let receipts: Arc<Mutex<Vec<Receipt>>> = Arc::default();
    let stream = loop {
        if let Ok(s) = js.get_stream(&f.stream).await {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let reader = {
        let consumer = unacked_consumer(&stream).await;
        let (phase, receipts) = (phase.clone(), receipts.clone());
        tokio::spawn(async move {
            let mut ids = HashSet::new();
            let mut messages = consumer.messages().await.unwrap();
            while let Some(m) = messages.next().await {
                let m = m.unwrap();
                let id = header(&m, "Nats-Msg-Id");
                assert!(
                    ids.insert(id.clone()),
                    "message {id} is in the stream twice"
                );
                let text = String::from_utf8(m.payload.to_vec()).unwrap();
                let mut parts = text.split(':');
                let (db, seq, at) = (
                    parts.next().unwrap(),
                    parts.next().unwrap(),
                    parts.next().unwrap(),
                );
                let latency_ms =
                    (unix_micros().saturating_sub(at.parse().unwrap())) as f64 / 1000.0;
                receipts.lock().unwrap().push(Receipt {
                    db: db.to_owned(),
                    seq: seq.parse().unwrap(),
                    latency_ms,
                    phase: *phase.lock().unwrap(),
                });
            }
        })
    };

    // Producers: one per database, 50 messages/s each, until told to stop.
    let mut producers = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let (producer, table) =
            match i {
                5 => (
                    Producer::My(sqlx::MySqlPool::connect(&mysql_url()).await.unwrap_or_else(
                        |e| {
                            panic!(
                                "MariaDB is required at {} (set OUTBOX_TEST_MYSQL_URL): {e}",
                                mysql_url()
                            )
                        },
                    )),
                    my_table.clone(),
                ),
                _ => (
                    Producer::Pg(PgPool::connect(&pg_url_of(&dbs[i], None)).await.unwrap()),
                    "outbox".to_owned(),
                ),
            };
        producers.push((name.to_string(), producer, table));
    }
    let stop = tokio_util::sync::CancellationToken::new();
    let written: Arc<Mutex<BTreeMap<String, u64>>> = Arc::default();
    let pg5_ready = tokio_util::sync::CancellationToken::new();
    let mut tasks = Vec::new();
    for (name, producer, table) in producers {
        let (stop, written, pg5_ready) = (stop.clone(), written.clone(), pg5_ready.clone());
        tasks.push(tokio::spawn(async move {
            if name == "pg5" {
                pg5_ready.cancelled().await;
            }
            let mut tick = tokio::time::interval(Duration::from_millis(20));
            let mut seq = 0u64;
            while !stop.is_cancelled() {
                tick.tick().await;
                producer.insert(&table, &name, seq).await;
                seq += 1;
                written.lock().unwrap().insert(name.clone(), seq);
            }
        }));
    }
    // pg5 is not migrated: the daemon runs the others and names it as not running.
    let ready = wait_status(&addr, "/readyz", 503, &f.dir).await;
    assert!(ready.contains("database pg5:"), "{ready}");
    succeeds(outbox().args(["migrate", "--database", &pg_url_of(&dbs[4], None)]));
    pg5_ready.cancel();
    wait_status(&addr, "/readyz", 200, &f.dir).await;

    let received = |db: &str, below: u64| {
        let r = receipts.lock().unwrap();
        r.iter().filter(|x| x.db == db && x.seq < below).count() as u64
    };
    tokio::time::sleep(Duration::from_secs(5)).await; // a stretch of traffic with all up

    // pg4 away: its relay cannot reach it; the others go on.
    *phase.lock().unwrap() = Phase::OneAway;
    proxy.set_blocked(true);
    let body = wait_status(&addr, "/readyz", 503, &f.dir).await;
    assert!(body.contains("database pg4:"), "{body}");
    assert!(!body.contains("database pg1:"), "{body}");
    assert_eq!(
        get(&addr, "/healthz").await.map(|(c, _)| c),
        Some(200),
        "one database away is no liveness problem"
    );
    assert_eq!(get(&addr, "/readyz/pg1").await.map(|(c, _)| c), Some(200));
    tokio::time::sleep(Duration::from_secs(6)).await; // a stretch of traffic with pg4 away
    // By now pg4's batch in flight waits for its database past lease - publish_timeout: still
    // no liveness problem (the database is away, not the process wedged), and still named by
    // readiness.
    assert_eq!(
        get(&addr, "/healthz").await.map(|(c, _)| c),
        Some(200),
        "a batch waiting for a database that went away is no liveness problem"
    );
    let body = get(&addr, "/readyz/pg4").await.unwrap();
    assert_eq!(body.0, 503, "{body:?}");
    // Everything the others wrote so far arrives while pg4 is still away.
    let marks: BTreeMap<String, u64> = written.lock().unwrap().clone();
    let others = marks.into_iter().filter(|(db, _)| db != "pg4");
    let (within, every) = (Duration::from_secs(30), Duration::from_millis(50));
    wait_received(&received, others, within, every, " while pg4 was away", &f).await;
    let metrics = samples(&get(&addr, "/metrics").await.unwrap().1);
    assert_eq!(
        metrics.get("outbox_database_ready{database=pg4}"),
        Some(&0.0),
        "{metrics:?}"
    );
    assert_eq!(
        metrics.get("outbox_database_ready{database=pg1}"),
        Some(&1.0)
    );
    assert!(
        metrics["outbox_relay_messages_published_total{database=maria,relay=dbs}"] > 0.0,
        "{metrics:?}"
    );

    // pg4 back: its backlog drains, the producers stop, every message arrives once.
    *phase.lock().unwrap() = Phase::After;
    proxy.set_blocked(false);
    stop.cancel();
    for t in tasks {
        t.await.unwrap();
    }
    let totals: BTreeMap<String, u64> = written.lock().unwrap().clone();
    let (within, every) = (Duration::from_secs(60), Duration::from_millis(100));
    wait_received(&received, totals.clone(), within, every, "", &f).await;
    assert!(!reader.is_finished(), "the reader stopped (a duplicate?)");
    reader.abort();
    let r = receipts.lock().unwrap().clone();
    for (db, n) in &totals {
        let mut seqs: Vec<u64> = r.iter().filter(|x| &x.db == db).map(|x| x.seq).collect();
        seqs.sort_unstable();
        seqs.dedup();
        assert_eq!(seqs.len() as u64, *n, "{db}: every message once");
    }
    wait_status(&addr, "/readyz", 200, &f.dir).await;
    // The figures for the note: the others' latency with all up and with pg4 away.
    for db in names {
        for p in [Phase::AllUp, Phase::OneAway, Phase::After] {
            let v: Vec<f64> = r
                .iter()
                .filter(|x| x.db == db && x.phase == p)
                .map(|x| x.latency_ms)
                .collect();
            eprintln!("{db} {p:?}: {}", percentiles(v));
        }
    }
    drop(_relays);
    js.delete_stream(&f.stream).await.unwrap();
    for db in &dbs {
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {db} WITH (FORCE)"
        )))
        .execute(&admin_pool)
        .await;
    }
}

/// Wait until each `(db, n)` of `counts` had its first `n` messages `received` (`received(db,
/// n)` counts them), all within `within`, looking every `every`; `when` ends the failure.
async fn wait_received(
    received: impl Fn(&str, u64) -> u64,
    counts: impl IntoIterator<Item = (String, u64)>,
    within: Duration,
    every: Duration,
    when: &str,
    f: &Fixture,
) {
    let deadline = tokio::time::Instant::now() + within;
    for (db, n) in counts {
        eventually!(
            until deadline,
            every,
            received(&db, n) >= n,
            "{db}: {} of its first {n} messages arrived{when}; log in {}",
            received(&db, n),
            f.dir.display()
        );
    }
}

/// `schemas = "<pattern>"`: every tenant schema holding the outbox table is relayed as its own
/// member, tenants added (and migrated) while the daemon runs are picked up, a dropped one is
/// stopped; each tenant's admin API answers under `/databases/<name>~<schema>/`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemon_discovers_tenant_schemas_without_a_restart() {
    let (f, pool, js) = Fixture::started("tenants").await;
    let suffix = f.table.rsplit('_').next().unwrap().to_owned();
    let schema = |t: &str| format!("tn_{suffix}_{t}");
    // Run `sql` on the fixture's database.
    let exec = |sql: String| {
        let pool = pool.clone();
        async move { sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&pool).await }
    };
    let create = |t: &str| {
        let s = schema(t);
        let created = exec(format!("CREATE SCHEMA {s}"));
        async move {
            created.await.unwrap();
            succeeds(
                outbox()
                    .args([
                        "migrate",
                        "--database",
                        &pg_url(),
                        "--table",
                        &format!("{s}.outbox"),
                    ])
                    .args(["--inbox-table", &format!("{s}.outbox_inbox")]),
            );
        }
    };
    create("a").await;
    create("b").await;
    // A schema matching the pattern without the table: not a tenant (yet).
    exec(format!("CREATE SCHEMA {}", schema("empty")))
        .await
        .unwrap();
    let addr = free_addr();
    let relay =
        "name = \"tenants\"\npoll_interval = \"200ms\"\nlease = \"3s\"\npublish_timeout = \"1s\"\n";
    let entry = format!(
        "[[databases]]\nname = \"app\"\nurl = \"{}\"\nschemas = \"tn_{suffix}_%\"\nrediscover_interval = \"1s\"\n",
        pg_url()
    );
    let toml = f.toml_with_databases(relay, &entry)
        + &format!("\n[admin]\nlisten = \"{addr}\"\n\n[logging]\nsummary_interval = \"1s\"\n");
    let config = f.write("tenants.toml", &toml);
    let _relays = Relays(vec![f.spawn_relay_logged(&config, "tenants")]);
    let member = |t: &str| format!("app~{}", schema(t));
    wait_status(&addr, &format!("/readyz/{}", member("a")), 200, &f.dir).await;
    wait_status(&addr, &format!("/readyz/{}", member("b")), 200, &f.dir).await;
    assert_eq!(
        get(&addr, &format!("/readyz/{}", member("empty")))
            .await
            .map(|(c, _)| c),
        Some(404)
    );
    let insert = |t: &str, n: i64| {
        let (pool, s) = (pool.clone(), schema(t));
        async move { enqueue_topics(&pool, &format!("{s}.outbox"), &[&s], n).await }
    };
    // Wait until every message of tenant `t` is sent and none failed.
    let all_sent = |t: &str| {
        let (pool, table) = (pool.clone(), format!("{}.outbox", schema(t)));
        async move { wait_all_sent_none_failed(&pool, &table, Duration::from_secs(20)).await }
    };
    insert("a", 5).await;
    insert("b", 7).await;
    all_sent("a").await;
    all_sent("b").await;
    // A tenant added while the daemon runs.
    create("c").await;
    wait_status(&addr, &format!("/readyz/{}", member("c")), 200, &f.dir).await;
    insert("c", 3).await;
    all_sent("c").await;
    assert_eq!(stream_ids(&js, &f.stream, 15).await.len(), 15);
    // `outbox status --config`: one status per tenant, named as the daemon's members.
    let out = succeeds(outbox().args(["status", "--json", "--config"]).arg(&config));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let sent: std::collections::BTreeMap<String, i64> = v["databases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            (
                d["name"].as_str().unwrap().to_owned(),
                d["counts"]["SENT"].as_i64().unwrap_or(0),
            )
        })
        .collect();
    let want: std::collections::BTreeMap<String, i64> = [("a", 5), ("b", 7), ("c", 3)]
        .into_iter()
        .map(|(t, n)| (format!("app/{}", schema(t)), n))
        .collect();
    assert_eq!(sent, want, "{out}");
    // Each tenant's admin API, and the page listing them.
    let (code, body) = get(&addr, &format!("/databases/{}/api/overview", member("b")))
        .await
        .unwrap();
    assert_eq!(code, 200, "{body}");
    let _: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(
        body.contains(&schema("b")),
        "b's topic in b's overview: {body}"
    );
    assert!(!body.contains(&schema("c")), "only b's table: {body}");
    let (code, page) = get(&addr, "/").await.unwrap();
    assert_eq!(code, 200);
    for t in ["a", "b", "c"] {
        assert!(page.contains(&format!("app/{}", schema(t))), "{page}");
    }
    // The list of databases and a tenant's dashboard opened from it, in a real browser.
    browse_databases(
        &addr,
        &f,
        &["a", "b", "c"].map(|t| format!("app/{}", schema(t))),
        &format!("app/{}", schema("b")),
        &schema("b"),
        &schema("c"),
    )
    .await;
    // One summary line per tenant, each naming its database.
    let log_path = f.dir.join("tenants.log");
    let summarised = |t: &str| {
        std::fs::read_to_string(&log_path)
            .unwrap()
            .lines()
            .any(|l| {
                l.contains("summary of the last 1s: published=")
                    && l.contains(&format!("database=app/{}", schema(t)))
            })
    };
    eventually!(
        Duration::from_secs(10),
        Duration::from_millis(100),
        ["a", "b", "c"].iter().all(|t| summarised(t)),
        "no summary line per tenant within 10 s; log in {}",
        log_path.display()
    );
    // A tenant dropped: its member goes.
    exec(format!("DROP SCHEMA {} CASCADE", schema("a")))
        .await
        .unwrap();
    wait_status(&addr, &format!("/readyz/{}", member("a")), 404, &f.dir).await;
    wait_status(&addr, "/readyz", 200, &f.dir).await;
    drop(_relays);
    js.delete_stream(&f.stream).await.unwrap();
    for t in ["b", "c", "empty"] {
        let _ = exec(format!("DROP SCHEMA {} CASCADE", schema(t))).await;
    }
}

/// Drive `tests/browser/databases.mjs` through the admin listener `addr`: the list names
/// `members`, all running; `open`'s dashboard, opened from it, shows `topic` and not `other`.
async fn browse_databases(
    addr: &str,
    f: &Fixture,
    members: &[String],
    open: &str,
    topic: &str,
    other: &str,
) {
    super::dashboard::run_browser(
        "databases.mjs",
        &[
            ("DBS_URL", format!("http://{addr}")),
            ("DBS_MEMBERS", members.join(",")),
            ("DBS_OPEN", open.to_owned()),
            ("DBS_TOPIC", topic.to_owned()),
            ("DBS_OTHER", other.to_owned()),
        ],
        "DBS_SHOTS",
        f,
    )
    .await;
}
