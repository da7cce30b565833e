//! What a step's `checks:` promise once checked: which checks judge each stored output, what a
//! failure does (`on_fail`), and how many times a task may be paid again (`max_rerolls`, inside
//! the pipeline's `rerolls.max_credits`). The top-level `checks` module runs them.

use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// `not_blank` without settings: a flat frame's luma barely moves, a photograph's moves by tens.
pub const DEFAULT_MIN_STDDEV: f64 = 2.0;
/// `transparent` without settings: a cut-out keeps some pixels and removes some.
pub const DEFAULT_TRANSPARENT: (f64, f64) = (0.01, 0.99);
/// `distinct` without settings: bits of a 64-bit perceptual hash two images must differ by.
/// Low on purpose: a failure pays again, so only near-identical images fail by default (the
/// sandbox's pictures of one prompt differ by 2 to 7 bits, a repeated image by 0).
pub const DEFAULT_MIN_DISTANCE: u32 = 2;
/// A command check that has not answered by then cannot judge (the image is not at fault).
pub const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_secs(60);
/// The longest `timeout` a command check may set: an hour per image stalls a night.
pub const MAX_COMMAND_TIMEOUT_SECS: u64 = 3600;
/// The most times one task may be paid again: past a few, the prompt is at fault, not luck.
pub const MAX_REROLLS: u32 = 10;
/// What a command's argument is replaced with: the stored output's path, as one argument.
pub const FILE_PLACEHOLDER: &str = "{file}";

/// The checks of one step and what their failure does.
#[derive(Clone, Debug, PartialEq)]
pub struct StepChecks {
    pub checks: Vec<Check>,
    pub on_fail: OnFail,
    /// Times a task whose output failed may be paid again (with `on_fail: reroll`).
    pub max_rerolls: u32,
}

impl StepChecks {
    /// The step and its checks as written, for the state database: earlier runs' verdicts
    /// count toward a plan's expected case only under the same key (changing a threshold
    /// starts afresh).
    pub fn key(&self, pipeline: &str, step: &str) -> String {
        let checks: Vec<String> = self.checks.iter().map(Check::written).collect();
        format!("{pipeline}/{step}: {}", checks.join(", "))
    }
}

/// One check of a stored output.
#[derive(Clone, Debug, PartialEq)]
pub enum Check {
    /// Not one flat colour: the standard deviation of luma is at least `min_stddev`.
    NotBlank { min_stddev: f64 },
    /// The dimensions the operation promises, within 1 pixel.
    Size,
    /// The share of pixels with alpha below 255 is within `min..=max`.
    Transparent { min: f64, max: f64 },
    /// The images of one generation (or what a later step made of each) differ by at least
    /// `min_distance` perceptual-hash bits.
    Distinct { min_distance: u32 },
    /// A program judges: exit 0 passes, 1 fails, anything else cannot judge.
    Command(CommandCheck),
}

/// A program run on each output, never through a shell.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommandCheck {
    /// The program and its arguments; every `{file}` becomes the output's path.
    pub argv: Vec<String>,
    pub timeout: Duration,
}

/// The name of a check, as the pipeline file, the state database and the reports write it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckName {
    NotBlank,
    Size,
    Transparent,
    Distinct,
    Command,
}

/// Every check, in the order the reference lists them.
pub const CHECK_NAMES: [&str; 5] = ["not_blank", "size", "transparent", "distinct", "command"];

impl CheckName {
    pub fn as_str(self) -> &'static str {
        match self {
            CheckName::NotBlank => "not_blank",
            CheckName::Size => "size",
            CheckName::Transparent => "transparent",
            CheckName::Distinct => "distinct",
            CheckName::Command => "command",
        }
    }

    pub fn parse(name: &str) -> Option<CheckName> {
        [
            CheckName::NotBlank,
            CheckName::Size,
            CheckName::Transparent,
            CheckName::Distinct,
            CheckName::Command,
        ]
        .into_iter()
        .find(|c| c.as_str() == name)
    }
}

impl std::fmt::Display for CheckName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Check {
    /// The check with its settings, one way for each (the defaults written out).
    pub fn written(&self) -> String {
        match self {
            Check::NotBlank { min_stddev } => format!("not_blank(min_stddev={min_stddev})"),
            Check::Size => "size".into(),
            Check::Transparent { min, max } => format!("transparent(min={min}, max={max})"),
            Check::Distinct { min_distance } => format!("distinct(min_distance={min_distance})"),
            Check::Command(c) => format!("command({:?}, timeout={}s)", c.argv, c.timeout.as_secs()),
        }
    }

    pub fn name(&self) -> CheckName {
        match self {
            Check::NotBlank { .. } => CheckName::NotBlank,
            Check::Size => CheckName::Size,
            Check::Transparent { .. } => CheckName::Transparent,
            Check::Distinct { .. } => CheckName::Distinct,
            Check::Command(_) => CheckName::Command,
        }
    }
}

/// What a failed check does to its task.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OnFail {
    /// Set the output aside and pay for the task again, while the rerolls' budget allows.
    #[default]
    Reroll,
    /// Keep the output and mark it for a person to look at.
    Flag,
    /// The task fails; the run goes on with the rest.
    Fail,
}

impl OnFail {
    pub fn as_str(self) -> &'static str {
        match self {
            OnFail::Reroll => "reroll",
            OnFail::Flag => "flag",
            OnFail::Fail => "fail",
        }
    }
}

/// `rerolls:` at the top of the file: what automatic rerolls may spend, inside the budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rerolls {
    pub max_credits: u64,
}
