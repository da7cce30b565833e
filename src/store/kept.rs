//! The outputs a run keeps, read back for a resume: streamed in the order of their place to be
//! checked, read whole by id or by task to be set aside, and a task's job for the lineage.

use crate::api::job_id::JobId;
use crate::run_id::RunId;
use futures::stream::{BoxStream, StreamExt, TryStreamExt};
use sqlx::Row;

use crate::sha256::Sha256Sum;
use crate::store::tasks::{OUTPUT_COLUMNS, output_row};
use crate::store::to_u64;
use crate::store::{Backend, OutputId, RecordedOutput, Store, StoreError, TaskId, rows};

/// A stored output as a resume checks it: where it is and what was stored there. The rest of
/// its record ([`RecordedOutput`]) is read, by [`Kept::by_id`], only for the few that
/// differ.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredOutput {
    pub id: OutputId,
    pub task_id: TaskId,
    /// A file's path or an object's `s3://` URL, as recorded.
    pub path: String,
    pub sha256: Sha256Sum,
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
/// Run with sorts disabled (see [`Kept::stored`]).
const STORED_OUTPUTS_POSTGRES: &str = "SELECT id, task_id, path, sha256, bytes, etag FROM outputs
     WHERE run_id = $1 AND path IS NOT NULL AND sha256 IS NOT NULL
       AND (path COLLATE \"C\", id) > ($2, $3)
     ORDER BY path COLLATE \"C\", id LIMIT $4";

/// Stored outputs read in one statement (see [`Kept::stored`]).
const STORED_PER_PAGE: i64 = 1000;

/// Ids a statement reading outputs back by id binds.
const IDS_PER_STATEMENT: usize = 500;

/// The outputs a run keeps, read back: [`Store::kept`].
#[derive(Clone, Copy)]
pub struct Kept<'a> {
    store: &'a Store,
}

impl Store {
    pub fn kept(&self) -> Kept<'_> {
        Kept { store: self }
    }
}

impl<'a> Kept<'a> {
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
    pub fn stored(self, run_id: &'a RunId) -> BoxStream<'a, Result<StoredOutput, StoreError>> {
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
            let rows = self.store.fetch_unsorted(query).await?;
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
                    Some((last.path.clone(), last.id.get()))
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
    pub async fn by_id(&self, ids: &[OutputId]) -> Result<Vec<RecordedOutput>, StoreError> {
        self.outputs_where_in("o.id", ids).await
    }

    /// The outputs of the tasks of row ids `task_ids`, whole, in task and output order: a
    /// statement per 500 tasks, where a scan of the run's outputs reads them all.
    pub async fn of_tasks(&self, task_ids: &[TaskId]) -> Result<Vec<RecordedOutput>, StoreError> {
        self.outputs_where_in("o.task_id", task_ids).await
    }

    /// Outputs whose `column` (`o.id` or `o.task_id`) is one of `ids`.
    async fn outputs_where_in<I>(
        &self,
        column: &'static str,
        ids: &[I],
    ) -> Result<Vec<RecordedOutput>, StoreError>
    where
        I: Copy + sqlx::Type<sqlx::Any> + for<'e> sqlx::Encode<'e, sqlx::Any>,
    {
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
                query = query.bind(*id);
            }
            for r in query.fetch_all(self.store.pool()).await? {
                out.push(output_row(&r)?);
            }
        }
        Ok(out)
    }

    /// The job of a task's result, if it has one: the parent, in the lineage, of a call that
    /// read the task's output.
    pub async fn job_of_task(&self, task_id: TaskId) -> Result<Option<JobId>, StoreError> {
        let job: Option<(Option<JobId>,)> =
            sqlx::query_as("SELECT job_id FROM tasks WHERE id = $1")
                .bind(task_id)
                .fetch_optional(self.store.pool())
                .await?;
        Ok(job.and_then(|j| j.0))
    }
}
