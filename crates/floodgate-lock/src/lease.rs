//! The holder's view of its lease: until when it may trust it, and whether it is lost.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::LeaseLost;

#[derive(Debug, Clone, Copy)]
pub(crate) struct Lease {
    /// Until when the holder may trust the lease (start of the last successful acquisition or
    /// renewal + ttl - clock drift).
    pub(crate) deadline: Instant,
    pub(crate) lost: Option<LeaseLost>,
    /// When the store's answer to the last acquisition or renewal arrived: a renewal that
    /// started later ran in the store after it, so its deadline replaces the old one.
    settled: Instant,
}

impl Lease {
    fn lost_at(&self, now: Instant) -> Option<LeaseLost> {
        self.lost
            .or_else(|| (now >= self.deadline).then_some(LeaseLost::Expired))
    }
}

/// The writing side, shared by the guard and its watchdog.
#[derive(Debug)]
pub(crate) struct LeaseCell {
    tx: watch::Sender<Lease>,
}

impl LeaseCell {
    pub(crate) fn new(deadline: Instant) -> Self {
        Self {
            tx: watch::Sender::new(Lease {
                deadline,
                lost: None,
                settled: Instant::now(),
            }),
        }
    }

    pub(crate) fn get(&self) -> Lease {
        *self.tx.borrow()
    }

    /// Records a renewal that started at `started` and is good until `deadline`. Refused (and
    /// the lease marked expired) if the old deadline has already passed: once the holder may
    /// have been told its lease is gone, it stays gone.
    ///
    /// The store keeps the expiry its last renewal set, shorter or longer than before, so the
    /// new deadline replaces the old one, even when it is sooner (`extend_for` a shorter ttl).
    /// Two renewals that overlapped may have run in the store in either order: then the sooner
    /// of the two deadlines stands.
    pub(crate) fn renewed(&self, started: Instant, deadline: Instant) -> Result<(), LeaseLost> {
        let now = Instant::now();
        let mut outcome = Ok(());
        self.tx.send_modify(|lease| {
            if let Some(lost) = lease.lost_at(now) {
                lease.lost = Some(lost);
                outcome = Err(lost);
                return;
            }
            lease.deadline = if started >= lease.settled {
                deadline
            } else {
                lease.deadline.min(deadline)
            };
            lease.settled = lease.settled.max(now);
        });
        outcome
    }

    /// An extension that started at `started` and would have made the lease good until
    /// `deadline` has an unknown outcome: it may have set that expiry in the store. The
    /// deadline comes forward to it if it is sooner, and a renewal that started before this
    /// one and answers later may have run before it in the store: it can no longer push the
    /// deadline back (see [`LeaseCell::renewed`]).
    pub(crate) fn at_most(&self, started: Instant, deadline: Instant) {
        self.bring_forward(started, deadline, true);
    }

    /// The store, asked at `started`, said the lease lasts until `deadline`: the deadline comes
    /// forward to it if it is sooner, and renewals that started before can no longer push it
    /// back. A later deadline changes nothing (renewals answering later stay trusted).
    pub(crate) fn verified(&self, started: Instant, deadline: Instant) {
        self.bring_forward(started, deadline, false);
    }

    /// The deadline at most `deadline`; renewals started before `started` ordered after it
    /// when it came forward, or `always`.
    fn bring_forward(&self, started: Instant, deadline: Instant, always: bool) {
        self.tx.send_if_modified(|lease| {
            let sooner = deadline < lease.deadline;
            if sooner || always {
                lease.settled = lease.settled.max(started);
            }
            if sooner {
                lease.deadline = deadline;
            }
            sooner
        });
    }

    /// Marks the lease lost (the first reason sticks).
    pub(crate) fn lose(&self, reason: LeaseLost) {
        self.tx.send_if_modified(|lease| {
            if lease.lost.is_some() {
                return false;
            }
            lease.lost = Some(reason);
            true
        });
    }

    /// Marks the lease expired if its deadline has passed; returns why it is lost, if it is.
    pub(crate) fn check(&self) -> Option<LeaseLost> {
        let now = Instant::now();
        let lease = self.get();
        let lost = lease.lost_at(now);
        if let (Some(reason), None) = (lost, lease.lost) {
            self.lose(reason);
        }
        lost
    }

    /// Notified of every renewal and loss (for the watchdog).
    pub(crate) fn subscribe(&self) -> watch::Receiver<Lease> {
        self.tx.subscribe()
    }

    pub(crate) fn watch(&self, name: Arc<[u8]>) -> LeaseWatch {
        LeaseWatch {
            rx: self.tx.subscribe(),
            name,
        }
    }
}

/// A handle on a guard's lease that other tasks can hold: whether it is still ours, for how
/// long, and a future that resolves when it is lost. Cloning is cheap.
///
/// The lease is lost when the watchdog (or an [`extend`](crate::LockGuard::extend)) learns that
/// the store no longer holds it for us, when its deadline passes without a renewal, or when
/// the guard is released or dropped. Once lost, it stays lost.
#[derive(Debug, Clone)]
pub struct LeaseWatch {
    rx: watch::Receiver<Lease>,
    name: Arc<[u8]>,
}

impl LeaseWatch {
    /// The lock's name.
    pub fn name(&self) -> &[u8] {
        &self.name
    }

    /// True once the lease is lost.
    pub fn is_lost(&self) -> bool {
        self.rx.borrow().lost_at(Instant::now()).is_some()
    }

    /// How much longer the lease can be trusted (zero once lost). Conservative: measured from
    /// before the request that took or renewed it.
    pub fn remaining(&self) -> Duration {
        let lease = *self.rx.borrow();
        if lease.lost.is_some() {
            return Duration::ZERO;
        }
        lease.deadline.saturating_duration_since(Instant::now())
    }

    /// Resolves, with the reason, when the lease is lost. Select on it next to the critical
    /// section to stop as soon as the lock may belong to someone else.
    pub fn lost(&self) -> impl Future<Output = LeaseLost> + Send + use<> {
        let mut rx = self.rx.clone();
        async move {
            loop {
                let lease = *rx.borrow_and_update();
                if let Some(reason) = lease.lost_at(Instant::now()) {
                    return reason;
                }
                tokio::select! {
                    changed = rx.changed() => {
                        if changed.is_err() {
                            // The guard and its watchdog are gone.
                            return rx.borrow().lost.unwrap_or(LeaseLost::Released);
                        }
                    }
                    () = tokio::time::sleep_until(lease.deadline) => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An extension with an unknown outcome (started at 10 s, for 2 s) brings the deadline
    /// forward; a renewal that started before it (at 9.9 s, for 30 s) and answers after it
    /// may have run first in the store: it does not push the deadline back.
    #[tokio::test(start_paused = true)]
    async fn an_unknown_extension_is_not_undone_by_an_earlier_renewal() {
        let start = Instant::now();
        let cell = LeaseCell::new(start + Duration::from_secs(60));
        let ms = |n| start + Duration::from_millis(n);
        cell.at_most(ms(10_000), ms(12_000));
        assert_eq!(cell.get().deadline, ms(12_000));
        tokio::time::advance(Duration::from_millis(10_300)).await;
        assert!(cell.renewed(ms(9_900), ms(39_900)).is_ok());
        assert_eq!(cell.get().deadline, ms(12_000));
        // A renewal that started after it ran after it: its deadline stands.
        assert!(cell.renewed(ms(10_300), ms(40_300)).is_ok());
        assert_eq!(cell.get().deadline, ms(40_300));
    }

    #[tokio::test(start_paused = true)]
    async fn once_lost_the_lease_stays_lost() {
        let start = Instant::now();
        let cell = LeaseCell::new(start + Duration::from_millis(100));
        let watch = cell.watch(Arc::from(&b"n"[..]));
        assert!(
            cell.renewed(start, start + Duration::from_millis(200))
                .is_ok()
        );
        assert_eq!(watch.remaining(), Duration::from_millis(200));
        tokio::time::advance(Duration::from_millis(250)).await;
        assert!(watch.is_lost());
        assert_eq!(watch.lost().await, LeaseLost::Expired);
        // A renewal that comes back after the deadline does not revive it.
        assert_eq!(
            cell.renewed(Instant::now(), Instant::now() + Duration::from_secs(1)),
            Err(LeaseLost::Expired)
        );
        assert!(watch.is_lost());
        cell.lose(LeaseLost::NotHeld);
        assert_eq!(
            cell.check(),
            Some(LeaseLost::Expired),
            "the first reason sticks"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_later_renewal_replaces_the_deadline_and_overlapping_ones_keep_the_sooner() {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        let cell = LeaseCell::new(t0 + ms(100));
        tokio::time::advance(ms(10)).await;
        // Started after the acquisition settled: replaces, longer or shorter.
        assert!(cell.renewed(t0 + ms(10), t0 + ms(500)).is_ok());
        assert_eq!(cell.get().deadline, t0 + ms(500));
        // Started before that renewal settled: the two may have run in either order.
        assert!(cell.renewed(t0 + ms(5), t0 + ms(300)).is_ok());
        assert_eq!(cell.get().deadline, t0 + ms(300));
        assert!(cell.renewed(t0 + ms(5), t0 + ms(900)).is_ok());
        assert_eq!(cell.get().deadline, t0 + ms(300));
        // A shorter renewal after them all: the store now expires sooner, and so do we.
        tokio::time::advance(ms(10)).await;
        assert!(cell.renewed(t0 + ms(20), t0 + ms(120)).is_ok());
        assert_eq!(cell.get().deadline, t0 + ms(120));
    }

    #[tokio::test(start_paused = true)]
    async fn lost_resolves_on_an_explicit_loss_and_when_the_guard_is_gone() {
        let cell = LeaseCell::new(Instant::now() + Duration::from_secs(60));
        let watch = cell.watch(Arc::from(&b"n"[..]));
        let lost = tokio::spawn(watch.lost());
        tokio::task::yield_now().await;
        cell.lose(LeaseLost::NotHeld);
        assert_eq!(lost.await.expect("task"), LeaseLost::NotHeld);

        let cell = LeaseCell::new(Instant::now() + Duration::from_secs(60));
        let lost = cell.watch(Arc::from(&b"n"[..])).lost();
        drop(cell);
        assert_eq!(lost.await, LeaseLost::Released);
    }
}
