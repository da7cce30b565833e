//! Hostile names, broken downloads and broken state databases, end to end through the binary.
//!
//! (a) Item, step and run ids never put a file outside the output directory: every unsafe id is
//!     refused before anything is sent (exit 2, naming the field and its line), and the file
//!     system is checked afterwards for anything written anywhere.
//! (b) A download that is not an image, is cut short or is too large leaves no file, partial or
//!     hidden, through `generate` and `run`; the size limit itself is held to its boundary.
//! (c) A state database that is corrupt, truncated or from a newer schema is reported (naming
//!     the file and what to do, exit 2) and its bytes and mtime are the same afterwards; the
//!     commands that never open the database leave it alone too.
//!
//! Everything talks to 127.0.0.1 only: the in-process sandbox, or a small fake service for what
//! the sandbox never serves (bodies that are no image, an oversized image).

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};
use futures::StreamExt;
use imgpipe::api::Downloader;
use imgpipe::api::download::{DEFAULT_MAX_BYTES, DownloadError};
use imgpipe::sandbox::{self, Faults};
use serde_json::{Value, json};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode};
use sqlx::{ConnectOptions, Connection, Row};

use crate::common::*;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// A sample the sandbox serves without any network.
const MUG: &str = "https://sandbox.invalid/assets/mug.png";

/// A sandbox drawing small images, so that runs stay quick.
async fn small_sandbox(faults: Faults) -> Env {
    start(sandbox::Config {
        image_side: 32,
        faults,
        ..sandbox::Config::default()
    })
    .await
}

/// A scalar as YAML reads it: a JSON string is a valid YAML double-quoted scalar, with `\n`,
/// `\\` and `\u0000` escapes.
fn yaml(s: &str) -> String {
    serde_json::to_string(s).unwrap()
}

/// One item, one upscale step (2 credits): the item id on line 5, the step id on line 7.
fn one_step(item_id: &str, step_id: &str) -> String {
    format!(
        "version: 1\nname: ids\noutput_dir: out\nitems:\n  - {{ id: {}, url: \"{MUG}\" }}\nsteps:\n  - id: {}\n    upscale: {{ image_url: \"{{{{ item.url }}}}\", desired_increase: 2 }}\n",
        yaml(item_id),
        yaml(step_id)
    )
}

const ITEM_LINE: usize = 5;
const STEP_LINE: usize = 7;

fn paths(list: &[&str]) -> Vec<PathBuf> {
    list.iter().map(PathBuf::from).collect()
}

/// `root/work/run`: two levels of room, so a relative climb out of the working directory still
/// lands inside `root`, where [`tree`] sees it.
fn nested_cwd(root: &Path) -> PathBuf {
    let cwd = root.join("work").join("run");
    std::fs::create_dir_all(&cwd).unwrap();
    cwd
}

/// `imgpipe ARGS` in `cwd` against `env`'s sandbox, in time.
async fn bin(env: &Env, cwd: &Path, args: &[&str]) -> Output {
    let mut cmd = Imgpipe::new(args).cwd(cwd).command();
    cmd.env("IMGPIPE_BASE_URL", env.sandbox.base_url().as_str())
        .env("IMGPIPE_API_KEY", env.sandbox.key());
    finish(cmd).await
}

/// `imgpipe run ARGS --state STATE` in `cwd` against `env`'s sandbox.
async fn run_with_state(env: &Env, cwd: &Path, state: &Path, args: &[&str]) -> Output {
    let state = state.to_string_lossy().into_owned();
    let mut all = vec!["run"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--state", &state, "--retry-base-ms", "10"]);
    bin(env, cwd, &all).await
}

/// The bytes and modification time of a file, to hold against themselves later.
#[derive(Debug, PartialEq, Eq)]
struct Snapshot {
    bytes: Vec<u8>,
    mtime: SystemTime,
}

fn snapshot(path: &Path) -> Snapshot {
    Snapshot {
        bytes: std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
        mtime: std::fs::metadata(path).unwrap().modified().unwrap(),
    }
}

#[track_caller]
fn assert_untouched(path: &Path, before: &Snapshot, what: &str) {
    let after = snapshot(path);
    assert!(
        after.bytes == before.bytes,
        "{what}: the bytes of {} changed ({} bytes before, {} after; first difference at byte {:?})",
        path.display(),
        before.bytes.len(),
        after.bytes.len(),
        before
            .bytes
            .iter()
            .zip(&after.bytes)
            .position(|(a, b)| a != b)
    );
    assert_eq!(after.mtime, before.mtime, "{what}: the mtime changed");
}

/// Deterministic bytes that are no file format at all.
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Runs one single-item pipeline to success on a sandbox of its own and returns the state
/// database's bytes: a real state database, checkpointed and closed.
async fn a_real_state_database() -> Vec<u8> {
    let env = &small_sandbox(Faults::default()).await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("p.yaml"), one_step("mug", "big")).unwrap();
    let state = dir.path().join("state.db");
    let o = run_with_state(env, dir.path(), &state, &["p.yaml", "--run-id", "r"]).await;
    assert_exit_without_panic(&o, 0);
    assert!(
        !dir.path().join("state.db-wal").exists(),
        "the WAL was checkpointed into the file on exit"
    );
    std::fs::read(&state).unwrap()
}

/// One plain read-only connection (not a pool) to a state database.
async fn read_only(path: &Path) -> sqlx::SqliteConnection {
    SqliteConnectOptions::new()
        .filename(path)
        .read_only(true)
        .connect()
        .await
        .unwrap_or_else(|e| panic!("cannot open {}: {e}", path.display()))
}

async fn run_ids(path: &Path) -> Vec<String> {
    let mut conn = read_only(path).await;
    let ids = sqlx::query("SELECT id FROM runs ORDER BY created_at")
        .fetch_all(&mut conn)
        .await
        .unwrap()
        .iter()
        .map(|r| r.get("id"))
        .collect();
    conn.close().await.unwrap();
    ids
}

// ---------------------------------------------------------------------------------------------
// A small fake service, for what the sandbox never serves
// ---------------------------------------------------------------------------------------------

fn post_json(body: Value) -> MethodRouter {
    post(move || async move { axum::Json(body).into_response() })
}

/// GET answered 200 with `content_type` and these bytes, with a Content-Length.
fn get_bytes(content_type: &'static str, bytes: Vec<u8>) -> MethodRouter {
    get(move || async move { ([(CONTENT_TYPE, content_type)], bytes).into_response() })
}

/// The sizes the oversized answers below pretend to or really have.
const OVER_LIMIT: u64 = DEFAULT_MAX_BYTES + 1024 * 1024;

/// GET answered with a Content-Length above the downloader's limit and the first bytes of a
/// PNG, after which the body stalls: only the header can stop it in time.
fn get_declared_huge() -> MethodRouter {
    get(|| async {
        let head = Bytes::from_static(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR");
        let body = futures::stream::iter([Ok::<_, std::io::Error>(head)])
            .chain(futures::stream::pending());
        Response::builder()
            .header(CONTENT_TYPE, "image/png")
            .header(CONTENT_LENGTH, OVER_LIMIT.to_string())
            .body(Body::from_stream(body))
            .unwrap()
    })
}

/// GET answered with `total` bytes starting like a PNG, streamed in 1 MiB chunks without a
/// Content-Length: only counting the bytes can stop it.
fn get_streamed(total: u64) -> MethodRouter {
    get(move || async move {
        const CHUNK: usize = 1024 * 1024;
        let mut first = vec![0u8; CHUNK];
        first[..8].copy_from_slice(b"\x89PNG\r\n\x1a\n");
        let first = Bytes::from(first);
        let rest = Bytes::from(vec![0u8; CHUNK]);
        let chunks = total.div_ceil(CHUNK as u64) as usize;
        let last = total as usize - (chunks - 1) * CHUNK;
        let stream = futures::stream::iter((0..chunks).map(move |i| {
            let chunk = if i == 0 { first.clone() } else { rest.clone() };
            let len = if i + 1 == chunks { last } else { CHUNK };
            Ok::<_, std::io::Error>(chunk.slice(..len))
        }));
        Response::builder()
            .header(CONTENT_TYPE, "image/png")
            .body(Body::from_stream(stream))
            .unwrap()
    })
}

// ---------------------------------------------------------------------------------------------
// (a) Ids never leave the output directory
// ---------------------------------------------------------------------------------------------

/// `{ROOT}` stands for the test's own temporary root, so an absolute id that escaped would
/// still land where the check sees it.
const UNSAFE_IDS: &[&str] = &[
    "../x",
    "../../escape",
    "/etc",
    "{ROOT}/abs",
    "a/b",
    "a/../../b",
    "..",
    ".",
    ".hidden",
    "a\0b",
    "a\nb",
    "a\rb",
    "a\\b",
    "..\\..\\x",
    "C:\\x",
    "C:x",
    "x.",
    " x",
    "x ",
    "",
    "é",
    "a*b",
    "a?b",
    "a|b",
    "~x",
    "-x",
    "_batch",
    "CON",
    "nul",
    "Aux",
    "prn",
    "com1",
    "LPT9",
];

fn long_id() -> String {
    "a".repeat(65)
}

#[derive(Clone, Copy, Debug)]
enum Field {
    Item,
    Step,
}

impl Field {
    fn name(self) -> &'static str {
        match self {
            Field::Item => "item",
            Field::Step => "step",
        }
    }
}

/// What is wrong with how `validate` and `run` treat one unsafe id; empty when all is well.
async fn check_unsafe_id(env: &Env, field: Field, template: &str) -> Vec<String> {
    let root = tempfile::tempdir().unwrap();
    let id = template.replace("{ROOT}", &root.path().to_string_lossy());
    let cwd = nested_cwd(root.path());
    let (text, line) = match field {
        Field::Item => (one_step(&id, "big"), ITEM_LINE),
        Field::Step => (one_step("mug", &id), STEP_LINE),
    };
    std::fs::write(cwd.join("p.yaml"), text).unwrap();
    let state = cwd.join("state.db");
    let mut problems = Vec::new();
    let label = format!("{} id {id:?}", field.name());
    let validated = bin(env, &cwd, &["validate", "p.yaml"]).await;
    let ran = run_with_state(env, &cwd, &state, &["p.yaml", "--run-id", "r"]).await;
    for (command, o) in [("validate", &validated), ("run", &ran)] {
        let err = stderr(o);
        if o.status.code() != Some(2) {
            problems.push(format!(
                "{label}: {command} exited {:?}, not 2",
                o.status.code()
            ));
        }
        if err.contains("panicked") {
            problems.push(format!("{label}: {command} panicked"));
        }
        let prefix = format!("error: p.yaml:{line}:");
        if !err
            .lines()
            .any(|l| l.starts_with(&prefix) && l.contains(&label))
        {
            problems.push(format!(
                "{label}: {command} names no `{label}` at {prefix}\n{err}"
            ));
        }
    }
    let expected = paths(&["work", "work/run", "work/run/p.yaml"]);
    let found = tree(root.path());
    if found != expected {
        problems.push(format!("{label}: files were written: {found:?}"));
    }
    problems
}

/// Every unsafe id, as an item id and as a step id, is refused by `validate` and by `run` with
/// exit 2 and an error at its line naming the field; nothing is written anywhere and not one
/// request reaches the service.
#[tokio::test(flavor = "multi_thread")]
async fn unsafe_item_and_step_ids_are_refused_at_their_line_before_anything_is_written() {
    let env = small_sandbox(Faults::default()).await;
    let long = long_id();
    let mut cases: Vec<(Field, &str)> = Vec::new();
    for id in UNSAFE_IDS.iter().copied().chain([long.as_str()]) {
        cases.push((Field::Item, id));
        cases.push((Field::Step, id));
    }
    // Step ids name files: `.` is refused there even where an item id may hold it.
    for id in ["a.b", "big.png"] {
        cases.push((Field::Step, id));
    }
    let problems: Vec<String> = futures::stream::iter(cases.iter())
        .map(|(field, id)| check_unsafe_id(&env, *field, id))
        .buffer_unordered(6)
        .flat_map(futures::stream::iter)
        .collect()
        .await;
    assert!(
        problems.is_empty(),
        "{} problem(s):\n{}",
        problems.len(),
        problems.join("\n\n")
    );
    assert_eq!(env.sandbox.stats().api_requests, 0, "nothing was sent");
    assert_nothing_billed(&env);
}

/// The longest ids allowed (64 characters each) make a path that really works: the run
/// succeeds and its one file lands at `out/<run>/<item>/<step>.png`, nowhere else.
#[tokio::test(flavor = "multi_thread")]
async fn ids_at_the_length_limit_run_and_stay_inside_the_output_directory() {
    let env = small_sandbox(Faults::default()).await;
    let root = tempfile::tempdir().unwrap();
    let cwd = nested_cwd(root.path());
    let item = format!("i{}", "x".repeat(63));
    let step = format!("s{}", "y".repeat(63));
    std::fs::write(cwd.join("p.yaml"), one_step(&item, &step)).unwrap();
    let o = run_with_state(
        &env,
        &cwd,
        &cwd.join("state.db"),
        &["p.yaml", "--run-id", "r"],
    )
    .await;
    assert_exit_without_panic(&o, 0);
    let image = format!("work/run/out/r/{item}/{step}.png");
    let written: Vec<PathBuf> = tree(root.path())
        .into_iter()
        .filter(|p| {
            !p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("state.db"))
                && !p.starts_with("work/run/state.db.locks")
        })
        .collect();
    let mut expected = paths(&[
        "work",
        "work/run",
        "work/run/out",
        "work/run/out/r",
        "work/run/out/r/manifest.jsonl",
        &format!("work/run/out/r/{item}"),
        &image,
        "work/run/p.yaml",
    ]);
    expected.sort();
    assert_eq!(written, expected);
    decode(&root.path().join(&image));
}

/// Ids that differ only in case would share a directory (items) or a file (steps) on a
/// case-insensitive file system: `run` refuses them as `validate` does, before any request.
#[tokio::test(flavor = "multi_thread")]
async fn ids_differing_only_in_case_are_refused_by_run_before_anything_is_sent() {
    let env = small_sandbox(Faults::default()).await;
    let items = format!(
        "version: 1\nname: case\noutput_dir: out\nitems:\n  - {{ id: mug, url: \"{MUG}\" }}\n  - {{ id: MUG, url: \"{MUG}\" }}\nsteps:\n  - id: big\n    upscale: {{ image_url: \"{{{{ item.url }}}}\", desired_increase: 2 }}\n"
    );
    let steps = format!(
        "version: 1\nname: case\noutput_dir: out\nitems:\n  - {{ id: mug, url: \"{MUG}\" }}\nsteps:\n  - id: big\n    upscale: {{ image_url: \"{{{{ item.url }}}}\", desired_increase: 2 }}\n  - id: Big\n    upscale: {{ image_url: \"{{{{ item.url }}}}\", desired_increase: 4 }}\n"
    );
    for (text, at, needle) in [
        (
            items,
            "p.yaml:6:",
            "item id \"MUG\" differs from \"mug\" only in case",
        ),
        (
            steps,
            "p.yaml:9:",
            "step id \"Big\" differs from \"big\" only in case",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("p.yaml"), text).unwrap();
        let o = run_with_state(
            &env,
            dir.path(),
            &dir.path().join("state.db"),
            &["p.yaml", "--run-id", "r"],
        )
        .await;
        assert_exit_without_panic(&o, 2);
        let err = stderr(&o);
        assert!(
            err.lines()
                .any(|l| l.starts_with(&format!("error: {at}")) && l.contains(needle)),
            "{err}"
        );
        assert_eq!(tree(dir.path()), paths(&["p.yaml"]));
    }
    assert_eq!(env.sandbox.stats().api_requests, 0);
}

/// Ids read from items files are held to the same rules, reported at the items file's line.
#[tokio::test(flavor = "multi_thread")]
async fn unsafe_ids_in_csv_and_jsonl_items_files_are_refused_at_their_line() {
    let env = small_sandbox(Faults::default()).await;
    let csv = format!(
        "id,url\nok,{MUG}\n../x,{MUG}\n\"a\\b\",{MUG}\n\"a\nb\",{MUG}\n/etc,{MUG}\nOK,{MUG}\n"
    );
    let jsonl = [
        json!({"id": "ok", "url": MUG}),
        json!({"id": "a\u{0}b", "url": MUG}),
        json!({"id": "..", "url": MUG}),
        json!({"id": "nul.txt", "url": MUG}),
        json!({"id": "a/../../b", "url": MUG}),
    ]
    .iter()
    .map(Value::to_string)
    .collect::<Vec<_>>()
    .join("\n");
    // (items file, its text, the errors expected in it: line and message)
    type Case = (&'static str, String, &'static [(usize, &'static str)]);
    let cases: [Case; 2] = [
        (
            "items.csv",
            csv,
            &[
                (3, r#"item id "../x": must start with a letter or digit"#),
                (4, r#"item id "a\\b": contains '\\'"#),
                (5, r#"item id "a\nb": contains '\n'"#),
                (7, r#"item id "/etc": must start with a letter or digit"#),
                (8, r#"item id "OK" differs from "ok" only in case"#),
            ],
        ),
        (
            "items.jsonl",
            jsonl,
            &[
                (2, r#"item id "a\0b": contains '\0'"#),
                (3, r#"item id "..": must start with a letter or digit"#),
                (
                    4,
                    r#"item id "nul.txt": is a reserved device name on Windows"#,
                ),
                (5, r#"item id "a/../../b": contains '/'"#),
            ],
        ),
    ];
    for (file, data, expected) in cases {
        let root = tempfile::tempdir().unwrap();
        let cwd = nested_cwd(root.path());
        std::fs::write(cwd.join(file), data).unwrap();
        std::fs::write(
            cwd.join("p.yaml"),
            format!(
                "version: 1\nname: from-file\noutput_dir: out\nitems_from: {file}\nsteps:\n  - id: big\n    upscale: {{ image_url: \"{{{{ item.url }}}}\", desired_increase: 2 }}\n"
            ),
        )
        .unwrap();
        let validated = bin(&env, &cwd, &["validate", "p.yaml"]).await;
        let ran = run_with_state(&env, &cwd, &cwd.join("state.db"), &["p.yaml"]).await;
        for o in [&validated, &ran] {
            assert_exit_without_panic(o, 2);
            let err = stderr(o);
            for (line, message) in expected {
                let prefix = format!("error: {file}:{line}:");
                assert!(
                    err.lines()
                        .any(|l| l.starts_with(&prefix) && l.contains(message)),
                    "{file}: no {message:?} at {prefix}\n{err}"
                );
            }
        }
        assert_eq!(
            tree(root.path()),
            paths(&[
                "work",
                "work/run",
                &format!("work/run/{file}"),
                "work/run/p.yaml"
            ])
        );
    }
    assert_eq!(env.sandbox.stats().api_requests, 0);
}

/// Run ids that are not plain names. A NUL cannot be passed in an argument at all.
const UNSAFE_RUN_IDS: &[&str] = &[
    "../../x",
    "../x",
    "..",
    ".",
    "",
    "a/b",
    "{ROOT}/abs",
    "x\ny",
    "a\\b",
    "..\\x",
    ".hidden",
    "x.",
    "-rf",
    "con",
    "LPT1",
    "é",
];

/// `--run-id` names a directory under the output directory: anything but a plain name is
/// refused with exit 2 naming the flag, no output directory appears, nothing lands outside the
/// working directory's state files, no run is recorded and nothing is billed.
#[tokio::test(flavor = "multi_thread")]
async fn an_unsafe_run_id_is_refused_and_writes_nothing_outside() {
    let env = small_sandbox(Faults::default()).await;
    let long = "r".repeat(65);
    let mut problems = Vec::new();
    for template in UNSAFE_RUN_IDS.iter().copied().chain([long.as_str()]) {
        let root = tempfile::tempdir().unwrap();
        let id = template.replace("{ROOT}", &root.path().to_string_lossy());
        let cwd = nested_cwd(root.path());
        std::fs::write(cwd.join("p.yaml"), one_step("mug", "big")).unwrap();
        let state = cwd.join("state.db");
        let flag = format!("--run-id={id}");
        let o = run_with_state(&env, &cwd, &state, &["p.yaml", &flag]).await;
        let err = stderr(&o);
        if o.status.code() != Some(2) || err.contains("panicked") {
            problems.push(format!("{id:?}: exit {:?}, not 2\n{err}", o.status.code()));
        }
        if !err.contains(&format!("--run-id {id:?}")) {
            problems.push(format!("{id:?}: the error does not name --run-id\n{err}"));
        }
        // Only the state database (and its lock) may have been written, all beside it.
        let stray: Vec<PathBuf> = tree(root.path())
            .into_iter()
            .filter(|p| {
                !matches!(p.to_str(), Some("work" | "work/run" | "work/run/p.yaml"))
                    && !p.starts_with("work/run/state.db.locks")
                    && !matches!(
                        p.file_name().and_then(|n| n.to_str()),
                        Some("state.db" | "state.db-wal" | "state.db-shm")
                    )
            })
            .collect();
        if !stray.is_empty() {
            problems.push(format!("{id:?}: files were written: {stray:?}"));
        }
        if state.exists() {
            let runs = run_ids(&state).await;
            if !runs.is_empty() {
                problems.push(format!("{id:?}: runs were recorded: {runs:?}"));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));
    assert_nothing_billed(&env);
}

/// A bad `--run-id` is a usage error whatever the plan says: it is exit 2, not the exit 3 of a
/// plan that does not fit (which would send the user to raise the budget first, only to be
/// told then that the id was never acceptable).
#[tokio::test(flavor = "multi_thread")]
async fn an_unsafe_run_id_is_a_usage_error_even_when_the_plan_does_not_fit() {
    let env = small_sandbox(Faults::default()).await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("p.yaml"), one_step("mug", "big")).unwrap();
    let o = run_with_state(
        &env,
        dir.path(),
        &dir.path().join("state.db"),
        &["p.yaml", "--run-id", "../../x", "--max-credits", "1"],
    )
    .await;
    assert_nothing_billed(&env);
    assert!(!dir.path().join("out").exists());
    assert_exit_without_panic(&o, 2);
    assert!(
        stderr(&o).contains("--run-id \"../../x\""),
        "{}",
        stderr(&o)
    );
}

/// An item id may hold a `.`, so `manifest.jsonl` passes the id check; its directory is then
/// the very path of the run's manifest. Either the id is refused before anything is paid for,
/// or the run writes its manifest as a file, as it says it did.
#[tokio::test(flavor = "multi_thread")]
async fn an_item_named_like_the_manifest_never_takes_the_manifests_place() {
    let env = small_sandbox(Faults::default()).await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("p.yaml"), one_step("manifest.jsonl", "big")).unwrap();
    let o = run_with_state(
        &env,
        dir.path(),
        &dir.path().join("state.db"),
        &["p.yaml", "--run-id", "r"],
    )
    .await;
    let manifest = dir.path().join("out/r/manifest.jsonl");
    match o.status.code() {
        Some(2) => assert_nothing_billed(&env),
        _ => {
            assert_exit_without_panic(&o, 0);
            assert!(
                manifest.is_file(),
                "the summary names {} as the manifest, but it is {}\n{}",
                manifest.display(),
                if manifest.is_dir() {
                    "the item's directory"
                } else {
                    "missing"
                },
                stderr(&o)
            );
            assert!(!stderr(&o).contains("ERROR"), "{}", stderr(&o));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// (b) Broken downloads leave nothing behind
// ---------------------------------------------------------------------------------------------

/// Bodies served as the result image that are no image, or no whole one.
fn bad_bodies() -> Vec<(&'static str, &'static str, Vec<u8>, &'static str, usize)> {
    let png = sample_png();
    let mut jpeg_cut = vec![0xff, 0xd8, 0xff, 0xe0];
    jpeg_cut.extend(noise(2000, 7));
    let mut png_no_end = png.clone();
    png_no_end.truncate(png.len() - 12);
    // (route, content type, body, expected message, GETs: 1 when retrying cannot help, else 4)
    vec![
        (
            "/html",
            "text/html",
            b"<!doctype html><title>Sign in</title>".to_vec(),
            "is not an image",
            1,
        ),
        (
            "/json",
            "image/png",
            br#"{"error": {"message": "expired"}}"#.to_vec(),
            "is not an image",
            1,
        ),
        ("/empty", "image/png", Vec::new(), "is not an image", 1),
        ("/noise", "image/png", noise(5000, 3), "is not an image", 1),
        (
            "/magic-only",
            "image/png",
            b"\x89PNG\r\n\x1a\n".to_vec(),
            "stopped before the end of the png image",
            4,
        ),
        (
            "/png-no-end",
            "image/png",
            png_no_end,
            "stopped before the end of the png image",
            4,
        ),
        (
            "/jpeg-cut",
            "image/jpeg",
            jpeg_cut,
            "stopped before the end of the jpg image",
            4,
        ),
    ]
}

/// `generate` against a service whose result URL answers 200 with something that is no whole
/// image: exit 1, the reason and the free way to fetch it again, one paid call, and no file at
/// all in the output directory: no image, no `.part`.
#[tokio::test(flavor = "multi_thread")]
async fn a_download_that_is_no_whole_image_leaves_no_file() {
    for (route, content_type, body, message, gets) in bad_bodies() {
        let dir = tempfile::tempdir().unwrap();
        let fake = Fake::start(|base| {
            Router::new()
                .route(
                    "/v1/images/generations",
                    post_json(generation("job_b1", &format!("{base}{}", &route[1..]))),
                )
                .route(route, get_bytes(content_type, body))
        })
        .await;
        let o = fake
            .run(&["generate", "--prompt", "x", "--out", "out"], dir.path())
            .await;
        assert_exit_without_panic(&o, 1);
        let err = stderr(&o);
        assert!(err.contains(message), "{route}: {err}");
        assert!(
            err.contains("imgpipe job job_b1 --out out"),
            "{route}: {err}"
        );
        assert_eq!(fake.count("POST", "/v1/images/generations"), 1, "{route}");
        assert_eq!(fake.count("GET", route), gets, "{route}");
        let out = dir.path().join("out");
        let left = if out.exists() { tree(&out) } else { Vec::new() };
        assert_eq!(left, Vec::<PathBuf>::new(), "{route}: files were left");
    }
}

/// A result whose Content-Length is over the limit is refused before a byte is written: one
/// GET, exit 1, the limit named, no file.
#[tokio::test(flavor = "multi_thread")]
async fn a_download_declared_too_large_is_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Fake::start(|base| {
        Router::new()
            .route(
                "/v1/images/generations",
                post_json(generation("job_big", &format!("{base}huge"))),
            )
            .route("/huge", get_declared_huge())
    })
    .await;
    let o = fake
        .run(&["generate", "--prompt", "x", "--out", "out"], dir.path())
        .await;
    assert_exit_without_panic(&o, 1);
    let err = stderr(&o);
    assert!(
        err.contains(&format!(
            "larger than the limit of {DEFAULT_MAX_BYTES} bytes"
        )),
        "{err}"
    );
    assert!(err.contains("imgpipe job job_big --out out"), "{err}");
    assert_eq!(fake.count("GET", "/huge"), 1, "a size limit is not retried");
    assert_eq!(fake.count("POST", "/v1/images/generations"), 1);
    let out = dir.path().join("out");
    let left = if out.exists() { tree(&out) } else { Vec::new() };
    assert_eq!(left, Vec::<PathBuf>::new());
}

/// A body without a Content-Length that goes on past the limit (256 MiB) is cut off there, and
/// the part already written is removed.
#[tokio::test(flavor = "multi_thread")]
async fn a_download_streamed_past_the_limit_is_stopped_and_its_part_file_removed() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Fake::start(|base| {
        Router::new()
            .route(
                "/v1/images/generations",
                post_json(generation("job_flood", &format!("{base}flood"))),
            )
            .route("/flood", get_streamed(OVER_LIMIT))
    })
    .await;
    let o = fake
        .run(&["generate", "--prompt", "x", "--out", "out"], dir.path())
        .await;
    assert_exit_without_panic(&o, 1);
    let err = stderr(&o);
    assert!(
        err.contains(&format!(
            "larger than the limit of {DEFAULT_MAX_BYTES} bytes"
        )),
        "{err}"
    );
    assert_eq!(fake.count("GET", "/flood"), 1);
    let out = dir.path().join("out");
    let left = if out.exists() { tree(&out) } else { Vec::new() };
    assert_eq!(left, Vec::<PathBuf>::new(), "the .part file was removed");
}

/// The limit at its boundary, on the downloader itself with a small limit: an image of exactly
/// the limit is saved; one byte more is refused, whether the length is declared or only
/// counted, and leaves nothing.
#[tokio::test]
async fn the_size_limit_holds_at_its_boundary_with_or_without_a_content_length() {
    let png = sample_png();
    let limit = png.len() as u64;
    let fake = Fake::start(|_| {
        // One byte more, inserted before the IEND chunk so that it still ends like a PNG.
        let mut bigger = png.clone();
        bigger.insert(png.len() - 12, 0);
        let streamed = |bytes: Vec<u8>| {
            get(move || async move {
                let chunks = futures::stream::iter(
                    bytes
                        .chunks(100)
                        .map(|c| Ok::<_, std::io::Error>(Bytes::copy_from_slice(c)))
                        .collect::<Vec<_>>(),
                );
                Response::builder()
                    .header(CONTENT_TYPE, "image/png")
                    .body(Body::from_stream(chunks))
                    .unwrap()
            })
        };
        Router::new()
            .route("/exact", get_bytes("image/png", png.clone()))
            .route("/exact-streamed", streamed(png.clone()))
            .route("/over", get_bytes("image/png", bigger.clone()))
            .route("/over-streamed", streamed(bigger))
    })
    .await;
    let downloader = Downloader::new(Duration::from_secs(5), Duration::from_secs(10), limit);
    for route in ["/exact", "/exact-streamed"] {
        let dir = tempfile::tempdir().unwrap();
        let got = downloader
            .fetch(&fake.url(route), dir.path(), "img")
            .await
            .unwrap_or_else(|e| panic!("{route}: {e}"));
        assert_eq!(got.bytes, limit, "{route}");
        assert_eq!(std::fs::read(&got.path).unwrap(), png, "{route}");
        assert_eq!(tree(dir.path()), paths(&["img.png"]), "{route}");
    }
    for route in ["/over", "/over-streamed"] {
        let dir = tempfile::tempdir().unwrap();
        let err = downloader
            .fetch(&fake.url(route), dir.path(), "img")
            .await
            .unwrap_err();
        assert!(
            matches!(err, DownloadError::TooLarge { limit: l } if l == limit),
            "{route}: {err:?}"
        );
        assert!(!err.is_transient(), "{route}");
        assert_eq!(tree(dir.path()), Vec::<PathBuf>::new(), "{route}");
    }
}

/// Through `imgpipe run`: every download of a run cut short by the sandbox (under a
/// Content-Length) is retried four times, then recorded as failed; exit 4, no image and no part
/// file anywhere under the run's directory, an empty manifest, and the call paid once.
#[tokio::test(flavor = "multi_thread")]
async fn a_run_whose_downloads_are_cut_short_leaves_no_partial_file() {
    let env = small_sandbox(Faults {
        truncate_download: 1.0,
        ..Faults::default()
    })
    .await;
    let dir = env.dir.path();
    std::fs::write(dir.join("p.yaml"), one_step("mug", "big")).unwrap();
    let state = dir.join("state.db");
    let o = run_with_state(&env, dir, &state, &["p.yaml", "--run-id", "r"]).await;
    assert_exit_without_panic(&o, 4);
    assert_eq!(env.sandbox.ledger().len(), 1, "paid once");
    assert_eq!(env.sandbox.stats().truncated_downloads, 4);
    let job = env.sandbox.ledger()[0].job_id.clone();
    assert!(
        stderr(&o).contains(&format!("imgpipe job {job} --out DIR")),
        "{}",
        stderr(&o)
    );
    let run_dir = dir.join("out").join("r");
    assert_eq!(files_under(&run_dir), ["manifest.jsonl".to_owned()].into());
    assert_eq!(
        std::fs::read_to_string(run_dir.join("manifest.jsonl")).unwrap(),
        ""
    );
    let mut conn = read_only(&state).await;
    let rows = sqlx::query("SELECT path, download_error FROM outputs")
        .fetch_all(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].get::<Option<String>, _>("path"), None);
    let error: Option<String> = rows[0].get("download_error");
    assert!(
        error.as_deref().is_some_and(|e| e.contains("cut short")),
        "{error:?}"
    );
}

/// Through `imgpipe run` against a service whose results are a web page and an oversized
/// image: both are failed downloads (exit 4), recorded with their reason, each fetched once
/// and paid once, and no file but the (empty) manifest is left under the run's directory.
#[tokio::test(flavor = "multi_thread")]
async fn a_run_whose_results_are_no_image_or_too_large_leaves_no_file() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Fake::start(|base| {
        let base = base.to_owned();
        let tool = post(move |axum::Json(body): axum::Json<Value>| {
            let base = base.clone();
            async move {
                let input = body["image_url"].as_str().unwrap_or_default().to_owned();
                let name = if input.ends_with("page.png") {
                    "page"
                } else {
                    "huge"
                };
                axum::Json(json!({
                    "id": format!("job_{name}"),
                    "status": "succeeded",
                    "tool": "upscale",
                    "credits_used": 2,
                    "data": {"url": format!("{base}{name}")},
                }))
            }
        });
        Router::new()
            .route(
                "/v1/account",
                get(|| async { axum::Json(json!({"credits_remaining": 1000})) }),
            )
            .route("/v1/images/tools/upscale", tool)
            .route(
                "/page",
                get_bytes("text/html", b"<html>not found</html>".to_vec()),
            )
            .route("/huge", get_declared_huge())
    })
    .await;
    std::fs::write(
        dir.path().join("p.yaml"),
        "version: 1\nname: bad-results\noutput_dir: out\nitems:\n  - { id: page, url: \"https://example.invalid/page.png\" }\n  - { id: huge, url: \"https://example.invalid/huge.png\" }\nsteps:\n  - id: big\n    upscale: { image_url: \"{{ item.url }}\", desired_increase: 2 }\n",
    )
    .unwrap();
    let state = dir.path().join("state.db");
    let state_arg = state.to_string_lossy().into_owned();
    let o = fake
        .run(
            &[
                "run",
                "p.yaml",
                "--run-id",
                "r",
                "--state",
                &state_arg,
                "--retry-base-ms",
                "10",
            ],
            dir.path(),
        )
        .await;
    assert_exit_without_panic(&o, 4);
    assert_eq!(fake.count("POST", "/v1/images/tools/upscale"), 2);
    assert_eq!(fake.count("GET", "/page"), 1);
    assert_eq!(fake.count("GET", "/huge"), 1);
    let run_dir = dir.path().join("out").join("r");
    assert_eq!(files_under(&run_dir), ["manifest.jsonl".to_owned()].into());
    assert_eq!(
        std::fs::read_to_string(run_dir.join("manifest.jsonl")).unwrap(),
        ""
    );
    let mut conn = read_only(&state).await;
    let rows = sqlx::query("SELECT job_id, path, download_error FROM outputs ORDER BY job_id")
        .fetch_all(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
    let found: Vec<(String, Option<String>, Option<String>)> = rows
        .iter()
        .map(|r| (r.get("job_id"), r.get("path"), r.get("download_error")))
        .collect();
    assert_eq!(found.len(), 2, "{found:?}");
    for (job, path, error) in &found {
        assert_eq!(path, &None, "{job}");
        let expected = if job == "job_page" {
            "is not an image"
        } else {
            "larger than the limit"
        };
        assert!(
            error.as_deref().is_some_and(|e| e.contains(expected)),
            "{job}: {error:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// (c) Broken state databases are reported and never touched
// ---------------------------------------------------------------------------------------------

/// Runs `run p.yaml --state FILE` on a state database holding `bytes`, and checks the verdict:
/// exit 2, the file named, the way out named, no call billed, no output directory, no lock
/// taken, and the file's bytes and mtime as they were. `expected` is part of the message.
/// Returns what is wrong, as one paragraph; `None` when all is well.
async fn check_refused_state(
    env: &Env,
    what: &str,
    bytes: &[u8],
    expected: &str,
) -> Option<String> {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("p.yaml"), one_step("mug", "big")).unwrap();
    let state = dir.path().join("state.db");
    std::fs::write(&state, bytes).unwrap();
    // An mtime well in the past, so that any write would show even within one clock tick.
    let old = SystemTime::now() - Duration::from_secs(3600);
    std::fs::File::options()
        .write(true)
        .open(&state)
        .unwrap()
        .set_modified(old)
        .unwrap();
    let before = snapshot(&state);
    let billed_before = env.sandbox.ledger().len();
    // Not the id of the run a real database holds: a run that went ahead would write.
    let o = run_with_state(env, dir.path(), &state, &["p.yaml", "--run-id", "r2"]).await;
    let billed = env.sandbox.ledger().len() - billed_before;
    let mut problems = Vec::new();
    let err = stderr(&o);
    if o.status.code() != Some(2) || err.contains("panicked") {
        problems.push(format!("exit {:?}, not 2", o.status.code()));
    }
    let shown = state.to_string_lossy().into_owned();
    for needle in [shown.as_str(), expected, "--state"] {
        if !err.contains(needle) {
            problems.push(format!("the error does not say {needle:?}"));
        }
    }
    if billed > 0 {
        problems.push(format!("{billed} call(s) were billed"));
    }
    let after = snapshot(&state);
    if after.bytes != before.bytes {
        problems.push(format!(
            "the file's bytes changed ({} bytes before, {} after)",
            before.bytes.len(),
            after.bytes.len()
        ));
    }
    if after.mtime != before.mtime {
        problems.push("the file's mtime changed".into());
    }
    for stray in ["out", "state.db.locks"] {
        if dir.path().join(stray).exists() {
            problems.push(format!("{stray} was created"));
        }
    }
    // A WAL left beside the file must hold nothing that could ever be replayed into it.
    let wal = dir.path().join("state.db-wal");
    if wal.exists() && std::fs::metadata(&wal).unwrap().len() > 0 {
        problems.push("a non-empty WAL was left beside the file".into());
    }
    (!problems.is_empty()).then(|| {
        format!(
            "{what}:\n  - {}\n  stderr:\n{}",
            problems.join("\n  - "),
            err.lines()
                .map(|l| format!("    | {l}"))
                .collect::<Vec<_>>()
                .join("\n")
        )
    })
}

/// A state database that is no database, or a damaged one, whether damaged at its start, its
/// end or at a page boundary: exit 2, the file and the way out named, and the file untouched.
#[tokio::test(flavor = "multi_thread")]
async fn a_corrupt_state_database_is_reported_and_left_untouched() {
    let env = small_sandbox(Faults::default()).await;
    let real = a_real_state_database().await;
    let page = 4096;
    assert!(
        real.len() >= 4 * page && real.len() % page == 0,
        "{}",
        real.len()
    );
    let mut header_then_noise = b"SQLite format 3\0".to_vec();
    header_then_noise.extend(noise(8192, 11));
    let mut scrambled_pages = real.clone();
    scrambled_pages[page..].copy_from_slice(&noise(real.len() - page, 5));
    let damaged = "if the file is damaged, move it aside";
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "a text file",
            b"groceries:\n- milk\n- eggs\n".repeat(100),
            damaged,
        ),
        ("random bytes", noise(20_000, 1), damaged),
        ("a SQLite header then noise", header_then_noise, damaged),
        ("the first 100 bytes", real[..100].to_vec(), damaged),
        ("the first page", real[..page].to_vec(), damaged),
        ("half the pages", real[..real.len() / 2].to_vec(), damaged),
        (
            "all but the last page",
            real[..real.len() - page].to_vec(),
            damaged,
        ),
        (
            "every page but the first scrambled",
            scrambled_pages,
            damaged,
        ),
    ];
    let mut problems = Vec::new();
    for (what, bytes, expected) in &cases {
        problems.extend(check_refused_state(&env, what, bytes, expected).await);
    }
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));
    assert_nothing_billed(&env);
}

/// A state database cut short in the middle of its last page (a copy interrupted, a disk that
/// filled up) is damaged just the same: SQLite reads the missing tail as zeros and the indexes
/// no longer match (`PRAGMA integrity_check` says so), so it must be refused and left as it
/// is, not written to and run on.
#[tokio::test(flavor = "multi_thread")]
async fn a_state_database_cut_inside_its_last_page_is_reported_and_left_untouched() {
    let env = small_sandbox(Faults::default()).await;
    let real = a_real_state_database().await;
    let mut problems = Vec::new();
    for cut in [1, 100, 4095] {
        let bytes = &real[..real.len() - cut];
        let what = format!("the file less its last {cut} bytes");
        problems.extend(
            check_refused_state(&env, &what, bytes, "if the file is damaged, move it aside").await,
        );
    }
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));
    assert_nothing_billed(&env);
}

/// Marks a real state database as written by a newer imgpipe: one applied migration this
/// binary does not know, then closed (checkpointed) in the given journal mode.
async fn from_the_future(bytes: &[u8], journal: SqliteJournalMode) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.db");
    std::fs::write(&path, bytes).unwrap();
    let mut conn = SqliteConnectOptions::new()
        .filename(&path)
        .journal_mode(journal)
        .connect()
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES (99991231000000, 'from the future', 1, x'00', 0)",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    conn.close().await.unwrap();
    assert!(!dir.path().join("state.db-wal").exists());
    std::fs::read(&path).unwrap()
}

const NEWER: &str = "was written by a newer imgpipe (schema version 99991231000000)";

/// A state database from a newer schema: exit 2, the file, the version and "upgrade imgpipe"
/// named, the file untouched, nothing billed; and the commands that never open the database
/// (`plan`, `run --dry-run`, `validate`) work with it set as IMGPIPE_STATE and leave it alone.
#[tokio::test(flavor = "multi_thread")]
async fn a_state_database_from_a_newer_imgpipe_is_reported_and_left_untouched() {
    let env = small_sandbox(Faults::default()).await;
    let newer = from_the_future(&a_real_state_database().await, SqliteJournalMode::Wal).await;
    if let Some(problem) = check_refused_state(&env, "a newer schema", &newer, NEWER).await {
        panic!("{problem}");
    }

    // The same file refused again says the same: the first refusal changed nothing.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("p.yaml"), one_step("mug", "big")).unwrap();
    let state = dir.path().join("state.db");
    std::fs::write(&state, &newer).unwrap();
    let before = snapshot(&state);
    for _ in 0..2 {
        let o = run_with_state(&env, dir.path(), &state, &["p.yaml", "--run-id", "r"]).await;
        assert_exit_without_panic(&o, 2);
        let err = stderr(&o);
        assert!(err.contains(NEWER), "{err}");
        assert!(err.contains("it was left untouched"), "{err}");
        assert!(err.contains("upgrade imgpipe"), "{err}");
    }
    assert_untouched(&state, &before, "run twice");

    // Commands that do not keep state never open it, so they work and it stays as it is.
    let corrupt = dir.path().join("corrupt.db");
    std::fs::write(&corrupt, noise(10_000, 9)).unwrap();
    let corrupt_before = snapshot(&corrupt);
    for db in [&state, &corrupt] {
        for args in [
            &["plan", "p.yaml"][..],
            &["run", "p.yaml", "--dry-run"],
            &["validate", "p.yaml"],
            &["account"],
        ] {
            let mut cmd = Imgpipe::new(args).cwd(dir.path()).command();
            cmd.env("IMGPIPE_BASE_URL", env.sandbox.base_url().as_str())
                .env("IMGPIPE_API_KEY", env.sandbox.key())
                .env("IMGPIPE_STATE", db);
            let o = finish(cmd).await;
            assert_exit_without_panic(&o, 0);
        }
    }
    assert_untouched(&state, &before, "plan, dry run, validate, account");
    assert_untouched(
        &corrupt,
        &corrupt_before,
        "plan, dry run, validate, account",
    );
    // And IMGPIPE_STATE reaches `run`, which refuses it as it refuses --state.
    let mut cmd = Imgpipe::new(&["run", "p.yaml", "--run-id", "r"])
        .cwd(dir.path())
        .command();
    cmd.env("IMGPIPE_BASE_URL", env.sandbox.base_url().as_str())
        .env("IMGPIPE_API_KEY", env.sandbox.key())
        .env("IMGPIPE_STATE", &state);
    let o = finish(cmd).await;
    assert_exit_without_panic(&o, 2);
    assert!(stderr(&o).contains(NEWER), "{}", stderr(&o));
    assert_untouched(&state, &before, "run with IMGPIPE_STATE");
    assert!(!dir.path().join("out").exists());
    assert_nothing_billed(&env);
}

/// A newer database kept in rollback-journal mode (a newer imgpipe that stopped using WAL, or
/// a copy made with `sqlite3 .backup`) is just as much not this binary's to change: the
/// message says "it was left untouched", so its bytes must be the same afterwards.
#[tokio::test(flavor = "multi_thread")]
async fn a_newer_state_database_in_rollback_journal_mode_is_left_untouched_too() {
    let env = small_sandbox(Faults::default()).await;
    let newer = from_the_future(&a_real_state_database().await, SqliteJournalMode::Delete).await;
    assert_eq!(
        newer[18..20],
        [1, 1],
        "the premise: a rollback-journal file"
    );
    let what = "a newer schema, rollback journal";
    if let Some(problem) = check_refused_state(&env, what, &newer, NEWER).await {
        panic!("{problem}");
    }
    assert_nothing_billed(&env);
}

/// A directory where the state file should be: reported naming it, exit 2, left as it was.
#[tokio::test(flavor = "multi_thread")]
async fn a_directory_in_place_of_the_state_database_is_reported() {
    let env = small_sandbox(Faults::default()).await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("p.yaml"), one_step("mug", "big")).unwrap();
    let state = dir.path().join("state.db");
    std::fs::create_dir(&state).unwrap();
    std::fs::write(state.join("keep"), b"mine").unwrap();
    let o = run_with_state(&env, dir.path(), &state, &["p.yaml", "--run-id", "r"]).await;
    assert_exit_without_panic(&o, 2);
    let err = stderr(&o);
    assert!(
        err.contains(&format!(
            "cannot open the state database {}",
            state.display()
        )),
        "{err}"
    );
    assert!(err.contains("--state"), "{err}");
    assert_eq!(tree(&state), paths(&["keep"]));
    assert_eq!(std::fs::read(state.join("keep")).unwrap(), b"mine");
    assert!(!dir.path().join("out").exists());
    assert_nothing_billed(&env);
}

// ---------------------------------------------------------------------------------------------
// (d) State databases that are not imgpipe's: another application's, or an empty file
// ---------------------------------------------------------------------------------------------

/// The bytes of a SQLite database made with `sql` (each statement run in turn) in the given
/// journal mode, then closed (checkpointed).
async fn sqlite_with(sql: &[&str], journal: SqliteJournalMode) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let mut conn = SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true)
        .journal_mode(journal)
        .connect()
        .await
        .unwrap();
    for statement in sql {
        sqlx::query(sqlx::AssertSqlSafe(*statement))
            .execute(&mut conn)
            .await
            .unwrap();
    }
    conn.close().await.unwrap();
    std::fs::read(&path).unwrap()
}

/// The `application_id` in a SQLite file's header (bytes 68 to 71, big-endian).
fn application_id(bytes: &[u8]) -> [u8; 4] {
    bytes[68..72].try_into().unwrap()
}

const NOT_OURS: &str = "is not an imgpipe state database";

/// A SQLite database of another application given as `--state`, whether it says so with an
/// `application_id` of its own or not at all: exit 2, the file named and said not to be
/// imgpipe's, nothing billed, and the file as it was (no table of imgpipe's added).
#[tokio::test(flavor = "multi_thread")]
async fn another_applications_sqlite_database_is_refused_and_left_untouched() {
    let env = small_sandbox(Faults::default()).await;
    let notes = [
        "CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT NOT NULL)",
        "INSERT INTO notes (body) VALUES ('buy milk'), ('call Ann')",
    ];
    let marked = [notes[0], notes[1], "PRAGMA application_id = 1598903374"];
    // A sqlx application of its own: a migrations table, but not imgpipe's migrations.
    let sqlx_app = [
        "CREATE TABLE _sqlx_migrations (version BIGINT PRIMARY KEY, description TEXT NOT NULL,
             installed_on TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP, success BOOLEAN NOT NULL,
             checksum BLOB NOT NULL, execution_time BIGINT NOT NULL)",
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
             VALUES (1, 'accounts', 1, x'0102', 0)",
        "CREATE TABLE accounts (id INTEGER PRIMARY KEY)",
    ];
    let cases = [
        (
            "another application's, rollback journal",
            sqlite_with(&notes, SqliteJournalMode::Delete).await,
        ),
        (
            "another application's, WAL",
            sqlite_with(&notes, SqliteJournalMode::Wal).await,
        ),
        (
            "another application id",
            sqlite_with(&marked, SqliteJournalMode::Delete).await,
        ),
        (
            "another sqlx application",
            sqlite_with(&sqlx_app, SqliteJournalMode::Delete).await,
        ),
        (
            "a database without a table",
            sqlite_with(&["PRAGMA user_version = 7"], SqliteJournalMode::Delete).await,
        ),
    ];
    let mut problems = Vec::new();
    for (what, bytes) in &cases {
        assert!(bytes.len() >= 512, "{what}: the premise, a SQLite file");
        problems.extend(check_refused_state(&env, what, bytes, NOT_OURS).await);
    }
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));

    // One that says it is another application's is refused from its header alone: even in
    // WAL mode, nothing is left beside it.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("p.yaml"), one_step("mug", "big")).unwrap();
    let state = dir.path().join("state.db");
    std::fs::write(&state, sqlite_with(&marked, SqliteJournalMode::Wal).await).unwrap();
    let o = run_with_state(&env, dir.path(), &state, &["p.yaml", "--run-id", "r"]).await;
    assert_exit_without_panic(&o, 2);
    assert!(
        stderr(&o).contains("its application id is 0x5f4d544e"),
        "{}",
        stderr(&o)
    );
    assert_eq!(tree(dir.path()), paths(&["p.yaml", "state.db"]));

    // The commands that only read refuse it the same way, and leave it as it is.
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("app.db");
    std::fs::write(&state, &cases[0].1).unwrap();
    let before = snapshot(&state);
    let shown = state.to_string_lossy().into_owned();
    for args in [
        &["runs", "--state", &shown][..],
        &["status", "r", "--state", &shown],
        &["report", "r", "--state", &shown],
    ] {
        let o = bin(&env, dir.path(), args).await;
        assert_exit_without_panic(&o, 2);
        let err = stderr(&o);
        assert!(err.contains(&format!("{shown} {NOT_OURS}")), "{err}");
        assert!(err.contains("tables notes"), "{err}");
    }
    assert_untouched(&state, &before, "runs, status, report");
    assert_nothing_billed(&env);
}

/// An empty file where the state database should be is not a new database: imgpipe makes its
/// databases itself, so it is refused (exit 2) and left empty; `runs` and `status` too.
#[tokio::test(flavor = "multi_thread")]
async fn an_empty_file_given_as_state_is_refused_and_left_empty() {
    let env = small_sandbox(Faults::default()).await;
    let expected = "is an empty file, which imgpipe did not create";
    if let Some(problem) = check_refused_state(&env, "an empty file", b"", expected).await {
        panic!("{problem}");
    }
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state.db");
    std::fs::write(&state, b"").unwrap();
    let shown = state.to_string_lossy().into_owned();
    for args in [
        &["runs", "--state", &shown][..],
        &["status", "r", "--state", &shown],
    ] {
        let o = bin(&env, dir.path(), args).await;
        assert_exit_without_panic(&o, 2);
        let err = stderr(&o);
        assert!(err.contains(expected), "{err}");
        assert!(err.contains("remove the empty file"), "{err}");
    }
    assert_eq!(std::fs::metadata(&state).unwrap().len(), 0);
    assert_nothing_billed(&env);
}

/// A new state database carries imgpipe's mark from the start, and nothing is left beside
/// it, even when two runs create it at once; one made before the mark existed (its
/// migrations are imgpipe's) is marked when next opened, and its runs are all there.
#[tokio::test(flavor = "multi_thread")]
async fn a_new_state_database_is_marked_and_one_from_before_the_mark_is_marked_on_open() {
    let env = small_sandbox(Faults::default()).await;
    let real = a_real_state_database().await;
    assert_eq!(&application_id(&real), b"imgp");

    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.yaml"), one_step("mug", "big")).unwrap();
    std::fs::write(
        dir.path().join("b.yaml"),
        one_step("mug", "big").replace("name: ids", "name: other"),
    )
    .unwrap();
    let state = dir.path().join("state.db");
    let (a, b) = tokio::join!(
        run_with_state(&env, dir.path(), &state, &["a.yaml", "--run-id", "a"]),
        run_with_state(&env, dir.path(), &state, &["b.yaml", "--run-id", "b"]),
    );
    assert_exit_without_panic(&a, 0);
    assert_exit_without_panic(&b, 0);
    assert_eq!(run_ids(&state).await.len(), 2);
    assert_eq!(&application_id(&std::fs::read(&state).unwrap()), b"imgp");
    let strays: Vec<String> = files_under(dir.path())
        .into_iter()
        .filter(|p| p.ends_with(".new"))
        .collect();
    assert!(strays.is_empty(), "{strays:?}");

    // The same database as an imgpipe from before the mark left it.
    let old = dir.path().join("old.db");
    std::fs::write(&old, &real).unwrap();
    let mut conn = SqliteConnectOptions::new()
        .filename(&old)
        .connect()
        .await
        .unwrap();
    sqlx::query("PRAGMA application_id = 0")
        .execute(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
    assert_eq!(application_id(&std::fs::read(&old).unwrap()), [0; 4]);
    let shown = old.to_string_lossy().into_owned();
    let o = bin(&env, dir.path(), &["runs", "--state", &shown, "--json"]).await;
    assert_exit_without_panic(&o, 0);
    assert_eq!(json_stdout(&o)[0]["id"], "r");
    assert_eq!(&application_id(&std::fs::read(&old).unwrap()), b"imgp");
    assert_eq!(run_ids(&old).await, ["r"]);
}

/// A task's or a run's status this build does not know (a database written by a newer
/// imgpipe, or edited by hand with its checks off) is refused by name, never read as another
/// (a task as pending, which a resume pays for; a run as running): exit 1, nothing billed.
#[tokio::test(flavor = "multi_thread")]
async fn a_status_this_imgpipe_does_not_know_is_refused_by_name() {
    let env = small_sandbox(Faults::default()).await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("p.yaml"), one_step("mug", "big")).unwrap();
    let state = dir.path().join("state.db");
    let o = run_with_state(&env, dir.path(), &state, &["p.yaml", "--run-id", "r"]).await;
    assert_exit_without_panic(&o, 0);
    let billed = env.sandbox.ledger().len();
    let edit = |sql: &'static str| {
        let state = state.clone();
        async move {
            let mut conn = SqliteConnectOptions::new()
                .filename(&state)
                .connect()
                .await
                .unwrap();
            // The tables hold their statuses to the words they know: only a hand that
            // turns the checks off (or a newer schema's) writes another.
            sqlx::query("PRAGMA ignore_check_constraints = ON")
                .execute(&mut conn)
                .await
                .unwrap();
            sqlx::query(sql).execute(&mut conn).await.unwrap();
            conn.close().await.unwrap();
        }
    };
    let state_arg = state.to_string_lossy().into_owned();
    edit("UPDATE tasks SET status = 'paused' WHERE run_id = 'r'").await;
    let o = bin(&env, dir.path(), &["report", "r", "--state", &state_arg]).await;
    assert_exit_without_panic(&o, 1);
    let err = stderr(&o);
    assert!(err.contains("a task's status is `paused`"), "{err}");

    edit("UPDATE runs SET status = 'halted' WHERE id = 'r'").await;
    let o = bin(&env, dir.path(), &["status", "r", "--state", &state_arg]).await;
    assert_exit_without_panic(&o, 1);
    let err = stderr(&o);
    assert!(err.contains("a run's status is `halted`"), "{err}");
    assert_eq!(env.sandbox.ledger().len(), billed, "nothing billed");
}
