//! `manifest.jsonl`: one line per downloaded output of a run, rewritten from the database so it
//! always agrees with it.

use std::io::Write;

use serde::Serialize;

use crate::place::layout::MANIFEST;
use crate::place::{Address, Objects, RunDir, temp};
use crate::run_id::RunId;
use crate::store::{RecordedOutput, Store, StoreError};

#[derive(Serialize)]
struct Line<'a> {
    item: &'a str,
    step: &'a str,
    index: u32,
    job_id: &'a str,
    parent_job_id: Option<&'a str>,
    sha256: &'a str,
    bytes: u64,
    /// Relative to the run's directory.
    path: String,
    /// Credits billed for the call that made this output (shared by a generation's images).
    credits: u64,
}

/// Writes the manifest of `run_id` into `run_dir` through a temporary file and a rename,
/// streaming rows from the database to the file. In object storage it is made in memory and
/// put whole, in one request that replaces the one before.
pub async fn write(store: &Store, run_id: &RunId, run_dir: &RunDir) -> Result<Address, String> {
    let root = run_dir.root();
    let dir = match root {
        Address::Local(dir) => dir,
        Address::Object(url) => {
            let objects = Objects::open(url).map_err(|e| e.to_string())?;
            return write_object(store, run_id, root, &objects).await;
        }
    };
    let path = dir.join(MANIFEST);
    let fail = |e: &dyn std::fmt::Display| format!("cannot write {}: {e}", path.display());
    std::fs::create_dir_all(dir).map_err(|e| fail(&e))?;
    let tmp = temp::readable(dir).map_err(|e| fail(&e))?;
    let mut out = std::io::BufWriter::new(tmp);
    store
        .outputs()
        .each(run_id, false, |o| {
            if o.path.is_some() {
                let io = |e: std::io::Error| StoreError::Query(sqlx::Error::Io(e));
                serde_json::to_writer(&mut out, &line(&o, root)).map_err(|e| io(e.into()))?;
                out.write_all(b"\n").map_err(io)?;
            }
            Ok(())
        })
        .await
        .map_err(|e| fail(&e))?;
    let tmp = out.into_inner().map_err(|e| fail(&e.into_error()))?;
    tmp.as_file().sync_all().map_err(|e| fail(&e))?;
    tmp.persist(&path).map_err(|e| fail(&e.error))?;
    Ok(Address::Local(path))
}

async fn write_object(
    store: &Store,
    run_id: &RunId,
    root: &Address,
    objects: &Objects,
) -> Result<Address, String> {
    let mut out = Vec::new();
    store
        .outputs()
        .each(run_id, false, |o| {
            if o.path.is_some() {
                let io = |e: std::io::Error| StoreError::Query(sqlx::Error::Io(e));
                serde_json::to_writer(&mut out, &line(&o, root)).map_err(|e| io(e.into()))?;
                out.push(b'\n');
            }
            Ok(())
        })
        .await
        .map_err(|e| format!("cannot write the manifest of {}: {e}", objects.url()))?;
    let key = objects.key(MANIFEST);
    objects
        .replace(&key, out)
        .await
        .map_err(|e| e.to_string())?;
    Ok(Address::Object(objects.url_of(&key)))
}

/// A recorded output as the manifest lists it: its path relative to the run directory (the
/// recorded text whole for one outside it).
fn line<'a>(o: &'a RecordedOutput, run_dir: &Address) -> Line<'a> {
    let path = o.path.as_ref().map_or_else(String::new, |a| {
        a.relative_to(run_dir).unwrap_or_else(|| a.to_string())
    });
    Line {
        item: &o.task.item,
        step: &o.task.step,
        index: o.task.index + o.k,
        job_id: &o.job_id,
        parent_job_id: o.parent_job_id.as_deref(),
        sha256: o.sha256.as_deref().unwrap_or_default(),
        bytes: o.bytes.unwrap_or(0),
        path,
        credits: o.task_credits,
    }
}
