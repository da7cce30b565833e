//! The report of a run whose directory is in object storage. The page is made by the same
//! code as a local one, in a local staging copy of the run directory (what of its outputs and
//! thumbnails must be read, read from the bucket), then its pages and new thumbnails are put
//! under the run's prefix. Its links are relative to the run's prefix, so the page works when
//! browsed from the bucket, wherever `--out` puts it.
//!
//! A report reads an output whole only when it has no thumbnail yet: a thumbnail needs the
//! image's bytes, and carries the image's size from then on. One whose thumbnail is in the
//! bucket is not read at all: a listing of the run's prefix (a request per 1,000 keys) says it
//! is there as recorded (its size and ETag), and the local report is told to trust it
//! ([`Known::trusted`]). Nor is the thumbnail read when the catalogue beside the thumbnails
//! ([`CATALOGUE`]) says what the page shows of it. So each image is read once in the run's life,
//! by its first report; one the listing shows gone is said so on the page, one it shows changed
//! is read again, and said changed. (A thumbnail made before thumbnails carried the size has its
//! image's header read, 4 KiB, as then.)
//!
//! Memory: the outputs to stage, and the names of the thumbnails, are held while the report is
//! made (a key and a few numbers each): this report grows with the run's outputs, where a local
//! one holds a page.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use futures::StreamExt;

use crate::error::Error;
use crate::place::layout::THUMBS;
use crate::place::{Address, ObjectError, ObjectUrl, Objects, strong_etag};
use crate::report::html::MARKER;
use crate::report::live::Observed;
use crate::report::thumbs::{Facts, Known, image_size, thumb_path};
use crate::report::{Written, refuse_foreign, write_local};
use crate::store::{RunRow, Store};

/// The thumbnails' catalogue, under `<run>/_thumbs/`: what each thumbnail says of itself
/// (the image's size, its own, whether it has alpha), so that a report made again needs none
/// of their bytes. A thumbnail it lacks (made by an older imgpipe, or by a report that ran
/// at the same time and wrote its own catalogue last) is read, and the catalogue written again.
const CATALOGUE: &str = "index.tsv";

/// What is read of an output whose thumbnail is made: a PNG's size is in its first 33 bytes.
const HEADER_BYTES: u64 = 4096;

/// Objects read at once while staging: round trips, not bandwidth, bound a run of many
/// small images.
const READS_IN_FLIGHT: usize = 8;

fn failed(e: impl std::fmt::Display) -> Error {
    Error::Other(anyhow::anyhow!("cannot write the report: {e}"))
}

pub(super) async fn write(
    store: &Store,
    run: RunRow,
    out: Option<&Address>,
    observed: Observed,
) -> Result<Written, Error> {
    let run_dir = run.dir();
    let Address::Object(run_url) = run_dir.root() else {
        return Err(failed("the run is not in object storage"));
    };
    let objects = Objects::open(run_url).map_err(failed)?;
    let stage = tempfile::tempdir().map_err(failed)?;
    let local_run = stage.path().join(&run.id);
    let started = std::time::Instant::now();
    let (made, mut known) = stage_thumbnails(&objects, &local_run)
        .await
        .map_err(failed)?;
    tracing::debug!(
        "{} thumbnail(s) known, {} read, in {:.2?}",
        known.facts.len(),
        made.len() - known.facts.len(),
        started.elapsed()
    );
    known.trusted = stage_outputs(store, &objects, &run.id, run_url, &local_run, &made).await?;
    let catalogued = known.facts.clone();
    tracing::debug!("outputs staged after {:.2?}", started.elapsed());

    let page = out
        .and_then(Address::file_name)
        .unwrap_or_else(|| "report.html".into());
    let staged = RunRow {
        output_dir: stage.path().to_string_lossy().into_owned(),
        ..run
    };
    let staged_out = local_run.join(&page);
    let rebase = (run_dir.root(), local_run.as_path());
    let mut written = write_local(
        store,
        staged,
        Some(&staged_out),
        observed,
        Some(rebase),
        known,
    )
    .await?;

    tracing::debug!("pages made after {:.2?}", started.elapsed());
    put_thumbnails(&objects, &local_run.join(THUMBS), &made, catalogued).await?;
    tracing::debug!("thumbnails put after {:.2?}", started.elapsed());
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

/// The thumbnails already under `<run>/_thumbs/`: those its catalogue ([`CATALOGUE`]) knows
/// are not read, the others are read into the staging copy, several at once. Returns every
/// thumbnail's name, each with whether it carries its image's size, and what the catalogue
/// knows.
async fn stage_thumbnails(
    objects: &Objects,
    local_run: &Path,
) -> Result<(HashMap<String, bool>, Known), ObjectError> {
    let thumbs = objects.child(THUMBS);
    let names = objects.names(thumbs.prefix()).await?;
    let catalogue = match thumbs.read(&thumbs.key(CATALOGUE)).await? {
        Some(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        None => String::new(),
    };
    let mut listed: HashMap<String, bool> = HashMap::new();
    let mut known = Known {
        dated: thumbs_dated(),
        ..Known::default()
    };
    let in_catalogue: HashMap<String, Facts> = Known::parse(&catalogue).collect();
    let mut to_read = Vec::new();
    for name in names.into_iter().filter(|n| n.ends_with(".png")) {
        match in_catalogue.get(&name) {
            Some(facts) => {
                listed.insert(name.clone(), facts.size.is_some());
                known.facts.insert(name, *facts);
            }
            None => to_read.push(name),
        }
    }
    let dir = local_run.join(THUMBS);
    let _ = std::fs::create_dir_all(&dir);
    let (thumbs, dir) = (&thumbs, &dir);
    let staged: Vec<Result<Option<(String, bool)>, ObjectError>> = futures::stream::iter(to_read)
        .map(|name| async move {
            let Some(bytes) = thumbs.read(&thumbs.key(&name)).await? else {
                return Ok(None);
            };
            let sized = image_size(&bytes).is_some();
            Ok(stage_file(&dir.join(&name), &bytes, Some(thumbs_dated()))
                .is_ok()
                .then_some((name, sized)))
        })
        .buffer_unordered(READS_IN_FLIGHT)
        .collect()
        .await;
    for found in staged {
        if let Some((name, sized)) = found? {
            listed.insert(name, sized);
        }
    }
    Ok((listed, known))
}

/// Puts the thumbnails this report made (those in the staging copy's `dir` that were not in
/// the bucket, `listed`) under the run's prefix, several at once, then the catalogue of every
/// thumbnail read or made when it knew fewer than that (`catalogued`: what it knew).
async fn put_thumbnails(
    objects: &Objects,
    dir: &Path,
    listed: &HashMap<String, bool>,
    mut catalogued: HashMap<String, Facts>,
) -> Result<(), Error> {
    let thumbs = objects.child(THUMBS);
    let before = catalogued.len();
    let mut new = Vec::new();
    for name in names_in(dir).into_iter().filter(|n| n.ends_with(".png")) {
        let bytes = std::fs::read(dir.join(&name)).map_err(failed)?;
        if let Some(facts) = Facts::of(&bytes) {
            catalogued.insert(name.clone(), facts);
        }
        if !listed.contains_key(&name) {
            new.push((name, bytes));
        }
    }
    let thumbs = &thumbs;
    let put: Vec<Result<(), ObjectError>> = futures::stream::iter(new)
        .map(|(name, bytes)| async move { thumbs.replace(&thumbs.key(&name), bytes).await })
        .buffer_unordered(READS_IN_FLIGHT)
        .collect()
        .await;
    put.into_iter().collect::<Result<(), _>>().map_err(failed)?;
    if catalogued.len() > before {
        let text = Known::lines(catalogued.iter());
        thumbs
            .replace(&thumbs.key(CATALOGUE), text.into_bytes())
            .await
            .map_err(failed)?;
    }
    Ok(())
}

/// What of an output is read into the staging copy.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Read {
    /// Nothing: its thumbnail is staged and carries the image's size. The file is staged
    /// empty, which the report, trusting the record, does not read.
    Nothing,
    /// Its header (its size): its thumbnail is staged, but was made before thumbnails
    /// carried the size.
    Header,
    /// All of it: it has no thumbnail yet, which the report makes of its bytes, or the
    /// listing shows it changed since it was recorded.
    Whole,
    /// Not there: the listing of the run's prefix does not have it.
    Gone,
}

/// An output to stage: its URL, what to read of it, and its size and ETag as recorded (the
/// ETag as its hash: 8 bytes an output, not a string).
struct Staging {
    url: ObjectUrl,
    read: Read,
    bytes: Option<u64>,
    etag: Option<u64>,
}

/// The hash an ETag is compared by; `None` for one that says nothing of the bytes.
fn etag_hash(etag: &str) -> Option<u64> {
    use std::hash::{Hash, Hasher};
    let etag = strong_etag(etag)?;
    let mut hasher = std::hash::DefaultHasher::new();
    etag.hash(&mut hasher);
    Some(hasher.finish())
}

/// Lists the run's prefix (a request per 1,000 keys) when some outputs are to be staged
/// without their bytes, and reads whole those the listing shows changed (another size or
/// ETag than recorded) or marks them gone: so the page still says what was removed or changed
/// in the bucket, without a request an image.
async fn confirm_by_listing(objects: &Objects, outputs: &mut [Staging]) -> Result<(), Error> {
    if outputs.iter().all(|o| o.read == Read::Whole) {
        return Ok(());
    }
    // By key (all are under the run's prefix): the order S3 lists in.
    outputs.sort_unstable_by(|a, b| a.url.key.cmp(&b.url.key));
    let listing = objects.list_after(Some(objects.prefix().as_ref()), None);
    let mut listing = std::pin::pin!(listing);
    let mut next = 0;
    while let Some(found) = listing.next().await {
        let found = found.map_err(failed)?;
        while let Some(o) = outputs.get_mut(next) {
            match o.url.key.as_str().cmp(found.key.as_str()) {
                std::cmp::Ordering::Greater => break,
                std::cmp::Ordering::Less => {
                    if o.read != Read::Whole {
                        o.read = Read::Gone;
                    }
                }
                std::cmp::Ordering::Equal => {
                    let listed = found.etag.as_deref().and_then(etag_hash);
                    let etag_changed = o.etag.zip(listed).is_some_and(|(a, b)| a != b);
                    if etag_changed || o.bytes.is_some_and(|b| b != found.bytes) {
                        o.read = Read::Whole;
                    }
                }
            }
            next += 1;
        }
    }
    for o in &mut outputs[next..] {
        if o.read != Read::Whole {
            o.read = Read::Gone;
        }
    }
    Ok(())
}

/// Reads each recorded output of the run into the staging copy, where the report looks for
/// it, as much of it as the report needs (`thumbs`: the thumbnails staged, whether each
/// carries its image's size); one that is gone from the bucket stays missing there too, and
/// the page says so.
async fn stage_outputs(
    store: &Store,
    objects: &Objects,
    run_id: &str,
    run_url: &ObjectUrl,
    local_run: &Path,
    thumbs: &HashMap<String, bool>,
) -> Result<HashSet<PathBuf>, Error> {
    let mut outputs = Vec::new();
    let thumb_dir = local_run.join(THUMBS);
    store
        .each_output(run_id, false, |o| {
            let Some(Address::Object(url)) = o.address() else {
                return Ok(());
            };
            if url.under(run_url).is_none() {
                return Ok(());
            }
            let thumb = o.sha256.as_deref().and_then(|sha| {
                let path = thumb_path(&thumb_dir, sha);
                thumbs.get(&*path.file_name()?.to_string_lossy()).copied()
            });
            let read = match thumb {
                Some(true) => Read::Nothing,
                Some(false) => Read::Header,
                None => Read::Whole,
            };
            outputs.push(Staging {
                url,
                read,
                bytes: o.bytes,
                etag: o.etag.as_deref().and_then(etag_hash),
            });
            Ok(())
        })
        .await?;
    let started = std::time::Instant::now();
    confirm_by_listing(objects, &mut outputs).await?;
    tracing::debug!(
        "{} output(s) compared with the listing in {:.2?}",
        outputs.len(),
        started.elapsed()
    );
    // Those the listing shows as recorded are not staged: their thumbnails stand for them.
    let (unread, to_read): (Vec<Staging>, Vec<Staging>) = outputs
        .into_iter()
        .partition(|o| matches!(o.read, Read::Nothing | Read::Gone));
    let trusted: HashSet<PathBuf> = unread
        .into_iter()
        .filter(|o| o.read == Read::Nothing)
        .filter_map(|o| Some(local_run.join(o.url.under(run_url)?)))
        .collect();
    let (bucket, _) = Objects::at(run_url).map_err(failed)?;
    let bucket = &bucket;
    let staged: Vec<Result<(), Error>> = futures::stream::iter(to_read)
        .map(|Staging { url, read, .. }| async move {
            let Some(rel) = url.under(run_url) else {
                return Ok(());
            };
            let key = object_store::path::Path::from(url.key.as_str());
            let bytes = match read {
                Read::Header => bucket.read_head(&key, HEADER_BYTES).await,
                _ => bucket.read(&key).await,
            };
            let Some(bytes) = bytes.map_err(failed)? else {
                return Ok(());
            };
            let dated = (read != Read::Whole).then_some(std::time::UNIX_EPOCH);
            stage_file(&local_run.join(rel), &bytes, dated).map_err(failed)
        })
        .buffer_unordered(READS_IN_FLIGHT)
        .collect()
        .await;
    staged.into_iter().collect::<Result<(), Error>>()?;
    Ok(trusted)
}

/// When the staged thumbnails say they were made: after the outputs staged without their
/// bytes (dated at the epoch), before any output read whole (dated now), whatever the clock's
/// grain: the local report reads an image again only when it is newer than its thumbnail.
fn thumbs_dated() -> std::time::SystemTime {
    std::time::UNIX_EPOCH + std::time::Duration::from_secs(1)
}

/// Writes a staged file (its directory made), dated `modified` when given.
fn stage_file(
    to: &Path,
    bytes: &[u8],
    modified: Option<std::time::SystemTime>,
) -> std::io::Result<()> {
    if let Some(dir) = to.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(to, bytes)?;
    match modified {
        Some(at) => std::fs::File::options()
            .write(true)
            .open(to)?
            .set_modified(at),
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
