//! Readiness: the tasks ready to be sent, those of chains already admitted apart from those
//! of chains not admitted yet. The latter are, at the start of a large run, one an item (its
//! first step), so a set of them is held as one bit a task rather than a tree node each
//! (a `BTreeSet<usize>` of a million tasks was 20 MB; this is 1.1 MB at 9,000,000 tasks).

use std::collections::BTreeSet;
use std::ops::Range;

use crate::plan::graph::Instance;

/// The ready tasks, and which chains (the batch's, each item's) are admitted. Task numbers
/// order them depth-first (instance, step, index).
pub(super) struct Readiness {
    /// Ready tasks of admitted chains.
    admitted: BTreeSet<usize>,
    /// Ready tasks of chains not admitted yet.
    new: ReadySet,
    batch_admitted: bool,
    items_admitted: Vec<bool>,
}

impl Readiness {
    pub(super) fn new(tasks: usize, items: usize) -> Readiness {
        Readiness {
            admitted: BTreeSet::new(),
            new: ReadySet::new(tasks),
            batch_admitted: false,
            items_admitted: vec![false; items],
        }
    }

    pub(super) fn is_admitted(&self, instance: Instance) -> bool {
        match instance {
            Instance::Batch => self.batch_admitted,
            Instance::Item(i) => self.items_admitted.get(i).copied().unwrap_or(false),
        }
    }

    /// Task `t` of `instance` is ready.
    pub(super) fn push(&mut self, t: usize, instance: Instance) {
        if self.is_admitted(instance) {
            self.admitted.insert(t);
        } else {
            self.new.insert(t);
        }
    }

    /// Task `t` is ready no more (sent, or blocked).
    pub(super) fn remove(&mut self, t: usize) {
        self.admitted.remove(&t);
        self.new.remove(t);
    }

    /// Task `t` of an admitted chain was sent.
    pub(super) fn sent(&mut self, t: usize) {
        self.admitted.remove(&t);
    }

    /// The ready tasks of admitted chains, in depth-first order.
    pub(super) fn admitted(&self) -> impl Iterator<Item = usize> + '_ {
        self.admitted.iter().copied()
    }

    /// The first ready task of a chain not admitted yet: the next chain to admit.
    pub(super) fn first_new(&mut self) -> Option<usize> {
        self.new.first()
    }

    /// Admits `instance`, whose tasks are `tasks`: its ready tasks may be sent.
    pub(super) fn admit(&mut self, instance: Instance, tasks: Range<usize>) {
        match instance {
            Instance::Batch => self.batch_admitted = true,
            Instance::Item(i) => self.items_admitted[i] = true,
        }
        for t in self.new.in_range(tasks) {
            self.new.remove(t);
            self.admitted.insert(t);
        }
    }
}

struct ReadySet {
    bits: Vec<u64>,
    /// No task below this is in the set: where the search for the first one starts.
    floor: usize,
}

impl ReadySet {
    fn new(tasks: usize) -> ReadySet {
        ReadySet {
            bits: vec![0; tasks.div_ceil(64)],
            floor: 0,
        }
    }

    fn insert(&mut self, t: usize) {
        self.bits[t / 64] |= 1 << (t % 64);
        self.floor = self.floor.min(t);
    }

    fn remove(&mut self, t: usize) {
        self.bits[t / 64] &= !(1 << (t % 64));
    }

    /// The lowest task in the set. The search starts where the last one ended, so walking
    /// the set from the front costs a word a 64 tasks in all.
    fn first(&mut self) -> Option<usize> {
        let mut word = self.floor / 64;
        while let Some(&bits) = self.bits.get(word) {
            if bits != 0 {
                let t = word * 64 + bits.trailing_zeros() as usize;
                self.floor = t;
                return Some(t);
            }
            word += 1;
        }
        self.floor = self.bits.len() * 64;
        None
    }

    /// The tasks of the set within `range`, in order.
    fn in_range(&self, range: Range<usize>) -> Vec<usize> {
        range
            .filter(|t| self.bits[t / 64] & (1 << (t % 64)) != 0)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_task_is_found_after_removals_and_inserts_below_it() {
        let mut s = ReadySet::new(200);
        assert_eq!(s.first(), None);
        for t in [5, 70, 130, 199] {
            s.insert(t);
        }
        assert_eq!(s.first(), Some(5));
        s.remove(5);
        assert_eq!(s.first(), Some(70));
        s.insert(3);
        assert_eq!(s.first(), Some(3));
        assert_eq!(s.in_range(60..140), vec![70, 130]);
        for t in [3, 70, 130, 199] {
            s.remove(t);
        }
        assert_eq!(s.first(), None);
        s.insert(0);
        assert_eq!(s.first(), Some(0));
    }
}
