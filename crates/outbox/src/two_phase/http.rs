//! The HTTP check-back: a POST of the [`CheckRequest`] as JSON, signed the Standard Webhooks way
//! when a secret is set; the answer is the response body by the strict grammar of [`Answer`].

use super::{Answer, CheckBackPolicy, CheckRequest};
use crate::error::ConfigError;
use crate::transport::webhook::WebhookSigner;

/// Longest answer body read, in bytes: a valid one is at most 10.
const MAX_BODY: usize = 1024;

/// Asks HTTP check-backs ([`CheckBack::http`](super::CheckBack::http)).
///
/// The request: `POST <url>`, `content-type: application/json`, body the [`CheckRequest`];
/// with [`CheckBackPolicy::secret`], the headers `webhook-id` (`check-<message id>-<checks>`),
/// `webhook-timestamp` (Unix seconds) and `webhook-signature` (`v1,` + base64 HMAC-SHA256 of
/// `id.timestamp.body`, as the webhook transport signs deliveries). The answer: status 200 and a
/// body that is exactly `COMMIT`, `ROLLBACK` or `UNKNOWN`. Any other status (a 5xx, a 3xx
/// redirect, which is not followed), another body, a timeout or a connection error is an error.
#[derive(Clone)]
pub struct HttpChecker {
    client: reqwest::Client,
    signer: Option<WebhookSigner>,
}

impl std::fmt::Debug for HttpChecker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpChecker")
            .field("signed", &self.signer.is_some())
            .finish()
    }
}

impl HttpChecker {
    /// A checker with `policy`'s timeout and secret.
    ///
    /// # Errors
    /// [`ConfigError`] when the secret is not a `whsec_…` base64 secret, or the client cannot be
    /// built.
    pub fn new(policy: &CheckBackPolicy) -> Result<Self, ConfigError> {
        let signer = policy
            .resolved_secret()?
            .as_deref()
            .map(WebhookSigner::new)
            .transpose()
            .map_err(|e| ConfigError::new("relay.check_back.secret", e.reason))?;
        // reqwest is built without a default crypto provider (to avoid aws-lc); use ring.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = reqwest::Client::builder()
            .timeout(policy.timeout)
            .connect_timeout(policy.timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| {
                ConfigError::new("relay.check_back", format!("cannot build HTTP client: {e}"))
            })?;
        Ok(HttpChecker { client, signer })
    }

    /// Ask `url` about `request`'s message.
    ///
    /// # Errors
    /// A text saying why there is no answer (never a decision).
    pub async fn check(&self, url: &str, request: &CheckRequest) -> Result<Answer, String> {
        let body = serde_json::to_vec(request).map_err(|e| e.to_string())?;
        let mut req = self
            .client
            .post(url)
            .header("content-type", "application/json");
        if let Some(signer) = &self.signer {
            let id = format!("check-{}-{}", request.message_id, request.checks);
            let ts = chrono::Utc::now().timestamp();
            req = req
                .header("webhook-signature", signer.sign(&id, ts, &body))
                .header("webhook-id", id)
                .header("webhook-timestamp", ts.to_string());
        }
        let mut resp = req
            .body(body)
            .send()
            .await
            .map_err(|e| format!("POST {}: {}", crate::redact::url(url), chain(&e)))?;
        let status = resp.status();
        let mut text = Vec::new();
        while let Some(chunk) = resp
            .chunk()
            .await
            .map_err(|e| format!("reading the answer: {}", chain(&e)))?
        {
            text.extend_from_slice(&chunk);
            if text.len() > MAX_BODY {
                return Err(format!(
                    "answer longer than {MAX_BODY} bytes (HTTP {status})"
                ));
            }
        }
        let text = String::from_utf8_lossy(&text);
        if status != reqwest::StatusCode::OK {
            let shown: String = text.chars().take(80).collect();
            return Err(format!("HTTP {status}: {shown:?}"));
        }
        Answer::parse(&text)
    }
}

/// `e` and its sources, `: `-separated (reqwest's own message says little: "error sending
/// request").
fn chain(e: &reqwest::Error) -> String {
    crate::error::with_sources(e.to_string(), std::error::Error::source(e))
}
