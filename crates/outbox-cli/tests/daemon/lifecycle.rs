//! The daemon's life and the operator commands: SIGTERM and kill -9, configuration errors named
//! with a non-zero exit, `requeue`, commands that never create a database, and a broker that is
//! down when the daemon starts.

use super::*;

#[tokio::test]
async fn plain_sql_rows_are_published_to_nats_and_sigterm_exits_cleanly() {
    let (f, pool, js) = Fixture::started("sql").await;
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
        count(&pool, &f.table, Status::Sending).await,
        0,
        "rows left SENDING after shutdown"
    );
    js.delete_stream(&f.stream).await.unwrap();
}

#[tokio::test]
async fn relay_killed_with_sigkill_mid_stream_loses_nothing() {
    let (f, pool, js) = Fixture::started("kill").await;
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
        while count(&pool, &f.table, Status::Sent).await < target {
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
    let failed = count(&pool, &f.table, Status::Failed).await;
    assert_eq!(failed, 0);
    js.delete_stream(&f.stream).await.unwrap();
}

#[test]
fn bad_configuration_is_named_and_exits_non_zero() {
    let f = Fixture::new("badcfg");
    let path = relay_refuses(
        &f,
        "[database]\nurl = \"sqlite://x.db\"\n[relay]\nlease = \"1s\"\n[transports.t]\nkind = \"webhook\"\nurl = \"http://127.0.0.1:9/\"\n[[routes]]\ntopics = \"*\"\ntransport = \"t\"\n",
        "relay.lease",
    );
    relay_refuses(
        &f,
        "[database]\nurl = \"sqlite://x.db\"\nbogus = 1\n",
        "bogus",
    );

    // Environment overrides use OUTBOX_<SECTION>__<FIELD>, upper case as documented.
    std::fs::write(
        &path,
        "[relay]\nbatch_size = 100\n[transports.t]\nkind = \"webhook\"\nurl = \"http://127.0.0.1:9/\"\n[[routes]]\ntopics = \"*\"\ntransport = \"t\"\n",
    )
    .unwrap();
    let err = fails(
        relay_cmd(&path)
            .env("OUTBOX_DATABASE__URL", "sqlite://x.db")
            .env("OUTBOX_RELAY__BATCH_SIZE", "0"),
    );
    assert!(
        err.contains("relay.batch_size"),
        "upper-case env override ignored: {err}"
    );
    let err = fails(relay_cmd(&path).env_remove("OUTBOX_DATABASE_URL"));
    assert!(err.contains("database.url"), "{err}");

    let err = fails(outbox().args(["status", "--database", "oracle://nope"]));
    assert!(err.contains("unsupported database URL"), "{err}");
    // MySQL/MariaDB URLs are supported; an unreachable one names the URL.
    let err = fails(outbox().args(["status", "--database", "mysql://nope@127.0.0.1:1/x"]));
    assert!(
        err.contains("cannot open mysql://nope@127.0.0.1:1/x"),
        "{err}"
    );

    let db = format!("sqlite://{}", f.dir.join("empty.db").display());
    let err = fails(outbox().args(["status", "--database", &db]));
    assert!(
        err.contains("outbox migrate"),
        "missing-table error must say how to fix it: {err}"
    );
}

/// `outbox status --config` over a daemon's `[[databases]]`: each database's status, named; a
/// database that does not answer is reported beside the others (not instead of them), and the
/// command fails naming it.
#[test]
fn status_of_a_configuration_shows_every_database_and_names_the_unreachable() {
    let f = Fixture::new("status-config");
    let one = sqlite_with_rows(&f, "one.db", &[(Status::Pending, 0, None)]);
    let two = sqlite_with_rows(
        &f,
        "two.db",
        &[
            (Status::Sent, 1, None),
            (
                Status::Failed,
                16,
                Some("attempts exhausted: broker said no"),
            ),
        ],
    );
    let away = format!("mysql://root@127.0.0.1:{}/test", closed_port());
    let databases = |with_away: bool| {
        let mut t = format!(
            "[[databases]]\nname = \"orders\"\nurl = \"{one}\"\n\n[[databases]]\nname = \"billing\"\nurl = \"{two}\"\n"
        );
        if with_away {
            t += &format!("\n[[databases]]\nname = \"away\"\nurl = \"{away}\"\n");
        }
        t + "\n[transports.t]\nkind = \"webhook\"\nurl = \"http://127.0.0.1:9/\"\n[[routes]]\ntopics = \"*\"\ntransport = \"t\"\n"
    };
    let all_up = f.dir.join("up.toml");
    std::fs::write(&all_up, databases(false)).unwrap();
    let out = succeeds(
        outbox()
            .env_remove("OUTBOX_DATABASE_URL")
            .args(["status", "--config"])
            .arg(&all_up),
    );
    assert!(
        out.contains("database orders: outbox table outbox (sqlite)"),
        "{out}"
    );
    assert!(
        out.contains("database billing: outbox table outbox (sqlite)"),
        "{out}"
    );
    assert!(out.contains("broker said no"), "{out}");

    let with_away = f.dir.join("away.toml");
    std::fs::write(&with_away, databases(true)).unwrap();
    let out = outbox()
        .env_remove("OUTBOX_DATABASE_URL")
        .args(["status", "--json", "--config"])
        .arg(&with_away)
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "an unreachable database fails the command"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("the status of 1 of 3 database(s) could not be read: away"),
        "{stderr}"
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let dbs = v["databases"].as_array().unwrap();
    let names: Vec<&str> = dbs.iter().map(|d| d["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["orders", "billing", "away"]);
    assert_eq!(dbs[0]["counts"]["PENDING"], 1);
    assert_eq!(dbs[1]["counts"]["FAILED"], 1);
    assert_eq!(dbs[1]["failed"][0]["attempts"], 16);
    let e = dbs[2]["error"].as_str().unwrap();
    assert!(e.contains("cannot open mysql://root@127.0.0.1"), "{e}");

    // A reader that went away (`outbox status --json | head -0`) ends the command quietly,
    // killed by SIGPIPE as coreutils are, not with a panic on "Broken pipe" (exit 101). The
    // pipe's reading end is closed before the command starts, so its first write fails.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = outbox()
        .env_remove("OUTBOX_DATABASE_URL")
        .args(["status", "--json", "--config"])
        .arg(&all_up)
        .stdout(writer)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&out.status),
        Some(libc::SIGPIPE),
        "killed by SIGPIPE: {:?} {stderr}",
        out.status
    );

    // The file is checked as `outbox relay` checks it: two databases of one name are refused.
    let twice = f.dir.join("twice.toml");
    std::fs::write(
        &twice,
        databases(false).replace("\"billing\"", "\"orders\""),
    )
    .unwrap();
    let err = fails(
        outbox()
            .env_remove("OUTBOX_DATABASE_URL")
            .args(["status", "--config"])
            .arg(&twice),
    );
    assert!(err.contains("names two databases"), "{err}");

    // A database URL beside [[databases]] is refused, naming both.
    let err = fails(
        outbox()
            .args(["status", "--database", &one, "--config"])
            .arg(&all_up),
    );
    assert!(err.contains("give one or the other"), "{err}");
}

#[test]
fn requeue_moves_dead_letters_back_to_pending() {
    let f = Fixture::new("requeue");
    let db = sqlite_with_rows(
        &f,
        "rq.db",
        &[
            (Status::Failed, 16, Some("attempts exhausted")),
            (Status::Failed, 16, Some("attempts exhausted")),
            (Status::Sent, 1, None),
        ],
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
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
        let pending = i64::from(Status::Pending.as_i16());
        assert_eq!(rows[0], (1, pending, 0, Some("attempts exhausted".into())));
        assert_eq!(rows[1].1, i64::from(Status::Failed.as_i16()));
        assert_eq!(rows[2].1, i64::from(Status::Sent.as_i16()));
    });
    let out = outbox()
        .args(["requeue", "--database", &db, "--all"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("requeued 1 "));
}

/// Issue 11 item 12: `requeue --id` names every id it could not requeue, with the reason (no
/// such row, or its state), and exits non-zero; the FAILED ones among them are requeued.
/// Before the fix it printed "requeued 1" and exited 0.
#[test]
fn defect_12_requeue_names_the_ids_it_could_not_requeue() {
    let f = Fixture::new("rqnames");
    let db = sqlite_with_rows(
        &f,
        "rq.db",
        &[
            (Status::Failed, 16, Some("attempts exhausted")),
            (Status::Sent, 1, None),
            (Status::Pending, 0, None),
        ],
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
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
        sqlx::query("UPDATE outbox SET status = ?1 WHERE id = 1")
            .bind(Status::Failed.as_i16())
            .execute(&pool)
            .await
            .unwrap();
    });
    succeeds(outbox().args(["requeue", "--database", &db, "--id", "1"]));
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
    let config = config.display().to_string();
    let runs: [(&str, &[&str]); 4] = [
        ("status", &["status", "--database", &db]),
        ("requeue --all", &["requeue", "--database", &db, "--all"]),
        ("requeue --id", &["requeue", "--database", &db, "--id", "1"]),
        ("relay", &["relay", "--config", &config]),
    ];
    for (what, args) in runs {
        let out = outbox().args(args).output().unwrap();
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
    succeeds(outbox().args(["migrate", "--database", &db]));
    assert!(path.exists(), "migrate creates the database");
    succeeds(outbox().args(["status", "--database", &db]));
}

/// Issue 11 item 6: a broker that is down when the daemon starts does not stop it. Before: the
/// daemon exited at once with "invalid configuration field transports.bus.url" and no cause
/// (a restart during an outage crash-looped). Now it starts, logs the cause (the connection
/// error), keeps running, and publishes every row once the broker answers on its address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_06_daemon_starts_while_the_broker_is_down_and_publishes_once_it_is_back() {
    let (f, pool, js) = Fixture::started("down").await;
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
        insert_message(
            &pool,
            &f.table,
            "order-created",
            format!("{{\"order\":{i}}}"),
        )
        .await;
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
        count(&pool, &f.table, Status::Sent).await,
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
    relay_refuses(
        &f,
        "[database]\nurl = \"sqlite://x.db\"\n[transports.bus]\nkind = \"nats\"\nurl = \"127.0.0.1:4222\"\n[[routes]]\ntopics = \"*\"\ntransport = \"bus\"\n",
        "transports.bus.url",
    );
}

/// `outbox relay` with `toml` as its file (`<dir>/bad.toml`) exits non-zero, its error naming
/// `named`: the file's path.
fn relay_refuses(f: &Fixture, toml: &str, named: &str) -> PathBuf {
    let path = f.write("bad.toml", toml);
    let err = fails(&mut relay_cmd(&path));
    assert!(err.contains(named), "{err}");
    path
}
