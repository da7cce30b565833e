//! The desk's connections, served one by one with hyper (HTTP/1.1 only), so that no client
//! can hold the desk: a request's head must arrive within [`HEADER_READ`], at most
//! [`MAX_CONNECTIONS`] are served at once, and once stopped the desk lets its connections
//! finish for [`CLOSE_WITHIN`] at most, then drops them. (`axum::serve` sets no header
//! timeout, caps nothing and waits for every connection however long it takes.)

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Connections served at once. A browser opens six per host, a script one or two: 64 leave
/// room for several tabs and scripts, and bound the sockets, tasks and buffers a local process
/// opening hundreds of idle or half-sent connections can make the desk hold. Connections
/// beyond wait in the kernel's queue until one ends (each within [`HEADER_READ`] when it
/// sends nothing).
pub(super) const MAX_CONNECTIONS: usize = 64;

/// How long a request's head (its line and headers) may take to arrive, and a kept-alive
/// connection may wait for its next request: a half-sent request holds nothing longer.
pub(super) const HEADER_READ: Duration = Duration::from_secs(10);

/// How long connections may take to finish once the desk is stopped (SIGINT, SIGTERM):
/// answers being written are given that long, then every connection still open is dropped.
pub(super) const CLOSE_WITHIN: Duration = Duration::from_secs(5);

/// Serves `router` on `listener` until `shutdown`; then stops accepting (the listener is
/// closed at once) and returns once every connection has ended, [`CLOSE_WITHIN`] later at
/// most.
pub(super) async fn serve(listener: TcpListener, router: Router, shutdown: CancellationToken) {
    let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let connections = TaskTracker::new();
    let dropped = CancellationToken::new();
    loop {
        let permit = tokio::select! {
            () = shutdown.cancelled() => break,
            permit = Arc::clone(&permits).acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
        };
        let stream = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors, a connection reset before it was taken: the
                    // listener itself still stands.
                    tracing::debug!("the desk could not accept a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let (shutdown, dropped) = (shutdown.clone(), dropped.clone());
        connections.spawn(connection(
            stream,
            router.clone(),
            shutdown,
            dropped,
            permit,
        ));
    }
    drop(listener);
    connections.close();
    if tokio::time::timeout(CLOSE_WITHIN, connections.wait())
        .await
        .is_err()
    {
        tracing::info!(
            "the desk drops the connections still open {}s after it was stopped",
            CLOSE_WITHIN.as_secs()
        );
        dropped.cancel();
        connections.wait().await;
    }
}

/// One connection, until it ends, or once `shutdown` until its answer in progress is written
/// (no next request is read), or until `dropped`.
async fn connection(
    stream: TcpStream,
    router: Router,
    shutdown: CancellationToken,
    dropped: CancellationToken,
    _permit: OwnedSemaphorePermit,
) {
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ);
    let conn = builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(router));
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        ended = conn.as_mut() => return log_end(ended),
        () = shutdown.cancelled() => conn.as_mut().graceful_shutdown(),
    }
    tokio::select! {
        ended = conn.as_mut() => log_end(ended),
        () = dropped.cancelled() => {}
    }
}

fn log_end(ended: Result<(), hyper::Error>) {
    if let Err(e) = ended {
        tracing::debug!("a connection to the desk ended: {e}");
    }
}
