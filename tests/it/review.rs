//! The report as the place to decide what to make again (issue 24): every task's request is
//! recorded as sent and shown beside its images, escaped; an output set aside by a reroll shows
//! as an earlier version. On SQLite and, with `IMGPIPE_TEST_POSTGRES`, on PostgreSQL. The
//! browser half (ticking outputs builds the command, nothing in an item runs) is in
//! `report_page.rs`.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use sqlx::{Connection, Row};

use crate::common::*;
use crate::run::{state_path, write};

/// A pipeline whose items put markup and quotes into prompts and object names, with the
/// request fields of every kind of task: a generation of two images, erase, expand, upscale.
pub(crate) fn review_pipeline(subject: &str, remove: &str) -> String {
    let quoted = |s: &str| serde_json::to_string(s).unwrap();
    format!(
        r#"version: 1
name: review
output_dir: out
pricing: {{ generation: 4 }}
items:
  - {{ id: mug, subject: {}, remove: {} }}
  - {{ id: cup, subject: a cup, remove: the handle }}
steps:
  - id: shot
    generate: {{ prompt: "Studio photo of {{{{ item.subject }}}}", n: 2, size: 2K }}
  - id: clean
    erase: {{ from: shot, object_name: "{{{{ item.remove }}}}" }}
  - id: wide
    expand: {{ from: clean, aspect_ratio: "16:9", prompt: extend the backdrop }}
  - id: big
    upscale: {{ from: wide, desired_increase: 4, preserve_alpha: false }}
"#,
        quoted(subject),
        quoted(remove)
    )
}

/// Runs `review_pipeline` as run `r1` on the embedded sandbox, state at `state`, with a report.
pub(crate) async fn run_review(dir: &Path, state: &str, subject: &str, remove: &str) -> PathBuf {
    write(dir, "review.yaml", &review_pipeline(subject, remove));
    let o = Imgpipe::new(&[
        "run",
        "--sandbox",
        "--report",
        "review.yaml",
        "--run-id",
        "r1",
        "--state",
        state,
        "--retry-base-ms",
        "20",
    ])
    .cwd(dir)
    .run()
    .await;
    assert_exit(&o, 0);
    dir.join("out/r1/report.html")
}

const SUBJECT: &str = r#"a mug <b>bold</b> & "quoted" 'too'"#;
const REMOVE: &str = "the <i>tag</i>";

/// The request each task of `review_pipeline` sends, without its image URLs.
fn expected(item: &str, step: &str) -> Value {
    let (subject, remove) = if item == "mug" {
        (SUBJECT, REMOVE)
    } else {
        ("a cup", "the handle")
    };
    match step {
        "shot" => json!({"prompt": format!("Studio photo of {subject}"), "n": 2, "size": "2K"}),
        "clean" => json!({ "object_name": remove }),
        "wide" => json!({"aspect_ratio": "16:9", "prompt": "extend the backdrop"}),
        "big" => json!({"desired_increase": 4, "preserve_alpha": false}),
        other => panic!("no step {other}"),
    }
}

/// The element starting at `id="ID"` (a figure) through its end tag.
fn figure<'a>(html: &'a str, id: &str) -> &'a str {
    let at = html
        .find(&format!("<figure id=\"{id}\""))
        .unwrap_or_else(|| panic!("no figure {id}"));
    let end = html[at..].find("</figure>").unwrap() + at;
    &html[at..end]
}

/// Each task's row id, key and recorded request, and each of its outputs' `k`.
async fn recorded(state: &str) -> Vec<(i64, String, String, u32, Option<String>, Vec<u32>)> {
    let mut db = state_connection(state).await;
    let tasks = sqlx::query("SELECT id, item, step, idx, request FROM tasks ORDER BY id")
        .fetch_all(&mut db)
        .await
        .unwrap();
    let mut out = Vec::new();
    for t in tasks {
        let id: i64 = t.get("id");
        let ks: Vec<i64> = sqlx::query_scalar("SELECT k FROM outputs WHERE task_id = $1")
            .bind(id)
            .fetch_all(&mut db)
            .await
            .unwrap();
        out.push((
            id,
            t.get("item"),
            t.get("step"),
            u32::try_from(t.get::<i64, _>("idx")).unwrap(),
            t.get("request"),
            ks.into_iter().map(|k| u32::try_from(k).unwrap()).collect(),
        ));
    }
    db.close().await.unwrap();
    out
}

/// The run on `state`: every task's request recorded as sent, and shown in each of its
/// outputs' figures, its markup escaped, with the box that picks the task for a reroll.
async fn requests_recorded_and_shown(dir: &Path, state: &str) {
    let report = run_review(dir, state, SUBJECT, REMOVE).await;
    let tasks = recorded(state).await;
    assert_eq!(tasks.len(), 14, "2 items × (1 shot + 2 × 3 edits)");
    let html = std::fs::read_to_string(&report).unwrap();
    for (id, item, step, idx, request, ks) in &tasks {
        let key = format!("{item}/{step}[{idx}]");
        let want = expected(item, step);
        let got: Value = serde_json::from_str(request.as_deref().expect("a request"))
            .unwrap_or_else(|e| panic!("{key}: {e}: {request:?}"));
        assert_eq!(got, want, "{key}");
        assert_eq!(ks.len(), if step == "shot" { 2 } else { 1 }, "{key}");
        for k in ks {
            let fig = figure(&html, &format!("o{id}-{k}"));
            assert!(
                fig.contains(&format!(
                    "<input class=\"pick\" type=\"checkbox\" value=\"{key}\">"
                )),
                "{key}: {fig}"
            );
            let shown = &fig[fig.find("<dl class=\"req\">").expect("the request")..];
            for (field, value) in want.as_object().unwrap() {
                let value = match value {
                    Value::String(s) => s.clone(),
                    Value::Number(n) if field == "desired_increase" => format!("×{n}"),
                    other => other.to_string(),
                };
                let escaped = value
                    .replace('&', "&amp;")
                    .replace('<', "&lt;")
                    .replace('>', "&gt;")
                    .replace('"', "&quot;");
                assert!(
                    shown.contains(&format!("\">{escaped}</dd>")),
                    "{key}: {field} = {value:?} not shown in {shown}"
                );
            }
        }
    }
    for raw in ["<b>bold</b>", "<i>tag</i>", "\"quoted\""] {
        assert!(!html.contains(raw), "{raw} written unescaped");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn each_tasks_request_is_recorded_and_shown_escaped_beside_its_images_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let state = state_path(dir.path()).to_string_lossy().into_owned();
    requests_recorded_and_shown(dir.path(), &state).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn each_tasks_request_is_recorded_and_shown_escaped_beside_its_images_on_postgres() {
    let Some(url) = postgres_database("review").await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    requests_recorded_and_shown(dir.path(), &url).await;
}

/// An output a reroll set aside (its file under `_superseded/`, its row in
/// `superseded_outputs` with the reason `rerolled`) shows in the figure of the output that
/// replaced it, with its thumbnail and a link to its file; no other figure has one.
#[tokio::test(flavor = "multi_thread")]
async fn an_output_set_aside_by_a_reroll_shows_as_an_earlier_version() {
    let dir = tempfile::tempdir().unwrap();
    let state = state_path(dir.path()).to_string_lossy().into_owned();
    run_review(dir.path(), &state, "a mug", "the tag").await;
    let run_dir = dir.path().join("out/r1");
    let mut db = sqlx::SqliteConnection::connect(&format!("sqlite://{state}"))
        .await
        .unwrap();
    let big = |item: &'static str| {
        sqlx::query(
            "SELECT t.id, o.path, o.sha256 FROM tasks t JOIN outputs o ON o.task_id = t.id
             WHERE t.item = $1 AND t.step = 'big' AND t.idx = 0",
        )
        .bind(item)
    };
    let mug = big("mug").fetch_one(&mut db).await.unwrap();
    let cup = big("cup").fetch_one(&mut db).await.unwrap();
    let (task, cup_path): (i64, String) = (mug.get("id"), cup.get("path"));
    // The earlier picture: another image, so its thumbnail is its own.
    let aside = run_dir.join("_superseded/mug/big.o1.rerolled.png");
    std::fs::create_dir_all(aside.parent().unwrap()).unwrap();
    std::fs::copy(&cup_path, &aside).unwrap();
    let sha = sha256_hex(&std::fs::read(&aside).unwrap());
    sqlx::query(
        "INSERT INTO superseded_outputs (task_id, run_id, k, job_id, path, sha256, bytes, reason,
             superseded_at)
         VALUES ($1, 'r1', 0, 'job_before', $2, $3, 1, 'rerolled', 1764000000000)",
    )
    .bind(task)
    .bind(aside.to_string_lossy().into_owned())
    .bind(&sha)
    .execute(&mut db)
    .await
    .unwrap();
    db.close().await.unwrap();

    let o = Imgpipe::new(&["report", "r1", "--state", &state])
        .cwd(dir.path())
        .run()
        .await;
    assert_exit(&o, 0);
    let html = std::fs::read_to_string(run_dir.join("report.html")).unwrap();
    assert_eq!(html.matches("<details class=\"earlier\">").count(), 1);
    let fig = figure(&html, &format!("o{task}-0"));
    let earlier = &fig[fig
        .find("<details class=\"earlier\">")
        .expect("earlier versions")..];
    assert!(earlier.contains("1 earlier version</summary>"), "{earlier}");
    assert!(earlier.contains("rerolled · 2025-11-24T"), "{earlier}");
    assert!(earlier.contains(">job_before</code>"), "{earlier}");
    assert!(
        earlier.contains("href=\"_superseded/mug/big.o1.rerolled.png\""),
        "{earlier}"
    );
    let thumb = format!("src=\"_thumbs/{}.png\"", &sha[..32]);
    assert!(earlier.contains(&thumb), "{thumb} in {earlier}");
    assert!(
        run_dir
            .join(format!("_thumbs/{}.png", &sha[..32]))
            .is_file()
    );
}
