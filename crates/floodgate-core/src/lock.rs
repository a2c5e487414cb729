//! Locks as a store: the [`LockStore`] interface and [`MemoryLocks`], its in-process version.
//!
//! A lock is held by one *token* (a random value per holder) for a lease; only that token can
//! release or extend it. Every acquisition returns a *fencing token*, a number that is strictly
//! larger than every fencing token issued before for the same lock name, so a protected resource
//! can refuse writes from a holder whose lease has lapsed (see `floodgate-lock`).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use tokio::sync::Notify;

use crate::clock::{Clock, SystemClock, duration_micros};
use crate::error::MemoryError;
use crate::store::OnFull;
use crate::store::sharded::{NewSlot, ShardedMap};

/// The answer to an attempt to take a lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockAttempt {
    /// The lock is ours, with this fencing token.
    Acquired {
        /// Strictly larger than every fencing token issued before for this name.
        fence: u64,
    },
    /// Someone else holds it, for at most this long unless they extend it.
    Held {
        /// The holder's remaining lease.
        remaining: Duration,
    },
}

/// A future that resolves when a lock may have been released (it may also resolve spuriously,
/// and callers must not rely on it alone: a lost notification is covered by retrying when the
/// holder's lease ends).
pub type Released = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// Where locks live: in memory, or in Redis.
pub trait LockStore: Send + Sync + 'static {
    /// The store's error.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Takes lock `name` for `token` for `ttl`, if no other token holds it.
    fn try_lock(
        &self,
        name: &[u8],
        token: &[u8],
        ttl: Duration,
    ) -> impl Future<Output = Result<LockAttempt, Self::Error>> + Send;

    /// Releases `name` if `token` holds it; returns whether it did.
    fn unlock(
        &self,
        name: &[u8],
        token: &[u8],
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send;

    /// Extends `token`'s lease on `name` to `ttl` from now; returns whether `token` still held it.
    fn extend(
        &self,
        name: &[u8],
        token: &[u8],
        ttl: Duration,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send;

    /// `token`'s remaining lease on `name`, or `None` when it does not hold it: as the store
    /// counts it (the caller allows for the clock drift and the round trip).
    fn remaining(
        &self,
        name: &[u8],
        token: &[u8],
    ) -> impl Future<Output = Result<Option<Duration>, Self::Error>> + Send;

    /// A future that resolves when `name` may have been released. Call it *before* trying to
    /// take the lock, so that a release between the attempt and the wait is not missed.
    fn released(&self, name: &[u8]) -> Released;

    /// How much of a `ttl` lease a holder must assume lost to clock drift between itself and
    /// the store: a lease taken or extended at `t` is trusted until `t + ttl - clock_drift(ttl)`.
    /// The memory store expires leases on its own clock (for `SystemClock`, the CPU's
    /// counter), the holder on Tokio's (the monotonic clock, which NTP may slew by up to 500
    /// ppm): it allows `ttl / 1000`. A Redis server expires them on its own clock, whose rate
    /// may differ more, and the Redis stores (one server or Redlock) allow `ttl / 100 + 2 ms`.
    /// (Under `tokio::time::pause` the holder's clock stands still while the memory store's
    /// runs on: leases there are only as good as the test's use of time.)
    fn clock_drift(&self, ttl: Duration) -> Duration {
        let _ = ttl;
        Duration::ZERO
    }

    /// This process's queues of waiters for this store's locks (shared by its clones), or
    /// `None` (the default): then every waiter of a lock tries it again on each release.
    /// With queues, waiters of a name line up, and only the first of them listens for its
    /// release (the others look on their backoff): a release costs one attempt per process,
    /// whatever the number of waiters, and waiters take the lock in the order they came
    /// (unless another attempt finds it free first).
    fn wait_queues(&self) -> Option<&WaitQueues> {
        None
    }
}

/// Waiters of the locks of one store in this process, lined up by lock name (see
/// [`LockStore::wait_queues`]).
#[derive(Default)]
pub struct WaitQueues {
    queues: Mutex<HashMap<Box<[u8]>, Queue>>,
}

/// The waiters of one name: each by the number of its place, with what wakes it when it comes
/// first.
#[derive(Default)]
struct Queue {
    next: u64,
    places: std::collections::BTreeMap<u64, Arc<Notify>>,
}

impl WaitQueues {
    /// No waiters yet.
    pub fn new() -> Self {
        Self::default()
    }

    fn queues(&self) -> std::sync::MutexGuard<'_, HashMap<Box<[u8]>, Queue>> {
        self.queues.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A place at the end of `name`'s queue, left when dropped.
    pub fn join(&self, name: &[u8]) -> Place<'_> {
        let turn = Arc::new(Notify::new());
        let mut queues = self.queues();
        let queue = queues.entry(name.into()).or_default();
        let number = queue.next;
        queue.next += 1;
        queue.places.insert(number, Arc::clone(&turn));
        Place {
            queues: self,
            name: name.into(),
            number,
            turn,
        }
    }

    /// How many waiters `name` has in this process.
    pub fn waiting(&self, name: &[u8]) -> usize {
        self.queues().get(name).map_or(0, |q| q.places.len())
    }
}

impl std::fmt::Debug for WaitQueues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WaitQueues")
            .field("names", &self.queues().len())
            .finish()
    }
}

/// A waiter's place in the queue of a lock name ([`WaitQueues::join`]). Dropping it leaves the
/// queue, and the next waiter's turn comes if it was first.
pub struct Place<'a> {
    queues: &'a WaitQueues,
    name: Box<[u8]>,
    number: u64,
    turn: Arc<Notify>,
}

impl Place<'_> {
    /// Whether no earlier waiter is still in the queue.
    pub fn is_first(&self) -> bool {
        let queues = self.queues.queues();
        queues
            .get(&*self.name)
            .and_then(|q| q.places.keys().next())
            .is_none_or(|&first| first == self.number)
    }

    /// Resolves once this place is first in its queue.
    pub async fn first(&self) {
        loop {
            let turn = self.turn.notified();
            tokio::pin!(turn);
            turn.as_mut().enable();
            if self.is_first() {
                return;
            }
            turn.await;
        }
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        let mut queues = self.queues.queues();
        let Some(queue) = queues.get_mut(&*self.name) else {
            return;
        };
        let was_first = queue.places.keys().next() == Some(&self.number);
        queue.places.remove(&self.number);
        if queue.places.is_empty() {
            queues.remove(&*self.name);
        } else if was_first && let Some(next) = queue.places.values().next() {
            next.notify_one();
        }
    }
}

impl std::fmt::Debug for Place<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Place")
            .field("number", &self.number)
            .finish_non_exhaustive()
    }
}

/// The longest lock name or token accepted by the stores.
pub const MAX_LOCK_NAME: usize = 1024;

struct Held {
    token: Box<[u8]>,
    expires_at: u64,
}

/// Locks in this process's memory, with the same semantics as the Redis locks: owner tokens,
/// lease expiry, strictly increasing fencing tokens, and release notifications.
///
/// The number of lock names held at once is bounded; past the bound, new locks are refused with
/// [`MemoryError::Full`] (a live lock is never evicted).
pub struct MemoryLocks<C = SystemClock> {
    inner: Arc<LocksInner<C>>,
}

struct LocksInner<C> {
    map: ShardedMap<Held>,
    clock: C,
    fence: AtomicU64,
    waiters: Mutex<Waiters>,
    queues: WaitQueues,
}

/// The release notifications waited for, by lock name.
#[derive(Default)]
struct Waiters {
    by_name: HashMap<Box<[u8]>, Weak<Notify>>,
    /// The size at which names nobody waits for any more are swept (twice the size after the
    /// last sweep): each unlock touches its own name only, and the sweeps cost O(1) a name.
    sweep_at: usize,
}

impl<C> Clone for MemoryLocks<C> {
    fn clone(&self) -> Self {
        MemoryLocks {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<C> std::fmt::Debug for MemoryLocks<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryLocks")
            .field("max_locks", &self.inner.map.max_keys())
            .finish_non_exhaustive()
    }
}

impl MemoryLocks<SystemClock> {
    /// In-memory locks on the system clock, up to a million names held at once.
    pub fn new() -> Self {
        MemoryLocks::with_clock(SystemClock::new(), 1_000_000)
    }
}

impl Default for MemoryLocks<SystemClock> {
    fn default() -> Self {
        MemoryLocks::new()
    }
}

impl<C: Clock> MemoryLocks<C> {
    /// In-memory locks on `clock`, holding at most `max_locks` names at once.
    pub fn with_clock(clock: C, max_locks: usize) -> Self {
        MemoryLocks {
            inner: Arc::new(LocksInner {
                map: ShardedMap::new(max_locks, 64, OnFull::Reject),
                clock,
                fence: AtomicU64::new(0),
                waiters: Mutex::new(Waiters::default()),
                queues: WaitQueues::new(),
            }),
        }
    }

    fn check_sizes(name: &[u8], token: &[u8]) -> Result<(), MemoryError> {
        if name.is_empty() || name.len() > MAX_LOCK_NAME {
            return Err(MemoryError::InvalidCheck(format!(
                "a lock name must be 1 to {MAX_LOCK_NAME} bytes, got {}",
                name.len()
            )));
        }
        if token.is_empty() || token.len() > MAX_LOCK_NAME {
            return Err(MemoryError::InvalidCheck(format!(
                "a lock token must be 1 to {MAX_LOCK_NAME} bytes, got {}",
                token.len()
            )));
        }
        Ok(())
    }

    /// See [`LockStore::try_lock`].
    pub fn try_lock_sync(
        &self,
        name: &[u8],
        token: &[u8],
        ttl: Duration,
    ) -> Result<LockAttempt, MemoryError> {
        Self::check_sizes(name, token)?;
        let now = self.inner.clock.now().as_micros();
        let expires_at = now.saturating_add(duration_micros(ttl));
        let map = &self.inner.map;
        let hash = map.hash(0, name);
        let mut shard = map.lock(map.shard_of(hash));
        if let Some(slot) = shard.find_mut(hash, 0, name) {
            if slot.value.expires_at > now && *slot.value.token != *token {
                return Ok(LockAttempt::Held {
                    remaining: Duration::from_micros(slot.value.expires_at - now),
                });
            }
            slot.value = Held {
                token: token.into(),
                expires_at,
            };
            slot.set_expires_at(expires_at);
            let at = slot.expires_at();
            shard.note_expiry(at);
        } else {
            map.insert(
                &mut shard,
                NewSlot {
                    hash,
                    ident: 0,
                    key: name,
                    value: Held {
                        token: token.into(),
                        expires_at,
                    },
                    expires_at,
                },
                now,
            )?;
        }
        // As the Redis store does: one more than the last token, and never below the clock's
        // microseconds, so that tokens keep growing across a restart of the process (or a new
        // store), for resources that remember the highest token they saw.
        let next = |last: u64| last.saturating_add(1).max(now);
        let last = self
            .inner
            .fence
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |last| Some(next(last)))
            .unwrap_or_else(|last| last);
        Ok(LockAttempt::Acquired { fence: next(last) })
    }

    /// See [`LockStore::unlock`].
    pub fn unlock_sync(&self, name: &[u8], token: &[u8]) -> bool {
        let now = self.inner.clock.now().as_micros();
        let map = &self.inner.map;
        let hash = map.hash(0, name);
        let released = {
            let mut shard = map.lock(map.shard_of(hash));
            let ours = shard
                .find(hash, 0, name)
                .is_some_and(|s| *s.value.token == *token && s.value.expires_at > now);
            if ours {
                shard.remove(hash, 0, name);
            }
            ours
        };
        if released {
            self.notify(name);
        }
        released
    }

    /// See [`LockStore::extend`].
    pub fn extend_sync(&self, name: &[u8], token: &[u8], ttl: Duration) -> bool {
        let now = self.inner.clock.now().as_micros();
        let map = &self.inner.map;
        let hash = map.hash(0, name);
        let mut shard = map.lock(map.shard_of(hash));
        match shard.find_mut(hash, 0, name) {
            Some(slot) if *slot.value.token == *token && slot.value.expires_at > now => {
                let expires_at = now.saturating_add(duration_micros(ttl));
                slot.value.expires_at = expires_at;
                slot.set_expires_at(expires_at);
                shard.note_expiry(expires_at);
                true
            }
            _ => false,
        }
    }

    /// See [`LockStore::remaining`].
    pub fn remaining_sync(&self, name: &[u8], token: &[u8]) -> Option<Duration> {
        let now = self.inner.clock.now().as_micros();
        let map = &self.inner.map;
        let hash = map.hash(0, name);
        let shard = map.lock(map.shard_of(hash));
        shard
            .find(hash, 0, name)
            .filter(|s| *s.value.token == *token && s.value.expires_at > now)
            .map(|s| Duration::from_micros(s.value.expires_at - now))
    }

    fn notify(&self, name: &[u8]) {
        let mut waiters = self
            .inner
            .waiters
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match waiters.by_name.get(name).map(Weak::upgrade) {
            Some(Some(n)) => n.notify_waiters(),
            Some(None) => drop(waiters.by_name.remove(name)),
            None => {}
        }
    }

    fn watch(&self, name: &[u8]) -> Released {
        let notify = {
            let mut waiters = self
                .inner
                .waiters
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            match waiters.by_name.get(name).and_then(Weak::upgrade) {
                Some(n) => n,
                None => {
                    if waiters.by_name.len() >= waiters.sweep_at {
                        waiters.by_name.retain(|_, w| w.strong_count() > 0);
                        waiters.sweep_at = (waiters.by_name.len() * 2).max(64);
                    }
                    let n = Arc::new(Notify::new());
                    waiters.by_name.insert(name.into(), Arc::downgrade(&n));
                    n
                }
            }
        };
        // Registered now: a release after this point wakes it even before it is polled.
        let notified = Arc::clone(&notify).notified_owned();
        Box::pin(async move {
            let _keep = notify;
            notified.await;
        })
    }
}

impl<C: Clock> LockStore for MemoryLocks<C> {
    type Error = MemoryError;

    async fn try_lock(
        &self,
        name: &[u8],
        token: &[u8],
        ttl: Duration,
    ) -> Result<LockAttempt, MemoryError> {
        self.try_lock_sync(name, token, ttl)
    }

    async fn unlock(&self, name: &[u8], token: &[u8]) -> Result<bool, MemoryError> {
        Ok(self.unlock_sync(name, token))
    }

    async fn extend(&self, name: &[u8], token: &[u8], ttl: Duration) -> Result<bool, MemoryError> {
        Ok(self.extend_sync(name, token, ttl))
    }

    async fn remaining(&self, name: &[u8], token: &[u8]) -> Result<Option<Duration>, MemoryError> {
        Ok(self.remaining_sync(name, token))
    }

    fn released(&self, name: &[u8]) -> Released {
        self.watch(name)
    }

    fn wait_queues(&self) -> Option<&WaitQueues> {
        Some(&self.inner.queues)
    }

    /// A thousandth of the lease: the store's clock and the holder's (Tokio's) are not one
    /// (see [`LockStore::clock_drift`]).
    fn clock_drift(&self, ttl: Duration) -> Duration {
        ttl / 1000
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ManualClock, Timestamp};

    fn locks() -> (ManualClock, MemoryLocks<ManualClock>) {
        let clock = ManualClock::new(Timestamp::from_millis(1_000_000));
        (clock.clone(), MemoryLocks::with_clock(clock, 1_000))
    }

    /// A full table makes room from a lock whose holder took it again for less time and let
    /// it lapse: a lock is never refused while an expired one holds its room.
    #[test]
    fn a_lock_taken_again_for_less_makes_room_when_it_lapses() {
        let clock = ManualClock::new(Timestamp::from_millis(1_000_000));
        let locks = MemoryLocks::with_clock(clock.clone(), 16);
        let long = Duration::from_secs(100);
        for i in 0..16 {
            let name = format!("lock-{i}");
            let taken = locks.try_lock_sync(name.as_bytes(), b"alice", long);
            assert!(
                matches!(taken, Ok(LockAttempt::Acquired { .. })),
                "{taken:?}"
            );
        }
        assert!(matches!(
            locks.try_lock_sync(b"one-more", b"bob", long),
            Err(MemoryError::Full { .. })
        ));
        let again = locks.try_lock_sync(b"lock-3", b"alice", Duration::from_secs(1));
        assert!(
            matches!(again, Ok(LockAttempt::Acquired { .. })),
            "{again:?}"
        );
        clock.advance(Duration::from_secs(2));
        let taken = locks.try_lock_sync(b"one-more", b"bob", long);
        assert!(
            matches!(taken, Ok(LockAttempt::Acquired { .. })),
            "{taken:?}"
        );
    }

    #[test]
    fn only_the_holder_releases_or_extends() {
        let (clock, locks) = locks();
        let ttl = Duration::from_secs(10);
        let LockAttempt::Acquired { fence: f1 } = locks
            .try_lock_sync(b"campaign-7", b"alice", ttl)
            .expect("ok")
        else {
            panic!("not acquired")
        };
        assert_eq!(
            locks.try_lock_sync(b"campaign-7", b"bob", ttl),
            Ok(LockAttempt::Held {
                remaining: Duration::from_secs(10)
            })
        );
        assert!(!locks.unlock_sync(b"campaign-7", b"bob"));
        assert!(!locks.extend_sync(b"campaign-7", b"bob", ttl));
        clock.advance(Duration::from_secs(4));
        assert!(locks.extend_sync(b"campaign-7", b"alice", ttl));
        assert_eq!(
            locks.remaining_sync(b"campaign-7", b"alice"),
            Some(Duration::from_secs(10))
        );
        // The lease lapses: bob takes it, with a larger fencing token; alice's release fails.
        clock.advance(Duration::from_secs(10));
        let LockAttempt::Acquired { fence: f2 } =
            locks.try_lock_sync(b"campaign-7", b"bob", ttl).expect("ok")
        else {
            panic!("not acquired")
        };
        assert!(f2 > f1);
        assert!(!locks.unlock_sync(b"campaign-7", b"alice"));
        assert!(locks.unlock_sync(b"campaign-7", b"bob"));
    }

    #[test]
    fn fencing_tokens_keep_growing_across_a_new_store() {
        let (clock, locks) = locks();
        let ttl = Duration::from_secs(1);
        let fence = |locks: &MemoryLocks<ManualClock>, name: &[u8]| match locks
            .try_lock_sync(name, b"t", ttl)
            .expect("ok")
        {
            LockAttempt::Acquired { fence } => fence,
            held => panic!("{held:?}"),
        };
        let first = fence(&locks, b"a");
        let second = fence(&locks, b"b");
        assert!(second > first);
        // A process restart: a new store, whose counter starts again, on a clock that went on.
        clock.advance(Duration::from_millis(1));
        let restarted = MemoryLocks::with_clock(clock.clone(), 1_000);
        let third = fence(&restarted, b"a");
        assert!(third > second, "{third} after {second}");
        // Many acquisitions within one microsecond still get distinct, growing tokens.
        let mut last = third;
        for i in 0..100u8 {
            let next = fence(&restarted, &[b'n', i]);
            assert!(next > last, "{next} after {last}");
            last = next;
        }
    }

    #[test]
    fn bad_names_are_errors() {
        let (_, locks) = locks();
        assert!(
            locks
                .try_lock_sync(b"", b"t", Duration::from_secs(1))
                .is_err()
        );
        assert!(
            locks
                .try_lock_sync(b"n", b"", Duration::from_secs(1))
                .is_err()
        );
        let huge = vec![b'x'; MAX_LOCK_NAME + 1];
        assert!(
            locks
                .try_lock_sync(&huge, b"t", Duration::from_secs(1))
                .is_err()
        );
    }

    #[tokio::test]
    async fn release_wakes_a_waiter_registered_before_it() {
        let (_, locks) = locks();
        let ttl = Duration::from_secs(60);
        assert!(matches!(
            locks.try_lock(b"l", b"a", ttl).await,
            Ok(LockAttempt::Acquired { .. })
        ));
        let woken = locks.released(b"l");
        assert!(locks.unlock(b"l", b"a").await.expect("ok"));
        tokio::time::timeout(Duration::from_secs(1), woken)
            .await
            .expect("woken by the release");
        assert!(matches!(
            locks.try_lock(b"l", b"b", ttl).await,
            Ok(LockAttempt::Acquired { .. })
        ));
    }

    #[test]
    fn names_nobody_waits_for_are_swept_without_scanning_on_every_unlock() {
        let (_, locks) = locks();
        // Ten thousand waits on as many names, each given up at once (a waiter that took the
        // lock, or was cancelled): the table keeps a bounded number of dead entries.
        for i in 0..10_000u32 {
            drop(locks.watch(format!("name-{i}").as_bytes()));
        }
        let held = locks
            .inner
            .waiters
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .by_name
            .len();
        assert!(held <= 128, "{held} entries kept");
        // A name still waited for is kept through sweeps, and notified.
        let mut waited = locks.watch(b"kept");
        for i in 0..1_000u32 {
            drop(locks.watch(format!("other-{i}").as_bytes()));
        }
        locks.notify(b"kept");
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(waited.as_mut().poll(&mut cx).is_ready(), "not notified");
    }
}
