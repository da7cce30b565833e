//! Why a run is not continued, decided from its records and what was asked: each "no" a
//! [`Refusal`] whose words are written here once. Nothing here touches the database; the
//! runner turns a refusal into its exit code (2 for what was asked wrongly, 3 for what it
//! would cost).

use crate::money::limit::{Limit, Limiting};
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
    /// What is left, or what a reroll would pay again (`reroll`, what it names), costs more
    /// than the limit: `limit` credits may be spent, which `limiting` sets; `limits` names the
    /// budget and the balance.
    OverLimit {
        run_id: RunId,
        reroll: Option<String>,
        tasks: usize,
        needed: u64,
        limit: u64,
        limiting: Limiting,
        limits: String,
        /// What the continuation did for free before it was refused; `None` when it did
        /// nothing (a dry run).
        kept: Option<Kept>,
    },
}

/// What a continuation refused for money does first, free: lost answers read back by their
/// job ids, and outputs already paid for fetched and stored. Result URLs expire within the
/// hour: a refusal that waited for more money to keep them would lose what was paid for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Kept {
    /// Lost answers read back.
    pub answers: usize,
    /// Outputs paid for and stored now.
    pub outputs: usize,
}

impl Kept {
    /// Whether anything was kept: the run's record changed.
    pub fn any(self) -> bool {
        self.answers > 0 || self.outputs > 0
    }

    fn describe(self) -> String {
        let mut said = Vec::new();
        if self.answers > 0 {
            said.push(format!("read back {} lost answer(s)", self.answers));
        }
        if self.outputs > 0 {
            said.push(format!("kept {} output(s) already paid for", self.outputs));
        }
        said.push("nothing was spent".to_owned());
        said.join("; ")
    }
}

impl Refusal {
    /// Whether it is the command that is wrong (exit 2) rather than what it would cost (exit 3).
    pub fn is_usage(&self) -> bool {
        !matches!(self, Refusal::Changed { .. } | Refusal::OverLimit { .. })
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
            Refusal::OverLimit {
                run_id,
                reroll,
                tasks,
                needed,
                limit,
                limits,
                kept,
                ..
            } => {
                let doing = match reroll {
                    Some(named) => format!("rerolling {named} in run {run_id}"),
                    None => format!("resuming run {run_id}"),
                };
                let said = format!(
                    "{doing} would pay for {tasks} task(s), {}, but only {limit} may be spent ({limits})",
                    crate::money::credits(*needed)
                );
                match kept {
                    Some(kept) => format!("{said}; {}", kept.describe()),
                    None => said,
                }
            }
        }
    }

    /// The refusal as said once the continuation kept `kept` for free; other refusals are
    /// unchanged.
    #[must_use]
    pub fn keeping(mut self, done: Kept) -> Refusal {
        if let Refusal::OverLimit { kept, .. } = &mut self {
            *kept = Some(done);
        }
        self
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
            // A reroll refused changed nothing: resuming would not pay for it, repeating it does.
            Refusal::OverLimit {
                limiting, reroll, ..
            } => {
                let then = match reroll {
                    Some(_) => "then run the same reroll again",
                    None => "then resume",
                };
                return Some(format!("{}, {then}", limiting.remedy()));
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

/// Refuses what remains of a run (`tasks` tasks, `needed` credits) when it does not fit its
/// limit: the budget left or the balance.
pub fn over_limit(
    run_id: &RunId,
    reroll: Option<&str>,
    tasks: usize,
    needed: u64,
    limit: Limit<'_>,
) -> Result<(), Refusal> {
    match (limit.credits(), limit.limiting()) {
        (Some(credits), Some(limiting)) if needed > credits => Err(Refusal::OverLimit {
            run_id: run_id.clone(),
            reroll: reroll.map(str::to_owned),
            tasks,
            needed,
            limit: credits,
            limiting,
            limits: limit.describe(),
            kept: None,
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::money::limit::{Balance, Budget};

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

    fn budget_of(max_credits: u64) -> Budget {
        Budget {
            max_credits,
            source: "--max-credits".into(),
        }
    }

    #[test]
    fn what_is_left_is_refused_only_past_the_limit_with_a_hint_at_what_sets_it() {
        let unknown = Balance::NotChecked;
        let budget = budget_of;
        assert_eq!(
            over_limit(&R1, None, 3, 30, Limit::of(None, &unknown, 0)),
            Ok(())
        );
        let b40 = budget(40);
        let spent_10 = Limit::of(Some(&b40), &unknown, 10);
        assert_eq!(over_limit(&R1, None, 3, 30, spent_10), Ok(()));
        let refused = over_limit(&R1, None, 3, 31, spent_10).unwrap_err();
        assert_eq!(
            refused.message(),
            "resuming run r1 would pay for 3 task(s), 31 credits, but only 30 may be spent (budget 40 less what the run spent, balance unknown)"
        );
        assert_eq!(
            refused.hint().as_deref(),
            Some("raise the budget (--max-credits or budget.max_credits), then resume")
        );
        assert!(!refused.is_usage());
        let known = Balance::Known {
            credits: 25,
            field: "balance".into(),
        };
        let refused = over_limit(&R1, None, 3, 31, Limit::of(None, &known, 10)).unwrap_err();
        assert!(refused.message().ends_with("(no budget, balance 25)"));
        assert_eq!(
            refused.hint().as_deref(),
            Some("top up the account, then resume")
        );
        let b20 = budget(20);
        let refused = over_limit(&R1, None, 1, 21, Limit::of(Some(&b20), &known, 0)).unwrap_err();
        assert!(
            refused
                .message()
                .ends_with("(budget 20 less what the run spent, balance 25)")
        );
        let rerolling = over_limit(&R1, Some("lamp/shot"), 3, 31, Limit::of(None, &known, 10));
        let rerolling = rerolling.unwrap_err();
        assert_eq!(
            rerolling.message(),
            "rerolling lamp/shot in run r1 would pay for 3 task(s), 31 credits, but only 25 may be spent (no budget, balance 25)"
        );
        assert_eq!(
            rerolling.hint().as_deref(),
            Some("top up the account, then run the same reroll again")
        );
        let b35 = budget(35);
        let both = over_limit(&R1, None, 1, 26, Limit::of(Some(&b35), &known, 10)).unwrap_err();
        assert_eq!(
            both.hint().as_deref(),
            Some(
                "raise the budget (--max-credits or budget.max_credits) and top up the account, then resume"
            )
        );
    }

    #[test]
    fn a_refusal_over_the_limit_says_what_it_kept_for_free() {
        let b40 = budget_of(40);
        let unknown = Balance::NotChecked;
        let refused =
            over_limit(&R1, None, 3, 31, Limit::of(Some(&b40), &unknown, 10)).unwrap_err();
        let said = "resuming run r1 would pay for 3 task(s), 31 credits, but only 30 may be spent (budget 40 less what the run spent, balance unknown)";
        let table = [
            ((0, 0), "nothing was spent"),
            (
                (0, 2),
                "kept 2 output(s) already paid for; nothing was spent",
            ),
            (
                (1, 1),
                "read back 1 lost answer(s); kept 1 output(s) already paid for; nothing was spent",
            ),
        ];
        for ((answers, outputs), kept) in table {
            let k = Kept { answers, outputs };
            assert_eq!(k.any(), answers + outputs > 0);
            let message = refused.clone().keeping(k).message();
            assert_eq!(message, format!("{said}; {kept}"));
        }
        let other = Refusal::RerollScoped;
        assert_eq!(other.clone().keeping(Kept::default()), other);
    }
}
