//! [`HeldLease`]: a concurrency lease that outlives the response, for upgraded connections.

use std::fmt;
use std::sync::Arc;

use http::{Method, Request, header};

use crate::engine::LeaseGuard;

/// The concurrency lease of a request that asks to switch protocols (a WebSocket handshake's
/// `Upgrade` header, or a `CONNECT`), in its extensions.
///
/// A concurrency policy's lease normally ends with the response body. After
/// `101 Switching Protocols` that body is empty, and the connection that matters (the WebSocket)
/// lives on past it. For such a request the layer also puts the lease in the request's
/// extensions as a `HeldLease`: the slot stays taken while any clone of it lives, and is given
/// back when the last one, and the response body, are gone. Move it into the task that serves
/// the upgraded connection (with axum's `WebSocketUpgrade`, into `on_upgrade`'s closure), and a
/// policy such as "at most 5 WebSockets per user" counts open connections, not handshakes:
///
/// ```
/// # #[cfg(feature = "axum")] {
/// use axum::extract::Request;
/// use axum::http::StatusCode;
/// use axum::response::{IntoResponse, Response};
/// use floodgate_tower::HeldLease;
///
/// async fn upgrade(lease: Option<HeldLease>, mut req: Request) -> Response {
///     // (A handler that turns the upgrade down answers here, and drops `lease`.)
///     let on_upgrade = hyper::upgrade::on(&mut req);
///     tokio::spawn(async move {
///         let _lease = lease; // the slot is taken until this task ends
///         if let Ok(_connection) = on_upgrade.await {
///             // Serve the upgraded connection.
///         }
///     });
///     (StatusCode::SWITCHING_PROTOCOLS, [("connection", "upgrade"), ("upgrade", "my-protocol")])
///         .into_response()
/// }
///
/// let _app: axum::Router = axum::Router::new().route("/socket", axum::routing::get(upgrade));
/// # }
/// ```
///
/// - **Keep it only on the path that switches protocols.** A task that holds it while awaiting
///   an upgrade the response turned down waits (and holds the slot) until the client
///   disconnects. A handler that does not keep it drops it with the request, and the lease ends
///   with the handshake, as for any response.
/// - **It lasts one TTL, or as long as the layer renews it.** The lease still expires at its
///   TTL, so that a replica that dies gives it back: a connection open longer than the TTL no
///   longer counts unless the layer renews its lease
///   ([`crate::RateLimitLayerBuilder::renew_leases_up_to`]; then up to that bound and a TTL,
///   so set the bound to the longest connection you will hold).
/// - **Layers stack.** Behind several layers with concurrency policies, the innermost layer's
///   `HeldLease` also holds the outer layers' leases.
/// - **Who gets one.** Requests that ask for no upgrade get no `HeldLease`, and pay nothing for
///   it. With feature `axum`, `Option<HeldLease>` is an extractor that takes it out of the
///   request (a second extraction gets `None`); it is also `None` when no concurrency policy
///   leased anything (none applied, or the layer failed open).
#[derive(Clone)]
pub struct HeldLease(Arc<Held>);

/// A lease, and the lease of an outer layer's [`HeldLease`] the same request carried. Held for
/// their drops.
struct Held {
    guard: LeaseGuard,
    _outer: Option<HeldLease>,
}

impl fmt::Debug for HeldLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("HeldLease").field(&self.0.guard).finish()
    }
}

/// The lease an allowed response's body carries to its end: its own, or a share of one the
/// request's handler may keep longer ([`HeldLease`]). Held for its drop.
#[derive(Debug)]
pub(crate) enum BodyLease {
    Own { _guard: LeaseGuard },
    Shared { _held: HeldLease },
}

/// Whether `request` asks to switch protocols: HTTP/1.1 `Upgrade`, or `CONNECT` (a tunnel, or
/// HTTP/2 extended `CONNECT` for WebSockets, RFC 8441), as hyper counts upgrades.
fn wants_upgrade<B>(request: &Request<B>) -> bool {
    request.method() == Method::CONNECT || request.headers().contains_key(header::UPGRADE)
}

/// The lease the response's body holds; for a request that asks for an upgrade, shared with a
/// [`HeldLease`] put in its extensions (holding an outer layer's, if the request had one).
#[inline]
pub(crate) fn hand_over<B>(
    request: &mut Request<B>,
    lease: Option<LeaseGuard>,
) -> Option<BodyLease> {
    let guard = lease?;
    if !wants_upgrade(request) {
        return Some(BodyLease::Own { _guard: guard });
    }
    let outer = request.extensions_mut().remove::<HeldLease>();
    let held = HeldLease(Arc::new(Held {
        guard,
        _outer: outer,
    }));
    request.extensions_mut().insert(held.clone());
    Some(BodyLease::Shared { _held: held })
}

#[cfg(feature = "axum")]
mod axum_impl {
    use std::convert::Infallible;

    use axum::extract::OptionalFromRequestParts;
    use http::request::Parts;

    use super::HeldLease;

    impl<S: Send + Sync> OptionalFromRequestParts<S> for HeldLease {
        type Rejection = Infallible;

        async fn from_request_parts(
            parts: &mut Parts,
            _: &S,
        ) -> Result<Option<Self>, Self::Rejection> {
            Ok(parts.extensions.remove::<HeldLease>())
        }
    }
}
