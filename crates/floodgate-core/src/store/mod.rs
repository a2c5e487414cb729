//! The store interface every backend implements, and the in-memory stores.

mod concurrency_lease;
mod deny_cache;
mod lease_clock;
mod leasing;
mod memory;
pub(crate) mod sharded;

use std::future::Future;
use std::time::Duration;

pub use concurrency_lease::ConcurrencyLease;
pub use deny_cache::{DenyCache, DenyCacheStats};
pub use lease_clock::LeaseClock;
pub use leasing::{Leasing, LeasingConfig, LeasingStats, MAX_LEASE_FOR};
pub use memory::{DEFAULT_MAX_KEYS, MemoryLimiter, MemoryLimiterBuilder};
pub use sharded::{OnFull, StoreStats};

use crate::{Decision, LeaseId, Policy, Timestamp, Verdict};

/// One policy to check for one key.
#[derive(Clone, Copy, Debug)]
pub struct Check<'a> {
    /// The key: any bytes (a phone number, an IP, an API key, ...).
    pub key: &'a [u8],
    /// The policy.
    pub policy: &'a Policy,
    /// The units this request takes (default 1; 0 peeks).
    pub cost: u64,
}

impl<'a> Check<'a> {
    /// A check of `policy` for `key`, costing 1.
    pub fn new(key: &'a [u8], policy: &'a Policy) -> Self {
        Check {
            key,
            policy,
            cost: 1,
        }
    }

    /// The same check with another cost.
    pub fn cost(self, cost: u64) -> Self {
        Check { cost, ..self }
    }
}

/// Options of a check.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CheckOptions {
    /// How long the caller is willing to wait for a shaper's reservation. Other algorithms
    /// ignore it. Zero decides now (`try_acquire`).
    pub max_wait: Duration,
    /// Decide as of this time instead of the store's clock (tests and simulations). The Redis
    /// backend otherwise uses the server's time.
    pub now: Option<Timestamp>,
    /// When the caller gives up on the check. A limiter that keeps deadlines
    /// ([`Limiter::keeps_deadlines`]) has the check over by then, failed with its timeout error
    /// if the store has not answered, and does not send it to the store past it; the caller
    /// needs no timer of its own. Others may ignore it. `None`: the limiter's own timeouts only.
    pub deadline: Option<std::time::Instant>,
}

impl CheckOptions {
    /// Options that wait up to `max_wait` for a reservation.
    pub fn wait(max_wait: Duration) -> Self {
        CheckOptions {
            max_wait,
            now: None,
            deadline: None,
        }
    }

    /// Options that decide as of `now`.
    pub fn at(now: Timestamp) -> Self {
        CheckOptions {
            max_wait: Duration::ZERO,
            now: Some(now),
            deadline: None,
        }
    }

    /// These options, the check over by `deadline` (see [`CheckOptions::deadline`]).
    #[must_use]
    pub fn until(self, deadline: std::time::Instant) -> Self {
        CheckOptions {
            deadline: Some(deadline),
            ..self
        }
    }
}

/// The counters of the local layers in front of a store, as [`Limiter::cache_stats`] gives
/// them: `None` for a layer the limiter does not have.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CacheStats {
    /// The deny cache's counters.
    pub deny_cache: Option<DenyCacheStats>,
    /// Local token leasing's counters.
    pub leasing: Option<LeasingStats>,
}

/// A store of rate-limit state: in memory, or in Redis.
///
/// A check of several policies is **all-or-nothing**: either every policy allows and every one
/// is counted, or nothing is counted (see [`Verdict`]). Implementations must make a check
/// atomic with respect to every other check on the same keys, across threads, and for shared
/// stores across processes.
pub trait Limiter: Send + Sync {
    /// The store's error.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Checks `checks` together.
    fn check(
        &self,
        checks: &[Check<'_>],
        opts: CheckOptions,
    ) -> impl Future<Output = Result<Verdict, Self::Error>> + Send;

    /// Releases the concurrency lease `lease` taken by an allowed check of `checks`. Policies
    /// other than concurrency limits are left alone.
    fn release(
        &self,
        checks: &[Check<'_>],
        lease: LeaseId,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Extends the concurrency lease `lease` taken by an allowed check of `checks` to a whole
    /// lease TTL from now, on every concurrency policy among them (the others are left
    /// alone): for work that outlasts the TTL (a long stream), renewed well within it. Returns
    /// whether every key still held the lease; one that had lapsed or been released is not
    /// taken again.
    fn renew(
        &self,
        checks: &[Check<'_>],
        lease: LeaseId,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send;

    /// Gives back what the allowed `verdict` of `checks` took, as if the request had not been
    /// made: for work that did not happen after all (the SMS provider refused the message, the
    /// call the limit guarded failed before doing anything). `checks` must be the checks the
    /// verdict answered (the same keys, policies and costs, as many as its decisions).
    ///
    /// A denied verdict took nothing, and nothing changes. Refunded before anything else is
    /// counted on its keys, a check is as if it had never been made. Refunded later:
    /// - the window algorithms (fixed and calendar windows, the sliding log and counter) give
    ///   back only to the window that counted the check, and nothing once it has closed;
    /// - GCRA, the funnel and the shaper drain oldest first: they give back only what is left
    ///   of the check's own share (known from its decision's `reset_after`, to the
    ///   millisecond), nothing once it has drained by itself, and never past a fresh state;
    /// - the token bucket gives back `cost` tokens as the bucket holds them now, never past its
    ///   capacity: if the check's tokens had already been refilled and others were taken since,
    ///   the key admits up to `cost` more than it would have without the request.
    ///
    /// Two limits of a late refund: the shaper gives nothing back once another reservation is
    /// queued behind the check's (freeing a slot in the middle would promise it twice), and
    /// the drain-in-order estimate knows nothing of earlier refunds, so refunding a second
    /// check after one counted since can take up to its own cost from that one.
    ///
    /// A concurrency policy's lease is released. Refunding the same verdict twice gives its
    /// units back twice.
    fn refund(
        &self,
        checks: &[Check<'_>],
        verdict: &Verdict,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Forgets the state of `policy` for `key`, as if it had never been used.
    fn reset(
        &self,
        key: &[u8],
        policy: &Policy,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// [`Limiter::check`], answered by the store itself. A limiter that answers some checks
    /// without it ([`DenyCache`]'s cached denials, [`Leasing`]'s leased units) asks the store
    /// here: what a layer needs to learn whether a failing store answers again, which a local
    /// answer would claim it does. Defaults to [`Limiter::check`]; a limiter that wraps
    /// another and answers locally should pass this on to its inner limiter's.
    fn check_store(
        &self,
        checks: &[Check<'_>],
        opts: CheckOptions,
    ) -> impl Future<Output = Result<Verdict, Self::Error>> + Send {
        self.check(checks, opts)
    }

    /// `checks` answered here, without the store, if this limiter holds an answer: a denial
    /// [`DenyCache`] holds that is still in force. `None` otherwise (the default); a limiter
    /// that wraps another passes this on. A layer asks it while the store is failing and
    /// skipped: a key the store denied until later stays denied, where the failure policy
    /// would decide it (failing open, let it through).
    fn check_local(&self, checks: &[Check<'_>], opts: &CheckOptions) -> Option<Verdict> {
        let _ = (checks, opts);
        None
    }

    /// Whether every check of this limiter whose [`CheckOptions::deadline`] is at least `within`
    /// away is over by that deadline on its own (failed with the limiter's timeout error when
    /// the store has not answered by then), so that a caller who sets one needs no timer of its
    /// own. Defaults to `false`. The tower layer sets its timeout as the deadline, and times a
    /// check itself unless its limiter keeps deadlines that far away: a timer per request is a
    /// good part of what an asynchronous check costs the service.
    ///
    /// A limiter that wraps another keeps deadlines only if every wait of its own is bounded by
    /// the deadline too, and the inner limiter keeps them.
    fn keeps_deadlines(&self, within: Duration) -> bool {
        let _ = within;
        false
    }

    /// Whether `error` means the store itself is unavailable (down, unreachable, too slow), as
    /// opposed to a problem with one key or one check (a corrupted value, a bad request). Layers
    /// use it to decide whether to stop asking the store for a while. Defaults to `true`.
    fn is_unavailable(error: &Self::Error) -> bool {
        let _ = error;
        true
    }

    /// The counters of the local layers in front of the store ([`DenyCache`], [`Leasing`]),
    /// for monitoring: how many checks they answered without it. Empty for a plain store. A
    /// limiter that wraps another should return its inner limiter's (the default returns
    /// nothing).
    fn cache_stats(&self) -> CacheStats {
        CacheStats::default()
    }

    /// Checks one policy for one key. A concurrency policy's lease taken here cannot be
    /// released (the decision has no lease id) and lapses after its TTL: check those with
    /// [`Limiter::check`], whose verdict has the lease.
    fn check_one(
        &self,
        key: &[u8],
        policy: &Policy,
        cost: u64,
    ) -> impl Future<Output = Result<Decision, Self::Error>> + Send {
        async move {
            let verdict = self
                .check(
                    &[Check::new(key, policy).cost(cost)],
                    CheckOptions::default(),
                )
                .await?;
            Ok(verdict.decisions[0])
        }
    }

    /// Takes a turn: reserves the next slot of every shaper in `checks` if it comes within
    /// `max_wait`, then sleeps until it. Returns the verdict; its `wait` is how long this call
    /// waited. A denied verdict did not wait and reserved nothing.
    fn acquire(
        &self,
        checks: &[Check<'_>],
        max_wait: Duration,
    ) -> impl Future<Output = Result<Verdict, Self::Error>> + Send {
        async move {
            let verdict = self.check(checks, CheckOptions::wait(max_wait)).await?;
            if verdict.allowed() && !verdict.wait.is_zero() {
                tokio::time::sleep(verdict.wait).await;
            }
            Ok(verdict)
        }
    }

    /// Decides now: like [`Limiter::acquire`] with no waiting.
    fn try_acquire(
        &self,
        checks: &[Check<'_>],
    ) -> impl Future<Output = Result<Verdict, Self::Error>> + Send {
        self.check(checks, CheckOptions::default())
    }
}
