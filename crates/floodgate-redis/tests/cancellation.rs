//! Callers that give up: a check whose caller is cancelled while it is in flight must not keep
//! what it was granted for nobody.

mod support;

use std::sync::Arc;
use std::time::Duration;

use floodgate_core::{Check, CheckOptions, ConcurrencyLease, Limiter, Policy};
use floodgate_redis::{BatchConfig, BreakerConfig, ConnectionKind, RedisLimiter};
use support::{cluster, cluster_limiter, keys_on_two_nodes, limiter, run, server};

/// Loads the script and checks Redis answers (a call that met NOSCRIPT would prove nothing).
async fn warm_up(limiter: &RedisLimiter, p: &Policy) {
    let other = [Check::new(b"other", p)];
    let warm = limiter
        .check(&other, CheckOptions::default())
        .await
        .expect("up");
    let id = warm.lease.expect("a lease");
    limiter.release(&other, id).await.expect("release");
}

/// Waits (3 s at most) for the one slot of `p` on key `slot` to be free again (through a circuit
/// breaker that may still be failing fast).
async fn slot_comes_back(limiter: &RedisLimiter, p: &Policy, held_by: &str) {
    let started = tokio::time::Instant::now();
    loop {
        match limiter.check_one(b"slot", p, 1).await {
            Ok(d) if d.allowed => return,
            Ok(_) => {}
            Err(e) => assert!(
                matches!(e, floodgate_redis::Error::Unavailable { .. }),
                "{e}"
            ),
        }
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "the slot is still held by {held_by}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A concurrency lease granted to a caller that was cancelled while Redis was paused is given
/// back when Redis answers, instead of holding the only slot for the lease's 30 s.
#[test]
fn fault_a_lease_granted_to_a_cancelled_caller_is_given_back() {
    let server = Arc::new(server());
    run(Duration::from_secs(30), async {
        let limiter = limiter(&server.url(), ConnectionKind::Multiplexed).await;
        let p = Policy::concurrency(1, Duration::from_secs(30)).expect("valid");
        warm_up(&limiter, &p).await;

        server.pause().expect("pause");
        let gave_up =
            tokio::time::timeout(Duration::from_millis(50), limiter.check_one(b"slot", &p, 1))
                .await;
        assert!(gave_up.is_err(), "the paused server answered: {gave_up:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
        server.resume().expect("resume");

        // The cancelled check ran when Redis resumed; its lease comes back at once.
        slot_comes_back(&limiter, &p, "the cancelled caller's lease").await;
    });
}

/// A check dropped after Redis answered it but before its caller read the verdict (the future
/// was polled once, then dropped: a client that went away while its task waited to run) gives
/// its lease back, batched (the verdict waits in the batcher's reply) or not (in the
/// connection's).
#[test]
fn fault_a_lease_answered_but_never_read_is_given_back() {
    let server = Arc::new(server());
    run(Duration::from_secs(30), async {
        // A prefix each: `slot_comes_back` takes the slot when it finds it free.
        for (limiter, prefix) in
            support::limiter_per_batching(&server.url(), Duration::from_secs(2)).await
        {
            let p = Policy::concurrency(1, Duration::from_secs(30)).expect("valid");
            warm_up(&limiter, &p).await;
            let checks = [Check::new(b"slot", &p)];
            // Redis holds its answer back while the check is first polled, so that the poll
            // cannot find it already there on a busy machine.
            server.pause().expect("pause");
            let mut check = Box::pin(limiter.check(&checks, CheckOptions::default()));
            std::future::poll_fn(|cx| {
                assert!(check.as_mut().poll(cx).is_pending(), "decided at once");
                std::task::Poll::Ready(())
            })
            .await;
            server.resume().expect("resume");
            // Redis answers meanwhile; nobody reads it.
            tokio::time::sleep(Duration::from_millis(300)).await;
            drop(check);
            slot_comes_back(&limiter, &p, &format!("an unread verdict ({prefix})")).await;
        }
    });
}

/// A batched call that times out may still run on the server once it answers: a concurrency
/// lease it granted is given back, instead of holding the only slot for the lease's 30 s.
#[test]
fn fault_a_lease_granted_to_a_call_that_timed_out_is_given_back() {
    let server = Arc::new(server());
    run(Duration::from_secs(30), async {
        for batching in [BatchConfig::default(), BatchConfig::disabled()] {
            lease_of_a_timed_out_call_comes_back(&server, batching, BreakerConfig::default()).await;
        }
    });
}

/// The call that times out can be the one that opens the circuit breaker, which then refuses
/// the lease's release at once: the release is tried again, and the slot comes back once
/// Redis answers, not after the lease's 30 s.
#[test]
fn fault_a_lease_granted_to_the_call_that_opened_the_breaker_is_given_back() {
    let server = Arc::new(server());
    let breaker = BreakerConfig {
        failures: 1,
        ..BreakerConfig::default()
    };
    run(Duration::from_secs(30), async {
        for batching in [BatchConfig::default(), BatchConfig::disabled()] {
            lease_of_a_timed_out_call_comes_back(&server, batching, breaker.clone()).await;
        }
    });
}

async fn lease_of_a_timed_out_call_comes_back(
    server: &floodgate_testkit::RedisServer,
    batching: BatchConfig,
    breaker: BreakerConfig,
) {
    let config = floodgate_redis::RedisConfig::new(&server.url())
        .expect("valid URL")
        .timeout(Duration::from_millis(100))
        .circuit_breaker(breaker);
    let limiter = support::limiter_batching(&config, batching).await;
    let p = Policy::concurrency(1, Duration::from_secs(30)).expect("valid");
    warm_up(&limiter, &p).await;

    server.pause().expect("pause");
    let timed_out = limiter.check_one(b"slot", &p, 1).await;
    assert!(
        matches!(timed_out, Err(floodgate_redis::Error::Timeout { .. })),
        "{timed_out:?}"
    );
    server.resume().expect("resume");

    // The call ran when Redis resumed; its lease is given back.
    slot_comes_back(&limiter, &p, "the lease of the call that timed out").await;
    let d = limiter.check_one(b"slot", &p, 1).await.expect("up");
    assert!(!d.allowed, "the one slot is ours now");
    server.cmd(&[b"FLUSHALL".as_slice()]).expect("flush");
}

/// A limiter outlives the runtime it was first used on (say a `static` shared by several
/// `#[tokio::test]`s): its batching task died with that runtime, and checks keep working on the
/// next one.
#[test]
fn a_limiter_keeps_working_after_its_first_runtime_is_gone() {
    let server = server();
    let p = Policy::per_second(1_000).expect("valid");
    let limiter = run(Duration::from_secs(10), async {
        let limiter = limiter(&server.url(), ConnectionKind::Multiplexed).await;
        assert!(limiter.check_one(b"k", &p, 1).await.expect("first").allowed);
        limiter
    });
    // `run`'s runtime is gone, and the batching task with it.
    run(Duration::from_secs(10), async {
        let started = tokio::time::Instant::now();
        loop {
            match limiter.check_one(b"k", &p, 1).await {
                Ok(d) => {
                    assert!(d.allowed);
                    break;
                }
                Err(e) => assert!(
                    started.elapsed() < Duration::from_secs(3),
                    "still failing on the second runtime: {e}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
}

/// A [`ConcurrencyLease`] held by a task that ends without releasing it (dropped by a panic, an early
/// return, a cancelled request) is released in the background, not held for its 30 s.
#[test]
fn a_dropped_lease_guard_gives_the_slot_back() {
    let server = Arc::new(server());
    run(Duration::from_secs(30), async {
        let limiter = limiter(&server.url(), ConnectionKind::Multiplexed).await;
        let p = Policy::concurrency(1, Duration::from_secs(30)).expect("valid");
        let task = {
            let limiter = limiter.clone();
            let p = p.clone();
            tokio::spawn(async move {
                let checks = [Check::new(b"slot", &p)];
                let (_, lease) =
                    ConcurrencyLease::check(&limiter, &checks, CheckOptions::default())
                        .await
                        .expect("up");
                let _lease = lease.expect("the slot was free");
                panic!("the holder dies");
            })
        };
        assert!(task.await.is_err(), "the holder panicked");
        slot_comes_back(&limiter, &p, "the dead holder's lease").await;

        // (`slot_comes_back` holds the slot now.) Released explicitly, a lease is free at once.
        let checks = [Check::new(b"another", &p)];
        let (_, lease) = ConcurrencyLease::check(&limiter, &checks, CheckOptions::default())
            .await
            .expect("up");
        let lease = lease.expect("free");
        assert!(
            !limiter
                .check_one(b"another", &p, 1)
                .await
                .expect("up")
                .allowed
        );
        lease.release().await.expect("release");
        assert!(
            limiter
                .check_one(b"another", &p, 1)
                .await
                .expect("up")
                .allowed
        );
    });
}

/// A check across cluster slots runs its parts one after the other. Dropped while a later part
/// waits on a paused node, it gives back what its first part counted: the only slot of a
/// concurrency policy, which would otherwise stay held for the lease's 30 s, and a rate unit.
#[test]
fn fault_a_check_across_slots_dropped_half_way_gives_back_its_first_part() {
    let cluster = cluster();
    run(Duration::from_secs(60), async {
        let redis = cluster_limiter(&cluster).await;
        let named = |p: Result<Policy, _>, name: &str| {
            p.and_then(|p: Policy| p.named(name)).expect("valid")
        };
        let tenant = named(
            Policy::concurrency(1, Duration::from_secs(30)),
            "exports-per-tenant",
        );
        let per_tenant = named(Policy::per_minute(1), "per-tenant");
        let per_ip = named(Policy::per_minute(1), "per-ip");
        let (first, ip, later) = keys_on_two_nodes(&redis, &cluster, &per_tenant, &per_ip);
        // One user key, one slot: the tenant's two policies are the first part.
        let checks = [
            Check::new(first.as_bytes(), &tenant),
            Check::new(first.as_bytes(), &per_tenant),
            Check::new(ip.as_bytes(), &per_ip),
        ];
        warm_up(&redis, &tenant).await;

        cluster.node(later).pause().expect("pause");
        let gave_up = tokio::time::timeout(
            Duration::from_millis(300),
            redis.check(&checks, CheckOptions::default()),
        )
        .await;
        assert!(gave_up.is_err(), "the paused node answered: {gave_up:?}");
        cluster.node(later).resume().expect("resume");

        // The first part comes back at once (3 s at most), not when its lease or window ends.
        let peek = [checks[0].cost(0), checks[1].cost(0)];
        let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
        loop {
            let v = redis
                .check(&peek, CheckOptions::default())
                .await
                .expect("checks");
            if v.decisions.iter().all(|d| d.remaining == 1) {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the dropped check's first part is still counted: {v:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
}

/// A check is over by its caller's deadline when that comes before the connection's timeout
/// (which is what lets the tower layer await it without a timer of its own), and a check whose
/// deadline has passed is not sent at all; batched or not, through the deny cache too.
#[test]
fn fault_a_check_is_over_by_its_deadline_and_not_sent_past_it() {
    let server = server();
    run(Duration::from_secs(60), async {
        for (limiter, prefix) in
            support::limiter_per_batching(&server.url(), Duration::from_secs(5)).await
        {
            let cached = floodgate_core::DenyCache::new(limiter.clone());
            let (five, short) = (Duration::from_secs(5), Duration::from_millis(150));
            assert!(limiter.keeps_deadlines(five) && cached.keeps_deadlines(five));
            assert!(!limiter.keeps_deadlines(short) && !cached.keeps_deadlines(short));
            let p = Policy::per_second(100).expect("valid");
            let checks = [Check::new(b"deadline", &p)];
            let first = limiter.check(&checks, CheckOptions::default()).await;
            assert!(first.expect("up").allowed(), "{prefix}");

            // Paused, Redis does not answer: the check ends at its deadline, not at the
            // connection's timeout of 5 s.
            server.pause().expect("pause");
            for name in ["limiter", "deny cache"] {
                let started = std::time::Instant::now();
                let opts = CheckOptions::default().until(started + Duration::from_millis(150));
                let result = if name == "limiter" {
                    limiter.check(&checks, opts).await
                } else {
                    cached.check(&checks, opts).await
                };
                let took = started.elapsed();
                let e = result.expect_err("Redis is paused");
                assert!(e.is_timeout(), "{prefix} {name}: {e}");
                assert!(
                    took >= Duration::from_millis(140) && took < Duration::from_secs(2),
                    "{prefix} {name}: over after {took:?}, not at its deadline of 150 ms"
                );
            }
            server.resume().expect("resume");

            // A deadline already passed: failed at once, and Redis never sees the check.
            let sent = support::command_calls(&server, "evalsha");
            let started = std::time::Instant::now();
            let late = CheckOptions::default().until(started);
            let e = limiter.check(&checks, late).await;
            let e = e.expect_err(prefix);
            assert!(e.is_timeout(), "{prefix}: {e}");
            assert!(started.elapsed() < Duration::from_secs(1), "{prefix}");
            let e = cached.check(&checks, late).await.expect_err("too late");
            assert!(e.is_timeout(), "{prefix}: {e}");
            assert_eq!(support::command_calls(&server, "evalsha"), sent, "{prefix}");
            // The same check with time to spare still gets through.
            let ok = limiter.check(&checks, CheckOptions::default()).await;
            assert!(ok.expect("up").allowed(), "{prefix}");
        }
    });
}

/// A check made outside a runtime, to be awaited in one, starts when first polled there (it
/// starts when made otherwise, and would find no runtime to queue it).
#[test]
fn a_check_made_outside_a_runtime_starts_in_the_one_that_awaits_it() {
    let server = server();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    for batching in [BatchConfig::default(), BatchConfig::disabled()] {
        let config = floodgate_redis::RedisConfig::new(&server.url()).expect("valid URL");
        let limiter = rt.block_on(support::limiter_batching(&config, batching));
        let p = Policy::per_minute(2).expect("valid");
        let checks = [Check::new(b"outside", &p)];
        let made = limiter.check(&checks, CheckOptions::default());
        let verdict = rt.block_on(made).expect("up");
        assert!(verdict.allowed());
        assert_eq!(verdict.decisions[0].remaining, 1);
        rt.block_on(limiter.reset(b"outside", &p)).expect("reset");
    }
}
