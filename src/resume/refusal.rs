//! Why a run is not continued, decided from its records and what was asked: each "no" a
//! [`Refusal`] whose words are written here once. Nothing here touches the database; the
//! runner turns a refusal into its exit code (2 for what was asked wrongly, 3 for what it
//! would cost).

use crate::plan::Balance;
use crate::run_id::RunId;

/// A continuation refused before anything was paid for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// `imgpipe reroll` with `--items` or `--until`.
    RerollScoped,
    /// A run with finished tasks resumed on a new embedded sandbox, which lost their jobs.
    SandboxGone { run_id: RunId },
    /// The run's own copy of its pipeline file (needed to compare) no longer reads.
    CopyUnreadable { run_id: RunId },
    /// A reroll naming tasks the run does not have.
    Targets { run_id: RunId, message: String },
    /// A reroll the review cannot make (a target nothing can be paid for again).
    Reroll { message: String },
    /// The pipeline changed and `--allow-changes` was not given; `changes` says what changed.
    Changed { run_id: RunId, changes: String },
    /// What is left costs more than may be spent.
    OverCap {
        run_id: RunId,
        tasks: usize,
        needed: u64,
        cap: u64,
        limits: String,
    },
}

impl Refusal {
    /// Whether it is the command that is wrong (exit 2) rather than what it would cost (exit 3).
    pub fn is_usage(&self) -> bool {
        !matches!(self, Refusal::Changed { .. } | Refusal::OverCap { .. })
    }

    pub fn message(&self) -> String {
        match self {
            Refusal::RerollScoped => "a reroll pays for the tasks it names and what is downstream of them: --items and --until do not apply".to_owned(),
            Refusal::SandboxGone { run_id } => format!(
                "run {run_id} cannot be resumed on a new embedded sandbox: the jobs and URLs of its finished tasks ended with the sandbox that made them"
            ),
            Refusal::CopyUnreadable { run_id } => {
                format!("run {run_id} kept a copy of its pipeline file that no longer reads")
            }
            Refusal::Targets { message, .. } | Refusal::Reroll { message } => message.clone(),
            Refusal::Changed { run_id, changes } => {
                format!("the pipeline changed since run {run_id} started: {changes}")
            }
            Refusal::OverCap {
                run_id,
                tasks,
                needed,
                cap,
                limits,
            } => format!(
                "resuming run {run_id} would pay for {tasks} task(s), {needed} credits, but only {cap} may be spent ({limits})"
            ),
        }
    }

    pub fn hint(&self) -> Option<String> {
        let hint = match self {
            Refusal::RerollScoped | Refusal::Reroll { .. } => return None,
            Refusal::SandboxGone { .. } => {
                "for runs you mean to interrupt and resume, start `imgpipe sandbox` once and point IMGPIPE_BASE_URL at it; or start again with a new --run-id"
            }
            Refusal::CopyUnreadable { .. } => {
                "resume it with the file it started from, or start a new run"
            }
            Refusal::Targets { run_id, .. } => {
                return Some(format!("`imgpipe status {run_id}` lists the run's tasks"));
            }
            Refusal::Changed { .. } => {
                "resume with --allow-changes to keep the unchanged tasks' results and run the rest again, or give the new work another --run-id"
            }
            Refusal::OverCap { .. } => {
                "raise the budget (--max-credits or budget.max_credits) or top up the account, then resume"
            }
        };
        Some(hint.to_owned())
    }
}

/// What is known of a run before its lock is taken.
#[derive(Clone, Copy, Debug)]
pub struct Asked<'a> {
    pub run_id: &'a RunId,
    pub rerolling: bool,
    /// Whether `--items` or `--until` asked for a part of the run.
    pub part: bool,
    /// On a new embedded sandbox (`--sandbox`), with tasks of the run already succeeded.
    pub sandbox_with_finished: bool,
}

/// The refusals that need no plan: a reroll given a part, a run whose finished tasks' jobs
/// ended with the sandbox that made them.
pub fn before_lock(asked: Asked<'_>) -> Result<(), Refusal> {
    if asked.rerolling && asked.part {
        return Err(Refusal::RerollScoped);
    }
    if asked.sandbox_with_finished {
        return Err(Refusal::SandboxGone {
            run_id: asked.run_id.clone(),
        });
    }
    Ok(())
}

/// A changed pipeline continues only under `--allow-changes`.
pub fn changes(
    run_id: &RunId,
    changed: bool,
    allowed: bool,
    describe: impl FnOnce() -> String,
) -> Result<(), Refusal> {
    if !changed || allowed {
        return Ok(());
    }
    Err(Refusal::Changed {
        run_id: run_id.clone(),
        changes: describe(),
    })
}

/// What may be spent, and what it comes from.
#[derive(Clone, Copy, Debug)]
pub struct Cap<'a> {
    /// The budget left and the balance, the tighter; `None`: no limit.
    pub credits: Option<u64>,
    pub budget: Option<u64>,
    pub balance: &'a Balance,
}

/// Refuses what remains of a run (`tasks` tasks, `needed` credits) when it does not fit the
/// budget left or the balance.
pub fn over_cap(run_id: &RunId, tasks: usize, needed: u64, cap: Cap<'_>) -> Result<(), Refusal> {
    match cap.credits {
        Some(credits) if needed > credits => Err(Refusal::OverCap {
            run_id: run_id.clone(),
            tasks,
            needed,
            cap: credits,
            limits: limits(cap.budget, cap.balance),
        }),
        _ => Ok(()),
    }
}

/// The limits a cap comes from, as the refusal names them.
fn limits(budget: Option<u64>, balance: &Balance) -> String {
    let budget = budget.map_or_else(|| "no budget".to_owned(), |b| format!("budget {b}"));
    let balance = match balance {
        Balance::Known { credits, .. } => format!("balance {credits}"),
        _ => "balance unknown".to_owned(),
    };
    format!("{budget} less what the run spent, {balance}")
}

#[cfg(test)]
mod tests {
    use super::*;

    static R1: std::sync::LazyLock<RunId> = std::sync::LazyLock::new(|| RunId::from("r1"));

    fn asked(rerolling: bool, part: bool, sandbox_with_finished: bool) -> Asked<'static> {
        Asked {
            run_id: &R1,
            rerolling,
            part,
            sandbox_with_finished,
        }
    }

    #[test]
    fn before_the_lock_a_scoped_reroll_then_a_lost_sandbox_is_refused() {
        let table = [
            ((false, false, false), None),
            ((false, true, false), None),
            ((true, false, false), None),
            ((true, true, false), Some(Refusal::RerollScoped)),
            ((true, true, true), Some(Refusal::RerollScoped)),
            (
                (false, false, true),
                Some(Refusal::SandboxGone {
                    run_id: "r1".into(),
                }),
            ),
        ];
        for ((rerolling, part, sandbox), want) in table {
            let got = before_lock(asked(rerolling, part, sandbox)).err();
            assert_eq!(
                got, want,
                "reroll {rerolling}, part {part}, sandbox {sandbox}"
            );
        }
    }

    #[test]
    fn a_changed_pipeline_is_refused_unless_allowed_and_described_only_then() {
        let described = std::cell::Cell::new(0);
        let describe = || {
            described.set(described.get() + 1);
            "step(s) `big` added".to_owned()
        };
        assert_eq!(changes(&R1, false, false, describe), Ok(()));
        assert_eq!(changes(&R1, true, true, describe), Ok(()));
        assert_eq!(described.get(), 0);
        let refused = changes(&R1, true, false, describe).unwrap_err();
        assert_eq!(
            refused.message(),
            "the pipeline changed since run r1 started: step(s) `big` added"
        );
        assert!(!refused.is_usage(), "exit 3");
    }

    #[test]
    fn what_is_left_is_refused_only_past_the_cap() {
        let unknown = Balance::NotChecked;
        let cap = |credits| Cap {
            credits,
            budget: None,
            balance: &unknown,
        };
        assert_eq!(over_cap(&R1, 3, 30, cap(None)), Ok(()));
        assert_eq!(over_cap(&R1, 3, 30, cap(Some(30))), Ok(()));
        let refused = over_cap(&R1, 3, 31, cap(Some(30))).unwrap_err();
        assert_eq!(
            refused.message(),
            "resuming run r1 would pay for 3 task(s), 31 credits, but only 30 may be spent (no budget less what the run spent, balance unknown)"
        );
        assert!(!refused.is_usage());
        let known = Balance::Known {
            credits: 25,
            field: "balance".into(),
        };
        let cap = Cap {
            credits: Some(20),
            budget: Some(20),
            balance: &known,
        };
        let refused = over_cap(&R1, 1, 21, cap).unwrap_err();
        assert!(
            refused
                .message()
                .ends_with("(budget 20 less what the run spent, balance 25)")
        );
    }
}
