//! How messages travel from the relay to the inventory service, and confirmations back: one
//! [`Delivery`] per broker, built from `--transport`. Each gives the relay a fresh transport per
//! incarnation, runs the order service's confirmation listener and gives the inventory service
//! its confirmation sender; the inventory service's consumers are in [`super::consumers`].

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use base64::Engine;
use outbox::confirm::nats::NatsConfirmationSender;
use outbox::confirm::webhook::WebhookConfirmationSender;
use outbox::{
    ConfirmationSender, NatsConfig, NatsTransport, Store, StreamSetup, Transport, WebhookConfig,
    WebhookTransport,
};
#[cfg(feature = "kafka")]
use outbox::{KafkaConfig, KafkaTransport, confirm::kafka::KafkaConfirmationSender};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

#[cfg(feature = "kafka")]
use super::CANCELLED_TOPIC;
use super::{CONSUMER, TOPIC};

/// Path of the order service's confirmation endpoint (webhook variant).
const CONFIRM_PATH: &str = "/confirmations";
/// Subject the order service listens on for confirmations (NATS variant); outside the stream.
const CONFIRM_SUBJECT: &str = "demo.confirmations";
/// Queue group of the order service's confirmation listeners.
const CONFIRM_QUEUE: &str = "demo-order-service";
/// JetStream stream of the NATS variant (deleted and recreated at start).
pub(super) const NATS_STREAM: &str = "DEMO_ORDERS";
/// Subjects the stream captures; the route publishes to `demo.orders.<topic>`.
const NATS_SUBJECTS: &str = "demo.orders.>";
/// Topic exchange of the RabbitMQ variant; the route publishes to `demo.orders/<topic>`.
#[cfg(feature = "rabbitmq")]
const RABBIT_EXCHANGE: &str = "demo.orders";
/// Queue of the inventory service in the RabbitMQ variant (bound to the exchange with `#`;
/// deleted and recreated at start).
#[cfg(feature = "rabbitmq")]
pub(super) const RABBIT_QUEUE: &str = "demo.inventory";
/// Queue the order service consumes confirmations from in the RabbitMQ variant.
#[cfg(feature = "rabbitmq")]
const RABBIT_CONFIRM_QUEUE: &str = "demo.confirmations";
/// Partitions of the Kafka variant's order topics.
#[cfg(feature = "kafka")]
const KAFKA_PARTITIONS: i32 = 4;

/// How messages travel from the relay to the inventory service, and confirmations back.
pub(super) enum Delivery {
    /// Standard Webhooks POSTs to an axum server in this process; confirmations are POSTed to
    /// the order service's own axum server.
    Webhook { secret: String },
    /// NATS JetStream: stream [`NATS_STREAM`], durable pull consumer [`CONSUMER`];
    /// confirmations on core NATS subject [`CONFIRM_SUBJECT`].
    Nats {
        url: String,
        js: Box<async_nats::jetstream::Context>,
    },
    /// Redis Streams: stream [`REDIS_STREAM`], consumer group [`CONSUMER`]; confirmations on
    /// stream [`REDIS_CONFIRM_STREAM`].
    #[cfg(feature = "redis")]
    Redis {
        url: String,
        transport: Arc<outbox::RedisTransport>,
    },
    /// MQTT 5: topics `demo/orders/<topic>`, shared subscription of persistent sessions;
    /// confirmations on [`MQTT_CONFIRM_TOPIC`]. `run` makes the session and group names unique
    /// to this run, so sessions left by an earlier run receive nothing of this one.
    #[cfg(feature = "mqtt")]
    Mqtt {
        url: String,
        run: String,
        sender: Arc<outbox::confirm::mqtt::MqttConfirmationSender>,
    },
    /// RocketMQ: fresh topics for this run (orders, with the outbox topic as the tag, and
    /// confirmations), consumer group `inventory_<run>` with two instances sharing the queues;
    /// confirmations over RocketMQ to the order service's group.
    #[cfg(feature = "rocketmq")]
    RocketMq(Box<RocketMqDelivery>),
    /// RabbitMQ: topic exchange [`RABBIT_EXCHANGE`] → queue [`RABBIT_QUEUE`] with publisher
    /// confirms; confirmations on queue [`RABBIT_CONFIRM_QUEUE`].
    #[cfg(feature = "rabbitmq")]
    RabbitMq { config: outbox::RabbitMqConfig },
    /// Kafka (any Kafka-protocol broker, e.g. Tansu): topics `demo-<run>.order-created` and
    /// `demo-<run>.order-cancelled`, consumer group `demo-<run>.inventory`; confirmations on topic
    /// `demo-<run>.confirmations`, group `demo-<run>.demo-order-service`. Topics and groups are
    /// fresh per run, so no earlier run's offsets or departed group members apply.
    #[cfg(feature = "kafka")]
    Kafka {
        url: String,
        config: Box<KafkaConfig>,
        run: String,
        sender: Arc<KafkaConfirmationSender>,
    },
}

/// The RocketMQ delivery's names and its confirmation sender.
#[cfg(feature = "rocketmq")]
pub(super) struct RocketMqDelivery {
    /// The `--transport` URL.
    pub(super) url: String,
    /// The name server's address.
    pub(super) name_server: String,
    /// Topic of the orders and cancellations (tags `order-created`, `order-cancelled`).
    pub(super) orders_topic: String,
    /// Topic of the confirmations (tag `order-service`).
    pub(super) confirm_topic: String,
    /// Suffix of this run's groups.
    pub(super) run: String,
    /// The inventory service's confirmation sender.
    pub(super) sender: Arc<dyn ConfirmationSender>,
}

#[cfg(feature = "rocketmq")]
impl RocketMqDelivery {
    /// Connect, create this run's topics (so consumers find their routes at once) and the
    /// confirmation sender. Topics are per run: a fresh consumer group reads its topic from the
    /// first offset, and must not see an earlier run's orders.
    async fn open(url: &str) -> anyhow::Result<RocketMqDelivery> {
        use outbox::transport::rocketmq::{RocketMqConfig, RocketMqTransport};
        let run = format!("{:08x}", rand::random::<u32>());
        let mut config = RocketMqConfig::from_url(url)?;
        let name_server = config.name_server.clone();
        config.producer_group = format!("demo_inventory_confirmer_{run}");
        let transport = RocketMqTransport::connect(config)
            .await
            .with_context(|| format!("cannot connect to RocketMQ at {url}"))?;
        let orders_topic = format!("demo_orders_{run}");
        let confirm_topic = format!("demo_confirmations_{run}");
        for t in [&orders_topic, &confirm_topic] {
            transport
                .create_topic(t, 4)
                .await
                .with_context(|| format!("cannot create the RocketMQ topic {t}"))?;
        }
        let sender = Arc::new(outbox::confirm::rocketmq::RocketMqConfirmationSender::new(
            transport,
        ));
        Ok(RocketMqDelivery {
            url: url.to_owned(),
            name_server,
            orders_topic,
            confirm_topic,
            run,
            sender,
        })
    }
}

/// Redis stream the demo's relay publishes every topic to (recreated at start).
#[cfg(feature = "redis")]
pub(super) const REDIS_STREAM: &str = "demo:orders";
/// Redis stream the inventory service confirms to (recreated at start).
#[cfg(feature = "redis")]
const REDIS_CONFIRM_STREAM: &str = "demo:confirmations";
/// MQTT topic prefix of the demo's messages (`demo/orders/<topic>`).
#[cfg(feature = "mqtt")]
const MQTT_TOPICS: &str = "demo/orders/{topic}";
/// MQTT topic the inventory service confirms to.
#[cfg(feature = "mqtt")]
const MQTT_CONFIRM_TOPIC: &str = "demo/confirmations";

/// Where the relay delivers: the webhook URL, or nothing for NATS (the route names the subject).
pub(super) type Endpoint = Option<String>;

/// A task of one of the services, joined at the end of the run.
pub(super) type ServiceTask = JoinHandle<anyhow::Result<()>>;

/// Spawn one of the services' tasks: `task`'s error, if any, is reported as `what`.
pub(super) fn spawn_service<T, E>(
    task: impl Future<Output = Result<T, E>> + Send + 'static,
    what: &'static str,
) -> ServiceTask
where
    T: Send + 'static,
    E: std::error::Error + Send + Sync + 'static,
{
    tokio::spawn(async move { task.await.map(|_| ()).context(what) })
}

/// Serve `app` on `listener` until `cancel`; a failure is reported as `what`.
pub(super) fn serve(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    cancel: &CancellationToken,
    what: &'static str,
) -> ServiceTask {
    let cancel = cancel.clone();
    spawn_service(
        async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(cancel.cancelled_owned())
                .await
        },
        what,
    )
}

impl Delivery {
    /// Set up the delivery; for NATS, a fresh stream with a 2-minute duplicate window (relay
    /// re-publishes of a message id are dropped; check-back redeliveries carry their own
    /// `Nats-Msg-Id` and get through).
    pub(super) async fn open(transport: Option<&str>) -> anyhow::Result<Delivery> {
        match transport {
            None | Some("webhook") => {
                let key: [u8; 24] = rand::random();
                let secret = format!(
                    "whsec_{}",
                    base64::engine::general_purpose::STANDARD.encode(key)
                );
                Ok(Delivery::Webhook { secret })
            }
            Some(url) if url.starts_with("nats://") => {
                let client = outbox::transport::nats::connect_client(url)
                    .await
                    .map_err(anyhow::Error::msg)?;
                // Start from an empty stream so runs are independent; a missing stream is fine.
                // (The library creates streams, it does not delete them.)
                let _ = async_nats::jetstream::new(client.clone())
                    .delete_stream(NATS_STREAM)
                    .await;
                // The transport creates the stream, with its 2-minute duplicate window.
                let mut config = NatsConfig::new(url);
                config.stream = Some(StreamSetup {
                    name: NATS_STREAM.into(),
                    subjects: vec![NATS_SUBJECTS.into()],
                    create: true,
                    replicas: 1,
                });
                let stream = NatsTransport::from_client(client, config)
                    .await
                    .with_context(|| format!("cannot create the JetStream stream {NATS_STREAM}"))?;
                Ok(Delivery::Nats {
                    url: url.to_owned(),
                    js: Box::new(stream.jetstream().clone()),
                })
            }
            #[cfg(feature = "redis")]
            Some(url) if url.starts_with("redis://") || url.starts_with("rediss://") => {
                let transport = outbox::RedisTransport::connect(outbox::RedisConfig::new(url))
                    .await
                    .with_context(|| format!("cannot connect to Redis at {url}"))?;
                // Start from empty streams so runs are independent.
                let mut conn = transport.connection();
                redis::cmd("DEL")
                    .arg(REDIS_STREAM)
                    .arg(REDIS_CONFIRM_STREAM)
                    .query_async::<i64>(&mut conn)
                    .await
                    .context("cannot reset the demo streams")?;
                Ok(Delivery::Redis {
                    url: url.to_owned(),
                    transport: Arc::new(transport),
                })
            }
            #[cfg(feature = "mqtt")]
            Some(url) if url.starts_with("mqtt://") || url.starts_with("mqtts://") => {
                let sender = outbox::confirm::mqtt::MqttConfirmationSender::connect(
                    outbox::MqttConfig::new(url),
                )
                .await
                .with_context(|| format!("cannot connect to the MQTT broker at {url}"))?;
                Ok(Delivery::Mqtt {
                    url: url.to_owned(),
                    run: format!("{:08x}", rand::random::<u32>()),
                    sender: Arc::new(sender),
                })
            }
            #[cfg(feature = "rocketmq")]
            Some(url) if url.starts_with("rocketmq://") => Ok(Delivery::RocketMq(Box::new(
                RocketMqDelivery::open(url).await?,
            ))),
            #[cfg(not(feature = "rocketmq"))]
            Some(url) if url.starts_with("rocketmq://") => {
                bail!(
                    "--transport {url}: RocketMQ support is not compiled in: run with --features rocketmq"
                )
            }
            #[cfg(feature = "rabbitmq")]
            Some(url) if url.starts_with("amqp://") || url.starts_with("amqps://") => {
                rabbitmq_fresh_queues(url).await?;
                let mut config = outbox::RabbitMqConfig::new(url);
                config.confirm_timeout = Duration::from_secs(1);
                config.validate()?;
                Ok(Delivery::RabbitMq { config })
            }
            #[cfg(feature = "kafka")]
            Some(url) if url.starts_with("kafka://") => {
                let mut config = KafkaConfig::new(url);
                // Below the demo relay's 1 s publish timeout (see outbox::transport::kafka).
                config.delivery_timeout = Duration::from_millis(800);
                let run = format!("demo-{:08x}", rand::random::<u32>());
                let topic = |t: &str, partitions| {
                    outbox::transport::kafka::KafkaTopic::new(format!("{run}.{t}"))
                        .partitions(partitions)
                };
                outbox::transport::kafka::create_topics(
                    &config,
                    &[
                        topic(TOPIC, KAFKA_PARTITIONS),
                        topic(CANCELLED_TOPIC, KAFKA_PARTITIONS),
                        topic("confirmations", 2),
                    ],
                )
                .await
                .with_context(|| format!("cannot create the demo topics on Kafka at {url}"))?;
                let sender = Arc::new(KafkaConfirmationSender::new(config.clone())?);
                Ok(Delivery::Kafka {
                    url: url.to_owned(),
                    config: Box::new(config),
                    run,
                    sender,
                })
            }
            Some(other) => bail!(
                "--transport must be \"webhook\" or a nats://, redis://, mqtt://, amqp://, kafka:// or rocketmq:// URL, not {other:?}"
            ),
        }
    }

    pub(super) fn describe(&self) -> String {
        match self {
            Delivery::Webhook { .. } => {
                "signed webhooks (in-process axum receiver), confirmations POSTed to the order service"
                    .into()
            }
            Delivery::Nats { url, .. } => {
                format!(
                    "NATS JetStream at {url} (stream {NATS_STREAM}, durable {CONSUMER}), \
                     confirmations on {CONFIRM_SUBJECT}"
                )
            }
            #[cfg(feature = "redis")]
            Delivery::Redis { url, .. } => format!(
                "Redis Streams at {url} (stream {REDIS_STREAM}, group {CONSUMER}), \
                 confirmations on stream {REDIS_CONFIRM_STREAM}"
            ),
            #[cfg(feature = "mqtt")]
            Delivery::Mqtt { url, run, .. } => format!(
                "MQTT 5 at {url} (QoS 1, topics demo/orders/#, shared subscription \
                 {CONSUMER}-{run}), confirmations on {MQTT_CONFIRM_TOPIC}"
            ),
            #[cfg(feature = "rocketmq")]
            Delivery::RocketMq(r) => format!(
                "RocketMQ at {} (topic {}, tags order-created/order-cancelled, group {CONSUMER}_{} \
                 with 2 instances), confirmations on {}:order-service",
                r.url, r.orders_topic, r.run, r.confirm_topic
            ),
            #[cfg(feature = "rabbitmq")]
            Delivery::RabbitMq { config } => format!(
                "RabbitMQ at {} (exchange {RABBIT_EXCHANGE} → queue {RABBIT_QUEUE}, publisher \
                 confirms), confirmations on queue {RABBIT_CONFIRM_QUEUE}",
                crate::redact(&config.url)
            ),
            #[cfg(feature = "kafka")]
            Delivery::Kafka { url, run, .. } => {
                format!(
                    "Kafka at {url} (topics {run}.{TOPIC} and {run}.{CANCELLED_TOPIC}, \
                     {KAFKA_PARTITIONS} partitions each, consumer group {run}.{CONSUMER}), \
                     confirmations on topic {run}.confirmations"
                )
            }
        }
    }

    /// What the report adds to the count of duplicates the inbox absorbed.
    pub(super) fn duplicates_note(&self) -> &'static str {
        match self {
            Delivery::Nats { .. } => {
                "  (JetStream's duplicate window drops quick re-publishes of a message id first)"
            }
            Delivery::Webhook { .. } => "",
            #[cfg(feature = "redis")]
            Delivery::Redis { .. } => "",
            #[cfg(feature = "mqtt")]
            Delivery::Mqtt { .. } => "",
            #[cfg(feature = "rocketmq")]
            Delivery::RocketMq(_) => {
                "  (RocketMQ keeps every re-publish: each copy is recognised by the inbox)"
            }
            #[cfg(feature = "rabbitmq")]
            Delivery::RabbitMq { .. } => {
                "  (RabbitMQ keeps every re-published copy; the inbox absorbs them)"
            }
            #[cfg(feature = "kafka")]
            Delivery::Kafka { .. } => "",
        }
    }

    /// Start the order service's confirmation endpoint, applying confirmations to `store` until
    /// `cancel`; returns the reply destination to name in the messages.
    pub(super) async fn start_confirmation_listener(
        &self,
        store: Arc<dyn Store>,
        cancel: &CancellationToken,
    ) -> anyhow::Result<(String, ServiceTask)> {
        match self {
            Delivery::Webhook { .. } => {
                let app = outbox::confirm::webhook::router(CONFIRM_PATH, store);
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
                let url = format!("http://{}{CONFIRM_PATH}", listener.local_addr()?);
                let server = serve(listener, app, cancel, "confirmation endpoint failed");
                Ok((url, server))
            }
            Delivery::Nats { js, .. } => {
                let listen = outbox::confirm::nats::listen(
                    js.client(),
                    CONFIRM_SUBJECT.into(),
                    CONFIRM_QUEUE.into(),
                    store,
                    cancel.clone(),
                );
                // A confirmation published before the subscription reaches the server is lost
                // like any other; the check-back recovers it.
                let task = spawn_service(listen, "cannot subscribe to the confirmation subject");
                Ok((CONFIRM_SUBJECT.into(), task))
            }
            #[cfg(feature = "redis")]
            Delivery::Redis { url, .. } => {
                let mut config = outbox::confirm::redis::RedisListenConfig::new(
                    url.clone(),
                    REDIS_CONFIRM_STREAM,
                );
                config.group = CONFIRM_QUEUE.into();
                config.consumer = "order-service".into();
                let listen = outbox::confirm::redis::listen(config, store, cancel.clone());
                let task = spawn_service(listen, "cannot read the confirmation stream");
                Ok((REDIS_CONFIRM_STREAM.into(), task))
            }
            #[cfg(feature = "mqtt")]
            Delivery::Mqtt { url, run, .. } => {
                let mut config =
                    outbox::confirm::mqtt::MqttListenConfig::new(url.clone(), MQTT_CONFIRM_TOPIC);
                config.group = format!("{CONFIRM_QUEUE}-{run}");
                config.client_id = format!("demo-order-service-{run}");
                config.session_expiry = Duration::from_secs(60);
                // Subscribed before the consumer can confirm: the session is open when this
                // returns its first poll, so start it and give it its own task.
                let listen = outbox::confirm::mqtt::listen(config, store, cancel.clone());
                let task = spawn_service(listen, "cannot subscribe to the confirmation topic");
                Ok((MQTT_CONFIRM_TOPIC.into(), task))
            }
            #[cfg(feature = "rocketmq")]
            Delivery::RocketMq(r) => {
                let reply = format!("{}:order-service", r.confirm_topic);
                let mut config = outbox::confirm::rocketmq::ListenConfig::new(
                    r.name_server.clone(),
                    reply.clone(),
                    format!("{CONFIRM_QUEUE}_{}", r.run),
                );
                config.route_refresh = Duration::from_secs(10);
                let listen = outbox::confirm::rocketmq::listen(config, store, cancel.clone());
                let task = spawn_service(listen, "RocketMQ confirmation listener failed");
                Ok((reply, task))
            }
            #[cfg(feature = "rabbitmq")]
            Delivery::RabbitMq { config } => {
                let listen = outbox::confirm::rabbitmq::listen(
                    config.clone(),
                    RABBIT_CONFIRM_QUEUE.into(),
                    store,
                    cancel.clone(),
                );
                let task = spawn_service(listen, "RabbitMQ confirmation listener failed");
                Ok((RABBIT_CONFIRM_QUEUE.into(), task))
            }
            #[cfg(feature = "kafka")]
            Delivery::Kafka { config, run, .. } => {
                let topic = format!("{run}.confirmations");
                let listen = outbox::confirm::kafka::listen(
                    (**config).clone(),
                    topic.clone(),
                    format!("{run}.{CONFIRM_QUEUE}"),
                    store,
                    cancel.clone(),
                );
                let task = spawn_service(listen, "the Kafka confirmation listener failed");
                Ok((topic, task))
            }
        }
    }

    /// The consumer side's confirmation sender for this delivery.
    pub(super) fn confirmation_sender(&self) -> Arc<dyn ConfirmationSender> {
        match self {
            Delivery::Webhook { .. } => Arc::new(WebhookConfirmationSender::new()),
            Delivery::Nats { js, .. } => Arc::new(NatsConfirmationSender::new(js.client())),
            #[cfg(feature = "redis")]
            Delivery::Redis { transport, .. } => Arc::new(
                outbox::confirm::redis::RedisConfirmationSender::new(transport.connection()),
            ),
            #[cfg(feature = "mqtt")]
            Delivery::Mqtt { sender, .. } => sender.clone(),
            #[cfg(feature = "rocketmq")]
            Delivery::RocketMq(r) => r.sender.clone(),
            #[cfg(feature = "rabbitmq")]
            Delivery::RabbitMq { config } => Arc::new(
                outbox::confirm::rabbitmq::RabbitMqConfirmationSender::new(config.clone())
                    .expect("validated at open"),
            ),
            #[cfg(feature = "kafka")]
            Delivery::Kafka { sender, .. } => sender.clone(),
        }
    }

    /// A fresh transport for one relay incarnation, and its route destination.
    pub(super) async fn transport(
        &self,
        endpoint: &Endpoint,
    ) -> anyhow::Result<(Arc<dyn Transport>, String)> {
        match self {
            Delivery::Webhook { secret } => {
                let url = endpoint.clone().context("webhook receiver not started")?;
                let mut config = WebhookConfig::new(url);
                config.secret = Some(secret.clone());
                config.timeout = Duration::from_secs(1);
                // Empty destination: post to the configured URL.
                Ok((Arc::new(WebhookTransport::new(config)?), String::new()))
            }
            Delivery::Nats { url, .. } => {
                let mut config = NatsConfig::new(url.clone());
                config.ack_timeout = Duration::from_secs(1);
                let transport = NatsTransport::connect(config).await?;
                Ok((Arc::new(transport), "demo.orders.{topic}".into()))
            }
            #[cfg(feature = "redis")]
            Delivery::Redis { url, .. } => {
                let mut config = outbox::RedisConfig::new(url.clone());
                config.response_timeout = Duration::from_secs(1);
                let transport = outbox::RedisTransport::connect(config).await?;
                Ok((Arc::new(transport), REDIS_STREAM.into()))
            }
            #[cfg(feature = "mqtt")]
            Delivery::Mqtt { url, .. } => {
                let mut config = outbox::MqttConfig::new(url.clone());
                config.ack_timeout = Duration::from_secs(1);
                let transport = outbox::MqttTransport::connect(config).await?;
                Ok((Arc::new(transport), MQTT_TOPICS.into()))
            }
            #[cfg(feature = "rocketmq")]
            Delivery::RocketMq(r) => {
                let mut config = outbox::RocketMqConfig::new(r.name_server.clone());
                config.producer_group = format!("demo_order_relay_{}", r.run);
                config.send_timeout = Duration::from_secs(1);
                let transport = outbox::RocketMqTransport::connect(config).await?;
                Ok((Arc::new(transport), format!("{}:{{topic}}", r.orders_topic)))
            }
            #[cfg(feature = "rabbitmq")]
            Delivery::RabbitMq { config } => {
                let transport = outbox::RabbitMqTransport::connect(config.clone()).await?;
                Ok((Arc::new(transport), format!("{RABBIT_EXCHANGE}/{{topic}}")))
            }
            #[cfg(feature = "kafka")]
            Delivery::Kafka { config, run, .. } => {
                let transport = KafkaTransport::connect((**config).clone()).await?;
                Ok((Arc::new(transport), format!("{run}.{{topic}}")))
            }
        }
    }
}

/// Make the RabbitMQ variant's topology fresh, so runs are independent: the topic exchange
/// [`RABBIT_EXCHANGE`], the queues [`RABBIT_QUEUE`] (bound with `#`, its retry queues deleted) and
/// [`RABBIT_CONFIRM_QUEUE`], deleted and declared again.
#[cfg(feature = "rabbitmq")]
async fn rabbitmq_fresh_queues(url: &str) -> anyhow::Result<()> {
    use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
    use lapin::types::FieldTable;
    let conn = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
        .await
        .with_context(|| format!("cannot connect to RabbitMQ at {}", crate::redact(url)))?;
    let ch = conn.create_channel().await?;
    ch.exchange_declare(
        RABBIT_EXCHANGE.into(),
        lapin::ExchangeKind::Topic,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .with_context(|| format!("cannot declare the exchange {RABBIT_EXCHANGE}"))?;
    let mut stale = vec![RABBIT_QUEUE.to_owned(), RABBIT_CONFIRM_QUEUE.to_owned()];
    for ms in [
        10u64, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 20_000, 50_000, 100_000,
    ] {
        stale.push(outbox::consumer::rabbitmq::retry_queue(
            RABBIT_QUEUE,
            Duration::from_millis(ms),
        ));
    }
    for q in &stale {
        ch.queue_delete(q.as_str().into(), Default::default())
            .await
            .with_context(|| format!("cannot delete the queue {q}"))?;
    }
    for q in [RABBIT_QUEUE, RABBIT_CONFIRM_QUEUE] {
        ch.queue_declare(
            q.into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .with_context(|| format!("cannot declare the queue {q}"))?;
    }
    ch.queue_bind(
        RABBIT_QUEUE.into(),
        RABBIT_EXCHANGE.into(),
        "#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    let _ = conn.close(200, "demo set up".into()).await;
    Ok(())
}
