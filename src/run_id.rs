//! A run's id, as `run --run-id` names it and the state database keeps it (`runs.id`):
//! made from text once, where it comes in (the command line, a record read back), then passed
//! as a type, so a run id is never confused with an item, a step or a path. `Display` writes
//! it as it was given, for messages. Like the task key's module, this one depends on nothing
//! but std and serde.

use std::fmt;
use std::ops::Deref;

#[derive(
    Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct RunId(String);

impl RunId {
    /// The id a run was given: whether it is a good one for a new run is
    /// `runner::record`'s check; a recorded one is taken as it is.
    pub fn new(id: impl Into<String>) -> RunId {
        RunId(id.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Read as text where text is wanted: a message, a path's name, a statement's parameter.
impl Deref for RunId {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for RunId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl From<&str> for RunId {
    fn from(id: &str) -> RunId {
        RunId::new(id)
    }
}

impl From<String> for RunId {
    fn from(id: String) -> RunId {
        RunId(id)
    }
}

impl PartialEq<str> for RunId {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for RunId {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_is_written_and_serialised_as_it_was_given() {
        let id = RunId::from("20261127-064500-ab12");
        assert_eq!(id.to_string(), "20261127-064500-ab12");
        assert_eq!(
            serde_json::to_string(&id).unwrap(),
            "\"20261127-064500-ab12\""
        );
        assert_eq!(id, "20261127-064500-ab12");
    }
}
