//! MQTT fixture: a transport on the test broker and a subscriber recording what arrives under a
//! unique topic prefix `obx_<hex>/…` (MQTT keeps nothing for topics nobody subscribes to, so the
//! subscriber is in place before anything is published).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox::transport::Transport;
use outbox::{MqttConfig, MqttTransport};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{Packet, Publish};
use rumqttc::v5::{AsyncClient, Event, MqttOptions};
use uuid::Uuid;

use crate::{Received, TransportFixture, unique, wait_until};

/// Default MQTT URL when `OUTBOX_TEST_MQTT_URL` is unset.
pub const DEFAULT_MQTT_URL: &str = "mqtt://127.0.0.1:1883";

/// `OUTBOX_TEST_MQTT_URL`, or [`DEFAULT_MQTT_URL`].
pub fn mqtt_url() -> String {
    std::env::var("OUTBOX_TEST_MQTT_URL").unwrap_or_else(|_| DEFAULT_MQTT_URL.into())
}

/// An MQTT transport to `url` with the test defaults (2 s PUBACK timeout).
///
/// # Panics
/// When the broker does not answer, naming the URL and `OUTBOX_TEST_MQTT_URL`.
pub async fn mqtt_transport(mut config: MqttConfig) -> MqttTransport {
    config.ack_timeout = Duration::from_secs(2);
    let url = config.url.clone();
    MqttTransport::connect(config).await.unwrap_or_else(|e| {
        panic!("the MQTT broker is not reachable at {url} ({e}); start mosquitto or set OUTBOX_TEST_MQTT_URL")
    })
}

/// A transport and a recording subscriber on the test broker.
pub struct MqttFixture {
    /// The transport.
    pub transport: Arc<MqttTransport>,
    /// Topic prefix of this test (`obx_<hex>`).
    pub prefix: String,
    /// The recording subscriber's client (subscribed to `<prefix>/#`).
    pub subscriber: AsyncClient,
    collected: Arc<Mutex<Vec<Publish>>>,
    driver: tokio::task::JoinHandle<()>,
}

impl MqttFixture {
    /// Connect the transport and the subscriber.
    ///
    /// # Panics
    /// When the broker does not answer (naming `OUTBOX_TEST_MQTT_URL`).
    pub async fn new() -> MqttFixture {
        Self::with_config(MqttConfig::new(mqtt_url())).await
    }

    /// As [`MqttFixture::new`] with `config` for the transport.
    ///
    /// # Panics
    /// As [`MqttFixture::new`].
    pub async fn with_config(config: MqttConfig) -> MqttFixture {
        let prefix = unique("obx");
        let url = mqtt_url();
        let addr = outbox::transport::mqtt::parse_url(&url)
            .unwrap_or_else(|e| panic!("OUTBOX_TEST_MQTT_URL {url:?}: {e}"));
        let mut o = MqttOptions::new(format!("{prefix}-sub"), addr.host, addr.port);
        o.set_clean_start(true);
        let (subscriber, mut eventloop) = AsyncClient::new(o, 1000);
        subscriber
            .subscribe(format!("{prefix}/#"), QoS::AtLeastOnce)
            .await
            .expect("subscribe request");
        // Wait for the SUBACK so nothing published from now on is missed.
        let subscribed = async {
            loop {
                match eventloop.poll().await {
                    Ok(Event::Incoming(Packet::SubAck(_))) => return,
                    Ok(_) => {}
                    Err(e) => panic!(
                        "the MQTT broker is not reachable at {url} ({e}); start mosquitto or set OUTBOX_TEST_MQTT_URL"
                    ),
                }
            }
        };
        crate::within(
            "the recording subscription",
            Duration::from_secs(5),
            subscribed,
        )
        .await;
        let collected: Arc<Mutex<Vec<Publish>>> = Arc::default();
        let c = collected.clone();
        let driver = tokio::spawn(async move {
            loop {
                match eventloop.poll().await {
                    Ok(Event::Incoming(Packet::Publish(p))) => c.lock().expect("poisoned").push(p),
                    Ok(_) => {}
                    Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
        });
        let mut config = config;
        config.url = url;
        let transport = Arc::new(mqtt_transport(config).await);
        MqttFixture {
            transport,
            prefix,
            subscriber,
            collected,
            driver,
        }
    }

    /// The topic `<prefix>/<name>`.
    pub fn topic(&self, name: &str) -> String {
        format!("{}/{name}", self.prefix)
    }

    /// Everything the subscriber received on `topic`, after a sentinel published to it now has
    /// arrived (the broker delivers one topic's messages in order, so everything acknowledged
    /// before the sentinel has arrived too).
    ///
    /// # Panics
    /// When the sentinel does not arrive within 5 s.
    pub async fn received_on(&self, topic: &str) -> Vec<Publish> {
        let sentinel = format!("sentinel-{}", Uuid::now_v7());
        self.subscriber
            .publish(topic, QoS::AtLeastOnce, false, sentinel.clone())
            .await
            .expect("sentinel publish");
        wait_until("the sentinel", Duration::from_secs(5), || async {
            self.collected
                .lock()
                .expect("poisoned")
                .iter()
                .any(|p| p.payload == sentinel.as_bytes())
        })
        .await;
        self.collected
            .lock()
            .expect("poisoned")
            .iter()
            .filter(|p| p.topic == topic.as_bytes() && !p.payload.starts_with(b"sentinel-"))
            .cloned()
            .collect()
    }
}

impl Drop for MqttFixture {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

#[async_trait]
impl TransportFixture for MqttFixture {
    fn transport(&self) -> Arc<dyn Transport> {
        self.transport.clone()
    }

    fn good_destination(&self) -> String {
        self.topic("ok")
    }

    fn rejecting_destination(&self) -> String {
        // A wildcard is not a topic name: refused (permanent) before it reaches the broker.
        self.topic("bad/+")
    }

    async fn received(&self) -> Vec<Received> {
        let topic = self.good_destination();
        self.received_on(&topic)
            .await
            .into_iter()
            .map(|p| {
                let native_id = p
                    .properties
                    .as_ref()
                    .and_then(|pr| pr.correlation_data.as_ref())
                    .and_then(|c| Uuid::from_slice(c).ok())
                    .map(|u| u.to_string());
                let (headers, payload) = outbox::transport::mqtt::decode(&p);
                Received {
                    native_id,
                    headers,
                    payload,
                    destination: String::from_utf8_lossy(&p.topic).into_owned(),
                }
            })
            .collect()
    }

    async fn cleanup(&self) {
        let _ = self.subscriber.disconnect().await;
    }
}
