//! The proof of holding a lock: release, renewal, the watchdog, and the fencing token.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use floodgate_core::LockStore;
use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::lease::{LeaseCell, LeaseWatch};
use crate::token::Token;
use crate::{Error, LeaseLost};

/// Attempts of [`LockGuard::release`] when the store fails transiently.
const RELEASE_ATTEMPTS: u32 = 4;
/// The first pause between them (doubling).
const RELEASE_BACKOFF: Duration = Duration::from_millis(25);

/// What a guard and its watchdog share.
pub(crate) struct Held<S> {
    pub(crate) store: S,
    pub(crate) name: Arc<[u8]>,
    pub(crate) token: Token,
    pub(crate) ttl: Duration,
    pub(crate) lease: LeaseCell,
}

impl<S: LockStore> Held<S> {
    /// Extends the lease to `ttl` from now in the store and records the new deadline.
    async fn extend(&self, ttl: Duration) -> Result<(), Error>
    where
        Error: From<S::Error>,
    {
        if let Some(reason) = self.lease.check() {
            return Err(Error::lost(&self.name, reason));
        }
        let started = Instant::now();
        let deadline = self.lease.get().deadline;
        // The drift allowance of this ttl, which may not be the lock's.
        let new_deadline = started + ttl.saturating_sub(self.store.clock_drift(ttl));
        // An extension that fails (a timeout, a lost reply) or is dropped may have run in the
        // store all the same: its expiry may stand there, and the lease is good until the
        // sooner of the two (a shorter ttl than the lease's, `extend_for`, would otherwise be
        // trusted past the store's expiry).
        let unknown = Unsettled {
            lease: &self.lease,
            started,
            deadline: new_deadline,
        };
        let held = match tokio::time::timeout_at(
            deadline,
            self.store.extend(&self.name, self.token.as_bytes(), ttl),
        )
        .await
        {
            Ok(result) => result?,
            Err(_) => {
                self.lease.lose(LeaseLost::Expired);
                return Err(Error::lost(&self.name, LeaseLost::Expired));
            }
        };
        std::mem::forget(unknown);
        if !held {
            self.lease.lose(LeaseLost::NotHeld);
            return Err(Error::lost(&self.name, LeaseLost::NotHeld));
        }
        self.lease
            .renewed(started, new_deadline)
            .map_err(|reason| Error::lost(&self.name, reason))
    }
}

/// An extension under way: dropped before its outcome is known (failed, or cancelled), the
/// lease is good until the sooner of its deadline and the extension's.
struct Unsettled<'a> {
    lease: &'a LeaseCell,
    started: Instant,
    deadline: Instant,
}

impl Drop for Unsettled<'_> {
    fn drop(&mut self) {
        self.lease.at_most(self.started, self.deadline);
    }
}

/// A held lock. Dropping it releases the lock in the background; prefer
/// [`release`](LockGuard::release), which reports whether the lease was still ours.
///
/// With the watchdog on (see [`Lock::watchdog`](crate::Lock::watchdog)) the lease is renewed
/// every `ttl / 3` while the guard lives; either way [`lost`](LockGuard::lost) resolves when the
/// lease is gone, so that the critical section can stop.
pub struct LockGuard<S: LockStore + Clone> {
    held: Arc<Held<S>>,
    fence: u64,
    watchdog: Option<AbortHandle>,
    /// Set by `release`, so that drop does nothing more.
    done: bool,
}

impl<S: LockStore + Clone> LockGuard<S> {
    pub(crate) fn new(held: Held<S>, fence: u64, watchdog: bool) -> Self
    where
        Error: From<S::Error>,
    {
        let held = Arc::new(held);
        let watchdog = if watchdog {
            match tokio::runtime::Handle::try_current() {
                Ok(handle) => Some(handle.spawn(renew(Arc::clone(&held))).abort_handle()),
                Err(_) => {
                    tracing::warn!("no tokio runtime: the lock's watchdog does not run");
                    None
                }
            }
        } else {
            None
        };
        Self {
            held,
            fence,
            watchdog,
            done: false,
        }
    }

    /// The fencing token of this acquisition: larger than every token issued before for this
    /// lock name. Pass it with every write to the protected resource (see
    /// [`FencedResource`](crate::FencedResource)).
    pub fn fence(&self) -> u64 {
        self.fence
    }

    /// The lock's name.
    pub fn name(&self) -> &[u8] {
        &self.held.name
    }

    /// The lease length this lock takes and renews.
    pub fn ttl(&self) -> Duration {
        self.held.ttl
    }

    /// How much longer the lease can be trusted, as this process knows it (zero once lost).
    /// Conservative: counted from before the request that took or last renewed it, minus the
    /// store's clock drift allowance. See [`verify`](LockGuard::verify) to ask the store.
    pub fn remaining(&self) -> Duration {
        if self.held.lease.check().is_some() {
            return Duration::ZERO;
        }
        self.held
            .lease
            .get()
            .deadline
            .saturating_duration_since(Instant::now())
    }

    /// True once the lease is lost (expired without renewal, or no longer held in the store).
    pub fn is_lost(&self) -> bool {
        self.held.lease.check().is_some()
    }

    /// Resolves when the lease is lost, with the reason.
    ///
    /// ```no_run
    /// # async fn run(guard: floodgate_lock::LockGuard<floodgate_core::MemoryLocks>) {
    /// # async fn send_batch(_: u64) {}
    /// tokio::select! {
    ///     () = send_batch(guard.fence()) => {}
    ///     reason = guard.lost() => eprintln!("stopped: {reason}"),
    /// }
    /// # }
    /// ```
    pub fn lost(&self) -> impl Future<Output = LeaseLost> + Send + use<S> {
        self.watch().lost()
    }

    /// A handle on the lease for other tasks (cheap to clone, `'static`).
    pub fn watch(&self) -> LeaseWatch {
        self.held.lease.watch(Arc::clone(&self.held.name))
    }

    /// Renews the lease to the lock's ttl from now.
    ///
    /// # Errors
    /// [`Error::Lost`] if the store no longer holds the lock for us or the lease had already
    /// run out (the guard is then lost for good); a store error otherwise. A failed extension
    /// (or one cancelled before its answer) may have run in the store all the same: the lease
    /// is then taken to end at the sooner of its deadline and the one the extension would
    /// have set.
    pub async fn extend(&self) -> Result<(), Error>
    where
        Error: From<S::Error>,
    {
        self.held.extend(self.held.ttl).await
    }

    /// Renews the lease to `ttl` from now (the watchdog keeps using the lock's ttl).
    ///
    /// # Errors
    /// [`Error::Invalid`] for a ttl of less than a millisecond or not longer than the store's
    /// clock drift; otherwise as [`extend`](LockGuard::extend).
    pub async fn extend_for(&self, ttl: Duration) -> Result<(), Error>
    where
        Error: From<S::Error>,
    {
        crate::lock::validate_ttl(&self.held.store, ttl)?;
        self.held.extend(ttl).await
    }

    /// Asks the store how long our lease has left, and trusts it no longer than that from now
    /// on: when the store's figure is shorter than what this process counted (the lock was
    /// renewed to a shorter ttl elsewhere, the store's clock runs fast),
    /// [`remaining`](LockGuard::remaining) and the watchdog go by the store's.
    ///
    /// Conservative, like [`remaining`](LockGuard::remaining): the store's figure is counted
    /// from before the question was sent, minus the store's clock drift allowance
    /// ([`LockStore::clock_drift`]).
    ///
    /// # Errors
    /// [`Error::Lost`] if the store no longer holds the lock for us, or holds it for less than
    /// the time the question took and the drift allowance; a store error.
    pub async fn verify(&self) -> Result<Duration, Error>
    where
        Error: From<S::Error>,
    {
        let held = &self.held;
        let asked = Instant::now();
        let Some(left) = held
            .store
            .remaining(&held.name, held.token.as_bytes())
            .await?
        else {
            held.lease.lose(LeaseLost::NotHeld);
            return Err(Error::lost(&held.name, LeaseLost::NotHeld));
        };
        let trusted = left.saturating_sub(held.store.clock_drift(left));
        // A figure past the end of time (a corrupt TTL) brings nothing forward.
        if let Some(deadline) = asked.checked_add(trusted) {
            held.lease.verified(asked, deadline);
        }
        match held.lease.check() {
            Some(reason) => Err(Error::lost(&held.name, reason)),
            None => Ok(held
                .lease
                .get()
                .deadline
                .saturating_duration_since(Instant::now())),
        }
    }

    /// Releases the lock, waking the next waiter.
    ///
    /// A transient store error (a timeout, a broken connection, a cluster failing over) is
    /// retried a few times with a short backoff while the lease lasts, so that waiters are not
    /// left waiting for the lease to run out. If an attempt that failed had in fact released
    /// the lock, the retry finds it gone and reports [`Error::Lost`]: on the safe side, since
    /// the two cases cannot be told apart.
    ///
    /// # Errors
    /// [`Error::Lost`] if the store no longer held it for us, or if the lease had run out (by
    /// our own deadline) before the release, whether or not the store could be reached: another
    /// holder may have overlapped with this critical section. A store error if it could not be
    /// reached within the lease; the lock then frees itself when the lease ends.
    pub async fn release(mut self) -> Result<(), Error>
    where
        Error: From<S::Error>,
    {
        // `done` only once the store has answered: if this future is dropped before (a
        // timeout around `release`, a cancelled task), `Drop` still releases in the background
        // rather than leaving the lock held until its lease runs out.
        self.stop_watchdog();
        let expired = self.held.lease.check();
        let deadline = self.held.lease.get().deadline;
        self.held.lease.lose(LeaseLost::Released);
        let mut backoff = RELEASE_BACKOFF;
        let mut attempts = 1;
        let released = loop {
            match self
                .held
                .store
                .unlock(&self.held.name, self.held.token.as_bytes())
                .await
            {
                Ok(released) => break released,
                Err(e) => {
                    let e = Error::from(e);
                    let retry_at = Instant::now() + backoff;
                    if !e.is_transient() || attempts >= RELEASE_ATTEMPTS || retry_at >= deadline {
                        // A lease that had run out (or been found gone) before the release is
                        // lost whether or not the store answers it: another holder may have
                        // overlapped with the work.
                        return Err(match expired {
                            Some(reason) => {
                                tracing::debug!(
                                    lock = %floodgate_redis::display_key(&self.held.name),
                                    error = %e,
                                    "the lease had run out and the release failed"
                                );
                                Error::lost(&self.held.name, reason)
                            }
                            None => e,
                        });
                    }
                    tracing::debug!(
                        lock = %floodgate_redis::display_key(&self.held.name),
                        error = %e,
                        "releasing the lock failed; retrying"
                    );
                    tokio::time::sleep_until(retry_at).await;
                    attempts += 1;
                    backoff *= 2;
                }
            }
        };
        self.done = true;
        match (released, expired) {
            (true, None) => Ok(()),
            // Released in the store, but past our own deadline: someone may have overlapped.
            (true, Some(reason)) => Err(Error::lost(&self.held.name, reason)),
            (false, _) => Err(Error::lost(&self.held.name, LeaseLost::NotHeld)),
        }
    }

    fn stop_watchdog(&mut self) {
        if let Some(watchdog) = self.watchdog.take() {
            watchdog.abort();
        }
    }
}

impl<S: LockStore + Clone> Drop for LockGuard<S> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        self.stop_watchdog();
        self.held.lease.lose(LeaseLost::Released);
        // Best effort, without blocking: with no runtime the lease simply runs out.
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            let held = Arc::clone(&self.held);
            handle.spawn(async move {
                if let Err(e) = held.store.unlock(&held.name, held.token.as_bytes()).await {
                    tracing::debug!(
                        lock = %floodgate_redis::display_key(&held.name),
                        error = %e,
                        "releasing a dropped lock guard failed; the lease will run out"
                    );
                }
            });
        }
    }
}

impl<S: LockStore + Clone> fmt::Debug for LockGuard<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("name", &floodgate_redis::display_key(&self.held.name))
            .field("fence", &self.fence)
            .field("remaining", &self.remaining())
            .field("watchdog", &self.watchdog.is_some())
            .finish_non_exhaustive()
    }
}

/// The watchdog: renews every `ttl / 3`; after a failed renewal retries sooner, until the lease
/// deadline; marks the lease lost and stops when the store says it is not ours or the deadline
/// passes.
async fn renew<S: LockStore>(held: Arc<Held<S>>)
where
    Error: From<S::Error>,
{
    let period = (held.ttl / 3).max(Duration::from_millis(1));
    let retry = (held.ttl / 10).max(Duration::from_millis(1));
    let mut next = Instant::now() + period;
    // Never sooner than `retry` after the last attempt, so that a lease barely longer than
    // the clock drift allowance is not renewed in a loop.
    let mut floor = Instant::now();
    let mut changes = held.lease.subscribe();
    loop {
        // Renew every period, and at the latest `retry` before the deadline: after an
        // `extend_for` with a shorter ttl, the deadline comes sooner than the next period.
        let deadline = changes.borrow_and_update().deadline;
        let wake = next
            .min(deadline.checked_sub(retry).unwrap_or(deadline))
            .max(floor);
        tokio::select! {
            () = tokio::time::sleep_until(wake) => {}
            // Someone else renewed (an `extend_for`) or the lease was lost: the watchdog's own
            // renewals are marked seen at the top of the loop.
            changed = changes.changed() => {
                if changed.is_err() || changes.borrow().lost.is_some() {
                    return;
                }
                floor = Instant::now();
                continue;
            }
        }
        floor = Instant::now() + retry;
        match held.extend(held.ttl).await {
            Ok(()) => next = Instant::now() + period,
            Err(e) if e.is_lost() => {
                tracing::warn!(
                    lock = %floodgate_redis::display_key(&held.name),
                    error = %e,
                    "lock lease lost"
                );
                return;
            }
            Err(e) => {
                tracing::debug!(
                    lock = %floodgate_redis::display_key(&held.name),
                    error = %e,
                    "renewing the lock lease failed; retrying"
                );
                next = Instant::now() + retry;
            }
        }
    }
}
