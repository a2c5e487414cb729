//! GCRA, the generic cell rate algorithm, exactly as redis-cell's `CL.THROTTLE`.
//!
//! `CL.THROTTLE key max_burst count period quantity` admits `max_burst + 1` requests at once
//! and then one every `period / count`. The whole state is one timestamp, the theoretical
//! arrival time (TAT) of the next request on the nominal schedule.
//!
//! This reproduces redis-cell's reply field for field, at millisecond precision instead of
//! whole seconds: `limit = max_burst + 1`; `remaining` truncates toward zero; `retry_after` is
//! absent when allowed and when the quantity exceeds the limit (it can never fit); a quantity of
//! 0 peeks. The emission interval is truncated to whole microseconds (redis-cell: nanoseconds).
//!
//! One state differs: a TAT more than twice the tolerance ahead of `now` reads as no state
//! (redis-cell denies until it drains). No check leaves a TAT later than `now + tolerance`;
//! one comes from a clock that stepped back (an NTP step, a failover to a Redis replica whose
//! clock is behind), from a policy whose period was cut under the same name, or from someone
//! else's write. Up to twice the tolerance ahead it counts as it stands, so a step back shorter
//! than the tolerance never grants a burst; further ahead, a key would be locked out for as
//! long as the TAT is ahead (for good, given a far-future value with no TTL). The cost is one
//! fresh burst per key each time a step back longer than the tolerance meets it; while two
//! policies of one name with periods more than twice apart run side by side (a rolling
//! deploy), each check of the longer one after a check of the shorter can get one.

use std::fmt;
use std::time::Duration;

use super::{Algorithm, Ctx, MAX_LIMIT, MAX_SPAN_US, Outcome, Undo, mul_span};
use crate::clock::period_micros;
use crate::error::PolicyError;

/// GCRA parameters: an emission interval `T` and a tolerance `tau = T * (max_burst + 1)`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Gcra {
    emission: u64,
    tolerance: u64,
    limit: u64,
    /// `floor((2^64 - 1) / emission)`: divides by the emission interval with a multiply
    /// ([`Gcra::per_emission`]); a hardware division was a tenth of a memory check.
    recip: u64,
}

/// GCRA's state: the theoretical arrival time, microseconds since the epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct State {
    /// Theoretical arrival time of the next request.
    pub tat: u64,
}

/// `count` events spread over `period_us`: the microseconds between them, rounded up so that
/// no more than `count` fit in `period_us`; 0 (refused by the callers) when they would be
/// less than a microsecond apart.
pub(crate) fn spaced(period_us: u64, count: u64) -> u64 {
    if period_us < count {
        0
    } else {
        period_us.div_ceil(count)
    }
}

impl fmt::Debug for Gcra {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Without `recip`, which follows from `emission`.
        f.debug_struct("Gcra")
            .field("emission", &self.emission)
            .field("tolerance", &self.tolerance)
            .field("limit", &self.limit)
            .finish()
    }
}

impl Gcra {
    /// redis-cell's parameters: `max_burst + 1` at once, then `count` per `period`, one every
    /// `period / count` rounded down to the microsecond, as redis-cell rounds (to its
    /// nanosecond): a period that `count` does not divide lets through a little more than
    /// `count` per `period`. [`Gcra::spread`] rounds the other way.
    pub fn new(max_burst: u64, count: u64, period: Duration) -> Result<Self, PolicyError> {
        if count == 0 {
            return Err(PolicyError::Zero { field: "count" });
        }
        let period_us = period_micros(period);
        if period_us == 0 {
            return Err(PolicyError::Zero { field: "period" });
        }
        Self::from_emission(max_burst, period_us / count, "period")
    }

    /// `max_burst + 1` at once, then `count` per `period`, one every `period / count` rounded
    /// up to the microsecond: never more than `count` per `period` after the burst, the promise
    /// of [`Policy::per`](crate::Policy::per) (`per(3, 1 s)` spaces requests 333,334 us apart;
    /// 333,333 would fit a fourth in the second).
    pub fn spread(max_burst: u64, count: u64, period: Duration) -> Result<Self, PolicyError> {
        if count == 0 {
            return Err(PolicyError::Zero { field: "count" });
        }
        let period_us = period_micros(period);
        if period_us == 0 {
            return Err(PolicyError::Zero { field: "period" });
        }
        Self::from_emission(max_burst, spaced(period_us, count), "period")
    }

    /// `max_burst + 1` at once, then one every `emission` microseconds.
    pub(crate) fn from_emission(
        max_burst: u64,
        emission: u64,
        field: &'static str,
    ) -> Result<Self, PolicyError> {
        if emission == 0 {
            return Err(PolicyError::TooSmall {
                field,
                reason: "the interval between requests is below one microsecond".into(),
            });
        }
        let limit =
            max_burst
                .checked_add(1)
                .filter(|l| *l <= MAX_LIMIT)
                .ok_or(PolicyError::TooLarge {
                    field: "max_burst",
                    value: max_burst.to_string(),
                    max: (MAX_LIMIT - 1).to_string(),
                })?;
        let tolerance = mul_span(emission, limit).ok_or(PolicyError::TooLarge {
            field,
            value: format!("{emission}us x {limit}"),
            max: format!("{MAX_SPAN_US}us in all"),
        })?;
        Ok(Gcra {
            emission,
            tolerance,
            limit,
            recip: u64::MAX / emission,
        })
    }

    /// `x / emission`, without a division: `x * recip / 2^64` is the quotient or one less
    /// (`recip * emission` falls short of 2^64 by at most `emission`, so the estimate falls
    /// short of `x / emission` by less than `x / 2^64 < 1`), and one comparison settles it.
    #[inline]
    fn per_emission(&self, x: u64) -> u64 {
        let q = ((u128::from(x) * u128::from(self.recip)) >> 64) as u64;
        // q * emission <= x: no overflow.
        if x - q * self.emission >= self.emission {
            q + 1
        } else {
            q
        }
    }

    /// Where a check at `now` starts the schedule: the stored `tat`, or `now` once it has
    /// passed. No check leaves a `tat` later than `now + tolerance`; one comes from a store
    /// whose clock stepped back, a policy whose burst was cut under the same name, or someone
    /// else's write. Up to twice the tolerance ahead it counts as it stands, so a step back
    /// shorter than the tolerance never grants a burst (one SMS per 30 minutes stays one
    /// across a failover to a server whose clock is a second behind); further ahead it reads
    /// as no state, so a key is never locked out for more than twice what its policy allows,
    /// and the next allowed check writes a state that is.
    #[inline]
    fn start(&self, tat: u64, now: u64) -> u64 {
        if tat.saturating_sub(now) > self.ahead_limit() {
            now
        } else {
            tat.max(now)
        }
    }

    /// How far ahead of the clock a `tat` may be and still count (see `start`).
    #[inline]
    fn ahead_limit(&self) -> u64 {
        // The tolerance is at most MAX_SPAN_US (2^51): no overflow.
        2 * self.tolerance
    }

    /// The emission interval `T` in microseconds.
    pub fn emission_us(&self) -> u64 {
        self.emission
    }

    /// The delay variation tolerance `tau` in microseconds.
    pub fn tolerance_us(&self) -> u64 {
        self.tolerance
    }

    /// `max_burst + 1`.
    pub fn limit(&self) -> u64 {
        self.limit
    }
}

impl Algorithm for Gcra {
    type State = State;

    fn fresh(&self) -> State {
        State::default()
    }

    fn decide(&self, state: &State, ctx: &Ctx) -> Outcome {
        let now = ctx.now;
        let tat = self.start(state.tat, now);
        let increment = mul_span(self.emission, ctx.cost);
        let new_tat = increment.map(|inc| tat + inc);
        let (allowed, ttl, retry) = match new_tat {
            Some(new_tat) if new_tat <= now + self.tolerance => (true, new_tat - now, None),
            Some(new_tat) => {
                let fits = increment.is_some_and(|inc| inc <= self.tolerance);
                let retry = fits.then(|| new_tat - self.tolerance - now);
                (false, tat - now, retry)
            }
            None => (false, tat - now, None),
        };
        let remaining = self.per_emission(self.tolerance.saturating_sub(ttl));
        Outcome::new(allowed, self.limit, remaining, retry, ttl)
    }

    fn commit(&self, state: &mut State, ctx: &Ctx) {
        let inc = self.emission.saturating_mul(ctx.cost);
        // A peek changes nothing: not even a state it reads as none, which another policy of
        // the same name (with a longer period) may still hold as it is.
        if inc > 0 {
            state.tat = self.start(state.tat, ctx.now).saturating_add(inc);
        }
    }

    fn undo(&self, state: &mut State, undo: &Undo) -> bool {
        let share = self.emission.saturating_mul(undo.cost);
        state.tat = state
            .tat
            .saturating_sub(undo.outstanding(share))
            .max(undo.at);
        true
    }

    fn expires_at(&self, state: &State) -> u64 {
        state.tat
    }

    /// Decide and commit in one pass (the hot path of the in-memory store).
    #[inline]
    fn check(&self, state: &mut State, ctx: &Ctx) -> Outcome {
        let now = ctx.now;
        // Not `start`: a tat it would read as none fails the test below whatever the cost, and
        // takes the other path.
        let tat = state.tat.max(now);
        if let Some(inc) = mul_span(self.emission, ctx.cost) {
            let new_tat = tat.saturating_add(inc);
            if new_tat <= now + self.tolerance {
                // A peek changes nothing, not even an expired state: the clock may step back
                // before the next check (see `commit`).
                if inc > 0 {
                    state.tat = new_tat;
                }
                let ttl = new_tat - now;
                let remaining = self.per_emission(self.tolerance - ttl);
                return Outcome::new(true, self.limit, remaining, None, ttl);
            }
        }
        let out = self.decide(state, ctx);
        if out.decision.allowed {
            // Allowed on a tat read as none.
            self.commit(state, ctx);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000;

    #[test]
    fn per_emission_divides_exactly() {
        let mut rng = fastrand::Rng::with_seed(17);
        let mut emissions = vec![1, 2, 3, 7, 10, 999, 1_000, 1_000_003, MAX_SPAN_US];
        emissions.extend((0..2_000).map(|_| rng.u64(1..=MAX_SPAN_US)));
        for _ in 0..2_000 {
            let bits = rng.u32(1..40);
            emissions.push(rng.u64(1..=1 << bits));
        }
        for emission in emissions {
            let g = Gcra::from_emission(0, emission, "test").expect("valid");
            let mut xs = vec![
                0,
                1,
                emission - 1,
                emission,
                emission + 1,
                MAX_SPAN_US,
                u64::MAX,
            ];
            xs.extend((0..50).map(|_| rng.u64(..)));
            xs.extend((0..50).map(|_| rng.u64(0..=MAX_SPAN_US)));
            xs.extend((1..20).map(|k| k * emission - 1));
            for x in xs {
                assert_eq!(g.per_emission(x), x / emission, "{x} / {emission}");
            }
        }
    }

    /// redis-cell's reply: (limited, limit, remaining, retry_after, reset_after).
    type Reply = (bool, u64, u64, Option<u64>, u64);

    fn run(g: &Gcra, st: &mut State, now_ms: u64, q: u64) -> Reply {
        let o = g.check(st, &Ctx::new(1_700_000_000 * S + now_ms * 1000, q));
        let d = o.decision;
        (
            !d.allowed,
            d.limit,
            d.remaining,
            d.retry_after_ms(),
            d.reset_after_ms(),
        )
    }

    /// redis-cell's own unit test table (limit 5, 1 per second), in milliseconds.
    #[test]
    fn matches_redis_cell_table() {
        let g = Gcra::new(4, 1, Duration::from_secs(1)).expect("valid");
        let mut st = g.fresh();
        // (now ms, quantity) => (limited, limit, remaining, retry_after, reset_after)
        let cases: &[(u64, u64, Reply)] = &[
            (0, 6, (true, 5, 5, None, 0)),
            (0, 1, (false, 5, 4, None, 1000)),
            (0, 1, (false, 5, 3, None, 2000)),
            (0, 1, (false, 5, 2, None, 3000)),
            (0, 1, (false, 5, 1, None, 4000)),
            (0, 1, (false, 5, 0, None, 5000)),
            (0, 1, (true, 5, 0, Some(1000), 5000)),
            (3000, 1, (false, 5, 2, None, 3000)),
            (3100, 1, (false, 5, 1, None, 3900)),
            (4000, 1, (false, 5, 1, None, 4000)),
            (8000, 1, (false, 5, 4, None, 1000)),
            (9500, 1, (false, 5, 4, None, 1000)),
            (9500, 0, (false, 5, 4, None, 1000)),
            (9500, 2, (false, 5, 2, None, 3000)),
            (9500, 5, (true, 5, 2, Some(3000), 3000)),
        ];
        for (i, (now, q, want)) in cases.iter().enumerate() {
            assert_eq!(run(&g, &mut st, *now, *q), *want, "case {i}");
        }
    }

    /// redis-cell's README: `CL.THROTTLE user123 15 30 60 1` -> 0 16 15 -1 2.
    #[test]
    fn matches_redis_cell_readme() {
        let g = Gcra::new(15, 30, Duration::from_secs(60)).expect("valid");
        let mut st = g.fresh();
        assert_eq!(run(&g, &mut st, 0, 1), (false, 16, 15, None, 2000));
        // The burst drains: 16 in all at the same instant, then denied for one interval.
        for i in 1..16 {
            assert_eq!(run(&g, &mut st, 0, 1).2, 15 - i);
        }
        assert_eq!(run(&g, &mut st, 0, 1), (true, 16, 0, Some(2000), 32000));
        assert_eq!(run(&g, &mut st, 2000, 1), (false, 16, 0, None, 32000));
    }

    /// A TAT up to `now + tolerance` is one a check may leave, and decides as it stands, as
    /// does one up to twice the tolerance ahead (a clock stepped back a little); a later one (a
    /// clock stepped back further, a cut period, a foreign write) reads as no state, in
    /// `decide`, `check` and `commit` alike.
    #[test]
    fn a_tat_no_check_could_leave_reads_as_no_state() {
        let g = Gcra::new(4, 1, Duration::from_secs(1)).expect("valid");
        let now = 1_700_000_000 * S;
        let ctx = Ctx::new(now, 1);
        let tolerance = g.tolerance_us();
        // Full, to the microsecond: denied, retry after one emission interval.
        let full = State {
            tat: now + tolerance,
        };
        let d = g.decide(&full, &ctx).decision;
        assert!(!d.allowed);
        assert_eq!(d.retry_after_ms(), Some(1000));
        let mut st = full;
        assert!(!g.check(&mut st, &ctx).decision.allowed);
        assert_eq!(st, full, "a denial leaves the state as it was");
        // Ahead of what a check leaves, by up to the tolerance again (a clock stepped back a
        // little): it counts as it stands, the wait included.
        for (tat, retry_ms) in [(now + tolerance + 1, 1001), (now + 2 * tolerance, 6000)] {
            let mut st = State { tat };
            let d = g.check(&mut st, &ctx).decision;
            assert!(!d.allowed, "{tat}");
            assert_eq!(d.retry_after_ms(), Some(retry_ms), "{tat}");
            assert_eq!(st.tat, tat);
        }
        for tat in [
            now + 2 * tolerance + 1,
            now + 3_600 * S,
            (1 << 53) - 1,
            u64::MAX,
        ] {
            let d = g.decide(&State { tat }, &ctx).decision;
            assert!(d.allowed, "{tat}: {d:?}");
            assert_eq!((d.remaining, d.reset_after_ms()), (4, 1000), "{tat}");
            let mut st = State { tat };
            assert!(g.check(&mut st, &ctx).decision.allowed, "{tat}");
            assert_eq!(st.tat, now + g.emission_us(), "{tat}: written as fresh");
            let mut st = State { tat };
            g.commit(&mut st, &ctx);
            assert_eq!(st.tat, now + g.emission_us(), "{tat}: committed as fresh");
            // A peek reads it as none too, and leaves it: a policy of the same name with a
            // longer period may hold it.
            let peek = Ctx::new(now, 0);
            let mut st = State { tat };
            let d = g.check(&mut st, &peek).decision;
            assert_eq!((d.allowed, d.remaining), (true, 5), "{tat}");
            g.commit(&mut st, &peek);
            assert_eq!(st.tat, tat, "a peek changed the state");
        }
        // Nor an expired one: the clock may step back before the next check.
        let mut st = State { tat: now - 1 };
        assert!(g.check(&mut st, &Ctx::new(now, 0)).decision.allowed);
        assert_eq!(st.tat, now - 1, "a peek moved an expired state to now");
    }

    #[test]
    fn rejects_bad_parameters() {
        assert!(matches!(
            Gcra::new(1, 0, Duration::from_secs(1)),
            Err(PolicyError::Zero { field: "count" })
        ));
        assert!(matches!(
            Gcra::new(1, 1, Duration::ZERO),
            Err(PolicyError::Zero { field: "period" })
        ));
        assert!(Gcra::new(1, 2_000_000, Duration::from_secs(1)).is_err());
        assert!(Gcra::new(u64::MAX, 1, Duration::from_secs(1)).is_err());
        assert!(Gcra::new(10, 1, Duration::MAX).is_err());
    }
}
