//! The report being written: each later page made and written as its items are read, the
//! first page (header, costs, problems of the whole run) kept for last.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::Error;
use crate::place::layout;
use crate::report::page::costs::Problems;
use crate::report::page::html::Page;
use crate::report::page::lineage::{self, Lineage};
use crate::report::page::links::file_of;
use crate::report::page::model::{Earlier, Model, Shared, Shown};
use crate::report::page::thumbs::{self, Preview};
use crate::report::page::{cannot_write, persist, remote};
use crate::sha256::Sha256Sum;
use crate::store::{EarlierOutput, OutputId, ReportEntry, ReportOutput, ReportTask, Store, TaskId};

/// The report being written: what the first page gathers from the others.
pub(super) struct Book<'a> {
    pub(super) shared: &'a Shared,
    pub(super) dir: &'a Path,
    pub(super) thumbs: PathBuf,
    /// The run's place in object storage, staged a page at a time.
    pub(super) remote: Option<remote::Pages>,
    pub(super) problems: Problems,
    /// The batch's tasks (first page), which items on later pages may read.
    pub(super) batch: Vec<ReportTask>,
    /// Which step reads which, for the cost table's order.
    pub(super) reads: HashSet<(String, String)>,
    /// Outputs whose file is where the record says.
    pub(super) images: usize,
    pub(super) made: usize,
    pub(super) bytes: usize,
    /// The first page's items, kept until its costs and problems are known.
    pub(super) first_items: String,
    /// Items read.
    pub(super) items: usize,
}

/// A page's rows sorted into its tasks (each item's as recorded, after the batch's when the
/// page is not the first) and their outputs, each by the index of its task.
#[derive(Debug, Default)]
pub(super) struct Grouped {
    pub(super) tasks: Vec<ReportTask>,
    pub(super) outputs: Vec<(usize, ReportOutput)>,
    /// `tasks[..borrowed]` are the batch's, copied from the first page.
    pub(super) borrowed: usize,
}

/// Sorts page `page`'s rows: the rows of one item come together, so the items are numbered in
/// the order they came, each one's tasks ordered as recorded and each task's outputs by index.
/// A later page starts with the batch's tasks (`batch`), which its items may read.
pub(super) fn group(rows: Vec<ReportEntry>, batch: &[ReportTask], page: usize) -> Grouped {
    let mut order: HashMap<String, usize> = HashMap::new();
    let mut keyed: Vec<(usize, TaskId, u32, ReportEntry)> = rows
        .into_iter()
        .map(|r| {
            let n = order.len();
            let item = *order.entry(r.task.item.clone()).or_insert(n);
            let k = r.output.as_ref().map_or(0, |o| o.k);
            (item, r.task.id, k, r)
        })
        .collect();
    keyed.sort_unstable_by_key(|(item, id, k, _)| (*item, *id, *k));
    let borrowed = if page > 1 { batch.len() } else { 0 };
    let mut tasks: Vec<ReportTask> = batch[..borrowed].to_vec();
    let mut outputs: Vec<(usize, ReportOutput)> = Vec::new();
    for (_, id, _, row) in keyed {
        if tasks.len() == borrowed || tasks.last().is_none_or(|t| t.id != id) {
            tasks.push(row.task);
        }
        if let Some(o) = row.output {
            outputs.push((tasks.len() - 1, o));
        }
    }
    Grouped {
        tasks,
        outputs,
        borrowed,
    }
}

/// The batch's tasks of the first page, which items on later pages may read.
fn batch_of(tasks: &[ReportTask]) -> Vec<ReportTask> {
    tasks
        .iter()
        .filter(|t| t.item == layout::BATCH)
        .cloned()
        .collect()
}

/// The files a page shows, in the order their previews come back: every output kept, then,
/// when the run is on this machine (`local`), every earlier version kept.
pub(super) fn files_to_preview(
    outputs: &[(usize, ReportOutput)],
    earlier: &[(usize, EarlierOutput)],
    local: bool,
) -> Vec<(PathBuf, Option<Sha256Sum>)> {
    let mut files: Vec<(PathBuf, Option<Sha256Sum>)> = outputs
        .iter()
        .filter_map(|(_, o)| Some((file_of(o.place.as_ref()?), o.sha256.clone())))
        .collect();
    // Earlier versions get thumbnails too, where their files are on this machine.
    files.extend(earlier.iter().filter_map(|(_, e)| {
        Some((file_of(e.place.as_ref()?), e.sha256.clone())).filter(|_| local)
    }));
    files
}

/// The page's outputs and earlier versions with their previews, by task index.
#[derive(Default)]
pub(super) struct Attached {
    pub(super) shown: HashMap<usize, Vec<Shown>>,
    pub(super) earlier: HashMap<usize, Vec<Earlier>>,
    /// Outputs whose file is where the record says.
    pub(super) images: usize,
    /// Thumbnails made (not found already made).
    pub(super) made: usize,
}

/// Gives each output and earlier version its preview: `previews` come in the order of
/// [`files_to_preview`], and what has no file (or, not `local`, an earlier version) gets none.
pub(super) fn attach(
    outputs: Vec<(usize, ReportOutput)>,
    earlier: Vec<(usize, EarlierOutput)>,
    previews: Vec<Preview>,
    local: bool,
) -> Attached {
    let mut made = previews.into_iter();
    let mut out = Attached::default();
    for (t, row) in outputs {
        let preview = if row.place.is_some() {
            made.next().unwrap_or_default()
        } else {
            Preview::default()
        };
        out.images += usize::from(preview.on_disk);
        out.made += usize::from(preview.made);
        out.shown.entry(t).or_default().push(Shown { row, preview });
    }
    for (t, row) in earlier {
        let preview = if local && row.place.is_some() {
            made.next().unwrap_or_default()
        } else {
            Preview::default()
        };
        out.made += usize::from(preview.made);
        out.earlier
            .entry(t)
            .or_default()
            .push(Earlier { row, preview });
    }
    out
}

impl Book<'_> {
    /// Makes page `page` of `rows` and writes it (the first page's items are kept for
    /// [`Book::first_page`]), in stages: group the rows, read the earlier versions, make the
    /// previews (staging a run in object storage), attach them, trace the lineage, write.
    pub(super) async fn page(
        &mut self,
        store: &Store,
        page: usize,
        rows: Vec<ReportEntry>,
    ) -> Result<(), Error> {
        let Grouped {
            tasks,
            outputs,
            borrowed,
        } = group(rows, &self.batch, page);
        if page == 1 {
            self.batch = batch_of(&tasks);
        }
        let earlier = self.earlier(store, &tasks, borrowed).await?;
        let verdicts = if self.shared.checks.any() {
            let ids: Vec<OutputId> = outputs.iter().map(|(_, o)| o.id).collect();
            store.verdicts().of_outputs(&ids).await?
        } else {
            HashMap::new()
        };
        let previews = self.previews(&outputs, &earlier).await?;
        let attached = attach(outputs, earlier, previews, self.remote.is_none());
        self.images += attached.images;
        self.made += attached.made;
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
            outputs: attached.shown,
            earlier: attached.earlier,
            verdicts,
            lineage,
        };
        self.write(&model)
    }

    /// The previews of a page's files, thumbnails made where missing; for a run in object
    /// storage, what they need is staged from the bucket first and what they made kept there.
    async fn previews(
        &self,
        outputs: &[(usize, ReportOutput)],
        earlier: &[(usize, EarlierOutput)],
    ) -> Result<Vec<Preview>, Error> {
        let files = files_to_preview(outputs, earlier, self.remote.is_none());
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
        Ok(previews)
    }

    /// Writes a later page, or keeps the first page's items for [`Book::first_page`].
    fn write(&mut self, model: &Model) -> Result<(), Error> {
        let page = model.page;
        let mut html = Page::new(self.shared, self.dir, page);
        let path = self.shared.pages.path(page);
        html.gather(model, &mut self.problems)
            .map_err(|e| cannot_write(&path, &e))?;
        if page == 1 {
            html.items(model);
            self.first_items = html.take();
            return Ok(());
        }
        html.open();
        html.later_header();
        html.raw("<main>\n");
        html.items(model);
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
        let index: HashMap<TaskId, usize> = tasks
            .iter()
            .enumerate()
            .skip(from)
            .map(|(i, t)| (t.id, i))
            .collect();
        let ids: Vec<TaskId> = index.keys().copied().collect();
        let rows = store
            .report()
            .earlier_outputs(&self.shared.run.id, &ids)
            .await?;
        Ok(rows
            .into_iter()
            .filter_map(|r| Some((*index.get(&r.task_id)?, r)))
            .collect())
    }

    /// Writes the first page: the run's header, costs and problems, then its items.
    pub(super) fn first_page(&mut self, out: &Path) -> Result<(), Error> {
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

#[cfg(test)]
mod tests;
