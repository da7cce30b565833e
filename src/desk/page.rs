//! The desk's pages, from maud templates (which escape what they show).

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use maud::{DOCTYPE, html};

use super::Desk;

/// `GET /`: the runs of the state database.
pub(super) async fn home(State(desk): State<Arc<Desk>>) -> Response {
    let lines = match crate::report::runs::lines(&desk.store, |id| (desk.resume)(id)).await {
        Ok(lines) => lines,
        Err(e) => {
            return (axum::http::StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response();
        }
    };
    let page = html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                title { "imgpipe review" }
            }
            body {
                h1 { "Runs" }
                table {
                    thead { tr { th { "run" } th { "pipeline" } th { "status" } th { "planned" } th { "billed" } th { "possibly billed" } th { "started" } th { "finished" } } }
                    tbody {
                        @for l in &lines {
                            tr {
                                td { a href={ "/runs/" (l.id) } { (l.id) } } td { (l.pipeline) } td { (l.status) }
                                td { (l.credits_planned) } td { (l.credits_billed) } td { (l.possibly_billed) }
                                td { (l.started) } td { (l.finished.as_deref().unwrap_or("-")) }
                            }
                        }
                    }
                }
            }
        }
    };
    Html(page.into_string()).into_response()
}

/// `GET /runs/{run}`: the run's page. Its header and costs (summed over every task of the
/// run: a second or two at 100,000 items) come from [`head`] once the page is up; its items,
/// a page at a time from the JSON API, are drawn and kept up to date by its script.
pub(super) async fn run(State(desk): State<Arc<Desk>>, Path(run): Path<String>) -> Response {
    let id = crate::run_id::RunId::from(run.as_str());
    let steps = match desk.store.runs().get(&id).await {
        Ok(Some(run)) => steps_of(&run),
        Ok(None) => {
            return (
                StatusCode::NOT_FOUND,
                format!("no run {id} in this state database"),
            )
                .into_response();
        }
        Err(e) => return (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    };
    let statuses = ["pending", "running", "succeeded", "failed", "blocked"];
    let page = html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { "run " (id) " · imgpipe review" }
                link rel="stylesheet" href="/assets/desk.css";
                script src="/assets/desk.js" defer {}
            }
            body #desk-run data-run=(id) {
                nav.top { a href="/" { "‹ runs" } " " span #live { "" } " " button #help-open type="button" { "? keys" } }
                div #head { header { h1 { "run " (id) } p { "Summing the run's costs…" } } }
                main {
                    section #problems {
                        h2 { "Problems" }
                        p {
                            "Show only: "
                            button.show type="button" data-filter="failed" { "failed, blocked or not downloaded" }
                            " "
                            button.show type="button" data-filter="possibly_billed" { "possibly billed" }
                            " "
                            button.show type="button" data-filter="rerolled" { "done again" }
                        }
                    }
                    section #items {
                        h2 { "Items" }
                        form #filters autocomplete="off" {
                            label { "status " select name="status" { option value="" { "any" } @for s in statuses { option value=(s) { (s) } } } }
                            label { "step " select name="step" { option value="" { "any" } @for s in &steps { option value=(s) { (s) } } } }
                            label { input type="checkbox" name="failed" value="1"; " failed" }
                            label { input type="checkbox" name="possibly_billed" value="1"; " possibly billed" }
                            label { input type="checkbox" name="rerolled" value="1"; " done again" }
                            label { "text " input type="search" name="q" placeholder="item id or prompt words"; }
                        }
                        p #shown {}
                        div #list {}
                        p { button #more type="button" hidden { "next page" } }
                    }
                }
                aside #decide {}
                div #viewer hidden {}
                div #help hidden {
                    h2 { "Keys" }
                    dl {
                        dt { "j / ↓" } dd { "next output" }
                        dt { "k / ↑" } dd { "previous output" }
                        dt { "p" } dd { "pick the output for a reroll (again: unpick)" }
                        dt { "x" } dd { "reject it: picked for a reroll, marked rejected (again: undo)" }
                        dt { "o" } dd { "open the image full size" }
                        dt { "c" } dd { "compare it with its earlier versions" }
                        dt { "?" } dd { "this help" }
                        dt { "Esc" } dd { "close" }
                    }
                }
            }
        }
    };
    Html(page.into_string()).into_response()
}

/// `GET /assets/{name}`: the page's script and style, served by the desk itself (its
/// Content-Security-Policy allows nothing inline and nothing from elsewhere). The style is
/// the report's, with the desk's own after it.
pub(super) async fn asset(Path(name): Path<String>) -> Response {
    match name.as_str() {
        "desk.js" => (
            [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
            include_str!("desk.js"),
        )
            .into_response(),
        "desk.css" => (
            [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
            concat!(
                include_str!("../report/page/page.css"),
                include_str!("desk.css")
            ),
        )
            .into_response(),
        _ => (StatusCode::NOT_FOUND, "no such asset").into_response(),
    }
}

/// The run's steps, as its plan priced them (the step filter's choices).
fn steps_of(run: &crate::store::Run) -> Vec<String> {
    run.plan
        .read::<crate::plan::document::PlanFigures>()
        .map(|p| p.steps().iter().map(|s| s.step.clone()).collect())
        .unwrap_or_default()
}

/// `GET /runs/{run}/head`: the run's header and costs as the report's first page shows them,
/// made by the report's own templates (which escape what they show): a fragment the run page
/// puts in place, and again while the run goes on.
pub(super) async fn head(State(desk): State<Arc<Desk>>, Path(run): Path<String>) -> Response {
    let id = crate::run_id::RunId::from(run.as_str());
    let run = match desk.store.runs().get(&id).await {
        Ok(Some(run)) => run,
        Ok(None) => {
            return (
                StatusCode::NOT_FOUND,
                format!("no run {id} in this state database"),
            )
                .into_response();
        }
        Err(e) => return (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    };
    let made = match crate::report::live::observe(&desk.store, run).await {
        Ok((run, process)) => {
            let observed = crate::report::live::Observed {
                process,
                continue_with: run.status.unfinished().then(|| (desk.resume)(&run.id)),
            };
            crate::report::page::head(&desk.store, run, observed).await
        }
        Err(e) => Err(e.into()),
    };
    match made {
        Ok((head, _)) => Html(head).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}
