//! Shared by the tests of limiter wrappers (deny cache, leasing): an instrumented store.

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use floodgate_core::{
    Check, CheckOptions, LeaseId, Limiter, MemoryError, MemoryLimiter, Policy, Verdict,
};

/// A memory store that counts the calls that reach it and the units it granted, and takes as
/// long per call as its delay says (a store round trip, or a store that hangs).
#[derive(Clone)]
pub struct Store {
    pub inner: MemoryLimiter,
    pub calls: Arc<AtomicU64>,
    pub granted: Arc<AtomicU64>,
    /// The most calls that were in the store at once.
    pub most_at_once: Arc<AtomicU64>,
    in_flight: Arc<AtomicU64>,
    delay_us: Arc<AtomicU64>,
    /// How long an answer is held after the store decided (a reply on its way back).
    reply_delay_us: Arc<AtomicU64>,
    /// Whether checks fail (a store that is down), after their delay.
    failing: Arc<AtomicBool>,
}

impl Store {
    /// A store that answers at once.
    pub fn new() -> Self {
        Store {
            inner: MemoryLimiter::new(),
            calls: Arc::new(AtomicU64::new(0)),
            granted: Arc::new(AtomicU64::new(0)),
            most_at_once: Arc::new(AtomicU64::new(0)),
            in_flight: Arc::new(AtomicU64::new(0)),
            delay_us: Arc::new(AtomicU64::new(0)),
            reply_delay_us: Arc::new(AtomicU64::new(0)),
            failing: Arc::new(AtomicBool::new(false)),
        }
    }

    /// A store whose calls take `delay`.
    pub fn with_delay(delay: Duration) -> Self {
        let store = Store::new();
        store.set_delay(delay);
        store
    }

    /// From now on, checks are decided at once and answered `delay` later (also for the
    /// clones of this store).
    pub fn set_reply_delay(&self, delay: Duration) {
        let us = u64::try_from(delay.as_micros()).unwrap_or(u64::MAX);
        self.reply_delay_us.store(us, Ordering::Relaxed);
    }

    /// From now on, checks fail, or no longer fail (also for the clones of this store).
    pub fn set_failing(&self, failing: bool) {
        self.failing.store(failing, Ordering::Relaxed);
    }

    /// From now on, calls take `delay` (also for the clones of this store).
    pub fn set_delay(&self, delay: Duration) {
        let us = u64::try_from(delay.as_micros()).unwrap_or(u64::MAX);
        self.delay_us.store(us, Ordering::Relaxed);
    }
}

impl Limiter for Store {
    type Error = MemoryError;

    async fn check(
        &self,
        checks: &[Check<'_>],
        opts: CheckOptions,
    ) -> Result<Verdict, MemoryError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let at_once = self.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        self.most_at_once.fetch_max(at_once, Ordering::Relaxed);
        let delay = self.delay_us.load(Ordering::Relaxed);
        if delay > 0 {
            tokio::time::sleep(Duration::from_micros(delay)).await;
        }
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        if self.failing.load(Ordering::Relaxed) {
            return Err(MemoryError::InvalidCheck("the store is down".into()));
        }
        let verdict = self.inner.check(checks, opts).await?;
        let reply_delay = self.reply_delay_us.load(Ordering::Relaxed);
        if reply_delay > 0 {
            tokio::time::sleep(Duration::from_micros(reply_delay)).await;
        }
        if verdict.allowed() {
            self.granted
                .fetch_add(checks.iter().map(|c| c.cost).sum(), Ordering::Relaxed);
        }
        Ok(verdict)
    }

    async fn release(&self, checks: &[Check<'_>], lease: LeaseId) -> Result<(), MemoryError> {
        self.inner.release(checks, lease).await
    }

    async fn renew(&self, checks: &[Check<'_>], lease: LeaseId) -> Result<bool, MemoryError> {
        let delay = self.delay_us.load(Ordering::Relaxed);
        if delay > 0 {
            tokio::time::sleep(Duration::from_micros(delay)).await;
        }
        self.inner.renew(checks, lease).await
    }

    async fn refund(&self, checks: &[Check<'_>], verdict: &Verdict) -> Result<(), MemoryError> {
        self.inner.refund(checks, verdict).await
    }

    async fn reset(&self, key: &[u8], policy: &Policy) -> Result<(), MemoryError> {
        self.inner.reset(key, policy).await
    }
}
