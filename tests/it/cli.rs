//! The real `imgpipe` binary end to end: files written, credits billed according to the
//! sandbox's own ledger, exit codes and what stdout and stderr say.
//!
//! Every test that runs the binary against an in-process sandbox uses the multi-thread runtime:
//! the sandbox must keep serving while the test awaits the child process.

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use image::GenericImageView;
use imgpipe::sandbox::faults::Dice;
use imgpipe::sandbox::{self, Sandbox};
use serde_json::Value;
use tokio::io::AsyncBufReadExt;
use tokio::process::Command;

use crate::common::*;

const SAMPLE_MUG: &str = "https://sandbox.invalid/assets/mug.png";

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// The binary pointed at `env`'s sandbox with an explicit key (`None`: no key at all).
async fn run_with_key(env: &Env, key: Option<&str>, args: &[&str]) -> Output {
    let mut cmd = Imgpipe::new(args).cwd(env.dir.path()).command();
    cmd.env("IMGPIPE_BASE_URL", env.sandbox.base_url().as_str());
    if let Some(key) = key {
        cmd.env("IMGPIPE_API_KEY", key);
    }
    finish(cmd).await
}

fn code(o: &Output) -> i32 {
    o.status
        .code()
        .expect("imgpipe exited, not killed by a signal")
}

fn file_name(path: &Path) -> String {
    path.file_name().unwrap().to_string_lossy().into_owned()
}

/// The ledger as (operation, credits) pairs.
fn charges(sandbox: &Sandbox) -> Vec<(String, u64)> {
    sandbox
        .ledger()
        .into_iter()
        .map(|e| {
            assert!(e.delivered, "{e:?}");
            (e.operation, e.credits)
        })
        .collect()
}

/// A sample image exactly as the sandbox serves it.
async fn sample(env: &Env, name: &str) -> image::DynamicImage {
    let url = env
        .sandbox
        .base_url()
        .join(&format!("assets/{name}.png"))
        .unwrap();
    let bytes = reqwest::get(url).await.unwrap().bytes().await.unwrap();
    image::load_from_memory_with_format(&bytes, image::ImageFormat::Png).unwrap()
}

/// Runs a tool on the mug sample with `--json` and returns the job and the saved file.
async fn tool_on_mug(env: &Env, tool: &str, extra: &[&str]) -> (Value, PathBuf) {
    let mut args = vec![
        "--json",
        "tool",
        tool,
        "--image-url",
        SAMPLE_MUG,
        "--out",
        "t",
    ];
    args.extend_from_slice(extra);
    let o = imgpipe(Some(env), &args, env.dir.path()).await;
    assert_exit(&o, 0);
    let out = json_stdout(&o);
    let job = out["job"].clone();
    assert_eq!(job["tool"], tool);
    assert_eq!(job["status"], "succeeded");
    let files = out["files"].as_array().unwrap();
    assert_eq!(files.len(), 1, "{out}");
    let path = env.dir.path().join(files[0]["path"].as_str().unwrap());
    assert_eq!(
        path,
        env.dir
            .path()
            .join("t")
            .join(format!("{}.png", job["id"].as_str().unwrap()))
    );
    (job, path)
}

/// Spawns `imgpipe sandbox` with `args` and reads the JSON line it prints first.
async fn spawn_standalone(args: &[&str], cwd: &Path) -> (tokio::process::Child, Value) {
    let mut full = vec!["sandbox", "--port", "0", "--json"];
    full.extend_from_slice(args);
    let mut cmd = Imgpipe::new(&full).cwd(cwd).command();
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("imgpipe sandbox starts");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let first = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
        .await
        .expect("the sandbox prints its address in time")
        .unwrap()
        .expect("the sandbox prints a line");
    let info: Value = serde_json::from_str(&first)
        .unwrap_or_else(|e| panic!("first line is not JSON ({e}): {first}"));
    (child, info)
}

fn send_signal(signal: &str, pid: u32) {
    let mut kill = std::process::Command::new("kill");
    kill.args([&format!("-{signal}"), &pid.to_string()])
        .stdin(std::process::Stdio::null());
    let o = finish_blocking(
        kill,
        Duration::from_secs(10),
        &format!("kill -{signal} {pid}"),
    );
    assert!(o.status.success(), "kill -{signal} {pid} failed: {o:?}");
}

// ---------------------------------------------------------------------------------------------
// 1. The first command of the README, on a fresh directory and the embedded sandbox
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn readme_first_command_writes_two_pngs_and_bills_eight_credits() {
    let dir = tempfile::tempdir().unwrap();
    let o = imgpipe(
        None,
        &[
            "generate",
            "--sandbox",
            "--prompt",
            "a ceramic coffee mug",
            "--n",
            "2",
            "--out",
            "out",
        ],
        dir.path(),
    )
    .await;
    assert_exit(&o, 0);
    let files = entries(&dir.path().join("out"));
    assert_eq!(files.len(), 2, "exactly two files, no leftovers: {files:?}");
    let text = stdout(&o);
    let mut hashes = Vec::new();
    for file in &files {
        assert!(file_name(file).ends_with(".png"), "{}", file.display());
        let img = decode(file);
        assert_eq!(img.dimensions(), (256, 256));
        let shown = format!("out/{}", file_name(file));
        assert!(text.contains(&shown), "stdout names {shown}:\n{text}");
        hashes.push(sha256_hex(&std::fs::read(file).unwrap()));
    }
    assert_ne!(hashes[0], hashes[1], "the two images differ");
    assert!(has_phrase(&text, "2 image(s)"), "{text}");
    assert!(has_phrase(&text, "8 credits billed"), "{text}");
    assert!(
        stderr(&o).contains("embedded sandbox"),
        "the user is told the credits are not real:\n{}",
        stderr(&o)
    );
}

// ---------------------------------------------------------------------------------------------
// 2. Every command against an in-process sandbox
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn generate_json_then_upscale_its_url_bills_both_calls() {
    let env = start_default().await;
    let cwd = env.dir.path();
    let o = imgpipe(
        Some(&env),
        &["generate", "--json", "--prompt", "a mug", "--out", "o1"],
        cwd,
    )
    .await;
    assert_exit(&o, 0);
    let out = json_stdout(&o);
    let job = &out["job"];
    assert_eq!(job["status"], "succeeded");
    assert_eq!(job["credits_used"], 4);
    assert_eq!(job["credits_remaining"], 996);
    let gen_id = job["id"].as_str().unwrap().to_owned();
    assert!(gen_id.starts_with("job_"), "{gen_id}");
    let images = job["images"].as_array().unwrap();
    assert_eq!(images.len(), 1);
    let url = images[0]["url"].as_str().unwrap().to_owned();

    // The files array describes the file actually written.
    let files = out["files"].as_array().unwrap();
    assert_eq!(files.len(), 1, "{out}");
    let path = cwd.join(files[0]["path"].as_str().unwrap());
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(files[0]["bytes"], bytes.len() as u64);
    assert_eq!(files[0]["sha256"], sha256_hex(&bytes));
    assert_eq!(decode(&path).dimensions(), (256, 256));
    assert_eq!(entries(&cwd.join("o1")), vec![path]);

    let o = imgpipe(
        Some(&env),
        &[
            "tool",
            "upscale",
            "--image-url",
            &url,
            "--desired-increase",
            "4",
            "--out",
            "o2",
        ],
        cwd,
    )
    .await;
    assert_exit(&o, 0);
    let text = stdout(&o);
    assert!(text.contains("upscale done, 4 credits billed"), "{text}");
    let files = entries(&cwd.join("o2"));
    assert_eq!(files.len(), 1, "{files:?}");
    assert_eq!(decode(&files[0]).dimensions(), (1024, 1024));
    assert!(
        text.contains(&format!("saved o2/{}", file_name(&files[0]))),
        "{text}"
    );

    let ledger = env.sandbox.ledger();
    assert_eq!(
        charges(&env.sandbox),
        vec![("generate".into(), 4), ("upscale".into(), 4)]
    );
    assert_eq!(ledger[0].job_id.as_str(), gen_id);
    assert_eq!(file_name(&files[0]), format!("{}.png", ledger[1].job_id));
    assert_eq!(env.sandbox.balance(), 1000 - 8);
}

#[tokio::test(flavor = "multi_thread")]
async fn upscale_defaults_to_2x_and_bills_2() {
    let env = start_default().await;
    let (job, path) = tool_on_mug(&env, "upscale", &[]).await;
    assert_eq!(job["credits_used"], 2);
    assert_eq!(decode(&path).dimensions(), (512, 512));
    assert_eq!(charges(&env.sandbox), vec![("upscale".into(), 2)]);
}

#[tokio::test(flavor = "multi_thread")]
async fn remove_background_on_a_sample_gives_a_transparent_png() {
    let env = start_default().await;
    let (job, path) = tool_on_mug(&env, "remove_background", &[]).await;
    assert_eq!(job["credits_used"], 5);
    let img = decode(&path);
    assert!(img.color().has_alpha(), "{:?}", img.color());
    assert_eq!(img.dimensions(), (256, 256));
    for (x, y) in [(0, 0), (255, 0), (0, 255), (255, 255)] {
        assert_eq!(img.get_pixel(x, y)[3], 0, "corner ({x},{y}) is transparent");
    }
    assert_eq!(img.get_pixel(128, 128)[3], 255, "the subject stays opaque");
    assert_eq!(charges(&env.sandbox), vec![("remove_background".into(), 5)]);
    assert_eq!(env.sandbox.balance(), 995);
}

#[tokio::test(flavor = "multi_thread")]
async fn expand_to_16_9_widens_around_the_original() {
    let env = start_default().await;
    let (job, path) = tool_on_mug(&env, "expand", &["--aspect-ratio", "16:9"]).await;
    assert_eq!(job["credits_used"], 5);
    let img = decode(&path);
    // 256 high; 256 * 16 / 9 = 455.1, rounded up so the canvas holds the whole image.
    assert_eq!(img.dimensions(), (456, 256));
    let original = sample(&env, "mug").await.to_rgba8();
    let centre = img.crop_imm(100, 0, 256, 256).to_rgba8();
    assert!(
        centre == original,
        "the original sits unchanged in the centre"
    );
    assert_eq!(charges(&env.sandbox), vec![("expand".into(), 5)]);
}

#[tokio::test(flavor = "multi_thread")]
async fn erase_changes_pixels_and_keeps_the_size() {
    let env = start_default().await;
    let (job, path) = tool_on_mug(&env, "erase", &["--object-name", "cup"]).await;
    assert_eq!(job["credits_used"], 2);
    let img = decode(&path).to_rgba8();
    let original = sample(&env, "mug").await.to_rgba8();
    assert_eq!(img.dimensions(), original.dimensions());
    assert!(img != original, "erasing changed the image");
    assert_eq!(img.get_pixel(0, 0), original.get_pixel(0, 0));
    assert_eq!(charges(&env.sandbox), vec![("erase".into(), 2)]);
}

#[tokio::test(flavor = "multi_thread")]
async fn job_downloads_again_without_billing() {
    let env = start_default().await;
    let cwd = env.dir.path();
    let o = imgpipe(
        Some(&env),
        &[
            "--json",
            "generate",
            "--prompt",
            "two lamps",
            "--n",
            "2",
            "--out",
            "first",
        ],
        cwd,
    )
    .await;
    assert_exit(&o, 0);
    let out = json_stdout(&o);
    let id = out["job"]["id"].as_str().unwrap().to_owned();
    let first: Vec<String> = out["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["sha256"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(first.len(), 2);
    let ledger_before = env.sandbox.ledger();
    assert_eq!(ledger_before.len(), 1);
    let balance_before = env.sandbox.balance();

    let o = imgpipe(Some(&env), &["job", &id, "--out", "again"], cwd).await;
    assert_exit(&o, 0);
    let text = stdout(&o);
    assert!(text.contains(&format!("job      {id}")), "{text}");
    assert!(text.contains("status   succeeded"), "{text}");
    assert!(text.contains("credits  8"), "{text}");
    assert_eq!(
        text.matches("url      http://127.0.0.1:").count(),
        2,
        "{text}"
    );
    let again = entries(&cwd.join("again"));
    let names: Vec<String> = again.iter().map(|p| file_name(p)).collect();
    assert_eq!(names, vec![format!("{id}-0.png"), format!("{id}-1.png")]);
    let hashes: Vec<String> = again
        .iter()
        .map(|p| sha256_hex(&std::fs::read(p).unwrap()))
        .collect();
    assert_eq!(hashes, first, "the same images, byte for byte");

    assert_eq!(env.sandbox.ledger(), ledger_before, "nothing billed");
    assert_eq!(env.sandbox.balance(), balance_before);
}

#[tokio::test(flavor = "multi_thread")]
async fn job_of_a_tool_call_downloads_its_single_image() {
    let env = start_default().await;
    let (job, first) = tool_on_mug(&env, "erase", &["--object-name", "cup"]).await;
    let id = job["id"].as_str().unwrap();
    let o = imgpipe(
        Some(&env),
        &["--json", "job", id, "--out", "again"],
        env.dir.path(),
    )
    .await;
    assert_exit(&o, 0);
    let out = json_stdout(&o);
    assert_eq!(out["job"]["id"], id);
    assert_eq!(out["job"]["tool"], "erase");
    let again = entries(&env.dir.path().join("again"));
    assert_eq!(again.len(), 1);
    assert_eq!(file_name(&again[0]), format!("{id}.png"));
    assert_eq!(
        std::fs::read(&again[0]).unwrap(),
        std::fs::read(first).unwrap()
    );
    assert_eq!(
        out["files"][0]["sha256"],
        sha256_hex(&std::fs::read(&again[0]).unwrap())
    );
    assert_eq!(env.sandbox.ledger().len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn job_unknown_id_is_not_found() {
    let env = start_default().await;
    let o = imgpipe(Some(&env), &["job", "job_nope"], env.dir.path()).await;
    assert_exit(&o, 1);
    assert!(stderr(&o).contains("not found"), "{}", stderr(&o));
    assert!(stdout(&o).is_empty(), "{}", stdout(&o));
}

#[tokio::test(flavor = "multi_thread")]
async fn account_prints_the_balance_and_where_it_was_found() {
    let env = start_default().await;
    env.sandbox.set_balance(123);
    let o = imgpipe(Some(&env), &["account"], env.dir.path()).await;
    assert_exit(&o, 0);
    let text = stdout(&o);
    assert!(text.contains("plan     sandbox"), "{text}");
    assert!(
        text.contains("balance  123 credits  (from /credits/balance)"),
        "{text}"
    );
    assert!(text.contains("\"max_images_per_generation\":4"), "{text}");

    let o = imgpipe(Some(&env), &["account", "--json"], env.dir.path()).await;
    assert_exit(&o, 0);
    let account = json_stdout(&o);
    assert_eq!(account["credits"]["balance"], 123);
    assert_eq!(account["plan"], "sandbox");

    // A pointer named by the user is honoured; a wrong one is a usage error.
    let o = imgpipe(
        Some(&env),
        &["account", "--balance-field", "/credits/balance"],
        env.dir.path(),
    )
    .await;
    assert_exit(&o, 0);
    assert!(
        stdout(&o).contains("balance  123 credits"),
        "{}",
        stdout(&o)
    );
    let o = imgpipe(
        Some(&env),
        &["account", "--balance-field", "/plan"],
        env.dir.path(),
    )
    .await;
    assert_exit(&o, 2);
    assert!(stderr(&o).contains("hint:"), "{}", stderr(&o));

    assert!(
        env.sandbox.ledger().is_empty(),
        "reading the account is free"
    );
    assert_eq!(env.sandbox.balance(), 123);
}

#[tokio::test(flavor = "multi_thread")]
async fn models_lists_models_and_tools() {
    let env = start_default().await;
    let o = imgpipe(Some(&env), &["models", "--json"], env.dir.path()).await;
    assert_exit(&o, 0);
    let models = json_stdout(&o);
    assert_eq!(models["models"][0]["id"], "sandbox-image-1");
    let tools: Vec<&str> = models["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(tools, ["remove_background", "upscale", "expand", "erase"]);

    let o = imgpipe(Some(&env), &["models"], env.dir.path()).await;
    assert_exit(&o, 0);
    let text = stdout(&o);
    assert!(text.contains("models   sandbox-image-1"), "{text}");
    assert!(
        text.contains("tools    remove_background, upscale, expand, erase"),
        "{text}"
    );
    assert!(text.contains("generation price  not stated"), "{text}");
    assert!(env.sandbox.ledger().is_empty());
}

// ---------------------------------------------------------------------------------------------
// 3. Exit codes and messages
// ---------------------------------------------------------------------------------------------

/// Asserts a usage error (exit 2) that sent nothing to the service and wrote nothing.
#[track_caller]
fn assert_refused_before_sending(env: &Env, o: &Output, needle: &str) {
    assert_exit(o, 2);
    let err = stderr(o);
    assert!(err.contains(needle), "stderr names {needle:?}:\n{err}");
    assert!(stdout(o).is_empty(), "{}", stdout(o));
    assert_eq!(env.sandbox.stats().api_requests, 0, "nothing was sent");
    assert!(env.sandbox.ledger().is_empty());
    assert!(!env.dir.path().join("out").exists(), "no output directory");
}

#[tokio::test(flavor = "multi_thread")]
async fn n_out_of_range_is_refused_before_sending() {
    let env = start_default().await;
    for n in ["5", "0"] {
        let o = imgpipe(
            Some(&env),
            &["generate", "--prompt", "x", "--n", n, "--out", "out"],
            env.dir.path(),
        )
        .await;
        assert_refused_before_sending(&env, &o, "n: must be between 1 and 4");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn unknown_size_is_a_usage_error() {
    let env = start_default().await;
    let o = imgpipe(
        Some(&env),
        &["generate", "--prompt", "x", "--size", "3K", "--out", "out"],
        env.dir.path(),
    )
    .await;
    assert_refused_before_sending(&env, &o, "--size");
    assert!(stderr(&o).contains("2K or 4K"), "{}", stderr(&o));
}

#[tokio::test(flavor = "multi_thread")]
async fn erase_without_object_name_is_a_usage_error() {
    let env = start_default().await;
    let o = imgpipe(
        Some(&env),
        &["tool", "erase", "--image-url", SAMPLE_MUG, "--out", "out"],
        env.dir.path(),
    )
    .await;
    assert_refused_before_sending(&env, &o, "--object-name");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_flag_of_another_tool_is_refused() {
    let env = start_default().await;
    let cases: [(&str, &[&str], &str); 3] = [
        (
            "upscale",
            &["--object-name", "cup"],
            "--object-name applies only to erase",
        ),
        (
            "erase",
            &["--object-name", "cup", "--desired-increase", "4"],
            "--desired-increase applies only to upscale",
        ),
        (
            "remove_background",
            &["--aspect-ratio", "16:9"],
            "applies only to expand",
        ),
    ];
    for (tool, extra, message) in cases {
        let mut args = vec!["tool", tool, "--image-url", SAMPLE_MUG, "--out", "out"];
        args.extend_from_slice(extra);
        let o = imgpipe(Some(&env), &args, env.dir.path()).await;
        assert_refused_before_sending(&env, &o, message);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn no_base_url_and_no_sandbox_hints_at_both() {
    let dir = tempfile::tempdir().unwrap();
    let o = imgpipe(None, &["account"], dir.path()).await;
    assert_exit(&o, 2);
    let err = stderr(&o);
    assert!(err.contains("no service address"), "{err}");
    assert!(err.contains("hint:"), "{err}");
    assert!(err.contains("IMGPIPE_BASE_URL"), "{err}");
    assert!(err.contains("--sandbox"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn base_url_without_key_asks_for_the_key() {
    let env = start_default().await;
    let o = run_with_key(&env, None, &["account"]).await;
    assert_exit(&o, 2);
    let err = stderr(&o);
    assert!(err.contains("no API key"), "{err}");
    assert!(err.contains("IMGPIPE_API_KEY"), "{err}");
    assert!(err.contains("--api-key-file"), "{err}");
    assert_eq!(env.sandbox.stats().api_requests, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn wrong_key_is_an_authentication_failure_with_a_hint() {
    let env = start_default().await;
    let o = run_with_key(
        &env,
        Some("sk-not-the-right-one"),
        &["generate", "--prompt", "x", "--out", "out"],
    )
    .await;
    assert_exit(&o, 1);
    let err = stderr(&o);
    assert!(err.contains("authentication failed (HTTP 401)"), "{err}");
    assert!(err.contains("hint: check IMGPIPE_API_KEY"), "{err}");
    let stats = env.sandbox.stats();
    assert_eq!((stats.api_requests, stats.unauthorized), (1, 1));
    assert!(env.sandbox.ledger().is_empty());
    assert!(!env.dir.path().join("out").exists());
}

#[tokio::test(flavor = "multi_thread")]
async fn low_balance_exits_3_and_bills_nothing() {
    let env = start_default().await;
    env.sandbox.set_balance(3);
    let o = imgpipe(
        Some(&env),
        &["generate", "--prompt", "x", "--out", "out"],
        env.dir.path(),
    )
    .await;
    assert_exit(&o, 3);
    let err = stderr(&o);
    assert!(err.contains("not enough credits (HTTP 402)"), "{err}");
    assert!(err.contains("hint:"), "{err}");
    assert!(env.sandbox.ledger().is_empty());
    assert_eq!(env.sandbox.balance(), 3);
    assert!(!env.dir.path().join("out").exists());

    // A call the balance still covers goes through.
    let o = imgpipe(
        Some(&env),
        &[
            "tool",
            "erase",
            "--image-url",
            SAMPLE_MUG,
            "--object-name",
            "cup",
            "--out",
            "out",
        ],
        env.dir.path(),
    )
    .await;
    assert_exit(&o, 0);
    assert_eq!(env.sandbox.balance(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn api_key_file_is_read_and_a_missing_one_is_a_usage_error() {
    let env = start_default().await;
    let key_file = env.dir.path().join("key.txt");
    std::fs::write(&key_file, format!("{}\n", env.sandbox.key())).unwrap();
    let key_arg = key_file.to_str().unwrap();

    // The file wins over the environment: a wrong IMGPIPE_API_KEY does not matter.
    let o = run_with_key(
        &env,
        Some("sk-wrong-in-env"),
        &["account", "--api-key-file", key_arg],
    )
    .await;
    assert_exit(&o, 0);
    assert!(
        stdout(&o).contains("balance  1000 credits"),
        "{}",
        stdout(&o)
    );
    assert_eq!(env.sandbox.stats().unauthorized, 0);

    let missing = env.dir.path().join("no-such-key.txt");
    let o = run_with_key(
        &env,
        None,
        &["account", "--api-key-file", missing.to_str().unwrap()],
    )
    .await;
    assert_exit(&o, 2);
    let err = stderr(&o);
    assert!(err.contains("cannot read the API key file"), "{err}");
    assert_eq!(
        env.sandbox.stats().api_requests,
        1,
        "only the first run called"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn sigint_or_sigterm_during_a_call_exits_130() {
    let env = start(sandbox::Config::default()).await;
    // Every call held at the sandbox's gate: the signal comes during the call, however slow
    // the machine (it was 20 s of latency).
    let hold = env.sandbox.hold();
    for (i, signal) in ["INT", "TERM"].into_iter().enumerate() {
        let mut cmd =
            Imgpipe::on(&env, &["generate", "--prompt", "slow", "--out", "out"]).command();
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        let child = cmd.spawn().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while env.sandbox.stats().paid_requests <= i as u64 {
            assert!(Instant::now() < deadline, "the call reaches the sandbox");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        send_signal(signal, child.id().unwrap());
        let o = tokio::time::timeout(Duration::from_secs(5), child.wait_with_output())
            .await
            .unwrap_or_else(|_| panic!("imgpipe stops promptly on SIG{signal}"))
            .unwrap();
        assert_exit(&o, 130);
        let err = stderr(&o);
        assert!(err.contains("interrupted"), "SIG{signal}: {err}");
        assert!(err.contains("may have been billed"), "SIG{signal}: {err}");
        assert!(
            err.contains("imgpipe job"),
            "says how to find the job: {err}"
        );
        assert!(stdout(&o).is_empty(), "{}", stdout(&o));
    }
    release_after_kill(&env, hold).await;
}

/// A download cut short after billing: exit 1, the user is told what happened and how to get
/// the image without paying again, and no partial file is left behind.
#[tokio::test(flavor = "multi_thread")]
async fn a_download_cut_short_is_reported_and_leaves_no_partial_file() {
    let env = start_with_faults(sandbox::Faults {
        truncate_download: 1.0,
        ..Default::default()
    })
    .await;
    let o = imgpipe(
        Some(&env),
        &["generate", "--prompt", "x", "--out", "out"],
        env.dir.path(),
    )
    .await;
    assert_exit(&o, 1);
    let err = stderr(&o);
    let id = &env.sandbox.ledger()[0].job_id;
    assert!(
        err.contains(&format!("imgpipe job {id} --out out")),
        "the recovery command is named:\n{err}"
    );
    assert_eq!(
        env.sandbox.stats().truncated_downloads,
        4,
        "tried four times before giving up"
    );
    assert!(err.contains("retrying"), "the retries are logged:\n{err}");
    assert_eq!(
        leftovers(&env.dir.path().join("out")),
        Vec::<PathBuf>::new(),
        "no partial file"
    );
    // The sandbox sends half the image under a Content-Length promising all of it; the user
    // must learn that the download was cut short, not that the request could not be sent.
    assert!(err.contains("the download was cut short"), "{err}");
}

/// A download that fails after billing tells the user how to fetch the images again for free;
/// following that advice word for word must work, even when some images were already saved.
#[tokio::test(flavor = "multi_thread")]
async fn the_recovery_hint_after_a_failed_download_works() {
    // Pick a seed whose download dice read: ok, then cut four times, then ok, ok. Image 0 of
    // the generation is saved, image 1 is cut short on every one of its four tries; the
    // re-download then succeeds for both.
    let p = 0.5;
    let seed = (1..10_000u64)
        .find(|s| {
            let dice = Dice::new(*s);
            [false, true, true, true, true, false, false]
                .iter()
                .all(|cut| dice.chance(p) == *cut)
        })
        .expect("some seed fits");
    let env = start_with_faults(sandbox::Faults {
        truncate_download: p,
        seed,
        ..Default::default()
    })
    .await;
    let cwd = env.dir.path();
    let o = imgpipe(
        Some(&env),
        &["generate", "--prompt", "x", "--n", "2", "--out", "out"],
        cwd,
    )
    .await;
    assert_exit(&o, 1);
    let err = stderr(&o);
    assert!(
        err.contains("download failed") || err.contains("cut short"),
        "{err}"
    );
    assert_eq!(env.sandbox.stats().truncated_downloads, 4);
    let id = env.sandbox.ledger()[0].job_id.clone();
    assert_eq!(entries(&cwd.join("out")).len(), 1, "image 0 was saved");

    let advice = err
        .split("without paying, with: ")
        .nth(1)
        .unwrap_or_else(|| panic!("no recovery command in:\n{err}"))
        .lines()
        .next()
        .unwrap();
    let words: Vec<&str> = advice.split_whitespace().collect();
    assert_eq!(words[..3], ["imgpipe", "job", id.as_str()], "{advice}");
    let o = imgpipe(Some(&env), &words[1..], cwd).await;
    assert_exit(&o, 0);

    let out_idx = words.iter().position(|w| *w == "--out").unwrap();
    let dir = cwd.join(words[out_idx + 1]);
    for i in 0..2 {
        let path = dir.join(format!("{id}-{i}.png"));
        assert_eq!(decode(&path).dimensions(), (256, 256));
    }
    assert_eq!(env.sandbox.ledger().len(), 1, "recovery is free");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_existing_different_file_is_never_overwritten() {
    let env = start_default().await;
    let cwd = env.dir.path();
    let o = imgpipe(
        Some(&env),
        &["--json", "generate", "--prompt", "x", "--out", "out"],
        cwd,
    )
    .await;
    assert_exit(&o, 0);
    let id = json_stdout(&o)["job"]["id"].as_str().unwrap().to_owned();
    let path = cwd.join("out").join(format!("{id}-0.png"));
    std::fs::write(&path, b"someone else's file").unwrap();

    let o = imgpipe(Some(&env), &["job", &id, "--out", "out"], cwd).await;
    assert_exit(&o, 1);
    assert!(
        stderr(&o).contains("refusing to overwrite"),
        "{}",
        stderr(&o)
    );
    assert_eq!(std::fs::read(&path).unwrap(), b"someone else's file");
    assert_eq!(entries(&cwd.join("out")), vec![path], "no leftovers");
    assert_eq!(env.sandbox.ledger().len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn preserve_alpha_false_flattens_a_transparent_input() {
    let env = start_default().await;
    let (job, transparent) = tool_on_mug(&env, "remove_background", &[]).await;
    assert!(decode(&transparent).color().has_alpha());
    let url = job["data"]["url"].as_str().unwrap().to_owned();
    for (flag, alpha) in [("true", true), ("false", false)] {
        let out = format!("alpha-{flag}");
        let o = imgpipe(
            Some(&env),
            &[
                "tool",
                "erase",
                "--image-url",
                &url,
                "--object-name",
                "cup",
                "--preserve-alpha",
                flag,
                "--out",
                &out,
            ],
            env.dir.path(),
        )
        .await;
        assert_exit(&o, 0);
        let files = entries(&env.dir.path().join(&out));
        let img = decode(&files[0]);
        assert_eq!(img.color().has_alpha(), alpha, "--preserve-alpha {flag}");
        if !alpha {
            assert_eq!(
                img.to_rgba8().get_pixel(0, 0).0,
                [255; 4],
                "flattened onto white"
            );
        }
    }
    let o = imgpipe(
        Some(&env),
        &[
            "tool",
            "erase",
            "--image-url",
            &url,
            "--object-name",
            "cup",
            "--preserve-alpha",
            "maybe",
            "--out",
            "x",
        ],
        env.dir.path(),
    )
    .await;
    assert_exit(&o, 2);
    assert!(stderr(&o).contains("--preserve-alpha"), "{}", stderr(&o));
    assert_eq!(
        charges(&env.sandbox),
        vec![
            ("remove_background".into(), 5),
            ("erase".into(), 2),
            ("erase".into(), 2)
        ]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn base_url_flag_and_its_checks() {
    let env = start_default().await;
    let dir = env.dir.path();
    // --base-url works in place of the environment variable.
    let mut cmd = Imgpipe::new(&["account", "--base-url", env.sandbox.base_url().as_str()])
        .cwd(dir)
        .command();
    cmd.env("IMGPIPE_API_KEY", env.sandbox.key());
    let o = finish(cmd).await;
    assert_exit(&o, 0);
    assert!(
        stdout(&o).contains("balance  1000 credits"),
        "{}",
        stdout(&o)
    );

    // Plain http to anything but loopback would send the key in clear: refused, nothing sent.
    let mut cmd = Imgpipe::new(&["account", "--base-url", "http://api.example.com/"])
        .cwd(dir)
        .command();
    cmd.env("IMGPIPE_API_KEY", env.sandbox.key());
    let o = finish(cmd).await;
    assert_exit(&o, 2);
    assert!(stderr(&o).contains("unencrypted"), "{}", stderr(&o));
    assert!(stderr(&o).contains("hint:"), "{}", stderr(&o));

    // Nonsense timeouts are usage errors.
    for flag in ["--timeout", "--connect-timeout"] {
        let o = imgpipe(Some(&env), &["account", flag, "0"], dir).await;
        assert_exit(&o, 2);
        assert!(stderr(&o).contains(flag), "{}", stderr(&o));
    }
    assert_eq!(env.sandbox.stats().api_requests, 1);
}

// ---------------------------------------------------------------------------------------------
// 4. The API key never shows
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn the_api_key_never_appears_in_any_output() {
    const RIGHT: &str = "sk-RIGHTKEY-q7Zp3xW9";
    const WRONG: &str = "sk-WRONGKEY-m4Kd8vB2";
    let env = start(sandbox::Config {
        key: Some(RIGHT.into()),
        ..Default::default()
    })
    .await;
    let runs: Vec<(&str, &[&str])> = vec![
        (RIGHT, &["-vv", "generate", "--prompt", "x", "--out", "a"]),
        (
            RIGHT,
            &[
                "-vv",
                "--log-format",
                "json",
                "generate",
                "--prompt",
                "x",
                "--out",
                "b",
            ],
        ),
        (RIGHT, &["-vv", "--json", "account"]),
        (
            RIGHT,
            &[
                "-vv",
                "tool",
                "remove_background",
                "--image-url",
                SAMPLE_MUG,
                "--out",
                "c",
            ],
        ),
        (WRONG, &["-vv", "generate", "--prompt", "x", "--out", "d"]),
        (WRONG, &["-vv", "--log-format", "json", "account"]),
    ];
    for (key, args) in runs {
        let o = run_with_key(&env, Some(key), args).await;
        let expected = if key == RIGHT { 0 } else { 1 };
        assert_exit(&o, expected);
        let (out, err) = (stdout(&o), stderr(&o));
        assert!(
            err.contains("DEBUG"),
            "-vv logs the HTTP stack ({args:?}):\n{err}"
        );
        for secret in [RIGHT, WRONG, "RIGHTKEY", "WRONGKEY"] {
            assert!(
                !out.contains(secret),
                "{secret} in stdout of {args:?}:\n{out}"
            );
            assert!(
                !err.contains(secret),
                "{secret} in stderr of {args:?}:\n{err}"
            );
        }
    }
    // IMGPIPE_LOG overrides -v: trace level, everything the HTTP stack says.
    for key in [RIGHT, WRONG] {
        let mut cmd = Imgpipe::new(&["generate", "--prompt", "x", "--out", "e"])
            .cwd(env.dir.path())
            .command();
        cmd.env("IMGPIPE_BASE_URL", env.sandbox.base_url().as_str())
            .env("IMGPIPE_API_KEY", key)
            .env("IMGPIPE_LOG", "trace");
        let o = finish(cmd).await;
        let both = format!("{}{}", stdout(&o), stderr(&o));
        assert!(both.contains("TRACE"), "{both}");
        for secret in [RIGHT, WRONG, "RIGHTKEY", "WRONGKEY"] {
            assert!(!both.contains(secret), "{secret} in trace output:\n{both}");
        }
    }
    let stats = env.sandbox.stats();
    assert_eq!(
        stats.unauthorized, 3,
        "the wrong-key runs reached the sandbox"
    );
    assert_eq!(env.sandbox.ledger().len(), 4);
}

// ---------------------------------------------------------------------------------------------
// 5. and 6. The standalone sandbox
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn standalone_sandbox_serves_the_cli_and_stops_on_sigint() {
    let dir = tempfile::tempdir().unwrap();
    let (child, info) = spawn_standalone(&["--balance", "50"], dir.path()).await;
    let base = info["base_url"].as_str().expect("base_url").to_owned();
    let key = info["api_key"].as_str().expect("api_key").to_owned();
    assert!(base.starts_with("http://127.0.0.1:"), "{base}");

    let run = |args: &'static [&'static str]| {
        let mut cmd = Imgpipe::new(args).cwd(dir.path()).command();
        cmd.env("IMGPIPE_BASE_URL", &base)
            .env("IMGPIPE_API_KEY", &key);
        finish(cmd)
    };
    let o = run(&["account"]).await;
    assert_exit(&o, 0);
    assert!(
        stdout(&o).contains("balance  50 credits  (from /credits/balance)"),
        "{}",
        stdout(&o)
    );
    // The README's "trying it by hand" flow: the sandbox keeps its jobs between commands.
    let o = run(&[
        "generate",
        "--prompt",
        "a brass desk lamp",
        "--out",
        "out",
        "--json",
    ])
    .await;
    assert_exit(&o, 0);
    let generated = json_stdout(&o);
    assert_eq!(generated["job"]["credits_remaining"], 46);
    let first = dir
        .path()
        .join(generated["files"][0]["path"].as_str().unwrap());
    assert_eq!(decode(&first).dimensions(), (256, 256));
    let url = generated["job"]["images"][0]["url"].as_str().unwrap();
    let o = Imgpipe::new(&[
        "tool",
        "upscale",
        "--desired-increase",
        "4",
        "--image-url",
        url,
        "--out",
        "out",
    ])
    .cwd(dir.path())
    .service(&base, &key)
    .run()
    .await;
    assert_exit(&o, 0);
    assert!(
        has_phrase(&stdout(&o), "4 credits billed"),
        "{}",
        stdout(&o)
    );
    let files = entries(&dir.path().join("out"));
    assert_eq!(files.len(), 2, "{files:?}");
    let upscaled = files.iter().find(|f| **f != first).unwrap();
    assert_eq!(decode(upscaled).dimensions(), (1024, 1024));
    let o = run(&["account"]).await;
    assert_exit(&o, 0);
    assert!(stdout(&o).contains("balance  42 credits"), "{}", stdout(&o));

    send_signal("INT", child.id().expect("still running"));
    let o = tokio::time::timeout(Duration::from_secs(5), child.wait_with_output())
        .await
        .expect("the sandbox stops within 5 s of SIGINT")
        .unwrap();
    assert_exit(&o, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn standalone_sandbox_refuses_invalid_flags() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&[&str], &str); 7] = [
        (&["sandbox", "--fault-drop", "2"], "--fault-drop"),
        (&["sandbox", "--fault-blank", "1.5"], "--fault-blank"),
        (&["sandbox", "--fault-duplicate=-1"], "--fault-duplicate"),
        (&["sandbox", "--fault-truncate=-0.1"], "--fault-truncate"),
        (
            &["sandbox", "--fault-server-error", "NaN"],
            "--fault-server-error",
        ),
        (&["sandbox", "--image-side", "0"], "--image-side"),
        (&["sandbox", "--url-ttl", "0"], "--url-ttl"),
    ];
    for (args, flag) in cases {
        let o = Imgpipe::new(args).cwd(dir.path()).run().await;
        assert_eq!(code(&o), 2, "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(flag), "{args:?}: {}", stderr(&o));
        assert!(stdout(&o).is_empty(), "{args:?} printed {}", stdout(&o));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn account_plan_and_limits_fields_are_honoured_or_refused() {
    let env = start_default().await;
    let dir = env.dir.path();
    let o = imgpipe(
        Some(&env),
        &[
            "account",
            "--plan-field",
            "/plan",
            "--limits-field",
            "/limits",
        ],
        dir,
    )
    .await;
    assert_exit(&o, 0);
    let text = stdout(&o);
    assert!(text.contains("plan     sandbox  (from /plan)"), "{text}");
    assert!(text.contains("(from /limits)"), "{text}");
    assert!(text.contains("\"max_images_per_generation\":4"), "{text}");

    // A pointer other than the one imgpipe would pick by itself is followed.
    let o = imgpipe(Some(&env), &["account", "--limits-field", "/credits"], dir).await;
    assert_exit(&o, 0);
    let text = stdout(&o);
    assert!(
        text.contains("limits   {\"balance\":1000}  (from /credits)"),
        "{text}"
    );

    // Missing, or holding the wrong kind of value: a usage error naming the pointer.
    for (flag, pointer) in [
        ("--plan-field", "/nope"),
        ("--plan-field", "/credits"),
        ("--limits-field", "/nope"),
        ("--limits-field", "/plan"),
    ] {
        let o = imgpipe(Some(&env), &["account", flag, pointer], dir).await;
        assert_exit(&o, 2);
        let err = stderr(&o);
        assert!(err.contains(pointer), "{flag} {pointer}: {err}");
        assert!(err.contains("hint:"), "{flag} {pointer}: {err}");
        assert!(stdout(&o).is_empty(), "{flag} {pointer}: {}", stdout(&o));
    }
    assert!(env.sandbox.ledger().is_empty());
}

/// Runs the binary and fails the test, rather than hanging, when a flag that should have been
/// refused lets the command start (`imgpipe sandbox` would serve until interrupted).
async fn refused_quickly(mut cmd: Command) -> Output {
    tokio::time::timeout(Duration::from_secs(10), cmd.output())
        .await
        .expect("refused at once, not started")
        .expect("imgpipe runs")
}

#[tokio::test(flavor = "multi_thread")]
async fn absurd_timeouts_and_sandbox_limits_are_usage_errors_not_panics() {
    let env = start_default().await;
    let dir = env.dir.path();
    let with_service = |args: &[&str]| {
        let mut cmd = Imgpipe::new(args).cwd(dir).command();
        cmd.env("IMGPIPE_BASE_URL", env.sandbox.base_url().as_str())
            .env("IMGPIPE_API_KEY", env.sandbox.key());
        cmd
    };
    let cases: [(&[&str], &[&str]); 7] = [
        (&["account", "--timeout", "1e20"], &["--timeout"]),
        (&["account", "--timeout", "inf"], &["--timeout"]),
        (&["account", "--timeout", "NaN"], &["--timeout"]),
        (&["account", "--timeout", "604801"], &["--timeout"]),
        (
            &["account", "--connect-timeout", "1e20"],
            &["--connect-timeout"],
        ),
        (
            &["account", "--timeout", "1", "--connect-timeout", "5"],
            &["--timeout", "--connect-timeout"],
        ),
        (
            &[
                "generate",
                "--prompt",
                "x",
                "--out",
                "out",
                "--timeout",
                "1e20",
            ],
            &["--timeout"],
        ),
    ];
    for (args, flags) in cases {
        let o = refused_quickly(with_service(args)).await;
        let err = stderr(&o);
        assert_eq!(code(&o), 2, "{args:?}: {err}");
        for flag in flags {
            assert!(err.contains(flag), "{args:?} names {flag}: {err}");
        }
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(stdout(&o).is_empty(), "{args:?}: {}", stdout(&o));
    }
    assert_eq!(env.sandbox.stats().api_requests, 0, "nothing was sent");
    assert!(!dir.join("out").exists());

    // The limits themselves are accepted: a week, and a timeout equal to the connect timeout.
    for args in [
        &["account", "--timeout", "604800"][..],
        &["account", "--timeout", "5", "--connect-timeout", "5"][..],
        // A short call timeout alone shortens the default connect timeout with it.
        &["account", "--timeout", "2"][..],
    ] {
        let o = refused_quickly(with_service(args)).await;
        assert_exit(&o, 0);
    }

    let sandbox_cases: [(&[&str], &str); 8] = [
        (&["sandbox", "--url-ttl", "1e20"], "--url-ttl"),
        (&["sandbox", "--url-ttl", "inf"], "--url-ttl"),
        (&["sandbox", "--rate-limit", "0"], "--rate-limit"),
        (&["sandbox", "--rate-limit", "NaN"], "--rate-limit"),
        (&["sandbox", "--rate-limit=-1"], "--rate-limit"),
        (&["sandbox", "--rate-limit", "1e300"], "--rate-limit"),
        (&["sandbox", "--max-in-flight", "0"], "--max-in-flight"),
        (
            &["sandbox", "--fault-gateway-timeout", "1.5"],
            "--fault-gateway-timeout",
        ),
    ];
    for (args, flag) in sandbox_cases {
        let o = refused_quickly(Imgpipe::new(args).cwd(dir).command()).await;
        let err = stderr(&o);
        assert_eq!(code(&o), 2, "{args:?}: {err}");
        assert!(err.contains(flag), "{args:?} names {flag}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(stdout(&o).is_empty(), "{args:?}: {}", stdout(&o));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn generate_json_still_prints_the_job_when_the_download_fails() {
    let env = start_with_faults(sandbox::Faults {
        truncate_download: 1.0,
        ..Default::default()
    })
    .await;
    let o = imgpipe(
        Some(&env),
        &["generate", "--json", "--prompt", "x", "--out", "out"],
        env.dir.path(),
    )
    .await;
    assert_exit(&o, 1);
    let out = json_stdout(&o);
    let ledger = env.sandbox.ledger();
    assert_eq!(ledger.len(), 1);
    let id = ledger[0].job_id.as_str();
    assert_eq!(out["job"]["id"], id, "{out}");
    assert_eq!(out["job"]["credits_used"], 4, "{out}");
    assert_eq!(out["files"], serde_json::json!([]), "{out}");
    let error = out["error"]
        .as_str()
        .unwrap_or_else(|| panic!("error is not a string: {out}"));
    assert!(!error.trim().is_empty(), "{out}");
    assert!(error.contains("cut short"), "{error}");
    assert!(
        error.contains(&format!("imgpipe job {id} --out out")),
        "{error}"
    );
    assert_eq!(env.sandbox.stats().truncated_downloads, 4);
    assert_eq!(
        leftovers(&env.dir.path().join("out")),
        Vec::<PathBuf>::new(),
        "no partial file"
    );
}

// ---------------------------------------------------------------------------------------------
// Closed and full output streams
// ---------------------------------------------------------------------------------------------

/// `/dev/full` opened for writing: every write to it fails with ENOSPC.
fn dev_full() -> Stdio {
    Stdio::from(
        std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .expect("/dev/full"),
    )
}

/// A pipe whose reading end is already closed: every write to it fails with EPIPE.
fn closed_pipe() -> Stdio {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    Stdio::from(writer)
}

#[derive(Clone, Copy, Debug)]
enum Stream {
    Piped,
    Full,
    Closed,
}

impl Stream {
    fn stdio(self) -> Stdio {
        match self {
            Stream::Piped => Stdio::piped(),
            Stream::Full => dev_full(),
            Stream::Closed => closed_pipe(),
        }
    }
}

/// Every command that prints, with stdout or stderr (or both) full or closed: never a panic
/// (exit 101). A full stdout is a failure said on stderr (exit 1); a closed stdout (a reader
/// that went away, `| head`) is not, and the exit code is the command's own; so is a full
/// or closed stderr, on which nothing more can be said.
#[tokio::test(flavor = "multi_thread")]
async fn a_full_or_closed_stdout_or_stderr_never_panics_and_a_full_stdout_exits_1_saying_so() {
    let env = start(sandbox::Config {
        image_side: 32,
        ..sandbox::Config::default()
    })
    .await;
    let dir = env.dir.path();
    std::fs::write(
        dir.join("p.yaml"),
        format!(
            "version: 1\nname: streams\noutput_dir: out\nitems:\n  - {{ id: mug, url: \"{SAMPLE_MUG}\" }}\nsteps:\n  - id: big\n    upscale: {{ image_url: \"{{{{ item.url }}}}\", desired_increase: 2 }}\n"
        ),
    )
    .unwrap();
    std::fs::write(dir.join("bad.yaml"), "version: 1\nname: [\n").unwrap();
    let state = dir.join("state.db").to_string_lossy().into_owned();
    let run = ["run", "p.yaml", "--run-id", "r", "--state", &state];
    let o = run_with_key(&env, Some(env.sandbox.key()), &run).await;
    assert_exit_without_panic(&o, 0);
    let commands: Vec<Vec<&str>> = vec![
        vec!["validate", "p.yaml"],
        vec!["validate", "p.yaml", "--json"],
        vec!["validate", "bad.yaml"],
        vec!["plan", "--offline", "p.yaml"],
        vec!["plan", "--offline", "p.yaml", "--json"],
        vec!["schema"],
        vec!["runs", "--state", &state],
        vec!["runs", "--state", &state, "--json"],
        vec!["status", "r", "--state", &state],
        vec!["status", "r", "--state", &state, "--json"],
        vec!["status", "nope", "--state", &state],
        vec!["report", "r", "--state", &state],
        vec!["account"],
        vec!["models", "--json"],
        run.to_vec(),
        vec!["--help"],
    ];
    let mut problems = Vec::new();
    for args in &commands {
        let shown = args.join(" ");
        let streams = |out: Stream, err: Stream| {
            let mut cmd = Imgpipe::new(args).cwd(dir).command();
            cmd.env("IMGPIPE_BASE_URL", env.sandbox.base_url().as_str())
                .env("IMGPIPE_API_KEY", env.sandbox.key())
                .stdout(out.stdio())
                .stderr(err.stdio());
            // Not `output()`, which would pipe both streams whatever was set.
            let child = cmd.spawn().unwrap();
            async {
                tokio::time::timeout(RUN_LIMIT, child.wait_with_output())
                    .await
                    .expect("imgpipe finishes in time")
                    .unwrap()
            }
        };
        let normal = streams(Stream::Piped, Stream::Piped).await;
        let code = normal.status.code().unwrap();
        assert_ne!(code, 101, "{shown}: {}", stderr(&normal));
        let prints = !normal.stdout.is_empty();
        for (out, err) in [
            (Stream::Full, Stream::Piped),
            (Stream::Piped, Stream::Full),
            (Stream::Full, Stream::Full),
            (Stream::Closed, Stream::Piped),
            (Stream::Piped, Stream::Closed),
            (Stream::Closed, Stream::Closed),
        ] {
            let o = streams(out, err).await;
            let what = format!("{shown} (stdout {out:?}, stderr {err:?})");
            let said = stderr(&o);
            if said.contains("panicked") || o.status.code() == Some(101) {
                problems.push(format!("{what}: panicked: {said}"));
                continue;
            }
            // clap prints its help itself, and takes a full stdout quietly.
            let full_stdout = matches!(out, Stream::Full) && prints && args[0] != "--help";
            let expected = if full_stdout { 1 } else { code };
            if o.status.code() != Some(expected) {
                problems.push(format!(
                    "{what}: exit {:?}, not {expected}: {said}",
                    o.status.code()
                ));
            }
            if full_stdout
                && matches!(err, Stream::Piped)
                && !said.contains("error: cannot write to stdout: No space left on device")
            {
                problems.push(format!("{what}: the failure is not said: {said}"));
            }
            if matches!(out, Stream::Closed) && said.contains("cannot write") {
                problems.push(format!("{what}: a closed pipe is no error: {said}"));
            }
            if matches!(out, Stream::Piped)
                && without_clock(&o.stdout) != without_clock(&normal.stdout)
                && args[0] != "report"
            {
                problems.push(format!("{what}: stdout differs from the normal run's"));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Output with a JSON document's `created_at` (a plan's, to the second) left out, so two runs
/// a second apart compare equal.
fn without_clock(out: &[u8]) -> Vec<u8> {
    match serde_json::from_slice::<Value>(out) {
        Ok(Value::Object(mut doc)) => {
            doc.remove("created_at");
            serde_json::to_vec(&doc).unwrap()
        }
        _ => out.to_vec(),
    }
}
