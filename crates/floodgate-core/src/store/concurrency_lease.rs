//! [`ConcurrencyLease`]: a concurrency lease that gives itself back when dropped.

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{Check, CheckOptions, LeaseClock, Limiter};
use crate::{Kind, LeaseId, MemoryLimiter, Policy, Verdict};

/// A concurrency lease held for the life of a value: released by
/// [`ConcurrencyLease::release`], or when dropped: at once for a [`MemoryLimiter`], otherwise
/// in the background, on the Tokio runtime the drop happens in. A lease that could not be
/// released (its process died, the store failed, or no runtime was left to run the release:
/// a lease dropped as `main` returns) lapses after its policy's lease TTL. Call
/// [`release`](ConcurrencyLease::release) where the work ends to have it back at once.
///
/// Binding the lease to `_` (`let (verdict, _) = ...`) drops it, and releases it, at once.
///
/// A lease lasts its policy's lease TTL unless renewed: for work that may run longer, renew it
/// in the background with [`renew_up_to`](ConcurrencyLease::renew_up_to) (or by hand with
/// [`renew`](ConcurrencyLease::renew)), and select on [`lost`](ConcurrencyLease::lost) to stop
/// the work when the lease no longer counts (its TTL passed without a renewal, or the store
/// lost it).
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
///     // An export may outlast the TTL: renewed meanwhile, for up to an hour.
///     let lease = lease.renew_up_to(Duration::from_secs(3600));
///     tokio::select! {
///         () = run_export() => {}
///         // The slot is no longer ours (the store lost the lease): stop.
///         () = lease.lost() => {}
///     }
///     lease.release().await?;
/// } else {
///     assert!(!verdict.allowed());
/// }
/// # Ok(())
/// # }
/// # async fn run_export() {}
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
    /// The concurrency checks the lease was taken with, but those of cost 0 (which hold
    /// nothing): (key, policy, cost).
    checks: Arc<[OwnedCheck]>,
    /// The lease's TTL (the shortest of its policies').
    ttl: Option<Duration>,
    /// When the lease stops counting.
    clock: Arc<LeaseClock>,
    /// The task renewing the lease ([`ConcurrencyLease::renew_up_to`]).
    renewing: Option<tokio::task::AbortHandle>,
}

/// A check the lease keeps: (key, policy, cost).
type OwnedCheck = (Box<[u8]>, Policy, u64);

impl<L> Held<L> {
    /// What a lease granted to `checks` (sent to `limiter` at `asked`) holds.
    fn new(limiter: L, checks: &[Check<'_>], asked: Instant) -> Self {
        // A check of cost 0 holds nothing: nothing to release or renew.
        let checks: Arc<[_]> = checks
            .iter()
            .filter(|c| matches!(c.policy.kind(), Kind::Concurrency(_)) && c.cost > 0)
            .map(|c| (Box::from(c.key), c.policy.clone(), c.cost))
            .collect();
        let ttl = checks
            .iter()
            .filter_map(|(_, policy, _)| match policy.kind() {
                Kind::Concurrency(c) => Some(Duration::from_micros(c.lease_ttl_us())),
                _ => None,
            })
            .min();
        Held {
            limiter,
            checks,
            ttl,
            clock: Arc::new(LeaseClock::new(asked, ttl)),
            renewing: None,
        }
    }

    fn checks(&self) -> Vec<Check<'_>> {
        owned_checks(&self.checks)
    }

    fn stop_renewing(&mut self) {
        if let Some(renewing) = self.renewing.take() {
            renewing.abort();
        }
    }
}

fn owned_checks(checks: &[OwnedCheck]) -> Vec<Check<'_>> {
    checks
        .iter()
        .map(|(key, policy, cost)| Check::new(key, policy).cost(*cost))
        .collect()
}

impl<L> Drop for Held<L> {
    fn drop(&mut self) {
        self.stop_renewing();
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
        let asked = Instant::now();
        let verdict = limiter.check(checks, opts).await?;
        let lease = verdict.lease.map(|id| ConcurrencyLease {
            id,
            held: Some(Held::new(limiter.clone(), checks, asked)),
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
            Some(mut held) => {
                held.stop_renewing();
                held.limiter.release(&held.checks(), self.id).await
            }
            None => Ok(()),
        }
    }

    /// Extends the lease to a whole lease TTL from now ([`Limiter::renew`]); `Ok(false)` when
    /// it had already lapsed (or was released) on some key, and is not held there any more.
    /// What it finds moves [`lost`](ConcurrencyLease::lost) on, or resolves it.
    ///
    /// A lease already [lost](ConcurrencyLease::is_lost) is not renewed: `Ok(false)`, without
    /// asking the store. Its holder was told the slot is gone; a renewal the store still
    /// accepted would hold a slot nobody counts on.
    ///
    /// # Errors
    /// The limiter's error.
    pub async fn renew(&self) -> Result<bool, L::Error> {
        match &self.held {
            Some(held) if !held.clock.is_lost() => {
                renew(&held.limiter, &held.checks, self.id, held.ttl, &held.clock).await
            }
            _ => Ok(false),
        }
    }

    /// Renews the lease in the background every third of its TTL, for at most `max` from
    /// now, until it is released or dropped: work that runs longer than the TTL keeps its
    /// slot, yet a process that dies gives it back within a TTL, and one that hangs within
    /// `max` and a TTL. A store that is down or slow is tried again at the next period (the TTL
    /// running on); a lease found lapsed, or that the store refuses for good, stops the renewal
    /// and is lost ([`lost`](ConcurrencyLease::lost)).
    ///
    /// Needs a Tokio runtime with timers: elsewhere, and for a lease whose policies have no
    /// TTL, it renews nothing; nor with a zero `max`. Calling it again changes nothing.
    #[must_use = "the lease is released when dropped"]
    pub fn renew_up_to(mut self, max: Duration) -> Self {
        let id = self.id;
        let Some(held) = &mut self.held else {
            return self;
        };
        let (Some(ttl), None, false) = (held.ttl, &held.renewing, max.is_zero()) else {
            return self;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return self;
        };
        let period = (ttl / 3).max(Duration::from_millis(1));
        let (limiter, checks, clock) = (
            held.limiter.clone(),
            Arc::clone(&held.checks),
            Arc::clone(&held.clock),
        );
        // The tower layer renews its leases with a loop of the same shape
        // (floodgate-tower's `engine::keep_alive`): keep the two alike.
        let task = runtime.spawn(async move {
            let start = Instant::now();
            let mut ticks = tokio::time::interval_at(clock.first_renewal(start, period), period);
            // A slow renewal does not make the next ones bunch up against the same slow store.
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                let tick = ticks.tick().await;
                // Lost (its deadline passed unrenewed): a renewal the store still accepts
                // would hold a slot its holder was told is gone.
                if tick.duration_since(start) > max || clock.is_lost() {
                    break;
                }
                match renew(&limiter, &checks, id, Some(ttl), &clock).await {
                    Ok(true) => {}
                    Ok(false) => break,
                    Err(e) if L::is_unavailable(&e) => {}
                    Err(_) => {
                        clock.lose();
                        break;
                    }
                }
            }
        });
        held.renewing = Some(task.abort_handle());
        self
    }

    /// Resolves when the lease stops counting, at once if it has: at its TTL, counted from
    /// when its check (or the last renewal the store accepted) was sent, never later than the
    /// store's own expiry when both count real time; or when a renewal finds the store no
    /// longer holds it. Once lost, it stays lost. It says when, not why (the renewal logs why).
    ///
    /// The future borrows nothing: select on it next to the work the lease is for, or hand it
    /// to another task. Needs a Tokio runtime with timers. Cancel-safe.
    pub fn lost(&self) -> impl Future<Output = ()> + Send + 'static {
        let clock = self.held.as_ref().map(|held| Arc::clone(&held.clock));
        async move {
            if let Some(clock) = clock {
                clock.lost().await;
            }
        }
    }

    /// Whether the lease has stopped counting (see [`lost`](ConcurrencyLease::lost)).
    pub fn is_lost(&self) -> bool {
        self.held.as_ref().is_none_or(|held| held.clock.is_lost())
    }

    /// Gives up the guard without releasing: the lease is held until its TTL, or until
    /// released by id ([`Limiter::release`]). Background renewal stops.
    pub fn forget(mut self) -> LeaseId {
        self.held = None;
        self.id
    }
}

/// Renews lease `id` over `checks` (of TTL `ttl`), telling `clock` what it finds.
async fn renew<L: Limiter>(
    limiter: &L,
    checks: &[OwnedCheck],
    id: LeaseId,
    ttl: Option<Duration>,
    clock: &LeaseClock,
) -> Result<bool, L::Error> {
    let sent = Instant::now();
    let held = limiter.renew(&owned_checks(checks), id).await?;
    match (held, ttl) {
        (true, Some(ttl)) => clock.renewed(sent, ttl),
        (true, None) => {}
        (false, _) => clock.lose(),
    }
    // A renewal the store accepted after the lease was lost (its TTL passed while the call
    // was under way) does not bring it back: lost stays lost, and says so.
    Ok(held && !clock.is_lost())
}

impl<L> Drop for ConcurrencyLease<L>
where
    L: Limiter + Clone + 'static,
{
    fn drop(&mut self) {
        let Some(mut held) = self.held.take() else {
            return;
        };
        held.stop_renewing();
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
            held: Some(Held::new(limiter.clone(), &checks, Instant::now())),
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

    fn one_of(ttl: Duration) -> Policy {
        Policy::concurrency(1, ttl)
            .and_then(|p| p.named("one-timed"))
            .expect("policy")
    }

    /// `lease` still counts, for its holder and in the store (no other can take the slot).
    async fn assert_still_held(
        lease: &ConcurrencyLease<MemoryLimiter>,
        limiter: &MemoryLimiter,
        policy: &Policy,
        why: &str,
    ) {
        assert!(!lease.is_lost(), "{why}");
        assert!(take(limiter, policy).await.is_none(), "lapsed in the store");
    }

    /// Waits up to 5 s for `lease` to be lost; how long since `began`.
    async fn time_to_loss(lease: &ConcurrencyLease<MemoryLimiter>, began: Instant) -> Duration {
        tokio::time::timeout(Duration::from_secs(5), lease.lost())
            .await
            .expect("the lease was never lost");
        assert!(lease.is_lost());
        began.elapsed()
    }

    /// Whether the slot comes free within 200 ms (the store expires a lease a little after
    /// `lost` gives it up, never before).
    async fn slot_frees_soon(limiter: &MemoryLimiter, policy: &Policy) -> bool {
        let deadline = Instant::now() + Duration::from_millis(200);
        loop {
            if let Some(lease) = take(limiter, policy).await {
                drop(lease);
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn an_unrenewed_lease_is_lost_at_its_ttl() {
        let (limiter, policy) = (MemoryLimiter::new(), one_of(Duration::from_millis(300)));
        let began = Instant::now();
        let lease = take(&limiter, &policy).await.expect("admitted");
        assert!(!lease.is_lost());
        let took = time_to_loss(&lease, began).await;
        assert!(took >= Duration::from_millis(300), "lost early: {took:?}");
        assert!(slot_frees_soon(&limiter, &policy).await);
    }

    #[tokio::test]
    async fn a_renewed_lease_outlives_its_ttl_and_is_lost_a_ttl_after_its_bound() {
        let (limiter, policy) = (MemoryLimiter::new(), one_of(Duration::from_millis(900)));
        let began = Instant::now();
        let lease = take(&limiter, &policy)
            .await
            .expect("admitted")
            .renew_up_to(Duration::from_millis(1_200));
        // Renewed every 300 ms up to 1.2 s: held until about 2.1 s (1.8 s if the last tick
        // came late and was skipped).
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        assert_still_held(&lease, &limiter, &policy, "lost while renewed").await;
        let took = time_to_loss(&lease, began).await;
        assert!(took >= Duration::from_millis(1_800), "{took:?}");
        assert!(slot_frees_soon(&limiter, &policy).await);
    }

    #[tokio::test]
    async fn a_lease_over_a_check_of_cost_zero_renews_its_other_keys() {
        let (limiter, policy) = (MemoryLimiter::new(), one_of(Duration::from_millis(600)));
        // The peek (cost 0) holds nothing: renewing it must not find the lease gone.
        let checks = [
            Check::new(b"k", &policy),
            Check::new(b"peeked", &policy).cost(0),
        ];
        let (_, lease) = ConcurrencyLease::check(&limiter, &checks, CheckOptions::default())
            .await
            .expect("check");
        let lease = lease
            .expect("admitted")
            .renew_up_to(Duration::from_secs(60));
        tokio::time::sleep(Duration::from_millis(900)).await;
        assert_still_held(&lease, &limiter, &policy, "lost for the key it never held").await;
    }

    #[tokio::test]
    async fn renewing_long_after_the_grant_renews_at_once() {
        let (limiter, policy) = (MemoryLimiter::new(), one_of(Duration::from_millis(900)));
        let lease = take(&limiter, &policy).await.expect("admitted");
        // Two thirds of the TTL gone: waiting a period for the first renewal would be too late.
        tokio::time::sleep(Duration::from_millis(700)).await;
        let lease = lease.renew_up_to(Duration::from_secs(60));
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_still_held(&lease, &limiter, &policy, "lost before its first renewal").await;
    }

    #[tokio::test]
    async fn a_renewal_that_finds_the_lease_gone_loses_it_before_its_ttl() {
        let (limiter, policy) = (MemoryLimiter::new(), one_of(Duration::from_secs(3)));
        let lease = take(&limiter, &policy)
            .await
            .expect("admitted")
            .renew_up_to(Duration::from_secs(60));
        // Released behind its back (as a store that lost it would say).
        let began = Instant::now();
        limiter
            .release(&[Check::new(b"k", &policy)], lease.id())
            .await
            .expect("release");
        // Renewals every second: the first one finds it gone.
        let took = time_to_loss(&lease, began).await;
        assert!(took < Duration::from_secs(2), "lost at its TTL: {took:?}");
    }

    #[tokio::test]
    async fn a_renewal_by_hand_moves_the_deadline_or_loses_the_lease() {
        let (limiter, policy) = (MemoryLimiter::new(), one_of(Duration::from_secs(1)));
        let lease = take(&limiter, &policy).await.expect("admitted");
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(lease.renew().await.expect("renew"));
        // Past the first TTL, well within the renewed one.
        tokio::time::sleep(Duration::from_millis(700)).await;
        assert!(!lease.is_lost(), "the renewal did not move the deadline");
        limiter
            .release(&[Check::new(b"k", &policy)], lease.id())
            .await
            .expect("release");
        assert!(!lease.renew().await.expect("renew"));
        assert!(
            lease.is_lost(),
            "a renewal that found it gone did not lose it"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_lost_lease_is_not_renewed_by_hand_though_the_store_still_holds_it() {
        // The store counts real time, the lease's clock Tokio's: paused and moved past the
        // TTL, the holder has lost the lease while the store still holds it.
        let (limiter, policy) = (MemoryLimiter::new(), one_of(Duration::from_secs(10)));
        let lease = take(&limiter, &policy).await.expect("admitted");
        tokio::time::advance(Duration::from_secs(11)).await;
        assert!(lease.is_lost(), "past its TTL on the lease's clock");
        assert!(
            take(&limiter, &policy).await.is_none(),
            "still held in the store"
        );
        assert!(
            !lease.renew().await.expect("renew"),
            "a lost lease was renewed"
        );
        assert!(lease.is_lost(), "once lost, it stays lost");
    }
}
