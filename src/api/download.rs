//! Downloads of result images: streamed, hashed and checked to be a whole image (magic bytes,
//! end marker, promised length), then handed to a [`Destination`] that names and keeps them.
//! Nothing here writes a kept file or object: where an image goes, and how it is never put
//! over another, is the destination's (the `place` module, for a run directory).
//!
//! Result URLs are signed and need no key, and they may point at another host than the API, so
//! the downloader has its own HTTP client that never carries `X-API-Key`.

use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use sha2::{Digest, Sha256};
use tempfile::NamedTempFile;
use tokio::io::AsyncWriteExt;

use crate::api::client::error_chain;
use crate::api::error::excerpt;
use crate::sha256::Sha256Sum;

/// Larger than any image the service documents, small enough to stop a runaway body.
pub const DEFAULT_MAX_BYTES: u64 = 256 * 1024 * 1024;

/// The most of a body held in memory before it goes to a temporary file: larger than most
/// images of the sandbox, small enough that the downloads in flight hold little.
pub const HELD_BYTES: u64 = 256 * 1024;

/// Where checked downloads are kept. The downloader receives and checks; the destination names
/// the file, writes it and never puts it over another. Generic rather than `dyn`: each caller
/// knows its destination, and the futures stay `Send` for the executor's tasks.
pub trait Destination {
    /// What the caller learns of a kept download: where it is, its size and sha256.
    type Kept;

    /// A new temporary file for the body of `<stem>.*` once it outgrows [`HELD_BYTES`], where
    /// the destination wants it (beside the final file, so that it lands by a rename).
    fn spill(
        &self,
        stem: &str,
    ) -> impl Future<Output = Result<NamedTempFile, DownloadError>> + Send;

    /// Keeps `body` as `<stem>.<ext>`: never over something else already there, and what is
    /// there with the very same bytes is a download already done.
    fn keep(
        &self,
        stem: &str,
        body: Checked,
    ) -> impl Future<Output = Result<Self::Kept, DownloadError>> + Send;
}

/// A body that passed the checks of a whole image, for a [`Destination`] to keep.
#[derive(Debug)]
pub struct Checked {
    pub body: Body,
    /// The extension of the image's format, from its magic bytes.
    pub ext: &'static str,
    pub sha256: Sha256Sum,
    pub bytes: u64,
}

/// A body received whole: in memory, or in the destination's temporary file, fsynced.
#[derive(Debug)]
pub enum Body {
    Held(Vec<Bytes>),
    Spilled(NamedTempFile),
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
    /// The destination already holds other bytes under the name: it is never replaced. `at`
    /// names the file or object as the destination shows it.
    #[error("refusing to overwrite {at}: it holds other bytes than this download")]
    Exists { at: String },
    /// The destination's store failed (after its own retries); the destination scrubs the
    /// message of credentials. `store_failed`: the store takes no write now (it refused, or
    /// failed for every request), rather than this one upload failed.
    #[error("{reason}")]
    Store { reason: String, store_failed: bool },
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

    /// Whether the destination failed rather than this download: a full disk or quota, a
    /// permission lost, a read-only file system, or a store refusing writes or failing every
    /// request after its own retries. Every further download into it would fail the same way, so a run stops
    /// paying for outputs it cannot keep; a bad image or an expired URL is this download's
    /// alone.
    pub fn is_storage_failure(&self) -> bool {
        match self {
            DownloadError::Store { store_failed, .. } => *store_failed,
            DownloadError::Io { source, .. } => is_storage_io(source),
            _ => false,
        }
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

/// Whether a write failed for a cause of the file system itself, not of the bytes written:
/// ENOSPC, EDQUOT, EACCES or EPERM, EROFS.
fn is_storage_io(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::StorageFull
            | io::ErrorKind::QuotaExceeded
            | io::ErrorKind::PermissionDenied
            | io::ErrorKind::ReadOnlyFilesystem
    )
}

#[derive(Clone, Debug)]
pub struct Downloader {
    /// Each client is built on its first download: building one loads the system's root
    /// certificates (the largest part of a run's start-up CPU in a profile), and most runs
    /// need only one of the two (the sandbox's URLs are all loopback, a service's none).
    http: Arc<OnceLock<reqwest::Client>>,
    /// For loopback URLs (the sandbox): a proxy from the environment must never see them.
    direct: Arc<OnceLock<reqwest::Client>>,
    connect_timeout: Duration,
    timeout: Duration,
    max_bytes: u64,
}

impl Downloader {
    pub fn new(connect_timeout: Duration, timeout: Duration, max_bytes: u64) -> Self {
        Downloader {
            http: Arc::default(),
            direct: Arc::default(),
            connect_timeout,
            timeout,
            max_bytes,
        }
    }

    /// The client for `url`, built the first time one is needed.
    fn client_for(&self, url: &str) -> Result<&reqwest::Client, DownloadError> {
        let direct = url::Url::parse(url).is_ok_and(|u| crate::api::client::is_loopback(&u));
        let cell = if direct { &self.direct } else { &self.http };
        if let Some(client) = cell.get() {
            return Ok(client);
        }
        let mut builder = reqwest::Client::builder()
            .user_agent(concat!("imgpipe/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(self.connect_timeout)
            .timeout(self.timeout);
        if direct {
            builder = builder.no_proxy();
        }
        let client = builder.build().map_err(|e| DownloadError::Transport {
            reason: format!("cannot set up the HTTP client: {}", error_chain(&e)),
        })?;
        // Two downloads may build one at once: the first kept serves both.
        Ok(cell.get_or_init(|| client))
    }

    /// Downloads `url` and has `dest` keep it as `<stem>.<ext>`, the extension chosen from the
    /// image's magic bytes, once it has passed the checks of a whole image: a body cut short,
    /// too large or not an image never reaches the destination.
    pub async fn fetch<D>(&self, url: &str, dest: &D, stem: &str) -> Result<D::Kept, DownloadError>
    where
        D: Destination + Sync + ?Sized,
    {
        let (response, expected) = self.get(url).await?;
        let (seen, body) = self.receive(response, expected, dest, stem).await?;
        let bytes = seen.bytes;
        let (ext, sha256) = seen.checked()?;
        let body = Checked {
            body,
            ext,
            sha256,
            bytes,
        };
        dest.keep(stem, body).await
    }

    /// The response of `url`, refused or failed statuses turned into errors.
    async fn get(&self, url: &str) -> Result<(reqwest::Response, Option<u64>), DownloadError> {
        let transport = |e: reqwest::Error| DownloadError::Transport {
            reason: error_chain(&e.without_url()),
        };
        let http = self.client_for(url)?;
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

    /// Receives the body, hashing it and keeping the first and last bytes for the format
    /// checks: held in memory up to [`HELD_BYTES`], streamed into the destination's temporary
    /// file (fsynced before this returns) past that.
    async fn receive<D: Destination + Sync + ?Sized>(
        &self,
        response: reqwest::Response,
        expected: Option<u64>,
        dest: &D,
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
                    spilled = Some(spill(dest, stem, std::mem::take(&mut held)).await?);
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

/// The destination's temporary file for a body too large to hold, with what arrived so far
/// written (in one write: a trip to the blocking pool per chunk would cost more).
async fn spill<D: Destination + Sync + ?Sized>(
    dest: &D,
    stem: &str,
    held: Vec<Bytes>,
) -> Result<(NamedTempFile, tokio::io::BufWriter<tokio::fs::File>), DownloadError> {
    let part = dest.spill(stem).await?;
    let io_err = |source| DownloadError::Io {
        path: part.path().to_path_buf(),
        source,
    };
    let handle = part.as_file().try_clone().map_err(io_err)?;
    let mut file = tokio::io::BufWriter::new(tokio::fs::File::from_std(handle));
    file.write_all(&held.concat()).await.map_err(io_err)?;
    Ok((part, file))
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
    fn checked(self) -> Result<(&'static str, Sha256Sum), DownloadError> {
        let ext = image_extension(&self.head).ok_or_else(|| DownloadError::NotImage {
            start: String::from_utf8_lossy(&self.head).into_owned(),
        })?;
        if !looks_complete(ext, &self.tail) {
            return Err(DownloadError::Unfinished {
                got: self.bytes,
                format: ext,
            });
        }
        Ok((ext, Sha256Sum::of_digest(self.hasher.finalize())))
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
    #[cfg(target_os = "linux")]
    fn a_failing_disk_or_store_is_told_from_a_failing_download() {
        let io = |errno| DownloadError::Io {
            path: PathBuf::from("/out/run/a/.shot-0.x.part"),
            source: io::Error::from_raw_os_error(errno),
        };
        // ENOSPC, EDQUOT, EACCES, EPERM, EROFS (Linux numbers).
        for errno in [28, 122, 13, 1, 30] {
            assert!(io(errno).is_storage_failure(), "errno {errno}");
        }
        // EISDIR, ENAMETOOLONG: this file's trouble, not the disk's.
        for errno in [21, 36] {
            assert!(!io(errno).is_storage_failure(), "errno {errno}");
        }
        let store = |store_failed| DownloadError::Store {
            reason: "cannot write s3://b/run/a/shot-0.png: …".into(),
            store_failed,
        };
        assert!(store(true).is_storage_failure());
        assert!(!store(false).is_storage_failure());
        for one in [
            DownloadError::Expired { status: 403 },
            DownloadError::NotImage {
                start: "<html>".into(),
            },
            DownloadError::Exists { at: "x".into() },
            DownloadError::Truncated {
                got: 1,
                expected: 2,
            },
        ] {
            assert!(!one.is_storage_failure(), "{one}");
        }
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
