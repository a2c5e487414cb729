//! Time: a [`Timestamp`] in microseconds since the Unix epoch, and the [`Clock`]s that tell it.
//!
//! Algorithms never read the time themselves; they are handed `now`. The memory stores ask a
//! [`Clock`]; the Redis backend takes the time from the Redis server. Tests use [`ManualClock`].

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A point in time: whole microseconds since the Unix epoch (UTC).
///
/// Microseconds keep every value an exact integer in a Lua double (below 2^53 until the year
/// 2255), so the Redis scripts compute exactly what the Rust code computes.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Timestamp(u64);

impl Timestamp {
    /// The Unix epoch.
    pub const EPOCH: Timestamp = Timestamp(0);

    /// A timestamp `micros` microseconds after the epoch.
    pub const fn from_micros(micros: u64) -> Self {
        Timestamp(micros)
    }

    /// A timestamp `millis` milliseconds after the epoch (saturating).
    pub const fn from_millis(millis: u64) -> Self {
        Timestamp(millis.saturating_mul(1_000))
    }

    /// Microseconds since the epoch.
    pub const fn as_micros(self) -> u64 {
        self.0
    }

    /// Whole milliseconds since the epoch (rounded down).
    pub const fn as_millis(self) -> u64 {
        self.0 / 1_000
    }

    /// This timestamp moved forward by `d`, saturating at the far future.
    pub fn saturating_add(self, d: Duration) -> Self {
        Timestamp(self.0.saturating_add(duration_micros(d)))
    }

    /// The time from `earlier` to `self`, or zero when `earlier` is later.
    pub fn saturating_since(self, earlier: Timestamp) -> Duration {
        Duration::from_micros(self.0.saturating_sub(earlier.0))
    }

    /// The current system time.
    pub fn now() -> Self {
        let d = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        Timestamp(duration_micros(d))
    }
}

impl fmt::Debug for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Timestamp({}.{:06}s)",
            self.0 / 1_000_000,
            self.0 % 1_000_000
        )
    }
}

/// Whole microseconds in `d`, saturating at `u64::MAX`.
pub(crate) fn duration_micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Microseconds in `d`, rounded up, saturating at `u64::MAX`: a policy's period or window,
/// which must not come out shorter (its rate more permissive) than the one asked for.
pub(crate) fn period_micros(d: Duration) -> u64 {
    let part = u128::from(!d.subsec_nanos().is_multiple_of(1000));
    u64::try_from(d.as_micros() + part).unwrap_or(u64::MAX)
}

/// A source of the current time.
///
/// Implementations must be cheap (they are called once per decision) and should not go
/// backwards; algorithms treat a `now` earlier than their state as "no time has passed".
pub trait Clock: Send + Sync + 'static {
    /// The current time.
    fn now(&self) -> Timestamp;
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now(&self) -> Timestamp {
        (**self).now()
    }
}

/// The system's wall-clock time, read through a monotonic counter.
///
/// The wall clock is sampled once at construction; after that time advances with the CPU's
/// monotonic counter (TSC, via `quanta`, a few nanoseconds a read), so an NTP step does not
/// make limits jump. Calendar-aligned windows still line up with UTC.
#[derive(Clone)]
pub struct SystemClock {
    clock: quanta::Clock,
    anchor_wall: u64,
    anchor_raw: u64,
}

impl SystemClock {
    /// A clock anchored to the wall clock now.
    pub fn new() -> Self {
        let clock = quanta::Clock::new();
        let anchor_raw = clock.raw();
        let anchor_wall = Timestamp::now().as_micros();
        SystemClock {
            clock,
            anchor_wall,
            anchor_raw,
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        SystemClock::new()
    }
}

impl fmt::Debug for SystemClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SystemClock")
            .field("now", &self.now())
            .finish()
    }
}

impl Clock for SystemClock {
    #[inline]
    fn now(&self) -> Timestamp {
        let elapsed = self.clock.delta_as_nanos(self.anchor_raw, self.clock.raw()) / 1_000;
        Timestamp(self.anchor_wall.saturating_add(elapsed))
    }
}

/// A clock that only moves when told to: for tests and simulations.
///
/// Clones share the same time.
#[derive(Clone, Default)]
pub struct ManualClock {
    micros: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock stopped at `start`.
    pub fn new(start: Timestamp) -> Self {
        ManualClock {
            micros: Arc::new(AtomicU64::new(start.as_micros())),
        }
    }

    /// Moves the clock forward by `d`, stopping at the last microsecond a `Timestamp` holds
    /// rather than wrapping around to 1970.
    pub fn advance(&self, d: Duration) {
        let by = duration_micros(d);
        // `fetch_update` retries only on a race; the closure always returns `Some`.
        let _ = self
            .micros
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |t| {
                Some(t.saturating_add(by))
            });
    }

    /// Sets the clock to `t` (which may go backwards: use with care).
    pub fn set(&self, t: Timestamp) {
        self.micros.store(t.as_micros(), Ordering::SeqCst);
    }
}

impl fmt::Debug for ManualClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ManualClock").field(&self.now()).finish()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp(self.micros.load(Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn periods_round_up_to_whole_microseconds() {
        for (nanos, micros) in [
            (0, 0),
            (1, 1),
            (999, 1),
            (1_000, 1),
            (1_001, 2),
            (1_999, 2),
            (2_000, 2),
            (1_000_000_001, 1_000_001),
        ] {
            assert_eq!(
                period_micros(Duration::from_nanos(nanos)),
                micros,
                "{nanos} ns"
            );
        }
        assert_eq!(period_micros(Duration::MAX), u64::MAX);
        assert_eq!(duration_micros(Duration::from_nanos(1_999)), 1);
    }

    #[test]
    fn system_clock_tracks_wall_clock() {
        let clock = SystemClock::new();
        let a = clock.now();
        std::thread::sleep(Duration::from_millis(20));
        let b = clock.now();
        assert!(
            b.saturating_since(a) >= Duration::from_millis(19),
            "{a:?} {b:?}"
        );
        let wall = Timestamp::now();
        let drift = wall.as_micros().abs_diff(b.as_micros());
        assert!(drift < 50_000, "drift {drift}us");
    }

    #[test]
    fn manual_clock_moves_only_when_told() {
        let clock = ManualClock::new(Timestamp::from_millis(1_000));
        let shared = clock.clone();
        assert_eq!(clock.now(), Timestamp::from_millis(1_000));
        shared.advance(Duration::from_millis(250));
        assert_eq!(clock.now(), Timestamp::from_micros(1_250_000));
    }

    #[test]
    fn a_manual_clock_advanced_past_the_end_of_time_stops_there() {
        let clock = ManualClock::new(Timestamp::from_micros(u64::MAX - 10));
        clock.advance(Duration::from_secs(1));
        assert_eq!(clock.now(), Timestamp::from_micros(u64::MAX));
        clock.advance(Duration::MAX);
        assert_eq!(clock.now(), Timestamp::from_micros(u64::MAX));
    }
}
