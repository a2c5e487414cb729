//! The HTTP server: the router served over HTTP/1.1 with the bounds a public endpoint needs,
//! which `axum::serve` does not set.
//!
//! - At most [`ServeLimits::max_connections`] connections at once: the next client waits in
//!   the listen queue until one closes, instead of costing a socket and a task each.
//! - A client has [`ServeLimits::header_timeout`] to send a request's headers, and an idle
//!   keep-alive connection is closed after as long: a client trickling bytes ("slowloris")
//!   holds a connection for that long at most.
//! - A request has [`ServeLimits::request_timeout`] from its headers to its response, its body
//!   included: a body that never ends gets `408` and the connection is closed.
//! - On shutdown, connections stop being accepted, idle ones are closed at once, and requests
//!   in progress have [`ServeLimits::shutdown_grace`] to finish; what is still open then is
//!   closed. A message being sent when its request is cut off is still recorded: sends run in
//!   tasks of their own (see `App::sends`).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;
use tower::ServiceExt;

use crate::config::Config;
use crate::error::ApiError;

/// How the server bounds its clients.
#[derive(Clone, Copy, Debug)]
pub struct ServeLimits {
    /// The most connections served at once.
    pub max_connections: usize,
    /// Time to send a request's headers; the life of an idle keep-alive connection.
    pub header_timeout: Duration,
    /// Time from a request's headers to its response.
    pub request_timeout: Duration,
    /// On shutdown, the longest wait for requests in progress.
    pub shutdown_grace: Duration,
}

impl ServeLimits {
    pub fn from_config(c: &Config) -> ServeLimits {
        ServeLimits {
            max_connections: c.max_connections,
            header_timeout: c.header_timeout,
            request_timeout: c.request_timeout,
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
                Err(e) => {
                    // Out of file descriptors, or a connection reset before it was accepted:
                    // a pause keeps the former from spinning.
                    tracing::warn!(error = %e, "cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // Finished connections' results, dropped as they come.
        while connections.try_join_next().is_some() {}
        connections.spawn(connection(
            stream,
            peer,
            router.clone(),
            limits,
            permit,
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

/// Serves one connection until it closes, or until shutdown closes it when idle.
async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    router: Router,
    limits: ServeLimits,
    _permit: OwnedSemaphorePermit,
    mut stopped: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let service = hyper::service::service_fn(move |mut request: http::Request<Incoming>| {
        request.extensions_mut().insert(ConnectInfo(peer));
        let response = router.clone().oneshot(request);
        async move {
            Ok::<Response, Infallible>(
                match tokio::time::timeout(limits.request_timeout, response).await {
                    Ok(Ok(response)) => response,
                    Ok(Err(never)) => match never {},
                    Err(_) => request_timed_out(limits.request_timeout),
                },
            )
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let conn = builder.serve_connection(TokioIo::new(stream), service);
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

/// `408`, closing the connection: what is left of the request's body is not read.
fn request_timed_out(after: Duration) -> Response {
    let mut response = ApiError::new(
        StatusCode::REQUEST_TIMEOUT,
        "request_timeout",
        format!("the request did not complete within {after:?}"),
    )
    .into_response();
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}
