//! [`RateLimit`]: the service.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower::Service;

use crate::body::ResponseBody;
use crate::engine::{Allowed, Called, DynEngine, Job};
use crate::future::ResponseFuture;
use crate::key::RequestView;

/// Rate-limits the requests to `S` (made by [`crate::RateLimitLayer`]).
///
/// Always as ready as `S`: the decision is made in `call`, and a rejection is a response, never
/// an error.
#[derive(Clone)]
pub struct RateLimit<S> {
    inner: S,
    engine: Arc<dyn DynEngine>,
}

impl<S> RateLimit<S> {
    pub(crate) fn from_engine(inner: S, engine: Arc<dyn DynEngine>) -> Self {
        RateLimit { inner, engine }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: fmt::Debug> fmt::Debug for RateLimit<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("config", self.engine.shared())
            .finish()
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<ReqBody>) -> Self::Future {
        let mut job = Job::default();
        let mut allowed = Allowed::default();
        let view = RequestView::from_request(&req);
        match self
            .engine
            .call(&self.engine, &view, &mut job, &mut allowed)
        {
            Called::Allow => {
                if let Some(info) = allowed.info {
                    req.extensions_mut().insert(info);
                }
                ResponseFuture::call(&mut self.inner, req, allowed.headers, allowed.lease)
            }
            Called::Reject(response) => ResponseFuture::early(response),
            Called::Deciding => {
                // Take the service that was made ready; leave a fresh clone in its place.
                let clone = self.inner.clone();
                let inner = std::mem::replace(&mut self.inner, clone);
                ResponseFuture::deciding(Arc::clone(&self.engine).decide(job), req, inner)
            }
        }
    }
}
