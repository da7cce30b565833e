//! Integration tests: the real client and the real binary against the in-process sandbox.
//! Everything talks to 127.0.0.1 only.

mod broken;
mod browser;
mod cli;
mod client;
mod common;
mod crash;
mod hostile;
mod plan;
mod report;
mod report_page;
mod resume;
mod run;
mod sandbox_http;
mod validate;
