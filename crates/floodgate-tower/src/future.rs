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

pin_project! {
    #[project = StateProj]
    enum State<S, B>
    where
        S: Service<Request<B>>,
    {
        // Waiting for the limiter.
        Deciding {
            decide: BoxFuture<Decided>,
            request: Option<Request<B>>,
            inner: Option<S>,
        },
        // Allowed (or not limited): the inner service is answering.
        Calling {
            #[pin]
            future: S::Future,
            headers: HeaderBlock,
            lease: Option<LeaseGuard>,
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
    pub(crate) fn calling(future: S::Future) -> Self {
        ResponseFuture::allowed(future, HeaderBlock::new(), None)
    }

    pub(crate) fn allowed(
        future: S::Future,
        headers: HeaderBlock,
        lease: Option<LeaseGuard>,
    ) -> Self {
        ResponseFuture {
            state: State::Calling {
                future,
                headers,
                lease,
            },
        }
    }

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
                request: Some(request),
                inner: Some(inner),
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
                StateProj::Deciding {
                    decide,
                    request,
                    inner,
                } => match ready!(decide.as_mut().poll(cx)) {
                    Decided::Allow(Allowed {
                        info,
                        headers,
                        lease,
                    }) => {
                        let mut request = request
                            .take()
                            .expect("ResponseFuture polled after completion");
                        let mut inner = inner
                            .take()
                            .expect("ResponseFuture polled after completion");
                        if let Some(info) = info {
                            request.extensions_mut().insert(info);
                        }
                        let future = inner.call(request);
                        this.state.set(State::Calling {
                            future,
                            headers,
                            lease,
                        });
                    }
                    Decided::Reject(response) => {
                        return Poll::Ready(Ok(response.map(ResponseBody::full)));
                    }
                },
                StateProj::Calling {
                    future,
                    headers,
                    lease,
                } => {
                    let response = ready!(future.poll(cx))?;
                    let (mut parts, body) = response.into_parts();
                    headers::apply(std::mem::take(headers), &mut parts.headers);
                    let body = ResponseBody::new(body, lease.take());
                    return Poll::Ready(Ok(Response::from_parts(parts, body)));
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
