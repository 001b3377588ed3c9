//! Keys of ordered routes held back: their rows are left out of reads until a time (the end of
//! the head's backoff, or the next poll while an earlier message is open).

use super::*;

/// Cap on the keys held back in memory (rows of further held-back keys are simply read again).
pub(super) const MAX_HELD_BACK_KEYS: usize = 1000;

/// Held-back keys and until when, at most [`MAX_HELD_BACK_KEYS`].
#[derive(Debug, Default)]
pub(super) struct KeyHolds {
    until: HashMap<String, Instant>,
}

impl KeyHolds {
    /// Keys still held back at `now` (expired entries dropped).
    pub(super) fn keys(&mut self, now: Instant) -> Vec<String> {
        if self.until.is_empty() {
            return Vec::new();
        }
        self.until.retain(|_, until| *until > now);
        self.until.keys().cloned().collect()
    }

    /// Time from `now` until the first held-back key is read again (at least 1 ms).
    pub(super) fn next_release(&self, now: Instant) -> Option<Duration> {
        self.until.values().min().map(|t| {
            t.saturating_duration_since(now)
                .max(Duration::from_millis(1))
        })
    }

    /// Hold `key` back until `until` (a key already held gets the new time; a new key beyond the
    /// cap is not held).
    pub(super) fn hold(&mut self, key: &str, until: Instant) {
        if self.until.len() < MAX_HELD_BACK_KEYS || self.until.contains_key(key) {
            self.until.insert(key.to_owned(), until);
        }
    }
}

impl Relay {
    /// Keys held back now (expired entries dropped).
    pub(super) fn held_back_keys(&self) -> Vec<String> {
        let mut held = self.inner.held_back.lock().expect("held-back lock");
        held.keys(Instant::now())
    }

    /// Time until the first held-back key is read again.
    pub(super) fn next_key_release(&self) -> Option<Duration> {
        let held = self.inner.held_back.lock().expect("held-back lock");
        held.next_release(Instant::now())
    }

    /// Hold `key` back for `for_` from now.
    pub(super) fn hold_back(&self, key: &str, for_: Duration) {
        let mut held = self.inner.held_back.lock().expect("held-back lock");
        held.hold(key, Instant::now() + for_);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn keys_are_held_until_their_time() {
        let mut k = KeyHolds::default();
        let t0 = Instant::now();
        assert!(k.keys(t0).is_empty());
        assert_eq!(k.next_release(t0), None);
        k.hold("a", t0 + Duration::from_millis(100));
        k.hold("b", t0 + Duration::from_millis(300));
        assert_eq!(k.next_release(t0), Some(Duration::from_millis(100)));
        tokio::time::advance(Duration::from_millis(100)).await;
        let now = Instant::now();
        assert_eq!(
            k.keys(now),
            vec!["b".to_owned()],
            "a is released at its time"
        );
        assert_eq!(k.next_release(now), Some(Duration::from_millis(200)));
        // Holding again moves the time (a new backoff), either way.
        k.hold("b", now + Duration::from_millis(50));
        assert_eq!(k.next_release(now), Some(Duration::from_millis(50)));
        // Past due but not yet dropped: read again at least 1 ms from now.
        assert_eq!(
            k.next_release(now + Duration::from_secs(1)),
            Some(Duration::from_millis(1))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_cap_bounds_new_keys_not_known_ones() {
        let mut k = KeyHolds::default();
        let t0 = Instant::now();
        let later = t0 + Duration::from_secs(1);
        for i in 0..MAX_HELD_BACK_KEYS {
            k.hold(&format!("k{i}"), later);
        }
        k.hold("one-too-many", later);
        assert_eq!(k.keys(t0).len(), MAX_HELD_BACK_KEYS);
        assert!(!k.keys(t0).contains(&"one-too-many".to_owned()));
        k.hold("k0", t0 + Duration::from_millis(10));
        assert_eq!(k.next_release(t0), Some(Duration::from_millis(10)));
    }
}
