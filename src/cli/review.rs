//! `imgpipe review [RUN_ID]`: the review desk served on 127.0.0.1 until SIGINT or SIGTERM; its
//! URL, with the token in it, is stdout's first line.

use std::io::IsTerminal;
use std::sync::Arc;

use clap::Args;
use tokio_util::sync::CancellationToken;

use crate::cli::GlobalArgs;
use crate::cli::args::{PartArgs, RunOptions};
use crate::cli::stdio;
use crate::desk::{self, Desk, Token};
use crate::error::Error;
use crate::run_id::RunId;

#[derive(Debug, Args)]
pub struct ReviewArgs {
    /// The run to open (`imgpipe runs` lists them); the runs' list when none is given
    pub run_id: Option<RunId>,
    /// The port on 127.0.0.1 (a free one when not given)
    #[arg(long, value_name = "N")]
    pub port: Option<u16>,
    /// Do not open the browser (it is opened only when stdout is a terminal)
    #[arg(long)]
    pub no_open: bool,
    // What a reroll or a continuation confirmed on the desk runs with, as `imgpipe reroll`.
    #[command(flatten)]
    pub opts: RunOptions,
}

pub(super) async fn run(
    args: &ReviewArgs,
    _global: &GlobalArgs,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let (settings, service) = args.opts.settings(&PartArgs::default())?;
    if settings.expect.is_bound() {
        return Err(Error::usage(
            "--expect-credits and --expect-revision confirm one spend; the desk confirms each with the price and revision its page shows",
            None,
        ));
    }
    let store = settings.state.open_existing().await?;
    if let Some(id) = &args.run_id
        && store.runs().get(id).await?.is_none()
    {
        return Err(crate::runner::state::no_such_run(&store, id));
    }
    let listener = desk::bind(args.port).await.map_err(|e| {
        Error::usage(
            format!("cannot listen on 127.0.0.1:{}: {e}", args.port.unwrap_or(0)),
            Some("give another --port, or none for a free one"),
        )
    })?;
    let port = listener
        .local_addr()
        .map_err(|e| Error::Other(e.into()))?
        .port();
    let (state, sandbox) = (args.opts.state.clone(), args.opts.service.sandbox);
    let desk = Arc::new(Desk {
        store,
        token: Token::new().map_err(|e| Error::Other(e.into()))?,
        sessions: desk::session::Sessions::default(),
        port,
        resume: Box::new(move |id| state.resume_command(id, sandbox)),
        settings,
        service,
        shutdown: shutdown.clone(),
        works: desk::work::Works::default(),
        thumbs: desk::thumbs::Thumbs::new().map_err(|e| Error::Other(e.into()))?,
    });
    let url = match &args.run_id {
        Some(id) => desk.run_url(id),
        None => desk.url(),
    };
    stdio::line(format_args!("{url}"))?;
    stdio::line(format_args!(
        "the review desk serves on 127.0.0.1:{port}; stop it with Ctrl-C"
    ))?;
    if !args.no_open && std::io::stdout().is_terminal() {
        open_browser(&url);
    }
    tracing::info!("review desk listening on 127.0.0.1:{port}");
    desk::serve(listener, desk, shutdown)
        .await
        .map_err(|e| Error::Other(e.into()))
}

/// Opens `url` in the person's browser (`xdg-open`, or `open` on macOS); said, not fatal,
/// when it cannot.
fn open_browser(url: &str) {
    let opener = if cfg!(target_os = "macos") {
        "open"
    } else {
        "xdg-open"
    };
    let started = std::process::Command::new(opener)
        .arg(url)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn();
    if started.is_err() {
        tracing::warn!("cannot open a browser ({opener}); open the URL above");
    }
}
