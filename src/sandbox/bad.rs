//! Bad images on request, for the checks to catch: a flat frame, a cut-out that removed
//! nothing, an edit that came back at its input's size, a generation whose images are all the
//! same. Each is a probability per paid call (per image for a flat frame), drawn from the
//! faults' seeded dice when the call comes in, so a run replays with the same seed. The call is
//! billed as usual: a bad image is the service's answer, not an error.

use crate::api::types::ToolParams;
use crate::sandbox::images::Weight;
use crate::sandbox::rows::{self, Unreadable};
use crate::sandbox::state::State;

/// Probabilities (0.0 to 1.0) of each kind of bad image.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BadImages {
    /// Each image of a call comes back one flat colour, at its right size.
    pub blank: f64,
    /// remove_background returns its input: nothing is transparent.
    pub opaque_cutout: f64,
    /// upscale and expand return their input: the size is the input's.
    pub wrong_size: f64,
    /// A generation of two or more images returns the first one each time.
    pub duplicate: f64,
}

/// What spoils one call's images, drawn when the call comes in.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Spoil {
    /// Per image: comes back flat.
    blank: Vec<bool>,
    /// The tool's input comes back instead of its result.
    input: bool,
    /// Every image is the first.
    duplicate: bool,
}

impl Spoil {
    /// Draws what spoils a generation of `n` images.
    pub(super) fn generation(state: &State, n: u8) -> Spoil {
        let bad = state.config.bad_images;
        Spoil {
            duplicate: n > 1 && state.dice.chance(bad.duplicate),
            blank: (0..n).map(|_| state.dice.chance(bad.blank)).collect(),
            input: false,
        }
    }

    /// Draws what spoils a tool's one image.
    pub(super) fn tool(state: &State, params: &ToolParams) -> Spoil {
        let bad = state.config.bad_images;
        let input = match params {
            ToolParams::RemoveBackground => state.dice.chance(bad.opaque_cutout),
            ToolParams::Upscale { .. } | ToolParams::Expand { .. } => {
                state.dice.chance(bad.wrong_size)
            }
            ToolParams::Erase { .. } => false,
        };
        Spoil {
            blank: vec![state.dice.chance(bad.blank)],
            input,
            duplicate: false,
        }
    }

    /// Whether the tool's input comes back instead of its result.
    pub(super) fn returns_input(&self) -> bool {
        self.input
    }

    /// The images as spoilt: duplicated, then flattened where drawn.
    pub(super) fn apply(
        &self,
        mut images: Vec<Vec<u8>>,
        weight: Weight,
    ) -> Result<Vec<Vec<u8>>, Unreadable> {
        if self.duplicate
            && let Some(first) = images.first().cloned()
        {
            images.iter_mut().for_each(|image| image.clone_from(&first));
        }
        for (image, blank) in images.iter_mut().zip(&self.blank) {
            if *blank {
                *image = flat_like(image, weight)?;
            }
        }
        Ok(images)
    }
}

/// A flat dark frame of `png`'s size and layout.
fn flat_like(png: &[u8], weight: Weight) -> Result<Vec<u8>, Unreadable> {
    let shape = rows::shape(png)?;
    let row: Vec<u8> = [24, 24, 24, u8::MAX].repeat(shape.width as usize);
    let encoded = rows::encode(shape, weight, |sink| {
        (0..shape.height).try_for_each(|_| sink.row(&row))
    })?;
    Ok(encoded)
}
