//! The admin API (`outbox::admin::http::router`) over real HTTP against each database, with a
//! running `Relay` doing what it does in production: dead letters made by the relay are found
//! by every filter, paged, shown, requeued (and published again by the relay), published early
//! and discarded into the archive; a change without the token is refused and changes nothing.

use outbox_testkit_macros::suite_test;
use std::sync::Arc;
use std::time::Duration;

use outbox::admin::http::{AdminAuth, router};
use outbox::{MemoryTransport, NewMessage, Status, TransportErrorKind};
use outbox_testkit::{StoreFixture, wait_until};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::relay::{fast_config, relay_to};

fixture_tests!(
    stores_and_partitioned,
    [crate::admin],
    [
        admin_api_finds_and_fixes_dead_letters = scenario,
        admin_api_shows_leases_and_blocked_keys = leases_and_blocked_keys,
        admin_api_orders_time_windows_by_the_search_indexes = search_indexes,
    ],
);

pub(crate) const TOKEN: &str = "s3cret-token";

/// The API of `fx`'s store served on a free loopback port until the returned token is
/// cancelled.
async fn serve(fx: &dyn StoreFixture) -> (String, CancellationToken) {
    serve_app(router(fx.store(), auth())).await
}

/// The token-protected authentication every test here uses.
pub(crate) fn auth() -> AdminAuth {
    AdminAuth {
        token: Some(TOKEN.into()),
        protect_reads: false,
    }
}

/// `app` served on a free loopback port until the returned token is cancelled.
pub(crate) async fn serve_app(app: axum::Router) -> (String, CancellationToken) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let cancel = CancellationToken::new();
    let stop = cancel.clone();
    tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move { stop.cancelled().await })
            .await
            .unwrap();
    });
    (format!("http://{addr}"), cancel)
}

pub(crate) async fn get(base: &str, path: &str) -> (u16, Value) {
    let r = reqwest::get(format!("{base}{path}")).await.expect("GET");
    let status = r.status().as_u16();
    (status, r.json().await.expect("a JSON body"))
}

pub(crate) async fn post(base: &str, path: &str, token: Option<&str>, body: Value) -> (u16, Value) {
    let mut req = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .json(&body);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let r = req.send().await.expect("POST");
    let status = r.status().as_u16();
    (status, r.json().await.expect("a JSON body"))
}

/// `POST /api/messages/<action>` (`requeue`, `discard`, `publish-now`) with the token for the
/// rows `ids` (a JSON array): the status code and the report.
async fn act_on(base: &str, action: &str, ids: Value) -> (u16, Value) {
    post(
        base,
        &format!("/api/messages/{action}"),
        Some(TOKEN),
        json!({ "ids": ids }),
    )
    .await
}

/// Wait (at most 20 s) until the relay settled `fx`'s rows: `sent` SENT and `failed` FAILED.
async fn wait_settled(fx: &dyn StoreFixture, sent: usize, failed: usize) {
    let count = |rows: &[outbox_testkit::RowState], status: Status| {
        rows.iter().filter(|r| r.status == status.as_i16()).count()
    };
    wait_until(
        &format!("the relay to settle {sent} rows SENT and {failed} FAILED"),
        Duration::from_secs(20),
        || async {
            let rows = fx.rows().await;
            count(&rows, Status::Sent) == sent && count(&rows, Status::Failed) == failed
        },
    )
    .await;
}

fn ids(page: &Value) -> Vec<i64> {
    page["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| m["id"].as_i64().unwrap())
        .collect()
}

async fn status_of(fx: &dyn StoreFixture, id: i64) -> Option<i16> {
    fx.rows()
        .await
        .into_iter()
        .find(|r| r.id == id)
        .map(|r| r.status)
}

pub async fn scenario(fx: &dyn StoreFixture) {
    let mem = Arc::new(MemoryTransport::new());
    let msgs = vec![
        NewMessage::new("orders.created", r#"{"order":1}"#).with_partition_key("o-1"),
        NewMessage::new("orders.created", r#"{"order":2}"#).with_partition_key("o-2"),
        NewMessage::new("orders.paid", "plain text").with_partition_key("o-1"),
        NewMessage::new("billing.invoice", vec![0xffu8, 0x00]),
        NewMessage::new("billing.invoice", "later").with_delay(Duration::from_secs(3600)),
        NewMessage::new("orders_created", "underscore, not a dot"),
    ];
    let mids = fx.enqueue_commit(msgs).await.expect("enqueue");
    // The relay dead-letters two of them (a permanent broker refusal) and publishes the rest.
    mem.fail_next(mids[1], vec![TransportErrorKind::Permanent]);
    mem.fail_next(mids[3], vec![TransportErrorKind::Permanent]);
    let relay = relay_to(fx, mem.clone(), fast_config("admin-r1")).spawn();
    wait_settled(fx, 3, 2).await;
    let rows = fx.rows().await;
    let row_of = |m: uuid::Uuid| rows.iter().find(|r| r.message_id == m).unwrap().id;
    let (failed_a, failed_b, delayed) = (row_of(mids[1]), row_of(mids[3]), row_of(mids[4]));
    let (base, stop) = serve(fx).await;

    // Search: by state, topic glob (`.` and `_` are themselves), key, message id, error text.
    let (code, page) = get(&base, "/api/messages?state=failed").await;
    assert_eq!(code, 200, "{page}");
    assert_eq!(ids(&page), vec![failed_b, failed_a], "newest first");
    let (_, page) = get(&base, "/api/messages?topic=orders.*").await;
    assert_eq!(
        ids(&page).len(),
        3,
        "orders.* is not orders_created: {page}"
    );
    let (_, page) = get(&base, "/api/messages?key=o-1&state=sent").await;
    assert_eq!(ids(&page), vec![row_of(mids[2]), row_of(mids[0])]);
    let (_, page) = get(&base, &format!("/api/messages?message_id={}", mids[4])).await;
    assert_eq!(ids(&page), vec![delayed]);
    let error = rows
        .iter()
        .find(|r| r.id == failed_a)
        .and_then(|r| r.last_error.clone())
        .expect("the dead letter's reason");
    let needle: String = error.chars().take(12).collect::<String>().to_uppercase();
    let (_, page) = get(
        &base,
        &format!("/api/messages?error={}", urlencode(&needle)),
    )
    .await;
    assert_eq!(ids(&page), vec![failed_b, failed_a], "error text, any case");
    let (_, page) = get(
        &base,
        "/api/messages?created_after=2000-01-01T00:00:00Z&created_before=2999-01-01T00:00:00Z",
    )
    .await;
    assert_eq!(ids(&page).len(), 6);
    let (_, page) = get(&base, "/api/messages?created_after=2999-01-01T00:00:00Z").await;
    assert!(ids(&page).is_empty());

    // Keyset pages: disjoint, in order, together every row; rows written meanwhile do not
    // shift a later page.
    let (_, p1) = get(&base, "/api/messages?limit=4").await;
    let next = p1["next"].as_i64().expect("a next page");
    fx.enqueue_commit(vec![
        NewMessage::new("late", "x").with_delay(Duration::from_secs(3600)),
    ])
    .await
    .unwrap();
    let (_, p2) = get(&base, &format!("/api/messages?limit=4&before={next}")).await;
    assert!(p2["next"].is_null(), "{p2}");
    let mut all = ids(&p1);
    all.extend(ids(&p2));
    let mut expected: Vec<i64> = rows.iter().map(|r| r.id).collect();
    expected.sort_unstable_by(|a, b| b.cmp(a));
    assert_eq!(all, expected);

    // Bad parameters are named.
    let (code, body) = get(&base, "/api/messages?state=lost").await;
    assert_eq!(code, 400);
    assert!(
        body["error"].as_str().unwrap().starts_with("state:"),
        "{body}"
    );
    let (code, body) = get(&base, "/api/messages?colour=red").await;
    assert_eq!(code, 400);
    assert!(body["error"].as_str().unwrap().contains("colour"), "{body}");

    // One message: by row id and by message id; payload rendered; unknown ids are 404.
    let (code, m) = get(&base, &format!("/api/messages/{}", row_of(mids[0]))).await;
    assert_eq!(code, 200, "{m}");
    assert_eq!(m["payload"]["kind"], "json");
    assert_eq!(m["payload"]["text"], "{\n  \"order\": 1\n}");
    assert_eq!(m["status"], "SENT");
    assert_eq!(m["partition_key"], "o-1");
    assert!(
        m["sent_at"].is_string() && m["created_at"].is_string(),
        "{m}"
    );
    let (_, m) = get(&base, &format!("/api/messages/{}", mids[3])).await;
    assert_eq!(
        (m["id"].as_i64(), &m["payload"]["kind"]),
        (Some(failed_b), &json!("hex"))
    );
    assert_eq!(m["status"], "FAILED");
    let (code, _) = get(&base, "/api/messages/999999999").await;
    assert_eq!(code, 404);

    // Changes need the token: refused with 401 and nothing changes.
    let (code, _) = post(
        &base,
        "/api/messages/requeue",
        None,
        json!({"ids": [failed_a]}),
    )
    .await;
    assert_eq!(code, 401);
    let (code, _) = post(
        &base,
        "/api/messages/discard",
        Some("wrong"),
        json!({"filter": {}}),
    )
    .await;
    assert_eq!(code, 401);
    assert_eq!(status_of(fx, failed_a).await, Some(Status::Failed.as_i16()));
    assert_eq!(status_of(fx, failed_b).await, Some(Status::Failed.as_i16()));

    // Requeue one dead letter (and name what cannot be requeued): the relay publishes it again.
    let published = mem.count();
    let (code, report) = act_on(&base, "requeue", json!([failed_a, delayed, 999999999])).await;
    assert_eq!(code, 200, "{report}");
    assert_eq!(report["changed"], 1, "{report}");
    let reasons: Vec<(i64, String)> = report["not_changed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            (
                n["id"].as_i64().unwrap(),
                n["reason"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(reasons.len(), 2, "{report}");
    assert!(
        reasons[0].0 == delayed && reasons[0].1.contains("PENDING"),
        "{reasons:?}"
    );
    assert!(
        reasons[1].0 == 999999999 && reasons[1].1.contains("no such"),
        "{reasons:?}"
    );
    wait_until(
        "the requeued message published again",
        Duration::from_secs(20),
        || async { status_of(fx, failed_a).await == Some(Status::Sent.as_i16()) },
    )
    .await;
    assert!(mem.count() > published);

    // Publish now: the delayed message goes out at once.
    let (_, report) = post(
        &base,
        "/api/messages/publish-now",
        Some(TOKEN),
        json!({"filter": {"topic": "billing.*"}}),
    )
    .await;
    assert_eq!(report["changed"], 1, "{report}");
    wait_until(
        "the delayed message published",
        Duration::from_secs(20),
        || async { status_of(fx, delayed).await == Some(Status::Sent.as_i16()) },
    )
    .await;

    // Discard every dead letter: out of the outbox, into the archive.
    let (_, report) = post(
        &base,
        "/api/messages/discard",
        Some(TOKEN),
        json!({"filter": {"states": ["FAILED"]}}),
    )
    .await;
    assert_eq!(report["changed"], 1, "{report}");
    assert_eq!(status_of(fx, failed_b).await, None);
    assert_eq!(
        fx.archived().await,
        vec![(failed_b, "discarded".to_owned(), Status::Failed.as_i16())]
    );
    let (code, _) = get(&base, &format!("/api/messages/{failed_b}")).await;
    assert_eq!(code, 404);

    // The overview counts what is there now.
    let (_, overview) = get(&base, "/api/overview").await;
    assert_eq!(overview["counts"]["FAILED"], 0, "{overview}");
    assert_eq!(overview["counts"]["SENT"], 5, "{overview}");
    let (_, spec) = get(&base, "/api/openapi.json").await;
    assert_eq!(spec["openapi"], "3.1.0");

    stop.cancel();
    relay.shutdown().await.unwrap();
}

/// Every id of the search `query` (without `limit`/`before`), page by page of `limit`; the
/// pages' order (all the same); `between` runs after the first page with its `next`.
async fn all_pages(
    base: &str,
    query: &str,
    limit: usize,
    between: impl AsyncFnOnce(i64),
) -> (Vec<i64>, String) {
    let (code, page) = get(base, &format!("/api/messages?{query}&limit={limit}")).await;
    assert_eq!(code, 200, "{page}");
    let order = page["order"].as_str().expect("an order").to_owned();
    let mut all = ids(&page);
    let mut next = page["next"].as_i64();
    if let Some(n) = next {
        between(n).await;
    }
    while let Some(before) = next {
        let (code, page) = get(
            base,
            &format!("/api/messages?{query}&limit={limit}&before={before}"),
        )
        .await;
        assert_eq!(code, 200, "{page}");
        assert_eq!(page["order"], order.as_str(), "{page}");
        all.extend(ids(&page));
        next = page["next"].as_i64();
        assert!(all.len() <= 100, "paging does not end: {all:?}");
    }
    (all, order)
}

/// Rows whose creation order is not their id order (backdated by a permutation of hours),
/// published by a relay, one dead-lettered: a creation window is listed by id without the
/// search indexes; `Store::create_search_indexes` builds them (idempotently) and the same
/// window is then listed by creation time, a publication window by publication time, page by
/// page, every row once, even when the row a page ended on is discarded before the next page.
pub async fn search_indexes<F: StoreFixture + outbox_testkit::ConfirmFixture>(fx: &F) {
    const N: usize = 12;
    // Message i is created `hours[i]` hours ago: newest first is the order of `hours`.
    let hours: Vec<u64> = (0..N as u64).map(|i| 1 + (i * 5) % N as u64).collect();
    let msgs: Vec<NewMessage> = (0..N)
        .map(|i| {
            NewMessage::new("search.t", format!("{i}")).with_partition_key(format!("k-{}", i % 3))
        })
        .collect();
    let mids = fx.enqueue_commit(msgs).await.expect("enqueue");
    let mut by_age: Vec<usize> = (0..N).collect();
    by_age.sort_by_key(|&i| hours[i]);
    // The fifth newest is dead-lettered: the first page of 5 (by creation time) ends on it.
    let doomed = by_age[4];
    let mem = Arc::new(MemoryTransport::new());
    mem.fail_next(mids[doomed], vec![TransportErrorKind::Permanent]);
    let relay = relay_to(fx, mem.clone(), fast_config("admin-search")).spawn();
    wait_settled(fx, N - 1, 1).await;
    relay.shutdown().await.unwrap();
    for (i, m) in mids.iter().enumerate() {
        fx.backdate(*m, Duration::from_secs(hours[i] * 3600)).await;
    }
    let rows = fx.rows().await;
    let row_of = |m: uuid::Uuid| rows.iter().find(|r| r.message_id == m).unwrap().id;
    let mut by_id: Vec<i64> = mids.iter().map(|m| row_of(*m)).collect();
    by_id.sort_unstable_by(|a, b| b.cmp(a));
    let by_created: Vec<i64> = by_age.iter().map(|&i| row_of(mids[i])).collect();
    assert_ne!(
        by_id, by_created,
        "the test needs creation order to differ from id order"
    );
    let now = chrono::Utc::now();
    let at = |h: i64| {
        (now - chrono::Duration::hours(h)).to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
    };
    let window = format!(
        "created_after={}&created_before={}",
        at(N as i64 + 2),
        at(0)
    );
    let (base, stop) = serve(fx).await;

    // Without the indexes: by id.
    assert_eq!(
        fx.store().search_indexes().await.unwrap(),
        outbox::admin::SearchIndexes::default()
    );
    let (all, order) = all_pages(&base, &window, 5, async |_| {}).await;
    assert_eq!((all, order.as_str()), (by_id.clone(), "id"));

    // Built, twice (the second finds them all and builds nothing).
    let store = fx.store();
    assert!(store.create_search_indexes().await.unwrap().all());
    assert!(store.create_search_indexes().await.unwrap().all());
    assert!(store.search_indexes().await.unwrap().all());

    // By creation time, every row once.
    let (all, order) = all_pages(&base, &window, 5, async |_| {}).await;
    assert_eq!((all, order.as_str()), (by_created.clone(), "created_at"));
    // A key over every state is still exactly the key's rows, by id.
    let (_, page) = get(&base, "/api/messages?key=k-1").await;
    let mut key_rows: Vec<i64> = (0..N)
        .filter(|i| i % 3 == 1)
        .map(|i| row_of(mids[i]))
        .collect();
    key_rows.sort_unstable_by(|a, b| b.cmp(a));
    assert_eq!(ids(&page), key_rows);

    // A publication window, by publication time (the dead letter was never published).
    let sent_window = format!("sent_after={}", at(N as i64 + 2));
    let published: Vec<i64> = by_created
        .iter()
        .copied()
        .filter(|&id| id != row_of(mids[doomed]))
        .collect();
    let (all, order) = all_pages(&base, &sent_window, 4, async |_| {}).await;
    assert_eq!((all, order.as_str()), (published, "sent_at"));

    // The row the first page ended on is discarded (into the archive) before the next page:
    // the next page still continues right after it.
    let doomed_row = row_of(mids[doomed]);
    let (all, _) = all_pages(&base, &window, 5, async |next| {
        assert_eq!(next, doomed_row, "the first page ends on the dead letter");
        let (code, report) = act_on(&base, "discard", json!([next])).await;
        assert_eq!(
            (code, report["changed"].as_u64()),
            (200, Some(1)),
            "{report}"
        );
    })
    .await;
    assert_eq!(all, by_created, "pages after a discarded cursor row");
    stop.cancel();
}

/// A relay on a `block` route: a dead-lettered head holds its key back; `GET /api/keys/blocked`
/// names the key, its head and what waits behind it, `GET /api/relays` the relay's heartbeat
/// and the buckets it holds; requeueing the head through the API frees the key.
pub async fn leases_and_blocked_keys(fx: &dyn StoreFixture) {
    use crate::ordering::{keyed, poisoned_head_with};
    let behind = vec![
        keyed("orders", "K", "B"),
        keyed("orders", "K", "C"),
        keyed("orders", "other", "D"),
    ];
    let (_mem, ids, relay) =
        poisoned_head_with(fx, behind, outbox::DeadLetterPolicy::Block, "admin-block").await;
    wait_until(
        "A dead-lettered and D published",
        Duration::from_secs(20),
        || async {
            let rows = fx.rows().await;
            let st = |m: uuid::Uuid| rows.iter().find(|r| r.message_id == m).unwrap().status;
            st(ids[0]) == Status::Failed.as_i16() && st(ids[3]) == Status::Sent.as_i16()
        },
    )
    .await;
    let rows = fx.rows().await;
    let head = rows.iter().find(|r| r.message_id == ids[0]).unwrap().id;
    let (base, stop) = serve(fx).await;

    let (code, body) = get(&base, "/api/keys/blocked").await;
    assert_eq!(code, 200, "{body}");
    let keys = body["keys"].as_array().unwrap();
    assert_eq!(keys.len(), 1, "only K is held back: {body}");
    assert_eq!(keys[0]["key"], "K");
    assert_eq!(keys[0]["held_by"], head);
    assert_eq!(keys[0]["waiting"], 2, "B and C wait: {body}");
    assert!(
        keys[0]["since"].is_string() && keys[0]["last_error"].is_string(),
        "{body}"
    );

    let (code, leases) = get(&base, "/api/relays").await;
    assert_eq!(code, 200, "{leases}");
    let relays = leases["relays"].as_array().unwrap();
    assert!(
        relays
            .iter()
            .any(|r| r["name"] == "admin-block" && r["heartbeat_at"].is_string()),
        "{leases}"
    );
    let buckets = leases["buckets"].as_array().unwrap();
    assert_eq!(buckets.len(), usize::from(outbox::store::BUCKETS));
    let held = buckets
        .iter()
        .filter(|b| b["owner"] == "admin-block" && b["expires_at"].is_string())
        .count();
    assert_eq!(
        held,
        usize::from(outbox::store::BUCKETS),
        "one relay holds every bucket: {leases}"
    );
    assert!(leases["now"].is_string());

    // Requeue the head: A, then B and C are published; nothing is held back any more.
    let (_, report) = act_on(&base, "requeue", json!([head])).await;
    assert_eq!(report["changed"], 1, "{report}");
    wait_until("K published in order", Duration::from_secs(20), || async {
        fx.rows()
            .await
            .iter()
            .all(|r| r.status == Status::Sent.as_i16())
    })
    .await;
    let (_, body) = get(&base, "/api/keys/blocked").await;
    assert_eq!(body["keys"].as_array().map(Vec::len), Some(0), "{body}");
    stop.cancel();
    relay.shutdown().await.unwrap();
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A row a foreign producer filled with garbage (SQLite keeps any value in any column: text in
/// the time and count columns, a blob as the key and the headers): the relay dead-letters it
/// and publishes its neighbour; the API still lists it and shows it, with what cannot be read
/// as null or named, so the operator can find and discard it.
#[suite_test]
async fn sqlite_garbage_row_is_listed_shown_and_discarded(fx: outbox_testkit::SqliteFixture) {
    sqlx::query(
        "INSERT INTO outbox (message_id, topic, partition_key, headers, payload, attempts, created_at) \
         VALUES ('00000000-0000-7000-8000-0000000000ff', 'orders', x'00ff', x'ff', 'text payload', 'many', 'yesterday')",
    )
    .execute(fx.store.pool())
    .await
    .unwrap();
    let good = fx.commit_one(NewMessage::new("orders", "ok")).await;
    let mem = Arc::new(MemoryTransport::new());
    let relay = relay_to(&fx, mem.clone(), fast_config("admin-garbage")).spawn();
    // Read through the API itself: the test kit's row reader refuses this row.
    let (base, stop) = serve(&fx).await;
    wait_until(
        "garbage dead-lettered, neighbour sent",
        Duration::from_secs(20),
        || async {
            let (_, sent) = get(
                &base,
                &format!("/api/messages?state=sent&message_id={good}"),
            )
            .await;
            let (_, failed) = get(&base, "/api/messages?state=failed").await;
            ids(&sent).len() == 1 && ids(&failed).len() == 1
        },
    )
    .await;
    let (code, page) = get(&base, "/api/messages").await;
    assert_eq!(code, 200, "{page}");
    assert_eq!(ids(&page).len(), 2, "{page}");
    let bad = &page["messages"][1];
    assert_eq!(bad["status"], "FAILED", "{page}");
    assert_eq!(bad["partition_key"], "<unreadable>", "{page}");
    assert!(bad["created_at"].is_null(), "{page}");
    let id = bad["id"].as_i64().unwrap();
    let (code, m) = get(&base, &format!("/api/messages/{id}")).await;
    assert_eq!(code, 200, "{m}");
    assert!(m["headers_error"].is_string(), "{m}");
    assert_eq!(m["payload"]["text"], "text payload");
    let (_, report) = act_on(&base, "discard", json!([id])).await;
    assert_eq!(report["changed"], 1, "{report}");
    assert_eq!(
        fx.archived().await,
        vec![(id, "discarded".to_owned(), Status::Failed.as_i16())]
    );
    stop.cancel();
    relay.shutdown().await.unwrap();
}
