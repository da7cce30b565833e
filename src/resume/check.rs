//! The kept outputs compared with what is there now: a file (its sha256 read) or an object
//! (see [`super::objects`]). What differs is fetched again from its job, never paid again.
//!
//! Memory: the run's stored outputs stream from the state database in the byte order of their
//! path ([`crate::store::Kept::stored`]: id, task, path, sha256, size, ETag), and are checked in
//! pages as they come: files [`FILES_PER_TRIP`] to a trip to the blocking pool, two trips at
//! once; objects a listing's page at a time, [`PAGES_IN_FLIGHT`] pages at once. What the
//! check holds is those pages and, for the run as a whole, the outputs that differ (an id and
//! the sha256 found); their whole records are read back by id at the end, for the review.
//! A night of 900,000 outputs is checked in the memory of a few thousand.

use std::collections::HashMap;
use std::future::ready;
use std::path::PathBuf;

use futures::stream::{Stream, TryStreamExt};
use tokio::sync::Semaphore;

use crate::place::{Address, file_sha256, stamp};
use crate::run_id::RunId;
use crate::sha256::Sha256Sum;
use crate::store::{OutputId, Store, StoreError, StoredOutput, TaskId};

use super::Refetch;
use super::objects::{Checker, OBJECTS_PER_PAGE, Recorded};

/// Files hashed in one trip to the blocking pool: a trip per file would cost a thread wake-up
/// each, one for the run a list of every file.
const FILES_PER_TRIP: usize = 256;

/// Trips hashing files at once: one a core of the 2-core machines imgpipe runs on.
const HASHING_AT_ONCE: usize = 2;

/// Pages being checked at once: files waiting for their trip, or objects compared with their
/// listing. For objects, the listings side by side: a night's 900,000 outputs are 900 pages, a
/// minute and a half of round trips one after the other.
const PAGES_IN_FLIGHT: usize = 16;

/// What is at an output's recorded place now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Found {
    Missing,
    /// Bytes of this sha256.
    Bytes(Sha256Sum),
}

/// An output whose file or object is missing or modified.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Differs {
    pub id: OutputId,
    /// The sha256 of the bytes there, when there are other bytes.
    pub modified: Option<Sha256Sum>,
}

/// The output `id`, whose place holds `found`, against the recorded `sha256`: `None` when it
/// is as recorded.
pub(super) fn differs(id: OutputId, sha256: &Sha256Sum, found: Found) -> Option<Differs> {
    match found {
        Found::Bytes(actual) if actual == *sha256 => None,
        Found::Bytes(actual) => Some(Differs {
            id,
            modified: Some(actual),
        }),
        Found::Missing => Some(Differs { id, modified: None }),
    }
}

/// The outputs of the kept tasks (row ids `kept`, sorted) whose file or object is missing or
/// differs from the record.
pub(super) async fn outputs(
    store: &Store,
    run_id: &RunId,
    kept: &[TaskId],
) -> Result<Vec<Refetch>, StoreError> {
    let (hashing, objects) = (&Semaphore::new(HASHING_AT_ONCE), &Checker::new());
    let kept = store
        .kept()
        .stored(run_id)
        .try_filter(|o| ready(kept.binary_search(&o.task_id).is_ok()));
    let mut differ: Vec<Differs> = pages(kept)
        .map_ok(move |page| async move {
            match page {
                Page::Files(files) => hash(files, hashing).await,
                Page::Objects(recorded) => Ok(objects.check(recorded).await),
            }
        })
        .try_buffer_unordered(PAGES_IN_FLIGHT)
        .try_fold(Vec::new(), |mut all, some| {
            all.extend(some);
            ready(Ok(all))
        })
        .await?;
    objects.summary();
    // The whole records of those that differ, for the review: read once the stream is done
    // (on SQLite it held the only connection).
    differ.sort_unstable_by_key(|d| d.id);
    let ids: Vec<OutputId> = differ.iter().map(|d| d.id).collect();
    let mut modified: HashMap<OutputId, Option<Sha256Sum>> =
        differ.into_iter().map(|d| (d.id, d.modified)).collect();
    let mut refetch: Vec<Refetch> = store
        .kept()
        .by_id(&ids)
        .await?
        .into_iter()
        .map(|output| Refetch {
            modified: modified.remove(&output.id).flatten(),
            output,
        })
        .collect();
    refetch.sort_unstable_by_key(|r| (r.output.task_id, r.output.k));
    Ok(refetch)
}

/// A stored file of a kept task.
#[derive(Clone)]
struct File {
    id: OutputId,
    path: PathBuf,
    sha256: Sha256Sum,
    /// Its stamp when it was kept (see [`stamp`]), recorded where objects have their ETag.
    stamp: Option<String>,
}

impl File {
    /// What is at the file's path now: read and hashed only when its stamp is not the one
    /// recorded (or none was).
    fn found(&self) -> Found {
        let unchanged = self
            .stamp
            .as_deref()
            .is_some_and(|s| stamp(&self.path).as_deref() == Some(s));
        if unchanged {
            return Found::Bytes(self.sha256.clone());
        }
        file_sha256(&self.path).map_or(Found::Missing, Found::Bytes)
    }
}

/// Outputs checked together: files of one trip to the blocking pool, or objects of one bucket
/// compared with one listing's page.
enum Page {
    Files(Vec<File>),
    Objects(Vec<Recorded>),
}

impl Page {
    fn of(o: StoredOutput) -> Page {
        match Address::recorded(&o.path) {
            Address::Local(path) => Page::Files(vec![File {
                id: o.id,
                path,
                sha256: o.sha256,
                stamp: o.etag,
            }]),
            Address::Object(url) => Page::Objects(vec![Recorded {
                id: o.id,
                url,
                sha256: o.sha256,
                bytes: o.bytes,
                etag: o.etag,
            }]),
        }
    }

    /// Adds `o` when it belongs here and there is room; else gives it back.
    fn take(&mut self, o: StoredOutput) -> Option<StoredOutput> {
        let Page::Objects(recorded) = self else {
            return self.take_file(o);
        };
        if recorded.len() >= OBJECTS_PER_PAGE {
            return Some(o);
        }
        match (Address::recorded(&o.path), recorded.last()) {
            (Address::Object(url), Some(last)) if url.bucket == last.url.bucket => {
                recorded.push(Recorded {
                    id: o.id,
                    url,
                    sha256: o.sha256,
                    bytes: o.bytes,
                    etag: o.etag,
                });
                None
            }
            _ => Some(o),
        }
    }

    fn take_file(&mut self, o: StoredOutput) -> Option<StoredOutput> {
        let Page::Files(files) = self else {
            return Some(o);
        };
        match Address::recorded(&o.path) {
            Address::Local(path) if files.len() < FILES_PER_TRIP => {
                files.push(File {
                    id: o.id,
                    path,
                    sha256: o.sha256,
                    stamp: o.etag,
                });
                None
            }
            _ => Some(o),
        }
    }
}

/// The outputs in pages, in the order they come: a page ends where it is full, or where the
/// next output is elsewhere (a file after objects, another bucket).
fn pages<'a>(
    outputs: impl Stream<Item = Result<StoredOutput, StoreError>> + Send + 'a,
) -> impl Stream<Item = Result<Page, StoreError>> + Send + 'a {
    let outputs = Box::pin(outputs);
    futures::stream::try_unfold(
        (outputs, None::<StoredOutput>),
        |(mut outputs, left)| async move {
            let first = match left {
                Some(o) => o,
                None => match outputs.try_next().await? {
                    Some(o) => o,
                    None => return Ok(None),
                },
            };
            let mut page = Page::of(first);
            while let Some(o) = outputs.try_next().await? {
                if let Some(o) = page.take(o) {
                    return Ok(Some((page, (outputs, Some(o)))));
                }
            }
            Ok(Some((page, (outputs, None))))
        },
    )
}

/// The files of `files` that are missing or differ, hashed in one trip to the blocking pool.
async fn hash(files: Vec<File>, hashing: &Semaphore) -> Result<Vec<Differs>, StoreError> {
    let _trip = hashing.acquire().await;
    tokio::task::spawn_blocking(move || {
        files
            .into_iter()
            .filter_map(|f| differs(f.id, &f.sha256, f.found()))
            .collect()
    })
    .await
    .map_err(|e| StoreError::Inconsistent(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_read_only_when_its_stamp_is_not_the_recorded_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shot.png");
        std::fs::write(&path, b"the picture").unwrap();
        // Recorded with a sha256 its bytes do not have: only a read would tell.
        let file = File {
            id: OutputId::new(1).unwrap(),
            path: path.clone(),
            sha256: Sha256Sum::of_bytes(b"recorded"),
            stamp: stamp(&path),
        };
        assert_eq!(file.found(), Found::Bytes(Sha256Sum::of_bytes(b"recorded")));
        let unstamped = File {
            stamp: None,
            ..file.clone()
        };
        let read = file_sha256(&path).unwrap();
        assert_eq!(unstamped.found(), Found::Bytes(read));
        // Another file put in its place, of the same size, however soon: read.
        let other = dir.path().join("other.png");
        std::fs::write(&other, b"THE PICTURE").unwrap();
        std::fs::rename(&other, &path).unwrap();
        assert_eq!(file.found(), Found::Bytes(file_sha256(&path).unwrap()));
        std::fs::remove_file(&path).unwrap();
        assert_eq!(file.found(), Found::Missing);
    }
}
