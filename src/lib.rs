//! imgpipe runs batches of image work against a paid image API without wasting a credit.
//!
//! # Layout, in the order data flows
//! - [`pipeline`]: pipeline files: YAML with every position kept, typed, checked, items and
//!   templates; a [`pipeline::Pipeline`] is a checked DAG of steps over a batch of items.
//! - [`plan`]: the cost plan: every step priced (the one place a task's price is computed),
//!   the total against the budget and the balance, and the task graph the executor runs.
//! - [`runner`]: the lifecycle of a run: state database, lock, fresh or continued run,
//!   admission, price discovery, execution and conclusion; what `run`, `resume` and
//!   `plan --reuse` call.
//! - [`exec`]: the executor: the scheduler, budget, rate limiter, attempts, downloads, the
//!   manifest, task identities and the review of a run to resume.
//! - [`store`]: the SQLite state database (migrations in `migrations/`) and the run lock.
//! - [`api`]: the service as the spec describes it: wire types and their rules, the HTTP
//!   client, failures classified by what they mean for billing, downloads.
//! - [`report`]: what the record says of a run: its summary and status, and its HTML page.
//! - [`sandbox`]: a faithful local emulator of the service, used by every test, by the
//!   benchmarks and by `--sandbox`.
//! - [`cli`]: the command line: one file per subcommand that parses, calls the library and
//!   renders.
//! - [`error`]: the top-level error and the stable exit codes.
//! - [`time`]: times as RFC 3339, the same in plans, locks, logs and reports.

// The library needs no unsafe code; the test and bench harnesses call libc themselves.
#![forbid(unsafe_code)]

pub mod api;
pub mod cli;
pub mod error;
pub mod exec;
pub mod layout;
pub mod pipeline;
pub mod plan;
pub mod report;
pub mod runner;
pub mod sandbox;
pub mod store;
pub mod time;

pub use error::{Error, exit};
