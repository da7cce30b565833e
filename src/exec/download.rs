//! Downloads of outputs, as soon as their job succeeds: their own concurrency, no API rate
//! limit, and a fresh URL from the job (never a new paid call) when one is refused.

use std::sync::Arc;

use crate::api::fetch::{FetchError, Retrying, fetch_with_refresh};
use crate::exec::shared::Shared;
use crate::place::Address;

pub(super) struct Fetched {
    pub task: usize,
    pub k: u32,
    pub result: Result<Address, String>,
}

pub(super) async fn download(shared: Arc<Shared>, task: usize, k: u32) -> Fetched {
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

async fn fetch(shared: &Shared, task: usize, k: u32) -> Result<Address, String> {
    let _permit = shared
        .downloads
        .acquire()
        .await
        .map_err(|e| e.to_string())?;
    let graph = &shared.graph;
    let dir = shared
        .place
        .join(&graph.item_dir(graph.task(task).instance));
    let stem = graph.file_stem(task, k);
    // A URL recorded long ago (a resumed run) is refreshed before it is tried.
    let out = shared.fresh_url(task, k, false).await?;
    let job_id = out.job_id.as_str();
    let fetched = fetch_with_refresh(
        &shared.downloader,
        shared.download_retry,
        out.url.clone(),
        (&dir, &stem),
        || async {
            shared.refresh(task, job_id).await?;
            shared
                .url(task, k)
                .map(|fresh| fresh.url)
                .ok_or_else(|| format!("no recorded output {k} of task {task}"))
        },
        |retrying| match retrying {
            Retrying::Refused(e) => {
                tracing::debug!(job = %job_id, "download refused ({e}); fetching a fresh URL");
            }
            Retrying::Transient { error, .. } => {
                tracing::debug!(job = %job_id, "download failed ({error}); trying again");
            }
        },
    )
    .await;
    let done = match fetched {
        Ok(done) => done,
        Err(FetchError::Refresh { source, .. }) => return Err(source),
        Err(FetchError::Download(e)) => {
            return Err(format!(
                "{e}; the job is paid for: `imgpipe job {job_id} --out DIR` fetches it again"
            ));
        }
    };
    shared
        .store
        .record_download(
            out.output_id,
            &done.address.to_string(),
            &done.sha256,
            done.bytes,
            done.etag.as_deref(),
        )
        .await
        .map_err(|e| e.to_string())?;
    Ok(done.address)
}
