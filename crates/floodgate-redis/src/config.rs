//! Where Redis is, how to connect to it, and how long to wait.
//!
//! ```
//! use std::time::Duration;
//! use floodgate_redis::{ConnectionKind, RedisConfig};
//!
//! # fn main() -> Result<(), floodgate_redis::Error> {
//! let config = RedisConfig::new("redis://app:s3cret@cache.internal:6380/2")?
//!     .connection(ConnectionKind::Pool { size: 16 })
//!     .timeout(Duration::from_millis(100))
//!     .key_prefix("sms")?;
//! assert_eq!(config.redacted_url(), "redis://app:***@cache.internal:6380/2");
//! assert!(!format!("{config:?}").contains("s3cret"));
//!
//! let cluster = RedisConfig::from_urls(["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"])?;
//! assert_eq!(cluster.kind(), ConnectionKind::Cluster);
//! # Ok(()) }
//! ```

use crate::breaker::BreakerConfig;
use std::fmt;
use std::time::Duration;

use redis::{ConnectionInfo, IntoConnectionInfo};
use url::Url;

use crate::Error;

/// Default bound on one call, including waiting for a pool connection.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(250);
/// Default bound on establishing the first connection.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Default prefix of every key floodgate writes.
pub const DEFAULT_KEY_PREFIX: &str = "floodgate";
/// Longest accepted key prefix, in bytes.
pub const MAX_KEY_PREFIX_LEN: usize = 64;
/// The connection kind used for a single-node URL unless one is chosen: the
/// faster one in `benches/connection.rs` (64 tasks running a tiny script).
pub const DEFAULT_SINGLE_NODE_KIND: ConnectionKind = ConnectionKind::Multiplexed;

/// How [`crate::RedisConn`] talks to Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ConnectionKind {
    /// One multiplexed connection that every call shares and that reconnects
    /// by itself (redis-rs `ConnectionManager`).
    Multiplexed,
    /// A bb8 pool of `size` connections; a call holds one for its duration.
    Pool {
        /// How many connections (at least 1).
        size: u32,
    },
    /// A Redis Cluster client that routes each call by its key's slot and
    /// follows the topology across failovers.
    Cluster,
}

impl fmt::Display for ConnectionKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Multiplexed => f.write_str("multiplexed"),
            Self::Pool { size } => write!(f, "pool of {size}"),
            Self::Cluster => f.write_str("cluster"),
        }
    }
}

/// One parsed node URL.
#[derive(Clone)]
struct Node {
    /// Without floodgate's own query parameters.
    url: Url,
    /// The URL as given, password replaced by `***`.
    redacted: String,
}

/// Connection settings, built from one URL or several cluster seed URLs.
///
/// URLs have the form `redis[s]://[user][:password@]host[:port][/db][?cluster=true]`;
/// the password may be percent-encoded. Passwords never appear in `Debug`,
/// `Display`, errors or logs: see [`RedisConfig::redacted_url`].
#[derive(Clone)]
pub struct RedisConfig {
    nodes: Vec<Node>,
    cluster_flag: bool,
    kind: Option<ConnectionKind>,
    timeout: Duration,
    connect_timeout: Duration,
    key_prefix: String,
    breaker: BreakerConfig,
    #[cfg(feature = "tls")]
    tls_ca: Option<Vec<u8>>,
    #[cfg(feature = "tls")]
    tls_insecure: bool,
}

impl RedisConfig {
    /// Settings for one URL: a single node, or a cluster seed with `?cluster=true`.
    ///
    /// # Errors
    /// [`Error::Config`] saying what is wrong with the URL (the URL shown
    /// with its password redacted).
    pub fn new(url: &str) -> Result<Self, Error> {
        Self::from_urls([url])
    }

    /// Settings for several URLs: the seed nodes of a Redis Cluster (one URL
    /// behaves like [`RedisConfig::new`]).
    ///
    /// # Errors
    /// [`Error::Config`] for no URL, an invalid one, or seeds that differ in
    /// scheme (`redis`/`rediss`).
    pub fn from_urls<I, S>(urls: I) -> Result<Self, Error>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut nodes = Vec::new();
        let mut cluster_flag = false;
        for url in urls {
            let (node, cluster) = parse_node(url.as_ref())?;
            cluster_flag |= cluster;
            nodes.push(node);
        }
        let Some(first) = nodes.first() else {
            return Err(Error::Config("no Redis URL given".to_owned()));
        };
        if let Some(other) = nodes.iter().find(|n| n.url.scheme() != first.url.scheme()) {
            return Err(Error::Config(format!(
                "cluster seed URLs must all use the same scheme: `{}` and `{}` differ",
                first.redacted, other.redacted
            )));
        }
        Ok(Self {
            nodes,
            cluster_flag,
            kind: None,
            timeout: DEFAULT_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            key_prefix: DEFAULT_KEY_PREFIX.to_owned(),
            breaker: BreakerConfig::default(),
            #[cfg(feature = "tls")]
            tls_ca: None,
            #[cfg(feature = "tls")]
            tls_insecure: false,
        })
    }

    /// Chooses how to connect. Without it: [`ConnectionKind::Cluster`] for
    /// several URLs or `?cluster=true`, else [`DEFAULT_SINGLE_NODE_KIND`].
    #[must_use]
    pub fn connection(mut self, kind: ConnectionKind) -> Self {
        self.kind = Some(kind);
        self
    }

    /// Treats the URL(s) as Redis Cluster seeds (same as `?cluster=true`).
    #[must_use]
    pub fn cluster(mut self, cluster: bool) -> Self {
        self.cluster_flag = cluster;
        self
    }

    /// Bounds each call, including the wait for a pool connection
    /// (default [`DEFAULT_TIMEOUT`]; must be greater than zero).
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Bounds establishing the first connection, and each reconnection attempt
    /// (default [`DEFAULT_CONNECT_TIMEOUT`]; must be greater than zero).
    #[must_use]
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Sets the prefix of every key (default [`DEFAULT_KEY_PREFIX`]).
    ///
    /// # Errors
    /// [`Error::Config`] if it is empty, longer than [`MAX_KEY_PREFIX_LEN`]
    /// bytes, or holds `{`, `}` (cluster hash tags), whitespace or control characters.
    pub fn key_prefix(mut self, prefix: &str) -> Result<Self, Error> {
        validate_key_prefix(prefix)?;
        prefix.clone_into(&mut self.key_prefix);
        Ok(self)
    }

    /// Trusts the CA certificate(s) in `pem` (PEM text) for `rediss://`,
    /// instead of the system's roots.
    #[cfg(feature = "tls")]
    #[must_use]
    pub fn tls_ca_cert(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls_ca = Some(pem.into());
        self
    }

    /// **Insecure**: accepts any server certificate on `rediss://`, so
    /// anyone on the network path can read and change the traffic. Only for
    /// tests and local development against self-signed servers; prefer
    /// [`RedisConfig::tls_ca_cert`].
    #[cfg(feature = "tls")]
    #[must_use]
    pub fn tls_insecure(mut self) -> Self {
        self.tls_insecure = true;
        self
    }

    /// The connection kind that [`crate::RedisConn::connect`] will use.
    pub fn kind(&self) -> ConnectionKind {
        self.kind
            .unwrap_or(if self.nodes.len() > 1 || self.cluster_flag {
                ConnectionKind::Cluster
            } else {
                DEFAULT_SINGLE_NODE_KIND
            })
    }

    /// The per-call timeout.
    pub fn get_timeout(&self) -> Duration {
        self.timeout
    }

    /// The connect timeout.
    pub fn get_connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// The key prefix.
    pub fn get_key_prefix(&self) -> &str {
        &self.key_prefix
    }

    /// The circuit breaker in front of the connection (see [`BreakerConfig`]).
    pub fn circuit_breaker(mut self, breaker: BreakerConfig) -> Self {
        self.breaker = breaker;
        self
    }

    /// The circuit breaker settings.
    pub fn get_breaker(&self) -> &BreakerConfig {
        &self.breaker
    }

    /// True for `rediss://` URLs.
    pub fn is_tls(&self) -> bool {
        self.nodes
            .first()
            .is_some_and(|n| n.url.scheme() == "rediss")
    }

    /// The URL(s) as given, each password replaced by `***`, joined by `, `.
    pub fn redacted_url(&self) -> String {
        let urls: Vec<&str> = self.nodes.iter().map(|n| n.redacted.as_str()).collect();
        urls.join(", ")
    }

    /// Checks everything that can be checked without connecting: positive
    /// timeouts, a pool of at least one connection, one URL unless
    /// clustered, database 0 on a cluster, TLS options only with `rediss://`.
    ///
    /// # Errors
    /// [`Error::Config`] naming the problem.
    pub fn validate(&self) -> Result<(), Error> {
        if self.timeout.is_zero() {
            return Err(Error::Config(
                "the call timeout must be greater than zero".to_owned(),
            ));
        }
        if self.connect_timeout.is_zero() {
            return Err(Error::Config(
                "the connect timeout must be greater than zero".to_owned(),
            ));
        }
        match self.kind() {
            ConnectionKind::Pool { size: 0 } => {
                return Err(Error::Config(
                    "a connection pool needs a size of at least 1".to_owned(),
                ));
            }
            ConnectionKind::Cluster => {
                if let Some(node) = self.nodes.iter().find(|n| db_of(&n.url) != 0) {
                    return Err(Error::Config(format!(
                        "Redis Cluster has only database 0, but `{}` selects another",
                        node.redacted
                    )));
                }
            }
            kind if self.nodes.len() > 1 => {
                return Err(Error::Config(format!(
                    "{} URLs given ({}) but the connection kind is {kind}; several URLs need ConnectionKind::Cluster",
                    self.nodes.len(),
                    self.redacted_url()
                )));
            }
            _ => {}
        }
        #[cfg(feature = "tls")]
        {
            if (self.tls_ca.is_some() || self.tls_insecure) && !self.is_tls() {
                return Err(Error::Config(format!(
                    "TLS options are set but `{}` is not a rediss:// URL",
                    self.redacted_url()
                )));
            }
            if let Some(pem) = &self.tls_ca {
                let marker = b"-----BEGIN CERTIFICATE-----";
                if !pem.windows(marker.len()).any(|w| w == marker) {
                    return Err(Error::Config(
                        "the TLS CA certificate is not PEM text (no `-----BEGIN CERTIFICATE-----`)"
                            .to_owned(),
                    ));
                }
            }
        }
        Ok(())
    }

    /// redis-rs connection infos of every node, with `#insecure` applied.
    pub(crate) fn connection_infos(&self) -> Result<Vec<ConnectionInfo>, Error> {
        self.nodes
            .iter()
            .map(|node| {
                #[allow(unused_mut)]
                let mut url = node.url.clone();
                #[cfg(feature = "tls")]
                if self.tls_insecure {
                    url.set_fragment(Some("insecure"));
                }
                url.into_connection_info()
                    .map(|info| info.set_tcp_settings(tcp_settings()))
                    .map_err(|e| {
                        Error::Config(format!("invalid Redis URL `{}`: {e}", node.redacted))
                    })
            })
            .collect()
    }

    /// The CA to trust, if one was set.
    #[cfg(feature = "tls")]
    pub(crate) fn tls_certificates(&self) -> Option<redis::TlsCertificates> {
        self.tls_ca.as_ref().map(|pem| redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(pem.clone()),
        })
    }
}

impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("RedisConfig");
        d.field(
            "urls",
            &self.nodes.iter().map(|n| &n.redacted).collect::<Vec<_>>(),
        )
        .field("kind", &self.kind())
        .field("timeout", &self.timeout)
        .field("connect_timeout", &self.connect_timeout)
        .field("key_prefix", &self.key_prefix);
        #[cfg(feature = "tls")]
        d.field("tls_ca", &self.tls_ca.as_ref().map(|_| "<set>"))
            .field("tls_insecure", &self.tls_insecure);
        d.finish()
    }
}

impl fmt::Display for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted_url())
    }
}

impl std::str::FromStr for RedisConfig {
    type Err = Error;

    fn from_str(url: &str) -> Result<Self, Error> {
        Self::new(url)
    }
}

/// Parses one URL; also returns its `cluster=` flag. Messages quote only
/// the redacted URL: a password with an unescaped `/`, `?` or `#` ends up
/// in the path, query or fragment, so those parts are never echoed.
fn parse_node(raw: &str) -> Result<(Node, bool), Error> {
    let redacted = redact_url(raw);
    if raw.trim().is_empty() {
        return Err(Error::Config("the Redis URL is empty".to_owned()));
    }
    let mut url = Url::parse(raw)
        .map_err(|e| Error::Config(format!("invalid Redis URL `{redacted}`: {e}")))?;
    match url.scheme() {
        "redis" => {}
        "rediss" if cfg!(feature = "tls") => {}
        "rediss" => {
            return Err(Error::Config(format!(
                "`{redacted}` needs TLS, but floodgate-redis was built without its `tls` feature"
            )));
        }
        other => {
            return Err(Error::Config(format!(
                "unsupported scheme `{other}` in `{redacted}`: expected redis:// or rediss://"
            )));
        }
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(Error::Config(format!("no host in Redis URL `{redacted}`")));
    }
    let db = url.path().trim_start_matches('/');
    if !db.is_empty() && db.parse::<u32>().is_err() {
        return Err(Error::Config(format!(
            "invalid database in Redis URL `{redacted}`: the path must be a database number like /0"
        )));
    }
    if url.fragment().is_some() {
        return Err(Error::Config(format!(
            "a fragment (#...) in Redis URL `{redacted}` is not supported{}",
            if cfg!(feature = "tls") {
                "; for #insecure use RedisConfig::tls_insecure"
            } else {
                ""
            }
        )));
    }
    let mut cluster = false;
    for (name, value) in url.query_pairs() {
        cluster = match (name.as_ref(), value.as_ref()) {
            ("cluster", "true" | "1" | "yes") => true,
            ("cluster", "false" | "0" | "no") => false,
            _ => {
                return Err(Error::Config(format!(
                    "unsupported query parameter in Redis URL `{redacted}`: only cluster=true|false is accepted"
                )));
            }
        };
    }
    url.set_query(None);
    // Let redis-rs check the rest (UTF-8 credentials...) now rather than at connect.
    url.clone()
        .into_connection_info()
        .map_err(|e| Error::Config(format!("invalid Redis URL `{redacted}`: {e}")))?;
    Ok((Node { url, redacted }, cluster))
}

fn db_of(url: &Url) -> u32 {
    url.path().trim_start_matches('/').parse().unwrap_or(0)
}

/// Replaces the password of a URL with `***`, working on the text as given
/// so that it also redacts URLs that do not parse. The password is
/// everything between the first `:` of the user info and the last `@`, so a
/// password holding unescaped `@`, `/`, `?` or `#` is still hidden.
pub(crate) fn redact_url(raw: &str) -> String {
    let (scheme, rest) = match raw.find("://") {
        Some(i) => raw.split_at(i + 3),
        None => ("", raw),
    };
    let Some(at) = rest.rfind('@') else {
        return raw.to_owned();
    };
    let user_info = &rest[..at];
    match user_info.find(':') {
        Some(colon) => format!("{scheme}{}:***{}", &user_info[..colon], &rest[at..]),
        None => raw.to_owned(),
    }
}

pub(crate) fn validate_key_prefix(prefix: &str) -> Result<(), Error> {
    if prefix.is_empty() {
        return Err(Error::Config("the key prefix must not be empty".to_owned()));
    }
    if prefix.len() > MAX_KEY_PREFIX_LEN {
        return Err(Error::Config(format!(
            "the key prefix is {} bytes long; at most {MAX_KEY_PREFIX_LEN} are allowed",
            prefix.len()
        )));
    }
    if let Some((at, c)) = prefix
        .char_indices()
        .find(|&(_, c)| c == '{' || c == '}' || c.is_whitespace() || c.is_control())
    {
        let what = match c {
            '{' | '}' => "a brace (it would change the cluster hash tag)",
            c if c.is_whitespace() => "whitespace",
            _ => "a control character",
        };
        return Err(Error::Config(format!(
            "the key prefix {prefix:?} contains {what} at byte {at}"
        )));
    }
    Ok(())
}

/// How long data sent to Redis may go unacknowledged before the kernel drops the connection
/// (Linux's `TCP_USER_TIMEOUT`): a server gone silent (its host down, its packets dropped after
/// a failover) is then an I/O error, which makes redis-rs connect again, instead of every call
/// timing out on the dead connection for the ~15 minutes of the kernel's retransmissions.
const TCP_USER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The TCP settings of every connection: no Nagle delay (redis-rs leaves it on), whose wait
/// for an acknowledgement holds back a small pipeline written while another is in flight; and
/// [`TCP_USER_TIMEOUT`] where the platform has it.
pub(crate) fn tcp_settings() -> redis::io::tcp::TcpSettings {
    let settings = redis::io::tcp::TcpSettings::default().set_nodelay(true);
    #[cfg(any(target_os = "android", target_os = "fuchsia", target_os = "linux"))]
    let settings = settings.set_user_timeout(TCP_USER_TIMEOUT);
    settings
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redaction_of_odd_urls() {
        for (raw, want) in [
            ("redis://h:1", "redis://h:1"),
            ("redis://user@h", "redis://user@h"),
            ("redis://:pw@h:1/2", "redis://:***@h:1/2"),
            ("redis://u:p@ss@h", "redis://u:***@h"),
            ("redis://u:pa/ss?x#y@h/0", "redis://u:***@h/0"),
            ("u:pw@h", "u:***@h"),
            ("redis://:@h", "redis://:***@h"),
        ] {
            assert_eq!(redact_url(raw), want, "{raw}");
        }
    }

    #[test]
    fn database_of_a_url() {
        let (node, _) = parse_node("redis://h/7").expect("valid");
        assert_eq!(db_of(&node.url), 7);
        let (node, _) = parse_node("redis://h").expect("valid");
        assert_eq!(db_of(&node.url), 0);
    }
}
