//! What every in-flight call and download shares: the client, the store, the limiters, and the
//! latest URL of every output, refreshed before it expires.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::sync::Semaphore;

use crate::api::fetch::DOWNLOAD_TRIES;
use crate::api::job_id::JobId;
use crate::api::{ApiError, Client, Downloader, RetryPolicy};
use crate::exec::Config;
use crate::exec::limiter::PaidLimiter;
use crate::place::Place;
use crate::plan::graph::Graph;
use crate::run_id::RunId;
use crate::store::{OutputId, Store, UrlIssued, now_ms};

/// Free reads (`GET /v1/jobs`) at once: enough to refresh URLs without crowding the paid calls.
const FREE_CONCURRENCY: usize = 2;
/// Tries of a free read before its failure is reported.
const FREE_TRIES: u32 = 5;

/// The current URL of one output.
#[derive(Clone, Debug)]
pub(super) struct OutputUrl {
    pub output_id: OutputId,
    pub job_id: JobId,
    pub url: String,
    pub issued_ms: i64,
}

pub(super) struct Shared {
    pub client: Client,
    pub downloader: Downloader,
    pub store: Store,
    pub graph: Arc<Graph>,
    pub run_id: RunId,
    /// The run directory, where the outputs go.
    pub place: Place,
    pub limiter: PaidLimiter,
    pub downloads: Semaphore,
    pub url_ttl: Duration,
    pub url_margin: Duration,
    /// Paid calls: `max_retries` retries after the first try.
    pub paid_retry: RetryPolicy,
    /// Downloads of outputs, refreshes of their URLs aside.
    pub download_retry: RetryPolicy,
    free_retry: RetryPolicy,
    /// Set when dispatch stops (interruption, budget, balance): calls still waiting for their
    /// retry delay or the limiter then give up without being sent.
    stop: tokio::sync::watch::Sender<bool>,
    free: Semaphore,
    urls: Mutex<HashMap<(usize, u32), OutputUrl>>,
    /// The first failure of the run directory itself (see
    /// [`DownloadError::is_storage_failure`](crate::api::download::DownloadError::is_storage_failure)):
    /// once set, no call is sent and no download starts.
    storage_failure: OnceLock<String>,
}

impl Shared {
    pub(super) fn new(
        client: Client,
        downloader: Downloader,
        store: Store,
        graph: Arc<Graph>,
        config: &Config,
    ) -> Shared {
        Shared {
            client,
            downloader,
            store,
            graph,
            run_id: config.run_id.clone(),
            place: config.place.clone(),
            limiter: PaidLimiter::new(config.rate).sharing(config.account_rate.clone()),
            downloads: Semaphore::new(config.download_concurrency.max(1)),
            url_ttl: config.url_ttl,
            url_margin: config.url_margin,
            paid_retry: RetryPolicy::new(config.max_retries.saturating_add(1), config.retry_base),
            download_retry: RetryPolicy::new(DOWNLOAD_TRIES, config.retry_base),
            free_retry: RetryPolicy::new(FREE_TRIES, config.retry_base),
            stop: tokio::sync::watch::Sender::new(false),
            free: Semaphore::new(FREE_CONCURRENCY),
            urls: Mutex::new(HashMap::new()),
            storage_failure: OnceLock::new(),
        }
    }

    pub(super) fn stop(&self) {
        self.stop.send_replace(true);
    }

    /// The run directory cannot keep outputs: stops dispatching at once, from the download
    /// that found it, so that no call still waiting for its turn is sent meanwhile. The first
    /// failure is the one kept.
    pub(super) fn storage_failed(&self, error: String) {
        let _ = self.storage_failure.set(error);
        self.stop();
    }

    /// The first failure of the run directory, once there was one.
    pub(super) fn storage_failure(&self) -> Option<&str> {
        self.storage_failure.get().map(String::as_str)
    }

    pub(super) fn is_stopping(&self) -> bool {
        *self.stop.borrow()
    }

    /// Completes once the run stops dispatching.
    pub(super) async fn stopped(&self) {
        let mut rx = self.stop.subscribe();
        let _ = rx.wait_for(|stop| *stop).await;
    }

    fn urls(&self) -> std::sync::MutexGuard<'_, HashMap<(usize, u32), OutputUrl>> {
        self.urls.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn set_url(&self, task: usize, k: u32, url: OutputUrl) {
        self.urls().insert((task, k), url);
    }

    /// Drops a task's URLs: nothing reads them any more.
    pub(super) fn forget(&self, task: usize, outputs: u32) {
        let mut urls = self.urls();
        for k in 0..outputs {
            urls.remove(&(task, k));
        }
    }

    pub(super) fn url(&self, task: usize, k: u32) -> Option<OutputUrl> {
        self.urls().get(&(task, k)).cloned()
    }

    /// The output's URL, fetched anew from its job when it is within the margin of expiry
    /// (or `force`): never by calling the tool again.
    pub(super) async fn fresh_url(
        &self,
        task: usize,
        k: u32,
        force: bool,
    ) -> Result<OutputUrl, String> {
        let current = self
            .url(task, k)
            .ok_or_else(|| format!("no recorded output {k} of task {task}"))?;
        let age = Duration::from_millis(u64::try_from(now_ms() - current.issued_ms).unwrap_or(0));
        if !force && age + self.url_margin < self.url_ttl {
            return Ok(current);
        }
        self.refresh(task, &current.job_id).await?;
        self.url(task, k)
            .ok_or_else(|| format!("no recorded output {k} of task {task}"))
    }

    /// Fetches fresh URLs for every output of `task` from `GET /v1/jobs/{job_id}`.
    pub(super) async fn refresh(&self, task: usize, job_id: &JobId) -> Result<(), String> {
        let record = self
            .free_call(|| self.client.job(job_id))
            .await
            .map_err(|e| e.to_string())?;
        let urls = record.image_urls();
        let now = now_ms();
        let mut fresh = Vec::new();
        for (k, url) in urls.into_iter().enumerate() {
            let key = (task, k as u32);
            let Some(mut known) = self.url(key.0, key.1) else {
                continue;
            };
            known.url = url;
            known.issued_ms = now;
            fresh.push(UrlIssued {
                output_id: known.output_id,
                url: known.url.clone(),
                issued_at: now,
            });
            self.set_url(key.0, key.1, known);
        }
        if fresh.is_empty() {
            return Err(format!("GET /v1/jobs/{job_id} lists no image URLs"));
        }
        tracing::debug!(job = %job_id.shown(), "refreshed {} result URL(s)", fresh.len());
        self.store
            .outputs()
            .refresh_urls(&fresh)
            .await
            .map_err(|e| e.to_string())
    }

    /// A free read with its own concurrency and retries, so it never waits behind paid calls.
    pub(super) async fn free_call<T, F, Fut>(&self, call: F) -> Result<T, ApiError>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<T, ApiError>>,
    {
        let _permit = self.free.acquire().await;
        crate::api::retry::free_call(self.free_retry, call).await
    }
}
