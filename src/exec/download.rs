//! Downloads of outputs, as soon as their job succeeds: their own concurrency, no API rate
//! limit, and a fresh URL from the job (never a new paid call) when one is refused.

use std::path::PathBuf;
use std::sync::Arc;

use crate::exec::shared::Shared;

/// Tries of one download before it is reported failed.
const TRIES: u32 = 4;

pub struct Fetched {
    pub task: usize,
    pub k: u32,
    pub result: Result<PathBuf, String>,
}

pub async fn download(shared: Arc<Shared>, task: usize, k: u32) -> Fetched {
    let result = fetch(&shared, task, k).await;
    if let (Err(error), Some(out)) = (&result, shared.url(task, k))
        && let Err(e) = shared
            .store
            .record_download_error(out.output_id, error)
            .await
    {
        tracing::error!("cannot record a failed download: {e}");
    }
    Fetched { task, k, result }
}

async fn fetch(shared: &Shared, task: usize, k: u32) -> Result<PathBuf, String> {
    let _permit = shared
        .downloads
        .acquire()
        .await
        .map_err(|e| e.to_string())?;
    let graph = &shared.graph;
    let dir = shared
        .run_dir
        .join(graph.item_dir(graph.tasks[task].instance));
    let stem = graph.file_stem(task, k);
    let mut tries = 0;
    loop {
        tries += 1;
        // A URL recorded long ago (a resumed run) is refreshed before it is tried.
        let out = shared.fresh_url(task, k, false).await?;
        match shared.downloader.fetch(&out.url, &dir, &stem).await {
            Ok(done) => {
                shared
                    .store
                    .record_download(
                        out.output_id,
                        &done.path.to_string_lossy(),
                        &done.sha256,
                        done.bytes,
                    )
                    .await
                    .map_err(|e| e.to_string())?;
                return Ok(done.path);
            }
            Err(e) if tries < TRIES && e.needs_fresh_url() => {
                tracing::debug!(job = %out.job_id, "download refused ({e}); fetching a fresh URL");
                shared.refresh(task, &out.job_id).await?;
            }
            Err(e) if tries < TRIES && e.is_transient() => {
                tracing::debug!(job = %out.job_id, "download failed ({e}); trying again");
                tokio::time::sleep(shared.backoff(tries)).await;
            }
            Err(e) => {
                return Err(format!(
                    "{e}; the job is paid for: `imgpipe job {} --out DIR` fetches it again",
                    out.job_id
                ));
            }
        }
    }
}
