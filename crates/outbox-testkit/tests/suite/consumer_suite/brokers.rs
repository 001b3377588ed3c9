//! Each broker's part of the consumer conformance suite: its resources, its production runner,
//! and how to put garbage where the runner consumes.

use super::*;

pub(super) mod nats {
    use outbox::consumer::nats::NatsConsumerConfig;
    use outbox_testkit::{NatsFixture, host_port, nats_client_at, nats_url, unique};

    use super::*;

    pub(crate) struct Nats {
        fx: NatsFixture,
        proxy: FaultProxy,
        durable: String,
    }

    #[async_trait]
    impl Broker for Nats {
        async fn new() -> Self {
            Nats {
                fx: NatsFixture::new().await,
                proxy: FaultProxy::start(host_port(&nats_url())).await,
                durable: unique("conformance"),
            }
        }

        fn transport(&self) -> Arc<dyn Transport> {
            self.fx.transport.clone()
        }

        fn destination(&self) -> String {
            format!("{}.orders", self.fx.prefix)
        }

        async fn publish_garbage(&self) {
            let js = async_nats::jetstream::new(outbox_testkit::nats_client().await);
            js.publish(self.destination(), "no headers".into())
                .await
                .unwrap()
                .await
                .unwrap();
        }

        fn spawn(&self, c: Settings, inbox: Inbox<sqlx::Sqlite>, handler: Arc<Script>) -> Runner {
            let mut config = NatsConsumerConfig::new(self.fx.stream.clone(), self.durable.clone());
            config.ack_wait = Duration::from_secs(2);
            config.runner = c.runner();
            let url = format!("nats://{}", self.proxy.addr);
            tokio::spawn(async move {
                let js = async_nats::jetstream::new(nats_client_at(&url).await);
                outbox::consumer::nats::run(js, config, inbox, handler, c.metrics, c.cancel).await
            })
        }

        fn proxy(&self) -> Option<&FaultProxy> {
            Some(&self.proxy)
        }
    }
}

pub(super) mod rabbitmq {
    use outbox::consumer::rabbitmq::RabbitMqConsumerConfig;
    use outbox_testkit::{RabbitMqFixture, rabbitmq_config, rabbitmq_host_port};

    use super::*;

    pub(crate) struct Rabbit {
        fx: RabbitMqFixture,
        proxy: FaultProxy,
    }

    #[async_trait]
    impl Broker for Rabbit {
        async fn new() -> Self {
            Rabbit {
                fx: RabbitMqFixture::new().await,
                proxy: FaultProxy::start(rabbitmq_host_port()).await,
            }
        }

        fn transport(&self) -> Arc<dyn Transport> {
            self.fx.transport.clone()
        }

        fn destination(&self) -> String {
            format!("{}/orders", self.fx.exchange)
        }

        async fn publish_garbage(&self) {
            self.fx.publish_raw(&self.fx.queue, b"no headers").await;
        }

        fn spawn(&self, c: Settings, inbox: Inbox<sqlx::Sqlite>, handler: Arc<Script>) -> Runner {
            let url = format!("amqp://guest:guest@{}/%2f", self.proxy.addr);
            let mut config =
                RabbitMqConsumerConfig::new(rabbitmq_config(&url), self.fx.queue.clone());
            let queue = self.fx.queue.clone();
            for ms in [10u64, 20, 50, 100, 200, 500] {
                self.fx.delete_at_cleanup(&format!("{queue}.retry.{ms}"));
            }
            spawn_runner!(outbox::consumer::rabbitmq::run, config, c, inbox, handler)
        }

        fn proxy(&self) -> Option<&FaultProxy> {
            Some(&self.proxy)
        }
    }
}

pub(super) mod redis {
    use outbox::consumer::redis::RedisConsumerConfig;
    use outbox_testkit::{RedisFixture, host_port, redis_url, unique};

    use super::*;

    pub(crate) struct Redis {
        fx: RedisFixture,
        proxy: FaultProxy,
        group: String,
    }

    #[async_trait]
    impl Broker for Redis {
        async fn new() -> Self {
            Redis {
                fx: RedisFixture::new().await,
                proxy: FaultProxy::start(host_port(&redis_url())).await,
                group: unique("conformance"),
            }
        }

        fn transport(&self) -> Arc<dyn Transport> {
            self.fx.transport.clone()
        }

        fn destination(&self) -> String {
            self.fx.key("orders")
        }

        async fn publish_garbage(&self) {
            let _: String = self
                .fx
                .query(
                    ::redis::cmd("XADD")
                        .arg(self.destination())
                        .arg("*")
                        .arg("junk")
                        .arg("x"),
                )
                .await;
        }

        fn spawn(&self, c: Settings, inbox: Inbox<sqlx::Sqlite>, handler: Arc<Script>) -> Runner {
            let url = format!("redis://{}", self.proxy.addr);
            let mut config = RedisConsumerConfig::new(url, self.destination(), self.group.clone());
            // A stable name: a restart resumes its own pending entries at once.
            config.consumer = format!("{}-c", self.group);
            config.block = Duration::from_millis(200);
            spawn_runner!(outbox::consumer::redis::run, config, c, inbox, handler)
        }

        fn proxy(&self) -> Option<&FaultProxy> {
            Some(&self.proxy)
        }
    }
}

pub(super) mod mqtt {
    use outbox::consumer::mqtt::MqttConsumerConfig;
    use outbox_testkit::{MqttFixture, host_port, mqtt_url, unique};
    use rumqttc::v5::mqttbytes::QoS;
    use rumqttc::v5::mqttbytes::v5::Packet;
    use rumqttc::v5::{AsyncClient, Event, MqttOptions};

    use super::*;

    pub(crate) struct Mqtt {
        fx: MqttFixture,
        proxy: FaultProxy,
        client_id: String,
    }

    impl Mqtt {
        fn filter(&self) -> String {
            format!("{}/orders", self.fx.prefix)
        }
    }

    #[async_trait]
    impl Broker for Mqtt {
        /// MQTT keeps nothing for a topic nobody subscribes to: the consumer's persistent
        /// session is created (and subscribed) here, before anything is published.
        async fn new() -> Self {
            let b = Mqtt {
                fx: MqttFixture::new().await,
                proxy: FaultProxy::start(host_port(&mqtt_url())).await,
                client_id: unique("conformance"),
            };
            let addr = host_port(&mqtt_url());
            let (host, port) = addr.rsplit_once(':').expect("host:port");
            let mut o = MqttOptions::new(&b.client_id, host, port.parse().expect("port"));
            o.set_clean_start(false);
            o.set_session_expiry_interval(Some(600));
            let (client, mut events) = AsyncClient::new(o, 10);
            client
                .subscribe(b.filter(), QoS::AtLeastOnce)
                .await
                .expect("subscribe");
            within("the SUBACK", Duration::from_secs(10), async {
                loop {
                    match events.poll().await {
                        Ok(Event::Incoming(Packet::SubAck(_))) => break,
                        Ok(_) => {}
                        Err(e) => panic!("the MQTT broker at {} failed: {e}", mqtt_url()),
                    }
                }
            })
            .await;
            client.disconnect().await.expect("disconnect");
            while events.poll().await.is_ok() {}
            b
        }

        fn transport(&self) -> Arc<dyn Transport> {
            self.fx.transport.clone()
        }

        fn destination(&self) -> String {
            self.filter()
        }

        async fn publish_garbage(&self) {
            self.fx
                .subscriber
                .publish(self.filter(), QoS::AtLeastOnce, false, "no properties")
                .await
                .expect("publish");
        }

        fn spawn(&self, c: Settings, inbox: Inbox<sqlx::Sqlite>, handler: Arc<Script>) -> Runner {
            let url = format!("mqtt://{}", self.proxy.addr);
            let mut config = MqttConsumerConfig::new(url, self.client_id.clone(), self.filter());
            config.session_expiry = Duration::from_secs(600);
            // The queued messages reach the session one packet at a time: without a wait the
            // first batch may hold only the first of them (the batch properties need more).
            config.batch_wait = Duration::from_millis(100);
            spawn_runner!(outbox::consumer::mqtt::run, config, c, inbox, handler)
        }

        fn proxy(&self) -> Option<&FaultProxy> {
            Some(&self.proxy)
        }
    }
}

pub(super) mod kafka {
    use outbox::consumer::kafka::KafkaConsumerConfig;
    use outbox_testkit::kafka::{KafkaFixture, kafka_config};
    use outbox_testkit::unique;

    use super::*;

    pub(crate) struct Kafka {
        fx: KafkaFixture,
        topic: String,
        group: String,
    }

    #[async_trait]
    impl Broker for Kafka {
        async fn new() -> Self {
            let fx = KafkaFixture::new().await;
            let topic = fx.topic("orders", 2).await;
            Kafka {
                fx,
                topic,
                group: unique("conformance"),
            }
        }

        fn transport(&self) -> Arc<dyn Transport> {
            self.fx.transport.clone()
        }

        fn destination(&self) -> String {
            self.topic.clone()
        }

        async fn publish_garbage(&self) {
            use rdkafka::producer::{FutureProducer, FutureRecord};
            let producer: FutureProducer = kafka_config()
                .client_config()
                .create()
                .expect("a plain Kafka producer");
            producer
                .send(
                    FutureRecord::<(), _>::to(&self.topic).payload("no headers"),
                    Duration::from_secs(10),
                )
                .await
                .expect("produce the garbage record");
        }

        fn spawn(&self, c: Settings, inbox: Inbox<sqlx::Sqlite>, handler: Arc<Script>) -> Runner {
            let mut config =
                KafkaConsumerConfig::new(kafka_config(), self.group.clone(), [self.topic.clone()]);
            // The broker minimum: Tansu holds a new group's first join for about half of it.
            config.session_timeout = Duration::from_secs(6);
            spawn_runner!(outbox::consumer::kafka::run, config, c, inbox, handler)
        }
    }
}

#[cfg(feature = "rocketmq")]
pub(super) mod rocketmq {
    use outbox::consumer::rocketmq::RocketMqConsumerConfig;
    use outbox_testkit::rocketmq::{RocketMqFixture, rocketmq_name_server};

    use super::*;

    pub(crate) struct RocketMq {
        fx: RocketMqFixture,
    }

    #[async_trait]
    impl Broker for RocketMq {
        async fn new() -> Self {
            RocketMq {
                fx: RocketMqFixture::new().await,
            }
        }

        fn transport(&self) -> Arc<dyn Transport> {
            self.fx.transport.clone()
        }

        fn destination(&self) -> String {
            self.fx.topic.clone()
        }

        async fn publish_garbage(&self) {
            let foreign = rocketmq_model::common::message::message_single::Message::builder()
                .topic(self.fx.topic.as_str())
                .body_slice(b"not an outbox message")
                .build()
                .unwrap();
            self.fx
                .transport
                .producer()
                .send_with_timeout(foreign, 5000)
                .await
                .expect("send the foreign message");
        }

        fn spawn(&self, c: Settings, inbox: Inbox<sqlx::Sqlite>, handler: Arc<Script>) -> Runner {
            let mut config = RocketMqConsumerConfig::new(
                rocketmq_name_server(),
                format!("{}_conformance", self.fx.topic),
                self.fx.topic.clone(),
            );
            config.route_refresh = Duration::from_secs(10);
            spawn_runner!(outbox::consumer::rocketmq::run, config, c, inbox, handler)
        }
    }
}
