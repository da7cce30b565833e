//! The report of a run whose directory is in object storage. The page is made by the same
//! code as a local one, in a local staging copy of the run directory (its outputs and the
//! thumbnails already made, read from the bucket), then its pages and new thumbnails are put
//! under the run's prefix. Its links are relative to the run's prefix, so the page works when
//! browsed from the bucket, wherever `--out` puts it.
//!
//! A report reads an output whole only when it has no thumbnail yet: a thumbnail needs the
//! image's bytes. One whose thumbnail is in the bucket is staged as its header alone (the size
//! shown beside it), dated before its thumbnail, which is all the local report reads of it then:
//! a nightly run's report never reads again the terabytes the nights before made.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use futures::StreamExt;

use crate::error::Error;
use crate::layout::THUMBS;
use crate::place::{ObjectError, Objects, Place};
use crate::report::html::MARKER;
use crate::report::live::Observed;
use crate::report::thumbs::thumb_path;
use crate::report::{Written, refuse_foreign, write_local};
use crate::store::{RunRow, Store};

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
    out: Option<&Path>,
    observed: Observed,
) -> Result<Written, Error> {
    let run_url = run.dir().to_string_lossy().into_owned();
    let objects = match Place::of(&run.dir()).map_err(failed)? {
        Place::Objects(objects) => objects,
        Place::Local(_) => return Err(failed("the run is not in object storage")),
    };
    let stage = tempfile::tempdir().map_err(failed)?;
    let local_run = stage.path().join(&run.id);
    let made = stage_thumbnails(&objects, &local_run)
        .await
        .map_err(failed)?;
    stage_outputs(store, &run.id, &run_url, &local_run).await?;

    let page = out.and_then(Path::file_name).map_or_else(
        || "report.html".into(),
        |n| n.to_string_lossy().into_owned(),
    );
    let staged = RunRow {
        output_dir: stage.path().to_string_lossy().into_owned(),
        ..run
    };
    let staged_out = local_run.join(&page);
    let mut written = write_local(
        store,
        staged,
        Some(&staged_out),
        observed,
        Some((&run_url, &local_run)),
    )
    .await?;

    let thumbs = objects.child(THUMBS);
    for name in names_in(&local_run.join(THUMBS)) {
        if !made.contains(&name) {
            let bytes = std::fs::read(local_run.join(THUMBS).join(&name)).map_err(failed)?;
            thumbs
                .replace(&thumbs.key(&name), bytes)
                .await
                .map_err(failed)?;
        }
    }
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
        run_url: &run_url,
    };
    written.path = match out {
        None => put_pages(&objects, &staged, &page).await?,
        Some(out) if crate::place::is_object_url(out) => {
            let dir = out.parent().unwrap_or(out);
            match Place::of(dir).map_err(failed)? {
                Place::Objects(there) => put_pages(&there, &staged, &page).await?,
                Place::Local(_) => return Err(failed("--out is not an s3:// URL")),
            }
        }
        Some(out) => copy_pages(out, &staged)?,
    };
    Ok(written)
}

/// Reads the thumbnails already under `<run>/_thumbs/` into the staging copy; returns their
/// names.
async fn stage_thumbnails(
    objects: &Objects,
    local_run: &Path,
) -> Result<HashSet<String>, ObjectError> {
    let thumbs = objects.child(THUMBS);
    let names = objects.names(thumbs.prefix()).await?;
    let dir = local_run.join(THUMBS);
    let _ = std::fs::create_dir_all(&dir);
    let mut made = HashSet::new();
    for name in names {
        if let Some(bytes) = thumbs.read(&thumbs.key(&name)).await?
            && std::fs::write(dir.join(&name), &bytes).is_ok()
        {
            made.insert(name);
        }
    }
    Ok(made)
}

/// Reads each recorded output of the run into the staging copy, where the report looks for
/// it; one that is gone from the bucket stays missing there too, and the page says so.
async fn stage_outputs(
    store: &Store,
    run_id: &str,
    run_url: &str,
    local_run: &Path,
) -> Result<(), Error> {
    let mut urls = Vec::new();
    let thumbs = local_run.join(THUMBS);
    store
        .each_output(run_id, false, |o| {
            if let Some(p) = o.path {
                // Its thumbnail is staged already: its header is all the report reads.
                let header_only = o
                    .sha256
                    .as_deref()
                    .is_some_and(|sha| thumb_path(&thumbs, sha).is_file());
                urls.push((p, header_only));
            }
            Ok(())
        })
        .await?;
    let staged: Vec<Result<(), Error>> = futures::stream::iter(urls)
        .map(|(url, header_only)| async move {
            let Some(rel) = super::under(&url, run_url) else {
                return Ok(());
            };
            let (objects, key) = Objects::at_url(&url).map_err(failed)?;
            let read = if header_only {
                objects.read_head(&key, HEADER_BYTES).await
            } else {
                objects.read(&key).await
            };
            let Some(bytes) = read.map_err(failed)? else {
                return Ok(());
            };
            let to = local_run.join(rel);
            if let Some(dir) = to.parent() {
                std::fs::create_dir_all(dir).map_err(failed)?;
            }
            std::fs::write(&to, &bytes).map_err(failed)?;
            if header_only {
                // Older than its thumbnail: the record is trusted, the file not hashed again.
                std::fs::File::options()
                    .write(true)
                    .open(&to)
                    .and_then(|f| f.set_modified(std::time::UNIX_EPOCH))
                    .map_err(failed)?;
            }
            Ok(())
        })
        .buffer_unordered(READS_IN_FLIGHT)
        .collect()
        .await;
    staged.into_iter().collect()
}

fn names_in(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|e| e.path().is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !crate::layout::is_leftover(n, false))
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
async fn put_pages(objects: &Objects, staged: &Staged<'_>, first: &str) -> Result<PathBuf, Error> {
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
    Ok(objects.key_url(&objects.key(first)).into())
}

/// Writes the pages beside `out`, a local file: their links still lead into the run's
/// prefix, for a page meant to be put there or browsed with it.
fn copy_pages(out: &Path, staged: &Staged<'_>) -> Result<PathBuf, Error> {
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
    Ok(out.to_path_buf())
}
