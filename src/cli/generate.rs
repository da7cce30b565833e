//! `imgpipe generate`: one generation call, its images downloaded at once.

use std::path::PathBuf;

use crate::api::types::{GenerationRequest, STATUS_SUCCEEDED, Size};
use crate::cli::GlobalArgs;
use crate::cli::output::{Billed, deliver};
use crate::error::Error;
use crate::runner::Connection;

#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub service: crate::cli::args::ServiceArgs,
    /// What to draw (up to 4000 characters)
    #[arg(long)]
    pub prompt: String,
    /// Number of images, 1 to 4
    #[arg(long, default_value_t = 1)]
    pub n: u8,
    /// 2K or 4K (4K bills twice)
    #[arg(long, default_value = "2K", value_parser = parse_size)]
    pub size: Size,
    /// Reference image URL (https, or one the service issued); up to 6
    #[arg(long = "image-url", value_name = "URL")]
    pub image_urls: Vec<String>,
    /// Directory for the downloaded images (created when missing)
    #[arg(long, value_name = "DIR", value_parser = crate::cli::args::out_path)]
    pub out: PathBuf,
}

fn parse_size(s: &str) -> Result<Size, String> {
    s.parse()
        .map_err(|e: crate::api::rules::InvalidField| e.message)
}

pub(super) async fn run(
    args: &GenerateArgs,
    conn: &Connection,
    global: &GlobalArgs,
) -> Result<(), Error> {
    let request = GenerationRequest {
        prompt: args.prompt.clone(),
        n: args.n,
        size: args.size,
        image_urls: args.image_urls.clone(),
    };
    let job = conn.client.generate(&request).await?;
    tracing::info!(job = %job.id.shown(), credits = job.credits_used, "billed; downloading {} image(s)", job.images.len());
    let mut problems = Vec::new();
    if job.status != STATUS_SUCCEEDED {
        problems.push(format!(
            "the service reported status {:?}, not succeeded",
            job.status
        ));
    }
    if job.images.len() != usize::from(args.n) {
        problems.push(format!(
            "asked for {} image(s), the service returned {}",
            args.n,
            job.images.len()
        ));
    }
    let remaining = job
        .credits_remaining
        .map(|r| format!(", {r} remaining"))
        .unwrap_or_default();
    let summary = format!(
        "job {}: {} image(s), {} billed{remaining}",
        job.id.shown(),
        job.images.len(),
        crate::money::credits(job.credits_used)
    );
    let billed = Billed {
        response: serde_json::to_value(&job).map_err(|e| Error::Other(e.into()))?,
        job_id: &job.id,
        urls: job.images.iter().map(|i| i.url.clone()).collect(),
        indexed: true,
        summary,
        problem: (!problems.is_empty())
            .then(|| format!("job {}: {}", job.id.shown(), problems.join("; "))),
    };
    deliver(conn, global, &args.out, billed).await
}
