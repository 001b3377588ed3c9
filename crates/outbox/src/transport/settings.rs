//! What the settings of every broker's transport share: URL checks and secrets read from the
//! environment. Below [`config`](super::config) (which builds each broker's transport from its
//! settings) and below each broker's module, so neither depends on the other.

use crate::error::ConfigError;

/// The value of the environment variable named `var` (`Ok(None)` when no variable is named).
///
/// # Errors
/// [`ConfigError`] naming `field` when the variable is not set (or not Unicode).
pub fn env_secret(field: &str, var: Option<&str>) -> Result<Option<String>, ConfigError> {
    match var {
        None => Ok(None),
        Some(v) => std::env::var(v)
            .map(Some)
            .map_err(|_| ConfigError::new(field, format!("environment variable {v} is not set"))),
    }
}

/// Fill `secret`, when it is none, from the environment variable named `var` ([`env_secret`]):
/// the `resolve_secrets` of the transport configs.
///
/// # Errors
/// [`ConfigError`] naming `field` when the variable is not set.
#[allow(dead_code)] // Unused in a build without webhook, Redis, MQTT and RabbitMQ.
pub(crate) fn fill_secret(
    secret: &mut Option<String>,
    field: &str,
    var: Option<&str>,
) -> Result<(), ConfigError> {
    if secret.is_none() {
        *secret = env_secret(field, var)?;
    }
    Ok(())
}

/// Check that `url` is `<scheme>://<something>` with one of `schemes`.
///
/// # Errors
/// [`ConfigError`] naming `url`.
pub fn check_url(url: &str, schemes: &[&str]) -> Result<(), ConfigError> {
    let bad = |r: String| Err(ConfigError::new("url", r));
    let Some((scheme, rest)) = url.split_once("://") else {
        return bad(format!(
            "{url:?} is not a URL (expected {}://…)",
            schemes[0]
        ));
    };
    if !schemes.contains(&scheme) {
        return bad(format!("scheme {scheme:?} is not one of {schemes:?}"));
    }
    if rest.is_empty() {
        return bad("host is missing".into());
    }
    Ok(())
}
