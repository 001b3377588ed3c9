//! Enqueue, validation, payloads, plain-SQL producers, migration and stats.

use super::*;

/// `migrate` can run again (twice) without error or data loss.
pub async fn migrate_is_idempotent<F: StoreFixture>(fx: &F) {
    let ids = fx
        .enqueue_commit(vec![NewMessage::new("t", "x")])
        .await
        .unwrap();
    fx.store().migrate().await.expect("second migrate");
    fx.store().migrate().await.expect("third migrate");
    let rows = fx.rows().await;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].message_id, ids[0]);
}

/// A rolled-back enqueue is never visible to the relay's read; a committed one is read.
pub async fn rollback_is_never_visible<F: StoreFixture>(fx: &F) {
    fx.enqueue_rollback(vec![NewMessage::new("t", "rolled-back")])
        .await
        .expect("enqueue inside the transaction works");
    let store = fx.store();
    let mut relay = sole_relay(&store, "relay-a", LONG).await;
    assert!(
        relay.read(&store, 10).await.is_empty(),
        "rolled back message read"
    );
    assert!(fx.rows().await.is_empty());
    let ids = fx
        .enqueue_commit(vec![NewMessage::new("t", "committed")])
        .await
        .unwrap();
    let work = relay.read(&store, 10).await;
    assert_eq!(
        work.iter()
            .map(|w| w.row.message.message_id)
            .collect::<Vec<_>>(),
        ids
    );
}

/// Validation errors are typed and raised before anything is written, and a bad message in a
/// batch writes none of the batch.
pub async fn validation_errors_write_nothing<F: StoreFixture>(fx: &F) {
    let e = fx
        .enqueue_commit(vec![NewMessage::new("", "x")])
        .await
        .unwrap_err();
    assert!(matches!(e, EnqueueError::InvalidTopic(_)), "{e:?}");
    let e = fx
        .enqueue_commit(vec![NewMessage::new("t", vec![0u8; 1024 * 1024 + 1])])
        .await
        .unwrap_err();
    assert!(matches!(e, EnqueueError::PayloadTooLarge { .. }), "{e:?}");
    let e = fx
        .enqueue_commit(vec![NewMessage::new("t", "x").with_header("bad name", "v")])
        .await
        .unwrap_err();
    assert!(matches!(e, EnqueueError::InvalidHeaderName(_)), "{e:?}");
    let e = fx
        .enqueue_commit(vec![
            NewMessage::new("t", "good"),
            NewMessage::new("t", "x").with_header("outbox-topic", "spoof"),
        ])
        .await
        .unwrap_err();
    assert!(matches!(e, EnqueueError::InvalidHeaderName(_)), "{e:?}");
    assert!(fx.rows().await.is_empty(), "a refused enqueue wrote rows");
}

/// Payload bytes round-trip byte-exact: invalid UTF-8 (0xFF 0xFE), NUL bytes, and JSON with a
/// `\u0000` escape (shared case C08).
pub async fn payload_round_trips_byte_exact<F: StoreFixture>(fx: &F) {
    let binary = vec![0xFF, 0xFE, 0x00, 0x01, 0x80, 0xC3, 0x28];
    let json =
        NewMessage::json("t", &serde_json::json!({"s": "a\u{0000}b", "emoji": "😀"})).unwrap();
    let json_bytes = json.payload().to_vec();
    assert!(
        json_bytes.windows(6).any(|w| w == b"\\u0000"),
        "the JSON carries the \\u0000 escape"
    );
    let raw_nul = b"{\"s\":\"a\x00b\"}".to_vec();
    let ids = fx
        .enqueue_commit(vec![
            NewMessage::new("t", binary.clone()),
            json,
            NewMessage::new("t", raw_nul.clone()),
            NewMessage::new("t", Vec::new()),
        ])
        .await
        .unwrap();
    let store = fx.store();
    let mut a = sole_relay(&store, "relay-a", LONG).await;
    let work = a.read(&store, 10).await;
    let by_id = |id| {
        work.iter()
            .find(|w| w.row.message.message_id == id)
            .expect("read")
            .row
            .message
            .clone()
    };
    assert_eq!(by_id(ids[0]).payload, binary);
    assert_eq!(by_id(ids[1]).payload, json_bytes);
    assert_eq!(by_id(ids[2]).payload, raw_nul);
    assert_eq!(by_id(ids[3]).payload, Vec::<u8>::new());
    assert_eq!(
        by_id(ids[1])
            .headers
            .get("content-type")
            .map(String::as_str),
        Some("application/json")
    );
}

/// A row inserted with plain SQL by a foreign producer, giving only the required columns (the
/// README's public contract), is read with the defaults and delivered by the relay: SENT after
/// one attempt.
pub async fn plain_sql_insert_is_delivered<F: StoreFixture>(fx: &F) {
    let id = fx.insert_plain_sql("foreign.topic", b"from java").await;
    let store = fx.store();
    let mut a = sole_relay(&store, "relay-a", LONG).await;
    let work = a.read(&store, 10).await;
    assert_eq!(work.len(), 1);
    let m = &work[0].row.message;
    assert_eq!(m.message_id, id);
    assert_eq!(m.topic, "foreign.topic");
    assert_eq!(m.payload, b"from java");
    assert!(m.headers.is_empty());
    assert_eq!(m.attempts, 0);
    a.leave(&store).await;

    let mem = Arc::new(MemoryTransport::new());
    let handle = spawn_relay(fx, &mem);
    within("the delivery", Duration::from_secs(15), mem.wait_for(1)).await;
    wait_status(fx, id, Status::Sent).await;
    let delivered = mem.delivered();
    assert_eq!(delivered.len(), 1);
    let m = &delivered[0].message;
    assert_eq!(m.message_id, id);
    assert_eq!(m.topic, "foreign.topic");
    assert_eq!(m.payload, b"from java");
    assert_eq!(delivered[0].destination, "foreign.topic");
    assert_eq!(fx.row(id).await.attempts, 1);
    handle.shutdown().await.unwrap();
}

/// A row a 0.1 relay left SENDING (it claimed the row, then stopped) is not read by the relay,
/// which reads PENDING rows only; `migrate` releases it (PENDING, lease cleared, due now) and the
/// relay publishes it. Issue 12: the row-claim protocol and its reaper are gone.
pub async fn migrate_releases_sending_rows_of_an_older_relay<F: StoreFixture>(fx: &F) {
    let ids = fx
        .enqueue_commit(vec![
            NewMessage::new("upgrade", "left SENDING"),
            NewMessage::new("upgrade", "pending"),
        ])
        .await
        .expect("enqueue");
    fx.leave_sending(ids[0]).await;
    let store = fx.store();

    let mem = Arc::new(MemoryTransport::new());
    let handle = spawn_relay(fx, &mem);
    wait_status(fx, ids[1], Status::Sent).await;
    handle.shutdown().await.unwrap();
    let left = fx.row(ids[0]).await;
    assert_eq!(
        left.status,
        Status::Sending.as_i16(),
        "the relay reads PENDING rows only"
    );
    assert_eq!(mem.delivered().len(), 1);

    store.migrate().await.expect("migrate");
    let released = fx.row(ids[0]).await;
    assert_eq!(
        released.status,
        Status::Pending.as_i16(),
        "migrate releases SENDING rows"
    );
    assert_eq!(released.lease_token, None, "the row lease is cleared");
    assert!(
        released.due_in_ms <= 0,
        "due at once, not after the old lease: {} ms",
        released.due_in_ms
    );
    store
        .migrate()
        .await
        .expect("migrate again changes nothing");

    let handle = spawn_relay(fx, &mem);
    wait_status(fx, ids[0], Status::Sent).await;
    handle.shutdown().await.unwrap();
    let delivered: Vec<Uuid> = mem
        .delivered()
        .iter()
        .map(|d| d.message.message_id)
        .collect();
    assert_eq!(delivered, vec![ids[1], ids[0]]);
    let row = fx.row(ids[0]).await;
    assert_eq!(
        row.attempts, 2,
        "the 0.1 relay's attempt is kept and this one counted"
    );
}

/// Table names that are not plain identifiers are rejected before any SQL runs.
pub async fn invalid_table_identifiers_are_rejected<F: StoreFixture>(fx: &F) {
    for bad in [
        "outbox; DROP TABLE outbox",
        "",
        "1outbox",
        "out box",
        "\"outbox\"",
        "a.b.c",
    ] {
        let e = fx.open_with_table(bad).await.expect_err(bad);
        assert_eq!(e.kind(), StoreErrorKind::Config, "{bad:?}: {e:?}");
    }
}

/// `next_due_in` and `stats` on an empty and a non-empty table; a delayed message is not read
/// before its delay.
pub async fn delayed_message_and_stats<F: StoreFixture>(fx: &F) {
    let store = fx.store();
    assert_eq!(store.next_due_in().await.unwrap(), None);
    let stats = store.stats().await.unwrap();
    assert!(stats.counts.values().all(|n| *n == 0));
    assert_eq!(stats.oldest_pending_age, None);
    fx.enqueue_commit(vec![
        NewMessage::new("t", "later").with_delay(Duration::from_secs(30)),
    ])
    .await
    .unwrap();
    let due = store.next_due_in().await.unwrap().expect("pending row");
    assert!(
        due > Duration::from_secs(28) && due <= Duration::from_secs(30),
        "{due:?}"
    );
    let mut a = sole_relay(&store, "relay-a", LONG).await;
    assert!(a.read(&store, 10).await.is_empty());
    let due = a.next_due(&store).await.expect("pending row");
    assert!(due > Duration::from_secs(28), "{due:?}");
    fx.enqueue_commit(vec![NewMessage::new("t", "now")])
        .await
        .unwrap();
    assert_eq!(store.next_due_in().await.unwrap(), Some(Duration::ZERO));
    assert_eq!(a.read(&store, 10).await.len(), 1);
    let stats = store.stats().await.unwrap();
    assert_eq!(stats.counts[&Status::Pending], 2);
    assert!(stats.oldest_pending_age.is_some());
}
