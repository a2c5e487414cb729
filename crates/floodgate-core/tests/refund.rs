//! `Limiter::refund`: giving back what an allowed check took.
//!
//! The property: a check refunded at once is as if it had never been made. Two stores see the
//! same traffic, one checking and refunding some requests, the other never making them: every
//! other request gets the same decision from both, for every algorithm and for several policies
//! checked together.

use std::time::Duration;

use floodgate_core::{
    CalendarUnit, Check, CheckOptions, DenyCache, Limiter, ManualClock, MemoryLimiter, Policy,
    Timestamp, Verdict,
};
use proptest::prelude::*;

const T0: u64 = 1_709_214_330_000_000;
const MS: u64 = 1_000;

/// A policy of every algorithm, with the gap between events that exercises it.
fn policy() -> impl Strategy<Value = (Policy, u64)> {
    let ms = |lo: u64, hi: u64| (lo..=hi).prop_map(Duration::from_millis);
    let us = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
    prop_oneof![
        (0u64..8, 1u64..10, ms(1, 5_000))
            .prop_map(move |(b, c, p)| (Policy::gcra(b, c, p).expect("valid"), us(p))),
        (1u64..6, ms(1, 5_000))
            .prop_map(move |(c, d)| (Policy::funnel(c, d).expect("valid"), us(d))),
        (1u64..8, 1u64..5, ms(1, 5_000), any::<bool>()).prop_map(move |(c, a, i, greedy)| (
            if greedy {
                Policy::token_bucket(c, a, i)
            } else {
                Policy::token_bucket_intervally(c, a, i)
            }
            .expect("valid"),
            us(i)
        )),
        (1u64..6, ms(1, 5_000))
            .prop_map(move |(l, w)| (Policy::fixed_window(l, w).expect("valid"), us(w))),
        (1u64..6, 0usize..3).prop_map(|(l, unit)| {
            let (n, unit, span) = [
                (1, CalendarUnit::Second, 1_000 * MS),
                (15, CalendarUnit::Second, 15_000 * MS),
                (5, CalendarUnit::Minute, 300_000 * MS),
            ][unit];
            (Policy::calendar_window(l, n, unit).expect("valid"), span)
        }),
        (1u64..6, ms(1, 5_000))
            .prop_map(move |(l, w)| (Policy::sliding_log(l, w).expect("valid"), us(w))),
        (1u64..10, ms(1, 5_000))
            .prop_map(move |(l, w)| (Policy::sliding_window(l, w).expect("valid"), us(w))),
        (1u64..10, ms(1, 5_000), 1u64..4).prop_map(move |(c, p, b)| (
            Policy::shaper(c, p)
                .and_then(|s| s.with_burst(b))
                .expect("valid"),
            us(p)
        )),
        (1u64..4, ms(1, 5_000))
            .prop_map(move |(l, t)| (Policy::concurrency(l, t).expect("valid"), us(t))),
    ]
}

#[derive(Clone, Debug)]
struct Event {
    gap: u64,
    key: u8,
    cost: u64,
    /// Which policies to check (a bit per policy; never zero).
    mask: u8,
    max_wait: u64,
    /// Refund the check at once (when allowed); the other store never makes it.
    refund: bool,
}

fn cases() -> impl Strategy<Value = (Vec<Policy>, Vec<Event>)> {
    prop::collection::vec(policy(), 1..=3)
        .prop_filter("distinct policies", |ps| {
            ps.iter()
                .enumerate()
                .all(|(i, (p, _))| ps[..i].iter().all(|(q, _)| q != p))
        })
        .prop_flat_map(|ps| {
            let span = ps[0].1;
            let n = ps.len();
            let policies: Vec<Policy> = ps.into_iter().map(|(p, _)| p).collect();
            let gap = prop_oneof![
                3 => Just(0u64),
                5 => 0..span / 4 + 1,
                2 => 0..2 * span + 1,
            ];
            let event = (
                gap,
                0u8..3,
                0u64..=3,
                1u8..(1u8 << n),
                0u64..=span,
                any::<bool>(),
                prop::bool::weighted(0.3),
            )
                .prop_map(|(gap, key, cost, mask, wait, waits, refund)| Event {
                    gap,
                    key,
                    cost,
                    mask,
                    max_wait: if waits { wait } else { 0 },
                    refund,
                });
            (Just(policies), prop::collection::vec(event, 1..80))
        })
}

fn keys(key: u8, policies: usize) -> Vec<Vec<u8>> {
    (0..policies)
        .map(|p| format!("p{p}-k{key}").into_bytes())
        .collect()
}

/// Runs `events` through a store that refunds the marked ones and a store that never sees
/// them; the first disagreement on an unmarked event is the error.
fn refunded_is_never_made(policies: &[Policy], events: &[Event]) -> Result<(), String> {
    let refunding = MemoryLimiter::new();
    let reference = MemoryLimiter::new();
    let mut now = T0;
    for (i, e) in events.iter().enumerate() {
        now += e.gap;
        let at = Timestamp::from_micros(now);
        let keys = keys(e.key, policies.len());
        let checks: Vec<Check<'_>> = (0..policies.len())
            .filter(|p| e.mask & (1 << p) != 0)
            .map(|p| Check::new(&keys[p], &policies[p]).cost(e.cost))
            .collect();
        let opts = CheckOptions {
            max_wait: Duration::from_micros(e.max_wait),
            now: Some(at),
            deadline: None,
        };
        let a = refunding
            .check_sync(&checks, opts)
            .map_err(|err| format!("event {i}: {err}"))?;
        if e.refund {
            refunding
                .refund_at(&checks, &a, at)
                .map_err(|err| format!("event {i}: refund: {err}"))?;
            continue;
        }
        let b = reference
            .check_sync(&checks, opts)
            .map_err(|err| format!("event {i}: {err}"))?;
        if a.decisions != b.decisions || a.wait != b.wait {
            return Err(format!(
                "event {i} at +{}us {e:?}:\n  refunding {a:?}\n  reference {b:?}",
                now - T0
            ));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn a_check_refunded_at_once_is_as_if_never_made((policies, events) in cases()) {
        refunded_is_never_made(&policies, &events).map_err(TestCaseError::fail)?;
    }
}

fn at(ms: u64) -> CheckOptions {
    CheckOptions::at(Timestamp::from_micros(T0 + ms * MS))
}

/// Whether `checks` are allowed at `ms` after T0.
fn allowed(limiter: &MemoryLimiter, checks: &[Check<'_>], ms: u64) -> bool {
    limiter
        .check_sync(checks, at(ms))
        .expect("checks")
        .allowed()
}

/// "One SMS per phone per 30 minutes", and the provider refused the message.
#[test]
fn a_refund_gives_the_phone_its_message_back() {
    let limiter = MemoryLimiter::new();
    let phone = Policy::funnel(1, Duration::from_secs(30 * 60)).expect("valid");
    let checks = [Check::new(b"+15550100", &phone)];
    let sent = limiter.check_sync(&checks, at(0)).expect("checks");
    assert!(sent.allowed());
    assert!(!allowed(&limiter, &checks, 1));
    limiter
        .refund_at(&checks, &sent, Timestamp::from_micros(T0 + 2 * MS))
        .expect("refunds");
    let again = limiter.check_sync(&checks, at(3)).expect("checks");
    assert!(again.allowed(), "{again:?}");
    assert!(!allowed(&limiter, &checks, 4));
}

#[test]
fn a_denied_verdict_refunds_nothing() {
    let limiter = MemoryLimiter::new();
    let p = Policy::per_minute(1).expect("valid");
    let checks = [Check::new(b"k", &p)];
    assert!(allowed(&limiter, &checks, 0));
    let denied = limiter.check_sync(&checks, at(1)).expect("checks");
    assert!(!denied.allowed());
    limiter
        .refund_at(&checks, &denied, Timestamp::from_micros(T0 + 2 * MS))
        .expect("refunds");
    assert!(!allowed(&limiter, &checks, 3));
}

/// A window that has closed since the check has forgotten its units: refunding them must not
/// credit the window that counts now.
#[test]
fn a_refund_after_the_window_closed_gives_nothing_to_the_next() {
    for p in [
        Policy::fixed_window(1, Duration::from_secs(1)).expect("valid"),
        Policy::calendar_window(1, 1, CalendarUnit::Second).expect("valid"),
        Policy::sliding_log(1, Duration::from_secs(1)).expect("valid"),
    ] {
        let limiter = MemoryLimiter::new();
        let checks = [Check::new(b"k", &p)];
        let first = limiter.check_sync(&checks, at(0)).expect("checks");
        assert!(first.allowed(), "{p:?}");
        let second = limiter.check_sync(&checks, at(1_500)).expect("checks");
        assert!(second.allowed(), "{p:?}");
        limiter
            .refund_at(&checks, &first, Timestamp::from_micros(T0 + 1_600 * MS))
            .expect("refunds");
        let third = limiter.check_sync(&checks, at(1_700)).expect("checks");
        assert!(
            !third.allowed(),
            "{p:?}: the refund credited the new window"
        );
    }
}

/// Several policies checked together give back on every one, and a concurrency lease is
/// released.
#[test]
fn a_refund_gives_back_every_policy_of_the_check_and_its_lease() {
    let limiter = MemoryLimiter::new();
    let rate = Policy::per_minute(1).expect("valid");
    let slots = Policy::concurrency(1, Duration::from_secs(60)).expect("valid");
    let checks = [Check::new(b"a", &rate), Check::new(b"a", &slots)];
    let first = limiter.check_sync(&checks, at(0)).expect("checks");
    assert!(first.allowed() && first.lease.is_some());
    assert!(!allowed(&limiter, &checks, 1));
    limiter
        .refund_at(&checks, &first, Timestamp::from_micros(T0 + 2 * MS))
        .expect("refunds");
    assert!(allowed(&limiter, &checks, 3));
}

/// A deny cache in front of the store remembers that the check spent the key's last unit; the
/// refund must make it forget, or the next check is turned away locally.
#[tokio::test]
async fn a_refund_through_the_deny_cache_forgets_its_denial() {
    let clock = ManualClock::new(Timestamp::from_micros(T0));
    let store = MemoryLimiter::builder().clock(clock.clone()).build();
    let cache = DenyCache::with_clock(store, clock.clone(), 1_000);
    let phone = Policy::funnel(1, Duration::from_secs(30 * 60)).expect("valid");
    let checks = [Check::new(b"+15550100", &phone)];
    let sent: Verdict = cache
        .check(&checks, CheckOptions::default())
        .await
        .expect("checks");
    assert!(sent.allowed());
    let denied = cache
        .check(&checks, CheckOptions::default())
        .await
        .expect("checks");
    assert!(!denied.allowed());
    cache.refund(&checks, &sent).await.expect("refunds");
    clock.advance(Duration::from_millis(1));
    let again = cache
        .check(&checks, CheckOptions::default())
        .await
        .expect("checks");
    assert!(again.allowed(), "{again:?}");
}

/// A sliding window counter that has moved on by one window gives the units back from the
/// previous window's count, which still weighs on the current one.
#[test]
fn a_late_refund_of_a_sliding_window_comes_off_the_previous_window() {
    let p = Policy::sliding_window(2, Duration::from_secs(1)).expect("valid");
    let checks = [Check::new(b"k", &p)];
    let run = |refund: bool| {
        let limiter = MemoryLimiter::new();
        let first = limiter.check_sync(&checks, at(0)).expect("checks");
        assert!(first.allowed());
        assert!(allowed(&limiter, &checks, 1_100));
        if refund {
            limiter
                .refund_at(&checks, &first, Timestamp::from_micros(T0 + 1_150 * MS))
                .expect("refunds");
        }
        allowed(&limiter, &checks, 1_200)
    };
    // Without the refund, 80% of the previous window's one unit still counts: 2.8 > 2.
    assert!(!run(false));
    assert!(run(true));
}

/// A refund trusts only what it can check: the checks must match the verdict's decisions, and
/// the verdict's time must be one the store can hold (a forged one is refused, changing
/// nothing).
#[test]
fn a_refund_that_does_not_fit_its_verdict_is_refused_and_changes_nothing() {
    let limiter = MemoryLimiter::new();
    let p = Policy::per_minute(1).expect("valid");
    let q = Policy::per_minute(5)
        .and_then(|q| q.named("other"))
        .expect("valid");
    let checks = [Check::new(b"k", &p)];
    let sent = limiter.check_sync(&checks, at(0)).expect("checks");
    assert!(sent.allowed());
    let now = Timestamp::from_micros(T0 + MS);
    // Two checks for one decision.
    let two = [Check::new(b"k", &p), Check::new(b"k", &q)];
    assert!(limiter.refund_at(&two, &sent, now).is_err());
    // A verdict from beyond what the store can hold.
    let forged = Verdict {
        at: Timestamp::from_micros(u64::MAX),
        ..sent.clone()
    };
    let err = limiter
        .refund_at(&checks, &forged, now)
        .expect_err("a verdict from the year 584,000");
    assert!(err.to_string().contains("us"), "{err}");
    // Nothing was given back.
    assert!(!allowed(&limiter, &checks, 2));
}

/// A late refund gives back only what is left of the check's own units: those that came back
/// by themselves are not given twice, and a request counted since keeps its place.
#[test]
fn a_late_refund_gives_back_only_what_has_not_come_back_by_itself() {
    for p in [
        Policy::per_minute(1).expect("valid"),
        Policy::funnel(1, Duration::from_secs(60)).expect("valid"),
    ] {
        let limiter = MemoryLimiter::new();
        let checks = [Check::new(b"k", &p)];
        let a = limiter.check_sync(&checks, at(0)).expect("checks");
        assert!(a.allowed(), "{p:?}");
        // A's unit has come back by itself; B takes it.
        let b = limiter.check_sync(&checks, at(60_000)).expect("checks");
        assert!(b.allowed(), "{p:?}");
        limiter
            .refund_at(&checks, &a, Timestamp::from_micros(T0 + 60_001 * MS))
            .expect("refunds");
        let c = limiter.check_sync(&checks, at(60_002)).expect("checks");
        assert!(!c.allowed(), "{p:?}: the late refund gave back B's unit");

        // Half of A's share has come back by itself at 30 s: the refund gives back the other
        // half, and the key is full again (one request, not two).
        let limiter = MemoryLimiter::new();
        let a = limiter.check_sync(&checks, at(0)).expect("checks");
        limiter
            .refund_at(&checks, &a, Timestamp::from_micros(T0 + 30_000 * MS))
            .expect("refunds");
        assert!(allowed(&limiter, &checks, 30_001), "{p:?}");
        assert!(
            !allowed(&limiter, &checks, 30_002),
            "{p:?}: more than a fresh state's room"
        );
    }
}

/// A shaper's reservation is given back only while nothing is queued behind it: its state is
/// one time, and freeing a slot in the middle of the queue would promise that slot twice.
#[test]
fn a_shaper_reservation_with_others_behind_it_is_not_given_back() {
    let p = Policy::shaper(100, Duration::from_secs(1)).expect("valid"); // one per 10 ms
    let checks = [Check::new(b"k", &p)];
    let wait = |ms| CheckOptions {
        max_wait: Duration::from_secs(1),
        now: Some(Timestamp::from_micros(T0 + ms * MS)),
        deadline: None,
    };
    let limiter = MemoryLimiter::new();
    let first = limiter.check_sync(&checks, wait(0)).expect("checks");
    let a = limiter.check_sync(&checks, wait(0)).expect("checks");
    let b = limiter.check_sync(&checks, wait(0)).expect("checks");
    assert_eq!(
        (first.wait, a.wait, b.wait),
        (
            Duration::ZERO,
            Duration::from_millis(10),
            Duration::from_millis(20)
        )
    );
    // A, in the middle: nothing comes back, and the next reservation comes after B's.
    limiter
        .refund_at(&checks, &a, Timestamp::from_micros(T0))
        .expect("refunds");
    let c = limiter.check_sync(&checks, wait(0)).expect("checks");
    assert_eq!(c.wait, Duration::from_millis(30), "C would share B's slot");
    // C, the last: its slot comes back.
    limiter
        .refund_at(&checks, &c, Timestamp::from_micros(T0))
        .expect("refunds");
    let d = limiter.check_sync(&checks, wait(0)).expect("checks");
    assert_eq!(d.wait, Duration::from_millis(30));
}
