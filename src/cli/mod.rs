//! The command line: clap types only, and the dispatch to one file per subcommand.
//!
//! Data goes to stdout, logs and progress to stderr. Every error is printed once, here, with a
//! `hint:` where there is something to do, and mapped to a documented exit code.
//!
//! This is the one layer that prints: the library returns values and logs.

mod account;
mod args;
mod cap;
mod completions;
mod generate;
mod job;
mod logging;
mod man;
mod models;
mod output;
mod plan;
mod progress;
mod report;
mod reroll;
mod resume;
mod review;
mod run;
mod runs;
mod sandbox;
mod schema;
mod spend;
mod status;
mod stdio;
mod tool;
mod validate;
mod values;
mod view;

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use crate::error::{Error, exit};
use crate::runner::{AccountFields, Connection};

#[derive(Debug, Parser)]
#[command(
    name = "imgpipe",
    version,
    about = "Batches of image work against a paid image API, without wasting a credit"
)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    pub command: Command,
}

/// What every command understands: how to print its data and its logs.
#[derive(Debug, Args)]
#[command(next_help_heading = "Output")]
pub struct GlobalArgs {
    /// Print machine-readable JSON on stdout
    #[arg(long, global = true)]
    pub json: bool,
    /// More log detail on stderr (-vv includes the HTTP stack)
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// Only warnings and errors on stderr
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    pub quiet: bool,
    /// Log line format on stderr
    #[arg(long, global = true, value_enum, default_value = "text")]
    pub log_format: logging::LogFormat,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Show the account: plan, credit balance and limits
    Account(account::AccountArgs),
    /// List the available models and tools
    Models(models::ModelsArgs),
    /// Show a past job, with fresh result URLs; --out downloads its images
    Job(job::JobArgs),
    /// Generate images from a prompt and download them
    Generate(generate::GenerateArgs),
    /// Edit an image with one tool and download the result
    Tool(tool::ToolArgs),
    /// Run the sandbox emulator of the service until interrupted
    Sandbox(sandbox::SandboxArgs),
    /// Check a pipeline file without touching the network: exit 0 when valid, 2 when not
    Validate(validate::ValidateArgs),
    /// The dry run: price every task and hold the total against the budget and the balance
    Plan(plan::PlanArgs),
    /// Print the JSON Schema of pipeline files
    Schema,
    /// Run a pipeline: plan, refuse what cannot be paid for, execute, record, download
    Run(run::RunArgs),
    /// Resume an interrupted run without paying twice; --dry-run lists what it would pay for
    Resume(resume::ResumeArgs),
    /// Pay again for chosen tasks of a run and what is downstream of them; --dry-run prices it
    Reroll(reroll::RerollArgs),
    /// List the runs in the state database
    Runs(runs::RunsArgs),
    /// Serve the review desk on 127.0.0.1: the runs, and rerolls priced and paid at the price confirmed
    Review(review::ReviewArgs),
    /// Spending caps shared by every run on every host: set, list, remove
    Cap(cap::CapArgs),
    /// Write a run's HTML report: each item's images step by step, and where every credit went
    Report(report::ReportArgs),
    /// Show one run: per-step counts, failures and their reasons, possibly billed attempts,
    /// where the outputs are
    Status(status::StatusArgs),
    /// What the runs cost: credits billed, possibly billed and planned, calls and failures,
    /// per day, week, month, pipeline, step or run
    Spend(spend::SpendArgs),
    /// Print the completion script of a shell: bash, zsh, fish or powershell
    Completions(completions::CompletionsArgs),
    /// Write man pages, one for imgpipe and one per command, to a directory
    Man(man::ManArgs),
}

/// Runs a parsed command line and returns the process exit code.
pub fn run(cli: Cli) -> ExitCode {
    logging::init(&cli.global);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            return report(&Error::Other(anyhow::anyhow!(
                "cannot start the async runtime: {e}"
            )));
        }
    };
    let result = runtime.block_on(dispatch(cli));
    // Leftover connections must not hold up the exit.
    runtime.shutdown_background();
    match result {
        Ok(()) => ExitCode::from(exit::SUCCESS),
        Err(e) => report(&e),
    }
}

async fn dispatch(cli: Cli) -> Result<(), Error> {
    let Cli { global, command } = cli;
    let g = &global;
    match &command {
        Command::Validate(args) => return validate::run(args, g),
        Command::Schema => return schema::run(),
        Command::Runs(args) => return runs::run(args, g).await,
        Command::Cap(args) => return cap::run(args, g).await,
        Command::Status(args) => return status::run(args, g).await,
        Command::Spend(args) => return spend::run(args, g).await,
        Command::Report(args) => return report::run(args, g).await,
        Command::Completions(args) => return completions::run(args),
        Command::Man(args) => return man::run(args),
        _ => {}
    }
    // From here on SIGINT and SIGTERM are latched: a signal is never lost between two waits,
    // and commands that record what they do stop at a safe point.
    let shutdown = listen_for_shutdown();
    let work = async {
        match &command {
            // The runner handles the signal itself: it records what is in flight first.
            Command::Run(args) => run::run(args, g, shutdown.clone()).await,
            Command::Resume(args) => resume::run(args, g, shutdown.clone()).await,
            Command::Reroll(args) => reroll::run(args, g, shutdown.clone()).await,
            Command::Sandbox(args) => sandbox::run(args, g, shutdown.clone()).await,
            Command::Review(args) => review::run(args, g, shutdown.clone()).await,
            Command::Plan(args) => plan::run(args, g).await,
            Command::Account(args) => account::run(args, g).await,
            Command::Models(args) => models::run(args, g).await,
            Command::Job(args) => job::run(args, &connect(&args.service).await?, g).await,
            Command::Generate(args) => generate::run(args, &connect(&args.service).await?, g).await,
            Command::Tool(args) => tool::run(args, &connect(&args.service).await?, g).await,
            Command::Validate(_)
            | Command::Schema
            | Command::Runs(_)
            | Command::Cap(_)
            | Command::Status(_)
            | Command::Spend(_)
            | Command::Report(_)
            | Command::Completions(_)
            | Command::Man(_) => Ok(()),
        }
    };
    let grace = match &command {
        Command::Run(args) => Some(args.opts.grace),
        Command::Resume(args) => Some(args.opts.grace),
        Command::Reroll(args) => Some(args.opts.grace),
        _ => None,
    };
    if let Some(grace) = grace {
        return bounded_after_shutdown(work, &shutdown, grace).await;
    }
    if matches!(command, Command::Sandbox(_) | Command::Review(_)) {
        return work.await;
    }
    tokio::select! {
        result = work => result,
        () = shutdown.cancelled() => Err(Error::Interrupted {
            detail: Some(
                "a call in flight may have been billed; a job id logged above can be fetched without paying: imgpipe job <id> --out DIR"
                    .into(),
            ),
        }),
    }
}

/// How long a run, resume or reroll has to record its end once the grace for its calls in
/// flight is over.
const RECORD_WITHIN: std::time::Duration = std::time::Duration::from_secs(30);

/// A test-only setting: seconds in place of [`RECORD_WITHIN`], so that a test of a state
/// database gone silent sees the bound reached without waiting out its 30 s.
const TEST_RECORD_WITHIN_ENV: &str = "IMGPIPE_TEST_RECORD_WITHIN_SECS";

/// [`RECORD_WITHIN`], or the positive seconds [`TEST_RECORD_WITHIN_ENV`] sets.
fn record_within() -> std::time::Duration {
    std::env::var(TEST_RECORD_WITHIN_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|secs| *secs > 0)
        .map_or(RECORD_WITHIN, std::time::Duration::from_secs)
}

/// Runs a command that records what it does (the runner handles the signal itself) to its
/// end, or, once stopped (a signal, or the PostgreSQL run lock's session lost), until its
/// `grace` for the calls in flight and [`RECORD_WITHIN`] more have passed: a state database
/// that does not answer must not hold the process for ever. What it could not record stays
/// as the database last had it (calls recorded as sent are possibly billed), which is what a
/// resume reads.
async fn bounded_after_shutdown(
    work: impl std::future::Future<Output = Result<(), Error>>,
    shutdown: &CancellationToken,
    grace: f64,
) -> Result<(), Error> {
    let grace = std::time::Duration::try_from_secs_f64(grace).unwrap_or_default();
    let within = record_within();
    let overdue = async {
        shutdown.cancelled().await;
        tokio::time::sleep(grace + within).await;
    };
    tokio::select! {
        result = work => result,
        () = overdue => Err(Error::Interrupted {
            detail: Some(format!(
                "the state database did not take the run's records within {}s after the {}s grace: calls it had as sent stay possibly billed; resume the run once it answers",
                within.as_secs(),
                grace.as_secs_f64()
            )),
        }),
    }
}

async fn connect(service: &args::ServiceArgs) -> Result<Connection, Error> {
    Connection::open(&service.settings(AccountFields::default())?).await
}

/// A token cancelled at the first SIGINT or SIGTERM, for the rest of the process.
fn listen_for_shutdown() -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        cancel.cancel();
    });
    token
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

fn report(e: &Error) -> ExitCode {
    // A part of a run done as asked (exit 7) is no error: it is said without the word.
    let lead = match e.exit_code() {
        crate::error::exit::PART_DONE => "",
        _ => "error: ",
    };
    let mut text = format!("{lead}{e}");
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(&format!("\n  caused by: {cause_text}"));
        }
        source = cause.source();
    }
    stdio::note(&text);
    ExitCode::from(e.exit_code())
}
