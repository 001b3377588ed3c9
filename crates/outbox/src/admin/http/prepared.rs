//! Two-phase messages over the admin API ([`crate::two_phase`]), for producers in other
//! languages: prepare, commit and roll back by message id. Mutations: each needs the admin
//! token (`Authorization: Bearer <token>`).

use std::collections::BTreeMap;
use std::time::Duration;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use base64::Engine;
use serde::Deserialize;
use serde_json::json;
use uuid::Uuid;

use super::{Api, ApiError, bad};
use crate::message::NewMessage;
use crate::two_phase::{CheckBack, DecideError, TwoPhase};

/// The body of `POST /api/prepared`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrepareRequest {
    /// The topic.
    pub topic: String,
    /// The payload as UTF-8 text (or give `payload_base64`).
    pub payload: Option<String>,
    /// The payload as standard base64 (binary payloads).
    pub payload_base64: Option<String>,
    /// The message id (a UUID); default a fresh UUIDv7.
    pub message_id: Option<Uuid>,
    /// The partition key.
    pub partition_key: Option<String>,
    /// Headers.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Publish attempts before the dead letter; default the relay's.
    pub max_attempts: Option<u32>,
    /// The check-back: an `http(s)://` URL or `hook:<name>`.
    pub check_back: String,
    /// First check-back after this long (`"6s"`); default 6 s.
    #[serde(default, with = "humantime_serde")]
    pub check_after: Option<Duration>,
    /// Park as UNDECIDED once prepared this long without a decision (`"1h"`); default none.
    #[serde(default, with = "humantime_serde")]
    pub deadline: Option<Duration>,
}

pub(super) fn routes() -> axum::Router<Api> {
    axum::Router::new()
        .route("/api/prepared", axum::routing::post(prepare))
        .route(
            "/api/prepared/{message_id}/commit",
            axum::routing::post(|s, p| decide(s, p, true)),
        )
        .route(
            "/api/prepared/{message_id}/rollback",
            axum::routing::post(|s, p| decide(s, p, false)),
        )
}

async fn prepare(
    State(api): State<Api>,
    body: Result<Json<PrepareRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body.map_err(|e| bad("body", e.body_text()))?;
    let payload = match (req.payload, req.payload_base64) {
        (Some(p), None) => p.into_bytes(),
        (None, Some(b)) => base64::engine::general_purpose::STANDARD
            .decode(b)
            .map_err(|e| bad("payload_base64", e))?,
        _ => {
            return Err(bad(
                "payload",
                "give exactly one of payload and payload_base64",
            ));
        }
    };
    let mut msg = NewMessage::new(req.topic, payload);
    if let Some(id) = req.message_id {
        msg = msg.with_message_id(id);
    }
    if let Some(k) = req.partition_key {
        msg = msg.with_partition_key(k);
    }
    for (k, v) in req.headers {
        msg = msg.with_header(k, v);
    }
    if let Some(n) = req.max_attempts {
        msg = msg.with_max_attempts(n);
    }
    let mut check_back =
        CheckBack::parse(&req.check_back).map_err(|e| bad("check_back", e.reason))?;
    if let Some(d) = req.check_after {
        check_back = check_back.after(d);
    }
    if let Some(d) = req.deadline {
        check_back = check_back.deadline(d);
    }
    match api.store.prepare(msg, &check_back).await {
        Ok(id) => {
            tracing::info!(message_id = %id, "admin API: prepared a two-phase message");
            Ok((StatusCode::CREATED, Json(json!({ "message_id": id }))).into_response())
        }
        Err(crate::error::EnqueueError::Database(e)) => Err(e.into()),
        Err(e @ crate::error::EnqueueError::DuplicateMessageId(_)) => {
            Err(ApiError(StatusCode::CONFLICT, e.to_string()))
        }
        Err(e) => Err(bad("message", e)),
    }
}

async fn decide(
    State(api): State<Api>,
    Path(message_id): Path<String>,
    commit: bool,
) -> Result<Response, ApiError> {
    let id = Uuid::parse_str(&message_id).map_err(|e| bad("message_id", e))?;
    let decided = if commit {
        api.store.commit_prepared(id).await
    } else {
        api.store.rollback_prepared(id).await
    };
    match decided {
        Ok(d) => Ok(Json(json!({ "message_id": id, "decided": d })).into_response()),
        Err(DecideError::NotFound(_)) => Err(ApiError(
            StatusCode::NOT_FOUND,
            format!("no prepared message {id}"),
        )),
        Err(DecideError::Lost { status, .. }) => Ok((
            StatusCode::CONFLICT,
            Json(json!({
                "error": format!("message {id} was already decided otherwise: it is {status}"),
                "status": status.name(),
            })),
        )
            .into_response()),
        Err(DecideError::Store(e)) => Err(e.into()),
        Err(e) => Err(ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())),
    }
}
