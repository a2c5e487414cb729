//! The store's health, as the layer sees it: a small circuit breaker that stops asking a
//! failing store for a while, and logs each change of state once instead of every error.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::telemetry::due;

pub(crate) struct StoreHealth {
    epoch: Instant,
    failing: AtomicBool,
    /// While failing: milliseconds since `epoch` after which one request probes the store.
    next_probe_ms: AtomicU64,
    /// While failing: milliseconds since `epoch` after which an error is logged at warn level
    /// again.
    next_warn_ms: AtomicU64,
    retry_interval: Duration,
    policy: &'static str,
}

/// What a request does with the store (see [`StoreHealth::admit`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Admit {
    Skip,
    Probe,
    Ask,
}

/// Errors while failing are logged at warn level at most this often.
const WARN_EVERY: Duration = Duration::from_secs(10);

impl StoreHealth {
    pub(crate) fn new(retry_interval: Duration, policy: &'static str) -> Self {
        StoreHealth {
            epoch: Instant::now(),
            failing: AtomicBool::new(false),
            next_probe_ms: AtomicU64::new(0),
            next_warn_ms: AtomicU64::new(0),
            retry_interval,
            policy,
        }
    }

    fn now_ms(&self) -> u64 {
        millis(self.epoch.elapsed())
    }

    /// Whether to skip the store for this request: it is failing and it is not yet time to
    /// probe it again. One request per interval gets to probe.
    pub(crate) fn skip_store(&self) -> bool {
        self.admit() == Admit::Skip
    }

    /// What this request does with the store: skip it (failing, and not yet time to probe),
    /// probe it (the one request of the interval while failing; every request, with no retry
    /// interval), or ask it as usual (not failing).
    pub(crate) fn admit(&self) -> Admit {
        if !self.failing.load(Ordering::Relaxed) {
            return Admit::Ask;
        }
        if self.retry_interval.is_zero() {
            return Admit::Probe;
        }
        if due(
            &self.next_probe_ms,
            self.now_ms(),
            millis(self.retry_interval),
        ) {
            Admit::Probe
        } else {
            Admit::Skip
        }
    }

    pub(crate) fn is_failing(&self) -> bool {
        self.failing.load(Ordering::Relaxed)
    }

    pub(crate) fn retry_interval(&self) -> Duration {
        self.retry_interval
    }

    pub(crate) fn succeeded(&self) {
        if self.failing.load(Ordering::Relaxed) && self.failing.swap(false, Ordering::AcqRel) {
            tracing::info!(
                target: "floodgate",
                "rate-limit store is answering again; decisions are back on the store"
            );
        }
    }

    pub(crate) fn failed(&self, error: &dyn fmt::Display) {
        let now = self.now_ms();
        if !self.retry_interval.is_zero() {
            self.next_probe_ms.store(
                now.saturating_add(millis(self.retry_interval)),
                Ordering::Relaxed,
            );
        }
        if !self.failing.swap(true, Ordering::AcqRel) {
            self.next_warn_ms
                .store(now.saturating_add(millis(WARN_EVERY)), Ordering::Relaxed);
            tracing::warn!(
                target: "floodgate",
                error = %error,
                on_store_error = self.policy,
                "rate-limit store failed; applying the failure policy until it answers again"
            );
            return;
        }
        if due(&self.next_warn_ms, now, millis(WARN_EVERY)) {
            tracing::warn!(
                target: "floodgate",
                error = %error,
                on_store_error = self.policy,
                "rate-limit store still failing"
            );
        } else {
            tracing::debug!(target: "floodgate", error = %error, "rate-limit store failed");
        }
    }
}

impl fmt::Debug for StoreHealth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreHealth")
            .field("failing", &self.is_failing())
            .field("retry_interval", &self.retry_interval)
            .finish()
    }
}

/// Whole milliseconds, saturating (a configured interval may be `Duration::MAX`).
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skips_until_the_probe() {
        let h = StoreHealth::new(Duration::from_secs(3600), "fail_open");
        assert!(!h.skip_store());
        h.failed(&"boom");
        assert!(h.is_failing());
        assert!(h.skip_store());
        h.succeeded();
        assert!(!h.skip_store());
        // A zero interval never skips: while failing, every request probes (only a probe's
        // answer, the store's own, says it is back).
        let h = StoreHealth::new(Duration::ZERO, "fail_open");
        assert_eq!(h.admit(), Admit::Ask);
        h.failed(&"boom");
        assert!(!h.skip_store());
        assert_eq!(h.admit(), Admit::Probe);
        assert_eq!(h.admit(), Admit::Probe);
        h.succeeded();
        assert_eq!(h.admit(), Admit::Ask);
        // The first request after the interval probes, the others still skip.
        let h = StoreHealth::new(Duration::from_millis(1), "fail_open");
        h.failed(&"boom");
        std::thread::sleep(Duration::from_millis(5));
        assert!(!h.skip_store());
        assert!(h.skip_store());
        // An interval of `Duration::MAX` waits for ever, without overflowing.
        let h = StoreHealth::new(Duration::MAX, "fail_open");
        h.failed(&"boom");
        h.failed(&"boom again");
        assert!(h.skip_store());
        assert!(h.skip_store());
    }
}
