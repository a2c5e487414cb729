//! `Limiter::refund` against real Redis: the SMS story behind the deny cache, a check across
//! cluster slots, and a corrupted state (a clear error, nothing written). The conformance suite
//! checks that refunds decide alike on both backends.

mod support;

use std::time::Duration;

use floodgate_core::{Check, CheckOptions, DenyCache, Limiter, Policy};
use floodgate_redis::keys::key_slot;
use floodgate_redis::{ConnectionKind, RedisLimiter};

use support::{cluster, cluster_limiter, keys_on_two_nodes, limiter, run, server};

const LIMIT: Duration = Duration::from_secs(120);

/// "One SMS per phone per 30 minutes", the provider refused the message, and the deny cache
/// had remembered that the check spent the phone's only unit.
#[test]
fn a_refund_gives_the_phone_its_message_back_behind_the_deny_cache() {
    let server = server();
    run(LIMIT, async {
        let kinds = [
            ConnectionKind::Multiplexed,
            ConnectionKind::Pool { size: 2 },
        ];
        for (n, kind) in kinds.into_iter().enumerate() {
            let redis = DenyCache::new(limiter(&server.url(), kind).await);
            let phone = Policy::funnel(1, Duration::from_secs(30 * 60)).expect("valid");
            let number = format!("+1555010{n}");
            let checks = [Check::new(number.as_bytes(), &phone)];
            let sent = redis
                .check(&checks, CheckOptions::default())
                .await
                .expect("checks");
            assert!(sent.allowed());
            let denied = redis
                .check(&checks, CheckOptions::default())
                .await
                .expect("checks");
            assert!(!denied.allowed());
            // A denied verdict gives nothing back.
            redis.refund(&checks, &denied).await.expect("refunds");
            redis.refund(&checks, &sent).await.expect("refunds");
            let again = redis
                .check(&checks, CheckOptions::default())
                .await
                .expect("checks");
            assert!(again.allowed(), "{kind:?}: {again:?}");
            let after = redis
                .check(&checks, CheckOptions::default())
                .await
                .expect("checks");
            assert!(
                !after.allowed(),
                "{kind:?}: one refund gave back more than one"
            );
        }
    });
}

fn one_a_minute(name: &str) -> Policy {
    Policy::per_minute(1)
        .and_then(|p| p.named(name))
        .expect("valid")
}

/// Each of `checks` has its unit back: checked on its own, it is allowed.
async fn assert_units_back(redis: &RedisLimiter, checks: &[Check<'_>], why: &str) {
    for c in checks {
        let d = redis.check_one(c.key, c.policy, 1).await.expect("checks");
        assert!(
            d.allowed,
            "{why}: {:?} {d:?}",
            String::from_utf8_lossy(c.key)
        );
    }
}

/// A check whose keys live in different cluster slots is refunded in each of them.
#[test]
fn a_check_across_slots_is_refunded_in_every_slot() {
    let cluster = cluster();
    run(LIMIT, async {
        let redis = cluster_limiter(&cluster).await;
        let (a, b) = (one_a_minute("per-phone"), one_a_minute("per-ip"));
        let first = b"+15550100".as_slice();
        let slot = key_slot(&redis.state_key(&a, first));
        let other = (0..1_000)
            .map(|i| format!("10.0.0.{i}"))
            .find(|k| key_slot(&redis.state_key(&b, k.as_bytes())) != slot)
            .expect("a key in another slot");
        let checks = [Check::new(first, &a), Check::new(other.as_bytes(), &b)];
        let sent = redis
            .check(&checks, CheckOptions::default())
            .await
            .expect("checks");
        assert!(sent.allowed());
        redis.refund(&checks, &sent).await.expect("refunds");
        assert_units_back(&redis, &checks, "refunded").await;
    });
}

/// A check across slots whose later part is a sliding log or a rolling window (the SMS
/// gateway's per-phone log beside a per-IP limit): the refund finds the log's entry and the
/// window the check opened, on the later node too.
#[test]
fn a_check_across_slots_is_refunded_in_a_later_log_and_window() {
    let cluster = cluster();
    run(LIMIT, async {
        let redis = cluster_limiter(&cluster).await;
        let a = one_a_minute("per-ip");
        let log = Policy::sliding_log(1, Duration::from_secs(60))
            .and_then(|p| p.named("per-phone-log"))
            .expect("valid");
        let window = Policy::fixed_window(1, Duration::from_secs(60))
            .and_then(|p| p.named("per-phone-window"))
            .expect("valid");
        for (n, later) in [&log, &window].into_iter().enumerate() {
            let first = format!("10.0.0.{n}");
            let slot = key_slot(&redis.state_key(&a, first.as_bytes()));
            // Parts run in slot order: the later policy's key in a higher slot.
            let phone = (0..10_000)
                .map(|i| format!("+1555{i:06}"))
                .find(|k| key_slot(&redis.state_key(later, k.as_bytes())) > slot)
                .expect("a key in a later slot");
            let checks = [
                Check::new(first.as_bytes(), &a),
                Check::new(phone.as_bytes(), later),
            ];
            let sent = redis
                .check(&checks, CheckOptions::default())
                .await
                .expect("checks");
            assert!(sent.allowed(), "{sent:?}");
            redis.refund(&checks, &sent).await.expect("refunds");
            assert_units_back(&redis, &checks, later.name()).await;
        }
    });
}

/// The parts of a check across slots run one after the other, GCRA parts each as of its node's
/// time. A refund gives each part its units back even when the later part ran well after the
/// first (here 300 ms, its node paused meanwhile): its reset time counts from the verdict's
/// time.
#[test]
fn a_check_across_slots_whose_parts_ran_apart_is_refunded_in_full() {
    let cluster = cluster();
    run(LIMIT, async {
        let redis = cluster_limiter(&cluster).await;
        let (a, b) = (one_a_minute("per-phone"), one_a_minute("per-ip"));
        let (phone, other, later) = keys_on_two_nodes(&redis, &cluster, &a, &b);
        let first = phone.as_bytes();
        let checks = [Check::new(first, &a), Check::new(other.as_bytes(), &b)];
        cluster.node(later).pause().expect("pause");
        let (sent, resumed) = tokio::join!(redis.check(&checks, CheckOptions::default()), async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            cluster.node(later).resume()
        });
        resumed.expect("resume");
        let sent = sent.expect("checks");
        assert!(sent.allowed());
        // The later part's reset time counts from the first part's time.
        assert!(
            sent.decisions[1].reset_after >= Duration::from_millis(60_250),
            "{:?}",
            sent.decisions[1]
        );
        redis.refund(&checks, &sent).await.expect("refunds");
        // At once: the later part got back more than what it would have drained by itself.
        assert_units_back(&redis, &checks, "refunded at once").await;
    });
}

/// A check across slots that its first part denies is denied, even when a later part's node
/// hangs (its dry run never answers): an error there would let a layer that fails open admit
/// the request. The part never reached reports what its policy decides with nothing counted,
/// and counts nothing.
#[test]
fn fault_a_cluster_check_denied_by_its_first_part_stays_denied_when_a_later_node_hangs() {
    let cluster = cluster();
    run(LIMIT, async {
        let redis = cluster_limiter(&cluster).await;
        let (a, b) = (one_a_minute("per-phone"), one_a_minute("per-ip"));
        let (phone, other, later) = keys_on_two_nodes(&redis, &cluster, &a, &b);
        let spent = redis
            .check(&[Check::new(phone.as_bytes(), &a)], CheckOptions::default())
            .await
            .expect("checks");
        assert!(spent.allowed());
        let checks = [
            Check::new(phone.as_bytes(), &a),
            Check::new(other.as_bytes(), &b),
        ];
        cluster.node(later).pause().expect("pause");
        let verdict = redis.check(&checks, CheckOptions::default()).await;
        cluster.node(later).resume().expect("resume");
        let verdict = verdict.expect("a denial, not an error");
        assert!(!verdict.allowed());
        assert!(!verdict.decisions[0].allowed, "{:?}", verdict.decisions[0]);
        assert!(verdict.decisions[0].retry_after.is_some());
        let never_reached = verdict.decisions[1];
        assert!(never_reached.allowed, "{never_reached:?}");
        assert_eq!((never_reached.limit, never_reached.remaining), (1, 0));
        // The later key was not counted: checked on its own, it is allowed.
        let alone = redis
            .check(&[Check::new(other.as_bytes(), &b)], CheckOptions::default())
            .await
            .expect("checks");
        assert!(alone.allowed());
    });
}

/// A state someone else overwrote with garbage: the refund says so, naming the key, and
/// leaves the key as it found it.
#[test]
fn a_refund_of_a_corrupted_state_is_a_typed_error_and_writes_nothing() {
    let server = server();
    run(LIMIT, async {
        let redis = limiter(&server.url(), ConnectionKind::Multiplexed).await;
        let p = Policy::per_minute(1).expect("valid");
        let checks = [Check::new(b"victim".as_slice(), &p)];
        let sent = redis
            .check(&checks, CheckOptions::default())
            .await
            .expect("checks");
        assert!(sent.allowed());
        let key = redis.state_key(&p, b"victim");
        server
            .cmd(&[b"SET".as_slice(), &key, b"not-a-number"])
            .expect("set");
        let err = redis
            .refund(&checks, &sent)
            .await
            .expect_err("garbage must not be refunded");
        assert!(err.is_corrupted(), "{err:?}");
        assert!(
            err.to_string()
                .contains(String::from_utf8_lossy(&key).as_ref()),
            "{err}"
        );
        let left = server.cmd(&[b"GET".as_slice(), &key]).expect("get");
        assert_eq!(left.as_bytes(), Some(b"not-a-number".as_slice()));
    });
}

/// A refund of part of a log entry (a unit of a lease that `Leasing` spent locally) takes its
/// cost off that entry, as the memory backend's merged entry does.
#[test]
fn a_partial_refund_of_a_log_entry_takes_its_cost_off() {
    let server = server();
    run(LIMIT, async {
        let redis = limiter(&server.url(), ConnectionKind::Multiplexed).await;
        partial_log_refund(&redis, "redis").await;
        partial_log_refund(&floodgate_core::MemoryLimiter::new(), "memory").await;

        // The entry that was cut down was the log's only one: the log still expires with its
        // window (an entry removed before its smaller self was added emptied the set, and the
        // set made anew had no TTL: it stayed in Redis for good).
        let log = Policy::sliding_log(5, Duration::from_secs(60)).expect("valid");
        let lease = [Check::new(b"alone", &log).cost(3)];
        let v = redis
            .check(&lease, CheckOptions::default())
            .await
            .expect("checks");
        redis
            .refund(&[Check::new(b"alone", &log)], &v)
            .await
            .expect("refunds");
        let key = redis.state_key(&log, b"alone");
        let ttl = server
            .cmd(&[b"PTTL".as_slice(), &key])
            .expect("PTTL")
            .as_int()
            .expect("an integer");
        assert!(ttl > 0 && ttl <= 120_000, "a TTL of {ttl} ms");
    });
}

async fn partial_log_refund<L: Limiter>(store: &L, name: &str) {
    let log = Policy::sliding_log(5, Duration::from_secs(60)).expect("valid");
    let lease = [Check::new(b"leased", &log).cost(3)];
    let unit = [Check::new(b"leased", &log)];
    let two = [Check::new(b"leased", &log).cost(2)];
    let peek = [Check::new(b"leased", &log).cost(0)];
    let left = || async {
        let v = store
            .check(&peek, CheckOptions::default())
            .await
            .expect("peeks");
        v.decisions[0].remaining
    };
    let v = store
        .check(&lease, CheckOptions::default())
        .await
        .expect("checks");
    assert_eq!(v.decisions[0].remaining, 2, "{name}");
    store.refund(&unit, &v).await.expect("refunds");
    assert_eq!(left().await, 3, "{name}: one unit back");
    store.refund(&two, &v).await.expect("refunds");
    assert_eq!(left().await, 5, "{name}: the rest back");
}

/// A refund on the server's clock keeps a state no longer than it matters: its TTL is the
/// state's remaining time, without the minute of slack that injected times get.
#[test]
fn a_refund_keeps_the_state_no_longer_than_it_matters() {
    let server = server();
    run(LIMIT, async {
        let redis = limiter(&server.url(), ConnectionKind::Multiplexed).await;
        // 5 per minute: each check holds 12 s of the key's state.
        let gcra = Policy::per_minute(5).expect("valid");
        let checks = [Check::new(b"refunded".as_slice(), &gcra).cost(2)];
        let first = redis
            .check(&checks, CheckOptions::default())
            .await
            .expect("checks");
        let second = redis
            .check(&checks, CheckOptions::default())
            .await
            .expect("checks");
        assert!(first.allowed() && second.allowed());
        redis.refund(&checks, &second).await.expect("refunds");
        let key = redis.state_key(&gcra, b"refunded");
        let ttl = server
            .cmd(&[b"PTTL".as_slice(), &key])
            .expect("PTTL")
            .as_int()
            .expect("an integer");
        // What the first check left: 24 s.
        assert!(ttl > 22_000 && ttl <= 24_000, "a TTL of {ttl} ms");
    });
}
