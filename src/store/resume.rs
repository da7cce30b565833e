//! What resuming, changing and reusing need from the record: the stored outputs to check,
//! outputs set aside, tasks reset or dropped, identities, and the succeeded tasks of earlier
//! runs.

use std::collections::HashMap;

use futures::stream::{BoxStream, StreamExt, TryStreamExt};
use sqlx::Row;

use crate::place::Address;
use crate::store::tasks::{NewTask, OUTPUT_COLUMNS, output_row, to_u64};
use crate::store::{Backend, RecordedOutput, Store, StoreError, rows};

/// A stored output as a resume checks it: where it is and what was stored there. The rest of
/// its record ([`RecordedOutput`]) is read, by [`Resuming::outputs_by_id`], only for the few that
/// differ.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredOutput {
    pub id: i64,
    pub task_id: i64,
    /// A file's path or an object's `s3://` URL, as recorded.
    pub path: String,
    pub sha256: String,
    pub bytes: Option<u64>,
    /// The object's ETag at upload, or the file's stamp, when one was kept.
    pub etag: Option<String>,
}

/// The run's stored outputs in the byte order of their path, which is the order S3 lists keys
/// in (their UTF-8 bytes): SQLite's default collation compares bytes; PostgreSQL's may not
/// (ICU's `en-US` puts `_t` before `A`, `aB` between `ab` and `ac`, `é` before `z`), so it is
/// told "C". Each page is a seek in the `outputs_by_path` index.
const STORED_OUTPUTS_SQLITE: &str = "SELECT id, task_id, path, sha256, bytes, etag FROM outputs
     WHERE run_id = $1 AND path IS NOT NULL AND sha256 IS NOT NULL AND (path, id) > ($2, $3)
     ORDER BY path, id LIMIT $4";
/// Run with sorts disabled (see [`Resuming::stored_outputs`]).
const STORED_OUTPUTS_POSTGRES: &str = "SELECT id, task_id, path, sha256, bytes, etag FROM outputs
     WHERE run_id = $1 AND path IS NOT NULL AND sha256 IS NOT NULL
       AND (path COLLATE \"C\", id) > ($2, $3)
     ORDER BY path COLLATE \"C\", id LIMIT $4";

/// Stored outputs read in one statement (see [`Resuming::stored_outputs`]).
const STORED_PER_PAGE: i64 = 1000;

/// Ids a statement reading outputs back by id binds.
const IDS_PER_STATEMENT: usize = 500;

/// An output set aside by a resume: its row moves to `superseded_outputs`, and its file (or
/// object), when it has one, is to move from `from` to `to`: a move journaled with the change
/// and made after the commit (see [`Resuming::apply_review`]).
pub struct SetAside {
    pub output_id: i64,
    /// The file's recorded place, and where it goes.
    pub from: Option<String>,
    pub to: Option<String>,
    /// The sha256 of the bytes there, when they differ from the recorded ones.
    pub sha256: Option<String>,
    pub reason: &'static str,
    /// Keep the output (its job is still the task's) and fetch its file again; else the
    /// output is dropped with its task's old job, before the task runs again.
    pub refetch: bool,
}

/// A task the record gains or already has: new tasks have no row id until the change is
/// written.
#[derive(Clone, Debug)]
pub enum TaskRef {
    Row(i64),
    /// `(item, step, idx)` of a task recorded by the same change.
    New(String, String, u32),
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
/// [`Resuming::apply_review`] in one transaction: a process killed while applying a review leaves
/// the record as it was before, or as it is after, never in between.
#[derive(Default)]
pub struct Changes {
    /// Tasks the pipeline gained, or reused ones the run had not recorded yet.
    pub new_tasks: Vec<NewTask>,
    pub set_aside: Vec<SetAside>,
    /// Tasks to do again from the start, as each `NewTask` now describes it.
    pub reset: Vec<(i64, NewTask)>,
    /// Tasks the pipeline no longer has; their attempts stay, for what they cost.
    pub removed: Vec<i64>,
    /// Tasks left failed, with why, and the tasks below them, blocked.
    pub failed: Vec<(i64, String)>,
    pub blocked: Vec<(Vec<i64>, String)>,
    pub reused: Vec<Reused>,
    /// A reroll, recorded with the tasks it resets.
    pub reroll: Option<crate::store::NewReroll>,
}

/// A file or object move a resume journaled: made after the change's commit, then forgotten
/// with [`Resuming::finish_moves`]. The next resume makes those a killed process left.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PendingMove {
    pub id: i64,
    pub superseded_id: i64,
    pub from: String,
    pub to: String,
}

/// A succeeded task of some run, whose outputs another task may take instead of paying.
#[derive(Clone, Debug)]
pub struct Reusable {
    pub task_id: i64,
    pub run_id: String,
    pub job_id: String,
    pub outputs: Vec<ReusableOutput>,
}

#[derive(Clone, Debug)]
pub struct ReusableOutput {
    pub k: u32,
    pub url: String,
    pub url_issued_at: i64,
    pub path: Option<String>,
    pub sha256: Option<String>,
    pub bytes: Option<u64>,
    pub parent_job_id: Option<String>,
}

impl ReusableOutput {
    /// Where the output was kept, when it was: a file or an object.
    pub fn address(&self) -> Option<Address> {
        self.path.as_deref().map(Address::recorded)
    }
}

/// What resuming a run reads and writes: the stored outputs a review checks, the succeeded
/// tasks of earlier runs it may reuse, the identities it records, the changes it applies in
/// one transaction and the moves journaled with them, and the rerolls it records.
#[derive(Clone, Copy, Debug)]
pub struct Resuming<'a> {
    pub(super) store: &'a Store,
}

impl<'a> Resuming<'a> {
    /// The run's outputs with a file or object and its sha256, in the byte order of their
    /// path: the order S3 lists keys in, whatever the database's collation. Read a page of
    /// [`STORED_PER_PAGE`] at a time, each page from where the last ended (an index seek, see
    /// the `outputs_by_path` migration), so no statement holds a connection for long: on
    /// SQLite the only one, which the executor writes on while a resume checks.
    ///
    /// On PostgreSQL each page is read with sorts disabled (`SET LOCAL enable_sort = off`):
    /// on a table not analysed yet (right after a kill) the planner guesses fewer rows than a
    /// page and would sort the run's outputs for each page (0.14–0.28 s a page at 300,000 of
    /// them); the index gives them in order (1 ms a page).
    pub fn stored_outputs(
        &self,
        run_id: &'a str,
    ) -> BoxStream<'a, Result<StoredOutput, StoreError>> {
        let store = self.store;
        let sql = match self.store.backend() {
            Backend::Sqlite => STORED_OUTPUTS_SQLITE,
            Backend::Postgres => STORED_OUTPUTS_POSTGRES,
        };
        // From the empty path on: every recorded path is after it.
        let start = Some((String::new(), 0_i64));
        futures::stream::try_unfold(start, move |after| async move {
            let Some((path, id)) = after else {
                return Ok::<_, StoreError>(None);
            };
            let query = sqlx::query(sql)
                .bind(run_id)
                .bind(&path)
                .bind(id)
                .bind(STORED_PER_PAGE);
            let rows = store.fetch_unsorted(query).await?;
            let page = rows
                .iter()
                .map(|r| {
                    Ok(StoredOutput {
                        id: r.try_get("id")?,
                        task_id: r.try_get("task_id")?,
                        path: r.try_get("path")?,
                        sha256: r.try_get("sha256")?,
                        bytes: r.try_get::<Option<i64>, _>("bytes")?.map(to_u64),
                        etag: r.try_get("etag")?,
                    })
                })
                .collect::<Result<Vec<StoredOutput>, StoreError>>()?;
            let next = match page.last() {
                Some(last) if page.len() as i64 == STORED_PER_PAGE => {
                    Some((last.path.clone(), last.id))
                }
                _ => None,
            };
            if page.is_empty() {
                return Ok(None);
            }
            let page = futures::stream::iter(page.into_iter().map(Ok::<_, StoreError>));
            Ok(Some((page, next)))
        })
        .try_flatten()
        .boxed()
    }

    /// The records of these outputs, in the order of their ids (`ids` sorted), one statement
    /// per 500; an id with no output is left out.
    pub async fn outputs_by_id(&self, ids: &[i64]) -> Result<Vec<RecordedOutput>, StoreError> {
        self.outputs_where_in("o.id", ids).await
    }

    /// The outputs of the tasks of row ids `task_ids`, whole, in task and output order: a
    /// statement per 500 tasks, where a scan of the run's outputs reads them all.
    pub async fn outputs_of_tasks(
        &self,
        task_ids: &[i64],
    ) -> Result<Vec<RecordedOutput>, StoreError> {
        self.outputs_where_in("o.task_id", task_ids).await
    }

    /// Outputs whose `column` (`o.id` or `o.task_id`) is one of `ids`.
    async fn outputs_where_in(
        &self,
        column: &'static str,
        ids: &[i64],
    ) -> Result<Vec<RecordedOutput>, StoreError> {
        let mut out = Vec::with_capacity(ids.len());
        for chunk in ids.chunks(IDS_PER_STATEMENT) {
            let marks = rows(self.store.backend(), chunk.len(), 1, |p| p[0].clone());
            let sql = format!(
                "SELECT {OUTPUT_COLUMNS} FROM outputs o JOIN tasks t ON t.id = o.task_id
                 WHERE {column} IN ({marks}) ORDER BY o.task_id, o.k, o.id"
            );
            // Built from a fixed placeholder list: no value is ever part of the text.
            let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
            for id in chunk {
                query = query.bind(id);
            }
            for r in query.fetch_all(self.store.pool()).await? {
                out.push(output_row(&r)?);
            }
        }
        Ok(out)
    }

    /// Records tasks' identities (request and input bytes) once they are known.
    pub async fn set_identities(&self, ids: &[(i64, String)]) -> Result<(), StoreError> {
        let mut tx = self.store.pool().begin().await?;
        // One statement a chunk: a statement a task was a round trip to SQLite's thread each,
        // most of a run's exit after thousands of tasks.
        for chunk in ids.chunks(500) {
            let values = rows(self.store.backend(), chunk.len(), 2, |p| {
                format!("({}, {})", p[0], p[1])
            });
            let sql = format!(
                "WITH v (id, identity) AS (VALUES {values})
                 UPDATE tasks SET identity = v.identity FROM v WHERE tasks.id = v.id"
            );
            // Built from a fixed placeholder list: no value is ever part of the text.
            let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
            for (task_id, identity) in chunk {
                query = query.bind(task_id).bind(identity);
            }
            query.execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// For each of these identities that has one, the latest succeeded task, of any run but
    /// `not_run`, with every output downloaded: one query a chunk of identities, not one a
    /// task.
    pub async fn reusable_many(
        &self,
        identities: &[String],
        not_run: &str,
    ) -> Result<HashMap<String, Reusable>, StoreError> {
        let mut found: HashMap<String, Reusable> = HashMap::new();
        for chunk in identities.chunks(500) {
            let marks = rows(self.store.backend(), chunk.len(), 1, |p| p[0].clone());
            // The last parameter, in the backend's own style (see `rows`).
            let not_run_mark = match self.store.backend() {
                Backend::Sqlite => "?".to_owned(),
                Backend::Postgres => format!("${}", chunk.len() + 1),
            };
            let sql = format!(
                "SELECT t.id, t.run_id, t.job_id, t.identity,
                        o.k, o.url, o.url_issued_at, o.path, o.sha256, o.bytes, o.parent_job_id
                 FROM tasks t JOIN outputs o ON o.task_id = t.id
                 WHERE t.identity IN ({marks}) AND t.run_id != {not_run_mark}
                   AND t.status = 'succeeded' AND t.removed_at IS NULL
                   AND t.job_id IS NOT NULL
                   AND NOT EXISTS (SELECT 1 FROM outputs x
                                   WHERE x.task_id = t.id AND x.sha256 IS NULL)
                 ORDER BY t.id DESC, o.k"
            );
            // Built from a fixed placeholder list: no value is ever part of the text.
            let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
            for id in chunk {
                query = query.bind(id);
            }
            let rows = query.bind(not_run).fetch_all(self.store.pool()).await?;
            for r in &rows {
                let identity: String = r.try_get("identity")?;
                let task_id: i64 = r.try_get("id")?;
                let entry = found.entry(identity).or_insert(Reusable {
                    task_id,
                    run_id: r.try_get("run_id")?,
                    job_id: r.try_get("job_id")?,
                    outputs: Vec::new(),
                });
                // Rows come latest task first: only its outputs are taken.
                if entry.task_id == task_id {
                    entry.outputs.push(ReusableOutput {
                        k: u32::try_from(r.try_get::<i64, _>("k")?).unwrap_or(0),
                        url: r.try_get("url")?,
                        url_issued_at: r.try_get("url_issued_at")?,
                        path: r.try_get("path")?,
                        sha256: r.try_get("sha256")?,
                        bytes: r.try_get::<Option<i64>, _>("bytes")?.map(to_u64),
                        parent_job_id: r.try_get("parent_job_id")?,
                    });
                }
            }
        }
        Ok(found)
    }

    /// The job of a task's result, if it has one: the parent, in the lineage, of a call that
    /// read the task's output.
    pub async fn task_job(&self, task_id: i64) -> Result<Option<String>, StoreError> {
        let job: Option<(Option<String>,)> =
            sqlx::query_as("SELECT job_id FROM tasks WHERE id = $1")
                .bind(task_id)
                .fetch_optional(self.store.pool())
                .await?;
        Ok(job.and_then(|j| j.0))
    }

    /// The sha256 of each downloaded output of these tasks, by task row and output index.
    pub async fn output_hashes_of(
        &self,
        task_ids: &[i64],
    ) -> Result<std::collections::HashMap<(i64, u32), String>, StoreError> {
        let mut out = std::collections::HashMap::new();
        for chunk in task_ids.chunks(500) {
            let marks = rows(self.store.backend(), chunk.len(), 1, |p| p[0].clone());
            let sql = format!(
                "SELECT task_id, k, sha256 FROM outputs
                 WHERE task_id IN ({marks}) AND sha256 IS NOT NULL"
            );
            // Built from a fixed placeholder list: no value is ever part of the text.
            let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
            for id in chunk {
                query = query.bind(id);
            }
            for r in query.fetch_all(self.store.pool()).await? {
                out.insert(
                    (
                        r.try_get::<i64, _>("task_id")?,
                        u32::try_from(r.try_get::<i64, _>("k")?).unwrap_or(0),
                    ),
                    r.try_get("sha256")?,
                );
            }
        }
        Ok(out)
    }

    /// The sha256 of every downloaded output of a run, by task id and output index.
    pub async fn output_hashes(
        &self,
        run_id: &str,
    ) -> Result<std::collections::HashMap<(i64, u32), String>, StoreError> {
        let rows = sqlx::query(
            "SELECT task_id, k, sha256 FROM outputs WHERE run_id = $1 AND sha256 IS NOT NULL",
        )
        .bind(run_id)
        .fetch_all(self.store.pool())
        .await?;
        rows.iter()
            .map(|r| {
                Ok((
                    (
                        r.try_get::<i64, _>("task_id")?,
                        u32::try_from(r.try_get::<i64, _>("k")?).unwrap_or(0),
                    ),
                    r.try_get("sha256")?,
                ))
            })
            .collect()
    }
}
