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
    /// In delay mode, a concurrency policy checked beside a shaper could see its lease lapse
    /// while the request waits its turn: the lease is sure to last (its TTL, or with renewal
    /// `renew_leases_up_to`'s `max` and two thirds of a TTL) no longer than `max_wait` and the
    /// layer's timeout. Lapsed before the handler runs, it no longer counts, and more requests
    /// than the limit would run at once.
    #[error(
        "concurrency policy {policy:?}'s lease is sure to last only {lasts:?}, while a request checked with a shaper may wait {needed:?} for its turn after asking for it (max_wait and the layer's timeout): lengthen the TTL, shorten max_wait, renew leases for longer (renew_leases_up_to), or keep the two rules on different paths or methods"
    )]
    LeaseShorterThanWait {
        /// The concurrency policy's name.
        policy: String,
        /// How long its lease is sure to last.
        lasts: std::time::Duration,
        /// How long after asking for it a request may wait: `max_wait` and the timeout.
        needed: std::time::Duration,
    },
    /// Invalid leasing settings ([`LeasingConfig::validate`](floodgate_core::LeasingConfig::validate)).
    #[error("invalid leasing settings: {message}")]
    Leasing {
        /// What was wrong, naming the setting.
        message: String,
    },
}
