//! Confirmations over webhooks, SQLite on both sides: the consumer's axum receiver confirms to
//! the producer's confirmation endpoint, one request per message or one per group commit.

use outbox_testkit_macros::suite_test;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use outbox::confirm::webhook::WebhookConfirmationSender;
use outbox::consumer::{ConsumerMetrics, DeliveryPolicy};
use outbox::{ConfirmPolicy, Inbox, NewMessage, Relay, Router, Status};
use outbox_testkit::{ConfirmFixture, HookControl, SqliteFixture, StoreFixture};
use uuid::Uuid;

use crate::confirm::{FaultySender, ScriptedHandler, confirm_config, fast_retry, wait_status};

/// Webhooks, SQLite on both sides: the consumer's axum receiver (`router_with`) confirms to the
/// producer's confirmation endpoint (`confirm::webhook::router`); processed → CONFIRMED, rejected
/// → REJECTED with the compensation once, a lost confirmation recovered by the check-back with
/// the effect once.
#[suite_test(workers = 4)]
async fn webhook_sqlite_confirmed_rejected_and_lost_confirmation() {
    webhook_sqlite_confirmations(1).await;
}

/// As above with the receiver's group commit (`inbox_batch` 16): the requests the relay posts
/// at once are applied in shared inbox transactions, and each group's confirmations go to the
/// producer's endpoint as one JSON array (`WebhookConfirmationSender::send_all`), applied there
/// in one transaction.
#[suite_test(workers = 4)]
async fn webhook_sqlite_group_commit_confirms_each_group_in_one_request() {
    let (sender, metrics) = webhook_sqlite_confirmations(16).await;
    assert!(
        sender.together.load(Ordering::SeqCst) >= 1,
        "no group's confirmations went out together"
    );
    assert!(metrics.inbox_batches.load(Ordering::Relaxed) >= 1);
}

/// The body of the two tests above: returns the confirmation sender and the consumer's metrics.
async fn webhook_sqlite_confirmations(
    inbox_batch: usize,
) -> (Arc<FaultySender>, Arc<ConsumerMetrics>) {
    crate::init_tracing();
    let producer = SqliteFixture::new().await;
    let consumer_db = SqliteFixture::new().await;
    let ctl = Arc::new(HookControl::default());
    let store = producer.store_with_hook(ctl.clone()).await;
    let cpool = consumer_db.store.pool().clone();
    crate::inbox::sqlite_effects_table(&cpool).await;
    let inbox = Inbox::<sqlx::Sqlite>::new(cpool.clone(), "consumer_inbox", "shipping").unwrap();
    inbox.migrate().await.unwrap();

    let (confirm_base, stop_confirm) =
        crate::admin::serve_app(outbox::confirm::webhook::router("/confirm", store.clone())).await;

    let sender = FaultySender::new(Arc::new(WebhookConfirmationSender::new()));
    let handler = ScriptedHandler::new("effects");
    let metrics = Arc::new(ConsumerMetrics::default());
    let policy = DeliveryPolicy {
        max_deliveries: 3,
        retry: fast_retry(),
        confirmations: Some(sender.clone()),
        inbox_batch,
    };
    let app = outbox::consumer::webhook::router_with(
        "/in",
        inbox.clone(),
        handler.clone(),
        None,
        metrics.clone(),
        policy,
    )
    .unwrap();
    let (consumer_base, stop_consumer) = crate::admin::serve_app(app).await;

    let mut wc = outbox::WebhookConfig::new(format!("{consumer_base}/in"));
    wc.timeout = Duration::from_secs(5);
    let transport = Arc::new(outbox::WebhookTransport::new(wc).unwrap());
    let relay = Relay::builder(store.clone())
        .router(Router::new().route_confirmed(
            "*",
            transport,
            "",
            ConfirmPolicy {
                reply_to: format!("{confirm_base}/confirm"),
                timeout: Duration::from_secs(1),
            },
        ))
        .config(confirm_config("w1"))
        .build()
        .unwrap()
        .spawn();

    let mut msgs: Vec<NewMessage> = (0..6)
        .map(|i| NewMessage::new("orders", format!("ok-{i}")))
        .collect();
    msgs.extend((0..2).map(|i| NewMessage::new("orders", format!("reject-{i}"))));
    msgs.push(NewMessage::new("orders", "lost"));
    let lost = msgs[8].message_id();
    sender.lose.lock().unwrap().insert(lost);
    let ids = producer.enqueue_commit(msgs).await.unwrap();
    let (ok, rejected) = (&ids[..6], &ids[6..8]);
    wait_status(&producer, ok, Status::Confirmed, Duration::from_secs(15)).await;
    wait_status(
        &producer,
        rejected,
        Status::Rejected,
        Duration::from_secs(15),
    )
    .await;
    wait_status(
        &producer,
        &[lost],
        Status::Confirmed,
        Duration::from_secs(15),
    )
    .await;

    let effects_of = |id: Uuid| {
        let cpool = cpool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM effects WHERE message_id = ?1")
                .bind(id.to_string())
                .fetch_one(&cpool)
                .await
                .unwrap()
        }
    };
    for id in rejected {
        assert_eq!(producer.compensations(*id).await, 1);
        assert_eq!(effects_of(*id).await, 0);
    }
    assert_eq!(ctl.calls.load(Ordering::SeqCst), 2);
    for id in ok.iter().chain([&lost]) {
        assert_eq!(effects_of(*id).await, 1, "effect exactly once");
    }
    assert_eq!(sender.lost.load(Ordering::SeqCst), 1);
    assert!(producer.confirm_state(lost).await.check_backs >= 1);
    assert!(metrics.duplicates.load(Ordering::Relaxed) >= 1);
    assert_eq!(metrics.applied.load(Ordering::Relaxed), 7);
    assert_eq!(metrics.rejected.load(Ordering::Relaxed), 2);
    assert_eq!(store.stats().await.unwrap().awaiting_confirmation, 0);

    // The endpoint itself: counts after commit, 400 for a body that is not a confirmation.
    let http = reqwest::Client::new();
    let url = format!("{confirm_base}/confirm");
    let body = serde_json::json!([
        {"message_id": ok[0], "consumer": "x", "outcome": "processed"},
        {"message_id": Uuid::now_v7(), "consumer": "x", "outcome": "processed"}
    ]);
    let resp = http
        .post(&url)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let counts: serde_json::Value = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
    assert_eq!(
        counts,
        serde_json::json!({"confirmed": 0, "rejected": 0, "duplicates": 1, "unknown": 1})
    );
    let resp = http.post(&url).body("not json").send().await.unwrap();
    assert_eq!(resp.status(), 400);

    relay.shutdown().await.unwrap();
    stop_confirm.cancel();
    stop_consumer.cancel();
    (sender, metrics)
}
