//! A step's checks on one stored output, and what their verdicts do to its task. Reading is
//! done once for every built-in check (on a blocking thread: decoding is CPU work), then each
//! command check runs in turn; `distinct` is judged across a generation's outputs, from the
//! hashes each output's reading gives ([`Judged::hash`]).
//!
//! The executor calls [`judge_file`] on each stored output before any downstream task may use
//! it, records the verdicts (`store::Verdicts`), then asks [`decide`] what to do.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use crate::checks::command::Commands;
use crate::checks::file;
use crate::checks::image::{self, SizePromise, Stats};
use crate::checks::{Outcome, Verdict};
use crate::pipeline::checks::{Check, CheckName, OnFail};
use crate::place::Address;

/// One output's verdicts, each with the check's place in its step's list.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Judged {
    pub verdicts: Vec<(usize, Verdict)>,
    /// The output's perceptual hash, when it could be read: `distinct` compares them.
    pub hash: Option<u64>,
}

/// Judges the stored output at `file` by every check but `distinct`. `promise` is what the
/// step's operation promises of its size (`None` when the step has no `size` check).
pub async fn judge_file(
    checks: &[Check],
    file: &Path,
    promise: Option<SizePromise>,
    commands: &Commands,
) -> Judged {
    let mut judged = Judged::default();
    let needs_pixels = checks.iter().any(|c| !matches!(c, Check::Command(_)));
    let stats = if needs_pixels {
        Some(read(file.to_path_buf()).await)
    } else {
        None
    };
    if let Some(Ok(stats)) = &stats {
        judged.hash = Some(stats.hash());
    }
    for (position, check) in checks.iter().enumerate() {
        let verdict = match (check, &stats) {
            (Check::Command(command), _) => commands.judge(command, file).await,
            (Check::Distinct { .. }, _) => continue,
            (_, Some(Ok(stats))) => match builtin(check, stats, promise) {
                Some(verdict) => verdict,
                None => continue,
            },
            (_, Some(Err(why))) => Verdict::not_checked(check.name(), why.clone()),
            (_, None) => continue,
        };
        judged.verdicts.push((position, verdict));
    }
    judged
}

/// Judges a task's outputs, in output order, by every check of its step: `distinct` across
/// them, after the `earlier` hashes of what sibling tasks kept. An output with no address (its download failed) or whose copy cannot be made is
/// judged by none: each check says why.
pub async fn judge_task(
    checks: &[Check],
    outputs: &[Option<Address>],
    promise: Option<SizePromise>,
    commands: &Commands,
    earlier: &[u64],
) -> Vec<Judged> {
    let mut judged = Vec::with_capacity(outputs.len());
    for address in outputs {
        let local = match address {
            Some(address) => file::local(address).await,
            None => Err("the output was not kept: its download failed".to_owned()),
        };
        judged.push(match local {
            Ok(file) => judge_file(checks, file.path(), promise, commands).await,
            Err(why) => unjudged(checks, &why),
        });
    }
    judge_generation(checks, &mut judged, earlier);
    judged
}

/// The perceptual hash of the kept output at `address` (a copy of it when it is an object);
/// `None` when it was not kept or cannot be read.
pub async fn hash_of(address: Option<&Address>) -> Option<u64> {
    let local = file::local(address?).await.ok()?;
    read(local.path().to_path_buf())
        .await
        .ok()
        .map(|s| s.hash())
}

/// Every check but `distinct` unable to judge an output, for `why`.
fn unjudged(checks: &[Check], why: &str) -> Judged {
    let verdicts = checks
        .iter()
        .enumerate()
        .filter(|(_, c)| !matches!(c, Check::Distinct { .. }))
        .map(|(position, c)| (position, Verdict::not_checked(c.name(), why)))
        .collect();
    Judged {
        verdicts,
        hash: None,
    }
}

/// What one reading of the file gives, or why it could not be read.
async fn read(file: PathBuf) -> Result<Stats, String> {
    let shown = file.display().to_string();
    let read = tokio::task::spawn_blocking(move || {
        let f = File::open(&file).map_err(|e| e.to_string())?;
        image::read(BufReader::new(f)).map_err(|e| e.to_string())
    })
    .await;
    match read {
        Ok(Ok(stats)) => Ok(stats),
        Ok(Err(why)) => Err(format!("{shown} could not be read: {why}")),
        Err(e) => Err(format!("{shown} could not be read: {e}")),
    }
}

/// A built-in check's verdict from the reading; `None` for the checks judged elsewhere
/// (`distinct` across a generation, `command` by its program).
fn builtin(check: &Check, stats: &Stats, promise: Option<SizePromise>) -> Option<Verdict> {
    Some(match check {
        Check::NotBlank { min_stddev } => image::not_blank(stats, *min_stddev),
        Check::Transparent { min, max } => image::transparent(stats, *min, *max),
        Check::Size => image::size(stats, promise.unwrap_or(SizePromise::UnknownInput)),
        Check::Distinct { .. } | Check::Command(_) => return None,
    })
}

/// Adds `distinct`'s verdicts to a task's outputs, judged in their order after `earlier`: the
/// hashes of what sibling tasks kept (what a later step made of a generation's other
/// images), which are compared with but not judged again. Outputs that could not be read
/// cannot be judged.
pub fn judge_generation(checks: &[Check], outputs: &mut [Judged], earlier: &[u64]) {
    for (position, check) in checks.iter().enumerate() {
        let Check::Distinct { min_distance } = check else {
            continue;
        };
        let mut read: Vec<u64> = earlier.to_vec();
        read.extend(outputs.iter().filter_map(|o| o.hash));
        let mut verdicts = image::distinct(&read, *min_distance)
            .into_iter()
            .skip(earlier.len());
        for output in outputs.iter_mut() {
            let verdict = match output.hash {
                Some(_) => verdicts.next(),
                None => None,
            }
            .unwrap_or_else(|| Verdict::not_checked(check.name(), "the image could not be read"));
            output.verdicts.push((position, verdict));
        }
    }
}

/// What an output's verdicts do to its task, from the mildest to the gravest: a task does
/// what the gravest of its outputs' decisions says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Decision {
    /// Every check passed: downstream tasks may use it.
    Keep,
    /// Keep it, marked for a person: a check failed with nothing left to pay again, or
    /// no check could judge it (then nothing is paid again: not the image's fault).
    Flag,
    /// Set it aside (`_superseded/`, reason `check: <name>`) and pay for the task again.
    Reroll,
    /// The task fails (`on_fail: fail`); the run goes on with the rest.
    Fail,
}

/// Where a task stands with its rerolls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RerollRoom {
    /// Times this task was already paid again for a failed check.
    pub rerolled: u32,
    pub max_rerolls: u32,
    /// What paying for the task again costs.
    pub price: u64,
    /// What `rerolls.max_credits` leaves for rerolls in this run.
    pub credits_left: u64,
}

impl RerollRoom {
    fn allows(self) -> bool {
        self.rerolled < self.max_rerolls && self.price <= self.credits_left
    }
}

/// What to do with an output given its verdicts. A reroll is only asked for here: the money
/// gate, which holds the run's budget and the caps, may still refuse it, and then the output
/// is flagged (or its task failed) as when `room` does not allow one.
pub fn decide(verdicts: &[Verdict], on_fail: OnFail, room: RerollRoom) -> Decision {
    let any = |o: Outcome| verdicts.iter().any(|v| v.outcome == o);
    if any(Outcome::Failed) {
        return match on_fail {
            OnFail::Reroll if room.allows() => Decision::Reroll,
            OnFail::Fail => Decision::Fail,
            OnFail::Reroll | OnFail::Flag => Decision::Flag,
        };
    }
    if any(Outcome::NotChecked) {
        return Decision::Flag;
    }
    Decision::Keep
}

/// What a task's outputs' verdicts do to it: the gravest of its outputs' decisions.
pub fn decide_task<'a>(
    outputs: impl IntoIterator<Item = &'a [Verdict]>,
    on_fail: OnFail,
    room: RerollRoom,
) -> Decision {
    outputs
        .into_iter()
        .map(|verdicts| decide(verdicts, on_fail, room))
        .max()
        .unwrap_or(Decision::Keep)
}

/// Whether an input's failure of `check` is passed on to what a tool makes of it: a flat
/// frame upscaled is a flat frame, an opaque cut-out stays opaque, copies stay copies. Not
/// `size`, which is judged against the input's own size, and not a command, whose verdict is
/// its own (two commands share the name).
pub fn passed_on(check: CheckName) -> bool {
    matches!(
        check,
        CheckName::NotBlank | CheckName::Transparent | CheckName::Distinct
    )
}

/// The first failed verdict of `verdicts`: what outputs are set aside for, and a task fails for.
pub fn first_failure<'a>(verdicts: impl IntoIterator<Item = &'a Verdict>) -> Option<&'a Verdict> {
    verdicts.into_iter().find(|v| v.outcome == Outcome::Failed)
}

/// The reason a failed output is set aside with: `check: <name>` of its first failed check.
pub fn set_aside_reason<'a>(verdicts: impl IntoIterator<Item = &'a Verdict>) -> Option<String> {
    first_failure(verdicts).map(|v| format!("check: {}", v.check))
}

/// Why a task fails for its verdicts: `check: <name>: <reason>` of its first failed one.
pub fn failure_reason<'a>(verdicts: impl IntoIterator<Item = &'a Verdict>) -> Option<String> {
    first_failure(verdicts).map(|v| format!("check: {}: {}", v.check, v.reason))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::pipeline::checks::CommandCheck;
    use crate::pixels::testing::png;
    use crate::sandbox::images::{Weight, generation_png};

    #[test]
    fn what_the_image_is_is_passed_on_and_what_the_call_did_is_not() {
        let passed = [
            (CheckName::NotBlank, true),
            (CheckName::Transparent, true),
            (CheckName::Distinct, true),
            (CheckName::Size, false),
            (CheckName::Command, false),
        ];
        for (check, want) in passed {
            assert_eq!(passed_on(check), want, "{check:?}");
        }
    }

    fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        path
    }

    fn outcomes(j: &Judged) -> Vec<(usize, CheckName, Outcome)> {
        j.verdicts
            .iter()
            .map(|(p, v)| (*p, v.check, v.outcome))
            .collect()
    }

    #[tokio::test]
    async fn one_reading_judges_every_builtin_check_and_commands_run_after() {
        let dir = tempfile::tempdir().unwrap();
        let flat = write(
            dir.path(),
            "flat.png",
            &png(64, 64, true, |_, _| [9, 9, 9, 255]),
        );
        let checks = [
            Check::NotBlank { min_stddev: 2.0 },
            Check::Size,
            Check::Transparent {
                min: 0.05,
                max: 0.95,
            },
            Check::Distinct { min_distance: 2 },
            Check::Command(CommandCheck {
                argv: vec!["test".into(), "-s".into(), "{file}".into()],
                timeout: Duration::from_secs(20),
            }),
        ];
        let promise = Some(SizePromise::Scaled {
            input: (32, 32),
            factor: 2,
        });
        let j = judge_file(&checks, &flat, promise, &Commands::default()).await;
        assert_eq!(
            outcomes(&j),
            [
                (0, CheckName::NotBlank, Outcome::Failed),
                (1, CheckName::Size, Outcome::Passed),
                (2, CheckName::Transparent, Outcome::Failed),
                (4, CheckName::Command, Outcome::Passed),
            ]
        );
        assert!(j.hash.is_some());
        let room = RerollRoom {
            rerolled: 0,
            max_rerolls: 1,
            price: 5,
            credits_left: 60,
        };
        let verdicts: Vec<Verdict> = j.verdicts.into_iter().map(|(_, v)| v).collect();
        assert_eq!(decide(&verdicts, OnFail::Reroll, room), Decision::Reroll);
        assert_eq!(
            set_aside_reason(&verdicts).as_deref(),
            Some("check: not_blank")
        );
    }

    #[tokio::test]
    async fn a_file_that_is_not_an_image_cannot_be_judged_and_is_flagged() {
        let dir = tempfile::tempdir().unwrap();
        let junk = write(dir.path(), "junk.png", b"not a png");
        let checks = [Check::NotBlank { min_stddev: 2.0 }];
        let j = judge_file(&checks, &junk, None, &Commands::default()).await;
        assert_eq!(
            outcomes(&j),
            [(0, CheckName::NotBlank, Outcome::NotChecked)]
        );
        assert!(
            j.verdicts[0]
                .1
                .reason
                .contains("junk.png could not be read"),
            "{j:?}"
        );
        let verdicts = [j.verdicts[0].1.clone()];
        let room = RerollRoom {
            rerolled: 0,
            max_rerolls: 1,
            price: 5,
            credits_left: 60,
        };
        assert_eq!(decide(&verdicts, OnFail::Reroll, room), Decision::Flag);
    }

    #[tokio::test]
    async fn a_generation_of_one_picture_repeated_fails_distinct_after_its_first() {
        let dir = tempfile::tempdir().unwrap();
        let a = generation_png("a mug", 0, 0, 128, Weight::Flat);
        let b = generation_png("a mug", 1, 0, 128, Weight::Flat);
        let checks = [Check::Distinct { min_distance: 2 }];
        let mut outputs = Vec::new();
        for (i, bytes) in [&a, &b, &a].into_iter().enumerate() {
            let file = write(dir.path(), &format!("shot-{i}.png"), bytes);
            outputs.push(judge_file(&checks, &file, None, &Commands::default()).await);
        }
        // An output that could not be read, between them, is judged by none.
        outputs.insert(1, Judged::default());
        judge_generation(&checks, &mut outputs, &[]);
        let got: Vec<Outcome> = outputs.iter().map(|o| o.verdicts[0].1.outcome).collect();
        assert_eq!(
            got,
            [
                Outcome::Passed,
                Outcome::NotChecked,
                Outcome::Passed,
                Outcome::Failed
            ]
        );
    }

    #[test]
    fn a_failure_rerolls_only_while_the_task_and_the_rerolls_budget_allow() {
        let failed = [Verdict::judged(CheckName::Size, false, 0.0, "wrong".into())];
        let room = |rerolled, credits_left| RerollRoom {
            rerolled,
            max_rerolls: 2,
            price: 5,
            credits_left,
        };
        assert_eq!(
            decide(&failed, OnFail::Reroll, room(1, 5)),
            Decision::Reroll
        );
        assert_eq!(
            decide(&failed, OnFail::Reroll, room(2, 60)),
            Decision::Flag,
            "max_rerolls spent"
        );
        assert_eq!(
            decide(&failed, OnFail::Reroll, room(0, 4)),
            Decision::Flag,
            "max_credits spent"
        );
        assert_eq!(decide(&failed, OnFail::Fail, room(0, 60)), Decision::Fail);
        assert_eq!(decide(&failed, OnFail::Flag, room(0, 60)), Decision::Flag);
        let passed = [Verdict::judged(CheckName::Size, true, 1.0, "ok".into())];
        assert_eq!(decide(&passed, OnFail::Reroll, room(0, 60)), Decision::Keep);
        assert_eq!(set_aside_reason(&passed), None);
    }
}
