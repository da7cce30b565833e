//! `imgpipe validate FILE`: every check that needs no network, every problem with its line.

use std::path::PathBuf;

use clap::Args;
use serde_json::json;

use crate::cli::GlobalArgs;
use crate::cli::stdio;
use crate::cli::view::Terminal;
use crate::error::Error;
use crate::pipeline;
use crate::plan::render::count;
use crate::runner;

#[derive(Debug, Args)]
pub struct ValidateArgs {
    /// The pipeline file
    pub file: PathBuf,
}

pub(super) fn run(args: &ValidateArgs, global: &GlobalArgs) -> Result<(), Error> {
    let loaded = pipeline::load(&args.file);
    if global.json {
        let summary = loaded.pipeline.as_ref().map(|p| {
            json!({"name": p.name, "steps": p.steps.len(), "items": p.items.len(),
                   "tasks": p.step_refs().map(|r| p.tasks(r)).sum::<u64>()})
        });
        let doc = json!({
            "file": args.file.display().to_string(),
            "valid": loaded.report.is_ok(),
            "errors": loaded.report.errors,
            "warnings": loaded.report.warnings,
            "pipeline": summary,
        });
        stdio::line(serde_json::to_string_pretty(&doc).unwrap_or_default())?;
        return runner::verdict(&args.file, &loaded.report);
    }
    let pipeline = runner::checked(&Terminal::plain(false), &args.file, loaded)?;
    let tasks: u64 = pipeline.step_refs().map(|r| pipeline.tasks(r)).sum();
    stdio::line(format_args!(
        "{} is valid: {}, {}, {}",
        args.file.display(),
        count(pipeline.steps.len() as u64, "step"),
        count(pipeline.items.len() as u64, "item"),
        count(tasks, "task")
    ))?;
    Ok(())
}
