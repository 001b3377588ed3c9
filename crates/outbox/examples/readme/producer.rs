use outbox::{NewMessage, PgStore};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Place an order: the order row and its message commit in one transaction, or neither does.
pub async fn place_order(store: &PgStore, order_id: i64, sku: &str, qty: i64) -> Result<(), Error> {
    let mut tx = store.begin().await?;
    sqlx::query("INSERT INTO orders (id, sku, qty) VALUES ($1, $2, $3)")
        .bind(order_id)
        .bind(sku)
        .bind(qty)
        .execute(&mut *tx)
        .await?;
    let event = serde_json::json!({"order_id": order_id, "sku": sku, "qty": qty});
    let message =
        NewMessage::json("order-created", &event)?.with_partition_key(format!("order-{order_id}"));
    store.enqueue(&mut tx, message).await?;
    store.commit(tx).await?; // commits, then wakes an embedded relay at once
    Ok(())
}
