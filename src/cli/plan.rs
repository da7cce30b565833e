//! `imgpipe plan FILE`: the dry run. Prices every task, totals them, and holds the total
//! against the budget and the account's balance; exit 0 when the run may start, 3 when not.

use std::path::PathBuf;

use clap::Args;

use crate::cli::GlobalArgs;
use crate::cli::connect::Connection;
use crate::cli::validate;
use crate::error::Error;
use crate::pipeline::{self, Pipeline};
use crate::plan::document::{PlanDocument, Prices};
use crate::plan::{Balance, Budget, Costs, GenerationPrice, ModelsAnswer, Verdict, render};

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
    #[arg(long, value_name = "CREDITS")]
    pub max_credits: Option<u64>,
    /// Show what earlier runs' results would save (also `reuse: true` in the pipeline file)
    #[arg(long)]
    pub reuse: bool,
    /// The state database that --reuse looks in [default: $XDG_STATE_HOME/imgpipe/state.db]
    #[arg(long, env = "IMGPIPE_STATE", value_name = "PATH")]
    pub state: Option<PathBuf>,
}

pub async fn run(args: &PlanArgs, global: &GlobalArgs) -> Result<(), Error> {
    let pipeline = validate::checked(&args.file, pipeline::load(&args.file))?;
    let (balance, generation) = if args.offline {
        (
            Balance::NotChecked,
            GenerationPrice::resolve(&pipeline, ModelsAnswer::NotAsked("--offline")),
        )
    } else {
        let conn = Connection::open(global).await.map_err(offline_hint)?;
        ask_service(&conn, &pipeline, global).await?
    };
    let mut doc = document(&pipeline, generation, balance, args.max_credits);
    if args.reuse || pipeline.reuse {
        doc.reuse =
            crate::cli::run::reuse_estimate(args.state.as_ref(), global.sandbox, &pipeline, &doc)
                .await?;
    }
    print(&doc, global)?;
    if let Some(path) = &args.save {
        doc.save(path).map_err(|e| Error::usage(e, None))?;
        tracing::info!("plan saved to {}", path.display());
    }
    crate::cli::run::refusal_after_reuse(&doc)
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

/// The plan document: costs, budget and verdict for what the service said.
pub fn document(
    pipeline: &Pipeline,
    generation: GenerationPrice,
    balance: Balance,
    max_credits: Option<u64>,
) -> PlanDocument {
    let costs = Costs::of(pipeline, &generation);
    let budget = Budget::pick(pipeline.max_credits, max_credits);
    let verdict = Verdict::judge(&costs, budget.as_ref(), &balance);
    PlanDocument::new(
        pipeline,
        Prices::new(generation),
        costs,
        budget,
        balance,
        verdict,
    )
}

/// Prints the plan on stdout: the table, or the JSON document with `--json`.
pub fn print(doc: &PlanDocument, global: &GlobalArgs) -> Result<(), Error> {
    if global.json {
        let text = serde_json::to_string_pretty(doc)
            .map_err(|e| Error::Other(anyhow::anyhow!("cannot print the plan: {e}")))?;
        println!("{text}");
    } else {
        print!("{}", render::text(doc));
    }
    Ok(())
}

/// The balance from the account, and the generation price with the models list's help.
pub async fn ask_service(
    conn: &Connection,
    pipeline: &Pipeline,
    global: &GlobalArgs,
) -> Result<(Balance, GenerationPrice), Error> {
    let account = conn.client.account().await?;
    let balance = match account.balance(global.balance_field.as_deref()) {
        Ok(found) => Balance::Known {
            credits: found.value,
            field: found.pointer,
        },
        Err(e) if global.balance_field.is_some() => return Err(Error::usage(e.to_string(), None)),
        Err(e) => Balance::Unknown {
            reason: format!("{e}; name it with --balance-field POINTER"),
        },
    };
    let generation = if pipeline.has_generation() {
        match conn.client.models().await {
            Ok(models) => GenerationPrice::resolve(pipeline, ModelsAnswer::Fetched(&models)),
            Err(e) => GenerationPrice::resolve(pipeline, ModelsAnswer::Failed(e.to_string())),
        }
    } else {
        GenerationPrice::resolve(pipeline, ModelsAnswer::NotAsked("no generate steps"))
    };
    Ok((balance, generation))
}

pub fn refusal(doc: &PlanDocument) -> Result<(), Error> {
    if doc.verdict.fits {
        return Ok(());
    }
    let hint = if doc.costs.total_credits.is_none() {
        "set the price of a 2K generated image in the pipeline file: `pricing: { generation: N }`"
    } else {
        "raise budget.max_credits or --max-credits, top up the account, or plan fewer items"
    };
    Err(Error::Refused {
        message: format!("the run does not fit: {}", doc.verdict.reasons.join("; ")),
        hint: Some(hint.into()),
    })
}
