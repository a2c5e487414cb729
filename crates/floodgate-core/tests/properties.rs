//! Property tests of every algorithm, driven by explicit time (no sleeps).
//!
//! For random policies and random traffic:
//! - no algorithm admits more than it promises in any window it promises;
//! - a client that waits `retry_after` is admitted;
//! - at `reset_after` the state is full again, and `remaining` is exact;
//! - algorithms that share GCRA's schedule agree with it decision for decision.

use std::time::Duration;

use floodgate_core::algorithm::fixed_window::Window;
use floodgate_core::algorithm::{Ctx, Undo};
use floodgate_core::{Calendar, CalendarUnit, Kind, Policy, State};
use proptest::prelude::*;

const T0: u64 = 1_700_000_000_000_000;

/// One request: time since the previous one (µs) and cost.
#[derive(Clone, Copy, Debug)]
struct Event {
    gap: u64,
    cost: u64,
}

#[derive(Debug)]
struct Step {
    now: u64,
    cost: u64,
    allowed: bool,
    wait: u64,
}

fn events(max_gap: u64, max_cost: u64) -> impl Strategy<Value = Vec<Event>> {
    let gap = prop_oneof![
        3 => Just(0u64),
        5 => 0..max_gap / 4 + 1,
        2 => 0..max_gap + 1,
    ];
    prop::collection::vec(
        (gap, 0..=max_cost).prop_map(|(gap, cost)| Event { gap, cost }),
        1..150,
    )
}

fn run(kind: &Kind, events: &[Event], max_wait: u64) -> Vec<Step> {
    let mut state = kind.fresh();
    let mut now = T0;
    let mut lease = 0;
    events
        .iter()
        .map(|e| {
            now += e.gap;
            lease += 1;
            let ctx = Ctx {
                now,
                cost: e.cost,
                max_wait,
                lease,
            };
            let out = kind.check(&mut state, &ctx);
            Step {
                now,
                cost: e.cost,
                allowed: out.decision.allowed,
                wait: out.wait,
            }
        })
        .collect()
}

/// Units admitted in every window `[a.now, b.now]` stay within `burst + span / interval`:
/// GCRA's conformance definition.
fn assert_rate_bound(steps: &[Step], burst: u64, interval: u64, per_interval: u64) {
    let admitted: Vec<(u64, u64)> = steps
        .iter()
        .filter(|s| s.allowed && s.cost > 0)
        .map(|s| (s.now + s.wait, s.cost))
        .collect();
    for i in 0..admitted.len() {
        let mut sum = 0;
        for j in i..admitted.len() {
            sum += admitted[j].1;
            let span = admitted[j].0 - admitted[i].0;
            let bound = burst + span / interval * per_interval;
            assert!(
                sum <= bound,
                "{sum} units admitted in {span}us, bound {bound} (burst {burst}, one per {interval}us)"
            );
        }
    }
}

/// Units admitted in any window `(t - w, t]` stay within `limit`.
fn assert_window_bound(steps: &[Step], window: u64, limit: u64) {
    let admitted: Vec<&Step> = steps.iter().filter(|s| s.allowed && s.cost > 0).collect();
    for (j, last) in admitted.iter().enumerate() {
        let sum: u64 = admitted[..=j]
            .iter()
            .filter(|s| s.now + window > last.now)
            .map(|s| s.cost)
            .sum();
        assert!(
            sum <= limit,
            "{sum} admitted within {window}us, limit {limit}"
        );
    }
}

/// The retry, reset and remaining promises of every decision.
fn assert_promises(kind: &Kind, events: &[Event], max_wait: u64) {
    let mut state = kind.fresh();
    let mut now = T0;
    for (i, e) in events.iter().enumerate() {
        now += e.gap;
        let ctx = Ctx {
            now,
            cost: e.cost,
            max_wait,
            lease: i as u64 + 1,
        };
        let before: State = state.clone();
        let d = kind.check(&mut state, &ctx).decision;
        assert!(d.remaining <= d.limit, "{d:?}");

        // Waiting retry_after admits the same request (nothing else happening meanwhile).
        if let Some(retry) = d.retry_after {
            assert!(!d.allowed);
            let later = Ctx {
                now: now + retry.as_micros() as u64,
                ..ctx
            };
            let again = kind.decide(&before, &later).decision;
            assert!(
                again.allowed,
                "denied after waiting {retry:?}: {d:?} then {again:?}"
            );
        } else if !d.allowed {
            assert!(
                e.cost > d.limit,
                "no retry time for a cost that fits: {d:?}"
            );
        }

        // At reset_after the state is full again.
        let reset_at = now + d.reset_after.as_micros() as u64;
        assert!(
            kind.expires_at(&state) <= reset_at,
            "state outlives reset_after: {d:?}"
        );
        let peek = kind
            .decide(
                &state,
                &Ctx {
                    now: reset_at,
                    cost: 0,
                    ..ctx
                },
            )
            .decision;
        assert_eq!(peek.remaining, peek.limit, "not full at reset_after: {d:?}");

        // `remaining` is exact: that many unit requests fit now, one more does not.
        let mut probe = state.clone();
        for k in 0..d.remaining.min(64) {
            let c = Ctx {
                cost: 1,
                lease: 1_000_000 + k,
                ..ctx
            };
            assert!(
                kind.check(&mut probe, &c).decision.allowed,
                "remaining {} but unit {k} denied",
                d.remaining
            );
        }
        if d.remaining <= 64 {
            let c = Ctx {
                cost: 1,
                lease: 2_000_000,
                ..ctx
            };
            assert!(
                !kind.check(&mut probe, &c).decision.allowed,
                "more than remaining {} admitted",
                d.remaining
            );
        }
    }
}

fn ms(lo: u64, hi: u64) -> impl Strategy<Value = u64> {
    (lo..=hi).prop_map(|v| v * 1_000)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn gcra(burst in 0u64..10, count in 1u64..20, period in ms(1, 10_000), evs in events(2_000_000, 3)) {
        let p = Policy::gcra(burst, count, Duration::from_micros(period)).expect("valid");
        let Kind::Gcra(g) = *p.kind() else { unreachable!() };
        assert_rate_bound(&run(p.kind(), &evs, 0), g.limit(), g.emission_us(), 1);
        assert_promises(p.kind(), &evs, 0);
    }

    #[test]
    fn funnel_is_gcra(cap in 1u64..10, drain in ms(1, 10_000), evs in events(2_000_000, 3)) {
        let f = Policy::funnel(cap, Duration::from_micros(drain)).expect("valid");
        let g = Policy::per(cap, Duration::from_micros(drain)).expect("valid");
        let a = run(f.kind(), &evs, 0);
        let b = run(g.kind(), &evs, 0);
        let (mut sf, mut sg) = (f.kind().fresh(), g.kind().fresh());
        let mut now = T0;
        for e in &evs {
            now += e.gap;
            let ctx = Ctx::new(now, e.cost);
            prop_assert_eq!(f.kind().check(&mut sf, &ctx), g.kind().check(&mut sg, &ctx));
        }
        prop_assert_eq!(a.len(), b.len());
        assert_promises(f.kind(), &evs, 0);
    }

    #[test]
    fn funnel_is_gcra_when_the_clock_steps_back(
        cap in 1u64..10,
        drain in ms(1, 10_000),
        evs in events(2_000_000, 3),
        backs in prop::collection::vec(prop_oneof![4 => Just(0u64), 1 => 0..6_000_000u64], 150),
        refunds in prop::collection::vec(prop_oneof![3 => Just(0usize), 1 => 1..6usize], 150),
    ) {
        // Both read a state ahead of the clock the same way: it drains from the tat (the
        // funnel's `at + level`), and one more than twice the tolerance (a full funnel's drain
        // time) ahead reads as none. A refund of an earlier allowed check (`k` checks back, as
        // of now, or of the check's time when the clock is now behind it) takes the same off
        // both.
        let f = Policy::funnel(cap, Duration::from_micros(drain)).expect("valid");
        let g = Policy::per(cap, Duration::from_micros(drain)).expect("valid");
        let (mut sf, mut sg) = (f.kind().fresh(), g.kind().fresh());
        let mut now = T0;
        let mut allowed: Vec<(u64, u64, u64)> = Vec::new();
        for ((e, back), k) in evs.iter().zip(&backs).zip(&refunds) {
            now = now - back + e.gap;
            if *k > 0 && *k <= allowed.len() {
                let (at, cost, reset_after) = allowed.remove(allowed.len() - k);
                let undo = Undo { at, now: now.max(at), cost, lease: 0, reset_after };
                f.kind().undo(&mut sf, &undo);
                g.kind().undo(&mut sg, &undo);
            }
            let ctx = Ctx::new(now, e.cost);
            let (a, b) = (f.kind().check(&mut sf, &ctx), g.kind().check(&mut sg, &ctx));
            prop_assert_eq!(a, b);
            if a.decision.allowed && e.cost > 0 {
                let reset = u64::try_from(a.decision.reset_after.as_micros()).unwrap_or(u64::MAX);
                allowed.push((now, e.cost, reset));
            }
        }
    }

    #[test]
    fn token_bucket_greedy_is_gcra(cap in 1u64..10, amount in 1u64..10, interval in ms(1, 10_000), evs in events(2_000_000, 3)) {
        let t = Policy::token_bucket(cap, amount, Duration::from_micros(interval)).expect("valid");
        let g = Policy::per(amount, Duration::from_micros(interval))
            .and_then(|p| p.with_burst(cap))
            .expect("valid");
        let (mut st, mut sg) = (t.kind().fresh(), g.kind().fresh());
        let mut now = T0;
        for e in &evs {
            now += e.gap;
            let ctx = Ctx::new(now, e.cost);
            let (dt, dg) = (t.kind().check(&mut st, &ctx).decision, g.kind().check(&mut sg, &ctx).decision);
            prop_assert_eq!(dt.allowed, dg.allowed, "at {}: {:?} vs {:?}", now - T0, dt, dg);
            prop_assert_eq!(dt.remaining, dg.remaining);
        }
        let Kind::TokenBucket(_) = *t.kind() else { unreachable!() };
        let step = interval.div_ceil(amount);
        assert_rate_bound(&run(t.kind(), &evs, 0), cap, step, 1);
        assert_promises(t.kind(), &evs, 0);
    }

    #[test]
    fn token_bucket_intervally(cap in 1u64..10, amount in 1u64..10, interval in ms(1, 5_000), evs in events(2_000_000, 3)) {
        let t = Policy::token_bucket_intervally(cap, amount, Duration::from_micros(interval)).expect("valid");
        // One more refill can land inside any window than whole intervals fit in it.
        assert_rate_bound(&run(t.kind(), &evs, 0), cap + amount, interval, amount);
        assert_promises(t.kind(), &evs, 0);
    }

    #[test]
    fn shaper_try_acquire_is_gcra(burst in 1u64..10, count in 1u64..20, period in ms(1, 10_000), evs in events(2_000_000, 3)) {
        let s = Policy::shaper(count, Duration::from_micros(period)).and_then(|p| p.with_burst(burst)).expect("valid");
        let g = Policy::per(count, Duration::from_micros(period))
            .and_then(|p| p.with_burst(burst))
            .expect("valid");
        let (mut ss, mut sg) = (s.kind().fresh(), g.kind().fresh());
        let mut now = T0;
        for e in &evs {
            now += e.gap;
            let ctx = Ctx::new(now, e.cost);
            prop_assert_eq!(s.kind().check(&mut ss, &ctx), g.kind().check(&mut sg, &ctx));
        }
    }

    #[test]
    fn shaper_departures_keep_the_rate(burst in 1u64..5, count in 1u64..20, period in ms(1, 5_000), max_wait in ms(0, 5_000), evs in events(1_000_000, 2)) {
        let s = Policy::shaper(count, Duration::from_micros(period)).and_then(|p| p.with_burst(burst)).expect("valid");
        let Kind::Shaper(sh) = *s.kind() else { unreachable!() };
        let steps = run(s.kind(), &evs, max_wait);
        for st in &steps {
            prop_assert!(st.wait <= max_wait, "waited {} > {}", st.wait, max_wait);
        }
        // Departures (arrival + wait) obey the rate. A request of cost q leaves when its last
        // unit conforms; its units are spread one interval apart before that.
        let t = sh.interval_us();
        let mut units: Vec<Step> = steps
            .iter()
            .filter(|s| s.allowed)
            .flat_map(|s| {
                (0..s.cost).map(move |k| Step {
                    now: s.now + s.wait - t * (s.cost - 1 - k),
                    cost: 1,
                    allowed: true,
                    wait: 0,
                })
            })
            .collect();
        units.sort_by_key(|s| s.now);
        assert_rate_bound(&units, burst, t, 1);
        assert_promises(s.kind(), &evs, max_wait);
    }

    /// A client that asks every microsecond, against `count` per `period` with a burst:
    /// no window of one `period` admits more than the burst and `count - 1` more, for periods
    /// that `count` does not divide too (where spacing rounded down fits one more).
    #[test]
    fn rate_policies_keep_their_promise_in_any_window(
        count in 1u64..12,
        burst in 1u64..6,
        extra in 0u64..3_000,
        which in 0usize..4,
    ) {
        let period = count + extra;
        let p = Duration::from_micros(period);
        let (policy, burst) = match which {
            0 => (Policy::per(count, p).and_then(|x| x.with_burst(burst)), burst),
            1 => (Policy::funnel(count, p), count),
            2 => (Policy::shaper(count, p).and_then(|x| x.with_burst(burst)), burst),
            _ => (Policy::token_bucket(burst, count, p), burst),
        };
        let policy = policy.expect("valid");
        let mut state = policy.kind().fresh();
        let mut admitted: Vec<u64> = Vec::new();
        for now in T0..T0 + 3 * period {
            let out = policy.kind().check(&mut state, &Ctx::new(now, 1));
            if out.decision.allowed {
                admitted.push(now);
            }
        }
        let bound = burst + count - 1;
        for (j, &last) in admitted.iter().enumerate() {
            let inside = admitted[..=j].iter().filter(|&&t| t + period > last).count() as u64;
            prop_assert!(
                inside <= bound,
                "{:?}: {} admitted in ({}, {}], bound {}", policy.kind(), inside, last - period, last, bound
            );
        }
    }

    #[test]
    fn fixed_window_rolling(limit in 1u64..10, window in ms(1, 10_000), evs in events(5_000_000, 3)) {
        let p = Policy::fixed_window(limit, Duration::from_micros(window)).expect("valid");
        let steps = run(p.kind(), &evs, 0);
        // Windows open at the first admission at or after the previous window's end.
        let mut start = None::<u64>;
        let mut sum = 0;
        for s in steps.iter().filter(|s| s.allowed && s.cost > 0) {
            if start.is_none_or(|st| s.now >= st + window) {
                start = Some(s.now);
                sum = 0;
            }
            sum += s.cost;
            prop_assert!(sum <= limit);
        }
        assert_promises(p.kind(), &evs, 0);
    }

    #[test]
    fn fixed_window_calendar(limit in 1u64..10, unit in 0usize..4, offset_h in -14i32..=14, evs in events(30_000_000, 3)) {
        let (n, unit) = [(1, CalendarUnit::Second), (15, CalendarUnit::Second), (1, CalendarUnit::Minute), (5, CalendarUnit::Minute)][unit];
        let p = Policy::calendar_window(limit, n, unit).and_then(|p| p.with_utc_offset(offset_h * 3600)).expect("valid");
        let Kind::FixedWindow(fw) = *p.kind() else { unreachable!() };
        let Window::Calendar(cal) = fw.window() else { unreachable!() };
        let steps = run(p.kind(), &evs, 0);
        let mut per_window = std::collections::HashMap::<u64, u64>::new();
        for s in steps.iter().filter(|s| s.allowed) {
            let w = per_window.entry(cal.bounds(s.now).0).or_default();
            *w += s.cost;
            prop_assert!(*w <= limit, "{} in one calendar window", w);
        }
        assert_promises(p.kind(), &evs, 0);
    }

    #[test]
    fn calendar_months_and_weeks(limit in 1u64..5, monthly in any::<bool>(), evs in events(86_400_000_000 * 9, 2)) {
        let unit = if monthly { CalendarUnit::Month } else { CalendarUnit::Week };
        let p = Policy::calendar_window(limit, 1, unit).and_then(|p| p.with_utc_offset(8 * 3600)).expect("valid");
        let cal = Calendar::new(1, unit).and_then(|c| c.with_utc_offset(8 * 3600)).expect("valid");
        let steps = run(p.kind(), &evs, 0);
        let mut per_window = std::collections::HashMap::<u64, u64>::new();
        for s in steps.iter().filter(|s| s.allowed) {
            let (start, end) = cal.bounds(s.now);
            prop_assert!(start <= s.now && s.now < end);
            let w = per_window.entry(start).or_default();
            *w += s.cost;
            prop_assert!(*w <= limit);
        }
        assert_promises(p.kind(), &evs, 0);
    }

    #[test]
    fn sliding_log(limit in 1u64..10, window in ms(1, 10_000), evs in events(3_000_000, 3)) {
        let p = Policy::sliding_log(limit, Duration::from_micros(window)).expect("valid");
        assert_window_bound(&run(p.kind(), &evs, 0), window, limit);
        assert_promises(p.kind(), &evs, 0);
    }

    #[test]
    fn sliding_window(limit in 1u64..10, window in ms(1, 10_000), evs in events(3_000_000, 3)) {
        let p = Policy::sliding_window(limit, Duration::from_micros(window)).expect("valid");
        let steps = run(p.kind(), &evs, 0);
        // Never more than the limit in an aligned window, nor twice the limit in any window.
        let mut per_window = std::collections::HashMap::<u64, u64>::new();
        for s in steps.iter().filter(|s| s.allowed) {
            let w = per_window.entry(s.now - s.now % window).or_default();
            *w += s.cost;
            prop_assert!(*w <= limit);
        }
        assert_window_bound(&steps, window, 2 * limit);
        assert_promises(p.kind(), &evs, 0);
    }

    #[test]
    fn concurrency(limit in 1u64..6, ttl in ms(1, 5_000), evs in events(2_000_000, 2), releases in prop::collection::vec(any::<bool>(), 150)) {
        let p = Policy::concurrency(limit, Duration::from_micros(ttl)).expect("valid");
        let Kind::Concurrency(c) = *p.kind() else { unreachable!() };
        let mut state = p.kind().fresh();
        let mut held: Vec<(u64, u64, u64)> = Vec::new(); // (id, expires, cost)
        let mut now = T0;
        for (i, (e, release)) in evs.iter().zip(&releases).enumerate() {
            now += e.gap;
            if *release && !held.is_empty() {
                let (id, _, _) = held.remove(0);
                if let State::Concurrency(st) = &mut state {
                    c.release(st, id, now);
                }
            }
            let ctx = Ctx { now, cost: e.cost, max_wait: 0, lease: i as u64 + 1 };
            let d = p.kind().check(&mut state, &ctx).decision;
            if d.allowed && e.cost > 0 {
                held.push((ctx.lease, now + ttl, e.cost));
            }
            held.retain(|h| h.1 > now);
            let in_flight: u64 = held.iter().map(|h| h.2).sum();
            prop_assert!(in_flight <= limit, "{} in flight, limit {}", in_flight, limit);
        }
        assert_promises(p.kind(), &evs, 0);
    }
}
