//! Integration tests: the real client and the real binary against the in-process sandbox.
//! Everything talks to 127.0.0.1 only.

// Benchmarks and tests report on stdout and stderr by design, and share helpers between
// their own modules.
#![allow(clippy::print_stdout, clippy::print_stderr, unreachable_pub)]

mod apply_crash;
mod binary;
mod broken;
mod browser;
mod caps;
mod checks;
mod checks_shown;
mod cli;
mod client;
mod cluster;
mod common;
mod crash;
mod deploy;
mod desk;
mod desk_browser;
mod desk_guard;
mod desk_run;
mod desk_thumbs;
mod docs;
mod events;
mod full_disk;
mod fuzz;
mod hostile;
mod objects;
mod places;
mod plan;
mod plan_rerolls;
mod postgres;
mod price_kept;
mod promises;
mod readme_promises;
mod report;
mod report_page;
mod resume;
mod review;
mod review_loop;
mod run;
mod runner;
mod said;
mod sandbox_http;
mod scale;
mod shared_rate;
mod signals;
mod spend;
mod toolchain;
mod totals;
mod validate;
