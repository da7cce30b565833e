//! The desk's run page (issue 36): its items paged and filtered by the database over HTTP,
//! its images served only from the run's directory, a hostile prompt shown as text, and in
//! Chromium the keyboard's picks and a run in another process followed without reloading.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;

use crate::binary::Imgpipe;
use crate::browser::Browser;
use crate::common::*;

/// What a hostile prompt holds: a script and an attribute break-out.
const HOSTILE: &str = r#"<script>alert(1)</script> "><img src=x onerror=alert(1)>"#;

/// Two steps, one call at a time (so which call the sandbox refuses is the run's first).
fn pipeline() -> String {
    let mut items = String::new();
    for i in 0..8 {
        let colour = if i == 3 || i == 5 { "Red" } else { "blue" };
        items.push_str(&format!(
            "  - {{ id: a{i}, subject: \"a {colour} mug\" }}\n"
        ));
    }
    items.push_str(&format!("  - {{ id: x-hostile, subject: '{HOSTILE}' }}\n"));
    format!(
        "version: 1\nname: desk-run\noutput_dir: out\npricing: {{ generation: 4 }}\nconcurrency: 1\nitems:\n{items}steps:\n  \
         - id: shot\n    generate: {{ prompt: \"Photo of {{{{ item.subject }}}}\", n: 1, size: 2K }}\n  \
         - id: clean\n    erase: {{ from: shot, object_name: dust }}\n"
    )
}

struct Catalogue<'e> {
    env: &'e Env,
    dir: PathBuf,
    state: String,
}

impl<'e> Catalogue<'e> {
    fn new(env: &'e Env, pg: Option<String>) -> Catalogue<'e> {
        let dir = env.dir.path().join("work");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("desk.yaml"), pipeline()).unwrap();
        let state = pg.unwrap_or_else(|| dir.join("state.db").to_string_lossy().into_owned());
        Catalogue { env, dir, state }
    }

    fn imgpipe(&self, args: &[&str]) -> Imgpipe<'e> {
        Imgpipe::on(self.env, args)
            .cwd(&self.dir)
            .state(&self.state)
            .args(&["--retry-base-ms", "1"])
    }
}

/// A run `r` with an item of each kind: one whose first call the service refused (failed,
/// its next step blocked), one done again (`reroll`), one with a call that may have been
/// billed, the rest succeeded.
async fn varied(c: &Catalogue<'_>) -> Db {
    c.env.sandbox.refuse_next(1);
    let ran = c
        .imgpipe(&["run", "desk.yaml", "--run-id", "r"])
        .run()
        .await;
    c.env.sandbox.refuse_next(0);
    let db = Db::read(&c.state).await;
    assert_eq!(db.count("failed"), 1, "one call refused: {}", ran.stderr());
    let redo = db
        .live()
        .find(|t| t.step == "clean" && t.status == "succeeded" && t.item == "a2")
        .expect("a2/clean[0] succeeded")
        .name();
    // Done again, and paid: the run still has its failed task (exit 4).
    let ran = c.imgpipe(&["reroll", "r", &redo]).run().await;
    assert_exit(&ran, 4);
    assert!(
        !Db::read(&c.state).await.superseded.is_empty(),
        "{}",
        ran.stderr()
    );
    // A call sent without an answer, as a killed process leaves one: possibly billed.
    let task = db.find("a6", "shot", 0).expect("a6/shot[0]").id;
    let mut conn = writable(&c.state).await;
    sqlx::query(
        "INSERT INTO attempts (task_id, run_id, endpoint, started_at, outcome)
         VALUES ($1, 'r', '/v1/images/generations', 1, 'ambiguous')",
    )
    .bind(task)
    .execute(&mut conn)
    .await
    .unwrap();
    Db::read(&c.state).await
}

/// A connection that writes to the state (SQLite's file, or PostgreSQL).
async fn writable(state: &str) -> sqlx::AnyConnection {
    use sqlx::Connection;
    sqlx::any::install_default_drivers();
    let url = if state.starts_with("postgres") {
        state.to_owned()
    } else {
        format!("sqlite://{state}?mode=rw")
    };
    within(
        "opening the state to write",
        sqlx::AnyConnection::connect(&url),
    )
    .await
    .unwrap()
}

/// `imgpipe review --no-open`: the child, its base URL and token.
struct Served {
    _child: tokio::process::Child,
    base: String,
    token: String,
}

async fn serve(c: &Catalogue<'_>) -> Served {
    serve_with(c, None).await
}

/// [`serve`], with the store's environment of `s3` when given.
async fn serve_with(c: &Catalogue<'_>, s3: Option<&crate::objects::S3>) -> Served {
    use tokio::io::AsyncBufReadExt;
    let mut desk = Imgpipe::on(c.env, &["review", "--no-open"])
        .cwd(&c.dir)
        .state(&c.state);
    if let Some(s3) = s3 {
        desk = desk.s3(s3);
    }
    let mut cmd = desk.command();
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::null())
        .stdin(Stdio::null());
    let mut child = cmd.spawn().unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let first = within("the desk's URL on stdout's first line", lines.next_line())
        .await
        .unwrap()
        .expect("a first line");
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let url = url::Url::parse(&first).unwrap();
    let token = url
        .query_pairs()
        .find(|(k, _)| k == "token")
        .map(|(_, v)| v.into_owned())
        .unwrap();
    Served {
        _child: child,
        base: format!("http://127.0.0.1:{}", url.port().unwrap()),
        token,
    }
}

impl Served {
    async fn get(&self, path: &str) -> reqwest::Response {
        http()
            .get(format!("{}{path}", self.base))
            .header("authorization", format!("Bearer {}", self.token))
            .send()
            .await
            .unwrap()
    }

    async fn json(&self, path: &str) -> Value {
        let r = self.get(path).await;
        assert_eq!(r.status(), 200, "GET {path}");
        r.json().await.unwrap()
    }

    /// Every item the filter `query` shows, page by page of `limit`: each page holds at most
    /// `limit` items, and no item comes twice.
    async fn walk(&self, query: &str, limit: u32) -> Vec<String> {
        self.pages(query, limit).await.concat()
    }

    /// [`Served::walk`], page by page (a page may be short, even empty, and have a next).
    async fn pages(&self, query: &str, limit: u32) -> Vec<Vec<String>> {
        let mut pages = Vec::new();
        let mut seen = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let mut path = format!("/api/runs/r/items?limit={limit}&{query}");
            if let Some(a) = &after {
                path.push_str(&format!("&after={}", urlencode(a)));
            }
            let page = self.json(&path).await;
            let items = page["items"].as_array().unwrap();
            assert!(items.len() <= limit as usize, "{path}: {page}");
            let mut this = Vec::new();
            for i in items {
                let id = i["item"].as_str().unwrap().to_owned();
                assert!(!seen.contains(&id), "{id} twice, with {query} by {limit}");
                seen.push(id.clone());
                this.push(id);
            }
            pages.push(this);
            match page["next"].as_str() {
                Some(n) => after = Some(n.to_owned()),
                None => return pages,
            }
            assert!(pages.len() < 1000, "the pages never end");
        }
    }
}

fn urlencode(s: &str) -> String {
    url::form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

/// The items of `db`'s run `r` with a live task for which `pred` holds.
fn items_where(db: &Db, pred: impl Fn(&TaskRow) -> bool) -> Vec<String> {
    let set: BTreeSet<String> = db
        .tasks_of("r")
        .into_iter()
        .filter(|t| !t.removed && pred(t))
        .map(|t| t.item.clone())
        .collect();
    set.into_iter().collect()
}

async fn paged_and_filtered(pg: Option<String>) {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, pg);
    let db = varied(&c).await;
    let desk = serve(&c).await;

    let all = items_where(&db, |_| true);
    assert_eq!(all.len(), 9);
    for limit in [1, 2, 4, 50] {
        assert_eq!(
            desk.walk("", limit).await,
            all,
            "every item once, by {limit}"
        );
    }

    let ambiguous: BTreeSet<i64> = db.ambiguous().iter().map(|a| a.task_id).collect();
    let superseded: BTreeSet<i64> = db.superseded.iter().map(|s| s.task_id).collect();
    let bad_download: BTreeSet<i64> = db
        .outputs
        .iter()
        .filter(|o| o.path.is_none() && o.download_error.is_some())
        .map(|o| o.task_id)
        .collect();
    let expected: Vec<(&str, Vec<String>)> = vec![
        ("status=failed", items_where(&db, |t| t.status == "failed")),
        (
            "status=blocked",
            items_where(&db, |t| t.status == "blocked"),
        ),
        (
            "step=clean&status=succeeded",
            items_where(&db, |t| t.step == "clean" && t.status == "succeeded"),
        ),
        (
            "failed=1",
            items_where(&db, |t| {
                t.status == "failed" || t.status == "blocked" || bad_download.contains(&t.id)
            }),
        ),
        (
            "possibly_billed=1",
            items_where(&db, |t| ambiguous.contains(&t.id)),
        ),
        (
            "rerolled=1",
            items_where(&db, |t| superseded.contains(&t.id)),
        ),
        ("q=RED", vec!["a3".to_owned(), "a5".to_owned()]),
        ("q=hostile", vec!["x-hostile".to_owned()]),
        ("q=onerror%3Dalert", vec!["x-hostile".to_owned()]),
        ("q=100%25", vec![]),
    ];
    for (query, want) in &expected {
        if !query.starts_with("q=100") {
            assert!(!want.is_empty(), "the fixture has items for {query}");
            assert!(want.len() < all.len(), "{query} leaves some out");
        }
        for limit in [1, 3] {
            assert_eq!(&desk.walk(query, limit).await, want, "{query} by {limit}");
        }
    }
    assert_eq!(expected[5].1, vec!["a2".to_owned()], "the item done again");

    // A bad parameter is named.
    let r = desk.get("/api/runs/r/items?status=done").await;
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert!(
        body["error"].as_str().unwrap().starts_with("status:"),
        "{body}"
    );

    // The hostile prompt comes as JSON text, the page's script puts it in as text.
    let page = desk.json("/api/runs/r/items?q=hostile").await;
    let task = &page["items"][0]["tasks"][0];
    assert_eq!(task["prompt"], format!("Photo of {HOSTILE}"));
    let html = desk.get("/runs/r").await.text().await.unwrap();
    assert!(
        !html.contains("<script>alert"),
        "no prompt in the page's own markup"
    );
    assert!(html.contains(r#"<aside id="decide"></aside>"#));
}

#[tokio::test(flavor = "multi_thread")]
async fn the_desk_pages_every_item_once_and_filters_exactly() {
    paged_and_filtered(None).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn on_postgres_the_desk_pages_every_item_once_and_filters_exactly() {
    let Some(pg) = postgres_database("desk_pages").await else {
        return;
    };
    paged_and_filtered(Some(pg.to_string())).await;
    drop(pg);
}

/// Items `b000001` to `b120000` added to run `r` as copies of `a1`'s two tasks, pending, the
/// prompt of `bN` saying `(model N)`: 240,000 tasks, more than four of the windows a filter
/// that walks the run looks at in one page.
async fn far_down(c: &Catalogue<'_>) {
    let name = if c.state.starts_with("postgres") {
        "'b' || lpad(n::text, 6, '0')"
    } else {
        "'b' || printf('%06d', n)"
    };
    let seed = format!(
        "WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < 120000)
         INSERT INTO tasks (run_id, item, step, idx, operation, inputs, planned_credits, status,
             credits_billed, updated_at, request)
         SELECT t.run_id, {name}, t.step, t.idx, t.operation, t.inputs, t.planned_credits,
             'pending', 0, t.updated_at, replace(t.request, 'blue mug', 'blue mug (model ' || n || ')')
         FROM tasks t, g WHERE t.run_id = 'r' AND t.item = 'a1'"
    );
    let mut conn = writable(&c.state).await;
    within(
        "seeding 240,000 tasks",
        sqlx::query(sqlx::AssertSqlSafe(seed)).execute(&mut conn),
    )
    .await
    .unwrap();
}

async fn filtered_far_down(pg: Option<String>) {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, pg);
    let ran = c
        .imgpipe(&["run", "desk.yaml", "--run-id", "r"])
        .run()
        .await;
    assert_exit(&ran, 0);
    far_down(&c).await;
    let desk = serve(&c).await;

    // One match, at the run's far end: found, after pages that looked and found nothing.
    let pages = desk.pages("q=model%20119999", 50).await;
    assert_eq!(pages.concat(), vec!["b119999".to_owned()]);
    assert!(
        pages.len() > 1 && pages[0].is_empty(),
        "a page looks at part of the run only: {pages:?}"
    );
    // Matches on both sides of the second window's end (about b049994), paged through.
    let mut want = vec!["b004999".to_owned()];
    want.extend((49990..=49999).map(|n| format!("b{n:06}")));
    for limit in [1, 3, 50] {
        assert_eq!(
            desk.walk("q=MODEL%204999", limit).await,
            want,
            "q=MODEL 4999 by {limit}"
        );
    }
    // A step with words: the item after all the others.
    assert_eq!(
        desk.walk("step=clean&q=x-HOSTILE", 2).await,
        vec!["x-hostile".to_owned()]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_filter_finds_matches_far_down_a_long_run_page_by_bounded_page() {
    filtered_far_down(None).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn on_postgres_a_filter_finds_matches_far_down_a_long_run_page_by_bounded_page() {
    let Some(pg) = postgres_database("desk_far").await else {
        return;
    };
    filtered_far_down(Some(pg.to_string())).await;
    drop(pg);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_desk_serves_a_runs_images_and_nothing_outside_its_directory() {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, None);
    let ran = c
        .imgpipe(&["run", "desk.yaml", "--run-id", "r"])
        .run()
        .await;
    assert_exit(&ran, 0);
    let run_dir = c.dir.join("out/r");
    std::fs::write(c.dir.join("out/secret.png"), b"not yours").unwrap();
    std::os::unix::fs::symlink(c.dir.join("out/secret.png"), run_dir.join("a0/link.png")).unwrap();
    let desk = serve(&c).await;

    let page = desk.json("/api/runs/r/items?limit=1").await;
    let out = &page["items"][0]["tasks"][0]["outputs"][0];
    let src = out["src"].as_str().unwrap();
    let r = desk.get(src).await;
    assert_eq!(r.status(), 200, "{src}");
    assert_eq!(r.headers()["content-type"], "image/png");
    let file = run_dir.join(out["file"].as_str().unwrap());
    assert_eq!(
        r.bytes().await.unwrap().to_vec(),
        std::fs::read(&file).unwrap()
    );

    for path in [
        "/runs/r/files/..%2Fsecret.png",
        "/runs/r/files/a0%2F..%2F..%2Fsecret.png",
        "/runs/r/files/a0/..%2F..%2F..%2Fstate.db",
        "/runs/r/files/%2Fetc%2Fpasswd",
    ] {
        let r = desk.get(path).await;
        assert_eq!(r.status(), 400, "{path} refused");
    }
    for (path, why) in [
        ("/runs/r/files/a0/link.png", "a link leading out of the run"),
        ("/runs/r/files/manifest.jsonl", "not an image"),
    ] {
        let r = desk.get(path).await;
        assert!(
            r.status() == 404 || r.status() == 400,
            "{why}: {path} answered {}",
            r.status()
        );
        assert_ne!(r.bytes().await.unwrap().as_ref(), b"not yours");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_desk_serves_the_images_of_a_run_in_a_bucket_and_nothing_outside_it() {
    let env = start_sample_sized().await;
    let s3 = crate::objects::S3::start().await;
    let c = Catalogue::new(&env, None);
    let ran = c
        .imgpipe(&[
            "run",
            "desk.yaml",
            "--run-id",
            "r",
            "--out",
            "s3://shots/runs/",
        ])
        .s3(&s3)
        .run()
        .await;
    assert_exit(&ran, 0);
    std::fs::create_dir_all(s3.file("runs")).unwrap();
    std::fs::write(s3.file("runs/secret.png"), b"not yours").unwrap();
    let desk = serve_with(&c, Some(&s3)).await;

    let page = desk.json("/api/runs/r/items?limit=1").await;
    let out = &page["items"][0]["tasks"][0]["outputs"][0];
    assert_eq!(out["file"], "a0/shot.png", "{page}");
    let src = out["src"].as_str().unwrap();
    let r = desk.get(src).await;
    assert_eq!(r.status(), 200, "{src}");
    assert_eq!(r.headers()["content-type"], "image/png");
    let object = std::fs::read(s3.file("runs/r/a0/shot.png")).unwrap();
    assert_eq!(
        r.bytes().await.unwrap().to_vec(),
        object,
        "the object, whole"
    );
    for path in [
        "/runs/r/files/..%2Fsecret.png",
        "/runs/r/files/a0%2F..%2F..%2Fsecret.png",
    ] {
        let r = desk.get(path).await;
        assert_eq!(r.status(), 400, "{path} refused");
    }
    let r = desk.get("/runs/r/files/a0/none.png").await;
    assert_eq!(r.status(), 404, "an object the run does not have");
}

/// Opens the run page in Chromium with the token's URL; `None` when there is no browser and
/// the test may skip (under CI it fails).
async fn page(desk: &Served, run: &str) -> Option<Browser> {
    let browser = Browser::start().await?;
    // The browser resolves no name but `localhost` (and maps even 127.0.0.1 away).
    let base = desk.base.replace("127.0.0.1", "localhost");
    browser
        .visit(&format!("{base}/runs/{run}?token={}", desk.token))
        .await;
    Some(browser)
}

#[tokio::test(flavor = "multi_thread")]
async fn in_chromium_the_keyboard_picks_and_rejects_through_filters_and_a_hostile_prompt_stays_text()
 {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, None);
    let ran = c
        .imgpipe(&["run", "desk.yaml", "--run-id", "r"])
        .run()
        .await;
    assert_exit(&ran, 0);
    let desk = serve(&c).await;
    let Some(b) = page(&desk, "r").await else {
        return;
    };
    b.wait_for(
        "the first page of items drawn",
        "return document.querySelectorAll('#list .item').length === 9;",
        Duration::from_secs(20),
    )
    .await;
    b.run(
        "window.__picks = null; document.addEventListener('desk:picks', \
         e => { window.__picks = e.detail.tasks; }); return true;",
    )
    .await;
    b.type_into("#list .out", "jpjp").await;
    let picked = b
        .run(
            "const outs = [...document.querySelectorAll('#list .out')].slice(0, 2); \
             return { event: window.__picks, first: outs.map(o => o.dataset.task), \
                      marked: [...document.querySelectorAll('.out.picked')].map(o => o.dataset.task) };",
        )
        .await;
    let first = picked["first"].clone();
    assert_eq!(first, serde_json::json!(["a0/shot[0]", "a0/clean[0]"]));
    assert_eq!(
        picked["event"], first,
        "desk:picks carries the two tasks: {picked}"
    );
    assert_eq!(picked["marked"], first, "both marked picked: {picked}");

    // A filter shows other items; `x` rejects one (picked too); the picks outlive the filter.
    b.type_into("input[name=q]", "a1").await;
    b.wait_for(
        "the filter q=a1 applied",
        "return document.querySelectorAll('#list .item').length === 1;",
        Duration::from_secs(20),
    )
    .await;
    b.type_into("#list .out", "jx").await;
    b.run(
        "const q = document.querySelector('input[name=q]'); q.value = ''; \
         q.dispatchEvent(new Event('input', { bubbles: true })); return true;",
    )
    .await;
    // The page draws the items, then marks them: wait for both, not only the first.
    b.wait_for(
        "the filter cleared and the rejected output marked again",
        "return document.querySelectorAll('#list .item').length === 9 \
                && !!document.querySelector('.out.rejected .mark');",
        Duration::from_secs(20),
    )
    .await;
    let kept = b
        .wait_value(
            "the picks and the rejection read back",
            Duration::from_secs(20),
            "const mark = document.querySelector('.out.rejected .mark'); \
             return mark && { event: window.__picks, \
                      picked: [...document.querySelectorAll('.out.picked')].map(o => o.dataset.task), \
                      rejected: [...document.querySelectorAll('.out.rejected')].map(o => o.dataset.task), \
                      said: mark.textContent };",
        )
        .await;
    assert_eq!(
        kept["event"],
        serde_json::json!(["a0/shot[0]", "a0/clean[0]", "a1/shot[0]"]),
        "a rejected output is picked too: {kept}"
    );
    assert_eq!(
        kept["picked"], first,
        "the picks outlive the filter: {kept}"
    );
    assert_eq!(
        kept["rejected"],
        serde_json::json!(["a1/shot[0]"]),
        "{kept}"
    );
    assert_eq!(kept["said"], "rejected ", "{kept}");

    // The hostile prompt is text: the page holds it escaped, and made no element of it.
    let hostile = b
        .wait_value(
            "the hostile item drawn",
            Duration::from_secs(20),
            "const it = document.querySelector('.item[data-item=\"x-hostile\"]'); \
             return it && { text: it.textContent, html: it.innerHTML, \
                      injected: document.querySelectorAll('img[src=\"x\"], #list script').length };",
        )
        .await;
    assert!(
        hostile["text"].as_str().unwrap().contains(HOSTILE),
        "{hostile}"
    );
    assert!(
        hostile["html"].as_str().unwrap().contains(
            "&lt;script&gt;alert(1)&lt;/script&gt; \"&gt;&lt;img src=x onerror=alert(1)&gt;"
        ),
        "{hostile}"
    );
    assert_eq!(hostile["injected"], 0, "{hostile}");
    // An alert would leave the browser refusing every command: this one still answers.
    assert_eq!(b.run("return 1 + 1;").await, 2);
    b.close().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn in_chromium_a_run_in_another_process_shows_its_new_images_without_reloading() {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, None);
    env.sandbox.hold_calls();
    let mut run = c
        .imgpipe(&["run", "desk.yaml", "--run-id", "live"])
        .watched();
    // The run recorded and its first call waiting at the gate.
    wait_while_running(&mut run, "the run's first call held at the gate", || {
        env.sandbox.held_calls() >= 1
    })
    .await;
    let desk = serve(&c).await;
    let Some(b) = page(&desk, "live").await else {
        env.sandbox.release_calls();
        return;
    };
    b.wait_for(
        "the run's items drawn, none with an image yet",
        "return document.querySelectorAll('#list .item').length === 9 \
             && document.querySelectorAll('#list .out img').length === 0;",
        Duration::from_secs(20),
    )
    .await;
    b.wait_for(
        "the header saying the page follows the run, not how to make it again",
        "var p = document.getElementById('run-process'); \
             return !!p && p.textContent.includes('this page follows the run as it goes') \
             && !p.textContent.includes('imgpipe report');",
        Duration::from_secs(20),
    )
    .await;
    b.run("window.__same_page = true; return true;").await;
    step_until(&env, &mut run, |e| e.sandbox.ledger().len() >= 2).await;
    b.wait_for(
        "a0's shot shown without reloading",
        "return window.__same_page === true && !!document.querySelector(\
             '.out[data-task=\"a0/shot[0]\"] img');",
        Duration::from_secs(30),
    )
    .await;
    env.sandbox.release_calls();
    let ended = run.finish().await;
    assert_exit(&ended, 0);
    b.wait_for(
        "every image of the run shown without reloading",
        "return window.__same_page === true \
             && document.querySelectorAll('#list .out img').length === 18;",
        Duration::from_secs(30),
    )
    .await;
    b.close().await;
}

/// One line of the costs table as `Shared::costs` must draw it: the cells after the step's
/// name, from Tasks to Possibly billed.
type Line = [u64; 9];

/// The cells of the costs table's line `data-step="{step}"` in `html`.
fn cost_line(html: &str, step: &str) -> Option<Line> {
    let at = html.find(&format!("data-step=\"{step}\""))?;
    let row = &html[at..at + html[at..].find("</tr>").unwrap()];
    let cells: Vec<u64> = row
        .split("<td")
        .skip(2)
        .map(|c| {
            let text = &c[c.find('>').unwrap() + 1..c.find("</td>").unwrap()];
            text.parse().unwrap_or_else(|_| panic!("{step}: {text}"))
        })
        .collect();
    Some(cells.try_into().unwrap_or_else(|c| panic!("{step}: {c:?}")))
}

/// What the record says a line of the costs table is: the tasks of `of`, and the planned price
/// of those with a call that may have been billed.
fn expected_line<'t>(db: &Db, of: impl Iterator<Item = &'t TaskRow>) -> Line {
    let mut line = [0; 9];
    for t in of {
        let status = ["succeeded", "failed", "blocked"]
            .iter()
            .position(|s| *s == t.status);
        line[0] += 1;
        line[1 + status.unwrap_or(3)] += 1;
        line[5] += u64::from(t.reused_from.is_some());
        line[6] += t.planned;
        line[7] += t.billed;
        line[8] += t.planned * db.ambiguous().iter().filter(|a| a.task_id == t.id).count() as u64;
    }
    line
}

/// The `<table class="costs">` of a page.
fn costs_table(html: &str) -> &str {
    let at = html.find("<table class=\"costs\">").expect("a costs table");
    &html[at..at + html[at..].find("</table>").unwrap()]
}

/// The desk's header of a run with a reroll, calls that may have been billed, and tasks
/// removed from the pipeline (an item dropped, a step dropped for half the items: lines of
/// their own, beside live tasks of the same steps) shows the costs the static report shows,
/// and both are what the record says, line by line: read from the totals the store keeps
/// and the few rows they cannot sum, never counted over the run.
async fn head_costs_as_the_report(pg: Option<String>) {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, pg);
    varied(&c).await;
    // A second call without an answer, on a task then removed with its item.
    let mut conn = writable(&c.state).await;
    for sql in [
        "INSERT INTO attempts (task_id, run_id, endpoint, started_at, outcome)
         SELECT id, 'r', '/v1/images/edits', 2, 'ambiguous' FROM tasks
         WHERE run_id = 'r' AND item = 'a6' AND step = 'clean'",
        "UPDATE tasks SET removed_at = 3 WHERE run_id = 'r'
         AND (item = 'a6' OR (step = 'clean' AND item IN ('a0', 'a1', 'a2', 'a3')))",
    ] {
        sqlx::query(sql).execute(&mut conn).await.unwrap();
    }
    let db = Db::read(&c.state).await;
    let removed: Vec<&TaskRow> = db.tasks.iter().filter(|t| t.removed).collect();
    assert_eq!(removed.len(), 6);
    assert!(!db.superseded.is_empty(), "a reroll");
    let desk = serve(&c).await;
    let r = desk.get("/runs/r/head").await;
    assert_eq!(r.status(), 200);
    let head = r.text().await.unwrap();
    let images = format!("<dt>Images on disk</dt><dd>{}</dd>", db.downloaded().len());
    assert!(head.contains(&images), "{images}: {head}");
    let mut total = [0; 9];
    for step in ["shot", "clean"] {
        let mut want = expected_line(&db, db.live().filter(|t| t.step == step));
        // The plan still has every item's task: those without a live one are pending at its
        // price.
        let price = db.tasks.iter().find(|t| t.step == step).unwrap().planned;
        let unrecorded = 9 - want[0];
        want[0] += unrecorded;
        want[4] += unrecorded;
        want[6] += unrecorded * price;
        assert_eq!(cost_line(&head, step), Some(want), "{step}: {head}");
        for (sum, n) in total.iter_mut().zip(want) {
            *sum += n;
        }
    }
    let gone = expected_line(&db, removed.into_iter());
    assert!(
        gone[7] > 0 && gone[8] > 0,
        "removed tasks billed and at risk: {gone:?}"
    );
    assert_eq!(
        cost_line(&head, "removed from the pipeline"),
        Some(gone),
        "{head}"
    );
    total[7] += gone[7];
    total[8] += gone[8];
    assert_eq!(cost_line(&head, "total"), Some(total), "{head}");

    let ran = Imgpipe::on(c.env, &["report", "r"])
        .cwd(&c.dir)
        .state(&c.state)
        .run()
        .await;
    assert_exit(&ran, 0);
    let page = std::fs::read_to_string(c.dir.join("out/r/report.html")).unwrap();
    assert_eq!(
        costs_table(&head),
        costs_table(&page),
        "the desk's and the report's costs"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_desks_header_shows_the_costs_of_the_record_as_the_report_does() {
    head_costs_as_the_report(None).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn on_postgres_the_desks_header_shows_the_costs_of_the_record_as_the_report_does() {
    let Some(pg) = postgres_database("desk_head").await else {
        return;
    };
    head_costs_as_the_report(Some(pg.to_string())).await;
    drop(pg);
}
