//! The in-memory check, side by side with governor in the same run.
//!
//! `cargo bench -p floodgate-core --bench memory_check`
//!
//! - one key: floodgate's keyed store hammered on one key (a 9-byte name, and an IPv4 address
//!   as the tower layer keys a client), governor's direct limiter, and governor's keyed limiter
//!   on one key;
//! - 100k keys across 2 threads: amortised wall time per check (total checks / wall time),
//!   floodgate's sharded store against governor's keyed (DashMap) store.
//!
//! - a full store under a steady flood: a bounded store (65,536 keys) taking one new key per
//!   check (a manual clock), as under a flood of unique client addresses, with as many live
//!   keys as its bound (old keys expire about as fast as new ones come; slot keys, whose
//!   expiries are rounded up to whole seconds, a little more), or 110% (evicting live ones);
//!   8-byte
//!   keys (the compact table) and 24-byte keys (the slot table), evicting (the default) and
//!   refusing; beside governor's keyed store, which has no bound but `retain_recent`, called
//!   after each bound's worth of new keys.
//!
//! Quotas are high so that both take the "allowed" path (but in `full_store_flood`, where
//! each key is checked once).

mod common;

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{KEYS, policy, quota};
use criterion::{Criterion, criterion_group, criterion_main};
use floodgate_core::{ManualClock, MemoryLimiter, OnFull, Policy, Timestamp};
use governor::RateLimiter;

const THREADS: u64 = 2;

fn one_key(c: &mut Criterion) {
    let mut g = c.benchmark_group("one_key");
    let limiter = MemoryLimiter::new();
    let p = policy();
    g.bench_function("floodgate_memory", |b| {
        b.iter(|| black_box(limiter.check_key(black_box(b"client-42"), &p, 1)))
    });
    // The tower layer's per-IP key, which the store packs into a compact entry.
    g.bench_function("floodgate_memory_ipv4", |b| {
        b.iter(|| black_box(limiter.check_key(black_box(b"203.0.113.42"), &p, 1)))
    });
    let direct = RateLimiter::direct(quota());
    g.bench_function("governor_direct", |b| b.iter(|| black_box(direct.check())));
    let keyed = RateLimiter::keyed(quota());
    g.bench_function("governor_keyed", |b| {
        b.iter(|| black_box(keyed.check_key(black_box(&42u64))))
    });
    g.finish();
}

/// Runs `iters` checks split over `THREADS` threads, each cycling through its share of keys,
/// and returns the wall time.
fn threaded<F>(iters: u64, check: Arc<F>) -> Duration
where
    F: Fn(u64) + Send + Sync + 'static,
{
    let per_thread = iters.div_ceil(THREADS);
    let start = Instant::now();
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let check = Arc::clone(&check);
            std::thread::spawn(move || {
                let mut key = t * (KEYS / THREADS);
                for _ in 0..per_thread {
                    check(key);
                    key += 1;
                    if key == (t + 1) * (KEYS / THREADS) {
                        key = t * (KEYS / THREADS);
                    }
                }
            })
        })
        .collect();
    for h in handles {
        let _ = h.join();
    }
    start.elapsed()
}

fn many_keys(c: &mut Criterion) {
    let mut g = c.benchmark_group("100k_keys_2_threads");
    let limiter = MemoryLimiter::new();
    let p = Arc::new(policy());
    let keyed = Arc::new(RateLimiter::keyed(quota()));
    // Warm both stores with every key so that the run measures lookups, not inserts.
    for k in 0..KEYS {
        limiter.check_key(&k.to_le_bytes(), &p, 1);
        let _ = keyed.check_key(&k);
    }
    g.bench_function("floodgate_memory_1_thread", |b| {
        let mut k = 0u64;
        b.iter(|| {
            k = (k + 1) % KEYS;
            black_box(limiter.check_key(&k.to_le_bytes(), &p, 1))
        })
    });
    g.bench_function("governor_keyed_1_thread", |b| {
        let mut k = 0u64;
        b.iter(|| {
            k = (k + 1) % KEYS;
            let _ = black_box(keyed.check_key(&k));
        })
    });
    g.bench_function("floodgate_memory", |b| {
        b.iter_custom(|iters| {
            let (limiter, p) = (limiter.clone(), Arc::clone(&p));
            threaded(
                iters,
                Arc::new(move |k: u64| {
                    black_box(limiter.check_key(&k.to_le_bytes(), &p, 1));
                }),
            )
        })
    });
    g.bench_function("governor_keyed", |b| {
        b.iter_custom(|iters| {
            let keyed = Arc::clone(&keyed);
            threaded(
                iters,
                Arc::new(move |k: u64| {
                    let _ = black_box(keyed.check_key(&k));
                }),
            )
        })
    });
    g.finish();
}

fn full_store_flood(c: &mut Criterion) {
    const MAX_KEYS: u64 = 65_536;
    let mut g = c.benchmark_group("full_store_flood");
    // Each key's state lasts a minute (slots keep whole seconds: about a second more).
    let p = Policy::per_minute(1).expect("valid policy");
    for (name, on_full, long, per_minute) in [
        // As many live keys as the bound: old keys expire about as fast as new ones come.
        ("evict_8_byte_keys", OnFull::EvictSoonest, false, MAX_KEYS),
        ("evict_24_byte_keys", OnFull::EvictSoonest, true, MAX_KEYS),
        ("reject_8_byte_keys", OnFull::Reject, false, MAX_KEYS),
        ("reject_24_byte_keys", OnFull::Reject, true, MAX_KEYS),
        // 110%: live keys are evicted.
        (
            "evict_8_byte_keys_over",
            OnFull::EvictSoonest,
            false,
            MAX_KEYS * 11 / 10,
        ),
        (
            "evict_24_byte_keys_over",
            OnFull::EvictSoonest,
            true,
            MAX_KEYS * 11 / 10,
        ),
    ] {
        let step = Duration::from_nanos(60_000_000_000 / per_minute);
        let clock = ManualClock::new(Timestamp::from_micros(1_000_000));
        let limiter = MemoryLimiter::builder()
            .max_keys(MAX_KEYS as usize)
            .on_full(on_full)
            .clock(clock.clone())
            .build();
        let len = if long { 24 } else { 8 };
        let mut n = 0u64;
        let mut key = [0u8; 24];
        let mut check = || {
            n += 1;
            clock.advance(step);
            key[..8].copy_from_slice(&n.to_le_bytes());
            limiter.check_key(&key[..len], &p, 1)
        };
        // Fill the store, then keep it full.
        for _ in 0..2 * MAX_KEYS {
            let _ = check();
        }
        g.bench_function(name, |b| b.iter(|| black_box(check())));
    }
    // The peer, bounded the way its docs say: `retain_recent` after each bound's worth of new
    // keys drops those whose state is full again (8-byte keys, as many live as the bound).
    let clock = governor::clock::FakeRelativeClock::default();
    type Instant = <governor::clock::FakeRelativeClock as governor::clock::Clock>::Instant;
    let keyed: RateLimiter<_, _, _, governor::middleware::NoOpMiddleware<Instant>> =
        RateLimiter::new(
            governor::Quota::per_minute(std::num::NonZeroU32::MIN),
            governor::state::keyed::DefaultKeyedStateStore::<u64>::default(),
            clock.clone(),
        );
    let step = Duration::from_nanos(60_000_000_000 / MAX_KEYS);
    let mut n = 0u64;
    let mut check = || {
        n += 1;
        clock.advance(step);
        if n.is_multiple_of(MAX_KEYS) {
            keyed.retain_recent();
        }
        keyed.check_key(&n).is_ok()
    };
    for _ in 0..2 * MAX_KEYS {
        let _ = check();
    }
    g.bench_function("governor_keyed_retain_recent", |b| {
        b.iter(|| black_box(check()))
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = one_key, many_keys, full_store_flood
}
criterion_main!(benches);
