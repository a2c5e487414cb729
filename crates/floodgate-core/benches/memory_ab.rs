//! The in-memory check against governor, interleaved: each round times floodgate and governor
//! back to back on the same case (the order alternating), so that a machine whose speed drifts
//! during the run (a shared host, a busy neighbour) slows both sides of a round alike. Criterion
//! (`--bench memory_check`) measures each function for seconds on its own, and on such a
//! machine its two medians can come from different weather.
//!
//! `cargo bench -p floodgate-core --bench memory_ab [-- ROUNDS]` (default 41 rounds)
//!
//! Prints, per case, each side's median ns per check over the rounds and the median of the
//! rounds' floodgate/governor ratios (below 1: floodgate is faster). The cases are those of
//! `memory_check`, with the same quotas (high, so both take the "allowed" path):
//! - one key: floodgate's keyed store on `client-42` and on an IPv4 address, against
//!   governor's keyed limiter on one key;
//! - 100k keys, 1 and 2 threads: every key warmed first, then checked in turn (each thread its
//!   own half), amortised wall time per check.

mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use common::{KEYS, policy, quota};
use floodgate_core::MemoryLimiter;
use governor::{DefaultKeyedRateLimiter, RateLimiter};

/// How long one side of one round runs.
const SLICE: Duration = Duration::from_millis(25);

/// Runs `n` checks of keys `from..to` (in turn, wrapping) with `check`, on `threads` threads
/// that split the range; returns the wall time.
fn run(n: u64, threads: u64, from: u64, to: u64, check: &(dyn Fn(u64) + Sync)) -> Duration {
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let span = (to - from) / threads;
            let (lo, hi) = (from + t * span, from + (t + 1) * span);
            s.spawn(move || {
                let mut key = lo;
                for _ in 0..n / threads {
                    check(key);
                    key += 1;
                    if key == hi {
                        key = lo;
                    }
                }
            });
        }
    });
    start.elapsed()
}

struct Case<'a> {
    name: &'static str,
    threads: u64,
    keys: u64,
    floodgate: &'a (dyn Fn(u64) + Sync),
    governor: &'a (dyn Fn(u64) + Sync),
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let rounds: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(41);
    let limiter = MemoryLimiter::new();
    let p = policy();
    let keyed: DefaultKeyedRateLimiter<u64> = RateLimiter::keyed(quota());
    for k in 0..KEYS {
        limiter.check_key(&k.to_le_bytes(), &p, 1);
        let _ = keyed.check_key(&k);
    }
    let fg_many = |k: u64| {
        black_box(limiter.check_key(&k.to_le_bytes(), &p, 1));
    };
    let gov_many = |k: u64| {
        let _ = black_box(keyed.check_key(&k));
    };
    let fg_one = |_: u64| {
        black_box(limiter.check_key(black_box(b"client-42"), &p, 1));
    };
    let fg_ipv4 = |_: u64| {
        black_box(limiter.check_key(black_box(b"203.0.113.42"), &p, 1));
    };
    let gov_one = |_: u64| {
        let _ = black_box(keyed.check_key(black_box(&42u64)));
    };
    let cases = [
        Case {
            name: "one key (client-42)",
            threads: 1,
            keys: 1,
            floodgate: &fg_one,
            governor: &gov_one,
        },
        Case {
            name: "one key (IPv4)",
            threads: 1,
            keys: 1,
            floodgate: &fg_ipv4,
            governor: &gov_one,
        },
        Case {
            name: "100k keys, 1 thread",
            threads: 1,
            keys: KEYS,
            floodgate: &fg_many,
            governor: &gov_many,
        },
        Case {
            name: "100k keys, 2 threads",
            threads: 2,
            keys: KEYS,
            floodgate: &fg_many,
            governor: &gov_many,
        },
    ];
    println!(
        "{rounds} rounds of {} ms per side, the order alternating",
        SLICE.as_millis()
    );
    println!(
        "{:<24} {:>14} {:>14} {:>18}",
        "case", "floodgate ns", "governor ns", "floodgate/governor"
    );
    for case in &cases {
        // Calibrate: checks per slice, from a short run of the slower side.
        let probe = 20_000 * case.threads;
        let slowest = [case.floodgate, case.governor]
            .iter()
            .map(|f| run(probe, case.threads, 0, case.keys.max(case.threads), *f))
            .max()
            .unwrap_or(Duration::from_millis(1));
        let per_check = slowest.as_secs_f64() / probe as f64;
        let n = ((SLICE.as_secs_f64() / per_check) as u64).max(case.threads * 1_000);
        let (mut fg, mut gov, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
        for r in 0..rounds {
            let time = |f: &(dyn Fn(u64) + Sync)| {
                run(n, case.threads, 0, case.keys.max(case.threads), f).as_secs_f64() * 1e9
                    / n as f64
            };
            let (a, b) = if r % 2 == 0 {
                let a = time(case.floodgate);
                (a, time(case.governor))
            } else {
                let b = time(case.governor);
                (time(case.floodgate), b)
            };
            fg.push(a);
            gov.push(b);
            ratio.push(a / b);
        }
        println!(
            "{:<24} {:>14.1} {:>14.1} {:>18.3}",
            case.name,
            median(&mut fg),
            median(&mut gov),
            median(&mut ratio)
        );
    }
}
