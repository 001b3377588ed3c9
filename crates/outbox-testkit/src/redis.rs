//! Redis Streams fixture: a transport on the test server, unique keys `obx_<hex>:…` per test,
//! deleted by [`TransportFixture::cleanup`].

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox::transport::Transport;
use outbox::{RedisConfig, RedisTransport};
use redis::aio::ConnectionManager;
use redis::streams::StreamRangeReply;

use crate::{Received, TransportFixture, unique};

/// Default Redis URL when `OUTBOX_TEST_REDIS_URL` is unset.
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";

/// `OUTBOX_TEST_REDIS_URL`, or [`DEFAULT_REDIS_URL`].
pub fn redis_url() -> String {
    std::env::var("OUTBOX_TEST_REDIS_URL").unwrap_or_else(|_| DEFAULT_REDIS_URL.into())
}

/// A connection to the test Redis.
///
/// # Panics
/// When Redis does not answer within 5 s, naming the URL and `OUTBOX_TEST_REDIS_URL`.
pub async fn redis_conn() -> ConnectionManager {
    let url = redis_url();
    outbox::transport::redis::connect_manager(
        &url,
        None,
        Duration::from_secs(5),
        Duration::from_secs(5),
    )
    .await
    .unwrap_or_else(|e| {
        panic!(
            "Redis is not reachable at {url} ({e}); start redis-server or set OUTBOX_TEST_REDIS_URL"
        )
    })
}

/// A transport on the test Redis with its own key prefix.
pub struct RedisFixture {
    /// The transport.
    pub transport: Arc<RedisTransport>,
    /// Key prefix of this test (`obx_<hex>`); every key it uses starts with it.
    pub prefix: String,
    /// A connection for inspecting and arranging the server's state.
    pub conn: ConnectionManager,
}

impl RedisFixture {
    /// A transport with the default settings (no trimming).
    ///
    /// # Panics
    /// When Redis does not answer (naming `OUTBOX_TEST_REDIS_URL`).
    pub async fn new() -> RedisFixture {
        Self::with_config(RedisConfig::new(redis_url())).await
    }

    /// A transport with `config` (its URL is replaced by the test server's).
    ///
    /// # Panics
    /// As [`RedisFixture::new`].
    pub async fn with_config(mut config: RedisConfig) -> RedisFixture {
        let conn = redis_conn().await;
        config.url = redis_url();
        let transport = RedisTransport::connect(config)
            .await
            .unwrap_or_else(|e| panic!("Redis transport: {e}; is OUTBOX_TEST_REDIS_URL right?"));
        let prefix = unique("obx");
        let mut fx = RedisFixture {
            transport: Arc::new(transport),
            prefix,
            conn,
        };
        let _: () = redis::cmd("SET")
            .arg(fx.key("notastream"))
            .arg("a string, not a stream")
            .query_async(&mut fx.conn)
            .await
            .expect("SET");
        fx
    }

    /// The key `<prefix>:<name>`.
    pub fn key(&self, name: &str) -> String {
        format!("{}:{name}", self.prefix)
    }

    /// Every entry of stream `key`: (entry id, fields).
    ///
    /// # Panics
    /// When Redis fails.
    pub async fn entries(&self, key: &str) -> Vec<(String, BTreeMap<String, Vec<u8>>)> {
        let mut conn = self.conn.clone();
        let reply: StreamRangeReply = redis::cmd("XRANGE")
            .arg(key)
            .arg("-")
            .arg("+")
            .query_async(&mut conn)
            .await
            .expect("XRANGE");
        reply
            .ids
            .into_iter()
            .map(|e| {
                let fields = e
                    .map
                    .into_iter()
                    .map(|(k, v)| {
                        let b = match v {
                            redis::Value::BulkString(b) => b,
                            other => format!("{other:?}").into_bytes(),
                        };
                        (k, b)
                    })
                    .collect();
                (e.id, fields)
            })
            .collect()
    }

    /// Run one command on the fixture's connection.
    ///
    /// # Panics
    /// When Redis refuses it.
    pub async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> T {
        let mut conn = self.conn.clone();
        cmd.query_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{cmd:?}: {e}"))
    }
}

#[async_trait]
impl TransportFixture for RedisFixture {
    fn transport(&self) -> Arc<dyn Transport> {
        self.transport.clone()
    }

    fn good_destination(&self) -> String {
        self.key("ok")
    }

    fn rejecting_destination(&self) -> String {
        // WRONGTYPE: the key holds a string.
        self.key("notastream")
    }

    async fn received(&self) -> Vec<Received> {
        let dest = self.good_destination();
        self.entries(&dest)
            .await
            .into_iter()
            .map(|(_, fields)| {
                let text = |v: &Vec<u8>| String::from_utf8_lossy(v).into_owned();
                Received {
                    native_id: fields.get("id").map(text),
                    headers: fields
                        .iter()
                        .filter_map(|(k, v)| Some((k.strip_prefix("h:")?.to_owned(), text(v))))
                        .collect(),
                    payload: fields.get("payload").cloned().unwrap_or_default(),
                    destination: dest.clone(),
                }
            })
            .collect()
    }

    async fn cleanup(&self) {
        let mut conn = self.conn.clone();
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}*", self.prefix))
            .query_async(&mut conn)
            .await
            .unwrap_or_default();
        if !keys.is_empty() {
            let _: Result<(), _> = redis::cmd("DEL").arg(&keys).query_async(&mut conn).await;
        }
    }
}
