//! Promises of README's "Running pipelines" that no other test would miss if they broke: a
//! saved plan no longer holds once its items file or the service's price changed, even with
//! the pipeline file untouched (so its hash alone would let it through); and a run never
//! replaces a different file already at an output's name, nor pays again for that output;
//! and with no `--state` a run keeps its state where the `--state` row of the table says.

use imgpipe::sandbox;

use crate::common::*;
use crate::run::{config, edit_chain, state_path, write};

/// `imgpipe ARGS` in `dir` against `env`'s sandbox, its state in `dir`.
async fn on(env: &Env, dir: &std::path::Path, args: &[&str]) -> std::process::Output {
    let state = state_path(dir).display().to_string();
    imgpipe_on(env, dir, &state, args).await
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
    let mut cmd = command(&args, dir);
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
