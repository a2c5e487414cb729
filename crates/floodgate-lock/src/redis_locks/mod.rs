//! Locks on one Redis (a single node or a cluster).
//!
//! Key layout, for lock name `n` (its cluster hash tag `t` is `n` itself, or `~` and its
//! SHA-256 when `n` is long, holds braces or starts with `~`, see
//! [`floodgate_redis::keys::key_tag`]):
//!
//! | what | name | value | expiry |
//! |---|---|---|---|
//! | the lock | `<prefix>:lock:{t}` | the holder's random token | the lease |
//! | fencing counter | `<prefix>:lock:{t}:fence` | the last fencing token issued | 7 days (or 2 x the lease), refreshed on each acquisition |
//! | release channel | `<prefix>:lock:{t}:released` | pub/sub channel, not a key | - |
//!
//! Both keys share a hash slot, so each script runs on one cluster node.

mod notifier;

use std::fmt;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use floodgate_core::lock::{Released, WaitQueues};
use floodgate_core::{LockAttempt, LockStore};
use floodgate_redis::keys::key_tag;
use floodgate_redis::{RedisConfig, RedisConn};
use redis::{Script, Value};

use crate::Error;
use notifier::Notifier;

/// The scripts that read the fencing counter, after the check they share.
macro_rules! with_fence {
    ($script:literal) => {
        concat!(include_str!("fence.lua"), include_str!($script))
    };
}

static ACQUIRE: LazyLock<Script> = LazyLock::new(|| Script::new(with_fence!("acquire.lua")));
static RELEASE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("release.lua")));
static EXTEND: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("extend.lua")));
static REMAINING: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("remaining.lua")));
pub(crate) static RAISE_FENCE: LazyLock<Script> =
    LazyLock::new(|| Script::new(with_fence!("raise_fence.lua")));

/// The shortest life of a fencing counter. With the server-time floor, fencing tokens keep
/// increasing after the counter expires; the counter only covers the server clock stepping back
/// (by less than this) and makes the sequence dense between close acquisitions.
const FENCE_KEY_TTL: Duration = Duration::from_secs(7 * 24 * 3600);

/// Locks in Redis: `SET NX PX` with a random owner token, release and renewal by Lua scripts
/// that act only for that token, a fencing counter next to each lock, and release notifications
/// over pub/sub. Works on a single node and on Redis Cluster. Cheap to clone; clones share the
/// connection and the subscriber.
///
/// ```no_run
/// use std::time::Duration;
/// use floodgate_lock::{Lock, RedisLocks};
///
/// # async fn run() -> Result<(), floodgate_lock::Error> {
/// let locks = RedisLocks::connect("redis://127.0.0.1:6379").await?;
/// let lock = Lock::new(locks, "dispatch:campaign-7", Duration::from_secs(10))?.watchdog(true);
/// let guard = lock.acquire(Duration::from_secs(5)).await?;
/// // ... send the campaign, passing guard.fence() with every write ...
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisLocks {
    inner: Arc<Inner>,
}

struct Inner {
    conn: RedisConn,
    notifier: Option<Notifier>,
    queues: WaitQueues,
}

impl RedisLocks {
    /// Connects to `url` (a single node, or a cluster seed with `?cluster=true`) with default
    /// settings, and subscribes to release notifications on the same server.
    ///
    /// # Errors
    /// [`Error::Redis`] for a bad URL or an unreachable server.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        let config = RedisConfig::new(url)?;
        let conn = RedisConn::connect(&config).await?;
        Ok(Self::builder(conn).notifications([url])?.build())
    }

    /// [`RedisLocks::connect`] without reaching the server now: the connection is made in a
    /// task of its own, within its connect timeout, on first use (see
    /// `RedisConn::connect_lazy`), whatever the deadline of the call that needs it.
    ///
    /// # Errors
    /// [`Error::Redis`] or [`Error::Invalid`] for a bad URL.
    pub fn connect_lazy(url: &str) -> Result<Self, Error> {
        let config = RedisConfig::new(url)?;
        let conn = RedisConn::connect_lazy(&config)?;
        Ok(Self::builder(conn).notifications([url])?.build())
    }

    /// Locks on an existing connection (its key prefix, timeout and kind). Without
    /// [`notifications`](RedisLocksBuilder::notifications), waiters only retry on their backoff.
    pub fn builder(conn: RedisConn) -> RedisLocksBuilder {
        RedisLocksBuilder {
            conn,
            clients: Vec::new(),
        }
    }

    /// The connection.
    pub fn conn(&self) -> &RedisConn {
        &self.inner.conn
    }

    /// True when waiters are woken by release notifications.
    pub fn has_notifications(&self) -> bool {
        self.inner.notifier.is_some()
    }

    /// The Redis key of lock `name`.
    pub fn lock_key(&self, name: &[u8]) -> Vec<u8> {
        lock_key(self.inner.conn.key_prefix(), name)
    }

    /// The Redis key of lock `name`'s fencing counter.
    pub fn fence_key(&self, name: &[u8]) -> Vec<u8> {
        with_suffix(self.lock_key(name), b":fence")
    }

    /// The pub/sub channel on which releases of lock `name` are announced.
    pub fn release_channel(&self, name: &[u8]) -> Vec<u8> {
        with_suffix(self.lock_key(name), b":released")
    }

    async fn call(&self, script: &Script, keys: &[&[u8]], args: &[&[u8]]) -> Result<Value, Error> {
        Ok(self.inner.conn.invoke_script(script, keys, args).await?)
    }

    /// Redlock's second step: raises this node's fencing counter to `fence` if `token` still
    /// holds `name`.
    pub(crate) async fn raise_fence(
        &self,
        name: &[u8],
        token: &[u8],
        fence: u64,
        ttl: Duration,
    ) -> Result<bool, Error> {
        let lock = self.lock_key(name);
        let counter = self.fence_key(name);
        let reply = self
            .call(
                &RAISE_FENCE,
                &[&lock, &counter],
                &[
                    token,
                    fence.to_string().as_bytes(),
                    millis(fence_ttl(ttl)).as_bytes(),
                ],
            )
            .await?;
        Ok(int(&reply, "1 or 0")? == 1)
    }
}

impl fmt::Debug for RedisLocks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLocks")
            .field("conn", &self.inner.conn)
            .field("notifications", &self.inner.notifier)
            .finish()
    }
}

/// Options of [`RedisLocks`].
#[derive(Debug)]
pub struct RedisLocksBuilder {
    conn: RedisConn,
    clients: Vec<redis::Client>,
}

impl RedisLocksBuilder {
    /// Subscribes to release notifications at these URLs: the same server as the connection
    /// (on a cluster, any nodes of it: a `PUBLISH` reaches every node; give several, the
    /// subscriber moves to the next when one fails). A `?cluster=...` query is ignored.
    ///
    /// With ACLs, the user needs rights on the channels `<prefix>:lock:*:released`
    /// (`&floodgate:lock:*` with the default prefix; Redis 7 gives a new user none). Without
    /// them releases still release (the script's announcement is refused, not the release),
    /// but waiters find them by backoff only.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a URL redis-rs does not accept (shown without its password).
    pub fn notifications<I, U>(mut self, urls: I) -> Result<Self, Error>
    where
        I: IntoIterator<Item = U>,
        U: AsRef<str>,
    {
        for url in urls {
            let url = url.as_ref();
            let plain = url.split_once('?').map_or(url, |(base, _)| base);
            let client = redis::Client::open(plain).map_err(|e| {
                let shown = RedisConfig::new(url)
                    .map_or_else(|_| "(unparsable URL)".to_owned(), |c| c.redacted_url());
                Error::Invalid(format!("bad notification URL {shown}: {e}"))
            })?;
            self.clients.push(client);
        }
        Ok(self)
    }

    /// Subscribes with this redis-rs client (e.g. one built with custom TLS settings).
    #[must_use]
    pub fn notification_client(mut self, client: redis::Client) -> Self {
        self.clients.push(client);
        self
    }

    /// The lock client.
    pub fn build(self) -> RedisLocks {
        let notifier = (!self.clients.is_empty()).then(|| Notifier::new(self.clients));
        RedisLocks {
            inner: Arc::new(Inner {
                conn: self.conn,
                notifier,
                queues: WaitQueues::new(),
            }),
        }
    }
}

impl LockStore for RedisLocks {
    type Error = Error;

    async fn try_lock(
        &self,
        name: &[u8],
        token: &[u8],
        ttl: Duration,
    ) -> Result<LockAttempt, Error> {
        let lock = self.lock_key(name);
        let counter = self.fence_key(name);
        let reply = self
            .call(
                &ACQUIRE,
                &[&lock, &counter],
                &[
                    token,
                    millis(ttl).as_bytes(),
                    millis(fence_ttl(ttl)).as_bytes(),
                ],
            )
            .await?;
        let expected = "[1, fence] or [0, remaining ms]";
        let Value::Array(parts) = &reply else {
            return Err(unexpected(expected, &reply));
        };
        match parts.as_slice() {
            [Value::Int(1), Value::Int(fence)] => Ok(LockAttempt::Acquired {
                fence: u64::try_from(*fence).map_err(|_| unexpected(expected, &reply))?,
            }),
            [Value::Int(0), Value::Int(pttl)] => Ok(LockAttempt::Held {
                // -1: a key without expiry (not written by us); wait on the backoff.
                remaining: u64::try_from(*pttl).map_or(Duration::MAX, Duration::from_millis),
            }),
            _ => Err(unexpected(expected, &reply)),
        }
    }

    async fn unlock(&self, name: &[u8], token: &[u8]) -> Result<bool, Error> {
        let lock = self.lock_key(name);
        let channel = self.release_channel(name);
        let reply = self.call(&RELEASE, &[&lock], &[token, &channel]).await?;
        Ok(int(&reply, "1 or 0")? == 1)
    }

    async fn extend(&self, name: &[u8], token: &[u8], ttl: Duration) -> Result<bool, Error> {
        let lock = self.lock_key(name);
        let reply = self
            .call(&EXTEND, &[&lock], &[token, millis(ttl).as_bytes()])
            .await?;
        Ok(int(&reply, "1 or 0")? == 1)
    }

    async fn remaining(&self, name: &[u8], token: &[u8]) -> Result<Option<Duration>, Error> {
        let lock = self.lock_key(name);
        let reply = self.call(&REMAINING, &[&lock], &[token]).await?;
        let ms = int(&reply, "remaining ms")?;
        Ok(u64::try_from(ms).ok().map(Duration::from_millis))
    }

    fn released(&self, name: &[u8]) -> Released {
        match &self.inner.notifier {
            Some(notifier) => notifier.released(self.release_channel(name)),
            None => Box::pin(std::future::pending()),
        }
    }

    /// Redis expires the key on its own clock, whose rate may differ from the holder's: the
    /// holder trusts its lease for `ttl / 100 + 2 ms` less, as Redlock does per node.
    fn clock_drift(&self, ttl: Duration) -> Duration {
        crate::redlock::clock_drift(ttl)
    }

    fn wait_queues(&self) -> Option<&WaitQueues> {
        Some(&self.inner.queues)
    }
}

fn lock_key(prefix: &str, name: &[u8]) -> Vec<u8> {
    let tag = key_tag(name);
    let mut key = Vec::with_capacity(prefix.len() + tag.len() + 8);
    key.extend_from_slice(prefix.as_bytes());
    key.extend_from_slice(b":lock:{");
    key.extend_from_slice(&tag);
    key.push(b'}');
    key
}

fn with_suffix(mut key: Vec<u8>, suffix: &[u8]) -> Vec<u8> {
    key.extend_from_slice(suffix);
    key
}

/// Whole milliseconds, rounded up (Redis leases are in ms; never shorter than asked).
fn millis(d: Duration) -> String {
    d.as_nanos().div_ceil(1_000_000).to_string()
}

fn fence_ttl(ttl: Duration) -> Duration {
    FENCE_KEY_TTL.max(ttl.saturating_mul(2))
}

fn int(reply: &Value, expected: &'static str) -> Result<i64, Error> {
    match reply {
        Value::Int(i) => Ok(*i),
        other => Err(unexpected(expected, other)),
    }
}

fn unexpected(expected: &'static str, got: &Value) -> Error {
    Error::Redis(floodgate_redis::Error::unexpected_reply(expected, got))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_unexpected_reply_of_any_characters_is_an_error_not_a_panic() {
        // Shortened for the message: at a character boundary, even when the cut falls inside
        // a character of two bytes.
        for pad in 0..4 {
            let text = format!("{}{}", "x".repeat(pad), "é".repeat(300));
            let reply = Value::Array(vec![Value::Int(1), Value::BulkString(text.into_bytes())]);
            let err = int(&reply, "an integer").expect_err("not an integer");
            let shown = err.to_string();
            assert!(shown.contains("expected an integer"), "{shown}");
            assert!(shown.len() < 400, "{} bytes: {shown}", shown.len());
        }
    }

    #[test]
    fn keys_share_a_slot_and_hide_braces() {
        let key = lock_key("fg", b"campaign-7");
        assert_eq!(key, b"fg:lock:{campaign-7}");
        let fence = with_suffix(key.clone(), b":fence");
        assert_eq!(
            floodgate_redis::keys::key_slot(&key),
            floodgate_redis::keys::key_slot(&fence)
        );
        let hostile = lock_key("fg", b"a}b{c");
        assert!(hostile.starts_with(b"fg:lock:{~"), "{hostile:?}");
        assert_eq!(millis(Duration::from_micros(1_500)), "2");
        assert_eq!(millis(Duration::from_secs(3)), "3000");
    }
}
