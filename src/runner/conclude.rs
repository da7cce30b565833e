//! How a run's end is recorded and told: a pure decision (which status, which exit) from what
//! the executor says and the record's totals, then the words of each exit, in one place.

use crate::error::Error;
use crate::exec::{Outcome, Stop};
use crate::run_id::RunId;
use crate::store::{RunStatus, Totals, Undone};

/// What the decision reads of a run's end.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Ended {
    pub interrupted: bool,
    /// The executor stopped the run itself ([`Stop`]).
    pub stopped: bool,
    /// Tasks left pending because they are outside the part asked for.
    pub held: usize,
    pub failed: u64,
    pub blocked: u64,
    pub pending: u64,
    pub download_failures: u64,
}

impl Ended {
    pub(super) fn of(outcome: &Outcome, totals: &Totals) -> Ended {
        Ended {
            interrupted: outcome.interrupted,
            stopped: outcome.stop.is_some(),
            held: outcome.held,
            failed: totals.failed,
            blocked: totals.blocked,
            pending: totals.pending,
            download_failures: totals.download_failures,
        }
    }
}

/// How the command exits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Exit {
    /// SIGINT/SIGTERM: everything done so far is recorded.
    Interrupted,
    /// The executor stopped the run: the words are its [`Stop`]'s.
    Stopped,
    /// Only the part asked for was done, and done well: the rest waits, as asked.
    PartDone,
    /// Tasks or downloads failed, or were blocked by a failure.
    TasksFailed,
    Success,
}

/// The status a run's end is recorded with, and the exit the command makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Verdict {
    pub status: RunStatus,
    pub exit: Exit,
}

/// Decides how a run ended. A run with tasks still pending (and none failed) is recorded
/// failed, yet exits 0: nothing went wrong in this process.
pub(super) fn verdict(e: Ended) -> Verdict {
    let troubled = e.failed > 0 || e.download_failures > 0 || e.blocked > 0;
    let (status, exit) = if e.interrupted {
        (RunStatus::Interrupted, Exit::Interrupted)
    } else if e.stopped {
        (RunStatus::Stopped, Exit::Stopped)
    } else if e.held > 0 && !troubled {
        (RunStatus::Stopped, Exit::PartDone)
    } else if troubled {
        (RunStatus::Failed, Exit::TasksFailed)
    } else if e.pending > 0 {
        (RunStatus::Failed, Exit::Success)
    } else {
        (RunStatus::Succeeded, Exit::Success)
    };
    Verdict { status, exit }
}

/// What a part done as asked records as its stop reason.
pub(super) fn done_as_asked(said: &str, held: usize) -> String {
    format!("{said} is done as asked; {held} task(s) left pending")
}

/// What the words of an exit name.
pub(super) struct Words<'a> {
    /// The command that continues the run (the part asked for, when one was).
    pub resume: &'a str,
    /// The command that continues all of the run.
    pub rest: &'a str,
    /// The report written, if it was.
    pub report: Option<&'a str>,
    /// The part asked for (`--items`, `--until`), as said.
    pub said: &'a str,
    pub held: usize,
    pub totals: &'a Totals,
}

impl Exit {
    /// The error the exit needs, with its words; `stop` is the executor's.
    pub(super) fn into_result(self, stop: Option<Stop>, w: &Words<'_>) -> Result<(), Error> {
        let resume = w.resume;
        match (self, stop) {
            // A stop is always named by the executor that stopped.
            (Exit::Success, _) | (Exit::Stopped, None) => Ok(()),
            (Exit::Interrupted, _) => Err(Error::Interrupted {
                detail: Some(format!(
                    "everything done so far is recorded; continue with: {resume}"
                )),
            }),
            (Exit::Stopped, Some(stop)) => Err(stopped(stop, w)),
            (Exit::PartDone, _) => Err(Error::PartDone {
                message: done_as_asked(w.said, w.held),
                hint: format!(
                    "look at the report ({}), then pay for the rest with: {}",
                    w.report.unwrap_or("`imgpipe report RUN_ID` writes it"),
                    w.rest
                ),
            }),
            (Exit::TasksFailed, _) => Err(Error::TasksFailed {
                message: format!(
                    "{} task(s) failed, {} blocked by them, {} download(s) failed; see the summary above\nhint: `{resume} --dry-run` lists what resuming would pay for again; `{resume}` does it",
                    w.totals.failed, w.totals.blocked, w.totals.download_failures
                ),
            }),
        }
    }
}

/// The error of a reroll undone ([`crate::resume::undo_reroll`]): why it could not be done,
/// with the exit code of that cause (2 for a call the service refused as invalid, 3 for the
/// balance or the budget, 6 for a cap, 130 when interrupted), and that nothing changed.
pub(super) fn undone(said: &str, run_id: &RunId, undone: &Undone, outcome: &Outcome) -> Error {
    let stop = outcome.stop.as_ref();
    let why = match (&undone.failed, stop) {
        (Some((key, error)), _) => format!("{key}: {}", error.as_deref().unwrap_or_default()),
        (None, Some(stop)) => stop.describe(),
        (None, None) if outcome.interrupted => "interrupted before any call was billed".into(),
        (None, None) => "none of its calls was done".into(),
    };
    let message = format!("the reroll of {said} could not be done: {why}");
    let hint = format!(
        "nothing was billed and nothing changed: run {run_id} is {} as before, its files where they were",
        undone.status
    );
    match (outcome.interrupted, undone.http_status, stop) {
        (true, ..) => Error::Interrupted {
            detail: Some(format!("{message}\nhint: {hint}")),
        },
        (_, Some(400 | 422), _) => Error::Usage {
            message,
            hint: Some(hint),
        },
        (_, Some(402), _) | (_, _, Some(Stop::Balance(_) | Stop::Limit { .. })) => Error::Refused {
            message,
            hint: Some(hint),
        },
        (_, _, Some(Stop::Cap(_) | Stop::LeaseLost)) => Error::CapSpent { message, hint },
        _ => Error::Other(anyhow::anyhow!("{message}\nhint: {hint}")),
    }
}

/// The error of a run the executor stopped.
fn stopped(stop: Stop, w: &Words<'_>) -> Error {
    let resume = w.resume;
    match stop {
        Stop::Storage { place, error } => Error::StorageFailed {
            message: format!(
                "the run stopped: outputs cannot be written to {place}: {error}\nno call was sent after that; the calls in flight then finished and are recorded"
            ),
            hint: format!(
                "{} paid output(s) are not stored; once {place} can be written again (free space, restore the permission), `{resume}` fetches them from their jobs without paying for them again, then goes on with the rest",
                w.totals.outputs.saturating_sub(w.totals.downloaded)
            ),
        },
        Stop::Fatal(cause) => Error::Stopped {
            cause,
            continue_with: resume.to_owned(),
        },
        stop @ (Stop::Cap(_) | Stop::LeaseLost) => Error::CapSpent {
            message: format!("the run stopped: {}", stop.describe()),
            hint: format!(
                "run the same command again in the next window (or `{resume}`): it continues without paying twice"
            ),
        },
        stop => Error::Refused {
            message: format!("the run stopped: {}", stop.describe()),
            hint: Some(format!(
                "raise the budget or top up the account, then continue with: {resume}"
            )),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_status_and_the_exit_follow_the_end_in_order_of_precedence() {
        let e = Ended::default();
        let table = [
            (e, RunStatus::Succeeded, Exit::Success),
            (Ended { pending: 2, ..e }, RunStatus::Failed, Exit::Success),
            (
                Ended { failed: 1, ..e },
                RunStatus::Failed,
                Exit::TasksFailed,
            ),
            (
                Ended { blocked: 1, ..e },
                RunStatus::Failed,
                Exit::TasksFailed,
            ),
            (
                Ended {
                    download_failures: 1,
                    ..e
                },
                RunStatus::Failed,
                Exit::TasksFailed,
            ),
            (Ended { held: 3, ..e }, RunStatus::Stopped, Exit::PartDone),
            (
                Ended {
                    held: 3,
                    pending: 3,
                    ..e
                },
                RunStatus::Stopped,
                Exit::PartDone,
            ),
            // A part with failures is not done as asked.
            (
                Ended {
                    held: 3,
                    failed: 1,
                    ..e
                },
                RunStatus::Failed,
                Exit::TasksFailed,
            ),
            (
                Ended {
                    stopped: true,
                    held: 3,
                    failed: 1,
                    ..e
                },
                RunStatus::Stopped,
                Exit::Stopped,
            ),
            (
                Ended {
                    interrupted: true,
                    stopped: true,
                    failed: 1,
                    ..e
                },
                RunStatus::Interrupted,
                Exit::Interrupted,
            ),
        ];
        for (ended, status, exit) in table {
            assert_eq!(verdict(ended), Verdict { status, exit }, "{ended:?}");
        }
    }

    #[test]
    fn each_exit_has_its_code_and_words() {
        let totals = Totals {
            failed: 2,
            blocked: 1,
            download_failures: 0,
            outputs: 5,
            downloaded: 3,
            ..Totals::default()
        };
        let w = Words {
            resume: "imgpipe resume r1",
            rest: "imgpipe resume r1 --all",
            report: None,
            said: "--items a",
            held: 4,
            totals: &totals,
        };
        let err = |exit: Exit, stop| exit.into_result(stop, &w).unwrap_err();
        assert!(Exit::Success.into_result(None, &w).is_ok());
        let failed = err(Exit::TasksFailed, None);
        assert_eq!(failed.exit_code(), crate::error::exit::TASKS_FAILED);
        assert!(
            failed
                .to_string()
                .starts_with("2 task(s) failed, 1 blocked by them, 0 download(s) failed")
        );
        let part = err(Exit::PartDone, None);
        assert_eq!(part.exit_code(), crate::error::exit::PART_DONE);
        assert_eq!(
            part.to_string(),
            "--items a is done as asked; 4 task(s) left pending\nhint: look at the report (`imgpipe report RUN_ID` writes it), then pay for the rest with: imgpipe resume r1 --all"
        );
        let interrupted = err(Exit::Interrupted, None);
        assert_eq!(interrupted.exit_code(), crate::error::exit::INTERRUPTED);
        let storage = Stop::Storage {
            place: "out".into(),
            error: "disk full".into(),
        };
        let storage = err(Exit::Stopped, Some(storage));
        assert!(
            storage
                .to_string()
                .contains("hint: 2 paid output(s) are not stored")
        );
        let budget = Stop::Limit { needed: 9, left: 2 };
        let budget = err(Exit::Stopped, Some(budget));
        assert_eq!(budget.exit_code(), crate::error::exit::CREDITS);
        assert!(budget.to_string().ends_with(
            "hint: raise the budget or top up the account, then continue with: imgpipe resume r1"
        ));
        let lease = err(Exit::Stopped, Some(Stop::LeaseLost));
        assert!(matches!(lease, Error::CapSpent { .. }));
    }
}
