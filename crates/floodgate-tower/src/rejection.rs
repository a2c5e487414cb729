//! Rejections: what a turned-away request gets back, and how to change it.

use std::fmt::Write as _;
use std::time::Duration;

use bytes::Bytes;
use floodgate_core::Policy;
use http::{HeaderValue, Response, StatusCode};

use crate::grpc::{self, GrpcCode};
use crate::headers::ceil_secs;
use crate::info::RateLimitInfo;
use crate::key::KeyError;

/// The RFC 9457 problem type of a rate-limited request
/// (draft-ietf-httpapi-ratelimit-headers-11, section 5.1).
pub const QUOTA_EXCEEDED: &str = "https://iana.org/assignments/http-problem-types#quota-exceeded";

/// Why a request is turned away.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RejectionKind {
    /// A policy denied it (429, gRPC `RESOURCE_EXHAUSTED`).
    Limited,
    /// No key could be taken from it and the layer rejects such requests (400, gRPC
    /// `INVALID_ARGUMENT`).
    MissingKey,
    /// The store failed and the layer fails closed (503, gRPC `UNAVAILABLE`).
    StoreUnavailable,
}

/// A request turned away, as the [`RejectionHandler`] sees it.
#[derive(Debug)]
pub struct Rejection<'a> {
    pub(crate) kind: RejectionKind,
    pub(crate) grpc: bool,
    pub(crate) info: Option<&'a RateLimitInfo>,
    pub(crate) key_error: Option<&'a KeyError>,
    pub(crate) policy: Option<&'a Policy>,
    pub(crate) retry_after: Option<Duration>,
}

impl<'a> Rejection<'a> {
    /// Why.
    pub fn kind(&self) -> RejectionKind {
        self.kind
    }

    /// Whether the request is a gRPC call (answer with a gRPC status, not an HTTP error).
    pub fn is_grpc(&self) -> bool {
        self.grpc
    }

    /// The decision, for [`RejectionKind::Limited`].
    pub fn info(&self) -> Option<&'a RateLimitInfo> {
        self.info
    }

    /// The policy at fault: the strictest that denied, or the one without a key.
    pub fn policy(&self) -> Option<&'a Policy> {
        self.policy
    }

    /// Why no key was found, for [`RejectionKind::MissingKey`].
    pub fn key_error(&self) -> Option<&'a KeyError> {
        self.key_error
    }

    /// When the request may be retried: the strictest policy's wait, or the store's retry
    /// interval. `None` when a request this costly can never be admitted.
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// The HTTP status of the default response.
    pub fn status(&self) -> StatusCode {
        match self.kind {
            RejectionKind::Limited => StatusCode::TOO_MANY_REQUESTS,
            RejectionKind::MissingKey => StatusCode::BAD_REQUEST,
            RejectionKind::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The gRPC status of the default response.
    pub fn grpc_code(&self) -> GrpcCode {
        match self.kind {
            RejectionKind::Limited => GrpcCode::ResourceExhausted,
            RejectionKind::MissingKey => GrpcCode::InvalidArgument,
            RejectionKind::StoreUnavailable => GrpcCode::Unavailable,
        }
    }

    /// A one-line explanation.
    pub fn detail(&self) -> String {
        let mut s = String::new();
        match self.kind {
            RejectionKind::Limited => {
                match self.policy {
                    Some(p) => {
                        let _ = write!(s, "rate limit {:?} exceeded", p.name());
                    }
                    None => s.push_str("rate limit exceeded"),
                }
                match self.retry_after {
                    Some(d) => {
                        // As `Retry-After`: never 0 while denied.
                        let _ = write!(s, "; retry in {} s", ceil_secs(d).max(1));
                    }
                    None => s.push_str("; this request can never be admitted"),
                }
            }
            RejectionKind::MissingKey => {
                s.push_str("no rate-limit key in the request");
                if let Some(e) = self.key_error {
                    let _ = write!(s, ": {e}");
                }
            }
            RejectionKind::StoreUnavailable => {
                s.push_str("the rate limiter is unavailable; retry later");
            }
        }
        s
    }
}

/// Builds the response of a rejected request. The layer then adds `Retry-After` (unless set)
/// and, when enabled, the rate-limit headers.
///
/// Implemented for closures `Fn(&Rejection<'_>) -> Response<Bytes>`; [`DefaultRejection`]
/// is the default.
pub trait RejectionHandler: Send + Sync + 'static {
    /// The response to `rejection`.
    fn rejection(&self, rejection: &Rejection<'_>) -> Response<Bytes>;
}

impl<F> RejectionHandler for F
where
    F: Fn(&Rejection<'_>) -> Response<Bytes> + Send + Sync + 'static,
{
    fn rejection(&self, rejection: &Rejection<'_>) -> Response<Bytes> {
        self(rejection)
    }
}

/// The default rejection: an RFC 9457 `application/problem+json` body (`type`, `title`,
/// `status`, `detail`, `policy`, `violated-policies`, `retry_after_ms`), or for gRPC requests a
/// trailers-only response with the gRPC status (see [`crate::grpc`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct DefaultRejection;

impl RejectionHandler for DefaultRejection {
    fn rejection(&self, r: &Rejection<'_>) -> Response<Bytes> {
        let detail = r.detail();
        if r.grpc {
            return grpc::trailers_only(r.grpc_code(), &detail, r.retry_after);
        }
        let status = r.status();
        let (kind, title) = match r.kind {
            // The title the draft registers with its problem type.
            RejectionKind::Limited => (QUOTA_EXCEEDED, "Quota Exceeded"),
            RejectionKind::MissingKey => ("about:blank", "Bad Request"),
            RejectionKind::StoreUnavailable => ("about:blank", "Service Unavailable"),
        };
        let mut body = String::with_capacity(256);
        body.push_str("{\"type\":");
        json_string(&mut body, kind);
        body.push_str(",\"title\":");
        json_string(&mut body, title);
        let _ = write!(body, ",\"status\":{}", status.as_u16());
        body.push_str(",\"detail\":");
        json_string(&mut body, &detail);
        if let Some(p) = r.policy {
            body.push_str(",\"policy\":");
            json_string(&mut body, p.name());
        }
        if r.kind == RejectionKind::Limited {
            body.push_str(",\"violated-policies\":[");
            if let Some(info) = r.info {
                for (i, (p, _)) in info.iter().filter(|(_, d)| !d.allowed).enumerate() {
                    if i > 0 {
                        body.push(',');
                    }
                    json_string(&mut body, p.name());
                }
            }
            body.push(']');
        }
        if let Some(d) = r.retry_after {
            let _ = write!(body, ",\"retry_after_ms\":{}", d.as_millis());
        }
        body.push('}');
        let mut res = Response::new(Bytes::from(body));
        *res.status_mut() = status;
        res.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        res
    }
}

/// Appends `s` as a JSON string.
fn json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_escaping() {
        let mut s = String::new();
        json_string(&mut s, "a\"b\\c\n\u{1}é");
        assert_eq!(s, "\"a\\\"b\\\\c\\n\\u0001é\"");
    }
}
