//! `imgpipe cap set|list|remove`: spending caps over calendar windows, kept in the state
//! database so that every run of every host that shares it obeys them (see [`crate::money::caps`]).

use clap::{Args, Subcommand};

use crate::cli::GlobalArgs;
use crate::cli::args::StateArgs;
use crate::cli::stdio;
use crate::cli::values::Per;
use crate::cli::view::print_json;
use crate::error::Error;
use crate::money::caps::{Cap, Standing};
use crate::runner::state::close;

#[derive(Debug, Args)]
pub struct CapArgs {
    #[command(subcommand)]
    pub action: CapAction,
}

/// Which state database holds the caps.
#[derive(Debug, Args)]
pub struct Held {
    #[command(flatten)]
    pub state: StateArgs,
    /// Use the database of runs made with --sandbox
    #[arg(long)]
    pub sandbox: bool,
}

#[derive(Debug, Subcommand)]
pub enum CapAction {
    /// Set a cap, replacing one of the same name
    Set(SetArgs),
    /// List the caps, each with what its window has spent and has left
    List(Held),
    /// Remove a cap (what its windows spent stays recorded)
    Remove {
        /// The cap's name
        name: String,
        #[command(flatten)]
        held: Held,
    },
}

#[derive(Debug, Args)]
pub struct SetArgs {
    /// The cap's name: letters, digits, '-', '_' or '.'
    pub name: String,
    /// The most the runs it covers may spend in one window, all together
    #[arg(long)]
    pub credits: u64,
    /// The window: a calendar day, week (from Monday) or month
    #[arg(long, value_enum)]
    pub per: Per,
    /// Cover only runs of this pipeline (its `name:`); every pipeline without it
    #[arg(long)]
    pub pipeline: Option<String>,
    /// The IANA time zone the windows are counted in
    #[arg(long, default_value = "UTC", value_name = "ZONE")]
    pub tz: String,
    #[command(flatten)]
    pub held: Held,
}

pub(super) async fn run(args: &CapArgs, global: &GlobalArgs) -> Result<(), Error> {
    match &args.action {
        CapAction::Set(set) => {
            let location = set.held.state.location(set.held.sandbox)?;
            let cap = Cap::new(
                &set.name,
                set.credits,
                set.per.into(),
                set.pipeline.clone(),
                &set.tz,
            )
            .map_err(|e| Error::usage(e, Some("`imgpipe cap set --help` shows the form")))?;
            let store = location.open().await?;
            let set = async {
                let replaced = store.caps().set(&cap.row(crate::store::now_ms())).await?;
                let verb = if replaced { "replaced" } else { "set" };
                tracing::info!("cap {} {verb}", cap.name);
                standing(&store, &[cap]).await
            };
            let standing = close(store.clone(), set.await).await?;
            show(&standing, global)
        }
        CapAction::List(held) => {
            let location = held.state.location(held.sandbox)?;
            if !location.exists() {
                return show(&[], global);
            }
            let store = location.open_existing().await?;
            let listed =
                async { standing(&store, &crate::money::caps::recorded(&store).await?).await };
            let standing = close(store.clone(), listed.await).await?;
            show(&standing, global)
        }
        CapAction::Remove { name, held } => {
            let location = held.state.location(held.sandbox)?;
            let store = location.open_existing().await?;
            let removed = close(
                store.clone(),
                store.caps().remove(name).await.map_err(Error::from),
            )
            .await?;
            if !removed {
                return Err(Error::usage(
                    format!("there is no cap {name:?} in {}", store.location()),
                    Some("`imgpipe cap list` lists them"),
                ));
            }
            if !global.json {
                stdio::line(format_args!("cap {name} removed"))?;
            }
            Ok(())
        }
    }
}

/// Where each cap stands now.
async fn standing(store: &crate::store::Store, caps: &[Cap]) -> Result<Vec<Standing>, Error> {
    Ok(crate::money::caps::standings(store, caps).await?)
}

fn show(standing: &[Standing], global: &GlobalArgs) -> Result<(), Error> {
    if global.json {
        return print_json(&standing);
    }
    if standing.is_empty() {
        stdio::line(format_args!(
            "no caps\nhint: `imgpipe cap set NAME --credits N --per day` sets one"
        ))?;
        return Ok(());
    }
    stdio::line(format_args!(
        "{:<16}  {:>9}  {:<5}  {:<16}  {:>9}  {:>9}  WINDOW ENDS",
        "NAME", "CREDITS", "PER", "PIPELINE", "SPENT", "LEFT"
    ))?;
    for s in standing {
        stdio::line(format_args!(
            "{:<16}  {:>9}  {:<5}  {:<16}  {:>9}  {:>9}  {}",
            s.name,
            s.credits,
            s.per.as_str(),
            s.pipeline.as_deref().unwrap_or("(all)"),
            s.spent,
            s.left,
            s.window_end
        ))?;
    }
    Ok(())
}
