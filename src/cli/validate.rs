//! `imgpipe validate FILE`: every check that needs no network, every problem with its line.

use std::path::{Path, PathBuf};

use clap::Args;
use serde_json::json;

use crate::cli::GlobalArgs;
use crate::error::Error;
use crate::pipeline::{self, Loaded, Pipeline, Report};

#[derive(Debug, Args)]
pub struct ValidateArgs {
    /// The pipeline file
    pub file: PathBuf,
}

/// Problems printed on stderr before the rest are only counted.
const SHOWN_ERRORS: usize = 200;

pub fn run(args: &ValidateArgs, global: &GlobalArgs) -> Result<(), Error> {
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
        println!("{}", serde_json::to_string_pretty(&doc).unwrap_or_default());
        return verdict(&args.file, &loaded.report);
    }
    let pipeline = checked(&args.file, loaded)?;
    let tasks: u64 = pipeline.step_refs().map(|r| pipeline.tasks(r)).sum();
    println!(
        "{} is valid: {} steps, {} items, {tasks} tasks",
        args.file.display(),
        pipeline.steps.len(),
        pipeline.items.len()
    );
    Ok(())
}

/// Prints the report on stderr and gives the pipeline, or exit 2 when anything is wrong.
pub fn checked(file: &Path, loaded: Loaded) -> Result<Pipeline, Error> {
    print_report(&loaded.report);
    verdict(file, &loaded.report)?;
    loaded
        .pipeline
        .ok_or_else(|| Error::usage(format!("{} could not be read", file.display()), None))
}

fn print_report(report: &Report) {
    for d in report.errors.iter().take(SHOWN_ERRORS) {
        eprintln!("error: {d}");
    }
    if report.errors.len() > SHOWN_ERRORS {
        eprintln!(
            "…and {} more errors (--json lists them all)",
            report.errors.len() - SHOWN_ERRORS
        );
    }
    for d in &report.warnings {
        eprintln!("warning: {d}");
    }
}

fn verdict(file: &Path, report: &Report) -> Result<(), Error> {
    match report.errors.len() {
        0 => Ok(()),
        n => Err(Error::usage(
            format!(
                "{} has {n} error{}; nothing was sent",
                file.display(),
                if n == 1 { "" } else { "s" }
            ),
            None,
        )),
    }
}
