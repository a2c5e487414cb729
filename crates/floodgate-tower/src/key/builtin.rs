//! The built-in key extractors.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use http::HeaderName;
use sha2::{Digest as _, Sha256};

use super::{Key, KeyError, KeyExtractor, RequestView};

/// One key for every request: a limit on the whole service (or route).
#[derive(Clone, Copy, Debug, Default)]
pub struct GlobalKey;

impl KeyExtractor for GlobalKey {
    fn extract(&self, _: &RequestView<'_>) -> Result<Key, KeyError> {
        Ok(Key::new(b"global"))
    }
}

/// The IP address of the connection's peer (see [`RequestView::peer_addr`]), IPv6 grouped by
/// a prefix (default /64, the smallest network a subscriber is given). Many ISPs give a home
/// a /56 or a /48, and a client there can spread its requests over 256 or 65,536 keys of /64:
/// where that matters, group by the shorter prefix with [`PeerIp::ipv6_prefix`].
///
/// Behind a proxy every request comes from the proxy: use [`super::ClientIp`] there.
#[derive(Clone, Copy, Debug)]
pub struct PeerIp {
    v6_prefix: u8,
}

impl Default for PeerIp {
    fn default() -> Self {
        PeerIp { v6_prefix: 64 }
    }
}

impl PeerIp {
    /// The peer's IP, IPv6 grouped by /64.
    pub fn new() -> Self {
        PeerIp::default()
    }

    /// Groups IPv6 addresses by their first `bits` bits (128: each address apart).
    #[must_use]
    pub fn ipv6_prefix(mut self, bits: u8) -> Self {
        self.v6_prefix = bits.min(128);
        self
    }
}

impl KeyExtractor for PeerIp {
    fn extract(&self, req: &RequestView<'_>) -> Result<Key, KeyError> {
        req.peer_addr()
            .map(|a| Key::from_ip(a.ip(), self.v6_prefix))
            .ok_or(KeyError::Missing {
                what: "peer address",
            })
    }
}

/// The value of a request header: an API key, a tenant id, ...
///
/// Any bytes are accepted (binary, non-UTF-8), without the spaces and tabs around them (HTTP/1
/// drops them, HTTP/2 does not: `K` and `K ` are one key either way). An absent header is a
/// missing key and an empty one an invalid key: both follow the layer's
/// [`OnMissingKey`](crate::OnMissingKey), as does a value longer than its maximum key length
/// (turned away under `Allow`).
///
/// The key is the value byte for byte. Where the application reads the value loosely, key on
/// what it reads, with a closure: `Authorization: Bearer T` is one credential however the
/// scheme is spelt (`bearer`, `BEARER`) or spaced, and keyed as sent each spelling would be a
/// bucket of its own.
///
/// A header sent more than once is [`KeyError::Ambiguous`], always turned away: which
/// instance a proxy added and which one the client wrote cannot be told apart, and the client
/// must not pick its own key nor skip the rule.
///
/// For a gRPC binary metadata key (a name ending in `-bin`), the value is base64 that gRPC
/// decodes with or without `=` padding; the padding is dropped, so that one value has one key.
///
/// A credential (an API key, a bearer token) should not be the key as it is: keys are stored
/// as the names of Redis keys, which anyone who can read the server lists, and shown in the
/// `floodgate.check` span. [`HeaderKey::hashed`] keys on a digest of the value instead, and
/// [`HeaderKey::hashed_with`] on a digest keyed with a secret the replicas share, for values
/// with little entropy (a user id, a short PIN) that could otherwise be found by trying them.
#[derive(Clone, Debug)]
pub struct HeaderKey {
    name: HeaderName,
    binary: bool,
    /// The digest the value is keyed on, if any (see [`HeaderKey::hashed`]).
    digest: Option<Arc<Digest>>,
    /// The longest value hashed (see [`HeaderKey::max_value_len`]).
    max_value_len: usize,
}

/// The longest header value [`HeaderKey::hashed`] hashes by default: 8 KiB, room for the
/// bearer tokens of identity providers (often 2 to 4 KiB with their claims), the most many
/// proxies pass in one header line.
pub const DEFAULT_MAX_HASHED_VALUE_LEN: usize = 8 * 1024;

/// How [`HeaderKey`] digests a value: SHA-256, or HMAC-SHA-256 with the hasher states after
/// the secret's inner and outer pads (RFC 2104), which each value's digest starts from.
#[allow(
    clippy::large_enum_variant,
    reason = "held in an `Arc`, built once per extractor"
)]
enum Digest {
    Sha256,
    Hmac { inner: Sha256, outer: Sha256 },
}

impl fmt::Debug for Digest {
    /// Never the secret nor anything made from it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Digest::Sha256 => "Sha256",
            Digest::Hmac { .. } => "HmacSha256",
        })
    }
}

/// The digest's first 16 bytes (128 bits), in lowercase hex: readable where keys are shown.
const DIGEST_BYTES: usize = 16;

impl Digest {
    fn hmac(secret: &[u8]) -> Self {
        // A secret longer than SHA-256's 64-byte block is hashed first (RFC 2104).
        let mut block = [0u8; 64];
        if secret.len() > block.len() {
            block[..32].copy_from_slice(&Sha256::digest(secret));
        } else {
            block[..secret.len()].copy_from_slice(secret);
        }
        let pad = |byte: u8| {
            let mut h = Sha256::new();
            h.update(block.map(|b| b ^ byte));
            h
        };
        Digest::Hmac {
            inner: pad(0x36),
            outer: pad(0x5c),
        }
    }

    fn key(&self, value: &[u8]) -> Key {
        let full = match self {
            Digest::Sha256 => Sha256::digest(value),
            Digest::Hmac { inner, outer } => {
                let mut i = inner.clone();
                i.update(value);
                let mut o = outer.clone();
                o.update(i.finalize());
                o.finalize()
            }
        };
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut text = [0u8; 2 * DIGEST_BYTES];
        for (pair, byte) in text.chunks_exact_mut(2).zip(&full[..DIGEST_BYTES]) {
            pair[0] = HEX[usize::from(byte >> 4)];
            pair[1] = HEX[usize::from(byte & 0xf)];
        }
        Key::new(&text[..])
    }
}

impl HeaderKey {
    /// The value of header `name`.
    pub fn new(name: HeaderName) -> Self {
        let binary = name.as_str().ends_with("-bin");
        HeaderKey {
            name,
            binary,
            digest: None,
            max_value_len: DEFAULT_MAX_HASHED_VALUE_LEN,
        }
    }

    /// Keys on the SHA-256 digest of the value (its first 128 bits, 32 hex digits) rather than
    /// the value: for credentials with plenty of entropy (API keys, random tokens), which
    /// then appear neither in Redis nor in traces. Values are compared as
    /// [`HeaderKey::new`] compares them (spaces around trimmed, `-bin` padding dropped) before
    /// they are hashed.
    ///
    /// The layer's [`max_key_len`](crate::RateLimitLayerBuilder::max_key_len) applies to the
    /// digest (32 bytes). A value longer than [`HeaderKey::max_value_len`] (by default
    /// [`DEFAULT_MAX_HASHED_VALUE_LEN`], 8 KiB) is refused as too long before it is hashed: a
    /// client cannot make the layer hash whatever the HTTP server accepts.
    pub fn hashed(mut self) -> Self {
        self.digest = Some(Arc::new(Digest::Sha256));
        self
    }

    /// Keys on the HMAC-SHA-256 of the value with `secret` (its first 128 bits, 32 hex
    /// digits): for values with little entropy, whose plain digest could be reversed by trying
    /// every value. Every replica must use the same secret, or each keeps its own counts; a
    /// new secret starts every client's counts afresh. Use at least 32 random bytes: an empty
    /// or guessable secret protects nothing. Values longer than
    /// [`HeaderKey::max_value_len`] are refused, as with [`HeaderKey::hashed`].
    pub fn hashed_with(mut self, secret: &[u8]) -> Self {
        self.digest = Some(Arc::new(Digest::hmac(secret)));
        self
    }

    /// The longest value [`HeaderKey::hashed`] and [`HeaderKey::hashed_with`] hash (default
    /// [`DEFAULT_MAX_HASHED_VALUE_LEN`]); a longer one is [`KeyError::TooLong`]. A value keyed
    /// as it is (not hashed) is bounded by the layer's
    /// [`max_key_len`](crate::RateLimitLayerBuilder::max_key_len) instead.
    pub fn max_value_len(mut self, max: usize) -> Self {
        self.max_value_len = max;
        self
    }

    /// The value of the header named `name` (case-insensitive).
    pub fn named(name: &str) -> Result<Self, http::header::InvalidHeaderName> {
        Ok(HeaderKey::new(HeaderName::try_from(name)?))
    }

    /// The header's name.
    pub fn name(&self) -> &HeaderName {
        &self.name
    }
}

impl KeyExtractor for HeaderKey {
    fn extract(&self, req: &RequestView<'_>) -> Result<Key, KeyError> {
        let mut all = req.headers().get_all(&self.name).iter();
        let Some(value) = all.next() else {
            return Err(KeyError::Missing { what: "key header" });
        };
        if all.next().is_some() {
            return Err(KeyError::Ambiguous {
                what: "key header sent more than once",
            });
        }
        let mut bytes = value.as_bytes().trim_ascii();
        if self.binary {
            while let [rest @ .., b'='] = bytes {
                bytes = rest;
            }
        }
        if bytes.is_empty() {
            return Err(KeyError::Invalid {
                what: "empty key header",
            });
        }
        match &self.digest {
            Some(_) if bytes.len() > self.max_value_len => Err(KeyError::TooLong {
                len: bytes.len(),
                max: self.max_value_len,
            }),
            Some(digest) => Ok(digest.key(bytes)),
            None => Ok(Key::new(bytes)),
        }
    }
}

/// gRPC metadata is carried in headers: a metadata key is a [`HeaderKey`] (use lowercase
/// names; a `-bin` key's value is keyed on its base64 text without padding).
pub type MetadataKey = HeaderKey;

/// The request path. Every distinct path is a key: with path parameters prefer
/// [`RouteKey`] (feature `axum`), which keys on the route pattern.
///
/// The path is keyed in canonical form: its percent-escapes decoded, as a router decodes path
/// parameters and a file server decodes the whole path (`%2F` too: `ServeDir` serves
/// `/files%2Freport` as `/files/report`), and its empty and dot segments resolved, as a file
/// server does (a trailing `/` is kept). `/files/report`, `/files/%72eport`,
/// `/files/%72%65port`, `/files/./report` and `/files%2F.%2Freport`, one file to `ServeDir`,
/// are one key, so a client cannot escape its limit by spelling one path many ways. A router
/// keeps `/a%2Fb` (one segment) apart from `/a/b`; the key does not, which can only make the
/// limit stricter.
#[derive(Clone, Copy, Debug, Default)]
pub struct PathKey;

impl KeyExtractor for PathKey {
    fn extract(&self, req: &RequestView<'_>) -> Result<Key, KeyError> {
        Ok(Key::new(&canonical_path(req.path())))
    }
}

/// `path` with its percent-escapes decoded, `%2F` to `/` as a file server decodes it, except
/// that of `%`, which stays escaped (as `%25`) so that an escaped escape stays one; a `%` that
/// starts no escape becomes `%25`, as the router reads it. Every spelling of one decoded path
/// gives the same bytes (which need not be UTF-8).
fn normalized_path(path: &str) -> Cow<'_, [u8]> {
    fn hex(b: u8) -> Option<u8> {
        (b as char).to_digit(16).and_then(|d| u8::try_from(d).ok())
    }
    let raw = path.as_bytes();
    if !raw.contains(&b'%') {
        return Cow::Borrowed(raw);
    }
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while let Some(&b) = raw.get(i) {
        if b != b'%' {
            out.push(b);
            i += 1;
            continue;
        }
        match (
            raw.get(i + 1).and_then(|&h| hex(h)),
            raw.get(i + 2).and_then(|&l| hex(l)),
        ) {
            (Some(high), Some(low)) => {
                match high << 4 | low {
                    b'%' => out.extend_from_slice(b"%25"),
                    c => out.push(c),
                }
                i += 3;
            }
            _ => {
                out.extend_from_slice(b"%25");
                i += 1;
            }
        }
    }
    Cow::Owned(out)
}

/// `path` as routers and file servers act on it: percent-escapes decoded as
/// [`normalized_path`] does (`%2F` to `/`, `%25` kept), then empty and `.` segments dropped and
/// each `..` segment taking the one before it away. Borrowed when `path` is canonical already;
/// a path that does not start with `/` (`*`) is left as it is.
pub(crate) fn canonical_path(path: &str) -> Cow<'_, [u8]> {
    let decoded = normalized_path(path);
    let raw: &[u8] = &decoded;
    let dotted = |seg: &[u8]| seg.is_empty() || seg == b"." || seg == b"..";
    let Some(body) = raw.strip_prefix(b"/") else {
        return decoded;
    };
    // A trailing `/` is kept: `/dir/` and `/dir` are two resources (routes, a directory's
    // index and its redirect).
    let trailing = body.ends_with(b"/");
    let body = body.strip_suffix(b"/").unwrap_or(body);
    if body.is_empty() {
        // `/`, or `//`.
        return if raw.len() == 1 {
            decoded
        } else {
            Cow::Owned(b"/".to_vec())
        };
    }
    if !body.split(|&b| b == b'/').any(dotted) {
        return decoded;
    }
    let mut segments: Vec<&[u8]> = Vec::new();
    for seg in body.split(|&b| b == b'/') {
        match seg {
            b"" | b"." => {}
            b".." => {
                segments.pop();
            }
            seg => segments.push(seg),
        }
    }
    let mut out = Vec::with_capacity(raw.len());
    for seg in &segments {
        out.push(b'/');
        out.extend_from_slice(seg);
    }
    if out.is_empty() || trailing {
        out.push(b'/');
    }
    Cow::Owned(out)
}

/// The route pattern axum matched (`/users/{id}`), from `MatchedPath`. A request the router's
/// fallback serves (no route matched: a 404, a `ServeDir`) is keyed [`RouteKey::FALLBACK`], one
/// key for every unmatched path, so that a client cannot get a fresh bucket per made-up path.
/// Missing when the layer does not run inside an axum `Router` (add it with `Router::layer` or
/// `route_layer`).
#[cfg(feature = "axum")]
#[derive(Clone, Copy, Debug, Default)]
pub struct RouteKey;

#[cfg(feature = "axum")]
impl RouteKey {
    /// The key of requests no route matched. No route pattern has it: patterns start with `/`.
    pub const FALLBACK: &'static str = "<fallback>";
}

#[cfg(feature = "axum")]
impl KeyExtractor for RouteKey {
    fn extract(&self, req: &RequestView<'_>) -> Result<Key, KeyError> {
        if let Some(route) = req.matched_path() {
            return Ok(Key::from(route));
        }
        // A router records every request's original URI before it looks for a route: with
        // that and no matched route, the router's fallback is serving it.
        if req
            .extensions()
            .get::<axum::extract::OriginalUri>()
            .is_some()
        {
            return Ok(Key::from(RouteKey::FALLBACK));
        }
        Err(KeyError::Missing {
            what: "matched route",
        })
    }
}

/// The request method: `GET`, `POST`, ... `HEAD` counts as `GET`, as rules match it
/// ([`crate::Rule::methods`]) and as axum serves it (with the `GET` handler), and every method
/// outside the nine of RFC 9110 and RFC 5789 (`PATCH`) is `OTHER`: a client cannot make up
/// methods (`FOO1`, `FOO2`, `get`, ...) for a fresh bucket each. To tell other methods apart
/// (WebDAV's `PROPFIND`, say), key with a closure.
#[derive(Clone, Copy, Debug, Default)]
pub struct MethodKey;

impl KeyExtractor for MethodKey {
    fn extract(&self, req: &RequestView<'_>) -> Result<Key, KeyError> {
        let name = match req.method().as_str() {
            "GET" | "HEAD" => "GET",
            m @ ("POST" | "PUT" | "DELETE" | "PATCH" | "OPTIONS" | "CONNECT" | "TRACE") => m,
            _ => "OTHER",
        };
        Ok(Key::from(name))
    }
}

/// Several keys in one: `client-ip|route`. Parts are joined with `|`; a `|` or `\` inside a
/// part is escaped with `\`, so different parts never give the same key. Missing if any part
/// is missing.
///
/// ```
/// use floodgate_tower::key::{Composite, HeaderKey, KeyExtractor, MethodKey, RequestView};
///
/// let key = Composite::new().with(HeaderKey::named("x-api-key").unwrap()).with(MethodKey);
/// let req = http::Request::post("/").header("x-api-key", "k|1").body(()).unwrap();
/// let k = key.extract(&RequestView::from_request(&req)).unwrap();
/// assert_eq!(k.as_bytes(), br"k\|1|POST");
/// ```
#[derive(Clone, Default)]
pub struct Composite {
    parts: Vec<Arc<dyn KeyExtractor>>,
}

impl Composite {
    /// No parts yet.
    pub fn new() -> Self {
        Composite::default()
    }

    /// Adds a part.
    #[must_use]
    pub fn with(mut self, part: impl KeyExtractor) -> Self {
        self.parts.push(Arc::new(part));
        self
    }
}

impl fmt::Debug for Composite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Composite")
            .field("parts", &self.parts.len())
            .finish()
    }
}

impl KeyExtractor for Composite {
    fn extract(&self, req: &RequestView<'_>) -> Result<Key, KeyError> {
        let mut key = Key::default();
        for (i, part) in self.parts.iter().enumerate() {
            if i > 0 {
                key.push(b'|');
            }
            let k = part.extract(req)?;
            for &b in k.as_bytes() {
                if b == b'|' || b == b'\\' {
                    key.push(b'\\');
                }
                key.push(b);
            }
        }
        Ok(key)
    }
}

macro_rules! tuple_extractor {
    ($($t:ident $i:tt),+) => {
        /// A tuple of extractors is a [`Composite`] of them.
        impl<$($t: KeyExtractor),+> KeyExtractor for ($($t,)+) {
            fn extract(&self, req: &RequestView<'_>) -> Result<Key, KeyError> {
                let mut key = Key::default();
                $(
                    if $i > 0 {
                        key.push(b'|');
                    }
                    let k = self.$i.extract(req)?;
                    for &b in k.as_bytes() {
                        if b == b'|' || b == b'\\' {
                            key.push(b'\\');
                        }
                        key.push(b);
                    }
                )+
                Ok(key)
            }
        }
    };
}

tuple_extractor!(A 0, B 1);
tuple_extractor!(A 0, B 1, C 2);
tuple_extractor!(A 0, B 1, C 2, D 3);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_paths() {
        for (path, canonical) in [
            ("/", "/"),
            ("/a/b/", "/a/b/"),
            ("*", "*"),
            ("//a", "/a"),
            ("/a/./b", "/a/b"),
            ("/a/../b", "/b"),
            ("/../../a", "/a"),
            ("/a/..", "/"),
            ("/a/b/./", "/a/b/"),
            ("/a//b/", "/a/b/"),
            ("//", "/"),
            ("///", "/"),
            ("/%61/%2e/b", "/a/b"),
            ("/a%2Fb/c", "/a/b/c"),
            ("/a%2f..%2fb", "/b"),
            ("/files%2F.%2Freport", "/files/report"),
            ("/files%2F%2Freport", "/files/report"),
            ("/a%252Fb", "/a%252Fb"),
        ] {
            assert_eq!(canonical_path(path), canonical.as_bytes(), "{path}");
        }
        assert!(matches!(canonical_path("/a/b/c"), Cow::Borrowed(_)));
        assert!(matches!(canonical_path("/a/b/"), Cow::Borrowed(_)));
    }

    fn request(path: &str, headers: &[(&str, &[u8])]) -> http::Request<()> {
        let mut req = http::Request::builder().uri(path);
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        req.body(()).expect("request")
    }

    fn header_key(name: &str, headers: &[(&str, &[u8])]) -> Result<Key, KeyError> {
        let req = request("/", headers);
        HeaderKey::named(name)
            .expect("name")
            .extract(&RequestView::from_request(&req))
    }

    fn path_key(path: &str) -> Vec<u8> {
        let req = request(path, &[]);
        let key = PathKey
            .extract(&RequestView::from_request(&req))
            .expect("key");
        key.as_bytes().to_vec()
    }

    #[test]
    fn header_keys_ignore_surrounding_blanks_and_refuse_ambiguity() {
        let key = |v: &[u8]| header_key("x-api-key", &[("x-api-key", v)]);
        let plain = key(b"K").expect("key");
        for spelled in [&b"K "[..], b" K", b"\tK\t", b"  K  "] {
            assert_eq!(key(spelled).expect("key"), plain, "{spelled:?}");
        }
        assert_eq!(key(b"a b").expect("key").as_bytes(), b"a b");
        for blank in [&b""[..], b" ", b"\t \t"] {
            assert!(
                matches!(key(blank), Err(KeyError::Invalid { .. })),
                "{blank:?}"
            );
        }
        assert!(matches!(
            header_key("x-api-key", &[]),
            Err(KeyError::Missing { .. })
        ));
        // A client's value and a proxy's appended one: neither is used.
        let twice = header_key(
            "x-user-id",
            &[("x-user-id", b"victim"), ("x-user-id", b"attacker")],
        );
        assert!(
            matches!(twice, Err(KeyError::Ambiguous { what }) if what.contains("more than once")),
            "{twice:?}"
        );
    }

    #[test]
    fn hashed_header_keys_are_digests_of_the_value_never_the_value() {
        let keyed = |extractor: HeaderKey, value: &[u8]| {
            let req = request("/", &[("authorization", value)]);
            extractor
                .extract(&RequestView::from_request(&req))
                .expect("key")
        };
        let named = || HeaderKey::named("authorization").expect("name");
        // SHA-256("abc") begins ba7816bf8f01cfea414140de5dae2223 (FIPS 180-2, appendix B.1).
        let sha = keyed(named().hashed(), b"abc");
        assert_eq!(sha.as_bytes(), b"ba7816bf8f01cfea414140de5dae2223");
        // Compared as the plain key compares values (spaces around trimmed), then hashed.
        assert_eq!(keyed(named().hashed(), b"  abc\t"), sha);
        assert_ne!(keyed(named().hashed(), b"abd"), sha);
        // HMAC-SHA-256, RFC 4231 test case 2 (key "Jefe") and test case 6 (a 131-byte key,
        // longer than a block, hashed first).
        let jefe = keyed(
            named().hashed_with(b"Jefe"),
            b"what do ya want for nothing?",
        );
        assert_eq!(jefe.as_bytes(), b"5bdcc146bf60754e6a042426089575c7");
        let long = keyed(
            named().hashed_with(&[0xaa; 131]),
            b"Test Using Larger Than Block-Size Key - Hash Key First",
        );
        assert_eq!(long.as_bytes(), b"60e431591ee0b67f0d8a26aacbf5b77f");
        // Another secret, another key; and neither the value nor the secret is shown.
        assert_ne!(
            keyed(
                named().hashed_with(b"other"),
                b"what do ya want for nothing?"
            ),
            jefe
        );
        let shown = format!("{:?}", named().hashed_with(b"s3cret-value"));
        assert!(!shown.contains("s3cret"), "{shown}");
        // A value over 8 KiB is refused before it is hashed; 8 KiB itself (a large bearer
        // token) is hashed. The bound can be set.
        let long = vec![b'k'; 8 * 1024 + 1];
        let req = request("/", &[("authorization", &long)]);
        assert!(matches!(
            named().hashed().extract(&RequestView::from_request(&req)),
            Err(KeyError::TooLong {
                len: 8193,
                max: 8192
            })
        ));
        assert_eq!(keyed(named().hashed(), &long[..8 * 1024]).len(), 32);
        assert!(matches!(
            named()
                .hashed()
                .max_value_len(100)
                .extract(&RequestView::from_request(&request(
                    "/",
                    &[("authorization", &long[..101])]
                ))),
            Err(KeyError::TooLong { len: 101, max: 100 })
        ));
        // Empty and missing values stay errors, not the digest of nothing.
        let req = request("/", &[("authorization", b" ")]);
        assert!(matches!(
            named().hashed().extract(&RequestView::from_request(&req)),
            Err(KeyError::Invalid { .. })
        ));
    }

    #[test]
    fn binary_metadata_keys_ignore_base64_padding() {
        let key = |v: &[u8]| header_key("x-token-bin", &[("x-token-bin", v)]);
        assert_eq!(key(b"YWI=").expect("key"), key(b"YWI").expect("key"));
        assert_eq!(key(b"YQ==").expect("key"), key(b"YQ").expect("key"));
        assert_ne!(key(b"YWI").expect("key"), key(b"YWJj").expect("key"));
        assert!(matches!(key(b"=="), Err(KeyError::Invalid { .. })));
        // Padding matters only to binary keys.
        let text = |v: &[u8]| header_key("x-token", &[("x-token", v)]);
        assert_ne!(text(b"a=").expect("key"), text(b"a").expect("key"));
    }

    #[test]
    fn method_keys_are_the_standard_methods_head_as_get() {
        let key = |method: &[u8]| {
            let req = http::Request::builder()
                .method(http::Method::from_bytes(method).expect("method"))
                .uri("/")
                .body(())
                .expect("request");
            let key = MethodKey
                .extract(&RequestView::from_request(&req))
                .expect("key");
            String::from_utf8(key.as_bytes().to_vec()).expect("utf-8")
        };
        assert_eq!(key(b"GET"), "GET");
        assert_eq!(key(b"HEAD"), "GET");
        for m in [
            "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "CONNECT", "TRACE",
        ] {
            assert_eq!(key(m.as_bytes()), m);
        }
        // Made-up methods, and the standard ones in another case, share one key.
        for m in ["FOO1", "FOO2", "get", "Post", "PROPFIND"] {
            assert_eq!(key(m.as_bytes()), "OTHER", "{m}");
        }
    }

    #[test]
    fn every_spelling_of_a_path_is_one_key() {
        let plain = path_key("/files/report");
        for spelled in [
            "/files/%72eport",
            "/files/r%65port",
            "/files/%72%65port",
            "/files/%72%65%70%6f%72%74",
            "/files/%72%65%70%6F%72%74",
            "/%66iles/report",
            "/files/./report",
            "/files//report",
            "//files/report",
            "/files/x/../report",
            "/files/%2e/report",
            "/x/../../files/report",
        ] {
            assert_eq!(path_key(spelled), plain, "{spelled}");
        }
        // A trailing slash is another resource.
        assert_eq!(path_key("/files/report/"), b"/files/report/");
        assert_eq!(path_key("/files/./report/"), b"/files/report/");
        // An escaped slash is a slash, as a file server reads it; escaped percent signs stay
        // escaped, in one case.
        assert_eq!(path_key("/a%2fb"), b"/a/b");
        assert_eq!(path_key("/a%2F.%2F%2Fb"), path_key("/a/b"));
        assert_eq!(path_key("/a%2541"), b"/a%2541");
        assert_ne!(path_key("/a%2541"), path_key("/a%41"));
        assert_eq!(path_key("/a%41"), b"/aA");
        // A percent sign that starts no escape is read as itself.
        assert_eq!(path_key("/100%"), b"/100%25");
        assert_eq!(path_key("/100%25"), b"/100%25");
        assert_eq!(path_key("/%zz"), path_key("/%25zz"));
        // Bytes that are not UTF-8 are keys too.
        assert_eq!(path_key("/%ff"), b"/\xff");
    }
}
