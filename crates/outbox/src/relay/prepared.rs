//! Check-back of two-phase messages ([`crate::two_phase`]): the due PREPARED rows of the buckets
//! this relay holds are asked about, concurrently and each bounded by the policy's timeout, and
//! each answer is written fenced by its bucket's lease, so one row is checked by one relay at a
//! time and a relay that lost the bucket writes nothing.

use super::*;
use crate::message::Status;
use crate::store::FencedRow;
use crate::two_phase::{Answer, CheckResult, CheckUpdate, DuePrepared};

/// The loop: every `check_back.poll_interval` (at once again after a full round), one round;
/// store errors back off with `probe_backoff`.
pub(super) async fn prepared_loop(relay: Relay, cancel: CancellationToken) {
    let inner = &relay.inner;
    let policy = &inner.config.check_back;
    let limit = inner.config.batch_size;
    let mut failures = 0u32;
    let mut full = false;
    loop {
        if !pause(&inner.config, failures, full, policy.poll_interval, &cancel).await {
            return;
        }
        // Cancelled mid-round (shutdown, or the relay dropped): the round is dropped with its
        // checks in flight; what they did not write yet is asked again by the bucket's owner.
        let result = tokio::select! {
            _ = cancel.cancelled() => return,
            r = round(&relay, limit) => r,
        };
        match result {
            Ok(n) => {
                failures = 0;
                full = n >= limit as usize;
            }
            Err(e) => {
                failures += 1;
                inner.metrics.store_error(&e);
                tracing::warn!(error = %e.report(), "check-back of prepared messages failed");
            }
        }
    }
}

/// One round: read the due rows of the held buckets, park malformed ones, ask the rest. The
/// rows read.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
async fn round(relay: &Relay, limit: u32) -> Result<usize, StoreError> {
    use crate::two_phase::TwoPhase;
    use futures::StreamExt;
    let inner = &relay.inner;
    let policy = &inner.config.check_back;
    // Buckets held now; membership renews them meanwhile, and the write after an answer is
    // fenced by the lease as it is then (a bucket lost meanwhile writes nothing; its new owner
    // asks again).
    let leases: BTreeMap<Bucket, LeaseToken> =
        relay.held_leases(Instant::now()).into_iter().collect();
    if leases.is_empty() {
        return Ok(0);
    }
    let buckets: Vec<Bucket> = leases.keys().copied().collect();
    let batch = inner.store.due_prepared(&buckets, limit).await?;
    let read = batch.due.len() + batch.malformed.len();
    let relay_name = inner.config.name.as_str();
    for (id, bucket, reason) in batch.malformed {
        let update = CheckUpdate {
            status: Status::Undecided,
            checks: 0,
            errors: 0,
            delay: Duration::ZERO,
            note: Some(format!("undecided: malformed prepared row: {reason}")),
        };
        // Read from held buckets only; a bucket lost meanwhile is left to its new owner.
        let Some(&token) = leases.get(&bucket) else {
            continue;
        };
        let row = FencedRow {
            relay: relay_name,
            id,
            bucket,
            token,
        };
        if inner.store.record_check(row, &update).await? {
            add(&inner.metrics.prepared_undecided, 1);
            tracing::warn!(id, reason, "malformed prepared row parked as UNDECIDED");
        }
    }
    let leases = &leases;
    let results: Vec<Result<(), StoreError>> = futures::stream::iter(batch.due)
        .map(|row| async move {
            let result = ask(inner, &row).await;
            let update = crate::two_phase::next(&row, &result, policy);
            let Some(&token) = leases.get(&row.bucket) else {
                return Ok(());
            };
            let fenced = FencedRow {
                relay: relay_name,
                id: row.request.id,
                bucket: row.bucket,
                token,
            };
            let written = inner.store.record_check(fenced, &update).await?;
            if written {
                count(inner, &row, &result, &update);
            }
            Ok(())
        })
        .buffer_unordered(policy.concurrency)
        .collect()
        .await;
    results.into_iter().collect::<Result<Vec<()>, _>>()?;
    Ok(read)
}

/// Without a database feature there is no store with prepared rows.
#[cfg(not(any(feature = "postgres", feature = "mysql", feature = "sqlite")))]
async fn round(_: &Relay, _: u32) -> Result<usize, StoreError> {
    Ok(0)
}

/// Ask `row`'s check-back: its hook or its URL, bounded by the timeout; a panicking hook is an
/// error like any other.
async fn ask(inner: &Inner, row: &DuePrepared) -> CheckResult {
    use futures::FutureExt;
    let policy = &inner.config.check_back;
    let asked: futures::future::BoxFuture<'_, Result<Answer, String>> =
        match row.target.strip_prefix("hook:") {
            Some(name) => match inner.check_back_hooks.get(name) {
                Some(hook) => {
                    async move { hook.check(&row.request).await.map_err(|e| e.to_string()) }.boxed()
                }
                None => {
                    return CheckResult::Error(format!(
                        "no check-back hook {name:?} is registered on relay {}",
                        inner.config.name
                    ));
                }
            },
            None => http(inner, row),
        };
    match tokio::time::timeout(
        policy.timeout,
        std::panic::AssertUnwindSafe(asked).catch_unwind(),
    )
    .await
    {
        Err(_) => CheckResult::Error(format!("no answer within {:?}", policy.timeout)),
        Ok(Err(panic)) => CheckResult::Error(format!(
            "the check-back panicked: {}",
            panic_message(&panic)
        )),
        Ok(Ok(Err(e))) => CheckResult::Error(e),
        Ok(Ok(Ok(answer))) => CheckResult::Answered(answer),
    }
}

#[cfg(feature = "webhook")]
fn http<'a>(
    inner: &'a Inner,
    row: &'a DuePrepared,
) -> futures::future::BoxFuture<'a, Result<Answer, String>> {
    use futures::FutureExt;
    inner.http_checker.check(&row.target, &row.request).boxed()
}

#[cfg(not(feature = "webhook"))]
fn http<'a>(
    _: &'a Inner,
    _: &'a DuePrepared,
) -> futures::future::BoxFuture<'a, Result<Answer, String>> {
    use futures::FutureExt;
    async { Err("HTTP check-backs need the `webhook` feature".to_owned()) }.boxed()
}

/// Count and log a written result.
fn count(inner: &Inner, row: &DuePrepared, result: &CheckResult, update: &CheckUpdate) {
    let m = &inner.metrics;
    let message_id = row.request.message_id;
    match result {
        CheckResult::Answered(Answer::Commit) => add(&m.prepared_committed, 1),
        CheckResult::Answered(Answer::Rollback) => add(&m.prepared_rolled_back, 1),
        CheckResult::Answered(Answer::Unknown) => add(&m.prepared_unknown, 1),
        CheckResult::Error(e) => {
            add(&m.prepared_check_errors, 1);
            if row.errors == 0 {
                tracing::warn!(%message_id, error = %e, "check-back of a prepared message failed (not counted; asked again with backoff)");
            } else {
                tracing::debug!(%message_id, errors = update.errors, error = %e, "check-back failed again");
            }
        }
    }
    match update.status {
        Status::Pending => {
            tracing::info!(%message_id, "prepared message committed by its check-back");
            inner.store.wake();
        }
        Status::RolledBack => {
            tracing::info!(%message_id, "prepared message rolled back by its check-back")
        }
        Status::Undecided => {
            add(&m.prepared_undecided, 1);
            tracing::warn!(%message_id, checks = update.checks, note = update.note.as_deref().unwrap_or(""), "prepared message parked as UNDECIDED");
        }
        _ => {}
    }
}
