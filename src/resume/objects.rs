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
//! (their UTF-8 bytes), a page of 1,000 at a time ([`OBJECTS_PER_PAGE`]), each page compared
//! with a listing ([`listing::compare`]): a page of recorded objects and a page of the listing
//! in memory for each page being checked (16 at once, [`super::check`]), a byte per output of
//! it (how the listing showed it), and the HEADs of those it did not show as recorded.
//! Nothing is held for the run as a whole but the outputs that differ. Should the database
//! give keys in another order, the listing passes outputs without seeing them: they are looked
//! at one by one, never taken as kept.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicUsize};

use futures::StreamExt;
use tokio::sync::Semaphore;

use super::check::Differs;
use crate::place::listing::{self, Record, Seen};
use crate::place::{ObjectError, ObjectUrl, Objects, Stat, same_etag};
use crate::sha256::Sha256Sum;
use crate::store::OutputId;

pub(super) use crate::place::listing::OBJECTS_PER_PAGE;

/// What the object of a recorded output is now.
enum Checked {
    /// As recorded.
    Same,
    Missing,
    /// Other bytes, of this sha256.
    Modified(Sha256Sum),
}

/// Compares the object at `url` with the recorded sha256 and size. A store that cannot be
/// reached says nothing for sure: the output is then fetched again, which is free and, the
/// object being create-only, harmless.
async fn check(url: &ObjectUrl, sha256: &Sha256Sum, bytes: Option<u64>) -> Checked {
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
        let meta_agrees = meta.as_ref() == Some(sha256);
        if meta_agrees && bytes.is_none_or(|b| b == size) {
            return Ok(Checked::Same);
        }
        // Metadata can be copied along with other bytes, or lost: the bytes decide.
        Ok(match objects.sha256(&key).await? {
            None => Checked::Missing,
            Some((actual, _)) => {
                if actual == *sha256 {
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

/// A recorded object of a kept task, as the check needs it.
pub(super) struct Recorded {
    pub id: OutputId,
    pub url: ObjectUrl,
    pub sha256: Sha256Sum,
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
        let mut seen = vec![Seen::Unlisted; page.len()];
        if page.iter().any(|o| o.etag.is_some())
            && let Err(e) = listing::compare(&page, &mut seen).await
        {
            self.warn_once(format_args!(
                "{e}; the objects not listed yet are looked at one by one"
            ));
        }
        let listed = seen.iter().filter(|s| **s == Seen::Same).count();
        self.recorded.fetch_add(page.len(), Relaxed);
        self.listed_same.fetch_add(listed, Relaxed);
        futures::stream::iter(page.into_iter().zip(seen))
            .filter(|(_, seen)| std::future::ready(*seen != Seen::Same))
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
