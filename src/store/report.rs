//! What the run report reads beyond the executor's own queries: every task with its inputs
//! (lineage), the removed ones (their cost stays on record), and the billed calls over time.

use sqlx::Row;

use crate::store::tasks::{TaskStatus, to_u64};
use crate::store::{Store, StoreError};

/// A task as the report shows it.
#[derive(Clone, Debug)]
pub struct ReportTask {
    pub id: i64,
    pub item: String,
    pub step: String,
    pub idx: u32,
    pub operation: String,
    /// `item/step[index]` references to other tasks' outputs, or URLs the pipeline wrote.
    pub inputs: Vec<String>,
    pub status: TaskStatus,
    pub planned_credits: u64,
    pub credits_billed: u64,
    pub job_id: Option<String>,
    pub error: Option<String>,
    /// Dropped from the pipeline by `--allow-changes`: only its cost is shown.
    pub removed: bool,
    /// The earlier run whose outputs it took (`--reuse`).
    pub reused_from_run: Option<String>,
    pub attempts: u32,
}

/// One billed call: when its answer arrived and what it cost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Spend {
    pub at: i64,
    pub credits: u64,
}

impl Store {
    /// Every task of the run, removed ones included, in the order they were recorded.
    pub async fn report_tasks(&self, run_id: &str) -> Result<Vec<ReportTask>, StoreError> {
        let rows = sqlx::query(
            "SELECT t.id, t.item, t.step, t.idx, t.operation, t.inputs, t.status,
                    t.planned_credits, t.credits_billed, t.job_id, t.error,
                    t.removed_at IS NOT NULL AS removed, r.run_id AS reused_run,
                    (SELECT COUNT(*) FROM attempts a WHERE a.task_id = t.id) AS attempts
             FROM tasks t LEFT JOIN tasks r ON r.id = t.reused_from
             WHERE t.run_id = ? ORDER BY t.id",
        )
        .bind(run_id)
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| {
                let inputs: String = r.try_get("inputs")?;
                Ok(ReportTask {
                    id: r.try_get("id")?,
                    item: r.try_get("item")?,
                    step: r.try_get("step")?,
                    idx: u32::try_from(r.try_get::<i64, _>("idx")?).unwrap_or(0),
                    operation: r.try_get("operation")?,
                    inputs: serde_json::from_str(&inputs).unwrap_or_default(),
                    status: TaskStatus::parse(r.try_get("status")?),
                    planned_credits: to_u64(r.try_get("planned_credits")?),
                    credits_billed: to_u64(r.try_get("credits_billed")?),
                    job_id: r.try_get("job_id")?,
                    error: r.try_get("error")?,
                    removed: r.try_get("removed")?,
                    reused_from_run: r.try_get("reused_run")?,
                    attempts: u32::try_from(r.try_get::<i64, _>("attempts")?).unwrap_or(0),
                })
            })
            .collect()
    }

    /// Every call of the run that billed credits, in the order the answers arrived.
    pub async fn spend(&self, run_id: &str) -> Result<Vec<Spend>, StoreError> {
        let rows: Vec<(i64, i64)> = sqlx::query_as(
            "SELECT COALESCE(finished_at, started_at), credits_billed FROM attempts
             WHERE run_id = ? AND credits_billed > 0 ORDER BY 1, id",
        )
        .bind(run_id)
        .fetch_all(self.pool())
        .await?;
        Ok(rows
            .into_iter()
            .map(|(at, credits)| Spend {
                at,
                credits: to_u64(credits),
            })
            .collect())
    }

    /// The balance the service reported with the run's latest answer, if any did.
    pub async fn last_reported_balance(&self, run_id: &str) -> Result<Option<i64>, StoreError> {
        let row: Option<(i64,)> = sqlx::query_as(
            "SELECT credits_remaining FROM attempts
             WHERE run_id = ? AND credits_remaining IS NOT NULL
             ORDER BY finished_at DESC, id DESC LIMIT 1",
        )
        .bind(run_id)
        .fetch_optional(self.pool())
        .await?;
        Ok(row.map(|(b,)| b))
    }
}
