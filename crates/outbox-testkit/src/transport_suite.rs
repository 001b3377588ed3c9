//! The transport conformance suite: one async function per property, generic over
//! [`TransportFixture`](crate::TransportFixture), run against every transport on the real broker.

use outbox::TransportErrorKind;
use outbox::transport::Outgoing;

use crate::{TransportFixture, claimed_message, header_message_id, publish_one_elsewhere};

/// A batch is acknowledged: one `Ok` per message, and the broker holds every message, each with
/// its message id in the native id field and in `outbox-message-id`, its topic, user headers and
/// byte-exact payload.
pub async fn publish_is_acked_and_carries_id_headers_payload<F: TransportFixture>(fx: &F) {
    let dest = fx.good_destination();
    let mut msgs: Vec<_> = (0..5)
        .map(|i| claimed_message("orders.created", format!("{{\"n\":{i}}}")))
        .collect();
    msgs[1].headers.insert("tag".into(), "created".into());
    msgs[1].partition_key = Some("order-7".into());
    msgs[2].headers.insert(
        "traceparent".into(),
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
    );
    let batch: Vec<Outgoing<'_>> = msgs
        .iter()
        .map(|m| Outgoing {
            message: m,
            destination: &dest,
        })
        .collect();
    let results = fx.transport().publish(&batch).await;
    assert_eq!(results.len(), 5);
    for r in &results {
        assert!(r.is_ok(), "{r:?}");
    }
    let received = fx.received().await;
    assert_eq!(received.len(), 5, "{received:?}");
    for m in &msgs {
        let r = received
            .iter()
            .find(|r| header_message_id(r) == Some(m.message_id))
            .unwrap_or_else(|| panic!("message {} not received", m.message_id));
        assert_eq!(
            r.native_id.as_deref(),
            Some(m.message_id.to_string().as_str())
        );
        assert_eq!(r.payload, m.payload);
        assert_eq!(
            r.headers.get("outbox-topic").map(String::as_str),
            Some("orders.created")
        );
        for (k, v) in &m.headers {
            assert_eq!(r.headers.get(k), Some(v), "header {k}");
        }
        if let Some(k) = &m.partition_key {
            assert_eq!(r.headers.get("outbox-partition-key"), Some(k));
        }
    }
}

/// Binary payloads (invalid UTF-8, NUL) arrive byte-identical (shared case C08).
pub async fn binary_payload_is_byte_exact<F: TransportFixture>(fx: &F) {
    let dest = fx.good_destination();
    let m = claimed_message("bin", vec![0xFF, 0xFE, 0x00, 0x7F, 0x80]);
    let results = fx
        .transport()
        .publish(&[Outgoing {
            message: &m,
            destination: &dest,
        }])
        .await;
    assert!(results[0].is_ok(), "{results:?}");
    let received = fx.received().await;
    assert_eq!(received.len(), 1);
    assert_eq!(received[0].payload, m.payload);
}

/// Results come back in input order, so one refused message in the middle of a batch is reported
/// at its own position as `Permanent` and the others are acknowledged.
pub async fn results_are_in_input_order<F: TransportFixture>(fx: &F) {
    let good = fx.good_destination();
    let bad = fx.rejecting_destination();
    let (msgs, results) = publish_one_elsewhere(fx.transport().as_ref(), &good, 2, &bad).await;
    assert_eq!(results.len(), 5);
    for (i, r) in results.iter().enumerate() {
        if i == 2 {
            let e = r.as_ref().expect_err("rejected message acknowledged");
            assert_eq!(e.kind(), TransportErrorKind::Permanent, "{e:?}");
        } else {
            assert!(r.is_ok(), "message {i}: {r:?}");
        }
    }
    let received = fx.received().await;
    assert_eq!(received.len(), 4);
    for (i, m) in msgs.iter().enumerate() {
        let found = received
            .iter()
            .any(|r| header_message_id(r) == Some(m.message_id));
        assert_eq!(found, i != 2, "message {i}");
    }
    fx.transport()
        .probe()
        .await
        .expect("probe of a reachable broker");
}
