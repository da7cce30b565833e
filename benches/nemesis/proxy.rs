//! A TCP proxy on 127.0.0.1 between the hosts and PostgreSQL, which the campaign slows (a delay
//! on every chunk) or cuts (a black hole: connections held open and silent, new ones accepted
//! and never answered) and heals.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

pub struct Proxy {
    pub port: u16,
    cut: Arc<AtomicBool>,
    delay_ms: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl Proxy {
    pub fn start(upstream: (String, u16), delay_ms: u64) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let port = listener.local_addr().expect("the proxy's port").port();
        let cut = Arc::new(AtomicBool::new(false));
        let delay = Arc::new(AtomicU64::new(delay_ms));
        let stop = Arc::new(AtomicBool::new(false));
        let (c, d, s) = (cut.clone(), delay.clone(), stop.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(down) = conn else { continue };
                let Ok(up) = TcpStream::connect((upstream.0.as_str(), upstream.1)) else {
                    continue;
                };
                for (from, to) in [
                    (down.try_clone(), up.try_clone()),
                    (up.try_clone(), down.try_clone()),
                ] {
                    let (Ok(from), Ok(to)) = (from, to) else {
                        continue;
                    };
                    let (c, d, s) = (c.clone(), d.clone(), s.clone());
                    std::thread::spawn(move || pump(from, to, &c, &d, &s));
                }
            }
        });
        Proxy {
            port,
            cut,
            delay_ms: delay,
            stop,
        }
    }

    pub fn cut(&self) {
        self.cut.store(true, Ordering::Relaxed);
    }

    pub fn heal(&self) {
        self.cut.store(false, Ordering::Relaxed);
    }

    pub fn is_cut(&self) -> bool {
        self.cut.load(Ordering::Relaxed)
    }

    pub fn set_delay(&self, ms: u64) {
        self.delay_ms.store(ms, Ordering::Relaxed);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.cut.store(false, Ordering::Relaxed);
        // Wake the accept loop so that it sees the stop.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn pump(
    mut from: TcpStream,
    mut to: TcpStream,
    cut: &AtomicBool,
    delay: &AtomicU64,
    stop: &AtomicBool,
) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        while cut.load(Ordering::Relaxed) && !stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(10));
        }
        let ms = delay.load(Ordering::Relaxed);
        if ms > 0 {
            std::thread::sleep(Duration::from_millis(ms));
        }
        if to.write_all(&buf[..n]).is_err() || stop.load(Ordering::Relaxed) {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
    let _ = from.shutdown(std::net::Shutdown::Both);
}
