//! The properties of the consumer conformance suite (listed in the parent module's docs), each
//! generic over the [`Broker`] it runs on.

use super::*;

pub(super) async fn applies_once_and_acks_after_commit<B: Broker>() {
    let r = Rig::<B>::new().await;
    let msgs: Vec<Message> = (0..20).map(|i| message(None, &format!("m{i}"))).collect();
    r.publish(&msgs).await;
    r.run_until(&Settings::new(), "20 effects", WAIT, || async {
        r.c.effects().await.len() == 20
    })
    .await;
    // A restart delivers nothing already acknowledged: only the new marker arrives.
    let s = r.restart_until_a_marker().await;
    assert_eq!(r.c.effects().await.len(), 21);
    assert_eq!(
        s.metrics.duplicates.load(Ordering::Relaxed),
        0,
        "an acknowledged message came back"
    );
    for m in &msgs {
        assert_eq!(
            r.script.deliveries(m.message_id),
            vec![1],
            "{}",
            m.message_id
        );
    }
}

pub(super) async fn redelivers_after_a_transient_error<B: Broker>() {
    let r = Rig::<B>::new().await;
    let m = message(None, "flaky");
    r.script.fail_times.lock().unwrap().insert(m.message_id, 2);
    r.publish(std::slice::from_ref(&m)).await;
    let s = Settings::new();
    r.run_until(&s, "the effect", WAIT, || async {
        r.c.effects_of(m.message_id).await == 1
    })
    .await;
    assert_eq!(r.script.deliveries(m.message_id), vec![1, 2, 3]);
    assert_eq!(r.c.effects_of(m.message_id).await, 1);
    assert_eq!(s.metrics.failures.load(Ordering::Relaxed), 2);
}

pub(super) async fn dead_letters_at_max_deliveries<B: Broker>() {
    let r = Rig::<B>::new().await;
    let m = message(None, "poison");
    r.script
        .fail_times
        .lock()
        .unwrap()
        .insert(m.message_id, u32::MAX);
    r.publish(std::slice::from_ref(&m)).await;
    let mut s = Settings::new();
    s.max_deliveries = 3;
    r.run_until(&s, "the dead letter", WAIT, || async {
        !r.c.inbox.dead_letters(10).await.unwrap().is_empty()
    })
    .await;
    r.dead_letters(&[&m], 3).await;
    assert_eq!(r.script.deliveries(m.message_id), vec![1, 2, 3]);
    // Acknowledged: a restart does not deliver it again.
    r.restart_until_a_marker().await;
    assert_eq!(
        r.script.deliveries(m.message_id).len(),
        3,
        "the dead letter came back"
    );
}

pub(super) async fn confirms_the_verdict<B: Broker>() {
    let r = Rig::<B>::new().await;
    let ok = replying(None, "ok");
    let refused = replying(None, "refused");
    r.script.reject.lock().unwrap().push(refused.message_id);
    let silent = message(None, "no reply destination");
    r.publish(&[ok.clone(), refused.clone(), silent.clone()])
        .await;
    let recorder = Arc::new(Recorder::default());
    let s = Settings::confirming_to(&recorder);
    let runner = r.spawn(&s);
    wait_until("two confirmations", WAIT, || async {
        recorder.sent.lock().unwrap().len() == 2
    })
    .await;
    wait_until("the silent message", WAIT, || async {
        r.c.effects_of(silent.message_id).await == 1
    })
    .await;
    stop(&s, runner).await;
    assert_eq!(recorder.verdicts(ok.message_id), vec![Verdict::Processed]);
    assert_eq!(
        recorder.verdicts(refused.message_id),
        vec![Verdict::Rejected {
            reason: "out of stock".into()
        }]
    );
    assert!(
        recorder
            .sent
            .lock()
            .unwrap()
            .iter()
            .all(|(to, c)| to == "replies" && c.consumer == "conformance")
    );
    assert_eq!(
        recorder.sent.lock().unwrap().len(),
        2,
        "a message without a reply destination was confirmed"
    );
}

pub(super) async fn contains_a_panicking_handler<B: Broker>() {
    let r = Rig::<B>::new().await;
    let bad = message(Some("k"), "panics");
    let after = message(Some("k"), "after the panic, same key");
    let other = message(Some("other"), "another key");
    r.script.panic.lock().unwrap().push(bad.message_id);
    r.publish(&[bad.clone(), after.clone(), other.clone()])
        .await;
    let mut s = Settings::new();
    s.max_deliveries = 3;
    r.run_until(
        &s,
        "the dead letter and both other effects",
        WAIT,
        || async {
            !r.c.inbox.dead_letters(10).await.unwrap().is_empty()
                && r.c.effects_of(after.message_id).await == 1
                && r.c.effects_of(other.message_id).await == 1
        },
    )
    .await;
    let dead = r.dead_letters(&[&bad], 3).await;
    assert!(dead[0].error.contains("panicked"), "{}", dead[0].error);
    assert_eq!(r.c.effects_of(bad.message_id).await, 0);
}

/// `n` messages over `keys` in turn, payloads numbered in publication order.
fn keyed(n: usize, keys: &[&str]) -> Vec<Message> {
    (0..n)
        .map(|i| message(Some(keys[i % keys.len()]), &format!("{i:03}")))
        .collect()
}

pub(super) async fn keeps_per_key_order<B: Broker>() {
    let r = Rig::<B>::new().await;
    let keys = ["k0", "k1", "k2", "k3", "k4"];
    let msgs = keyed(100, &keys);
    r.publish(&msgs).await;
    let mut s = Settings::new();
    s.concurrency = 4;
    r.run_until(&s, "100 effects", WAIT, || async {
        r.c.effects().await.len() == 100
    })
    .await;
    let mut by_key: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (_, key, payload) in r.c.effects().await {
        by_key
            .entry(key.expect("key"))
            .or_default()
            .push(String::from_utf8(payload).unwrap());
    }
    assert_eq!(by_key.len(), keys.len());
    for (key, seq) in by_key {
        let mut sorted = seq.clone();
        sorted.sort();
        assert_eq!(seq, sorted, "key {key} applied out of order");
        assert_eq!(seq.len(), 20);
    }
}

/// `runner.inbox_batch`: the runner applies many messages per inbox transaction, and a message
/// whose handler fails, rejects or panics in the middle of a batch costs the others nothing:
/// every other message is applied exactly once, the failing ones end as they would alone
/// (applied after retries, rejected, dead-lettered), and a key without failures keeps its order.
pub(super) async fn applies_in_batches_around_failures<B: Broker>() {
    let r = Rig::<B>::new().await;
    let msgs = keyed(60, &["k0", "k1", "k2"]);
    let (flaky, refused, poison) = (&msgs[10], &msgs[20], &msgs[31]);
    r.script
        .fail_times
        .lock()
        .unwrap()
        .insert(flaky.message_id, 2);
    r.script.reject.lock().unwrap().push(refused.message_id);
    r.script.panic.lock().unwrap().push(poison.message_id);
    r.publish(&msgs).await;
    let mut s = Settings::new();
    s.inbox_batch = 16;
    s.concurrency = 2;
    s.max_deliveries = 3;
    r.run_until(
        &s,
        "58 effects, one rejection, one dead letter",
        WAIT,
        || async {
            r.c.effects().await.len() >= 58
                && s.metrics.rejected.load(Ordering::Relaxed) == 1
                && s.metrics.dead_lettered.load(Ordering::Relaxed) == 1
        },
    )
    .await;
    for m in &msgs {
        let want =
            usize::from(m.message_id != refused.message_id && m.message_id != poison.message_id);
        assert_eq!(
            r.c.effects_of(m.message_id).await,
            want,
            "effects of {:?}",
            String::from_utf8_lossy(&m.payload)
        );
    }
    assert_eq!(r.c.effects().await.len(), 58);
    let k0: Vec<Vec<u8>> =
        r.c.effects()
            .await
            .into_iter()
            .filter(|(_, key, _)| key.as_deref() == Some("k0"))
            .map(|(_, _, payload)| payload)
            .collect();
    let mut sorted = k0.clone();
    sorted.sort();
    assert_eq!(k0, sorted, "key k0 (no failures) applied out of order");
    let dead = r.c.inbox.dead_letters(10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].message.message_id, poison.message_id);
    assert!(dead[0].error.contains("panicked"), "{}", dead[0].error);
    assert_eq!(
        r.c.inbox.verdict(refused.message_id).await.unwrap(),
        Some(Verdict::Rejected {
            reason: "out of stock".into()
        })
    );
    assert!(
        s.metrics.inbox_batches.load(Ordering::Relaxed) > 0,
        "no inbox transaction held more than one message"
    );
    assert!(
        s.metrics.inbox_batch_splits.load(Ordering::Relaxed) >= 1,
        "no batch was split at a failing handler"
    );
}

pub(super) async fn survives_a_crash_between_commit_and_ack<B: Broker>() {
    let r = Rig::<B>::new().await;
    let m = replying(None, "crash");
    r.publish(std::slice::from_ref(&m)).await;
    let recorder = Arc::new(Recorder::default());
    recorder.hang_first.store(true, Ordering::SeqCst);
    let reached = recorder.reached.notified();
    let runner = r.spawn(&Settings::confirming_to(&recorder));
    within("the commit", WAIT, reached).await;
    // Committed, not acknowledged: the process dies.
    assert_eq!(r.c.effects_of(m.message_id).await, 1);
    crash(&r.b, runner).await;
    let s = Settings::confirming_to(&recorder);
    r.run_until(
        &s,
        "the confirmation after the restart",
        Duration::from_secs(60),
        || async { !recorder.verdicts(m.message_id).is_empty() },
    )
    .await;
    assert_eq!(r.c.effects_of(m.message_id).await, 1, "applied twice");
    assert_eq!(recorder.verdicts(m.message_id), vec![Verdict::Processed]);
    assert_eq!(s.metrics.duplicates.load(Ordering::Relaxed), 1);
    assert_eq!(
        r.script.deliveries(m.message_id).len(),
        1,
        "the handler ran again"
    );
}

/// Abort `runner` as a dying process would end: its task dropped mid-await (an open inbox
/// transaction rolls back with its connection) and its broker connections cut.
async fn crash<B: Broker>(b: &B, runner: Runner) {
    runner.abort();
    let _ = runner.await;
    if let Some(proxy) = b.proxy() {
        proxy.set_blocked(true);
        proxy.set_blocked(false);
    }
}

pub(super) async fn survives_crashes_in_an_inbox_batch<B: Broker>() {
    let r = Rig::<B>::new().await;
    // One partition key: in order on every broker (one Kafka partition, one lane), so the four
    // messages before the fifth reach the handler before it.
    let msgs: Vec<Message> = (0..24)
        .map(|i| replying(Some("batch"), &format!("{i:02}")))
        .collect();
    r.publish(&msgs).await;
    let recorder = Arc::new(Recorder::default());
    let settings = || {
        let mut s = Settings::confirming_to(&recorder);
        s.inbox_batch = 16;
        s
    };

    // 1. Death inside a batch's transaction: nothing of it is committed.
    *r.script.hang.lock().unwrap() = Some(msgs[4].message_id);
    let hung = r.script.hung.notified();
    let runner = r.spawn(&settings());
    within("the handler of the fifth message", WAIT, hung).await;
    crash(&r.b, runner).await;
    assert_eq!(r.c.effects_of(msgs[4].message_id).await, 0);
    // The four before it ran first, in its batch or in batches of their own that committed.
    // Those of its batch left nothing.
    let mut rolled_back = 0;
    for m in &msgs[..4] {
        assert!(!r.script.deliveries(m.message_id).is_empty());
        if r.c.effects_of(m.message_id).await == 0 {
            rolled_back += 1;
        }
    }
    assert!(
        rolled_back >= 1,
        "the fifth message was not applied in a batch with those before it"
    );

    // 2. Death after a batch's commit, before its acks (the first confirmation hangs). Messages
    // applied in step 1 in a batch of their own before the fifth's were acknowledged then: they
    // are not counted as committed here.
    let applied_before = r.c.effects().await.len();
    recorder.hang_first.store(true, Ordering::SeqCst);
    let reached = recorder.reached.notified();
    let s = settings();
    let runner = r.spawn(&s);
    within("a commit", WAIT, reached).await;
    let committed = r.c.effects().await.len() - applied_before;
    crash(&r.b, runner).await;
    let batches = s.metrics.inbox_batches.load(Ordering::Relaxed);

    // 3. The restart applies the rest and recognises the committed batch.
    let s = settings();
    r.run_until(
        &s,
        "every message confirmed",
        Duration::from_secs(60),
        || async {
            msgs.iter()
                .all(|m| !recorder.verdicts(m.message_id).is_empty())
        },
    )
    .await;
    for m in &msgs {
        assert_eq!(
            r.c.effects_of(m.message_id).await,
            1,
            "effects of {:?}",
            String::from_utf8_lossy(&m.payload)
        );
        assert!(
            recorder
                .verdicts(m.message_id)
                .iter()
                .all(|v| *v == Verdict::Processed),
            "verdicts of {:?}",
            String::from_utf8_lossy(&m.payload)
        );
    }
    assert!(
        committed >= 1 && s.metrics.duplicates.load(Ordering::Relaxed) >= committed as u64,
        "{} duplicates after the restart, {committed} messages committed but not acknowledged",
        s.metrics.duplicates.load(Ordering::Relaxed)
    );
    assert!(
        batches + s.metrics.inbox_batches.load(Ordering::Relaxed) >= 1,
        "no inbox transaction after the first crash held more than one message"
    );
}

pub(super) async fn rejects_malformed_input<B: Broker>() {
    let r = Rig::<B>::new().await;
    r.b.publish_garbage().await;
    let after = message(None, "after the garbage");
    r.publish(std::slice::from_ref(&after)).await;
    let s = Settings::new();
    // Both, in either order: a broker with several queues per topic (RocketMQ) may deliver the
    // message before the garbage.
    r.run_until(
        &s,
        "the garbage and the message behind it",
        WAIT,
        || async {
            r.c.effects_of(after.message_id).await == 1
                && s.metrics.malformed.load(Ordering::Relaxed) == 1
        },
    )
    .await;
    assert_eq!(s.metrics.malformed.load(Ordering::Relaxed), 1);
    // Taken out of the way: a restart does not see it again.
    let s = r.restart_until_a_marker().await;
    assert_eq!(
        s.metrics.malformed.load(Ordering::Relaxed),
        0,
        "the garbage came back"
    );
}
