//! Background removal in bounded memory: the background is the region connected to the border
//! whose colours are close to the border's own (a flood fill from the border, by colour distance
//! to the border's colours); it becomes transparent, and whatever it encloses stays as it was.
//! Comparing with the border's colours rather than with each neighbour keeps the fill out of a
//! subject that an edit joined to the backdrop by a smooth ramp (as `erase` does).
//!
//! The input is read three times, row by row: its border's colours, then which pixels have a
//! backdrop's colour (one bit each), then, after the fill over those bits, to write the result.
//! Memory is two bits a pixel (30 MB at 14,564 × 8,192) and a few rows, where the pixels whole
//! would be 477 MB.

use crate::sandbox::images::Weight;
use crate::sandbox::rows::{self, Shape, Unreadable};

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

/// RGBA PNG of `input` (of `shape`) with its background transparent; pixels that were already
/// transparent stay transparent.
pub(crate) fn remove_background(
    input: &[u8],
    shape: Shape,
    weight: Weight,
) -> Result<Vec<u8>, Unreadable> {
    let (w, h) = (shape.width as usize, shape.height as usize);
    let backdrop = Backdrop::of(&border_colours(input, shape)?);
    let mut candidates = Bits::new(w * h);
    rows::read(input, |y, rgba| {
        for (x, px) in rgba.chunks_exact(4).enumerate() {
            if backdrop.contains([px[0], px[1], px[2]]) {
                candidates.set(y as usize * w + x);
            }
        }
        Ok(())
    })?;
    let background = flood_from_border(&candidates, w, h);
    drop(candidates);
    let out = Shape {
        alpha: true,
        ..shape
    };
    let mut read = Ok(());
    let png = rows::encode(out, weight, |sink| {
        let mut line = Vec::with_capacity(w * 4);
        read = rows::read(input, |y, rgba| {
            line.clear();
            line.extend_from_slice(rgba);
            for (x, px) in line.chunks_exact_mut(4).enumerate() {
                if background.get(y as usize * w + x) {
                    px[3] = 0;
                }
            }
            sink.row(&line)
        });
        Ok(())
    });
    read?;
    png.map_err(Unreadable::from)
}

/// The colours of the image's outermost pixels.
fn border_colours(input: &[u8], shape: Shape) -> Result<Vec<[u8; 3]>, Unreadable> {
    let last = shape.height.saturating_sub(1);
    let mut colours = Vec::new();
    rows::read(input, |y, rgba| {
        let mut pixels = rgba.chunks_exact(4).map(|p| [p[0], p[1], p[2]]);
        if y == 0 || y == last {
            colours.extend(pixels);
        } else {
            colours.extend(pixels.next());
            colours.extend(pixels.next_back());
        }
        Ok(())
    })?;
    Ok(colours)
}

/// One bit per pixel.
struct Bits(Vec<u64>);

impl Bits {
    fn new(len: usize) -> Bits {
        Bits(vec![0; len.div_ceil(64)])
    }

    fn get(&self, i: usize) -> bool {
        self.0[i / 64] >> (i % 64) & 1 == 1
    }

    fn set(&mut self, i: usize) {
        self.0[i / 64] |= 1 << (i % 64);
    }
}

/// Every border pixel, and every candidate 4-connected to one through candidates. A scanline
/// fill: the stack holds one seed per run of a row met, not one per pixel, so it stays small.
fn flood_from_border(candidates: &Bits, w: usize, h: usize) -> Bits {
    let mut seen = Bits::new(w * h);
    if w == 0 || h == 0 {
        return seen;
    }
    let mut stack: Vec<(usize, usize)> = (0..w)
        .flat_map(|x| [(x, 0), (x, h - 1)])
        .chain((0..h).flat_map(|y| [(0, y), (w - 1, y)]))
        .collect();
    stack.iter().for_each(|&(x, y)| seen.set(y * w + x));
    let open = |seen: &Bits, x: usize, y: usize| {
        let i = y * w + x;
        candidates.get(i) && !seen.get(i)
    };
    while let Some((x, y)) = stack.pop() {
        let (mut left, mut right) = (x, x);
        while left > 0 && open(&seen, left - 1, y) {
            left -= 1;
            seen.set(y * w + left);
        }
        while right + 1 < w && open(&seen, right + 1, y) {
            right += 1;
            seen.set(y * w + right);
        }
        let rows = [y.checked_sub(1), (y + 1 < h).then_some(y + 1)];
        for ny in rows.into_iter().flatten() {
            let mut in_run = false;
            for nx in left..=right {
                if !open(&seen, nx, ny) {
                    in_run = false;
                } else if !in_run {
                    seen.set(ny * w + nx);
                    stack.push((nx, ny));
                    in_run = true;
                }
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
    fn of(colours: &[[u8; 3]]) -> Backdrop {
        let mut cells = vec![false; CELLS * CELLS * CELLS];
        for &c in colours {
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
