//! `imgpipe runs`: the runs in the state database, without any network call.

use clap::Args;

use crate::cli::GlobalArgs;
use crate::cli::args::StateArgs;
use crate::cli::stdio;
use crate::cli::view::print_json;
use crate::error::Error;
use crate::report::runs::RunLine;
use crate::runner::state::{NO_DATABASE_HINT, close};

#[derive(Debug, Args)]
pub struct RunsArgs {
    #[command(flatten)]
    pub state: StateArgs,
    /// Look in the database of runs made with --sandbox
    #[arg(long)]
    pub sandbox: bool,
}

pub(super) async fn run(args: &RunsArgs, global: &GlobalArgs) -> Result<(), Error> {
    let location = args.state.location(args.sandbox)?;
    if !location.exists() {
        if global.json {
            return print_json(&Vec::<RunLine>::new());
        }
        stdio::line(format_args!(
            "no runs yet: there is no state database at {}\nhint: {NO_DATABASE_HINT}",
            location.location()
        ))?;
        return Ok(());
    }
    let store = location.open_existing().await?;
    let lines = close(store.clone(), lines(&store, args).await).await?;
    if global.json {
        return print_json(&lines);
    }
    if lines.is_empty() {
        stdio::line(format_args!("no runs yet in {}", store.location()))?;
        return Ok(());
    }
    let width = lines.iter().map(|l| l.id.len()).max().unwrap_or(2).max(2);
    let pwidth = lines
        .iter()
        .map(|l| l.pipeline.len())
        .max()
        .unwrap_or(8)
        .max(8);
    stdio::line(format_args!(
        "{:<width$}  {:<pwidth$}  {:<11}  {:>8}  {:>8}  {:<20}  FINISHED",
        "ID", "PIPELINE", "STATUS", "PLANNED", "BILLED", "STARTED"
    ))?;
    for l in &lines {
        let billed = if l.possibly_billed > 0 {
            format!("{}+{}?", l.credits_billed, l.possibly_billed)
        } else {
            l.credits_billed.to_string()
        };
        stdio::line(format_args!(
            "{:<width$}  {:<pwidth$}  {:<11}  {:>8}  {:>8}  {:<20}  {}",
            l.id,
            l.pipeline,
            l.status,
            l.credits_planned,
            billed,
            l.started,
            l.finished.as_deref().unwrap_or("-")
        ))?;
    }
    for l in &lines {
        for d in &l.rate_drawers {
            let sharing = lines
                .iter()
                .flat_map(|o| &o.rate_drawers)
                .filter(|o| o.account == d.account)
                .count();
            stdio::line(format_args!(
                "run {}: draws from account {}'s rate, {} a second, on {} (pid {}) with {sharing} process(es) in all",
                l.id, d.account, d.per_second, d.host, d.pid
            ))?;
        }
    }
    for l in &lines {
        if let (Some(process), Some(command)) = (&l.process, &l.continue_with) {
            stdio::line(format_args!(
                "run {}: process {}\nhint: continue it with: {command}",
                l.id,
                process.describe()
            ))?;
        }
    }
    Ok(())
}

async fn lines(store: &crate::store::Store, args: &RunsArgs) -> Result<Vec<RunLine>, Error> {
    let resume = |id: &crate::run_id::RunId| args.state.resume_command(id, args.sandbox);
    Ok(crate::report::runs::lines(store, resume).await?)
}
