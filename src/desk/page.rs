//! The desk's pages, from maud templates (which escape what they show).

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use maud::{DOCTYPE, Markup, html};

use super::Desk;
use crate::error::Error;
use crate::money::caps::Standing;
use crate::money::ledger::Window;
use crate::money::ledger::{By, Ledger};
use crate::money::planned::PlanFigures;
use crate::report::runs::RunLine;

/// How many UTC days of the spend ledger the home shows: today and the six before.
const LEDGER_DAYS: i64 = 7;

/// The `<meta>` that gives the page's own scripts the token for their `POST`s (the cookie is
/// `HttpOnly`, and a change needs the `Authorization` header). It is only ever in a page the
/// guard served to a request that brought the token; no other origin can read the page (no
/// CORS, a foreign `Host` refused, framing denied), and nothing caches it (`no-store`).
pub(super) fn token_meta(desk: &Desk) -> Markup {
    html! { meta name="imgpipe-desk-token" content=(desk.token.reveal()); }
}

/// `GET /assets/decide.js`: the run page's decisions with their price (`<aside id="decide">`).
pub(super) async fn decide_js() -> Response {
    let script = include_str!("decide.js");
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        script,
    )
        .into_response()
}

/// `GET /assets/decide.css`: the decisions' panel.
pub(super) async fn decide_css() -> Response {
    let style = include_str!("decide.css");
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], style).into_response()
}

/// What the home shows: the runs, the caps, the spend ledger's last days.
struct Home {
    runs: Vec<RunLine>,
    caps: Vec<Standing>,
    ledger: Ledger,
}

/// `GET /`: the runs of the state database, the caps and the spend ledger's last days, read by
/// the code `imgpipe runs`, `imgpipe cap list` and `imgpipe spend` print them with.
pub(super) async fn home(State(desk): State<Arc<Desk>>) -> Response {
    match read_home(&desk).await {
        Ok(home) => Html(home_page(&desk, &home).into_string()).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

async fn read_home(desk: &Desk) -> Result<Home, Error> {
    let store = &desk.store;
    let runs = crate::report::runs::lines(store, |id| (desk.resume)(id)).await?;
    let caps = crate::money::caps::recorded(store).await?;
    let caps = crate::money::caps::standings(store, &caps).await?;
    let today = chrono::Utc::now().date_naive();
    let first = today - chrono::Days::new(LEDGER_DAYS as u64 - 1);
    let since = first.and_hms_opt(0, 0, 0).unwrap_or_default().and_utc();
    let window = Window {
        since: Some(since.timestamp_millis()),
        until: None,
    };
    let ledger = crate::money::ledger::ledger(store, By::Day, window).await?;
    Ok(Home { runs, caps, ledger })
}

fn home_page(desk: &Desk, home: &Home) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                (token_meta(desk))
                title { "imgpipe review" }
                link rel="stylesheet" href="/assets/desk.css";
            }
            body.home {
                h1 { "imgpipe review" }
                (runs_table(&home.runs))
                (caps_table(&home.caps))
                (ledger_table(&home.ledger))
            }
        }
    }
}

fn runs_table(runs: &[RunLine]) -> Markup {
    html! {
        section #runs {
            h2 { "Runs" }
            @if runs.is_empty() {
                p { "No runs in this state database yet." }
            } @else {
                table {
                    thead { tr { th { "run" } th { "pipeline" } th { "status" } th { "planned" } th { "billed" } th { "possibly billed" } th { "started" } th { "finished" } } }
                    tbody {
                        @for l in runs {
                            tr data-run=(l.id) {
                                td { a href={ "/runs/" (l.id) } { (l.id) } }
                                td { (l.pipeline) } td.status { (l.status) }
                                td.n { (l.credits_planned) } td.n { (l.credits_billed) } td.n { (l.possibly_billed) }
                                td { (l.started) } td { (l.finished.as_deref().unwrap_or("-")) }
                            }
                        }
                    }
                }
            }
        }
    }
}

fn caps_table(caps: &[Standing]) -> Markup {
    html! {
        section #caps {
            h2 { "Caps" }
            @if caps.is_empty() {
                p { "No caps. " code { "imgpipe cap set NAME --credits N --per day" } " sets one." }
            } @else {
                table {
                    thead { tr { th { "cap" } th { "pipeline" } th { "per" } th { "limit" } th { "spent" } th { "left" } th { "window ends" } } }
                    tbody {
                        @for c in caps {
                            tr data-cap=(c.name) {
                                td { (c.name) } td { (c.pipeline.as_deref().unwrap_or("(all)")) }
                                td { (c.per.as_str()) } td.n.limit { (c.credits) }
                                td.n.spent { (c.spent) } td.n.left { (c.left) } td { (c.window_end) }
                            }
                        }
                    }
                }
            }
        }
    }
}

fn ledger_table(ledger: &Ledger) -> Markup {
    html! {
        section #spend {
            h2 { "Spend, the last " (LEDGER_DAYS) " days (UTC)" }
            @if ledger.groups.is_empty() {
                p { "Nothing spent or planned in these days." }
            } @else {
                table {
                    thead { tr { th { "day" } th { "planned" } th { "billed" } th { "possibly billed" } th { "calls" } th { "failures" } } }
                    tbody {
                        @for l in &ledger.groups {
                            tr data-day=(l.group) {
                                td { (l.group) } td.n { (l.figures.credits_planned) }
                                td.n.billed { (l.figures.credits_billed) } td.n { (l.figures.possibly_billed) }
                                td.n { (l.figures.calls) } td.n { (l.figures.failures) }
                            }
                        }
                    }
                    tfoot {
                        tr.total {
                            td { "total" } td.n { (ledger.totals.credits_planned) }
                            td.n.billed { (ledger.totals.credits_billed) } td.n { (ledger.totals.possibly_billed) }
                            td.n { (ledger.totals.calls) } td.n { (ledger.totals.failures) }
                        }
                    }
                }
            }
        }
    }
}

/// `GET /runs/{run}`: the run's page. Its header and costs (summed over every task of the
/// run: a second or two at 100,000 items) come from [`head`] once the page is up; its items,
/// a page at a time from the JSON API, are drawn and kept up to date by its script.
pub(super) async fn run(State(desk): State<Arc<Desk>>, Path(run): Path<String>) -> Response {
    let (id, steps, items) = match found(&desk, &run).await {
        Ok(run) => (run.id.clone(), steps_of(&run), items_of(&run)),
        Err(answer) => return answer,
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
                (token_meta(&desk))
                link rel="stylesheet" href="/assets/decide.css";
                script src="/assets/decide.js" defer {}
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
                            " "
                            button.show type="button" data-filter="flagged" { "failed a check" }
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
                            label { input type="checkbox" name="flagged" value="1"; " failed a check" }
                            label { "text " input type="search" name="q" placeholder="item id or prompt words"; }
                        }
                        p #every-step {
                            "Pick a step for every item: "
                            @for s in &steps {
                                button.pick-step type="button" data-step=(s) aria-pressed="false" {
                                    "all " @if let Some(n) = items { (n) " " } "items' " (s)
                                }
                                " "
                            }
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
                        dt { "i" } dd { "pick its whole item for a reroll (again: unpick)" }
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

/// The run a page asks for, or the answer that it is not there (404) or cannot be read.
async fn found(desk: &Desk, run: &str) -> Result<crate::store::Run, Response> {
    let id = crate::run_id::RunId::from(run);
    match desk.store.runs().get(&id).await {
        Ok(Some(run)) => Ok(run),
        Ok(None) => Err((
            StatusCode::NOT_FOUND,
            format!("no run {id} in this state database"),
        )
            .into_response()),
        Err(e) => Err((StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response()),
    }
}

/// How many items the run's plan read (the "all N items' step" buttons), when it says.
fn items_of(run: &crate::store::Run) -> Option<usize> {
    PlanFigures::of(&run.plan).and_then(|p| p.item_count())
}

/// The run's steps, as its plan priced them (the step filter's choices, and a step to pick
/// for every item).
fn steps_of(run: &crate::store::Run) -> Vec<String> {
    PlanFigures::of(&run.plan)
        .map(|p| p.steps().iter().map(|s| s.step.clone()).collect())
        .unwrap_or_default()
}

/// `GET /runs/{run}/head`: the run's header and costs as the report's first page shows them,
/// made by the report's own templates (which escape what they show): a fragment the run page
/// puts in place, and again while the run goes on.
pub(super) async fn head(State(desk): State<Arc<Desk>>, Path(run): Path<String>) -> Response {
    let run = match found(&desk, &run).await {
        Ok(run) => run,
        Err(answer) => return answer,
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
