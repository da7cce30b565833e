//! The review desk (`imgpipe review`): the runs of a state database served live on loopback,
//! to look at, pick, and pay for exactly what is wrong.
//!
//! - [`guard`]: what every request passes (the desk's own `Host`, its token, and for a change
//!   a JSON `POST` with the token in its header from the desk's own origin) and what every
//!   response carries (a Content-Security-Policy allowing nothing from elsewhere);
//! - [`api`]: the JSON API, the same documents the command line prints
//!   (`docs/reference/review-api.md`);
//! - [`token`]: the secret in the printed URL;
//! - [`session`]: the page's cookie, a secret of its own that the token's URL opens;
//! - `server`: the connections, each bounded in time and in number;
//! - [`work`]: the work started from the desk, followed for the page and waited for at the end;
//! - the run page (`page`, its script `desk.js` and style): the report's header and costs,
//!   then the items a page at a time from [`items`] (paged and filtered by the database,
//!   followed live), the images from [`files`], picked and compared by keyboard; its
//!   decisions with their price (`decide.js`, in its `<aside id="decide">`).
//!
//! It reads the state database as `status` and `runs` do (SQLite or PostgreSQL, any run, on
//! this host or another's) and holds nothing of a run in memory between requests.

pub mod api;
pub mod files;
pub mod guard;
pub mod items;
mod page;
mod server;
pub mod session;
pub mod thumbs;
pub mod token;
mod view;
pub mod work;

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::run_id::RunId;
use crate::store::Store;

pub use token::Token;

/// What the desk serves from, shared by its requests.
pub struct Desk {
    pub store: Store,
    pub token: Token,
    /// The page's sessions, opened by the token's URL.
    pub sessions: session::Sessions,
    /// The port it is bound to on 127.0.0.1.
    pub port: u16,
    /// The command that continues a run, as `status` and `runs` say it (with the flags that
    /// find this state database again).
    pub resume: Box<dyn Fn(&RunId) -> String + Send + Sync>,
    /// What a reroll or a continuation started here runs with: the settings `imgpipe reroll`
    /// would have with the same flags.
    pub settings: crate::runner::Settings,
    pub service: crate::runner::ServiceSettings,
    /// Cancelled on SIGINT/SIGTERM: the work started here stops at a safe point.
    pub shutdown: CancellationToken,
    /// The work started here, followed for the page and waited for at the end.
    pub works: work::Works,
    /// The thumbnails the page shows, made on demand a few at a time (see [`thumbs`]).
    pub thumbs: thumbs::Thumbs,
}

impl Desk {
    /// Whether `host` (a request's `Host`) is the desk's own address.
    pub fn is_own_host(&self, host: Option<&str>) -> bool {
        let port = self.port.to_string();
        host.and_then(|h| h.rsplit_once(':'))
            .is_some_and(|(name, p)| p == port && (name == "127.0.0.1" || name == "localhost"))
    }

    /// Whether `origin` (a request's `Origin`) is the desk's own page.
    pub fn is_own_origin(&self, origin: &str) -> bool {
        origin
            .strip_prefix("http://")
            .is_some_and(|host| self.is_own_host(Some(host)))
    }

    /// The URL of run `id`'s page, the token in it.
    pub fn run_url(&self, id: &RunId) -> String {
        let run: String = url::form_urlencoded::byte_serialize(id.as_ref().as_bytes()).collect();
        format!(
            "http://127.0.0.1:{}/runs/{}?token={}",
            self.port,
            run.replace('+', "%20"),
            self.token.reveal()
        )
    }

    /// The URL to open: the token in it, as the `token` parameter.
    pub fn url(&self) -> String {
        format!(
            "http://127.0.0.1:{}/?token={}",
            self.port,
            self.token.reveal()
        )
    }
}

/// Binds 127.0.0.1 (never another address) on `port`, or a free one.
pub async fn bind(port: Option<u16>) -> std::io::Result<TcpListener> {
    TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, port.unwrap_or(0)))).await
}

/// The most a request's body may hold: a `POST` names its tasks (a step for every item is one
/// name, `*/clean`), never files.
pub const MOST_BODY: usize = 2 * 1024 * 1024;

/// The desk's routes, every one behind [`guard::guard`]; those that name a run answer 404
/// when the state database does not have it, before their handler.
pub fn router(desk: Arc<Desk>) -> Router {
    let of_a_run = Router::new()
        .route("/runs/{run}", get(page::run))
        .route("/runs/{run}/head", get(page::head))
        .route("/runs/{run}/files/{*path}", get(files::file))
        .route("/runs/{run}/thumbs/{*path}", get(thumbs::thumb))
        .route("/api/runs/{run}", get(api::run))
        .route("/api/runs/{run}/work", get(api::work))
        .route("/api/runs/{run}/items", get(items::items))
        .route("/api/runs/{run}/changes", get(items::changes))
        .route("/api/runs/{run}/reroll", post(api::reroll))
        .route("/api/runs/{run}/continue", post(api::continue_run))
        .route_layer(axum::middleware::from_fn_with_state(
            Arc::clone(&desk),
            api::known_run,
        ));
    Router::new()
        .route("/", get(page::home))
        .route("/assets/decide.js", get(page::decide_js))
        .route("/assets/decide.css", get(page::decide_css))
        .route("/api/runs", get(api::runs))
        .route("/assets/{name}", get(page::asset))
        .merge(of_a_run)
        .method_not_allowed_fallback(api::method_not_allowed)
        .fallback(api::not_found)
        .layer(DefaultBodyLimit::max(MOST_BODY))
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&desk),
            guard::guard,
        ))
        .with_state(desk)
}

/// Serves `desk` on `listener` until `shutdown`: then it accepts nothing more, drops the
/// connections still open after [`server::CLOSE_WITHIN`] (whatever the clients do), and
/// waits for the work it started to reach the runner's safe point (the calls in flight
/// answered and recorded, as `imgpipe reroll` does on SIGTERM) before it returns.
pub async fn serve(
    listener: TcpListener,
    desk: Arc<Desk>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    server::serve(listener, router(Arc::clone(&desk)), shutdown).await;
    desk.works.wait().await;
    Ok(())
}
