//! Resuming a run whose outputs are in object storage: what [`super::check`] does with files,
//! done with objects. The run's prefix is listed (a request a page of 1,000 keys) and each
//! recorded object compared with the listing by its key, size and the ETag the store gave it at
//! upload; only an object the listing does not show as recorded (missing, another size or
//! ETag, or recorded before ETags were kept) is looked at by itself: a HEAD (its size and the
//! sha256 kept in its metadata), and its bytes when those do not agree with the record. A
//! modified object is copied, create-only, to its `_superseded/` key before it is removed, so
//! the user's bytes are never lost.
//!
//! Memory: the recorded objects come from the state database in the order S3 lists keys in
//! (their UTF-8 bytes), a page of 1,000 at a time ([`OBJECTS_PER_PAGE`]), and each page is
//! walked against a listing that starts just before its first key, as the listing streams in:
//! a page of recorded objects and a page of the listing in memory for each page being checked
//! (16 at once, [`super::check`]), a byte per output of it (whether the listing showed it as
//! recorded), and the HEADs of those it did not. Nothing is held for the run as a whole but
//! the outputs that differ. Should the database give keys in another order, the walk passes
//! outputs without seeing them: they are looked at one by one, never taken as kept.

use std::cmp::Ordering;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicUsize};

use futures::StreamExt;
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;

use super::check::Differs;
use crate::place::{ObjectError, ObjectUrl, Objects, Stat, same_etag};

/// What the object of a recorded output is now.
enum Checked {
    /// As recorded.
    Same,
    Missing,
    /// Other bytes, of this sha256.
    Modified(String),
}

/// Compares the object at `url` with the recorded sha256 and size. A store that cannot be
/// reached says nothing for sure: the output is then fetched again, which is free and, the
/// object being create-only, harmless.
async fn check(url: &ObjectUrl, sha256: &str, bytes: Option<u64>) -> Checked {
    let found = async {
        let (objects, key) = Objects::at(url)?;
        let stat = objects.stat(&key).await?;
        let Some(Stat {
            bytes: size,
            sha256: meta,
            ..
        }) = stat
        else {
            return Ok(Checked::Missing);
        };
        let meta_agrees = meta.is_some_and(|m| m.eq_ignore_ascii_case(sha256));
        if meta_agrees && bytes.is_none_or(|b| b == size) {
            return Ok(Checked::Same);
        }
        // Metadata can be copied along with other bytes, or lost: the bytes decide.
        Ok(match objects.read(&key).await? {
            None => Checked::Missing,
            Some(body) => {
                let actual = hex::encode(Sha256::digest(&body));
                if actual == sha256 {
                    Checked::Same
                } else {
                    Checked::Modified(actual)
                }
            }
        })
    };
    match found.await {
        Ok(checked) => checked,
        Err(e) => {
            let e: ObjectError = e;
            tracing::warn!("cannot check {url}: {e}; it is fetched again");
            Checked::Missing
        }
    }
}

/// HEADs at once when a resume checks a run's objects: one at a time, a run of 100,000
/// outputs would wait minutes on round trips alone.
const CHECKS_IN_FLIGHT: usize = 16;

/// Listed keys in a row that no recorded output has, after which the listing starts again
/// just before the next recorded key (one request) rather than read on: a run's `_thumbs/`,
/// an object per image, sorting between two items would otherwise cost as many pages as the
/// outputs themselves. A page's worth, so a jump never costs more requests than reading on.
const JUMP_AFTER: usize = 1_000;

/// Recorded objects a listing is compared with at once: a page of the listing. The run's
/// objects come from the state database in key order, a page's worth at a time, and each is
/// listed from just before its first key to its last: a page with no foreign key between its
/// outputs is one request, so a run costs a request per 1,000 outputs, and one more for each
/// page with other keys among its outputs.
pub(super) const OBJECTS_PER_PAGE: usize = 1_000;

/// A recorded object of a kept task, as the check needs it.
pub(super) struct Recorded {
    pub id: i64,
    pub url: ObjectUrl,
    pub sha256: String,
    pub bytes: Option<u64>,
    /// The ETag the store gave it at upload, when one was kept.
    pub etag: Option<String>,
}

/// Compares pages of recorded objects with the store: listings side by side (one per page
/// being checked), and HEADs for what the listings do not show as recorded, at most
/// [`CHECKS_IN_FLIGHT`] at once across the pages.
pub(super) struct Checker {
    looks: Semaphore,
    recorded: AtomicUsize,
    listed_same: AtomicUsize,
    /// A listing failed: said once, not once per page.
    warned: AtomicBool,
}

impl Checker {
    pub(super) fn new() -> Checker {
        Checker {
            looks: Semaphore::new(CHECKS_IN_FLIGHT),
            recorded: AtomicUsize::new(0),
            listed_same: AtomicUsize::new(0),
            warned: AtomicBool::new(false),
        }
    }

    /// The outputs of `page` (one bucket's, in key order) whose object is missing or
    /// modified.
    pub(super) async fn check(&self, page: Vec<Recorded>) -> Vec<Differs> {
        let mut same = vec![false; page.len()];
        if page.iter().any(|o| o.etag.is_some()) {
            self.compare_with_listing(&page, &mut same).await;
        }
        let listed = same.iter().filter(|s| **s).count();
        self.recorded.fetch_add(page.len(), Relaxed);
        self.listed_same.fetch_add(listed, Relaxed);
        futures::stream::iter(page.into_iter().zip(same).filter(|(_, same)| !same))
            .map(|(o, _)| async move {
                let _look = self.looks.acquire().await;
                let modified = match check(&o.url, &o.sha256, o.bytes).await {
                    Checked::Same => return None,
                    Checked::Missing => None,
                    Checked::Modified(actual) => Some(actual),
                };
                Some(Differs { id: o.id, modified })
            })
            .buffer_unordered(CHECKS_IN_FLIGHT)
            .filter_map(std::future::ready)
            .collect()
            .await
    }

    /// Says how many objects the listings settled.
    pub(super) fn summary(&self) {
        tracing::debug!(
            "{} of {} recorded objects are in the listing as recorded; the others are looked at one by one",
            self.listed_same.load(Relaxed),
            self.recorded.load(Relaxed),
        );
    }

    fn warn_once(&self, message: std::fmt::Arguments<'_>) {
        if !self.warned.swap(true, Relaxed) {
            tracing::warn!("{message}");
        }
    }

    /// Lists what lies under the outputs' common directory, from just before the first
    /// output's key to the last's (`group` sorted), and marks in `same` each output the listing
    /// shows as recorded. A listing that fails part way marks no more: the rest are looked at
    /// one by one.
    async fn compare_with_listing<R: Record>(&self, group: &[R], same: &mut [bool]) {
        let Some(first) = group.first() else { return };
        let root = ObjectUrl {
            bucket: first.bucket().to_owned(),
            key: String::new(),
        };
        let (objects, _) = match Objects::at(&root) {
            Ok(found) => found,
            Err(e) => {
                self.warn_once(format_args!(
                    "cannot list the run's objects: {e}; each is looked at by itself"
                ));
                return;
            }
        };
        let dir = common_dir(group);
        let mut walk = Walk::new(group, same);
        let mut after = walk.start();
        loop {
            let listing = objects.list_after(dir, after.as_deref());
            let mut listing = std::pin::pin!(listing);
            let mut jump = None;
            while let Some(found) = listing.next().await {
                let found = match found {
                    Ok(found) => found,
                    Err(e) => {
                        self.warn_once(format_args!(
                            "{e}; the objects not listed yet are looked at one by one"
                        ));
                        return;
                    }
                };
                match walk.listed(&found.key, found.bytes, found.etag.as_deref()) {
                    Step::More => {}
                    Step::Done => return,
                    Step::JumpAfter(key) => {
                        jump = Some(key);
                        break;
                    }
                }
            }
            match jump {
                Some(key) => after = Some(key),
                None => return,
            }
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

/// A recorded output as the walk sees it.
trait Record {
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

impl Record for Recorded {
    fn url(&self) -> &ObjectUrl {
        &self.url
    }

    fn agrees(&self, bytes: u64, etag: Option<&str>) -> bool {
        let etags_agree = match (self.etag.as_deref(), etag) {
            (Some(mine), Some(listed)) => same_etag(mine, listed),
            _ => false,
        };
        etags_agree && self.bytes.is_none_or(|b| b == bytes)
    }
}

/// What the walk wants of the listing next.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    More,
    /// Every recorded output was passed: the rest of the listing is of no interest.
    Done,
    /// Many keys in a row were not the run's outputs: list again from after this key.
    JumpAfter(String),
}

/// The listing (sorted by key) walked against the recorded outputs (sorted the same way).
struct Walk<'a, R> {
    recorded: &'a [R],
    /// Whether each recorded output was listed as recorded.
    same: &'a mut [bool],
    /// The first recorded output the listing has not reached yet.
    next: usize,
    /// Listed keys in a row that are no recorded output.
    foreign: usize,
}

impl<'a, R: Record> Walk<'a, R> {
    fn new(recorded: &'a [R], same: &'a mut [bool]) -> Self {
        Walk {
            recorded,
            same,
            next: 0,
            foreign: 0,
        }
    }

    /// Where the listing starts: just before the first recorded key.
    fn start(&self) -> Option<String> {
        self.recorded.first().and_then(|r| just_before(r.key()))
    }

    /// Takes the next listed object. A recorded output whose key the listing passed without
    /// showing it stays unmarked: it is missing, or the store lists in another order; either
    /// way it is looked at by itself.
    fn listed(&mut self, key: &str, bytes: u64, etag: Option<&str>) -> Step {
        let mut found = false;
        while let Some(r) = self.recorded.get(self.next) {
            match r.key().cmp(key) {
                Ordering::Less => self.next += 1,
                Ordering::Equal => {
                    self.same[self.next] = r.agrees(bytes, etag);
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

/// Copies the object at `from` to `to` (create-only) and removes it from `from`; returns the
/// size moved, `None` when there was nothing at `from` or it could not be kept (then it is
/// left where it is, and said).
pub(super) async fn set_aside(from: &ObjectUrl, to: &ObjectUrl) -> Option<u64> {
    let moved = async {
        let (objects, key) = Objects::at(from)?;
        let (_, to_key) = Objects::at(to)?;
        let Some(body) = objects.read(&key).await? else {
            return Ok(None);
        };
        let sha = hex::encode(Sha256::digest(&body));
        let size = body.len() as u64;
        objects.put_new(&to_key, body.into(), &sha).await?;
        objects.delete(&key).await?;
        Ok(Some(size))
    };
    match moved.await {
        Ok(size) => size,
        Err(e) => {
            let e: ObjectError = e;
            tracing::warn!("cannot move {from} aside: {e}");
            None
        }
    }
}

/// The size of the object at `url`, `None` when there is none (or the store does not say).
pub(super) async fn size_of(url: &ObjectUrl) -> Option<u64> {
    let (objects, key) = Objects::at(url).ok()?;
    objects.stat(&key).await.ok().flatten().map(|s| s.bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let mut same = vec![false; recorded.len()];
        let mut walk = Walk::new(recorded, &mut same);
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
        (same, requests)
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
