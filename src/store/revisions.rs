//! A resume's revisions of the record (tasks reset, added, dropped, left failed or reused,
//! outputs set aside), written in one transaction, and the journal of the file and object
//! moves that go with them.

use crate::run_id::RunId;
use sqlx::{AnyConnection, Row};

use crate::api::job_id::JobId;
use crate::sha256::Sha256Sum;
use crate::store::identities::Reusable;
use crate::store::tasks::{NewTask, insert_tasks};
use crate::store::to_i64;
use crate::store::{MoveId, OutputId, Store, StoreError, SupersededId, TaskId, now_ms, rerolls};
use crate::task_key::TaskKey;

/// An output set aside by a resume: its row moves to `superseded_outputs`, and its file (or
/// object), when it has one, is to move from `from` to `to`: a move journaled with the change
/// and made after the commit (see [`Revisions::apply`]).
pub struct SetAside {
    pub output_id: OutputId,
    /// The file's recorded place, and where it goes.
    pub from: Option<String>,
    pub to: Option<String>,
    /// The sha256 of the bytes there, when they differ from the recorded ones.
    pub sha256: Option<Sha256Sum>,
    pub reason: String,
    /// Keep the output (its job is still the task's) and fetch its file again; else the
    /// output is dropped with its task's old job, before the task runs again.
    pub refetch: bool,
}

/// A task the record gains or already has: new tasks have no row id until the change is
/// written.
#[derive(Clone, Debug)]
pub enum TaskRef {
    Row(TaskId),
    /// The key of a task recorded by the same change.
    New(TaskKey),
}

/// A task settled with an earlier run's result (`--reuse`), its files copied to `paths` (by
/// output index), or to be fetched from its job where `None`.
pub struct Reused {
    pub task: TaskRef,
    pub identity: String,
    pub from: Reusable,
    pub paths: Vec<Option<String>>,
}

/// Every state write a resume makes before its scheduler starts, written by
/// [`Revisions::apply`] in one transaction: a process killed while applying a review leaves
/// the record as it was before, or as it is after, never in between.
#[derive(Default)]
pub struct Changes {
    /// Tasks the pipeline gained, or reused ones the run had not recorded yet.
    pub new_tasks: Vec<NewTask>,
    pub set_aside: Vec<SetAside>,
    /// Tasks to do again from the start, as each `NewTask` now describes it.
    pub reset: Vec<(TaskId, NewTask)>,
    /// Tasks the pipeline no longer has; their attempts stay, for what they cost.
    pub removed: Vec<TaskId>,
    /// Tasks left failed, with why, and the tasks below them, blocked.
    pub failed: Vec<(TaskId, String)>,
    pub blocked: Vec<Blocked>,
    pub reused: Vec<Reused>,
    /// A reroll, recorded with the tasks it resets.
    pub reroll: Option<crate::store::NewReroll>,
}

/// Tasks left blocked below a task left failed, with why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blocked {
    pub tasks: Vec<TaskId>,
    pub why: String,
}

/// A file or object move a resume journaled: made after the change's commit, then forgotten
/// with [`Revisions::finish_moves`]. The next resume makes those a killed process left.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PendingMove {
    pub id: MoveId,
    pub superseded_id: SupersededId,
    pub from: String,
    pub to: String,
}

/// A resume's revisions of the record: [`Store::revisions`].
#[derive(Clone, Copy)]
pub struct Revisions<'a> {
    pub(super) store: &'a Store,
}

impl Store {
    pub fn revisions(&self) -> Revisions<'_> {
        Revisions { store: self }
    }
}

impl Revisions<'_> {
    /// Writes every change of an applied review in one transaction, and journals in it each
    /// move of a set-aside output's file; gives the moves to make once it is committed.
    pub async fn apply(
        &self,
        run_id: &RunId,
        changes: &Changes,
    ) -> Result<Vec<PendingMove>, StoreError> {
        let mut tx = self.store.pool().begin().await?;
        let inserted =
            insert_tasks(&mut tx, self.store.backend(), run_id, &changes.new_tasks).await?;
        let now = now_ms();
        // First, so that its copy of the rows is of them as they were.
        if let Some(reroll) = &changes.reroll {
            rerolls::insert(&mut tx, run_id, reroll, now).await?;
        }
        let mut moves = Vec::new();
        for m in &changes.set_aside {
            if let Some(mv) = set_aside(&mut tx, run_id, m, now).await? {
                moves.push(mv);
            }
        }
        for (id, task) in &changes.reset {
            reset_task(&mut tx, *id, task, now).await?;
        }
        for id in &changes.removed {
            sqlx::query("UPDATE tasks SET removed_at = $1, updated_at = $2 WHERE id = $3")
                .bind(now)
                .bind(now)
                .bind(id)
                .execute(&mut *tx)
                .await?;
        }
        let failed = changes
            .failed
            .iter()
            .map(|(id, why)| (vec![*id], why, "failed"));
        let blocked = changes
            .blocked
            .iter()
            .map(|b| (b.tasks.clone(), &b.why, "blocked"));
        for (ids, why, status) in failed.chain(blocked) {
            for id in ids {
                sqlx::query(
                    "UPDATE tasks SET status = $1, error = $2, updated_at = $3 WHERE id = $4",
                )
                .bind(status)
                .bind(why)
                .bind(now)
                .bind(id)
                .execute(&mut *tx)
                .await?;
            }
        }
        for r in &changes.reused {
            let id = match &r.task {
                TaskRef::Row(id) => Some(*id),
                TaskRef::New(key) => inserted.iter().find(|(_, k)| k == key).map(|(id, _)| *id),
            };
            let Some(id) = id else {
                return Err(StoreError::Inconsistent(format!(
                    "reused task {:?} has no row",
                    r.task
                )));
            };
            reuse(&mut tx, run_id, id, r, now).await?;
        }
        tx.commit().await?;
        Ok(moves)
    }

    /// The moves a resume journaled and did not finish (its process was killed).
    pub async fn pending_moves(&self, run_id: &RunId) -> Result<Vec<PendingMove>, StoreError> {
        sqlx::query(
            "SELECT id, superseded_id, from_path, to_path FROM pending_moves
             WHERE run_id = $1 ORDER BY id",
        )
        .bind(run_id)
        .fetch_all(self.store.pool())
        .await?
        .iter()
        .map(|r| {
            Ok(PendingMove {
                id: r.try_get("id")?,
                superseded_id: r.try_get("superseded_id")?,
                from: r.try_get("from_path")?,
                to: r.try_get("to_path")?,
            })
        })
        .collect()
    }

    /// Forgets journaled moves once made: each with the size of what was moved, or `None`
    /// when there was nothing to move (the set-aside output then names no file).
    pub async fn finish_moves(
        &self,
        done: &[(PendingMove, Option<u64>)],
    ) -> Result<(), StoreError> {
        let mut tx = self.store.pool().begin().await?;
        for (m, moved) in done {
            let query = match moved {
                Some(bytes) => {
                    sqlx::query("UPDATE superseded_outputs SET bytes = $1 WHERE id = $2")
                        .bind(to_i64(*bytes))
                        .bind(m.superseded_id)
                }
                None => sqlx::query("UPDATE superseded_outputs SET path = NULL WHERE id = $1")
                    .bind(m.superseded_id),
            };
            query.execute(&mut *tx).await?;
            sqlx::query("DELETE FROM pending_moves WHERE id = $1")
                .bind(m.id)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }
}

/// What the executor did about a checked task's verdicts, written with them
/// ([`Revisions::checked`]).
pub enum Checked<'a> {
    /// Its outputs stay: every check passed, or a failure was flagged.
    Kept,
    /// Its outputs are set aside and the task is pending again, to be paid for once more:
    /// the outputs of job `job_id`, and the reroll planned at `credits`.
    Rerolled {
        aside: Vec<SetAside>,
        job_id: &'a JobId,
        credits: u64,
    },
    /// The task failed, with why (`on_fail: fail`).
    Failed(&'a str),
}

impl Revisions<'_> {
    /// Records a task's verdicts and what was done about them in one transaction: a process
    /// killed before its commit judges again, after it never acts twice. Gives the moves of
    /// the set-aside files to make once it is committed.
    pub async fn checked(
        &self,
        run_id: &RunId,
        task_id: TaskId,
        verdicts: &[crate::store::VerdictRow],
        action: Checked<'_>,
    ) -> Result<Vec<PendingMove>, StoreError> {
        let mut tx = self.store.pool().begin().await?;
        crate::store::verdicts::insert(&mut tx, self.store.backend(), run_id, verdicts).await?;
        let now = now_ms();
        let mut moves = Vec::new();
        match action {
            Checked::Kept => {}
            Checked::Rerolled {
                aside,
                job_id,
                credits,
            } => {
                sqlx::query(
                    "INSERT INTO check_rerolls (run_id, task_id, job_id, credits, rerolled_at)
                     VALUES ($1, $2, $3, $4, $5)",
                )
                .bind(run_id)
                .bind(task_id)
                .bind(job_id)
                .bind(to_i64(credits))
                .bind(now)
                .execute(&mut *tx)
                .await?;
                for m in &aside {
                    if let Some(mv) = set_aside(&mut tx, run_id, m, now).await? {
                        moves.push(mv);
                    }
                }
                sqlx::query(
                    "UPDATE tasks SET status = 'pending', identity = NULL, job_id = NULL,
                         error = NULL, updated_at = $1
                     WHERE id = $2",
                )
                .bind(now)
                .bind(task_id)
                .execute(&mut *tx)
                .await?;
            }
            Checked::Failed(why) => {
                sqlx::query(
                    "UPDATE tasks SET status = 'failed', error = $1, updated_at = $2 WHERE id = $3",
                )
                .bind(why)
                .bind(now)
                .bind(task_id)
                .execute(&mut *tx)
                .await?;
            }
        }
        tx.commit().await?;
        Ok(moves)
    }
}

/// Moves an output's row to `superseded_outputs` (keeping it, cleared, when it is fetched
/// again) and journals its file's move.
async fn set_aside(
    conn: &mut AnyConnection,
    run_id: &RunId,
    m: &SetAside,
    now: i64,
) -> Result<Option<PendingMove>, StoreError> {
    let to = m.from.as_ref().and(m.to.as_ref());
    let superseded_id: SupersededId = sqlx::query(
        "INSERT INTO superseded_outputs (task_id, run_id, k, job_id, path, sha256, bytes,
             reason, superseded_at)
         SELECT task_id, $1, k, job_id, $2, COALESCE($3, sha256), bytes, $4, $5
         FROM outputs WHERE id = $6
         RETURNING id",
    )
    .bind(run_id)
    .bind(to)
    .bind(&m.sha256)
    .bind(&m.reason)
    .bind(now)
    .bind(m.output_id)
    .fetch_one(&mut *conn)
    .await?
    .try_get("id")?;
    let sql = if m.refetch {
        "UPDATE outputs SET path = NULL, sha256 = NULL, bytes = NULL, etag = NULL,
             downloaded_at = NULL, download_error = NULL
         WHERE id = $1"
    } else {
        "DELETE FROM outputs WHERE id = $1"
    };
    sqlx::query(sql)
        .bind(m.output_id)
        .execute(&mut *conn)
        .await?;
    let (Some(from), Some(to)) = (&m.from, to) else {
        return Ok(None);
    };
    let id: MoveId = sqlx::query(
        "INSERT INTO pending_moves (run_id, superseded_id, from_path, to_path)
         VALUES ($1, $2, $3, $4) RETURNING id",
    )
    .bind(run_id)
    .bind(superseded_id)
    .bind(from)
    .bind(to)
    .fetch_one(&mut *conn)
    .await?
    .try_get("id")?;
    Ok(Some(PendingMove {
        id,
        superseded_id,
        from: from.clone(),
        to: to.clone(),
    }))
}

/// Makes a task to do again from the start, as `task` now describes it.
async fn reset_task(
    conn: &mut AnyConnection,
    task_id: TaskId,
    task: &NewTask,
    now: i64,
) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE tasks SET status = 'pending', operation = $1, inputs = $2, planned_credits = $3,
             request = $4, identity = NULL, job_id = NULL, error = NULL,
             removed_at = NULL, reused_from = NULL, updated_at = $5
         WHERE id = $6",
    )
    .bind(task.operation)
    .bind(&task.inputs)
    .bind(to_i64(task.planned_credits))
    .bind(task.request.as_deref())
    .bind(now)
    .bind(task_id)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Settles `task_id` with an earlier task's job and outputs, billed nothing.
async fn reuse(
    conn: &mut AnyConnection,
    run_id: &RunId,
    task_id: TaskId,
    r: &Reused,
    now: i64,
) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE tasks SET status = 'succeeded', job_id = $1, identity = $2, reused_from = $3,
             error = NULL, updated_at = $4
         WHERE id = $5",
    )
    .bind(&r.from.job_id)
    .bind(&r.identity)
    .bind(r.from.task_id)
    .bind(now)
    .bind(task_id)
    .execute(&mut *conn)
    .await?;
    for (o, path) in r.from.outputs.iter().zip(&r.paths) {
        let copied = path.is_some();
        sqlx::query(
            "INSERT INTO outputs (task_id, run_id, k, job_id, parent_job_id, url,
                 url_issued_at, path, sha256, bytes, downloaded_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
        )
        .bind(task_id)
        .bind(run_id)
        .bind(i64::from(o.k))
        .bind(&r.from.job_id)
        .bind(&o.parent_job_id)
        .bind(&o.url)
        .bind(o.url_issued_at)
        .bind(path)
        .bind(if copied { o.sha256.as_deref() } else { None })
        .bind(if copied { o.bytes.map(to_i64) } else { None })
        .bind(copied.then_some(now))
        .execute(&mut *conn)
        .await?;
    }
    Ok(())
}

/// A reroll is recorded by the revision that resets its tasks: its reads and its end are
/// revisions' too.
impl Revisions<'_> {
    /// The latest reroll of run `run_id` that named `said` and has not ended.
    pub async fn open_reroll(
        &self,
        run_id: &RunId,
        said: &str,
    ) -> Result<Option<crate::store::OpenReroll>, StoreError> {
        rerolls::open(self.store.pool(), run_id, said).await
    }

    /// Ends the open rerolls of run `run_id` that named `said`: all their tasks are done.
    pub async fn finish_reroll(&self, run_id: &RunId, said: &str) -> Result<(), StoreError> {
        rerolls::finish(self.store.pool(), run_id, said).await
    }

    /// Undoes the open reroll of run `run_id` that named `said`, in one transaction, when
    /// none of its calls was billed (or may have been) and none of its tasks is done: the
    /// record as it was before it ([`rerolls::Undone`]); `None`, and nothing changed, else.
    pub async fn undo_reroll(
        &self,
        run_id: &RunId,
        said: &str,
    ) -> Result<Option<crate::store::Undone>, StoreError> {
        let mut tx = self.store.pool().begin().await?;
        let undone = rerolls::undo(&mut tx, run_id, said).await?;
        if undone.is_some() {
            tx.commit().await?;
        }
        Ok(undone)
    }
}
