//! The run's items a page at a time, filtered, and what changed since a moment: the JSON the
//! run page draws and follows the run with (`docs/reference/review-api.md`).

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::Desk;
use crate::place::Address;
use crate::run_id::RunId;
use crate::store::{
    EarlierOutput, ItemFilter, PageItem, PageTask, ReportOutput, Run, RunStatus, ShownVerdict,
    TaskStatus,
};
use crate::task_key::TaskKey;

/// Items a page holds unless asked otherwise, and the most it may hold.
const LIMIT: u32 = 50;
const MOST: u32 = 500;

/// How far before the moment asked a poll looks again: a writer stamps its rows before it
/// commits them, so a row may become visible after a later one.
const OVERLAP_MS: i64 = 2_000;

/// Changed items one poll answers at most, the earliest changed first.
const CHANGED: u32 = 500;

/// A refusal of the query, naming the parameter.
fn bad(message: String) -> Response {
    (
        StatusCode::BAD_REQUEST,
        Json(json!({ "error": message, "hint": Value::Null })),
    )
        .into_response()
}

fn failed(e: impl std::fmt::Display) -> Response {
    (
        StatusCode::INTERNAL_SERVER_ERROR,
        Json(json!({ "error": e.to_string(), "hint": Value::Null })),
    )
        .into_response()
}

/// What a query asks: the page and the filter.
#[derive(Debug, Default, PartialEq, Eq)]
struct Asked {
    after: Option<String>,
    limit: u32,
    since: Option<i64>,
    filter: ItemFilter,
}

/// Reads the query's parameters, refusing any it does not know or cannot read.
fn asked(query: Option<&str>) -> Result<Asked, String> {
    let mut a = Asked {
        limit: LIMIT,
        ..Asked::default()
    };
    let flag = |k: &str, v: &str| match v {
        "1" | "true" | "yes" => Ok(true),
        "" | "0" | "false" | "no" => Ok(false),
        _ => Err(format!("{k}: `{v}` is not a flag; give 1 or 0")),
    };
    for (k, v) in url::form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
        let v = v.as_ref();
        match k.as_ref() {
            "after" if !v.is_empty() => a.after = Some(v.to_owned()),
            "after" | "token" => {}
            "limit" => {
                a.limit = v
                    .parse()
                    .ok()
                    .filter(|n| (1..=MOST).contains(n))
                    .ok_or_else(|| format!("limit: `{v}` is not a number from 1 to {MOST}"))?;
            }
            "since" => {
                a.since = Some(
                    v.parse()
                        .map_err(|_| format!("since: `{v}` is not a stamp (milliseconds)"))?,
                );
            }
            "status" if v.is_empty() => {}
            "status" => {
                a.filter.status = Some(TaskStatus::parse(v).ok_or_else(|| {
                    format!(
                        "status: `{v}` is not a task status (pending, running, succeeded, failed, blocked)"
                    )
                })?);
            }
            "step" => a.filter.step = Some(v.to_owned()).filter(|s| !s.is_empty()),
            "q" => a.filter.text = Some(v.to_owned()).filter(|s| !s.trim().is_empty()),
            "failed" => a.filter.failed = flag("failed", v)?,
            "possibly_billed" => a.filter.possibly_billed = flag("possibly_billed", v)?,
            "rerolled" => a.filter.rerolled = flag("rerolled", v)?,
            "flagged" => a.filter.flagged = flag("flagged", v)?,
            other => {
                return Err(format!(
                    "`{other}` is not a parameter of this request (after, limit, status, step, failed, possibly_billed, rerolled, flagged, q)"
                ));
            }
        }
    }
    Ok(a)
}

/// The run asked for, or the answer saying there is none.
async fn the_run(desk: &Desk, run: &str) -> Result<Run, Response> {
    let id = RunId::from(run);
    match desk.store.runs().get(&id).await {
        Ok(Some(run)) => Ok(run),
        Ok(None) => Err((
            StatusCode::NOT_FOUND,
            Json(json!({ "error": format!("no run {id} in this state database"), "hint": Value::Null })),
        )
            .into_response()),
        Err(e) => Err(failed(e)),
    }
}

/// Calls without an answer count as possibly billed once the run is no longer going.
fn unanswered(run: &Run) -> bool {
    run.status != RunStatus::Running
}

/// `GET /api/runs/{run}/items`: a page of items after `after`, matching the filter.
pub async fn items(
    State(desk): State<Arc<Desk>>,
    Path(run): Path<String>,
    RawQuery(query): RawQuery,
) -> Response {
    let asked = match asked(query.as_deref()) {
        Ok(a) => a,
        Err(e) => return bad(e),
    };
    let run = match the_run(&desk, &run).await {
        Ok(run) => run,
        Err(answer) => return answer,
    };
    let report = desk.store.report();
    // The stamp first: what changes while the page is read is seen by the next poll.
    let since = match report.stamp(&run.id).await {
        Ok(s) => s,
        Err(e) => return failed(e),
    };
    let page = report
        .item_page(
            &run.id,
            asked.after.as_deref(),
            asked.limit,
            &asked.filter,
            unanswered(&run),
        )
        .await;
    match page {
        Ok(page) => Json(json!({
            "run_id": run.id,
            "status": run.status.as_str(),
            "items": page.items.iter().map(|i| item_json(&run, i)).collect::<Vec<_>>(),
            "next": page.next,
            "since": since,
        }))
        .into_response(),
        Err(e) => failed(e),
    }
}

/// `GET /api/runs/{run}/changes?since=STAMP`: the items with a task whose state changed or an
/// output downloaded since `since` (the `since` of the last answer), those matching the
/// filter whole, the others by id in `unmatched`; and the `since` to ask with next.
pub async fn changes(
    State(desk): State<Arc<Desk>>,
    Path(run): Path<String>,
    RawQuery(query): RawQuery,
) -> Response {
    let asked = match asked(query.as_deref()) {
        Ok(a) => a,
        Err(e) => return bad(e),
    };
    let Some(since) = asked.since else {
        return bad("since: give the `since` of the last answer".to_owned());
    };
    let run = match the_run(&desk, &run).await {
        Ok(run) => run,
        Err(answer) => return answer,
    };
    let report = desk.store.report();
    let answer = async {
        let now = report.stamp(&run.id).await?;
        let changed = report
            .changed_items(&run.id, since - OVERLAP_MS, CHANGED)
            .await?;
        let matching = report
            .matching(&run.id, &changed, &asked.filter, unanswered(&run))
            .await?;
        let unmatched: Vec<&String> = changed.iter().filter(|c| !matching.contains(c)).collect();
        let items = report
            .items_named(&run.id, &matching, unanswered(&run))
            .await?;
        // Past the most one poll answers, the next poll goes on from there.
        let next = if changed.len() == CHANGED as usize {
            since
        } else {
            now.max(since)
        };
        Ok::<_, crate::store::StoreError>(json!({
            "run_id": run.id,
            "status": run.status.as_str(),
            "items": items.iter().map(|i| item_json(&run, i)).collect::<Vec<_>>(),
            "unmatched": unmatched,
            "since": next,
        }))
    };
    match answer.await {
        Ok(body) => Json(body).into_response(),
        Err(e) => failed(e),
    }
}

fn item_json(run: &Run, item: &PageItem) -> Value {
    json!({
        "item": item.item,
        "tasks": item.tasks.iter().map(|t| task_json(run, t)).collect::<Vec<_>>(),
    })
}

fn task_json(run: &Run, t: &PageTask) -> Value {
    let task = &t.task;
    let name = TaskKey::new(task.item.as_str(), task.step.as_str(), task.idx).to_string();
    let request: Vec<Value> = task
        .request
        .as_ref()
        .map(|r| {
            r.shown()
                .into_iter()
                .map(|(k, v)| json!({ "name": k, "value": v }))
                .collect()
        })
        .unwrap_or_default();
    json!({
        "task": name,
        "item": task.item,
        "step": task.step,
        "index": task.idx,
        "operation": task.operation,
        "status": task.status.as_str(),
        "planned_credits": task.planned_credits,
        "credits_billed": task.credits_billed,
        "attempts": task.attempts,
        "possibly_billed": t.possibly_billed,
        "job_id": task.job_id,
        "error": task.error,
        "reused_from_run": task.reused_from_run,
        "inputs": task.inputs,
        "prompt": task.request.as_ref().and_then(|r| r.prompt.clone()),
        "request": request,
        "outputs": t.outputs.iter().map(|o| output_json(run, task.idx, &name, o, t.checks.get(&o.id))).collect::<Vec<_>>(),
        "earlier": t.earlier.iter().map(|e| earlier_json(run, task.idx, &name, e)).collect::<Vec<_>>(),
    })
}

/// A file's path in the run's place and the desk's URL of it; `None` for a file kept
/// elsewhere (reused from another run's directory) or not kept.
fn file(run: &Run, place: Option<&Address>) -> (Option<String>, Option<String>) {
    let Some(place) = place else {
        return (None, None);
    };
    match place.relative_to(run.dir().root()) {
        Some(rel) => {
            let src = format!(
                "/runs/{}/files/{}",
                encode(run.id.as_ref()),
                encode_path(&rel)
            );
            (Some(rel), Some(src))
        }
        None => (Some(place.to_string()), None),
    }
}

fn encode(s: &str) -> String {
    url::form_urlencoded::byte_serialize(s.as_bytes())
        .collect::<String>()
        .replace('+', "%20")
}

fn encode_path(rel: &str) -> String {
    rel.split('/').map(encode).collect::<Vec<_>>().join("/")
}

/// The desk's URL of the thumbnail of an output kept in the run's place (`file`, served at
/// `src`), named by its recorded sha256.
fn thumb_of(run: &Run, file: Option<&str>, src: Option<&str>, sha: Option<&str>) -> Option<String> {
    let (rel, _, sha) = (file?, src?, sha?);
    Some(format!(
        "/runs/{}/thumbs/{}?sha={}",
        encode(run.id.as_ref()),
        encode_path(rel),
        encode(sha)
    ))
}

/// An output, with its checks' verdicts (none for a step without checks).
fn output_json(
    run: &Run,
    idx: u32,
    task: &str,
    o: &ReportOutput,
    checks: Option<&Vec<ShownVerdict>>,
) -> Value {
    let (file, src) = file(run, o.place.as_ref());
    let thumb = thumb_of(run, file.as_deref(), src.as_deref(), o.sha256.as_deref());
    json!({
        "task": task,
        "k": o.k,
        "index": idx + o.k,
        "job_id": o.job_id,
        "file": file,
        "src": src,
        "thumb": thumb,
        "sha256": o.sha256,
        "download_error": o.download_error,
        "checks": checks.map_or(&[][..], Vec::as_slice),
    })
}

fn earlier_json(run: &Run, idx: u32, task: &str, e: &EarlierOutput) -> Value {
    let (file, src) = file(run, e.place.as_ref());
    json!({
        "task": task,
        "k": e.k,
        "index": idx + e.k,
        "job_id": e.job_id,
        "file": file,
        "src": src,
        "reason": e.reason,
        "superseded_at": e.superseded_at,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_query_names_what_it_cannot_read() {
        let a = asked(Some(
            "after=mug&limit=10&status=failed&failed=1&q=red%20mug&token=x",
        ))
        .unwrap();
        assert_eq!(a.after.as_deref(), Some("mug"));
        assert_eq!(a.limit, 10);
        assert_eq!(a.filter.status, Some(TaskStatus::Failed));
        assert!(a.filter.failed && !a.filter.rerolled);
        assert_eq!(a.filter.text.as_deref(), Some("red mug"));
        assert!(asked(Some("limit=0")).unwrap_err().starts_with("limit:"));
        assert!(
            asked(Some("status=done"))
                .unwrap_err()
                .starts_with("status:")
        );
        assert!(
            asked(Some("failed=maybe"))
                .unwrap_err()
                .starts_with("failed:")
        );
        assert!(asked(Some("colour=red")).unwrap_err().contains("`colour`"));
    }
}
