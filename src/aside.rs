//! Outputs set aside under `_superseded/`: where each goes, and the moves of their files or
//! objects. A move is journaled in the transaction that sets its output aside
//! ([`crate::store::Revisions`]) and made after its commit, so a process killed in between
//! leaves a journal the next resume finishes. Resumes set aside what a run will pay for
//! again; the executor sets aside what a check failed, before it pays for its task again.

use std::path::Path;

use crate::api::job_id::JobId;
use crate::place::{Address, ObjectError, ObjectUrl, Objects, RunDir};
use crate::sha256::Sha256Sum;
use crate::store::{PendingMove, RecordedOutput, Store, StoreError};

/// Makes journaled moves, then forgets them.
pub async fn make_moves(store: &Store, moves: Vec<PendingMove>) -> Result<(), StoreError> {
    if moves.is_empty() {
        return Ok(());
    }
    let mut done = Vec::with_capacity(moves.len());
    for m in moves {
        let moved = move_one(&m.from, &m.to).await;
        done.push((m, moved));
        if done.len() == 1 {
            crate::failpoint::hit("resume-apply-moving");
        }
    }
    store.revisions().finish_moves(&done).await
}

/// Moves a file or object from `from` to `to` (as the journal holds them), never replacing
/// anything at `to`; the size now at `to`, or `None` when there was nothing to move. A move
/// already made (by a resume killed before it could forget it) is found made.
pub async fn move_one(from: &str, to: &str) -> Option<u64> {
    match (Address::recorded(from), Address::recorded(to)) {
        (Address::Object(from), Address::Object(to)) => match set_aside(&from, &to).await {
            Some(size) => Some(size),
            None => size_of(&to).await,
        },
        (Address::Local(from), Address::Local(to)) => {
            tokio::task::spawn_blocking(move || move_file(&from, &to))
                .await
                .ok()
                .flatten()
        }
        // Never journaled: a file is set aside in its own run directory.
        _ => {
            tracing::warn!("cannot move {from} aside to {to}: one is a file, the other an object");
            None
        }
    }
}

fn move_file(from: &Path, to: &Path) -> Option<u64> {
    if let Ok(there) = std::fs::metadata(to) {
        return Some(there.len());
    }
    let dir = to.parent().unwrap_or(Path::new("."));
    match std::fs::create_dir_all(dir).and_then(|()| std::fs::rename(from, to)) {
        Ok(()) => std::fs::metadata(to).ok().map(|m| m.len()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => {
            tracing::warn!("cannot move {} aside: {e}", from.display());
            None
        }
    }
}

/// Where an output's file (or object) goes when set aside:
/// `<run>/_superseded/<item>/<name>.o<output id>.<job>[.<tag>].<ext>`, `<job>` the first 8 hex
/// digits of its job id's sha256; `None` when it has none. The job is in the name because
/// SQLite gives a new output the row id of the last one deleted: a task set aside twice (a
/// check's reroll, then another) would otherwise name the second file as the first, and a
/// move that finds its place taken counts itself made, leaving the file where the next
/// download must write.
pub fn aside_path(run_dir: &RunDir, o: &RecordedOutput, tag: Option<&str>) -> Option<String> {
    let name = o.path.as_ref()?.file_name()?;
    let name = Path::new(&name);
    let stem = name.file_stem()?.to_string_lossy().into_owned();
    let ext = name
        .extension()
        .map(|e| format!(".{}", e.to_string_lossy()))
        .unwrap_or_default();
    let tag = tag.map(|t| format!(".{t}")).unwrap_or_default();
    let to = run_dir.superseded(&o.task.item).join(&format!(
        "{stem}.o{}.{}{tag}{ext}",
        o.id,
        job_mark(&o.job_id)
    ));
    Some(to.to_string())
}

/// A short mark of a job id fit for a file name, whatever the service's ids hold.
fn job_mark(job: &JobId) -> String {
    Sha256Sum::of_bytes(job.as_str().as_bytes())[..8].to_owned()
}

/// Copies the object at `from` to `to` (create-only) and removes it from `from`; returns the
/// size moved, `None` when there was nothing at `from` or it could not be kept (then it is
/// left where it is, and said). The bytes pass through a temporary file, never held whole.
async fn set_aside(from: &ObjectUrl, to: &ObjectUrl) -> Option<u64> {
    let moved = async {
        let (objects, key) = Objects::at(from)?;
        let (_, to_key) = Objects::at(to)?;
        let copy = tempfile::NamedTempFile::new().map_err(|e| ObjectError::Request {
            what: "cannot make a temporary copy of",
            url: objects.key_url(&key),
            reason: e.to_string(),
            store_failed: false,
        })?;
        let Some((sha, size)) = objects.read_to_file(&key, copy.path()).await? else {
            return Ok(None);
        };
        objects.put_new_file(&to_key, copy.path(), &sha).await?;
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
async fn size_of(url: &ObjectUrl) -> Option<u64> {
    let (objects, key) = Objects::at(url).ok()?;
    objects.stat(&key).await.ok().flatten().map(|s| s.bytes)
}
