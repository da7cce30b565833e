//! The sandbox's images as streams of rows: what it draws or edits goes to a PNG encoder one row
//! at a time, and what it edits is read one row at a time ([`crate::pixels`]), so making a
//! 14,564 × 8,192 image (the sample pipeline's at 2048 px) costs a few rows of memory and its
//! compressed bytes, not the 477 MB its pixels would take whole.

use std::io::{self, Cursor};

use crate::pixels;
use crate::sandbox::images::Weight;

/// Where an image's rows go, top to bottom: each row is the image's width in RGBA pixels.
pub(crate) trait Sink {
    fn row(&mut self, rgba: &[u8]) -> io::Result<()>;
}

/// What an encoder needs before the first row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Shape {
    pub width: u32,
    pub height: u32,
    /// RGBA8 when true, else RGB8: the two layouts the service's clients expect.
    pub alpha: bool,
}

/// A PNG the sandbox cannot edit.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct Unreadable(String);

impl From<io::Error> for Unreadable {
    fn from(e: io::Error) -> Self {
        Unreadable(e.to_string())
    }
}

/// Encodes the rows `draw` hands its sink as one PNG of `shape`. An image without alpha is
/// shown over white, as a viewer would: rows that carry transparency are composed onto white.
pub(crate) fn encode(
    shape: Shape,
    weight: Weight,
    draw: impl FnOnce(&mut dyn Sink) -> io::Result<()>,
) -> io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    let mut encoder = png::Encoder::new(&mut bytes, shape.width, shape.height);
    encoder.set_color(if shape.alpha {
        png::ColorType::Rgba
    } else {
        png::ColorType::Rgb
    });
    encoder.set_depth(png::BitDepth::Eight);
    encoder.set_compression(weight.compression());
    let mut writer = encoder.write_header().map_err(io::Error::other)?;
    {
        let stream = writer
            .stream_writer_with_size(IDAT_SIZE)
            .map_err(io::Error::other)?;
        let mut sink = Encoder {
            stream,
            alpha: shape.alpha,
            line: Vec::with_capacity(shape.width as usize * 4),
        };
        draw(&mut sink)?;
        sink.finish()?;
    }
    writer.finish().map_err(io::Error::other)?;
    Ok(bytes)
}

/// Bytes of image data per PNG chunk: the encoder's 4 KiB default would cut a 100 MB image
/// into 25,000 chunks.
const IDAT_SIZE: usize = 256 * 1024;

struct Encoder<'w, 'a> {
    stream: png::StreamWriter<'w, &'a mut Vec<u8>>,
    alpha: bool,
    line: Vec<u8>,
}

impl Encoder<'_, '_> {
    fn finish(self) -> io::Result<()> {
        self.stream.finish().map_err(io::Error::other)
    }
}

impl Sink for Encoder<'_, '_> {
    fn row(&mut self, rgba: &[u8]) -> io::Result<()> {
        use std::io::Write;
        if self.alpha {
            return self.stream.write_all(rgba);
        }
        self.line.clear();
        for p in rgba.chunks_exact(4) {
            self.line
                .extend(p[..3].iter().map(|&c| over_white(c, p[3])));
        }
        self.stream.write_all(&self.line)
    }
}

fn over_white(c: u8, a: u8) -> u8 {
    let (c, a) = (u32::from(c), u32::from(a));
    ((c * a + 255 * (255 - a) + 127) / 255) as u8
}

/// The shape of the PNG in `bytes`, from its header alone.
pub(crate) fn shape(bytes: &[u8]) -> Result<Shape, Unreadable> {
    let reader = png::Decoder::new(Cursor::new(bytes))
        .read_info()
        .map_err(|e| Unreadable(e.to_string()))?;
    let info = reader.info();
    Ok(Shape {
        width: info.width,
        height: info.height,
        alpha: info.color_type.samples() == 2
            || info.color_type.samples() == 4
            || info.trns.is_some(),
    })
}

/// Reads the PNG in `bytes` row by row into `each` (`y` and the row as RGBA), stopping at the
/// first error `each` returns. Interlaced files are refused: the sandbox never makes them, and
/// a pass's partial rows are no row to edit.
pub(crate) fn read(
    bytes: &[u8],
    mut each: impl FnMut(u32, &[u8]) -> io::Result<()>,
) -> Result<(), Unreadable> {
    let mut failed: Option<String> = None;
    pixels::rows(Cursor::new(bytes), |header, row| {
        if failed.is_some() {
            return;
        }
        if row.dx != 1 || row.x0 != 0 || row.rgba.len() != header.width as usize * 4 {
            failed = Some("an interlaced PNG is not edited".to_owned());
        } else if let Err(e) = each(row.y, row.rgba) {
            failed = Some(e.to_string());
        }
    })
    .map_err(|e| Unreadable(e.to_string()))?;
    failed.map_or(Ok(()), |e| Err(Unreadable(e)))
}
