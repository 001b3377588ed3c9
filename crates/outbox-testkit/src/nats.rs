//! NATS: the test client and a JetStream stream per test.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox::transport::Transport;
use outbox::{NatsConfig, NatsTransport, StreamSetup};

use crate::{FaultProxy, Received, TransportFixture, host_port, nats_url, unique, within};

/// Connect to the test NATS server and wait until connected.
///
/// # Panics
/// When NATS does not answer within 5 s, naming the URL and `OUTBOX_TEST_NATS_URL`.
pub async fn nats_client() -> async_nats::Client {
    nats_client_at(&nats_url()).await
}

/// The current info of JetStream stream `stream` (its state: messages stored, sequences).
///
/// # Panics
/// When the stream cannot be read, naming it and the error.
pub async fn nats_stream_info(
    js: &async_nats::jetstream::Context,
    stream: &str,
) -> async_nats::jetstream::stream::Info {
    let mut s = js
        .get_stream(stream)
        .await
        .unwrap_or_else(|e| panic!("get stream {stream}: {e}"));
    s.info()
        .await
        .unwrap_or_else(|e| panic!("info of stream {stream}: {e}"))
        .clone()
}

/// Connect to NATS at `url` (for example through a [`FaultProxy`]).
///
/// # Panics
/// As [`nats_client`].
pub async fn nats_client_at(url: &str) -> async_nats::Client {
    let seeds = outbox::transport::nats::seeds(url).unwrap_or_else(|e| panic!("{e}"));
    let connect = outbox::transport::nats::connect_options(url)
        .connection_timeout(Duration::from_secs(5))
        .connect(seeds);
    match tokio::time::timeout(Duration::from_secs(5), connect).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => panic!(
            "NATS is not reachable at {url} ({e}); start nats-server -js or set OUTBOX_TEST_NATS_URL"
        ),
        Err(_) => panic!(
            "NATS at {url} did not answer within 5 s; start nats-server -js or set OUTBOX_TEST_NATS_URL"
        ),
    }
}

/// A JetStream stream `<NAME>` capturing `<name>.>` for one test.
pub struct NatsFixture {
    /// The transport.
    pub transport: Arc<NatsTransport>,
    /// Stream name.
    pub stream: String,
    /// Subject prefix captured by the stream (`prefix.>`).
    pub prefix: String,
}

impl NatsFixture {
    /// Connect and create the stream.
    ///
    /// # Panics
    /// When NATS does not answer (naming `OUTBOX_TEST_NATS_URL`) or the stream cannot be created.
    pub async fn new() -> NatsFixture {
        let client = nats_client().await;
        Self::with_client(client).await
    }

    /// As [`NatsFixture::new`], its client connected through a fresh [`FaultProxy`] in front of
    /// the test server (to cut or stall the connection): the proxy and the fixture.
    ///
    /// # Panics
    /// As [`NatsFixture::new`].
    pub async fn behind_proxy() -> (FaultProxy, NatsFixture) {
        let proxy = FaultProxy::start(host_port(&nats_url())).await;
        let client = nats_client_at(&format!("nats://{}", proxy.addr)).await;
        (proxy, NatsFixture::with_client(client).await)
    }

    /// As [`NatsFixture::new`] with an existing client (for example through a [`FaultProxy`]).
    ///
    /// # Panics
    /// When the stream cannot be created.
    pub async fn with_client(client: async_nats::Client) -> NatsFixture {
        let prefix = unique("obx");
        let stream = prefix.to_ascii_uppercase();
        let mut config = NatsConfig::new(nats_url());
        config.ack_timeout = Duration::from_secs(2);
        config.stream = Some(StreamSetup {
            name: stream.clone(),
            subjects: vec![format!("{prefix}.>")],
            create: true,
            replicas: 1,
        });
        let transport = NatsTransport::from_client(client, config)
            .await
            .unwrap_or_else(|e| panic!("NATS JetStream stream setup failed: {e}; is JetStream enabled (nats-server -js)?"));
        NatsFixture {
            transport: Arc::new(transport),
            stream,
            prefix,
        }
    }

    /// The destination template that sends each topic to a subject of its own in the stream:
    /// `<prefix>.{topic}`.
    pub fn topic_destination(&self) -> String {
        format!("{}.{{topic}}", self.prefix)
    }

    /// Messages stored in the stream.
    ///
    /// # Panics
    /// When the stream cannot be read.
    pub async fn stored(&self) -> u64 {
        nats_stream_info(self.transport.jetstream(), &self.stream)
            .await
            .state
            .messages
    }
}

#[async_trait]
impl TransportFixture for NatsFixture {
    fn transport(&self) -> Arc<dyn Transport> {
        self.transport.clone()
    }

    fn good_destination(&self) -> String {
        format!("{}.ok", self.prefix)
    }

    /// A subject with a space: refused before sending (a subject no stream captures is not a
    /// permanent refusal: it pauses the transport until a stream exists).
    fn rejecting_destination(&self) -> String {
        format!("{}.no stream", self.prefix)
    }

    async fn received(&self) -> Vec<Received> {
        use futures::StreamExt as _;
        let stream = self
            .transport
            .jetstream()
            .get_stream(&self.stream)
            .await
            .expect("get stream");
        let consumer = stream
            .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig {
                ..Default::default()
            })
            .await
            .expect("ordered consumer");
        let n = self.stored().await as usize;
        let mut out = Vec::with_capacity(n);
        if n == 0 {
            return out;
        }
        let mut msgs = consumer.messages().await.expect("messages");
        while out.len() < n {
            let m = within("stream messages", Duration::from_secs(5), msgs.next())
                .await
                .expect("stream ended")
                .expect("stream message");
            let headers: BTreeMap<String, String> = m
                .headers
                .as_ref()
                .map(|h| {
                    h.iter()
                        .filter_map(|(k, v)| Some((k.to_string(), v.first()?.to_string())))
                        .collect()
                })
                .unwrap_or_default();
            out.push(Received {
                native_id: headers.get("Nats-Msg-Id").cloned(),
                headers,
                payload: m.payload.to_vec(),
                destination: m.subject.to_string(),
            });
        }
        out
    }

    async fn cleanup(&self) {
        let _ = self.transport.jetstream().delete_stream(&self.stream).await;
    }
}
