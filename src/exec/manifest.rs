//! `manifest.jsonl`: one line per downloaded output of a run, rewritten from the database so it
//! always agrees with it.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::store::{OutputRow, Store, StoreError};

pub const FILE: &str = "manifest.jsonl";

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

/// Writes the manifest of `run_id` into `run_dir` through a temporary file and a rename.
pub async fn write(store: &Store, run_id: &str, run_dir: &Path) -> Result<PathBuf, String> {
    let outputs = store
        .outputs(run_id)
        .await
        .map_err(|e: StoreError| e.to_string())?;
    let mut body = Vec::new();
    for o in outputs.iter().filter(|o| o.path.is_some()) {
        let line = line(o, run_dir);
        serde_json::to_writer(&mut body, &line).map_err(|e| e.to_string())?;
        body.push(b'\n');
    }
    let path = run_dir.join(FILE);
    std::fs::create_dir_all(run_dir).map_err(|e| format!("{}: {e}", run_dir.display()))?;
    let write = || -> std::io::Result<()> {
        let mut tmp = tempfile::NamedTempFile::new_in(run_dir)?;
        tmp.write_all(&body)?;
        tmp.as_file().sync_all()?;
        tmp.persist(&path).map_err(|e| e.error)?;
        Ok(())
    };
    write().map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(path)
}

fn line<'a>(o: &'a OutputRow, run_dir: &Path) -> Line<'a> {
    let full = Path::new(o.path.as_deref().unwrap_or_default());
    let path = full
        .strip_prefix(run_dir)
        .unwrap_or(full)
        .to_string_lossy()
        .into_owned();
    Line {
        item: &o.item,
        step: &o.step,
        index: o.idx + o.k,
        job_id: &o.job_id,
        parent_job_id: o.parent_job_id.as_deref(),
        sha256: o.sha256.as_deref().unwrap_or_default(),
        bytes: o.bytes.unwrap_or(0),
        path,
        credits: o.task_credits,
    }
}
