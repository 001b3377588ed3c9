//! The web dashboard in a real browser: `outbox relay` on PostgreSQL and NATS JetStream serves it
//! on its `[admin]` listener, and `tests/browser/dashboard.mjs` drives Debian's chromium through
//! it with playwright-core: the overview, a search by message id and by key, a dead letter
//! opened, requeued (refused without the token, done with it), the counts changing and the relay
//! publishing it; a consumer's inbox dead letters listed, one opened and discarded, the other
//! replayed. Screenshots of each page go to `<fixture dir>/shots` (copies are kept in
//! `docs/dashboard/`).
//!
//! Needs node, chromium (`CHROMIUM`, default `/usr/bin/chromium`) and playwright-core in
//! `tests/browser/node_modules`: `.ci/services/browser.sh` installs them.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_in_a_real_browser() {
    browser_ready();
    let (f, pool, js) = Fixture::started("dash").await;
    let t = &f.table;
    for i in 0..6 {
        let key = if i % 2 == 0 { "order-42" } else { "order-43" };
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {t} (topic, partition_key, payload) VALUES ('orders.created', $1, $2)"
        )))
        .bind(key)
        .bind(format!(r#"{{"order":{i}}}"#).into_bytes())
        .execute(&pool)
        .await
        .unwrap();
    }
    // Two dead letters, as a relay leaves them after a broker refused them.
    let mut dead = Vec::new();
    for i in 0..2 {
        let row: (i64, uuid::Uuid) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {t} (topic, partition_key, payload, status, attempts, last_error) \
             VALUES ('orders.created', $1, $2, {failed}, 16, 'simulated broker refusal') \
             RETURNING id, message_id",
            failed = Status::Failed.as_i16()
        )))
        .bind(format!("order-9{i}"))
        .bind(format!(r#"{{"order":9{i}}}"#).into_bytes())
        .fetch_one(&pool)
        .await
        .unwrap();
        dead.push(row);
    }

    // A two-phase message parked as UNDECIDED, its check-back a hook the daemon does not have
    // (so after the resume it stays PREPARED: errors are not counted).
    let undecided: (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {t} (topic, payload, status, check_backs, check_back, last_error) \
         VALUES ('orders.created', '\\x7b7d', {undecided}, 15, 'hook:orders', \
                 'undecided: 15 check-backs answered UNKNOWN') RETURNING id",
        undecided = Status::Undecided.as_i16()
    )))
    .fetch_one(&pool)
    .await
    .unwrap();

    // Two dead letters of the consumer "inventory" in the inbox `[database] inbox_table`, as the
    // consumer runner leaves them (Inbox::dead_letter).
    let inbox =
        outbox::Inbox::<sqlx::Postgres>::new(pool.clone(), &format!("{t}_inbox"), "inventory")
            .unwrap();
    let mut inbox_dead = Vec::new();
    for i in 0..2 {
        let msg = outbox::InboundMessage {
            message_id: uuid::Uuid::now_v7(),
            topic: "orders.created".into(),
            partition_key: Some(format!("order-7{i}")),
            headers: [("trace".to_owned(), format!("t-{i}"))].into(),
            payload: format!(r#"{{"order":7{i}}}"#).into_bytes(),
            delivery_count: 5,
        };
        inbox
            .dead_letter(&msg, "stock service said no", 5)
            .await
            .unwrap();
        inbox_dead.push(msg.message_id);
    }

    let addr = super::metrics::free_addr();
    let relay = "name = \"dash-relay\"\npoll_interval = \"200ms\"\nlease = \"3s\"\npublish_timeout = \"1s\"\n";
    let mut toml = f.toml(relay, &f.route("orders.*"));
    toml.push_str(&format!(
        "\n[admin]\nlisten = \"{addr}\"\ntoken_env = \"OUTBOX_DASH_TOKEN\"\n"
    ));
    let config = f.write("dash.toml", &toml);
    let log = std::fs::File::create(f.dir.join("dash.log")).unwrap();
    let _relays = Relays(vec![
        outbox()
            .args(["relay", "--config"])
            .arg(&config)
            .env("OUTBOX_DASH_TOKEN", "dash-token")
            .env("RUST_LOG", "info,sqlx=warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start outbox relay"),
    ]);
    wait_until_sent(&pool, t, 6, Duration::from_secs(20)).await;

    run_browser(
        "dashboard.mjs",
        &[
            ("DASH_URL", format!("http://{addr}")),
            ("DASH_TOKEN", "dash-token".into()),
            ("DASH_FAILED_ID", dead[0].0.to_string()),
            ("DASH_FAILED_MID", dead[0].1.to_string()),
            ("DASH_UNDECIDED_ID", undecided.0.to_string()),
            ("DASH_KEY", "order-42".into()),
            ("DASH_INBOX_DISCARD", inbox_dead[0].to_string()),
            ("DASH_INBOX_REPLAY", inbox_dead[1].to_string()),
        ],
        "DASH_SHOTS",
        &f,
    )
    .await;
    // What the browser did is in the table: one dead letter left, the other published.
    assert_eq!(count(&pool, t, Status::Failed).await, 1);
    assert_eq!(count(&pool, t, Status::Sent).await, 7);
    // And in the inbox: one dead letter discarded, the other waiting for its replay.
    let left = inbox.dead_letters(10).await.unwrap();
    assert_eq!(left.len(), 1, "{left:?}");
    assert_eq!(left[0].message.message_id, inbox_dead[1]);
    assert!(left[0].replay_requested, "{left:?}");
    js.delete_stream(&f.stream).await.unwrap();
}

/// Chromium and playwright-core are installed (`.ci/services/browser.sh`), or the test fails
/// naming them.
pub(super) fn browser_ready() {
    let browser_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser");
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    assert!(
        Path::new(&chromium).exists(),
        "chromium is required at {chromium} (set CHROMIUM; .ci/services/browser.sh installs Debian's chromium)"
    );
    assert!(
        browser_dir.join("node_modules/playwright-core").exists(),
        "playwright-core is required in {}: run .ci/services/browser.sh (npm ci there)",
        browser_dir.display()
    );
}

/// Run `tests/browser/<script>` with `env`, its screenshots going to `<fixture dir>/shots`
/// (passed as `shots_var`); fails with its output, the relay log and the screenshots' place
/// unless it succeeds.
pub(super) async fn run_browser(
    script: &str,
    env: &[(&str, String)],
    shots_var: &str,
    f: &Fixture,
) {
    browser_ready();
    let browser_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser");
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    let shots = f.dir.join("shots");
    std::fs::create_dir_all(&shots).unwrap();
    let out = tokio::process::Command::new("node")
        .arg(script)
        .current_dir(&browser_dir)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .env(shots_var, &shots)
        .env("CHROMIUM", &chromium)
        .output()
        .await
        .expect("node is required to drive the browser (Debian's nodejs)");
    assert!(
        out.status.success(),
        "{script} failed:\n{}\n{}\nrelay log in {}, screenshots in {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        f.dir.display(),
        shots.display()
    );
    eprintln!(
        "{}screenshots in {}",
        String::from_utf8_lossy(&out.stdout),
        shots.display()
    );
}
