//! The built-in key extractors.

use std::fmt;
use std::sync::Arc;

use http::HeaderName;

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
/// a prefix (default /64, what one subscriber usually gets).
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
/// Any bytes are accepted (binary, non-UTF-8); an empty or absent header is a missing key, and
/// a value longer than the layer's maximum key length counts as missing too. Only the first
/// instance of the header is used.
#[derive(Clone, Debug)]
pub struct HeaderKey {
    name: HeaderName,
}

impl HeaderKey {
    /// The value of header `name`.
    pub fn new(name: HeaderName) -> Self {
        HeaderKey { name }
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
        match req.headers().get(&self.name) {
            Some(v) if !v.is_empty() => Ok(Key::new(v.as_bytes())),
            Some(_) => Err(KeyError::Invalid {
                what: "empty key header",
            }),
            None => Err(KeyError::Missing { what: "key header" }),
        }
    }
}

/// gRPC metadata is carried in headers: a metadata key is a [`HeaderKey`] (use lowercase
/// names; a `-bin` key's value is keyed on its base64 text).
pub type MetadataKey = HeaderKey;

/// The request path. Every distinct path is a key: with path parameters prefer
/// [`RouteKey`] (feature `axum`), which keys on the route pattern.
#[derive(Clone, Copy, Debug, Default)]
pub struct PathKey;

impl KeyExtractor for PathKey {
    fn extract(&self, req: &RequestView<'_>) -> Result<Key, KeyError> {
        Ok(Key::from(req.path()))
    }
}

/// The route pattern axum matched (`/users/{id}`), from `MatchedPath`. Missing when the layer
/// does not run inside an axum `Router` (add it with `Router::layer` or `route_layer`).
#[cfg(feature = "axum")]
#[derive(Clone, Copy, Debug, Default)]
pub struct RouteKey;

#[cfg(feature = "axum")]
impl KeyExtractor for RouteKey {
    fn extract(&self, req: &RequestView<'_>) -> Result<Key, KeyError> {
        req.matched_path().map(Key::from).ok_or(KeyError::Missing {
            what: "matched route",
        })
    }
}

/// The request method.
#[derive(Clone, Copy, Debug, Default)]
pub struct MethodKey;

impl KeyExtractor for MethodKey {
    fn extract(&self, req: &RequestView<'_>) -> Result<Key, KeyError> {
        Ok(Key::from(req.method().as_str()))
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
