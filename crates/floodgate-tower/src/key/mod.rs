//! Rate-limit keys: what a request is counted against, and the extractors that find it.
//!
//! An extractor reads a borrowed [`RequestView`] (method, URI, headers, extensions), so it
//! works for any body type. [`KeyExtractor`] decides synchronously; [`AsyncKeyExtractor`]
//! returns a `'static` future for lookups that need I/O (copy what you need from the view
//! before the `async` block). Both are implemented for closures:
//!
//! ```
//! use floodgate_tower::key::{Key, KeyExtractor, RequestView};
//!
//! let tenant = |req: &RequestView<'_>| req.header("x-tenant").map(|v| Key::from(v.as_bytes()));
//! let req = http::Request::builder().header("x-tenant", "acme").body(()).unwrap();
//! let key = tenant.extract(&RequestView::from_request(&req)).unwrap();
//! assert_eq!(key.as_bytes(), b"acme");
//! ```

mod builtin;
mod client_ip;

use std::fmt;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;

use http::{Extensions, HeaderMap, HeaderValue, Method, Request, Uri};
use smallvec::SmallVec;

#[cfg(feature = "axum")]
pub use builtin::RouteKey;
pub(crate) use builtin::canonical_path;
pub use builtin::{
    Composite, DEFAULT_MAX_HASHED_VALUE_LEN, GlobalKey, HeaderKey, MetadataKey, MethodKey, PathKey,
    PeerIp,
};
pub use client_ip::{ClientIp, ForwardedHeader, TrustedProxies};

/// The longest key accepted by default; longer keys count as missing, and are turned away
/// under `OnMissingKey::Allow` (see [`crate::RateLimitLayerBuilder::max_key_len`]).
pub const DEFAULT_MAX_KEY_LEN: usize = 1024;

/// A borrowed view of a request's head: what key extractors and route rules look at.
#[derive(Clone, Copy, Debug)]
pub struct RequestView<'a> {
    method: &'a Method,
    uri: &'a Uri,
    headers: &'a HeaderMap,
    extensions: &'a Extensions,
}

impl<'a> RequestView<'a> {
    /// A view of these parts.
    pub fn new(
        method: &'a Method,
        uri: &'a Uri,
        headers: &'a HeaderMap,
        extensions: &'a Extensions,
    ) -> Self {
        RequestView {
            method,
            uri,
            headers,
            extensions,
        }
    }

    /// A view of `req`'s head.
    pub fn from_request<B>(req: &'a Request<B>) -> Self {
        RequestView::new(req.method(), req.uri(), req.headers(), req.extensions())
    }

    /// A view of a request's parts.
    pub fn from_parts(parts: &'a http::request::Parts) -> Self {
        RequestView::new(&parts.method, &parts.uri, &parts.headers, &parts.extensions)
    }

    /// The method.
    pub fn method(&self) -> &'a Method {
        self.method
    }

    /// The URI.
    pub fn uri(&self) -> &'a Uri {
        self.uri
    }

    /// The path of the URI.
    pub fn path(&self) -> &'a str {
        self.uri.path()
    }

    /// The headers (gRPC metadata, for gRPC requests).
    pub fn headers(&self) -> &'a HeaderMap {
        self.headers
    }

    /// The first value of header `name`.
    pub fn header(&self, name: &str) -> Option<&'a HeaderValue> {
        self.headers.get(name)
    }

    /// The extensions (connection info, matched route, ...).
    pub fn extensions(&self) -> &'a Extensions {
        self.extensions
    }

    /// Whether this is a gRPC request: a `POST` (as every gRPC and gRPC-Web call is) whose
    /// `content-type` is gRPC's or gRPC-Web's (`application/grpc`, `application/grpc+proto`,
    /// `application/grpc-web`, ...; see [`crate::grpc::is_grpc`]). Another method with that
    /// content type is an HTTP request, turned away with an HTTP status: a client that sends
    /// `GET /app.js` with it does not turn its 429 into gRPC's `200 OK` with an empty body,
    /// which a cache in front could keep and serve to everyone.
    pub fn is_grpc(&self) -> bool {
        *self.method() == http::Method::POST && crate::grpc::is_grpc(self.headers)
    }

    /// The address of the connection's peer, from a [`SocketAddr`] extension, axum's
    /// `ConnectInfo<SocketAddr>` (feature `axum`), or tonic's `TcpConnectInfo` (feature
    /// `tonic`).
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        if let Some(addr) = self.extensions.get::<SocketAddr>() {
            return Some(*addr);
        }
        #[cfg(feature = "axum")]
        if let Some(info) = self
            .extensions
            .get::<axum::extract::ConnectInfo<SocketAddr>>()
        {
            return Some(info.0);
        }
        #[cfg(feature = "tonic")]
        if let Some(info) = self
            .extensions
            .get::<tonic::transport::server::TcpConnectInfo>()
        {
            return info.remote_addr();
        }
        None
    }

    /// The matched route pattern (axum's `MatchedPath`), when the layer runs inside a router.
    #[cfg(feature = "axum")]
    pub fn matched_path(&self) -> Option<&'a str> {
        self.extensions
            .get::<axum::extract::MatchedPath>()
            .map(|m| m.as_str())
    }
}

/// A rate-limit key: any bytes. Short keys (most IPs, API keys) are stored inline.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Key(SmallVec<[u8; 48]>);

impl Key {
    /// A key of these bytes.
    pub fn new(bytes: &[u8]) -> Self {
        Key(SmallVec::from_slice(bytes))
    }

    /// The key's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The key's length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the key is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The key of an IP address; IPv6 addresses are grouped by their first `v6_prefix` bits
    /// (`2001:db8:1:2::/64`).
    ///
    /// An IPv6 address that stands for one IPv4 host is keyed by that IPv4 address, as the
    /// host's own IPv4 requests are:
    /// - IPv4-mapped addresses (`::ffff:192.0.2.1`);
    /// - the IPv4/IPv6 translators' well-known prefix `64:ff9b::/96` (RFC 6052): behind NAT64
    ///   or SIIT every IPv4 client has one of those, and grouped by /64 they would all share
    ///   one key;
    /// - Teredo, `2001::/32` (RFC 4380): the client's public IPv4 address, which the address
    ///   carries inverted in its last 32 bits. Grouped by /64 every client of one Teredo server
    ///   would share a key; keyed by the whole address, one client could take another port
    ///   mapping, and with it a fresh key, whenever it liked;
    /// - 6to4, `2002::/16` (RFC 3056): the site's IPv4 address, in bits 16 to 47. A site owns
    ///   the whole `/48`, and grouped by /64 could spread over 65,536 keys.
    ///
    /// Teredo and 6to4 addresses count as IPv4 only when the IPv4 address they carry is a
    /// public one, never one of the private, shared (`100.64.0.0/10`), loopback, link-local
    /// or multicast ranges: those would share a key with the internal host of that address.
    /// An IPv6 address that stands for an IPv4 host is keyed by that host even with
    /// `v6_prefix` 128.
    pub fn from_ip(ip: IpAddr, v6_prefix: u8) -> Self {
        use std::fmt::Write as _;
        let v6 = match ip {
            IpAddr::V4(v4) => return Key::from_ipv4(v4),
            IpAddr::V6(v6) => match embedded_ipv4(v6) {
                Some(v4) => return Key::from_ipv4(v4),
                None => v6,
            },
        };
        let mut key = Key::default();
        if v6_prefix >= 128 {
            let _ = write!(key, "{v6}");
        } else {
            let bits = u128::from(v6);
            let mask = if v6_prefix == 0 {
                0
            } else {
                u128::MAX << (128 - u32::from(v6_prefix))
            };
            let net = std::net::Ipv6Addr::from(bits & mask);
            let _ = write!(key, "{net}/{v6_prefix}");
        }
        key
    }

    /// Dotted decimal, from a table, on the stack: the hot path of per-IP limits.
    #[inline]
    fn from_ipv4(v4: std::net::Ipv4Addr) -> Self {
        let mut buf = [0u8; 20];
        let mut len = 0;
        for octet in v4.octets() {
            let (digits, n) = OCTETS[usize::from(octet)];
            buf[len..len + 4].copy_from_slice(&digits);
            len += n;
        }
        // Without the last dot.
        Key::new(&buf[..len - 1])
    }

    pub(crate) fn push(&mut self, byte: u8) {
        self.0.push(byte);
    }
}

impl fmt::Write for Key {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        self.0.extend_from_slice(s.as_bytes());
        Ok(())
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key(\"{}\")", crate::telemetry::Escaped::new(&self.0))
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&crate::telemetry::Escaped::new(&self.0), f)
    }
}

impl AsRef<[u8]> for Key {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl From<&[u8]> for Key {
    fn from(bytes: &[u8]) -> Self {
        Key::new(bytes)
    }
}

impl From<&str> for Key {
    fn from(s: &str) -> Self {
        Key::new(s.as_bytes())
    }
}

impl From<String> for Key {
    fn from(s: String) -> Self {
        Key::new(s.as_bytes())
    }
}

impl From<Vec<u8>> for Key {
    fn from(v: Vec<u8>) -> Self {
        Key(SmallVec::from_vec(v))
    }
}

impl From<IpAddr> for Key {
    /// The address itself (IPv6 not grouped; an address that stands for an IPv4 host, such
    /// as an IPv4-mapped or a Teredo one, is that host's IPv4 address: see [`Key::from_ip`]).
    fn from(ip: IpAddr) -> Self {
        Key::from_ip(ip, 128)
    }
}

/// Each byte in decimal followed by a dot (padded to four bytes), and the length of that.
static OCTETS: [([u8; 4], usize); 256] = {
    let mut table = [([0u8; 4], 0); 256];
    let mut i = 0;
    while i < 256 {
        let n = i as u8;
        table[i] = if n >= 100 {
            ([b'0' + n / 100, b'0' + n / 10 % 10, b'0' + n % 10, b'.'], 4)
        } else if n >= 10 {
            ([b'0' + n / 10, b'0' + n % 10, b'.', 0], 3)
        } else {
            ([b'0' + n, b'.', 0, 0], 2)
        };
        i += 1;
    }
    table
};

/// The top 96 bits of the well-known prefix `64:ff9b::/96` of IPv4/IPv6 translation.
const NAT64_PREFIX: u128 = 0x0064_ff9b_0000_0000_0000_0000;
/// The top 32 bits of Teredo's prefix `2001::/32`.
const TEREDO_PREFIX: u128 = 0x2001_0000;
/// The top 16 bits of 6to4's prefix `2002::/16`.
const SIX_TO_FOUR_PREFIX: u128 = 0x2002;

/// The IPv4 host an IPv6 address stands for (see [`Key::from_ip`]), if it stands for one.
fn embedded_ipv4(v6: std::net::Ipv6Addr) -> Option<std::net::Ipv4Addr> {
    let bits = u128::from(v6);
    if let Some(v4) = v6.to_ipv4_mapped() {
        Some(v4)
    } else if bits >> 32 == NAT64_PREFIX {
        Some(std::net::Ipv4Addr::from(bits as u32))
    } else if bits >> 96 == TEREDO_PREFIX {
        // RFC 4380 section 4: the client's mapped address, every bit inverted.
        Some(std::net::Ipv4Addr::from(!(bits as u32))).filter(public)
    } else if bits >> 112 == SIX_TO_FOUR_PREFIX {
        Some(std::net::Ipv4Addr::from((bits >> 80) as u32)).filter(public)
    } else {
        None
    }
}

/// Whether a tunnel's IPv4 address may be a host's on the Internet. One that cannot (a private,
/// shared, loopback, link-local, multicast or reserved address) would share its key with the
/// internal host that has it: such a tunnel address is keyed as IPv6.
fn public(v4: &std::net::Ipv4Addr) -> bool {
    let [a, b, ..] = v4.octets();
    !(v4.is_unspecified()
        || a == 0
        || v4.is_private()
        || (a == 100 && (b & 0xc0) == 64)
        || v4.is_loopback()
        || v4.is_link_local()
        || a >= 224)
}

/// IPv4-mapped IPv6 addresses (`::ffff:192.0.2.1`) as IPv4.
pub(crate) fn canonical_ip(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

/// Why no key could be taken from a request.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The request has nothing to key on.
    #[error("the request has no {what}")]
    Missing {
        /// What was looked for: `"peer address"`, `"x-api-key header"`, ...
        what: &'static str,
    },
    /// The key is longer than allowed.
    #[error("the key is {len} bytes long, more than the {max} allowed")]
    TooLong {
        /// Its length.
        len: usize,
        /// The most allowed.
        max: usize,
    },
    /// The request has a value, but not a usable one.
    #[error("invalid {what}")]
    Invalid {
        /// What was wrong.
        what: &'static str,
    },
    /// The request has several values where one is expected (a key header sent twice), and
    /// which one the client wrote cannot be told. Always turned away (400), whatever
    /// [`OnMissingKey`](crate::OnMissingKey) says: letting it through would let a client
    /// escape a rule set to `Allow` by repeating a header its application reads once.
    #[error("ambiguous {what}")]
    Ambiguous {
        /// What was sent more than once.
        what: &'static str,
    },
}

/// Finds the key of a request, synchronously.
///
/// Implemented for closures `Fn(&RequestView<'_>) -> Option<Key>` (`None` counts as a missing
/// key).
pub trait KeyExtractor: Send + Sync + 'static {
    /// The key of `req`.
    fn extract(&self, req: &RequestView<'_>) -> Result<Key, KeyError>;
}

impl<F> KeyExtractor for F
where
    F: Fn(&RequestView<'_>) -> Option<Key> + Send + Sync + 'static,
{
    fn extract(&self, req: &RequestView<'_>) -> Result<Key, KeyError> {
        self(req).ok_or(KeyError::Missing { what: "key" })
    }
}

impl<K: KeyExtractor + ?Sized> KeyExtractor for std::sync::Arc<K> {
    fn extract(&self, req: &RequestView<'_>) -> Result<Key, KeyError> {
        (**self).extract(req)
    }
}

/// Finds the key of a request with I/O (a token lookup, ...).
///
/// The future must not borrow the request: copy what it needs first. Implemented for
/// closures `Fn(&RequestView<'_>) -> impl Future<Output = Option<Key>>`.
///
/// The layer's [`timeout`](crate::RateLimitLayerBuilder::timeout) bounds the store's decision,
/// not the extractor: bound the lookup yourself (answering `None` when it takes too long, which
/// the layer's [`OnMissingKey`](crate::OnMissingKey) then decides), or a lookup that hangs
/// holds its request. The keys of several asynchronous extractors are awaited one after the
/// other.
///
/// ```
/// use floodgate_tower::key::{AsyncKeyExtractor, Key, RequestView};
///
/// let account = |req: &RequestView<'_>| {
///     let token = req.header("authorization").map(|v| v.as_bytes().to_vec());
///     async move { token.map(|t| Key::from(format!("account-of-{}", t.len()))) }
/// };
/// # fn assert_async(_: impl AsyncKeyExtractor) {}
/// assert_async(account);
/// ```
pub trait AsyncKeyExtractor: Send + Sync + 'static {
    /// The future returned by [`AsyncKeyExtractor::extract`].
    type Future: Future<Output = Result<Key, KeyError>> + Send + 'static;

    /// Starts finding the key of `req`.
    fn extract(&self, req: &RequestView<'_>) -> Self::Future;
}

impl<F, Fut> AsyncKeyExtractor for F
where
    F: Fn(&RequestView<'_>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Option<Key>> + Send + 'static,
{
    type Future = futures_util::future::Map<Fut, fn(Option<Key>) -> Result<Key, KeyError>>;

    fn extract(&self, req: &RequestView<'_>) -> Self::Future {
        use futures_util::FutureExt as _;
        self(req).map(missing_to_error as fn(Option<Key>) -> Result<Key, KeyError>)
    }
}

fn missing_to_error(key: Option<Key>) -> Result<Key, KeyError> {
    key.ok_or(KeyError::Missing { what: "key" })
}

pub(crate) type KeyFuture = Pin<Box<dyn Future<Output = Result<Key, KeyError>> + Send>>;

pub(crate) trait ErasedAsync: Send + Sync + 'static {
    fn extract_boxed(&self, req: &RequestView<'_>) -> KeyFuture;
}

impl<K: AsyncKeyExtractor> ErasedAsync for K {
    fn extract_boxed(&self, req: &RequestView<'_>) -> KeyFuture {
        Box::pin(self.extract(req))
    }
}

/// A key extractor of either kind, type-erased.
#[derive(Clone)]
pub(crate) enum AnyExtractor {
    Sync(std::sync::Arc<dyn KeyExtractor>),
    Async(std::sync::Arc<dyn ErasedAsync>),
}

impl AnyExtractor {
    pub(crate) fn sync(k: impl KeyExtractor) -> Self {
        AnyExtractor::Sync(std::sync::Arc::new(k))
    }

    pub(crate) fn asynchronous(k: impl AsyncKeyExtractor) -> Self {
        AnyExtractor::Async(std::sync::Arc::new(k))
    }
}

/// What a rule's extractor gave for one request.
pub(crate) enum Extracted {
    Ready(Result<Key, KeyError>),
    Pending(KeyFuture),
}

impl AnyExtractor {
    pub(crate) fn extract(&self, req: &RequestView<'_>) -> Extracted {
        match self {
            AnyExtractor::Sync(k) => Extracted::Ready(k.extract(req)),
            AnyExtractor::Async(k) => Extracted::Pending(k.extract_boxed(req)),
        }
    }
}

impl fmt::Debug for AnyExtractor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AnyExtractor::Sync(_) => "KeyExtractor",
            AnyExtractor::Async(_) => "AsyncKeyExtractor",
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn ipv4_keys_are_dotted_decimal() {
        for ip in [
            "0.0.0.0",
            "255.255.255.255",
            "10.0.0.1",
            "127.0.0.1",
            "192.168.100.20",
        ] {
            let addr: std::net::IpAddr = ip.parse().expect("ip");
            assert_eq!(super::Key::from_ip(addr, 64).as_bytes(), ip.as_bytes());
        }
        let mapped: std::net::IpAddr = "::ffff:10.1.2.3".parse().expect("ip");
        assert_eq!(super::Key::from_ip(mapped, 64).as_bytes(), b"10.1.2.3");
    }

    #[test]
    fn translated_ipv4_clients_are_keyed_apart() {
        // Behind NAT64 or SIIT each IPv4 client is one address of 64:ff9b::/96: keyed by its
        // IPv4 address, not grouped by /64 with every other IPv4 client.
        let key = |ip: &str| {
            let addr: std::net::IpAddr = ip.parse().expect("ip");
            String::from_utf8(super::Key::from_ip(addr, 64).as_bytes().to_vec()).expect("utf-8")
        };
        assert_eq!(key("64:ff9b::192.0.2.33"), "192.0.2.33");
        assert_eq!(key("64:ff9b::c000:222"), "192.0.2.34");
        // Just outside the prefix: an IPv6 address like any other.
        assert_eq!(key("64:ff9b:0:0:1::1"), "64:ff9b::/64");
        assert_eq!(key("64:ff9b:1::1"), "64:ff9b:1::/64");
    }

    #[test]
    fn tunnelled_ipv4_hosts_are_keyed_by_their_ipv4_address() {
        let key = |ip: &str, prefix: u8| {
            let addr: std::net::IpAddr = ip.parse().expect("ip");
            String::from_utf8(super::Key::from_ip(addr, prefix).as_bytes().to_vec()).expect("utf-8")
        };
        // RFC 4380's example: a client behind 192.0.2.45, port 40000, of server 65.54.227.120.
        // Its other port mappings, and the server's other clients, are keyed apart from it.
        assert_eq!(
            key("2001:0:4136:e378:8000:63bf:3fff:fdd2", 64),
            "192.0.2.45"
        );
        assert_eq!(
            key("2001:0:4136:e378:8000:1234:3fff:fdd2", 128),
            "192.0.2.45"
        );
        assert_eq!(
            key("2001:0:4136:e378:8000:63bf:3fff:fdd3", 64),
            "192.0.2.44"
        );
        // 6to4: every subnet and host of the site 192.0.2.4.
        assert_eq!(key("2002:c000:204::1", 64), "192.0.2.4");
        assert_eq!(key("2002:c000:204:ffff:1:2:3:4", 48), "192.0.2.4");
        // Beside both prefixes: IPv6 addresses like any other.
        assert_eq!(key("2001:1:4136:e378::1", 64), "2001:1:4136:e378::/64");
        assert_eq!(key("2001:db8:1:2::1", 64), "2001:db8:1:2::/64");
        assert_eq!(key("2003:c000:204::1", 48), "2003:c000:204::/48");
        // A tunnel address carrying a private, loopback or multicast IPv4 address stays IPv6:
        // it must not share a key with the internal host of that address.
        assert_eq!(key("2002:a00:1::1", 64), "2002:a00:1::/64");
        assert_eq!(key("2002:7f00:1::1", 64), "2002:7f00:1::/64");
        assert_eq!(key("2002:6440:1::1", 64), "2002:6440:1::/64");
        assert_eq!(key("2002:e000:1::1", 64), "2002:e000:1::/64");
        // 10.0.0.1, inverted, behind a Teredo server.
        assert_eq!(
            key("2001:0:4136:e378:8000:63bf:f5ff:fffe", 64),
            "2001:0:4136:e378::/64"
        );
        // Just outside the shared range 100.64.0.0/10: public.
        assert_eq!(key("2002:6480:1::1", 64), "100.128.0.1");
    }
}
