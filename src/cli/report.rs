//! `imgpipe report RUN_ID`: the run's HTML page, from the state database and the run's files;
//! no network, and no lock, so it works on a run still going.

use std::path::{Path, PathBuf};

use clap::Args;

use crate::cli::GlobalArgs;
use crate::cli::run::{close, open_existing_store};
use crate::cli::runs::no_such_run;
use crate::error::Error;
use crate::report;
use crate::store::Store;

#[derive(Debug, Args)]
pub struct ReportArgs {
    /// The run (`imgpipe runs` lists them)
    pub run_id: String,
    /// Where to write the page [default: report.html in the run's directory]
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// The state database [default: $XDG_STATE_HOME/imgpipe/state.db]
    #[arg(long, env = "IMGPIPE_STATE", value_name = "PATH")]
    pub state: Option<PathBuf>,
}

pub async fn run(args: &ReportArgs, global: &GlobalArgs) -> Result<(), Error> {
    let store = open_existing_store(args.state.as_ref(), global.sandbox).await?;
    let written = write(&store, &args.run_id, args.out.as_deref()).await;
    let written = close(store, written).await?;
    print(&written, global)
}

/// The report of run `run_id`, which must be in `store`.
pub async fn write(
    store: &Store,
    run_id: &str,
    out: Option<&Path>,
) -> Result<report::Written, Error> {
    let Some(run) = store.run(run_id).await? else {
        return Err(no_such_run(store, run_id));
    };
    report::write(store, run, out).await
}

/// Prints where the page went: JSON on stdout with `--json`, else one line.
pub fn print(written: &report::Written, global: &GlobalArgs) -> Result<(), Error> {
    if global.json {
        let text = serde_json::to_string_pretty(written)
            .map_err(|e| Error::Other(anyhow::anyhow!("cannot print JSON: {e}")))?;
        println!("{text}");
    } else {
        println!(
            "report of run {} ({}): {} ({} images, {} new thumbnails)",
            written.run_id,
            written.status,
            written.path.display(),
            written.images,
            written.thumbnails_made
        );
    }
    Ok(())
}
