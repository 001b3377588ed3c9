//! HTTP webhook transport: one `POST` per message, `2xx` is the acknowledgement.
//!
//! Deliveries follow the Standard Webhooks specification (<https://www.standardwebhooks.com/>):
//! `webhook-id` = message id, `webhook-timestamp` = Unix seconds, and, when a secret is
//! configured, `webhook-signature` = `v1,` + base64(HMAC-SHA256(key, "{id}.{timestamp}.{body}"))
//! where `key` is the base64-decoded part of a `whsec_…` secret. Receivers in any language can
//! verify them with that specification's libraries. The body is the payload, byte-exact; the
//! message's headers travel as HTTP headers (`outbox-message-id`, `outbox-topic`,
//! `outbox-partition-key`, `outbox-attempt`, `traceparent`, user headers).
//!
//! # What HTTP can carry
//! [`WebhookTransport::check`](Transport::check) refuses, as permanent, before anything is sent:
//! a header name that is not an HTTP token (RFC 9110 §5.1: no space, `:`, control or non-ASCII
//! character), a header value, topic or partition key (they travel as `outbox-topic` and
//! `outbox-partition-key`) with a control character other than tab (CR and LF included), a user
//! header the HTTP client or the transport owns (`Host`, `Content-Length`, `Transfer-Encoding`,
//! `Connection`, `Keep-Alive`, `Proxy-*`, `TE`, `Trailer`, `Upgrade`, `Expect`, and the
//! `webhook-*` headers the transport sets and signs: a `webhook-signature` from a row would pass
//! for the relay's own on an unsigned transport), and a destination that is not a URL.
//! `Content-Type` and the other representation headers stay the user's.
//!
//! Classification of the answer: `2xx` acknowledged; `429` a busy destination
//! ([`TransportError::destination_busy`]: the receiver sheds load; no attempt is counted and the
//! relay backs that URL off alone); `408`, `425` and `5xx` retryable (a `503` too: receivers
//! answer it for one message's transient failure);
//! `401` and `403` `Unavailable` (the receiver refuses the transport's credentials or signature: a
//! configuration fault, not the message's; the relay pauses the transport, counts no attempt and
//! publishes once the receiver accepts again); `404` a missing destination (`Unavailable`; the
//! relay dead-letters after its `missing_destination_grace`, default 5 min); any other status
//! permanent (the receiver refused the message; it goes to FAILED with the status and the start
//! of the body). A refused connection or a failed TLS handshake (an untrusted certificate) is
//! `Unavailable` (the relay pauses and probes); a timeout is retryable.
//!
//! The probe of an `https` URL makes a `HEAD` request to it (any HTTP answer will do), so it
//! fails as long as the TLS handshake does, and a transport with a certificate problem stays
//! paused instead of flapping up and down; an `http` URL is probed with a TCP connect.
//!
//! Up to [`WebhookConfig::concurrency`] requests of a batch are in flight at once, each bounded
//! by [`WebhookConfig::timeout`]; each answer is recorded as it comes, so a hanging request holds
//! back only its own message, and when the relay's `publish_timeout` cuts the batch short, the
//! answered messages keep their outcome and the ones not yet sent are released untouched.

use std::time::Duration;

use async_trait::async_trait;
use base64::Engine;
use futures::StreamExt;
use hmac::{Hmac, Mac};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use sha2::Sha256;

use super::wire::{self, Broker, HeaderRules};
use super::{Acks, Outgoing, Transport};
use crate::error::{ConfigError, TransportError};
use crate::transport::settings::fill_secret;

/// The header rules of HTTP as the `http` crate enforces them: a name is a token, a value has no
/// control character but tab.
const HTTP_HEADERS: HeaderRules = HeaderRules {
    broker: Broker::Webhook,
    name: |n| match HeaderName::try_from(n) {
        Ok(_) => Ok(()),
        Err(_) => Err(
            "an HTTP header name is a non-empty token of ASCII letters, digits and !#$%&'*+-.^_`|~ (no space, ':', control or non-ASCII character)",
        ),
    },
    value: |v| match HeaderValue::try_from(v) {
        Ok(_) => Ok(()),
        Err(_) => Err(
            "an HTTP header value cannot contain control characters other than tab (no CR, LF, NUL or DEL)",
        ),
    },
};

/// Webhook transport settings; the `[transports.<name>] kind = "webhook"` table of the
/// configuration file (see [`TransportConfig`](super::config::TransportConfig)): `url`,
/// `secret_env`, `timeout` (`"10s"`), `concurrency`. Every field but `url` may be left out.
#[derive(Clone, serde::Deserialize, serde::Serialize, derive_more::Debug)]
#[serde(default, deny_unknown_fields)]
pub struct WebhookConfig {
    /// Default target URL (`http://` or `https://`), used when a route's destination is empty.
    /// Required.
    #[debug("{:?}", crate::redact::url(url))]
    pub url: String,
    /// Signing secret, `whsec_` + base64 (Standard Webhooks). Default: none (unsigned). Never
    /// read from nor written to a file: see `secret_env`.
    #[serde(skip)]
    #[debug("{:?}", crate::redact::secret(secret))]
    pub secret: Option<String>,
    /// Name of the environment variable holding the signing secret, read by
    /// [`WebhookConfig::resolve_secrets`] when `secret` is none. Default: none.
    pub secret_env: Option<String>,
    /// Timeout of one request, connect included. Default 10 s.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// Requests in flight at once per batch. Default 64.
    pub concurrency: usize,
}

impl Default for WebhookConfig {
    /// [`WebhookConfig::new`] with an empty URL.
    fn default() -> Self {
        WebhookConfig::new("")
    }
}

impl WebhookConfig {
    /// Settings for `url` with the defaults.
    pub fn new(url: impl Into<String>) -> Self {
        WebhookConfig {
            url: url.into(),
            secret: None,
            secret_env: None,
            timeout: Duration::from_secs(10),
            concurrency: 64,
        }
    }

    /// Check the settings without connecting, the secret named by `secret_env` included.
    ///
    /// # Errors
    /// [`ConfigError`] naming `url`, `secret_env`, `secret`, `timeout` or `concurrency`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        crate::transport::settings::check_url(&self.url, &["http", "https"])?;
        let c = self.resolve_secrets()?;
        ConfigError::zero_if(c.timeout.is_zero(), "timeout")?;
        ConfigError::invalid_if(c.concurrency == 0, "concurrency", "must be at least 1")?;
        if let Some(s) = &c.secret {
            WebhookSigner::new(s)?;
        }
        Ok(())
    }

    /// A copy with `secret` read from the variable named by `secret_env` (when `secret` is
    /// none).
    ///
    /// # Errors
    /// [`ConfigError`] naming `secret_env` when the variable is not set.
    pub fn resolve_secrets(&self) -> Result<Self, ConfigError> {
        let mut c = self.clone();
        fill_secret(&mut c.secret, "secret_env", c.secret_env.as_deref())?;
        Ok(c)
    }

    /// The transport, secrets read from the environment ([`WebhookTransport::new`]).
    ///
    /// # Errors
    /// As [`WebhookConfig::validate`].
    pub fn build(&self) -> Result<WebhookTransport, ConfigError> {
        self.validate()?;
        WebhookTransport::new(self.resolve_secrets()?)
    }
}

/// Signs deliveries the Standard Webhooks way (see the module docs).
#[derive(Clone)]
pub struct WebhookSigner {
    key: Vec<u8>,
}

impl std::fmt::Debug for WebhookSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WebhookSigner(<secret>)")
    }
}

impl WebhookSigner {
    /// A signer for a `whsec_…` secret (the prefix is optional).
    ///
    /// # Errors
    /// [`ConfigError`] when the secret is not base64 or is empty. The secret is never echoed.
    pub fn new(secret: &str) -> Result<Self, ConfigError> {
        let b64 = secret.strip_prefix("whsec_").unwrap_or(secret);
        let key = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|_| ConfigError::new("secret", "not a whsec_ + base64 secret"))?;
        ConfigError::invalid_if(key.is_empty(), "secret", "empty secret")?;
        Ok(WebhookSigner { key })
    }

    /// The signature header value `v1,<base64>` for `id`, `timestamp` (Unix seconds) and `body`.
    pub fn sign(&self, id: &str, timestamp: i64, body: &[u8]) -> String {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.key).expect("HMAC takes any key length");
        mac.update(id.as_bytes());
        mac.update(b".");
        mac.update(timestamp.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        format!(
            "v1,{}",
            base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
        )
    }

    /// Check a `webhook-signature` header (space-separated `v1,…` entries) in constant time, and
    /// that `timestamp` is within `tolerance` of `now` (Unix seconds).
    ///
    /// # Errors
    /// A text saying what did not match.
    pub fn verify(
        &self,
        id: &str,
        timestamp: i64,
        body: &[u8],
        signature_header: &str,
        now: i64,
        tolerance: Duration,
    ) -> Result<(), String> {
        // `abs_diff`: a timestamp far from now (a client may send `i64::MIN`) overflowed the
        // subtraction (a panic in a debug build; a seed of the `inbound` fuzz corpus).
        if now.abs_diff(timestamp) > tolerance.as_secs() {
            return Err(format!(
                "timestamp {timestamp} is outside the tolerance of {tolerance:?}"
            ));
        }
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.key).expect("HMAC takes any key length");
        mac.update(format!("{id}.{timestamp}.").as_bytes());
        mac.update(body);
        let ok = signature_header
            .split(' ')
            .filter_map(|s| s.strip_prefix("v1,"))
            .any(|sig| {
                base64::engine::general_purpose::STANDARD
                    .decode(sig)
                    .map(|raw| mac.clone().verify_slice(&raw).is_ok())
                    .unwrap_or(false)
            });
        if ok {
            Ok(())
        } else {
            Err("no matching v1 signature".into())
        }
    }
}

/// Publishes messages as HTTP `POST`s (see the module docs).
pub struct WebhookTransport {
    client: reqwest::Client,
    config: WebhookConfig,
    signer: Option<WebhookSigner>,
}

impl std::fmt::Debug for WebhookTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookTransport")
            .field("url", &crate::redact::url(&self.config.url))
            .finish_non_exhaustive()
    }
}

impl WebhookTransport {
    /// Build the transport.
    ///
    /// # Errors
    /// [`ConfigError`] naming `url`, `secret`, `timeout` or `concurrency` when invalid.
    pub fn new(config: WebhookConfig) -> Result<Self, ConfigError> {
        let url =
            reqwest::Url::parse(&config.url).map_err(|e| ConfigError::new("url", e.to_string()))?;
        ConfigError::invalid_if(
            !matches!(url.scheme(), "http" | "https"),
            "url",
            "scheme must be http or https",
        )?;
        ConfigError::zero_if(config.timeout.is_zero(), "timeout")?;
        ConfigError::invalid_if(config.concurrency == 0, "concurrency", "must be at least 1")?;
        let signer = config
            .secret
            .as_deref()
            .map(WebhookSigner::new)
            .transpose()?;
        // reqwest is built without a default crypto provider (to avoid aws-lc); use ring.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = reqwest::Client::builder()
            .timeout(config.timeout)
            .connect_timeout(config.timeout)
            .pool_max_idle_per_host(config.concurrency)
            .build()
            .map_err(|e| ConfigError::new("url", format!("cannot build HTTP client: {e}")))?;
        Ok(WebhookTransport {
            client,
            config,
            signer,
        })
    }

    /// The URL for a route destination: empty → the configured URL; an absolute `http(s)://`
    /// URL → itself; anything else → a path resolved against the configured URL (so
    /// `Router::single` with destination `{topic}` posts to `<url>/<topic>` when the URL ends
    /// with `/`).
    fn target(&self, destination: &str) -> Result<reqwest::Url, TransportError> {
        let base = reqwest::Url::parse(&self.config.url)
            .map_err(|e| TransportError::permanent(format!("bad webhook URL: {e}")))?;
        if destination.is_empty() {
            return Ok(base);
        }
        if destination.starts_with("http://") || destination.starts_with("https://") {
            return reqwest::Url::parse(destination).map_err(|e| {
                TransportError::permanent(format!("bad webhook destination {destination:?}: {e}"))
            });
        }
        base.join(destination).map_err(|e| {
            TransportError::permanent(format!("bad webhook destination {destination:?}: {e}"))
        })
    }

    /// The request headers for `m` sent at `ts` (Unix seconds): every wire header, a
    /// content type, and the Standard Webhooks `webhook-id`, `webhook-timestamp` and, with a
    /// secret, `webhook-signature`.
    ///
    /// # Errors
    /// A permanent error naming a header HTTP cannot carry.
    pub(crate) fn request_headers(
        &self,
        m: &crate::Message,
        ts: i64,
    ) -> Result<HeaderMap, TransportError> {
        let id = m.message_id.to_string();
        let mut headers = HeaderMap::new();
        for (k, v) in m.wire_headers() {
            let (Ok(name), Ok(value)) = (
                HeaderName::try_from(k.as_str()),
                HeaderValue::try_from(v.as_str()),
            ) else {
                return Err(TransportError::permanent(format!(
                    "header {k:?} cannot be sent over HTTP"
                )));
            };
            headers.insert(name, value);
        }
        if !headers.contains_key(reqwest::header::CONTENT_TYPE) {
            headers.insert(
                reqwest::header::CONTENT_TYPE,
                HeaderValue::from_static("application/octet-stream"),
            );
        }
        headers.insert(
            "webhook-id",
            HeaderValue::try_from(id.as_str()).expect("uuid is ascii"),
        );
        headers.insert("webhook-timestamp", HeaderValue::from(ts));
        if let Some(s) = &self.signer {
            let sig = s.sign(&id, ts, &m.payload);
            headers.insert(
                "webhook-signature",
                HeaderValue::try_from(sig).expect("base64 is ascii"),
            );
        }
        Ok(headers)
    }

    async fn post(&self, out: Outgoing<'_>) -> Result<(), TransportError> {
        self.check(&out)?;
        let m = out.message;
        let url = match self.target(out.destination) {
            Ok(u) => u,
            Err(e) => return Err(e),
        };
        let url = url.as_str();
        let headers = self.request_headers(m, chrono::Utc::now().timestamp())?;
        let resp = self
            .client
            .post(url)
            .headers(headers)
            .body(m.payload.clone())
            .send()
            .await;
        let resp = match resp {
            Ok(r) => r,
            Err(e) if e.is_connect() => {
                return Err(
                    TransportError::unavailable(format!("cannot connect to {url}")).with_source(e),
                );
            }
            Err(e) if e.is_timeout() => {
                return Err(
                    TransportError::retryable(format!("POST {url} timed out")).with_source(e)
                );
            }
            Err(e) if e.is_builder() => {
                return Err(
                    TransportError::permanent(format!("bad webhook request to {url}"))
                        .with_source(e),
                );
            }
            Err(e) => {
                return Err(TransportError::retryable(format!("POST {url} failed")).with_source(e));
            }
        };
        let status = resp.status();
        if status.is_success() {
            return Ok(());
        }
        let body = resp.text().await.unwrap_or_default();
        let snippet: String = body.chars().take(200).collect();
        let msg = format!("POST {url} answered {status}: {snippet}");
        match status.as_u16() {
            // Not 503: receivers (this crate's webhook consumer among them) answer it for one
            // message's transient failure, which must spend its attempts to reach the
            // receiver's `max_deliveries` and its dead letters.
            429 => Err(TransportError::destination_busy(format!(
                "{msg} (the receiver sheds load)"
            ))),
            408 | 425 | 500..=599 => Err(TransportError::retryable(msg)),
            401 | 403 => Err(TransportError::unavailable(format!(
                "{msg} (the receiver refuses the transport's credentials or signature)"
            ))),
            404 => Err(TransportError::missing_destination(msg)),
            _ => Err(TransportError::permanent(msg)),
        }
    }
}

#[async_trait]
impl Transport for WebhookTransport {
    fn name(&self) -> &str {
        "webhook"
    }

    fn check(&self, out: &Outgoing<'_>) -> Result<(), TransportError> {
        self.target(out.destination)?;
        wire::check_headers(out.message, &HTTP_HEADERS)?;
        Ok(())
    }

    /// Up to `concurrency` requests at once, each bounded by `timeout`; each answer is recorded
    /// as it comes, so a hanging request holds only its own message, and the messages not yet
    /// sent when the relay's publish timeout runs out are marked as never sent.
    async fn publish_each(&self, batch: &[Outgoing<'_>], acks: &Acks) {
        let mut posts: Vec<futures::future::BoxFuture<'_, ()>> = Vec::with_capacity(batch.len());
        for (i, o) in batch.iter().enumerate() {
            posts.push(Box::pin(async move {
                acks.sending(i);
                acks.record(i, self.post(*o).await);
            }));
        }
        futures::stream::iter(posts)
            .buffer_unordered(self.config.concurrency)
            .collect::<Vec<()>>()
            .await;
    }

    async fn probe(&self) -> Result<(), TransportError> {
        let url = reqwest::Url::parse(&self.config.url)
            .map_err(|e| TransportError::permanent(e.to_string()))?;
        if url.scheme() == "https" {
            // Exercise the TLS handshake the publishes need; any HTTP answer means it passed.
            return match self.client.head(url.as_str()).send().await {
                Ok(_) => Ok(()),
                Err(e) => Err(TransportError::unavailable(format!(
                    "HEAD {url} failed (connection or TLS handshake)"
                ))
                .with_source(e)),
            };
        }
        let host = url.host_str().unwrap_or("localhost").to_owned();
        let port = url.port_or_known_default().unwrap_or(80);
        match tokio::time::timeout(
            self.config.timeout,
            tokio::net::TcpStream::connect((host.as_str(), port)),
        )
        .await
        {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(TransportError::unavailable(format!(
                "cannot connect to {host}:{port}"
            ))
            .with_source(e)),
            Err(_) => Err(TransportError::unavailable(format!(
                "connect to {host}:{port} timed out"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sign_and_verify_round_trip() {
        let secret = format!(
            "whsec_{}",
            base64::engine::general_purpose::STANDARD.encode(b"0123456789abcdef")
        );
        let s = WebhookSigner::new(&secret).unwrap();
        let sig = s.sign("msg_1", 1_700_000_000, b"\xff\x00body");
        assert!(sig.starts_with("v1,"));
        // Checked at `now` (5 min tolerance): the signed body, another body, too late.
        let verify = |body: &[u8], now: i64| {
            s.verify(
                "msg_1",
                1_700_000_000,
                body,
                &sig,
                now,
                Duration::from_secs(300),
            )
        };
        assert!(verify(b"\xff\x00body", 1_700_000_010).is_ok());
        assert!(verify(b"other", 1_700_000_010).is_err());
        assert!(verify(b"\xff\x00body", 1_700_001_000).is_err());
        assert!(WebhookSigner::new("whsec_!!!").is_err());
    }

    #[test]
    fn destinations_resolve_against_the_url() {
        let t = WebhookTransport::new(WebhookConfig::new("http://h:1/hooks/")).unwrap();
        assert_eq!(t.target("").unwrap().as_str(), "http://h:1/hooks/");
        assert_eq!(
            t.target("order-created").unwrap().as_str(),
            "http://h:1/hooks/order-created"
        );
        assert_eq!(t.target("https://x/y").unwrap().as_str(), "https://x/y");
    }

    /// Headers HTTP cannot carry and the headers the client or the transport owns are refused as
    /// permanent, naming the header or key; the rest passes.
    #[test]
    fn check_refuses_what_http_cannot_carry() {
        let t = WebhookTransport::new(WebhookConfig::new("http://h:1/hooks/")).unwrap();
        let check = |headers: &[(&str, &str)], key: Option<&str>| {
            let m = crate::transport::wire::test_message(headers, key);
            t.check(&Outgoing {
                message: &m,
                destination: "",
            })
        };
        for (headers, key, named) in [
            (vec![("a b", "v")], None, "header \"a b\""),
            (vec![("a", "x\r\nInjected: 1")], None, "header \"a\""),
            (vec![], Some("k\n"), "partition key \"k\\n\""),
            (
                vec![("Content-Length", "0")],
                None,
                "\"Content-Length\" is reserved",
            ),
            (vec![("host", "evil")], None, "\"host\" is reserved"),
            (
                vec![("Transfer-Encoding", "chunked")],
                None,
                "Transfer-Encoding",
            ),
            (
                vec![("webhook-signature", "v1,forged")],
                None,
                "webhook-signature",
            ),
        ] {
            let e = check(&headers, key).unwrap_err();
            assert_eq!(e.kind(), crate::TransportErrorKind::Permanent);
            assert!(e.report().contains(named), "{named}: {}", e.report());
        }
        assert!(
            check(
                &[("content-type", "application/json"), ("tag", "a\tb \u{e9}")],
                Some("order 7")
            )
            .is_ok()
        );
    }

    #[test]
    fn config_errors_name_the_field() {
        assert_eq!(
            WebhookTransport::new(WebhookConfig::new("not a url"))
                .unwrap_err()
                .field,
            "url"
        );
        assert_eq!(
            WebhookTransport::new(WebhookConfig::new("ftp://x"))
                .unwrap_err()
                .field,
            "url"
        );
        let mut c = WebhookConfig::new("http://127.0.0.1:1/");
        c.concurrency = 0;
        assert_eq!(WebhookTransport::new(c).unwrap_err().field, "concurrency");
    }
}
