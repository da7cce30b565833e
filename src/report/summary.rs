//! A run's summary and status, from the record alone: what `run` and `resume` print when a
//! run ends, and what `status` shows at any time.

use serde::Serialize;

use crate::error::Error;
use crate::money::planned::unrecorded;
use crate::report::live::Process;
use crate::run_id::RunId;
use crate::store::{
    AmbiguousAttempt, CheckCounts, FlaggedOutput, Run, RunStatus, StepCounts, Store, TaskStatus,
    Totals,
};

/// Flagged outputs `status` lists, at most: the desk's "failed a check" filter has them all.
pub const FLAGGED_SHOWN: u32 = 10;

/// How a run stands: its tasks, credits, balance and failures.
#[derive(Serialize)]
pub struct Summary {
    pub run_id: RunId,
    pub pipeline: String,
    pub status: RunStatus,
    pub output_dir: String,
    pub manifest: String,
    #[serde(flatten)]
    pub totals: Totals,
    pub balance_before: Option<i64>,
    pub balance_after: Option<i64>,
    pub failures: Vec<Failure>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped: Option<String>,
    /// For a run recorded as `running`: whether its process is still going
    /// ([`crate::report::live`]); absent for other runs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub process: Option<Process>,
    /// The command that continues the run, when it is unfinished and not going.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub continue_with: Option<String>,
    /// The HTML report the run just wrote (`run --report`, or a part done as asked), so the
    /// summary says where to look; absent when none was written.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub report: Option<String>,
}

#[derive(Serialize)]
pub struct Failure {
    pub task: String,
    pub reason: String,
}

/// The summary, and per step counts, possibly billed attempts and superseded files.
#[derive(Serialize)]
pub struct Status {
    #[serde(flatten)]
    pub summary: Summary,
    pub steps: Vec<StepCounts>,
    pub ambiguous: Vec<AmbiguousAttempt>,
    /// Outputs moved under `_superseded/` (a task ran again, or a file was modified).
    pub superseded_files: u64,
    /// While the run goes: every process drawing from the rate limit of its account, the
    /// run's own included (they share the account's limit through the state database).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rate_drawers: Vec<crate::store::Drawer>,
    /// What the checks of a checked pipeline did; absent when nothing was judged.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checks: Option<Checks>,
}

/// A run's checks: their counts, and the first [`FLAGGED_SHOWN`] outputs they flagged, each
/// with its checks' verdicts.
#[derive(Serialize)]
pub struct Checks {
    #[serde(flatten)]
    pub counts: CheckCounts,
    pub flagged_outputs: Vec<FlaggedOutput>,
    /// Flagged outputs not listed.
    pub more_flagged: u64,
}

impl Checks {
    /// The checks of run `run_id`; `None` when it judged nothing. A bounded read: sums, and a
    /// few flagged outputs.
    pub async fn of(store: &Store, run_id: &RunId) -> Result<Option<Checks>, Error> {
        let counts = store.verdicts().counts(run_id).await?;
        if !counts.any() {
            return Ok(None);
        }
        let flagged_outputs = store.verdicts().flagged(run_id, FLAGGED_SHOWN).await?;
        let more_flagged = counts.flagged.saturating_sub(flagged_outputs.len() as u64);
        Ok(Some(Checks {
            counts,
            flagged_outputs,
            more_flagged,
        }))
    }
}

/// The summary of run `run_id`, which must be in `store`.
pub async fn summary_of(store: &Store, run_id: &RunId) -> Result<Summary, Error> {
    let run = run_row(store, run_id).await?;
    let steps = store.runs().step_counts(run_id).await?;
    let extras = unrecorded(&run.plan, |step| recorded_in(&steps, step));
    summary_from(store, run, &extras).await
}

async fn run_row(store: &Store, run_id: &RunId) -> Result<Run, Error> {
    store
        .runs()
        .get(run_id)
        .await?
        .ok_or_else(|| Error::usage(format!("no run {run_id}"), None))
}

fn recorded_in(steps: &[StepCounts], step: &str) -> u64 {
    steps.iter().find(|s| s.step == step).map_or(0, |s| s.tasks)
}

/// The summary of `run`, given the tasks it has not recorded yet.
async fn summary_from(
    store: &Store,
    run: Run,
    unrecorded: &[StepCounts],
) -> Result<Summary, Error> {
    let run_id = &run.id;
    let mut totals = store.runs().totals(run_id).await?;
    for step in unrecorded {
        totals.tasks += step.tasks;
        totals.pending += step.pending;
        totals.planned_credits += step.planned_credits;
    }
    let mut failures: Vec<Failure> = store
        .tasks()
        .with_status(run_id, Some(TaskStatus::Failed))
        .await?
        .into_iter()
        .map(|t| Failure {
            task: t.key.to_string(),
            reason: t.error.unwrap_or_default(),
        })
        .collect();
    store
        .outputs()
        .each(run_id, true, |o| {
            failures.push(Failure {
                task: format!("{} download", o.key()),
                reason: o.download_error.unwrap_or_default(),
            });
            Ok(())
        })
        .await?;
    let dir = run.dir();
    Ok(Summary {
        run_id: run.id.clone(),
        pipeline: run.pipeline_name,
        status: run.status,
        manifest: dir.manifest().to_string(),
        output_dir: dir.root().to_string(),
        totals,
        balance_before: run.balance_before,
        balance_after: run.balance_after,
        failures,
        stopped: run.stop_reason,
        process: None,
        continue_with: None,
        report: None,
    })
}

/// The status of `run`, as read from `store` (its status may be corrected first by
/// [`crate::report::live::observe`]).
pub async fn status_of(store: &Store, run: Run) -> Result<Status, Error> {
    let run_id = run.id.clone();
    let run_id = &run_id;
    let mut steps = store.runs().step_counts(run_id).await?;
    let extras = unrecorded(&run.plan, |step| recorded_in(&steps, step));
    let summary = summary_from(store, run, &extras).await?;
    for extra in extras {
        match steps.iter_mut().find(|s| s.step == extra.step) {
            Some(s) => {
                s.tasks += extra.tasks;
                s.pending += extra.pending;
                s.planned_credits += extra.planned_credits;
            }
            None => steps.push(extra),
        }
    }
    Ok(Status {
        summary,
        steps,
        ambiguous: store.runs().ambiguous_attempts(run_id).await?,
        superseded_files: store.runs().superseded_count(run_id).await?,
        rate_drawers: sharing_with(store, run_id).await?,
        checks: Checks::of(store, run_id).await?,
    })
}

/// The processes drawing from the rate limit of the accounts run `run_id` draws from now
/// (seen within the time a drawer is counted), itself included; none when it draws from none.
pub async fn sharing_with(
    store: &Store,
    run_id: &RunId,
) -> Result<Vec<crate::store::Drawer>, Error> {
    let since = crate::store::now_ms() - crate::exec::account_rate::STALE_AFTER_MS;
    let all = store.rates().drawers(since).await?;
    let accounts: Vec<String> = all
        .iter()
        .filter(|d| d.run_id == run_id.as_str())
        .map(|d| d.account.clone())
        .collect();
    Ok(all
        .into_iter()
        .filter(|d| accounts.contains(&d.account))
        .collect())
}
