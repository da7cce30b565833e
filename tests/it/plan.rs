//! `imgpipe plan`, `validate` and `schema` through the real binary: the cost arithmetic of
//! every pipeline shape, unknown and advertised generation prices, the balance and the budget,
//! saved plans and their hashes, and the committed schema and samples.
//!
//! Expected costs are worked out by hand from each pipeline's shape (the arithmetic is in the
//! comments), never by asking imgpipe. Plans against a sandbox must never pay for anything.

use std::path::{Path, PathBuf};
use std::process::Output;

use imgpipe::sandbox;
use serde_json::Value;

use crate::common::*;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

const MUG: &str = "https://sandbox.invalid/assets/mug.png";

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// The binary in `cwd`, pointed at `env`'s sandbox when given, within [`RUN_LIMIT`].
async fn run(env: Option<&Env>, args: &[&str], cwd: &Path) -> Output {
    let mut cmd = Imgpipe::new(args).cwd(cwd).command();
    if let Some(env) = env {
        cmd.env("IMGPIPE_BASE_URL", env.sandbox.base_url().as_str())
            .env("IMGPIPE_API_KEY", env.sandbox.key());
    }
    finish(cmd).await
}

/// `imgpipe --json plan --offline FILE` in `dir`, and the plan document it prints.
async fn plan_offline(dir: &Path, file: &str, extra: &[&str]) -> (Output, Value) {
    let mut args = vec!["--json", "plan", "--offline", file];
    args.extend_from_slice(extra);
    let o = run(None, &args, dir).await;
    let doc = json_stdout(&o);
    (o, doc)
}

/// `imgpipe --json plan FILE` against `env`'s sandbox, and the plan document.
async fn plan_online(env: &Env, file: &str, extra: &[&str]) -> (Output, Value) {
    let mut args = vec!["--json", "plan", file];
    args.extend_from_slice(extra);
    let o = run(Some(env), &args, env.dir.path()).await;
    let doc = json_stdout(&o);
    (o, doc)
}

/// One step's line of the plan: (step, tasks, credits per task, subtotal).
type Line = (String, u64, Option<u64>, Option<u64>);

/// The plan's steps, in the plan's order, as [`Line`]s.
fn lines(doc: &Value) -> Vec<Line> {
    doc["costs"]["steps"]
        .as_array()
        .unwrap_or_else(|| panic!("no costs.steps in {doc:#}"))
        .iter()
        .map(|s| {
            (
                s["step"].as_str().unwrap().to_owned(),
                s["tasks"].as_u64().unwrap(),
                s["credits_per_task"].as_u64(),
                s["subtotal"].as_u64(),
            )
        })
        .collect()
}

fn line(step: &str, tasks: u64, per_task: Option<u64>, subtotal: Option<u64>) -> Line {
    (step.to_owned(), tasks, per_task, subtotal)
}

#[track_caller]
fn assert_lines(doc: &Value, expected: &[Line]) {
    assert_eq!(lines(doc), expected, "{:#}", doc["costs"]);
}

/// Asserts `costs.tasks`, `costs.total_credits`, `costs.known_credits` and that no step is
/// left unpriced.
#[track_caller]
fn assert_totals(doc: &Value, tasks: u64, total: u64) {
    let costs = &doc["costs"];
    assert_eq!(costs["tasks"], tasks, "{costs:#}");
    assert_eq!(costs["total_credits"], total, "{costs:#}");
    assert_eq!(costs["known_credits"], total, "{costs:#}");
    assert_eq!(costs["unpriced_steps"], serde_json::json!([]), "{costs:#}");
}

#[track_caller]
fn price_kind<'a>(doc: &'a Value, step: &str) -> &'a str {
    doc["costs"]["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["step"] == step)
        .unwrap_or_else(|| panic!("no step {step} in {doc:#}"))["price_source"]["kind"]
        .as_str()
        .unwrap()
}

/// The whitespace-separated cells of the text table's row for `step`.
#[track_caller]
fn row(text: &str, step: &str) -> Vec<String> {
    text.lines()
        .map(|l| l.split_whitespace().map(str::to_owned).collect::<Vec<_>>())
        .find(|cells| cells.first().map(String::as_str) == Some(step))
        .unwrap_or_else(|| panic!("no row for {step} in\n{text}"))
}

/// Plans never pay: no paid request reached the sandbox and the ledger is empty.
#[track_caller]
fn assert_no_paid_call(env: &Env) {
    let stats = env.sandbox.stats();
    assert_eq!(stats.paid_requests, 0, "{stats:?}");
    assert_eq!(stats.billed, 0, "{stats:?}");
    assert!(
        env.sandbox.ledger().is_empty(),
        "{:?}",
        env.sandbox.ledger()
    );
}

fn is_sha256_hex(v: &Value) -> bool {
    v.as_str()
        .is_some_and(|s| s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit()))
}

fn read_json(path: &Path) -> Value {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&bytes)
        .unwrap_or_else(|e| panic!("{} is not JSON ({e})", path.display()))
}

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The committed sample pipelines, as paths relative to the repository.
fn samples() -> Vec<String> {
    let mut all: Vec<String> = std::fs::read_dir(repo().join("pipelines"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".yaml") || name.ends_with(".yml"))
        .map(|name| format!("pipelines/{name}"))
        .collect();
    all.sort();
    all
}

// ---------------------------------------------------------------------------------------------
// 1. Cost arithmetic (offline, prices from the pipeline and the spec)
// ---------------------------------------------------------------------------------------------

const FAN_OUT: &str = r#"
version: 1
name: fan-out
pricing: { generation: 3 }
items:
  - { id: a, subject: a mug }
  - { id: b, subject: a lamp }
steps:
  - id: shot
    generate: { prompt: "Photo of {{ item.subject }}", n: 3 }
  - id: cut
    remove_background: { from: shot }
  - id: big
    upscale: { from: cut, desired_increase: 4 }
  - id: clean
    erase: { from: big, object_name: the shadow }
  - id: small
    upscale: { from: shot, desired_increase: 2 }
  - id: wide
    expand: { image_url: "https://sandbox.invalid/assets/lamp.png", aspect_ratio: "16:9" }
"#;

#[tokio::test]
async fn fan_out_multiplies_every_tool_step_down_the_chain() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "fan.yaml", FAN_OUT);
    let (o, doc) = plan_offline(dir.path(), "fan.yaml", &[]).await;
    assert_exit(&o, 0);
    assert_lines(
        &doc,
        &[
            // 2 items × 1 call; 3 credits × n 3 = 9 a call; 2 × 9 = 18
            line("shot", 2, Some(9), Some(18)),
            // one call per image of shot: 2 items × 3 images = 6; 6 × 5 = 30
            line("cut", 6, Some(5), Some(30)),
            // the chain keeps the fan-out: 6 × 4 = 24
            line("big", 6, Some(4), Some(24)),
            // and further down: 6 × 2 = 12
            line("clean", 6, Some(2), Some(12)),
            // a second branch off shot: 6 × 2 = 12
            line("small", 6, Some(2), Some(12)),
            // a fixed image_url: one call per item, 2 × 5 = 10
            line("wide", 2, Some(5), Some(10)),
        ],
    );
    // tasks 2 + 6 + 6 + 6 + 6 + 2 = 28; credits 18 + 30 + 24 + 12 + 12 + 10 = 106
    assert_totals(&doc, 28, 106);
    assert_eq!(doc["prices"]["generation"]["credits"], 3);
    assert_eq!(doc["prices"]["generation"]["source"]["kind"], "pipeline");
    assert_eq!(price_kind(&doc, "shot"), "pipeline");
    for tool in ["cut", "big", "clean", "small", "wide"] {
        assert_eq!(price_kind(&doc, tool), "spec", "{tool}");
    }
    assert_eq!(doc["items"]["count"], 2);
    assert_eq!(doc["balance"]["kind"], "not_checked");
    assert_eq!(doc["verdict"]["fits"], true);

    // The table for people says the same.
    let o = run(None, &["plan", "--offline", "fan.yaml"], dir.path()).await;
    assert_exit(&o, 0);
    let text = stdout(&o);
    assert_eq!(
        row(&text, "cut"),
        [
            "cut",
            "remove_background",
            "per",
            "item",
            "6",
            "5",
            "30",
            "spec"
        ],
        "{text}"
    );
    assert_eq!(row(&text, "big")[1..3], ["upscale", "4x"], "{text}");
    assert!(text.contains("total    106 credits"), "{text}");
    assert!(has_phrase(&text, "2 items, 6 steps, 28 tasks"), "{text}");
}

#[tokio::test]
async fn four_k_bills_twice_and_upscale_4x_costs_twice_2x() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "sizes.yaml",
        r#"
version: 1
name: sizes
pricing: { generation: 5 }
items:
  - { id: a, subject: a mug }
  - { id: b, subject: a lamp }
  - { id: c, subject: a chair }
steps:
  - id: big
    generate: { prompt: "Photo of {{ item.subject }}", n: 2, size: 4K }
  - id: small
    generate: { prompt: "Sketch of {{ item.subject }}", size: 2K }
  - id: up2
    upscale: { from: big, desired_increase: 2 }
  - id: up4
    upscale: { from: big, desired_increase: 4 }
"#,
    );
    let (o, doc) = plan_offline(dir.path(), "sizes.yaml", &[]).await;
    assert_exit(&o, 0);
    assert_lines(
        &doc,
        &[
            // 5 credits × n 2 × 2 (4K bills twice) = 20 a call; 3 items × 20 = 60
            line("big", 3, Some(20), Some(60)),
            // 5 × n 1 × 1 (2K) = 5; 3 × 5 = 15
            line("small", 3, Some(5), Some(15)),
            // 3 items × 2 images = 6 calls × 2 credits = 12
            line("up2", 6, Some(2), Some(12)),
            // 6 calls × 4 credits = 24
            line("up4", 6, Some(4), Some(24)),
        ],
    );
    // tasks 3 + 3 + 6 + 6 = 18; credits 60 + 15 + 12 + 24 = 111
    assert_totals(&doc, 18, 111);
    let steps = doc["costs"]["steps"].as_array().unwrap();
    // The operation with what sets its price (`operation`, plus `detail` where the document
    // splits them off).
    let ops: Vec<String> = steps
        .iter()
        .map(|s| {
            let detail = s["detail"].as_str().unwrap_or("");
            format!("{} {detail}", s["operation"].as_str().unwrap())
                .trim_end()
                .to_owned()
        })
        .collect();
    assert_eq!(
        ops,
        [
            "generate 4K ×2",
            "generate 2K ×1",
            "upscale 2x",
            "upscale 4x"
        ]
    );
    let tools = &doc["prices"]["tools"];
    assert_eq!(tools["upscale_2x"], 2, "{tools}");
    assert_eq!(tools["upscale_4x"], 4, "{tools}");
    assert_eq!(tools["remove_background"], 5, "{tools}");
    assert_eq!(tools["expand"], 5, "{tools}");
    assert_eq!(tools["erase"], 2, "{tools}");
}

/// A batch of `items` items with a once-generated style set, and per-item steps reading it.
fn once_pipeline(items: usize) -> String {
    let mut text = String::from("version: 1\nname: once\npricing: { generation: 4 }\nitems:\n");
    for i in 0..items {
        text.push_str(&format!("  - {{ id: item{i}, subject: thing {i} }}\n"));
    }
    text.push_str(
        r#"steps:
  - id: style
    once: true
    generate: { prompt: "A palette study", n: 2, size: 4K }
  - id: style-big
    once: true
    upscale: { from: style, desired_increase: 4 }
  - id: per
    erase: { from: style, object_name: "{{ item.subject }}" }
  - id: per-big
    upscale: { from: per, desired_increase: 2 }
"#,
    );
    text
}

#[tokio::test]
async fn once_steps_count_once_and_per_item_readers_fan_out_over_their_images() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "three.yaml", &once_pipeline(3));
    let (o, doc) = plan_offline(dir.path(), "three.yaml", &[]).await;
    assert_exit(&o, 0);
    assert_lines(
        &doc,
        &[
            // once for the batch: 1 call × (4 × n 2 × 2 for 4K = 16) = 16
            line("style", 1, Some(16), Some(16)),
            // once, one call per image of style: 1 × 2 = 2 calls × 4 = 8
            line("style-big", 2, Some(4), Some(8)),
            // per item, one call per image of the once step: 3 items × 2 images = 6 × 2 = 12
            line("per", 6, Some(2), Some(12)),
            // the chain keeps it: 6 × 2 = 12
            line("per-big", 6, Some(2), Some(12)),
        ],
    );
    // tasks 1 + 2 + 6 + 6 = 15; credits 16 + 8 + 12 + 12 = 48
    assert_totals(&doc, 15, 48);
    let onces: Vec<bool> = doc["costs"]["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["once"].as_bool().unwrap())
        .collect();
    assert_eq!(onces, [true, true, false, false]);

    // The once steps do not grow with the batch; the per-item steps do.
    for (items, per) in [(1u64, 2u64), (5, 10)] {
        let name = format!("n{items}.yaml");
        write(dir.path(), &name, &once_pipeline(items as usize));
        let (o, doc) = plan_offline(dir.path(), &name, &[]).await;
        assert_exit(&o, 0);
        assert_lines(
            &doc,
            &[
                line("style", 1, Some(16), Some(16)),
                line("style-big", 2, Some(4), Some(8)),
                // items × 2 images of style
                line("per", per, Some(2), Some(per * 2)),
                line("per-big", per, Some(2), Some(per * 2)),
            ],
        );
    }
}

#[tokio::test]
async fn a_join_is_one_generation_per_item_priced_as_a_generation() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "join.yaml",
        r#"
version: 1
name: join
pricing: { generation: 4 }
items:
  - { id: fox, animal: a red fox }
  - { id: owl, animal: a snowy owl }
  - { id: otter, animal: a river otter }
steps:
  - id: style
    once: true
    generate: { prompt: "A watercolour palette study", n: 2 }
  - id: portrait
    generate:
      prompt: "A portrait of {{ item.animal }}"
      image_urls:
        - https://sandbox.invalid/assets/plant.png
        - { from: style }
  - id: variants
    generate:
      prompt: "Variants of {{ item.animal }}"
      n: 3
      image_urls: [ "https://sandbox.invalid/assets/mug.png", { from: style } ]
  - id: framed
    expand: { from: variants, aspect_ratio: "4:5" }
"#,
    );
    let (o, doc) = plan_offline(dir.path(), "join.yaml", &[]).await;
    assert_exit(&o, 0);
    assert_lines(
        &doc,
        &[
            // once: 1 call × (4 × n 2) = 8
            line("style", 1, Some(8), Some(8)),
            // one call per item whatever its 1 + 2 reference images: 3 × (4 × 1) = 12
            line("portrait", 3, Some(4), Some(12)),
            // one call per item, n 3: 3 × (4 × 3 = 12) = 36
            line("variants", 3, Some(12), Some(36)),
            // per image of variants: 3 items × 3 = 9 calls × 5 = 45
            line("framed", 9, Some(5), Some(45)),
        ],
    );
    // tasks 1 + 3 + 3 + 9 = 16; credits 8 + 12 + 36 + 45 = 101
    assert_totals(&doc, 16, 101);
    assert_eq!(price_kind(&doc, "portrait"), "pipeline");
    assert_eq!(price_kind(&doc, "variants"), "pipeline");
}

#[tokio::test]
async fn edit_only_items_from_a_csv_need_no_generation_price() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "items.csv",
        "id,url,remove\n\
         mug,https://sandbox.invalid/assets/mug.png,the handle\n\
         lamp,https://sandbox.invalid/assets/lamp.png,the shade\n\
         chair,https://sandbox.invalid/assets/chair.png,the backrest\n",
    );
    write(
        dir.path(),
        "edit.yaml",
        r#"
version: 1
name: edit
items_from: items.csv
steps:
  - id: clean
    erase: { image_url: "{{ item.url }}", object_name: "{{ item.remove }}" }
  - id: big
    upscale: { from: clean, desired_increase: 4 }
  - id: cutout
    remove_background: { from: big, preserve_alpha: true }
"#,
    );
    let (o, doc) = plan_offline(dir.path(), "edit.yaml", &[]).await;
    assert_exit(&o, 0);
    assert_lines(
        &doc,
        &[
            // 3 rows × 1 call × 2 = 6
            line("clean", 3, Some(2), Some(6)),
            // one image per erase: 3 × 4 = 12
            line("big", 3, Some(4), Some(12)),
            // 3 × 5 = 15
            line("cutout", 3, Some(5), Some(15)),
        ],
    );
    // tasks 3 + 3 + 3 = 9; credits 6 + 12 + 15 = 33
    assert_totals(&doc, 9, 33);
    assert_eq!(doc["items"]["count"], 3);
    assert_eq!(doc["items"]["file"], "items.csv");
    for step in ["clean", "big", "cutout"] {
        assert_eq!(price_kind(&doc, step), "spec");
    }
    assert_eq!(doc["verdict"]["fits"], true, "{:#}", doc["verdict"]);
    assert!(
        !stderr(&o).contains("generation price"),
        "a tool-only pipeline needs no generation price: {}",
        stderr(&o)
    );
}

#[tokio::test]
async fn zero_items_warn_and_plan_zero_tasks() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "empty.yaml",
        r#"
version: 1
name: empty
pricing: { generation: 4 }
items: []
steps:
  - id: shot
    generate: { prompt: "Photo of {{ item.subject }}", n: 2 }
  - id: cut
    remove_background: { from: shot }
"#,
    );
    let (o, doc) = plan_offline(dir.path(), "empty.yaml", &[]).await;
    assert_exit(&o, 0);
    assert!(
        stderr(&o).contains("warning") && stderr(&o).contains("no items"),
        "{}",
        stderr(&o)
    );
    // 0 items × anything = 0
    assert_lines(
        &doc,
        &[
            line("shot", 0, Some(8), Some(0)),
            line("cut", 0, Some(5), Some(0)),
        ],
    );
    assert_totals(&doc, 0, 0);
    assert_eq!(doc["items"]["count"], 0);

    // A header-only CSV is zero items too; a once step still runs its one time.
    write(dir.path(), "none.csv", "id,url\n");
    write(
        dir.path(),
        "once-empty.yaml",
        r#"
version: 1
name: once-empty
pricing: { generation: 4 }
items_from: none.csv
steps:
  - id: style
    once: true
    generate: { prompt: "A palette study", n: 2 }
  - id: per
    erase: { from: style, object_name: the frame }
"#,
    );
    let (o, doc) = plan_offline(dir.path(), "once-empty.yaml", &[]).await;
    assert_exit(&o, 0);
    assert!(stderr(&o).contains("no items"), "{}", stderr(&o));
    assert_lines(
        &doc,
        &[
            // once: 1 × (4 × 2) = 8
            line("style", 1, Some(8), Some(8)),
            // 0 items × 2 images = 0
            line("per", 0, Some(2), Some(0)),
        ],
    );
    assert_totals(&doc, 1, 8);
}

// ---------------------------------------------------------------------------------------------
// 2. Unknown generation price
// ---------------------------------------------------------------------------------------------

const UNPRICED: &str = r#"
version: 1
name: unpriced
items:
  - { id: a, subject: a mug }
  - { id: b, subject: a lamp }
steps:
  - id: shot
    generate: { prompt: "Photo of {{ item.subject }}", n: 2 }
  - id: cut
    remove_background: { from: shot }
  - id: sketch
    generate: { prompt: "Sketch of {{ item.subject }}" }
"#;

#[tokio::test]
async fn an_unknown_generation_price_refuses_offline_with_a_hint() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "unpriced.yaml", UNPRICED);
    let (o, doc) = plan_offline(dir.path(), "unpriced.yaml", &[]).await;
    assert_exit(&o, 3);
    let err = stderr(&o);
    assert!(err.contains("generation price is unknown"), "{err}");
    assert!(err.contains("pricing: { generation: N }"), "{err}");
    assert_lines(
        &doc,
        &[
            line("shot", 2, None, None),
            // 2 items × 2 images = 4 calls × 5 = 20: known whatever a generation costs
            line("cut", 4, Some(5), Some(20)),
            line("sketch", 2, None, None),
        ],
    );
    let costs = &doc["costs"];
    // tasks 2 + 4 + 2 = 8
    assert_eq!(costs["tasks"], 8, "{costs:#}");
    assert!(costs["total_credits"].is_null(), "{costs:#}");
    assert_eq!(costs["known_credits"], 20, "{costs:#}");
    assert_eq!(
        costs["unpriced_steps"],
        serde_json::json!(["shot", "sketch"])
    );
    assert_eq!(price_kind(&doc, "shot"), "unknown");
    assert!(doc["prices"]["generation"]["credits"].is_null());
    assert_eq!(doc["prices"]["generation"]["source"]["kind"], "unknown");
    assert_eq!(doc["verdict"]["fits"], false);

    // The table says what is known and what is not.
    let o = run(None, &["plan", "--offline", "unpriced.yaml"], dir.path()).await;
    assert_exit(&o, 3);
    let text = stdout(&o);
    assert!(text.contains("at least 20 credits"), "{text}");
    assert!(text.contains("shot, sketch"), "{text}");
    // shot, generate, 2K, ×2, per, item, TASKS, CREDITS/TASK, SUBTOTAL, ...
    assert_eq!(row(&text, "shot")[7..9], ["?", "?"], "{text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn tool_only_pipelines_need_no_generation_price_even_online() {
    let env = start_default().await;
    write(
        env.dir.path(),
        "tools.yaml",
        &format!(
            r#"
version: 1
name: tools
items:
  - {{ id: a, url: "{MUG}" }}
steps:
  - id: cut
    remove_background: {{ image_url: "{{{{ item.url }}}}" }}
  - id: big
    upscale: {{ from: cut, desired_increase: 2 }}
"#
        ),
    );
    let (o, doc) = plan_online(&env, "tools.yaml", &[]).await;
    assert_exit(&o, 0);
    // 1 × 5 + 1 × 2 = 7
    assert_lines(
        &doc,
        &[
            line("cut", 1, Some(5), Some(5)),
            line("big", 1, Some(2), Some(2)),
        ],
    );
    assert_totals(&doc, 2, 7);
    assert_eq!(doc["balance"]["kind"], "known");
    assert_no_paid_call(&env);
    assert_nothing_billed(&env);
}

// ---------------------------------------------------------------------------------------------
// 3. Generation prices from the models list
// ---------------------------------------------------------------------------------------------

async fn advertising_sandbox() -> Env {
    start(sandbox::Config {
        advertise_price: true,
        generation_price: 7,
        ..sandbox::Config::default()
    })
    .await
}

/// `GET /v1/models` straight from the sandbox, not through imgpipe.
async fn models_json(env: &Env) -> Value {
    crate::common::http()
        .get(env.sandbox.base_url().join("v1/models").unwrap())
        .header("X-API-Key", env.sandbox.key())
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_generation_price_comes_from_the_models_list_when_it_states_one() {
    let env = advertising_sandbox().await;
    write(env.dir.path(), "unpriced.yaml", UNPRICED);
    let (o, doc) = plan_online(&env, "unpriced.yaml", &[]).await;
    assert_exit(&o, 0);
    assert_lines(
        &doc,
        &[
            // 7 credits × n 2 = 14 a call; 2 items × 14 = 28
            line("shot", 2, Some(14), Some(28)),
            // 4 × 5 = 20
            line("cut", 4, Some(5), Some(20)),
            // 7 × 1 = 7; 2 × 7 = 14
            line("sketch", 2, Some(7), Some(14)),
        ],
    );
    // tasks 2 + 4 + 2 = 8; credits 28 + 20 + 14 = 62
    assert_totals(&doc, 8, 62);
    let generation = &doc["prices"]["generation"];
    assert_eq!(generation["credits"], 7, "{generation:#}");
    assert_eq!(generation["source"]["kind"], "models", "{generation:#}");
    assert_eq!(price_kind(&doc, "shot"), "models");
    // The pointer really points at the price in what the service said.
    let pointer = generation["source"]["pointer"]
        .as_str()
        .unwrap_or_else(|| panic!("no pointer in {generation:#}"));
    let models = models_json(&env).await;
    assert_eq!(
        models.pointer(pointer),
        Some(&Value::from(7)),
        "{pointer} in {models:#}"
    );
    assert_no_paid_call(&env);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_pipeline_price_wins_over_the_models_list_and_the_disagreement_is_noted() {
    let env = advertising_sandbox().await;
    let priced = UNPRICED.replace("name: unpriced", "name: priced\npricing: { generation: 3 }");
    write(env.dir.path(), "priced.yaml", &priced);
    let (o, doc) = plan_online(&env, "priced.yaml", &[]).await;
    assert_exit(&o, 0);
    assert_lines(
        &doc,
        &[
            // 3 (the pipeline's, not the list's 7) × n 2 = 6; 2 × 6 = 12
            line("shot", 2, Some(6), Some(12)),
            line("cut", 4, Some(5), Some(20)),
            // 3 × 1; 2 × 3 = 6
            line("sketch", 2, Some(3), Some(6)),
        ],
    );
    // credits 12 + 20 + 6 = 38
    assert_totals(&doc, 8, 38);
    let generation = &doc["prices"]["generation"];
    assert_eq!(generation["credits"], 3);
    assert_eq!(generation["source"]["kind"], "pipeline");
    let notes = generation["notes"]
        .as_array()
        .unwrap_or_else(|| panic!("no notes in {generation:#}"));
    assert_eq!(notes.len(), 1, "{generation:#}");
    let note = notes[0].as_str().unwrap();
    assert!(note.contains('3') && note.contains('7'), "{note}");

    // The table shows the note too.
    let o = run(Some(&env), &["plan", "priced.yaml"], env.dir.path()).await;
    assert_exit(&o, 0);
    assert!(stdout(&o).contains("note: "), "{}", stdout(&o));

    // When both agree there is nothing to note.
    let agreed = UNPRICED.replace("name: unpriced", "name: agreed\npricing: { generation: 7 }");
    write(env.dir.path(), "agreed.yaml", &agreed);
    let (o, doc) = plan_online(&env, "agreed.yaml", &[]).await;
    assert_exit(&o, 0);
    let notes = &doc["prices"]["generation"]["notes"];
    assert!(
        notes.is_null() || notes.as_array().is_some_and(Vec::is_empty),
        "{notes}"
    );
    assert_no_paid_call(&env);
}

// ---------------------------------------------------------------------------------------------
// 4. Balance and budget
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn the_balance_is_shown_and_a_plan_that_fits_exits_0() {
    let env = start_default().await;
    write(env.dir.path(), "fan.yaml", FAN_OUT);
    let o = run(Some(&env), &["plan", "fan.yaml"], env.dir.path()).await;
    assert_exit(&o, 0);
    let text = stdout(&o);
    assert!(text.contains("balance  1000 credits"), "{text}");
    assert!(text.contains("total    106 credits"), "{text}");
    assert!(text.contains("fits"), "{text}");

    let (o, doc) = plan_online(&env, "fan.yaml", &[]).await;
    assert_exit(&o, 0);
    assert_eq!(doc["balance"]["kind"], "known", "{:#}", doc["balance"]);
    assert_eq!(doc["balance"]["credits"], 1000, "{:#}", doc["balance"]);
    assert_eq!(doc["verdict"]["fits"], true);
    assert_totals(&doc, 28, 106);
    assert_nothing_billed(&env);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_plan_costing_more_than_the_balance_exits_3_and_still_prints_the_table() {
    let env = start(sandbox::Config {
        balance: 50,
        ..sandbox::Config::default()
    })
    .await;
    write(env.dir.path(), "fan.yaml", FAN_OUT);
    let o = run(Some(&env), &["plan", "fan.yaml"], env.dir.path()).await;
    assert_exit(&o, 3);
    let err = stderr(&o);
    assert!(
        has_phrase(
            &err,
            "the plan costs 106 credits, more than the balance of 50"
        ),
        "the cost and the balance are named: {err}"
    );
    let text = stdout(&o);
    assert!(text.contains("STEP") && text.contains("SUBTOTAL"), "{text}");
    // shot, generate, 2K, ×3, per, item, TASKS, CREDITS/TASK, SUBTOTAL, ...
    assert_eq!(row(&text, "shot")[7..9], ["9", "18"], "{text}");
    assert!(text.contains("balance  50 credits"), "{text}");

    let (o, doc) = plan_online(&env, "fan.yaml", &[]).await;
    assert_exit(&o, 3);
    assert_eq!(doc["balance"]["credits"], 50);
    assert_eq!(doc["verdict"]["fits"], false);
    assert_no_paid_call(&env);
    assert_eq!(env.sandbox.balance(), 50);
}

const BUDGETED: &str = r#"
version: 1
name: budgeted
budget: { max_credits: 50 }
pricing: { generation: 4 }
items:
  - { id: a, subject: a mug }
  - { id: b, subject: a lamp }
steps:
  - id: shot
    generate: { prompt: "Photo of {{ item.subject }}", n: 2 }
  - id: cut
    remove_background: { from: shot }
"#;

#[tokio::test]
async fn over_budget_exits_3_and_the_smaller_budget_applies() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "budgeted.yaml", BUDGETED);
    // 2 × (4 × 2) = 16 + 4 × 5 = 20 → 36, under the file's 50
    let (o, doc) = plan_offline(dir.path(), "budgeted.yaml", &[]).await;
    assert_exit(&o, 0);
    assert_totals(&doc, 6, 36);
    assert_eq!(doc["budget"]["max_credits"], 50);
    assert_eq!(doc["budget"]["source"], "budget.max_credits");

    // A smaller --max-credits wins.
    let (o, doc) = plan_offline(dir.path(), "budgeted.yaml", &["--max-credits", "30"]).await;
    assert_exit(&o, 3);
    assert_eq!(doc["budget"]["max_credits"], 30);
    assert_eq!(doc["budget"]["source"], "--max-credits");
    assert_eq!(doc["verdict"]["fits"], false);
    let err = stderr(&o);
    assert!(
        err.contains("budget of 30") && err.contains("--max-credits"),
        "{err}"
    );

    // A larger one does not raise the file's budget...
    let (o, doc) = plan_offline(dir.path(), "budgeted.yaml", &["--max-credits", "3000"]).await;
    assert_exit(&o, 0);
    assert_eq!(doc["budget"]["max_credits"], 50);
    assert_eq!(doc["budget"]["source"], "budget.max_credits");

    // ...so a file budget under the total still refuses.
    write(
        dir.path(),
        "tight.yaml",
        &BUDGETED.replace("max_credits: 50", "max_credits: 20"),
    );
    let (o, doc) = plan_offline(dir.path(), "tight.yaml", &["--max-credits", "3000"]).await;
    assert_exit(&o, 3);
    assert_eq!(doc["budget"]["max_credits"], 20);
    let err = stderr(&o);
    assert!(
        err.contains("budget of 20") && err.contains("budget.max_credits"),
        "{err}"
    );
    let o = run(None, &["plan", "--offline", "tight.yaml"], dir.path()).await;
    assert_exit(&o, 3);
    assert!(stdout(&o).contains("STEP"), "{}", stdout(&o));

    // The budget holds exactly: a total equal to it fits.
    let (o, _) = plan_offline(dir.path(), "budgeted.yaml", &["--max-credits", "36"]).await;
    assert_exit(&o, 0);
}

#[tokio::test]
async fn plan_on_the_embedded_sandbox_needs_no_environment() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "fan.yaml", FAN_OUT);
    let o = run(None, &["plan", "--sandbox", "fan.yaml"], dir.path()).await;
    assert_exit(&o, 0);
    let text = stdout(&o);
    assert!(text.contains("balance  1000 credits"), "{text}");
    assert!(text.contains("total    106 credits"), "{text}");
}

// ---------------------------------------------------------------------------------------------
// 5. Saved plans
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn save_writes_the_plan_with_the_hashes_of_what_it_was_made_from() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), "fan.yaml", FAN_OUT);
    let (o, printed) = plan_offline(dir.path(), "fan.yaml", &["--save", "plan.json"]).await;
    assert_exit(&o, 0);
    let saved = read_json(&dir.path().join("plan.json"));
    assert_eq!(saved["kind"], "imgpipe-plan");
    assert_eq!(
        saved["pipeline"]["sha256"],
        sha256_hex(&std::fs::read(&file).unwrap())
    );
    assert!(is_sha256_hex(&saved["items"]["sha256"]), "{saved:#}");
    assert!(is_sha256_hex(&saved["prices"]["sha256"]), "{saved:#}");
    assert_eq!(saved["pipeline"]["name"], "fan-out");
    assert_totals(&saved, 28, 106);
    assert_eq!(saved, printed, "--save writes what --json prints");

    // Saving again over the earlier plan works.
    let o = run(
        None,
        &["plan", "--offline", "--save", "plan.json", "fan.yaml"],
        dir.path(),
    )
    .await;
    assert_exit(&o, 0);
    assert_eq!(
        read_json(&dir.path().join("plan.json"))["kind"],
        "imgpipe-plan"
    );
}

#[tokio::test]
async fn save_never_overwrites_a_file_that_is_not_a_plan() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "fan.yaml", FAN_OUT);
    for (name, content) in [
        ("notes.txt", "my notes, not a plan\n"),
        ("other.json", "{\"kind\": \"something-else\"}\n"),
        ("empty.json", ""),
    ] {
        write(dir.path(), name, content);
        let before = entries(dir.path());
        let o = run(
            None,
            &["plan", "--offline", "--save", name, "fan.yaml"],
            dir.path(),
        )
        .await;
        assert_exit(&o, 2);
        assert!(
            stderr(&o).contains(name) && stderr(&o).contains("not an imgpipe plan"),
            "{}",
            stderr(&o)
        );
        assert_eq!(
            std::fs::read_to_string(dir.path().join(name)).unwrap(),
            content,
            "{name} is unchanged"
        );
        assert_eq!(entries(dir.path()), before, "no leftover files");
    }
}

/// The saved plan of `file` in `dir`.
async fn saved_plan(dir: &Path, file: &str) -> Value {
    let o = run(
        None,
        &["plan", "--offline", "--save", "plan.json", file],
        dir,
    )
    .await;
    assert_exit(&o, 0);
    read_json(&dir.join("plan.json"))
}

#[tokio::test]
async fn the_items_hash_follows_the_items_not_the_way_the_file_is_written() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.yaml", FAN_OUT);
    let first = saved_plan(dir.path(), "p.yaml").await;

    // Only comments change: the file's hash changes, the items' and prices' do not.
    let commented = FAN_OUT
        .replace("items:\n", "# the batch\nitems:   # two products\n")
        .replace("steps:\n", "steps:   # a chain\n");
    write(dir.path(), "p.yaml", &commented);
    let second = saved_plan(dir.path(), "p.yaml").await;
    assert_ne!(second["pipeline"]["sha256"], first["pipeline"]["sha256"]);
    assert_eq!(second["items"]["sha256"], first["items"]["sha256"]);
    assert_eq!(second["prices"]["sha256"], first["prices"]["sha256"]);

    // The same items written as block mappings: still the same items.
    let block = FAN_OUT.replace(
        "  - { id: a, subject: a mug }\n  - { id: b, subject: a lamp }\n",
        "  - id: a\n    subject: a mug\n  - subject: \"a lamp\"\n    id: b\n",
    );
    assert_ne!(block, FAN_OUT);
    write(dir.path(), "p.yaml", &block);
    let third = saved_plan(dir.path(), "p.yaml").await;
    assert_eq!(third["items"]["sha256"], first["items"]["sha256"]);

    // One item's field changes: the items' hash changes.
    write(
        dir.path(),
        "p.yaml",
        &FAN_OUT.replace("a lamp", "a brass lamp"),
    );
    let fourth = saved_plan(dir.path(), "p.yaml").await;
    assert_ne!(fourth["items"]["sha256"], first["items"]["sha256"]);

    // An item's id changes: so does the hash.
    write(dir.path(), "p.yaml", &FAN_OUT.replace("id: b,", "id: b2,"));
    let fifth = saved_plan(dir.path(), "p.yaml").await;
    assert_ne!(fifth["items"]["sha256"], first["items"]["sha256"]);

    // The generation price changes: the prices' hash changes, the items' does not.
    write(
        dir.path(),
        "p.yaml",
        &FAN_OUT.replace("generation: 3", "generation: 4"),
    );
    let sixth = saved_plan(dir.path(), "p.yaml").await;
    assert_ne!(sixth["prices"]["sha256"], first["prices"]["sha256"]);
    assert_eq!(sixth["items"]["sha256"], first["items"]["sha256"]);
}

/// The items hash must tell apart two different item tables. It joins each field as
/// `name=value` with nothing to mark where the name ends, so a CSV column `k` holding `v=w`
/// and a column `k=v` holding `w` hash alike: a saved plan would not notice that change.
#[tokio::test]
async fn the_items_hash_tells_a_field_name_from_its_value() {
    let dir = tempfile::tempdir().unwrap();
    let pipeline = |csv: &str| {
        format!(
            r#"
version: 1
name: csv
items_from: {csv}
steps:
  - id: clean
    erase: {{ image_url: "{{{{ item.url }}}}", object_name: the handle }}
"#
        )
    };
    write(dir.path(), "one.csv", &format!("id,url,k\nmug,{MUG},v=w\n"));
    write(dir.path(), "two.csv", &format!("id,url,k=v\nmug,{MUG},w\n"));
    write(dir.path(), "one.yaml", &pipeline("one.csv"));
    write(dir.path(), "two.yaml", &pipeline("two.csv"));
    let (o, one) = plan_offline(dir.path(), "one.yaml", &[]).await;
    assert_exit(&o, 0);
    let (o, two) = plan_offline(dir.path(), "two.yaml", &[]).await;
    assert_exit(&o, 0);
    assert_ne!(
        one["items"]["sha256"], two["items"]["sha256"],
        "items {{k: \"v=w\"}} and {{\"k=v\": \"w\"}} are different items but hash alike"
    );
}

// ---------------------------------------------------------------------------------------------
// 6. Invalid files are refused before any request
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn an_invalid_file_exits_2_before_any_request() {
    let env = start_default().await;
    write(
        env.dir.path(),
        "bad.yaml",
        r#"
version: 1
name: bad
pricing: { generation: 4 }
items:
  - { id: a, subject: a mug }
steps:
  - id: shot
    generate: { prompt: "Photo of {{ item.subjekt }}", n: 5 }
  - id: cut
    remove_background: { from: shoot }
"#,
    );
    for args in [
        &["plan", "bad.yaml"][..],
        &["--json", "plan", "bad.yaml"],
        &["plan", "--save", "plan.json", "bad.yaml"],
        &["plan", "missing.yaml"],
    ] {
        let o = run(Some(&env), args, env.dir.path()).await;
        assert_exit_without_panic(&o, 2);
        assert!(stdout(&o).is_empty(), "{args:?}: {}", stdout(&o));
        assert!(stderr(&o).contains("nothing was sent"), "{}", stderr(&o));
    }
    let o = run(Some(&env), &["plan", "bad.yaml"], env.dir.path()).await;
    let err = stderr(&o);
    for needle in [
        "bad.yaml:9:",
        "subjekt",
        "n must be between 1 and 4",
        "\"shoot\"",
    ] {
        assert!(err.contains(needle), "{needle} missing from {err}");
    }
    assert!(!env.dir.path().join("plan.json").exists());
    let stats = env.sandbox.stats();
    assert_eq!(
        stats.api_requests, 0,
        "the sandbox saw a request: {stats:?}"
    );
    assert_eq!(stats.unauthorized, 0, "{stats:?}");
    assert_nothing_billed(&env);
}

// ---------------------------------------------------------------------------------------------
// 7. The committed schema and samples
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn the_committed_schema_is_what_imgpipe_prints() {
    let o = run(None, &["schema"], repo()).await;
    assert_exit(&o, 0);
    let printed = stdout(&o);
    let committed = std::fs::read_to_string(repo().join("pipelines/schema.json")).unwrap();
    assert!(
        printed.trim_end() == committed.trim_end(),
        "pipelines/schema.json is out of date with the pipeline types; regenerate it with \
         `cargo run -q -- schema > pipelines/schema.json`"
    );
}

#[tokio::test]
async fn every_sample_validates_and_plans_offline_and_on_the_sandbox() {
    let samples = samples();
    assert!(samples.len() >= 4, "{samples:?}");
    let checks = samples.iter().map(|file| async move {
        let o = run(None, &["validate", file], repo()).await;
        assert_exit(&o, 0);
        assert!(stdout(&o).contains("is valid"), "{file}: {}", stdout(&o));
        let o = run(None, &["plan", "--offline", file], repo()).await;
        assert_exit(&o, 0);
        let o = run(None, &["plan", "--sandbox", file], repo()).await;
        assert_exit(&o, 0);
        assert!(
            stdout(&o).contains("balance  1000 credits"),
            "{file}: {}",
            stdout(&o)
        );
    });
    futures::future::join_all(checks).await;
}

// ---------------------------------------------------------------------------------------------
// Absurd numbers
// ---------------------------------------------------------------------------------------------

/// Prices near the top of u64 must neither crash the planner nor wrap around into a small
/// total that fits: the plan is refused, as invalid (2) or over budget (3).
#[tokio::test]
async fn absurd_prices_do_not_wrap_into_a_plan_that_fits() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        // 2^63 × n 1, twice: the sum is 2^64, which wraps to 0
        (
            "sum.yaml",
            "9223372036854775808",
            "  - id: one\n    generate: { prompt: one }\n  - id: two\n    generate: { prompt: two }\n",
        ),
        // (2^64 - 1) × n 2: the per-call price overflows
        (
            "product.yaml",
            "18446744073709551615",
            "  - id: one\n    generate: { prompt: one, n: 2 }\n",
        ),
    ];
    for (name, price, steps) in cases {
        write(
            dir.path(),
            name,
            &format!(
                "version: 1\nname: absurd\nbudget: {{ max_credits: 1000 }}\npricing: {{ generation: {price} }}\nitems:\n  - {{ id: a }}\nsteps:\n{steps}"
            ),
        );
        let o = run(None, &["--json", "plan", "--offline", name], dir.path()).await;
        let err = stderr(&o);
        assert!(
            !err.contains("panicked"),
            "{name}: the planner crashed:\n{err}"
        );
        let code = o.status.code();
        assert!(
            code == Some(2) || code == Some(3),
            "{name}: exit {code:?}, not refused\n{}\n{err}",
            stdout(&o)
        );
        if code == Some(3) {
            let doc = json_stdout(&o);
            assert_eq!(doc["verdict"]["fits"], false, "{name}");
            let known = doc["costs"]["known_credits"].as_u64().unwrap();
            assert!(known > 1000, "{name}: a total of {known} credits");
        }
    }
}
