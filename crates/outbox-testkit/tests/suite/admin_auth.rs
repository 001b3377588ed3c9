//! The admin API's one gate (`outbox::admin::http::router`'s authorization layer), over real
//! HTTP on a SQLite store: every `/api` route but the OpenAPI document is behind it, a `GET` is
//! a read and anything else a mutation, and a refused request reaches no handler (nothing
//! changes, not even an unknown action's 404 is revealed).

use outbox_testkit_macros::suite_test;
use serde_json::json;

use outbox::Status;
use outbox::admin::http::{AdminAuth, router};
use outbox_testkit::StoreFixture as _;

use crate::admin::{TOKEN, serve_app};

/// Every read route of the API (those that need a relay or an inbox answer 404 here, past the
/// gate).
const READS: &[&str] = &[
    "/api/overview",
    "/api/messages",
    "/api/messages/1",
    "/api/relays",
    "/api/keys/blocked",
    "/api/series",
    "/api/inbox",
    "/api/inbox/dead-letters",
    "/api/inbox/dead-letters/c/00000000-0000-7000-8000-000000000001",
];

/// Every mutation route, with a body it would accept.
fn mutations() -> Vec<(&'static str, serde_json::Value)> {
    vec![
        ("/api/messages/requeue", json!({"ids": [1]})),
        ("/api/messages/discard", json!({"ids": [1]})),
        ("/api/messages/no-such-action", json!({"ids": [1]})),
        (
            "/api/inbox/replay",
            json!({"consumer": "c", "message_ids": []}),
        ),
        (
            "/api/inbox/discard",
            json!({"consumer": "c", "message_ids": []}),
        ),
        (
            "/api/prepared",
            json!({"topic": "t", "payload": "p", "check_back": "hook:h"}),
        ),
        (
            "/api/prepared/00000000-0000-7000-8000-000000000001/commit",
            json!({}),
        ),
        (
            "/api/prepared/00000000-0000-7000-8000-000000000001/rollback",
            json!({}),
        ),
    ]
}

async fn status(req: reqwest::RequestBuilder, token: Option<&str>) -> u16 {
    let req = match token {
        Some(t) => req.bearer_auth(t),
        None => req,
    };
    req.send().await.expect("request").status().as_u16()
}

#[suite_test]
async fn admin_api_gates_every_route_in_one_layer(fx: outbox_testkit::SqliteFixture) {
    let failed = fx.commit_one(outbox::NewMessage::new("orders", "x")).await;
    sqlx::query("UPDATE outbox SET status = ?1")
        .bind(Status::Failed.as_i16())
        .execute(fx.store.pool())
        .await
        .unwrap();
    let http = reqwest::Client::new();

    // Reads protected too: without the token (or with a wrong one) every route but the
    // dashboard's files and the OpenAPI document is refused.
    let protected = AdminAuth {
        token: Some(TOKEN.into()),
        protect_reads: true,
    };
    let (base, stop) = serve_app(router(fx.store(), protected)).await;
    for path in ["/", "/assets/app.js", "/api/openapi.json"] {
        assert_eq!(
            status(http.get(format!("{base}{path}")), None).await,
            200,
            "{path}"
        );
    }
    for path in READS {
        let get = || http.get(format!("{base}{path}"));
        assert_eq!(status(get(), None).await, 401, "{path}");
        assert_eq!(status(get(), Some("wrong")).await, 401, "{path}");
        let with = status(get(), Some(TOKEN)).await;
        assert!(with == 200 || with == 404, "{path} with the token: {with}");
    }
    for (path, body) in mutations() {
        let post = || http.post(format!("{base}{path}")).json(&body);
        assert_eq!(status(post(), None).await, 401, "{path}");
        assert_eq!(status(post(), Some("wrong")).await, 401, "{path}");
    }
    // Past the gate, the handlers answer as before.
    let unknown = http
        .post(format!("{base}/api/messages/no-such-action"))
        .json(&json!({"ids": [1]}));
    assert_eq!(status(unknown, Some(TOKEN)).await, 404);
    stop.cancel();

    // No token configured: reads are open, every mutation is refused (403).
    let (base, stop) = serve_app(router(fx.store(), AdminAuth::default())).await;
    for path in ["/api/overview", "/api/messages"] {
        assert_eq!(
            status(http.get(format!("{base}{path}")), None).await,
            200,
            "{path}"
        );
    }
    for (path, body) in mutations() {
        let post = http.post(format!("{base}{path}")).json(&body);
        assert_eq!(status(post, Some(TOKEN)).await, 403, "{path}");
    }
    stop.cancel();

    // Nothing a refused request asked for happened.
    let (page,): (i64,) = sqlx::query_as("SELECT count(*) FROM outbox WHERE status = ?1")
        .bind(Status::Failed.as_i16())
        .fetch_one(fx.store.pool())
        .await
        .unwrap();
    assert_eq!(page, 1, "message {failed} is still a dead letter");
}
