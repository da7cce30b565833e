//! The run report: one HTML page per run that shows each item's images from step to step and
//! where every credit went. It reads only the state database and the run's files, so it can
//! be made for any run, finished or still going, without the network.

mod chart;
mod commands;
mod costs;
mod figure;
mod html;
mod items;
mod lineage;
mod links;
pub mod live;
mod model;
mod pages;
mod remote;
pub mod spend;
pub mod summary;
pub mod thumbs;

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::TryStreamExt;

use crate::error::Error;
use crate::place::temp;
use crate::place::{Address, layout};
use crate::report::costs::Problems;
use crate::report::html::{PER_PAGE, Page};
use crate::report::lineage::Lineage;
use crate::report::live::Observed;
use crate::report::model::{Earlier, Model, Shared, Shown};
use crate::store::{EarlierOutput, ReportOutput, ReportRow, ReportTask, RunRow, Store};

pub use html::MARKER;

/// What a written report holds.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Written {
    /// The first page; later ones are its siblings (`report-2.html`, …).
    pub path: Address,
    pub run_id: String,
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
/// [`PER_PAGE`] items, to its numbered siblings, making the thumbnails it lacks. A file that
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
    run: RunRow,
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
    run: RunRow,
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
    let mut rows = store.report_rows(&shared.run.id);
    let mut page = 1;
    let mut on_page: Vec<ReportRow> = Vec::new();
    let mut items = 0;
    let mut item: Option<String> = None;
    while let Some(mut row) = rows.try_next().await? {
        if let (Some(remote), Some(o)) = (&book.remote, row.output.as_mut()) {
            remote.rebase(o);
        }
        if item.as_deref() != Some(row.task.item.as_str()) {
            if items == PER_PAGE {
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

fn cannot_write(path: &Path, e: &dyn std::fmt::Display) -> Error {
    Error::Other(anyhow::anyhow!("cannot write {}: {e}", path.display()))
}

/// The report being written: what the first page gathers from the others.
struct Book<'a> {
    shared: &'a Shared,
    dir: &'a Path,
    thumbs: PathBuf,
    /// The run's place in object storage, staged a page at a time.
    remote: Option<remote::Pages>,
    problems: Problems,
    /// The batch's tasks (first page), which items on later pages may read.
    batch: Vec<ReportTask>,
    /// Which step reads which, for the cost table's order.
    reads: HashSet<(String, String)>,
    /// Outputs whose file is where the record says.
    images: usize,
    made: usize,
    bytes: usize,
    /// The first page's items, kept until its costs and problems are known.
    first_items: String,
    /// Items read.
    items: usize,
}

impl Book<'_> {
    /// Makes the thumbnails of page `page` and writes it (the first page's items are kept
    /// for [`Book::first_page`]).
    async fn page(
        &mut self,
        store: &Store,
        page: usize,
        mut rows: Vec<ReportRow>,
    ) -> Result<(), Error> {
        // Rows of one item come together: number the items, then order each one's tasks as
        // recorded and each task's outputs by index.
        let mut order: HashMap<String, usize> = HashMap::new();
        let mut keyed: Vec<(usize, i64, u32, ReportRow)> = rows
            .drain(..)
            .map(|r| {
                let n = order.len();
                let item = *order.entry(r.task.item.clone()).or_insert(n);
                let k = r.output.as_ref().map_or(0, |o| o.k);
                (item, r.task.id, k, r)
            })
            .collect();
        keyed.sort_unstable_by_key(|(item, id, k, _)| (*item, *id, *k));
        let borrowed = if page > 1 { self.batch.len() } else { 0 };
        let mut tasks: Vec<ReportTask> = if page > 1 {
            self.batch.clone()
        } else {
            Vec::new()
        };
        let mut outputs: Vec<(usize, ReportOutput)> = Vec::new();
        for (_, id, _, row) in keyed {
            if tasks.len() == borrowed || tasks.last().is_none_or(|t| t.id != id) {
                tasks.push(row.task);
            }
            if let Some(o) = row.output {
                outputs.push((tasks.len() - 1, o));
            }
        }
        if page == 1 {
            self.batch = tasks
                .iter()
                .filter(|t| t.item == layout::BATCH)
                .cloned()
                .collect();
        }
        let earlier = self.earlier(store, &tasks, borrowed).await?;
        let mut files: Vec<(PathBuf, Option<String>)> = outputs
            .iter()
            .filter_map(|(_, o)| Some((PathBuf::from(o.path.as_deref()?), o.sha256.clone())))
            .collect();
        // Earlier versions get thumbnails too, where their files are on this machine.
        let local = self.remote.is_none();
        files.extend(earlier.iter().filter_map(|(_, e)| {
            Some((PathBuf::from(e.path.as_deref()?), e.sha256.clone())).filter(|_| local)
        }));
        let (known, staged) = match &self.remote {
            Some(remote) => {
                let on_page: Vec<&ReportOutput> = outputs.iter().map(|(_, o)| o).collect();
                remote.stage(&on_page).await?
            }
            None => Default::default(),
        };
        let previews = thumbs::previews(&self.thumbs, files, &Arc::new(known)).await;
        if let Some(remote) = &self.remote {
            remote.keep(&previews, staged).await?;
        }
        let mut made = previews.into_iter();
        let mut shown: HashMap<usize, Vec<Shown>> = HashMap::new();
        for (t, row) in outputs {
            let preview = if row.path.is_some() {
                made.next().unwrap_or_default()
            } else {
                thumbs::Preview::default()
            };
            self.images += usize::from(preview.on_disk);
            self.made += usize::from(preview.made);
            shown.entry(t).or_default().push(Shown { row, preview });
        }
        let mut was: HashMap<usize, Vec<Earlier>> = HashMap::new();
        for (t, row) in earlier {
            let preview = if local && row.path.is_some() {
                made.next().unwrap_or_default()
            } else {
                thumbs::Preview::default()
            };
            self.made += usize::from(preview.made);
            was.entry(t).or_default().push(Earlier { row, preview });
        }
        let lineage = Lineage::build(&tasks);
        for (from, to) in lineage.reads(&tasks) {
            if !self.reads.contains(&(from.to_owned(), to.to_owned())) {
                self.reads.insert((from.to_owned(), to.to_owned()));
            }
        }
        let model = Model {
            shared: self.shared,
            page,
            borrowed,
            tasks,
            outputs: shown,
            earlier: was,
            lineage,
        };
        let mut html = Page::new(self.shared, self.dir, page);
        let path = self.shared.pages.path(page);
        html.gather(&model, &mut self.problems)
            .map_err(|e| cannot_write(&path, &e))?;
        if page == 1 {
            html.items(&model);
            self.first_items = html.take();
            return Ok(());
        }
        html.open();
        html.later_header();
        html.raw("<main>\n");
        html.items(&model);
        html.close();
        let text = html.take();
        self.bytes += text.len();
        persist(self.dir, &path, |w| w.write_all(text.as_bytes()))
    }

    /// The earlier versions of the outputs of `tasks[from..]` (the page's own), by index in
    /// `tasks`; the database is asked only when the run set any output aside.
    async fn earlier(
        &self,
        store: &Store,
        tasks: &[ReportTask],
        from: usize,
    ) -> Result<Vec<(usize, EarlierOutput)>, Error> {
        if self.shared.superseded == 0 || tasks.len() <= from {
            return Ok(Vec::new());
        }
        let index: HashMap<i64, usize> = tasks
            .iter()
            .enumerate()
            .skip(from)
            .map(|(i, t)| (t.id, i))
            .collect();
        let ids: Vec<i64> = index.keys().copied().collect();
        let rows = store.earlier_outputs(&self.shared.run.id, &ids).await?;
        Ok(rows
            .into_iter()
            .filter_map(|r| Some((*index.get(&r.task_id)?, r)))
            .collect())
    }

    /// Writes the first page: the run's header, costs and problems, then its items.
    fn first_page(&mut self, out: &Path) -> Result<(), Error> {
        let recorded: Vec<&str> = self
            .shared
            .step_totals
            .iter()
            .filter(|s| !s.removed)
            .map(|s| s.step.as_str())
            .collect();
        let order = lineage::order(
            &recorded,
            self.reads.iter().map(|(a, b)| (a.as_str(), b.as_str())),
        );
        let (steps, total, removed) = self.shared.costs(&order);
        let mut html = Page::new(self.shared, self.dir, 1);
        html.open();
        html.header(
            &total,
            self.problems.count(self.shared),
            self.images,
            self.items,
        );
        html.raw("<main>\n");
        html.costs(&steps, &total, removed.as_ref());
        let problems = &mut self.problems;
        let items = std::mem::take(&mut self.first_items);
        let mut bytes = 0;
        persist(self.dir, out, |w| {
            let mut w = Counted { inner: w, bytes: 0 };
            html.problems(problems, &mut w)?;
            w.write_all(html.take().as_bytes())?;
            w.write_all(items.as_bytes())?;
            html.close();
            w.write_all(html.take().as_bytes())?;
            bytes = w.bytes;
            Ok(())
        })?;
        self.bytes += bytes;
        Ok(())
    }
}

/// A writer that counts what went through it.
struct Counted<W> {
    inner: W,
    bytes: usize,
}

impl<W: Write> Write for Counted<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.bytes += n;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Writes a page under a temporary name in `dir` and renames it to `path`, so a reader never
/// sees half a page; a file at `path` that is not a report is left alone.
fn persist(
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
