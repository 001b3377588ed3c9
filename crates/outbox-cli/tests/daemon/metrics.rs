//! `[admin] listen`: the daemon's `/metrics`, scraped over HTTP and read with a Prometheus
//! text-format parser (`prometheus-parse`), not by searching the text.

use super::*;

/// `GET http://<addr>/metrics`: status line and body.
async fn scrape(addr: &str) -> std::io::Result<(String, String)> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).await?;
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    Ok((
        head.lines().next().unwrap_or_default().to_owned(),
        body.to_owned(),
    ))
}

/// The samples of `body` as `name{labels}` → value.
fn samples(body: &str) -> BTreeMap<String, f64> {
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
                other => panic!("{}: unexpected {other:?}", s.metric),
            };
            let mut labels: Vec<String> =
                s.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
            labels.sort();
            (format!("{}{{{}}}", s.metric, labels.join(",")), v)
        })
        .collect()
}

#[tokio::test]
async fn metrics_endpoint_serves_relay_counters_and_backlog() {
    let (f, pool, js) = Fixture::started("metrics").await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let relay = "name = \"metrics-relay\"\npoll_interval = \"300ms\"\nlease = \"3s\"\n\
                 publish_timeout = \"1s\"\n";
    let mut toml = f.toml(relay, &f.route("order-*"));
    toml.push_str(&format!(
        "\n[admin]\nlisten = \"{addr}\"\nbacklog_sample_interval = \"200ms\"\n"
    ));
    let config = f.write("metrics.toml", &toml);
    let _relays = Relays(vec![f.spawn_relay_logged(&config, "metrics")]);
    // 30 routed messages, 2 on a topic no relay routes (dead-lettered).
    for (topic, n) in [("order-created", 30), ("unrouted", 2)] {
        for i in 0..n {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {} (topic, payload) VALUES ($1, $2)",
                f.table
            )))
            .bind(topic)
            .bind(format!("{i}").into_bytes())
            .execute(&pool)
            .await
            .unwrap();
        }
    }
    wait_until_sent(&pool, &f.table, 30, Duration::from_secs(20)).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let m = loop {
        if let Ok((status, body)) = scrape(&addr).await {
            assert!(status.contains(" 200 "), "GET /metrics: {status}");
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
    assert_eq!(m["outbox_backlog_pending_messages{}"], 0.0);
    assert_eq!(m["outbox_backlog_oldest_pending_age_seconds{}"], 0.0);
    assert!(m["outbox_relay_buckets_acquired_total{relay=metrics-relay}"] >= 1.0);
    assert!(m["outbox_backlog_sample_age_seconds{}"] < 5.0);
    js.delete_stream(&f.stream).await.unwrap();
}
