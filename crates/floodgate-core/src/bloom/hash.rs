//! MurmurHash3 x64_128 and the item → (part, bit indexes) mapping of scheme 1.
//!
//! Everything here is integer arithmetic on little-endian reads, so it gives the same answer on
//! every architecture, process and version; `tests/bloom.rs` pins it with fixed items and
//! fixed indexes.

/// The hashing scheme version stored with every filter. Bump it whenever anything in this file
/// changes what an item maps to: filters written with another scheme are then refused instead
/// of being read with the wrong bits.
pub const SCHEME_VERSION: u32 = 1;

const C1: u64 = 0x87c3_7b91_1142_53d5;
const C2: u64 = 0x4cf5_ad43_2745_937f;

/// MurmurHash3 x64_128 of `data` (Austin Appleby's reference `MurmurHash3_x64_128`), as its
/// two 64-bit halves `(h1, h2)`: the digest's bytes are `h1` then `h2`, each little-endian.
///
/// ```
/// use floodgate_core::bloom::murmur3_x64_128;
/// assert_eq!(murmur3_x64_128(b"", 0), (0, 0));
/// assert_eq!(
///     murmur3_x64_128(b"The quick brown fox jumps over the lazy dog", 0),
///     (0xe34b_bc7b_bc07_1b6c, 0x7a43_3ca9_c49a_9347),
/// );
/// ```
pub fn murmur3_x64_128(data: &[u8], seed: u32) -> (u64, u64) {
    let mut h1 = u64::from(seed);
    let mut h2 = u64::from(seed);

    let mut blocks = data.chunks_exact(16);
    for block in &mut blocks {
        let (lo, hi) = block.split_at(8);
        let k1 = read_u64_le(lo);
        let k2 = read_u64_le(hi);

        h1 ^= mix_k1(k1);
        h1 = h1
            .rotate_left(27)
            .wrapping_add(h2)
            .wrapping_mul(5)
            .wrapping_add(0x52dc_e729);

        h2 ^= mix_k2(k2);
        h2 = h2
            .rotate_left(31)
            .wrapping_add(h1)
            .wrapping_mul(5)
            .wrapping_add(0x3849_5ab5);
    }

    let tail = blocks.remainder();
    if tail.len() > 8 {
        h2 ^= mix_k2(read_partial_le(&tail[8..]));
    }
    if !tail.is_empty() {
        h1 ^= mix_k1(read_partial_le(&tail[..tail.len().min(8)]));
    }

    // The reference mixes in the length as a 64-bit value.
    let len = data.len() as u64;
    h1 ^= len;
    h2 ^= len;
    h1 = h1.wrapping_add(h2);
    h2 = h2.wrapping_add(h1);
    h1 = fmix64(h1);
    h2 = fmix64(h2);
    h1 = h1.wrapping_add(h2);
    h2 = h2.wrapping_add(h1);
    (h1, h2)
}

fn mix_k1(k1: u64) -> u64 {
    k1.wrapping_mul(C1).rotate_left(31).wrapping_mul(C2)
}

fn mix_k2(k2: u64) -> u64 {
    k2.wrapping_mul(C2).rotate_left(33).wrapping_mul(C1)
}

/// MurmurHash3's 64-bit finaliser: a bijection that spreads every input bit over the output.
pub fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^= k >> 33;
    k
}

fn read_u64_le(bytes: &[u8]) -> u64 {
    let mut buf = [0u8; 8];
    buf.copy_from_slice(bytes);
    u64::from_le_bytes(buf)
}

/// Up to 8 bytes, little-endian, missing high bytes zero (the reference's tail switch).
fn read_partial_le(bytes: &[u8]) -> u64 {
    let mut buf = [0u8; 8];
    buf[..bytes.len()].copy_from_slice(bytes);
    u64::from_le_bytes(buf)
}

/// The 128-bit hash of one item, from which its part and its bit indexes are derived.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ItemHash {
    /// The digest's first (low) 64 bits.
    pub h1: u64,
    /// The digest's second (high) 64 bits.
    pub h2: u64,
}

impl ItemHash {
    /// MurmurHash3 x64_128 of `item` with seed 0.
    pub fn of(item: &[u8]) -> Self {
        let (h1, h2) = murmur3_x64_128(item, 0);
        ItemHash { h1, h2 }
    }

    /// The part (of `parts`) the item belongs to: `⌊fmix64(h1 ⊕ h2) · parts / 2^64⌋`. The
    /// finaliser decorrelates it from the bit indexes, which use `h1` and `h2` directly.
    pub fn part(self, parts: u32) -> u32 {
        let mixed = fmix64(self.h1 ^ self.h2);
        // The product of a u64 and a u32 shifted right by 64 is below `parts`.
        ((u128::from(mixed) * u128::from(parts)) >> 64) as u32
    }

    /// The item's `hashes` bit indexes within a part of `part_bits` bits, by double hashing as
    /// Guava's `MURMUR128_MITZ_64`: index `i` is `((h1 + i·h2) mod 2^64, top bit cleared) mod
    /// part_bits`. `part_bits` must be positive.
    pub fn indexes(self, hashes: u32, part_bits: u64) -> BitIndexes {
        BitIndexes {
            combined: self.h1,
            step: self.h2,
            left: hashes,
            part_bits: part_bits.max(1),
        }
    }
}

/// The bit indexes of one item within its part: see [`ItemHash::indexes`].
#[derive(Clone, Debug)]
pub struct BitIndexes {
    combined: u64,
    step: u64,
    left: u32,
    part_bits: u64,
}

impl Iterator for BitIndexes {
    type Item = u64;

    fn next(&mut self) -> Option<u64> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let index = (self.combined & (u64::MAX >> 1)) % self.part_bits;
        self.combined = self.combined.wrapping_add(self.step);
        Some(index)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.left as usize;
        (left, Some(left))
    }
}

impl ExactSizeIterator for BitIndexes {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_lengths_all_differ() {
        // Every tail length (0..=15) goes through its own branch of the tail switch.
        let data: Vec<u8> = (0u8..40).collect();
        let mut seen = std::collections::HashSet::new();
        for len in 0..=data.len() {
            assert!(seen.insert(murmur3_x64_128(&data[..len], 0)), "len {len}");
        }
    }

    #[test]
    fn part_is_in_range_and_spread() {
        let mut counts = [0u32; 7];
        for i in 0u32..70_000 {
            let p = ItemHash::of(&i.to_le_bytes()).part(7);
            counts[p as usize] += 1;
        }
        for c in counts {
            assert!((9_000..11_000).contains(&c), "{counts:?}");
        }
        assert_eq!(ItemHash::of(b"x").part(1), 0);
    }
}
