//! The run's HTML page (`imgpipe report`): one page per run (split into numbered siblings past
//! [`PER_PAGE`](pages::PER_PAGE) items) that shows each item's images from step to step and where every credit
//! went. It reads only the state database and the run's files, so it can be made for any run,
//! finished or still going, without the network.
//!
//! The page is its own product, apart from the summary and status beside it in
//! [`crate::report`]: its templates ([`html`], [`items`], [`figure`], [`costs`], [`chart`]),
//! the thumbnails it shows ([`thumbs`]: image decoding and scaling), and, for a run in object
//! storage, the local staging of a page's outputs and thumbnails ([`remote`]).

mod book;
mod chart;
mod commands;
mod costs;
mod figure;
mod html;
mod items;
mod lineage;
mod links;
mod model;
mod pages;
mod remote;
pub mod thumbs;

use std::collections::HashSet;
use std::io::Write;
use std::path::Path;

use futures::TryStreamExt;

use crate::error::Error;
use crate::place::Address;
use crate::place::temp;
use crate::report::live::Observed;
use crate::report::page::book::Book;
use crate::report::page::costs::Problems;
use crate::report::page::model::Shared;
use crate::report::page::pages::per_page;
use crate::run_id::RunId;
use crate::store::{ReportEntry, Run, Store};

pub use html::MARKER;

/// What a written report holds.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Written {
    /// The first page; later ones are its siblings (`report-2.html`, …).
    pub path: Address,
    pub run_id: RunId,
    pub status: &'static str,
    pub images: usize,
    pub thumbnails_made: usize,
    /// Page files written.
    pub pages: usize,
    /// Their size, all together.
    pub bytes: usize,
    /// Whether the run's process is going, for a run recorded as `running`, and how to
    /// continue a run that is not.
    #[serde(flatten)]
    pub observed: Observed,
}

/// Writes the report of `run` to `out` (default: `report.html` in the run directory) and, past
/// [`PER_PAGE`](pages::PER_PAGE) items, to its numbered siblings, making the thumbnails it lacks. A file that
/// is not an imgpipe report is never replaced.
///
/// The run is read item by item from the database and each later page written as soon as its
/// items are read, thumbnails made for that page only; the first page, which holds the costs
/// and problems of the whole run, is written last. Memory holds one page, whatever the run.
///
/// `observed` is what the caller learnt beyond the record ([`live::observe`]): `run`'s status
/// then already says `interrupted` for a run whose process is gone.
pub async fn write(
    store: &Store,
    run: Run,
    out: Option<&Address>,
    observed: Observed,
) -> Result<Written, Error> {
    let out = match (run.dir().root(), out) {
        (Address::Object(_), _) => return remote::write(store, run, out, observed).await,
        (Address::Local(_), Some(Address::Object(o))) => {
            return Err(Error::usage(
                format!(
                    "--out {o}: run {} is in a local directory, and so is its report",
                    run.id
                ),
                Some("give a local file"),
            ));
        }
        (Address::Local(_), out) => out.and_then(Address::as_local),
    };
    write_local(store, run, out, observed, None).await
}

/// [`write`] into a local directory; `remote` stages each page's outputs of a run in object
/// storage in it, and keeps what the page made there.
async fn write_local(
    store: &Store,
    run: Run,
    out: Option<&Path>,
    observed: Observed,
    remote: Option<remote::Pages>,
) -> Result<Written, Error> {
    let Some(run_dir) = run.dir().local() else {
        return Err(Error::Other(anyhow::anyhow!(
            "run {} is not in a local directory",
            run.id
        )));
    };
    let out = out.map_or_else(|| run_dir.report(), Path::to_owned);
    let out = links::normal(&out);
    refuse_foreign(&out)?;
    let dir = out.parent().unwrap_or(Path::new("/")).to_owned();
    std::fs::create_dir_all(&dir)
        .map_err(|e| Error::Other(anyhow::anyhow!("cannot create {}: {e}", dir.display())))?;
    let shared = Shared::load(store, run, &out, observed, remote.is_some()).await?;
    let _writing = thumbs::Writing::start(&run_dir.thumbs());
    // Every page's name is checked before any is written: a refusal leaves no half report.
    for n in 2..=shared.pages.count() {
        refuse_foreign(&shared.pages.path(n))?;
    }
    let mut book = Book {
        problems: Problems::new(&shared).map_err(|e| cannot_write(&out, &e))?,
        shared: &shared,
        dir: &dir,
        thumbs: run_dir.thumbs(),
        remote,
        batch: Vec::new(),
        reads: HashSet::new(),
        images: 0,
        made: 0,
        bytes: 0,
        first_items: String::new(),
        items: 0,
    };
    let mut rows = store.report().rows(&shared.run.id);
    let mut page = 1;
    let mut on_page: Vec<ReportEntry> = Vec::new();
    let mut items = 0;
    let mut item: Option<String> = None;
    while let Some(mut row) = rows.try_next().await? {
        if let (Some(remote), Some(o)) = (&book.remote, row.output.as_mut()) {
            remote.rebase(o);
        }
        if item.as_deref() != Some(row.task.item.as_str()) {
            if items == per_page() {
                book.page(store, page, std::mem::take(&mut on_page)).await?;
                page += 1;
                items = 0;
            }
            items += 1;
            book.items += 1;
            item = Some(row.task.item.clone());
        }
        on_page.push(row);
    }
    drop(rows);
    book.page(store, page, on_page).await?;
    book.first_page(&out)?;
    for stale in shared.pages.stale(page) {
        // A page an earlier, longer report left would still be found next to the new ones.
        std::fs::remove_file(&stale).map_err(|e| cannot_write(&stale, &e))?;
    }
    Ok(Written {
        path: Address::Local(out),
        run_id: shared.run.id.clone(),
        status: shared.run.status.as_str(),
        images: book.images,
        thumbnails_made: book.made,
        pages: page,
        bytes: book.bytes,
        observed: shared.observed.clone(),
    })
}

pub(super) fn cannot_write(path: &Path, e: &dyn std::fmt::Display) -> Error {
    Error::Other(anyhow::anyhow!("cannot write {}: {e}", path.display()))
}

/// Writes a page under a temporary name in `dir` and renames it to `path`, so a reader never
/// sees half a page; a file at `path` that is not a report is left alone.
pub(super) fn persist(
    dir: &Path,
    path: &Path,
    fill: impl FnOnce(&mut std::io::BufWriter<&std::fs::File>) -> std::io::Result<()>,
) -> Result<(), Error> {
    refuse_foreign(path)?;
    let tmp = temp::readable(dir).map_err(|e| cannot_write(path, &e))?;
    let mut w = std::io::BufWriter::with_capacity(256 * 1024, tmp.as_file());
    fill(&mut w)
        .and_then(|()| w.flush())
        .map_err(|e| cannot_write(path, &e))?;
    drop(w);
    tmp.persist(path)
        .map_err(|e| cannot_write(path, &e.error))?;
    Ok(())
}

/// Whether `path` is a file an imgpipe report wrote.
fn is_report(path: &Path) -> bool {
    use std::io::Read;
    let Ok(file) = std::fs::File::open(path) else {
        return false;
    };
    let mut head = Vec::new();
    let _ = file.take(256).read_to_end(&mut head);
    !path.is_dir() && String::from_utf8_lossy(&head).contains(MARKER)
}

/// Refuses to replace a file that is not an earlier report.
fn refuse_foreign(out: &Path) -> Result<(), Error> {
    if std::fs::File::open(out).is_err() {
        return Ok(());
    }
    if !is_report(out) {
        return Err(Error::usage(
            format!(
                "--out {} exists and is not an imgpipe report; it was left as it is",
                out.display()
            ),
            Some("name a new file, or remove that one first"),
        ));
    }
    Ok(())
}

/// The run at a glance and where its credits went, made by the same templates as the first
/// page's header and costs, for the desk's run page: sums and short lists read from the
/// database, never a row per task. Returned with the run's steps, in pipeline order.
pub async fn head(
    store: &Store,
    run: Run,
    observed: Observed,
) -> Result<(String, Vec<String>), Error> {
    let first = Path::new(crate::place::layout::REPORT);
    let shared = Shared::load(store, run, first, observed, true).await?;
    let recorded: Vec<&str> = shared
        .step_totals
        .iter()
        .filter(|s| !s.removed)
        .map(|s| s.step.as_str())
        .collect();
    let order = lineage::order(&recorded, std::iter::empty());
    let (steps, total, removed) = shared.costs(&order);
    let unanswered = shared
        .ambiguous
        .iter()
        .filter(|a| !shared.in_flight(a))
        .count();
    let failed = usize::try_from(total.failed + total.blocked).unwrap_or(usize::MAX);
    let images = store.report().images(&shared.run.id).await?;
    let items = usize::try_from(shared.items).unwrap_or(usize::MAX);
    let mut page = html::Page::new(&shared, Path::new("/"), 1);
    page.live = true;
    page.header(
        &total,
        failed + unanswered,
        usize::try_from(images).unwrap_or(usize::MAX),
        items,
    );
    page.costs(&steps, &total, removed.as_ref());
    Ok((page.take(), order))
}
