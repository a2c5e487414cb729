//! [`Policy`]: an algorithm with its parameters, validated, and a name.

use std::collections::HashMap;
use std::fmt;
use std::hash::Hash;
use std::str::FromStr;
use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::time::Duration;

use crate::algorithm::concurrency::{self, Concurrency};
use crate::algorithm::fixed_window::{self, FixedWindow, Window};
use crate::algorithm::gcra::{self, Gcra};
use crate::algorithm::leaky_bucket::{self, LeakyBucket};
use crate::algorithm::shaper::{self, Shaper};
use crate::algorithm::sliding_log::{self, SlidingLog};
use crate::algorithm::sliding_window::{self, SlidingWindow};
use crate::algorithm::token_bucket::{self, TokenBucket};
use crate::algorithm::{Algorithm, Ctx, MAX_SPAN_US, Outcome, Undo};
use crate::calendar::{Calendar, CalendarUnit};
use crate::error::PolicyError;

/// The longest policy name.
pub const MAX_NAME_LEN: usize = 64;

/// Names an algorithm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum AlgorithmKind {
    /// [`FixedWindow`], rolling or calendar-aligned.
    FixedWindow,
    /// [`SlidingLog`].
    SlidingLog,
    /// [`SlidingWindow`] (two weighted counters).
    SlidingWindow,
    /// [`TokenBucket`].
    TokenBucket,
    /// [`LeakyBucket`] as a meter: the funnel.
    LeakyBucket,
    /// [`Gcra`], redis-cell's algorithm.
    Gcra,
    /// [`Shaper`]: leaky bucket as a queue.
    Shaper,
    /// [`Concurrency`] leases.
    Concurrency,
}

impl AlgorithmKind {
    /// Every algorithm.
    pub const ALL: [AlgorithmKind; 8] = [
        AlgorithmKind::FixedWindow,
        AlgorithmKind::SlidingLog,
        AlgorithmKind::SlidingWindow,
        AlgorithmKind::TokenBucket,
        AlgorithmKind::LeakyBucket,
        AlgorithmKind::Gcra,
        AlgorithmKind::Shaper,
        AlgorithmKind::Concurrency,
    ];

    /// The algorithm's name as used in keys, flags and JSON: `fixed_window`, `gcra`, ...
    pub fn as_str(self) -> &'static str {
        match self {
            AlgorithmKind::FixedWindow => "fixed_window",
            AlgorithmKind::SlidingLog => "sliding_log",
            AlgorithmKind::SlidingWindow => "sliding_window",
            AlgorithmKind::TokenBucket => "token_bucket",
            AlgorithmKind::LeakyBucket => "leaky_bucket",
            AlgorithmKind::Gcra => "gcra",
            AlgorithmKind::Shaper => "shaper",
            AlgorithmKind::Concurrency => "concurrency",
        }
    }

    /// A short stable tag, used in Redis keys and the scripts' arguments.
    pub fn tag(self) -> &'static str {
        match self {
            AlgorithmKind::FixedWindow => "fw",
            AlgorithmKind::SlidingLog => "log",
            AlgorithmKind::SlidingWindow => "sw",
            AlgorithmKind::TokenBucket => "tb",
            AlgorithmKind::LeakyBucket => "lb",
            AlgorithmKind::Gcra => "gcra",
            AlgorithmKind::Shaper => "shp",
            AlgorithmKind::Concurrency => "conc",
        }
    }
}

impl fmt::Display for AlgorithmKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for AlgorithmKind {
    type Err = PolicyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let k = match s.trim().to_ascii_lowercase().replace('-', "_").as_str() {
            "fixed_window" | "fixed" | "fw" | "calendar" => AlgorithmKind::FixedWindow,
            "sliding_log" | "log" => AlgorithmKind::SlidingLog,
            "sliding_window" | "sliding" | "sw" => AlgorithmKind::SlidingWindow,
            "token_bucket" | "token" | "tb" => AlgorithmKind::TokenBucket,
            "leaky_bucket" | "funnel" | "lb" => AlgorithmKind::LeakyBucket,
            "gcra" | "cell" => AlgorithmKind::Gcra,
            "shaper" | "leaky_bucket_queue" | "queue" => AlgorithmKind::Shaper,
            "concurrency" | "concurrent" => AlgorithmKind::Concurrency,
            other => {
                return Err(PolicyError::Invalid {
                    field: "algorithm",
                    reason: format!(
                        "{other:?} is not one of fixed_window, sliding_log, sliding_window, \
                         token_bucket, leaky_bucket, gcra, shaper, concurrency"
                    ),
                });
            }
        };
        Ok(k)
    }
}

/// An algorithm with its validated parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Kind {
    /// Fixed window.
    FixedWindow(FixedWindow),
    /// Sliding window log.
    SlidingLog(SlidingLog),
    /// Sliding window counter.
    SlidingWindow(SlidingWindow),
    /// Token bucket.
    TokenBucket(TokenBucket),
    /// Leaky bucket meter (funnel).
    LeakyBucket(LeakyBucket),
    /// GCRA.
    Gcra(Gcra),
    /// Leaky bucket queue (shaper).
    Shaper(Shaper),
    /// Concurrency leases.
    Concurrency(Concurrency),
}

/// The state of one key under any algorithm.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum State {
    /// Fixed window.
    FixedWindow(fixed_window::State),
    /// Sliding window log (boxed: it grows with the limit).
    SlidingLog(Box<sliding_log::State>),
    /// Sliding window counter.
    SlidingWindow(sliding_window::State),
    /// Token bucket.
    TokenBucket(token_bucket::State),
    /// Leaky bucket meter.
    LeakyBucket(leaky_bucket::State),
    /// GCRA.
    Gcra(gcra::State),
    /// Shaper.
    Shaper(shaper::State),
    /// Concurrency leases.
    Concurrency(concurrency::State),
}

/// Runs `$body` with `$alg` bound to the algorithm and `$st` to the matching state. The callers
/// of the first form have made the state match first (`matching`).
macro_rules! dispatch {
    ($kind:expr, $state:expr, |$alg:ident, $st:ident| $body:expr) => {
        dispatch!($kind, $state, |$alg, $st| $body, _ => {
            unreachable!("state matched to its algorithm by `matching`")
        })
    };
    // `$other` runs for a state of another algorithm.
    ($kind:expr, $state:expr, |$alg:ident, $st:ident| $body:expr, _ => $other:expr) => {
        match ($kind, $state) {
            (Kind::FixedWindow($alg), State::FixedWindow($st)) => $body,
            (Kind::SlidingLog($alg), State::SlidingLog($st)) => $body,
            (Kind::SlidingWindow($alg), State::SlidingWindow($st)) => $body,
            (Kind::TokenBucket($alg), State::TokenBucket($st)) => $body,
            (Kind::LeakyBucket($alg), State::LeakyBucket($st)) => $body,
            (Kind::Gcra($alg), State::Gcra($st)) => $body,
            (Kind::Shaper($alg), State::Shaper($st)) => $body,
            (Kind::Concurrency($alg), State::Concurrency($st)) => $body,
            _ => $other,
        }
    };
}

impl Kind {
    /// The algorithm's name.
    pub fn algorithm(&self) -> AlgorithmKind {
        match self {
            Kind::FixedWindow(_) => AlgorithmKind::FixedWindow,
            Kind::SlidingLog(_) => AlgorithmKind::SlidingLog,
            Kind::SlidingWindow(_) => AlgorithmKind::SlidingWindow,
            Kind::TokenBucket(_) => AlgorithmKind::TokenBucket,
            Kind::LeakyBucket(_) => AlgorithmKind::LeakyBucket,
            Kind::Gcra(_) => AlgorithmKind::Gcra,
            Kind::Shaper(_) => AlgorithmKind::Shaper,
            Kind::Concurrency(_) => AlgorithmKind::Concurrency,
        }
    }

    /// A fresh state for this algorithm.
    pub fn fresh(&self) -> State {
        match self {
            Kind::FixedWindow(a) => State::FixedWindow(a.fresh()),
            Kind::SlidingLog(a) => State::SlidingLog(Box::new(a.fresh())),
            Kind::SlidingWindow(a) => State::SlidingWindow(a.fresh()),
            Kind::TokenBucket(a) => State::TokenBucket(a.fresh()),
            Kind::LeakyBucket(a) => State::LeakyBucket(a.fresh()),
            Kind::Gcra(a) => State::Gcra(a.fresh()),
            Kind::Shaper(a) => State::Shaper(a.fresh()),
            Kind::Concurrency(a) => State::Concurrency(a.fresh()),
        }
    }

    /// Whether `state` belongs to this algorithm.
    #[inline]
    pub fn matches(&self, state: &State) -> bool {
        matches!(
            (self, state),
            (Kind::FixedWindow(_), State::FixedWindow(_))
                | (Kind::SlidingLog(_), State::SlidingLog(_))
                | (Kind::SlidingWindow(_), State::SlidingWindow(_))
                | (Kind::TokenBucket(_), State::TokenBucket(_))
                | (Kind::LeakyBucket(_), State::LeakyBucket(_))
                | (Kind::Gcra(_), State::Gcra(_))
                | (Kind::Shaper(_), State::Shaper(_))
                | (Kind::Concurrency(_), State::Concurrency(_))
        )
    }

    /// Replaces a state of another algorithm by a fresh one.
    fn matching<'s>(&self, state: &'s mut State) -> &'s mut State {
        if !self.matches(state) {
            *state = self.fresh();
        }
        state
    }

    /// See [`Algorithm::decide`]. A state of another algorithm counts as fresh.
    pub fn decide(&self, state: &State, ctx: &Ctx) -> Outcome {
        if !self.matches(state) {
            return self.decide(&self.fresh(), ctx);
        }
        dispatch!(self, state, |a, s| a.decide(s, ctx))
    }

    /// See [`Algorithm::commit`]. A peek (cost 0) changes nothing.
    pub fn commit(&self, state: &mut State, ctx: &Ctx) {
        if ctx.cost == 0 {
            return;
        }
        let state = self.matching(state);
        dispatch!(self, state, |a, s| a.commit(s, ctx))
    }

    /// See [`Algorithm::check`].
    pub fn check(&self, state: &mut State, ctx: &Ctx) -> Outcome {
        let state = self.matching(state);
        dispatch!(self, state, |a, s| a.check(s, ctx))
    }

    /// See [`Algorithm::undo`]. A state of another algorithm is left alone (it holds nothing
    /// of this policy's).
    pub fn undo(&self, state: &mut State, undo: &Undo) -> bool {
        dispatch!(self, state, |a, s| a.undo(s, undo), _ => false)
    }

    /// [`Kind::check`] and, when allowed, [`Kind::expires_at`] of the new state, in one
    /// dispatch (the in-memory hot path). `expires_at` is written only when allowed.
    #[inline]
    pub(crate) fn check_expiring(
        &self,
        state: &mut State,
        ctx: &Ctx,
        expires_at: &mut u64,
    ) -> Outcome {
        dispatch!(self, &mut *state, |a, s| check_expiring(a, s, ctx, expires_at), _ => {
            *state = self.fresh();
            self.check_expiring_fresh(state, ctx, expires_at)
        })
    }

    #[cold]
    fn check_expiring_fresh(&self, state: &mut State, ctx: &Ctx, expires_at: &mut u64) -> Outcome {
        dispatch!(self, state, |a, s| check_expiring(a, s, ctx, expires_at))
    }

    /// See [`Algorithm::expires_at`].
    pub fn expires_at(&self, state: &State) -> u64 {
        if !self.matches(state) {
            return 0;
        }
        dispatch!(self, state, |a, s| a.expires_at(s))
    }

    /// The most units admitted at once (for the shaper, without waiting).
    pub fn limit(&self) -> u64 {
        match self {
            Kind::FixedWindow(a) => a.limit(),
            Kind::SlidingLog(a) => a.limit(),
            Kind::SlidingWindow(a) => a.limit(),
            Kind::TokenBucket(a) => a.capacity(),
            Kind::LeakyBucket(a) => a.capacity(),
            Kind::Gcra(a) => a.limit(),
            Kind::Shaper(a) => a.burst(),
            Kind::Concurrency(a) => a.limit(),
        }
    }

    /// The time over which [`Kind::limit`] units are granted, for quota headers: the window,
    /// or the time to refill or drain completely. `None` for concurrency limits.
    pub fn window(&self) -> Option<Duration> {
        let us = match self {
            Kind::FixedWindow(a) => match a.window() {
                Window::Rolling(w) => w,
                // Not the bounds of some window: those of 1970's first are cut at the epoch.
                Window::Calendar(c) => c.nominal_us(),
            },
            Kind::SlidingLog(a) => a.window_us(),
            Kind::SlidingWindow(a) => a.window_us(),
            // In u128: capacity × interval can pass u64 (10,000,000 per 4 weeks). A refill at
            // once of more than the bucket fills it in one interval, not a fraction of one.
            Kind::TokenBucket(a) => {
                let amount = if a.is_greedy() {
                    a.amount()
                } else {
                    a.amount().min(a.capacity())
                };
                u64::try_from(
                    u128::from(a.capacity()) * u128::from(a.interval_us()) / u128::from(amount),
                )
                .unwrap_or(u64::MAX)
            }
            Kind::LeakyBucket(a) => a.unit_us() * a.capacity(),
            Kind::Gcra(a) => a.tolerance_us(),
            Kind::Shaper(a) => a.interval_us() * a.burst(),
            Kind::Concurrency(_) => return None,
        };
        Some(Duration::from_micros(us))
    }
}

/// One algorithm's check and, when allowed, the new state's expiry: small and monomorphic, so
/// that the dispatch around it stays small too.
#[inline(never)]
fn check_expiring<A: Algorithm>(
    alg: &A,
    state: &mut A::State,
    ctx: &Ctx,
    expires_at: &mut u64,
) -> Outcome {
    let out = alg.check(state, ctx);
    if out.decision.allowed {
        *expires_at = alg.expires_at(state);
    }
    out
}

/// A named, validated rate-limiting policy.
///
/// The name identifies the policy's state: two policies with the same algorithm and name share
/// counters for the same key (that is how several replicas agree). It defaults to a canonical
/// spelling of the parameters, such as `gcra-20-per-1m`, and must be a lowercase token
/// (`a-z 0-9 _ - . *`, starting with a letter) so that it is safe in Redis keys and in the
/// `RateLimit-Policy` header.
///
/// Name each distinct limit with [`Policy::named`] when its state lives in a shared store
/// (Redis): two limits with equal parameters and the canonical name (`/login` and `/search`,
/// each 20 per minute per IP) share one counter per key there, and changing a policy's
/// parameters changes its canonical name, so its state starts over and, during a rolling
/// deploy, old and new replicas count apart. A chosen name keeps both apart and stable.
///
/// ```
/// use std::time::Duration;
/// use floodgate_core::Policy;
///
/// # fn main() -> Result<(), floodgate_core::PolicyError> {
/// let per_ip = Policy::per_minute(20)?;                          // GCRA, bursts of 20
/// let phone = Policy::funnel(1, Duration::from_secs(30 * 60))?;  // one per 30 minutes
/// let parsed: Vec<Policy> = Policy::parse_many("5/2s; calendar:10/day@+08:00")?;
/// assert_eq!(parsed.len(), 2);
/// assert_eq!(per_ip.limit(), 20);
/// assert_eq!(phone.name(), "funnel-1-drain-30m");
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Policy {
    name: Arc<str>,
    kind: Kind,
    ident: u32,
}

impl PartialEq for Policy {
    fn eq(&self, other: &Self) -> bool {
        self.kind == other.kind && self.name == other.name
    }
}

impl Eq for Policy {}

impl Hash for Policy {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.name.hash(state);
        self.kind.hash(state);
    }
}

impl fmt::Debug for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Policy")
            .field("name", &self.name)
            .field("kind", &self.kind)
            .finish()
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

impl Policy {
    /// A policy of `kind` with its canonical name.
    pub fn new(kind: Kind) -> Self {
        let name: Arc<str> = canonical_name(&kind).into();
        Policy::with_name(kind, name)
    }

    fn with_name(kind: Kind, name: Arc<str>) -> Self {
        let ident = identity(kind.algorithm(), &name);
        Policy { name, kind, ident }
    }

    /// The same policy under another name (see the type's docs for the rules).
    pub fn named(self, name: &str) -> Result<Self, PolicyError> {
        validate_name(name)?;
        Ok(Policy::with_name(self.kind, name.into()))
    }

    /// The policy's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The algorithm and its parameters.
    pub fn kind(&self) -> &Kind {
        &self.kind
    }

    /// The algorithm's name.
    pub fn algorithm(&self) -> AlgorithmKind {
        self.kind.algorithm()
    }

    /// The most units admitted at once.
    pub fn limit(&self) -> u64 {
        self.kind.limit()
    }

    /// The quota's time window (see [`Kind::window`]).
    pub fn window(&self) -> Option<Duration> {
        self.kind.window()
    }

    /// A small number for the algorithm and name: the identity of this policy's state in memory
    /// (the same for equal names within a process; not stable across processes).
    pub fn ident(&self) -> u32 {
        self.ident
    }

    // ---- constructors that read like the sentence --------------------------------------

    /// `n` per second: GCRA, `n` at once, then one every `1/n` s.
    pub fn per_second(n: u64) -> Result<Self, PolicyError> {
        Self::per(n, Duration::from_secs(1))
    }

    /// `n` per minute: GCRA, `n` at once, then one every `60/n` s.
    pub fn per_minute(n: u64) -> Result<Self, PolicyError> {
        Self::per(n, Duration::from_secs(60))
    }

    /// `n` per hour: GCRA, `n` at once, then one every `3600/n` s.
    pub fn per_hour(n: u64) -> Result<Self, PolicyError> {
        Self::per(n, Duration::from_secs(3_600))
    }

    /// `n` per day: GCRA, `n` at once, then one every `86400/n` s.
    pub fn per_day(n: u64) -> Result<Self, PolicyError> {
        Self::per(n, Duration::from_secs(86_400))
    }

    /// `n` per `period`: GCRA with bursts of `n` (change with [`Policy::with_burst`]).
    ///
    /// Over any window of length `period` at most `2n - 1` pass (a full burst, then the
    /// refill); use [`Policy::sliding_log`] for "never more than `n` in any `period`".
    pub fn per(n: u64, period: Duration) -> Result<Self, PolicyError> {
        if n == 0 {
            return Err(PolicyError::Zero { field: "count" });
        }
        Ok(Policy::new(Kind::Gcra(Gcra::spread(n - 1, n, period)?)))
    }

    /// `rate` per `period`, where `rate` may be fractional (`0.5` per second): GCRA with
    /// bursts of `max(1, floor(rate))`.
    pub fn rate(rate: f64, period: Duration) -> Result<Self, PolicyError> {
        if !rate.is_finite() || rate <= 0.0 {
            return Err(PolicyError::NotPositive {
                field: "rate",
                value: rate,
            });
        }
        if period.is_zero() {
            return Err(PolicyError::Zero { field: "period" });
        }
        // Rounded up, as `per`: never more than `rate` per `period` after the burst (below one
        // microsecond it is refused). From the period's nanoseconds, not its whole
        // microseconds, which would round a 1.999 us period down to 1 (twice the rate).
        let exact = period.as_nanos() as f64 / 1_000.0 / rate;
        let emission = if exact < 1.0 { 0.0 } else { exact.ceil() };
        if emission > MAX_SPAN_US as f64 {
            return Err(PolicyError::TooLarge {
                field: "period",
                value: format!("{period:?} / {rate}"),
                max: format!("{MAX_SPAN_US}us between requests"),
            });
        }
        let burst = (rate.floor() as u64).max(1);
        Ok(Policy::new(Kind::Gcra(Gcra::from_emission(
            burst - 1,
            emission as u64,
            "rate",
        )?)))
    }

    /// redis-cell's `CL.THROTTLE key max_burst count period`.
    pub fn gcra(max_burst: u64, count: u64, period: Duration) -> Result<Self, PolicyError> {
        Ok(Policy::new(Kind::Gcra(Gcra::new(
            max_burst, count, period,
        )?)))
    }

    /// A funnel (leaky bucket meter) of `capacity` that drains completely in `drain`.
    pub fn funnel(capacity: u64, drain: Duration) -> Result<Self, PolicyError> {
        Ok(Policy::new(Kind::LeakyBucket(LeakyBucket::new(
            capacity, drain,
        )?)))
    }

    /// A token bucket of `capacity`, refilled continuously at `amount` per `interval`.
    pub fn token_bucket(
        capacity: u64,
        amount: u64,
        interval: Duration,
    ) -> Result<Self, PolicyError> {
        Ok(Policy::new(Kind::TokenBucket(TokenBucket::new(
            capacity, amount, interval,
        )?)))
    }

    /// A token bucket of `capacity` that gets `amount` tokens at once every `interval`.
    pub fn token_bucket_intervally(
        capacity: u64,
        amount: u64,
        interval: Duration,
    ) -> Result<Self, PolicyError> {
        Ok(Policy::new(Kind::TokenBucket(TokenBucket::intervally(
            capacity, amount, interval,
        )?)))
    }

    /// `limit` per fixed window of `window`, opening at the first request.
    pub fn fixed_window(limit: u64, window: Duration) -> Result<Self, PolicyError> {
        Ok(Policy::new(Kind::FixedWindow(FixedWindow::rolling(
            limit, window,
        )?)))
    }

    /// `limit` per `n` calendar `unit`s, in UTC (see [`Policy::with_utc_offset`]).
    pub fn calendar_window(limit: u64, n: u32, unit: CalendarUnit) -> Result<Self, PolicyError> {
        Ok(Policy::new(Kind::FixedWindow(FixedWindow::calendar(
            limit,
            Calendar::new(n, unit)?,
        )?)))
    }

    /// At most `limit` in any window of `window` (exact; memory grows with the limit).
    pub fn sliding_log(limit: u64, window: Duration) -> Result<Self, PolicyError> {
        Ok(Policy::new(Kind::SlidingLog(SlidingLog::new(
            limit, window,
        )?)))
    }

    /// About `limit` in any window of `window` (two counters; O(1) memory).
    pub fn sliding_window(limit: u64, window: Duration) -> Result<Self, PolicyError> {
        Ok(Policy::new(Kind::SlidingWindow(SlidingWindow::new(
            limit, window,
        )?)))
    }

    /// A shaper: `count` per `period`, evenly spaced; callers wait for their turn.
    pub fn shaper(count: u64, period: Duration) -> Result<Self, PolicyError> {
        Ok(Policy::new(Kind::Shaper(Shaper::new(count, period, 1)?)))
    }

    /// At most `limit` in flight; leases lapse after `lease_ttl`.
    pub fn concurrency(limit: u64, lease_ttl: Duration) -> Result<Self, PolicyError> {
        Ok(Policy::new(Kind::Concurrency(Concurrency::new(
            limit, lease_ttl,
        )?)))
    }

    // ---- modifiers -----------------------------------------------------------------------

    /// Sets how many are admitted at once: GCRA's `max_burst + 1`, the shaper's burst, the
    /// token bucket's capacity. The rate is unchanged. Keeps a custom name; a canonical name is
    /// recomputed.
    pub fn with_burst(self, burst: u64) -> Result<Self, PolicyError> {
        if burst == 0 {
            return Err(PolicyError::Zero { field: "burst" });
        }
        let kind = match self.kind {
            Kind::Gcra(g) => Kind::Gcra(Gcra::from_emission(burst - 1, g.emission_us(), "burst")?),
            Kind::Shaper(s) => {
                let period = Duration::from_micros(s.interval_us());
                Kind::Shaper(Shaper::new(1, period, burst)?)
            }
            Kind::TokenBucket(t) => {
                let interval = Duration::from_micros(t.interval_us());
                Kind::TokenBucket(if t.is_greedy() {
                    TokenBucket::new(burst, t.amount(), interval)?
                } else {
                    TokenBucket::intervally(burst, t.amount(), interval)?
                })
            }
            other => {
                return Err(PolicyError::NotApplicable {
                    field: "burst",
                    algorithm: other.algorithm().as_str(),
                });
            }
        };
        Ok(self.rebuild(kind))
    }

    /// Moves a calendar window to a UTC offset, in seconds east of UTC.
    pub fn with_utc_offset(self, offset_secs: i32) -> Result<Self, PolicyError> {
        let kind = match self.kind {
            Kind::FixedWindow(fw) => match fw.window() {
                Window::Calendar(c) => Kind::FixedWindow(FixedWindow::calendar(
                    fw.limit(),
                    c.with_utc_offset(offset_secs)?,
                )?),
                Window::Rolling(_) => {
                    return Err(PolicyError::NotApplicable {
                        field: "utc_offset",
                        algorithm: "rolling fixed_window",
                    });
                }
            },
            other => {
                return Err(PolicyError::NotApplicable {
                    field: "utc_offset",
                    algorithm: other.algorithm().as_str(),
                });
            }
        };
        Ok(self.rebuild(kind))
    }

    fn rebuild(self, kind: Kind) -> Self {
        if *self.name == *canonical_name(&self.kind) {
            Policy::new(kind)
        } else {
            Policy::with_name(kind, self.name)
        }
    }

    /// Parses several policies separated by `;` (see [`Policy::from_str`] for one).
    pub fn parse_many(input: &str) -> Result<Vec<Self>, PolicyError> {
        let items: Vec<&str> = input
            .split([';', '\n'])
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        if items.is_empty() {
            return Err(PolicyError::Parse {
                input: input.into(),
                reason: "no policy given".into(),
            });
        }
        items.into_iter().map(str::parse).collect()
    }
}

/// The in-memory identity of a policy's state: a small number, the same for every policy of
/// the same algorithm and name in this process (0 is never used: the lock and cache stores use
/// it). Interned rather than hashed so two policies can never share state by accident.
fn identity(algorithm: AlgorithmKind, name: &str) -> u32 {
    type Idents = HashMap<(AlgorithmKind, Box<str>), u32>;
    static IDENTS: LazyLock<Mutex<Idents>> = LazyLock::new(|| Mutex::new(HashMap::new()));
    let mut idents = IDENTS.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(id) = idents.get(&(algorithm, Box::from(name))) {
        return *id;
    }
    let id = u32::try_from(idents.len() + 1).unwrap_or(u32::MAX);
    idents.insert((algorithm, name.into()), id);
    id
}

fn validate_name(name: &str) -> Result<(), PolicyError> {
    let bad = |reason: &str| PolicyError::Invalid {
        field: "name",
        reason: format!("{name:?} {reason}"),
    };
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return Err(bad(&format!("must be 1 to {MAX_NAME_LEN} characters")));
    }
    let first_ok = name.starts_with(|c: char| c.is_ascii_lowercase() || c == '*');
    let rest_ok = name.chars().all(|c| {
        c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '_' | '-' | '.' | '*')
    });
    if !first_ok || !rest_ok {
        return Err(bad(
            "must start with a lowercase letter and hold only a-z, 0-9, _ - . *",
        ));
    }
    Ok(())
}

/// `30m`, `1d`, `1500ms`: the largest unit that divides the duration.
pub(crate) fn short_duration(us: u64) -> String {
    const UNITS: [(u64, &str); 6] = [
        (86_400_000_000, "d"),
        (3_600_000_000, "h"),
        (60_000_000, "m"),
        (1_000_000, "s"),
        (1_000, "ms"),
        (1, "us"),
    ];
    for (size, suffix) in UNITS {
        if us >= size && us.is_multiple_of(size) {
            return format!("{}{suffix}", us / size);
        }
    }
    "0us".into()
}

fn canonical_name(kind: &Kind) -> String {
    let d = short_duration;
    match kind {
        Kind::Gcra(g) => format!("gcra-{}-per-{}", g.limit(), d(g.tolerance_us())),
        Kind::LeakyBucket(f) => format!(
            "funnel-{}-drain-{}",
            f.capacity(),
            d(f.unit_us() * f.capacity())
        ),
        Kind::TokenBucket(t) => format!(
            "token-{}-refill-{}-per-{}{}",
            t.capacity(),
            t.amount(),
            d(t.interval_us()),
            if t.is_greedy() { "" } else { "-intervally" }
        ),
        Kind::FixedWindow(fw) => match fw.window() {
            Window::Rolling(w) => format!("fixed-{}-per-{}", fw.limit(), d(w)),
            Window::Calendar(c) => {
                let off = c.utc_offset_secs();
                let zone = if off == 0 {
                    String::new()
                } else {
                    let sign = if off < 0 { "-" } else { "" };
                    let a = off.unsigned_abs();
                    format!("-utc{sign}{:02}{:02}", a / 3600, a % 3600 / 60)
                };
                format!("calendar-{}-per-{}{}{zone}", fw.limit(), c.n(), c.unit())
            }
        },
        Kind::SlidingLog(l) => format!("log-{}-per-{}", l.limit(), d(l.window_us())),
        Kind::SlidingWindow(s) => format!("sliding-{}-per-{}", s.limit(), d(s.window_us())),
        Kind::Shaper(s) => format!("shaper-{}-every-{}", s.burst(), d(s.interval_us())),
        Kind::Concurrency(c) => format!("concurrency-{}-ttl-{}", c.limit(), d(c.lease_ttl_us())),
    }
}
