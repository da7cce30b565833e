//! A TCP proxy on 127.0.0.1 that the bench can turn into a black hole: until [`BlackHole::cut`]
//! it forwards every connection to its target; from then on it forwards nothing more, in
//! either direction, on the connections it holds (they stay open, silent: what a client
//! has sent lies unread, no answer comes, nothing is closed or refused), and it accepts new
//! connections and says nothing on them either. The worst case of a database "unreachable":
//! one that does not answer, not one that refuses. Dropped, it closes everything.

use std::net::SocketAddr;
use std::sync::mpsc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

pub struct BlackHole {
    pub port: u16,
    cut: watch::Sender<bool>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl BlackHole {
    /// Forwards 127.0.0.1:(a free port) to `target`, in a thread of its own.
    pub fn start(target: SocketAddr) -> BlackHole {
        let (cut, cut_seen) = watch::channel(false);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (tx, rx) = mpsc::channel();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .expect("tokio runtime");
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                    .await
                    .expect("bind the proxy");
                tx.send(listener.local_addr().expect("port").port())
                    .expect("send the port");
                let accepting = async {
                    loop {
                        let Ok((inbound, _)) = listener.accept().await else {
                            continue;
                        };
                        tokio::spawn(forward(inbound, target, cut_seen.clone()));
                    }
                };
                tokio::select! {
                    () = accepting => {}
                    _ = stopped => {}
                }
            });
            // Every connection's task is dropped with the runtime: its sockets close.
            runtime.shutdown_background();
        });
        let port = rx.recv().expect("the proxy starts");
        BlackHole {
            port,
            cut,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// From now on nothing passes, and nothing is closed.
    pub fn cut(&self) {
        self.cut.send_replace(true);
    }
}

impl Drop for BlackHole {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// One connection: forwarded both ways until the cut, then held open and silent.
async fn forward(inbound: tokio::net::TcpStream, target: SocketAddr, cut: watch::Receiver<bool>) {
    if *cut.borrow() {
        return silent(inbound).await;
    }
    let Ok(outbound) = tokio::net::TcpStream::connect(target).await else {
        return;
    };
    let (in_read, in_write) = inbound.into_split();
    let (out_read, out_write) = outbound.into_split();
    tokio::join!(
        pump(in_read, out_write, cut.clone()),
        pump(out_read, in_write, cut)
    );
}

/// Holds `stream` open without reading or writing, for as long as the proxy lives.
async fn silent(stream: tokio::net::TcpStream) {
    std::future::pending::<()>().await;
    drop(stream);
}

/// Copies `from` to `to` until the cut; then holds both, silent.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut cut: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let read = tokio::select! {
            read = from.read(&mut buf) => read,
            _ = cut.wait_for(|c| *c) => break,
        };
        // Bytes read as the cut came are swallowed: they never arrive.
        if *cut.borrow() {
            break;
        }
        match read {
            Ok(0) | Err(_) => {
                let _ = to.shutdown().await;
                return;
            }
            Ok(n) => {
                if to.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        }
    }
    std::future::pending::<()>().await;
    drop((from, to));
}
