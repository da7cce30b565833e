//! The tools on real PNG bytes, as a paid call applies them.

use image::{DynamicImage, GenericImageView, ImageFormat};

use super::apply;
use crate::api::types::{Increase, ToolParams};
use crate::sandbox::images::{Weight, generation_png, sample_png};
use crate::sandbox::rows::{self, Shape};

fn open(png: &[u8]) -> DynamicImage {
    image::load_from_memory_with_format(png, ImageFormat::Png).expect("the sandbox's own PNG")
}

fn png(img: &DynamicImage) -> Vec<u8> {
    let mut bytes = Vec::new();
    img.write_to(std::io::Cursor::new(&mut bytes), ImageFormat::Png)
        .expect("encoding into memory");
    bytes
}

fn generation(prompt: &str, index: u32, seed: u64, side: u32) -> DynamicImage {
    open(&generation_png(prompt, index, seed, side, Weight::Flat))
}

fn tool_at(img: &DynamicImage, params: ToolParams, weight: Weight) -> DynamicImage {
    open(&apply(&png(img), &params, true, weight).expect("an edit of a readable PNG"))
}

fn tool(img: &DynamicImage, params: ToolParams) -> DynamicImage {
    tool_at(img, params, Weight::Flat)
}

fn upscale(img: &DynamicImage, factor: u32) -> DynamicImage {
    let desired_increase = if factor == 2 {
        Increase::X2
    } else {
        Increase::X4
    };
    tool(img, ToolParams::Upscale { desired_increase })
}

fn expand(img: &DynamicImage, ratio: Option<&str>, prompt: Option<&str>) -> DynamicImage {
    let params = ToolParams::Expand {
        aspect_ratio: ratio.map(|r| r.parse().expect("a ratio")),
        prompt: prompt.map(str::to_owned),
    };
    tool(img, params)
}

fn erase(img: &DynamicImage, object_name: &str) -> DynamicImage {
    let object_name = object_name.to_owned();
    tool(img, ToolParams::Erase { object_name })
}

fn remove_background(img: &DynamicImage) -> DynamicImage {
    tool(img, ToolParams::RemoveBackground)
}

#[test]
fn generation_is_deterministic_and_varies_with_inputs() {
    let a = generation("a cat", 0, 7, 64);
    assert!(matches!(a, DynamicImage::ImageRgb8(_)) && a.dimensions() == (64, 64));
    assert_eq!(a.as_bytes(), generation("a cat", 0, 7, 64).as_bytes());
    for other in [("a dog", 0, 7), ("a cat", 1, 7), ("a cat", 0, 8)] {
        let b = generation(other.0, other.1, other.2, 64);
        assert_ne!(a.as_bytes(), b.as_bytes());
    }
    assert_eq!(
        sample_png("x", 32, Weight::Flat),
        sample_png("x", 32, Weight::Flat)
    );
}

#[test]
fn upscale_multiplies_sides_and_keeps_alpha() {
    let img = generation("p", 0, 0, 40);
    let double = upscale(&img, 2);
    assert_eq!(double.dimensions(), (80, 80));
    assert_eq!(double.get_pixel(21, 11), img.get_pixel(10, 5));
    assert_eq!(upscale(&img, 4).dimensions(), (160, 160));
    assert!(upscale(&remove_background(&img), 2).color().has_alpha());
}

#[test]
fn remove_background_clears_border_and_keeps_subject() {
    let images = [
        generation("a cat", 3, 1, 128),
        open(&sample_png("shoe", 100, Weight::Flat)),
    ];
    for img in images.iter().flat_map(|img| [upscale(img, 4), img.clone()]) {
        let (w, h) = img.dimensions();
        let out = remove_background(&img);
        assert_eq!(out.dimensions(), (w, h));
        for (x, y) in [(0, 0), (w - 1, 0), (0, h - 1), (w - 1, h - 1)] {
            assert_eq!(out.get_pixel(x, y)[3], 0);
        }
        assert_eq!(out.get_pixel(w / 2, h / 2)[3], 255);
    }
}

/// The sample pipeline's chain: erase, expand to 16:9 with a prompt, upscale 4×, cut out, at
/// both weights (a photo's grain adds up along the chain). The subject (the dark circle in the
/// middle, with the object over it) stays opaque and the whole border goes.
#[test]
fn remove_background_keeps_the_subject_at_the_end_of_a_chain() {
    let subjects = [
        ("a ceramic coffee mug", "the price sticker"),
        ("a brass desk lamp", "the power cable"),
        ("an oak dining chair", "the floor scuff"),
    ];
    for weight in [Weight::Flat, Weight::Photo] {
        for (subject, object) in subjects {
            let prompt = format!("Studio photo of {subject} on a white backdrop");
            for index in 0..2 {
                let shot = open(&generation_png(&prompt, index, 0, 64, weight));
                let chain = [
                    ToolParams::Erase {
                        object_name: object.to_owned(),
                    },
                    ToolParams::Expand {
                        aspect_ratio: Some("16:9".parse().expect("a ratio")),
                        prompt: Some("extend the backdrop".to_owned()),
                    },
                    ToolParams::Upscale {
                        desired_increase: Increase::X4,
                    },
                    ToolParams::RemoveBackground,
                ];
                let out = chain
                    .into_iter()
                    .fold(shot, |img, params| tool_at(&img, params, weight))
                    .to_rgba8();
                let (w, h) = out.dimensions();
                let case = format!("{weight:?} {subject} {index}");
                // The circle's radius is a quarter of the shot's side, which is `h` here; a
                // square of 0.3 h around the centre lies inside it.
                let half = h * 15 / 100;
                let centre: Vec<u8> = (h / 2 - half..h / 2 + half)
                    .flat_map(|y| (w / 2 - half..w / 2 + half).map(move |x| (x, y)))
                    .map(|(x, y)| out.get_pixel(x, y)[3])
                    .collect();
                let opaque = centre.iter().filter(|a| **a == 255).count();
                assert!(
                    opaque * 100 >= centre.len() * 90,
                    "{case}: {opaque} of {} centre pixels opaque",
                    centre.len()
                );
                let border = (0..w)
                    .flat_map(|x| [(x, 0), (x, h - 1)])
                    .chain((0..h).flat_map(|y| [(0, y), (w - 1, y)]));
                for (x, y) in border {
                    assert_eq!(out.get_pixel(x, y)[3], 0, "{case}: ({x}, {y})");
                }
            }
        }
    }
}

#[test]
fn expand_contains_the_centred_input_and_keeps_colour_type() {
    let img = generation("p", 0, 0, 90);
    let out = expand(&img, Some("16:9"), Some("sea"));
    assert_eq!(out.dimensions(), (160, 90));
    assert_eq!(out.crop_imm(35, 0, 90, 90), img);
    let (w, h) = expand(&upscale(&img, 2), Some("16:9"), None).dimensions();
    assert!(w >= 180 && h == 180 && (w * 9).abs_diff(h * 16) < 16);
    assert_eq!(expand(&img, Some("1:2"), None).dimensions(), (90, 180));
    let rgba = remove_background(&img);
    let grown = expand(&rgba, None, None);
    assert!(grown.dimensions() == (113, 113) && grown.color().has_alpha());
    assert_eq!(grown.crop_imm(11, 11, 90, 90), rgba);
    assert_ne!(grown, expand(&rgba, None, Some("forest")));
}

#[test]
fn erase_keeps_size_and_changes_a_region() {
    let img = generation("a cat", 0, 0, 120);
    for name in ["hat", "car", "tree", "person"] {
        let out = erase(&img, name);
        assert!(matches!(out, DynamicImage::ImageRgb8(_)));
        assert_eq!(out.dimensions(), img.dimensions());
        assert_ne!(out, img, "{name}");
        assert_eq!(out.get_pixel(0, 0), img.get_pixel(0, 0));
        assert_eq!(out, erase(&img, name));
    }
}

/// `preserve_alpha: false` shows a transparent result over white; an opaque one is unchanged.
#[test]
fn flattening_composes_over_white_and_keeps_the_colour_types() {
    let rgb = generation("p", 0, 0, 32);
    let rgba = remove_background(&rgb);
    let params = ToolParams::Erase {
        object_name: "nothing".to_owned(),
    };
    let flat = open(&apply(&png(&rgba), &params, false, Weight::Flat).expect("an edit"));
    assert!(matches!(flat, DynamicImage::ImageRgb8(_)));
    assert_eq!(flat.get_pixel(0, 0).0, [255; 4]);
    assert_eq!(flat.get_pixel(16, 16), rgb.get_pixel(16, 16));
    let kept = open(&apply(&png(&rgb), &params, false, Weight::Flat).expect("an edit"));
    assert_eq!(kept, erase(&rgb, "nothing"));
    let luma = apply(
        &png(&DynamicImage::new_luma8(4, 4)),
        &params,
        true,
        Weight::Flat,
    );
    assert!(matches!(
        open(&luma.expect("a grey PNG")),
        DynamicImage::ImageRgb8(_)
    ));
    let refused = apply(b"not a png", &params, true, Weight::Flat).expect_err("not a PNG");
    assert_eq!(refused.field, "image_url");
}

/// A photo-weight picture carries a photo's bytes (a 2048-px photo is 3 to 8 MB, 6 to 15 bits
/// a pixel), is still the same for the same request, and its edits keep that weight.
#[test]
fn a_photo_weighs_what_photos_weigh_and_its_edits_too() {
    let bits_per_pixel = |png: &[u8]| {
        let shape = rows::shape(png).expect("a PNG");
        png.len() as f64 * 8.0 / f64::from(shape.width * shape.height)
    };
    let photo = generation_png("a lamp", 0, 0, 256, Weight::Photo);
    assert_eq!(photo, generation_png("a lamp", 0, 0, 256, Weight::Photo));
    let flat = generation_png("a lamp", 0, 0, 256, Weight::Flat);
    let bits = bits_per_pixel(&photo);
    assert!(
        (6.0..=15.0).contains(&bits),
        "generation: {bits:.1} bits a pixel"
    );
    assert!(
        bits_per_pixel(&flat) < 1.0,
        "flat: {:.2}",
        bits_per_pixel(&flat)
    );
    let params = ToolParams::Upscale {
        desired_increase: Increase::X4,
    };
    let big = apply(&photo, &params, true, Weight::Photo).expect("an upscale");
    let bits = bits_per_pixel(&big);
    assert!(
        (4.0..=15.0).contains(&bits),
        "upscale: {bits:.1} bits a pixel"
    );
    let shape = Shape {
        width: 1024,
        height: 1024,
        alpha: false,
    };
    assert_eq!(rows::shape(&big).expect("a PNG"), shape);
}

/// The sample pipeline's chain at the service's 2K (2048 px: expanded to 16:9, then upscaled
/// 4×) makes 14,564 × 8,192 images, and the sandbox makes them; past 16,384 a side an edit is
/// refused before anything is drawn, naming the field that asked for it.
#[test]
fn the_sample_chain_fits_at_2048_and_past_16384_a_side_is_refused() {
    let (w, h) = crate::sandbox::tools::expanded_size(2048, 2048, Some((16, 9)));
    assert_eq!((w * 4, h * 4), (14_564, 8_192));
    assert!(super::fitted("desired_increase", (w * 4, h * 4), false).is_ok());
    let line = |width| {
        let shape = Shape {
            width,
            height: 1,
            alpha: false,
        };
        rows::encode(shape, Weight::Flat, |sink| {
            sink.row(&vec![200; width as usize * 4])
        })
        .expect("a PNG")
    };
    let x4 = ToolParams::Upscale {
        desired_increase: Increase::X4,
    };
    let widest = apply(&line(4096), &x4, true, Weight::Flat).expect("16384 a side");
    assert_eq!(rows::shape(&widest).expect("a PNG").width, 16_384);
    let refused = apply(&line(4097), &x4, true, Weight::Flat).expect_err("past 16384");
    assert_eq!(
        (refused.field.as_str(), refused.message.as_str()),
        (
            "desired_increase",
            "the result would be 16388x4 pixels; the sandbox stops at 16384 per side"
        )
    );
}
