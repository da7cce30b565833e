//! Runs: one row per `imgpipe run`, holding the pipeline text and the plan it started from.

use sqlx::Row;

use crate::place::{Address, RunDir};
use crate::store::{Store, StoreError, now_ms};
use crate::task_key::TaskKey;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunStatus {
    Running,
    /// Every task succeeded and every output is on disk.
    Succeeded,
    /// Finished, with failed tasks or downloads.
    Failed,
    /// Stopped by SIGINT/SIGTERM. A crash records nothing, so the record still says
    /// `running`; the report (its `live::observe`) tells that run as `interrupted`.
    Interrupted,
    /// Stopped by imgpipe itself: out of budget or balance, or prices above the plan.
    Stopped,
}

impl RunStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Running => "running",
            RunStatus::Succeeded => "succeeded",
            RunStatus::Failed => "failed",
            RunStatus::Interrupted => "interrupted",
            RunStatus::Stopped => "stopped",
        }
    }

    /// Whether `resume` would continue a run in this status: it is neither finished nor
    /// going (a `running` status being that of a live process, once observed).
    pub fn unfinished(self) -> bool {
        !matches!(self, RunStatus::Succeeded | RunStatus::Running)
    }

    pub fn parse(s: &str) -> Option<RunStatus> {
        Some(match s {
            "running" => RunStatus::Running,
            "succeeded" => RunStatus::Succeeded,
            "failed" => RunStatus::Failed,
            "interrupted" => RunStatus::Interrupted,
            "stopped" => RunStatus::Stopped,
            _ => return None,
        })
    }
}

/// What a run starts with.
pub struct NewRun<'a> {
    pub id: &'a str,
    pub pipeline_name: &'a str,
    pub pipeline_file: &'a str,
    pub pipeline_text: &'a str,
    pub pipeline_sha256: &'a str,
    pub items_sha256: &'a str,
    pub plan_json: &'a str,
    pub output_dir: &'a str,
    pub credits_planned: u64,
    pub balance_before: Option<i64>,
}

#[derive(Clone, Debug)]
pub struct RunRow {
    pub id: String,
    pub pipeline_name: String,
    pub pipeline_file: String,
    /// The run's own copy of its pipeline file.
    pub pipeline_text: String,
    pub pipeline_sha256: String,
    pub items_sha256: String,
    pub plan_json: String,
    pub output_dir: String,
    pub status: RunStatus,
    pub credits_planned: u64,
    pub balance_before: Option<i64>,
    pub balance_after: Option<i64>,
    pub stop_reason: Option<String>,
    pub created_at: i64,
    pub finished_at: Option<i64>,
}

impl RunRow {
    /// The run's own directory: its outputs, manifest and report.
    pub fn dir(&self) -> RunDir {
        RunDir::new(&Address::recorded(&self.output_dir), &self.id)
    }
}

impl Store {
    /// Records a run with its tasks, in one transaction: a run is never recorded without them.
    pub async fn create_run(
        &self,
        run: &NewRun<'_>,
        tasks: &[crate::store::NewTask],
    ) -> Result<(), StoreError> {
        let mut tx = self.pool().begin().await?;
        sqlx::query(
            "INSERT INTO runs (id, pipeline_name, pipeline_file, pipeline_text, pipeline_sha256,
                 items_sha256, plan_json, output_dir, status, credits_planned, balance_before,
                 created_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'running', $9, $10, $11)",
        )
        .bind(run.id)
        .bind(run.pipeline_name)
        .bind(run.pipeline_file)
        .bind(run.pipeline_text)
        .bind(run.pipeline_sha256)
        .bind(run.items_sha256)
        .bind(run.plan_json)
        .bind(run.output_dir)
        .bind(i64::try_from(run.credits_planned).unwrap_or(i64::MAX))
        .bind(run.balance_before)
        .bind(now_ms())
        .execute(&mut *tx)
        .await?;
        crate::store::tasks::insert_tasks(&mut tx, self.backend(), run.id, tasks).await?;
        tx.commit().await?;
        Ok(())
    }

    pub async fn run(&self, id: &str) -> Result<Option<RunRow>, StoreError> {
        let row = sqlx::query(
            "SELECT id, pipeline_name, pipeline_file, pipeline_text, pipeline_sha256, items_sha256,
                    plan_json, output_dir, status, credits_planned, balance_before,
                    balance_after, stop_reason, created_at, finished_at
             FROM runs WHERE id = $1",
        )
        .bind(id)
        .fetch_optional(self.pool())
        .await?;
        row.as_ref().map(run_row).transpose()
    }

    /// Every run, the latest first, without their pipeline text and plan.
    pub async fn runs(&self) -> Result<Vec<RunRow>, StoreError> {
        let rows = sqlx::query(
            "SELECT id, pipeline_name, pipeline_file, '' AS pipeline_text, pipeline_sha256,
                    items_sha256, '' AS plan_json, output_dir, status, credits_planned,
                    balance_before, balance_after, stop_reason, created_at, finished_at
             FROM runs ORDER BY created_at DESC, id DESC",
        )
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(run_row).collect()
    }

    /// Adopts a changed pipeline file (`--allow-changes`): the run keeps the new copy.
    pub async fn update_run_source(
        &self,
        id: &str,
        text: &str,
        sha256: &str,
        items_sha256: &str,
        plan_json: &str,
        credits_planned: u64,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE runs SET pipeline_text = $1, pipeline_sha256 = $2, items_sha256 = $3,
                 plan_json = $4, credits_planned = $5
             WHERE id = $6",
        )
        .bind(text)
        .bind(sha256)
        .bind(items_sha256)
        .bind(plan_json)
        .bind(i64::try_from(credits_planned).unwrap_or(i64::MAX))
        .bind(id)
        .execute(self.pool())
        .await?;
        Ok(())
    }

    /// Records the run's plan anew, once the generation price was discovered: the tasks not
    /// recorded yet are counted from it.
    pub async fn set_run_plan(
        &self,
        id: &str,
        plan_json: &str,
        credits_planned: u64,
    ) -> Result<(), StoreError> {
        sqlx::query("UPDATE runs SET plan_json = $1, credits_planned = $2 WHERE id = $3")
            .bind(plan_json)
            .bind(i64::try_from(credits_planned).unwrap_or(i64::MAX))
            .bind(id)
            .execute(self.pool())
            .await?;
        Ok(())
    }

    /// Marks the run running again (a continued run) or finished.
    pub async fn set_run_status(
        &self,
        id: &str,
        status: RunStatus,
        stop_reason: Option<&str>,
        balance_after: Option<i64>,
    ) -> Result<(), StoreError> {
        let finished = (status != RunStatus::Running).then(now_ms);
        sqlx::query(
            "UPDATE runs SET status = $1, stop_reason = $2, finished_at = $3,
                 balance_after = COALESCE($4, balance_after)
             WHERE id = $5",
        )
        .bind(status.as_str())
        .bind(stop_reason)
        .bind(finished)
        .bind(balance_after)
        .bind(id)
        .execute(self.pool())
        .await?;
        Ok(())
    }
}

fn run_row(row: &sqlx::any::AnyRow) -> Result<RunRow, StoreError> {
    let status: String = row.try_get("status")?;
    Ok(RunRow {
        id: row.try_get("id")?,
        pipeline_name: row.try_get("pipeline_name")?,
        pipeline_file: row.try_get("pipeline_file")?,
        pipeline_text: row.try_get("pipeline_text")?,
        pipeline_sha256: row.try_get("pipeline_sha256")?,
        items_sha256: row.try_get("items_sha256")?,
        plan_json: row.try_get("plan_json")?,
        output_dir: row.try_get("output_dir")?,
        status: RunStatus::parse(&status).unwrap_or(RunStatus::Running),
        credits_planned: row.try_get::<i64, _>("credits_planned")?.max(0) as u64,
        balance_before: row.try_get("balance_before")?,
        balance_after: row.try_get("balance_after")?,
        stop_reason: row.try_get("stop_reason")?,
        created_at: row.try_get("created_at")?,
        finished_at: row.try_get("finished_at")?,
    })
}

/// One step's tasks of a run, by status.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct StepCounts {
    pub step: String,
    pub tasks: u64,
    pub succeeded: u64,
    pub failed: u64,
    pub blocked: u64,
    pub pending: u64,
    pub planned_credits: u64,
    pub billed_credits: u64,
}

/// An attempt sent without a complete answer: it may have been billed.
#[derive(Clone, Debug, serde::Serialize)]
pub struct AmbiguousAttempt {
    #[serde(skip)]
    pub task_id: i64,
    pub task: String,
    pub endpoint: String,
    pub started_at: i64,
    pub job_id: Option<String>,
    pub error: Option<String>,
    /// The task's planned price: what the call may have cost.
    pub credits_at_risk: u64,
    /// No outcome recorded: in flight, or its process died.
    pub in_flight: bool,
}

impl Store {
    /// The run's tasks counted per step, in the order the steps first appear.
    pub async fn step_counts(&self, run_id: &str) -> Result<Vec<StepCounts>, StoreError> {
        let rows = sqlx::query(
            "SELECT step, COUNT(*) AS tasks,
                    COUNT(*) FILTER (WHERE status = 'succeeded') AS succeeded,
                    COUNT(*) FILTER (WHERE status = 'failed') AS failed,
                    COUNT(*) FILTER (WHERE status = 'blocked') AS blocked,
                    COUNT(*) FILTER (WHERE status IN ('pending', 'running')) AS pending,
                    CAST(SUM(planned_credits) AS BIGINT) AS planned,
                    CAST(SUM(credits_billed) AS BIGINT) AS billed
             FROM tasks WHERE run_id = $1 AND removed_at IS NULL
             GROUP BY step ORDER BY MIN(id)",
        )
        .bind(run_id)
        .fetch_all(self.pool())
        .await?;
        let n = |r: &sqlx::any::AnyRow, c: &str| -> Result<u64, StoreError> {
            Ok(r.try_get::<Option<i64>, _>(c)?.unwrap_or(0).max(0) as u64)
        };
        rows.iter()
            .map(|r| {
                Ok(StepCounts {
                    step: r.try_get("step")?,
                    tasks: n(r, "tasks")?,
                    succeeded: n(r, "succeeded")?,
                    failed: n(r, "failed")?,
                    blocked: n(r, "blocked")?,
                    pending: n(r, "pending")?,
                    planned_credits: n(r, "planned")?,
                    billed_credits: n(r, "billed")?,
                })
            })
            .collect()
    }

    /// Every attempt of the run that may have been billed without a result.
    pub async fn ambiguous_attempts(
        &self,
        run_id: &str,
    ) -> Result<Vec<AmbiguousAttempt>, StoreError> {
        let rows = sqlx::query(
            "SELECT t.id, t.item, t.step, t.idx, t.planned_credits, a.endpoint, a.started_at,
                    a.job_id, a.error,
                    CASE WHEN a.outcome IS NULL THEN 1 ELSE 0 END AS in_flight
             FROM attempts a JOIN tasks t ON t.id = a.task_id
             WHERE a.run_id = $1 AND (a.outcome IS NULL OR a.outcome = 'ambiguous')
             ORDER BY a.id",
        )
        .bind(run_id)
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| {
                Ok(AmbiguousAttempt {
                    task_id: r.try_get("id")?,
                    task: TaskKey::new(
                        r.try_get::<String, _>("item")?,
                        r.try_get::<String, _>("step")?,
                        u32::try_from(r.try_get::<i64, _>("idx")?).unwrap_or(0),
                    )
                    .to_string(),
                    endpoint: r.try_get("endpoint")?,
                    started_at: r.try_get("started_at")?,
                    job_id: r.try_get("job_id")?,
                    error: r.try_get("error")?,
                    credits_at_risk: crate::store::tasks::to_u64(r.try_get("planned_credits")?),
                    in_flight: r.try_get::<i64, _>("in_flight")? != 0,
                })
            })
            .collect()
    }

    /// How many outputs of the run were moved aside, and into which directory they went.
    pub async fn superseded_count(&self, run_id: &str) -> Result<u64, StoreError> {
        let (n,): (i64,) = sqlx::query_as(
            "SELECT COUNT(*) FROM superseded_outputs WHERE run_id = $1 AND path IS NOT NULL",
        )
        .bind(run_id)
        .fetch_one(self.pool())
        .await?;
        Ok(n.max(0) as u64)
    }

    /// Whether a call of `operation` planned at `credits` was ever billed exactly that, in
    /// any run: the price is then the service's word, not only the pipeline file's.
    pub async fn billed_as_planned(
        &self,
        operation: &str,
        credits: u64,
    ) -> Result<bool, StoreError> {
        let found: Option<(i64,)> = sqlx::query_as(
            "SELECT 1 FROM tasks WHERE operation = $1 AND planned_credits = $2
                 AND credits_billed = planned_credits AND status = 'succeeded' LIMIT 1",
        )
        .bind(operation)
        .bind(i64::try_from(credits).unwrap_or(i64::MAX))
        .fetch_optional(self.pool())
        .await?;
        Ok(found.is_some())
    }
}
