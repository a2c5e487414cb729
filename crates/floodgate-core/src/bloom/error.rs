//! Errors of Bloom filters, shared by every backend.

/// What can go wrong with a Bloom filter, whatever stores it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BloomError {
    /// A parameter (or a filter name) that cannot be used.
    #[error("invalid Bloom filter {field} {value}: {reason}")]
    Invalid {
        /// The parameter: `expected_insertions`, `false_probability`, `parts`, `name`.
        field: &'static str,
        /// The value given.
        value: String,
        /// Why it was refused.
        reason: String,
    },
    /// The filter exists with other parameters than this handle's: refused rather than read or
    /// written with the wrong sizes.
    #[error(
        "Bloom filter {filter} exists with other parameters: stored {stored}, this handle has {requested}"
    )]
    Mismatch {
        /// The filter (and part, for a split filter).
        filter: String,
        /// The stored parameters, as stored.
        stored: String,
        /// The handle's parameters.
        requested: String,
    },
    /// The filter does not exist (or was deleted): call `try_init` first.
    #[error("Bloom filter {filter} is not initialised (call try_init first)")]
    NotInitialized {
        /// The filter (and part, for a split filter).
        filter: String,
    },
    /// The in-memory bit array could not be allocated.
    #[error("cannot allocate {bytes} bytes for an in-memory Bloom filter")]
    OutOfMemory {
        /// The size asked for.
        bytes: u64,
    },
}

impl BloomError {
    pub(crate) fn invalid(
        field: &'static str,
        value: impl ToString,
        reason: impl Into<String>,
    ) -> Self {
        BloomError::Invalid {
            field,
            value: value.to_string(),
            reason: reason.into(),
        }
    }

    /// The parameter at fault, for [`BloomError::Invalid`].
    pub fn field(&self) -> Option<&'static str> {
        match self {
            BloomError::Invalid { field, .. } => Some(field),
            _ => None,
        }
    }

    /// True when the filter exists with other parameters.
    pub fn is_mismatch(&self) -> bool {
        matches!(self, BloomError::Mismatch { .. })
    }

    /// True when the filter does not exist.
    pub fn is_not_initialized(&self) -> bool {
        matches!(self, BloomError::NotInitialized { .. })
    }
}
