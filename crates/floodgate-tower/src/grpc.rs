//! gRPC mapping: a rejection of a gRPC request is a trailers-only response with a gRPC status,
//! not an HTTP error status, so that gRPC clients see the code (tonic: `Status::code()`).
//!
//! A rate-limited call gets `RESOURCE_EXHAUSTED` (8), with the retry delay as `retry-after`
//! metadata (whole seconds) and as a `google.rpc.RetryInfo` in `grpc-status-details-bin`
//! (a `google.rpc.Status` protobuf, the "richer error model").
//!
//! A gRPC-Web call (`application/grpc-web` or `application/grpc-web-text`, from a browser that reaches the layer before any
//! gRPC-Web translation) gets the same trailers-only response in its own content type
//! (`application/grpc-web+proto`, `application/grpc-web-text+proto`, or the message format the
//! request named, as `+json`): gRPC-Web sends a
//! trailers-only response's status in its headers too. The browser reads those headers only
//! if CORS exposes them (`Access-Control-Expose-Headers: grpc-status, grpc-message`).

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};

/// gRPC status codes used by the layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum GrpcCode {
    /// 3: the request has no usable rate-limit key.
    InvalidArgument = 3,
    /// 8: rate limited.
    ResourceExhausted = 8,
    /// 14: the rate-limit store is unavailable and the layer fails closed.
    Unavailable = 14,
}

/// Whether `headers` have a gRPC content type: `application/grpc`, `application/grpc-web` or
/// `application/grpc-web-text`, with or without a message format (`+proto`) or parameters, in
/// any case. Another type that merely begins alike (`application/grpcx`) is not gRPC: its
/// client would read a gRPC rejection (HTTP 200) as a success. The layer also asks for `POST`
/// ([`RequestView::is_grpc`](crate::key::RequestView::is_grpc)).
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|ct| is_grpc_type(ct.as_bytes()))
}

fn is_grpc_type(ct: &[u8]) -> bool {
    const BASE: &[u8] = b"application/grpc";
    if !starts_with_ignore_case(ct, BASE) {
        return false;
    }
    let rest = &ct[BASE.len()..];
    let rest = if starts_with_ignore_case(rest, b"-web-text") {
        &rest[b"-web-text".len()..]
    } else if starts_with_ignore_case(rest, b"-web") {
        &rest[b"-web".len()..]
    } else {
        rest
    };
    matches!(rest.first(), None | Some(b'+' | b';' | b' ' | b'\t'))
}

/// A gRPC rejection (`content-type: application/grpc`, as [`trailers_only`] makes it, or a
/// custom handler) of a gRPC-Web request, in the content type a gRPC-Web client expects.
/// Nothing else changes: not other responses, nor those of other requests.
pub(crate) fn answer_grpc_web<B>(request: &HeaderMap, response: &mut Response<B>) {
    let is = |headers: &HeaderMap, value: &[u8]| {
        headers
            .get(http::header::CONTENT_TYPE)
            .is_some_and(|ct| ct.as_bytes().eq_ignore_ascii_case(value))
    };
    if !is(response.headers(), b"application/grpc") {
        return;
    }
    let Some(web) = request
        .get(http::header::CONTENT_TYPE)
        .and_then(|ct| grpc_web_answer(ct.to_str().ok()?))
    else {
        return;
    };
    response
        .headers_mut()
        .insert(http::header::CONTENT_TYPE, web);
}

/// The content type of a gRPC-Web answer to a request of content type `ct`: its own base
/// (`application/grpc-web` or `application/grpc-web-text`) and message format (`proto` when it
/// names none, or one that is not a plain token); `None` for other content types.
fn grpc_web_answer(ct: &str) -> Option<HeaderValue> {
    let essence = ct.split(';').next().unwrap_or_default().trim();
    let essence = essence.to_ascii_lowercase();
    let (base, format) = match essence.split_once('+') {
        Some((base, format)) => (base, Some(format)),
        None => (essence.as_str(), None),
    };
    if base != "application/grpc-web" && base != "application/grpc-web-text" {
        return None;
    }
    let format = format
        .filter(|f| {
            !f.is_empty()
                && f.len() <= 32
                && f.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        })
        .unwrap_or("proto");
    HeaderValue::from_str(&format!("{base}+{format}")).ok()
}

fn starts_with_ignore_case(s: &[u8], prefix: &[u8]) -> bool {
    s.len() >= prefix.len() && s[..prefix.len()].eq_ignore_ascii_case(prefix)
}

/// A trailers-only gRPC response: HTTP 200, `content-type: application/grpc`, `grpc-status`,
/// a percent-encoded `grpc-message` and, with a `retry_after`, `retry-after` metadata and a
/// `google.rpc.Status` carrying a `google.rpc.RetryInfo` in `grpc-status-details-bin`.
pub fn trailers_only(
    code: GrpcCode,
    message: &str,
    retry_after: Option<Duration>,
) -> Response<Bytes> {
    let mut res = Response::new(Bytes::new());
    *res.status_mut() = StatusCode::OK;
    let h = res.headers_mut();
    h.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    h.insert(
        HeaderName::from_static("grpc-status"),
        HeaderValue::from(code as u16),
    );
    if let Ok(v) = HeaderValue::from_bytes(&percent_encode(message.as_bytes())) {
        h.insert(HeaderName::from_static("grpc-message"), v);
    }
    if let Some(delay) = retry_after {
        h.insert(
            http::header::RETRY_AFTER,
            HeaderValue::from(crate::headers::ceil_secs(delay).max(1)),
        );
        let status = encode_status(code as i32, message, Some(delay));
        if let Ok(v) = HeaderValue::from_bytes(base64_unpadded(&status).as_bytes()) {
            h.insert(HeaderName::from_static("grpc-status-details-bin"), v);
        }
    }
    res
}

/// `google.rpc.Status { code, message, details: [Any(google.rpc.RetryInfo)] }`, encoded by hand
/// (three messages, a handful of fields: not worth a code generator).
pub(crate) fn encode_status(code: i32, message: &str, retry_delay: Option<Duration>) -> Vec<u8> {
    let mut status = Vec::with_capacity(96 + message.len());
    if code != 0 {
        // field 1, varint
        status.push(0x08);
        put_varint(&mut status, code as u32 as u64);
    }
    if !message.is_empty() {
        put_len_field(&mut status, 2, message.as_bytes());
    }
    if let Some(delay) = retry_delay {
        // google.protobuf.Duration { seconds = 1; nanos = 2 }
        let mut duration = Vec::with_capacity(12);
        if delay.as_secs() != 0 {
            duration.push(0x08);
            put_varint(&mut duration, delay.as_secs());
        }
        if delay.subsec_nanos() != 0 {
            duration.push(0x10);
            put_varint(&mut duration, u64::from(delay.subsec_nanos()));
        }
        // google.rpc.RetryInfo { retry_delay = 1 }
        let mut retry_info = Vec::with_capacity(16);
        put_len_field(&mut retry_info, 1, &duration);
        // google.protobuf.Any { type_url = 1; value = 2 }
        let mut any = Vec::with_capacity(64);
        put_len_field(&mut any, 1, b"type.googleapis.com/google.rpc.RetryInfo");
        put_len_field(&mut any, 2, &retry_info);
        put_len_field(&mut status, 3, &any);
    }
    status
}

fn put_len_field(buf: &mut Vec<u8>, field: u8, bytes: &[u8]) {
    buf.push(field << 3 | 2);
    put_varint(buf, bytes.len() as u64);
    buf.extend_from_slice(bytes);
}

fn put_varint(buf: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        buf.push((v as u8) | 0x80);
        v >>= 7;
    }
    buf.push(v as u8);
}

/// gRPC's `grpc-message` encoding: bytes outside `0x20..=0x7e`, and `%`, as `%XX`.
pub(crate) fn percent_encode(bytes: &[u8]) -> Vec<u8> {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = Vec::with_capacity(bytes.len());
    for &b in bytes {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(b);
        } else {
            out.extend_from_slice(&[b'%', HEX[usize::from(b >> 4)], HEX[usize::from(b & 15)]]);
        }
    }
    out
}

/// Standard base64 without padding, as gRPC sends binary (`-bin`) metadata.
pub(crate) fn base64_unpadded(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = match *chunk {
            [a, b, c] => u32::from(a) << 16 | u32::from(b) << 8 | u32::from(c),
            [a, b] => u32::from(a) << 16 | u32::from(b) << 8,
            [a] => u32::from(a) << 16,
            _ => 0,
        };
        let sextets = chunk.len() + 1;
        for i in 0..sextets {
            out.push(char::from(ALPHABET[(n >> (18 - 6 * i) & 63) as usize]));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_grpc_content_types() {
        let mut h = HeaderMap::new();
        assert!(!is_grpc(&h));
        for (ct, grpc) in [
            ("application/grpc", true),
            ("application/grpc+proto", true),
            ("application/grpc+json", true),
            ("Application/GRPC", true),
            ("application/grpc-web+proto", true),
            ("application/grpc-web", true),
            ("application/grpc-web-text", true),
            ("application/grpc-Web-Text+proto", true),
            ("application/grpc; charset=utf-8", true),
            ("application/grpc ;x=1", true),
            ("application/json", false),
            ("application/gr", false),
            // Types that only begin like gRPC's: a gRPC answer (HTTP 200) would read as success.
            ("application/grpcx", false),
            ("application/grpc-webx", false),
            ("application/grpc-web-textual", false),
            ("application/grpc-json", false),
        ] {
            h.insert(http::header::CONTENT_TYPE, HeaderValue::from_static(ct));
            assert_eq!(is_grpc(&h), grpc, "{ct}");
        }
    }

    #[test]
    fn retry_after_is_never_zero_seconds() {
        // Rounded up, and at least one second: as the HTTP answers' `Retry-After`.
        for (delay, secs) in [(0, "1"), (1, "1"), (1000, "1"), (1001, "2")] {
            let res = trailers_only(
                GrpcCode::ResourceExhausted,
                "slow down",
                Some(std::time::Duration::from_millis(delay)),
            );
            let got = res.headers().get(http::header::RETRY_AFTER);
            assert_eq!(
                got.map(HeaderValue::as_bytes),
                Some(secs.as_bytes()),
                "{delay} ms"
            );
        }
    }

    #[test]
    fn encodes() {
        assert_eq!(percent_encode("a%b é\n".as_bytes()), b"a%25b %C3%A9%0A");
        assert_eq!(base64_unpadded(b""), "");
        assert_eq!(base64_unpadded(b"f"), "Zg");
        assert_eq!(base64_unpadded(b"fo"), "Zm8");
        assert_eq!(base64_unpadded(b"foo"), "Zm9v");
        assert_eq!(base64_unpadded(b"foobar\xff"), "Zm9vYmFy/w");
        let mut v = Vec::new();
        put_varint(&mut v, 300);
        assert_eq!(v, [0xac, 0x02]);
    }
}
