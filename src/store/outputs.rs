//! Outputs: one row per image a task made, with its signed URL and, once downloaded, where it
//! was kept. A part of the store ([`Store::outputs`]).

use sqlx::Row;

use crate::api::job_id::JobId;
use crate::place::Address;
use crate::run_id::RunId;
use crate::sha256::Sha256Sum;
use crate::store::group::Written;
use crate::store::{OutputId, Store, StoreError, TaskId, now_ms};
use crate::store::{to_i64, to_u64};
use crate::task_key::TaskKey;

/// A freshly signed URL for an output.
#[derive(Clone, Debug)]
pub struct UrlIssued {
    pub output_id: OutputId,
    pub url: String,
    pub issued_at: i64,
}

#[derive(Clone, Debug)]
pub struct RecordedOutput {
    pub id: OutputId,
    pub task_id: TaskId,
    /// The key of the task that made it.
    pub task: TaskKey,
    /// Its number among the task's outputs.
    pub k: u32,
    pub job_id: JobId,
    pub parent_job_id: Option<JobId>,
    pub url: String,
    pub url_issued_at: i64,
    /// Where the output was kept, when it was: a file or an object.
    pub path: Option<Address>,
    pub sha256: Option<Sha256Sum>,
    pub bytes: Option<u64>,
    /// The store's ETag of the output's object, as uploaded, or a local file's stamp
    /// (`place::stamp`); `None` for what an imgpipe from before they were kept recorded.
    pub etag: Option<String>,
    pub download_error: Option<String>,
    /// The credits of the call that made it, shared by all of that call's outputs (0 when
    /// the output was reused from an earlier run).
    pub task_credits: u64,
}

/// The run's outputs: their URLs, and the files or objects they were kept in.
#[derive(Clone, Copy, Debug)]
pub struct Outputs<'a> {
    pub(super) store: &'a Store,
}

impl RecordedOutput {
    /// The output's own key: its task's, numbered by the output (`mug/shot[1]` is the second
    /// image of `mug/shot[0]`).
    pub fn key(&self) -> TaskKey {
        TaskKey::new(
            self.task.item.as_str(),
            self.task.step.as_str(),
            self.task.index + self.k,
        )
    }
}

impl Outputs<'_> {
    /// Records an output's file (or object) once it is whole; `etag` is the store's ETag of
    /// an object, which a resume compares with the bucket's listing, or a file's stamp
    /// (`place::stamp`), which it compares with the file's.
    pub async fn record_download(
        &self,
        output_id: OutputId,
        path: &str,
        sha256: &Sha256Sum,
        bytes: u64,
        etag: Option<&str>,
    ) -> Result<(), StoreError> {
        let (path, sha256, etag) = (path.to_owned(), sha256.clone(), etag.map(str::to_owned));
        self.store
            .writer
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
        output_id: OutputId,
        error: &str,
    ) -> Result<(), StoreError> {
        let error = error.to_owned();
        self.store
            .writer
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
        self.store
            .writer
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

    pub async fn all(&self, run_id: &RunId) -> Result<Vec<RecordedOutput>, StoreError> {
        let mut out = Vec::new();
        self.each(run_id, false, |o| {
            out.push(o);
            Ok(())
        })
        .await?;
        Ok(out)
    }

    /// Calls `f` with each output of the run in order, one row in memory at a time; only the
    /// failed downloads with `failed_only`.
    pub async fn each(
        &self,
        run_id: &RunId,
        failed_only: bool,
        mut f: impl FnMut(RecordedOutput) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        use futures::TryStreamExt;
        // The failed ones are found through their own index (`outputs_failed`), whose
        // condition the statement must say as such, not behind a parameter.
        let only = if failed_only {
            "AND o.path IS NULL AND o.download_error IS NOT NULL"
        } else {
            ""
        };
        let sql = format!(
            "SELECT {OUTPUT_COLUMNS}
             FROM outputs o JOIN tasks t ON t.id = o.task_id
             WHERE o.run_id = $1 {only}
             ORDER BY t.id, o.k"
        );
        // A fixed text: no value is ever part of it.
        let mut rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(run_id)
            .fetch(self.store.pool());
        while let Some(r) = rows.try_next().await? {
            f(output_row(&r)?)?;
        }
        Ok(())
    }

    /// The run's outputs with no file or object (a download that failed, was cut by a kill,
    /// or was set aside to be fetched again), whole: few, and each to be downloaded.
    pub async fn unstored(&self, run_id: &RunId) -> Result<Vec<RecordedOutput>, StoreError> {
        let sql = format!(
            "SELECT {OUTPUT_COLUMNS}
             FROM outputs o JOIN tasks t ON t.id = o.task_id
             WHERE o.run_id = $1 AND o.path IS NULL
             ORDER BY t.id, o.k"
        );
        // A fixed text: no value is ever part of it.
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(run_id)
            .fetch_all(self.store.pool())
            .await?;
        rows.iter().map(output_row).collect()
    }
}

/// The columns of an [`RecordedOutput`], read from `outputs o JOIN tasks t ON t.id = o.task_id`.
pub(crate) const OUTPUT_COLUMNS: &str =
    "o.id, o.task_id, t.item, t.step, t.idx, o.k, o.job_id, o.parent_job_id, o.url,
     o.url_issued_at, o.path, o.sha256, o.bytes, o.etag, o.download_error,
     COALESCE((SELECT a.credits_billed FROM attempts a
               WHERE a.task_id = o.task_id AND a.job_id = o.job_id
                 AND a.outcome = 'succeeded'
               ORDER BY a.id DESC LIMIT 1), 0) AS credits_billed";

/// An output row as [`OUTPUT_COLUMNS`] selects it.
pub(crate) fn output_row(r: &sqlx::any::AnyRow) -> Result<RecordedOutput, StoreError> {
    Ok(RecordedOutput {
        id: r.try_get("id")?,
        task_id: r.try_get("task_id")?,
        task: crate::store::tasks::key_of(r)?,
        k: u32::try_from(r.try_get::<i64, _>("k")?).unwrap_or(0),
        job_id: r.try_get("job_id")?,
        parent_job_id: r.try_get("parent_job_id")?,
        url: r.try_get("url")?,
        url_issued_at: r.try_get("url_issued_at")?,
        path: r
            .try_get::<Option<String>, _>("path")?
            .as_deref()
            .map(Address::recorded),
        sha256: r.try_get("sha256")?,
        bytes: r.try_get::<Option<i64>, _>("bytes")?.map(to_u64),
        etag: r.try_get("etag")?,
        download_error: r.try_get("download_error")?,
        task_credits: to_u64(r.try_get("credits_billed")?),
    })
}
