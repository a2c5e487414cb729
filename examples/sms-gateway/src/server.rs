//! The HTTP server: the router served over HTTP/1.1 with the bounds a public endpoint needs,
//! which `axum::serve` does not set.
//!
//! - At most [`ServeLimits::max_connections`] connections at once: the next client waits in
//!   the listen queue until one closes, instead of costing a socket and a task each.
//! - At most [`ServeLimits::max_per_address`] of them from one client address (an IPv6
//!   client's /64: it holds many addresses), so that one client cannot take them all: one more
//!   is answered `503 too_many_connections` and closed. Trusted proxies, whose connections
//!   carry many clients, are exempt.
//! - A client has [`ServeLimits::header_timeout`] to send a request's headers, an idle
//!   keep-alive connection is closed after as long, and so is a connection whose client has
//!   read nothing of a response for as long (it pipelined requests and stopped reading): a
//!   client trickling bytes, or one that never reads, holds a connection for that long at most.
//! - A client has [`ServeLimits::body_timeout`] from a request's headers to the end of its
//!   body: past it, reading the body fails with [`BodyTimeout`], which the handlers answer
//!   with `408`, and the connection is closed. The timeout does not cut handlers off (what
//!   they do has bounds of its own): cut off, a message could be sent while the client is told
//!   its request did not complete.
//! - On shutdown, connections stop being accepted, idle ones are closed at once, and requests
//!   in progress have [`ServeLimits::shutdown_grace`] to finish; what is still open then is
//!   closed, and their handlers with them, but messages being sent go on in tasks of their
//!   own (see `App::sends`), which shutdown waits for next.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use bytes::Bytes;
use floodgate::tower::key::{Key, TrustedProxies};
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;
use tokio::time::{Instant, Sleep};
use tower::ServiceExt;

use crate::config::Config;
use crate::error::ApiError;

/// How the server bounds its clients.
#[derive(Clone, Debug)]
pub struct ServeLimits {
    /// The most connections served at once.
    pub max_connections: usize,
    /// The most connections served at once from one client address (an IPv6 client's /64).
    pub max_per_address: usize,
    /// Peers exempt from [`ServeLimits::max_per_address`]: the trusted proxies.
    pub exempt: Arc<TrustedProxies>,
    /// Time to send a request's headers; the life of an idle keep-alive connection; the
    /// longest a response waits for the client to read any of it.
    pub header_timeout: Duration,
    /// Time to send a request's body, from its headers.
    pub body_timeout: Duration,
    /// On shutdown, the longest wait for requests in progress.
    pub shutdown_grace: Duration,
}

impl ServeLimits {
    pub fn from_config(c: &Config) -> ServeLimits {
        ServeLimits {
            max_connections: c.max_connections,
            max_per_address: c.max_connections_per_ip,
            exempt: Arc::new(TrustedProxies::new(c.trusted_proxies.iter().copied())),
            header_timeout: c.header_timeout,
            body_timeout: c.body_timeout,
            shutdown_grace: c.shutdown_grace,
        }
    }
}

/// Serves `router` on `listener` until `shutdown` completes, then lets requests in progress
/// finish within the grace period. Each request's extensions hold the client's
/// `ConnectInfo<SocketAddr>`, as with `into_make_service_with_connect_info`.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ServeLimits,
    shutdown: impl Future<Output = ()>,
) {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let addresses = Arc::new(Addresses::default());
    let refusing = Arc::new(Semaphore::new(MAX_REFUSING));
    let (stop, stopped) = watch::channel(false);
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            biased;
            () = &mut shutdown => break,
            permit = Arc::clone(&permits).acquire_owned() => match permit {
                Ok(permit) => permit,
                // Never closed.
                Err(_) => break,
            },
        };
        let (stream, peer) = tokio::select! {
            biased;
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                // The client gave up before it was accepted: the next one.
                Err(e) if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionAborted
                        | io::ErrorKind::ConnectionReset
                        | io::ErrorKind::ConnectionRefused
                ) => continue,
                Err(e) => {
                    // Out of file descriptors or memory: a pause (and a line a second at
                    // most) until connections close.
                    tracing::warn!(error = %e, "cannot accept a connection");
                    tokio::select! {
                        biased;
                        () = &mut shutdown => break,
                        () = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    }
                }
            },
        };
        // Finished connections' results, dropped as they come.
        while connections.try_join_next().is_some() {}
        let address = if limits.exempt.contains(peer.ip()) {
            None
        } else {
            // Counted as the rate limits key a client: an IPv6 client by its /64 (it holds
            // the whole of it), an address that stands for an IPv4 host by that host.
            match addresses.enter(Key::from_ip(peer.ip(), 64), limits.max_per_address) {
                Some(slot) => Some(slot),
                None => {
                    drop(permit);
                    refuse(stream, peer, limits.max_per_address, &refusing);
                    continue;
                }
            }
        };
        connections.spawn(connection(
            stream,
            peer,
            router.clone(),
            (limits.header_timeout, limits.body_timeout),
            (address, permit),
            stopped.clone(),
        ));
    }
    drop(listener);
    let _ = stop.send(true);
    let drained = tokio::time::timeout(limits.shutdown_grace, async {
        while connections.join_next().await.is_some() {}
    })
    .await
    .is_ok();
    if !drained {
        tracing::warn!(
            connections = connections.len(),
            grace = ?limits.shutdown_grace,
            "closing connections whose requests did not finish in time"
        );
        connections.shutdown().await;
    }
}

/// Connections being refused at once (each waits up to [`REFUSAL_LINGER`] for its client to
/// read the answer); past this, a refused connection is closed without one.
const MAX_REFUSING: usize = 64;
/// How long a refused connection waits for its client to read the answer and close.
const REFUSAL_LINGER: Duration = Duration::from_millis(500);

/// Answers a connection beyond its address's bound with `503 too_many_connections`, and closes
/// it: in a task of its own that lets the client read the answer (closing a socket with a
/// request unread would reset it, and the answer with it), within bounds.
fn refuse(stream: TcpStream, peer: SocketAddr, most: usize, refusing: &Arc<Semaphore>) {
    tracing::debug!(%peer, most, "refusing a connection: too many from its address");
    let Ok(permit) = Arc::clone(refusing).try_acquire_owned() else {
        return;
    };
    let body = ApiError::new(
        http::StatusCode::SERVICE_UNAVAILABLE,
        "too_many_connections",
        format!(
            "this address has {most} connections open, the most it may have; reuse them, or \
             try again when one closes"
        ),
    )
    .body()
    .to_string();
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    tokio::spawn(async move {
        let _permit = permit;
        let mut stream = stream;
        let _ = tokio::time::timeout(REFUSAL_LINGER, async {
            stream.write_all(answer.as_bytes()).await?;
            stream.shutdown().await?;
            // What the client sent, read and dropped until it closes.
            let mut sink = [0u8; 1024];
            while stream.read(&mut sink).await? > 0 {}
            Ok::<_, io::Error>(())
        })
        .await;
    });
}

/// Connections open per client address.
#[derive(Default)]
struct Addresses {
    open: Mutex<HashMap<Key, usize>>,
}

impl Addresses {
    /// One more connection from `address`, if it has fewer than `most` open; counted until the
    /// slot drops.
    fn enter(self: &Arc<Self>, address: Key, most: usize) -> Option<AddressSlot> {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let count = open.get(&address).copied().unwrap_or(0);
        if count >= most {
            return None;
        }
        open.insert(address.clone(), count + 1);
        Some(AddressSlot {
            addresses: Arc::clone(self),
            address,
        })
    }
}

/// A connection counted against its address.
struct AddressSlot {
    addresses: Arc<Addresses>,
    address: Key,
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let mut open = self
            .addresses
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = open.get_mut(&self.address) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.address);
            }
        }
    }
}

/// Serves one connection until it closes, or until shutdown closes it when idle.
/// `_slots`: what the connection counts against, released when it closes: its address first,
/// so that the client the permit lets in finds its address's count without it.
async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    router: Router,
    (header_timeout, body_timeout): (Duration, Duration),
    _slots: (Option<AddressSlot>, OwnedSemaphorePermit),
    mut stopped: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let service = hyper::service::service_fn(move |request: http::Request<Incoming>| {
        let mut request = request.map(|body| Body::new(Deadline::new(body, body_timeout)));
        request.extensions_mut().insert(ConnectInfo(peer));
        router.clone().oneshot(request)
    });
    let io = TokioIo::new(WriteStall::new(stream, header_timeout));
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout);
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);
    let served = tokio::select! {
        served = conn.as_mut() => Some(served),
        _ = stopped.wait_for(|stop| *stop) => None,
    };
    let served = match served {
        Some(served) => served,
        None => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = served {
        tracing::debug!(%peer, error = %e, "connection ended");
    }
}

/// Reading a request's body failed: it did not end in time.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not complete within {0:?}")]
pub struct BodyTimeout(pub Duration);

impl BodyTimeout {
    /// The timeout among the causes of `error`, if it is one.
    pub fn find<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a BodyTimeout> {
        let mut cause = Some(error);
        while let Some(e) = cause {
            if let Some(timeout) = e.downcast_ref::<BodyTimeout>() {
                return Some(timeout);
            }
            cause = e.source();
        }
        None
    }
}

/// Polls the timer in `slot`, made to fire at `at()` if there is none yet: whether it fired.
fn fired(
    slot: &mut Option<Pin<Box<Sleep>>>,
    at: impl FnOnce() -> Instant,
    cx: &mut Context<'_>,
) -> bool {
    slot.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at())))
        .as_mut()
        .poll(cx)
        .is_ready()
}

/// A request body that fails with [`BodyTimeout`] when it has not ended `limit` after the
/// request's headers. The timer is made at the first wait: a request whose body nobody reads
/// costs none.
struct Deadline {
    body: Incoming,
    limit: Duration,
    deadline: Instant,
    timer: Option<Pin<Box<Sleep>>>,
}

impl Deadline {
    fn new(body: Incoming, limit: Duration) -> Self {
        Deadline {
            body,
            limit,
            deadline: Instant::now() + limit,
            timer: None,
        }
    }
}

impl http_body::Body for Deadline {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        let deadline = this.deadline;
        // Strict: a body whose bytes are always ready is cut off at the deadline too.
        if Instant::now() < deadline {
            if let Poll::Ready(frame) = Pin::new(&mut this.body).poll_frame(cx) {
                return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
            }
            if !fired(&mut this.timer, || deadline, cx) {
                return Poll::Pending;
            }
        }
        Poll::Ready(Some(Err(Box::new(BodyTimeout(this.limit)))))
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A connection whose writes fail once they have made no progress for `limit`: a client that
/// sent requests and stopped reading the responses (its receive window full) does not hold
/// its connection, nor its place among the bounded connections, for good.
struct WriteStall {
    io: TcpStream,
    limit: Duration,
    /// Running while a write waits.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl WriteStall {
    fn new(io: TcpStream, limit: Duration) -> Self {
        WriteStall {
            io,
            limit,
            stalled: None,
        }
    }

    /// `polled`, a write's outcome, with the stall timer started when it waits and stopped
    /// when it makes progress.
    fn timed<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.stalled = None;
            return polled;
        }
        let limit = self.limit;
        if !fired(&mut self.stalled, || Instant::now() + limit, cx) {
            return Poll::Pending;
        }
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("the client read nothing for {limit:?}"),
        )))
    }
}

impl AsyncRead for WriteStall {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for WriteStall {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        self.timed(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.timed(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.io).poll_flush(cx);
        self.timed(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.io).poll_shutdown(cx);
        self.timed(cx, polled)
    }
}
