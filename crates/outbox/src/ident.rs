//! SQL identifiers for table names: validated once, then used in statements built at
//! construction time. Nothing else is ever interpolated into SQL; every value is a bind parameter.

use crate::error::StoreError;

/// A validated table name: `name` or `schema.name`, each part 1 to 48 characters of ASCII
/// letters, digits and `_`, not starting with a digit. Stored lower-case.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TableName {
    full: String,
}

impl TableName {
    /// Validate `name`.
    ///
    /// # Errors
    /// [`StoreError::InvalidIdentifier`] naming the input.
    pub fn new(name: &str) -> Result<TableName, StoreError> {
        let parts: Vec<&str> = name.split('.').collect();
        let ok = (1..=2).contains(&parts.len())
            && parts.iter().all(|p| {
                !p.is_empty()
                    && p.len() <= 48
                    && !p.as_bytes()[0].is_ascii_digit()
                    && p.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
            });
        if !ok {
            return Err(StoreError::InvalidIdentifier(name.to_owned()));
        }
        Ok(TableName {
            full: name.to_ascii_lowercase(),
        })
    }

    /// The name as used in SQL (`schema.name` or `name`).
    pub fn as_str(&self) -> &str {
        &self.full
    }

    /// The name with `.` replaced by `_`: a base for index, trigger and channel names.
    pub fn flat(&self) -> String {
        self.full.replace('.', "_")
    }

    /// The part after the schema, if any.
    pub fn unqualified(&self) -> &str {
        self.full.rsplit('.').next().unwrap_or(&self.full)
    }
}

impl std::fmt::Display for TableName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.full)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_and_qualified() {
        assert_eq!(TableName::new("outbox").unwrap().as_str(), "outbox");
        assert_eq!(
            TableName::new("App.Outbox_2").unwrap().as_str(),
            "app.outbox_2"
        );
        assert_eq!(TableName::new("app.outbox").unwrap().flat(), "app_outbox");
        assert_eq!(
            TableName::new("app.outbox").unwrap().unqualified(),
            "outbox"
        );
    }

    #[test]
    fn rejects_injection_and_junk() {
        for bad in [
            "",
            "1abc",
            "a;drop table x",
            "a b",
            "a.b.c",
            "a.",
            "\"x\"",
            &"x".repeat(49),
        ] {
            assert!(TableName::new(bad).is_err(), "{bad:?} accepted");
        }
    }
}
