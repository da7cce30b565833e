//! The order of a continuation's stages, in one function ([`continue_locked`]). The runner
//! holds the run's lock and makes a plan now; it then calls this once, and does what is its
//! own (showing, the spending recorded, the refusal's fetches, the execution) when this asks,
//! through [`Lifecycle`]. The order is the promise: nothing is paid before the review is
//! admitted and the gate passed, and the review is applied only once the run is reopened.

use crate::api::Client;
use crate::money::{Expected, Priced, Stale};
use crate::store::{Store, StoreError};

use super::{Applied, Choices, Given, Prepared, Refusal, ResumeError, Target, finished, prepare};

/// What the runner does between resume's stages. Each hook is called at most once, in the
/// order of [`continue_locked`]; an error from one ends the continuation.
pub(crate) trait Lifecycle {
    /// The runner's error, into which resume's own are mapped.
    type Error: From<ResumeError> + From<StoreError> + From<Refusal> + From<Stale>;
    /// The run reopened for the executor (its place, its directory, what it spent).
    type Opened;

    /// What the user asked of the continuation.
    fn choices(&self) -> Choices;
    /// The price a confirm agreed to (`--expect-credits`, `--expect-revision`), if any.
    fn expected(&self) -> &Expected;
    /// What the run was billed, plus what its unanswered calls may have cost.
    async fn spent(&self, prepared: &Prepared) -> Result<u64, Self::Error>;
    /// A dry run: the review shown, with its price and the kept outputs' check.
    async fn show(
        &self,
        prepared: &Prepared,
        priced: &Priced,
        spent: u64,
    ) -> Result<(), Self::Error>;
    /// The gate let a confirmed spend through.
    fn admitted(&self, priced: &Priced);
    /// The continuation costs more than may be spent: keep what was paid for (`answers` lost
    /// answers were read back already), record why the run stopped, and give the refusal.
    async fn refused(
        &self,
        prepared: &Prepared,
        refusal: Refusal,
        answers: usize,
    ) -> Result<(), Self::Error>;
    /// The run reopened (recorded running again) before its review is applied.
    async fn reopen(&self, prepared: &Prepared, spent: u64) -> Result<Self::Opened, Self::Error>;
    /// The executor run on what the review left to do.
    async fn execute(&self, opened: Self::Opened, applied: Applied) -> Result<(), Self::Error>;
    /// Whether an execution's result is the run, or the part asked for, done: only then is
    /// a reroll recorded finished.
    fn done(result: &Result<(), Self::Error>) -> bool;
}

/// Continues a run whose lock the runner holds, `given` the plan made now: reviews it, shows
/// a dry run, reads lost answers back when it is over its limit, passes the gate, then
/// reopens it, applies the review and hands it to the executor.
pub(crate) async fn continue_locked<L: Lifecycle>(
    life: &L,
    store: &Store,
    client: &Client,
    given: Given,
    dry_run: bool,
    reroll: Option<&[Target]>,
) -> Result<(), L::Error> {
    let started = std::time::Instant::now();
    let mut prepared = prepare(store, given, life.choices(), reroll).await?;
    tracing::debug!(
        "reviewed run {} in {:.2?}",
        prepared.row.id,
        started.elapsed()
    );
    let mut spent = life.spent(&prepared).await?;
    if dry_run {
        let priced = prepared.priced(store).await?;
        prepared.check_kept(store).await?;
        life.show(&prepared, &priced, spent).await?;
        return Ok(prepared.admit(spent)?);
    }
    // Over its limit, the continuation first reads lost answers back, free: each is a task no
    // longer to pay for, so the run is reviewed again, and may now fit.
    let mut answers = 0;
    if prepared.admit(spent).is_err() && !finished(prepared.row.status, false) {
        answers = prepared.read_back(store, client).await?;
        if answers > 0 {
            let given = prepared.into_given();
            prepared = prepare(store, given, life.choices(), reroll).await?;
            spent = life.spent(&prepared).await?;
        }
    }
    // The gate: the lock is held and the work planned again; what a confirm agreed to must be
    // what this pays for now, and it must fit. The revision digests every recorded task to pay
    // and every item never recorded (100,000 on a night's takeover): only a confirm has one to
    // compare.
    let confirmed = match life.expected().is_bound() {
        true => Some(prepared.priced(store).await?),
        false => None,
    };
    if let Some(priced) = &confirmed {
        crate::money::gate::check(life.expected(), priced)?;
    }
    if let Err(refusal) = prepared.admit(spent) {
        return life.refused(&prepared, refusal, answers).await;
    }
    if let Some(priced) = &confirmed {
        life.admitted(priced);
    }
    let opened = life.reopen(&prepared, spent).await?;
    let run_dir = prepared.row.dir();
    let (applied, after) = prepared.apply(store, client, run_dir).await?;
    let result = life.execute(opened, applied).await;
    after.finish(store, L::done(&result)).await?;
    result
}
