//! Shared output of the one-off commands: getting a billed job's images onto disk, whatever it
//! takes short of paying again, and printing what happened.

use std::path::Path;
use std::time::Duration;

use serde::Serialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::api::Downloaded;
use crate::api::client::is_job_id;
use crate::api::download::DownloadError;
use crate::cli::GlobalArgs;
use crate::error::Error;
use crate::runner::Connection;

/// Tries per image before a download is given up; each retry waits twice as long as the last.
const DOWNLOAD_ATTEMPTS: u32 = 4;
const FIRST_RETRY_DELAY: Duration = Duration::from_millis(100);

/// A job the service answered, and what to print about it.
pub struct Billed<'a> {
    /// The response as received, printed under `job` with `--json`.
    pub response: Value,
    pub job_id: &'a str,
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
pub async fn deliver(
    conn: &Connection,
    global: &GlobalArgs,
    dir: &Path,
    job: Billed<'_>,
) -> Result<(), Error> {
    let mut files = Vec::new();
    let mut failure = None;
    for (index, url) in job.urls.iter().enumerate() {
        match fetch(conn, &job, index, url, dir).await {
            Ok(file) => files.push(file),
            Err(e) => {
                failure.get_or_insert(e);
            }
        }
    }
    let failure = failure.or_else(|| {
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
        println!("{}", conn.redact(&job.summary));
        for f in &files {
            println!(
                "saved {} ({} bytes, sha256 {})",
                f.path.display(),
                f.bytes,
                &f.sha256[..16]
            );
        }
    }
    failure.map_or(Ok(()), Err)
}

/// One image: retried when the failure is passing, and fetched through a fresh URL from the
/// job when the URL was refused. Never by calling the paid endpoint again.
async fn fetch(
    conn: &Connection,
    job: &Billed<'_>,
    index: usize,
    url: &str,
    dir: &Path,
) -> Result<Downloaded, Error> {
    let stem = file_stem(job.job_id, job.indexed.then_some(index));
    let mut url = url.to_owned();
    let mut refreshed = false;
    let mut delay = FIRST_RETRY_DELAY;
    let mut attempt = 1;
    loop {
        let error = match conn.downloader.fetch(&url, dir, &stem).await {
            Ok(file) => return Ok(file),
            Err(e) => e,
        };
        if error.needs_fresh_url() && !refreshed {
            refreshed = true;
            tracing::warn!(job = %shown_id(job.job_id), "result URL refused; fetching a fresh one");
            match fresh_url(conn, job.job_id, index).await {
                Some(fresh) => url = fresh,
                None => return Err(download_failed(error, job.job_id, dir)),
            }
        } else if error.is_transient() && attempt < DOWNLOAD_ATTEMPTS {
            tracing::warn!(
                job = %shown_id(job.job_id),
                "download failed ({error}); retrying in {delay:?}"
            );
            tokio::time::sleep(delay).await;
            delay *= 2;
            attempt += 1;
        } else {
            return Err(download_failed(error, job.job_id, dir));
        }
    }
}

async fn fresh_url(conn: &Connection, job_id: &str, index: usize) -> Option<String> {
    if !is_job_id(job_id) {
        return None;
    }
    match conn.client.job(job_id).await {
        Ok(record) => record.image_urls().into_iter().nth(index),
        Err(e) => {
            tracing::warn!("cannot refresh the URL: {e}");
            None
        }
    }
}

fn download_failed(source: DownloadError, job_id: &str, dir: &Path) -> Error {
    let recover = if is_job_id(job_id) {
        format!(
            "job {job_id} is done and paid for; fetch its images again, without paying, with: imgpipe job {job_id} --out {}",
            dir.display()
        )
    } else {
        format!(
            "job {job_id:?} is done and paid for, but its id is not one imgpipe can ask the service about; the URLs in the service's answer are valid for a limited time"
        )
    };
    Error::Download { source, recover }
}

/// A job id as it may be shown: as is when it is plainly an id, quoted and escaped otherwise,
/// so a hostile id cannot smuggle control sequences onto the terminal.
pub fn shown_id(job_id: &str) -> String {
    if is_job_id(job_id) {
        job_id.to_owned()
    } else {
        format!("{job_id:?}")
    }
}

/// The file name of a job's image. Job ids come from the service; one that is not plainly a
/// job id must never become a path (it could climb out of the output directory), so it is
/// replaced by a digest of itself.
fn file_stem(job_id: &str, index: Option<usize>) -> String {
    let id = if is_job_id(job_id) {
        job_id.to_owned()
    } else {
        let digest = hex::encode(Sha256::digest(job_id.as_bytes()));
        tracing::warn!(
            "the service's job id {job_id:?} is not safe as a file name; using job-{}",
            &digest[..16]
        );
        format!("job-{}", &digest[..16])
    };
    match index {
        Some(i) => format!("{id}-{i}"),
        None => id,
    }
}

pub fn files_json(files: &[Downloaded]) -> Value {
    files
        .iter()
        .map(|f| json!({"path": f.path, "bytes": f.bytes, "sha256": f.sha256}))
        .collect()
}

/// Prints JSON on stdout with the key scrubbed: a record may echo what it was sent.
pub fn print_json(conn: &Connection, value: &impl Serialize) -> Result<(), Error> {
    let text = serde_json::to_string_pretty(value).map_err(|e| Error::Other(e.into()))?;
    println!("{}", conn.redact(&text));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsafe_job_ids_never_become_paths() {
        assert_eq!(file_stem("job_1", Some(2)), "job_1-2");
        for hostile in ["/../../tmp/x", "../x", "a/b", "", "-rf", "job 1"] {
            let stem = file_stem(hostile, None);
            assert!(
                stem.starts_with("job-") && is_job_id(&stem),
                "{hostile:?} -> {stem}"
            );
        }
    }
}
