//! The in-memory limiter under threads, all-or-nothing checks, key floods and leases.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use floodgate_core::{
    Check, CheckOptions, Limiter, ManualClock, MemoryError, MemoryLimiter, OnFull, Policy,
    Timestamp,
};

fn clock() -> ManualClock {
    ManualClock::new(Timestamp::from_millis(1_700_000_000_000))
}

/// A limiter on `clock` that refuses new keys beyond `max_keys`, over `shards` shards.
fn refusing(clock: &ManualClock, max_keys: usize, shards: usize) -> MemoryLimiter<ManualClock> {
    MemoryLimiter::builder()
        .clock(clock.clone())
        .max_keys(max_keys)
        .shards(shards)
        .on_full(OnFull::Reject)
        .build()
}

#[test]
fn threads_racing_on_one_key_admit_exactly_the_limit() {
    let policies = [
        Policy::fixed_window(100, Duration::from_secs(60)),
        Policy::sliding_log(100, Duration::from_secs(60)),
        Policy::sliding_window(100, Duration::from_secs(60)),
        Policy::token_bucket(100, 1, Duration::from_secs(60)),
        Policy::funnel(100, Duration::from_secs(600)),
        Policy::gcra(99, 1, Duration::from_secs(60)),
        Policy::concurrency(100, Duration::from_secs(60)),
    ];
    for policy in policies {
        let policy = Arc::new(policy.expect("valid"));
        let limiter = MemoryLimiter::builder().clock(clock()).build();
        let admitted = Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (limiter, policy, admitted) =
                    (limiter.clone(), Arc::clone(&policy), Arc::clone(&admitted));
                std::thread::spawn(move || {
                    for _ in 0..250 {
                        if limiter.check_key(b"one-key", &policy, 1).allowed {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("thread");
        }
        assert_eq!(admitted.load(Ordering::Relaxed), 100, "{policy:?}");
    }
}

#[test]
fn nothing_is_counted_unless_every_policy_allows() {
    let limiter = MemoryLimiter::builder().clock(clock()).build();
    let per_ip = Policy::per_minute(10).expect("valid");
    let global = Policy::fixed_window(1, Duration::from_secs(60)).expect("valid");
    let checks = [Check::new(b"10.0.0.1", &per_ip), Check::new(b"", &global)];

    let first = limiter
        .check_sync(&checks, CheckOptions::default())
        .expect("check");
    assert!(first.allowed());
    assert_eq!(first.decisions[0].remaining, 9);

    let second = limiter
        .check_sync(&checks, CheckOptions::default())
        .expect("check");
    assert!(!second.allowed());
    assert!(second.decisions[0].allowed && !second.decisions[1].allowed);
    // The per-IP policy reports its state unchanged: still 9 left.
    assert_eq!(second.decisions[0].remaining, 9);
    assert_eq!(second.strictest().map(|(i, _)| i), Some(1));
    assert_eq!(limiter.check_key(b"10.0.0.1", &per_ip, 1).remaining, 8);
}

#[test]
fn all_or_nothing_checks_on_shared_keys_do_not_deadlock_or_overcount() {
    let limiter = MemoryLimiter::builder().clock(clock()).shards(64).build();
    let global = Arc::new(Policy::fixed_window(500, Duration::from_secs(60)).expect("valid"));
    let per_user = Arc::new(Policy::fixed_window(50, Duration::from_secs(60)).expect("valid"));
    let admitted = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let (limiter, global, per_user, admitted) = (
                limiter.clone(),
                Arc::clone(&global),
                Arc::clone(&per_user),
                Arc::clone(&admitted),
            );
            std::thread::spawn(move || {
                for i in 0..2_000u64 {
                    let user = ((t * 7 + i) % 16).to_string();
                    // Alternate the order so that lock ordering is exercised.
                    let a = Check::new(user.as_bytes(), &per_user);
                    let b = Check::new(b"global", &global);
                    let checks = if i % 2 == 0 { [a, b] } else { [b, a] };
                    let v = limiter
                        .check_sync(&checks, CheckOptions::default())
                        .expect("check");
                    if v.allowed() {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("thread");
    }
    // 16 users x 50 = 800 > 500: the global limit binds exactly.
    assert_eq!(admitted.load(Ordering::Relaxed), 500);
}

/// Single GCRA checks advance a held state under the shard's read lock (a compare-and-swap);
/// all-or-nothing checks and inserts take the write lock. Raced on the same keys, neither
/// loses the other's count.
#[test]
fn single_and_all_or_nothing_gcra_checks_racing_on_one_key_admit_exactly_the_limit() {
    let limiter = MemoryLimiter::builder().clock(clock()).shards(4).build();
    // Burst 200 in an hour: about 200 admitted at one instant, never more.
    let global = Arc::new(Policy::gcra(199, 1, Duration::from_secs(3600)).expect("valid"));
    let per_user = Arc::new(
        Policy::gcra(999, 1, Duration::from_secs(3600))
            .and_then(|p| p.named("per-user"))
            .expect("valid"),
    );
    let admitted = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let (limiter, global, per_user, admitted) = (
                limiter.clone(),
                Arc::clone(&global),
                Arc::clone(&per_user),
                Arc::clone(&admitted),
            );
            std::thread::spawn(move || {
                for i in 0..500u64 {
                    let user = format!("u{}", (t + i) % 4);
                    let allowed = if t % 2 == 0 {
                        limiter.check_key(b"global", &global, 1).allowed
                    } else {
                        let checks = [
                            Check::new(user.as_bytes(), &per_user),
                            Check::new(b"global", &global),
                        ];
                        limiter
                            .check_sync(&checks, CheckOptions::default())
                            .expect("check")
                            .allowed()
                    };
                    if allowed {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("thread");
    }
    assert_eq!(admitted.load(Ordering::Relaxed), 200);
    assert!(!limiter.check_key(b"global", &global, 1).allowed);
}

/// Times past what the store's states can hold are refused, not saturated into wrong
/// decisions: past 2106 a slot's expiry (whole seconds in 32 bits) would read as passed, and a
/// full store set to refuse new keys would drop live state to make room.
#[test]
fn a_time_beyond_the_year_2106_is_refused() {
    let limiter = MemoryLimiter::builder().clock(clock()).build();
    let p = Policy::per_second(1).expect("valid");
    for far in [u64::from(u32::MAX) * 1_000_000, 1 << 53, 1 << 56] {
        let far = Timestamp::from_micros(far);
        let refused = limiter.check_sync(&[Check::new(b"k", &p)], CheckOptions::at(far));
        assert!(
            matches!(&refused, Err(MemoryError::InvalidCheck(m)) if m.contains("beyond")),
            "{refused:?}"
        );
    }
    let last = Timestamp::from_micros((u64::from(u32::MAX) - 1) * 1_000_000);
    for allowed in [true, false] {
        let v = limiter
            .check_sync(&[Check::new(b"k", &p)], CheckOptions::at(last))
            .expect("within range");
        assert_eq!(v.allowed(), allowed);
    }
    // Near the end of the range, a full store that refuses new keys keeps the state it has.
    let clock = ManualClock::new(Timestamp::from_micros(
        (u64::from(u32::MAX) - 3_600) * 1_000_000,
    ));
    let full = refusing(&clock, 16, 1);
    let hourly = Policy::per_hour(1).expect("valid");
    for i in 0..16u8 {
        assert!(full.check_key(&[b'k', i], &hourly, 1).allowed);
    }
    clock.advance(Duration::from_secs(1));
    assert!(
        !full.check_key(b"new", &hourly, 1).allowed,
        "the store is full"
    );
    for i in 0..16u8 {
        assert!(
            !full.check_key(&[b'k', i], &hourly, 1).allowed,
            "key {i} lost its state"
        );
    }
}

#[test]
fn a_flood_of_unique_keys_stays_within_the_bound() {
    let limiter = MemoryLimiter::builder()
        .clock(clock())
        .max_keys(10_000)
        .build();
    let policy = Policy::per_minute(5).expect("valid");
    for i in 0..200_000u32 {
        assert!(limiter.check_key(&i.to_be_bytes(), &policy, 1).allowed);
    }
    let stats = limiter.stats();
    assert!(stats.keys <= 10_000, "{stats:?}");
    assert!(stats.evicted >= 190_000, "{stats:?}");
}

#[test]
fn expired_state_is_dropped_before_live_state() {
    let clock = clock();
    let limiter = refusing(&clock, 1_000, 16);
    let policy = Policy::per_second(1).expect("valid");
    // Keys spread over shards, each holding its share of the bound: some shards fill first.
    let admitted: Vec<u32> = (0..2_000u32)
        .filter(|i| limiter.check_key(&i.to_be_bytes(), &policy, 1).allowed)
        .collect();
    let stats = limiter.stats();
    assert!(admitted.len() <= 1_000 && admitted.len() > 500, "{stats:?}");
    assert_eq!(stats.refused as usize, 2_000 - admitted.len());
    let refused = limiter
        .check_sync(
            &[Check::new(&1_999u32.to_be_bytes(), &policy)],
            CheckOptions::default(),
        )
        .map(|v| v.allowed());
    assert!(
        matches!(refused, Err(MemoryError::Full { .. }) | Ok(false)),
        "{refused:?}"
    );
    // Existing keys keep their state while full.
    assert!(
        !limiter
            .check_key(&admitted[7].to_be_bytes(), &policy, 1)
            .allowed
    );
    clock.advance(Duration::from_secs(1));
    limiter.purge_expired();
    assert_eq!(limiter.stats().keys, 0);
    assert!(limiter.check_key(b"newcomer", &policy, 1).allowed);
}

/// GCRA states of short keys live in a compact table, the others in slots: every key keeps its
/// own state on either side of the boundary, under any path (check, all-or-nothing, state,
/// reset).
#[test]
fn gcra_keys_on_both_sides_of_the_compact_boundary_keep_their_own_state() {
    let limiter = MemoryLimiter::builder().clock(clock()).build();
    let p = Policy::per_hour(1).expect("valid");
    let q = Policy::per_hour(1)
        .and_then(|q| q.named("other"))
        .expect("valid");
    let mut keys: Vec<Vec<u8>> = Vec::new();
    for len in 0..=16usize {
        keys.push(vec![b'k'; len]);
        keys.push(vec![0; len]);
        // The same bytes with one more zero at the end: a different key.
        let mut longer = vec![b'k'; len];
        longer.push(0);
        keys.push(longer);
    }
    // IPv4 addresses: canonical ones longer than 8 bytes pack as addresses, others as bytes.
    // Then numbers.
    for ip in [
        "10.0.0.1",
        "192.168.100.1",
        "203.113.100.200",
        "203.113.100.20",
        "203.113.100.020",
        "203.113.100.2000",
        // Numbers of 9 to 19 digits pack as numbers; with a leading zero, as other keys.
        "15551234567",
        "015551234567",
        "1555123456",
        "9999999999999999999",
        "10000000000000000000",
    ] {
        keys.push(ip.as_bytes().to_vec());
    }
    keys.sort();
    keys.dedup();
    for key in &keys {
        assert!(limiter.check_key(key, &p, 1).allowed, "{key:?}");
        assert!(limiter.state(key, &p).is_some(), "{key:?}");
    }
    for key in &keys {
        assert!(!limiter.check_key(key, &p, 1).allowed, "{key:?}");
        // Another policy on the same key has its own state.
        assert!(limiter.check_key(key, &q, 1).allowed, "{key:?}");
    }
    assert_eq!(limiter.stats().keys, 2 * keys.len());
    // All-or-nothing over both tables: the 8-byte key is exhausted, so the 9-byte key's fresh
    // state is not counted.
    let (short, long) = (vec![b'k'; 8], vec![b'x'; 9]);
    let denied = limiter
        .check_sync(
            &[Check::new(&long, &p), Check::new(&short, &p)],
            CheckOptions::default(),
        )
        .expect("check");
    assert!(!denied.allowed());
    assert!(limiter.state(&long, &p).is_none());
    // Reset on both sides.
    limiter.reset_sync(&short, &p);
    limiter.reset_sync(&[b'k'; 9], &p);
    assert!(limiter.check_key(&short, &p, 1).allowed);
    assert!(limiter.check_key(&[b'k'; 9], &p, 1).allowed);
    assert!(!limiter.check_key(&[b'k'; 10], &p, 1).allowed);
}

/// The compact table serves a store's first fifteen GCRA policies; the others keep their
/// states in slots, and decide the same.
#[test]
fn gcra_policies_beyond_the_compact_table_s_fifteen_decide_the_same() {
    let clock = clock();
    let limiter = MemoryLimiter::builder().clock(clock.clone()).build();
    let policies: Vec<Policy> = (0..20)
        .map(|i| {
            Policy::per_second(2)
                .and_then(|p| p.named(&format!("policy-{i}")))
                .expect("valid")
        })
        .collect();
    for round in 0..3 {
        for p in &policies {
            for key in [
                &b"12345678"[..],
                b"10.0.0.1",
                b"203.113.100.200",
                b"a-longer-key",
            ] {
                let d = limiter.check_key(key, p, 1);
                // Two per second: the third check of a second is denied, with the same retry
                // time whichever table holds the state.
                assert_eq!(d.allowed, round < 2, "{} {key:?} round {round}", p.name());
                if round == 2 {
                    assert_eq!(d.retry_after, Some(Duration::from_millis(500)));
                }
            }
        }
    }
    assert_eq!(limiter.stats().keys, 20 * 4);
    clock.advance(Duration::from_millis(500));
    for p in &policies {
        assert!(limiter.check_key(b"12345678", p, 1).allowed, "{}", p.name());
        assert!(
            !limiter.check_key(b"12345678", p, 1).allowed,
            "{}",
            p.name()
        );
    }
}

#[test]
fn short_and_long_keys_share_one_bound() {
    let clock = clock();
    let limiter = refusing(&clock, 1_000, 16);
    let p = Policy::per_second(1).expect("valid");
    let admitted = (0..4_000u32)
        .filter(|i| {
            let key = if i % 2 == 0 {
                i.to_be_bytes().to_vec()
            } else {
                format!("a-longer-key-{i}").into_bytes()
            };
            limiter.check_key(&key, &p, 1).allowed
        })
        .count();
    let stats = limiter.stats();
    assert!(stats.keys <= 1_000 && stats.keys == admitted, "{stats:?}");
    assert_eq!(stats.refused as usize, 4_000 - admitted);
    // Both tables expire and are swept.
    clock.advance(Duration::from_secs(1));
    limiter.purge_expired();
    assert_eq!(limiter.stats().keys, 0);
}

/// A full shard, one of whose keys has expired: an all-or-nothing check of that key and a new
/// one must make room for both before counting either (the sweep frees the expired key, which
/// then comes back as new).
#[test]
fn a_full_store_refuses_an_all_or_nothing_check_whole_when_an_expired_key_returns() {
    let clock = clock();
    let limiter = refusing(&clock, 16, 1);
    let short = Policy::per_second(1).expect("valid");
    let long = Policy::per_hour(1).expect("valid");
    let fill = |i: u32| format!("a-slot-key-{i}").into_bytes();
    assert!(limiter.check_key(b"soon", &short, 1).allowed);
    for i in 0..15 {
        assert!(limiter.check_key(&fill(i), &long, 1).allowed);
    }
    assert_eq!(limiter.stats().keys, 16);
    clock.advance(Duration::from_secs(2));
    // "soon" (compact table) has expired; "newcomer-key" (slot table) is new.
    let result = limiter.check_sync(
        &[
            Check::new(b"soon", &short),
            Check::new(b"newcomer-key", &long),
        ],
        CheckOptions::default(),
    );
    assert!(
        matches!(result, Err(MemoryError::Full { .. })),
        "{result:?}"
    );
    assert!(limiter.state(b"soon", &short).is_none(), "counted half-way");
    assert!(limiter.state(b"newcomer-key", &long).is_none());
    // Alone, the expired key finds room again.
    assert!(limiter.check_key(b"soon", &short, 1).allowed);
}

/// A full shard whose sweep is deferred (refusing, a batch of keys has not expired yet): an
/// all-or-nothing check of keys it holds, one of them expired, needs no room and is counted in
/// place, as each of them alone would be.
#[test]
fn a_full_store_counts_an_all_or_nothing_check_of_held_keys_in_place() {
    let clock = clock();
    let limiter = refusing(&clock, 16, 1);
    let short = Policy::per(1, Duration::from_secs(10)).expect("valid");
    let long = Policy::per_hour(100).expect("valid");
    assert!(limiter.check_key(b"k", &short, 1).allowed);
    assert!(limiter.check_key(b"k", &long, 1).allowed);
    for i in 0..14 {
        assert!(
            limiter
                .check_key(format!("f{i}").as_bytes(), &long, 1)
                .allowed
        );
    }
    clock.advance(Duration::from_secs(1));
    // Full, nothing expired: refused, and the next sweep deferred until a batch has expired.
    let refused = limiter.check_sync(&[Check::new(b"new", &long)], CheckOptions::default());
    assert!(
        matches!(refused, Err(MemoryError::Full { .. })),
        "{refused:?}"
    );
    // "k" under `short` has expired (not yet swept); both of its states are held.
    clock.advance(Duration::from_secs(14));
    let verdict = limiter
        .check_sync(
            &[Check::new(b"k", &short), Check::new(b"k", &long)],
            CheckOptions::default(),
        )
        .expect("no new key: nothing to make room for");
    assert!(verdict.allowed());
    assert_eq!(limiter.stats().keys, 16);
    // Counted: the short policy is spent again.
    assert!(!limiter.check_key(b"k", &short, 1).allowed);
}

/// Evicting the soonest-expiring keys looks at both tables together.
#[test]
fn eviction_takes_the_soonest_keys_from_either_table() {
    for short_keys_expire_first in [true, false] {
        let limiter = MemoryLimiter::builder()
            .clock(clock())
            .max_keys(16)
            .shards(1)
            .build();
        let soon = Policy::per_second(1).expect("valid");
        let late = Policy::per_hour(1).expect("valid");
        let (compact_policy, slot_policy) = if short_keys_expire_first {
            (&soon, &late)
        } else {
            (&late, &soon)
        };
        let compact_key = |i: u32| format!("c{i}").into_bytes();
        let slot_key = |i: u32| format!("a-slot-key-{i}").into_bytes();
        for i in 0..8 {
            assert!(
                limiter
                    .check_key(&compact_key(i), compact_policy, 1)
                    .allowed
            );
            assert!(limiter.check_key(&slot_key(i), slot_policy, 1).allowed);
        }
        assert!(limiter.check_key(b"one-more-key", &late, 1).allowed);
        let stats = limiter.stats();
        assert_eq!((stats.keys, stats.evicted), (15, 2), "{stats:?}");
        let kept = |key: &dyn Fn(u32) -> Vec<u8>, p: &Policy| {
            (0..8)
                .filter(|i| limiter.state(&key(*i), p).is_some())
                .count()
        };
        let (compact_kept, slot_kept) = (
            kept(&compact_key, compact_policy),
            kept(&slot_key, slot_policy),
        );
        if short_keys_expire_first {
            assert_eq!((compact_kept, slot_kept), (6, 8));
        } else {
            assert_eq!((compact_kept, slot_kept), (8, 6));
        }
    }
}

#[test]
fn a_check_of_the_same_policy_twice_for_one_key_is_refused() {
    let limiter = MemoryLimiter::new();
    let p = Policy::per_second(1).expect("valid");
    let err = limiter
        .check_sync(
            &[Check::new(b"k", &p), Check::new(b"k", &p)],
            CheckOptions::default(),
        )
        .expect_err("duplicate");
    assert!(err.to_string().contains("twice"), "{err}");
}

#[test]
fn huge_and_binary_keys_are_fine() {
    let limiter = MemoryLimiter::new();
    let p = Policy::per_second(1).expect("valid");
    let huge = vec![0xffu8; 1 << 20];
    assert!(limiter.check_key(&huge, &p, 1).allowed);
    assert!(!limiter.check_key(&huge, &p, 1).allowed);
    assert!(limiter.check_key(b"\0\x01\xfe", &p, 1).allowed);
    assert!(limiter.check_key(b"", &p, 1).allowed);
}

#[tokio::test]
async fn concurrency_leases_are_released_through_the_trait() {
    let limiter = MemoryLimiter::builder().clock(clock()).build();
    let p = Policy::concurrency(2, Duration::from_secs(30)).expect("valid");
    let checks = [Check::new(b"job", &p)];
    let a = limiter.try_acquire(&checks).await.expect("check");
    let b = limiter.try_acquire(&checks).await.expect("check");
    assert!(a.allowed() && b.allowed());
    assert_ne!(a.lease, b.lease);
    assert!(!limiter.try_acquire(&checks).await.expect("check").allowed());
    limiter
        .release(&checks, a.lease.expect("lease"))
        .await
        .expect("release");
    assert!(limiter.try_acquire(&checks).await.expect("check").allowed());
}

#[tokio::test(start_paused = true)]
async fn acquire_waits_its_turn_and_reports_the_wait() {
    let limiter = MemoryLimiter::builder().clock(clock()).build();
    let p = Policy::shaper(10, Duration::from_secs(1)).expect("valid");
    let checks = [Check::new(b"sms-provider", &p)];
    let started = tokio::time::Instant::now();
    let mut waits = Vec::new();
    for _ in 0..4 {
        let v = limiter
            .acquire(&checks, Duration::from_millis(250))
            .await
            .expect("acquire");
        waits.push(v.allowed().then_some(v.wait.as_millis()));
    }
    // The manual clock does not move, so reservations queue up 100 ms apart.
    assert_eq!(waits, [Some(0), Some(100), Some(200), None]);
    assert!(started.elapsed() >= Duration::from_millis(300));
    // try_acquire decides now: no reservation.
    assert!(!limiter.try_acquire(&checks).await.expect("check").allowed());
}

#[tokio::test]
async fn reset_forgets_state() {
    let limiter = MemoryLimiter::new();
    let p = Policy::per_hour(1).expect("valid");
    assert!(limiter.check_one(b"k", &p, 1).await.expect("check").allowed);
    assert!(!limiter.check_one(b"k", &p, 1).await.expect("check").allowed);
    limiter.reset(b"k", &p).await.expect("reset");
    assert!(limiter.check_one(b"k", &p, 1).await.expect("check").allowed);
}

/// A renewed concurrency lease outlives its TTL; a lapsed or released one is not taken again.
#[test]
fn renewing_a_lease_extends_it_and_never_revives_it() {
    use floodgate_core::{Check, CheckOptions, MemoryLimiter, Policy, Timestamp};
    const T0: u64 = 1_709_214_330_000_000;
    let ms = |ms: u64| Timestamp::from_micros(T0 + ms * 1_000);
    let limiter = MemoryLimiter::new();
    let one = Policy::concurrency(1, std::time::Duration::from_secs(1)).expect("valid");
    let checks = [Check::new(b"worker", &one)];
    let first = limiter
        .check_sync(&checks, CheckOptions::at(ms(0)))
        .expect("checks");
    let lease = first.lease.expect("a lease");
    assert!(limiter.renew_at(&checks, lease, ms(800)));
    let during = limiter
        .check_sync(&checks, CheckOptions::at(ms(1_500)))
        .expect("checks");
    assert!(!during.allowed(), "the renewed lease still holds the slot");
    assert!(
        !limiter.renew_at(&checks, lease, ms(1_900)),
        "lapsed at 1.8 s"
    );
    let second = limiter
        .check_sync(&checks, CheckOptions::at(ms(1_900)))
        .expect("checks");
    let lease = second.lease.expect("a lease");
    assert!(limiter.release_at(&checks, lease, ms(1_950)));
    assert!(!limiter.renew_at(&checks, lease, ms(2_000)), "released");
}

/// A renewal past the year 2106 renews nothing (its expiry would wrap around to the past) and
/// leaves the lease as it was; a release then still gives the slot back.
#[test]
fn a_lease_renewed_beyond_the_year_2106_is_not_renewed_and_can_still_be_released() {
    use floodgate_core::{Check, CheckOptions, MemoryLimiter, Policy, Timestamp};
    let last = Timestamp::from_micros((u64::from(u32::MAX) - 60) * 1_000_000);
    let limiter = MemoryLimiter::new();
    let one = Policy::concurrency(1, std::time::Duration::from_secs(3_600)).expect("valid");
    let checks = [Check::new(b"worker", &one)];
    let lease = limiter
        .check_sync(&checks, CheckOptions::at(last))
        .expect("checks")
        .lease
        .expect("a lease");
    for far in [u64::from(u32::MAX) * 1_000_000, 1 << 56, u64::MAX] {
        assert!(
            !limiter.renew_at(&checks, lease, Timestamp::from_micros(far)),
            "renewed at {far}us"
        );
    }
    let held = limiter
        .check_sync(&checks, CheckOptions::at(last))
        .expect("checks");
    assert!(!held.allowed(), "the refused renewals lost the lease");
    assert!(limiter.release_at(&checks, lease, Timestamp::from_micros(u64::MAX)));
    let freed = limiter
        .check_sync(&checks, CheckOptions::at(last))
        .expect("checks");
    assert!(freed.allowed(), "the release did not give the slot back");
}

/// A GCRA state more than twice the tolerance ahead reads as no state: after the clock stepped
/// back, or under a policy whose period was cut (same name), a key is not locked out for more
/// than twice what its policy allows; a smaller step back grants no burst. Short keys (the
/// compact table) and long ones, checked alone or beside another policy, alike.
#[test]
fn a_gcra_state_ahead_of_what_its_policy_allows_reads_as_none() {
    let hourly = Policy::per_hour(2)
        .and_then(|p| p.named("per-user"))
        .expect("valid");
    let window = Policy::fixed_window(100, Duration::from_secs(60)).expect("valid");
    let long = [b'u'; 40];
    for key in [b"user-1".as_slice(), &long] {
        for beside in [false, true] {
            let clock = clock();
            let limiter = MemoryLimiter::builder().clock(clock.clone()).build();
            let check = |policy: &Policy| {
                let mut checks = vec![Check::new(key, policy)];
                if beside {
                    checks.push(Check::new(key, &window));
                }
                limiter
                    .check_sync(&checks, CheckOptions::default())
                    .expect("check")
            };
            let spend = || {
                assert!(check(&hourly).allowed());
                assert!(check(&hourly).allowed());
                let full = check(&hourly);
                assert!(!full.allowed(), "{full:?}");
            };
            let case = format!("a {}-byte key, beside a window: {beside}", key.len());

            // The clock steps back a second: the tat, a tolerance (an hour) and a second ahead,
            // counts as it stands, so the step grants no burst.
            spend();
            clock.set(Timestamp::from_millis(1_700_000_000_000 - 1_000));
            let v = check(&hourly);
            assert!(!v.allowed(), "{case}, stepped back a second: {v:?}");
            assert_eq!(
                v.decisions[0].retry_after,
                Some(Duration::from_millis(1_801_000)),
                "{case}"
            );

            // Two hours back: the tat, three hours ahead, is more than twice the tolerance.
            clock.set(Timestamp::from_millis(1_700_000_000_000 - 7_200_000));
            let v = check(&hourly);
            assert!(v.allowed(), "{case}, stepped back: {v:?}");
            assert_eq!(v.decisions[0].remaining, 1, "read as fresh");

            // The same name, a period cut to a minute: an hour of tat is 59 minutes too many.
            clock.set(Timestamp::from_millis(1_700_000_000_000 + 7_200_000));
            spend();
            let minutely = Policy::per_minute(2)
                .and_then(|p| p.named("per-user"))
                .expect("valid");
            let v = check(&minutely);
            assert!(v.allowed(), "{case}, cut period: {v:?}");
            assert_eq!(v.decisions[0].remaining, 1, "read as fresh");
        }
    }
}

/// A refund that brings a key's expiry sooner than every other key's is noted: once it
/// expires, a full refusing store makes room from it.
#[test]
fn a_refunded_key_makes_room_in_a_full_store_once_it_expires() {
    // Slot keys and compact keys.
    for key in [
        |i: u32| format!("a-slot-key-{i}").into_bytes(),
        |i: u32| format!("k{i}").into_bytes(),
    ] {
        let clock = clock();
        let limiter = refusing(&clock, 16, 1);
        // 20 an hour: three minutes a unit.
        let p = Policy::per_hour(20).expect("valid");
        let check = |k: &[u8], cost: u64| {
            let verdict = limiter
                .check_sync(&[Check::new(k, &p).cost(cost)], CheckOptions::default())
                .expect("room");
            assert!(verdict.allowed());
            verdict
        };
        check(b"soon", 1);
        for i in 0..14 {
            check(&key(i), 10);
        }
        // Key 99 goes last, after a second check that is given back.
        check(&key(99), 5);
        let second = check(&key(99), 6);
        // Three minutes on, `soon` expired: a sweep drops it and learns the next expiry.
        clock.advance(Duration::from_secs(181));
        check(b"new-1", 10);
        limiter
            .refund_sync(&[Check::new(&key(99), &p).cost(6)], &second)
            .expect("refund");
        // Key 99 now expires at 15 minutes, before every other key (30 minutes).
        clock.advance(Duration::from_secs(720));
        check(b"new-2", 1);
        assert!(limiter.state(&key(99), &p).is_none(), "key 99 made room");
        assert_eq!(limiter.stats().refused, 0);
    }
}
