//! The one error type of this crate.

use std::fmt;
use std::time::Duration;

use floodgate_core::MemoryError;

/// Why a lease is no longer ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LeaseLost {
    /// The lease ran out before it was renewed (no watchdog, or the store could not be reached
    /// to renew it in time).
    Expired,
    /// The store says our token no longer holds the lock: it expired there, the key was
    /// deleted or overwritten, or the server lost it (restart, failover).
    NotHeld,
    /// The guard was released or dropped.
    Released,
}

impl fmt::Display for LeaseLost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Expired => "the lease expired before it was renewed",
            Self::NotHeld => "the store no longer holds the lock for this owner",
            Self::Released => "the lock was released",
        })
    }
}

/// Everything that can go wrong taking, holding or releasing a lock.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Bad input, refused when the lock (or store) is built: empty or too long name, zero or
    /// too long lease, a backoff whose bounds make no sense, no Redlock node.
    #[error("invalid lock configuration: {0}")]
    Invalid(String),

    /// Another owner held the lock for the whole wait.
    #[error("lock {name} was not acquired within {waited:?}: another owner held it")]
    Timeout {
        /// The lock name, as [`floodgate_redis::display_key`] shows it.
        name: String,
        /// How long the caller waited.
        waited: Duration,
    },

    /// The lease is gone: the critical section must assume someone else may hold the lock.
    #[error("lost the lease on lock {name}: {reason}")]
    Lost {
        /// The lock name, as [`floodgate_redis::display_key`] shows it.
        name: String,
        /// Why.
        reason: LeaseLost,
    },

    /// Redis failed or could not be reached.
    #[error(transparent)]
    Redis(#[from] floodgate_redis::Error),

    /// The in-memory store refused (full, or malformed input).
    #[error(transparent)]
    Memory(#[from] MemoryError),

    /// Redlock could not reach enough nodes to decide.
    #[error("Redlock needs {quorum} of {nodes} nodes but {failed} failed; first error: {source}")]
    NoQuorum {
        /// Nodes configured.
        nodes: usize,
        /// Nodes that must agree.
        quorum: usize,
        /// Nodes that failed or did not answer in time.
        failed: usize,
        /// The first node error.
        #[source]
        source: Box<Error>,
    },

    /// A Redlock node did not answer within the per-node timeout.
    #[error("Redlock node {node} did not answer within {after:?}")]
    NodeTimeout {
        /// The node's redacted URL.
        node: String,
        /// The per-node timeout.
        after: Duration,
    },

    /// A Redlock node failed recently and is skipped for a moment.
    #[error("Redlock node {node} failed recently; tried again in {retry_in:?}")]
    NodeDown {
        /// The node's redacted URL.
        node: String,
        /// When it is tried again.
        retry_in: Duration,
    },

    /// The store granted the lock, but its answer came when the lease (less the clock drift
    /// allowance) was over: the lock may be someone else's by now, and it is given back. Slow
    /// answers pass (acquiring tries again until its deadline); a lease shorter than the store
    /// usually takes to answer needs lengthening.
    #[error(
        "lock {name}: the store answered after {took:?}, past the lease of {ttl:?} (less its \
         clock drift allowance); the grant was given back"
    )]
    AnsweredTooLate {
        /// The lock name, as [`floodgate_redis::display_key`] shows it.
        name: String,
        /// How long the store took to answer.
        took: Duration,
        /// The lease asked for.
        ttl: Duration,
    },

    /// The operating system gave no random bytes for an owner token.
    #[error("cannot draw a random owner token: {0}")]
    Random(String),

    /// An error from a lock store outside this crate.
    #[error("lock store error: {0}")]
    Store(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl Error {
    /// True when another owner held the lock for the whole wait.
    pub fn is_timeout(&self) -> bool {
        matches!(self, Self::Timeout { .. })
    }

    /// True when the lease was lost (see [`LeaseLost`]).
    pub fn is_lost(&self) -> bool {
        matches!(self, Self::Lost { .. })
    }

    /// True for a failure of the store that may pass by itself: a Redis timeout or connection
    /// problem, a lock's keys split by a cluster slot's migration (`TRYAGAIN`, until the
    /// migration ends), a Redlock without quorum, a node timeout. Acquiring retries these until
    /// its deadline.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Redis(e) => e.is_timeout() || e.is_connection() || e.is_migrating(),
            Self::NoQuorum { .. }
            | Self::NodeTimeout { .. }
            | Self::NodeDown { .. }
            | Self::AnsweredTooLate { .. } => true,
            _ => false,
        }
    }

    /// True for any failure of the store itself (Redis, memory, Redlock, custom store), as
    /// opposed to the lock being busy, the lease being lost or bad input.
    pub fn is_store(&self) -> bool {
        matches!(
            self,
            Self::Redis(_)
                | Self::Memory(_)
                | Self::NoQuorum { .. }
                | Self::NodeTimeout { .. }
                | Self::NodeDown { .. }
                | Self::AnsweredTooLate { .. }
                | Self::Store(_)
        )
    }

    pub(crate) fn lost(name: &[u8], reason: LeaseLost) -> Self {
        Self::Lost {
            name: floodgate_redis::display_key(name),
            reason,
        }
    }
}
