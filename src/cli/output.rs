//! Shared output of the one-off commands: printing what became of a billed job and its images
//! (the downloads themselves are [`crate::api::fetch::deliver_job`]).

use std::path::Path;

use serde::Serialize;
use serde_json::{Value, json};

use crate::api::fetch::{Delivery, deliver_job};
use crate::api::job_id::JobId;
use crate::cli::GlobalArgs;
use crate::cli::stdio;
use crate::error::Error;
use crate::place::LocalFile;
use crate::runner::Connection;

/// A job the service answered, and what to print about it.
pub(super) struct Billed<'a> {
    /// The response as received, printed under `job` with `--json`.
    pub response: Value,
    pub job_id: &'a JobId,
    pub urls: Vec<String>,
    /// Name files `<id>-<index>` (generations) rather than `<id>` (edits).
    pub indexed: bool,
    /// The human-readable first line.
    pub summary: String,
    /// Something wrong with the answer itself (a status other than succeeded, images missing).
    pub problem: Option<String>,
}

/// Downloads every image of a billed job into `dir`, carrying on past a failed image, then
/// prints the result (also on failure, so a script still learns the job id) and returns the
/// first failure.
pub(super) async fn deliver(
    conn: &Connection,
    global: &GlobalArgs,
    dir: &Path,
    job: Billed<'_>,
) -> Result<(), Error> {
    let Delivery { files, failure } = deliver_job(
        &conn.client,
        &conn.downloader,
        job.job_id,
        &job.urls,
        job.indexed,
        dir,
        &dir.display().to_string(),
    )
    .await;
    let failure = failure
        .map(|e| Error::Download {
            source: e.source,
            recover: e.recover,
        })
        .or_else(|| {
            job.problem
                .clone()
                .map(|p| Error::Other(anyhow::anyhow!("{p}")))
        });
    if global.json {
        let error = failure.as_ref().map(ToString::to_string);
        print_json(
            conn,
            &json!({"job": job.response, "files": files_json(&files), "error": error}),
        )?;
    } else {
        stdio::line(conn.redact(&job.summary))?;
        for f in &files {
            stdio::line(format_args!(
                "saved {} ({} bytes, sha256 {})",
                f.path.display(),
                f.bytes,
                &f.sha256[..16]
            ))?;
        }
    }
    failure.map_or(Ok(()), Err)
}

pub(super) fn files_json(files: &[LocalFile]) -> Value {
    files
        .iter()
        .map(|f| json!({"path": f.path, "bytes": f.bytes, "sha256": f.sha256}))
        .collect()
}

/// Prints JSON on stdout with the key scrubbed: a record may echo what it was sent.
pub(super) fn print_json(conn: &Connection, value: &impl Serialize) -> Result<(), Error> {
    let text = serde_json::to_string_pretty(value).map_err(|e| Error::Other(e.into()))?;
    stdio::line(conn.redact(&text))?;
    Ok(())
}
