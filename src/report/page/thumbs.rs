//! Thumbnails: small PNGs made once per image and named by the image's sha256, so a report
//! made again (or for a run in progress) only decodes the images it has not seen, and a file
//! changed on disk never shows the old picture.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use futures::StreamExt;
use image::codecs::png::{CompressionType, FilterType, PngEncoder};
use image::{DynamicImage, ImageDecoder, ImageReader};

use crate::place::temp;
use crate::sha256::Sha256Sum;

/// The longest side of a thumbnail, in pixels: sharp at the page's 160 px on a 1.6x screen.
pub const EDGE: u32 = 256;

/// What one output shows on the page.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Preview {
    pub thumb: Option<PathBuf>,
    /// The thumbnail's own size, so the page reserves the space before it loads.
    pub thumb_size: Option<(u32, u32)>,
    /// The full image's size.
    pub size: Option<(u32, u32)>,
    /// Some pixel is not opaque: the page puts a checkerboard behind it.
    pub alpha: bool,
    /// Why there is no picture, or what is odd about the file.
    pub note: Option<String>,
    /// A thumbnail was made (not found already made).
    pub made: bool,
    /// The file is where the record says.
    pub on_disk: bool,
}

/// What a thumbnail says of itself, known without reading it (see [`Known`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Facts {
    /// The full image's size, when the thumbnail carries it.
    pub size: Option<(u32, u32)>,
    pub thumb_size: (u32, u32),
    pub alpha: bool,
}

impl Facts {
    /// The facts of a thumbnail's bytes (its header and the size it carries).
    pub fn of(png: &[u8]) -> Option<Facts> {
        let (w, h, alpha) = probe_bytes(png).ok()?;
        Some(Facts {
            size: image_size(png),
            thumb_size: (w, h),
            alpha,
        })
    }
}

/// Thumbnails known by name without being read or being on the local disk: a report of a run
/// in object storage records what each says of itself in the state database when it puts it,
/// so a report made again reads none. Each counts as made at `dated`.
#[derive(Debug)]
pub struct Known {
    pub facts: std::collections::HashMap<String, Facts>,
    pub dated: std::time::SystemTime,
    /// Images known to be as recorded without being on the local disk (a listing of the
    /// bucket said so), by the path they would have: their thumbnail stands for them.
    pub trusted: std::collections::HashSet<PathBuf>,
}

impl Default for Known {
    fn default() -> Known {
        Known {
            facts: std::collections::HashMap::new(),
            dated: std::time::UNIX_EPOCH,
            trusted: std::collections::HashSet::new(),
        }
    }
}

impl Known {
    fn get(&self, thumb: &Path) -> Option<&Facts> {
        self.facts.get(&*thumb.file_name()?.to_string_lossy())
    }
}

/// A report's hold on a `_thumbs` directory while it writes thumbnails there: a shared
/// `flock` on the directory itself, which every report making thumbnails at once holds.
///
/// A report killed while writing a thumbnail leaves its temporary (`.tmp…`) behind. The next
/// report that finds the directory held by no one removes them first: with no hold, no
/// report is writing there, so none of them is anyone's to finish. A hold is let go when its
/// report ends, however it ends, so a killed report never keeps them from being cleaned.
pub struct Writing {
    _dir: Option<std::fs::File>,
}

impl Writing {
    /// Takes the hold on `dir` (made if its parent, the run directory, exists: without it
    /// there is no image to make a thumbnail of), removing leftover temporaries when no other
    /// report holds it. Best effort: a directory that cannot be opened or locked is used
    /// without a hold, and is cleaned another time.
    pub fn start(dir: &Path) -> Writing {
        if dir.parent().is_some_and(Path::is_dir) {
            let _ = std::fs::create_dir_all(dir);
        }
        let Ok(handle) = std::fs::File::open(dir) else {
            return Writing { _dir: None };
        };
        if handle.try_lock().is_ok() {
            let removed = remove_temporaries(dir);
            if removed > 0 {
                tracing::debug!(
                    "removed {removed} temporary file(s) a killed report left in {}",
                    dir.display()
                );
            }
        }
        // From alone to shared (or waiting for a report that is cleaning up to finish).
        match handle.lock_shared() {
            Ok(()) => Writing { _dir: Some(handle) },
            Err(_) => Writing { _dir: None },
        }
    }
}

/// Removes the temporaries in `dir`; returns how many.
fn remove_temporaries(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .filter(|e| crate::place::layout::is_leftover(&e.file_name().to_string_lossy(), false))
        .filter(|e| std::fs::remove_file(e.path()).is_ok())
        .count()
}

/// Previews of `files` (path and recorded sha256), in their order, decoding at most one image
/// per core at a time. Each trip to the blocking pool takes a few images: a trip per image
/// cost more thread switches than a small image costs to preview.
pub async fn previews(
    dir: &Path,
    files: Vec<(PathBuf, Option<Sha256Sum>)>,
    known: &std::sync::Arc<Known>,
) -> Vec<Preview> {
    const PER_TRIP: usize = 16;
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    let mut files = files.into_iter().peekable();
    let trips = std::iter::from_fn(|| {
        files.peek()?;
        Some(files.by_ref().take(PER_TRIP).collect::<Vec<_>>())
    });
    let done: Vec<Vec<Preview>> = futures::stream::iter(trips)
        .map(|trip| {
            let (dir, known) = (dir.to_owned(), std::sync::Arc::clone(known));
            let count = trip.len();
            let work = tokio::task::spawn_blocking(move || {
                trip.into_iter()
                    .map(|(path, sha)| preview(&dir, &path, sha.as_ref(), &known))
                    .collect::<Vec<_>>()
            });
            async move {
                work.await.unwrap_or_else(|e| {
                    let failed = Preview {
                        note: Some(format!("no preview: {e}")),
                        ..Preview::default()
                    };
                    vec![failed; count]
                })
            }
        })
        .buffered(workers)
        .collect()
        .await;
    done.into_iter().flatten().collect()
}

/// The preview of one file, making its thumbnail in `dir` when it has none yet.
pub fn preview(dir: &Path, path: &Path, recorded: Option<&Sha256Sum>, known: &Known) -> Preview {
    if let Some(sha) = recorded
        && known.trusted.contains(path)
        && let Some(p) = ready(dir, sha, || None, known)
    {
        return Preview { on_disk: true, ..p };
    }
    let meta = std::fs::metadata(path)
        .ok()
        .filter(std::fs::Metadata::is_file);
    // Read from the file's header only when a thumbnail is found: making one tells it anyway.
    let size = || {
        meta.as_ref()
            .and_then(|_| probe(path).ok())
            .map(|(w, h, _)| (w, h))
    };
    // The record is trusted while the file is older than its thumbnail: hashing every
    // full-size image again would make each report of a large run read gigabytes.
    if let Some(sha) = recorded {
        let Some(p) = ready(dir, sha, size, known) else {
            return from_bytes(dir, path, (recorded, Some(sha)), size, known);
        };
        match &meta {
            None => {
                return Preview {
                    note: Some("the file is no longer on disk".to_owned()),
                    ..p
                };
            }
            Some(m) if !written_after(m, p.thumb.as_deref(), known) => {
                return Preview { on_disk: true, ..p };
            }
            Some(_) => {}
        }
    }
    from_bytes(dir, path, (recorded, None), size, known)
}

/// The preview made from the file's bytes: hashed, compared with the record, and its
/// thumbnail made unless one is there for those bytes (`missing` names a digest whose
/// thumbnail was just found missing, not to be looked for twice).
fn from_bytes(
    dir: &Path,
    path: &Path,
    (recorded, missing): (Option<&Sha256Sum>, Option<&Sha256Sum>),
    size: impl Fn() -> Option<(u32, u32)>,
    known: &Known,
) -> Preview {
    let actual = match crate::place::file_sha256(path) {
        Ok(sha) => sha,
        Err(e) => {
            return Preview {
                note: Some(format!("not on disk: {e}")),
                ..Preview::default()
            };
        }
    };
    let changed = recorded.is_some_and(|r| *r != actual);
    let note = changed.then(|| "the file changed on disk since it was downloaded".to_owned());
    let known_missing = missing == Some(&actual);
    if !known_missing && let Some(p) = ready(dir, &actual, &size, known) {
        return Preview {
            note,
            on_disk: true,
            ..p
        };
    }
    match make(dir, &actual, path) {
        Ok(p) => Preview {
            note,
            made: true,
            on_disk: true,
            ..p
        },
        Err(e) => Preview {
            size: size(),
            note: Some(note.map_or_else(
                || format!("no preview: {e}"),
                |n| format!("{n}; no preview: {e}"),
            )),
            on_disk: true,
            ..Preview::default()
        },
    }
}

/// Whether the file was modified after `thumb` was made (or that cannot be told).
fn written_after(file: &std::fs::Metadata, thumb: Option<&Path>, known: &Known) -> bool {
    let made = match thumb {
        Some(t) if known.get(t).is_some() => Some(known.dated),
        Some(t) => std::fs::metadata(t).and_then(|m| m.modified()).ok(),
        None => None,
    };
    match (file.modified(), made) {
        (Ok(f), Some(t)) => f > t,
        _ => true,
    }
}

pub(crate) fn thumb_path(dir: &Path, sha: &Sha256Sum) -> PathBuf {
    dir.join(format!("{}.png", thumb_name(sha)))
}

/// The name of the thumbnail of an image of this sha256, less `.png`: its first 128 bits.
pub(crate) fn thumb_name(sha: &Sha256Sum) -> String {
    sha[..32].to_owned()
}

/// The preview from a thumbnail already made for `sha`; the full image's size is the one the
/// thumbnail carries, else `size` reads it from the image.
fn ready(
    dir: &Path,
    sha: &Sha256Sum,
    size: impl Fn() -> Option<(u32, u32)>,
    known: &Known,
) -> Option<Preview> {
    let thumb = thumb_path(dir, sha);
    let facts = match known.get(&thumb) {
        Some(facts) => *facts,
        None => Facts::of(&read(&thumb).ok()?)?,
    };
    Some(Preview {
        size: facts.size.or_else(size),
        thumb: Some(thumb),
        thumb_size: Some(facts.thumb_size),
        alpha: facts.alpha,
        note: None,
        made: false,
        on_disk: false,
    })
}

/// Reads the image a row at a time, scaling it into [`EDGE`] as it goes (memory by its width,
/// not its area: see [`crate::pixels`]), and writes the thumbnail next to the others under a
/// temporary name first, so two reports made at once never see half a file.
fn make(dir: &Path, sha: &Sha256Sum, path: &Path) -> Result<Preview, String> {
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let mut reader = std::io::BufReader::new(file);
    let head = std::io::BufRead::fill_buf(&mut reader).map_err(|e| e.to_string())?;
    if !crate::pixels::is_png(head) {
        return Err("not a PNG: only PNG images are read".to_owned());
    }
    let thumb = crate::pixels::thumbnail(reader, EDGE).map_err(|e| e.to_string())?;
    let size = thumb.size;
    let alpha = thumb.translucent;
    let fits = size.0 <= EDGE && size.1 <= EDGE;
    // An image that already fits is only encoded again, and the default deflater's set-up
    // (hundreds of KiB of state allocated and zeroed for every image) cost more than the rest
    // of its preview: the fast one writes it at about twice the size, a KiB or two. A real
    // thumbnail keeps the default, whose files are a third of the fast one's (README).
    let compression = if fits {
        CompressionType::Fast
    } else {
        CompressionType::Default
    };
    let rgba = image::RgbaImage::from_raw(thumb.width, thumb.height, thumb.rgba)
        .ok_or("the thumbnail's pixels do not fill it")?;
    let small = if alpha {
        DynamicImage::ImageRgba8(rgba)
    } else {
        DynamicImage::ImageRgb8(DynamicImage::ImageRgba8(rgba).to_rgb8())
    };
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let path = thumb_path(dir, sha);
    let mut png = Vec::new();
    let encoder = PngEncoder::new_with_quality(&mut png, compression, FilterType::Adaptive);
    small
        .write_with_encoder(encoder)
        .map_err(|e| e.to_string())?;
    let png = with_image_size(png, size);
    let tmp = temp::readable(dir).map_err(|e| e.to_string())?;
    let mut file = tmp.as_file();
    file.write_all(&png).map_err(|e| e.to_string())?;
    tmp.persist(&path).map_err(|e| e.error.to_string())?;
    Ok(Preview {
        thumb: Some(path),
        thumb_size: Some((small.width(), small.height())),
        size: Some(size),
        alpha,
        note: None,
        made: false,
        on_disk: false,
    })
}

/// The keyword of the `tEXt` chunk in which a thumbnail carries its full image's size
/// (`2048x1536`): a report that finds the thumbnail needs nothing of the image itself, which
/// for a run in object storage is a request an image saved on every report made again.
const SIZE_KEYWORD: &[u8] = b"imgpipe-image-size";

/// `png` with a `tEXt` chunk giving the full image's size, just before its `IEND`.
fn with_image_size(mut png: Vec<u8>, (w, h): (u32, u32)) -> Vec<u8> {
    const IEND: usize = 12;
    if png.len() < 8 + IEND || &png[png.len() - 8..png.len() - 4] != b"IEND" {
        return png;
    }
    let mut data = SIZE_KEYWORD.to_vec();
    data.push(0);
    data.extend_from_slice(format!("{w}x{h}").as_bytes());
    let mut chunk = Vec::with_capacity(data.len() + 12);
    chunk.extend_from_slice(&u32::try_from(data.len()).unwrap_or(0).to_be_bytes());
    chunk.extend_from_slice(b"tEXt");
    chunk.extend_from_slice(&data);
    chunk.extend_from_slice(&crc32(&chunk[4..]).to_be_bytes());
    let at = png.len() - IEND;
    png.splice(at..at, chunk);
    png
}

/// The full image's size a thumbnail (its bytes) carries, if it does (those made before
/// thumbnails did do not).
pub(crate) fn image_size(png: &[u8]) -> Option<(u32, u32)> {
    let mut at = 8;
    while at + 12 <= png.len() {
        let len = u32::from_be_bytes(png[at..at + 4].try_into().ok()?) as usize;
        let kind = &png[at + 4..at + 8];
        let data = png.get(at + 8..at + 8 + len)?;
        if kind == b"tEXt"
            && let Some(text) = data
                .strip_prefix(SIZE_KEYWORD)
                .and_then(|t| t.strip_prefix(b"\0"))
        {
            let (w, h) = std::str::from_utf8(text).ok()?.split_once('x')?;
            return Some((w.parse().ok()?, h.parse().ok()?));
        }
        at += len + 12;
    }
    None
}

/// The CRC of a PNG chunk (ISO 3309, as PNG specifies), over its type and data.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = u32::MAX;
    for byte in bytes {
        crc ^= u32::from(*byte);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn read(path: &Path) -> std::io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    std::fs::File::open(path)?.read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// [`probe`] of an image in memory.
fn probe_bytes(bytes: &[u8]) -> Result<(u32, u32, bool), String> {
    let decoder = ImageReader::new(std::io::Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| e.to_string())?
        .into_decoder()
        .map_err(|e| e.to_string())?;
    let (w, h) = decoder.dimensions();
    Ok((w, h, decoder.color_type().has_alpha()))
}

/// Width, height and whether the colour type has alpha, from the header alone.
fn probe(path: &Path) -> Result<(u32, u32, bool), String> {
    let decoder = ImageReader::open(path)
        .and_then(ImageReader::with_guessed_format)
        .map_err(|e| e.to_string())?
        .into_decoder()
        .map_err(|e| e.to_string())?;
    let (w, h) = decoder.dimensions();
    Ok((w, h, decoder.color_type().has_alpha()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png(path: &Path, w: u32, h: u32, alpha: u8) -> Sha256Sum {
        let img = image::RgbaImage::from_fn(w, h, |x, y| {
            image::Rgba([(x % 256) as u8, (y % 256) as u8, 90, alpha])
        });
        img.save(path).unwrap();
        Sha256Sum::of_bytes(&std::fs::read(path).unwrap())
    }

    #[test]
    fn makes_a_small_thumbnail_once_and_keeps_alpha() {
        let dir = tempfile::tempdir().unwrap();
        let thumbs = dir.path().join("_thumbs");
        let big = dir.path().join("big.png");
        let sha = png(&big, 1200, 600, 128);
        let first = preview(&thumbs, &big, Some(&sha), &Known::default());
        assert!(first.made);
        assert_eq!(first.size, Some((1200, 600)));
        assert_eq!(first.thumb_size, Some((EDGE, EDGE / 2)));
        assert!(first.alpha);
        assert_eq!(first.note, None);
        let again = preview(&thumbs, &big, Some(&sha), &Known::default());
        assert!(!again.made);
        assert!(again.on_disk);
        assert_eq!(again.thumb, first.thumb);
        assert!(again.alpha);
    }

    #[test]
    fn a_thumbnail_carries_its_images_size_so_the_image_is_not_read_again() {
        let dir = tempfile::tempdir().unwrap();
        let thumbs = dir.path().join("_thumbs");
        let big = dir.path().join("big.png");
        let sha = png(&big, 900, 300, 255);
        assert!(preview(&thumbs, &big, Some(&sha), &Known::default()).made);
        let thumb = thumb_path(&thumbs, &sha);
        assert_eq!(
            image_size(&std::fs::read(&thumb).unwrap()),
            Some((900, 300))
        );
        // Still a PNG every decoder reads whole, its CRCs right.
        let decoded = image::open(&thumb).unwrap();
        assert_eq!((decoded.width(), decoded.height()), (EDGE, EDGE / 3));
        // The image in place but unreadable, older than its thumbnail: the size is the
        // thumbnail's to tell.
        std::fs::write(&big, b"").unwrap();
        std::fs::File::options()
            .write(true)
            .open(&big)
            .and_then(|f| f.set_modified(std::time::UNIX_EPOCH))
            .unwrap();
        let again = preview(&thumbs, &big, Some(&sha), &Known::default());
        assert!(!again.made && again.on_disk, "{again:?}");
        assert_eq!(again.size, Some((900, 300)));
        assert_eq!(crc32(b"IEND"), 0xAE42_6082);
    }

    #[test]
    fn leftover_temporaries_go_unless_another_report_is_writing() {
        let dir = tempfile::tempdir().unwrap();
        let thumbs = dir.path().join("_thumbs");
        std::fs::create_dir(&thumbs).unwrap();
        std::fs::write(thumbs.join(".tmpAbC123"), b"half a png").unwrap();
        std::fs::write(thumbs.join("0123abcd.png"), b"a thumbnail").unwrap();
        let first = Writing::start(&thumbs);
        let names = || {
            let mut n: Vec<String> = std::fs::read_dir(&thumbs)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            n.sort();
            n
        };
        assert_eq!(names(), ["0123abcd.png"]);
        // While the first writes, a second neither waits nor removes what it is writing.
        std::fs::write(thumbs.join(".tmpXyZ789"), b"being written").unwrap();
        let second = Writing::start(&thumbs);
        assert_eq!(names(), [".tmpXyZ789", "0123abcd.png"]);
        drop((first, second));
        drop(Writing::start(&thumbs));
        assert_eq!(names(), ["0123abcd.png"]);
    }

    #[test]
    fn opaque_images_lose_their_alpha_channel_and_small_ones_are_not_enlarged() {
        let dir = tempfile::tempdir().unwrap();
        let small = dir.path().join("small.png");
        let sha = png(&small, 40, 30, 255);
        let p = preview(dir.path(), &small, Some(&sha), &Known::default());
        assert!(!p.alpha);
        assert_eq!(p.thumb_size, Some((40, 30)));
    }

    #[test]
    fn a_changed_file_is_said_so_and_a_missing_one_too() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("x.png");
        png(&file, 10, 10, 255);
        let p = preview(
            dir.path(),
            &file,
            Some(&Sha256Sum::parse(&"ab".repeat(32)).unwrap()),
            &Known::default(),
        );
        assert!(p.note.unwrap().contains("changed on disk"));
        assert!(p.thumb.is_some());
        let gone = preview(
            dir.path(),
            &dir.path().join("gone.png"),
            Some(&Sha256Sum::parse(&"cd".repeat(32)).unwrap()),
            &Known::default(),
        );
        assert!(gone.note.unwrap().contains("not on disk"));
        assert!(!gone.on_disk);
        assert_eq!(gone.thumb, None);
        std::fs::write(&file, b"not an image").unwrap();
        let bad = preview(dir.path(), &file, None, &Known::default());
        assert!(bad.note.unwrap().contains("no preview"));
    }
}
