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
            }),
        }
    }

    pub(crate) fn get(&self) -> Lease {
        *self.tx.borrow()
    }

    /// Records a renewal that started at `started` and is good until `deadline`. Refused (and
    /// the lease marked expired) if the old deadline has already passed: once the holder may
    /// have been told its lease is gone, it stays gone.
    pub(crate) fn renewed(&self, deadline: Instant) -> Result<(), LeaseLost> {
        let now = Instant::now();
        let mut outcome = Ok(());
        self.tx.send_modify(|lease| {
            if let Some(lost) = lease.lost_at(now) {
                lease.lost = Some(lost);
                outcome = Err(lost);
            } else if deadline > lease.deadline {
                lease.deadline = deadline;
            }
        });
        outcome
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

    #[tokio::test(start_paused = true)]
    async fn once_lost_the_lease_stays_lost() {
        let start = Instant::now();
        let cell = LeaseCell::new(start + Duration::from_millis(100));
        let watch = cell.watch(Arc::from(&b"n"[..]));
        assert!(cell.renewed(start + Duration::from_millis(200)).is_ok());
        assert_eq!(watch.remaining(), Duration::from_millis(200));
        tokio::time::advance(Duration::from_millis(250)).await;
        assert!(watch.is_lost());
        assert_eq!(watch.lost().await, LeaseLost::Expired);
        // A renewal that comes back after the deadline does not revive it.
        assert_eq!(
            cell.renewed(Instant::now() + Duration::from_secs(1)),
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
