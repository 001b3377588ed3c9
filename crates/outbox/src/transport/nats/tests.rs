use super::*;
use crate::message::Message;
use crate::transport::wire::test_message as message;

fn check(m: &Message) -> Result<(), TransportError> {
    check_message(&Outgoing {
        message: m,
        destination: "orders.created",
    })
}

/// Everything async-nats would panic on, and the `Nats-` namespace, is refused as permanent
/// with the header or key named; what it accepts passes.
#[test]
fn check_refuses_what_nats_cannot_carry() {
    crate::transport::wire::assert_refused(
        check_message,
        "orders.created",
        [
            (message(&[("a b", "v")], None), "header \"a b\""),
            (message(&[("a:b", "v")], None), "header \"a:b\""),
            (message(&[("", "v")], None), "header \"\""),
            (message(&[("caf\u{e9}", "v")], None), "header \"caf\u{e9}\""),
            (message(&[("tab\there", "v")], None), "printable ASCII"),
            (message(&[("a", "x\r\ny")], None), "CR or LF"),
            (message(&[("a", "x\ny")], None), "header \"a\""),
            (message(&[], Some("k\r\n1")), "partition key \"k\\r\\n1\""),
            (
                message(&[("Nats-Msg-Id", "dup")], None),
                "\"Nats-Msg-Id\" is reserved by NATS JetStream",
            ),
            (
                message(&[("nats-expected-last-sequence", "1")], None),
                "nats-expected-last-sequence",
            ),
            (message(&[("Nats-Rollup", "all")], None), "Nats-Rollup"),
        ],
    );
    let mut topic = message(&[], None);
    topic.topic = "a\nb".into();
    assert!(check(&topic).unwrap_err().report().contains("topic"));
    let bad_subject = message(&[], None);
    let e = check_message(&Outgoing {
        message: &bad_subject,
        destination: "a b",
    })
    .unwrap_err();
    assert!(e.report().contains("destination \"a b\""), "{}", e.report());
    let ok = message(
        &[
            ("tag", "x y\tz \u{e9}"),
            ("traceparent", "00-abc-def-01"),
            ("x-request-id", "1"),
        ],
        Some("order 7 \u{e9}"),
    );
    assert!(check(&ok).is_ok());
}

/// Failed `Nats-Expected-*` conditions and other refusals of the message as it is are
/// permanent; a server that is busy is not.
#[test]
fn expected_header_mismatches_are_permanent() {
    let api = |code: u64, status: u16| {
        let e: jetstream::Error = serde_json::from_str(&format!(
            r#"{{"code":{status},"err_code":{code},"description":"x"}}"#
        ))
        .unwrap();
        jetstream::context::PublishError::with_source(PublishErrorKind::Other, e)
    };
    for code in [10060, 10070, 10071, 10164, 10193, 10054, 10165] {
        assert_eq!(
            classify(&api(code, 400), true),
            TransportErrorKind::Permanent,
            "{code}"
        );
    }
    assert_eq!(
        classify(&api(10163, 503), true),
        TransportErrorKind::Retryable
    );
    assert_eq!(
        classify(&api(10008, 503), false),
        TransportErrorKind::Unavailable
    );
    for kind in [
        PublishErrorKind::WrongLastSequence,
        PublishErrorKind::WrongLastMessageId,
    ] {
        assert_eq!(
            classify(&jetstream::context::PublishError::new(kind), true),
            TransportErrorKind::Permanent
        );
    }
    assert_eq!(
        classify(
            &jetstream::context::PublishError::new(PublishErrorKind::TimedOut),
            true
        ),
        TransportErrorKind::Retryable
    );
}

/// The server's permission errors are parsed into the subject they name; a refusal counts
/// only for acks of messages sent before it.
#[test]
fn permission_violations_are_recorded_per_subject() {
    let r = Refusals::default();
    let before = Instant::now();
    r.record("Permissions Violation for Publish to \"orders.created\"");
    r.record("'Permissions Violation for Publish to \"Orders.Mixed\"'");
    r.record("maximum payload exceeded");
    let why = r.refused("orders.created", before).expect("refused");
    assert!(
        why.contains("\"orders.created\"") && why.contains("permission"),
        "{why}"
    );
    assert!(r.refused("Orders.Mixed", before).is_some());
    assert!(r.refused("orders.other", before).is_none());
    assert!(
        r.refused("orders.created", Instant::now() + Duration::from_secs(1))
            .is_none()
    );
    r.record("Permissions Violation for Subscription to \"_INBOX.abc.*\"");
    let why = r.refused("orders.other", before).expect("inbox refused");
    assert!(why.contains("_INBOX.abc.*"), "{why}");
}

#[test]
fn subjects_are_validated() {
    for ok in ["a", "orders.created", "a.b-c_d.e"] {
        assert!(super::validate_subject(ok).is_ok(), "{ok}");
    }
    for bad in ["", "a b", "a..b", ".a", "a.", "a.*", "a.>", "a\tb"] {
        assert!(super::validate_subject(bad).is_err(), "{bad:?}");
    }
}
