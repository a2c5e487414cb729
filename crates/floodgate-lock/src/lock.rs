//! A named lock on a store: acquiring, waiting, and running a critical section.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use floodgate_core::lock::MAX_LOCK_NAME;
use floodgate_core::{LockAttempt, LockStore};
use tokio::time::Instant;

use crate::guard::{Held, LockGuard};
use crate::lease::LeaseCell;
use crate::token::Token;
use crate::{Backoff, Error};

/// The longest lease accepted: 30 days.
pub const MAX_TTL: Duration = Duration::from_secs(30 * 24 * 3600);

/// One named lock on a store ([`MemoryLocks`](floodgate_core::MemoryLocks),
/// [`RedisLocks`](crate::RedisLocks) or [`Redlock`](crate::Redlock)). Cheap to clone; every
/// acquisition draws a fresh random owner token, so one `Lock` can be shared by many tasks and
/// they still exclude each other.
///
/// ```
/// use std::time::Duration;
/// use floodgate_core::MemoryLocks;
/// use floodgate_lock::Lock;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), floodgate_lock::Error> {
/// let lock = Lock::new(MemoryLocks::new(), "campaign:42", Duration::from_secs(10))?;
/// let guard = lock.acquire(Duration::from_secs(1)).await?;
/// assert!(lock.try_acquire().await?.is_none()); // held
/// let fence = guard.fence();
/// guard.release().await?;
/// let next = lock.try_acquire().await?.expect("free again");
/// assert!(next.fence() > fence);
/// # Ok(()) }
/// ```
pub struct Lock<S> {
    store: S,
    name: Arc<[u8]>,
    ttl: Duration,
    drift: Duration,
    watchdog: bool,
    backoff: Backoff,
}

impl<S: Clone> Clone for Lock<S> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            name: Arc::clone(&self.name),
            ttl: self.ttl,
            drift: self.drift,
            watchdog: self.watchdog,
            backoff: self.backoff,
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for Lock<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lock")
            .field("name", &floodgate_redis::display_key(&self.name))
            .field("ttl", &self.ttl)
            .field("watchdog", &self.watchdog)
            .field("backoff", &self.backoff)
            .field("store", &self.store)
            .finish()
    }
}

/// Checks a lease length against the store.
pub(crate) fn validate_ttl<S: LockStore>(store: &S, ttl: Duration) -> Result<Duration, Error> {
    if ttl < Duration::from_millis(1) {
        return Err(Error::Invalid(format!(
            "a lock lease must be at least 1 ms, got {ttl:?}"
        )));
    }
    if ttl > MAX_TTL {
        return Err(Error::Invalid(format!(
            "a lock lease must be at most {MAX_TTL:?}, got {ttl:?}"
        )));
    }
    let drift = store.clock_drift(ttl);
    if drift >= ttl {
        return Err(Error::Invalid(format!(
            "a lock lease of {ttl:?} is not longer than the store's clock drift allowance {drift:?}"
        )));
    }
    Ok(drift)
}

impl<S> Lock<S>
where
    S: LockStore + Clone,
    Error: From<S::Error>,
{
    /// The lock `name` on `store`, taken for leases of `ttl`. No watchdog, default backoff.
    ///
    /// # Errors
    /// [`Error::Invalid`] for an empty name or one over
    /// [`MAX_LOCK_NAME`](floodgate_core::lock::MAX_LOCK_NAME) bytes, a ttl under 1 ms, over
    /// [`MAX_TTL`], or not longer than the store's clock drift allowance.
    pub fn new(store: S, name: impl AsRef<[u8]>, ttl: Duration) -> Result<Self, Error> {
        let name = name.as_ref();
        if name.is_empty() {
            return Err(Error::Invalid("a lock name must not be empty".to_owned()));
        }
        if name.len() > MAX_LOCK_NAME {
            return Err(Error::Invalid(format!(
                "a lock name must be at most {MAX_LOCK_NAME} bytes, got {}",
                name.len()
            )));
        }
        let drift = validate_ttl(&store, ttl)?;
        Ok(Self {
            store,
            name: name.into(),
            ttl,
            drift,
            watchdog: false,
            backoff: Backoff::DEFAULT,
        })
    }

    /// Renews the lease in the background every `ttl / 3` while a guard lives (default off).
    /// The guard's [`lost`](LockGuard::lost) fires if a renewal finds the lock taken or the
    /// lease runs out because the store cannot be reached.
    #[must_use]
    pub fn watchdog(mut self, on: bool) -> Self {
        self.watchdog = on;
        self
    }

    /// The fallback waits between attempts (see [`Backoff`]).
    #[must_use]
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// The lock's name.
    pub fn name(&self) -> &[u8] {
        &self.name
    }

    /// The lease length.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// One attempt: the guard if the lock was free, `None` if another owner holds it.
    ///
    /// # Errors
    /// A store error; [`Error::AnsweredTooLate`] when the store granted the lock after the
    /// lease was over (the grant is given back).
    pub async fn try_acquire(&self) -> Result<Option<LockGuard<S>>, Error> {
        let token = Token::random()?;
        // Until the store has answered, this attempt may have taken the lock for us: if it is
        // cancelled or fails, the token is released in the background.
        let pending = PendingAttempt::new(self, &token);
        match self.attempt(&token).await {
            Ok(Attempt::Acquired(guard)) => {
                pending.disarm();
                Ok(Some(guard))
            }
            Ok(Attempt::Busy(_)) => {
                pending.disarm();
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Takes the lock, waiting up to `wait` for the holder to release it.
    ///
    /// Waiters are woken by the store's release notification, and otherwise retry after a
    /// jittered backoff that never outlasts the holder's lease. On a store with wait queues
    /// (all of this crate's, see [`LockStore::wait_queues`]), a waiter lines up behind the
    /// process's earlier waiters of the name; until they have left the line it looks at the
    /// lock only on its backoff, and is not woken by releases. Transient store errors
    /// (timeouts, lost connections, no Redlock quorum) are retried until the deadline.
    ///
    /// At least one attempt is made, even with a zero `wait`, and an attempt begun before the
    /// deadline runs until the store answers or its own timeout: with a hung store, the call
    /// can return up to one store timeout after `wait`.
    ///
    /// # Errors
    /// [`Error::Timeout`] if another owner held the lock the whole time; the last store error
    /// if the store failed until the deadline; a non-transient store error at once.
    pub async fn acquire(&self, wait: Duration) -> Result<LockGuard<S>, Error> {
        let deadline = Instant::now().checked_add(wait).unwrap_or_else(far_future);
        self.acquire_until(deadline).await
    }

    /// Like [`acquire`](Lock::acquire), with a deadline.
    ///
    /// # Errors
    /// As [`acquire`](Lock::acquire).
    pub async fn acquire_until(&self, deadline: impl Into<Instant>) -> Result<LockGuard<S>, Error> {
        let deadline = deadline.into();
        let began = Instant::now();
        // The attempts' token: a new one after an attempt that failed (see below).
        let mut token = Token::random()?;
        // Armed while an attempt may have taken the lock for us unseen (an attempt in flight,
        // or one that failed): dropped armed, by an error return or by cancellation, it
        // releases the token in the background.
        let mut pending = PendingAttempt::new(self, &token);
        let mut backoff = self.backoff.start();
        let mut registered = None;
        // This waiter's place in the store's queue for the name, if the store has queues:
        // left (and the next waiter's turn come) whatever ends this call.
        let mut place = None;
        let mut last_error: Option<Error>;
        let mut had_error = false;
        loop {
            // Whether this waiter is behind others of its process in the lock's line.
            let mut in_line = false;
            let wait = match self.attempt(&token).await {
                Ok(Attempt::Acquired(guard)) => {
                    pending.disarm();
                    return Ok(guard);
                }
                Ok(Attempt::Busy(remaining)) => {
                    last_error = None;
                    // Nothing granted to give back. But a store of several nodes (Redlock)
                    // answers "held" to a split vote too, after giving back what some nodes
                    // granted, and its give-back to a node cooling off may still be on its
                    // way: the next attempts draw a new token, which it cannot delete.
                    token = Token::random()?;
                    pending.rebind(&token);
                    if place.is_none()
                        && let Some(queues) = self.store.wait_queues()
                    {
                        place = Some(queues.join(&self.name));
                    }
                    in_line = place.as_ref().is_some_and(|p| !p.is_first());
                    if in_line {
                        // Behind this process's earlier waiters: only the first of them
                        // listens for the release, so that a release costs one attempt, not
                        // one per waiter. Our turn comes when they have left the line;
                        // meanwhile we look at the lock on our backoff, as a waiter without
                        // notifications would (a first waiter whose caller stopped polling it
                        // must not hold the others up).
                        registered = None;
                    } else if registered.is_none() {
                        // First sight of a holder (or first in line): listen for its release,
                        // then look again at once, so that a release in between is not missed.
                        registered = Some(self.store.released(&self.name));
                        continue;
                    }
                    // Back when the holder's lease ends, if no release (in line: our turn)
                    // wakes us before.
                    backoff.next().min(remaining.max(Duration::from_millis(1)))
                }
                Err(e) if e.is_transient() => {
                    tracing::debug!(
                        lock = %floodgate_redis::display_key(&self.name),
                        error = %e,
                        "acquiring the lock failed; retrying"
                    );
                    // It may have taken the lock for us unseen, or have sent a give-back (a
                    // grant that came too late, a Redlock short of a quorum) that is still on
                    // its way. Under the same token, that give-back arriving late would delete
                    // what a later attempt is granted, and the guard would hold nothing. The
                    // next attempts draw a new token; this one is given back in the
                    // background (a lock it holds frees itself, and wakes us, then).
                    let fresh = Token::random()?;
                    pending.replace(&fresh);
                    token = fresh;
                    had_error = true;
                    last_error = Some(e);
                    backoff.next()
                }
                Err(e) => return Err(e),
            };
            let now = Instant::now();
            if now >= deadline {
                if !had_error {
                    // Every attempt was answered "held by another": nothing to give back.
                    pending.disarm();
                }
                return Err(last_error.unwrap_or_else(|| Error::Timeout {
                    name: floodgate_redis::display_key(&self.name),
                    waited: now - began,
                }));
            }
            let wake = now.checked_add(wait).map_or(deadline, |t| t.min(deadline));
            if let Some(joined) = place.as_ref().filter(|_| in_line) {
                tokio::select! {
                    () = joined.first() => {
                        // First in line: listen, then look again at once.
                        registered = Some(self.store.released(&self.name));
                    }
                    () = tokio::time::sleep_until(wake) => {}
                }
                continue;
            }
            match registered.take() {
                Some(released) => {
                    tokio::select! {
                        () = released => {}
                        () = tokio::time::sleep_until(wake) => {}
                    }
                }
                None => tokio::time::sleep_until(wake).await,
            }
            registered = Some(self.store.released(&self.name));
        }
    }

    /// Takes the lock (waiting up to `wait`), runs `critical` with the fencing token, and
    /// releases. If the lease is lost first, `critical` is dropped (cancelled at its next
    /// await) and the result is [`Error::Lost`].
    ///
    /// Once `critical` has finished under the lease, its output is returned even if the
    /// store cannot be reached to release the lock (logged as a warning): the work was done
    /// while the lock was held, and the lock frees itself when its lease ends.
    ///
    /// # Errors
    /// As [`acquire`](Lock::acquire); [`Error::Lost`] if the lease was lost before `critical`
    /// finished or was found lost on release (another holder may have overlapped with it).
    pub async fn run<F, Fut, T>(&self, wait: Duration, critical: F) -> Result<T, Error>
    where
        F: FnOnce(u64) -> Fut,
        Fut: Future<Output = T>,
    {
        let guard = self.acquire(wait).await?;
        let lost = guard.lost();
        let output = tokio::select! {
            biased;
            reason = lost => return Err(Error::lost(&self.name, reason)),
            output = critical(guard.fence()) => output,
        };
        match guard.release().await {
            Err(e) if e.is_lost() => Err(e),
            Err(e) => {
                tracing::warn!(
                    lock = %floodgate_redis::display_key(&self.name),
                    error = %e,
                    "the critical section finished but the lock could not be released; it frees \
                     itself when its lease ends"
                );
                Ok(output)
            }
            Ok(()) => Ok(output),
        }
    }

    async fn attempt(&self, token: &Token) -> Result<Attempt<S>, Error> {
        let started = Instant::now();
        match self
            .store
            .try_lock(&self.name, token.as_bytes(), self.ttl)
            .await?
        {
            LockAttempt::Acquired { fence } => {
                let deadline = started + (self.ttl - self.drift);
                let answered = Instant::now();
                if answered >= deadline {
                    // The answer took longer than the lease: it may already be someone else's.
                    // Given back here; should that fail, the caller's pending attempt, still
                    // armed by the error, gives it back in the background.
                    if let Err(e) = self.store.unlock(&self.name, token.as_bytes()).await {
                        tracing::debug!(error = %Error::from(e), "giving back a late grant failed");
                    }
                    return Err(Error::AnsweredTooLate {
                        name: floodgate_redis::display_key(&self.name),
                        took: answered - started,
                        ttl: self.ttl,
                    });
                }
                let held = Held {
                    store: self.store.clone(),
                    name: Arc::clone(&self.name),
                    token: token.clone(),
                    ttl: self.ttl,
                    lease: LeaseCell::new(deadline),
                };
                Ok(Attempt::Acquired(LockGuard::new(
                    held,
                    fence,
                    self.watchdog,
                )))
            }
            LockAttempt::Held { remaining } => Ok(Attempt::Busy(remaining)),
        }
    }
}

/// An acquisition attempt whose outcome the store may have applied without our seeing it (it
/// timed out, failed, or was cancelled): dropped without [`PendingAttempt::disarm`], it
/// releases the lock under its token in the background, so a lock nobody knows it holds does
/// not block others until its lease runs out. Releasing a lock held under another token does
/// nothing.
struct PendingAttempt<S: LockStore + Clone> {
    store: S,
    name: Arc<[u8]>,
    token: Option<Token>,
}

impl<S: LockStore + Clone> PendingAttempt<S> {
    fn new(lock: &Lock<S>, token: &Token) -> Self {
        PendingAttempt {
            store: lock.store.clone(),
            name: Arc::clone(&lock.name),
            token: Some(token.clone()),
        }
    }

    /// The outcome was seen: nothing to give back.
    fn disarm(mut self) {
        self.token = None;
    }

    /// The attempts go on under `token`: the one before is given back in the background.
    fn replace(&mut self, token: &Token) {
        self.give_back();
        self.rebind(token);
    }

    /// The attempts go on under `token`; the one before holds nothing to give back.
    fn rebind(&mut self, token: &Token) {
        self.token = Some(token.clone());
    }

    fn give_back(&mut self) {
        let Some(token) = self.token.take() else {
            return;
        };
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            let (store, name) = (self.store.clone(), Arc::clone(&self.name));
            handle.spawn(async move {
                let _ = store.unlock(&name, token.as_bytes()).await;
            });
        }
    }
}

impl<S: LockStore + Clone> Drop for PendingAttempt<S> {
    fn drop(&mut self) {
        self.give_back();
    }
}

enum Attempt<S: LockStore + Clone> {
    Acquired(LockGuard<S>),
    Busy(Duration),
}

/// A deadline that is never reached in practice (about 30 years ahead).
fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(86_400 * 365 * 30)
}
