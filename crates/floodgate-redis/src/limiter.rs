//! [`RedisLimiter`]: every floodgate algorithm as one atomic Lua script, with automatic batching.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, LazyLock, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use floodgate_core::algorithm::fixed_window::Window;
use floodgate_core::algorithm::gcra::Gcra;
use floodgate_core::{
    Check, CheckOptions, Decision, Kind, LeaseId, Limiter, Policy, Timestamp, Verdict,
};
use redis::Script;
use smallvec::{SmallVec, smallvec};
use tokio::sync::{mpsc, oneshot};

use crate::batch::{self, BatchConfig, Checked, Job};
use crate::config::validate_key_prefix;
use crate::gcra_batch::{GCRA_BATCH, GcraBatch};
use crate::keys::{key_slot, state_key};
use crate::{ConnectionKind, Error, RedisConfig, RedisConn};

/// A script with every algorithm defined before `$main`: the errors, the numbers and the
/// prelude, then one file per algorithm, then the script's own body.
macro_rules! with_algorithms {
    ($main:literal) => {
        concat!(
            include_str!("lua/errors.lua"),
            include_str!("lua/numbers.lua"),
            include_str!("lua/prelude.lua"),
            include_str!("lua/gcra.lua"),
            include_str!("lua/shaper.lua"),
            include_str!("lua/leaky_bucket.lua"),
            include_str!("lua/token_bucket.lua"),
            include_str!("lua/fixed_window.lua"),
            include_str!("lua/sliding_window.lua"),
            include_str!("lua/sliding_log.lua"),
            include_str!("lua/concurrency.lua"),
            include_str!($main),
        )
    };
}

/// The check script: the shared helpers, every algorithm, then the batch driver.
pub(crate) const CHECK_SRC: &str = with_algorithms!("lua/check.lua");

/// The check script with only the named algorithm files: a script defines its algorithms on
/// every call, and a batch of one algorithm (the usual case) need not pay for the others.
macro_rules! check_with {
    ($($alg:literal),+) => {
        concat!(
            include_str!("lua/errors.lua"),
            include_str!("lua/numbers.lua"),
            include_str!("lua/prelude.lua"),
            $(include_str!($alg),)+
            include_str!("lua/check.lua"),
        )
    };
}

/// One check script per algorithm, by tag (the shaper keeps its state as GCRA does).
static ALGORITHM_CHECKS: LazyLock<[(&str, Script); 8]> = LazyLock::new(|| {
    [
        ("gcra", check_with!("lua/gcra.lua")),
        ("shp", check_with!("lua/gcra.lua", "lua/shaper.lua")),
        ("lb", check_with!("lua/leaky_bucket.lua")),
        ("tb", check_with!("lua/token_bucket.lua")),
        ("fw", check_with!("lua/fixed_window.lua")),
        ("sw", check_with!("lua/sliding_window.lua")),
        ("log", check_with!("lua/sliding_log.lua")),
        ("conc", check_with!("lua/concurrency.lua")),
    ]
    .map(|(tag, src)| (tag, Script::new(src)))
});

/// The script for `groups`: the one of their algorithm when they share one, else
/// [`CHECK_SCRIPT`]. Both decide alike; the smaller one is cheaper per call.
pub(crate) fn check_script_for(groups: &[&Group]) -> &'static Script {
    let mut tags = groups.iter().flat_map(|g| g.policies.iter().map(|p| p.0));
    let Some(first) = tags.next() else {
        return &CHECK_SCRIPT;
    };
    if tags.any(|t| t != first) {
        return &CHECK_SCRIPT;
    }
    ALGORITHM_CHECKS
        .iter()
        .find(|(tag, _)| *tag == first)
        .map_or(&CHECK_SCRIPT, |(_, script)| script)
}

const UNDO_SRC: &str = with_algorithms!("lua/undo.lua");

const RELEASE_SRC: &str = concat!(
    include_str!("lua/errors.lua"),
    include_str!("lua/numbers.lua"),
    include_str!("lua/prelude.lua"),
    include_str!("lua/release.lua")
);

/// The check script, as sent with `EVALSHA`.
pub static CHECK_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(CHECK_SRC));
pub(crate) static RELEASE: LazyLock<Script> = LazyLock::new(|| Script::new(RELEASE_SRC));
static UNDO: LazyLock<Script> = LazyLock::new(|| Script::new(UNDO_SRC));
static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        include_str!("lua/errors.lua"),
        include_str!("lua/numbers.lua"),
        include_str!("lua/prelude.lua"),
        include_str!("lua/renew.lua")
    ))
});

/// One call of the check script: which script, its keys and arguments.
#[derive(Clone, Debug)]
pub struct ScriptArgs {
    /// The script: [`CHECK_SCRIPT`], the smaller one of the check's algorithm, or for a plain
    /// GCRA check the GCRA batch script.
    pub script: &'static Script,
    /// `KEYS`.
    pub keys: Vec<Vec<u8>>,
    /// `ARGV`.
    pub args: Vec<Vec<u8>>,
}

/// Equal when they call the same script (by its SHA1) with the same keys and arguments.
impl PartialEq for ScriptArgs {
    fn eq(&self, other: &Self) -> bool {
        self.script.get_hash() == other.script.get_hash()
            && self.keys == other.keys
            && self.args == other.args
    }
}

impl Eq for ScriptArgs {}

/// Fields of one decision in the script's reply.
const FIELDS: usize = 6;

/// A rate limiter whose state lives in Redis: every replica that shares the server (or
/// cluster) and the key prefix shares the limits.
///
/// Each check reads, decides and writes atomically in one Lua script, with the time taken from
/// the Redis server (`TIME`), so replicas with skewed clocks agree. Every key it writes gets a
/// TTL no longer than the time after which its state no longer matters.
///
/// **Batching.** Checks issued concurrently by many tasks are grouped into one script call
/// (each check still all-or-nothing on its own), and several such calls are kept in flight on
/// the connection. A check waits at most [`BatchConfig::window`] for company, and only while
/// another batch is already in flight: an idle limiter sends at once. See [`BatchConfig`].
/// A batch made only of plain GCRA checks (one policy, cost 1, no wait: what a service checks
/// per request) runs a smaller script that reads its keys with one `MGET`, writes each
/// changed key once and replies with the state each key held; the client replays the
/// decisions with floodgate-core's GCRA, which decides exactly as the script does. It takes
/// about two thirds of the general script's server time per check.
///
/// On Redis Cluster, all policies of one user key share a slot (the user key is the hash tag)
/// and are checked in one call; batches are formed per slot. A check across user keys in
/// different slots (per client IP and global, say) is checked slot by slot: when a later slot
/// denies or fails, or the check is dropped before it ends, what the earlier slots counted is
/// given back.
#[derive(Clone)]
pub struct RedisLimiter {
    inner: Arc<Inner>,
}

struct Inner {
    conn: RedisConn,
    prefix: Arc<str>,
    batch: BatchConfig,
    /// The batcher's queue, and the runtime its task runs on.
    jobs: OnceLock<(mpsc::Sender<Job>, tokio::runtime::Id)>,
}

impl fmt::Debug for RedisLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLimiter")
            .field("conn", &self.inner.conn)
            .field("prefix", &self.inner.prefix)
            .field("batch", &self.inner.batch)
            .finish()
    }
}

/// One check ready for the script: its keys and, per check, policy and cost.
pub(crate) struct Group {
    pub(crate) keys: SmallVec<[Vec<u8>; 2]>,
    pub(crate) policies: SmallVec<[(&'static str, [i64; 4]); 2]>,
    pub(crate) costs: SmallVec<[u64; 2]>,
    pub(crate) max_wait: u64,
    pub(crate) lease: u64,
    pub(crate) now: Option<Timestamp>,
    /// Decide without counting anything.
    pub(crate) dry_run: bool,
    /// The policy, when the group is one check of a GCRA policy.
    pub(crate) gcra: Option<Gcra>,
}

impl Group {
    /// The slot of the group's keys (they share one).
    pub(crate) fn slot(&self) -> u16 {
        key_slot(&self.keys[0])
    }

    /// One check of cost 1, no wait, no lease, counted: the script's one-argument form.
    pub(crate) fn is_plain(&self) -> bool {
        self.keys.len() == 1
            && self.costs.first() == Some(&1)
            && self.max_wait == 0
            && self.lease == 0
            && !self.dry_run
    }

    /// The GCRA policy of a plain check of one (see [`crate::gcra_batch`]).
    pub(crate) fn plain_gcra(&self) -> Option<Gcra> {
        self.gcra.filter(|_| self.is_plain())
    }
}

impl RedisLimiter {
    /// Connects with `config`, batching with the default settings.
    pub async fn connect(config: &RedisConfig) -> Result<Self, Error> {
        let conn = RedisConn::connect(config).await?;
        RedisLimiter::new(conn, config.get_key_prefix())
    }

    /// [`RedisLimiter::connect`] without waiting for Redis: the connection is made on first use
    /// ([`RedisConn::connect_lazy`]), so a service can start while Redis is down. Until Redis
    /// can be reached, checks fail as unavailable ([`Error::Connect`], [`Error::Timeout`] while
    /// an attempt is under way, or [`Error::Unavailable`] while the circuit breaker is open): a
    /// layer's failure policy decides them. A configuration error is returned at once.
    pub fn connect_lazy(config: &RedisConfig) -> Result<Self, Error> {
        let conn = RedisConn::connect_lazy(config)?;
        RedisLimiter::new(conn, config.get_key_prefix())
    }

    /// A limiter over an existing connection, with its keys under `prefix`.
    ///
    /// The prefix is checked as [`RedisConfig::key_prefix`] checks it: an empty or overlong
    /// prefix, or one with a brace (it would change every key's cluster hash tag), whitespace or
    /// a control character, is a [`Error::Config`].
    pub fn new(conn: RedisConn, prefix: &str) -> Result<Self, Error> {
        RedisLimiter::with_batching(conn, prefix, BatchConfig::default())
    }

    /// A limiter with explicit batching settings (`BatchConfig::disabled()` sends every check
    /// on its own). The prefix is checked as by [`RedisLimiter::new`].
    pub fn with_batching(conn: RedisConn, prefix: &str, batch: BatchConfig) -> Result<Self, Error> {
        validate_key_prefix(prefix)?;
        batch.validate(conn.timeout())?;
        Ok(RedisLimiter {
            inner: Arc::new(Inner {
                conn,
                prefix: prefix.into(),
                batch,
                jobs: OnceLock::new(),
            }),
        })
    }

    /// The connection.
    pub fn conn(&self) -> &RedisConn {
        &self.inner.conn
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// The batching settings.
    pub fn batching(&self) -> &BatchConfig {
        &self.inner.batch
    }

    /// The Redis key holding `policy`'s state for `key`.
    pub fn state_key(&self, policy: &Policy, key: &[u8]) -> Vec<u8> {
        state_key(&self.inner.prefix, policy, key)
    }

    /// The script, keys and arguments of the check script call for one check, as `EVALSHA` sends them (for
    /// benchmarks that compare against raw `EVALSHA`).
    pub fn script_call(
        &self,
        checks: &[Check<'_>],
        opts: CheckOptions,
    ) -> Result<ScriptArgs, Error> {
        let group = self.encode(checks, opts)?;
        if let Some(batch) = GcraBatch::of(&[&group]) {
            return Ok(ScriptArgs {
                script: &GCRA_BATCH,
                keys: batch.keys().iter().map(|k| k.to_vec()).collect(),
                args: batch.args().iter().map(<[u8]>::to_vec).collect(),
            });
        }
        let args = batch::encode_args(&[&group]);
        Ok(ScriptArgs {
            script: check_script_for(&[&group]),
            keys: group.keys.into_vec(),
            args,
        })
    }

    /// Releases concurrency lease `lease` of `checks` (see [`Limiter::release`]), with the time
    /// taken from the server or, for tests and simulations, given. Returns how many policies
    /// still held the lease.
    pub async fn release_at(
        &self,
        checks: &[Check<'_>],
        lease: LeaseId,
        now: Option<Timestamp>,
    ) -> Result<u64, Error> {
        let keys: SmallVec<[Vec<u8>; 2]> = checks
            .iter()
            .filter(|c| matches!(c.policy.kind(), Kind::Concurrency(_)))
            .map(|c| self.state_key(c.policy, c.key))
            .collect();
        batch::release_keys(&self.inner.conn, &keys, lease.0, now).await
    }

    /// Validates and encodes one check (its keys may span cluster slots: see `split`).
    fn encode(&self, checks: &[Check<'_>], opts: CheckOptions) -> Result<Group, Error> {
        // A lease only for a concurrency check that takes something (cost 0 holds nothing).
        let lease = if checks
            .iter()
            .any(|c| c.cost > 0 && matches!(c.policy.kind(), Kind::Concurrency(_)))
        {
            fastrand::u64(1..)
        } else {
            0
        };
        self.encode_with(checks, opts, lease)
    }

    fn encode_with(
        &self,
        checks: &[Check<'_>],
        opts: CheckOptions,
        lease: u64,
    ) -> Result<Group, Error> {
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
        // One check, the usual case, is built without the iterator: collecting into a SmallVec
        // took about 200 instructions per vector.
        let (keys, policies, costs) = match checks {
            [c] => (
                smallvec![self.state_key(c.policy, c.key)],
                smallvec![params(c.policy.kind())],
                smallvec![c.cost],
            ),
            _ => (
                checks
                    .iter()
                    .map(|c| self.state_key(c.policy, c.key))
                    .collect(),
                checks.iter().map(|c| params(c.policy.kind())).collect(),
                checks.iter().map(|c| c.cost).collect(),
            ),
        };
        Ok(Group {
            keys,
            policies,
            costs,
            max_wait: u64::try_from(opts.max_wait.as_micros()).unwrap_or(u64::MAX),
            lease,
            now: opts.now,
            dry_run: false,
            gcra: match checks {
                [c] => match c.policy.kind() {
                    Kind::Gcra(g) => Some(*g),
                    _ => None,
                },
                _ => None,
            },
        })
    }

    /// The first step of a check: a check that one script call decides goes into the
    /// batcher's queue when it has room, and the future only waits for its reply; any other
    /// (no batching, a full queue, a cluster check across slots) runs boxed. `here`: the
    /// runtime the check is made on.
    fn start<'c>(
        &self,
        checks: &'c [Check<'_>],
        opts: CheckOptions,
        here: tokio::runtime::Id,
    ) -> Result<CheckFuture<'c>, Error> {
        let timeout = self.budget(&opts);
        if timeout.is_zero() {
            // Past the caller's deadline: not sent.
            return Err(Error::Timeout {
                after: timeout,
                op: "check (its deadline had passed)",
            });
        }
        let group = self.encode(checks, opts)?;
        let lease = group.lease;
        let slots = self.slots_of(&group);
        if let Some((jobs, batcher_runtime)) = self.batcher_on()
            && slots.is_none()
            && let Ok(permit) = jobs.try_reserve()
        {
            let deadline = later(tokio::time::Instant::now(), timeout);
            let rx = queue(permit, group, deadline);
            // The batcher answers by the deadline while its runtime runs, which it
            // does whenever this check is awaited on that runtime. Awaited on another
            // (a runtime per thread, a test's own), the check keeps a timer of its own
            // in case that one is blocked or no longer driven.
            let patience = (here != *batcher_runtime).then(|| {
                let patience = later(deadline, PATIENCE_MARGIN);
                (Box::pin(tokio::time::sleep_until(patience)), timeout)
            });
            return Ok(CheckFuture::Batched {
                reply: rx,
                lease,
                patience,
            });
        }
        // The limiter is cloned (an `Arc`) rather than borrowed: the future then borrows the
        // checks alone, and `check` can return it without holding its arguments.
        let this = self.clone();
        Ok(CheckFuture::Boxed(Box::pin(async move {
            this.run_check(checks, opts, group, slots, timeout).await
        })))
    }

    /// How long a check with `opts` may take: the connection's timeout, or less when the
    /// caller's deadline comes sooner.
    fn budget(&self, opts: &CheckOptions) -> Duration {
        let timeout = self.inner.conn.timeout();
        opts.deadline.map_or(timeout, |d| {
            d.saturating_duration_since(std::time::Instant::now())
                .min(timeout)
        })
    }

    /// `slots`: the group's [`RedisLimiter::slots_of`]; `timeout`: the check's
    /// [`RedisLimiter::budget`].
    async fn run_check(
        &self,
        checks: &[Check<'_>],
        opts: CheckOptions,
        group: Group,
        slots: Option<Vec<u16>>,
        timeout: Duration,
    ) -> Result<Verdict, Error> {
        let lease = group.lease;
        // The cross-slot path is boxed: it holds several script calls, and its futures would
        // make every check's future (boxed and copied by callers such as the tower layer)
        // many kilobytes larger.
        let verdict = match slots {
            // Each part's call is bounded by the connection's timeout, and the whole by the
            // check's: cut short before a part denies, the parts counted are given back.
            Some(slots) => {
                Box::pin(self.run_across_slots(checks, opts, lease, &slots, timeout)).await?
            }
            None => self.run_group(group, timeout).await?.0,
        };
        Ok(with_lease(verdict, lease))
    }

    /// On a cluster, the slot of each check when they span several; `None` when one call does.
    fn slots_of(&self, group: &Group) -> Option<Vec<u16>> {
        if self.inner.conn.kind() != ConnectionKind::Cluster {
            return None;
        }
        let slots: Vec<u16> = group.keys.iter().map(|k| key_slot(k)).collect();
        slots.iter().any(|s| *s != slots[0]).then_some(slots)
    }

    /// One call of the check script, batched with others when batching is on, over within
    /// `timeout`.
    async fn run_group(&self, group: Group, timeout: Duration) -> Result<Checked, Error> {
        match self.batcher() {
            Some(jobs) => {
                let deadline = later(tokio::time::Instant::now(), timeout);
                // A place in the queue first, then the job: the job is built once and moved
                // once, instead of living in the future of `send` as well. The queue is
                // almost never full: only then does the check wait for a place, bounded by its
                // deadline, in a boxed future that leaves the usual path without a timer.
                let reserved = match jobs.try_reserve() {
                    Ok(permit) => Ok(Ok(permit)),
                    Err(mpsc::error::TrySendError::Closed(())) => Ok(Err(())),
                    Err(mpsc::error::TrySendError::Full(())) => {
                        Box::pin(async {
                            match tokio::time::timeout_at(deadline, jobs.reserve()).await {
                                Ok(reserved) => Ok(reserved.map_err(|_| ())),
                                Err(elapsed) => Err(elapsed),
                            }
                        })
                        .await
                    }
                };
                let permit = match reserved {
                    Ok(Ok(permit)) => permit,
                    Ok(Err(())) => {
                        // The batching task is gone (the runtime it ran on was shut down):
                        // check unbatched rather than fail every check from now on.
                        if !BATCHER_GONE_WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                            tracing::warn!(
                                "floodgate's batching task has stopped (was the tokio runtime it \
                                 started on shut down?); checks go unbatched"
                            );
                        }
                        return self.run_unbatched(&group, timeout).await;
                    }
                    Err(_) => {
                        return Err(Error::Timeout {
                            after: timeout,
                            op: "batched check",
                        });
                    }
                };
                let rx = queue(permit, group, deadline);
                // The batcher answers by the deadline; the margin only guards against a
                // batcher that stopped answering.
                let patience = later(deadline, PATIENCE_MARGIN);
                match tokio::time::timeout_at(patience, rx).await {
                    Ok(Ok(answer)) => claimed(answer),
                    Ok(Err(_)) => Err(batcher_gone()),
                    Err(_) => Err(Error::Timeout {
                        after: timeout,
                        op: "batched check",
                    }),
                }
            }
            None => self.run_unbatched(&group, timeout).await,
        }
    }

    /// One call of the check script for `group` alone, over within `timeout`.
    async fn run_unbatched(&self, group: &Group, timeout: Duration) -> Result<Checked, Error> {
        // Dropped with this future while the call is in flight, the lease the call may grant is
        // given back. On the multiplexed connection the release goes after the call; on a pool
        // it takes another connection and may arrive first, and a lease granted after it
        // lapses at its TTL.
        let unclaimed = batch::Unclaimed::of(&self.inner.conn, group);
        // Boxed for the same reason as the cross-slot path: a script call's future is large,
        // and the batched path (the default) does not need it here.
        let results = Box::pin(batch::run_within(&self.inner.conn, &[group], timeout)).await;
        // Answered: an allowed verdict takes its lease to the caller, and `run_within` gives back
        // what a failed call may have granted.
        if let Some(lease) = unclaimed {
            lease.claim();
        }
        let mut results = results?;
        results.pop().unwrap_or_else(|| Err(batcher_gone()))
    }

    /// A check whose keys live in several cluster slots: each slot's part is checked
    /// all-or-nothing in turn; when a part is denied, the parts already counted are given back
    /// (`undo.lua`) and the parts not reached are peeked at, so nothing stays counted.
    ///
    /// Once a part denies, the check is denied, whatever follows: should giving back or the dry
    /// runs fail or run out of time (`timeout`), the parts not dry-run report their decision
    /// as counted, or, never reached, what their policy decides with nothing counted. An error
    /// there would let a layer that fails open admit the request.
    ///
    /// Between a part being counted and given back, other checks may see it counted: across
    /// slots, all-or-nothing holds for the final state, not at every instant. A check dropped
    /// half-way (its caller gave up, the layer's timeout) gives back the parts counted so far
    /// in a task of its own; the part in flight then may still be counted when its node
    /// answers, as a single-slot check dropped in flight may (its concurrency lease is given
    /// back, as any lease granted to a caller that is gone).
    async fn run_across_slots(
        &self,
        checks: &[Check<'_>],
        opts: CheckOptions,
        lease: u64,
        slots: &[u16],
        timeout: Duration,
    ) -> Result<Verdict, Error> {
        let deadline = later(tokio::time::Instant::now(), timeout);
        // What a call may take: the connection's timeout, within what is left of the check's.
        let budget = || {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            (!left.is_zero()).then(|| left.min(self.inner.conn.timeout()))
        };
        let mut order: Vec<u16> = slots.to_vec();
        order.dedup();
        order.sort_unstable();
        order.dedup();
        let parts: Vec<Vec<usize>> = order
            .iter()
            .map(|slot| (0..checks.len()).filter(|&i| slots[i] == *slot).collect())
            .collect();
        let mut decisions: Vec<Option<Decision>> = vec![None; checks.len()];
        // Given back should this future be dropped (or fail) half-way.
        let mut counted = Counted {
            limiter: self,
            checks,
            parts: Vec::new(),
            lease,
        };
        let mut wait = Duration::ZERO;
        let mut denied_at = None;
        let mut first_time = None;
        for (n, part) in parts.iter().enumerate() {
            let sub: Vec<Check<'_>> = part.iter().map(|&i| checks[i]).collect();
            // A later part with a window or a log is decided as of the first part's time, which
            // a refund gives back as of: a sliding log finds its entry by that time, a window
            // that the check opened starts at it. Its node decides as of a moment in its past
            // (the time between the calls; more if the nodes' clocks differ), and keeps those
            // keys a minute longer (the slack of injected times). Other parts are decided on
            // their node's time, with the batches of other checks: their reset times are moved
            // to count from the first part's time below, which is all their refund needs.
            let by_time = sub.iter().any(|c| {
                matches!(
                    c.policy.kind(),
                    Kind::SlidingLog(_) | Kind::FixedWindow(_) | Kind::SlidingWindow(_)
                )
            });
            let opts = match (opts.now, first_time) {
                (None, Some(first)) if by_time => CheckOptions {
                    now: Some(Timestamp::from_micros(first)),
                    ..opts
                },
                _ => opts,
            };
            let result = match budget() {
                Some(budget) => {
                    self.run_group(self.encode_with(&sub, opts, lease)?, budget)
                        .await
                }
                None => Err(Error::Timeout {
                    after: timeout,
                    op: "check across slots",
                }),
            };
            let (verdict, now) = match result {
                Ok(v) => v,
                Err(e) => {
                    // The undo goes on in its task should the check's time run out first.
                    let _ = tokio::time::timeout_at(deadline, counted.undo_now()).await;
                    return Err(e);
                }
            };
            first_time.get_or_insert(now);
            for (&i, d) in part.iter().zip(&verdict.decisions) {
                decisions[i] = Some(*d);
            }
            if verdict.allowed() {
                wait = wait.max(verdict.wait);
                counted.parts.push((part, now));
            } else {
                denied_at = Some(n);
                break;
            }
        }
        // A check across slots is decided, and refunded, as of its first part's time.
        let at = Timestamp::from_micros(first_time.unwrap_or(0));
        if let Some(n) = denied_at {
            // The parts given back, and the parts never reached, report what they would have
            // decided with nothing counted: a dry run of each, once the undo is done. Nothing
            // here turns the denial into an error.
            let undone = tokio::time::timeout_at(deadline, counted.undo_now()).await;
            let (undone, dry_run) = match undone {
                Ok(undone) => (undone, true),
                Err(_) => (Vec::new(), false),
            };
            for part in undone.into_iter().chain(&parts[n + 1..]) {
                let sub: Vec<Check<'_>> = part.iter().map(|&i| checks[i]).collect();
                let verdict = match budget().filter(|_| dry_run) {
                    Some(budget) => match self.encode_with(&sub, opts, 0) {
                        Ok(mut group) => {
                            group.dry_run = true;
                            self.run_group(group, budget).await.ok()
                        }
                        Err(_) => None,
                    },
                    None => None,
                };
                match verdict {
                    Some((verdict, _)) => {
                        for (&i, d) in part.iter().zip(&verdict.decisions) {
                            decisions[i] = Some(*d);
                        }
                    }
                    None => {
                        tracing::debug!(
                            "a denied check across slots reports some parts without a dry run"
                        );
                    }
                }
            }
            // Never reached, and not dry-run: what the policy decides with nothing counted.
            let now = first_time.unwrap_or(0);
            for (d, c) in decisions.iter_mut().zip(checks) {
                if d.is_none() {
                    let kind = c.policy.kind();
                    *d = Some(
                        kind.decide(
                            &kind.fresh(),
                            &floodgate_core::algorithm::Ctx::new(now, c.cost),
                        )
                        .decision,
                    );
                }
            }
            wait = Duration::ZERO;
        } else {
            let kept = counted.keep();
            if let Some(first) = first_time.filter(|_| !kept.is_empty()) {
                // Each later part's reset times are moved to count from the first part's time
                // (still whole milliseconds, rounded up), so that `at + reset_after` stays the
                // instant each key is full again (what a refund gives back depends on it).
                for (part, now) in &kept[1..] {
                    for &i in part.iter() {
                        if let Some(d) = &mut decisions[i] {
                            let us = u64::try_from(d.reset_after.as_micros()).unwrap_or(u64::MAX);
                            let us = if *now >= first {
                                us.saturating_add(now - first)
                            } else {
                                us.saturating_sub(first - now)
                            };
                            d.reset_after = Duration::from_millis(us.div_ceil(1_000));
                        }
                    }
                }
            }
        }
        let decisions = decisions
            .into_iter()
            .map(|d| {
                d.ok_or_else(|| Error::UnexpectedReply {
                    expected: "a decision for every check",
                    got: "a check left undecided".into(),
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Verdict {
            decisions,
            wait,
            lease: None,
            at,
        })
    }

    /// The keys and arguments of one call of `lua/undo.lua` that gives back what the checks at
    /// `part` (one slot) took at `at` (us), with lease `lease` (0: none), at `now` (us; `None`:
    /// the server's time); `reset_after(i)` is check `i`'s decision's reset time (us).
    fn undo_call(
        &self,
        checks: &[Check<'_>],
        part: &[usize],
        at: u64,
        now: Option<u64>,
        reset_after: &dyn Fn(usize) -> u64,
        lease: u64,
    ) -> UndoCall {
        let keys = part
            .iter()
            .map(|&i| self.state_key(checks[i].policy, checks[i].key))
            .collect();
        let mut args: Vec<Vec<u8>> = vec![
            at.to_string().into_bytes(),
            lease.to_string().into_bytes(),
            now.map(|t| t.to_string().into_bytes()).unwrap_or_default(),
        ];
        for &i in part {
            let (tag, p) = params(checks[i].policy.kind());
            args.push(tag.as_bytes().to_vec());
            args.extend(p.iter().map(|v| v.to_string().into_bytes()));
            args.push(checks[i].cost.to_string().into_bytes());
            args.push(reset_after(i).to_string().into_bytes());
        }
        UndoCall { keys, args }
    }

    /// Runs one call of `lua/undo.lua` (see [`RedisLimiter::undo_call`]).
    async fn undo(&self, call: UndoCall) -> Result<(), Error> {
        let key_refs: Vec<&[u8]> = call.keys.iter().map(Vec::as_slice).collect();
        let arg_refs: Vec<&[u8]> = call.args.iter().map(Vec::as_slice).collect();
        self.inner
            .conn
            .invoke_script(&UNDO, &key_refs, &arg_refs)
            .await
            .map(drop)
    }

    /// [`Limiter::renew`] as of `now` (simulations and tests; `None`: the server's time): one
    /// call per concurrency key, each extended by its policy's lease TTL.
    ///
    /// # Errors
    /// The first error of any key's call (the others are still renewed); a corrupt lease end
    /// or a key of another type changes nothing in that key.
    pub async fn renew_at(
        &self,
        checks: &[Check<'_>],
        lease: LeaseId,
        now: Option<Timestamp>,
    ) -> Result<bool, Error> {
        let id = lease.0.to_string();
        let now = now.map_or(String::new(), |t| t.as_micros().to_string());
        let mut held = true;
        let mut first_error = None;
        for c in checks {
            let Kind::Concurrency(conc) = c.policy.kind() else {
                continue;
            };
            let key = self.state_key(c.policy, c.key);
            let ttl = conc.lease_ttl_us().to_string();
            let reply = self
                .inner
                .conn
                .invoke_script(
                    &RENEW,
                    &[key.as_slice()],
                    &[id.as_bytes(), now.as_bytes(), ttl.as_bytes()],
                )
                .await;
            match reply {
                Ok(redis::Value::Int(n)) => held &= n == 1,
                Ok(other) => {
                    first_error.get_or_insert(Error::UnexpectedReply {
                        expected: "0 or 1 from the renew script",
                        got: format!("{other:?}").chars().take(200).collect(),
                    });
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(held), Err)
    }

    /// [`Limiter::refund`] as of `now` (simulations and tests; `None`: the server's time).
    ///
    /// # Errors
    /// As [`Limiter::refund`].
    pub async fn refund_at(
        &self,
        checks: &[Check<'_>],
        verdict: &Verdict,
        now: Option<Timestamp>,
    ) -> Result<(), Error> {
        if !verdict.allowed() {
            return Ok(());
        }
        if checks.len() != verdict.decisions.len() {
            return Err(Error::Config(format!(
                "a refund needs the checks its verdict answered: {} checks for {} decisions",
                checks.len(),
                verdict.decisions.len()
            )));
        }
        let lease = verdict.lease.map_or(0, |l| l.0);
        let at = verdict.at.as_micros();
        let now = now.map(Timestamp::as_micros);
        let reset_after = |i: usize| {
            u64::try_from(verdict.decisions[i].reset_after.as_micros()).unwrap_or(u64::MAX)
        };
        let mut parts: Vec<(u16, Vec<usize>)> = Vec::new();
        for (i, c) in checks.iter().enumerate() {
            let slot = if self.inner.conn.kind() == ConnectionKind::Cluster {
                key_slot(&self.state_key(c.policy, c.key))
            } else {
                0
            };
            match parts.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, part)) => part.push(i),
                None => parts.push((slot, vec![i])),
            }
        }
        // Every slot gets its units back even when another fails (a retry would refund the
        // others twice): the first error is the answer.
        let mut first_error = None;
        for (_, part) in &parts {
            let call = self.undo_call(checks, part, at, now, &reset_after, lease);
            if let Err(e) = self.undo(call).await {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// The batcher's queue, started on first use (it needs a running tokio runtime).
    fn batcher(&self) -> Option<&mpsc::Sender<Job>> {
        self.batcher_on().map(|(jobs, _)| jobs)
    }

    /// [`RedisLimiter::batcher`], with the id of the runtime the batching task runs on.
    fn batcher_on(&self) -> Option<&(mpsc::Sender<Job>, tokio::runtime::Id)> {
        if !self.inner.batch.enabled {
            return None;
        }
        Some(self.inner.jobs.get_or_init(|| {
            let (tx, rx) = mpsc::channel(self.inner.batch.queue);
            let runtime = tokio::runtime::Handle::current();
            runtime.spawn(batch::batcher(
                self.inner.conn.clone(),
                self.inner.batch.clone(),
                rx,
            ));
            (tx, runtime.id())
        }))
    }
}

/// How long past its deadline a caller waits for the batcher's answer before giving up on it:
/// the batcher answers by the deadline, so this only guards against one that stopped answering.
const PATIENCE_MARGIN: Duration = Duration::from_millis(20);

/// Puts `group` in the batcher's queue; the receiver gets its decision by `deadline`.
fn queue(
    permit: mpsc::Permit<'_, Job>,
    group: Group,
    deadline: tokio::time::Instant,
) -> oneshot::Receiver<batch::Answer> {
    let (tx, rx) = oneshot::channel();
    permit.send(Job {
        group,
        reply: tx,
        deadline,
    });
    rx
}

/// An allowed check of a concurrency policy holds lease `lease` (0: none was taken).
fn with_lease(verdict: Verdict, lease: u64) -> Verdict {
    Verdict {
        lease: (lease != 0 && verdict.allowed()).then_some(LeaseId(lease)),
        ..verdict
    }
}

/// The future of [`RedisLimiter::check`], written out rather than `async`: callers such as the
/// tower layer box it per request, and a batched check, the usual one, needs little while it
/// waits but the receiving end of its reply (`check`'s future is 104 bytes, against 1,120 as an
/// `async fn` throughout). The batcher answers every job by its deadline while its runtime runs,
/// or drops it when its task is gone; so a check awaited on the batcher's runtime needs no timer
/// of its own, and only one awaited on another runtime keeps one.
///
/// A check of a concurrency policy dropped before its caller reads the verdict (the client went
/// away, the layer's timeout) gives back the lease its script call may have granted: the
/// batcher's answer carries it unclaimed ([`batch::Unclaimed`]), and an unbatched call holds it
/// unclaimed until it answers.
enum CheckFuture<'a> {
    /// In the batcher's queue, or in a batch in flight.
    Batched {
        reply: oneshot::Receiver<batch::Answer>,
        lease: u64,
        /// When awaited off the batcher's runtime: a timer past the check's deadline, and the
        /// timeout to report when it fires.
        patience: Option<(Pin<Box<tokio::time::Sleep>>, Duration)>,
    },
    /// Every other check.
    Boxed(Pin<Box<dyn Future<Output = Result<Verdict, Error>> + Send + 'a>>),
    /// Failed before it started (a malformed check, a deadline already past).
    Failed(Error),
    /// Made outside a runtime: started when first polled. Rare, and boxed so that the usual
    /// variants set the future's size.
    #[allow(clippy::type_complexity)]
    Lazy(Box<(RedisLimiter, &'a [Check<'a>], CheckOptions)>),
    Done,
}

impl Future for CheckFuture<'_> {
    type Output = Result<Verdict, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if let CheckFuture::Lazy(_) = this
            && let CheckFuture::Lazy(lazy) = std::mem::replace(this, CheckFuture::Done)
        {
            let (limiter, checks, opts) = *lazy;
            *this = match tokio::runtime::Handle::try_current() {
                Ok(here) => limiter
                    .start(checks, opts, here.id())
                    .unwrap_or_else(CheckFuture::Failed),
                Err(e) => CheckFuture::Failed(Error::Config(format!(
                    "a rate-limit check was polled outside a tokio runtime: {e}"
                ))),
            };
        }
        let result = match this {
            CheckFuture::Batched {
                reply,
                lease,
                patience,
            } => match Pin::new(reply).poll(cx) {
                Poll::Ready(Ok(answer)) => claimed(answer).map(|(v, _)| with_lease(v, *lease)),
                Poll::Ready(Err(_)) => Err(batcher_gone()),
                Poll::Pending => {
                    let Some((sleep, after)) = patience else {
                        return Poll::Pending;
                    };
                    std::task::ready!(sleep.as_mut().poll(cx));
                    Err(Error::Timeout {
                        after: *after,
                        op: "batched check",
                    })
                }
            },
            CheckFuture::Boxed(fut) => std::task::ready!(fut.as_mut().poll(cx)),
            // Taken out (an empty placeholder allocates nothing); `Done` replaces it below.
            CheckFuture::Failed(e) => Err(std::mem::replace(e, Error::Config(String::new()))),
            // (`Lazy` was started above.)
            CheckFuture::Done | CheckFuture::Lazy(_) => Err(Error::Config(
                "a rate-limit check was polled after it finished".into(),
            )),
        };
        *this = CheckFuture::Done;
        Poll::Ready(result)
    }
}

/// The batcher's answer, its lease (if any) claimed: the verdict goes to the caller.
fn claimed((result, lease): batch::Answer) -> Result<Checked, Error> {
    if let Some(lease) = lease {
        lease.claim();
    }
    result
}

/// Whether the batching task's end has been logged (once per process).
static BATCHER_GONE_WARNED: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

fn batcher_gone() -> Error {
    Error::Config("the batching task has stopped (was its tokio runtime shut down?)".into())
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

/// Decodes one group's decisions from the reply's integers.
pub(crate) fn decode_group(ints: &[i64], now: u64) -> Option<Verdict> {
    let u = |v: i64| u64::try_from(v).ok();
    let mut decisions = SmallVec::new();
    let mut wait = 0;
    for f in ints.chunks_exact(FIELDS) {
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
    // A denied check reserved nothing: it does not wait.
    if decisions.iter().any(|d: &Decision| !d.allowed) {
        wait = 0;
    }
    Some(Verdict {
        decisions,
        wait: Duration::from_micros(wait),
        lease: None,
        at: Timestamp::from_micros(now),
    })
}

impl Limiter for RedisLimiter {
    type Error = Error;

    /// Timeouts and connection errors (including an open circuit breaker); a corrupted key or a
    /// malformed check is not.
    fn is_unavailable(error: &Error) -> bool {
        error.is_timeout() || error.is_connection()
    }

    /// For deadlines at least the connection's timeout away: a check is over by then, failed
    /// with [`Error::Timeout`] at the connection's timeout. The batching task answers every
    /// check by its deadline while its runtime runs; a check awaited on another runtime also
    /// keeps a timer of its own, 20 ms past the deadline, should that runtime be blocked.
    ///
    /// A sooner deadline is kept too (the check gets what is left of it, and one already past
    /// is not sent), but it bounds the whole call of the batch the check joins, and a call cut
    /// short counts against the circuit breaker: for a caller that cannot wait the
    /// connection's timeout, a timer of its own spares the other checks.
    fn keeps_deadlines(&self, within: Duration) -> bool {
        within >= self.inner.conn.timeout()
    }

    fn check<'s, 'c, 'k>(
        &'s self,
        checks: &'c [Check<'k>],
        opts: CheckOptions,
    ) -> impl Future<Output = Result<Verdict, Error>> + Send + use<'s, 'c, 'k> {
        // Started when called, not when first polled: the future is the started check alone,
        // without the arguments (callers such as the tower layer box it per request). Called
        // outside a runtime (to be awaited in one: `block_on(limiter.check(..))`), it starts
        // when first polled, in that runtime.
        match tokio::runtime::Handle::try_current() {
            Ok(here) => self
                .start(checks, opts, here.id())
                .unwrap_or_else(CheckFuture::Failed),
            Err(_) => CheckFuture::Lazy(Box::new((self.clone(), checks, opts))),
        }
    }

    async fn release(&self, checks: &[Check<'_>], lease: LeaseId) -> Result<(), Error> {
        self.release_at(checks, lease, None).await.map(|_| ())
    }

    /// One call of `lua/undo.lua` per cluster slot, as of the verdict's time (the server's).
    /// On a cluster, a check across slots is decided as of its first part's time (the later
    /// parts' reset times are moved to count from it), and refunded as of that time: a window
    /// or log whose part ran in another window (a boundary crossed between the parts, or a
    /// node whose clock differs) may give nothing back, and on a node whose clock differs the
    /// drain-in-order estimate of GCRA, the funnel and the shaper is off by the difference.
    async fn refund(&self, checks: &[Check<'_>], verdict: &Verdict) -> Result<(), Error> {
        self.refund_at(checks, verdict, None).await
    }

    async fn renew(&self, checks: &[Check<'_>], lease: LeaseId) -> Result<bool, Error> {
        self.renew_at(checks, lease, None).await
    }

    async fn reset(&self, key: &[u8], policy: &Policy) -> Result<(), Error> {
        let mut cmd = redis::cmd("DEL");
        cmd.arg(self.state_key(policy, key));
        self.inner.conn.query::<i64>(cmd).await.map(|_| ())
    }
}

/// How long the undo of a check across slots dropped half-way is tried again while the circuit
/// breaker refuses it (see `Counted::spawn_undo`).
const UNDO_PATIENCE: Duration = Duration::from_secs(30);

/// One call of `lua/undo.lua`, owned: it can outlive the check it gives back.
#[derive(Clone)]
struct UndoCall {
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

/// The parts of a check across cluster slots counted so far, each with the time (us) its node
/// counted it at. Unless kept (the check was allowed), they are given back: by
/// [`Counted::undo_now`], or when the check is dropped half-way (its caller gave up, a timeout
/// cut it short) by a task of their own, so that a check across slots does not stay half
/// counted, nor hold a concurrency lease no one will release.
struct Counted<'a, 'c> {
    limiter: &'a RedisLimiter,
    checks: &'a [Check<'c>],
    parts: Vec<(&'a Vec<usize>, u64)>,
    lease: u64,
}

impl<'a> Counted<'a, '_> {
    /// The undo call of a part counted at `now`: it gives back its checks' whole share as of
    /// that time (no reset time limits it).
    fn call(&self, part: &[usize], now: u64) -> UndoCall {
        let whole = |_: usize| floodgate_core::algorithm::MAX_SPAN_US;
        self.limiter
            .undo_call(self.checks, part, now, Some(now), &whole, self.lease)
    }

    /// Gives back what the counted parts took, and returns those parts. Failures are logged:
    /// the units come back on their own when the state expires. The undo calls run in a task
    /// of their own, awaited here: dropped meanwhile, this leaves them running.
    async fn undo_now(&mut self) -> Vec<&'a Vec<usize>> {
        let parts = self.parts.iter().map(|(p, _)| *p).collect();
        if let Some(task) = self.spawn_undo(Duration::ZERO) {
            // A task that panicked has logged it; there is nothing more to do.
            let _ = task.await;
        }
        parts
    }

    /// The counted parts, which stay counted.
    fn keep(mut self) -> Vec<(&'a Vec<usize>, u64)> {
        std::mem::take(&mut self.parts)
    }

    /// Spawns one task that gives back every counted part (none are left counted here), on the
    /// current tokio runtime; `None` when there is nothing to give back or no runtime.
    /// `patience`: how long a call refused by an open circuit breaker (nothing sent) is tried
    /// again; the failure that dropped the check may be what opened it. Other failures are not
    /// tried again: the undo may have run.
    fn spawn_undo(&mut self, patience: Duration) -> Option<tokio::task::JoinHandle<()>> {
        if self.parts.is_empty() {
            return None;
        }
        let calls: Vec<UndoCall> = std::mem::take(&mut self.parts)
            .into_iter()
            .map(|(part, now)| self.call(part, now))
            .collect();
        let limiter = self.limiter.clone();
        let undo = async move {
            for call in calls {
                let give_up = tokio::time::Instant::now() + patience;
                loop {
                    match limiter.undo(call.clone()).await {
                        Err(Error::Unavailable { retry_in, .. })
                            if tokio::time::Instant::now() + retry_in < give_up =>
                        {
                            tokio::time::sleep(retry_in.max(Duration::from_millis(50))).await;
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "could not give back a cross-slot check's units");
                            break;
                        }
                        Ok(()) => break,
                    }
                }
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => Some(runtime.spawn(undo)),
            Err(_) => {
                tracing::warn!(
                    "a check across cluster slots was dropped half-way outside a tokio runtime: \
                     the parts it counted come back when their states expire"
                );
                None
            }
        }
    }
}

impl Drop for Counted<'_, '_> {
    /// Dropped half-way (its caller gave up, a timeout cut it short): the counted parts are
    /// given back by a task of their own, on the runtime the check was dropped on (a
    /// current-thread runtime runs it when next driven; one shutting down drops it, and the
    /// parts come back when their states expire).
    fn drop(&mut self) {
        drop(self.spawn_undo(UNDO_PATIENCE));
    }
}

/// `d` after `from`; a century after it when that is more than an `Instant` holds (a timeout
/// of `Duration::MAX`, which means for ever).
pub(crate) fn later(from: tokio::time::Instant, d: Duration) -> tokio::time::Instant {
    from.checked_add(d)
        .or_else(|| from.checked_add(Duration::from_secs(100 * 365 * 24 * 3_600)))
        .unwrap_or(from)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(tags: &[&'static str]) -> Group {
        Group {
            keys: tags.iter().map(|t| t.as_bytes().to_vec()).collect(),
            policies: tags.iter().map(|t| (*t, [1, 1, 1, 0])).collect(),
            costs: tags.iter().map(|_| 1).collect(),
            max_wait: 0,
            lease: 0,
            now: None,
            dry_run: false,
            gcra: None,
        }
    }

    #[test]
    fn a_batch_of_one_algorithm_runs_that_algorithm_s_script() {
        let hash = |groups: &[&Group]| check_script_for(groups).get_hash().to_owned();
        let full = CHECK_SCRIPT.get_hash().to_owned();
        let (a, b) = (group(&["gcra"]), group(&["gcra", "gcra"]));
        let gcra = hash(&[&a, &b]);
        assert_ne!(gcra, full);
        // Every algorithm has its own script, each different from the others and the full one.
        let mut seen = vec![full.clone()];
        for tag in ["gcra", "shp", "lb", "tb", "fw", "sw", "log", "conc"] {
            let h = hash(&[&group(&[tag])]);
            assert!(!seen.contains(&h), "{tag} shares a script");
            seen.push(h);
        }
        // Mixed algorithms, or none known: the script with every algorithm.
        assert_eq!(hash(&[&a, &group(&["tb"])]), full);
        assert_eq!(hash(&[&group(&["gcra", "fw"])]), full);
        assert_eq!(hash(&[&group(&["nope"])]), full);
        assert_eq!(hash(&[]), full);
    }

    /// The size of what `f` returns.
    fn returned<A: 'static, R>(_: &impl Fn(&'static A, &'static [Check<'static>]) -> R) -> usize {
        std::mem::size_of::<R>()
    }

    #[test]
    fn a_check_s_future_is_small() {
        // Layers box this future per request (the deny cache around it): a batched check
        // holds its reply's receiver and little else.
        let redis = |l: &'static RedisLimiter, c: &'static [Check<'static>]| {
            l.check(c, CheckOptions::default())
        };
        let cached = |l: &'static floodgate_core::DenyCache<RedisLimiter>,
                      c: &'static [Check<'static>]| {
            l.check(c, CheckOptions::default())
        };
        assert!(returned(&redis) <= 128, "{} bytes", returned(&redis));
        assert!(returned(&cached) <= 320, "{} bytes", returned(&cached));
    }

    #[test]
    fn only_plain_checks_take_the_short_form() {
        assert!(group(&["gcra"]).is_plain());
        assert!(!group(&["gcra", "gcra"]).is_plain());
        let mut g = group(&["gcra"]);
        g.costs[0] = 2;
        assert!(!g.is_plain());
        let mut g = group(&["gcra"]);
        g.max_wait = 1;
        assert!(!g.is_plain());
        let mut g = group(&["conc"]);
        g.lease = 7;
        assert!(!g.is_plain());
        let mut g = group(&["gcra"]);
        g.dry_run = true;
        assert!(!g.is_plain());
    }
}
