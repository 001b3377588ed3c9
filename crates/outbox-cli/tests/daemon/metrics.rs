//! `[admin] listen`: the daemon's `/metrics`, scraped over HTTP and read with a Prometheus
//! text-format parser (`prometheus-parse`), not by searching the text.

use super::*;

/// A free loopback address for the admin listener.
pub(super) fn free_addr() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("127.0.0.1:{port}")
}

/// Start `outbox relay` named `<name>-relay` (lease 3 s, routes `order-*`) with `[admin]` on a
/// free loopback port plus `admin` lines: the admin address and the running relay.
fn admin_relay(f: &Fixture, name: &str, admin: &str) -> (String, Relays) {
    let addr = free_addr();
    let relay = format!(
        "name = \"{name}-relay\"\npoll_interval = \"200ms\"\nlease = \"3s\"\npublish_timeout = \"1s\"\n"
    );
    let mut toml = f.toml(&relay, &f.route("order-*"));
    toml.push_str(&format!("\n[admin]\nlisten = \"{addr}\"\n{admin}"));
    let config = f.write(&format!("{name}.toml"), &toml);
    let relays = Relays(vec![f.spawn_relay_logged(&config, name)]);
    (addr, relays)
}

/// The samples of `body` as `name{labels}` → value; a histogram's value is its observation
/// count (its `+Inf` bucket), its `_sum` and `_count` are samples of their own.
pub(super) fn samples(body: &str) -> BTreeMap<String, f64> {
    let scrape = prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_owned())))
        .expect("a Prometheus text exposition");
    scrape
        .samples
        .into_iter()
        .map(|s| {
            let v = match s.value {
                prometheus_parse::Value::Counter(v)
                | prometheus_parse::Value::Gauge(v)
                | prometheus_parse::Value::Untyped(v) => v,
                prometheus_parse::Value::Histogram(buckets) => {
                    let inf = buckets.iter().find(|b| b.less_than == f64::INFINITY);
                    inf.unwrap_or_else(|| panic!("{}: no +Inf bucket", s.metric))
                        .count
                }
                other => panic!("{}: unexpected {other:?}", s.metric),
            };
            let mut labels: Vec<String> =
                s.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
            labels.sort();
            (format!("{}{{{}}}", s.metric, labels.join(",")), v)
        })
        .collect()
}

/// The metric families of `body`: each name once (a histogram by its family name, its `_sum`
/// and `_count` too).
fn families(body: &str) -> BTreeSet<String> {
    samples(body)
        .keys()
        .map(|k| k.split('{').next().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn metrics_endpoint_serves_relay_counters_and_backlog() {
    let (f, pool, js) = Fixture::started("metrics").await;
    // With a confirmation listener, so its counters are served too.
    let listener = format!(
        "backlog_sample_interval = \"200ms\"\n\n[confirmations]\nkind = \"nats\"\nurl = \"{}\"\nsubject = \"replies.{}\"\n",
        nats_url(),
        f.table
    );
    let (addr, _relays) = admin_relay(&f, "metrics", &listener);
    // 30 routed messages, 2 on a topic no relay routes (dead-lettered).
    for (topic, n) in [("order-created", 30), ("unrouted", 2)] {
        for i in 0..n {
            insert_message(&pool, &f.table, topic, format!("{i}")).await;
        }
    }
    wait_until_sent(&pool, &f.table, 30, Duration::from_secs(20)).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let m = loop {
        if let Some((status, body)) = get(&addr, "/metrics").await {
            assert_eq!(status, 200, "GET /metrics: {body}");
            let m = samples(&body);
            let published = m
                .get("outbox_relay_messages_published_total{relay=metrics-relay}")
                .copied();
            let failed = m.get("outbox_backlog_failed_messages{}").copied();
            if published == Some(30.0) && failed == Some(2.0) {
                break m;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the metrics never showed 30 published and 2 dead letters; log in {}",
            f.dir.display()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        m["outbox_relay_messages_dead_lettered_total{relay=metrics-relay}"],
        2.0
    );
    // The same listener serves the admin API: the two dead letters are found by topic; without
    // `token_env` it only reads.
    let (code, body) = get(&addr, "/api/messages?state=failed&topic=unrout*")
        .await
        .expect("GET /api/messages");
    assert_eq!(code, 200, "{body}");
    let page: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(page["messages"].as_array().map(Vec::len), Some(2), "{body}");
    let (code, body) = super::messages::request(
        &addr,
        "POST",
        "/api/messages/discard",
        None,
        r#"{"ids":[1]}"#,
    )
    .await;
    assert_eq!(code, 403, "{body}");
    assert_eq!(m["outbox_backlog_pending_messages{}"], 0.0);
    assert_eq!(m["outbox_backlog_oldest_pending_age_seconds{}"], 0.0);
    assert!(m["outbox_relay_buckets_acquired_total{relay=metrics-relay}"] >= 1.0);
    assert_eq!(
        m["outbox_relay_transport_up{relay=metrics-relay,transport=nats}"], 1.0,
        "{m:?}"
    );
    assert_eq!(m["outbox_relay_healthy{relay=metrics-relay}"], 1.0);
    assert!(m["outbox_backlog_sample_age_seconds{}"] < 5.0);
    // The histograms: every routed message acknowledged on its first attempt is one
    // enqueue → ack observation, each within the test's time; the batches published add up to
    // at least the 30 messages (the 2 unrouted ones never reach a transport).
    let r = "{relay=metrics-relay}";
    assert_eq!(m[&format!("outbox_relay_enqueue_to_ack_seconds{r}")], 30.0);
    assert_eq!(
        m[&format!("outbox_relay_enqueue_to_ack_seconds_count{r}")],
        30.0
    );
    let latency = m[&format!("outbox_relay_enqueue_to_ack_seconds_sum{r}")];
    assert!(latency > 0.0 && latency < 30.0 * 20.0, "sum {latency}");
    assert!(m[&format!("outbox_relay_publish_batch_messages_sum{r}")] >= 30.0);
    let publishes = m[&format!("outbox_relay_publish_duration_seconds_count{r}")];
    assert!(publishes >= 1.0);
    assert_eq!(
        m[&format!("outbox_relay_publish_batch_messages_count{r}")],
        publishes
    );
    // Database errors by kind: a series per kind, none in a healthy run.
    for kind in [
        "transient",
        "missing_table",
        "config",
        "corrupt",
        "unavailable",
        "schema_version",
        "other",
    ] {
        let key = format!("outbox_relay_store_errors_total{{kind={kind},relay=metrics-relay}}");
        assert_eq!(m.get(&key), Some(&0.0), "{key}");
    }
    assert_eq!(m["outbox_confirmations_unknown_total{}"], 0.0);

    // The alert rules and the Grafana dashboard of deploy/ use only metrics that exist: those
    // this daemon serves plus a consumer runner's (served by an application or the demo).
    let body = get(&addr, "/metrics").await.expect("/metrics").1;
    let mut names = families(&body);
    let mut registry = prometheus_client::registry::Registry::default();
    outbox::prometheus::register_consumer(&mut registry, "inventory", Default::default());
    let mut consumer = String::new();
    prometheus_client::encoding::text::encode(&mut consumer, &registry).unwrap();
    names.extend(families(&consumer));
    let file = f.dir.join("metric-names.txt");
    std::fs::write(&file, names.into_iter().collect::<Vec<_>>().join("\n")).unwrap();
    let check = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/check.sh");
    let out = std::process::Command::new("bash")
        .arg(&check)
        .arg(&file)
        .output()
        .expect("run bash deploy/check.sh");
    assert!(
        out.status.success(),
        "deploy/check.sh failed (it needs promtool, from Debian's prometheus package):\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    js.delete_stream(&f.stream).await.unwrap();
}

/// `GET http://<addr><path>`: status code and body.
pub(super) async fn get(addr: &str, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).await.ok()?;
    let (head, body) = raw.split_once("\r\n\r\n")?;
    let code = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, body.to_owned()))
}

/// Poll `path` until its status is `code` (within 20 s): the body.
pub(super) async fn wait_status(addr: &str, path: &str, code: u16, dir: &Path) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Some((c, body)) = get(addr, path).await
            && c == code
        {
            return body;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{path} never answered {code}; relay log in {}",
            dir.display()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A batch wedged on the database (its completion waits on bucket rows a stranger holds
/// locked): `/healthz` turns 503 naming the stuck batch, and 200 again once the lock goes.
#[tokio::test]
async fn healthz_reports_a_wedged_batch_and_recovers() {
    let (f, pool, js) = Fixture::started("health").await;
    let (addr, _relays) = admin_relay(&f, "health", "");
    wait_status(&addr, "/readyz", 200, &f.dir).await;
    assert_eq!(get(&addr, "/healthz").await.map(|(c, _)| c), Some(200));

    // A stranger locks every bucket row: completions and renewals wait on it.
    let mut stranger = pool.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT bucket FROM {}_buckets FOR UPDATE",
        f.table
    )))
    .fetch_all(&mut *stranger)
    .await
    .unwrap();
    insert_message(&pool, &f.table, "order-created", "x").await;
    let body = wait_status(&addr, "/healthz", 503, &f.dir).await;
    let ready = get(&addr, "/readyz").await.expect("/readyz answers");
    assert_eq!(ready.0, 503, "/readyz: {}", ready.1);
    // Held until the batch is reported stuck, not only the membership.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut body = body;
    while !body.contains("in flight") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "/healthz never named the stuck batch: {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        body = get(&addr, "/healthz")
            .await
            .map(|(_, b)| b)
            .unwrap_or_default();
    }
    eprintln!("healthz while wedged: {body}");
    stranger.rollback().await.unwrap();
    wait_status(&addr, "/healthz", 200, &f.dir).await;
    wait_status(&addr, "/readyz", 200, &f.dir).await;
    wait_until_sent(&pool, &f.table, 1, Duration::from_secs(20)).await;
    js.delete_stream(&f.stream).await.unwrap();
}
