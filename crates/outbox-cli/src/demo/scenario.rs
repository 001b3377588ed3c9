//! The order/inventory scenario: the orders the clients place, the inventory service's handler
//! (deduct or refuse) and the order service's compensation for a refused order (cancel it and
//! announce it), and the timeline of when each order committed and took effect.
//!
//! The handler and the hook are written once and compiled for each database
//! (`inventory_handler!`, `cancel_order_hook!`): their SQL is written with `?` placeholders,
//! numbered for PostgreSQL by [`numbered`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use outbox::{
    BoxError, HandlerError, InboundMessage, MySqlStore, NewMessage, PgStore, RejectedMessage,
    RejectionHook, SqliteStore,
};
use rand::Rng;
use serde::{Deserialize, Serialize};
use sqlx::{MySqlConnection, PgConnection, SqliteConnection};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::services::{Services, Tables};
use super::{CANCELLED, CANCELLED_TOPIC, DemoArgs, PLACED, SKUS, TOPIC};

/// One order: order `n` buys `1 + n % 3` of `SKUS[n % 8]`, or, when oversized, one unit more
/// than the stock of a SKU holds at start (so the inventory service always refuses it).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Order {
    /// Order number, from 1.
    pub(super) order_id: i64,
    /// The product bought.
    pub(super) sku: String,
    /// Units bought.
    pub(super) qty: i64,
}

impl Order {
    /// Order `n` of `orders`.
    pub(super) fn number(n: usize, orders: usize, oversized: bool) -> Order {
        Order {
            order_id: n as i64,
            sku: SKUS[n % SKUS.len()].to_owned(),
            qty: if oversized {
                initial_stock(orders) + 1
            } else {
                1 + (n % 3) as i64
            },
        }
    }
}

/// The `order-cancelled` event the rejection hook enqueues.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct OrderCancelled {
    /// The cancelled order.
    order_id: i64,
    /// Why the inventory service refused it.
    reason: String,
}

/// Units of each SKU in stock at start: enough for every regular order (at most 3 units each),
/// never enough for an oversized one.
pub(super) fn initial_stock(orders: usize) -> i64 {
    3 * orders as i64
}

/// Start `--clients` clients placing orders `numbers` between them, each order one local
/// transaction (order row + outbox row), at full speed or, with `rate`, order `k` of the range
/// placed `k / rate` seconds after the start (open loop); `placed` counts the orders committed.
pub(super) fn spawn_clients(
    args: &DemoArgs,
    services: &Services,
    timeline: &Arc<Timeline>,
    placed: &Arc<AtomicUsize>,
    numbers: std::ops::RangeInclusive<usize>,
    rate: Option<f64>,
) -> JoinSet<anyhow::Result<()>> {
    let first = *numbers.start();
    let last = *numbers.end();
    let next_order = Arc::new(AtomicUsize::new(first));
    let start = Instant::now();
    let mut clients = JoinSet::new();
    for _ in 0..args.clients {
        let services = services.clone();
        let (placed, next_order, timeline) = (placed.clone(), next_order.clone(), timeline.clone());
        let (orders, oversized) = (args.total_orders(), args.oversized);
        clients.spawn(async move {
            loop {
                let n = next_order.fetch_add(1, Ordering::Relaxed);
                if n > last {
                    return anyhow::Ok(());
                }
                if let Some(rate) = rate {
                    let due = start + Duration::from_secs_f64((n - first) as f64 / rate);
                    tokio::time::sleep_until(due).await;
                }
                let too_big = rand::rng().random_bool(oversized);
                let order = Order::number(n, orders, too_big);
                services.place_order(&order).await?;
                timeline.committed(order.order_id);
                placed.fetch_add(1, Ordering::Relaxed);
            }
        });
    }
    clients
}

/// `sql` with its `?` placeholders numbered (`$1`, `$2`, …), as PostgreSQL wants them. The demo's
/// statements have no `?` anywhere else.
pub(super) fn numbered(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len() + 8);
    let mut n = 0;
    for c in sql.chars() {
        if c == '?' {
            n += 1;
            out.push_str(&format!("${n}"));
        } else {
            out.push(c);
        }
    }
    out
}

/// The message id as the deduction log stores it on SQLite and MySQL (text).
fn id_text(id: uuid::Uuid) -> String {
    id.to_string()
}

/// The inventory service's message handler, inside the inbox transaction: an `order-created`
/// message deducts stock and logs the deduction, or is refused when the stock cannot cover it
/// (nothing deducted); an `order-cancelled` event is acknowledged without effect.
pub(super) struct InventoryHandler {
    /// The inventory service's tables.
    pub(super) tables: Tables,
    /// Where the handler records when each order took effect.
    pub(super) timeline: Arc<Timeline>,
}

impl InventoryHandler {
    /// The order of an `order-created` message; `None` for the events this service ignores.
    fn order(msg: &InboundMessage) -> Result<Option<Order>, HandlerError> {
        match msg.topic.as_str() {
            TOPIC => msg.json().map(Some).map_err(HandlerError::permanent),
            CANCELLED_TOPIC => Ok(None),
            other => Err(HandlerError::permanent(format!(
                "unexpected topic {other:?}"
            ))),
        }
    }

    /// The refusal of an order the stock cannot cover.
    fn insufficient(order: &Order, in_stock: Option<i64>) -> HandlerError {
        HandlerError::reject(format!(
            "insufficient stock: order {} wants {} {}, {} in stock",
            order.order_id,
            order.qty,
            order.sku,
            in_stock.map_or_else(|| "none".to_owned(), |n| n.to_string())
        ))
    }
}

/// [`InventoryHandler`] for one database: `$db` with its connection type `$conn`, `$sql` turning
/// `?` placeholders into its syntax and `$message_id` the message id into the deduction log's
/// column type.
macro_rules! inventory_handler {
    ($db:ty, $conn:ty, $sql:expr, $message_id:expr) => {
        #[async_trait]
        impl outbox::Handler<$db> for InventoryHandler {
            async fn handle(
                &self,
                conn: &mut $conn,
                msg: &InboundMessage,
            ) -> Result<(), HandlerError> {
                let Some(order) = Self::order(msg)? else {
                    return Ok(());
                };
                let t = self.tables;
                let deducted = sqlx::query(sqlx::AssertSqlSafe($sql(&format!(
                    "UPDATE {} SET qty = qty - ? WHERE sku = ? AND qty >= ?",
                    t.stock
                ))))
                .bind(order.qty)
                .bind(&order.sku)
                .bind(order.qty)
                .execute(&mut *conn)
                .await
                .map_err(HandlerError::transient)?
                .rows_affected();
                if deducted == 0 {
                    let in_stock: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe($sql(
                        &format!("SELECT qty FROM {} WHERE sku = ?", t.stock),
                    )))
                    .bind(&order.sku)
                    .fetch_optional(&mut *conn)
                    .await
                    .map_err(HandlerError::transient)?;
                    return Err(Self::insufficient(&order, in_stock));
                }
                sqlx::query(sqlx::AssertSqlSafe($sql(&format!(
                    "INSERT INTO {} (order_id, sku, qty, message_id) VALUES (?, ?, ?, ?)",
                    t.deductions
                ))))
                .bind(order.order_id)
                .bind(&order.sku)
                .bind(order.qty)
                .bind($message_id(msg.message_id))
                .execute(&mut *conn)
                .await
                .map_err(HandlerError::transient)?;
                self.timeline.applied(order.order_id);
                Ok(())
            }
        }
    };
}

inventory_handler!(sqlx::Sqlite, SqliteConnection, str::to_owned, id_text);
inventory_handler!(
    sqlx::Postgres,
    PgConnection,
    numbered,
    std::convert::identity
);
inventory_handler!(sqlx::MySql, MySqlConnection, str::to_owned, id_text);

/// The order service's compensation for a refused order, run by the store inside the producer
/// transaction that records REJECTED: the order becomes CANCELLED and an `order-cancelled`
/// event is enqueued through the outbox, all committed together (or not at all).
pub(super) struct CancelOrder<S> {
    /// The orders table.
    pub(super) orders: &'static str,
    /// The outbox to enqueue the event into (a store without a hook: enqueue needs the table).
    pub(super) outbox: S,
}

impl<S> CancelOrder<S> {
    /// The refused order and its `order-cancelled` event; `None` for other topics.
    fn event(rejected: &RejectedMessage) -> Result<Option<(i64, NewMessage)>, BoxError> {
        if rejected.topic != TOPIC {
            return Ok(None);
        }
        let order: Order = serde_json::from_slice(&rejected.payload)?;
        let event = OrderCancelled {
            order_id: order.order_id,
            reason: rejected.reason.clone(),
        };
        let message = NewMessage::json(CANCELLED_TOPIC, &event)?
            .with_partition_key(order.order_id.to_string());
        Ok(Some((order.order_id, message)))
    }

    /// `Ok` when the update cancelled the order (it was still PLACED).
    fn check_cancelled(order_id: i64, rows: u64) -> Result<(), BoxError> {
        if rows == 1 {
            Ok(())
        } else {
            Err(format!("order {order_id} is not {PLACED}; refusing to cancel it").into())
        }
    }
}

/// [`CancelOrder`] for one database: `$db` with its connection type `$conn` and store `$store`,
/// `$sql` turning `?` placeholders into its syntax.
macro_rules! cancel_order_hook {
    ($db:ty, $conn:ty, $store:ty, $sql:expr) => {
        #[async_trait]
        impl RejectionHook<$db> for CancelOrder<$store> {
            async fn on_rejected(
                &self,
                conn: &mut $conn,
                rejected: &RejectedMessage,
            ) -> Result<(), BoxError> {
                let Some((order_id, event)) = Self::event(rejected)? else {
                    return Ok(());
                };
                let rows = sqlx::query(sqlx::AssertSqlSafe($sql(&format!(
                    "UPDATE {} SET status = '{CANCELLED}' WHERE id = ? AND status = '{PLACED}'",
                    self.orders
                ))))
                .bind(order_id)
                .execute(&mut *conn)
                .await?
                .rows_affected();
                Self::check_cancelled(order_id, rows)?;
                self.outbox.enqueue(conn, event).await?;
                Ok(())
            }
        }
    };
}

cancel_order_hook!(sqlx::Sqlite, SqliteConnection, SqliteStore, str::to_owned);
cancel_order_hook!(sqlx::Postgres, PgConnection, PgStore, numbered);
cancel_order_hook!(sqlx::MySql, MySqlConnection, MySqlStore, str::to_owned);

/// When each order committed (client side) and took effect (handler side), in microseconds
/// since the start plus one (zero: not yet).
pub(super) struct Timeline {
    start: Instant,
    committed: Vec<AtomicU64>,
    applied: Vec<AtomicU64>,
}

impl Timeline {
    /// A timeline of `orders` orders, starting now.
    pub(super) fn new(orders: usize) -> Timeline {
        Timeline {
            start: Instant::now(),
            committed: (0..orders).map(|_| AtomicU64::new(0)).collect(),
            applied: (0..orders).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Microseconds since the start, plus one.
    fn now(&self) -> u64 {
        self.start.elapsed().as_micros() as u64 + 1
    }

    /// The slot of `order_id` (numbered from 1), if in range.
    fn slot(slots: &[AtomicU64], order_id: i64) -> Option<&AtomicU64> {
        usize::try_from(order_id - 1)
            .ok()
            .and_then(|i| slots.get(i))
    }

    /// Record the order's commit.
    pub(super) fn committed(&self, order_id: i64) {
        if let Some(s) = Self::slot(&self.committed, order_id) {
            s.store(self.now(), Ordering::Relaxed);
        }
    }

    /// Record the effect; a handler run whose transaction rolled back is overwritten by the
    /// run that commits, which comes later.
    pub(super) fn applied(&self, order_id: i64) {
        if let Some(s) = Self::slot(&self.applied, order_id) {
            s.store(self.now(), Ordering::Relaxed);
        }
    }

    /// Commit-to-effect latencies in microseconds of orders `numbers` (numbered from 1).
    pub(super) fn latencies(
        &self,
        numbers: std::ops::Range<usize>,
    ) -> anyhow::Result<hdrhistogram::Histogram<u64>> {
        let mut h = hdrhistogram::Histogram::<u64>::new(3)?;
        // Order n is slot n - 1.
        let end = numbers.end.saturating_sub(1).min(self.committed.len());
        let start = numbers.start.saturating_sub(1).min(end);
        for (c, a) in self.committed[start..end]
            .iter()
            .zip(&self.applied[start..end])
        {
            let (c, a) = (c.load(Ordering::Relaxed), a.load(Ordering::Relaxed));
            if c > 0 && a > 0 {
                h.record(a.saturating_sub(c).max(1))?;
            }
        }
        Ok(h)
    }
}
