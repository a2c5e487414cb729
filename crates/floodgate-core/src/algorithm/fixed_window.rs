//! Fixed window: at most `limit` units per window, the count starting over with each window.
//!
//! Windows are either **rolling** (a window opens at the first request after the previous one
//! closed: "10 per hour from the first send") or **calendar**-aligned ("10 per calendar day,
//! Beijing time"). Cheap and easy to explain, but a client can spend two windows' worth
//! around a boundary; pick the sliding log when that matters.

use std::time::Duration;

use super::{Algorithm, Ctx, MAX_LIMIT, MAX_SPAN_US, Outcome, Undo};
use crate::calendar::Calendar;
use crate::clock::period_micros;
use crate::error::PolicyError;

/// How windows are laid out in time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Window {
    /// A window of this many microseconds opens at the first request.
    Rolling(u64),
    /// Calendar windows.
    Calendar(Calendar),
}

/// Fixed window parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FixedWindow {
    limit: u64,
    window: Window,
}

/// Units counted in the window that started at `start`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct State {
    /// Start of the counted window, microseconds since the epoch.
    pub start: u64,
    /// Units admitted in that window.
    pub count: u64,
}

impl FixedWindow {
    /// `limit` per rolling window of `window`.
    pub fn rolling(limit: u64, window: Duration) -> Result<Self, PolicyError> {
        check_limit(limit)?;
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
        Ok(FixedWindow {
            limit,
            window: Window::Rolling(w),
        })
    }

    /// `limit` per calendar window.
    pub fn calendar(limit: u64, calendar: Calendar) -> Result<Self, PolicyError> {
        check_limit(limit)?;
        Ok(FixedWindow {
            limit,
            window: Window::Calendar(calendar),
        })
    }

    /// The limit per window.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The window layout.
    pub fn window(&self) -> Window {
        self.window
    }

    /// `(start, end, count)` of the window in force at `now`.
    fn current(&self, state: &State, now: u64) -> (u64, u64, u64) {
        match self.window {
            Window::Rolling(len) => {
                if state.count > 0 && now < state.start + len {
                    (state.start, state.start + len, state.count)
                } else {
                    (now, now + len, 0)
                }
            }
            Window::Calendar(cal) => {
                let (start, end) = cal.bounds(now);
                if state.count > 0 && state.start > start {
                    // A window ahead of the clock (it stepped back over a boundary) stays the
                    // one in force until it ends, as a rolling window does: counting the
                    // earlier window afresh would hand out its limit again, and the later one's
                    // once more when the clock is back in it. (A start that is no boundary of
                    // this layout was written under another one, same name: it reads as
                    // fresh, as any other window's.)
                    let (held_start, held_end) = cal.bounds(state.start);
                    if held_start == state.start {
                        return (state.start, held_end, state.count);
                    }
                }
                let count = if state.start == start { state.count } else { 0 };
                (start, end, count)
            }
        }
    }
}

fn check_limit(limit: u64) -> Result<(), PolicyError> {
    if limit == 0 {
        return Err(PolicyError::Zero { field: "limit" });
    }
    if limit > MAX_LIMIT {
        return Err(PolicyError::TooLarge {
            field: "limit",
            value: limit.to_string(),
            max: MAX_LIMIT.to_string(),
        });
    }
    Ok(())
}

impl Algorithm for FixedWindow {
    type State = State;

    fn fresh(&self) -> State {
        State::default()
    }

    fn decide(&self, state: &State, ctx: &Ctx) -> Outcome {
        let (_, end, count) = self.current(state, ctx.now);
        let until_end = end.saturating_sub(ctx.now);
        let fits = ctx.cost <= self.limit - count.min(self.limit);
        if fits {
            let after = count + ctx.cost;
            let reset = if after > 0 { until_end } else { 0 };
            // A state counted under a larger limit (peeked at cost 0) has nothing left.
            Outcome::new(
                true,
                self.limit,
                self.limit.saturating_sub(after),
                None,
                reset,
            )
        } else {
            let retry = (ctx.cost <= self.limit).then_some(until_end);
            let reset = if count > 0 { until_end } else { 0 };
            Outcome::new(
                false,
                self.limit,
                self.limit - count.min(self.limit),
                retry,
                reset,
            )
        }
    }

    fn commit(&self, state: &mut State, ctx: &Ctx) {
        let (start, _, count) = self.current(state, ctx.now);
        *state = State {
            start,
            count: count + ctx.cost,
        };
    }

    fn undo(&self, state: &mut State, undo: &Undo) -> bool {
        // Only the window that counted the check gives units back: a later window never saw
        // them. (Nor does one that started after the check's time, which counted it while the
        // clock was behind: its units stay counted until it ends, in both backends.)
        let counted = State {
            start: state.start,
            count: state.count.max(1),
        };
        let (start, _, _) = self.current(&counted, undo.at);
        if state.count > 0 && state.start == start && state.start <= undo.at {
            state.count = state.count.saturating_sub(undo.cost);
            return true;
        }
        false
    }

    fn expires_at(&self, state: &State) -> u64 {
        if state.count == 0 {
            return 0;
        }
        match self.window {
            Window::Rolling(len) => state.start + len,
            Window::Calendar(cal) => cal.bounds(state.start).1,
        }
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_state_counted_past_the_limit_peeks_as_nothing_left() {
        // Counted under a larger limit (a policy changed under the same name).
        let w = FixedWindow::rolling(5, Duration::from_secs(60)).expect("valid");
        let mut st = State {
            start: T0,
            count: 9,
        };
        let d = w.check(&mut st, &Ctx::new(T0 + 1, 0)).decision;
        assert_eq!(d.remaining, 0);
        assert!(!w.check(&mut st, &Ctx::new(T0 + 1, 1)).decision.allowed);
    }
    use super::*;
    use crate::calendar::CalendarUnit;

    const T0: u64 = 1_709_214_330_000_000; // 2024-02-29T13:45:30Z

    #[test]
    fn rolling_window_opens_at_first_hit() {
        let fw = FixedWindow::rolling(3, Duration::from_secs(10)).expect("valid");
        let mut st = fw.fresh();
        for left in (0..3).rev() {
            let d = fw.check(&mut st, &Ctx::new(T0, 1)).decision;
            assert_eq!((d.allowed, d.remaining), (true, left));
        }
        let d = fw.check(&mut st, &Ctx::new(T0 + 4_000_000, 1)).decision;
        assert!(!d.allowed);
        assert_eq!(d.retry_after, Some(Duration::from_secs(6)));
        assert_eq!(d.reset_after, Duration::from_secs(6));
        let d = fw.check(&mut st, &Ctx::new(T0 + 10_000_000, 1)).decision;
        assert!(d.allowed);
        assert_eq!(d.reset_after, Duration::from_secs(10));
    }

    #[test]
    fn calendar_window_resets_at_midnight() {
        let cal = Calendar::new(1, CalendarUnit::Day).expect("valid");
        let fw = FixedWindow::calendar(2, cal).expect("valid");
        let mut st = fw.fresh();
        assert!(fw.check(&mut st, &Ctx::new(T0, 2)).decision.allowed);
        let d = fw.check(&mut st, &Ctx::new(T0, 1)).decision;
        assert!(!d.allowed);
        // 13:45:30 to midnight.
        assert_eq!(
            d.retry_after,
            Some(Duration::from_secs(10 * 3600 + 14 * 60 + 30))
        );
        let midnight = 1_709_251_200_000_000;
        assert!(fw.check(&mut st, &Ctx::new(midnight, 1)).decision.allowed);
        assert_eq!(fw.expires_at(&st), midnight + 86_400_000_000);
    }

    #[test]
    fn a_calendar_window_ahead_of_the_clock_stays_in_force_until_it_ends() {
        let cal = Calendar::new(1, CalendarUnit::Day).expect("valid");
        let fw = FixedWindow::calendar(2, cal).expect("valid");
        let midnight = 1_709_251_200_000_000;
        let mut st = fw.fresh();
        assert!(
            fw.check(&mut st, &Ctx::new(midnight + 500_000, 2))
                .decision
                .allowed
        );
        // The clock steps back a second, over midnight: the later day is still the one in
        // force, spent, until it ends (not the earlier day afresh).
        let back = midnight - 500_000;
        let d = fw.check(&mut st, &Ctx::new(back, 1)).decision;
        assert!(!d.allowed);
        assert_eq!(d.retry_after, Some(Duration::from_millis(86_400_500)));
        assert_eq!(
            st,
            State {
                start: midnight,
                count: 2
            }
        );
        // A refund of a check made before the step gives back from that day only.
        let undo = Undo {
            at: midnight + 500_000,
            now: back,
            cost: 1,
            lease: 0,
            reset_after: 0,
        };
        assert!(fw.undo(&mut st, &undo));
        assert!(fw.check(&mut st, &Ctx::new(back, 1)).decision.allowed);
        assert_eq!(
            st,
            State {
                start: midnight,
                count: 2
            }
        );
        // The next day starts afresh.
        let next = midnight + 86_400_000_000;
        assert!(fw.check(&mut st, &Ctx::new(next, 2)).decision.allowed);
        // A later start that is no day boundary was written under another layout (the same
        // name, hourly): it reads as fresh, as any other window's.
        let mut st = State {
            start: midnight + 3_600_000_000,
            count: 2,
        };
        assert!(
            fw.check(&mut st, &Ctx::new(midnight + 1, 2))
                .decision
                .allowed
        );
        assert_eq!(
            st,
            State {
                start: midnight,
                count: 2
            }
        );
    }

    #[test]
    fn oversized_cost_never_fits() {
        let fw = FixedWindow::rolling(3, Duration::from_secs(10)).expect("valid");
        let d = fw.check(&mut fw.fresh(), &Ctx::new(T0, 4)).decision;
        assert_eq!((d.allowed, d.retry_after, d.remaining), (false, None, 3));
    }
}
