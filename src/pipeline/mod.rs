//! Pipeline files: read ([`yaml`]), typed ([`spec`] through [`de`]), checked ([`check`]) into a
//! [`Pipeline`], with every problem reported at its line ([`diag`]).

pub mod check;
pub mod checks;
pub mod de;
pub mod diag;
pub mod items;
pub mod model;
pub mod rate;
pub mod spec;
pub mod template;
pub mod yaml;

use std::path::Path;

pub use diag::{Diagnostic, Report};
pub use model::{Input, Operation, Pipeline, Reference, Step, StepRef, Tool, ToolOp};

use crate::sha256::Sha256Sum;
/// Typing errors reported before giving up on the rest of the file.
const MAX_SCHEMA_ERRORS: usize = 200;

/// A pipeline file read and checked: the pipeline when nothing is wrong, and the report.
pub struct Loaded {
    pub pipeline: Option<Pipeline>,
    pub report: Report,
}

/// Reads and checks the pipeline file at `path`, named in messages as the user wrote it.
pub fn load(path: &Path) -> Loaded {
    let shown = path.display().to_string();
    match std::fs::read(path) {
        Ok(bytes) => match String::from_utf8(bytes) {
            Ok(text) => load_str(&shown, dir_of(path), &text),
            Err(e) => single(&shown, format!("is not UTF-8 text ({e})")),
        },
        Err(e) => single(&shown, format!("cannot read the pipeline file: {e}")),
    }
}

/// The directory relative paths in the pipeline file at `path` are resolved against.
pub fn dir_of(path: &Path) -> &Path {
    path.parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Checks pipeline `text` as if read from `file`, resolving relative paths against `dir`.
pub fn load_str(file: &str, dir: &Path, text: &str) -> Loaded {
    let mut report = Report::default();
    // Editors on Windows may start the file with a byte order mark; YAML allows it.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let root = match yaml::parse(text) {
        Ok(root) => root,
        Err(e) => {
            report.error(Diagnostic::new(
                file,
                e.mark,
                format!("YAML syntax: {}", e.message),
            ));
            return Loaded {
                pipeline: None,
                report,
            };
        }
    };
    if root.entries().is_none() {
        report.error(Diagnostic::new(
            file,
            root.mark,
            format!(
                "a pipeline file is a mapping of keys (version, name, steps, ...), not {}",
                root.describe()
            ),
        ));
        return Loaded {
            pipeline: None,
            report,
        };
    }
    let typed = de::from_node::<spec::PipelineSpec>(&root, MAX_SCHEMA_ERRORS);
    for e in &typed.errors {
        let mark = e.mark.unwrap_or(root.mark);
        report.error(Diagnostic::new(file, mark, e.to_string()));
    }
    let src = check::Source {
        file,
        dir,
        text_sha256: Sha256Sum::of_bytes(text.as_bytes()),
    };
    let pipeline = check::check(&src, &root, typed, &mut report);
    if pipeline.is_none() && report.is_ok() {
        // Every path to no pipeline reports why; this keeps a missed one from reading as valid.
        report.error(Diagnostic::new(
            file,
            root.mark,
            "the file could not be checked completely; this is a bug in imgpipe, please report it",
        ));
    }
    report.sort();
    Loaded {
        pipeline: pipeline.filter(|_| report.is_ok()),
        report,
    }
}

fn single(file: &str, message: String) -> Loaded {
    let mut report = Report::default();
    report.error(Diagnostic::new(
        file,
        yaml::Mark { line: 1, col: 1 },
        message,
    ));
    Loaded {
        pipeline: None,
        report,
    }
}
