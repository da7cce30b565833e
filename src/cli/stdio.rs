//! Writing to stdout and stderr without ever panicking: `println!` panics when its stream is
//! closed or full (`imgpipe runs | head -0`, `>/dev/full`, `2>/dev/full`).
//!
//! - Data on stdout that cannot be written is an error: exit 1, said on stderr.
//! - A reader that went away (a broken pipe: `| head`) is not: what is left of the data is
//!   dropped, and the command ends as it would have, with its own exit code.
//! - Diagnostics on stderr that cannot be written are dropped: there is nowhere left to say so,
//!   and the exit code still tells what happened.

use std::fmt::Display;
use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::Error;

/// Set once a write to stdout met a broken pipe: nobody reads it any more.
static STDOUT_GONE: AtomicBool = AtomicBool::new(false);

/// Writes `text` to stdout as it is.
pub(super) fn print(text: &str) -> Result<(), Error> {
    if STDOUT_GONE.load(Ordering::Relaxed) {
        return Ok(());
    }
    let mut out = io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => {
            STDOUT_GONE.store(true, Ordering::Relaxed);
            Ok(())
        }
        Err(source) => Err(Error::Output {
            stream: "stdout",
            source,
        }),
    }
}

/// Writes `text` and a newline to stdout.
pub(super) fn line(text: impl Display) -> Result<(), Error> {
    print(&format!("{text}\n"))
}

/// Writes `text` and a newline to stderr, if it can be written.
pub(super) fn note(text: impl Display) {
    let mut err = io::stderr().lock();
    let _ = writeln!(err, "{text}").and_then(|()| err.flush());
}
