//! In-memory transport for tests and demos: records every acknowledged publish and can be told
//! to fail.
//!
//! It stands in for any broker, so its [`check`](Transport::check) refuses a user header whose
//! name any broker reserves ([`wire::reserved_by`](super::wire::reserved_by), what enqueue
//! refuses), as permanent; every other name, value and key travels.

use std::collections::HashMap;
use std::sync::Mutex;

use async_trait::async_trait;
use tokio::sync::Notify;
use uuid::Uuid;

use super::wire::{WireError, reserved_by};
use super::{Outgoing, Transport};
use crate::error::{TransportError, TransportErrorKind};
use crate::message::Message;

/// A message the memory broker acknowledged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivered {
    /// The message as published.
    pub message: Message,
    /// The destination it was published to.
    pub destination: String,
}

#[derive(Default)]
struct State {
    delivered: Vec<Delivered>,
    fail_next: HashMap<Uuid, Vec<TransportErrorKind>>,
    down: bool,
}

/// A broker in memory. `publish` acknowledges every message unless told otherwise with
/// [`MemoryTransport::fail_next`] or [`MemoryTransport::set_down`].
#[derive(Default)]
pub struct MemoryTransport {
    state: Mutex<State>,
    published: Notify,
}

impl MemoryTransport {
    /// A broker that acknowledges everything.
    pub fn new() -> Self {
        MemoryTransport::default()
    }

    /// Make the next publishes of `message_id` fail with these kinds, one per attempt.
    pub fn fail_next(&self, message_id: Uuid, kinds: Vec<TransportErrorKind>) {
        self.state
            .lock()
            .expect("poisoned")
            .fail_next
            .insert(message_id, kinds);
    }

    /// Take the broker down (every publish and probe fails `Unavailable`) or bring it back.
    pub fn set_down(&self, down: bool) {
        self.state.lock().expect("poisoned").down = down;
    }

    /// Everything acknowledged so far, in acknowledgement order (duplicates included).
    pub fn delivered(&self) -> Vec<Delivered> {
        self.state.lock().expect("poisoned").delivered.clone()
    }

    /// How many publishes were acknowledged.
    pub fn count(&self) -> usize {
        self.state.lock().expect("poisoned").delivered.len()
    }

    /// Wait until at least `n` publishes were acknowledged.
    pub async fn wait_for(&self, n: usize) {
        loop {
            let notified = self.published.notified();
            if self.count() >= n {
                return;
            }
            notified.await;
        }
    }
}

#[async_trait]
impl Transport for MemoryTransport {
    fn name(&self) -> &str {
        "memory"
    }

    fn check(&self, out: &Outgoing<'_>) -> Result<(), TransportError> {
        match out
            .message
            .headers
            .keys()
            .find_map(|name| Some((name, reserved_by(name)?)))
        {
            Some((name, reserved)) => Err(WireError::Reserved {
                name: name.clone(),
                reserved,
            }
            .into()),
            None => Ok(()),
        }
    }

    async fn publish(&self, batch: &[Outgoing<'_>]) -> Vec<Result<(), TransportError>> {
        let mut st = self.state.lock().expect("poisoned");
        let results = batch
            .iter()
            .map(|o| {
                self.check(o)?;
                if st.down {
                    return Err(TransportError::unavailable("memory broker is down"));
                }
                if let Some(kinds) = st.fail_next.get_mut(&o.message.message_id)
                    && !kinds.is_empty()
                {
                    let kind = kinds.remove(0);
                    return Err(TransportError::new(kind, "injected failure"));
                }
                st.delivered.push(Delivered {
                    message: o.message.clone(),
                    destination: o.destination.to_owned(),
                });
                Ok(())
            })
            .collect();
        drop(st);
        self.published.notify_waiters();
        results
    }

    async fn probe(&self) -> Result<(), TransportError> {
        if self.state.lock().expect("poisoned").down {
            Err(TransportError::unavailable("memory broker is down"))
        } else {
            Ok(())
        }
    }
}
