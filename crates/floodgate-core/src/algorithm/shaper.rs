//! Leaky bucket as a queue (a shaper): requests are spaced out instead of turned away.
//!
//! Requests leave at a steady rate, one every `interval`, with up to `burst` leaving at once.
//! A request that arrives early *reserves* the next free slot on that schedule and waits for
//! it, as Guava's `RateLimiter.acquire()` and nginx's `limit_req ... delay` do, provided the
//! wait is no longer than the caller's `max_wait`; otherwise it is denied and reserves nothing.
//! With `max_wait = 0` this is [`super::gcra::Gcra`] with `max_burst = burst - 1`, except on a
//! state more than twice the tolerance ahead of `now`, which GCRA reads as none: a shaper's
//! queue legitimately runs as far ahead as its callers' `max_wait`, so no bound tells such a
//! state apart here.

use std::time::Duration;

use super::gcra::{Gcra, spaced};
use super::{Algorithm, Ctx, MAX_SPAN_US, Outcome, Undo, mul_span};
use crate::clock::period_micros;
use crate::error::PolicyError;

/// Shaper parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shaper {
    /// Microseconds between departures.
    interval: u64,
    /// Departures allowed at once.
    burst: u64,
    /// `interval * burst`.
    tolerance: u64,
}

/// The shaper's schedule: the time the next request would leave, were there no burst.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct State {
    /// Theoretical arrival time of the next request.
    pub tat: u64,
}

impl Shaper {
    /// `count` requests per `period`, evenly spaced, `burst` of them at once (at least 1).
    pub fn new(count: u64, period: Duration, burst: u64) -> Result<Self, PolicyError> {
        if count == 0 {
            return Err(PolicyError::Zero { field: "count" });
        }
        if burst == 0 {
            return Err(PolicyError::Zero { field: "burst" });
        }
        let period_us = period_micros(period);
        if period_us == 0 {
            return Err(PolicyError::Zero { field: "period" });
        }
        // Rounded up: never more than `count` departures per `period` after the burst.
        let g = Gcra::from_emission(burst - 1, spaced(period_us, count), "period")?;
        Ok(Shaper {
            interval: g.emission_us(),
            burst,
            tolerance: g.tolerance_us(),
        })
    }

    /// Microseconds between departures.
    pub fn interval_us(&self) -> u64 {
        self.interval
    }

    /// Requests that leave at once.
    pub fn burst(&self) -> u64 {
        self.burst
    }

    /// How many requests a caller willing to wait `max_wait` can have admitted at once.
    pub fn limit(&self, max_wait: u64) -> u64 {
        self.burst + max_wait.min(MAX_SPAN_US) / self.interval
    }
}

impl Algorithm for Shaper {
    type State = State;

    fn fresh(&self) -> State {
        State::default()
    }

    fn decide(&self, state: &State, ctx: &Ctx) -> Outcome {
        let now = ctx.now;
        let max_wait = ctx.max_wait.min(MAX_SPAN_US);
        let horizon = self.tolerance + max_wait;
        let limit = self.limit(max_wait);
        let tat = state.tat.max(now);
        let increment = mul_span(self.interval, ctx.cost);
        let Some(new_tat) = increment.map(|inc| tat + inc) else {
            let remaining = horizon.saturating_sub(tat - now) / self.interval;
            return Outcome::new(false, limit, remaining, None, tat - now);
        };
        let wait = (new_tat - now).saturating_sub(self.tolerance);
        if wait <= max_wait {
            let remaining = horizon.saturating_sub(new_tat - now) / self.interval;
            let mut out = Outcome::new(true, limit, remaining, None, new_tat - now);
            out.wait = wait;
            out
        } else {
            let fits = increment.is_some_and(|inc| inc <= horizon);
            let retry = fits.then_some(wait - max_wait);
            let remaining = horizon.saturating_sub(tat - now) / self.interval;
            Outcome::new(false, limit, remaining, retry, tat - now)
        }
    }

    fn commit(&self, state: &mut State, ctx: &Ctx) {
        let inc = self.interval.saturating_mul(ctx.cost);
        state.tat = state.tat.max(ctx.now).saturating_add(inc);
    }

    fn undo(&self, state: &mut State, undo: &Undo) -> bool {
        // A reservation with others queued behind it is not given back: the state is one time,
        // and freeing a slot in the middle of the queue would promise it twice.
        if state.tat > undo.at.saturating_add(undo.reset_after) {
            return false;
        }
        let share = self.interval.saturating_mul(undo.cost);
        state.tat = state
            .tat
            .saturating_sub(undo.outstanding(share))
            .max(undo.at);
        true
    }

    fn expires_at(&self, state: &State) -> u64 {
        state.tat
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: u64 = 1_700_000_000_000_000;

    #[test]
    fn spaces_requests_out() {
        // 10 per second, no burst beyond one: one every 100 ms.
        let s = Shaper::new(10, Duration::from_secs(1), 1).expect("valid");
        let mut st = s.fresh();
        let ctx = Ctx {
            max_wait: 350_000,
            ..Ctx::new(T0, 1)
        };
        let waits: Vec<u64> = (0..5)
            .map(|_| {
                let o = s.check(&mut st, &ctx);
                if o.decision.allowed { o.wait } else { u64::MAX }
            })
            .collect();
        assert_eq!(waits, [0, 100_000, 200_000, 300_000, u64::MAX]);
        let denied = s.decide(&st, &ctx).decision;
        assert_eq!(denied.retry_after, Some(Duration::from_millis(50)));
        assert_eq!(denied.limit, 4);
    }

    #[test]
    fn try_acquire_is_gcra() {
        let s = Shaper::new(1, Duration::from_secs(1), 3).expect("valid");
        let g = Gcra::new(2, 1, Duration::from_secs(1)).expect("valid");
        let (mut a, mut b) = (s.fresh(), g.fresh());
        for i in 0..20u64 {
            let ctx = Ctx::new(T0 + i * 300_000, 1 + i % 2);
            assert_eq!(
                s.check(&mut a, &ctx).decision,
                g.check(&mut b, &ctx).decision
            );
        }
    }
}
