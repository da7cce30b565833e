//! Tasks, their HTTP attempts and their outputs.

use sqlx::Row;

use crate::place::Address;
use crate::store::group::Written;
use crate::store::{Backend, Store, StoreError, now_ms, rows};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TaskStatus {
    Pending,
    /// A paid call was announced; until it is settled it may have been billed.
    Running,
    Succeeded,
    Failed,
    /// An input failed, so the task never ran.
    Blocked,
}

impl TaskStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            TaskStatus::Pending => "pending",
            TaskStatus::Running => "running",
            TaskStatus::Succeeded => "succeeded",
            TaskStatus::Failed => "failed",
            TaskStatus::Blocked => "blocked",
        }
    }

    pub(crate) fn parse(s: &str) -> TaskStatus {
        match s {
            "running" => TaskStatus::Running,
            "succeeded" => TaskStatus::Succeeded,
            "failed" => TaskStatus::Failed,
            "blocked" => TaskStatus::Blocked,
            _ => TaskStatus::Pending,
        }
    }
}

pub struct NewTask {
    pub item: String,
    pub step: String,
    pub idx: u32,
    pub operation: &'static str,
    pub inputs: String,
    pub planned_credits: u64,
    /// The request's parameters as sent, without image URLs: a compact JSON object, shown by
    /// the report. `None` when the request could not be rendered.
    pub request: Option<String>,
}

#[derive(Clone, Debug)]
pub struct TaskRow {
    pub id: i64,
    pub item: String,
    pub step: String,
    pub idx: u32,
    pub status: TaskStatus,
    pub planned_credits: u64,
    pub credits_billed: u64,
    pub job_id: Option<String>,
    pub error: Option<String>,
    /// The task's latest attempt, if it made one.
    pub last_attempt: Option<LastAttempt>,
    pub identity: Option<String>,
    /// The earlier task whose outputs this one took instead of paying (`--reuse`).
    pub reused_from: Option<i64>,
}

#[derive(Clone, Debug)]
pub struct LastAttempt {
    pub id: i64,
    /// `None` while in flight, or when the process died with the call in flight.
    pub outcome: Option<String>,
    pub job_id: Option<String>,
}

impl LastAttempt {
    /// Sent without a complete answer: it may have been billed.
    pub fn possibly_billed(&self) -> bool {
        self.outcome.as_deref().is_none_or(|o| o == "ambiguous")
    }
}

/// A paid call that came back with its job.
pub struct Settled<'a> {
    pub job_id: &'a str,
    pub credits_used: u64,
    pub credits_remaining: Option<i64>,
    /// The result URLs, in output order.
    pub urls: &'a [String],
    /// The job whose output was this call's input, for the lineage.
    pub parent_job_id: Option<&'a str>,
    /// A note kept with the attempt, e.g. that the answer was recovered by job id.
    pub note: Option<&'a str>,
}

pub enum AttemptOutcome<'a> {
    Succeeded(Settled<'a>),
    /// The service answered an error: nothing billed.
    Answered {
        status: u16,
        error: &'a str,
    },
    /// Never reached the service.
    NotSent {
        error: &'a str,
    },
    /// Sent, no complete answer: possibly billed. The job id when the partial answer named one.
    Ambiguous {
        error: &'a str,
        job_id: Option<&'a str>,
    },
}

/// A freshly signed URL for an output.
#[derive(Clone, Debug)]
pub struct UrlIssued {
    pub output_id: i64,
    pub url: String,
    pub issued_at: i64,
}

#[derive(Clone, Debug)]
pub struct OutputRow {
    pub id: i64,
    pub task_id: i64,
    pub item: String,
    pub step: String,
    pub idx: u32,
    pub k: u32,
    pub job_id: String,
    pub parent_job_id: Option<String>,
    pub url: String,
    pub url_issued_at: i64,
    pub path: Option<String>,
    pub sha256: Option<String>,
    pub bytes: Option<u64>,
    /// The store's ETag of the output's object, as uploaded, or a local file's stamp
    /// (`place::stamp`); `None` for what an imgpipe from before they were kept recorded.
    pub etag: Option<String>,
    pub download_error: Option<String>,
    /// The credits of the call that made it, shared by all of that call's outputs (0 when
    /// the output was reused from an earlier run).
    pub task_credits: u64,
}

impl OutputRow {
    /// Where the output was kept, when it was: a file or an object.
    pub fn address(&self) -> Option<Address> {
        self.path.as_deref().map(Address::recorded)
    }
}

/// What a run has done and paid, from its attempts.
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

pub(crate) fn to_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

pub(crate) fn to_u64(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// The statements that record an attempt's outcome and, for a success, settle its task and
/// record its `outputs` (returning each one's `k` and id). A task that runs again (its first job
/// fell short) replaces its outputs' records whole: the old job's file facts must not stick to
/// the new job.
///
/// Parameters: $1 now, $2 outcome, $3 HTTP status, $4 credits, $5 credits remaining, $6 job id,
/// $7 error, $8 attempt id; with a success, $9 task id, $10 run id, $11 parent job id, and one
/// URL each from $12. SQLite runs the statements as one batch; PostgreSQL takes one statement
/// per round trip, so there the updates are data-modifying parts of the insert.
fn settle_sql(backend: Backend, succeeded: bool, outputs: usize) -> String {
    let attempt = "UPDATE attempts SET finished_at = $1, outcome = $2, http_status = $3,
             credits_billed = $4, credits_remaining = $5, job_id = $6, error = $7
         WHERE id = $8";
    if !succeeded {
        return attempt.to_owned();
    }
    let task = "UPDATE tasks SET status = 'succeeded', job_id = $6, error = NULL,
             credits_billed = credits_billed + $4, updated_at = $1
         WHERE id = $9";
    let values: Vec<String> = (0..outputs)
        .map(|k| format!("($9, $10, {k}, $6, $11, ${}, $1)", 12 + k))
        .collect();
    let insert = format!(
        "INSERT INTO outputs (task_id, run_id, k, job_id, parent_job_id, url, url_issued_at)
         VALUES {}
         ON CONFLICT (task_id, k) DO UPDATE SET job_id = excluded.job_id,
             parent_job_id = excluded.parent_job_id, url = excluded.url,
             url_issued_at = excluded.url_issued_at, path = NULL,
             sha256 = NULL, bytes = NULL, downloaded_at = NULL,
             download_error = NULL
         RETURNING k, id",
        values.join(", ")
    );
    match (backend, outputs) {
        (Backend::Sqlite, 0) => format!("{attempt}; {task}"),
        (Backend::Sqlite, _) => format!("{attempt}; {task}; {insert}"),
        (Backend::Postgres, 0) => format!("WITH a AS ({attempt}) {task}"),
        (Backend::Postgres, _) => format!("WITH a AS ({attempt}), t AS ({task}) {insert}"),
    }
}

/// The intent's statements: the task is running, and its attempt is recorded (its id
/// returned). Parameters: $1 now, $2 task id, $3 run id, $4 endpoint.
fn intent_sql(backend: Backend) -> &'static str {
    match backend {
        Backend::Sqlite => {
            "UPDATE tasks SET status = 'running', updated_at = $1 WHERE id = $2;
             INSERT INTO attempts (task_id, run_id, endpoint, started_at)
             VALUES ($2, $3, $4, $1) RETURNING id"
        }
        Backend::Postgres => {
            "WITH t AS (UPDATE tasks SET status = 'running', updated_at = $1 WHERE id = $2)
             INSERT INTO attempts (task_id, run_id, endpoint, started_at)
             VALUES ($2, $3, $4, $1) RETURNING id"
        }
    }
}

impl Store {
    /// Records a run's tasks in one transaction; tasks already recorded are kept as they are.
    pub async fn insert_tasks(&self, run_id: &str, tasks: &[NewTask]) -> Result<(), StoreError> {
        let mut tx = self.pool().begin().await?;
        insert_tasks(&mut tx, self.backend, run_id, tasks).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Records tasks in one transaction and gives the row id of each one recorded (or revived
    /// after `--allow-changes` had dropped it), with its key.
    pub async fn record_tasks(
        &self,
        run_id: &str,
        tasks: &[NewTask],
    ) -> Result<Vec<(i64, String, String, u32)>, StoreError> {
        let mut tx = self.pool().begin().await?;
        let ids = insert_tasks(&mut tx, self.backend, run_id, tasks).await?;
        tx.commit().await?;
        Ok(ids)
    }

    /// Sets the planned price of tasks (after the price was discovered) by row id, one
    /// statement per 500 tasks. Not by key: PostgreSQL without statistics may find each row
    /// through `tasks_by_step` (the run and the step) rather than the unique key, reading
    /// every task of the step for each one; by id the primary key leaves no choice.
    pub async fn set_planned(&self, tasks: &[(i64, u64)]) -> Result<(), StoreError> {
        let mut tx = self.pool().begin().await?;
        for chunk in tasks.chunks(500) {
            let values = rows(self.backend, chunk.len(), 2, |p| {
                format!("({}, {})", p[0], p[1])
            });
            let sql = format!(
                "WITH v (id, credits) AS (VALUES {values})
                 UPDATE tasks SET planned_credits = v.credits FROM v WHERE tasks.id = v.id"
            );
            // Built from a fixed placeholder list: no value is ever part of the text.
            let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
            for (task_id, credits) in chunk {
                query = query.bind(task_id).bind(to_i64(*credits));
            }
            query.execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    pub async fn tasks(&self, run_id: &str) -> Result<Vec<TaskRow>, StoreError> {
        self.tasks_where(run_id, None).await
    }

    /// The run's tasks, or only those with `status`.
    pub async fn tasks_where(
        &self,
        run_id: &str,
        status: Option<TaskStatus>,
    ) -> Result<Vec<TaskRow>, StoreError> {
        let mut out = Vec::new();
        self.each_task(run_id, status, |row| out.push(row)).await?;
        Ok(out)
    }

    /// Calls `f` with each task of the run (or only those with `status`) in order, one row in
    /// memory at a time: a large run's rows are never held all at once, raw and decoded.
    pub async fn each_task(
        &self,
        run_id: &str,
        status: Option<TaskStatus>,
        mut f: impl FnMut(TaskRow),
    ) -> Result<(), StoreError> {
        let mut rows = sqlx::query(
            "SELECT t.id, t.item, t.step, t.idx, t.status, t.planned_credits, t.credits_billed,
                    t.job_id, t.error, t.identity, t.reused_from,
                    a.id AS a_id, a.outcome AS a_outcome, a.job_id AS a_job
             FROM tasks t
             LEFT JOIN attempts a ON a.id = (SELECT MAX(id) FROM attempts WHERE task_id = t.id)
             WHERE t.run_id = $1 AND t.removed_at IS NULL AND ($2 IS NULL OR t.status = $3)
             ORDER BY t.id",
        )
        .bind(run_id)
        .bind(status.map(TaskStatus::as_str))
        .bind(status.map(TaskStatus::as_str))
        .fetch(self.pool());
        while let Some(r) = futures::TryStreamExt::try_next(&mut rows).await? {
            f(task_row(&r)?);
        }
        Ok(())
    }

    /// The intent: written and committed before the paid call is sent.
    pub async fn begin_attempt(
        &self,
        run_id: &str,
        task_id: i64,
        endpoint: &str,
    ) -> Result<i64, StoreError> {
        let (run_id, endpoint) = (run_id.to_owned(), endpoint.to_owned());
        let backend = self.backend;
        let written = self
            .writer
            .write(Box::new(move |conn| {
                let (run_id, endpoint) = (run_id.clone(), endpoint.clone());
                Box::pin(async move {
                    // One round trip: the attempt's row id is what the batch returns.
                    // Every row read: sqlx's `Any` driver takes SQLite's first answer for the
                    // one a single-row fetch waits for, and here that is the update's.
                    let ids: Vec<i64> = sqlx::query_scalar(intent_sql(backend))
                        .bind(now_ms())
                        .bind(task_id)
                        .bind(&run_id)
                        .bind(&endpoint)
                        .fetch_all(&mut *conn)
                        .await?;
                    let id = ids.last().copied().ok_or(sqlx::Error::RowNotFound)?;
                    Ok(Written::Id(id))
                })
            }))
            .await?;
        match written {
            Written::Id(id) => Ok(id),
            _ => Err(StoreError::Inconsistent(
                "recording an attempt gave no attempt id".into(),
            )),
        }
    }

    /// The result, written right after the call returns. A success also settles the task and
    /// records its outputs' URLs; the returned ids are the outputs', in order.
    pub async fn finish_attempt(
        &self,
        run_id: &str,
        task_id: i64,
        attempt_id: i64,
        outcome: &AttemptOutcome<'_>,
    ) -> Result<Vec<i64>, StoreError> {
        let owned = |v: Option<&str>| v.map(str::to_owned);
        let (name, status, credits, remaining, job, error) = match outcome {
            AttemptOutcome::Succeeded(s) => (
                "succeeded",
                None,
                to_i64(s.credits_used),
                s.credits_remaining,
                Some(s.job_id.to_owned()),
                owned(s.note),
            ),
            AttemptOutcome::Answered { status, error } => (
                "answered_error",
                Some(i64::from(*status)),
                0,
                None,
                None,
                Some((*error).to_owned()),
            ),
            AttemptOutcome::NotSent { error } => {
                ("not_sent", None, 0, None, None, Some((*error).to_owned()))
            }
            AttemptOutcome::Ambiguous { error, job_id } => (
                "ambiguous",
                None,
                0,
                None,
                owned(*job_id),
                Some((*error).to_owned()),
            ),
        };
        let settled = match outcome {
            AttemptOutcome::Succeeded(s) => Some((s.urls.to_vec(), owned(s.parent_job_id))),
            _ => None,
        };
        let run_id = run_id.to_owned();
        let backend = self.backend;
        let written = self
            .writer
            .write(Box::new(move |conn| {
                let (run_id, job, error, settled) =
                    (run_id.clone(), job.clone(), error.clone(), settled.clone());
                Box::pin(async move {
                    let outputs = settled.as_ref().map_or(0, |(urls, ..)| urls.len());
                    // One round trip for the attempt, the task and its outputs.
                    let sql = sqlx::AssertSqlSafe(settle_sql(backend, settled.is_some(), outputs));
                    let mut query = sqlx::query_as::<_, (i64, i64)>(sql)
                        .bind(now_ms())
                        .bind(name)
                        .bind(status)
                        .bind(credits)
                        .bind(remaining)
                        .bind(job)
                        .bind(error)
                        .bind(attempt_id);
                    if let Some((urls, parent)) = settled {
                        query = query.bind(task_id);
                        if !urls.is_empty() {
                            query = query.bind(run_id).bind(parent);
                        }
                        for url in urls {
                            query = query.bind(url);
                        }
                    }
                    let mut ids = query.fetch_all(&mut *conn).await?;
                    ids.sort_unstable();
                    Ok(Written::Ids(ids.into_iter().map(|(_, id)| id).collect()))
                })
            }))
            .await?;
        match written {
            Written::Ids(ids) => Ok(ids),
            _ => Err(StoreError::Inconsistent(
                "recording a result gave no output ids".into(),
            )),
        }
    }

    /// Marks a task pending, failed or blocked, with the reason.
    pub async fn set_task_status(
        &self,
        task_ids: &[i64],
        status: TaskStatus,
        error: Option<&str>,
    ) -> Result<(), StoreError> {
        let (ids, error) = (task_ids.to_vec(), error.map(str::to_owned));
        self.writer
            .write(Box::new(move |conn| {
                let (ids, error) = (ids.clone(), error.clone());
                Box::pin(async move {
                    let now = now_ms();
                    for id in ids {
                        sqlx::query(
                            "UPDATE tasks SET status = $1, error = $2, updated_at = $3 WHERE id = $4",
                        )
                        .bind(status.as_str())
                        .bind(&error)
                        .bind(now)
                        .bind(id)
                        .execute(&mut *conn)
                        .await?;
                    }
                    Ok(Written::Done)
                })
            }))
            .await?;
        Ok(())
    }

    /// Attempts announced and never settled: calls in flight when a process died.
    pub async fn settle_orphaned_attempts(&self, run_id: &str) -> Result<u64, StoreError> {
        let mut tx = self.pool().begin().await?;
        let done = sqlx::query(
            "UPDATE attempts SET outcome = 'ambiguous', finished_at = $1,
                 error = 'in flight when the run stopped; it may have been billed'
             WHERE run_id = $2 AND outcome IS NULL",
        )
        .bind(now_ms())
        .bind(run_id)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        sqlx::query("UPDATE tasks SET status = 'pending' WHERE run_id = $1 AND status = 'running'")
            .bind(run_id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(done)
    }

    /// Records an output's file (or object) once it is whole; `etag` is the store's ETag of
    /// an object, which a resume compares with the bucket's listing, or a file's stamp
    /// (`place::stamp`), which it compares with the file's.
    pub async fn record_download(
        &self,
        output_id: i64,
        path: &str,
        sha256: &str,
        bytes: u64,
        etag: Option<&str>,
    ) -> Result<(), StoreError> {
        let (path, sha256, etag) = (path.to_owned(), sha256.to_owned(), etag.map(str::to_owned));
        self.writer
            .write(Box::new(move |conn| {
                let (path, sha256, etag) = (path.clone(), sha256.clone(), etag.clone());
                Box::pin(async move {
                    sqlx::query(
                        "UPDATE outputs SET path = $1, sha256 = $2, bytes = $3, downloaded_at = $4,
                             download_error = NULL, etag = $5
                         WHERE id = $6",
                    )
                    .bind(&path)
                    .bind(&sha256)
                    .bind(to_i64(bytes))
                    .bind(now_ms())
                    .bind(&etag)
                    .bind(output_id)
                    .execute(&mut *conn)
                    .await?;
                    Ok(Written::Done)
                })
            }))
            .await?;
        Ok(())
    }

    pub async fn record_download_error(
        &self,
        output_id: i64,
        error: &str,
    ) -> Result<(), StoreError> {
        let error = error.to_owned();
        self.writer
            .write(Box::new(move |conn| {
                let error = error.clone();
                Box::pin(async move {
                    sqlx::query("UPDATE outputs SET download_error = $1 WHERE id = $2")
                        .bind(&error)
                        .bind(output_id)
                        .execute(&mut *conn)
                        .await?;
                    Ok(Written::Done)
                })
            }))
            .await?;
        Ok(())
    }

    pub async fn refresh_urls(&self, fresh: &[UrlIssued]) -> Result<(), StoreError> {
        let fresh = fresh.to_vec();
        self.writer
            .write(Box::new(move |conn| {
                let fresh = fresh.clone();
                Box::pin(async move {
                    for f in fresh {
                        sqlx::query(
                            "UPDATE outputs SET url = $1, url_issued_at = $2 WHERE id = $3",
                        )
                        .bind(&f.url)
                        .bind(f.issued_at)
                        .bind(f.output_id)
                        .execute(&mut *conn)
                        .await?;
                    }
                    Ok(Written::Done)
                })
            }))
            .await?;
        Ok(())
    }

    pub async fn outputs(&self, run_id: &str) -> Result<Vec<OutputRow>, StoreError> {
        let mut out = Vec::new();
        self.each_output(run_id, false, |o| {
            out.push(o);
            Ok(())
        })
        .await?;
        Ok(out)
    }

    /// Calls `f` with each output of the run in order, one row in memory at a time; only the
    /// failed downloads with `failed_only`.
    pub async fn each_output(
        &self,
        run_id: &str,
        failed_only: bool,
        mut f: impl FnMut(OutputRow) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        use futures::TryStreamExt;
        let sql = format!(
            "SELECT {OUTPUT_COLUMNS}
             FROM outputs o JOIN tasks t ON t.id = o.task_id
             WHERE o.run_id = $1
               AND (NOT $2 OR (o.path IS NULL AND o.download_error IS NOT NULL))
             ORDER BY t.id, o.k"
        );
        // A fixed text: no value is ever part of it.
        let mut rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(run_id)
            .bind(failed_only)
            .fetch(self.pool());
        while let Some(r) = rows.try_next().await? {
            f(output_row(&r)?)?;
        }
        Ok(())
    }

    /// The run's outputs with no file or object (a download that failed, was cut by a kill,
    /// or was set aside to be fetched again), whole: few, and each to be downloaded.
    pub async fn unstored_outputs(&self, run_id: &str) -> Result<Vec<OutputRow>, StoreError> {
        let sql = format!(
            "SELECT {OUTPUT_COLUMNS}
             FROM outputs o JOIN tasks t ON t.id = o.task_id
             WHERE o.run_id = $1 AND o.path IS NULL
             ORDER BY t.id, o.k"
        );
        // A fixed text: no value is ever part of it.
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(run_id)
            .fetch_all(self.pool())
            .await?;
        rows.iter().map(output_row).collect()
    }

    pub async fn totals(&self, run_id: &str) -> Result<Totals, StoreError> {
        let t = sqlx::query(
            "SELECT COUNT(*) AS tasks,
                    COUNT(*) FILTER (WHERE status = 'succeeded') AS succeeded,
                    COUNT(*) FILTER (WHERE status = 'failed') AS failed,
                    COUNT(*) FILTER (WHERE status = 'blocked') AS blocked,
                    COUNT(*) FILTER (WHERE status IN ('pending', 'running')) AS pending,
                    CAST(COALESCE(SUM(planned_credits), 0) AS BIGINT) AS planned
             FROM tasks WHERE run_id = $1 AND removed_at IS NULL",
        )
        .bind(run_id)
        .fetch_one(self.pool())
        .await?;
        let a = sqlx::query(
            "SELECT CAST(COALESCE(SUM(a.credits_billed), 0) AS BIGINT) AS billed,
                    COUNT(*) FILTER (WHERE a.outcome = 'ambiguous' OR a.outcome IS NULL)
                        AS ambiguous,
                    CAST(COALESCE(SUM(CASE WHEN a.outcome = 'ambiguous' OR a.outcome IS NULL
                                 THEN t.planned_credits ELSE 0 END), 0) AS BIGINT) AS possibly
             FROM attempts a JOIN tasks t ON t.id = a.task_id WHERE a.run_id = $1",
        )
        .bind(run_id)
        .fetch_one(self.pool())
        .await?;
        let o = sqlx::query(
            "SELECT COUNT(*) AS outputs,
                    COUNT(*) FILTER (WHERE path IS NOT NULL) AS downloaded,
                    COUNT(*) FILTER (WHERE path IS NULL AND download_error IS NOT NULL)
                        AS failures
             FROM outputs WHERE run_id = $1",
        )
        .bind(run_id)
        .fetch_one(self.pool())
        .await?;
        let n = |row: &sqlx::any::AnyRow, c: &str| -> Result<u64, StoreError> {
            Ok(to_u64(row.try_get::<i64, _>(c)?))
        };
        Ok(Totals {
            tasks: n(&t, "tasks")?,
            succeeded: n(&t, "succeeded")?,
            failed: n(&t, "failed")?,
            blocked: n(&t, "blocked")?,
            pending: n(&t, "pending")?,
            planned_credits: n(&t, "planned")?,
            billed_credits: n(&a, "billed")?,
            ambiguous_attempts: n(&a, "ambiguous")?,
            possibly_billed_credits: n(&a, "possibly")?,
            outputs: n(&o, "outputs")?,
            downloaded: n(&o, "downloaded")?,
            download_failures: n(&o, "failures")?,
        })
    }
}

/// The columns of an [`OutputRow`], read from `outputs o JOIN tasks t ON t.id = o.task_id`.
pub(crate) const OUTPUT_COLUMNS: &str =
    "o.id, o.task_id, t.item, t.step, t.idx, o.k, o.job_id, o.parent_job_id, o.url,
     o.url_issued_at, o.path, o.sha256, o.bytes, o.etag, o.download_error,
     COALESCE((SELECT a.credits_billed FROM attempts a
               WHERE a.task_id = o.task_id AND a.job_id = o.job_id
                 AND a.outcome = 'succeeded'
               ORDER BY a.id DESC LIMIT 1), 0) AS credits_billed";

/// An output row as [`OUTPUT_COLUMNS`] selects it.
pub(crate) fn output_row(r: &sqlx::any::AnyRow) -> Result<OutputRow, StoreError> {
    Ok(OutputRow {
        id: r.try_get("id")?,
        task_id: r.try_get("task_id")?,
        item: r.try_get("item")?,
        step: r.try_get("step")?,
        idx: u32::try_from(r.try_get::<i64, _>("idx")?).unwrap_or(0),
        k: u32::try_from(r.try_get::<i64, _>("k")?).unwrap_or(0),
        job_id: r.try_get("job_id")?,
        parent_job_id: r.try_get("parent_job_id")?,
        url: r.try_get("url")?,
        url_issued_at: r.try_get("url_issued_at")?,
        path: r.try_get("path")?,
        sha256: r.try_get("sha256")?,
        bytes: r.try_get::<Option<i64>, _>("bytes")?.map(to_u64),
        etag: r.try_get("etag")?,
        download_error: r.try_get("download_error")?,
        task_credits: to_u64(r.try_get("credits_billed")?),
    })
}

/// A task row as [`Store::tasks_where`] selects it.
pub(super) fn task_row(r: &sqlx::any::AnyRow) -> Result<TaskRow, StoreError> {
    Ok(TaskRow {
        id: r.try_get("id")?,
        item: r.try_get("item")?,
        step: r.try_get("step")?,
        idx: u32::try_from(r.try_get::<i64, _>("idx")?).unwrap_or(0),
        status: TaskStatus::parse(r.try_get("status")?),
        planned_credits: to_u64(r.try_get("planned_credits")?),
        credits_billed: to_u64(r.try_get("credits_billed")?),
        job_id: r.try_get("job_id")?,
        error: r.try_get("error")?,
        last_attempt: match r.try_get::<Option<i64>, _>("a_id")? {
            Some(id) => Some(LastAttempt {
                id,
                outcome: r.try_get("a_outcome")?,
                job_id: r.try_get("a_job")?,
            }),
            None => None,
        },
        identity: r.try_get("identity")?,
        reused_from: r.try_get("reused_from")?,
    })
}

/// Rows per INSERT: one statement per row made recording a large batch's tasks take seconds
/// (each statement is a round trip to the database's thread); 100 rows bind 900 values,
/// within any SQLite's limit (999 before 3.32).
const ROWS_PER_INSERT: usize = 100;

/// Records tasks within `tx`; tasks already recorded are kept as they are.
pub(crate) async fn insert_tasks(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    backend: Backend,
    run_id: &str,
    tasks: &[NewTask],
) -> Result<Vec<(i64, String, String, u32)>, StoreError> {
    let now = now_ms();
    let mut ids = Vec::with_capacity(tasks.len());
    for chunk in tasks.chunks(ROWS_PER_INSERT) {
        let values = rows(backend, chunk.len(), 9, |p| {
            format!(
                "({}, {}, {}, {}, {}, {}, {}, {}, 'pending', {})",
                p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8]
            )
        });
        // A task that `--allow-changes` dropped and a later change brought back is the same
        // row, revived; a live task is left as it is.
        let sql = format!(
            "INSERT INTO tasks (run_id, item, step, idx, operation, inputs, planned_credits,
                 request, status, updated_at)
             VALUES {values}
             ON CONFLICT (run_id, item, step, idx) DO UPDATE SET removed_at = NULL,
                 status = 'pending', operation = excluded.operation, inputs = excluded.inputs,
                 request = excluded.request, planned_credits = excluded.planned_credits, identity = NULL, job_id = NULL,
                 error = NULL, reused_from = NULL, updated_at = excluded.updated_at
             WHERE tasks.removed_at IS NOT NULL
             RETURNING id, item, step, idx"
        );
        // Built from a fixed placeholder list: no value is ever part of the text.
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for t in chunk {
            query = query
                .bind(run_id)
                .bind(&t.item)
                .bind(&t.step)
                .bind(i64::from(t.idx))
                .bind(t.operation)
                .bind(&t.inputs)
                .bind(to_i64(t.planned_credits))
                .bind(t.request.as_deref())
                .bind(now);
        }
        for row in query.fetch_all(&mut **tx).await? {
            ids.push((
                row.try_get("id")?,
                row.try_get("item")?,
                row.try_get("step")?,
                u32::try_from(row.try_get::<i64, _>("idx")?).unwrap_or(0),
            ));
        }
    }
    Ok(ids)
}
