//! Keeping secrets out of `Debug` output, and so out of logs: passwords and signing secrets
//! print as `***`, a URL's password as `user:***@`. Configurations that hold a secret derive
//! `Debug` with `derive_more::Debug`, their secret fields printed through [`secret`] or [`url`]
//! (`#[debug("{:?}", crate::redact::secret(password))]`) and client handles skipped.

/// A URL with any password replaced by `***` (`scheme://user:***@host…`); a URL without one
/// unchanged. A seed list (URLs separated by commas) has each of its URLs redacted.
#[cfg(any(
    feature = "webhook",
    feature = "redis",
    feature = "mqtt",
    feature = "rabbitmq",
    feature = "nats"
))]
pub(crate) fn url(url: &str) -> String {
    if url.matches("://").count() > 1 {
        return url.split(',').map(one_url).collect::<Vec<_>>().join(",");
    }
    one_url(url)
}

#[cfg(any(
    feature = "webhook",
    feature = "redis",
    feature = "mqtt",
    feature = "rabbitmq",
    feature = "nats"
))]
fn one_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => match url[s + 3..at].split_once(':') {
            Some((user, _)) => format!("{}{user}:***{}", &url[..s + 3], &url[at..]),
            None => url.to_owned(),
        },
        _ => url.to_owned(),
    }
}

/// A secret: `Some("***")` when set, `None` when not.
// Called from derived `Debug` impls, which the dead-code lint does not count as uses.
#[allow(dead_code)]
pub(crate) fn secret(value: &Option<String>) -> Option<&'static str> {
    value.as_ref().map(|_| "***")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(any(
        feature = "webhook",
        feature = "redis",
        feature = "mqtt",
        feature = "rabbitmq"
    ))]
    fn urls_lose_their_password_only() {
        assert_eq!(
            url("amqp://guest:hunter2@h:5672/%2f"),
            "amqp://guest:***@h:5672/%2f"
        );
        assert_eq!(url("redis://:hunter2@h/0"), "redis://:***@h/0");
        assert_eq!(url("mqtt://user@h"), "mqtt://user@h");
        assert_eq!(url("nats://h:4222"), "nats://h:4222");
        assert_eq!(url("garbage"), "garbage");
        assert_eq!(
            url("amqp://u:p1@a:5681/%2f,amqp://u:p2@b:5682/%2f"),
            "amqp://u:***@a:5681/%2f,amqp://u:***@b:5682/%2f"
        );
    }

    /// Every configuration that can hold a secret prints none of it.
    #[test]
    fn no_configuration_prints_a_secret() {
        const S: &str = "hunter2";
        let with_password = |scheme: &str| format!("{scheme}://user:{S}@127.0.0.1:1");
        let mut printed: Vec<String> = Vec::new();
        #[cfg(feature = "nats")]
        printed.push(format!(
            "{:?}",
            crate::transport::nats::NatsConfig::new(with_password("nats"))
        ));
        #[cfg(feature = "webhook")]
        {
            let mut c = crate::transport::webhook::WebhookConfig::new(with_password("http"));
            c.secret = Some(S.into());
            printed.push(format!("{c:?}"));
        }
        #[cfg(feature = "mqtt")]
        {
            let mut c = crate::transport::mqtt::MqttConfig::new(with_password("mqtt"));
            c.password = Some(S.into());
            printed.push(format!("{c:?}"));
            printed.push(format!(
                "{:?}",
                crate::transport::mqtt::parse_url(&with_password("mqtt")).expect("parses")
            ));
            let mut l = crate::confirm::mqtt::MqttListenConfig::new(with_password("mqtt"), "t");
            l.password = Some(S.into());
            printed.push(format!("{l:?}"));
            let mut c =
                crate::consumer::mqtt::MqttConsumerConfig::new(with_password("mqtt"), "c1", "t");
            c.password = Some(S.into());
            printed.push(format!("{c:?}"));
        }
        #[cfg(feature = "redis")]
        {
            let mut c = crate::transport::redis::RedisConfig::new(with_password("redis"));
            c.password = Some(S.into());
            printed.push(format!("{c:?}"));
            let mut l = crate::confirm::redis::RedisListenConfig::new(with_password("redis"), "s");
            l.password = Some(S.into());
            printed.push(format!("{l:?}"));
            let mut c =
                crate::consumer::redis::RedisConsumerConfig::new(with_password("redis"), "s", "g");
            c.password = Some(S.into());
            printed.push(format!("{c:?}"));
        }
        {
            let c = crate::two_phase_model::CheckBackPolicy {
                secret: Some(S.into()),
                ..Default::default()
            };
            printed.push(format!("{c:?}"));
        }
        #[cfg(feature = "admin")]
        printed.push(format!(
            "{:?}",
            crate::admin::http::AdminAuth {
                token: Some(S.into()),
                protect_reads: true,
            }
        ));
        #[cfg(feature = "kafka")]
        {
            use crate::transport::kafka::{KafkaConfig, KafkaSasl};
            let mut c = KafkaConfig::new("127.0.0.1:9092");
            c.sasl = Some(KafkaSasl {
                mechanism: "PLAIN".into(),
                username: "user".into(),
                password: S.into(),
                ..KafkaSasl::default()
            });
            c.properties.insert("sasl.password".into(), S.into());
            c.properties.insert("ssl.key.password".into(), S.into());
            printed.push(format!("{c:?}"));
            let consumer = crate::consumer::kafka::KafkaConsumerConfig::new(c, "g", ["t"]);
            printed.push(format!("{consumer:?}"));
        }
        #[cfg(feature = "rocketmq")]
        {
            let credentials = crate::transport::rocketmq::Credentials {
                access_key: "ak".into(),
                secret_key: S.into(),
                secret_key_env: None,
            };
            let mut c = crate::transport::rocketmq::RocketMqConfig::new("127.0.0.1:9876");
            c.credentials = Some(credentials.clone());
            printed.push(format!("{c:?}"));
            let mut l = crate::confirm::rocketmq::ListenConfig::new("127.0.0.1:9876", "t", "g");
            l.credentials = Some(credentials);
            printed.push(format!("{l:?}"));
        }
        for p in &printed {
            assert!(!p.contains(S), "a secret in {p}");
            assert!(p.contains("***"), "{p}");
        }
    }
}
