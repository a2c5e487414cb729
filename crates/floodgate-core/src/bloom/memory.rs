//! [`MemoryBloom`]: a Bloom filter in one array of atomic words.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard};

use super::{BloomError, BloomFilter, BloomParams};

/// A Bloom filter in memory: `add` and `contains` take `&self` and are safe from any number of
/// threads (one atomic `fetch_or` or load per bit).
///
/// It follows the same contract as the Redis filter: a handle has parameters, the storage is
/// created by [`MemoryBloom::try_init_sync`] and records the parameters it was created with,
/// and a handle made by [`MemoryBloom::handle`] with other parameters gets
/// [`BloomError::Mismatch`] instead of reading the wrong bits. Clones share the storage.
///
/// ```
/// use floodgate_core::bloom::{BloomParams, MemoryBloom};
///
/// # fn main() -> Result<(), floodgate_core::bloom::BloomError> {
/// let opted_out = MemoryBloom::create(BloomParams::new(10_000, 0.001)?)?;
/// assert!(opted_out.add_sync(b"+8613800000000")?);
/// assert!(opted_out.contains_sync(b"+8613800000000")?);
/// assert!(!opted_out.contains_sync(b"+8613900000000")?);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct MemoryBloom {
    params: BloomParams,
    shared: Arc<RwLock<Option<Bits>>>,
}

/// The storage: the parameters it was created with, and the words of every part (each part
/// starts on a word boundary).
struct Bits {
    params: BloomParams,
    words_per_part: usize,
    words: Box<[AtomicU64]>,
}

const FILTER: &str = "(in memory)";

impl MemoryBloom {
    /// A handle with `params` on new, uninitialised storage: call
    /// [`MemoryBloom::try_init_sync`] (or use [`MemoryBloom::create`]).
    pub fn new(params: BloomParams) -> Self {
        MemoryBloom {
            params,
            shared: Arc::new(RwLock::new(None)),
        }
    }

    /// A filter with `params`, initialised.
    ///
    /// # Errors
    /// [`BloomError::OutOfMemory`] if the bit array cannot be allocated.
    pub fn create(params: BloomParams) -> Result<Self, BloomError> {
        let filter = MemoryBloom::new(params);
        filter.try_init_sync()?;
        Ok(filter)
    }

    /// Another handle on the same storage, with `params`: what a second process opening the
    /// same filter with its own configuration would be.
    pub fn handle(&self, params: BloomParams) -> Self {
        MemoryBloom {
            params,
            shared: Arc::clone(&self.shared),
        }
    }

    /// The handle's parameters.
    pub fn params(&self) -> &BloomParams {
        &self.params
    }

    /// Creates the storage with the handle's parameters: `Ok(true)` if created, `Ok(false)` if
    /// it exists with the same parameters.
    ///
    /// # Errors
    /// [`BloomError::Mismatch`] if it exists with other parameters; [`BloomError::OutOfMemory`].
    pub fn try_init_sync(&self) -> Result<bool, BloomError> {
        let mut slot = self.shared.write().unwrap_or_else(PoisonError::into_inner);
        match &*slot {
            Some(bits) => bits.check(&self.params).map(|()| false),
            None => {
                *slot = Some(Bits::new(self.params)?);
                Ok(true)
            }
        }
    }

    /// Adds `item`: `Ok(true)` if it was not in the filter before (some bit was 0).
    ///
    /// # Errors
    /// [`BloomError::NotInitialized`], [`BloomError::Mismatch`].
    pub fn add_sync(&self, item: &[u8]) -> Result<bool, BloomError> {
        let guard = self.read();
        Ok(checked(&guard, &self.params)?.add(item))
    }

    /// True if `item` may be in the filter; false if it certainly is not.
    ///
    /// # Errors
    /// [`BloomError::NotInitialized`], [`BloomError::Mismatch`].
    pub fn contains_sync(&self, item: &[u8]) -> Result<bool, BloomError> {
        let guard = self.read();
        Ok(checked(&guard, &self.params)?.contains(item))
    }

    /// [`MemoryBloom::add_sync`] for each item, in order.
    ///
    /// # Errors
    /// As [`MemoryBloom::add_sync`]; nothing is added on error.
    pub fn add_many_sync(&self, items: &[&[u8]]) -> Result<Vec<bool>, BloomError> {
        let guard = self.read();
        let bits = checked(&guard, &self.params)?;
        Ok(items.iter().map(|item| bits.add(item)).collect())
    }

    /// [`MemoryBloom::contains_sync`] for each item, in order.
    ///
    /// # Errors
    /// As [`MemoryBloom::contains_sync`].
    pub fn contains_many_sync(&self, items: &[&[u8]]) -> Result<Vec<bool>, BloomError> {
        let guard = self.read();
        let bits = checked(&guard, &self.params)?;
        Ok(items.iter().map(|item| bits.contains(item)).collect())
    }

    /// The estimated number of items added (see [`BloomParams::estimate_count`]).
    ///
    /// # Errors
    /// [`BloomError::NotInitialized`], [`BloomError::Mismatch`].
    pub fn count_sync(&self) -> Result<u64, BloomError> {
        let guard = self.read();
        let bits = checked(&guard, &self.params)?;
        Ok(self.params.estimate_count(bits.set_bits_per_part()))
    }

    /// The number of bits set, over every part.
    ///
    /// # Errors
    /// [`BloomError::NotInitialized`], [`BloomError::Mismatch`].
    pub fn set_bits(&self) -> Result<u64, BloomError> {
        let guard = self.read();
        Ok(checked(&guard, &self.params)?.set_bits_per_part().sum())
    }

    /// Frees the storage, whatever its parameters: `true` if it existed. Every handle then
    /// gets [`BloomError::NotInitialized`] until the next `try_init`.
    pub fn delete_sync(&self) -> bool {
        let mut slot = self.shared.write().unwrap_or_else(PoisonError::into_inner);
        slot.take().is_some()
    }

    fn read(&self) -> RwLockReadGuard<'_, Option<Bits>> {
        // The lock guards no invariant a panic could break (bits only ever go from 0 to 1).
        self.shared.read().unwrap_or_else(PoisonError::into_inner)
    }
}

fn checked<'a>(slot: &'a Option<Bits>, params: &BloomParams) -> Result<&'a Bits, BloomError> {
    let bits = slot.as_ref().ok_or_else(|| BloomError::NotInitialized {
        filter: FILTER.to_owned(),
    })?;
    bits.check(params)?;
    Ok(bits)
}

impl Bits {
    fn new(params: BloomParams) -> Result<Self, BloomError> {
        let words_per_part = params.part_bits().div_ceil(64);
        let words = words_per_part * u64::from(params.parts());
        let out_of_memory = || BloomError::OutOfMemory {
            bytes: words.saturating_mul(8),
        };
        let words_per_part = usize::try_from(words_per_part).map_err(|_| out_of_memory())?;
        let len = usize::try_from(words).map_err(|_| out_of_memory())?;
        let mut vec = Vec::new();
        vec.try_reserve_exact(len).map_err(|_| out_of_memory())?;
        vec.resize_with(len, || AtomicU64::new(0));
        Ok(Bits {
            params,
            words_per_part,
            words: vec.into_boxed_slice(),
        })
    }

    fn check(&self, params: &BloomParams) -> Result<(), BloomError> {
        if self.params == *params {
            return Ok(());
        }
        Err(BloomError::Mismatch {
            filter: FILTER.to_owned(),
            stored: self.params.to_string(),
            requested: params.to_string(),
        })
    }

    /// The word and mask of every bit of `item`.
    fn positions(&self, item: &[u8]) -> impl Iterator<Item = (&AtomicU64, u64)> {
        let (part, indexes) = self.params.locate(item);
        let base = part as usize * self.words_per_part;
        indexes.map(move |i| {
            // `i < part_bits`, so the word is inside the part.
            (&self.words[base + (i / 64) as usize], 1u64 << (i % 64))
        })
    }

    fn add(&self, item: &[u8]) -> bool {
        let mut new = false;
        for (word, mask) in self.positions(item) {
            // Relaxed: bits only go from 0 to 1, and callers that need an add to be seen by
            // another thread's contains order the two themselves.
            new |= word.fetch_or(mask, Ordering::Relaxed) & mask == 0;
        }
        new
    }

    fn contains(&self, item: &[u8]) -> bool {
        self.positions(item)
            .all(|(word, mask)| word.load(Ordering::Relaxed) & mask != 0)
    }

    fn set_bits_per_part(&self) -> impl Iterator<Item = u64> + '_ {
        self.words.chunks(self.words_per_part.max(1)).map(|part| {
            part.iter()
                .map(|w| u64::from(w.load(Ordering::Relaxed).count_ones()))
                .sum()
        })
    }
}

impl fmt::Debug for MemoryBloom {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let initialised = self.read().is_some();
        f.debug_struct("MemoryBloom")
            .field("params", &self.params)
            .field("initialised", &initialised)
            .finish()
    }
}

impl BloomFilter for MemoryBloom {
    type Error = BloomError;

    fn params(&self) -> &BloomParams {
        &self.params
    }

    async fn try_init(&self) -> Result<bool, BloomError> {
        self.try_init_sync()
    }

    async fn add(&self, item: &[u8]) -> Result<bool, BloomError> {
        self.add_sync(item)
    }

    async fn contains(&self, item: &[u8]) -> Result<bool, BloomError> {
        self.contains_sync(item)
    }

    async fn add_many(&self, items: &[&[u8]]) -> Result<Vec<bool>, BloomError> {
        self.add_many_sync(items)
    }

    async fn contains_many(&self, items: &[&[u8]]) -> Result<Vec<bool>, BloomError> {
        self.contains_many_sync(items)
    }

    async fn count(&self) -> Result<u64, BloomError> {
        self.count_sync()
    }

    async fn delete(&self) -> Result<bool, BloomError> {
        Ok(self.delete_sync())
    }
}
