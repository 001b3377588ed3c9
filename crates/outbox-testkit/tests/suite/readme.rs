//! Issue 11 item 13: the README's producer, embedded relay and consumer examples are the files of
//! `crates/outbox/examples/readme` (checked here block by block), and those files, run together
//! as a user would copy them, deliver every order to the consumer exactly once on the real
//! PostgreSQL and NATS JetStream.

use outbox_testkit_macros::suite_test;
#[path = "../../../outbox/examples/readme/consumer.rs"]
mod consumer;
#[path = "../../../outbox/examples/readme/producer.rs"]
mod producer;
#[path = "../../../outbox/examples/readme/relay.rs"]
mod relay;

use std::path::PathBuf;
use std::time::Duration;

use outbox::{PgStore, StoreOptions};
use tokio_util::sync::CancellationToken;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The code blocks of `README.md` that follow a `<!-- example: PATH -->` marker, with PATH.
fn readme_examples() -> Vec<(String, String)> {
    let readme = std::fs::read_to_string(repo().join("README.md")).expect("README.md");
    let mut out = Vec::new();
    let mut rest = readme.as_str();
    while let Some(at) = rest.find("<!-- example: ") {
        rest = &rest[at + "<!-- example: ".len()..];
        let end = rest.find(" -->").expect("marker ends with -->");
        let path = rest[..end].to_owned();
        let fence = rest
            .find("```rust")
            .expect("a rust block follows the marker");
        let body_start = fence + rest[fence..].find('\n').expect("fence line") + 1;
        let body_len = rest[body_start..].find("\n```").expect("closing fence") + 1;
        out.push((path, rest[body_start..body_start + body_len].to_owned()));
        rest = &rest[body_start + body_len..];
    }
    out
}

/// The README's producer, relay and consumer blocks are exactly the example files the test
/// below runs (so what a user copies is what was tested).
#[test]
fn defect_13_readme_code_blocks_are_the_example_files() {
    let blocks = readme_examples();
    let paths: Vec<&str> = blocks.iter().map(|(p, _)| p.as_str()).collect();
    for file in ["producer.rs", "relay.rs", "consumer.rs"] {
        let path = format!("crates/outbox/examples/readme/{file}");
        assert!(
            paths.contains(&path.as_str()),
            "README.md has no block marked `<!-- example: {path} -->` (found {paths:?})"
        );
    }
    for (path, block) in &blocks {
        let file = std::fs::read_to_string(repo().join(path))
            .unwrap_or_else(|e| panic!("README names {path}: {e}"));
        if *block != file {
            let line = block
                .lines()
                .zip(file.lines())
                .position(|(a, b)| a != b)
                .map_or(block.lines().count().min(file.lines().count()) + 1, |i| {
                    i + 1
                });
            panic!(
                "README.md's block for {path} differs from the file at line {line}:\n\
                 README: {:?}\nfile:   {:?}\n(copy the file into the README)",
                block.lines().nth(line - 1),
                file.lines().nth(line - 1)
            );
        }
    }
}

/// The README's three examples run together against the real PostgreSQL and NATS JetStream:
/// the producer places orders, the embedded relay publishes them to the stream `ORDERS` it
/// creates, the consumer reads that stream and applies each order once (stock decremented by
/// exactly the ordered quantities, one inbox row per message, nothing FAILED). With the
/// README's previous relay example (no stream, a catch-all route elsewhere) every message was
/// dead-lettered ("no stream for subject") and the consumer found no stream `ORDERS`.
#[suite_test]
async fn defect_13_readme_examples_deliver_every_order_once() {
    // Own schema (the examples use the default table names) and a fresh stream `ORDERS`.
    let admin = outbox_testkit::pg_pool(2).await;
    let schema = outbox_testkit::unique("readme");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&admin)
        .await
        .unwrap();
    let base = outbox_testkit::postgres_url();
    let sep = if base.contains('?') { '&' } else { '?' };
    let url = format!("{base}{sep}options=-c%20search_path%3D{schema}");
    let js = async_nats::jetstream::new(outbox_testkit::nats_client().await);
    let _ = js.delete_stream("ORDERS").await;

    let store = PgStore::connect(&url, StoreOptions::default())
        .await
        .expect("connect");
    sqlx::raw_sql(
        "CREATE TABLE orders (id bigint PRIMARY KEY, sku text NOT NULL, qty bigint NOT NULL);
         CREATE TABLE stock (sku text PRIMARY KEY, qty bigint NOT NULL);
         INSERT INTO stock (sku, qty) VALUES ('apple', 100000)",
    )
    .execute(store.pool())
    .await
    .unwrap();

    let nats_url = outbox_testkit::nats_url();
    let handle = relay::start_relay(store.clone(), &nats_url)
        .await
        .expect("the README's relay starts");
    let cancel = CancellationToken::new();
    let consumer = {
        let (pool, url, cancel) = (store.pool().clone(), nats_url.clone(), cancel.clone());
        tokio::spawn(async move { consumer::run_consumer(pool, &url, cancel).await })
    };
    let n = 60i64;
    let mut ordered = 0;
    for id in 1..=n {
        let qty = id % 3 + 1;
        ordered += qty;
        producer::place_order(&store, id, "apple", qty)
            .await
            .expect("the README's producer");
    }

    let q = |sql: &'static str| {
        let pool = store.pool().clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let applied = q("SELECT COUNT(*) FROM outbox_inbox WHERE consumer = 'inventory'").await;
        let failed = q("SELECT COUNT(*) FROM outbox WHERE status = 4").await;
        assert_eq!(
            failed,
            0,
            "messages dead-lettered: {:?}",
            sqlx::query_scalar::<_, Option<String>>(
                "SELECT last_error FROM outbox WHERE status = 4 LIMIT 1"
            )
            .fetch_one(store.pool())
            .await
            .unwrap()
        );
        if applied == n {
            break;
        }
        assert!(
            !consumer.is_finished(),
            "the README's consumer stopped: {:?}",
            consumer.await
        );
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {applied} of {n} orders applied by the consumer within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cancel.cancel();
    consumer
        .await
        .unwrap()
        .expect("the README's consumer ends cleanly");
    handle.shutdown().await.unwrap();

    // Each order applied once: the stock went down by exactly the ordered quantities.
    let stock = q("SELECT qty FROM stock WHERE sku = 'apple'").await;
    assert_eq!(
        stock,
        100_000 - ordered,
        "an order was applied twice or not at all"
    );
    assert_eq!(q("SELECT COUNT(*) FROM outbox WHERE status = 2").await, n);
    let info = outbox_testkit::nats_stream_info(&js, "ORDERS").await;
    assert_eq!(
        info.state.messages, n as u64,
        "one message per order in ORDERS"
    );

    drop(store);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&admin)
        .await
        .unwrap();
    js.delete_stream("ORDERS").await.unwrap();
}
