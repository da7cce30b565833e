//! What a run has done and paid, read from its tasks and attempts: the figures `status`, the
//! summary and the report show. Part of the runs' part of the store ([`Store::runs`]).

use sqlx::Row;

use crate::api::job_id::JobId;
use crate::run_id::RunId;
use crate::store::runs::Runs;
use crate::store::tasks::key_of;
use crate::store::to_u64;
use crate::store::{StoreError, TaskId};
use crate::task_key::TaskKey;

/// A run's attempts and outputs summed up, as the store keeps them while they are written
/// (`run_totals`, kept by the triggers of migration `20261201000600_run_totals`): one row,
/// however long the night. A run with nothing recorded has none.
const RUN_TOTALS: &str = "SELECT billed_credits, ambiguous_attempts, possibly_billed_credits,
        outputs, downloaded, download_failures
    FROM run_totals WHERE run_id = $1";

/// What a run has done and paid, from the totals the store keeps of its tasks, attempts and
/// outputs.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Totals {
    pub tasks: u64,
    pub succeeded: u64,
    pub failed: u64,
    pub blocked: u64,
    pub pending: u64,
    pub planned_credits: u64,
    pub billed_credits: u64,
    /// Attempts sent without a complete answer, which may have been billed without a result.
    pub ambiguous_attempts: u64,
    /// The planned price of those attempts: what they may have cost.
    pub possibly_billed_credits: u64,
    pub outputs: u64,
    pub downloaded: u64,
    pub download_failures: u64,
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
    pub task_id: TaskId,
    pub task: TaskKey,
    pub endpoint: String,
    pub started_at: i64,
    pub job_id: Option<JobId>,
    pub error: Option<String>,
    /// The task's planned price: what the call may have cost.
    pub credits_at_risk: u64,
    /// No outcome recorded: in flight, or its process died.
    pub in_flight: bool,
}

/// Each step of a run with live tasks, summed from the totals kept (`run_step_totals`: as
/// recorded, and changed since: two rows a step), with the smallest task id it ever had, in
/// that order; never a count of the tasks. Read by the progress and by the report's costs.
pub(super) const KEPT_STEPS: &str = "SELECT step, MIN(first_id) AS first,
        CAST(SUM(tasks) AS BIGINT) AS tasks,
        CAST(SUM(succeeded) AS BIGINT) AS succeeded,
        CAST(SUM(failed) AS BIGINT) AS failed,
        CAST(SUM(blocked) AS BIGINT) AS blocked,
        CAST(SUM(pending) AS BIGINT) AS pending,
        CAST(SUM(planned_credits) AS BIGINT) AS planned,
        CAST(SUM(billed_credits) AS BIGINT) AS billed
     FROM run_step_totals WHERE run_id = $1
     GROUP BY step HAVING SUM(tasks) <> 0
     ORDER BY MIN(first_id)";

impl Runs<'_> {
    /// The run's tasks counted per step, in the order the steps first appear: the totals the
    /// store keeps of each step (`run_step_totals`: as recorded, and changed since), two rows a
    /// step, never a count of the tasks.
    pub async fn step_counts(&self, run_id: &RunId) -> Result<Vec<StepCounts>, StoreError> {
        let rows = sqlx::query(KEPT_STEPS)
            .bind(run_id)
            .fetch_all(self.store.pool())
            .await?;
        let n = |r: &sqlx::any::AnyRow, c: &str| -> Result<u64, StoreError> {
            Ok(to_u64(r.try_get::<i64, _>(c)?))
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
        run_id: &RunId,
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
        .fetch_all(self.store.pool())
        .await?;
        rows.iter()
            .map(|r| {
                Ok(AmbiguousAttempt {
                    task_id: r.try_get("id")?,
                    task: key_of(r)?,
                    endpoint: r.try_get("endpoint")?,
                    started_at: r.try_get("started_at")?,
                    job_id: r.try_get("job_id")?,
                    error: r.try_get("error")?,
                    credits_at_risk: to_u64(r.try_get("planned_credits")?),
                    in_flight: r.try_get::<i64, _>("in_flight")? != 0,
                })
            })
            .collect()
    }

    /// How many outputs of the run were moved aside, and into which directory they went.
    pub async fn superseded_count(&self, run_id: &RunId) -> Result<u64, StoreError> {
        let (n,): (i64,) = sqlx::query_as(
            "SELECT COUNT(*) FROM superseded_outputs WHERE run_id = $1 AND path IS NOT NULL",
        )
        .bind(run_id)
        .fetch_one(self.store.pool())
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
        .fetch_optional(self.store.pool())
        .await?;
        Ok(found.is_some())
    }

    /// What run `run_id` was billed or may have been: [`Totals::billed_credits`] and
    /// [`Totals::possibly_billed_credits`], read alone. What a run may still spend is decided
    /// on it before its first paid call: one row of the totals the store keeps, not a sum over
    /// the night's attempts (at 900,000 tasks, seconds).
    pub async fn spent(&self, run_id: &RunId) -> Result<u64, StoreError> {
        let Some(a) = self.run_totals(run_id).await? else {
            return Ok(0);
        };
        let n = |c: &str| -> Result<u64, StoreError> { Ok(to_u64(a.try_get::<i64, _>(c)?)) };
        Ok(n("billed_credits")?.saturating_add(n("possibly_billed_credits")?))
    }

    /// The run's totals: its steps' summed (a few rows), its attempts' and outputs' read.
    pub async fn totals(&self, run_id: &RunId) -> Result<Totals, StoreError> {
        let mut totals = Totals::default();
        for s in self.step_counts(run_id).await? {
            totals.tasks += s.tasks;
            totals.succeeded += s.succeeded;
            totals.failed += s.failed;
            totals.blocked += s.blocked;
            totals.pending += s.pending;
            totals.planned_credits += s.planned_credits;
        }
        if let Some(a) = self.run_totals(run_id).await? {
            let n = |c: &str| -> Result<u64, StoreError> { Ok(to_u64(a.try_get::<i64, _>(c)?)) };
            totals.billed_credits = n("billed_credits")?;
            totals.ambiguous_attempts = n("ambiguous_attempts")?;
            totals.possibly_billed_credits = n("possibly_billed_credits")?;
            totals.outputs = n("outputs")?;
            totals.downloaded = n("downloaded")?;
            totals.download_failures = n("download_failures")?;
        }
        Ok(totals)
    }

    async fn run_totals(&self, run_id: &RunId) -> Result<Option<sqlx::any::AnyRow>, StoreError> {
        Ok(sqlx::query(RUN_TOTALS)
            .bind(run_id)
            .fetch_optional(self.store.pool())
            .await?)
    }
}

#[cfg(test)]
mod tests {
    use crate::run_id::RunId;
    use crate::store::runs::{NewRun, RecordedPlan};
    use crate::store::{Location, NewTask, Store, TaskId, TaskStatus};
    use crate::task_key::TaskKey;

    /// What a run may still spend and its steps' counts, as kept by the store, follow every
    /// kind of write: an attempt left without an answer counts its task's planned price, and
    /// that price changed afterwards (a discovered price) counts anew; a task failed or dropped
    /// by a changed pipeline leaves its step's counts.
    async fn totals_follow_their_rows(store: &Store) {
        let run_id = RunId::from("r");
        let plan = RecordedPlan::of(&serde_json::json!({})).unwrap();
        let run = NewRun {
            id: &run_id,
            pipeline_name: "p",
            pipeline_file: "p.yaml",
            pipeline_text: "",
            pipeline_sha256: &crate::sha256::Sha256Sum::of_bytes(b""),
            items_sha256: &crate::sha256::Sha256Sum::of_bytes(b""),
            plan: &plan,
            output_dir: "out",
            credits_planned: 6,
            balance_before: None,
        };
        let task = |item: &str| NewTask {
            key: TaskKey::new(item.to_owned(), "shot".to_owned(), 0),
            operation: "generate",
            inputs: "[]".to_owned(),
            planned_credits: 3,
            request: None,
        };
        store
            .runs()
            .create(&run, &[task("a"), task("b")])
            .await
            .unwrap();
        let ids: Vec<TaskId> = store
            .tasks()
            .all(&run_id)
            .await
            .unwrap()
            .iter()
            .map(|t| t.id)
            .collect();
        assert_eq!(store.runs().spent(&run_id).await.unwrap(), 0);
        store.attempts().begin(&run_id, ids[0], "x").await.unwrap();
        assert_eq!(
            store.runs().spent(&run_id).await.unwrap(),
            3,
            "unanswered: its price"
        );
        store.tasks().set_planned(&[(ids[0], 7)]).await.unwrap();
        let totals = store.runs().totals(&run_id).await.unwrap();
        assert_eq!(
            (
                totals.ambiguous_attempts,
                totals.possibly_billed_credits,
                totals.planned_credits
            ),
            (1, 7, 10),
            "repriced: the unanswered attempt may have cost the new price"
        );
        assert_eq!(store.runs().spent(&run_id).await.unwrap(), 7);
        store
            .tasks()
            .set_status(&ids[1..], TaskStatus::Failed, Some("no"))
            .await
            .unwrap();
        let steps = store.runs().step_counts(&run_id).await.unwrap();
        let counts = |s: &super::StepCounts| (s.tasks, s.pending, s.failed, s.planned_credits);
        assert_eq!(
            steps.iter().map(counts).collect::<Vec<_>>(),
            [(2, 1, 1, 10)]
        );
        sqlx::query("UPDATE tasks SET removed_at = 1 WHERE id = $1")
            .bind(ids[1])
            .execute(store.pool())
            .await
            .unwrap();
        let steps = store.runs().step_counts(&run_id).await.unwrap();
        assert_eq!(steps.iter().map(counts).collect::<Vec<_>>(), [(1, 1, 0, 7)]);
    }

    #[tokio::test]
    async fn the_totals_kept_follow_their_rows_on_sqlite_and_postgres() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("state.db")).await.unwrap();
        totals_follow_their_rows(&store).await;
        store.close().await;
        let Some(url) = crate::store::test_postgres::database("totals").await else {
            return;
        };
        let store = Store::open_at(&Location::Postgres((*url).clone()))
            .await
            .unwrap();
        totals_follow_their_rows(&store).await;
        store.close().await;
    }
}
