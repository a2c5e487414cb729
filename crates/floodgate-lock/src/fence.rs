//! The resource side of fencing tokens: refuse writes from a holder whose lease has lapsed.
//!
//! A lease can run out while its holder still believes it holds the lock (a GC pause, a slow
//! network, a stopped VM). Every acquisition gets a *fencing token* larger than all tokens
//! issued before for that lock; a resource that remembers the highest token it has accepted can
//! then refuse the late writes of the old holder:
//!
//! - a write whose token is **greater than or equal to** the highest accepted is admitted
//!   (equal: the current holder writes several times with the same token), and raises it;
//! - a write whose token is **smaller** is refused: a newer holder has already written.
//!
//! A stale holder that writes *before* its successor's first write is still admitted; that is
//! inherent to fencing and harmless, since the successor writes after it. The check and the
//! write must be one atomic step in the resource, e.g. in SQL:
//!
//! ```sql
//! UPDATE campaign SET state = $2, fence = $3 WHERE id = $1 AND fence <= $3
//! -- 0 rows updated: the token is stale
//! ```

use std::fmt;
use std::sync::{Mutex, PoisonError};

/// A write with a fencing token below the highest one the resource has accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("fencing token {fence} is stale: the resource already accepted token {highest}")]
pub struct StaleFence {
    /// The refused token.
    pub fence: u64,
    /// The highest token accepted so far.
    pub highest: u64,
}

/// The fencing rule as a value, to keep next to your own state under your own lock.
///
/// ```
/// use floodgate_lock::FenceCheck;
///
/// let mut check = FenceCheck::new();
/// assert!(check.admit(7).is_ok());
/// assert!(check.admit(7).is_ok()); // the same holder, writing again
/// assert!(check.admit(9).is_ok()); // the next holder
/// let stale = check.admit(7).unwrap_err(); // the first holder woke up late
/// assert_eq!((stale.fence, stale.highest), (7, 9));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FenceCheck {
    highest: u64,
}

impl FenceCheck {
    /// A check that has accepted nothing yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// A check that has already accepted `highest` (e.g. loaded from storage).
    pub fn starting_at(highest: u64) -> Self {
        Self { highest }
    }

    /// Admits `fence` if it is at least the highest accepted, and remembers it.
    ///
    /// # Errors
    /// [`StaleFence`] if a larger token was accepted before.
    pub fn admit(&mut self, fence: u64) -> Result<(), StaleFence> {
        if fence < self.highest {
            return Err(StaleFence {
                fence,
                highest: self.highest,
            });
        }
        self.highest = fence;
        Ok(())
    }

    /// The highest token accepted (0 before any).
    pub fn highest(&self) -> u64 {
        self.highest
    }
}

/// A value guarded by the fencing rule: every write presents the writer's fencing token, and
/// the check and the write happen under one mutex.
///
/// ```
/// use floodgate_lock::FencedResource;
///
/// let balance = FencedResource::new(100_i64);
/// balance.write(41, |b| *b -= 30).unwrap();
/// balance.write(42, |b| *b -= 30).unwrap();
/// assert!(balance.write(41, |b| *b -= 30).is_err()); // holder 41's lease had lapsed
/// assert_eq!(balance.read(|b| *b), 40);
/// ```
pub struct FencedResource<T> {
    state: Mutex<(FenceCheck, T)>,
}

impl<T> FencedResource<T> {
    /// Guards `value`.
    pub fn new(value: T) -> Self {
        Self {
            state: Mutex::new((FenceCheck::new(), value)),
        }
    }

    /// Runs `write` on the value if `fence` is admitted.
    ///
    /// # Errors
    /// [`StaleFence`] (and `write` does not run) if a larger token has written before.
    pub fn write<R>(&self, fence: u64, write: impl FnOnce(&mut T) -> R) -> Result<R, StaleFence> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.0.admit(fence)?;
        Ok(write(&mut state.1))
    }

    /// Reads the value.
    pub fn read<R>(&self, read: impl FnOnce(&T) -> R) -> R {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        read(&state.1)
    }

    /// The highest token admitted (0 before any).
    pub fn highest(&self) -> u64 {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .0
            .highest()
    }

    /// The value, consuming the guard.
    pub fn into_inner(self) -> T {
        self.state
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner)
            .1
    }
}

impl<T: Default> Default for FencedResource<T> {
    fn default() -> Self {
        Self::new(T::default())
    }
}

impl<T: fmt::Debug> fmt::Debug for FencedResource<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        f.debug_struct("FencedResource")
            .field("highest", &state.0.highest())
            .field("value", &state.1)
            .finish()
    }
}
