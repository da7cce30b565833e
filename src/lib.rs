//! imgpipe runs batches of image work against a paid image API without wasting a credit.
//!
//! # Layout
//! - [`api`]: the service as the spec describes it: wire types and their rules, the HTTP
//!   client, failures classified by what they mean for billing, downloads.
//! - [`sandbox`]: a faithful local emulator of the service, used by every test, by the
//!   benchmarks and by `--sandbox`.
//! - [`cli`]: the command line; one file per subcommand.
//! - [`error`]: the top-level error and the stable exit codes.

pub mod api;
pub mod cli;
pub mod error;
pub mod exec;
pub mod layout;
pub mod pipeline;
pub mod plan;
pub mod report;
pub mod sandbox;
pub mod store;

pub use error::{Error, exit};
