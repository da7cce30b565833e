//! The one way the tests start the real `imgpipe` binary: [`Imgpipe`], a builder in the manner
//! of just's `Test` and uv's `TestContext`. Every process it starts has
//!
//! - a clean environment: no `IMGPIPE_*` of the caller's, stdin closed, SIGINT at its default;
//! - its own `HOME` and `XDG_{STATE,CONFIG,CACHE,DATA}_HOME`, shared by the commands a test
//!   runs in the same directory and by no other test, so that a developer's real
//!   `~/.local/state/imgpipe/` never changes what a test sees, and a test never writes there;
//! - a service to talk to when the test gives one (the in-process sandbox, or any address and
//!   key), a state (`--state`, SQLite or PostgreSQL) when the test gives one;
//! - a time limit: a run that does not end within it fails the test with its command line.
//!
//! It returns a [`Ran`]: the exit code, stdout, stderr, and the sandbox's ledger at the end.

#![allow(dead_code)] // the builder's whole surface, some of it used by a few tests only

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use imgpipe::sandbox::LedgerEntry;
use tokio::process::Command;

use crate::common::{Db, Env, RUN_LIMIT, Watched, describe};

/// The variables of the caller's that never reach the binary.
const CLEARED: [&str; 8] = [
    "IMGPIPE_BASE_URL",
    "IMGPIPE_API_KEY",
    "IMGPIPE_LOG",
    "IMGPIPE_STATE",
    "IMGPIPE_NOTIFY_URL",
    "IMGPIPE_NOTIFY_SECRET",
    "PGPASSWORD",
    "PGPASSFILE",
];

/// A command line of the real binary, not started yet.
#[must_use]
pub struct Imgpipe<'e> {
    args: Vec<OsString>,
    cwd: Option<PathBuf>,
    vars: Vec<(OsString, Option<OsString>)>,
    sandbox: Option<&'e Env>,
    /// The `--state` given, for [`Ran::db`].
    state: Option<String>,
    limit: Duration,
    launcher: Launcher,
}

/// What starts the binary: itself, or a program given the command line a user types.
enum Launcher {
    Direct,
    /// `PROGRAM ARGS… LINE TAIL…`, `imgpipe` at the start of LINE being this build's binary.
    Line {
        program: OsString,
        before: Vec<OsString>,
        line: String,
        after: Vec<OsString>,
    },
}

impl<'e> Imgpipe<'e> {
    /// `imgpipe ARGS`, talking to no service unless told.
    pub fn new(args: &[&str]) -> Imgpipe<'e> {
        Imgpipe {
            args: args.iter().map(OsString::from).collect(),
            cwd: None,
            vars: Vec::new(),
            sandbox: None,
            state: None,
            limit: RUN_LIMIT,
            launcher: Launcher::Direct,
        }
    }

    /// A command line as a user pastes it into `sh` (`imgpipe run … --run-id …`, as a run
    /// printed it): the shell reads its quoting; `imgpipe` is this build's binary.
    pub fn pasted(line: &str) -> Imgpipe<'e> {
        Imgpipe::new(&[]).launched_by("sh", &["-c"], line, &[])
    }

    /// A command line run on a terminal that `script` (util-linux, at `script`) gives it:
    /// `script -qefc LINE /dev/null`.
    pub fn on_a_terminal(script: &Path, line: &str) -> Imgpipe<'e> {
        Imgpipe::new(&[]).launched_by(script.as_os_str(), &["-qefc"], line, &["/dev/null"])
    }

    fn launched_by(
        mut self,
        program: impl Into<OsString>,
        before: &[&str],
        line: &str,
        after: &[&str],
    ) -> Imgpipe<'e> {
        assert!(
            line.starts_with("imgpipe "),
            "a command line of imgpipe: {line}"
        );
        self.launcher = Launcher::Line {
            program: program.into(),
            before: before.iter().map(OsString::from).collect(),
            line: line.to_owned(),
            after: after.iter().map(OsString::from).collect(),
        };
        self
    }

    /// The `HOME` of the commands run in `dir`, for a test that puts a user's file there
    /// (`~/.pgpass`).
    pub fn home_in(dir: impl AsRef<Path>) -> PathBuf {
        home_for(dir.as_ref()).swap_remove(0).1
    }

    /// `imgpipe ARGS` in `env`'s directory, pointed at its sandbox with its key.
    pub fn on(env: &'e Env, args: &[&str]) -> Imgpipe<'e> {
        Imgpipe::new(args).sandbox(env).cwd(env.dir.path())
    }

    /// Pointed at `env`'s sandbox (`IMGPIPE_BASE_URL`, `IMGPIPE_API_KEY`); its ledger comes
    /// back with the output.
    pub fn sandbox(mut self, env: &'e Env) -> Imgpipe<'e> {
        self.sandbox = Some(env);
        self.service(env.sandbox.base_url().as_str(), env.sandbox.key())
    }

    /// Pointed at any service: its address and key.
    pub fn service(self, base: &str, key: &str) -> Imgpipe<'e> {
        self.env("IMGPIPE_BASE_URL", base)
            .env("IMGPIPE_API_KEY", key)
    }

    /// `--state STATE`: a SQLite file or a PostgreSQL URL.
    pub fn state(mut self, state: &str) -> Imgpipe<'e> {
        self.state = Some(state.to_owned());
        self.args(&["--state", state])
    }

    /// `--state DIR/state.db`: the SQLite state the tests keep beside their pipeline.
    pub fn sqlite_in(self, dir: impl AsRef<Path>) -> Imgpipe<'e> {
        let path = dir.as_ref().join("state.db");
        self.state(&path.to_string_lossy())
    }

    /// `--retry-base-ms MS` (`run` and `resume`): retries a few milliseconds apart, so that a
    /// test of retries does not wait out the real backoff.
    pub fn retry_base_ms(self, ms: u64) -> Imgpipe<'e> {
        self.args(&["--retry-base-ms", &ms.to_string()])
    }

    /// The caps' clock moved `secs` seconds on (`IMGPIPE_TEST_CAP_CLOCK_OFFSET_SECS`, read by
    /// tests-only builds): tomorrow's window, or leases gone silent, without waiting.
    pub fn caps_clock_offset(self, secs: i64) -> Imgpipe<'e> {
        self.env("IMGPIPE_TEST_CAP_CLOCK_OFFSET_SECS", secs.to_string())
    }

    /// Outputs to the test's S3 server: the environment a user sets for an S3-compatible
    /// store (the place itself is the pipeline's `output:`).
    pub fn s3(mut self, s3: &crate::objects::S3) -> Imgpipe<'e> {
        for (name, value) in s3.vars() {
            self.vars.push((name.into(), value.map(OsString::from)));
        }
        self
    }

    /// More arguments.
    pub fn args(mut self, args: &[&str]) -> Imgpipe<'e> {
        self.args.extend(args.iter().map(OsString::from));
        self
    }

    /// The working directory (else the test process's own).
    pub fn cwd(mut self, dir: impl AsRef<Path>) -> Imgpipe<'e> {
        self.cwd = Some(dir.as_ref().to_owned());
        self
    }

    /// One variable set, over the builder's own (`HOME` included).
    pub fn env(mut self, name: &str, value: impl Into<OsString>) -> Imgpipe<'e> {
        self.vars.push((name.into(), Some(value.into())));
        self
    }

    /// One variable removed, the builder's own included (`XDG_STATE_HOME`, to see `HOME`'s
    /// default used).
    pub fn env_remove(mut self, name: &str) -> Imgpipe<'e> {
        self.vars.push((name.into(), None));
        self
    }

    /// The time the run may take before the test fails (else [`RUN_LIMIT`]).
    pub fn limit(mut self, limit: Duration) -> Imgpipe<'e> {
        self.limit = limit;
        self
    }

    /// The process to start, for a test that drives it (signals, reads its stderr as it
    /// goes): killed when dropped; its stdout and stderr as the caller sets them.
    pub fn command(&self) -> Command {
        let mut cmd = Command::from(self.std_command());
        cmd.kill_on_drop(true);
        cmd
    }

    /// Started, its stderr read line by line as it goes ([`Watched`]): for a test that
    /// signals it or lets its calls through the sandbox's gate.
    pub fn watched(&self) -> Watched {
        Watched::start(self.command())
    }

    /// [`Imgpipe::command`] for a test that waits without a runtime (a property test).
    pub fn std_command(&self) -> std::process::Command {
        let binary = env!("CARGO_BIN_EXE_imgpipe");
        let mut cmd = match &self.launcher {
            Launcher::Direct => std::process::Command::new(binary),
            Launcher::Line {
                program,
                before,
                line,
                after,
            } => {
                let line = line.replacen("imgpipe", &format!("'{binary}'"), 1);
                let mut cmd = std::process::Command::new(program);
                cmd.args(before).arg(line).args(after);
                cmd
            }
        };
        cmd.args(&self.args).stdin(Stdio::null());
        default_sigint(&mut cmd);
        for name in CLEARED {
            cmd.env_remove(name);
        }
        let cwd = self
            .cwd
            .clone()
            .unwrap_or_else(|| std::env::current_dir().expect("the tests' working directory"));
        for (name, dir) in home_for(&cwd) {
            cmd.env(name, dir);
        }
        cmd.current_dir(cwd);
        for (name, value) in &self.vars {
            match value {
                Some(value) => cmd.env(name, value),
                None => cmd.env_remove(name),
            };
        }
        cmd
    }

    /// Runs it to its end, failing the test with the command line if it has not ended within
    /// its limit.
    pub async fn run(self) -> Ran {
        let mut cmd = self.command();
        let what = describe(cmd.as_std());
        let output = tokio::time::timeout(self.limit, cmd.output())
            .await
            .unwrap_or_else(|_| panic!("`{what}` did not finish within {:?}", self.limit))
            .unwrap_or_else(|e| panic!("`{what}` did not run: {e}"));
        Ran {
            output,
            ledger: self.sandbox.map(|env| env.sandbox.ledger()),
            state: self.state,
        }
    }
}

/// SIGINT at its default in the child, however the suite was started: a shell without job
/// control starts a background command (`cargo test … &`) with SIGINT ignored, and a child
/// that inherits that lets a SIGINT sent before it installs its own handler go unseen, where a
/// user's would end it (crash.rs sends some a few milliseconds after the start). Nothing else
/// of the caller's dispositions is changed.
fn default_sigint(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt as _;
    // SAFETY: `signal` is async-signal-safe, and the closure touches nothing else between
    // fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            if libc::signal(libc::SIGINT, libc::SIG_DFL) == libc::SIG_ERR {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// What a run of the binary left: its output, and the sandbox's ledger at its end when it
/// talked to the in-process sandbox. Reads as the [`Output`] it holds.
#[derive(Debug)]
pub struct Ran {
    pub output: Output,
    pub ledger: Option<Vec<LedgerEntry>>,
    /// The `--state` it was given.
    pub state: Option<String>,
}

impl Ran {
    /// The exit code, `None` when a signal ended it.
    pub fn code(&self) -> Option<i32> {
        self.output.status.code()
    }

    pub fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.output.stdout).into_owned()
    }

    pub fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.output.stderr).into_owned()
    }

    /// The state database it was given with `--state`, whole, read now.
    pub async fn db(&self) -> Db {
        let state = self.state.as_deref().expect("a run given --state");
        Db::read(state).await
    }
}

impl std::ops::Deref for Ran {
    type Target = Output;

    fn deref(&self) -> &Output {
        &self.output
    }
}

impl From<Ran> for Output {
    fn from(ran: Ran) -> Output {
        ran.output
    }
}

/// `HOME` and the XDG directories of the commands run in `cwd`: under Cargo's temporary
/// directory for integration tests, one set per working directory (each test has its own
/// temporary one), made on first use. Those of earlier test processes, gone now, are removed
/// the first time.
fn home_for(cwd: &Path) -> Vec<(&'static str, PathBuf)> {
    use sha2::Digest as _;
    let key = hex::encode(&sha2::Sha256::digest(cwd.as_os_str().as_encoded_bytes())[..8]);
    let home = homes().join(key);
    let vars = vec![
        ("XDG_STATE_HOME", home.join(".local/state")),
        ("XDG_CONFIG_HOME", home.join(".config")),
        ("XDG_CACHE_HOME", home.join(".cache")),
        ("XDG_DATA_HOME", home.join(".local/share")),
    ];
    for (_, dir) in &vars {
        std::fs::create_dir_all(dir)
            .unwrap_or_else(|e| panic!("cannot make {}: {e}", dir.display()));
    }
    let mut all = vec![("HOME", home)];
    all.extend(vars);
    all
}

/// This test process's homes: `CARGO_TARGET_TMPDIR/homes/PID/`.
fn homes() -> &'static Path {
    static HOMES: OnceLock<PathBuf> = OnceLock::new();
    HOMES.get_or_init(|| {
        let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("homes");
        if let Ok(entries) = std::fs::read_dir(&root) {
            for entry in entries.flatten() {
                let gone = entry
                    .file_name()
                    .to_str()
                    .and_then(|pid| pid.parse::<u32>().ok())
                    .is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists());
                if gone {
                    let _ = std::fs::remove_dir_all(entry.path());
                }
            }
        }
        root.join(std::process::id().to_string())
    })
}
