//! Downloads of outputs, as soon as their job succeeds: their own concurrency, no API rate
//! limit, and a fresh URL from the job (never a new paid call) when one is refused. A failure
//! of the run directory itself (a full disk, a store refusing writes) stops the run's calls at
//! once, and the downloads not started yet: they are left for the next resume.

use std::sync::Arc;

use crate::api::fetch::{FetchError, Retrying, fetch_with_refresh};
use crate::exec::shared::Shared;
use crate::place::Address;
use crate::store::StoreError;

pub(super) struct Fetched {
    pub task: usize,
    pub k: u32,
    pub result: Result<Address, Unfetched>,
}

/// Why an output was not kept.
pub(super) enum Unfetched {
    /// This output's own trouble (not an image, a URL the job cannot renew): recorded with
    /// it; the run goes on.
    Output(String),
    /// The run directory itself failed
    /// ([`DownloadError::is_storage_failure`](crate::api::download::DownloadError::is_storage_failure)):
    /// recorded with the output, and nothing more is paid for.
    Storage(String),
    /// Not tried: the run directory had failed already. Left without a file, as a download a
    /// kill cut short, for the next resume to fetch from its job.
    NotTried,
    /// The download was kept but the state database cannot record it.
    Store(StoreError),
}

pub(super) async fn download(shared: Arc<Shared>, task: usize, k: u32) -> Fetched {
    let result = fetch(&shared, task, k).await;
    if let Err(Unfetched::Storage(error)) = &result {
        shared.storage_failed(error.clone());
    }
    let error = match &result {
        Err(Unfetched::Output(e)) => Some(e.clone()),
        Err(Unfetched::Storage(e)) => shared
            .url(task, k)
            .map(|out| format!("{e}; {}", paid_for(&out.job_id))),
        _ => None,
    };
    if let (Some(error), Some(out)) = (error, shared.url(task, k))
        && let Err(e) = shared
            .store
            .outputs()
            .record_download_error(out.output_id, &error)
            .await
    {
        tracing::error!("cannot record a failed download: {e}");
    }
    Fetched { task, k, result }
}

fn paid_for(job_id: &str) -> String {
    format!("the job is paid for: `imgpipe job {job_id} --out DIR` fetches it again")
}

async fn fetch(shared: &Shared, task: usize, k: u32) -> Result<Address, Unfetched> {
    let _permit = shared
        .downloads
        .acquire()
        .await
        .map_err(|e| Unfetched::Output(e.to_string()))?;
    if shared.storage_failure().is_some() {
        return Err(Unfetched::NotTried);
    }
    let graph = &shared.graph;
    let dir = shared
        .place
        .join(&graph.item_dir(graph.task(task).instance));
    let stem = graph.file_stem(task, k);
    // A URL recorded long ago (a resumed run) is refreshed before it is tried.
    let out = shared
        .fresh_url(task, k, false)
        .await
        .map_err(Unfetched::Output)?;
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
        Err(FetchError::Refresh { source, .. }) => return Err(Unfetched::Output(source)),
        Err(FetchError::Download(e)) if e.is_storage_failure() => {
            return Err(Unfetched::Storage(e.to_string()));
        }
        Err(FetchError::Download(e)) => {
            return Err(Unfetched::Output(format!("{e}; {}", paid_for(job_id))));
        }
    };
    shared
        .store
        .outputs()
        .record_download(
            out.output_id,
            &done.address.to_string(),
            &done.sha256,
            done.bytes,
            done.etag.as_deref(),
        )
        .await
        .map_err(Unfetched::Store)?;
    Ok(done.address)
}
