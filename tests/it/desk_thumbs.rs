//! The desk's grid shows thumbnails, not the images (issue 44): each output of the items API
//! has a `thumb` URL beside its `src`; the thumbnail is a PNG of at most 256 px a side, made
//! once (the report's own, in `_thumbs/`, named by the image's sha256) and served again from
//! there, while the full image stays one click away.

use crate::common::*;
use crate::desk::{Catalogue, serve_with};

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

#[tokio::test(flavor = "multi_thread")]
async fn the_grid_gets_thumbnails_made_once_and_the_full_image_stays_a_click_away() {
    let env = start(imgpipe::sandbox::Config {
        image_side: 512,
        ..imgpipe::sandbox::Config::default()
    })
    .await;
    let c = Catalogue::new(&env, None);
    std::fs::write(c.dir.join("thumbs.yaml"), PIPELINE).unwrap();
    let ran = c
        .imgpipe(&["run", "thumbs.yaml", "--run-id", "r"])
        .run()
        .await;
    assert_exit(&ran, 0);
    let desk = serve_with(&c, &[]).await;
    let (base, token) = (desk.base.clone(), desk.token.clone());

    let page: serde_json::Value = fetch(&base, &token, "/api/runs/r/items")
        .await
        .json()
        .await
        .unwrap();
    let outputs: Vec<&serde_json::Value> = page["items"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|i| i["tasks"].as_array().unwrap())
        .flat_map(|t| t["outputs"].as_array().unwrap())
        .collect();
    assert_eq!(outputs.len(), 4, "{page:#}");
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
