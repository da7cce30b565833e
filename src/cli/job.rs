//! `imgpipe job <id>`: a past job with fresh URLs; `--out` downloads its images again, free.

use std::path::PathBuf;

use serde_json::json;

use crate::cli::GlobalArgs;
use crate::cli::connect::Connection;
use crate::cli::output::{files_json, print_files, print_json, save_images};
use crate::error::Error;

#[derive(Debug, clap::Args)]
pub struct JobArgs {
    /// Job id, as returned by a call (job_...)
    pub id: String,
    /// Download the job's images into this directory
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
}

pub async fn run(args: &JobArgs, conn: &Connection, global: &GlobalArgs) -> Result<(), Error> {
    let job = conn.client.job(&args.id).await?;
    let urls = job.image_urls();
    let indexed = job.raw().get("images").is_some();
    let files = match &args.out {
        Some(dir) => save_images(conn, &args.id, &urls, indexed, dir).await?,
        None => Vec::new(),
    };
    if global.json {
        return print_json(&json!({"job": job.raw(), "files": files_json(&files)}));
    }
    println!("job      {}", job.id().unwrap_or(&args.id));
    println!("status   {}", job.status().unwrap_or("(not stated)"));
    if let Some(credits) = job.credits_used() {
        println!("credits  {credits}");
    }
    for url in &urls {
        println!("url      {url}");
    }
    print_files(&files);
    Ok(())
}
