//! Headless Chromium for the report tests: chromedriver started on a loopback port and driven
//! with `fantoccini`. This file starts and stops the processes, decides what happens when
//! there is no browser, and wraps the few commands the tests use, each with a time limit.
//!
//! Binaries: `IMGPIPE_CHROMIUM` (default `/usr/bin/chromium`) and `IMGPIPE_CHROMEDRIVER`
//! (default `/usr/bin/chromedriver`). When the browser cannot be started, a test fails with the
//! reason under CI (`CI=true` or `CI=1`) or `IMGPIPE_REQUIRE_CHROMIUM=1`, and otherwise passes
//! after printing `test NAME ... skipped: no browser: <reason>` on stdout (see
//! [`Settings::unavailable`]).
//!
//! Everything stays on 127.0.0.1: fantoccini talks plain HTTP to chromedriver there (no proxy),
//! and Chromium is told to use no proxy and to resolve no host name but `localhost`.

use std::fmt::Display;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{Value, json};

use crate::common::{flag_in, say_skipped};

/// How long the in-page script waits, in total, for all images to load or fail.
const IMAGE_WAIT: Duration = Duration::from_secs(20);
/// How long chromedriver gets to accept connections after it is started.
const DRIVER_START: Duration = Duration::from_secs(15);
/// Per-command limits; each bounds how long a hung browser can stall a test.
const SESSION_TIMEOUT: Duration = Duration::from_secs(30);
const NAVIGATE_TIMEOUT: Duration = Duration::from_secs(25);
const SCRIPT_TIMEOUT: Duration = Duration::from_secs(30);
const SCREENSHOT_TIMEOUT: Duration = Duration::from_secs(20);
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

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

/// Un-hides `[hidden]` elements, makes every image eager, scrolls through the page as a reader
/// would (so images a page script loads near the screen get their turn), waits at most
/// `arguments[0]` ms for each image to load or fail, and reports them. chromedriver awaits the
/// returned promise.
const IMAGES_SCRIPT: &str = r#"
const limit = arguments[0];
const sleep = ms => new Promise(r => setTimeout(r, ms));
return (async () => {
  for (const el of document.querySelectorAll('[hidden]')) el.removeAttribute('hidden');
  const imgs = Array.from(document.images);
  for (const img of imgs) img.loading = 'eager';
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
  // Let the un-hidden content and the images paint before a screenshot.
  await Promise.race([frame().then(frame), sleep(2000)]);
  return {
    timedOut,
    images: imgs.map(img => ({
      src: img.currentSrc || img.src,
      complete: img.complete,
      naturalWidth: img.naturalWidth,
    })),
  };
})();
"#;

/// Where the browser is, and whether a test may pass without it.
#[derive(Clone, Debug)]
pub struct Settings {
    pub chromium: PathBuf,
    pub chromedriver: PathBuf,
    /// Why a missing browser fails the test (`CI=true`, `CI=1`, `IMGPIPE_REQUIRE_CHROMIUM=1`); `None`
    /// when it may skip.
    pub required_by: Option<String>,
}

impl Settings {
    pub fn from_env() -> Settings {
        Settings::from_vars(|name| std::env::var(name).ok())
    }

    /// The settings that the environment variables `var` reads would give.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Settings {
        let path = |name: &str, default: &str| PathBuf::from(var(name).unwrap_or(default.into()));
        let required_by = flag_in(&var, "CI").or_else(|| flag_in(&var, "IMGPIPE_REQUIRE_CHROMIUM"));
        Settings {
            chromium: path("IMGPIPE_CHROMIUM", "/usr/bin/chromium"),
            chromedriver: path("IMGPIPE_CHROMEDRIVER", "/usr/bin/chromedriver"),
            required_by,
        }
    }

    /// The browser cannot be started: panics with `why` when a browser is required, else says
    /// in the test's output that it skips ([`say_skipped`]).
    pub fn unavailable(&self, why: &str) {
        if let Some(required_by) = &self.required_by {
            panic!(
                "browser: cannot start Chromium, and {required_by} requires it: {why}\n\
                 hint: install `chromium chromium-driver`, or point IMGPIPE_CHROMIUM / \
                 IMGPIPE_CHROMEDRIVER at them"
            );
        }
        say_skipped(&format!(
            "no browser: {why} (install `chromium chromium-driver` or set IMGPIPE_CHROMIUM / \
             IMGPIPE_CHROMEDRIVER; under CI this fails)"
        ));
    }
}

/// A WebDriver session in headless Chromium. Dropping it kills chromedriver and Chromium.
pub struct Browser {
    client: Client,
    driver: Driver,
}

impl Browser {
    /// A browser per the environment's [`Settings`]; `None` when there is none and the test
    /// may skip (it has been said why).
    pub async fn start() -> Option<Browser> {
        Browser::start_with(&Settings::from_env()).await
    }

    pub async fn start_with(settings: &Settings) -> Option<Browser> {
        match Browser::launch(settings).await {
            Ok(browser) => Some(browser),
            Err(why) => {
                settings.unavailable(&why);
                None
            }
        }
    }

    /// Starts chromedriver and a Chromium session, or says why it could not.
    pub async fn launch(settings: &Settings) -> Result<Browser, String> {
        for (what, path) in [
            ("Chromium", &settings.chromium),
            ("chromedriver", &settings.chromedriver),
        ] {
            if !path.is_file() {
                return Err(format!("{what} not found at {}", path.display()));
            }
        }
        let driver = Driver::start(&settings.chromedriver).await?;
        let profile = driver.dir.path().join("profile");
        let mut args: Vec<String> = CHROMIUM_ARGS.iter().map(|a| a.to_string()).collect();
        args.push(format!("--user-data-dir={}", profile.display()));
        let capabilities = json!({
            "browserName": "chrome",
            "pageLoadStrategy": "normal",
            "timeouts": {
                "pageLoad": millis(NAVIGATE_TIMEOUT - Duration::from_secs(5)),
                "script": millis(IMAGE_WAIT + Duration::from_secs(5)),
                "implicit": 0,
            },
            "goog:chromeOptions": {
                "binary": settings.chromium.to_string_lossy(),
                "args": args,
            },
        });
        let Value::Object(capabilities) = capabilities else {
            unreachable!("a JSON object")
        };
        let mut builder =
            ClientBuilder::rustls().map_err(|e| format!("fantoccini's HTTP client: {e}"))?;
        let connect = builder.capabilities(capabilities).connect(&driver.url);
        let client = match tokio::time::timeout(SESSION_TIMEOUT, connect).await {
            Ok(Ok(client)) => client,
            Ok(Err(e)) => {
                return Err(format!(
                    "no Chromium session: {e}\n{}",
                    driver.diagnostics()
                ));
            }
            Err(_) => {
                return Err(format!(
                    "no Chromium session within {SESSION_TIMEOUT:?}\n{}",
                    driver.diagnostics()
                ));
            }
        };
        Ok(Browser { client, driver })
    }

    /// Awaits one WebDriver command, panicking with chromedriver's log when it fails or takes
    /// longer than `limit`.
    async fn command<T, E: Display>(
        &self,
        what: &str,
        limit: Duration,
        command: impl Future<Output = Result<T, E>>,
    ) -> T {
        match tokio::time::timeout(limit, command).await {
            Ok(Ok(value)) => value,
            Ok(Err(e)) => panic!("browser: {what} failed: {e}\n{}", self.driver.diagnostics()),
            Err(_) => panic!(
                "browser: {what}: no answer within {limit:?}\n{}",
                self.driver.diagnostics()
            ),
        }
    }

    /// Loads a local file.
    pub async fn open(&self, file: &Path) -> url::Url {
        let file = std::fs::canonicalize(file)
            .unwrap_or_else(|e| panic!("browser: cannot resolve {}: {e}", file.display()));
        let url = url::Url::from_file_path(&file)
            .unwrap_or_else(|()| panic!("browser: no file:// URL for {}", file.display()));
        let what = format!("opening {url}");
        self.command(&what, NAVIGATE_TIMEOUT, self.client.goto(url.as_str()))
            .await;
        url
    }

    /// Presses and releases each of `keys` in turn, as a person typing on the focused page.
    pub async fn keys(&self, keys: &str) {
        use fantoccini::actions::{InputSource, KeyAction, KeyActions};
        let mut typed = KeyActions::new("keyboard".to_owned());
        for value in keys.chars() {
            typed = typed
                .then(KeyAction::Down { value })
                .then(KeyAction::Up { value });
        }
        self.command(
            &format!("typing {keys:?}"),
            SCRIPT_TIMEOUT,
            self.client.perform_actions(typed),
        )
        .await;
    }

    /// Waits until `script` (a function body) returns something other than `null` or
    /// `false`, and returns it; fails saying `what` it waited for after `limit`.
    pub async fn wait_value(&self, what: &str, limit: Duration, script: &str) -> Value {
        let deadline = Instant::now() + limit;
        loop {
            let value = self.run(script).await;
            if !value.is_null() && value != Value::Bool(false) {
                return value;
            }
            assert!(
                Instant::now() < deadline,
                "browser: no {what} within {limit:?} (the page's text: {})",
                self.run("return document.body ? document.body.innerText : ''")
                    .await
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// What `script` (a function body) returns in the page.
    pub async fn run(&self, script: &str) -> Value {
        self.command(
            "running a script",
            SCRIPT_TIMEOUT,
            self.client.execute(script, Vec::new()),
        )
        .await
    }

    pub async fn title(&self) -> String {
        self.command("reading the title", SCRIPT_TIMEOUT, self.client.title())
            .await
    }

    pub async fn url(&self) -> url::Url {
        self.command("reading the URL", SCRIPT_TIMEOUT, self.client.current_url())
            .await
    }

    /// Un-hides everything, scrolls through the page and waits for its images; returns each
    /// image's URL and whether it loaded.
    pub async fn images(&self) -> Images {
        let report = self
            .command(
                "waiting for the images",
                SCRIPT_TIMEOUT,
                self.client
                    .execute(IMAGES_SCRIPT, vec![json!(millis(IMAGE_WAIT))]),
            )
            .await;
        let all = report["images"]
            .as_array()
            .unwrap_or_else(|| panic!("browser: unexpected script result: {report}"));
        if report["timedOut"].as_bool() == Some(true) {
            eprintln!(
                "browser: images still loading after {IMAGE_WAIT:?}; counting those as broken"
            );
        }
        let broken = all
            .iter()
            .filter(|img| {
                img["complete"].as_bool() != Some(true)
                    || img["naturalWidth"].as_u64().unwrap_or(0) == 0
            })
            .map(|img| img["src"].as_str().unwrap_or_default().to_owned())
            .collect();
        Images {
            count: all.len(),
            broken,
        }
    }

    /// Clicks the link `css` selects and waits until the browser has left the current page;
    /// returns where it went.
    pub async fn follow(&self, css: &str) -> url::Url {
        let from = self.url().await;
        let link = self
            .command(
                &format!("finding link {css}"),
                SCRIPT_TIMEOUT,
                self.client.find(Locator::Css(css)),
            )
            .await;
        self.command(&format!("clicking {css}"), NAVIGATE_TIMEOUT, link.click())
            .await;
        let deadline = Instant::now() + NAVIGATE_TIMEOUT;
        loop {
            let now = self.url().await;
            let ready = self.run("return document.readyState").await;
            if now != from && ready == "complete" {
                return now;
            }
            assert!(
                Instant::now() < deadline,
                "browser: still at {now} ({ready}) {NAVIGATE_TIMEOUT:?} after clicking {css}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Clicks the element `css` selects, as a reader would (a trusted click), after scrolling
    /// it to the middle of the window (clear of the page's sticky bar).
    pub async fn click(&self, css: &str) {
        let centre = format!(
            "document.querySelector({}).scrollIntoView({{block: 'center'}})",
            serde_json::to_string(css).unwrap()
        );
        self.run(&centre).await;
        let element = self
            .command(
                &format!("finding {css}"),
                SCRIPT_TIMEOUT,
                self.client.find(Locator::Css(css)),
            )
            .await;
        self.command(&format!("clicking {css}"), SCRIPT_TIMEOUT, element.click())
            .await;
    }

    /// Writes a screenshot of the window to `to`, after checking it is a PNG with more than one
    /// colour in it (a page that rendered).
    pub async fn screenshot(&self, to: &Path) {
        let png = self
            .command(
                "taking a screenshot",
                SCREENSHOT_TIMEOUT,
                self.client.screenshot(),
            )
            .await;
        check_screenshot(&png);
        if let Some(dir) = to.parent() {
            std::fs::create_dir_all(dir).ok();
        }
        std::fs::write(to, &png)
            .unwrap_or_else(|e| panic!("browser: cannot write {}: {e}", to.display()));
    }

    /// Ends the session politely, then the processes.
    /// Ends the session and kills the browser. Closing is cleanup, not what a test checks: a
    /// session that fails, hangs or panics while it closes (a loaded CI machine once saw one
    /// panic here, after every assertion had passed) is said on stderr, and the processes are
    /// killed all the same.
    pub async fn close(self) {
        use futures::FutureExt as _;
        let Browser { client, driver } = self;
        let closing = tokio::time::timeout(CLOSE_TIMEOUT, client.close());
        if let Err(panic) = std::panic::AssertUnwindSafe(closing).catch_unwind().await {
            let why = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("a panic without a message");
            eprintln!("browser: closing the session panicked ({why}); killing the browser");
        }
        drop(driver);
    }
}

/// The images of a page once they settled.
#[derive(Debug)]
pub struct Images {
    /// `<img>` elements in the document (after un-hiding everything).
    pub count: usize,
    /// The resolved URL (`currentSrc`, else `src`: absolute and percent-encoded, e.g.
    /// `file:///tmp/x/missing%20one.png`) of every image that did not load.
    pub broken: Vec<String>,
}

/// What the browser saw of one page, see [`check_page`].
#[derive(Debug)]
pub struct PageCheck {
    pub images: usize,
    pub broken: Vec<String>,
    pub screenshot: PathBuf,
    pub title: String,
    /// What each probe script returned, run in order once the page loaded (before anything
    /// was un-hidden).
    pub probes: Vec<Value>,
}

/// Loads `html`, runs `probes`, waits for its images and writes a screenshot to
/// `screenshot_to`; `None` when the test may skip for want of a browser.
pub async fn check_page(html: &Path, screenshot_to: &Path, probes: &[&str]) -> Option<PageCheck> {
    let browser = Browser::start().await?;
    browser.open(html).await;
    let page = browser.check(screenshot_to, probes).await;
    browser.close().await;
    Some(page)
}

impl Browser {
    /// [`check_page`] on the page already open.
    pub async fn check(&self, screenshot_to: &Path, probes: &[&str]) -> PageCheck {
        let mut answers = Vec::new();
        for probe in probes {
            answers.push(self.run(probe).await);
        }
        let images = self.images().await;
        self.screenshot(screenshot_to).await;
        PageCheck {
            images: images.count,
            broken: images.broken,
            screenshot: screenshot_to.to_owned(),
            title: self.title().await,
            probes: answers,
        }
    }
}

/// A running chromedriver (in its own process group, with Chromium under it) and its profile
/// directory. Dropping it kills the whole process group, so nothing outlives the test.
struct Driver {
    child: Child,
    url: String,
    // Declared last: removed only after the processes using it are dead.
    dir: tempfile::TempDir,
}

impl Driver {
    /// Starts chromedriver with `--port=0`: it binds a free port itself and reports it
    /// ("… started successfully on port N."), so no port is picked here and left free for
    /// another process to take before chromedriver binds it.
    async fn start(chromedriver: &Path) -> Result<Driver, String> {
        let dir = tempfile::tempdir().map_err(|e| format!("tempdir: {e}"))?;
        let output = std::fs::File::create(dir.path().join("chromedriver.out"))
            .map_err(|e| format!("chromedriver output file: {e}"))?;
        let child = Command::new(chromedriver)
            .arg("--port=0")
            .arg(format!(
                "--log-path={}",
                dir.path().join("chromedriver.log").display()
            ))
            .stdin(Stdio::null())
            .stdout(output.try_clone().map_err(|e| format!("dup: {e}"))?)
            .stderr(output)
            // Its own process group, so that Drop can kill Chromium along with it.
            .process_group(0)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", chromedriver.display()))?;
        let mut driver = Driver {
            child,
            url: String::new(),
            dir,
        };
        match driver.wait_ready().await {
            Ok(port) => {
                driver.url = format!("http://127.0.0.1:{port}");
                Ok(driver)
            }
            Err(why) => Err(format!(
                "chromedriver ({}) {why}\n{}",
                chromedriver.display(),
                driver.diagnostics()
            )),
        }
    }

    /// Waits until chromedriver reports the port it listens on, and returns it.
    async fn wait_ready(&mut self) -> Result<u16, String> {
        const READY: &str = "started successfully on port ";
        let deadline = Instant::now() + DRIVER_START;
        loop {
            if let Some(status) = self.child.try_wait().ok().flatten() {
                return Err(format!("exited early ({status})"));
            }
            let said = std::fs::read_to_string(self.dir.path().join("chromedriver.out"))
                .unwrap_or_default();
            let port = said.lines().find_map(|line| {
                let tail = line.split(READY).nth(1)?;
                tail.trim_end_matches('.').trim().parse::<u16>().ok()
            });
            if let Some(port) = port {
                return Ok(port);
            }
            if Instant::now() > deadline {
                return Err(format!("reported no port within {DRIVER_START:?}"));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The tail of chromedriver's own output and log, for failure messages.
    fn diagnostics(&self) -> String {
        let mut out = String::new();
        for name in ["chromedriver.out", "chromedriver.log"] {
            let text = std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(30)..];
            out += &format!("--- last {} lines of {name} ---\n", tail.len());
            for line in tail {
                out += line;
                out += "\n";
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
async fn the_harness_sees_broken_images() {
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
<p><a id="next" href="second.html">second</a></p>
</body></html>
"#,
    )
    .unwrap();
    std::fs::write(
        site.join("second.html"),
        "<!doctype html><title>second</title><p>the second page</p>",
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

    let browser = Browser::start().await.expect("started once already");
    browser.open(&html).await;
    let second = browser.follow("#next").await;
    assert!(
        second.path().ends_with("/report%20dir/second.html"),
        "{second}"
    );
    assert_eq!(browser.title().await, "second");
    browser.close().await;
}

/// The test above run as its own process (this very test binary), with `env` set and the
/// variables that require a browser removed unless `env` sets them.
fn harness_test_alone(env: &[(&str, &str)]) -> std::process::Output {
    crate::common::test_alone(
        "browser::the_harness_sees_broken_images",
        &["CI", "IMGPIPE_REQUIRE_CHROMIUM"],
        env,
        Duration::from_secs(120),
    )
}

#[test]
fn without_a_browser_a_test_says_skipped_on_stdout_and_under_ci_fails_with_the_reason() {
    let missing = "/nonexistent/imgpipe-test/chromium";
    let text = |o: &std::process::Output| {
        format!(
            "{}\n--- stderr\n{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    };

    // Outside CI: passes, and says so in the output libtest shows for a passing test.
    let skipped = harness_test_alone(&[("IMGPIPE_CHROMIUM", missing)]);
    let stdout = String::from_utf8_lossy(&skipped.stdout);
    assert_eq!(skipped.status.code(), Some(0), "{}", text(&skipped));
    assert!(
        stdout.contains(&format!(
            "test browser::the_harness_sees_broken_images ... skipped: no browser: \
             Chromium not found at {missing}"
        )),
        "{}",
        text(&skipped)
    );
    assert!(stdout.contains("1 passed"), "{}", text(&skipped));

    // Under CI, or when asked to: the test fails, naming the reason.
    for (env, required_by, why) in [
        (
            &[("CI", "true"), ("IMGPIPE_CHROMIUM", missing)][..],
            "CI=true",
            format!("Chromium not found at {missing}"),
        ),
        (
            &[("CI", "1"), ("IMGPIPE_CHROMIUM", missing)][..],
            "CI=1",
            format!("Chromium not found at {missing}"),
        ),
        (
            &[
                ("IMGPIPE_REQUIRE_CHROMIUM", "1"),
                ("IMGPIPE_CHROMIUM", missing),
            ],
            "IMGPIPE_REQUIRE_CHROMIUM=1",
            format!("Chromium not found at {missing}"),
        ),
        (
            // Binaries that are there but no browser: chromedriver cannot start.
            &[
                ("CI", "true"),
                ("IMGPIPE_CHROMIUM", "/bin/true"),
                ("IMGPIPE_CHROMEDRIVER", "/bin/false"),
            ],
            "CI=true",
            "chromedriver (/bin/false) exited early".to_owned(),
        ),
    ] {
        let failed = harness_test_alone(env);
        let all = text(&failed);
        assert_eq!(failed.status.code(), Some(101), "{env:?}: {all}");
        assert!(
            all.contains(&format!(
                "cannot start Chromium, and {required_by} requires it: {why}"
            )),
            "{env:?}: {all}"
        );
        assert!(!all.contains("skipped:"), "{env:?}: {all}");
    }
}

#[test]
fn ci_true_or_1_or_require_chromium_require_the_browser() {
    let settings = |vars: &[(&str, &str)]| {
        Settings::from_vars(|name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        })
    };
    let plain = settings(&[]);
    assert_eq!(plain.chromium, Path::new("/usr/bin/chromium"));
    assert_eq!(plain.chromedriver, Path::new("/usr/bin/chromedriver"));
    assert_eq!(plain.required_by, None);
    for (vars, required_by) in [
        (&[("CI", "true")][..], Some("CI=true")),
        (&[("CI", "1")], Some("CI=1")),
        (&[("CI", "TRUE")], Some("CI=TRUE")),
        (&[("CI", " True ")], Some("CI= True ")),
        (&[("CI", "false")], None),
        (&[("CI", "")], None),
        (
            &[("IMGPIPE_REQUIRE_CHROMIUM", "1")],
            Some("IMGPIPE_REQUIRE_CHROMIUM=1"),
        ),
        (&[("IMGPIPE_REQUIRE_CHROMIUM", "0")], None),
    ] {
        assert_eq!(
            settings(vars).required_by.as_deref(),
            required_by,
            "{vars:?}"
        );
    }
    let custom = settings(&[
        ("IMGPIPE_CHROMIUM", "/opt/c"),
        ("IMGPIPE_CHROMEDRIVER", "/opt/d"),
    ]);
    assert_eq!(custom.chromium, Path::new("/opt/c"));
    assert_eq!(custom.chromedriver, Path::new("/opt/d"));
}

/// `.ci/chromium.sh` as `.ci/run` sources it, pointed at a Chromium that is not there (which
/// it does not try to install): CI must stop there rather than go on without the browser test.
#[test]
fn ci_stops_when_it_cannot_have_chromium() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let missing = "/nonexistent/imgpipe-test/chromium";
    let mut cmd = Command::new("bash");
    cmd.args([
        "-c",
        "set -euo pipefail; source .ci/chromium.sh; echo 'went on'",
    ])
    .current_dir(root)
    .env("IMGPIPE_CHROMIUM", missing)
    .env_remove("IMGPIPE_CHROMEDRIVER")
    .stdin(Stdio::null());
    let o = crate::common::finish_blocking(cmd, Duration::from_secs(60), "source .ci/chromium.sh");
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_ne!(o.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(!stdout.contains("went on"), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("error: Chromium/chromedriver unavailable")
            && stderr.contains("IMGPIPE_CHROMIUM/IMGPIPE_CHROMEDRIVER point at missing files"),
        "{stderr}"
    );
}

/// What the desk's tests do with the browser: open a page served on loopback, type on it.
impl Browser {
    /// Loads `url` (an `http://127.0.0.1:…` page).
    pub async fn visit(&self, url: &str) {
        let what = format!("opening {url}");
        self.command(&what, NAVIGATE_TIMEOUT, self.client.goto(url))
            .await;
    }

    /// Types `keys` into the first element `css` finds (the keys go on to whatever the page
    /// focuses as they are typed).
    pub async fn type_into(&self, css: &str, keys: &str) {
        let found = self
            .command(
                &format!("finding {css}"),
                SCRIPT_TIMEOUT,
                self.client.find(Locator::Css(css)),
            )
            .await;
        self.command(
            &format!("typing into {css}"),
            SCRIPT_TIMEOUT,
            found.send_keys(keys),
        )
        .await;
    }

    /// Waits until `script` (a function body) returns `true` in the page, at most `limit`,
    /// failing with `what` it waited for and the last answer.
    pub async fn wait_for(&self, what: &str, script: &str, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            let got = self.run(script).await;
            if got == Value::Bool(true) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "browser: waited {limit:?} for {what}; the page last answered {got}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
