//! The command line: clap types only, and the dispatch to one file per subcommand.
//!
//! Data goes to stdout, logs and progress to stderr. Every error is printed once, here, with a
//! `hint:` where there is something to do, and mapped to a documented exit code.

mod account;
mod connect;
mod generate;
mod job;
mod logging;
mod models;
mod output;
mod plan;
mod preflight;
mod progress;
mod report;
mod resume;
mod run;
pub(crate) mod runs;
mod sandbox;
mod schema;
mod summary;
mod tool;
mod validate;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use crate::error::{Error, exit};

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

/// Options every command that talks to the service understands.
#[derive(Debug, Args)]
pub struct GlobalArgs {
    /// Base URL of the service (no public default exists)
    #[arg(long, env = "IMGPIPE_BASE_URL", global = true, value_name = "URL")]
    pub base_url: Option<String>,
    /// File holding the API key (else IMGPIPE_API_KEY); keys are never taken on the command line
    #[arg(long, global = true, value_name = "PATH")]
    pub api_key_file: Option<PathBuf>,
    /// Start the embedded sandbox on loopback and talk to it instead: no account, no real credits
    #[arg(long, global = true)]
    pub sandbox: bool,
    /// Print machine-readable JSON on stdout
    #[arg(long, global = true)]
    pub json: bool,
    /// JSON pointer to the balance in the account record, when imgpipe cannot find it (e.g. /credits/balance)
    #[arg(long, global = true, value_name = "POINTER")]
    pub balance_field: Option<String>,
    /// JSON pointer to the plan in the account record, when imgpipe cannot find it
    #[arg(long, global = true, value_name = "POINTER")]
    pub plan_field: Option<String>,
    /// JSON pointer to the limits object in the account record, when imgpipe cannot find it
    #[arg(long, global = true, value_name = "POINTER")]
    pub limits_field: Option<String>,
    /// Seconds to wait for a whole call
    #[arg(long, global = true, default_value_t = 300.0, value_name = "SECS")]
    pub timeout: f64,
    /// Seconds to wait for a connection [default: 10, or --timeout when shorter]
    #[arg(long, global = true, value_name = "SECS")]
    pub connect_timeout: Option<f64>,
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
    Account,
    /// List the available models and tools
    Models,
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
    /// List the runs in the state database
    Runs(runs::RunsArgs),
    /// Write a run's HTML report: each item's images step by step, and where every credit went
    Report(report::ReportArgs),
    /// Show one run: per-step counts, failures and their reasons, possibly billed attempts,
    /// where the outputs are
    Status(runs::StatusArgs),
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
    match &command {
        Command::Sandbox(args) => return sandbox::run(args, &global).await,
        Command::Validate(args) => return validate::run(args, &global),
        Command::Schema => return schema::run(),
        // The executor handles SIGINT/SIGTERM itself: it records what is in flight first.
        Command::Run(args) => {
            listen_for_shutdown();
            return run::run(args, &global).await;
        }
        Command::Resume(args) => {
            listen_for_shutdown();
            return resume::run(args, &global).await;
        }
        Command::Runs(args) => return runs::runs(args, &global).await,
        Command::Status(args) => return runs::status(args, &global).await,
        Command::Report(args) => return report::run(args, &global).await,
        _ => {}
    }
    let work = async {
        if let Command::Plan(args) = &command {
            return plan::run(args, &global).await;
        }
        let conn = connect::Connection::open(&global).await?;
        match &command {
            Command::Account => account::run(&conn, &global).await,
            Command::Models => models::run(&conn, &global).await,
            Command::Job(args) => job::run(args, &conn, &global).await,
            Command::Generate(args) => generate::run(args, &conn, &global).await,
            Command::Tool(args) => tool::run(args, &conn, &global).await,
            Command::Sandbox(_)
            | Command::Validate(_)
            | Command::Plan(_)
            | Command::Schema
            | Command::Run(_)
            | Command::Resume(_)
            | Command::Runs(_)
            | Command::Status(_)
            | Command::Report(_) => Ok(()),
        }
    };
    tokio::select! {
        result = work => result,
        () = shutdown_signal() => Err(Error::Interrupted {
            detail: Some(
                "a call in flight may have been billed; a job id logged above can be fetched without paying: imgpipe job <id> --out DIR"
                    .into(),
            ),
        }),
    }
}

/// SIGINT or SIGTERM, latched once [`listen_for_shutdown`] has run: a signal that arrives
/// between two waits is then never lost.
pub(crate) async fn shutdown_signal() {
    match SHUTDOWN.get() {
        Some(latch) => {
            let mut latch = latch.clone();
            if latch.wait_for(|got| *got).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
        None => wait_for_signal().await,
    }
}

static SHUTDOWN: std::sync::OnceLock<tokio::sync::watch::Receiver<bool>> =
    std::sync::OnceLock::new();

/// Takes over SIGINT and SIGTERM for the rest of the process; from then on
/// [`shutdown_signal`] returns as soon as one has arrived, whenever it is awaited. Commands
/// that record what they do call this first, so no signal ever kills them unrecorded.
pub(crate) fn listen_for_shutdown() {
    SHUTDOWN.get_or_init(|| {
        let (tx, rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            wait_for_signal().await;
            let _ = tx.send(true);
            // Keep the sender, so waiting receivers see the latch and not a closed channel.
            std::future::pending::<()>().await;
        });
        rx
    });
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
    let mut text = format!("error: {e}");
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(&format!("\n  caused by: {cause_text}"));
        }
        source = cause.source();
    }
    eprintln!("{text}");
    ExitCode::from(e.exit_code())
}
