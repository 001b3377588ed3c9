//! Model-based test of the relay protocol on each real database (issue 13, item 4; vector tests
//! its disk buffer the same way, docs/design/STYLE.md "Tests"): proptest generates sequences of
//! the calls the relay, the producers, the consumers and the operator make, runs each sequence on
//! a fresh outbox table, checks every step against an in-memory model of the protocol, and on a
//! failure shrinks the sequence to a minimal one that still fails (printed with the failure).
//!
//! The calls: producers' transactions (1 to 4 messages, with or without a partition key,
//! committed or rolled back); two relays' membership rounds (renew, acquire up to the fair share,
//! give back the excess), reads of the buckets each relay believes it holds (some keys held
//! back, as for per-key order), completions of read batches with every outcome (a taken-over
//! bucket's first batch records its attempt first, as `relay.rs` does), give-backs with current
//! or stale tokens, a relay stalled past its lease and a relay that crashes and restarts;
//! key heads; consumers' confirmations (processed, rejected, duplicates, unknown ids, also
//! overtaking a completion); check-back of expired confirmation deadlines; purging finished
//! rows; the operator's requeue of dead letters; and the clock moving on (an hour's delays and
//! deadlines pass).
//!
//! Invariants (the Promela model's, docs/lease-model.md): nothing committed is lost and nothing
//! rolled back is ever visible; a relay reads only due PENDING rows of the buckets it asks for
//! (each bucket's rows a prefix of its due rows, held-back keys left out); at most one relay
//! holds a bucket's current lease; a membership round renews exactly the live leases a relay
//! still owns and grants only free or expired buckets up to the fair share (a takeover exactly
//! for an expired owned one); a completion applies only under the bucket's current, unexpired
//! lease (no stale write); attempts never exceed `max_attempts + 1` in a round; and after every
//! step each row and bucket is in exactly the state the model says.
//!
//! Time is made, not waited for: a lease expires by moving a relay's leases and heartbeat two
//! leases into the past; the clock moves on by moving every row's timestamps two hours back.
//! Cases per database: `OUTBOX_MODEL_CASES` (default 48 on SQLite, 24 on PostgreSQL, 16 on
//! MySQL/MariaDB), up to 100 steps each.

mod case;
mod db;
mod ops;
mod state;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use outbox_testkit::{MySqlFixture, PgFixture, SqliteFixture};
use proptest::collection::vec;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

use case::Case;
use db::ModelDb;
use ops::op;
use state::Model;

pub(super) const MAX_ATTEMPTS: u32 = 3;
pub(super) const MAX_CHECK_BACKS: u32 = 2;
pub(super) const LEASE: Duration = Duration::from_secs(3600);
/// Retry delays and confirmation deadlines given by the model's completions; the clock moves
/// by two of them.
pub(super) const HOUR: Duration = Duration::from_secs(3600);
pub(super) const NAMES: [&str; 2] = ["relay-a", "relay-b"];
pub(super) const KEYS: [&str; 4] = ["k0", "k1", "k2", "k3"];

fn cases(default: u32) -> u32 {
    std::env::var("OUTBOX_MODEL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Run `cases` generated sequences, each on a fresh fixture made by `make`; a failing
/// sequence is shrunk and reported with the step that failed.
fn run<F, M, Fut>(cases: u32, make: M)
where
    F: ModelDb,
    M: Fn() -> Fut,
    Fut: Future<Output = F>,
{
    crate::init_tracing();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    let mut runner = TestRunner::new(Config {
        cases,
        max_shrink_iters: 4096,
        max_shrink_time: 300_000,
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&vec(op(), 1..=100), |ops| {
        rt.block_on(async {
            let fx = Arc::new(make().await);
            let task = tokio::spawn({
                let fx = fx.clone();
                async move {
                    let mut case = Case {
                        fx: &*fx,
                        model: Model::new(),
                    };
                    for (i, op) in ops.iter().enumerate() {
                        case.step(op, i).await;
                    }
                }
            });
            let outcome = task.await;
            fx.cleanup().await;
            match outcome {
                Ok(()) => Ok(()),
                Err(e) if e.is_panic() => {
                    let p = e.into_panic();
                    let msg = p
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                        .unwrap_or_default();
                    Err(TestCaseError::fail(msg))
                }
                Err(e) => Err(TestCaseError::fail(e.to_string())),
            }
        })
    });
    if let Err(e) = result {
        panic!("the store departs from the model: {e}");
    }
}

#[test]
fn sqlite_matches_the_model() {
    run(cases(48), SqliteFixture::new);
}

#[test]
fn postgres_matches_the_model() {
    run(cases(24), PgFixture::new);
}

#[test]
fn mysql_matches_the_model() {
    run(cases(16), MySqlFixture::new);
}
