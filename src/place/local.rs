//! Local files, written the way a download lands: through a temporary file beside the final
//! name, fsynced, then linked or renamed into place without ever replacing a file that holds
//! other bytes. A local directory is a download's [`Destination`]; resuming and reusing copy
//! files the same way ([`copy_checked`]).

use std::io;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use tempfile::NamedTempFile;

use crate::api::download::{Body, Checked, Destination, DownloadError};
use crate::sha256::Sha256Sum;

use super::temp;

/// A download kept in a local directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalFile {
    pub path: PathBuf,
    pub bytes: u64,
    pub sha256: Sha256Sum,
    /// The file's [`stamp`] once in place.
    pub stamp: Option<String>,
}

/// What says a file is the one written, without reading it: its size, inode and change time
/// (`file:<size>:<inode>:<ctime>`). Any write to the file, or a file put in its place, gives
/// another; unlike the modification time, the change time cannot be set back by hand. A resume
/// hashes only the files whose stamp is not the recorded one (as it asks object storage only
/// about objects whose listed ETag is not the recorded one). The one write it cannot see is one
/// of the same size, to the same inode, within the tick of the file system's clock in which
/// imgpipe wrote the file.
pub fn stamp(path: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path)
        .ok()
        .filter(std::fs::Metadata::is_file)?;
    Some(format!(
        "file:{}:{}:{}.{:09}",
        meta.len(),
        meta.ino(),
        meta.ctime(),
        meta.ctime_nsec()
    ))
}

/// A local directory (made when the first file goes in): `<dir>/<stem>.<ext>`, its temporary
/// file `<dir>/.<stem>.<random>.part`, which a resume recognises as left behind.
impl Destination for Path {
    type Kept = LocalFile;

    async fn spill(&self, stem: &str) -> Result<NamedTempFile, DownloadError> {
        spill_in(self, stem).await
    }

    async fn keep(&self, stem: &str, body: Checked) -> Result<LocalFile, DownloadError> {
        let Checked {
            body,
            ext,
            sha256,
            bytes,
        } = body;
        let dest = self.join(format!("{stem}.{ext}"));
        if let Some(full) = crate::failpoint::disk_full() {
            return Err(DownloadError::Io {
                path: self.to_path_buf(),
                source: full,
            });
        }
        let (dir, stem) = (self.to_path_buf(), stem.to_owned());
        // The file lands in one trip to the blocking pool: every trip is two thread switches,
        // which cost more than writing a small image.
        blocking(&dest.clone(), move || {
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
            let path = persist(part, &dest, &sha256)?;
            Ok(LocalFile {
                stamp: stamp(&path),
                path,
                bytes,
                sha256,
            })
        })
        .await
    }
}

/// Whether files can be written in `dir` now, before anything is paid for: a small file
/// written, synced and removed there, or in its nearest existing parent while `dir` is not
/// made yet (a run makes it with its first output). A full disk or quota, a read-only file
/// system or a permission missing fails here; a disk with a little room passes, and fails at
/// the first output that does not fit (the run then stops its calls).
pub async fn probe(dir: &Path) -> Result<(), DownloadError> {
    let dir = dir.to_path_buf();
    blocking(&dir.clone(), move || {
        let at = dir
            .ancestors()
            .find(|d| d.is_dir())
            .unwrap_or(Path::new("."))
            .to_path_buf();
        let io_err = |source| DownloadError::Io {
            path: at.clone(),
            source,
        };
        if let Some(full) = crate::failpoint::disk_is_full() {
            return Err(io_err(full));
        }
        let mut probe = temp::readable(&at).map_err(io_err)?;
        io::Write::write_all(&mut probe, &[0u8; PROBE_BYTES]).map_err(io_err)?;
        probe.as_file().sync_all().map_err(io_err)?;
        probe.close().map_err(io_err)
    })
    .await
}

/// What [`probe`] writes: a block of most file systems.
const PROBE_BYTES: usize = 4096;

/// A new, empty temporary file for a download of `<stem>.*` in `dir` (made if missing).
pub(super) async fn spill_in(dir: &Path, stem: &str) -> Result<NamedTempFile, DownloadError> {
    let (dir, stem) = (dir.to_path_buf(), stem.to_owned());
    blocking(&dir.clone(), move || new_part(&dir, &stem, &[])).await
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

fn exists(dest: &Path) -> DownloadError {
    DownloadError::Exists {
        at: dest.display().to_string(),
    }
}

/// The sha256 of a file's bytes, read in chunks.
pub fn file_sha256(path: &Path) -> io::Result<Sha256Sum> {
    use std::io::Read;
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match file.read(&mut buf)? {
            0 => return Ok(Sha256Sum::of_digest(hasher.finalize())),
            n => hasher.update(&buf[..n]),
        }
    }
}

/// Copies `from`, whose sha256 is known, to `dest` the way a download lands: through a
/// temporary file, fsynced, never replacing a different file already at `dest`.
pub fn copy_checked(
    from: &Path,
    dest: &Path,
    sha256: &Sha256Sum,
) -> Result<PathBuf, DownloadError> {
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
fn persist(part: NamedTempFile, dest: &Path, sha256: &Sha256Sum) -> Result<PathBuf, DownloadError> {
    match part.persist_noclobber(dest) {
        Ok(_) => {}
        Err(e) if e.error.kind() == io::ErrorKind::AlreadyExists => {
            if file_sha256(dest).is_ok_and(|existing| existing == *sha256) {
                return Ok(dest.to_path_buf());
            }
            return Err(exists(dest));
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
            return Err(exists(dest));
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
