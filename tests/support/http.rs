//! The HTTP side of the chaos suite: an axum app behind the rate-limit layer on 127.0.0.1:0,
//! and a plain hyper client that records status and decision source of every request.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::http::{Request, StatusCode};
use axum::routing::get;
use floodgate::tower::{DecisionSource, RateLimitInfo, RateLimitLayer};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// The header that carries the rate-limit key of a request.
pub const KEY_HEADER: &str = "x-client";

/// Longer than any bound the suite checks: a request still unanswered then is recorded as a
/// hang (status 0) instead of blocking the test.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the decision of an answered request came from, as the handler saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    /// 200, decided by the store (Redis).
    Store,
    /// 200, decided by the local in-memory fallback.
    Fallback,
    /// 200, let through undecided (fail open).
    Open,
    /// 429: over the limit (decided by the store, the deny cache or the fallback).
    Limited,
    /// 503: the store failed and the layer fails closed.
    Unavailable,
    /// Any other status.
    Other(u16),
    /// No response: connection error or [`CLIENT_TIMEOUT`].
    NoResponse,
}

impl Source {
    /// A 200 of any source.
    pub fn admitted(self) -> bool {
        matches!(self, Source::Store | Source::Fallback | Source::Open)
    }
}

/// An app whose handler answers with the decision source (`store`, `fallback`, `open`).
pub fn app(layer: RateLimitLayer) -> Router {
    Router::new()
        .route(
            "/",
            get(|info: Option<RateLimitInfo>| async move {
                match info.map(|i| i.source()) {
                    Some(DecisionSource::Store) => "store",
                    Some(DecisionSource::Fallback) => "fallback",
                    Some(DecisionSource::FailOpen) => "open",
                    _ => "none",
                }
            }),
        )
        .layer(layer)
}

/// Serves `router` on a free loopback port until the runtime stops.
pub async fn serve(router: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind 127.0.0.1:0");
    let addr = listener.local_addr().expect("local addr");
    tokio::spawn(async move {
        axum::serve(listener, router).await.expect("serve");
    });
    addr
}

/// A pooled HTTP/1 client for one app.
#[derive(Clone, Debug)]
pub struct HttpClient {
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
}

impl HttpClient {
    pub fn new(addr: SocketAddr) -> Self {
        assert!(addr.ip().is_loopback(), "the suite only targets loopback");
        HttpClient {
            client: Client::builder(TokioExecutor::new()).build_http(),
            base: format!("http://{addr}"),
        }
    }

    /// `GET /` with the key header; the decision source, or [`Source::NoResponse`].
    pub async fn get(&self, key: &str) -> Source {
        let req = Request::get(format!("{}/", self.base))
            .header(KEY_HEADER, key)
            .body(Full::new(Bytes::new()))
            .expect("request");
        let res = match tokio::time::timeout(CLIENT_TIMEOUT, self.client.request(req)).await {
            Ok(Ok(res)) => res,
            Ok(Err(_)) | Err(_) => return Source::NoResponse,
        };
        let status = res.status();
        let body = match tokio::time::timeout(CLIENT_TIMEOUT, res.into_body().collect()).await {
            Ok(Ok(body)) => body.to_bytes(),
            Ok(Err(_)) | Err(_) => return Source::NoResponse,
        };
        match status {
            StatusCode::OK => match body.as_ref() {
                b"store" => Source::Store,
                b"fallback" => Source::Fallback,
                b"open" => Source::Open,
                _ => Source::Other(200),
            },
            StatusCode::TOO_MANY_REQUESTS => Source::Limited,
            StatusCode::SERVICE_UNAVAILABLE => Source::Unavailable,
            other => Source::Other(other.as_u16()),
        }
    }
}
