//! What the record says of a run, read from the state database alone (no pipeline file, no
//! network), for a run finished or still going:
//! - [`summary`]: the summary `run` and `resume` print when a run ends, and what `status`
//!   shows at any time;
//! - [`live`]: whether a run recorded as `running` still has its process;
//! - [`page`]: the run's HTML page, with its thumbnails and, for a run in object storage, its
//!   staging.
//!
//! What was billed across runs (`imgpipe spend`) is the ledger's, not a run's report:
//! the `ledger` module, a layer above this one.

pub mod live;
pub mod page;
pub mod runs;
pub mod summary;

pub use page::{MARKER, Written, write};
