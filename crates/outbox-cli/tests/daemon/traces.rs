//! The daemon's OpenTelemetry trace export (docs/operations.md, "Traces"): with the standard
//! `OTEL_EXPORTER_OTLP_ENDPOINT`, a row whose headers carry a W3C `traceparent` (written by a
//! producer in another language, by plain SQL) is published in an `outbox.publish` span of that
//! trace, exported over OTLP/HTTP to a collector (here a test server on loopback that records
//! the requests); the message on the broker carries the publish span as its parent.

use std::sync::{Arc, Mutex};

use super::*;

/// The requests a stand-in collector received: content type and body of each.
type Received = Arc<Mutex<Vec<(String, Vec<u8>)>>>;

/// A stand-in OTLP/HTTP collector: records the body of every `POST /v1/traces`, answers 200
/// with an empty `ExportTraceServiceResponse`.
async fn collector() -> (String, Received) {
    let seen: Received = Arc::default();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post({
            let seen = seen.clone();
            move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
                let seen = seen.clone();
                async move {
                    let ct = headers
                        .get("content-type")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_owned();
                    seen.lock().unwrap().push((ct, body.to_vec()));
                    (
                        [("content-type", "application/x-protobuf")],
                        Vec::<u8>::new(),
                    )
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), seen)
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_exports_publish_spans_over_otlp_in_the_producers_trace() {
    let (endpoint, seen) = collector().await;
    let (f, pool, js) = Fixture::started("otel").await;
    let config = f.config("30s", "5s");
    let mut relay = outbox()
        .args(["relay", "--config"])
        .arg(&config)
        .env("RUST_LOG", "warn")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
        .env("OTEL_SERVICE_NAME", "outbox-daemon-test")
        // The batch span processor's delay between exports, in milliseconds (default 5000).
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start outbox relay");

    let trace_id = format!("{:032x}", rand::random::<u128>() | 1);
    let parent = format!("{:016x}", rand::random::<u64>() | 1);
    let headers = format!(r#"{{"traceparent":"00-{trace_id}-{parent}-01"}}"#);
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {} (topic, headers, payload) VALUES ('order-created', $1::jsonb, $2)",
        f.table
    )))
    .bind(&headers)
    .bind(b"{}".to_vec())
    .execute(&pool)
    .await
    .unwrap();
    wait_until_sent(&pool, &f.table, 1, Duration::from_secs(10)).await;

    // The broker's copy continues the trace with the publish span as the parent.
    let stream = js.get_stream(&f.stream).await.unwrap();
    let consumer = unacked_consumer(&stream).await;
    let mut messages = fetch(&consumer, 1, Duration::from_secs(2)).await;
    let m = messages.next().await.expect("the message").unwrap();
    let sent = header(&m, "traceparent");
    let parts: Vec<&str> = sent.split('-').collect();
    assert_eq!(parts.len(), 4, "{sent}");
    assert_eq!(parts[1], trace_id, "same trace: {sent}");
    assert_ne!(
        parts[2], parent,
        "the publish span is the parent now: {sent}"
    );

    // The exported span: this trace, the publish span's id, the name and the service.
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let found = seen.lock().unwrap().iter().any(|(ct, body)| {
            ct == "application/x-protobuf"
                && contains(body, &hex(&trace_id))
                && contains(body, &hex(parts[2]))
                && contains(body, &hex(&parent))
                && contains(body, b"outbox.publish")
                && contains(body, b"outbox-daemon-test")
        });
        if found {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no OTLP export with the publish span of trace {trace_id}; {} requests seen",
            seen.lock().unwrap().len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    nix_kill(&relay, "TERM");
    let status = wait_exit(&mut relay, Duration::from_secs(20));
    assert_eq!(status.code(), Some(0), "{status:?}");
    js.delete_stream(&f.stream).await.unwrap();
}

/// An OTLP protocol this build does not have is refused at startup, named.
#[test]
fn an_unsupported_otlp_protocol_is_named_at_startup() {
    let f = Fixture::new("otelproto");
    let config = f.config("30s", "5s");
    let err = fails(
        outbox()
            .args(["relay", "--config"])
            .arg(&config)
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
            .env("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
    );
    assert!(
        err.contains("OTEL_EXPORTER_OTLP_PROTOCOL") && err.contains("grpc"),
        "{err}"
    );
}
