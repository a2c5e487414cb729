//! Jittered backoff between attempts, the fallback when no release notification comes.

use std::time::Duration;

use crate::Error;

/// Bounds of the randomized wait between two attempts to take a busy lock.
///
/// Waiters are normally woken by the release notification; this backoff only covers a lost
/// notification, a lease that runs out without a release, or a store without notifications.
/// The waits grow with "decorrelated jitter" (each one uniform in `[min, 3 x previous]`, capped
/// at `max`), and never exceed the holder's remaining lease, so a waiter is back when the lease
/// ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    min: Duration,
    max: Duration,
}

impl Backoff {
    /// 5 ms to 250 ms.
    pub const DEFAULT: Backoff = Backoff {
        min: Duration::from_millis(5),
        max: Duration::from_millis(250),
    };

    /// Waits between `min` and `max`.
    ///
    /// # Errors
    /// [`Error::Invalid`] if `min` is zero or greater than `max`.
    pub fn new(min: Duration, max: Duration) -> Result<Self, Error> {
        if min.is_zero() {
            return Err(Error::Invalid(
                "the minimum backoff must be greater than zero".to_owned(),
            ));
        }
        if min > max {
            return Err(Error::Invalid(format!(
                "the minimum backoff {min:?} is greater than the maximum {max:?}"
            )));
        }
        Ok(Self { min, max })
    }

    /// The shortest wait.
    pub fn min(&self) -> Duration {
        self.min
    }

    /// The longest wait.
    pub fn max(&self) -> Duration {
        self.max
    }

    pub(crate) fn start(self) -> BackoffState {
        BackoffState {
            bounds: self,
            previous: self.min,
        }
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// The waits of one acquisition.
#[derive(Debug)]
pub(crate) struct BackoffState {
    bounds: Backoff,
    previous: Duration,
}

impl BackoffState {
    pub(crate) fn next(&mut self) -> Duration {
        // In nanoseconds: a minimum under a microsecond must not round down to waits of zero
        // (a retry loop without pause).
        let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let low = nanos(self.bounds.min);
        let high = nanos(self.previous)
            .saturating_mul(3)
            .max(low.saturating_add(1));
        let drawn = if high > low {
            fastrand::u64(low..high)
        } else {
            low
        };
        let wait = Duration::from_nanos(drawn).clamp(self.bounds.min, self.bounds.max);
        self.previous = wait;
        wait
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_stay_in_bounds_and_grow() {
        let b = Backoff::new(Duration::from_millis(2), Duration::from_millis(100)).expect("ok");
        let mut s = b.start();
        let waits: Vec<Duration> = (0..50).map(|_| s.next()).collect();
        assert!(waits.iter().all(|w| *w >= b.min() && *w <= b.max()));
        assert!(waits.iter().any(|w| *w > Duration::from_millis(20)));
        assert!(Backoff::new(Duration::ZERO, Duration::from_secs(1)).is_err());
        assert!(Backoff::new(Duration::from_secs(2), Duration::from_secs(1)).is_err());
    }

    #[test]
    fn a_minimum_under_a_microsecond_still_waits() {
        let b = Backoff::new(Duration::from_nanos(500), Duration::from_millis(1)).expect("ok");
        let mut s = b.start();
        for _ in 0..100 {
            let wait = s.next();
            assert!(wait >= Duration::from_nanos(500), "{wait:?}");
            assert!(wait <= Duration::from_millis(1), "{wait:?}");
        }
        // Bounds too long for nanoseconds in a u64: no overflow, no empty range.
        let b = Backoff::new(Duration::MAX, Duration::MAX).expect("ok");
        assert_eq!(b.start().next(), Duration::MAX);
    }
}
