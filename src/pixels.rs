//! Pixels read in bounded memory: a PNG decoded one row at a time, never whole, so what
//! reading an image costs grows with its width and not its area. An 8192 × 8192 RGBA image is
//! 256 MiB decoded, and the sample pipeline's chain makes 14,564 × 8,192 ones (477 MB): a
//! report, the desk or a check that decoded them whole would not fit a 512 MiB pod.
//!
//! [`rows`] hands each row, as 8-bit RGBA, to a closure: thumbnails ([`thumbnail`]) and the
//! statistics a check reads are folds over it. Interlaced (Adam7) images come as the passes'
//! rows, each with the columns it covers. Other formats than PNG are not read here: their
//! callers say so rather than decode them whole.

use std::io::{BufRead, Seek};

/// What a PNG's header says, once the rows are read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub width: u32,
    pub height: u32,
    /// The file can carry transparency (an alpha channel, or a transparent colour).
    pub alpha_channel: bool,
}

/// One decoded row: the pixels of line `y` at columns `x0`, `x0 + dx`, `x0 + 2·dx`, …, as
/// RGBA, 4 bytes each (`dx` is 1 but in an interlaced image's passes).
pub struct Row<'a> {
    pub y: u32,
    pub x0: u32,
    pub dx: u32,
    pub rgba: &'a [u8],
}

/// Why an image could not be read.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct PixelError(String);

impl PixelError {
    pub fn new(why: impl Into<String>) -> PixelError {
        PixelError(why.into())
    }
}

/// The most pixels per side read: past the service's 8192 × 2 (an expand of an upscale), a
/// file is more likely damaged than an image, and a row stays a few hundred KiB.
pub const MAX_SIDE: u32 = 32_768;

/// Whether `head` (a file's first bytes) is a PNG's signature.
pub fn is_png(head: &[u8]) -> bool {
    head.starts_with(b"\x89PNG\r\n\x1a\n")
}

/// Reads the PNG in `reader` row by row, handing each to `each` as RGBA with the header;
/// memory is a few rows.
pub fn rows<R: BufRead + Seek>(
    reader: R,
    mut each: impl FnMut(&Header, Row<'_>),
) -> Result<Header, PixelError> {
    let mut decoder = png::Decoder::new(reader);
    decoder.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    let mut reader = decoder.read_info().map_err(failed)?;
    let info = reader.info();
    let (width, height) = (info.width, info.height);
    if width > MAX_SIDE || height > MAX_SIDE {
        return Err(PixelError(format!(
            "{width}x{height} pixels: more than {MAX_SIDE} a side is not read"
        )));
    }
    let alpha_channel =
        info.color_type.samples() == 2 || info.color_type.samples() == 4 || info.trns.is_some();
    let interlaced = info.interlaced;
    let header = Header {
        width,
        height,
        alpha_channel,
    };
    let (color, _) = reader.output_color_type();
    let mut rgba = Vec::with_capacity(width as usize * 4);
    let mut lines = Lines::new(width, height, interlaced);
    while let Some(row) = reader.next_row().map_err(failed)? {
        let Some((y, x0, dx)) = lines.next() else {
            break;
        };
        to_rgba(color, row.data(), &mut rgba);
        let row = Row {
            y,
            x0,
            dx,
            rgba: &rgba,
        };
        each(&header, row);
    }
    Ok(header)
}

fn failed(e: png::DecodingError) -> PixelError {
    PixelError(e.to_string())
}

/// `data` (8-bit samples of `color`) as RGBA in `out`.
fn to_rgba(color: png::ColorType, data: &[u8], out: &mut Vec<u8>) {
    out.clear();
    match color {
        png::ColorType::Rgba => out.extend_from_slice(data),
        png::ColorType::Rgb => {
            for p in data.chunks_exact(3) {
                out.extend_from_slice(&[p[0], p[1], p[2], u8::MAX]);
            }
        }
        png::ColorType::GrayscaleAlpha => {
            for p in data.chunks_exact(2) {
                out.extend_from_slice(&[p[0], p[0], p[0], p[1]]);
            }
        }
        // Grayscale; an indexed image is expanded to RGB(A) by the decoder.
        _ => {
            for &g in data {
                out.extend_from_slice(&[g, g, g, u8::MAX]);
            }
        }
    }
}

/// The line and columns of each row the decoder gives, in its order: every line, or the seven
/// passes of Adam7 (those an image too small for them skips).
struct Lines {
    passes: Vec<(u32, u32, u32, u32)>,
    pass: usize,
    line: u32,
    width: u32,
    height: u32,
}

/// Adam7's passes: first column, first line, column step, line step.
const ADAM7: [(u32, u32, u32, u32); 7] = [
    (0, 0, 8, 8),
    (4, 0, 8, 8),
    (0, 4, 4, 8),
    (2, 0, 4, 4),
    (0, 2, 2, 4),
    (1, 0, 2, 2),
    (0, 1, 1, 2),
];

impl Lines {
    fn new(width: u32, height: u32, interlaced: bool) -> Lines {
        let passes = if interlaced {
            ADAM7
                .into_iter()
                .filter(|&(x0, y0, _, _)| x0 < width && y0 < height)
                .collect()
        } else {
            vec![(0, 0, 1, 1)]
        };
        Lines {
            passes,
            pass: 0,
            line: 0,
            width,
            height,
        }
    }
}

impl Iterator for Lines {
    type Item = (u32, u32, u32);

    fn next(&mut self) -> Option<(u32, u32, u32)> {
        loop {
            let &(x0, y0, dx, dy) = self.passes.get(self.pass)?;
            let y = y0 + self.line * dy;
            if y < self.height && x0 < self.width {
                self.line += 1;
                return Some((y, x0, dx));
            }
            self.pass += 1;
            self.line = 0;
        }
    }
}

/// An image scaled to fit a square of `edge` pixels, as RGBA, with what was learnt reading it.
pub struct Thumbnail {
    pub width: u32,
    pub height: u32,
    pub rgba: Vec<u8>,
    /// The full image's size.
    pub size: (u32, u32),
    /// Some pixel is not fully opaque.
    pub translucent: bool,
}

/// The image in `reader` scaled into `edge` (never enlarged), each output pixel the mean of
/// the pixels it covers (weighted by their alpha, so transparent pixels lend no colour).
/// Memory is the output's sums and one row of the input, whatever the image's area.
pub fn thumbnail<R: BufRead + Seek>(reader: R, edge: u32) -> Result<Thumbnail, PixelError> {
    let mut fold: Option<Fold> = None;
    let header = rows(reader, |header, row| {
        fold.get_or_insert_with(|| Fold::new(header, edge))
            .add(&row);
    })?;
    let fold = fold.ok_or_else(|| PixelError("the image has no rows".into()))?;
    Ok(Thumbnail {
        width: fold.out.0,
        height: fold.out.1,
        translucent: fold.translucent,
        rgba: fold.finish(),
        size: (header.width, header.height),
    })
}

/// The size that fits `w × h` into a square of `edge`, keeping its shape; never larger.
pub fn fitted(w: u32, h: u32, edge: u32) -> (u32, u32) {
    if w <= edge && h <= edge {
        return (w.max(1), h.max(1));
    }
    let scale = |a: u32, b: u32| {
        let scaled = (u64::from(a) * u64::from(edge) + u64::from(b) / 2) / u64::from(b);
        u32::try_from(scaled).unwrap_or(edge).clamp(1, edge)
    };
    if w >= h {
        (edge, scale(h, w))
    } else {
        (scale(w, h), edge)
    }
}

/// The sums of a box filter: for each output pixel, its colours weighted by alpha, its alpha,
/// and how many input pixels fell in it.
struct Fold {
    /// The input's height, and the output's size.
    height: u32,
    out: (u32, u32),
    /// The output column of each input column, worked out once: a division a pixel saved.
    columns: Vec<u32>,
    sums: Vec<[u64; 5]>,
    /// Some pixel read so far is not fully opaque.
    translucent: bool,
}

impl Fold {
    fn new(header: &Header, edge: u32) -> Fold {
        let out = fitted(header.width, header.height, edge);
        let columns = (0..header.width)
            .map(|x| Fold::cell(x, header.width, out.0).min(out.0 as usize - 1) as u32)
            .collect();
        Fold {
            height: header.height,
            out,
            columns,
            sums: vec![[0; 5]; out.0 as usize * out.1 as usize],
            translucent: false,
        }
    }

    /// The output cell of input coordinate `v` of `of`, on an output axis of `cells`.
    fn cell(v: u32, of: u32, cells: u32) -> usize {
        (u64::from(v) * u64::from(cells) / u64::from(of.max(1))) as usize
    }

    fn add(&mut self, row: &Row<'_>) {
        let (tw, th) = self.out;
        let oy = Fold::cell(row.y, self.height, th).min(th as usize - 1);
        let line = &mut self.sums[oy * tw as usize..(oy + 1) * tw as usize];
        let columns = self
            .columns
            .iter()
            .skip(row.x0 as usize)
            .step_by(row.dx as usize);
        for (p, &ox) in row.rgba.chunks_exact(4).zip(columns) {
            self.translucent |= p[3] < u8::MAX;
            let a = u64::from(p[3]);
            let cell = &mut line[ox as usize];
            cell[0] += u64::from(p[0]) * a;
            cell[1] += u64::from(p[1]) * a;
            cell[2] += u64::from(p[2]) * a;
            cell[3] += a;
            cell[4] += 1;
        }
    }

    /// The mean of each cell, as RGBA.
    fn finish(self) -> Vec<u8> {
        let mut rgba = Vec::with_capacity(self.sums.len() * 4);
        for [r, g, b, a, n] in self.sums {
            let mean = |c: u64| (c + a / 2).checked_div(a).unwrap_or(0) as u8;
            let alpha = (a + n / 2).checked_div(n).unwrap_or(0) as u8;
            rgba.extend_from_slice(&[mean(r), mean(g), mean(b), alpha]);
        }
        rgba
    }
}

/// Images made to order for the tests of what reads pixels.
#[cfg(test)]
pub(crate) mod testing {
    /// A PNG of `w × h`, RGBA or RGB, its pixels from `at(x, y)`.
    pub(crate) fn png(w: u32, h: u32, alpha: bool, at: impl Fn(u32, u32) -> [u8; 4]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut enc = png::Encoder::new(&mut out, w, h);
        enc.set_color(if alpha {
            png::ColorType::Rgba
        } else {
            png::ColorType::Rgb
        });
        enc.set_depth(png::BitDepth::Eight);
        let mut writer = enc.write_header().unwrap();
        let mut data = Vec::new();
        for y in 0..h {
            for x in 0..w {
                let p = at(x, y);
                data.extend_from_slice(if alpha { &p[..] } else { &p[..3] });
            }
        }
        writer.write_image_data(&data).unwrap();
        writer.finish().unwrap();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::testing::png;
    use super::*;
    use std::io::Cursor;

    #[test]
    fn a_thumbnail_is_the_mean_of_what_each_pixel_covers() {
        // Left half red, right half blue, 64 × 32: a 4 × 2 thumbnail is two red, two blue.
        let bytes = png(64, 32, false, |x, _| {
            if x < 32 {
                [255, 0, 0, 255]
            } else {
                [0, 0, 255, 255]
            }
        });
        let t = thumbnail(Cursor::new(bytes), 4).unwrap();
        assert_eq!((t.width, t.height, t.size), (4, 2, (64, 32)));
        assert!(!t.translucent);
        assert_eq!(&t.rgba[..4], &[255, 0, 0, 255]);
        assert_eq!(&t.rgba[12..16], &[0, 0, 255, 255]);
    }

    #[test]
    fn transparent_pixels_lend_no_colour_and_are_told() {
        // Every other pixel transparent black, the others white: a grey would be wrong.
        let bytes = png(16, 16, true, |x, y| {
            if (x + y) % 2 == 0 {
                [0, 0, 0, 0]
            } else {
                [255, 255, 255, 255]
            }
        });
        let t = thumbnail(Cursor::new(bytes), 2).unwrap();
        assert!(t.translucent);
        assert_eq!(&t.rgba[..4], &[255, 255, 255, 128]);
    }

    #[test]
    fn a_small_image_is_not_enlarged_and_shapes_are_kept() {
        assert_eq!(fitted(100, 50, 256), (100, 50));
        assert_eq!(fitted(14_564, 8_192, 256), (256, 144));
        assert_eq!(fitted(8_192, 1, 256), (256, 1));
        assert_eq!(fitted(1, 8_192, 256), (1, 256));
    }

    #[test]
    fn every_line_of_an_interlaced_image_is_read_once_in_its_place() {
        for (w, h) in [(1, 1), (3, 5), (9, 17), (16, 16)] {
            let mut seen = vec![0u8; (w * h) as usize];
            for (y, x0, dx) in Lines::new(w, h, true) {
                let mut x = x0;
                while x < w {
                    seen[(y * w + x) as usize] += 1;
                    x += dx;
                }
            }
            assert!(seen.iter().all(|&n| n == 1), "{w}x{h}: {seen:?}");
        }
    }
}
