//! [`RateLimit`]: the service.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower::Service;

use crate::body::{Native, ResponseBody, Wrapped};
use crate::engine::{Allowed, Called, DynEngine, Job};
use crate::future::ResponseFuture;
use crate::grpc;
use crate::key::RequestView;
use crate::lease;

/// Rate-limits the requests to `S` (made by [`crate::RateLimitLayer`]).
///
/// Always as ready as `S`: the decision is made in `call`, and a rejection is a response, never
/// an error. `K` is the body kind: responses have a [`ResponseBody`] ([`Wrapped`]), or the
/// inner service's own body type ([`Native`]).
pub struct RateLimit<S, K = Wrapped> {
    inner: S,
    engine: Arc<dyn DynEngine>,
    kind: PhantomData<fn() -> K>,
}

impl<S: Clone, K> Clone for RateLimit<S, K> {
    fn clone(&self) -> Self {
        RateLimit {
            inner: self.inner.clone(),
            engine: Arc::clone(&self.engine),
            kind: PhantomData,
        }
    }
}

impl<S, K> RateLimit<S, K> {
    pub(crate) fn from_engine(inner: S, engine: Arc<dyn DynEngine>) -> Self {
        RateLimit {
            inner,
            engine,
            kind: PhantomData,
        }
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

impl<S: fmt::Debug, K> fmt::Debug for RateLimit<S, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("config", self.engine.shared())
            .finish()
    }
}

impl<S, K> RateLimit<S, K> {
    /// Decides on `req`: the response future of an allowed, rejected or pending request.
    #[inline]
    fn start<ReqBody>(&mut self, mut req: Request<ReqBody>) -> ResponseFuture<S, ReqBody, K>
    where
        S: Service<Request<ReqBody>> + Clone,
    {
        let mut job = Job::default();
        let mut allowed = Allowed::default();
        let view = RequestView::from_request(&req);
        match self
            .engine
            .call(&self.engine, &view, &mut job, &mut allowed)
        {
            Called::Allow => {
                if let Some(info) = allowed.info {
                    info.insert_into(req.extensions_mut());
                }
                let lease = lease::hand_over(&mut req, allowed.lease);
                ResponseFuture::call(&mut self.inner, req, allowed.headers, lease, allowed.refund)
            }
            Called::Reject(mut response) => {
                grpc::answer_grpc_web(req.headers(), &mut response);
                ResponseFuture::early(response)
            }
            Called::Deciding => {
                // Take the service that was made ready; leave a fresh clone in its place.
                let clone = self.inner.clone();
                let inner = std::mem::replace(&mut self.inner, clone);
                ResponseFuture::deciding(Arc::clone(&self.engine).decide(job), req, inner)
            }
        }
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<S, Wrapped>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody, Wrapped>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        self.start(req)
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<S, Native>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    ResBody: From<ResponseBody<ResBody>>,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody, Native>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        self.start(req)
    }
}
