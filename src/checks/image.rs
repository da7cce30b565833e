//! The built-in checks, as pure functions of what one pass over an image's rows learns
//! ([`Stats`]): luma's spread (`not_blank`), the dimensions (`size`), the share of pixels that
//! are not opaque (`transparent`) and a perceptual hash (`distinct`). Reading is
//! [`crate::pixels::rows`]: a few rows in memory whatever the image's area.
//!
//! Luma is taken over black (colour times alpha), so a cut-out's removed background reads as
//! one flat colour and its subject as what stands out of it.

use std::io::{BufRead, Seek};

use crate::checks::Verdict;
use crate::pipeline::ToolOp;
use crate::pipeline::checks::CheckName;
use crate::pixels::{self, PixelError, Row};

/// The perceptual hash's grid: 9 columns of mean luma, 8 rows, compared left to right (a
/// difference hash): 64 bits that survive re-encoding and small changes, not a new picture.
const HASH_COLUMNS: usize = 9;
const HASH_ROWS: usize = 8;

/// What one pass over an image's rows learns; all that the built-in checks read.
#[derive(Clone, Debug, PartialEq)]
pub struct Stats {
    pub width: u32,
    pub height: u32,
    pixels: u64,
    luma_sum: u64,
    luma_squares: u64,
    translucent: u64,
    /// Sum of luma and pixel count in each cell of the hash's grid.
    cells: [[(u64, u64); HASH_COLUMNS]; HASH_ROWS],
}

/// Reads the PNG in `reader` once, row by row.
pub fn read<R: BufRead + Seek>(reader: R) -> Result<Stats, PixelError> {
    let mut stats: Option<Stats> = None;
    let header = pixels::rows(reader, |header, row| {
        stats
            .get_or_insert_with(|| Stats::empty(header.width, header.height))
            .add(&row);
    })?;
    stats.ok_or_else(|| {
        PixelError::new(format!(
            "{}x{} pixels: no rows",
            header.width, header.height
        ))
    })
}

/// Rec. 601 luma of an RGBA pixel over black, 0 to 255.
fn luma(p: &[u8]) -> u64 {
    let [r, g, b, a] = [p[0], p[1], p[2], p[3]].map(u64::from);
    (299 * r + 587 * g + 114 * b) * a / (1000 * 255)
}

impl Stats {
    fn empty(width: u32, height: u32) -> Stats {
        Stats {
            width,
            height,
            pixels: 0,
            luma_sum: 0,
            luma_squares: 0,
            translucent: 0,
            cells: [[(0, 0); HASH_COLUMNS]; HASH_ROWS],
        }
    }

    fn add(&mut self, row: &Row<'_>) {
        let cell_row = cell(row.y, self.height, HASH_ROWS);
        let mut x = row.x0;
        for p in row.rgba.chunks_exact(4) {
            let l = luma(p);
            self.pixels += 1;
            self.luma_sum += l;
            self.luma_squares += l * l;
            self.translucent += u64::from(p[3] < u8::MAX);
            let c = &mut self.cells[cell_row][cell(x, self.width, HASH_COLUMNS)];
            c.0 += l;
            c.1 += 1;
            x += row.dx;
        }
    }

    /// Standard deviation of luma over every pixel.
    pub fn luma_stddev(&self) -> f64 {
        if self.pixels == 0 {
            return 0.0;
        }
        let n = self.pixels as f64;
        let mean = self.luma_sum as f64 / n;
        (self.luma_squares as f64 / n - mean * mean).max(0.0).sqrt()
    }

    /// Share of the pixels whose alpha is below 255.
    pub fn translucent_share(&self) -> f64 {
        if self.pixels == 0 {
            return 0.0;
        }
        self.translucent as f64 / self.pixels as f64
    }

    /// The 64-bit difference hash: bit set where a cell is darker than its right neighbour.
    pub fn hash(&self) -> u64 {
        let mean = |(sum, n): (u64, u64)| (sum * 16).checked_div(n).unwrap_or(0);
        let mut bits = 0u64;
        for row in &self.cells {
            for pair in row.windows(2) {
                bits = bits << 1 | u64::from(mean(pair[0]) < mean(pair[1]));
            }
        }
        bits
    }
}

/// The cell of the hash's grid that line or column `v` of `of` falls in.
fn cell(v: u32, of: u32, cells: usize) -> usize {
    (u64::from(v) * cells as u64 / u64::from(of.max(1))) as usize
}

/// `not_blank`: not one flat colour.
pub fn not_blank(stats: &Stats, min_stddev: f64) -> Verdict {
    let stddev = stats.luma_stddev();
    let reason = if stddev >= min_stddev {
        format!("luma varies by {stddev:.1}")
    } else {
        format!("a flat image: luma varies by {stddev:.1}, below {min_stddev}")
    };
    Verdict::judged(CheckName::NotBlank, stddev >= min_stddev, stddev, reason)
}

/// `transparent`: the share of pixels that are not opaque, within `min..=max`.
pub fn transparent(stats: &Stats, min: f64, max: f64) -> Verdict {
    let share = stats.translucent_share();
    let pct = |v: f64| format!("{:.1}%", v * 100.0);
    let reason = if share < min {
        format!(
            "{} of the pixels are transparent, below {}: the background was not removed",
            pct(share),
            pct(min)
        )
    } else if share > max {
        format!(
            "{} of the pixels are transparent, above {}: the subject was removed too",
            pct(share),
            pct(max)
        )
    } else {
        format!("{} of the pixels are transparent", pct(share))
    };
    Verdict::judged(
        CheckName::Transparent,
        (min..=max).contains(&share),
        share,
        reason,
    )
}

/// What an operation promises of its output's dimensions, as far as its input is known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SizePromise {
    /// An upscale: the input's sides times the factor (1 for an erase or a background removal,
    /// which keep their input's size).
    Scaled { input: (u32, u32), factor: u32 },
    /// An expand: the ratio, on a canvas that holds the input (when its size is known).
    Ratio {
        ratio: (u32, u32),
        input: Option<(u32, u32)>,
    },
    /// An upscale of an input whose size is not known here (a URL): nothing to hold it to.
    UnknownInput,
}

impl SizePromise {
    /// What `op` promises of an output's size, given its input's (`None` when not known:
    /// the input is a URL the pipeline wrote, or its file could not be read).
    pub fn of(op: &ToolOp, input: Option<(u32, u32)>) -> SizePromise {
        let scaled = |factor| match input {
            Some(input) => SizePromise::Scaled { input, factor },
            None => SizePromise::UnknownInput,
        };
        match op {
            ToolOp::Upscale(increase) => scaled(increase.factor()),
            ToolOp::Erase { .. } | ToolOp::RemoveBackground => scaled(1),
            ToolOp::Expand {
                aspect_ratio: Some(ratio),
                ..
            } => SizePromise::Ratio {
                ratio: (ratio.width(), ratio.height()),
                input,
            },
            ToolOp::Expand {
                aspect_ratio: None, ..
            } => SizePromise::UnknownInput,
        }
    }
}

/// Slack in pixels a side: services round.
const SIZE_SLACK: u64 = 1;

/// `size`: the dimensions the operation promises, within a pixel.
pub fn size(stats: &Stats, promise: SizePromise) -> Verdict {
    let (w, h) = (u64::from(stats.width), u64::from(stats.height));
    let near = |a: u64, b: u64| a.abs_diff(b) <= SIZE_SLACK;
    let got = format!("{w}x{h}");
    let (ok, expected) = match promise {
        SizePromise::UnknownInput => {
            return Verdict::not_checked(
                CheckName::Size,
                format!("{got}: the input's size is not known, so the promised one is not either"),
            );
        }
        SizePromise::Scaled {
            input: (iw, ih),
            factor,
        } => {
            let (ew, eh) = (
                u64::from(iw) * u64::from(factor),
                u64::from(ih) * u64::from(factor),
            );
            (near(w, ew) && near(h, eh), format!("{ew}x{eh}"))
        }
        SizePromise::Ratio {
            ratio: (rw, rh),
            input,
        } => {
            let (rw, rh) = (u64::from(rw.max(1)), u64::from(rh.max(1)));
            // Either side may be the one that was kept; the other follows from the ratio.
            let ratio_ok = near(h, (w * rh).div_ceil(rw))
                || near(w, (h * rw).div_ceil(rh))
                || near(h, w * rh / rw)
                || near(w, h * rw / rh);
            let holds = input.is_none_or(|(iw, ih)| {
                w + SIZE_SLACK >= u64::from(iw) && h + SIZE_SLACK >= u64::from(ih)
            });
            (
                ratio_ok && holds,
                format!(
                    "{rw}:{rh}{}",
                    input
                        .map(|(iw, ih)| format!(" around {iw}x{ih}"))
                        .unwrap_or_default()
                ),
            )
        }
    };
    let reason = if ok {
        format!("{got}, as promised ({expected})")
    } else {
        format!("{got}, not the promised {expected}")
    };
    Verdict::judged(CheckName::Size, ok, if ok { 1.0 } else { 0.0 }, reason)
}

/// `distinct`: each image of one generation against those before it. The first of a group of
/// look-alikes passes; the others fail, naming the one they repeat. The score is the
/// smallest distance found.
pub fn distinct(hashes: &[u64], min_distance: u32) -> Vec<Verdict> {
    hashes
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let closest = hashes[..i]
                .iter()
                .enumerate()
                .map(|(j, other)| (j, (h ^ other).count_ones()))
                .min_by_key(|&(_, d)| d);
            match closest {
                None => Verdict::judged(CheckName::Distinct, true, 64.0, "the first image of its generation".into()),
                Some((j, d)) if d < min_distance => Verdict::judged(
                    CheckName::Distinct,
                    false,
                    f64::from(d),
                    format!("the same picture as image {j} of its generation: {d} of 64 hash bits differ, below {min_distance}"),
                ),
                Some((j, d)) => Verdict::judged(
                    CheckName::Distinct,
                    true,
                    f64::from(d),
                    format!("{d} of 64 hash bits differ from the closest, image {j}"),
                ),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::io::Cursor;

    use super::*;
    use crate::checks::Outcome;
    use crate::pipeline::checks::DEFAULT_MIN_DISTANCE;
    use crate::pixels::testing::png;
    use crate::sandbox::images::{Weight, generation_png};

    fn stats(bytes: Vec<u8>) -> Stats {
        read(Cursor::new(bytes)).expect("a PNG")
    }

    fn picture(prompt: &str, index: u32) -> Vec<u8> {
        generation_png(prompt, index, 0, 256, Weight::Flat)
    }

    #[test]
    fn a_flat_frame_is_blank_and_a_picture_is_not() {
        let flat = stats(png(64, 48, false, |_, _| [12, 12, 12, 255]));
        let v = not_blank(&flat, 2.0);
        assert_eq!((v.outcome, v.score), (Outcome::Failed, Some(0.0)), "{v:?}");
        assert!(v.reason.starts_with("a flat image"), "{v:?}");
        let v = not_blank(&stats(picture("a mug", 0)), 2.0);
        assert_eq!(v.outcome, Outcome::Passed, "{v:?}");
        assert!(v.score.unwrap() > 10.0, "{v:?}");
    }

    #[test]
    fn faint_noise_passes_only_a_low_threshold() {
        // Luma alternating 100 and 103: a standard deviation of 1.5.
        let faint = stats(png(32, 32, false, |x, _| {
            let v = if x % 2 == 0 { 100 } else { 103 };
            [v, v, v, 255]
        }));
        assert!(
            (faint.luma_stddev() - 1.5).abs() < 0.01,
            "{}",
            faint.luma_stddev()
        );
        assert_eq!(not_blank(&faint, 2.0).outcome, Outcome::Failed);
        assert_eq!(not_blank(&faint, 1.0).outcome, Outcome::Passed);
    }

    #[test]
    fn transparency_is_the_share_of_pixels_not_opaque() {
        // The left quarter removed: 25% transparent.
        let cutout = stats(png(40, 10, true, |x, _| {
            if x < 10 {
                [0, 0, 0, 0]
            } else {
                [200, 10, 10, 255]
            }
        }));
        assert!((cutout.translucent_share() - 0.25).abs() < 1e-9);
        assert_eq!(transparent(&cutout, 0.05, 0.95).outcome, Outcome::Passed);
        let opaque = stats(picture("a lamp", 0));
        let v = transparent(&opaque, 0.05, 0.95);
        assert_eq!((v.outcome, v.score), (Outcome::Failed, Some(0.0)));
        assert!(v.reason.contains("the background was not removed"), "{v:?}");
        let v = transparent(&stats(png(8, 8, true, |_, _| [0, 0, 0, 0])), 0.05, 0.95);
        assert!(v.reason.contains("the subject was removed too"), "{v:?}");
    }

    #[test]
    fn size_holds_an_upscale_to_its_factor_and_an_expand_to_its_ratio() {
        let s = stats(png(64, 36, false, |x, y| [x as u8, y as u8, 0, 255]));
        let up = |input| size(&s, SizePromise::Scaled { input, factor: 2 }).outcome;
        assert_eq!(up((32, 18)), Outcome::Passed);
        assert_eq!(up((64, 36)), Outcome::Failed, "the input's size came back");
        let odd = stats(png(65, 35, false, |x, y| [x as u8, y as u8, 0, 255]));
        let v = size(
            &odd,
            SizePromise::Scaled {
                input: (32, 18),
                factor: 2,
            },
        );
        assert_eq!(v.outcome, Outcome::Passed, "within a pixel: {v:?}");
        let ratio = |ratio, input| size(&s, SizePromise::Ratio { ratio, input }).outcome;
        assert_eq!(ratio((16, 9), Some((48, 36))), Outcome::Passed);
        assert_eq!(ratio((16, 9), None), Outcome::Passed);
        assert_eq!(ratio((1, 1), Some((36, 36))), Outcome::Failed);
        assert_eq!(
            ratio((16, 9), Some((80, 36))),
            Outcome::Failed,
            "smaller than its input"
        );
        let v = size(&s, SizePromise::UnknownInput);
        assert_eq!(v.outcome, Outcome::NotChecked);
    }

    #[test]
    fn a_generation_of_the_same_picture_fails_distinct_but_its_first() {
        let a = stats(picture("a mug", 0)).hash();
        let b = stats(picture("a mug", 1)).hash();
        let verdicts = distinct(&[a, b, a], DEFAULT_MIN_DISTANCE);
        let outcomes: Vec<Outcome> = verdicts.iter().map(|v| v.outcome).collect();
        assert_eq!(
            outcomes,
            [Outcome::Passed, Outcome::Passed, Outcome::Failed],
            "{verdicts:?}"
        );
        assert!(verdicts[2].reason.contains("image 0"), "{verdicts:?}");
        assert!(
            (a ^ b).count_ones() >= DEFAULT_MIN_DISTANCE,
            "two pictures differ: {a:x} {b:x}"
        );
    }

    #[test]
    fn the_hash_survives_a_change_of_size_and_interlacing() {
        let small = stats(png(90, 80, false, |x, y| {
            [(x * 2) as u8, (y * 3) as u8, 40, 255]
        }))
        .hash();
        let big = stats(png(180, 160, false, |x, y| {
            [x as u8, (y * 3 / 2) as u8, 40, 255]
        }))
        .hash();
        assert!((small ^ big).count_ones() <= 2, "{small:x} {big:x}");
    }
}
