//! The conformance suite: the same cases, and random sequences, against the memory backend and
//! the Redis backend with an injected `now`, compared decision for decision. Run on a single node
//! (both connection kinds) and on a local Redis Cluster.

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use floodgate_core::{
    CalendarUnit, Check, CheckOptions, Kind, LeaseId, Limiter, ManualClock, MemoryLimiter, Policy,
    Timestamp, Verdict,
};
use floodgate_redis::{BatchConfig, ConnectionKind, RedisConfig, RedisLimiter};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

use support::{cluster, cluster_limiter, limiter, run, server};

const LIMIT: Duration = Duration::from_secs(240);
/// 2024-02-29T13:45:30Z: a leap day, in the middle of a week, month and quarter.
const T0: u64 = 1_709_214_330_000_000;
const MS: u64 = 1_000;

static CASE: AtomicU64 = AtomicU64::new(0);

#[derive(Clone, Debug)]
struct Event {
    gap: u64,
    /// How far the clock steps back before the gap (a clock stepped back by NTP, a failover to
    /// a server whose clock is behind); zero mostly.
    back: u64,
    key: u8,
    cost: u64,
    /// Which of the case's policies to check (a bit per policy; never zero).
    mask: u8,
    max_wait: u64,
    /// Release the oldest concurrency lease before checking.
    release: bool,
    /// Refund the check when it is allowed: 1 at once, `n` > 1 before the event `n - 1`
    /// events later (after its gap); 0 never.
    refund: u8,
}

/// Runs `events` through both backends and fails at the first difference.
async fn compare(
    redis: &RedisLimiter,
    policies: &[Policy],
    events: &[Event],
    same_key: bool,
) -> Result<(), String> {
    let case = CASE.fetch_add(1, Ordering::Relaxed);
    let clock = ManualClock::new(Timestamp::from_micros(T0));
    let memory = MemoryLimiter::builder().clock(clock.clone()).build();
    let mut leases: Vec<(LeaseId, LeaseId, Vec<usize>, u8)> = Vec::new();
    let mut now = T0;
    // Checks to refund before a later event: that event's index, the check's policies, key
    // and cost, and both verdicts.
    let mut late: Vec<(usize, Vec<usize>, u8, u64, Verdict, Verdict)> = Vec::new();
    for (i, e) in events.iter().enumerate() {
        now = now - e.back + e.gap;
        clock.set(Timestamp::from_micros(now));
        let at = Timestamp::from_micros(now);
        for (_, chosen, key, cost, a, b) in late.iter().filter(|l| l.0 == i) {
            let keys = key_bytes(case, *key, policies.len(), same_key);
            let checks: Vec<Check<'_>> = chosen
                .iter()
                .map(|&p| Check::new(&keys[p], &policies[p]).cost(*cost))
                .collect();
            memory
                .refund_at(&checks, a, at)
                .map_err(|err| format!("event {i}: memory late refund failed: {err}"))?;
            redis
                .refund_at(&checks, b, Some(at))
                .await
                .map_err(|err| format!("event {i}: redis late refund failed: {err}"))?;
        }
        if e.release && !leases.is_empty() {
            let (m, r, chosen, key) = leases.remove(0);
            let keys = key_bytes(case, key, policies.len(), same_key);
            let checks: Vec<Check<'_>> = chosen
                .iter()
                .map(|&p| Check::new(&keys[p], &policies[p]))
                .collect();
            let a = memory.release_at(&checks, m, at);
            let b = redis
                .release_at(&checks, r, Some(at))
                .await
                .map_err(|err| format!("event {i}: redis release failed: {err}"))?;
            if a != (b > 0) {
                return Err(format!("event {i}: release memory {a} redis {b}"));
            }
        }
        let keys = key_bytes(case, e.key, policies.len(), same_key);
        let chosen: Vec<usize> = (0..policies.len())
            .filter(|p| e.mask & (1 << p) != 0)
            .collect();
        let checks: Vec<Check<'_>> = chosen
            .iter()
            .map(|&p| Check::new(&keys[p], &policies[p]).cost(e.cost))
            .collect();
        let opts = CheckOptions {
            max_wait: Duration::from_micros(e.max_wait),
            now: Some(at),
            deadline: None,
        };
        let a = memory
            .check(&checks, opts)
            .await
            .map_err(|err| format!("event {i}: memory failed: {err}"))?;
        let b = redis
            .check(&checks, opts)
            .await
            .map_err(|err| format!("event {i}: redis failed: {err}"))?;
        // A lease only for a concurrency check that takes something: one of cost 0 (a peek)
        // holds nothing to release.
        let takes = checks
            .iter()
            .any(|c| c.cost > 0 && matches!(c.policy.kind(), Kind::Concurrency(_)));
        if !takes && (a.lease.is_some() || b.lease.is_some()) {
            return Err(format!(
                "event {i}: a lease that holds nothing: memory {a:?}, redis {b:?}"
            ));
        }
        if !same_verdict(&a, &b) {
            return Err(format!(
                "event {i} at {:+}us {e:?}:\n  memory {a:?}\n  redis  {b:?}",
                now as i64 - T0 as i64
            ));
        }
        if e.refund > 1 && a.allowed() {
            let due = i + usize::from(e.refund) - 1;
            late.push((due, chosen.clone(), e.key, e.cost, a.clone(), b.clone()));
        }
        if e.refund == 1 && a.allowed() {
            memory
                .refund_at(&checks, &a, at)
                .map_err(|err| format!("event {i}: memory refund failed: {err}"))?;
            redis
                .refund_at(&checks, &b, Some(at))
                .await
                .map_err(|err| format!("event {i}: redis refund failed: {err}"))?;
            continue;
        }
        if let (Some(m), Some(r)) = (a.lease, b.lease) {
            leases.push((m, r, chosen, e.key));
        }
    }
    Ok(())
}

fn same_verdict(a: &Verdict, b: &Verdict) -> bool {
    a.decisions == b.decisions
        && a.wait == b.wait
        && a.lease.is_some() == b.lease.is_some()
        && a.at == b.at
}

/// One user key per policy (or one shared by all, which a cluster needs for a multi-check).
fn key_bytes(case: u64, key: u8, policies: usize, same_key: bool) -> Vec<Vec<u8>> {
    (0..policies)
        .map(|p| {
            let p = if same_key { 0 } else { p };
            format!("case{case}-p{p}-k{key}").into_bytes()
        })
        .collect()
}

/// A policy of every algorithm, with the gap between events that exercises it.
fn policy() -> impl Strategy<Value = (Policy, u64)> {
    let ms = |lo: u64, hi: u64| (lo..=hi).prop_map(Duration::from_millis);
    prop_oneof![
        (0u64..8, 1u64..10, ms(1, 5_000))
            .prop_map(|(b, c, p)| (Policy::gcra(b, c, p).expect("valid"), p.as_micros() as u64)),
        (1u64..6, ms(1, 5_000))
            .prop_map(|(c, d)| (Policy::funnel(c, d).expect("valid"), d.as_micros() as u64)),
        (1u64..8, 1u64..5, ms(1, 5_000), any::<bool>()).prop_map(|(c, a, i, greedy)| (
            if greedy {
                Policy::token_bucket(c, a, i)
            } else {
                Policy::token_bucket_intervally(c, a, i)
            }
            .expect("valid"),
            i.as_micros() as u64
        )),
        (1u64..6, ms(1, 5_000)).prop_map(|(l, w)| (
            Policy::fixed_window(l, w).expect("valid"),
            w.as_micros() as u64
        )),
        (1u64..6, 0usize..6, -14i32..=14).prop_map(|(l, unit, off)| {
            let (n, unit, span) = [
                (1, CalendarUnit::Second, 1_000 * MS),
                (15, CalendarUnit::Second, 15_000 * MS),
                (5, CalendarUnit::Minute, 300_000 * MS),
                (1, CalendarUnit::Day, 86_400_000 * MS),
                (1, CalendarUnit::Week, 604_800_000 * MS),
                (3, CalendarUnit::Month, 7_776_000_000 * MS),
            ][unit];
            let p = Policy::calendar_window(l, n, unit)
                .and_then(|p| p.with_utc_offset(off * 3600))
                .expect("valid");
            (p, span)
        }),
        (1u64..6, ms(1, 5_000)).prop_map(|(l, w)| (
            Policy::sliding_log(l, w).expect("valid"),
            w.as_micros() as u64
        )),
        (1u64..10, ms(1, 5_000)).prop_map(|(l, w)| (
            Policy::sliding_window(l, w).expect("valid"),
            w.as_micros() as u64
        )),
        (1u64..10, ms(1, 5_000), 1u64..4).prop_map(|(c, p, b)| (
            Policy::shaper(c, p)
                .and_then(|s| s.with_burst(b))
                .expect("valid"),
            p.as_micros() as u64
        )),
        (1u64..4, ms(1, 5_000)).prop_map(|(l, t)| (
            Policy::concurrency(l, t).expect("valid"),
            t.as_micros() as u64
        )),
    ]
}

/// Events for a case whose first policy is exercised by gaps around `span`; with `back`, the
/// clock steps back now and then (up to two spans).
fn events(span: u64, policies: usize, back: bool) -> impl Strategy<Value = Vec<Event>> {
    let gap = prop_oneof![
        3 => Just(0u64),
        5 => 0..span / 4 + 1,
        2 => 0..2 * span + 1,
    ];
    let back = prop_oneof![
        11 => Just(0u64),
        u32::from(back) => 1..2 * span + 1,
    ];
    let mask = 1u8..(1u8 << policies);
    let event = (
        (gap, back),
        0u8..3,
        0u64..=3,
        mask,
        0u64..=span,
        any::<bool>(),
        any::<bool>(),
        prop_oneof![7 => Just(0u8), 2 => Just(1u8), 1 => Just(2u8), 1 => Just(3u8)],
    )
        .prop_map(
            |((gap, back), key, cost, mask, wait, waits, release, refund)| Event {
                gap,
                back,
                key,
                cost,
                mask,
                max_wait: if waits { wait } else { 0 },
                release,
                refund,
            },
        );
    prop::collection::vec(event, 1..80)
}

/// Random cases: one to three policies of any algorithms, checked together.
fn cases(back: bool) -> impl Strategy<Value = (Vec<Policy>, Vec<Event>)> {
    prop::collection::vec(policy(), 1..=3)
        .prop_filter("distinct policies", |ps| {
            ps.iter()
                .enumerate()
                .all(|(i, (p, _))| ps[..i].iter().all(|(q, _)| q != p))
        })
        .prop_flat_map(move |ps| {
            let span = ps[0].1;
            let n = ps.len();
            let policies: Vec<Policy> = ps.into_iter().map(|(p, _)| p).collect();
            (Just(policies), events(span, n, back))
        })
}

/// Random cases through both backends; with `back`, the clock steps back now and then.
async fn random_sequences(redis: &RedisLimiter, cases_count: u32, same_key: bool, back: bool) {
    let mut runner = TestRunner::new(Config {
        cases: cases_count,
        failure_persistence: None,
        ..Config::default()
    });
    // proptest runs synchronously; each case blocks on its own short-lived runtime thread.
    let handle = tokio::runtime::Handle::current();
    let redis = redis.clone();
    let result = tokio::task::spawn_blocking(move || {
        runner.run(&cases(back), |(policies, events)| {
            handle
                .block_on(compare(&redis, &policies, &events, same_key))
                .map_err(TestCaseError::fail)
        })
    })
    .await
    .expect("runner thread");
    if let Err(e) = result {
        panic!("memory and Redis disagree: {e}");
    }
}

/// Hand-written sequences every backend must reproduce exactly, beyond agreeing.
async fn fixed_cases(redis: &RedisLimiter) {
    // redis-cell's own table (limit 5, 1 per second), through the Redis scripts.
    let gcra = Policy::gcra(4, 1, Duration::from_secs(1)).expect("valid");
    let key = format!("cell-{}", CASE.fetch_add(1, Ordering::Relaxed));
    // (ms, quantity) => (allowed, remaining, retry_after_ms, reset_after_ms)
    type Row = (u64, u64, (bool, u64, Option<u64>, u64));
    let table: &[Row] = &[
        (0, 6, (false, 5, None, 0)),
        (0, 1, (true, 4, None, 1000)),
        (0, 1, (true, 3, None, 2000)),
        (0, 1, (true, 2, None, 3000)),
        (0, 1, (true, 1, None, 4000)),
        (0, 1, (true, 0, None, 5000)),
        (0, 1, (false, 0, Some(1000), 5000)),
        (3000, 1, (true, 2, None, 3000)),
        (3100, 1, (true, 1, None, 3900)),
        (4000, 1, (true, 1, None, 4000)),
        (8000, 1, (true, 4, None, 1000)),
        (9500, 1, (true, 4, None, 1000)),
        (9500, 0, (true, 4, None, 1000)),
        (9500, 2, (true, 2, None, 3000)),
        (9500, 5, (false, 2, Some(3000), 3000)),
    ];
    for (i, (t, q, want)) in table.iter().enumerate() {
        let v = redis
            .check(
                &[Check::new(key.as_bytes(), &gcra).cost(*q)],
                CheckOptions::at(Timestamp::from_micros(T0 + t * MS)),
            )
            .await
            .expect("check");
        let d = v.decisions[0];
        assert_eq!(
            (
                d.allowed,
                d.remaining,
                d.retry_after_ms(),
                d.reset_after_ms()
            ),
            *want,
            "row {i}"
        );
        assert_eq!(d.limit, 5);
    }

    // Every algorithm, a deterministic sequence of bursts and pauses, both backends.
    let policies = [
        Policy::funnel(1, Duration::from_secs(1800)),
        Policy::token_bucket(4, 2, Duration::from_secs(1)),
        Policy::token_bucket_intervally(10, 10, Duration::from_secs(60)),
        Policy::fixed_window(3, Duration::from_secs(10)),
        Policy::calendar_window(2, 1, CalendarUnit::Day).and_then(|p| p.with_utc_offset(8 * 3600)),
        Policy::calendar_window(2, 1, CalendarUnit::Month),
        Policy::sliding_log(3, Duration::from_secs(10)),
        Policy::sliding_window(10, Duration::from_secs(10)),
        Policy::shaper(10, Duration::from_secs(1)),
        Policy::concurrency(2, Duration::from_secs(30)),
    ];
    for p in policies {
        let p = p.expect("valid");
        let events: Vec<Event> = (0..120u64)
            .map(|i| Event {
                gap: [
                    0,
                    0,
                    250 * MS,
                    3_000 * MS,
                    0,
                    40_000 * MS,
                    11 * 3_600_000 * MS,
                ][(i % 7) as usize],
                back: 0,
                key: (i % 2) as u8,
                cost: [1, 1, 2, 0, 1][(i % 5) as usize],
                mask: 1,
                max_wait: if i % 3 == 0 { 350 * MS } else { 0 },
                release: i % 4 == 0,
                refund: [0, 1, 0, 2, 0, 0, 1, 0, 2][(i % 9) as usize],
            })
            .collect();
        if let Err(e) = compare(redis, std::slice::from_ref(&p), &events, true).await {
            panic!("{}: {e}", p.name());
        }
        // The same with a clock that steps back now and then (NTP, a failover to a server
        // whose clock is behind) past states written later, with refunds and peeks: both
        // backends must agree on what such states still count.
        let back: Vec<Event> = (0..120u64)
            .map(|i| Event {
                gap: [0, 250 * MS, 0, 700 * MS, 40 * MS, 1_300 * MS][(i % 6) as usize],
                back: [0, 0, 0, 0, 2_100 * MS, 0, 0, 600 * MS][(i % 8) as usize],
                key: (i % 2) as u8,
                cost: [1, 0, 2, 1, 0, 1, 3][(i % 7) as usize],
                mask: 1,
                max_wait: if i % 5 == 0 { 350 * MS } else { 0 },
                release: i % 6 == 0,
                refund: [0, 2, 0, 1, 3, 0, 0, 2][(i % 8) as usize],
            })
            .collect();
        if let Err(e) = compare(redis, std::slice::from_ref(&p), &back, true).await {
            panic!("{} with steps back: {e}", p.name());
        }
    }
}

/// Refunds that come after the window of the check has moved on: the window algorithms must
/// give back from the right count, or nothing, alike on both backends.
async fn late_refund_cases(redis: &RedisLimiter) {
    let policies = [
        Policy::sliding_window(2, Duration::from_secs(1)),
        Policy::fixed_window(1, Duration::from_secs(1)),
        Policy::calendar_window(1, 1, CalendarUnit::Second),
        Policy::sliding_log(2, Duration::from_secs(1)),
        Policy::gcra(1, 1, Duration::from_secs(1)),
    ];
    let event = |gap: u64, refund: u8| Event {
        gap,
        back: 0,
        key: 0,
        cost: 1,
        mask: 1,
        max_wait: 0,
        release: false,
        refund,
    };
    for p in policies {
        let p = p.expect("valid");
        // A check, another in the next window, the first refunded, then checks that see it.
        let events = [
            event(0, 3),
            event(1_100 * MS, 0),
            event(100 * MS, 0),
            event(0, 0),
            event(0, 0),
        ];
        if let Err(e) = compare(redis, std::slice::from_ref(&p), &events, true).await {
            panic!("{}: {e}", p.name());
        }
    }
    // A funnel measured from a time ahead of the clock (it stepped back), emptied by a refund:
    // it is fresh, not a level of zero that a later check would measure from that time.
    let funnel = Policy::funnel(3, Duration::from_secs(3)).expect("valid");
    let step = |gap: u64, back: u64, cost: u64, refund: u8| Event {
        gap,
        back,
        key: 0,
        cost,
        mask: 1,
        max_wait: 0,
        release: false,
        refund,
    };
    let events = [
        step(0, 0, 2, 3),
        step(5_000 * MS, 0, 1, 0),
        step(0, 4_500 * MS, 3, 0),
        step(1_500 * MS, 0, 0, 0),
    ];
    if let Err(e) = compare(redis, std::slice::from_ref(&funnel), &events, true).await {
        panic!("{}: {e}", funnel.name());
    }
    // One name under two calendar layouts (a policy changed from hourly to daily): the hourly
    // window's start, later than the day's and no day boundary, reads as another window's.
    let layouts = [
        Policy::calendar_window(1, 1, CalendarUnit::Hour).and_then(|p| p.named("shared")),
        Policy::calendar_window(1, 1, CalendarUnit::Day).and_then(|p| p.named("shared")),
    ]
    .map(|p| p.expect("valid"));
    let events = [
        Event {
            mask: 1,
            ..step(0, 0, 1, 0)
        },
        Event {
            mask: 2,
            ..step(1, 0, 1, 0)
        },
        Event {
            mask: 2,
            ..step(1, 0, 1, 0)
        },
    ];
    if let Err(e) = compare(redis, &layouts, &events, true).await {
        panic!("one name, two calendar layouts: {e}");
    }
}

#[test]
fn conformance_single_node_multiplexed() {
    let server = server();
    run(LIMIT, async {
        let redis = limiter(&server.url(), ConnectionKind::Multiplexed).await;
        fixed_cases(&redis).await;
        late_refund_cases(&redis).await;
        random_sequences(&redis, 64, false, true).await;
    });
}

#[test]
fn conformance_single_node_pool() {
    let server = server();
    run(LIMIT, async {
        let redis = limiter(&server.url(), ConnectionKind::Pool { size: 4 }).await;
        fixed_cases(&redis).await;
        late_refund_cases(&redis).await;
        random_sequences(&redis, 32, false, true).await;
    });
}

#[test]
fn conformance_cluster() {
    let cluster = cluster();
    run(LIMIT, async {
        let redis = cluster_limiter(&cluster).await;
        fixed_cases(&redis).await;
        late_refund_cases(&redis).await;
        random_sequences(&redis, 48, true, true).await;
        // One user key per policy: the checks span slots, counted slot by slot and given back
        // when a later slot denies. The clock only moves forward: what is given back leaves a
        // state that decides as the memory backend's from then on, not before (a funnel or a
        // bucket measured from the check's time, not from where the state stood).
        random_sequences(&redis, 48, false, false).await;
    });
}

/// GCRA with a clock that steps back and two policies of one name with different periods: the
/// states either leaves far ahead of the other's tolerance read as none on both backends alike,
/// checked one by one (the check script) and in batches of plain checks (the batch script and
/// the client's replay).
#[test]
fn gcra_states_ahead_of_the_tolerance_decide_alike() {
    let server = server();
    run(LIMIT, async {
        // One script call at a time: batches in flight together are sent from tasks of their
        // own, in no set order (concurrent checks have none), and the memory backend below
        // replays the order of issue.
        let config = RedisConfig::new(&server.url())
            .expect("valid URL")
            .timeout(Duration::from_secs(2));
        let batching = BatchConfig {
            max_in_flight: 1,
            ..BatchConfig::default()
        };
        let one_by_one = support::limiter_batching(&config, batching).await;
        let policies = [
            Policy::per_hour(6)
                .and_then(|p| p.named("g"))
                .expect("valid"),
            Policy::per_minute(6)
                .and_then(|p| p.named("g"))
                .expect("valid"),
            Policy::gcra(2, 1, Duration::from_secs(1)).expect("valid"),
        ];
        for seed in 0..8u64 {
            let mut rng = fastrand::Rng::with_seed(seed);
            let memory = MemoryLimiter::new();
            let keys: Vec<Vec<u8>> = (0..3)
                .map(|k| format!("ahead-s{seed}-k{k}").into_bytes())
                .collect();
            let mut now = T0 + 10 * 3_600_000_000;
            for i in 0..200 {
                // Mostly forward, sometimes a step back (up to two hours).
                if rng.u8(..10) == 0 {
                    now -= rng.u64(0..7_200_000_000);
                } else {
                    now += rng.u64(0..20_000_000);
                }
                let opts = CheckOptions::at(Timestamp::from_micros(now));
                // A round of plain checks (cost 1) issued at once, which batch together; or one
                // check of any cost. (Checks of other forms in one batch are decided in no set
                // order: concurrent checks have none.)
                let plain = rng.bool();
                let round: Vec<[Check<'_>; 1]> = (0..if plain { rng.usize(1..=4) } else { 1 })
                    .map(|_| {
                        let c =
                            Check::new(&keys[rng.usize(..keys.len())], &policies[rng.usize(..3)]);
                        [c.cost(if plain { 1 } else { rng.u64(0..=2) })]
                    })
                    .collect();
                let got = tokio::task::unconstrained(futures_util::future::join_all(
                    round.iter().map(|c| one_by_one.check(c, opts)),
                ))
                .await;
                // The memory backend in the order the batch decides: the order of issue.
                for (j, (c, got)) in round.iter().zip(got).enumerate() {
                    let got = got.expect("redis decides");
                    let want = memory.check_sync(c, opts).expect("memory decides");
                    assert_eq!(
                        got.decisions,
                        want.decisions,
                        "seed {seed}, event {i}, check {j} ({:?}, cost {}) at +{}us",
                        c[0].policy.name(),
                        c[0].cost,
                        now.wrapping_sub(T0)
                    );
                }
            }
        }
    });
}
