//! [`RedisLimiter`]: every floodgate algorithm as one atomic Lua script per check.

use std::fmt;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use floodgate_core::algorithm::fixed_window::Window;
use floodgate_core::{Check, CheckOptions, Decision, Kind, LeaseId, Limiter, Policy, Verdict};
use redis::{Script, Value};
use smallvec::SmallVec;

use crate::keys::{key_slot, state_key};
use crate::{ConnectionKind, Error, RedisConfig, RedisConn};

/// The check script: the prelude, every algorithm, then the all-or-nothing driver.
pub(crate) const CHECK_SRC: &str = concat!(
    include_str!("lua/prelude.lua"),
    include_str!("lua/gcra.lua"),
    include_str!("lua/shaper.lua"),
    include_str!("lua/leaky_bucket.lua"),
    include_str!("lua/token_bucket.lua"),
    include_str!("lua/fixed_window.lua"),
    include_str!("lua/sliding_window.lua"),
    include_str!("lua/sliding_log.lua"),
    include_str!("lua/concurrency.lua"),
    include_str!("lua/check.lua"),
);

const RELEASE_SRC: &str = concat!(
    include_str!("lua/prelude.lua"),
    include_str!("lua/release.lua")
);

pub(crate) static CHECK: LazyLock<Script> = LazyLock::new(|| Script::new(CHECK_SRC));
static RELEASE: LazyLock<Script> = LazyLock::new(|| Script::new(RELEASE_SRC));

/// Fields of one decision in the script's reply.
const FIELDS: usize = 6;

/// A rate limiter whose state lives in Redis: every replica that shares the server (or
/// cluster) and the key prefix shares the limits.
///
/// Each check is one `EVALSHA` of one script that reads, decides and writes atomically, with the
/// time taken from the Redis server (`TIME`), so replicas with skewed clocks agree. Every key
/// it writes gets a TTL no longer than the time after which its state no longer matters.
///
/// On Redis Cluster, a check's keys must share a slot: all policies of one user key do (the
/// user key is the hash tag). A check across user keys in different slots returns
/// [`Error::CrossSlot`].
#[derive(Clone)]
pub struct RedisLimiter {
    conn: RedisConn,
    prefix: Arc<str>,
}

impl fmt::Debug for RedisLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLimiter")
            .field("conn", &self.conn)
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl RedisLimiter {
    /// Connects with `config`.
    pub async fn connect(config: &RedisConfig) -> Result<Self, Error> {
        let conn = RedisConn::connect(config).await?;
        Ok(RedisLimiter::new(conn, config.get_key_prefix()))
    }

    /// A limiter over an existing connection, with its keys under `prefix`.
    pub fn new(conn: RedisConn, prefix: &str) -> Self {
        RedisLimiter {
            conn,
            prefix: prefix.into(),
        }
    }

    /// The connection.
    pub fn conn(&self) -> &RedisConn {
        &self.conn
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The Redis key holding `policy`'s state for `key`.
    pub fn state_key(&self, policy: &Policy, key: &[u8]) -> Vec<u8> {
        state_key(&self.prefix, policy, key)
    }

    /// Releases concurrency lease `lease` of `checks` (see [`Limiter::release`]), with the time
    /// taken from the server or, for tests and simulations, given. Returns how many policies
    /// still held the lease.
    pub async fn release_at(
        &self,
        checks: &[Check<'_>],
        lease: LeaseId,
        now: Option<floodgate_core::Timestamp>,
    ) -> Result<u64, Error> {
        let lease = lease.0.to_string();
        let now = now.map_or(String::new(), |t| t.as_micros().to_string());
        let mut released = 0;
        // One call per key: they may live in different slots.
        for c in checks {
            if !matches!(c.policy.kind(), Kind::Concurrency(_)) {
                continue;
            }
            let key = self.state_key(c.policy, c.key);
            let reply = self
                .conn
                .invoke_script(&RELEASE, &[&key], &[lease.as_bytes(), now.as_bytes()])
                .await?;
            match reply {
                Value::Int(n) => released += u64::try_from(n).unwrap_or(0),
                other => {
                    return Err(Error::UnexpectedReply {
                        expected: "a count from the release script",
                        got: format!("{other:?}").chars().take(200).collect(),
                    });
                }
            }
        }
        Ok(released)
    }

    async fn run_check(&self, checks: &[Check<'_>], opts: CheckOptions) -> Result<Verdict, Error> {
        if checks.is_empty() {
            return Err(Error::Config("a check needs at least one policy".into()));
        }
        for (i, a) in checks.iter().enumerate() {
            if checks[..i]
                .iter()
                .any(|b| b.policy.ident() == a.policy.ident() && b.key == a.key)
            {
                return Err(Error::Config(format!(
                    "policy {} is checked twice for the same key",
                    a.policy.name()
                )));
            }
        }
        let keys: SmallVec<[Vec<u8>; 4]> = checks
            .iter()
            .map(|c| self.state_key(c.policy, c.key))
            .collect();
        if self.conn.kind() == ConnectionKind::Cluster {
            let slot = key_slot(&keys[0]);
            if let Some(other) = keys.iter().find(|k| key_slot(k) != slot) {
                return Err(Error::CrossSlot {
                    message: format!(
                        "{} and {} are in different cluster slots",
                        crate::display_key(&keys[0]),
                        crate::display_key(other)
                    ),
                });
            }
        }
        let lease = checks
            .iter()
            .any(|c| matches!(c.policy.kind(), Kind::Concurrency(_)))
            .then(|| fastrand::u64(1..));
        let args = encode_args(checks, &opts, lease);
        let key_refs: SmallVec<[&[u8]; 4]> = keys.iter().map(Vec::as_slice).collect();
        let arg_refs: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
        let reply = self
            .conn
            .invoke_script(&CHECK, &key_refs, &arg_refs)
            .await?;
        let verdict = decode_reply(&reply, checks.len())?;
        Ok(Verdict {
            lease: lease.filter(|_| verdict.allowed()).map(LeaseId),
            ..verdict
        })
    }
}

/// The script's arguments: now, max wait, lease, count, then six per check.
fn encode_args(checks: &[Check<'_>], opts: &CheckOptions, lease: Option<u64>) -> Vec<String> {
    let mut args = Vec::with_capacity(4 + FIELDS * checks.len());
    args.push(
        opts.now
            .map_or(String::new(), |t| t.as_micros().to_string()),
    );
    args.push(
        u64::try_from(opts.max_wait.as_micros())
            .unwrap_or(u64::MAX)
            .to_string(),
    );
    args.push(lease.unwrap_or(0).to_string());
    args.push(checks.len().to_string());
    for c in checks {
        let (tag, p) = params(c.policy.kind());
        args.push(tag.to_owned());
        args.push(c.cost.to_string());
        args.extend(p.iter().map(i64::to_string));
    }
    args
}

/// The algorithm's tag and its four parameters, as the scripts expect them.
pub(crate) fn params(kind: &Kind) -> (&'static str, [i64; 4]) {
    let i = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    let tag = kind.algorithm().tag();
    let p = match kind {
        Kind::Gcra(g) => [i(g.emission_us()), i(g.tolerance_us()), i(g.limit()), 0],
        Kind::Shaper(s) => [
            i(s.interval_us()),
            i(s.burst()),
            i(s.interval_us() * s.burst()),
            0,
        ],
        Kind::LeakyBucket(f) => [
            i(f.unit_us()),
            i(f.unit_us() * f.capacity()),
            i(f.capacity()),
            0,
        ],
        Kind::TokenBucket(t) => [i(t.capacity()), i(t.per_step()), i(t.step_us()), 0],
        Kind::FixedWindow(fw) => match fw.window() {
            Window::Rolling(len) => [i(fw.limit()), 0, i(len), 0],
            Window::Calendar(c) => [
                i(fw.limit()),
                i64::from(c.unit().code()),
                i64::from(c.n()),
                i64::from(c.utc_offset_secs()) * 1_000_000,
            ],
        },
        Kind::SlidingLog(l) => [i(l.limit()), i(l.window_us()), 0, 0],
        Kind::SlidingWindow(s) => [i(s.limit()), i(s.window_us() / 1_000), 0, 0],
        Kind::Concurrency(c) => [i(c.limit()), i(c.lease_ttl_us()), 0, 0],
        // `Kind` is non-exhaustive for users, not for this workspace.
        #[allow(unreachable_patterns)]
        _ => [0, 0, 0, 0],
    };
    (tag, p)
}

fn decode_reply(reply: &Value, n: usize) -> Result<Verdict, Error> {
    let unexpected = || Error::UnexpectedReply {
        expected: "an array of integers from the check script",
        got: format!("{reply:?}").chars().take(200).collect(),
    };
    let Value::Array(items) = reply else {
        return Err(unexpected());
    };
    if items.len() != n * FIELDS + 1 {
        return Err(unexpected());
    }
    let ints: SmallVec<[i64; 32]> = items
        .iter()
        .map(|v| match v {
            Value::Int(i) => Ok(*i),
            _ => Err(unexpected()),
        })
        .collect::<Result<_, _>>()?;
    let u = |v: i64| u64::try_from(v).map_err(|_| unexpected());
    let mut decisions = SmallVec::new();
    let mut wait = 0;
    for f in ints[..n * FIELDS].chunks_exact(FIELDS) {
        let retry = if f[3] < 0 { None } else { Some(u(f[3])?) };
        decisions.push(Decision::from_micros(
            f[0] == 1,
            u(f[1])?,
            u(f[2])?,
            retry,
            u(f[4])?,
        ));
        wait = wait.max(u(f[5])?);
    }
    Ok(Verdict {
        decisions,
        wait: Duration::from_micros(wait),
        lease: None,
    })
}

impl Limiter for RedisLimiter {
    type Error = Error;

    async fn check(&self, checks: &[Check<'_>], opts: CheckOptions) -> Result<Verdict, Error> {
        self.run_check(checks, opts).await
    }

    async fn release(&self, checks: &[Check<'_>], lease: LeaseId) -> Result<(), Error> {
        self.release_at(checks, lease, None).await.map(|_| ())
    }

    async fn reset(&self, key: &[u8], policy: &Policy) -> Result<(), Error> {
        let mut cmd = redis::cmd("DEL");
        cmd.arg(self.state_key(policy, key));
        self.conn.query::<i64>(cmd).await.map(|_| ())
    }
}
