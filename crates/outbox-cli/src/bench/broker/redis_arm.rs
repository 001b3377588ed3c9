//! `redis://`: every message is `XADD`ed to the stream key `bench:<run>` by `RedisTransport`.

use super::*;
use outbox::transport::redis::{FIELD_ID, connect_manager};
use outbox::{RedisConfig, RedisTransport};
use redis::aio::ConnectionManager;
use redis::streams::StreamReadReply;

/// How long one `XREAD` of the latency subscriber blocks for new entries.
const BLOCK: Duration = Duration::from_millis(500);

/// The Redis Streams arm.
pub(super) struct Redis {
    config: RedisConfig,
    transport: Arc<RedisTransport>,
    key: String,
}

impl Redis {
    /// Connect the transport and empty the run's stream key.
    pub(super) async fn open(url: &str, run_id: &str) -> anyhow::Result<Redis> {
        let config = RedisConfig::new(url);
        let r = Redis {
            transport: connect(url, RedisTransport::connect(config.clone())).await?,
            config,
            key: format!("bench:{run_id}"),
        };
        r.delete().await?;
        Ok(r)
    }

    async fn delete(&self) -> anyhow::Result<()> {
        redis::cmd("DEL")
            .arg(&self.key)
            .query_async::<i64>(&mut self.transport.connection())
            .await
            .with_context(|| format!("DEL {}", self.key))?;
        Ok(())
    }
}

#[async_trait]
impl Broker for Redis {
    fn describe(&self) -> String {
        format!(
            "Redis Streams at {} (stream key {}, XADD without MAXLEN; durability as the \
             server's persistence settings)",
            self.config.url, self.key
        )
    }

    fn transport(&self) -> Arc<dyn Transport> {
        self.transport.clone()
    }

    fn destination(&self) -> String {
        self.key.clone()
    }

    async fn reset(&self) -> anyhow::Result<()> {
        self.delete().await
    }

    async fn stored(&self) -> anyhow::Result<Option<u64>> {
        let n: u64 = redis::cmd("XLEN")
            .arg(&self.key)
            .query_async(&mut self.transport.connection())
            .await
            .with_context(|| format!("XLEN {}", self.key))?;
        Ok(Some(n))
    }

    async fn observe(
        &self,
        receipts: Arc<Receipts>,
        cancel: CancellationToken,
    ) -> anyhow::Result<Option<JoinHandle<()>>> {
        // A connection of its own: a blocking XREAD on the transport's multiplexed
        // connection would hold the relay's XADDs behind it.
        let mut conn: ConnectionManager = connect_manager(
            &self.config.url,
            self.config.password.as_deref(),
            self.config.connect_timeout,
            BLOCK + self.config.response_timeout,
        )
        .await
        .context("connect the latency subscriber")?;
        // Everything after the last entry there now (none right after `reset`), read from
        // that id on so no entry published before the first XREAD is missed.
        let last: Vec<(String, Vec<(String, Vec<u8>)>)> = redis::cmd("XREVRANGE")
            .arg(&self.key)
            .arg("+")
            .arg("-")
            .arg("COUNT")
            .arg(1)
            .query_async(&mut conn)
            .await
            .with_context(|| format!("XREVRANGE {}", self.key))?;
        let mut from = last
            .into_iter()
            .next()
            .map(|(id, _)| id)
            .unwrap_or_else(|| "0-0".into());
        let key = self.key.clone();
        Ok(Some(tokio::spawn(async move {
            loop {
                let mut cmd = redis::cmd("XREAD");
                cmd.arg("COUNT")
                    .arg(10_000)
                    .arg("BLOCK")
                    .arg(BLOCK.as_millis() as u64)
                    .arg("STREAMS")
                    .arg(&key)
                    .arg(&from);
                let read = tokio::select! {
                    _ = cancel.cancelled() => return,
                    r = cmd.query_async::<Option<StreamReadReply>>(&mut conn) => r,
                };
                match read {
                    Ok(reply) => {
                        let at = now_us();
                        for entry in reply.into_iter().flat_map(|r| r.keys).flat_map(|k| k.ids) {
                            let id = entry
                                .get::<String>(FIELD_ID)
                                .and_then(|v| Uuid::parse_str(&v).ok());
                            if let Some(id) = id {
                                receipts.record(id, at);
                            }
                            from = entry.id;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "latency subscriber: XREAD failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        })))
    }

    async fn consume(&self, group: &str, run: ConsumerRun) -> anyhow::Result<ConsumerTask> {
        let mut config =
            outbox::consumer::redis::RedisConsumerConfig::new(&self.config.url, &self.key, group);
        config.password = self.config.password.clone();
        config.batch = run.fetch;
        config.runner = run.runner.clone();
        run.spawn(config)
    }

    async fn cleanup(&self) -> anyhow::Result<()> {
        self.delete().await
    }
}
