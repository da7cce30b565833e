//! A run's summary and status, from the record alone: what `run` and `resume` print when a
//! run ends, and what `status` shows at any time.

use serde::Serialize;

use crate::error::Error;
use crate::store::{AmbiguousAttempt, StepCounts, Store, TaskStatus, Totals};

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
    let run = store
        .run(run_id)
        .await?
        .ok_or_else(|| Error::usage(format!("no run {run_id}"), None))?;
    let totals = store.totals(run_id).await?;
    let mut failures: Vec<Failure> = store
        .tasks_where(run_id, Some(TaskStatus::Failed))
        .await?
        .into_iter()
        .map(|t| Failure {
            task: format!("{}/{}[{}]", t.item, t.step, t.idx),
            reason: t.error.unwrap_or_default(),
        })
        .collect();
    store
        .each_output(run_id, true, |o| {
            failures.push(Failure {
                task: format!("{}/{}[{}] download", o.item, o.step, o.idx + o.k),
                reason: o.download_error.unwrap_or_default(),
            });
            Ok(())
        })
        .await?;
    let dir = run.dir();
    Ok(Summary {
        run_id: run_id.to_owned(),
        pipeline: run.pipeline_name,
        status: run.status.as_str(),
        manifest: crate::layout::RunDir::at(&dir)
            .manifest()
            .display()
            .to_string(),
        output_dir: dir.display().to_string(),
        totals,
        balance_before: run.balance_before,
        balance_after: run.balance_after,
        failures,
        stopped: run.stop_reason,
    })
}

/// The status of run `run_id`, which must be in `store`.
pub async fn status_of(store: &Store, run_id: &str) -> Result<Status, Error> {
    Ok(Status {
        summary: summary_of(store, run_id).await?,
        steps: store.step_counts(run_id).await?,
        ambiguous: store.ambiguous_attempts(run_id).await?,
        superseded_files: store.superseded_count(run_id).await?,
    })
}
