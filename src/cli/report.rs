//! `imgpipe report RUN_ID`: the run's HTML page, from the state database and the run's files;
//! no network, and no lock, so it works on a run still going.

use crate::run_id::RunId;
use clap::Args;

use crate::cli::GlobalArgs;
use crate::cli::args::StateArgs;
use crate::cli::stdio;
use crate::cli::view::print_json;
use crate::error::Error;
use crate::place::Address;
use crate::report::{self, Written};
use crate::runner::state::close;
use crate::store::Store;

#[derive(Debug, Args)]
pub struct ReportArgs {
    /// The run (`imgpipe runs` lists them)
    pub run_id: RunId,
    /// Where to write the page [default: report.html in the run's directory]
    #[arg(long, value_name = "FILE", value_parser = crate::cli::args::out_place)]
    pub out: Option<Address>,
    #[command(flatten)]
    pub state: StateArgs,
    /// Look in the database of runs made with --sandbox
    #[arg(long)]
    pub sandbox: bool,
}

pub(super) async fn run(args: &ReportArgs, global: &GlobalArgs) -> Result<(), Error> {
    let store = args.state.location(args.sandbox)?.open_existing().await?;
    let written = write(&store, args).await;
    let written = close(store, written).await?;
    if global.json {
        return print_json(&written);
    }
    stdio::line(format_args!(
        "report of run {} ({}): {} ({} images, {} new thumbnails)",
        written.run_id, written.status, written.path, written.images, written.thumbnails_made
    ))?;
    let observed = &written.observed;
    if let (Some(process), Some(command)) = (
        observed.process.as_ref().filter(|p| !p.alive),
        &observed.continue_with,
    ) {
        stdio::line(format_args!(
            "run {}: process {}\nhint: continue it with: {command}",
            written.run_id,
            process.describe()
        ))?;
    }
    Ok(())
}

async fn write(store: &Store, args: &ReportArgs) -> Result<Written, Error> {
    let (run, observed) = args
        .state
        .observed_run(store, &args.run_id, args.sandbox)
        .await?;
    report::write(store, run, args.out.as_ref(), observed).await
}
