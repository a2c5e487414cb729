//! The client's IP behind trusted proxies: the rightmost untrusted hop of `Forwarded` or
//! `X-Forwarded-For`, starting from the peer address.
//!
//! A proxy appends the address it received a request from; everything to the left of that
//! was written by whoever sent the request and can be forged. So the chain is read from the
//! right, starting with the peer itself, and the first address that is not a trusted proxy is
//! the client. Headers are read only when the peer is trusted: a client that connects directly
//! cannot choose its key by sending headers.

use std::net::IpAddr;
use std::sync::Arc;

use http::{HeaderMap, HeaderName};
use ipnet::IpNet;

use super::{Key, KeyError, KeyExtractor, RequestView, canonical_ip};

/// At most this many hops are read from the right of a header chain.
const MAX_HOPS: usize = 32;

/// A set of trusted proxy networks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TrustedProxies {
    nets: Vec<IpNet>,
}

impl TrustedProxies {
    /// No proxy is trusted.
    pub fn none() -> Self {
        TrustedProxies::default()
    }

    /// These networks. An IPv4-mapped IPv6 network (`::ffff:10.0.0.0/104`, how peers look on
    /// a dual-stack listener) is taken as the IPv4 network it maps (`10.0.0.0/8`): addresses
    /// are compared in their IPv4 form.
    pub fn new(nets: impl IntoIterator<Item = IpNet>) -> Self {
        TrustedProxies {
            nets: nets.into_iter().map(canonical_net).collect(),
        }
    }

    /// Loopback and private networks: `127.0.0.0/8`, `10.0.0.0/8`, `172.16.0.0/12`,
    /// `192.168.0.0/16`, `::1/128`, `fc00::/7`.
    ///
    /// Every address in them is taken for a proxy. Where clients too connect from a private
    /// network (internal services through the same ingress), the walk goes past such a client
    /// into the entries it wrote itself, and it picks its own key: list the proxies' own
    /// networks instead.
    pub fn private() -> Self {
        let nets = [
            "127.0.0.0/8",
            "10.0.0.0/8",
            "172.16.0.0/12",
            "192.168.0.0/16",
            "::1/128",
            "fc00::/7",
        ];
        TrustedProxies::new(nets.iter().filter_map(|n| n.parse().ok()))
    }

    /// Parses a comma- or whitespace-separated list of networks or addresses
    /// (`10.0.0.0/8, 192.0.2.7, 2001:db8::/32`).
    pub fn parse(list: &str) -> Result<Self, crate::ConfigError> {
        let mut nets = Vec::new();
        for item in list
            .split(|c: char| c == ',' || c.is_whitespace())
            .filter(|s| !s.is_empty())
        {
            let net = match item.parse::<IpNet>() {
                Ok(net) => net,
                Err(_) => match item.parse::<IpAddr>() {
                    Ok(ip) => IpNet::from(ip),
                    Err(_) => {
                        return Err(crate::ConfigError::InvalidProxy {
                            value: item.to_owned(),
                        });
                    }
                },
            };
            nets.push(net);
        }
        Ok(TrustedProxies::new(nets))
    }

    /// Adds a network.
    #[must_use]
    pub fn with(mut self, net: IpNet) -> Self {
        self.nets.push(canonical_net(net));
        self
    }

    /// Whether `ip` is in a trusted network.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = canonical_ip(ip);
        self.nets.iter().any(|n| n.contains(&ip))
    }
}

/// `net`, or the IPv4 network an IPv4-mapped IPv6 network (`::ffff:0:0/96` and within) maps.
/// A shorter IPv6 prefix that covers the mapped range stays IPv6: its IPv4 part is all of
/// IPv4 and more, which no IPv4 network says.
fn canonical_net(net: IpNet) -> IpNet {
    match net {
        IpNet::V6(v6) if v6.prefix_len() >= 96 => match v6.network().to_ipv4_mapped() {
            Some(v4) => ipnet::Ipv4Net::new(v4, v6.prefix_len() - 96).map_or(net, IpNet::V4),
            None => net,
        },
        _ => net,
    }
}

/// Which header the trusted proxies write the chain to.
///
/// Choose the one your proxies maintain: a header they pass through untouched is written by
/// the client alone.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ForwardedHeader {
    /// `X-Forwarded-For: client, proxy1, proxy2` (the default).
    #[default]
    XForwardedFor,
    /// RFC 7239 `Forwarded: for=client, for="[2001:db8::1]:4711"`.
    Forwarded,
    /// Another header holding a comma-separated list of addresses (`X-Real-IP`, ...).
    Custom(HeaderName),
}

/// The client's IP address behind trusted proxies, IPv6 grouped by a prefix (default /64; a
/// client given a /56 or a /48 has 256 or 65,536 of those, see [`super::PeerIp`]).
///
/// With no trusted proxy this is the peer address. Unparseable, `unknown` or obfuscated
/// (`_hidden`) entries written by a trusted proxy end the walk: the key is then the trusted hop
/// that reported it, never anything to its left.
///
/// ```
/// use std::net::SocketAddr;
/// use floodgate_tower::key::{ClientIp, KeyExtractor, RequestView, TrustedProxies};
///
/// let client_ip = ClientIp::new(TrustedProxies::parse("10.0.0.0/8").unwrap());
/// let mut req = http::Request::get("/")
///     .header("x-forwarded-for", "6.6.6.6, 203.0.113.9, 10.0.0.2") // 6.6.6.6 is forged
///     .body(())
///     .unwrap();
/// req.extensions_mut().insert("10.0.0.1:443".parse::<SocketAddr>().unwrap());
/// let key = client_ip.extract(&RequestView::from_request(&req)).unwrap();
/// assert_eq!(key.as_bytes(), b"203.0.113.9");
/// ```
#[derive(Clone, Debug)]
pub struct ClientIp {
    trusted: Arc<TrustedProxies>,
    header: ForwardedHeader,
    v6_prefix: u8,
    trust_unaddressed: bool,
}

impl ClientIp {
    /// The client IP behind `trusted` proxies, read from `X-Forwarded-For`.
    pub fn new(trusted: TrustedProxies) -> Self {
        ClientIp {
            trusted: Arc::new(trusted),
            header: ForwardedHeader::XForwardedFor,
            v6_prefix: 64,
            trust_unaddressed: false,
        }
    }

    /// Takes a peer without an IP address for a trusted proxy: a reverse proxy on this host
    /// that connects over a Unix socket (axum served on a `UnixListener`), where no request
    /// has a peer address. The key is then the rightmost untrusted hop of the header chain
    /// (a request without one has no key and follows [`OnMissingKey`](crate::OnMissingKey)).
    ///
    /// Only for a socket that nothing but the proxy can reach: whoever connects to it writes
    /// the chain, and with it the key.
    #[must_use]
    pub fn trust_peers_without_address(mut self) -> Self {
        self.trust_unaddressed = true;
        self
    }

    /// Reads the chain from another header.
    #[must_use]
    pub fn header(mut self, header: ForwardedHeader) -> Self {
        self.header = header;
        self
    }

    /// Reads the chain from RFC 7239 `Forwarded`.
    #[must_use]
    pub fn forwarded(self) -> Self {
        self.header(ForwardedHeader::Forwarded)
    }

    /// Groups IPv6 addresses by their first `bits` bits (128: each address apart).
    #[must_use]
    pub fn ipv6_prefix(mut self, bits: u8) -> Self {
        self.v6_prefix = bits.min(128);
        self
    }

    /// The client's address: `peer` unless it is trusted, then the rightmost untrusted hop of
    /// the header chain.
    pub fn resolve(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        let peer = canonical_ip(peer);
        if !self.trusted.contains(peer) {
            return peer;
        }
        self.walk(Some(peer), headers).unwrap_or(peer)
    }

    /// The rightmost untrusted hop of the chain behind the trusted `peer` (`None`: a peer
    /// without an address); else the last trusted hop that could say, if any.
    fn walk(&self, peer: Option<IpAddr>, headers: &HeaderMap) -> Option<IpAddr> {
        let mut hops = Hops::default();
        match &self.header {
            ForwardedHeader::XForwardedFor => collect_list(
                headers,
                &http::header::HeaderName::from_static("x-forwarded-for"),
                &mut hops,
            ),
            ForwardedHeader::Custom(name) => collect_list(headers, name, &mut hops),
            ForwardedHeader::Forwarded => collect_forwarded(headers, &mut hops),
        }
        let mut client = peer;
        for hop in hops.iter_rev() {
            match hop {
                Some(ip) => {
                    client = Some(ip);
                    if !self.trusted.contains(ip) {
                        return client;
                    }
                }
                // A trusted proxy could not say who sent it the request: keep that proxy.
                None => return client,
            }
        }
        client
    }
}

impl KeyExtractor for ClientIp {
    fn extract(&self, req: &RequestView<'_>) -> Result<Key, KeyError> {
        let client = match req.peer_addr() {
            Some(peer) => self.resolve(peer.ip(), req.headers()),
            None if self.trust_unaddressed => {
                self.walk(None, req.headers()).ok_or(KeyError::Missing {
                    what: "client address in the forwarding header",
                })?
            }
            None => {
                return Err(KeyError::Missing {
                    what: "peer address",
                });
            }
        };
        Ok(Key::from_ip(client, self.v6_prefix))
    }
}

/// The last [`MAX_HOPS`] entries of a chain, oldest first; `None` for an entry that is not an
/// address.
#[derive(Default)]
struct Hops {
    ring: [Option<IpAddr>; MAX_HOPS],
    len: usize,
}

impl Hops {
    fn push(&mut self, hop: Option<IpAddr>) {
        self.ring[self.len % MAX_HOPS] = hop;
        self.len += 1;
    }

    /// Newest first.
    fn iter_rev(&self) -> impl Iterator<Item = Option<IpAddr>> + '_ {
        let n = self.len.min(MAX_HOPS);
        (0..n).map(move |i| self.ring[(self.len - 1 - i) % MAX_HOPS])
    }
}

/// `X-Forwarded-For`-style lists: every instance of the header, in order, comma-separated.
/// Entries are split on the raw bytes, so a byte that is not UTF-8 spoils only its own entry,
/// not the ones a trusted proxy appended after it.
fn collect_list(headers: &HeaderMap, name: &HeaderName, hops: &mut Hops) {
    for value in headers.get_all(name) {
        for item in value.as_bytes().split(|b| *b == b',') {
            let item = trim(item);
            if item.is_empty() {
                continue;
            }
            hops.push(std::str::from_utf8(item).ok().and_then(parse_node));
        }
    }
}

/// RFC 7239 `Forwarded`: elements separated by commas, pairs by semicolons, values tokens or
/// quoted strings; only `for=` matters here. An element without `for` is an unknown hop, and
/// so is a malformed one (an unclosed quote).
///
/// Elements are delimited from the right. The elements that matter are the newest ones,
/// appended by trusted proxies, and those are well-formed; what a client wrote sits to their
/// left. Read from the left, a quote the client leaves open (`for=1.2.3.4;x="`) would swallow
/// the element a proxy appends to the same line (`, for=203.0.113.9`), and the client would
/// choose its own key. Read from the right, the client's text can only spoil its own element.
fn collect_forwarded(headers: &HeaderMap, hops: &mut Hops) {
    for value in headers.get_all(http::header::FORWARDED) {
        let bytes = value.as_bytes();
        // The newest MAX_HOPS non-empty elements of this line, newest first: older ones would
        // fall out of `hops` anyway.
        let mut found = [(0usize, 0usize); MAX_HOPS];
        let mut n = 0;
        let mut end = bytes.len();
        let mut quoted = false;
        let mut i = bytes.len();
        while i > 0 && n < MAX_HOPS {
            i -= 1;
            match bytes[i] {
                b'"' if !escaped(bytes, i) => quoted = !quoted,
                b',' if !quoted => {
                    if !trim(&bytes[i + 1..end]).is_empty() {
                        found[n] = (i + 1, end);
                        n += 1;
                    }
                    end = i;
                }
                _ => {}
            }
        }
        if i == 0 && n < MAX_HOPS && !trim(&bytes[..end]).is_empty() {
            found[n] = (0, end);
            n += 1;
        }
        for &(from, to) in found[..n].iter().rev() {
            if let Some(hop) = forwarded_element(&bytes[from..to]) {
                hops.push(hop);
            }
        }
    }
}

/// Whether the byte at `i` is preceded by an odd number of backslashes (a quoted pair).
fn escaped(bytes: &[u8], i: usize) -> bool {
    bytes[..i].iter().rev().take_while(|b| **b == b'\\').count() % 2 == 1
}

/// One `Forwarded` element: `None` when it holds no pair (not a hop), else its `for` node
/// (`Some(None)` when it has none, names no address, or is malformed).
fn forwarded_element(bytes: &[u8]) -> Option<Option<IpAddr>> {
    let mut node: Option<Option<IpAddr>> = None;
    let mut any_pair = false;
    let mut i = 0;
    loop {
        // One pair.
        while i < bytes.len() && (bytes[i] == b' ' || bytes[i] == b'\t') {
            i += 1;
        }
        let name_start = i;
        while i < bytes.len() && !matches!(bytes[i], b'=' | b';') {
            i += 1;
        }
        let name = trim(&bytes[name_start..i]);
        any_pair |= !name.is_empty();
        let mut val: &[u8] = &[];
        let mut owned = Vec::new();
        if i < bytes.len() && bytes[i] == b'=' {
            i += 1;
            while i < bytes.len() && (bytes[i] == b' ' || bytes[i] == b'\t') {
                i += 1;
            }
            if i < bytes.len() && bytes[i] == b'"' {
                i += 1;
                loop {
                    match bytes.get(i) {
                        // An unclosed quote: the element is malformed.
                        None => return Some(None),
                        Some(b'"') => break,
                        Some(b'\\') if i + 1 < bytes.len() => {
                            owned.push(bytes[i + 1]);
                            i += 2;
                        }
                        Some(b) => {
                            owned.push(*b);
                            i += 1;
                        }
                    }
                }
                i += 1; // the closing quote
                while i < bytes.len() && bytes[i] != b';' {
                    i += 1;
                }
                val = &owned;
            } else {
                let start = i;
                while i < bytes.len() && bytes[i] != b';' {
                    i += 1;
                }
                val = trim(&bytes[start..i]);
            }
        }
        if name.eq_ignore_ascii_case(b"for") && node.is_none() {
            node = Some(std::str::from_utf8(val).ok().and_then(parse_node));
        }
        if i < bytes.len() && bytes[i] == b';' {
            i += 1;
            continue;
        }
        break;
    }
    any_pair.then(|| node.flatten())
}

fn trim(b: &[u8]) -> &[u8] {
    let start = b
        .iter()
        .position(|c| !c.is_ascii_whitespace())
        .unwrap_or(b.len());
    let end = b
        .iter()
        .rposition(|c| !c.is_ascii_whitespace())
        .map_or(start, |e| e + 1);
    &b[start..end.max(start)]
}

/// One node: `192.0.2.1`, `192.0.2.1:80`, `[2001:db8::1]`, `[2001:db8::1]:80`, `2001:db8::1`.
/// `unknown`, obfuscated identifiers (`_abc`) and garbage are `None`.
fn parse_node(s: &str) -> Option<IpAddr> {
    let s = s.trim();
    if let Some(rest) = s.strip_prefix('[') {
        let (addr, after) = rest.split_once(']')?;
        if !(after.is_empty() || valid_port(after.strip_prefix(':')?)) {
            return None;
        }
        return addr
            .parse::<std::net::Ipv6Addr>()
            .ok()
            .map(IpAddr::V6)
            .map(canonical_ip);
    }
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(canonical_ip(ip));
    }
    let (addr, port) = s.rsplit_once(':')?;
    if !valid_port(port) {
        return None;
    }
    addr.parse::<std::net::Ipv4Addr>().ok().map(IpAddr::V4)
}

/// A port, or an obfuscated port (`_abc`) as RFC 7239 allows.
fn valid_port(p: &str) -> bool {
    (!p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit()))
        || (p.starts_with('_')
            && p.len() > 1
            && p.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test address")
    }

    fn headers(name: &str, values: &[&[u8]]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(
                HeaderName::try_from(name).expect("name"),
                http::HeaderValue::from_bytes(v).expect("value"),
            );
        }
        h
    }

    fn xff(trusted: &str, peer: &str, values: &[&[u8]]) -> IpAddr {
        ClientIp::new(TrustedProxies::parse(trusted).expect("nets"))
            .resolve(ip(peer), &headers("x-forwarded-for", values))
    }

    fn fwd(trusted: &str, peer: &str, values: &[&[u8]]) -> IpAddr {
        ClientIp::new(TrustedProxies::parse(trusted).expect("nets"))
            .forwarded()
            .resolve(ip(peer), &headers("forwarded", values))
    }

    /// Behind a proxy on a Unix socket no request has a peer address: opted in, the chain
    /// alone gives the key.
    #[test]
    fn peers_without_an_address() {
        let key = |client_ip: &ClientIp, values: &[&[u8]], peer: Option<&str>| {
            let mut req = http::Request::get("/").body(()).expect("request");
            *req.headers_mut() = headers("x-forwarded-for", values);
            if let Some(peer) = peer {
                req.extensions_mut()
                    .insert(std::net::SocketAddr::new(ip(peer), 443));
            }
            client_ip
                .extract(&RequestView::from_request(&req))
                .map(|k| String::from_utf8_lossy(k.as_bytes()).into_owned())
        };
        let chain: &[&[u8]] = &[b"6.6.6.6, 203.0.113.9, 10.0.0.2"];
        let plain = ClientIp::new(TrustedProxies::parse("10.0.0.0/8").expect("nets"));
        assert!(matches!(
            key(&plain, chain, None),
            Err(KeyError::Missing {
                what: "peer address"
            })
        ));
        let local = plain.clone().trust_peers_without_address();
        assert_eq!(key(&local, chain, None).expect("key"), "203.0.113.9");
        // The socket's proxy only: nothing else trusted.
        let alone = ClientIp::new(TrustedProxies::new([])).trust_peers_without_address();
        assert_eq!(key(&alone, chain, None).expect("key"), "10.0.0.2");
        // No chain, or one the proxy could not write: no key.
        assert!(key(&local, &[], None).is_err());
        assert!(key(&local, &[b"203.0.113.9, unknown"], None).is_err());
        // Every hop trusted: the oldest.
        assert_eq!(
            key(&local, &[b"10.0.0.3, 10.0.0.2"], None).expect("key"),
            "10.0.0.3"
        );
        // A request with a peer address is read as before.
        assert_eq!(
            key(&local, chain, Some("198.51.100.7")).expect("key"),
            "198.51.100.7"
        );
        assert_eq!(
            key(&local, chain, Some("10.0.0.1")).expect("key"),
            "203.0.113.9"
        );
    }

    #[test]
    fn nodes() {
        assert_eq!(parse_node("192.0.2.1"), Some(ip("192.0.2.1")));
        assert_eq!(parse_node(" 192.0.2.1:8080 "), Some(ip("192.0.2.1")));
        assert_eq!(parse_node("[2001:db8::1]"), Some(ip("2001:db8::1")));
        assert_eq!(parse_node("[2001:db8::1]:4711"), Some(ip("2001:db8::1")));
        assert_eq!(parse_node("[2001:db8::1]:_hidden"), Some(ip("2001:db8::1")));
        assert_eq!(parse_node("2001:db8::1"), Some(ip("2001:db8::1")));
        assert_eq!(parse_node("::ffff:192.0.2.9"), Some(ip("192.0.2.9")));
        for bad in [
            "unknown",
            "_hidden",
            "_SEVKISEK",
            "",
            "[",
            "[]",
            "[::1",
            "[::1]x",
            "[::1]:",
            "[::1]:999999",
            "1.2.3",
            "1.2.3.4.5",
            "1.2.3.4:",
            "1.2.3.4:x",
            "300.1.1.1",
            "fe80::1%eth0",
            "[192.0.2.1]",
            "garbage",
            "1.2.3.4 5.6.7.8",
            "\u{0}",
        ] {
            assert_eq!(parse_node(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn untrusted_peer_ignores_headers() {
        assert_eq!(
            xff("10.0.0.0/8", "198.51.100.7", &[b"1.1.1.1"]),
            ip("198.51.100.7")
        );
        assert_eq!(
            fwd("10.0.0.0/8", "198.51.100.7", &[b"for=1.1.1.1"]),
            ip("198.51.100.7")
        );
        // Trusting nobody: always the peer.
        assert_eq!(xff("", "10.0.0.1", &[b"1.1.1.1"]), ip("10.0.0.1"));
    }

    #[test]
    fn ipv4_mapped_trusted_networks_match_ipv4_peers() {
        // As written for a dual-stack listener, whose peers look like ::ffff:10.0.0.5.
        for trusted in ["::ffff:10.0.0.5", "::ffff:10.0.0.0/104", "::ffff:0:0/96"] {
            for peer in ["10.0.0.5", "::ffff:10.0.0.5"] {
                assert_eq!(
                    xff(trusted, peer, &[b"203.0.113.9"]),
                    ip("203.0.113.9"),
                    "{trusted} trusts {peer}"
                );
            }
        }
        // Only the mapped network: 10.0.0.6 is not in ::ffff:10.0.0.5/128.
        assert_eq!(
            xff("::ffff:10.0.0.5", "10.0.0.6", &[b"203.0.113.9"]),
            ip("10.0.0.6")
        );
        let built = TrustedProxies::new(["::ffff:10.0.0.0/104".parse().expect("net")]);
        assert!(built.contains(ip("10.1.2.3")));
        let added = TrustedProxies::none().with("::ffff:192.0.2.0/120".parse().expect("net"));
        assert!(added.contains(ip("192.0.2.77")));
        assert!(!added.contains(ip("192.0.3.1")));
        // Plain IPv6 networks stay as they are.
        assert!(
            TrustedProxies::parse("2001:db8::/32")
                .expect("net")
                .contains(ip("2001:db8::1"))
        );
    }

    #[test]
    fn rightmost_untrusted_hop() {
        let t = "10.0.0.0/8, 192.168.0.0/16";
        assert_eq!(xff(t, "10.0.0.1", &[b"203.0.113.9"]), ip("203.0.113.9"));
        // Forged entries on the left are skipped.
        assert_eq!(
            xff(
                t,
                "10.0.0.1",
                &[b"6.6.6.6, 7.7.7.7, 203.0.113.9, 192.168.1.1"]
            ),
            ip("203.0.113.9")
        );
        // Several header instances form one list, in order.
        assert_eq!(
            xff(t, "10.0.0.1", &[b"6.6.6.6", b"203.0.113.9", b"10.1.1.1"]),
            ip("203.0.113.9")
        );
        // A byte that is not UTF-8 spoils its own entry only, not the one a proxy appended.
        assert_eq!(
            xff(t, "10.0.0.1", &[b"\xff, 203.0.113.9"]),
            ip("203.0.113.9")
        );
        assert_eq!(
            xff(t, "10.0.0.1", &[b"6.6.6.6\xff, 203.0.113.9, 10.0.0.2"]),
            ip("203.0.113.9")
        );
        // Every hop trusted: the leftmost.
        assert_eq!(xff(t, "10.0.0.1", &[b"10.9.9.9, 10.0.0.2"]), ip("10.9.9.9"));
        // No header: the peer.
        assert_eq!(xff(t, "10.0.0.1", &[]), ip("10.0.0.1"));
        // Ports and brackets in X-Forwarded-For.
        assert_eq!(
            xff(t, "10.0.0.1", &[b"[2001:db8::5]:443"]),
            ip("2001:db8::5")
        );
        assert_eq!(
            xff(t, "10.0.0.1", &[b"203.0.113.9:5555"]),
            ip("203.0.113.9")
        );
        // Empty items are skipped.
        assert_eq!(
            xff(t, "10.0.0.1", &[b",, 203.0.113.9 ,,"]),
            ip("203.0.113.9")
        );
        // IPv4-mapped peers are trusted as IPv4.
        assert_eq!(
            xff(t, "::ffff:10.0.0.1", &[b"203.0.113.9"]),
            ip("203.0.113.9")
        );
    }

    #[test]
    fn garbage_stops_at_the_reporting_proxy() {
        let t = "10.0.0.0/8";
        // A trusted proxy wrote garbage: it is the best we know.
        assert_eq!(
            xff(t, "10.0.0.1", &[b"203.0.113.9, nonsense"]),
            ip("10.0.0.1")
        );
        assert_eq!(xff(t, "10.0.0.1", &[b"unknown, 10.0.0.7"]), ip("10.0.0.7"));
        assert_eq!(xff(t, "10.0.0.1", &[b"\xff\xfe"]), ip("10.0.0.1"));
        // Garbage left of the client is never reached.
        assert_eq!(
            xff(t, "10.0.0.1", &[b"garbage, 203.0.113.9"]),
            ip("203.0.113.9")
        );
    }

    #[test]
    fn whatever_a_client_writes_the_element_a_proxy_appends_decides() {
        let t = "10.0.0.0/8";
        let prefixes: [&[u8]; 12] = [
            b"",
            b"\"",
            b"\\",
            b"\\\"",
            b"for=\"",
            b"for=6.6.6.6;x=\"a\\\"",
            b"for=\"\\\\\\\"",
            b"x=\"\";y=\"",
            b";;;===,,,",
            b"for=6.6.6.6;host=\"a,b",
            b"\xff\xfe\"",
            b"for=\"[",
        ];
        for prefix in prefixes {
            for (suffix, want) in [
                (&b", for=203.0.113.9"[..], "203.0.113.9"),
                (b", for=\"[2001:db8::1]:80\"", "2001:db8::1"),
                (
                    b", for=203.0.113.9;proto=https, for=10.0.0.3",
                    "203.0.113.9",
                ),
            ] {
                let line = [prefix, suffix].concat();
                assert_eq!(fwd(t, "10.0.0.1", &[&line]), ip(want), "{line:?}");
            }
        }
        // The newest elements are found from the right however long the line.
        let mut long = b"x=\"".to_vec();
        for i in 0..10_000 {
            long.extend_from_slice(format!("for=6.6.{}.{}, ", i / 256 % 256, i % 256).as_bytes());
        }
        long.extend_from_slice(b"for=203.0.113.9");
        assert_eq!(fwd(t, "10.0.0.1", &[&long]), ip("203.0.113.9"));
    }

    #[test]
    fn too_many_entries() {
        let t = "10.0.0.0/8";
        let mut long = String::new();
        for i in 0..10_000 {
            long.push_str(&format!("6.6.{}.{}, ", i / 256 % 256, i % 256));
        }
        long.push_str("203.0.113.9");
        assert_eq!(xff(t, "10.0.0.1", &[long.as_bytes()]), ip("203.0.113.9"));
        // More trusted hops than we read: the leftmost one read, never a forged one.
        let mut chain = String::from("6.6.6.6");
        for i in 0..100 {
            chain.push_str(&format!(", 10.0.{}.{}", i / 256, i % 256));
        }
        assert!(TrustedProxies::parse(t).expect("nets").contains(xff(
            t,
            "10.0.0.1",
            &[chain.as_bytes()]
        )));
    }

    #[test]
    fn forwarded_header() {
        let t = "10.0.0.0/8";
        assert_eq!(fwd(t, "10.0.0.1", &[b"for=203.0.113.9"]), ip("203.0.113.9"));
        assert_eq!(
            fwd(t, "10.0.0.1", &[b"for=\"[2001:db8:cafe::17]:4711\""]),
            ip("2001:db8:cafe::17")
        );
        assert_eq!(
            fwd(
                t,
                "10.0.0.1",
                &[b"For=\"6.6.6.6\", for=203.0.113.9;proto=https;by=10.0.0.1"]
            ),
            ip("203.0.113.9")
        );
        assert_eq!(
            fwd(
                t,
                "10.0.0.1",
                &[b"for=6.6.6.6", b"for=203.0.113.9, for=10.0.0.3"]
            ),
            ip("203.0.113.9")
        );
        // Parameters in any order, with host and proto.
        assert_eq!(
            fwd(t, "10.0.0.1", &[b"proto=http;host=\"a,b\";for=203.0.113.9"]),
            ip("203.0.113.9")
        );
        // Quoted commas do not split elements.
        assert_eq!(
            fwd(t, "10.0.0.1", &[b"for=203.0.113.9;host=\"x,for=6.6.6.6\""]),
            ip("203.0.113.9")
        );
        // Obfuscated and unknown nodes written by a trusted proxy stop the walk.
        assert_eq!(
            fwd(t, "10.0.0.1", &[b"for=6.6.6.6, for=_hidden"]),
            ip("10.0.0.1")
        );
        assert_eq!(fwd(t, "10.0.0.1", &[b"for=unknown"]), ip("10.0.0.1"));
        // An element without `for` is an unknown hop.
        assert_eq!(
            fwd(t, "10.0.0.1", &[b"for=6.6.6.6, proto=https"]),
            ip("10.0.0.1")
        );
        // A quote the client leaves open does not swallow what a trusted proxy appends to the
        // same line: the client's element is malformed, the proxy's is read.
        for line in [
            &b"for=1.2.3.4;x=\", for=203.0.113.9"[..],
            b"for=1.2.3.4;x=\"abc\\\", for=203.0.113.9",
            b"for=\"6.6.6.6, for=203.0.113.9",
            b"for=1.2.3.4;x=\", for=203.0.113.9;host=\"a\\\"b,c\"",
        ] {
            assert_eq!(fwd(t, "10.0.0.1", &[line]), ip("203.0.113.9"), "{line:?}");
        }
        // Not even by pairing with a quote the proxy writes.
        assert_eq!(
            fwd(t, "10.0.0.1", &[b"for=1.2.3.4;x=\", for=\"[2001:db8::1]\""]),
            ip("2001:db8::1")
        );
        // Every hop trusted, and the client's element malformed: the proxy that received it.
        assert_eq!(
            fwd(t, "10.0.0.1", &[b"for=\"6.6.6.6, for=10.0.0.7"]),
            ip("10.0.0.7")
        );
        // Garbage.
        assert_eq!(fwd(t, "10.0.0.1", &[b";;;,,,===\"\"\"\\"]), ip("10.0.0.1"));
        assert_eq!(fwd(t, "10.0.0.1", &[b"for=\"unterminated"]), ip("10.0.0.1"));
        assert_eq!(
            fwd(t, "10.0.0.1", &[b"for=[2001:db8::1]"]),
            ip("2001:db8::1")
        );
        // IPv6 keys group by /64.
        let key = Key::from_ip(ip("2001:db8:1:2:3:4:5:6"), 64);
        assert_eq!(key.as_bytes(), b"2001:db8:1:2::/64");
        assert_eq!(
            Key::from_ip(ip("2001:db8::1"), 128).as_bytes(),
            b"2001:db8::1"
        );
        assert_eq!(Key::from_ip(ip("2001:db8::1"), 0).as_bytes(), b"::/0");
    }

    #[test]
    fn trusted_list_parsing() {
        let t = TrustedProxies::parse("10.0.0.0/8 192.0.2.7,2001:db8::/32").expect("nets");
        assert!(t.contains(ip("10.200.0.1")));
        assert!(t.contains(ip("192.0.2.7")));
        assert!(!t.contains(ip("192.0.2.8")));
        assert!(t.contains(ip("2001:db8:ffff::1")));
        assert!(TrustedProxies::parse("10.0.0.0/33").is_err());
        assert!(TrustedProxies::parse("nope").is_err());
        assert!(TrustedProxies::private().contains(ip("::1")));
    }
}
