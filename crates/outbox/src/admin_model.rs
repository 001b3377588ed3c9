//! The admin API's data: filters, pages, messages as an operator sees them, actions and their
//! reports, lease views, a consumer inbox's dead letters. A contract, below the store (which reads
//! and writes it, `store/admin/`) and the admin server; public as [`crate::admin`] (see there).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::message::Status;

/// Rows one action changes per transaction.
pub const ACTION_CHUNK: usize = 500;

/// The most rows one page holds; a larger `limit` is lowered to it.
pub const MAX_PAGE: u32 = 1000;

/// Which messages: every condition that is set must hold (none set: every message).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MessageFilter {
    /// Any of these states (empty: any state).
    pub states: Vec<Status>,
    /// Topic glob: `*` any run of characters, `?` one character, anything else itself
    /// (`orders.*`).
    pub topic: Option<String>,
    /// Exactly this partition key (the business key, e.g. the order id).
    pub partition_key: Option<String>,
    /// Exactly this message id.
    pub message_id: Option<Uuid>,
    /// Created at or after (database clock).
    pub created_after: Option<DateTime<Utc>>,
    /// Created before.
    pub created_before: Option<DateTime<Utc>>,
    /// Acknowledged by the broker at or after.
    pub sent_after: Option<DateTime<Utc>>,
    /// Acknowledged by the broker before.
    pub sent_before: Option<DateTime<Utc>>,
    /// `last_error` contains this text (case-insensitive).
    pub error: Option<String>,
}

impl MessageFilter {
    /// Whether no condition is set (the filter matches every message).
    pub fn is_empty(&self) -> bool {
        *self == MessageFilter::default()
    }
}

/// One page of a search: at most `limit` rows (1 to [`MAX_PAGE`]) with ids below `before`
/// (`None`: from the newest).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageRequest {
    /// The `next` of the previous page.
    pub before: Option<i64>,
    /// Rows per page; 0 reads as 1, above [`MAX_PAGE`] as [`MAX_PAGE`].
    pub limit: u32,
}

impl Default for PageRequest {
    /// The newest 50.
    fn default() -> Self {
        PageRequest {
            before: None,
            limit: 50,
        }
    }
}

/// A page of messages, newest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MessagePage {
    /// The rows.
    pub messages: Vec<MessageSummary>,
    /// The `before` of the next page (the last row's id); `None` on the last page.
    pub next: Option<i64>,
    /// How the rows are ordered.
    #[serde(default)]
    pub order: SearchOrder,
}

/// The order of a [`MessagePage`], newest first, ties by id.
///
/// A filter with a creation window (`created_after`/`created_before`) is ordered by
/// `created_at` and one with only a publication window by `sent_at`, when the table has the
/// matching [`SearchIndexes`]: the index then finds the window's newest rows directly, wherever
/// the window lies. Otherwise by id, which is the insertion order (ids and creation times only
/// disagree for rows of transactions that overlapped). The page cursor stays the last row's id
/// either way: the next page continues after that row's time and id, read from the archive if
/// the row was discarded or retired meanwhile (after the nearest older row if it was deleted).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SearchOrder {
    /// `id` descending.
    #[default]
    Id,
    /// `created_at`, then `id`, descending.
    CreatedAt,
    /// `sent_at`, then `id`, descending.
    SentAt,
}

/// Which of the optional search indexes the outbox table has
/// ([`Store::search_indexes`](crate::Store::search_indexes),
/// [`Store::create_search_indexes`](crate::Store::create_search_indexes)).
///
/// Without them every search is still correct, and fast for recent rows, for a message id, for
/// dead letters, for errors and for the open messages of a key (the migrations' own indexes);
/// two kinds scan the table and slow down as it grows: a key over every state, and a time window
/// far in the past. The indexes (`<table>_key_id` on `(partition_key, id)` for keyed rows,
/// `<table>_created_id` on `(created_at, id)`, `<table>_sent_id` on `(sent_at, id)` for
/// published rows) answer those under 1 ms on 10,000,000 rows, and cost every insert and every
/// state change the relay writes (measured by `outbox bench --only search`,
/// docs/benchmarks.md): an operator's choice, not a migration every table pays for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SearchIndexes {
    /// `<table>_key_id`: a partition key over every state.
    pub key: bool,
    /// `<table>_created_id`: a creation window, ordered by `created_at`.
    pub created: bool,
    /// `<table>_sent_id`: a publication window, ordered by `sent_at`.
    pub sent: bool,
}

impl SearchIndexes {
    /// Whether all three exist.
    pub fn all(&self) -> bool {
        self.key && self.created && self.sent
    }
}

/// A message as a list shows it. Times are the database clock's, UTC.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MessageSummary {
    /// Row id.
    pub id: i64,
    /// Message id as stored (text: a malformed id written by a foreign producer still shows).
    pub message_id: String,
    /// Topic.
    pub topic: String,
    /// Partition key.
    pub partition_key: Option<String>,
    /// State; `None` for a number outside the schema (`status_number` says which).
    pub status: Option<Status>,
    /// The stored status number.
    pub status_number: i64,
    /// Publish attempts made.
    pub attempts: i64,
    /// The message's own attempt limit, if any.
    pub max_attempts: Option<i64>,
    /// Check-backs made while waiting for the consumer's confirmation.
    pub check_backs: i64,
    /// How often an operator requeued it (or a check-back republished it).
    pub redelivery: i64,
    /// Written by the producer.
    pub created_at: Option<DateTime<Utc>>,
    /// Due for publishing (a delay or a retry's backoff).
    pub available_at: Option<DateTime<Utc>>,
    /// Acknowledged by the broker.
    pub sent_at: Option<DateTime<Utc>>,
    /// Confirmed or rejected by the consumer.
    pub confirmed_at: Option<DateTime<Utc>>,
    /// Last change.
    pub updated_at: Option<DateTime<Utc>>,
    /// The consumer's confirmation is due by then (a check-back follows).
    pub confirm_deadline: Option<DateTime<Utc>>,
    /// Why the last attempt failed, why it was dead-lettered or rejected.
    pub last_error: Option<String>,
}

/// One message in full.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MessageDetail {
    /// What the list shows.
    #[serde(flatten)]
    pub summary: MessageSummary,
    /// Headers; empty when they do not parse (`headers_error` says why, `headers_raw` holds
    /// them).
    pub headers: BTreeMap<String, String>,
    /// Why the stored headers are not a JSON object of strings.
    pub headers_error: Option<String>,
    /// The stored headers text when it does not parse.
    pub headers_raw: Option<String>,
    /// The payload, rendered.
    pub payload: RenderedPayload,
    /// A two-phase message's check-back target (a URL or `hook:<name>`; [`crate::two_phase`]);
    /// `None` for other messages.
    #[serde(default)]
    pub check_back: Option<String>,
}

/// A payload as an operator reads it: JSON pretty-printed, else UTF-8 text, else hex.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RenderedPayload {
    /// `json`, `text` or `hex`.
    pub kind: String,
    /// Size in bytes.
    pub bytes: usize,
    /// The rendering.
    pub text: String,
}

impl RenderedPayload {
    /// Render `payload`: JSON (pretty-printed) when it parses as JSON, text when it is valid
    /// UTF-8 without control characters (other than tab and line breaks), else lower-case hex.
    pub fn of(payload: &[u8]) -> RenderedPayload {
        let (kind, text) = if let Ok(v) = serde_json::from_slice::<serde_json::Value>(payload) {
            (
                "json",
                serde_json::to_string_pretty(&v).unwrap_or_else(|_| v.to_string()),
            )
        } else if let Ok(s) = std::str::from_utf8(payload)
            && !s
                .chars()
                .any(|c| c.is_control() && !matches!(c, '\n' | '\r' | '\t'))
        {
            ("text", s.to_owned())
        } else {
            (
                "hex",
                payload
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect::<String>(),
            )
        };
        RenderedPayload {
            kind: kind.to_owned(),
            bytes: payload.len(),
            text,
        }
    }
}

/// How an operator names one message: its row id (`outbox messages list` shows it) or its
/// message id (the UUID the producer, the broker and the consumer see).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageRef {
    /// A row id.
    Row(i64),
    /// A message id.
    Id(Uuid),
}

impl std::str::FromStr for MessageRef {
    type Err = String;

    /// A number is a row id, a UUID a message id; anything else is an error that says so.
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if let Ok(row) = s.parse::<i64>() {
            return Ok(MessageRef::Row(row));
        }
        s.parse::<Uuid>()
            .map(MessageRef::Id)
            .map_err(|_| format!("{s:?} is neither a row id nor a message id"))
    }
}

impl std::fmt::Display for MessageRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MessageRef::Row(r) => write!(f, "{r}"),
            MessageRef::Id(id) => write!(f, "{id}"),
        }
    }
}

/// Which messages an action applies to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Selection {
    /// These row ids; each id not changed is reported with why.
    Ids(Vec<i64>),
    /// Every message the filter matches (in the states the action applies to).
    Filter(MessageFilter),
}

/// What an operator does to messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Action {
    /// FAILED, REJECTED or SENT → PENDING: published again at once, attempts and check-backs
    /// reset, `redelivery` + 1, the last error kept. A SENT message published again reaches the
    /// consumer twice; its inbox applies it once.
    Requeue,
    /// A delayed PENDING message (or one waiting for its retry) is due now.
    PublishNow,
    /// FAILED → moved to the archive table `<table>_archive` with `archive_reason =
    /// 'discarded'`: out of the outbox, never silently lost.
    Discard,
    /// UNDECIDED → PREPARED: a parked two-phase message is checked back again at once, with a
    /// fresh budget of `max_checks` and no decision deadline (the one it had has passed or
    /// parked it) ([`crate::two_phase`]).
    Resume,
}

impl Action {
    /// The states the action changes.
    pub fn from_states(self) -> &'static [Status] {
        match self {
            Action::Requeue => &[Status::Failed, Status::Rejected, Status::Sent],
            Action::PublishNow => &[Status::Pending],
            Action::Discard => &[Status::Failed],
            Action::Resume => &[Status::Undecided],
        }
    }

    /// `requeue`, `publish-now`, `discard` or `resume`.
    pub fn name(self) -> &'static str {
        match self {
            Action::Requeue => "requeue",
            Action::PublishNow => "publish-now",
            Action::Discard => "discard",
            Action::Resume => "resume",
        }
    }
}

/// What an action changed, and for a selection by ids, each id it did not change and why.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActionReport {
    /// Rows changed.
    pub changed: u64,
    /// Ids named but not changed, with why (only for [`Selection::Ids`]).
    pub not_changed: Vec<NotChanged>,
}

/// An id an action did not change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NotChanged {
    /// The row id.
    pub id: i64,
    /// Its state now; `None` when there is no such row (never written, purged or archived).
    pub status: Option<Status>,
    /// Why, e.g. `"PENDING is not FAILED, REJECTED or SENT"`.
    pub reason: String,
}

/// The relays' membership and the bucket leases, as the database holds them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Leases {
    /// The database clock when read: compare heartbeats and lease expiries with it.
    pub now: Option<DateTime<Utc>>,
    /// Every relay row, alive or not, by name.
    pub relays: Vec<RelayRow>,
    /// Every bucket, by number.
    pub buckets: Vec<BucketRow>,
}

/// A relay's membership row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelayRow {
    /// The relay's name.
    pub name: String,
    /// Its last heartbeat (database clock).
    pub heartbeat_at: Option<DateTime<Utc>>,
    /// The topic patterns it routes, as it advertised them (JSON list text), if any.
    pub routes: Option<String>,
}

/// One bucket's lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BucketRow {
    /// The bucket (0 to `BUCKETS - 1`).
    pub bucket: i64,
    /// The relay holding (or last holding) it.
    pub owner: Option<String>,
    /// The fencing token of the lease; in JSON a string (a 63-bit number loses digits in
    /// JavaScript).
    #[serde(with = "token_text")]
    pub token: Option<i64>,
    /// When the lease ends (database clock); `None` for a bucket never leased.
    pub expires_at: Option<DateTime<Utc>>,
    /// How often a relay took it over from another whose lease had expired.
    pub takeovers: i64,
    /// The relay it is being handed over to, if any.
    pub handoff: Option<String>,
}

/// A partition key held back by a dead letter: its FAILED head and the PENDING messages of the
/// key after it. On a route with `dead_letter = "block"` they wait until the head is requeued or
/// discarded (docs/ordering.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockedKey {
    /// The partition key.
    pub key: String,
    /// The row id of the dead letter holding it back.
    pub held_by: i64,
    /// When that message was dead-lettered (its last change).
    pub since: Option<DateTime<Utc>>,
    /// Why it was dead-lettered.
    pub last_error: Option<String>,
    /// PENDING messages of the key after it.
    pub waiting: i64,
}

/// Messages per state of one topic.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopicCounts {
    /// The topic.
    pub topic: String,
    /// Rows per state name (only states that occur).
    pub counts: BTreeMap<String, u64>,
}

impl Serialize for Status {
    /// The upper-case name (`"FAILED"`).
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for Status {
    /// A name in any case (`"failed"`, `"FAILED"`).
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl std::str::FromStr for Status {
    type Err = String;

    /// A state name in any case: `pending`, `sending`, `sent`, `confirmed`, `failed`,
    /// `prepared`, `rejected`, `rolled_back`, `undecided`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Status::ALL
            .into_iter()
            .find(|st| st.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| {
                format!(
                    "unknown state {s:?}: one of {}",
                    Status::ALL.map(Status::name).join(", ")
                )
            })
    }
}

/// A fencing token as a JSON string.
mod token_text {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(t: &Option<i64>, s: S) -> Result<S::Ok, S::Error> {
        match t {
            Some(t) => s.serialize_str(&t.to_string()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|t| t.parse().map_err(serde::de::Error::custom))
            .transpose()
    }
}

/// A topic glob (`*` any run, `?` one character) as a SQL `LIKE` pattern with `!` as the
/// escape character.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) fn like_pattern(glob: &str) -> String {
    let mut out = String::with_capacity(glob.len() + 2);
    for c in glob.chars() {
        match c {
            '*' => out.push('%'),
            '?' => out.push('_'),
            '%' | '_' | '!' => {
                out.push('!');
                out.push(c);
            }
            c => out.push(c),
        }
    }
    out
}

/// `text` anywhere, as a `LIKE` pattern with `!` as the escape character.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) fn contains_pattern(text: &str) -> String {
    let mut out = String::from("%");
    for c in text.chars() {
        if matches!(c, '%' | '_' | '!') {
            out.push('!');
        }
        out.push(c);
    }
    out.push('%');
    out
}

/// A consumer inbox's dead letters as the admin API shows and settles them
/// ([`crate::admin::inbox`]).
pub mod inbox {
    use chrono::{DateTime, Utc};
    use serde::{Deserialize, Serialize};

    use super::RenderedPayload;

    /// A consumer with dead letters.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct ConsumerDeadLetters {
        /// The consumer's name.
        pub consumer: String,
        /// Its dead letters.
        pub dead_letters: u64,
        /// Of those, replays requested and not run yet.
        pub replay_requested: u64,
        /// When the oldest was dead-lettered.
        pub oldest_failed_at: Option<DateTime<Utc>>,
        /// When the newest was dead-lettered.
        pub newest_failed_at: Option<DateTime<Utc>>,
    }

    /// One dead letter.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct InboxDeadLetter {
        /// The consumer that dead-lettered it.
        pub consumer: String,
        /// The message id (the producer's idempotency key).
        pub message_id: String,
        /// Topic.
        pub topic: String,
        /// Partition key.
        pub partition_key: Option<String>,
        /// The handler's last error.
        pub error: String,
        /// Deliveries before it was dead-lettered.
        pub deliveries: i64,
        /// When it was dead-lettered.
        pub failed_at: Option<DateTime<Utc>>,
        /// When an operator asked for a replay that has not run yet.
        pub replay_requested_at: Option<DateTime<Utc>>,
        /// Headers as stored (a JSON object of strings); only in [`InboxAdmin::dead_letter`].
        #[serde(skip_serializing_if = "Option::is_none", default)]
        pub headers: Option<String>,
        /// The payload, rendered; only in [`InboxAdmin::dead_letter`].
        #[serde(skip_serializing_if = "Option::is_none", default)]
        pub payload: Option<RenderedPayload>,
    }

    /// What an operator does to dead letters.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
    #[serde(rename_all = "kebab-case")]
    pub enum InboxAction {
        /// Ask the consumer's runner to run it again (sets `replay_requested_at`).
        Replay,
        /// Delete it; the inbox's rejected verdict stays.
        Discard,
    }

    impl InboxAction {
        /// `replay` or `discard`.
        pub fn name(self) -> &'static str {
            match self {
                InboxAction::Replay => "replay",
                InboxAction::Discard => "discard",
            }
        }
    }

    /// What an inbox action changed, and each message id named but not changed, with why.
    #[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
    pub struct InboxActionReport {
        /// Dead letters changed.
        pub changed: u64,
        /// Message ids not changed: `(message id, why)`.
        pub not_changed: Vec<(String, String)>,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    fn globs_become_like_patterns() {
        assert_eq!(like_pattern("orders.*"), "orders.%");
        assert_eq!(like_pattern("a?c"), "a_c");
        assert_eq!(like_pattern("50%_off!"), "50!%!_off!!");
        assert_eq!(contains_pattern("5% *"), "%5!% *%");
    }

    #[test]
    fn payloads_render_as_json_text_or_hex() {
        let j = RenderedPayload::of(br#"{"order":42}"#);
        assert_eq!(
            (j.kind.as_str(), j.text.as_str()),
            ("json", "{\n  \"order\": 42\n}")
        );
        assert_eq!(RenderedPayload::of(b"plain\nlines").kind, "text");
        assert_eq!(RenderedPayload::of(b"\0").kind, "hex");
        let h = RenderedPayload::of(&[0xff, 0x00]);
        assert_eq!(
            (h.kind.as_str(), h.text.as_str(), h.bytes),
            ("hex", "ff00", 2)
        );
    }

    #[test]
    fn a_message_is_named_by_row_id_or_message_id() {
        assert_eq!("42".parse::<MessageRef>(), Ok(MessageRef::Row(42)));
        let id = Uuid::now_v7();
        assert_eq!(id.to_string().parse::<MessageRef>(), Ok(MessageRef::Id(id)));
        let e = "order-42".parse::<MessageRef>().unwrap_err();
        assert!(e.contains("neither a row id nor a message id"), "{e}");
    }

    #[test]
    fn states_parse_in_any_case_and_name_the_choices() {
        assert_eq!("failed".parse::<Status>().unwrap(), Status::Failed);
        let e = "lost".parse::<Status>().unwrap_err();
        assert!(e.contains("PENDING") && e.contains("\"lost\""), "{e}");
        let sel: Selection = serde_json::from_str(r#"{"ids":[1,2]}"#).unwrap();
        assert_eq!(sel, Selection::Ids(vec![1, 2]));
        let sel: Selection =
            serde_json::from_str(r#"{"filter":{"states":["failed"],"topic":"o.*"}}"#).unwrap();
        let Selection::Filter(f) = sel else { panic!() };
        assert_eq!(f.states, vec![Status::Failed]);
    }
}
