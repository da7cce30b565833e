//! `imgpipe account`: plan, balance and limits, saying where each was found.

use std::fmt::Display;

use clap::Args;

use crate::api::records::{Found, NotFound};
use crate::cli::GlobalArgs;
use crate::cli::args::{BalanceFieldArg, LimitsFieldArg, ServiceArgs};
use crate::cli::output::print_json;
use crate::cli::stdio;
use crate::error::Error;
use crate::runner::{AccountFields, Connection};

#[derive(Debug, Args)]
pub struct AccountArgs {
    #[command(flatten)]
    pub balance: BalanceFieldArg,
    /// JSON pointer to the plan in the account record, when imgpipe cannot find it
    #[arg(long, value_name = "POINTER", help_heading = "Service")]
    pub plan_field: Option<String>,
    #[command(flatten)]
    pub limits: LimitsFieldArg,
    #[command(flatten)]
    pub service: ServiceArgs,
}

pub(super) async fn run(args: &AccountArgs, global: &GlobalArgs) -> Result<(), Error> {
    let fields = AccountFields {
        balance: args.balance.balance_field.clone(),
        plan: args.plan_field.clone(),
        limits: args.limits.limits_field.clone(),
    };
    let conn = Connection::open(&args.service.settings(fields.clone())?).await?;
    let account = conn.client.account().await?;
    let plan = account.plan(fields.plan.as_deref());
    let balance = account.balance(fields.balance.as_deref());
    let limits = account.limits(fields.limits.as_deref());
    if global.json {
        // The raw record is the answer, but a field the user pointed at must still exist.
        for (found, flag) in [
            (plan.as_ref().err(), &fields.plan),
            (balance.as_ref().err(), &fields.balance),
            (limits.as_ref().err(), &fields.limits),
        ] {
            if let (Some(e), Some(_)) = (found, flag) {
                return Err(Error::usage(e.to_string(), None));
            }
        }
        return print_json(&conn, account.raw());
    }
    let lines = [
        line("plan", "", plan, fields.plan.is_some(), "--plan-field")?,
        line(
            "balance",
            " credits",
            balance,
            fields.balance.is_some(),
            "--balance-field",
        )?,
        line(
            "limits",
            "",
            limits,
            fields.limits.is_some(),
            "--limits-field",
        )?,
    ];
    stdio::line(conn.redact(&lines.join("\n")))?;
    Ok(())
}

/// One field: its value and where it was found, or "unknown" and what was received. A field
/// the user pointed at and that is not there is an error, not a shrug.
fn line<T: Display>(
    name: &str,
    unit: &str,
    found: Result<Found<T>, NotFound>,
    named: bool,
    flag: &str,
) -> Result<String, Error> {
    match found {
        Ok(f) => Ok(format!("{name:<8} {}{unit}  (from {})", f.value, f.pointer)),
        Err(e) if named => Err(Error::usage(
            e.to_string(),
            Some("check the pointer against `imgpipe account --json`"),
        )),
        Err(e) => {
            tracing::warn!("{e}");
            stdio::note(format_args!(
                "hint: name the field with {flag} /json/pointer (see `imgpipe account --json`)"
            ));
            Ok(format!("{name:<8} unknown"))
        }
    }
}
