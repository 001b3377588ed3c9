//! `kafka://`: a topic `bench-<run>-<k>` (1 partition, replication 1) created with the library's
//! admin helper, as `outbox relay` does for `create_topics`; `KafkaTransport` never creates it.
//! Each [`Broker::reset`] creates the next topic (`k` + 1), so that a scenario's consumers
//! reading from the first record see only that scenario's messages.

use super::*;
use outbox::consumer::kafka::KafkaConsumerConfig;
use outbox::transport::kafka::{KafkaTopic, create_topics};
use outbox::{KafkaConfig, KafkaTransport};

/// The Kafka arm.
pub(super) struct Kafka {
    config: KafkaConfig,
    transport: Arc<KafkaTransport>,
    run_id: String,
    /// The current topic and how many were created.
    topic: Mutex<(String, u32)>,
}

impl Kafka {
    /// Create the run's first topic and connect the producer.
    pub(super) async fn open(url: &str, run_id: &str) -> anyhow::Result<Kafka> {
        let config = KafkaConfig::new(url);
        let kafka = Kafka {
            transport: connect(url, KafkaTransport::connect(config.clone())).await?,
            config,
            run_id: run_id.to_owned(),
            topic: Mutex::new((String::new(), 0)),
        };
        kafka.reset().await?;
        Ok(kafka)
    }
}

#[async_trait]
impl Broker for Kafka {
    fn describe(&self) -> String {
        format!(
            "Kafka protocol at {} (topics {}, a new one per scenario, 1 partition, \
             idempotent producer, acks=all, linger {:?}); the messages stored are not \
             counted (the client's high watermarks are not trusted on Tansu) and the topics \
             are left on the broker (the library has no topic deletion)",
            self.config.bootstrap_servers,
            self.topic.lock().expect("poisoned").0,
            self.config.linger
        )
    }

    fn transport(&self) -> Arc<dyn Transport> {
        self.transport.clone()
    }

    fn destination(&self) -> String {
        self.topic.lock().expect("poisoned").0.clone()
    }

    /// Create the next topic and publish to it from now on.
    async fn reset(&self) -> anyhow::Result<()> {
        let k = self.topic.lock().expect("poisoned").1 + 1;
        let topic = format!("bench-{}-{k}", self.run_id);
        create_topics(&self.config, &[KafkaTopic::new(topic.clone())])
            .await
            .with_context(|| {
                format!(
                    "create the topic {topic} on Kafka at {}",
                    self.config.bootstrap_servers
                )
            })?;
        *self.topic.lock().expect("poisoned") = (topic, k);
        Ok(())
    }

    async fn stored(&self) -> anyhow::Result<Option<u64>> {
        Ok(None)
    }

    async fn consume(&self, group: &str, run: ConsumerRun) -> anyhow::Result<ConsumerTask> {
        let mut config = KafkaConsumerConfig::new(self.config.clone(), group, [self.destination()]);
        config.batch = run.fetch;
        config.runner = run.runner.clone();
        run.spawn(config)
    }

    /// Leaves the topics: the library offers topic creation only, and the CLI does not
    /// depend on the Kafka client directly.
    async fn cleanup(&self) -> anyhow::Result<()> {
        let (topic, k) = self.topic.lock().expect("poisoned").clone();
        tracing::info!(last = %topic, topics = k, "the bench topics are left on the Kafka broker");
        Ok(())
    }
}
