//! The admin JSON API over HTTP (feature `admin`): [`router`] serves the [`crate::admin`]
//! operations of one [`Store`] under `/api/`, described by the OpenAPI 3.1 document at
//! `/api/openapi.json`, and the web dashboard over them at `/` (docs/operations.md, "Admin API"
//! and "Dashboard").
//!
//! | method and path | what |
//! |---|---|
//! | `GET /api/overview` | counts per state, backlog ages, the busiest topics per state |
//! | `GET /api/messages?state=&topic=&key=&message_id=&created_after=&created_before=&sent_after=&sent_before=&error=&before=&limit=` | one page of a search, newest first |
//! | `GET /api/messages/{id}` | one message (row id or message id) |
//! | `POST /api/messages/requeue`, `…/publish-now`, `…/discard`, `…/resume` | an action on `{"ids": […]}` or `{"filter": {…}}` |
//! | `GET /api/relays` | the relays' heartbeats and routes, every bucket's lease, the database clock |
//! | `GET /api/keys/blocked?limit=` | partition keys held back by a dead letter |
//! | `GET /api/series` | the relay's throughput and commit → ack latency over the last hour (404 without a relay) |
//! | `GET /api/inbox` | the consumers with dead letters in the inbox (404 without one) |
//! | `GET /api/inbox/dead-letters?consumer=&limit=` | dead letters, newest first |
//! | `GET /api/inbox/dead-letters/{consumer}/{message_id}` | one dead letter with headers and payload |
//! | `POST /api/inbox/replay`, `…/discard` | on `{"consumer": "…", "message_ids": […]}` |
//! | `POST /api/prepared` | prepare a two-phase message (`crate::two_phase`; body: [`PrepareRequest`](super::prepared::PrepareRequest)) |
//! | `POST /api/prepared/{message_id}/commit`, `…/rollback` | decide it (200 `{"decided": "now"\|"already"}`, 409 when decided otherwise, 404) |
//!
//! Authentication: with a token set ([`AdminAuth::token`]) a mutation needs `Authorization:
//! Bearer <token>` (401 without it, nothing changed); without one, mutations are refused (403).
//! Reads need the token too when [`AdminAuth::protect_reads`]. One layer in front of every
//! `/api` route but `/api/openapi.json` decides (a `GET` is a read, any other method a
//! mutation), so a refused request reaches no handler. Errors are JSON `{"error":
//! "…"}`: 400 naming the parameter, 401, 403, 404, 503 while the database is unreachable, 500.

pub mod prepared;

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use chrono::{DateTime, Utc};
use serde_json::json;

use super::inbox::{InboxAction, InboxAdmin};
use super::series::Series;
use super::{Action, MessageFilter, MessageRef, PageRequest, Selection};
use crate::error::StoreError;
use crate::message::Status;
use crate::store::Store;

/// Who may read and change through the API.
#[derive(Clone, Default, derive_more::Debug)]
pub struct AdminAuth {
    /// The bearer token mutations need (and reads, with [`AdminAuth::protect_reads`]). `None`:
    /// mutations are refused. Never shown in any response or log (`Debug` prints `***`).
    #[debug("{:?}", crate::redact::secret(token))]
    pub token: Option<String>,
    /// Reads need the token too. Default `false`.
    pub protect_reads: bool,
}

/// How long after its heartbeat a relay counts as alive (the relay's default lease), given to
/// `GET /api/relays` clients as `lease_seconds`.
pub const RELAY_LEASE: Duration = Duration::from_secs(30);

#[derive(Clone)]
pub(super) struct Api {
    pub(super) store: Arc<dyn Store>,
    inbox: Option<InboxAdmin>,
    series: Option<Arc<Series>>,
    auth: Arc<AdminAuth>,
}

/// The admin API of `store` under `/api/` (see the module docs); merge it into an application's
/// router or serve it alone. With an inbox or a relay's series: [`AdminApi`].
pub fn router(store: Arc<dyn Store>, auth: AdminAuth) -> axum::Router {
    AdminApi::new(store, auth).router()
}

/// The admin API with what it may serve beyond the outbox table: a consumer inbox's dead
/// letters (`/api/inbox…`, the dashboard's Inbox page) and a relay's throughput and latency
/// over the last hour (`/api/series`, the overview's charts).
pub struct AdminApi {
    api: Api,
}

impl AdminApi {
    /// The API of `store` with `auth`; no inbox, no series.
    pub fn new(store: Arc<dyn Store>, auth: AdminAuth) -> Self {
        AdminApi {
            api: Api {
                store,
                inbox: None,
                series: None,
                auth: Arc::new(auth),
            },
        }
    }

    /// Serve the dead letters of `inbox`.
    pub fn inbox(mut self, inbox: InboxAdmin) -> Self {
        self.api.inbox = Some(inbox);
        self
    }

    /// Serve `series` (sampled from the relay of this process: [`Series::spawn_sampler`]).
    pub fn series(mut self, series: Arc<Series>) -> Self {
        self.api.series = Some(series);
        self
    }

    /// The router.
    pub fn router(self) -> axum::Router {
        build(self.api)
    }
}

fn build(api: Api) -> axum::Router {
    let guarded = axum::Router::new()
        .route("/api/overview", get(overview))
        .route("/api/messages", get(list))
        // `GET` one message by id; `POST` an action by name (requeue, publish-now, discard).
        .route("/api/messages/{id}", get(show).post(act))
        .route("/api/relays", get(relays))
        .route("/api/keys/blocked", get(blocked_keys))
        .route("/api/series", get(series))
        .route("/api/inbox", get(inbox_consumers))
        .route("/api/inbox/dead-letters", get(inbox_dead_letters))
        .route(
            "/api/inbox/dead-letters/{consumer}/{message_id}",
            get(inbox_dead_letter),
        )
        .route(
            "/api/inbox/replay",
            axum::routing::post(|s, b| inbox_act(s, InboxAction::Replay, b)),
        )
        .route(
            "/api/inbox/discard",
            axum::routing::post(|s, b| inbox_act(s, InboxAction::Discard, b)),
        )
        .merge(prepared::routes())
        .route_layer(axum::middleware::from_fn_with_state(api.clone(), authorize));
    axum::Router::new()
        .route("/", get(|| asset("text/html; charset=utf-8", INDEX_HTML)))
        .route(
            "/assets/app.js",
            get(|| asset("text/javascript; charset=utf-8", APP_JS)),
        )
        .route(
            "/assets/app.css",
            get(|| asset("text/css; charset=utf-8", APP_CSS)),
        )
        .route("/favicon.ico", get(|| async { StatusCode::NO_CONTENT }))
        .route("/api/openapi.json", get(openapi))
        .merge(guarded)
        .with_state(api)
}

/// The one gate of every `/api` route but the OpenAPI document: a `GET` (or `HEAD`) is a read,
/// any other method a mutation, and [`Api::check`] decides. One layer, so that no handler can
/// forget it; a request it refuses reaches no handler.
async fn authorize(
    State(api): State<Api>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let mutation = !matches!(*request.method(), Method::GET | Method::HEAD);
    api.check(request.headers(), mutation)?;
    Ok(next.run(request).await)
}

/// An API error: status and message.
pub(super) struct ApiError(pub(super) StatusCode, pub(super) String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(json!({ "error": self.1 }))).into_response()
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        let status = if e.is_retryable() {
            StatusCode::SERVICE_UNAVAILABLE
        } else {
            StatusCode::INTERNAL_SERVER_ERROR
        };
        ApiError(status, e.report())
    }
}

pub(super) fn bad(param: &str, why: impl std::fmt::Display) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, format!("{param}: {why}"))
}

/// Constant-time comparison of the presented token with the configured one.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Api {
    /// Whether `headers` carry the token; `mutation` decides what no configured token means.
    fn check(&self, headers: &HeaderMap, mutation: bool) -> Result<(), ApiError> {
        if !mutation && !self.auth.protect_reads {
            return Ok(());
        }
        let Some(token) = &self.auth.token else {
            return Err(ApiError(
                StatusCode::FORBIDDEN,
                "changes through the admin API are disabled: no token is configured \
                 ([admin] token_env)"
                    .into(),
            ));
        };
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        match presented {
            Some(p) if same(p.trim().as_bytes(), token.as_bytes()) => Ok(()),
            _ => Err(ApiError(
                StatusCode::UNAUTHORIZED,
                "missing or wrong bearer token (Authorization: Bearer <token>)".into(),
            )),
        }
    }
}

/// A `limit` parameter (pages are capped at [`super::MAX_PAGE`] later).
fn limit_param(v: &str) -> Result<u32, ApiError> {
    v.parse()
        .map_err(|_| bad("limit", "not a number from 1 to 1000"))
}

fn time(param: &str, v: &str) -> Result<DateTime<Utc>, ApiError> {
    DateTime::parse_from_rfc3339(v)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| bad(param, format!("{v:?} is not an RFC 3339 time ({e})")))
}

/// A search's filter and page from query parameters (see the module docs); an unknown or bad
/// parameter is an error naming it.
pub fn search_params(pairs: &[(String, String)]) -> Result<(MessageFilter, PageRequest), String> {
    search_params_api(pairs).map_err(|e| e.1)
}

fn search_params_api(pairs: &[(String, String)]) -> Result<(MessageFilter, PageRequest), ApiError> {
    let mut f = MessageFilter::default();
    let mut page = PageRequest::default();
    for (k, v) in pairs {
        if v.is_empty() {
            continue;
        }
        match k.as_str() {
            "state" => {
                for s in v.split(',') {
                    f.states
                        .push(s.parse::<Status>().map_err(|e| bad("state", e))?);
                }
            }
            "topic" => f.topic = Some(v.clone()),
            "key" => f.partition_key = Some(v.clone()),
            "message_id" => {
                f.message_id = Some(
                    v.parse()
                        .map_err(|e| bad("message_id", format!("{v:?} is not a UUID ({e})")))?,
                );
            }
            "created_after" => f.created_after = Some(time(k, v)?),
            "created_before" => f.created_before = Some(time(k, v)?),
            "sent_after" => f.sent_after = Some(time(k, v)?),
            "sent_before" => f.sent_before = Some(time(k, v)?),
            "error" => f.error = Some(v.clone()),
            "before" => {
                page.before = Some(v.parse().map_err(|_| bad("before", "not a row id"))?);
            }
            "limit" => {
                page.limit = limit_param(v)?;
            }
            other => {
                return Err(bad(
                    other,
                    "unknown parameter (state, topic, key, message_id, created_after, \
                     created_before, sent_after, sent_before, error, before, limit)",
                ));
            }
        }
    }
    Ok((f, page))
}

/// The dashboard's page, script and style sheet: plain files in `admin/ui/`, compiled in (no
/// build step, nothing fetched from elsewhere).
const INDEX_HTML: &str = include_str!("../ui/index.html");
const APP_JS: &str = include_str!("../ui/app.js");
const APP_CSS: &str = include_str!("../ui/app.css");

async fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

async fn openapi() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        OPENAPI.to_owned(),
    )
        .into_response()
}

async fn overview(State(api): State<Api>) -> Result<Response, ApiError> {
    let stats = api.store.stats().await?;
    let topics = api.store.topic_counts(20).await?;
    let counts: serde_json::Map<String, serde_json::Value> = stats
        .counts
        .iter()
        .map(|(s, n)| (s.name().to_owned(), json!(n)))
        .collect();
    Ok(Json(json!({
        "counts": counts,
        "oldest_pending_age_seconds": stats.oldest_pending_age.map(|d| d.as_secs_f64()),
        "awaiting_confirmation": stats.awaiting_confirmation,
        "oldest_unconfirmed_age_seconds": stats.oldest_unconfirmed_age.map(|d| d.as_secs_f64()),
        "topics": topics,
    }))
    .into_response())
}

async fn list(
    State(api): State<Api>,
    Query(pairs): Query<Vec<(String, String)>>,
) -> Result<Response, ApiError> {
    let (filter, page) = search_params_api(&pairs)?;
    Ok(Json(api.store.search(&filter, &page).await?).into_response())
}

async fn show(State(api): State<Api>, Path(id): Path<String>) -> Result<Response, ApiError> {
    let message: MessageRef = id.parse().map_err(|e| bad("id", e))?;
    let detail = api.store.find_message(message).await?;
    match detail {
        Some(d) => Ok(Json(d).into_response()),
        None => Err(ApiError(
            StatusCode::NOT_FOUND,
            format!("no message {id} (never written, purged or archived)"),
        )),
    }
}

async fn act(
    State(api): State<Api>,
    Path(name): Path<String>,
    body: Result<Json<Selection>, axum::extract::rejection::JsonRejection>,
) -> Result<Response, ApiError> {
    let action = [
        Action::Requeue,
        Action::PublishNow,
        Action::Discard,
        Action::Resume,
    ]
    .into_iter()
    .find(|a| a.name() == name)
    .ok_or_else(|| {
        ApiError(
            StatusCode::NOT_FOUND,
            format!("no action {name:?}: requeue, publish-now, discard or resume"),
        )
    })?;
    let Json(selection) = body.map_err(|e| bad("body", e.body_text()))?;
    let report = api.store.act(action, &selection).await?;
    tracing::info!(
        action = action.name(),
        changed = report.changed,
        not_changed = report.not_changed.len(),
        "admin action"
    );
    Ok(Json(report).into_response())
}

async fn relays(State(api): State<Api>) -> Result<Response, ApiError> {
    let leases = api.store.leases().await?;
    Ok(Json(json!({
        "now": leases.now,
        "lease_seconds": RELAY_LEASE.as_secs(),
        "relays": leases.relays,
        "buckets": leases.buckets,
    }))
    .into_response())
}

async fn blocked_keys(
    State(api): State<Api>,
    Query(pairs): Query<Vec<(String, String)>>,
) -> Result<Response, ApiError> {
    let mut limit = 100;
    for (k, v) in &pairs {
        match k.as_str() {
            "limit" => {
                limit = limit_param(v)?;
            }
            other => return Err(bad(other, "unknown parameter (limit)")),
        }
    }
    Ok(Json(json!({ "keys": api.store.blocked_keys(limit).await? })).into_response())
}

impl Api {
    /// The inbox, or 404 naming the setting that configures one.
    fn inbox(&self) -> Result<&InboxAdmin, ApiError> {
        self.inbox.as_ref().ok_or_else(|| {
            ApiError(
                StatusCode::NOT_FOUND,
                "no inbox is configured (AdminApi::inbox)".into(),
            )
        })
    }
}

async fn series(State(api): State<Api>) -> Result<Response, ApiError> {
    let Some(series) = &api.series else {
        return Err(ApiError(
            StatusCode::NOT_FOUND,
            "no relay runs in this process: throughput and latency charts come from the relay \
             daemon's [admin] listener"
                .into(),
        ));
    };
    Ok(Json(json!({
        "interval_seconds": series.interval().as_secs_f64(),
        "points": series.points(),
    }))
    .into_response())
}

async fn inbox_consumers(State(api): State<Api>) -> Result<Response, ApiError> {
    let consumers = api.inbox()?.consumers().await?;
    Ok(Json(json!({ "consumers": consumers })).into_response())
}

async fn inbox_dead_letters(
    State(api): State<Api>,
    Query(pairs): Query<Vec<(String, String)>>,
) -> Result<Response, ApiError> {
    let (mut consumer, mut limit) = (None, 100);
    for (k, v) in &pairs {
        match k.as_str() {
            "consumer" if !v.is_empty() => consumer = Some(v.clone()),
            "consumer" => {}
            "limit" => {
                limit = limit_param(v)?;
            }
            other => return Err(bad(other, "unknown parameter (consumer, limit)")),
        }
    }
    let dead = api
        .inbox()?
        .dead_letters(consumer.as_deref(), limit)
        .await?;
    Ok(Json(json!({ "dead_letters": dead })).into_response())
}

async fn inbox_dead_letter(
    State(api): State<Api>,
    Path((consumer, message_id)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let inbox = api.inbox()?;
    let id = message_id
        .parse::<uuid::Uuid>()
        .map_err(|e| bad("message_id", format!("{message_id:?} is not a UUID ({e})")))?;
    match inbox.dead_letter(&consumer, &id.to_string()).await? {
        Some(d) => Ok(Json(d).into_response()),
        None => Err(ApiError(
            StatusCode::NOT_FOUND,
            format!("consumer {consumer:?} has no dead letter {id}"),
        )),
    }
}

/// The body of an inbox action.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct InboxSelection {
    consumer: String,
    message_ids: Vec<String>,
}

async fn inbox_act(
    State(api): State<Api>,
    action: InboxAction,
    body: Result<Json<InboxSelection>, axum::extract::rejection::JsonRejection>,
) -> Result<Response, ApiError> {
    let inbox = api.inbox()?;
    let Json(sel) = body.map_err(|e| bad("body", e.body_text()))?;
    let report = inbox.act(action, &sel.consumer, &sel.message_ids).await?;
    tracing::info!(
        action = action.name(),
        consumer = %sel.consumer,
        changed = report.changed,
        not_changed = report.not_changed.len(),
        "admin inbox action"
    );
    Ok(Json(report).into_response())
}

/// The OpenAPI 3.1 description of [`router`]'s routes.
pub const OPENAPI: &str = include_str!("../openapi.json");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn search_parameters_are_checked_by_name() {
        let p = |k: &str, v: &str| vec![(k.to_owned(), v.to_owned())];
        let (f, page) = search_params(&[
            ("state".into(), "failed,pending".into()),
            ("topic".into(), "orders.*".into()),
            ("limit".into(), "10".into()),
        ])
        .unwrap();
        assert_eq!(f.states, vec![Status::Failed, Status::Pending]);
        assert_eq!(page.limit, 10);
        for (k, v, needle) in [
            ("state", "lost", "state: unknown state"),
            ("message_id", "x", "message_id:"),
            ("created_after", "yesterday", "created_after:"),
            ("limit", "-1", "limit:"),
            ("colour", "red", "colour: unknown parameter"),
        ] {
            let e = search_params(&p(k, v)).unwrap_err();
            assert!(e.starts_with(needle), "{k}={v}: {e}");
        }
    }

    #[test]
    fn the_openapi_document_describes_every_route() {
        let doc: serde_json::Value = serde_json::from_str(OPENAPI).expect("valid JSON");
        assert_eq!(doc["openapi"], "3.1.0");
        for path in [
            "/api/overview",
            "/api/messages",
            "/api/messages/{id}",
            "/api/messages/requeue",
            "/api/messages/publish-now",
            "/api/messages/discard",
            "/api/relays",
            "/api/keys/blocked",
            "/api/series",
            "/api/inbox",
            "/api/inbox/dead-letters",
            "/api/inbox/dead-letters/{consumer}/{message_id}",
            "/api/inbox/replay",
            "/api/inbox/discard",
        ] {
            assert!(doc["paths"][path].is_object(), "{path} is not described");
        }
    }

    #[test]
    fn tokens_compare_whole() {
        assert!(same(b"abc", b"abc"));
        assert!(!same(b"abc", b"abd"));
        assert!(!same(b"ab", b"abc"));
    }
}
