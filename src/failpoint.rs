//! Test-only faults, each set by an environment variable read once per process:
//!
//! - crash points, for the tests that prove a step crash-safe: `IMGPIPE_TEST_CRASH_AT=NAME`
//!   makes the process abort at the point named NAME, as a `kill -9` there would, with nothing
//!   flushed and no destructor run; a point then costs a comparison at most;
//! - a disk that fills: `IMGPIPE_TEST_DISK_FULL_AFTER=N` lets the process keep N outputs in a
//!   local run directory, then fails every further one with ENOSPC, as a full disk would
//!   (without root, and the same on every machine); a kept output then costs an atomic add.

/// The environment variable naming the point to crash at (tests only).
pub const ENV: &str = "IMGPIPE_TEST_CRASH_AT";

/// Aborts the process when `IMGPIPE_TEST_CRASH_AT` names this point.
pub fn hit(name: &str) {
    static AT: std::sync::OnceLock<Option<std::ffi::OsString>> = std::sync::OnceLock::new();
    if AT
        .get_or_init(|| std::env::var_os(ENV))
        .as_ref()
        .is_some_and(|v| v == name)
    {
        tracing::error!("{ENV}={name}: aborting here, as a kill -9 would");
        std::process::abort();
    }
}

/// The environment variable that fills the disk under a run's local outputs (tests only).
pub const DISK_FULL_ENV: &str = "IMGPIPE_TEST_DISK_FULL_AFTER";

/// ENOSPC ("No space left on device") once this process has kept the outputs that
/// `IMGPIPE_TEST_DISK_FULL_AFTER` allows in local directories, for every output after; `None`
/// without the variable. Each call counts one output about to be kept.
pub fn disk_full() -> Option<std::io::Error> {
    let room = disk_room()?;
    (KEPT.fetch_add(1, Ordering::Relaxed) >= room).then(no_space)
}

/// ENOSPC when the disk `IMGPIPE_TEST_DISK_FULL_AFTER` sets is full already; counts nothing
/// (a run's check that it can write, before it pays).
pub fn disk_is_full() -> Option<std::io::Error> {
    let room = disk_room()?;
    (KEPT.load(Ordering::Relaxed) >= room).then(no_space)
}

use std::sync::atomic::{AtomicU64, Ordering};

/// Outputs kept so far under `IMGPIPE_TEST_DISK_FULL_AFTER`.
static KEPT: AtomicU64 = AtomicU64::new(0);

fn disk_room() -> Option<u64> {
    static ROOM: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *ROOM.get_or_init(|| std::env::var(DISK_FULL_ENV).ok()?.parse().ok())
}

fn no_space() -> std::io::Error {
    // 28 is ENOSPC on Linux, macOS and the BSDs.
    std::io::Error::from_raw_os_error(28)
}

/// The environment variable naming a guarantee to break on purpose (tests only): the fault
/// campaign (`cargo bench --bench nemesis -- --mutate NAME`) proves that its invariants catch
/// each of [`MUTATIONS`].
pub const MUTATE_ENV: &str = "IMGPIPE_TEST_MUTATE";

/// The run's lock is taken under a name of this process's own, so it never excludes anyone.
pub const RUN_LOCK_SKIPPED: &str = "run-lock-skipped";
/// An attempt's intent is recorded after its call is answered, not before it is sent.
pub const INTENT_AFTER_CALL: &str = "intent-after-call";
/// A confirm's revision is not compared with the run's: only its credits are.
pub const REVISION_IGNORED: &str = "revision-ignored";
/// Every spend fits the budget: the cap a run may spend is never held against it.
pub const BUDGET_IGNORED: &str = "budget-ignored";
/// A resume forgets the rerolls the checks asked for before it: `max_rerolls` and
/// `rerolls.max_credits` start again from nothing.
pub const REROLLS_FORGOTTEN: &str = "rerolls-forgotten";

/// The guarantees `IMGPIPE_TEST_MUTATE` can break, one at a time.
pub const MUTATIONS: &[&str] = &[
    RUN_LOCK_SKIPPED,
    INTENT_AFTER_CALL,
    REVISION_IGNORED,
    BUDGET_IGNORED,
    REROLLS_FORGOTTEN,
];

/// Whether `IMGPIPE_TEST_MUTATE` breaks the guarantee `name` in this process.
pub fn mutated(name: &str) -> bool {
    static MUTATE: std::sync::OnceLock<Option<std::ffi::OsString>> = std::sync::OnceLock::new();
    MUTATE
        .get_or_init(|| std::env::var_os(MUTATE_ENV))
        .as_ref()
        .is_some_and(|v| v == name)
}
