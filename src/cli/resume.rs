//! `imgpipe resume RUN_ID`, and `run FILE --run-id ID` for a run that exists: continue an
//! interrupted run without paying twice for what it already did.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use clap::Args;
use serde_json::json;

use crate::cli::GlobalArgs;
use crate::cli::connect::Connection;
use crate::cli::run::{RunOptions, Start, build_graph, close, execute, lock, open_existing_store};
use crate::cli::{plan, preflight, summary, validate};
use crate::error::Error;
use crate::exec::resume::{self, Reason, Review};
use crate::pipeline::{self, Pipeline};
use crate::plan::document::PlanDocument;
use crate::plan::graph::Graph;
use crate::store::{RunRow, RunStatus, Store};

/// Tasks listed one by one by `resume --dry-run` before the rest are only counted.
const SHOWN_TASKS: usize = 50;

#[derive(Debug, Args)]
pub struct ResumeArgs {
    /// The run to resume (`imgpipe runs` lists them)
    pub run_id: String,
    /// List what resuming would pay for, and why, without spending anything
    #[arg(long)]
    pub dry_run: bool,
    #[command(flatten)]
    pub opts: RunOptions,
}

pub async fn run(args: &ResumeArgs, global: &GlobalArgs) -> Result<(), Error> {
    let store = open_existing_store(args.opts.state.as_ref(), global.sandbox).await?;
    let result = match store.run(&args.run_id).await? {
        None => Err(crate::cli::runs::no_such_run(&store, &args.run_id)),
        Some(row) => match current_pipeline(&row) {
            Ok(pipeline) => existing(&store, row, pipeline, &args.opts, args.dry_run, global).await,
            Err(e) => Err(e),
        },
    };
    close(store, result).await
}

/// The run's pipeline file as it is now; the run's own copy when the file is gone.
fn current_pipeline(row: &RunRow) -> Result<Pipeline, Error> {
    let path = Path::new(&row.pipeline_file);
    if path.exists() {
        return validate::checked(path, pipeline::load(path));
    }
    tracing::warn!(
        "{} is gone; resuming from the run's own copy of it",
        row.pipeline_file
    );
    recorded_pipeline(row)
}

/// The pipeline file as the run recorded it (when it started, or last adopted a change).
fn recorded_pipeline(row: &RunRow) -> Result<Pipeline, Error> {
    let path = Path::new(&row.pipeline_file);
    validate::checked(
        path,
        pipeline::load_str(
            &row.pipeline_file,
            pipeline::dir_of(path),
            &row.pipeline_text,
        ),
    )
}

/// Resumes the recorded run `row` with `pipeline` (the file as it is now).
pub async fn existing(
    store: &Store,
    row: RunRow,
    pipeline: Pipeline,
    opts: &RunOptions,
    dry_run: bool,
    global: &GlobalArgs,
) -> Result<(), Error> {
    if row.status == RunStatus::Succeeded {
        if dry_run {
            println!("run {} is finished: nothing to pay for", row.id);
            return Ok(());
        }
        return summary::print_finished(store, &row.id, opts.report, global).await;
    }
    if global.sandbox && store.totals(&row.id).await?.succeeded > 0 {
        return Err(Error::usage(
            format!(
                "run {} cannot be resumed on a new embedded sandbox: the jobs and URLs of its finished tasks ended with the sandbox that made them",
                row.id
            ),
            Some(
                "for runs you mean to interrupt and resume, start `imgpipe sandbox` once and point IMGPIPE_BASE_URL at it; or start again with a new --run-id",
            ),
        ));
    }
    let conn = Connection::open(global).await?;
    let (balance, generation) = plan::ask_service(&conn, &pipeline, global).await?;
    let doc = plan::document(&pipeline, generation, balance, opts.max_credits);
    // A price the service no longer states is the one the run was planned with.
    let price = priced_at(&doc, &row);
    let graph = build_graph(&pipeline, &crate::plan::Costs::of(&pipeline, &price))?;
    let changed =
        pipeline.text_sha256 != row.pipeline_sha256 || doc.items.sha256 != row.items_sha256;
    let old = if changed {
        Some(recorded_pipeline(&row).map_err(|_| {
            Error::usage(
                format!(
                    "run {} kept a copy of its pipeline file that no longer reads",
                    row.id
                ),
                Some("resume it with the file it started from, or start a new run"),
            )
        })?)
    } else {
        None
    };
    let previous = old
        .as_ref()
        .map(|p| build_graph(p, &crate::plan::Costs::of(p, &price)))
        .transpose()?;
    let _lock = if dry_run {
        None
    } else {
        Some(lock(store, &row.pipeline_name, &row.id, opts.wait).await?)
    };
    let reuse = opts.reuse || pipeline.reuse;
    let review = resume::review(
        store,
        &row.id,
        &graph,
        previous.as_deref(),
        opts.on_ambiguous,
        reuse,
    )
    .await?;
    if let Some(old) = &old
        && !opts.allow_changes
    {
        return Err(Error::Refused {
            message: format!(
                "the pipeline changed since run {} started: {}",
                row.id,
                describe_changes(old, &pipeline, &graph, &review)
            ),
            hint: Some(
                "resume with --allow-changes to keep the unchanged tasks' results and run the rest again, or give the new work another --run-id"
                    .into(),
            ),
        });
    }
    let spent = preflight::spent(store, &row.id).await?;
    let cap = preflight::cap_of(&doc, spent);
    if dry_run {
        print_review(&row, &graph, &review, cap, global)?;
        return over_cap(&row, &review, cap, &doc);
    }
    over_cap(&row, &review, cap, &doc)?;
    let run = preflight::continue_run(store, &row).await?;
    let applied = resume::apply(
        store,
        &conn.client,
        &row.id,
        &run.dir,
        &graph,
        &review,
        |t| preflight::new_task(&graph, t),
    )
    .await?;
    tracing::info!(
        "resuming run {}: {} task(s) to pay for ({} credits), {} kept, {} recovered by job id, {} file(s) to fetch again, {} reused",
        row.id,
        review.redo.len(),
        review.credits(),
        review.kept.len(),
        applied.recovered,
        applied.refetch,
        applied.reused,
    );
    if changed {
        let text = std::fs::read_to_string(&pipeline.file).unwrap_or(row.pipeline_text.clone());
        store
            .update_run_source(
                &row.id,
                &text,
                &pipeline.text_sha256,
                &doc.items.sha256,
                &serde_json::to_string(&doc).unwrap_or_default(),
                doc.costs.known_credits,
            )
            .await?;
    }
    let start = Start {
        run,
        graph,
        doc,
        discover: false,
        resume: format!("imgpipe resume {}", row.id),
    };
    execute(opts, global, &conn, store, &pipeline, start).await
}

/// The generation price the run was planned (or discovered) with.
fn recorded_price(row: &RunRow) -> Option<crate::plan::GenerationPrice> {
    let doc = serde_json::from_str::<PlanDocument>(&row.plan_json).ok()?;
    doc.prices
        .generation
        .credits
        .is_some()
        .then_some(doc.prices.generation)
}

/// The generation price now, else the one the run was planned with.
fn priced_at(doc: &PlanDocument, row: &RunRow) -> crate::plan::GenerationPrice {
    match doc.prices.generation.credits {
        Some(_) => doc.prices.generation.clone(),
        None => recorded_price(row).unwrap_or_else(|| doc.prices.generation.clone()),
    }
}

/// Refuses what remains when it does not fit the budget left or the balance.
fn over_cap(
    row: &RunRow,
    review: &Review,
    cap: Option<u64>,
    doc: &PlanDocument,
) -> Result<(), Error> {
    let needed = review.credits();
    match cap {
        Some(cap) if needed > cap => Err(Error::Refused {
            message: format!(
                "resuming run {} would pay for {} task(s), {needed} credits, but only {cap} may be spent ({})",
                row.id,
                review.redo.len(),
                limits(doc)
            ),
            hint: Some(
                "raise the budget (--max-credits or budget.max_credits) or top up the account, then resume"
                    .into(),
            ),
        }),
        _ => Ok(()),
    }
}

fn limits(doc: &PlanDocument) -> String {
    let budget = doc.budget.as_ref().map_or_else(
        || "no budget".to_owned(),
        |b| format!("budget {}", b.max_credits),
    );
    let balance = match &doc.balance {
        crate::plan::Balance::Known { credits, .. } => format!("balance {credits}"),
        _ => "balance unknown".to_owned(),
    };
    format!("{budget} less what the run spent, {balance}")
}

/// A short account of what changed: steps and items added, removed or changed, and what
/// that costs.
fn describe_changes(old: &Pipeline, new: &Pipeline, graph: &Graph, review: &Review) -> String {
    let ids = |p: &Pipeline| -> BTreeSet<String> { p.steps.iter().map(|s| s.id.clone()).collect() };
    let (before, after) = (ids(old), ids(new));
    let mut parts = Vec::new();
    let list = |set: Vec<&String>| {
        set.iter()
            .map(|s| format!("`{s}`"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let added: Vec<&String> = after.difference(&before).collect();
    if !added.is_empty() {
        parts.push(format!("step(s) {} added", list(added)));
    }
    let removed: Vec<&String> = before.difference(&after).collect();
    if !removed.is_empty() {
        parts.push(format!("step(s) {} removed", list(removed)));
    }
    let mut by_step: BTreeMap<&str, usize> = BTreeMap::new();
    for r in review.redo.iter().filter(|r| r.reason == Reason::Changed) {
        let step = graph.step_id(r.task);
        if before.contains(step) {
            *by_step.entry(step).or_default() += 1;
        }
    }
    for (step, n) in by_step {
        parts.push(format!("step `{step}` asks something else of {n} task(s)"));
    }
    let items =
        |p: &Pipeline| -> BTreeSet<String> { p.items.iter().map(|i| i.id.clone()).collect() };
    let (was, is) = (items(old), items(new));
    let (gained, lost) = (is.difference(&was).count(), was.difference(&is).count());
    if gained + lost > 0 {
        parts.push(format!("{gained} item(s) added, {lost} removed"));
    }
    if parts.is_empty() {
        parts.push("the file's text differs, but no task changed".into());
    }
    format!(
        "{}; {} task(s) would run again for {} credits, {} keep their results, {} recorded task(s) would be dropped",
        parts.join("; "),
        review.redo.len(),
        review.credits(),
        review.kept.len(),
        review.removed.len()
    )
}

/// `resume --dry-run`: each task to pay for with its reason and credits, then the totals.
fn print_review(
    row: &RunRow,
    graph: &Graph,
    review: &Review,
    cap: Option<u64>,
    global: &GlobalArgs,
) -> Result<(), Error> {
    let name = |t: usize| {
        let (item, step, idx) = graph.key(t);
        format!("{item}/{step}[{idx}]")
    };
    let mut by_reason: BTreeMap<&str, (usize, u64)> = BTreeMap::new();
    for r in &review.redo {
        let e = by_reason.entry(r.reason.as_str()).or_default();
        e.0 += 1;
        e.1 += r.credits;
    }
    if global.json {
        let tasks: Vec<_> = review
            .redo
            .iter()
            .map(|r| {
                let (item, step, idx) = graph.key(r.task);
                json!({"item": item, "step": step, "index": idx, "reason": r.reason,
                       "credits": r.credits, "detail": r.detail})
            })
            .collect();
        let left: Vec<_> = review
            .left_failed
            .iter()
            .map(|r| json!({"task": name(r.task), "credits": r.credits, "detail": r.detail}))
            .collect();
        let doc = json!({
            "run_id": row.id,
            "status": row.status.as_str(),
            "tasks": tasks,
            "credits": review.credits(),
            "by_reason": by_reason.iter().map(|(k, (n, c))| (k.to_string(), json!({"tasks": n, "credits": c}))).collect::<serde_json::Map<_, _>>(),
            "cap": cap,
            "kept": review.kept.len(),
            "recover_by_job_id": review.recover.len(),
            "refetch": review.refetch.iter().map(|r| json!({"path": r.output.path, "modified": r.modified.is_some()})).collect::<Vec<_>>(),
            "reused": review.reuse.len(),
            "saved_by_reuse": review.saved_by_reuse(graph),
            "left_failed": left,
            "removed": review.removed.len(),
        });
        println!("{}", serde_json::to_string_pretty(&doc).unwrap_or_default());
        return Ok(());
    }
    println!(
        "run {} ({}): {} task(s) to pay for, {} credits{}",
        row.id,
        row.status.as_str(),
        review.redo.len(),
        review.credits(),
        cap.map(|c| format!(" (at most {c} may be spent)"))
            .unwrap_or_default()
    );
    for r in review.redo.iter().take(SHOWN_TASKS) {
        let detail = r
            .detail
            .as_deref()
            .map(|d| format!("  {d}"))
            .unwrap_or_default();
        println!(
            "  {:<40} {:<14} {:>6} credits{detail}",
            name(r.task),
            r.reason.as_str(),
            r.credits
        );
    }
    if review.redo.len() > SHOWN_TASKS {
        println!(
            "  ...and {} more (--json lists all)",
            review.redo.len() - SHOWN_TASKS
        );
    }
    for (reason, (n, c)) in &by_reason {
        println!("  {reason}: {n} task(s), {c} credits");
    }
    println!("kept: {} task(s) already done", review.kept.len());
    let free = [
        (
            review.recover.len(),
            "lost answer(s) to read back by job id",
        ),
        (
            review.refetch.len(),
            "file(s) missing or modified, to fetch again from their job",
        ),
        (review.reuse.len(), "task(s) reused from earlier runs"),
        (
            review.removed.len(),
            "recorded task(s) no longer in the pipeline",
        ),
    ];
    for (n, what) in free.iter().filter(|(n, _)| *n > 0) {
        println!("free: {n} {what}");
    }
    for r in &review.left_failed {
        println!(
            "not paid again (--on-ambiguous fail): {} ({} credits)",
            name(r.task),
            r.credits
        );
    }
    Ok(())
}
