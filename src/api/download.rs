//! Downloads of result images: streamed to a temporary file, checked, fsynced and moved into
//! place, so a file that exists under its final name is always whole.
//!
//! Result URLs are signed and need no key, and they may point at another host than the API, so
//! the downloader has its own HTTP client that never carries `X-API-Key`.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::StreamExt;
use sha2::{Digest, Sha256};
use tempfile::NamedTempFile;
use tokio::io::AsyncWriteExt;

use crate::api::client::error_chain;
use crate::api::error::excerpt;
use crate::place::temp;
use crate::place::{ObjectError, Objects, Place};

/// Larger than any image the service documents, small enough to stop a runaway body.
pub const DEFAULT_MAX_BYTES: u64 = 256 * 1024 * 1024;

/// A file that arrived whole.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Downloaded {
    pub path: PathBuf,
    pub bytes: u64,
    pub sha256: String,
    /// The ETag the store gave the object; `None` for a local file (or a store that gives none).
    pub etag: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum DownloadError {
    #[error(
        "the result URL was refused (HTTP {status}): it has expired or is not valid; fetch a fresh one with GET /v1/jobs/<id>"
    )]
    Expired { status: u16 },
    #[error("the download failed with HTTP {status}: {body}")]
    Http { status: u16, body: String },
    #[error("the download failed: {reason}")]
    Transport { reason: String },
    #[error("the download was cut short: {got} of {expected} bytes")]
    Truncated { got: u64, expected: u64 },
    #[error("the download stopped before the end of the {format} image, after {got} bytes")]
    Unfinished { got: u64, format: &'static str },
    #[error("the download is larger than the limit of {limit} bytes")]
    TooLarge { limit: u64 },
    #[error("the download is not an image (it starts with {start:?})")]
    NotImage { start: String },
    #[error("refusing to overwrite {}: it holds other bytes than this download", path.display())]
    Exists { path: PathBuf },
    /// Object storage failed (after its own retries); the message is scrubbed of credentials.
    #[error("{reason}")]
    Store { reason: String },
    #[error("cannot write {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl DownloadError {
    /// Whether fetching the job again for a fresh URL is the way forward.
    pub fn needs_fresh_url(&self) -> bool {
        matches!(self, DownloadError::Expired { .. })
    }

    /// Whether the same download may succeed when tried again.
    pub fn is_transient(&self) -> bool {
        match self {
            DownloadError::Transport { .. }
            | DownloadError::Truncated { .. }
            | DownloadError::Unfinished { .. } => true,
            DownloadError::Http { status, .. } => *status >= 500 || *status == 429,
            _ => false,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Downloader {
    http: reqwest::Client,
    /// For loopback URLs (the sandbox): a proxy from the environment must never see them.
    direct: reqwest::Client,
    max_bytes: u64,
}

impl Downloader {
    pub fn new(
        connect_timeout: Duration,
        timeout: Duration,
        max_bytes: u64,
    ) -> Result<Self, reqwest::Error> {
        let builder = || {
            reqwest::Client::builder()
                .user_agent(concat!("imgpipe/", env!("CARGO_PKG_VERSION")))
                .connect_timeout(connect_timeout)
                .timeout(timeout)
        };
        Ok(Downloader {
            http: builder().build()?,
            direct: builder().no_proxy().build()?,
            max_bytes,
        })
    }

    /// Downloads `url` to `<dir>/<stem>.<ext>`, the extension chosen from the image's magic
    /// bytes. Never replaces an existing file or object. In object storage the body goes up
    /// once it has passed the image checks: in one create-only PUT when it was small enough
    /// to hold, else from its temporary file in parts; either way nothing is visible under
    /// the final key before the whole body is.
    pub async fn fetch_to(
        &self,
        url: &str,
        dir: &Place,
        stem: &str,
    ) -> Result<Downloaded, DownloadError> {
        match dir {
            Place::Local(dir) => self.fetch(url, dir, stem).await,
            Place::Objects(objects) => self.fetch_object(url, objects, stem).await,
        }
    }

    /// The response of `url`, refused or failed statuses turned into errors.
    async fn get(&self, url: &str) -> Result<(reqwest::Response, Option<u64>), DownloadError> {
        let transport = |e: reqwest::Error| DownloadError::Transport {
            reason: error_chain(&e.without_url()),
        };
        let http = match url::Url::parse(url) {
            Ok(u) if crate::api::client::is_loopback(&u) => &self.direct,
            _ => &self.http,
        };
        let response = http.get(url).send().await.map_err(transport)?;
        let status = response.status().as_u16();
        if matches!(status, 401 | 403 | 410) {
            return Err(DownloadError::Expired { status });
        }
        if !response.status().is_success() {
            let body = response.text().await.unwrap_or_default();
            return Err(DownloadError::Http {
                status,
                body: excerpt(&body),
            });
        }
        let expected = response.content_length();
        if expected.is_some_and(|n| n > self.max_bytes) {
            return Err(DownloadError::TooLarge {
                limit: self.max_bytes,
            });
        }
        Ok((response, expected))
    }

    /// [`Downloader::fetch_to`] a local directory.
    pub async fn fetch(
        &self,
        url: &str,
        dir: &Path,
        stem: &str,
    ) -> Result<Downloaded, DownloadError> {
        let (response, expected) = self.get(url).await?;
        let (seen, body) = self.receive(response, expected, dir, stem).await?;
        let bytes = seen.bytes;
        let (ext, sha256) = seen.checked()?;
        let dest = dir.join(format!("{stem}.{ext}"));
        let (dir, stem, sha) = (dir.to_path_buf(), stem.to_owned(), sha256.clone());
        // The file lands in one trip to the blocking pool: every trip is two thread switches,
        // which cost more than writing a small image.
        let path = blocking(&dest.clone(), move || {
            let part = match body {
                Body::Held(chunks) => {
                    let part = new_part(&dir, &stem, &chunks)?;
                    part.as_file()
                        .sync_all()
                        .map_err(|source| DownloadError::Io {
                            path: part.path().to_path_buf(),
                            source,
                        })?;
                    part
                }
                Body::Spilled(part) => part,
            };
            persist(part, &dest, &sha)
        })
        .await?;
        Ok(Downloaded {
            path,
            bytes,
            sha256,
            etag: None,
        })
    }

    /// [`Downloader::fetch_to`] a bucket: a body too large to hold waits in a temporary
    /// file of the system's temporary directory, which goes when the upload is over.
    async fn fetch_object(
        &self,
        url: &str,
        dir: &Objects,
        stem: &str,
    ) -> Result<Downloaded, DownloadError> {
        let (response, expected) = self.get(url).await?;
        let spill = std::env::temp_dir();
        let (seen, body) = self.receive(response, expected, &spill, stem).await?;
        let bytes = seen.bytes;
        let (ext, sha256) = seen.checked()?;
        let key = dir.key(&format!("{stem}.{ext}"));
        let written = match body {
            Body::Held(chunks) => {
                dir.put_new(&key, chunks.into_iter().collect(), &sha256)
                    .await
            }
            Body::Spilled(part) => dir.put_new_file(&key, part.path(), &sha256).await,
        };
        let etag = written.map_err(|e| match e {
            ObjectError::Exists { url } => DownloadError::Exists { path: url.into() },
            other => DownloadError::Store {
                reason: other.to_string(),
            },
        })?;
        Ok(Downloaded {
            path: dir.key_url(&key).into(),
            bytes,
            sha256,
            etag,
        })
    }

    /// Receives the body, hashing it and keeping the first and last bytes for the format
    /// checks: held in memory up to [`HELD_BYTES`], streamed into a temporary file in `dir`
    /// (fsynced before this returns) past that.
    async fn receive(
        &self,
        response: reqwest::Response,
        expected: Option<u64>,
        dir: &Path,
        stem: &str,
    ) -> Result<(Seen, Body), DownloadError> {
        let mut seen = Seen {
            hasher: Sha256::new(),
            bytes: 0,
            head: Vec::with_capacity(16),
            tail: Vec::with_capacity(32),
        };
        let mut held = Vec::new();
        let mut spilled: Option<(NamedTempFile, tokio::io::BufWriter<tokio::fs::File>)> = None;
        let mut body = response.bytes_stream();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| match expected {
                Some(expected) => DownloadError::Truncated {
                    got: seen.bytes,
                    expected,
                },
                None => DownloadError::Transport {
                    reason: error_chain(&e.without_url()),
                },
            })?;
            seen.bytes += chunk.len() as u64;
            if seen.bytes > self.max_bytes {
                return Err(DownloadError::TooLarge {
                    limit: self.max_bytes,
                });
            }
            seen.observe(&chunk);
            match &mut spilled {
                None if seen.bytes <= HELD_BYTES => held.push(chunk),
                None => {
                    held.push(chunk);
                    spilled = Some(spill(dir, stem, std::mem::take(&mut held)).await?);
                }
                Some((part, file)) => {
                    file.write_all(&chunk)
                        .await
                        .map_err(|source| DownloadError::Io {
                            path: part.path().to_path_buf(),
                            source,
                        })?;
                }
            }
        }
        if let Some(expected) = expected.filter(|e| *e != seen.bytes) {
            return Err(DownloadError::Truncated {
                got: seen.bytes,
                expected,
            });
        }
        let Some((part, mut file)) = spilled else {
            return Ok((seen, Body::Held(held)));
        };
        let io_err = |source| DownloadError::Io {
            path: part.path().to_path_buf(),
            source,
        };
        file.flush().await.map_err(io_err)?;
        file.get_ref().sync_all().await.map_err(io_err)?;
        Ok((seen, Body::Spilled(part)))
    }
}

/// The most of a body held in memory before it goes to a temporary file: larger than most
/// images of the sandbox, small enough that the downloads in flight hold little.
const HELD_BYTES: u64 = 256 * 1024;

/// A body received whole: in memory, or in a temporary file already fsynced.
enum Body {
    Held(Vec<bytes::Bytes>),
    Spilled(NamedTempFile),
}

/// A temporary file in `dir` for a body too large to hold, with what arrived so far written.
async fn spill(
    dir: &Path,
    stem: &str,
    held: Vec<bytes::Bytes>,
) -> Result<(NamedTempFile, tokio::io::BufWriter<tokio::fs::File>), DownloadError> {
    let (dir, stem) = (dir.to_path_buf(), stem.to_owned());
    let (part, handle) = blocking(&dir.clone(), move || {
        let part = new_part(&dir, &stem, &held)?;
        let handle = part
            .as_file()
            .try_clone()
            .map_err(|source| DownloadError::Io {
                path: part.path().to_path_buf(),
                source,
            })?;
        Ok((part, handle))
    })
    .await?;
    Ok((
        part,
        tokio::io::BufWriter::new(tokio::fs::File::from_std(handle)),
    ))
}

/// A new temporary file in `dir` (made if missing) holding `chunks`.
fn new_part(
    dir: &Path,
    stem: &str,
    chunks: &[bytes::Bytes],
) -> Result<NamedTempFile, DownloadError> {
    std::fs::create_dir_all(dir).map_err(|source| DownloadError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let part = part_file(dir, stem)?;
    let mut file = part.as_file();
    for chunk in chunks {
        io::Write::write_all(&mut file, chunk).map_err(|source| DownloadError::Io {
            path: part.path().to_path_buf(),
            source,
        })?;
    }
    Ok(part)
}

/// Runs file work on the blocking pool; `path` names it should the pool fail.
async fn blocking<T: Send + 'static>(
    path: &Path,
    work: impl FnOnce() -> Result<T, DownloadError> + Send + 'static,
) -> Result<T, DownloadError> {
    tokio::task::spawn_blocking(work).await.unwrap_or_else(|e| {
        Err(DownloadError::Io {
            path: path.to_path_buf(),
            source: io::Error::other(e),
        })
    })
}

/// What a download's bytes looked like on the way through.
struct Seen {
    hasher: Sha256,
    bytes: u64,
    head: Vec<u8>,
    tail: Vec<u8>,
}

impl Seen {
    /// The image's extension and sha256, once it has passed the checks of a whole image.
    fn checked(self) -> Result<(&'static str, String), DownloadError> {
        let ext = image_extension(&self.head).ok_or_else(|| DownloadError::NotImage {
            start: String::from_utf8_lossy(&self.head).into_owned(),
        })?;
        if !looks_complete(ext, &self.tail) {
            return Err(DownloadError::Unfinished {
                got: self.bytes,
                format: ext,
            });
        }
        Ok((ext, hex::encode(self.hasher.finalize())))
    }

    fn observe(&mut self, chunk: &[u8]) {
        if self.head.len() < 16 {
            let take = (16 - self.head.len()).min(chunk.len());
            self.head.extend_from_slice(&chunk[..take]);
        }
        self.tail
            .extend_from_slice(&chunk[chunk.len().saturating_sub(32)..]);
        let excess = self.tail.len().saturating_sub(32);
        self.tail.drain(..excess);
        self.hasher.update(chunk);
    }
}

/// Whether an image's last bytes are its format's end marker, so a body cut short without a
/// `Content-Length` to betray it is still caught. Formats without a fixed end pass.
fn looks_complete(ext: &str, tail: &[u8]) -> bool {
    match ext {
        // The last chunk is IEND: its type, then a 4-byte CRC.
        "png" => tail.len() >= 8 && &tail[tail.len() - 8..tail.len() - 4] == b"IEND",
        "jpg" => tail.ends_with(&[0xff, 0xd9]),
        _ => true,
    }
}

/// The extension for an image's magic bytes; `None` when it is no image format we know.
pub fn image_extension(head: &[u8]) -> Option<&'static str> {
    if head.starts_with(b"\x89PNG\r\n\x1a\n") {
        Some("png")
    } else if head.starts_with(&[0xff, 0xd8, 0xff]) {
        Some("jpg")
    } else if head.len() >= 12 && &head[..4] == b"RIFF" && &head[8..12] == b"WEBP" {
        Some("webp")
    } else if head.starts_with(b"GIF87a") || head.starts_with(b"GIF89a") {
        Some("gif")
    } else {
        None
    }
}

/// The sha256 of a file's bytes, read in chunks.
pub fn file_sha256(path: &Path) -> io::Result<String> {
    use std::io::Read;
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match file.read(&mut buf)? {
            0 => return Ok(hex::encode(hasher.finalize())),
            n => hasher.update(&buf[..n]),
        }
    }
}

/// Copies `from`, whose sha256 is known, to `dest` the way a download lands: through a
/// temporary file, fsynced, never replacing a different file already at `dest`.
pub fn copy_checked(from: &Path, dest: &Path, sha256: &str) -> Result<PathBuf, DownloadError> {
    let dir = dest.parent().unwrap_or(Path::new("."));
    let stem = dest
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let part = part_file(dir, &stem)?;
    let io_err = |source| DownloadError::Io {
        path: dest.to_path_buf(),
        source,
    };
    std::fs::copy(from, part.path()).map_err(io_err)?;
    part.as_file().sync_all().map_err(io_err)?;
    persist(part, dest, sha256)
}

/// A download's temporary file next to its destination (see [`temp::part_file`]); removed
/// when dropped unless it is persisted.
fn part_file(dir: &Path, stem: &str) -> Result<NamedTempFile, DownloadError> {
    temp::part_file(dir, stem).map_err(|source| DownloadError::Io {
        path: dir.to_path_buf(),
        source,
    })
}

/// Moves the temporary file to `dest` without ever replacing an existing file (`tempfile`
/// links or renames with no-replace; a rename alone would silently overwrite). An existing
/// file with the very same bytes is a download already done, not a conflict.
fn persist(part: NamedTempFile, dest: &Path, sha256: &str) -> Result<PathBuf, DownloadError> {
    match part.persist_noclobber(dest) {
        Ok(_) => {}
        Err(e) if e.error.kind() == io::ErrorKind::AlreadyExists => {
            if file_sha256(dest).is_ok_and(|existing| existing == sha256) {
                return Ok(dest.to_path_buf());
            }
            return Err(DownloadError::Exists {
                path: dest.to_path_buf(),
            });
        }
        // A file system without hard links or a no-replace rename: copy into a file that must
        // not exist yet; the temporary file goes when `e` is dropped.
        Err(e) => copy_new(e.file.path(), dest)?,
    }
    if let Some(dir) = dest.parent() {
        // Make the new directory entry durable too; a failure here loses nothing already
        // written, so it is not an error.
        let _ = std::fs::File::open(dir).and_then(|d| d.sync_all());
    }
    Ok(dest.to_path_buf())
}

/// Copies `from` to `dest`, creating `dest` and failing if it exists; fsyncs the copy.
fn copy_new(from: &Path, dest: &Path) -> Result<(), DownloadError> {
    let io_err = |source| DownloadError::Io {
        path: dest.to_path_buf(),
        source,
    };
    let mut target = match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(dest)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            return Err(DownloadError::Exists {
                path: dest.to_path_buf(),
            });
        }
        Err(e) => return Err(io_err(e)),
    };
    let copied = std::fs::File::open(from)
        .and_then(|mut source| io::copy(&mut source, &mut target))
        .and_then(|_| target.sync_all());
    if let Err(e) = copied {
        let _ = std::fs::remove_file(dest);
        return Err(io_err(e));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn end_markers_betray_a_cut_image() {
        assert!(looks_complete("png", b"....\0\0\0\0IEND\xaeB`\x82"));
        assert!(!looks_complete(
            "png",
            b"IDAT\x01\x02\x03\x04\x05\x06\x07\x08"
        ));
        assert!(looks_complete("jpg", &[1, 2, 0xff, 0xd9]));
        assert!(!looks_complete("jpg", &[1, 2, 0xff]));
        let mut seen = Seen {
            hasher: Sha256::new(),
            bytes: 0,
            head: Vec::new(),
            tail: Vec::new(),
        };
        for chunk in [
            &b"\x89PNG\r\n\x1a\n0123456789"[..],
            &[7u8; 100][..],
            b"IEND\xaeB`\x82",
        ] {
            seen.observe(chunk);
        }
        assert_eq!(seen.head.len(), 16);
        assert_eq!(seen.tail.len(), 32);
        assert!(looks_complete("png", &seen.tail));
    }

    #[test]
    fn magic_bytes_pick_the_extension() {
        assert_eq!(image_extension(b"\x89PNG\r\n\x1a\n...."), Some("png"));
        assert_eq!(image_extension(&[0xff, 0xd8, 0xff, 0xe0]), Some("jpg"));
        assert_eq!(image_extension(b"RIFF\0\0\0\0WEBPVP8 "), Some("webp"));
        assert_eq!(image_extension(b"<html>"), None);
        assert_eq!(image_extension(b""), None);
    }
}
