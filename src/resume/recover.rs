//! Lost answers read back: a call whose answer was cut after it named its job is read back by
//! that job's id, for free, before anything is paid again.

use std::collections::HashSet;
use std::time::Duration;

use crate::api::job_id::JobId;
use crate::api::types::STATUS_SUCCEEDED;
use crate::api::{ApiError, Client, JobRecord, RetryPolicy};
use crate::plan::graph::{Graph, Source};
use crate::plan::rows::RowIds;
use crate::run_id::RunId;
use crate::store::{AttemptOutcome, Settled, Store, StoreError, TaskId};

use super::{Prepared, Recover, records};

/// Tries at reading back a lost answer's job. The job is paid for and the alternative is to pay
/// again, so a passing failure (a 429, a server error, a lost connection) is waited out.
const READ_BACK: RetryPolicy = RetryPolicy::new(5, Duration::from_millis(500));

async fn read_back(client: &Client, job_id: &JobId) -> Result<JobRecord, ApiError> {
    crate::api::retry::free_call(READ_BACK, || client.job(job_id)).await
}

impl Prepared {
    /// The first free part of a continuation refused for money: every lost answer whose job
    /// is known read back, as [`Prepared::apply`] would before paying. Gives how many were;
    /// each is a task no longer to pay for, so the run, reviewed again, may then fit.
    pub async fn read_back(&self, store: &Store, client: &Client) -> Result<usize, StoreError> {
        if self.review.recover.is_empty() {
            return Ok(0);
        }
        store.attempts().settle_orphaned(&self.row.id).await?;
        let read;
        let rows = match &self.review.rows {
            Some(rows) => rows,
            None => {
                read = records::row_ids(store, &self.row.id, &self.graph).await?;
                &read
            }
        };
        let (id, graph) = (&self.row.id, &self.graph);
        let found = read_back_all(store, client, id, graph, &self.review.recover, rows).await?;
        Ok(found.len())
    }
}

/// Reads back each of `lost`; gives the row ids of the tasks found succeeded.
pub(super) async fn read_back_all(
    store: &Store,
    client: &Client,
    run_id: &RunId,
    graph: &Graph,
    lost: &[Recover],
    rows: &RowIds,
) -> Result<HashSet<TaskId>, StoreError> {
    let mut recovered = HashSet::new();
    for r in lost {
        if recover(store, client, run_id, graph, r, rows).await? {
            recovered.extend(rows.get(r.task));
        }
    }
    Ok(recovered)
}

/// Reads back a lost call's job; records it as the attempt's answer when it succeeded. Each
/// answer is recorded on its own, as the executor records a call's: a fact that holds
/// whatever happens next (a resume killed after it finds the task succeeded).
async fn recover(
    store: &Store,
    client: &Client,
    run_id: &RunId,
    graph: &Graph,
    r: &Recover,
    rows: &RowIds,
) -> Result<bool, StoreError> {
    // A lost answer is read back only for a recorded task.
    let Some(task_id) = rows.get(r.task) else {
        return Ok(false);
    };
    let job = match read_back(client, &r.job_id).await {
        Ok(job) => job,
        Err(e) => {
            tracing::warn!(job = %r.job_id, "cannot read back a lost answer: {}", client.redact(&e.to_string()));
            return Ok(false);
        }
    };
    let urls = job.image_urls();
    let expected = graph.outputs(r.task) as usize;
    if job.status() != Some(STATUS_SUCCEEDED) || urls.len() < expected {
        return Ok(false);
    }
    let note = format!(
        "the answer was lost; recovered on resume from GET /v1/jobs/{}",
        r.job_id
    );
    // The lineage, as the call would have recorded it: the job of the output it read.
    let upstream = graph.work(r.task).ok().and_then(|work| {
        work.sources().into_iter().find_map(|s| match s {
            Source::Output { task, .. } => Some(*task),
            Source::Url(_) => None,
        })
    });
    let parent = match upstream.and_then(|u| rows.get(u)) {
        Some(id) => store.kept().job_of_task(id).await?,
        None => None,
    };
    store
        .attempts()
        .finish(
            run_id,
            task_id,
            r.attempt_id,
            &AttemptOutcome::Succeeded(Settled {
                job_id: &r.job_id,
                credits_used: job.credits_used().unwrap_or(graph.task(r.task).planned),
                credits_remaining: None,
                urls: &urls,
                parent_job_id: parent.as_ref(),
                note: Some(&note),
            }),
        )
        .await?;
    tracing::info!(job = %r.job_id, "recovered a lost answer by its job id; not paid for again");
    Ok(true)
}
