//! The relay daemon's configuration as the library reads it: `[relay]`, `[transports.<name>]`
//! and `[[routes]]` from TOML, each validated. Parsing and validation must answer, never panic.
#![no_main]

use std::collections::BTreeMap;

use outbox::RelayConfig;
use outbox::transport::config::{RouteConfig, TransportConfig};

#[derive(serde::Deserialize)]
struct File {
    relay: Option<RelayConfig>,
    #[serde(default)]
    transports: BTreeMap<String, TransportConfig>,
    #[serde(default)]
    routes: Vec<RouteConfig>,
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(file) = toml::from_str::<File>(text) else {
        return;
    };
    if let Some(r) = &file.relay {
        let _ = r.validate();
    }
    for t in file.transports.values() {
        let _ = t.validate();
    }
    for r in &file.routes {
        let _ = r.validate();
    }
});
