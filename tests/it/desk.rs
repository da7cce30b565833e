//! A reroll that could not be done changes nothing the person had (issue 36): the calls it
//! sent refused before billing (an injected 400, a drained balance), it is undone: the run's
//! status, its tasks' and outputs' rows and its files are as they were, and the exit code and
//! message say why. A reroll that pays still sets the old files aside.

use std::path::PathBuf;
use std::process::Stdio;

use crate::binary::{Imgpipe, Ran};
use crate::common::*;

pub(crate) const PIPELINE: &str = include_str!("../../pipelines/product-shots.yaml");
/// What an item's chain costs (see `review_loop.rs`).
pub(crate) const ITEM: u64 = 8 + 2 * (2 + 5 + 4 + 5);
/// `mug/clean[0]` and what is downstream of it: erase, expand, upscale, cut-out.
pub(crate) const CLEAN0: u64 = 2 + 5 + 4 + 5;

/// The sample pipeline in `env`'s directory, and the state it uses (SQLite there, or `pg`).
pub(crate) struct Catalogue<'e> {
    env: &'e Env,
    pub(crate) dir: PathBuf,
    pub(crate) state: String,
}

impl<'e> Catalogue<'e> {
    pub(crate) fn new(env: &'e Env, pg: Option<String>) -> Catalogue<'e> {
        let dir = env.dir.path().join("work");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("shots.yaml"), PIPELINE).unwrap();
        let state = pg.unwrap_or_else(|| dir.join("state.db").to_string_lossy().into_owned());
        Catalogue { env, dir, state }
    }

    /// `imgpipe ARGS --state …` in the catalogue's directory, against the sandbox.
    pub(crate) fn plain(&self, args: &[&str]) -> Imgpipe<'e> {
        Imgpipe::on(self.env, args)
            .cwd(&self.dir)
            .state(&self.state)
    }

    /// A paying command: retries without waiting.
    pub(crate) fn imgpipe(&self, args: &[&str]) -> Imgpipe<'e> {
        self.plain(args).args(&["--retry-base-ms", "1"])
    }

    /// The whole catalogue, run to its end as run `r`.
    pub(crate) async fn done(&self) {
        let ran = self
            .imgpipe(&["run", "shots.yaml", "--run-id", "r"])
            .run()
            .await;
        assert_exit(&ran, 0);
        assert_eq!(billed(self.env), 3 * ITEM);
    }

    fn run_dir(&self) -> PathBuf {
        self.dir.join("out/r")
    }

    /// What the person has: the run's files, and its record (status, tasks, outputs, outputs
    /// set aside), as text to compare whole.
    async fn had(&self) -> (std::collections::BTreeMap<String, String>, String) {
        let db = Db::read(&self.state).await;
        let runs: Vec<String> = db
            .runs
            .iter()
            .map(|r| format!("{} {}", r.id, r.status))
            .collect();
        let tasks: Vec<String> = db
            .tasks
            .iter()
            .map(|t| format!("{} {} {:?} {:?}", t.name(), t.status, t.job_id, t.error))
            .collect();
        let outputs: Vec<String> = db
            .outputs
            .iter()
            .map(|o| {
                format!(
                    "{} {} {} {:?} {:?}",
                    o.id, o.task_id, o.job_id, o.path, o.sha256
                )
            })
            .collect();
        let record = format!(
            "runs {runs:#?}\ntasks {tasks:#?}\noutputs {outputs:#?}\nset aside {}",
            db.superseded.len()
        );
        (file_digests(&self.run_dir()), record)
    }
}

/// `body` with `key` set to `value`.
pub(crate) fn with(
    body: &serde_json::Value,
    key: &str,
    value: serde_json::Value,
) -> serde_json::Value {
    let mut body = body.clone();
    body[key] = value;
    body
}

/// `body` confirmed at what the dry run `priced` answered: its credits and revision.
pub(crate) fn confirmed_at(
    body: &serde_json::Value,
    priced: &serde_json::Value,
) -> serde_json::Value {
    let body = with(body, "credits", priced["credits"].clone());
    with(&body, "revision", priced["revision"].clone())
}

pub(crate) fn billed(env: &Env) -> u64 {
    env.sandbox.ledger().iter().map(|e| e.credits).sum()
}

/// The reroll refused said why, and that nothing changed.
fn says_nothing_changed(ran: &Ran, why: &str) {
    let err = ran.stderr();
    assert!(
        has_phrase(&err, "the reroll of mug/clean[0] could not be done"),
        "{err}"
    );
    assert!(
        err.contains(why),
        "the refusal's cause `{why}` is said: {err}"
    );
    assert!(
        has_phrase(
            &err,
            "nothing was billed and nothing changed: run r is succeeded as before"
        ),
        "{err}"
    );
}

/// The paid reroll after a refused one: it bills its chain once and sets the old files aside.
async fn reroll_pays_and_sets_aside(c: &Catalogue<'_>) {
    let (files, _) = c.had().await;
    let ran = c.imgpipe(&["reroll", "r", "mug/clean[0]"]).run().await;
    assert_exit(&ran, 0);
    assert_eq!(billed(c.env), 3 * ITEM + CLEAN0, "the chain billed once");
    let after = file_digests(&c.run_dir());
    let old = files
        .iter()
        .find(|(p, _)| p.starts_with("mug/") && p.contains("clean") && p.contains('0'))
        .map(|(_, sha)| sha.clone())
        .expect("mug/clean[0] had a file");
    assert!(
        after
            .iter()
            .any(|(p, s)| p.starts_with("_superseded/mug/") && *s == old),
        "the earlier mug/clean[0] is under _superseded/: {after:#?}"
    );
}

async fn a_reroll_the_service_refuses_changes_nothing(pg: Option<String>) {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, pg);
    c.done().await;
    let before = c.had().await;
    let calls = env.sandbox.ledger().len();

    // Every call refused: a tool's 400 may be an input's URL expired, which the client asks
    // again once before it gives up.
    env.sandbox.refuse_next(usize::MAX);
    let ran = c.imgpipe(&["reroll", "r", "mug/clean[0]"]).run().await;
    env.sandbox.refuse_next(0);
    assert_exit(&ran, 2);
    says_nothing_changed(&ran, "refused as invalid");
    assert_eq!(env.sandbox.ledger().len(), calls, "nothing billed");
    let after = c.had().await;
    assert_eq!(after.1, before.1, "the record is as it was");
    assert_eq!(after.0, before.0, "the files are as they were");

    reroll_pays_and_sets_aside(&c).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reroll_the_service_refuses_as_invalid_changes_nothing_and_says_why() {
    a_reroll_the_service_refuses_changes_nothing(None).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn on_postgres_a_reroll_refused_changes_nothing() {
    let Some(pg) = postgres_database("desk_undo").await else {
        return;
    };
    a_reroll_the_service_refuses_changes_nothing(Some(pg.to_string())).await;
    drop(pg);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reroll_refused_for_the_balance_changes_nothing_and_says_why() {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, None);
    c.done().await;
    let before = c.had().await;
    let calls = env.sandbox.ledger().len();

    // The balance is drained while the reroll's first call waits at the gate, after the
    // reroll was priced against it and set its files aside.
    env.sandbox.hold_calls();
    let mut cmd = c.imgpipe(&["reroll", "r", "mug/clean[0]"]).command();
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = cmd.spawn().unwrap();
    wait_until("the reroll's first call held", || {
        env.sandbox.held_calls() == 1
    })
    .await;
    env.sandbox.set_balance(0);
    env.sandbox.release_calls();
    let out = finish_child(child, "the reroll refused for the balance").await;
    let ran = Ran {
        output: out,
        ledger: None,
        state: None,
    };
    assert_exit(&ran, 3);
    says_nothing_changed(&ran, "balance");
    assert_eq!(env.sandbox.ledger().len(), calls, "nothing billed");
    let after = c.had().await;
    assert_eq!(after.1, before.1, "the record is as it was");
    assert_eq!(after.0, before.0, "the files are as they were");

    env.sandbox.set_balance(1000);
    reroll_pays_and_sets_aside(&c).await;
}

/// `imgpipe review --no-open` started on the catalogue's state: the child, its URL (stdout's
/// first line) and its token.
pub(crate) struct Served {
    pub(crate) child: tokio::process::Child,
    /// The URL stdout's first line gives.
    pub(crate) url: String,
    pub(crate) base: String,
    pub(crate) token: String,
    pub(crate) port: u16,
}

async fn serve(c: &Catalogue<'_>) -> Served {
    serve_with(c, &[]).await
}

pub(crate) async fn serve_with(c: &Catalogue<'_>, more: &[&str]) -> Served {
    serve_on(c.plain(&["review", "--no-open"]).args(more)).await
}

/// Starts `review`, the desk's command as built (its state, flags and environment).
pub(crate) async fn serve_on(review: Imgpipe<'_>) -> Served {
    use tokio::io::AsyncBufReadExt;
    let mut cmd = review.command();
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let mut child = cmd.spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let first = within("the desk's URL on stdout's first line", lines.next_line())
        .await
        .unwrap()
        .expect("a first line");
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let url = url::Url::parse(&first).unwrap_or_else(|e| panic!("`{first}`: {e}"));
    assert_eq!(url.host_str(), Some("127.0.0.1"), "{first}");
    let token = url
        .query_pairs()
        .find(|(k, _)| k == "token")
        .map(|(_, v)| v.into_owned())
        .expect("the token in the URL");
    assert!(token.len() >= 32, "at least 128 bits: {token}");
    let port = url.port().unwrap();
    Served {
        child,
        url: first.clone(),
        base: format!("http://127.0.0.1:{port}"),
        token,
        port,
    }
}

impl Served {
    /// SIGTERM, then what it wrote on stderr once ended (exit 0).
    pub(crate) async fn stop(self) -> String {
        send_signal(self.child.id().unwrap(), libc::SIGTERM);
        self.ended().await
    }

    /// What it wrote on stderr once ended, which must be exit 0.
    pub(crate) async fn ended(mut self) -> String {
        let stderr = self.child.stderr.take().unwrap();
        let status = wait_child(&mut self.child, RUN_LIMIT, "the desk stopping on SIGTERM").await;
        let mut err = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut tokio::io::BufReader::new(stderr), &mut err)
            .await
            .unwrap();
        assert_eq!(
            status.code(),
            Some(0),
            "the desk ends well on SIGTERM: {err}"
        );
        err
    }
}

/// A POST as a test sends it: what it is, its `Authorization`, its `Origin`, its
/// `Content-Type`, and the status it must get.
type Post<'a> = (&'a str, Option<&'a str>, Option<&'a str>, &'a str, u16);

#[tokio::test(flavor = "multi_thread")]
async fn the_desk_answers_only_its_token_its_host_and_its_own_page() {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, None);
    c.done().await;
    let calls = env.sandbox.ledger().len();
    let desk = serve(&c).await;
    let http = reqwest::Client::builder()
        .timeout(RUN_LIMIT)
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let (base, token) = (desk.base.clone(), desk.token.clone());
    let bearer = format!("Bearer {token}");
    let csp = |r: &reqwest::Response| {
        let csp = r.headers()["content-security-policy"]
            .to_str()
            .unwrap()
            .to_owned();
        assert!(csp.starts_with("default-src 'self'"), "{csp}");
    };

    // No token: 401, saying how to get the URL again; a wrong one the same.
    for given in [None, Some("Bearer 00")] {
        let mut get = http.get(format!("{base}/api/runs"));
        if let Some(g) = given {
            get = get.header("authorization", g);
        }
        let r = get.send().await.unwrap();
        assert_eq!(r.status(), 401);
        csp(&r);
        let body = r.text().await.unwrap();
        assert!(body.contains("imgpipe review"), "{body}");
    }
    let r = http.get(format!("{base}/")).send().await.unwrap();
    assert_eq!(r.status(), 401, "the page too");

    // The token: the API answers what the command line prints.
    let r = http
        .get(format!("{base}/api/runs"))
        .header("authorization", &bearer)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    csp(&r);
    let runs: serde_json::Value = r.json().await.unwrap();
    let cli = c.plain(&["runs", "--json"]).run().await;
    assert_eq!(runs, json_stdout(&cli), "GET /api/runs is `runs --json`");
    let r = http
        .get(format!("{base}/api/runs/r"))
        .header("authorization", &bearer)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let status: serde_json::Value = r.json().await.unwrap();
    let cli = c.plain(&["status", "r", "--json"]).run().await;
    assert_eq!(
        status,
        json_stdout(&cli),
        "GET /api/runs/r is `status r --json`"
    );

    // The URL's token opens a session whose cookie the page's requests carry (the session's
    // own secret: `desk_guard.rs`).
    let r = http
        .get(format!("{base}/?token={token}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 303);
    let cookie = r.headers()["set-cookie"].to_str().unwrap().to_owned();
    assert!(has_phrase(&cookie, "HttpOnly; SameSite=Strict"), "{cookie}");
    let cookie = cookie.split(';').next().unwrap().to_owned();
    let r = http
        .get(format!("{base}/api/runs"))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "the cookie is the token for a GET");

    // A name rebound to 127.0.0.1 is refused, token or not.
    for host in [
        format!("evil.example:{}", desk.port),
        "127.0.0.1:1".to_owned(),
    ] {
        let r = http
            .get(format!("{base}/api/runs"))
            .header("host", &host)
            .header("authorization", &bearer)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 421, "Host {host} refused");
        csp(&r);
    }

    // A change from anywhere but the desk's own page is refused, and nothing is spent.
    let reroll = format!("{base}/api/runs/r/reroll");
    let own = format!("http://127.0.0.1:{}", desk.port);
    let other = format!("http://127.0.0.1:{}", desk.port.wrapping_add(1).max(1));
    let body = r#"{"tasks":["mug/clean[0]"],"credits":16}"#;
    let refused: [Post<'_>; 5] = [
        // A page served by another loopback port, with the token (stolen) and JSON.
        (
            "another origin",
            Some(&bearer),
            Some(&other),
            "application/json",
            403,
        ),
        // No Origin at all.
        ("no origin", Some(&bearer), None, "application/json", 403),
        // An HTML form: no header but the cookie, a form's body.
        (
            "a form post",
            None,
            Some(&other),
            "application/x-www-form-urlencoded",
            401,
        ),
        // A form from the desk's origin still has no JSON body.
        ("a form body", Some(&bearer), Some(&own), "text/plain", 415),
        // The cookie alone does not make a change.
        (
            "the cookie alone",
            None,
            Some(&own),
            "application/json",
            401,
        ),
    ];
    for (what, auth, origin, content_type, status) in refused {
        let mut post = http
            .post(&reroll)
            .header("content-type", content_type)
            .header("cookie", &cookie)
            .body(body);
        if let Some(a) = auth {
            post = post.header("authorization", a);
        }
        if let Some(o) = origin {
            post = post.header("origin", o);
        }
        let r = post.send().await.unwrap();
        assert_eq!(r.status(), status, "{what} is refused");
        csp(&r);
    }
    assert_eq!(env.sandbox.ledger().len(), calls, "nothing spent");

    let err = desk.stop().await;
    assert!(!err.contains(&token), "the token is never logged: {err}");
}

impl Served {
    /// A POST as the desk's own page sends it.
    pub(crate) async fn post(
        &self,
        path: &str,
        body: serde_json::Value,
    ) -> (u16, serde_json::Value) {
        let r = http()
            .post(format!("{}{path}", self.base))
            .header("authorization", format!("Bearer {}", self.token))
            .header("origin", &self.base)
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(serde_json::Value::Null))
    }

    /// `body` priced by a dry run of `path`, then confirmed at the credits and revision the dry
    /// run answered (as the page's button does): the confirm's status and answer.
    pub(crate) async fn confirm(
        &self,
        path: &str,
        body: serde_json::Value,
    ) -> (u16, serde_json::Value) {
        let (status, priced) = self.post(path, with(&body, "dry_run", true.into())).await;
        assert_eq!(status, 200, "the dry run of {path}: {priced}");
        self.post(path, confirmed_at(&body, &priced)).await
    }

    async fn status_of(&self, run: &str) -> serde_json::Value {
        http()
            .get(format!("{}/api/runs/{run}", self.base))
            .header("authorization", format!("Bearer {}", self.token))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// Waits until the run's record is no longer `running` and its status is `status`.
    /// Waits until the work the desk started on `run` has ended, and gives how
    /// (`GET /api/runs/{run}/work`).
    pub(crate) async fn work_ended(&self, run: &str) -> serde_json::Value {
        let get = || async {
            http()
                .get(format!("{}/api/runs/{run}/work", self.base))
                .header("authorization", format!("Bearer {}", self.token))
                .send()
                .await
                .unwrap()
                .json::<serde_json::Value>()
                .await
                .unwrap()
        };
        wait_until_async(&format!("the desk's work on run {run} ended"), || async {
            get().await["state"] != "going"
        })
        .await;
        get().await
    }

    pub(crate) async fn wait_status(&self, run: &str, status: &str) {
        let what = format!("run {run} {status} as the desk says");
        wait_until_async(&what, || async {
            self.status_of(run).await["status"] == status
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_desk_prices_as_the_cli_and_pays_exactly_the_price_confirmed() {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, None);
    c.done().await;
    let desk = serve_with(&c, &["--retry-base-ms", "1"]).await;
    let calls = env.sandbox.ledger().len();
    let reroll = "/api/runs/r/reroll";
    let tasks = serde_json::json!(["mug/clean[0]"]);

    // The dry run's price is `reroll --dry-run`'s, and nothing is spent.
    let (status, priced) = desk
        .post(reroll, serde_json::json!({"tasks": tasks, "dry_run": true}))
        .await;
    assert_eq!(status, 200, "{priced}");
    let cli = c
        .plain(&["reroll", "r", "mug/clean[0]", "--dry-run", "--json"])
        .run()
        .await;
    assert_exit(&cli, 0);
    let cli = json_stdout(&cli);
    assert_eq!(priced["credits"], cli["credits"], "{priced}\n{cli}");
    assert_eq!(priced["credits"], CLEAN0);
    assert_eq!(priced["tasks"], cli["tasks"]);
    assert_eq!(
        priced["revision"], cli["revision"],
        "one state, one revision"
    );
    assert_eq!(
        env.sandbox.ledger().len(),
        calls,
        "a dry run spends nothing"
    );

    // A price that is not the price now: 409, nothing spent.
    let body = serde_json::json!({"tasks": tasks});
    let cheaper = with(
        &confirmed_at(&body, &priced),
        "credits",
        (CLEAN0 - 1).into(),
    );
    let (status, stale) = desk.post(reroll, cheaper).await;
    assert_eq!(status, 409, "{stale}");
    assert_eq!(stale["credits"], CLEAN0, "the answer gives the price now");
    assert_eq!(stale["revision"], priced["revision"]);
    assert_eq!(env.sandbox.ledger().len(), calls, "nothing spent");

    // A confirm without the revision it was priced at is refused: it could pay twice.
    let (status, bare) = desk
        .post(
            reroll,
            serde_json::json!({"tasks": tasks, "credits": CLEAN0}),
        )
        .await;
    assert_eq!(status, 400, "{bare}");

    // Another process holds the run: refused naming it, nothing spent.
    env.sandbox.hold_calls();
    let mut cmd = c.imgpipe(&["reroll", "r", "lamp/shot"]).command();
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let other = cmd.spawn().unwrap();
    let pid = other.id().unwrap();
    wait_until("the other reroll's call held", || {
        env.sandbox.held_calls() == 1
    })
    .await;
    let (status, held) = desk.post(reroll, confirmed_at(&body, &priced)).await;
    assert_eq!(status, 409, "{held}");
    let said = held["error"].as_str().unwrap_or_default();
    assert!(
        said.contains(&format!("pid {pid}")),
        "the holder is named: {held}"
    );
    assert_eq!(env.sandbox.ledger().len(), calls, "nothing spent");
    env.sandbox.release_calls();
    assert_exit(&finish_child(other, "the other reroll").await, 0);
    let calls = env.sandbox.ledger().len();
    let billed_before = billed(&env);

    // The other process changed the run since the dry run: its revision no longer holds,
    // though the price is the same. Refused, with the revision now; nothing spent.
    let (status, moved) = desk.post(reroll, confirmed_at(&body, &priced)).await;
    assert_eq!(status, 409, "{moved}");
    assert_eq!(moved["credits"], CLEAN0, "{moved}");
    assert_ne!(moved["revision"], priced["revision"], "{moved}");
    assert_eq!(env.sandbox.ledger().len(), calls, "nothing spent");

    // Confirmed at its price now: started (202), and billed exactly that.
    let (status, started) = desk.confirm(reroll, body.clone()).await;
    assert_eq!(status, 202, "{started}");
    wait_until("the desk's reroll billed", || {
        env.sandbox.ledger().len() >= calls + 4
    })
    .await;
    desk.wait_status("r", "succeeded").await;
    assert_eq!(
        billed(&env) - billed_before,
        CLEAN0,
        "billed exactly the price confirmed"
    );
    assert_eq!(env.sandbox.ledger().len(), calls + 4);
    desk.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_desk_continues_a_stopped_run_for_exactly_the_rest() {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, None);
    let sample = c
        .imgpipe(&["run", "shots.yaml", "--items", "mug", "--run-id", "s"])
        .run()
        .await;
    assert_exit(&sample, 7);
    let desk = serve_with(&c, &["--retry-base-ms", "1"]).await;
    let path = "/api/runs/s/continue";
    let (status, priced) = desk.post(path, serde_json::json!({"dry_run": true})).await;
    assert_eq!(status, 200, "{priced}");
    assert_eq!(billed(&env), ITEM, "a dry run spends nothing");
    let cli = c.plain(&["resume", "s", "--dry-run", "--json"]).run().await;
    assert_eq!(priced["credits"], json_stdout(&cli)["credits"]);
    assert_eq!(priced["credits"], 2 * ITEM, "{priced}");
    let before = billed(&env);
    let (status, started) = desk
        .post(path, confirmed_at(&serde_json::json!({}), &priced))
        .await;
    assert_eq!(status, 202, "{started}");
    desk.wait_status("s", "succeeded").await;
    assert_eq!(billed(&env) - before, 2 * ITEM, "billed exactly the rest");
    desk.stop().await;
}

/// The text of the first `<td class="…">` after `row` (a `data-…` attribute) in `page`.
fn cell<'p>(page: &'p str, row: &str, class: &str) -> &'p str {
    let at = page
        .find(row)
        .unwrap_or_else(|| panic!("no row {row} in the page:\n{page}"));
    let open = format!("<td class=\"{class}\">");
    let from = page[at..]
        .find(&open)
        .map(|i| at + i + open.len())
        .unwrap_or_else(|| panic!("no cell {class} after {row}:\n{page}"));
    &page[from..from + page[from..].find('<').unwrap()]
}

#[tokio::test(flavor = "multi_thread")]
async fn the_home_shows_the_runs_the_caps_and_the_ledger_as_the_cli_computes_them() {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, None);
    let set = c
        .plain(&["cap", "set", "daily", "--credits", "1000", "--per", "day"])
        .run()
        .await;
    assert_exit(&set, 0);
    c.done().await;
    let desk = serve(&c).await;
    let r = http()
        .get(format!("{}/", desk.base))
        .header("authorization", format!("Bearer {}", desk.token))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let page = r.text().await.unwrap();

    // The run, linking to its page, with what `runs --json` says of its money.
    let runs = json_stdout(&c.plain(&["runs", "--json"]).run().await);
    assert!(page.contains(r#"<a href="/runs/r">r</a>"#), "{page}");
    assert_eq!(cell(&page, r#"data-run="r""#, "status"), "succeeded");
    assert_eq!(runs[0]["credits_billed"], 3 * ITEM);
    assert!(
        page.contains(&format!("<td class=\"n\">{}</td>", 3 * ITEM)),
        "billed shown: {page}"
    );

    // The cap: limit, spent and left as `cap list --json` computes them.
    let caps = json_stdout(&c.plain(&["cap", "list", "--json"]).run().await);
    let cap = &caps[0];
    assert_eq!(cap["spent"], 3 * ITEM, "{caps}");
    for (class, field) in [
        ("n limit", "credits"),
        ("n spent", "spent"),
        ("n left", "left"),
    ] {
        assert_eq!(
            cell(&page, r#"data-cap="daily""#, class),
            cap[field].to_string(),
            "{field}"
        );
    }

    // Today's line of the ledger, as `spend --json` computes it.
    let spend = json_stdout(&c.plain(&["spend", "--json"]).run().await);
    let today = spend["groups"][0]["group"].as_str().unwrap().to_owned();
    assert_eq!(
        cell(&page, &format!("data-day=\"{today}\""), "n billed"),
        spend["groups"][0]["credits_billed"].to_string()
    );
    desk.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn on_sigterm_the_desk_stops_accepting_lets_its_reroll_reach_its_safe_point_and_exits_0() {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, None);
    c.done().await;
    let desk = serve_with(&c, &["--retry-base-ms", "1"]).await;
    let calls = env.sandbox.ledger().len();

    // The desk's reroll is held at the sandbox's gate, its first call in flight.
    env.sandbox.hold_calls();
    let (status, started) = desk
        .confirm(
            "/api/runs/r/reroll",
            serde_json::json!({"tasks": ["mug/clean[0]"]}),
        )
        .await;
    assert_eq!(status, 202, "{started}");
    assert_eq!(started["credits"], CLEAN0, "{started}");
    wait_until("the desk's reroll call held", || {
        env.sandbox.held_calls() == 1
    })
    .await;

    // SIGTERM: the desk accepts nothing more while its call is still in flight...
    send_signal(desk.child.id().unwrap(), libc::SIGTERM);
    let base = desk.base.clone();
    wait_until_async("the desk refusing connections after SIGTERM", || async {
        http().get(format!("{base}/api/runs")).send().await.is_err()
    })
    .await;
    assert_eq!(env.sandbox.held_calls(), 1, "the call is still held");

    // ...and once the call is answered, it records it and exits 0.
    env.sandbox.release_calls();
    let err = desk.ended().await;
    assert_eq!(
        env.sandbox.ledger().len(),
        calls + 1,
        "the call in flight billed once, nothing dispatched after it: {err}"
    );
    let db = Db::read(&c.state).await;
    let clean0 = db
        .tasks
        .iter()
        .find(|t| t.name() == "mug/clean[0]")
        .expect("mug/clean[0]");
    assert_eq!(clean0.status, "succeeded", "the call's result is kept");

    // The run is resumable, and its rest pays only what was not paid.
    let resumed = c.imgpipe(&["resume", "r"]).run().await;
    assert_exit(&resumed, 0);
    assert_eq!(
        billed(&env),
        3 * ITEM + CLEAN0,
        "the reroll's chain billed exactly once in all"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn work_started_at_the_desk_is_followed_to_its_end_with_the_clis_error_and_hint() {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, None);
    c.done().await;
    let desk = serve_with(&c, &["--retry-base-ms", "1"]).await;
    let work = |desk: &Served| {
        let url = format!("{}/api/runs/r/work", desk.base);
        let bearer = format!("Bearer {}", desk.token);
        async move {
            let r = http()
                .get(url)
                .header("authorization", bearer)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            r.json::<serde_json::Value>().await.unwrap()
        }
    };
    assert_eq!(work(&desk).await, serde_json::json!({"state": "none"}));
    let calls = env.sandbox.ledger().len();

    // Every call refused as invalid: the reroll cannot be done, and says why as the CLI does.
    env.sandbox.refuse_next(usize::MAX);
    let (status, started) = desk
        .confirm(
            "/api/runs/r/reroll",
            serde_json::json!({"tasks": ["mug/clean[0]"]}),
        )
        .await;
    assert_eq!(status, 202, "{started}");
    wait_until_async("the desk's reroll ended", || async {
        work(&desk).await["state"] != "going"
    })
    .await;
    let ended = work(&desk).await;
    env.sandbox.refuse_next(0);
    assert_eq!(ended["state"], "failed", "{ended}");
    assert_eq!(ended["kind"], "reroll");
    assert_eq!(ended["credits"], CLEAN0);
    let error = ended["error"].as_str().unwrap_or_default();
    assert!(
        has_phrase(error, "the reroll of mug/clean[0] could not be done"),
        "{ended}"
    );
    let hint = ended["hint"].as_str().unwrap_or_default();
    assert!(
        has_phrase(
            hint,
            "nothing was billed and nothing changed: run r is succeeded as before"
        ),
        "{ended}"
    );
    assert_eq!(env.sandbox.ledger().len(), calls, "nothing billed");
    desk.stop().await;
}

/// A task that never ran, named while its input is not made (a run stopped after its first
/// step): the CLI's dry run says so and exits 2, the desk's dry run says the same, and a
/// confirm is refused at once rather than accepted and undone. Nothing is billed.
#[tokio::test(flavor = "multi_thread")]
async fn a_reroll_of_a_task_whose_input_is_not_made_is_refused_before_it_is_confirmed() {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, None);
    let until = c
        .imgpipe(&["run", "shots.yaml", "--until", "shot", "--run-id", "u"])
        .run()
        .await;
    assert_exit(&until, 7);
    let calls = env.sandbox.ledger().len();
    let why = "mug/wide[0] never ran: it waits on mug/clean[0], which has no output yet";

    let cli = c
        .plain(&["reroll", "u", "mug/wide", "--dry-run"])
        .run()
        .await;
    assert_exit(&cli, 2);
    assert!(has_phrase(&cli.stderr(), why), "{}", cli.stderr());

    let desk = serve_with(&c, &["--retry-base-ms", "1"]).await;
    let tasks = serde_json::json!(["mug/wide"]);
    let (status, priced) = desk
        .post(
            "/api/runs/u/reroll",
            serde_json::json!({"tasks": tasks, "dry_run": true}),
        )
        .await;
    assert_eq!(status, 400, "{priced}");
    assert!(has_phrase(&priced.to_string(), why), "{priced}");
    let (status, refused) = desk
        .post(
            "/api/runs/u/reroll",
            serde_json::json!({"tasks": tasks, "credits": 10, "revision": "0123456789abcdef"}),
        )
        .await;
    assert_eq!(status, 400, "{refused}");
    assert!(has_phrase(&refused.to_string(), why), "{refused}");
    assert_eq!(env.sandbox.ledger().len(), calls, "nothing billed");
    desk.stop().await;
}

/// A step for every item (`*/clean`) on a sample of two items of three: the desk prices it as
/// `imgpipe reroll s '*/clean' --dry-run --json` does (the clean of the two items that ran and
/// what is downstream of them; the third item, which never ran, is left alone), and a
/// confirm at that price bills exactly it.
async fn a_step_for_every_item(pg: Option<String>) {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, pg);
    let sample = c
        .imgpipe(&["run", "shots.yaml", "--items", "mug,lamp", "--run-id", "s"])
        .run()
        .await;
    assert_exit(&sample, 7);
    let desk = serve_with(&c, &["--retry-base-ms", "1"]).await;
    let reroll = "/api/runs/s/reroll";
    let tasks = serde_json::json!(["*/clean"]);
    let calls = env.sandbox.ledger().len();

    let (status, priced) = desk
        .post(reroll, serde_json::json!({"tasks": tasks, "dry_run": true}))
        .await;
    assert_eq!(status, 200, "{priced}");
    let cli = c
        .plain(&["reroll", "s", "*/clean", "--dry-run", "--json"])
        .run()
        .await;
    assert_exit(&cli, 0);
    let cli = json_stdout(&cli);
    assert_eq!(priced["credits"], cli["credits"], "{priced}\n{cli}");
    assert_eq!(priced["tasks"], cli["tasks"]);
    // Both indexes of clean for the two items that ran, and their chains downstream.
    let price = 2 * 2 * CLEAN0;
    assert_eq!(priced["credits"], price, "{priced}");
    let items: std::collections::BTreeSet<&str> = priced["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["item"].as_str().unwrap())
        .collect();
    assert_eq!(
        items,
        ["lamp", "mug"].into(),
        "the item that never ran is left alone: {priced}"
    );
    assert_eq!(
        env.sandbox.ledger().len(),
        calls,
        "a dry run spends nothing"
    );

    let before = billed(&env);
    let (status, started) = desk
        .post(
            reroll,
            confirmed_at(&serde_json::json!({"tasks": tasks}), &priced),
        )
        .await;
    assert_eq!(status, 202, "{started}");
    let work = desk.work_ended("s").await;
    assert_eq!(work["state"], "done", "{work}");
    assert_eq!(
        billed(&env) - before,
        price,
        "billed exactly the price confirmed"
    );
    assert_eq!(env.sandbox.ledger().len(), calls + 2 * 8);
    desk.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_desk_prices_a_step_for_every_item_as_the_cli_and_pays_exactly_it() {
    a_step_for_every_item(None).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn on_postgres_the_desk_prices_a_step_for_every_item_as_the_cli_and_pays_exactly_it() {
    let Some(pg) = postgres_database("desk_every").await else {
        return;
    };
    a_step_for_every_item(Some(pg.to_string())).await;
    drop(pg);
}
