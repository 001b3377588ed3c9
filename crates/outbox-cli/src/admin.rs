//! The admin HTTP surface (`[admin] listen`, and the demo's metrics): `/metrics`, `/healthz`,
//! `/readyz` (docs/operations.md).

use std::sync::{Arc, Mutex};

use axum::http::{StatusCode, header};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

/// `GET /metrics`: `registry` in the OpenMetrics text format. The registry is behind a lock so
/// collectors can be added while it is served (the demo's relay incarnations).
pub fn metrics_router(registry: Arc<Mutex<Registry>>) -> axum::Router {
    axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let registry = registry.clone();
            async move {
                let mut body = String::new();
                let encoded = {
                    let r = registry.lock().unwrap_or_else(|e| e.into_inner());
                    prometheus_client::encoding::text::encode(&mut body, &r)
                };
                match encoded {
                    Ok(()) => (
                        StatusCode::OK,
                        [(
                            header::CONTENT_TYPE,
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        body,
                    ),
                    Err(_) => (
                        StatusCode::INTERNAL_SERVER_ERROR,
                        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
                        "metrics encoding failed\n".to_owned(),
                    ),
                }
            }
        }),
    )
}

/// `GET /healthz` ([`outbox::Relay::health`]) and `GET /readyz` ([`outbox::Relay::readiness`]):
/// 200 `ok`, or 503 with one problem per line.
pub fn health_router(relay: outbox::Relay) -> axum::Router {
    let check = |ready: bool| {
        let relay = relay.clone();
        move || {
            let h = if ready {
                relay.readiness()
            } else {
                relay.health()
            };
            async move { health_answer(&h) }
        }
    };
    axum::Router::new()
        .route("/healthz", axum::routing::get(check(false)))
        .route("/readyz", axum::routing::get(check(true)))
}

/// A health check's answer: 200 `ok`, or 503 with one problem per line.
pub fn health_answer(h: &outbox::RelayHealth) -> (StatusCode, String) {
    if h.is_ok() {
        (StatusCode::OK, "ok\n".to_owned())
    } else {
        let mut body = h.problems.join("\n");
        body.push('\n');
        (StatusCode::SERVICE_UNAVAILABLE, body)
    }
}

/// Serve `app` on `listener` until `cancel`; the address it listens on.
///
/// # Errors
/// When the listener has no local address.
pub fn serve(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    cancel: CancellationToken,
) -> std::io::Result<std::net::SocketAddr> {
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(async move { cancel.cancelled().await })
            .await;
        if let Err(e) = served {
            tracing::error!(error = %e, "admin listener failed");
        }
    });
    Ok(addr)
}
