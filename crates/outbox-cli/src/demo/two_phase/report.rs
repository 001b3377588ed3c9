//! The two-phase demo's report: its figures and the checks of the promise.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::ensure;
use outbox::admin::{MessageFilter, PageRequest};
use outbox::two_phase::Decided;
use outbox::{Status, Store};

use super::super::TOPIC;
use super::super::report::{check_mark, print_statuses};

use super::*;

/// The figures of the run and the checks' findings.
pub(super) struct Report {
    /// Orders to place.
    pub(super) orders: usize,
    /// Orders whose producer ran (prepared).
    pub(super) prepared: usize,
    /// Producers that crashed after the prepare, before the business transaction.
    pub(super) crashed_before: usize,
    /// Producers that crashed after the business commit.
    pub(super) crashed_after: usize,
    /// Business transactions that committed.
    pub(super) business_committed: usize,
    /// Business transactions rolled back on purpose.
    pub(super) business_rolled_back: usize,
    /// Business transactions whose producer then crashed.
    pub(super) rollback_then_crash: usize,
    /// Business transactions refused by the barrier (a check-back had decided first).
    pub(super) refused: usize,
    /// `commit_prepared` calls that decided.
    pub(super) committed_by_producer: u64,
    /// `rollback_prepared` calls that decided.
    pub(super) rolled_back_by_producer: u64,
    /// Producer decision calls that found it decided the same way already.
    pub(super) already: usize,
    /// Producer decision calls that failed on the database (left to the check-back).
    pub(super) decision_failures: usize,
    /// The relay's check-back counters.
    pub(super) relay: outbox::MetricsSnapshot,
    /// Outbox rows by status (whole table).
    pub(super) statuses: BTreeMap<Status, u64>,
    /// Distinct messages the consumer applied.
    pub(super) delivered: usize,
    /// Handler runs (rolled-back runs included).
    pub(super) handler_runs: u64,
    /// Duplicates the inbox absorbed.
    pub(super) duplicates: u64,
    /// How long the run took.
    pub(super) elapsed: Duration,
    /// Broken promises, each a line of the report (a few per check).
    pub(super) problems: Vec<String>,
    /// How many broken promises were found in all.
    pub(super) breaches: usize,
    /// The number of committed orders checked.
    pub(super) checked_committed: usize,
    /// The number of orders without a committed business transaction checked.
    pub(super) checked_rolled_back: usize,
}

impl Report {
    /// Read the three databases and check every order.
    pub(super) async fn gather(
        store: &Arc<dyn Store>,
        orders_db: &OrdersDb,
        consumer: &ConsumerDb,
        attempts: Vec<Attempt>,
        orders: usize,
        relay: outbox::MetricsSnapshot,
        elapsed: Duration,
    ) -> anyhow::Result<Report> {
        let stats = store.stats().await?;
        let rows = outbox_rows(store).await?;
        let business: HashMap<String, i64> = orders_db
            .orders()
            .await?
            .into_iter()
            .map(|(order, id)| (id, order))
            .collect();
        let received = consumer.received().await?;
        let handler_runs = consumer
            .recorder
            .runs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .map(|n| u64::from(*n))
            .sum();
        let count = |f: &dyn Fn(&Attempt) -> bool| attempts.iter().filter(|a| f(a)).count();
        let decided = |d: Decided, committed: bool| {
            attempts
                .iter()
                .filter(|a| {
                    a.decision == Decision::Done(d)
                        && (a.business == Business::Committed) == committed
                })
                .count() as u64
        };
        let mut report = Report {
            orders,
            prepared: attempts.len(),
            crashed_before: count(&|a| a.fate == Fate::CrashBeforeBusiness),
            crashed_after: count(&|a| {
                a.fate == Fate::CrashAfterBusiness && a.business == Business::Committed
            }),
            business_committed: count(&|a| a.business == Business::Committed),
            business_rolled_back: count(&|a| a.business == Business::RolledBack),
            rollback_then_crash: count(&|a| {
                a.fate == Fate::RollbackThenCrash && a.business == Business::RolledBack
            }),
            refused: count(&|a| a.business == Business::Refused),
            committed_by_producer: decided(Decided::Now, true),
            rolled_back_by_producer: decided(Decided::Now, false),
            already: count(&|a| a.decision == Decision::Done(Decided::Already)),
            decision_failures: count(&|a| matches!(a.decision, Decision::Failed(_))),
            relay,
            statuses: stats.counts.clone(),
            delivered: received.len(),
            handler_runs,
            duplicates: consumer.metrics.duplicates.load(Ordering::Relaxed),
            elapsed,
            problems: Vec::new(),
            breaches: 0,
            checked_committed: 0,
            checked_rolled_back: 0,
        };
        report.check(&attempts, &rows, &business, &received);
        Ok(report)
    }

    /// Check every order against the three databases; each broken promise becomes a problem.
    pub(super) fn check(
        &mut self,
        attempts: &[Attempt],
        rows: &HashMap<String, Option<Status>>,
        business: &HashMap<String, i64>,
        received: &HashMap<String, i64>,
    ) {
        let mut problems = Problems::default();
        if attempts.len() != self.orders {
            problems.push(
                "orders attempted",
                format!(
                    "{} of {} orders were placed to the end (crashes included)",
                    attempts.len(),
                    self.orders
                ),
            );
        }
        let mut prepared = HashSet::new();
        for a in attempts {
            let id = a.message_id.to_string();
            prepared.insert(id.clone());
            let status = rows.get(&id).copied().flatten();
            let applied = received.get(&id).copied().unwrap_or(0);
            let in_orders = business.get(&id).copied();
            // The producer's view and the orders database agree.
            let committed = a.business == Business::Committed;
            if committed != in_orders.is_some() {
                problems.push(
                    "business rows",
                    format!(
                        "order {}: the producer saw its business transaction {:?}, but the \
                         orders database {} it",
                        a.order_id,
                        a.business,
                        if in_orders.is_some() { "has" } else { "lacks" }
                    ),
                );
            }
            if in_orders.is_some_and(|o| o != a.order_id) {
                problems.push(
                    "business rows",
                    format!(
                        "message {id} is marked by another order than {}",
                        a.order_id
                    ),
                );
            }
            if in_orders.is_some() {
                self.checked_committed += 1;
                if status != Some(Status::Sent) || applied != 1 {
                    problems.push(
                        "committed orders published once",
                        format!(
                            "order {} committed: its message is {}, applied {applied} times",
                            a.order_id,
                            status_name(status)
                        ),
                    );
                }
            } else {
                self.checked_rolled_back += 1;
                if status != Some(Status::RolledBack) || applied != 0 {
                    problems.push(
                        "orders without a business row rolled back",
                        format!(
                            "order {} has no business row ({:?}): its message is {}, applied \
                             {applied} times",
                            a.order_id,
                            a.fate,
                            status_name(status)
                        ),
                    );
                }
            }
            if let Decision::Refused(why) = &a.decision {
                problems.push(
                    "producer decisions",
                    format!(
                        "order {}: the producer's decision was refused: {why}",
                        a.order_id
                    ),
                );
            }
        }
        for id in received.keys() {
            if !prepared.contains(id) {
                problems.push(
                    "committed orders published once",
                    format!("the consumer applied {id}, which no finished producer prepared"),
                );
            }
        }
        for id in rows.keys() {
            if !prepared.contains(id) {
                problems.push(
                    "orders attempted",
                    format!("the outbox holds {id}, which no finished producer prepared"),
                );
            }
        }
        let count = |s| self.statuses.get(&s).copied().unwrap_or(0);
        for (s, what) in [
            (Status::Prepared, "left PREPARED"),
            (Status::Undecided, "parked UNDECIDED"),
            (Status::Pending, "left PENDING"),
            (Status::Failed, "dead-lettered"),
        ] {
            if count(s) > 0 {
                problems.push(
                    "every message decided",
                    format!("{} messages {what}", count(s)),
                );
            }
        }
        // Each decision is written once, by the producer or by a check-back.
        let committed = count(Status::Pending) + count(Status::Sent);
        if self.committed_by_producer + self.relay.prepared_committed != committed {
            problems.push(
                "decisions add up",
                format!(
                    "{} committed by producers + {} by check-backs != {committed} committed rows",
                    self.committed_by_producer, self.relay.prepared_committed
                ),
            );
        }
        if self.rolled_back_by_producer + self.relay.prepared_rolled_back
            != count(Status::RolledBack)
        {
            problems.push(
                "decisions add up",
                format!(
                    "{} rolled back by producers + {} by check-backs != {} rolled-back rows",
                    self.rolled_back_by_producer,
                    self.relay.prepared_rolled_back,
                    count(Status::RolledBack)
                ),
            );
        }
        self.breaches = problems.by_check.values().map(|(n, _)| n).sum();
        self.problems = problems.lines();
    }

    /// Print the figures and the checks.
    pub(super) fn print(&self) {
        let n = |s| self.statuses.get(&s).copied().unwrap_or(0);
        let failed = |what: &str| self.problems.iter().any(|p| p.starts_with(what));
        println!();
        println!("== outbox demo --two-phase report ==");
        println!("orders attempted           {:>10}", self.orders);
        println!(
            "prepared                   {:>10}  (crashed before the business transaction {})",
            self.prepared, self.crashed_before
        );
        println!(
            "business committed         {:>10}  (crashed before commit_prepared {})",
            self.business_committed, self.crashed_after
        );
        println!(
            "business rolled back       {:>10}  (crashed before rollback_prepared {}; refused by the barrier, a check-back first {})",
            self.business_rolled_back + self.refused,
            self.rollback_then_crash,
            self.refused
        );
        println!(
            "committed by the producer  {:>10}",
            self.committed_by_producer
        );
        println!(
            "committed by check-back    {:>10}",
            self.relay.prepared_committed
        );
        println!(
            "rolled back by the producer{:>10}",
            self.rolled_back_by_producer
        );
        println!(
            "rolled back by check-back  {:>10}",
            self.relay.prepared_rolled_back
        );
        println!(
            "producer calls, no-op      {:>10}  (decided the same way by a check-back first; database failures left to the check-back {})",
            self.already, self.decision_failures
        );
        println!(
            "check-backs UNKNOWN        {:>10}  (check-backs that failed, retried and not counted: {})",
            self.relay.prepared_unknown, self.relay.prepared_check_errors
        );
        println!("undecided                  {:>10}", n(Status::Undecided));
        print_statuses(&self.statuses);
        println!(
            "published                  {:>10}  (delivered to the consumer: {} distinct, {} handler runs, {} duplicates absorbed by the inbox)",
            n(Status::Sent),
            self.delivered,
            self.handler_runs,
            self.duplicates
        );
        println!(
            "committed orders           {:>10}  {}  every one published and applied exactly once",
            self.checked_committed,
            check_mark(!failed("committed orders published once") && !failed("business rows"))
        );
        println!(
            "orders without a business row{:>8}  {}  every message ROLLED_BACK, never delivered",
            self.checked_rolled_back,
            check_mark(!failed("orders without a business row rolled back"))
        );
        println!(
            "left PREPARED/UNDECIDED    {:>10}  {}",
            n(Status::Prepared) + n(Status::Undecided),
            check_mark(!failed("every message decided"))
        );
        println!(
            "decisions                  {:>10}  {}  producer + check-back decisions = committed and rolled-back rows; no producer decision refused",
            "",
            check_mark(!failed("decisions add up") && !failed("producer decisions"))
        );
        for p in self.problems.iter().take(20) {
            println!("  FAILED {p}");
        }
        if self.problems.len() > 20 {
            println!("  ... and {} more", self.problems.len() - 20);
        }
        println!(
            "elapsed                    {:>9.1}s  ({:.0} orders/s end to end)",
            self.elapsed.as_secs_f64(),
            self.prepared as f64 / self.elapsed.as_secs_f64()
        );
    }

    /// `Ok` when every check held.
    pub(super) fn verdict(&self) -> anyhow::Result<()> {
        ensure!(
            self.problems.is_empty(),
            "the two-phase promise broke {} times, first: {}",
            self.breaches,
            self.problems[0]
        );
        Ok(())
    }
}

/// Broken promises by check, each with a bounded list of examples.
#[derive(Default)]
pub(super) struct Problems {
    /// Per check: how many broke it, and the first few.
    pub(super) by_check: BTreeMap<&'static str, (usize, Vec<String>)>,
}

impl Problems {
    /// Record one breach of `check`.
    pub(super) fn push(&mut self, check: &'static str, what: String) {
        let (n, shown) = self.by_check.entry(check).or_default();
        *n += 1;
        if shown.len() < 5 {
            shown.push(what);
        }
    }

    /// One line per breach shown, each starting with its check's name, and a count of those
    /// not shown.
    pub(super) fn lines(self) -> Vec<String> {
        let mut lines = Vec::new();
        for (check, (n, shown)) in self.by_check {
            let hidden = n - shown.len();
            lines.extend(shown.into_iter().map(|w| format!("{check}: {w}")));
            if hidden > 0 {
                lines.push(format!("{check}: ... and {hidden} more"));
            }
        }
        lines
    }
}

/// The status of a row, or why there is none.
pub(super) fn status_name(status: Option<Status>) -> String {
    status.map_or_else(|| "missing from the outbox".to_owned(), |s| s.to_string())
}

/// Every `order-created` row of the outbox: message id → status, read page by page through
/// the store's search.
pub(super) async fn outbox_rows(
    store: &Arc<dyn Store>,
) -> anyhow::Result<HashMap<String, Option<Status>>> {
    let filter = MessageFilter {
        topic: Some(TOPIC.into()),
        ..MessageFilter::default()
    };
    let mut page = PageRequest {
        before: None,
        limit: outbox::admin::MAX_PAGE,
    };
    let mut rows = HashMap::new();
    loop {
        let found = store.search(&filter, &page).await?;
        rows.extend(found.messages.into_iter().map(|m| (m.message_id, m.status)));
        match found.next {
            Some(next) => page.before = Some(next),
            None => return Ok(rows),
        }
    }
}
