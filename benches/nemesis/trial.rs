//! One trial: the sandbox in this process, the hosts as child processes of the binary, each
//! started and stopped at points of the run's progress, then every process stopped, the faults
//! quieted and one last resume; then what the invariants read.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command as Process, Stdio};
use std::time::{Duration, Instant};

use imgpipe::sandbox::{BadImages, Config, Faults, RateScope, Sandbox};

use super::scenario::{Backend, Command, Fate, Scenario};

/// How long any process of a trial may live, at the least: past it, a process still running
/// while the trial makes no progress for [`STALL_BOUND`] is killed and the trial fails
/// `process_bound`. The SIGTERM'd get `--grace` plus the time to record their end.
pub const PROCESS_BOUND: Duration = Duration::from_secs(120);
/// How long a trial may go without progress (a call billed, an image downloaded) while a
/// process of it lives past [`PROCESS_BOUND`]. A hang makes no progress; a large night on a
/// loaded machine makes it slowly. A bound in wall time alone failed the second for being slow
/// (a night of 570 tasks on PostgreSQL, killed at its bound of 177 s while storing 3 tasks a
/// second, at a load of 20), which no invariant should depend on.
const STALL_BOUND: Duration = Duration::from_secs(60);
const RUN_ID: &str = "r";

/// What a trial leaves for the invariants.
pub struct Outcome {
    pub state: String,
    pub dir: PathBuf,
    /// Every file under the output directory after each phase: path → sha256.
    pub snapshots: Vec<BTreeMap<String, String>>,
    /// Confirms accepted (202, exit 0): their revision and credits.
    pub accepted: Vec<(String, u64)>,
    /// Processes that outlived [`PROCESS_BOUND`].
    pub overdue: Vec<String>,
    pub log: Vec<String>,
    /// What the run had planned before any change was confirmed.
    pub planned_before_confirms: Option<u64>,
    /// What `imgpipe status RUN --json` told after the last resume (what a user reads: a
    /// run whose process is gone is told `interrupted`), or why it could not be read.
    pub told: Result<serde_json::Value, String>,
}

pub struct Env<'a> {
    pub binary: &'a str,
    pub rt: &'a tokio::runtime::Runtime,
    pub mutate: Option<&'a str>,
    /// PostgreSQL admin URL, for PostgreSQL trials.
    pub postgres: Option<&'a str>,
}

pub fn sandbox_config(s: &Scenario) -> Config {
    let f = &s.faults;
    Config {
        key: Some("sbx_nemesis_key".into()),
        balance: 100_000_000,
        latency: Duration::from_millis(f.latency_ms),
        jitter: Duration::from_millis(f.jitter_ms),
        rate_limit: f.account_rate.map(|r| r as f64),
        rate_scope: RateScope::Paid,
        faults: Faults {
            server_error: f.server_error,
            rate_limit: f.rate_limit,
            drop_after_billing: f.drop,
            gateway_timeout: f.gateway,
            partial_answer: f.partial,
            truncate_download: f.truncate,
            seed: s.seed,
        },
        bad_images: BadImages {
            blank: s.checks.as_ref().map_or(0.0, |c| c.blank),
            duplicate: s.checks.as_ref().map_or(0.0, |c| c.duplicate),
            ..BadImages::default()
        },
        ..Config::default()
    }
}

struct Proc {
    name: String,
    child: Child,
    started: Instant,
    billed_at_start: u64,
    downloads_at_start: u64,
    fate: Fate,
    signalled: bool,
}

pub struct Trial<'a> {
    pub env: &'a Env<'a>,
    pub s: &'a Scenario,
    pub sandbox: &'a Sandbox,
    pub dir: PathBuf,
    pub state: String,
    /// The URL the hosts use for the state (the proxy's, on PostgreSQL).
    pub host_state: String,
    pub proxy: Option<&'a super::proxy::Proxy>,
    pub out: Outcome,
}

impl Trial<'_> {
    /// Waits while the run's row says `running`, until it would be past its bound.
    fn wait_while_running(&self) {
        let (started, mut live) = (Instant::now(), Liveness::new(self.sandbox));
        while self
            .env
            .rt
            .block_on(super::db::run_status(&self.state, RUN_ID))
            .as_deref()
            == Some("running")
            && !live.overdue(self.sandbox, started)
        {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn command(&self, args: &[&str]) -> Process {
        let mut cmd = Process::new(self.env.binary);
        cmd.args(args)
            .current_dir(&self.dir)
            .env("HOME", &self.dir)
            .env("XDG_STATE_HOME", self.dir.join("xdg"))
            .env("IMGPIPE_BASE_URL", self.sandbox.base_url().as_str())
            .env("IMGPIPE_API_KEY", self.sandbox.key())
            .env("IMGPIPE_STATE", &self.host_state)
            .env_remove("IMGPIPE_TEST_CRASH_AT")
            .stdin(Stdio::null());
        match self.env.mutate {
            Some(m) => cmd.env("IMGPIPE_TEST_MUTATE", m),
            None => cmd.env_remove("IMGPIPE_TEST_MUTATE"),
        };
        cmd
    }

    fn spawn(&mut self, name: &str, args: &[&str], fate: Fate) -> Proc {
        let n = self.out.log.len();
        let log = std::fs::File::create(self.dir.join(format!("p{n}-{name}.log"))).unwrap();
        let mut cmd = self.command(args);
        cmd.stdout(log.try_clone().unwrap()).stderr(log);
        let child = cmd.spawn().expect("spawn imgpipe");
        self.out
            .log
            .push(format!("started {name}: imgpipe {}", args.join(" ")));
        let stats = self.sandbox.stats();
        Proc {
            name: name.into(),
            child,
            started: Instant::now(),
            billed_at_start: stats.billed,
            downloads_at_start: stats.downloads,
            fate,
            signalled: false,
        }
    }

    /// Watches `procs` (and starts `pending` at their points) until every one has ended.
    fn watch(&mut self, mut procs: Vec<Proc>, mut pending: Vec<(u64, String, Vec<String>, Fate)>) {
        let mut last_progress = Instant::now();
        let mut seen_billed = self.sandbox.stats().billed;
        let mut live = Liveness::new(self.sandbox);
        loop {
            let stats = self.sandbox.stats();
            if stats.billed != seen_billed {
                seen_billed = stats.billed;
                last_progress = Instant::now();
            }
            if let Some(at) = self.s.faults.expire_urls_at
                && stats.billed >= at
                && !self.out.log.iter().any(|l| l == "urls expired")
            {
                self.sandbox.expire_urls();
                self.out.log.push("urls expired".into());
            }
            let mut i = 0;
            while i < pending.len() {
                let all_ended = procs.is_empty();
                if stats.billed >= pending[i].0 || all_ended {
                    let (_, name, args, fate) = pending.remove(i);
                    let args: Vec<&str> = args.iter().map(String::as_str).collect();
                    let p = self.spawn(&name, &args, fate);
                    procs.push(p);
                } else {
                    i += 1;
                }
            }
            for p in &mut procs {
                if p.signalled {
                    continue;
                }
                let billed = stats.billed.saturating_sub(p.billed_at_start);
                let downloads = stats.downloads.saturating_sub(p.downloads_at_start);
                let signal = match p.fate {
                    Fate::Ends => None,
                    Fate::KillAtBilled(at) => (billed >= at).then_some(libc::SIGKILL),
                    Fate::KillAtDownload(at) => (downloads >= at).then_some(libc::SIGKILL),
                    Fate::TermAtBilled(at) => (billed >= at).then_some(libc::SIGTERM),
                    Fate::DatabaseCutAtBilled(at) => {
                        if billed >= at
                            && let Some(proxy) = self.proxy
                        {
                            proxy.cut();
                            self.out.log.push(format!("database cut ({})", p.name));
                            p.signalled = true;
                        }
                        None
                    }
                };
                if let Some(sig) = signal {
                    // SAFETY: a plain kill(2) of our own child, not yet reaped.
                    unsafe { libc::kill(p.child.id() as libc::pid_t, sig) };
                    p.signalled = true;
                    self.out.log.push(format!(
                        "{} {} after {billed} billed, {downloads} downloads",
                        if sig == libc::SIGKILL {
                            "kill -9"
                        } else {
                            "SIGTERM"
                        },
                        p.name
                    ));
                }
            }
            procs.retain_mut(|p| match p.child.try_wait() {
                Ok(Some(status)) => {
                    self.out.log.push(format!(
                        "{} ended: {status} after {:.1}s",
                        p.name,
                        p.started.elapsed().as_secs_f64()
                    ));
                    false
                }
                _ => {
                    if live.overdue(self.sandbox, p.started) {
                        let _ = p.child.kill();
                        let _ = p.child.wait();
                        self.out.overdue.push(format!(
                            "{} still running after {:.1}s, {} (killed)",
                            p.name,
                            p.started.elapsed().as_secs_f64(),
                            live.idle()
                        ));
                        false
                    } else {
                        true
                    }
                }
            });
            // A cut database stays cut a while (the processes' own bounds apply), then heals.
            if let Some(proxy) = self.proxy
                && proxy.is_cut()
                && last_progress.elapsed() > Duration::from_secs(15)
            {
                proxy.heal();
                self.out.log.push("database healed".into());
            }
            if procs.is_empty() && pending.is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        if let Some(proxy) = self.proxy {
            proxy.heal();
        }
    }

    fn snapshot(&mut self) {
        let root = self.dir.join("out");
        let mut files = BTreeMap::new();
        walk(&root, &root, &mut files);
        self.out.snapshots.push(files);
    }

    fn run_one(&mut self, name: &str, args: &[&str]) {
        let p = self.spawn(name, args, Fate::Ends);
        self.watch(vec![p], vec![]);
    }

    pub fn play(&mut self) {
        let s = self.s;
        std::fs::write(self.dir.join("nemesis.yaml"), s.pipeline_yaml()).unwrap();
        let common = ["--grace", "5", "--retry-base-ms", "1"];
        let mut first: Vec<String> = ["run", "nemesis.yaml", "--run-id", RUN_ID, "--out", "out"]
            .iter()
            .map(|a| a.to_string())
            .collect();
        first.extend(common.iter().map(|a| a.to_string()));
        let mut pending = Vec::new();
        for (i, h) in s.hosts.iter().enumerate() {
            let args = match h.command {
                Command::Run => first.clone(),
                Command::Resume { wait } => {
                    let mut a = vec!["resume".to_string(), RUN_ID.to_string()];
                    if wait {
                        a.push("--wait".into());
                    }
                    a.extend(common.iter().map(|a| a.to_string()));
                    a
                }
            };
            pending.push((h.start_at_billed, format!("host{i}"), args, h.fate));
        }
        // The first host starts at once; the others at their points.
        let (_, name, args, fate) = pending.remove(0);
        let args_ref: Vec<&str> = args.iter().map(String::as_str).collect();
        let p = self.spawn(&name, &args_ref, fate);
        self.watch(vec![p], pending);
        self.snapshot();
        // The faults still on: a resume to bring the run to an end, so that changes can be
        // confirmed on it.
        let resume = ["resume", RUN_ID, "--grace", "5", "--retry-base-ms", "1"];
        self.run_one("resume", &resume);
        self.snapshot();
        if let Some(c) = &s.confirms {
            self.out.planned_before_confirms = Some(self.planned());
            self.confirm(c);
            self.snapshot();
        }
        self.sandbox.quiet_faults();
        self.out.log.push("faults quieted".into());
        self.run_one("final", &resume);
        self.snapshot();
        self.out.told = self.told();
    }

    /// `imgpipe status RUN --json`, as a user would ask it once the last resume ended, within
    /// [`PROCESS_BOUND`]: a status that hangs is killed and told as overdue.
    fn told(&mut self) -> Result<serde_json::Value, String> {
        let (out, err) = (self.dir.join("status.json"), self.dir.join("status.log"));
        let file = |p: &Path| std::fs::File::create(p).map_err(|e| format!("{}: {e}", p.display()));
        let mut child = self
            .command(&["status", RUN_ID, "--json"])
            .stdout(file(&out)?)
            .stderr(file(&err)?)
            .spawn()
            .map_err(|e| format!("cannot run imgpipe status: {e}"))?;
        let started = Instant::now();
        let status = loop {
            if let Ok(Some(status)) = child.try_wait() {
                break status;
            }
            if started.elapsed() > PROCESS_BOUND {
                let _ = child.kill();
                let _ = child.wait();
                self.out.overdue.push(format!(
                    "imgpipe status, still running after {PROCESS_BOUND:?} (killed)"
                ));
                return Err("imgpipe status did not answer".into());
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let read = |p: &Path| std::fs::read(p).unwrap_or_default();
        serde_json::from_slice(&read(&out)).map_err(|e| {
            format!(
                "imgpipe status exited {:?} without a JSON status ({e}): {}",
                status.code(),
                String::from_utf8_lossy(&read(&err)).trim()
            )
        })
    }

    fn planned(&self) -> u64 {
        let state = self.state.clone();
        self.env
            .rt
            .block_on(async move { super::db::read(&state).await })
            .ok()
            .and_then(|db| db.runs.first().map(|r| r.credits_planned))
            .unwrap_or(0)
    }

    /// The desk's confirms of one dry run, several at once, a command line's with them, one
    /// late; the desk killed at a point of the reroll's progress or stopped at the end.
    fn confirm(&mut self, c: &super::scenario::Confirms) {
        use std::io::BufRead;
        let n = self.out.log.len();
        let log = std::fs::File::create(self.dir.join(format!("p{n}-desk.log"))).unwrap();
        let mut cmd = self.command(&["review", "--no-open", "--retry-base-ms", "1"]);
        cmd.stdout(Stdio::piped()).stderr(log);
        let mut desk = cmd.spawn().expect("spawn the desk");
        let started = Instant::now();
        self.out.log.push("started the desk".into());
        // Its address, its first line, within the bound: a desk that hangs before it is killed.
        let mut lines = std::io::BufReader::new(desk.stdout.take().unwrap()).lines();
        let (tx, said) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(lines.next());
            for _ in lines {}
        });
        let Ok(Some(Ok(first))) = said.recv_timeout(PROCESS_BOUND) else {
            let _ = desk.kill();
            let _ = desk.wait();
            self.out.log.push("the desk said nothing".into());
            if started.elapsed() >= PROCESS_BOUND {
                self.out.overdue.push(format!(
                    "the desk, no address after {PROCESS_BOUND:?} (killed)"
                ));
            }
            return;
        };
        let url = url::Url::parse(&first).expect("the desk's URL");
        let token = url
            .query_pairs()
            .find(|(k, _)| k == "token")
            .map(|(_, v)| v.into_owned())
            .unwrap_or_default();
        let base = format!("http://127.0.0.1:{}", url.port().unwrap_or(0));
        let path = format!("{base}/api/runs/{RUN_ID}/reroll");
        let http = reqwest::Client::builder().no_proxy().build().unwrap();
        let post = |body: serde_json::Value| {
            let (http, path, token, base) =
                (http.clone(), path.clone(), token.clone(), base.clone());
            async move {
                match http
                    .post(&path)
                    .header("authorization", format!("Bearer {token}"))
                    .header("origin", &base)
                    .json(&body)
                    .send()
                    .await
                {
                    Ok(r) => {
                        let status = r.status().as_u16();
                        (status, r.json().await.unwrap_or(serde_json::Value::Null))
                    }
                    Err(e) => (0, serde_json::json!({"error": e.to_string()})),
                }
            }
        };
        let tasks = serde_json::json!([c.target]);
        let (status, priced) = self
            .env
            .rt
            .block_on(post(serde_json::json!({"tasks": tasks, "dry_run": true})));
        self.out.log.push(format!("dry run: {status} {priced}"));
        if status == 200
            && let (Some(credits), Some(revision)) =
                (priced["credits"].as_u64(), priced["revision"].as_str())
        {
            let confirm =
                serde_json::json!({"tasks": tasks, "credits": credits, "revision": revision});
            let mut cli = None;
            if c.cli_too {
                let credits = credits.to_string();
                let args = [
                    "reroll",
                    RUN_ID,
                    &c.target,
                    "--expect-credits",
                    &credits,
                    "--expect-revision",
                    revision,
                    "--grace",
                    "5",
                    "--retry-base-ms",
                    "1",
                ];
                cli = Some(self.spawn("cli-reroll", &args, Fate::Ends));
            }
            let billed_before = self.sandbox.stats().billed;
            let answers = self.env.rt.block_on(futures::future::join_all(
                (0..c.at_once).map(|_| post(confirm.clone())),
            ));
            for (status, answer) in &answers {
                self.out.log.push(format!("confirm: {status} {answer}"));
                if *status == 202 {
                    self.out.accepted.push((revision.to_owned(), credits));
                }
            }
            // Until the desk's work ends (the run no longer running), killing it at its point.
            let mut killed = false;
            let mut live = Liveness::new(self.sandbox);
            loop {
                if let Some(at) = c.kill_desk_at
                    && !killed
                    && self.sandbox.stats().billed - billed_before >= at
                {
                    let _ = desk.kill();
                    killed = true;
                    self.out
                        .log
                        .push(format!("kill -9 the desk after {at} billed"));
                }
                let status = self
                    .env
                    .rt
                    .block_on(super::db::run_status(&self.state, RUN_ID));
                if killed
                    || (status.as_deref() != Some("running")
                        && started.elapsed() > Duration::from_millis(300))
                {
                    break;
                }
                if live.overdue(self.sandbox, started) {
                    self.out
                        .overdue
                        .push(format!("the desk's reroll still running, {}", live.idle()));
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            if let Some(mut p) = cli {
                let (cli_start, mut live) = (p.started, Liveness::new(self.sandbox));
                let status = loop {
                    if let Ok(Some(st)) = p.child.try_wait() {
                        break Some(st);
                    }
                    if live.overdue(self.sandbox, cli_start) {
                        let _ = p.child.kill();
                        let _ = p.child.wait();
                        self.out
                            .overdue
                            .push(format!("the command-line reroll, {}", live.idle()));
                        break None;
                    }
                    std::thread::sleep(Duration::from_millis(5));
                };
                self.out.log.push(format!("cli reroll ended: {status:?}"));
                if status.is_some_and(|s| s.code() == Some(0)) {
                    self.out.accepted.push((revision.to_owned(), credits));
                }
            }
            if c.late && !killed {
                // Wait for the desk's run to end before the late confirm.
                self.wait_while_running();
                let (status, answer) = self.env.rt.block_on(post(confirm.clone()));
                self.out
                    .log
                    .push(format!("late confirm: {status} {answer}"));
                if status == 202 {
                    self.out.accepted.push((revision.to_owned(), credits));
                }
                std::thread::sleep(Duration::from_millis(300));
                self.wait_while_running();
            }
        }
        // SAFETY: a plain kill(2) of our own child, not yet reaped.
        unsafe { libc::kill(desk.id() as libc::pid_t, libc::SIGTERM) };
        let until = Instant::now() + Duration::from_secs(40);
        loop {
            if let Ok(Some(st)) = desk.try_wait() {
                self.out.log.push(format!("desk ended: {st}"));
                break;
            }
            if Instant::now() > until {
                let _ = desk.kill();
                let _ = desk.wait();
                self.out
                    .overdue
                    .push("the desk, 40 s after SIGTERM (killed)".into());
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// The trial's progress as the sandbox sees it (calls billed, images downloaded), and since
/// when it has not moved: what tells a hung process from a slow one.
struct Liveness {
    work: u64,
    since: Instant,
}

impl Liveness {
    fn new(sandbox: &Sandbox) -> Liveness {
        let stats = sandbox.stats();
        Liveness {
            work: stats.billed + stats.downloads,
            since: Instant::now(),
        }
    }

    /// Whether a process `started` then is past its bound: alive past [`PROCESS_BOUND`] while
    /// nothing was billed or downloaded for [`STALL_BOUND`].
    fn overdue(&mut self, sandbox: &Sandbox, started: Instant) -> bool {
        let stats = sandbox.stats();
        let work = stats.billed + stats.downloads;
        if work != self.work {
            (self.work, self.since) = (work, Instant::now());
        }
        started.elapsed() > PROCESS_BOUND && self.since.elapsed() > STALL_BOUND
    }

    /// How long the trial has gone without progress, said.
    fn idle(&self) -> String {
        format!(
            "nothing billed or downloaded for {:.1}s",
            self.since.elapsed().as_secs_f64()
        )
    }
}

fn walk(root: &Path, dir: &Path, files: &mut BTreeMap<String, String>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        if path.is_dir() {
            walk(root, &path, files);
        } else if let Ok(bytes) = std::fs::read(&path) {
            // Keyed by the whole path, as the state records an output's.
            let _ = root;
            files.insert(
                path.to_string_lossy().into_owned(),
                super::sha256_hex(&bytes),
            );
        }
    }
}

/// A fresh state for a trial: a SQLite file in `dir`, or a new PostgreSQL database.
pub fn fresh_state(env: &Env, s: &Scenario, dir: &Path) -> String {
    match s.backend {
        Backend::Sqlite => dir.join("state.db").to_string_lossy().into_owned(),
        Backend::Postgres => {
            let admin = env
                .postgres
                .expect("a PostgreSQL server for PostgreSQL trials");
            let name = format!("nemesis_{}_{:x}", std::process::id(), s.seed);
            env.rt.block_on(async {
                use sqlx::Connection;
                let mut conn = sqlx::PgConnection::connect(admin)
                    .await
                    .expect("reach the PostgreSQL server");
                let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                    "DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"
                )))
                .execute(&mut conn)
                .await;
                sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
                    .execute(&mut conn)
                    .await
                    .expect("create the trial's database");
                let _ = conn.close().await;
            });
            let mut url = url::Url::parse(admin).expect("a PostgreSQL URL");
            url.set_path(&name);
            url.to_string()
        }
    }
}

/// Drops a PostgreSQL trial's database.
pub fn drop_state(env: &Env, state: &str) {
    let (Some(admin), true) = (env.postgres, state.starts_with("postgres")) else {
        return;
    };
    let name = url::Url::parse(state)
        .map(|u| u.path().trim_start_matches('/').to_owned())
        .unwrap_or_default();
    env.rt.block_on(async {
        use sqlx::Connection;
        if let Ok(mut conn) = sqlx::PgConnection::connect(admin).await {
            let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"
            )))
            .execute(&mut conn)
            .await;
            let _ = conn.close().await;
        }
    });
}
