//! Leasing: a hot key costs the store one call per lease, and no more is admitted than the
//! store granted.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::Store;
use floodgate_core::{Check, CheckOptions, Leasing, LeasingConfig, Limiter, Policy, SystemClock};

fn store() -> Store {
    Store::new()
}

/// A store, a manual clock, and leasing with the default settings over both.
fn on_manual_clock() -> (
    Store,
    floodgate_core::ManualClock,
    Leasing<Store, floodgate_core::ManualClock>,
) {
    let clock = floodgate_core::ManualClock::new(floodgate_core::Timestamp::from_micros(
        1_700_000_000_000_000,
    ));
    let store = store();
    let leasing = Leasing::with_config(store.clone(), LeasingConfig::default(), clock.clone());
    (store, clock, leasing)
}

/// `replicas` leasing limiters over one store, 16 tasks each hammering one key for `run`.
async fn hammer(store: &Store, replicas: usize, policy: &Policy, run: Duration) -> u64 {
    let admitted = Arc::new(AtomicU64::new(0));
    let stop = Instant::now() + run;
    let mut tasks = Vec::new();
    let mut leasings = Vec::new();
    for _ in 0..replicas {
        let leasing =
            Leasing::with_config(store.clone(), LeasingConfig::default(), SystemClock::new());
        leasings.push(leasing.clone());
        for _ in 0..16 {
            let (leasing, policy, admitted) =
                (leasing.clone(), policy.clone(), Arc::clone(&admitted));
            tasks.push(tokio::spawn(async move {
                while Instant::now() < stop {
                    let v = leasing
                        .check(&[Check::new(b"hot", &policy)], CheckOptions::default())
                        .await
                        .expect("check");
                    if v.allowed() {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                    tokio::task::yield_now().await;
                }
            }));
        }
    }
    for t in tasks {
        t.await.expect("task");
    }
    for l in &leasings {
        let stats = l.stats();
        assert!(stats.local > 0, "{stats:?}");
    }
    admitted.load(Ordering::Relaxed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_key_costs_one_store_call_per_lease_and_never_more_than_granted() {
    // A million per second (bursts of ten million), far above the load: leases of 10,000.
    let policy = Policy::per(10_000_000, Duration::from_secs(10)).expect("valid");
    let store = store();
    let run = Duration::from_millis(800);
    let admitted = hammer(&store, 2, &policy, run).await;
    let calls = store.calls.load(Ordering::Relaxed);
    let granted = store.granted.load(Ordering::Relaxed);
    assert!(
        admitted <= granted,
        "admitted {admitted} > granted {granted}"
    );
    assert!(admitted > 10_000, "only {admitted} admitted");
    // Before the key is hot, and around lease changes, a few calls go to the store itself;
    // otherwise one call per lease of 10,000.
    assert!(
        calls < admitted / 500,
        "{calls} store calls for {admitted} admitted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_a_window_leasing_admits_at_most_replicas_times_a_lease_extra() {
    // 2,000 per fixed second; leases of 20 units.
    let policy = Policy::fixed_window(2_000, Duration::from_secs(1)).expect("valid");
    let store = store();
    let admitted = hammer(&store, 3, &policy, Duration::from_millis(1_500)).await;
    let granted = store.granted.load(Ordering::Relaxed);
    assert!(admitted <= granted);
    // The rolling window opened at the first check: 1.5 s holds at most two windows.
    let bound = 2 * 2_000;
    assert!(admitted <= bound, "{admitted} > {bound}");
}

#[tokio::test]
async fn small_limits_concurrency_and_injected_time_are_never_leased() {
    let store = store();
    let leasing = Leasing::new(store.clone());
    let small = Policy::per_minute(20).expect("valid");
    let conc = Policy::concurrency(10_000, Duration::from_secs(5)).expect("valid");
    for p in [&small, &conc] {
        for _ in 0..40 {
            let _ = leasing
                .check(&[Check::new(b"k", p)], CheckOptions::default())
                .await
                .expect("check");
        }
    }
    assert_eq!(store.calls.load(Ordering::Relaxed), 80);
    assert_eq!(leasing.stats().local, 0);
    // And a small limit is exact: 20 admitted, no more.
    let admitted = {
        let mut n = 0;
        for _ in 0..40 {
            if leasing
                .check(&[Check::new(b"other", &small)], CheckOptions::default())
                .await
                .expect("check")
                .allowed()
            {
                n += 1;
            }
        }
        n
    };
    assert_eq!(admitted, 20);
}

#[tokio::test]
async fn checks_that_cost_more_than_a_lease_go_to_the_store_and_waste_nothing() {
    // 10,000 per second: leases of 100 units; each check costs 200.
    let policy = Policy::per_second(10_000).expect("valid");
    let store = store();
    let leasing = Leasing::new(store.clone());
    let mut admitted = 0;
    for _ in 0..100 {
        let v = leasing
            .check(
                &[Check::new(b"hot", &policy).cost(200)],
                CheckOptions::default(),
            )
            .await
            .expect("check");
        if v.allowed() {
            admitted += 200;
        }
    }
    let stats = leasing.stats();
    assert_eq!(stats.leases, 0, "{stats:?}");
    assert_eq!(stats.wasted, 0, "{stats:?}");
    assert_eq!(store.calls.load(Ordering::Relaxed), 100);
    // The store charged only what was admitted.
    assert_eq!(store.granted.load(Ordering::Relaxed), admitted);
}

/// A key that stays hot under a long window: what each lease leaves unspent goes back to the
/// store when the next lease replaces it, so the store is charged what was admitted (and the
/// lease held now), not a lease per lease period. Before, 100,000 a day at 120 requests a
/// second lost about 1,000 units every 300 ms, and the day's quota was gone in minutes.
#[tokio::test]
async fn a_hot_key_under_a_long_window_is_charged_what_it_spent() {
    // 100,000 a day: leases of 1,000 units.
    let policy = Policy::fixed_window(100_000, Duration::from_secs(86_400)).expect("valid");
    let (store, clock, leasing) = on_manual_clock();
    let check = [Check::new(b"hot", &policy)];
    let mut admitted = 0;
    // 40 lease periods of 36 checks, 300 ms apart: each lease ends with most of it unspent.
    for _ in 0..40 {
        for _ in 0..36 {
            let v = leasing
                .check(&check, CheckOptions::default())
                .await
                .expect("check");
            assert!(v.allowed(), "{v:?}");
            admitted += 1;
        }
        clock.advance(Duration::from_millis(300));
    }
    let stats = leasing.stats();
    assert!(stats.leases >= 39 && stats.local > 0, "{stats:?}");
    let peek = store
        .inner
        .check(
            &[Check::new(b"hot", &policy).cost(0)],
            CheckOptions::default(),
        )
        .await
        .expect("peek");
    let charged = 100_000 - peek.decisions[0].remaining;
    assert!(
        charged >= admitted && charged <= admitted + 1_000,
        "charged {charged} for {admitted} admitted: {stats:?}"
    );
    assert_eq!(stats.wasted, 0, "{stats:?}");
    assert!(stats.returned >= 38 * 900, "{stats:?}");
}

/// A check answered from a local lease reports the lease's decision aged by the time since it
/// was granted: its reset time is when the store's state is full again, not a lease later.
#[tokio::test]
async fn local_answers_age_the_lease_s_reset_time() {
    let policy = Policy::per_second(10_000).expect("valid");
    let (_, clock, leasing) = on_manual_clock();
    let check = [Check::new(b"hot", &policy)];
    // Hot after a few checks: the next one takes a lease and is answered from it.
    let mut first_local = None;
    for _ in 0..64 {
        let v = leasing
            .check(&check, CheckOptions::default())
            .await
            .expect("check");
        if leasing.stats().local > 0 {
            first_local = Some(v);
            break;
        }
    }
    let granted = first_local.expect("a lease was taken");
    clock.advance(Duration::from_millis(3));
    let later = leasing
        .check(&check, CheckOptions::default())
        .await
        .expect("check");
    assert_eq!(leasing.stats().leases, 1, "{:?}", leasing.stats());
    let (g, l) = (
        granted.decisions[0].reset_after,
        later.decisions[0].reset_after,
    );
    assert!(
        l + Duration::from_millis(3) <= g + Duration::from_millis(1),
        "not aged: {g:?} then {l:?} 3 ms later"
    );
}

/// A flood of unique keys does not push a leased hot key out of the tracked keys: its units
/// stay spendable (answered locally, nothing wasted) while the flood's keys go to the store.
#[tokio::test]
async fn a_flood_of_unique_keys_does_not_evict_a_leased_key() {
    use floodgate_core::{ManualClock, Timestamp};
    let policy = Policy::per_second(10_000).expect("valid");
    let clock = ManualClock::new(Timestamp::from_micros(1_700_000_000_000_000));
    let cfg = LeasingConfig {
        max_keys: 640,
        ..LeasingConfig::default()
    };
    let leasing = Leasing::with_config(store(), cfg, clock.clone());
    let hot = [Check::new(b"hot", &policy)];
    for _ in 0..64 {
        leasing
            .check(&hot, CheckOptions::default())
            .await
            .expect("check");
        if leasing.stats().local > 0 {
            break;
        }
    }
    assert_eq!(leasing.stats().leases, 1, "{:?}", leasing.stats());
    for i in 0..5_000u32 {
        let key = format!("flood-{i}");
        let v = leasing
            .check(
                &[Check::new(key.as_bytes(), &policy)],
                CheckOptions::default(),
            )
            .await
            .expect("check");
        assert!(v.allowed());
    }
    let before = leasing.stats();
    let v = leasing
        .check(&hot, CheckOptions::default())
        .await
        .expect("check");
    assert!(v.allowed());
    let after = leasing.stats();
    assert_eq!(
        (after.local, after.store),
        (before.local + 1, before.store),
        "the hot key went to the store after the flood: {before:?} then {after:?}"
    );
    assert_eq!(after.wasted, 0, "{after:?}");
}

/// A check answered from a lease is refunded as of the time the store counted the lease: a
/// lease taken in one window and spent after the next began gives nothing back to the next
/// window, which never counted it; a sliding log gives back from the lease's entry.
#[tokio::test]
async fn a_local_answer_is_refunded_as_of_its_lease() {
    use floodgate_core::algorithm::fixed_window;
    use floodgate_core::{ManualClock, MemoryLimiter, State, Timestamp};
    let t0 = 1_700_000_000_000_000;
    let ms = 1_000;
    // Hot after a few checks, `step` apart: returns the first answer from a lease.
    async fn leased(
        leasing: &Leasing<MemoryLimiter<ManualClock>, ManualClock>,
        clock: &ManualClock,
        check: &[Check<'_>],
    ) -> floodgate_core::Verdict {
        for _ in 0..64 {
            clock.advance(Duration::from_micros(10));
            let v = leasing
                .check(check, CheckOptions::default())
                .await
                .expect("check");
            if leasing.stats().local > 0 {
                return v;
            }
        }
        panic!("no lease: {:?}", leasing.stats());
    }
    // A check that must be answered from the lease.
    async fn local(
        leasing: &Leasing<MemoryLimiter<ManualClock>, ManualClock>,
        check: &[Check<'_>],
    ) -> floodgate_core::Verdict {
        let answered = leasing.stats().local;
        let v = leasing
            .check(check, CheckOptions::default())
            .await
            .expect("check");
        assert_eq!(
            leasing.stats().local,
            answered + 1,
            "not answered from the lease"
        );
        v
    }

    // A fixed window of a second from the first check at t0; the lease comes at 0.9 s and
    // lasts 250 ms, past the window's end.
    let clock = ManualClock::new(Timestamp::from_micros(t0));
    let memory = MemoryLimiter::builder().clock(clock.clone()).build();
    let leasing = Leasing::with_config(memory.clone(), LeasingConfig::default(), clock.clone());
    let window = Policy::fixed_window(2_000, Duration::from_secs(1)).expect("valid");
    let check = [Check::new(b"hot", &window)];
    memory
        .check(&check, CheckOptions::default())
        .await
        .expect("check");
    clock.set(Timestamp::from_micros(t0 + 900 * ms));
    leased(&leasing, &clock, &check).await;
    // The next window opens in the store (another replica's check), then this replica spends
    // from its lease and refunds the check.
    clock.set(Timestamp::from_micros(t0 + 1_000 * ms + 50));
    memory
        .check(&check, CheckOptions::default())
        .await
        .expect("check");
    let opened = memory.state(b"hot", &window);
    clock.advance(Duration::from_micros(50));
    let spent = local(&leasing, &check).await;
    assert!(spent.allowed());
    leasing.refund(&check, &spent).await.expect("refund");
    assert_eq!(
        memory.state(b"hot", &window),
        opened,
        "the next window got units it never counted"
    );
    assert!(matches!(
        opened,
        Some(State::FixedWindow(fixed_window::State { count: 1, .. }))
    ));

    // A sliding log: the lease is one entry of its units; a local answer's refund takes its
    // cost off that entry.
    let clock = ManualClock::new(Timestamp::from_micros(t0));
    let memory = MemoryLimiter::builder().clock(clock.clone()).build();
    let leasing = Leasing::with_config(memory.clone(), LeasingConfig::default(), clock.clone());
    let log = Policy::sliding_log(2_000, Duration::from_secs(1)).expect("valid");
    let check = [Check::new(b"hot", &log)];
    leased(&leasing, &clock, &check).await;
    let units = |memory: &MemoryLimiter<ManualClock>| match memory.state(b"hot", &log) {
        Some(State::SlidingLog(st)) => st.entries.iter().map(|e| e.cost).sum::<u64>(),
        other => panic!("{other:?}"),
    };
    clock.advance(Duration::from_millis(10));
    let spent = local(&leasing, &check).await;
    assert_eq!(leasing.stats().leases, 1, "{:?}", leasing.stats());
    let before = units(&memory);
    leasing.refund(&check, &spent).await.expect("refund");
    assert_eq!(units(&memory), before - 1, "the refund gave nothing back");
}

/// A hot global limit checked with a per-client one for clients that are each new (cold): a
/// lease of the global limit would not let such a call be answered locally, so none is taken
/// (before, one was taken every lease period and ran out unspent, a thousand units each).
#[tokio::test]
async fn a_hot_limit_beside_cold_ones_takes_no_lease_it_cannot_spend() {
    let store = store();
    let clock = floodgate_core::ManualClock::new(floodgate_core::Timestamp::from_micros(1_000_000));
    let leasing = Leasing::with_config(store.clone(), LeasingConfig::default(), clock.clone());
    let global = Policy::per(100_000, Duration::from_secs(3_600))
        .and_then(|p| p.named("global"))
        .expect("valid");
    let per_ip = Policy::per_minute(1_000)
        .and_then(|p| p.named("per-ip"))
        .expect("valid");
    let mut admitted = 0;
    for i in 0..400u32 {
        let ip = format!("10.0.{}.{}", i / 256, i % 256);
        let checks = [
            Check::new(b"all", &global),
            Check::new(ip.as_bytes(), &per_ip),
        ];
        if leasing
            .check(&checks, CheckOptions::default())
            .await
            .expect("check")
            .allowed()
        {
            admitted += 1;
        }
        if i % 20 == 19 {
            clock.advance(Duration::from_millis(300));
        }
    }
    assert_eq!(admitted, 400);
    let stats = leasing.stats();
    assert_eq!((stats.leases, stats.wasted), (0, 0), "{stats:?}");
    // The store spent on the global limit what was admitted, and no more.
    let left = store
        .check_one(b"all", &global, 0)
        .await
        .expect("peek")
        .remaining;
    // (Refilled since by as much as the store's own clock has run, a moment.)
    assert!(left >= 100_000 - 400, "{left} left");
}

/// One check of each of `keys` (a key may repeat), each in a task of its own, all at once:
/// every one is allowed.
async fn checks_at_once_all_allowed<C: floodgate_core::Clock + 'static>(
    leasing: &Leasing<Store, C>,
    policy: &Policy,
    keys: Vec<Vec<u8>>,
) {
    let tasks: Vec<_> = keys
        .into_iter()
        .map(|key| {
            let (leasing, policy) = (leasing.clone(), policy.clone());
            tokio::spawn(async move {
                leasing
                    .check(&[Check::new(&key, &policy)], CheckOptions::default())
                    .await
                    .expect("check")
                    .allowed()
            })
        })
        .collect();
    for task in tasks {
        assert!(task.await.expect("task"));
    }
}

/// A hot key the store refuses a lease (fewer units left than a lease) is not asked for one
/// again at each check: for a lease period its checks cost the store one call each, not two,
/// and then a lease is asked for again.
#[tokio::test]
async fn a_refused_lease_is_not_asked_for_again_at_each_check() {
    // Leases of 20 units; 2,010 in the hour: a hundred leases, then 10 units left.
    let policy = Policy::fixed_window(2_010, Duration::from_secs(3_600)).expect("valid");
    let (store, clock, leasing) = on_manual_clock();
    let check = [Check::new(b"hot", &policy)];
    let mut admitted = 0;
    let mut denied = 0;
    while denied < 40 {
        let v = leasing
            .check(&check, CheckOptions::default())
            .await
            .expect("check");
        if v.allowed() {
            admitted += 1;
        } else {
            denied += 1;
        }
        assert!(admitted + denied < 10_000, "never denied");
    }
    assert_eq!(admitted, 2_010);
    // Leased, but for the checks before the key was hot and the units left.
    assert!(leasing.stats().leases >= 90, "{:?}", leasing.stats());
    // The store calls of 20 more checks, each denied.
    let twenty_denied = || async {
        let before = store.calls.load(Ordering::Relaxed);
        for _ in 0..20 {
            let v = leasing
                .check(&check, CheckOptions::default())
                .await
                .expect("check");
            assert!(!v.allowed());
        }
        store.calls.load(Ordering::Relaxed) - before
    };
    // Refused a lease when fewer than 20 units were left: denied since, each check costing
    // one store call.
    assert_eq!(twenty_denied().await, 20);
    // A lease period later, a lease is asked for once more (and refused again).
    clock.advance(LeasingConfig::default().lease_for);
    assert_eq!(twenty_denied().await, 21);
}

/// Checks of a hot key that queued for a lease while the store refused one to the first of
/// them do not ask for one again each: one refused lease, then each check its own store call.
#[tokio::test]
async fn checks_queued_behind_a_refused_lease_do_not_ask_again() {
    use floodgate_core::{ManualClock, Timestamp};
    // Leases of 20 units; 30 units left, and the key hot after 16 checks.
    let policy = Policy::fixed_window(2_000, Duration::from_secs(3_600)).expect("valid");
    let clock = ManualClock::new(Timestamp::from_micros(1_700_000_000_000_000));
    let store = store();
    let near = [Check::new(b"hot", &policy).cost(1_970)];
    assert!(
        store
            .check(&near, CheckOptions::default())
            .await
            .expect("check")
            .allowed()
    );
    let leasing = Leasing::with_config(store.clone(), LeasingConfig::default(), clock.clone());
    let check = [Check::new(b"hot", &policy)];
    all_allowed(&leasing, &check, 15).await;
    // Eight at once, hot, 15 units left: the store takes a while to answer.
    store.set_delay(Duration::from_millis(5));
    let before = store.calls.load(Ordering::Relaxed);
    checks_at_once_all_allowed(&leasing, &policy, vec![b"hot".to_vec(); 8]).await;
    assert_eq!(store.calls.load(Ordering::Relaxed) - before, 1 + 8);
    assert_eq!(leasing.stats().leases, 0, "{:?}", leasing.stats());
}

/// Leases of different keys are taken side by side: a replica with many hot keys does not ask
/// for one lease per store round trip, every hot key waiting behind the others'.
#[tokio::test]
async fn leases_of_different_keys_are_taken_at_once() {
    let policy = Policy::per(10_000_000, Duration::from_secs(10)).expect("valid");
    let store = store();
    let leasing = Leasing::new(store.clone());
    let keys: Vec<Vec<u8>> = (0..8).map(|k| format!("hot-{k}").into_bytes()).collect();
    // Each key seen 16 times in a lease period: hot, and the next check asks for a lease.
    for key in &keys {
        for _ in 0..LeasingConfig::default().hot_after {
            let v = leasing
                .check(&[Check::new(key, &policy)], CheckOptions::default())
                .await
                .expect("check");
            assert!(v.allowed());
        }
    }
    assert_eq!(leasing.stats().leases, 0, "{:?}", leasing.stats());
    store.set_delay(Duration::from_millis(50));
    checks_at_once_all_allowed(&leasing, &policy, keys).await;
    let stats = leasing.stats();
    assert_eq!(stats.leases, 8, "{stats:?}");
    assert_eq!(stats.local, 8, "{stats:?}");
    // Eight keys spread over the lease locks: several leases in the store at once (all eight
    // unless two keys share a lock). One lock for the replica allowed one.
    let at_once = store.most_at_once.load(Ordering::Relaxed);
    assert!(at_once >= 2, "at most {at_once} lease at once");
}

/// A caller that gives up while its check takes a lease (its timeout) does not take the lease
/// with it: the store counted the lease's units, and this replica spends them.
#[tokio::test]
async fn a_caller_that_gives_up_during_a_lease_loses_no_units() {
    // Leases of 20 units; the key hot after 16 checks.
    let policy = Policy::fixed_window(2_000, Duration::from_secs(3_600)).expect("valid");
    let (store, _, leasing) = on_manual_clock();
    let check = [Check::new(b"hot", &policy)];
    all_allowed(&leasing, &check, 16).await;
    // The store counts the lease at once and answers 50 ms later; the caller waits 10 ms.
    store.set_reply_delay(Duration::from_millis(50));
    let gave_up = tokio::time::timeout(
        Duration::from_millis(10),
        leasing.check(&check, CheckOptions::default()),
    )
    .await;
    assert!(gave_up.is_err(), "answered within 10 ms");
    store.set_reply_delay(Duration::ZERO);
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The lease is this replica's: its 20 units are spent here, with no call to the store.
    let calls = store.calls.load(Ordering::Relaxed);
    all_allowed(&leasing, &check, 20).await;
    assert_eq!(
        store.calls.load(Ordering::Relaxed),
        calls,
        "{:?}",
        leasing.stats()
    );
    assert_eq!(leasing.stats().leases, 1, "{:?}", leasing.stats());
    // The store counted the 16 checks and the one lease, no more.
    let peek = store
        .inner
        .check(
            &[Check::new(b"hot", &policy).cost(0)],
            CheckOptions::default(),
        )
        .await
        .expect("peek");
    assert_eq!(peek.decisions[0].remaining, 2_000 - 16 - 20);
}

/// Checks of a hot key that queued for a lease while the store failed the first of them do not
/// ask for one again each: one failed lease, then each check its own store call.
#[tokio::test]
async fn checks_queued_behind_a_failed_lease_do_not_ask_again() {
    let policy = Policy::fixed_window(2_000, Duration::from_secs(3_600)).expect("valid");
    let store = store();
    let leasing = Leasing::new(store.clone());
    let check = [Check::new(b"hot", &policy)];
    all_allowed(&leasing, &check, 16).await;
    // Eight at once, hot, and the store is down (each call takes a while to fail).
    store.set_delay(Duration::from_millis(5));
    store.set_failing(true);
    let before = store.calls.load(Ordering::Relaxed);
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (leasing, policy) = (leasing.clone(), policy.clone());
            tokio::spawn(async move {
                leasing
                    .check(&[Check::new(b"hot", &policy)], CheckOptions::default())
                    .await
                    .is_err()
            })
        })
        .collect();
    for task in tasks {
        assert!(
            task.await.expect("task"),
            "a check succeeded with the store down"
        );
    }
    assert_eq!(store.calls.load(Ordering::Relaxed) - before, 1 + 8);
    assert_eq!(leasing.stats().leases, 0, "{:?}", leasing.stats());
}

#[test]
fn a_lease_period_longer_than_an_hour_is_refused() {
    let cfg = LeasingConfig {
        lease_for: Duration::from_secs(3_601),
        ..LeasingConfig::default()
    };
    let err = cfg.validate().expect_err("an hour and a second");
    assert!(err.to_string().contains("lease_for"), "{err}");
    let cfg = LeasingConfig {
        lease_for: floodgate_core::MAX_LEASE_FOR,
        ..LeasingConfig::default()
    };
    cfg.validate().expect("an hour");
}

#[tokio::test]
async fn no_check_at_all_is_not_answered_locally() {
    let store = store();
    let leasing = Leasing::new(store.clone());
    let answer = leasing.check(&[], CheckOptions::default()).await;
    assert!(answer.is_err(), "{answer:?}");
    assert_eq!(leasing.stats().local, 0);
}

/// `times` checks of `check`, one after the other: every one is allowed.
async fn all_allowed<C: floodgate_core::Clock + 'static>(
    leasing: &Leasing<Store, C>,
    check: &[Check<'_>],
    times: usize,
) {
    for _ in 0..times {
        let v = leasing
            .check(check, CheckOptions::default())
            .await
            .expect("check");
        assert!(v.allowed());
    }
}
