//! The scheduler: decides what runs next and what a finished attempt means.
//!
//! A task is ready when every task it reads has succeeded. Ready tasks of chains already under
//! way go first (depth-first), so each item finishes promptly and its downstream calls use
//! upstream URLs well inside their lifetime; a new chain is admitted only when its whole
//! remaining cost fits the budget.

use std::collections::{BTreeSet, HashMap};

use crate::exec::ready::ReadySet;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot::error::RecvError;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::api::{ApiError, ErrorKind};
use crate::exec::attempt::{Attempted, Failure, Success, attempt};
use crate::exec::budget::Budget;
use crate::exec::download::{Fetched, Unfetched, download};
use crate::exec::rows::{Rows, record_identities};
use crate::exec::shared::{OutputUrl, Shared};
use crate::exec::state::State;
use crate::exec::{Config, Fatal, Handoff, Links, Observer, OnAmbiguous, Outcome, Refetch, Stop};
use crate::plan::graph::{Graph, Instance};
use crate::store::{RecordedOutput, StoreError, TaskStatus};

/// 429s one task may meet before it fails: the limiter slows down long before this.
const MAX_THROTTLED: u32 = 30;

#[derive(Default, Clone, Copy)]
struct Tries {
    retries: u32,
    throttled: u32,
    ambiguous: u32,
    refreshed: bool,
    delay: Duration,
    force_refresh: bool,
}

/// Downloads waiting or under way, per download slot, past which no new call is sent.
const DOWNLOADS_WAITING_PER_SLOT: usize = 4;

/// Per task, a few bytes (its state, a row id mostly derived, a bit while ready): everything else exists only
/// while a task is ready, in flight or being downloaded. Ready sets hold task numbers, whose
/// order is the depth-first order (instance, step, index).
struct Scheduler {
    shared: Arc<Shared>,
    graph: Arc<Graph>,
    config: Config,
    observer: Arc<dyn Observer>,
    state: Vec<State>,
    rows: Rows,
    /// Only tasks that have been tried and not settled.
    tries: HashMap<usize, Tries>,
    admitted_ready: BTreeSet<usize>,
    new_ready: ReadySet,
    batch_admitted: bool,
    admitted_items: Vec<bool>,
    /// By step: whether a bill confirmed its planned price, and whether a call is testing it.
    confirmed: Vec<bool>,
    probing: Vec<bool>,
    /// The longest chain of calls of the graph.
    depth: u32,
    /// Tasks still to run (not done, failed or blocked).
    unfinished: usize,
    /// Downloads in flight, by task: its URLs are kept until they end.
    downloading: HashMap<usize, u32>,
    /// Tasks that succeeded in this process, for their identities at the end.
    succeeded: Vec<usize>,
    budget: Budget,
    calls: JoinSet<Attempted>,
    downloads: JoinSet<Fetched>,
    /// Stops every dispatch.
    halt: Option<Stop>,
    /// Stops admitting new chains; those under way finish.
    closed: Option<Stop>,
    outcome: Outcome,
    /// Cancelled on SIGINT/SIGTERM: stop dispatching, let what is in flight finish.
    shutdown: CancellationToken,
    /// Earlier outputs to fetch again, once a resume's check of the kept files ends.
    refetch: Option<Refetch>,
    /// The cost of a chain waiting for the caps to lease enough to commit it.
    leasing: Option<u64>,
    /// What earlier executors of this process spent of the caps' leases: this one commits only
    /// what was leased beyond it.
    lease_base: u64,
    /// Earlier outputs without a file still being fetched, while none has been kept yet: a
    /// resume sends no call before its run directory has kept one of them, so a disk still
    /// full (or a bucket still refusing) costs nothing.
    unproven: Option<usize>,
    /// Told when `unproven` is cleared (see [`Handoff::place_proven`]).
    place_proven: Option<tokio::sync::oneshot::Sender<()>>,
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
    let mut s = Scheduler::new(shared, graph, config, observer, rows, state, shutdown);
    s.refetch = refetch;
    s.place_proven = proven;
    s.restore_outputs().await?;
    tracing::debug!("earlier outputs restored after {:.2?}", started.elapsed());
    s.main_loop().await;
    if let Some(leash) = &s.config.leash {
        leash.spent(s.budget.spent());
    }
    let (outcome, graph, rows, succeeded) = s.finish().await;
    record_identities(&store, &graph, &rows.ids, &succeeded).await?;
    Ok(outcome)
}

impl Scheduler {
    fn new(
        shared: Arc<Shared>,
        graph: Arc<Graph>,
        config: Config,
        observer: Arc<dyn Observer>,
        rows: Rows,
        state: Vec<State>,
        shutdown: CancellationToken,
    ) -> Scheduler {
        let n = graph.len();
        let mut s = Scheduler {
            state,
            rows,
            tries: HashMap::new(),
            admitted_ready: BTreeSet::new(),
            new_ready: ReadySet::new(n),
            batch_admitted: false,
            admitted_items: vec![false; graph.instances()],
            confirmed: (0..graph.step_ids.len())
                .map(|s| config.known_prices.get(s).copied().unwrap_or(false))
                .collect(),
            probing: vec![false; graph.step_ids.len()],
            depth: graph.depth(),
            unfinished: 0,
            downloading: HashMap::new(),
            succeeded: Vec::new(),
            budget: {
                let mut budget = Budget::new(config.cap);
                if let Some(leash) = &config.leash {
                    budget.lease(leash.leased().saturating_sub(leash.spent_so_far()));
                }
                budget
            },
            calls: JoinSet::new(),
            downloads: JoinSet::new(),
            halt: None,
            closed: None,
            outcome: Outcome::default(),
            shutdown,
            refetch: None,
            leasing: None,
            lease_base: config
                .leash
                .as_ref()
                .map_or(0, crate::caps::Leash::spent_so_far),
            unproven: None,
            place_proven: None,
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

    /// Loads the URLs of earlier outputs that a task still to run reads, and downloads those
    /// not on disk: the others are not read at all.
    async fn restore_outputs(&mut self) -> Result<(), StoreError> {
        let store = self.shared.store.clone();
        let mut read: Vec<i64> = (0..self.graph.len())
            .filter(|t| self.state[*t] == State::Done && self.still_read(*t))
            .filter_map(|t| self.rows.ids.get(t))
            .collect();
        read.sort_unstable();
        let mut outputs = store.outputs().unstored(&self.config.run_id).await?;
        let stored = store.kept().of_tasks(&read).await?.into_iter();
        outputs.extend(stored.filter(|o| o.path.is_some()));
        self.take_outputs(outputs);
        // Every download so far fetches an output a run paid for and could not keep.
        self.unproven = (!self.downloads.is_empty()).then_some(self.downloads.len());
        Ok(())
    }

    /// Keeps the URLs of earlier outputs that a task still to run reads, and downloads, from
    /// their jobs, those with no file or object.
    fn take_outputs(&mut self, outputs: Vec<RecordedOutput>) {
        let graph = Arc::clone(&self.graph);
        let index = graph.index();
        for o in outputs {
            let Some(t) = index.of(&o.task) else {
                continue;
            };
            let missing = o.path.is_none();
            if !missing && !self.still_read(t) {
                continue;
            }
            let k = o.k;
            self.shared.set_url(t, k, url_of(o));
            if missing {
                self.spawn_download(t, k);
            }
        }
    }

    fn spawn_download(&mut self, t: usize, k: u32) {
        *self.downloading.entry(t).or_default() += 1;
        self.downloads
            .spawn(download(Arc::clone(&self.shared), t, k));
    }

    /// Forgets a task's URLs once nothing will read them: not its downloads, not its readers.
    fn release(&mut self, t: usize) {
        if !self.downloading.contains_key(&t) && !self.still_read(t) {
            self.shared.forget(t, self.graph.outputs(t));
        }
    }

    /// After `t` settled: the URLs of what it read may be needed no more.
    fn release_inputs(&mut self, t: usize) {
        for d in self.graph.deps(t) {
            self.release(d);
        }
    }

    fn is_admitted(&self, instance: Instance) -> bool {
        match instance {
            Instance::Batch => self.batch_admitted,
            Instance::Item(i) => self.admitted_items.get(i).copied().unwrap_or(false),
        }
    }

    fn push_ready(&mut self, t: usize) {
        if self.config.only.is_some_and(|only| only != t) {
            return;
        }
        self.state[t] = State::Ready;
        if self.is_admitted(self.graph.task(t).instance) {
            self.admitted_ready.insert(t);
        } else {
            self.new_ready.insert(t);
        }
    }

    /// Records the tasks of the next items to admit, before they are admitted.
    async fn record_ahead(&mut self) {
        let Some(next) = self.new_ready.first() else {
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
            if self.unproven.is_none()
                && let Some(proven) = self.place_proven.take()
            {
                let _ = proven.send(());
            }
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
            // Calls held back for the downloads to catch up are not the end of the run.
            let held_back =
                self.downloads_backlogged() && self.halt.is_none() && deadline.is_none();
            // Nor is a check of the kept files still under way, unless the run must stop.
            let checking = self.refetch.is_some() && self.halt.is_none() && deadline.is_none();
            // Nor is a resume waiting for its run directory to keep an earlier output.
            let proving = self.unproven.is_some() && self.halt.is_none() && deadline.is_none();
            // A chain waiting for a lease is leased at the top of the loop, calls in flight
            // or not.
            let leasing = self.leasing.is_some()
                && self.halt.is_none()
                && self.closed.is_none()
                && deadline.is_none();
            if leasing {
                continue;
            }
            if self.calls.is_empty() && !held_back && !checking && !proving {
                break;
            }
            tokio::select! {
                Some(joined) = self.calls.join_next() => match joined {
                    Ok(attempted) => self.settle(attempted).await,
                    Err(e) => self.fatal(Fatal::Crashed(format!("a call's task ended abnormally: {e}"))),
                },
                Some(joined) = self.downloads.join_next(), if !self.downloads.is_empty() => {
                    self.downloaded(joined);
                }
                found = checked(&mut self.refetch), if self.refetch.is_some() => {
                    self.refetch = None;
                    self.check_ended(found);
                }
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
                    self.calls.abort_all();
                    while self.calls.join_next().await.is_some() {}
                    break;
                }
            }
        }
        self.drain_downloads(deadline).await;
    }

    /// Takes what the check of the kept files beside the run found. A check that failed, or
    /// ended without an answer, stops the run: recorded succeeded, its kept files would never
    /// be checked again; stopped, the next resume checks them.
    fn check_ended(
        &mut self,
        found: Result<Result<Vec<RecordedOutput>, Arc<StoreError>>, RecvError>,
    ) {
        match found {
            Ok(Ok(outputs)) => self.take_outputs(outputs),
            Ok(Err(e)) => self.fatal(Fatal::Store(e)),
            Err(_) => self.fatal(Fatal::Crashed(
                "the check of the kept files ended without an answer; the next resume checks them again".to_owned(),
            )),
        }
    }

    /// Waits for the downloads: all of them, or until the grace period ends after an
    /// interruption.
    async fn drain_downloads(&mut self, mut deadline: Option<Instant>) {
        let shutdown = self.shutdown.clone();
        while !self.downloads.is_empty() {
            tokio::select! {
                Some(joined) = self.downloads.join_next() => self.downloaded(joined),
                () = shutdown.cancelled(), if deadline.is_none() => {
                    self.outcome.interrupted = true;
                    deadline = Some(Instant::now() + self.config.grace);
                }
                () = sleep_until(deadline) => {
                    self.downloads.abort_all();
                    while self.downloads.join_next().await.is_some() {}
                }
            }
        }
    }

    /// Whether enough outputs wait for their download that no new call should be sent: calls
    /// that outpace downloads would pile up outputs whose URLs age, and memory, without end.
    fn downloads_backlogged(&self) -> bool {
        self.downloads.len() >= self.config.download_concurrency.max(1) * DOWNLOADS_WAITING_PER_SLOT
    }

    fn dispatch(&mut self) {
        if let Some(error) = self.shared.storage_failure() {
            let error = error.to_owned();
            self.storage_failed(error);
        }
        while self.halt.is_none()
            && self.unproven.is_none()
            && self.calls.len() < self.config.concurrency
            && !self.downloads_backlogged()
        {
            let next = if self.in_tail() {
                self.longest_ready()
            } else {
                self.admitted_ready
                    .iter()
                    .find(|t| self.may_send(**t))
                    .copied()
            };
            // A chain is admitted once its tasks are recorded (see `record_ahead`).
            let fresh = self.new_ready.first().filter(|t| {
                self.closed.is_none()
                    && self.leasing.is_none()
                    && self.may_send(*t)
                    && self.rows.is_recorded(self.graph.task(*t).instance)
            });
            // Near the end a new chain goes first when it is longer than any under way:
            // otherwise the last chains to start would end the run alone, slots idle.
            let longer = |new: usize, old: usize| self.graph.reach(new) > self.graph.reach(old);
            let t = match (next, fresh) {
                (Some(old), Some(new)) if self.in_tail() && longer(new, old) => {
                    self.admit(self.graph.task(new).instance);
                    continue;
                }
                (Some(t), _) => t,
                (None, Some(new)) => {
                    self.admit(self.graph.task(new).instance);
                    continue;
                }
                (None, None) => return,
            };
            let task = self.graph.task(t);
            if !self.budget.reserve(task.planned) {
                if self.calls.is_empty() {
                    let left = self
                        .budget
                        .cap()
                        .unwrap_or(0)
                        .saturating_sub(self.budget.spent());
                    self.halt = Some(Stop::Budget {
                        needed: task.planned,
                        left,
                    });
                }
                return;
            }
            self.admitted_ready.remove(&t);
            self.state[t] = State::Running;
            let (delay, force) = self.tries.get_mut(&t).map_or((Duration::ZERO, false), |x| {
                let once = (x.delay, x.force_refresh);
                (x.delay, x.force_refresh) = (Duration::ZERO, false);
                once
            });
            // A retry sleeping out its delay is no probe: a sibling may test the price.
            let step = task.step.0;
            self.probing[step] |= !self.confirmed[step] && delay.is_zero();
            // Admitted, so recorded: an item's tasks are recorded before any is admitted.
            let Some(row) = self.rows.ids.get(t) else {
                let name = self.name(t);
                let missing = StoreError::Inconsistent(format!("task {name} is not recorded"));
                self.fatal(Fatal::Store(Arc::new(missing)));
                return;
            };
            self.calls
                .spawn(attempt(Arc::clone(&self.shared), t, row, delay, force));
        }
    }

    /// Whether the work left is within a few rounds of the slots: from then on, the
    /// longest chain left goes first (critical path), so none ends the run alone. Before, a
    /// chain under way goes first (depth-first), so each item finishes while its URLs are
    /// fresh; that order costs no time while there is more work than slots.
    fn in_tail(&self) -> bool {
        self.unfinished <= self.config.concurrency.saturating_mul(self.depth as usize)
    }

    /// The ready task of an admitted chain with the longest chain still ahead of it; the
    /// depth-first order breaks ties.
    fn longest_ready(&self) -> Option<usize> {
        let mut best: Option<usize> = None;
        for &t in self.admitted_ready.iter().filter(|t| self.may_send(**t)) {
            if best.is_none_or(|b| self.graph.reach(t) > self.graph.reach(b)) {
                best = Some(t);
            }
        }
        best
    }

    /// Until a bill has confirmed a step's price, one call of that step at a time: a plan
    /// priced too low must not overspend by a whole round of concurrent calls.
    fn may_send(&self, t: usize) -> bool {
        let step = self.graph.task(t).step.0;
        self.confirmed[step] || !self.probing[step]
    }

    /// What is left of `instance`'s chain to pay for.
    fn chain_cost(&self, instance: Instance) -> u64 {
        self.graph
            .instance_tasks(instance)
            .filter(|t| matches!(self.state[*t], State::Waiting | State::Ready))
            .map(|t| self.graph.task(t).planned)
            .sum()
    }

    /// Halts the run when its cap leases were closed by another run that took this process
    /// for dead (frozen past the caps' silence limit): they were given back to their windows,
    /// so nothing more is sent, not even for chains already committed.
    async fn check_lease(&mut self) {
        let Some(leash) = self.config.leash.clone() else {
            return;
        };
        match leash.ensure_fresh().await {
            Ok(true) => self.halt = Some(Stop::LeaseLost),
            Ok(false) => {}
            Err(e) => self.fatal(Fatal::Store(Arc::new(e))),
        }
    }

    /// Leases from the caps what the next chain needs beyond what they leased, when a cap
    /// covers the run; closes admission when a cap's window has too little left.
    async fn lease_ahead(&mut self) {
        if self.config.leash.is_none() {
            return;
        }
        let cost = match self.leasing.take() {
            Some(cost) => cost,
            None => match self.new_ready.first() {
                Some(next) => self.chain_cost(self.graph.task(next).instance),
                None => return,
            },
        };
        self.lease_more(cost).await;
    }

    /// Leases from the caps what `cost` needs beyond what they leased; closes admission when
    /// a cap's window has too little left.
    async fn lease_more(&mut self, cost: u64) {
        let Some(leash) = self.config.leash.clone() else {
            return;
        };
        let short = cost.saturating_sub(self.budget.unleased().unwrap_or(u64::MAX));
        if short == 0 || leash.lost() {
            return;
        }
        match leash.grow(short).await {
            Ok(crate::caps::Grant::Leased(crossed)) => {
                self.budget
                    .lease(leash.leased().saturating_sub(self.lease_base));
                for crossing in &crossed {
                    self.observer.cap_crossed(crossing);
                }
            }
            Ok(crate::caps::Grant::Spent(spent)) => {
                if self.closed.is_none() {
                    self.closed = Some(Stop::Cap(spent));
                }
            }
            Err(e) => self.fatal(Fatal::Store(Arc::new(e))),
        }
    }

    /// Admits `instance` when what is left of its chain fits; else closes admission, or waits
    /// for the caps to lease what it needs.
    fn admit(&mut self, instance: Instance) {
        let tasks = self.graph.instance_tasks(instance);
        let cost = self.chain_cost(instance);
        let within_budget = self.budget.uncommitted().is_none_or(|left| cost <= left);
        if within_budget && self.budget.unleased().is_some_and(|left| left < cost) {
            self.leasing = Some(cost);
            return;
        }
        if !self.budget.admit(cost) {
            self.closed = Some(Stop::Budget {
                needed: cost,
                left: self.budget.uncommitted().unwrap_or(0),
            });
            return;
        }
        match instance {
            Instance::Batch => self.batch_admitted = true,
            Instance::Item(i) => self.admitted_items[i] = true,
        }
        let moving: Vec<usize> = self.new_ready.in_range(tasks);
        for t in moving {
            self.new_ready.remove(t);
            self.admitted_ready.insert(t);
        }
    }

    fn name(&self, t: usize) -> String {
        self.graph.key(t).to_string()
    }

    async fn settle(&mut self, attempted: Attempted) {
        let t = attempted.task;
        let planned = self.graph.task(t).planned;
        self.probing[self.graph.task(t).step.0] = false;
        match attempted.result {
            Ok(success) => self.succeeded(t, planned, success).await,
            Err(Failure::Store(e)) => {
                self.budget.ambiguous(planned);
                self.state[t] = State::Ready;
                self.fatal(Fatal::Store(Arc::new(e)));
            }
            Err(Failure::Cancelled) => {
                self.budget.release(planned);
                self.put_back(t).await;
            }
            Err(Failure::Input(reason)) => {
                self.budget.release(planned);
                self.retry_or_fail(t, None, &reason).await;
            }
            Err(Failure::Status(reason)) => {
                let committed = self.budget.ambiguous(planned);
                self.fail(t, &reason, committed).await;
            }
            Err(Failure::Api(e)) => self.api_failure(t, planned, e).await,
        }
    }

    async fn succeeded(&mut self, t: usize, planned: u64, success: Success) {
        self.budget.settle(planned, success.credits);
        self.observer.call_billed(
            self.graph.task(t).step.0,
            &self.name(t),
            planned,
            success.credits,
        );
        if success.credits <= planned {
            self.confirmed[self.graph.task(t).step.0] = true;
        }
        if success.credits_remaining.is_some() {
            self.outcome.last_balance = success.credits_remaining;
        }
        if success.credits > planned && self.halt.is_none() && self.config.only.is_none() {
            self.halt = Some(Stop::PriceAbovePlan {
                task: self.name(t),
                planned,
                billed: success.credits,
            });
        }
        let expected = self.graph.outputs(t);
        let got = success.outputs.len() as u32;
        for (k, out) in success.outputs.into_iter().enumerate() {
            self.shared.set_url(t, k as u32, out);
            self.spawn_download(t, k as u32);
        }
        let step = self.graph.task(t).step.0;
        if got < expected {
            let reason = format!(
                "job {} returned {got} image(s) where {expected} were asked for",
                success.job_id
            );
            // The bill settled the task's commitment: nothing is left to free.
            self.fail(t, &reason, false).await;
            return;
        }
        self.state[t] = State::Done;
        crate::failpoint::hit("exec-task-succeeded");
        self.tries.remove(&t);
        self.succeeded.push(t);
        self.unfinished = self.unfinished.saturating_sub(1);
        self.observer.task_succeeded(step, success.credits);
        self.release_inputs(t);
        for c in self.graph.children(t) {
            if self.inputs_made(c) {
                self.push_ready(c);
            }
        }
    }

    async fn api_failure(&mut self, t: usize, planned: u64, e: ApiError) {
        let reason = self.shared.client.redact(&e.to_string());
        let Some(kind) = e.kind() else {
            if let ApiError::Ambiguous {
                job_id: Some(id), ..
            } = &e
            {
                // The job exists but could not be read yet: paying again would buy it twice.
                let committed = self.budget.ambiguous(planned);
                let reason = format!(
                    "{reason} (not called again: the job exists; `imgpipe job {id} --out DIR` fetches it)"
                );
                return self.fail(t, &reason, committed).await;
            }
            if matches!(e, ApiError::Ambiguous { .. }) {
                return self.ambiguous(t, planned, &reason).await;
            }
            self.budget.release(planned);
            return match e {
                ApiError::NotSent { .. } => self.retry_or_fail(t, None, &reason).await,
                _ => self.fail(t, &reason, true).await,
            };
        };
        self.budget.release(planned);
        match kind {
            ErrorKind::RateLimited => {
                self.shared.limiter.throttled(e.retry_after());
                self.tries.entry(t).or_default().throttled += 1;
                if self.tries.entry(t).or_default().throttled <= MAX_THROTTLED {
                    self.requeue(t, Duration::ZERO, false);
                } else {
                    self.fail(t, &reason, true).await;
                }
            }
            ErrorKind::Server => self.retry_or_fail(t, e.retry_after(), &reason).await,
            ErrorKind::Credits => {
                self.put_back(t).await;
                self.halt.get_or_insert(Stop::Balance(reason));
            }
            ErrorKind::Auth => {
                self.put_back(t).await;
                self.fatal(Fatal::Refused(reason));
            }
            ErrorKind::InvalidRequest
                if self.reads_outputs(t) && !self.tries.entry(t).or_default().refreshed =>
            {
                // An upstream URL may have expired on the way: nothing was billed, so try
                // once more with fresh ones.
                self.tries.entry(t).or_default().refreshed = true;
                self.requeue(t, Duration::ZERO, true);
            }
            _ => self.fail(t, &reason, true).await,
        }
    }

    async fn ambiguous(&mut self, t: usize, planned: u64, reason: &str) {
        // The call counts as spent and a retry pays again: the caps lease it first.
        self.lease_more(planned).await;
        let fits = self.budget.ambiguous(planned);
        self.tries.entry(t).or_default().ambiguous += 1;
        let why = if self.config.on_ambiguous == OnAmbiguous::Fail {
            "--on-ambiguous fail"
        } else if !fits && self.config.leash.is_some() {
            "another try would not fit the budget or the spending caps"
        } else if !fits {
            "another try would not fit the budget"
        } else if !self
            .shared
            .paid_retry
            .allows(self.tries.entry(t).or_default().ambiguous)
        {
            "too many tries"
        } else {
            tracing::warn!("{}: {reason}; trying again", self.name(t));
            let delay = self
                .shared
                .paid_retry
                .backoff(self.tries.entry(t).or_default().ambiguous);
            return self.requeue(t, delay, false);
        };
        self.fail(t, &format!("{reason} (not tried again: {why})"), fits)
            .await;
    }

    async fn retry_or_fail(&mut self, t: usize, after: Option<Duration>, reason: &str) {
        self.tries.entry(t).or_default().retries += 1;
        let n = self.tries.entry(t).or_default().retries;
        if !self.shared.paid_retry.allows(n) {
            return self
                .fail(t, &format!("{reason} (after {} tries)", n), true)
                .await;
        }
        tracing::debug!("{}: {reason}; retry {n}", self.name(t));
        let delay = self.shared.paid_retry.delay(n, after);
        self.requeue(t, delay, false);
    }

    fn reads_outputs(&self, t: usize) -> bool {
        self.graph.reads_outputs(t)
    }

    fn requeue(&mut self, t: usize, delay: Duration, force_refresh: bool) {
        self.tries.entry(t).or_default().delay = delay;
        self.tries.entry(t).or_default().force_refresh |= force_refresh;
        self.push_ready(t);
    }

    /// A task that could not be tried, back to pending for a later run.
    async fn put_back(&mut self, t: usize) {
        self.state[t] = State::Ready;
        let ids: Vec<i64> = self.rows.ids.get(t).into_iter().collect();
        if let Err(e) = self
            .shared
            .store
            .tasks()
            .set_status(&ids, TaskStatus::Pending, None)
            .await
        {
            self.fatal(Fatal::Store(Arc::new(e)));
        }
    }

    /// Fails `t` and blocks everything that reads it; the rest of the batch goes on.
    /// `committed`: whether the task still holds a commitment to free (not when its price was
    /// spent, or possibly spent, with no retry left to pay for).
    async fn fail(&mut self, t: usize, reason: &str, committed: bool) {
        self.state[t] = State::Failed;
        self.tries.remove(&t);
        self.unfinished = self.unfinished.saturating_sub(1);
        let task = self.graph.task(t);
        if committed {
            self.budget.abandon(task.planned);
        }
        let name = self.name(t);
        let item = self.graph.item_dir(task.instance);
        self.observer.task_failed(task.step.0, &item, reason);
        self.outcome
            .failures
            .push((name.clone(), reason.to_owned()));
        let mut blocked = Vec::new();
        for d in self.graph.descendants(t) {
            if matches!(self.state[d], State::Waiting | State::Ready) {
                self.admitted_ready.remove(&d);
                self.new_ready.remove(d);
                self.state[d] = State::Blocked;
                self.unfinished = self.unfinished.saturating_sub(1);
                let below = self.graph.task(d);
                // An admitted chain's cost is committed; another's is counted at admission.
                if self.is_admitted(below.instance) {
                    self.budget.abandon(below.planned);
                }
                // A task not recorded yet is recorded pending, and blocked again on resume.
                blocked.extend(self.rows.ids.get(d));
            }
        }
        self.release_inputs(t);
        self.release(t);
        let store = &self.shared.store;
        let recorded = match store
            .tasks()
            .set_status(
                &self.rows.ids.get(t).into_iter().collect::<Vec<_>>(),
                TaskStatus::Failed,
                Some(reason),
            )
            .await
        {
            Ok(()) => {
                let why = format!("its input {name} failed");
                store
                    .tasks()
                    .set_status(&blocked, TaskStatus::Blocked, Some(&why))
                    .await
            }
            Err(e) => Err(e),
        };
        if let Err(e) = recorded {
            self.fatal(Fatal::Store(Arc::new(e)));
        }
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

    fn downloaded(&mut self, joined: Result<Fetched, tokio::task::JoinError>) {
        let fetched = match joined {
            Ok(fetched) => fetched,
            Err(e) => {
                return self.fatal(Fatal::Crashed(format!(
                    "a download's task ended abnormally: {e}"
                )));
            }
        };
        let Fetched { task: t, k, result } = fetched;
        let name = |s: &Self| format!("{} output {k}", s.name(t));
        match result {
            Ok(_) => self.unproven = None,
            // Recorded with the output; the summary reads it from there.
            Err(Unfetched::Output(reason)) => {
                tracing::error!("download of {} failed: {reason}", name(self));
            }
            Err(Unfetched::Storage(reason)) => {
                tracing::error!("download of {} failed: {reason}", name(self));
                self.storage_failed(reason);
            }
            Err(Unfetched::NotTried) => {
                tracing::debug!("{} is left for the next resume to fetch", name(self));
            }
            Err(Unfetched::Store(e)) => self.fatal(Fatal::Store(Arc::new(e))),
        }
        if let Some(n) = &mut self.unproven {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.unproven = None;
            }
        }
        if let Some(n) = self.downloading.get_mut(&t) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.downloading.remove(&t);
                self.release(t);
            }
        }
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

/// Where an earlier output's URL is, as recorded.
fn url_of(o: RecordedOutput) -> OutputUrl {
    OutputUrl {
        output_id: o.id,
        job_id: o.job_id,
        url: o.url,
        issued_ms: o.url_issued_at,
    }
}

/// The outputs a resume's check found to fetch again, once it ends; never, without one.
async fn checked(
    refetch: &mut Option<Refetch>,
) -> Result<Result<Vec<RecordedOutput>, Arc<StoreError>>, RecvError> {
    match refetch {
        Some(rx) => rx.await,
        None => std::future::pending().await,
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
