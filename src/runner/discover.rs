//! `run --discover-price`: one generation alone, never paid for twice, and the price of a 2K
//! image taken from what it billed.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::api::job_id::JobId;
use crate::api::types::Size;
use crate::error::Error;
use crate::exec::{self, Observer};
use crate::money::limit::Balance;
use crate::plan::graph::{Graph, Work};
use crate::plan::scope::Scope;
use crate::plan::{GenerationPrice, PriceSource};
use crate::run_id::RunId;
use crate::runner::Connection;
use crate::store::{Store, TaskStatus};

/// The discovering call is shown by its own log lines, not by progress bars (and so are the
/// downloads of a refused continuation, [`super::refused`]).
pub(super) struct Quiet;

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
    let Some((t, n, size)) = discovering_task(graph, &config.scope) else {
        return Err(Error::usage(
            "--discover-price needs a generate step that reads no other step",
            Some("set `pricing: { generation: N }` in the pipeline file"),
        ));
    };
    tracing::info!("discovering the generation price with one call ({n} image(s) at {size})");
    let links = exec::Links {
        store: store.clone(),
        client: conn.client.clone(),
        downloader: conn.downloader.clone(),
    };
    let alone = alone(config, t, balance);
    let quiet = Arc::new(Quiet);
    let outcome = exec::run(
        Arc::clone(graph),
        links,
        alone,
        quiet,
        shutdown.clone(),
        None,
    );
    let outcome = outcome.await?;
    if outcome.interrupted {
        return Err(Error::Interrupted { detail: None });
    }
    let Some((credits_billed, job_id)) = billed(store, &config.run_id, graph, t).await? else {
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
    let images = u64::from(n) * size.price_multiplier();
    let price = priced(credits_billed, images, job_id.clone());
    tracing::info!(
        "a 2K generated image costs {} (billed by job {})",
        crate::money::credits(price.credits.unwrap_or_default()),
        job_id.as_deref().unwrap_or("?")
    );
    Ok(price)
}

/// The task that discovers the price: the first generation asked for that reads no other
/// step, with its image count and size.
fn discovering_task(graph: &Graph, scope: &Scope) -> Option<(usize, u8, Size)> {
    (0..graph.len())
        .filter(|t| !graph.reads_outputs(*t) && scope.contains(graph, *t))
        .find_map(|t| match graph.work(t) {
            Ok(Work::Generate { n, size, .. }) => Some((t, n, size)),
            _ => None,
        })
}

/// The configuration of the discovering call: task `t` alone, bounded only by the balance
/// (the price is unknown), and never paid for twice.
fn alone(config: &exec::Config, t: usize, balance: &Balance) -> exec::Config {
    let mut alone = config.clone();
    alone.only = Some(t);
    alone.limit = balance.credits();
    alone.on_ambiguous = exec::OnAmbiguous::Fail;
    alone
}

/// What the discovering task was billed, and by which job, once it succeeded: read among the
/// succeeded tasks without holding the rest.
async fn billed(
    store: &Store,
    run_id: &RunId,
    graph: &Graph,
    t: usize,
) -> Result<Option<(u64, Option<JobId>)>, Error> {
    let (item, step, idx) = graph.key_ref(t);
    let mut found = None;
    store
        .tasks()
        .each(run_id, Some(TaskStatus::Succeeded), |r| {
            if r.key.item == item && r.key.step == step && r.key.index == idx {
                found = Some((r.credits_billed, r.job_id));
            }
        })
        .await?;
    Ok(found)
}

/// The price of a 2K generated image, from what a job (`job_id`) billed for `images` 2K-image
/// equivalents: rounded up, and said so when it is.
fn priced(billed: u64, images: u64, job_id: Option<JobId>) -> GenerationPrice {
    let credits = billed.div_ceil(images);
    let mut notes = Vec::new();
    if !billed.is_multiple_of(images) {
        notes.push(format!(
            "job billed {} for {images} 2K-image equivalents; priced at {credits} each (rounded up)",
            crate::money::credits(billed)
        ));
    }
    GenerationPrice {
        credits: Some(credits),
        source: PriceSource::Discovered { job_id },
        notes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_discovered_price_is_what_was_billed_per_2k_image_rounded_up_and_said_so() {
        let exact = priced(12, 4, Some("j1".into()));
        assert_eq!(exact.credits, Some(3));
        assert!(exact.notes.is_empty());
        assert!(
            matches!(exact.source, PriceSource::Discovered { job_id: Some(job_id) } if job_id == *"j1")
        );
        let rounded = priced(13, 4, Some("j2".into()));
        assert_eq!(rounded.credits, Some(4));
        assert_eq!(
            rounded.notes,
            ["job billed 13 credits for 4 2K-image equivalents; priced at 4 each (rounded up)"]
        );
    }
}
