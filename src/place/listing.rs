//! Recorded objects compared with a listing of their bucket, instead of a request each: a
//! resume's check of the kept outputs and a report of a run in object storage both ask which
//! of the objects the state database recorded are still there as recorded.
//!
//! The recorded objects come in the order S3 lists keys in (their UTF-8 bytes), a page of
//! [`OBJECTS_PER_PAGE`] at a time, and each page is walked against a listing that starts just
//! before its first key, as the listing streams in: a page with no foreign key between its
//! objects is one request. Should the records come in another order, the walk passes objects
//! without seeing them: they are [`Seen::Unlisted`], which a caller never takes as there.

use std::cmp::Ordering;

use futures::StreamExt;

use super::{ObjectError, ObjectUrl, Objects};

/// Recorded objects a listing is compared with at once: a page of the listing. A run costs a
/// request per 1,000 objects, and one more for each page with other keys among its objects.
pub const OBJECTS_PER_PAGE: usize = 1_000;

/// Listed keys in a row that no recorded object has, after which the listing starts again
/// just before the next recorded key (one request) rather than read on: a run's `_thumbs/`,
/// an object per image, sorting between two items would otherwise cost as many pages as the
/// outputs themselves. A page's worth, so a jump never costs more requests than reading on.
const JUMP_AFTER: usize = 1_000;

/// A recorded object as the walk sees it.
pub trait Record {
    /// Its object's URL.
    fn url(&self) -> &ObjectUrl;
    /// Whether a listed object of this size and ETag is the one recorded.
    fn agrees(&self, bytes: u64, etag: Option<&str>) -> bool;
    fn bucket(&self) -> &str {
        &self.url().bucket
    }
    /// Its key in its bucket.
    fn key(&self) -> &str {
        &self.url().key
    }
}

/// How a recorded object showed in the listing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Seen {
    /// Not listed: missing, or the listing failed or passed it in another order.
    #[default]
    Unlisted,
    /// Listed with another size or ETag than recorded (or one recorded without an ETag).
    Other,
    /// Listed as recorded.
    Same,
}

/// Lists what lies under the objects' common directory, from just before the first object's
/// key to the last's (`group` sorted by key, all of one bucket), and says in `seen` how the
/// listing showed each. A listing that fails part way leaves the rest [`Seen::Unlisted`] and
/// says why.
pub async fn compare<R: Record>(group: &[R], seen: &mut [Seen]) -> Result<(), ObjectError> {
    let Some(first) = group.first() else {
        return Ok(());
    };
    let root = ObjectUrl {
        bucket: first.bucket().to_owned(),
        key: String::new(),
    };
    let (objects, _) = Objects::at(&root)?;
    let dir = common_dir(group);
    let mut walk = Walk::new(group, seen);
    let mut after = walk.start();
    loop {
        let listing = objects.list_after(dir, after.as_deref());
        let mut listing = std::pin::pin!(listing);
        let mut jump = None;
        while let Some(found) = listing.next().await {
            let found = found?;
            match walk.listed(&found.key, found.bytes, found.etag.as_deref()) {
                Step::More => {}
                Step::Done => return Ok(()),
                Step::JumpAfter(key) => {
                    jump = Some(key);
                    break;
                }
            }
        }
        match jump {
            Some(key) => after = Some(key),
            None => return Ok(()),
        }
    }
}

/// The directory all of `group`'s keys are in (sorted, so the first and the last tell);
/// `None` for the bucket's root.
fn common_dir<R: Record>(group: &[R]) -> Option<&str> {
    let (first, last) = (group.first()?.key(), group.last()?.key());
    let shared = first
        .bytes()
        .zip(last.bytes())
        .take_while(|(a, b)| a == b)
        .count();
    let dir = first[..shared].rfind('/').map(|at| &first[..at])?;
    (!dir.is_empty()).then_some(dir)
}

/// What the walk wants of the listing next.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    More,
    /// Every recorded object was passed: the rest of the listing is of no interest.
    Done,
    /// Many keys in a row were not recorded objects: list again from after this key.
    JumpAfter(String),
}

/// The listing (sorted by key) walked against the recorded objects (sorted the same way).
struct Walk<'a, R> {
    recorded: &'a [R],
    /// How each recorded object was listed.
    seen: &'a mut [Seen],
    /// The first recorded object the listing has not reached yet.
    next: usize,
    /// Listed keys in a row that are no recorded object.
    foreign: usize,
}

impl<'a, R: Record> Walk<'a, R> {
    fn new(recorded: &'a [R], seen: &'a mut [Seen]) -> Self {
        Walk {
            recorded,
            seen,
            next: 0,
            foreign: 0,
        }
    }

    /// Where the listing starts: just before the first recorded key.
    fn start(&self) -> Option<String> {
        self.recorded.first().and_then(|r| just_before(r.key()))
    }

    /// Takes the next listed object. A recorded object whose key the listing passed without
    /// showing it stays unlisted: it is missing, or the store lists in another order.
    fn listed(&mut self, key: &str, bytes: u64, etag: Option<&str>) -> Step {
        let mut found = false;
        while let Some(r) = self.recorded.get(self.next) {
            match r.key().cmp(key) {
                Ordering::Less => self.next += 1,
                Ordering::Equal => {
                    self.seen[self.next] = if r.agrees(bytes, etag) {
                        Seen::Same
                    } else {
                        Seen::Other
                    };
                    self.next += 1;
                    found = true;
                }
                Ordering::Greater if found => {
                    self.foreign = 0;
                    return Step::More;
                }
                Ordering::Greater => {
                    self.foreign += 1;
                    if self.foreign < JUMP_AFTER {
                        return Step::More;
                    }
                    self.foreign = 0;
                    return match just_before(r.key()) {
                        Some(after) if after.as_str() > key => Step::JumpAfter(after),
                        _ => Step::More,
                    };
                }
            }
        }
        Step::Done
    }
}

/// A key that sorts just before `key` (`key` less its last character), so a listing that
/// starts after it starts at `key`; `None` when that is the empty key.
fn just_before(key: &str) -> Option<String> {
    let (last, _) = key.char_indices().last()?;
    (last > 0).then(|| key[..last].to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::place::same_etag;

    /// A recorded output: its URL, size and ETag.
    struct Rec(ObjectUrl, u64, Option<&'static str>);

    impl Record for Rec {
        fn url(&self) -> &ObjectUrl {
            &self.0
        }

        fn agrees(&self, bytes: u64, etag: Option<&str>) -> bool {
            let etags = self.2.zip(etag);
            etags.is_some_and(|(a, b)| same_etag(a, b)) && bytes == self.1
        }
    }

    fn rec(key: &str, bytes: u64, etag: Option<&'static str>) -> Rec {
        let url = ObjectUrl::parse(&format!("s3://bkt/{key}"))
            .unwrap()
            .unwrap();
        Rec(url, bytes, etag)
    }

    /// Walks `recorded` against a store holding `listing` (sorted), answering lists `page`
    /// keys at a time as S3 does; returns which outputs were listed as recorded and the
    /// number of list requests.
    fn walk(recorded: &[Rec], listing: &[(String, u64, &str)], page: usize) -> (Vec<bool>, usize) {
        let mut seen = vec![Seen::Unlisted; recorded.len()];
        let mut walk = Walk::new(recorded, &mut seen);
        let mut after = walk.start();
        let mut requests = 0;
        'listing: loop {
            let mut rest = listing
                .iter()
                .filter(|(k, ..)| after.as_deref().is_none_or(|a| k.as_str() > a))
                .peekable();
            while rest.peek().is_some() {
                requests += 1;
                for (key, bytes, etag) in rest.by_ref().take(page) {
                    match walk.listed(key, *bytes, Some(etag)) {
                        Step::More => {}
                        Step::Done => break 'listing,
                        Step::JumpAfter(key) => {
                            after = Some(key);
                            continue 'listing;
                        }
                    }
                }
            }
            break;
        }
        (seen.iter().map(|s| *s == Seen::Same).collect(), requests)
    }

    #[test]
    fn only_the_outputs_the_listing_shows_as_recorded_are_kept_without_a_look() {
        let recorded = [
            rec("runs/r/a/shot.png", 10, Some("\"e1\"")),
            rec("runs/r/b/shot.png", 10, Some("\"e2\"")),
            rec("runs/r/c/shot.png", 10, Some("\"e3\"")),
            rec("runs/r/d/shot.png", 10, Some("\"e4\"")),
            rec("runs/r/e/shot.png", 10, None),
            rec("runs/r/f/shot.png", 10, Some("W/\"e6\"")),
            rec("runs/r/g/shot.png", 10, Some("e7")),
        ];
        let listing: Vec<(String, u64, &str)> = [
            ("runs/r/_thumbs/x.png", 3, "\"t\""),
            ("runs/r/a/shot.png", 10, "\"e1\""),
            // b is missing; c has other bytes of the same size; d another size.
            ("runs/r/c/shot.png", 10, "\"other\""),
            ("runs/r/d/shot.png", 11, "\"e4\""),
            ("runs/r/e/shot.png", 10, "\"e5\""),
            ("runs/r/f/shot.png", 10, "W/\"e6\""),
            ("runs/r/g/shot.png", 10, "\"e7\""),
            ("runs/r/manifest.jsonl", 1, "\"m\""),
        ]
        .iter()
        .map(|(k, b, e)| ((*k).to_owned(), *b, *e))
        .collect();
        let (same, requests) = walk(&recorded, &listing, 1000);
        assert_eq!(same, [true, false, false, false, false, false, true]);
        assert_eq!(requests, 1);
        assert_eq!(common_dir(&recorded), Some("runs/r"));
        assert_eq!(common_dir(&recorded[..1]), Some("runs/r/a"));
    }

    #[test]
    fn a_listing_is_a_request_a_page_and_jumps_over_what_is_not_the_runs_outputs() {
        let key = |i: usize| format!("runs/r/i{i:05}/shot.png");
        let recorded: Vec<Rec> = (0..2_500).map(|i| rec(&key(i), 7, Some("\"e\""))).collect();
        let mut listing: Vec<(String, u64, &str)> =
            (0..2_500).map(|i| (key(i), 7, "\"e\"")).collect();
        let (same, requests) = walk(&recorded, &listing, 1000);
        assert!(same.iter().all(|s| *s));
        assert_eq!(requests, 3, "2,500 keys, 1,000 a page");
        // 10,000 thumbnails between two items, and as many after the last: a jump over the
        // first run of them, and the listing stops at the last recorded key.
        listing.extend((0..10_000).map(|i| (format!("runs/r/i00100/t{i:05}"), 1, "\"t\"")));
        listing.extend((0..10_000).map(|i| (format!("runs/r/z{i:05}"), 1, "\"t\"")));
        listing.sort();
        let (same, requests) = walk(&recorded, &listing, 1000);
        assert!(same.iter().all(|s| *s));
        assert_eq!(
            requests, 5,
            "3 pages of outputs, one of thumbnails, one jump"
        );
        // Lost from the listing in the middle of a page: only that one is left to a look.
        listing.retain(|(k, ..)| k != &key(1_234));
        let (same, _) = walk(&recorded, &listing, 1000);
        let unseen: Vec<usize> = (0..same.len()).filter(|i| !same[*i]).collect();
        assert_eq!(unseen, [1_234]);
    }

    #[test]
    fn pages_listed_side_by_side_cost_a_request_each_and_one_more_with_other_keys_among_them() {
        let key = |i: usize| format!("runs/r/i{i:06}/shot.png");
        let n = 95_000;
        let recorded: Vec<Rec> = (0..n).map(|i| rec(&key(i), 7, Some("\"e\""))).collect();
        let mut listing: Vec<(String, u64, &str)> = (0..n).map(|i| (key(i), 7, "\"e\"")).collect();
        let requests = |listing: &[(String, u64, &str)]| {
            let mut requests = 0;
            for page in recorded.chunks(OBJECTS_PER_PAGE) {
                let (same, r) = walk(page, listing, 1000);
                assert!(same.iter().all(|s| *s));
                requests += r;
            }
            requests
        };
        assert_eq!(requests(&listing), n / 1000, "a request a page");
        // Other keys among the outputs of three pages: a request more for each.
        for i in [10, 20_500, 94_998] {
            listing.push((format!("{}.txt", key(i)), 1, "\"t\""));
        }
        listing.sort();
        assert_eq!(requests(&listing), n / 1000 + 3);
    }

    #[test]
    fn a_listing_starts_just_before_a_key() {
        assert_eq!(just_before("a/b.png").as_deref(), Some("a/b.pn"));
        assert_eq!(just_before("a/é").as_deref(), Some("a/"));
        assert_eq!(just_before("a"), None);
        assert_eq!(rec("a/b", 1, None).bucket(), "bkt");
        assert_eq!(rec("a/b", 1, None).key(), "a/b");
    }
}
