//! floodgate: distributed rate limiting and locks for Rust services, on Redis or in memory.
//!
//! This crate gathers the others behind features:
//!
//! | module | crate | feature |
//! |---|---|---|
//! | the crate root, [`core`] | `floodgate-core`: policies, decisions, algorithms, memory stores | always |
//! | [`redis`] | `floodgate-redis`: the Redis backend | `redis` (default) |
//! | [`lock`] | `floodgate-lock`: distributed locks | `lock` (default) |
//! | [`tower`] | `floodgate-tower`: the layer for axum and tonic | `tower` (default) |
//!
//! ```
//! use floodgate::{MemoryLimiter, Policy};
//!
//! let limiter = MemoryLimiter::new();
//! let per_phone = Policy::funnel(1, std::time::Duration::from_secs(30 * 60)).unwrap();
//! assert!(limiter.check_key(b"+8613800000000", &per_phone, 1).allowed);
//! assert!(!limiter.check_key(b"+8613800000000", &per_phone, 1).allowed);
//! ```

#[cfg(all(doctest, feature = "redis", feature = "tower"))]
#[doc = include_str!("../README.md")]
struct ReadmeExamples;

pub use floodgate_core as core;
pub use floodgate_core::*;

#[cfg(feature = "redis")]
pub use floodgate_redis as redis;

#[cfg(feature = "lock")]
pub use floodgate_lock as lock;

#[cfg(feature = "tower")]
pub use floodgate_tower as tower;
