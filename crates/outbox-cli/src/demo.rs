//! `outbox demo`: the order → inventory story end to end, with faults injected, through the
//! whole state machine (docs/design/DESIGN.md §4, §9).
//!
//! Two services, each with its own database:
//! - the **order service** writes an order row (status `PLACED`) and an `order-created` outbox
//!   message in one local transaction ([`outbox::SqliteStore`], [`outbox::PgStore`] or
//!   [`outbox::MySqlStore`]), and
//!   serves a confirmation endpoint (an axum route, or a NATS subject it listens on);
//! - the **inventory service** receives the message (webhook or NATS JetStream) and, in one
//!   transaction with its [`outbox::Inbox`] row, deducts stock and appends to a deduction log, or
//!   refuses an order that asks for more than the stock holds
//!   ([`HandlerError::reject`]: nothing is deducted); it then confirms its verdict to the order
//!   service.
//!
//! The `order-created` route requires confirmation: a `processed` verdict moves the outbox row
//! SENT → CONFIRMED; a `rejected` one moves it to REJECTED and runs the order service's
//! rejection hook in the same producer transaction, which cancels the order and enqueues an
//! `order-cancelled` event through the outbox. A confirmation that is lost is recovered by the
//! relay's check-back: the message is published again, the inbox recognises the copy and sends
//! the recorded verdict again.
//!
//! Between them an embedded [`outbox::Relay`] publishes through a fault-injecting transport
//! (deliveries lost before the consumer, acknowledgements lost after it committed, duplicated
//! deliveries) and is killed and restarted without cleanup a few times; the consumer's
//! confirmations are dropped at a configurable rate. At the end the demo checks that every order
//! ended either deducted once and CONFIRMED or CANCELLED with nothing deducted, and prints a
//! report; a broken promise is an error (non-zero exit).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use async_trait::async_trait;
use base64::Engine;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use outbox::confirm::nats::NatsConfirmationSender;
use outbox::confirm::webhook::WebhookConfirmationSender;
use outbox::consumer::nats::NatsConsumerConfig;
use outbox::consumer::{ConsumerMetrics, DeliveryPolicy};
use outbox::{
    Backoff, BoxError, ConfirmPolicy, Confirmation, ConfirmationSender, HandlerError,
    InboundMessage, Inbox, InboxBackend, MySqlStore, NatsConfig, NatsTransport, NewMessage,
    Outgoing, PgStore, RejectedMessage, RejectionHook, Relay, RelayConfig, RelayHandle,
    RelayMetrics, Router, SqliteStore, Status, Store, StoreOptions, Transport, TransportError,
    WebhookConfig, WebhookTransport,
};
#[cfg(feature = "kafka")]
use outbox::{KafkaConfig, KafkaTransport, confirm::kafka::KafkaConfirmationSender};
use rand::Rng;
use serde::{Deserialize, Serialize};
use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{ConnectOptions, MySqlConnection, PgConnection, SqliteConnection};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Topic of the message the order service publishes for each order (confirmation required).
const TOPIC: &str = "order-created";
/// Topic of the event the rejection hook enqueues when the inventory service refused an order.
const CANCELLED_TOPIC: &str = "order-cancelled";
/// Order status at placement.
const PLACED: &str = "PLACED";
/// Order status after the inventory service refused the order.
const CANCELLED: &str = "CANCELLED";
/// Path of the order service's confirmation endpoint (webhook variant).
const CONFIRM_PATH: &str = "/confirmations";
/// Subject the order service listens on for confirmations (NATS variant); outside the stream.
const CONFIRM_SUBJECT: &str = "demo.confirmations";
/// Queue group of the order service's confirmation listeners.
const CONFIRM_QUEUE: &str = "demo-order-service";
/// Products on sale; order `n` buys `SKUS[n % SKUS.len()]`.
const SKUS: [&str; 8] = [
    "apple",
    "banana",
    "cherry",
    "date",
    "elderberry",
    "fig",
    "grape",
    "kiwi",
];
/// JetStream stream of the NATS variant (deleted and recreated at start).
const NATS_STREAM: &str = "DEMO_ORDERS";
/// Subjects the stream captures; the route publishes to `demo.orders.<topic>`.
const NATS_SUBJECTS: &str = "demo.orders.>";
/// Topic exchange of the RabbitMQ variant; the route publishes to `demo.orders/<topic>`.
#[cfg(feature = "rabbitmq")]
const RABBIT_EXCHANGE: &str = "demo.orders";
/// Queue of the inventory service in the RabbitMQ variant (bound to the exchange with `#`;
/// deleted and recreated at start).
#[cfg(feature = "rabbitmq")]
const RABBIT_QUEUE: &str = "demo.inventory";
/// Queue the order service consumes confirmations from in the RabbitMQ variant.
#[cfg(feature = "rabbitmq")]
const RABBIT_CONFIRM_QUEUE: &str = "demo.confirmations";
/// Partitions of the Kafka variant's order topics.
#[cfg(feature = "kafka")]
const KAFKA_PARTITIONS: i32 = 4;
/// Consumer name of the inventory service, in the inbox and as the JetStream durable.
const CONSUMER: &str = "inventory";
/// How often the monitor refreshes the progress bars and checks for the drain.
const TICK: Duration = Duration::from_millis(100);

/// Options of `outbox demo`.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Orders to place.
    #[arg(long, default_value_t = 10_000)]
    pub orders: usize,

    /// Concurrent clients placing orders.
    #[arg(long, default_value_t = 16)]
    pub clients: usize,

    /// Directory of the two SQLite databases (orders.db, inventory.db); the demo's files in it
    /// are deleted at start.
    #[arg(long, default_value = "./demo-data")]
    pub data_dir: PathBuf,

    /// Run both services on this PostgreSQL (`postgres://user@host:port/db`) or MySQL/MariaDB
    /// (`mysql://user@host:3306/db`) database instead of SQLite files; the demo_* tables are
    /// dropped and recreated at start.
    #[arg(long, value_name = "URL")]
    pub database: Option<String>,

    /// Deliver over NATS JetStream (`nats://host:port`; the DEMO_ORDERS stream is deleted and
    /// recreated at start), Redis Streams (`redis://host:port`; the demo:orders and
    /// demo:confirmations streams are reset), MQTT 5 (`mqtt://host:port`), RabbitMQ
    /// (`amqp://user:password@host:5672/%2f`; the demo.inventory and demo.confirmations queues are
    /// deleted and recreated at start), Kafka (`kafka://host:port`; fresh `demo-<run>.*` topics are
    /// created at start) or RocketMQ (`rocketmq://host:port`, with the `rocketmq` cargo feature:
    /// fresh topics per run) instead of webhooks.
    #[arg(long, value_name = "URL")]
    pub transport: Option<String>,

    /// Fraction of deliveries lost before they reach the consumer.
    #[arg(long, default_value_t = 0.10, value_parser = parse_fraction)]
    pub loss_before: f64,

    /// Fraction of acknowledgements lost after the consumer committed.
    #[arg(long, default_value_t = 0.10, value_parser = parse_fraction)]
    pub loss_after: f64,

    /// Fraction of deliveries sent twice.
    #[arg(long, default_value_t = 0.05, value_parser = parse_fraction)]
    pub duplicate: f64,

    /// Times the relay is killed (aborted without cleanup) and restarted during the run.
    #[arg(long, default_value_t = 3)]
    pub kills: usize,

    /// Fraction of orders asking for more than the stock holds; the inventory service rejects
    /// them and the order service cancels them.
    #[arg(long, default_value_t = 0.10, value_parser = parse_fraction)]
    pub oversized: f64,

    /// Fraction of the consumer's confirmations dropped on the way to the order service; the
    /// relay's check-back recovers them.
    #[arg(long, default_value_t = 0.10, value_parser = parse_fraction)]
    pub lost_confirmations: f64,

    /// How long the order service waits for a confirmation before checking the message back.
    #[arg(long, default_value = "4s", value_parser = humantime::parse_duration)]
    pub confirm_timeout: Duration,

    /// Check-backs of an unconfirmed message before it is dead-lettered as unconfirmed.
    #[arg(long, default_value_t = 5)]
    pub max_check_backs: u32,

    /// Longest time to wait for every order to take effect before giving up.
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
}

fn parse_fraction(s: &str) -> Result<f64, String> {
    let f: f64 = s
        .parse()
        .map_err(|e| format!("{s:?} is not a number: {e}"))?;
    if (0.0..1.0).contains(&f) {
        Ok(f)
    } else {
        Err(format!("{f} is not a fraction in [0, 1)"))
    }
}

/// Run the demo; an invariant failure is an error (non-zero exit).
pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    ensure!(args.orders > 0, "--orders must be at least 1");
    ensure!(args.clients > 0, "--clients must be at least 1");
    ensure!(
        !args.confirm_timeout.is_zero(),
        "--confirm-timeout must be greater than zero"
    );
    let started = Instant::now();
    let services = Services::open(&args).await?;
    let delivery = Delivery::open(args.transport.as_deref()).await?;
    println!(
        "outbox demo: {} orders from {} clients; order and inventory services on {}, delivery over {}",
        args.orders,
        args.clients,
        services.describe(&args),
        delivery.describe()
    );
    println!(
        "faults: {:.0}% of deliveries lost before the consumer, {:.0}% of acknowledgements lost, \
         {:.0}% duplicated, {:.0}% of confirmations lost; relay killed {} times",
        args.loss_before * 100.0,
        args.loss_after * 100.0,
        args.duplicate * 100.0,
        args.lost_confirmations * 100.0,
        args.kills
    );
    println!(
        "business: {:.0}% of orders ask for more than the stock holds (rejected, then cancelled); \
         confirmations due within {}, checked back up to {} times",
        args.oversized * 100.0,
        humantime::format_duration(args.confirm_timeout),
        args.max_check_backs
    );

    let timeline = Arc::new(Timeline::new(args.orders));
    let consumer_metrics = Arc::new(ConsumerMetrics::default());
    let fault_stats = Arc::new(FaultStats::default());
    let cancel = CancellationToken::new();

    // The order service's confirmation endpoint, then the inventory service, which confirms to it.
    let (reply_to, listener) = delivery
        .start_confirmation_listener(services.store(), &cancel)
        .await?;
    let confirmations: Arc<dyn ConfirmationSender> = Arc::new(LossyConfirmations {
        inner: delivery.confirmation_sender(),
        rate: args.lost_confirmations,
        stats: fault_stats.clone(),
    });
    let handler = Arc::new(InventoryHandler {
        tables: services.tables(),
        timeline: timeline.clone(),
    });
    let (endpoint, mut tasks) = match &services {
        Services::Sqlite { inbox, .. } => {
            delivery
                .start_consumer(
                    inbox.clone(),
                    handler,
                    confirmations,
                    consumer_metrics.clone(),
                    &cancel,
                )
                .await?
        }
        Services::Postgres { inbox, .. } => {
            delivery
                .start_consumer(
                    inbox.clone(),
                    handler,
                    confirmations,
                    consumer_metrics.clone(),
                    &cancel,
                )
                .await?
        }
        Services::MySql { inbox, .. } => {
            delivery
                .start_consumer(
                    inbox.clone(),
                    handler,
                    confirmations,
                    consumer_metrics.clone(),
                    &cancel,
                )
                .await?
        }
    };
    tasks.push(listener);

    let faults = Faults {
        loss_before: args.loss_before,
        loss_after: args.loss_after,
        duplicate: args.duplicate,
    };
    let mut confirm = ConfirmPolicy::new(reply_to);
    confirm.timeout = args.confirm_timeout;
    let mut relays = RelaySupervisor {
        store: services.store(),
        delivery: &delivery,
        endpoint: &endpoint,
        faults,
        fault_stats: fault_stats.clone(),
        confirm,
        max_check_backs: args.max_check_backs,
        current: None,
        metrics: Vec::new(),
    };
    relays.start().await?;

    // The clients: each order is one local transaction (order row + outbox row).
    let placed = Arc::new(AtomicUsize::new(0));
    let next_order = Arc::new(AtomicUsize::new(1));
    let mut clients = JoinSet::new();
    for _ in 0..args.clients {
        let services = services.clone();
        let (placed, next_order, timeline) = (placed.clone(), next_order.clone(), timeline.clone());
        let (orders, oversized) = (args.orders, args.oversized);
        clients.spawn(async move {
            loop {
                let n = next_order.fetch_add(1, Ordering::Relaxed);
                if n > orders {
                    return anyhow::Ok(());
                }
                let too_big = rand::rng().random_bool(oversized);
                let order = Order::number(n, orders, too_big);
                services.place_order(&order).await?;
                timeline.committed(order.order_id);
                placed.fetch_add(1, Ordering::Relaxed);
            }
        });
    }

    // Monitor: progress bars, scheduled relay kills, and the drain check.
    let bars = Bars::new(args.orders);
    let deadline = started + args.timeout;
    let mut tick = tokio::time::interval(TICK);
    let mut kills_done = 0;
    let drained = loop {
        tick.tick().await;
        while let Some(joined) = clients.try_join_next() {
            joined
                .context("an order client panicked")?
                .context("placing an order failed")?;
        }
        let placed_now = placed.load(Ordering::Relaxed);
        // Effects are counted in the inventory database: a delivery whose HTTP exchange was cut
        // by a relay kill may have committed without the receiver counting it.
        let applied = services.orders_with_deduction().await?;
        let refused = consumer_metrics.rejected.load(Ordering::Relaxed);
        let stats = services.store().stats().await?;
        let count = |s| stats.counts.get(&s).copied().unwrap_or(0);
        let verdicts = count(Status::Confirmed) + count(Status::Rejected);
        bars.update(
            placed_now,
            applied + refused,
            verdicts,
            kills_done,
            args.kills,
        );
        // Kill k of n when (k / (n + 1)) of the orders have been processed by the consumer.
        if kills_done < args.kills
            && (applied + refused) as usize >= args.orders * (kills_done + 1) / (args.kills + 1)
        {
            relays.kill_and_restart().await?;
            kills_done += 1;
        }
        // Drained: every order placed, nothing left to publish (orders and cancellations), and no
        // order-created message still waiting for its consumer's verdict.
        if placed_now == args.orders
            && clients.is_empty()
            && count(Status::Pending) == 0
            && count(Status::Sending) == 0
            && stats.awaiting_confirmation == 0
            && verdicts >= args.orders as u64
        {
            break true;
        }
        if Instant::now() >= deadline {
            break false;
        }
    };
    bars.finish();
    let elapsed = started.elapsed();

    relays.shutdown().await?;
    cancel.cancel();
    for t in tasks {
        t.await.context("service task panicked")??;
    }

    let report = Report::gather(
        &services,
        &timeline,
        &consumer_metrics,
        &fault_stats,
        &relays.metrics,
        kills_done,
        elapsed,
    )
    .await?;
    report.print(&delivery);
    if !drained {
        bail!(
            "the run did not drain within {}",
            humantime::format_duration(args.timeout)
        );
    }
    report.verdict()
}

/// One order: order `n` buys `1 + n % 3` of `SKUS[n % 8]`, or, when oversized, one unit more
/// than the stock of a SKU holds at start (so the inventory service always refuses it).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Order {
    order_id: i64,
    sku: String,
    qty: i64,
}

impl Order {
    fn number(n: usize, orders: usize, oversized: bool) -> Order {
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
struct OrderCancelled {
    order_id: i64,
    reason: String,
}

/// Units of each SKU in stock at start: enough for every regular order (at most 3 units each),
/// never enough for an oversized one.
fn initial_stock(orders: usize) -> i64 {
    3 * orders as i64
}

/// Table names of both services.
#[derive(Debug, Clone, Copy)]
struct Tables {
    orders: &'static str,
    outbox: &'static str,
    stock: &'static str,
    inbox: &'static str,
    deductions: &'static str,
}

/// SQLite: each service has its own file, so plain names.
const SQLITE_TABLES: Tables = Tables {
    orders: "orders",
    outbox: "outbox",
    stock: "stock",
    inbox: "inbox",
    deductions: "deductions",
};

/// PostgreSQL: both services share the database, so distinct prefixed names.
const PG_TABLES: Tables = Tables {
    orders: "demo_orders",
    outbox: "demo_outbox",
    stock: "demo_stock",
    inbox: "demo_inbox",
    deductions: "demo_deductions",
};

/// The two services' databases.
#[derive(Clone)]
enum Services {
    Sqlite {
        store: SqliteStore,
        inventory: SqlitePool,
        inbox: Inbox<sqlx::Sqlite>,
    },
    Postgres {
        store: PgStore,
        inventory: PgPool,
        inbox: Inbox<sqlx::Postgres>,
    },
    MySql {
        store: MySqlStore,
        inventory: MySqlPool,
        inbox: Inbox<sqlx::MySql>,
    },
}

impl Services {
    /// Create fresh databases for both services.
    async fn open(args: &DemoArgs) -> anyhow::Result<Services> {
        match &args.database {
            None => Services::open_sqlite(&args.data_dir, args.orders).await,
            Some(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
                Services::open_postgres(url, args.orders).await
            }
            Some(url) if url.starts_with("mysql://") || url.starts_with("mariadb://") => {
                Services::open_mysql(&url.replacen("mariadb://", "mysql://", 1), args.orders).await
            }
            Some(url) => bail!("--database must be a postgres:// or mysql:// URL, not {url:?}"),
        }
    }

    async fn open_sqlite(dir: &Path, orders: usize) -> anyhow::Result<Services> {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        for db in ["orders.db", "inventory.db"] {
            for suffix in ["", "-wal", "-shm"] {
                let file = dir.join(format!("{db}{suffix}"));
                match std::fs::remove_file(&file) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(e).context(format!("cannot delete {}", file.display())),
                }
            }
        }
        let t = SQLITE_TABLES;
        let store = SqliteStore::from_pool(
            sqlite_pool(&dir.join("orders.db"))
                .await
                .context("cannot open the order database")?,
            StoreOptions::table(t.outbox),
        )?;
        store.migrate().await?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {} (id INTEGER PRIMARY KEY, sku TEXT NOT NULL, qty INTEGER NOT NULL, \
             status TEXT NOT NULL DEFAULT '{PLACED}', \
             created_at INTEGER NOT NULL DEFAULT (CAST(ROUND((julianday('now') - 2440587.5) * 86400000) AS INTEGER)))",
            t.orders
        )))
        .execute(store.pool())
        .await?;
        // The compensation enqueues through a store without a hook of its own (enqueue needs
        // only the table); the store the relay and the confirmation listener use runs it.
        let store = store.clone().with_rejection_hook(Arc::new(CancelOrder {
            orders: t.orders,
            outbox: store,
        }));

        let inventory = sqlite_pool(&dir.join("inventory.db"))
            .await
            .context("cannot open the inventory database")?;
        let inbox = Inbox::new(inventory.clone(), t.inbox, CONSUMER)?;
        inbox.migrate().await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {stock} (sku TEXT PRIMARY KEY, qty INTEGER NOT NULL);
             CREATE TABLE {log} (id INTEGER PRIMARY KEY AUTOINCREMENT, order_id INTEGER NOT NULL,
                 sku TEXT NOT NULL, qty INTEGER NOT NULL, message_id TEXT NOT NULL);
             CREATE INDEX {log}_order_id ON {log} (order_id);",
            stock = t.stock,
            log = t.deductions
        )))
        .execute(&inventory)
        .await?;
        for sku in SKUS {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {} (sku, qty) VALUES (?1, ?2)",
                t.stock
            )))
            .bind(sku)
            .bind(initial_stock(orders))
            .execute(&inventory)
            .await?;
        }
        Ok(Services::Sqlite {
            store,
            inventory,
            inbox,
        })
    }

    async fn open_postgres(url: &str, orders: usize) -> anyhow::Result<Services> {
        let t = PG_TABLES;
        let outbox_options = StoreOptions::table(t.outbox);
        let store = PgStore::from_pool(
            pg_pool(url)
                .await
                .context("cannot connect to PostgreSQL for the order service")?,
            outbox_options.clone(),
        )?;
        let inventory = pg_pool(url)
            .await
            .context("cannot connect to PostgreSQL for the inventory service")?;

        // Start from scratch: drop the demo tables (with the inboxes' dead-letter tables) and
        // forget their migrations.
        let ours = [
            t.orders,
            t.outbox,
            outbox_options.inbox_table.as_str(),
            t.stock,
            t.inbox,
            t.deductions,
        ];
        let dead_letters = [
            format!("{}_dlq", outbox_options.inbox_table),
            format!("{}_dlq", t.inbox),
        ];
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP TABLE IF EXISTS {}, {} CASCADE",
            ours.join(", "),
            dead_letters.join(", ")
        )))
        .execute(&inventory)
        .await?;
        let has_migrations: Option<String> =
            sqlx::query_scalar("SELECT to_regclass('outbox_migrations')::text")
                .fetch_one(&inventory)
                .await?;
        if has_migrations.is_some() {
            sqlx::query("DELETE FROM outbox_migrations WHERE table_name = ANY($1)")
                .bind(ours.map(str::to_owned).to_vec())
                .execute(&inventory)
                .await?;
        }

        store.migrate().await?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {} (id bigint PRIMARY KEY, sku text NOT NULL, qty bigint NOT NULL, \
             status text NOT NULL DEFAULT '{PLACED}', created_at timestamptz NOT NULL DEFAULT now())",
            t.orders
        )))
        .execute(store.pool())
        .await?;
        let store = store.clone().with_rejection_hook(Arc::new(CancelOrder {
            orders: t.orders,
            outbox: store,
        }));

        let inbox = Inbox::new(inventory.clone(), t.inbox, CONSUMER)?;
        inbox.migrate().await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {stock} (sku text PRIMARY KEY, qty bigint NOT NULL);
             CREATE TABLE {log} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                 order_id bigint NOT NULL, sku text NOT NULL, qty bigint NOT NULL,
                 message_id uuid NOT NULL);
             CREATE INDEX {log}_order_id ON {log} (order_id);",
            stock = t.stock,
            log = t.deductions
        )))
        .execute(&inventory)
        .await?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {} (sku, qty) SELECT s, $2 FROM UNNEST($1::text[]) AS s",
            t.stock
        )))
        .bind(SKUS.map(str::to_owned).to_vec())
        .bind(initial_stock(orders))
        .execute(&inventory)
        .await?;
        Ok(Services::Postgres {
            store,
            inventory,
            inbox,
        })
    }

    async fn open_mysql(url: &str, orders: usize) -> anyhow::Result<Services> {
        let t = PG_TABLES;
        let outbox_options = StoreOptions::table(t.outbox);
        let store = MySqlStore::from_pool(
            mysql_pool(url)
                .await
                .context("cannot connect to MySQL/MariaDB for the order service")?,
            outbox_options.clone(),
        )?;
        let inventory = mysql_pool(url)
            .await
            .context("cannot connect to MySQL/MariaDB for the inventory service")?;
        // Start from scratch: drop the demo tables (with the inboxes' dead-letter tables) and
        // forget their migrations.
        let ours = [
            t.orders,
            t.outbox,
            outbox_options.inbox_table.as_str(),
            t.stock,
            t.inbox,
            t.deductions,
        ];
        let dead_letters = [
            format!("{}_dlq", outbox_options.inbox_table),
            format!("{}_dlq", t.inbox),
        ];
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP TABLE IF EXISTS {}, {}",
            ours.join(", "),
            dead_letters.join(", ")
        )))
        .execute(&inventory)
        .await?;
        let has_migrations: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.tables \
             WHERE table_schema = DATABASE() AND table_name = 'outbox_migrations'",
        )
        .fetch_one(&inventory)
        .await?;
        if has_migrations > 0 {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "DELETE FROM outbox_migrations WHERE table_name IN ({})",
                ours.map(|t| format!("'{t}'")).join(", ")
            )))
            .execute(&inventory)
            .await?;
        }

        store.migrate().await?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {} (id BIGINT PRIMARY KEY, sku VARCHAR(64) NOT NULL, qty BIGINT NOT NULL, \
             status VARCHAR(32) NOT NULL DEFAULT '{PLACED}', \
             created_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6))) ENGINE=InnoDB",
            t.orders
        )))
        .execute(store.pool())
        .await?;
        let store = store.clone().with_rejection_hook(Arc::new(CancelOrder {
            orders: t.orders,
            outbox: store,
        }));

        let inbox = Inbox::new(inventory.clone(), t.inbox, CONSUMER)?;
        inbox.migrate().await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {stock} (sku VARCHAR(64) PRIMARY KEY, qty BIGINT NOT NULL) ENGINE=InnoDB;
             CREATE TABLE {log} (id BIGINT AUTO_INCREMENT PRIMARY KEY,
                 order_id BIGINT NOT NULL, sku VARCHAR(64) NOT NULL, qty BIGINT NOT NULL,
                 message_id CHAR(36) NOT NULL, KEY {log}_order_id (order_id)) ENGINE=InnoDB;",
            stock = t.stock,
            log = t.deductions
        )))
        .execute(&inventory)
        .await?;
        for sku in SKUS {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {} (sku, qty) VALUES (?, ?)",
                t.stock
            )))
            .bind(sku)
            .bind(initial_stock(orders))
            .execute(&inventory)
            .await?;
        }
        Ok(Services::MySql {
            store,
            inventory,
            inbox,
        })
    }

    fn describe(&self, args: &DemoArgs) -> String {
        match self {
            Services::Sqlite { .. } => format!(
                "SQLite ({0}/orders.db, {0}/inventory.db)",
                args.data_dir.display()
            ),
            Services::Postgres { .. } => {
                "PostgreSQL (demo_orders + demo_outbox, demo_stock + demo_inbox + demo_deductions)"
                    .into()
            }
            Services::MySql { .. } => "MySQL/MariaDB (demo_orders + demo_outbox, demo_stock + \
                 demo_inbox + demo_deductions)"
                .into(),
        }
    }

    fn tables(&self) -> Tables {
        match self {
            Services::Sqlite { .. } => SQLITE_TABLES,
            Services::Postgres { .. } | Services::MySql { .. } => PG_TABLES,
        }
    }

    /// The order service's outbox store, for the relay.
    fn store(&self) -> Arc<dyn Store> {
        match self {
            Services::Sqlite { store, .. } => Arc::new(store.clone()),
            Services::Postgres { store, .. } => Arc::new(store.clone()),
            Services::MySql { store, .. } => Arc::new(store.clone()),
        }
    }

    /// Place one order: the order row and its `order-created` message in one transaction.
    async fn place_order(&self, order: &Order) -> anyhow::Result<()> {
        let message =
            NewMessage::json(TOPIC, order)?.with_partition_key(order.order_id.to_string());
        let orders = self.tables().orders;
        match self {
            Services::Sqlite { store, .. } => {
                let mut tx = store.begin().await?;
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "INSERT INTO {orders} (id, sku, qty) VALUES (?1, ?2, ?3)"
                )))
                .bind(order.order_id)
                .bind(&order.sku)
                .bind(order.qty)
                .execute(&mut *tx)
                .await?;
                store.enqueue(&mut tx, message).await?;
                store.commit(tx).await?;
            }
            Services::Postgres { store, .. } => {
                let mut tx = store.begin().await?;
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "INSERT INTO {orders} (id, sku, qty) VALUES ($1, $2, $3)"
                )))
                .bind(order.order_id)
                .bind(&order.sku)
                .bind(order.qty)
                .execute(&mut *tx)
                .await?;
                store.enqueue(&mut tx, message).await?;
                store.commit(tx).await?;
            }
            Services::MySql { store, .. } => {
                let mut tx = store.begin().await?;
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "INSERT INTO {orders} (id, sku, qty) VALUES (?, ?, ?)"
                )))
                .bind(order.order_id)
                .bind(&order.sku)
                .bind(order.qty)
                .execute(&mut *tx)
                .await?;
                store.enqueue(&mut tx, message).await?;
                store.commit(tx).await?;
            }
        }
        Ok(())
    }

    /// Every order row: (id, sku, qty, status).
    async fn orders(&self) -> anyhow::Result<Vec<(i64, String, i64, String)>> {
        let sql = format!("SELECT id, sku, qty, status FROM {}", self.tables().orders);
        Ok(match self {
            Services::Sqlite { store, .. } => {
                sqlx::query_as(sqlx::AssertSqlSafe(sql))
                    .fetch_all(store.pool())
                    .await?
            }
            Services::Postgres { store, .. } => {
                sqlx::query_as(sqlx::AssertSqlSafe(sql))
                    .fetch_all(store.pool())
                    .await?
            }
            Services::MySql { store, .. } => {
                sqlx::query_as(sqlx::AssertSqlSafe(sql))
                    .fetch_all(store.pool())
                    .await?
            }
        })
    }

    /// Every outbox row: (topic, partition key = order id, status number).
    async fn outbox_rows(&self) -> anyhow::Result<Vec<(String, Option<String>, i64)>> {
        let sql = if matches!(self, Services::MySql { .. }) {
            format!(
                "SELECT topic, partition_key, CAST(status AS SIGNED) FROM {}",
                self.tables().outbox
            )
        } else {
            format!(
                "SELECT CAST(topic AS TEXT), CAST(partition_key AS TEXT), CAST(status AS BIGINT) FROM {}",
                self.tables().outbox
            )
        };
        Ok(match self {
            Services::Sqlite { store, .. } => {
                sqlx::query_as(sqlx::AssertSqlSafe(sql))
                    .fetch_all(store.pool())
                    .await?
            }
            Services::Postgres { store, .. } => {
                sqlx::query_as(sqlx::AssertSqlSafe(sql))
                    .fetch_all(store.pool())
                    .await?
            }
            Services::MySql { store, .. } => {
                sqlx::query_as(sqlx::AssertSqlSafe(sql))
                    .fetch_all(store.pool())
                    .await?
            }
        })
    }

    /// Commit-to-verdict latency of every `order-created` message that got its verdict
    /// (`confirmed_at - created_at`, database clock), in microseconds.
    async fn verdict_latencies(&self) -> anyhow::Result<Vec<i64>> {
        let t = self.tables().outbox;
        Ok(match self {
            Services::Sqlite { store, .. } => {
                sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                    "SELECT (confirmed_at - created_at) * 1000 FROM {t} \
                     WHERE topic = ?1 AND confirmed_at IS NOT NULL"
                )))
                .bind(TOPIC)
                .fetch_all(store.pool())
                .await?
            }
            Services::Postgres { store, .. } => sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT CAST(EXTRACT(EPOCH FROM confirmed_at - created_at) * 1000000 AS BIGINT) \
                     FROM {t} WHERE topic = $1 AND confirmed_at IS NOT NULL"
            )))
            .bind(TOPIC)
            .fetch_all(store.pool())
            .await?,
            Services::MySql { store, .. } => {
                sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                    "SELECT TIMESTAMPDIFF(MICROSECOND, created_at, confirmed_at) \
                     FROM {t} WHERE topic = ? AND confirmed_at IS NOT NULL"
                )))
                .bind(TOPIC)
                .fetch_all(store.pool())
                .await?
            }
        })
    }

    /// Every deduction log row: (order id, sku, qty).
    async fn deductions(&self) -> anyhow::Result<Vec<(i64, String, i64)>> {
        let sql = format!(
            "SELECT order_id, sku, qty FROM {}",
            self.tables().deductions
        );
        Ok(match self {
            Services::Sqlite { inventory, .. } => {
                sqlx::query_as(sqlx::AssertSqlSafe(sql))
                    .fetch_all(inventory)
                    .await?
            }
            Services::Postgres { inventory, .. } => {
                sqlx::query_as(sqlx::AssertSqlSafe(sql))
                    .fetch_all(inventory)
                    .await?
            }
            Services::MySql { inventory, .. } => {
                sqlx::query_as(sqlx::AssertSqlSafe(sql))
                    .fetch_all(inventory)
                    .await?
            }
        })
    }

    /// Orders with at least one deduction.
    async fn orders_with_deduction(&self) -> anyhow::Result<u64> {
        let sql = format!(
            "SELECT COUNT(DISTINCT order_id) FROM {}",
            self.tables().deductions
        );
        let n: i64 = match self {
            Services::Sqlite { inventory, .. } => {
                sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                    .fetch_one(inventory)
                    .await?
            }
            Services::Postgres { inventory, .. } => {
                sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                    .fetch_one(inventory)
                    .await?
            }
            Services::MySql { inventory, .. } => {
                sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                    .fetch_one(inventory)
                    .await?
            }
        };
        Ok(n as u64)
    }

    /// Stock per SKU now.
    async fn stock(&self) -> anyhow::Result<Vec<(String, i64)>> {
        let sql = format!("SELECT sku, qty FROM {}", self.tables().stock);
        Ok(match self {
            Services::Sqlite { inventory, .. } => {
                sqlx::query_as(sqlx::AssertSqlSafe(sql))
                    .fetch_all(inventory)
                    .await?
            }
            Services::Postgres { inventory, .. } => {
                sqlx::query_as(sqlx::AssertSqlSafe(sql))
                    .fetch_all(inventory)
                    .await?
            }
            Services::MySql { inventory, .. } => {
                sqlx::query_as(sqlx::AssertSqlSafe(sql))
                    .fetch_all(inventory)
                    .await?
            }
        })
    }

    /// Publish attempts recorded in the outbox (the sum of `attempts`).
    async fn publish_attempts(&self) -> anyhow::Result<i64> {
        let int = if matches!(self, Services::MySql { .. }) {
            "SIGNED"
        } else {
            "BIGINT"
        };
        let sql = format!(
            "SELECT CAST(COALESCE(SUM(attempts), 0) AS {int}) FROM {}",
            self.tables().outbox
        );
        Ok(match self {
            Services::Sqlite { store, .. } => {
                sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                    .fetch_one(store.pool())
                    .await?
            }
            Services::Postgres { store, .. } => {
                sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                    .fetch_one(store.pool())
                    .await?
            }
            Services::MySql { store, .. } => {
                sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                    .fetch_one(store.pool())
                    .await?
            }
        })
    }
}

/// A pool on a fresh SQLite file: WAL, `synchronous = FULL`, a 10 s busy timeout. Statement
/// logging is off: waiting for SQLite's single write lock under 16 concurrent clients is the
/// expected contention here, not a slow query worth a warning.
async fn sqlite_pool(file: &Path) -> Result<SqlitePool, sqlx::Error> {
    SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(
            SqliteConnectOptions::new()
                .filename(file)
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .synchronous(SqliteSynchronous::Full)
                .busy_timeout(Duration::from_secs(10))
                .disable_statement_logging(),
        )
        .await
}

/// A pool of up to 10 PostgreSQL connections, statement logging off (row-lock waits on the hot
/// stock rows are expected contention).
async fn pg_pool(url: &str) -> Result<PgPool, sqlx::Error> {
    let options = PgConnectOptions::from_str(url)?.disable_statement_logging();
    PgPoolOptions::new()
        .max_connections(10)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await
}

/// A pool of up to 10 MySQL/MariaDB connections, statement logging off (row-lock waits on the
/// hot stock rows are expected contention).
async fn mysql_pool(url: &str) -> Result<MySqlPool, sqlx::Error> {
    let options = MySqlConnectOptions::from_str(url)?.disable_statement_logging();
    MySqlPoolOptions::new()
        .max_connections(10)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await
}

/// The inventory service's message handler, inside the inbox transaction: an `order-created`
/// message deducts stock and logs the deduction, or is refused when the stock cannot cover it
/// (nothing deducted); an `order-cancelled` event is acknowledged without effect.
struct InventoryHandler {
    tables: Tables,
    timeline: Arc<Timeline>,
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

#[async_trait]
impl outbox::Handler<sqlx::Sqlite> for InventoryHandler {
    async fn handle(
        &self,
        conn: &mut SqliteConnection,
        msg: &InboundMessage,
    ) -> Result<(), HandlerError> {
        let Some(order) = Self::order(msg)? else {
            return Ok(());
        };
        let t = self.tables;
        let deducted = sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {} SET qty = qty - ?1 WHERE sku = ?2 AND qty >= ?1",
            t.stock
        )))
        .bind(order.qty)
        .bind(&order.sku)
        .execute(&mut *conn)
        .await
        .map_err(HandlerError::transient)?
        .rows_affected();
        if deducted == 0 {
            let in_stock: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT qty FROM {} WHERE sku = ?1",
                t.stock
            )))
            .bind(&order.sku)
            .fetch_optional(&mut *conn)
            .await
            .map_err(HandlerError::transient)?;
            return Err(Self::insufficient(&order, in_stock));
        }
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {} (order_id, sku, qty, message_id) VALUES (?1, ?2, ?3, ?4)",
            t.deductions
        )))
        .bind(order.order_id)
        .bind(&order.sku)
        .bind(order.qty)
        .bind(msg.message_id.to_string())
        .execute(&mut *conn)
        .await
        .map_err(HandlerError::transient)?;
        self.timeline.applied(order.order_id);
        Ok(())
    }
}

#[async_trait]
impl outbox::Handler<sqlx::Postgres> for InventoryHandler {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        msg: &InboundMessage,
    ) -> Result<(), HandlerError> {
        let Some(order) = Self::order(msg)? else {
            return Ok(());
        };
        let t = self.tables;
        let deducted = sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {} SET qty = qty - $1 WHERE sku = $2 AND qty >= $1",
            t.stock
        )))
        .bind(order.qty)
        .bind(&order.sku)
        .execute(&mut *conn)
        .await
        .map_err(HandlerError::transient)?
        .rows_affected();
        if deducted == 0 {
            let in_stock: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT qty FROM {} WHERE sku = $1",
                t.stock
            )))
            .bind(&order.sku)
            .fetch_optional(&mut *conn)
            .await
            .map_err(HandlerError::transient)?;
            return Err(Self::insufficient(&order, in_stock));
        }
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {} (order_id, sku, qty, message_id) VALUES ($1, $2, $3, $4)",
            t.deductions
        )))
        .bind(order.order_id)
        .bind(&order.sku)
        .bind(order.qty)
        .bind(msg.message_id)
        .execute(&mut *conn)
        .await
        .map_err(HandlerError::transient)?;
        self.timeline.applied(order.order_id);
        Ok(())
    }
}

#[async_trait]
impl outbox::Handler<sqlx::MySql> for InventoryHandler {
    async fn handle(
        &self,
        conn: &mut MySqlConnection,
        msg: &InboundMessage,
    ) -> Result<(), HandlerError> {
        let Some(order) = Self::order(msg)? else {
            return Ok(());
        };
        let t = self.tables;
        let deducted = sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {} SET qty = qty - ? WHERE sku = ? AND qty >= ?",
            t.stock
        )))
        .bind(order.qty)
        .bind(&order.sku)
        .bind(order.qty)
        .execute(&mut *conn)
        .await
        .map_err(HandlerError::transient)?
        .rows_affected();
        if deducted == 0 {
            let in_stock: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT qty FROM {} WHERE sku = ?",
                t.stock
            )))
            .bind(&order.sku)
            .fetch_optional(&mut *conn)
            .await
            .map_err(HandlerError::transient)?;
            return Err(Self::insufficient(&order, in_stock));
        }
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {} (order_id, sku, qty, message_id) VALUES (?, ?, ?, ?)",
            t.deductions
        )))
        .bind(order.order_id)
        .bind(&order.sku)
        .bind(order.qty)
        .bind(msg.message_id.to_string())
        .execute(&mut *conn)
        .await
        .map_err(HandlerError::transient)?;
        self.timeline.applied(order.order_id);
        Ok(())
    }
}

/// The order service's compensation for a refused order, run by the store inside the producer
/// transaction that records REJECTED: the order becomes CANCELLED and an `order-cancelled`
/// event is enqueued through the outbox, all committed together (or not at all).
struct CancelOrder<S> {
    /// The orders table.
    orders: &'static str,
    /// The outbox to enqueue the event into (a store without a hook: enqueue needs the table).
    outbox: S,
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

    fn check_cancelled(order_id: i64, rows: u64) -> Result<(), BoxError> {
        if rows == 1 {
            Ok(())
        } else {
            Err(format!("order {order_id} is not {PLACED}; refusing to cancel it").into())
        }
    }
}

#[async_trait]
impl RejectionHook<sqlx::Sqlite> for CancelOrder<SqliteStore> {
    async fn on_rejected(
        &self,
        conn: &mut SqliteConnection,
        rejected: &RejectedMessage,
    ) -> Result<(), BoxError> {
        let Some((order_id, event)) = Self::event(rejected)? else {
            return Ok(());
        };
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {} SET status = '{CANCELLED}' WHERE id = ?1 AND status = '{PLACED}'",
            self.orders
        )))
        .bind(order_id)
        .execute(&mut *conn)
        .await?
        .rows_affected();
        Self::check_cancelled(order_id, rows)?;
        self.outbox.enqueue(conn, event).await?;
        Ok(())
    }
}

#[async_trait]
impl RejectionHook<sqlx::Postgres> for CancelOrder<PgStore> {
    async fn on_rejected(
        &self,
        conn: &mut PgConnection,
        rejected: &RejectedMessage,
    ) -> Result<(), BoxError> {
        let Some((order_id, event)) = Self::event(rejected)? else {
            return Ok(());
        };
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {} SET status = '{CANCELLED}' WHERE id = $1 AND status = '{PLACED}'",
            self.orders
        )))
        .bind(order_id)
        .execute(&mut *conn)
        .await?
        .rows_affected();
        Self::check_cancelled(order_id, rows)?;
        self.outbox.enqueue(conn, event).await?;
        Ok(())
    }
}

#[async_trait]
impl RejectionHook<sqlx::MySql> for CancelOrder<MySqlStore> {
    async fn on_rejected(
        &self,
        conn: &mut MySqlConnection,
        rejected: &RejectedMessage,
    ) -> Result<(), BoxError> {
        let Some((order_id, event)) = Self::event(rejected)? else {
            return Ok(());
        };
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {} SET status = '{CANCELLED}' WHERE id = ? AND status = '{PLACED}'",
            self.orders
        )))
        .bind(order_id)
        .execute(&mut *conn)
        .await?
        .rows_affected();
        Self::check_cancelled(order_id, rows)?;
        self.outbox.enqueue(conn, event).await?;
        Ok(())
    }
}

/// When each order committed (client side) and took effect (handler side), in microseconds
/// since the start plus one (zero: not yet).
struct Timeline {
    start: Instant,
    committed: Vec<AtomicU64>,
    applied: Vec<AtomicU64>,
}

impl Timeline {
    fn new(orders: usize) -> Timeline {
        Timeline {
            start: Instant::now(),
            committed: (0..orders).map(|_| AtomicU64::new(0)).collect(),
            applied: (0..orders).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn now(&self) -> u64 {
        self.start.elapsed().as_micros() as u64 + 1
    }

    fn slot(slots: &[AtomicU64], order_id: i64) -> Option<&AtomicU64> {
        usize::try_from(order_id - 1)
            .ok()
            .and_then(|i| slots.get(i))
    }

    fn committed(&self, order_id: i64) {
        if let Some(s) = Self::slot(&self.committed, order_id) {
            s.store(self.now(), Ordering::Relaxed);
        }
    }

    /// Record the effect; a handler run whose transaction rolled back is overwritten by the
    /// run that commits, which comes later.
    fn applied(&self, order_id: i64) {
        if let Some(s) = Self::slot(&self.applied, order_id) {
            s.store(self.now(), Ordering::Relaxed);
        }
    }

    /// Commit-to-effect latencies in microseconds.
    fn latencies(&self) -> anyhow::Result<hdrhistogram::Histogram<u64>> {
        let mut h = hdrhistogram::Histogram::<u64>::new(3)?;
        for (c, a) in self.committed.iter().zip(&self.applied) {
            let (c, a) = (c.load(Ordering::Relaxed), a.load(Ordering::Relaxed));
            if c > 0 && a > 0 {
                h.record(a.saturating_sub(c).max(1))?;
            }
        }
        Ok(h)
    }
}

/// Fault rates of the [`FaultyTransport`].
#[derive(Debug, Clone, Copy)]
struct Faults {
    loss_before: f64,
    loss_after: f64,
    duplicate: f64,
}

/// What the fault injector did.
#[derive(Debug, Default)]
struct FaultStats {
    lost_before: AtomicU64,
    acks_lost: AtomicU64,
    duplicated: AtomicU64,
    copies_sent: AtomicU64,
    confirmations_lost: AtomicU64,
}

/// A confirmation sender that drops a share of the consumer's confirmations silently, as a
/// network would (the consumer believes it sent them); the producer's check-back recovers them.
struct LossyConfirmations {
    inner: Arc<dyn ConfirmationSender>,
    rate: f64,
    stats: Arc<FaultStats>,
}

#[async_trait]
impl ConfirmationSender for LossyConfirmations {
    async fn send(
        &self,
        reply_to: &str,
        confirmation: &Confirmation,
    ) -> Result<(), TransportError> {
        if rand::rng().random_bool(self.rate) {
            self.stats
                .confirmations_lost
                .fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        self.inner.send(reply_to, confirmation).await
    }
}

/// A transport wrapper that injects faults: a delivery lost before the broker (a retryable
/// error, nothing sent), an acknowledgement lost after the broker accepted (sent, then a
/// retryable error), a duplicated delivery (sent twice).
struct FaultyTransport {
    inner: Arc<dyn Transport>,
    faults: Faults,
    stats: Arc<FaultStats>,
}

/// The fault drawn for one message of a batch.
#[derive(Debug, Clone, Copy, Default)]
struct Fate {
    lost_before: bool,
    ack_lost: bool,
    duplicated: bool,
}

#[async_trait]
impl Transport for FaultyTransport {
    fn name(&self) -> &str {
        self.inner.name()
    }

    async fn publish(&self, batch: &[Outgoing<'_>]) -> Vec<Result<(), TransportError>> {
        let fates: Vec<Fate> = {
            let mut rng = rand::rng();
            batch
                .iter()
                .map(|_| {
                    let lost_before = rng.random_bool(self.faults.loss_before);
                    Fate {
                        lost_before,
                        ack_lost: !lost_before && rng.random_bool(self.faults.loss_after),
                        duplicated: !lost_before && rng.random_bool(self.faults.duplicate),
                    }
                })
                .collect()
        };
        let mut sends = Vec::with_capacity(batch.len());
        let mut origin = Vec::with_capacity(batch.len());
        for (i, (out, fate)) in batch.iter().zip(&fates).enumerate() {
            let copies = match fate {
                Fate {
                    lost_before: true, ..
                } => 0,
                Fate {
                    duplicated: true, ..
                } => 2,
                _ => 1,
            };
            for _ in 0..copies {
                sends.push(*out);
                origin.push(i);
            }
        }
        let stats = &self.stats;
        let count = |a: &AtomicU64, n: usize| a.fetch_add(n as u64, Ordering::Relaxed);
        count(&stats.copies_sent, sends.len());
        let results = if sends.is_empty() {
            Vec::new()
        } else {
            self.inner.publish(&sends).await
        };

        // One result per input: a message is acknowledged when any of its copies was.
        let mut merged: Vec<Option<Result<(), TransportError>>> =
            (0..batch.len()).map(|_| None).collect();
        for (i, r) in origin.into_iter().zip(results) {
            if !matches!(merged[i], Some(Ok(()))) {
                merged[i] = Some(r);
            }
        }
        merged
            .into_iter()
            .zip(fates)
            .map(|(result, fate)| {
                if fate.lost_before {
                    count(&stats.lost_before, 1);
                    return Err(TransportError::retryable(
                        "injected fault: delivery lost before the consumer",
                    ));
                }
                if fate.duplicated {
                    count(&stats.duplicated, 1);
                }
                match result {
                    Some(Ok(())) if fate.ack_lost => {
                        count(&stats.acks_lost, 1);
                        Err(TransportError::retryable(
                            "injected fault: acknowledgement lost after the consumer committed",
                        ))
                    }
                    Some(r) => r,
                    None => Err(TransportError::retryable("transport returned no result")),
                }
            })
            .collect()
    }

    async fn probe(&self) -> Result<(), TransportError> {
        self.inner.probe().await
    }
}

/// How messages travel from the relay to the inventory service, and confirmations back.
enum Delivery {
    /// Standard Webhooks POSTs to an axum server in this process; confirmations are POSTed to
    /// the order service's own axum server.
    Webhook { secret: String },
    /// NATS JetStream: stream [`NATS_STREAM`], durable pull consumer [`CONSUMER`];
    /// confirmations on core NATS subject [`CONFIRM_SUBJECT`].
    Nats {
        url: String,
        js: Box<async_nats::jetstream::Context>,
    },
    /// Redis Streams: stream [`REDIS_STREAM`], consumer group [`CONSUMER`]; confirmations on
    /// stream [`REDIS_CONFIRM_STREAM`].
    #[cfg(feature = "redis")]
    Redis {
        url: String,
        transport: Arc<outbox::RedisTransport>,
    },
    /// MQTT 5: topics `demo/orders/<topic>`, shared subscription of persistent sessions;
    /// confirmations on [`MQTT_CONFIRM_TOPIC`]. `run` makes the session and group names unique
    /// to this run, so sessions left by an earlier run receive nothing of this one.
    #[cfg(feature = "mqtt")]
    Mqtt {
        url: String,
        run: String,
        sender: Arc<outbox::confirm::mqtt::MqttConfirmationSender>,
    },
    /// RocketMQ: fresh topics for this run (orders, with the outbox topic as the tag, and
    /// confirmations), consumer group `inventory_<run>` with two instances sharing the queues;
    /// confirmations over RocketMQ to the order service's group.
    #[cfg(feature = "rocketmq")]
    RocketMq(Box<RocketMqDelivery>),
    /// RabbitMQ: topic exchange [`RABBIT_EXCHANGE`] → queue [`RABBIT_QUEUE`] with publisher
    /// confirms; confirmations on queue [`RABBIT_CONFIRM_QUEUE`].
    #[cfg(feature = "rabbitmq")]
    RabbitMq { config: outbox::RabbitMqConfig },
    /// Kafka (any Kafka-protocol broker, e.g. Tansu): topics `demo-<run>.order-created` and
    /// `demo-<run>.order-cancelled`, consumer group `demo-<run>.inventory`; confirmations on topic
    /// `demo-<run>.confirmations`, group `demo-<run>.demo-order-service`. Topics and groups are
    /// fresh per run, so no earlier run's offsets or departed group members apply.
    #[cfg(feature = "kafka")]
    Kafka {
        url: String,
        config: Box<KafkaConfig>,
        run: String,
        sender: Arc<KafkaConfirmationSender>,
    },
}

/// The RocketMQ delivery's names and its confirmation sender.
#[cfg(feature = "rocketmq")]
struct RocketMqDelivery {
    url: String,
    name_server: String,
    /// Topic of the orders and cancellations (tags `order-created`, `order-cancelled`).
    orders_topic: String,
    /// Topic of the confirmations (tag `order-service`).
    confirm_topic: String,
    /// Suffix of this run's groups.
    run: String,
    sender: Arc<dyn ConfirmationSender>,
}

#[cfg(feature = "rocketmq")]
impl RocketMqDelivery {
    /// Connect, create this run's topics (so consumers find their routes at once) and the
    /// confirmation sender. Topics are per run: a fresh consumer group reads its topic from the
    /// first offset, and must not see an earlier run's orders.
    async fn open(url: &str) -> anyhow::Result<RocketMqDelivery> {
        use outbox::transport::rocketmq::{RocketMqConfig, RocketMqTransport};
        let run = format!("{:08x}", rand::random::<u32>());
        let mut config = RocketMqConfig::from_url(url)?;
        let name_server = config.name_server.clone();
        config.producer_group = format!("demo_inventory_confirmer_{run}");
        let transport = RocketMqTransport::connect(config)
            .await
            .with_context(|| format!("cannot connect to RocketMQ at {url}"))?;
        let orders_topic = format!("demo_orders_{run}");
        let confirm_topic = format!("demo_confirmations_{run}");
        for t in [&orders_topic, &confirm_topic] {
            transport
                .create_topic(t, 4)
                .await
                .with_context(|| format!("cannot create the RocketMQ topic {t}"))?;
        }
        let sender = Arc::new(outbox::confirm::rocketmq::RocketMqConfirmationSender::new(
            transport,
        ));
        Ok(RocketMqDelivery {
            url: url.to_owned(),
            name_server,
            orders_topic,
            confirm_topic,
            run,
            sender,
        })
    }
}

/// Redis stream the demo's relay publishes every topic to (recreated at start).
#[cfg(feature = "redis")]
const REDIS_STREAM: &str = "demo:orders";
/// Redis stream the inventory service confirms to (recreated at start).
#[cfg(feature = "redis")]
const REDIS_CONFIRM_STREAM: &str = "demo:confirmations";
/// MQTT topic prefix of the demo's messages (`demo/orders/<topic>`).
#[cfg(feature = "mqtt")]
const MQTT_TOPICS: &str = "demo/orders/{topic}";
/// MQTT topic the inventory service confirms to.
#[cfg(feature = "mqtt")]
const MQTT_CONFIRM_TOPIC: &str = "demo/confirmations";

/// Where the relay delivers: the webhook URL, or nothing for NATS (the route names the subject).
type Endpoint = Option<String>;

/// A task of one of the services, joined at the end of the run.
type ServiceTask = JoinHandle<anyhow::Result<()>>;

impl Delivery {
    /// Set up the delivery; for NATS, a fresh stream with a 2-minute duplicate window (relay
    /// re-publishes of a message id are dropped; check-back redeliveries carry their own
    /// `Nats-Msg-Id` and get through).
    async fn open(transport: Option<&str>) -> anyhow::Result<Delivery> {
        match transport {
            None | Some("webhook") => {
                let key: [u8; 24] = rand::random();
                let secret = format!(
                    "whsec_{}",
                    base64::engine::general_purpose::STANDARD.encode(key)
                );
                Ok(Delivery::Webhook { secret })
            }
            Some(url) if url.starts_with("nats://") => {
                let client = outbox::transport::nats::connect_options(url)
                    .connect(url)
                    .await
                    .with_context(|| format!("cannot connect to NATS at {url}"))?;
                let js = async_nats::jetstream::new(client);
                // Start from an empty stream so runs are independent; a missing stream is fine.
                let _ = js.delete_stream(NATS_STREAM).await;
                js.create_stream(async_nats::jetstream::stream::Config {
                    name: NATS_STREAM.into(),
                    subjects: vec![NATS_SUBJECTS.into()],
                    duplicate_window: Duration::from_secs(120),
                    ..Default::default()
                })
                .await
                .with_context(|| format!("cannot create the JetStream stream {NATS_STREAM}"))?;
                Ok(Delivery::Nats {
                    url: url.to_owned(),
                    js: Box::new(js),
                })
            }
            #[cfg(feature = "redis")]
            Some(url) if url.starts_with("redis://") || url.starts_with("rediss://") => {
                let transport = outbox::RedisTransport::connect(outbox::RedisConfig::new(url))
                    .await
                    .with_context(|| format!("cannot connect to Redis at {url}"))?;
                // Start from empty streams so runs are independent.
                let mut conn = transport.connection();
                redis::cmd("DEL")
                    .arg(REDIS_STREAM)
                    .arg(REDIS_CONFIRM_STREAM)
                    .query_async::<i64>(&mut conn)
                    .await
                    .context("cannot reset the demo streams")?;
                Ok(Delivery::Redis {
                    url: url.to_owned(),
                    transport: Arc::new(transport),
                })
            }
            #[cfg(feature = "mqtt")]
            Some(url) if url.starts_with("mqtt://") || url.starts_with("mqtts://") => {
                let sender = outbox::confirm::mqtt::MqttConfirmationSender::connect(
                    outbox::MqttConfig::new(url),
                )
                .await
                .with_context(|| format!("cannot connect to the MQTT broker at {url}"))?;
                Ok(Delivery::Mqtt {
                    url: url.to_owned(),
                    run: format!("{:08x}", rand::random::<u32>()),
                    sender: Arc::new(sender),
                })
            }
            #[cfg(feature = "rocketmq")]
            Some(url) if url.starts_with("rocketmq://") => Ok(Delivery::RocketMq(Box::new(
                RocketMqDelivery::open(url).await?,
            ))),
            #[cfg(not(feature = "rocketmq"))]
            Some(url) if url.starts_with("rocketmq://") => {
                bail!(
                    "--transport {url}: RocketMQ support is not compiled in: run with --features rocketmq"
                )
            }
            #[cfg(feature = "rabbitmq")]
            Some(url) if url.starts_with("amqp://") || url.starts_with("amqps://") => {
                rabbitmq_fresh_queues(url).await?;
                let mut config = outbox::RabbitMqConfig::new(url);
                config.confirm_timeout = Duration::from_secs(1);
                config.validate()?;
                Ok(Delivery::RabbitMq { config })
            }
            #[cfg(feature = "kafka")]
            Some(url) if url.starts_with("kafka://") => {
                let mut config = KafkaConfig::new(url);
                // Below the demo relay's 1 s publish timeout (see outbox::transport::kafka).
                config.delivery_timeout = Duration::from_millis(800);
                let run = format!("demo-{:08x}", rand::random::<u32>());
                let topic = |t: &str, partitions| {
                    outbox::transport::kafka::KafkaTopic::new(format!("{run}.{t}"))
                        .partitions(partitions)
                };
                outbox::transport::kafka::create_topics(
                    &config,
                    &[
                        topic(TOPIC, KAFKA_PARTITIONS),
                        topic(CANCELLED_TOPIC, KAFKA_PARTITIONS),
                        topic("confirmations", 2),
                    ],
                )
                .await
                .with_context(|| format!("cannot create the demo topics on Kafka at {url}"))?;
                let sender = Arc::new(KafkaConfirmationSender::new(config.clone())?);
                Ok(Delivery::Kafka {
                    url: url.to_owned(),
                    config: Box::new(config),
                    run,
                    sender,
                })
            }
            Some(other) => bail!(
                "--transport must be \"webhook\" or a nats://, redis://, mqtt://, amqp://, kafka:// or rocketmq:// URL, not {other:?}"
            ),
        }
    }

    fn describe(&self) -> String {
        match self {
            Delivery::Webhook { .. } => {
                "signed webhooks (in-process axum receiver), confirmations POSTed to the order service"
                    .into()
            }
            Delivery::Nats { url, .. } => {
                format!(
                    "NATS JetStream at {url} (stream {NATS_STREAM}, durable {CONSUMER}), \
                     confirmations on {CONFIRM_SUBJECT}"
                )
            }
            #[cfg(feature = "redis")]
            Delivery::Redis { url, .. } => format!(
                "Redis Streams at {url} (stream {REDIS_STREAM}, group {CONSUMER}), \
                 confirmations on stream {REDIS_CONFIRM_STREAM}"
            ),
            #[cfg(feature = "mqtt")]
            Delivery::Mqtt { url, run, .. } => format!(
                "MQTT 5 at {url} (QoS 1, topics demo/orders/#, shared subscription \
                 {CONSUMER}-{run}), confirmations on {MQTT_CONFIRM_TOPIC}"
            ),
            #[cfg(feature = "rocketmq")]
            Delivery::RocketMq(r) => format!(
                "RocketMQ at {} (topic {}, tags order-created/order-cancelled, group {CONSUMER}_{} \
                 with 2 instances), confirmations on {}:order-service",
                r.url, r.orders_topic, r.run, r.confirm_topic
            ),
            #[cfg(feature = "rabbitmq")]
            Delivery::RabbitMq { config } => format!(
                "RabbitMQ at {} (exchange {RABBIT_EXCHANGE} → queue {RABBIT_QUEUE}, publisher \
                 confirms), confirmations on queue {RABBIT_CONFIRM_QUEUE}",
                crate::redact(&config.url)
            ),
            #[cfg(feature = "kafka")]
            Delivery::Kafka { url, run, .. } => {
                format!(
                    "Kafka at {url} (topics {run}.{TOPIC} and {run}.{CANCELLED_TOPIC}, \
                     {KAFKA_PARTITIONS} partitions each, consumer group {run}.{CONSUMER}), \
                     confirmations on topic {run}.confirmations"
                )
            }
        }
    }

    /// Start the order service's confirmation endpoint, applying confirmations to `store` until
    /// `cancel`; returns the reply destination to name in the messages.
    async fn start_confirmation_listener(
        &self,
        store: Arc<dyn Store>,
        cancel: &CancellationToken,
    ) -> anyhow::Result<(String, ServiceTask)> {
        match self {
            Delivery::Webhook { .. } => {
                let app = outbox::confirm::webhook::router(CONFIRM_PATH, store);
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
                let url = format!("http://{}{CONFIRM_PATH}", listener.local_addr()?);
                let cancel = cancel.clone();
                let server = tokio::spawn(async move {
                    axum::serve(listener, app)
                        .with_graceful_shutdown(cancel.cancelled_owned())
                        .await
                        .context("confirmation endpoint failed")
                });
                Ok((url, server))
            }
            Delivery::Nats { js, .. } => {
                let listen = outbox::confirm::nats::listen(
                    js.client(),
                    CONFIRM_SUBJECT.into(),
                    CONFIRM_QUEUE.into(),
                    store,
                    cancel.clone(),
                );
                // A confirmation published before the subscription reaches the server is lost
                // like any other; the check-back recovers it.
                let task = tokio::spawn(async move {
                    listen
                        .await
                        .map(|_| ())
                        .context("cannot subscribe to the confirmation subject")
                });
                Ok((CONFIRM_SUBJECT.into(), task))
            }
            #[cfg(feature = "redis")]
            Delivery::Redis { url, .. } => {
                let mut config = outbox::confirm::redis::RedisListenConfig::new(
                    url.clone(),
                    REDIS_CONFIRM_STREAM,
                );
                config.group = CONFIRM_QUEUE.into();
                config.consumer = "order-service".into();
                let listen = outbox::confirm::redis::listen(config, store, cancel.clone());
                let task = tokio::spawn(async move {
                    listen
                        .await
                        .map(|_| ())
                        .context("cannot read the confirmation stream")
                });
                Ok((REDIS_CONFIRM_STREAM.into(), task))
            }
            #[cfg(feature = "mqtt")]
            Delivery::Mqtt { url, run, .. } => {
                let mut config =
                    outbox::confirm::mqtt::MqttListenConfig::new(url.clone(), MQTT_CONFIRM_TOPIC);
                config.group = format!("{CONFIRM_QUEUE}-{run}");
                config.client_id = format!("demo-order-service-{run}");
                config.session_expiry = Duration::from_secs(60);
                // Subscribed before the consumer can confirm: the session is open when this
                // returns its first poll, so start it and give it its own task.
                let listen = outbox::confirm::mqtt::listen(config, store, cancel.clone());
                let task = tokio::spawn(async move {
                    listen
                        .await
                        .map(|_| ())
                        .context("cannot subscribe to the confirmation topic")
                });
                Ok((MQTT_CONFIRM_TOPIC.into(), task))
            }
            #[cfg(feature = "rocketmq")]
            Delivery::RocketMq(r) => {
                let reply = format!("{}:order-service", r.confirm_topic);
                let mut config = outbox::confirm::rocketmq::ListenConfig::new(
                    r.name_server.clone(),
                    reply.clone(),
                    format!("{CONFIRM_QUEUE}_{}", r.run),
                );
                config.route_refresh = Duration::from_secs(10);
                let listen = outbox::confirm::rocketmq::listen(config, store, cancel.clone());
                let task = tokio::spawn(async move {
                    listen
                        .await
                        .map(|_| ())
                        .context("RocketMQ confirmation listener failed")
                });
                Ok((reply, task))
            }
            #[cfg(feature = "rabbitmq")]
            Delivery::RabbitMq { config } => {
                let listen = outbox::confirm::rabbitmq::listen(
                    config.clone(),
                    RABBIT_CONFIRM_QUEUE.into(),
                    store,
                    cancel.clone(),
                );
                let task = tokio::spawn(async move {
                    listen
                        .await
                        .map(|_| ())
                        .context("RabbitMQ confirmation listener failed")
                });
                Ok((RABBIT_CONFIRM_QUEUE.into(), task))
            }
            #[cfg(feature = "kafka")]
            Delivery::Kafka { config, run, .. } => {
                let topic = format!("{run}.confirmations");
                let listen = outbox::confirm::kafka::listen(
                    (**config).clone(),
                    topic.clone(),
                    format!("{run}.{CONFIRM_QUEUE}"),
                    store,
                    cancel.clone(),
                );
                let task = tokio::spawn(async move {
                    listen
                        .await
                        .map(|_| ())
                        .context("the Kafka confirmation listener failed")
                });
                Ok((topic, task))
            }
        }
    }

    /// The consumer side's confirmation sender for this delivery.
    fn confirmation_sender(&self) -> Arc<dyn ConfirmationSender> {
        match self {
            Delivery::Webhook { .. } => Arc::new(WebhookConfirmationSender::new()),
            Delivery::Nats { js, .. } => Arc::new(NatsConfirmationSender::new(js.client())),
            #[cfg(feature = "redis")]
            Delivery::Redis { transport, .. } => Arc::new(
                outbox::confirm::redis::RedisConfirmationSender::new(transport.connection()),
            ),
            #[cfg(feature = "mqtt")]
            Delivery::Mqtt { sender, .. } => sender.clone(),
            #[cfg(feature = "rocketmq")]
            Delivery::RocketMq(r) => r.sender.clone(),
            #[cfg(feature = "rabbitmq")]
            Delivery::RabbitMq { config } => Arc::new(
                outbox::confirm::rabbitmq::RabbitMqConfirmationSender::new(config.clone())
                    .expect("validated at open"),
            ),
            #[cfg(feature = "kafka")]
            Delivery::Kafka { sender, .. } => sender.clone(),
        }
    }

    /// Start the inventory service's receiver, confirming through `confirmations`; it runs until
    /// `cancel`.
    async fn start_consumer<DB, H>(
        &self,
        inbox: Inbox<DB>,
        handler: Arc<H>,
        confirmations: Arc<dyn ConfirmationSender>,
        metrics: Arc<ConsumerMetrics>,
        cancel: &CancellationToken,
    ) -> anyhow::Result<(Endpoint, Vec<ServiceTask>)>
    where
        DB: InboxBackend,
        H: outbox::Handler<DB>,
    {
        match self {
            Delivery::Webhook { secret } => {
                let path = "/inventory/order-events";
                let policy = DeliveryPolicy {
                    confirmations: Some(confirmations),
                    ..DeliveryPolicy::default()
                };
                let app = outbox::consumer::webhook::router_with(
                    path,
                    inbox.clone(),
                    handler.clone(),
                    Some(secret),
                    metrics.clone(),
                    policy.clone(),
                )?;
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
                let url = format!("http://{}{path}", listener.local_addr()?);
                let server_cancel = cancel.clone();
                let server = tokio::spawn(async move {
                    axum::serve(listener, app)
                        .with_graceful_shutdown(server_cancel.cancelled_owned())
                        .await
                        .context("webhook server failed")
                });
                // Beside the server, as a webhook receiver should run it: operator replays of
                // dead letters (none expected here) and inbox retention (kept for the report).
                let maintenance = tokio::spawn(outbox::consumer::maintenance(
                    inbox,
                    handler,
                    policy,
                    None,
                    Duration::from_secs(2),
                    metrics,
                    cancel.clone(),
                ));
                let maintenance =
                    tokio::spawn(async move { maintenance.await.context("maintenance panicked") });
                Ok((Some(url), vec![server, maintenance]))
            }
            Delivery::Nats { js, .. } => {
                let mut config = NatsConsumerConfig::new(NATS_STREAM, CONSUMER)
                    .with_confirmations(confirmations);
                config.dedup_window = None;
                // Create the durable once, so the runners below do not race to create it.
                js.get_stream(NATS_STREAM)
                    .await?
                    .get_or_create_consumer(
                        CONSUMER,
                        async_nats::jetstream::consumer::pull::Config {
                            durable_name: Some(CONSUMER.into()),
                            ack_policy: async_nats::jetstream::consumer::AckPolicy::Explicit,
                            ack_wait: config.ack_wait,
                            max_ack_pending: 10_000,
                            ..Default::default()
                        },
                    )
                    .await
                    .context("cannot create the JetStream consumer")?;
                // Several runners share the durable, as instances of one service would.
                let runners = (0..4)
                    .map(|_| {
                        let run = outbox::consumer::nats::run(
                            (**js).clone(),
                            config.clone(),
                            inbox.clone(),
                            handler.clone(),
                            metrics.clone(),
                            cancel.clone(),
                        );
                        tokio::spawn(async move { run.await.context("NATS consumer failed") })
                    })
                    .collect();
                Ok((None, runners))
            }
            #[cfg(feature = "redis")]
            Delivery::Redis { url, .. } => {
                let mut config = outbox::consumer::redis::RedisConsumerConfig::new(
                    url.clone(),
                    REDIS_STREAM,
                    CONSUMER,
                )
                .with_confirmations(confirmations);
                config.dedup_window = None;
                config.concurrency = 4;
                // Several runners share the group, as instances of one service would.
                let runners = (0..4)
                    .map(|i| {
                        let mut config = config.clone();
                        config.consumer = format!("{CONSUMER}-{i}");
                        let run = outbox::consumer::redis::run(
                            config,
                            inbox.clone(),
                            handler.clone(),
                            metrics.clone(),
                            cancel.clone(),
                        );
                        tokio::spawn(async move { run.await.context("Redis consumer failed") })
                    })
                    .collect();
                Ok((None, runners))
            }
            #[cfg(feature = "mqtt")]
            Delivery::Mqtt { url, run, .. } => {
                let mut config = outbox::consumer::mqtt::MqttConsumerConfig::new(
                    url.clone(),
                    "",
                    "demo/orders/#",
                )
                .with_confirmations(confirmations);
                config.group = Some(format!("{CONSUMER}-{run}"));
                config.session_expiry = Duration::from_secs(60);
                config.dedup_window = None;
                config.concurrency = 4;
                let runners = (0..4)
                    .map(|i| {
                        let mut config = config.clone();
                        config.client_id = format!("demo-{CONSUMER}-{run}-{i}");
                        let run = outbox::consumer::mqtt::run(
                            config,
                            inbox.clone(),
                            handler.clone(),
                            metrics.clone(),
                            cancel.clone(),
                        );
                        tokio::spawn(async move { run.await.context("MQTT consumer failed") })
                    })
                    .collect();
                Ok((None, runners))
            }
            #[cfg(feature = "rocketmq")]
            Delivery::RocketMq(r) => {
                let mut config = outbox::consumer::rocketmq::RocketMqConsumerConfig::new(
                    r.name_server.clone(),
                    format!("{CONSUMER}_{}", r.run),
                    r.orders_topic.clone(),
                )
                .with_confirmations(confirmations);
                config.dedup_window = None;
                config.batch = 32;
                config.concurrency = 8;
                config.route_refresh = Duration::from_secs(10);
                // Two instances of the group share the topic's queues, as instances of one
                // service would.
                let runners = (0..2)
                    .map(|_| {
                        let run = outbox::consumer::rocketmq::run(
                            config.clone(),
                            inbox.clone(),
                            handler.clone(),
                            metrics.clone(),
                            cancel.clone(),
                        );
                        tokio::spawn(async move { run.await.context("RocketMQ consumer failed") })
                    })
                    .collect();
                Ok((None, runners))
            }
            #[cfg(feature = "rabbitmq")]
            Delivery::RabbitMq { config } => {
                let mut config = outbox::consumer::rabbitmq::RabbitMqConsumerConfig::new(
                    config.clone(),
                    RABBIT_QUEUE,
                )
                .with_confirmations(confirmations);
                config.dedup_window = None;
                config.concurrency = 1;
                // Two instances of the service share the queue (competing consumers).
                let runners = (0..4)
                    .map(|_| {
                        let run = outbox::consumer::rabbitmq::run(
                            config.clone(),
                            inbox.clone(),
                            handler.clone(),
                            metrics.clone(),
                            cancel.clone(),
                        );
                        tokio::spawn(async move { run.await.context("RabbitMQ consumer failed") })
                    })
                    .collect();
                Ok((None, runners))
            }
            #[cfg(feature = "kafka")]
            Delivery::Kafka { config, run, .. } => {
                let mut consumer = outbox::consumer::kafka::KafkaConsumerConfig::new(
                    (**config).clone(),
                    format!("{run}.{CONSUMER}"),
                    [format!("{run}.{TOPIC}"), format!("{run}.{CANCELLED_TOPIC}")],
                )
                .with_confirmations(confirmations);
                consumer.dedup_window = None;
                consumer.concurrency = 4;
                // The broker minimum, so a new group starts quickly (Tansu holds a new group's
                // first join for about half the session timeout).
                consumer.session_timeout = Duration::from_secs(6);
                // Two members of the group share the partitions, as instances of one service
                // would; each applies its batches in 4 lanes by partition key.
                let runners = (0..2)
                    .map(|_| {
                        let run = outbox::consumer::kafka::run(
                            consumer.clone(),
                            inbox.clone(),
                            handler.clone(),
                            metrics.clone(),
                            cancel.clone(),
                        );
                        tokio::spawn(async move { run.await.context("Kafka consumer failed") })
                    })
                    .collect();
                Ok((None, runners))
            }
        }
    }

    /// A fresh transport for one relay incarnation, and its route destination.
    async fn transport(&self, endpoint: &Endpoint) -> anyhow::Result<(Arc<dyn Transport>, String)> {
        match self {
            Delivery::Webhook { secret } => {
                let url = endpoint.clone().context("webhook receiver not started")?;
                let mut config = WebhookConfig::new(url);
                config.secret = Some(secret.clone());
                config.timeout = Duration::from_secs(1);
                // Empty destination: post to the configured URL.
                Ok((Arc::new(WebhookTransport::new(config)?), String::new()))
            }
            Delivery::Nats { url, .. } => {
                let mut config = NatsConfig::new(url.clone());
                config.ack_timeout = Duration::from_secs(1);
                let transport = NatsTransport::connect(config).await?;
                Ok((Arc::new(transport), "demo.orders.{topic}".into()))
            }
            #[cfg(feature = "redis")]
            Delivery::Redis { url, .. } => {
                let mut config = outbox::RedisConfig::new(url.clone());
                config.response_timeout = Duration::from_secs(1);
                let transport = outbox::RedisTransport::connect(config).await?;
                Ok((Arc::new(transport), REDIS_STREAM.into()))
            }
            #[cfg(feature = "mqtt")]
            Delivery::Mqtt { url, .. } => {
                let mut config = outbox::MqttConfig::new(url.clone());
                config.ack_timeout = Duration::from_secs(1);
                let transport = outbox::MqttTransport::connect(config).await?;
                Ok((Arc::new(transport), MQTT_TOPICS.into()))
            }
            #[cfg(feature = "rocketmq")]
            Delivery::RocketMq(r) => {
                let mut config = outbox::RocketMqConfig::new(r.name_server.clone());
                config.producer_group = format!("demo_order_relay_{}", r.run);
                config.send_timeout = Duration::from_secs(1);
                let transport = outbox::RocketMqTransport::connect(config).await?;
                Ok((Arc::new(transport), format!("{}:{{topic}}", r.orders_topic)))
            }
            #[cfg(feature = "rabbitmq")]
            Delivery::RabbitMq { config } => {
                let transport = outbox::RabbitMqTransport::connect(config.clone()).await?;
                Ok((Arc::new(transport), format!("{RABBIT_EXCHANGE}/{{topic}}")))
            }
            #[cfg(feature = "kafka")]
            Delivery::Kafka { config, run, .. } => {
                let transport = KafkaTransport::connect((**config).clone()).await?;
                Ok((Arc::new(transport), format!("{run}.{{topic}}")))
            }
        }
    }
}

/// Make the RabbitMQ variant's topology fresh, so runs are independent: the topic exchange
/// [`RABBIT_EXCHANGE`], the queues [`RABBIT_QUEUE`] (bound with `#`, its retry queues deleted) and
/// [`RABBIT_CONFIRM_QUEUE`], deleted and declared again.
#[cfg(feature = "rabbitmq")]
async fn rabbitmq_fresh_queues(url: &str) -> anyhow::Result<()> {
    use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
    use lapin::types::FieldTable;
    let conn = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
        .await
        .with_context(|| format!("cannot connect to RabbitMQ at {}", crate::redact(url)))?;
    let ch = conn.create_channel().await?;
    ch.exchange_declare(
        RABBIT_EXCHANGE.into(),
        lapin::ExchangeKind::Topic,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .with_context(|| format!("cannot declare the exchange {RABBIT_EXCHANGE}"))?;
    let mut stale = vec![RABBIT_QUEUE.to_owned(), RABBIT_CONFIRM_QUEUE.to_owned()];
    for ms in [
        10u64, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 20_000, 50_000, 100_000,
    ] {
        stale.push(outbox::consumer::rabbitmq::retry_queue(
            RABBIT_QUEUE,
            Duration::from_millis(ms),
        ));
    }
    for q in &stale {
        ch.queue_delete(q.as_str().into(), Default::default())
            .await
            .with_context(|| format!("cannot delete the queue {q}"))?;
    }
    for q in [RABBIT_QUEUE, RABBIT_CONFIRM_QUEUE] {
        ch.queue_declare(
            q.into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .with_context(|| format!("cannot declare the queue {q}"))?;
    }
    ch.queue_bind(
        RABBIT_QUEUE.into(),
        RABBIT_EXCHANGE.into(),
        "#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    let _ = conn.close(200, "demo set up".into()).await;
    Ok(())
}

/// Starts, kills and restarts the embedded relay.
struct RelaySupervisor<'a> {
    store: Arc<dyn Store>,
    delivery: &'a Delivery,
    endpoint: &'a Endpoint,
    faults: Faults,
    fault_stats: Arc<FaultStats>,
    /// Confirmation policy of the `order-created` route.
    confirm: ConfirmPolicy,
    /// Check-backs before an unconfirmed message is dead-lettered.
    max_check_backs: u32,
    current: Option<RelayHandle>,
    metrics: Vec<Arc<RelayMetrics>>,
}

impl RelaySupervisor<'_> {
    /// Start a new relay incarnation (a fresh transport, as after a process restart).
    async fn start(&mut self) -> anyhow::Result<()> {
        let (transport, destination) = self.delivery.transport(self.endpoint).await?;
        let faulty: Arc<dyn Transport> = Arc::new(FaultyTransport {
            inner: transport,
            faults: self.faults,
            stats: self.fault_stats.clone(),
        });
        let config = RelayConfig {
            name: format!("demo-relay-{}", self.metrics.len() + 1),
            batch_size: 100,
            lease: Duration::from_secs(3),
            publish_timeout: Duration::from_secs(1),
            poll_interval: Duration::from_millis(500),
            max_attempts: 50,
            backoff: Backoff {
                base: Duration::from_millis(100),
                factor: 2.0,
                max: Duration::from_secs(2),
                jitter: 0.2,
            },
            maintenance_interval: Duration::from_secs(1),
            in_flight_batches: 4,
            max_check_backs: self.max_check_backs,
            // Keep every finished row: the report reads them.
            retention: None,
            ..RelayConfig::default()
        };
        // Orders need the consumer's verdict; cancellations are plain notifications (SENT is
        // final) over the same faulty transport.
        let router = Router::new()
            .route_confirmed(
                TOPIC,
                faulty.clone(),
                destination.clone(),
                self.confirm.clone(),
            )
            .route(CANCELLED_TOPIC, faulty, destination);
        let relay = Relay::builder(self.store.clone())
            .router(router)
            .config(config)
            .build()?;
        self.metrics.push(relay.metrics().clone());
        self.current = Some(relay.spawn());
        Ok(())
    }

    /// Crash the relay (claimed rows stay SENDING until their lease expires) and start another.
    async fn kill_and_restart(&mut self) -> anyhow::Result<()> {
        if let Some(relay) = self.current.take() {
            relay.abort();
        }
        self.start().await
    }

    /// Stop the relay gracefully.
    async fn shutdown(&mut self) -> anyhow::Result<()> {
        if let Some(relay) = self.current.take() {
            relay.shutdown().await?;
        }
        Ok(())
    }
}

/// Three progress bars: orders placed, orders processed by the consumer (deducted or refused),
/// verdicts confirmed back to the order service.
struct Bars {
    placed: ProgressBar,
    processed: ProgressBar,
    verdicts: ProgressBar,
    _multi: MultiProgress,
}

impl Bars {
    fn new(orders: usize) -> Bars {
        let multi = MultiProgress::new();
        let style = ProgressStyle::with_template(
            "{prefix:>18} [{bar:40.cyan/blue}] {pos:>6}/{len} [{elapsed}] {msg}",
        )
        .expect("valid template")
        .progress_chars("=> ");
        let bar = |name: &str| {
            let b = multi.add(ProgressBar::new(orders as u64));
            b.set_style(style.clone());
            b.set_prefix(name.to_owned());
            b
        };
        Bars {
            placed: bar("orders placed"),
            processed: bar("orders processed"),
            verdicts: bar("verdicts confirmed"),
            _multi: multi,
        }
    }

    fn update(&self, placed: usize, processed: u64, verdicts: u64, kills: usize, planned: usize) {
        self.placed.set_position(placed as u64);
        self.processed.set_position(processed);
        self.processed
            .set_message(format!("relay kills {kills}/{planned}"));
        self.verdicts.set_position(verdicts);
    }

    fn finish(&self) {
        self.placed.finish();
        self.processed.finish();
        self.verdicts.finish();
    }
}

/// How one order ended, from the order service's and the inventory service's records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// Deducted once, its `order-created` message CONFIRMED, the order still PLACED.
    DeductedAndConfirmed,
    /// Nothing deducted, its message REJECTED, the order CANCELLED, one `order-cancelled` event.
    Cancelled,
    /// Anything else: a broken promise.
    InBetween,
}

/// The end-of-run figures and checks.
struct Report {
    orders: usize,
    statuses: BTreeMap<Status, u64>,
    attempts: i64,
    deductions: usize,
    duplicates: u64,
    consumer_failures: u64,
    consumer_rejected: u64,
    consumer_dead_letters: u64,
    confirmations_sent: u64,
    confirmation_failures: u64,
    confirmed: usize,
    rejected: usize,
    cancelled: usize,
    cancellation_events: usize,
    oversized: usize,
    lost: Vec<i64>,
    applied_twice: Vec<i64>,
    in_between: Vec<(i64, String)>,
    refused_but_fit: Vec<i64>,
    stock_problems: Vec<String>,
    units_deducted: i64,
    faults: [u64; 5],
    relay: outbox::MetricsSnapshot,
    kills: usize,
    latency: hdrhistogram::Histogram<u64>,
    verdict_latency: hdrhistogram::Histogram<u64>,
    elapsed: Duration,
}

impl Report {
    async fn gather(
        services: &Services,
        timeline: &Timeline,
        consumer: &ConsumerMetrics,
        faults: &FaultStats,
        relays: &[Arc<RelayMetrics>],
        kills: usize,
        elapsed: Duration,
    ) -> anyhow::Result<Report> {
        let orders = services.orders().await?;
        let deductions = services.deductions().await?;
        let stock = services.stock().await?;
        let rows = services.outbox_rows().await?;
        let initial = initial_stock(orders.len());

        let mut per_order: HashMap<i64, usize> = HashMap::new();
        let mut deducted: HashMap<&str, i64> = HashMap::new();
        for (order_id, sku, qty) in &deductions {
            *per_order.entry(*order_id).or_default() += 1;
            *deducted.entry(sku.as_str()).or_default() += qty;
        }
        // The outbox rows of each order, by partition key: its order-created statuses and its
        // order-cancelled events.
        let mut created: HashMap<i64, Vec<Status>> = HashMap::new();
        let mut cancel_events: HashMap<i64, usize> = HashMap::new();
        for (topic, key, status) in &rows {
            let Some(id) = key.as_deref().and_then(|k| k.parse::<i64>().ok()) else {
                continue;
            };
            let status = i16::try_from(*status)
                .ok()
                .and_then(Status::from_i16)
                .with_context(|| format!("unknown outbox status {status}"))?;
            match topic.as_str() {
                TOPIC => created.entry(id).or_default().push(status),
                CANCELLED_TOPIC => *cancel_events.entry(id).or_default() += 1,
                _ => {}
            }
        }

        let mut ordered: HashMap<&str, i64> = HashMap::new();
        let (mut lost, mut applied_twice, mut in_between, mut refused_but_fit) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut confirmed, mut rejected, mut cancelled, mut oversized) = (0, 0, 0, 0);
        for (id, sku, qty, status) in &orders {
            let n_deducted = per_order.get(id).copied().unwrap_or(0);
            let message = match created.get(id).map(Vec::as_slice) {
                Some([s]) => Some(*s),
                _ => None,
            };
            let events = cancel_events.get(id).copied().unwrap_or(0);
            let ending = match (message, status.as_str(), n_deducted, events) {
                (Some(Status::Confirmed), PLACED, 1, 0) => Ending::DeductedAndConfirmed,
                (Some(Status::Rejected), CANCELLED, 0, 1) => Ending::Cancelled,
                _ => Ending::InBetween,
            };
            match ending {
                Ending::DeductedAndConfirmed => confirmed += 1,
                Ending::Cancelled => {
                    rejected += 1;
                    cancelled += 1;
                }
                Ending::InBetween => in_between.push((
                    *id,
                    format!(
                        "order {id}: message {}, order {status}, {n_deducted} deductions, {events} cancellation events",
                        match created.get(id) {
                            None => "missing".to_owned(),
                            Some(v) => v.iter().map(|s| s.to_string()).collect::<Vec<_>>().join("+"),
                        }
                    ),
                )),
            }
            if status != CANCELLED {
                *ordered.entry(sku.as_str()).or_default() += qty;
            }
            let too_big = *qty > initial;
            oversized += usize::from(too_big);
            if ending == Ending::Cancelled && !too_big {
                refused_but_fit.push(*id);
            }
            match n_deducted {
                0 if status != CANCELLED => lost.push(*id),
                0 | 1 => {}
                _ => applied_twice.push(*id),
            }
        }
        lost.sort_unstable();
        applied_twice.sort_unstable();
        in_between.sort_unstable();
        refused_but_fit.sort_unstable();

        // Stock: initial − now = deducted = ordered by orders not cancelled, per SKU, and never
        // negative.
        let mut stock_problems = Vec::new();
        for (sku, now) in &stock {
            let gone = initial - now;
            let d = deducted.get(sku.as_str()).copied().unwrap_or(0);
            let o = ordered.get(sku.as_str()).copied().unwrap_or(0);
            if gone != d || d != o || *now < 0 {
                stock_problems.push(format!(
                    "{sku}: stock fell by {gone}, deduction log says {d}, orders not cancelled say {o}, now {now}"
                ));
            }
        }
        if stock.len() != SKUS.len() {
            stock_problems.push(format!(
                "{} stock rows, expected {}",
                stock.len(),
                SKUS.len()
            ));
        }

        let mut relay = outbox::MetricsSnapshot::default();
        for m in relays {
            let s = m.snapshot();
            relay.claimed += s.claimed;
            relay.sent += s.sent;
            relay.retried += s.retried;
            relay.failed += s.failed;
            relay.released += s.released;
            relay.lost_leases += s.lost_leases;
            relay.stale_batches += s.stale_batches;
            relay.checked_back += s.checked_back;
            relay.purged += s.purged;
            relay.store_errors += s.store_errors;
            relay.outages += s.outages;
            relay.held_back += s.held_back;
            relay.buckets_acquired += s.buckets_acquired;
            relay.takeovers += s.takeovers;
            relay.buckets_lost += s.buckets_lost;
            relay.buckets_released += s.buckets_released;
            relay.completion_writes += s.completion_writes;
        }
        let mut verdict_latency = hdrhistogram::Histogram::<u64>::new(3)?;
        for us in services.verdict_latencies().await? {
            verdict_latency.record(us.max(1) as u64)?;
        }
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Ok(Report {
            orders: orders.len(),
            statuses: services.store().stats().await?.counts,
            attempts: services.publish_attempts().await?,
            deductions: deductions.len(),
            duplicates: load(&consumer.duplicates),
            consumer_failures: load(&consumer.failures),
            consumer_rejected: load(&consumer.rejected),
            consumer_dead_letters: load(&consumer.dead_lettered),
            confirmations_sent: load(&consumer.confirmations_sent),
            confirmation_failures: load(&consumer.confirmation_failures),
            confirmed,
            rejected,
            cancelled,
            cancellation_events: cancel_events.values().sum(),
            oversized,
            lost,
            applied_twice,
            in_between,
            refused_but_fit,
            stock_problems,
            units_deducted: deducted.values().sum(),
            faults: [
                load(&faults.lost_before),
                load(&faults.acks_lost),
                load(&faults.duplicated),
                load(&faults.copies_sent),
                load(&faults.confirmations_lost),
            ],
            relay,
            kills,
            latency: timeline.latencies()?,
            verdict_latency,
            elapsed,
        })
    }

    fn print(&self, delivery: &Delivery) {
        let ms = |h: &hdrhistogram::Histogram<u64>, q: f64| h.value_at_quantile(q) as f64 / 1000.0;
        let latency = |h: &hdrhistogram::Histogram<u64>| {
            format!(
                "p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms, max {:.1} ms ({} samples)",
                ms(h, 0.5),
                ms(h, 0.9),
                ms(h, 0.99),
                h.max() as f64 / 1000.0,
                h.len()
            )
        };
        let statuses: Vec<String> = self
            .statuses
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(s, n)| format!("{s} {n}"))
            .collect();
        let [
            lost_before,
            acks_lost,
            duplicated,
            copies,
            confirmations_lost,
        ] = self.faults;
        let check = |ok: bool| if ok { "ok" } else { "FAILED" };
        let ids = |v: &[i64]| {
            if v.is_empty() {
                String::new()
            } else {
                let shown: Vec<String> = v.iter().take(10).map(i64::to_string).collect();
                format!(
                    "  (orders {}{})",
                    shown.join(", "),
                    if v.len() > 10 { ", ..." } else { "" }
                )
            }
        };
        let failed = self.statuses.get(&Status::Failed).copied().unwrap_or(0);
        println!();
        println!("== outbox demo report ==");
        println!("orders placed              {:>10}", self.orders);
        println!("outbox rows by status      {:>10}", statuses.join(", "));
        println!(
            "publish attempts           {:>10}  ({:.2} per order)",
            self.attempts,
            self.attempts as f64 / self.orders.max(1) as f64
        );
        println!(
            "faults injected            {:>10}  lost before consumer {lost_before}, acks lost {acks_lost}, duplicated {duplicated}, confirmations lost {confirmations_lost}",
            lost_before + acks_lost + duplicated + confirmations_lost
        );
        println!("copies handed to transport {copies:>10}");
        println!(
            "relay kills                {:>10}  (buckets taken over after lease expiry {}, lost leases {}, retries {}, dead letters {})",
            self.kills,
            self.relay.takeovers,
            self.relay.lost_leases,
            self.relay.retried,
            self.relay.failed
        );
        println!(
            "deductions                 {:>10}  ({} units)",
            self.deductions, self.units_deducted
        );
        println!(
            "refused by inventory       {:>10}  (insufficient stock; {} orders asked for more than the stock holds)",
            self.consumer_rejected, self.oversized
        );
        println!(
            "duplicates absorbed (inbox){:>10}{}",
            self.duplicates,
            match delivery {
                Delivery::Nats { .. } =>
                    "  (JetStream's duplicate window drops quick re-publishes of a message id first)",
                Delivery::Webhook { .. } => "",
                #[cfg(feature = "redis")]
                Delivery::Redis { .. } => "",
                #[cfg(feature = "mqtt")]
                Delivery::Mqtt { .. } => "",
                #[cfg(feature = "rocketmq")]
                Delivery::RocketMq(_) =>
                    "  (RocketMQ keeps every re-publish: each copy is recognised by the inbox)",
                #[cfg(feature = "rabbitmq")]
                Delivery::RabbitMq { .. } =>
                    "  (RabbitMQ keeps every re-published copy; the inbox absorbs them)",
                #[cfg(feature = "kafka")]
                Delivery::Kafka { .. } => "",
            }
        );
        if self.consumer_failures > 0 || self.consumer_dead_letters > 0 {
            println!(
                "consumer failures (retried){:>10}  (dead-lettered by the consumer {})",
                self.consumer_failures, self.consumer_dead_letters
            );
        }
        println!(
            "confirmations sent         {:>10}  (of them lost on the way {confirmations_lost}; send failures {})",
            self.confirmations_sent, self.confirmation_failures
        );
        println!(
            "checked back               {:>10}  (unconfirmed past the deadline, published again)",
            self.relay.checked_back
        );
        println!("confirmed                  {:>10}", self.confirmed);
        println!("rejected                   {:>10}", self.rejected);
        println!(
            "cancelled                  {:>10}  ({} order-cancelled events enqueued by the rejection hook)",
            self.cancelled, self.cancellation_events
        );
        println!(
            "ended in between           {:>10}  {}{}",
            self.in_between.len(),
            check(self.in_between.is_empty()),
            if self.in_between.is_empty() {
                "  every order DEDUCTED-and-CONFIRMED or CANCELLED".to_owned()
            } else {
                let shown: Vec<&str> = self
                    .in_between
                    .iter()
                    .take(5)
                    .map(|(_, why)| why.as_str())
                    .collect();
                format!(
                    "  ({}{})",
                    shown.join("; "),
                    if self.in_between.len() > 5 {
                        "; ..."
                    } else {
                        ""
                    }
                )
            }
        );
        println!(
            "refused though stock fit   {:>10}  {}{}",
            self.refused_but_fit.len(),
            check(self.refused_but_fit.is_empty()),
            ids(&self.refused_but_fit)
        );
        println!(
            "dead letters (FAILED)      {:>10}  {}",
            failed,
            check(failed == 0)
        );
        println!(
            "lost                       {:>10}  {}{}",
            self.lost.len(),
            check(self.lost.is_empty()),
            ids(&self.lost)
        );
        println!(
            "applied twice              {:>10}  {}{}",
            self.applied_twice.len(),
            check(self.applied_twice.is_empty()),
            ids(&self.applied_twice)
        );
        println!(
            "stock consistency          {:>10}  {}",
            check(self.stock_problems.is_empty()),
            if self.stock_problems.is_empty() {
                "initial - final = deducted = ordered by orders not cancelled, for every SKU"
                    .to_owned()
            } else {
                self.stock_problems.join("; ")
            }
        );
        println!("commit-to-effect latency   {}", latency(&self.latency));
        println!(
            "commit-to-verdict latency  {}",
            latency(&self.verdict_latency)
        );
        println!(
            "elapsed                    {:>9.1}s  ({:.0} orders/s end to end)",
            self.elapsed.as_secs_f64(),
            self.orders as f64 / self.elapsed.as_secs_f64()
        );
    }

    /// `Ok` when every promise held.
    fn verdict(&self) -> anyhow::Result<()> {
        ensure!(
            self.lost.is_empty(),
            "{} orders never took effect",
            self.lost.len()
        );
        ensure!(
            self.applied_twice.is_empty(),
            "{} orders took effect more than once",
            self.applied_twice.len()
        );
        ensure!(
            self.in_between.is_empty(),
            "{} orders ended neither DEDUCTED-and-CONFIRMED nor CANCELLED",
            self.in_between.len()
        );
        ensure!(
            self.refused_but_fit.is_empty(),
            "{} orders were cancelled although the stock covered them",
            self.refused_but_fit.len()
        );
        let failed = self.statuses.get(&Status::Failed).copied().unwrap_or(0);
        ensure!(failed == 0, "{failed} outbox messages were dead-lettered");
        ensure!(
            self.stock_problems.is_empty(),
            "stock is inconsistent: {}",
            self.stock_problems.join("; ")
        );
        Ok(())
    }
}
