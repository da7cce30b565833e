//! `run --discover-price`: one generation alone, never paid for twice, and the price of a 2K
//! image taken from what it billed.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::error::Error;
use crate::exec::{self, Observer};
use crate::plan::graph::{Graph, Work};
use crate::plan::{Balance, GenerationPrice, PriceSource};
use crate::runner::Connection;
use crate::store::{Store, TaskStatus};

/// The discovering call is shown by its own log lines, not by progress bars.
struct Quiet;

impl Observer for Quiet {
    fn task_succeeded(&self, _: usize, _: u64) {}
    fn task_failed(&self, _: usize, _: &str, _: &str) {}
}

/// Runs one generation alone and prices a 2K image from what it billed.
pub(super) async fn price(
    conn: &Connection,
    store: &Store,
    graph: &Arc<Graph>,
    config: &exec::Config,
    balance: &Balance,
    shutdown: &CancellationToken,
) -> Result<GenerationPrice, Error> {
    let Some((t, n, size)) = (0..graph.len())
        .filter(|t| !graph.reads_outputs(*t) && config.scope.contains(graph, *t))
        .find_map(|t| match graph.work(t) {
            Ok(Work::Generate { n, size, .. }) => Some((t, n, size)),
            _ => None,
        })
    else {
        return Err(Error::usage(
            "--discover-price needs a generate step that reads no other step",
            Some("set `pricing: { generation: N }` in the pipeline file"),
        ));
    };
    let images = u64::from(n) * size.price_multiplier();
    tracing::info!("discovering the generation price with one call ({n} image(s) at {size})");
    let mut alone = config.clone();
    alone.only = Some(t);
    // The price is unknown, so only the balance bounds this one call; and it is never paid
    // for twice.
    alone.cap = match balance {
        Balance::Known { credits, .. } => Some(u64::try_from(*credits).unwrap_or(0)),
        _ => None,
    };
    alone.on_ambiguous = exec::OnAmbiguous::Fail;
    let outcome = exec::run(
        Arc::clone(graph),
        exec::Links {
            store: store.clone(),
            client: conn.client.clone(),
            downloader: conn.downloader.clone(),
        },
        alone,
        Arc::new(Quiet),
        shutdown.clone(),
        None,
    )
    .await?;
    if outcome.interrupted {
        return Err(Error::Interrupted { detail: None });
    }
    // The discovering task's row, read among the succeeded ones without holding the rest.
    let (item, step, idx) = graph.key_ref(t);
    let mut found = None;
    store
        .tasks()
        .each(&config.run_id, Some(TaskStatus::Succeeded), |r| {
            if r.key.item == item && r.key.step == step && r.key.index == idx {
                found = Some(r);
            }
        })
        .await?;
    let Some(row) = found else {
        let why = outcome
            .failures
            .first()
            .map(|f| f.1.clone())
            .or_else(|| outcome.stop.as_ref().map(exec::Stop::describe))
            .unwrap_or_else(|| "it did not succeed".into());
        return Err(Error::TasksFailed {
            message: format!("the generation that was to discover the price failed: {why}"),
        });
    };
    let credits = row.credits_billed.div_ceil(images);
    let mut notes = Vec::new();
    if row.credits_billed % images != 0 {
        notes.push(format!(
            "job billed {} credits for {images} 2K-image equivalents; priced at {credits} each (rounded up)",
            row.credits_billed
        ));
    }
    tracing::info!(
        "a 2K generated image costs {credits} credits (billed by job {})",
        row.job_id.as_deref().unwrap_or("?")
    );
    Ok(GenerationPrice {
        credits: Some(credits),
        source: PriceSource::Discovered {
            job_id: row.job_id.clone().unwrap_or_default(),
        },
        notes,
    })
}
