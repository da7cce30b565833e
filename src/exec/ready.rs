//! The ready tasks of chains not admitted yet: at the start of a large run, one a item (its
//! first step), so a set of them is held as one bit a task rather than a tree node each
//! (a `BTreeSet<usize>` of a million tasks was 20 MB; this is 1.1 MB at 9,000,000 tasks).

use std::ops::Range;

pub(super) struct ReadySet {
    bits: Vec<u64>,
    /// No task below this is in the set: where the search for the first one starts.
    floor: usize,
}

impl ReadySet {
    pub(super) fn new(tasks: usize) -> ReadySet {
        ReadySet {
            bits: vec![0; tasks.div_ceil(64)],
            floor: 0,
        }
    }

    pub(super) fn insert(&mut self, t: usize) {
        self.bits[t / 64] |= 1 << (t % 64);
        self.floor = self.floor.min(t);
    }

    pub(super) fn remove(&mut self, t: usize) {
        self.bits[t / 64] &= !(1 << (t % 64));
    }

    /// The lowest task in the set. The search starts where the last one ended, so walking
    /// the set from the front costs a word a 64 tasks in all.
    pub(super) fn first(&mut self) -> Option<usize> {
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
    pub(super) fn in_range(&self, range: Range<usize>) -> Vec<usize> {
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
