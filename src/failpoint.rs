//! Crash points for the tests that prove a step crash-safe: `IMGPIPE_TEST_CRASH_AT=NAME` makes
//! the process abort at the point named NAME, as a `kill -9` there would, with nothing flushed
//! and no destructor run. The variable is read once per process; a point then costs a
//! comparison at most.

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
