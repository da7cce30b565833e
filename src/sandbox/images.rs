//! Deterministic pictures for the sandbox emulator: what a generation draws, the built-in
//! samples, and the grain that gives an image a photo's weight.
//!
//! The sandbox stands in for a paid image API, so its outputs must be genuine PNGs whose
//! dimensions and alpha channel behave like the real service's: tests assert on them. Nothing
//! here is random; every variation comes from an FNV-1a hash of the request's inputs, so the
//! same request always yields byte-identical pixels.

use std::ops::Range;

use crate::sandbox::rows::{self, Shape};

/// How much the sandbox's images weigh. Flat pictures (a gradient, a disc, a rectangle)
/// compress to almost nothing: a 2048-px PNG is 80 to 200 KB, and tests stay fast. A photo's
/// grain on top of them does not compress: a 2048-px PNG is several MB and an upscaled
/// 8192-px one tens of MB, as photos are, so downloads, hashing and uploads see real volumes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Weight {
    #[default]
    Flat,
    Photo,
}

/// The grain of a generated picture, in levels either way per channel.
const GENERATED_GRAIN: u8 = 2;
/// The grain an edit adds to the pixels it makes. Grains add up along a chain (a generation,
/// then an erase or expand, then an upscale: at most 2 + 1 + 1 levels), and background removal
/// tells a subject from its backdrop by 64 levels with 8 to spare: 4 either way fits.
pub(crate) const EDIT_GRAIN: u8 = 1;

impl Weight {
    /// Photo-weight images are made in bulk, so they are encoded for speed: fdeflate's fast
    /// mode compresses noise as well as the balanced one does, many times faster.
    pub(crate) fn compression(self) -> png::Compression {
        match self {
            Weight::Flat => png::Compression::Balanced,
            Weight::Photo => png::Compression::Fast,
        }
    }

    /// The grain an image of this weight gets from `seed` (none when flat).
    pub(crate) fn grain(self, seed: u64, amplitude: u8) -> Option<Grain> {
        (self == Weight::Photo).then_some(Grain { seed, amplitude })
    }
}

/// Noise added to pixels, a function of a seed and each pixel's place only.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Grain {
    seed: u64,
    amplitude: u8,
}

impl Grain {
    /// Adds the grain to the pixels of `rgba`, line `y` of its image, at `columns`.
    pub(crate) fn add(&self, y: u32, columns: Range<u32>, rgba: &mut [u8]) {
        let amplitude = i16::from(self.amplitude);
        let levels = 2 * u64::from(self.amplitude) + 1;
        for x in columns {
            let z = splitmix(self.seed ^ (u64::from(y) << 32 | u64::from(x)));
            let at = 4 * x as usize;
            for (i, c) in rgba[at..at + 3].iter_mut().enumerate() {
                let d = ((z >> (16 * i)) & 0xffff) % levels;
                *c = (i16::from(*c) + d as i16 - amplitude).clamp(0, 255) as u8;
            }
        }
    }
}

/// FNV-1a over several fields; a 0xFF separator (never valid UTF-8) keeps `("ab", "c")` and
/// `("a", "bc")` apart.
pub(crate) fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325_u64;
    for part in parts {
        for &byte in part.iter().chain(std::iter::once(&0xff)) {
            hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    hash
}

/// SplitMix64's finaliser: every bit of the input moves about half of the output's.
fn splitmix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// SplitMix64 stream from one hash, so each feature of a picture gets its own value.
pub(crate) struct Dice(pub(crate) u64);

impl Dice {
    /// Uniform-ish value in `lo..=hi`.
    pub(crate) fn roll(&mut self, lo: u32, hi: u32) -> u32 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        lo + (splitmix(self.0) % (u64::from(hi - lo) + 1)) as u32
    }

    pub(crate) fn colour(&mut self, lo: u8, hi: u8) -> [u8; 3] {
        [(); 3].map(|()| self.roll(lo.into(), hi.into()) as u8)
    }

    /// Saturated colour (one channel high, one low) that stands out from both the light
    /// background and the dark subject.
    fn vivid(&mut self) -> [u8; 3] {
        let mut colour = [(200, 255), (0, 60), (0, 255)].map(|(lo, hi)| self.roll(lo, hi) as u8);
        colour.rotate_left(self.roll(0, 2) as usize);
        colour
    }
}

/// Linear interpolation `a + (b - a) * num / den` per channel.
pub(crate) fn lerp<const N: usize>(a: [u8; N], b: [u8; N], num: i64, den: i64) -> [u8; N] {
    std::array::from_fn(|i| {
        let (a, b) = (i64::from(a[i]), i64::from(b[i]));
        (a + (b - a) * num / den.max(1)) as u8
    })
}

/// PNG of what a generation request "asked for": the real API returns one image per index, so
/// the index and the reference images' seed take part in the hash with the prompt.
pub fn generation_png(
    prompt: &str,
    index: u32,
    reference_seed: u64,
    side: u32,
    weight: Weight,
) -> Vec<u8> {
    let seed = fnv1a(&[
        b"generation",
        prompt.as_bytes(),
        &index.to_le_bytes(),
        &reference_seed.to_le_bytes(),
    ]);
    scene_png(seed, side, weight)
}

/// Built-in sample assets look like generations so every transform works on them too.
pub fn sample_png(name: &str, side: u32, weight: Weight) -> Vec<u8> {
    scene_png(fnv1a(&[b"sample", name.as_bytes()]), side, weight)
}

fn scene_png(seed: u64, side: u32, weight: Weight) -> Vec<u8> {
    let scene = Scene::new(seed, side.max(1));
    let grain = weight.grain(seed, GENERATED_GRAIN);
    let shape = Shape {
        width: scene.side,
        height: scene.side,
        alpha: false,
    };
    rows::encode(shape, weight, |sink| {
        let mut row = vec![u8::MAX; scene.side as usize * 4];
        for y in 0..scene.side {
            scene.row(y, &mut row);
            if let Some(grain) = grain {
                grain.add(y, 0..scene.side, &mut row);
            }
            sink.row(&row)?;
        }
        Ok(())
    })
    .expect("encoding into memory cannot fail")
}

/// Light gradient background, a dark sharp-edged circle in the centre and a vivid rectangle
/// overlapping it: enough structure for background removal and erasing to have real effects.
struct Scene {
    side: u32,
    diagonal: bool,
    subject: [u8; 3],
    object: [u8; 3],
    centre: u32,
    radius: u32,
    /// The rectangle's centre and half sides.
    ox: u32,
    oy: u32,
    half_w: u32,
    half_h: u32,
    /// Background colour by (x + y) or 2y, precomputed so drawing 4K stays cheap unoptimised.
    ramp: Vec<[u8; 3]>,
}

impl Scene {
    fn new(seed: u64, side: u32) -> Scene {
        let mut dice = Dice(seed);
        let (top, bottom) = (dice.colour(160, 255), dice.colour(160, 255));
        let diagonal = dice.roll(0, 1) == 1;
        let (subject, object) = (dice.colour(0, 64), dice.vivid());
        let (centre, radius) = (side / 2, side / 4);
        // Rectangle centre stays within ~0.99 radius of the centre, so it always overlaps the
        // circle.
        let reach = radius * 7 / 10;
        let [ox, oy] = [(); 2].map(|()| centre - reach + dice.roll(0, 2 * reach));
        let [half_w, half_h] = [(); 2].map(|()| dice.roll(side / 16, side / 8));
        let span = 2 * i64::from(side - 1);
        let ramp = (0..=span).map(|t| lerp(top, bottom, t, span)).collect();
        Scene {
            side,
            diagonal,
            subject,
            object,
            centre,
            radius,
            ox,
            oy,
            half_w,
            half_h,
            ramp,
        }
    }

    /// Line `y` as RGBA into `rgba` (whose alpha stays as it is: opaque).
    fn row(&self, y: u32, rgba: &mut [u8]) {
        let dy = u64::from(y.abs_diff(self.centre));
        let r2 = u64::from(self.radius) * u64::from(self.radius);
        let in_object_rows = y.abs_diff(self.oy) <= self.half_h;
        for (x, px) in (0..self.side).zip(rgba.chunks_exact_mut(4)) {
            let dx = u64::from(x.abs_diff(self.centre));
            let colour = if in_object_rows && x.abs_diff(self.ox) <= self.half_w {
                self.object
            } else if dx * dx + dy * dy <= r2 {
                self.subject
            } else {
                self.ramp[if self.diagonal { x + y } else { 2 * y } as usize]
            };
            px[..3].copy_from_slice(&colour);
        }
    }
}
