//! [`LeaseClock`]: when a concurrency lease stops counting, as its holder can tell.

use std::future::{Future, poll_fn};
use std::pin::pin;
use std::sync::{Mutex, PoisonError};
use std::task::Poll;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::{Instant, sleep_until};

/// When a concurrency lease stops counting, as its holder can tell: a TTL after the check that
/// granted it was sent, moved on by each renewal the store accepts (a TTL after the renewal
/// was sent), or at once when a renewal finds the store no longer holds it. Never later than
/// the store's own expiry, which counts from when the store ran the check or renewal, a little
/// later: so long as both count real time (not with [`CheckOptions::at`](crate::CheckOptions),
/// a [`ManualClock`](crate::ManualClock), or a paused Tokio clock against a real store) and
/// the store's clock does not step. Once lost, a lease stays lost: a renewal accepted after
/// the deadline does not bring it back, since [`LeaseClock::lost`] may have resolved already.
///
/// [`ConcurrencyLease`](crate::ConcurrencyLease) keeps one, and floodgate-tower's `HeldLease`
/// too; a holder that renews its lease itself records what it learns with
/// [`LeaseClock::renewed`] and [`LeaseClock::lose`].
///
/// Times are on Tokio's clock ([`tokio::time::Instant`]), so that tests may pause it.
///
/// Public for floodgate's own crates (floodgate-tower); not part of the supported API.
#[doc(hidden)]
#[derive(Debug)]
pub struct LeaseClock {
    until: Mutex<Deadline>,
    changed: Notify,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Deadline {
    /// Counts until then, unless renewed.
    At(Instant),
    /// No TTL: counts until lost (a lease that holds nothing, as a check of cost 0 takes).
    Never,
    Lost,
}

impl LeaseClock {
    /// A lease granted by a check sent at `asked`, of `ttl` (`None`: no TTL).
    pub fn new(asked: Instant, ttl: Option<Duration>) -> Self {
        let until = match ttl {
            Some(ttl) => asked.checked_add(ttl).map_or(Deadline::Never, Deadline::At),
            None => Deadline::Never,
        };
        LeaseClock {
            until: Mutex::new(until),
            changed: Notify::new(),
        }
    }

    pub(crate) fn deadline(&self) -> Deadline {
        *self.until.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// When a renewal loop started at `start`, renewing every `period` (a third of the TTL),
    /// renews first: a period from now, or at once if the lease has less than two periods left
    /// (the loop began long after the grant, or the store was slow to answer: the TTL runs
    /// from when the check was sent).
    pub fn first_renewal(&self, start: Instant, period: Duration) -> Instant {
        match self.deadline() {
            Deadline::At(at) => at
                .checked_sub(period * 2)
                .unwrap_or(start)
                .clamp(start, start + period),
            _ => start + period,
        }
    }

    /// A renewal sent at `sent` was accepted by the store, for `ttl`: the lease counts until a
    /// TTL after `sent`. An answer that comes at or after the deadline marks the lease lost
    /// instead.
    pub fn renewed(&self, sent: Instant, ttl: Duration) {
        let mut until = self.until.lock().unwrap_or_else(PoisonError::into_inner);
        // Read under the lock: `lost` marks a passed deadline lost under it too.
        let now = Instant::now();
        *until = match *until {
            Deadline::At(held) if now < held => match sent.checked_add(ttl) {
                Some(later) => Deadline::At(held.max(later)),
                None => Deadline::At(held),
            },
            Deadline::Never => Deadline::Never,
            _ => Deadline::Lost,
        };
        drop(until);
        self.changed.notify_waiters();
    }

    /// The store no longer holds the lease (a renewal found it gone, or refused it for good).
    pub fn lose(&self) {
        *self.until.lock().unwrap_or_else(PoisonError::into_inner) = Deadline::Lost;
        self.changed.notify_waiters();
    }

    /// Marks the lease lost once its deadline `at` has passed, unless a renewal moved it.
    fn expire(&self, at: Instant) {
        let mut until = self.until.lock().unwrap_or_else(PoisonError::into_inner);
        if *until == Deadline::At(at) {
            *until = Deadline::Lost;
        }
    }

    /// Whether the lease has stopped counting by `now`.
    pub fn is_lost_at(&self, now: Instant) -> bool {
        match self.deadline() {
            Deadline::At(at) => now >= at,
            Deadline::Never => false,
            Deadline::Lost => true,
        }
    }

    /// Whether the lease has stopped counting.
    pub fn is_lost(&self) -> bool {
        self.is_lost_at(Instant::now())
    }

    /// Resolves when the lease stops counting; at once if it has. Needs a Tokio runtime with
    /// timers. Cancel-safe.
    pub async fn lost(&self) {
        loop {
            // Listening before looking, so that a change in between is not missed.
            let mut changed = pin!(self.changed.notified());
            changed.as_mut().enable();
            match self.deadline() {
                Deadline::Lost => return,
                Deadline::Never => changed.await,
                Deadline::At(at) => {
                    if Instant::now() >= at {
                        self.expire(at);
                        return;
                    }
                    // Woken by a change or by the deadline (which a renewal may have moved
                    // meanwhile): looked at again either way.
                    let mut deadline = pin!(sleep_until(at));
                    poll_fn(|cx| {
                        if changed.as_mut().poll(cx).is_ready()
                            || deadline.as_mut().poll(cx).is_ready()
                        {
                            Poll::Ready(())
                        } else {
                            Poll::Pending
                        }
                    })
                    .await;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    const TTL: Duration = Duration::from_millis(300);

    /// Whether `lost` has resolved, without waiting.
    async fn resolved(clock: &LeaseClock) -> bool {
        tokio::time::timeout(Duration::ZERO, clock.lost())
            .await
            .is_ok()
    }

    #[tokio::test(start_paused = true)]
    async fn an_accepted_renewal_moves_the_deadline_to_a_ttl_from_its_sending() {
        let t0 = Instant::now();
        let clock = LeaseClock::new(t0, Some(TTL));
        assert_eq!(clock.deadline(), Deadline::At(t0 + TTL));
        tokio::time::advance(Duration::from_millis(100)).await;
        let sent = Instant::now();
        // Answered 50 ms later: the TTL still counts from the sending.
        tokio::time::advance(Duration::from_millis(50)).await;
        clock.renewed(sent, TTL);
        assert_eq!(clock.deadline(), Deadline::At(sent + TTL));
        tokio::time::advance(Duration::from_millis(249)).await;
        assert!(!resolved(&clock).await && !clock.is_lost());
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(resolved(&clock).await && clock.is_lost());
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiting_lost_follows_a_moved_deadline_and_wakes_on_a_loss() {
        let t0 = Instant::now();
        let clock = Arc::new(LeaseClock::new(t0, Some(TTL)));
        let waiting = tokio::spawn({
            let clock = Arc::clone(&clock);
            async move {
                clock.lost().await;
                Instant::now()
            }
        });
        tokio::time::advance(Duration::from_millis(200)).await;
        clock.renewed(Instant::now(), TTL);
        // Past the first deadline: the moved one holds.
        tokio::time::advance(Duration::from_millis(200)).await;
        assert!(!waiting.is_finished());
        clock.lose();
        let lost_at = waiting.await.expect("task");
        assert_eq!(lost_at, t0 + Duration::from_millis(400));
        assert!(clock.is_lost());
    }

    #[tokio::test(start_paused = true)]
    async fn a_lost_lease_stays_lost_even_if_a_late_renewal_is_accepted() {
        let t0 = Instant::now();
        let clock = LeaseClock::new(t0, Some(TTL));
        let sent = t0 + Duration::from_millis(250);
        tokio::time::advance(TTL).await;
        assert!(resolved(&clock).await);
        clock.renewed(sent, TTL);
        assert_eq!(clock.deadline(), Deadline::Lost);
        assert!(resolved(&clock).await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_without_a_ttl_is_lost_only_when_told() {
        let t0 = Instant::now();
        let clock = LeaseClock::new(t0, None);
        assert!(!clock.is_lost_at(t0 + Duration::from_secs(1 << 30)));
        assert!(
            tokio::time::timeout(Duration::from_secs(3600), clock.lost())
                .await
                .is_err()
        );
        clock.renewed(Instant::now(), TTL);
        assert_eq!(clock.deadline(), Deadline::Never);
        clock.lose();
        assert!(resolved(&clock).await);
    }
}
