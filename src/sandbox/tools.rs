//! Upscale, expand and erase as filters of rows: each takes its input's rows one at a time and
//! hands its own rows on, so an edit's memory is a few rows whatever the image's size. Pixels
//! an edit makes get the grain of the image's weight; pixels it copies keep theirs.

use std::io;

use crate::sandbox::images::{Dice, Grain, fnv1a, lerp};
use crate::sandbox::rows::Sink;

/// Upscaling must change real dimensions (clients check them). Integer factors make
/// nearest-neighbour a plain pixel replication, and its sharp edges keep later background
/// removal exact.
pub(crate) struct Upscale<'s> {
    next: &'s mut dyn Sink,
    factor: u32,
    grain: Option<Grain>,
    y: u32,
    wide: Vec<u8>,
    line: Vec<u8>,
}

impl<'s> Upscale<'s> {
    pub(crate) fn new(next: &'s mut dyn Sink, factor: u32, grain: Option<Grain>) -> Self {
        Upscale {
            next,
            factor: factor.max(1),
            grain,
            y: 0,
            wide: Vec::new(),
            line: Vec::new(),
        }
    }
}

impl Sink for Upscale<'_> {
    fn row(&mut self, rgba: &[u8]) -> io::Result<()> {
        self.wide.clear();
        for px in rgba.chunks_exact(4) {
            (0..self.factor).for_each(|_| self.wide.extend_from_slice(px));
        }
        let width = (self.wide.len() / 4) as u32;
        for _ in 0..self.factor {
            match self.grain {
                Some(grain) => {
                    self.line.clone_from(&self.wide);
                    grain.add(self.y, 0..width, &mut self.line);
                    self.next.row(&self.line)?;
                }
                None => self.next.row(&self.wide)?,
            }
            self.y += 1;
        }
        Ok(())
    }
}

/// Outpainting: the canvas grows to the requested ratio (or 1.25× without one), the image is
/// centred and the new area repeats the nearest edge pixel, tinted by the prompt if any, so
/// different prompts visibly produce different fills.
pub(crate) struct Expand<'s> {
    next: &'s mut dyn Sink,
    /// The input's size, the canvas's, and where the input sits on it.
    size: (u32, u32),
    canvas: (u32, u32),
    offset: (u32, u32),
    tint: Option<[u8; 3]>,
    grain: Option<Grain>,
    /// The input's rows received so far.
    input_y: u32,
    line: Vec<u8>,
}

impl<'s> Expand<'s> {
    pub(crate) fn new(
        next: &'s mut dyn Sink,
        (w, h): (u32, u32),
        aspect_ratio: Option<(u32, u32)>,
        prompt: Option<&str>,
        grain: Option<Grain>,
    ) -> Self {
        let canvas = expanded_size(w, h, aspect_ratio);
        Expand {
            next,
            size: (w, h),
            canvas,
            offset: ((canvas.0 - w) / 2, (canvas.1 - h) / 2),
            tint: prompt.map(|p| Dice(fnv1a(&[b"tint", p.as_bytes()])).colour(0, 255)),
            grain,
            input_y: 0,
            line: Vec::new(),
        }
    }

    /// Line `y` of the canvas from `rgba`, the input's line nearest to it.
    fn emit(&mut self, y: u32, rgba: &[u8]) -> io::Result<()> {
        let ((w, h), (cw, _), (ox, oy)) = (self.size, self.canvas, self.offset);
        let outside_rows = y < oy || y >= oy + h;
        self.line.clear();
        for x in 0..cw {
            let sx = x.saturating_sub(ox).min(w - 1) as usize;
            let mut p: [u8; 4] = rgba[4 * sx..4 * sx + 4].try_into().expect("a pixel");
            if let (true, Some(t)) = (outside_rows || x < ox || x >= ox + w, self.tint) {
                let [r, g, b] = lerp([p[0], p[1], p[2]], t, 1, 5);
                p = [r, g, b, p[3]];
            }
            self.line.extend_from_slice(&p);
        }
        if let Some(grain) = self.grain {
            if outside_rows {
                grain.add(y, 0..cw, &mut self.line);
            } else {
                grain.add(y, 0..ox, &mut self.line);
                grain.add(y, ox + w..cw, &mut self.line);
            }
        }
        self.next.row(&self.line)
    }
}

impl Sink for Expand<'_> {
    /// The rows above the input come with its first row, those below with its last.
    fn row(&mut self, rgba: &[u8]) -> io::Result<()> {
        let ((_, h), (_, ch), (_, oy)) = (self.size, self.canvas, self.offset);
        let y = self.input_y;
        self.input_y += 1;
        if y == 0 {
            for above in 0..oy {
                self.emit(above, rgba)?;
            }
        }
        self.emit(oy + y, rgba)?;
        if y + 1 == h {
            for below in oy + h..ch {
                self.emit(below, rgba)?;
            }
        }
        Ok(())
    }
}

/// Canvas size for [`Expand`]. With a ratio `rw:rh`, the side that already binds is kept and
/// the other is rounded *up*, so the canvas always contains the image and `width * rh`
/// differs from `height * rw` by less than `max(rw, rh)` (exact whenever integers allow).
/// A ratio with a zero term is treated as absent. Without a ratio each side is 1.25×, rounded.
pub(crate) fn expanded_size(w: u32, h: u32, aspect_ratio: Option<(u32, u32)>) -> (u32, u32) {
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
/// pictures have the subject's edge, so erasing visibly changes them. Images smaller than 8
/// pixels a side pass unchanged.
pub(crate) struct Erase<'s> {
    next: &'s mut dyn Sink,
    /// `(x, y, width, height)` of the region, if the image has one.
    region: Option<(u32, u32, u32, u32)>,
    grain: Option<Grain>,
    y: u32,
    line: Vec<u8>,
}

impl<'s> Erase<'s> {
    pub(crate) fn new(
        next: &'s mut dyn Sink,
        (w, h): (u32, u32),
        object_name: &str,
        grain: Option<Grain>,
    ) -> Self {
        let region = (w >= 8 && h >= 8)
            .then(|| erase_region(w, h, fnv1a(&[b"erase", object_name.as_bytes()])));
        Erase {
            next,
            region,
            grain,
            y: 0,
            line: Vec::new(),
        }
    }
}

impl Sink for Erase<'_> {
    fn row(&mut self, rgba: &[u8]) -> io::Result<()> {
        let y = self.y;
        self.y += 1;
        let Some((x0, _, rw, _)) = self.region.filter(|r| (r.1..r.1 + r.3).contains(&y)) else {
            return self.next.row(rgba);
        };
        self.line.clear();
        self.line.extend_from_slice(rgba);
        let pixel = |x: u32| -> [u8; 4] {
            let at = 4 * x as usize;
            rgba[at..at + 4].try_into().expect("a pixel")
        };
        let (left, right) = (pixel(x0 - 1), pixel(x0 + rw));
        for i in 0..rw {
            let at = 4 * (x0 + i) as usize;
            let filled = lerp(left, right, i64::from(i + 1), i64::from(rw + 1));
            self.line[at..at + 4].copy_from_slice(&filled);
        }
        if let Some(grain) = self.grain {
            grain.add(y, x0..x0 + rw, &mut self.line);
        }
        self.next.row(&self.line)
    }
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
