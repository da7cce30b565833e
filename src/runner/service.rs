//! The service a command talks to: where it is and which key to use, or the embedded sandbox
//! started on loopback; and what it says of the balance and the generation price.

use std::path::PathBuf;
use std::time::Duration;

use crate::api::client::DEFAULT_CONNECT_TIMEOUT;
use crate::api::download::DEFAULT_MAX_BYTES;
use crate::api::retry::{RetryPolicy, free_call};
use crate::api::{Account, ApiKey, Client, ClientConfig, Downloader};
use crate::error::Error;
use crate::money::limit::Balance;
use crate::pipeline::Pipeline;
use crate::plan::{GenerationPrice, ModelsAnswer};
use crate::sandbox::{self, Sandbox};

/// Tries at the reads a run starts with (account, models) and the balance it ends with: they
/// bill nothing, so a passing 429 or server error is waited out rather than ending the run.
const FREE_READS: RetryPolicy = RetryPolicy::new(5, Duration::from_millis(500));

/// How to reach the service, as the command line and the environment said.
#[derive(Clone, Debug, Default)]
pub struct ServiceSettings {
    pub base_url: Option<String>,
    /// The key's file; else `IMGPIPE_API_KEY`. Never a key itself: command lines are visible
    /// to every user of the machine.
    pub api_key_file: Option<PathBuf>,
    /// Start the embedded sandbox and talk to it instead.
    pub sandbox: bool,
    pub timeout: Duration,
    /// Default: 10 s, or `timeout` when shorter.
    pub connect_timeout: Option<Duration>,
    pub fields: AccountFields,
}

/// JSON pointers to account fields imgpipe cannot find itself.
#[derive(Clone, Debug, Default)]
pub struct AccountFields {
    pub balance: Option<String>,
    pub plan: Option<String>,
    pub limits: Option<String>,
}

/// A client ready to call the service, and the sandbox behind it when there is one; the
/// sandbox lives as long as the connection.
pub struct Connection {
    pub client: Client,
    pub downloader: Downloader,
    pub fields: AccountFields,
    /// The account as the run's first read found it: its limits serve the run's settings
    /// without a second read.
    account: std::sync::OnceLock<Account>,
    _sandbox: Option<Sandbox>,
}

/// A test-only setting: the embedded sandbox's side of a 2K image, in pixels (1 to 2,048), in
/// place of its default (256), so that a test of the sample pipeline on `--sandbox`, which
/// expands and upscales each image 4x, need not draw and thumbnail 1,820x1,024-pixel images.
const TEST_SANDBOX_SIDE_ENV: &str = "IMGPIPE_TEST_SANDBOX_IMAGE_SIDE";

/// The embedded sandbox's settings: its defaults, but for [`TEST_SANDBOX_SIDE_ENV`].
fn embedded_config() -> sandbox::Config {
    let default = sandbox::Config::default();
    let image_side = std::env::var(TEST_SANDBOX_SIDE_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|side| (1..=2048).contains(side))
        .unwrap_or(default.image_side);
    sandbox::Config {
        image_side,
        ..default
    }
}

impl Connection {
    pub async fn open(settings: &ServiceSettings) -> Result<Self, Error> {
        let (base_url, key, sandbox) = if settings.sandbox {
            let sandbox = Sandbox::start(embedded_config()).await.map_err(|e| {
                Error::Other(anyhow::anyhow!("cannot start the embedded sandbox: {e}"))
            })?;
            tracing::info!(
                "using the embedded sandbox at {} (credits are not real)",
                sandbox.base_url()
            );
            let key = ApiKey::new(sandbox.key()).map_err(|e| Error::Other(e.into()))?;
            (sandbox.base_url().to_string(), key, Some(sandbox))
        } else {
            (base_url(settings)?, api_key(settings)?, None)
        };
        let mut config = ClientConfig::new(&base_url, key).map_err(|e| {
            Error::usage(
                format!("invalid base URL: {e}"),
                Some("set IMGPIPE_BASE_URL or --base-url to the service's address"),
            )
        })?;
        config.timeout = settings.timeout;
        // A connect that outlives the whole-call timeout would end as a call timeout, which
        // must be read as "maybe billed" although nothing was sent: the connect timeout never
        // exceeds the call's.
        config.connect_timeout = settings
            .connect_timeout
            .unwrap_or_else(|| DEFAULT_CONNECT_TIMEOUT.min(config.timeout));
        if config.timeout < config.connect_timeout {
            return Err(Error::usage(
                format!(
                    "--timeout ({}s) must not be shorter than --connect-timeout ({}s)",
                    config.timeout.as_secs_f64(),
                    config.connect_timeout.as_secs_f64()
                ),
                None,
            ));
        }
        let client = Client::new(config.clone()).map_err(|e| Error::Other(e.into()))?;
        let downloader = Downloader::new(config.connect_timeout, config.timeout, DEFAULT_MAX_BYTES);
        Ok(Connection {
            client,
            downloader,
            fields: settings.fields.clone(),
            account: std::sync::OnceLock::new(),
            _sandbox: sandbox,
        })
    }

    pub fn redact(&self, text: &str) -> String {
        self.client.redact(text)
    }

    /// The balance from the account, and the generation price with the models list's help.
    pub async fn ask(&self, pipeline: &Pipeline) -> Result<(Balance, GenerationPrice), Error> {
        let account = free_call(FREE_READS, || self.client.account()).await?;
        let account = self.account.get_or_init(|| account);
        let pointer = self.fields.balance.as_deref();
        let balance = match account.balance(pointer) {
            Ok(found) => Balance::Known {
                credits: found.value,
                field: found.pointer,
            },
            Err(e) if pointer.is_some() => return Err(Error::usage(e.to_string(), None)),
            Err(e) => Balance::Unknown {
                reason: format!("{e}; name it with --balance-field POINTER"),
            },
        };
        let generation = if pipeline.has_generation() {
            match free_call(FREE_READS, || self.client.models()).await {
                Ok(models) => GenerationPrice::resolve(pipeline, ModelsAnswer::Fetched(&models)),
                Err(e) => GenerationPrice::resolve(pipeline, ModelsAnswer::Failed(e.to_string())),
            }
        } else {
            GenerationPrice::resolve(pipeline, ModelsAnswer::NotAsked("no generate steps"))
        };
        Ok((balance, generation))
    }

    /// The account read first in this connection (by [`Connection::ask`]), or read now;
    /// `None` when it cannot be read. For its limits: the balance is [`Connection::balance_now`].
    pub async fn account(&self) -> Option<Account> {
        if let Some(account) = self.account.get() {
            return Some(account.clone());
        }
        let account = free_call(FREE_READS, || self.client.account()).await.ok()?;
        Some(self.account.get_or_init(|| account).clone())
    }

    /// The balance now, when the account answers and states it.
    pub async fn balance_now(&self) -> Option<i64> {
        let account = free_call(FREE_READS, || self.client.account()).await.ok()?;
        account
            .balance(self.fields.balance.as_deref())
            .ok()
            .map(|f| f.value)
    }
}

fn base_url(settings: &ServiceSettings) -> Result<String, Error> {
    settings.base_url.clone().filter(|u| !u.trim().is_empty()).ok_or_else(|| {
        Error::usage(
            "no service address: the service has no public default",
            Some("set IMGPIPE_BASE_URL or pass --base-url URL; or add --sandbox to try imgpipe on the embedded sandbox"),
        )
    })
}

/// The key from `--api-key-file`, else `IMGPIPE_API_KEY`.
fn api_key(settings: &ServiceSettings) -> Result<ApiKey, Error> {
    let hint = Some(
        "set IMGPIPE_API_KEY or pass --api-key-file PATH; or add --sandbox to try imgpipe without an account",
    );
    if let Some(path) = &settings.api_key_file {
        return ApiKey::from_file(path).map_err(|e| Error::usage(e.to_string(), hint));
    }
    match std::env::var("IMGPIPE_API_KEY") {
        Ok(raw) => {
            ApiKey::new(raw).map_err(|e| Error::usage(format!("IMGPIPE_API_KEY: {e}"), hint))
        }
        Err(_) => Err(Error::usage("no API key", hint)),
    }
}
