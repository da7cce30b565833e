//! `imgpipe generate`: one generation call, its images downloaded at once.

use std::path::PathBuf;

use serde_json::json;

use crate::api::types::{GenerationRequest, STATUS_SUCCEEDED, Size};
use crate::cli::GlobalArgs;
use crate::cli::connect::Connection;
use crate::cli::output::{files_json, print_files, print_json, save_images};
use crate::error::Error;

#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
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
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
}

fn parse_size(s: &str) -> Result<Size, String> {
    s.parse()
        .map_err(|e: crate::api::rules::InvalidField| e.message)
}

pub async fn run(args: &GenerateArgs, conn: &Connection, global: &GlobalArgs) -> Result<(), Error> {
    let request = GenerationRequest {
        prompt: args.prompt.clone(),
        n: args.n,
        size: args.size,
        image_urls: args.image_urls.clone(),
    };
    let job = conn.client.generate(&request).await?;
    if job.status != STATUS_SUCCEEDED {
        tracing::warn!(job = %job.id, status = %job.status, "the service reported a status other than succeeded");
    }
    let urls: Vec<String> = job.images.iter().map(|i| i.url.clone()).collect();
    let files = save_images(conn, &job.id, &urls, true, &args.out).await?;
    if global.json {
        return print_json(&json!({"job": job, "files": files_json(&files)}));
    }
    let remaining = job
        .credits_remaining
        .map(|r| format!(", {r} remaining"))
        .unwrap_or_default();
    println!(
        "job {}: {} image(s), {} credits billed{remaining}",
        job.id,
        job.images.len(),
        job.credits_used
    );
    print_files(&files);
    Ok(())
}
