//! The work the desk started (a reroll or a continuation confirmed on its page): what the page
//! follows through `GET /api/runs/{run}/work`, and what the desk waits for when it stops, so
//! that work reaches the runner's safe point before the process ends.
//!
//! One entry per run the desk started work on, its latest: a few bytes each, whatever the
//! batch.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use serde::Serialize;
use tokio_util::task::TaskTracker;

use crate::error::Error;
use crate::run_id::RunId;

/// What the desk started on a run, and how it is going.
#[derive(Clone, Debug, Serialize)]
pub struct Started {
    /// `reroll` or `continue`.
    pub kind: &'static str,
    /// The price confirmed.
    pub credits: u64,
    /// `going`, `done` or `failed`.
    pub state: &'static str,
    /// Why it failed and what to do, as the command line says it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
}

/// The desk's work: the latest per run, and the tasks to wait for.
#[derive(Default)]
pub struct Works {
    latest: Arc<Mutex<HashMap<RunId, Started>>>,
    tracker: TaskTracker,
}

impl Works {
    /// Follows `ran` (the runner's end) as `kind` work on run `id` paid `credits`.
    pub(super) fn follow(
        &self,
        id: RunId,
        kind: &'static str,
        credits: u64,
        ran: impl Future<Output = Option<Result<(), Error>>> + Send + 'static,
    ) {
        let going = Started {
            kind,
            credits,
            state: "going",
            error: None,
            hint: None,
        };
        lock(&self.latest).insert(id.clone(), going.clone());
        let latest = Arc::clone(&self.latest);
        self.tracker.spawn(async move {
            let ended = match ran.await {
                Some(Ok(())) => Started {
                    state: "done",
                    ..going
                },
                Some(Err(e)) => failed(going, &e.to_string()),
                None => failed(going, "the desk's runner was lost"),
            };
            lock(&latest).insert(id, ended);
        });
    }

    /// The latest work the desk started on run `id`.
    pub fn latest(&self, id: &RunId) -> Option<Started> {
        lock(&self.latest).get(id).cloned()
    }

    /// Waits until every work started has ended (the runners stop at their safe point once
    /// the desk's shutdown is cancelled).
    pub async fn wait(&self) {
        self.tracker.close();
        self.tracker.wait().await;
    }
}

type Latest = Mutex<HashMap<RunId, Started>>;

fn lock(latest: &Latest) -> std::sync::MutexGuard<'_, HashMap<RunId, Started>> {
    latest.lock().unwrap_or_else(|e| e.into_inner())
}

/// `going` ended with `message` (`…\nhint: …` split as the API answers errors).
fn failed(going: Started, message: &str) -> Started {
    let (error, hint) = match message.split_once("\nhint: ") {
        Some((m, h)) => (m.to_owned(), Some(h.to_owned())),
        None => (message.to_owned(), None),
    };
    Started {
        state: "failed",
        error: Some(error),
        hint,
        ..going
    }
}
