//! Sliding window counter: the fixed window's memory with (almost) the sliding log's accuracy.
//!
//! Two counters, the current window's and the previous one's. The previous window counts in
//! proportion to how much of it still overlaps the sliding window:
//! `used = prev * (W - elapsed) / W + curr`. Windows line up with multiples of `W` since the
//! epoch. The weight is taken in whole milliseconds, which keeps every product an exact integer
//! (the limit times the window in milliseconds must stay below 2^51).

use std::time::Duration;

use super::{Algorithm, Ctx, MAX_LIMIT, MAX_SPAN_US, Outcome, Undo};
use crate::clock::period_micros;
use crate::error::PolicyError;

const MS: u64 = 1_000;
const MAX_PRODUCT: u64 = 1 << 51;

/// Sliding window counter parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SlidingWindow {
    limit: u64,
    /// Window length in milliseconds.
    window_ms: u64,
}

/// The counts of the window starting at `start` and of the one before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct State {
    /// Start of the current window, microseconds since the epoch.
    pub start: u64,
    /// Units admitted in the current window.
    pub curr: u64,
    /// Units admitted in the window before it.
    pub prev: u64,
}

impl SlidingWindow {
    /// About `limit` units in any window of length `window` (a whole number of milliseconds).
    pub fn new(limit: u64, window: Duration) -> Result<Self, PolicyError> {
        if limit == 0 {
            return Err(PolicyError::Zero { field: "limit" });
        }
        // As every algorithm: every time and count stays exact in Lua's doubles (2^53).
        if limit > MAX_LIMIT {
            return Err(PolicyError::TooLarge {
                field: "limit",
                value: limit.to_string(),
                max: MAX_LIMIT.to_string(),
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
        if !w.is_multiple_of(MS) {
            return Err(PolicyError::Invalid {
                field: "window",
                reason: format!("{window:?} is not a whole number of milliseconds"),
            });
        }
        let window_ms = w / MS;
        if limit.checked_mul(window_ms).is_none_or(|p| p > MAX_PRODUCT) {
            return Err(PolicyError::TooLarge {
                field: "limit",
                value: format!("{limit} per {window_ms}ms"),
                max: format!("limit x window in ms of {MAX_PRODUCT}"),
            });
        }
        Ok(SlidingWindow { limit, window_ms })
    }

    /// The limit.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The window, microseconds.
    pub fn window_us(&self) -> u64 {
        self.window_ms * MS
    }

    /// `(start, curr, prev)` rolled forward to the window containing `now`.
    fn roll(&self, state: &State, now: u64) -> (u64, u64, u64) {
        let w = self.window_us();
        let start = now - now % w;
        if start <= state.start {
            (state.start, state.curr, state.prev)
        } else if start == state.start + w {
            (start, 0, state.curr)
        } else {
            (start, 0, 0)
        }
    }

    /// Whether `prev * (W - e) + used * W <= limit * W`, all in milliseconds.
    fn fits(&self, prev: u64, elapsed_ms: u64, used: u64) -> bool {
        let w = self.window_ms;
        used <= self.limit && weigh(prev, w - elapsed_ms) <= (self.limit - used) * w
    }

    /// Milliseconds into a window from which `prev` weighs at most `room` units.
    fn first_fit_ms(&self, prev: u64, room: u64) -> u64 {
        let w = self.window_ms;
        w.saturating_sub(room * w / prev)
    }
}

/// `prev * weight_ms`, saturated. The product stays below 2^51 for counts this policy admitted,
/// but a state can come from another policy of the same name with a much larger limit (or a
/// store's value): such a count saturates, and reads as a full window, instead of overflowing.
fn weigh(prev: u64, weight_ms: u64) -> u64 {
    prev.saturating_mul(weight_ms)
}

impl Algorithm for SlidingWindow {
    type State = State;

    fn fresh(&self) -> State {
        State::default()
    }

    fn decide(&self, state: &State, ctx: &Ctx) -> Outcome {
        let w_us = self.window_us();
        let (start, curr, prev) = self.roll(state, ctx.now);
        let elapsed_ms = (ctx.now.saturating_sub(start) / MS).min(self.window_ms);
        let weighted_prev_x_w = weigh(prev, self.window_ms - elapsed_ms);
        let used_after = curr.saturating_add(ctx.cost);
        let allowed = self.fits(prev, elapsed_ms, used_after);
        let counted = if allowed { used_after } else { curr };
        // remaining = floor(limit - prev * (W - e) / W - counted)
        let remaining = (self.limit.saturating_sub(counted) * self.window_ms)
            .saturating_sub(weighted_prev_x_w)
            / self.window_ms;
        let reset_end = if counted > 0 {
            start + 2 * w_us
        } else if prev > 0 {
            start + w_us
        } else {
            0
        };
        let reset = reset_end.saturating_sub(ctx.now);
        let retry = if allowed || ctx.cost > self.limit {
            None
        } else if used_after <= self.limit {
            // Fits in this window once the previous one weighs little enough.
            let at_ms = self.first_fit_ms(prev, self.limit - used_after);
            Some((start + at_ms * MS).saturating_sub(ctx.now))
        } else {
            // Next window: this window's count becomes the previous one.
            let at_ms = self.first_fit_ms(curr, self.limit - ctx.cost);
            Some((start + w_us + at_ms * MS).saturating_sub(ctx.now))
        };
        Outcome::new(allowed, self.limit, remaining, retry, reset)
    }

    fn commit(&self, state: &mut State, ctx: &Ctx) {
        let (start, curr, prev) = self.roll(state, ctx.now);
        *state = State {
            start,
            curr: curr.saturating_add(ctx.cost),
            prev,
        };
    }

    fn undo(&self, state: &mut State, undo: &Undo) -> bool {
        // The check was counted in the window holding its time: the current one, or the
        // previous one if the state has moved on by one window since. (A check counted in a
        // later window, while the clock was behind, is not given back: its units stay counted
        // until that window has passed, in both backends.)
        let w = self.window_us();
        let start = undo.at - undo.at % w;
        if state.start == start {
            state.curr = state.curr.saturating_sub(undo.cost);
        } else if state.start == start.saturating_add(w) {
            state.prev = state.prev.saturating_sub(undo.cost);
        } else {
            return false;
        }
        true
    }

    fn expires_at(&self, state: &State) -> u64 {
        let w = self.window_us();
        if state.curr > 0 {
            state.start + 2 * w
        } else if state.prev > 0 {
            state.start + w
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: u64 = 10_000_000;
    const T0: u64 = 1_700_000_000 * 1_000_000; // a multiple of 10 s

    #[test]
    fn previous_window_weighs_in_proportion() {
        let sw = SlidingWindow::new(10, Duration::from_secs(10)).expect("valid");
        let mut st = sw.fresh();
        assert!(
            sw.check(&mut st, &Ctx::new(T0 + W / 2, 10))
                .decision
                .allowed
        );
        // 30% into the next window: the previous 10 weigh 7, so 3 more fit.
        let now = T0 + W + 3 * W / 10;
        let d = sw.check(&mut st, &Ctx::new(now, 3)).decision;
        assert!(d.allowed, "{d:?}");
        assert_eq!(d.remaining, 0);
        let d = sw.check(&mut st, &Ctx::new(now, 1)).decision;
        assert!(!d.allowed);
        // prev 10 must weigh <= 6: at 40% of the window, 1 s from now.
        assert_eq!(d.retry_after, Some(Duration::from_secs(1)));
        assert_eq!(d.reset_after, Duration::from_millis(17_000));
        assert!(
            sw.check(&mut st, &Ctx::new(now + 1_000_000, 1))
                .decision
                .allowed
        );
    }

    #[test]
    fn full_current_window_waits_for_the_next() {
        let sw = SlidingWindow::new(4, Duration::from_secs(10)).expect("valid");
        let mut st = sw.fresh();
        assert!(sw.check(&mut st, &Ctx::new(T0, 4)).decision.allowed);
        let d = sw.check(&mut st, &Ctx::new(T0 + 1, 1)).decision;
        // Next window, prev 4 must weigh <= 3: from 25% in, at T0 + 12.5 s.
        assert_eq!(d.retry_after, Some(Duration::from_millis(12_500)));
        assert!(
            !sw.check(&mut st, &Ctx::new(T0 + 12_499_000, 1))
                .decision
                .allowed
        );
        assert!(
            sw.check(&mut st, &Ctx::new(T0 + 12_500_000, 1))
                .decision
                .allowed
        );
    }

    #[test]
    fn a_previous_count_too_large_for_this_policy_denies_instead_of_overflowing() {
        // Counted under a policy of the same name with a far larger limit: 2^51 units in the
        // previous window, weighed over a window of 10^9 ms.
        let sw = SlidingWindow::new(10, Duration::from_secs(1_000_000)).expect("valid");
        let w = sw.window_us();
        let start = T0 - T0 % w;
        let mut st = State {
            start: start - w,
            curr: 1 << 51,
            prev: 0,
        };
        let d = sw.check(&mut st, &Ctx::new(start + 1, 1)).decision;
        assert!(!d.allowed, "{d:?}");
        assert_eq!(d.remaining, 0);
        let mut st = State {
            start,
            curr: u64::MAX,
            prev: 0,
        };
        sw.commit(&mut st, &Ctx::new(start + 1, 1));
        assert_eq!(st.curr, u64::MAX);
    }

    #[test]
    fn validates() {
        assert!(SlidingWindow::new(0, Duration::from_secs(1)).is_err());
        assert!(SlidingWindow::new(1, Duration::from_micros(1500)).is_err());
        assert!(SlidingWindow::new(1 << 40, Duration::from_secs(86_400)).is_err());
        // A window past the span every algorithm keeps to (2^51 us, about 71 years), however
        // small the limit: its times would not stay exact in Lua.
        let week = Duration::from_secs(7 * 86_400);
        let long = SlidingWindow::new(1, week * 100_000).expect_err("too long");
        assert!(long.to_string().contains("window"), "{long}");
        assert!(SlidingWindow::new(1, week * 3_000).is_ok());
        let many = SlidingWindow::new((1 << 40) + 1, Duration::from_millis(1)).expect_err("limit");
        assert!(many.to_string().contains("limit"), "{many}");
        let parsed = "sliding:1/100000w"
            .parse::<crate::Policy>()
            .expect_err("too long");
        assert!(parsed.to_string().contains("window"), "{parsed}");
    }
}
