//! `outbox bench` end to end with tiny sizes on the real PostgreSQL and NATS JetStream
//! (`OUTBOX_TEST_POSTGRES_URL`, `OUTBOX_TEST_NATS_URL`): every scenario runs, the JSON report has
//! every section with sane, non-zero figures, and the run leaves nothing behind. The figures
//! themselves are not judged here: they are benchmark results, not test outcomes.

use std::process::Command;

use serde_json::Value;

fn num(v: &Value, path: &str) -> f64 {
    let mut cur = v;
    for part in path.split('.') {
        cur = match part.parse::<usize>() {
            Ok(i) => &cur[i],
            Err(_) => &cur[part],
        };
    }
    cur.as_f64()
        .unwrap_or_else(|| panic!("{path} is not a number: {cur}"))
}

fn positive(v: &Value, path: &str) -> f64 {
    let n = num(v, path);
    assert!(n > 0.0 && n.is_finite(), "{path} = {n}, expected > 0");
    n
}

/// Run `outbox bench ARGS --no-progress --json FILE`; fails the test with its output unless it
/// succeeded. Returns its standard output and the JSON report.
fn run_bench(args: &[&str]) -> (String, Value) {
    let json = std::env::temp_dir().join(format!(
        "outbox-bench-run-{:08x}.json",
        rand::random::<u32>()
    ));
    let out = Command::new(env!("CARGO_BIN_EXE_outbox"))
        .arg("bench")
        .args(args)
        .args(["--no-progress", "--json"])
        .arg(&json)
        .output()
        .expect("run outbox bench");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "outbox bench {args:?} failed:\n{stdout}\n{stderr}"
    );
    let r: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);
    (stdout, r)
}

/// The `consume` scenario's report: its three consumers each applied (or acknowledged) all
/// `messages`, at a rate; the batched inbox committed batches (`what` names the run).
fn every_consumer_applied_all(r: &Value, messages: u64, what: &str) {
    let names: Vec<&str> = r["consume"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["consume-raw", "consume-inbox-1", "consume-inbox-batch"],
        "{what}"
    );
    for i in 0..3 {
        let applied = num(r, &format!("consume.{i}.messages"));
        assert_eq!(applied, messages as f64, "{what}");
        positive(r, &format!("consume.{i}.rate"));
    }
    positive(r, "consume.2.inbox_batches");
}

/// The schemas of the PostgreSQL test server whose name is `LIKE` `pattern`.
async fn schemas_like(pg: &sqlx::PgPool, pattern: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pg_namespace WHERE nspname LIKE $1")
        .bind(pattern)
        .fetch_one(pg)
        .await
        .unwrap()
}

#[tokio::test]
async fn bench_runs_every_scenario_and_reports_each_section() {
    // A missing service fails here, naming its environment variable.
    let pg = outbox_testkit::pg_pool(1).await;
    drop(outbox_testkit::nats_client().await);
    let messages = 2_000u64;
    let (stdout, r) = run_bench(&[
        "--database",
        &outbox_testkit::postgres_url(),
        "--transport",
        &outbox_testkit::nats_url(),
        "--messages",
        &messages.to_string(),
        "--relays",
        "1,4",
        "--rate",
        "200",
        "--producers",
        "2",
        "--latency-duration",
        "2s",
        "--enqueue-duration",
        "2s",
        "--only",
        "broker,baseline,drain,scaling,latency,enqueue,idle,metrics,consume,pipeline",
        "--idle-duration",
        "2s",
    ]);
    for section in [
        "Throughput",
        "Rate in each tenth",
        "Database cost",
        "Steady state",
        "Enqueue overhead",
        "Idle cost",
        "Cost of the Prometheus metrics",
        "Consumers",
        "End to end",
        "Targets",
    ] {
        assert!(stdout.contains(section), "no {section} table:\n{stdout}");
    }
    assert_eq!(r["database"]["backend"], "postgres");
    assert!(num(&r, "clock.uncertainty_us") >= 0.0);
    // The raw broker run and the baselines: every message arrived, at a rate.
    for name in ["broker", "baseline_naive", "baseline_tuned", "drain"] {
        positive(&r, &format!("{name}.rate"));
        assert_eq!(
            num(&r, &format!("{name}.broker_stored")),
            messages as f64,
            "{name}"
        );
        assert!(r[name]["load"].is_array(), "{name} has no load");
    }
    // The raw loops write every row twice (claim, then mark) by construction.
    for name in ["baseline_naive", "baseline_tuned"] {
        let w = num(&r, &format!("{name}.cost.pg.rows_written_per_message"));
        assert!((w - 2.0).abs() < 1e-9, "{name}: {w}");
    }
    // The drain: ratios to every baseline, ten tenths, its cost and the table's growth.
    for field in ["vs_naive", "vs_tuned", "vs_broker", "flatness"] {
        positive(&r, &format!("drain.{field}"));
    }
    let deciles = r["drain"]["deciles"].as_array().unwrap();
    assert_eq!(deciles.len(), 10);
    assert!(
        deciles.iter().all(|d| d.as_f64().unwrap() > 0.0),
        "{deciles:?}"
    );
    positive(&r, "drain.cost.statements");
    assert!(num(&r, "drain.cost.pg.rows_written_per_message") >= 1.0);
    positive(&r, "drain.table.before.live_tuples");
    positive(&r, "drain.table.after.index_bytes");
    // The CPU each side spent per message: the relay's process at least (a busy drain).
    positive(&r, "drain.cpu_us_per_message.process");
    // Scaling: one entry per instance count, compared with one relay.
    let scaling = r["scaling"].as_array().unwrap();
    assert_eq!(scaling.len(), 2);
    assert_eq!(num(&r, "scaling.1.relays"), 4.0);
    positive(&r, "scaling.1.vs_one_relay");
    // Latency: the three wake-ups (PostgreSQL: in-process, post-commit NOTIFY, trigger NOTIFY)
    // at the fixed rate and at the maximum, ordered percentiles, the subscriber saw the
    // messages too.
    let latency = r["latency"].as_array().unwrap();
    let wakeups: Vec<&str> = latency
        .iter()
        .map(|l| l["wakeup"].as_str().unwrap())
        .collect();
    assert_eq!(
        wakeups,
        [
            "embedded", "embedded", "external", "external", "trigger", "trigger"
        ]
    );
    for i in 0..latency.len() {
        let p = |q: &str| num(&r, &format!("latency.{i}.commit_to_ack.{q}"));
        assert!(p("count") > 0.0);
        assert!(0.0 < p("p50_ms") && p("p50_ms") <= p("p99_ms") && p("p99_ms") <= p("max_ms"));
        positive(&r, &format!("latency.{i}.commit_to_received.count"));
        positive(&r, &format!("latency.{i}.commit_rate"));
        positive(&r, &format!("latency.{i}.relay_statements_per_message"));
    }
    // Enqueue overhead (at the fixed rate and at the maximum; on PostgreSQL also the trigger's
    // NOTIFY inside the transaction) and idle cost.
    for e in ["enqueue", "enqueue_fixed_rate"] {
        positive(&r, &format!("{e}.without.transactions"));
        positive(&r, &format!("{e}.with_outbox.transaction.p50_ms"));
        positive(&r, &format!("{e}.with_outbox_trigger.transaction.p50_ms"));
        assert!(r[e]["overhead_p50"].is_number(), "{e}");
        assert!(r[e]["overhead_trigger_p50"].is_number(), "{e}");
    }
    assert_eq!(num(&r, "enqueue_fixed_rate.offered_rate"), 200.0);
    positive(&r, "idle.statements");
    positive(&r, "idle.statements_per_poll_interval");
    // The metrics export: two drains without, two with, each of every message; the registry
    // was encoded during the drains with the export.
    for side in ["off", "on"] {
        let drains = r["metrics_cost"][side].as_array().unwrap();
        assert_eq!(drains.len(), 2, "{side}");
        for i in 0..2 {
            assert_eq!(
                num(&r, &format!("metrics_cost.{side}.{i}.messages")),
                messages as f64
            );
            positive(&r, &format!("metrics_cost.{side}.{i}.rate"));
        }
    }
    positive(&r, "metrics_cost.scrapes");
    positive(&r, "metrics_cost.ratio");
    // The consumers: each applied (or acknowledged) every message; the batched inbox committed
    // batches; the ratios of the same run.
    every_consumer_applied_all(&r, messages, "NATS");
    positive(&r, "consume.2.vs_inbox_1");
    positive(&r, "consume.2.vs_raw_consumer");
    // End to end: the producers at their maximum, then paced at half the end-to-end rate; every
    // message applied (the run fails otherwise), in inbox batches, with ordered percentiles.
    let pipeline = r["pipeline"].as_array().unwrap();
    assert_eq!(pipeline.len(), 2);
    assert!(pipeline[0]["offered_rate"].is_null());
    let half = (num(&r, "pipeline.0.end_to_end_rate") / 2.0)
        .round()
        .max(1.0);
    assert_eq!(num(&r, "pipeline.1.offered_rate"), half);
    for i in 0..2 {
        positive(&r, &format!("pipeline.{i}.messages"));
        positive(&r, &format!("pipeline.{i}.inbox_batches"));
        let effect = |q: &str| num(&r, &format!("pipeline.{i}.commit_to_effect.{q}"));
        assert!(effect("p50_ms") <= effect("p99_ms") && effect("p99_ms") <= effect("max_ms"));
        // The consumer acknowledges after the broker acknowledged to the relay.
        assert!(effect("p50_ms") >= num(&r, &format!("pipeline.{i}.commit_to_ack.p50_ms")));
    }
    // Where each latency run's slowest messages were.
    for run in r["latency"].as_array().unwrap() {
        assert_eq!(run["slowest"].as_array().unwrap().len(), 10, "{run}");
        assert!(
            run["longest_commit_pause"][1].as_f64().unwrap() > 0.0,
            "{run}"
        );
    }
    // Every target was measured.
    let targets = r["targets"].as_array().unwrap();
    assert_eq!(targets.len(), 15);
    assert!(targets.iter().all(|t| t["met"].is_boolean()), "{targets:?}");

    // Nothing left behind: the schema, the migration records, the stream.
    let run = r["run_id"].as_str().unwrap();
    let schemas = schemas_like(&pg, &format!("bench_{run}")).await;
    assert_eq!(schemas, 0, "schema bench_{run} left behind");
    let records: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox_migrations WHERE table_name LIKE $1")
            .bind(format!("bench_{run}%"))
            .fetch_one(&pg)
            .await
            .unwrap();
    assert_eq!(records, 0, "migration records of bench_{run} left behind");
    let js = async_nats::jetstream::new(outbox_testkit::nats_client().await);
    assert!(
        js.get_stream(format!("BENCH_{}", run.to_uppercase()))
            .await
            .is_err(),
        "stream left behind"
    );
}

/// The consumer side on the brokers whose consumer the bench drives besides NATS: RabbitMQ (the
/// queue is emptied by each consumer, so the backlog is published again for each) and Kafka (a
/// new topic per scenario, each consumer a new group). Every consumer of `consume` applies every
/// message, and `pipeline` applies every committed message exactly once (checked by the bench
/// itself: it fails otherwise).
#[tokio::test]
async fn bench_consumes_on_rabbitmq_and_kafka() {
    drop(outbox_testkit::pg_pool(1).await);
    for transport in [
        outbox_testkit::rabbitmq::rabbitmq_url(),
        outbox_testkit::kafka::kafka_url(),
    ] {
        let messages = 1_000u64;
        let (_, r) = run_bench(&[
            "--database",
            &outbox_testkit::postgres_url(),
            "--transport",
            &transport,
            "--messages",
            &messages.to_string(),
            "--producers",
            "2",
            "--latency-duration",
            "2s",
            "--only",
            "consume,pipeline",
            "--messages-per-transaction",
            "3",
        ]);
        every_consumer_applied_all(&r, messages, &transport);
        assert_eq!(r["pipeline"].as_array().unwrap().len(), 2, "{transport}");
        for i in 0..2 {
            // Three messages per producer transaction, each applied once (the bench checks).
            assert_eq!(
                num(&r, &format!("pipeline.{i}.messages_per_transaction")),
                3.0
            );
            let measured = positive(&r, &format!("pipeline.{i}.messages"));
            assert_eq!(
                measured % 3.0,
                0.0,
                "{transport}: whole transactions measured"
            );
            positive(&r, &format!("pipeline.{i}.end_to_end_rate"));
        }
    }
}

/// The baselines on SQLite and MariaDB, the two databases where the relay's index set is part of
/// what bounds it: the raw loop runs on a copy with only its claim index, then on a copy with
/// every index of the relay's table too, and the relay drains the original; each drained every
/// message (the bench checks), and the ratios of the same run are filled.
#[tokio::test]
async fn bench_runs_the_raw_loop_with_the_relays_indexes_on_sqlite_and_mariadb() {
    drop(outbox_testkit::mysql_pool(1).await);
    let dir = std::env::temp_dir().join(format!(
        "outbox-bench-baselines-{:08x}",
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let sqlite = format!("sqlite://{}", dir.join("baseline.db").display());
    for database in [sqlite, outbox_testkit::mysql_url()] {
        let (stdout, r) = run_bench(&[
            "--database",
            &database,
            "--transport",
            "memory",
            "--messages",
            "2000",
            "--only",
            "baseline,drain",
        ]);
        assert!(
            stdout.contains("the relay's indexes"),
            "no row of the raw loop with the relay's indexes:\n{stdout}"
        );
        assert_eq!(r["baseline_relay_indexes"]["name"], "raw-relay-indexes");
        positive(&r, "baseline_relay_indexes.rate");
        positive(&r, "baseline_relay_indexes.vs_naive");
        positive(&r, "drain.vs_naive");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The `databases` scenario: one relay group drains PostgreSQL twice over (two schemas of the
/// test server) and a SQLite file at once, after the same with one and two of them; every
/// message arrives (checked by the bench itself), and the report gives each run's rate, each
/// database's, the ratio to one database and the CPU each side spent.
#[tokio::test]
async fn bench_drains_many_databases_through_one_relay_group() {
    let pg = outbox_testkit::pg_pool(1).await;
    drop(outbox_testkit::nats_client().await);
    let dir = std::env::temp_dir().join(format!(
        "outbox-bench-databases-{:08x}",
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let sqlite = format!("sqlite://{}", dir.join("third.db").display());
    let messages = 2_000u64;
    let (stdout, r) = run_bench(&[
        "--database",
        &outbox_testkit::postgres_url(),
        "--databases",
        &outbox_testkit::postgres_url(),
        &sqlite,
        "--transport",
        &outbox_testkit::nats_url(),
        "--messages",
        &messages.to_string(),
        "--only",
        "databases",
    ]);
    assert!(
        stdout.contains("One relay group, many databases"),
        "{stdout}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    let runs = r["databases"].as_array().unwrap();
    assert_eq!(runs.len(), 3, "1, 2 and 3 databases: {runs:?}");
    for (i, k) in [1u64, 2, 3].into_iter().enumerate() {
        assert_eq!(num(&r, &format!("databases.{i}.databases")), k as f64);
        assert_eq!(
            num(&r, &format!("databases.{i}.messages")),
            (k * messages) as f64
        );
        positive(&r, &format!("databases.{i}.rate"));
        positive(&r, &format!("databases.{i}.vs_one_database"));
        let each = r["databases"][i]["per_database"].as_array().unwrap();
        assert_eq!(each.len() as u64, k);
        assert!(each.iter().all(|v| v.as_f64().unwrap() > 0.0), "{each:?}");
        positive(&r, &format!("databases.{i}.cpu_seconds.relays"));
        positive(&r, &format!("databases.{i}.messages_per_cpu_second.relays"));
    }
    // PostgreSQL runs on this machine: its CPU is counted.
    positive(&r, "databases.2.cpu_seconds.postgres");
    // Nothing left behind: neither schema.
    let run = r["run_id"].as_str().unwrap();
    let schemas = schemas_like(&pg, &format!("bench_{run}%")).await;
    assert_eq!(schemas, 0, "a schema bench_{run}* left behind");
}
