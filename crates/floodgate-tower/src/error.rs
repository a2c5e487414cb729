//! Errors of floodgate-tower.

/// A layer that cannot be built: says what was wrong and with which value.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The layer has no rule.
    #[error("a rate-limit layer needs at least one rule")]
    NoRules,
    /// Two rules use policies of the same name: their counters and headers would be confused.
    #[error("two rules use a policy named {name:?}: give each rule's policy its own name")]
    DuplicatePolicy {
        /// The name.
        name: String,
    },
    /// A trusted proxy that is neither a network nor an address.
    #[error("invalid trusted proxy {value:?}: expected a network (10.0.0.0/8) or an address")]
    InvalidProxy {
        /// The text given.
        value: String,
    },
    /// A rule's fixed cost is more than its policy ever admits at once: every request would
    /// be turned away, with no time after which a retry could succeed.
    #[error(
        "rule {policy:?} costs {cost} per request, more than its policy admits at once ({limit}): every request would be refused"
    )]
    CostAboveLimit {
        /// The policy's name.
        policy: String,
        /// The rule's cost.
        cost: u64,
        /// The most the policy admits at once (in delay mode, a shaper's burst plus what
        /// `max_wait` lets it reserve).
        limit: u64,
    },
    /// A duration that must be positive was zero.
    #[error("{field} must be greater than zero")]
    Zero {
        /// The setting.
        field: &'static str,
    },
    /// In delay mode, a concurrency policy's lease would lapse while its request waits its
    /// shaper turn: its TTL is not longer than `max_wait` and leases are not renewed. The lease
    /// is taken with the turn; lapsed before the handler runs, it no longer counts, and more
    /// requests than the limit would run at once.
    #[error(
        "concurrency policy {policy:?} leases for {ttl:?}, not longer than the delay's max_wait of {max_wait:?}: its lease could lapse while a request waits its turn; lengthen the TTL, shorten max_wait, or renew leases (renew_leases_up_to)"
    )]
    LeaseShorterThanWait {
        /// The concurrency policy's name.
        policy: String,
        /// Its lease TTL.
        ttl: std::time::Duration,
        /// The layer's `max_wait`.
        max_wait: std::time::Duration,
    },
    /// Invalid leasing settings ([`LeasingConfig::validate`](floodgate_core::LeasingConfig::validate)).
    #[error("invalid leasing settings: {message}")]
    Leasing {
        /// What was wrong, naming the setting.
        message: String,
    },
}
