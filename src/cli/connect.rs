//! Resolves where the service is and which key to use, or starts the embedded sandbox.

use std::time::Duration;

use crate::api::client::DEFAULT_CONNECT_TIMEOUT;
use crate::api::download::DEFAULT_MAX_BYTES;
use crate::api::{ApiKey, Client, ClientConfig, Downloader};
use crate::cli::GlobalArgs;
use crate::error::Error;
use crate::sandbox::{self, Sandbox};

/// A client ready to call the service, and the sandbox behind it when there is one; the
/// sandbox lives as long as the connection.
pub struct Connection {
    pub client: Client,
    pub downloader: Downloader,
    _sandbox: Option<Sandbox>,
}

impl Connection {
    pub async fn open(args: &GlobalArgs) -> Result<Self, Error> {
        let (base_url, key, sandbox) = if args.sandbox {
            let sandbox = Sandbox::start(sandbox::Config::default())
                .await
                .map_err(|e| {
                    Error::Other(anyhow::anyhow!("cannot start the embedded sandbox: {e}"))
                })?;
            tracing::info!(
                "using the embedded sandbox at {} (credits are not real)",
                sandbox.base_url()
            );
            let key = ApiKey::new(sandbox.key()).map_err(|e| Error::Other(e.into()))?;
            (sandbox.base_url().to_string(), key, Some(sandbox))
        } else {
            (base_url(args)?, api_key(args)?, None)
        };
        let mut config = ClientConfig::new(&base_url, key).map_err(|e| {
            Error::usage(
                format!("invalid base URL: {e}"),
                Some("set IMGPIPE_BASE_URL or --base-url to the service's address"),
            )
        })?;
        config.timeout = seconds("--timeout", args.timeout)?;
        // A connect that outlives the whole-call timeout would end as a call timeout, which
        // must be read as "maybe billed" although nothing was sent: the connect timeout never
        // exceeds the call's.
        config.connect_timeout = match args.connect_timeout {
            None => DEFAULT_CONNECT_TIMEOUT.min(config.timeout),
            Some(secs) => seconds("--connect-timeout", secs)?,
        };
        if config.timeout < config.connect_timeout {
            return Err(Error::usage(
                format!(
                    "--timeout ({}s) must not be shorter than --connect-timeout ({}s)",
                    args.timeout,
                    config.connect_timeout.as_secs_f64()
                ),
                None,
            ));
        }
        let client = Client::new(config.clone()).map_err(|e| Error::Other(e.into()))?;
        let downloader = Downloader::new(config.connect_timeout, config.timeout, DEFAULT_MAX_BYTES)
            .map_err(|e| Error::Other(e.into()))?;
        Ok(Connection {
            client,
            downloader,
            _sandbox: sandbox,
        })
    }
}

impl Connection {
    pub fn redact(&self, text: &str) -> String {
        self.client.redact(text)
    }
}

fn base_url(args: &GlobalArgs) -> Result<String, Error> {
    args.base_url.clone().filter(|u| !u.trim().is_empty()).ok_or_else(|| {
        Error::usage(
            "no service address: the service has no public default",
            Some("set IMGPIPE_BASE_URL or pass --base-url URL; or add --sandbox to try imgpipe on the embedded sandbox"),
        )
    })
}

/// The key from `--api-key-file`, else `IMGPIPE_API_KEY`. Never from an argument: command
/// lines are visible to every user of the machine.
fn api_key(args: &GlobalArgs) -> Result<ApiKey, Error> {
    let hint = Some(
        "set IMGPIPE_API_KEY or pass --api-key-file PATH; or add --sandbox to try imgpipe without an account",
    );
    if let Some(path) = &args.api_key_file {
        return ApiKey::from_file(path).map_err(|e| Error::usage(e.to_string(), hint));
    }
    match std::env::var("IMGPIPE_API_KEY") {
        Ok(raw) => {
            ApiKey::new(raw).map_err(|e| Error::usage(format!("IMGPIPE_API_KEY: {e}"), hint))
        }
        Err(_) => Err(Error::usage("no API key", hint)),
    }
}

/// A positive, finite number of seconds from a flag; anything else is a usage error naming it.
pub fn seconds(flag: &str, secs: f64) -> Result<Duration, Error> {
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
