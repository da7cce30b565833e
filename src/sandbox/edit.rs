//! What a paid call does to pixels: draws a generation's images or applies a tool to its
//! input, as PNG bytes, row by row. Runs on blocking threads; nothing here touches the books.

use url::Url;

use crate::api::rules::InvalidField;
use crate::api::types::ToolParams;
use crate::sandbox::cutout;
use crate::sandbox::images::{self, EDIT_GRAIN, Weight, fnv1a};
use crate::sandbox::rows::{self, Shape, Sink, Unreadable};
use crate::sandbox::state::SAMPLE_HOST;
use crate::sandbox::tools::{Erase, Expand, Upscale, expanded_size};

/// The largest side the sandbox will produce; beyond it a call is refused before billing. The
/// service states no limit, and its own sizes compose past 8192: the sample pipeline's chain
/// (a 2K image expanded to 16:9, then upscaled 4×) makes 14,564 × 8,192, and a 4K image
/// upscaled 4× makes 16,384 a side. Edits stream their rows, so the sandbox's memory per call
/// is a few rows, two bits a pixel for background removal, and the image's compressed bytes.
pub(crate) const MAX_SIDE: u32 = 16_384;

/// Folds `text` into `seed` (FNV-1a), so references steer what a generation draws.
pub(super) fn mix(seed: u64, text: &str) -> u64 {
    text.bytes().fold(seed ^ 0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

pub(super) fn draw_all(
    prompt: &str,
    n: u8,
    reference_seed: u64,
    side: u32,
    weight: Weight,
) -> Vec<Vec<u8>> {
    (0..u32::from(n))
        .map(|i| images::generation_png(prompt, i, reference_seed, side, weight))
        .collect()
}

/// Applies a tool. With `keep_alpha` false the result is flattened onto white, except for
/// remove_background, whose whole point is transparency.
pub(super) fn apply(
    input: &[u8],
    params: &ToolParams,
    keep_alpha: bool,
    weight: Weight,
) -> Result<Vec<u8>, InvalidField> {
    let shape = rows::shape(input).map_err(unreadable)?;
    let (w, h) = (shape.width, shape.height);
    let alpha = shape.alpha && keep_alpha;
    let grain = weight.grain(fnv1a(&[format!("{params:?}").as_bytes()]), EDIT_GRAIN);
    let encoded = match params {
        ToolParams::RemoveBackground => {
            return cutout::remove_background(input, shape, weight).map_err(unreadable);
        }
        ToolParams::Upscale { desired_increase } => {
            let factor = desired_increase.factor();
            let size = (w.saturating_mul(factor), h.saturating_mul(factor));
            let out = fitted("desired_increase", size, alpha)?;
            edit(input, out, weight, |sink| {
                Box::new(Upscale::new(sink, factor, grain))
            })
        }
        ToolParams::Expand {
            aspect_ratio,
            prompt,
        } => {
            let ratio = aspect_ratio.map(|r| (r.width(), r.height()));
            let out = fitted("aspect_ratio", expanded_size(w, h, ratio), alpha)?;
            edit(input, out, weight, |sink| {
                Box::new(Expand::new(sink, (w, h), ratio, prompt.as_deref(), grain))
            })
        }
        ToolParams::Erase { object_name } => {
            let out = Shape { alpha, ..shape };
            edit(input, out, weight, |sink| {
                Box::new(Erase::new(sink, (w, h), object_name, grain))
            })
        }
    };
    encoded.map_err(unreadable)
}

/// Reads `input` row by row through the filter `make` builds in front of an encoder of `out`.
fn edit(
    input: &[u8],
    out: Shape,
    weight: Weight,
    make: impl for<'a> FnOnce(&'a mut dyn Sink) -> Box<dyn Sink + 'a>,
) -> Result<Vec<u8>, Unreadable> {
    let mut read = Ok(());
    let png = rows::encode(out, weight, |sink| {
        let mut filter = make(sink);
        read = rows::read(input, |_, rgba| filter.row(rgba));
        Ok(())
    });
    read?;
    Ok(png?)
}

pub(super) fn unreadable(e: Unreadable) -> InvalidField {
    InvalidField::new(
        "image_url",
        format!("is not a PNG the sandbox can read ({e})"),
    )
}

/// The shape of a result of `width × height`, refused (naming `field`, what asked for that
/// size) past [`MAX_SIDE`].
fn fitted(field: &str, (width, height): (u32, u32), alpha: bool) -> Result<Shape, InvalidField> {
    if width.max(height) > MAX_SIDE {
        return Err(InvalidField::new(
            field,
            format!(
                "the result would be {width}x{height} pixels; the sandbox stops at {MAX_SIDE} per side"
            ),
        ));
    }
    Ok(Shape {
        width,
        height,
        alpha,
    })
}

/// How to name an image the sandbox can edit, for error messages.
pub(super) fn sample_hint(base: &Url) -> String {
    format!("e.g. https://{SAMPLE_HOST}/assets/mug.png or {base}assets/mug.png")
}

#[cfg(test)]
mod tests;
