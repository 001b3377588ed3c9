//! The inboxes' dead letters through the admin API (`outbox::admin::http::router`) over real
//! HTTP on each database, written by the consumer runner's `Inbox::dead_letter`.

use outbox_testkit_macros::suite_test;
use std::sync::Arc;

use outbox_testkit::StoreFixture;
use serde_json::json;

use crate::admin::{TOKEN, auth, get, post, serve_app};

/// The inbox's dead letters through the API on each database: the consumer runner's
/// `Inbox::dead_letter` writes them; the API lists consumers and dead letters, shows one with
/// headers and payload, refuses a change without the token (nothing changes), requests a replay
/// (the consumer side's `replay_requested` then runs it through its handler) and discards one
/// (the inbox keeps its rejected verdict). The caller creates `<table>_effects` (the handler's).
async fn inbox_scenario<DB: outbox::InboxBackend>(
    store: Arc<dyn outbox::Store>,
    pool: sqlx::Pool<DB>,
    table: &str,
) where
    crate::inbox::EffectHandler: outbox::Handler<DB>,
{
    use outbox::{Inbox, Verdict};
    let inventory = Inbox::<DB>::new(pool.clone(), table, "inventory").unwrap();
    inventory.migrate().await.unwrap();
    let billing = Inbox::<DB>::new(pool.clone(), table, "billing").unwrap();
    let mut ids = Vec::new();
    for (inbox, n) in [(&inventory, 3), (&billing, 1)] {
        for i in 0..n {
            let mut msg = crate::inbox::inbound(uuid::Uuid::now_v7());
            msg.payload = format!(r#"{{"order":{i}}}"#).into_bytes();
            msg.partition_key = Some(format!("order-{i}"));
            inbox
                .dead_letter(&msg, "stock service said no", 5)
                .await
                .unwrap();
            ids.push(msg.message_id);
        }
    }
    let admin = outbox::admin::inbox::InboxAdmin::on_store(&*store, table).unwrap();
    let app = outbox::admin::http::AdminApi::new(store, auth())
        .inbox(admin)
        .router();
    let (base, cancel) = serve_app(app).await;

    let (code, c) = get(&base, "/api/inbox").await;
    assert_eq!(code, 200, "{c}");
    assert_eq!(c["consumers"][0]["consumer"], "inventory", "{c}");
    assert_eq!(c["consumers"][0]["dead_letters"], 3, "{c}");
    assert_eq!(c["consumers"][1]["consumer"], "billing", "{c}");
    let (_, page) = get(&base, "/api/inbox/dead-letters?consumer=inventory").await;
    assert_eq!(page["dead_letters"].as_array().unwrap().len(), 3, "{page}");
    let (_, all) = get(&base, "/api/inbox/dead-letters").await;
    assert_eq!(all["dead_letters"].as_array().unwrap().len(), 4, "{all}");
    let (code, one) = get(
        &base,
        &format!("/api/inbox/dead-letters/inventory/{}", ids[0]),
    )
    .await;
    assert_eq!(code, 200, "{one}");
    assert_eq!(one["error"], "stock service said no", "{one}");
    assert_eq!(one["deliveries"], 5, "{one}");
    assert_eq!(one["payload"]["kind"], "json", "{one}");
    assert!(
        one["headers"].as_str().unwrap().contains("orders.created"),
        "{one}"
    );
    let (code, _) = get(
        &base,
        &format!("/api/inbox/dead-letters/billing/{}", ids[0]),
    )
    .await;
    assert_eq!(code, 404, "another consumer's dead letter is not found");
    let (code, _) = get(&base, "/api/inbox/dead-letters/inventory/not-a-uuid").await;
    assert_eq!(code, 400);

    // Without the token: refused, nothing changes.
    let body = json!({"consumer": "inventory", "message_ids": [ids[0].to_string()]});
    let (code, _) = post(&base, "/api/inbox/replay", None, body.clone()).await;
    assert_eq!(code, 401);
    let (code, _) = post(&base, "/api/inbox/discard", Some("wrong"), body.clone()).await;
    assert_eq!(code, 401);
    assert_eq!(inventory.dead_letters(10).await.unwrap().len(), 3);
    assert!(
        inventory
            .dead_letters(10)
            .await
            .unwrap()
            .iter()
            .all(|d| !d.replay_requested)
    );

    // Replay one (and an id that is none of inventory's: reported).
    let (code, r) = post(
        &base,
        "/api/inbox/replay",
        Some(TOKEN),
        json!({"consumer": "inventory", "message_ids": [ids[0].to_string(), ids[3].to_string()]}),
    )
    .await;
    assert_eq!(code, 200, "{r}");
    assert_eq!(r["changed"], 1, "{r}");
    assert_eq!(r["not_changed"][0][0], ids[3].to_string(), "{r}");
    // The consumer side runs the requested replay through its handler: applied now.
    let handler = crate::inbox::EffectHandler::new(&format!("{table}_effects"));
    let replayed = inventory.replay_requested(&handler, 10).await.unwrap();
    assert_eq!(replayed.len(), 1);
    assert_eq!(replayed[0].result, Ok(Verdict::Processed));
    assert_eq!(
        inventory.verdict(ids[0]).await.unwrap(),
        Some(Verdict::Processed)
    );

    // Discard another: gone from the dead letters, the rejected verdict stays.
    let (code, r) = post(
        &base,
        "/api/inbox/discard",
        Some(TOKEN),
        json!({"consumer": "inventory", "message_ids": [ids[1].to_string(), "garbage"]}),
    )
    .await;
    assert_eq!(code, 200, "{r}");
    assert_eq!(r["changed"], 1, "{r}");
    assert!(
        r["not_changed"][0][1]
            .as_str()
            .unwrap()
            .contains("not a message id"),
        "{r}"
    );
    let left: Vec<_> = inventory
        .dead_letters(10)
        .await
        .unwrap()
        .into_iter()
        .map(|d| d.message.message_id)
        .collect();
    assert_eq!(left, vec![ids[2]]);
    assert!(matches!(
        inventory.verdict(ids[1]).await.unwrap(),
        Some(Verdict::Rejected { .. })
    ));
    cancel.cancel();
}

#[suite_test]
async fn sqlite_admin_api_settles_inbox_dead_letters(fx: outbox_testkit::SqliteFixture) {
    sqlx::query("CREATE TABLE adm_inbox_effects (message_id TEXT NOT NULL, payload BLOB)")
        .execute(fx.store.pool())
        .await
        .unwrap();
    inbox_scenario(fx.store(), fx.store.pool().clone(), "adm_inbox").await;
}

#[suite_test]
async fn postgres_admin_api_settles_inbox_dead_letters(fx: outbox_testkit::PgFixture) {
    let table = format!("{}.adm_inbox", fx.schema);
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {table}_effects (message_id uuid NOT NULL, payload bytea)"
    )))
    .execute(fx.store.pool())
    .await
    .unwrap();
    inbox_scenario(fx.store(), fx.store.pool().clone(), &table).await;
}

#[suite_test]
async fn mysql_admin_api_settles_inbox_dead_letters(fx: outbox_testkit::MySqlFixture) {
    let table = format!("{}_adm_inbox", fx.table);
    fx.exec(&format!(
        "CREATE TABLE {table}_effects (message_id CHAR(36) NOT NULL, payload LONGBLOB)"
    ))
    .await;
    inbox_scenario(fx.store(), fx.store.pool().clone(), &table).await;
    for t in ["", "_dlq", "_effects"] {
        fx.exec(&format!("DROP TABLE IF EXISTS {table}{t}")).await;
    }
}
