//! The deny cache: hammered denied keys cost the store (almost) nothing, and the cache never
//! admits what the store would deny.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::Store;
use floodgate_core::{Check, CheckOptions, DenyCache, Limiter, ManualClock, Policy, Timestamp};

/// Whether `limiter` allows `checks` now.
async fn allowed<L: Limiter>(limiter: &L, checks: &[Check<'_>]) -> bool
where
    L::Error: std::fmt::Debug,
{
    limiter
        .check(checks, CheckOptions::default())
        .await
        .expect("ok")
        .allowed()
}

/// A store round trip: concurrent callers pile up as they would.
const ROUND_TRIP: Duration = Duration::from_micros(300);

/// A store counting its calls, and the counter.
fn counting() -> (Store, Arc<AtomicU64>) {
    let store = Store::with_delay(ROUND_TRIP);
    let calls = Arc::clone(&store.calls);
    (store, calls)
}

/// 64 tasks hammer one key for `run`; returns (store calls, admitted).
async fn hammer(limiter: DenyCache<Store>, policy: Policy, run: Duration) -> (u64, u64) {
    let policy = Arc::new(policy);
    let admitted = Arc::new(AtomicU64::new(0));
    let stop = Instant::now() + run;
    let tasks: Vec<_> = (0..64)
        .map(|_| {
            let (limiter, policy, admitted) =
                (limiter.clone(), Arc::clone(&policy), Arc::clone(&admitted));
            tokio::spawn(async move {
                while Instant::now() < stop {
                    let v = limiter
                        .check(&[Check::new(b"attacker", &policy)], CheckOptions::default())
                        .await
                        .expect("check");
                    if v.allowed() {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    } else {
                        assert!(v.decisions[0].retry_after.is_some(), "{v:?}");
                        tokio::task::yield_now().await;
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("task");
    }
    (
        limiter.inner().calls.load(Ordering::Relaxed),
        admitted.load(Ordering::Relaxed),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hammered_key_costs_one_store_call_per_admitted_request() {
    for policy in [
        Policy::per(1, Duration::from_millis(200)).expect("valid"),
        Policy::funnel(2, Duration::from_millis(400)).expect("valid"),
        Policy::fixed_window(3, Duration::from_millis(300)).expect("valid"),
    ] {
        let (store, _) = counting();
        let cache = DenyCache::new(store);
        let run = Duration::from_millis(1_500);
        let (calls, admitted) = hammer(cache.clone(), policy.clone(), run).await;
        let stats = cache.stats();
        // The first burst of 64 reaches the store before any denial is known; after that,
        // about one call per admitted request.
        assert!(
            calls <= 64 + 2 * admitted + 4,
            "{}: {calls} store calls for {admitted} admitted; {stats:?}",
            policy.name()
        );
        assert!(stats.hits > 10_000, "{}: {stats:?}", policy.name());
        // And never more admitted than the policy allows: the cache only denies.
        let bound = match policy.name() {
            n if n.starts_with("gcra") => 1 + 1_500 / 200,
            n if n.starts_with("funnel") => 2 + 1_500 / 200,
            _ => 3 * (1 + 1_500 / 300),
        };
        assert!(admitted <= bound, "{}: {admitted} > {bound}", policy.name());
        assert!(
            admitted >= bound / 2,
            "{}: only {admitted} admitted",
            policy.name()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn algorithms_without_a_known_next_unit_still_cost_little() {
    let policy = Policy::sliding_log(2, Duration::from_millis(300)).expect("valid");
    let (store, _) = counting();
    let cache = DenyCache::new(store);
    let (calls, admitted) = hammer(cache.clone(), policy, Duration::from_millis(1_500)).await;
    // Probes are one at a time: a couple of calls per admitted request at most.
    assert!(
        calls <= 64 + 3 * admitted + 8,
        "{calls} calls, {admitted} admitted"
    );
}

#[tokio::test]
async fn cached_denials_report_shrinking_retry_times() {
    let (store, calls) = counting();
    let cache = DenyCache::new(store);
    let p = Policy::per(1, Duration::from_secs(10)).expect("valid");
    let checks = [Check::new(b"k", &p)];
    assert!(
        cache
            .check(&checks, CheckOptions::default())
            .await
            .expect("ok")
            .allowed()
    );
    let first = cache
        .check(&checks, CheckOptions::default())
        .await
        .expect("ok");
    assert!(!first.allowed());
    let before = calls.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let cached = cache
        .check(&checks, CheckOptions::default())
        .await
        .expect("ok");
    assert_eq!(calls.load(Ordering::Relaxed), before, "answered locally");
    let (r0, r1) = (
        first.decisions[0].retry_after.expect("retry"),
        cached.decisions[0].retry_after.expect("retry"),
    );
    assert!(
        r1 < r0 && r1 > r0 - Duration::from_millis(200),
        "{r0:?} then {r1:?}"
    );
    // A different cost or key is not the same check.
    assert!(
        cache
            .check(&[Check::new(b"other", &p)], CheckOptions::default())
            .await
            .expect("ok")
            .allowed()
    );
    assert!(calls.load(Ordering::Relaxed) > before);
}

#[tokio::test]
async fn concurrency_and_injected_time_bypass_the_cache() {
    let (store, calls) = counting();
    let cache = DenyCache::new(store);
    let p = Policy::concurrency(1, Duration::from_secs(10)).expect("valid");
    let checks = [Check::new(b"k", &p)];
    let held = cache
        .check(&checks, CheckOptions::default())
        .await
        .expect("ok");
    assert!(held.allowed());
    assert!(
        !cache
            .check(&checks, CheckOptions::default())
            .await
            .expect("ok")
            .allowed()
    );
    cache
        .release(&checks, held.lease.expect("lease"))
        .await
        .expect("release");
    // Released early: the next check must see it, so concurrency is never cached.
    assert!(
        cache
            .check(&checks, CheckOptions::default())
            .await
            .expect("ok")
            .allowed()
    );
    assert_eq!(calls.load(Ordering::Relaxed), 3);
}

/// One check of key `k` against `p`.
async fn check(cache: DenyCache<Store>, p: Arc<Policy>) -> floodgate_core::Verdict {
    cache
        .check(&[Check::new(b"k", &p)], CheckOptions::default())
        .await
        .expect("ok")
}

/// A cache whose denial of key `k` (one per 200 ms) has just run out: the next check probes.
async fn a_denial_that_ran_out() -> (Store, DenyCache<Store>, Arc<Policy>) {
    let store = Store::new();
    let cache = DenyCache::new(store.clone());
    let p = Arc::new(Policy::per(1, Duration::from_millis(200)).expect("valid"));
    assert!(check(cache.clone(), Arc::clone(&p)).await.allowed());
    assert!(!check(cache.clone(), Arc::clone(&p)).await.allowed());
    tokio::time::sleep(Duration::from_millis(250)).await;
    (store, cache, p)
}

/// When a denial runs out, one caller probes the store and the others wait for it. If that
/// caller is cancelled (a dropped request, a timeout), the next caller must not wait for an
/// answer that will never come.
#[tokio::test]
async fn a_cancelled_probe_does_not_hold_up_the_next_caller() {
    let (store, cache, p) = a_denial_that_ran_out().await;
    // The next caller probes, and the store hangs.
    store.set_delay(Duration::from_secs(5));
    let probe = tokio::spawn(check(cache.clone(), Arc::clone(&p)));
    tokio::time::sleep(Duration::from_millis(50)).await;
    probe.abort();
    assert!(probe.await.is_err_and(|e| e.is_cancelled()));
    // The store answers again; the next caller asks it at once.
    store.set_delay(Duration::ZERO);
    let started = Instant::now();
    let next = check(cache.clone(), Arc::clone(&p)).await;
    assert!(next.allowed());
    assert!(
        started.elapsed() < Duration::from_millis(300),
        "waited {:?} for a cancelled probe",
        started.elapsed()
    );
}

/// A probe that stalls (its store call hangs, its caller still waiting) holds the others up
/// for one second of patience, once: then they ask the store themselves.
#[tokio::test]
async fn a_stalled_probe_holds_the_others_up_once() {
    let (store, cache, p) = a_denial_that_ran_out().await;
    // The next caller probes, and its call hangs for 5 s; calls after it answer at once.
    store.set_delay(Duration::from_secs(5));
    let probe = tokio::spawn(check(cache.clone(), Arc::clone(&p)));
    tokio::time::sleep(Duration::from_millis(50)).await;
    store.set_delay(Duration::ZERO);
    let started = Instant::now();
    let next = check(cache.clone(), Arc::clone(&p)).await;
    let waited = started.elapsed();
    assert!(next.allowed());
    assert!(
        // Twice the patience (2 s and more) before.
        waited >= Duration::from_millis(900) && waited < Duration::from_millis(1_900),
        "waited {waited:?} for a stalled probe"
    );
    probe.abort();
}

/// A denial the store answered before a refund, and reaching the cache after it, is not
/// cached: the refund gave the unit back, and the next check must reach the store.
#[tokio::test]
async fn a_denial_answered_before_a_refund_is_not_cached_after_it() {
    let store = Store::new();
    let cache = DenyCache::new(store.clone());
    // A sliding log caches nothing on an allowed check: only the denial below could.
    let p = Arc::new(Policy::sliding_log(1, Duration::from_secs(1_800)).expect("valid"));
    let first = check(cache.clone(), Arc::clone(&p)).await;
    assert!(first.allowed());
    // A second check is denied by the store, and its answer is slow to come back.
    store.set_reply_delay(Duration::from_millis(200));
    let second = tokio::spawn(check(cache.clone(), Arc::clone(&p)));
    tokio::time::sleep(Duration::from_millis(50)).await;
    store.set_reply_delay(Duration::ZERO);
    // Meanwhile the first message failed: its unit is given back.
    cache
        .refund(&[Check::new(b"k", &p)], &first)
        .await
        .expect("refund");
    assert!(!second.await.expect("task").allowed());
    // The store has the unit back: the next check is allowed, not denied from the cache.
    assert!(check(cache.clone(), Arc::clone(&p)).await.allowed());
    assert_eq!(cache.stats().hits, 0, "{:?}", cache.stats());
}

/// A refund stops storing only the denials in flight that its keys made: a denial of another
/// client's key answered meanwhile is still cached, also when both checks share a global
/// policy (whose key the refund gave a unit back) that did not deny. (Refunds are counted in
/// 256 stripes, placed by a hash seeded at random: a client whose key shares a stripe with a
/// refunded one is not cached, so of eight clients, most, not all, must be.)
#[tokio::test]
async fn a_refund_leaves_the_denials_of_other_keys_cached() {
    let store = Store::new();
    let cache = DenyCache::new(store.clone());
    // Sliding logs cache nothing on an allowed check: only the denial below could be cached.
    let ip = Arc::new(Policy::sliding_log(1, Duration::from_secs(1_800)).expect("valid"));
    let global = Arc::new(Policy::sliding_log(1_000, Duration::from_secs(1)).expect("valid"));
    let on = |client: String| {
        let (cache, ip, global) = (cache.clone(), Arc::clone(&ip), Arc::clone(&global));
        async move {
            let checks = [
                Check::new(client.as_bytes(), &ip),
                Check::new(b"all", &global),
            ];
            cache
                .check(&checks, CheckOptions::default())
                .await
                .expect("ok")
        }
    };
    let clients: Vec<String> = (0..8).map(|i| format!("b{i}")).collect();
    let a = on("a".to_owned()).await;
    assert!(a.allowed());
    for b in &clients {
        assert!(on(b.clone()).await.allowed());
    }
    // Each b's second check is denied by the store (its own limit), and slow to come back.
    store.set_reply_delay(Duration::from_millis(200));
    let denied: Vec<_> = clients
        .iter()
        .map(|b| tokio::spawn(on(b.clone())))
        .collect();
    tokio::time::sleep(Duration::from_millis(50)).await;
    store.set_reply_delay(Duration::ZERO);
    // Meanwhile a's request failed: its units (its own and the global one) are given back.
    cache
        .refund(&[Check::new(b"a", &ip), Check::new(b"all", &global)], &a)
        .await
        .expect("refund");
    for d in denied {
        assert!(!d.await.expect("task").allowed());
    }
    // The b's are still denied, most of them now from the cache.
    for b in &clients {
        assert!(!on(b.clone()).await.allowed());
    }
    let hits = cache.stats().hits;
    assert!(hits >= 6, "{hits} of 8 denials cached: {:?}", cache.stats());
    // And a has its unit back.
    assert!(on("a".to_owned()).await.allowed());
}

/// `max_hold` bounds how long a denial is answered locally: a refund made through another
/// replica (another cache over the same store) is seen within it, and the verdicts answered
/// locally meanwhile still report the whole retry time. Without it, the denial is held for
/// its whole retry time.
#[tokio::test]
async fn max_hold_sees_another_replicas_refund() {
    let store = Store::new();
    let p = Policy::funnel(1, Duration::from_secs(30 * 60)).expect("valid");
    let checks = [Check::new(b"+15551234", &p)];
    // The caches' own clock: the store's (real) one does not matter over 30 minutes.
    let clock = ManualClock::new(Timestamp::from_micros(1_000_000));
    let cache = || DenyCache::with_clock(store.clone(), clock.clone(), 1_000);
    let x = cache();
    let held = cache();
    let bounded = cache().max_hold(Duration::from_millis(100));
    let allowed = x.check(&checks, CheckOptions::default()).await.expect("ok");
    assert!(allowed.allowed());
    for cache in [&held, &bounded] {
        let denied = cache
            .check(&checks, CheckOptions::default())
            .await
            .expect("ok");
        assert!(!denied.allowed());
    }
    x.refund(&checks, &allowed).await.expect("refund");

    // Within max_hold, both answer from their cache, with the whole retry time.
    for cache in [&held, &bounded] {
        let before = cache.stats().hits;
        let v = cache
            .check(&checks, CheckOptions::default())
            .await
            .expect("ok");
        assert!(!v.allowed());
        assert_eq!(cache.stats().hits, before + 1, "answered locally");
        let retry = v.decisions[0].retry_after.expect("retry");
        assert!(retry > Duration::from_secs(29 * 60), "{retry:?}");
    }
    clock.advance(Duration::from_millis(150));
    assert!(
        !held
            .check(&checks, CheckOptions::default())
            .await
            .expect("ok")
            .allowed(),
        "held for the whole retry time"
    );
    assert!(
        bounded
            .check(&checks, CheckOptions::default())
            .await
            .expect("ok")
            .allowed(),
        "the refund is seen after max_hold"
    );
    // Zero holds nothing: every check asks the store.
    let none = cache().max_hold(Duration::ZERO);
    let before = store.calls.load(Ordering::Relaxed);
    for _ in 0..3 {
        let v = none
            .check(&checks, CheckOptions::default())
            .await
            .expect("ok");
        assert!(!v.allowed());
    }
    assert_eq!(store.calls.load(Ordering::Relaxed) - before, 3);
}

/// A reset made through the cache forgets the denials it held: the next check of the reset
/// key asks the store, which admits it.
#[tokio::test]
async fn a_reset_through_the_cache_forgets_its_denials() {
    let store = Store::new();
    let p = Policy::funnel(1, Duration::from_secs(30 * 60)).expect("valid");
    let other = Policy::per_minute(1).expect("valid");
    let clock = ManualClock::new(Timestamp::from_micros(1_000_000));
    let cache = DenyCache::with_clock(store.clone(), clock.clone(), 1_000);
    let checks = [Check::new(b"+15551234", &p)];
    let elsewhere = [Check::new(b"203.0.113.9", &other)];
    for c in [&checks[..], &elsewhere[..]] {
        assert!(allowed(&cache, c).await);
        assert!(!allowed(&cache, c).await);
    }
    let hits = cache.stats().hits;
    assert!(!allowed(&cache, &checks).await);
    assert_eq!(cache.stats().hits, hits + 1, "held locally");

    cache.reset(b"+15551234", &p).await.expect("reset");
    let calls = store.calls.load(Ordering::Relaxed);
    assert!(
        allowed(&cache, &checks).await,
        "the reset key is admitted at once"
    );
    // Another key's denial is asked again too (still denied by the store).
    assert!(!allowed(&cache, &elsewhere).await);
    assert_eq!(store.calls.load(Ordering::Relaxed) - calls, 2);
}

/// `check_store` asks the store past a cached denial, and leaves the cache as it is.
#[tokio::test]
async fn check_store_asks_the_store_past_a_cached_denial() {
    let store = Store::new();
    let p = Policy::funnel(1, Duration::from_secs(30 * 60)).expect("valid");
    let clock = ManualClock::new(Timestamp::from_micros(1_000_000));
    let cache = DenyCache::with_clock(store.clone(), clock, 1_000);
    let checks = [Check::new(b"+15551234", &p)];
    assert!(allowed(&cache, &checks).await);
    assert!(!allowed(&cache, &checks).await);
    let calls = store.calls.load(Ordering::Relaxed);
    let fresh = cache
        .check_store(&checks, CheckOptions::default())
        .await
        .expect("ok");
    assert!(!fresh.allowed());
    assert_eq!(
        store.calls.load(Ordering::Relaxed),
        calls + 1,
        "asked the store"
    );
    let hits = cache.stats().hits;
    assert!(!allowed(&cache, &checks).await);
    assert_eq!(
        cache.stats().hits,
        hits + 1,
        "the cached denial is still there"
    );
}

/// When a fixed window rolls over, the callers that queued behind the probe go to the store
/// together: the probe found room for them all. One at a time, a hot key would be served one
/// store round trip per request for a second after each window's denial.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_that_finds_room_for_the_crowd_lets_it_through_at_once() {
    // 100 per 300 ms window; store calls take 20 ms.
    let store = Store::new();
    let cache = DenyCache::new(store.clone());
    let p = Arc::new(Policy::fixed_window(100, Duration::from_millis(300)).expect("valid"));
    let spend = [Check::new(b"k", &p).cost(100)];
    assert!(allowed(&cache, &spend).await);
    assert!(!check(cache.clone(), Arc::clone(&p)).await.allowed());
    // The window rolls over; 40 callers at once.
    tokio::time::sleep(Duration::from_millis(350)).await;
    store.set_delay(Duration::from_millis(20));
    let before = store.most_at_once.load(Ordering::Relaxed);
    assert_eq!(before, 1, "calls so far went one at a time");
    let started = Instant::now();
    let tasks: Vec<_> = (0..40)
        .map(|_| tokio::spawn(check(cache.clone(), Arc::clone(&p))))
        .collect();
    for t in tasks {
        assert!(t.await.expect("task").allowed());
    }
    let took = started.elapsed();
    let at_once = store.most_at_once.load(Ordering::Relaxed);
    assert!(at_once >= 2, "the crowd went one at a time ({took:?})");
    // One probe, then the rest together: far less than 40 round trips of 20 ms.
    assert!(took < Duration::from_millis(400), "{took:?}");
    assert_eq!(cache.stats().hits, 0, "{:?}", cache.stats());
}

/// A probe that finds a unit or two free keeps the others coming one at a time: they are not
/// all sent to the store for units that are not there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_that_finds_little_room_keeps_the_crowd_in_line() {
    // Two per 300 ms, a sliding log (no known next unit, so no denial is made up).
    let store = Store::new();
    let cache = DenyCache::new(store.clone());
    let p = Arc::new(Policy::sliding_log(2, Duration::from_millis(300)).expect("valid"));
    for _ in 0..2 {
        assert!(check(cache.clone(), Arc::clone(&p)).await.allowed());
    }
    assert!(!check(cache.clone(), Arc::clone(&p)).await.allowed());
    tokio::time::sleep(Duration::from_millis(350)).await;
    store.set_delay(Duration::from_millis(20));
    let tasks: Vec<_> = (0..40)
        .map(|_| tokio::spawn(check(cache.clone(), Arc::clone(&p))))
        .collect();
    let mut admitted = 0;
    for t in tasks {
        if t.await.expect("task").allowed() {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 2);
    assert_eq!(store.most_at_once.load(Ordering::Relaxed), 1);
}
