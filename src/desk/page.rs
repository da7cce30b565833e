//! The desk's pages, from maud templates (which escape what they show).

use std::sync::Arc;

use axum::extract::State;
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
                                td { (l.id) } td { (l.pipeline) } td { (l.status) }
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
