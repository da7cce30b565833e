//! Whether a run recorded as `running` still has its process. The record cannot say: a
//! process killed with SIGKILL, or on a machine that stopped, records nothing. The run lock
//! can ([`crate::store::lock::probe`]): the kernel lets it go when its process dies.

use serde::Serialize;

use crate::run_id::RunId;
use crate::store::lock::{self, Probe};
use crate::store::{Run, RunStatus, RunSummary, Store, StoreError};

/// The process of a run recorded as `running`.
#[derive(Clone, Debug, Serialize)]
pub struct Process {
    /// It holds the run lock: the run is going. Otherwise it is gone, and the run is shown as
    /// `interrupted`.
    pub alive: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// RFC 3339, UTC: when it took the lock.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
}

/// Why a run's process is gone, when the record says it is running.
pub const GONE: &str = "it ended without recording its end (killed, or its machine stopped)";

impl Process {
    /// `pid 12 on host since …`, when the lock file named the holder.
    pub fn holder(&self) -> Option<String> {
        match (self.pid, &self.host, &self.since) {
            (Some(pid), Some(host), Some(since)) => {
                Some(format!("pid {pid} on {host} since {since}"))
            }
            _ => None,
        }
    }

    /// One line of text: `going: pid 12 on host since …`, or `gone: …`.
    pub fn describe(&self) -> String {
        match (self.alive, self.holder()) {
            (true, Some(holder)) => format!("going: {holder}"),
            (true, None) => "going: its process holds the run lock".to_owned(),
            (false, _) => format!("gone: {GONE}"),
        }
    }
}

/// `run` as it stands now. A run recorded as `running` whose process no longer holds the run
/// lock is returned as `interrupted`, with a [`Process`] saying it is gone; a live one stays
/// `running`, with its process. Other runs are returned as recorded, without a process.
pub async fn observe<R: Observable>(
    store: &Store,
    mut run: R,
) -> Result<(R, Option<Process>), StoreError> {
    if run.status() != RunStatus::Running {
        return Ok((run, None));
    }
    let held = match lock::probe_store(store, run.pipeline_name()).await {
        Ok(Probe::Held(holder)) => Some(holder),
        Ok(Probe::Free) => None,
        Err(e) => {
            tracing::debug!("cannot ask the run lock of {}: {e}", run.id());
            return Ok((run, None));
        }
    };
    // Held by this run, or by a process that has not written its name yet: going. Held by
    // another run of the pipeline, or free: this run's process is gone.
    if let Some(holder) = held
        && holder.as_ref().is_none_or(|h| *run.id() == *h.run_id)
    {
        let process = Process {
            alive: true,
            pid: holder.as_ref().map(|h| h.pid),
            host: holder.as_ref().map(|h| h.host.clone()),
            since: holder.map(|h| h.since),
        };
        return Ok((run, Some(process)));
    }
    // The run may have recorded its end (and let go of the lock) since it was read.
    let Some(now) = R::read(store, run.id()).await? else {
        return Ok((run, None));
    };
    run = now;
    if run.status() != RunStatus::Running {
        return Ok((run, None));
    }
    run.interrupted();
    let gone = Process {
        alive: false,
        pid: None,
        host: None,
        since: None,
    };
    Ok((run, Some(gone)))
}

/// A run's record as [`observe`] reads it: whole ([`Run`]) or summed up ([`RunSummary`]), read
/// again as it was given when the run may have ended since.
pub trait Observable: Sized {
    fn id(&self) -> &RunId;
    fn pipeline_name(&self) -> &str;
    fn status(&self) -> RunStatus;
    /// Shown as interrupted: recorded running, its process gone.
    fn interrupted(&mut self);
    fn read(
        store: &Store,
        id: &RunId,
    ) -> impl Future<Output = Result<Option<Self>, StoreError>> + Send;
}

/// Both records hold the same fields for it; each is read again by its own statement.
macro_rules! observable {
    ($record:ty, $read:ident) => {
        impl Observable for $record {
            fn id(&self) -> &RunId {
                &self.id
            }

            fn pipeline_name(&self) -> &str {
                &self.pipeline_name
            }

            fn status(&self) -> RunStatus {
                self.status
            }

            fn interrupted(&mut self) {
                self.status = RunStatus::Interrupted;
            }

            async fn read(store: &Store, id: &RunId) -> Result<Option<$record>, StoreError> {
                store.runs().$read(id).await
            }
        }
    };
}

observable!(Run, get);
observable!(RunSummary, summary);

/// What a report says of a run beyond its record: its process, and how to continue it.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Observed {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub process: Option<Process>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub continue_with: Option<String>,
}
