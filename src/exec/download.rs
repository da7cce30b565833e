//! Downloads of outputs, as soon as their job succeeds: their own concurrency, no API rate
//! limit, and a fresh URL from the job (never a new paid call) when one is refused. A failure
//! of the run directory itself (a full disk, a store refusing writes) stops the run's calls at
//! once, and the downloads not started yet: they are left for the next resume.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::oneshot::error::RecvError;
use tokio::task::{JoinError, JoinSet};

use crate::api::fetch::{FetchError, Retrying, fetch_with_refresh};
use crate::api::job_id::JobId;
use crate::exec::Refetch;
use crate::exec::shared::Shared;
use crate::place::Address;
use crate::store::{RecordedOutput, StoreError};

/// Downloads waiting or under way, per download slot, past which no new call is sent.
const DOWNLOADS_WAITING_PER_SLOT: usize = 4;

/// What a resume's check of the kept files found to fetch again, when it ended.
pub(super) type Checked = Result<Result<Vec<RecordedOutput>, Arc<StoreError>>, RecvError>;

/// The downloads of a run: those under way, the earlier outputs a resume's check of the kept
/// files will bring, and whether the run directory has proven it keeps what is paid for.
pub(super) struct Downloads {
    set: JoinSet<Fetched>,
    /// Downloads in flight, by task: its URLs are kept until they end.
    by_task: HashMap<usize, u32>,
    /// How many may wait or go at once before calls are held back.
    backlog: usize,
    /// Earlier outputs to fetch again, once a resume's check of the kept files ends.
    refetch: Option<Refetch>,
    /// Earlier outputs without a file still being fetched, while none has been kept yet: a
    /// resume sends no call before its run directory has kept one of them, so a disk still
    /// full (or a bucket still refusing) costs nothing.
    unproven: Option<usize>,
    /// Told when `unproven` is cleared (see [`crate::exec::Handoff::place_proven`]).
    place_proven: Option<tokio::sync::oneshot::Sender<()>>,
}

/// News of the downloads.
pub(super) enum News {
    Fetched(Result<Fetched, JoinError>),
    Checked(Checked),
}

impl Downloads {
    pub(super) fn new(
        download_concurrency: usize,
        refetch: Option<Refetch>,
        place_proven: Option<tokio::sync::oneshot::Sender<()>>,
    ) -> Downloads {
        Downloads {
            set: JoinSet::new(),
            by_task: HashMap::new(),
            backlog: download_concurrency.max(1) * DOWNLOADS_WAITING_PER_SLOT,
            refetch,
            unproven: None,
            place_proven,
        }
    }

    pub(super) fn spawn(&mut self, shared: &Arc<Shared>, t: usize, k: u32) {
        *self.by_task.entry(t).or_default() += 1;
        self.set.spawn(download(Arc::clone(shared), t, k));
    }

    pub(super) fn is_empty(&self) -> bool {
        self.set.is_empty()
    }

    /// Whether task `t` has downloads under way.
    pub(super) fn downloading(&self, t: usize) -> bool {
        self.by_task.contains_key(&t)
    }

    /// Whether enough outputs wait for their download that no new call should be sent: calls
    /// that outpace downloads would pile up outputs whose URLs age, and memory, without end.
    pub(super) fn backlogged(&self) -> bool {
        self.set.len() >= self.backlog
    }

    /// Every download so far fetches an output a run paid for and could not keep: until one
    /// is kept, the run directory is not proven.
    pub(super) fn prove_place(&mut self) {
        self.unproven = (!self.set.is_empty()).then_some(self.set.len());
    }

    /// Whether the run directory is still to prove it keeps outputs.
    pub(super) fn proving(&self) -> bool {
        self.unproven.is_some()
    }

    /// Tells a resume's check of the kept files, once, that the run directory is proven.
    pub(super) fn tell_proven(&mut self) {
        if self.unproven.is_none()
            && let Some(proven) = self.place_proven.take()
        {
            let _ = proven.send(());
        }
    }

    /// Whether a check of the kept files is still under way.
    pub(super) fn checking(&self) -> bool {
        self.refetch.is_some()
    }

    /// The next download to end, or the end of the check of the kept files; never, with
    /// neither under way.
    pub(super) async fn next(&mut self) -> News {
        tokio::select! {
            Some(joined) = self.set.join_next(), if !self.set.is_empty() => News::Fetched(joined),
            found = checked(&mut self.refetch), if self.refetch.is_some() => {
                self.refetch = None;
                News::Checked(found)
            }
            else => std::future::pending().await,
        }
    }

    /// The next download to end.
    pub(super) async fn join_next(&mut self) -> Option<Result<Fetched, JoinError>> {
        self.set.join_next().await
    }

    /// Cuts off every download, and waits until they are gone.
    pub(super) async fn abort(&mut self) {
        self.set.abort_all();
        while self.set.join_next().await.is_some() {}
    }

    /// A download of task `t` ended, its output `kept` or not: `true` when it was the task's
    /// last, and its URLs may be forgotten.
    pub(super) fn ended(&mut self, t: usize, kept: bool) -> bool {
        if kept {
            self.unproven = None;
        }
        if let Some(n) = &mut self.unproven {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.unproven = None;
            }
        }
        if let Some(n) = self.by_task.get_mut(&t) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.by_task.remove(&t);
                return true;
            }
        }
        false
    }
}

/// The outputs a resume's check found to fetch again, once it ends; never, without one.
async fn checked(refetch: &mut Option<Refetch>) -> Checked {
    match refetch {
        Some(rx) => rx.await,
        None => std::future::pending().await,
    }
}

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

fn paid_for(job_id: &JobId) -> String {
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
    let job_id = &out.job_id;
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
                tracing::debug!(job = %job_id.shown(), "download refused ({e}); fetching a fresh URL");
            }
            Retrying::Transient { error, .. } => {
                tracing::debug!(job = %job_id.shown(), "download failed ({error}); trying again");
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
