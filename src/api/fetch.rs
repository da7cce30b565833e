//! Getting a billed job's images to their destination, whatever it takes short of paying again:
//! the one download-with-refresh loop, used by runs and by the one-off commands alike.
//!
//! A refused result URL has expired: the job gives a fresh one for free (`GET /v1/jobs/{id}`),
//! so the caller supplies that read as a refresher. A passing failure is retried per the
//! [`RetryPolicy`]. Nothing here ever calls a paid endpoint.

use std::future::Future;
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::api::client::Client;
use crate::api::download::{Destination, DownloadError, Downloader};
use crate::api::job_id::{JobId, is_job_id};
use crate::api::retry::RetryPolicy;

/// Tries of one download, refreshes of its URL included, before it is given up.
pub const DOWNLOAD_TRIES: u32 = 4;

/// The first retry delay of a one-off command's download: short, someone is waiting for it.
const ONE_OFF_RETRY_BASE: Duration = Duration::from_millis(100);

/// Why a download is about to be tried again, for the caller to log as it sees fit.
#[derive(Debug)]
pub enum Retrying<'a> {
    /// The URL was refused: a fresh one is being fetched from the job.
    Refused(&'a DownloadError),
    /// A passing failure: the next try comes after `delay`.
    Transient {
        error: &'a DownloadError,
        delay: Duration,
    },
}

/// Why a download was given up.
#[derive(Debug)]
pub enum FetchError<E> {
    /// The download's own last failure.
    Download(DownloadError),
    /// The URL was refused and no fresh one could be had.
    Refresh { refused: DownloadError, source: E },
}

/// Downloads `url` into `dest` as `<stem>.<ext>` (see [`Downloader::fetch`]). A refused URL
/// is replaced once by `refresh` (a fresh URL refused too is not a matter of age, so asking
/// again would not help); passing failures back off per `policy`; every try counts against
/// `policy.tries`.
pub async fn fetch_with_refresh<D, R, Fut, E>(
    downloader: &Downloader,
    policy: RetryPolicy,
    url: String,
    (dest, stem): (&D, &str),
    mut refresh: R,
    mut on_retry: impl FnMut(Retrying<'_>),
) -> Result<D::Kept, FetchError<E>>
where
    D: Destination + Sync + ?Sized,
    R: FnMut() -> Fut,
    Fut: Future<Output = Result<String, E>>,
{
    let mut url = url;
    let mut refreshed = false;
    let mut tries = 0;
    loop {
        tries += 1;
        let error = match downloader.fetch(&url, dest, stem).await {
            Ok(done) => return Ok(done),
            Err(e) => e,
        };
        if !policy.allows(tries) {
            return Err(FetchError::Download(error));
        }
        if error.needs_fresh_url() && !refreshed {
            refreshed = true;
            on_retry(Retrying::Refused(&error));
            url = match refresh().await {
                Ok(fresh) => fresh,
                Err(source) => {
                    return Err(FetchError::Refresh {
                        refused: error,
                        source,
                    });
                }
            };
        } else if error.is_transient() {
            let delay = policy.backoff(tries);
            on_retry(Retrying::Transient {
                error: &error,
                delay,
            });
            tokio::time::sleep(delay).await;
        } else {
            return Err(FetchError::Download(error));
        }
    }
}

/// What became of a billed job's images: each kept as its destination says.
#[derive(Debug)]
pub struct Delivery<K> {
    pub files: Vec<K>,
    /// The first image that could not be saved; the others were still tried.
    pub failure: Option<Undelivered>,
}

/// A download given up after its call was billed, and how to get the file without paying.
#[derive(Debug, thiserror::Error)]
#[error("{source}\nhint: {recover}")]
pub struct Undelivered {
    #[source]
    pub source: DownloadError,
    pub recover: String,
}

/// Downloads every image of a billed job into `dest` (the one-off commands), carrying on past a
/// failed image. Files are named `<id>-<index>` when `indexed` (generations), `<id>` otherwise.
/// `out` is what `--out` names `dest`, for the hint that fetches the images again for free.
pub async fn deliver_job<D: Destination + Sync + ?Sized>(
    client: &Client,
    downloader: &Downloader,
    job_id: &JobId,
    urls: &[String],
    indexed: bool,
    dest: &D,
    out: &str,
) -> Delivery<D::Kept> {
    let policy = RetryPolicy::new(DOWNLOAD_TRIES, ONE_OFF_RETRY_BASE);
    let mut delivery = Delivery {
        files: Vec::new(),
        failure: None,
    };
    for (index, url) in urls.iter().enumerate() {
        let stem = file_stem(job_id, indexed.then_some(index));
        let fetched = fetch_with_refresh(
            downloader,
            policy,
            url.clone(),
            (dest, &stem),
            || fresh_url(client, job_id, index),
            |retrying| match retrying {
                Retrying::Refused(_) => {
                    tracing::warn!(job = %job_id.shown(), "result URL refused; fetching a fresh one");
                }
                Retrying::Transient { error, delay } => tracing::warn!(
                    job = %job_id.shown(),
                    "download failed ({error}); retrying in {delay:?}"
                ),
            },
        )
        .await;
        match fetched {
            Ok(file) => delivery.files.push(file),
            Err(
                FetchError::Download(source)
                | FetchError::Refresh {
                    refused: source, ..
                },
            ) => {
                delivery.failure.get_or_insert(Undelivered {
                    source,
                    recover: recovery(job_id, out),
                });
            }
        }
    }
    delivery
}

/// Image `index`'s URL, read afresh from the job: a free read, tried once.
async fn fresh_url(client: &Client, job_id: &JobId, index: usize) -> Result<String, ()> {
    if !is_job_id(job_id) {
        return Err(());
    }
    match client.job(job_id).await {
        Ok(record) => record.image_urls().into_iter().nth(index).ok_or(()),
        Err(e) => {
            tracing::warn!("cannot refresh the URL: {e}");
            Err(())
        }
    }
}

fn recovery(job_id: &JobId, out: &str) -> String {
    if is_job_id(job_id) {
        format!(
            "job {job_id} is done and paid for; fetch its images again, without paying, with: imgpipe job {job_id} --out {out}"
        )
    } else {
        format!(
            "job {:?} is done and paid for, but its id is not one imgpipe can ask the service about; the URLs in the service's answer are valid for a limited time",
            job_id.as_str()
        )
    }
}

/// The file name of a job's image. Job ids come from the service; one that is not plainly a
/// job id must never become a path (it could climb out of the output directory), so it is
/// replaced by a digest of itself.
fn file_stem(job_id: &JobId, index: Option<usize>) -> String {
    let id = if is_job_id(job_id) {
        job_id.to_string()
    } else {
        let digest = hex::encode(Sha256::digest(job_id.as_bytes()));
        tracing::warn!(
            "the service's job id {:?} is not safe as a file name; using job-{}",
            job_id.as_str(),
            &digest[..16]
        );
        format!("job-{}", &digest[..16])
    };
    match index {
        Some(i) => format!("{id}-{i}"),
        None => id,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsafe_job_ids_never_become_paths() {
        assert_eq!(file_stem(&JobId::from("job_1"), Some(2)), "job_1-2");
        for hostile in ["/../../tmp/x", "../x", "a/b", "", "-rf", "job 1"] {
            let stem = file_stem(&JobId::from(hostile), None);
            assert!(
                stem.starts_with("job-") && is_job_id(&stem),
                "{hostile:?} -> {stem}"
            );
        }
    }
}
