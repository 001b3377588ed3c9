use super::*;

#[test]
fn keys_are_validated() {
    assert!(validate_key("orders").is_ok());
    assert!(validate_key("app:orders.created").is_ok());
    for bad in ["", "a b", "a\nb"] {
        assert!(validate_key(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn fields_round_trip_and_headers_cannot_collide() {
    let m = Message {
        id: 1,
        message_id: uuid::Uuid::now_v7(),
        topic: "t".into(),
        partition_key: Some("k".into()),
        headers: Headers::from([
            ("payload".into(), "not the payload".into()),
            ("id".into(), "not the id".into()),
        ]),
        payload: vec![0xff, 0],
        attempts: 1,
        max_attempts: 5,
        redelivery: 0,
    };
    let fields = entry_fields(&m);
    assert_eq!(fields[0].0, "id");
    assert_eq!(fields[0].1, m.message_id.to_string().into_bytes());
    assert_eq!(fields.last().unwrap().0, "payload");
    let raw = fields
        .into_iter()
        .map(|(k, v)| (k.into_bytes(), v))
        .collect();
    let (h, p) = decode_fields(raw);
    assert_eq!(p, m.payload);
    assert_eq!(h, m.wire_headers());
}

#[test]
fn config_is_validated_and_warns_about_a_cap() {
    let ok = RedisConfig::new("redis://127.0.0.1:6379");
    ok.validate().unwrap();
    assert!(ok.warnings().is_empty());
    let e = RedisConfig::new("http://x").validate().unwrap_err();
    assert_eq!(e.field, "url");
    let capped = RedisConfig {
        max_len: Some(1000),
        ..ok.clone()
    };
    capped.validate().unwrap();
    let w = capped.warnings();
    assert_eq!(w.len(), 1);
    assert!(w[0].contains("C38") && w[0].contains("1000"), "{w:?}");
    let zero = RedisConfig {
        max_len: Some(0),
        ..ok.clone()
    };
    assert_eq!(zero.validate().unwrap_err().field, "max_len");
    let wait = RedisConfig {
        wait_replicas: Some(WaitReplicas {
            replicas: 1,
            timeout: Duration::from_secs(10),
        }),
        ..ok
    };
    assert_eq!(wait.validate().unwrap_err().field, "wait_replicas");
}
