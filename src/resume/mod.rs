//! Resuming a run, in one place: what a resume keeps, reads back, fetches again and pays for
//! again, and why; then making the record and the run's files agree with that before the
//! scheduler starts.
//!
//! Continuing a run (`imgpipe resume`, `imgpipe reroll`, `imgpipe run --run-id` of a run that
//! exists) is two stages and a hand-off, in the order [`continuation`] owns. The runner calls
//! it once it holds the run's lock and has made a plan now, and does its own part (the view,
//! the spending recorded, the execution) through the hooks of its `Lifecycle`:
//! 1. [`prepare()`] → [`Prepared`]: the graph priced, the review, a changed pipeline refused
//!    unless allowed, a reroll's targets chosen; [`Prepared::admit`] refuses what costs more
//!    than may be spent. Nothing is written: a dry run stops here, and shows it. A resume
//!    over its limit first reads lost answers back ([`Prepared::read_back`], free) and is
//!    prepared again: a task read back is no longer to pay for, and the rest may then fit.
//!    Then the gate: what a confirm agreed to must be what this pays for now.
//! 2. [`Prepared::apply`] → [`Applied`]: the run reopened, the review applied, the kept
//!    outputs' check started beside the run, the run's record of its source and plan brought
//!    up to date.
//! 3. the hand-off: [`Applied`] is what the executor is given; [`After::finish`] records a
//!    reroll done once the executor is. Every refusal is a [`Refusal`], its words in
//!    [`refusal`].
//!
//! The parts they are made of:
//! - [`decide`]: the pure core. The run's records in, a [`Review`] out; no I/O.
//! - [`records`]: reads what the core needs from the state database, in batches.
//! - [`check`]: the kept outputs' files or objects compared with the record (what to fetch
//!   again, what was modified and is set aside), streamed from the database in pages; the
//!   objects by listing the run's prefix ([`objects`]). A dry run shows what it finds
//!   ([`check()`]); a resume runs it beside the run ([`beside`]), whose first paid call waits
//!   for no look at a night's files.
//! - [`apply`]: the review applied: every state write in one transaction, every file or
//!   object move journaled in it, so a process killed anywhere inside resumes correctly.
//! - [`recover`]: lost answers read back by their job id, for free.
//! - [`changes`]: what a changed pipeline would run again, in a sentence.
//!
//! [`review`] and [`check()`] only read, so `resume --dry-run` shows them; [`apply()`] and
//! [`beside`] change things.
//! The lifecycle around them (the lock, the plan, the execution) is the runner's; their order
//! is [`continuation`]'s.

mod apply;
mod changes;
mod check;
mod continuation;
pub mod decide;
mod handoff;
mod objects;
mod prepare;
mod records;
mod recover;
pub mod refusal;
mod reroll;

use crate::api::job_id::JobId;
use crate::exec::OnAmbiguous;
use crate::place::RunDir;
use crate::plan::graph::{Graph, Instance};
use crate::plan::rows::RowIds;
use crate::plan::scope::Scope;
use crate::run_id::RunId;
use crate::store::{AttemptId, RecordedOutput, RecordedTask, Reusable, Store, StoreError, TaskId};

pub use apply::{Tally, apply, undo_reroll};
pub(crate) use continuation::{Lifecycle, continue_locked};
use decide::{Decision, Lookups, Options};
pub use handoff::{After, Applied};
pub use prepare::{Choices, Given, Prepared, changed, finished, prepare};
pub use refusal::Refusal;
pub use reroll::Target;

/// Why a run cannot be continued: a refusal, or the database or the pipeline failing.
#[derive(Debug, thiserror::Error)]
pub enum ResumeError {
    #[error("{}", .0.message())]
    Refused(Refusal),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Graph(#[from] crate::plan::graph::GraphError),
}

impl From<Refusal> for ResumeError {
    fn from(refusal: Refusal) -> Self {
        ResumeError::Refused(refusal)
    }
}

/// Why a task will be paid for (again).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// Its last call failed.
    Failed,
    /// `--allow-changes`: the pipeline now asks something else of it, or it is new.
    Changed,
    /// Its last call was sent without a complete answer: it may have been billed already.
    Ambiguous,
    /// No call of it was ever answered.
    NeverStarted,
    /// An input failed, so it never ran.
    Blocked,
    /// `imgpipe reroll`: it, or a task upstream of it, was chosen to be paid for again.
    Rerolled,
}

impl Reason {
    /// Every reason, for the tests that hold [`Reason::key`] to serde's names.
    #[cfg(test)]
    pub const ALL: [Reason; 6] = [
        Reason::Failed,
        Reason::Changed,
        Reason::Ambiguous,
        Reason::NeverStarted,
        Reason::Blocked,
        Reason::Rerolled,
    ];

    /// The reason as JSON names it, the same in a task's `reason` and as a key of `by_reason`.
    pub fn key(self) -> &'static str {
        match self {
            Reason::NeverStarted => "never_started",
            other => other.as_str(),
        }
    }

    /// The reason as a sentence says it.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Failed => "failed",
            Reason::Changed => "changed",
            Reason::Ambiguous => "ambiguous",
            Reason::NeverStarted => "never started",
            Reason::Blocked => "blocked",
            Reason::Rerolled => "rerolled",
        }
    }
}

/// A task the resumed run will call.
#[derive(Clone, Debug)]
pub struct Redo {
    pub task: usize,
    pub reason: Reason,
    pub credits: u64,
    /// The recorded error, when there is one.
    pub detail: Option<String>,
}

impl Redo {
    /// Why a task left failed is not paid for again.
    pub fn left_because(&self) -> &'static str {
        match self.reason {
            Reason::Failed => "a check failed it",
            _ => "--on-ambiguous fail",
        }
    }
}

/// An output of a kept task whose file is to be fetched again from its job.
#[derive(Clone, Debug)]
pub struct Refetch {
    pub output: RecordedOutput,
    /// The file's actual sha256 when it is there but differs from the record.
    pub modified: Option<crate::sha256::Sha256Sum>,
}

/// The answer of a lost call whose job is known: read it back, free, before paying again.
#[derive(Clone, Debug)]
pub struct Recover {
    pub task: usize,
    pub attempt_id: AttemptId,
    pub job_id: JobId,
}

#[derive(Default)]
pub struct Review {
    /// Recorded tasks to pay for, and under `--reuse` every task without a reusable result.
    pub redo: Vec<Redo>,
    /// Items the run never recorded (it records an item's tasks as it comes near them): all
    /// their tasks are to pay for, and are counted rather than listed.
    pub unrecorded: Unrecorded,
    /// Tasks left failed: ambiguous ones per `--on-ambiguous fail`, and those a check failed.
    pub left_failed: Vec<Redo>,
    pub recover: Vec<Recover>,
    /// Filled by [`check()`] for a dry run; a resume checks beside the run ([`beside`]).
    pub refetch: Vec<Refetch>,
    /// Tasks taken from an earlier run's succeeded task of the same identity (`--reuse`).
    pub reuse: Vec<(usize, String, Reusable)>,
    /// Recorded tasks the (changed) pipeline no longer has.
    pub removed: Vec<RecordedTask>,
    /// Whether the pipeline changed since the tasks were recorded (`--allow-changes`).
    pub changes: bool,
    /// Tasks kept as they are (succeeded), by row id, sorted.
    pub kept: Vec<TaskId>,
    /// The row id of each task, as the review read them, for [`apply()`]; `None` when the run
    /// had no row yet (a new run, which records some before it applies the review).
    pub rows: Option<RowIds>,
    /// A reroll, recorded when the review is applied ([`Review::reroll`]).
    pub reroll: Option<crate::store::NewReroll>,
}

/// The tasks of items with no recorded task.
#[derive(Default)]
pub struct Unrecorded {
    pub instances: Vec<Instance>,
    /// Of their tasks, those asked for now: all of them but under `--until`.
    pub scope: Scope,
    pub tasks: usize,
    pub credits: u64,
}

impl Review {
    /// Tasks to pay for.
    pub fn to_pay(&self) -> usize {
        self.redo.len() + self.unrecorded.tasks
    }

    /// Feeds `digest` what this review pays for, for the revision a confirm is bound to.
    /// The caller has fed it the plan's revision (pipeline, items, prices, part asked), which
    /// fixes the graph: a task is then its number, and an item never recorded its index
    /// (its tasks are the graph's). A night's takeover prices 900,000 unrecorded tasks: their
    /// items are 100,000 numbers, not 900,000 keys formatted.
    pub fn digest(&self, mut digest: crate::money::gate::Builder) -> crate::money::gate::Builder {
        digest = digest.number(self.redo.len() as u64);
        for r in &self.redo {
            digest = digest
                .number(r.task as u64)
                .part(r.reason.as_str())
                .number(r.credits);
        }
        digest = digest.number(self.unrecorded.instances.len() as u64);
        for i in &self.unrecorded.instances {
            digest = digest.number(match i {
                Instance::Batch => u64::MAX,
                Instance::Item(i) => *i as u64,
            });
        }
        digest
            .number(self.unrecorded.tasks as u64)
            .number(self.unrecorded.credits)
    }

    pub fn credits(&self) -> u64 {
        self.redo.iter().map(|r| r.credits).sum::<u64>() + self.unrecorded.credits
    }

    /// Every task to pay for: the recorded ones, then those of unrecorded items.
    pub fn each_redo<'a>(&'a self, graph: &'a Graph) -> impl Iterator<Item = Redo> + 'a {
        let scope = &self.unrecorded.scope;
        let unrecorded = self.unrecorded.instances.iter().flat_map(move |i| {
            let asked = graph
                .instance_tasks(*i)
                .filter(|t| scope.contains(graph, *t));
            asked.map(move |t| Redo {
                task: t,
                reason: Reason::NeverStarted,
                credits: graph.task(t).planned,
                detail: None,
            })
        });
        self.redo.iter().cloned().chain(unrecorded)
    }

    /// Keeps of what is to pay for only what `scope` asks for now (`--items`, `--until`);
    /// the rest stays as the record has it, pending or failed, for a later resume.
    pub fn narrow(&mut self, graph: &Graph, scope: &Scope) {
        if scope.is_all() {
            return;
        }
        self.redo.retain(|r| scope.contains(graph, r.task));
        self.left_failed.retain(|r| scope.contains(graph, r.task));
        self.reuse.retain(|(t, ..)| scope.contains(graph, *t));
        let mut unrecorded = Unrecorded {
            scope: scope.clone(),
            ..Unrecorded::default()
        };
        for instance in std::mem::take(&mut self.unrecorded.instances) {
            let asked = graph
                .instance_tasks(instance)
                .filter(|t| scope.contains(graph, *t));
            let (tasks, credits) =
                asked.fold((0, 0), |(n, c), t| (n + 1, c + graph.task(t).planned));
            if tasks > 0 {
                unrecorded.instances.push(instance);
                unrecorded.tasks += tasks;
                unrecorded.credits += credits;
            }
        }
        self.unrecorded = unrecorded;
    }

    pub fn is_kept(&self, row_id: TaskId) -> bool {
        self.kept.binary_search(&row_id).is_ok()
    }

    pub fn saved_by_reuse(&self, graph: &Graph) -> u64 {
        self.reuse
            .iter()
            .map(|(t, ..)| graph.task(*t).planned)
            .sum()
    }
}

/// What the run would do now. `previous` is the graph the run's tasks were recorded from, when
/// the pipeline changed since (`--allow-changes`); `reuse` looks for earlier runs' results.
/// Reads are batched: one pass over the tasks, and under `--reuse` one lookup of earlier
/// results per level of the chain, whatever the number of items.
pub async fn review(
    store: &Store,
    run_id: Option<&RunId>,
    graph: &Graph,
    previous: Option<&Graph>,
    on_ambiguous: OnAmbiguous,
    reuse: bool,
) -> Result<Review, StoreError> {
    let records = match run_id {
        Some(id) => records::load(store, id, graph, previous, reuse).await?,
        None => decide::Records::empty(graph),
    };
    let opts = Options {
        on_ambiguous,
        reuse,
    };
    let mut lookups = Lookups::default();
    let mut review = loop {
        match decide::decide(graph, &records, opts, &lookups) {
            Decision::Done(review) => break *review,
            Decision::Need(ids) => {
                let found = store.identities().reusable(&ids, run_id).await?;
                lookups.answer(ids, found);
            }
        }
    };
    if records.has_rows.iter().any(|r| *r) || !records.removed.is_empty() {
        review.rows = Some(records.ids);
    }
    Ok(review)
}

/// The kept outputs whose file or object is missing or differs from the record, for a dry run
/// to show: [`Review::refetch`].
pub async fn check(
    store: &Store,
    run_id: &RunId,
    review: &Review,
) -> Result<Vec<Refetch>, StoreError> {
    check::outputs(store, run_id, &review.kept).await
}

/// The check of the kept outputs running beside a resumed run (see [`beside`]); stopped when
/// dropped, as the run ends. A check stopped anywhere is made again by the next resume: what it
/// sets aside is one transaction, its moves journaled in it.
pub struct Beside(tokio::task::JoinHandle<()>);

impl Drop for Beside {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Starts the check of the kept outputs (row ids `kept`, sorted) beside the run: what is missing
/// or modified is set aside ([`apply::refetch`]) and handed to the executor to fetch again from
/// its job. First, the temporary files a killed process left are removed (not the executor's
/// own); then the check waits for `proven` (the executor's place proven writable, or the
/// executor gone), so that its listings, many at once, never hold back the write the first
/// paid call waits for (at 900,000 outputs, 3.3 s behind them on a one-thread S3 server).
///
/// The run pays meanwhile, from its first call, because no paid call depends on what the check
/// finds: a call never reads a kept file or object. Its inputs are the service's URLs of the
/// outputs it reads, taken from their jobs (fetched fresh from the job when near expiry), and a
/// call whose input the job cannot give is not sent. A kept output found missing or modified
/// is fetched again from that same job, free; a downstream call that read it meanwhile read
/// the job's bytes, the recorded ones. What the check must hold back is the run's end: the
/// executor does not end (nor the run get recorded succeeded) before the check answers, and a
/// check that fails stops the run, so the next resume checks again.
pub fn beside(
    store: Store,
    run_id: RunId,
    run_dir: RunDir,
    kept: Vec<TaskId>,
    proven: tokio::sync::oneshot::Receiver<()>,
) -> (crate::exec::Refetch, Beside) {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let started = std::time::Instant::now();
        let dir = run_dir.clone();
        let _ = tokio::task::spawn_blocking(move || dir.remove_leftovers()).await;
        // Told, or the executor gone: either way the check goes on.
        let _ = proven.await;
        let found = async {
            let refetch = check::outputs(&store, &run_id, &kept).await?;
            if !refetch.is_empty() {
                apply::refetch(&store, &run_id, &run_dir, &refetch).await?;
            }
            Ok::<_, StoreError>(refetch)
        };
        match found.await {
            Ok(refetch) => {
                tracing::info!(
                    "checked the outputs of {} kept task(s) in {:.2?}: {} file(s) to fetch again",
                    kept.len(),
                    started.elapsed(),
                    refetch.len()
                );
                // Set aside: no file or object is recorded for them any more.
                let outputs = refetch.into_iter().map(|r| RecordedOutput {
                    path: None,
                    ..r.output
                });
                let _ = tx.send(Ok(outputs.collect()));
            }
            Err(e) => {
                tracing::warn!(
                    "cannot check the kept outputs of run {run_id}: {e}; the next resume checks them again"
                );
                let _ = tx.send(Err(std::sync::Arc::new(e)));
            }
        }
    });
    (rx, Beside(task))
}

#[cfg(test)]
mod tests {
    use super::Reason;

    #[test]
    fn a_reasons_json_key_is_the_name_serde_gives_it() {
        for reason in Reason::ALL {
            let serde = serde_json::to_value(reason).unwrap();
            assert_eq!(serde.as_str(), Some(reason.key()), "{reason:?}");
        }
    }
}
