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
    /// A duration that must be positive was zero.
    #[error("{field} must be greater than zero")]
    Zero {
        /// The setting.
        field: &'static str,
    },
}
