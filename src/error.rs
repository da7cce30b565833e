//! The top-level error of a command and its exit code. Exit codes are part of the interface
//! (cron jobs branch on them) and never change meaning.

use crate::api::download::DownloadError;
use crate::api::error::{ApiError, ErrorKind};
use crate::exec::Fatal;
use crate::money::caps::CapError;
use crate::plan::graph::GraphError;
use crate::store::StoreError;

/// Exit codes, documented in README.md.
pub mod exit {
    pub const SUCCESS: u8 = 0;
    /// Any failure without a more specific code.
    pub const FAILURE: u8 = 1;
    /// Invalid input or usage: nothing was sent.
    pub const INVALID: u8 = 2;
    /// Not enough credits, or over budget.
    pub const CREDITS: u8 = 3;
    /// A run finished with failed tasks.
    pub const TASKS_FAILED: u8 = 4;
    /// Another run holds the lock.
    pub const LOCKED: u8 = 5;
    /// A spending cap's window is spent: the run did tonight's share and goes on in the next
    /// window (the same run id again).
    pub const CAP: u8 = 6;
    /// The part of a run that was asked for (`--items`, `--until`, a reroll) is done; the
    /// rest is left pending for a later resume.
    pub const PART_DONE: u8 = 7;
    /// Interrupted by SIGINT or SIGTERM.
    pub const INTERRUPTED: u8 = 130;
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Api(#[from] ApiError),

    /// A download failed after its call was billed; `recover` says how to get the file.
    #[error("{source}\nhint: {recover}")]
    Download {
        #[source]
        source: DownloadError,
        recover: String,
    },

    /// Bad input caught before anything was sent.
    #[error("{message}{}", hint.as_ref().map(|h| format!("\nhint: {h}")).unwrap_or_default())]
    Usage {
        message: String,
        hint: Option<String>,
    },

    /// The work does not fit the budget or the balance, or cannot be priced.
    #[error("{message}{}", hint.as_ref().map(|h| format!("\nhint: {h}")).unwrap_or_default())]
    Refused {
        message: String,
        hint: Option<String>,
    },

    /// A confirmed price no longer holds once the run's lock is held and the work planned
    /// again (exit 3): nothing was spent, and the new price is in it.
    #[error("{0}\nhint: {hint}", hint = .0.hint())]
    Stale(#[from] crate::money::Stale),

    /// Another run of the pipeline holds the lock.
    #[error("{message}\nhint: {hint}")]
    Locked { message: String, hint: String },

    /// A spending cap's window has too little left: what fitted was done, the rest waits for
    /// the window to reopen.
    #[error("{message}\nhint: {hint}")]
    CapSpent { message: String, hint: String },

    /// The part of the run that was asked for is done, the rest left pending (exit 7).
    #[error("{message}\nhint: {hint}")]
    PartDone { message: String, hint: String },

    /// A run finished with failed tasks or downloads; the message names them.
    #[error("{message}")]
    TasksFailed { message: String },

    /// A run stopped because its run directory cannot keep outputs (a full disk, a permission
    /// lost, a bucket refusing writes); the hint says what is not stored and how to fetch it
    /// without paying again.
    #[error("{message}\nhint: {hint}")]
    StorageFailed { message: String, hint: String },

    /// A run stopped for a cause no retry cures: a refused key, a state database that
    /// cannot be written.
    #[error("the run stopped: {cause}\nhint: continue with: {continue_with}")]
    Stopped { cause: Fatal, continue_with: String },

    /// A pipeline whose tasks cannot be unrolled (a template naming a missing field).
    #[error(transparent)]
    Graph(#[from] GraphError),

    #[error("interrupted{}", detail.as_ref().map(|d| format!("; {d}")).unwrap_or_default())]
    Interrupted { detail: Option<String> },

    /// The state database failed: the run cannot be recorded, so it does not go on.
    #[error("{source}{}", source.hint().map(|h| format!("\nhint: {h}")).unwrap_or_default())]
    Store {
        #[from]
        source: StoreError,
    },

    /// The command's output could not be written (a full disk); a closed pipe is no error.
    #[error("cannot write to {stream}: {source}")]
    Output {
        stream: &'static str,
        source: std::io::Error,
    },

    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

impl From<CapError> for Error {
    /// A cap that no longer reads is bad input (exit 2), with the way to mend it.
    fn from(e: CapError) -> Self {
        match e {
            CapError::Unreadable(message) => {
                Error::usage(message, Some("set the cap again with `imgpipe cap set`"))
            }
            CapError::Window(message) => Error::Other(anyhow::anyhow!(message)),
            CapError::Store(source) => Error::Store { source },
        }
    }
}

impl Error {
    pub fn usage(message: impl Into<String>, hint: Option<&str>) -> Self {
        Error::Usage {
            message: message.into(),
            hint: hint.map(str::to_owned),
        }
    }

    pub fn exit_code(&self) -> u8 {
        match self {
            Error::Api(e) => match e {
                ApiError::Invalid(_) => exit::INVALID,
                ApiError::Answered { kind, .. } => match kind {
                    ErrorKind::Credits => exit::CREDITS,
                    ErrorKind::InvalidRequest => exit::INVALID,
                    _ => exit::FAILURE,
                },
                _ => exit::FAILURE,
            },
            Error::Usage { .. } | Error::Graph(_) => exit::INVALID,
            Error::Stopped { .. } | Error::StorageFailed { .. } => exit::FAILURE,
            Error::Refused { .. } | Error::Stale(_) => exit::CREDITS,
            Error::Interrupted { .. } => exit::INTERRUPTED,
            Error::TasksFailed { .. } => exit::TASKS_FAILED,
            Error::Locked { .. } => exit::LOCKED,
            Error::CapSpent { .. } => exit::CAP,
            Error::PartDone { .. } => exit::PART_DONE,
            Error::Store { source } if source.is_bad_input() => exit::INVALID,
            Error::Download { .. }
            | Error::Store { .. }
            | Error::Output { .. }
            | Error::Other(_) => exit::FAILURE,
        }
    }
}

/// A continuation refused says why with the exit code of its kind: 2 for what was asked
/// wrongly, 3 for what it would cost.
impl From<crate::money::admit::Refused> for Error {
    fn from(r: crate::money::admit::Refused) -> Error {
        Error::Refused {
            message: r.message,
            hint: Some(r.hint),
        }
    }
}

impl From<crate::resume::ResumeError> for Error {
    fn from(e: crate::resume::ResumeError) -> Self {
        use crate::resume::ResumeError;
        match e {
            ResumeError::Refused(r) if r.is_usage() => Error::Usage {
                message: r.message(),
                hint: r.hint(),
            },
            ResumeError::Refused(r) => Error::Refused {
                message: r.message(),
                hint: r.hint(),
            },
            ResumeError::Store(source) => Error::Store { source },
            ResumeError::Graph(e) => Error::Graph(e),
        }
    }
}

impl From<crate::resume::Refusal> for Error {
    fn from(r: crate::resume::Refusal) -> Self {
        crate::resume::ResumeError::Refused(r).into()
    }
}
