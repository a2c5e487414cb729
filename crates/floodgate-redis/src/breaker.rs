//! A circuit breaker in front of the connection: while Redis is down, callers fail at once
//! instead of each waiting for its timeout.
//!
//! - **Closed**: calls go through. A call that times out or cannot reach the server counts as a
//!   failure; any answer from the server (even an error reply, such as a corrupted key) resets
//!   the count. After [`BreakerConfig::failures`] failures in a row the breaker opens.
//! - **Open**: calls fail at once with [`crate::Error::Unavailable`] for the open period, which
//!   starts at [`BreakerConfig::open_for`] and doubles each time a probe fails, up to
//!   [`BreakerConfig::max_open_for`].
//! - **Half-open**: when the open period ends, one call goes through as a probe while the others
//!   keep failing fast. If it succeeds the breaker closes; if it fails it opens again.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Circuit breaker settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Whether to break at all.
    pub enabled: bool,
    /// Consecutive failures (timeouts, connection errors) that open the breaker. Default 3.
    pub failures: u32,
    /// The first open period. Default 100 ms.
    pub open_for: Duration,
    /// The longest open period: how late, at most, the first probe after a recovery comes.
    /// Default 1 s.
    pub max_open_for: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            enabled: true,
            failures: 3,
            open_for: Duration::from_millis(100),
            max_open_for: Duration::from_secs(1),
        }
    }
}

impl BreakerConfig {
    /// No breaker: every call waits for its own timeout.
    pub fn disabled() -> Self {
        BreakerConfig {
            enabled: false,
            ..BreakerConfig::default()
        }
    }
}

#[derive(Debug)]
enum State {
    Closed { failures: u32 },
    Open { until: Instant, period: Duration },
    HalfOpen { period: Duration },
}

/// Whether a call may go ahead.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Admit {
    /// Go.
    Go,
    /// Go, as the one probe of a half-open breaker.
    Probe,
    /// Fail now; the breaker may let a probe through after this long.
    Reject(Duration),
}

#[derive(Debug)]
pub(crate) struct Breaker {
    cfg: BreakerConfig,
    state: Mutex<State>,
}

impl Breaker {
    pub(crate) fn new(cfg: BreakerConfig) -> Self {
        Breaker {
            cfg,
            state: Mutex::new(State::Closed { failures: 0 }),
        }
    }

    pub(crate) fn admit(&self) -> Admit {
        if !self.cfg.enabled {
            return Admit::Go;
        }
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        match *state {
            State::Closed { .. } => Admit::Go,
            State::Open { until, period } => {
                let now = Instant::now();
                if now >= until {
                    *state = State::HalfOpen { period };
                    Admit::Probe
                } else {
                    Admit::Reject(until - now)
                }
            }
            State::HalfOpen { .. } => Admit::Reject(Duration::ZERO),
        }
    }

    /// Records how a call that was let through ended: `reached` when the server answered.
    pub(crate) fn record(&self, admit: &Admit, reached: bool) -> bool {
        if !self.cfg.enabled {
            return false;
        }
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let mut opened = false;
        *state = match (&*state, reached) {
            (_, true) => State::Closed { failures: 0 },
            (State::Closed { failures }, false) => {
                let failures = failures + 1;
                if failures >= self.cfg.failures {
                    opened = true;
                    State::Open {
                        until: after(self.cfg.open_for),
                        period: self.cfg.open_for,
                    }
                } else {
                    State::Closed { failures }
                }
            }
            (State::HalfOpen { period }, false) if *admit == Admit::Probe => {
                let period = period.saturating_mul(2).min(self.cfg.max_open_for);
                opened = true;
                State::Open {
                    until: after(period),
                    period,
                }
            }
            // A call admitted before the breaker opened, failing late: already open.
            (State::Open { until, period }, false) => State::Open {
                until: *until,
                period: *period,
            },
            (State::HalfOpen { period }, false) => State::HalfOpen { period: *period },
        };
        opened
    }

    /// The probe let through by `admit` ended without an outcome: its caller dropped the call
    /// (a cancelled request, a `select!` that took another branch). Without this the breaker
    /// would stay half-open, failing every call, forever; instead the next call probes.
    pub(crate) fn abandon(&self, admit: &Admit) {
        if *admit != Admit::Probe {
            return;
        }
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let State::HalfOpen { period } = *state {
            *state = State::Open {
                until: Instant::now(),
                period,
            };
        }
    }

    /// Whether the breaker is open now (for health checks).
    pub(crate) fn is_open(&self) -> bool {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        !matches!(*state, State::Closed { .. })
    }
}

/// `d` from now; a duration too long for an `Instant` (a configured `Duration::MAX`) is a
/// century, which is for ever here.
fn after(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d)
        .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 24 * 3600)))
        .unwrap_or(now)
}

/// The breakers of one connection: one for a single node; on a cluster one per range of 128
/// slots (so a master that dies opens only the breakers of its own slots) and one for calls
/// without a key.
#[derive(Debug)]
pub(crate) struct Breakers {
    slots: Box<[Breaker]>,
    keyless: Breaker,
    cluster: bool,
}

/// Slots per breaker on a cluster.
const SLOTS_PER_BREAKER: usize = 128;

impl Breakers {
    pub(crate) fn new(cfg: &BreakerConfig, cluster: bool) -> Self {
        let n = if cluster {
            16_384 / SLOTS_PER_BREAKER
        } else {
            1
        };
        Breakers {
            slots: (0..n).map(|_| Breaker::new(cfg.clone())).collect(),
            keyless: Breaker::new(cfg.clone()),
            cluster,
        }
    }

    /// The breaker of a call to `slot` (`None`: a call without a key).
    pub(crate) fn get(&self, slot: Option<u16>) -> &Breaker {
        match (self.cluster, slot) {
            (true, Some(slot)) => {
                &self.slots[usize::from(slot) / SLOTS_PER_BREAKER % self.slots.len()]
            }
            (true, None) => &self.keyless,
            (false, _) => &self.slots[0],
        }
    }

    /// Whether any breaker is open or probing.
    pub(crate) fn any_open(&self) -> bool {
        self.slots.iter().any(Breaker::is_open) || (self.cluster && self.keyless.is_open())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_failures_and_probes_to_close() {
        let b = Breaker::new(BreakerConfig {
            // Long enough that a busy machine's late wake-ups (tens of ms) change nothing.
            open_for: Duration::from_millis(200),
            ..BreakerConfig::default()
        });
        for _ in 0..2 {
            let a = b.admit();
            assert_eq!(a, Admit::Go);
            assert!(!b.record(&a, false));
        }
        let a = b.admit();
        assert!(b.record(&a, false), "third failure opens");
        assert!(matches!(b.admit(), Admit::Reject(_)));
        std::thread::sleep(Duration::from_millis(250));
        let probe = b.admit();
        assert_eq!(probe, Admit::Probe);
        assert!(matches!(b.admit(), Admit::Reject(_)), "one probe at a time");
        // The probe fails: open again, for twice as long (400 ms).
        assert!(b.record(&probe, false));
        std::thread::sleep(Duration::from_millis(250));
        assert!(matches!(b.admit(), Admit::Reject(_)));
        std::thread::sleep(Duration::from_millis(200));
        let probe = b.admit();
        assert_eq!(probe, Admit::Probe);
        b.record(&probe, true);
        assert_eq!(b.admit(), Admit::Go);
        assert!(!b.is_open());
    }

    #[test]
    fn durations_too_long_for_an_instant_do_not_panic() {
        let b = Breaker::new(BreakerConfig {
            open_for: Duration::MAX,
            max_open_for: Duration::MAX,
            failures: 1,
            ..BreakerConfig::default()
        });
        let a = b.admit();
        assert!(b.record(&a, false), "one failure opens");
        match b.admit() {
            Admit::Reject(wait) => assert!(wait > Duration::from_secs(3600 * 24 * 365)),
            other => panic!("{other:?}"),
        }
        // A probe that fails doubles the period: saturating, still no panic.
        b.abandon(&Admit::Probe);
        *b.state.lock().expect("lock") = State::HalfOpen {
            period: Duration::MAX,
        };
        assert!(b.record(&Admit::Probe, false));
    }

    #[test]
    fn a_dropped_probe_lets_the_next_call_probe() {
        let b = Breaker::new(BreakerConfig {
            open_for: Duration::from_millis(5),
            ..BreakerConfig::default()
        });
        for _ in 0..3 {
            let a = b.admit();
            b.record(&a, false);
        }
        std::thread::sleep(Duration::from_millis(10));
        let probe = b.admit();
        assert_eq!(probe, Admit::Probe);
        assert_eq!(b.admit(), Admit::Reject(Duration::ZERO));
        // The probe's caller gave up before an answer.
        b.abandon(&probe);
        let probe = b.admit();
        assert_eq!(probe, Admit::Probe, "the breaker is not stuck half-open");
        b.record(&probe, true);
        assert_eq!(b.admit(), Admit::Go);
        // Abandoning an ordinary call changes nothing.
        b.abandon(&Admit::Go);
        assert_eq!(b.admit(), Admit::Go);
    }

    #[test]
    fn on_a_cluster_a_dead_slot_range_does_not_open_the_others() {
        let b = Breakers::new(&BreakerConfig::default(), true);
        for _ in 0..3 {
            let breaker = b.get(Some(100));
            let a = breaker.admit();
            breaker.record(&a, false);
        }
        assert!(matches!(b.get(Some(100)).admit(), Admit::Reject(_)));
        // Slot 127 shares the range of slot 100; slot 5000 is another master's.
        assert!(matches!(b.get(Some(127)).admit(), Admit::Reject(_)));
        assert_eq!(b.get(Some(5000)).admit(), Admit::Go);
        assert_eq!(b.get(None).admit(), Admit::Go);
        assert!(b.any_open());
        let single = Breakers::new(&BreakerConfig::default(), false);
        assert!(std::ptr::eq(single.get(Some(1)), single.get(None)));
    }

    #[test]
    fn answers_from_the_server_reset_the_count() {
        let b = Breaker::new(BreakerConfig::default());
        for _ in 0..10 {
            let a = b.admit();
            b.record(&a, false);
            let a = b.admit();
            if a == Admit::Go {
                b.record(&a, true);
            }
        }
        assert_eq!(b.admit(), Admit::Go);
    }
}
