//! What the run report reads beyond the executor's own queries: the run's tasks item by item
//! with their inputs (lineage) and outputs, streamed, the cost of each step and the billed
//! calls over time, both summed by the database: a report of a large run holds one page of
//! rows at a time, never the run.

use crate::api::job_id::JobId;
use crate::run_id::RunId;
use futures::stream::{BoxStream, StreamExt, TryStreamExt};
use sqlx::Row;

use crate::place::Address;
use crate::sha256::Sha256Sum;
use crate::store::tasks::TaskStatus;
use crate::store::to_u64;
use crate::store::{Backend, OutputId, Store, StoreError, TaskId, rows};

/// A task as the report shows it.
#[derive(Clone, Debug)]
pub struct ReportTask {
    pub id: TaskId,
    pub item: String,
    pub step: String,
    pub idx: u32,
    pub operation: String,
    /// `item/step[index]` references to other tasks' outputs, or URLs the pipeline wrote.
    pub inputs: Vec<String>,
    pub status: TaskStatus,
    pub planned_credits: u64,
    pub credits_billed: u64,
    pub job_id: Option<JobId>,
    pub error: Option<String>,
    /// Dropped from the pipeline by `--allow-changes`: only its cost is shown.
    pub removed: bool,
    /// The earlier run whose outputs it took (`--reuse`).
    pub reused_from_run: Option<String>,
    pub attempts: u32,
    /// What the task asks of the service, as recorded with it; `None` for tasks recorded
    /// before requests were, or whose record cannot be read.
    pub request: Option<TaskRequest>,
}

/// A task's request as recorded: the body's fields other than image URLs. Each field is
/// there when the request has it (a generation: prompt, n, size; a tool: its own fields).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Deserialize)]
pub struct TaskRequest {
    pub prompt: Option<String>,
    pub n: Option<u64>,
    pub size: Option<String>,
    pub object_name: Option<String>,
    pub aspect_ratio: Option<String>,
    pub desired_increase: Option<u64>,
    pub preserve_alpha: Option<bool>,
}

impl TaskRequest {
    /// Each field the request has, named as the report and the desk show it, in that order.
    pub fn shown(&self) -> Vec<(&'static str, String)> {
        let fields: [(&str, Option<String>); 7] = [
            ("prompt", self.prompt.clone()),
            ("object name", self.object_name.clone()),
            ("aspect ratio", self.aspect_ratio.clone()),
            ("increase", self.desired_increase.map(|x| format!("×{x}"))),
            ("n", self.n.map(|n| n.to_string())),
            ("size", self.size.clone()),
            ("preserve alpha", self.preserve_alpha.map(|b| b.to_string())),
        ];
        fields
            .into_iter()
            .filter_map(|(name, value)| value.map(|v| (name, v)))
            .collect()
    }
}

/// One output as the report shows it.
#[derive(Clone, Debug)]
pub struct ReportOutput {
    pub id: OutputId,
    pub k: u32,
    pub job_id: JobId,
    /// Where the output was kept, when it was: a file or an object.
    pub place: Option<Address>,
    pub sha256: Option<Sha256Sum>,
    pub download_error: Option<String>,
}

/// A recorded place, decoded once here: a local path or an `s3://` URL.
pub(super) fn place(r: &sqlx::any::AnyRow) -> Result<Option<Address>, StoreError> {
    Ok(r.try_get::<Option<String>, _>("path")?
        .as_deref()
        .map(Address::recorded))
}

/// [`Report::rows`] on SQLite: the list of items is made first (from the
/// `(run_id, item, …)` index alone), then each item's tasks are looked up by that index.
/// `CROSS JOIN` keeps the items as the outer loop, which is what keeps an item's rows
/// together; sorting the whole result instead would cost a sort of every task.
const REPORT_ROWS_SQLITE: &str = "WITH items AS MATERIALIZED (
         SELECT item, MIN(id) AS first FROM tasks WHERE run_id = $1
         GROUP BY item ORDER BY item <> '_batch', first)
     SELECT t.id, t.item, t.step, t.idx, t.operation, t.inputs, t.status,
            t.planned_credits, t.credits_billed, t.job_id, t.error, t.request,
            0 AS removed, r.run_id AS reused_run,
            (SELECT COUNT(*) FROM attempts a WHERE a.task_id = t.id) AS attempts,
            o.id AS o_id, o.k, o.job_id AS o_job, o.path, o.sha256, o.download_error
     FROM items i
     CROSS JOIN tasks t ON t.run_id = $1 AND t.item = i.item
     LEFT JOIN tasks r ON r.id = t.reused_from
     LEFT JOIN outputs o ON o.task_id = t.id
     WHERE t.removed_at IS NULL";

/// [`Report::rows`] on PostgreSQL, which takes no join order from the text and sorts the
/// result anyway: each task gets its item's first id from a window over the run's tasks, and
/// every other table is reached from a task by an index. Joining the list of items to the
/// tasks instead left the planner a choice it got wrong on tables not analysed yet (a run
/// killed minutes after it started): it took both sides for a few rows and joined them in a
/// nested loop over all the run's tasks for each item, 17 s for 3,072 items (README, "cargo
/// bench --bench scale"). Here no join has two sides of the run's size without an index.
const REPORT_ROWS_POSTGRES: &str = "SELECT t.id, t.item, t.step, t.idx, t.operation, t.inputs,
            t.status, t.planned_credits, t.credits_billed, t.job_id, t.error, t.request,
            0 AS removed, r.run_id AS reused_run,
            (SELECT COUNT(*) FROM attempts a WHERE a.task_id = t.id) AS attempts,
            o.id AS o_id, o.k, o.job_id AS o_job, o.path, o.sha256, o.download_error
     FROM (SELECT id, item, step, idx, operation, inputs, status, planned_credits,
                  credits_billed, job_id, error, request, reused_from, removed_at,
                  MIN(id) OVER (PARTITION BY item) AS first
           FROM tasks WHERE run_id = $1) AS t
     LEFT JOIN tasks r ON r.id = t.reused_from
     LEFT JOIN outputs o ON o.task_id = t.id
     WHERE t.removed_at IS NULL
     ORDER BY t.item <> '_batch', t.first, t.step, t.idx, o.k";

/// One line of [`Report::step_totals`] as summed by the database, with the smallest task id
/// it counts (the lines are listed in that order); its reused tasks and calls at risk apart.
fn step_line(r: &sqlx::any::AnyRow, removed: bool) -> Result<(i64, StepTotals), StoreError> {
    let n = |c: &str| -> Result<u64, StoreError> {
        Ok(to_u64(r.try_get::<Option<i64>, _>(c)?.unwrap_or(0)))
    };
    let line = StepTotals {
        step: r.try_get("step")?,
        removed,
        tasks: n("tasks")?,
        succeeded: n("succeeded")?,
        failed: n("failed")?,
        blocked: n("blocked")?,
        pending: n("pending")?,
        reused: 0,
        planned: n("planned")?,
        billed: n("billed")?,
        at_risk: 0,
    };
    Ok((r.try_get("first")?, line))
}

/// One row of [`Report::rows`]: a task, and one of its outputs when it has any.
#[derive(Clone, Debug)]
pub struct ReportEntry {
    pub task: ReportTask,
    pub output: Option<ReportOutput>,
}

/// The tasks of one step summed by the database, apart for tasks removed from the pipeline.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepTotals {
    pub step: String,
    pub removed: bool,
    pub tasks: u64,
    pub succeeded: u64,
    pub failed: u64,
    pub blocked: u64,
    /// Pending and running.
    pub pending: u64,
    pub reused: u64,
    pub planned: u64,
    pub billed: u64,
    /// The planned price of the step's calls sent without a complete answer.
    pub at_risk: u64,
}

/// An output a task no longer has: set aside (its file moved under `_superseded/`) when the
/// task was done again (`reroll`), changed (`--allow-changes`), or its file found modified.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EarlierOutput {
    pub task_id: TaskId,
    pub k: u32,
    pub job_id: JobId,
    /// Where the file was moved to; `None` when it was not kept.
    pub place: Option<Address>,
    pub sha256: Option<Sha256Sum>,
    pub reason: String,
    pub superseded_at: i64,
}

/// One billed call: when its answer arrived and what it cost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Spend {
    pub at: i64,
    pub credits: u64,
}

impl Store {
    /// The report's reads of a run: its tasks and outputs a page at a time, its step costs, its spend over time.
    pub fn report(&self) -> Report<'_> {
        Report { store: self }
    }
}

/// The report's reads of a run: its tasks and outputs a page at a time, its step costs, its spend over time.
#[derive(Clone, Copy, Debug)]
pub struct Report<'a> {
    pub(super) store: &'a Store,
}

impl<'a> Report<'a> {
    /// The run's live tasks item by item (the batch's `once` steps first, then the items in
    /// the order their first task was recorded), each task followed by its outputs. The rows of
    /// one item come together, in no set order among themselves.
    ///
    /// Tasks are recorded step by step, so an item's rows are spread over the table; each
    /// backend's statement says how it brings them together.
    pub fn rows(self, run_id: &'a RunId) -> BoxStream<'a, Result<ReportEntry, StoreError>> {
        let sql = match self.store.backend() {
            Backend::Sqlite => REPORT_ROWS_SQLITE,
            Backend::Postgres => REPORT_ROWS_POSTGRES,
        };
        sqlx::query(sql)
            .bind(run_id)
            .fetch(self.store.streams())
            .map_err(StoreError::from)
            .and_then(|r| async move {
                let output = match r.try_get::<Option<i64>, _>("k")? {
                    Some(k) => Some(ReportOutput {
                        id: r.try_get("o_id")?,
                        k: u32::try_from(k).unwrap_or(0),
                        job_id: r.try_get("o_job")?,
                        place: place(&r)?,
                        sha256: r.try_get("sha256")?,
                        download_error: r.try_get("download_error")?,
                    }),
                    None => None,
                };
                Ok(ReportEntry {
                    task: report_task(&r)?,
                    output,
                })
            })
            .boxed()
    }

    /// How many items the run has (the batch's `once` steps count as one), read from the
    /// index alone: an item whose every task was removed from the pipeline still counts.
    pub async fn items(&self, run_id: &RunId) -> Result<u64, StoreError> {
        let (n,): (i64,) =
            sqlx::query_as("SELECT COUNT(DISTINCT item) FROM tasks WHERE run_id = $1")
                .bind(run_id)
                .fetch_one(self.store.pool())
                .await?;
        Ok(to_u64(n))
    }

    /// Each step's tasks summed, in the order the steps were first recorded, removed tasks on
    /// lines of their own. Calls without an answer count at risk only with `unanswered`: while
    /// the run goes on they are in flight, not (yet) possibly billed.
    ///
    /// Read from the totals the store keeps of each step's live tasks (`run_step_totals`, a
    /// few rows), and from the few rows summing cannot keep apart: the tasks removed from the
    /// pipeline and those reused from an earlier run (each read alone through an index of its
    /// own, `20261201000800_report_totals`: none in most runs) and the calls without an
    /// answer. Never a count of the run's every task (seconds at 100,000 items).
    pub async fn step_totals(
        &self,
        run_id: &RunId,
        unanswered: bool,
    ) -> Result<Vec<StepTotals>, StoreError> {
        let mut lines = self.live_steps(run_id).await?;
        let removed = self.removed_steps(run_id).await?;
        for (first, line) in &mut lines {
            // The totals keep the smallest id the step ever had: a step whose first tasks were
            // removed is listed where its first live task is.
            if removed.iter().any(|(_, r)| r.step == line.step) {
                *first = self.first_live(run_id, &line.step).await?;
            }
        }
        lines.extend(removed);
        lines.sort_by_key(|(first, _)| *first);
        let reused: Vec<(String, i64, i64)> = sqlx::query_as(
            "SELECT step, CASE WHEN removed_at IS NULL THEN 0 ELSE 1 END, COUNT(*)
             FROM tasks WHERE run_id = $1 AND reused_from IS NOT NULL GROUP BY 1, 2",
        )
        .bind(run_id)
        .fetch_all(self.store.pool())
        .await?;
        // The predicate of the index of unanswered attempts, as it is written there.
        let risk: Vec<(String, i64, i64)> = sqlx::query_as(
            "SELECT t.step, CASE WHEN t.removed_at IS NULL THEN 0 ELSE 1 END,
                    CAST(SUM(t.planned_credits) AS BIGINT)
             FROM attempts a JOIN tasks t ON t.id = a.task_id
             WHERE a.run_id = $1 AND (a.outcome IS NULL OR a.outcome = 'ambiguous')
               AND (a.outcome IS NOT NULL OR $2)
             GROUP BY 1, 2",
        )
        .bind(run_id)
        .bind(unanswered)
        .fetch_all(self.store.pool())
        .await?;
        let of = |rows: &[(String, i64, i64)], line: &StepTotals| -> u64 {
            rows.iter()
                .filter(|(s, rm, _)| *s == line.step && (*rm != 0) == line.removed)
                .map(|(_, _, n)| to_u64(*n))
                .sum()
        };
        Ok(lines
            .into_iter()
            .map(|(_, mut line)| {
                line.reused = of(&reused, &line);
                line.at_risk = of(&risk, &line);
                line
            })
            .collect())
    }

    /// The run's steps with live tasks, from the totals kept, each with the smallest task id
    /// it ever had.
    async fn live_steps(&self, run_id: &RunId) -> Result<Vec<(i64, StepTotals)>, StoreError> {
        let rows = sqlx::query(super::run_figures::KEPT_STEPS)
            .bind(run_id)
            .fetch_all(self.store.pool())
            .await?;
        rows.iter().map(|r| step_line(r, false)).collect()
    }

    /// The run's tasks removed from the pipeline, summed per step: read through their own
    /// index, so a run with none (most) costs nothing.
    async fn removed_steps(&self, run_id: &RunId) -> Result<Vec<(i64, StepTotals)>, StoreError> {
        let rows = sqlx::query(
            "SELECT step, MIN(id) AS first, COUNT(*) AS tasks,
                    COUNT(*) FILTER (WHERE status = 'succeeded') AS succeeded,
                    COUNT(*) FILTER (WHERE status = 'failed') AS failed,
                    COUNT(*) FILTER (WHERE status = 'blocked') AS blocked,
                    COUNT(*) FILTER (WHERE status IN ('pending', 'running')) AS pending,
                    CAST(SUM(planned_credits) AS BIGINT) AS planned,
                    CAST(SUM(credits_billed) AS BIGINT) AS billed
             FROM tasks WHERE run_id = $1 AND removed_at IS NOT NULL GROUP BY step",
        )
        .bind(run_id)
        .fetch_all(self.store.pool())
        .await?;
        rows.iter().map(|r| step_line(r, true)).collect()
    }

    /// The smallest id of a step's live tasks.
    async fn first_live(&self, run_id: &RunId, step: &str) -> Result<i64, StoreError> {
        let (first,): (Option<i64>,) = sqlx::query_as(
            "SELECT MIN(id) FROM tasks WHERE run_id = $1 AND step = $2 AND removed_at IS NULL",
        )
        .bind(run_id)
        .bind(step)
        .fetch_one(self.store.pool())
        .await?;
        Ok(first.unwrap_or(i64::MAX))
    }

    /// The run's billed calls in the order the answers arrived, those answered within the same
    /// `1/buckets` of the time from `start` to `end` summed into one: the chart draws no finer,
    /// and a large run's every call would weigh on the page.
    pub async fn spend(
        &self,
        run_id: &RunId,
        start: i64,
        end: i64,
        buckets: i64,
    ) -> Result<Vec<Spend>, StoreError> {
        let width = ((end - start) / buckets.max(1)).max(1);
        let rows: Vec<(i64, i64)> = sqlx::query_as(
            "SELECT MAX(at), CAST(SUM(credits_billed) AS BIGINT) FROM
                (SELECT COALESCE(finished_at, started_at) AS at, credits_billed FROM attempts
                 WHERE run_id = $1 AND credits_billed > 0) AS billed
             GROUP BY (at - $2) / $3 ORDER BY 1",
        )
        .bind(run_id)
        .bind(start)
        .bind(width)
        .fetch_all(self.store.pool())
        .await?;
        Ok(rows
            .into_iter()
            .map(|(at, credits)| Spend {
                at,
                credits: to_u64(credits),
            })
            .collect())
    }

    /// The earlier outputs of `tasks` (row ids of run `run_id`), by task, output and age: a
    /// page's tasks are asked, never the whole run's, one statement per 500 tasks.
    pub async fn earlier_outputs(
        &self,
        run_id: &RunId,
        tasks: &[TaskId],
    ) -> Result<Vec<EarlierOutput>, StoreError> {
        let mut out = Vec::new();
        for chunk in tasks.chunks(500) {
            let marks = rows(self.store.backend(), chunk.len(), 1, |p| p[0].clone());
            let run = match self.store.backend() {
                Backend::Sqlite => "?".to_owned(),
                Backend::Postgres => format!("${}", chunk.len() + 1),
            };
            let sql = format!(
                "SELECT task_id, k, job_id, path, sha256, reason, superseded_at
                 FROM superseded_outputs WHERE task_id IN ({marks}) AND run_id = {run}
                 ORDER BY task_id, k, superseded_at, id"
            );
            // Built from a fixed placeholder list: no value is ever part of the text.
            let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
            for id in chunk {
                query = query.bind(id);
            }
            for r in query.bind(run_id).fetch_all(self.store.pool()).await? {
                out.push(EarlierOutput {
                    task_id: r.try_get("task_id")?,
                    k: u32::try_from(r.try_get::<i64, _>("k")?).unwrap_or(0),
                    job_id: r.try_get("job_id")?,
                    place: place(&r)?,
                    sha256: r.try_get("sha256")?,
                    reason: r.try_get("reason")?,
                    superseded_at: r.try_get("superseded_at")?,
                });
            }
        }
        Ok(out)
    }

    /// The balance the service reported with the run's latest answer, if any did.
    pub async fn last_balance(&self, run_id: &RunId) -> Result<Option<i64>, StoreError> {
        let row: Option<(i64,)> = sqlx::query_as(
            "SELECT credits_remaining FROM attempts
             WHERE run_id = $1 AND credits_remaining IS NOT NULL
             ORDER BY finished_at DESC, id DESC LIMIT 1",
        )
        .bind(run_id)
        .fetch_optional(self.store.pool())
        .await?;
        Ok(row.map(|(b,)| b))
    }
}

/// A task as [`Report::rows`] selects it.
pub(super) fn report_task(r: &sqlx::any::AnyRow) -> Result<ReportTask, StoreError> {
    let inputs: String = r.try_get("inputs")?;
    let request: Option<String> = r.try_get("request")?;
    Ok(ReportTask {
        id: r.try_get("id")?,
        item: r.try_get("item")?,
        step: r.try_get("step")?,
        idx: u32::try_from(r.try_get::<i64, _>("idx")?).unwrap_or(0),
        operation: r.try_get("operation")?,
        inputs: serde_json::from_str(&inputs).unwrap_or_default(),
        status: TaskStatus::recorded(r.try_get("status")?)?,
        planned_credits: to_u64(r.try_get("planned_credits")?),
        credits_billed: to_u64(r.try_get("credits_billed")?),
        job_id: r.try_get("job_id")?,
        error: r.try_get("error")?,
        removed: r.try_get::<i64, _>("removed")? != 0,
        reused_from_run: r.try_get("reused_run")?,
        attempts: u32::try_from(r.try_get::<i64, _>("attempts")?).unwrap_or(0),
        request: request.and_then(|r| serde_json::from_str(&r).ok()),
    })
}
