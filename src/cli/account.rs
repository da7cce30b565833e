//! `imgpipe account`: plan, balance and limits, saying where each was found.

use crate::cli::GlobalArgs;
use crate::cli::connect::Connection;
use crate::cli::output::print_json;
use crate::error::Error;

pub async fn run(conn: &Connection, args: &GlobalArgs) -> Result<(), Error> {
    let account = conn.client.account().await?;
    let balance = account.balance(args.balance_field.as_deref());
    if args.json {
        return print_json(account.raw());
    }
    match account.plan() {
        Some(plan) => println!("plan     {}", plan.value),
        None => println!("plan     (not stated)"),
    }
    match balance {
        Ok(found) => println!("balance  {} credits  (from {})", found.value, found.pointer),
        Err(e) if args.balance_field.is_some() => {
            return Err(Error::usage(
                e.to_string(),
                Some("check the pointer against `imgpipe account --json`"),
            ));
        }
        Err(e) => {
            println!("balance  unknown");
            tracing::warn!("{e}");
            eprintln!(
                "hint: name the field with --balance-field /json/pointer (see `imgpipe account --json`)"
            );
        }
    }
    match account.limits() {
        Some(limits) => println!("limits   {}", limits.value),
        None => println!("limits   (not stated)"),
    }
    Ok(())
}
