//! [`ConcurrencyLease`]: a concurrency lease that gives itself back when dropped.

use std::any::Any;
use std::fmt;

use super::{Check, CheckOptions, Limiter};
use crate::{LeaseId, MemoryLimiter, Policy, Verdict};

/// A concurrency lease held for the life of a value: released by
/// [`ConcurrencyLease::release`], or when dropped: at once for a [`MemoryLimiter`], otherwise
/// in the background, on the Tokio runtime the drop happens in. A lease that could not be
/// released (its process died, the store failed, or no runtime was left to run the release:
/// a lease dropped as `main` returns) lapses after its policy's lease TTL. Call
/// [`release`](ConcurrencyLease::release) where the work ends to have it back at once.
///
/// Binding the lease to `_` (`let (verdict, _) = ...`) drops it, and releases it, at once.
///
/// ```
/// use std::time::Duration;
/// use floodgate_core::{Check, CheckOptions, ConcurrencyLease, MemoryLimiter, Policy};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let limiter = MemoryLimiter::new();
/// // At most 2 exports at once per tenant.
/// let exports = Policy::concurrency(2, Duration::from_secs(600))?.named("exports")?;
/// let checks = [Check::new(b"tenant-7", &exports)];
/// let (verdict, lease) = ConcurrencyLease::check(&limiter, &checks, CheckOptions::default()).await?;
/// if let Some(lease) = lease {
///     // ... run the export ...
///     lease.release().await?;
/// } else {
///     assert!(!verdict.allowed());
/// }
/// # Ok(())
/// # }
/// ```
#[must_use = "dropping the lease releases it at once"]
pub struct ConcurrencyLease<L>
where
    L: Limiter + Clone + 'static,
{
    id: LeaseId,
    /// `None` once released or forgotten.
    held: Option<Held<L>>,
}

struct Held<L> {
    limiter: L,
    /// The concurrency checks the lease was taken with: (key, policy, cost).
    checks: Vec<(Box<[u8]>, Policy, u64)>,
}

impl<L> Held<L> {
    fn checks(&self) -> Vec<Check<'_>> {
        self.checks
            .iter()
            .map(|(key, policy, cost)| Check::new(key, policy).cost(*cost))
            .collect()
    }
}

impl<L> ConcurrencyLease<L>
where
    L: Limiter + Clone + 'static,
{
    /// Checks `checks` as [`Limiter::check`] does. When they are allowed and take a
    /// concurrency lease, the lease comes back as a [`ConcurrencyLease`] holding a clone of
    /// `limiter`.
    ///
    /// # Errors
    /// The limiter's error.
    pub async fn check(
        limiter: &L,
        checks: &[Check<'_>],
        opts: CheckOptions,
    ) -> Result<(Verdict, Option<ConcurrencyLease<L>>), L::Error> {
        let verdict = limiter.check(checks, opts).await?;
        let lease = verdict.lease.map(|id| ConcurrencyLease {
            id,
            held: Some(Held {
                limiter: limiter.clone(),
                checks: checks
                    .iter()
                    .filter(|c| matches!(c.policy.kind(), crate::Kind::Concurrency(_)))
                    .map(|c| (Box::from(c.key), c.policy.clone(), c.cost))
                    .collect(),
            }),
        });
        Ok((verdict, lease))
    }

    /// The lease's id.
    pub fn id(&self) -> LeaseId {
        self.id
    }

    /// Releases the lease now.
    ///
    /// # Errors
    /// The limiter's error; the lease then lapses after its TTL.
    pub async fn release(mut self) -> Result<(), L::Error> {
        match self.held.take() {
            Some(held) => held.limiter.release(&held.checks(), self.id).await,
            None => Ok(()),
        }
    }

    /// Extends the lease to a whole lease TTL from now ([`Limiter::renew`]); `Ok(false)` when
    /// it had already lapsed (or was released) on some key, and is not held there any more.
    ///
    /// # Errors
    /// The limiter's error.
    pub async fn renew(&self) -> Result<bool, L::Error> {
        match &self.held {
            Some(held) => held.limiter.renew(&held.checks(), self.id).await,
            None => Ok(false),
        }
    }

    /// Gives up the guard without releasing: the lease is held until its TTL, or until
    /// released by id ([`Limiter::release`]).
    pub fn forget(mut self) -> LeaseId {
        self.held = None;
        self.id
    }
}

impl<L> Drop for ConcurrencyLease<L>
where
    L: Limiter + Clone + 'static,
{
    fn drop(&mut self) {
        let Some(held) = self.held.take() else {
            return;
        };
        let id = self.id;
        if let Some(memory) = (&held.limiter as &dyn Any).downcast_ref::<MemoryLimiter>() {
            memory.release_sync(&held.checks(), id);
            return;
        }
        // A store's futures may need a runtime even to be polled once (timers, I/O).
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                // A failed release lapses with the lease's TTL; the store's own timeout bounds
                // the wait.
                let _ = held.limiter.release(&held.checks(), id).await;
            });
        }
    }
}

impl<L> fmt::Debug for ConcurrencyLease<L>
where
    L: Limiter + Clone + 'static,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConcurrencyLease")
            .field("id", &self.id)
            .field("held", &self.held.is_some())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::MemoryLimiter;

    fn one_at_a_time() -> Policy {
        Policy::concurrency(1, Duration::from_secs(600))
            .and_then(|p| p.named("one"))
            .expect("policy")
    }

    async fn take(
        limiter: &MemoryLimiter,
        policy: &Policy,
    ) -> Option<ConcurrencyLease<MemoryLimiter>> {
        let checks = [Check::new(b"k", policy)];
        let (verdict, lease) = ConcurrencyLease::check(limiter, &checks, CheckOptions::default())
            .await
            .expect("check");
        assert_eq!(verdict.allowed(), lease.is_some());
        lease
    }

    #[test]
    fn a_memory_lease_dropped_outside_a_runtime_is_given_back() {
        let (limiter, policy) = (MemoryLimiter::new(), one_at_a_time());
        let checks = [Check::new(b"k", &policy)];
        let verdict = limiter
            .check_sync(&checks, CheckOptions::default())
            .expect("check");
        let lease = ConcurrencyLease {
            id: verdict.lease.expect("a lease"),
            held: Some(Held {
                limiter: limiter.clone(),
                checks: vec![(Box::from(&b"k"[..]), policy.clone(), 1)],
            }),
        };
        assert!(
            !limiter
                .check_sync(&checks, CheckOptions::default())
                .expect("check")
                .allowed()
        );
        drop(lease);
        assert!(
            limiter
                .check_sync(&checks, CheckOptions::default())
                .expect("check")
                .allowed()
        );
    }

    #[tokio::test]
    async fn a_dropped_lease_is_given_back() {
        let (limiter, policy) = (MemoryLimiter::new(), one_at_a_time());
        let lease = take(&limiter, &policy)
            .await
            .expect("the first is admitted");
        assert!(take(&limiter, &policy).await.is_none(), "one at a time");
        drop(lease);
        // The release runs on the runtime.
        tokio::task::yield_now().await;
        assert!(
            take(&limiter, &policy).await.is_some(),
            "given back on drop"
        );
    }

    #[tokio::test]
    async fn release_gives_it_back_and_forget_keeps_it() {
        let (limiter, policy) = (MemoryLimiter::new(), one_at_a_time());
        let lease = take(&limiter, &policy).await.expect("admitted");
        lease.release().await.expect("release");
        let lease = take(&limiter, &policy).await.expect("admitted again");
        let id = lease.forget();
        assert!(take(&limiter, &policy).await.is_none(), "still held");
        limiter
            .release(&[Check::new(b"k", &policy)], id)
            .await
            .expect("release by id");
        assert!(take(&limiter, &policy).await.is_some());
    }

    #[tokio::test]
    async fn a_check_without_a_concurrency_policy_has_no_lease() {
        let limiter = MemoryLimiter::new();
        let policy = Policy::per_second(5).expect("policy");
        let (verdict, lease) = ConcurrencyLease::check(
            &limiter,
            &[Check::new(b"k", &policy)],
            CheckOptions::default(),
        )
        .await
        .expect("check");
        assert!(verdict.allowed() && lease.is_none());
    }
}
