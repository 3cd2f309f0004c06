//! A TCP proxy a test controls: it passes bytes, cuts the link (every connection closed, new
//! ones closed at once: what a client sees when a network policy or a dead node rejects it),
//! or stalls it (connections stay open, bytes are held in both directions and delivered late
//! and in order when the link heals: a congested or paused network path).

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const PASS: u8 = 0;
const CUT: u8 = 1;
const STALL: u8 = 2;

/// A proxy from a loopback port to `target`. Stops (closing every connection) when dropped.
pub struct Proxy {
    port: u16,
    mode: Arc<AtomicU8>,
    closed: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards every connection to `target`.
    pub fn start(target: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
        let port = listener.local_addr().expect("local addr").port();
        listener.set_nonblocking(true).expect("non-blocking listener");
        let proxy = Proxy {
            port,
            mode: Arc::new(AtomicU8::new(PASS)),
            closed: Arc::new(AtomicBool::new(false)),
            conns: Arc::new(Mutex::new(Vec::new())),
        };
        let (mode, closed, conns) = (proxy.mode.clone(), proxy.closed.clone(), proxy.conns.clone());
        std::thread::spawn(move || {
            while !closed.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((client, _)) => {
                        if mode.load(Ordering::Relaxed) == CUT {
                            drop(client); // refused: closed at once
                            continue;
                        }
                        let Ok(server) = TcpStream::connect(target) else { continue };
                        let mut all = conns.lock().unwrap_or_else(|e| e.into_inner());
                        all.push(client.try_clone().expect("clone socket"));
                        all.push(server.try_clone().expect("clone socket"));
                        for (from, to) in [
                            (client.try_clone().expect("clone"), server.try_clone().expect("clone")),
                            (server, client),
                        ] {
                            let (mode, closed) = (mode.clone(), closed.clone());
                            std::thread::spawn(move || pump(from, to, &mode, &closed));
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(5))
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        proxy
    }

    /// The loopback port clients connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Cuts the link: closes every connection; new ones are closed as soon as they are accepted.
    pub fn cut(&self) {
        self.mode.store(CUT, Ordering::Relaxed);
        for c in self.conns.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }

    /// Stalls the link: connections stay open, bytes are held in both directions.
    pub fn stall(&self) {
        self.mode.store(STALL, Ordering::Relaxed);
    }

    /// Heals the link: held bytes are delivered, in order; new connections pass.
    pub fn heal(&self) {
        self.mode.store(PASS, Ordering::Relaxed);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.closed.store(true, Ordering::Relaxed);
        for c in self.conns.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}

/// Copies `from` to `to`, holding bytes while the link stalls and ending when it is cut.
fn pump(mut from: TcpStream, mut to: TcpStream, mode: &AtomicU8, closed: &AtomicBool) {
    let _ = from.set_read_timeout(Some(Duration::from_millis(10)));
    let mut held: Vec<u8> = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut eof = false;
    loop {
        let m = mode.load(Ordering::Relaxed);
        if m == CUT || closed.load(Ordering::Relaxed) {
            let _ = from.shutdown(Shutdown::Both);
            let _ = to.shutdown(Shutdown::Both);
            return;
        }
        if m == PASS && !held.is_empty() {
            if to.write_all(&held).is_err() {
                return;
            }
            held.clear();
        }
        if eof {
            if held.is_empty() {
                let _ = to.shutdown(Shutdown::Write);
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        match from.read(&mut buf) {
            Ok(0) => eof = true,
            Ok(n) => held.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => eof = true,
        }
    }
}
