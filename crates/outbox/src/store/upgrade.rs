//! Schema versions (which migrations a table has, whether this build knows the newest) and the
//! guard that renews a pool's connections after a server refused a write as read-only (a
//! failover, or a URL moved off a replica).

use super::*;

/// The highest migration version of `table` in `steps` (the version this build needs).
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) fn latest_version<S>(steps: &[(String, i64, S)], table: &str) -> i64 {
    steps
        .iter()
        .filter(|(t, _, _)| t == table)
        .map(|(_, v, _)| *v)
        .max()
        .unwrap_or(0)
}

/// Each table of `steps` with the highest version this build knows for it.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) fn newest_versions<S>(steps: &[(String, i64, S)]) -> BTreeMap<String, i64> {
    let mut out: BTreeMap<String, i64> = BTreeMap::new();
    for (t, v, _) in steps {
        let e = out.entry(t.clone()).or_insert(*v);
        *e = (*e).max(*v);
    }
    out
}

/// Compare the version recorded for `table` (`None`: no migration recorded) with the one this
/// build needs; `Ok(false)` when nothing is recorded (the caller decides between a missing table
/// and version 0).
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) fn compare_version(
    table: &str,
    found: Option<i64>,
    needed: i64,
) -> Result<bool, StoreError> {
    match found {
        None => Ok(false),
        Some(found) if found == needed => Ok(true),
        Some(found) => Err(StoreError::SchemaVersion {
            table: table.to_owned(),
            found,
            needed,
        }),
    }
}

/// Remembers when a server last refused a write as read-only, so that a pool built by a store's
/// `connect` closes every connection opened before that (in `before_acquire` and
/// `after_release`) and opens new ones: through DNS or a proxy they reach the server the URL
/// names now (the primary after a failover or a URL moved off a replica).
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[derive(Debug)]
pub(crate) struct ReadOnlyGuard {
    base: std::time::Instant,
    /// Milliseconds after `base` of the last refusal, plus one; 0 when none.
    marked: std::sync::atomic::AtomicU64,
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl ReadOnlyGuard {
    pub(crate) fn new() -> Arc<ReadOnlyGuard> {
        Arc::new(ReadOnlyGuard {
            base: std::time::Instant::now(),
            marked: std::sync::atomic::AtomicU64::new(0),
        })
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// A server refused a write as read-only now: connections opened until now are dropped.
    pub(crate) fn mark(&self) {
        let now = self.now_ms() + 1;
        let before = self
            .marked
            .fetch_max(now, std::sync::atomic::Ordering::AcqRel);
        if before < now {
            tracing::debug!(
                "a server refused a write as read-only; pooled connections opened before now are dropped"
            );
        }
    }

    /// Whether a pooled connection of age `age` may be used: it was opened after the last
    /// read-only refusal.
    pub(crate) fn keep(&self, age: Duration) -> bool {
        let marked = self.marked.load(std::sync::atomic::Ordering::Acquire);
        if marked == 0 {
            return true;
        }
        let age = u64::try_from(age.as_millis()).unwrap_or(u64::MAX);
        // Opened at `now - age` (ms after base, plus one to compare with `marked`).
        self.now_ms().saturating_sub(age) + 1 > marked
    }

    /// Mark when `e` is a read-only refusal; returns `e`.
    pub(crate) fn check(&self, e: StoreError) -> StoreError {
        if matches!(e, StoreError::ReadOnly { .. }) {
            self.mark();
        }
        e
    }
}
