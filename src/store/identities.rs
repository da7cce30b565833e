//! Tasks' identities (their request and their inputs' bytes), recorded once known, and the
//! succeeded tasks of earlier runs found by identity: what `--reuse` and a changed pipeline
//! compare.

use crate::api::job_id::JobId;
use crate::run_id::RunId;
use std::collections::HashMap;

use sqlx::Row;

use crate::place::Address;
use crate::sha256::Sha256Sum;
use crate::store::to_u64;
use crate::store::{Backend, Store, StoreError, TaskId, rows};

/// A succeeded task of some run, whose outputs another task may take instead of paying.
#[derive(Clone, Debug)]
pub struct Reusable {
    pub task_id: TaskId,
    pub run_id: RunId,
    pub job_id: JobId,
    pub outputs: Vec<ReusableOutput>,
}

#[derive(Clone, Debug)]
pub struct ReusableOutput {
    pub k: u32,
    pub url: String,
    pub url_issued_at: i64,
    pub path: Option<String>,
    pub sha256: Option<Sha256Sum>,
    pub bytes: Option<u64>,
    pub parent_job_id: Option<JobId>,
}

impl ReusableOutput {
    /// Where the output was kept, when it was: a file or an object.
    pub fn address(&self) -> Option<Address> {
        self.path.as_deref().map(Address::recorded)
    }
}

/// Tasks' identities and what they find: [`Store::identities`].
#[derive(Clone, Copy)]
pub struct Identities<'a> {
    store: &'a Store,
}

impl Store {
    pub fn identities(&self) -> Identities<'_> {
        Identities { store: self }
    }
}

impl Identities<'_> {
    /// Records tasks' identities (request and input bytes) once they are known.
    pub async fn set(&self, ids: &[(TaskId, String)]) -> Result<(), StoreError> {
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
    /// `not_run` (of any run at all when `None`: a plan's estimate), with every output downloaded: one query a chunk of identities, not one a
    /// task.
    pub async fn reusable(
        &self,
        identities: &[String],
        not_run: Option<&RunId>,
    ) -> Result<HashMap<String, Reusable>, StoreError> {
        let mut found: HashMap<String, Reusable> = HashMap::new();
        for chunk in identities.chunks(500) {
            let marks = rows(self.store.backend(), chunk.len(), 1, |p| p[0].clone());
            // The last parameter, in the backend's own style (see `rows`).
            let not_run_mark = match self.store.backend() {
                Backend::Sqlite => "?".to_owned(),
                Backend::Postgres => format!("${}", chunk.len() + 1),
            };
            let not_run_clause = match not_run {
                Some(_) => format!("AND t.run_id != {not_run_mark}"),
                None => String::new(),
            };
            let sql = format!(
                "SELECT t.id, t.run_id, t.job_id, t.identity,
                        o.k, o.url, o.url_issued_at, o.path, o.sha256, o.bytes, o.parent_job_id
                 FROM tasks t JOIN outputs o ON o.task_id = t.id
                 WHERE t.identity IN ({marks}) {not_run_clause}
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
            if let Some(run) = not_run {
                query = query.bind(run);
            }
            let rows = query.fetch_all(self.store.pool()).await?;
            for r in &rows {
                let identity: String = r.try_get("identity")?;
                let task_id: TaskId = r.try_get("id")?;
                let entry = found.entry(identity).or_insert(Reusable {
                    task_id,
                    run_id: RunId::from(r.try_get::<String, _>("run_id")?),
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

    /// The sha256 of each downloaded output of these tasks, by task row and output index.
    pub async fn output_hashes_of(
        &self,
        task_ids: &[TaskId],
    ) -> Result<std::collections::HashMap<(TaskId, u32), Sha256Sum>, StoreError> {
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
                        r.try_get::<TaskId, _>("task_id")?,
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
        run_id: &RunId,
    ) -> Result<std::collections::HashMap<(TaskId, u32), Sha256Sum>, StoreError> {
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
                        r.try_get::<TaskId, _>("task_id")?,
                        u32::try_from(r.try_get::<i64, _>("k")?).unwrap_or(0),
                    ),
                    r.try_get("sha256")?,
                ))
            })
            .collect()
    }
}
