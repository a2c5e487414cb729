//! [`ResponseFuture`]: decide, then call the inner service or answer early.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower::Service;

use crate::body::ResponseBody;
use crate::engine::{Allowed, BoxFuture, Decided, LeaseGuard};
use crate::headers::{self, HeaderBlock};

pin_project! {
    /// The response future of [`crate::RateLimit`].
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<B>>,
    {
        #[pin]
        state: State<S, B>,
    }
}

/// What an allowed response gets on its way out: rate-limit headers, a concurrency lease. Boxed,
/// and absent by default: the future stays as small as the inner one, which is moved often.
struct After {
    headers: HeaderBlock,
    lease: Option<LeaseGuard>,
}

impl After {
    #[inline]
    fn boxed(headers: HeaderBlock, lease: Option<LeaseGuard>) -> Option<Box<After>> {
        match lease {
            None if headers.is_empty() => None,
            lease => Some(Box::new(After { headers, lease })),
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

impl<S, B> ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    /// Calls `inner` with an allowed `request`. The call is made in place, so that the inner
    /// future (often the largest part) is written once.
    #[inline]
    pub(crate) fn call(
        inner: &mut S,
        request: Request<B>,
        headers: HeaderBlock,
        lease: Option<LeaseGuard>,
    ) -> Self {
        ResponseFuture {
            state: State::Calling {
                future: inner.call(request),
                after: After::boxed(headers, lease),
            },
        }
    }

    #[inline]
    pub(crate) fn early(response: Response<Bytes>) -> Self {
        ResponseFuture {
            state: State::Early {
                response: Some(response),
            },
        }
    }

    pub(crate) fn deciding(decide: BoxFuture<Decided>, request: Request<B>, inner: S) -> Self {
        ResponseFuture {
            state: State::Deciding {
                decide,
                call: Some((request, inner)),
            },
        }
    }
}

impl<S, B, ResBody> Future for ResponseFuture<S, B>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Deciding { decide, call } => {
                    let decided = ready!(decide.as_mut().poll(cx));
                    let (mut request, mut inner) =
                        call.take().expect("ResponseFuture polled after completion");
                    match decided {
                        Decided::Allow(Allowed {
                            info,
                            headers,
                            lease,
                        }) => {
                            if let Some(info) = info {
                                request.extensions_mut().insert(info);
                            }
                            this.state.set(State::Calling {
                                future: inner.call(request),
                                after: After::boxed(headers, lease),
                            });
                        }
                        Decided::Reject(response) => {
                            // Done: polled again, it says so instead of polling `decide`.
                            this.state.set(State::Early { response: None });
                            return Poll::Ready(Ok(response.map(ResponseBody::full)));
                        }
                    }
                }
                StateProj::Calling { future, after } => {
                    let mut response = ready!(future.poll(cx))?;
                    let lease = after.take().and_then(|after| {
                        let After { headers, lease } = *after;
                        headers::apply(headers, response.headers_mut());
                        lease
                    });
                    return Poll::Ready(Ok(response.map(|body| ResponseBody::new(body, lease))));
                }
                StateProj::Early { response } => {
                    let response = response
                        .take()
                        .expect("ResponseFuture polled after completion");
                    return Poll::Ready(Ok(response.map(ResponseBody::full)));
                }
            }
        }
    }
}

impl<S, B> fmt::Debug for ResponseFuture<S, B>
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
