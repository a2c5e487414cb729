//! Bad data and hostile input: corrupted limiter keys, keys of the wrong type, binary and huge
//! user keys, and how keys spread over a cluster.

mod support;

use std::collections::HashSet;
use std::time::Duration;

use floodgate_core::{Check, CheckOptions, Limiter, Policy};
use floodgate_redis::keys::key_slot;
use floodgate_redis::{ConnectionKind, Error};

use support::{cluster, cluster_limiter, limiter, run, server};

const LIMIT: Duration = Duration::from_secs(60);

fn every_algorithm() -> Vec<Policy> {
    [
        Policy::fixed_window(5, Duration::from_secs(60)),
        Policy::calendar_window(5, 1, floodgate_core::CalendarUnit::Day),
        Policy::sliding_log(5, Duration::from_secs(60)),
        Policy::sliding_window(5, Duration::from_secs(60)),
        Policy::token_bucket(5, 1, Duration::from_secs(60)),
        Policy::funnel(5, Duration::from_secs(60)),
        Policy::gcra(4, 1, Duration::from_secs(60)),
        Policy::shaper(1, Duration::from_secs(60)),
        Policy::concurrency(5, Duration::from_secs(60)),
    ]
    .into_iter()
    .map(|p| p.expect("valid"))
    .collect()
}

#[test]
fn corrupted_and_wrong_type_keys_are_typed_errors_naming_the_key() {
    let server = server();
    run(LIMIT, async {
        let redis = limiter(&server.url(), ConnectionKind::Multiplexed).await;
        for policy in every_algorithm() {
            let bad = b"victim";
            let key = redis.state_key(&policy, bad);
            let shown = String::from_utf8_lossy(&key).into_owned();

            // Another client writes a string of garbage where the state lives.
            let kind_of_garbage: &[&[u8]] = match policy.algorithm().tag() {
                "gcra" | "shp" => &[b"SET", &key, b"not-a-number"],
                // A score inside the window (and a live lease), so it is read.
                "log" | "conc" => &[b"ZADD", &key, b"9000000000000000", b"garbage-member"],
                _ => &[
                    b"HSET", &key, b"start", b"-3", b"count", b"x", b"level", b"1e999", b"tokens",
                    b"NaN", b"curr", b"?", b"prev", b"\xff",
                ],
            };
            let wrote = server.cmd(kind_of_garbage).expect("write garbage");
            assert!(!wrote.is_error(), "{wrote:?}");
            let err = match redis.check_one(bad, &policy, 1).await {
                Err(e) => e,
                Ok(d) => panic!("{}: garbage decided {d:?}", policy.name()),
            };
            assert!(err.is_corrupted(), "{}: {err:?}", policy.name());
            assert!(
                err.to_string().contains(&shown),
                "{}: error {err} does not name {shown}",
                policy.name()
            );

            // A key of another Redis type altogether.
            server.cmd(&[b"DEL".as_slice(), &key]).expect("del");
            server
                .cmd(&[b"LPUSH".as_slice(), &key, b"x"])
                .expect("lpush");
            let err = redis
                .check_one(bad, &policy, 1)
                .await
                .expect_err("a list must not decide");
            assert!(
                matches!(err, Error::WrongType { .. }),
                "{}: {err:?}",
                policy.name()
            );

            // Every other key is unaffected.
            assert!(
                redis
                    .check_one(b"bystander", &policy, 1)
                    .await
                    .expect("other keys work")
                    .allowed
            );
        }
    });
}

#[test]
fn a_corrupted_key_fails_the_whole_check_and_writes_nothing() {
    let server = server();
    run(LIMIT, async {
        let redis = limiter(&server.url(), ConnectionKind::Multiplexed).await;
        let good = Policy::per_minute(10).expect("valid");
        let broken = Policy::fixed_window(10, Duration::from_secs(60)).expect("valid");
        server
            .cmd(&[b"SET".as_slice(), &redis.state_key(&broken, b"k"), b"oops"])
            .expect("set");
        let checks = [Check::new(b"k", &good), Check::new(b"k", &broken)];
        let err = redis
            .check(&checks, CheckOptions::default())
            .await
            .expect_err("corrupt");
        assert!(err.is_corrupted(), "{err:?}");
        let exists = server
            .cmd(&[b"EXISTS".as_slice(), &redis.state_key(&good, b"k")])
            .expect("exists")
            .as_int()
            .expect("int");
        assert_eq!(
            exists, 0,
            "the healthy policy was written despite the failure"
        );
    });
}

#[test]
fn binary_huge_and_brace_keys_work() {
    let server = server();
    run(LIMIT, async {
        let redis = limiter(&server.url(), ConnectionKind::Multiplexed).await;
        let p = Policy::per_hour(1).expect("valid");
        let huge = vec![0xa5u8; 1 << 20];
        for key in [
            &b"\0\xff\xfe binary"[..],
            &huge,
            b"}{",
            b"{tag}",
            b"",
            b"\r\n*3\r\n",
        ] {
            assert!(redis.check_one(key, &p, 1).await.expect("check").allowed);
            assert!(!redis.check_one(key, &p, 1).await.expect("check").allowed);
        }
        // The huge key is stored hashed, not as a megabyte-long key.
        let state_key = redis.state_key(&p, &huge);
        assert!(state_key.len() < 200, "{}", state_key.len());
    });
}

#[test]
fn cluster_keys_spread_over_slots_and_each_decision_stays_in_one() {
    let cluster = cluster();
    run(LIMIT, async {
        let redis = cluster_limiter(&cluster).await;
        let a = Policy::per_minute(10).expect("valid");
        let b = Policy::calendar_window(100, 1, floodgate_core::CalendarUnit::Day).expect("valid");
        let mut slots = HashSet::new();
        for i in 0..1_000 {
            let user = format!("+86138{i:08}");
            let keys = [
                redis.state_key(&a, user.as_bytes()),
                redis.state_key(&b, user.as_bytes()),
            ];
            assert_eq!(key_slot(&keys[0]), key_slot(&keys[1]));
            slots.insert(key_slot(&keys[0]));
            if i < 100 {
                let v = redis
                    .check(
                        &[
                            Check::new(user.as_bytes(), &a),
                            Check::new(user.as_bytes(), &b),
                        ],
                        CheckOptions::default(),
                    )
                    .await
                    .expect("one slot per decision");
                assert!(v.allowed());
            }
        }
        assert!(slots.len() > 900, "only {} slots", slots.len());
        // The live cluster agrees with our slot computation.
        let key = redis.state_key(&a, b"+8613800000000");
        let live = cluster
            .node(0)
            .cmd(&[b"CLUSTER".as_slice(), b"KEYSLOT", &key])
            .expect("keyslot")
            .as_int()
            .expect("int");
        assert_eq!(live, i64::from(key_slot(&key)));
        // Different user keys in one check are refused with a clear error on a cluster.
        let err = redis
            .check(
                &[Check::new(b"user-1", &a), Check::new(b"global", &b)],
                CheckOptions::default(),
            )
            .await;
        assert!(
            matches!(err, Err(Error::CrossSlot { .. })) || err.is_ok(),
            "{err:?}"
        );
    });
}

/// Runs `snippet` after the scripts' shared prelude, with `args` as ARGV, and returns its
/// reply: a list of strings.
fn after_prelude(
    server: &floodgate_testkit::RedisServer,
    snippet: &str,
    args: &[String],
) -> Vec<String> {
    let script = [
        include_str!("../src/lua/errors.lua"),
        include_str!("../src/lua/numbers.lua"),
        include_str!("../src/lua/prelude.lua"),
        snippet,
    ]
    .concat();
    let mut cmd: Vec<&[u8]> = vec![b"EVAL", script.as_bytes(), b"0"];
    cmd.extend(args.iter().map(|a| a.as_bytes()));
    let reply = server.cmd(&cmd).expect("EVAL");
    let floodgate_testkit::Resp::Array(Some(items)) = reply else {
        panic!("not an array: {reply:?}");
    };
    items
        .into_iter()
        .map(|item| match item {
            floodgate_testkit::Resp::Bulk(Some(v)) => String::from_utf8(v).expect("ASCII"),
            other => panic!("not a string: {other:?}"),
        })
        .collect()
}

/// The scripts' `fmt` writes every integer below 2^53 exactly, both with the one `'%d'` of a
/// Redis whose C long has 64 bits and in the two halves a 32-bit build needs (forced here, as
/// no 32-bit Redis is at hand): a stored state written with a digit wrong would decide wrong.
#[test]
fn the_scripts_write_integers_below_2_pow_53_exactly() {
    let server = server();
    let values: [i64; 12] = [
        0,
        1,
        -1,
        999_999_999,
        1_000_000_000,
        -1_000_000_000,
        1_000_000_001,
        1_999_999_999_999,
        123_456_789_012_345,
        1_709_214_330_000_000,
        9_007_199_254_740_991,
        -9_007_199_254_740_991,
    ];
    let shown = |v: &[i64]| v.iter().map(ToString::to_string).collect::<Vec<_>>();
    let got = after_prelude(
        &server,
        "local out = {}\n\
         for _, wide in ipairs({ 'auto', false }) do\n\
           if wide == false then wide_d = false end\n\
           for i = 1, #ARGV do out[#out + 1] = fmt(tonumber(ARGV[i])) end\n\
           if wide == 'auto' then out[#out + 1] = tostring(wide_d) end\n\
         end\n\
         return out\n",
        &shown(&values),
    );
    // This Redis is a 64-bit build: the first pass took the one '%d'.
    let want = [shown(&values), vec!["true".to_owned()], shown(&values)].concat();
    assert_eq!(
        got, want,
        "as this Redis writes them (one '%d'), then in two halves"
    );
}

/// A written state's TTL is the whole milliseconds until its tat, rounded up, plus the slack of
/// injected time: `ttl_ms` (and the batch script's `ttl_base`, which it is made of) gives
/// exactly that with one division, at every distance up to the longest span a state may have.
#[test]
fn a_state_s_ttl_is_the_milliseconds_until_its_tat_rounded_up() {
    let server = server();
    let now: u64 = 1_709_214_330_123_457;
    let distances: [u64; 8] = [1, 999, 1_000, 1_001, 1_999, 123_456_789, 1 << 50, 1 << 51];
    let args: Vec<String> = std::iter::once(now)
        .chain(distances)
        .map(|v| v.to_string())
        .collect();
    let got = after_prelude(
        &server,
        "local out = {}\n\
         local now = tonumber(ARGV[1])\n\
         for _, slack in ipairs({ 0, 60000 }) do\n\
           TTL_SLACK = slack\n\
           for i = 2, #ARGV do\n\
             out[#out + 1] = fmt(ttl_ms(now + tonumber(ARGV[i]), now))\n\
           end\n\
         end\n\
         return out\n",
        &args,
    );
    let want: Vec<String> = [0u64, 60_000]
        .iter()
        .flat_map(|slack| {
            distances
                .iter()
                .map(move |d| (d.div_ceil(1_000) + slack).to_string())
        })
        .collect();
    assert_eq!(
        got, want,
        "TTLs for {distances:?} us, without and with slack"
    );
}

#[test]
fn scores_and_costs_lua_cannot_hold_exactly_are_corruption() {
    let server = server();
    run(LIMIT, async {
        let redis = limiter(&server.url(), ConnectionKind::Multiplexed).await;
        let log = Policy::sliding_log(5, Duration::from_secs(60)).expect("valid");
        let conc = Policy::concurrency(5, Duration::from_secs(60)).expect("valid");
        for (policy, score, member) in [
            (&log, &b"inf"[..], &b"1:1:0"[..]),
            (&log, b"9000000000000000", b"1:99999999999999999999:0"),
            (&log, b"18014398509481984", b"1:1:0"),
            // The number after which the next entry of that microsecond is numbered.
            (&log, b"9000000000000000", b"1:1:99999999999999999999"),
            (&log, b"9000000000000000", b"1:1:9007199254740991"),
            (&conc, b"inf", b"lease:1"),
            (&conc, b"9000000000000000", b"lease:99999999999999999999"),
        ] {
            let key = redis.state_key(policy, b"k");
            server.cmd(&[b"DEL".as_slice(), &key]).expect("del");
            server
                .cmd(&[b"ZADD".as_slice(), &key, score, member])
                .expect("zadd");
            let err = match redis.check_one(b"k", policy, 1).await {
                Err(e) => e,
                Ok(d) => panic!("{} {score:?} {member:?} decided {d:?}", policy.name()),
            };
            assert!(err.is_corrupted(), "{err:?}");
        }
    });
}

#[test]
fn a_state_counted_under_a_larger_limit_decides_with_nothing_left() {
    let server = server();
    run(LIMIT, async {
        let redis = limiter(&server.url(), ConnectionKind::Multiplexed).await;
        // The same name, a smaller limit: a deploy that lowers a limit while old replicas run.
        for (large, small) in [
            (
                Policy::fixed_window(10, Duration::from_secs(60)),
                Policy::fixed_window(5, Duration::from_secs(60)),
            ),
            (
                Policy::funnel(10, Duration::from_secs(60)),
                Policy::funnel(2, Duration::from_secs(60)),
            ),
        ] {
            let large = large.and_then(|p| p.named("lowered")).expect("valid");
            let small = small.and_then(|p| p.named("lowered")).expect("valid");
            for _ in 0..8 {
                assert!(
                    redis
                        .check_one(b"k", &large, 1)
                        .await
                        .expect("check")
                        .allowed
                );
            }
            let peek = redis
                .check_one(b"k", &small, 0)
                .await
                .expect("peek decides");
            assert_eq!(peek.remaining, 0, "{peek:?}");
            let d = redis
                .check_one(b"k", &small, 1)
                .await
                .expect("check decides");
            assert!(!d.allowed, "{d:?}");
            assert_eq!(d.remaining, 0, "{d:?}");
        }
    });
}

#[test]
fn sliding_log_entries_of_one_microsecond_never_overwrite_each_other() {
    let server = server();
    run(LIMIT, async {
        let redis = limiter(&server.url(), ConnectionKind::Multiplexed).await;
        let log = Policy::sliding_log(10, Duration::from_secs(60)).expect("valid");
        let at = floodgate_core::Timestamp::from_micros(1_700_000_000_000_000);
        let check = |cost| {
            let redis = &redis;
            let log = &log;
            async move {
                redis
                    .check(&[Check::new(b"k", log).cost(cost)], CheckOptions::at(at))
                    .await
                    .expect("check")
            }
        };
        assert!(check(1).await.allowed());
        assert!(check(2).await.allowed());
        // An undo (a cross-slot check denied further on) takes the first entry back.
        let key = redis.state_key(&log, b"k");
        let members = server
            .cmd(&[b"ZRANGE".as_slice(), &key, b"0", b"-1"])
            .expect("zrange");
        let first = members
            .as_array()
            .and_then(|m| m.first())
            .cloned()
            .expect("a member");
        let first = first.as_bytes().expect("bytes").to_vec();
        assert!(
            first.ends_with(b":1:0"),
            "{:?}",
            String::from_utf8_lossy(&first)
        );
        server
            .cmd(&[b"ZREM".as_slice(), &key, &first])
            .expect("zrem");
        // Two more units in the same microsecond: 4 counted in all, none overwritten.
        assert!(check(2).await.allowed());
        assert_eq!(check(0).await.decisions[0].remaining, 6);
    });
}

#[test]
fn a_hash_state_missing_a_field_is_corruption_and_stays_as_it_was() {
    let server = server();
    run(LIMIT, async {
        let redis = limiter(&server.url(), ConnectionKind::Multiplexed).await;
        let minute = Duration::from_secs(60);
        for (policy, field, value) in [
            (Policy::fixed_window(5, minute), "count", "100"),
            (Policy::fixed_window(5, minute), "start", "1700000000000000"),
            (Policy::sliding_window(5, minute), "curr", "100"),
            (Policy::token_bucket(5, 1, minute), "tokens", "0"),
            (
                Policy::token_bucket(5, 1, minute),
                "last",
                "1700000000000000",
            ),
            (Policy::funnel(5, minute), "level", "0"),
        ] {
            let policy = policy.expect("valid");
            let key = redis.state_key(&policy, b"k");
            server.cmd(&[b"DEL".as_slice(), &key]).expect("del");
            server
                .cmd(&[b"HSET".as_slice(), &key, field.as_bytes(), value.as_bytes()])
                .expect("hset");
            let err = match redis.check_one(b"k", &policy, 1).await {
                Err(e) => e,
                Ok(d) => panic!("{} with only {field} decided {d:?}", policy.name()),
            };
            assert!(err.is_corrupted(), "{}: {err:?}", policy.name());
            assert!(err.to_string().contains("missing"), "{err}");
            let fields = server.cmd(&[b"HGETALL".as_slice(), &key]).expect("hgetall");
            let fields = fields.as_array().expect("array");
            assert_eq!(fields.len(), 2, "{}: {fields:?}", policy.name());
        }
    });
}

#[test]
fn releasing_beside_a_corrupt_lease_end_keeps_every_lease() {
    let server = server();
    run(LIMIT, async {
        let redis = limiter(&server.url(), ConnectionKind::Multiplexed).await;
        let conc = Policy::concurrency(5, Duration::from_secs(60)).expect("valid");
        let checks = [Check::new(b"k", &conc)];
        let verdict = redis
            .check(&checks, CheckOptions::default())
            .await
            .expect("check");
        let lease = verdict.lease.expect("a lease");
        let key = redis.state_key(&conc, b"k");
        for corrupt in [&b"inf"[..], b"1e300"] {
            server
                .cmd(&[b"ZADD".as_slice(), &key, corrupt, b"other:1"])
                .expect("zadd");
            let err = redis
                .release(&checks, lease)
                .await
                .expect_err("a corrupt lease end");
            assert!(err.is_corrupted(), "{err:?}");
            let held = server
                .cmd(&[b"ZCARD".as_slice(), &key])
                .expect("zcard")
                .as_int();
            assert_eq!(held, Some(2), "our lease and the other member are kept");
        }
    });
}

/// A GCRA state later than any check could leave (here someone else's far-future value with no
/// TTL, as a clock that stepped back or a cut period would leave a nearer one) reads as no
/// state, on each path of the scripts (the batch script alone and per key, the check script's
/// GCRA and group paths, a peek): the check is allowed and writes a state that expires when it
/// should, instead of locking the key out for as long as the value is ahead; a peek writes
/// nothing.
#[test]
fn a_gcra_state_no_check_could_leave_reads_as_none_and_heals() {
    let server = server();
    run(LIMIT, async {
        let redis = limiter(&server.url(), ConnectionKind::Multiplexed).await;
        let gcra = Policy::per_minute(5).expect("valid");
        let window = Policy::fixed_window(5, Duration::from_secs(60)).expect("valid");
        let pttl = |key: &[u8]| {
            server
                .cmd(&[b"PTTL".as_slice(), key])
                .expect("PTTL")
                .as_int()
                .expect("an integer")
        };
        // A plain check (the GCRA batch script), a check of cost 2, and GCRA beside another
        // algorithm (the check script's GCRA and generic paths).
        let cases: [(&[u8], u64, bool, i64); 3] = [
            (b"plain", 1, false, 12_000),
            (b"cost-2", 2, false, 24_000),
            (b"with-a-window", 1, true, 12_000),
        ];
        for (user, cost, with_window, ttl_ms) in cases {
            let key = redis.state_key(&gcra, user);
            for ahead in ["9007199254740991", "4102444800000000"] {
                server
                    .cmd(&[b"SET".as_slice(), &key, ahead.as_bytes()])
                    .expect("SET");
                let mut checks = vec![Check::new(user, &gcra).cost(cost)];
                if with_window {
                    checks.push(Check::new(user, &window));
                }
                let v = redis
                    .check(&checks, CheckOptions::default())
                    .await
                    .expect("decides");
                let name = String::from_utf8_lossy(user);
                assert!(v.allowed(), "{name} {ahead}: {v:?}");
                assert_eq!(v.decisions[0].remaining, 5 - cost, "{name}: {v:?}");
                let ttl = pttl(&key);
                assert!(
                    ttl > ttl_ms - 2_000 && ttl <= ttl_ms,
                    "{name} {ahead}: a TTL of {ttl} ms"
                );
                let left = server.cmd(&[b"DEL".as_slice(), &key]).expect("DEL");
                assert_eq!(left.as_int(), Some(1));
            }
        }

        // Several checks of the key in one batch (the batch script's per-key form): the first
        // reads the state as none, the others count on from there.
        let batching = floodgate_redis::BatchConfig {
            max_in_flight: 1,
            ..floodgate_redis::BatchConfig::default()
        };
        let config = floodgate_redis::RedisConfig::new(&server.url()).expect("valid URL");
        let in_order = support::limiter_batching(&config, batching).await;
        let key = in_order.state_key(&gcra, b"batched");
        server
            .cmd(&[b"SET".as_slice(), &key, b"9007199254740991"])
            .expect("SET");
        let check = [Check::new(b"batched".as_slice(), &gcra)];
        let all = tokio::task::unconstrained(futures_util::future::join_all(
            (0..3).map(|_| in_order.check(&check, CheckOptions::default())),
        ))
        .await;
        let mut remaining: Vec<u64> = all
            .iter()
            .map(|v| {
                let v = v.as_ref().expect("decides");
                assert!(v.allowed(), "{v:?}");
                v.decisions[0].remaining
            })
            .collect();
        remaining.sort_unstable();
        assert_eq!(remaining, [2, 3, 4]);
        let ttl = pttl(&key);
        assert!(ttl > 34_000 && ttl <= 36_000, "a TTL of {ttl} ms");

        // A peek reads such a state as none, and leaves it as it is.
        let key = redis.state_key(&gcra, b"peeked");
        server
            .cmd(&[b"SET".as_slice(), &key, b"9007199254740991"])
            .expect("SET");
        let peek = redis
            .check(
                &[Check::new(b"peeked".as_slice(), &gcra).cost(0)],
                CheckOptions::default(),
            )
            .await
            .expect("decides");
        assert_eq!(peek.decisions[0].remaining, 5, "{peek:?}");
        let left = server.cmd(&[b"GET".as_slice(), &key]).expect("GET");
        assert_eq!(left.as_bytes(), Some(b"9007199254740991".as_slice()));
    });
}

/// The GCRA batch script refuses a key's count of checks that no client sends (2^32 checks or
/// more, `inf`, a fraction) before it writes anything, even to the keys before it; a sound
/// count is decided and written.
#[test]
fn the_gcra_batch_script_refuses_a_count_out_of_range_before_writing() {
    let server = server();
    let script = [
        include_str!("../src/lua/numbers.lua"),
        include_str!("../src/lua/gcra_batch.lua"),
    ]
    .concat();
    // Two keys, one policy (100 ms apart, bursts of 10), a count per key.
    let eval = |second: &str| {
        server
            .cmd(&[
                "EVAL",
                script.as_str(),
                "2",
                "bad:first",
                "bad:second",
                "",
                "1",
                "100000",
                "900000",
                "3",
                second,
            ])
            .expect("EVAL")
    };
    for count in ["4294967296", "inf", "1e300", "2.5", "0", "x"] {
        let reply = eval(count);
        assert!(
            matches!(&reply, floodgate_testkit::Resp::Error(e) if e.contains("FLOODGATE_BADARG") && e.contains("key 2")),
            "count {count}: {reply:?}"
        );
        let first = server.cmd(&["GET", "bad:first"]).expect("GET");
        assert_eq!(
            first.as_bytes(),
            None,
            "count {count}: the first key was written"
        );
    }
    let reply = eval("2");
    assert!(
        matches!(&reply, floodgate_testkit::Resp::Array(Some(items)) if items.len() == 3),
        "sound counts: {reply:?}"
    );
    let first = server.cmd(&["GET", "bad:first"]).expect("GET");
    assert!(first.as_bytes().is_some(), "the first key was not written");
}
