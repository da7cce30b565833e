//! What resuming, changing and reusing need from the record: outputs set aside, tasks reset
//! or dropped, identities, and the succeeded tasks of earlier runs.

use sqlx::Row;

use crate::store::tasks::{NewTask, to_i64, to_u64};
use crate::store::{Store, StoreError, now_ms, rows};

/// An output whose file (if any) was moved out of the way.
pub struct SetAside<'a> {
    pub output_id: i64,
    /// Where the file now is; `None` when there was no file.
    pub moved_to: Option<&'a str>,
    /// The sha256 and size of the moved file, when it differs from the recorded one.
    pub sha256: Option<&'a str>,
    pub bytes: Option<u64>,
    pub reason: &'a str,
    /// Keep the output (its job is still the task's) and fetch its file again; else the
    /// output is dropped with its task's old job, before the task runs again.
    pub refetch: bool,
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

impl Store {
    /// Records outputs set aside; for those not refetched the output row goes too.
    pub async fn set_aside(&self, run_id: &str, moves: &[SetAside<'_>]) -> Result<(), StoreError> {
        let mut tx = self.pool().begin().await?;
        let now = now_ms();
        for m in moves {
            sqlx::query(
                "INSERT INTO superseded_outputs (task_id, run_id, k, job_id, path, sha256, bytes,
                     reason, superseded_at)
                 SELECT task_id, $1, k, job_id, $2, COALESCE($3, sha256), COALESCE($4, bytes), $5, $6
                 FROM outputs WHERE id = $7",
            )
            .bind(run_id)
            .bind(m.moved_to)
            .bind(m.sha256)
            .bind(m.bytes.map(to_i64))
            .bind(m.reason)
            .bind(now)
            .bind(m.output_id)
            .execute(&mut *tx)
            .await?;
            let sql = if m.refetch {
                "UPDATE outputs SET path = NULL, sha256 = NULL, bytes = NULL, etag = NULL,
                     downloaded_at = NULL, download_error = NULL
                 WHERE id = $1"
            } else {
                "DELETE FROM outputs WHERE id = $1"
            };
            sqlx::query(sql).bind(m.output_id).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Makes a task to do again from the start, as `task` now describes it.
    pub async fn reset_task(&self, task_id: i64, task: &NewTask) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE tasks SET status = 'pending', operation = $1, inputs = $2, planned_credits = $3,
                 identity = NULL, job_id = NULL, error = NULL,
                 removed_at = NULL, reused_from = NULL, updated_at = $4
             WHERE id = $5",
        )
        .bind(task.operation)
        .bind(&task.inputs)
        .bind(to_i64(task.planned_credits))
        .bind(now_ms())
        .bind(task_id)
        .execute(self.pool())
        .await?;
        Ok(())
    }

    /// Drops tasks the pipeline no longer has; their attempts stay, for what they cost.
    pub async fn remove_tasks(&self, task_ids: &[i64]) -> Result<(), StoreError> {
        let mut tx = self.pool().begin().await?;
        let now = now_ms();
        for id in task_ids {
            sqlx::query("UPDATE tasks SET removed_at = $1, updated_at = $2 WHERE id = $3")
                .bind(now)
                .bind(now)
                .bind(id)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Records tasks' identities (request and input bytes) once they are known.
    pub async fn set_identities(&self, ids: &[(i64, String)]) -> Result<(), StoreError> {
        let mut tx = self.pool().begin().await?;
        // One statement a chunk: a statement a task was a round trip to SQLite's thread each,
        // most of a run's exit after thousands of tasks.
        for chunk in ids.chunks(500) {
            let values = rows(self.backend(), chunk.len(), 2, |p| {
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

    /// The latest succeeded task, of any run but `not_run`, with this identity and every
    /// output downloaded.
    pub async fn reusable(
        &self,
        identity: &str,
        not_run: &str,
    ) -> Result<Option<Reusable>, StoreError> {
        let row = sqlx::query(
            "SELECT t.id, t.run_id, t.job_id FROM tasks t
             WHERE t.identity = $1 AND t.run_id != $2 AND t.status = 'succeeded'
               AND t.removed_at IS NULL AND t.job_id IS NOT NULL
               AND NOT EXISTS (SELECT 1 FROM outputs o WHERE o.task_id = t.id AND o.sha256 IS NULL)
               AND EXISTS (SELECT 1 FROM outputs o WHERE o.task_id = t.id)
             ORDER BY t.id DESC LIMIT 1",
        )
        .bind(identity)
        .bind(not_run)
        .fetch_optional(self.pool())
        .await?;
        let Some(row) = row else { return Ok(None) };
        let task_id: i64 = row.try_get("id")?;
        let outputs = sqlx::query(
            "SELECT k, url, url_issued_at, path, sha256, bytes, parent_job_id
             FROM outputs WHERE task_id = $1 ORDER BY k",
        )
        .bind(task_id)
        .fetch_all(self.pool())
        .await?
        .iter()
        .map(|o| {
            Ok(ReusableOutput {
                k: u32::try_from(o.try_get::<i64, _>("k")?).unwrap_or(0),
                url: o.try_get("url")?,
                url_issued_at: o.try_get("url_issued_at")?,
                path: o.try_get("path")?,
                sha256: o.try_get("sha256")?,
                bytes: o.try_get::<Option<i64>, _>("bytes")?.map(to_u64),
                parent_job_id: o.try_get("parent_job_id")?,
            })
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
        Ok(Some(Reusable {
            task_id,
            run_id: row.try_get("run_id")?,
            job_id: row.try_get("job_id")?,
            outputs,
        }))
    }

    /// Settles `task_id` with `from`'s job and outputs, billed nothing: the files were copied
    /// to `paths` (by output index), or are to be fetched where `None`.
    pub async fn reuse(
        &self,
        run_id: &str,
        task_id: i64,
        identity: &str,
        from: &Reusable,
        paths: &[Option<String>],
    ) -> Result<(), StoreError> {
        let mut tx = self.pool().begin().await?;
        let now = now_ms();
        sqlx::query(
            "UPDATE tasks SET status = 'succeeded', job_id = $1, identity = $2, reused_from = $3,
                 error = NULL, updated_at = $4
             WHERE id = $5",
        )
        .bind(&from.job_id)
        .bind(identity)
        .bind(from.task_id)
        .bind(now)
        .bind(task_id)
        .execute(&mut *tx)
        .await?;
        for (o, path) in from.outputs.iter().zip(paths) {
            let copied = path.is_some();
            sqlx::query(
                "INSERT INTO outputs (task_id, run_id, k, job_id, parent_job_id, url,
                     url_issued_at, path, sha256, bytes, downloaded_at)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
            )
            .bind(task_id)
            .bind(run_id)
            .bind(i64::from(o.k))
            .bind(&from.job_id)
            .bind(&o.parent_job_id)
            .bind(&o.url)
            .bind(o.url_issued_at)
            .bind(path)
            .bind(if copied { o.sha256.as_deref() } else { None })
            .bind(if copied { o.bytes.map(to_i64) } else { None })
            .bind(copied.then_some(now))
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// The job of a task's result, if it has one: the parent, in the lineage, of a call that
    /// read the task's output.
    pub async fn task_job(&self, task_id: i64) -> Result<Option<String>, StoreError> {
        let job: Option<(Option<String>,)> =
            sqlx::query_as("SELECT job_id FROM tasks WHERE id = $1")
                .bind(task_id)
                .fetch_optional(self.pool())
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
            let marks = rows(self.backend(), chunk.len(), 1, |p| p[0].clone());
            let sql = format!(
                "SELECT task_id, k, sha256 FROM outputs
                 WHERE task_id IN ({marks}) AND sha256 IS NOT NULL"
            );
            // Built from a fixed placeholder list: no value is ever part of the text.
            let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
            for id in chunk {
                query = query.bind(id);
            }
            for r in query.fetch_all(self.pool()).await? {
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
        .fetch_all(self.pool())
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
