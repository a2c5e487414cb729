//! [`HeldLease`]: a concurrency lease that outlives the response, for upgraded connections.

use std::fmt;
use std::sync::Arc;

use http::{Method, Request, header};

use crate::engine::LeaseGuard;

/// The concurrency lease of a request that asks to switch protocols (a WebSocket handshake:
/// an `Upgrade` header, or an HTTP/2 extended `CONNECT`), in its extensions.
///
/// A concurrency policy's lease normally ends with the response body. After
/// `101 Switching Protocols` that body is empty, and the connection that matters (the WebSocket)
/// lives on past it. For such a request the layer also puts the lease in the request's
/// extensions as a `HeldLease`: the slot stays taken while any clone of it lives, and is given
/// back when the last one, and the response body, are gone. Move it into the task that serves
/// the upgraded connection (with axum's `WebSocketUpgrade`, into `on_upgrade`'s closure), and a
/// policy such as "at most 5 WebSockets per user" holds for the connections' whole lives:
///
/// ```
/// # #[cfg(feature = "axum")] {
/// use axum::extract::Request;
/// use axum::http::StatusCode;
/// use axum::response::{IntoResponse, Response};
/// use floodgate_tower::HeldLease;
///
/// async fn upgrade(lease: Option<HeldLease>, mut req: Request) -> Response {
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
/// A handler that does not keep it drops it with the request, and the lease ends with the
/// handshake, as for any response. The lease still expires at its TTL if this replica dies; to
/// hold it longer than the TTL, let the layer renew it
/// ([`crate::RateLimitLayerBuilder::renew_leases_up_to`], bounded by the longest connection you
/// will hold). Requests that do not ask for an upgrade get no `HeldLease`, and pay nothing for
/// it. With feature `axum`, `Option<HeldLease>` is an extractor (`None` when no concurrency
/// policy leased anything: the policy did not apply, or the layer failed open).
#[derive(Clone)]
pub struct HeldLease(Arc<LeaseGuard>);

impl fmt::Debug for HeldLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("HeldLease").field(&self.0).finish()
    }
}

/// The lease an allowed response's body carries to its end: its own, or a share of one the
/// request's handler may keep longer ([`HeldLease`]). Held for its drop.
#[derive(Debug)]
pub(crate) enum BodyLease {
    Own { _guard: LeaseGuard },
    Shared { _held: HeldLease },
}

/// Whether `request` asks to switch protocols: HTTP/1.1 `Upgrade`, or HTTP/2 extended
/// `CONNECT` (RFC 8441).
fn wants_upgrade<B>(request: &Request<B>) -> bool {
    request.method() == Method::CONNECT || request.headers().contains_key(header::UPGRADE)
}

/// The lease the response's body holds; for a request that asks for an upgrade, shared with a
/// [`HeldLease`] put in its extensions.
#[inline]
pub(crate) fn hand_over<B>(
    request: &mut Request<B>,
    lease: Option<LeaseGuard>,
) -> Option<BodyLease> {
    let guard = lease?;
    if !wants_upgrade(request) {
        return Some(BodyLease::Own { _guard: guard });
    }
    let held = HeldLease(Arc::new(guard));
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
