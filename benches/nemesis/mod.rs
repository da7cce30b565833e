//! The fault campaign of issue 43: seeded random trials, each a pipeline, a backend, one to
//! three hosts and a schedule of faults drawn from its seed, with every invariant checked after
//! the trial's last, quiet resume. See benches/README.md ("The fault campaign").

#![allow(dead_code, unreachable_pub, clippy::print_stdout, clippy::print_stderr)]

pub mod check;
pub mod db;
pub mod proxy;
pub mod rng;
pub mod scenario;
pub mod trial;

use std::collections::BTreeMap;
use std::time::Instant;

use scenario::{Backend, Scenario};
use sha2::Digest;

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(sha2::Sha256::digest(bytes))
}

#[derive(Debug, Default)]
pub struct Args {
    pub trials: u64,
    pub seed: u64,
    pub json: bool,
    pub mutate: Option<String>,
    pub list: bool,
    pub backends: Vec<Backend>,
    pub keep: bool,
    /// `--max-items N`: no trial draws more items (a short campaign, as CI runs).
    pub max_items: Option<u64>,
    /// `--jobs J`: trials run J at a time, each with its own sandbox, state and processes (a
    /// trial spends much of its time waiting on its processes, so a long run goes faster).
    pub jobs: usize,
    /// `--from A --to B`: only the campaign's trials A to B (from 1, as printed), so that a long
    /// run of `--trials N` can be played in pieces, each trial drawing the seed it would draw
    /// in the whole run.
    pub from: u64,
    pub to: Option<u64>,
}

pub fn parse(args: &[String]) -> Result<Args, String> {
    let mut a = Args {
        trials: 10,
        seed: 1,
        jobs: 1,
        from: 1,
        ..Args::default()
    };
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{name} needs a value"))
        };
        match arg.as_str() {
            "--trials" => {
                a.trials = value("--trials")?
                    .parse()
                    .map_err(|e| format!("--trials: {e}"))?
            }
            "--seed" => {
                a.seed = value("--seed")?
                    .parse()
                    .map_err(|e| format!("--seed: {e}"))?
            }
            "--json" => a.json = true,
            "--mutate" => a.mutate = Some(value("--mutate")?),
            "--list-mutations" => a.list = true,
            "--keep" => a.keep = true,
            "--from" => {
                a.from = value("--from")?
                    .parse()
                    .map_err(|e| format!("--from: {e}"))?
            }
            "--to" => a.to = Some(value("--to")?.parse().map_err(|e| format!("--to: {e}"))?),
            "--jobs" => {
                a.jobs = value("--jobs")?
                    .parse()
                    .map_err(|e| format!("--jobs: {e}"))?;
                if a.jobs == 0 {
                    return Err("--jobs: at least 1".into());
                }
            }
            "--max-items" => {
                a.max_items = Some(
                    value("--max-items")?
                        .parse()
                        .map_err(|e| format!("--max-items: {e}"))?,
                )
            }
            "--backend" => {
                a.backends = match value("--backend")?.as_str() {
                    "sqlite" => vec![Backend::Sqlite],
                    "postgres" => vec![Backend::Postgres],
                    "both" => vec![Backend::Sqlite, Backend::Postgres],
                    other => return Err(format!("--backend {other}: sqlite, postgres or both")),
                }
            }
            // cargo bench passes --bench to every bench binary.
            "--bench" => {}
            other => return Err(format!("unknown argument {other}")),
        }
    }
    let last = a.to.unwrap_or(a.trials);
    if a.from == 0 || a.from > last || last > a.trials {
        return Err(format!(
            "--from {} --to {last}: trials are numbered 1 to {} (--trials)",
            a.from, a.trials
        ));
    }
    if let Some(m) = &a.mutate
        && !imgpipe::failpoint::MUTATIONS.contains(&m.as_str())
    {
        return Err(format!("--mutate {m}: not one of --list-mutations"));
    }
    Ok(a)
}

/// What one trial found.
pub struct Report {
    pub seed: u64,
    pub scenario: Scenario,
    pub violations: Vec<check::Violation>,
    pub seconds: f64,
    pub log: Vec<String>,
    pub dir: std::path::PathBuf,
}

/// Runs the trial of scenario `s` and checks it.
pub fn trial(
    binary: &str,
    s: Scenario,
    mutate: Option<&str>,
    postgres: Option<&str>,
    keep: bool,
) -> Report {
    let started = Instant::now();
    let seed = s.seed;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let env = trial::Env {
        binary,
        rt: &rt,
        mutate,
        postgres,
    };
    let dir = tempfile::Builder::new()
        .prefix("nemesis-")
        .tempdir()
        .expect("a trial directory");
    let sandbox = rt
        .block_on(imgpipe::sandbox::Sandbox::start(trial::sandbox_config(&s)))
        .expect("the sandbox starts");
    let state = trial::fresh_state(&env, &s, dir.path());
    let proxy = (s.backend == Backend::Postgres).then(|| {
        let url = url::Url::parse(&state).expect("a PostgreSQL URL");
        proxy::Proxy::start(
            (
                url.host_str().unwrap_or("127.0.0.1").to_owned(),
                url.port().unwrap_or(5432),
            ),
            s.db_delay_ms,
        )
    });
    let host_state = match &proxy {
        Some(p) => {
            let mut url = url::Url::parse(&state).expect("a PostgreSQL URL");
            let _ = url.set_port(Some(p.port));
            url.to_string()
        }
        None => state.clone(),
    };
    let mut t = trial::Trial {
        env: &env,
        s: &s,
        sandbox: &sandbox,
        dir: dir.path().to_owned(),
        state: state.clone(),
        host_state,
        proxy: proxy.as_ref(),
        out: trial::Outcome {
            state: state.clone(),
            dir: dir.path().to_owned(),
            snapshots: Vec::new(),
            accepted: Vec::new(),
            overdue: Vec::new(),
            log: Vec::new(),
            planned_before_confirms: None,
            told: Err("not asked: the trial did not reach its end".into()),
        },
    };
    t.play();
    let out = t.out;
    // What each process did and when, beside its logs, for a trial kept (`--keep`) or failed.
    let scenario = serde_json::to_string(&s).unwrap_or_default();
    let told = format!("scenario: {scenario}\n{}\n", out.log.join("\n"));
    let _ = std::fs::write(dir.path().join("trial.log"), told);
    let violations = match rt.block_on(db::read(&state)) {
        Ok(db) => check::all(&s, &out, &db, &sandbox, &sandbox.ledger(), &sandbox.stats()),
        Err(e) => {
            let mut v = vec![check::Violation {
                invariant: "run_end",
                evidence: format!("the state cannot be read: {e}"),
            }];
            v.extend(check::overdue(&out));
            v
        }
    };
    drop(proxy);
    trial::drop_state(&env, &state);
    let kept = if keep || !violations.is_empty() {
        dir.keep()
    } else {
        dir.path().to_owned()
    };
    Report {
        seed,
        scenario: s,
        violations,
        seconds: started.elapsed().as_secs_f64(),
        log: out.log,
        dir: kept,
    }
}

/// The campaign: `--trials N --seed S [--json] [--mutate NAME] [--list-mutations]`; the exit
/// code (0 when no trial violated an invariant, 1 otherwise, 2 for a wrong argument).
pub fn main(binary: &str, args: &[String]) -> i32 {
    let a = match parse(args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("nemesis: {e}");
            return 2;
        }
    };
    if a.list {
        for m in imgpipe::failpoint::MUTATIONS {
            println!("{m}");
        }
        return 0;
    }
    let postgres = std::env::var("IMGPIPE_NEMESIS_POSTGRES")
        .ok()
        .or_else(|| std::env::var("IMGPIPE_TEST_POSTGRES").ok())
        .filter(|v| !v.is_empty());
    // Under CI the PostgreSQL trials are never left out for want of a server.
    let ci = std::env::var("CI").is_ok_and(|v| v.eq_ignore_ascii_case("true") || v == "1");
    let backends = if a.backends.is_empty() {
        if postgres.is_some() || ci {
            vec![Backend::Sqlite, Backend::Postgres]
        } else {
            vec![Backend::Sqlite]
        }
    } else {
        a.backends.clone()
    };
    if backends.contains(&Backend::Postgres) && postgres.is_none() {
        eprintln!(
            "nemesis: PostgreSQL trials need IMGPIPE_NEMESIS_POSTGRES (or IMGPIPE_TEST_POSTGRES)"
        );
        return 2;
    }
    let started = Instant::now();
    let mut failed = Vec::new();
    let mut by_invariant: BTreeMap<&str, u64> = check::INVARIANTS.iter().map(|i| (*i, 0)).collect();
    let mut by_backend: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    let (mut trials_run, mut first_violation) = (0, None);
    // A single trial replays its seed itself; a campaign's trials each draw theirs from it.
    let seed_of = |i: u64| {
        if a.trials == 1 {
            a.seed
        } else {
            rng::trial_seed(a.seed, i)
        }
    };
    let (first, last) = (a.from - 1, a.to.unwrap_or(a.trials));
    let next = std::sync::atomic::AtomicU64::new(first);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (tx, rx) = std::sync::mpsc::channel::<(u64, Report)>();
    std::thread::scope(|scope| {
        for _ in 0..a.jobs.min((last - first) as usize) {
            let tx = tx.clone();
            let (next, stop, backends, postgres, a) = (&next, &stop, &backends, &postgres, &a);
            scope.spawn(move || {
                use std::sync::atomic::Ordering;
                while !stop.load(Ordering::SeqCst) {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= last {
                        break;
                    }
                    let r = trial(
                        binary,
                        Scenario::draw(seed_of(i), backends, a.max_items),
                        a.mutate.as_deref(),
                        postgres.as_deref(),
                        a.keep,
                    );
                    if tx.send((i, r)).is_err() {
                        break;
                    }
                }
            });
        }
        drop(tx);
        for (i, r) in rx {
            let seed = r.seed;
            trials_run += 1;
            let slot = by_backend
                .entry(format!("{:?}", r.scenario.backend))
                .or_default();
            slot.0 += 1;
            eprintln!(
                "trial {}/{} seed {seed}: {:?}, {} items, {} steps, {} tasks, {} host(s){}: {} in {:.1}s",
                i + 1,
                a.trials,
                r.scenario.backend,
                r.scenario.items,
                r.scenario.steps.len(),
                r.scenario.tasks,
                r.scenario.hosts.len(),
                if r.scenario.confirms.is_some() {
                    ", confirms"
                } else {
                    ""
                },
                if r.violations.is_empty() {
                    "ok".to_owned()
                } else {
                    format!("{} VIOLATION(S)", r.violations.len())
                },
                r.seconds
            );
            if !r.violations.is_empty() {
                slot.1 += 1;
                let mut seen = std::collections::BTreeSet::new();
                for v in &r.violations {
                    if seen.insert(v.invariant) {
                        *by_invariant.entry(v.invariant).or_default() += 1;
                    }
                }
                eprintln!(
                    "  replay: cargo bench --bench nemesis -- --seed {seed} --trials 1{}{}",
                    if a.backends.len() == 1 {
                        format!(
                            " --backend {}",
                            format!("{:?}", a.backends[0]).to_lowercase()
                        )
                    } else {
                        String::new()
                    },
                    a.mutate
                        .as_deref()
                        .map(|m| format!(" --mutate {m}"))
                        .unwrap_or_default()
                        + &a.max_items
                            .map(|n| format!(" --max-items {n}"))
                            .unwrap_or_default()
                );
                eprintln!(
                    "  scenario: {}",
                    serde_json::to_string(&r.scenario).unwrap_or_default()
                );
                for l in &r.log {
                    eprintln!("  | {l}");
                }
                let mut told: BTreeMap<&str, usize> = BTreeMap::new();
                for v in &r.violations {
                    let n = told.entry(v.invariant).or_default();
                    *n += 1;
                    if *n <= 5 {
                        eprintln!("  VIOLATED {}: {}", v.invariant, v.evidence);
                    }
                }
                for (invariant, n) in told.iter().filter(|(_, n)| **n > 5) {
                    eprintln!("  VIOLATED {invariant}: {} more like these", n - 5);
                }
                eprintln!("  kept: {}", r.dir.display());
                failed.push(seed);
                first_violation = Some(first_violation.map_or(i + 1, |f: u64| f.min(i + 1)));
                // A mutation is proven caught by its first violation: the trials to it are the
                // figure, the rest would only repeat it.
                if a.mutate.is_some() {
                    eprintln!(
                        "nemesis: mutation {} caught at trial {}",
                        a.mutate.as_deref().unwrap_or_default(),
                        i + 1
                    );
                    // Trials already under way finish; no new one starts.
                    stop.store(true, std::sync::atomic::Ordering::SeqCst);
                }
            }
        }
    });
    let violations = failed.len() as u64;
    eprintln!(
        "nemesis: {trials_run} trial(s), {violations} with a violation, {:.0}s{}",
        started.elapsed().as_secs_f64(),
        a.mutate
            .as_deref()
            .map(|m| format!(" (mutation {m})"))
            .unwrap_or_default()
    );
    if a.json {
        let doc = serde_json::json!({
            "trials": trials_run,
            "of_campaign": {"trials": a.trials, "from": a.from, "to": a.to.unwrap_or(a.trials)},
            "violations": violations,
            "first_violation": first_violation,
            "failed_seeds": failed,
            "by_invariant": by_invariant,
            "by_backend": by_backend.iter().map(|(k, (n, v))| (k.to_lowercase(), serde_json::json!({"trials": n, "violations": v}))).collect::<serde_json::Map<_, _>>(),
            "seconds": started.elapsed().as_secs_f64().round(),
            "mutation": a.mutate,
        });
        println!("{doc}");
    }
    i32::from(violations > 0)
}
