//! Many relays in one process, one per database (or per tenant schema): [`RelayGroup`].
//!
//! Each member is opened, run and supervised on its own task with its own store (its own pool,
//! LISTEN connection, membership and bucket leases), so a database that is slow, down or
//! failing over delays only its own member: nothing is shared between members but the
//! transports of their routers (which are built to be shared: each relay keeps its own view of
//! a transport's availability). Several processes running the same group share every database
//! through its bucket leases, as single relays do (docs/scaling.md).
//!
//! A member that cannot be opened (the database is unreachable at start, its table is not
//! migrated yet) or whose relay stops (a start-up error, a panic) is opened again with backoff
//! (1 s doubling to 60 s), and meanwhile reported by [`RelayGroup::readiness`] with its error.
//! Members can be added and removed while the group runs (tenants appearing and leaving).

use std::collections::BTreeMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::FutureExt;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{Relay, RelayHealth};
use crate::error::ConfigError;
use crate::retry::Backoff;

/// What opening a member can fail with: any error, shown with its sources.
pub type OpenError = Box<dyn std::error::Error + Send + Sync>;

/// The future an opener returns: a built [`Relay`] over the member's store.
pub type OpenFuture = Pin<Box<dyn Future<Output = Result<Relay, OpenError>> + Send>>;

/// How a member is opened: connect its store, build its relay. Called again after every failure
/// (with backoff), so it must open afresh each time.
pub type Opener = Arc<dyn Fn() -> OpenFuture + Send + Sync>;

/// Backoff between attempts to open (or reopen) a member: 1 s doubling to 60 s, 20 % jitter.
pub const REOPEN_BACKOFF: Backoff = Backoff {
    base: Duration::from_secs(1),
    factor: 2.0,
    max: Duration::from_secs(60),
    jitter: 0.2,
};

/// A member that ran for this long before stopping starts its backoff over.
const STABLE_RUN: Duration = Duration::from_secs(60);

/// Where a member stands ([`RelayGroup::members`]).
#[derive(Clone)]
pub enum MemberState {
    /// Being opened, or waiting to be opened again: the number of failed attempts so far and the
    /// last error (none before the first attempt ended).
    Opening {
        /// Failed attempts since the member was added or last ran for a while.
        failures: u32,
        /// The last failure, with its sources.
        last_error: Option<String>,
    },
    /// Its relay runs.
    Running(Relay),
}

impl std::fmt::Debug for MemberState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MemberState::Opening {
                failures,
                last_error,
            } => f
                .debug_struct("Opening")
                .field("failures", failures)
                .field("last_error", last_error)
                .finish(),
            MemberState::Running(r) => f.debug_tuple("Running").field(&r.config().name).finish(),
        }
    }
}

struct Member {
    state: Arc<Mutex<MemberState>>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

struct Inner {
    members: Mutex<BTreeMap<String, Member>>,
    /// Cancelled by [`RelayGroup::shutdown`]: every member's stop token is its child.
    stop: CancellationToken,
}

/// Relays of several databases run side by side (see the module docs). Cheap to clone: clones
/// share the members.
///
/// ```no_run
/// # async fn f(router: outbox::Router) -> Result<(), Box<dyn std::error::Error>> {
/// use std::sync::Arc;
/// use outbox::relay::group::RelayGroup;
/// let group = RelayGroup::new();
/// for (name, url) in [("orders", "postgres://db1/app"), ("billing", "postgres://db2/app")] {
///     let router = router.clone();
///     group.add(name, Arc::new(move || {
///         let router = router.clone();
///         Box::pin(async move {
///             let store = outbox::store::connect_existing(url, Default::default()).await?;
///             Ok(outbox::Relay::builder(store).router(router).build()?)
///         })
///     }))?;
/// }
/// // ... on shutdown:
/// group.shutdown().await;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RelayGroup {
    inner: Arc<Inner>,
}

impl Default for RelayGroup {
    fn default() -> Self {
        RelayGroup::new()
    }
}

impl std::fmt::Debug for RelayGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayGroup")
            .field("members", &self.names())
            .finish()
    }
}

impl RelayGroup {
    /// An empty group.
    pub fn new() -> RelayGroup {
        RelayGroup {
            inner: Arc::new(Inner {
                members: Mutex::new(BTreeMap::new()),
                stop: CancellationToken::new(),
            }),
        }
    }

    /// Add member `name` (the database's name in logs, metrics and health) and start it on its
    /// own task: `open` is called, then its relay run until [`RelayGroup::remove`] or
    /// [`RelayGroup::shutdown`]; a failure to open, a start-up error and a panic are logged and
    /// the member opened again with [`REOPEN_BACKOFF`].
    ///
    /// # Errors
    /// [`ConfigError`] (`databases`) when `name` is empty or already a member, or the group was
    /// shut down.
    ///
    /// # Panics
    /// Outside a Tokio runtime.
    pub fn add(&self, name: impl Into<String>, open: Opener) -> Result<(), ConfigError> {
        let name = name.into();
        ConfigError::invalid_if(name.is_empty(), "databases", "a member needs a name")?;
        let mut members = self.lock();
        ConfigError::invalid_if(
            self.inner.stop.is_cancelled(),
            "databases",
            "the group was shut down",
        )?;
        ConfigError::invalid_if(
            members.contains_key(&name),
            "databases",
            format!("two members are named {name:?}"),
        )?;
        let state = Arc::new(Mutex::new(MemberState::Opening {
            failures: 0,
            last_error: None,
        }));
        let stop = self.inner.stop.child_token();
        let span = tracing::info_span!("database", database = %name);
        let task = tokio::spawn(supervise(open, state.clone(), stop.clone()).instrument(span));
        members.insert(name, Member { state, stop, task });
        Ok(())
    }

    /// Stop member `name` gracefully (its relay finishes its batches and releases its buckets)
    /// and remove it; whether it was a member.
    pub async fn remove(&self, name: &str) -> bool {
        let member = self.lock().remove(name);
        match member {
            Some(m) => {
                m.stop.cancel();
                let _ = m.task.await;
                true
            }
            None => false,
        }
    }

    /// The members' names, in order.
    pub fn names(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    /// Every member and where it stands, by name.
    pub fn members(&self) -> Vec<(String, MemberState)> {
        self.lock()
            .iter()
            .map(|(n, m)| (n.clone(), lock(&m.state).clone()))
            .collect()
    }

    /// The relays that run now, by member name.
    pub fn relays(&self) -> Vec<(String, Relay)> {
        self.members()
            .into_iter()
            .filter_map(|(n, s)| match s {
                MemberState::Running(r) => Some((n, r)),
                MemberState::Opening { .. } => None,
            })
            .collect()
    }

    /// Liveness of the process (the daemon's `/healthz`): a running relay whose batch is stuck
    /// past `lease - publish_timeout` while its database answers ([`Relay::wedged`]), named
    /// `database <name>: …`. A database that does not answer is not a liveness problem here,
    /// nor a batch waiting for it (restarting the process would not bring the database back and
    /// would disturb the others): [`RelayGroup::readiness`] reports them.
    pub fn health(&self) -> RelayHealth {
        let mut problems = Vec::new();
        for (name, relay) in self.relays() {
            if let Some(age) = relay.wedged() {
                problems.push(format!(
                    "database {name}: a batch has been in flight for {:.1} s, past lease - publish_timeout: the relay makes no progress",
                    age.as_secs_f64()
                ));
            }
        }
        RelayHealth { problems }
    }

    /// Readiness of every member (the daemon's `/readyz`): each running relay's
    /// [`Relay::readiness`] and each member not running with its last error, every problem
    /// prefixed `database <name>: `. Use [`RelayGroup::member_readiness`] for one member.
    pub fn readiness(&self) -> RelayHealth {
        let mut problems = Vec::new();
        for (name, state) in self.members() {
            for p in state_readiness(&state).problems {
                problems.push(format!("database {name}: {p}"));
            }
        }
        RelayHealth { problems }
    }

    /// Readiness of member `name` alone (unprefixed problems); `None` when there is no such member.
    pub fn member_readiness(&self, name: &str) -> Option<RelayHealth> {
        let state = self.lock().get(name).map(|m| lock(&m.state).clone())?;
        Some(state_readiness(&state))
    }

    /// Stop every member gracefully and wait for them; no member can be added afterwards.
    pub async fn shutdown(&self) {
        let members: Vec<Member> = {
            let mut m = self.lock();
            self.inner.stop.cancel();
            std::mem::take(&mut *m).into_values().collect()
        };
        for m in members {
            let _ = m.task.await;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Member>> {
        self.inner
            .members
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

fn lock(state: &Mutex<MemberState>) -> std::sync::MutexGuard<'_, MemberState> {
    state
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn state_readiness(state: &MemberState) -> RelayHealth {
    match state {
        MemberState::Running(r) => r.readiness(),
        MemberState::Opening {
            failures,
            last_error,
        } => RelayHealth {
            problems: vec![match last_error {
                Some(e) => format!("not running ({failures} failed attempts; last: {e})"),
                None => "being opened".to_owned(),
            }],
        },
    }
}

/// Open and run one member until `stop`, reopening with backoff after each failure.
async fn supervise(open: Opener, state: Arc<Mutex<MemberState>>, stop: CancellationToken) {
    let mut failures = 0u32;
    while !stop.is_cancelled() {
        let opened = tokio::select! {
            _ = stop.cancelled() => return,
            r = AssertUnwindSafe(open()).catch_unwind() => r,
        };
        let error = match opened {
            Ok(Ok(relay)) => {
                *lock(&state) = MemberState::Running(relay.clone());
                tracing::info!(relay = %relay.config().name, "database member running");
                let started = Instant::now();
                let ran = AssertUnwindSafe(relay.run(stop.child_token()))
                    .catch_unwind()
                    .await;
                if stop.is_cancelled() {
                    return;
                }
                if started.elapsed() >= STABLE_RUN {
                    failures = 0;
                }
                match ran {
                    Ok(Ok(())) => "the relay stopped".to_owned(),
                    Ok(Err(e)) => format!("the relay stopped: {}", e.report()),
                    Err(p) => format!(
                        "the relay panicked: {}",
                        crate::inbox::panic_text(p.as_ref())
                    ),
                }
            }
            Ok(Err(e)) => format!(
                "cannot open: {}",
                crate::error::with_sources(e.to_string(), e.source())
            ),
            Err(p) => format!("opening panicked: {}", crate::inbox::panic_text(p.as_ref())),
        };
        failures = failures.saturating_add(1);
        let wait = REOPEN_BACKOFF.delay(failures);
        tracing::warn!(
            error,
            failures,
            retry_in_ms = wait.as_millis() as u64,
            "database member not running; opening it again after a backoff"
        );
        *lock(&state) = MemberState::Opening {
            failures,
            last_error: Some(error),
        };
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}
