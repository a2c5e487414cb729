//! Metrics, tracing helpers, and keys made safe to log.

use std::fmt;
use std::sync::{Once, OnceLock};

use metrics::{Counter, Histogram};

/// Requests decided, by `outcome` (`allowed`, `denied`, `error`, `fallback`) and `policy`
/// (the strictest policy of the decision).
pub const REQUESTS_TOTAL: &str = "floodgate_requests_total";
/// Time taken by the store to decide (including the fallback, excluding delay-mode sleeps).
pub const CHECK_DURATION_SECONDS: &str = "floodgate_check_duration_seconds";
/// Store errors and timeouts, by `kind` (`error`, `timeout`).
pub const STORE_ERRORS_TOTAL: &str = "floodgate_store_errors_total";

/// The outcome label of [`REQUESTS_TOTAL`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    Allowed = 0,
    Denied = 1,
    Error = 2,
    Fallback = 3,
}

const OUTCOMES: [&str; 4] = ["allowed", "denied", "error", "fallback"];

fn describe() {
    static DESCRIBED: Once = Once::new();
    DESCRIBED.call_once(|| {
        metrics::describe_counter!(
            REQUESTS_TOTAL,
            "Requests decided by floodgate, by outcome and strictest policy"
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
    });
}

/// One policy's counters, registered on first use (install the recorder before serving).
#[derive(Debug, Default)]
pub(crate) struct PolicyMetrics {
    counters: OnceLock<[Counter; 4]>,
}

impl PolicyMetrics {
    pub(crate) fn count(&self, policy: &str, outcome: Outcome) {
        let counters = self.counters.get_or_init(|| {
            describe();
            OUTCOMES.map(|o| {
                metrics::counter!(REQUESTS_TOTAL, "outcome" => o, "policy" => policy.to_owned())
            })
        });
        counters[outcome as usize].increment(1);
    }
}

/// Layer-wide metrics.
#[derive(Debug, Default)]
pub(crate) struct LayerMetrics {
    duration: OnceLock<Histogram>,
    store_errors: OnceLock<[Counter; 2]>,
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
