//! What the broker tests share: the consumer's PostgreSQL inbox and effects table, and a
//! production consumer runner started with its own metrics and cancel token, stopped cleanly.

use std::sync::Arc;
use std::time::Duration;

use outbox::consumer::ConsumerMetrics;
use outbox::consumer::source::SourceConfig;
use outbox::{Inbox, InboxBackend};
use outbox_testkit::{PgFixture, within};
use tokio_util::sync::CancellationToken;

/// A running consumer runner's task.
pub(crate) type ConsumerTask = tokio::task::JoinHandle<Result<(), outbox::ConfigError>>;

/// The consumer inbox `billing` in the fixture's schema (`<schema>.consumer_inbox`), migrated.
pub(crate) async fn pg_inbox(fx: &PgFixture) -> Inbox<sqlx::Postgres> {
    let inbox = Inbox::<sqlx::Postgres>::new(
        fx.store.pool().clone(),
        &format!("{}.consumer_inbox", fx.schema),
        "billing",
    )
    .unwrap();
    inbox.migrate().await.unwrap();
    inbox
}

/// The columns of the effects table of [`crate::confirm::ScriptedHandler`].
pub(crate) const EFFECTS: &str = "message_id text NOT NULL, payload bytea";

/// Create the table `<schema>.effects (<columns>)` and return its name.
pub(crate) async fn pg_effects(fx: &PgFixture, columns: &str) -> String {
    let effects = format!("{}.effects", fx.schema);
    fx.exec(&format!("CREATE TABLE {effects} ({columns})"))
        .await;
    effects
}

/// Spawn the production runner of `config`'s broker (`outbox::consumer::run`) over `inbox`.
pub(crate) fn spawn_consumer<C, DB, H>(
    config: C,
    inbox: &Inbox<DB>,
    handler: Arc<H>,
    metrics: Arc<ConsumerMetrics>,
    cancel: CancellationToken,
) -> ConsumerTask
where
    C: SourceConfig + 'static,
    DB: InboxBackend,
    H: outbox::Handler<DB> + ?Sized + 'static,
{
    tokio::spawn(outbox::consumer::run(
        config,
        inbox.clone(),
        handler,
        metrics,
        cancel,
    ))
}

/// How long a consumer runner may take to stop unless its test says otherwise: 5 s.
pub(crate) const CONSUMER_STOPS_WITHIN: Duration = Duration::from_secs(5);

/// How long a confirmation listener may take to stop unless its test says otherwise: 10 s.
pub(crate) const LISTENER_STOPS_WITHIN: Duration = Duration::from_secs(10);

/// Cancel a consumer runner and wait until it stopped, without an error, for at most `bound`
/// (each broker's tests keep the bound they had: 5 s NATS, 10 s Redis, RabbitMQ and MQTT,
/// 15 s Kafka, 30 s RocketMQ, whose client leaves its rebalance loop slowly).
pub(crate) async fn stop_consumer(cancel: CancellationToken, task: ConsumerTask, bound: Duration) {
    cancel.cancel();
    within("the consumer to stop", bound, task)
        .await
        .expect("consumer task")
        .expect("consumer result");
}

/// A consumer runner started with fresh metrics and a cancel token of its own.
pub(crate) struct Running {
    pub(crate) metrics: Arc<ConsumerMetrics>,
    pub(crate) cancel: CancellationToken,
    pub(crate) task: ConsumerTask,
    /// How long [`Running::stop`] waits: [`CONSUMER_STOPS_WITHIN`] unless set by
    /// [`Running::stopping_within`].
    bound: Duration,
}

impl Running {
    /// The production runner of `config`'s broker (`outbox::consumer::run`) over `inbox`.
    pub(crate) fn spawn<C, DB, H>(config: C, inbox: &Inbox<DB>, handler: Arc<H>) -> Running
    where
        C: SourceConfig + 'static,
        DB: InboxBackend,
        H: outbox::Handler<DB> + ?Sized + 'static,
    {
        Running::start(|metrics, cancel| spawn_consumer(config, inbox, handler, metrics, cancel))
    }

    /// The runner `spawn` starts with these metrics and this cancel token.
    pub(crate) fn start(
        spawn: impl FnOnce(Arc<ConsumerMetrics>, CancellationToken) -> ConsumerTask,
    ) -> Running {
        let metrics = Arc::new(ConsumerMetrics::default());
        let cancel = CancellationToken::new();
        let task = spawn(metrics.clone(), cancel.clone());
        Running {
            metrics,
            cancel,
            task,
            bound: CONSUMER_STOPS_WITHIN,
        }
    }

    /// The same runner, which [`Running::stop`] waits for at most `bound`.
    pub(crate) fn stopping_within(self, bound: Duration) -> Running {
        Running { bound, ..self }
    }

    /// Wait (at most `bound`, for `what`) until `reached` (its handler's crash point), then end
    /// it as a dying process would ([`Running::abort`]); its metrics.
    pub(crate) async fn crash_at(
        self,
        what: &str,
        bound: Duration,
        reached: impl std::future::Future<Output = ()>,
    ) -> Arc<ConsumerMetrics> {
        within(what, bound, reached).await;
        self.abort().await
    }

    /// End it as a dying process would (its task aborted); its metrics.
    pub(crate) async fn abort(self) -> Arc<ConsumerMetrics> {
        self.task.abort();
        let _ = self.task.await;
        self.metrics
    }

    /// Cancel it and wait until it stopped ([`stop_consumer`]).
    pub(crate) async fn stop(self) {
        stop_consumer(self.cancel, self.task, self.bound).await;
    }
}

/// A producer's confirmation listener (`outbox::confirm::<broker>::listen`), stopped by a
/// token of its own.
pub(crate) struct Listener {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Result<outbox::ConfirmReport, outbox::ConfigError>>,
    /// How long stopping it waits: [`LISTENER_STOPS_WITHIN`] unless set by
    /// [`Listener::stopping_within`].
    bound: Duration,
}

impl Listener {
    /// Spawn the listener `listen` makes with the stop token.
    pub(crate) fn spawn<F>(listen: impl FnOnce(CancellationToken) -> F) -> Listener
    where
        F: std::future::Future<Output = Result<outbox::ConfirmReport, outbox::ConfigError>>
            + Send
            + 'static,
    {
        let stop = CancellationToken::new();
        let task = tokio::spawn(listen(stop.clone()));
        Listener {
            stop,
            task,
            bound: LISTENER_STOPS_WITHIN,
        }
    }

    /// The same listener, which stopping waits for at most `bound`.
    pub(crate) fn stopping_within(self, bound: Duration) -> Listener {
        Listener { bound, ..self }
    }

    /// Stop it and return its report (it must end without an error).
    pub(crate) async fn report(self) -> outbox::ConfirmReport {
        self.stop.cancel();
        within("listener to stop", self.bound, self.task)
            .await
            .expect("listener task")
            .expect("listener result")
    }

    /// Stop it, whatever it ends with.
    pub(crate) async fn stop(self) {
        self.stop.cancel();
        let _ = within("listener to stop", self.bound, self.task).await;
    }
}
