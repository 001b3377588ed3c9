//! The daemon's confirmation listener (`[confirmations]`): one per broker kind, or the HTTP
//! endpoint, in a task of its own.

use std::sync::Arc;

use anyhow::Context;
use outbox::Store;
use outbox::error::ConfigError;
use tokio_util::sync::CancellationToken;

use crate::config;

/// A broker's confirmation listener, to its end: its totals.
type Listen = futures::future::BoxFuture<'static, anyhow::Result<outbox::ConfirmReport>>;

/// A library listener (`outbox::confirm::<broker>::listen(..)`) as a [`Listen`].
fn listener(
    listen: impl std::future::Future<Output = Result<outbox::ConfirmReport, ConfigError>>
    + Send
    + 'static,
) -> Listen {
    Box::pin(async move { Ok(listen.await?) })
}

/// Start the confirmation listener of `[confirmations]`.
pub(crate) async fn spawn(
    c: &config::ConfirmationsSection,
    store: Arc<dyn Store>,
    cancel: CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<anyhow::Result<()>>> {
    let stop = cancel.clone();
    let (broker, listen): (&'static str, Listen) = match c.clone() {
        config::ConfirmationsSection::Nats {
            url,
            subject,
            queue,
        } => {
            let client = outbox::transport::nats::connect_client(&url)
                .await
                .map_err(|e| anyhow::anyhow!("confirmations.url: {e}"))?;
            tracing::info!(subject, queue, "listening for confirmations on NATS");
            (
                "NATS",
                listener(outbox::confirm::nats::listen(
                    client, subject, queue, store, cancel,
                )),
            )
        }
        #[cfg(feature = "kafka")]
        config::ConfirmationsSection::Kafka(k) => {
            let kafka = k.kafka_config()?;
            tracing::info!(
                topic = k.topic,
                group = k.group,
                "listening for confirmations on Kafka"
            );
            (
                "Kafka",
                listener(outbox::confirm::kafka::listen(
                    kafka, k.topic, k.group, store, cancel,
                )),
            )
        }
        #[cfg(feature = "rabbitmq")]
        ref section @ config::ConfirmationsSection::Rabbitmq { ref queue, .. } => {
            let connection = section.rabbitmq()?.context("confirmations: not rabbitmq")?;
            let queue = queue.clone();
            tracing::info!(queue, "listening for confirmations on RabbitMQ");
            (
                "RabbitMQ",
                listener(outbox::confirm::rabbitmq::listen(
                    connection, queue, store, cancel,
                )),
            )
        }
        #[cfg(feature = "redis")]
        ref section @ config::ConfirmationsSection::Redis { .. } => {
            let lc = section.redis()?.context("confirmations: not redis")?;
            tracing::info!(
                stream = lc.stream.as_str(),
                group = %lc.group,
                "listening for confirmations on Redis"
            );
            (
                "Redis",
                listener(outbox::confirm::redis::listen(lc, store, cancel)),
            )
        }
        #[cfg(feature = "mqtt")]
        ref section @ config::ConfirmationsSection::Mqtt { .. } => {
            let lc = section.mqtt()?.context("confirmations: not mqtt")?;
            tracing::info!(
                topic = lc.topic.as_str(),
                group = %lc.group,
                "listening for confirmations on MQTT"
            );
            (
                "MQTT",
                listener(outbox::confirm::mqtt::listen(lc, store, cancel)),
            )
        }
        #[cfg(feature = "rocketmq")]
        ref section @ config::ConfirmationsSection::Rocketmq {
            ref destination,
            ref group,
            ..
        } => {
            let listen = section.rocketmq()?.context("confirmations: not rocketmq")?;
            let (destination, group) = (destination.clone(), group.clone());
            tracing::info!(
                destination,
                group,
                "listening for confirmations on RocketMQ"
            );
            (
                "RocketMQ",
                listener(outbox::confirm::rocketmq::listen(listen, store, cancel)),
            )
        }
        #[cfg(not(feature = "rocketmq"))]
        config::ConfirmationsSection::Rocketmq { .. } => {
            anyhow::bail!(
                "confirmations.kind: RocketMQ support is not compiled in: build outbox-cli with --features rocketmq"
            )
        }
        config::ConfirmationsSection::Http { listen, path } => {
            let socket = tokio::net::TcpListener::bind(&listen)
                .await
                .with_context(|| format!("confirmations.listen: cannot bind {listen}"))?;
            tracing::info!(listen, path, "listening for confirmations over HTTP");
            let app = outbox::confirm::webhook::router(&path, store);
            return Ok(tokio::spawn(async move {
                axum::serve(socket, app)
                    .with_graceful_shutdown(async move { cancel.cancelled().await })
                    .await
                    .context("confirmation endpoint failed")
            }));
        }
    };
    Ok(supervise_listener(broker, stop, listen))
}

/// Run a confirmation listener in a task: log its totals when it stops, and make its stopping
/// an error ("the <broker> confirmation listener ended") unless `stop` was cancelled. Every
/// broker's listener goes through it.
fn supervise_listener(
    broker: &'static str,
    stop: CancellationToken,
    listen: Listen,
) -> tokio::task::JoinHandle<anyhow::Result<()>> {
    tokio::spawn(async move {
        let total = listen.await?;
        tracing::info!(
            broker,
            confirmed = total.confirmed,
            rejected = total.rejected,
            duplicates = total.duplicates,
            unknown = total.unknown,
            "confirmation listener stopped"
        );
        if stop.is_cancelled() {
            Ok(())
        } else {
            anyhow::bail!("the {broker} confirmation listener ended")
        }
    })
}
