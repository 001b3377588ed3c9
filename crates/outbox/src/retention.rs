//! Retention: how long finished rows stay in the outbox table, and whether they are then deleted
//! or moved to the archive table `<table>_archive` (the one [`crate::admin`]'s discard fills).
//!
//! One rule per finished state ([`Finished`]): SENT rows that await no confirmation, CONFIRMED,
//! REJECTED, and FAILED (dead letters: kept until an operator acts unless a rule is set). Rows
//! still to be published or confirmed (PENDING, SENT awaiting a confirmation, PREPARED) are never
//! touched. The relay applies the rules in its maintenance, on one relay at a time (the holder of
//! bucket 0), in transactions of at most [`crate::admin::ACTION_CHUNK`] rows that skip rows
//! another transaction holds, so retention never waits on a lock and never deadlocks; `outbox
//! archive` applies them at once.
//!
//! In a configuration file, `[relay] retention` is either a duration (or `"forever"`) for every
//! finished state but FAILED, deleted (the form before 0.2), or a table:
//!
//! ```toml
//! [relay.retention]
//! action = "archive"          # default for the states below: "delete" (the default) or "archive"
//! confirmed = "7d"            # CONFIRMED rows, by confirmed_at; default 7 days
//! sent = "7d"                 # SENT rows awaiting no confirmation, by sent_at; default 7 days
//! rejected = { after = "30d", action = "archive" }   # by confirmed_at; default 7 days
//! failed = "forever"          # dead letters, by updated_at; default forever
//! archived = "365d"           # rows in <table>_archive, by archived_at; default forever
//! ```

use std::time::Duration;

/// A finished state a retention [`Rule`] applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Finished {
    /// SENT rows that await no confirmation (`confirm_deadline` null), aged by `sent_at`.
    Sent,
    /// CONFIRMED rows, aged by `confirmed_at`.
    Confirmed,
    /// REJECTED rows, aged by `confirmed_at` (when the rejection arrived).
    Rejected,
    /// FAILED rows (dead letters), aged by `updated_at` (when they were dead-lettered).
    Failed,
    /// ROLLED_BACK rows (two-phase messages rolled back, [`crate::two_phase`]), aged by
    /// `updated_at` (when they were rolled back).
    RolledBack,
}

impl Finished {
    /// Every finished state, in the order retention runs them.
    pub const ALL: [Finished; 5] = [
        Finished::Sent,
        Finished::Confirmed,
        Finished::Rejected,
        Finished::Failed,
        Finished::RolledBack,
    ];

    /// The name in configuration and reports: `sent`, `confirmed`, `rejected`, `failed`,
    /// `rolled_back`.
    pub fn name(self) -> &'static str {
        match self {
            Finished::Sent => "sent",
            Finished::Confirmed => "confirmed",
            Finished::Rejected => "rejected",
            Finished::Failed => "failed",
            Finished::RolledBack => "rolled_back",
        }
    }
}

impl std::str::FromStr for Finished {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Finished::ALL
            .into_iter()
            .find(|f| f.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                format!("{s:?} is not one of sent, confirmed, rejected, failed, rolled_back")
            })
    }
}

/// What happens to a row past its retention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RetentionAction {
    /// Deleted (the default).
    #[default]
    Delete,
    /// Moved to `<table>_archive` (same columns, plus `archived_at` and `archive_reason =
    /// 'retention'`), in the same transaction that deletes it from the outbox table.
    Archive,
}

/// One finished state's retention: after how long, and what then.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    /// How long a row stays after it finished; `None` keeps it forever.
    pub after: Option<Duration>,
    /// Delete or archive it then.
    pub action: RetentionAction,
}

impl Rule {
    /// Delete after `after`.
    pub fn delete_after(after: Duration) -> Self {
        Rule {
            after: Some(after),
            action: RetentionAction::Delete,
        }
    }

    /// Archive after `after`.
    pub fn archive_after(after: Duration) -> Self {
        Rule {
            after: Some(after),
            action: RetentionAction::Archive,
        }
    }

    /// Keep forever.
    pub const KEEP: Rule = Rule {
        after: None,
        action: RetentionAction::Delete,
    };
}

/// The retention of every finished state and of the archive. Default: SENT (awaiting no
/// confirmation), CONFIRMED and REJECTED rows deleted after 7 days; FAILED rows and archived rows
/// kept forever.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// SENT rows that await no confirmation. Default: delete after 7 days.
    pub sent: Rule,
    /// CONFIRMED rows. Default: delete after 7 days.
    pub confirmed: Rule,
    /// REJECTED rows. Default: delete after 7 days.
    pub rejected: Rule,
    /// FAILED rows (dead letters). Default: kept until an operator acts ([`Rule::KEEP`]).
    pub failed: Rule,
    /// ROLLED_BACK rows (two-phase messages never published). Default: delete after 7 days.
    pub rolled_back: Rule,
    /// Rows in `<table>_archive` (archived by retention or discarded by an operator), deleted
    /// this long after `archived_at`; `None` (the default) keeps them.
    pub archived: Option<Duration>,
}

const WEEK: Duration = Duration::from_secs(7 * 24 * 3600);

impl Default for Retention {
    fn default() -> Self {
        Retention::finished_after(WEEK)
    }
}

impl Retention {
    /// SENT, CONFIRMED and REJECTED rows deleted after `after`; FAILED and archived rows kept
    /// (what `retention = "<duration>"` means in a file).
    pub fn finished_after(after: Duration) -> Self {
        let rule = Rule::delete_after(after);
        Retention {
            sent: rule,
            confirmed: rule,
            rejected: rule,
            failed: Rule::KEEP,
            rolled_back: rule,
            archived: None,
        }
    }

    /// Nothing is ever deleted or archived (`retention = "forever"`).
    pub fn keep_all() -> Self {
        Retention {
            sent: Rule::KEEP,
            confirmed: Rule::KEEP,
            rejected: Rule::KEEP,
            failed: Rule::KEEP,
            rolled_back: Rule::KEEP,
            archived: None,
        }
    }

    /// The rule of one state.
    pub fn rule(&self, state: Finished) -> Rule {
        match state {
            Finished::Sent => self.sent,
            Finished::Confirmed => self.confirmed,
            Finished::Rejected => self.rejected,
            Finished::Failed => self.failed,
            Finished::RolledBack => self.rolled_back,
        }
    }

    /// The first zero duration, as the name of its key (`failed`, `archived`, …): a zero
    /// retention would remove rows the moment they finish, which is never meant.
    pub fn zero_field(&self) -> Option<&'static str> {
        Finished::ALL
            .into_iter()
            .find(|f| self.rule(*f).after.is_some_and(|d| d.is_zero()))
            .map(Finished::name)
            .or_else(|| {
                self.archived
                    .is_some_and(|d| d.is_zero())
                    .then_some("archived")
            })
    }
}

/// A duration or `"forever"`.
fn parse_after(s: &str) -> Result<Option<Duration>, String> {
    if s == "forever" {
        return Ok(None);
    }
    humantime_serde::re::humantime::parse_duration(s)
        .map(Some)
        .map_err(|e| format!("{s:?} is neither a duration nor \"forever\": {e}"))
}

fn format_after(d: Option<Duration>) -> String {
    match d {
        Some(d) => humantime_serde::re::humantime::format_duration(d).to_string(),
        None => "forever".to_owned(),
    }
}

/// A rule in a file: a duration or `"forever"`, or `{ after, action }`.
#[derive(Default)]
struct RuleFile {
    after: Option<Option<Duration>>,
    action: Option<RetentionAction>,
}

impl<'de> serde::Deserialize<'de> for RuleFile {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Table {
            after: Option<String>,
            action: Option<RetentionAction>,
        }
        str_or_table(
            d,
            "a duration, \"forever\", or { after, action }",
            |s| {
                Ok(RuleFile {
                    after: Some(parse_after(s)?),
                    action: None,
                })
            },
            |t: Table| {
                Ok(RuleFile {
                    after: t.after.as_deref().map(parse_after).transpose()?,
                    action: t.action,
                })
            },
        )
    }
}

impl<'de> serde::Deserialize<'de> for Retention {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Table {
            action: Option<RetentionAction>,
            #[serde(default)]
            sent: RuleFile,
            #[serde(default)]
            confirmed: RuleFile,
            #[serde(default)]
            rejected: RuleFile,
            #[serde(default)]
            failed: RuleFile,
            #[serde(default)]
            rolled_back: RuleFile,
            archived: Option<String>,
        }
        str_or_table(
            d,
            "a duration, \"forever\", or a table of rules per state",
            |s| {
                Ok(match parse_after(s)? {
                    Some(d) => Retention::finished_after(d),
                    None => Retention::keep_all(),
                })
            },
            |t: Table| {
                let default = Retention::default();
                let action = t.action.unwrap_or_default();
                let rule = |f: RuleFile, d: Rule| Rule {
                    after: f.after.unwrap_or(d.after),
                    action: f.action.unwrap_or(action),
                };
                Ok(Retention {
                    sent: rule(t.sent, default.sent),
                    confirmed: rule(t.confirmed, default.confirmed),
                    rejected: rule(t.rejected, default.rejected),
                    failed: rule(t.failed, default.failed),
                    rolled_back: rule(t.rolled_back, default.rolled_back),
                    archived: t.archived.as_deref().map_or(Ok(None), parse_after)?,
                })
            },
        )
    }
}

/// Deserialize a value written either as a string (read by `from_str`) or as a table `T` (read
/// by `from_table`); `expecting` describes both for serde's type errors. The table's own errors
/// (an unknown field, a wrong type) are serde's; `from_str`'s and `from_table`'s become custom
/// errors.
fn str_or_table<'de, D, T, R>(
    d: D,
    expecting: &'static str,
    from_str: fn(&str) -> Result<R, String>,
    from_table: fn(T) -> Result<R, String>,
) -> Result<R, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::Deserialize<'de>,
{
    struct V<T, R> {
        expecting: &'static str,
        from_str: fn(&str) -> Result<R, String>,
        from_table: fn(T) -> Result<R, String>,
    }
    impl<'de, T: serde::Deserialize<'de>, R> serde::de::Visitor<'de> for V<T, R> {
        type Value = R;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.expecting)
        }
        fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<R, E> {
            (self.from_str)(s).map_err(E::custom)
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, m: A) -> Result<R, A::Error> {
            let t = T::deserialize(serde::de::value::MapAccessDeserializer::new(m))?;
            (self.from_table)(t).map_err(serde::de::Error::custom)
        }
    }
    d.deserialize_any(V {
        expecting,
        from_str,
        from_table,
    })
}

impl serde::Serialize for Retention {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(6))?;
        for f in Finished::ALL {
            let r = self.rule(f);
            let mut rule = serde_json::Map::new();
            rule.insert("after".into(), format_after(r.after).into());
            rule.insert(
                "action".into(),
                serde_json::to_value(r.action).map_err(serde::ser::Error::custom)?,
            );
            m.serialize_entry(f.name(), &rule)?;
        }
        m.serialize_entry("archived", &format_after(self.archived))?;
        m.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_duration_is_the_shorthand_and_a_table_sets_each_state() {
        let r: Retention = serde_json::from_value(json!("3d")).unwrap();
        assert_eq!(r, Retention::finished_after(Duration::from_secs(3 * 86400)));
        let r: Retention = serde_json::from_value(json!("forever")).unwrap();
        assert_eq!(r, Retention::keep_all());
        let r: Retention = serde_json::from_value(json!({
            "action": "archive",
            "confirmed": "1h",
            "rejected": {"after": "30d", "action": "delete"},
            "failed": {"after": "90d"},
            "archived": "365d"
        }))
        .unwrap();
        assert_eq!(r.confirmed, Rule::archive_after(Duration::from_secs(3600)));
        assert_eq!(
            r.sent,
            Rule::archive_after(WEEK),
            "the default age, the table's action"
        );
        assert_eq!(
            r.rejected,
            Rule::delete_after(Duration::from_secs(30 * 86400))
        );
        assert_eq!(
            r.failed,
            Rule::archive_after(Duration::from_secs(90 * 86400))
        );
        assert_eq!(r.archived, Some(Duration::from_secs(365 * 86400)));
        let again: Retention = serde_json::from_value(serde_json::to_value(r).unwrap()).unwrap();
        assert_eq!(again, r);
    }

    #[test]
    fn bad_retention_names_the_problem() {
        let e = |v| {
            serde_json::from_value::<Retention>(v)
                .unwrap_err()
                .to_string()
        };
        assert!(e(json!("soon")).contains("forever"), "{}", e(json!("soon")));
        assert!(e(json!({"confirmd": "1d"})).contains("confirmd"));
        assert!(e(json!({"failed": {"action": "shred"}})).contains("shred"));
        let r: Retention = serde_json::from_value(json!({"failed": "0s"})).unwrap();
        assert_eq!(r.zero_field(), Some("failed"));
    }
}

/// What one round of partition retention did ([`crate::Store::retire_partitions`], a
/// time-partitioned PostgreSQL table: docs/operations.md, "Partitioned outbox table").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PartitionRound {
    /// Day partitions created ahead.
    pub created: u32,
    /// Rows that had to stay carried forward into today's partition.
    pub carried: u64,
    /// Day partitions dropped.
    pub dropped: u32,
    /// Rows of the dropped partitions copied to the archive first (states ruled `archive`).
    pub archived: u64,
    /// Rows of the dropped partitions deleted with them.
    pub deleted: u64,
}
