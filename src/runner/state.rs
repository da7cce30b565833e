//! Where the state database is, opening it, and the lock that keeps one run of a pipeline at
//! a time. Commands that run create the database; commands that only read never do, so a
//! mistyped path is said rather than left behind as an empty database.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::error::Error;
use crate::run_id::RunId;
use crate::store::{self, Location, Store, lock::RunLock};

/// Said whenever a database or a run is not where the user looked.
pub const NO_DATABASE_HINT: &str = "--state (or IMGPIPE_STATE) names the database the run used; runs made with --sandbox are in sandbox.db beside the default one: add --sandbox";

/// The state database's place, resolved once from `--state`/`IMGPIPE_STATE`, else the
/// default file under `$XDG_STATE_HOME` or `~/.local/state`.
#[derive(Clone, Debug)]
pub struct StateLocation {
    location: Location,
}

impl StateLocation {
    /// Runs on the embedded sandbox get their own database by default: its jobs vanish with
    /// it, so they must never mix with, or be reused by, runs against the real service.
    pub fn resolve(flag: Option<Location>, sandbox: bool) -> Result<StateLocation, Error> {
        let default = || {
            store::default_path().map(|p| {
                if sandbox {
                    p.with_file_name(store::SANDBOX_FILE)
                } else {
                    p
                }
            })
        };
        let location = flag
            .or_else(|| default().map(Location::File))
            .ok_or_else(|| {
                Error::usage(
                    "no place for the state database: HOME and XDG_STATE_HOME are unset",
                    Some("pass --state PATH or set IMGPIPE_STATE"),
                )
            })?;
        Ok(StateLocation { location })
    }

    pub fn location(&self) -> &Location {
        &self.location
    }

    /// Whether there is a database to read: a file that exists; a PostgreSQL database is
    /// asked when opened.
    pub fn exists(&self) -> bool {
        self.location.file().is_none_or(std::path::Path::exists)
    }

    /// Opens the database, creating it when missing.
    pub async fn open(&self) -> Result<Store, Error> {
        Ok(Store::open_at(&self.location).await?)
    }

    /// Opens the database of a command that reads what runs recorded.
    pub async fn open_existing(&self) -> Result<Store, Error> {
        if !self.exists() {
            return Err(Error::usage(
                format!("there is no state database at {}", self.location),
                Some(NO_DATABASE_HINT),
            ));
        }
        Ok(Store::open_existing(&self.location).await?)
    }
}

/// Everything is committed already; closing only tidies the WAL, and must not hang an exit.
pub async fn close<T>(store: Store, result: Result<T, Error>) -> Result<T, Error> {
    let _ = tokio::time::timeout(Duration::from_secs(5), store.close()).await;
    result
}

pub fn no_such_run(store: &Store, run_id: &RunId) -> Error {
    Error::usage(
        format!(
            "there is no run {:?} in {}",
            run_id.as_str(),
            store.location()
        ),
        Some(
            "`imgpipe runs` lists the runs; --state (or IMGPIPE_STATE) picks another database, and --sandbox the one of runs made with --sandbox",
        ),
    )
}

/// One run of a pipeline at a time per state database: exit 5 naming the holder, or wait
/// (until the holder ends, or `shutdown`).
pub async fn lock(
    store: &Store,
    pipeline: &str,
    run_id: &RunId,
    wait: bool,
    shutdown: &CancellationToken,
) -> Result<RunLock, Error> {
    let own;
    let pipeline = if crate::failpoint::mutated(crate::failpoint::RUN_LOCK_SKIPPED) {
        own = format!("{pipeline}-{}", std::process::id());
        own.as_str()
    } else {
        pipeline
    };
    let taking = async {
        match store.location() {
            Location::File(db) => {
                let (db, name, id) = (db.clone(), pipeline.to_owned(), run_id.to_owned());
                tokio::task::spawn_blocking(move || store::lock::acquire(&db, &name, &id, wait))
                    .await
                    .map_err(|e| Error::Other(e.into()))
            }
            Location::Postgres(url) => {
                Ok(store::lock::pg::acquire(url, pipeline, run_id, wait, shutdown.clone()).await)
            }
        }
    };
    let taken = tokio::select! {
        taken = taking => taken?,
        () = shutdown.cancelled() => {
            return Err(Error::Interrupted { detail: Some("nothing was started".into()) });
        }
    };
    let lock = taken.map_err(|e| match e {
        store::lock::LockError::Held { .. } => Error::Locked {
            message: e.to_string(),
            hint: "wait for it with --wait; a lock left by a process that died never blocks".into(),
        },
        other => Error::Other(other.into()),
    })?;
    if let Some(fence) = lock.fence() {
        store.fence(fence.clone());
    }
    Ok(lock)
}
