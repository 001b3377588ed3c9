//! The inventory service's receiving side, per broker: the library's consumer runner
//! (`outbox::consumer::<broker>::run`) in several instances sharing the work, as instances of one
//! service would, or the webhook receiver's router served by axum beside its maintenance.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use outbox::consumer::nats::NatsConsumerConfig;
use outbox::consumer::{ConsumerMetrics, DeliveryPolicy};
use outbox::error::ConfigError;
use outbox::{ConfirmationSender, Inbox, InboxBackend};
use tokio_util::sync::CancellationToken;

use super::CONSUMER;
#[cfg(feature = "rabbitmq")]
use super::delivery::RABBIT_QUEUE;
#[cfg(feature = "redis")]
use super::delivery::REDIS_STREAM;
use super::delivery::{Delivery, Endpoint, NATS_STREAM, ServiceTask, serve, spawn_service};
#[cfg(feature = "kafka")]
use super::{CANCELLED_TOPIC, TOPIC};

/// The demo consumers' runner settings on `runner`: no deduplication window (the inbox
/// deduplicates), at most `inbox_batch` messages per inbox transaction.
fn demo_runner(runner: &mut outbox::consumer::RunnerSettings, inbox_batch: usize) {
    runner.dedup_window = None;
    runner.inbox_batch = inbox_batch;
}

/// Start `n` runners of one consumer (`start(i)` is runner `i`); a runner's error is reported as
/// `what`.
fn runners<F, Fut>(n: usize, what: &'static str, start: F) -> Vec<ServiceTask>
where
    F: FnMut(usize) -> Fut,
    Fut: Future<Output = Result<(), ConfigError>> + Send + 'static,
{
    (0..n)
        .map(start)
        .map(|run| spawn_service(run, what))
        .collect()
}

impl Delivery {
    /// Start the inventory service's receiver, confirming through `confirmations` and applying up
    /// to `inbox_batch` messages per inbox transaction; it runs until `cancel`. Returns where the relay delivers (the webhook URL; nothing for a broker, whose
    /// route names the destination) and the receiver's tasks.
    pub(super) async fn start_consumer<DB, H>(
        &self,
        inbox: Inbox<DB>,
        handler: Arc<H>,
        confirmations: Arc<dyn ConfirmationSender>,
        metrics: Arc<ConsumerMetrics>,
        inbox_batch: usize,
        cancel: &CancellationToken,
    ) -> anyhow::Result<(Endpoint, Vec<ServiceTask>)>
    where
        DB: InboxBackend,
        H: outbox::Handler<DB>,
    {
        // The arguments every runner takes after its configuration.
        let shared = || {
            (
                inbox.clone(),
                handler.clone(),
                metrics.clone(),
                cancel.clone(),
            )
        };
        match self {
            Delivery::Webhook { secret } => {
                let path = "/inventory/order-events";
                let policy = DeliveryPolicy {
                    confirmations: Some(confirmations),
                    inbox_batch,
                    ..DeliveryPolicy::default()
                };
                let app = outbox::consumer::webhook::router_with(
                    path,
                    inbox.clone(),
                    handler.clone(),
                    Some(secret),
                    metrics.clone(),
                    policy.clone(),
                )?;
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
                let url = format!("http://{}{path}", listener.local_addr()?);
                let server = serve(listener, app, cancel, "webhook server failed");
                // Beside the server, as a webhook receiver should run it: operator replays of
                // dead letters (none expected here) and inbox retention (kept for the report).
                let maintenance = tokio::spawn(outbox::consumer::maintenance(
                    inbox,
                    handler,
                    policy,
                    None,
                    Duration::from_secs(2),
                    metrics,
                    cancel.clone(),
                ));
                let maintenance = spawn_service(maintenance, "maintenance panicked");
                Ok((Some(url), vec![server, maintenance]))
            }
            Delivery::Nats { js, .. } => {
                let mut config = NatsConsumerConfig::new(NATS_STREAM, CONSUMER)
                    .with_confirmations(confirmations);
                demo_runner(&mut config.runner, inbox_batch);
                // Create the durable once, so the runners below do not race to create it.
                js.get_stream(NATS_STREAM)
                    .await?
                    .get_or_create_consumer(
                        CONSUMER,
                        async_nats::jetstream::consumer::pull::Config {
                            durable_name: Some(CONSUMER.into()),
                            ack_policy: async_nats::jetstream::consumer::AckPolicy::Explicit,
                            ack_wait: config.ack_wait,
                            max_ack_pending: 10_000,
                            ..Default::default()
                        },
                    )
                    .await
                    .context("cannot create the JetStream consumer")?;
                // Several runners share the durable, as instances of one service would.
                let tasks = runners(4, "NATS consumer failed", |_| {
                    let (inbox, handler, metrics, cancel) = shared();
                    let js = (**js).clone();
                    outbox::consumer::nats::run(js, config.clone(), inbox, handler, metrics, cancel)
                });
                Ok((None, tasks))
            }
            #[cfg(feature = "redis")]
            Delivery::Redis { url, .. } => {
                let mut config = outbox::consumer::redis::RedisConsumerConfig::new(
                    url.clone(),
                    REDIS_STREAM,
                    CONSUMER,
                )
                .with_confirmations(confirmations);
                demo_runner(&mut config.runner, inbox_batch);
                config.runner.concurrency = 4;
                // Several runners share the group, as instances of one service would.
                let tasks = runners(4, "Redis consumer failed", |i| {
                    let mut config = config.clone();
                    config.consumer = format!("{CONSUMER}-{i}");
                    let (inbox, handler, metrics, cancel) = shared();
                    outbox::consumer::redis::run(config, inbox, handler, metrics, cancel)
                });
                Ok((None, tasks))
            }
            #[cfg(feature = "mqtt")]
            Delivery::Mqtt { url, run, .. } => {
                let mut config = outbox::consumer::mqtt::MqttConsumerConfig::new(
                    url.clone(),
                    "",
                    "demo/orders/#",
                )
                .with_confirmations(confirmations);
                config.group = Some(format!("{CONSUMER}-{run}"));
                config.session_expiry = Duration::from_secs(60);
                demo_runner(&mut config.runner, inbox_batch);
                config.runner.concurrency = 4;
                let tasks = runners(4, "MQTT consumer failed", |i| {
                    let mut config = config.clone();
                    config.client_id = format!("demo-{CONSUMER}-{run}-{i}");
                    let (inbox, handler, metrics, cancel) = shared();
                    outbox::consumer::mqtt::run(config, inbox, handler, metrics, cancel)
                });
                Ok((None, tasks))
            }
            #[cfg(feature = "rocketmq")]
            Delivery::RocketMq(r) => {
                let mut config = outbox::consumer::rocketmq::RocketMqConsumerConfig::new(
                    r.name_server.clone(),
                    format!("{CONSUMER}_{}", r.run),
                    r.orders_topic.clone(),
                )
                .with_confirmations(confirmations);
                demo_runner(&mut config.runner, inbox_batch);
                config.batch = 32;
                config.runner.concurrency = 8;
                config.route_refresh = Duration::from_secs(10);
                // Two instances of the group share the topic's queues, as instances of one
                // service would.
                let tasks = runners(2, "RocketMQ consumer failed", |_| {
                    let (inbox, handler, metrics, cancel) = shared();
                    outbox::consumer::rocketmq::run(config.clone(), inbox, handler, metrics, cancel)
                });
                Ok((None, tasks))
            }
            #[cfg(feature = "rabbitmq")]
            Delivery::RabbitMq { config } => {
                let mut config = outbox::consumer::rabbitmq::RabbitMqConsumerConfig::new(
                    config.clone(),
                    RABBIT_QUEUE,
                )
                .with_confirmations(confirmations);
                demo_runner(&mut config.runner, inbox_batch);
                config.runner.concurrency = 1;
                // Four instances of the service share the queue (competing consumers).
                let tasks = runners(4, "RabbitMQ consumer failed", |_| {
                    let (inbox, handler, metrics, cancel) = shared();
                    outbox::consumer::rabbitmq::run(config.clone(), inbox, handler, metrics, cancel)
                });
                Ok((None, tasks))
            }
            #[cfg(feature = "kafka")]
            Delivery::Kafka { config, run, .. } => {
                let mut consumer = outbox::consumer::kafka::KafkaConsumerConfig::new(
                    (**config).clone(),
                    format!("{run}.{CONSUMER}"),
                    [format!("{run}.{TOPIC}"), format!("{run}.{CANCELLED_TOPIC}")],
                )
                .with_confirmations(confirmations);
                demo_runner(&mut consumer.runner, inbox_batch);
                consumer.runner.concurrency = 4;
                // The broker minimum, so a new group starts quickly (Tansu holds a new group's
                // first join for about half the session timeout).
                consumer.session_timeout = Duration::from_secs(6);
                // Two members of the group share the partitions, as instances of one service
                // would; each applies its batches in 4 lanes by partition key.
                let tasks = runners(2, "Kafka consumer failed", |_| {
                    let (inbox, handler, metrics, cancel) = shared();
                    outbox::consumer::kafka::run(consumer.clone(), inbox, handler, metrics, cancel)
                });
                Ok((None, tasks))
            }
        }
    }
}
