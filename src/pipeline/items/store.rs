//! Where the items live while a run goes: encoded one after another, in memory while they are
//! few and in an unlinked temporary file once they pass [`SPILL_AT`], so a batch of a million
//! items holds an offset per item in memory rather than every id and field as strings. An item
//! is decoded again each time a task of it is rendered, which is once per task sent.
//!
//! The temporary file has no name (it is gone when the process ends, however it ends) and is
//! written once, before the first read. Reading it back can fail only if the disk under the
//! temporary directory fails; imgpipe then stops with that error, as it would if memory failed:
//! everything a run did is already in the state database, so the run can be continued.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;

use crate::pipeline::yaml::Mark;

use super::Item;

/// Bytes of encoded items kept in memory before they move to a temporary file.
const SPILL_AT: usize = 1 << 20;
/// Bytes gathered in memory between writes to the temporary file.
const WRITE_AT: usize = 256 << 10;

#[derive(Debug, Default)]
pub(super) struct Store {
    /// Where each item starts; it ends where the next starts, or at `len`.
    starts: Starts,
    len: u64,
    /// The bytes not yet in the file: all of them while `file` is `None`.
    tail: Vec<u8>,
    file: Option<File>,
}

impl Store {
    pub(super) fn len(&self) -> usize {
        self.starts.len()
    }

    pub(super) fn push(&mut self, item: &Item) -> std::io::Result<()> {
        self.starts.push(self.len);
        let before = self.tail.len();
        encode(item, &mut self.tail);
        self.len += (self.tail.len() - before) as u64;
        let bound = if self.file.is_some() {
            WRITE_AT
        } else {
            SPILL_AT
        };
        if self.tail.len() >= bound {
            self.flush()?;
        }
        Ok(())
    }

    /// Moves the tail to the file, creating the file on the first call.
    pub(super) fn flush(&mut self) -> std::io::Result<()> {
        let file = match &mut self.file {
            Some(file) => file,
            None => self.file.insert(tempfile::tempfile()?),
        };
        file.write_all(&self.tail)?;
        self.tail.clear();
        self.tail.shrink_to(WRITE_AT);
        Ok(())
    }

    /// Once every item is in: the memory of a store that spilled is its offsets alone.
    pub(super) fn finish(&mut self) -> std::io::Result<()> {
        if self.file.is_some() {
            self.flush()?;
            self.tail = Vec::new();
        } else {
            self.tail.shrink_to_fit();
        }
        self.starts.shrink_to_fit();
        Ok(())
    }

    #[cfg(test)]
    pub(super) fn spilled(&self) -> bool {
        self.file.is_some()
    }

    /// Item `i`, decoded.
    pub(super) fn get(&self, i: usize) -> Option<Item> {
        self.with_bytes(i, decode)
    }

    /// Item `i`'s id alone (encoded first), for the many places that name its directory.
    pub(super) fn id(&self, i: usize) -> Option<String> {
        self.with_bytes(i, |bytes| Reader(bytes).string())
    }

    fn with_bytes<T>(&self, i: usize, f: impl FnOnce(&[u8]) -> T) -> Option<T> {
        let start = self.starts.get(i)?;
        let end = self.starts.get(i + 1).unwrap_or(self.len);
        let mut buf = Vec::new();
        Some(f(self.bytes(start, end, &mut buf)))
    }

    /// Items `from..` in order, read from the file in large blocks rather than one by one.
    pub(super) fn iter_from(&self, from: usize) -> Iter<'_, Item> {
        Iter {
            store: self,
            next: from,
            block: Vec::new(),
            block_start: 0,
            decode,
        }
    }

    /// Every item's id in order, read as [`Store::iter_from`] reads items, their fields left
    /// encoded.
    pub(super) fn ids(&self) -> Iter<'_, String> {
        Iter {
            store: self,
            next: 0,
            block: Vec::new(),
            block_start: 0,
            decode: |bytes| Reader(bytes).string(),
        }
    }

    /// The bytes `start..end`, from the tail or the file (an item is wholly in one of them).
    fn bytes<'a>(&'a self, start: u64, end: u64, buf: &'a mut Vec<u8>) -> &'a [u8] {
        let in_file = self.len - self.tail.len() as u64;
        if start >= in_file {
            return &self.tail[(start - in_file) as usize..(end - in_file) as usize];
        }
        buf.resize((end - start) as usize, 0);
        self.read_at(buf, start);
        buf
    }

    fn read_at(&self, buf: &mut [u8], at: u64) {
        let file = self
            .file
            .as_ref()
            .expect("bytes before the tail are in the file");
        if let Err(e) = file.read_exact_at(buf, at) {
            // See the module's comment: this is the disk failing, like memory failing.
            panic!("cannot read the items back from their temporary file: {e}");
        }
    }
}

pub(super) struct Iter<'a, T> {
    store: &'a Store,
    next: usize,
    block: Vec<u8>,
    /// Where `block` starts in the store.
    block_start: u64,
    /// What is read of each item.
    decode: fn(&[u8]) -> T,
}

impl<T> Iterator for Iter<'_, T> {
    type Item = T;

    fn next(&mut self) -> Option<T> {
        let decode = self.decode;
        let store = self.store;
        let start = store.starts.get(self.next)?;
        let end = store.starts.get(self.next + 1).unwrap_or(store.len);
        self.next += 1;
        let in_file = store.len - store.tail.len() as u64;
        if start >= in_file {
            return Some(decode(
                &store.tail[(start - in_file) as usize..(end - in_file) as usize],
            ));
        }
        let block_end = self.block_start + self.block.len() as u64;
        if start < self.block_start || end > block_end {
            let want = (end - start).max(WRITE_AT as u64).min(in_file - start);
            self.block.resize(want.max(end - start) as usize, 0);
            self.block_start = start;
            store.read_at(&mut self.block, start);
        }
        let at = (start - self.block_start) as usize;
        Some(decode(&self.block[at..at + (end - start) as usize]))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.store.len().saturating_sub(self.next);
        (left, Some(left))
    }
}

impl<T> ExactSizeIterator for Iter<'_, T> {}

/// Lengths and numbers as LEB128, strings as their length then their bytes.
fn put_number(mut n: u64, out: &mut Vec<u8>) {
    loop {
        let byte = (n & 0x7f) as u8;
        n >>= 7;
        if n == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

fn put_str(s: &str, out: &mut Vec<u8>) {
    put_number(s.len() as u64, out);
    out.extend_from_slice(s.as_bytes());
}

fn encode(item: &Item, out: &mut Vec<u8>) {
    put_str(&item.id, out);
    put_number(item.mark.line as u64, out);
    put_number(item.mark.col as u64, out);
    put_number(item.values.len() as u64, out);
    for value in &item.values {
        match value {
            None => out.push(0),
            Some(v) => {
                out.push(1);
                put_str(v, out);
            }
        }
    }
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn number(&mut self) -> u64 {
        let mut n = 0u64;
        for (i, byte) in self.0.iter().enumerate() {
            n |= u64::from(byte & 0x7f) << (7 * i);
            if byte & 0x80 == 0 {
                self.0 = &self.0[i + 1..];
                return n;
            }
        }
        unreachable!("an item is decoded from the bytes encode wrote")
    }

    fn string(&mut self) -> String {
        let len = self.number() as usize;
        let (s, rest) = self.0.split_at(len);
        self.0 = rest;
        // Written from a `str` by `encode`: the check passes, and is cheap.
        match std::str::from_utf8(s) {
            Ok(s) => s.to_owned(),
            Err(_) => String::from_utf8_lossy(s).into_owned(),
        }
    }
}

fn decode(bytes: &[u8]) -> Item {
    let mut r = Reader(bytes);
    let id = r.string();
    let line = r.number() as usize;
    let col = r.number() as usize;
    let n = r.number() as usize;
    let values = (0..n)
        .map(|_| {
            let (&tag, rest) = r.0.split_first().expect("a value's tag");
            r.0 = rest;
            (tag == 1).then(|| r.string().into_boxed_str())
        })
        .collect();
    Item {
        id,
        values,
        mark: Mark { line, col },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(i: usize) -> Item {
        Item {
            id: format!("sku-{i}"),
            values: vec![
                Some(format!("a value of item {i}, é ✓").into_boxed_str()),
                None,
                Some("x".repeat(i % 300).into_boxed_str()),
            ]
            .into_boxed_slice(),
            mark: Mark {
                line: i + 1,
                col: 1 + i % 3,
            },
        }
    }

    #[test]
    fn items_come_back_the_same_before_and_after_the_spill() {
        let mut store = Store::default();
        let n = 12_000;
        for i in 0..n {
            store.push(&item(i)).unwrap();
        }
        assert!(store.file.is_some(), "{n} items pass the spill threshold");
        store.finish().unwrap();
        assert!(store.tail.is_empty());
        for i in [0, 1, 777, n / 2, n - 1] {
            let got = store.get(i).unwrap();
            let want = item(i);
            assert_eq!(
                (got.id, got.values, got.mark),
                (want.id, want.values, want.mark)
            );
        }
        assert!(store.get(n).is_none());
        let all: Vec<Item> = store.iter_from(0).collect();
        assert_eq!(all.len(), n);
        assert!(
            all.iter()
                .enumerate()
                .all(|(i, it)| it.id == format!("sku-{i}")
                    && it.values[2].as_deref().map(str::len) == Some(i % 300))
        );
        assert_eq!(store.iter_from(n - 2).count(), 2);
    }

    #[test]
    fn a_small_batch_stays_in_memory() {
        let mut store = Store::default();
        for i in 0..10 {
            store.push(&item(i)).unwrap();
        }
        store.finish().unwrap();
        assert!(store.file.is_none());
        assert_eq!(store.get(9).unwrap().id, "sku-9");
        assert_eq!(
            store.iter_from(3).map(|i| i.id).collect::<Vec<_>>().len(),
            7
        );
    }
}

/// Items' start offsets, 4 bytes an item: the low 32 bits of each, and where the high bits
/// change (every 4 GiB of encoded items). A `Vec<u64>` was 8 MB at 1,000,000 items.
#[derive(Debug, Default)]
struct Starts {
    low: Vec<u32>,
    /// `(first item, high bits)`, from the first item whose offset has those high bits.
    high: Vec<(usize, u32)>,
}

impl Starts {
    fn len(&self) -> usize {
        self.low.len()
    }

    fn push(&mut self, offset: u64) {
        let (high, low) = ((offset >> 32) as u32, offset as u32);
        if self.high.last().map_or(0, |(_, h)| *h) != high {
            self.high.push((self.low.len(), high));
        }
        self.low.push(low);
    }

    fn get(&self, i: usize) -> Option<u64> {
        let low = *self.low.get(i)?;
        let at = self.high.partition_point(|(first, _)| *first <= i);
        let high = at.checked_sub(1).map_or(0, |a| self.high[a].1);
        Some(u64::from(high) << 32 | u64::from(low))
    }

    fn shrink_to_fit(&mut self) {
        self.low.shrink_to_fit();
        self.high.shrink_to_fit();
    }
}

#[cfg(test)]
mod starts_tests {
    use super::Starts;

    #[test]
    fn offsets_past_4_gib_read_back_whole() {
        let offsets = [
            0,
            10,
            (1 << 32) - 1,
            1 << 32,
            (1 << 32) + 7,
            9 << 32,
            (9 << 32) + 1,
        ];
        let mut s = Starts::default();
        for o in offsets {
            s.push(o);
        }
        let back: Vec<u64> = (0..offsets.len()).map(|i| s.get(i).unwrap()).collect();
        assert_eq!(back, offsets);
        assert_eq!((s.len(), s.get(offsets.len())), (offsets.len(), None));
    }
}
