//! The deployment files of `deploy/` hold what docs/guides/deploying.md promises. The CronJob
//! passes Kubernetes' own schemas (`kubernetes-validate --strict`, from PyPI, with the schemas
//! it bundles) and keeps its promises: one night at a time, a deadline to start, the key, the
//! state and the store's credentials from Secrets, limits set. The systemd units pass
//! `systemd-analyze verify` without a word, the timer catches up (`Persistent=true`). And the
//! command each file runs is the main job: against the sandbox it pays for the whole night,
//! and started again the same day (a pod replaced, a timer caught up) it pays nothing more.
//!
//! `.ci/deploy.sh` installs both validators when missing; under CI a missing one fails.

use std::path::{Path, PathBuf};
use std::time::Duration;

use yaml_rust2::{Yaml, YamlLoader};

use crate::binary::{Imgpipe, Ran};
use crate::common::{self, Env};

fn deploy(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy")
        .join(path)
}

/// `program args…` when it is on PATH, its output; `None` (the skip said) when it is not.
fn validator(program: &str, args: &[&str]) -> Option<std::process::Output> {
    if !common::on_path(program) {
        common::skip_unless_ci(
            program,
            &format!("{program} is not on PATH"),
            "`bash .ci/run` installs it (.ci/deploy.sh)",
        );
        return None;
    }
    let mut cmd = std::process::Command::new(program);
    cmd.args(args);
    Some(common::finish_blocking(
        cmd,
        Duration::from_secs(60),
        program,
    ))
}

fn cronjob() -> Yaml {
    let text = std::fs::read_to_string(deploy("kubernetes/cronjob.yaml")).unwrap();
    YamlLoader::load_from_str(&text).unwrap().remove(0)
}

/// The CronJob's one container.
fn container(job: &Yaml) -> &Yaml {
    &job["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
}

/// The container's variables: name, and its value or the Secret key it is read from.
fn variables(job: &Yaml) -> Vec<(String, Result<String, String>)> {
    let list = container(job)["env"].as_vec().unwrap();
    list.iter()
        .map(|var| {
            let name = var["name"].as_str().unwrap().to_owned();
            let value = match var["value"].as_str() {
                Some(value) => Ok(value.to_owned()),
                None => Err(var["valueFrom"]["secretKeyRef"]["key"]
                    .as_str()
                    .unwrap_or_else(|| panic!("{name} has neither a value nor a Secret"))
                    .to_owned()),
            };
            (name, value)
        })
        .collect()
}

#[test]
fn the_cronjob_passes_kubernetes_schemas() {
    let path = deploy("kubernetes/cronjob.yaml");
    let Some(out) = validator("kubernetes-validate", &["--strict", path.to_str().unwrap()]) else {
        return;
    };
    assert!(
        out.status.success(),
        "kubernetes-validate refused {}:\n{}{}",
        path.display(),
        common::stdout(&out),
        common::stderr(&out)
    );
}

#[test]
fn the_cronjob_keeps_its_promises() {
    let job = cronjob();
    assert_eq!(job["kind"].as_str(), Some("CronJob"));
    assert_eq!(job["spec"]["concurrencyPolicy"].as_str(), Some("Forbid"));
    assert!(job["spec"]["startingDeadlineSeconds"].as_i64().is_some());
    let vars = variables(&job);
    for secret in [
        "IMGPIPE_STATE",
        "PGPASSWORD",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
    ] {
        assert!(
            vars.iter().any(|(name, v)| name == secret && v.is_err()),
            "{secret} is not read from a Secret"
        );
    }
    assert!(
        !vars.iter().any(|(name, _)| name == "IMGPIPE_API_KEY"),
        "the key is mounted as a file, never a variable"
    );
    let volumes = &job["spec"]["jobTemplate"]["spec"]["template"]["spec"]["volumes"];
    let secret = volumes
        .as_vec()
        .unwrap()
        .iter()
        .find(|v| v["name"].as_str() == Some("secret"));
    assert!(
        secret.is_some_and(|v| v["secret"]["items"][0]["key"].as_str() == Some("api-key")),
        "the API key's volume is not the Secret's api-key"
    );
    let limits = &container(&job)["resources"]["limits"];
    assert!(limits["memory"].as_str().is_some() && limits["cpu"].as_str().is_some());
}

#[test]
fn the_systemd_units_pass_systemd_analyze_verify() {
    let (service, timer) = (
        deploy("systemd/imgpipe.service"),
        deploy("systemd/imgpipe.timer"),
    );
    let args = ["verify", service.to_str().unwrap(), timer.to_str().unwrap()];
    let Some(out) = validator("systemd-analyze", &args) else {
        return;
    };
    // An unknown key is only a warning to systemd (exit 0): any word said is a failure here.
    let said = format!("{}{}", common::stdout(&out), common::stderr(&out));
    assert!(
        out.status.success() && said.trim().is_empty(),
        "systemd-analyze verify: {:?}\n{said}",
        out.status
    );
    let timer = std::fs::read_to_string(timer).unwrap();
    assert!(timer.lines().any(|l| l == "Persistent=true"), "{timer}");
}

/// The job's shell line, `exec imgpipe …`, run by `sh` in `dir` against `env`'s sandbox with
/// the variables given, twice: the night is paid for whole, then nothing more.
async fn night_paid_once(env: &Env, line: &str, vars: &[(String, String)], state: &Path) {
    let line = line
        .strip_prefix("exec ")
        .unwrap_or_else(|| panic!("the job's line execs imgpipe (signals reach it): {line}"));
    let run = || {
        let mut cmd = Imgpipe::pasted(line)
            .sandbox(env)
            .env_remove("IMGPIPE_API_KEY");
        for (name, value) in vars {
            cmd = cmd.env(name, value);
        }
        cmd.cwd(env.dir.path()).run()
    };
    let first: Ran = run().await;
    common::assert_exit(&first, 0);
    assert!(state.is_file(), "no state at {}", state.display());
    let billed: u64 = env.sandbox.ledger().iter().map(|e| e.credits).sum();
    assert_eq!(billed, 120, "the night's bill: {}", first.stderr());
    let again: Ran = run().await;
    common::assert_exit(&again, 0);
    assert_eq!(
        env.sandbox.ledger().len(),
        27,
        "started again, it paid: {}",
        again.stderr()
    );
    assert!(again.stdout().contains(": succeeded"), "{}", again.stdout());
}

/// The pipeline of the night, the repository's sample, and the key's file, in `dir`.
fn night_files(env: &Env, dir: &Path) -> (String, String) {
    std::fs::create_dir_all(dir).unwrap();
    let pipeline = dir.join("daily.yaml");
    let sample = Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines/product-shots.yaml");
    std::fs::copy(sample, &pipeline).unwrap();
    std::fs::write(dir.join("api-key"), env.sandbox.key()).unwrap();
    (
        pipeline.display().to_string(),
        dir.join("api-key").display().to_string(),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cronjobs_command_runs_the_night_once() {
    let env = common::start_sample_sized().await;
    let dir = env.dir.path();
    let (pipeline, key_file) = night_files(&env, &dir.join("etc"));
    let job = cronjob();
    let command: Vec<&str> = container(&job)["command"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|w| w.as_str().unwrap())
        .collect();
    assert_eq!(command[..2], ["sh", "-c"], "{command:?}");
    // The manifest's own values, but for the places of this machine; the Secrets' values are
    // this test's state and unused S3 credentials (the outputs are local here).
    let mine = [
        ("PIPELINE", pipeline),
        ("API_KEY_FILE", key_file),
        ("OUT", dir.join("out").display().to_string()),
        ("IMGPIPE_STATE", dir.join("state.db").display().to_string()),
    ];
    let mut vars = Vec::new();
    for (name, value) in variables(&job) {
        if name == "IMGPIPE_BASE_URL" {
            continue;
        }
        let value = match mine.iter().find(|(n, _)| *n == name) {
            Some((_, v)) => v.clone(),
            None => value.unwrap_or_else(|secret| format!("unused-{secret}")),
        };
        vars.push((name, value));
    }
    let line = command[2].replace('\n', " ");
    night_paid_once(&env, &line, &vars, &dir.join("state.db")).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_systemd_services_command_runs_the_night_once() {
    let env = common::start_sample_sized().await;
    let dir = env.dir.path();
    let (pipeline, _) = night_files(&env, &dir.join("credentials"));
    let unit = std::fs::read_to_string(deploy("systemd/imgpipe.service")).unwrap();
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("an ExecStart= line");
    // systemd's escapes: `$$` is a `$`, `%%` a `%`.
    let exec = exec.replace("$$", "$").replace("%%", "%");
    let line = exec
        .strip_prefix("/bin/sh -c '")
        .and_then(|l| l.strip_suffix('\''))
        .unwrap_or_else(|| panic!("ExecStart runs one line of sh: {exec}"));
    assert!(
        unit.lines()
            .any(|l| l == "Environment=PIPELINE=/etc/imgpipe/daily.yaml"),
        "the unit names its pipeline in PIPELINE"
    );
    let vars = [
        ("PIPELINE", pipeline),
        (
            "CREDENTIALS_DIRECTORY",
            dir.join("credentials").display().to_string(),
        ),
        ("STATE_DIRECTORY", dir.join("state").display().to_string()),
    ]
    .map(|(name, value)| (name.to_owned(), value));
    std::fs::create_dir_all(dir.join("state")).unwrap();
    night_paid_once(&env, line, &vars, &dir.join("state/state.db")).await;
}
