//! The heart of a resume, and nothing but logic: the run's records in, a [`Review`] out. No
//! database, network or disk is touched here, so every outcome is unit-tested on records
//! written by hand (see the tests below).
//!
//! Under `--reuse` a task's identity depends on its inputs' bytes, which an earlier decision
//! may have taken from another run; [`decide`] therefore works in passes: a pass that meets
//! identities it has not looked up yet answers [`Decision::Need`] with all of them, the caller
//! looks them up in one batch and calls again. A chain of `d` steps takes at most `d + 1`
//! passes, whatever the number of items.

use std::collections::{HashMap, HashSet};

use crate::exec::identity::identity;
use crate::exec::{OnAmbiguous, RowIds};
use crate::plan::graph::{Graph, Instance};
use crate::store::{RecordedTask, Reusable, TaskStatus};

use super::{Reason, Recover, Redo, Review};

/// What the record says of a run, matched to the graph of the pipeline as it is now.
pub struct Records {
    /// The row id of each task of the graph; 0 where the run has no row for it.
    pub ids: RowIds,
    /// The whole row of each recorded task that did not succeed (few: what failed, and what
    /// was under way), by task.
    pub open: HashMap<usize, RecordedTask>,
    /// Recorded tasks the pipeline no longer has.
    pub removed: Vec<RecordedTask>,
    /// Whether each instance (items, then the batch) has a recorded task.
    pub has_rows: Vec<bool>,
    /// The sha256 of each downloaded output, by row id and output index; read only when
    /// identities are computed (`--reuse`, or a changed pipeline).
    pub hashes: HashMap<(i64, u32), String>,
    /// A changed pipeline (`--allow-changes`): the identity each recorded task had under the
    /// pipeline it was recorded from, by row id.
    pub previous: Option<HashMap<i64, Option<String>>>,
}

impl Records {
    /// The records of a run with no task recorded.
    pub fn empty(graph: &Graph) -> Records {
        Records {
            ids: RowIds::new(graph),
            open: HashMap::new(),
            removed: Vec::new(),
            has_rows: vec![false; graph.instances() + 1],
            hashes: HashMap::new(),
            previous: None,
        }
    }

    fn has_rows(&self, instance: Instance) -> bool {
        let i = match instance {
            Instance::Item(i) => i,
            Instance::Batch => self.has_rows.len() - 1,
        };
        self.has_rows.get(i).copied().unwrap_or(false)
    }
}

/// What the user asked of the resume.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    pub on_ambiguous: OnAmbiguous,
    pub reuse: bool,
}

/// Earlier runs' results looked up so far, by identity (`--reuse`).
#[derive(Default)]
pub struct Lookups {
    pub found: HashMap<String, Reusable>,
    /// Every identity asked for, found or not.
    pub asked: HashSet<String>,
}

impl Lookups {
    /// Adds the answer to one batch of questions.
    pub fn answer(&mut self, asked: Vec<String>, found: HashMap<String, Reusable>) {
        self.asked.extend(asked);
        self.found.extend(found);
    }
}

pub enum Decision {
    /// Look these identities up (all at once) and decide again.
    Need(Vec<String>),
    Done(Box<Review>),
}

/// Decides, for each task of `graph`, whether the resumed run keeps it, reuses an earlier
/// run's result, reads a lost answer back, or pays for it, and why.
pub fn decide(graph: &Graph, rec: &Records, opts: Options, lookups: &Lookups) -> Decision {
    let identities = rec.previous.is_some() || opts.reuse;
    let mut review = Review {
        changes: rec.previous.is_some(),
        ..Review::default()
    };
    let mut need: Vec<String> = Vec::new();
    // The sha256 of each output known to be final by now, by (task, k).
    let mut known: HashMap<(usize, u32), String> = HashMap::new();
    for t in 0..graph.len() {
        let task = graph.task(t);
        let id = rec.ids.get(t);
        // The batch's tasks are recorded with the run: one it lacks is new to the pipeline.
        let unreached = task.instance != Instance::Batch && !rec.has_rows(task.instance);
        if id == 0 && !opts.reuse && unreached {
            if t == graph.instance_tasks(task.instance).start {
                review.unrecorded.instances.push(task.instance);
            }
            review.unrecorded.tasks += 1;
            review.unrecorded.credits += task.planned;
            continue;
        }
        let open = rec.open.get(&t);
        let succeeded = id != 0 && open.is_none();
        let mine = if identities {
            identity(graph, t, |u, k| known.get(&(u, k)).cloned())
        } else {
            None
        };
        let keep = match &rec.previous {
            None => succeeded,
            Some(ids) => succeeded && mine.is_some() && ids.get(&id).cloned().flatten() == mine,
        };
        if keep {
            review.kept.push(id);
            if identities {
                for k in 0..graph.outputs(t) {
                    if let Some(sha) = rec.hashes.get(&(id, k)) {
                        known.insert((t, k), sha.clone());
                    }
                }
            }
            continue;
        }
        if opts.reuse
            && let Some(mine) = &mine
        {
            if let Some(found) = lookups.found.get(mine) {
                for o in &found.outputs {
                    if let Some(sha) = &o.sha256 {
                        known.insert((t, o.k), sha.clone());
                    }
                }
                review.reuse.push((t, mine.clone(), found.clone()));
                continue;
            }
            if !lookups.asked.contains(mine) {
                need.push(mine.clone());
            }
        }
        let redo = Redo {
            task: t,
            reason: reason(rec, t, &mut review.recover),
            credits: task.planned,
            detail: open.and_then(|r| r.error.clone()),
        };
        if redo.reason == Reason::Ambiguous && opts.on_ambiguous == OnAmbiguous::Fail {
            review.left_failed.push(redo);
        } else {
            review.redo.push(redo);
        }
    }
    if !need.is_empty() {
        need.sort_unstable();
        need.dedup();
        return Decision::Need(need);
    }
    review.kept.sort_unstable();
    review.removed = rec.removed.clone();
    // Tasks below one left failed are blocked, not paid for.
    if !review.left_failed.is_empty() {
        let mut blocked = vec![false; graph.len()];
        for f in &review.left_failed {
            for d in graph.descendants(f.task) {
                blocked[d] = true;
            }
        }
        review.redo.retain(|r| !blocked[r.task]);
    }
    Decision::Done(Box::new(review))
}

/// Why task `t`, not kept, is paid for; a lost answer whose job is known is listed for
/// reading back first.
fn reason(rec: &Records, t: usize, recover: &mut Vec<Recover>) -> Reason {
    if rec.ids.get(t) == 0 {
        // New to a changed pipeline; or never recorded at all.
        return if rec.previous.is_some() {
            Reason::Changed
        } else {
            Reason::NeverStarted
        };
    }
    let Some(r) = rec.open.get(&t) else {
        // Succeeded, but the changed pipeline asks something else of it.
        return Reason::Changed;
    };
    if let Some(a) = r.last_attempt.as_ref().filter(|a| a.possibly_billed()) {
        if let Some(job) = &a.job_id {
            recover.push(Recover {
                task: t,
                attempt_id: a.id,
                job_id: job.clone(),
            });
        }
        return Reason::Ambiguous;
    }
    match r.status {
        TaskStatus::Failed => Reason::Failed,
        TaskStatus::Blocked => Reason::Blocked,
        _ => Reason::NeverStarted,
    }
}

#[cfg(test)]
mod tests;
