//! Tasks: one row per (item, step, index) of a run, with its planned price, its status and
//! the job that made its outputs. A part of the store ([`Store::tasks`]).

use sqlx::Row;

use crate::api::job_id::JobId;
use crate::run_id::RunId;
use crate::store::attempts::CallOutcome;
use crate::store::group::Written;
use crate::store::{AttemptId, Backend, Store, StoreError, TaskId, now_ms, rows, to_i64, to_u64};
use crate::task_key::TaskKey;

pub(crate) use crate::store::outputs::{OUTPUT_COLUMNS, output_row};

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

    /// The status a word names; `None` for any other word (the desk's filter, say).
    pub fn parse(s: &str) -> Option<TaskStatus> {
        Some(match s {
            "pending" => TaskStatus::Pending,
            "running" => TaskStatus::Running,
            "succeeded" => TaskStatus::Succeeded,
            "failed" => TaskStatus::Failed,
            "blocked" => TaskStatus::Blocked,
            _ => return None,
        })
    }

    /// A task row's status. A word this build does not know is an error, never read as
    /// pending: a pending task is paid for by the next resume.
    pub(crate) fn recorded(s: &str) -> Result<TaskStatus, StoreError> {
        TaskStatus::parse(s).ok_or_else(|| {
            StoreError::Inconsistent(format!(
                "a task's status is `{s}`, which this imgpipe does not know (a database written by a newer imgpipe, or edited by hand)"
            ))
        })
    }
}

pub struct NewTask {
    /// The task it records: `item/step[index]`.
    pub key: TaskKey,
    pub operation: &'static str,
    pub inputs: String,
    pub planned_credits: u64,
    /// The request's parameters as sent, without image URLs: a compact JSON object, shown by
    /// the report. `None` when the request could not be rendered.
    pub request: Option<String>,
}

#[derive(Clone, Debug)]
pub struct RecordedTask {
    pub id: TaskId,
    pub key: TaskKey,
    pub status: TaskStatus,
    pub planned_credits: u64,
    pub credits_billed: u64,
    pub job_id: Option<JobId>,
    pub error: Option<String>,
    /// The task's latest attempt, if it made one.
    pub last_attempt: Option<LastAttempt>,
    pub identity: Option<String>,
    /// The earlier task whose outputs this one took instead of paying (`--reuse`).
    pub reused_from: Option<TaskId>,
}

#[derive(Clone, Debug)]
pub struct LastAttempt {
    pub id: AttemptId,
    /// `None` while in flight, or when the process died with the call in flight.
    pub outcome: Option<CallOutcome>,
    pub job_id: Option<JobId>,
}

impl LastAttempt {
    /// Sent without a complete answer: it may have been billed.
    pub fn possibly_billed(&self) -> bool {
        self.outcome.is_none_or(|o| o == CallOutcome::Ambiguous)
    }
}

/// The run's tasks: what is recorded of each, and the statements that change them.
#[derive(Clone, Copy, Debug)]
pub struct Tasks<'a> {
    pub(super) store: &'a Store,
}

impl Tasks<'_> {
    /// Records a run's tasks in one transaction; tasks already recorded are kept as they are.
    pub async fn insert(&self, run_id: &RunId, tasks: &[NewTask]) -> Result<(), StoreError> {
        let mut tx = self.store.pool().begin().await?;
        insert_tasks(&mut tx, self.store.backend(), run_id, tasks).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Records tasks in one transaction and gives the row id of each one recorded (or revived
    /// after `--allow-changes` had dropped it), with its key.
    pub async fn record(
        &self,
        run_id: &RunId,
        tasks: &[NewTask],
    ) -> Result<Vec<(TaskId, TaskKey)>, StoreError> {
        let mut tx = self.store.pool().begin().await?;
        let ids = insert_tasks(&mut tx, self.store.backend(), run_id, tasks).await?;
        tx.commit().await?;
        Ok(ids)
    }

    /// Sets the planned price of tasks (after the price was discovered) by row id, one
    /// statement per 500 tasks. Not by key: PostgreSQL without statistics may find each row
    /// through `tasks_by_step` (the run and the step) rather than the unique key, reading
    /// every task of the step for each one; by id the primary key leaves no choice.
    pub async fn set_planned(&self, tasks: &[(TaskId, u64)]) -> Result<(), StoreError> {
        let mut tx = self.store.pool().begin().await?;
        for chunk in tasks.chunks(500) {
            let values = rows(self.store.backend(), chunk.len(), 2, |p| {
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

    pub async fn all(&self, run_id: &RunId) -> Result<Vec<RecordedTask>, StoreError> {
        self.with_status(run_id, None).await
    }

    /// The run's tasks, or only those with `status`.
    pub async fn with_status(
        &self,
        run_id: &RunId,
        status: Option<TaskStatus>,
    ) -> Result<Vec<RecordedTask>, StoreError> {
        let mut out = Vec::new();
        self.each(run_id, status, |row| out.push(row)).await?;
        Ok(out)
    }

    /// Calls `f` with each task of the run (or only those with `status`) in order, one row in
    /// memory at a time: a large run's rows are never held all at once, raw and decoded.
    pub async fn each(
        &self,
        run_id: &RunId,
        status: Option<TaskStatus>,
        mut f: impl FnMut(RecordedTask),
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
        .fetch(self.store.pool());
        while let Some(r) = futures::TryStreamExt::try_next(&mut rows).await? {
            f(task_row(&r)?);
        }
        Ok(())
    }

    /// Marks a task pending, failed or blocked, with the reason.
    pub async fn set_status(
        &self,
        task_ids: &[TaskId],
        status: TaskStatus,
        error: Option<&str>,
    ) -> Result<(), StoreError> {
        let (ids, error) = (task_ids.to_vec(), error.map(str::to_owned));
        self.store.writer
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
}

/// A task row as [`Tasks::with_status`] selects it.
pub(super) fn task_row(r: &sqlx::any::AnyRow) -> Result<RecordedTask, StoreError> {
    Ok(RecordedTask {
        id: r.try_get("id")?,
        key: key_of(r)?,
        status: TaskStatus::recorded(r.try_get("status")?)?,
        planned_credits: to_u64(r.try_get("planned_credits")?),
        credits_billed: to_u64(r.try_get("credits_billed")?),
        job_id: r.try_get("job_id")?,
        error: r.try_get("error")?,
        last_attempt: match r.try_get::<Option<AttemptId>, _>("a_id")? {
            Some(id) => Some(LastAttempt {
                id,
                outcome: r
                    .try_get::<Option<String>, _>("a_outcome")?
                    .as_deref()
                    .map(CallOutcome::parse),
                job_id: r.try_get("a_job")?,
            }),
            None => None,
        },
        identity: r.try_get("identity")?,
        reused_from: r.try_get("reused_from")?,
    })
}

/// A task's key as a row selects it (`item`, `step`, `idx`).
pub(crate) fn key_of(r: &sqlx::any::AnyRow) -> Result<TaskKey, StoreError> {
    Ok(TaskKey::new(
        r.try_get::<String, _>("item")?,
        r.try_get::<String, _>("step")?,
        u32::try_from(r.try_get::<i64, _>("idx")?).unwrap_or(0),
    ))
}

/// Rows per INSERT: one statement per row made recording a large batch's tasks take seconds
/// (each statement is a round trip to the database's thread); 100 rows bind 900 values,
/// within any SQLite's limit (999 before 3.32).
const ROWS_PER_INSERT: usize = 100;

/// Records tasks within `tx`; tasks already recorded are kept as they are.
pub(crate) async fn insert_tasks(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    backend: Backend,
    run_id: &RunId,
    tasks: &[NewTask],
) -> Result<Vec<(TaskId, TaskKey)>, StoreError> {
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
                .bind(&t.key.item)
                .bind(&t.key.step)
                .bind(i64::from(t.key.index))
                .bind(t.operation)
                .bind(&t.inputs)
                .bind(to_i64(t.planned_credits))
                .bind(t.request.as_deref())
                .bind(now);
        }
        for row in query.fetch_all(&mut **tx).await? {
            ids.push((row.try_get("id")?, key_of(&row)?));
        }
    }
    Ok(ids)
}
