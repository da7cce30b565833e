//! `imgpipe run FILE`: plan, refuse what cannot be paid for, then execute with every step
//! recorded in the state database and every output downloaded.

use crate::run_id::RunId;
use std::path::PathBuf;

use clap::Args;
use tokio_util::sync::CancellationToken;

use crate::cli::GlobalArgs;
use crate::cli::args::{PartArgs, RunOptions, quote};
use crate::cli::view::{ContinueWith, Terminal};
use crate::error::Error;
use crate::runner::{RunRequest, Runner};

#[derive(Debug, Args)]
pub struct RunArgs {
    /// The pipeline file (optional with --plan, which names it)
    #[arg(required_unless_present = "plan")]
    pub file: Option<PathBuf>,
    /// Run exactly this saved plan (from `imgpipe plan --save`); refuse if anything changed
    #[arg(long, value_name = "PLAN.json", help_heading = "Run")]
    pub plan: Option<PathBuf>,
    /// Print the plan (or, for a run that exists, what resuming it would pay for) and stop
    #[arg(long, help_heading = "Run")]
    pub dry_run: bool,
    /// The run's id: names its directory under the output directory. An unfinished run of
    /// that id is resumed; a finished one is only summarised [default: the time and a random
    /// suffix]
    #[arg(long, value_name = "ID", help_heading = "Run")]
    pub run_id: Option<RunId>,
    /// Output directory, instead of the pipeline's output_dir: a path or s3://bucket/prefix
    /// (credentials from the AWS_* environment variables)
    #[arg(long, value_name = "DIR", help_heading = "Run", value_parser = crate::cli::args::out_place)]
    pub out: Option<crate::place::Address>,
    /// When the generation price is unknown, run one generation first and price the plan
    /// with what it billed
    #[arg(long, help_heading = "Budget")]
    pub discover_price: bool,
    #[command(flatten)]
    pub part: PartArgs,
    #[command(flatten)]
    pub opts: RunOptions,
}

pub(super) async fn run(
    args: &RunArgs,
    global: &GlobalArgs,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let (settings, service) = args.opts.settings(&args.part)?;
    let request = RunRequest {
        file: args.file.clone(),
        saved_plan: args.plan.clone(),
        run_id: args.run_id.clone(),
        out: args.out.clone(),
        discover_price: args.discover_price,
        dry_run: args.dry_run,
    };
    let view = Terminal {
        json: global.json,
        quiet: global.quiet,
        continue_with: continue_with(args),
    };
    let runner = Runner {
        settings: &settings,
        service: &service,
        view: &view,
        shutdown,
    };
    runner.run(&request).await
}

/// `imgpipe run FILE --run-id ID` with every flag the run was given that continuing it needs.
fn continue_with(args: &RunArgs) -> ContinueWith {
    let (scoped, all) = (command_after(args, true), command_after(args, false));
    Box::new(move |id, part| {
        let (file, after) = if part { &scoped } else { &all };
        format!("imgpipe run{file} --run-id {}{after}", quote(id))
    })
}

/// The words of the continue command before and after its run id.
fn command_after(args: &RunArgs, scoped: bool) -> (String, String) {
    let file = args.file.as_ref().map(|f| quote(&f.display().to_string()));
    let mut after = args.opts.continue_flags(scoped.then_some(&args.part));
    if let Some(out) = &args.out {
        after.push("--out".into());
        after.push(quote(&out.to_string()));
    }
    if let Some(plan) = &args.plan
        && file.is_none()
    {
        after.push("--plan".into());
        after.push(quote(&plan.display().to_string()));
    }
    let after = crate::cli::args::after(&after);
    let file = file.map(|f| format!(" {f}")).unwrap_or_default();
    (file, after)
}
