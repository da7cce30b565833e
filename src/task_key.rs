//! A task's name as people read and type it: `item/step[index]` (`mug/clean[0]`), the batch's
//! tasks under `_batch`. The index is the task's number within its step for the item; where
//! the key names an input image (the inputs recorded with each task, the report's lineage) it
//! is the output's number, which is the same but for a generation of `n > 1`, whose task 0
//! makes outputs 0 to n-1 (`mug/shot[1]` is its second image). Written once here: status,
//! failures, the lineage and the recorded inputs all say it the same way, and read it back
//! with [`FromStr`].
//! Like [`crate::place::layout`], this module depends on nothing but std.

use std::fmt;
use std::str::FromStr;

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TaskKey {
    pub item: String,
    pub step: String,
    pub index: u32,
}

impl TaskKey {
    pub fn new(item: impl Into<String>, step: impl Into<String>, index: u32) -> TaskKey {
        TaskKey {
            item: item.into(),
            step: step.into(),
            index,
        }
    }
}

impl fmt::Display for TaskKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}[{}]", self.item, self.step, self.index)
    }
}

/// Why a text is not a task's name.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a task's name: write it as item/step[index], e.g. mug/clean[0]")]
pub struct NotATaskKey(pub String);

impl FromStr for TaskKey {
    type Err = NotATaskKey;

    fn from_str(s: &str) -> Result<TaskKey, NotATaskKey> {
        let parsed = s
            .strip_suffix(']')
            .and_then(|s| s.rsplit_once('['))
            .and_then(|(key, i)| {
                let (item, step) = key.split_once('/')?;
                let index = i.parse::<u32>().ok()?;
                let plain = |p: &str| !p.is_empty() && !p.contains(['/', '[', ']']);
                (plain(item) && plain(step)).then(|| TaskKey::new(item, step, index))
            });
        parsed.ok_or_else(|| NotATaskKey(s.to_owned()))
    }
}

impl serde::Serialize for TaskKey {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_reads_back_as_it_was_written() {
        for key in [
            TaskKey::new("mug", "clean", 0),
            TaskKey::new("_batch", "style", 12),
        ] {
            assert_eq!(key.to_string().parse::<TaskKey>(), Ok(key));
        }
        assert_eq!(TaskKey::new("mug", "shot", 1).to_string(), "mug/shot[1]");
        for bad in [
            "mug/clean",
            "mug[0]",
            "/clean[0]",
            "mug/[0]",
            "mug/clean[x]",
            "a/b/c[0]",
            "mug/clean[-1]",
        ] {
            assert!(bad.parse::<TaskKey>().is_err(), "{bad}");
        }
    }
}
