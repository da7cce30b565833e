//! Promises of README's "Running pipelines" that no other test would miss if they broke: a
//! saved plan no longer holds once its items file or the service's price changed, even with
//! the pipeline file untouched (so its hash alone would let it through); and a run never
//! replaces a different file already at an output's name, nor pays again for that output;
//! and with no `--state` a run keeps its state where the `--state` row of the table says.
//! Then the defaults a run takes from the account (concurrency, rate), the smaller of two
//! budgets on `run`, `plan --reuse`, the depth-first order of the calls, the manifest's
//! `index` and `parent_job_id`, and where the run lock lives. Then a run killed while it makes
//! its database, the progress a run shows (a line every 10 s in cron, bars on a terminal), and
//! the longest chain first near a run's end. And a run on the embedded sandbox refused by a
//! later process.

use std::time::Duration;

use imgpipe::sandbox;

use crate::binary::Imgpipe;
use crate::common::*;
use crate::review_loop::items_with_outputs;
use crate::run::{config, edit_chain, state_path, write};

/// `imgpipe ARGS` in `dir` against `env`'s sandbox, its state in `dir`.
async fn on(env: &Env, dir: &std::path::Path, args: &[&str]) -> std::process::Output {
    let state = state_path(dir).display().to_string();
    Imgpipe::on(env, args)
        .cwd(dir)
        .state(&state)
        .run()
        .await
        .into()
}

/// Two generated items whose price is the service's word only: the file has no `pricing:`.
const SERVICE_PRICED: &str = r#"
version: 1
name: priced
output_dir: out
budget: { max_credits: 500 }
items: [{ id: a }, { id: b }]
steps:
  - id: shot
    generate: { prompt: "a {{ item.id }}" }
"#;

/// An edit chain over the items of `items.csv`.
const FROM_CSV: &str = r#"
version: 1
name: csv
output_dir: out
budget: { max_credits: 500 }
items_from: items.csv
steps:
  - id: clean
    erase: { image_url: "{{ item.url }}", object_name: the corner }
"#;

fn csv(ids: &[&str]) -> String {
    let mut text = String::from("id,url\n");
    for id in ids {
        text += &format!("{id},https://sandbox.invalid/assets/mug.png\n");
    }
    text
}

/// A sandbox stating `price` credits for a generated image in its models list.
async fn stating(price: u64) -> Env {
    start(sandbox::Config {
        generation_price: price,
        advertise_price: true,
        ..config()
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_saved_plan_is_refused_when_its_items_file_or_the_services_price_changed() {
    // The items file gains a row; the pipeline file stays byte for byte the same.
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", FROM_CSV);
    write(dir, "items.csv", &csv(&["mug", "lamp"]));
    assert_exit(
        &on(&env, dir, &["plan", "p.yaml", "--save", "plan.json"]).await,
        0,
    );
    write(dir, "items.csv", &csv(&["mug", "lamp", "vase"]));
    let o = on(&env, dir, &["run", "--plan", "plan.json", "--run-id", "r"]).await;
    assert_exit_without_panic(&o, 3);
    let err = stderr(&o);
    assert!(
        has_phrase(&err, "the items changed (2 then, 3 now)"),
        "{err}"
    );
    assert!(
        !err.contains("pipeline file"),
        "the file did not change: {err}"
    );
    assert_nothing_billed(&env);

    // The service's price rises from 4 to 6 between the plan and the run.
    let before = stating(4).await;
    let dir = before.dir.path();
    write(dir, "p.yaml", SERVICE_PRICED);
    let o = on(&before, dir, &["plan", "p.yaml", "--save", "plan.json"]).await;
    assert_exit(&o, 0);
    let now = stating(6).await;
    let o = on(&now, dir, &["run", "--plan", "plan.json", "--run-id", "r"]).await;
    assert_exit_without_panic(&o, 3);
    let err = stderr(&o);
    assert!(
        err.contains("the prices changed (a generated image: 4 then, 6 now)"),
        "{err}"
    );
    assert!(
        !err.contains("pipeline file"),
        "the file did not change: {err}"
    );
    assert_nothing_billed(&now);
    assert_nothing_billed(&before);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_never_replaces_a_different_file_at_an_outputs_name() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(1, None));
    let theirs = dir.join("out/r/i00/big.png");
    std::fs::create_dir_all(theirs.parent().unwrap()).unwrap();
    std::fs::write(&theirs, b"someone else's file").unwrap();

    let o = on(&env, dir, &["run", "p.yaml", "--run-id", "r"]).await;
    assert_exit_without_panic(&o, 4);
    assert_eq!(
        std::fs::read(&theirs).unwrap(),
        b"someone else's file",
        "the file at the output's name was replaced"
    );
    let said = format!("{}{}", stdout(&o), stderr(&o));
    assert!(
        said.contains(&theirs.display().to_string()) || said.contains("i00/big.png"),
        "{said}"
    );
    // Each call paid once: the chain's downstream read the URL, and nothing was paid again.
    assert_eq!(env.sandbox.ledger().len(), 3, "{:?}", env.sandbox.ledger());
    let db = Db::read_file(&state_path(dir)).await;
    let big = db.find("i00", "big", 0).expect("the big task");
    let outputs = db.outputs_of(big.id);
    assert_eq!(outputs.len(), 1, "{outputs:?}");
    assert_eq!(outputs[0].path, None, "recorded as not stored: {outputs:?}");
    let error = outputs[0].download_error.as_deref().unwrap_or_default();
    assert!(
        error.contains("big.png"),
        "the failure names the file: {error}"
    );
    // The other outputs of the chain landed beside it.
    for name in ["clean.png", "cutout.png"] {
        assert!(dir.join("out/r/i00").join(name).is_file(), "{name}");
    }
}

/// `imgpipe run p.yaml --run-id ID` in `dir` with no `--state`, against `env`'s sandbox, or
/// the embedded one when `env` is `None`; `vars` set, XDG_STATE_HOME removed unless set.
async fn run_by_default(
    env: Option<&Env>,
    dir: &std::path::Path,
    id: &str,
    vars: &[(&str, String)],
) {
    let mut args = vec!["run", "p.yaml", "--run-id", id];
    if env.is_none() {
        args.push("--sandbox");
    }
    let mut cmd = Imgpipe::new(&args).cwd(dir).command();
    cmd.env_remove("XDG_STATE_HOME")
        .env("HOME", dir.join("home"));
    if let Some(env) = env {
        cmd.env("IMGPIPE_BASE_URL", env.sandbox.base_url().as_str())
            .env("IMGPIPE_API_KEY", env.sandbox.key());
    }
    for (name, value) in vars {
        cmd.env(name, value);
    }
    assert_exit_without_panic(&finish(cmd).await, 0);
}

/// Where a run keeps its state when no `--state` is given (README's `--state` row):
/// `IMGPIPE_STATE`, else `$XDG_STATE_HOME/imgpipe/state.db`, else
/// `~/.local/state/imgpipe/state.db`; `sandbox.db` beside it with `--sandbox`.
#[tokio::test(flavor = "multi_thread")]
async fn a_run_keeps_its_state_where_the_readme_says_by_default() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(1, None));
    let xdg = dir.join("xdg");
    let home_state = dir.join("home/.local/state/imgpipe");

    run_by_default(
        Some(&env),
        dir,
        "x",
        &[("XDG_STATE_HOME", xdg.display().to_string())],
    )
    .await;
    let db = Db::read_file(&xdg.join("imgpipe/state.db")).await;
    assert_eq!(db.run_status("x"), "succeeded");
    assert!(!home_state.exists(), "XDG_STATE_HOME comes before HOME");

    run_by_default(Some(&env), dir, "h", &[]).await;
    let db = Db::read_file(&home_state.join("state.db")).await;
    assert_eq!(db.run_status("h"), "succeeded");

    let named = dir.join("named.db");
    let vars = [
        ("IMGPIPE_STATE", named.display().to_string()),
        ("XDG_STATE_HOME", xdg.display().to_string()),
    ];
    run_by_default(Some(&env), dir, "e", &vars).await;
    assert_eq!(Db::read_file(&named).await.run_status("e"), "succeeded");
    assert_eq!(
        Db::read_file(&xdg.join("imgpipe/state.db"))
            .await
            .runs
            .len(),
        1
    );

    run_by_default(
        None,
        dir,
        "s",
        &[("XDG_STATE_HOME", xdg.display().to_string())],
    )
    .await;
    let db = Db::read_file(&xdg.join("imgpipe/sandbox.db")).await;
    assert_eq!(db.run_status("s"), "succeeded");
    assert_eq!(
        Db::read_file(&xdg.join("imgpipe/state.db"))
            .await
            .runs
            .len(),
        1
    );
}

/// `imgpipe ARGS --state DIR/state.db` in `dir` against `env`'s sandbox, started and left
/// running, its stderr read as it comes.
fn spawn_on(env: &Env, dir: &std::path::Path, args: &[&str]) -> Watched {
    let state = state_path(dir).display().to_string();
    let mut all = args.to_vec();
    all.extend_from_slice(&["--state", &state]);
    let mut cmd = Imgpipe::new(&all).cwd(dir).command();
    cmd.env("IMGPIPE_BASE_URL", env.sandbox.base_url().as_str())
        .env("IMGPIPE_API_KEY", env.sandbox.key());
    Watched::start(cmd)
}

/// How long the test leaves a held run to send calls beyond the account's limit before
/// looking. A correct run never sends them, so a slow machine can only let a wrong one go
/// unnoticed here; the whole run after it still catches it (it then sends 4 at once).
const GRACE: Duration = Duration::from_millis(500);

/// `--concurrency` unset and no `concurrency:` in the file: the account's limit (the
/// sandbox's `max_in_flight`, which its `GET /v1/account` states and which it enforces with a
/// 429) is the number of calls in flight, not the default 4.
#[tokio::test(flavor = "multi_thread")]
async fn without_a_concurrency_a_run_keeps_to_the_accounts_limit() {
    let env = start(sandbox::Config {
        max_in_flight: Some(2),
        ..config()
    })
    .await;
    let dir = env.dir.path();
    // Six items: six first steps ready at once, more than either limit.
    write(dir, "p.yaml", &edit_chain(6, None));
    let hold = env.sandbox.hold();
    let run = spawn_on(&env, dir, &["run", "p.yaml", "--run-id", "r", "--json"]);
    // A price only written down is proven by one call alone first; then the slots fill.
    wait_until("the first call held", || env.sandbox.held_calls() == 1).await;
    env.sandbox.let_through(1);
    wait_until("two calls held at the sandbox", || {
        env.sandbox.held_calls() == 2
    })
    .await;
    tokio::time::sleep(GRACE).await;
    let stats = env.sandbox.stats();
    assert_eq!(
        (stats.paid_requests, stats.rate_limited),
        (3, 0),
        "a call past the account's limit of 2 was sent: {stats:?}"
    );
    drop(hold);
    let o = run.finish().await;
    assert_exit_without_panic(&o, 0);
    let stats = env.sandbox.stats();
    assert_eq!(stats.rate_limited, 0, "{stats:?}");
    assert_eq!(stats.peak_in_flight, 2, "{stats:?}");
    assert_eq!(env.sandbox.ledger().len(), 18);
    let said = stderr(&o);
    assert!(
        said.contains("paid calls: up to 2 at once (the account's limits)"),
        "the run says whence its concurrency: {said}"
    );
}

/// imgpipe's limiter lets a burst of this many calls go at once (`exec/limiter.rs`).
const LIMITER_BURST: u64 = 2;

/// `--rate` unset and no `rate_limit:` in the file: the rate the account states paces every
/// paid call, so the service never has to answer 429 (without it, none is set until one).
#[tokio::test(flavor = "multi_thread")]
async fn without_a_rate_a_run_paces_its_calls_at_the_accounts_rate() {
    const RATE: u64 = 10;
    let env = start(sandbox::Config {
        rate_limit: Some(RATE as f64),
        rate_scope: sandbox::RateScope::Paid,
        ..config()
    })
    .await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(8, None));
    let o = on(&env, dir, &["run", "p.yaml", "--run-id", "r", "--json"]).await;
    assert_exit_without_panic(&o, 0);
    let stats = env.sandbox.stats();
    assert_eq!(stats.rate_limited, 0, "answered 429: {stats:?}");
    let said = stderr(&o);
    assert!(
        said.contains("at most 10 a second (the account's limits)"),
        "the run says whence its rate: {said}"
    );
    let mut times: Vec<u64> = env.sandbox.ledger().iter().map(|e| e.received_us).collect();
    times.sort_unstable();
    let n = times.len() as u64;
    assert_eq!(n, 24);
    // Calls in flight when the run starts (4 by default) may arrive in one burst; every other
    // call waited its turn: a lower bound, which a slow machine only raises.
    let floor_us = (n - LIMITER_BURST - 4) * 1_000_000 / RATE - 20_000;
    let span = times[times.len() - 1] - times[0];
    assert!(
        span >= floor_us,
        "{n} calls in {span} µs, less than {floor_us}: {times:?}"
    );
}

/// `budget.max_credits` and `--max-credits` both given to `run`: the smaller one refuses a
/// plan over it (exit 3, naming it), whichever of the two it is, before any call.
#[tokio::test(flavor = "multi_thread")]
async fn run_keeps_to_the_smaller_of_the_files_budget_and_max_credits() {
    let env = start(config()).await;
    let dir = env.dir.path();
    // Two items: 18 credits.
    write(dir, "p.yaml", &edit_chain(2, Some(100)));
    let o = on(
        &env,
        dir,
        &["run", "p.yaml", "--run-id", "f", "--max-credits", "10"],
    )
    .await;
    assert_exit_without_panic(&o, 3);
    let err = stderr(&o);
    assert!(
        err.contains("over the budget of 10 (--max-credits)"),
        "{err}"
    );
    assert_nothing_billed(&env);

    write(dir, "p.yaml", &edit_chain(2, Some(10)));
    let o = on(
        &env,
        dir,
        &["run", "p.yaml", "--run-id", "b", "--max-credits", "100"],
    )
    .await;
    assert_exit_without_panic(&o, 3);
    let err = stderr(&o);
    assert!(
        err.contains("over the budget of 10 (budget.max_credits)"),
        "{err}"
    );
    assert_nothing_billed(&env);

    // Both above the plan: it runs.
    write(dir, "p.yaml", &edit_chain(2, Some(100)));
    let o = on(
        &env,
        dir,
        &["run", "p.yaml", "--run-id", "ok", "--max-credits", "50"],
    )
    .await;
    assert_exit_without_panic(&o, 0);
    assert_eq!(START_BALANCE - env.sandbox.balance(), 18);
}

/// `imgpipe plan FILE --reuse` (or `reuse: true` in the file) says how many tasks earlier
/// runs' results would cover and the credits saved, and spends nothing.
#[tokio::test(flavor = "multi_thread")]
async fn plan_with_reuse_counts_the_tasks_reused_and_the_credits_saved() {
    let env = start(config()).await;
    let dir = env.dir.path();
    let original = edit_chain(3, None);
    write(dir, "p.yaml", &original);
    assert_exit(&on(&env, dir, &["run", "p.yaml", "--run-id", "a"]).await, 0);
    let paid = env.sandbox.ledger().len();
    assert_eq!(paid, 9);

    let o = on(&env, dir, &["plan", "p.yaml"]).await;
    assert_exit(&o, 0);
    assert!(!stdout(&o).contains("reuse:"), "{}", stdout(&o));

    let o = on(&env, dir, &["plan", "p.yaml", "--reuse"]).await;
    assert_exit(&o, 0);
    let text = stdout(&o);
    assert!(
        text.contains("reuse: 9 task(s) from earlier runs, saving 27 credits; 0 credits to pay"),
        "{text}"
    );

    // The upscale changed: the three erases are reused, the rest is to pay.
    let changed = original.replace("desired_increase: 2", "desired_increase: 4");
    write(dir, "p.yaml", &format!("reuse: true\n{changed}"));
    let o = on(&env, dir, &["plan", "p.yaml"]).await;
    assert_exit(&o, 0);
    let text = stdout(&o);
    assert!(
        text.contains("reuse: 3 task(s) from earlier runs, saving 6 credits"),
        "{text}"
    );
    assert_eq!(env.sandbox.ledger().len(), paid, "plan paid for nothing");
}

/// With one call at a time, an item's whole chain is billed before the next item's first
/// call (the ready tasks of items under way go first), up to the end-of-run phase: the last
/// `concurrency × depth` tasks, here the last item.
#[tokio::test(flavor = "multi_thread")]
async fn each_item_finishes_its_chain_before_the_next_item_starts() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(4, None));
    let o = on(
        &env,
        dir,
        &["run", "p.yaml", "--run-id", "r", "--concurrency", "1"],
    )
    .await;
    assert_exit_without_panic(&o, 0);
    let db = Db::read_file(&state_path(dir)).await;
    let by_job: std::collections::HashMap<&str, String> = db
        .tasks
        .iter()
        .filter_map(|t| Some((t.job_id.as_deref()?, format!("{}/{}", t.item, t.step))))
        .collect();
    let ledger = env.sandbox.ledger();
    let billed: Vec<&str> = ledger
        .iter()
        .map(|e| by_job[e.job_id.as_str()].as_str())
        .collect();
    let expected: Vec<String> = (0..4)
        .flat_map(|i| ["clean", "big", "cutout"].map(|s| format!("i{i:02}/{s}")))
        .collect();
    assert_eq!(
        billed, expected,
        "the order the sandbox billed the calls in"
    );
}

/// Two images a generation, each erased then upscaled.
const TWO_SHOTS: &str = r#"
version: 1
name: shots
output_dir: out
pricing: { generation: 4 }
items: [{ id: mug }, { id: lamp }]
steps:
  - id: shot
    generate: { prompt: "a {{ item.id }}", n: 2 }
  - id: clean
    erase: { from: shot, object_name: the corner }
  - id: big
    upscale: { from: clean, desired_increase: 2 }
"#;

/// `manifest.jsonl`'s `index` (which of a step's images) and `parent_job_id` (the job whose
/// output the call read), against the files' names and the jobs of the lines upstream.
#[tokio::test(flavor = "multi_thread")]
async fn the_manifest_gives_each_outputs_index_and_parent_job() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", TWO_SHOTS);
    let o = on(&env, dir, &["run", "p.yaml", "--run-id", "r"]).await;
    assert_exit_without_panic(&o, 0);
    let lines = crate::run::manifest(&dir.join("out/r"));
    assert_eq!(lines.len(), 12, "{lines:#?}");
    let line = |item: &str, step: &str, index: u64| {
        lines
            .iter()
            .find(|l| l["item"] == item && l["step"] == step && l["index"] == index)
            .unwrap_or_else(|| panic!("no line for {item}/{step} index {index}: {lines:#?}"))
    };
    for l in &lines {
        let name = format!(
            "{}/{}-{}.png",
            l["item"].as_str().unwrap(),
            l["step"].as_str().unwrap(),
            l["index"]
        );
        assert_eq!(l["path"], name.as_str(), "{l}");
    }
    for item in ["mug", "lamp"] {
        let shots = [line(item, "shot", 0), line(item, "shot", 1)];
        assert_eq!(shots[0]["job_id"], shots[1]["job_id"], "one generation");
        for index in 0..2 {
            let (shot, clean, big) = (
                line(item, "shot", index),
                line(item, "clean", index),
                line(item, "big", index),
            );
            assert!(shot["parent_job_id"].is_null(), "{shot}");
            assert_eq!(clean["parent_job_id"], shot["job_id"], "{clean}");
            assert_eq!(big["parent_job_id"], clean["job_id"], "{big}");
            assert_ne!(big["job_id"], clean["job_id"], "{big}");
        }
        assert_ne!(
            line(item, "clean", 0)["job_id"],
            line(item, "clean", 1)["job_id"]
        );
    }
}

/// While a run is in flight its lock is an OS file lock in `state.db.locks/` beside the
/// database, naming the run and its process; it is let go when the run ends.
#[tokio::test(flavor = "multi_thread")]
async fn a_running_run_holds_its_lock_in_a_file_beside_the_database() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(1, None));
    let hold = env.sandbox.hold();
    let run = spawn_on(&env, dir, &["run", "p.yaml", "--run-id", "r"]);
    wait_until("a call held at the sandbox", || {
        env.sandbox.held_calls() == 1
    })
    .await;
    let locks = dir.join("state.db.locks");
    let files = entries(&locks);
    assert_eq!(files.len(), 1, "{files:?}");
    let file = std::fs::File::open(&files[0]).unwrap();
    assert!(
        matches!(file.try_lock(), Err(std::fs::TryLockError::WouldBlock)),
        "{} is not locked while the run is in flight",
        files[0].display()
    );
    let holder: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&files[0]).unwrap()).unwrap();
    assert_eq!(holder["run_id"], "r", "{holder}");
    assert_eq!(holder["pid"], run.id(), "{holder}");
    drop(hold);
    assert_exit_without_panic(&run.finish().await, 0);
    assert!(file.try_lock().is_ok(), "the lock outlived its run");
}

/// The hidden temporaries a new state database is made under beside `dir/state.db`.
fn temporaries(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    entries(dir)
        .into_iter()
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name.starts_with(".state.db.") && name.ends_with(".new")
        })
        .collect()
}

/// README "Whose database": a new database is made whole under `.state.db.<random>.new` and
/// only then linked into place, so a process killed while making it (here aborted, as by
/// `kill -9`, once the temporary is whole but not yet linked) leaves no file at `--state`,
/// has paid nothing, and the next run makes the database and runs whole.
#[tokio::test(flavor = "multi_thread")]
async fn a_run_killed_while_it_creates_its_database_leaves_none_at_the_path() {
    use std::os::unix::process::ExitStatusExt as _;
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(1, None));
    let state = state_path(dir).display().to_string();
    let mut cmd = Imgpipe::new(&["run", "p.yaml", "--run-id", "r", "--state", &state])
        .cwd(dir)
        .command();
    cmd.env("IMGPIPE_BASE_URL", env.sandbox.base_url().as_str())
        .env("IMGPIPE_API_KEY", env.sandbox.key())
        .env(imgpipe::failpoint::ENV, "state-created-unlinked");
    let o = finish(cmd).await;
    assert_eq!(
        o.status.signal(),
        Some(6),
        "not aborted at the crash point: {:?}\n{}",
        o.status,
        stderr(&o)
    );
    assert!(
        !state_path(dir).exists(),
        "a database at the path before it was whole: {:?}",
        entries(dir)
    );
    let made = temporaries(dir);
    assert_eq!(made.len(), 1, "{:?}", entries(dir));
    let others: Vec<_> = entries(dir)
        .into_iter()
        .filter(|p| !made.contains(p) && !p.ends_with("p.yaml") && !p.ends_with("state.db.locks"))
        .collect();
    assert!(others.is_empty(), "left beside it: {others:?}");
    // The temporary is whole: it carries imgpipe's mark (bytes 68 to 71 of its header).
    let header = std::fs::read(&made[0]).unwrap();
    assert_eq!(
        header.get(68..72),
        Some(&b"imgp"[..]),
        "{}",
        made[0].display()
    );
    assert_nothing_billed(&env);

    let o = on(&env, dir, &["run", "p.yaml", "--run-id", "r"]).await;
    assert_exit_without_panic(&o, 0);
    assert_eq!(
        Db::read_file(&state_path(dir)).await.run_status("r"),
        "succeeded"
    );
    assert_eq!(env.sandbox.ledger().len(), 3, "{:?}", env.sandbox.ledger());
}

/// How often a run not on a terminal writes its progress line (README "How it ends").
const LOG_EVERY: Duration = Duration::from_secs(10);

/// The seconds a progress line says have elapsed (`…, 12s elapsed (…)`).
fn elapsed_said(line: &str) -> u64 {
    let (before, _) = line
        .split_once("s elapsed")
        .unwrap_or_else(|| panic!("no elapsed time in {line:?}"));
    let digits = before.rsplit(' ').next().unwrap_or_default();
    digits
        .parse()
        .unwrap_or_else(|e| panic!("{digits:?} in {line:?}: {e}"))
}

/// README "How it ends": not on a terminal (cron, here a pipe) a run writes a plain progress
/// line every 10 s, with the tasks and credits so far, even while nothing finishes: here the
/// run's second call is held at the sandbox after its first task succeeded, and the line comes
/// once 10 s have passed (a lower bound, which a slow machine only raises), within 30 s.
#[tokio::test(flavor = "multi_thread")]
async fn a_run_not_on_a_terminal_logs_its_progress_every_10_seconds_while_held() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(1, None));
    let hold = env.sandbox.hold();
    let started = std::time::Instant::now();
    let mut run = spawn_on(&env, dir, &["run", "p.yaml", "--run-id", "r"]);
    wait_until("the first call held", || env.sandbox.held_calls() == 1).await;
    env.sandbox.let_through(1);
    wait_until("the second call held, the first billed", || {
        env.sandbox.held_calls() == 1 && env.sandbox.ledger().len() == 1
    })
    .await;
    let line = run.wait_for_line_within("progress: ", 3 * LOG_EVERY).await;
    let seen = started.elapsed();
    assert!(seen >= LOG_EVERY, "a progress line after {seen:?}: {line}");
    assert!(elapsed_said(&line) >= LOG_EVERY.as_secs(), "{line}");
    let first = env.sandbox.ledger()[0].credits;
    drop(hold);
    let o = run.finish().await;
    assert_exit_without_panic(&o, 0);
    let planned = Db::read_file(&state_path(dir)).await.planned();
    assert!(
        line.contains(&format!("progress: 1/3 tasks, {first}/{planned} credits")),
        "{line}"
    );
}

/// README "How it ends": on a terminal, a progress bar per step and one for the credits spent
/// against the plan. `script` (util-linux) gives the run a pseudo-terminal.
#[tokio::test(flavor = "multi_thread")]
async fn a_run_on_a_terminal_draws_a_bar_per_step_and_one_for_credits() {
    let Ok(script) = which_script() else {
        if ci().is_some() {
            panic!("`script` (util-linux) is needed to give a run a terminal");
        }
        say_skipped("no `script` (util-linux) to give a run a terminal");
        return;
    };
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(1, None));
    let line = format!(
        "imgpipe run p.yaml --run-id r --state '{}'",
        state_path(dir).display()
    );
    let o = Imgpipe::on_a_terminal(&script, &line)
        .sandbox(&env)
        .cwd(dir)
        .env("TERM", "xterm")
        .run()
        .await
        .output;
    assert_exit(&o, 0);
    let planned = Db::read_file(&state_path(dir)).await.planned();
    let seen = stdout(&o);
    let full = "=".repeat(30);
    for step in ["clean", "big", "cutout"] {
        let bar = format!("{step:>16} [{full}] 1/1 tasks");
        assert!(seen.contains(&bar), "no {bar:?} in:\n{seen}");
    }
    let credits = format!("{:>16} [{full}] {planned}/{planned} credits", "spent");
    assert!(seen.contains(&credits), "no {credits:?} in:\n{seen}");
    assert!(
        !seen.contains("progress: "),
        "a plain line on a terminal:\n{seen}"
    );
}

fn which_script() -> Result<std::path::PathBuf, ()> {
    ["/usr/bin/script", "/bin/script"]
        .into_iter()
        .map(std::path::PathBuf::from)
        .find(|p| p.is_file())
        .ok_or(())
}

/// Per item, a three-call chain (clean → big → cutout) and a lone call (shadow) declared
/// after its first step: depth-first order (instance, step) takes shadow before big.
const SHORT_AND_LONG: &str = r#"
version: 1
name: tail
output_dir: out
items:
  - { id: a, url: "https://sandbox.invalid/assets/mug.png" }
  - { id: b, url: "https://sandbox.invalid/assets/lamp.png" }
steps:
  - id: clean
    erase: { image_url: "{{ item.url }}", object_name: the corner }
  - id: shadow
    remove_background: { image_url: "{{ item.url }}" }
  - id: big
    upscale: { from: clean, desired_increase: 2 }
  - id: cutout
    remove_background: { from: big }
"#;

/// README "How it runs": near the end of a run (the work left within a few rounds of the
/// concurrency: here 3 tasks, one slot times the longest chain), the ready task with the
/// longest chain ahead goes first; before it, the depth-first order. With one call at a time
/// the sandbox bills in dispatch order: item a takes shadow before big, item b, in the tail,
/// big (two calls ahead) before shadow (none).
#[tokio::test(flavor = "multi_thread")]
async fn near_the_end_the_task_with_the_longest_chain_ahead_goes_first() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", SHORT_AND_LONG);
    let o = on(
        &env,
        dir,
        &["run", "p.yaml", "--run-id", "r", "--concurrency", "1"],
    )
    .await;
    assert_exit_without_panic(&o, 0);
    let db = Db::read_file(&state_path(dir)).await;
    let by_job: std::collections::HashMap<&str, String> = db
        .tasks
        .iter()
        .filter_map(|t| Some((t.job_id.as_deref()?, format!("{}/{}", t.item, t.step))))
        .collect();
    let billed: Vec<&str> = env
        .sandbox
        .ledger()
        .iter()
        .map(|e| by_job[e.job_id.as_str()].as_str())
        .collect();
    let expected = [
        "a/clean", "a/shadow", "a/big", "a/cutout", // depth-first
        "b/clean", "b/big", "b/shadow", "b/cutout", // the tail: longest chain first
    ];
    assert_eq!(
        billed, expected,
        "the order the sandbox billed the calls in"
    );
}

/// README "Resuming": a run on the embedded sandbox (`--sandbox`) cannot be resumed by a later
/// process once some task finished, since that sandbox's jobs and URLs ended with it: the
/// resume (and `run --run-id`) is refused with exit 2, saying why and what to do instead, and
/// the record and the files are left as they were.
#[tokio::test(flavor = "multi_thread")]
async fn a_run_on_the_embedded_sandbox_is_not_resumed_by_a_later_process() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    write(dir, "p.yaml", &edit_chain(2, None));
    let state = state_path(dir).display().to_string();
    let sandboxed = |args: &[&str]| {
        let mut all = args.to_vec();
        all.extend_from_slice(&["--sandbox", "--state", &state]);
        finish(Imgpipe::new(&all).cwd(dir).command())
    };
    let o = sandboxed(&["run", "p.yaml", "--run-id", "s", "--items", "first:1"]).await;
    assert_exit_without_panic(&o, 7);
    let before = (Db::read(&state).await, file_digests(&dir.join("out")));
    for again in [
        &["resume", "s"][..],
        &["run", "p.yaml", "--run-id", "s"][..],
    ] {
        let o = sandboxed(again).await;
        assert_exit_without_panic(&o, 2);
        let said = stderr(&o);
        assert!(
            said.contains("run s cannot be resumed on a new embedded sandbox")
                && said.contains(
                    "hint: for runs you mean to interrupt and resume, start `imgpipe sandbox` once"
                ),
            "`{}`: {said}",
            again.join(" ")
        );
        let after = (Db::read(&state).await, file_digests(&dir.join("out")));
        assert_eq!(
            (after.0.attempts.len(), after.0.run_status("s"), &after.1),
            (before.0.attempts.len(), before.0.run_status("s"), &before.1),
            "`{}` changed the record or the files",
            again.join(" ")
        );
    }
}

/// README "How it runs": reading jobs (`GET /v1/jobs`, to fetch a result again) and downloads
/// have their own limits and take no paid-call rate. At `--rate 1/h` a run's first paid call
/// goes at once and the next would wait an hour: the four images it made still download, one
/// at a time; and the resume's one paid call goes with a lost image fetched again from its job
/// and four more downloads, each far within the test's ceiling, nothing billed twice.
#[tokio::test(flavor = "multi_thread")]
async fn reads_of_jobs_and_downloads_take_no_paid_call_rate() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(
        dir,
        "p.yaml",
        "version: 1\nname: four\noutput_dir: out\npricing: { generation: 4 }\nitems: [{ id: a }, { id: b }]\nsteps:\n  - id: shot\n    generate: { prompt: \"four views of {{ item.id }}\", n: 4 }\n",
    );
    let slow = ["--rate", "1/h", "--download-concurrency", "1"];
    let mut args = vec!["run", "p.yaml", "--run-id", "r", "--items", "a"];
    args.extend_from_slice(&slow);
    assert_exit_without_panic(&on(&env, dir, &args).await, 7);
    let shot = |item: &str, k: usize| dir.join(format!("out/r/{item}/shot-{k}.png"));
    assert!((0..4).all(|k| shot("a", k).is_file()), "{:?}", tree(dir));
    assert_eq!(env.sandbox.ledger().len(), 1);

    std::fs::remove_file(shot("a", 2)).unwrap();
    env.sandbox.expire_urls();
    let mut args = vec!["resume", "r"];
    args.extend_from_slice(&slow);
    let o = on(&env, dir, &args).await;
    assert_exit_without_panic(&o, 0);
    assert!(shot("a", 2).is_file(), "not fetched again: {}", stderr(&o));
    assert!((0..4).all(|k| shot("b", k).is_file()), "{:?}", tree(dir));
    assert_eq!(env.sandbox.ledger().len(), 2, "one call each");
}

/// README "The review loop": `sample:N:SEED` picks the same items again, whatever the order of
/// the file's items. Among 40 items a sample of 5 has 658,008 possible picks, so a seed that
/// were not honoured would not pick the same five twice by chance (with 3 items it would, a
/// third of the time).
#[tokio::test(flavor = "multi_thread")]
async fn a_sample_seed_picks_the_same_items_from_many_whatever_their_order() {
    let env = start(config()).await;
    let dir = env.dir.path();
    let file = |ids: &mut dyn Iterator<Item = usize>| {
        let mut text = String::from(
            "version: 1\nname: many\noutput_dir: out\npricing: { generation: 4 }\nitems:\n",
        );
        for i in ids {
            text += &format!("  - {{ id: it{i:02} }}\n");
        }
        text + "steps:\n  - id: shot\n    generate: { prompt: \"a {{ item.id }}\" }\n"
    };
    let picked = |run: &str| items_with_outputs(&dir.join("out").join(run));
    write(dir, "p.yaml", &file(&mut (0..40)));
    let o = on(
        &env,
        dir,
        &["run", "p.yaml", "--run-id", "a", "--items", "sample:5:4242"],
    )
    .await;
    assert_exit_without_panic(&o, 7);
    write(dir, "p.yaml", &file(&mut (0..40).rev()));
    let o = on(
        &env,
        dir,
        &["run", "p.yaml", "--run-id", "b", "--items", "sample:5:4242"],
    )
    .await;
    assert_exit_without_panic(&o, 7);
    let (a, b) = (picked("a"), picked("b"));
    assert_eq!(a.len(), 5, "{a:?}");
    assert_eq!(a, b, "the same seed picked other items");
    assert_eq!(env.sandbox.ledger().len(), 10);
}

/// README "Running pipelines", `--items`: ids and shell-style globs, comma separated. A glob
/// and an id together pay for exactly the items they name, and the rest stays pending (exit
/// 7); a glob that names no item is refused before anything is paid.
#[tokio::test(flavor = "multi_thread")]
async fn items_chosen_by_glob_and_id_are_exactly_those_paid_for() {
    let env = start(config()).await;
    let dir = env.dir.path();
    let mut text = String::from(
        "version: 1\nname: globs\noutput_dir: out\npricing: { generation: 4 }\nitems:\n",
    );
    for i in 0..30 {
        text += &format!("  - {{ id: it{i:02} }}\n");
    }
    text += "steps:\n  - id: shot\n    generate: { prompt: \"a {{ item.id }}\" }\n";
    write(dir, "p.yaml", &text);
    let o = on(
        &env,
        dir,
        &["run", "p.yaml", "--run-id", "g", "--items", "it0*,it15"],
    )
    .await;
    assert_exit_without_panic(&o, 7);
    let paid = items_with_outputs(&dir.join("out/g"));
    let mut expected: Vec<String> = (0..10).map(|i| format!("it{i:02}")).collect();
    expected.push("it15".to_owned());
    assert_eq!(paid, expected);
    assert_eq!(env.sandbox.ledger().len(), 11);
    let db = Db::read_file(&state_path(dir)).await;
    assert_eq!(db.count_in("g", "pending"), 19, "the rest stays pending");

    let o = on(
        &env,
        dir,
        &["run", "p.yaml", "--run-id", "h", "--items", "lamp-*"],
    )
    .await;
    assert_exit_without_panic(&o, 2);
    assert_eq!(
        env.sandbox.ledger().len(),
        11,
        "a glob naming nothing paid for something"
    );
}
