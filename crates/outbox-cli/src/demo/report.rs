//! The end of the run: progress bars while it runs, then the report: every order's ending read
//! from both services' records, the figures, and the checks whose failure fails the demo.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, ensure};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use outbox::consumer::ConsumerMetrics;
use outbox::{RelayMetrics, Status};

use super::delivery::Delivery;
use super::faults::FaultStats;
use super::scenario::{Timeline, initial_stock};
use super::services::Services;
use super::{CANCELLED, CANCELLED_TOPIC, PLACED, SKUS, TOPIC};

/// Three progress bars: orders placed, orders processed by the consumer (deducted or refused),
/// verdicts confirmed back to the order service.
pub(super) struct Bars {
    /// Orders placed.
    placed: ProgressBar,
    /// Orders deducted or refused by the inventory service.
    processed: ProgressBar,
    /// Verdicts confirmed back to the order service.
    verdicts: ProgressBar,
    /// Keeps the bars drawn together.
    _multi: MultiProgress,
}

impl Bars {
    /// Bars for `orders` orders.
    pub(super) fn new(orders: usize) -> Bars {
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

    /// Show the counts so far and the relay kills done of those planned.
    pub(super) fn update(
        &self,
        placed: usize,
        processed: u64,
        verdicts: u64,
        kills: usize,
        planned: usize,
    ) {
        self.placed.set_position(placed as u64);
        self.processed.set_position(processed);
        self.processed
            .set_message(format!("relay kills {kills}/{planned}"));
        self.verdicts.set_position(verdicts);
    }

    /// Leave the bars as they are.
    pub(super) fn finish(&self) {
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
pub(super) struct Report {
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
    paced_latency: hdrhistogram::Histogram<u64>,
    verdict_latency: hdrhistogram::Histogram<u64>,
    phases: Phases,
    elapsed: Duration,
}

/// Print the report's line of the outbox rows by status: each status with rows, `<STATUS>
/// <rows>`, in status order. The demo and the two-phase demo print it.
pub(super) fn print_statuses(statuses: &BTreeMap<Status, u64>) {
    let shown: Vec<String> = statuses
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(s, n)| format!("{s} {n}"))
        .collect();
    println!("outbox rows by status      {:>10}", shown.join(", "));
}

/// A check's verdict in a report: `ok` when it held, `FAILED` when not.
pub(super) fn check_mark(ok: bool) -> &'static str {
    if ok { "ok" } else { "FAILED" }
}

/// The run's two phases: the burst at full speed, then the paced phase.
#[derive(Debug, Clone, Copy)]
pub(super) struct Phases {
    /// Orders of the burst (`--orders`): numbers 1 to `burst`.
    pub(super) burst: usize,
    /// From the start to the burst drained.
    pub(super) burst_elapsed: Duration,
    /// Orders/s of the paced phase.
    pub(super) rate: f64,
    /// Orders of the paced phase (0: none), numbered after the burst's.
    pub(super) paced: usize,
    /// From the start to the end of both phases.
    pub(super) elapsed: Duration,
}

impl Report {
    /// Read both services' records and the run's counters, and check every order.
    pub(super) async fn gather(
        services: &Services,
        timeline: &Timeline,
        consumer: &ConsumerMetrics,
        faults: &FaultStats,
        relays: &[Arc<RelayMetrics>],
        kills: usize,
        phases: Phases,
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
            latency: timeline.latencies(1..phases.burst + 1)?,
            paced_latency: timeline.latencies(phases.burst + 1..phases.burst + phases.paced + 1)?,
            verdict_latency,
            elapsed: phases.elapsed,
            phases,
        })
    }

    /// Print the report.
    pub(super) fn print(&self, delivery: &Delivery) {
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
        let [
            lost_before,
            acks_lost,
            duplicated,
            copies,
            confirmations_lost,
        ] = self.faults;
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
        // A check over a list of orders: how many, ok when none, the first of them.
        let id_row = |label: &str, v: &[i64]| {
            println!(
                "{label:<27}{:>10}  {}{}",
                v.len(),
                check_mark(v.is_empty()),
                ids(v)
            );
        };
        let failed = self.statuses.get(&Status::Failed).copied().unwrap_or(0);
        println!();
        println!("== outbox demo report ==");
        println!("orders placed              {:>10}", self.orders);
        print_statuses(&self.statuses);
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
            delivery.duplicates_note()
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
            check_mark(self.in_between.is_empty()),
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
        id_row("refused though stock fit", &self.refused_but_fit);
        println!(
            "dead letters (FAILED)      {:>10}  {}",
            failed,
            check_mark(failed == 0)
        );
        id_row("lost", &self.lost);
        id_row("applied twice", &self.applied_twice);
        println!(
            "stock consistency          {:>10}  {}",
            check_mark(self.stock_problems.is_empty()),
            if self.stock_problems.is_empty() {
                "initial - final = deducted = ordered by orders not cancelled, for every SKU"
                    .to_owned()
            } else {
                self.stock_problems.join("; ")
            }
        );
        let p = &self.phases;
        println!(
            "burst                      {:>10}  orders at full speed, drained in {:.1} s: {:.0} orders/s \
             end to end",
            p.burst,
            p.burst_elapsed.as_secs_f64(),
            p.burst as f64 / p.burst_elapsed.as_secs_f64().max(1e-3)
        );
        println!(
            "  commit-to-effect latency {} (mostly queueing behind the burst)",
            latency(&self.latency)
        );
        if p.paced > 0 {
            println!(
                "paced                      {:>10}  orders at {} orders/s, after the burst drained",
                p.paced, p.rate
            );
            println!(
                "  commit-to-effect latency {} (what a user sees at this load, the injected \
                 delivery faults included)",
                latency(&self.paced_latency)
            );
        }
        println!(
            "commit-to-verdict latency  {}",
            latency(&self.verdict_latency)
        );
        println!(
            "elapsed                    {:>9.1}s  (both phases)",
            self.elapsed.as_secs_f64(),
        );
    }

    /// `Ok` when every promise held.
    pub(super) fn verdict(&self) -> anyhow::Result<()> {
        // The orders' findings, each a broken promise; the first found is the error.
        for (orders, broken) in [
            (self.lost.len(), "never took effect"),
            (self.applied_twice.len(), "took effect more than once"),
            (
                self.in_between.len(),
                "ended neither DEDUCTED-and-CONFIRMED nor CANCELLED",
            ),
            (
                self.refused_but_fit.len(),
                "were cancelled although the stock covered them",
            ),
        ] {
            ensure!(orders == 0, "{orders} orders {broken}");
        }
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
