//! Maintenance: check-back of unconfirmed messages and purge past retention.

use super::*;

/// Maintenance, on every relay, each step one bounded conditional statement so relays never
/// do the same work twice: check back unconfirmed messages past their deadline, and delete
/// finished rows past the retention period. A step that fills a whole
/// batch runs again at once.
pub(super) async fn maintenance_loop(relay: Relay, cancel: CancellationToken) {
    let inner = &relay.inner;
    let cfg = &inner.config;
    let mut failures = 0u32;
    let mut full = false;
    loop {
        let wait = if failures > 0 {
            cfg.probe_backoff.delay(failures)
        } else if full {
            Duration::ZERO
        } else {
            cfg.maintenance_interval
        };
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
        let limit = cfg.batch_size;
        let steps = async {
            let checked = inner.store.check_back(limit, cfg.max_check_backs).await?;
            let purged = match cfg.retention {
                Some(r) => inner.store.purge_finished(r, limit).await?,
                None => 0,
            };
            Ok::<_, StoreError>((checked, purged))
        };
        match steps.await {
            Ok((checked, purged)) => {
                failures = 0;
                full = [checked, purged].iter().any(|n| *n >= u64::from(limit));
                if checked > 0 {
                    add(&inner.metrics.checked_back, checked);
                    tracing::info!(rows = checked, "checked back unconfirmed messages");
                }
                if purged > 0 {
                    add(&inner.metrics.purged, purged);
                    tracing::debug!(rows = purged, "purged finished rows past retention");
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
