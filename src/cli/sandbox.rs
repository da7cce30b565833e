//! `imgpipe sandbox`: the emulator as a standalone server, for trying imgpipe by hand, for
//! benchmarks in a separate process, and for scripts.

use std::time::Duration;

use serde_json::json;

use tokio_util::sync::CancellationToken;

use crate::cli::GlobalArgs;
use crate::cli::args::seconds;
use crate::cli::stdio;
use crate::cli::values::RateScope;
use crate::error::Error;
use crate::sandbox::{self, BadImages, Faults, SAMPLE_HOST, SAMPLE_NAMES, Sandbox, Weight};

#[derive(Debug, clap::Args)]
pub struct SandboxArgs {
    /// Port on 127.0.0.1 (0 picks a free one)
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// The API key clients must send (random when not given)
    #[arg(long)]
    pub key: Option<String>,
    /// Starting credit balance
    #[arg(long, default_value_t = 1000)]
    pub balance: i64,
    /// Credits per 2K image (4K bills twice)
    #[arg(long, default_value_t = 4)]
    pub generation_price: u64,
    /// State the generation price in GET /v1/models (the real service's list shows none)
    #[arg(long)]
    pub advertise_price: bool,
    /// Lifetime of result URLs, in seconds
    #[arg(long, default_value_t = 3600.0, value_name = "SECS")]
    pub url_ttl: f64,
    /// Added latency per paid call, in milliseconds
    #[arg(long, default_value_t = 0)]
    pub latency_ms: u64,
    /// Random extra latency per paid call, up to this many milliseconds
    #[arg(long, default_value_t = 0)]
    pub jitter_ms: u64,
    /// Added latency per download of a result image, in milliseconds
    #[arg(long, default_value_t = 0)]
    pub download_latency_ms: u64,
    /// Requests per second before 429 (burst: one second's worth)
    #[arg(long, value_name = "PER_SEC")]
    pub rate_limit: Option<f64>,
    /// Requests the rate limit lets through at once after a quiet spell
    #[arg(long, value_name = "N", requires = "rate_limit", value_parser = clap::value_parser!(u32).range(1..))]
    pub rate_burst: Option<u32>,
    /// Which calls the rate limit counts: every /v1 call, or only the paid ones
    #[arg(long, value_enum, default_value = "all")]
    pub rate_limit_scope: RateScope,
    /// Paid requests in flight before 429
    #[arg(long, value_name = "N")]
    pub max_in_flight: Option<usize>,
    /// Side in pixels of a 2K image (4K doubles it), at most 2048 (the service's). No image
    /// the sandbox makes is larger than 16384 pixels a side (a 4K image upscaled 4x): an edit
    /// that would be is refused as invalid. Edits stream their rows, so a call takes a few rows
    /// of memory (two bits a pixel more to remove a background), but every result is kept in
    /// memory as its PNG: at 2048 px, the sample pipeline's 14564 x 8192 upscales weigh about
    /// 0.5 MB each, or 130 MB with --photo-weight (its cut-outs 160 MB)
    #[arg(long, default_value_t = 256)]
    pub image_side: u32,
    /// Draw images that weigh what photos weigh: a grain over every picture, and over the
    /// pixels each edit makes, that does not compress (a 2048-px PNG of several MB, an 8192-px
    /// one of tens of MB), still the same for the same request. Off by default: flat pictures
    /// keep tests and the README's tour fast; benches of downloads, hashing, uploads and
    /// thumbnails turn it on to see real volumes
    #[arg(long)]
    pub photo_weight: bool,
    /// Draw each distinct picture once: a request drawn before (the same prompt, references and
    /// size; the same input image and parameters) is answered with the same PNG, only the
    /// latency added. Nothing a client sees changes but the time. Every picture stays in
    /// memory, so it is off by default; the bytes bench turns it on to measure a night's
    /// storing rather than the sandbox's drawing
    #[arg(long)]
    pub remember_drawings: bool,
    /// Probability of a 500/503 per paid call (nothing billed)
    #[arg(long, default_value_t = 0.0, value_name = "P")]
    pub fault_server_error: f64,
    /// Probability of an extra 429 per paid call (nothing billed)
    #[arg(long, default_value_t = 0.0, value_name = "P")]
    pub fault_rate_limit: f64,
    /// Probability that a paid call is billed and its connection then dropped
    #[arg(long, default_value_t = 0.0, value_name = "P")]
    pub fault_drop: f64,
    /// Probability that a paid call is billed and a gateway then answers 504
    #[arg(long, default_value_t = 0.0, value_name = "P")]
    pub fault_gateway_timeout: f64,
    /// Probability that a paid call is billed, its answer starts naming the job, and the
    /// connection is then cut
    #[arg(long, default_value_t = 0.0, value_name = "P")]
    pub fault_partial: f64,
    /// Probability that a download stops half way
    #[arg(long, default_value_t = 0.0, value_name = "P")]
    pub fault_truncate: f64,
    /// Probability that an image comes back one flat colour (per image), for checks to catch
    #[arg(long, default_value_t = 0.0, value_name = "P")]
    pub fault_blank: f64,
    /// Probability that remove_background returns its input, nothing transparent
    #[arg(long, default_value_t = 0.0, value_name = "P")]
    pub fault_opaque_cutout: f64,
    /// Probability that upscale or expand returns its input, at the input's size
    #[arg(long, default_value_t = 0.0, value_name = "P")]
    pub fault_wrong_size: f64,
    /// Probability that a generation of several images returns the same image each time
    #[arg(long, default_value_t = 0.0, value_name = "P")]
    pub fault_duplicate: f64,
    /// Seed of the fault generator (bad images included)
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

impl SandboxArgs {
    fn config(&self) -> Result<sandbox::Config, Error> {
        let probability = |flag: &str, p: f64| {
            if (0.0..=1.0).contains(&p) {
                Ok(p)
            } else {
                Err(Error::usage(
                    format!("{flag} must be a probability between 0 and 1, got {p}"),
                    None,
                ))
            }
        };
        let url_ttl = seconds("--url-ttl", self.url_ttl)?;
        if let Some(rate) = self.rate_limit
            && !(rate.is_finite() && (0.001..=1_000_000.0).contains(&rate))
        {
            return Err(Error::usage(
                format!(
                    "--rate-limit must be between 0.001 and 1000000 requests per second, got {rate}"
                ),
                None,
            ));
        }
        if self.max_in_flight == Some(0) {
            return Err(Error::usage("--max-in-flight must be at least 1", None));
        }
        if self.image_side == 0 || self.image_side > 2048 {
            return Err(Error::usage(
                "--image-side must be between 1 and 2048",
                None,
            ));
        }
        Ok(sandbox::Config {
            port: self.port,
            key: self.key.clone(),
            balance: self.balance,
            generation_price: self.generation_price,
            advertise_price: self.advertise_price,
            url_ttl,
            latency: Duration::from_millis(self.latency_ms),
            jitter: Duration::from_millis(self.jitter_ms),
            download_latency: Duration::from_millis(self.download_latency_ms),
            rate_limit: self.rate_limit,
            rate_burst: self.rate_burst,
            rate_scope: self.rate_limit_scope.into(),
            max_in_flight: self.max_in_flight,
            image_side: self.image_side,
            weight: if self.photo_weight {
                Weight::Photo
            } else {
                Weight::Flat
            },
            remember_drawings: self.remember_drawings,
            faults: Faults {
                server_error: probability("--fault-server-error", self.fault_server_error)?,
                rate_limit: probability("--fault-rate-limit", self.fault_rate_limit)?,
                drop_after_billing: probability("--fault-drop", self.fault_drop)?,
                gateway_timeout: probability(
                    "--fault-gateway-timeout",
                    self.fault_gateway_timeout,
                )?,
                partial_answer: probability("--fault-partial", self.fault_partial)?,
                truncate_download: probability("--fault-truncate", self.fault_truncate)?,
                seed: self.seed,
            },
            bad_images: BadImages {
                blank: probability("--fault-blank", self.fault_blank)?,
                opaque_cutout: probability("--fault-opaque-cutout", self.fault_opaque_cutout)?,
                wrong_size: probability("--fault-wrong-size", self.fault_wrong_size)?,
                duplicate: probability("--fault-duplicate", self.fault_duplicate)?,
            },
        })
    }
}

pub(super) async fn run(
    args: &SandboxArgs,
    global: &GlobalArgs,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let sandbox = Sandbox::start(args.config()?).await.map_err(|e| {
        Error::Other(anyhow::anyhow!(
            "cannot start the sandbox on port {}: {e}",
            args.port
        ))
    })?;
    let base = sandbox.base_url().to_string();
    if global.json {
        stdio::line(json!({"base_url": base, "api_key": sandbox.key()}))?;
    } else {
        stdio::line(format_args!(
            "imgpipe sandbox listening on {base} (credits are not real)"
        ))?;
        stdio::line(format_args!("export IMGPIPE_BASE_URL={base}"))?;
        stdio::line(format_args!("export IMGPIPE_API_KEY={}", sandbox.key()))?;
        let samples: Vec<String> = SAMPLE_NAMES
            .iter()
            .map(|n| format!("https://{SAMPLE_HOST}/assets/{n}.png"))
            .collect();
        stdio::line(format_args!("sample images: {}", samples.join(" ")))?;
        stdio::line(format_args!("stop with Ctrl-C"))?;
    }
    shutdown.cancelled().await;
    tracing::info!("sandbox stopping");
    sandbox.stop().await.map_err(|e| Error::Other(e.into()))
}
