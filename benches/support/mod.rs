//! What the benches share: the binary under test, the sandbox as a child process, the kernel's
//! account of a child's time and memory, and where a run keeps its state and outputs (a SQLite
//! file or a fresh PostgreSQL database; a local directory or a bucket of an S3-compatible server
//! in the bench's process).

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub mod black_hole;
mod s3_etags;

use serde_json::Value;
use sqlx::Connection;

/// The binary measured: this build's, or `IMGPIPE_BENCH_BINARY` (another build, to compare
/// two versions on the same machine at the same time).
pub fn binary() -> String {
    std::env::var("IMGPIPE_BENCH_BINARY")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_imgpipe").to_owned())
}

pub fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Wall time, CPU (user + sys) and peak RSS of a child.
#[derive(Clone, Copy, Debug, Default)]
pub struct Usage {
    pub wall: f64,
    /// User + sys.
    pub cpu: f64,
    pub user: f64,
    pub sys: f64,
    pub peak_mib: f64,
}

/// Reaps child `pid`, started at `start`, and panics with the tail of its log (`stderr`) when
/// it did not exit 0.
pub fn wait(pid: u32, start: Instant, stderr: &Path) -> Usage {
    let (usage, status) = reap(pid, start);
    if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
        failed(status, stderr);
    }
    usage
}

/// How long a child may run before the bench kills it and fails naming it, so that a stuck
/// binary ends the bench rather than hanging it: `IMGPIPE_BENCH_CHILD_LIMIT` seconds, else 30
/// minutes (the 100,000-item run takes a few).
fn child_limit() -> Duration {
    Duration::from_secs(env_usize("IMGPIPE_BENCH_CHILD_LIMIT", 1800) as u64)
}

/// Kills child `pid` unless disarmed within a limit; [`Watchdog::disarm`] says whether it
/// had to.
struct Watchdog {
    stop: mpsc::Sender<()>,
    thread: std::thread::JoinHandle<bool>,
}

impl Watchdog {
    fn arm(pid: u32, limit: Duration) -> Watchdog {
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::spawn(move || match stopped.recv_timeout(limit) {
            Err(mpsc::RecvTimeoutError::Timeout) => {
                // SAFETY: a plain kill(2); the child is not reaped before the watchdog is
                // disarmed (see `reap`), so the pid is still ours.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
                true
            }
            _ => false,
        });
        Watchdog { stop, thread }
    }

    fn disarm(self) -> bool {
        let _ = self.stop.send(());
        self.thread.join().expect("the watchdog thread")
    }
}

/// Reaps child `pid`, started at `start`, whatever its end: its usage and its raw wait status.
/// A child still running after [`child_limit`] is killed and the bench fails, naming it.
pub fn reap(pid: u32, start: Instant) -> (Usage, libc::c_int) {
    let watchdog = Watchdog::arm(pid, child_limit());
    // Wait for the end without reaping, so that the pid stays ours until the watchdog is
    // disarmed; wait4 below then reaps at once and reads the child's rusage.
    // SAFETY: an all-zero siginfo_t is a valid value, and waitid writes it for our own child.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: pid is our child, not yet reaped; info points at a live local.
    let waited = unsafe {
        libc::waitid(
            libc::P_PID,
            pid as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOWAIT,
        )
    };
    assert_eq!(waited, 0, "waitid failed");
    let wall = start.elapsed();
    if watchdog.disarm() {
        panic!(
            "child {pid} ({}) was still running after {:?}: killed",
            binary(),
            child_limit()
        );
    }
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value, and wait4 writes it for our own child.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: pid is our child, not yet reaped; status and usage point at live locals.
    let reaped = unsafe { libc::wait4(pid as libc::pid_t, &mut status, 0, &mut usage) };
    assert_eq!(reaped, pid as libc::pid_t, "wait4 failed");
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    let (user, sys) = (seconds(usage.ru_utime), seconds(usage.ru_stime));
    let usage = Usage {
        wall: wall.as_secs_f64(),
        cpu: user + sys,
        user,
        sys,
        // Linux reports ru_maxrss in KiB.
        peak_mib: usage.ru_maxrss as f64 / 1024.0,
    };
    (usage, status)
}

/// Panics with wait status `status` and the tail of the child's log (`stderr`).
pub fn failed(status: libc::c_int, stderr: &Path) -> ! {
    let log = std::fs::read_to_string(stderr).unwrap_or_default();
    let tail: Vec<&str> = log.lines().rev().take(20).collect();
    panic!(
        "the child logging to {} failed with status {status}; its last log lines:\n{}",
        stderr.display(),
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    );
}

/// Starts `cmd` with its output in files; [`wait`] measures it.
pub fn spawn(cmd: &mut Command, stdout: &Path, stderr: &Path) -> (Child, Instant) {
    let out = std::fs::File::create(stdout).expect("create stdout file");
    let err = std::fs::File::create(stderr).expect("create stderr file");
    let start = Instant::now();
    let child = cmd
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .expect("spawn imgpipe");
    (child, start)
}

/// Runs `cmd` to the end with its output in files, and measures it.
#[allow(clippy::zombie_processes)] // reaped by wait4, which also reads its rusage
pub fn measure(mut cmd: Command, stdout: &Path, stderr: &Path) -> Usage {
    let (child, start) = spawn(&mut cmd, stdout, stderr);
    wait(child.id(), start, stderr)
}

/// Runs `cmd` (a step that prepares a bench, not measured) to the end, its stdout discarded,
/// and panics naming `what` when it fails or outlives [`child_limit`].
#[allow(clippy::zombie_processes)] // reaped by wait4 in `reap`
pub fn run_to_end(mut cmd: Command, what: &str) {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{what}: cannot start {}: {e}", binary()));
    let (_, status) = reap(child.id(), Instant::now());
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "{what} failed with wait status {status}"
    );
}

/// `imgpipe sandbox` as a child process, killed when dropped.
pub struct Sandbox {
    child: Child,
    _stdout: BufReader<ChildStdout>,
    pub base_url: String,
    pub api_key: String,
}

impl Sandbox {
    pub fn start(extra: &[String]) -> Sandbox {
        Sandbox::start_with_balance("100000000", extra)
    }

    /// [`Sandbox::start`] with another starting balance (the sandbox takes `--balance` once).
    pub fn start_with_balance(balance: &str, extra: &[String]) -> Sandbox {
        let mut child = Command::new(binary())
            .args(["sandbox", "--json", "--port", "0", "--balance", balance])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn imgpipe sandbox");
        let mut stdout = BufReader::new(child.stdout.take().expect("sandbox stdout"));
        let mut line = String::new();
        // A sandbox that never says where it listens is killed, which ends the read.
        let watchdog = Watchdog::arm(child.id(), Duration::from_secs(60));
        stdout
            .read_line(&mut line)
            .expect("read the sandbox's line");
        assert!(
            !watchdog.disarm(),
            "the sandbox printed no line within 60 s: killed"
        );
        let hello: Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("the sandbox printed {line:?}: {e}"));
        let field = |k: &str| hello[k].as_str().expect("sandbox field").to_owned();
        Sandbox {
            base_url: field("base_url"),
            api_key: field("api_key"),
            child,
            _stdout: stdout,
        }
    }

    /// `GET /_sandbox/stats`, over a bare HTTP/1.0 connection.
    pub fn stats(&self) -> Value {
        let url = url::Url::parse(&self.base_url)
            .and_then(|b| b.join("_sandbox/stats"))
            .expect("stats URL");
        let host = url.host_str().expect("sandbox host");
        let port = url.port().expect("sandbox port");
        let mut stream = TcpStream::connect((host, port)).expect("connect to the sandbox");
        write!(
            stream,
            "GET {} HTTP/1.0\r\nHost: {host}:{port}\r\nX-API-Key: {}\r\n\r\n",
            url.path(),
            self.api_key
        )
        .expect("send the stats request");
        let mut answer = String::new();
        stream
            .read_to_string(&mut answer)
            .expect("read the stats answer");
        let (head, body) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
        assert!(head.contains(" 200 "), "stats: {head}");
        serde_json::from_str(body).expect("stats are JSON")
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The run's `--state`: `state.db` in `dir`, or a new database on the PostgreSQL server of
/// IMGPIPE_BENCH_STATE (`postgres://ADMIN@HOST:PORT/DB`, a user allowed to create databases).
pub fn state_for(dir: &Path) -> String {
    let Some(admin) = std::env::var("IMGPIPE_BENCH_STATE")
        .ok()
        .filter(|v| !v.is_empty())
    else {
        return dir.join("state.db").to_string_lossy().into_owned();
    };
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let name = format!(
        "imgpipe_bench_{}_{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    block_on(async {
        let mut conn = sqlx::PgConnection::connect(&admin)
            .await
            .expect("reach IMGPIPE_BENCH_STATE");
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
            .execute(&mut conn)
            .await
            .expect("create the run's database");
        let _ = conn.close().await;
    });
    let mut url = url::Url::parse(&admin).expect("IMGPIPE_BENCH_STATE is a URL");
    url.set_path(&name);
    url.to_string()
}

/// Whether IMGPIPE_BENCH_OUT=s3 puts the outputs in the bench's S3-compatible server.
pub fn s3_out() -> bool {
    std::env::var("IMGPIPE_BENCH_OUT").as_deref() == Ok("s3")
}

/// The run's `--out`: `out` in `dir`, or a new prefix in the bench's bucket with
/// IMGPIPE_BENCH_OUT=s3 (the store's environment set on `cmd`, as a user sets it).
pub fn out_for(dir: &Path, cmd: &mut Command) -> String {
    if !s3_out() {
        return dir.join("out").to_string_lossy().into_owned();
    }
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    s3_env(cmd);
    format!("s3://bench/run{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Sets the environment of the bench's S3 server on `cmd` (starting the server the first
/// time), with IMGPIPE_BENCH_OUT=s3; does nothing otherwise.
pub fn s3_env(cmd: &mut Command) {
    if !s3_out() {
        return;
    }
    static SERVER: std::sync::OnceLock<u16> = std::sync::OnceLock::new();
    let port = *SERVER.get_or_init(s3_server);
    cmd.env("AWS_ACCESS_KEY_ID", S3_KEY)
        .env("AWS_SECRET_ACCESS_KEY", S3_SECRET)
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ENDPOINT", format!("http://127.0.0.1:{port}"))
        .env("AWS_ALLOW_HTTP", "true");
}

/// Removes the bucket of the bench's S3 server, if one was started (unless IMGPIPE_BENCH_KEEP
/// is set): its objects are the bench's runs' outputs, hundreds of MiB.
pub fn s3_remove_bucket() {
    if std::env::var_os("IMGPIPE_BENCH_KEEP").is_none()
        && let Some(root) = S3_ROOT.get()
    {
        let _ = std::fs::remove_dir_all(root);
    }
}

/// The directory the bench's S3 server keeps its buckets in, once started.
pub fn s3_root() -> Option<&'static Path> {
    S3_ROOT.get().map(|p| p.as_path())
}

/// Requests the bench's S3 server has received so far (0 without one).
pub fn s3_requests() -> u64 {
    S3_REQUESTS.load(Ordering::Relaxed)
}

/// LIST requests (a GET with `list-type`) the bench's S3 server has received so far.
pub fn s3_lists() -> u64 {
    S3_LISTS.load(Ordering::Relaxed)
}

/// With IMGPIPE_BENCH_S3_LOG=FILE, a line per request the S3 server receives (milliseconds
/// since the epoch, LIST or the method, the path), to see what a takeover asks and when.
fn s3_log<B>(req: &http::Request<B>, list: bool) {
    let Some(file) = std::env::var_os("IMGPIPE_BENCH_S3_LOG") else {
        return;
    };
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let kind = if list { "LIST" } else { req.method().as_str() };
    let line = format!("{ms} {kind} {}\n", req.uri());
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(file)
    {
        let _ = f.write_all(line.as_bytes());
    }
}

static S3_REQUESTS: AtomicU64 = AtomicU64::new(0);
static S3_LISTS: AtomicU64 = AtomicU64::new(0);
static S3_ROOT: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
const S3_KEY: &str = "AKIAIMGPIPEBENCH";
const S3_SECRET: &str = "imgpipe-bench-secret";

/// Starts s3s-fs on 127.0.0.1 in a thread of its own, its bucket `bench` in a temporary
/// directory kept until the bench ends ([`s3_remove_bucket`]), every request counted; returns
/// its port.
fn s3_server() -> u16 {
    let root = tempfile::tempdir().expect("temp dir").keep();
    let _ = S3_ROOT.set(root.clone());
    std::fs::create_dir(root.join("bench")).expect("the bucket");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("tokio runtime");
        runtime.block_on(async move {
            let fs = s3_etags::ListingETags::new(&root)
                .expect("s3s-fs")
                .remembering();
            let mut builder = s3s::service::S3ServiceBuilder::new(fs);
            builder.set_auth(s3s::auth::SimpleAuth::from_single(S3_KEY, S3_SECRET));
            let service = builder.build();
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            tx.send(listener.local_addr().expect("port").port())
                .expect("send the port");
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let service = service.clone();
                let counted = hyper::service::service_fn(move |req: http::Request<_>| {
                    S3_REQUESTS.fetch_add(1, Ordering::Relaxed);
                    let list = req.uri().query().is_some_and(|q| q.contains("list-type"));
                    if list {
                        S3_LISTS.fetch_add(1, Ordering::Relaxed);
                    }
                    s3_log(&req, list);
                    let service = service.clone();
                    async move {
                        let delay = env_usize("IMGPIPE_BENCH_S3_LIST_MS", 0) as u64;
                        if list && delay > 0 {
                            tokio::time::sleep(Duration::from_millis(delay)).await;
                        }
                        hyper::service::Service::call(&service, req).await
                    }
                });
                tokio::spawn(async move {
                    let _ = hyper_util::server::conn::auto::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), counted)
                    .await;
                });
            }
        });
    });
    rx.recv().expect("the S3 server starts")
}

/// The base URL and token of a desk from the first line `imgpipe review --no-open` prints.
pub fn desk_url(first_line: &str) -> (String, String) {
    let url = url::Url::parse(first_line.trim()).expect("the desk's URL");
    let token = url
        .query_pairs()
        .find(|(k, _)| k == "token")
        .map(|(_, v)| v.into_owned())
        .expect("the token");
    let base = format!("http://127.0.0.1:{}", url.port().expect("a port"));
    (base, token)
}

pub fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
        .block_on(f)
}
