//! The run report: one HTML page per run that shows each item's images from step to step and
//! where every credit went. It reads only the state database and the run's files, so it can
//! be made for any run, finished or still going, without the network.

mod chart;
mod costs;
mod html;
mod lineage;
mod links;
mod model;
pub mod summary;
pub mod thumbs;

use std::path::{Path, PathBuf};

use crate::api::temp;
use crate::error::Error;
use crate::layout::RunDir;
use crate::store::{RunRow, Store};

pub use html::MARKER;

/// What a written report holds.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Written {
    pub path: PathBuf,
    pub run_id: String,
    pub status: &'static str,
    pub images: usize,
    pub thumbnails_made: usize,
    pub bytes: usize,
}

/// Writes the report of `run` to `out` (default: `report.html` in the run directory),
/// making the thumbnails it lacks. A file at `out` that is not an imgpipe report is never
/// replaced.
pub async fn write(store: &Store, run: RunRow, out: Option<&Path>) -> Result<Written, Error> {
    let run_dir = RunDir::at(run.dir());
    let out = out.map_or_else(|| run_dir.report(), Path::to_owned);
    let out = links::normal(&out);
    refuse_foreign(&out)?;
    let dir = out.parent().unwrap_or(Path::new("/")).to_owned();
    std::fs::create_dir_all(&dir)
        .map_err(|e| Error::Other(anyhow::anyhow!("cannot create {}: {e}", dir.display())))?;
    let model = model::Model::load(store, run, &run_dir.thumbs()).await?;
    let page = html::render(&model, &dir);
    let fail = |e: &dyn std::fmt::Display| {
        Error::Other(anyhow::anyhow!("cannot write {}: {e}", out.display()))
    };
    let tmp = temp::readable(&dir).map_err(|e| fail(&e))?;
    std::fs::write(tmp.path(), &page).map_err(|e| fail(&e))?;
    tmp.persist(&out).map_err(|e| fail(&e.error))?;
    Ok(Written {
        path: out,
        run_id: model.run.id.clone(),
        status: model.run.status.as_str(),
        images: model.images_on_disk(),
        thumbnails_made: model.thumbnails_made(),
        bytes: page.len(),
    })
}

/// Refuses to replace a file that is not an earlier report.
fn refuse_foreign(out: &Path) -> Result<(), Error> {
    use std::io::Read;
    let Ok(file) = std::fs::File::open(out) else {
        return Ok(());
    };
    let mut head = Vec::new();
    let _ = file.take(256).read_to_end(&mut head);
    if out.is_dir() || !String::from_utf8_lossy(&head).contains(MARKER) {
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
