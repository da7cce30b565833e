//! `imgpipe models`: the models and tools the service lists.

use crate::cli::GlobalArgs;
use crate::cli::connect::Connection;
use crate::cli::output::print_json;
use crate::error::Error;

pub async fn run(conn: &Connection, args: &GlobalArgs) -> Result<(), Error> {
    let models = conn.client.models().await?;
    if args.json {
        return print_json(conn, models.raw());
    }
    let list = |items: Vec<String>| {
        if items.is_empty() {
            "(none listed)".to_owned()
        } else {
            items.join(", ")
        }
    };
    println!("models   {}", list(models.model_ids()));
    println!("tools    {}", list(models.tool_names()));
    match models.generation_price() {
        Some(p) => println!(
            "generation price  {} credits per 2K image  (from {})",
            p.value, p.pointer
        ),
        None => println!("generation price  not stated by the service"),
    }
    Ok(())
}
