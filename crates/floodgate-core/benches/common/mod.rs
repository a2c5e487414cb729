//! What the in-memory benches share: the same high quota for floodgate and governor, so that
//! both take the "allowed" path.

use std::num::NonZeroU32;

use floodgate_core::Policy;
use governor::Quota;

pub(crate) const KEYS: u64 = 100_000;
pub(crate) const RATE: u32 = 1_000_000;
pub(crate) const BURST: u32 = u32::MAX;

/// Governor's quota: `RATE` per second, bursts of `BURST`.
pub(crate) fn quota() -> Quota {
    Quota::per_second(NonZeroU32::new(RATE).unwrap_or(NonZeroU32::MIN))
        .allow_burst(NonZeroU32::new(BURST).unwrap_or(NonZeroU32::MIN))
}

/// The same as a floodgate policy.
pub(crate) fn policy() -> Policy {
    Policy::per_second(u64::from(RATE))
        .and_then(|p| p.with_burst(u64::from(BURST)))
        .expect("valid policy")
}
