//! The report of a run whose directory is in object storage. The page is made by the same
//! code as a local one, in a local staging copy of the run directory, a page at a time: what
//! of a page's outputs must be read is read from the bucket before the page is made, the
//! thumbnails it made are put under the run's prefix after, and its staged files removed.
//! Its links are relative to the run's prefix, so the page works when browsed from the bucket,
//! wherever `--out` puts it.
//!
//! A report reads an output whole only when it has no thumbnail yet: a thumbnail needs the
//! image's bytes, and what it shows (the image's size, its own, whether it has alpha) is
//! recorded in the state database when it is put ([`crate::store::Thumbnails::record`]). So each image
//! is read once in the run's life, by its first report, and a report made again reads no image
//! nor thumbnail: two comparisons with listings (a request per 1,000 keys) say the outputs and
//! thumbnails are there as recorded (their size and ETag). An output the listing shows gone is
//! said so on the page; one it shows changed is read again, and said changed; a thumbnail gone
//! or changed is forgotten, and made again.
//!
//! Memory: the comparisons stream the records from the database in key order, a listing's
//! page at a time ([`listing::compare`]), and keep for the run as a whole only the outputs
//! that disagree (an id and a byte each); the rest is a page's: its thumbnails' rows and its
//! staged files (on disk). A report of a night of 900,000 outputs holds what one of 900 does.

use std::collections::{HashMap, HashSet};
use std::future::ready;
use std::path::{Path, PathBuf};

use futures::{Stream, StreamExt, TryStreamExt};

use crate::error::Error;
use crate::place::layout::THUMBS;
use crate::place::listing::{self, OBJECTS_PER_PAGE, Record, Seen};
use crate::place::{Address, ObjectError, ObjectUrl, Objects, strong_etag};
use crate::report::live::Observed;
use crate::report::page::html::MARKER;
use crate::report::page::thumbs::{Facts, Known, Preview, thumb_name};
use crate::report::page::{Written, refuse_foreign, write_local};
use crate::run_id::RunId;
use crate::store::{OutputId, ReportOutput, Run, Store, Thumbnail};

/// Objects read or put at once while a page is staged or kept: round trips, not bandwidth,
/// bound a run of many small images.
const READS_IN_FLIGHT: usize = 8;

/// Listings compared with the records at once: a night's 900,000 outputs are 900 pages, a
/// minute and a half of round trips one after the other.
const LISTINGS_IN_FLIGHT: usize = 16;

fn failed(e: impl std::fmt::Display) -> Error {
    Error::Other(anyhow::anyhow!("cannot write the report: {e}"))
}

pub(super) async fn write(
    store: &Store,
    run: Run,
    out: Option<&Address>,
    observed: Observed,
) -> Result<Written, Error> {
    let run_dir = run.dir();
    let Address::Object(run_url) = run_dir.root() else {
        return Err(failed("the run is not in object storage"));
    };
    let objects = Objects::open(run_url).map_err(failed)?;
    let stage = tempfile::tempdir().map_err(failed)?;
    let local_run = stage.path().join(run.id.as_str());
    let started = std::time::Instant::now();
    let differ = outputs_not_as_recorded(store, &run.id, run_url).await?;
    let forgotten = forget_missing_thumbnails(store, &run.id, &objects.child(THUMBS)).await?;
    tracing::debug!(
        "{} output(s) not as recorded, {forgotten} thumbnail(s) gone, found in {:.2?}",
        differ.len(),
        started.elapsed()
    );
    let pages = Pages {
        store: store.clone(),
        run_id: run.id.clone(),
        run_url: run_url.clone(),
        local_run: local_run.clone(),
        thumbs: objects.child(THUMBS),
        differ,
    };

    let page = out
        .and_then(Address::file_name)
        .unwrap_or_else(|| "report.html".into());
    let staged = Run {
        output_dir: Address::Local(stage.path().to_path_buf()),
        ..run
    };
    let staged_out = local_run.join(&page);
    let mut written = write_local(store, staged, Some(&staged_out), observed, Some(pages)).await?;
    tracing::debug!("pages made after {:.2?}", started.elapsed());
    // The staging directory's path would show where the run's place is named.
    let shown = local_run.to_string_lossy().into_owned();
    let pages: Vec<String> = names_in(&local_run)
        .into_iter()
        .filter(|n| n.ends_with(".html"))
        .collect();
    let staged = Staged {
        local_run: &local_run,
        pages: &pages,
        shown: &shown,
        run_url: &run_url.to_string(),
    };
    written.path = match out {
        None => put_pages(&objects, &staged, &page).await?,
        Some(Address::Object(out)) => {
            let Some(dir) = out.parent() else {
                return Err(failed("--out is not an s3:// URL"));
            };
            let there = Objects::open(&dir).map_err(failed)?;
            put_pages(&there, &staged, &page).await?
        }
        Some(Address::Local(out)) => copy_pages(out, &staged)?,
    };
    Ok(written)
}

/// Whether two ETags, one recorded and one listed, say other bytes: both say something of
/// the bytes (neither weak nor missing), and differ.
fn etags_differ(recorded: Option<&str>, listed: Option<&str>) -> bool {
    match (recorded.and_then(strong_etag), listed.and_then(strong_etag)) {
        (Some(a), Some(b)) => a != b,
        _ => false,
    }
}

/// A recorded output of the run, as its listing is compared with it.
struct Kept {
    id: OutputId,
    url: ObjectUrl,
    bytes: Option<u64>,
    etag: Option<String>,
}

impl Record for Kept {
    fn url(&self) -> &ObjectUrl {
        &self.url
    }

    /// As recorded, unless its size or ETag says otherwise: an output recorded before ETags
    /// were kept is taken as there by its size, as its thumbnail is by its name.
    fn agrees(&self, bytes: u64, etag: Option<&str>) -> bool {
        self.bytes.is_none_or(|b| b == bytes) && !etags_differ(self.etag.as_deref(), etag)
    }
}

/// A thumbnail the report put, as its listing is compared with it.
struct Put {
    name: String,
    url: ObjectUrl,
    bytes: u64,
    etag: Option<String>,
}

impl Record for Put {
    fn url(&self) -> &ObjectUrl {
        &self.url
    }

    fn agrees(&self, bytes: u64, etag: Option<&str>) -> bool {
        self.bytes == bytes && !etags_differ(self.etag.as_deref(), etag)
    }
}

/// The records of `records` (in key order, of one bucket) that a listing does not show as
/// recorded, each made `T` by `keep` with how it was seen: pages of [`OBJECTS_PER_PAGE`]
/// compared side by side, [`LISTINGS_IN_FLIGHT`] at once.
async fn not_as_listed<R, T>(
    records: impl Stream<Item = Result<R, Error>> + Send,
    keep: impl Fn(&R, Seen) -> T + Copy + Send,
) -> Result<Vec<T>, Error>
where
    R: Record + Send + Sync,
    T: Send,
{
    records
        .try_chunks(OBJECTS_PER_PAGE)
        .map_err(|e| e.1)
        .map_ok(|page| async move {
            let mut seen = vec![Seen::Unlisted; page.len()];
            listing::compare(&page, &mut seen).await.map_err(failed)?;
            Ok::<_, Error>(
                page.iter()
                    .zip(seen)
                    .filter(|(_, seen)| *seen != Seen::Same)
                    .map(|(r, seen)| keep(r, seen))
                    .collect::<Vec<T>>(),
            )
        })
        .try_buffer_unordered(LISTINGS_IN_FLIGHT)
        .try_fold(Vec::new(), |mut all, some| {
            all.extend(some);
            ready(Ok(all))
        })
        .await
}

/// The run's outputs under its prefix that the listing does not show as recorded, by id
/// (sorted): gone ([`Seen::Unlisted`]) or changed ([`Seen::Other`]).
async fn outputs_not_as_recorded(
    store: &Store,
    run_id: &RunId,
    run_url: &ObjectUrl,
) -> Result<Vec<(OutputId, Seen)>, Error> {
    let kept = store
        .kept()
        .stored(run_id)
        .map_err(Error::from)
        .try_filter_map(|o| {
            ready(Ok(match Address::recorded(&o.path) {
                Address::Object(url) if url.under(run_url).is_some() => Some(Kept {
                    id: o.id,
                    url,
                    bytes: o.bytes,
                    etag: o.etag,
                }),
                _ => None,
            }))
        });
    let mut differ = not_as_listed(kept, |k, seen| (k.id, seen)).await?;
    differ.sort_unstable_by_key(|(id, _)| *id);
    Ok(differ)
}

/// Forgets the recorded thumbnails the listing of `thumbs` does not show as they were put;
/// returns how many.
async fn forget_missing_thumbnails(
    store: &Store,
    run_id: &RunId,
    thumbs: &Objects,
) -> Result<usize, Error> {
    let put = store
        .thumbnails()
        .list(run_id)
        .map_err(Error::from)
        .map_ok(|t| Put {
            url: thumbs.url_of(&thumbs.key(&format!("{}.png", t.name))),
            name: t.name,
            bytes: t.bytes,
            etag: t.etag,
        });
    let gone = not_as_listed(put, |t, _| t.name.clone()).await?;
    store.thumbnails().forget(run_id, &gone).await?;
    Ok(gone.len())
}

/// The pages of a report of a run in object storage, made in a local staging copy of the run
/// directory (`local_run`): what of each page's outputs must be read is staged before it is
/// made, and what it made is put after.
pub(super) struct Pages {
    store: Store,
    run_id: RunId,
    run_url: ObjectUrl,
    local_run: PathBuf,
    thumbs: Objects,
    /// The outputs the listing did not show as recorded, by id (sorted).
    differ: Vec<(OutputId, Seen)>,
}

impl Pages {
    /// Makes an output recorded under the run's prefix a file of the staging copy.
    pub(super) fn rebase(&self, o: &mut ReportOutput) {
        if let Some(Address::Object(url)) = &o.place
            && let Some(rel) = url.under(&self.run_url)
        {
            o.place = Some(Address::Local(self.local_run.join(rel)));
        }
    }

    /// Stages what the page of `outputs` (rebased) needs: each output whose thumbnail is
    /// recorded and that the listing showed as recorded is trusted unread; one the listing
    /// showed changed, or with no thumbnail yet, is read whole; one gone stays missing, and
    /// the page says so. Returns what the page knows without reading, and the files staged.
    pub(super) async fn stage(
        &self,
        outputs: &[&ReportOutput],
    ) -> Result<(Known, Vec<PathBuf>), Error> {
        let mut names: Vec<String> = outputs
            .iter()
            .filter_map(|o| o.sha256.as_ref().map(thumb_name))
            .collect();
        names.sort_unstable();
        names.dedup();
        let facts: HashMap<String, Facts> = self
            .store
            .thumbnails()
            .named(&self.run_id, &names)
            .await?
            .into_iter()
            .map(|t| {
                let facts = Facts {
                    size: Some(t.size),
                    thumb_size: t.thumb_size,
                    alpha: t.alpha,
                };
                (format!("{}.png", t.name), facts)
            })
            .collect();
        let mut known = Known {
            facts,
            dated: thumbs_dated(),
            trusted: HashSet::new(),
        };
        let mut to_read = Vec::new();
        for o in outputs {
            let Some(path) = o
                .place
                .as_ref()
                .and_then(Address::as_local)
                .map(Path::to_owned)
            else {
                continue;
            };
            let Ok(rel) = path.strip_prefix(&self.local_run) else {
                continue;
            };
            let seen = self
                .differ
                .binary_search_by_key(&o.id, |(id, _)| *id)
                .map_or(Seen::Same, |at| self.differ[at].1);
            let thumbnailed = o.sha256.as_ref().is_some_and(|sha| {
                known
                    .facts
                    .contains_key(&format!("{}.png", thumb_name(sha)))
            });
            match seen {
                Seen::Unlisted => {}
                Seen::Same if thumbnailed => {
                    known.trusted.insert(path);
                }
                _ => {
                    let url = self.run_url.join(&rel.to_string_lossy());
                    to_read.push((path, url));
                }
            }
        }
        let staged = self.read(to_read).await?;
        Ok((known, staged))
    }

    /// Reads each object into its file of the staging copy, several at once; returns the
    /// files written (an object gone since the listing is not).
    async fn read(&self, objects: Vec<(PathBuf, ObjectUrl)>) -> Result<Vec<PathBuf>, Error> {
        let read: Vec<Result<Option<PathBuf>, Error>> = futures::stream::iter(objects)
            .map(|(path, url)| async move {
                let (bucket, key) = Objects::at(&url).map_err(failed)?;
                stage_dir(&path).map_err(failed)?;
                let read = bucket.read_to_file(&key, &path).await.map_err(failed)?;
                Ok(read.map(|_| path))
            })
            .buffer_unordered(READS_IN_FLIGHT)
            .collect()
            .await;
        read.into_iter().filter_map(Result::transpose).collect()
    }

    /// After a page is made: puts the thumbnails it made under the run's prefix, records them,
    /// and removes them and the page's `staged` files from the staging copy.
    pub(super) async fn keep(
        &self,
        previews: &[Preview],
        staged: Vec<PathBuf>,
    ) -> Result<(), Error> {
        let mut made: Vec<&Path> = previews
            .iter()
            .filter(|p| p.made)
            .filter_map(|p| p.thumb.as_deref())
            .collect();
        made.sort_unstable();
        made.dedup();
        let thumbs = &self.thumbs;
        let put: Vec<Result<Option<Thumbnail>, ObjectError>> = futures::stream::iter(made)
            .map(|file| async move {
                let (Some(name), Ok(bytes)) = (
                    file.file_stem().map(|n| n.to_string_lossy().into_owned()),
                    std::fs::read(file),
                ) else {
                    return Ok(None);
                };
                let facts = Facts::of(&bytes);
                let size = bytes.len() as u64;
                let etag = thumbs
                    .replace(&thumbs.key(&format!("{name}.png")), bytes)
                    .await?;
                let _ = std::fs::remove_file(file);
                Ok(facts.and_then(|f| {
                    Some(Thumbnail {
                        name,
                        size: f.size?,
                        thumb_size: f.thumb_size,
                        alpha: f.alpha,
                        bytes: size,
                        etag,
                    })
                }))
            })
            .buffer_unordered(READS_IN_FLIGHT)
            .collect()
            .await;
        for file in staged {
            let _ = std::fs::remove_file(file);
        }
        let rows: Vec<Thumbnail> = put
            .into_iter()
            .filter_map(Result::transpose)
            .collect::<Result<_, _>>()
            .map_err(failed)?;
        if let Err(e) = self.store.thumbnails().record(&self.run_id, &rows).await {
            // The page is right; the next report makes these thumbnails again.
            tracing::warn!("cannot record the report's thumbnails: {e}");
        }
        Ok(())
    }
}

/// When the recorded thumbnails say they were made: before any output read whole (dated now),
/// whatever the clock's grain: the local report reads an image again only when it is newer
/// than its thumbnail.
fn thumbs_dated() -> std::time::SystemTime {
    std::time::UNIX_EPOCH + std::time::Duration::from_secs(1)
}

/// Writes a staged file, its directory made.
/// The directory a staged file goes in, made.
fn stage_dir(to: &Path) -> std::io::Result<()> {
    match to.parent() {
        Some(dir) => std::fs::create_dir_all(dir),
        None => Ok(()),
    }
}

fn names_in(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|e| e.path().is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !crate::place::layout::is_leftover(n, false))
        .collect()
}

/// The pages made in the staging copy.
struct Staged<'a> {
    local_run: &'a Path,
    pages: &'a [String],
    /// The staging copy's path, as the pages show it, and the run's URL to show instead.
    shown: &'a str,
    run_url: &'a str,
}

impl Staged<'_> {
    fn text(&self, name: &str) -> Result<String, Error> {
        let text = std::fs::read_to_string(self.local_run.join(name)).map_err(failed)?;
        Ok(text.replace(self.shown, self.run_url))
    }
}

/// Puts the pages under the run's prefix, never over an object that is not a report.
async fn put_pages(objects: &Objects, staged: &Staged<'_>, first: &str) -> Result<Address, Error> {
    for name in staged.pages {
        let key = objects.key(name);
        if let Some(existing) = objects.read(&key).await.map_err(failed)?
            && !String::from_utf8_lossy(&existing[..existing.len().min(256)]).contains(MARKER)
        {
            return Err(Error::usage(
                format!(
                    "{} exists and is not an imgpipe report; it was left as it is",
                    objects.key_url(&key)
                ),
                Some("name a new file with --out, or remove that object first"),
            ));
        }
    }
    for name in staged.pages {
        objects
            .replace(&objects.key(name), staged.text(name)?.into_bytes())
            .await
            .map_err(failed)?;
    }
    Ok(Address::Object(objects.url_of(&objects.key(first))))
}

/// Writes the pages beside `out`, a local file: their links still lead into the run's
/// prefix, for a page meant to be put there or browsed with it.
fn copy_pages(out: &Path, staged: &Staged<'_>) -> Result<Address, Error> {
    let dir = out
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    for name in staged.pages {
        refuse_foreign(&dir.join(name))?;
    }
    std::fs::create_dir_all(dir).map_err(failed)?;
    for name in staged.pages {
        std::fs::write(dir.join(name), staged.text(name)?).map_err(failed)?;
    }
    Ok(Address::Local(out.to_path_buf()))
}
