//! `outbox demo --two-phase`: two-phase (half) messages with a barrier check-back, for an order
//! service whose orders live in **another database** than its outbox (docs/two-phase.md).
//!
//! The order service keeps its orders in the orders database (`--orders-database`: a second
//! SQLite file by default, or PostgreSQL or MySQL/MariaDB) and its outbox in the outbox database
//! (`--database`: a SQLite file by default, or PostgreSQL or MySQL/MariaDB), so no local
//! transaction can hold both the order and its message. Each order is placed in three steps:
//!
//! 1. [`TwoPhase::prepare`] writes the `order-created` message as a PREPARED row in the outbox,
//!    with an HTTP check-back to the order service's barrier endpoint
//!    ([`Barrier::router`], served by the demo on 127.0.0.1), due about a second later;
//! 2. the business transaction, in the orders database, inserts the order and marks the
//!    message id in the barrier table ([`Barrier::mark`]), then commits;
//! 3. [`TwoPhase::commit_prepared`] hands the message to the relay (PENDING).
//!
//! Producers fail on purpose, drawn per order from a fixed seed: 10 % crash between the prepare
//! and the business transaction (no order, no decision: the check-back must answer ROLLBACK),
//! 10 % crash between the business commit and `commit_prepared` (the check-back must answer
//! COMMIT), and 5 % of business transactions roll back (half of those producers then call
//! [`TwoPhase::rollback_prepared`], the other half crash and leave it to the check-back). A
//! producer whose business transaction comes after the check-back already decided finds its
//! mark refused ([`BarrierError::Decided`]) and rolls back.
//!
//! An embedded relay with a fast check-back policy publishes the committed messages over the
//! `--transport` of the main demo to a consumer ([`outbox::Inbox`] on a third SQLite file) that
//! records each message it applies. At the end the demo checks the promise of the two-phase
//! protocol: every order whose business transaction committed has its message published and
//! applied exactly once; every prepared message without a committed order is ROLLED_BACK and
//! never delivered; nothing is left PREPARED or UNDECIDED. A broken check is an error
//! (non-zero exit).

mod databases;
mod report;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::ensure;
use outbox::two_phase::{CheckBack, CheckBackPolicy, DecideError, Decided, TwoPhase};
use outbox::{NewMessage, Relay, RelayConfig, Router, Status, Store};
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::delivery::{Delivery, serve};
use super::{DemoArgs, TICK, TOPIC};

/// The outbox table (on a server database it may share with other demos, hence the prefix).
use databases::*;
use report::*;
const OUTBOX_TABLE: &str = "demo_2pc_outbox";
/// The orders table in the orders database.
const ORDERS_TABLE: &str = "demo_2pc_orders";
/// The barrier table in the orders database.
const BARRIER_TABLE: &str = "demo_2pc_barrier";
/// The consumer's inbox table (in its own SQLite file).
const INBOX_TABLE: &str = "inbox";
/// The consumer's record of the messages it applied: one row per applied message, no unique
/// key, so an order applied twice would show as two rows.
const RECEIVED_TABLE: &str = "received";
/// SQLite file of the outbox when `--database` is not given.
const OUTBOX_FILE: &str = "outbox-2pc.db";
/// SQLite file of the orders when `--orders-database` is not given.
const ORDERS_FILE: &str = "orders-2pc.db";
/// SQLite file of the consumer (its inbox and its record of received messages).
const CONSUMER_FILE: &str = "consumer-2pc.db";
/// Path of the barrier's HTTP check-back endpoint.
const CHECK_BACK_PATH: &str = "/check-back";
/// Delay from a prepare to its first check-back.
const CHECK_AFTER: Duration = Duration::from_secs(1);
/// Seed of the faults drawn per order: every run injects the same faults into the same orders.
const SEED: u64 = 0x2bc_0016;
/// Share of producers that crash between the prepare and the business transaction.
const CRASH_BEFORE_BUSINESS: f64 = 0.10;
/// Share of producers that crash between the business commit and `commit_prepared`.
const CRASH_AFTER_BUSINESS: f64 = 0.10;
/// Share of business transactions that roll back (half of their producers then crash).
const BUSINESS_ROLLBACK: f64 = 0.05;
/// How often a progress line is printed while the run goes on.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// The payload of an `order-created` message.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct OrderCreated {
    /// The order number, from 1.
    order_id: i64,
}

/// What the producer of one order does, drawn per order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// Prepare, business commit, `commit_prepared`.
    Normal,
    /// Prepare, then crash: no business transaction, no decision.
    CrashBeforeBusiness,
    /// Prepare, business commit, then crash before `commit_prepared`.
    CrashAfterBusiness,
    /// Prepare, business rollback, `rollback_prepared`.
    RollbackThenDecide,
    /// Prepare, business rollback, then crash before `rollback_prepared`.
    RollbackThenCrash,
}

impl Fate {
    /// The fates of `orders` orders, drawn from [`SEED`].
    fn draw(orders: usize) -> Vec<Fate> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(SEED);
        (0..orders)
            .map(|_| {
                let x: f64 = rng.random();
                if x < CRASH_BEFORE_BUSINESS {
                    Fate::CrashBeforeBusiness
                } else if x < CRASH_BEFORE_BUSINESS + CRASH_AFTER_BUSINESS {
                    Fate::CrashAfterBusiness
                } else if x < CRASH_BEFORE_BUSINESS + CRASH_AFTER_BUSINESS + BUSINESS_ROLLBACK {
                    if rng.random_bool(0.5) {
                        Fate::RollbackThenDecide
                    } else {
                        Fate::RollbackThenCrash
                    }
                } else {
                    Fate::Normal
                }
            })
            .collect()
    }
}

/// How an order's business transaction ended, as its producer saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Business {
    /// Not run: the producer crashed after the prepare.
    NotRun,
    /// Committed: the order and its barrier mark are in the orders database.
    Committed,
    /// Rolled back on purpose.
    RolledBack,
    /// Refused by the barrier: a check-back had decided ROLLBACK first, the transaction rolled
    /// back.
    Refused,
}

/// What the producer's own decision call returned.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Decision {
    /// No call: the producer crashed, or the barrier had decided already.
    NotCalled,
    /// `commit_prepared` or `rollback_prepared` returned this.
    Done(Decided),
    /// The call failed on the database: left to the check-back (not a broken promise).
    Failed(String),
    /// The call found the opposite decision taken, the row missing or corrupt: a broken
    /// promise.
    Refused(String),
}

/// One order as its producer placed it.
#[derive(Debug, Clone)]
struct Attempt {
    /// The order number.
    order_id: i64,
    /// The faults drawn for it.
    fate: Fate,
    /// The prepared message's id.
    message_id: Uuid,
    /// How the business transaction ended.
    business: Business,
    /// The producer's decision call.
    decision: Decision,
}

/// What each producer shares: where to prepare, where to run the business transaction, whom
/// the check-back asks, and the faults drawn.
struct Producer {
    /// The outbox.
    store: Arc<dyn Store>,
    /// The orders database.
    orders: OrdersDb,
    /// The check-back every message names.
    check_back: CheckBack,
    /// The fate of order `n` at index `n - 1`.
    fates: Vec<Fate>,
    /// The next order number to place.
    next: AtomicUsize,
    /// The orders whose producer is done (crashed included), as each ended.
    attempts: Mutex<Vec<Attempt>>,
}

impl Producer {
    /// Place order `order_id` through the three steps, with its faults.
    async fn place(&self, order_id: i64, fate: Fate) -> anyhow::Result<Attempt> {
        let message = NewMessage::json(TOPIC, &OrderCreated { order_id })?
            .with_partition_key(order_id.to_string());
        let message_id = self.store.prepare(message, &self.check_back).await?;
        let mut attempt = Attempt {
            order_id,
            fate,
            message_id,
            business: Business::NotRun,
            decision: Decision::NotCalled,
        };
        if fate == Fate::CrashBeforeBusiness {
            return Ok(attempt);
        }
        let commit = matches!(fate, Fate::Normal | Fate::CrashAfterBusiness);
        attempt.business = self.orders.place(order_id, message_id, commit).await?;
        let decided = match (attempt.business, fate) {
            (Business::Committed, Fate::CrashAfterBusiness)
            | (Business::RolledBack, Fate::RollbackThenCrash)
            | (Business::Refused | Business::NotRun, _) => return Ok(attempt),
            (Business::Committed, _) => self.store.commit_prepared(message_id).await,
            (Business::RolledBack, _) => self.store.rollback_prepared(message_id).await,
        };
        attempt.decision = match decided {
            Ok(d) => Decision::Done(d),
            Err(DecideError::Store(e)) => Decision::Failed(e.report().to_string()),
            Err(e) => Decision::Refused(e.to_string()),
        };
        Ok(attempt)
    }

    /// The orders done so far.
    fn done(&self) -> usize {
        self.attempts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }
}

/// Start `clients` producers placing every order between them, each recorded in
/// [`Producer::attempts`] as it ends.
fn spawn_producers(producer: &Arc<Producer>, clients: usize) -> JoinSet<anyhow::Result<()>> {
    let mut set = JoinSet::new();
    for _ in 0..clients {
        let producer = producer.clone();
        set.spawn(async move {
            loop {
                let n = producer.next.fetch_add(1, Ordering::Relaxed);
                let Some(&fate) = producer.fates.get(n.wrapping_sub(1)) else {
                    return Ok(());
                };
                let attempt = producer.place(n as i64, fate).await?;
                producer
                    .attempts
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(attempt);
            }
        });
    }
    set
}

/// Run the two-phase demo; a broken check is an error (non-zero exit).
pub(super) async fn run(args: &DemoArgs) -> anyhow::Result<()> {
    ensure!(args.orders > 0, "--orders must be at least 1");
    ensure!(args.clients > 0, "--clients must be at least 1");
    let started = Instant::now();
    let store = open_outbox(args).await?;
    let orders = OrdersDb::open(args).await?;
    let consumer = ConsumerDb::open(&args.data_dir).await?;
    let delivery = Delivery::open(args.transport.as_deref()).await?;
    let cancel = CancellationToken::new();

    println!(
        "outbox demo --two-phase: {} orders from {} clients; orders and outbox in different \
         databases, decided by prepare + barrier + check-back",
        args.orders, args.clients
    );
    println!("orders:   {}", orders.describe(args));
    println!("outbox:   {}", describe_outbox(args));
    println!(
        "consumer: SQLite {} (inbox, {RECEIVED_TABLE}), over {}",
        args.data_dir.join(CONSUMER_FILE).display(),
        describe_delivery(args)
    );
    println!(
        "faults: {:.0}% of producers crash after prepare, {:.0}% after their business commit; \
         {:.0}% of business transactions roll back (half of their producers then crash); \
         first check-back {} after prepare",
        CRASH_BEFORE_BUSINESS * 100.0,
        CRASH_AFTER_BUSINESS * 100.0,
        BUSINESS_ROLLBACK * 100.0,
        humantime::format_duration(CHECK_AFTER)
    );

    // The order service's barrier endpoint, then the consumer, then the relay.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let check_back_url = format!("http://{}{CHECK_BACK_PATH}", listener.local_addr()?);
    let mut tasks = vec![serve(
        listener,
        orders.check_back_router()?,
        &cancel,
        "check-back endpoint failed",
    )];
    let (endpoint, consumer_tasks) = delivery
        .start_consumer(
            consumer.inbox.clone(),
            consumer.recorder.clone(),
            delivery.confirmation_sender(),
            consumer.metrics.clone(),
            usize::from(args.inbox_batch),
            &cancel,
        )
        .await?;
    tasks.extend(consumer_tasks);
    let (transport, destination) = delivery.transport(&endpoint).await?;
    let config = RelayConfig {
        check_back: CheckBackPolicy {
            poll_interval: Duration::from_millis(100),
            interval: Duration::from_millis(500),
            error_backoff: Duration::from_millis(100),
            error_backoff_max: Duration::from_secs(1),
            ..CheckBackPolicy::default()
        },
        ..super::faults::demo_relay_config("demo-2pc-relay".into())
    };
    let relay = Relay::builder(store.clone())
        .router(Router::new().route(TOPIC, transport, destination))
        .config(config)
        .build()?;
    let relay_metrics = relay.metrics().clone();
    let relay = relay.spawn();

    let producer = Arc::new(Producer {
        store: store.clone(),
        orders: orders.clone(),
        check_back: CheckBack::http(&check_back_url)?.after(CHECK_AFTER),
        fates: Fate::draw(args.orders),
        next: AtomicUsize::new(1),
        attempts: Mutex::new(Vec::with_capacity(args.orders)),
    });
    let mut clients = spawn_producers(&producer, args.clients);

    // Wait until every producer is done, every prepared message decided, every committed one
    // published, and the consumer has applied every published one.
    let deadline = started + args.timeout;
    let mut tick = tokio::time::interval(TICK);
    let mut next_progress = Instant::now() + PROGRESS_EVERY;
    let drained = loop {
        tick.tick().await;
        super::reap_clients(&mut clients, "a producer")?;
        let progress = Instant::now() >= next_progress;
        if clients.is_empty() || progress {
            let stats = store.stats().await?;
            let count = |s| stats.counts.get(&s).copied().unwrap_or(0);
            let received = consumer.distinct_received().await?;
            if progress {
                next_progress += PROGRESS_EVERY;
                println!(
                    "  {:>6.1}s  producers done {}/{}, outbox: prepared {}, pending {}, sent {}, \
                     rolled back {}; applied by the consumer {received}",
                    started.elapsed().as_secs_f64(),
                    producer.done(),
                    args.orders,
                    count(Status::Prepared),
                    count(Status::Pending) + count(Status::Sending),
                    count(Status::Sent),
                    count(Status::RolledBack),
                );
            }
            if clients.is_empty()
                && count(Status::Prepared) == 0
                && count(Status::Pending) == 0
                && count(Status::Sending) == 0
                && received >= count(Status::Sent)
            {
                break true;
            }
        }
        if Instant::now() >= deadline {
            break false;
        }
    };
    clients.abort_all();
    let attempts =
        std::mem::take(&mut *producer.attempts.lock().unwrap_or_else(|e| e.into_inner()));
    let elapsed = started.elapsed();
    relay.shutdown().await?;
    super::stop_services(&cancel, tasks).await?;

    let report = Report::gather(
        &store,
        &orders,
        &consumer,
        attempts,
        args.orders,
        relay_metrics.snapshot(),
        elapsed,
    )
    .await?;
    report.print();
    super::conclude(drained, args.timeout, " (see the report above)", || {
        report.verdict()
    })
}

/// The outbox database, for the banner.
fn describe_outbox(args: &DemoArgs) -> String {
    match &args.database {
        None => format!(
            "SQLite {} (table {OUTBOX_TABLE})",
            args.data_dir.join(OUTBOX_FILE).display()
        ),
        Some(url) => format!("{} (table {OUTBOX_TABLE})", crate::redact(url)),
    }
}

/// The delivery, for the banner (no confirmations in this mode).
fn describe_delivery(args: &DemoArgs) -> String {
    match args.transport.as_deref() {
        None | Some("webhook") => "signed webhooks (in-process axum receiver)".into(),
        Some(url) => crate::redact(url),
    }
}
