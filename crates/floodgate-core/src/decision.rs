//! The answer to "may this go ahead?": [`Decision`] for one policy, [`Verdict`] for several.

use std::time::Duration;

use smallvec::SmallVec;

use crate::Timestamp;

/// The outcome of checking one policy: redis-cell's five fields, at millisecond precision.
///
/// Durations are rounded **up** to whole milliseconds, so a client that waits `retry_after`
/// is admitted, never turned away for a fraction of a millisecond.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Decision {
    /// Whether the request may go ahead (and was counted).
    pub allowed: bool,
    /// The most the policy admits at once (redis-cell's `max_burst + 1`).
    pub limit: u64,
    /// How many more units would be admitted right now, after this request.
    pub remaining: u64,
    /// When denied: how long until the same request would be admitted. `None` when allowed,
    /// or when the request can never be admitted (its cost exceeds the limit).
    pub retry_after: Option<Duration>,
    /// How long until the key's state is back to full (as if it had never been used).
    pub reset_after: Duration,
}

impl Decision {
    /// Builds a decision from microsecond quantities, rounding durations up to milliseconds
    /// (how every backend turns its arithmetic into a decision).
    #[inline]
    pub fn from_micros(
        allowed: bool,
        limit: u64,
        remaining: u64,
        retry_after_us: Option<u64>,
        reset_after_us: u64,
    ) -> Self {
        Decision {
            allowed,
            limit,
            remaining,
            retry_after: retry_after_us.map(ceil_ms),
            reset_after: ceil_ms(reset_after_us),
        }
    }

    /// `retry_after` in whole milliseconds.
    pub fn retry_after_ms(&self) -> Option<u64> {
        self.retry_after.map(|d| d.as_millis() as u64)
    }

    /// `reset_after` in whole milliseconds.
    pub fn reset_after_ms(&self) -> u64 {
        self.reset_after.as_millis() as u64
    }

    /// Whether this decision constrains more than `other`: a denial beats an allowance; between
    /// denials the longer wait wins (never-admissible is the longest); between allowances the
    /// one with less remaining (then the later reset) wins.
    pub fn is_stricter_than(&self, other: &Decision) -> bool {
        match (self.allowed, other.allowed) {
            (false, true) => true,
            (true, false) => false,
            (false, false) => match (self.retry_after, other.retry_after) {
                (None, Some(_)) => true,
                (Some(_), None) => false,
                (a, b) => a > b,
            },
            (true, true) => {
                (self.remaining, std::cmp::Reverse(self.reset_after))
                    < (other.remaining, std::cmp::Reverse(other.reset_after))
            }
        }
    }
}

/// Rounds microseconds up to a whole-millisecond duration.
pub(crate) fn ceil_ms(us: u64) -> Duration {
    Duration::from_millis(us.div_ceil(1_000))
}

/// The outcome of checking several policies at once, all-or-nothing.
///
/// When every policy allows, all were counted. When any denies, none was counted and the
/// decisions of the policies that would have allowed describe their state unchanged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// One decision per checked policy, in the order they were given.
    pub decisions: SmallVec<[Decision; 2]>,
    /// For shaping (queueing) policies: how long the caller must wait before going ahead.
    /// Zero for every other algorithm.
    pub wait: Duration,
    /// For concurrency policies: the lease to release when the work is done.
    pub lease: Option<LeaseId>,
    /// When the check was decided, by the store's clock (the Redis server's time for the
    /// Redis backend); for a check [`Leasing`](crate::Leasing) answered from a local lease,
    /// when the store counted that lease (the earliest lease's, when the check spent several).
    /// [`Limiter::refund`](crate::Limiter::refund) gives units back as of then.
    pub at: Timestamp,
}

impl Verdict {
    /// Whether every policy allowed.
    pub fn allowed(&self) -> bool {
        self.decisions.iter().all(|d| d.allowed)
    }

    /// The index and decision of the most constraining policy (see [`Decision::is_stricter_than`]).
    pub fn strictest(&self) -> Option<(usize, &Decision)> {
        let mut best: Option<(usize, &Decision)> = None;
        for (i, d) in self.decisions.iter().enumerate() {
            match best {
                Some((_, b)) if !d.is_stricter_than(b) => {}
                _ => best = Some((i, d)),
            }
        }
        best
    }

    /// One decision that summarises the verdict: the strictest one.
    pub fn decision(&self) -> Option<Decision> {
        self.strictest().map(|(_, d)| *d)
    }
}

/// Identifies one concurrency lease, to release it later.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct LeaseId(pub u64);

#[cfg(test)]
mod tests {
    use super::*;

    fn d(allowed: bool, remaining: u64, retry: Option<u64>) -> Decision {
        Decision {
            allowed,
            limit: 10,
            remaining,
            retry_after: retry.map(Duration::from_millis),
            reset_after: Duration::from_millis(5),
        }
    }

    #[test]
    fn rounds_up_to_milliseconds() {
        let x = Decision::from_micros(false, 1, 0, Some(1), 1_001);
        assert_eq!(x.retry_after, Some(Duration::from_millis(1)));
        assert_eq!(x.reset_after, Duration::from_millis(2));
        let y = Decision::from_micros(true, 1, 0, None, 2_000);
        assert_eq!(y.reset_after_ms(), 2);
    }

    #[test]
    fn strictest_prefers_denials_with_longest_wait() {
        let v = Verdict {
            decisions: [
                d(true, 0, None),
                d(false, 0, Some(10)),
                d(false, 0, Some(30)),
            ]
            .into_iter()
            .collect(),
            wait: Duration::ZERO,
            lease: None,
            at: Timestamp::EPOCH,
        };
        assert!(!v.allowed());
        assert_eq!(v.strictest().map(|(i, _)| i), Some(2));
        let never = Verdict {
            decisions: [d(false, 0, Some(10)), d(false, 0, None)]
                .into_iter()
                .collect(),
            wait: Duration::ZERO,
            lease: None,
            at: Timestamp::EPOCH,
        };
        assert_eq!(never.strictest().map(|(i, _)| i), Some(1));
        let ok = Verdict {
            decisions: [d(true, 5, None), d(true, 2, None)].into_iter().collect(),
            wait: Duration::ZERO,
            lease: None,
            at: Timestamp::EPOCH,
        };
        assert!(ok.allowed());
        assert_eq!(ok.strictest().map(|(i, _)| i), Some(1));
    }
}
