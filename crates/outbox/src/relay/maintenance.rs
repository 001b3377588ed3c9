//! Maintenance: check-back of unconfirmed messages, and retention (delete or archive finished
//! rows, [`crate::retention`]).

use super::*;
use crate::retention::{Finished, RetentionAction};

/// Maintenance. On every relay: check back unconfirmed messages past their deadline (one
/// bounded conditional statement, so relays never do the same work twice). On the relay that
/// holds bucket 0 only: retention, one bounded transaction per finished state with a rule, and
/// one for the archive. A step that fills a whole batch runs again at once.
pub(super) async fn maintenance_loop(relay: Relay, cancel: CancellationToken) {
    let inner = &relay.inner;
    let cfg = &inner.config;
    let mut failures = 0u32;
    let mut full = false;
    loop {
        if !pause(cfg, failures, full, cfg.maintenance_interval, &cancel).await {
            return;
        }
        let limit = cfg.batch_size;
        let steps = async {
            let checked = inner.store.check_back(limit, cfg.max_check_backs).await?;
            let (purged, archived, any_full) = if relay.runs_retention() {
                retention(inner, limit).await?
            } else {
                (0, 0, false)
            };
            Ok::<_, StoreError>((checked, purged, archived, any_full))
        };
        match steps.await {
            Ok((checked, purged, archived, any_full)) => {
                failures = 0;
                full = any_full || checked >= u64::from(limit);
                if checked > 0 {
                    add(&inner.metrics.checked_back, checked);
                    tracing::info!(rows = checked, "checked back unconfirmed messages");
                }
                if purged > 0 {
                    add(&inner.metrics.purged, purged);
                    tracing::debug!(rows = purged, "deleted finished rows past retention");
                }
                if archived > 0 {
                    add(&inner.metrics.archived, archived);
                    tracing::debug!(rows = archived, "archived finished rows past retention");
                }
                if checked > 0 {
                    inner.store.wake();
                }
            }
            Err(e) => {
                failures += 1;
                inner.metrics.store_error(&e);
                tracing::warn!(error = %e.report(), "relay maintenance failed");
            }
        }
    }
}

/// One retention round: a transaction per finished state with a rule, then the archive's.
/// Returns the rows deleted, the rows archived, and whether any transaction was full (more to
/// do).
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
async fn retention(inner: &Inner, limit: u32) -> Result<(u64, u64, bool), StoreError> {
    let r = &inner.config.retention;
    let chunk = u64::from(limit).min(crate::admin_model::ACTION_CHUNK as u64);
    let (mut purged, mut archived, mut full) = (0, 0, false);
    // A partitioned table: whole day partitions instead of rows.
    if let Some(round) = inner.store.retire_partitions(r).await? {
        purged += round.deleted;
        archived += round.archived;
        if round.carried > 0 {
            tracing::info!(
                rows = round.carried,
                "carried rows that must stay out of a partition past retention"
            );
        }
    } else {
        for state in Finished::ALL {
            let rule = r.rule(state);
            let Some(after) = rule.after else { continue };
            let n = inner.store.retire(state, after, rule.action, limit).await?;
            full |= n >= chunk;
            match rule.action {
                RetentionAction::Delete => purged += n,
                RetentionAction::Archive => archived += n,
            }
        }
    }
    if let Some(after) = r.archived {
        let n = inner.store.purge_archive(after, limit).await?;
        full |= n >= chunk;
        purged += n;
    }
    Ok((purged, archived, full))
}

/// Without a database feature there is no store to apply retention to.
#[cfg(not(any(feature = "postgres", feature = "mysql", feature = "sqlite")))]
async fn retention(_: &Inner, _: u32) -> Result<(u64, u64, bool), StoreError> {
    Ok((0, 0, false))
}
