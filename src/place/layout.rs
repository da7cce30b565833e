//! Every name inside a run directory, in one place: `<output_dir>/<run id>/` holds one
//! directory per item, the batch's `_batch/`, `manifest.jsonl`, `report.html`, `_thumbs/`,
//! `_superseded/` and, after a crash, temporary files.
//!
//! Item ids start with a letter or digit and may not be a run file's name, so the names
//! starting with `_` and the run files never meet an item's directory. The names are the same
//! on disk and under a prefix in object storage: a [`RunDir`] gives them as [`Address`]es, or,
//! for a run directory on this machine, as paths.

use crate::run_id::RunId;
use std::path::{Path, PathBuf};

use super::Address;

/// The manifest: one line per downloaded output.
pub const MANIFEST: &str = "manifest.jsonl";
/// The HTML report's default place.
pub const REPORT: &str = "report.html";
/// The directory of a `once` step's outputs.
pub const BATCH: &str = "_batch";
/// The report's thumbnails.
pub const THUMBS: &str = "_thumbs";
/// Outputs a task no longer has (it ran again, or its file was modified), kept rather than
/// deleted: `_superseded/<item>/<name>.o<output id>.<job mark>[.<tag>].<ext>` (see
/// `aside_path`, where outputs are set aside).
pub const SUPERSEDED: &str = "_superseded";
/// Files of a run's own beside its item directories, which no item id may take.
pub const RUN_FILES: [&str; 2] = [MANIFEST, REPORT];

/// The start of a temporary file written whole and renamed into place (manifest, report,
/// thumbnails).
pub const TEMP_PREFIX: &str = ".tmp";
/// The end of a download's temporary file, `.<stem>.<mark><random>.part` (see [`own_mark`]).
pub const PART_SUFFIX: &str = ".part";

/// The start of the temporary file of a download to `<stem>.<ext>`, by this process.
pub fn part_prefix(stem: &str) -> String {
    format!(".{stem}.{}", own_mark())
}

/// Whether `name` is a temporary file a killed process left behind: a download's
/// (in an item's directory) or a file written whole (in the run directory itself).
pub fn is_leftover(name: &str, in_item_dir: bool) -> bool {
    if in_item_dir {
        name.starts_with('.') && name.ends_with(PART_SUFFIX)
    } else {
        name.starts_with(TEMP_PREFIX)
    }
}

/// What a run directory can be named by: an [`Address`], on this machine or not, or a path
/// known to be local (for the code that writes local files: the report's pages, reused copies).
pub trait Root: Clone {
    /// The file or directory `name` inside this directory.
    fn child(&self, name: &str) -> Self;
}

impl Root for Address {
    fn child(&self, name: &str) -> Address {
        self.join(name)
    }
}

impl Root for PathBuf {
    fn child(&self, name: &str) -> PathBuf {
        self.join(name)
    }
}

/// A run's directory, `<output_dir>/<run id>`, and the names of everything in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunDir<R = Address> {
    root: R,
}

impl<R: Root> RunDir<R> {
    pub fn new(output_dir: &R, run_id: &RunId) -> RunDir<R> {
        RunDir {
            root: output_dir.child(run_id),
        }
    }

    /// A run directory already named.
    pub fn at(root: R) -> RunDir<R> {
        RunDir { root }
    }

    pub fn root(&self) -> &R {
        &self.root
    }

    /// The directory of an item's outputs, or of the batch's ([`BATCH`]).
    pub fn item(&self, item: &str) -> R {
        self.root.child(item)
    }

    /// An output file, `<item>/<file name>`.
    pub fn output(&self, item: &str, file_name: &str) -> R {
        self.item(item).child(file_name)
    }

    pub fn manifest(&self) -> R {
        self.root.child(MANIFEST)
    }

    pub fn report(&self) -> R {
        self.root.child(REPORT)
    }

    pub fn thumbs(&self) -> R {
        self.root.child(THUMBS)
    }

    /// Where an item's superseded outputs go.
    pub fn superseded(&self, item: &str) -> R {
        self.root.child(SUPERSEDED).child(item)
    }
}

impl RunDir<Address> {
    /// The same run directory as local paths, when it is on this machine.
    pub fn local(&self) -> Option<RunDir<PathBuf>> {
        self.root
            .as_local()
            .map(|root| RunDir::at(root.to_path_buf()))
    }

    /// Removes the temporary files another process left behind (see [`is_leftover`]): in the
    /// run directory and in each directory directly under it; never this process's own (their
    /// names carry [`own_mark`]), which it may be writing beside the cleaning. Best effort:
    /// what cannot be read or removed stays, and is harmless. In object storage there are
    /// none: an upload is invisible until it is whole.
    pub fn remove_leftovers(&self) {
        let Some(root) = self.root.as_local() else {
            return;
        };
        let Ok(entries) = std::fs::read_dir(root) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                remove_in(&path, true);
            } else if is_foreign_leftover(&entry.file_name().to_string_lossy(), false) {
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

fn remove_in(dir: &Path, in_item_dir: bool) {
    let Ok(files) = std::fs::read_dir(dir) else {
        return;
    };
    for f in files.flatten() {
        if is_foreign_leftover(&f.file_name().to_string_lossy(), in_item_dir) {
            let _ = std::fs::remove_file(f.path());
        }
    }
}

fn is_foreign_leftover(name: &str, in_item_dir: bool) -> bool {
    is_leftover(name, in_item_dir) && !name.contains(own_mark())
}

/// A mark of this process in the names of its temporary files, random: a resume removes the
/// temporary files of the processes before it while its own downloads are under way.
pub fn own_mark() -> &'static str {
    static MARK: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    MARK.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        // The standard library seeds each `RandomState` from the system's randomness.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        format!("{:016x}", h.finish())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_inside_a_run_directory() {
        let run = RunDir::new(&PathBuf::from("out"), &crate::run_id::RunId::from("r1"));
        assert_eq!(run.root(), Path::new("out/r1"));
        assert_eq!(run.item(BATCH), Path::new("out/r1/_batch"));
        assert_eq!(run.output("a", "shot.png"), Path::new("out/r1/a/shot.png"));
        assert_eq!(run.manifest(), Path::new("out/r1/manifest.jsonl"));
        assert_eq!(run.report(), Path::new("out/r1/report.html"));
        assert_eq!(run.thumbs(), Path::new("out/r1/_thumbs"));
        assert_eq!(run.superseded("a"), Path::new("out/r1/_superseded/a"));
        assert_eq!(RunDir::at(PathBuf::from("out/r1")), run);
        let local = RunDir::new(&Address::recorded("out"), &crate::run_id::RunId::from("r1"));
        assert_eq!(local.local(), Some(run));
        let objects = RunDir::new(
            &Address::recorded("s3://bkt/p"),
            &crate::run_id::RunId::from("r1"),
        );
        assert_eq!(objects.local(), None);
        assert_eq!(
            objects.output("a", "shot.png").to_string(),
            "s3://bkt/p/r1/a/shot.png"
        );
        assert_eq!(
            objects.superseded("a").to_string(),
            "s3://bkt/p/r1/_superseded/a"
        );
        assert_eq!(
            objects.manifest().to_string(),
            "s3://bkt/p/r1/manifest.jsonl"
        );
    }

    #[test]
    fn leftovers_are_temporary_files_only() {
        assert!(is_leftover(".shot-0.a1b2c3.part", true));
        assert!(!is_leftover("shot-0.png", true));
        assert!(!is_leftover(".shot-0.png", true));
        assert!(is_leftover(".tmpXy12", false));
        assert!(!is_leftover(MANIFEST, false));
        assert!(!is_leftover(".shot-0.a1b2c3.part", false));
    }
}
