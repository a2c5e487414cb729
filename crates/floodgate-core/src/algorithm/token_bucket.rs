//! Token bucket: a bucket of `capacity` tokens, refilled `amount` tokens every `interval`.
//!
//! Two refill styles:
//! - **greedy** (default): tokens trickle in one at a time, `interval / amount` apart, as in
//!   Guava's `RateLimiter` and the classic Lua bucket. Admits what GCRA admits.
//! - **interval**: all `amount` tokens arrive at once when each full `interval` has passed
//!   ("100 tokens every minute, on the minute of the first use").
//!
//! The state is a whole number of tokens and the time of the last refill step; the partial
//! progress towards the next token is kept by not moving that time past the last whole step.

use std::time::Duration;

use super::gcra::spaced;
use super::{Algorithm, Ctx, MAX_LIMIT, MAX_SPAN_US, Outcome, Undo};
use crate::clock::period_micros;
use crate::error::PolicyError;

/// Token bucket parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TokenBucket {
    capacity: u64,
    /// Tokens added per refill step.
    per_step: u64,
    /// Microseconds between refill steps.
    step: u64,
    /// `amount` and `interval` as given, for display.
    amount: u64,
    interval: u64,
    greedy: bool,
}

/// Tokens in the bucket as of the refill step at `last`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct State {
    /// Whole tokens available.
    pub tokens: u64,
    /// Time of the last refill step, microseconds since the epoch.
    pub last: u64,
}

impl TokenBucket {
    /// A bucket of `capacity` tokens, refilled continuously at `amount` per `interval`.
    pub fn new(capacity: u64, amount: u64, interval: Duration) -> Result<Self, PolicyError> {
        Self::build(capacity, amount, interval, true)
    }

    /// A bucket of `capacity` tokens that gets `amount` tokens at once every full `interval`.
    pub fn intervally(capacity: u64, amount: u64, interval: Duration) -> Result<Self, PolicyError> {
        Self::build(capacity, amount, interval, false)
    }

    fn build(
        capacity: u64,
        amount: u64,
        interval: Duration,
        greedy: bool,
    ) -> Result<Self, PolicyError> {
        if capacity == 0 {
            return Err(PolicyError::Zero { field: "capacity" });
        }
        if capacity > MAX_LIMIT {
            return Err(PolicyError::TooLarge {
                field: "capacity",
                value: capacity.to_string(),
                max: MAX_LIMIT.to_string(),
            });
        }
        if amount == 0 {
            return Err(PolicyError::Zero {
                field: "refill amount",
            });
        }
        let interval_us = period_micros(interval);
        if interval_us == 0 {
            return Err(PolicyError::Zero {
                field: "refill interval",
            });
        }
        let (per_step, step) = if greedy {
            // Rounded up: never more than `amount` tokens per `interval`.
            (1, spaced(interval_us, amount))
        } else {
            // More than a whole bucket at once fills it, as the whole bucket does: the smaller
            // number keeps the Redis scripts' arithmetic exact (doubles, under 2^53).
            (amount.min(capacity), interval_us)
        };
        if step == 0 {
            return Err(PolicyError::TooSmall {
                field: "refill interval",
                reason: "tokens would arrive less than one microsecond apart".into(),
            });
        }
        // The longest wait is refilling a whole bucket.
        let full = capacity.div_ceil(per_step).checked_mul(step);
        if full.is_none_or(|f| f > MAX_SPAN_US) {
            return Err(PolicyError::TooLarge {
                field: "refill interval",
                value: format!("{interval_us}us"),
                max: format!("{MAX_SPAN_US}us to refill the whole bucket"),
            });
        }
        Ok(TokenBucket {
            capacity,
            per_step,
            step,
            amount,
            interval: interval_us,
            greedy,
        })
    }

    /// The bucket's capacity.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Tokens added per interval.
    pub fn amount(&self) -> u64 {
        self.amount
    }

    /// The refill interval, microseconds.
    pub fn interval_us(&self) -> u64 {
        self.interval
    }

    /// Tokens added per refill step (1 when greedy, `amount` otherwise).
    pub fn per_step(&self) -> u64 {
        self.per_step
    }

    /// Microseconds between refill steps.
    pub fn step_us(&self) -> u64 {
        self.step
    }

    /// Whether tokens trickle in continuously (`true`) or arrive once per interval.
    pub fn is_greedy(&self) -> bool {
        self.greedy
    }

    /// Tokens and refill time at `now`. A state measured ahead of the clock (it stepped back)
    /// refills from then, unless it would be full more than twice a whole refill from now:
    /// it reads as a full bucket then, as GCRA reads a tat that far ahead.
    fn refill(&self, state: &State, now: u64) -> (u64, u64) {
        if state.last > now {
            let missing = self.capacity.saturating_sub(state.tokens);
            let full_at = self.time_for(state.last, 0, missing);
            // A whole refill is at most MAX_SPAN_US (2^51): no overflow.
            if full_at - now > 2 * self.time_for(0, 0, self.capacity) {
                return (self.capacity, now);
            }
        }
        if now <= state.last || state.tokens >= self.capacity {
            return (state.tokens.min(self.capacity), state.last.max(now));
        }
        let steps = (now - state.last) / self.step;
        let tokens = state
            .tokens
            .saturating_add(steps.saturating_mul(self.per_step));
        if tokens >= self.capacity {
            (self.capacity, now)
        } else {
            (tokens, state.last + steps * self.step)
        }
    }

    /// Microseconds from `now` until `need` more tokens than `tokens` have arrived.
    fn time_for(&self, last: u64, now: u64, need: u64) -> u64 {
        last.saturating_add(need.div_ceil(self.per_step) * self.step)
            .saturating_sub(now)
    }
}

impl Algorithm for TokenBucket {
    type State = State;

    fn fresh(&self) -> State {
        State {
            tokens: self.capacity,
            last: 0,
        }
    }

    fn decide(&self, state: &State, ctx: &Ctx) -> Outcome {
        let (tokens, last) = self.refill(state, ctx.now);
        let (allowed, left, retry) = if ctx.cost <= tokens {
            (true, tokens - ctx.cost, None)
        } else if ctx.cost <= self.capacity {
            let wait = self.time_for(last, ctx.now, ctx.cost - tokens);
            (false, tokens, Some(wait))
        } else {
            (false, tokens, None)
        };
        let reset = self.time_for(last, ctx.now, self.capacity - left);
        Outcome::new(allowed, self.capacity, left, retry, reset)
    }

    fn commit(&self, state: &mut State, ctx: &Ctx) {
        let (tokens, last) = self.refill(state, ctx.now);
        state.tokens = tokens - ctx.cost.min(tokens);
        state.last = last;
    }

    fn undo(&self, state: &mut State, undo: &Undo) -> bool {
        state.tokens = state.tokens.saturating_add(undo.cost).min(self.capacity);
        true
    }

    fn expires_at(&self, state: &State) -> u64 {
        if state.tokens >= self.capacity {
            return 0;
        }
        state.last + (self.capacity - state.tokens).div_ceil(self.per_step) * self.step
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: u64 = 1_700_000_000_000_000;

    /// A refill larger than the bucket fills it, as the bucket's capacity does; the step is
    /// kept small for the Redis scripts' doubles (an amount of 2^64 - 1 made them read a
    /// full bucket's `reset_after` as a whole interval).
    #[test]
    fn an_interval_refill_larger_than_the_bucket_is_the_bucket() {
        let huge = TokenBucket::intervally(10, u64::MAX, Duration::from_secs(60)).expect("valid");
        let whole = TokenBucket::intervally(10, 10, Duration::from_secs(60)).expect("valid");
        assert_eq!((huge.per_step(), huge.step_us()), (10, 60_000_000));
        assert_eq!(huge.amount, u64::MAX);
        // Its quota window (the `w` of `RateLimit-Policy`) is the interval, as the bucket's.
        let window = |b: TokenBucket| crate::policy::Kind::TokenBucket(b).window();
        assert_eq!(window(huge), Some(Duration::from_secs(60)));
        assert_eq!(window(huge), window(whole));
        let (mut a, mut b) = (huge.fresh(), whole.fresh());
        for (dt, cost) in [
            (0, 10),
            (1, 1),
            (60_000_000, 0),
            (60_000_001, 10),
            (60_000_002, 1),
        ] {
            let ctx = Ctx::new(T0 + dt, cost);
            assert_eq!(
                huge.check(&mut a, &ctx).decision,
                whole.check(&mut b, &ctx).decision,
                "{dt}"
            );
        }
    }

    /// A period finer than a microsecond is rounded up, not down: never more than asked for.
    #[test]
    fn sub_microsecond_intervals_round_up() {
        let t = TokenBucket::new(1, 1, Duration::from_nanos(1_999)).expect("valid");
        assert_eq!(t.step_us(), 2);
    }

    #[test]
    fn a_state_ahead_of_the_clock_refills_from_then_or_reads_as_full() {
        // 4 tokens, one per 250 ms: a bucket refills from empty in 1 s.
        let b = TokenBucket::new(4, 4, Duration::from_secs(1)).expect("valid");
        let s = 1_000_000;
        // Empty, measured half a second ahead: full at T0 + 1.5s, the first token at T0 + 0.75s.
        let ahead = State {
            tokens: 0,
            last: T0 + s / 2,
        };
        let d = b.decide(&ahead, &Ctx::new(T0, 1)).decision;
        assert!(!d.allowed);
        assert_eq!(d.retry_after, Some(Duration::from_millis(750)));
        // Full more than twice a whole refill from now: it reads as full.
        for last in [T0 + s + 1, T0 + 3_600 * s] {
            let mut st = State { tokens: 0, last };
            let d = b.check(&mut st, &Ctx::new(T0, 4)).decision;
            assert!(d.allowed, "{last}");
            assert_eq!(
                st,
                State {
                    tokens: 0,
                    last: T0
                }
            );
        }
        // At the bound, it still counts: empty, a whole refill ahead.
        let st = State {
            tokens: 0,
            last: T0 + s,
        };
        let d = b.decide(&st, &Ctx::new(T0, 1)).decision;
        assert!(!d.allowed);
        assert_eq!(d.retry_after, Some(Duration::from_millis(1250)));
        // Three tokens, an hour ahead (or as far as a u64 goes): past the bound.
        for last in [T0 + 3_600 * s, u64::MAX] {
            let st = State { tokens: 3, last };
            assert!(b.decide(&st, &Ctx::new(T0, 4)).decision.allowed, "{last}");
        }
    }

    #[test]
    fn greedy_refills_one_token_at_a_time() {
        // 4 tokens, 2 per second: one every 500 ms.
        let b = TokenBucket::new(4, 2, Duration::from_secs(1)).expect("valid");
        let mut st = b.fresh();
        for left in (0..4).rev() {
            let d = b.check(&mut st, &Ctx::new(T0, 1)).decision;
            assert!(d.allowed);
            assert_eq!(d.remaining, left);
        }
        let d = b.check(&mut st, &Ctx::new(T0 + 100_000, 1)).decision;
        assert!(!d.allowed);
        assert_eq!(d.retry_after, Some(Duration::from_millis(400)));
        assert_eq!(d.reset_after, Duration::from_millis(1900));
        assert!(
            b.check(&mut st, &Ctx::new(T0 + 500_000, 1))
                .decision
                .allowed
        );
        // Cost above capacity never fits.
        assert_eq!(
            b.check(&mut st, &Ctx::new(T0, 5)).decision.retry_after,
            None
        );
    }

    #[test]
    fn interval_refill_arrives_at_once() {
        let b = TokenBucket::intervally(10, 10, Duration::from_secs(60)).expect("valid");
        let mut st = b.fresh();
        assert!(b.check(&mut st, &Ctx::new(T0, 10)).decision.allowed);
        let d = b.check(&mut st, &Ctx::new(T0 + 59_000_000, 1)).decision;
        assert!(!d.allowed);
        assert_eq!(d.retry_after, Some(Duration::from_secs(1)));
        let d = b.check(&mut st, &Ctx::new(T0 + 60_000_000, 10)).decision;
        assert!(d.allowed, "{d:?}");
    }

    #[test]
    fn validates() {
        assert!(matches!(
            TokenBucket::new(0, 1, Duration::from_secs(1)),
            Err(PolicyError::Zero { field: "capacity" })
        ));
        assert!(TokenBucket::new(1, 0, Duration::from_secs(1)).is_err());
        assert!(TokenBucket::new(1, 1, Duration::ZERO).is_err());
        assert!(TokenBucket::new(1 << 41, 1, Duration::from_secs(1)).is_err());
        assert!(TokenBucket::new(1 << 30, 1, Duration::from_secs(1 << 30)).is_err());
    }
}
