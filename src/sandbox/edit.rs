//! What a paid call does to pixels: draws a generation's images or applies a tool to its
//! input, as PNG bytes. Runs on blocking threads; nothing here touches the books.

use url::Url;

use crate::api::rules::InvalidField;
use crate::api::types::ToolParams;
use crate::sandbox::images;
use crate::sandbox::state::SAMPLE_HOST;

/// The largest side the sandbox will produce; beyond it a call is refused before billing,
/// rather than spending gigabytes of memory on one image.
pub(super) const MAX_SIDE: u32 = 8192;

/// Folds `text` into `seed` (FNV-1a), so references steer what a generation draws.
pub(super) fn mix(seed: u64, text: &str) -> u64 {
    text.bytes().fold(seed ^ 0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

pub(super) fn draw_all(prompt: &str, n: u8, reference_seed: u64, side: u32) -> Vec<Vec<u8>> {
    (0..u32::from(n))
        .map(|i| images::encode_png(&images::draw_generation(prompt, i, reference_seed, side)))
        .collect()
}

/// Applies a tool. With `keep_alpha` false the result is flattened onto white, except for
/// remove_background, whose whole point is transparency.
pub(super) fn apply(
    input: &[u8],
    params: &ToolParams,
    keep_alpha: bool,
) -> Result<Vec<u8>, InvalidField> {
    let img = images::decode_png(input).map_err(|e| {
        InvalidField::new(
            "image_url",
            format!("is not a PNG the sandbox can read ({e})"),
        )
    })?;
    let (w, h) = (img.width(), img.height());
    let out = match params {
        ToolParams::RemoveBackground => images::remove_background(&img),
        ToolParams::Upscale { desired_increase } => {
            let factor = desired_increase.factor();
            too_large(
                "desired_increase",
                w.saturating_mul(factor),
                h.saturating_mul(factor),
            )?;
            images::upscale(&img, factor)
        }
        ToolParams::Expand {
            aspect_ratio,
            prompt,
        } => {
            let ratio = aspect_ratio.map(|r| (r.width(), r.height()));
            let (cw, ch) = match ratio {
                Some((rw, rh)) => (
                    w.max(
                        (u64::from(h) * u64::from(rw))
                            .div_ceil(u64::from(rh))
                            .min(u64::from(u32::MAX)) as u32,
                    ),
                    h.max(
                        (u64::from(w) * u64::from(rh))
                            .div_ceil(u64::from(rw))
                            .min(u64::from(u32::MAX)) as u32,
                    ),
                ),
                None => (w + w / 4 + 1, h + h / 4 + 1),
            };
            too_large("aspect_ratio", cw, ch)?;
            images::expand(&img, ratio, prompt.as_deref())
        }
        ToolParams::Erase { object_name } => images::erase(&img, object_name),
    };
    let out = match params {
        ToolParams::RemoveBackground => out,
        _ if !keep_alpha => images::flatten(&out),
        _ => out,
    };
    Ok(images::encode_png(&out))
}

fn too_large(field: &str, w: u32, h: u32) -> Result<(), InvalidField> {
    if w.max(h) > MAX_SIDE {
        return Err(InvalidField::new(
            field,
            format!("the result would be {w}x{h} pixels; the sandbox stops at {MAX_SIDE} per side"),
        ));
    }
    Ok(())
}

/// How to name an image the sandbox can edit, for error messages.
pub(super) fn sample_hint(base: &Url) -> String {
    format!("e.g. https://{SAMPLE_HOST}/assets/mug.png or {base}assets/mug.png")
}
