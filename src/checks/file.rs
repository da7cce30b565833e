//! A stored output as a file a check can read: the file itself on disk, or a temporary copy of
//! an object in a bucket (a command check needs a path, and the decoder reads a file). Also
//! the size of an input image, read from its header alone.

use std::io::Cursor;
use std::path::{Path, PathBuf};

use tempfile::NamedTempFile;

use crate::place::{Address, Objects};

/// The bytes of a PNG (or JPEG, or WebP) that hold its dimensions, with room to spare.
const HEADER_BYTES: u64 = 64 * 1024;

/// A stored output to judge, as a local file.
pub enum Local {
    /// The output's own file.
    Own(PathBuf),
    /// A copy of an object, removed when dropped.
    Copy(NamedTempFile),
}

impl Local {
    pub fn path(&self) -> &Path {
        match self {
            Local::Own(path) => path,
            Local::Copy(file) => file.path(),
        }
    }
}

/// The output at `address` as a local file; why not, when it cannot be had.
pub async fn local(address: &Address) -> Result<Local, String> {
    match address {
        Address::Local(path) => Ok(Local::Own(path.clone())),
        Address::Object(url) => {
            let (objects, key) = Objects::at(url).map_err(|e| e.to_string())?;
            let copy = NamedTempFile::new()
                .map_err(|e| format!("cannot make a temporary copy of {url}: {e}"))?;
            match objects.read_to_file(&key, copy.path()).await {
                Ok(Some(_)) => Ok(Local::Copy(copy)),
                Ok(None) => Err(format!("{url} is not there")),
                Err(e) => Err(e.to_string()),
            }
        }
    }
}

/// The width and height of the image at `address`, read from its first bytes; `None` when
/// it cannot be read.
pub async fn dimensions(address: &Address) -> Option<(u32, u32)> {
    let head = match address {
        Address::Local(path) => {
            let path = path.clone();
            tokio::task::spawn_blocking(move || {
                use std::io::Read;
                let mut head = Vec::new();
                std::fs::File::open(path)
                    .and_then(|f| f.take(HEADER_BYTES).read_to_end(&mut head))
                    .ok()
                    .map(|_| head)
            })
            .await
            .ok()??
        }
        Address::Object(url) => {
            let (objects, key) = Objects::at(url).ok()?;
            objects.read_head(&key, HEADER_BYTES).await.ok()??.to_vec()
        }
    };
    image::ImageReader::new(Cursor::new(head))
        .with_guessed_format()
        .ok()?
        .into_dimensions()
        .ok()
}
