//! `imgpipe job <id>`: a past job with fresh URLs; `--out` downloads its images again, free.

use std::path::PathBuf;

use serde_json::json;

use crate::api::job_id::JobId;
use crate::cli::GlobalArgs;
use crate::cli::output::{Billed, deliver, print_json};
use crate::cli::stdio;
use crate::error::Error;
use crate::runner::Connection;

#[derive(Debug, clap::Args)]
pub struct JobArgs {
    #[command(flatten)]
    pub service: crate::cli::args::ServiceArgs,
    /// Job id, as returned by a call (job_...)
    pub id: JobId,
    /// Download the job's images into this directory
    #[arg(long, value_name = "DIR", value_parser = crate::cli::args::out_path)]
    pub out: Option<PathBuf>,
}

pub(super) async fn run(
    args: &JobArgs,
    conn: &Connection,
    global: &GlobalArgs,
) -> Result<(), Error> {
    let job = conn.client.job(&args.id).await?;
    let urls = job.image_urls();
    let mut lines = vec![
        format!("job      {}", job.id().unwrap_or(args.id.as_str())),
        format!(
            "status   {}",
            job.status().unwrap_or("(not stated)").escape_debug()
        ),
    ];
    if let Some(credits) = job.credits_used() {
        lines.push(format!("credits  {credits}"));
    }
    lines.extend(
        urls.iter()
            .map(|u| format!("url      {}", u.escape_debug())),
    );
    let Some(dir) = &args.out else {
        if global.json {
            return print_json(conn, &json!({"job": job.raw(), "files": []}));
        }
        stdio::line(conn.redact(&lines.join("\n")))?;
        return Ok(());
    };
    let billed = Billed {
        response: job.raw().clone(),
        job_id: &args.id,
        indexed: job.raw().get("images").is_some(),
        urls,
        summary: lines.join("\n"),
        problem: None,
    };
    deliver(conn, global, dir, billed).await
}
