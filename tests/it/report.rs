//! `imgpipe report` and `run --report` end to end: the real binary against the in-process
//! sandbox (or its own `--sandbox`), then the page read back and held against the state
//! database, the files on disk and the sandbox's ledger. Every link of the page must lead to
//! the file the database names, every thumbnail must be a small PNG named after its image's
//! digest, and every figure of the cost table must be what the database and the sandbox say.
//!
//! Every command passes `--state DIR/state.db`; those that run tasks pass `--retry-base-ms 20`.
//! The page is read with a few string scans, not a parser: the report writes plain, quoted
//! attributes and its templates (maud) escape `<`, `>`, `"` and `&` in every value.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};

use imgpipe::sandbox::{self, Faults};
use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{ConnectOptions, Connection};
use tokio::process::Child;

use crate::common::*;
use crate::resume::{interrupt_when, sandbox_with_latency};
use crate::run::{both, config, copy_sample, edit_chain, seed_for, state_path, write};

type Command = tokio::process::Command;

// ---------------------------------------------------------------------------------------------
// Running the binary
// ---------------------------------------------------------------------------------------------

/// `imgpipe ARGS --state DIR/state.db` in `cwd`, pointed at `env`'s sandbox when there is one;
/// `run` and `resume` retry fast.
fn cmd(env: Option<&Env>, dir: &Path, cwd: &Path, args: &[&str]) -> Command {
    let state = state_path(dir).to_string_lossy().into_owned();
    let mut all = args.to_vec();
    if matches!(args.first(), Some(&"run" | &"resume")) {
        all.extend_from_slice(&["--retry-base-ms", "20"]);
    }
    all.extend_from_slice(&["--state", &state]);
    let mut c = Imgpipe::new(&all).cwd(cwd).command();
    if let Some(env) = env {
        c.env("IMGPIPE_BASE_URL", env.sandbox.base_url().as_str())
            .env("IMGPIPE_API_KEY", env.sandbox.key());
    }
    c
}

/// The same, run to completion in `dir`.
async fn ip(env: Option<&Env>, dir: &Path, args: &[&str]) -> Output {
    finish(cmd(env, dir, dir, args)).await
}

/// A sandbox with `config`, and `edit_chain(items)` in `p.yaml` in its directory.
async fn start_with_chain(config: sandbox::Config, items: usize) -> Env {
    let env = start(config).await;
    write(env.dir.path(), "p.yaml", &edit_chain(items, None));
    env
}

/// A sandbox with `edit_chain(items)` in `p.yaml`, after its run `r` (`ARGS` added) succeeded.
async fn after_run_r(items: usize, args: &[&str]) -> Env {
    let env = start_with_chain(config(), items).await;
    assert_exit_without_panic(&run_chain(&env, "r", args).await, 0);
    env
}

/// `run p.yaml --run-id RUN ARGS`.
fn run_args<'a>(run: &'a str, args: &[&'a str]) -> Vec<&'a str> {
    let mut all = vec!["run", "p.yaml", "--run-id", run];
    all.extend_from_slice(args);
    all
}

/// `imgpipe run p.yaml --run-id RUN ARGS` in `env`'s directory, run to completion.
async fn run_chain(env: &Env, run: &str, args: &[&str]) -> Output {
    ip(Some(env), env.dir.path(), &run_args(run, args)).await
}

/// `imgpipe run p.yaml --run-id RUN --concurrency 1 ARGS` in `env`'s directory (one call at a
/// time), its output captured, to be started by the test.
fn one_at_a_time(env: &Env, run: &str, args: &[&str]) -> Command {
    let mut all = run_args(run, &["--concurrency", "1"]);
    all.extend_from_slice(args);
    let dir = env.dir.path();
    let mut c = cmd(Some(env), dir, dir, &all);
    c.stdout(Stdio::piped()).stderr(Stdio::piped());
    c
}

/// What a started run printed, once it ends (in time).
async fn ended(child: Child) -> Output {
    tokio::time::timeout(RUN_LIMIT, child.wait_with_output())
        .await
        .expect("the run ends in time")
        .unwrap()
}

fn signal(child: &tokio::process::Child, sig: i32) {
    let pid = i32::try_from(child.id().expect("still running")).unwrap();
    // SAFETY: sending a signal to our own child, whose pid we hold.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
}

// ---------------------------------------------------------------------------------------------
// The state database
// ---------------------------------------------------------------------------------------------

/// The record of the run `run` alone, read after (or while) its process ran.
async fn read_db(dir: &Path, run: &str) -> Db {
    Db::read_file(&state_path(dir)).await.only_run(run)
}

/// The live task `item/step[idx]`.
#[track_caller]
fn find<'d>(db: &'d Db, item: &str, step: &str, idx: i64) -> &'d TaskRow {
    db.find(item, step, idx)
        .unwrap_or_else(|| panic!("no task {item}/{step}[{idx}]"))
}

/// `(status, downloaded outputs)` of a run, read while its process may still write.
async fn progress(dir: &Path, run: &str) -> Option<(String, usize)> {
    let mut conn = SqliteConnectOptions::new()
        .filename(state_path(dir))
        .read_only(true)
        .connect()
        .await
        .ok()?;
    let status: Option<(String,)> = sqlx::query_as("SELECT status FROM runs WHERE id = ?")
        .bind(run)
        .fetch_optional(&mut conn)
        .await
        .ok()?;
    let (n,): (i64,) =
        sqlx::query_as("SELECT COUNT(*) FROM outputs WHERE run_id = ? AND path IS NOT NULL")
            .bind(run)
            .fetch_one(&mut conn)
            .await
            .ok()?;
    conn.close().await.ok()?;
    Some((status?.0, usize::try_from(n).unwrap()))
}

// ---------------------------------------------------------------------------------------------
// The page
// ---------------------------------------------------------------------------------------------

fn unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&#39;", "'")
        .replace("&amp;", "&")
}

fn percent_decode(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let hex = std::str::from_utf8(&b[i + 1..i + 3]).unwrap();
            out.push(u8::from_str_radix(hex, 16).unwrap_or_else(|_| panic!("bad escape in {s}")));
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

#[derive(Debug, Clone)]
struct Tag {
    at: usize,
    attrs: BTreeMap<String, String>,
}

impl Tag {
    fn attr(&self, name: &str) -> &str {
        self.attrs
            .get(name)
            .unwrap_or_else(|| panic!("no {name} in {self:?}"))
    }

    fn classes(&self) -> BTreeSet<&str> {
        self.attrs
            .get("class")
            .map(|c| c.split_whitespace().collect())
            .unwrap_or_default()
    }
}

fn parse_attrs(s: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut rest = s.trim().trim_end_matches('/').trim_start();
    while !rest.is_empty() {
        let end = rest
            .find(|c: char| c == '=' || c.is_whitespace())
            .unwrap_or(rest.len());
        let name = rest[..end].to_owned();
        rest = &rest[end..];
        if let Some(r) = rest.strip_prefix("=\"") {
            let close = r.find('"').expect("a closing quote");
            out.insert(name, unescape(&r[..close]));
            rest = r[close + 1..].trim_start();
        } else {
            out.insert(name, String::new());
            rest = rest.trim_start();
        }
    }
    out
}

/// Plain text of a piece of HTML: tags dropped, entities decoded.
fn text(html: &str) -> String {
    let mut out = String::new();
    let mut in_tag = false;
    for c in html.chars() {
        match c {
            '<' => in_tag = true,
            '>' if in_tag => in_tag = false,
            c if !in_tag => out.push(c),
            _ => {}
        }
    }
    unescape(&out)
}

struct Page {
    html: String,
    path: PathBuf,
}

impl Page {
    fn read(path: &Path) -> Page {
        let html = std::fs::read_to_string(path)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        Page {
            html,
            path: path.to_owned(),
        }
    }

    fn dir(&self) -> &Path {
        self.path.parent().unwrap()
    }

    /// Start tags named `name`, in document order.
    fn tags(&self, name: &str) -> Vec<Tag> {
        let open = format!("<{name}");
        let mut out = Vec::new();
        for (at, _) in self.html.match_indices(&open) {
            let after = &self.html[at + open.len()..];
            if !after.starts_with([' ', '>']) {
                continue;
            }
            let end = after.find('>').expect("a tag ends");
            out.push(Tag {
                at,
                attrs: parse_attrs(&after[..end]),
            });
        }
        out
    }

    /// Every element with `id`, by id; each id must be unique.
    fn ids(&self) -> BTreeMap<String, usize> {
        let mut ids = BTreeMap::new();
        for (at, _) in self.html.match_indices(" id=\"") {
            let rest = &self.html[at + 5..];
            let id = unescape(&rest[..rest.find('"').unwrap()]);
            assert!(
                ids.insert(id.clone(), at).is_none(),
                "{}: id {id:?} twice",
                self.path.display()
            );
        }
        ids
    }

    fn by_id(&self, tag: &str, id: &str) -> Option<Tag> {
        let found: Vec<Tag> = self
            .tags(tag)
            .into_iter()
            .filter(|t| t.attrs.get("id").map(String::as_str) == Some(id))
            .collect();
        assert!(found.len() <= 1, "<{tag} id={id:?}> {} times", found.len());
        found.into_iter().next()
    }

    #[track_caller]
    fn must(&self, tag: &str, id: &str) -> Tag {
        self.by_id(tag, id)
            .unwrap_or_else(|| panic!("no <{tag} id={id:?}> in {}", self.path.display()))
    }

    /// The byte range of the element whose start tag is at `at`, through its end tag,
    /// counting nested elements of the same name.
    fn range(&self, at: usize) -> std::ops::Range<usize> {
        let name: String = self.html[at + 1..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric())
            .collect();
        let (open, close) = (format!("<{name}"), format!("</{name}>"));
        let next_open = |from: usize| {
            let mut j = from;
            while let Some(p) = self.html[j..].find(&open).map(|p| p + j) {
                if self.html[p + open.len()..].starts_with([' ', '>']) {
                    return Some(p);
                }
                j = p + 1;
            }
            None
        };
        let mut depth = 0usize;
        let mut i = at;
        loop {
            let close_at = self.html[i..]
                .find(&close)
                .map(|p| p + i)
                .expect("an end tag");
            match next_open(i) {
                Some(o) if o < close_at => {
                    depth += 1;
                    i = o + 1;
                }
                _ => {
                    depth -= 1;
                    i = close_at + close.len();
                    if depth == 0 {
                        return at..i;
                    }
                }
            }
        }
    }

    fn element(&self, at: usize) -> &str {
        &self.html[self.range(at)]
    }

    /// The number in the cell with this id.
    #[track_caller]
    fn number(&self, id: &str) -> u64 {
        let cell = self.must("td", id);
        let t = text(self.element(cell.at));
        t.trim()
            .parse()
            .unwrap_or_else(|_| panic!("cell {id} holds {t:?}"))
    }

    /// The cells of the cost table's row for `step`: name, tasks, succeeded, failed, blocked,
    /// pending, reused, planned, billed, possibly billed.
    fn step_row(&self, step: &str) -> Option<Vec<String>> {
        let rows: Vec<Tag> = self
            .tags("tr")
            .into_iter()
            .filter(|t| t.attrs.get("data-step").map(String::as_str) == Some(step))
            .filter(|t| !t.classes().contains("total"))
            .collect();
        assert!(rows.len() <= 1, "{} rows for step {step}", rows.len());
        let row = rows.first()?;
        let html = self.element(row.at);
        Some(
            html.split("<td")
                .skip(1)
                .map(|c| text(&format!("<td{c}")).trim().to_owned())
                .collect(),
        )
    }

    /// Where a link or image source of the page leads, as a file path, resolved as a browser
    /// resolves a relative URL against the page's own (as opened) location: `..` drops the
    /// segment before it, whatever symbolic links the directories are.
    fn target(&self, href: &str) -> PathBuf {
        assert!(!href.contains("://"), "not relative: {href}");
        assert!(!href.starts_with('/'), "not relative: {href}");
        use std::os::unix::ffi::OsStringExt;
        let rel = PathBuf::from(std::ffi::OsString::from_vec(percent_decode(href)));
        let mut out = PathBuf::new();
        for c in self.dir().components().chain(rel.components()) {
            match c {
                std::path::Component::ParentDir => {
                    out.pop();
                }
                std::path::Component::CurDir => {}
                c => out.push(c),
            }
        }
        out
    }

    /// The `<a>`s and `<img>`s inside the element at `at`.
    fn inner(&self, at: usize, tag: &str) -> Vec<Tag> {
        let r = self.range(at);
        self.tags(tag)
            .into_iter()
            .filter(|t| r.contains(&t.at))
            .collect()
    }

    fn has_table(&self, id: &str) -> bool {
        self.by_id("table", id).is_some()
    }

    /// The task ids the table `id` links to (`#tID`).
    fn linked_tasks(&self, table: &str) -> BTreeSet<i64> {
        let t = self.must("table", table);
        self.inner(t.at, "a")
            .iter()
            .map(|a| {
                a.attr("href")
                    .strip_prefix("#t")
                    .unwrap_or_else(|| panic!("{a:?}"))
                    .parse()
                    .unwrap()
            })
            .collect()
    }

    /// The plain text of the element with this id.
    fn text_of(&self, tag: &str, id: &str) -> String {
        text(self.element(self.must(tag, id).at))
    }

    /// The value of one fact of the header (`<dt>` name).
    fn fact(&self, name: &str) -> String {
        let key = format!("<dt>{name}</dt><dd>");
        let at = self
            .html
            .find(&key)
            .unwrap_or_else(|| panic!("no fact {name}"));
        let rest = &self.html[at + key.len()..];
        unescape(&rest[..rest.find("</dd>").unwrap()])
    }
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

fn has_transparency(path: &Path) -> bool {
    decode(path).to_rgba8().pixels().any(|p| p[3] < 255)
}

/// What a page and the run it shows agree on, whatever the run: the marker, unique ids, every
/// `#` link landing on an element, every task of the run once and in its item's section
/// (under the output it reads), every recorded output as a figure whose links lead to its file
/// and to a small thumbnail named after its digest, placeholders for tasks without outputs,
/// the cost table against the database, and the problem tables when, and only when, there are
/// problems. Returns the thumbnails the page shows.
#[track_caller]
fn assert_page_agrees(page: &Page, db: &Db, run: &str) -> BTreeSet<PathBuf> {
    let html = &page.html;
    let path = page.path.display();
    assert!(
        html.starts_with("<!DOCTYPE html>\n<!-- imgpipe run report -->\n"),
        "{path}: {}",
        &html[..html.len().min(200)]
    );
    assert!(html.trim_end().ends_with("</html>"), "{path} is cut short");
    let ids = page.ids();
    for a in page.tags("a") {
        if let Some(frag) = a.attrs.get("href").and_then(|h| h.strip_prefix('#')) {
            assert!(
                ids.contains_key(frag),
                "{path}: link to #{frag} leads nowhere"
            );
        }
    }
    assert_eq!(
        page.text_of("span", "run-status"),
        db.the_run().status,
        "{path}"
    );

    // Every task once, in its item's section, under the output it reads.
    let run_dir = db.the_run().output_dir.join(run);
    let mut thumbs = BTreeSet::new();
    for t in db.live() {
        let div = page.must("div", &format!("t{}", t.id));
        let classes = div.classes();
        assert!(classes.contains("task"), "{div:?}");
        assert!(
            classes.contains(format!("st-{}", t.status).as_str()),
            "t{} is {} in the database: {div:?}",
            t.id,
            t.status
        );
        let section = page.must("section", &format!("item-{}", t.item));
        assert!(section.classes().contains("item"), "{section:?}");
        assert!(
            page.range(section.at).contains(&div.at),
            "{}/{}[{}] lies outside its item's section",
            t.item,
            t.step,
            t.idx
        );
        // The first input of its own item is the output it hangs under.
        let parent = t.inputs.iter().find_map(|i| {
            let (key, index) = i.strip_suffix(']')?.rsplit_once('[')?;
            let (item, step) = key.split_once('/')?;
            let index: i64 = index.parse().ok()?;
            (item == t.item).then_some(())?;
            let p = db
                .live()
                .filter(|p| p.item == item && p.step == step && p.idx <= index)
                .max_by_key(|p| p.idx)?;
            Some((p, index - p.idx))
        });
        if let Some((p, k)) = parent {
            let pdiv = page.must("div", &format!("t{}", p.id));
            assert!(
                page.range(pdiv.at).contains(&div.at),
                "t{} is not drawn under t{}, the task it reads",
                t.id,
                p.id
            );
            if let Some(fig) = page.by_id("figure", &format!("o{}-{k}", p.id)) {
                assert!(
                    div.at > fig.at,
                    "t{} comes before the output it reads",
                    t.id
                );
                if let Some(next) = page.by_id("figure", &format!("o{}-{}", p.id, k + 1)) {
                    assert!(
                        div.at < next.at,
                        "t{} is under the wrong output of t{}",
                        t.id,
                        p.id
                    );
                }
            }
        }
        let outputs = db.outputs_of(t.id);
        let task_html = page.element(div.at);
        if outputs.is_empty() {
            assert!(
                task_html.contains(&format!(
                    "<div class=\"thumb none\"><span class=\"badge b-{0}\">{0}</span>",
                    t.status
                )),
                "t{} has no output and no placeholder: {}",
                t.id,
                &task_html[..task_html.len().min(600)]
            );
        }
        for o in outputs {
            let fig = page.must("figure", &format!("o{}-{}", t.id, o.k));
            assert!(
                page.range(div.at).contains(&fig.at),
                "{fig:?} outside t{}",
                t.id
            );
            let fig_html = page.element(fig.at);
            let Some(file) = &o.path else {
                let badge = if o.download_error.is_some() {
                    "not downloaded"
                } else {
                    "downloading"
                };
                assert!(fig_html.contains(badge), "{fig_html}");
                assert!(page.inner(fig.at, "img").is_empty(), "{fig_html}");
                continue;
            };
            let file = run_dir.join(file);
            // The picture's own link; "also reads" links to other figures follow it.
            let links: Vec<Tag> = page
                .inner(fig.at, "a")
                .into_iter()
                .filter(|a| a.classes().contains("thumb"))
                .collect();
            assert_eq!(links.len(), 1, "{fig_html}");
            let a = &links[0];
            let full = page.target(a.attr("href"));
            if !file.exists() {
                // A file gone from disk: its link still names it.
                assert_eq!(
                    full.canonicalize().ok(),
                    None,
                    "{:?} leads to a file",
                    a.attr("href")
                );
                continue;
            }
            assert!(
                same_file(&full, &file),
                "{path}: {} leads to {}, not to {}",
                a.attr("href"),
                full.display(),
                file.display()
            );
            let imgs = page.inner(fig.at, "img");
            assert_eq!(imgs.len(), 1, "{fig_html}");
            let img = &imgs[0];
            let thumb = page.target(img.attr("src"));
            let sha = o.sha256.as_deref().unwrap();
            let expected = run_dir.join("_thumbs").join(format!("{}.png", &sha[..32]));
            assert!(
                same_file(&thumb, &expected),
                "{path}: thumbnail {} of {} is not {}",
                img.attr("src"),
                file.display(),
                expected.display()
            );
            let small = decode(&thumb);
            let big = decode(&file);
            let (w, h) = (small.width(), small.height());
            assert!(w.max(h) <= 256, "{}: {w}x{h}", thumb.display());
            if big.width().max(big.height()) <= 256 {
                assert_eq!(
                    (w, h),
                    (big.width(), big.height()),
                    "small images kept as they are"
                );
            } else {
                assert_eq!(w.max(h), 256, "{}: {w}x{h}", thumb.display());
                let ratio = |a: u32, b: u32| f64::from(a) / f64::from(b);
                assert!(
                    (ratio(w, h) - ratio(big.width(), big.height())).abs() < 0.05,
                    "aspect kept: {w}x{h} of {}x{}",
                    big.width(),
                    big.height()
                );
            }
            assert_eq!(img.attr("width"), w.to_string(), "{img:?}");
            assert_eq!(img.attr("height"), h.to_string(), "{img:?}");
            assert_eq!(
                a.classes().contains("alpha"),
                has_transparency(&file),
                "{}: alpha mark against the pixels",
                file.display()
            );
            thumbs.insert(expected);
        }
    }

    // Each item's heading says what its tasks were billed.
    let items: BTreeSet<&str> = db.live().map(|t| t.item.as_str()).collect();
    for item in items {
        let billed: u64 = db.live().filter(|t| t.item == item).map(|t| t.billed).sum();
        let section = page.element(page.must("section", &format!("item-{item}")).at);
        assert!(
            section.contains(&format!("<span class=\"badge\">{billed} cr</span>")),
            "{path}: {item} billed {billed}"
        );
    }

    // Costs.
    let n = |s: &str| page.number(&format!("total-{s}"));
    let live: Vec<&TaskRow> = db.live().collect();
    let count = |st: &[&str]| {
        live.iter()
            .filter(|t| st.contains(&t.status.as_str()))
            .count() as u64
    };
    assert_eq!(n("tasks"), live.len() as u64, "{path}");
    assert_eq!(n("succeeded"), count(&["succeeded"]), "{path}");
    assert_eq!(n("failed"), count(&["failed"]), "{path}");
    assert_eq!(n("blocked"), count(&["blocked"]), "{path}");
    assert_eq!(n("pending"), count(&["pending", "running"]), "{path}");
    assert_eq!(
        n("reused"),
        live.iter().filter(|t| t.reused_from.is_some()).count() as u64
    );
    assert_eq!(n("planned"), db.planned(), "{path}: planned");
    assert_eq!(
        n("billed"),
        db.billed(),
        "{path}: billed against the attempts"
    );
    let at_risk: u64 = db
        .ambiguous()
        .iter()
        .map(|a| db.task(a.task_id).planned)
        .sum();
    // While the run goes on, a call in flight (no outcome yet) may count as at risk or not.
    let settled: Vec<&AttemptRow> = db
        .ambiguous()
        .into_iter()
        .filter(|a| a.outcome.is_some())
        .collect();
    let settled_risk: u64 = settled.iter().map(|a| db.task(a.task_id).planned).sum();
    let running = db.the_run().status == "running";
    assert!(
        n("at-risk") == at_risk || (running && n("at-risk") == settled_risk),
        "{path}: possibly billed {} against {at_risk}",
        n("at-risk")
    );
    let steps: BTreeSet<&str> = live.iter().map(|t| t.step.as_str()).collect();
    for step in &steps {
        let row = page
            .step_row(step)
            .unwrap_or_else(|| panic!("{path}: no cost row for {step}"));
        let of: Vec<&&TaskRow> = live.iter().filter(|t| t.step == *step).collect();
        let ids: BTreeSet<i64> = of.iter().map(|t| t.id).collect();
        let num = |i: usize| row[i].parse::<u64>().unwrap();
        assert_eq!(row[0], *step);
        assert_eq!(num(1), of.len() as u64, "{step}: {row:?}");
        assert_eq!(
            num(7),
            of.iter().map(|t| t.planned).sum::<u64>(),
            "{step} planned: {row:?}"
        );
        let billed: u64 = db
            .attempts
            .iter()
            .filter(|a| ids.contains(&a.task_id))
            .map(|a| a.billed)
            .sum();
        assert_eq!(num(8), billed, "{step} billed: {row:?}");
    }
    let svg = page.tags("svg");
    assert_eq!(svg.len(), 1, "{path}: one chart");
    assert!(
        html.contains(&format!("Credits billed over time: {} in all", db.billed())),
        "{path}: the chart's total"
    );

    // Problems, when and only when there are some.
    let troubled: BTreeSet<i64> = live
        .iter()
        .filter(|t| matches!(t.status.as_str(), "failed" | "blocked"))
        .map(|t| t.id)
        .collect();
    assert_eq!(page.has_table("failures"), !troubled.is_empty(), "{path}");
    if !troubled.is_empty() {
        assert_eq!(page.linked_tasks("failures"), troubled, "{path}");
    }
    if !running || settled.len() == db.ambiguous().len() {
        assert_eq!(
            page.has_table("possibly-billed"),
            !db.ambiguous().is_empty(),
            "{path}"
        );
    }
    let failed_downloads = db
        .outputs
        .iter()
        .filter(|o| o.path.is_none() && o.download_error.is_some())
        .count();
    assert_eq!(
        page.has_table("failed-downloads"),
        failed_downloads > 0,
        "{path}"
    );
    thumbs
}

/// The names of the files in `<run dir>/_thumbs`, which must all be finished PNGs named by a
/// 32-hex-digit digest prefix.
fn thumb_files(run_dir: &Path) -> BTreeSet<String> {
    let dir = run_dir.join("_thumbs");
    if !dir.exists() {
        return BTreeSet::new();
    }
    entries(&dir)
        .iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            let stem = name
                .strip_suffix(".png")
                .unwrap_or_else(|| panic!("{name}"));
            assert!(
                stem.len() == 32 && stem.chars().all(|c| c.is_ascii_hexdigit()),
                "stray file in _thumbs: {name}"
            );
            decode(p);
            name
        })
        .collect()
}

/// The run's record, and its page at `out/RUN/report.html` held against it.
async fn record_and_page(dir: &Path, run: &str) -> (Db, Page) {
    let db = read_db(dir, run).await;
    let page = Page::read(&dir.join("out").join(run).join("report.html"));
    assert_page_agrees(&page, &db, run);
    (db, page)
}

/// The thumbnail names the database's outputs call for.
fn wanted_thumbs(db: &Db) -> BTreeSet<String> {
    db.downloaded()
        .iter()
        .map(|o| format!("{}.png", &o.sha256.as_deref().unwrap()[..32]))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// 1. The sample's full chain, with --sandbox --report
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn product_shots_report_links_every_output_and_its_costs_are_the_records_and_the_bill() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    copy_sample(dir, "product-shots.yaml");
    let mut run = cmd(
        None,
        dir,
        dir,
        &[
            "run",
            "--sandbox",
            "product-shots.yaml",
            "--report",
            "--json",
            "--run-id",
            "full",
            "--rate",
            "100/s",
        ],
    );
    // The embedded sandbox's images 64 pixels a side at 2K (a test-only setting): the links,
    // thumbnails and costs checked here name no size.
    run.env("IMGPIPE_TEST_SANDBOX_IMAGE_SIDE", "64");
    let o = finish(run).await;
    assert_exit_without_panic(&o, 0);
    let summary = json_stdout(&o);
    let run_dir = dir.join("out").join("full");
    let report = run_dir.join("report.html");
    assert!(
        stderr(&o).contains(&format!("report written to {}", report.display())),
        "{}",
        stderr(&o)
    );
    assert!(run_dir.join("manifest.jsonl").is_file());
    let db = read_db(dir, "full").await;
    assert_eq!(db.the_run().status, "succeeded");
    assert_eq!(db.outputs.len(), 30, "{:#?}", db.outputs);
    assert_eq!(db.downloaded().len(), 30);

    let page = Page::read(&report);
    let thumbs = assert_page_agrees(&page, &db, "full");
    assert_eq!(thumbs.len(), wanted_thumbs(&db).len());
    // Every thumbnail the run called for, and nothing else, in _thumbs.
    assert_eq!(thumb_files(&run_dir), wanted_thumbs(&db));

    // The money: the page, the database and the sandbox's balance all say 120.
    let spent =
        summary["balance_before"].as_i64().unwrap() - summary["balance_after"].as_i64().unwrap();
    assert_eq!(spent, 120, "{summary:#}");
    assert_eq!(db.billed(), 120);
    assert_eq!(page.number("total-billed"), 120);
    assert_eq!(page.number("total-planned"), 120);
    assert_eq!(page.number("total-planned"), db.the_run().credits_planned);
    assert_eq!(
        (db.the_run().balance_before, db.the_run().balance_after),
        (
            summary["balance_before"].as_i64(),
            summary["balance_after"].as_i64()
        )
    );
    assert_eq!(page.number("total-tasks"), 27);
    assert_eq!(page.number("total-succeeded"), 27);
    for s in ["failed", "blocked", "pending", "reused", "at-risk"] {
        assert_eq!(page.number(&format!("total-{s}")), 0, "{s}");
    }
    // Steps in chain order, each at its own price: shot 3 × 8, then 6 of each tool.
    let order: Vec<String> = page
        .tags("tr")
        .iter()
        .filter_map(|t| t.attrs.get("data-step").cloned())
        .collect();
    assert_eq!(order, ["shot", "clean", "wide", "big", "cutout", "total"]);
    let row = page.step_row("shot").unwrap();
    assert_eq!(row[1..], ["3", "3", "0", "0", "0", "0", "24", "24", "0"]);
    let row = page.step_row("cutout").unwrap();
    assert_eq!(row[1..], ["6", "6", "0", "0", "0", "0", "30", "30", "0"]);

    // Cut-outs are drawn on a checkerboard; generations are not.
    for t in db.live() {
        for out in db.outputs_of(t.id) {
            let a = &page.inner(page.must("figure", &format!("o{}-{}", t.id, out.k)).at, "a")[0];
            match t.step.as_str() {
                "cutout" => assert!(a.classes().contains("alpha"), "{t:?}"),
                "shot" => assert!(!a.classes().contains("alpha"), "{t:?}"),
                _ => {}
            }
        }
    }
    // Each shot's two outputs fan out, each into its own chain of four.
    for item in ["mug", "lamp", "chair"] {
        let shot = find(&db, item, "shot", 0);
        let div = page.must("div", &format!("t{}", shot.id));
        assert!(div.classes().contains("fan"), "{div:?}");
        let section = page.element(page.must("section", &format!("item-{item}")).at);
        assert_eq!(section.matches("<figure id=").count(), 10, "{item}");
    }
    assert!(!page.has_table("failures"));
    assert!(!page.has_table("possibly-billed"));
    assert!(!page.has_table("failed-downloads"));
    assert!(page.html.contains("Problems (0)"), "nav says no problems");
    assert!(
        !page.html.contains("class=\"banner\""),
        "no in-progress banner"
    );
    assert_eq!(page.fact("Images on disk"), "30");
    assert_eq!(page.fact("Tasks done"), "27 of 27");
    assert_eq!(page.fact("Credits billed"), "120 of 120 planned");
    assert_eq!(page.fact("Balance"), "1000 before, 880 after");
}

// ---------------------------------------------------------------------------------------------
// 2. From elsewhere, again, and over files that are not reports
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn report_from_another_directory_links_relative_to_its_out_and_never_replaces_a_user_file() {
    let env = after_run_r(2, &["--report"]).await;
    let dir = env.dir.path();
    let (db, first) = record_and_page(dir, "r").await;
    let requests = env.sandbox.stats().api_requests;

    // From another working directory, to a relative --out in a directory not made yet.
    let elsewhere = dir.join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    let report = |args: &[&str]| {
        let mut all = vec!["report"];
        all.extend_from_slice(args);
        finish(cmd(Some(&env), dir, &elsewhere, &all))
    };
    let o = report(&["r", "--out", "../reports/r.html", "--json"]).await;
    assert_exit_without_panic(&o, 0);
    let written = json_stdout(&o);
    let out = dir.join("reports/r.html");
    // (The path is printed as given, `elsewhere/../reports/r.html`: the same file.)
    assert!(
        same_file(Path::new(written["path"].as_str().unwrap()), &out),
        "{written:#}"
    );
    assert_eq!(written["run_id"], "r");
    assert_eq!(written["status"], "succeeded");
    assert_eq!(written["images"], 6);
    assert_eq!(
        written["thumbnails_made"], 0,
        "the run's own report made them all"
    );
    assert_eq!(
        written["bytes"].as_u64().unwrap(),
        std::fs::metadata(&out).unwrap().len()
    );
    let page = Page::read(&out);
    assert!(
        page.html.contains("href=\"../out/r/i00/clean.png\""),
        "links relative to the page's directory"
    );
    assert_page_agrees(&page, &db, "r");
    assert_eq!(
        std::fs::read_to_string(&first.path).unwrap(),
        first.html,
        "the run's own report untouched"
    );

    // Again: its own earlier report is replaced, and no thumbnail made again.
    std::fs::write(&out, format!("{}<!-- a user's note -->", page.html)).unwrap();
    let o = report(&["r", "--out", out.to_str().unwrap()]).await;
    assert_exit_without_panic(&o, 0);
    assert!(
        stdout(&o).starts_with(&format!(
            "report of run r (succeeded): {} (6 images, 0 new thumbnails)",
            out.display()
        )),
        "{}",
        stdout(&o)
    );
    let again = std::fs::read_to_string(&out).unwrap();
    assert!(
        !again.contains("a user's note"),
        "the earlier report was replaced"
    );
    assert_page_agrees(&Page::read(&out), &db, "r");

    // A file of the user's, a directory, a file that merely mentions reports: left alone.
    let notes = dir.join("reports/notes.html");
    let mine = b"<html><body>my notes on imgpipe run report</body></html>\n".to_vec();
    std::fs::write(&notes, &mine).unwrap();
    let before = entries(&dir.join("reports"));
    for target in [&notes, &dir.join("reports")] {
        let o = report(&["r", "--out", target.to_str().unwrap()]).await;
        assert_exit_without_panic(&o, 2);
        let err = stderr(&o);
        assert!(err.contains("is not an imgpipe report"), "{err}");
        assert!(err.contains("left as it is"), "{err}");
        assert!(stdout(&o).is_empty(), "{}", stdout(&o));
    }
    assert_eq!(std::fs::read(&notes).unwrap(), mine, "byte for byte");
    assert_eq!(
        entries(&dir.join("reports")),
        before,
        "no temporary file left"
    );

    // An unknown run: exit 2, pointing at the list, and nothing written.
    let o = report(&["nope", "--out", "../reports/nope.html"]).await;
    assert_exit_without_panic(&o, 2);
    let err = stderr(&o);
    assert!(err.contains("\"nope\""), "{err}");
    assert!(err.contains("imgpipe runs"), "{err}");
    assert_eq!(entries(&dir.join("reports")), before);
    assert_eq!(entries(&elsewhere), Vec::<PathBuf>::new());
    // Reports read the record alone: not one request.
    assert_eq!(env.sandbox.stats().api_requests, requests);
}

// ---------------------------------------------------------------------------------------------
// 3. Failures in place
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn failed_tasks_show_their_reason_in_place_their_chain_blocked_and_the_run_exits_4() {
    let env = start(config()).await;
    let dir = env.dir.path();
    // i01 names a sample the sandbox does not have: its erase is refused (400), and its
    // upscale and cut-out are blocked.
    let pipeline = edit_chain(3, None).replace("lamp.png", "nope.png");
    write(dir, "p.yaml", &pipeline);
    let o = run_chain(&env, "f", &["--report"]).await;
    assert_exit_without_panic(&o, 4);
    let err = stderr(&o);
    assert!(err.contains("report written to"), "{err}");
    let (db, page) = record_and_page(dir, "f").await;
    assert_eq!(db.the_run().status, "failed");
    assert_eq!(
        (db.count("failed"), db.count("blocked")),
        (1, 2),
        "{:#?}",
        db.tasks
    );

    let failed = find(&db, "i01", "clean", 0);
    let reason = failed.error.as_deref().unwrap();
    assert!(
        reason.contains("no sample image named") && reason.contains("nope"),
        "{reason}"
    );
    let div = page.must("div", &format!("t{}", failed.id));
    let placeholder = text(page.element(div.at));
    assert!(placeholder.contains(reason), "{placeholder}");
    // The reason (the service's JSON body) is escaped, not markup.
    assert!(reason.contains("{\"error\":"), "{reason}");
    assert!(page.element(div.at).contains("{&quot;error&quot;:"));
    for step in ["big", "cutout"] {
        let t = find(&db, "i01", step, 0);
        assert_eq!(t.status, "blocked");
        let d = page.must("div", &format!("t{}", t.id));
        assert!(d.classes().contains("st-blocked"), "{d:?}");
        assert!(
            page.range(div.at).contains(&d.at),
            "{step} is drawn after the failed erase, in place"
        );
        let why = t.error.as_deref().unwrap();
        assert!(text(page.element(d.at)).contains(why), "{why}");
    }
    // The other items are whole, with pictures.
    for item in ["i00", "i02"] {
        let section = page.element(page.must("section", &format!("item-{item}")).at);
        assert_eq!(section.matches("<img ").count(), 3, "{item}");
        assert!(!section.contains("b-failed"), "{item}");
    }
    let rows = page.element(page.must("table", "failures").at);
    assert!(rows.contains(&format!("<a href=\"#t{}\">i01/clean[0]</a>", failed.id)));
    assert!(rows.contains("b-blocked"));
    assert!(page.html.contains("Problems (3)"));
    assert_eq!(page.number("total-failed"), 1);
    assert_eq!(page.number("total-blocked"), 2);
    assert_eq!(page.number("total-billed"), 18);
    assert_eq!(page.number("total-planned"), 27);
    let item = page.element(page.must("section", "item-i01").at);
    assert!(has_phrase(item, "1 failed"), "{item}");
    assert!(has_phrase(item, "2 blocked"), "{item}");
}

#[tokio::test(flavor = "multi_thread")]
async fn calls_that_may_have_been_billed_and_failed_downloads_are_listed_with_links() {
    // One call at a time, with the second call's answer dropped after billing, and
    // --on-ambiguous fail: i00/big fails possibly billed and i00/cutout is blocked.
    let seed = seed_for(0.5, &[false, true, false, false, false, false]);
    let env = start(sandbox::Config {
        faults: Faults {
            drop_after_billing: 0.5,
            seed,
            ..Faults::default()
        },
        ..config()
    })
    .await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(2, None));
    let args = ["--report", "--concurrency", "1", "--on-ambiguous", "fail"];
    assert_exit_without_panic(&run_chain(&env, "a", &args).await, 4);
    let (db, page) = record_and_page(dir, "a").await;
    let big = find(&db, "i00", "big", 0);
    assert_eq!(big.status, "failed", "{:#?}", db.tasks);
    assert_eq!(db.ambiguous().len(), 1);
    assert_eq!(
        page.linked_tasks("possibly-billed"),
        BTreeSet::from([big.id])
    );
    // What may have been billed is what the sandbox billed and never delivered.
    let undelivered: u64 = env
        .sandbox
        .ledger()
        .iter()
        .filter(|e| !e.delivered)
        .map(|e| e.credits)
        .sum();
    assert_eq!(undelivered, 2);
    assert_eq!(page.number("total-at-risk"), undelivered);
    assert_eq!(page.fact("Possibly billed"), "2 more");
    let table = text(page.element(page.must("table", "possibly-billed").at));
    assert!(table.contains("may have been paid for nothing"), "{table}");

    // Every download cut short: the calls are paid, the files are not there.
    let env = start(sandbox::Config {
        faults: Faults {
            truncate_download: 1.0,
            seed: 1,
            ..Faults::default()
        },
        ..config()
    })
    .await;
    let dir = env.dir.path();
    write(
        dir,
        "p.yaml",
        "version: 1\nname: one\noutput_dir: out\nitems:\n  - { id: a }\n  - { id: b }\nsteps:\n  - id: clean\n    erase: { image_url: \"https://sandbox.invalid/assets/mug.png\", object_name: x }\n",
    );
    assert_exit_without_panic(&run_chain(&env, "d", &["--report"]).await, 4);
    let (db, page) = record_and_page(dir, "d").await;
    assert_eq!(db.count("succeeded"), 2);
    assert!(
        db.outputs.iter().all(|o| o.download_error.is_some()),
        "{:#?}",
        db.outputs
    );
    let table = page.element(page.must("table", "failed-downloads").at);
    for t in db.live() {
        assert!(table.contains(&format!("href=\"#o{}-0\"", t.id)), "{table}");
    }
    assert_eq!(page.fact("Images on disk"), "0");
    assert_eq!(thumb_files(&dir.join("out/d")), BTreeSet::new());
}

// ---------------------------------------------------------------------------------------------
// 4. A run in progress, then finished; a run interrupted, then resumed
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn a_report_of_a_run_in_progress_shows_what_is_done_and_what_waits_then_the_finished_run() {
    // One call at a time, four let through the sandbox's gate: the run is caught with its
    // fifth call held in flight, and held still (SIGSTOP) while the report is made, so what it
    // shows is exactly the record.
    let env = start_with_chain(config(), 3).await;
    let dir = env.dir.path();
    let hold = env.sandbox.hold();
    env.sandbox.let_through(4);
    let child = one_at_a_time(&env, "g", &[]).spawn().unwrap();
    wait_until_async(
        "four calls billed, three files and the fifth call held",
        || async {
            let held = env.sandbox.ledger().len() == 4 && env.sandbox.held_calls() == 1;
            held && progress(dir, "g").await.is_some_and(|(_, n)| n >= 3)
        },
    )
    .await;
    signal(&child, libc::SIGSTOP);
    let stat = format!("/proc/{}/stat", child.id().unwrap());
    wait_until_async("the run to stop", || async {
        // `pid (comm) STATE ...`: T when stopped.
        let s = std::fs::read_to_string(&stat).unwrap_or_default();
        s.rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('T'))
    })
    .await;
    let o = ip(Some(&env), dir, &["report", "g", "--json"]).await;
    // The record as the report saw it, before the run goes on.
    let db = read_db(dir, "g").await;
    signal(&child, libc::SIGCONT);
    drop(hold);
    assert_exit_without_panic(&o, 0);
    assert_eq!(db.the_run().status, "running");
    let first = json_stdout(&o);
    assert_eq!(first["status"], "running", "{first:#}");
    let page = Page::read(&dir.join("out/g/report.html"));
    assert_page_agrees(&page, &db, "g");
    assert!(
        page.html.contains("class=\"banner\""),
        "the in-progress banner"
    );
    assert!(page.html.contains("still going"));
    assert!(page.fact("Running for").ends_with(" s"));
    let done = db.count("succeeded");
    assert!((4..9).contains(&done), "{:#?}", db.tasks);
    assert_eq!(page.number("total-pending"), (9 - done) as u64);
    assert!(page.html.matches("<img ").count() >= 3);
    assert!(
        page.html
            .contains("b-pending\">pending</span><span class=\"why\">waiting its turn")
    );
    // The call caught in flight: a task running, its call not settled.
    let running: Vec<&TaskRow> = db.live().filter(|t| t.status == "running").collect();
    assert_eq!(running.len(), 1, "{:#?}", db.tasks);
    let div = page.must("div", &format!("t{}", running[0].id));
    assert!(text(page.element(div.at)).contains("a call is in flight"));
    assert_eq!(
        first["thumbnails_made"].as_u64().unwrap() as usize,
        wanted_thumbs(&db).len()
    );

    assert_exit_without_panic(&ended(child).await, 0);
    let o = ip(Some(&env), dir, &["report", "g", "--json"]).await;
    assert_exit_without_panic(&o, 0);
    let second = json_stdout(&o);
    let (db, page) = record_and_page(dir, "g").await;
    assert_eq!(db.the_run().status, "succeeded");
    assert!(!page.html.contains("class=\"banner\""));
    assert_eq!(page.number("total-pending"), 0);
    assert!(!page.html.contains("badge b-pending\""));
    assert!(!page.html.contains("badge b-running\""));
    assert_eq!(page.html.matches("<img ").count(), 9);
    // Only the new images were decoded the second time.
    let all = thumb_files(&dir.join("out/g"));
    assert_eq!(all, wanted_thumbs(&db));
    assert_eq!(
        first["thumbnails_made"].as_u64().unwrap() + second["thumbnails_made"].as_u64().unwrap(),
        all.len() as u64
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_interrupted_run_reports_itself_and_its_resume_replaces_the_report() {
    let env = start_with_chain(sandbox_with_latency(60), 3).await;
    let dir = env.dir.path();
    let run = one_at_a_time(&env, "s", &["--report"]);
    // Interrupted once four calls are billed.
    let o = interrupt_when(&env, run, |env| env.sandbox.ledger().len() >= 4).await;
    assert_exit_without_panic(&o, 130);
    assert!(stderr(&o).contains("report written to"), "{}", stderr(&o));
    let (db, page) = record_and_page(dir, "s").await;
    assert_eq!(db.the_run().status, "interrupted");
    let pending = db.count("pending");
    assert!(pending > 0, "{:#?}", db.tasks);
    assert_eq!(page.number("total-pending"), pending as u64);
    assert!(
        !page.html.contains("class=\"banner\""),
        "not in progress: interrupted"
    );
    assert!(page.html.contains("not run: the run ended before it"));

    let o = ip(Some(&env), dir, &["resume", "s", "--report"]).await;
    assert_exit_without_panic(&o, 0);
    assert!(stderr(&o).contains("report written to"), "{}", both(&o));
    let (db, page) = record_and_page(dir, "s").await;
    assert_eq!(db.the_run().status, "succeeded");
    assert_eq!(page.number("total-pending"), 0);
    assert_eq!(page.number("total-billed"), 27);
    assert_eq!(thumb_files(&dir.join("out/s")), wanted_thumbs(&db));
}

// ---------------------------------------------------------------------------------------------
// 5. What a demanding user does next
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn reused_outputs_say_from_which_run_and_cost_nothing() {
    let env = start_with_chain(config(), 2).await;
    assert_exit_without_panic(&run_chain(&env, "a", &[]).await, 0);
    let ledger = env.sandbox.ledger().len();
    let o = run_chain(&env, "b", &["--reuse", "--report", "--json"]).await;
    assert_exit_without_panic(&o, 0);
    assert_eq!(env.sandbox.ledger().len(), ledger, "nothing paid");
    let (db, page) = record_and_page(env.dir.path(), "b").await;
    assert!(
        db.live().all(|t| t.reused_from.is_some()),
        "{:#?}",
        db.tasks
    );
    assert_eq!(page.number("total-reused"), 6);
    assert_eq!(page.number("total-billed"), 0);
    for t in db.live() {
        let fig = page.element(page.must("figure", &format!("o{}-0", t.id)).at);
        assert!(has_phrase(&text(fig), "0 cr, reused from run a"), "{fig}");
        // The link leads to run b's own copy.
        let a = &page.inner(page.must("figure", &format!("o{}-0", t.id)).at, "a")[0];
        assert!(a.attr("href").starts_with(&format!("{}/", t.item)), "{a:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn links_survive_spaces_hashes_and_percent_signs_in_paths() {
    let env = start_with_chain(config(), 1).await;
    let dir = env.dir.path();
    let out = dir.join("my shots #1 100%");
    let o = run_chain(&env, "r", &["--out", out.to_str().unwrap(), "--report"]).await;
    assert_exit_without_panic(&o, 0);
    let db = read_db(dir, "r").await;
    let page = Page::read(&out.join("r/report.html"));
    assert_page_agrees(&page, &db, "r");
    // And from a page in a directory with odd characters of its own, the other way round.
    let odd = dir.join("ré ports?");
    let target = odd.join("a&b.html");
    let o = ip(
        Some(&env),
        dir,
        &["report", "r", "--out", target.to_str().unwrap()],
    )
    .await;
    assert_exit_without_panic(&o, 0);
    let page = Page::read(&target);
    assert!(
        page.html.contains("my%20shots%20%231%20100%25/r/"),
        "percent-encoded"
    );
    assert_page_agrees(&page, &db, "r");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_batch_step_has_its_own_section_and_items_link_to_the_references_they_read() {
    let env = start(config()).await;
    let dir = env.dir.path();
    copy_sample(dir, "style-join.yaml");
    let o = ip(
        Some(&env),
        dir,
        &[
            "run",
            "style-join.yaml",
            "--run-id",
            "j",
            "--out",
            "out",
            "--report",
        ],
    )
    .await;
    assert_exit_without_panic(&o, 0);
    let (db, page) = record_and_page(dir, "j").await;
    let sections: Vec<String> = page
        .tags("section")
        .iter()
        .filter(|s| s.classes().contains("item"))
        .map(|s| s.attr("id").to_owned())
        .collect();
    assert_eq!(
        sections,
        ["item-_batch", "item-fox", "item-owl", "item-otter"]
    );
    assert!(page.html.contains("Batch steps (run once for all items)"));
    let style = find(&db, "_batch", "style", 0);
    for item in ["fox", "owl", "otter"] {
        let portrait = find(&db, item, "portrait", 0);
        let html = page.element(page.must("div", &format!("t{}", portrait.id)).at);
        for input in &portrait.inputs {
            if let Some(k) = input
                .strip_prefix("_batch/style[")
                .and_then(|s| s.strip_suffix(']'))
            {
                assert!(
                    html.contains(&format!(
                        "<a href=\"#o{}-{k}\">_batch/style[{k}]</a>",
                        style.id
                    )),
                    "{item} names the reference it read: {html}"
                );
            } else {
                assert!(
                    html.contains(&format!("<code>{input}</code>")),
                    "{input}: {html}"
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_output_deleted_after_the_run_is_said_to_be_gone_and_the_report_still_made() {
    let env = after_run_r(2, &["--report"]).await;
    let dir = env.dir.path();
    let db = read_db(dir, "r").await;
    let run_dir = dir.join("out/r");
    let cutout = find(&db, "i00", "cutout", 0);
    let clean = find(&db, "i01", "clean", 0);
    // One file deleted after its thumbnail was made, one before any was.
    std::fs::remove_file(run_dir.join("i00/cutout.png")).unwrap();
    std::fs::remove_dir_all(run_dir.join("_thumbs")).unwrap();
    let o = ip(Some(&env), dir, &["report", "r"]).await;
    assert_exit_without_panic(&o, 0);
    std::fs::remove_file(run_dir.join("i01/clean.png")).unwrap();
    let o = ip(Some(&env), dir, &["report", "r", "--json"]).await;
    assert_exit_without_panic(&o, 0);
    let written = json_stdout(&o);
    assert_eq!(written["thumbnails_made"], 0);
    let page = Page::read(&run_dir.join("report.html"));
    assert_page_agrees(&page, &db, "r");
    let fig = |t: &TaskRow| text(page.element(page.must("figure", &format!("o{}-0", t.id)).at));
    assert!(fig(cutout).contains("not on disk"), "{}", fig(cutout));
    assert!(fig(clean).contains("no longer on disk"), "{}", fig(clean));
}

/// The header's "Images on disk" counts recorded paths, not files on disk.
#[tokio::test(flavor = "multi_thread")]
async fn images_on_disk_does_not_count_a_file_deleted_after_the_run() {
    let env = after_run_r(2, &[]).await;
    let dir = env.dir.path();
    std::fs::remove_file(dir.join("out/r/i00/cutout.png")).unwrap();
    let o = ip(Some(&env), dir, &["report", "r", "--json"]).await;
    assert_exit_without_panic(&o, 0);
    assert_eq!(json_stdout(&o)["images"], 5);
    let page = Page::read(&dir.join("out/r/report.html"));
    assert_eq!(
        page.fact("Images on disk"),
        "5",
        "one of the six files is gone"
    );
}

/// A file replaced on disk after a report was made keeps showing the old picture (the
/// thumbnail of its recorded digest), with no word that it changed, although the module says
/// "a file changed on disk never shows the old picture".
#[tokio::test(flavor = "multi_thread")]
async fn a_file_changed_after_an_earlier_report_does_not_show_the_old_picture() {
    let env = after_run_r(2, &["--report"]).await;
    let dir = env.dir.path();
    let db = read_db(dir, "r").await;
    let run_dir = dir.join("out/r");
    // The user replaces i01's cleaned picture with i00's.
    let other = std::fs::read(run_dir.join("i00/clean.png")).unwrap();
    std::fs::write(run_dir.join("i01/clean.png"), &other).unwrap();
    let o = ip(Some(&env), dir, &["report", "r"]).await;
    assert_exit_without_panic(&o, 0);
    let page = Page::read(&run_dir.join("report.html"));
    let t = find(&db, "i01", "clean", 0);
    let fig = page.must("figure", &format!("o{}-0", t.id));
    let img = &page.inner(fig.at, "img")[0];
    let shown = page.target(img.attr("src"));
    let now = run_dir
        .join("_thumbs")
        .join(format!("{}.png", &sha256_hex(&other)[..32]));
    let said = text(page.element(fig.at)).contains("changed on disk");
    assert!(
        same_file(&shown, &now) || said,
        "i01/clean.png now holds i00's picture, but the page shows {} without a word",
        img.attr("src")
    );
}

/// A run asked for a part (`--items`) records the part's price; its plan what the whole file
/// costs. The page's header holds the whole against the plan now, and says nothing changed
/// when nothing did (issue 45: it said "the plan changed since" of every sample).
#[tokio::test(flavor = "multi_thread")]
async fn a_part_asked_for_is_not_said_to_have_changed_the_plan() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(2, None));
    let args = [
        "run", "p.yaml", "--run-id", "c", "--items", "first:1", "--report",
    ];
    assert_exit_without_panic(&ip(Some(&env), dir, &args).await, 7);
    let (db, page) = record_and_page(dir, "c").await;
    assert!(
        page.number("total-planned") > db.the_run().credits_planned,
        "the page counts the whole file, the run recorded the part"
    );
    assert!(
        !page.html.contains("the plan changed since"),
        "{}",
        page.html
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_step_dropped_by_allow_changes_keeps_its_cost_on_a_line_of_its_own() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(
        dir,
        "p.yaml",
        &edit_chain(2, None).replace("lamp.png", "nope.png"),
    );
    assert_exit_without_panic(&run_chain(&env, "c", &[]).await, 4);
    // i01 mended, and the cut-out step dropped: i00's cut-out was paid for all the same.
    let cut = "  - id: cutout\n    remove_background: { from: big }\n";
    let mended = edit_chain(2, None).replace(cut, "");
    assert_ne!(mended, edit_chain(2, None));
    write(dir, "p.yaml", &mended);
    let o = ip(
        Some(&env),
        dir,
        &["resume", "c", "--allow-changes", "--report"],
    )
    .await;
    assert_exit_without_panic(&o, 0);
    let (db, page) = record_and_page(dir, "c").await;
    assert_eq!(db.the_run().status, "succeeded");
    let removed: Vec<&TaskRow> = db.tasks.iter().filter(|t| t.removed).collect();
    assert_eq!(removed.len(), 2, "{:#?}", db.tasks);
    let ledger: u64 = env.sandbox.ledger().iter().map(|e| e.credits).sum();
    assert_eq!(
        page.number("total-billed"),
        ledger,
        "every credit the sandbox took"
    );
    let row = page
        .step_row("removed from the pipeline")
        .expect("a line for the removed tasks");
    assert_eq!(row[1], "2", "{row:?}");
    assert_eq!(row[8], "5", "{row:?}");
    assert_eq!(page.number("total-tasks"), 4);
    // The resume re-planned the run: the plan on record is the new one, 2 × (2 + 2).
    assert_eq!(page.number("total-planned"), 8);
    assert_eq!(db.the_run().credits_planned, 8);
    assert!(!page.html.contains("the plan changed since"));
    for t in removed {
        assert!(page.by_id("div", &format!("t{}", t.id)).is_none(), "{t:?}");
    }
    let removed_row = page
        .tags("tr")
        .into_iter()
        .find(|t| t.attrs.get("data-step").map(String::as_str) == Some("removed from the pipeline"))
        .unwrap();
    let removed_html = page.element(removed_row.at).to_owned();
    // The dropped step has no line of its own (its tasks are on the removed line).
    assert_eq!(
        page.step_row("cutout"),
        None,
        "an empty line for a dropped step"
    );
    // Nor is the removed line's billing marked over its plan (removed tasks plan nothing).
    assert!(
        !removed_html.contains("class=\"n over\""),
        "removed tasks shown as billed over their plan: {removed_html}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn identical_images_share_one_thumbnail_and_it_is_counted_once() {
    // i00 and i04 are both the mug, edited alike (one object name for every item): the same
    // bytes at every step.
    let env = start(config()).await;
    let dir = env.dir.path();
    let alike = edit_chain(5, None).replace("the corner of {{ item.id }}", "the corner");
    write(dir, "p.yaml", &alike);
    assert_exit_without_panic(&run_chain(&env, "r", &[]).await, 0);
    let db = read_db(dir, "r").await;
    let distinct = wanted_thumbs(&db);
    assert!(
        distinct.len() < db.downloaded().len(),
        "some outputs are alike"
    );
    let o = ip(Some(&env), dir, &["report", "r", "--json"]).await;
    assert_exit_without_panic(&o, 0);
    let written = json_stdout(&o);
    let page = Page::read(&dir.join("out/r/report.html"));
    assert_page_agrees(&page, &db, "r");
    assert_eq!(thumb_files(&dir.join("out/r")), distinct);
    assert_eq!(written["images"], 15);
    assert_eq!(
        written["thumbnails_made"].as_u64().unwrap(),
        distinct.len() as u64,
        "thumbnails made: {written:#}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_report_that_cannot_be_written_leaves_the_runs_exit_code_and_a_finished_run_gets_one() {
    let env = start_with_chain(config(), 1).await;
    let dir = env.dir.path();
    // Something of the user's already sits where the report goes.
    let report = dir.join("out/r/report.html");
    std::fs::create_dir_all(&report).unwrap();
    let o = run_chain(&env, "r", &["--report"]).await;
    assert_exit_without_panic(&o, 0);
    let err = stderr(&o);
    assert!(err.contains("cannot write the report"), "{err}");
    assert!(err.contains("`imgpipe report r` tries again"), "{err}");
    assert!(report.is_dir(), "left as it was");
    assert!(stdout(&o).starts_with("run r: succeeded"), "{}", both(&o));

    // The finished run, run again with --report: the page, and not one request.
    std::fs::remove_dir(&report).unwrap();
    let requests = env.sandbox.stats().api_requests;
    let o = run_chain(&env, "r", &["--report"]).await;
    assert_exit_without_panic(&o, 0);
    assert!(stderr(&o).contains("report written to"), "{}", both(&o));
    assert_eq!(env.sandbox.stats().api_requests, requests);
    let db = read_db(dir, "r").await;
    assert_page_agrees(&Page::read(&report), &db, "r");
    // Readable by others (a web server, a colleague), like the images.
    use std::os::unix::fs::PermissionsExt;
    let mut files = vec![report.clone()];
    files.extend(entries(&dir.join("out/r/_thumbs")));
    for f in files {
        let mode = std::fs::metadata(&f).unwrap().permissions().mode();
        assert_eq!(mode & 0o044, 0o044, "{}: {mode:o}", f.display());
    }
}

/// Links are made between the real (symlink-resolved) directories, but the page is opened at
/// the path the user gave, which `report` prints: through a symlinked directory, `..` climbs
/// out of the wrong directory and every link of the page breaks.
#[tokio::test(flavor = "multi_thread")]
async fn links_work_from_the_path_the_report_was_written_to_even_through_a_symlink() {
    let env = after_run_r(1, &["--report"]).await;
    let dir = env.dir.path();
    let db = read_db(dir, "r").await;
    // ~/reports is a link to a shared directory deeper down.
    std::fs::create_dir_all(dir.join("shared/team/reports")).unwrap();
    std::os::unix::fs::symlink(dir.join("shared/team/reports"), dir.join("reports")).unwrap();
    let o = ip(
        Some(&env),
        dir,
        &["report", "r", "--out", "reports/r.html", "--json"],
    )
    .await;
    assert_exit_without_panic(&o, 0);
    let printed = PathBuf::from(json_stdout(&o)["path"].as_str().unwrap());
    assert_eq!(printed, dir.join("reports/r.html"));
    // Opened where it says it is, as a browser would open it.
    assert_page_agrees(&Page::read(&printed), &db, "r");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_stopped_for_credits_says_why_and_that_the_balance_moved_by_more_than_it_billed() {
    let env = start_with_chain(config(), 3).await;
    // Someone else spends the account down after the second bill, the third call held in
    // flight: it is refused for lack of credits.
    let hold = env.sandbox.hold();
    let mut child = Watched::start(one_at_a_time(&env, "b", &["--report"]));
    step_until(&env, &mut child, |env| env.sandbox.ledger().len() >= 2).await;
    env.sandbox.set_balance(1);
    drop(hold);
    let o = child.finish().await;
    assert_exit_without_panic(&o, 3);
    assert!(stderr(&o).contains("report written to"), "{}", both(&o));
    let (db, page) = record_and_page(env.dir.path(), "b").await;
    assert_eq!(db.the_run().status, "stopped");
    let header = text(page.element(page.tags("header")[0].at));
    assert!(
        header.contains("the service refused a call for lack of credits"),
        "the reason for the stop, a balance stop and not a budget stop: {header}"
    );
    // The page of a stopped run says how to continue it, with the database it is in.
    let state = state_path(env.dir.path());
    let resume = format!("imgpipe resume b --state {}", state.display());
    assert!(header.contains("The run stopped: "), "{header}");
    assert!(
        header.contains(&format!("Continue it with {resume}: it pays only")),
        "{header}"
    );
    assert_eq!(page.text_of("code", "continue-with"), resume);
    assert!(page.html.contains("not run: the run stopped ("));
    let (before, after) = (
        db.the_run().balance_before.unwrap(),
        db.the_run().balance_after.unwrap(),
    );
    assert_eq!(after, env.sandbox.balance());
    assert!(
        page.html.contains(&format!(
            "The balance moved by {} credits while this run was billed {}",
            before - after,
            db.billed()
        )),
        "the balance note"
    );
    assert_eq!(
        page.fact("Balance"),
        format!("{before} before, {after} after")
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn reports_made_at_once_all_succeed_and_leave_no_temporary_file() {
    let env = after_run_r(4, &[]).await;
    let dir = env.dir.path();
    let db = read_db(dir, "r").await;
    let outs: Vec<PathBuf> = (0..3).map(|i| dir.join(format!("r{i}.html"))).collect();
    let runs = outs.iter().map(|out| {
        finish(cmd(
            Some(&env),
            dir,
            dir,
            &["report", "r", "--out", out.to_str().unwrap()],
        ))
    });
    for o in futures::future::join_all(runs).await {
        assert_exit_without_panic(&o, 0);
    }
    for out in &outs {
        assert_page_agrees(&Page::read(out), &db, "r");
    }
    assert_eq!(thumb_files(&dir.join("out/r")), wanted_thumbs(&db));
    let mut expected: BTreeSet<PathBuf> = outs.iter().cloned().collect();
    expected.extend(
        [
            "p.yaml",
            "state.db",
            "state.db-wal",
            "state.db-shm",
            "out",
            "state.db.locks",
        ]
        .map(|f| dir.join(f)),
    );
    for e in entries(dir) {
        assert!(expected.contains(&e), "stray {}", e.display());
    }
}

/// A report killed while writing a thumbnail leaves its temporary in `_thumbs/`: the next
/// report removes it, unless a report is writing there at that moment (it holds the
/// directory shared, as this test does by hand), whose temporary is left alone.
#[tokio::test(flavor = "multi_thread")]
async fn temporaries_a_killed_report_left_in_thumbs_are_removed_by_the_next_report() {
    let env = after_run_r(2, &[]).await;
    let dir = env.dir.path();
    let thumbs = dir.join("out/r/_thumbs");
    std::fs::create_dir_all(&thumbs).unwrap();
    let stale = thumbs.join(".tmpK1lled");
    std::fs::write(&stale, b"the first bytes of a thumbnail").unwrap();
    let o = ip(Some(&env), dir, &["report", "r"]).await;
    assert_exit_without_panic(&o, 0);
    assert!(
        !stale.exists(),
        "the killed report's temporary is still there"
    );
    let (db, _) = record_and_page(dir, "r").await;
    assert_eq!(thumb_files(&dir.join("out/r")), wanted_thumbs(&db));

    // Another report writing now: its temporary is its own to finish.
    let writing = std::fs::File::open(&thumbs).unwrap();
    writing.lock_shared().unwrap();
    let busy = thumbs.join(".tmpWr1tng");
    std::fs::write(&busy, b"being written").unwrap();
    let o = ip(Some(&env), dir, &["report", "r"]).await;
    assert_exit_without_panic(&o, 0);
    assert!(busy.exists(), "a temporary being written was removed");
    drop(writing);
    let o = ip(Some(&env), dir, &["report", "r"]).await;
    assert_exit_without_panic(&o, 0);
    assert!(!busy.exists(), "left once its writer was gone");
    assert_eq!(thumb_files(&dir.join("out/r")), wanted_thumbs(&db));
}

/// `report` with a mistyped `--state` says there is no database there, and creates none.
#[tokio::test(flavor = "multi_thread")]
async fn a_mistyped_state_path_is_reported_and_not_created() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let typo = dir.join("sate/state.db");
    let o = Imgpipe::new(&["report", "r", "--state", typo.to_str().unwrap()])
        .cwd(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 2);
    let err = stderr(&o);
    assert!(
        err.contains("there is no state database at") && err.contains("sate/state.db"),
        "{err}"
    );
    assert!(err.contains("--state"), "{err}");
    assert!(
        !typo.exists(),
        "a read-only command created {}",
        typo.display()
    );
    assert!(!dir.join("sate").exists());
    // No command that only reads (or resumes) what runs recorded makes one either.
    for args in [["status", "r"], ["resume", "r"]] {
        let o = Imgpipe::new(&[args[0], args[1], "--state", typo.to_str().unwrap()])
            .cwd(dir)
            .run()
            .await;
        assert_exit_without_panic(&o, 2);
        assert!(
            stderr(&o).contains("there is no state database"),
            "{}",
            stderr(&o)
        );
        assert!(!dir.join("sate").exists(), "{args:?} created it");
    }
    let o = Imgpipe::new(&["runs", "--state", typo.to_str().unwrap()])
        .cwd(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    assert!(stdout(&o).contains("no runs yet"), "{}", stdout(&o));
    assert!(!dir.join("sate").exists(), "runs created it");
}

/// Items on a report's page in the paged report's test (`IMGPIPE_TEST_REPORT_PAGE_ITEMS`, a
/// test-only setting, in place of 100): the pages, their links and each item on one page are
/// the same at 10 as at 100, for a tenth of the items paid and drawn.
const PAGE_ITEMS: usize = 10;

/// `imgpipe report r --json` in `env`'s directory, `PAGE_ITEMS` items a page.
async fn report_paged(env: &Env) -> Output {
    let dir = env.dir.path();
    let mut c = cmd(Some(env), dir, dir, &["report", "r", "--json"]);
    c.env("IMGPIPE_TEST_REPORT_PAGE_ITEMS", PAGE_ITEMS.to_string());
    finish(c).await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_of_more_items_than_a_page_writes_linked_pages_each_holding_its_items_images() {
    // Two full pages and a part (the last page's count is its own).
    let env = start_with_chain(
        sandbox::Config {
            balance: 10_000,
            ..config()
        },
        2 * PAGE_ITEMS + 5,
    )
    .await;
    assert_exit_without_panic(&run_chain(&env, "r", &["--concurrency", "16"]).await, 0);
    let dir = env.dir.path();
    let db = read_db(dir, "r").await;
    let run_dir = db.the_run().output_dir.join("r");
    // An earlier, longer report's last page, and a user's file past it: the first goes, the
    // second stays.
    let stale = run_dir.join("report-4.html");
    std::fs::write(&stale, "<!DOCTYPE html>\n<!-- imgpipe run report -->\nold").unwrap();
    std::fs::write(run_dir.join("report-5.html"), "my notes").unwrap();
    let o = report_paged(&env).await;
    assert_exit_without_panic(&o, 0);
    let written = json_stdout(&o);
    assert_eq!(written["pages"], 3, "{written:#}");
    assert!(!stale.exists(), "the stale page is removed");
    assert_eq!(
        std::fs::read_to_string(run_dir.join("report-5.html")).unwrap(),
        "my notes"
    );
    let names = ["report.html", "report-2.html", "report-3.html"];
    let pages: Vec<Page> = names.iter().map(|n| Page::read(&run_dir.join(n))).collect();
    for (i, page) in pages.iter().enumerate() {
        assert!(
            page.html
                .starts_with("<!DOCTYPE html>\n<!-- imgpipe run report -->\n")
        );
        assert!(
            page.html.trim_end().ends_with("</html>"),
            "{} is cut short",
            names[i]
        );
        let sections = page.html.matches("<section class=\"item\"").count();
        assert_eq!(sections, [10, 10, 5][i], "items on {}", names[i]);
        let links: Vec<String> = page
            .tags("a")
            .iter()
            .filter(|a| a.attrs.get("rel").map(String::as_str) == Some("next"))
            .map(|a| a.attr("href").to_owned())
            .collect();
        match names.get(i + 1) {
            Some(next) => assert!(
                links.contains(&format!("{next}#items")),
                "{} links to {next}: {links:?}",
                names[i]
            ),
            None => assert!(links.is_empty(), "the last page links no next: {links:?}"),
        }
    }
    // Every task on exactly one page, with its item; every downloaded output's figure links
    // its file, on that page and no other.
    let mut items_seen = BTreeSet::new();
    for t in db.live() {
        let on: Vec<usize> = (0..3)
            .filter(|&i| pages[i].by_id("div", &format!("t{}", t.id)).is_some())
            .collect();
        assert_eq!(on.len(), 1, "t{} is on pages {on:?}", t.id);
        let page = &pages[on[0]];
        let section = page.must("section", &format!("item-{}", t.item));
        items_seen.insert((on[0], t.item.clone()));
        for out in db.outputs_of(t.id) {
            let fig = page.must("figure", &format!("o{}-{}", t.id, out.k));
            assert!(page.range(section.at).contains(&fig.at));
            let a = &page.inner(fig.at, "a")[0];
            let file = PathBuf::from(out.path.as_deref().unwrap());
            assert!(same_file(&page.target(a.attr("href")), &file), "{a:?}");
            let img = &page.inner(fig.at, "img")[0];
            let src = img
                .attrs
                .get("src")
                .or_else(|| img.attrs.get("data-src"))
                .unwrap();
            assert!(
                page.target(src).is_file(),
                "thumbnail {src} of {}",
                names[on[0]]
            );
        }
    }
    let per_page: Vec<usize> = (0..3)
        .map(|i| items_seen.iter().filter(|(p, _)| *p == i).count())
        .collect();
    assert_eq!(per_page, [10, 10, 5]);
    let figures: usize = pages
        .iter()
        .map(|p| p.html.matches("<figure id=\"o").count())
        .sum();
    assert_eq!(figures, db.downloaded().len(), "every output once");
    // The costs and problems are the whole run's, on the first page only.
    assert_eq!(pages[0].number("total-tasks"), db.live().count() as u64);
    assert!(pages[1].by_id("section", "costs").is_none());

    // An item of the last page rerolled: made again, that page shows its earlier versions
    // beside the new ones (read while the rows of the pages before were still streaming).
    let (_, last) = items_seen.iter().rfind(|(p, _)| *p == 2).unwrap();
    assert_exit_without_panic(&ip(Some(&env), dir, &["reroll", "r", last]).await, 0);
    let again = report_paged(&env).await;
    assert_exit_without_panic(&again, 0);
    let third = Page::read(&run_dir.join("report-3.html"));
    let section = third.must("section", &format!("item-{last}"));
    let earlier: Vec<String> = third
        .tags("a")
        .iter()
        .filter(|a| third.range(section.at).contains(&a.at))
        .map(|a| a.attr("href").to_owned())
        .filter(|href| href.starts_with(&format!("_superseded/{last}/")))
        .collect();
    assert!(!earlier.is_empty(), "{last}'s earlier versions on page 3");
}
