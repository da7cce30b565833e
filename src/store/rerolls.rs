//! Rerolls as the record keeps them: written in the transaction that resets their tasks
//! ([`crate::store::Revisions::apply`]) with a copy of what they reset, looked up by what they
//! named, ended when all their tasks are done, or undone from that copy when they could not be
//! done (nothing of them billed, none of their tasks done).

use crate::run_id::RunId;
use sqlx::{AnyConnection, AnyPool, Row};

use crate::store::{RerollId, RunStatus, StoreError, SupersededId, TaskId, now_ms};
use crate::task_key::TaskKey;

/// A reroll to record with the review that resets its tasks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NewReroll {
    /// Its targets, sorted: `lamp mug/clean[0]`.
    pub said: String,
    /// The row ids of the tasks it resets.
    pub task_ids: Vec<TaskId>,
    /// The run as it was before the reroll reopened it: what an undone reroll gives back.
    pub before: Option<RunBefore>,
}

/// A run's status, stop reason and end, as a reroll found them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunBefore {
    pub status: RunStatus,
    pub stop_reason: Option<String>,
    pub finished_at: Option<i64>,
}

/// A reroll undone ([`crate::store::Revisions::undo_reroll`]): the record is as it was before
/// it; its files are to move back from `_superseded/`.
#[derive(Clone, Debug)]
pub struct Undone {
    /// Each set-aside file's place under `_superseded/`, and its place as an output again.
    pub moves: Vec<(String, String)>,
    /// The first of its tasks that failed, and why when the record says, as it said before
    /// the undo.
    pub failed: Option<(TaskKey, Option<String>)>,
    /// The HTTP status of that task's last call, when it was answered.
    pub http_status: Option<i64>,
    /// The run's status, given back.
    pub status: RunStatus,
}

/// A reroll recorded and not ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenReroll {
    pub id: RerollId,
    pub task_ids: Vec<TaskId>,
}

/// Records `reroll` at `now`, with a copy of the rows it is about to reset or set aside: call it
/// in the transaction that resets them, before it does.
pub(super) async fn insert(
    conn: &mut AnyConnection,
    run_id: &RunId,
    reroll: &NewReroll,
    now: i64,
) -> Result<(), StoreError> {
    let ids = serde_json::to_string(&reroll.task_ids).unwrap_or_else(|_| "[]".into());
    let before = reroll.before.as_ref();
    let id: RerollId = sqlx::query(
        "INSERT INTO rerolls (run_id, said, task_ids, created_at, status_before,
             stop_reason_before, finished_at_before)
         VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING id",
    )
    .bind(run_id)
    .bind(&reroll.said)
    .bind(ids)
    .bind(now)
    .bind(before.map(|b| b.status.as_str()))
    .bind(before.and_then(|b| b.stop_reason.as_deref()))
    .bind(before.and_then(|b| b.finished_at))
    .fetch_one(&mut *conn)
    .await?
    .try_get("id")?;
    for task_id in &reroll.task_ids {
        copy_before(conn, id, *task_id).await?;
    }
    Ok(())
}

/// Copies task `task_id`'s row and its outputs' rows as reroll `reroll_id` found them.
async fn copy_before(
    conn: &mut AnyConnection,
    reroll_id: RerollId,
    task_id: TaskId,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO reroll_tasks_before (reroll_id, task_id, operation, inputs, planned_credits,
             status, credits_billed, job_id, error, identity, removed_at, reused_from, request,
             updated_at)
         SELECT $1, id, operation, inputs, planned_credits, status, credits_billed, job_id,
             error, identity, removed_at, reused_from, request, updated_at
         FROM tasks WHERE id = $2",
    )
    .bind(reroll_id)
    .bind(task_id)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "INSERT INTO reroll_outputs_before (reroll_id, id, task_id, run_id, k, job_id,
             parent_job_id, url, url_issued_at, path, sha256, bytes, downloaded_at,
             download_error, etag)
         SELECT $1, id, task_id, run_id, k, job_id, parent_job_id, url, url_issued_at, path,
             sha256, bytes, downloaded_at, download_error, etag
         FROM outputs WHERE task_id = $2",
    )
    .bind(reroll_id)
    .bind(task_id)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// The latest reroll of run `run_id` that named `said` and has not ended.
pub(super) async fn open(
    pool: &AnyPool,
    run_id: &RunId,
    said: &str,
) -> Result<Option<OpenReroll>, StoreError> {
    let row = sqlx::query(
        "SELECT id, task_ids FROM rerolls
             WHERE run_id = $1 AND said = $2 AND finished_at IS NULL
             ORDER BY id DESC LIMIT 1",
    )
    .bind(run_id)
    .bind(said)
    .fetch_optional(pool)
    .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    let text: String = row.try_get("task_ids")?;
    let task_ids = serde_json::from_str(&text)
        .map_err(|e| StoreError::Inconsistent(format!("reroll's task ids do not read: {e}")))?;
    Ok(Some(OpenReroll {
        id: row.try_get("id")?,
        task_ids,
    }))
}

/// Ends the open rerolls of run `run_id` that named `said`: all their tasks are done.
pub(super) async fn finish(pool: &AnyPool, run_id: &RunId, said: &str) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE rerolls SET finished_at = $1
             WHERE run_id = $2 AND said = $3 AND finished_at IS NULL",
    )
    .bind(now_ms())
    .bind(run_id)
    .bind(said)
    .execute(pool)
    .await?;
    Ok(())
}

/// The open reroll of run `run_id` that named `said`, with when it was made and the run's
/// status before it; `None` when there is none, or it was recorded before its copy was kept.
async fn undoable(
    conn: &mut AnyConnection,
    run_id: &RunId,
    said: &str,
) -> Result<Option<(RerollId, i64, RunBefore)>, StoreError> {
    let row = sqlx::query(
        "SELECT id, created_at, status_before, stop_reason_before, finished_at_before
         FROM rerolls
         WHERE run_id = $1 AND said = $2 AND finished_at IS NULL AND status_before IS NOT NULL
         ORDER BY id DESC LIMIT 1",
    )
    .bind(run_id)
    .bind(said)
    .fetch_optional(&mut *conn)
    .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    let status: String = row.try_get("status_before")?;
    let status = RunStatus::recorded(&status)?;
    let before = RunBefore {
        status,
        stop_reason: row.try_get("stop_reason_before")?,
        finished_at: row.try_get("finished_at_before")?,
    };
    Ok(Some((
        row.try_get("id")?,
        row.try_get("created_at")?,
        before,
    )))
}

/// Whether reroll `id` (made at `since`) did anything that must be kept: a call of one of its
/// tasks billed, possibly billed or in flight, or one of its tasks done.
async fn did_something(
    conn: &mut AnyConnection,
    id: RerollId,
    since: i64,
) -> Result<bool, StoreError> {
    let calls: i64 = sqlx::query(
        "SELECT COUNT(*) AS n FROM attempts a
         JOIN reroll_tasks_before b ON b.task_id = a.task_id AND b.reroll_id = $1
         WHERE a.started_at >= $2
           AND (a.outcome IS NULL OR a.outcome IN ('succeeded', 'ambiguous')
                OR a.credits_billed > 0)",
    )
    .bind(id)
    .bind(since)
    .fetch_one(&mut *conn)
    .await?
    .try_get("n")?;
    let done: i64 = sqlx::query(
        "SELECT COUNT(*) AS n FROM tasks t
         JOIN reroll_tasks_before b ON b.task_id = t.id AND b.reroll_id = $1
         WHERE t.status IN ('succeeded', 'running')",
    )
    .bind(id)
    .fetch_one(&mut *conn)
    .await?
    .try_get("n")?;
    Ok(calls > 0 || done > 0)
}

/// The first of reroll `id`'s tasks that failed, why, and its last call's HTTP status.
async fn first_failure(
    conn: &mut AnyConnection,
    id: RerollId,
) -> Result<(Option<(TaskKey, Option<String>)>, Option<i64>), StoreError> {
    let row = sqlx::query(
        "SELECT t.id, t.item, t.step, t.idx, t.error FROM tasks t
         JOIN reroll_tasks_before b ON b.task_id = t.id AND b.reroll_id = $1
         WHERE t.status = 'failed' ORDER BY t.id LIMIT 1",
    )
    .bind(id)
    .fetch_optional(&mut *conn)
    .await?;
    let Some(row) = row else {
        return Ok((None, None));
    };
    let task_id: TaskId = row.try_get("id")?;
    let idx: i64 = row.try_get("idx")?;
    let key = TaskKey::new(
        row.try_get::<String, _>("item")?,
        row.try_get::<String, _>("step")?,
        u32::try_from(idx).unwrap_or(u32::MAX),
    );
    let error: Option<String> = row.try_get("error")?;
    let status: Option<i64> =
        sqlx::query("SELECT http_status FROM attempts WHERE task_id = $1 ORDER BY id DESC LIMIT 1")
            .bind(task_id)
            .fetch_optional(&mut *conn)
            .await?
            .map(|r| r.try_get("http_status"))
            .transpose()?
            .flatten();
    Ok((Some((key, error)), status))
}

/// Undoes the open reroll of run `run_id` that named `said` when it did nothing that must be
/// kept ([`did_something`]): its tasks' and outputs' rows written back as it found them, the
/// rows it set aside forgotten, the run's status given back, the reroll and its copy forgotten.
/// Gives the file moves to make once committed; `None` (and nothing changed) otherwise.
pub(super) async fn undo(
    conn: &mut AnyConnection,
    run_id: &RunId,
    said: &str,
) -> Result<Option<Undone>, StoreError> {
    let Some((id, since, before)) = undoable(conn, run_id, said).await? else {
        return Ok(None);
    };
    if did_something(conn, id, since).await? {
        return Ok(None);
    }
    let (failed, http_status) = first_failure(conn, id).await?;
    let moves = set_aside_since(conn, run_id, id, since).await?;
    restore_rows(conn, id).await?;
    sqlx::query("UPDATE runs SET status = $1, stop_reason = $2, finished_at = $3 WHERE id = $4")
        .bind(before.status.as_str())
        .bind(&before.stop_reason)
        .bind(before.finished_at)
        .bind(run_id)
        .execute(&mut *conn)
        .await?;
    for sql in [
        "DELETE FROM reroll_tasks_before WHERE reroll_id = $1",
        "DELETE FROM reroll_outputs_before WHERE reroll_id = $1",
        "DELETE FROM rerolls WHERE id = $1",
    ] {
        sqlx::query(sql).bind(id).execute(&mut *conn).await?;
    }
    Ok(Some(Undone {
        moves,
        failed,
        http_status,
        status: before.status,
    }))
}

/// Forgets the rows reroll `id` (made at `since`) set aside, and their journaled moves; gives
/// each file's way back: from under `_superseded/` to its place as an output.
async fn set_aside_since(
    conn: &mut AnyConnection,
    run_id: &RunId,
    id: RerollId,
    since: i64,
) -> Result<Vec<(String, String)>, StoreError> {
    let rows = sqlx::query(
        "SELECT s.id, s.path AS aside, o.path AS home FROM superseded_outputs s
         JOIN reroll_outputs_before o ON o.task_id = s.task_id AND o.k = s.k AND o.reroll_id = $1
         WHERE s.run_id = $2 AND s.superseded_at >= $3",
    )
    .bind(id)
    .bind(run_id)
    .bind(since)
    .fetch_all(&mut *conn)
    .await?;
    let mut moves = Vec::new();
    for row in rows {
        let superseded: SupersededId = row.try_get("id")?;
        for sql in [
            "DELETE FROM pending_moves WHERE superseded_id = $1",
            "DELETE FROM superseded_outputs WHERE id = $1",
        ] {
            sqlx::query(sql)
                .bind(superseded)
                .execute(&mut *conn)
                .await?;
        }
        let aside: Option<String> = row.try_get("aside")?;
        let home: Option<String> = row.try_get("home")?;
        moves.extend(aside.zip(home));
    }
    Ok(moves)
}

/// Writes back reroll `id`'s copy of its tasks' and outputs' rows.
async fn restore_rows(conn: &mut AnyConnection, id: RerollId) -> Result<(), StoreError> {
    let statements = [
        "DELETE FROM outputs WHERE task_id IN
             (SELECT task_id FROM reroll_tasks_before WHERE reroll_id = $1)",
        "INSERT INTO outputs (id, task_id, run_id, k, job_id, parent_job_id, url, url_issued_at,
             path, sha256, bytes, downloaded_at, download_error, etag)
         SELECT id, task_id, run_id, k, job_id, parent_job_id, url, url_issued_at, path, sha256,
             bytes, downloaded_at, download_error, etag
         FROM reroll_outputs_before WHERE reroll_id = $1",
        "UPDATE tasks SET operation = b.operation, inputs = b.inputs,
             planned_credits = b.planned_credits, status = b.status,
             credits_billed = b.credits_billed, job_id = b.job_id, error = b.error,
             identity = b.identity, removed_at = b.removed_at, reused_from = b.reused_from,
             request = b.request, updated_at = b.updated_at
         FROM reroll_tasks_before b WHERE b.task_id = tasks.id AND b.reroll_id = $1",
    ];
    for sql in statements {
        sqlx::query(sql).bind(id).execute(&mut *conn).await?;
    }
    Ok(())
}
