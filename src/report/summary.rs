//! A run's summary and status, from the record alone: what `run` and `resume` print when a
//! run ends, and what `status` shows at any time.

use serde::Serialize;

use crate::error::Error;
use crate::report::live::Process;
use crate::store::{AmbiguousAttempt, RunRow, StepCounts, Store, TaskStatus, Totals};
use crate::task_key::TaskKey;

/// How a run stands: its tasks, credits, balance and failures.
#[derive(Serialize)]
pub struct Summary {
    pub run_id: String,
    pub pipeline: String,
    pub status: &'static str,
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
}

/// The summary of run `run_id`, which must be in `store`.
pub async fn summary_of(store: &Store, run_id: &str) -> Result<Summary, Error> {
    let run = run_row(store, run_id).await?;
    let steps = store.step_counts(run_id).await?;
    let extras = unrecorded(&run.plan_json, |step| recorded_in(&steps, step));
    summary_from(store, run, &extras).await
}

async fn run_row(store: &Store, run_id: &str) -> Result<RunRow, Error> {
    store
        .run(run_id)
        .await?
        .ok_or_else(|| Error::usage(format!("no run {run_id}"), None))
}

fn recorded_in(steps: &[StepCounts], step: &str) -> u64 {
    steps.iter().find(|s| s.step == step).map_or(0, |s| s.tasks)
}

/// The summary of `run`, given the tasks it has not recorded yet.
async fn summary_from(
    store: &Store,
    run: RunRow,
    unrecorded: &[StepCounts],
) -> Result<Summary, Error> {
    let run_id = run.id.as_str();
    let mut totals = store.totals(run_id).await?;
    for step in unrecorded {
        totals.tasks += step.tasks;
        totals.pending += step.pending;
        totals.planned_credits += step.planned_credits;
    }
    let mut failures: Vec<Failure> = store
        .tasks_where(run_id, Some(TaskStatus::Failed))
        .await?
        .into_iter()
        .map(|t| Failure {
            task: TaskKey::new(t.item, t.step, t.idx).to_string(),
            reason: t.error.unwrap_or_default(),
        })
        .collect();
    store
        .each_output(run_id, true, |o| {
            failures.push(Failure {
                task: format!("{} download", TaskKey::new(o.item, o.step, o.idx + o.k)),
                reason: o.download_error.unwrap_or_default(),
            });
            Ok(())
        })
        .await?;
    let dir = run.dir();
    Ok(Summary {
        run_id: run.id.clone(),
        pipeline: run.pipeline_name,
        status: run.status.as_str(),
        manifest: dir.manifest().to_string(),
        output_dir: dir.root().to_string(),
        totals,
        balance_before: run.balance_before,
        balance_after: run.balance_after,
        failures,
        stopped: run.stop_reason,
        process: None,
        continue_with: None,
    })
}

/// The status of `run`, as read from `store` (its status may be corrected first by
/// [`crate::report::live::observe`]).
pub async fn status_of(store: &Store, run: RunRow) -> Result<Status, Error> {
    let run_id = run.id.clone();
    let run_id = run_id.as_str();
    let mut steps = store.step_counts(run_id).await?;
    let extras = unrecorded(&run.plan_json, |step| recorded_in(&steps, step));
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
        ambiguous: store.ambiguous_attempts(run_id).await?,
        superseded_files: store.superseded_count(run_id).await?,
    })
}

/// The tasks the run has not recorded yet, per step: a run records an item's tasks only as
/// it comes near the item, so those of items it has not reached are counted from its plan.
/// They are all pending. `recorded(step)`: the step's tasks the run has recorded.
pub(crate) fn unrecorded(plan_json: &str, recorded: impl Fn(&str) -> u64) -> Vec<StepCounts> {
    let plan = serde_json::from_str::<serde_json::Value>(plan_json).unwrap_or_default();
    let Some(steps) = plan.pointer("/costs/steps").and_then(|s| s.as_array()) else {
        return Vec::new();
    };
    steps
        .iter()
        .filter_map(|s| {
            let step = s.get("step")?.as_str()?;
            let planned = s.get("tasks")?.as_u64()?;
            let have = recorded(step);
            let missing = planned.checked_sub(have).filter(|m| *m > 0)?;
            let price = s
                .get("credits_per_task")
                .and_then(|c| c.as_u64())
                .unwrap_or(0);
            Some(StepCounts {
                step: step.to_owned(),
                tasks: missing,
                succeeded: 0,
                failed: 0,
                blocked: 0,
                pending: missing,
                planned_credits: missing * price,
                billed_credits: 0,
            })
        })
        .collect()
}
