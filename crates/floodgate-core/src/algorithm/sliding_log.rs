//! Sliding window log: at most `limit` units in *any* window of length `window`.
//!
//! Exact: every admitted request is logged with its time and cost until it leaves the window,
//! so there is no boundary burst. Memory grows with the limit (at most `limit` entries per key);
//! use the sliding window counter when limits are large.

use std::collections::VecDeque;
use std::time::Duration;

use super::{Algorithm, Ctx, MAX_SPAN_US, Outcome, Undo};
use crate::clock::period_micros;
use crate::error::PolicyError;

/// The largest limit a log may have: the log keeps one entry per admitted request.
pub const MAX_LOG_LIMIT: u64 = 100_000;

/// Sliding log parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SlidingLog {
    limit: u64,
    window: u64,
}

/// One logged request: when, and how many units it took.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// When it was admitted, microseconds since the epoch.
    pub at: u64,
    /// Its cost.
    pub cost: u64,
}

/// The log, oldest first (by time, not by order of issue: a clock that steps back logs an
/// entry before later ones). It may hold entries that have already left the window.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct State {
    /// Admitted requests, oldest first.
    pub entries: VecDeque<Entry>,
}

impl SlidingLog {
    /// At most `limit` units in any window of length `window`.
    pub fn new(limit: u64, window: Duration) -> Result<Self, PolicyError> {
        if limit == 0 {
            return Err(PolicyError::Zero { field: "limit" });
        }
        if limit > MAX_LOG_LIMIT {
            return Err(PolicyError::TooLarge {
                field: "limit",
                value: limit.to_string(),
                max: format!("{MAX_LOG_LIMIT} for a sliding log (use sliding_window)"),
            });
        }
        let w = period_micros(window);
        if w == 0 {
            return Err(PolicyError::Zero { field: "window" });
        }
        if w > MAX_SPAN_US {
            return Err(PolicyError::TooLarge {
                field: "window",
                value: format!("{window:?}"),
                max: format!("{MAX_SPAN_US}us"),
            });
        }
        Ok(SlidingLog { limit, window: w })
    }

    /// The limit.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The window, microseconds.
    pub fn window_us(&self) -> u64 {
        self.window
    }

    /// Entries still inside the window at `now`.
    fn live<'a>(&self, state: &'a State, now: u64) -> impl Iterator<Item = &'a Entry> + 'a {
        let window = self.window;
        state.entries.iter().filter(move |e| e.at + window > now)
    }
}

impl Algorithm for SlidingLog {
    type State = State;

    fn fresh(&self) -> State {
        State::default()
    }

    fn decide(&self, state: &State, ctx: &Ctx) -> Outcome {
        let now = ctx.now;
        let used: u64 = self.live(state, now).map(|e| e.cost).sum();
        let newest = self.live(state, now).map(|e| e.at).max();
        let until_gone = |at: u64| (at + self.window).saturating_sub(now);
        // Checked: a cost near u64::MAX must not wrap around to "fits".
        if used.checked_add(ctx.cost).is_some_and(|t| t <= self.limit) {
            // Full again when the newest entry leaves: this check's, or one ahead of the clock
            // (stepped back) that leaves later.
            let ahead = newest.map_or(0, until_gone);
            let reset = if ctx.cost > 0 {
                self.window.max(ahead)
            } else {
                ahead
            };
            return Outcome::new(true, self.limit, self.limit - used - ctx.cost, None, reset);
        }
        let retry = (ctx.cost <= self.limit).then(|| {
            // Wait until enough of the oldest entries have left the window.
            let mut to_free = used + ctx.cost - self.limit;
            let mut at = now;
            for e in self.live(state, now) {
                at = e.at;
                if e.cost >= to_free {
                    break;
                }
                to_free -= e.cost;
            }
            until_gone(at)
        });
        let reset = newest.map_or(0, until_gone);
        Outcome::new(
            false,
            self.limit,
            self.limit - used.min(self.limit),
            retry,
            reset,
        )
    }

    fn commit(&self, state: &mut State, ctx: &Ctx) {
        while state
            .entries
            .front()
            .is_some_and(|e| e.at + self.window <= ctx.now)
        {
            state.entries.pop_front();
        }
        if ctx.cost == 0 {
            return;
        }
        // In time order, which is the order of issue unless the clock stepped back: the oldest
        // entries leave the window first (as the Redis backend's sorted set has them).
        let i = state.entries.partition_point(|e| e.at < ctx.now);
        match state.entries.get_mut(i) {
            Some(e) if e.at == ctx.now => e.cost += ctx.cost,
            _ => state.entries.insert(
                i,
                Entry {
                    at: ctx.now,
                    cost: ctx.cost,
                },
            ),
        }
    }

    fn undo(&self, state: &mut State, undo: &Undo) -> bool {
        // The check's entry: the last one admitted at its time (checks admitted in the same
        // microsecond share one entry).
        if let Some(i) = state.entries.iter().rposition(|e| e.at == undo.at) {
            let entry = &mut state.entries[i];
            entry.cost = entry.cost.saturating_sub(undo.cost);
            if entry.cost == 0 {
                state.entries.remove(i);
            }
        }
        // Only a log left empty goes (Redis deletes an empty sorted set); other entries stay
        // until they leave the window, in both backends.
        state.entries.is_empty()
    }

    fn expires_at(&self, state: &State) -> u64 {
        state
            .entries
            .iter()
            .map(|e| e.at + self.window)
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_cost_near_u64_max_is_denied_and_counts_nothing() {
        let log = SlidingLog::new(5, Duration::from_secs(10)).expect("valid");
        let mut st = log.fresh();
        let t0 = 1_700_000_000_000_000;
        assert!(log.check(&mut st, &Ctx::new(t0, 1)).decision.allowed);
        let d = log.check(&mut st, &Ctx::new(t0, u64::MAX)).decision;
        assert!(!d.allowed);
        assert_eq!(d.retry_after, None);
        assert_eq!(d.remaining, 4);
        for _ in 0..4 {
            assert!(log.check(&mut st, &Ctx::new(t0, 1)).decision.allowed);
        }
        assert!(!log.check(&mut st, &Ctx::new(t0, 1)).decision.allowed);
    }
    use super::*;

    const T0: u64 = 1_700_000_000_000_000;
    const S: u64 = 1_000_000;

    #[test]
    fn no_burst_at_a_boundary() {
        let log = SlidingLog::new(3, Duration::from_secs(10)).expect("valid");
        let mut st = log.fresh();
        assert!(log.check(&mut st, &Ctx::new(T0, 1)).decision.allowed);
        assert!(
            log.check(&mut st, &Ctx::new(T0 + 5 * S, 2))
                .decision
                .allowed
        );
        let d = log.check(&mut st, &Ctx::new(T0 + 9 * S, 1)).decision;
        assert!(!d.allowed);
        // The first entry leaves at T0+10s.
        assert_eq!(d.retry_after, Some(Duration::from_secs(1)));
        assert_eq!(d.reset_after, Duration::from_secs(6));
        assert!(
            log.check(&mut st, &Ctx::new(T0 + 10 * S, 1))
                .decision
                .allowed
        );
        // Two units need the 2-unit entry gone: T0+15s.
        let d = log.check(&mut st, &Ctx::new(T0 + 11 * S, 2)).decision;
        assert_eq!(d.retry_after, Some(Duration::from_secs(4)));
    }

    /// After the clock stepped back, an entry ahead of it leaves the window after this check's
    /// own: the log is full again only then.
    #[test]
    fn an_entry_ahead_of_the_clock_holds_the_reset() {
        let log = SlidingLog::new(5, Duration::from_secs(10)).expect("valid");
        let mut st = log.fresh();
        assert!(
            log.check(&mut st, &Ctx::new(T0 + 5 * S, 1))
                .decision
                .allowed
        );
        let d = log.check(&mut st, &Ctx::new(T0, 1)).decision;
        assert!(d.allowed);
        assert_eq!(d.reset_after, Duration::from_secs(15));
        assert_eq!(log.expires_at(&st), T0 + 15 * S);
    }

    #[test]
    fn log_stays_bounded() {
        let log = SlidingLog::new(5, Duration::from_secs(1)).expect("valid");
        let mut st = log.fresh();
        for i in 0..1000 {
            log.check(&mut st, &Ctx::new(T0 + i * 1000, 1));
        }
        assert!(st.entries.len() <= 6, "{}", st.entries.len());
    }
}
