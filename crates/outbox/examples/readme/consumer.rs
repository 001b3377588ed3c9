use std::sync::Arc;

use outbox::consumer::ConsumerMetrics;
use outbox::consumer::nats::{NatsConsumerConfig, run};
use outbox::{Handler, HandlerError, InboundMessage, Inbox};
use tokio_util::sync::CancellationToken;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// The inventory service's handler: deducts the ordered quantity, once per message.
pub struct Deduct;

#[async_trait::async_trait]
impl Handler<sqlx::Postgres> for Deduct {
    async fn handle(
        &self,
        conn: &mut sqlx::PgConnection,
        msg: &InboundMessage,
    ) -> Result<(), HandlerError> {
        let order: serde_json::Value = msg.json().map_err(HandlerError::permanent)?;
        sqlx::query("UPDATE stock SET qty = qty - $1 WHERE sku = $2")
            .bind(order["qty"].as_i64())
            .bind(order["sku"].as_str())
            .execute(conn)
            .await
            .map_err(HandlerError::transient)?;
        Ok(())
    }
}

/// Consume the stream `ORDERS` (the relay creates it) as the durable consumer `inventory`,
/// until `cancel`.
pub async fn run_consumer(
    pool: sqlx::PgPool,
    nats_url: &str,
    cancel: CancellationToken,
) -> Result<(), Error> {
    let js = async_nats::jetstream::new(async_nats::connect(nats_url).await?);
    let inbox = Inbox::new(pool, "outbox_inbox", "inventory")?; // dedup per (consumer, message_id)
    inbox.migrate().await?;
    let config = NatsConsumerConfig::new("ORDERS", "inventory");
    let metrics = Arc::new(ConsumerMetrics::default());
    run(js, config, inbox, Arc::new(Deduct), metrics, cancel).await?;
    Ok(())
}
