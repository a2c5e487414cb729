//! [`TcpProxy`]: a loopback TCP proxy in front of a server, whose open connections can be
//! frozen: they stay open, and the kernel still acknowledges what is sent on them, but nothing
//! is passed on any more. That is a half-dead connection (a proxy or load balancer whose
//! backend went away, a NAT that lost its entry), which no error ever reports; connections
//! opened after the freeze are passed on as usual.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use crate::TestkitError;

/// How often a forwarding thread looks at the proxy's state while its socket is quiet.
const POLL: Duration = Duration::from_millis(20);

/// A TCP proxy on a free `127.0.0.1` port, forwarding every connection to `upstream`.
///
/// Dropped, it closes every connection it holds, frozen ones included (a frozen connection
/// holds its socket to the server until then), within about 20 ms.
pub struct TcpProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

struct Shared {
    upstream: SocketAddr,
    /// Connections numbered below this one are frozen.
    frozen_below: AtomicU64,
    /// How many connections were accepted (the next one's number).
    accepted: AtomicU64,
    stop: AtomicBool,
    /// How long new connections wait before anything is passed on, in milliseconds.
    delay_ms: AtomicU64,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl TcpProxy {
    /// A proxy to `upstream`, listening on a free loopback port.
    ///
    /// # Errors
    /// [`TestkitError::NoFreePort`] when no loopback port can be bound.
    pub fn start(upstream: SocketAddr) -> Result<Self, TestkitError> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr().map(|a| (l, a)))
            .map_err(|source| TestkitError::NoFreePort { source })?;
        let (listener, addr) = listener;
        // Polled, so that the accept loop sees `stop` without being woken.
        listener
            .set_nonblocking(true)
            .map_err(|source| TestkitError::NoFreePort { source })?;
        let shared = Arc::new(Shared {
            upstream,
            frozen_below: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            delay_ms: AtomicU64::new(0),
            threads: Mutex::new(Vec::new()),
        });
        let accept = {
            let shared = Arc::clone(&shared);
            thread::spawn(move || accept_loop(&listener, &shared))
        };
        Ok(TcpProxy {
            addr,
            shared,
            accept: Some(accept),
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `redis://127.0.0.1:<port>`, for a proxy in front of a Redis server.
    pub fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// Freezes every connection open now, in both directions; later ones are passed on.
    pub fn freeze_open_connections(&self) {
        let accepted = self.shared.accepted.load(Ordering::SeqCst);
        self.shared
            .frozen_below
            .fetch_max(accepted, Ordering::SeqCst);
    }

    /// Connections accepted from now on pass nothing on, either way, for `delay` (a server
    /// slow to answer a new connection: far away, or behind TLS); those open already are not
    /// slowed.
    pub fn delay_new_connections(&self, delay: Duration) {
        let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.shared.delay_ms.store(ms, Ordering::SeqCst);
    }

    /// How many connections the proxy has accepted so far.
    pub fn connections(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
        let threads = std::mem::take(
            &mut *self
                .shared
                .threads
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        for t in threads {
            let _ = t.join();
        }
    }
}

impl std::fmt::Debug for TcpProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpProxy")
            .field("addr", &self.addr)
            .field("upstream", &self.shared.upstream)
            .field("connections", &self.connections())
            .finish()
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        let client = match listener.accept() {
            Ok((client, _)) => client,
            // Nothing to accept (or an error that will not go away by retrying at once).
            Err(_) => {
                thread::sleep(Duration::from_millis(5));
                continue;
            }
        };
        // Accepted sockets may inherit the listener's non-blocking mode.
        if client.set_nonblocking(false).is_err() {
            continue;
        }
        let id = shared.accepted.fetch_add(1, Ordering::SeqCst);
        let delay = Duration::from_millis(shared.delay_ms.load(Ordering::SeqCst));
        let Ok(server) = TcpStream::connect_timeout(&shared.upstream, Duration::from_secs(2))
        else {
            continue;
        };
        let pairs = client
            .try_clone()
            .and_then(|c| server.try_clone().map(|s| (c, s)));
        let Ok((client2, server2)) = pairs else {
            continue;
        };
        let mut threads = shared
            .threads
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for (from, to) in [(client, server), (server2, client2)] {
            let shared = Arc::clone(shared);
            threads.push(thread::spawn(move || forward(from, to, id, delay, &shared)));
        }
    }
}

/// Copies `from` to `to` until either closes, the proxy stops, or (frozen) forever holding
/// both open.
fn forward(mut from: TcpStream, mut to: TcpStream, id: u64, delay: Duration, shared: &Shared) {
    let started = std::time::Instant::now();
    while started.elapsed() < delay && !shared.stop.load(Ordering::SeqCst) {
        thread::sleep(POLL);
    }
    // A peer that stops reading fails the write instead of blocking `Drop` for good.
    if from.set_read_timeout(Some(POLL)).is_err()
        || to.set_write_timeout(Some(Duration::from_secs(1))).is_err()
    {
        return;
    }
    let mut buf = [0u8; 16 * 1024];
    while !shared.stop.load(Ordering::SeqCst) {
        if id < shared.frozen_below.load(Ordering::SeqCst) {
            // Read nothing, pass nothing, close nothing.
            thread::sleep(POLL);
            continue;
        }
        match from.read(&mut buf) {
            Ok(0) => break,
            // Frozen while reading: what was read is lost, as in a black hole.
            Ok(_) if id < shared.frozen_below.load(Ordering::SeqCst) => {}
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    let _ = to.shutdown(Shutdown::Write);
    let _ = from.shutdown(Shutdown::Read);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server on a free port.
    fn echo() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                thread::spawn(move || {
                    let mut stream = stream;
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = stream.read(&mut buf) {
                        if n == 0 || stream.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                });
            }
        });
        addr
    }

    /// Sends `msg` and reads as much back, within `patience`.
    fn round_trip(stream: &mut TcpStream, msg: &[u8], patience: Duration) -> io::Result<Vec<u8>> {
        stream.set_read_timeout(Some(patience))?;
        stream.write_all(msg)?;
        let mut got = vec![0u8; msg.len()];
        stream.read_exact(&mut got)?;
        Ok(got)
    }

    #[test]
    fn a_frozen_connection_stays_open_and_silent_while_new_ones_pass() {
        let proxy = TcpProxy::start(echo()).expect("proxy");
        let mut old = TcpStream::connect(proxy.addr()).expect("connect");
        assert_eq!(
            round_trip(&mut old, b"ping", Duration::from_secs(2)).expect("echoed"),
            b"ping"
        );
        proxy.freeze_open_connections();
        let frozen = round_trip(&mut old, b"again", Duration::from_millis(300))
            .expect_err("a frozen connection answered");
        assert!(
            matches!(
                frozen.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ),
            "not silent but {frozen:?}"
        );
        let mut new = TcpStream::connect(proxy.addr()).expect("connect");
        assert_eq!(
            round_trip(&mut new, b"fresh", Duration::from_secs(2)).expect("echoed"),
            b"fresh"
        );
        assert_eq!(proxy.connections(), 2);
    }
}
