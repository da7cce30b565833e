//! Log lines on stderr: plain text without colour when stderr is not a terminal (cron mail
//! stays readable), or JSON for log collectors. `IMGPIPE_LOG` overrides the filter.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

use crate::cli::GlobalArgs;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

pub(super) fn init(args: &GlobalArgs) {
    let default = match (args.quiet, args.verbose) {
        (true, _) => "warn",
        (false, 0) => "warn,imgpipe=info",
        (false, 1) => "warn,imgpipe=debug",
        (false, _) => "debug",
    };
    let filter = EnvFilter::try_from_env("IMGPIPE_LOG").unwrap_or_else(|_| EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // A log line that cannot be written (stderr closed or full) is dropped: by default
        // the subscriber would say so with `eprintln!`, which panics on that same stderr.
        .log_internal_errors(false)
        .with_target(args.verbose > 0);
    let _ = match args.log_format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init(),
    };
}
