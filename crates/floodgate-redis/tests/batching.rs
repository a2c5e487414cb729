//! Batching against a real Redis: checks issued together go out as few script calls, a hot
//! key is read and written once per call however many of the batch's checks it has, and the
//! decisions are exactly those of the checks made one by one.

mod support;

use std::time::Duration;

use floodgate_core::{Check, CheckOptions, Limiter, MemoryLimiter, Policy, Timestamp};
use floodgate_redis::{BatchConfig, ConnectionKind, RedisConfig, RedisLimiter};
use futures_util::future::join_all;
use support::{command_calls, limiter, run, server};

const HOUR: Duration = Duration::from_secs(3_600);

/// A limiter with one script call in flight at a time: calls in flight together are sent by
/// separate tasks, in no set order (as concurrent callers' checks have none). One at a time
/// keeps the order the checks were issued in, so they can be compared with the same checks
/// made one by one.
async fn in_order(server: &floodgate_testkit::RedisServer) -> RedisLimiter {
    let config = RedisConfig::new(&server.url()).expect("valid URL");
    let batching = BatchConfig {
        max_in_flight: 1,
        ..BatchConfig::default()
    };
    support::limiter_batching(&config, batching).await
}

/// A valid policy under `name`.
fn named(policy: Result<Policy, floodgate_core::PolicyError>, name: &str) -> Policy {
    policy.and_then(|p| p.named(name)).expect("valid")
}

/// 300 checks of one key issued at once: exactly the burst of 50 is admitted, the state is
/// written (the next check is denied, the key has a TTL), and Redis ran far fewer `GET`s and
/// `SET`s than there were checks, at most one of each per script call.
#[test]
fn checks_of_one_hot_key_in_a_batch_read_and_write_it_once_per_call() {
    let server = server();
    run(Duration::from_secs(30), async {
        let limiter = limiter(&server.url(), ConnectionKind::Multiplexed).await;
        let policy = Policy::gcra(49, 1, HOUR).expect("valid");
        // Load the script first, so that every call below runs it.
        limiter
            .check_one(b"warm-up", &policy, 1)
            .await
            .expect("warm-up");
        let reads = || command_calls(&server, "get") + command_calls(&server, "mget");
        let (calls0, gets0, sets0) = (
            command_calls(&server, "evalsha"),
            reads(),
            command_calls(&server, "set"),
        );
        let checks = (0..300).map(|_| limiter.check_one(b"hot", &policy, 1));
        let decisions = join_all(checks).await;
        let admitted = decisions
            .iter()
            .map(|d| d.as_ref().expect("decided"))
            .filter(|d| d.allowed)
            .count();
        assert_eq!(admitted, 50, "the burst is 50");
        let calls = command_calls(&server, "evalsha") - calls0;
        let gets = reads() - gets0;
        let sets = command_calls(&server, "set") - sets0;
        assert!(
            calls < 100,
            "300 concurrent checks took {calls} script calls"
        );
        assert!(gets <= calls, "{gets} GETs and MGETs in {calls} calls");
        assert!(sets <= calls, "{sets} SETs in {calls} calls");

        let after = limiter
            .check_one(b"hot", &policy, 1)
            .await
            .expect("decided");
        assert!(!after.allowed, "the 50 admitted were not written");
        let key = limiter.state_key(&policy, b"hot");
        let ttl = server.cmd(&[b"PTTL".as_slice(), &key]).expect("PTTL");
        assert!(
            matches!(ttl, floodgate_testkit::Resp::Int(ms) if ms > 0),
            "no TTL: {ttl:?}"
        );
    });
}

/// A batch mixing one-check groups, two-policy groups and dry runs of the same key: the
/// two-policy groups and the one-check groups count against the same budget of 50, whichever
/// order the batch runs them in, and nothing is admitted beyond it.
#[test]
fn a_batch_mixing_single_checks_and_groups_of_one_key_admits_exactly_the_budget() {
    let server = server();
    run(Duration::from_secs(30), async {
        let limiter = limiter(&server.url(), ConnectionKind::Multiplexed).await;
        let tight = Policy::gcra(49, 1, HOUR)
            .and_then(|p| p.named("tight"))
            .expect("valid");
        let loose = Policy::gcra(99_999, 1, HOUR)
            .and_then(|p| p.named("loose"))
            .expect("valid");
        let fixed = Policy::fixed_window(1_000_000, HOUR).expect("valid");
        limiter
            .check_one(b"warm-up", &tight, 1)
            .await
            .expect("warm-up");
        // Interleaved, so that groups run between single checks of the same key in a batch.
        let single = [Check::new(b"hot", &tight)];
        let pair = [Check::new(b"hot", &tight), Check::new(b"hot", &loose)];
        // Another algorithm in the same batch: the batch runs the script with every algorithm.
        let mixed = [Check::new(b"hot", &tight), Check::new(b"hot", &fixed)];
        let opts = CheckOptions::default();
        let all = join_all((0..300).map(|i| match i % 4 {
            0 => limiter.check(&pair, opts),
            1 => limiter.check(&mixed, opts),
            _ => limiter.check(&single, opts),
        }))
        .await;
        let admitted = all
            .iter()
            .map(|v| v.as_ref().expect("decided"))
            .filter(|v| v.allowed())
            .count();
        assert_eq!(admitted, 50, "tight's budget is 50");
        // The loose and fixed policies counted only the admitted groups.
        let loose_left = limiter
            .check(&[Check::new(b"hot", &loose).cost(0)], opts)
            .await
            .expect("peek");
        let fixed_left = limiter
            .check(&[Check::new(b"hot", &fixed).cost(0)], opts)
            .await
            .expect("peek");
        let counted = (100_000 - loose_left.decisions[0].remaining)
            + (1_000_000 - fixed_left.decisions[0].remaining);
        let groups_admitted = all
            .iter()
            .step_by(4)
            .chain(all.iter().skip(1).step_by(4))
            .flatten()
            .filter(|v| v.allowed())
            .count();
        assert_eq!(counted, groups_admitted as u64);
    });
}

/// Random checks issued at once (so that the batches hold many checks of the same keys: plain
/// ones, peeks of cost 0, costs above 1, two-policy groups, another algorithm) decide exactly
/// as the same checks made one by one, in the same order, by the in-memory limiter at the same
/// instant. Without the flush of GCRA's remembered state before the other paths, or with a
/// stale read of it, the decisions differ.
#[test]
fn a_concurrent_batch_decides_as_the_same_checks_one_by_one() {
    let server = server();
    run(Duration::from_secs(60), async {
        let limiter = in_order(&server).await;
        let policies = [
            named(Policy::gcra(4, 1, HOUR), "a"),
            named(Policy::gcra(9, 10, Duration::from_secs(1)), "b"),
            named(Policy::token_bucket(6, 1, HOUR), "c"),
        ];
        let at = Timestamp::from_micros(1_709_214_330_000_000);
        for seed in 0..20u64 {
            let mut rng = fastrand::Rng::with_seed(seed);
            let memory = MemoryLimiter::new();
            // (key, policies, cost) per check; the keys differ per seed.
            let plan: Vec<(Vec<u8>, Vec<usize>, u64)> = (0..200)
                .map(|_| {
                    let key = format!("s{seed}-k{}", rng.u8(0..3)).into_bytes();
                    let chosen = match rng.u8(0..10) {
                        0..=5 => vec![0],
                        6 => vec![1],
                        7 => vec![0, 1],
                        8 => vec![0, 2],
                        _ => vec![2],
                    };
                    let cost = [0, 1, 1, 1, 2, 5][rng.usize(0..6)];
                    (key, chosen, cost)
                })
                .collect();
            let checks: Vec<Vec<Check<'_>>> = plan
                .iter()
                .map(|(key, chosen, cost)| {
                    chosen
                        .iter()
                        .map(|&i| Check::new(key, &policies[i]).cost(*cost))
                        .collect()
                })
                .collect();
            let opts = CheckOptions::at(at);
            // Unconstrained: tokio's cooperative budget would make some checks yield before
            // they queue, and queue after later ones.
            let batched =
                tokio::task::unconstrained(join_all(checks.iter().map(|c| limiter.check(c, opts))))
                    .await;
            for (i, (c, got)) in checks.iter().zip(&batched).enumerate() {
                let got = got.as_ref().expect("decided");
                let want = memory.check_sync(c, opts).expect("decided");
                assert_eq!(
                    got.decisions, want.decisions,
                    "seed {seed}, check {i} of {:?}: Redis (batched) against memory",
                    plan[i]
                );
            }
        }
    });
}

/// A batch of plain GCRA checks (one policy each, cost 1: the checks most services make) runs
/// the GCRA batch script: every key read with one `MGET`, no `GET`, each changed key written
/// once, and the decisions replayed by the client. Over four policies (two of one name), keys
/// checked once and many times in a batch, and states left at random times before, it decides
/// exactly as the in-memory limiter making the same checks one by one, and leaves the same
/// states behind.
#[test]
fn plain_gcra_batches_decide_and_store_as_the_checks_one_by_one() {
    let server = server();
    run(Duration::from_secs(60), async {
        let limiter = in_order(&server).await;
        let policies = [
            named(Policy::gcra(4, 1, Duration::from_secs(10)), "a"),
            named(Policy::gcra(0, 3, Duration::from_secs(1)), "b"),
            named(Policy::gcra(19, 7, Duration::from_millis(1_300)), "c"),
            // Another policy named "a": it shares a's state with other parameters, so a batch
            // holding both on one key takes the general script.
            named(Policy::gcra(1, 5, Duration::from_secs(10)), "a"),
        ];
        let t0 = 1_709_214_330_000_000u64;
        // GETs and MGETs of the batches (the peeks below read with GET).
        let (mut gets, mut mgets, mut batches) = (0, 0, 0);
        for seed in 0..15u64 {
            let mut rng = fastrand::Rng::with_seed(seed);
            let memory = MemoryLimiter::new();
            let keys: Vec<Vec<u8>> = (0..8)
                .map(|k| format!("s{seed}-k{k}").into_bytes())
                .collect();
            // Rounds of checks, each round issued at once at its own instant, a random time
            // after the previous one: later rounds find states of every age.
            let mut at = t0;
            for round in 0..6 {
                at += rng.u64(0..3_000_000);
                let opts = CheckOptions::at(Timestamp::from_micros(at));
                // One policy per batch (a single policy's form of the script), all three, or
                // also the other "a".
                let spread = [1, 3, 1, 4][round % 4];
                let plan: Vec<(usize, usize)> = (0..rng.usize(1..60))
                    .map(|_| (rng.usize(0..keys.len()), rng.usize(0..spread)))
                    .collect();
                let checks: Vec<[Check<'_>; 1]> = plan
                    .iter()
                    .map(|&(k, p)| [Check::new(&keys[k], &policies[p])])
                    .collect();
                let reads = || {
                    (
                        command_calls(&server, "get"),
                        command_calls(&server, "mget"),
                    )
                };
                let before = reads();
                let batched = tokio::task::unconstrained(join_all(
                    checks.iter().map(|c| limiter.check(c, opts)),
                ))
                .await;
                let after = reads();
                if spread < 4 {
                    gets += after.0 - before.0;
                    mgets += after.1 - before.1;
                    batches += 1;
                }
                for (i, (c, got)) in checks.iter().zip(&batched).enumerate() {
                    let got = got.as_ref().expect("decided");
                    let want = memory.check_sync(c, opts).expect("decided");
                    assert_eq!(
                        got.decisions, want.decisions,
                        "seed {seed}, round {round}, check {i} ({:?}): Redis against memory",
                        plan[i]
                    );
                }
                // What the round wrote: each state written keeps its key until its tat (plus
                // the minute of slack of injected time), whatever values the keys of its batch
                // shared.
                for (c, got) in checks.iter().zip(&batched) {
                    if !got.as_ref().is_ok_and(|v| v.allowed()) {
                        continue;
                    }
                    let state = limiter.state_key(c[0].policy, c[0].key);
                    let tat = match server.cmd(&[b"GET".as_slice(), &state]).expect("GET") {
                        floodgate_testkit::Resp::Bulk(Some(v)) => String::from_utf8(v)
                            .ok()
                            .and_then(|s| s.parse::<u64>().ok())
                            .expect("a tat in decimal digits"),
                        other => panic!("seed {seed}, round {round}: no state ({other:?})"),
                    };
                    let want = i64::try_from((tat - at).div_ceil(1_000)).expect("small") + 60_000;
                    let ttl = server.cmd(&[b"PTTL".as_slice(), &state]).expect("PTTL");
                    assert!(
                        matches!(ttl, floodgate_testkit::Resp::Int(ms) if ms <= want && ms > want - 5_000),
                        "seed {seed}, round {round}: TTL {ttl:?}, want {want} ms (tat {tat}, now {at})"
                    );
                }
                // The states left behind: a peek of every key and policy agrees.
                for key in &keys {
                    for policy in &policies {
                        let peek = [Check::new(key, policy).cost(0)];
                        let got = limiter.check(&peek, opts).await.expect("peek");
                        let want = memory.check_sync(&peek, opts).expect("peek");
                        assert_eq!(got.decisions, want.decisions, "seed {seed}: state left");
                    }
                }
            }
        }
        assert_eq!(gets, 0, "plain GCRA checks read with MGET only");
        assert!(mgets >= batches, "{mgets} MGETs for {batches} batches");
    });
}

/// A plain GCRA batch of more keys than one `MGET` reads (256) decides each of them as the
/// memory store does, over two rounds (fresh states, then held ones), and a garbage key and a
/// key of another type past the first 256 fail alone.
#[test]
fn a_plain_gcra_batch_of_more_keys_than_one_mget_decides_each() {
    let server = server();
    run(Duration::from_secs(60), async {
        let config = RedisConfig::new(&server.url()).expect("valid URL");
        let batching = BatchConfig {
            max_in_flight: 1,
            max_batch: 1_000,
            ..BatchConfig::default()
        };
        let limiter = support::limiter_batching(&config, batching).await;
        let policy = Policy::gcra(1, 1, HOUR).expect("valid");
        let keys: Vec<Vec<u8>> = (0..600).map(|k| format!("k{k}").into_bytes()).collect();
        let (garbage, list) = (300, 557);
        server
            .cmd(&[
                b"SET".as_slice(),
                &limiter.state_key(&policy, &keys[garbage]),
                b"x",
            ])
            .expect("set");
        server
            .cmd(&[
                b"RPUSH".as_slice(),
                &limiter.state_key(&policy, &keys[list]),
                b"kept",
            ])
            .expect("rpush");
        let memory = MemoryLimiter::new();
        let t0 = 1_709_214_330_000_000u64;
        let (calls_before, mgets_before) = (
            command_calls(&server, "evalsha"),
            command_calls(&server, "mget"),
        );
        for round in 0..3u64 {
            let opts = CheckOptions::at(Timestamp::from_micros(t0 + round * 1_000));
            let checks: Vec<[Check<'_>; 1]> =
                keys.iter().map(|k| [Check::new(k, &policy)]).collect();
            let got =
                tokio::task::unconstrained(join_all(checks.iter().map(|c| limiter.check(c, opts))))
                    .await;
            for (i, (c, got)) in checks.iter().zip(&got).enumerate() {
                match got {
                    Err(e) if i == garbage => assert!(
                        matches!(e, floodgate_redis::Error::Corrupted { .. }),
                        "{e:?}"
                    ),
                    Err(e) if i == list => assert!(
                        matches!(e, floodgate_redis::Error::WrongType { .. }),
                        "{e:?}"
                    ),
                    Ok(v) if i != garbage && i != list => {
                        let want = memory.check_sync(c, opts).expect("decided");
                        assert_eq!(v.decisions, want.decisions, "round {round}, key {i}");
                    }
                    other => panic!("round {round}, key {i}: {other:?}"),
                }
            }
        }
        // Each call of at most 256 keys reads them with one MGET: more MGETs than calls means
        // some call read past its first 256 keys.
        let calls = command_calls(&server, "evalsha") - calls_before;
        let mgets = command_calls(&server, "mget") - mgets_before;
        assert!(
            mgets > calls,
            "{mgets} MGETs in {calls} calls: no call held over 256 keys"
        );
    });
}

/// In a batch of plain GCRA checks, keys holding garbage (anything but a whole number below
/// 2^53) and a key of another type fail their own checks with typed errors naming them and are
/// left exactly as they were; the other keys of the batch are decided and counted.
#[test]
fn plain_gcra_batches_refuse_bad_keys_and_decide_the_others() {
    let server = server();
    run(Duration::from_secs(30), async {
        let limiter = limiter(&server.url(), ConnectionKind::Multiplexed).await;
        let policy = Policy::gcra(2, 1, HOUR).expect("valid");
        // Stored tats the script must not take for a time: not a number, negative, fractional,
        // past 2^53, infinite, not a number again (strtod reads "nan").
        let bad: [&[u8]; 6] = [b"12x", b"-5", b"1.5", b"9007199254740993", b"inf", b"nan"];
        let bad_keys: Vec<Vec<u8>> = (0..bad.len())
            .map(|i| format!("bad{i}").into_bytes())
            .collect();
        for (name, value) in bad_keys.iter().zip(bad) {
            let key = limiter.state_key(&policy, name);
            server.cmd(&[b"SET".as_slice(), &key, value]).expect("set");
        }
        let list = limiter.state_key(&policy, b"list");
        server
            .cmd(&[b"RPUSH".as_slice(), &list, b"kept"])
            .expect("rpush");
        let mut keys: Vec<&[u8]> = vec![b"list", b"good"];
        keys.extend(bad_keys.iter().map(Vec::as_slice));
        let checks: Vec<[Check<'_>; 1]> = (0..keys.len() * 10)
            .map(|i| [Check::new(keys[i % keys.len()], &policy)])
            .collect();
        let opts = CheckOptions::default();
        let all =
            tokio::task::unconstrained(join_all(checks.iter().map(|c| limiter.check(c, opts))))
                .await;
        let mut admitted = 0;
        for (i, result) in all.iter().enumerate() {
            let key = keys[i % keys.len()];
            match (i % keys.len(), result) {
                (0, Err(e)) => {
                    assert!(
                        matches!(e, floodgate_redis::Error::WrongType { .. }),
                        "{e:?}"
                    );
                    assert!(e.to_string().contains("list"), "{e}");
                }
                (1, Ok(v)) => admitted += usize::from(v.allowed()),
                (_, Err(e)) => {
                    assert!(
                        matches!(e, floodgate_redis::Error::Corrupted { .. }),
                        "{}: {e:?}",
                        String::from_utf8_lossy(key)
                    );
                    assert!(
                        e.to_string().contains(&*String::from_utf8_lossy(key)),
                        "{e}"
                    );
                }
                (_, other) => panic!("check {i}: {other:?}"),
            }
        }
        assert_eq!(admitted, 3, "the good key's burst is 3");
        for (name, value) in bad_keys.iter().zip(bad) {
            let key = limiter.state_key(&policy, name);
            let kept = server.cmd(&[b"GET".as_slice(), &key]).expect("get");
            assert_eq!(kept.as_bytes(), Some(value), "garbage was overwritten");
        }
        let items = server
            .cmd(&[b"LRANGE".as_slice(), &list, b"0", b"-1"])
            .expect("lrange");
        let items: Vec<&[u8]> = match &items {
            floodgate_testkit::Resp::Array(Some(items)) => items
                .iter()
                .filter_map(floodgate_testkit::Resp::as_bytes)
                .collect(),
            other => panic!("LRANGE: {other:?}"),
        };
        assert_eq!(items, [b"kept"], "the list was changed");
    });
}

/// A check awaited on one runtime while the batching task lives on another that is no longer
/// driven (a runtime per thread, a test's own runtime) fails with a timeout just after its
/// deadline instead of waiting for an answer that cannot come.
#[test]
fn a_check_off_the_batcher_s_runtime_times_out_when_that_runtime_stalls() {
    let server = server();
    let runtime = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    };
    let config = RedisConfig::new(&server.url())
        .expect("valid URL")
        .timeout(Duration::from_millis(200));
    let policy = Policy::per_second(1_000).expect("valid");
    let checks = [Check::new(b"k", &policy)];
    // The batching task (and the connection's) start on `first`, which is then never driven
    // again, but kept.
    let first = runtime();
    let limiter = first.block_on(async {
        let limiter = RedisLimiter::connect(&config).await.expect("connect");
        let verdict = limiter.check(&checks, CheckOptions::default()).await;
        assert!(verdict.expect("check").allowed());
        limiter
    });
    let started = std::time::Instant::now();
    let result = runtime().block_on(async {
        tokio::time::timeout(
            Duration::from_secs(10),
            limiter.check(&checks, CheckOptions::default()),
        )
        .await
    });
    let err = result
        .expect("answered long before 10 s")
        .expect_err("nobody runs the batcher");
    assert!(err.is_timeout(), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    drop(first);
}

/// Batch settings that cannot work are refused with an error naming them, not a panic at the
/// first check: no room in the queue, more calls in flight than a batcher can count, a window
/// as long as the timeout (every check waiting for company would time out).
#[test]
fn batch_settings_that_cannot_work_are_refused() {
    let server = server();
    run(Duration::from_secs(30), async {
        let config = RedisConfig::new(&server.url())
            .expect("valid URL")
            .timeout(Duration::from_millis(500));
        let conn = floodgate_redis::RedisConn::connect(&config)
            .await
            .expect("connect");
        let refused =
            |batching: BatchConfig| match RedisLimiter::with_batching(conn.clone(), "fg", batching)
            {
                Ok(_) => panic!("accepted"),
                Err(e) => e.to_string(),
            };
        let e = refused(BatchConfig {
            queue: 0,
            ..BatchConfig::default()
        });
        assert!(e.contains("queue"), "{e}");
        let e = refused(BatchConfig {
            max_in_flight: usize::MAX,
            ..BatchConfig::default()
        });
        assert!(e.contains("max_in_flight"), "{e}");
        let e = refused(BatchConfig {
            queue: usize::MAX,
            ..BatchConfig::default()
        });
        assert!(e.contains("queue"), "{e}");
        // Three quarters of the timeout or more: checks that waited so long would be sent
        // with too little time left.
        let e = refused(BatchConfig {
            window: Duration::from_millis(375),
            ..BatchConfig::default()
        });
        assert!(e.contains("window"), "{e}");
        let shorter = BatchConfig {
            window: Duration::from_millis(300),
            ..BatchConfig::default()
        };
        assert!(RedisLimiter::with_batching(conn.clone(), "fg", shorter).is_ok());
        // Batching off: its settings do not matter.
        let off = BatchConfig {
            queue: 0,
            ..BatchConfig::disabled()
        };
        assert!(RedisLimiter::with_batching(conn.clone(), "fg", off).is_ok());
    });
}

/// A call timeout of `Duration::MAX` (for ever) decides checks, batched and concurrent,
/// instead of panicking on a deadline past what an `Instant` holds.
#[test]
fn a_timeout_of_for_ever_decides_checks() {
    let server = server();
    run(Duration::from_secs(30), async {
        for kind in [
            ConnectionKind::Multiplexed,
            ConnectionKind::Pool { size: 2 },
        ] {
            let config = RedisConfig::new(&server.url())
                .expect("valid URL")
                .connection(kind)
                .timeout(Duration::MAX);
            let limiter = RedisLimiter::connect(&config).await.expect("connect");
            let policy = Policy::per(10, HOUR).expect("valid");
            let key = format!("k:{kind}");
            let checks = [Check::new(key.as_bytes(), &policy)];
            let verdicts =
                join_all((0..20).map(|_| limiter.check(&checks, CheckOptions::default()))).await;
            let allowed = verdicts
                .into_iter()
                .map(|v| v.expect("decided"))
                .filter(|v| v.allowed())
                .count();
            assert_eq!(allowed, 10, "{kind}");
        }
    });
}
