//! Model-based test of the store's state machine (STYLE.md "Tests"; vector tests its disk buffer
//! the same way): random sequences of enqueue with commit or rollback, claims by two relays,
//! completions with current and stale fencing tokens, lease expiry and reaping, checked after
//! every step against a model. Invariants: nothing committed is lost, nothing rolled back is ever
//! visible, a completion applies only under the current lease token, and every row is in exactly
//! the state the protocol says.
//!
//! Confirmations are part of the model: SENT with a confirmation deadline, check-back of expired
//! deadlines (back to PENDING, then FAILED `unconfirmed`), and consumer confirmations (processed
//! or rejected, duplicates and unknown ids).
//!
//! Runs on SQLite (a temp file); the conformance suite in `outbox-testkit` covers PostgreSQL.

use std::collections::BTreeMap;
use std::time::Duration;

use outbox::{
    ClaimRequest, Completion, NewMessage, Outcome, SqliteStore, Status, Store, StoreOptions,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Debug, Clone, PartialEq)]
struct Row {
    status: Status,
    attempts: u32,
    token: Option<i64>,
    due: bool,
    lease_short: bool,
    message_id: uuid::Uuid,
    /// `Some(expired)` while SENT awaiting a confirmation.
    confirm: Option<bool>,
    check_backs: u32,
}

const MAX_ATTEMPTS: u32 = 3;
const MAX_CHECK_BACKS: u32 = 2;

async fn check(store: &SqliteStore, model: &BTreeMap<i64, Row>, step: usize, seed: u64) {
    type State = (Status, u32, Option<i64>, u32, bool);
    let rows: Vec<(i64, i64, i64, Option<i64>, i64, bool)> = sqlx::query_as(
        "SELECT id, status, attempts, lease_token, check_backs, confirm_deadline IS NOT NULL \
         FROM outbox ORDER BY id",
    )
    .fetch_all(store.pool())
    .await
    .unwrap();
    let actual: BTreeMap<i64, State> = rows
        .into_iter()
        .map(|(id, s, a, t, c, d)| {
            (
                id,
                (
                    Status::from_i16(s as i16).unwrap(),
                    a as u32,
                    t,
                    c as u32,
                    d,
                ),
            )
        })
        .collect();
    let expected: BTreeMap<i64, State> = model
        .iter()
        .map(|(id, r)| {
            (
                *id,
                (
                    r.status,
                    r.attempts,
                    r.token,
                    r.check_backs,
                    r.confirm.is_some(),
                ),
            )
        })
        .collect();
    assert_eq!(
        actual, expected,
        "seed {seed} step {step}: database differs from the model"
    );
}

async fn run(seed: u64, steps: usize) {
    let mut rng = StdRng::seed_from_u64(seed);
    let dir = std::env::temp_dir().join(format!("outbox-model-{seed}-{}", rand::random::<u32>()));
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}", dir.join("model.db").display());
    let store = SqliteStore::connect(&url, StoreOptions::default())
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let mut model: BTreeMap<i64, Row> = BTreeMap::new();
    let mut claims: Vec<(i64, Vec<i64>)> = Vec::new();

    for step in 0..steps {
        match rng.random_range(0..100) {
            // Enqueue 1..4 messages in one transaction, commit or roll back.
            0..=24 => {
                let n = rng.random_range(1..=4);
                let commit = rng.random_bool(0.7);
                let mut tx = store.pool().begin().await.unwrap();
                for _ in 0..n {
                    store
                        .enqueue(&mut tx, NewMessage::new("t", vec![1, 2, 3]))
                        .await
                        .unwrap();
                }
                if commit {
                    tx.commit().await.unwrap();
                } else {
                    tx.rollback().await.unwrap();
                }
                let ids: Vec<(i64, String)> =
                    sqlx::query_as("SELECT id, message_id FROM outbox ORDER BY id")
                        .fetch_all(store.pool())
                        .await
                        .unwrap();
                for (id, message_id) in ids {
                    if let std::collections::btree_map::Entry::Vacant(e) = model.entry(id) {
                        assert!(
                            commit,
                            "seed {seed} step {step}: a rolled-back message is visible"
                        );
                        e.insert(Row {
                            status: Status::Pending,
                            attempts: 0,
                            token: None,
                            due: true,
                            lease_short: false,
                            message_id: message_id.parse().unwrap(),
                            confirm: None,
                            check_backs: 0,
                        });
                    }
                }
            }
            // Claim by one of two relays, with a long or an already-expiring lease.
            25..=49 => {
                let batch = rng.random_range(1..=5);
                let short = rng.random_bool(0.3);
                let req = ClaimRequest {
                    owner: format!("r{}", rng.random_range(1..=2)),
                    batch_size: batch,
                    lease: if short {
                        Duration::from_millis(1)
                    } else {
                        Duration::from_secs(3600)
                    },
                };
                let claim = store.claim(&req).await.unwrap();
                let due = model
                    .values()
                    .filter(|r| r.status == Status::Pending && r.due)
                    .count();
                assert_eq!(
                    claim.messages.len(),
                    due.min(batch as usize),
                    "seed {seed} step {step}: claim size"
                );
                for m in &claim.messages {
                    let r = model.get_mut(&m.id).expect("claimed row is in the model");
                    assert!(
                        r.status == Status::Pending && r.due,
                        "seed {seed} step {step}: claimed a row that was {r:?}"
                    );
                    r.status = Status::Sending;
                    r.attempts += 1;
                    r.token = Some(claim.token);
                    r.lease_short = short;
                    assert_eq!(m.attempts, r.attempts);
                }
                claims.push((claim.token, claim.messages.iter().map(|m| m.id).collect()));
            }
            // Complete part of a past claim (possibly stale) with random outcomes.
            50..=74 if !claims.is_empty() => {
                let (token, ids) = claims[rng.random_range(0..claims.len())].clone();
                let mut completions = Vec::new();
                let mut expected_matches = 0;
                for id in ids {
                    if !rng.random_bool(0.8) {
                        continue;
                    }
                    let outcome = match rng.random_range(0..5) {
                        0 => Outcome::Sent,
                        4 => Outcome::SentAwaitingConfirmation {
                            within: if rng.random_bool(0.5) {
                                Duration::from_millis(1)
                            } else {
                                Duration::from_secs(3600)
                            },
                        },
                        1 => Outcome::Retry {
                            delay: if rng.random_bool(0.5) {
                                Duration::ZERO
                            } else {
                                Duration::from_secs(3600)
                            },
                            error: "boom".into(),
                        },
                        2 => Outcome::Failed {
                            reason: "poison".into(),
                        },
                        _ => Outcome::Release {
                            delay: Duration::ZERO,
                        },
                    };
                    let r = model.get_mut(&id).unwrap();
                    if matches!(r.status, Status::Confirmed | Status::Rejected)
                        && r.token == Some(token)
                    {
                        // Confirmed while SENDING: the completion matches, clears the lease and
                        // keeps the verdict.
                        expected_matches += 1;
                        r.token = None;
                    } else if r.status == Status::Sending && r.token == Some(token) {
                        expected_matches += 1;
                        r.token = None;
                        match &outcome {
                            Outcome::Sent => r.status = Status::Sent,
                            Outcome::SentAwaitingConfirmation { within } => {
                                r.status = Status::Sent;
                                r.confirm = Some(*within < Duration::from_secs(1));
                            }
                            Outcome::Retry { delay, .. } => {
                                r.status = Status::Pending;
                                r.due = delay.is_zero();
                            }
                            Outcome::Failed { .. } => r.status = Status::Failed,
                            Outcome::Release { .. } => {
                                r.status = Status::Pending;
                                r.attempts -= 1;
                                r.due = true;
                            }
                        }
                    }
                    completions.push(Completion { id, outcome });
                }
                let matched = store.complete(token, &completions).await.unwrap();
                assert_eq!(
                    matched, expected_matches,
                    "seed {seed} step {step}: fenced completion count"
                );
            }
            // Let short confirmation deadlines pass, then check back.
            85..=91 => {
                tokio::time::sleep(Duration::from_millis(3)).await;
                let moved = store.check_back(1000, MAX_CHECK_BACKS).await.unwrap();
                let mut expected = 0;
                for r in model.values_mut() {
                    if r.status == Status::Sent && r.confirm == Some(true) {
                        expected += 1;
                        r.confirm = None;
                        r.due = true;
                        if r.check_backs >= MAX_CHECK_BACKS {
                            r.status = Status::Failed;
                        } else {
                            r.status = Status::Pending;
                            r.check_backs += 1;
                        }
                    }
                }
                assert_eq!(
                    moved, expected,
                    "seed {seed} step {step}: checked back rows"
                );
            }
            // Consumer confirmations for random messages (any state), plus an unknown id.
            92..=99 => {
                let mut batch = Vec::new();
                let mut expected = outbox::ConfirmReport::default();
                let mut seen = std::collections::HashSet::new();
                for r in model.values_mut() {
                    if !rng.random_bool(0.2) || !seen.insert(r.message_id) {
                        continue;
                    }
                    let verdict = if rng.random_bool(0.7) {
                        outbox::Verdict::Processed
                    } else {
                        outbox::Verdict::Rejected {
                            reason: "no".into(),
                        }
                    };
                    if matches!(
                        r.status,
                        Status::Pending | Status::Sending | Status::Sent | Status::Failed
                    ) {
                        r.confirm = None;
                        if verdict == outbox::Verdict::Processed {
                            expected.confirmed += 1;
                            r.status = Status::Confirmed;
                        } else {
                            expected.rejected += 1;
                            r.status = Status::Rejected;
                        }
                    } else {
                        expected.duplicates += 1;
                    }
                    batch.push(outbox::Confirmation {
                        message_id: r.message_id,
                        consumer: "c".into(),
                        verdict,
                    });
                }
                batch.push(outbox::Confirmation {
                    message_id: uuid::Uuid::now_v7(),
                    consumer: "c".into(),
                    verdict: outbox::Verdict::Processed,
                });
                expected.unknown += 1;
                let report = store.apply_confirmations(&batch).await.unwrap();
                assert_eq!(
                    report, expected,
                    "seed {seed} step {step}: confirmation report"
                );
            }
            // Let short leases expire, then reap.
            _ => {
                tokio::time::sleep(Duration::from_millis(3)).await;
                let reaped = store.reap_expired_leases(1000, MAX_ATTEMPTS).await.unwrap();
                let mut expected = 0;
                for r in model.values_mut() {
                    if r.status == Status::Sending && r.lease_short {
                        expected += 1;
                        r.token = None;
                        r.due = true;
                        r.status = if r.attempts >= MAX_ATTEMPTS {
                            Status::Failed
                        } else {
                            Status::Pending
                        };
                    }
                }
                assert_eq!(reaped, expected, "seed {seed} step {step}: reaped rows");
            }
        }
        check(&store, &model, step, seed).await;
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn store_state_machine_matches_the_model() {
    for seed in 0..12 {
        run(seed, 150).await;
    }
}
