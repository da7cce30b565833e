//! Where each task of a graph is recorded in the state database: its row id, held in a few
//! bytes a task. The executor fills it as it records tasks; a resume reads it back to match
//! the record to the graph of the pipeline as it is now.

use std::collections::HashMap;

use crate::plan::graph::{Graph, Instance};
use crate::store::TaskId;

/// Each task's row id, in a few bytes a task.
///
/// A run records an item's tasks in one statement, in the graph's order, so their ids are
/// consecutive: an item's ids are held as the id of its first task, plus a bit a task saying
/// whether it is recorded. Ids that break the pattern (tasks a changed pipeline added later,
/// or another run's rows interleaved on a shared PostgreSQL) are held one by one. At 1,000,000
/// items × 9 tasks that is 5 MB where a `Vec<i64>` was 72 MB. The arithmetic is on the numbers
/// the ids are; what goes in and out is a [`TaskId`].
pub struct RowIds {
    batch: usize,
    shape: usize,
    /// The first group's base (an id less its offset, so not always an id itself): the
    /// others' are held as their distance from it.
    origin: Option<i64>,
    /// Per group (the batch, then each item): the id its first task has when its ids are
    /// consecutive, less `origin`; [`UNSET`] before any of its tasks is recorded (or when the
    /// distance does not fit: its ids are then all in `others`).
    base: Vec<u32>,
    /// One bit a task: recorded.
    recorded: Vec<u64>,
    /// Ids that are not their group's base plus their offset.
    others: HashMap<usize, TaskId>,
}

const UNSET: u32 = u32::MAX;

impl RowIds {
    /// No task of `graph` recorded.
    pub fn new(graph: &Graph) -> RowIds {
        let batch = graph.instance_tasks(Instance::Batch).len();
        let shape = graph.len().saturating_sub(batch) / graph.instances().max(1);
        RowIds {
            batch,
            shape,
            origin: None,
            base: vec![UNSET; graph.instances() + 1],
            recorded: vec![0; graph.len().div_ceil(64)],
            others: HashMap::new(),
        }
    }

    /// Task `t`'s group and its offset in it.
    fn group(&self, t: usize) -> (usize, i64) {
        let (group, offset) = if t < self.batch {
            (0, t)
        } else {
            let r = t - self.batch;
            (1 + r / self.shape, r % self.shape)
        };
        (group, i64::try_from(offset).unwrap_or(i64::MAX))
    }

    /// Whether any task of `instance` is recorded.
    pub fn any_of(&self, graph: &Graph, instance: Instance) -> bool {
        graph
            .instance_tasks(instance)
            .any(|t| self.recorded[t / 64] & (1 << (t % 64)) != 0)
    }

    /// The row id of task `t`; `None` while it is not recorded.
    pub fn get(&self, t: usize) -> Option<TaskId> {
        if self.recorded[t / 64] & (1 << (t % 64)) == 0 {
            return None;
        }
        if let Some(id) = self.others.get(&t) {
            return Some(*id);
        }
        let (group, offset) = self.group(t);
        match (self.origin, self.base[group]) {
            (Some(origin), base) if base != UNSET => TaskId::new(origin + i64::from(base) + offset),
            _ => None,
        }
    }

    /// Whether task `t` is recorded.
    pub fn has(&self, t: usize) -> bool {
        self.get(t).is_some()
    }

    pub fn set(&mut self, t: usize, task: TaskId) {
        let id = task.get();
        self.recorded[t / 64] |= 1 << (t % 64);
        let (group, offset) = self.group(t);
        let origin = *self.origin.get_or_insert(id - offset);
        if self.base[group] == UNSET {
            match u32::try_from(id - offset - origin) {
                Ok(base) if base != UNSET => self.base[group] = base,
                _ => {
                    self.others.insert(t, task);
                    return;
                }
            }
        }
        if origin + i64::from(self.base[group]) + offset == id {
            self.others.remove(&t);
        } else {
            self.others.insert(t, task);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: i64) -> TaskId {
        TaskId::new(n).unwrap()
    }

    #[test]
    fn row_ids_are_derived_where_consecutive_and_kept_where_not() {
        let g = Graph::of_text(
            "version: 1\nname: t\nitems: [{ id: a }, { id: b }, { id: c }]\nsteps:\n  - id: shot\n    generate: { prompt: p, n: 2 }\n  - id: big\n    upscale: { from: shot, desired_increase: 2 }\n",
        );
        let mut ids = RowIds::new(&g);
        assert!((0..g.len()).all(|t| ids.get(t).is_none()));
        let a = g.instance_tasks(Instance::Item(0));
        let b = g.instance_tasks(Instance::Item(1));
        // Item a recorded in one statement; item b's tasks interleaved with another run's.
        for (n, t) in a.clone().enumerate() {
            ids.set(t, id(10 + n as i64));
        }
        for (n, t) in b.clone().enumerate() {
            ids.set(t, id(50 + 2 * n as i64));
        }
        let got: Vec<Option<i64>> = (0..g.len()).map(|t| ids.get(t).map(TaskId::get)).collect();
        let none = None;
        let want = [10, 11, 12, 50, 52, 54].map(Some);
        assert_eq!(got, [&want[..], &[none; 3]].concat());
        assert_eq!(
            ids.others.len(),
            2,
            "only the ids off the pattern are kept one by one"
        );
        // Set again to the derived value: kept no more.
        ids.set(b.start + 1, id(51));
        assert_eq!((ids.get(b.start + 1), ids.others.len()), (Some(id(51)), 1));
        // Item c's ids lie below the first item's: held one by one, still right.
        let c = g.instance_tasks(Instance::Item(2));
        for (n, t) in c.clone().enumerate() {
            ids.set(t, id(1 + n as i64));
        }
        let got: Vec<Option<i64>> = c.map(|t| ids.get(t).map(TaskId::get)).collect();
        assert_eq!(got, [Some(1), Some(2), Some(3)]);
    }
}
