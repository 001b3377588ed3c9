//! The README's examples as one program: `cargo run -p outbox --example readme` with
//! PostgreSQL and NATS JetStream at the URLs of `DATABASE_URL` and `NATS_URL` (defaults
//! `postgres://postgres@127.0.0.1:5432/test` and `nats://127.0.0.1:4222`).

mod consumer;
mod producer;
mod relay;

use outbox::{PgStore, StoreOptions};
use tokio_util::sync::CancellationToken;

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let env = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.to_owned());
    let database_url = env("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let nats_url = env("NATS_URL", "nats://127.0.0.1:4222");
    let store = PgStore::connect(&database_url, StoreOptions::default()).await?;
    // The application's own tables (the order service's and the inventory service's).
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS orders (id bigint PRIMARY KEY, sku text NOT NULL, qty bigint NOT NULL);
         CREATE TABLE IF NOT EXISTS stock (sku text PRIMARY KEY, qty bigint NOT NULL);
         INSERT INTO stock (sku, qty) VALUES ('apple', 100) ON CONFLICT DO NOTHING",
    )
    .execute(store.pool())
    .await?;

    let relay = relay::start_relay(store.clone(), &nats_url).await?;
    let cancel = CancellationToken::new();
    let consumer = {
        let (pool, url, cancel) = (store.pool().clone(), nats_url.clone(), cancel.clone());
        tokio::spawn(async move { consumer::run_consumer(pool, &url, cancel).await })
    };
    let order_id = i64::from(std::process::id());
    producer::place_order(&store, order_id, "apple", 3).await?;

    // Wait until the inventory service applied the order.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let applied: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM outbox_inbox i JOIN outbox o ON o.message_id = i.message_id \
             WHERE i.consumer = 'inventory' AND o.partition_key = $1",
        )
        .bind(format!("order-{order_id}"))
        .fetch_one(store.pool())
        .await?;
        if applied == 1 {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            return Err("the order was not applied within 30 s".into());
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    println!("order {order_id} placed, published and applied once");
    cancel.cancel();
    consumer.await??;
    relay.shutdown().await?;
    Ok(())
}
