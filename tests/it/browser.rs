//! A small headless-Chromium harness: load a local HTML file in a real browser and report which
//! of its images failed to load, plus a screenshot.
//!
//! Chromium is driven through chromedriver's W3C WebDriver HTTP API with `reqwest`. Everything
//! talks to 127.0.0.1 only: the HTTP client ignores proxy settings and calls chromedriver on
//! 127.0.0.1 (chromedriver binds that port on ::1 as well and has no option not to), and Chromium
//! is told to use no proxy and to resolve no host name but `localhost`.
//!
//! Binaries: `IMGPIPE_CHROMIUM` (default `/usr/bin/chromium`) and `IMGPIPE_CHROMEDRIVER` (default
//! `/usr/bin/chromedriver`). When either is missing the check is skipped, unless
//! `IMGPIPE_REQUIRE_CHROMIUM` is set (CI sets it once it has installed them), in which case the
//! test fails.

use std::fmt::Write as _;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// What the browser saw when it loaded a page.
#[derive(Debug)]
pub struct PageCheck {
    /// Number of `<img>` elements in the document (after un-hiding everything).
    pub images: usize,
    /// The resolved URL (`currentSrc`, else `src`, as the browser reports it: absolute and
    /// percent-encoded, e.g. `file:///tmp/x/missing%20one.png`) of every image that did not load.
    pub broken: Vec<String>,
    /// Where the PNG screenshot of the viewport was written (a 1400x1800 window; new headless
    /// mode keeps room for browser UI, so the PNG here is 1400x1661).
    pub screenshot: PathBuf,
    /// `document.title`.
    pub title: String,
    /// What each probe script returned, run in order once the page loaded (before anything
    /// was un-hidden).
    pub probes: Vec<Value>,
}

/// How long the in-page script waits, in total, for all images to load or fail.
const IMAGE_WAIT: Duration = Duration::from_secs(20);
/// How long chromedriver gets to answer `/status` after it is started.
const DRIVER_START: Duration = Duration::from_secs(15);
/// Per-request limits; each bounds how long a hung browser can stall the test.
const SESSION_TIMEOUT: Duration = Duration::from_secs(30);
const NAVIGATE_TIMEOUT: Duration = Duration::from_secs(25);
const SCRIPT_TIMEOUT: Duration = Duration::from_secs(30);
const SCREENSHOT_TIMEOUT: Duration = Duration::from_secs(20);
const DELETE_TIMEOUT: Duration = Duration::from_secs(5);

const CHROMIUM_ARGS: &[&str] = &[
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1800",
    // Docker's default /dev/shm is 64 MB, too small for Chromium. Debian's /usr/bin/chromium
    // wrapper tries to add this itself, but its check breaks when findmnt prints several lines.
    "--disable-dev-shm-usage",
    // Loopback only: no proxy, and no DNS for anything but localhost (file:// needs neither).
    "--no-proxy-server",
    "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE localhost",
];

/// Runs in the page via `execute/sync`, which awaits the returned promise. Un-hides `[hidden]`
/// elements, makes every image eager, scrolls through the page, waits (at most `arguments[0]`
/// ms) for each image to load or fail, and reports them.
const IMAGES_SCRIPT: &str = r#"
const limit = arguments[0];
const sleep = ms => new Promise(r => setTimeout(r, ms));
return (async () => {
  for (const el of document.querySelectorAll('[hidden]')) el.removeAttribute('hidden');
  const imgs = Array.from(document.images);
  for (const img of imgs) img.loading = 'eager';
  // Scroll through the page as a reader would, so images a page script loads as they come
  // near the screen get their turn; then back to the top for the screenshot.
  const frame = () => new Promise(r => requestAnimationFrame(() => r()));
  for (let y = 0; y < document.documentElement.scrollHeight; y += innerHeight / 2) {
    scrollTo(0, y);
    await Promise.race([frame().then(frame), sleep(100)]);
  }
  scrollTo(0, 0);
  const settle = img => new Promise(resolve => {
    if (img.complete) return resolve();
    img.addEventListener('load', resolve, { once: true });
    img.addEventListener('error', resolve, { once: true });
  }).then(() => img.decode().catch(() => null));
  let timedOut = false;
  await Promise.race([
    Promise.all(imgs.map(settle)),
    sleep(limit).then(() => { timedOut = true; }),
  ]);
  // Let the un-hidden content and the images paint before the screenshot.
  await Promise.race([
    new Promise(r => requestAnimationFrame(() => requestAnimationFrame(() => r()))),
    sleep(2000),
  ]);
  return {
    title: document.title,
    timedOut,
    images: imgs.map(img => ({
      src: img.currentSrc || img.src,
      complete: img.complete,
      naturalWidth: img.naturalWidth,
    })),
  };
})();
"#;

/// Loads `html` in headless Chromium, waits for its images, and writes a screenshot to
/// `screenshot_to`. Returns `None` (after saying why on stderr) when Chromium or chromedriver is
/// missing and `IMGPIPE_REQUIRE_CHROMIUM` is not set; panics on any other failure, including a
/// screenshot that is not a PNG or is one flat colour.
pub async fn check_page(html: &Path, screenshot_to: &Path, probes: &[&str]) -> Option<PageCheck> {
    let (chromium, chromedriver) = find_binaries()?;
    let html = std::fs::canonicalize(html)
        .unwrap_or_else(|e| panic!("browser: cannot resolve {}: {e}", html.display()));
    let page_url = url::Url::from_file_path(&html)
        .unwrap_or_else(|()| panic!("browser: no file:// URL for {}", html.display()));

    // The Driver guard kills chromedriver and Chromium when it drops, also on panic; on success
    // the session is closed politely first.
    let driver = Driver::start(&chromedriver).await;
    let session = driver.new_session(&chromium).await;
    let session_path = format!("/session/{session}");
    driver
        .call(
            "POST",
            &format!("{session_path}/url"),
            Some(json!({ "url": page_url.as_str() })),
            NAVIGATE_TIMEOUT,
        )
        .await;
    let mut answers = Vec::new();
    for probe in probes {
        let answer = driver
            .call(
                "POST",
                &format!("{session_path}/execute/sync"),
                Some(json!({ "script": probe, "args": [] })),
                SCRIPT_TIMEOUT,
            )
            .await;
        answers.push(answer);
    }
    let report = driver
        .call(
            "POST",
            &format!("{session_path}/execute/sync"),
            Some(json!({ "script": IMAGES_SCRIPT, "args": [millis(IMAGE_WAIT)] })),
            SCRIPT_TIMEOUT,
        )
        .await;
    let shot = driver
        .call(
            "GET",
            &format!("{session_path}/screenshot"),
            None,
            SCREENSHOT_TIMEOUT,
        )
        .await;
    let _ = driver
        .try_call("DELETE", &session_path, None, DELETE_TIMEOUT)
        .await;
    drop(driver);

    let images = report["images"]
        .as_array()
        .unwrap_or_else(|| panic!("browser: unexpected script result: {report}"));
    if report["timedOut"].as_bool() == Some(true) {
        eprintln!("browser: images still loading after {IMAGE_WAIT:?}; counting those as broken");
    }
    let broken = images
        .iter()
        .filter(|img| {
            img["complete"].as_bool() != Some(true)
                || img["naturalWidth"].as_u64().unwrap_or(0) == 0
        })
        .map(|img| img["src"].as_str().unwrap_or_default().to_owned())
        .collect();

    let png = shot.as_str().and_then(base64_decode).unwrap_or_else(|| {
        panic!(
            "browser: screenshot is not base64: {:.200}",
            shot.to_string()
        )
    });
    check_screenshot(&png);
    if let Some(dir) = screenshot_to.parent() {
        std::fs::create_dir_all(dir).ok();
    }
    std::fs::write(screenshot_to, &png)
        .unwrap_or_else(|e| panic!("browser: cannot write {}: {e}", screenshot_to.display()));

    Some(PageCheck {
        images: images.len(),
        broken,
        screenshot: screenshot_to.to_owned(),
        title: report["title"].as_str().unwrap_or_default().to_owned(),
        probes: answers,
    })
}

fn find_binaries() -> Option<(PathBuf, PathBuf)> {
    let from_env = |var: &str, default: &str| {
        PathBuf::from(std::env::var_os(var).unwrap_or_else(|| default.into()))
    };
    let chromium = from_env("IMGPIPE_CHROMIUM", "/usr/bin/chromium");
    let chromedriver = from_env("IMGPIPE_CHROMEDRIVER", "/usr/bin/chromedriver");
    let missing: Vec<String> = [&chromium, &chromedriver]
        .into_iter()
        .filter(|p| !p.is_file())
        .map(|p| p.display().to_string())
        .collect();
    if missing.is_empty() {
        return Some((chromium, chromedriver));
    }
    let required = std::env::var_os("IMGPIPE_REQUIRE_CHROMIUM").is_some_and(|v| !v.is_empty());
    let what = missing.join(" and ");
    if required {
        panic!(
            "browser: IMGPIPE_REQUIRE_CHROMIUM is set but {what} not found \
             (install `chromium chromium-driver`, or point IMGPIPE_CHROMIUM / \
             IMGPIPE_CHROMEDRIVER at them)"
        );
    }
    eprintln!(
        "skipping: browser check needs {what} (install `chromium chromium-driver` or set \
         IMGPIPE_CHROMIUM / IMGPIPE_CHROMEDRIVER; set IMGPIPE_REQUIRE_CHROMIUM=1 to fail instead)"
    );
    None
}

/// A running chromedriver (in its own process group, with Chromium under it) and its profile
/// directory. Dropping it kills the whole process group, so nothing outlives the test.
struct Driver {
    child: Child,
    base: String,
    http: reqwest::Client,
    // Declared last: removed only after the processes using it are dead.
    dir: tempfile::TempDir,
}

impl Driver {
    async fn start(chromedriver: &Path) -> Driver {
        let http = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(Duration::from_secs(2))
            .build()
            .expect("browser: HTTP client");
        // A free port can be taken between our check and chromedriver's bind: retry a few times.
        let mut attempt = 1;
        loop {
            let dir = tempfile::tempdir().expect("browser: tempdir");
            let port = free_port();
            let output = std::fs::File::create(dir.path().join("chromedriver.out"))
                .expect("browser: chromedriver output file");
            let child = Command::new(chromedriver)
                .arg(format!("--port={port}"))
                .arg(format!(
                    "--log-path={}",
                    dir.path().join("chromedriver.log").display()
                ))
                .stdin(Stdio::null())
                .stdout(output.try_clone().expect("browser: dup output file"))
                .stderr(output)
                // Its own process group, so that Drop can kill Chromium along with it.
                .process_group(0)
                .spawn()
                .unwrap_or_else(|e| {
                    panic!("browser: cannot start {}: {e}", chromedriver.display())
                });
            let mut driver = Driver {
                child,
                base: format!("http://127.0.0.1:{port}"),
                http: http.clone(),
                dir,
            };
            match driver.wait_ready().await {
                Ok(()) => return driver,
                Err(why) if attempt < 3 && why.contains("exited") => {
                    eprintln!("browser: chromedriver on port {port} {why}; retrying");
                    attempt += 1;
                }
                Err(why) => panic!(
                    "browser: chromedriver ({}) {why}\n{}",
                    chromedriver.display(),
                    driver.diagnostics()
                ),
            }
        }
    }

    async fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + DRIVER_START;
        let url = format!("{}/status", self.base);
        loop {
            if let Some(status) = self.child.try_wait().ok().flatten() {
                return Err(format!("exited early ({status})"));
            }
            let reply = self
                .http
                .get(&url)
                .timeout(Duration::from_secs(2))
                .send()
                .await;
            if let Ok(reply) = reply
                && let Ok(body) = reply.json::<Value>().await
                && body["value"]["ready"].as_bool() == Some(true)
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("not ready at {url} after {DRIVER_START:?}"));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn new_session(&self, chromium: &Path) -> String {
        let profile = self.dir.path().join("profile");
        let mut args: Vec<String> = CHROMIUM_ARGS.iter().map(|a| a.to_string()).collect();
        args.push(format!("--user-data-dir={}", profile.display()));
        let caps = json!({
            "capabilities": {
                "alwaysMatch": {
                    "browserName": "chrome",
                    "pageLoadStrategy": "normal",
                    "timeouts": {
                        "pageLoad": millis(NAVIGATE_TIMEOUT - Duration::from_secs(5)),
                        "script": millis(IMAGE_WAIT + Duration::from_secs(5)),
                        "implicit": 0,
                    },
                    "goog:chromeOptions": {
                        "binary": chromium.to_string_lossy(),
                        "args": args,
                    },
                }
            }
        });
        let value = self
            .call("POST", "/session", Some(caps), SESSION_TIMEOUT)
            .await;
        value["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("browser: no sessionId in {value}"))
            .to_owned()
    }

    /// One WebDriver command; panics with chromedriver's log on any error.
    async fn call(&self, method: &str, path: &str, body: Option<Value>, limit: Duration) -> Value {
        match self.try_call(method, path, body, limit).await {
            Ok(value) => value,
            Err(why) => panic!(
                "browser: {method} {path} failed: {why}\n{}",
                self.diagnostics()
            ),
        }
    }

    /// One WebDriver command; returns its `value`, or a description of what went wrong.
    async fn try_call(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
        limit: Duration,
    ) -> Result<Value, String> {
        let url = format!("{}{path}", self.base);
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let mut request = self.http.request(method, &url).timeout(limit);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let reply = request.send().await.map_err(|e| {
            if e.is_timeout() {
                format!("no answer within {limit:?}")
            } else {
                format!("{e}")
            }
        })?;
        let status = reply.status();
        let mut body: Value = reply
            .json()
            .await
            .map_err(|e| format!("HTTP {status}, unreadable body: {e}"))?;
        let value = body["value"].take();
        if status.is_success() {
            Ok(value)
        } else {
            Err(format!(
                "HTTP {status}: {}: {}",
                value["error"].as_str().unwrap_or("?"),
                value["message"].as_str().unwrap_or("?")
            ))
        }
    }

    /// The tail of chromedriver's own output and log, for failure messages.
    fn diagnostics(&self) -> String {
        let mut out = String::new();
        for name in ["chromedriver.out", "chromedriver.log"] {
            let text = std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(30)..];
            let _ = writeln!(out, "--- last {} lines of {name} ---", tail.len());
            for line in tail {
                let _ = writeln!(out, "{line}");
            }
        }
        out
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        // chromedriver leads its own process group; Chromium and its helpers are in it too.
        if let Ok(pid) = i32::try_from(self.child.id()) {
            // SAFETY: kill(2) with a negative pid signals that process group; no memory involved.
            unsafe {
                libc::kill(-pid, libc::SIGKILL);
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap()
}

fn free_port() -> u16 {
    let listener = TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))
        .expect("browser: bind a loopback port");
    listener.local_addr().unwrap().port()
}

/// Standard base64 (with optional padding, whitespace ignored); `None` on anything else.
fn base64_decode(text: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(text.len() / 4 * 3);
    let (mut acc, mut bits) = (0u32, 0u32);
    let mut padding = false;
    for byte in text.bytes() {
        let sextet = match byte {
            b'A'..=b'Z' => byte - b'A',
            b'a'..=b'z' => byte - b'a' + 26,
            b'0'..=b'9' => byte - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            b'=' => {
                padding = true;
                continue;
            }
            b'\r' | b'\n' | b' ' | b'\t' => continue,
            _ => return None,
        };
        if padding {
            return None;
        }
        acc = (acc << 6) | u32::from(sextet);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    (acc == 0).then_some(out)
}

/// Panics unless `png` decodes as a PNG with more than one colour in it.
fn check_screenshot(png: &[u8]) {
    let img = image::load_from_memory_with_format(png, image::ImageFormat::Png)
        .unwrap_or_else(|e| panic!("browser: screenshot is not a valid PNG: {e}"))
        .to_rgba8();
    let first = img.pixels().next().copied();
    assert!(
        first.is_some_and(|first| img.pixels().any(|p| *p != first)),
        "browser: screenshot ({}x{}) is a single flat colour {first:?}: the page did not render",
        img.width(),
        img.height()
    );
}

#[tokio::test]
async fn browser_harness_sees_broken_images() {
    let dir = tempfile::tempdir().unwrap();
    // A space in the directory name checks the file:// URL's percent-encoding.
    let site = dir.path().join("report dir");
    std::fs::create_dir(&site).unwrap();
    let png = image::RgbImage::from_fn(64, 48, |x, y| {
        image::Rgb([(x * 4) as u8, (y * 5) as u8, 200])
    });
    png.save(site.join("good one.png")).unwrap();
    let html = site.join("index.html");
    std::fs::write(
        &html,
        r#"<!doctype html>
<html><head><meta charset="utf-8"><title>harness self-test</title></head>
<body style="background:#fff">
<h1>Self-test</h1>
<img src="good%20one.png" width="64" height="48" alt="good">
<div hidden><img src="missing.png" loading="lazy" alt="missing"></div>
</body></html>
"#,
    )
    .unwrap();

    let started = Instant::now();
    let Some(check) = check_page(
        &html,
        &dir.path().join("shot.png"),
        &["return document.images.length"],
    )
    .await
    else {
        return;
    };
    eprintln!("browser: check_page took {:?}", started.elapsed());

    assert_eq!(check.images, 2, "{check:?}");
    assert_eq!(check.broken.len(), 1, "{check:?}");
    assert!(
        check.broken[0].ends_with("/report%20dir/missing.png"),
        "{check:?}"
    );
    assert_eq!(check.title, "harness self-test");
    assert_eq!(
        check.probes,
        [json!(2)],
        "probes run before anything is un-hidden"
    );
    assert!(check.screenshot.is_file());
}

#[test]
fn base64_decoder_matches_known_vectors() {
    for (text, bytes) in [
        ("", &b""[..]),
        ("Zg==", b"f"),
        ("Zm8=", b"fo"),
        ("Zm9v", b"foo"),
        ("Zm9vYg==", b"foob"),
        ("Zm9vYmE=", b"fooba"),
        ("Zm9vYmFy", b"foobar"),
        ("/+8=", &[0xff, 0xef]),
    ] {
        assert_eq!(base64_decode(text).as_deref(), Some(bytes), "{text}");
    }
    assert_eq!(base64_decode("Zm9v!"), None);
    assert_eq!(base64_decode("Zg==Zg=="), None);
}
