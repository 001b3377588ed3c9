//! Shared failure cases under faults: an inbox write that fails (C27), concurrent writers committing
//! out of id order (C01 stress), a NATS outage through a proxy (C05), and malformed rows from foreign
//! producers dead-lettered without blocking.

use outbox_testkit_macros::suite_test;
use std::sync::Arc;
use std::time::Duration;

use outbox::{Inbox, NewMessage, RelayConfig, Router, Status};
use outbox_testkit::store_suite::relay_routed;
use outbox_testkit::{PgFixture, SqliteFixture, StoreFixture, wait_metrics, wait_until, within};

use crate::relay::{counts_by_id, fast_config, memory_relay, wait_all_status};

/// C27 through the JetStream consumer runner: while the inbox insert fails (a trigger raises),
/// no message is acknowledged (each is negatively acknowledged and redelivered) and nothing is
/// applied; after the trigger is dropped all 10 are applied once.
#[suite_test]
async fn c27_nats_runner_does_not_ack_while_inbox_write_fails() {
    use outbox::consumer::ConsumerMetrics;
    use outbox::consumer::nats::NatsConsumerConfig;
    use outbox_testkit::NatsFixture;
    use std::sync::atomic::Ordering;

    let fx = PgFixture::new().await;
    let nats = NatsFixture::new().await;
    let pool = fx.store.pool().clone();
    let s = &fx.schema;
    let effects = format!("{s}.effects");
    crate::inbox::pg_effects(&pool, &effects).await;
    let inbox = Inbox::<sqlx::Postgres>::new(pool.clone(), &fx.inbox_table(), "billing").unwrap();
    inbox.migrate().await.unwrap();
    fx.refuse_inserts(&fx.inbox_table()).await;
    let router = Router::new().route("*", nats.transport.clone(), nats.topic_destination());
    let relay = relay_routed(fx.store(), router, fast_config("r1")).spawn();
    let mut config = NatsConsumerConfig::new(nats.stream.clone(), "billing");
    config.runner.retry = outbox::Backoff {
        base: Duration::from_millis(100),
        factor: 2.0,
        max: Duration::from_millis(400),
        jitter: 0.2,
    };
    let metrics = Arc::new(ConsumerMetrics::default());
    let cancel = tokio_util::sync::CancellationToken::new();
    let consumer = tokio::spawn(outbox::consumer::nats::run(
        nats.transport.jetstream().clone(),
        config,
        inbox,
        Arc::new(crate::inbox::EffectHandler::new(&effects)),
        metrics.clone(),
        cancel.clone(),
    ));
    fx.enqueue_numbered(10).await;
    wait_until("20 failed deliveries", Duration::from_secs(15), || async {
        metrics.failures.load(Ordering::Relaxed) >= 20
    })
    .await;
    assert_eq!(metrics.applied.load(Ordering::Relaxed), 0);
    let count = format!("SELECT COUNT(*) FROM {effects}");
    assert_eq!(crate::inbox::pg_count(&pool, &count).await, 0);
    // Nothing was acknowledged: every message is still pending on the consumer.
    let mut c = nats
        .transport
        .jetstream()
        .get_stream(&nats.stream)
        .await
        .unwrap()
        .get_consumer::<async_nats::jetstream::consumer::pull::Config>("billing")
        .await
        .unwrap();
    let info = c.info().await.unwrap();
    assert_eq!(info.ack_floor.stream_sequence, 0, "a message was acked");
    fx.allow_inserts(&fx.inbox_table()).await;
    wait_until(
        "10 effects after restore",
        Duration::from_secs(15),
        || async { crate::inbox::pg_count(&pool, &count).await >= 10 },
    )
    .await;
    assert_eq!(
        crate::inbox::pg_count(
            &pool,
            &format!("SELECT COUNT(DISTINCT message_id) FROM {effects}")
        )
        .await,
        10
    );
    assert_eq!(crate::inbox::pg_count(&pool, &count).await, 10);
    cancel.cancel();
    let _ = within("consumer stop", Duration::from_secs(5), consumer).await;
    relay.shutdown().await.unwrap();
    outbox_testkit::TransportFixture::cleanup(&nats).await;
    fx.cleanup().await;
}

/// C01, stress variant (scaled down from 16 writers × 10,000 messages): 16 writers commit after
/// a random 0–50 ms pause inside their transaction, so commits land in a different order from the
/// ids they drew; 1 in 10 transactions rolls back. The published set equals the committed set and
/// holds nothing rolled back.
#[suite_test]
async fn c01_stress_concurrent_writers_commit_out_of_id_order() {
    use rand::Rng;
    let fx = PgFixture::new().await;
    let (mem, relay) = memory_relay(&fx);
    let mut writers = tokio::task::JoinSet::new();
    for w in 0..16 {
        let store = fx.store.clone();
        writers.spawn(async move {
            let (mut committed, mut rolled_back) = (Vec::new(), Vec::new());
            for i in 0..100 {
                let (pause, rollback) = {
                    let mut rng = rand::rng();
                    (rng.random_range(0..50u64), rng.random_range(0..10) == 0)
                };
                let mut tx = store.pool().begin().await.unwrap();
                let id = store
                    .enqueue(&mut tx, NewMessage::new("t", format!("{w}-{i}")))
                    .await
                    .unwrap();
                // The business work between drawing the id and committing.
                tokio::time::sleep(Duration::from_millis(pause)).await;
                if rollback {
                    tx.rollback().await.unwrap();
                    rolled_back.push(id);
                } else {
                    store.commit(tx).await.unwrap();
                    committed.push(id);
                }
            }
            (committed, rolled_back)
        });
    }
    let (mut committed, mut rolled_back) = (std::collections::HashSet::new(), Vec::new());
    while let Some(r) = writers.join_next().await {
        let (c, r) = r.unwrap();
        committed.extend(c);
        rolled_back.extend(r);
    }
    within(
        "every committed message published",
        Duration::from_secs(30),
        mem.wait_for(committed.len()),
    )
    .await;
    wait_all_status(&fx, Status::Sent, Duration::from_secs(10)).await;
    let counts = counts_by_id(&mem.delivered());
    let published: std::collections::HashSet<_> = counts.keys().copied().collect();
    assert_eq!(
        published, committed,
        "published set differs from committed set"
    );
    assert!(rolled_back.iter().all(|id| !published.contains(id)));
    assert!(
        counts.values().all(|n| *n == 1),
        "a message was published twice"
    );
    relay.shutdown().await.unwrap();
    fx.cleanup().await;
}

/// C05 against the real broker: the relay's NATS connection is cut (a TCP proxy refuses it)
/// while messages are committed. The outage is noticed and logged in the metrics, nothing is
/// dead-lettered and no attempt is burned beyond the one in flight; every message is delivered,
/// once in the stream, after the broker comes back.
#[suite_test]
async fn c05_nats_outage_through_proxy_pauses_and_recovers() {
    let (proxy, nats) = outbox_testkit::NatsFixture::behind_proxy().await;
    let fx = SqliteFixture::new().await;
    let relay = relay_routed(
        fx.store(),
        Router::new().route("*", nats.transport.clone(), nats.topic_destination()),
        RelayConfig {
            max_attempts: 3,
            ..fast_config("r1")
        },
    )
    .spawn();
    fx.enqueue_commit(vec![NewMessage::new("before", "0")])
        .await
        .unwrap();
    wait_all_status(&fx, Status::Sent, Duration::from_secs(10)).await;

    proxy.set_blocked(true);
    let ids = fx.commit_numbered("during", "", 20).await;
    wait_metrics(relay.metrics(), 15, "the outage to be noticed", |m| {
        m.outages >= 1
    })
    .await;
    // Stay down for several probe periods and publish timeouts.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let m = relay.metrics().snapshot();
    assert_eq!(m.failed, 0, "an outage dead-lettered messages: {m:?}");
    for r in fx.rows().await {
        assert_ne!(r.status, Status::Failed.as_i16(), "{r:?}");
        assert!(r.attempts <= 1, "the outage burned attempts: {r:?}");
    }
    proxy.set_blocked(false);
    wait_all_status(&fx, Status::Sent, Duration::from_secs(30)).await;
    assert_eq!(
        nats.stored().await,
        1 + ids.len() as u64,
        "stream holds each message once"
    );
    relay.shutdown().await.unwrap();
    outbox_testkit::TransportFixture::cleanup(&nats).await;
}

/// Rows written by a foreign producer with plain SQL: a payload stored as TEXT is published as its
/// bytes; headers that are not a JSON object of strings, or a message id that is not a UUID, send
/// that row to FAILED with the reason at once, and the rest of its batch is delivered.
#[suite_test]
async fn sqlite_malformed_foreign_rows_are_dead_lettered_without_blocking(fx: SqliteFixture) {
    let pool = fx.store.pool().clone();
    let ok = uuid::Uuid::now_v7();
    for (mid, headers, payload) in [
        (ok.to_string(), "{}", "text payload"),
        (uuid::Uuid::now_v7().to_string(), "[1,2]", "bad headers"),
        ("not-a-uuid".to_string(), "{}", "bad id"),
    ] {
        sqlx::query(
            "INSERT INTO outbox (message_id, topic, headers, payload) VALUES (?1, 't', ?2, ?3)",
        )
        .bind(mid)
        .bind(headers)
        .bind(payload)
        .execute(&pool)
        .await
        .unwrap();
    }
    let good = fx.commit_one(NewMessage::new("t", "library")).await;
    let (mem, relay) = memory_relay(&fx);
    within(
        "the two good rows",
        Duration::from_secs(10),
        mem.wait_for(2),
    )
    .await;
    wait_until(
        "no row left PENDING or SENDING",
        Duration::from_secs(10),
        || {
            let pool = pool.clone();
            async move {
                let n: i64 =
                    sqlx::query_scalar("SELECT count(*) FROM outbox WHERE status IN (?1, ?2)")
                        .bind(Status::Pending.as_i16())
                        .bind(Status::Sending.as_i16())
                        .fetch_one(&pool)
                        .await
                        .unwrap();
                n == 0
            }
        },
    )
    .await;
    let delivered = mem.delivered();
    let by_id: std::collections::HashMap<_, _> = delivered
        .iter()
        .map(|d| (d.message.message_id, d.message.payload.clone()))
        .collect();
    assert_eq!(
        by_id.get(&ok).map(Vec::as_slice),
        Some(&b"text payload"[..])
    );
    assert!(by_id.contains_key(&good));
    let failed: Vec<(String, String)> =
        sqlx::query_as("SELECT message_id, last_error FROM outbox WHERE status = ?1 ORDER BY id")
            .bind(Status::Failed.as_i16())
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(failed.len(), 2, "{failed:?}");
    assert!(
        failed.iter().all(|(_, e)| e.starts_with("malformed row")),
        "{failed:?}"
    );
    assert!(failed[1].1.contains("not a UUID"), "{failed:?}");
    assert_eq!(relay.metrics().snapshot().store_errors, 0);
    relay.shutdown().await.unwrap();
}

/// The same on PostgreSQL: headers that are valid JSON but not an object of strings.
#[suite_test]
async fn postgres_malformed_foreign_rows_are_dead_lettered_without_blocking(fx: PgFixture) {
    let t = fx.table();
    fx.exec(&format!(
        "INSERT INTO {t} (topic, headers, payload) VALUES ('t', '[1]', 'x'), ('t', '{{\"a\": 1}}', 'y'), ('t', '{{}}', 'z')"
    ))
    .await;
    let (mem, relay) = memory_relay(&fx);
    within("the good row", Duration::from_secs(10), mem.wait_for(1)).await;
    wait_until(
        "two rows dead-lettered",
        Duration::from_secs(10),
        || async {
            fx.count(&format!(
                "{t} WHERE status = {} AND last_error LIKE 'malformed row%'",
                Status::Failed.as_i16()
            ))
            .await
                == 2
        },
    )
    .await;
    assert_eq!(mem.delivered()[0].message.payload, b"z");
    relay.shutdown().await.unwrap();
}
