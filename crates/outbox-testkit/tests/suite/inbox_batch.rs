//! The batched inbox (`RunnerSettings::inbox_batch`) through `deliver_batch`, the function every
//! consumer runner calls with each fetched batch, on PostgreSQL: many messages per inbox
//! transaction, and a message whose handler fails, rejects or panics in the middle of a batch
//! costs the others nothing (each applied exactly once, per key in order), while the failing
//! ones end as they would alone; and, on each of the three databases, a batch's multi-row inbox
//! insert tells new messages from recorded and repeated ones.

use outbox_testkit_macros::suite_test;
use std::sync::Mutex;
use std::sync::atomic::Ordering;

use async_trait::async_trait;
use outbox::consumer::{ConsumerMetrics, DeliveryPolicy, Disposition, deliver_batch};
use outbox::{HandlerError, InboundMessage, Inbox, Verdict};
use outbox_testkit::{PgFixture, StoreFixture as _};
use sqlx::{AssertSqlSafe, PgConnection};
use uuid::Uuid;

use crate::inbox::interleaved;

/// Writes each message's effect (key, sequence) first, then fails as scripted, so a rolled-back
/// effect would show as a missing or extra row.
struct Script {
    effects: String,
    /// A message and how many more times it fails transiently.
    fail: Mutex<(Uuid, u32)>,
    reject: Uuid,
    panic: Uuid,
}

#[async_trait]
impl outbox::Handler<sqlx::Postgres> for Script {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        msg: &InboundMessage,
    ) -> Result<(), HandlerError> {
        let seq: i32 = std::str::from_utf8(&msg.payload).unwrap().parse().unwrap();
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {} (message_id, key, seq) VALUES ($1, $2, $3)",
            self.effects
        )))
        .bind(msg.message_id)
        .bind(msg.partition_key.clone())
        .bind(seq)
        .execute(&mut *conn)
        .await
        .map_err(HandlerError::transient)?;
        if msg.message_id == self.panic {
            panic!("scripted panic after the effect");
        }
        if msg.message_id == self.reject {
            return Err(HandlerError::reject("out of stock"));
        }
        let mut fail = self.fail.lock().unwrap();
        if fail.0 == msg.message_id && fail.1 > 0 {
            fail.1 -= 1;
            return Err(HandlerError::transient("chosen failure"));
        }
        Ok(())
    }
}

#[suite_test]
async fn deliver_batch_in_inbox_batches_isolates_failures_and_keeps_order(fx: PgFixture) {
    let pool = fx.store.pool().clone();
    let effects = format!("{}.batch_effects", fx.schema);
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {effects} (n bigserial PRIMARY KEY, message_id uuid NOT NULL, key text, seq int)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let inbox = Inbox::<sqlx::Postgres>::new(pool.clone(), &fx.inbox_table(), "batched").unwrap();
    inbox.migrate().await.unwrap();
    let batch = interleaved(8, 10);
    let find = |key: &str, seq: &[u8]| {
        batch
            .iter()
            .find(|m| m.partition_key.as_deref() == Some(key) && m.payload == seq)
            .unwrap()
            .message_id
    };
    let (flaky, refused, poison) = (find("k3", b"4"), find("k5", b"2"), find("k6", b"7"));
    let h = Script {
        effects: effects.clone(),
        // Twice: once in its batch, once alone; it applies at its second delivery.
        fail: Mutex::new((flaky, 2)),
        reject: refused,
        panic: poison,
    };
    let policy = DeliveryPolicy {
        inbox_batch: 16,
        max_deliveries: 2,
        ..DeliveryPolicy::default()
    };
    let metrics = ConsumerMetrics::default();
    let d = deliver_batch(&inbox, &h, &batch, 2, &policy, &metrics).await;
    assert_eq!(d.len(), batch.len());
    let mut retried = Vec::new();
    for (m, d) in batch.iter().zip(&d) {
        let key = m.partition_key.as_deref().unwrap();
        let seq: u32 = std::str::from_utf8(&m.payload).unwrap().parse().unwrap();
        let held = (key == "k3" && seq >= 4) || (key == "k6" && seq >= 7);
        match d {
            Disposition::Retry(_) if held => retried.push(m.clone()),
            Disposition::Ack(Verdict::Rejected { reason })
                if m.message_id == refused && reason == "out of stock" => {}
            Disposition::Ack(Verdict::Processed) if !held && m.message_id != refused => {}
            other => panic!("{key} #{seq}: unexpected {other:?}"),
        }
    }
    assert_eq!(retried.len(), 6 + 3);
    // The broker redelivers the held messages: k3 applies in order, the poison message is
    // dead-lettered at its second delivery and k6's last two apply after it.
    for m in &mut retried {
        m.delivery_count = 2;
    }
    let d = deliver_batch(&inbox, &h, &retried, 2, &policy, &metrics).await;
    for (m, d) in retried.iter().zip(&d) {
        match d {
            Disposition::Ack(Verdict::Rejected { reason }) if m.message_id == poison => {
                assert!(reason.contains("dead-lettered"), "{reason}")
            }
            Disposition::Ack(Verdict::Processed) if m.message_id != poison => {}
            other => panic!("{:?}: unexpected {other:?}", m.partition_key),
        }
    }
    let rows: Vec<(Uuid, String, i32)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT message_id, key, seq FROM {effects} ORDER BY n"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        rows.len(),
        78,
        "every message but the two failing ones, once"
    );
    for m in &batch {
        let n = rows.iter().filter(|r| r.0 == m.message_id).count();
        let want = usize::from(m.message_id != refused && m.message_id != poison);
        assert_eq!(n, want, "effects of {:?} #{:?}", m.partition_key, m.payload);
    }
    for k in 0..8 {
        let key = format!("k{k}");
        let seqs: Vec<i32> = rows.iter().filter(|r| r.1 == key).map(|r| r.2).collect();
        let mut sorted = seqs.clone();
        sorted.sort();
        assert_eq!(seqs, sorted, "key {key} out of order");
    }
    let dead = inbox.dead_letters(10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].message.message_id, poison);
    assert!(
        metrics.inbox_batches.load(Ordering::Relaxed) >= 4,
        "batches committed: {}",
        metrics.inbox_batches.load(Ordering::Relaxed)
    );
    // The transient failure, the rejection and the panic (twice) each split a batch.
    assert!(metrics.inbox_batch_splits.load(Ordering::Relaxed) >= 3);
    assert_eq!(metrics.applied.load(Ordering::Relaxed), 78);
    assert_eq!(metrics.dead_lettered.load(Ordering::Relaxed), 1);
}

/// The batch's inbox rows go in multi-row statements on every database (PostgreSQL `unnest`,
/// SQLite `VALUES … RETURNING`, MySQL/MariaDB `INSERT IGNORE … VALUES` after a savepoint, back to
/// one row per message when some were recorded already). Through `deliver_batch`: a batch of new
/// messages is applied in one transaction; a second batch mixing recorded messages, two copies
/// of one new message and another new one applies only the new ones, once each, and answers
/// the rest as duplicates. `count` runs a `SELECT COUNT(*)` on the database.
async fn batch_recognises_recorded_and_repeated<DB>(
    inbox: &Inbox<DB>,
    effects: &str,
    count: impl AsyncFn(String) -> i64,
) where
    DB: outbox::InboxBackend,
    crate::inbox::EffectHandler: outbox::Handler<DB>,
{
    use crate::inbox::{EffectHandler, inbound};
    let h = EffectHandler::new(effects);
    let policy = DeliveryPolicy {
        inbox_batch: 16,
        ..DeliveryPolicy::default()
    };
    let metrics = ConsumerMetrics::default();
    let m: Vec<InboundMessage> = (0..7).map(|_| inbound(Uuid::now_v7())).collect();
    let d = deliver_batch(inbox, &h, &m[..5], 1, &policy, &metrics).await;
    assert!(
        d.iter().all(|d| *d == Disposition::Ack(Verdict::Processed)),
        "{d:?}"
    );
    assert_eq!(metrics.inbox_batches.load(Ordering::Relaxed), 1);
    assert_eq!(metrics.applied.load(Ordering::Relaxed), 5);

    let second = [
        m[2].clone(),
        m[5].clone(),
        m[5].clone(),
        m[0].clone(),
        m[6].clone(),
    ];
    let d = deliver_batch(inbox, &h, &second, 1, &policy, &metrics).await;
    assert!(
        d.iter().all(|d| *d == Disposition::Ack(Verdict::Processed)),
        "{d:?}"
    );
    assert_eq!(metrics.inbox_batches.load(Ordering::Relaxed), 2);
    assert_eq!(metrics.applied.load(Ordering::Relaxed), 7);
    assert_eq!(metrics.duplicates.load(Ordering::Relaxed), 3);
    assert_eq!(
        h.calls.load(Ordering::SeqCst),
        7,
        "a duplicate ran the handler"
    );
    for msg in &m {
        assert_eq!(
            count(format!(
                "SELECT COUNT(*) FROM {effects} WHERE message_id = '{}'",
                msg.message_id
            ))
            .await,
            1,
            "effects of {}",
            msg.message_id
        );
        assert_eq!(
            count(format!(
                "SELECT COUNT(*) FROM {} WHERE message_id = '{}'",
                inbox.table(),
                msg.message_id
            ))
            .await,
            1,
            "inbox rows of {}",
            msg.message_id
        );
    }
}

#[suite_test]
async fn postgres_batch_recognises_recorded_and_repeated_messages() {
    let (fx, pool, effects) = crate::inbox::pg_with_effects().await;
    let inbox = Inbox::<sqlx::Postgres>::new(pool.clone(), &fx.inbox_table(), "batched").unwrap();
    inbox.migrate().await.unwrap();
    batch_recognises_recorded_and_repeated(&inbox, &effects, async |sql| {
        crate::inbox::pg_count(&pool, &sql).await
    })
    .await;
    fx.cleanup().await;
}

#[suite_test]
async fn mysql_batch_recognises_recorded_and_repeated_messages(fx: outbox_testkit::MySqlFixture) {
    let pool = fx.store.pool().clone();
    let effects = crate::inbox::mysql_effects_of(&fx).await;
    let inbox = Inbox::<sqlx::MySql>::new(pool.clone(), &fx.inbox_table(), "batched").unwrap();
    inbox.migrate().await.unwrap();
    batch_recognises_recorded_and_repeated(&inbox, &effects, async |sql| {
        crate::inbox::mysql_count(&pool, &sql).await
    })
    .await;
    fx.exec(&format!("DROP TABLE IF EXISTS {effects}")).await;
}

#[suite_test]
async fn sqlite_batch_recognises_recorded_and_repeated_messages() {
    let (_fx, pool, inbox) = crate::inbox::sqlite_with_effects("batched").await;
    batch_recognises_recorded_and_repeated(&inbox, "effects", async |sql| {
        sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql))
            .fetch_one(&pool)
            .await
            .unwrap()
    })
    .await;
}
