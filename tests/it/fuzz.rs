//! Fuzzing what users type: the sample pipelines of `pipelines/` and their items files, mutated
//! (bytes, keys, values, indentation, line ends, Unicode and invalid UTF-8), must be validated
//! without a panic, every error and warning pointing inside the file it names; the binary's
//! `validate` exits 0 or 2 on them, agreeing with the library.
//!
//! Bounded for CI: [`DEFAULT_CASES`] inputs in-process and an eighth of that through the binary,
//! a few seconds. `IMGPIPE_FUZZ_CASES=N` runs a longer campaign (`--nocapture` shows the count).
//! Each run draws a new seed, prints it, and names it when it fails; `IMGPIPE_FUZZ_SEED=S`
//! draws the inputs of seed S again. A failing input is kept, as proptest's seed of that one
//! input, in `tests/fuzz-regressions/` (one file per test, committed), and every run tries the
//! inputs kept there before any new one; proptest prints the smallest failing input it finds.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use imgpipe::pipeline::{self, Diagnostic};
use proptest::prelude::*;
use proptest::test_runner::{
    Config, FileFailurePersistence, RngAlgorithm, TestCaseError, TestRng, TestRunner,
};

/// Inputs tried in-process per run unless `IMGPIPE_FUZZ_CASES` says otherwise.
const DEFAULT_CASES: u32 = 384;
/// Through the binary: a process per input, so fewer.
const BINARY_SHARE: u32 = 8;
/// The failing inputs of each test, kept and tried again first on every run (see the module).
const IN_PROCESS_REGRESSIONS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fuzz-regressions/in-process.txt"
);
const BINARY_REGRESSIONS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fuzz-regressions/binary.txt"
);
/// How long one `imgpipe validate` may take (it takes milliseconds): a binary stuck on an
/// input fails the case rather than hang the suite.
const VALIDATE_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);

/// A sample pipeline with its items file, if it has one.
#[derive(Clone, Debug)]
struct Seed {
    /// The pipeline's file name, e.g. `edit-only.yaml`.
    name: String,
    text: Vec<u8>,
    items: Option<(String, Vec<u8>)>,
}

/// The samples of `pipelines/`, plus `edit-only.yaml` reading its items from JSONL (made from
/// the CSV), so both items formats are mutated.
fn seeds() -> Vec<Seed> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines");
    let mut names: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    names.sort();
    let mut seeds = Vec::new();
    for path in names {
        let text = std::fs::read_to_string(&path).unwrap();
        let items = text.lines().find_map(|l| {
            let name = l.strip_prefix("items_from:")?.split('#').next()?.trim();
            Some((name.to_owned(), std::fs::read(dir.join(name)).unwrap()))
        });
        seeds.push(Seed {
            name: path.file_name().unwrap().to_string_lossy().into_owned(),
            text: text.clone().into_bytes(),
            items: items.clone(),
        });
        if let Some((csv_name, csv)) = items {
            let jsonl_name = csv_name.replace(".csv", ".jsonl");
            seeds.push(Seed {
                name: path
                    .file_name()
                    .unwrap()
                    .to_string_lossy()
                    .replace(".yaml", "-jsonl.yaml"),
                text: text.replace(&csv_name, &jsonl_name).into_bytes(),
                items: Some((jsonl_name, csv_to_jsonl(&csv))),
            });
        }
    }
    assert!(seeds.len() >= 5, "{seeds:?}");
    seeds
}

fn csv_to_jsonl(csv: &[u8]) -> Vec<u8> {
    let text = std::str::from_utf8(csv).unwrap();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let mut out = String::new();
    for line in lines {
        let object: serde_json::Map<String, serde_json::Value> = header
            .iter()
            .zip(line.split(','))
            .map(|(k, v)| ((*k).to_owned(), v.into()))
            .collect();
        out += &serde_json::Value::Object(object).to_string();
        out += "\n";
    }
    out.into_bytes()
}

/// Keys a renamed key becomes: other keys of the format, near misses, and odd ones.
const KEYS: &[&str] = &[
    "version",
    "name",
    "steps",
    "id",
    "from",
    "once",
    "n",
    "size",
    "prompt",
    "items",
    "items_from",
    "budget",
    "max_credits",
    "pricing",
    "generation",
    "concurrency",
    "rate_limit",
    "output_dir",
    "reuse",
    "generate",
    "erase",
    "expand",
    "upscale",
    "remove_background",
    "object_name",
    "desired_increase",
    "aspect_ratio",
    "image_url",
    "image_urls",
    "preserve_alpha",
    "subject",
    "url",
    "remove",
    "promt",
    "stpes",
    "ID",
    "",
    "\"\"",
    "''",
    "?",
    "<<",
    "&a id",
    "*a",
    "!!str id",
    "- id",
    "id id",
    "{id}",
    "[id]",
    "naïve",
    "名前",
    "\u{202e}di",
    "id\u{200b}",
    "\u{feff}id",
    "🙂",
    "a\u{0}b",
    "1",
    "null",
    "true",
];

/// Values a replaced value becomes: every YAML type, numbers far out of range, templates,
/// paths, and Unicode.
const VALUES: &[&str] = &[
    "0",
    "-1",
    "1.5",
    "-0",
    "1e400",
    "-1e400",
    "18446744073709551616",
    "-9223372036854775809",
    "99999999999999999999999999999999",
    "0x10",
    "0o17",
    "0b101",
    ".inf",
    "-.inf",
    ".nan",
    "true",
    "no",
    "~",
    "null",
    "''",
    "\"\"",
    "[]",
    "{}",
    "[1, [2, [3]]]",
    "{a: 1}",
    "{ from: shot }",
    "[{ from: style }]",
    "\"{{ item.subject }}\"",
    "\"{{ item.nope }}\"",
    "\"{{\"",
    "}}",
    "{{ item.id }}",
    "*a",
    "&a x",
    "!!binary aGk=",
    "!!int 3",
    "!!float x",
    "!custom x",
    "|",
    ">-",
    "'open",
    "\"open",
    "- a",
    "a: b",
    "? a",
    "https://sandbox.invalid/assets/mug.png",
    "http://127.0.0.1:1/x.png",
    "file:///etc/passwd",
    "../../../etc/passwd.csv",
    "/nonexistent/items.jsonl",
    "items.txt",
    "4K",
    "8K",
    "2K",
    "1K",
    "16:9",
    "21:9",
    "0:0",
    "1:99999999999999999999",
    "1/s",
    "0/s",
    "999999999/h",
    "5/fortnight",
    "2025-01-01",
    "日本語",
    "🙂🙂🙂",
    "\u{202e}lamp",
    "zero\u{200b}width",
    "e\u{301}",
    "\u{0}",
    "\"\\u0000\"",
    "\"\\ud800\"",
    "\u{ffff}",
    "\u{10ffff}",
    "שלום",
    "مرحبا",
];

/// Snippets inserted anywhere: multi-byte, right-to-left, zero-width, control and line-break
/// characters.
const UNICODE: &[&str] = &[
    "é",
    "ß",
    "日本",
    "🙂",
    "👩‍👩‍👧",
    "\u{202e}",
    "\u{200f}",
    "\u{200b}",
    "\u{200d}",
    "\u{feff}",
    "\u{0}",
    "\u{7}",
    "\u{1b}[31m",
    "\u{2028}",
    "\u{2029}",
    "\u{85}",
    "\r",
    "\t",
    "e\u{301}",
    "\u{ffff}",
    "\u{10ffff}",
    "שלום",
    "مرحبا",
    "\u{fffd}",
];

/// Byte sequences that are not UTF-8: a stray continuation, a cut sequence, a surrogate, an
/// overlong encoding, beyond U+10FFFF.
const INVALID_UTF8: &[&[u8]] = &[
    b"\xff",
    b"\x80",
    b"\xc3",
    b"\xe2\x82",
    b"\xed\xa0\x80",
    b"\xc0\xaf",
    b"\xf4\x90\x80\x80",
];

#[derive(Clone, Debug)]
enum Mutation {
    FlipBit { at: usize, bit: u8 },
    InsertByte { at: usize, byte: u8 },
    Delete { at: usize, len: usize },
    RenameKey { nth: usize, to: &'static str },
    ReplaceValue { nth: usize, with: String },
    Indent { line: usize, change: Indent },
    DuplicateLine { line: usize },
    DeleteLine { line: usize },
    SwapLines { line: usize },
    LineEnds(&'static str),
    Unicode { at: usize, text: &'static str },
    InvalidUtf8 { at: usize, bytes: &'static [u8] },
}

#[derive(Clone, Copy, Debug)]
enum Indent {
    Add(usize),
    Remove(usize),
    Tab,
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let at = any::<usize>();
    prop_oneof![
        1 => (at, 0u8..8).prop_map(|(at, bit)| Mutation::FlipBit { at, bit }),
        1 => (at, any::<u8>()).prop_map(|(at, byte)| Mutation::InsertByte { at, byte }),
        1 => (at, 1usize..40).prop_map(|(at, len)| Mutation::Delete { at, len }),
        1 => (at, proptest::sample::select(KEYS))
            .prop_map(|(nth, to)| Mutation::RenameKey { nth, to }),
        2 => (at, value()).prop_map(|(nth, with)| Mutation::ReplaceValue { nth, with }),
        1 => (
            at,
            prop_oneof![
                (1usize..5).prop_map(Indent::Add),
                (1usize..5).prop_map(Indent::Remove),
                Just(Indent::Tab)
            ]
        )
            .prop_map(|(line, change)| Mutation::Indent { line, change }),
        1 => at.prop_map(|line| Mutation::DuplicateLine { line }),
        1 => at.prop_map(|line| Mutation::DeleteLine { line }),
        1 => at.prop_map(|line| Mutation::SwapLines { line }),
        1 => proptest::sample::select(&["\r\n", "\r", "\n\n"][..]).prop_map(Mutation::LineEnds),
        2 => (at, proptest::sample::select(UNICODE))
            .prop_map(|(at, text)| Mutation::Unicode { at, text }),
        1 => (at, proptest::sample::select(INVALID_UTF8))
            .prop_map(|(at, bytes)| Mutation::InvalidUtf8 { at, bytes }),
    ]
}

/// A value from [`VALUES`], repeated or written from arbitrary characters at times.
fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => proptest::sample::select(VALUES).prop_map(str::to_owned),
        1 => (proptest::sample::select(VALUES), 2usize..2000).prop_map(|(v, n)| v.repeat(n)),
        1 => "\\PC{0,12}",
        1 => any::<i128>().prop_map(|n| n.to_string()),
        1 => any::<f64>().prop_map(|n| n.to_string()),
    ]
}

/// Byte spans of keys and of their values. YAML and JSONL: a key, bare or double-quoted, then
/// `:` and a space or the line end; its value runs to the line end, a `,`, a `}` or a comment,
/// or past a closing quote. CSV: the header's cells are the keys, the others the values.
fn fields(text: &[u8], csv: bool) -> (Vec<Range<usize>>, Vec<Range<usize>>) {
    let (mut keys, mut values) = (Vec::new(), Vec::new());
    if csv {
        let mut start = 0;
        let mut header = true;
        for (i, b) in text
            .iter()
            .copied()
            .enumerate()
            .chain([(text.len(), b'\n')])
        {
            if b == b',' || b == b'\n' {
                let cell = start..i;
                if header { &mut keys } else { &mut values }.push(cell);
                start = i + 1;
                header &= b != b'\n';
            }
        }
        return (keys, values);
    }
    let word = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b'-';
    let mut i = 0;
    while i < text.len() {
        let starts = i == 0 || matches!(text[i - 1], b' ' | b'\n' | b'{' | b',' | b'-' | b'\t');
        let end = if starts && text[i] == b'"' {
            text[i + 1..]
                .iter()
                .position(|&b| b == b'"' || b == b'\n')
                .map(|n| i + 1 + n + 1)
                .filter(|&e| text[e - 1] == b'"')
        } else if starts && word(text[i]) {
            Some(i + text[i..].iter().take_while(|&&b| word(b)).count())
        } else {
            None
        };
        let Some(end) = end.filter(|&e| text.get(e) == Some(&b':')) else {
            i += 1;
            continue;
        };
        if !matches!(text.get(end + 1), None | Some(b' ' | b'\n' | b'\r' | b'"')) {
            i = end;
            continue;
        }
        keys.push(i..end);
        let mut v = end + 1;
        while text.get(v) == Some(&b' ') {
            v += 1;
        }
        let stop = if text.get(v) == Some(&b'"') {
            text[v + 1..]
                .iter()
                .position(|&b| b == b'"' || b == b'\n')
                .map_or(text.len(), |n| v + 1 + n + 1)
        } else {
            let rest = &text[v..];
            let mut stop = rest
                .iter()
                .position(|&b| matches!(b, b'\n' | b'\r' | b',' | b'}'))
                .unwrap_or(rest.len());
            if let Some(comment) = rest[..stop].windows(2).position(|w| w == b" #") {
                stop = comment;
            }
            v + stop
        };
        values.push(v..stop.min(text.len()).max(v));
        i = end + 1;
    }
    (keys, values)
}

/// Byte spans of the lines, without their ends.
fn line_spans(text: &[u8]) -> Vec<Range<usize>> {
    let mut spans = Vec::new();
    let mut start = 0;
    for (i, &b) in text.iter().enumerate() {
        if b == b'\n' {
            spans.push(start..i);
            start = i + 1;
        }
    }
    spans.push(start..text.len());
    spans
}

/// `at` moved back to the start of a UTF-8 character, when `text` is UTF-8 there.
fn char_boundary(text: &[u8], at: usize) -> usize {
    let mut at = at % (text.len() + 1);
    while at > 0 && at < text.len() && text[at] & 0xc0 == 0x80 {
        at -= 1;
    }
    at
}

fn apply(text: &mut Vec<u8>, mutation: &Mutation, csv: bool) {
    let len = text.len();
    match *mutation {
        Mutation::FlipBit { at, bit } => {
            if len > 0 {
                text[at % len] ^= 1 << bit;
            }
        }
        Mutation::InsertByte { at, byte } => text.insert(at % (len + 1), byte),
        Mutation::Delete { at, len: n } => {
            let at = at % (len + 1);
            text.drain(at..(at + n).min(len));
        }
        Mutation::RenameKey { nth, to } => {
            let (keys, _) = fields(text, csv);
            if !keys.is_empty() {
                let span = keys[nth % keys.len()].clone();
                text.splice(span, to.bytes());
            }
        }
        Mutation::ReplaceValue { nth, ref with } => {
            let (_, values) = fields(text, csv);
            if !values.is_empty() {
                let span = values[nth % values.len()].clone();
                text.splice(span, with.bytes());
            }
        }
        Mutation::Indent { line, change } => {
            let lines = line_spans(text);
            let span = lines[line % lines.len()].clone();
            match change {
                Indent::Add(n) => {
                    text.splice(span.start..span.start, std::iter::repeat_n(b' ', n));
                }
                Indent::Remove(n) => {
                    let spaces = text[span.clone()]
                        .iter()
                        .take_while(|&&b| b == b' ')
                        .count();
                    text.drain(span.start..span.start + spaces.min(n));
                }
                Indent::Tab => text.insert(span.start, b'\t'),
            }
        }
        Mutation::DuplicateLine { line } => {
            let lines = line_spans(text);
            let span = lines[line % lines.len()].clone();
            let mut copy = text[span.clone()].to_vec();
            copy.push(b'\n');
            text.splice(span.start..span.start, copy);
        }
        Mutation::DeleteLine { line } => {
            let lines = line_spans(text);
            let span = lines[line % lines.len()].clone();
            text.drain(span.start..(span.end + 1).min(len));
        }
        Mutation::SwapLines { line } => {
            let lines = line_spans(text);
            if lines.len() > 1 {
                let i = line % (lines.len() - 1);
                let (a, b) = (lines[i].clone(), lines[i + 1].clone());
                let mut swapped = text[b.clone()].to_vec();
                swapped.push(b'\n');
                swapped.extend_from_slice(&text[a.clone()]);
                text.splice(a.start..b.end, swapped);
            }
        }
        Mutation::LineEnds(end) => {
            let mut out = Vec::with_capacity(len + len / 20);
            for &b in text.iter() {
                if b == b'\n' {
                    out.extend_from_slice(end.as_bytes());
                } else {
                    out.push(b);
                }
            }
            *text = out;
        }
        Mutation::Unicode { at, text: snippet } => {
            let at = char_boundary(text, at);
            text.splice(at..at, snippet.bytes());
        }
        Mutation::InvalidUtf8 { at, bytes } => {
            let at = at % (len + 1);
            text.splice(at..at, bytes.iter().copied());
        }
    }
}

/// One input: a seed, which of its files to mutate, and how.
#[derive(Clone, Debug)]
struct Case {
    seed: usize,
    items: bool,
    mutations: Vec<Mutation>,
}

fn case(seeds: usize) -> impl Strategy<Value = Case> {
    (
        0..seeds,
        proptest::bool::weighted(0.3),
        proptest::collection::vec(mutation(), 1..5),
    )
        .prop_map(|(seed, items, mutations)| Case {
            seed,
            items,
            mutations,
        })
}

/// The case's files written into a fresh directory under `base`; returns the directory and the
/// pipeline's path.
fn write_case(base: &Path, seeds: &[Seed], case: &Case) -> (tempfile::TempDir, PathBuf) {
    let seed = &seeds[case.seed];
    let dir = tempfile::tempdir_in(base).unwrap();
    let mut text = seed.text.clone();
    let mut items = seed.items.clone();
    let target = match &mut items {
        Some((name, bytes)) if case.items => Some((name.ends_with(".csv"), bytes)),
        _ => None,
    };
    let (csv, target) = match target {
        Some((csv, bytes)) => (csv, bytes),
        None => (false, &mut text),
    };
    for m in &case.mutations {
        apply(target, m, csv);
    }
    if let Some((name, bytes)) = &items {
        std::fs::write(dir.path().join(name), bytes).unwrap();
    }
    let path = dir.path().join(&seed.name);
    std::fs::write(&path, &text).unwrap();
    (dir, path)
}

/// The 1-based lines of a file as the reader of `name` counts them: JSONL by `\n`; YAML and CSV
/// by `\n`, `\r\n` or a lone `\r`. Invalid UTF-8 counts as U+FFFD.
fn lines_of(name: &str, bytes: &[u8]) -> Vec<String> {
    let text = String::from_utf8_lossy(bytes);
    let text = if name.ends_with(".jsonl") {
        text.replace("\r\n", "\n")
    } else {
        text.replace("\r\n", "\n").replace('\r', "\n")
    };
    let mut lines: Vec<String> = text.split('\n').map(str::to_owned).collect();
    // After a final line end there is no further line, except in an empty file.
    if lines.len() > 1 && lines.last().is_some_and(String::is_empty) {
        lines.pop();
    }
    lines
}

/// Fails unless `d` names the pipeline at `pipeline` or a file beside it that exists, at a line
/// of that file and a column within that line or just past its end.
fn points_inside(d: &Diagnostic, pipeline: &Path, dir: &Path) -> Result<(), TestCaseError> {
    let shown = pipeline.display().to_string();
    let file = if d.file == shown {
        pipeline.to_owned()
    } else {
        let named = Path::new(&d.file);
        if named.is_absolute() {
            named.to_owned()
        } else {
            dir.join(named)
        }
    };
    let bytes = std::fs::read(&file).map_err(|e| {
        TestCaseError::fail(format!(
            "{d}\n  names {}, which cannot be read: {e}",
            file.display()
        ))
    })?;
    let lines = lines_of(&d.file, &bytes);
    let line = (d.line >= 1)
        .then(|| lines.get(d.line - 1))
        .flatten()
        .ok_or_else(|| {
            TestCaseError::fail(format!(
                "{d}\n  line {} is outside {} ({} lines)",
                d.line,
                file.display(),
                lines.len()
            ))
        })?;
    let width = line.chars().count();
    if d.column < 1 || d.column > width + 1 {
        return Err(TestCaseError::fail(format!(
            "{d}\n  column {} is outside line {} of {} ({width} characters: {line:?})",
            d.column,
            d.line,
            file.display()
        )));
    }
    Ok(())
}

/// The number of inputs to try in-process: `IMGPIPE_FUZZ_CASES`, else [`DEFAULT_CASES`].
fn cases() -> u32 {
    std::env::var("IMGPIPE_FUZZ_CASES")
        .ok()
        .map(|v| v.parse().expect("IMGPIPE_FUZZ_CASES is a number"))
        .unwrap_or(DEFAULT_CASES)
}

/// The seed of this run's new inputs: `IMGPIPE_FUZZ_SEED`, to draw a failed run's inputs
/// again, else a new one.
fn run_seed() -> u64 {
    use std::hash::BuildHasher as _;
    match std::env::var("IMGPIPE_FUZZ_SEED") {
        Ok(v) => v
            .trim()
            .parse()
            .expect("IMGPIPE_FUZZ_SEED is a number, as a fuzz run prints it"),
        Err(_) => {
            std::collections::hash_map::RandomState::new().hash_one(std::time::SystemTime::now())
        }
    }
}

/// A runner drawing `cases` new inputs from `seed`, after the inputs kept in `regressions`; an
/// input that fails is added there.
fn runner(cases: u32, seed: u64, regressions: &'static str) -> TestRunner {
    let mut bytes = [0; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    TestRunner::new_with_rng(
        Config {
            cases,
            failure_persistence: Some(Box::new(FileFailurePersistence::Direct(regressions))),
            max_shrink_iters: 4096,
            rng_algorithm: RngAlgorithm::ChaCha,
            ..Config::default()
        },
        TestRng::from_seed(RngAlgorithm::ChaCha, &bytes),
    )
}

/// Fails the test with what the runner found, the seed to draw its inputs again and the file
/// where the failing input was kept.
fn fail_with_seed(test: &str, seed: u64, regressions: &str, failure: impl std::fmt::Display) -> ! {
    panic!(
        "{failure}\nfuzz: seed {seed}; draw these inputs again with \
         IMGPIPE_FUZZ_SEED={seed} cargo test --test it -- --exact fuzz::{test}\n\
         fuzz: a failing input found anew was added to {regressions}: commit it, and every \
         run tries it first"
    );
}

/// What `validate` makes of the file at `path`, checked: every diagnostic inside its file, and
/// for a valid pipeline the summary the command prints. Returns whether it is valid.
fn validate_in_process(path: &Path) -> Result<bool, TestCaseError> {
    let loaded = pipeline::load(path);
    let dir = path.parent().unwrap();
    for d in loaded.report.errors.iter().chain(&loaded.report.warnings) {
        points_inside(d, path, dir)?;
        prop_assert!(!d.message.contains("bug in imgpipe"), "{}", d);
    }
    if let Some(p) = &loaded.pipeline {
        // What `validate` prints of a valid pipeline is computed too.
        let tasks: u64 = p.step_refs().map(|r| p.tasks(r)).sum();
        std::hint::black_box(tasks);
    }
    prop_assert_eq!(loaded.pipeline.is_some(), loaded.report.is_ok());
    Ok(loaded.report.is_ok())
}

#[test]
fn mutated_samples_validate_without_panic_and_every_error_points_inside_its_file() {
    let seeds = seeds();
    let base = tempfile::tempdir().unwrap();
    let (cases, seed) = (cases(), run_seed());
    println!("fuzz: seed {seed}");
    let (tried, valid) = (AtomicU64::new(0), AtomicU64::new(0));
    let mut runner = runner(cases, seed, IN_PROCESS_REGRESSIONS);
    let result = runner.run(&case(seeds.len()), |case| {
        let (_dir, path) = write_case(base.path(), &seeds, &case);
        tried.fetch_add(1, Ordering::Relaxed);
        if validate_in_process(&path)? {
            valid.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    });
    println!(
        "fuzz: {} mutated inputs validated in-process ({} still valid)",
        tried.into_inner(),
        valid.into_inner()
    );
    if let Err(e) = result {
        fail_with_seed(
            "mutated_samples_validate_without_panic_and_every_error_points_inside_its_file",
            seed,
            IN_PROCESS_REGRESSIONS,
            e,
        );
    }
}

#[test]
fn the_binary_exits_0_or_2_on_mutated_samples_as_the_library_says() {
    let seeds = seeds();
    let base = tempfile::tempdir().unwrap();
    let (cases, seed) = ((cases() / BINARY_SHARE).max(16), run_seed());
    println!("fuzz: seed {seed}");
    let tried = AtomicU64::new(0);
    let mut runner = runner(cases, seed, BINARY_REGRESSIONS);
    let result = runner.run(&(case(seeds.len()), any::<bool>()), |(case, json)| {
        let (dir, path) = write_case(base.path(), &seeds, &case);
        tried.fetch_add(1, Ordering::Relaxed);
        let valid = validate_in_process(&path)?;
        let file = path.file_name().unwrap();
        let file = file.to_str().expect("the case's file name is UTF-8");
        let args: &[&str] = if json {
            &["validate", file, "--json"]
        } else {
            &["validate", file]
        };
        let cmd = crate::binary::Imgpipe::new(args)
            .cwd(dir.path())
            .std_command();
        let o = crate::common::try_finish_blocking(cmd, VALIDATE_LIMIT, "imgpipe validate")
            .map_err(TestCaseError::fail)?;
        let (stdout, stderr) = (
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr),
        );
        prop_assert!(
            !stderr.contains("panicked"),
            "validate panicked:\n{}",
            stderr
        );
        prop_assert_eq!(
            o.status.code(),
            Some(if valid { 0 } else { 2 }),
            "stdout:\n{}\nstderr:\n{}",
            stdout,
            stderr
        );
        if json {
            let doc: serde_json::Value = serde_json::from_slice(&o.stdout).map_err(|e| {
                TestCaseError::fail(format!("--json gave no JSON ({e}):\n{stdout}"))
            })?;
            prop_assert_eq!(&doc["valid"], &serde_json::json!(valid));
        }
        Ok(())
    });
    println!(
        "fuzz: {} mutated inputs validated by the binary",
        tried.into_inner()
    );
    if let Err(e) = result {
        fail_with_seed(
            "the_binary_exits_0_or_2_on_mutated_samples_as_the_library_says",
            seed,
            BINARY_REGRESSIONS,
            e,
        );
    }
}

/// The first `n` inputs a runner draws from `seed`, as text.
fn drawn(seed: u64, n: usize, regressions: &'static str) -> Vec<String> {
    use proptest::strategy::ValueTree as _;
    let strategy = case(seeds().len());
    let mut runner = runner(1, seed, regressions);
    (0..n)
        .map(|_| format!("{:?}", strategy.new_tree(&mut runner).unwrap().current()))
        .collect()
}

#[test]
fn a_seed_draws_the_same_inputs_again_and_a_failing_input_is_kept_and_tried_first() {
    let dir = tempfile::tempdir().unwrap();
    // The runner keeps its file's path for the life of the process.
    let kept: &'static str = Box::leak(
        dir.path()
            .join("kept.txt")
            .to_string_lossy()
            .into_owned()
            .into_boxed_str(),
    );
    assert_eq!(drawn(7, 20, kept), drawn(7, 20, kept), "seed 7 twice");
    assert_ne!(drawn(7, 20, kept), drawn(8, 20, kept), "seeds 7 and 8");

    // A property that fails on some inputs: the first failing one is kept in the file.
    let strategy = case(seeds().len());
    let fails = |case: &Case| case.mutations.len() >= 3 && case.items;
    let failed = runner(256, 7, kept).run(&strategy, |case| {
        prop_assert!(!fails(&case));
        Ok(())
    });
    assert!(failed.is_err(), "no input failed");
    let file = std::fs::read_to_string(kept).unwrap();
    assert_eq!(
        file.lines().filter(|l| l.starts_with("cc ")).count(),
        1,
        "{file}"
    );

    // Another seed, no new input at all: the kept input is still tried, and fails again.
    let first = std::sync::Mutex::new(None);
    let again = runner(0, 8, kept).run(&strategy, |case| {
        first.lock().unwrap().get_or_insert_with(|| fails(&case));
        prop_assert!(!fails(&case));
        Ok(())
    });
    assert_eq!(
        first.into_inner().unwrap(),
        Some(true),
        "the kept input was tried first"
    );
    assert!(again.is_err());
}
