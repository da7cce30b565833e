//! `manifest.jsonl`: one line per downloaded output of a run, rewritten from the database so it
//! always agrees with it.

use std::io::Write;

use serde::Serialize;

use crate::api::job_id::JobId;
use crate::place::layout::MANIFEST;
use crate::place::{Address, Objects, RunDir, temp};
use crate::run_id::RunId;
use crate::sha256::Sha256Sum;
use crate::store::{RecordedOutput, Store, StoreError};

#[derive(Serialize)]
struct Line<'a> {
    item: &'a str,
    step: &'a str,
    index: u32,
    job_id: &'a JobId,
    parent_job_id: Option<&'a JobId>,
    sha256: &'a Sha256Sum,
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
            if let Some(line) = line(&o, root) {
                let io = |e: std::io::Error| StoreError::Query(sqlx::Error::Io(e));
                serde_json::to_writer(&mut out, &line).map_err(|e| io(e.into()))?;
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
            if let Some(line) = line(&o, root) {
                let io = |e: std::io::Error| StoreError::Query(sqlx::Error::Io(e));
                serde_json::to_writer(&mut out, &line).map_err(|e| io(e.into()))?;
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

/// A recorded output as the manifest lists it, when it was kept (a file or an object, and its
/// digest): its path relative to the run directory (the recorded text whole for one outside
/// it).
fn line<'a>(o: &'a RecordedOutput, run_dir: &Address) -> Option<Line<'a>> {
    let (path, sha256) = (o.path.as_ref()?, o.sha256.as_ref()?);
    Some(Line {
        item: &o.task.item,
        step: &o.task.step,
        index: o.task.index + o.k,
        job_id: &o.job_id,
        parent_job_id: o.parent_job_id.as_ref(),
        sha256,
        bytes: o.bytes.unwrap_or(0),
        path: path
            .relative_to(run_dir)
            .unwrap_or_else(|| path.to_string()),
        credits: o.task_credits,
    })
}
