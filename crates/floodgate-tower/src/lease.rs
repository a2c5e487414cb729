//! [`HeldLease`]: a concurrency lease that outlives the response, for upgraded connections.

use std::fmt;
use std::future::{Future, pending};
use std::sync::Arc;

use floodgate_core::LeaseClock;
use futures_util::future::select_all;
use http::{Method, Request, header};
use tokio::time::{Instant, sleep_until};

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
///         // The slot is taken until this task ends.
///         if let Ok(connection) = on_upgrade.await {
///             match &lease {
///                 // Closed when the lease is lost (see below).
///                 Some(lease) => tokio::select! {
///                     _ = serve(connection) => {}
///                     _ = lease.lost() => {}
///                 },
///                 None => serve(connection).await,
///             }
///         }
///     });
///     (StatusCode::SWITCHING_PROTOCOLS, [("connection", "upgrade"), ("upgrade", "my-protocol")])
///         .into_response()
/// }
///
/// async fn serve(connection: hyper::upgrade::Upgraded) {
///     // Speak the new protocol.
/// #   drop(connection);
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
/// - **Know when it is gone.** [`HeldLease::lost`] resolves when the lease stops counting: at
///   its TTL, or a TTL after its last accepted renewal, or, while the layer renews it, at the
///   first renewal that finds the store no longer holds it (flushed, failed over to a replica
///   that never had it). Close the connection then, as the example does: the connections left
///   open are those the policy still counts, give or take a renewal period (a third of the
///   TTL) after the store loses a lease.
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
    outer: Option<HeldLease>,
}

impl HeldLease {
    /// Resolves when the lease stops counting, and with it the connection's place in the
    /// policy; at once if it already has. Once lost, a lease stays lost.
    ///
    /// - **At its TTL**, counted from when the layer sent the check that granted it, or from
    ///   when it sent the last renewal the store accepted
    ///   ([`crate::RateLimitLayerBuilder::renew_leases_up_to`]): never later than the store's
    ///   own expiry, as the store counts from when it ran them. A renewal the store does not
    ///   answer (down, slow) changes nothing, and one accepted only after the deadline does
    ///   not bring the lease back.
    /// - **At the first renewal that finds it gone** (the store flushed, or failed over to a
    ///   replica that never had it), or that the store refuses for good (its key corrupted or
    ///   of another type): so only while the layer renews it, and up to a renewal period (a
    ///   third of the TTL) after the store lost it. A replica that missed the last renewals
    ///   expires the lease sooner than this counts, by up to as much.
    ///
    /// A lease granted by the layer's local fallback counts in that fallback only. A check
    /// whose concurrency rules all cost 0 holds nothing, and its lease is never lost. Behind
    /// stacked layers, it resolves when the first of the leases it holds is lost. It says
    /// when, not why (the renewal logs why).
    ///
    /// The future borrows nothing and holds no slot: select on it next to the connection, or
    /// hand it to another task. Needs a Tokio runtime with timers. Cancel-safe.
    pub fn lost(&self) -> impl Future<Output = ()> + Send + 'static {
        let lapses: Vec<Lapse> = self
            .chain()
            .map(|held| held.guard.lapse().clone())
            .collect();
        async move {
            select_all(lapses.iter().map(|lapse| Box::pin(lapse.lost()))).await;
        }
    }

    /// Whether the lease has stopped counting (see [`HeldLease::lost`]).
    pub fn is_lost(&self) -> bool {
        let now = Instant::now();
        self.chain().any(|held| held.guard.lapse().is_lost(now))
    }

    /// This lease, then the outer layers' it holds.
    fn chain(&self) -> impl Iterator<Item = &Held> {
        std::iter::successors(Some(&*self.0), |held| held.outer.as_ref().map(|o| &*o.0))
    }
}

/// When a lease stops counting.
#[derive(Clone)]
pub(crate) enum Lapse {
    /// At its TTL from the grant (`None`: no TTL known), as nothing renews it.
    Fixed(Option<Instant>),
    /// As its renewal finds.
    Clock(Arc<LeaseClock>),
}

impl Lapse {
    fn is_lost(&self, now: Instant) -> bool {
        match self {
            Lapse::Fixed(until) => until.is_some_and(|until| now >= until),
            Lapse::Clock(clock) => clock.is_lost_at(now),
        }
    }

    async fn lost(&self) {
        match self {
            Lapse::Fixed(None) => pending().await,
            Lapse::Fixed(Some(until)) => sleep_until(*until).await,
            Lapse::Clock(clock) => clock.lost().await,
        }
    }
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
    let held = HeldLease(Arc::new(Held { guard, outer }));
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn an_unrenewed_lapse_is_lost_at_its_deadline_and_one_without_is_never() {
        let ttl = Duration::from_millis(300);
        let t0 = Instant::now();
        let fixed = Lapse::Fixed(Some(t0 + ttl));
        assert!(!fixed.is_lost(t0 + ttl - Duration::from_millis(1)));
        assert!(fixed.is_lost(t0 + ttl));
        fixed.lost().await;
        assert_eq!(Instant::now() - t0, ttl);
        let never = Lapse::Fixed(None);
        assert!(!never.is_lost(t0 + Duration::from_secs(1 << 30)));
        assert!(
            tokio::time::timeout(Duration::from_secs(3600), never.lost())
                .await
                .is_err()
        );
    }
}
