//! Every temporary file imgpipe writes: made by `tempfile` next to where the file will land,
//! so a rename or link puts it in place whole, and removed if it never gets there.
//!
//! The names follow [`super::layout`], so that resuming a killed run recognises and removes what
//! it left behind.

use std::io;
use std::path::Path;

use tempfile::{Builder, NamedTempFile};

use super::layout;

/// Random characters in a temporary file's name: enough that concurrent writers never meet.
const RANDOM_CHARS: usize = 12;

/// A download's temporary file in `dir`, hidden and named after the file it will become and
/// marked as this process's: `.<stem>.<mark><random>.part`. Its mode is an ordinary new
/// file's (`0o666` less the umask), as the image it becomes is the user's to open, not a
/// secret.
pub fn part_file(dir: &Path, stem: &str) -> io::Result<NamedTempFile> {
    let prefix = layout::part_prefix(stem);
    let mut builder = Builder::new();
    builder
        .prefix(&prefix)
        .suffix(layout::PART_SUFFIX)
        .rand_bytes(RANDOM_CHARS);
    with_mode(&mut builder, 0o666);
    builder.tempfile_in(dir)
}

/// A temporary file in `dir` that becomes readable by others (as the umask allows) once
/// persisted: a manifest, a report, a thumbnail or a saved plan is meant to be read, served
/// or mailed.
pub fn readable(dir: &Path) -> io::Result<NamedTempFile> {
    let prefix = format!("{}{}", layout::TEMP_PREFIX, layout::own_mark());
    let mut builder = Builder::new();
    builder.prefix(&prefix);
    with_mode(&mut builder, 0o644);
    builder.tempfile_in(dir)
}

/// `tempfile` makes files only their owner may read (`0o600`); these are not secrets.
#[cfg_attr(not(unix), allow(unused_variables))]
fn with_mode(builder: &mut Builder<'_, '_>, mode: u32) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(std::fs::Permissions::from_mode(mode));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cleanup_removes_other_processes_temporary_files_and_never_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let root = super::super::Address::Local(dir.path().to_path_buf());
        let run = layout::RunDir::at(root);
        let item = dir.path().join("a");
        std::fs::create_dir_all(&item).unwrap();
        // Being written by this process: a download and a report.
        let part = part_file(&item, "shot-0").unwrap();
        let page = readable(dir.path()).unwrap();
        // Left by a process killed before it.
        let theirs = [
            item.join(".shot-1.0123456789abcdefXYZ.part"),
            dir.path().join(".tmpQwErTy"),
        ];
        for path in &theirs {
            std::fs::write(path, b"half").unwrap();
        }
        run.remove_leftovers();
        assert!(theirs.iter().all(|p| !p.exists()), "{theirs:?}");
        assert!(part.path().exists() && page.path().exists());
    }

    #[test]
    fn temporary_names_are_the_ones_resume_cleans_up() {
        let dir = tempfile::tempdir().unwrap();
        let part = part_file(dir.path(), "shot-0").unwrap();
        let name = part
            .path()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        assert!(
            name.starts_with(".shot-0.") && name.ends_with(".part"),
            "{name}"
        );
        assert!(layout::is_leftover(&name, true), "{name}");
        let page = readable(dir.path()).unwrap();
        let name = page
            .path()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        assert!(layout::is_leftover(&name, false), "{name}");
        drop((part, page));
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
