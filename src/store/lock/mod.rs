//! The run lock: one run of a pipeline at a time per state database, so overlapping cron jobs
//! cannot both pay for the same work.
//!
//! It is an OS file lock (`flock`), which the kernel releases when its process dies however it
//! dies: a lock left by a dead process never blocks. The file also says who holds it.
//!
//! The same lock tells a run still going from one whose process is gone ([`probe`]): a run
//! holds it from before it is recorded as running until after it records its end.
//!
//! With the state in PostgreSQL, hosts share it, so the lock is theirs to share too: an
//! advisory lock held by a connection of the run's own ([`pg`]), which the server releases
//! when that session ends, however the process died. Its holder is named in `run_locks`.

pub mod pg;

use crate::run_id::RunId;
use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::store::{Location, Store};

/// Who holds a lock, as its file says.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Holder {
    pub pid: u32,
    pub host: String,
    /// RFC 3339, UTC.
    pub since: String,
    pub run_id: RunId,
}

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("another imgpipe is running pipeline {pipeline}: {}", describe(holder.as_deref()))]
    Held {
        pipeline: String,
        holder: Option<Box<Holder>>,
        path: PathBuf,
    },
    #[error("cannot take the run lock {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot take the run lock in {location}: {reason}")]
    Database { location: String, reason: String },
}

fn describe(holder: Option<&Holder>) -> String {
    holder.map_or_else(
        || "its lock file says nothing more yet".to_owned(),
        |h| {
            format!(
                "run {} by pid {} on {} since {}",
                h.run_id, h.pid, h.host, h.since
            )
        },
    )
}

/// A held lock; dropping it releases it.
#[derive(Debug)]
pub struct RunLock {
    held: Held,
    fence: Option<crate::store::group::Fence>,
}

impl RunLock {
    fn postgres(watch: tokio::task::JoinHandle<()>, fence: crate::store::group::Fence) -> RunLock {
        RunLock {
            held: Held::Postgres(watch),
            fence: Some(fence),
        }
    }

    /// On PostgreSQL, who holds the lock as `run_locks` names it: what the run's records are
    /// fenced by ([`crate::store::Store::fence`]). A file lock cannot be lost while its
    /// process lives, so it needs none.
    pub fn fence(&self) -> Option<&crate::store::group::Fence> {
        self.fence.as_ref()
    }
}

impl Drop for RunLock {
    fn drop(&mut self) {
        if let Held::Postgres(watch) = &self.held {
            // The watch owns the session: ending it closes the session, and the server lets
            // go of the lock.
            watch.abort();
        }
    }
}

/// Held, never read: dropping it lets go of the lock.
#[derive(Debug)]
#[allow(dead_code)]
enum Held {
    File(File),
    /// The task that owns and watches the session holding the advisory lock.
    Postgres(tokio::task::JoinHandle<()>),
}

/// The lock file of `pipeline` for the database at `db`: beside the database, named by a hash
/// of the pipeline's name so any name makes a safe file name.
pub fn lock_path(db: &Path, pipeline: &str) -> PathBuf {
    let digest = hex::encode(Sha256::digest(pipeline.as_bytes()));
    let mut dir = db.as_os_str().to_owned();
    dir.push(".locks");
    PathBuf::from(dir).join(format!("{}.lock", &digest[..16]))
}

/// Takes the lock of `pipeline`, or fails at once naming its holder. With `wait`, blocks until
/// the holder is done instead; run it off the async threads.
pub fn acquire(
    db: &Path,
    pipeline: &str,
    run_id: &RunId,
    wait: bool,
) -> Result<RunLock, LockError> {
    let path = lock_path(db, pipeline);
    let io = |source| LockError::Io {
        path: path.clone(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    // Not truncated on open: the holder's details must survive a failed attempt.
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io)?;
    match try_lock(&file) {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) if wait => {
            tracing::info!("waiting for {}", describe(read_holder(&mut file).as_ref()));
            file.lock().map_err(io)?;
        }
        Err(TryLockError::WouldBlock) => {
            return Err(LockError::Held {
                pipeline: pipeline.to_owned(),
                holder: read_holder(&mut file).map(Box::new),
                path,
            });
        }
        Err(TryLockError::Error(e)) => return Err(io(e)),
    }
    let holder = Holder {
        pid: std::process::id(),
        host: hostname(),
        since: crate::time::rfc3339(std::time::SystemTime::now()),
        run_id: run_id.to_owned(),
    };
    let body = serde_json::to_vec(&holder).unwrap_or_default();
    file.set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| file.write_all(&body))
        .and_then(|()| file.sync_all())
        .map_err(io)?;
    Ok(RunLock {
        held: Held::File(file),
        fence: None,
    })
}

/// Takes the lock at once or says it is held. A [`probe`] holds it for an instant, so a
/// held lock is tried again for a moment before it counts as held.
fn try_lock(file: &File) -> Result<(), TryLockError> {
    let mut tries = 0;
    loop {
        match file.try_lock() {
            Err(TryLockError::WouldBlock) if tries < PROBE_RETRIES => {
                tries += 1;
                std::thread::sleep(PROBE_PAUSE);
            }
            other => return other,
        }
    }
}

/// How long [`try_lock`] keeps trying a held lock: far longer than a [`probe`] holds it.
const PROBE_RETRIES: u32 = 10;
const PROBE_PAUSE: std::time::Duration = std::time::Duration::from_millis(20);

/// What the lock of a pipeline says right now.
#[derive(Clone, Debug)]
pub enum Probe {
    /// No process holds it: no run of the pipeline is going.
    Free,
    /// A live process holds it; its file names the holder, once the holder has written it.
    Held(Option<Holder>),
}

/// Whether a live process holds the lock of `pipeline` for the database at `db`, without
/// creating anything. The lock is taken shared for an instant to ask the kernel (which
/// `acquire` allows for), then let go.
pub fn probe(db: &Path, pipeline: &str) -> std::io::Result<Probe> {
    let path = lock_path(db, pipeline);
    let mut file = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Probe::Free),
        Err(e) => return Err(e),
    };
    match file.try_lock_shared() {
        Ok(()) => Ok(Probe::Free),
        Err(TryLockError::WouldBlock) => Ok(Probe::Held(read_holder(&mut file))),
        Err(TryLockError::Error(e)) => Err(e),
    }
}

/// What the run lock of `pipeline` in `store` says right now, whichever backend keeps it.
pub async fn probe_store(store: &Store, pipeline: &str) -> Result<Probe, String> {
    match store.location() {
        Location::File(db) => probe(db, pipeline).map_err(|e| e.to_string()),
        Location::Postgres(_) => pg::probe(store, pipeline).await.map_err(|e| e.to_string()),
    }
}

fn read_holder(file: &mut File) -> Option<Holder> {
    let mut text = String::new();
    file.rewind().ok()?;
    file.read_to_string(&mut text).ok()?;
    serde_json::from_str(&text).ok()
}

pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "an unknown host".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_taker_is_told_who_holds_the_lock_until_it_is_released() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("state.db");
        let first = acquire(&db, "nightly", &RunId::from("r1"), false).unwrap();
        let err = acquire(&db, "nightly", &RunId::from("r2"), false).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("run r1 by pid"), "{text}");
        assert!(text.contains(&std::process::id().to_string()), "{text}");
        assert!(acquire(&db, "another pipeline", &RunId::from("r3"), false).is_ok());
        drop(first);
        assert!(acquire(&db, "nightly", &RunId::from("r2"), false).is_ok());
    }

    #[test]
    fn a_probe_sees_the_holder_and_a_free_lock_and_never_keeps_it() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("state.db");
        assert!(matches!(probe(&db, "nightly").unwrap(), Probe::Free));
        assert!(
            !db.with_extension("db.locks").exists(),
            "a probe creates nothing"
        );
        let held = acquire(&db, "nightly", &RunId::from("r1"), false).unwrap();
        match probe(&db, "nightly").unwrap() {
            Probe::Held(Some(h)) => assert_eq!(h.run_id, "r1"),
            other => panic!("{other:?}"),
        }
        drop(held);
        assert!(matches!(probe(&db, "nightly").unwrap(), Probe::Free));
        // A probe lets go at once: the lock can be taken right after it.
        assert!(acquire(&db, "nightly", &RunId::from("r2"), false).is_ok());
    }
}
