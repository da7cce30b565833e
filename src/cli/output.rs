//! Shared output of the one-off commands: downloading a job's images and printing results.

use std::path::Path;

use serde::Serialize;
use serde_json::{Value, json};

use crate::api::Downloaded;
use crate::cli::connect::Connection;
use crate::error::Error;

/// Downloads a job's images into `dir` as `<job id>-<index>` (several images) or `<job id>`.
/// A failure here comes after the call was billed, so the error says how to fetch the files
/// again without paying.
pub async fn save_images(
    conn: &Connection,
    job_id: &str,
    urls: &[String],
    indexed: bool,
    dir: &Path,
) -> Result<Vec<Downloaded>, Error> {
    let mut saved = Vec::with_capacity(urls.len());
    for (i, url) in urls.iter().enumerate() {
        let stem = if indexed {
            format!("{job_id}-{i}")
        } else {
            job_id.to_owned()
        };
        let file = conn.downloader.fetch(url, dir, &stem).await.map_err(|source| Error::Download {
            source,
            recover: format!(
                "job {job_id} is done and paid for; fetch its images again, without paying, with: imgpipe job {job_id} --out {}",
                dir.display()
            ),
        })?;
        tracing::debug!(path = %file.path.display(), bytes = file.bytes, "saved");
        saved.push(file);
    }
    Ok(saved)
}

pub fn files_json(files: &[Downloaded]) -> Value {
    files
        .iter()
        .map(|f| json!({"path": f.path, "bytes": f.bytes, "sha256": f.sha256}))
        .collect()
}

pub fn print_json(value: &impl Serialize) -> Result<(), Error> {
    let text = serde_json::to_string_pretty(value).map_err(|e| Error::Other(e.into()))?;
    println!("{text}");
    Ok(())
}

pub fn print_files(files: &[Downloaded]) {
    for f in files {
        println!(
            "saved {} ({} bytes, sha256 {})",
            f.path.display(),
            f.bytes,
            &f.sha256[..16]
        );
    }
}
