//! `imgpipe plan FILE`: the dry run. Prices every task, totals them, and holds the total
//! against the budget and the account's balance; exit 0 when the run may start, 3 when not.

use std::path::PathBuf;

use clap::Args;

use crate::cli::GlobalArgs;
use crate::cli::args::{BalanceFieldArg, ServiceArgs, StateArgs};
use crate::cli::view::Terminal;
use crate::error::Error;
use crate::money::limit::Balance;
use crate::pipeline;
use crate::pipeline::Pipeline;
use crate::plan::document::PlanDocument;
use crate::plan::rerolls::RerollCosts;
use crate::plan::scope::{ItemSelector, Scope};
use crate::plan::{GenerationPrice, ModelsAnswer};
use crate::runner::{self, AccountFields, Connection, StateLocation, View};

#[derive(Debug, Args)]
pub struct PlanArgs {
    /// The pipeline file
    pub file: PathBuf,
    /// Do not ask the service: no balance check, no price from the models list
    #[arg(long)]
    pub offline: bool,
    /// Also write the plan as JSON to PATH (replacing only an earlier plan)
    #[arg(long, value_name = "PATH")]
    pub save: Option<PathBuf>,
    /// Most credits the run may spend; the smaller of this and budget.max_credits applies
    #[arg(long, value_name = "CREDITS", help_heading = "Budget")]
    pub max_credits: Option<u64>,
    /// Price only these items: ids and globs (mug,lamp-*), first:N or sample:N[:SEED], as
    /// `run --items` takes them; the plan says what the whole file would cost too
    #[arg(long, value_name = "SELECTOR", value_parser = crate::cli::args::item_selector)]
    pub items: Option<ItemSelector>,
    /// Price only STEP and the steps it needs, as `run --until` pays for them
    #[arg(long, value_name = "STEP")]
    pub until: Option<String>,
    /// Show what earlier runs' results would save (also `reuse: true` in the pipeline file)
    #[arg(long)]
    pub reuse: bool,
    /// The state database that --reuse, the caps and the rerolls' expected case look in
    #[command(flatten)]
    pub state: StateArgs,
    #[command(flatten)]
    pub service: ServiceArgs,
    #[command(flatten)]
    pub balance: BalanceFieldArg,
}

pub(super) async fn run(args: &PlanArgs, global: &GlobalArgs) -> Result<(), Error> {
    let view = Terminal::plain(global.json);
    let pipeline = runner::checked(&view, &args.file, pipeline::load(&args.file))?;
    let (balance, generation) = if args.offline {
        (
            Balance::NotChecked,
            GenerationPrice::resolve(&pipeline, ModelsAnswer::NotAsked("--offline")),
        )
    } else {
        let fields = AccountFields {
            balance: args.balance.balance_field.clone(),
            ..AccountFields::default()
        };
        let settings = args.service.settings(fields)?;
        let conn = Connection::open(&settings).await.map_err(offline_hint)?;
        conn.ask(&pipeline).await?
    };
    let scope = Scope::of(&pipeline, args.items.as_ref(), args.until.as_deref())
        .map_err(|e| Error::usage(e.message, e.hint.as_deref()))?;
    let doc = crate::plan::make(&pipeline, generation, balance, args.max_credits);
    let mut doc = crate::plan::narrow(doc, &pipeline, &scope);
    let state = args.state.location(args.service.sandbox)?;
    if args.reuse || pipeline.reuse {
        doc.reuse = Some(runner::reuse_estimate(&state, &pipeline, &doc, &scope).await?);
    }
    doc.caps = runner::cap_fits(&state, &pipeline, &doc).await;
    if doc.rerolls.is_some() {
        doc.rerolls = expected_rerolls(&state, &pipeline, &doc).await;
    }
    view.plan(&doc)?;
    if let Some(path) = &args.save {
        doc.save(path).map_err(|e| Error::usage(e, None))?;
        tracing::info!("plan saved to {}", path.display());
    }
    Ok(crate::money::admit::refusal_after_reuse(&doc.claim())?)
}

/// The rerolls' figures with the expected case from earlier runs' verdicts. A plan needs no
/// state database: without one the expected case is unknown, and one that cannot be read is
/// said and left as it is.
async fn expected_rerolls(
    state: &StateLocation,
    pipeline: &Pipeline,
    doc: &PlanDocument,
) -> Option<RerollCosts> {
    if !state.exists() {
        return doc.rerolls;
    }
    let read = async {
        let store = state.open_existing().await?;
        let expected = crate::plan::rerolls::expected(&store, pipeline, &doc.costs).await;
        runner::state::close(store, expected.map_err(Error::from)).await
    };
    match read.await {
        Ok(rerolls) => rerolls,
        Err(e) => {
            tracing::warn!("the rerolls' expected case was not read: {e}");
            doc.rerolls
        }
    }
}

fn offline_hint(e: Error) -> Error {
    match e {
        Error::Usage { message, hint } => Error::Usage {
            message,
            hint: Some(format!(
                "{}; or plan with --offline (no balance check)",
                hint.unwrap_or_default()
            )),
        },
        other => other,
    }
}
