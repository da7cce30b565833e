//! `imgpipe models`: the models and tools the service lists.

use clap::Args;

use crate::cli::GlobalArgs;
use crate::cli::args::ServiceArgs;
use crate::cli::output::print_json;
use crate::cli::stdio;
use crate::error::Error;
use crate::runner::{AccountFields, Connection};

#[derive(Debug, Args)]
pub struct ModelsArgs {
    #[command(flatten)]
    pub service: ServiceArgs,
}

pub(super) async fn run(args: &ModelsArgs, global: &GlobalArgs) -> Result<(), Error> {
    let conn = Connection::open(&args.service.settings(AccountFields::default())?).await?;
    let models = conn.client.models().await?;
    if global.json {
        return print_json(&conn, models.raw());
    }
    let list = |items: Vec<String>| {
        if items.is_empty() {
            "(none listed)".to_owned()
        } else {
            items.join(", ")
        }
    };
    stdio::line(format_args!("models   {}", list(models.model_ids())))?;
    stdio::line(format_args!("tools    {}", list(models.tool_names())))?;
    match models.generation_price() {
        Some(p) => stdio::line(format_args!(
            "generation price  {} per 2K image  (from {})",
            crate::money::credits(p.value),
            p.pointer
        ))?,
        None => stdio::line(format_args!("generation price  not stated by the service"))?,
    }
    Ok(())
}
