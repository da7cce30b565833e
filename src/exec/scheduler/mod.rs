//! The scheduler: decides what runs next and what a finished attempt means.
//!
//! A task is ready when every task it reads has succeeded. Ready tasks of chains already under
//! way go first (depth-first), so each item finishes promptly and its downstream calls use
//! upstream URLs well inside their lifetime; a new chain is admitted only when its whole
//! remaining cost fits the purse.
//!
//! The scheduler orchestrates parts that each keep their own state: the [`Purse`] (money),
//! the [`Readiness`] of tasks, the [`Calls`] in flight and the [`Downloads`]. What an
//! attempt's answer means is in `settle`, what is sent next in `dispatch`, the purse's leases
//! in `spend`, earlier outputs and downloads' ends in `outputs`.

mod checked;
mod dispatch;
mod outputs;
mod settle;
mod spend;

use std::sync::Arc;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::exec::calls::Calls;
use crate::exec::download::Downloads;
use crate::exec::ready::Readiness;
use crate::exec::rows::{Rows, record_identities};
use crate::exec::shared::Shared;
use crate::exec::state::State;
use crate::exec::{Config, Fatal, Handoff, Links, Observer, Outcome, Stop};
use crate::money::purse::Purse;
use crate::plan::graph::{Graph, Instance};
use crate::store::StoreError;

/// Per task, a few bytes (its state, a row id mostly derived, a bit while ready): everything
/// else exists only while a task is ready, in flight or being downloaded.
struct Scheduler {
    shared: Arc<Shared>,
    graph: Arc<Graph>,
    config: Config,
    observer: Arc<dyn Observer>,
    state: Vec<State>,
    rows: Rows,
    /// The run's money: its limit, reservations, commitments and the caps' leases.
    purse: Purse,
    ready: Readiness,
    calls: Calls,
    downloads: Downloads,
    /// Checks of stored outputs, and the rerolls they asked for.
    checking: checked::Checking,
    /// The longest chain of calls of the graph.
    depth: u32,
    /// Tasks still to run (not done, failed or blocked).
    unfinished: usize,
    /// Tasks that succeeded in this process, for their identities at the end.
    succeeded: Vec<usize>,
    /// Stops every dispatch.
    halt: Option<Stop>,
    /// Stops admitting new chains; those under way finish.
    closed: Option<Stop>,
    outcome: Outcome,
    /// Cancelled on SIGINT/SIGTERM: stop dispatching, let what is in flight finish.
    shutdown: CancellationToken,
}

/// Runs every unfinished task of the run recorded in `store` until done, stopped or
/// interrupted by `shutdown`.
/// A resume's `handoff` brings, while it runs, earlier outputs to fetch again: the run does not
/// end before they are fetched, unless it is interrupted or halted (the next resume finds them
/// again); and the row ids its review read, not read again.
pub async fn run(
    graph: Arc<Graph>,
    links: Links,
    config: Config,
    observer: Arc<dyn Observer>,
    shutdown: CancellationToken,
    handoff: Option<Handoff>,
) -> Result<Outcome, StoreError> {
    let Links {
        store,
        client,
        downloader,
    } = links;
    let started = std::time::Instant::now();
    store.attempts().settle_orphaned(&config.run_id).await?;
    if let Some(rate) = &config.account_rate {
        rate.tell(Arc::clone(&observer));
    }
    let (refetch, read, proven) = match handoff {
        Some(h) => (Some(h.refetch), h.rows, Some(h.place_proven)),
        None => (None, None, None),
    };
    let (rows, state) = Rows::load(&store, &graph, &config, read).await?;
    tracing::debug!("tasks' state read in {:.2?}", started.elapsed());
    let shared = Arc::new(Shared::new(
        client,
        downloader,
        store.clone(),
        Arc::clone(&graph),
        &config,
    ));
    let downloads = Downloads::new(config.download_concurrency, refetch, proven);
    let (state, checking) = checked::recorded(&store, &graph, &config.run_id, state).await?;
    let parts = Parts {
        shared,
        graph,
        config,
        observer,
        rows,
        state,
        downloads,
        checking,
    };
    let mut s = Scheduler::new(parts, shutdown);
    s.restore_outputs().await?;
    tracing::debug!("earlier outputs restored after {:.2?}", started.elapsed());
    s.main_loop().await;
    s.purse.close();
    let (outcome, graph, rows, succeeded) = s.finish().await;
    record_identities(&store, &graph, &rows.ids, &succeeded).await?;
    Ok(outcome)
}

/// What a scheduler is made of.
struct Parts {
    shared: Arc<Shared>,
    graph: Arc<Graph>,
    config: Config,
    observer: Arc<dyn Observer>,
    rows: Rows,
    state: Vec<State>,
    downloads: Downloads,
    checking: checked::Checking,
}

impl Scheduler {
    fn new(parts: Parts, shutdown: CancellationToken) -> Scheduler {
        let Parts {
            shared,
            graph,
            config,
            observer,
            rows,
            state,
            downloads,
            checking,
        } = parts;
        let n = graph.len();
        let mut s = Scheduler {
            state,
            rows,
            purse: Purse::new(config.limit, config.leash.clone()),
            ready: Readiness::new(n, graph.instances()),
            calls: Calls::new(graph.step_ids.len(), &config.known_prices),
            downloads,
            checking,
            depth: graph.depth(),
            unfinished: 0,
            succeeded: Vec::new(),
            halt: None,
            closed: None,
            outcome: Outcome::default(),
            shutdown,
            shared,
            graph,
            config,
            observer,
        };
        // Outside the scope, what is still to do is held: never ready, never paid for.
        if !s.config.scope.is_all() {
            for t in 0..n {
                if s.state[t] == State::Waiting && !s.config.scope.contains(&s.graph, t) {
                    s.state[t] = State::Held;
                    s.outcome.held += 1;
                }
            }
        }
        // Below a task failed for good, what is still to do is blocked.
        for t in 0..n {
            if s.state[t] == State::Failed {
                for d in s.graph.descendants(t) {
                    if s.state[d] == State::Waiting {
                        s.state[d] = State::Blocked;
                    }
                }
            }
        }
        s.unfinished = s.state.iter().filter(|x| **x == State::Waiting).count();
        for t in 0..n {
            if s.inputs_made(t) {
                s.push_ready(t);
            }
        }
        s
    }

    /// Whether `t` waits for nothing more: every task it reads is done. Asked of a task's
    /// few inputs when one of them is done, rather than kept as a count per task (9 MB at
    /// 1,000,000 items).
    fn inputs_made(&self, t: usize) -> bool {
        self.state[t] == State::Waiting
            && self
                .graph
                .deps(t)
                .iter()
                .all(|d| self.state[*d] == State::Done)
    }

    /// Whether `t` will not run in this process: done, failed, blocked, or held outside
    /// the scope.
    fn settled(&self, t: usize) -> bool {
        matches!(
            self.state[t],
            State::Done | State::Failed | State::Blocked | State::Held
        )
    }

    /// Whether a task's URLs are still needed: a task that reads them is not settled. The
    /// batch's are kept: they are few, and read by every item.
    fn still_read(&self, t: usize) -> bool {
        self.graph.task(t).instance == Instance::Batch
            || self.graph.children(t).iter().any(|c| !self.settled(*c))
    }

    /// Forgets a task's URLs once nothing will read them: not its downloads, not its readers.
    fn release(&mut self, t: usize) {
        if !self.downloads.downloading(t) && !self.still_read(t) {
            self.shared.forget(t, self.graph.outputs(t));
        }
    }

    /// After `t` settled: the URLs of what it read may be needed no more.
    fn release_inputs(&mut self, t: usize) {
        for d in self.graph.deps(t) {
            self.release(d);
        }
    }

    fn push_ready(&mut self, t: usize) {
        if self.config.only.is_some_and(|only| only != t) {
            return;
        }
        self.state[t] = State::Ready;
        self.ready.push(t, self.graph.task(t).instance);
    }

    /// Records the tasks of the next items to admit, before they are admitted.
    async fn record_ahead(&mut self) {
        let Some(next) = self.ready.first_new() else {
            return;
        };
        let Instance::Item(i) = self.graph.task(next).instance else {
            return;
        };
        let ahead = self.config.concurrency.saturating_mul(4);
        // Runs before every dispatch: borrows, no clones, and nothing to do most times.
        let (store, graph, run_id) = (&self.shared.store, &self.graph, &self.config.run_id);
        let recorded = self.rows.record_ahead(store, graph, run_id, i, ahead).await;
        if let Err(e) = recorded {
            self.fatal(Fatal::Store(Arc::new(e)));
        }
    }

    async fn main_loop(&mut self) {
        let shutdown = self.shutdown.clone();
        let mut deadline: Option<Instant> = None;
        loop {
            self.downloads.tell_proven();
            if deadline.is_none() && self.halt.is_none() {
                self.check_lease().await;
            }
            if deadline.is_none() && self.halt.is_none() && self.closed.is_none() {
                self.record_ahead().await;
                self.lease_ahead().await;
            }
            if deadline.is_none() {
                self.dispatch();
            }
            if self.halt.is_some() {
                self.shared.stop();
            }
            let going = self.halt.is_none() && deadline.is_none();
            // Calls held back for the downloads to catch up are not the end of the run.
            let held_back = self.downloads.backlogged() && going;
            // Nor is a check of the kept files still under way, unless the run must stop.
            let checking = self.downloads.checking() && going;
            // Nor is a resume waiting for its run directory to keep an earlier output.
            let proving = self.downloads.proving() && going;
            // Nor are outputs still to be judged before what reads them goes.
            let judging = self.checking.busy() && going;
            // A chain waiting for a lease is leased at the top of the loop, calls in flight
            // or not.
            if self.purse.waiting() && self.closed.is_none() && going {
                continue;
            }
            if self.calls.is_empty() && !held_back && !checking && !proving && !judging {
                break;
            }
            tokio::select! {
                Some(joined) = self.calls.next() => match joined {
                    Ok(attempted) => self.settle(attempted).await,
                    Err(e) => self.fatal(Fatal::Crashed(format!("a call's task ended abnormally: {e}"))),
                },
                news = self.downloads.next() => self.downloads_news(news),
                judged = self.checking.next() => self.judged(judged).await,
                () = shutdown.cancelled(), if deadline.is_none() => {
                    self.shared.stop();
                    tracing::warn!(
                        "interrupted: no new calls; waiting up to {:.0}s for {} in flight",
                        self.config.grace.as_secs_f64(),
                        self.calls.len()
                    );
                    self.outcome.interrupted = true;
                    deadline = Some(Instant::now() + self.config.grace);
                }
                () = sleep_until(deadline) => {
                    tracing::warn!(
                        "{} call(s) still in flight after the grace period; recorded as possibly billed",
                        self.calls.len()
                    );
                    self.calls.abort().await;
                    break;
                }
            }
        }
        self.drain_downloads(deadline).await;
        self.checking.abort().await;
    }

    fn name(&self, t: usize) -> String {
        self.graph.key(t).to_string()
    }

    /// Stops every dispatch for a cause no retry can cure; the first cause is the one kept.
    fn fatal(&mut self, cause: Fatal) {
        tracing::debug!("the run stops: {cause}");
        if !matches!(self.halt, Some(Stop::Fatal(_))) {
            self.halt = Some(Stop::Fatal(cause));
        }
    }

    /// Stops every dispatch: the run directory cannot keep what more calls would buy. Only a
    /// state database that cannot be written says more (the first of the two is kept).
    fn storage_failed(&mut self, error: String) {
        if matches!(self.halt, Some(Stop::Fatal(_) | Stop::Storage { .. })) {
            return;
        }
        let place = self.config.run_dir.root().to_string();
        tracing::error!(
            "the outputs cannot be written to {place}: {error}; no new call is sent, and the calls already sent are recorded as they end"
        );
        self.halt = Some(Stop::Storage { place, error });
        self.shared.stop();
    }

    /// The outcome, and what the identities of this process's results are recorded from.
    async fn finish(mut self) -> (Outcome, Arc<Graph>, Rows, Vec<usize>) {
        if self.outcome.interrupted
            && let Err(e) = self
                .shared
                .store
                .attempts()
                .settle_orphaned(&self.config.run_id)
                .await
        {
            self.fatal(Fatal::Store(Arc::new(e)));
        }
        self.outcome.stop = self.halt.take().or(self.closed.take());
        (self.outcome, self.graph, self.rows, self.succeeded)
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use crate::plan::graph::Graph;

    #[test]
    fn reach_counts_the_longest_chain_of_calls_ahead_of_each_task() {
        // Per item: a generation of two images, each erased, then upscaled: 5 tasks, chains
        // of three calls; the batch step's style feeds every item's generation.
        let g = Graph::of_text(
            r#"
version: 1
name: t
items: [{ id: a }, { id: b }]
steps:
  - id: style
    once: true
    generate: { prompt: a style }
  - id: shot
    generate: { prompt: "shot {{ item.id }}", n: 2, image_urls: [{ from: style }] }
  - id: clean
    erase: { from: shot, object_name: a scuff }
  - id: big
    upscale: { from: clean, desired_increase: 2 }
"#,
        );
        let of = |step: &str| -> Vec<u32> {
            (0..g.len())
                .filter(|t| g.step_id(*t) == step)
                .map(|t| g.reach(t))
                .collect()
        };
        assert_eq!(of("style"), [4]);
        assert_eq!(of("shot"), [3, 3]);
        assert_eq!(of("clean"), [2, 2, 2, 2]);
        assert_eq!(of("big"), [1, 1, 1, 1]);
        assert_eq!(g.depth(), 4);
    }
}
