//! Metrics, tracing helpers, and keys made safe to log.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, Once, OnceLock, PoisonError};
use std::time::Instant;

use floodgate_core::{CacheStats, DenyCacheStats, LeasingStats};
use metrics::{Counter, Gauge, Histogram};

/// Requests decided, by `outcome`, `source` and `policy` (the strictest policy of the
/// decision; the first rule's when there is none):
///
/// | `outcome` | `source` | |
/// |---|---|---|
/// | `allowed`, `denied` | `store` | decided by the layer's limiter |
/// | `allowed`, `denied` | `fallback` | decided by the local fallback, the store failing |
/// | `error` | `none` | no decision: the store failed, and the layer failed open or closed |
/// | `missing_key` | `none` | no usable key (missing, too long, invalid or ambiguous): rejected |
///
/// Every pair is registered when the policy is first counted, so a dashboard sees zeros.
pub const REQUESTS_TOTAL: &str = "floodgate_requests_total";
/// Time taken by the store to decide, each check (not the local fallback's, nor delay-mode sleeps).
pub const CHECK_DURATION_SECONDS: &str = "floodgate_check_duration_seconds";
/// Store errors and timeouts, by `kind` (`error`, `timeout`).
pub const STORE_ERRORS_TOTAL: &str = "floodgate_store_errors_total";
/// Concurrency leases this layer holds now, by `policy`: responses whose body has not ended,
/// and upgraded connections that keep their [`crate::HeldLease`] (at the store, or its local
/// fallback).
pub const LEASES_HELD: &str = "floodgate_leases_held";

/// Checks the deny cache answered locally (denied without the store). Like every cache and
/// leasing metric, copied from the layer's counters at most once a second while requests
/// flow, and whenever [`crate::RateLimitLayer::stats`] is called; each layer adds its own
/// (a limiter with a deny cache of its own, shared by several layers, is counted by each).
pub const DENY_CACHE_HITS_TOTAL: &str = "floodgate_deny_cache_hits_total";
/// Checks the deny cache passed to the store. Checks it never caches (of a concurrency
/// policy, of cost 0) are not counted.
pub const DENY_CACHE_MISSES_TOTAL: &str = "floodgate_deny_cache_misses_total";
/// Checks that waited for another request's probe of the same check instead of asking the
/// store.
pub const DENY_CACHE_COALESCED_TOTAL: &str = "floodgate_deny_cache_coalesced_total";
/// Denials the deny cache holds (with those that ran out a moment ago, kept while the next
/// call to the store is answered).
pub const DENY_CACHE_ENTRIES: &str = "floodgate_deny_cache_entries";
/// Checks answered from a local lease, without the store.
pub const LEASING_LOCAL_TOTAL: &str = "floodgate_leasing_local_total";
/// Checks local leasing passed to the store.
pub const LEASING_STORE_TOTAL: &str = "floodgate_leasing_store_total";
/// Leases taken from the store.
pub const LEASING_LEASES_TOTAL: &str = "floodgate_leasing_leases_total";
/// Units taken in leases that could not be given back (see `LeasingStats::wasted`).
pub const LEASING_WASTED_UNITS_TOTAL: &str = "floodgate_leasing_wasted_units_total";
/// Units of leases offered back to the store unspent (see `LeasingStats::returned`).
pub const LEASING_RETURNED_UNITS_TOTAL: &str = "floodgate_leasing_returned_units_total";

/// The outcome label of [`REQUESTS_TOTAL`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    Allowed = 0,
    Denied = 1,
    FallbackAllowed = 2,
    FallbackDenied = 3,
    Error = 4,
    MissingKey = 5,
}

impl Outcome {
    /// Its `outcome` and `source` labels, which the `floodgate.check` span records too.
    pub(crate) fn labels(self) -> (&'static str, &'static str) {
        OUTCOMES[self as usize]
    }
}

/// The `outcome` and `source` labels of each [`Outcome`], in its order.
const OUTCOMES: [(&str, &str); 6] = [
    ("allowed", "store"),
    ("denied", "store"),
    ("allowed", "fallback"),
    ("denied", "fallback"),
    ("error", "none"),
    ("missing_key", "none"),
];

fn describe() {
    static DESCRIBED: Once = Once::new();
    DESCRIBED.call_once(|| {
        metrics::describe_counter!(
            REQUESTS_TOTAL,
            "Requests decided by floodgate, by outcome, source and strictest policy"
        );
        metrics::describe_histogram!(
            CHECK_DURATION_SECONDS,
            metrics::Unit::Seconds,
            "Time taken to reach a rate-limit decision"
        );
        metrics::describe_counter!(
            STORE_ERRORS_TOTAL,
            "Rate-limit store errors and timeouts, by kind"
        );
        for (name, help) in [
            (
                DENY_CACHE_HITS_TOTAL,
                "Checks the deny cache denied without the store",
            ),
            (
                DENY_CACHE_MISSES_TOTAL,
                "Checks the deny cache passed to the store",
            ),
            (
                DENY_CACHE_COALESCED_TOTAL,
                "Checks that waited for another's probe",
            ),
            (LEASING_LOCAL_TOTAL, "Checks answered from a local lease"),
            (
                LEASING_STORE_TOTAL,
                "Checks local leasing passed to the store",
            ),
            (LEASING_LEASES_TOTAL, "Leases taken from the store"),
            (
                LEASING_WASTED_UNITS_TOTAL,
                "Leased units that could not be given back",
            ),
            (
                LEASING_RETURNED_UNITS_TOTAL,
                "Leased units offered back to the store unspent",
            ),
        ] {
            metrics::describe_counter!(name, help);
        }
        metrics::describe_gauge!(DENY_CACHE_ENTRIES, "Denials held by the deny cache");
        metrics::describe_gauge!(
            LEASES_HELD,
            "Concurrency leases held by responses and upgraded connections, by policy"
        );
    });
}

/// One policy's counters, registered on first use (install the recorder before serving).
#[derive(Debug, Default)]
pub(crate) struct PolicyMetrics {
    counters: OnceLock<[Counter; 6]>,
    leases: OnceLock<Gauge>,
}

impl PolicyMetrics {
    /// A lease of this (concurrency) policy was taken (`1.0`) or given back (`-1.0`).
    pub(crate) fn lease_held(&self, policy: &str, change: f64) {
        self.leases
            .get_or_init(|| {
                describe();
                metrics::gauge!(LEASES_HELD, "policy" => policy.to_owned())
            })
            .increment(change);
    }

    pub(crate) fn count(&self, policy: &str, outcome: Outcome) {
        let counters = self.counters.get_or_init(|| {
            describe();
            OUTCOMES.map(|(outcome, source)| {
                metrics::counter!(
                    REQUESTS_TOTAL,
                    "outcome" => outcome,
                    "source" => source,
                    "policy" => policy.to_owned()
                )
            })
        });
        counters[outcome as usize].increment(1);
    }
}

/// Layer-wide metrics.
#[derive(Debug)]
pub(crate) struct LayerMetrics {
    duration: OnceLock<Histogram>,
    store_errors: OnceLock<[Counter; 2]>,
    caches: OnceLock<CacheMetrics>,
    /// The cache counters as last copied: each copy adds what they gained since.
    copied: Mutex<CacheStats>,
    /// When the cache counters are next copied, in milliseconds after `base`.
    next_copy_ms: AtomicU64,
    base: Instant,
    /// When a request's own check error (not the store's being down) is next logged at warn,
    /// in milliseconds after `base`, and how many were not logged since.
    next_error_log_ms: AtomicU64,
    errors_not_logged: AtomicU64,
    /// Times in-memory checks (made at the first: a Redis layer never pays its calibration).
    /// `quanta` reads the CPU's counter where it is invariant, a fraction of an `Instant`'s
    /// cost, and the monotonic clock elsewhere.
    timer: OnceLock<quanta::Clock>,
}

impl Default for LayerMetrics {
    fn default() -> Self {
        LayerMetrics {
            duration: OnceLock::new(),
            store_errors: OnceLock::new(),
            caches: OnceLock::new(),
            copied: Mutex::new(CacheStats::default()),
            next_copy_ms: AtomicU64::new(0),
            base: Instant::now(),
            next_error_log_ms: AtomicU64::new(0),
            errors_not_logged: AtomicU64::new(0),
            timer: OnceLock::new(),
        }
    }
}

/// The deny cache's and leasing's metrics.
#[derive(Debug)]
struct CacheMetrics {
    /// Hits, misses, coalesced.
    deny: [Counter; 3],
    entries: Gauge,
    /// Local, store, leases, wasted, returned.
    leasing: [Counter; 5],
}

impl LayerMetrics {
    pub(crate) fn check_duration(&self, seconds: f64) {
        self.duration
            .get_or_init(|| {
                describe();
                metrics::histogram!(CHECK_DURATION_SECONDS)
            })
            .record(seconds);
    }

    fn clock(&self) -> &quanta::Clock {
        self.timer.get_or_init(quanta::Clock::new)
    }

    /// A reading of the check timer, for [`LayerMetrics::check_duration_since`].
    #[inline]
    pub(crate) fn timer(&self) -> u64 {
        self.clock().raw()
    }

    /// Records the time since `start`, a reading of [`LayerMetrics::timer`].
    #[inline]
    pub(crate) fn check_duration_since(&self, start: u64) {
        let clock = self.clock();
        let end = clock.raw();
        self.check_duration(clock.delta(start, end).as_secs_f64());
    }

    pub(crate) fn store_error(&self, timeout: bool) {
        let c = self.store_errors.get_or_init(|| {
            describe();
            [
                metrics::counter!(STORE_ERRORS_TOTAL, "kind" => "error"),
                metrics::counter!(STORE_ERRORS_TOTAL, "kind" => "timeout"),
            ]
        });
        c[usize::from(timeout)].increment(1);
    }

    /// Logs a check that failed for this request only (a corrupted value, a full in-memory
    /// store): at warn at most every 10 s, with how many were not logged meanwhile (a client
    /// may cause one per request), else at debug. `floodgate_store_errors_total` counts them
    /// all.
    pub(crate) fn request_error(&self, e: &dyn std::fmt::Display) {
        let ms = u64::try_from(self.base.elapsed().as_millis()).unwrap_or(u64::MAX);
        if due(&self.next_error_log_ms, ms, 10_000) {
            let not_logged = self.errors_not_logged.swap(0, Ordering::Relaxed);
            tracing::warn!(
                error = %e,
                not_logged,
                "rate-limit check failed for this request (and `not_logged` others since the last such warning)"
            );
        } else {
            self.errors_not_logged.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(error = %e, "rate-limit check failed for this request");
        }
    }

    /// Copies `stats` (of the deny cache and leasing) into their metrics if a second has
    /// passed since the last copy (`now` is about now).
    pub(crate) fn copy_caches_soon(&self, now: Instant, stats: impl FnOnce() -> CacheStats) {
        let ms =
            u64::try_from(now.saturating_duration_since(self.base).as_millis()).unwrap_or(u64::MAX);
        if due(&self.next_copy_ms, ms, 1000) {
            self.copy_caches(stats);
        }
    }

    /// Copies the stats `read` returns into their metrics now, and returns them. They are read
    /// under the lock of the last copy: two copies at once (a request's and a scrape's) add
    /// their gains in the order they were read, never an older count after a newer one.
    pub(crate) fn copy_caches(&self, read: impl FnOnce() -> CacheStats) -> CacheStats {
        let mut copied = self.copied.lock().unwrap_or_else(PoisonError::into_inner);
        let stats = read();
        if stats.deny_cache.is_none() && stats.leasing.is_none() {
            return stats;
        }
        let m = self.caches.get_or_init(|| {
            describe();
            CacheMetrics {
                deny: [
                    metrics::counter!(DENY_CACHE_HITS_TOTAL),
                    metrics::counter!(DENY_CACHE_MISSES_TOTAL),
                    metrics::counter!(DENY_CACHE_COALESCED_TOTAL),
                ],
                entries: metrics::gauge!(DENY_CACHE_ENTRIES),
                leasing: [
                    metrics::counter!(LEASING_LOCAL_TOTAL),
                    metrics::counter!(LEASING_STORE_TOTAL),
                    metrics::counter!(LEASING_LEASES_TOTAL),
                    metrics::counter!(LEASING_WASTED_UNITS_TOTAL),
                    metrics::counter!(LEASING_RETURNED_UNITS_TOTAL),
                ],
            }
        });
        // Each layer adds what its own counters gained since its last copy, so that several
        // layers' counts add up (a limiter shared by several layers is counted by each).
        if let Some(d) = &stats.deny_cache {
            let was = copied.deny_cache.unwrap_or_default();
            let counts = |s: &DenyCacheStats| [s.hits, s.misses, s.coalesced];
            add_gains(&m.deny, counts(d), counts(&was));
            m.entries.increment(d.entries as f64 - was.entries as f64);
        }
        if let Some(l) = &stats.leasing {
            let was = copied.leasing.unwrap_or_default();
            let counts = |s: &LeasingStats| [s.local, s.store, s.leases, s.wasted, s.returned];
            add_gains(&m.leasing, counts(l), counts(&was));
        }
        *copied = stats;
        stats
    }
}

/// Whether `now_ms` has reached `next` (then it moves `every_ms` on): for work done at most
/// that often, by one of the threads that get there at once.
pub(crate) fn due(next: &AtomicU64, now_ms: u64, every_ms: u64) -> bool {
    let at = next.load(Ordering::Relaxed);
    now_ms >= at
        && next
            .compare_exchange(
                at,
                now_ms.saturating_add(every_ms),
                Ordering::Relaxed,
                Ordering::Relaxed,
            )
            .is_ok()
}

/// Adds to each counter what its count gained since `was`.
fn add_gains<const N: usize>(counters: &[Counter; N], now: [u64; N], was: [u64; N]) {
    for ((c, n), w) in counters.iter().zip(now).zip(was) {
        c.increment(n.saturating_sub(w));
    }
}

/// Bytes shown safely in logs: printable ASCII as is, anything else `\xNN`, cut after
/// [`Escaped::MAX`] bytes.
pub(crate) struct Escaped<'a>(&'a [u8]);

impl<'a> Escaped<'a> {
    const MAX: usize = 64;

    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Escaped(bytes)
    }
}

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use fmt::Write as _;
        for &b in self.0.iter().take(Self::MAX) {
            match b {
                b'\\' => f.write_str("\\\\")?,
                b'"' => f.write_str("\\\"")?,
                0x20..=0x7e => f.write_char(char::from(b))?,
                _ => write!(f, "\\x{b:02x}")?,
            }
        }
        if self.0.len() > Self::MAX {
            write!(f, "...({} bytes)", self.0.len())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_and_truncates() {
        assert_eq!(
            Escaped::new(b"ab\"\\\x00\xff").to_string(),
            "ab\\\"\\\\\\x00\\xff"
        );
        let long = vec![b'a'; 100];
        assert_eq!(
            Escaped::new(&long).to_string(),
            format!("{}...(100 bytes)", "a".repeat(64))
        );
    }
}
