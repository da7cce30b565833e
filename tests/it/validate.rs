//! `imgpipe validate`: the corpus of malformed pipeline files in `tests/pipelines/bad/`, each
//! reported at the right line with the right message, the `--json` report, and that validating
//! needs no network, no key and writes nothing.
//!
//! Each corpus file starts with comment lines saying what `validate` must report:
//!
//! ```text
//! # expect-file: data/x.csv      (optional: the line is in this file, relative to the corpus)
//! # expect-line: 12              (1-based, header comments included)
//! # expect-message: unknown key `promt`; did you mean `prompt`?
//! # expect-absent: i64           (optional: no error line may contain this)
//! ```
//!
//! `expect-file` and `expect-line` apply to the next `expect-message`; a file may hold several
//! such groups, each of which must match a different error line. Supporting files (items files)
//! live next to the pipelines under other extensions, or in `data/`.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::SystemTime;

use futures::future::join_all;
use serde_json::Value;

use crate::common::*;

/// The corpus, relative to the manifest directory (the binary runs there, so the file names it
/// prints are these relative paths).
const CORPUS: &str = "tests/pipelines/bad";
const MIN_CORPUS_FILES: usize = 30;
/// Exit code for invalid input.
const EXIT_INVALID: i32 = 2;

fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[derive(Debug)]
struct Expectation {
    /// The file the error is reported against, as the binary prints it.
    file: String,
    line: usize,
    message: String,
}

#[derive(Debug)]
struct Case {
    /// `tests/pipelines/bad/<name>.yaml`, as passed to the binary.
    path: String,
    expected: Vec<Expectation>,
    absent: Vec<String>,
}

/// The expectations in the leading comment lines of a corpus file.
fn parse_case(path: &str, text: &str) -> Result<Case, String> {
    let mut case = Case {
        path: path.to_owned(),
        expected: Vec::new(),
        absent: Vec::new(),
    };
    let mut file: Option<String> = None;
    let mut line: Option<usize> = None;
    for (i, raw) in text.lines().enumerate() {
        let Some(comment) = raw.strip_prefix('#') else {
            break;
        };
        let Some((key, value)) = comment.trim().split_once(':') else {
            continue;
        };
        let value = value.trim();
        let at = i + 1;
        match key.trim() {
            "expect-file" => {
                let shown = Path::new(CORPUS).join(value).display().to_string();
                if file.replace(shown).is_some() {
                    return Err(format!(
                        "line {at}: a second expect-file before expect-message"
                    ));
                }
            }
            "expect-line" => {
                let n = value
                    .parse::<usize>()
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or_else(|| format!("line {at}: expect-line {value:?} is not a line"))?;
                if line.replace(n).is_some() {
                    return Err(format!(
                        "line {at}: a second expect-line before expect-message"
                    ));
                }
            }
            "expect-message" => {
                if value.is_empty() {
                    return Err(format!("line {at}: empty expect-message"));
                }
                let line = line
                    .take()
                    .ok_or_else(|| format!("line {at}: expect-message without expect-line"))?;
                case.expected.push(Expectation {
                    file: file.take().unwrap_or_else(|| path.to_owned()),
                    line,
                    message: value.to_owned(),
                });
            }
            "expect-absent" => {
                if value.is_empty() {
                    return Err(format!("line {at}: empty expect-absent"));
                }
                case.absent.push(value.to_owned());
            }
            other if other.starts_with("expect") => {
                return Err(format!("line {at}: unknown header `{other}`"));
            }
            _ => {}
        }
    }
    if line.is_some() || file.is_some() {
        return Err("expect-line or expect-file without its expect-message".into());
    }
    if case.expected.is_empty() {
        return Err("no `# expect-line:` / `# expect-message:` header".into());
    }
    Ok(case)
}

/// Every `*.yaml` of the corpus, sorted by name.
fn corpus() -> Vec<PathBuf> {
    let dir = manifest_dir().join(CORPUS);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
}

/// `imgpipe validate ARGS...` run from the manifest directory, with no IMGPIPE_* variables.
fn validate(args: &[&str]) -> impl Future<Output = Output> + use<> {
    let mut all = vec!["validate"];
    all.extend_from_slice(args);
    finish(Imgpipe::new(&all).cwd(manifest_dir()).command())
}

/// What is wrong with one run against its case; empty when it is all as expected.
fn check_run(case: &Case, o: &Output) -> Vec<String> {
    let mut problems = Vec::new();
    let err = stderr(o);
    if o.status.code() != Some(EXIT_INVALID) {
        problems.push(format!(
            "exit status {:?}, expected {EXIT_INVALID}",
            o.status.code()
        ));
    }
    if err.contains("panicked") {
        problems.push("the binary panicked".into());
    }
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error: ")).collect();
    let mut used = vec![false; errors.len()];
    for e in &case.expected {
        let prefix = format!("error: {}:{}:", e.file, e.line);
        let found = errors
            .iter()
            .enumerate()
            .find(|(i, l)| !used[*i] && l.starts_with(&prefix) && l.contains(&e.message));
        match found {
            Some((i, _)) => used[i] = true,
            None => problems.push(format!(
                "no error at {}:{} containing {:?}",
                e.file, e.line, e.message
            )),
        }
    }
    for needle in &case.absent {
        for l in errors.iter().filter(|l| l.contains(needle.as_str())) {
            problems.push(format!(
                "an error contains {needle:?}, which it must not: {l}"
            ));
        }
    }
    problems
}

#[tokio::test(flavor = "multi_thread")]
async fn every_malformed_pipeline_is_reported_at_its_line() {
    let files = corpus();
    assert!(
        files.len() >= MIN_CORPUS_FILES,
        "the corpus in {CORPUS} has {} files; at least {MIN_CORPUS_FILES} expected",
        files.len()
    );
    let mut failures = Vec::new();
    let mut cases = Vec::new();
    for file in &files {
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        let path = format!("{CORPUS}/{name}");
        let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{path}: {e}"));
        match parse_case(&path, &text) {
            Ok(case) => cases.push(case),
            Err(why) => failures.push(format!("{path}: bad header: {why}")),
        }
    }
    // Each run takes milliseconds; running them side by side keeps the whole corpus quick.
    let outputs = join_all(cases.iter().map(|c| validate(&[&c.path]))).await;
    for (case, o) in cases.iter().zip(&outputs) {
        let problems = check_run(case, o);
        if !problems.is_empty() {
            failures.push(format!(
                "{}:\n  - {}\n  stderr:\n{}",
                case.path,
                problems.join("\n  - "),
                stderr(o)
                    .lines()
                    .map(|l| format!("    | {l}"))
                    .collect::<Vec<_>>()
                    .join("\n")
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} corpus files are not reported as expected:\n\n{}",
        failures.len(),
        files.len(),
        failures.join("\n\n")
    );
}

#[test]
fn the_corpus_header_parser_reads_groups_and_refuses_half_ones() {
    let case = parse_case(
        "p.yaml",
        "# expect-line: 3\n# expect-message: a\n# expect-file: data/x.csv\n# expect-line: 2\n\
         # expect-message: b\n# expect-absent: c\nversion: 1\n# expect-line: 9\n",
    )
    .unwrap();
    let got: Vec<(&str, usize, &str)> = case
        .expected
        .iter()
        .map(|e| (e.file.as_str(), e.line, e.message.as_str()))
        .collect();
    let csv = format!("{CORPUS}/data/x.csv");
    assert_eq!(got, [("p.yaml", 3, "a"), (csv.as_str(), 2, "b")]);
    assert_eq!(case.absent, ["c"]);
    for bad in [
        "version: 1\n",
        "# expect-message: a\n",
        "# expect-line: 0\n# expect-message: a\n",
        "# expect-line: 2\n",
        "# expect-lien: 2\n# expect-message: a\n",
        "# expect-line: 2\n# expect-message: a\n# expect-absent:\n",
    ] {
        assert!(parse_case("p.yaml", bad).is_err(), "{bad:?}");
    }
}

/// The multi-error corpus file with a templating error for one item.
const MULTI_ERROR: &str = "60-several-semantic-errors.yaml";

#[tokio::test(flavor = "multi_thread")]
async fn json_report_lists_every_error_with_file_line_column_and_item() {
    let path = format!("{CORPUS}/{MULTI_ERROR}");
    let text = std::fs::read_to_string(manifest_dir().join(&path)).unwrap();
    let case = parse_case(&path, &text).unwrap();
    assert!(case.expected.len() >= 3, "{case:?}");

    let o = validate(&["--json", &path]).await;
    assert_exit_without_panic(&o, EXIT_INVALID);
    let doc = json_stdout(&o);
    assert_eq!(doc["valid"], Value::Bool(false), "{doc:#}");
    assert_eq!(doc["file"], path.as_str(), "{doc:#}");
    assert!(doc["pipeline"].is_null(), "{doc:#}");
    let errors = doc["errors"].as_array().expect("errors is an array");
    assert_eq!(errors.len(), case.expected.len(), "{doc:#}");
    for e in errors {
        assert!(e["file"].is_string(), "{e}");
        assert!(e["line"].as_u64().is_some_and(|n| n > 0), "{e}");
        assert!(e["column"].as_u64().is_some_and(|n| n > 0), "{e}");
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{e}");
    }
    // The same errors as the text report: every expectation of the file, at its line.
    for x in &case.expected {
        let found = errors.iter().any(|e| {
            let shown = match e["item"].as_str() {
                Some(item) => format!("item {item:?}: {}", e["message"].as_str().unwrap()),
                None => e["message"].as_str().unwrap().to_owned(),
            };
            e["file"] == x.file.as_str()
                && e["line"].as_u64() == Some(x.line as u64)
                && shown.contains(&x.message)
        });
        assert!(found, "no JSON error matches {x:?}:\n{doc:#}");
    }
    let templated: Vec<&Value> = errors.iter().filter(|e| !e["item"].is_null()).collect();
    assert_eq!(templated.len(), 1, "{doc:#}");
    assert_eq!(templated[0]["item"], "lamp");
    assert!(
        templated[0]["message"]
            .as_str()
            .unwrap()
            .contains("object_name is empty"),
        "{doc:#}"
    );
}

/// Every file and directory under `dir` with its size and modification time.
fn snapshot(dir: &Path) -> Vec<(PathBuf, u64, Option<SystemTime>)> {
    let mut out = Vec::new();
    for path in entries(dir) {
        let meta = std::fs::symlink_metadata(&path).unwrap();
        out.push((path.clone(), meta.len(), meta.modified().ok()));
        if meta.is_dir() {
            out.extend(snapshot(&path));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn validate_needs_no_network_no_key_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let sample = "product-shots.yaml";
    std::fs::copy(
        manifest_dir().join("pipelines").join(sample),
        dir.path().join(sample),
    )
    .unwrap();
    let before = snapshot(dir.path());

    // `command` removes IMGPIPE_BASE_URL, IMGPIPE_API_KEY and IMGPIPE_LOG: no service, no key.
    let o = Imgpipe::new(&["validate", sample])
        .cwd(dir.path())
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    assert_eq!(
        stdout(&o).trim(),
        format!("{sample} is valid: 5 steps, 3 items, 27 tasks"),
        "{}",
        stderr(&o)
    );
    assert!(!stderr(&o).contains("error"), "{}", stderr(&o));

    let o = Imgpipe::new(&["validate", "--json", sample])
        .cwd(dir.path())
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let doc = json_stdout(&o);
    assert_eq!(doc["valid"], Value::Bool(true), "{doc:#}");
    assert_eq!(doc["errors"], serde_json::json!([]), "{doc:#}");
    let summary = &doc["pipeline"];
    assert_eq!(summary["name"], "product-shots", "{doc:#}");
    assert_eq!(summary["steps"], 5, "{doc:#}");
    assert_eq!(summary["items"], 3, "{doc:#}");
    assert_eq!(summary["tasks"], 27, "{doc:#}");

    assert_eq!(
        snapshot(dir.path()),
        before,
        "validate wrote to the pipeline's directory"
    );
}
