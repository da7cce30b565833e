//! Checks of stored outputs: the one home of what judges an image. The built-in checks
//! ([`image`]) are pure functions of a file's pixels, read once and row by row through
//! [`crate::pixels`], so a check costs memory by the image's width and not its area. The
//! command check ([`command`]) hands the file to a program the user names, never through a
//! shell. Each gives a [`Verdict`]; what a verdict does to its task is the executor's business.

pub mod command;
pub mod file;
pub mod image;
pub mod judge;

use serde::Serialize;

use crate::pipeline::checks::CheckName;
pub use crate::store::Outcome;

/// Longest reason kept from a check: a card line, not a log.
pub const MAX_REASON_CHARS: usize = 300;

/// One check's verdict on one output, with its score (when it measures one) and why.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Verdict {
    pub check: CheckName,
    pub outcome: Outcome,
    pub score: Option<f64>,
    pub reason: String,
}

impl Verdict {
    pub fn new(check: CheckName, outcome: Outcome, score: Option<f64>, reason: String) -> Verdict {
        Verdict {
            check,
            outcome,
            score: score.filter(|s| s.is_finite()),
            reason: plain_reason(&reason),
        }
    }

    /// A pass or a fail, as `ok` says.
    pub fn judged(check: CheckName, ok: bool, score: f64, reason: String) -> Verdict {
        let outcome = if ok { Outcome::Passed } else { Outcome::Failed };
        Verdict::new(check, outcome, Some(score), reason)
    }

    pub fn not_checked(check: CheckName, reason: impl Into<String>) -> Verdict {
        Verdict::new(check, Outcome::NotChecked, None, reason.into())
    }
}

/// A reason as one short line of plain text: whatever a program printed, it is data, shown
/// on a card and in a terminal, so control characters go and the length is bounded.
pub fn plain_reason(text: &str) -> String {
    let mut out: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(MAX_REASON_CHARS)
        .collect();
    if text.chars().count() > MAX_REASON_CHARS {
        out.push('…');
    }
    out.trim().to_owned()
}
