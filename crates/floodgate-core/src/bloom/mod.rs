//! Bloom filters: "certainly not in the set" or "maybe in the set", in memory or in Redis.
//!
//! ```
//! use floodgate_core::bloom::{BloomFilter, BloomParams, MemoryBloom};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), floodgate_core::bloom::BloomError> {
//! // The SMS gateway's opt-out list: a hit is then confirmed exactly, a miss is certain.
//! let opted_out = MemoryBloom::new(BloomParams::new(1_000_000, 0.01)?);
//! assert!(opted_out.try_init().await?); // created
//! assert!(!opted_out.try_init().await?); // already there, same parameters
//! opted_out.add_many(&[b"+8613800000000", b"+8613800000001"]).await?;
//! assert!(opted_out.contains(b"+8613800000001").await?);
//! assert!(!opted_out.contains(b"+8613900000000").await?);
//!
//! // Another handle with other parameters is refused rather than reading the wrong bits.
//! let other = opted_out.handle(BloomParams::new(1_000, 0.01)?);
//! assert!(other.contains(b"+8613800000000").await.unwrap_err().is_mismatch());
//! # Ok(()) }
//! ```
//!
//! [`BloomFilter`] is the interface; [`MemoryBloom`] keeps the bits in memory and
//! `floodgate_redis::RedisBloom` in Redis bitmaps, with the same parameters, the same hashing
//! and the same answers. Redisson's `tryInit(n, p)` is [`BloomParams::new`]`(n, p)` given to the
//! handle, then [`BloomFilter::try_init`].
//!
//! # Parameters
//!
//! For `n` expected insertions and a false-positive probability `p`, the filter has
//! `m = ⌈-n·ln p / (ln 2)²⌉` bits and `k = max(1, round(m/n · ln 2))` hash functions, at most
//! [`MAX_BITS`] bits and [`MAX_HASHES`] hashes. The bits are split into `parts` parts of
//! `part_bits = ⌈m / parts⌉` bits (by default as few as fit in [`MAX_PART_BITS`], the size of a
//! Redis string). A filter stores `(scheme, n, p, m, k, parts)` with its bits and every
//! operation checks them against the handle's.
//!
//! # Hashing scheme 1
//!
//! Stable across processes, versions and architectures (integer arithmetic only):
//!
//! 1. `(h1, h2)` = MurmurHash3 x64_128 of the item's bytes with seed 0 ([`murmur3_x64_128`]):
//!    `h1` is the digest's first 8 bytes, `h2` the next 8, both read little-endian.
//! 2. The part is `⌊fmix64(h1 ⊕ h2) · parts / 2^64⌋` (always 0 with one part), where `fmix64`
//!    is MurmurHash3's finaliser.
//! 3. The bit indexes within the part, for `i` in `0..k`, are
//!    `((h1 + i·h2) mod 2^64 with the top bit cleared) mod part_bits` (Kirsch–Mitzenmacher
//!    double hashing, exactly as Guava's `MURMUR128_MITZ_64`).
//! 4. In Redis, index `j` of part `p` is bit `j` of that part's string (`GETBIT key j`); in
//!    memory, bit `j % 64` of word `p·⌈part_bits/64⌉ + j/64`.
//!
//! Any change to these steps must bump [`SCHEME_VERSION`]; `tests/bloom.rs` pins fixed items
//! to fixed indexes so that an accidental change fails a test.

mod error;
mod hash;
mod memory;
mod params;

use std::future::Future;

pub use error::BloomError;
pub use hash::{BitIndexes, ItemHash, SCHEME_VERSION, fmix64, murmur3_x64_128};
pub use memory::MemoryBloom;
pub use params::{BloomParams, MAX_BITS, MAX_HASHES, MAX_PART_BITS, MAX_PARTS};

/// A Bloom filter handle: its parameters, and the storage it reads and writes (in memory or in
/// Redis).
///
/// Every operation checks that the stored filter has the handle's parameters: one created with
/// other parameters is an error, as is one never initialised (or deleted); nothing is read or
/// written with the wrong sizes.
pub trait BloomFilter: Send + Sync {
    /// The backend's error.
    type Error: std::error::Error + Send + Sync + 'static;

    /// The handle's parameters.
    fn params(&self) -> &BloomParams;

    /// Creates the filter with the handle's parameters: `Ok(true)` if it created it,
    /// `Ok(false)` if it exists already with the same parameters, an error naming both sets
    /// if it exists with other parameters.
    fn try_init(&self) -> impl Future<Output = Result<bool, Self::Error>> + Send;

    /// Adds `item`: `Ok(true)` if it is new (some of its bits were 0), `Ok(false)` if it was
    /// already there or is a false positive.
    fn add(&self, item: &[u8]) -> impl Future<Output = Result<bool, Self::Error>> + Send;

    /// `Ok(false)` if `item` was certainly never added; `Ok(true)` if it probably was.
    fn contains(&self, item: &[u8]) -> impl Future<Output = Result<bool, Self::Error>> + Send;

    /// [`BloomFilter::add`] for many items in one round trip per part; the answers are in the
    /// order of `items` and as if they were added one after another.
    fn add_many(
        &self,
        items: &[&[u8]],
    ) -> impl Future<Output = Result<Vec<bool>, Self::Error>> + Send;

    /// [`BloomFilter::contains`] for many items in one round trip per part, in order.
    fn contains_many(
        &self,
        items: &[&[u8]],
    ) -> impl Future<Output = Result<Vec<bool>, Self::Error>> + Send;

    /// The estimated number of distinct items added, from the number of set bits
    /// ([`BloomParams::estimate_count`]).
    fn count(&self) -> impl Future<Output = Result<u64, Self::Error>> + Send;

    /// Removes the filter, whatever its parameters: `Ok(true)` if there was anything to
    /// remove. Later operations get a "not initialised" error until `try_init`.
    fn delete(&self) -> impl Future<Output = Result<bool, Self::Error>> + Send;
}
