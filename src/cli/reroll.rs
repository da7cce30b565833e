//! `imgpipe reroll RUN_ID TASK...`: pay again for chosen tasks of a run and everything
//! downstream of them that ran, priced and held against the budget first; `--dry-run` shows
//! each task and the total.

use crate::run_id::RunId;
use clap::Args;
use tokio_util::sync::CancellationToken;

use crate::cli::GlobalArgs;
use crate::cli::args::{PartArgs, RunOptions, after, quote};
use crate::cli::view::Terminal;
use crate::error::Error;
use crate::resume::Target;
use crate::runner::Runner;

#[derive(Debug, Args)]
pub struct RerollArgs {
    /// The run (`imgpipe runs` lists them)
    pub run_id: RunId,
    /// What to pay for again: an item (`mug`), one of its steps (`mug/clean`), a step of every
    /// item that ran it (`'*/clean'`) or one task (`mug/clean[0]`); what is downstream of it is
    /// paid for again too
    #[arg(required = true, value_name = "TASK")]
    pub tasks: Vec<Target>,
    /// Show each task it would pay for again, and the total, without spending anything
    #[arg(long, help_heading = "Run")]
    pub dry_run: bool,
    #[command(flatten)]
    pub opts: RunOptions,
}

pub(super) async fn run(
    args: &RerollArgs,
    global: &GlobalArgs,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let (settings, service) = args.opts.settings(&PartArgs::default())?;
    let targets = &args.tasks;
    let words: Vec<String> = targets.iter().map(|t| quote(&t.to_string())).collect();
    let flags = after(&args.opts.continue_flags(None));
    let tasks = words.join(" ");
    let view = Terminal {
        json: global.json,
        quiet: global.quiet,
        continue_with: Box::new(move |id, part| {
            if part {
                format!("imgpipe reroll {} {tasks}{flags}", quote(id))
            } else {
                format!("imgpipe resume {}{flags}", quote(id))
            }
        }),
    };
    let runner = Runner {
        settings: &settings,
        service: &service,
        view: &view,
        shutdown,
    };
    runner.reroll(&args.run_id, targets, args.dry_run).await
}
