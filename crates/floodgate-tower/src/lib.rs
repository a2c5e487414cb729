//! Rate limits for tower services — axum, tonic, hyper — with one `.layer(...)` call, backed by
//! any [`floodgate_core::Limiter`]: in memory, or Redis for limits shared by every replica.
//!
//! ```
//! use std::net::SocketAddr;
//! use floodgate_core::{MemoryLimiter, Policy};
//! use floodgate_tower::{RateLimitLayer, Rule};
//! use floodgate_tower::key::{GlobalKey, PeerIp};
//! use http::{Request, Response, StatusCode};
//! use tower::{ServiceBuilder, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let layer = RateLimitLayer::builder(MemoryLimiter::new())
//!     .rule(Rule::new(Policy::per_second(2)?.named("per-ip")?).key(PeerIp::new()))
//!     .rule(Rule::new(Policy::per_second(1000)?.named("global")?).key(GlobalKey))
//!     .build()?;
//! let svc = ServiceBuilder::new()
//!     .layer(layer)
//!     .service_fn(|_req: Request<String>| async {
//!         Ok::<_, std::convert::Infallible>(Response::new(String::from("hello")))
//!     });
//!
//! let request = || {
//!     let mut req = Request::new(String::new());
//!     req.extensions_mut().insert("203.0.113.7:50000".parse::<SocketAddr>().unwrap());
//!     req
//! };
//! for _ in 0..2 {
//!     let res = svc.clone().oneshot(request()).await?;
//!     assert_eq!(res.status(), StatusCode::OK);
//! }
//! let res = svc.clone().oneshot(request()).await?;
//! assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
//! assert_eq!(res.headers()["retry-after"], "1");
//! assert_eq!(res.headers()["content-type"], "application/problem+json");
//! assert_eq!(res.headers()["ratelimit-policy"], r#""per-ip";q=2;w=1"#);
//! assert!(res.headers()["ratelimit"].to_str()?.starts_with(r#""per-ip";r=0;t=1"#));
//! # Ok(())
//! # }
//! ```
//!
//! # What it does
//!
//! - **Rules**: each [`Rule`] is a [`floodgate_core::Policy`] with a key extractor (see
//!   [`key`]), a cost, and the requests it applies to (path prefixes, axum routes, methods, a
//!   predicate). Every rule that applies to a request is checked in **one**
//!   [`floodgate_core::Limiter::check`] call, all-or-nothing: a request denied by one policy is
//!   counted by none. On Redis Cluster, for keys in several slots, this holds for the final
//!   state (parts counted before a later slot denies are given back, logged if that fails);
//!   with leasing, a lease taken for one policy stays counted in the store when another denies.
//! - **Rejections** are responses: 429 with `Retry-After` and an RFC 9457
//!   `application/problem+json` body, or for gRPC requests a trailers-only
//!   `RESOURCE_EXHAUSTED` with a `google.rpc.RetryInfo` (see [`grpc`]). Replace them with a
//!   [`RejectionHandler`].
//! - **Headers** ([`headers`]): `RateLimit-Policy` and `RateLimit` as in
//!   draft-ietf-httpapi-ratelimit-headers-11, optional `X-RateLimit-*`, on rejections, and on
//!   allowed responses too with [`RateLimitLayerBuilder::headers_on_allowed`].
//! - **Modes** ([`Mode`]): reject, or delay requests up to a maximum wait.
//! - **Concurrency** policies hold their lease until the response body ends or is dropped. An
//!   upgraded connection (a WebSocket after `101 Switching Protocols`, whose body is empty)
//!   holds it while its handler keeps the request's [`HeldLease`] (and at most a TTL, or the
//!   renewal bound and a TTL), whose [`HeldLease::lost`] says when to close the connection.
//! - **Failures** ([`OnStoreError`]): when the store errors or misses the layer's timeout, fail
//!   open, fail closed (503), or decide with a local in-memory limiter. A failing store is left
//!   alone for a retry interval, and each change of state is logged once.
//! - **Observability**: a [`RateLimitInfo`] in the request extensions (an axum extractor with
//!   feature `axum`), a `floodgate.check` tracing span (debug level, with the request's
//!   `key`, the first rule's `policy`, and the `outcome` and `source` that
//!   `floodgate_requests_total` counts), the metrics named in [`telemetry`], and the deny
//!   cache's and leasing's counters ([`RateLimitLayer::stats`]).
//!
//! # Cost
//!
//! `RateLimit` is cloned per connection and holds one `Arc`; the policy headers are rendered
//! once, when the layer is built. With a [`floodgate_core::MemoryLimiter`] in reject mode the
//! decision is made synchronously inside `call`, like any in-process limiter: the key stays
//! inline (up to 48 bytes), nothing is allocated for the decision of up to two rules (a
//! verdict holds two decisions inline), and the response future is the inner one and a
//! pointer. Per allowed request the layer allocates the `RateLimitInfo`
//! extension (disable with [`RateLimitLayerBuilder::request_info`]) and, only when asked for
//! with [`RateLimitLayerBuilder::headers_on_allowed`], the `RateLimit` header value. Behind
//! axum, [`RateLimitLayer::native_body`] keeps axum's own body type, which axum would otherwise
//! box once more around the layer's [`ResponseBody`]. Other
//! limiters (Redis) are awaited in one boxed future, and the inner service is cloned for the
//! call, as tower requires.

pub mod body;
mod engine;
mod error;
mod future;
pub mod grpc;
pub mod headers;
mod health;
mod info;
pub mod key;
mod layer;
mod lease;
mod rejection;
mod rule;
mod service;
pub mod telemetry;

pub use body::ResponseBody;
pub use error::ConfigError;
pub use future::ResponseFuture;
#[cfg(feature = "axum")]
pub use info::MissingRateLimitInfo;
pub use info::{DecisionSource, RateLimitInfo};
pub use layer::{
    DEFAULT_DENY_CACHE_MAX_HOLD_WITH_REFUNDS, DEFAULT_STORE_RETRY_INTERVAL, DEFAULT_TIMEOUT, Mode,
    OnMissingKey, OnStoreError, RateLimitLayer, RateLimitLayerBuilder,
};
pub use lease::HeldLease;
pub use rejection::{DefaultRejection, QUOTA_EXCEEDED, Rejection, RejectionHandler, RejectionKind};
pub use rule::Rule;
pub use service::RateLimit;
