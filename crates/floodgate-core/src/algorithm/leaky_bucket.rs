//! Leaky bucket as a meter: the "funnel" of the original SMS article.
//!
//! A funnel holds `capacity` units of water and drains completely in `drain` time. Each request
//! pours its cost in; it is admitted only if the water fits. "One SMS per phone per 30 minutes"
//! is `funnel(1, 30 min)`.
//!
//! The funnel is built from capacity and drain time rather than a rate because `1 / 1800` per
//! second is awkward to write and to store. Its schedule is GCRA's with
//! `max_burst = capacity - 1, count = capacity, period = drain`, so it admits exactly what that
//! GCRA admits from any state, also when the clock steps back and with refunds: the funnel is
//! empty at `at + level`, GCRA's tat, and water that would take more than twice a full
//! funnel's drain time reads as none, as GCRA reads a tat that far ahead. The state is the
//! water level and the time it was measured, as in the article.

use std::time::Duration;

use super::gcra::{Gcra, spaced};
use super::{Algorithm, Ctx, Outcome, Undo, mul_span};
use crate::clock::period_micros;
use crate::error::PolicyError;

/// Funnel parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LeakyBucket {
    capacity: u64,
    /// Time for one unit to drain, microseconds.
    unit: u64,
    /// Drain time of a full funnel (`unit * capacity`), microseconds.
    full: u64,
}

/// The funnel's water: `level` microseconds of draining left, measured at `at`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct State {
    /// Water in the funnel, as the time it takes to drain, in microseconds.
    pub level: u64,
    /// When `level` was measured.
    pub at: u64,
}

impl LeakyBucket {
    /// A funnel of `capacity` units that drains completely in `drain`.
    pub fn new(capacity: u64, drain: Duration) -> Result<Self, PolicyError> {
        if capacity == 0 {
            return Err(PolicyError::Zero { field: "capacity" });
        }
        let drain_us = period_micros(drain);
        if drain_us == 0 {
            return Err(PolicyError::Zero { field: "drain" });
        }
        // Validation and limits are GCRA's: same schedule.
        // Rounded up: a full funnel takes at least `drain` to empty, never less.
        let g = Gcra::from_emission(capacity - 1, spaced(drain_us, capacity), "drain")?;
        Ok(LeakyBucket {
            capacity,
            unit: g.emission_us(),
            full: g.tolerance_us(),
        })
    }

    /// The funnel's capacity.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Microseconds for one unit to drain.
    pub fn unit_us(&self) -> u64 {
        self.unit
    }

    /// Units of water in the funnel at `now` (fractional).
    pub fn level(&self, state: &State, now: u64) -> f64 {
        self.drained(state, now) as f64 / self.unit as f64
    }

    /// The water at `now`, as the time it takes to drain: the funnel is empty at `at + level`
    /// (GCRA's tat), also when that was measured ahead of the clock (it stepped back). Water
    /// that would take more than twice a full funnel's drain time reads as none, as GCRA reads
    /// a tat that far ahead.
    fn drained(&self, state: &State, now: u64) -> u64 {
        let left = state.at.saturating_add(state.level).saturating_sub(now);
        // `full` is at most MAX_SPAN_US (2^51): no overflow.
        if left > 2 * self.full {
            return 0;
        }
        left
    }
}

impl Algorithm for LeakyBucket {
    type State = State;

    fn fresh(&self) -> State {
        State::default()
    }

    fn decide(&self, state: &State, ctx: &Ctx) -> Outcome {
        let level = self.drained(state, ctx.now);
        let pour = mul_span(self.unit, ctx.cost);
        let (allowed, after, retry) = match pour {
            Some(p) if level + p <= self.full => (true, level + p, None),
            Some(p) if p <= self.full => (false, level, Some(level + p - self.full)),
            _ => (false, level, None),
        };
        // A level above full (poured under a larger capacity) leaves nothing.
        let remaining = self.full.saturating_sub(after) / self.unit;
        Outcome::new(allowed, self.capacity, remaining, retry, after)
    }

    fn commit(&self, state: &mut State, ctx: &Ctx) {
        let level = self.drained(state, ctx.now);
        state.level = level.saturating_add(self.unit.saturating_mul(ctx.cost));
        state.at = ctx.now;
    }

    fn undo(&self, state: &mut State, undo: &Undo) -> bool {
        // As GCRA's: the check's outstanding share comes off the end of the water (the tat),
        // never before the check's time; measured from the earlier of `at` and that time, so a
        // later check's water (made before a step back) stays.
        let share = self.unit.saturating_mul(undo.cost);
        let tat = state
            .at
            .saturating_add(state.level)
            .saturating_sub(undo.outstanding(share))
            .max(undo.at);
        state.at = state.at.min(undo.at);
        state.level = tat - state.at;
        true
    }

    fn expires_at(&self, state: &State) -> u64 {
        // GCRA's tat. A refund measures the water from no later than the check's time, so a
        // funnel it empties expires by the refund's time and is dropped, as Redis deletes it.
        state.at.saturating_add(state.level)
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_level_above_full_leaves_nothing() {
        // Poured under a larger capacity (a policy changed under the same name), up to twice
        // this one's: denied until it drains. Further, it reads as none, as GCRA's tat.
        let b = LeakyBucket::new(2, Duration::from_secs(2)).expect("valid");
        let t0 = 1_700_000_000_000_000;
        let mut st = State {
            level: 4 * b.unit_us(),
            at: t0,
        };
        let d = b.check(&mut st, &Ctx::new(t0, 1)).decision;
        assert!(!d.allowed);
        assert_eq!(d.remaining, 0);
        assert_eq!(b.check(&mut st, &Ctx::new(t0, 0)).decision.remaining, 0);
        let mut st = State {
            level: 4 * b.unit_us() + 1,
            at: t0,
        };
        assert!(b.check(&mut st, &Ctx::new(t0, 2)).decision.allowed);
    }
    use super::*;

    #[test]
    fn a_state_ahead_of_the_clock_drains_from_its_tat_or_reads_as_empty() {
        let f = LeakyBucket::new(2, Duration::from_secs(2)).expect("valid");
        let t0 = 1_700_000_000_000_000;
        let s = 1_000_000;
        // Half a second ahead, half a unit in: empty at t0 + 1s, one unit of room now (a
        // second of water, where the old reading kept half a second and no drain).
        let ahead = State {
            level: s / 2,
            at: t0 + s / 2,
        };
        let d = f.decide(&ahead, &Ctx::new(t0, 2)).decision;
        assert!(!d.allowed);
        assert_eq!(d.retry_after, Some(Duration::from_secs(1)));
        let mut st = ahead;
        let d = f.check(&mut st, &Ctx::new(t0, 1)).decision;
        assert!(d.allowed);
        assert_eq!(d.reset_after, Duration::from_secs(2));
        // Measured from now: it drains from here on.
        assert_eq!(
            st,
            State {
                level: 2 * s,
                at: t0
            }
        );
        assert!(!f.check(&mut st, &Ctx::new(t0 + s / 2, 1)).decision.allowed);
        assert!(f.check(&mut st, &Ctx::new(t0 + s, 1)).decision.allowed);
        // Empty more than twice a full funnel's drain time from now: it reads as empty.
        for at in [t0 + 3 * s + 1, t0 + 3_600 * s, u64::MAX / 2] {
            let mut st = State { level: s, at };
            let d = f.check(&mut st, &Ctx::new(t0, 2)).decision;
            assert!(d.allowed, "{at}");
            assert_eq!(
                st,
                State {
                    level: 2 * s,
                    at: t0
                }
            );
        }
        // At the bound (empty twice a full drain time from now), it still counts: waited out.
        let st = State {
            level: s,
            at: t0 + 3 * s,
        };
        let d = f.decide(&st, &Ctx::new(t0, 1)).decision;
        assert!(!d.allowed);
        assert_eq!(d.retry_after, Some(Duration::from_secs(3)));
    }

    #[test]
    fn one_per_thirty_minutes() {
        let f = LeakyBucket::new(1, Duration::from_secs(1800)).expect("valid");
        let mut st = f.fresh();
        let t0 = 1_700_000_000_000_000;
        let first = f.check(&mut st, &Ctx::new(t0, 1)).decision;
        assert!(first.allowed);
        assert_eq!((first.limit, first.remaining), (1, 0));
        assert_eq!(first.reset_after, Duration::from_secs(1800));
        let second = f.check(&mut st, &Ctx::new(t0 + 60_000_000, 1)).decision;
        assert!(!second.allowed);
        assert_eq!(second.retry_after, Some(Duration::from_secs(1740)));
        assert!((f.level(&st, t0 + 900_000_000) - 0.5).abs() < 1e-9);
        assert!(
            f.check(&mut st, &Ctx::new(t0 + 1_800_000_000, 1))
                .decision
                .allowed
        );
    }

    #[test]
    fn validates() {
        assert!(matches!(
            LeakyBucket::new(0, Duration::from_secs(1)),
            Err(PolicyError::Zero { field: "capacity" })
        ));
        assert!(matches!(
            LeakyBucket::new(1, Duration::ZERO),
            Err(PolicyError::Zero { field: "drain" })
        ));
        assert!(LeakyBucket::new(10, Duration::from_micros(5)).is_err());
    }
}
