//! The one error type of this crate, and how Redis replies map onto it.

use std::fmt::Write as _;
use std::time::Duration;

use redis::{ErrorKind, RedisError, ServerErrorKind, Value};

/// The code a script raises for a stored value that makes no sense:
/// `FLOODGATE_CORRUPT <key-index> <detail>`, the index 0-based into `KEYS`.
pub const CORRUPT_CODE: &str = "FLOODGATE_CORRUPT";
/// The code a script raises for a key holding another Redis type:
/// `FLOODGATE_WRONGTYPE <key-index>`, the index 0-based into `KEYS`.
pub const WRONGTYPE_CODE: &str = "FLOODGATE_WRONGTYPE";

/// How many characters of a key or reply an error message shows.
const SHOWN_CHARS: usize = 200;

/// Everything that can go wrong talking to Redis.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The configuration is invalid (bad URL, key prefix, timeout...).
    #[error("invalid Redis configuration: {0}")]
    Config(String),

    /// No connection could be made, or an established one broke.
    #[error("cannot reach Redis at {addr}: {source}")]
    Connect {
        /// The address, with any password replaced by `***`.
        addr: String,
        /// What went wrong.
        #[source]
        source: RedisError,
    },

    /// Redis was unreachable moments ago and the circuit breaker is failing calls fast.
    #[error("Redis at {addr} is unavailable (circuit breaker open; next probe in {retry_in:?})")]
    Unavailable {
        /// The address, with any password replaced by `***`.
        addr: String,
        /// When the breaker lets a probe through.
        retry_in: Duration,
    },

    /// Redis answered but refuses to serve: out of memory under `maxmemory` with no eviction
    /// (`OOM`), unable to persist (`MISCONF`), blocked by a long script (`BUSY`), a replica
    /// that takes no writes (`READONLY`, a failover demoted the node), loading its data
    /// (`LOADING`), too few replicas (`NOREPLICAS`), a cluster or master down. The whole server
    /// is affected, not the call's keys: counts as unavailable ([`Error::is_connection`]), so
    /// the circuit breaker and a layer's failure policy take over.
    #[error("Redis at {addr} is not serving: {message}")]
    NotServing {
        /// The address, with any password replaced by `***`.
        addr: String,
        /// The error reply, without Redis' `script: <sha>, on @user_script:N.` suffix.
        message: String,
    },

    /// The operation did not finish in time.
    #[error("Redis {op} timed out after {after:?}")]
    Timeout {
        /// The timeout that expired.
        after: Duration,
        /// What was being done (`invoke_script`, `query`, `connect`...).
        op: &'static str,
    },

    /// A key holds a value of another Redis type than the one expected.
    #[error("Redis key {key} holds a value of the wrong type")]
    WrongType {
        /// The key, as [`display_key`] shows it.
        key: String,
    },

    /// A key holds a value that makes no sense to the limiter.
    #[error("Redis key {key} holds a corrupted value: {detail}")]
    Corrupted {
        /// The key, as [`display_key`] shows it.
        key: String,
        /// What is wrong with it.
        detail: String,
    },

    /// The keys of one call are in a cluster slot that is migrating between two nodes, some
    /// on each or some not yet anywhere (`TRYAGAIN`), so neither node can run the call. The
    /// servers are fine and the call did not run: a call of one key, or the same call once the
    /// migration has ended, goes through. Batched checks refused so are sent again one by one;
    /// a check of several policies of one user can still be refused until the migration ends.
    #[error("Redis Cluster slot migrating, the call's keys are on two nodes: {message}")]
    Migrating {
        /// The server's message.
        message: String,
    },

    /// The keys of one call hash to different cluster slots.
    #[error("keys in different Redis Cluster slots: {message}")]
    CrossSlot {
        /// Which keys, or the server's message.
        message: String,
    },

    /// A script answered with an error reply that is none of the above.
    #[error("Redis script failed: {message}")]
    Script {
        /// The error reply, without Redis' `script: <sha>, on @user_script:N.` suffix.
        message: String,
    },

    /// A reply did not have the expected shape.
    #[error("unexpected reply from Redis: expected {expected}, got {got}")]
    UnexpectedReply {
        /// What was expected.
        expected: &'static str,
        /// What came, shortened.
        got: String,
    },

    /// A Bloom filter's own error: invalid parameters, a filter stored with other parameters,
    /// or none at all.
    #[error(transparent)]
    Bloom(#[from] floodgate_core::BloomError),

    /// Any other Redis error.
    #[error("Redis error: {0}")]
    Redis(#[source] RedisError),
}

impl Error {
    /// The error of a reply that is not what was `expected`: `got`, shortened (at a character
    /// boundary, whatever the reply holds) for the message.
    pub fn unexpected_reply(expected: &'static str, got: &Value) -> Self {
        Self::UnexpectedReply {
            expected,
            got: describe_value(got),
        }
    }

    /// True when an operation (or connecting) ran out of time.
    pub fn is_timeout(&self) -> bool {
        match self {
            Self::Timeout { .. } => true,
            Self::Connect { source, .. } | Self::Redis(source) => source.is_timeout(),
            _ => false,
        }
    }

    /// True when Redis could not be reached or is not serving: connection
    /// refused, reset or broken, authentication failed while reconnecting,
    /// and every [`Error::NotServing`] (out of memory, cluster down, master
    /// down, loading, a read-only replica after a failover...).
    pub fn is_connection(&self) -> bool {
        match self {
            Self::Connect { .. } | Self::Unavailable { .. } | Self::NotServing { .. } => true,
            Self::Redis(e) => is_connection_error(e),
            _ => false,
        }
    }

    /// True when the call's keys were split by a cluster slot's migration (`TRYAGAIN`).
    pub fn is_migrating(&self) -> bool {
        matches!(self, Self::Migrating { .. })
    }

    /// The Bloom filter error, if it is one.
    pub fn as_bloom(&self) -> Option<&floodgate_core::BloomError> {
        match self {
            Self::Bloom(e) => Some(e),
            _ => None,
        }
    }

    /// True when a Bloom filter exists with other parameters than the handle's.
    pub fn is_mismatch(&self) -> bool {
        self.as_bloom()
            .is_some_and(floodgate_core::BloomError::is_mismatch)
    }

    /// True when a Bloom filter (or one of its parts) does not exist.
    pub fn is_not_initialized(&self) -> bool {
        self.as_bloom()
            .is_some_and(floodgate_core::BloomError::is_not_initialized)
    }

    /// True when a key holds something the limiter cannot use: another
    /// Redis type, or a value that makes no sense.
    pub fn is_corrupted(&self) -> bool {
        matches!(self, Self::WrongType { .. } | Self::Corrupted { .. })
    }

    /// Maps an error that is not about a particular call's keys: connection
    /// problems become [`Error::Connect`] naming `addr`, the rest [`Error::Redis`].
    pub(crate) fn from_redis(e: RedisError, addr: &str) -> Self {
        if is_transport_error(&e) {
            Self::Connect {
                addr: addr.to_owned(),
                source: e,
            }
        } else if e.kind() == ErrorKind::Server(ServerErrorKind::TryAgain) {
            Self::Migrating {
                message: server_message(&e),
            }
        } else if e.kind() == ErrorKind::Server(ServerErrorKind::CrossSlot) {
            Self::CrossSlot {
                message: server_message(&e),
            }
        } else if e.code().is_some_and(is_refusal) {
            Self::NotServing {
                addr: addr.to_owned(),
                message: server_message(&e),
            }
        } else {
            Self::Redis(e)
        }
    }

    /// Whether this is a primary demoted to a replica refusing writes (`READONLY`).
    pub(crate) fn is_demoted(&self) -> bool {
        matches!(self, Self::NotServing { message, .. } if message.starts_with("READONLY"))
    }

    /// Maps an error reply to a command whose first key is `key`.
    pub(crate) fn from_command(e: RedisError, key: Option<&[u8]>, addr: &str) -> Self {
        if e.code() == Some("WRONGTYPE") {
            return Self::WrongType {
                key: key.map_or_else(|| "(unknown)".to_owned(), display_key),
            };
        }
        Self::from_redis(e, addr)
    }

    /// Maps an error reply to `EVALSHA` with these keys: floodgate's own
    /// codes, `WRONGTYPE`, and any other script error.
    pub(crate) fn from_script<K: AsRef<[u8]>>(e: RedisError, keys: &[K], addr: &str) -> Self {
        let key_at = |index: Option<&str>| -> String {
            match index.and_then(|i| i.parse::<usize>().ok()) {
                Some(i) => keys.get(i).map_or_else(
                    || format!("(KEYS index {i} of {})", keys.len()),
                    |k| display_key(k.as_ref()),
                ),
                None => "(unknown)".to_owned(),
            }
        };
        match e.code() {
            Some(CORRUPT_CODE) => {
                let detail = e.detail().map(strip_script_suffix).unwrap_or_default();
                let (index, detail) = detail.split_once(' ').unwrap_or((detail, ""));
                Self::Corrupted {
                    key: key_at(Some(index)),
                    detail: detail.trim().to_owned(),
                }
            }
            Some(WRONGTYPE_CODE) => {
                let detail = e.detail().map(strip_script_suffix).unwrap_or_default();
                Self::WrongType {
                    key: key_at(detail.split_whitespace().next()),
                }
            }
            Some("WRONGTYPE") => Self::WrongType {
                key: keys
                    .first()
                    .map_or_else(|| "(no key)".to_owned(), |k| display_key(k.as_ref())),
            },
            // Still NOSCRIPT after loading it: on a cluster in the middle of a failover the
            // call and the load landed on different nodes. The topology is in flux: treat it
            // like an unreachable node, not as a script error.
            _ if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => Self::Connect {
                addr: addr.to_owned(),
                source: e,
            },
            _ if e.code().is_some_and(is_refusal) => Self::from_redis(e, addr),
            _ if is_script_error(&e) => Self::Script {
                message: server_message(&e),
            },
            _ => Self::from_redis(e, addr),
        }
    }
}

/// Errors that mean the transport is gone: I/O, no connection to a cluster
/// node, authentication failing on (re)connect, a redirect that could not be followed.
fn is_transport_error(e: &RedisError) -> bool {
    e.is_io_error()
        || matches!(
            e.kind(),
            ErrorKind::ClusterConnectionNotFound
                | ErrorKind::AuthenticationFailed
                // A redirect the cluster client gave up following: the node it points to is
                // down (a master died and no replica has taken over yet) or the topology keeps
                // changing under it.
                | ErrorKind::Server(ServerErrorKind::Moved | ServerErrorKind::Ask)
        )
}

fn is_connection_error(e: &RedisError) -> bool {
    is_transport_error(e) || e.code().is_some_and(is_refusal)
}

/// The codes of the error replies by which a server that is up refuses to serve anything for
/// now: its state, not the call's keys or arguments (see [`Error::NotServing`]).
pub(crate) fn is_refusal(code: &str) -> bool {
    refusal(code).is_some()
}

/// `code` if it is one of a refusal to serve ([`is_refusal`]), as a static string.
pub(crate) fn refusal(code: &str) -> Option<&'static str> {
    // Not `TRYAGAIN`: it is about the call's keys (see [`Error::Migrating`]).
    const CODES: [&str; 8] = [
        "OOM",
        "MISCONF",
        "BUSY",
        "READONLY",
        "LOADING",
        "NOREPLICAS",
        "MASTERDOWN",
        "CLUSTERDOWN",
    ];
    CODES.into_iter().find(|c| *c == code)
}

/// True for an error reply that the script itself produced: `ERR ...`
/// (a Lua runtime error) or any code Redis does not use for its own state.
fn is_script_error(e: &RedisError) -> bool {
    match e.kind() {
        ErrorKind::Server(ServerErrorKind::ResponseError) => true,
        // (A refusal to serve, `OOM`..., is told apart before.)
        ErrorKind::Extension => !matches!(
            e.code(),
            Some("NOAUTH" | "WRONGPASS" | "UNBLOCKED" | "NOTBUSY") | None
        ),
        _ => false,
    }
}

/// `CODE detail` of an error reply, without the script suffix.
fn server_message(e: &RedisError) -> String {
    match (e.code(), e.detail()) {
        (Some(code), Some(detail)) => format!("{code} {}", strip_script_suffix(detail)),
        (Some(code), None) => code.to_owned(),
        _ => e.to_string(),
    }
}

/// Removes the ` script: <sha1>, on @user_script:<line>.` that Redis 7
/// appends to errors raised inside scripts.
pub(crate) fn strip_script_suffix(detail: &str) -> &str {
    let Some(at) = detail.rfind(" script: ") else {
        return detail;
    };
    let rest = &detail[at + " script: ".len()..];
    let is_suffix = rest.len() > 40
        && rest.as_bytes()[..40].iter().all(u8::is_ascii_hexdigit)
        && rest[40..].starts_with(", on @")
        && rest.ends_with('.');
    if is_suffix { &detail[..at] } else { detail }
}

/// Shows a key in an error message: printable ASCII as is, a backslash as
/// `\\`, any other byte as `\xNN`; past about 200 characters it is cut and
/// `...(N bytes)` gives the full length.
///
/// ```
/// use floodgate_redis::display_key;
/// assert_eq!(display_key(b"rl:{user 7}"), "rl:{user 7}");
/// assert_eq!(display_key(b"caf\xc3\xa9\n"), "caf\\xc3\\xa9\\x0a");
/// assert!(display_key(&[b'k'; 1000]).ends_with("...(1000 bytes)"));
/// ```
pub fn display_key(key: &[u8]) -> String {
    let mut out = String::with_capacity(key.len().min(SHOWN_CHARS) + 16);
    for &b in key {
        if out.len() >= SHOWN_CHARS {
            let _ = write!(out, "...({} bytes)", key.len());
            return out;
        }
        match b {
            b'\\' => out.push_str("\\\\"),
            0x20..=0x7e => out.push(char::from(b)),
            _ => {
                let _ = write!(out, "\\x{b:02x}");
            }
        }
    }
    out
}

/// A reply, shortened for an error message.
pub(crate) fn describe_value(value: &Value) -> String {
    let mut text = format!("{value:?}");
    if text.len() > SHOWN_CHARS {
        let mut cut = SHOWN_CHARS;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        let total = text.len();
        text.truncate(cut);
        let _ = write!(text, "...({total} bytes)");
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn script_suffix_is_stripped_only_when_it_is_one() {
        let sha = "0c32c0db2cf4b01b7c4f30e7a8811fc594d3b186";
        let d = format!("0 tat is \"x\" script: {sha}, on @user_script:1.");
        assert_eq!(strip_script_suffix(&d), "0 tat is \"x\"");
        assert_eq!(strip_script_suffix("0 my script: ok"), "0 my script: ok");
        assert_eq!(strip_script_suffix(""), "");
    }

    #[test]
    fn display_key_escapes_and_truncates() {
        assert_eq!(display_key(b""), "");
        assert_eq!(display_key(b"a\\b"), "a\\\\b");
        assert_eq!(display_key(&[0, 0x7f, 0xff]), "\\x00\\x7f\\xff");
        let long = display_key(&[0xffu8; 500]);
        assert!(long.ends_with("...(500 bytes)"), "{long}");
        assert!(long.len() < 230, "{}", long.len());
        // Exactly at the limit: nothing is cut.
        assert_eq!(display_key(&[b'k'; SHOWN_CHARS]).len(), SHOWN_CHARS);
    }
}
