//! RocketMQ fixtures (feature `rocketmq`): the name server URL from `OUTBOX_TEST_ROCKETMQ_URL`
//! (default [`DEFAULT_ROCKETMQ_URL`]), a transport that has proven the broker answers, and
//! [`RocketMqFixture`], a fresh topic per test with a view of what the broker stored.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox::transport::rocketmq::{
    RocketMqConfig, RocketMqTransport, client_config, client_runtime,
};
use outbox::transport::{Outgoing, Transport};
use rocketmq_client_rust::{
    ConsumeConcurrentlyContext, ConsumeConcurrentlyStatus, DefaultMQPushConsumer, MQPushConsumer,
};
use rocketmq_model::common::consumer::consume_from_where::ConsumeFromWhere;
use rocketmq_model::common::message::message_ext::MessageExt;

use crate::{Received, TransportFixture, claimed_message, unique, wait_until};

/// Default RocketMQ name server URL when `OUTBOX_TEST_ROCKETMQ_URL` is unset (the port `.ci/run`
/// starts the name server on).
pub const DEFAULT_ROCKETMQ_URL: &str = "rocketmq://127.0.0.1:19876";

/// `OUTBOX_TEST_ROCKETMQ_URL`, or [`DEFAULT_ROCKETMQ_URL`].
pub fn rocketmq_url() -> String {
    std::env::var("OUTBOX_TEST_ROCKETMQ_URL").unwrap_or_else(|_| DEFAULT_ROCKETMQ_URL.into())
}

/// The name server list of [`rocketmq_url`].
///
/// # Panics
/// When the URL is not `rocketmq://host:port[;host:port…]`, naming `OUTBOX_TEST_ROCKETMQ_URL`.
pub fn rocketmq_name_server() -> String {
    let url = rocketmq_url();
    outbox::transport::rocketmq::name_server_of_url(&url).unwrap_or_else(|e| {
        panic!("OUTBOX_TEST_ROCKETMQ_URL={url:?} is not a rocketmq://host:port URL: {e}")
    })
}

/// Connect a transport with `config` and wait (up to 30 s) until the broker acknowledges a send
/// to the topic `outbox_ready`, so tests start against a registered broker.
///
/// # Panics
/// When the name server or the broker does not answer, naming the URL and
/// `OUTBOX_TEST_ROCKETMQ_URL`.
pub async fn rocketmq_transport(config: RocketMqConfig) -> RocketMqTransport {
    let url = rocketmq_url();
    let transport = RocketMqTransport::connect(config).await.unwrap_or_else(|e| {
        panic!(
            "RocketMQ is not reachable at {url} ({e}); start the name server and broker (.ci/run) or set OUTBOX_TEST_ROCKETMQ_URL"
        )
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let probe = claimed_message("ready", "ready");
    loop {
        let r = transport
            .publish(&[Outgoing {
                message: &probe,
                destination: "outbox_ready",
            }])
            .await
            .pop()
            .expect("one result");
        match r {
            Ok(()) => return transport,
            Err(e) if tokio::time::Instant::now() > deadline => panic!(
                "the RocketMQ broker behind {url} does not acknowledge sends ({}); start it (.ci/run) or set OUTBOX_TEST_ROCKETMQ_URL",
                e.report()
            ),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// A fresh topic `obx_<hex>` with 4 queues, created before the test, and a transport.
pub struct RocketMqFixture {
    /// The transport.
    pub transport: Arc<RocketMqTransport>,
    /// The topic of this test.
    pub topic: String,
}

impl RocketMqFixture {
    /// Connect and create the topic.
    ///
    /// # Panics
    /// When RocketMQ does not answer (naming `OUTBOX_TEST_ROCKETMQ_URL`) or the topic cannot be
    /// created.
    pub async fn new() -> RocketMqFixture {
        Self::with_config(RocketMqConfig::new(rocketmq_name_server())).await
    }

    /// As [`RocketMqFixture::new`] with a transport built from `config`.
    ///
    /// # Panics
    /// As [`RocketMqFixture::new`].
    pub async fn with_config(config: RocketMqConfig) -> RocketMqFixture {
        let transport = rocketmq_transport(config).await;
        let topic = unique("obx");
        create_topic(&transport, &topic).await;
        RocketMqFixture {
            transport: Arc::new(transport),
            topic,
        }
    }

    /// Messages the broker stored in the topic: the sum of its queues' max offsets.
    ///
    /// # Panics
    /// When the offsets cannot be read.
    pub async fn stored(&self) -> u64 {
        let mut p = self.transport.producer().clone();
        let queues = p
            .fetch_publish_message_queues(&self.topic)
            .await
            .expect("queues of the test topic");
        let mut n = 0;
        for q in &queues {
            n += p.max_offset(q).await.expect("max offset").max(0) as u64;
        }
        n
    }

    /// Every message stored in the topic, read from the start by a fresh consumer group, in
    /// store order.
    ///
    /// # Panics
    /// When they cannot be read within 30 s.
    pub async fn messages(&self) -> Vec<MessageExt> {
        let n = self.stored().await as usize;
        if n == 0 {
            return Vec::new();
        }
        read_topic(&self.topic, n).await
    }
}

/// Create `topic` with 4 queues and wait until the name server routes it.
///
/// # Panics
/// When it cannot be created within 30 s.
pub async fn create_topic(transport: &RocketMqTransport, topic: &str) {
    transport
        .create_topic(topic, 4)
        .await
        .unwrap_or_else(|e| panic!("cannot create RocketMQ topic {topic}: {}", e.report()));
    let p = transport.producer().clone();
    wait_until(
        &format!("the name server to route {topic}"),
        Duration::from_secs(30),
        || {
            let mut p = p.clone();
            async move {
                p.fetch_publish_message_queues(topic)
                    .await
                    .is_ok_and(|q| !q.is_empty())
            }
        },
    )
    .await;
}

/// Read the first `n` distinct messages of `topic` with a fresh consumer group (from the first
/// offset), in store order.
///
/// # Panics
/// When fewer than `n` arrive within 30 s.
pub async fn read_topic(topic: &str, n: usize) -> Vec<MessageExt> {
    let seen: Arc<Mutex<Vec<MessageExt>>> = Arc::default();
    let sink = seen.clone();
    let config = client_config(&rocketmq_name_server(), "reader", Duration::from_secs(3));
    let mut consumer =
        DefaultMQPushConsumer::builder(client_runtime().expect("RocketMQ client runtime"))
            .client_config(config)
            .consumer_group(unique("reader"))
            .consume_from_where(ConsumeFromWhere::ConsumeFromFirstOffset)
            .consume_message_batch_max_size(32)
            .build();
    consumer.subscribe(topic, "*").await.expect("subscribe");
    consumer.register_message_listener_concurrently(
        move |msgs: &[&MessageExt], _: &ConsumeConcurrentlyContext| {
            sink.lock()
                .expect("poisoned")
                .extend(msgs.iter().map(|m| (*m).clone()));
            Ok(ConsumeConcurrentlyStatus::ConsumeSuccess)
        },
    );
    consumer.start().await.expect("start the reader");
    let distinct = |v: &[MessageExt]| {
        v.iter()
            .map(|m| (m.queue_id(), m.queue_offset()))
            .collect::<HashSet<_>>()
            .len()
    };
    wait_until(
        &format!("{n} messages of {topic}"),
        Duration::from_secs(30),
        || {
            let k = distinct(&seen.lock().expect("poisoned"));
            async move { k >= n }
        },
    )
    .await;
    consumer.shutdown().await;
    let mut all = std::mem::take(&mut *seen.lock().expect("poisoned"));
    let mut keep = HashSet::new();
    all.retain(|m| keep.insert((m.queue_id(), m.queue_offset())));
    all.sort_by_key(|m| (m.store_timestamp(), m.queue_id(), m.queue_offset()));
    all
}

/// A stored message as the conformance suite sees it: `UNIQ_KEY` as the native id, the user
/// properties as headers, `topic[:tag]` as the destination.
pub fn received_of(m: &MessageExt) -> Received {
    let headers: BTreeMap<String, String> = outbox::consumer::rocketmq::user_properties(m)
        .into_iter()
        .collect();
    let native_id = m.properties().get("UNIQ_KEY").map(|v| v.to_string());
    let destination = match m.get_tags() {
        Some(tag) => format!("{}:{tag}", m.topic()),
        None => m.topic().to_string(),
    };
    Received {
        native_id,
        headers,
        payload: m.body().map(|b| b.to_vec()).unwrap_or_default(),
        destination,
    }
}

#[async_trait]
impl TransportFixture for RocketMqFixture {
    fn transport(&self) -> Arc<dyn Transport> {
        self.transport.clone()
    }

    fn good_destination(&self) -> String {
        format!("{}:ok", self.topic)
    }

    /// A destination that is not a RocketMQ topic name (a dot): refused before sending.
    fn rejecting_destination(&self) -> String {
        format!("{}.invalid", self.topic)
    }

    async fn received(&self) -> Vec<Received> {
        self.messages().await.iter().map(received_of).collect()
    }

    async fn cleanup(&self) {
        self.transport.shutdown().await;
    }
}
