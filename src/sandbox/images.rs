//! Deterministic pictures and real pixel transforms for the sandbox emulator.
//!
//! The sandbox stands in for a paid image API, so its outputs must be genuine PNGs whose
//! dimensions and alpha channel behave like the real service's: tests assert on them. Nothing
//! here is random; every variation comes from an FNV-1a hash of the request's inputs, so the
//! same request always yields byte-identical pixels.

use std::{borrow::Cow, io::Cursor};

pub use image::DynamicImage;
use image::{
    GenericImageView, ImageBuffer, ImageFormat, Pixel, Rgb, RgbImage, RgbaImage,
    imageops::FilterType,
};

/// How far, per channel, a colour may lie from the colours on the border and still be
/// background. Sandbox backdrops are light (every channel 160 or more; an `expand` tint moves
/// them at most 51 towards its colour), subjects dark (64 or less) and objects vivid (one
/// channel 60 or less): a gradient's colour is within 48 of one of its ends, a subject at least
/// 64 from any backdrop colour.
const BACKGROUND_DISTANCE: usize = 48;
/// Colours are compared in cells of this many levels per channel, so the test is a table look-up:
/// a colour within [`BACKGROUND_DISTANCE`] of a border colour always counts, one more than
/// `BACKGROUND_DISTANCE + CELL - 1` away never does.
const CELL: usize = 8;
const CELLS: usize = 256 / CELL;

/// FNV-1a over several fields; a 0xFF separator (never valid UTF-8) keeps `("ab", "c")` and
/// `("a", "bc")` apart.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325_u64;
    for part in parts {
        for &byte in part.iter().chain(std::iter::once(&0xff)) {
            hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    hash
}

/// SplitMix64 stream from one hash, so each feature of a picture gets its own value.
struct Dice(u64);

impl Dice {
    /// Uniform-ish value in `lo..=hi`.
    fn roll(&mut self, lo: u32, hi: u32) -> u32 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        lo + (z % (u64::from(hi - lo) + 1)) as u32
    }

    fn colour(&mut self, lo: u8, hi: u8) -> [u8; 3] {
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
fn lerp<const N: usize>(a: [u8; N], b: [u8; N], num: i64, den: i64) -> [u8; N] {
    std::array::from_fn(|i| {
        let (a, b) = (i64::from(a[i]), i64::from(b[i]));
        (a + (b - a) * num / den.max(1)) as u8
    })
}

/// Picture of what a generation request "asked for": the real API returns one image per
/// index, so the index and the reference images' seed take part in the hash with the prompt.
pub fn draw_generation(prompt: &str, index: u32, reference_seed: u64, side: u32) -> DynamicImage {
    let seed = fnv1a(&[
        b"generation",
        prompt.as_bytes(),
        &index.to_le_bytes(),
        &reference_seed.to_le_bytes(),
    ]);
    draw_scene(seed, side)
}

/// Built-in sample assets look like generations so every transform works on them too.
pub fn draw_sample(name: &str, side: u32) -> DynamicImage {
    draw_scene(fnv1a(&[b"sample", name.as_bytes()]), side)
}

/// Light gradient background, a dark sharp-edged circle in the centre and a vivid rectangle
/// overlapping it: enough structure for background removal and erasing to have real effects.
fn draw_scene(seed: u64, side: u32) -> DynamicImage {
    let side = side.max(1);
    let mut dice = Dice(seed);
    let (top, bottom) = (dice.colour(160, 255), dice.colour(160, 255));
    let diagonal = dice.roll(0, 1) == 1;
    let (subject, object) = (dice.colour(0, 64), dice.vivid());
    let (centre, radius) = (side / 2, side / 4);
    // Rectangle centre stays within ~0.99 radius of the centre, so it always overlaps the circle.
    let reach = radius * 7 / 10;
    let [ox, oy] = [(); 2].map(|()| centre - reach + dice.roll(0, 2 * reach));
    let [half_w, half_h] = [(); 2].map(|()| dice.roll(side / 16, side / 8));
    // Background colour by (x + y) or 2y, precomputed so drawing 4K stays cheap unoptimised.
    let span = 2 * i64::from(side - 1);
    let ramp: Vec<Rgb<u8>> = (0..=span)
        .map(|t| Rgb(lerp(top, bottom, t, span)))
        .collect();
    RgbImage::from_fn(side, side, |x, y| {
        let (dx, dy) = (u64::from(x.abs_diff(centre)), u64::from(y.abs_diff(centre)));
        if x.abs_diff(ox) <= half_w && y.abs_diff(oy) <= half_h {
            Rgb(object)
        } else if dx * dx + dy * dy <= u64::from(radius) * u64::from(radius) {
            Rgb(subject)
        } else {
            ramp[if diagonal { x + y } else { 2 * y } as usize]
        }
    })
    .into()
}

/// Upscaling must change real dimensions (clients check them). Integer factors make
/// nearest-neighbour a plain pixel replication, far faster than `imageops::resize` on
/// 8K outputs, and its sharp edges keep later background removal exact.
pub fn upscale(img: &DynamicImage, factor: u32) -> DynamicImage {
    let factor = factor.max(1);
    let (w, h) = (img.width() * factor, img.height() * factor);
    match img {
        DynamicImage::ImageRgb8(buf) => replicate(buf, factor).into(),
        DynamicImage::ImageRgba8(buf) => replicate(buf, factor).into(),
        _ => img.resize_exact(w, h, FilterType::Nearest),
    }
}

fn replicate<P: Pixel<Subpixel = u8>>(
    src: &ImageBuffer<P, Vec<u8>>,
    factor: u32,
) -> ImageBuffer<P, Vec<u8>> {
    let (w, h, f) = (src.width(), src.height(), factor as usize);
    let channels = usize::from(P::CHANNEL_COUNT);
    let mut out = Vec::with_capacity(src.as_raw().len() * f * f);
    for row in src.as_raw().chunks_exact((w as usize * channels).max(1)) {
        let start = out.len();
        for px in row.chunks_exact(channels) {
            (0..f).for_each(|_| out.extend_from_slice(px));
        }
        (1..f).for_each(|_| out.extend_from_within(start..start + row.len() * f));
    }
    ImageBuffer::from_raw(w * factor, h * factor, out).expect("sized for the output")
}

/// Background removal: the background is the region connected to the border whose colours are
/// close to the border's own (a flood fill from the border, by colour distance to the border's
/// colours); it becomes transparent, and whatever it encloses stays as it was. Comparing with
/// the border's colours rather than with each neighbour keeps the fill out of a subject that an
/// edit joined to the backdrop by a smooth ramp (as `erase` does). Returns RGBA8; pixels that
/// were already transparent stay transparent.
pub fn remove_background(img: &DynamicImage) -> DynamicImage {
    let mut rgba = img.to_rgba8();
    let background = flood_from_border(&rgba);
    for (pixel, &is_background) in rgba.pixels_mut().zip(&background) {
        if is_background {
            pixel[3] = 0;
        }
    }
    rgba.into()
}

/// Iterative 4-connected fill (no recursion, so large images cannot overflow the stack).
fn flood_from_border(img: &RgbaImage) -> Vec<bool> {
    let (w, h) = (img.width() as usize, img.height() as usize);
    let mut seen = vec![false; w * h];
    if w == 0 || h == 0 {
        return seen;
    }
    let px = img.as_raw();
    let colour = |i: usize| [px[4 * i], px[4 * i + 1], px[4 * i + 2]];
    let columns = (0..w).flat_map(|x| [x, (h - 1) * w + x]);
    let mut stack: Vec<usize> = columns
        .chain((0..h).flat_map(|y| [y * w, y * w + w - 1]))
        .collect();
    let backdrop = Backdrop::of(stack.iter().map(|&i| colour(i)));
    stack.iter().for_each(|&i| seen[i] = true);
    while let Some(i) = stack.pop() {
        let (x, y) = (i % w, i / w);
        let neighbours = [
            (x > 0).then(|| i - 1),
            (x + 1 < w).then_some(i + 1),
            (y > 0).then(|| i - w),
            (y + 1 < h).then_some(i + w),
        ];
        for n in neighbours.into_iter().flatten() {
            if !seen[n] && backdrop.contains(colour(n)) {
                seen[n] = true;
                stack.push(n);
            }
        }
    }
    seen
}

/// The colours near those of a picture's border, as a table of colour cells.
struct Backdrop {
    cells: Vec<bool>,
}

impl Backdrop {
    fn of(colours: impl Iterator<Item = [u8; 3]>) -> Backdrop {
        let mut cells = vec![false; CELLS * CELLS * CELLS];
        for c in colours {
            cells[Self::cell(c)] = true;
        }
        // Grow the set by the distance along each axis in turn: a cell is marked when some
        // border cell is within `reach` cells of it on every axis.
        let reach = BACKGROUND_DISTANCE / CELL;
        for stride in [1, CELLS, CELLS * CELLS] {
            let before = cells.clone();
            for (i, marked) in cells.iter_mut().enumerate() {
                let at = (i / stride) % CELLS;
                let lo = at.saturating_sub(reach);
                let hi = (at + reach).min(CELLS - 1);
                *marked = (lo..=hi).any(|k| before[i - at * stride + k * stride]);
            }
        }
        Backdrop { cells }
    }

    fn cell([r, g, b]: [u8; 3]) -> usize {
        let [r, g, b] = [r, g, b].map(|c| usize::from(c) / CELL);
        (r * CELLS + g) * CELLS + b
    }

    fn contains(&self, colour: [u8; 3]) -> bool {
        self.cells[Self::cell(colour)]
    }
}

/// Runs an RGBA transform but hands back the input's kind (RGB8 in, RGB8 out), because
/// callers rely on transforms not inventing or dropping an alpha channel.
fn map_rgba(img: &DynamicImage, f: impl FnOnce(RgbaImage) -> RgbaImage) -> DynamicImage {
    let out = DynamicImage::ImageRgba8(f(img.to_rgba8()));
    if has_alpha(img) {
        out
    } else {
        out.to_rgb8().into()
    }
}

/// Outpainting: the canvas grows to the requested ratio (or 1.25× without one), the image is
/// centred and the new area repeats the nearest edge pixel, tinted by the prompt if any, so
/// different prompts visibly produce different fills.
pub fn expand(
    img: &DynamicImage,
    aspect_ratio: Option<(u32, u32)>,
    prompt: Option<&str>,
) -> DynamicImage {
    let (w, h) = img.dimensions();
    if w == 0 || h == 0 {
        return img.clone();
    }
    let (cw, ch) = expanded_size(w, h, aspect_ratio);
    let (ox, oy) = ((cw - w) / 2, (ch - h) / 2);
    let tint = prompt.map(|p| Dice(fnv1a(&[b"tint", p.as_bytes()])).colour(0, 255));
    map_rgba(img, |src| {
        RgbaImage::from_fn(cw, ch, |x, y| {
            let (sx, sy) = (x.saturating_sub(ox), y.saturating_sub(oy));
            let mut p = *src.get_pixel(sx.min(w - 1), sy.min(h - 1));
            let outside = x < ox || y < oy || sx >= w || sy >= h;
            if let (true, Some(t)) = (outside, tint) {
                let [r, g, b] = lerp([p[0], p[1], p[2]], t, 1, 5);
                p.0 = [r, g, b, p[3]];
            }
            p
        })
    })
}

/// Canvas size for [`expand`]. With a ratio `rw:rh`, the side that already binds is kept and
/// the other is rounded *up*, so the canvas always contains the image and `width * rh`
/// differs from `height * rw` by less than `max(rw, rh)` (exact whenever integers allow).
/// A ratio with a zero term is treated as absent. Without a ratio each side is 1.25×, rounded.
fn expanded_size(w: u32, h: u32, aspect_ratio: Option<(u32, u32)>) -> (u32, u32) {
    let to_u32 = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
    let grow = |v: u32| to_u32((u64::from(v) * 5 + 2) / 4);
    match aspect_ratio {
        Some((rw, rh)) if rw > 0 && rh > 0 => {
            let (w64, h64, rw, rh) = (u64::from(w), u64::from(h), u64::from(rw), u64::from(rh));
            if w64 * rh >= h64 * rw {
                (w, to_u32((w64 * rh).div_ceil(rw)))
            } else {
                (to_u32((h64 * rw).div_ceil(rh)), h)
            }
        }
        _ => (grow(w), grow(h)),
    }
}

/// Object removal: the named object gets a deterministic region, refilled by interpolating
/// each row between its left and right neighbours. The region straddles where sandbox
/// pictures have the subject's edge, so erasing visibly changes them.
pub fn erase(img: &DynamicImage, object_name: &str) -> DynamicImage {
    let (w, h) = img.dimensions();
    if w < 8 || h < 8 {
        return img.clone();
    }
    let (x0, y0, rw, rh) = erase_region(w, h, fnv1a(&[b"erase", object_name.as_bytes()]));
    map_rgba(img, |mut out| {
        for y in y0..y0 + rh {
            let (left, right) = (out.get_pixel(x0 - 1, y).0, out.get_pixel(x0 + rw, y).0);
            for i in 0..rw {
                let filled = lerp(left, right, i64::from(i + 1), i64::from(rw + 1));
                out.get_pixel_mut(x0 + i, y).0 = filled;
            }
        }
        out
    })
}

/// `(x, y, width, height)`: each side between 1/8 and 1/3 of the image's, with a pixel to
/// spare on the left and right for the interpolation; needs `w, h >= 8`.
fn erase_region(w: u32, h: u32, seed: u64) -> (u32, u32, u32, u32) {
    let mut dice = Dice(seed);
    let (rw, rh) = (dice.roll(w / 8, w / 3), dice.roll(h / 8, h / 3));
    let edge_x = [w / 4, w - w / 4][dice.roll(0, 1) as usize];
    let centre_y = h / 2 - h / 8 + dice.roll(0, 2 * (h / 8));
    let x0 = edge_x.saturating_sub(rw / 2).clamp(1, w - 1 - rw);
    let y0 = centre_y.saturating_sub(rh / 2).min(h - rh);
    (x0, y0, rw, rh)
}

/// Drops alpha the way a viewer would show it (over white), for `preserve_alpha = false`.
pub fn flatten(img: &DynamicImage) -> DynamicImage {
    if !has_alpha(img) {
        return img.clone();
    }
    let rgba = img.to_rgba8();
    let over_white = |c: u8, a: u8| {
        let (c, a) = (u32::from(c), u32::from(a));
        ((c * a + 255 * (255 - a) + 127) / 255) as u8
    };
    RgbImage::from_fn(rgba.width(), rgba.height(), |x, y| {
        let [r, g, b, a] = rgba.get_pixel(x, y).0;
        Rgb([r, g, b].map(|c| over_white(c, a)))
    })
    .into()
}

/// PNG bytes in RGB8 or RGBA8 only, so responses have the two layouts clients expect.
pub fn encode_png(img: &DynamicImage) -> Vec<u8> {
    let img = match img {
        DynamicImage::ImageRgb8(_) | DynamicImage::ImageRgba8(_) => Cow::Borrowed(img),
        _ if has_alpha(img) => Cow::Owned(img.to_rgba8().into()),
        _ => Cow::Owned(img.to_rgb8().into()),
    };
    let mut bytes = Vec::new();
    img.write_to(Cursor::new(&mut bytes), ImageFormat::Png)
        .expect("encoding an RGB8/RGBA8 image into a Vec cannot fail");
    bytes
}

/// Decodes uploads; errors are returned because uploaded bytes are untrusted.
pub fn decode_png(bytes: &[u8]) -> Result<DynamicImage, image::ImageError> {
    image::load_from_memory_with_format(bytes, ImageFormat::Png)
}

/// Whether the picture can carry transparency (the type's, not whether any pixel is clear).
pub fn has_alpha(img: &DynamicImage) -> bool {
    img.color().has_alpha()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_is_deterministic_and_varies_with_inputs() {
        let a = draw_generation("a cat", 0, 7, 64);
        assert!(matches!(a, DynamicImage::ImageRgb8(_)) && a.dimensions() == (64, 64));
        assert_eq!(a.as_bytes(), draw_generation("a cat", 0, 7, 64).as_bytes());
        for other in [("a dog", 0, 7), ("a cat", 1, 7), ("a cat", 0, 8)] {
            let b = draw_generation(other.0, other.1, other.2, 64);
            assert_ne!(a.as_bytes(), b.as_bytes());
        }
        assert_eq!(draw_sample("x", 32), draw_sample("x", 32));
    }

    #[test]
    fn upscale_multiplies_sides_and_keeps_alpha() {
        let img = draw_generation("p", 0, 0, 40);
        let double = upscale(&img, 2);
        assert_eq!(double.dimensions(), (80, 80));
        assert_eq!(double.get_pixel(21, 11), img.get_pixel(10, 5));
        assert_eq!(upscale(&img, 4).dimensions(), (160, 160));
        assert!(has_alpha(&upscale(&remove_background(&img), 2)));
    }

    #[test]
    fn remove_background_clears_border_and_keeps_subject() {
        let images = [
            draw_generation("a cat", 3, 1, 128),
            draw_sample("shoe", 100),
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

    /// The sample pipeline's chain: erase, expand to 16:9 with a prompt, upscale 4×, cut out.
    /// The subject (the dark circle in the middle, with the object over it) stays opaque.
    #[test]
    fn remove_background_keeps_the_subject_at_the_end_of_a_chain() {
        let subjects = [
            ("a ceramic coffee mug", "the price sticker"),
            ("a brass desk lamp", "the power cable"),
            ("an oak dining chair", "the floor scuff"),
        ];
        for (subject, object) in subjects {
            let prompt = format!("Studio photo of {subject} on a white backdrop");
            for index in 0..2 {
                let shot = draw_generation(&prompt, index, 0, 64);
                let wide = expand(
                    &erase(&shot, object),
                    Some((16, 9)),
                    Some("extend the backdrop"),
                );
                let out = remove_background(&upscale(&wide, 4)).to_rgba8();
                let (w, h) = out.dimensions();
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
                    "{subject} {index}: {opaque} of {} centre pixels opaque",
                    centre.len()
                );
                let border = (0..w)
                    .flat_map(|x| [(x, 0), (x, h - 1)])
                    .chain((0..h).flat_map(|y| [(0, y), (w - 1, y)]));
                for (x, y) in border {
                    assert_eq!(out.get_pixel(x, y)[3], 0, "{subject} {index}: ({x}, {y})");
                }
            }
        }
    }

    #[test]
    fn expand_contains_the_centred_input_and_keeps_colour_type() {
        let img = draw_generation("p", 0, 0, 90);
        let out = expand(&img, Some((16, 9)), Some("sea"));
        assert_eq!(out.dimensions(), (160, 90));
        assert_eq!(out.crop_imm(35, 0, 90, 90), img);
        let (w, h) = expand(&upscale(&img, 2), Some((16, 9)), None).dimensions();
        assert!(w >= 180 && h == 180 && (w * 9).abs_diff(h * 16) < 16);
        assert_eq!(expand(&img, Some((1, 2)), None).dimensions(), (90, 180));
        let rgba = remove_background(&img);
        let grown = expand(&rgba, None, None);
        assert!(grown.dimensions() == (113, 113) && has_alpha(&grown));
        assert_eq!(grown.crop_imm(11, 11, 90, 90), rgba);
        assert_ne!(grown, expand(&rgba, None, Some("forest")));
    }

    #[test]
    fn erase_keeps_size_and_changes_a_region() {
        let img = draw_generation("a cat", 0, 0, 120);
        for name in ["hat", "car", "tree", "person"] {
            let out = erase(&img, name);
            assert!(matches!(out, DynamicImage::ImageRgb8(_)));
            assert_eq!(out.dimensions(), img.dimensions());
            assert_ne!(out, img, "{name}");
            assert_eq!(out.get_pixel(0, 0), img.get_pixel(0, 0));
            assert_eq!(out, erase(&img, name));
        }
    }

    #[test]
    fn flatten_and_png_round_trip_keep_the_expected_colour_types() {
        let rgb = draw_generation("p", 0, 0, 32);
        let rgba = remove_background(&rgb);
        let flat = flatten(&rgba);
        assert!(matches!(flat, DynamicImage::ImageRgb8(_)) && flatten(&rgb) == rgb);
        assert_eq!(flat.get_pixel(0, 0).0, [255; 4]);
        assert_eq!(flat.get_pixel(16, 16), rgb.get_pixel(16, 16));
        for img in [rgb, rgba] {
            assert_eq!(decode_png(&encode_png(&img)).expect("own PNG decodes"), img);
        }
        let luma = decode_png(&encode_png(&DynamicImage::new_luma8(4, 4)));
        assert!(matches!(luma, Ok(DynamicImage::ImageRgb8(_))));
        assert!(decode_png(b"not a png").is_err());
    }
}
