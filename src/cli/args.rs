//! Option groups shared by several commands, each resolved into the library's settings, and
//! the command that continues a run as the user can paste it.

use crate::run_id::RunId;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use crate::cli::values::OnAmbiguous;
use crate::error::Error;
use crate::plan::scope::ItemSelector;
use crate::runner::{AccountFields, DEFAULT_DOWNLOADS, ServiceSettings, Settings, StateLocation};
use crate::store::Location;

/// Where the service is and how long to wait for it.
#[derive(Clone, Debug, Args)]
#[command(next_help_heading = "Service")]
pub struct ServiceArgs {
    /// Base URL of the service (no public default exists) [default: IMGPIPE_BASE_URL]
    #[arg(long, value_name = "URL")]
    pub base_url: Option<String>,
    /// File holding the API key (else IMGPIPE_API_KEY); keys are never taken on the command line
    #[arg(long, value_name = "PATH")]
    pub api_key_file: Option<PathBuf>,
    /// Start the embedded sandbox on loopback and talk to it instead: no account, no real credits
    #[arg(long)]
    pub sandbox: bool,
    /// Seconds to wait for a whole call
    #[arg(long, default_value_t = 300.0, value_name = "SECS")]
    pub timeout: f64,
    /// Seconds to wait for a connection [default: 10, or --timeout when shorter]
    #[arg(long, value_name = "SECS")]
    pub connect_timeout: Option<f64>,
}

/// Where the balance is in the account record, when imgpipe cannot find it.
#[derive(Clone, Debug, Default, Args)]
#[command(next_help_heading = "Service")]
pub struct BalanceFieldArg {
    /// JSON pointer to the balance in the account record, when imgpipe cannot find it (e.g. /credits/balance)
    #[arg(long, value_name = "POINTER")]
    pub balance_field: Option<String>,
}

/// Where the limits are in the account record, when imgpipe cannot find them.
#[derive(Clone, Debug, Default, Args)]
#[command(next_help_heading = "Service")]
pub struct LimitsFieldArg {
    /// JSON pointer to the limits object in the account record, when imgpipe cannot find it
    #[arg(long, value_name = "POINTER")]
    pub limits_field: Option<String>,
}

impl ServiceArgs {
    pub fn settings(&self, fields: AccountFields) -> Result<ServiceSettings, Error> {
        Ok(ServiceSettings {
            base_url: self
                .base_url
                .clone()
                .or_else(|| std::env::var("IMGPIPE_BASE_URL").ok()),
            api_key_file: self.api_key_file.clone(),
            sandbox: self.sandbox,
            timeout: seconds("--timeout", self.timeout)?,
            connect_timeout: self
                .connect_timeout
                .map(|s| seconds("--connect-timeout", s))
                .transpose()?,
            fields,
        })
    }
}

/// The state database of a command.
#[derive(Clone, Debug, Args)]
#[command(next_help_heading = "State")]
pub struct StateArgs {
    /// The state database: a SQLite file, or postgres://user@host:port/database (password from
    /// PGPASSWORD or ~/.pgpass) [default: IMGPIPE_STATE, else $XDG_STATE_HOME/imgpipe/state.db,
    /// else ~/.local/state/imgpipe/state.db; sandbox.db beside it with --sandbox]
    #[arg(long, value_name = "PATH|URL", value_parser = state_location)]
    pub state: Option<Location>,
}

/// `--notify`: https, or http to a loopback address; anything else is exit 2.
fn notify_url(s: &str) -> Result<url::Url, String> {
    crate::webhook::check_url(s)
}

/// `--state`: a local file or a PostgreSQL URL; any other URL is refused (exit 2) rather than
/// taken for a relative path.
fn state_location(s: &str) -> Result<Location, String> {
    Location::parse(s, "the state database")
}

/// `--out` of a one-off command: a local directory or file; a URL is refused (exit 2) rather
/// than created as `./scheme:/…`.
pub(crate) fn out_path(s: &str) -> Result<PathBuf, String> {
    crate::place::local_path(s, "the output place")
}

/// `--out` of a run or a report: a local path or an `s3://bucket/prefix` URL (credentials
/// from the environment, never from here); any other URL is refused (exit 2).
pub(crate) fn out_place(s: &str) -> Result<crate::place::Address, String> {
    crate::place::Address::parse(s, "the output place")
}

impl StateArgs {
    pub fn location(&self, sandbox: bool) -> Result<StateLocation, Error> {
        let from_env = std::env::var_os("IMGPIPE_STATE").filter(|v| !v.is_empty());
        let from_env = match from_env {
            None => None,
            Some(v) => Some(
                Location::parse(&v.to_string_lossy(), "IMGPIPE_STATE").map_err(|why| {
                    Error::usage(
                        why,
                        Some("unset it, or give a file path or a postgres:// URL"),
                    )
                })?,
            ),
        };
        StateLocation::resolve(self.state.clone().or(from_env), sandbox)
    }

    /// `imgpipe resume RUN_ID` with the flags that find this database again.
    pub fn resume_command(&self, run_id: &RunId, sandbox: bool) -> String {
        let mut command = format!("imgpipe resume {}", quote(run_id));
        if let Some(state) = &self.state {
            command += &format!(" --state {}", quote(&state_flag(state)));
        }
        if sandbox {
            command += " --sandbox";
        }
        command
    }

    /// Run `run_id` as it is now: its record, and whether its process is still going (the run
    /// lock asked) with the command that continues it when it is unfinished.
    pub async fn observed_run(
        &self,
        store: &crate::store::Store,
        run_id: &crate::run_id::RunId,
        sandbox: bool,
    ) -> Result<(crate::store::Run, crate::report::live::Observed), Error> {
        let Some(run) = store.runs().get(run_id).await? else {
            return Err(crate::runner::state::no_such_run(store, run_id));
        };
        let (run, process) = crate::report::live::observe(store, run).await?;
        let continue_with = run
            .status
            .unfinished()
            .then(|| self.resume_command(&run.id, sandbox));
        let observed = crate::report::live::Observed {
            process,
            continue_with,
        };
        Ok((run, observed))
    }
}

/// The part of a run to pay for now: options of `run` and `resume` only (a reroll names its
/// tasks instead, so its `--help` does not offer these).
#[derive(Clone, Debug, Default, Args)]
pub struct PartArgs {
    /// Pay now only for these items: ids and shell-style globs, comma separated (mug,lamp-*),
    /// first:N, or sample:N (a seed is drawn and printed; sample:N:SEED picks the same items
    /// again). The rest stays pending: the same run continued without --items pays for it
    #[arg(long, value_name = "SELECTOR", help_heading = "Run", value_parser = item_selector)]
    pub items: Option<ItemSelector>,
    /// Pay now only for STEP and the steps it needs, then stop with exit 7; the run
    /// continued without --until pays for the rest
    #[arg(long, value_name = "STEP", help_heading = "Run")]
    pub until: Option<String>,
}

/// Options of every command that runs tasks: `run`, `resume` and `reroll`.
#[derive(Clone, Debug, Args)]
pub struct RunOptions {
    /// Resume a run even though its pipeline file (or items) changed: tasks whose request and
    /// input images are unchanged keep their results; the others run again
    #[arg(long, help_heading = "Run")]
    pub allow_changes: bool,
    /// Take the results of tasks that succeeded in earlier runs (same request, same input
    /// images) instead of paying for them again; also `reuse: true` in the pipeline file
    #[arg(long, help_heading = "Run")]
    pub reuse: bool,
    /// When another run of this pipeline holds the lock, wait for it instead of exiting 5
    #[arg(long, help_heading = "Run")]
    pub wait: bool,
    /// A call sent without a complete answer may have been billed: call again, or fail the
    /// task (also for calls in flight when an earlier process died)
    #[arg(long, value_enum, default_value = "retry", help_heading = "Run")]
    pub on_ambiguous: OnAmbiguous,
    /// Write the run's HTML report (report.html, next to the manifest) when it ends
    #[arg(long, help_heading = "Run")]
    pub report: bool,
    #[command(flatten)]
    pub state: StateArgs,
    /// Most credits the run may spend; the smaller of this and budget.max_credits applies
    #[arg(long, value_name = "CREDITS", help_heading = "Budget")]
    pub max_credits: Option<u64>,
    /// Pay only this price, the one a dry run showed: once the run's lock is held and the
    /// work planned again, any other price is exit 3 with the new one, and nothing is spent
    #[arg(long, value_name = "CREDITS", help_heading = "Budget")]
    pub expect_credits: Option<u64>,
    /// Pay only for what the dry run with this revision priced (`--dry-run --json` prints
    /// it): a run changed since, or a change already made, is exit 3, nothing spent
    #[arg(long, value_name = "REVISION", help_heading = "Budget")]
    pub expect_revision: Option<crate::money::Revision>,
    /// Paid calls in flight at once [default: pipeline, else the account's limit, else 4]
    #[arg(long, value_name = "N", help_heading = "Pace")]
    pub concurrency: Option<usize>,
    /// Paid calls per second, minute or hour, e.g. 5/s or 120/min [default: pipeline, else
    /// the account's limit, else none until the service answers 429]
    #[arg(long, value_name = "SPEC", help_heading = "Pace")]
    pub rate: Option<String>,
    /// Downloads in flight at once
    #[arg(long, default_value_t = DEFAULT_DOWNLOADS, value_name = "N", help_heading = "Pace")]
    pub download_concurrency: usize,
    /// Lifetime of result URLs in seconds (the spec says one hour)
    #[arg(
        long,
        default_value_t = 3600.0,
        value_name = "SECS",
        help_heading = "Pace"
    )]
    pub url_ttl: f64,
    /// Refresh an input URL this many seconds before it expires
    #[arg(
        long,
        default_value_t = 300.0,
        value_name = "SECS",
        help_heading = "Pace"
    )]
    pub url_margin: f64,
    /// Seconds calls in flight may take to finish after SIGINT/SIGTERM
    #[arg(
        long,
        default_value_t = 60.0,
        value_name = "SECS",
        help_heading = "Pace"
    )]
    pub grace: f64,
    /// Post the run's events as signed JSON to this webhook: https, or http to 127.0.0.1 (also
    /// `notify:` in the pipeline file); the signing secret from IMGPIPE_NOTIFY_SECRET
    #[arg(
        long,
        value_name = "URL",
        env = "IMGPIPE_NOTIFY_URL",
        hide_env_values = true,
        value_parser = notify_url,
        help_heading = "Events"
    )]
    pub notify: Option<url::Url>,
    /// Write the run's metrics for node_exporter's textfile collector (Prometheus text format)
    /// to this file, e.g. /var/lib/node_exporter/imgpipe.prom: at the start, every 10 s and at
    /// the end
    #[arg(long, value_name = "PATH", help_heading = "Events")]
    pub metrics_file: Option<PathBuf>,
    /// First retry delay in milliseconds (tests set it low)
    #[arg(long, default_value_t = 500, hide = true)]
    pub retry_base_ms: u64,
    #[command(flatten)]
    pub service: ServiceArgs,
    #[command(flatten)]
    pub balance: BalanceFieldArg,
    #[command(flatten)]
    pub limits: LimitsFieldArg,
}

impl RunOptions {
    /// The settings, every flag checked: a bad one is exit 2 before anything is asked. `part`
    /// is the part of the run asked for (`PartArgs::default()` for all of it).
    pub fn settings(&self, part: &PartArgs) -> Result<(Settings, ServiceSettings), Error> {
        if self.concurrency == Some(0) {
            return Err(Error::usage("--concurrency must be at least 1", None));
        }
        if self.download_concurrency == 0 {
            return Err(Error::usage(
                "--download-concurrency must be at least 1",
                None,
            ));
        }
        let rate = self
            .rate
            .as_deref()
            .map(|spec| {
                spec.parse::<crate::pipeline::rate::Rate>()
                    .map(|r| r.per_second())
                    .map_err(|e| {
                        Error::usage(
                            format!("--rate: {e}"),
                            Some("write it like 5/s, 120/min or 1000/h"),
                        )
                    })
            })
            .transpose()?;
        let url_ttl = seconds("--url-ttl", self.url_ttl)?;
        let url_margin = Duration::try_from_secs_f64(self.url_margin)
            .ok()
            .filter(|m| *m < url_ttl)
            .ok_or_else(|| {
                Error::usage(
                    "--url-margin must be 0 or more and shorter than --url-ttl",
                    None,
                )
            })?;
        let fields = AccountFields {
            balance: self.balance.balance_field.clone(),
            plan: None,
            limits: self.limits.limits_field.clone(),
        };
        let settings = Settings {
            state: self.state.location(self.service.sandbox)?,
            allow_changes: self.allow_changes,
            reuse: self.reuse,
            wait: self.wait,
            items: part.items.clone(),
            until: part.until.clone(),
            concurrency: self.concurrency,
            rate,
            max_credits: self.max_credits,
            on_ambiguous: self.on_ambiguous.into(),
            url_ttl,
            url_margin,
            download_concurrency: self.download_concurrency,
            grace: seconds("--grace", self.grace)?,
            report: self.report,
            retry_base: Duration::from_millis(self.retry_base_ms),
            events: self.events()?,
            expect: crate::money::Expected {
                credits: self.expect_credits,
                revision: self.expect_revision.clone(),
            },
        };
        Ok((settings, self.service.settings(fields)?))
    }

    /// Alerts and metrics: the webhook, its secret from the environment, the metrics file
    /// (whose directory must exist: a file that could never be written is exit 2).
    fn events(&self) -> Result<crate::events::Config, Error> {
        if let Some(path) = &self.metrics_file {
            let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
            if dir.is_some_and(|d| !d.is_dir()) || path.is_dir() {
                return Err(Error::usage(
                    format!(
                        "--metrics-file {}: the file cannot be written there",
                        path.display()
                    ),
                    Some("name a file in a directory that exists"),
                ));
            }
        }
        let secret = std::env::var_os("IMGPIPE_NOTIFY_SECRET")
            .and_then(|s| crate::events::notify::Secret::new(s.into_encoded_bytes()));
        Ok(crate::events::Config {
            notify_url: self.notify.clone(),
            notify_secret: secret,
            metrics_file: self.metrics_file.clone(),
        })
    }

    /// The flags that continuing the run must be given again: where the service, the key,
    /// the state and the budget are, and the choices that shape what is paid for. Flags
    /// given through the environment need no repeating: the environment is still there.
    /// With `scoped`, the `--items` and `--until` it was given too: the command then continues
    /// the part asked for; without (`None`), it continues the whole run.
    pub fn continue_flags(&self, scoped: Option<&PartArgs>) -> Vec<String> {
        let mut out = Vec::new();
        let mut flag = |name: &str, value: Option<String>| {
            if let Some(v) = value {
                out.push(name.to_owned());
                out.push(quote(&v));
            }
        };
        let s = &self.service;
        flag("--base-url", s.base_url.clone());
        flag("--api-key-file", s.api_key_file.as_deref().map(path));
        flag("--state", self.state.state.as_ref().map(state_flag));
        flag(
            "--timeout",
            (s.timeout != 300.0).then(|| s.timeout.to_string()),
        );
        flag(
            "--connect-timeout",
            s.connect_timeout.map(|t| t.to_string()),
        );
        flag("--balance-field", self.balance.balance_field.clone());
        flag("--limits-field", self.limits.limits_field.clone());
        flag("--max-credits", self.max_credits.map(|c| c.to_string()));
        flag("--concurrency", self.concurrency.map(|c| c.to_string()));
        flag("--rate", self.rate.clone());
        // Not --notify: a webhook's URL is often its credential, and this command is printed.
        flag("--metrics-file", self.metrics_file.as_deref().map(path));
        if let Some(part) = scoped {
            flag("--items", part.items.as_ref().map(ToString::to_string));
            flag("--until", part.until.clone());
        }
        let on_fail = self.on_ambiguous == OnAmbiguous::Fail;
        flag("--on-ambiguous", on_fail.then(|| "fail".to_owned()));
        for (given, name) in [
            (s.sandbox, "--sandbox"),
            (self.allow_changes, "--allow-changes"),
            (self.reuse, "--reuse"),
            (self.report, "--report"),
        ] {
            if given {
                out.push(name.to_owned());
            }
        }
        out
    }
}

/// Words to follow a command's earlier words: each after a space.
pub(super) fn after(words: &[String]) -> String {
    words.iter().map(|w| format!(" {w}")).collect()
}

/// `--items`: a selector as written; a sample given no seed draws one here, once, so that the
/// run and every command printed to continue it pick the same items.
pub(super) fn item_selector(text: &str) -> Result<ItemSelector, String> {
    text.parse::<ItemSelector>().map(ItemSelector::seeded)
}

/// `--state` as the user can paste it: a PostgreSQL URL without its password, which they keep
/// in PGPASSWORD or ~/.pgpass.
fn state_flag(state: &Location) -> String {
    match state {
        Location::File(p) => path(p),
        Location::Postgres(url) => url.to_string(),
    }
}

fn path(p: &std::path::Path) -> String {
    p.display().to_string()
}

pub(super) use crate::shell::quote;

/// A positive, finite number of seconds from a flag; anything else is a usage error naming it.
pub(super) fn seconds(flag: &str, secs: f64) -> Result<Duration, Error> {
    Duration::try_from_secs_f64(secs)
        .ok()
        .filter(|d| !d.is_zero() && *d <= MAX_SECONDS)
        .ok_or_else(|| {
            Error::usage(
                format!(
                    "{flag} must be a positive number of seconds up to {}, got {secs}",
                    MAX_SECONDS.as_secs()
                ),
                None,
            )
        })
}

/// A week: longer than any sensible timeout or URL lifetime, short enough to add to a clock.
const MAX_SECONDS: Duration = Duration::from_secs(7 * 24 * 3600);
