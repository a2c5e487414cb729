//! The rate-limiting algorithms as pure state machines.
//!
//! Each algorithm is a parameter struct (validated at construction) and a small `State`. A check
//! is two steps so that several policies can be checked all-or-nothing:
//!
//! 1. [`Algorithm::decide`] looks at the state and returns the [`Outcome`] the request *would*
//!    have, changing nothing;
//! 2. [`Algorithm::commit`] applies the request, and is called only when every policy allowed.
//!
//! Time is whole microseconds since the Unix epoch (see [`crate::Timestamp`]). Everything is
//! integer arithmetic, and every intermediate value stays below 2^53, so the Lua scripts of the
//! Redis backend compute bit-for-bit the same results.

pub mod concurrency;
pub mod fixed_window;
pub mod gcra;
pub mod leaky_bucket;
pub mod shaper;
pub mod sliding_log;
pub mod sliding_window;
pub mod token_bucket;

use crate::Decision;

/// Largest duration, in microseconds, a policy may span (about 71 years): keeps `now + span`
/// exact in a double.
pub const MAX_SPAN_US: u64 = 1 << 51;

/// Largest limit or capacity a policy may have.
pub const MAX_LIMIT: u64 = 1 << 40;

/// The inputs of one check besides the state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ctx {
    /// The current time, microseconds since the epoch.
    pub now: u64,
    /// The units this request takes (0 peeks).
    pub cost: u64,
    /// For the shaper: how long the caller is willing to wait for its turn, in microseconds.
    pub max_wait: u64,
    /// For concurrency limits: the id of the lease this request would hold.
    pub lease: u64,
}

impl Ctx {
    /// A context for a request of `cost` units at `now`, that will not wait.
    pub fn new(now: u64, cost: u64) -> Self {
        Ctx {
            now,
            cost,
            max_wait: 0,
            lease: 0,
        }
    }
}

/// A refund of one allowed check: the check's time, cost, lease and decision, and the time of
/// the refund.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Undo {
    /// When the check was decided (its verdict's `at`), microseconds since the epoch.
    pub at: u64,
    /// When the refund happens (no earlier than `at`).
    pub now: u64,
    /// The units the check took.
    pub cost: u64,
    /// Its concurrency lease (0: none).
    pub lease: u64,
    /// Its decision's `reset_after`, in microseconds: the time from `at` until the state was
    /// due to be full again, the end of the check's own share for the algorithms that drain
    /// in order (GCRA, the shaper, the funnel).
    pub reset_after: u64,
}

impl Undo {
    /// Of the check's own `share` (microseconds of drain), what has not drained by itself by
    /// the refund: units drain oldest first, and the check's are the last of its reset time.
    pub(crate) fn outstanding(&self, share: u64) -> u64 {
        let end = self.at.saturating_add(self.reset_after);
        end.saturating_sub(self.now.max(self.at)).min(share)
    }
}

/// What a check would do: the decision, and for the shaper how long to wait before going ahead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// The decision.
    pub decision: Decision,
    /// Microseconds the caller must wait before acting (shaper only; otherwise 0).
    pub wait: u64,
}

impl Outcome {
    #[inline]
    pub(crate) fn new(
        allowed: bool,
        limit: u64,
        remaining: u64,
        retry_after_us: Option<u64>,
        reset_after_us: u64,
    ) -> Self {
        Outcome {
            decision: Decision::from_micros(
                allowed,
                limit,
                remaining,
                retry_after_us,
                reset_after_us,
            ),
            wait: 0,
        }
    }
}

/// One rate-limiting algorithm: validated parameters and the transitions of its state.
pub trait Algorithm {
    /// The per-key state.
    type State: Clone + std::fmt::Debug + Send + Sync + 'static;

    /// The state of a key never used (or whose state has expired).
    fn fresh(&self) -> Self::State;

    /// The outcome of the request described by `ctx`, without changing anything.
    fn decide(&self, state: &Self::State, ctx: &Ctx) -> Outcome;

    /// Applies the request described by `ctx`. Only called after `decide` allowed it, and never
    /// for a peek (cost 0): a peek changes no state, not even to drop what has expired, so that
    /// the memory and Redis backends hold the same states whatever the clock does next (a clock
    /// that steps back sees again what a peek would have dropped).
    fn commit(&self, state: &mut Self::State, ctx: &Ctx);

    /// Gives back what an allowed check took (`undo` says which check, and when), and
    /// `state` may have moved on since. When nothing else was counted in between, the state is
    /// as if the check had never been made. Otherwise, see
    /// [`Limiter::refund`](crate::Limiter::refund). A concurrency check's lease is released.
    ///
    /// Returns whether a store should take the state's expiry anew and drop it when it holds
    /// nothing as of the refund, as the Redis backend rewrites the key with its new TTL or
    /// deletes it. False when the check's units were no longer there to give back (a window
    /// that has moved on, a reservation with others queued behind it), and for a log or a
    /// lease set that still holds entries (Redis removes one member and keeps the set and its
    /// TTL): the state keeps its expiry.
    fn undo(&self, state: &mut Self::State, undo: &Undo) -> bool;

    /// The time from which `state` is indistinguishable from [`Algorithm::fresh`]: it may be
    /// dropped then without changing any future decision (the Redis TTL, the memory eviction).
    fn expires_at(&self, state: &Self::State) -> u64;

    /// Decides and, when allowed and not a peek, commits: one check of one policy.
    fn check(&self, state: &mut Self::State, ctx: &Ctx) -> Outcome {
        let out = self.decide(state, ctx);
        if out.decision.allowed && ctx.cost > 0 {
            self.commit(state, ctx);
        }
        out
    }
}

/// `a * b`, or `None` when it would exceed [`MAX_SPAN_US`] (never admissible).
#[inline]
pub(crate) fn mul_span(a: u64, b: u64) -> Option<u64> {
    a.checked_mul(b).filter(|v| *v <= MAX_SPAN_US)
}
