//! A review applied: the record and the run's files made to agree with it before the scheduler
//! starts. Nothing here is a paid call.
//!
//! What a process killed at any point leaves, and what the next resume does with it:
//! 1. moves an earlier resume journaled and did not make are made first;
//! 2. lost answers are read back and each recorded as it comes (a fact, like any answer);
//! 3. reused outputs are copied into the run (files no row names yet: copied again, or found
//!    whole, next time);
//! 4. every other state write is one transaction ([`crate::store::Revisions::apply`]), which also journals
//!    the file and object moves: before its commit nothing of it happened, after it all did;
//! 5. the journaled moves are made, then forgotten. A move is idempotent: one found made is
//!    counted made.
//!
//! The kept outputs' check and the temporary files a killed process left are dealt with beside
//! the run ([`super::beside`]), which sets aside what it finds in the same way.

use std::collections::HashSet;

use crate::api::Client;
use crate::place::{Address, RunDir, copy_checked, file_sha256};
use crate::plan::graph::Graph;
use crate::plan::rows::RowIds;
use crate::run_id::RunId;
use crate::store::{
    Blocked, Changes, NewTask, RecordedOutput, Reusable, Reused, SetAside, Store, StoreError,
    TaskId, TaskRef, Undone,
};
use crate::task_key::TaskKey;

use super::{Reason, Refetch, Review, records, recover::read_back_all};
use crate::aside::{aside_path, make_moves, move_one};

/// What [`apply`] did.
#[derive(Debug, Default)]
pub struct Tally {
    pub recovered: usize,
    pub reused: usize,
    pub set_aside: usize,
    /// Task rows recorded (tasks gained or reused): the review's row ids are then not all.
    pub new_rows: usize,
}

/// Makes the record and the output directory agree with `review`: lost answers read back by
/// job id, outputs of tasks to redo moved under [`crate::place::layout::SUPERSEDED`], changed
/// tasks reset, reused results copied in. The kept outputs' files are checked beside the run,
/// not here (see [`super::beside`]): the first paid call does not wait for a look at each.
pub async fn apply(
    store: &Store,
    client: &Client,
    run_id: &RunId,
    run_dir: &RunDir,
    graph: &Graph,
    review: &Review,
    describe: impl Fn(usize) -> NewTask,
) -> Result<Tally, StoreError> {
    make_moves(store, store.revisions().pending_moves(run_id).await?).await?;
    store.attempts().settle_orphaned(run_id).await?;
    // A continued run's rows are the review's; a new run recorded some since its review.
    let read;
    let rows = match &review.rows {
        Some(rows) => rows,
        None => {
            read = records::row_ids(store, run_id, graph).await?;
            &read
        }
    };
    let recovered = read_back_all(store, client, run_id, graph, &review.recover, rows).await?;
    let at = Applying {
        graph,
        review,
        rows,
        describe: &describe,
    };
    let leaving = at.leaving(&recovered);
    let set_aside = at.set_aside(&store.kept().of_tasks(&leaving).await?, run_dir);
    let (failed, blocked) = at.left_failed();
    let changes = Changes {
        new_tasks: at.new_tasks(),
        set_aside,
        reset: at.reset(),
        removed: review.removed.iter().map(|r| r.id).collect(),
        failed,
        blocked,
        reused: at.reused(run_dir),
        reroll: review.reroll.clone(),
    };
    let tally = Tally {
        recovered: recovered.len(),
        reused: changes.reused.len(),
        set_aside: changes.set_aside.len(),
        new_rows: changes.new_tasks.len(),
    };
    crate::failpoint::hit("resume-apply-before-commit");
    let moves = store.revisions().apply(run_id, &changes).await?;
    crate::failpoint::hit("resume-apply-after-commit");
    make_moves(store, moves).await?;
    Ok(tally)
}

/// What a review's application reads to make its [`Changes`]: each a short decision on the
/// review and the run's rows.
struct Applying<'a, D: Fn(usize) -> NewTask> {
    graph: &'a Graph,
    review: &'a Review,
    rows: &'a RowIds,
    describe: &'a D,
}

impl<D: Fn(usize) -> NewTask> Applying<'_, D> {
    /// Tasks the pipeline gained under --allow-changes, and those reused: the others are
    /// recorded by the executor as it comes near them.
    fn new_tasks(&self) -> Vec<NewTask> {
        let gained = self
            .review
            .redo
            .iter()
            .filter(|r| r.reason == Reason::Changed);
        let reused = self.review.reuse.iter().map(|(t, ..)| *t);
        gained
            .map(|r| r.task)
            .chain(reused)
            .filter(|t| !self.rows.has(*t))
            .map(self.describe)
            .collect()
    }

    /// The rows whose outputs make way for new ones: tasks that run again (not read back),
    /// and those the pipeline dropped; sorted.
    fn leaving(&self, recovered: &HashSet<TaskId>) -> Vec<TaskId> {
        let again = self
            .review
            .redo
            .iter()
            .filter_map(|r| self.rows.get(r.task));
        let leaving: HashSet<TaskId> = again
            .filter(|id| !recovered.contains(id))
            .chain(self.review.removed.iter().map(|r| r.id))
            .collect();
        let mut leaving: Vec<TaskId> = leaving.into_iter().collect();
        leaving.sort_unstable();
        leaving
    }

    /// The leaving tasks' outputs, set aside under `_superseded/`.
    fn set_aside(&self, outputs: &[RecordedOutput], run_dir: &RunDir) -> Vec<SetAside> {
        let rerolled: HashSet<TaskId> = self
            .review
            .redo
            .iter()
            .filter(|r| r.reason == Reason::Rerolled)
            .filter_map(|r| self.rows.get(r.task))
            .collect();
        let aside = |o: &RecordedOutput| SetAside {
            output_id: o.id,
            to: aside_path(run_dir, o, None),
            reason: if rerolled.contains(&o.task_id) {
                "rerolled"
            } else {
                "the task runs again"
            }
            .to_owned(),
            from: o.path.as_ref().map(ToString::to_string),
            sha256: None,
            refetch: false,
        };
        outputs.iter().map(aside).collect()
    }

    /// Recorded tasks done again from the start, as the pipeline now says: under a changed
    /// pipeline every task to do, else the changed and the rerolled ones.
    fn reset(&self) -> Vec<(TaskId, NewTask)> {
        let review = self.review;
        let again = review
            .redo
            .iter()
            .filter(|r| review.changes || matches!(r.reason, Reason::Changed | Reason::Rerolled));
        again
            .filter_map(|r| Some((self.rows.get(r.task)?, (self.describe)(r.task))))
            .collect()
    }

    /// Tasks left failed (`--on-ambiguous fail`, or failed by a check), with why, and the
    /// recorded tasks below each, blocked.
    fn left_failed(&self) -> (Vec<(TaskId, String)>, Vec<Blocked>) {
        let (mut failed, mut blocked) = (Vec::new(), Vec::new());
        for f in &self.review.left_failed {
            let why = match f.reason {
                // A check failed it: its recorded error says which.
                Reason::Failed => f
                    .detail
                    .clone()
                    .unwrap_or_else(|| "a check failed it".into()),
                _ => format!(
                    "a call was sent without a complete answer and may have been billed; not called again (--on-ambiguous fail){}",
                    f.detail
                        .as_deref()
                        .map(|d| format!(": {d}"))
                        .unwrap_or_default()
                ),
            };
            failed.extend(self.rows.get(f.task).map(|id| (id, why)));
            let below = self.graph.descendants(f.task).into_iter();
            let tasks: Vec<TaskId> = below.filter_map(|t| self.rows.get(t)).collect();
            let TaskKey { item, step, .. } = self.graph.key(f.task);
            blocked.push(Blocked {
                tasks,
                why: format!("its input {item}/{step} failed"),
            });
        }
        (failed, blocked)
    }

    /// Tasks settled with an earlier run's result, their files copied into this run.
    fn reused(&self, run_dir: &RunDir) -> Vec<Reused> {
        let graph = self.graph;
        let reused = |(t, identity, found): &(usize, String, Reusable)| {
            let task = match self.rows.get(*t) {
                Some(id) => TaskRef::Row(id),
                None => TaskRef::New(graph.key(*t)),
            };
            Reused {
                task,
                identity: identity.clone(),
                from: found.clone(),
                paths: copy_reused(run_dir, graph, *t, found),
            }
        };
        self.review.reuse.iter().map(reused).collect()
    }
}

/// Sets aside the kept outputs `refetch` found missing or modified, to be fetched again: the
/// record in one transaction that journals the moves of the modified files, then the moves.
pub(super) async fn refetch(
    store: &Store,
    run_id: &RunId,
    run_dir: &RunDir,
    refetch: &[Refetch],
) -> Result<(), StoreError> {
    let set_aside = refetch.iter().map(|r| {
        let modified = r.modified.is_some();
        if modified {
            tracing::warn!(
                "{} was modified since it was downloaded; moved aside and fetched again",
                r.output
                    .path
                    .as_ref()
                    .map_or_else(|| "?".to_owned(), ToString::to_string)
            );
        }
        SetAside {
            output_id: r.output.id,
            from: r
                .output
                .path
                .as_ref()
                .map(ToString::to_string)
                .filter(|_| modified),
            to: aside_path(run_dir, &r.output, Some("modified")).filter(|_| modified),
            sha256: r.modified.clone(),
            reason: if modified {
                "the file on disk differed from the one downloaded; fetched again"
            } else {
                "the file was missing; fetched again"
            }
            .to_owned(),
            refetch: true,
        }
    });
    let changes = Changes {
        set_aside: set_aside.collect(),
        ..Changes::default()
    };
    crate::failpoint::hit("resume-refetch-before-commit");
    let moves = store.revisions().apply(run_id, &changes).await?;
    crate::failpoint::hit("resume-refetch-after-commit");
    make_moves(store, moves).await
}

/// Undoes the open reroll of run `run_id` named `said` when it could not be done: nothing of
/// it billed, none of its tasks done ([`crate::store::Revisions::undo_reroll`]); then moves
/// the files it set aside back to their places, never over other bytes. A process killed
/// between the commit and the moves leaves outputs whose files are missing: the next resume
/// fetches them again from their jobs, for free.
pub async fn undo_reroll(
    store: &Store,
    run_id: &RunId,
    said: &str,
) -> Result<Option<Undone>, StoreError> {
    let undone = store.revisions().undo_reroll(run_id, said).await?;
    for (aside, home) in undone.iter().flat_map(|u| u.moves.iter()) {
        if move_one(aside, home).await.is_none() {
            tracing::warn!("cannot move {aside} back to {home}; the next resume fetches it again");
        }
    }
    Ok(undone)
}

/// Copies a reused task's files into this run; `None` for each one to fetch from its job
/// instead (gone, or changed since).
fn copy_reused(run_dir: &RunDir, graph: &Graph, t: usize, found: &Reusable) -> Vec<Option<String>> {
    // Into object storage, each reused output is fetched from its job: free, and create-only;
    // so is one kept in object storage by the earlier run.
    let Some(run_dir) = run_dir.local() else {
        return vec![None; found.outputs.len()];
    };
    let dir = run_dir.item(&graph.item_dir(graph.task(t).instance));
    found
        .outputs
        .iter()
        .map(|o| {
            let Address::Local(from) = o.address()? else {
                return None;
            };
            let ext = from
                .extension()
                .map(|e| format!(".{}", e.to_string_lossy()))
                .unwrap_or_default();
            let to = dir.join(format!("{}{ext}", graph.file_stem(t, o.k)));
            let sha = o.sha256.as_ref()?;
            if file_sha256(&from).ok().as_ref() != Some(sha) {
                return None;
            }
            std::fs::create_dir_all(&dir).ok()?;
            let done = copy_checked(&from, &to, sha).ok()?;
            Some(done.to_string_lossy().into_owned())
        })
        .collect()
}
