//! `outbox relay` with `[[databases]]`: one daemon relaying several databases, and on PostgreSQL
//! every tenant schema of a database, each a member of an [`outbox::RelayGroup`]
//! (docs/scaling.md). The transports are built once and shared; everything else (pool, LISTEN
//! connection, membership, bucket leases, batches) is each database's own, so one database
//! being slow, down or failing over delays no other.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use outbox::relay::group::{MemberState, Opener, RelayGroup};
use outbox::{RelayConfig, Router, StoreOptions, Transport};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use crate::config::{DatabasesEntry, FileConfig};
use crate::{Create, open_store};

/// Run the daemon over `file.databases` until SIGTERM or Ctrl-C.
///
/// # Errors
/// An invalid configuration (named); a database that cannot be reached is not an error: its
/// member is opened again with backoff and reported by `/readyz`.
pub async fn run(file: FileConfig) -> anyhow::Result<()> {
    file.validate()?;
    let relay_config = file.relay_config()?;
    let mut built: BTreeMap<String, Arc<dyn Transport>> = BTreeMap::new();
    let mut routers = Vec::new();
    for d in &file.databases {
        let routes = d.routes(&file);
        let router = Router::from_config_sharing(
            routes,
            file.transports.iter().map(|(k, v)| (k.as_str(), v)),
            &mut built,
        )?;
        routers.push(router);
    }
    for (name, t) in &built {
        if let Err(e) = t.probe().await {
            tracing::warn!(
                transport = %name,
                error = %e.report(),
                "transport unreachable at start; the relays start anyway and connect it once the broker answers"
            );
        }
    }
    let cancel = CancellationToken::new();
    let c = cancel.clone();
    tokio::spawn(async move {
        crate::shutdown_signal().await;
        tracing::info!("shutdown signal received; stopping every database's relay");
        c.cancel();
    });
    let group = RelayGroup::new();
    let mut discovery = Vec::new();
    for (d, router) in file.databases.iter().zip(routers) {
        if d.discovers() {
            discovery.push(tokio::spawn(discover(
                d.clone(),
                router,
                relay_config.clone(),
                group.clone(),
                cancel.clone(),
            )));
        } else {
            let options = StoreOptions {
                table: d.table.clone(),
                inbox_table: d.inbox_table.clone(),
                ..StoreOptions::default()
            };
            let open = opener(
                d.url.clone(),
                options,
                router,
                relay_config.clone(),
                d.search_indexes,
            );
            group.add(&d.name, open)?;
        }
    }
    tracing::info!(
        databases = file.databases.len(),
        "relaying {} database(s): {}",
        file.databases.len(),
        file.databases
            .iter()
            .map(|d| d.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    if let Some(admin) = &file.admin {
        serve_admin(admin, &file.databases, &group, cancel.clone()).await?;
    }
    if !file.logging.summary_interval.is_zero() {
        tokio::spawn(log_summaries(
            group.clone(),
            file.logging.summary_interval,
            cancel.clone(),
        ));
    }
    cancel.cancelled().await;
    for d in discovery {
        let _ = d.await;
    }
    let relays = group.relays();
    group.shutdown().await;
    for (name, r) in relays {
        let m = r.metrics().snapshot();
        eprintln!(
            "relay of database {name} stopped: sent={} retried={} failed={} lost_leases={}",
            m.sent, m.retried, m.failed, m.lost_leases
        );
    }
    Ok(())
}

/// How a member over `url` is opened: connect (never creating a database), build the relay.
fn opener(
    url: String,
    options: StoreOptions,
    router: Router,
    config: RelayConfig,
    search_indexes: bool,
) -> Opener {
    Arc::new(move || {
        let (url, options, router, config) =
            (url.clone(), options.clone(), router.clone(), config.clone());
        Box::pin(async move {
            let store = open_store(&url, &options.table, &options.inbox_table, Create::Never)
                .await
                .map_err(|e| format!("{e:#}"))?;
            if search_indexes {
                spawn_search_indexes(store.clone());
            }
            let relay = outbox::Relay::builder(store)
                .router(router)
                .config(config)
                .build()?;
            Ok(relay)
        })
    })
}

fn spawn_search_indexes(store: Arc<dyn outbox::Store>) {
    tokio::spawn(async move {
        match store.create_search_indexes().await {
            Ok(present) => tracing::info!(?present, "search indexes present"),
            Err(e) => {
                tracing::warn!(error = %e, "building the search indexes failed; searches stay correct, slower on a large table")
            }
        }
    });
}

/// Keep one member per tenant schema of `d` (PostgreSQL): list the schemas every
/// `rediscover_interval`, add the new, remove (gracefully) the gone. A failed listing changes
/// nothing and is logged; the database's pool is opened (again) with backoff.
async fn discover(
    d: DatabasesEntry,
    router: Router,
    config: RelayConfig,
    group: RelayGroup,
    cancel: CancellationToken,
) {
    let mut base: Option<outbox::PgStore> = None;
    let mut current: BTreeSet<String> = BTreeSet::new();
    let mut failures = 0u32;
    let member = |schema: &str| format!("{}/{schema}", d.name);
    loop {
        let listed = async {
            if base.is_none() {
                base = Some(
                    outbox::PgStore::connect(&d.url, StoreOptions::default())
                        .await
                        .map_err(|e| e.report().to_string())?,
                );
            }
            let store = base.as_ref().expect("just opened");
            match (&d.schemas, &d.schemas_query) {
                (Some(pattern), _) => store.schemas_with_table(pattern, &d.table).await,
                (None, Some(q)) => store.list_by_query(q).await,
                (None, None) => Ok(Vec::new()),
            }
            .map_err(|e| e.report().to_string())
        }
        .await;
        let wait = match listed {
            Ok(schemas) => {
                failures = 0;
                let wanted: BTreeSet<String> = schemas.into_iter().collect();
                for gone in current.difference(&wanted) {
                    tracing::info!(database = %d.name, schema = %gone, "tenant schema gone; stopping its relay");
                    group.remove(&member(gone)).await;
                }
                let store = base.as_ref().expect("listed through it");
                for new in wanted.difference(&current) {
                    let options = StoreOptions {
                        table: format!("{new}.{}", d.table),
                        inbox_table: format!("{new}.{}", d.inbox_table),
                        ..StoreOptions::default()
                    };
                    let open = match store.for_tables(options) {
                        Ok(s) => tenant_opener(s, router.clone(), config.clone()),
                        Err(e) => {
                            tracing::warn!(database = %d.name, schema = %new, error = %e, "tenant schema skipped: its name is not a table name");
                            continue;
                        }
                    };
                    tracing::info!(database = %d.name, schema = %new, "tenant schema found; starting its relay");
                    if let Err(e) = group.add(member(new), open) {
                        tracing::warn!(database = %d.name, schema = %new, error = %e, "tenant schema not added");
                    }
                }
                current = wanted;
                d.rediscover_interval
            }
            Err(e) => {
                failures += 1;
                let wait = outbox::relay::group::REOPEN_BACKOFF
                    .delay(failures)
                    .min(d.rediscover_interval);
                tracing::warn!(database = %d.name, error = %e, retry_in_ms = wait.as_millis() as u64, "listing the tenant schemas failed; the tenants found so far go on");
                wait
            }
        };
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// A tenant member: its store shares the database's pool.
fn tenant_opener(store: outbox::PgStore, router: Router, config: RelayConfig) -> Opener {
    let store: Arc<dyn outbox::Store> = Arc::new(store);
    Arc::new(move || {
        let (store, router, config) = (store.clone(), router.clone(), config.clone());
        Box::pin(async move {
            Ok(outbox::Relay::builder(store)
                .router(router)
                .config(config)
                .build()?)
        })
    })
}

/// The admin surface of a group: `/metrics` (every member labelled `database`), `/healthz` and
/// `/readyz` ([`RelayGroup::health`], [`RelayGroup::readiness`]; `/readyz/<database>` for one),
/// `/` a page listing the databases, and each database's admin API and dashboard under
/// `/databases/<name>/` (a tenant's `<name>/<schema>` is written `<name>~<schema>` in the path).
async fn serve_admin(
    admin: &crate::config::AdminSection,
    databases: &[DatabasesEntry],
    group: &RelayGroup,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register_collector(Box::new(outbox::prometheus::GroupCollector::spawn(
        group.clone(),
        admin.backlog_sample_interval,
        cancel.clone(),
    )));
    let inbox_tables: BTreeMap<String, String> = databases
        .iter()
        .map(|d| (d.name.clone(), d.inbox_table.clone()))
        .collect();
    let apis = Arc::new(MemberApis {
        group: group.clone(),
        auth: admin.auth()?,
        inbox_tables,
        built: Mutex::new(BTreeMap::new()),
        cancel: cancel.clone(),
    });
    let health = {
        let g = group.clone();
        move || {
            let h = g.health();
            async move { crate::admin::health_answer(&h) }
        }
    };
    let ready = {
        let g = group.clone();
        move || {
            let h = g.readiness();
            async move { crate::admin::health_answer(&h) }
        }
    };
    let ready_one = {
        let g = group.clone();
        move |Path(name): Path<String>| {
            let h = g.member_readiness(&name.replace('~', "/"));
            async move {
                match h {
                    Some(h) => crate::admin::health_answer(&h),
                    None => (StatusCode::NOT_FOUND, format!("no database {name}\n")),
                }
            }
        }
    };
    let index = {
        let g = group.clone();
        move || {
            let page = index_page(&g);
            async move { Html(page) }
        }
    };
    let app = crate::admin::metrics_router(Arc::new(Mutex::new(registry)))
        .route("/healthz", axum::routing::get(health))
        .route("/readyz", axum::routing::get(ready))
        .route("/readyz/{name}", axum::routing::get(ready_one))
        .route("/", axum::routing::get(index))
        .route(
            "/favicon.ico",
            axum::routing::get(|| async { StatusCode::NO_CONTENT }),
        )
        .route("/databases/{name}", axum::routing::get(add_slash))
        .merge(
            axum::Router::new()
                .route("/databases/{name}/", axum::routing::any(member_api))
                .route("/databases/{name}/{*rest}", axum::routing::any(member_api))
                .with_state(apis),
        );
    let listener = tokio::net::TcpListener::bind(admin.listen)
        .await
        .with_context(|| format!("admin.listen: cannot listen on {}", admin.listen))?;
    let addr = crate::admin::serve(listener, app, cancel)?;
    tracing::info!(%addr, "serving metrics on http://{addr}/metrics and each database's admin API under http://{addr}/databases/<name>/");
    Ok(())
}

/// `/`: the databases, their state and links to their dashboards.
fn index_page(group: &RelayGroup) -> String {
    let mut rows = String::new();
    for (name, state) in group.members() {
        let (class, text) = match &state {
            MemberState::Running(r) => {
                let h = r.readiness();
                if h.is_ok() {
                    ("ok", "running".to_owned())
                } else {
                    (
                        "bad",
                        format!("running, not ready: {}", h.problems.join("; ")),
                    )
                }
            }
            MemberState::Opening { last_error, .. } => (
                "bad",
                last_error
                    .clone()
                    .map_or("being opened".to_owned(), |e| format!("not running: {e}")),
            ),
        };
        let path = name.replace('/', "~");
        rows.push_str(&format!(
            "<tr><td><a href=\"databases/{}/\">{}</a></td><td class=\"{class}\">{}</td></tr>\n",
            escape(&path),
            escape(&name),
            escape(&text)
        ));
    }
    format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>outbox: databases</title>\
         <style>body{{font-family:system-ui,sans-serif;margin:2rem}}td{{padding:.3rem 1rem}}\
         .ok{{color:#1a7f37}}.bad{{color:#cf222e}}</style></head><body>\
         <h1>outbox: databases</h1><table><tr><th>database</th><th>state</th></tr>\n{rows}</table>\
         <p><a href=\"metrics\">metrics</a> · <a href=\"readyz\">readiness</a></p></body></html>"
    )
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Each member's admin API, built when first asked for and again when the member was reopened
/// (a new store).
struct MemberApis {
    group: RelayGroup,
    auth: outbox::admin::http::AdminAuth,
    /// Inbox table per configured database (a tenant's is `<schema>.<inbox_table>`).
    inbox_tables: BTreeMap<String, String>,
    /// Member name → (its relay's store, its API, the token stopping its series sampler).
    built: Mutex<BuiltApis>,
    cancel: CancellationToken,
}

type BuiltApis = BTreeMap<String, (Arc<dyn outbox::Store>, axum::Router, CancellationToken)>;

impl MemberApis {
    fn api(&self, member: &str) -> Option<axum::Router> {
        let relay = self
            .group
            .relays()
            .into_iter()
            .find(|(n, _)| n == member)
            .map(|(_, r)| r)?;
        let store = relay.store().clone();
        let mut built = self.built.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((s, api, _)) = built.get(member)
            && Arc::ptr_eq(s, &store)
        {
            return Some(api.clone());
        }
        let (db, schema) = match member.split_once('/') {
            Some((db, schema)) => (db, Some(schema)),
            None => (member, None),
        };
        let inbox = self.inbox_tables.get(db)?;
        let inbox = match schema {
            Some(s) => format!("{s}.{inbox}"),
            None => inbox.clone(),
        };
        let stop = self.cancel.child_token();
        let series = outbox::admin::series::Series::new(Duration::from_secs(10));
        series.spawn_sampler(relay.metrics().clone(), stop.clone());
        let mut api =
            outbox::admin::http::AdminApi::new(store.clone(), self.auth.clone()).series(series);
        match outbox::admin::inbox::InboxAdmin::on_store(&*store, &inbox) {
            Ok(i) => api = api.inbox(i),
            Err(e) => {
                tracing::warn!(database = %member, error = %e, "inbox dead letters not served")
            }
        }
        let router = api.router();
        if let Some((_, _, old)) = built.insert(member.to_owned(), (store, router.clone(), stop)) {
            old.cancel();
        }
        Some(router)
    }
}

/// `/databases/<name>` → `/databases/<name>/`, so the dashboard's relative paths resolve.
async fn add_slash(Path(name): Path<String>) -> Response {
    axum::response::Redirect::permanent(&format!("/databases/{name}/")).into_response()
}

/// `/databases/<name>/<rest>`: `<rest>` of that member's admin API.
async fn member_api(State(apis): State<Arc<MemberApis>>, mut req: Request) -> Response {
    let path = req.uri().path().to_owned();
    let Some(after) = path.strip_prefix("/databases/") else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let (name, rest) = after.split_once('/').unwrap_or((after, ""));
    let member = name.replace('~', "/");
    let Some(api) = apis.api(&member) else {
        let known = apis.group.names().contains(&member);
        return if known {
            (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("database {member} is not running now (see /readyz/{name})\n"),
            )
                .into_response()
        } else {
            (StatusCode::NOT_FOUND, format!("no database {member}\n")).into_response()
        };
    };
    let query = req
        .uri()
        .query()
        .map(|q| format!("?{q}"))
        .unwrap_or_default();
    let Ok(uri) = format!("/{rest}{query}").parse() else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    *req.uri_mut() = uri;
    match api.oneshot(req).await {
        Ok(r) => r,
        Err(never) => match never {},
    }
}

/// Every `every`, one INFO line per database (`[logging] summary_interval`): for a running one
/// what its relay did since the last line and its backlog ([`crate::summary_text`]), taken for
/// every database at once so one that does not answer delays no other's line; for one not
/// running, its last error.
async fn log_summaries(group: RelayGroup, every: Duration, cancel: CancellationToken) {
    let mut last: BTreeMap<String, outbox::MetricsSnapshot> = BTreeMap::new();
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        let lines = futures::future::join_all(group.members().into_iter().map(|(name, state)| {
            let before = last.get(&name).copied().unwrap_or_default();
            async move {
                match state {
                    MemberState::Running(relay) => {
                        let now = relay.metrics().snapshot();
                        let problems = relay.readiness().problems;
                        let text = crate::summary_text(
                            &relay,
                            &before,
                            &now,
                            every,
                            "not ready",
                            &problems,
                        )
                        .await;
                        (name, Some(now), text)
                    }
                    MemberState::Opening {
                        failures,
                        last_error,
                    } => {
                        let error = last_error.unwrap_or_else(|| "being opened".into());
                        let text =
                            format!("summary: not running ({failures} failed attempts): {error}");
                        (name, None, text)
                    }
                }
            }
        }))
        .await;
        for (name, now, text) in lines {
            tracing::info!(database = %name, "{text}");
            if let Some(now) = now {
                last.insert(name, now);
            }
        }
    }
}
