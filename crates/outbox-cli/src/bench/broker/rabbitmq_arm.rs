//! `amqp://`: a durable queue `bench.<run>`, published to through the default exchange by
//! `RabbitMqTransport` (destination = the bare queue name).

use super::*;
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions, QueuePurgeOptions};
use lapin::types::FieldTable;
use outbox::{RabbitMqConfig, RabbitMqTransport};

/// Close a channel the bench opened for one operation (a channel left open is closed with
/// the connection, which lapin logs as an error when it was already closing).
async fn close(ch: lapin::Channel) {
    if ch.status().connected() {
        let _ = ch.close(200, "done".into()).await;
    }
}

/// Run `op` on a fresh channel of `conn` (a refused operation closes the channel it ran on),
/// closed afterwards: its result, an error naming `what`.
async fn on_channel<T, F>(
    conn: &lapin::Connection,
    what: impl FnOnce() -> String,
    op: impl FnOnce(lapin::Channel) -> F,
) -> anyhow::Result<T>
where
    F: std::future::Future<Output = Result<T, lapin::Error>>,
{
    let ch = conn
        .create_channel()
        .await
        .context("open a RabbitMQ channel")?;
    let r = op(ch.clone()).await;
    close(ch).await;
    r.with_context(what)
}

/// The RabbitMQ arm.
pub(super) struct Rabbit {
    /// The URL redacted, for the report.
    url: String,
    /// The URL as given, for the consumer.
    raw_url: String,
    /// The bench's own connection, for declaring, purging, counting and deleting the queue.
    conn: lapin::Connection,
    transport: Arc<RabbitMqTransport>,
    queue: String,
}

impl Rabbit {
    /// Declare the run's queue (durable, classic) and connect the transport.
    pub(super) async fn open(url: &str, run_id: &str) -> anyhow::Result<Rabbit> {
        let redacted = crate::redact(url);
        let conn = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
            .await
            .with_context(|| format!("cannot connect to RabbitMQ at {redacted}"))?;
        let queue = format!("bench.{run_id}");
        let (name, declare) = (queue.as_str(), QueueDeclareOptions::durable());
        on_channel(
            &conn,
            || format!("declare the queue {name}"),
            |ch| async move {
                ch.queue_declare(name.into(), declare, FieldTable::default())
                    .await
            },
        )
        .await?;
        let config = RabbitMqConfig::new(url);
        Ok(Rabbit {
            transport: connect(&redacted, RabbitMqTransport::connect(config)).await?,
            url: redacted.to_string(),
            raw_url: url.to_owned(),
            conn,
            queue,
        })
    }
}

#[async_trait]
impl Broker for Rabbit {
    fn describe(&self) -> String {
        format!(
            "RabbitMQ at {} (durable classic queue {} through the default exchange, \
             persistent messages, publisher confirms; no consumer, so the count stays \
             exact)",
            self.url, self.queue
        )
    }

    fn transport(&self) -> Arc<dyn Transport> {
        self.transport.clone()
    }

    fn destination(&self) -> String {
        self.queue.clone()
    }

    async fn reset(&self) -> anyhow::Result<()> {
        let queue = self.queue.as_str();
        on_channel(
            &self.conn,
            || format!("purge the queue {queue}"),
            |ch| async move {
                ch.queue_purge(queue.into(), QueuePurgeOptions::default())
                    .await
            },
        )
        .await?;
        Ok(())
    }

    async fn stored(&self) -> anyhow::Result<Option<u64>> {
        let queue = self.queue.as_str();
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let q = on_channel(
            &self.conn,
            || format!("count the queue {queue}"),
            |ch| async move {
                ch.queue_declare(queue.into(), passive, FieldTable::default())
                    .await
            },
        )
        .await?;
        Ok(Some(u64::from(q.message_count())))
    }

    // `observe` is the default (no subscriber): the default exchange routes a message to
    // the one queue named by its routing key, so a consumer could only read the queue that
    // `Broker::stored` counts, and would take the messages off it (the drain check would
    // then see a loss).

    fn consuming_removes(&self) -> bool {
        true
    }

    /// The queue's consumer (`group` does not apply: a queue is one group).
    async fn consume(&self, _group: &str, run: ConsumerRun) -> anyhow::Result<ConsumerTask> {
        let mut config = outbox::consumer::rabbitmq::RabbitMqConsumerConfig::new(
            RabbitMqConfig::new(&self.raw_url),
            &self.queue,
        );
        config.batch = u16::try_from(run.fetch).context("--consumer-fetch above 65535")?;
        config.runner = run.runner.clone();
        run.spawn(config)
    }

    async fn cleanup(&self) -> anyhow::Result<()> {
        let queue = self.queue.as_str();
        let r = on_channel(
            &self.conn,
            || format!("delete the queue {queue}"),
            |ch| async move {
                ch.queue_delete(queue.into(), QueueDeleteOptions::default())
                    .await
            },
        )
        .await;
        let _ = self.conn.close(200, "bench done".into()).await;
        r?;
        Ok(())
    }
}
