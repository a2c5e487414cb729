//! The core of floodgate: policies, decisions, and the rate-limiting algorithms as pure state
//! machines, with thread-safe in-memory stores.
//!
//! ```
//! use floodgate_core::{MemoryLimiter, Policy};
//!
//! let limiter = MemoryLimiter::new();
//! let per_phone = "funnel:1/30m".parse::<Policy>().unwrap(); // one SMS per phone per 30 min
//! let first = limiter.check_key(b"+8613800000000", &per_phone, 1);
//! let second = limiter.check_key(b"+8613800000000", &per_phone, 1);
//! assert!(first.allowed && !second.allowed);
//! assert!(second.retry_after.unwrap().as_secs() > 29 * 60);
//! ```
//!
//! Every algorithm lives in [`algorithm`], one file each, as a pure transition over
//! `(state, now, cost)`; [`MemoryLimiter`] stores their states per key, and the Redis backend
//! (`floodgate-redis`) runs the same transitions as Lua scripts.

pub mod algorithm;
pub mod bloom;
pub mod calendar;
pub mod clock;
mod decision;
mod error;
pub mod lock;
pub mod parse;
mod policy;
mod store;

pub use bloom::{BloomError, BloomFilter, BloomParams, MemoryBloom};
pub use calendar::{Calendar, CalendarUnit};
pub use clock::{Clock, ManualClock, SystemClock, Timestamp};
pub use decision::{Decision, LeaseId, Verdict};
pub use error::{MemoryError, PolicyError};
pub use lock::{LockAttempt, LockStore, MemoryLocks, Place, WaitQueues};
pub use policy::{AlgorithmKind, Kind, MAX_NAME_LEN, Policy, State};
pub use store::{
    CacheStats, Check, CheckOptions, ConcurrencyLease, DEFAULT_MAX_KEYS, DenyCache, DenyCacheStats,
    LeaseClock, Leasing, LeasingConfig, LeasingStats, Limiter, MAX_LEASE_FOR, MemoryLimiter,
    MemoryLimiterBuilder, OnFull, StoreStats,
};
