//! Resuming a run, in one place: what a resume keeps, reads back, fetches again and pays for
//! again, and why; then making the record and the run's files agree with that before the
//! scheduler starts.
//!
//! - [`decide`]: the pure core. The run's records in, a [`Review`] out; no I/O.
//! - [`records`]: reads what the core needs from the state database, in batches.
//! - [`check`]: the kept outputs' files or objects compared with the record (what to fetch
//!   again, what was modified and is set aside), streamed from the database in pages; the
//!   objects by listing the run's prefix ([`objects`]).
//! - [`apply`]: the review applied: every state write in one transaction, every file or
//!   object move journaled in it, so a process killed anywhere inside resumes correctly.
//! - [`recover`]: lost answers read back by their job id, for free.
//! - [`changes`]: what a changed pipeline would run again, in a sentence.
//!
//! [`review`] only reads, so `resume --dry-run` shows it; [`apply()`] changes things.
//! The lifecycle around them (lock, plan, admission, execution) is the runner's.

mod apply;
mod changes;
mod check;
pub mod decide;
mod objects;
mod records;
mod recover;

use crate::exec::{OnAmbiguous, RowIds};
use crate::plan::graph::{Graph, Instance};
use crate::store::{OutputRow, Reusable, Store, StoreError, TaskRow};

pub use apply::{Applied, apply};
pub use changes::describe_changes;
use decide::{Decision, Lookups, Options};

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
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Failed => "failed",
            Reason::Changed => "changed",
            Reason::Ambiguous => "ambiguous",
            Reason::NeverStarted => "never started",
            Reason::Blocked => "blocked",
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

/// An output of a kept task whose file is to be fetched again from its job.
#[derive(Clone, Debug)]
pub struct Refetch {
    pub output: OutputRow,
    /// The file's actual sha256 when it is there but differs from the record.
    pub modified: Option<String>,
}

/// The answer of a lost call whose job is known: read it back, free, before paying again.
#[derive(Clone, Debug)]
pub struct Recover {
    pub task: usize,
    pub attempt_id: i64,
    pub job_id: String,
}

#[derive(Default)]
pub struct Review {
    /// Recorded tasks to pay for, and under `--reuse` every task without a reusable result.
    pub redo: Vec<Redo>,
    /// Items the run never recorded (it records an item's tasks as it comes near them): all
    /// their tasks are to pay for, and are counted rather than listed.
    pub unrecorded: Unrecorded,
    /// Ambiguous tasks left failed, per `--on-ambiguous fail`.
    pub left_failed: Vec<Redo>,
    pub recover: Vec<Recover>,
    pub refetch: Vec<Refetch>,
    /// Tasks taken from an earlier run's succeeded task of the same identity (`--reuse`).
    pub reuse: Vec<(usize, String, Reusable)>,
    /// Recorded tasks the (changed) pipeline no longer has.
    pub removed: Vec<TaskRow>,
    /// Whether the pipeline changed since the tasks were recorded (`--allow-changes`).
    pub changes: bool,
    /// Tasks kept as they are (succeeded), by row id, sorted.
    pub kept: Vec<i64>,
    /// The row id of each task, as the review read them, for [`apply()`]; `None` when the run
    /// had no row yet (a new run, which records some before it applies the review).
    pub rows: Option<RowIds>,
}

/// The tasks of items with no recorded task.
#[derive(Default)]
pub struct Unrecorded {
    pub instances: Vec<Instance>,
    pub tasks: usize,
    pub credits: u64,
}

impl Review {
    /// Tasks to pay for.
    pub fn to_pay(&self) -> usize {
        self.redo.len() + self.unrecorded.tasks
    }

    pub fn credits(&self) -> u64 {
        self.redo.iter().map(|r| r.credits).sum::<u64>() + self.unrecorded.credits
    }

    /// Every task to pay for: the recorded ones, then those of unrecorded items.
    pub fn each_redo<'a>(&'a self, graph: &'a Graph) -> impl Iterator<Item = Redo> + 'a {
        let unrecorded = self.unrecorded.instances.iter().flat_map(move |i| {
            graph.instance_tasks(*i).map(move |t| Redo {
                task: t,
                reason: Reason::NeverStarted,
                credits: graph.task(t).planned,
                detail: None,
            })
        });
        self.redo.iter().cloned().chain(unrecorded)
    }

    pub fn is_kept(&self, row_id: i64) -> bool {
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
    run_id: &str,
    graph: &Graph,
    previous: Option<&Graph>,
    on_ambiguous: OnAmbiguous,
    reuse: bool,
) -> Result<Review, StoreError> {
    let records = records::load(store, run_id, graph, previous, reuse).await?;
    let opts = Options {
        on_ambiguous,
        reuse,
    };
    let mut lookups = Lookups::default();
    let mut review = loop {
        match decide::decide(graph, &records, opts, &lookups) {
            Decision::Done(review) => break *review,
            Decision::Need(ids) => {
                let found = store.reusable_many(&ids, run_id).await?;
                lookups.answer(ids, found);
            }
        }
    };
    review.refetch = check::outputs(store, run_id, &review).await?;
    if records.has_rows.iter().any(|r| *r) || !records.removed.is_empty() {
        review.rows = Some(records.ids);
    }
    Ok(review)
}
