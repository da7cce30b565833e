//! The run report in a real browser (headless Chromium, see `browser.rs`): every image loads,
//! large runs are paged and their pager followed, and a screenshot is kept for eyes. Without a
//! browser these tests fail under CI (`CI=true` or `CI=1`) and say they skipped otherwise.

use std::path::{Path, PathBuf};

use imgpipe::sandbox;

use crate::browser::{Browser, check_page};
use crate::common::*;
use crate::review::run_review;
use crate::run::{config, edit_chain, state_path, write};

/// The screenshot of a report, kept in the target directory for anyone to look at:
/// `screenshots/PID/TEST-NAME.png`, so that test processes run at once (two checkouts, two
/// runs of the suite) and tests in one process never write the same file.
fn screenshot(name: &str) -> PathBuf {
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("test").replace("::", "-");
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("screenshots")
        .join(std::process::id().to_string());
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    dir.join(format!("{test}-{name}.png"))
}

/// The only report under `dir/out/<run id>/`.
fn report_in(dir: &Path) -> PathBuf {
    let runs = entries(&dir.join("out"));
    assert_eq!(runs.len(), 1, "one run directory: {runs:?}");
    let report = runs[0].join("report.html");
    assert!(report.is_file(), "no report at {}", report.display());
    report
}

/// Rows of the `outputs` table that have a file.
async fn downloaded(dir: &Path) -> usize {
    Db::read_file(&state_path(dir)).await.downloaded().len()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_sample_chain_report_loads_in_chromium_without_a_broken_image() {
    let dir = tempfile::tempdir().unwrap();
    let sample = Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines/product-shots.yaml");
    std::fs::copy(&sample, dir.path().join("product-shots.yaml")).unwrap();
    let state = state_path(dir.path()).to_string_lossy().into_owned();
    // The embedded sandbox's images 64 pixels a side at 2K (a test-only setting): a broken
    // image is broken at any size.
    let o = Imgpipe::new(&[
        "run",
        "--sandbox",
        "--report",
        "product-shots.yaml",
        "--state",
        &state,
        "--retry-base-ms",
        "20",
    ])
    .cwd(dir.path())
    .env("IMGPIPE_TEST_SANDBOX_IMAGE_SIDE", "64")
    .run()
    .await;
    assert_exit(&o, 0);
    let report = report_in(dir.path());
    let images = downloaded(dir.path()).await;
    assert_eq!(images, 30, "3 items × (2 shots + 4 steps × 2)");
    let shot = screenshot("report-product-shots");
    let Some(page) = check_page(&report, &shot, &[]).await else {
        return;
    };
    assert_eq!(page.images, images, "one <img> per output: {page:?}");
    assert!(page.broken.is_empty(), "broken images: {:?}", page.broken);
    assert!(page.title.contains("product-shots"), "{}", page.title);
    eprintln!("screenshot of the report: {}", page.screenshot.display());
}

/// Thumbnails the report loads with the page; the others wait until they come near the screen.
const EAGER: usize = 60;

/// On arrival (the page's load event passed, which waits for every image it loads): the item
/// sections in the page, the pager's entries, the images in the page, how many of the first
/// [`EAGER`] are loaded, and whether the last one, far below the screen, still waits (its
/// `data-src` not yet made its `src`) and is not loaded. Counting what is loaded beyond those
/// would count what the page script happened to load near the screen by then.
const ARRIVAL: &str = "const imgs = [...document.images];
const last = imgs[imgs.length - 1];
return [
    document.querySelectorAll('section.item').length,
    [...document.querySelectorAll('#pages a, #pages b')].map(b => b.textContent),
    imgs.length,
    imgs.slice(0, 60).filter(i => i.complete && i.naturalWidth > 0).length,
    last.hasAttribute('data-src') && last.naturalWidth === 0,
]";

#[tokio::test(flavor = "multi_thread")]
async fn a_run_of_many_items_is_paged_and_still_loads_every_image() {
    let env = start(sandbox::Config {
        balance: 10_000,
        ..config()
    })
    .await;
    let dir = env.dir.path();
    // Pages of 40 items (`IMGPIPE_TEST_REPORT_PAGE_ITEMS`, a test-only setting, in place of
    // 100): a page still holds more thumbnails than load with it, the last far below the
    // screen, for 50 items paid and drawn rather than 130.
    write(dir, "chain.yaml", &edit_chain(50, None));
    let state = state_path(dir).to_string_lossy().into_owned();
    let mut cmd = Imgpipe::new(&[
        "run",
        "chain.yaml",
        "--report",
        "--state",
        &state,
        "--retry-base-ms",
        "20",
        "--concurrency",
        "16",
    ])
    .cwd(dir)
    .command();
    cmd.env("IMGPIPE_BASE_URL", env.sandbox.base_url().as_str())
        .env("IMGPIPE_API_KEY", env.sandbox.key())
        .env("IMGPIPE_TEST_REPORT_PAGE_ITEMS", "40");
    let o = finish(cmd).await;
    assert_exit(&o, 0);
    let report = report_in(dir);
    let images = downloaded(dir).await;
    assert_eq!(images, 150);
    let Some(browser) = Browser::start().await else {
        return;
    };
    browser.open(&report).await;
    let page = browser.check(&screenshot("report-paged"), &[ARRIVAL]).await;
    let arrival = page.probes[0].as_array().unwrap();
    assert_eq!(
        arrival[..3],
        serde_json::json!([40, ["1–40", "41–50", "next ›"], 120])
            .as_array()
            .unwrap()[..],
        "40 items on the first page, the others on the second"
    );
    assert_eq!(
        arrival[3..],
        serde_json::json!([EAGER, true]).as_array().unwrap()[..],
        "the first {EAGER} thumbnails load with the page, and the last waits until it comes \
         near the screen"
    );
    assert!(page.broken.is_empty(), "broken images: {:?}", page.broken);

    // The pager's link leads to the second page, as a reader would follow it.
    let second = browser.follow("#pages a[rel=next]").await;
    let expected = std::fs::canonicalize(report.with_file_name("report-2.html")).unwrap();
    let mut expected = url::Url::from_file_path(expected).unwrap();
    expected.set_fragment(Some("items"));
    assert_eq!(
        second, expected,
        "the pager leads to the second page's items"
    );
    let next = browser
        .check(&screenshot("report-paged-2"), &[ARRIVAL])
        .await;
    browser.close().await;
    assert_eq!(
        next.probes[0].as_array().unwrap()[..3],
        serde_json::json!([10, ["‹ previous", "1–40", "41–50"], 30])
            .as_array()
            .unwrap()[..],
        "the second page holds the last 10 items"
    );
    assert_eq!(page.images + next.images, images);
    assert!(next.broken.is_empty(), "broken images: {:?}", next.broken);
}

/// On arrival: whether anything in the item ran, the page's scripts, images the item's text
/// would have made, the requests shown in the item's figures, the reroll bar shown with its copy
/// button, and the command (nothing ticked yet).
const ARRIVAL_OF_HOSTILE: &str = "return [
    typeof window.__pwned,
    document.scripts.length,
    document.querySelectorAll('img[src=\"x\"], #item-mug script').length,
    [...document.querySelectorAll('#item-mug dl.req dd')].map(d => d.textContent),
    document.getElementById('reroll').hidden,
    document.getElementById('reroll-copy').tagName,
    document.getElementById('reroll-command').value,
]";

const COMMAND: &str = "return document.getElementById('reroll-command').value";

#[tokio::test(flavor = "multi_thread")]
async fn ticked_outputs_make_the_exact_reroll_command_and_an_items_markup_runs_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let state = state_path(dir.path()).to_string_lossy().into_owned();
    let subject = r#"<script>window.__pwned=1</script> "><img src=x onerror="window.__pwned=2">"#;
    let remove = r#"'><img src=x onerror="window.__pwned=3"> & more"#;
    let report = run_review(dir.path(), &state, subject, remove).await;
    let Some(browser) = Browser::start().await else {
        return;
    };
    browser.open(&report).await;
    let arrival = browser.run(ARRIVAL_OF_HOSTILE).await;
    assert_eq!(
        arrival[0], "undefined",
        "nothing of the item ran: {arrival}"
    );
    assert_eq!(arrival[1], 1, "the page's own script only: {arrival}");
    assert_eq!(
        arrival[2], 0,
        "no element made of the item's text: {arrival}"
    );
    let shown: Vec<&str> = arrival[3]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    let prompt = format!("Studio photo of {subject}");
    assert_eq!(
        shown.iter().filter(|s| **s == prompt).count(),
        2,
        "the prompt as text in both of the generation's figures: {shown:?}"
    );
    assert_eq!(
        shown.iter().filter(|s| **s == remove).count(),
        2,
        "the object name as text in both erases' figures: {shown:?}"
    );
    assert_eq!(arrival[4], false, "the reroll bar is shown");
    assert_eq!(arrival[5], "BUTTON", "a copy button");
    assert_eq!(arrival[6], "", "nothing ticked yet");

    // Two outputs ticked: their tasks, in the order ticked, with the database's flag.
    browser.click(r#"input.pick[value="mug/clean[0]"]"#).await;
    browser.click(r#"input.pick[value="cup/wide[0]"]"#).await;
    let flags = format!("--state {state}");
    assert_eq!(
        browser.run(COMMAND).await,
        format!("imgpipe reroll r1 'mug/clean[0]' 'cup/wide[0]' {flags}")
    );
    // A generation's two images are one task: ticking one ticks both, named once.
    browser
        .click(r#"#item-mug input.pick[value="mug/shot[0]"]"#)
        .await;
    let both = browser
        .run("return [...document.querySelectorAll('input.pick[value=\"mug/shot[0]\"]')].map(b => b.checked)")
        .await;
    assert_eq!(both, serde_json::json!([true, true]));
    assert_eq!(
        browser.run(COMMAND).await,
        format!("imgpipe reroll r1 'mug/clean[0]' 'cup/wide[0]' 'mug/shot[0]' {flags}")
    );
    browser.screenshot(&screenshot("report-reroll")).await;
    // The whole item: its tasks need not be named.
    browser.click(r#"input.pick[value="cup"]"#).await;
    let whole = format!("imgpipe reroll r1 'mug/clean[0]' 'mug/shot[0]' cup {flags}");
    assert_eq!(browser.run(COMMAND).await, whole);
    // The choice outlives the page: opened again (in the same tab), the same command.
    browser.open(&report).await;
    assert_eq!(browser.run(COMMAND).await, whole);
    browser.click("#reroll-copy").await;
    // The page says so once the clipboard has answered (a promise), not at the click.
    let deadline = std::time::Instant::now() + WAIT_LIMIT;
    let said = loop {
        let said = browser
            .run("return document.getElementById('reroll-said').textContent")
            .await;
        if said != "" {
            break said;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the page said nothing within {WAIT_LIMIT:?} of Copy"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert!(
        said == "Copied." || said.as_str().is_some_and(|s| s.starts_with("Selected")),
        "{said}"
    );
    browser.click("#reroll-clear").await;
    assert_eq!(browser.run(COMMAND).await, "");
    assert_eq!(
        browser.run("return typeof window.__pwned").await,
        "undefined"
    );
    browser.close().await;
}
