//! Retention (issue 15, item 4) through the `Relay`'s maintenance, on each database: finished
//! rows are archived or deleted per state while producers keep writing and four relays share
//! the table; nothing unfinished is moved or deleted, no database error surfaces (a deadlock or
//! lock wait would), and dead letters stay until a rule names them.

use outbox_testkit_macros::suite_test;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox::retention::{Retention, Rule};
use outbox::{MemoryTransport, NewMessage, RelayConfig, RelayHandle, Status, TransportErrorKind};
use outbox_testkit::{StoreFixture, wait_metrics, wait_until};

use crate::relay::{fast_config, relay_to};

fixture_tests!(
    stores,
    [crate::retention],
    [
        retention_archives_under_four_relays_with_producers_running = four_relays,
        retention_applies_each_state_rule = per_state,
    ],
);

/// Ten messages the transport refuses for good (dead letters to be) and one delayed an hour.
async fn poison_and_delayed(
    fx: &dyn StoreFixture,
) -> (Arc<MemoryTransport>, Vec<uuid::Uuid>, uuid::Uuid) {
    let mem = Arc::new(MemoryTransport::new());
    let poison = (0..10).map(|i| NewMessage::new("poison", format!("p{i}")));
    let poison = fx.enqueue_commit(poison.collect()).await.expect("enqueue");
    for id in &poison {
        mem.fail_next(*id, vec![TransportErrorKind::Permanent]);
    }
    let later = NewMessage::new("later", "x").with_delay(Duration::from_secs(3600));
    let delayed = fx.commit_one(later).await;
    (mem, poison, delayed)
}

/// Producers: commits of 10 messages every 10 ms for 3 s (about 1,000 messages/s).
async fn produce(fx: &dyn StoreFixture) -> Vec<uuid::Uuid> {
    let started = Instant::now();
    let mut produced = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    for round in 0..300 {
        tick.tick().await;
        let batch = (0..10)
            .map(|i| NewMessage::new("orders", format!("{round}-{i}")))
            .collect();
        produced.extend(fx.enqueue_commit(batch).await.expect("enqueue"));
    }
    let rate = produced.len() as f64 / started.elapsed().as_secs_f64();
    println!("produced {} messages at {rate:.0} msg/s", produced.len());
    produced
}

/// Four relays, producers at about 1,000 messages/s for 3 s, SENT rows archived 100 ms after
/// they were sent. At the end every produced message was published and sits in the archive as
/// SENT; the dead letters and a delayed message are still in the outbox, untouched.
pub async fn four_relays(fx: &dyn StoreFixture) {
    let (mem, poison, delayed) = poison_and_delayed(fx).await;
    let retention = Retention {
        sent: Rule::archive_after(Duration::from_millis(100)),
        ..Retention::default()
    };
    let relays = spawn_four(fx, &mem, retention, "ret");

    let produced = produce(fx).await;

    wait_until(
        "every produced message published and archived",
        Duration::from_secs(90),
        || async { fx.archived().await.len() >= produced.len() },
    )
    .await;
    let archived = fx.archived().await;
    assert_eq!(
        archived.len(),
        produced.len(),
        "only SENT rows are archived"
    );
    let sent = Status::Sent.as_i16();
    for (id, reason, status) in &archived {
        assert_eq!((reason.as_str(), *status), ("retention", sent), "row {id}");
    }
    let delivered: HashSet<_> = mem
        .delivered()
        .iter()
        .map(|d| d.message.message_id)
        .collect();
    for id in &produced {
        assert!(delivered.contains(id), "{id} was published before it left");
    }
    let left = fx.rows().await;
    let left_ids: HashSet<_> = left.iter().map(|r| r.message_id).collect();
    let mut expected: HashSet<_> = poison.iter().copied().collect();
    expected.insert(delayed);
    assert_eq!(
        left_ids, expected,
        "the outbox keeps the dead letters and the delayed message"
    );
    for r in &left {
        let want = if r.message_id == delayed {
            Status::Pending
        } else {
            Status::Failed
        };
        assert_eq!(r.status, want.as_i16(), "{}", r.message_id);
    }
    // A relay counts its rows after the transaction that moved them committed.
    let archived_by_relays = || {
        relays
            .iter()
            .map(|r| r.metrics().snapshot().archived)
            .sum::<u64>()
    };
    wait_until(
        "the relays counted what they archived",
        Duration::from_secs(10),
        || async { archived_by_relays() >= produced.len() as u64 },
    )
    .await;
    shut_down_having_archived(relays, produced.len()).await;
}

/// Each state's rule: SENT rows deleted, dead letters archived (a rule set for them), the
/// archive itself kept; a delayed message never touched.
pub async fn per_state(fx: &dyn StoreFixture) {
    let mem = Arc::new(MemoryTransport::new());
    let ids = fx
        .enqueue_commit(vec![
            NewMessage::new("t", "published"),
            NewMessage::new("t", "dead letter"),
            NewMessage::new("t", "later").with_delay(Duration::from_secs(3600)),
        ])
        .await
        .expect("enqueue");
    mem.fail_next(ids[1], vec![TransportErrorKind::Permanent]);
    let config = RelayConfig {
        retention: Retention {
            sent: Rule::delete_after(Duration::from_millis(50)),
            failed: Rule::archive_after(Duration::from_millis(50)),
            archived: Some(Duration::from_secs(3600)),
            ..Retention::default()
        },
        ..fast_config("ret-rules")
    };
    let relay = relay_to(fx, mem.clone(), config).spawn();
    wait_until(
        "the published row deleted and the dead letter archived",
        Duration::from_secs(30),
        || async { fx.rows().await.len() == 1 && fx.archived().await.len() == 1 },
    )
    .await;
    assert_eq!(mem.count(), 1);
    let left = fx.rows().await;
    assert_eq!(left[0].message_id, ids[2]);
    assert_eq!(left[0].status, Status::Pending.as_i16());
    let archived = fx.archived().await;
    assert_eq!(archived[0].1, "retention");
    assert_eq!(archived[0].2, Status::Failed.as_i16());
    // The relay counts its rows after the transaction that moved them committed.
    wait_metrics(relay.metrics(), 10, "the relay counted them", |m| {
        m.purged + m.archived >= 2
    })
    .await;
    let m = relay.metrics().snapshot();
    assert_eq!((m.purged, m.archived), (1, 1), "{m:?}");
    relay.shutdown().await.expect("shutdown");
}

/// A time-partitioned outbox table on PostgreSQL (`PgStore::migrate_partitioned`): the rows of
/// a day that ended (yesterday's partition: published, dead-lettered, delayed) while four relays
/// share the table and producers write about 1,000 messages/s for 3 s. The holder of bucket 0
/// drops yesterday's partition: its SENT rows land in the archive (ruled `archive`), the dead
/// letters (no rule) and the delayed message are carried forward into today's partition with
/// their row ids, today's rows stay (younger than the partition), and no database error
/// surfaces (a deadlock or a lock wait beyond the detach's timeout would).
#[suite_test]
async fn postgres_partition_drop_under_four_relays_with_producers_running() {
    let fx = outbox_testkit::PgFixture::partitioned().await;
    let t = fx.table();
    let (mem, poison, delayed, old) = published(&fx, 200, "part-r0").await;
    // Everything so far becomes yesterday's.
    let pool = fx.store.pool().clone();
    let yesterday_part = age_into_yesterday(&fx).await;
    let today: String =
        sqlx::query_scalar("SELECT to_char((now() AT TIME ZONE 'UTC')::date, 'YYYYMMDD')")
            .fetch_one(&pool)
            .await
            .unwrap();
    let row_ids = |rows: &[outbox_testkit::RowState], ids: &[uuid::Uuid]| -> Vec<i64> {
        let mut v: Vec<i64> = ids
            .iter()
            .map(|m| rows.iter().find(|r| r.message_id == *m).expect("row").id)
            .collect();
        v.sort_unstable();
        v
    };
    let before = fx.rows().await;
    let mut kept = poison.clone();
    kept.push(delayed);
    let kept_ids = row_ids(&before, &kept);
    let in_yesterday: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {yesterday_part}"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(in_yesterday as usize, poison.len() + 1 + old.len());

    let retention = archive_sent_delete_settled();
    let relays = spawn_four(&fx, &mem, retention, "part");
    let produced = produce(&fx).await;

    wait_until(
        "yesterday's partition dropped",
        Duration::from_secs(60),
        || async {
            let gone: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NULL")
                .bind(&yesterday_part)
                .fetch_one(&pool)
                .await
                .unwrap();
            gone
        },
    )
    .await;
    wait_until(
        "every produced message published",
        Duration::from_secs(60),
        || async {
            fx.rows()
                .await
                .iter()
                .filter(|r| r.status == Status::Sent.as_i16())
                .count()
                == produced.len()
        },
    )
    .await;

    let archived = fx.archived().await;
    let mut archived_ids: Vec<i64> = archived.iter().map(|(id, _, _)| *id).collect();
    archived_ids.sort_unstable();
    assert_eq!(
        archived_ids,
        row_ids(&before, &old),
        "yesterday's SENT rows, archived"
    );
    for (id, reason, status) in &archived {
        assert_eq!(
            (reason.as_str(), *status),
            ("retention", Status::Sent.as_i16()),
            "row {id}"
        );
    }
    let after = fx.rows().await;
    assert_eq!(
        row_ids(&after, &kept),
        kept_ids,
        "the kept rows keep their row ids"
    );
    for r in after.iter().filter(|r| kept.contains(&r.message_id)) {
        let want = if r.message_id == delayed {
            Status::Pending
        } else {
            Status::Failed
        };
        assert_eq!(r.status, want.as_i16(), "{}", r.message_id);
    }
    let in_today: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {t}_p{today}"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        in_today as usize,
        produced.len() + kept.len(),
        "today's partition: the new rows and the carried ones"
    );
    shut_down_having_archived(relays, old.len()).await;
    fx.cleanup().await;
}

/// Four relays over `fx` publishing to `mem` with `retention`, named `{prefix}-r1` to
/// `{prefix}-r4`, spawned.
fn spawn_four(
    fx: &dyn StoreFixture,
    mem: &Arc<MemoryTransport>,
    retention: Retention,
    prefix: &str,
) -> Vec<RelayHandle> {
    (1..=4)
        .map(|i| {
            let config = RelayConfig {
                retention,
                ..fast_config(&format!("{prefix}-r{i}"))
            };
            relay_to(fx, mem.clone(), config).spawn()
        })
        .collect()
}

/// Check that no database error surfaced in `relays` and that together they counted `archived`
/// rows archived, then shut them down.
async fn shut_down_having_archived(relays: Vec<RelayHandle>, archived: usize) {
    let snapshots: Vec<_> = relays.iter().map(|r| r.metrics().snapshot()).collect();
    let errors: u64 = snapshots.iter().map(|s| s.store_errors).sum();
    assert_eq!(errors, 0, "a database error surfaced: {snapshots:?}");
    let by_relays: u64 = snapshots.iter().map(|s| s.archived).sum();
    assert_eq!(by_relays, archived as u64, "{snapshots:?}");
    for r in relays {
        r.shutdown().await.expect("shutdown");
    }
}

/// SENT rows archived and settled ones (CONFIRMED, REJECTED, ROLLED_BACK) deleted once
/// 100 ms old; dead letters (no rule) and PENDING rows kept.
fn archive_sent_delete_settled() -> Retention {
    let soon = Duration::from_millis(100);
    Retention {
        sent: Rule::archive_after(soon),
        confirmed: Rule::delete_after(soon),
        rejected: Rule::delete_after(soon),
        rolled_back: Rule::delete_after(soon),
        ..Retention::default()
    }
}

/// [`poison_and_delayed`] and `n` messages, published and dead-lettered by a relay named
/// `relay` with the default retention (nothing is old yet), which is shut down. Returns the
/// transport, the ten dead letters (FAILED), the delayed message (PENDING) and the `n`
/// published messages (SENT).
async fn published(
    fx: &outbox_testkit::PgFixture,
    n: usize,
    relay: &str,
) -> (
    Arc<MemoryTransport>,
    Vec<uuid::Uuid>,
    uuid::Uuid,
    Vec<uuid::Uuid>,
) {
    let (mem, poison, delayed) = poison_and_delayed(fx).await;
    let old = fx.commit_numbered("old", "", n).await;
    let first = relay_to(fx, mem.clone(), fast_config(relay)).spawn();
    wait_until(
        "the old rows published and the poison dead-lettered",
        Duration::from_secs(30),
        || async {
            let rows = fx.rows().await;
            let count = |s: Status| rows.iter().filter(|r| r.status == s.as_i16()).count();
            count(Status::Sent) == old.len() && count(Status::Failed) == poison.len()
        },
    )
    .await;
    first.shutdown().await.expect("shutdown");
    (mem, poison, delayed, old)
}

/// Every row of `fx`'s partitioned table made yesterday's: yesterday's partition created (the
/// relays create only today's and later ones) and every row moved into it. Returns that
/// partition.
async fn age_into_yesterday(fx: &outbox_testkit::PgFixture) -> String {
    let t = fx.table();
    let (yesterday, today): (String, String) = sqlx::query_as(
        "SELECT to_char((now() AT TIME ZONE 'UTC')::date - 1, 'YYYYMMDD'), \
                to_char((now() AT TIME ZONE 'UTC')::date, 'YYYYMMDD')",
    )
    .fetch_one(fx.store.pool())
    .await
    .unwrap();
    let part = format!("{t}_p{yesterday}");
    fx.exec(&format!(
        "CREATE TABLE {part} PARTITION OF {t} FOR VALUES FROM \
         (to_date('{yesterday}', 'YYYYMMDD')::timestamp AT TIME ZONE 'UTC') TO \
         (to_date('{today}', 'YYYYMMDD')::timestamp AT TIME ZONE 'UTC'); \
         UPDATE {t} SET partitioned_at = partitioned_at - interval '1 day'"
    ))
    .await;
    part
}

/// A relay died between detaching yesterday's partition and dropping it (the detach is done
/// here by hand; the drop never came): the next relay's round finds the detached table, puts
/// the rows that must stay (dead letters without a rule, a delayed message) back into the table
/// with their row ids and states, archives the published rows (ruled `archive`) and drops it.
/// Nothing is lost, nothing is published again, and no database error surfaces.
#[suite_test]
async fn postgres_partition_detached_by_a_dead_relay_is_finished_next_round() {
    let fx = outbox_testkit::PgFixture::partitioned().await;
    let t = fx.table();
    let (mem, poison, delayed, old) = published(&fx, 20, "detached-r0").await;
    let before = fx.rows().await;
    let part = age_into_yesterday(&fx).await;
    fx.exec(&format!("ALTER TABLE {t} DETACH PARTITION {part}"))
        .await;
    assert!(
        fx.rows().await.is_empty(),
        "every row is in the detached partition"
    );
    let published = mem.delivered().len();

    let retention = archive_sent_delete_settled();
    let config = RelayConfig {
        retention,
        ..fast_config("detached-r1")
    };
    let relay = relay_to(&fx, mem.clone(), config).spawn();
    let pool = fx.store.pool().clone();
    wait_until(
        "the detached partition finished",
        Duration::from_secs(30),
        || async {
            sqlx::query_scalar::<_, bool>("SELECT to_regclass($1) IS NULL")
                .bind(&part)
                .fetch_one(&pool)
                .await
                .unwrap()
        },
    )
    .await;
    let id_of = |rows: &[outbox_testkit::RowState], m: &uuid::Uuid| {
        rows.iter()
            .find(|r| r.message_id == *m)
            .map(|r| (r.id, r.status))
    };
    let after = fx.rows().await;
    let mut kept = poison.clone();
    kept.push(delayed);
    for m in &kept {
        assert_eq!(
            id_of(&after, m),
            id_of(&before, m),
            "{m} put back as it was"
        );
    }
    assert_eq!(after.len(), kept.len(), "only the kept rows are back");
    let mut archived: Vec<i64> = fx.archived().await.iter().map(|(id, _, _)| *id).collect();
    archived.sort_unstable();
    let mut old_ids: Vec<i64> = old.iter().map(|m| id_of(&before, m).unwrap().0).collect();
    old_ids.sort_unstable();
    assert_eq!(archived, old_ids, "the published rows, archived");
    assert_eq!(mem.delivered().len(), published, "nothing published again");
    let s = relay.metrics().snapshot();
    assert_eq!(s.store_errors, 0, "{s:?}");
    relay.shutdown().await.expect("shutdown");
    fx.cleanup().await;
}
