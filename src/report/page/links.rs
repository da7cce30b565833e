//! Links from the report to the run's files, relative to the report, so the page and the run
//! directory can be moved, zipped or mailed together.

use std::path::{Component, Path, PathBuf};

use crate::place::Address;

/// The href of `target` from a page in `page_dir`. Both are made absolute and normalised the
/// way a browser normalises a file URL (`a/../b` is `b`), never by resolving symlinks: the page
/// is opened by the path it was written to, and its links are resolved against that path.
/// A target with no relative path (another drive) gets a file URL.
pub(super) fn href(page_dir: &Path, target: &Path) -> String {
    let page_dir = normal(page_dir);
    let target = normal(target);
    match relative(&page_dir, &target) {
        Some(rel) => encode(&rel),
        None => format!("file://{}", encode(&target)),
    }
}

/// The file a page links to for a recorded place. A place in object storage is linked by its
/// URL's text taken as a path, as pages always have: the page of a run in object storage
/// rebases its own outputs onto their staged copies first, so only an output kept elsewhere
/// (reused from another run's prefix) reaches here as an object.
pub(super) fn file_of(place: &Address) -> PathBuf {
    match place {
        Address::Local(path) => path.clone(),
        Address::Object(url) => PathBuf::from(url.to_string()),
    }
}

/// `path` made absolute, without `.` and with each `..` taking the segment before it.
pub(super) fn normal(path: &Path) -> PathBuf {
    let path = std::path::absolute(path).unwrap_or_else(|_| path.to_owned());
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            c => out.push(c.as_os_str()),
        }
    }
    out
}

/// The path from directory `from` to `to`, when both start at the same root.
pub(super) fn relative(from: &Path, to: &Path) -> Option<PathBuf> {
    let from: Vec<Component> = from.components().collect();
    let to: Vec<Component> = to.components().collect();
    if from.first() != to.first() {
        return None;
    }
    let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
    let mut rel = PathBuf::new();
    for _ in common..from.len() {
        rel.push("..");
    }
    for c in &to[common..] {
        rel.push(c.as_os_str());
    }
    Some(rel)
}

/// Percent-encodes each path segment, keeping `/` between them.
fn encode(path: &Path) -> String {
    let mut out = String::new();
    for (i, c) in path.components().enumerate() {
        match c {
            Component::RootDir => {
                out.push('/');
                continue;
            }
            _ if i > 0 && !out.ends_with('/') => out.push('/'),
            _ => {}
        }
        for b in c.as_os_str().as_encoded_bytes() {
            match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                    out.push(char::from(*b));
                }
                _ => out.push_str(&format!("%{b:02X}")),
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_place_is_linked_by_its_path_or_its_url_text() {
        assert_eq!(
            file_of(&Address::recorded("out/r1/a/x.png")),
            PathBuf::from("out/r1/a/x.png")
        );
        assert_eq!(
            file_of(&Address::recorded("s3://b/runs/r0/a/x.png")),
            PathBuf::from("s3://b/runs/r0/a/x.png")
        );
    }

    #[test]
    fn relative_paths_climb_out_and_back_in() {
        let r = |a: &str, b: &str| relative(Path::new(a), Path::new(b)).unwrap();
        assert_eq!(
            r("/runs/r1", "/runs/r1/mug/shot-0.png"),
            Path::new("mug/shot-0.png")
        );
        assert_eq!(
            r("/home/me/reports", "/runs/r1/_thumbs/ab.png"),
            Path::new("../../../runs/r1/_thumbs/ab.png")
        );
        assert_eq!(r("/a/b", "/a/b"), Path::new(""));
    }

    #[test]
    fn paths_are_normalised_like_file_urls_not_through_symlinks() {
        assert_eq!(normal(Path::new("/a/b/../c/./d")), Path::new("/a/c/d"));
        assert_eq!(normal(Path::new("/../x")), Path::new("/x"));
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("shared/team/reports");
        std::fs::create_dir_all(&real).unwrap();
        std::os::unix::fs::symlink(&real, dir.path().join("reports")).unwrap();
        let target = dir.path().join("out/r/a.png");
        assert_eq!(href(&dir.path().join("reports"), &target), "../out/r/a.png");
    }

    #[test]
    fn hrefs_are_percent_encoded_per_segment() {
        assert_eq!(
            encode(Path::new("../my runs/a#1/x?.png")),
            "../my%20runs/a%231/x%3F.png"
        );
        assert_eq!(encode(Path::new("/tmp/é.png")), "/tmp/%C3%A9.png");
    }
}
