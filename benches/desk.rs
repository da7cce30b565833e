//! The desk's run page at batch scale (issue 36): IMGPIPE_BENCH_ITEMS items (default 100,000)
//! through the five-step chain of `pipelines/product-shots.yaml` (9 tasks an item), of which
//! IMGPIPE_BENCH_OUTPUTS stored outputs (default 10,000: the first 1,000 items done), the rest
//! pending. A real `imgpipe run` against `imgpipe sandbox` does three items; the first one's
//! tasks and outputs are then copied to the others in the state database (renamed, stamped a
//! minute before the run's last change, as the scale bench seeds a night; no files: the desk's
//! pages do not read them).
//!
//! Then `imgpipe review` serves that state, and the bench times, each as one request over
//! loopback (the first of its kind, no cache warmed by an earlier one):
//! - the run's first page: `GET /runs/{run}` (the page) and `GET /api/runs/{run}/items` (its
//!   first 50 items), then its header and costs (`GET /runs/{run}/head`, summed over the whole
//!   run by the database), which the page puts in place when they come. Goal: 1 s each;
//! - the next page (`?after=`), each filter (a common one, a rare one, and the text of the
//!   prompts), and a live poll (`/changes?since=`). Goal: 200 ms each. A text that only the
//!   last items match is followed page by page (each looks at part of the run) to its match:
//!   the slowest page against that goal, and the whole walk against the first page's;
//! - a change in the state shown: while a poller asks `/changes?since=` as the run page does
//!   (every second, with the `since` of the last answer), the bench writes CHANGES changes as
//!   the runner settles a task (a pending item's generation succeeded: the task's row and its
//!   two outputs' in one transaction, stamped then), 1.37 s apart on a schedule of their own,
//!   so that they fall anywhere between two polls; each is timed from its commit to the poll
//!   answer that holds its item. The median and the slowest. Goal: 2 s;
//! - the server's peak RSS (VmHWM) after all of them. Goal: 100 MB.
//!
//! `cargo bench --bench desk`; IMGPIPE_BENCH_STATE=postgres://ADMIN@HOST:PORT/DB keeps the
//! state in a fresh database of that server. The directory is removed after, unless
//! IMGPIPE_BENCH_KEEP is set.

#![allow(clippy::print_stdout, clippy::print_stderr, unreachable_pub)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::Connection;

#[path = "support/mod.rs"]
mod support;
use support::{Sandbox, binary, env_usize};

const PIPELINE: &str = r#"version: 1
name: desk-bench
pricing: { generation: 4 }
items_from: items.jsonl
steps:
  - id: shot
    generate: { prompt: "Studio photo of {{ item.subject }} on a white backdrop", n: 2, size: 2K }
  - id: clean
    erase: { from: shot, object_name: "{{ item.remove }}" }
  - id: wide
    expand: { from: clean, aspect_ratio: "16:9", prompt: extend the backdrop }
  - id: big
    upscale: { from: wide, desired_increase: 4 }
  - id: cutout
    remove_background: { from: big }
"#;

/// Stored outputs an item has once done: two shots, and each one's four steps.
const OUTPUTS_PER_ITEM: usize = 10;
const RUN_ID: &str = "bench";
const GOAL_FIRST_S: f64 = 1.0;
const GOAL_NEXT_S: f64 = 0.2;
const GOAL_MIB: f64 = 100e6 / (1024.0 * 1024.0);
const GOAL_SHOWN_S: f64 = 2.0;
/// How often the run page asks what changed (`setInterval(poll, 1000)` in `desk.js`).
const POLL: Duration = Duration::from_millis(1000);
/// Changes written and timed; between two, a pause that is no multiple of the poll's.
const CHANGES: usize = 9;
const BETWEEN: Duration = Duration::from_millis(1370);

fn main() {
    let items = env_usize("IMGPIPE_BENCH_ITEMS", 100_000);
    let outputs = env_usize("IMGPIPE_BENCH_OUTPUTS", 10_000);
    let dir = tempfile::tempdir().expect("a temporary directory");
    let state = support::state_for(dir.path());
    println!("desk: {items} items, {outputs} outputs stored, state {state}");
    write_inputs(dir.path(), 3);
    let started = Instant::now();
    record(dir.path(), &state);
    seed(&state, items, outputs / OUTPUTS_PER_ITEM);
    println!(
        "  recorded and seeded in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let figures = measure(&state, items);
    report(&figures);
    if std::env::var_os("IMGPIPE_BENCH_KEEP").is_some() {
        println!("  kept {}", dir.keep().display());
    }
}

fn write_inputs(dir: &Path, items: usize) {
    std::fs::write(dir.join("bench.yaml"), PIPELINE).expect("write the pipeline");
    let file = std::fs::File::create(dir.join("items.jsonl")).expect("create the items");
    let mut out = BufWriter::new(file);
    for i in 1..=items {
        let line = serde_json::json!({
            "id": format!("p{i:06}"),
            "subject": format!("a ceramic coffee mug (model {i})"),
            "remove": "the price sticker",
        });
        writeln!(out, "{line}").expect("write an item");
    }
    out.flush().expect("flush the items");
}

/// A real run of the first three items, to its end.
fn record(dir: &Path, state: &str) {
    let sandbox = Sandbox::start(&[]);
    let mut run = Command::new(binary());
    run.current_dir(dir)
        .env("IMGPIPE_BASE_URL", &sandbox.base_url)
        .env("IMGPIPE_API_KEY", &sandbox.api_key)
        .args(["run", "bench.yaml", "--run-id", RUN_ID, "--state", state])
        .args(["--out", &dir.join("out").to_string_lossy()])
        .args(["--concurrency", "16", "--retry-base-ms", "1"]);
    support::measure(run, &dir.join("run.out"), &dir.join("run.log"));
}

fn url_of(state: &str) -> String {
    if state.starts_with("postgres") {
        state.to_owned()
    } else {
        format!("sqlite://{state}")
    }
}

fn stored(state: &str) -> i64 {
    support::block_on(async {
        sqlx::any::install_default_drivers();
        let mut conn = sqlx::AnyConnection::connect(&url_of(state))
            .await
            .expect("the state");
        let (n,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM outputs WHERE path IS NOT NULL")
            .fetch_one(&mut conn)
            .await
            .expect("count the outputs");
        let _ = conn.close().await;
        n
    })
}

/// Items 4 to `items` copied from the first one: the first `done` of them with its outputs,
/// the others pending.
fn seed(state: &str, items: usize, done: usize) {
    let name = if state.starts_with("postgres") {
        "'p' || lpad(n::text, 6, '0')"
    } else {
        "'p' || printf('%06d', n)"
    };
    let tasks = format!(
        "WITH RECURSIVE g(n) AS (SELECT 4 UNION ALL SELECT n + 1 FROM g WHERE n < $2)
         INSERT INTO tasks (run_id, item, step, idx, operation, inputs, planned_credits, status,
             credits_billed, job_id, updated_at, request)
         SELECT t.run_id, {name}, t.step, t.idx, t.operation,
             replace(t.inputs, 'p000001/', {name} || '/'), t.planned_credits,
             CASE WHEN n <= $3 THEN t.status ELSE 'pending' END,
             CASE WHEN n <= $3 THEN t.credits_billed ELSE 0 END,
             CASE WHEN n <= $3 THEN t.job_id || '-' || {name} END,
             t.updated_at - 60000, replace(t.request, '(model 1)', '(model ' || n || ')')
         FROM tasks t, g WHERE t.run_id = $1 AND t.item = 'p000001'"
    );
    let outputs = "INSERT INTO outputs (task_id, run_id, k, job_id, parent_job_id, url,
             url_issued_at, path, sha256, bytes, downloaded_at)
         SELECT n.id, o.run_id, o.k, n.job_id, o.parent_job_id, o.url, o.url_issued_at,
             replace(o.path, '/p000001/', '/' || n.item || '/'), o.sha256, o.bytes,
             o.downloaded_at - 60000
         FROM outputs o JOIN tasks t ON t.id = o.task_id AND t.item = 'p000001'
         JOIN tasks n ON n.run_id = t.run_id AND n.step = t.step AND n.idx = t.idx
             AND n.item > 'p000003' AND n.status = 'succeeded'
         WHERE t.run_id = $1";
    support::block_on(async {
        sqlx::any::install_default_drivers();
        let mut conn = sqlx::AnyConnection::connect(&url_of(state))
            .await
            .expect("the state");
        sqlx::query(sqlx::AssertSqlSafe(tasks))
            .bind(RUN_ID)
            .bind(items as i64)
            .bind(done as i64)
            .execute(&mut conn)
            .await
            .expect("seed the tasks");
        sqlx::query(outputs)
            .bind(RUN_ID)
            .execute(&mut conn)
            .await
            .expect("seed the outputs");
        // As the scale bench: a night written at once is analysed as autovacuum would have.
        let analyse = if state.starts_with("postgres") {
            "ANALYZE tasks, attempts, outputs"
        } else {
            "ANALYZE"
        };
        sqlx::query(analyse)
            .execute(&mut conn)
            .await
            .expect("analyse");
        let _ = conn.close().await;
    });
    println!("  {} outputs stored", stored(state));
}

struct Figures {
    timed: Vec<(String, f64, f64)>,
    peak_mib: f64,
}

/// Starts the desk and times its requests.
fn measure(state: &str, items: usize) -> Figures {
    let mut desk = Command::new(binary())
        .args(["review", "--no-open", "--state", state])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the desk");
    let mut lines = BufReader::new(desk.stdout.take().expect("its stdout"));
    let mut first = String::new();
    lines.read_line(&mut first).expect("the desk's URL");
    let (base, token) = support::desk_url(&first);
    let api = format!("/api/runs/{RUN_ID}");
    let figures = support::block_on(async {
        let http = reqwest::Client::new();
        let get = |path: String| {
            let request = http.get(format!("{base}{path}")).bearer_auth(&token).send();
            async move {
                let at = Instant::now();
                let r = request.await.expect("the desk answers");
                assert!(r.status().is_success(), "{path}: {}", r.status());
                let body = r.bytes().await.expect("a body");
                (at.elapsed().as_secs_f64(), body)
            }
        };
        let mut timed = Vec::new();
        let (page_s, _) = get(format!("/runs/{RUN_ID}")).await;
        let (items_s, body) = get(format!("{api}/items?limit=50")).await;
        let first: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
        timed.push((
            format!("first page (/runs/R {:.0} ms + 50 items)", page_s * 1000.0),
            page_s + items_s,
            GOAL_FIRST_S,
        ));
        let (head_s, _) = get(format!("/runs/{RUN_ID}/head")).await;
        timed.push((
            "its header and costs (/runs/R/head, after)".to_owned(),
            head_s,
            GOAL_FIRST_S,
        ));
        let next = first["next"].as_str().expect("a next page").to_owned();
        let since = first["since"].as_i64().expect("a stamp");
        let asks = [
            ("next page", format!("{api}/items?limit=50&after={next}")),
            (
                "filter step=cutout&status=succeeded",
                format!("{api}/items?limit=50&step=cutout&status=succeeded"),
            ),
            (
                "filter status=pending",
                format!("{api}/items?limit=50&status=pending"),
            ),
            (
                "filter failed=1 (none)",
                format!("{api}/items?limit=50&failed=1"),
            ),
            (
                "filter rerolled=1 (none)",
                format!("{api}/items?limit=50&rerolled=1"),
            ),
            (
                "filter q=ceramic (prompt text, every item)",
                format!("{api}/items?limit=50&q=ceramic"),
            ),
            (
                "live poll (/changes?since=)",
                format!("{api}/changes?since={since}"),
            ),
        ];
        for (what, path) in asks {
            let (s, _) = get(path).await;
            timed.push((what.to_owned(), s, GOAL_NEXT_S));
        }
        // One match at the far end: page after page (each looks at part of the run) to it.
        let (mut slowest, mut total, mut pages) = (0.0_f64, 0.0, 0);
        let mut after = String::new();
        loop {
            let (s, body) = get(format!(
                "{api}/items?limit=50&q=model%2099999&after={after}"
            ))
            .await;
            (slowest, total, pages) = (slowest.max(s), total + s, pages + 1);
            let page: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
            let found = page["items"].as_array().is_some_and(|i| !i.is_empty());
            match page["next"].as_str() {
                Some(next) if !found => after = next.to_owned(),
                _ => break,
            }
        }
        timed.push((
            format!("filter q=model 99999, slowest of its {pages} pages"),
            slowest,
            GOAL_NEXT_S,
        ));
        timed.push((
            format!("filter q=model 99999, its {pages} pages to the match"),
            total,
            GOAL_FIRST_S,
        ));
        let pending = (items - 20..items).map(|n| format!("p{n:06}"));
        let shown = change_shown(state, &base, &token, since, pending.collect()).await;
        timed.push((
            format!("a change shown by the poll, median of {CHANGES}"),
            median(&shown),
            GOAL_SHOWN_S,
        ));
        timed.push((
            format!("a change shown by the poll, slowest of {CHANGES}"),
            shown.iter().copied().fold(0.0, f64::max),
            GOAL_SHOWN_S,
        ));
        timed
    });
    let peak_mib = hwm_mib(desk.id()).unwrap_or(f64::NAN);
    // SAFETY: the desk is our child, not reaped yet.
    unsafe { libc::kill(desk.id() as libc::pid_t, libc::SIGTERM) };
    let _ = desk.wait();
    Figures {
        timed: figures,
        peak_mib,
    }
}

/// When each item was first in a poll's answer.
type Seen = Arc<Mutex<HashMap<String, Instant>>>;

/// Polls `/changes?since=` as the run page does (every [`POLL`], from the `since` of the last
/// answer) while [`CHANGES`] changes are written to pending items of `pending` as the runner
/// settles a task; gives, for each, the seconds from its commit to the answer that held it.
async fn change_shown(
    state: &str,
    base: &str,
    token: &str,
    since: i64,
    pending: Vec<String>,
) -> Vec<f64> {
    let seen: Seen = Arc::default();
    let poller = tokio::spawn(poll(
        format!("{base}/api/runs/{RUN_ID}/changes"),
        token.to_owned(),
        since,
        Arc::clone(&seen),
    ));
    sqlx::any::install_default_drivers();
    let mut conn = sqlx::AnyConnection::connect(&url_of(state))
        .await
        .expect("the state");
    // Written on a schedule of their own (not after each is shown), so that they fall at
    // every phase of the poll's second.
    let start = tokio::time::Instant::now();
    let mut written = Vec::new();
    for (i, item) in pending.iter().take(CHANGES).enumerate() {
        tokio::time::sleep_until(start + BETWEEN * (i as u32 + 1)).await;
        settle(&mut conn, item).await;
        written.push((item, Instant::now()));
    }
    let limit = Instant::now() + Duration::from_secs(30);
    let mut shown = Vec::new();
    for (item, at) in written {
        let seen_at = loop {
            if let Some(seen_at) = seen.lock().expect("the poller's record").get(item) {
                break *seen_at;
            }
            assert!(
                Instant::now() < limit,
                "{item}'s change not shown within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        shown.push(seen_at.saturating_duration_since(at).as_secs_f64());
    }
    poller.abort();
    let _ = conn.close().await;
    shown
}

/// The run page's poll: every [`POLL`], what changed since the last answer's `since`.
async fn poll(url: String, token: String, mut since: i64, seen: Seen) {
    let http = reqwest::Client::new();
    let mut every = tokio::time::interval(POLL);
    loop {
        every.tick().await;
        let answer = http
            .get(format!("{url}?since={since}"))
            .bearer_auth(&token)
            .send()
            .await
            .expect("the desk answers");
        let body: serde_json::Value = answer.json().await.expect("JSON");
        let at = Instant::now();
        since = body["since"].as_i64().expect("a since");
        let mut seen = seen.lock().expect("the poller's record");
        for item in body["items"].as_array().into_iter().flatten() {
            let name = item["item"].as_str().expect("an item").to_owned();
            seen.entry(name).or_insert(at);
        }
    }
}

/// Item `item`'s generation settled as the runner settles a success: the task's row and its
/// two outputs' in one transaction, stamped now.
async fn settle(conn: &mut sqlx::AnyConnection, item: &str) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as i64;
    let mut tx = sqlx::Connection::begin(conn).await.expect("a transaction");
    sqlx::query(
        "UPDATE tasks SET status = 'succeeded', job_id = $1, error = NULL,
             credits_billed = credits_billed + 8, updated_at = $2
         WHERE run_id = $3 AND item = $4 AND step = 'shot'",
    )
    .bind(format!("job-bench-{item}"))
    .bind(now)
    .bind(RUN_ID)
    .bind(item)
    .execute(&mut *tx)
    .await
    .expect("settle the task");
    sqlx::query(
        "INSERT INTO outputs (task_id, run_id, k, job_id, url, url_issued_at)
         SELECT id, run_id, 0, job_id, 'https://example.invalid/0.png', $1 FROM tasks
             WHERE run_id = $2 AND item = $3 AND step = 'shot'
         UNION ALL
         SELECT id, run_id, 1, job_id, 'https://example.invalid/1.png', $1 FROM tasks
             WHERE run_id = $2 AND item = $3 AND step = 'shot'",
    )
    .bind(now)
    .bind(RUN_ID)
    .bind(item)
    .execute(&mut *tx)
    .await
    .expect("record its outputs");
    tx.commit().await.expect("commit");
}

fn median(of: &[f64]) -> f64 {
    let mut sorted = of.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN)
}

fn hwm_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

fn report(f: &Figures) {
    for (what, s, goal) in &f.timed {
        let verdict = if s <= goal { "ok" } else { "OVER" };
        println!(
            "  {what:<48} {:>8.1} ms   goal {:>5.0} ms  {verdict}",
            s * 1000.0,
            goal * 1000.0
        );
    }
    let verdict = if f.peak_mib <= GOAL_MIB { "ok" } else { "OVER" };
    println!(
        "  {:<48} {:>8.1} MiB  goal {GOAL_MIB:>5.1} MiB {verdict}",
        "desk peak RSS", f.peak_mib
    );
}
