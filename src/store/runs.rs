//! Runs: one row per `imgpipe run`, holding the pipeline text and the plan it started from.
//! A part of the store ([`Store::runs`]); what a run has done and paid is read in
//! [`super::run_figures`].

use sqlx::Row;

use crate::place::{Address, RunDir};
use crate::run_id::RunId;
use crate::sha256::Sha256Sum;
use crate::store::{Store, StoreError, now_ms};

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

    /// A run row's status. A word this build does not know is an error, never read as
    /// another status.
    pub(crate) fn recorded(s: &str) -> Result<RunStatus, StoreError> {
        RunStatus::parse(s).ok_or_else(|| {
            StoreError::Inconsistent(format!(
                "a run's status is `{s}`, which this imgpipe does not know (a database written by a newer imgpipe, or edited by hand)"
            ))
        })
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

impl std::fmt::Display for RunStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// As its word (`succeeded`), what `status --json` and the events show.
impl serde::Serialize for RunStatus {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

/// The plan a run was recorded with, as the store keeps it: a JSON document whose type the
/// store does not know (it sits below `plan`), read back as the type its caller knows it by.
/// Written only by [`RecordedPlan::of`], so a plan that cannot be written is an error, never
/// an empty record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordedPlan(String);

impl RecordedPlan {
    /// The plan as the store records it.
    pub fn of(plan: &(impl serde::Serialize + ?Sized)) -> Result<RecordedPlan, StoreError> {
        serde_json::to_string(plan)
            .map(RecordedPlan)
            .map_err(|e| StoreError::Plan(e.to_string()))
    }

    /// The plan read as `P`; `None` for a record `P` cannot read (one written before `P` took
    /// its shape, or left empty by an imgpipe from before plans were checked as they were
    /// written). Read by its two readers only: the figures every part shows
    /// (`money::planned::PlanFigures::of`) and the whole document a resume compares.
    pub fn read<P: serde::de::DeserializeOwned>(&self) -> Option<P> {
        if self.0.is_empty() {
            return None;
        }
        serde_json::from_str(&self.0)
            .inspect_err(|e| tracing::debug!("the recorded plan does not read: {e}"))
            .ok()
    }

    /// The document as a statement read it.
    pub(super) fn from_record(text: String) -> RecordedPlan {
        RecordedPlan(text)
    }

    fn text(&self) -> &str {
        &self.0
    }
}

/// What a run starts with.
pub struct NewRun<'a> {
    pub id: &'a RunId,
    pub pipeline_name: &'a str,
    pub pipeline_file: &'a str,
    pub pipeline_text: &'a str,
    pub pipeline_sha256: &'a Sha256Sum,
    pub items_sha256: &'a Sha256Sum,
    pub plan: &'a RecordedPlan,
    pub output_dir: &'a str,
    pub credits_planned: u64,
    pub balance_before: Option<i64>,
}

#[derive(Clone, Debug)]
pub struct Run {
    pub id: RunId,
    pub pipeline_name: String,
    pub pipeline_file: String,
    /// The run's own copy of its pipeline file.
    pub pipeline_text: String,
    pub pipeline_sha256: Sha256Sum,
    pub items_sha256: Sha256Sum,
    pub plan: RecordedPlan,
    /// Where the run's directory is made: `<output_dir>/<run id>` ([`Run::dir`]).
    pub output_dir: Address,
    pub status: RunStatus,
    pub credits_planned: u64,
    pub balance_before: Option<i64>,
    pub balance_after: Option<i64>,
    pub stop_reason: Option<String>,
    pub created_at: i64,
    pub finished_at: Option<i64>,
}

/// A run as [`Runs::list`] lists them: its record without the pipeline's text, its plan, its
/// place or its balances, which a list of every run does not read.
#[derive(Clone, Debug)]
pub struct RunSummary {
    pub id: RunId,
    pub pipeline_name: String,
    pub status: RunStatus,
    pub credits_planned: u64,
    pub created_at: i64,
    pub finished_at: Option<i64>,
}

impl Run {
    /// The run's own directory: its outputs, manifest and report.
    pub fn dir(&self) -> RunDir {
        RunDir::new(&self.output_dir, &self.id)
    }
}

/// The runs: their records, and the statements that change them.
#[derive(Clone, Copy, Debug)]
pub struct Runs<'a> {
    pub(super) store: &'a Store,
}

impl Runs<'_> {
    /// Records a run with its tasks, in one transaction: a run is never recorded without them.
    pub async fn create(
        &self,
        run: &NewRun<'_>,
        tasks: &[crate::store::NewTask],
    ) -> Result<(), StoreError> {
        let mut tx = self.store.pool().begin().await?;
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
        .bind(run.plan.text())
        .bind(run.output_dir)
        .bind(i64::try_from(run.credits_planned).unwrap_or(i64::MAX))
        .bind(run.balance_before)
        .bind(now_ms())
        .execute(&mut *tx)
        .await?;
        crate::store::tasks::insert_tasks(&mut tx, self.store.backend(), run.id, tasks).await?;
        tx.commit().await?;
        Ok(())
    }

    pub async fn get(&self, id: &RunId) -> Result<Option<Run>, StoreError> {
        let row = sqlx::query(
            "SELECT id, pipeline_name, pipeline_file, pipeline_text, pipeline_sha256, items_sha256,
                    plan_json, output_dir, status, credits_planned, balance_before,
                    balance_after, stop_reason, created_at, finished_at
             FROM runs WHERE id = $1",
        )
        .bind(id)
        .fetch_optional(self.store.pool())
        .await?;
        row.as_ref().map(run_row).transpose()
    }

    /// Every run, the latest first, summed up.
    pub async fn list(&self) -> Result<Vec<RunSummary>, StoreError> {
        let rows = sqlx::query(
            "SELECT id, pipeline_name, status, credits_planned, created_at, finished_at
             FROM runs ORDER BY created_at DESC, id DESC",
        )
        .fetch_all(self.store.pool())
        .await?;
        rows.iter().map(summary_row).collect()
    }

    /// One run, summed up as [`Runs::list`] lists it.
    pub async fn summary(&self, id: &RunId) -> Result<Option<RunSummary>, StoreError> {
        let row = sqlx::query(
            "SELECT id, pipeline_name, status, credits_planned, created_at, finished_at
             FROM runs WHERE id = $1",
        )
        .bind(id)
        .fetch_optional(self.store.pool())
        .await?;
        row.as_ref().map(summary_row).transpose()
    }

    /// Adopts a changed pipeline file (`--allow-changes`): the run keeps the new copy.
    pub async fn adopt_source(
        &self,
        id: &RunId,
        text: &str,
        sha256: &Sha256Sum,
        items_sha256: &Sha256Sum,
        plan: &RecordedPlan,
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
        .bind(plan.text())
        .bind(i64::try_from(credits_planned).unwrap_or(i64::MAX))
        .bind(id)
        .execute(self.store.pool())
        .await?;
        Ok(())
    }

    /// Records the run's plan anew, once the generation price was discovered: the tasks not
    /// recorded yet are counted from it.
    pub async fn set_plan(
        &self,
        id: &RunId,
        plan: &RecordedPlan,
        credits_planned: u64,
    ) -> Result<(), StoreError> {
        sqlx::query("UPDATE runs SET plan_json = $1, credits_planned = $2 WHERE id = $3")
            .bind(plan.text())
            .bind(i64::try_from(credits_planned).unwrap_or(i64::MAX))
            .bind(id)
            .execute(self.store.pool())
            .await?;
        Ok(())
    }

    /// Marks the run running again (a continued run) or finished.
    pub async fn set_status(
        &self,
        id: &RunId,
        status: RunStatus,
        stop_reason: Option<&str>,
        balance_after: Option<i64>,
    ) -> Result<(), StoreError> {
        let finished = (status != RunStatus::Running).then(now_ms);
        // A host that lost the run's lock must not tell the run's end over the new holder's.
        let mut tx = self.store.pool().begin().await?;
        if let Some(fence) = self.store.fenced_by() {
            crate::store::group::check(&mut tx, &fence).await?;
        }
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
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }
}

/// A run's id is bound as the text the database keeps.
impl sqlx::Type<sqlx::Any> for RunId {
    fn type_info() -> sqlx::any::AnyTypeInfo {
        <String as sqlx::Type<sqlx::Any>>::type_info()
    }
}

impl sqlx::Encode<'_, sqlx::Any> for RunId {
    fn encode_by_ref(
        &self,
        buf: &mut <sqlx::Any as sqlx::Database>::ArgumentBuffer,
    ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
        <String as sqlx::Encode<'_, sqlx::Any>>::encode(self.as_str().to_owned(), buf)
    }
}

fn summary_row(row: &sqlx::any::AnyRow) -> Result<RunSummary, StoreError> {
    let status: String = row.try_get("status")?;
    Ok(RunSummary {
        id: RunId::from(row.try_get::<String, _>("id")?),
        pipeline_name: row.try_get("pipeline_name")?,
        status: RunStatus::recorded(&status)?,
        credits_planned: row.try_get::<i64, _>("credits_planned")?.max(0) as u64,
        created_at: row.try_get("created_at")?,
        finished_at: row.try_get("finished_at")?,
    })
}

fn run_row(row: &sqlx::any::AnyRow) -> Result<Run, StoreError> {
    let status: String = row.try_get("status")?;
    Ok(Run {
        id: RunId::from(row.try_get::<String, _>("id")?),
        pipeline_name: row.try_get("pipeline_name")?,
        pipeline_file: row.try_get("pipeline_file")?,
        pipeline_text: row.try_get("pipeline_text")?,
        pipeline_sha256: row.try_get("pipeline_sha256")?,
        items_sha256: row.try_get("items_sha256")?,
        plan: RecordedPlan::from_record(row.try_get("plan_json")?),
        output_dir: Address::recorded(&row.try_get::<String, _>("output_dir")?),
        status: RunStatus::recorded(&status)?,
        credits_planned: row.try_get::<i64, _>("credits_planned")?.max(0) as u64,
        balance_before: row.try_get("balance_before")?,
        balance_after: row.try_get("balance_after")?,
        stop_reason: row.try_get("stop_reason")?,
        created_at: row.try_get("created_at")?,
        finished_at: row.try_get("finished_at")?,
    })
}
