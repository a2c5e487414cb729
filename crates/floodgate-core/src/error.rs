//! Errors of floodgate-core.

/// A policy that cannot be built: names the bad field and what was wrong with it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// A field that must be positive was zero.
    #[error("{field} must be greater than zero")]
    Zero {
        /// The field.
        field: &'static str,
    },
    /// A number that must be finite and positive was not.
    #[error("{field} must be a finite positive number, got {value}")]
    NotPositive {
        /// The field.
        field: &'static str,
        /// The value given.
        value: f64,
    },
    /// A value too large for exact arithmetic or storage.
    #[error("{field} is too large: {value} (the most is {max})")]
    TooLarge {
        /// The field.
        field: &'static str,
        /// The value given.
        value: String,
        /// The largest accepted.
        max: String,
    },
    /// A value too small to be represented.
    #[error("{field} is too small: {reason}")]
    TooSmall {
        /// The field.
        field: &'static str,
        /// Why.
        reason: String,
    },
    /// Any other invalid value.
    #[error("invalid {field}: {reason}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// Why.
        reason: String,
    },
    /// A modifier that does not apply to the policy's algorithm.
    #[error("{field} does not apply to a {algorithm} policy")]
    NotApplicable {
        /// The modifier.
        field: &'static str,
        /// The policy's algorithm.
        algorithm: &'static str,
    },
    /// A policy string that could not be parsed.
    #[error("cannot parse policy {input:?}: {reason}")]
    Parse {
        /// The text given.
        input: String,
        /// Why it failed.
        reason: String,
    },
}

impl PolicyError {
    /// The name of the field at fault, when there is one.
    pub fn field(&self) -> Option<&'static str> {
        match self {
            PolicyError::Zero { field }
            | PolicyError::NotPositive { field, .. }
            | PolicyError::TooLarge { field, .. }
            | PolicyError::TooSmall { field, .. }
            | PolicyError::Invalid { field, .. }
            | PolicyError::NotApplicable { field, .. } => Some(field),
            PolicyError::Parse { .. } => None,
        }
    }
}

/// Errors of the in-memory stores.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// The store holds its maximum number of keys, none has expired, and it is configured to
    /// refuse new keys rather than evict live ones.
    #[error("the in-memory store is full ({max_keys} keys) and set to refuse new keys")]
    Full {
        /// The configured bound.
        max_keys: usize,
    },
    /// A check was malformed.
    #[error("invalid check: {0}")]
    InvalidCheck(String),
}
