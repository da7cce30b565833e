//! A throwaway PostgreSQL cluster of one test's own, for what the shared test server cannot
//! show: it trusts every connection from loopback, so a password there is never checked. This
//! one checks passwords (`scram-sha-256` for every TCP connection), listens on 127.0.0.1 only,
//! at a port free when it starts, and lives in a temporary directory removed with it.
//!
//! Made with the server's own `initdb` and `pg_ctl` (`IMGPIPE_PG_BIN`, else the newest of
//! `/usr/lib/postgresql/*/bin`, as `.ci/postgres.sh` finds them); as root, run as the
//! `postgres` user, since `initdb` refuses root. Without them the test says it skips, and
//! fails under CI.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::common::{finish_blocking, skip_unless_ci, try_finish_blocking};

/// How long `initdb`, `pg_ctl start` and `pg_ctl stop` may take each.
const STEP_LIMIT: Duration = Duration::from_secs(120);

/// A running cluster whose superuser `postgres` has a password: stopped and removed when
/// dropped.
pub struct Cluster {
    bin: PathBuf,
    dir: tempfile::TempDir,
    pub port: u16,
    as_postgres: bool,
}

impl Cluster {
    /// Starts a cluster whose superuser `postgres` has `password`; `None` when this machine
    /// has no PostgreSQL server binaries (said as a skip; under CI the test fails).
    pub async fn start(password: &str) -> Option<Cluster> {
        // On the test's own thread, which names the test in a skip.
        let bin = server_bin()?;
        let password = password.to_owned();
        let made = tokio::task::spawn_blocking(move || Cluster::make(bin, &password));
        Some(
            made.await
                .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic())),
        )
    }

    /// `initdb` and `pg_ctl start`, waited for.
    fn make(bin: PathBuf, password: &str) -> Cluster {
        let as_postgres = unsafe { libc::geteuid() } == 0;
        let dir = tempfile::Builder::new()
            .prefix("imgpipe-pg-")
            .tempdir()
            .expect("a temporary directory for the cluster");
        std::fs::write(dir.path().join("pwfile"), format!("{password}\n")).unwrap();
        if as_postgres {
            chown_to_postgres(dir.path());
        }
        let mut cluster = Cluster {
            bin,
            dir,
            port: 0,
            as_postgres,
        };
        let data = cluster.data();
        let pwfile = cluster.dir.path().join("pwfile");
        let mut initdb = cluster.server_command("initdb");
        initdb
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "-E", "UTF8", "--no-locale", "--no-sync"])
            .args(["--auth-local=trust", "--auth-host=scram-sha-256"])
            .arg(format!("--pwfile={}", pwfile.display()));
        let out = finish_blocking(initdb, STEP_LIMIT, "initdb");
        assert!(out.status.success(), "initdb failed: {}", said(&out));
        cluster.listen();
        cluster
    }

    /// `pg_ctl start` on a loopback port free a moment before; tried again on another port
    /// when one was taken in between.
    fn listen(&mut self) {
        let mut why = String::new();
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free loopback port")
                .port();
            let options = format!(
                "-c listen_addresses=127.0.0.1 -p {port} -k {} -c fsync=off",
                self.dir.path().display()
            );
            let log = self.dir.path().join(format!("server-{port}.log"));
            let mut start = self.server_command("pg_ctl");
            start
                .arg("-D")
                .arg(self.data())
                .arg("-l")
                .arg(&log)
                .args(["-w", "-t", "60", "-o", &options, "start"]);
            let out = finish_blocking(start, STEP_LIMIT, "pg_ctl start");
            if out.status.success() {
                self.port = port;
                return;
            }
            why = format!(
                "{}\n{}",
                said(&out),
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        panic!("the throwaway cluster did not start: {why}");
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// One of the server's programs, as the `postgres` user when we are root.
    fn server_command(&self, program: &str) -> Command {
        let program = self.bin.join(program);
        if self.as_postgres {
            let mut cmd = Command::new("runuser");
            cmd.args(["-u", "postgres", "--"]).arg(program);
            cmd
        } else {
            Command::new(program)
        }
    }

    /// `postgres://USER[:PASSWORD]@127.0.0.1:PORT/DATABASE`.
    pub fn url(&self, user: &str, password: Option<&str>, database: &str) -> String {
        let secret = password.map(|p| format!(":{p}")).unwrap_or_default();
        format!(
            "postgres://{user}{secret}@127.0.0.1:{}/{database}",
            self.port
        )
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let mut stop = self.server_command("pg_ctl");
        stop.arg("-D")
            .arg(self.data())
            .args(["-m", "immediate", "-w", "stop"]);
        if let Err(why) = try_finish_blocking(stop, STEP_LIMIT, "pg_ctl stop") {
            eprintln!(
                "the throwaway cluster in {} may still run: {why}",
                self.dir.path().display()
            );
        }
    }
}

/// The directory of `initdb` and `pg_ctl`, or `None` (a skip said; under CI, a failure).
fn server_bin() -> Option<PathBuf> {
    let found = std::env::var_os("IMGPIPE_PG_BIN")
        .map(PathBuf::from)
        .or_else(|| {
            let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path().join("bin"))
                .collect();
            dirs.sort_by_key(|d| {
                let version = d.parent().and_then(Path::file_name);
                version.and_then(|v| v.to_str()?.parse::<u32>().ok())
            });
            dirs.pop()
        });
    match found {
        Some(bin) if bin.join("initdb").is_file() && bin.join("pg_ctl").is_file() => Some(bin),
        _ => {
            skip_unless_ci(
                "PostgreSQL server binaries",
                "no initdb and pg_ctl in IMGPIPE_PG_BIN or /usr/lib/postgresql/*/bin",
                "install Debian's `postgresql` (`bash .ci/run` does)",
            );
            None
        }
    }
}

/// Gives `dir` to the `postgres` user, for a cluster made as root.
fn chown_to_postgres(dir: &Path) {
    let out = finish_blocking(
        {
            let mut cmd = Command::new("chown");
            cmd.args(["-R", "postgres:"]).arg(dir);
            cmd
        },
        STEP_LIMIT,
        "chown postgres:",
    );
    assert!(
        out.status.success(),
        "root, and no postgres user to own the throwaway cluster: {}",
        said(&out)
    );
}

fn said(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}
