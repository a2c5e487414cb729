//! Distributed locks for Rust services: owner-checked leases with fencing tokens, background
//! renewal, fast hand-off to waiters, and Redlock — on Redis, on Redis Cluster, or in memory
//! with the same API.
//!
//! ```no_run
//! use std::time::Duration;
//! use floodgate_lock::{FencedResource, Lock, RedisLocks};
//!
//! # async fn run() -> Result<(), floodgate_lock::Error> {
//! # async fn send_sms(_: &str) {}
//! let locks = RedisLocks::connect("redis://127.0.0.1:6379").await?;
//! // One dispatcher per campaign across all replicas.
//! let lock = Lock::new(locks, "dispatch:campaign-7", Duration::from_secs(10))?
//!     .watchdog(true); // renew every ttl/3 while the guard lives
//!
//! let guard = lock.acquire(Duration::from_secs(5)).await?; // or try_acquire(): no wait
//! tokio::select! {
//!     () = send_sms("+8613800000000") => {}
//!     reason = guard.lost() => {
//!         // Renewal failed or the lock was taken over: stop, someone else may be sending.
//!         eprintln!("lease lost: {reason}");
//!     }
//! }
//! let outbox = FencedResource::new(Vec::<String>::new()); // the protected resource
//! outbox.write(guard.fence(), |o| o.push("sent".into())).expect("not stale");
//! guard.release().await?;
//! # Ok(()) }
//! ```
//!
//! # How it works
//!
//! - **Taking** a lock is `SET key token NX PX ttl` inside a Lua script, with a fresh 128-bit
//!   token from the operating system per acquisition. **Releasing** and **extending** are
//!   scripts that act only while the key still holds that token: nobody releases or extends
//!   someone else's lock, even after their own lease lapsed.
//! - Every acquisition gets a **fencing token**, larger than every token issued before for the
//!   same name: `max(counter + 1, server time in µs)`, the counter in a companion key in the
//!   same hash slot, so tokens keep growing even after the counter expired or the server
//!   restarted empty. A resource that refuses tokens below the highest it has seen
//!   ([`FencedResource`], [`FenceCheck`]) is safe from a holder whose lease ran out mid-write.
//! - A **watchdog** ([`Lock::watchdog`]) renews the lease every `ttl / 3`; the guard's
//!   [`lost`](LockGuard::lost) future fires when a renewal finds the lock gone or taken, or
//!   when the lease runs out because the store is unreachable.
//! - **Waiting** ([`Lock::acquire`]) wakes on the release: the release script `PUBLISH`es on
//!   the lock's channel, and one subscriber connection per [`RedisLocks`] dispatches to the
//!   waiters of that name. A jittered backoff, never longer than the holder's remaining
//!   lease, covers lost notifications and leases that simply expire. There is no fixed
//!   polling sleep: the median hand-off is under a millisecond on loopback (`cargo bench`).
//!   A process's waiters of one name (on one store and its clones) line up: only the first
//!   listens for the release, so a release costs one attempt per process, not one per
//!   waiter, and they take the lock in the order they came (unless a caller, or a waiter's
//!   backoff poll, finds it free first). A waiter that leaves the line (cancelled, or out of
//!   time) hands its turn on.
//! - Dropping a guard releases in the background (spawned, never blocking); without a tokio
//!   runtime the lease simply runs out. A crashed holder blocks others for at most its ttl.
//!
//! # Choosing a lock: single Redis vs Redlock vs memory
//!
//! | | [`MemoryLocks`] | [`RedisLocks`] (one node or cluster) | [`Redlock`] (N independent nodes) |
//! |---|---|---|---|
//! | excludes | tasks of one process | every process using that Redis | every process using the N nodes |
//! | survives | - | nothing if the one node dies; on a cluster or with replicas, a failover can lose a just-taken lock (replication is asynchronous) | any minority of nodes failing |
//! | cost per acquire | a mutex | one round trip | N parallel round trips (+1 to raise the fence counters) |
//! | fencing tokens | strictly increasing | strictly increasing, also across restarts while the server clock does not step back | strictly increasing in normal operation, best effort when a node loses data (see [`redlock`]) |
//!
//! - **Memory** is the embedded default: tests, single-replica services, or a local first
//!   stage in front of a distributed lock.
//! - **A single Redis** (or one cluster) is right for most services: it is fast and simple, and
//!   when the lock is only an *efficiency* measure (avoid doing work twice) a rare double grant
//!   after a failover is acceptable. When it is a matter of *correctness*, make the protected
//!   resource check the fencing token: then even a double grant cannot corrupt it.
//! - **Redlock** buys availability when there is no single Redis you are willing to depend on.
//!   It does not buy stronger safety than a consensus system: it assumes bounded clock drift,
//!   nodes that restart no sooner than a lease later (or fsync every write), and holders that
//!   are not paused past their lease (Martin Kleppmann, "How to do distributed locking", 2016;
//!   antirez, "Is Redlock safe?", 2016). Its fencing tokens are the maximum over the granting
//!   quorum, raised on those nodes so that the next quorum sees it: strictly increasing as long
//!   as no node loses its counter. For locks whose double grant would be a disaster, use the
//!   fencing token at the resource, or etcd/ZooKeeper.
//!
//! A guard tells its lease's end by the monotonic clock (`tokio::time::Instant`), which runs
//! through a process paused (SIGSTOP, a long GC-like stall) but, on Linux and macOS, stops
//! while the whole machine is suspended (a laptop asleep, a VM suspended), while Redis, on
//! another machine, goes on expiring keys. A holder that wakes from a suspension longer than
//! its lease still counts the lease as held: it learns otherwise at its next renewal (the
//! watchdog's, within a third of the TTL), which finds the lock gone. Where holders can be
//! suspended, check the fencing token at the resource.
//!
//! A Redis that holds locks needs `maxmemory-policy noeviction`: lock keys always have a TTL,
//! so any `volatile-*` policy (`volatile-ttl` first of all) and every `allkeys-*` one may evict
//! a held lock to make room, and hand it to a second client while the first learns of it only
//! at its next renewal.
//!
//! Custom stores implement [`LockStore`] and convert their error
//! into [`Error`] (`impl From<MyError> for floodgate_lock::Error`, e.g. to [`Error::Store`]).

mod backoff;
mod error;
mod fence;
mod guard;
mod lease;
mod lock;
mod redis_locks;
pub mod redlock;
mod token;

pub use backoff::Backoff;
pub use error::{Error, LeaseLost};
pub use fence::{FenceCheck, FencedResource, StaleFence};
pub use floodgate_core::lock::MAX_LOCK_NAME;
pub use floodgate_core::{LockAttempt, LockStore, MemoryLocks};
pub use guard::LockGuard;
pub use lease::LeaseWatch;
pub use lock::{Lock, MAX_TTL};
pub use redis_locks::{RedisLocks, RedisLocksBuilder};
pub use redlock::Redlock;
