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

use crate::exec::OnAmbiguous;
use crate::exec::identity::identity;
use crate::plan::graph::{Graph, Instance};
use crate::plan::rows::RowIds;
use crate::sha256::Sha256Sum;
use crate::store::{RecordedTask, Reusable, TaskId, TaskStatus};

use super::{Reason, Recover, Redo, Review};

/// What the record says of a run, matched to the graph of the pipeline as it is now.
pub struct Records {
    /// The row id of each task of the graph that the run has a row for.
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
    pub hashes: HashMap<(TaskId, u32), Sha256Sum>,
    /// A changed pipeline (`--allow-changes`): the identity each recorded task had under the
    /// pipeline it was recorded from, by row id.
    pub previous: Option<HashMap<TaskId, Option<String>>>,
    /// Tasks a check failed (`on_fail: fail`): left failed, since paying for them again would
    /// act twice on one verdict.
    pub failed_by_checks: HashSet<TaskId>,
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
            failed_by_checks: HashSet::new(),
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
    let mut pass = Pass {
        rec,
        opts,
        identities: rec.previous.is_some() || opts.reuse,
        review: Review {
            changes: rec.previous.is_some(),
            ..Review::default()
        },
        need: Vec::new(),
        known: HashMap::new(),
    };
    for t in 0..graph.len() {
        pass.task(graph, t, lookups);
    }
    pass.end(graph)
}

/// One pass of [`decide`] over the tasks, in the graph's order (inputs first).
struct Pass<'a> {
    rec: &'a Records,
    opts: Options,
    /// Whether tasks' identities are computed: `--reuse`, or a changed pipeline.
    identities: bool,
    review: Review,
    /// Identities to look up before deciding again.
    need: Vec<String>,
    /// The sha256 of each output known to be final by now, by (task, k).
    known: HashMap<(usize, u32), Sha256Sum>,
}

impl Pass<'_> {
    fn task(&mut self, graph: &Graph, t: usize, lookups: &Lookups) {
        let task = graph.task(t);
        let id = self.rec.ids.get(t);
        // The batch's tasks are recorded with the run: one it lacks is new to the pipeline.
        let unreached = task.instance != Instance::Batch && !self.rec.has_rows(task.instance);
        if id.is_none() && !self.opts.reuse && unreached {
            self.unrecorded(graph, t);
            return;
        }
        let open = self.rec.open.get(&t);
        let mine = if self.identities {
            identity(graph, t, |u, k| self.known.get(&(u, k)).cloned())
        } else {
            None
        };
        if let Some(id) = id.filter(|_| open.is_none())
            && self.keeps(id, mine.as_ref())
        {
            self.keep(graph, t, id);
            return;
        }
        if self.opts.reuse
            && let Some(mine) = mine
            && self.reused(t, mine, lookups)
        {
            return;
        }
        self.pay(graph, t, open);
    }

    /// A task of an item the run never recorded: counted, not listed.
    fn unrecorded(&mut self, graph: &Graph, t: usize) {
        let task = graph.task(t);
        let unrecorded = &mut self.review.unrecorded;
        if t == graph.instance_tasks(task.instance).start {
            unrecorded.instances.push(task.instance);
        }
        unrecorded.tasks += 1;
        unrecorded.credits += task.planned;
    }

    /// Whether a task that succeeded (row `id`) is kept: always, unless the pipeline changed
    /// and asks something else of it now (its identity `mine` differs from the recorded one).
    fn keeps(&self, id: TaskId, mine: Option<&String>) -> bool {
        match &self.rec.previous {
            None => true,
            Some(ids) => mine.is_some() && ids.get(&id).and_then(Option::as_ref) == mine,
        }
    }

    fn keep(&mut self, graph: &Graph, t: usize, id: TaskId) {
        self.review.kept.push(id);
        if self.identities {
            for k in 0..graph.outputs(t) {
                if let Some(sha) = self.rec.hashes.get(&(id, k)) {
                    self.known.insert((t, k), sha.clone());
                }
            }
        }
    }

    /// Takes an earlier run's result of the same identity `mine` when one was found; asks for
    /// it when it was not looked up yet.
    fn reused(&mut self, t: usize, mine: String, lookups: &Lookups) -> bool {
        if let Some(found) = lookups.found.get(&mine) {
            for o in &found.outputs {
                if let Some(sha) = &o.sha256 {
                    self.known.insert((t, o.k), sha.clone());
                }
            }
            self.review.reuse.push((t, mine, found.clone()));
            return true;
        }
        if !lookups.asked.contains(&mine) {
            self.need.push(mine);
        }
        false
    }

    /// A task paid for (again), or left failed: per `--on-ambiguous fail`, or failed by a
    /// check.
    fn pay(&mut self, graph: &Graph, t: usize, open: Option<&RecordedTask>) {
        let redo = Redo {
            task: t,
            reason: reason(self.rec, t, &mut self.review.recover),
            credits: graph.task(t).planned,
            detail: open.and_then(|r| r.error.clone()),
        };
        let by_check = open.is_some_and(|r| self.rec.failed_by_checks.contains(&r.id));
        let left = match redo.reason {
            Reason::Failed => by_check,
            Reason::Ambiguous => self.opts.on_ambiguous == OnAmbiguous::Fail,
            _ => false,
        };
        if left {
            self.review.left_failed.push(redo);
        } else {
            self.review.redo.push(redo);
        }
    }

    /// The identities to look up, or the review: tasks below one left failed are blocked,
    /// not paid for.
    fn end(mut self, graph: &Graph) -> Decision {
        if !self.need.is_empty() {
            self.need.sort_unstable();
            self.need.dedup();
            return Decision::Need(self.need);
        }
        let mut review = self.review;
        review.kept.sort_unstable();
        review.removed = self.rec.removed.clone();
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
}

/// Why task `t`, not kept, is paid for; a lost answer whose job is known is listed for
/// reading back first.
fn reason(rec: &Records, t: usize, recover: &mut Vec<Recover>) -> Reason {
    if !rec.ids.has(t) {
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
