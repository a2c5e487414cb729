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
//! Quotas are high so that both take the "allowed" path.

mod common;

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{KEYS, policy, quota};
use criterion::{Criterion, criterion_group, criterion_main};
use floodgate_core::MemoryLimiter;
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

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = one_key, many_keys
}
criterion_main!(benches);
