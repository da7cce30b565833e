//! Every name inside a run directory, in one place: `<output_dir>/<run id>/` holds one
//! directory per item, the batch's `_batch/`, `manifest.jsonl`, `report.html`, `_thumbs/`,
//! `_superseded/` and, after a crash, temporary files.
//!
//! Item ids start with a letter or digit and may not be a run file's name, so the names
//! starting with `_` and the run files never meet an item's directory. This module depends on
//! nothing but std: the store, the executor and the report all sit above it.

use std::path::{Path, PathBuf};

/// Where a place the user names for state or outputs is a URL (`scheme://…`): its scheme.
/// imgpipe writes only local files, so a URL must never be taken for a relative path (that
/// would create `./s3:/bucket/` and go on as if nothing were wrong).
pub fn url_scheme(place: &str) -> Option<&str> {
    let (scheme, _) = place.split_once("://")?;
    let mut chars = scheme.chars();
    let valid = chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    valid.then_some(scheme)
}

/// A local path from what the user wrote: `file:///abs/path` is that path, any other URL is
/// refused with what to do instead; `what` names the option or field in the message.
pub fn local_path(place: &str, what: &str) -> Result<PathBuf, String> {
    match url_scheme(place) {
        None => Ok(PathBuf::from(place)),
        Some(scheme) if scheme.eq_ignore_ascii_case("file") => {
            let path = &place[scheme.len() + 3..];
            if path.starts_with('/') {
                Ok(PathBuf::from(path))
            } else {
                Err(format!(
                    "{what} `{place}`: a file:// URL names an absolute path (file:///…); or give the path itself"
                ))
            }
        }
        Some(scheme) => Err(format!(
            "{what} `{place}` is a {scheme}:// URL, and imgpipe reads and writes only local files: give a local path (a mounted directory works)"
        )),
    }
}

/// The manifest: one line per downloaded output.
pub const MANIFEST: &str = "manifest.jsonl";
/// The HTML report's default place.
pub const REPORT: &str = "report.html";
/// The directory of a `once` step's outputs.
pub const BATCH: &str = "_batch";
/// The report's thumbnails.
pub const THUMBS: &str = "_thumbs";
/// Outputs a task no longer has (it ran again, or its file was modified), kept rather than
/// deleted: `_superseded/<item>/<name>.o<output id>[.<tag>].<ext>`.
pub const SUPERSEDED: &str = "_superseded";
/// Files of a run's own beside its item directories, which no item id may take.
pub const RUN_FILES: [&str; 2] = [MANIFEST, REPORT];

/// The start of a temporary file written whole and renamed into place (manifest, report,
/// thumbnails).
pub const TEMP_PREFIX: &str = ".tmp";
/// The end of a download's temporary file, `.<stem>.<random>.part`.
pub const PART_SUFFIX: &str = ".part";

/// The start of the temporary file of a download to `<stem>.<ext>`.
pub fn part_prefix(stem: &str) -> String {
    format!(".{stem}.")
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

/// A run's directory, `<output_dir>/<run id>`, and the names of everything in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunDir {
    root: PathBuf,
}

impl RunDir {
    pub fn new(output_dir: &Path, run_id: &str) -> RunDir {
        RunDir {
            root: output_dir.join(run_id),
        }
    }

    /// A run directory already named (the executor's configuration carries it whole).
    pub fn at(root: impl Into<PathBuf>) -> RunDir {
        RunDir { root: root.into() }
    }

    pub fn path(&self) -> &Path {
        &self.root
    }

    pub fn into_path(self) -> PathBuf {
        self.root
    }

    /// The directory of an item's outputs, or of the batch's ([`BATCH`]).
    pub fn item(&self, item: &str) -> PathBuf {
        self.root.join(item)
    }

    /// An output file, `<item>/<file name>`.
    pub fn output(&self, item: &str, file_name: &str) -> PathBuf {
        self.item(item).join(file_name)
    }

    pub fn manifest(&self) -> PathBuf {
        self.root.join(MANIFEST)
    }

    pub fn report(&self) -> PathBuf {
        self.root.join(REPORT)
    }

    pub fn thumbs(&self) -> PathBuf {
        self.root.join(THUMBS)
    }

    /// Where an item's superseded outputs go.
    pub fn superseded(&self, item: &str) -> PathBuf {
        self.root.join(SUPERSEDED).join(item)
    }

    /// Removes the temporary files a killed process left behind (see [`is_leftover`]): in the
    /// run directory and in each directory directly under it. Best effort: what cannot be
    /// read or removed stays, and is harmless.
    pub fn remove_leftovers(&self) {
        let Ok(entries) = std::fs::read_dir(&self.root) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                remove_in(&path, true);
            } else if is_leftover(&entry.file_name().to_string_lossy(), false) {
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
        if is_leftover(&f.file_name().to_string_lossy(), in_item_dir) {
            let _ = std::fs::remove_file(f.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_inside_a_run_directory() {
        let run = RunDir::new(Path::new("out"), "r1");
        assert_eq!(run.path(), Path::new("out/r1"));
        assert_eq!(run.item(BATCH), Path::new("out/r1/_batch"));
        assert_eq!(run.output("a", "shot.png"), Path::new("out/r1/a/shot.png"));
        assert_eq!(run.manifest(), Path::new("out/r1/manifest.jsonl"));
        assert_eq!(run.report(), Path::new("out/r1/report.html"));
        assert_eq!(run.thumbs(), Path::new("out/r1/_thumbs"));
        assert_eq!(run.superseded("a"), Path::new("out/r1/_superseded/a"));
        assert_eq!(RunDir::at("out/r1"), run);
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
