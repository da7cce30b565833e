//! Items by id: the check that no two items share one (case-insensitively, as they name
//! directories), and the index that finds an item by its id.
//!
//! Both work on a 64-bit hash of each lowercased id, sorted, so neither holds the ids' strings.
//! While items are read only the hashes are kept (8 bytes an item); the duplicates are found
//! once every item is in, by sorting. The index is not kept after that: only a resume looks
//! items up by id (its records name them), so it is built again on the first lookup, and a
//! run from scratch of a million items holds none of its 12 MB.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};

use super::store::Store;
use crate::pipeline::yaml::Mark;

/// The hash an id is found by.
pub(super) fn hash(id: &str) -> u64 {
    let mut h = DefaultHasher::new();
    id.to_lowercase().hash(&mut h);
    h.finish()
}

/// The index: rows sorted by the hash of their id (rows in order where hashes are equal).
#[derive(Debug, Default)]
pub(super) struct IdIndex {
    /// Two lists, not a list of pairs: a pair pads to 16 bytes.
    hashes: Vec<u64>,
    rows: Vec<u32>,
}

impl IdIndex {
    /// The index of rows whose ids hash to `hashes[row]`.
    fn sorted(hashes: Vec<u64>) -> IdIndex {
        let mut rows: Vec<u32> = (0..hashes.len())
            .map(|r| u32::try_from(r).expect("rows are counted in u32 (see `Builder::push`)"))
            .collect();
        rows.sort_unstable_by_key(|&r| (hashes[r as usize], r));
        let mut sorted = Vec::with_capacity(hashes.len());
        sorted.extend(rows.iter().map(|&r| hashes[r as usize]));
        IdIndex {
            hashes: sorted,
            rows,
        }
    }

    /// The index of every item in `rows`, read from the store.
    pub(super) fn of(rows: &Store) -> IdIndex {
        IdIndex::sorted(rows.ids().map(|id| hash(&id)).collect())
    }

    /// The rows whose ids hash as `id` does, first row first.
    fn candidates(&self, id_hash: u64) -> impl Iterator<Item = usize> + '_ {
        let from = self.hashes.partition_point(|&h| h < id_hash);
        let to = from + self.hashes[from..].partition_point(|&h| h == id_hash);
        self.rows[from..to].iter().map(|&r| r as usize)
    }

    /// The first row whose id is `id` but for case.
    pub(super) fn find(&self, id: &str, rows: &Store) -> Option<usize> {
        self.find_hashed(hash(id), id, rows)
    }

    fn find_hashed(&self, id_hash: u64, id: &str, rows: &Store) -> Option<usize> {
        let lower = id.to_lowercase();
        self.candidates(id_hash).find(|&row| {
            rows.id(row)
                .is_some_and(|other| other.to_lowercase() == lower)
        })
    }
}

/// An id found again: `row`'s id is the one of `first`, an earlier row, but for case.
pub(super) struct Duplicate {
    pub row: usize,
    pub first: usize,
    /// Where `row`'s id is written, when not where its item is.
    pub id_mark: Option<Mark>,
}

/// The hashes of the ids as the items are read, to find the duplicates once all are in.
#[derive(Default)]
pub(super) struct Seen {
    hashes: Vec<u64>,
    /// Where an id is written, for the rows where that is not where its item is (an inline
    /// item's `id:` line): a duplicate is shown there.
    marks: HashMap<usize, Mark>,
}

impl Seen {
    /// Adds the id of the next row, written at `mark` (`None`: where the item is).
    pub(super) fn push(&mut self, id: &str, mark: Option<Mark>) {
        if let Some(mark) = mark {
            self.marks.insert(self.hashes.len(), mark);
        }
        self.hashes.push(hash(id));
    }

    /// Every row whose id an earlier row has (but for case), in row order.
    pub(super) fn duplicates(self, rows: &Store) -> Vec<Duplicate> {
        let marks = self.marks;
        let index = IdIndex::sorted(self.hashes);
        let mut found = Vec::new();
        let mut at = 0;
        while at < index.hashes.len() {
            let same = index.hashes[at..].partition_point(|&h| h == index.hashes[at]);
            if same > 1 {
                let group = &index.rows[at..at + same];
                let ids: Vec<Option<String>> = group
                    .iter()
                    .map(|&r| rows.id(r as usize).map(|id| id.to_lowercase()))
                    .collect();
                for (j, id) in ids.iter().enumerate().skip(1) {
                    let first = ids[..j]
                        .iter()
                        .position(|other| other.is_some() && other == id);
                    if let Some(i) = first {
                        let row = group[j] as usize;
                        found.push(Duplicate {
                            row,
                            first: group[i] as usize,
                            id_mark: marks.get(&row).copied(),
                        });
                    }
                }
            }
            at += same;
        }
        found.sort_unstable_by_key(|d| d.row);
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::items::Item;

    fn store(ids: &[&str]) -> Store {
        let mut store = Store::default();
        for (line, id) in ids.iter().enumerate() {
            let item = Item {
                id: (*id).to_owned(),
                values: Box::new([]),
                mark: Mark {
                    line: line + 1,
                    col: 1,
                },
            };
            store.push(&item).unwrap();
        }
        store
    }

    #[test]
    fn ids_whose_hashes_clash_are_told_apart_by_their_text() {
        let rows = store(&["a", "B", "c", "b"]);
        // Every id made to hash alike: only the ids' text can tell them apart.
        let index = IdIndex::sorted(vec![7; 4]);
        assert_eq!(index.find_hashed(7, "c", &rows), Some(2));
        assert_eq!(
            index.find_hashed(7, "b", &rows),
            Some(1),
            "the first row, but for case"
        );
        assert_eq!(index.find_hashed(7, "d", &rows), None);
        let seen = Seen {
            hashes: vec![7; 4],
            marks: HashMap::from([(3, Mark { line: 9, col: 3 })]),
        };
        let found = seen.duplicates(&rows);
        assert_eq!(found.len(), 1);
        assert_eq!((found[0].row, found[0].first), (3, 1));
        assert_eq!(found[0].id_mark, Some(Mark { line: 9, col: 3 }));
    }
}
