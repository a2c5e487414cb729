//! A small log-bucketed latency histogram in the spirit of HdrHistogram: fixed memory, O(1)
//! recording without allocation, quantiles at most 1/128 (0.8%) above the recorded values.
//!
//! Values (nanoseconds) below 256 have a bucket each; above, every power of two is split into
//! 128 buckets, so a bucket is at most 1/128 of its values wide. A quantile is reported as the
//! highest value its bucket can hold (never below the true value), capped at the recorded max.

/// Buckets per power of two above the linear range, as a power of two.
const SUB_BITS: u32 = 8;
/// Values below this have their own bucket.
const LINEAR: u64 = 1 << SUB_BITS;
const HALF: u64 = LINEAR / 2;
/// Enough buckets for every `u64`.
const BUCKETS: usize = (LINEAR + (64 - SUB_BITS as u64) * HALF) as usize;

/// Latencies in nanoseconds.
#[derive(Clone)]
pub(crate) struct Histogram {
    counts: Box<[u64]>,
    total: u64,
    sum: u128,
    min: u64,
    max: u64,
}

impl std::fmt::Debug for Histogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Histogram")
            .field("total", &self.total)
            .field("min", &self.min)
            .field("max", &self.max)
            .finish_non_exhaustive()
    }
}

impl Default for Histogram {
    fn default() -> Self {
        Self::new()
    }
}

/// The bucket of `v`.
fn index(v: u64) -> usize {
    if v < LINEAR {
        return v as usize;
    }
    let msb = 63 - v.leading_zeros(); // >= SUB_BITS
    let shift = msb + 1 - SUB_BITS; // >= 1: v >> shift is in [HALF, LINEAR)
    let mantissa = v >> shift;
    (LINEAR + u64::from(shift - 1) * HALF + (mantissa - HALF)) as usize
}

/// The highest value bucket `i` holds.
fn highest(i: usize) -> u64 {
    let i = i as u64;
    if i < LINEAR {
        return i;
    }
    let j = i - LINEAR;
    let shift = j / HALF + 1;
    let mantissa = j % HALF + HALF;
    // The top bucket's bound is u64::MAX itself.
    ((mantissa + 1) << shift)
        .wrapping_sub(1)
        .max(mantissa << shift)
}

impl Histogram {
    /// An empty histogram (about 64 KiB).
    pub(crate) fn new() -> Self {
        Histogram {
            counts: vec![0; BUCKETS].into_boxed_slice(),
            total: 0,
            sum: 0,
            min: u64::MAX,
            max: 0,
        }
    }

    /// Records one value.
    #[inline]
    pub(crate) fn record(&mut self, v: u64) {
        self.counts[index(v)] += 1;
        self.total += 1;
        self.sum += u128::from(v);
        self.min = self.min.min(v);
        self.max = self.max.max(v);
    }

    /// Adds `other`'s values.
    pub(crate) fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(other.counts.iter()) {
            *a += b;
        }
        self.total += other.total;
        self.sum += other.sum;
        self.min = self.min.min(other.min);
        self.max = self.max.max(other.max);
    }

    /// How many values were recorded.
    pub(crate) fn len(&self) -> u64 {
        self.total
    }

    /// The largest value recorded (0 when empty).
    pub(crate) fn max(&self) -> u64 {
        self.max
    }

    /// The mean (0 when empty).
    pub(crate) fn mean(&self) -> f64 {
        if self.total == 0 {
            return 0.0;
        }
        self.sum as f64 / self.total as f64
    }

    /// The value at quantile `q` (0.5 is the median), 0 when empty.
    pub(crate) fn quantile(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return highest(i).clamp(self.min, self.max);
            }
        }
        self.max
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_every_value_in_order() {
        let mut previous = 0;
        for v in (0..5000).chain([u64::MAX / 3, u64::MAX - 1, u64::MAX]) {
            let i = index(v);
            assert!(i < BUCKETS, "{v}");
            assert!(i >= previous, "{v}");
            assert!(highest(i) >= v, "{v}: bucket {i} ends at {}", highest(i));
            // Relative width: the bucket's bound is within 1/128 of the value.
            assert!(highest(i) - v <= v / 128 + 1, "{v}: {}", highest(i));
            previous = i;
        }
        assert_eq!(index(u64::MAX), BUCKETS - 1);
        assert_eq!(highest(BUCKETS - 1), u64::MAX);
        // Bucket bounds are consecutive.
        for i in 1..BUCKETS {
            assert_eq!(index(highest(i - 1) + 1), i, "{i}");
        }
    }

    #[test]
    fn quantiles_are_close_and_never_low() {
        let mut h = Histogram::new();
        for v in 1..=100_000u64 {
            h.record(v * 1000);
        }
        for (q, want) in [(0.5, 50_000_000u64), (0.9, 90_000_000), (0.999, 99_900_000)] {
            let got = h.quantile(q);
            assert!(
                got >= want && got - want <= want / 128,
                "q{q}: {got} vs {want}"
            );
        }
        assert_eq!(h.quantile(1.0), 100_000_000);
        assert_eq!(h.max(), 100_000_000);
        let mut other = Histogram::new();
        other.record(5);
        h.merge(&other);
        assert_eq!(h.len(), 100_001);
        assert_eq!(h.quantile(0.0), 5);
        assert_eq!(Histogram::new().quantile(0.5), 0);
    }
}
