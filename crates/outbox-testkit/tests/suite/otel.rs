//! OpenTelemetry traces across the outbox (issue 14 item 2, `outbox::otel`): PostgreSQL → relay →
//! broker (NATS JetStream, RabbitMQ) → inbox consumer runner → confirmation → producer, every
//! part the code production runs, with `tracing-opentelemetry` and an in-memory exporter in place
//! of OTLP.
//!
//! One request enqueues three messages: one processed, one rejected by the consumer (the
//! producer's rejection hook compensates) and one whose first delivery fails transiently. The
//! processed and rejected messages end in one trace: request → `outbox.publish` →
//! `outbox.consume` → `outbox.confirmation` (→ `outbox.rejection_hook`). The failed first
//! delivery is in that trace too; its redelivery starts a trace of its own, linked to the publish
//! span. A message whose caller set `traceparent` keeps it.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use opentelemetry::trace::{SpanId, SpanKind, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use outbox::confirm::nats::NatsConfirmationSender;
use outbox::confirm::rabbitmq::RabbitMqConfirmationSender;
use outbox::store::Store as _;
use outbox::{NewMessage, Status};
use outbox_testkit::{
    ConfirmFixture as _, StoreFixture as _, rabbitmq_config, rabbitmq_url, wait_until,
};
use tracing::Instrument;
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt;
use uuid::Uuid;

use crate::broker_support::Running;
use crate::confirm::{NatsSetup, PgProducer, ScriptedHandler, wait_status};
use crate::rabbitmq_consumer::RabbitSetup;

/// The broker of a run: its producer (relay, inbox, confirmation listener) and how its consumer
/// runner is started, with confirmations sent back over the same broker.
enum Broker {
    Nats(Box<NatsSetup>),
    Rabbit(Box<RabbitSetup>),
}

impl Broker {
    fn producer(&self) -> &PgProducer {
        match self {
            Broker::Nats(s) => s,
            Broker::Rabbit(s) => s,
        }
    }

    async fn spawn_consumer(&self, handler: Arc<ScriptedHandler>) -> Running {
        match self {
            Broker::Nats(s) => {
                let client = outbox_testkit::nats_client().await;
                let sender = Arc::new(NatsConfirmationSender::new(client));
                s.spawn_consumer(s.consumer_config(sender), handler)
            }
            Broker::Rabbit(s) => {
                let sender = Arc::new(
                    RabbitMqConfirmationSender::new(rabbitmq_config(&rabbitmq_url())).unwrap(),
                );
                let config = crate::rabbitmq::consumer_config(&s.broker).with_confirmations(sender);
                Running::spawn(config, &s.inbox, handler)
            }
        }
    }

    async fn finish(self) {
        match self {
            Broker::Nats(s) => s.finish().await,
            Broker::Rabbit(s) => s.finish().await,
        }
    }
}

/// The finished spans named `name` whose `messaging.message.id` is `id`.
fn spans_of<'a>(spans: &'a [SpanData], name: &str, id: Uuid) -> Vec<&'a SpanData> {
    let id = id.to_string();
    spans
        .iter()
        .filter(|s| s.name == name)
        .filter(|s| {
            s.attributes
                .iter()
                .any(|kv| kv.key.as_str() == "messaging.message.id" && kv.value.as_str() == id)
        })
        .collect()
}

/// The one span named `name` of message `id` (panics naming what was found otherwise).
fn one<'a>(spans: &'a [SpanData], name: &str, id: Uuid) -> &'a SpanData {
    let found = spans_of(spans, name, id);
    assert_eq!(found.len(), 1, "one {name} span for {id}: {found:#?}");
    found[0]
}

fn attr(s: &SpanData, key: &str) -> Option<String> {
    s.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.as_str().into_owned())
}

fn child_of(s: &SpanData, parent: &SpanData) {
    assert_eq!(
        s.span_context.trace_id(),
        parent.span_context.trace_id(),
        "{} is in the trace of {}",
        s.name,
        parent.name
    );
    assert_eq!(
        s.parent_span_id,
        parent.span_context.span_id(),
        "{} is the child of {}",
        s.name,
        parent.name
    );
}

/// The stored headers of message `id`, as JSON text.
async fn stored_headers(s: &PgProducer, id: Uuid) -> String {
    let sql = format!(
        "SELECT headers::text FROM {} WHERE message_id = $1",
        s.fx.store.table()
    );
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .bind(id)
        .fetch_one(s.fx.store.pool())
        .await
        .unwrap()
}

/// NATS JetStream: the whole path in one trace; redeliveries linked; a caller's `traceparent`
/// kept; nothing written for a message enqueued outside any span.
#[tokio::test(flavor = "current_thread")]
async fn one_trace_from_the_request_to_the_consumer_and_back() {
    one_trace(|| async { Broker::Nats(Box::new(NatsSetup::new().await)) }).await;
}

/// The same over RabbitMQ (headers carried as AMQP message headers).
#[tokio::test(flavor = "current_thread")]
async fn rabbitmq_one_trace_from_the_request_to_the_consumer_and_back() {
    one_trace(|| async { Broker::Rabbit(Box::new(RabbitSetup::new().await)) }).await;
}

async fn one_trace<F, Fut>(setup: F)
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = Broker>,
{
    // The test's own subscriber, for this thread: a current-thread runtime runs the relay, the
    // consumer runner and the confirmation listener on it.
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let targets = tracing_subscriber::filter::Targets::new()
        .with_target("outbox", tracing::Level::TRACE)
        .with_target("suite", tracing::Level::TRACE);
    let subscriber = tracing_subscriber::registry().with(
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("outbox-test"))
            .with_filter(targets),
    );
    let _guard = tracing::subscriber::set_default(subscriber);

    let broker = setup().await;
    let s = broker.producer();
    let handler = ScriptedHandler::new(&s.effects);
    let consumer = broker.spawn_consumer(handler.clone()).await;
    let metrics = consumer.metrics.clone();

    let ok = NewMessage::new("orders", "ok-1");
    let rejected = NewMessage::new("orders", "reject-1");
    let flaky = NewMessage::new("orders", "flaky-1");
    let caller_parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let own = NewMessage::new("orders", "ok-own").with_header("traceparent", caller_parent);
    let request = tracing::info_span!("http.request", http.route = "/orders");
    let ids =
        s.fx.enqueue_commit(vec![ok, rejected, flaky, own])
            .instrument(request.clone())
            .await
            .unwrap();
    let untraced =
        s.fx.commit_one(NewMessage::new("orders", "ok-untraced"))
            .await;
    drop(request);
    let (ok, rejected, flaky, own) = (ids[0], ids[1], ids[2], ids[3]);

    // The flaky message's first delivery fails; then the handler is fixed and the redelivery
    // applies it.
    wait_until(
        "the flaky message's first failure",
        Duration::from_secs(15),
        || async { metrics.failures.load(Ordering::SeqCst) >= 1 },
    )
    .await;
    handler.fixed.store(true, Ordering::SeqCst);
    wait_status(
        &s.fx,
        &[ok, flaky, own, untraced],
        Status::Confirmed,
        Duration::from_secs(20),
    )
    .await;
    wait_status(
        &s.fx,
        &[rejected],
        Status::Rejected,
        Duration::from_secs(20),
    )
    .await;
    assert_eq!(s.fx.compensations(rejected).await, 1);

    // The rows keep the producer's context; the caller's own is untouched; none without a span.
    let request_trace = |headers: &str| {
        let v: serde_json::Value = serde_json::from_str(headers).unwrap();
        v["traceparent"].as_str().map(str::to_owned)
    };
    let tp = request_trace(&stored_headers(s, ok).await).expect("traceparent stored");
    assert_eq!(tp.len(), 55, "{tp}");
    assert_eq!(
        request_trace(&stored_headers(s, own).await).as_deref(),
        Some(caller_parent)
    );
    assert_eq!(request_trace(&stored_headers(s, untraced).await), None);

    consumer.stop().await;
    broker.finish().await;

    let spans = exporter.get_finished_spans().unwrap();
    let req = spans
        .iter()
        .find(|s| s.name == "http.request")
        .expect("the request span");
    let trace: TraceId = req.span_context.trace_id();
    assert!(
        tp.contains(&format!("{trace}-{}", req.span_context.span_id())),
        "{tp}"
    );

    // Processed: request → publish → consume → confirmation.
    let publish = one(&spans, "outbox.publish", ok);
    child_of(publish, req);
    assert_eq!(publish.span_kind, SpanKind::Producer);
    assert_eq!(attr(publish, "outbox.outcome").as_deref(), Some("sent"));
    let consume = one(&spans, "outbox.consume", ok);
    child_of(consume, publish);
    assert_eq!(consume.span_kind, SpanKind::Consumer);
    assert_eq!(
        attr(consume, "outbox.outcome").as_deref(),
        Some("processed")
    );
    let confirmation = one(&spans, "outbox.confirmation", ok);
    child_of(confirmation, consume);
    assert_eq!(
        attr(confirmation, "outbox.verdict").as_deref(),
        Some("processed")
    );

    // Rejected: the same, and the rejection hook under the confirmation.
    let publish = one(&spans, "outbox.publish", rejected);
    child_of(publish, req);
    let consume = one(&spans, "outbox.consume", rejected);
    child_of(consume, publish);
    assert_eq!(attr(consume, "outbox.outcome").as_deref(), Some("rejected"));
    let confirmation = one(&spans, "outbox.confirmation", rejected);
    child_of(confirmation, consume);
    let hook = one(&spans, "outbox.rejection_hook", rejected);
    child_of(hook, confirmation);

    // Redelivered: the first delivery in the request's trace, the second a root of its own
    // linked to the publish span; its confirmation follows the delivery that applied it.
    let publish = one(&spans, "outbox.publish", flaky);
    child_of(publish, req);
    let deliveries = spans_of(&spans, "outbox.consume", flaky);
    let first = deliveries
        .iter()
        .find(|d| attr(d, "outbox.delivery").as_deref() == Some("1"))
        .expect("first delivery");
    child_of(first, publish);
    assert_eq!(attr(first, "outbox.outcome").as_deref(), Some("retry"));
    let again: Vec<_> = deliveries
        .iter()
        .filter(|d| attr(d, "outbox.delivery").as_deref() != Some("1"))
        .collect();
    assert!(!again.is_empty(), "a redelivery span: {deliveries:#?}");
    for d in &again {
        assert_ne!(
            d.span_context.trace_id(),
            trace,
            "a redelivery starts its own trace"
        );
        assert_eq!(d.parent_span_id, SpanId::INVALID);
        assert!(
            d.links.links.iter().any(|l| l.span_context.span_id()
                == publish.span_context.span_id()
                && l.span_context.trace_id() == trace),
            "a redelivery links to the publish span: {d:#?}"
        );
    }
    let applied = again
        .iter()
        .find(|d| attr(d, "outbox.outcome").as_deref() == Some("processed"))
        .expect("the redelivery that applied it");
    child_of(one(&spans, "outbox.confirmation", flaky), applied);

    // The caller's context is continued as given; the untraced message has no spans.
    let publish = one(&spans, "outbox.publish", own);
    assert_eq!(
        publish.span_context.trace_id().to_string(),
        "0af7651916cd43dd8448eb211c80319c"
    );
    assert_eq!(publish.parent_span_id.to_string(), "b7ad6b7169203331");
    assert!(spans_of(&spans, "outbox.publish", untraced).is_empty());
    assert!(spans_of(&spans, "outbox.consume", untraced).is_empty());
    let _ = provider.shutdown();
}
