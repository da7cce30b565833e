//! The executor: runs a run's tasks concurrently under the rate limiter and the budget,
//! records every attempt, and downloads every output as soon as it exists.
//!
//! On shutdown it stops dispatching, lets the calls in flight finish for a bounded time and
//! records them; a call cut off after that stays recorded as in flight, that is, possibly
//! billed, which is exactly what is known of it.

pub mod account_rate;
mod attempt;
mod calls;
mod download;
pub mod identity;
pub mod limiter;
pub mod manifest;
mod ready;
mod rows;
mod scheduler;
mod shared;
mod state;

use std::sync::Arc;
use std::time::Duration;

use crate::run_id::RunId;
use crate::store::StoreError;

pub use rows::{new_task, read_rows};
pub use scheduler::run;

/// Where the executor's calls, records and files go.
#[derive(Clone)]
pub struct Links {
    pub store: crate::store::Store,
    pub client: crate::api::Client,
    pub downloader: crate::api::Downloader,
}

/// Outputs of earlier tasks that a resume, checking the kept files beside the run, found
/// missing or modified (and set aside: no path recorded): the executor fetches each again from
/// its job, free. A check that could not end says why (the state database failed it): the run
/// then stops as when it cannot record, never recorded succeeded with its kept outputs
/// unchecked (a succeeded run is not checked again by the next resume).
pub type Refetch =
    tokio::sync::oneshot::Receiver<Result<Vec<crate::store::RecordedOutput>, Arc<StoreError>>>;

/// What a resume hands the executor from its review, so the executor's start reads nothing
/// the review already read: at a night's 900,000 tasks, reading every task's row id again cost
/// seconds before the first paid call.
pub struct Handoff {
    /// The kept outputs to fetch again, as the check beside the run finds them.
    pub refetch: Refetch,
    /// Each recorded task's row id as the review read them, when they are still every row
    /// of the run (its application recorded none): the executor then reads only the rows
    /// not succeeded, for their state now. `None`: it reads them all again.
    pub rows: Option<crate::plan::rows::RowIds>,
    /// Told once the run's place is proven writable (an earlier output fetched again and kept,
    /// or none to fetch), or dropped with the executor: the kept outputs' check waits for it,
    /// so its listings never queue ahead of the write that lets the first paid call go.
    pub place_proven: tokio::sync::oneshot::Sender<()>,
}

/// What to do with a call that was sent and got no complete answer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OnAmbiguous {
    /// Record it as possibly billed and call again.
    #[default]
    Retry,
    /// Record it as possibly billed and fail the task.
    Fail,
}

#[derive(Clone, Debug)]
pub struct Config {
    pub run_id: RunId,
    /// `<output_dir>/<run id>`.
    pub run_dir: crate::place::RunDir,
    /// The same, opened: a local directory or a prefix in object storage.
    pub place: crate::place::Place,
    pub concurrency: usize,
    /// Paid calls per second; `None` for no limit until the service answers 429.
    pub rate: Option<f64>,
    pub download_concurrency: usize,
    pub on_ambiguous: OnAmbiguous,
    /// How long a result URL lives (the spec: one hour).
    pub url_ttl: Duration,
    /// URLs closer than this to expiry are refreshed before a call uses them.
    pub url_margin: Duration,
    /// First retry delay; later ones double.
    pub retry_base: Duration,
    /// Retries of a call after server errors or connection failures.
    pub max_retries: u32,
    /// How long calls in flight may take to finish after SIGINT/SIGTERM.
    pub grace: Duration,
    /// The most the run may spend: the limit, the least of the budget left and the balance.
    pub limit: Option<u64>,
    /// Run this task alone (a generation that discovers the price), nothing else.
    pub only: Option<usize>,
    /// The tasks to pay for now (`--items`, `--until`, a reroll's); the others are left
    /// pending, untouched, for a later resume.
    pub scope: crate::plan::scope::Scope,
    /// By step: whether its price is known to be what the service bills (stated by the
    /// service or the spec, or billed before), so no single call has to confirm it first.
    pub known_prices: Vec<bool>,
    /// The run's hold on the spending caps that cover it: chains are committed only from what
    /// it leased.
    pub leash: Option<crate::money::caps::Leash>,
    /// The account's rate limit, shared with every process that spends on it through the
    /// state database; `None` without a known rate (or a database that cannot say).
    pub account_rate: Option<account_rate::AccountRate>,
    /// The pipeline's name: checks' verdicts are recorded under it and their step's id.
    pub pipeline_name: String,
    /// What rerolls asked for by checks may be planned at in all (`rerolls.max_credits`): 0
    /// when the pipeline has none.
    pub reroll_credits: u64,
}

/// Live news of the run, for the progress display or log lines.
pub trait Observer: Send + Sync {
    fn task_succeeded(&self, step: usize, credits: u64);
    fn task_failed(&self, step: usize, item: &str, reason: &str);
    /// A call of task `task` (`item/step[i]`) of step `step` was billed `billed` credits where
    /// the plan priced it at `planned`, before its outputs are checked.
    fn call_billed(&self, _step: usize, _task: &str, _planned: u64, _billed: u64) {}
    /// A lease of this run took a spending cap's window past 50, 80 or 100%.
    fn cap_crossed(&self, _crossing: &crate::money::caps::Crossing) {}
    /// The state database did not answer a draw from the account's shared rate: this process
    /// keeps to `share` calls a second (the account's `limit` over the `drawers` it last saw)
    /// until it answers again.
    fn rate_fallback(&self, _share: f64, _limit: f64, _drawers: u64) {}
    /// The run stopped dispatching and everything in flight was settled.
    fn finish(&self) {}
}

/// Why nothing more can be done, with its cause kept as a type: a refused key and a state
/// database that cannot be written call for different remedies.
#[derive(Clone, Debug, thiserror::Error)]
pub enum Fatal {
    /// The service refused the key (401/403): every further call would be refused too.
    #[error("{0}")]
    Refused(String),
    /// The state database cannot be written: a call it cannot record must not be sent.
    #[error("cannot record the run: {0}")]
    Store(Arc<StoreError>),
    /// A call's or a download's task ended abnormally (a bug).
    #[error("{0}")]
    Crashed(String),
}

/// Why a run stopped before its work was done, short of an interruption.
#[derive(Clone, Debug)]
pub enum Stop {
    /// The next chain does not fit what the limit (the budget left, the balance) leaves.
    Limit { needed: u64, left: u64 },
    /// A call was billed more than the plan priced it at.
    PriceAbovePlan {
        task: String,
        planned: u64,
        billed: u64,
    },
    /// A spending cap's window has too little left for the next chain.
    Cap(crate::money::caps::Spent),
    /// Another run took this one for dead and closed its cap leases.
    LeaseLost,
    /// The service answered 402.
    Balance(String),
    /// The run directory cannot keep outputs (a full disk or quota, a permission lost, a
    /// read-only file system, a store refusing writes): every output paid for after this
    /// would be lost too. `place` is the run directory, `error` the first failure there.
    Storage { place: String, error: String },
    /// Nothing more can be done: the key was refused, or the record cannot be written.
    Fatal(Fatal),
}

impl Stop {
    pub fn describe(&self) -> String {
        match self {
            Stop::Limit { needed, left } => format!(
                "the next item needs {} and the budget or balance leaves {left}; the rest is left pending",
                crate::money::credits(*needed)
            ),
            Stop::PriceAbovePlan {
                task,
                planned,
                billed,
            } => format!(
                "{task} was billed {} where the plan said {planned}; no call was sent after that bill",
                crate::money::credits(*billed)
            ),
            Stop::Cap(s) => format!(
                "cap {} ({} a {}) has {} left in this window and the next item needs {}; the rest is left pending until the window reopens at {}",
                s.cap,
                crate::money::credits(s.credits), s.per, s.left, s.needed, s.reopens
            ),
            Stop::LeaseLost => "another run took this one for dead and closed its cap leases; the rest is left pending".to_owned(),
            Stop::Balance(e) => format!("the service refused a call for lack of credits: {e}"),
            Stop::Storage { place, error } => format!(
                "outputs cannot be written to {place}: {error}; no call was sent after that, and the calls in flight then were recorded"
            ),
            Stop::Fatal(e) => e.to_string(),
        }
    }
}

/// How the run ended.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    pub stop: Option<Stop>,
    pub interrupted: bool,
    /// The failed tasks: `item/step[idx]` and the reason.
    pub failures: Vec<(String, String)>,
    /// The last `credits_remaining` the service reported.
    pub last_balance: Option<i64>,
    /// Tasks left pending because they are outside the scope asked for.
    pub held: usize,
}
