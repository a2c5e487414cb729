//! [`ResponseFuture`]: decide, then call the inner service or answer early.

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower::Service;

use crate::body::{Native, ResponseBody, Wrapped};
use crate::engine::{Allowed, BoxFuture, Decided, Refund};
use crate::headers::{self, HeaderBlock};
use crate::lease::{self, BodyLease};

pin_project! {
    /// The response future of [`crate::RateLimit`]; `K` is its body kind ([`Wrapped`] or
    /// [`Native`]).
    pub struct ResponseFuture<S, B, K = Wrapped>
    where
        S: Service<Request<B>>,
    {
        #[pin]
        state: State<S, B>,
        kind: PhantomData<fn() -> K>,
    }
}

/// What a finished [`ResponseFuture`] has, before its body is shaped for the body kind.
enum Finished<B> {
    /// The inner service's response, with the lease its body must hold.
    Inner(Response<B>, Option<BodyLease>),
    /// A response of the layer's own.
    Early(Response<Bytes>),
}

/// What an allowed response gets on its way out: rate-limit headers, a concurrency lease. Boxed,
/// and absent by default: the future stays as small as the inner one, which is moved often.
struct After {
    headers: HeaderBlock,
    lease: Option<BodyLease>,
    refund: Option<Refund>,
}

impl After {
    #[inline]
    fn boxed(
        headers: HeaderBlock,
        lease: Option<BodyLease>,
        refund: Option<Refund>,
    ) -> Option<Box<After>> {
        match (lease, refund) {
            (None, None) if headers.is_empty() => None,
            (lease, refund) => Some(Box::new(After {
                headers,
                lease,
                refund,
            })),
        }
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, B>
    where
        S: Service<Request<B>>,
    {
        // Waiting for the limiter, with what the call needs afterwards. Held inline, not boxed:
        // a box per request costs most where requests wait, many at once, for the store. The
        // price is that every state is at least a request and a service large: free behind
        // axum, whose own future holds both already; a service with a small (boxed) future
        // gets a response future about that much larger.
        Deciding {
            decide: BoxFuture<Decided>,
            call: Option<(Request<B>, S)>,
        },
        // Allowed (or not limited): the inner service is answering.
        Calling {
            #[pin]
            future: S::Future,
            after: Option<Box<After>>,
        },
        // Turned away without calling the inner service.
        Early {
            response: Option<Response<Bytes>>,
        },
    }
}

impl<S, B, K> ResponseFuture<S, B, K>
where
    S: Service<Request<B>>,
{
    fn new(state: State<S, B>) -> Self {
        ResponseFuture {
            state,
            kind: PhantomData,
        }
    }

    /// Calls `inner` with an allowed `request`. The call is made in place, so that the inner
    /// future (often the largest part) is written once.
    #[inline]
    pub(crate) fn call(
        inner: &mut S,
        request: Request<B>,
        headers: HeaderBlock,
        lease: Option<BodyLease>,
        refund: Option<Refund>,
    ) -> Self {
        Self::new(State::Calling {
            future: inner.call(request),
            after: After::boxed(headers, lease, refund),
        })
    }

    #[inline]
    pub(crate) fn early(response: Response<Bytes>) -> Self {
        Self::new(State::Early {
            response: Some(response),
        })
    }

    pub(crate) fn deciding(decide: BoxFuture<Decided>, request: Request<B>, inner: S) -> Self {
        Self::new(State::Deciding {
            decide,
            call: Some((request, inner)),
        })
    }
}

impl<S, B, ResBody> State<S, B>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
{
    fn poll_finish(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Finished<ResBody>, S::Error>> {
        loop {
            match self.as_mut().project() {
                StateProj::Deciding { decide, call } => {
                    let decided = ready!(decide.as_mut().poll(cx));
                    let (mut request, mut inner) =
                        call.take().expect("ResponseFuture polled after completion");
                    match decided {
                        Decided::Allow(Allowed {
                            info,
                            headers,
                            lease,
                            refund,
                        }) => {
                            if let Some(info) = info {
                                info.insert_into(request.extensions_mut());
                            }
                            let lease = lease::hand_over(&mut request, lease);
                            self.set(State::Calling {
                                future: inner.call(request),
                                after: After::boxed(headers, lease, refund),
                            });
                        }
                        Decided::Reject(mut response) => {
                            crate::grpc::answer_grpc_web(request.headers(), &mut response);
                            // Done: polled again, it says so instead of polling `decide`.
                            self.set(State::Early { response: None });
                            return Poll::Ready(Ok(Finished::Early(response)));
                        }
                    }
                }
                StateProj::Calling { future, after } => {
                    let mut response = ready!(future.poll(cx))?;
                    let lease = after.take().and_then(|after| {
                        let After {
                            headers,
                            lease,
                            refund,
                        } = *after;
                        if let Some(refund) = refund {
                            refund.settle(response.status(), response.headers());
                        }
                        headers::apply(headers, response.headers_mut());
                        lease
                    });
                    return Poll::Ready(Ok(Finished::Inner(response, lease)));
                }
                StateProj::Early { response } => {
                    let response = response
                        .take()
                        .expect("ResponseFuture polled after completion");
                    return Poll::Ready(Ok(Finished::Early(response)));
                }
            }
        }
    }
}

impl<S, B, ResBody> Future for ResponseFuture<S, B, Wrapped>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Poll::Ready(Ok(match ready!(self.project().state.poll_finish(cx))? {
            Finished::Inner(response, lease) => response.map(|body| ResponseBody::new(body, lease)),
            Finished::Early(response) => response.map(ResponseBody::full),
        }))
    }
}

impl<S, B, ResBody> Future for ResponseFuture<S, B, Native>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
    ResBody: From<ResponseBody<ResBody>>,
{
    type Output = Result<Response<ResBody>, S::Error>;

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Poll::Ready(Ok(match ready!(self.project().state.poll_finish(cx))? {
            // The body as it is, unless a lease must ride with it to its end.
            Finished::Inner(response, None) => response,
            Finished::Inner(response, lease) => {
                response.map(|body| ResBody::from(ResponseBody::new(body, lease)))
            }
            Finished::Early(response) => {
                response.map(|bytes| ResBody::from(ResponseBody::full(bytes)))
            }
        }))
    }
}

impl<S, B, K> fmt::Debug for ResponseFuture<S, B, K>
where
    S: Service<Request<B>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Deciding { .. } => "deciding",
            State::Calling { .. } => "calling",
            State::Early { .. } => "early",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
}

#[cfg(all(test, feature = "axum"))]
mod tests {
    use super::*;

    #[test]
    fn an_axum_route_s_response_future_is_its_inner_future_plus_a_pointer() {
        // The layer's future is moved (into axum's box) with every request: the states of a
        // request waiting for the store and of an allowed one (its headers and lease boxed)
        // fit beside axum's own future. 328 bytes against 320.
        type Inner = axum::routing::future::RouteFuture<std::convert::Infallible>;
        type Ours = ResponseFuture<axum::routing::Route, axum::body::Body>;
        let (inner, ours) = (std::mem::size_of::<Inner>(), std::mem::size_of::<Ours>());
        assert!(ours <= inner + 8, "{ours} bytes against the inner {inner}");
    }
}
