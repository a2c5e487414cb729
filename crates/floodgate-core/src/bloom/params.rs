//! A filter's parameters: what the caller asks for (n, p), what follows from it (m, k), and how
//! the bits are split into parts.

use std::f64::consts::LN_2;
use std::fmt;

use super::BloomError;
use super::hash::{ItemHash, SCHEME_VERSION};

/// The most bits a filter may have: 2^40 (128 GiB).
pub const MAX_BITS: u64 = 1 << 40;
/// The most bits of one part: 2^32, the most a Redis string holds (512 MiB).
pub const MAX_PART_BITS: u64 = 1 << 32;
/// The most hash functions (bit indexes per item); k = 64 already means p ≈ 5·10^-20.
pub const MAX_HASHES: u32 = 64;
/// The most parts: one per Redis Cluster slot.
pub const MAX_PARTS: u32 = 16_384;

/// The parameters of a Bloom filter, validated.
///
/// From the expected number of insertions `n` and the target false-positive probability `p`:
/// `m = ⌈-n·ln p / (ln 2)²⌉` bits and `k = max(1, round(m/n · ln 2))` hash functions. The `m`
/// bits are split into `parts` parts of `⌈m / parts⌉` bits each; an item lives in one part
/// (see [`ItemHash::part`]). Every filter stores its parameters, and every operation checks
/// that they equal the handle's, so that a filter is never read or written with other sizes.
///
/// ```
/// use floodgate_core::bloom::BloomParams;
///
/// let p = BloomParams::new(1_000_000, 0.01).unwrap();
/// assert_eq!((p.bits(), p.hashes(), p.parts()), (9_585_059, 7, 1));
/// assert_eq!(BloomParams::new(0, 0.01).unwrap_err().field(), Some("expected_insertions"));
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BloomParams {
    expected_insertions: u64,
    false_probability: f64,
    bits: u64,
    hashes: u32,
    parts: u32,
    part_bits: u64,
}

impl BloomParams {
    /// Parameters for `expected_insertions` items at a false-positive probability of
    /// `false_probability`, in as few parts as fit ([`MAX_PART_BITS`] bits each).
    ///
    /// # Errors
    /// [`BloomError::Invalid`] naming the parameter: zero insertions; a probability that is not
    /// strictly between 0 and 1 (or NaN); more than [`MAX_BITS`] bits or [`MAX_HASHES`]
    /// hashes needed.
    pub fn new(expected_insertions: u64, false_probability: f64) -> Result<Self, BloomError> {
        if expected_insertions == 0 {
            return Err(BloomError::invalid(
                "expected_insertions",
                0,
                "must be at least 1",
            ));
        }
        if false_probability.is_nan() || false_probability <= 0.0 || false_probability >= 1.0 {
            return Err(BloomError::invalid(
                "false_probability",
                false_probability,
                "must be strictly between 0 and 1",
            ));
        }
        let n = expected_insertions as f64;
        let m = (-n * false_probability.ln() / (LN_2 * LN_2)).ceil();
        if m > MAX_BITS as f64 {
            return Err(BloomError::invalid(
                "expected_insertions",
                expected_insertions,
                format!(
                    "with false_probability {false_probability} it needs {m:.0} bits; the most \
                     is {MAX_BITS} (2^40)"
                ),
            ));
        }
        // `m` is an integer in [1, 2^40]: exact in both types.
        let bits = (m as u64).max(1);
        let k = (bits as f64 / n * LN_2).round().max(1.0);
        if k > f64::from(MAX_HASHES) {
            return Err(BloomError::invalid(
                "false_probability",
                false_probability,
                format!("it needs {k:.0} hash functions; the most is {MAX_HASHES}"),
            ));
        }
        let parts = bits.div_ceil(MAX_PART_BITS) as u32;
        Ok(BloomParams {
            expected_insertions,
            false_probability,
            bits,
            hashes: k as u32,
            parts,
            part_bits: bits.div_ceil(u64::from(parts)),
        })
    }

    /// The same parameters with the bits split into `parts` parts (a Redis Cluster spreads
    /// them over its nodes).
    ///
    /// # Errors
    /// [`BloomError::Invalid`] naming `parts`: zero, more than [`MAX_PARTS`] or than the bit
    /// count, or too few for parts of at most [`MAX_PART_BITS`] bits.
    pub fn with_parts(self, parts: u32) -> Result<Self, BloomError> {
        let min = self.bits.div_ceil(MAX_PART_BITS);
        if parts == 0 || u64::from(parts) < min {
            return Err(BloomError::invalid(
                "parts",
                parts,
                format!(
                    "{} bits need at least {min} part(s) of at most 2^32 bits",
                    self.bits
                ),
            ));
        }
        if parts > MAX_PARTS || u64::from(parts) > self.bits {
            return Err(BloomError::invalid(
                "parts",
                parts,
                format!(
                    "the most is {} (one per cluster slot, and no more than the {} bits)",
                    u64::from(MAX_PARTS).min(self.bits),
                    self.bits
                ),
            ));
        }
        Ok(BloomParams {
            parts,
            part_bits: self.bits.div_ceil(u64::from(parts)),
            ..self
        })
    }

    /// n: the number of items the filter is sized for.
    pub fn expected_insertions(&self) -> u64 {
        self.expected_insertions
    }

    /// p: the target false-positive probability at n items.
    pub fn false_probability(&self) -> f64 {
        self.false_probability
    }

    /// m: the number of bits the formula asks for.
    pub fn bits(&self) -> u64 {
        self.bits
    }

    /// k: the number of bit indexes per item.
    pub fn hashes(&self) -> u32 {
        self.hashes
    }

    /// The number of parts.
    pub fn parts(&self) -> u32 {
        self.parts
    }

    /// The bits of each part, `⌈m / parts⌉`.
    pub fn part_bits(&self) -> u64 {
        self.part_bits
    }

    /// The bits actually stored, `parts · part_bits` (at most `parts - 1` more than m).
    pub fn total_bits(&self) -> u64 {
        u64::from(self.parts) * self.part_bits
    }

    /// The bytes of one part's bitmap, `⌈part_bits / 8⌉`.
    pub fn part_bytes(&self) -> u64 {
        self.part_bits.div_ceil(8)
    }

    /// The hashing scheme (see the [module docs](super)).
    pub fn scheme(&self) -> u32 {
        SCHEME_VERSION
    }

    /// Where `item` lives: its part and its bit indexes within the part.
    pub fn locate(&self, item: &[u8]) -> (u32, super::BitIndexes) {
        let hash = ItemHash::of(item);
        (
            hash.part(self.parts),
            hash.indexes(self.hashes, self.part_bits),
        )
    }

    /// The estimated number of distinct items from the number of set bits of each part:
    /// the sum over parts of `-(m_part / k)·ln(1 - X_part / m_part)` (with one part, the usual
    /// `n* = -(m/k)·ln(1 - X/m)`), rounded. A full part makes it `u64::MAX`.
    pub fn estimate_count(&self, set_bits_per_part: impl IntoIterator<Item = u64>) -> u64 {
        let m = self.part_bits as f64;
        let k = f64::from(self.hashes);
        let estimate: f64 = set_bits_per_part
            .into_iter()
            .map(|x| -(m / k) * (1.0 - (x as f64).min(m) / m).ln())
            .sum();
        // Saturating: an infinite estimate (a full part) becomes u64::MAX.
        estimate.round() as u64
    }
}

impl fmt::Display for BloomParams {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "n={} p={} (m={} bits, k={}, {} part{}, scheme {})",
            self.expected_insertions,
            self.false_probability,
            self.bits,
            self.hashes,
            self.parts,
            if self.parts == 1 { "" } else { "s" },
            SCHEME_VERSION
        )
    }
}
