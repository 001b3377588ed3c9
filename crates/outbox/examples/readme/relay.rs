use std::sync::Arc;

use outbox::{
    DeadLetterPolicy, NatsConfig, NatsTransport, PgStore, Relay, RelayHandle, Router, Store,
    StreamSetup,
};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Start the relay inside the application. It publishes every committed `order-*` message to
/// the subject `orders.<topic>`, captured by the JetStream stream `ORDERS` (created here when
/// missing), per order in commit order.
pub async fn start_relay(store: PgStore, nats_url: &str) -> Result<RelayHandle, Error> {
    store.migrate().await?; // or `outbox migrate --database URL`
    let mut nats = NatsConfig::new(nats_url);
    nats.stream = Some(StreamSetup {
        name: "ORDERS".into(),
        subjects: vec!["orders.>".into()],
        create: true,
        replicas: 1, // 3 on a JetStream cluster
    });
    let nats = Arc::new(NatsTransport::connect(nats).await?);
    let relay = Relay::builder(Arc::new(store))
        .router(
            Router::new()
                // Per partition key, in commit order; a dead letter lets the key go on.
                .route("order-*", nats, "orders.{topic}")
                .ordered(DeadLetterPolicy::Skip),
        )
        .build()?;
    // On shutdown: `handle.shutdown().await` stops reading, finishes the batches in flight
    // and gives the buckets back.
    Ok(relay.spawn())
}
