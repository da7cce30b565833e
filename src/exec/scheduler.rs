//! The scheduler: decides what runs next and what a finished attempt means.
//!
//! A task is ready when every task it reads has succeeded. Ready tasks of chains already under
//! way go first (depth-first), so each item finishes promptly and its downstream calls use
//! upstream URLs well inside their lifetime; a new chain is admitted only when its whole
//! remaining cost fits the budget.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::api::{ApiError, Client, Downloader, ErrorKind};
use crate::exec::attempt::{Attempted, Failure, Success, attempt};
use crate::exec::budget::Budget;
use crate::exec::download::{Fetched, download};
use crate::exec::shared::{OutputUrl, Shared};
use crate::exec::{Config, Fatal, Observer, OnAmbiguous, Outcome, Stop};
use crate::plan::graph::{Graph, Instance, Source};
use crate::store::{Store, StoreError, TaskStatus};

/// 429s one task may meet before it fails: the limiter slows down long before this.
const MAX_THROTTLED: u32 = 30;

/// Ready-queue order: instance (the batch first, then items in file order), step, index.
type Key = (Instance, usize, u32, usize);

/// Graph index of a task by its recorded identity: item directory, step id, index, borrowed
/// from the graph.
type TaskIndex<'g> = HashMap<(&'g str, &'g str, u32), usize>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Waiting,
    Ready,
    Running,
    Done,
    Failed,
    Blocked,
}

#[derive(Default, Clone, Copy)]
struct Tries {
    retries: u32,
    throttled: u32,
    ambiguous: u32,
    refreshed: bool,
    delay: Duration,
    force_refresh: bool,
}

struct Scheduler {
    shared: Arc<Shared>,
    graph: Arc<Graph>,
    config: Config,
    observer: Arc<dyn Observer>,
    state: Vec<State>,
    waiting: Vec<usize>,
    tries: Vec<Tries>,
    admitted_ready: BTreeSet<Key>,
    new_ready: BTreeSet<Key>,
    admitted: HashSet<Instance>,
    instance_cost: HashMap<Instance, u64>,
    /// By step: whether a bill confirmed its planned price, and whether a call is testing it.
    confirmed: Vec<bool>,
    probing: Vec<bool>,
    /// By task: the longest chain of calls from it to the end of its item, itself included.
    reach: Vec<u32>,
    /// The longest `reach` of all.
    depth: u32,
    /// Tasks still to run (not done, failed or blocked).
    unfinished: usize,
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
}

/// Runs every unfinished task of the run recorded in `store` until done, stopped or
/// interrupted by `shutdown`.
pub async fn run(
    graph: Arc<Graph>,
    store: Store,
    client: Client,
    downloader: Downloader,
    config: Config,
    observer: Arc<dyn Observer>,
    shutdown: CancellationToken,
) -> Result<Outcome, StoreError> {
    store.settle_orphaned_attempts(&config.run_id).await?;
    let keys = Arc::clone(&graph);
    let index: TaskIndex<'_> = (0..keys.tasks.len())
        .map(|t| (keys.key_ref(t), t))
        .collect();
    let mut row_ids = vec![0i64; graph.tasks.len()];
    let mut prior = vec![Prior::Todo; graph.tasks.len()];
    // Rows stream: a large run's rows are looked up one at a time, never all held at once.
    store
        .each_task(&config.run_id, None, |row| {
            let Some(&t) = index.get(&(row.item.as_str(), row.step.as_str(), row.idx)) else {
                return;
            };
            row_ids[t] = row.id;
            prior[t] = match row.status {
                TaskStatus::Succeeded => Prior::Done,
                // Possibly billed already, and the user asked not to pay twice.
                TaskStatus::Failed
                    if config.on_ambiguous == OnAmbiguous::Fail
                        && row
                            .last_attempt
                            .as_ref()
                            .is_some_and(|a| a.possibly_billed()) =>
                {
                    Prior::Failed
                }
                _ => Prior::Todo,
            };
        })
        .await?;
    if let Some(t) = row_ids.iter().position(|id| *id == 0) {
        return Err(StoreError::Inconsistent(format!(
            "task {}/{} is not recorded for run {}",
            graph.item_dir(graph.tasks[t].instance),
            graph.step_id(t),
            config.run_id
        )));
    }
    let (outcome_graph, outcome_ids, run_id) =
        (Arc::clone(&graph), row_ids.clone(), config.run_id.clone());
    let shared = Arc::new(Shared::new(
        client,
        downloader,
        store.clone(),
        Arc::clone(&graph),
        row_ids,
        &config,
    ));
    let mut s = Scheduler::new(shared, graph, config, observer, &prior, shutdown);
    s.restore_outputs(&index).await?;
    // Setup only: a large run should not carry every row's strings to the end.
    drop(index);
    s.main_loop().await;
    let outcome = s.finish().await;
    record_identities(&store, &outcome_graph, &outcome_ids, &run_id).await?;
    Ok(outcome)
}

/// What an earlier process settled about a task.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Prior {
    Todo,
    Done,
    /// Failed for good: left failed, its descendants blocked.
    Failed,
}

/// Records the identity of every succeeded task whose inputs' bytes are now known, so later
/// runs and changed pipelines can tell the same work from new work.
async fn record_identities(
    store: &Store,
    graph: &Graph,
    row_ids: &[i64],
    run_id: &str,
) -> Result<(), StoreError> {
    let hashes = store.output_hashes(run_id).await?;
    let rows = store
        .tasks_where(run_id, Some(TaskStatus::Succeeded))
        .await?;
    let missing: HashSet<i64> = rows
        .iter()
        .filter(|r| r.identity.is_none())
        .map(|r| r.id)
        .collect();
    let found: Vec<(i64, String)> = (0..graph.tasks.len())
        .filter(|t| missing.contains(&row_ids[*t]))
        .filter_map(|t| {
            let id = crate::exec::identity::from_record(graph, t, |u| Some(row_ids[u]), &hashes)?;
            Some((row_ids[t], id))
        })
        .collect();
    store.set_identities(&found).await
}

impl Scheduler {
    fn new(
        shared: Arc<Shared>,
        graph: Arc<Graph>,
        config: Config,
        observer: Arc<dyn Observer>,
        prior: &[Prior],
        shutdown: CancellationToken,
    ) -> Scheduler {
        let n = graph.tasks.len();
        let mut s = Scheduler {
            state: vec![State::Waiting; n],
            waiting: vec![0; n],
            tries: vec![Tries::default(); n],
            admitted_ready: BTreeSet::new(),
            new_ready: BTreeSet::new(),
            admitted: HashSet::new(),
            instance_cost: HashMap::new(),
            confirmed: (0..graph.step_ids.len())
                .map(|s| config.known_prices.get(s).copied().unwrap_or(false))
                .collect(),
            probing: vec![false; graph.step_ids.len()],
            reach: reach(&graph),
            depth: 0,
            unfinished: 0,
            budget: Budget::new(config.cap),
            calls: JoinSet::new(),
            downloads: JoinSet::new(),
            halt: None,
            closed: None,
            outcome: Outcome::default(),
            shutdown,
            shared,
            graph,
            config,
            observer,
        };
        for (t, p) in prior.iter().enumerate() {
            if *p == Prior::Failed {
                s.state[t] = State::Failed;
                for d in s.graph.descendants(t) {
                    s.state[d] = State::Blocked;
                }
            }
        }
        for t in 0..n {
            let task = &s.graph.tasks[t];
            if prior[t] == Prior::Done {
                s.state[t] = State::Done;
                continue;
            }
            if s.state[t] != State::Waiting {
                continue;
            }
            *s.instance_cost.entry(task.instance).or_default() += task.planned;
            s.waiting[t] = task
                .deps
                .iter()
                .filter(|d| prior[**d] != Prior::Done)
                .count();
        }
        for t in 0..n {
            if s.state[t] == State::Waiting && s.waiting[t] == 0 {
                s.push_ready(t);
            }
        }
        s.unfinished = s
            .state
            .iter()
            .filter(|st| matches!(st, State::Waiting | State::Ready))
            .count();
        s.depth = s.reach.iter().copied().max().unwrap_or(0);
        s
    }

    /// Loads the outputs of tasks that succeeded earlier, and downloads those not on disk.
    async fn restore_outputs(&mut self, index: &TaskIndex<'_>) -> Result<(), StoreError> {
        let store = self.shared.store.clone();
        store
            .each_output(&self.config.run_id, false, |o| {
                let Some(&t) = index.get(&(o.item.as_str(), o.step.as_str(), o.idx)) else {
                    return Ok(());
                };
                let missing = o.path.is_none();
                self.shared.set_url(
                    t,
                    o.k,
                    OutputUrl {
                        output_id: o.id,
                        job_id: o.job_id,
                        url: o.url,
                        issued_ms: o.url_issued_at,
                    },
                );
                if missing {
                    self.downloads
                        .spawn(download(Arc::clone(&self.shared), t, o.k));
                }
                Ok(())
            })
            .await
    }

    fn key(&self, t: usize) -> Key {
        let task = &self.graph.tasks[t];
        (task.instance, task.step.0, task.idx, t)
    }

    fn push_ready(&mut self, t: usize) {
        if self.config.only.is_some_and(|only| only != t) {
            return;
        }
        self.state[t] = State::Ready;
        let key = self.key(t);
        if self.admitted.contains(&key.0) {
            self.admitted_ready.insert(key);
        } else {
            self.new_ready.insert(key);
        }
    }

    async fn main_loop(&mut self) {
        let shutdown = self.shutdown.clone();
        let mut deadline: Option<Instant> = None;
        loop {
            if deadline.is_none() {
                self.dispatch();
            }
            if self.halt.is_some() {
                self.shared.stop();
            }
            if self.calls.is_empty() {
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

    fn dispatch(&mut self) {
        while self.halt.is_none() && self.calls.len() < self.config.concurrency {
            let next = if self.in_tail() {
                self.longest_ready()
            } else {
                self.admitted_ready
                    .iter()
                    .find(|k| self.may_send(k.3))
                    .copied()
            };
            let fresh = self
                .new_ready
                .first()
                .copied()
                .filter(|k| self.closed.is_none() && self.may_send(k.3));
            // Near the end a new chain goes first when it is longer than any under way:
            // otherwise the last chains to start would end the run alone, slots idle.
            let longer = |new: &Key, old: &Key| self.reach[new.3] > self.reach[old.3];
            let key = match (next, fresh) {
                (Some(old), Some(new)) if self.in_tail() && longer(&new, &old) => {
                    self.admit(new.0);
                    continue;
                }
                (Some(key), _) => key,
                (None, Some(new)) => {
                    self.admit(new.0);
                    continue;
                }
                (None, None) => return,
            };
            let t = key.3;
            let planned = self.graph.tasks[t].planned;
            if !self.budget.reserve(planned) {
                if self.calls.is_empty() {
                    let left = self
                        .budget
                        .cap()
                        .unwrap_or(0)
                        .saturating_sub(self.budget.spent());
                    self.halt = Some(Stop::Budget {
                        needed: planned,
                        left,
                    });
                }
                return;
            }
            self.admitted_ready.remove(&key);
            self.state[t] = State::Running;
            let (delay, force) = (self.tries[t].delay, self.tries[t].force_refresh);
            // A retry sleeping out its delay is no probe: a sibling may test the price.
            let step = self.graph.tasks[t].step.0;
            self.probing[step] |= !self.confirmed[step] && delay.is_zero();
            self.tries[t].delay = Duration::ZERO;
            self.tries[t].force_refresh = false;
            self.calls
                .spawn(attempt(Arc::clone(&self.shared), t, delay, force));
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
    fn longest_ready(&self) -> Option<Key> {
        let mut best: Option<Key> = None;
        for k in self.admitted_ready.iter().filter(|k| self.may_send(k.3)) {
            if best.is_none_or(|b| self.reach[k.3] > self.reach[b.3]) {
                best = Some(*k);
            }
        }
        best
    }

    /// Until a bill has confirmed a step's price, one call of that step at a time: a plan
    /// priced too low must not overspend by a whole round of concurrent calls.
    fn may_send(&self, t: usize) -> bool {
        let step = self.graph.tasks[t].step.0;
        self.confirmed[step] || !self.probing[step]
    }

    /// Admits `instance` when its remaining chain fits; else closes admission.
    fn admit(&mut self, instance: Instance) {
        let cost = self.instance_cost.get(&instance).copied().unwrap_or(0);
        if !self.budget.admit(cost) {
            self.closed = Some(Stop::Budget {
                needed: cost,
                left: self.budget.uncommitted().unwrap_or(0),
            });
            return;
        }
        self.admitted.insert(instance);
        let lo = (instance, 0, 0, 0);
        let hi = (instance, usize::MAX, u32::MAX, usize::MAX);
        let moving: Vec<Key> = self.new_ready.range(lo..=hi).copied().collect();
        for key in moving {
            self.new_ready.remove(&key);
            self.admitted_ready.insert(key);
        }
    }

    fn name(&self, t: usize) -> String {
        let task = &self.graph.tasks[t];
        format!(
            "{}/{}[{}]",
            self.graph.item_dir(task.instance),
            self.graph.step_id(t),
            task.idx
        )
    }

    async fn settle(&mut self, attempted: Attempted) {
        let t = attempted.task;
        let planned = self.graph.tasks[t].planned;
        self.probing[self.graph.tasks[t].step.0] = false;
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
        if success.credits <= planned {
            self.confirmed[self.graph.tasks[t].step.0] = true;
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
        let expected = self.graph.tasks[t].outputs();
        let got = success.outputs.len() as u32;
        for (k, out) in success.outputs.into_iter().enumerate() {
            self.shared.set_url(t, k as u32, out);
            self.downloads
                .spawn(download(Arc::clone(&self.shared), t, k as u32));
        }
        let step = self.graph.tasks[t].step.0;
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
        self.unfinished = self.unfinished.saturating_sub(1);
        self.observer.task_succeeded(step, success.credits);
        let children = self.graph.tasks[t].children.clone();
        for c in children {
            self.waiting[c] = self.waiting[c].saturating_sub(1);
            if self.waiting[c] == 0 && self.state[c] == State::Waiting {
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
                self.tries[t].throttled += 1;
                if self.tries[t].throttled <= MAX_THROTTLED {
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
            ErrorKind::InvalidRequest if self.reads_outputs(t) && !self.tries[t].refreshed => {
                // An upstream URL may have expired on the way: nothing was billed, so try
                // once more with fresh ones.
                self.tries[t].refreshed = true;
                self.requeue(t, Duration::ZERO, true);
            }
            _ => self.fail(t, &reason, true).await,
        }
    }

    async fn ambiguous(&mut self, t: usize, planned: u64, reason: &str) {
        let fits = self.budget.ambiguous(planned);
        self.tries[t].ambiguous += 1;
        let why = if self.config.on_ambiguous == OnAmbiguous::Fail {
            "--on-ambiguous fail"
        } else if !fits {
            "another try would not fit the budget"
        } else if !self.shared.paid_retry.allows(self.tries[t].ambiguous) {
            "too many tries"
        } else {
            tracing::warn!("{}: {reason}; trying again", self.name(t));
            let delay = self.shared.paid_retry.backoff(self.tries[t].ambiguous);
            return self.requeue(t, delay, false);
        };
        self.fail(t, &format!("{reason} (not tried again: {why})"), fits)
            .await;
    }

    async fn retry_or_fail(&mut self, t: usize, after: Option<Duration>, reason: &str) {
        self.tries[t].retries += 1;
        let n = self.tries[t].retries;
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
        self.graph.tasks[t]
            .sources()
            .iter()
            .any(|s| matches!(s, Source::Output { .. }))
    }

    fn requeue(&mut self, t: usize, delay: Duration, force_refresh: bool) {
        self.tries[t].delay = delay;
        self.tries[t].force_refresh |= force_refresh;
        self.push_ready(t);
    }

    /// A task that could not be tried, back to pending for a later run.
    async fn put_back(&mut self, t: usize) {
        self.state[t] = State::Ready;
        let id = self.shared.row_ids[t];
        if let Err(e) = self
            .shared
            .store
            .set_task_status(&[id], TaskStatus::Pending, None)
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
        self.unfinished = self.unfinished.saturating_sub(1);
        if committed {
            self.budget.abandon(self.graph.tasks[t].planned);
        }
        let name = self.name(t);
        let step = self.graph.tasks[t].step.0;
        let item = self.graph.item_dir(self.graph.tasks[t].instance).to_owned();
        self.observer.task_failed(step, &item, reason);
        self.outcome
            .failures
            .push((name.clone(), reason.to_owned()));
        let mut blocked = Vec::new();
        for d in self.graph.descendants(t) {
            if matches!(self.state[d], State::Waiting | State::Ready) {
                let key = self.key(d);
                self.admitted_ready.remove(&key);
                self.new_ready.remove(&key);
                self.state[d] = State::Blocked;
                self.unfinished = self.unfinished.saturating_sub(1);
                let (instance, planned) =
                    (self.graph.tasks[d].instance, self.graph.tasks[d].planned);
                if self.admitted.contains(&instance) {
                    self.budget.abandon(planned);
                } else if let Some(cost) = self.instance_cost.get_mut(&instance) {
                    *cost = cost.saturating_sub(planned);
                }
                blocked.push(self.shared.row_ids[d]);
            }
        }
        let store = &self.shared.store;
        let recorded = match store
            .set_task_status(&[self.shared.row_ids[t]], TaskStatus::Failed, Some(reason))
            .await
        {
            Ok(()) => {
                let why = format!("its input {name} failed");
                store
                    .set_task_status(&blocked, TaskStatus::Blocked, Some(&why))
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

    fn downloaded(&mut self, joined: Result<Fetched, tokio::task::JoinError>) {
        match joined {
            Ok(Fetched { result: Ok(_), .. }) => {}
            Ok(Fetched {
                task,
                k,
                result: Err(reason),
            }) => {
                let name = format!("{} output {k}", self.name(task));
                // Recorded with the output; the summary reads it from there.
                tracing::error!("download of {name} failed: {reason}");
            }
            Err(e) => self.fatal(Fatal::Crashed(format!(
                "a download's task ended abnormally: {e}"
            ))),
        }
    }

    async fn finish(mut self) -> Outcome {
        if self.outcome.interrupted
            && let Err(e) = self
                .shared
                .store
                .settle_orphaned_attempts(&self.config.run_id)
                .await
        {
            self.fatal(Fatal::Store(Arc::new(e)));
        }
        self.outcome.stop = self.halt.take().or(self.closed.take());
        self.outcome
    }
}

/// Each task's longest chain of calls to the end of its item, itself included. A task's
/// readers always come after it in the graph, so one pass from the end sees them first.
fn reach(graph: &Graph) -> Vec<u32> {
    let mut reach = vec![1u32; graph.tasks.len()];
    for t in (0..graph.tasks.len()).rev() {
        let longest = graph.tasks[t]
            .children
            .iter()
            .map(|c| reach[*c])
            .max()
            .unwrap_or(0);
        reach[t] = longest + 1;
    }
    reach
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::reach;
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
        let reach = reach(&g);
        let of = |step: &str| -> Vec<u32> {
            (0..g.tasks.len())
                .filter(|t| g.step_id(*t) == step)
                .map(|t| reach[t])
                .collect()
        };
        assert_eq!(of("style"), [4]);
        assert_eq!(of("shot"), [3, 3]);
        assert_eq!(of("clean"), [2, 2, 2, 2]);
        assert_eq!(of("big"), [1, 1, 1, 1]);
    }
}
