//! `imgpipe tool <name>`: one editing call, its result downloaded at once.

use std::path::PathBuf;

use crate::api::rules::InvalidField;
use crate::api::types::{
    AspectRatio, Increase, STATUS_SUCCEEDED, ToolName, ToolParams, ToolRequest,
};
use crate::cli::GlobalArgs;
use crate::cli::output::{Billed, deliver};
use crate::error::Error;
use crate::runner::Connection;

#[derive(Debug, clap::Args)]
pub struct ToolArgs {
    #[command(flatten)]
    pub service: crate::cli::args::ServiceArgs,
    /// remove_background (5 credits), upscale (2 for 2x, 4 for 4x), expand (5) or erase (2)
    #[arg(value_parser = parse::<ToolName>)]
    pub tool: ToolName,
    /// The image to edit: a URL the service issued, or a public URL
    #[arg(long, value_name = "URL")]
    pub image_url: String,
    /// upscale: 2 or 4 (default 2)
    #[arg(long, value_parser = parse::<Increase>)]
    pub desired_increase: Option<Increase>,
    /// expand: target aspect ratio, <width>:<height>
    #[arg(long, value_parser = parse::<AspectRatio>)]
    pub aspect_ratio: Option<AspectRatio>,
    /// expand: how to extend the image
    #[arg(long)]
    pub prompt: Option<String>,
    /// erase: the object to erase
    #[arg(long)]
    pub object_name: Option<String>,
    /// Keep transparency where the tool supports it (the service's default is true)
    #[arg(long, value_name = "BOOL")]
    pub preserve_alpha: Option<bool>,
    /// Directory for the downloaded image (created when missing)
    #[arg(long, value_name = "DIR", value_parser = crate::cli::args::out_path)]
    pub out: PathBuf,
}

fn parse<T: std::str::FromStr<Err = InvalidField>>(s: &str) -> Result<T, String> {
    s.parse().map_err(|e: InvalidField| e.message)
}

impl ToolArgs {
    /// The tool's parameters; a flag meant for another tool is an error, not silently dropped.
    fn params(&self) -> Result<ToolParams, Error> {
        let stray = |flag: &str, owner: &str| {
            Error::usage(
                format!("{flag} applies only to {owner}, not to {}", self.tool),
                None,
            )
        };
        let t = self.tool;
        if self.desired_increase.is_some() && t != ToolName::Upscale {
            return Err(stray("--desired-increase", "upscale"));
        }
        if (self.aspect_ratio.is_some() || self.prompt.is_some()) && t != ToolName::Expand {
            return Err(stray("--aspect-ratio and --prompt", "expand"));
        }
        if self.object_name.is_some() && t != ToolName::Erase {
            return Err(stray("--object-name", "erase"));
        }
        Ok(match t {
            ToolName::RemoveBackground => ToolParams::RemoveBackground,
            ToolName::Upscale => ToolParams::Upscale {
                desired_increase: self.desired_increase.unwrap_or(Increase::X2),
            },
            ToolName::Expand => ToolParams::Expand {
                aspect_ratio: self.aspect_ratio,
                prompt: self.prompt.clone(),
            },
            ToolName::Erase => ToolParams::Erase {
                object_name: self.object_name.clone().ok_or_else(|| {
                    Error::usage("erase needs --object-name: the object to erase", None)
                })?,
            },
        })
    }
}

pub(super) async fn run(
    args: &ToolArgs,
    conn: &Connection,
    global: &GlobalArgs,
) -> Result<(), Error> {
    let request = ToolRequest {
        image_url: args.image_url.clone(),
        preserve_alpha: args.preserve_alpha,
        params: args.params()?,
    };
    let job = conn.client.tool(&request).await?;
    tracing::info!(job = %job.id.shown(), credits = job.credits_used, "billed; downloading the result");
    let billed = Billed {
        response: serde_json::to_value(&job).map_err(|e| Error::Other(e.into()))?,
        job_id: &job.id,
        urls: vec![job.data.url.clone()],
        indexed: false,
        summary: format!(
            "job {}: {} done, {} billed",
            job.id.shown(),
            job.tool.escape_debug(),
            crate::money::credits(job.credits_used)
        ),
        problem: (job.status != STATUS_SUCCEEDED).then(|| {
            format!(
                "job {}: the service reported status {:?}, not succeeded",
                job.id.shown(),
                job.status
            )
        }),
    };
    deliver(conn, global, &args.out, billed).await
}
