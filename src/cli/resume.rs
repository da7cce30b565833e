//! `imgpipe resume RUN_ID`: continue an interrupted run without paying twice for what it
//! already did; `--dry-run` lists what it would pay for, and why.

use crate::run_id::RunId;
use clap::Args;
use tokio_util::sync::CancellationToken;

use crate::cli::GlobalArgs;
use crate::cli::args::{PartArgs, RunOptions, after, quote};
use crate::cli::view::Terminal;
use crate::error::Error;
use crate::runner::Runner;

#[derive(Debug, Args)]
pub struct ResumeArgs {
    /// The run to resume (`imgpipe runs` lists them)
    pub run_id: RunId,
    /// List what resuming would pay for, and why, without spending anything
    #[arg(long, help_heading = "Run")]
    pub dry_run: bool,
    #[command(flatten)]
    pub part: PartArgs,
    #[command(flatten)]
    pub opts: RunOptions,
}

pub(super) async fn run(
    args: &ResumeArgs,
    global: &GlobalArgs,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let (settings, service) = args.opts.settings(&args.part)?;
    let words = |scoped: bool| after(&args.opts.continue_flags(scoped.then_some(&args.part)));
    let (scoped, all) = (words(true), words(false));
    let view = Terminal {
        json: global.json,
        quiet: global.quiet,
        continue_with: Box::new(move |id, part| {
            let flags = if part { &scoped } else { &all };
            format!("imgpipe resume {}{flags}", quote(id))
        }),
    };
    let runner = Runner {
        settings: &settings,
        service: &service,
        view: &view,
        shutdown,
    };
    runner.resume(&args.run_id, args.dry_run).await
}
