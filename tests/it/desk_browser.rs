//! The review desk in Chromium (issue 36): a sample run opened at the desk, two outputs picked
//! by keyboard, the price shown is `reroll --dry-run`'s, Confirm bills exactly that (the
//! sandbox's ledger), the old files are set aside and the page shows the new images; a
//! stopped sample's Continue bills exactly the rest. Under CI a browser that cannot start
//! fails the test ([`Browser::start`]).

use std::collections::BTreeSet;
use std::time::Duration;

use crate::browser::Browser;
use crate::common::*;
use crate::desk::{Catalogue, ITEM, billed, serve_with};

/// How long the page gets to show what the test waits for: a price, the end of a paid reroll.
const SHOWN: Duration = Duration::from_secs(60);

/// A sample of the catalogue (`--items mug`): the whole chain for one product, the rest
/// pending, exit 7 (status `stopped`), as run `s`.
async fn sample(c: &Catalogue<'_>) {
    let ran = c
        .imgpipe(&["run", "shots.yaml", "--items", "mug", "--run-id", "s"])
        .run()
        .await;
    assert_exit(&ran, 7);
}

/// `imgpipe review s`: the desk, its URL that of run `s`'s page.
async fn serve(c: &Catalogue<'_>) -> crate::desk::Served {
    let desk = serve_with(c, &["s", "--retry-base-ms", "1"]).await;
    let page = format!("{}/runs/s?token={}", desk.base, desk.token);
    assert_eq!(desk.url, page, "the URL printed opens the run's page");
    desk
}

/// The browser at the URL the desk printed (at `localhost`, the one name the test browser
/// resolves; the desk answers to it too).
async fn open(desk: &crate::desk::Served) -> Option<Browser> {
    let browser = Browser::start().await?;
    browser
        .visit(&desk.url.replace("127.0.0.1", "localhost"))
        .await;
    browser
        .wait_value(
            "the run's outputs with their images",
            SHOWN,
            "return document.querySelectorAll('.out[data-src]').length >= 4 || null",
        )
        .await;
    Some(browser)
}

/// The task of the focused output, when it shows an image.
async fn focused(browser: &Browser) -> Option<String> {
    let task = browser
        .run("const f = document.querySelector('.out.focus[data-src]'); return f ? f.dataset.task : null")
        .await;
    task.as_str().map(str::to_owned)
}

/// Moves down with `j` to the first output with an image of a task not in `taken`, and picks
/// it with `p`.
async fn pick_next(browser: &Browser, taken: &BTreeSet<String>) -> String {
    for _ in 0..80 {
        browser.keys("j").await;
        if let Some(task) = focused(browser).await
            && !taken.contains(&task)
        {
            browser.keys("p").await;
            return task;
        }
    }
    panic!("no output of another task within 80 presses of j");
}

/// The sha256 of the full image behind each picture of `task`, fetched by the page itself.
async fn shown_digests(browser: &Browser, task: &str) -> Value {
    let script = format!(
        r#"return (async () => {{
          const hex = b => Array.from(new Uint8Array(b)).map(x => x.toString(16).padStart(2, '0')).join('');
          const imgs = Array.from(document.querySelectorAll('.out[data-task={task:?}] img'));
          if (imgs.length === 0 || imgs.some(i => !i.complete || i.naturalWidth === 0)) return null;
          const out = [];
          for (const i of imgs) {{
            // The grid shows a thumbnail; its card names the full image it stands for.
            const full = i.closest('figure').getAttribute('data-src');
            const bytes = await (await fetch(full, {{credentials: 'same-origin'}})).arrayBuffer();
            out.push(hex(await crypto.subtle.digest('SHA-256', bytes)));
          }}
          return out.sort();
        }})()"#
    );
    browser
        .wait_value(&format!("{task}'s images loaded"), SHOWN, &script)
        .await
}

use serde_json::Value;

/// A screenshot of the desk kept for anyone to look at, as the report tests keep theirs:
/// `screenshots/PID/TEST-NAME.png` in the target's test directory.
fn screenshot(name: &str) -> std::path::PathBuf {
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("test").replace("::", "-");
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("screenshots")
        .join(std::process::id().to_string());
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    dir.join(format!("{test}-{name}.png"))
}

#[tokio::test(flavor = "multi_thread")]
async fn in_chromium_two_outputs_picked_by_keyboard_are_priced_as_the_cli_and_paid_exactly() {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, None);
    let cap = c
        .plain(&["cap", "set", "daily", "--credits", "1000", "--per", "day"])
        .run()
        .await;
    assert_exit(&cap, 0);
    sample(&c).await;
    let desk = serve(&c).await;
    let Some(browser) = open(&desk).await else {
        return;
    };

    // Two outputs of two tasks, picked with j and p.
    let mut picked = BTreeSet::new();
    for _ in 0..2 {
        let task = pick_next(&browser, &picked).await;
        picked.insert(task);
    }
    let on_page: BTreeSet<String> = serde_json::from_value(
        browser
            .run("return [...new Set([...document.querySelectorAll('.out.picked')].map(o => o.dataset.task))]")
            .await,
    )
    .unwrap();
    assert_eq!(on_page, picked, "the page marks the two tasks picked");

    // The price on the button is `reroll --dry-run`'s.
    let shown = browser
        .wait_value(
            "the reroll's price on its Confirm button",
            SHOWN,
            "const b = document.querySelector('#decide-reroll button.confirm'); \
             return b ? [b.dataset.credits, b.textContent, b.disabled] : null",
        )
        .await;
    let mut args = vec!["reroll", "s"];
    args.extend(picked.iter().map(String::as_str));
    args.extend(["--dry-run", "--json"]);
    let cli = json_stdout(&c.plain(&args).run().await);
    let price = cli["credits"].as_u64().unwrap();
    assert!(price > 0, "{cli}");
    assert_eq!(shown[0], price.to_string(), "the page's price: {shown}");
    assert_eq!(shown[1], format!("Confirm ({price} credits)"));
    assert_eq!(shown[2], false, "it fits: the button is live");
    let left = browser
        .run("return document.querySelector('#decide-reroll table.left').innerText")
        .await;
    let left = left.as_str().unwrap_or_default();
    assert!(
        has_phrase(left, &format!("budget left\t{}", 400 - ITEM)),
        "the budget's rest is shown: {left}"
    );
    assert!(
        has_phrase(left, &format!("balance\t{}", 1000 - ITEM)),
        "the balance is shown: {left}"
    );
    assert!(
        has_phrase(
            left,
            &format!("cap daily left (day)\t{} of 1000", 1000 - ITEM)
        ),
        "the cap's rest is shown: {left}"
    );

    browser.screenshot(&screenshot("priced")).await;

    // Confirm: billed exactly the price, the old files set aside, the new ones shown.
    let run_dir = c.dir.join("out/s");
    let before_files = file_digests(&run_dir);
    let before = billed(&env);
    let first = picked.iter().next().unwrap().clone();
    let old_shown = shown_digests(&browser, &first).await;
    browser.click("#decide-reroll button.confirm").await;
    browser
        .wait_value(
            "the reroll done",
            SHOWN,
            "return document.querySelector('#decide-reroll .done, #decide-reroll .refused') \
             ? document.querySelector('#decide-reroll').innerText : null",
        )
        .await;
    let said = browser
        .run("return document.querySelector('#decide-reroll').innerText")
        .await;
    assert!(
        said.as_str().is_some_and(|s| s.contains("done")),
        "the reroll ended well: {said}"
    );
    assert_eq!(
        billed(&env) - before,
        price,
        "billed exactly the price shown"
    );
    let after_files = file_digests(&run_dir);
    for sha in old_shown.as_array().unwrap() {
        let sha = sha.as_str().unwrap();
        assert!(
            before_files.values().any(|s| s == sha),
            "the page showed the file on disk"
        );
        assert!(
            after_files
                .iter()
                .any(|(p, s)| p.starts_with("_superseded/") && s == sha),
            "{first}'s earlier image {sha} is under _superseded/: {after_files:#?}"
        );
    }
    let new_shown = browser
        .wait_value(
            &format!("{first}'s new images on the page"),
            SHOWN,
            &format!(
                "const n = document.querySelector('.out[data-task={first:?}] .note'); \
                 return n && n.textContent.includes('earlier') || null"
            ),
        )
        .await;
    assert_eq!(new_shown, true);
    // The sandbox draws the same bytes for the same request: the new images are told from
    // the old by the record (the note above) and their address, not their bytes.
    let srcs = browser
        .run(&format!(
            "return [...document.querySelectorAll('.out[data-task={first:?}] img')].map(i => i.src)"
        ))
        .await;
    assert!(
        srcs.as_array().is_some_and(|a| !a.is_empty()
            && a.iter()
                .all(|s| !s.as_str().unwrap().contains("_superseded"))),
        "the page shows {first}'s current files: {srcs}"
    );
    let new_shown = shown_digests(&browser, &first).await;
    for sha in new_shown.as_array().unwrap() {
        let sha = sha.as_str().unwrap();
        assert!(
            after_files
                .iter()
                .any(|(p, s)| !p.starts_with("_superseded/") && s == sha),
            "the page's new image {sha} is the current file: {after_files:#?}"
        );
    }
    browser.close().await;
    desk.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn in_chromium_a_stopped_samples_continue_bills_exactly_the_rest() {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, None);
    sample(&c).await;
    let desk = serve(&c).await;
    let Some(browser) = open(&desk).await else {
        return;
    };
    let shown = browser
        .wait_value(
            "the rest's price on its Continue button",
            SHOWN,
            "const b = document.querySelector('#decide-gate button.confirm'); \
             return b ? [b.dataset.credits, b.textContent] : null",
        )
        .await;
    let cli = json_stdout(&c.plain(&["resume", "s", "--dry-run", "--json"]).run().await);
    let rest = cli["credits"].as_u64().unwrap();
    assert_eq!(rest, 2 * ITEM, "{cli}");
    assert_eq!(shown[0], rest.to_string(), "the page's price: {shown}");
    assert_eq!(shown[1], format!("Continue ({rest} credits)"));

    let before = billed(&env);
    browser.click("#decide-gate button.confirm").await;
    browser
        .wait_value(
            "the continuation done",
            SHOWN,
            "return document.querySelector('#decide-gate .done, #decide-gate .refused') \
             ? document.querySelector('#decide-gate').innerText : null",
        )
        .await;
    assert_eq!(billed(&env) - before, rest, "billed exactly the rest");
    let db = Db::read(&c.state).await;
    assert_eq!(db.runs[0].status, "succeeded");
    browser.close().await;
    desk.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn in_chromium_a_price_that_changed_is_shown_again_and_only_the_new_one_is_paid() {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, None);
    sample(&c).await;
    let desk = serve(&c).await;
    let Some(browser) = open(&desk).await else {
        return;
    };
    let button = "const b = document.querySelector('#decide-gate button.confirm'); \
                  return b ? b.textContent : null";
    let shown = browser.wait_value("the rest's price", SHOWN, button).await;
    assert_eq!(shown, format!("Continue ({} credits)", 2 * ITEM));

    // Another process pays for part of the rest after the page priced it.
    let lamp = c.imgpipe(&["resume", "s", "--items", "lamp"]).run().await;
    assert_exit(&lamp, 7);
    let before = billed(&env);
    let calls = env.sandbox.ledger().len();

    // Confirming the old price spends nothing: the new one is shown, and asked again.
    browser.click("#decide-gate button.confirm").await;
    let again = format!(
        "const s = document.querySelector('#decide-gate .stale'); \
         const b = document.querySelector('#decide-gate button.confirm'); \
         return s && b && b.textContent === 'Continue ({ITEM} credits)' ? s.textContent : null"
    );
    let said = browser
        .wait_value("the new price, asked again", SHOWN, &again)
        .await;
    assert!(
        has_phrase(
            said.as_str().unwrap(),
            &format!(
                "the price is now {ITEM} credits, not {}: nothing was spent",
                2 * ITEM
            )
        ),
        "{said}"
    );
    assert_eq!(env.sandbox.ledger().len(), calls, "nothing spent");

    browser.click("#decide-gate button.confirm").await;
    browser
        .wait_value(
            "the continuation done",
            SHOWN,
            "return document.querySelector('#decide-gate .done, #decide-gate .refused') \
             ? document.querySelector('#decide-gate').innerText : null",
        )
        .await;
    assert_eq!(billed(&env) - before, ITEM, "billed exactly the new price");
    browser.close().await;
    desk.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn in_chromium_a_refusal_shows_its_error_and_hint_and_spends_nothing() {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, None);
    sample(&c).await;
    let desk = serve(&c).await;
    let Some(browser) = open(&desk).await else {
        return;
    };
    // A pick the other process's reroll below leaves alone (set as the page's keys set it).
    browser
        .run(
            "document.dispatchEvent(new CustomEvent('desk:set-picks', \
             {detail: {tasks: ['mug/cutout[1]']}})); return true",
        )
        .await;
    let confirm = "const b = document.querySelector('#decide-reroll button.confirm'); \
                   return b ? b.textContent : null";
    let shown = browser.wait_value("the pick's price", SHOWN, confirm).await;
    assert_eq!(shown, "Confirm (5 credits)");

    // Another process holds the run, its call at the sandbox's gate.
    env.sandbox.hold_calls();
    let mut cmd = c.imgpipe(&["reroll", "s", "mug/clean[0]"]).command();
    cmd.stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let other = cmd.spawn().unwrap();
    let pid = other.id().unwrap();
    wait_until("the other reroll's call held", || {
        env.sandbox.held_calls() == 1
    })
    .await;
    let calls = env.sandbox.ledger().len();

    browser.click("#decide-reroll button.confirm").await;
    let refused = browser
        .wait_value(
            "the refusal",
            SHOWN,
            "const r = document.querySelector('#decide-reroll .refused'); \
             return r ? [r.querySelector('.error').textContent, r.querySelector('.hint').textContent] : null",
        )
        .await;
    let (error, hint) = (refused[0].as_str().unwrap(), refused[1].as_str().unwrap());
    assert!(
        error.contains(&format!("pid {pid}")),
        "the holder named: {error}"
    );
    assert!(has_phrase(error, "nothing was spent"), "{error}");
    assert_eq!(hint, "hint: wait for it to end, then confirm again");
    env.sandbox.release_calls();
    assert_exit(&finish_child(other, "the other reroll").await, 7);
    assert_eq!(
        env.sandbox.ledger().len(),
        calls + 4,
        "only the other process's reroll was paid"
    );
    browser.close().await;
    desk.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn in_chromium_a_whole_item_picked_by_keyboard_is_priced_as_the_cli_and_paid_exactly() {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, None);
    sample(&c).await;
    let desk = serve(&c).await;
    let Some(browser) = open(&desk).await else {
        return;
    };

    // Mug's last step focused with j (past chair's placeholders), its whole item picked with
    // i: the item, not the focused task (which alone would cost 5).
    let mut at = Value::Null;
    for _ in 0..60 {
        browser.keys("j").await;
        at = browser
            .run("const f = document.querySelector('.out.focus'); return f ? [f.dataset.item, f.dataset.step] : null")
            .await;
        if at == serde_json::json!(["mug", "cutout"]) {
            break;
        }
    }
    assert_eq!(
        at,
        serde_json::json!(["mug", "cutout"]),
        "mug's cut-out within 60 presses of j"
    );
    browser.keys("i").await;
    let marked = browser
        .run(
            "return [document.querySelector('.item[data-item=mug] button.pick-item').getAttribute('aria-pressed'), \
             [...document.querySelectorAll('.item[data-item=mug] .out')].every(o => o.classList.contains('picked'))]",
        )
        .await;
    assert_eq!(
        marked,
        serde_json::json!(["true", true]),
        "the item and its outputs marked picked"
    );

    // The price and tasks shown are `reroll s mug --dry-run --json`'s.
    let shown = browser
        .wait_value(
            "the item's price on its Confirm button",
            SHOWN,
            "const b = document.querySelector('#decide-reroll button.confirm'); \
             return b ? [b.dataset.credits, b.textContent, b.disabled, \
               [...document.querySelectorAll('#decide-reroll li[data-task]')].map(l => l.dataset.task)] : null",
        )
        .await;
    let cli = json_stdout(
        &c.plain(&["reroll", "s", "mug", "--dry-run", "--json"])
            .run()
            .await,
    );
    let price = cli["credits"].as_u64().unwrap();
    assert_eq!(price, ITEM, "{cli}");
    assert_eq!(shown[0], price.to_string(), "the page's price: {shown}");
    assert_eq!(shown[1], format!("Confirm ({price} credits)"));
    assert_eq!(shown[2], false, "it fits: the button is live");
    let cli_tasks: Vec<String> = cli["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            format!(
                "{}/{}[{}]",
                t["item"].as_str().unwrap(),
                t["step"].as_str().unwrap(),
                t["index"]
            )
        })
        .collect();
    assert_eq!(
        shown[3],
        serde_json::json!(cli_tasks),
        "the tasks shown are the dry run's"
    );

    // Confirm: billed exactly the price, every earlier file of mug set aside.
    let run_dir = c.dir.join("out/s");
    let before_files = file_digests(&run_dir);
    let mugs: Vec<(String, String)> = before_files
        .iter()
        .filter(|(p, _)| p.starts_with("mug/"))
        .map(|(p, s)| (p.clone(), s.clone()))
        .collect();
    assert_eq!(mugs.len(), 10, "mug's ten images: {before_files:#?}");
    let before = billed(&env);
    browser.click("#decide-reroll button.confirm").await;
    let said = browser
        .wait_value(
            "the item's reroll ended",
            SHOWN,
            "return document.querySelector('#decide-reroll .done, #decide-reroll .refused') \
             ? document.querySelector('#decide-reroll').innerText : null",
        )
        .await;
    let ended = browser
        .run("return !!document.querySelector('#decide-reroll .done')")
        .await;
    assert_eq!(ended, true, "the reroll is done: {said}");
    assert_eq!(
        billed(&env) - before,
        price,
        "billed exactly the price shown"
    );
    let after_files = file_digests(&run_dir);
    let superseded: Vec<&String> = after_files
        .iter()
        .filter(|(p, _)| p.starts_with("_superseded/mug/"))
        .map(|(_, s)| s)
        .collect();
    for (path, sha) in &mugs {
        assert!(
            superseded.contains(&sha),
            "mug's earlier {path} is under _superseded/: {after_files:#?}"
        );
    }
    assert_eq!(
        superseded.len(),
        mugs.len(),
        "each earlier image set aside once"
    );
    browser.close().await;
    desk.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn in_chromium_a_step_for_every_item_is_one_pick_priced_as_the_cli() {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, None);
    sample(&c).await;
    let desk = serve(&c).await;
    let Some(browser) = open(&desk).await else {
        return;
    };
    let button = "#every-step button.pick-step[data-step=clean]";
    let label = browser
        .run(&format!(
            "return document.querySelector('{button}').textContent"
        ))
        .await;
    assert_eq!(label, "all 3 items' clean");
    browser.click(button).await;
    let picks = browser
        .run("return JSON.parse(sessionStorage.getItem('desk-picks:s'))")
        .await;
    assert_eq!(
        picks,
        serde_json::json!({"*/clean": "pick"}),
        "one pick names the step for every item, not its tasks"
    );
    let shown = browser
        .wait_value(
            "the step's price on its Confirm button",
            SHOWN,
            "const b = document.querySelector('#decide-reroll button.confirm'); \
             return b ? [b.dataset.credits, \
               [...document.querySelectorAll('#decide-reroll li[data-task]')].length] : null",
        )
        .await;
    let cli = json_stdout(
        &c.plain(&["reroll", "s", "*/clean", "--dry-run", "--json"])
            .run()
            .await,
    );
    let price = cli["credits"].as_u64().unwrap();
    assert_eq!(price, ITEM - 8, "mug's clean and what is downstream: {cli}");
    assert_eq!(shown[0], price.to_string(), "the page's price: {shown}");
    assert_eq!(shown[1], cli["tasks"].as_array().unwrap().len(), "{shown}");
    let marked = browser
        .run(
            "return [...document.querySelectorAll('.out[data-step=clean]')].every(o => o.classList.contains('picked'))",
        )
        .await;
    assert_eq!(marked, true, "every clean output shown is marked picked");
    browser.close().await;
    desk.stop().await;
}
