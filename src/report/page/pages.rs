//! The report's files: the first page at the path asked for (`report.html`), later pages as
//! its siblings (`report-2.html`, `report-3.html`, …), so links between them are bare file
//! names and the set moves with the run directory.

use std::path::{Path, PathBuf};

/// Items per page file: a page stays light in the browser and in memory while it is made.
pub(super) const PER_PAGE: usize = 100;

/// A test-only setting: items per page file in place of [`PER_PAGE`], so that a test can see a
/// report paged (its pager, its links, each item on one page) with a few dozen items rather
/// than paying for hundreds.
const TEST_PER_PAGE_ENV: &str = "IMGPIPE_TEST_REPORT_PAGE_ITEMS";

/// [`PER_PAGE`], or the positive number [`TEST_PER_PAGE_ENV`] sets; read once.
pub(super) fn per_page() -> usize {
    static PER: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PER.get_or_init(|| {
        std::env::var(TEST_PER_PAGE_ENV)
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|n| *n > 0)
            .unwrap_or(PER_PAGE)
    })
}

/// The pages of one report.
#[derive(Clone, Debug)]
pub(super) struct Pages {
    first: PathBuf,
    count: usize,
}

impl Pages {
    /// The pages for `items` items, the first at `first`; a run with no item still has one.
    pub(super) fn new(first: &Path, items: u64) -> Pages {
        let items = usize::try_from(items).unwrap_or(usize::MAX);
        Pages {
            first: first.to_owned(),
            count: items.div_ceil(per_page()).max(1),
        }
    }

    pub(super) fn count(&self) -> usize {
        self.count
    }

    /// Page `n` (1-based): the first page's name with `-n` before its extension.
    pub(super) fn path(&self, n: usize) -> PathBuf {
        if n <= 1 {
            return self.first.clone();
        }
        let stem = self
            .first
            .file_stem()
            .map_or_else(String::new, |s| s.to_string_lossy().into_owned());
        let name = match self.first.extension() {
            Some(ext) => format!("{stem}-{n}.{}", ext.to_string_lossy()),
            None => format!("{stem}-{n}"),
        };
        self.first.with_file_name(name)
    }

    /// Pages after page `last` that an earlier, longer report of the same name left, stopping
    /// at the first missing name or at a file that is not a report.
    pub(super) fn stale(&self, last: usize) -> impl Iterator<Item = PathBuf> + '_ {
        (last + 1..)
            .map(|n| self.path(n))
            .take_while(|p| super::is_report(p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn later_pages_are_siblings_numbered_before_the_extension() {
        let pages = Pages::new(Path::new("/runs/r1/report.html"), 250);
        assert_eq!(pages.count(), 3);
        assert_eq!(pages.path(1), Path::new("/runs/r1/report.html"));
        assert_eq!(pages.path(3), Path::new("/runs/r1/report-3.html"));
        let bare = Pages::new(Path::new("/tmp/page"), 0);
        assert_eq!(bare.count(), 1);
        assert_eq!(bare.path(2), Path::new("/tmp/page-2"));
    }
}
