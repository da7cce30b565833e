//! The desk's grid shows thumbnails, not the images (issue 44): each output of the items API
//! has a `thumb` URL beside its `src`; the thumbnail is a PNG of at most 256 px a side, made
//! once (the report's own, in `_thumbs/`, named by the image's sha256) and served again from
//! there, while the full image stays one click away.

use crate::common::*;
use crate::desk::{Catalogue, serve_on, serve_with};

/// Two items, each one generation of two 2K images: 512 px squares in this sandbox, twice
/// the thumbnail's side.
const PIPELINE: &str = r#"version: 1
name: thumbs
output_dir: out
pricing: { generation: 4 }
items:
  - { id: mug }
  - { id: lamp }
steps:
  - id: shot
    generate: { prompt: "a photo of {{ item.id }}", n: 2, size: 2K }
"#;

async fn fetch(desk_base: &str, token: &str, path: &str) -> reqwest::Response {
    http()
        .get(format!("{desk_base}{path}"))
        .header("authorization", format!("Bearer {token}"))
        .send()
        .await
        .unwrap()
}

/// A sandbox whose 2K images are 512 px squares.
async fn sandbox() -> Env {
    start(imgpipe::sandbox::Config {
        image_side: 512,
        ..imgpipe::sandbox::Config::default()
    })
    .await
}

/// [`PIPELINE`] run to its end as run `r`, its outputs in `s3` when given.
async fn ran<'e>(env: &'e Env, s3: Option<&crate::objects::S3>) -> Catalogue<'e> {
    let c = Catalogue::new(env, None);
    std::fs::write(c.dir.join("thumbs.yaml"), PIPELINE).unwrap();
    let mut run = c.imgpipe(&["run", "thumbs.yaml", "--run-id", "r"]);
    if let Some(s3) = s3 {
        run = run.args(&["--out", "s3://shots/runs/"]).s3(s3);
    }
    assert_exit(&run.run().await, 0);
    c
}

/// The outputs the first page of run `r`'s items shows.
async fn outputs(desk_base: &str, token: &str) -> Vec<serde_json::Value> {
    let page: serde_json::Value = fetch(desk_base, token, "/api/runs/r/items")
        .await
        .json()
        .await
        .unwrap();
    let outputs: Vec<serde_json::Value> = page["items"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|i| i["tasks"].as_array().unwrap())
        .flat_map(|t| t["outputs"].as_array().unwrap())
        .cloned()
        .collect();
    assert_eq!(outputs.len(), 4, "{page:#}");
    outputs
}

#[tokio::test(flavor = "multi_thread")]
async fn the_grid_gets_thumbnails_made_once_and_the_full_image_stays_a_click_away() {
    let env = sandbox().await;
    let c = ran(&env, None).await;
    let desk = serve_with(&c, &[]).await;
    let (base, token) = (desk.base.clone(), desk.token.clone());
    let outputs = outputs(&base, &token).await;
    let thumbs = c.dir.join("out/r/_thumbs");
    for o in outputs {
        let thumb = o["thumb"]
            .as_str()
            .unwrap_or_else(|| panic!("no thumb: {o}"));
        let sha = o["sha256"].as_str().unwrap();
        assert!(thumb.ends_with(&format!("?sha={sha}")), "{thumb}");
        let r = fetch(&base, &token, thumb).await;
        assert_eq!(r.status(), 200, "{thumb}");
        assert_eq!(r.headers()["content-type"], "image/png");
        let small = r.bytes().await.unwrap();
        let full = fetch(&base, &token, o["src"].as_str().unwrap()).await;
        assert_eq!(full.status(), 200);
        let full = full.bytes().await.unwrap();
        let (shown, image) = (
            image::load_from_memory(&small).unwrap(),
            image::load_from_memory(&full).unwrap(),
        );
        assert_eq!((image.width(), image.height()), (512, 512));
        assert_eq!((shown.width(), shown.height()), (256, 256), "{thumb}");
        assert!(small.len() < full.len(), "{} ≥ {}", small.len(), full.len());

        // Made once, where the report keeps its own, and served from there again.
        let made = thumbs.join(format!("{}.png", &sha[..32]));
        let when = std::fs::metadata(&made).unwrap().modified().unwrap();
        let again = fetch(&base, &token, thumb).await.bytes().await.unwrap();
        assert_eq!(again, small);
        assert_eq!(std::fs::metadata(&made).unwrap().modified().unwrap(), when);
    }

    // A thumbnail is asked by its image's place and sha256, and nothing else.
    for (path, status) in [
        ("/runs/r/thumbs/mug/shot-0.png?sha=nothex", 400),
        ("/runs/r/thumbs/..%2Fstate.db?sha=", 400),
        (
            "/runs/r/thumbs/mug/none.png?sha=0000000000000000000000000000000000000000000000000000000000000000",
            404,
        ),
    ] {
        assert_eq!(fetch(&base, &token, path).await.status(), status, "{path}");
    }
    desk.stop().await;
}

/// A run whose outputs are in a bucket: the desk makes each thumbnail from its object, read
/// once, and keeps it in a cache of its own (it writes nothing into the bucket); once a report
/// has put its thumbnails beside the run's objects, the desk serves those and reads no image.
#[tokio::test(flavor = "multi_thread")]
async fn the_grid_of_a_run_in_a_bucket_gets_thumbnails_without_reading_an_image_twice() {
    use crate::objects::{S3, of_kind};
    let env = sandbox().await;
    let s3 = S3::start().await;
    let c = ran(&env, Some(&s3)).await;
    let desk = serve_on(c.plain(&["review", "--no-open"]).s3(&s3)).await;
    let (base, token) = (desk.base.clone(), desk.token.clone());
    let outputs: Vec<(String, String)> = outputs(&base, &token)
        .await
        .iter()
        .map(|o| {
            let text = |k: &str| o[k].as_str().unwrap().to_owned();
            (text("file"), text("thumb"))
        })
        .collect();
    let _ = s3.take_requests();
    let mut shown = Vec::new();
    for (file, thumb) in &outputs {
        let small = fetch(&base, &token, thumb).await;
        assert_eq!(small.status(), 200, "{thumb}");
        let small = small.bytes().await.unwrap();
        let img = image::load_from_memory(&small).unwrap();
        assert_eq!((img.width(), img.height()), (256, 256), "{thumb}");
        let object = std::fs::read(s3.file(&format!("runs/r/{file}"))).unwrap();
        assert!(small.len() < object.len(), "{file}: smaller than its image");
        let again = fetch(&base, &token, thumb).await.bytes().await.unwrap();
        assert_eq!(again, small, "{file}: the same thumbnail again");
        shown.push(small);
    }
    let log = s3.take_requests();
    // It looks for a report's thumbnail first (none yet), then reads the image.
    let mut read: Vec<&str> = of_kind(&log, "GET")
        .into_iter()
        .filter(|k| !k.starts_with("runs/r/_thumbs/"))
        .collect();
    read.sort_unstable();
    let mut images: Vec<String> = outputs.iter().map(|(f, _)| format!("runs/r/{f}")).collect();
    images.sort_unstable();
    assert_eq!(read, images, "each image read once, for its thumbnail");
    assert!(
        of_kind(&log, "PUT").is_empty(),
        "the desk writes nothing into the bucket"
    );
    desk.stop().await;

    // A report puts its thumbnails beside the run's objects; a desk then serves those.
    let reported = c.plain(&["report", "r"]).s3(&s3).run().await;
    assert_exit(&reported, 0);
    let desk = serve_on(c.plain(&["review", "--no-open"]).s3(&s3)).await;
    let _ = s3.take_requests();
    for ((file, thumb), before) in outputs.iter().zip(&shown) {
        let small = fetch(&desk.base, &desk.token, thumb).await;
        assert_eq!(small.status(), 200, "{thumb}");
        assert_eq!(
            &small.bytes().await.unwrap(),
            before,
            "{file}: the report's thumbnail"
        );
    }
    let log = s3.take_requests();
    let read = of_kind(&log, "GET");
    assert!(
        read.iter().all(|k| k.starts_with("runs/r/_thumbs/")),
        "only thumbnails read: {read:?}"
    );
    desk.stop().await;
}
