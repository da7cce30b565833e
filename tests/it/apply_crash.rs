//! A resume killed inside the application of its review, on SQLite and on PostgreSQL: at each
//! crash point (`IMGPIPE_TEST_CRASH_AT`: before the review's transaction commits and right
//! after it; then, once the check of the kept files beside the run found files to fetch again,
//! before and after the transaction that sets them aside, and between two of its journaled file
//! moves) the process aborts as a `kill -9` there would;
//! the next resume then pays for nothing twice, loses no file, and records each set-aside
//! output once.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Output;

use sqlx::Connection;

use crate::common::{
    Env, Imgpipe, assert_exit_without_panic, finish, postgres_database, sha256_hex, start,
    state_connection, stderr,
};
use crate::resume::interrupt_when;
use crate::run::{config, edit_chain, write};

const POINTS: [&str; 5] = [
    "resume-apply-before-commit",
    "resume-apply-after-commit",
    "resume-refetch-before-commit",
    "resume-refetch-after-commit",
    "resume-apply-moving",
];

/// `imgpipe ARGS --state STATE --retry-base-ms 20` in `dir` against `env`'s sandbox.
fn on(env: &Env, dir: &Path, state: &str, args: &[&str]) -> tokio::process::Command {
    let mut all = args.to_vec();
    all.extend_from_slice(&["--state", state, "--retry-base-ms", "20"]);
    let mut cmd = Imgpipe::new(&all).cwd(dir).command();
    cmd.env("IMGPIPE_BASE_URL", env.sandbox.base_url().as_str())
        .env("IMGPIPE_API_KEY", env.sandbox.key())
        .env_remove(imgpipe::failpoint::ENV);
    cmd
}

async fn count(state: &str, sql: &'static str) -> i64 {
    let mut conn = state_connection(state).await;
    let (n,): (i64,) = sqlx::query_as(sql).fetch_one(&mut conn).await.unwrap();
    conn.close().await.unwrap();
    n
}

/// A run of 3 items × erase → upscale → cut-out interrupted after item i00's chain, then two
/// of i00's files overwritten and one deleted: a resume has two files to move aside and three
/// to fetch again. Gives the overwritten files' paths and bytes.
async fn interrupted_with_files_changed(env: &Env, state: &str) -> Vec<(String, Vec<u8>)> {
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(3, None));
    let run = on(
        env,
        dir,
        state,
        &["run", "p.yaml", "--run-id", "r", "--concurrency", "1"],
    );
    let o = interrupt_when(env, run, |env| env.sandbox.ledger().len() >= 4).await;
    assert_exit_without_panic(&o, 130);
    let item = dir.join("out/r/i00");
    let mut changed = Vec::new();
    for name in ["clean.png", "big.png"] {
        let junk = format!("not the {name} that was downloaded").into_bytes();
        std::fs::write(item.join(name), &junk).unwrap();
        changed.push((name.trim_end_matches(".png").to_owned(), junk));
    }
    std::fs::remove_file(item.join("cutout.png")).unwrap();
    changed
}

async fn killed_at(env: &Env, state: &str, point: &str) -> Output {
    let mut cmd = on(env, env.dir.path(), state, &["resume", "r"]);
    cmd.env(imgpipe::failpoint::ENV, point);
    finish(cmd).await
}

async fn check_point(env: Env, state: String, point: &str) {
    let dir = env.dir.path();
    let changed = interrupted_with_files_changed(&env, &state).await;
    let billed_before = env.sandbox.ledger().len();
    let o = killed_at(&env, &state, point).await;
    assert_eq!(
        o.status.signal(),
        Some(libc::SIGABRT),
        "{point}: the resume was to abort there: {}",
        stderr(&o)
    );
    // The review is applied before the first paid call; the kept files are checked beside the
    // run, which may have paid for some of what was left by the time the check aborts.
    let beside = point != "resume-apply-before-commit" && point != "resume-apply-after-commit";
    if !beside {
        assert_eq!(env.sandbox.ledger().len(), billed_before, "{point}: paid");
    }
    let journaled = count(&state, "SELECT COUNT(*) FROM pending_moves").await;
    let aside = count(&state, "SELECT COUNT(*) FROM superseded_outputs").await;
    let item = dir.join("out/r/i00");
    match point {
        "resume-apply-before-commit"
        | "resume-apply-after-commit"
        | "resume-refetch-before-commit" => {
            assert_eq!(
                (journaled, aside),
                (0, 0),
                "{point}: written before its commit"
            );
            assert_eq!(std::fs::read(item.join("clean.png")).unwrap(), changed[0].1);
        }
        "resume-refetch-after-commit" => {
            assert_eq!((journaled, aside), (2, 3), "{point}");
            assert_eq!(std::fs::read(item.join("clean.png")).unwrap(), changed[0].1);
            assert_eq!(std::fs::read(item.join("big.png")).unwrap(), changed[1].1);
        }
        _ => {
            assert_eq!((journaled, aside), (2, 3), "{point}");
            let moved = ["clean.png", "big.png"]
                .iter()
                .filter(|n| !item.join(n).exists())
                .count();
            assert_eq!(moved, 1, "{point}: one move made before the abort");
        }
    }

    let o = finish(on(&env, dir, &state, &["resume", "r"])).await;
    assert_exit_without_panic(&o, 0);
    let ledger = env.sandbox.ledger();
    // A call in flight when the check aborted was possibly billed, and is called again: the
    // only calls billed twice, each recorded as such.
    let ambiguous = count(
        &state,
        "SELECT COUNT(*) FROM attempts WHERE outcome = 'ambiguous'",
    )
    .await as usize;
    assert!(
        ledger.len() >= 9 && ledger.len() <= 9 + ambiguous && (beside || ambiguous == 0),
        "{point}: each task billed once ({ambiguous} possibly billed call(s) again): {ledger:#?}"
    );
    assert_eq!(
        count(&state, "SELECT COUNT(*) FROM pending_moves").await,
        0,
        "{point}: the journal is emptied"
    );
    assert_eq!(
        count(&state, "SELECT COUNT(*) FROM superseded_outputs").await,
        3,
        "{point}: each set-aside output recorded once"
    );
    assert_eq!(
        count(
            &state,
            "SELECT COUNT(*) FROM outputs WHERE path IS NULL OR sha256 IS NULL"
        )
        .await,
        0,
        "{point}: every output fetched again"
    );
    // The overwritten files are kept under _superseded/, where their rows say.
    let mut conn = state_connection(&state).await;
    let rows: Vec<(Option<String>, Option<String>, Option<i64>)> = sqlx::query_as(
        "SELECT path, sha256, bytes FROM superseded_outputs WHERE path IS NOT NULL ORDER BY path",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    conn.close().await.unwrap();
    assert_eq!(rows.len(), 2, "{point}: {rows:?}");
    for (name, junk) in &changed {
        let (path, sha, bytes) = rows
            .iter()
            .find(|(p, ..)| {
                p.as_deref()
                    .is_some_and(|p| p.contains(&format!("/{name}.o")))
            })
            .unwrap_or_else(|| panic!("{point}: no row for {name}: {rows:?}"));
        let path = path.as_deref().unwrap();
        assert!(path.contains("_superseded/i00/"), "{point}: {path}");
        assert_eq!(&std::fs::read(path).unwrap(), junk, "{point}: {path}");
        assert_eq!(sha.as_deref(), Some(sha256_hex(junk).as_str()), "{point}");
        assert_eq!(*bytes, Some(junk.len() as i64), "{point}");
    }
    // The files in place are the ones the record names, byte for byte.
    let mut conn = state_connection(&state).await;
    let outputs: Vec<(String, String)> = sqlx::query_as("SELECT path, sha256 FROM outputs")
        .fetch_all(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
    assert_eq!(outputs.len(), 9, "{point}");
    for (path, sha) in outputs {
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{point}: {path}: {e}"));
        assert_eq!(sha256_hex(&bytes), sha, "{point}: {path}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_resume_killed_inside_apply_on_sqlite_resumes_paying_nothing_twice() {
    for point in POINTS {
        let env = start(config()).await;
        let state = env.dir.path().join("state.db");
        check_point(env, state.to_string_lossy().into_owned(), point).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_resume_killed_inside_apply_on_postgres_resumes_paying_nothing_twice() {
    for point in POINTS {
        let Some(url) = postgres_database("apply").await else {
            return;
        };
        let env = start(config()).await;
        check_point(env, url.to_string(), point).await;
    }
}
