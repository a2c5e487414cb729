//! Response bodies: [`ResponseBody`], the inner service's body or the body of a rejection,
//! which holds a concurrency lease until the body ends; and the markers that choose whether the
//! layer's service answers with it ([`Wrapped`]) or with the inner service's own body type
//! ([`Native`]).

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::lease::BodyLease;

/// The layer's service answers with [`ResponseBody`] around any inner body type: the default.
///
/// Each response body is wrapped, so a framework that boxes foreign body types (axum's
/// `IntoResponse` does) boxes it once more per request. See [`Native`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Wrapped;

/// The layer's service answers with the inner service's own body type, made by
/// [`crate::RateLimitLayer::native_body`].
///
/// An allowed response's body passes through untouched: nothing is wrapped or boxed. A
/// rejection's body, and a body that must carry a concurrency lease to its end, are converted
/// with `From<ResponseBody<B>>`, which axum's `Body` (feature `axum`) and tonic's `Body`
/// (feature `tonic`) implement; so does any body type of yours for which you write it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Native;

pin_project! {
    /// The body of a rate-limited service's responses.
    ///
    /// When a concurrency policy admitted the request, the body holds its lease and gives it
    /// back when it ends: at its last frame, on an error, or when it is dropped unfinished.
    pub struct ResponseBody<B> {
        #[pin]
        inner: Inner<B>,
        lease: Option<BodyLease>,
    }
}

pin_project! {
    #[project = InnerProj]
    enum Inner<B> {
        Body { #[pin] body: B },
        Full { data: Option<Bytes> },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn new(body: B, lease: Option<BodyLease>) -> Self {
        ResponseBody {
            inner: Inner::Body { body },
            lease,
        }
    }

    pub(crate) fn full(data: Bytes) -> Self {
        ResponseBody {
            inner: Inner::Full {
                data: (!data.is_empty()).then_some(data),
            },
            lease: None,
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body,
    B::Data: From<Bytes>,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        match this.inner.project() {
            InnerProj::Body { body } => {
                let frame = std::task::ready!(body.poll_frame(cx));
                if !matches!(frame, Some(Ok(_))) {
                    // The end, or an error: the work is over.
                    this.lease.take();
                }
                Poll::Ready(frame)
            }
            InnerProj::Full { data } => {
                Poll::Ready(data.take().map(|d| Ok(Frame::data(B::Data::from(d)))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Inner::Body { body } => body.is_end_stream(),
            Inner::Full { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Body { body } => body.size_hint(),
            Inner::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}

#[cfg(feature = "axum")]
impl<B> From<ResponseBody<B>> for axum::body::Body
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<axum::BoxError>,
{
    fn from(body: ResponseBody<B>) -> Self {
        axum::body::Body::new(body)
    }
}

#[cfg(feature = "tonic")]
impl<B> From<ResponseBody<B>> for tonic::body::Body
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    fn from(body: ResponseBody<B>) -> Self {
        tonic::body::Body::new(body)
    }
}

impl<B> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.inner {
            Inner::Body { .. } => "inner",
            Inner::Full { .. } => "rejection",
        };
        f.debug_struct("ResponseBody")
            .field("kind", &kind)
            .field("lease", &self.lease)
            .finish()
    }
}
