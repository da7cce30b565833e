//! Fixtures: a sandbox on port 0 with a client pointed at it, and a builder for running the
//! real `imgpipe` binary against it.

#![allow(dead_code)]

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use imgpipe::api::download::DEFAULT_MAX_BYTES;
use imgpipe::api::{ApiKey, Client, ClientConfig, Downloader};
use imgpipe::sandbox::{self, Sandbox};

pub struct Env {
    pub sandbox: Sandbox,
    pub client: Client,
    pub downloader: Downloader,
    pub dir: tempfile::TempDir,
}

pub async fn start(config: sandbox::Config) -> Env {
    let sandbox = Sandbox::start(config).await.expect("sandbox starts");
    let client = client_for(&sandbox, sandbox.key());
    let downloader = Downloader::new(
        Duration::from_secs(5),
        Duration::from_secs(30),
        DEFAULT_MAX_BYTES,
    )
    .unwrap();
    Env {
        sandbox,
        client,
        downloader,
        dir: tempfile::tempdir().unwrap(),
    }
}

pub async fn start_default() -> Env {
    start(sandbox::Config::default()).await
}

pub fn client_for(sandbox: &Sandbox, key: &str) -> Client {
    let mut config =
        ClientConfig::new(sandbox.base_url().as_str(), ApiKey::new(key).unwrap()).unwrap();
    config.timeout = Duration::from_secs(30);
    Client::new(config).unwrap()
}

/// Posts a raw JSON body, bypassing the client's own checks, to see what the sandbox says.
pub async fn raw_post(env: &Env, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    let response = reqwest::Client::new()
        .post(env.sandbox.base_url().join(path).unwrap())
        .header("X-API-Key", env.sandbox.key())
        .json(body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (
        status,
        response.json().await.unwrap_or(serde_json::Value::Null),
    )
}

/// Runs the real binary with the given arguments, pointed at `env`'s sandbox unless the
/// arguments say otherwise.
pub async fn imgpipe(env: Option<&Env>, args: &[&str], cwd: &Path) -> Output {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_imgpipe"));
    cmd.args(args)
        .current_dir(cwd)
        .env_remove("IMGPIPE_BASE_URL")
        .env_remove("IMGPIPE_API_KEY")
        .env_remove("IMGPIPE_LOG");
    if let Some(env) = env {
        cmd.env("IMGPIPE_BASE_URL", env.sandbox.base_url().as_str())
            .env("IMGPIPE_API_KEY", env.sandbox.key());
    }
    cmd.output().await.expect("imgpipe runs")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn decode(path: &Path) -> image::DynamicImage {
    let bytes = std::fs::read(path).unwrap();
    assert!(
        bytes.starts_with(b"\x89PNG\r\n\x1a\n"),
        "{} is not a PNG",
        path.display()
    );
    image::load_from_memory_with_format(&bytes, image::ImageFormat::Png).unwrap()
}
