//! The lock API on every store: bad input refused at construction, owner checks, fencing
//! tokens that survive the counter's loss, try-acquire that does not wait, timeouts, keys with
//! TTLs, and hand-off woken by the release notification (also after the subscriber's
//! connection dropped) rather than by polling.

mod support;

use std::future::Future;
use std::time::Duration;

use floodgate_lock::{
    Backoff, Error, Lock, LockAttempt, LockGuard, LockStore, MAX_LOCK_NAME, MAX_TTL, MemoryLocks,
    RedisLocks, Redlock,
};
use floodgate_redis::{RedisConfig, RedisConn};
use support::{
    redis_locks, redis_locks_silent, redis_locks_with, run, scripts_run, server, servers,
};
use tokio::time::Instant;

const TTL: Duration = Duration::from_secs(10);

#[test]
fn bad_input_is_refused_at_construction() {
    let store = MemoryLocks::new();
    let invalid = |r: Result<Lock<MemoryLocks>, Error>| match r {
        Err(Error::Invalid(message)) => message,
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("accepted"),
    };
    assert!(invalid(Lock::new(store.clone(), "", TTL)).contains("empty"));
    let long = vec![b'x'; MAX_LOCK_NAME + 1];
    assert!(invalid(Lock::new(store.clone(), &long, TTL)).contains("1024"));
    assert!(invalid(Lock::new(store.clone(), "n", Duration::ZERO)).contains("at least 1 ms"));
    assert!(invalid(Lock::new(store.clone(), "n", Duration::from_micros(999))).contains("1 ms"));
    assert!(invalid(Lock::new(store.clone(), "n", MAX_TTL * 2)).contains("at most"));
    assert!(Lock::new(store.clone(), vec![b'x'; MAX_LOCK_NAME], TTL).is_ok());
    assert!(Backoff::new(Duration::ZERO, TTL).is_err());
    assert!(Redlock::new(Vec::new()).is_err());
}

#[test]
fn redlock_refuses_a_lease_shorter_than_its_drift_allowance() {
    let server = server();
    run(Duration::from_secs(20), async {
        let redlock = Redlock::new(vec![redis_locks(&server.url()).await]).expect("one node");
        // The same server twice would vote twice.
        let twice = Redlock::new(vec![
            redis_locks(&server.url()).await,
            redis_locks(&server.url()).await,
            redis_locks(&server.url()).await,
        ]);
        assert!(
            matches!(&twice, Err(Error::Invalid(m)) if m.contains("given twice")),
            "{twice:?}"
        );
        let urls = [server.url(), server.url(), server.url()];
        let twice = Redlock::connect(urls.iter()).await;
        assert!(
            matches!(&twice, Err(Error::Invalid(m)) if m.contains("given twice")),
            "{twice:?}"
        );
        // drift = ttl / 100 + 2 ms
        assert!(matches!(
            Lock::new(redlock.clone(), "n", Duration::from_millis(2)),
            Err(Error::Invalid(_))
        ));
        assert!(Lock::new(redlock, "n", Duration::from_millis(10)).is_ok());
    });
}

/// One Redis server expires a lease on its own clock, whose rate may differ from the holder's:
/// the holder trusts it for `ttl / 100 + 2 ms` less, as Redlock does; memory, on the holder's
/// own clock, loses nothing.
#[test]
fn a_single_redis_lease_allows_for_clock_drift() {
    let server = server();
    run(Duration::from_secs(20), async {
        let locks = redis_locks(&server.url()).await;
        let ttl = Duration::from_secs(10);
        assert_eq!(locks.clock_drift(ttl), Duration::from_millis(102));
        // The memory store's clock is not the holder's either: a thousandth.
        assert_eq!(
            MemoryLocks::new().clock_drift(ttl),
            Duration::from_millis(10)
        );
        let guard = Lock::new(locks, "drift", ttl)
            .expect("lock")
            .try_acquire()
            .await
            .expect("up")
            .expect("free");
        let remaining = guard.remaining();
        assert!(
            remaining <= ttl - Duration::from_millis(102),
            "{remaining:?}"
        );
        assert!(remaining > ttl - Duration::from_secs(1), "{remaining:?}");
        guard.release().await.expect("release");
        assert!(matches!(
            Lock::new(
                redis_locks(&server.url()).await,
                "n",
                Duration::from_millis(2)
            ),
            Err(Error::Invalid(_))
        ));
    });
}

#[test]
fn only_the_owner_releases_or_extends() {
    let server = server();
    run(Duration::from_secs(20), async {
        let locks = redis_locks(&server.url()).await;
        let name = b"owner-check";
        let LockAttempt::Acquired { fence } =
            locks.try_lock(name, b"alice", TTL).await.expect("ok")
        else {
            panic!("not acquired")
        };
        assert!(fence > 1_000_000_000_000_000, "time-floored fence: {fence}");
        let held = locks.try_lock(name, b"bob", TTL).await.expect("ok");
        let LockAttempt::Held { remaining } = held else {
            panic!("bob got it: {held:?}")
        };
        assert!(remaining > TTL - Duration::from_secs(1) && remaining <= TTL);
        assert!(!locks.unlock(name, b"bob").await.expect("ok"));
        assert!(!locks.extend(name, b"bob", TTL).await.expect("ok"));
        assert_eq!(locks.remaining(name, b"bob").await.expect("ok"), None);
        assert!(locks.remaining(name, b"alice").await.expect("ok").is_some());
        assert!(locks.extend(name, b"alice", TTL * 2).await.expect("ok"));
        assert!(locks.remaining(name, b"alice").await.expect("ok") > Some(TTL));
        // The holder taking it again gets a new, larger fencing token.
        let LockAttempt::Acquired { fence: again } =
            locks.try_lock(name, b"alice", TTL).await.expect("ok")
        else {
            panic!("the holder could not take it again")
        };
        assert!(again > fence);
        assert!(locks.unlock(name, b"alice").await.expect("ok"));
        assert!(!locks.unlock(name, b"alice").await.expect("ok"));
    });
}

#[test]
fn keys_have_ttls_and_nothing_is_left_behind() {
    let server = server();
    run(Duration::from_secs(20), async {
        let locks = redis_locks(&server.url()).await;
        let lock = Lock::new(locks.clone(), "ttl-check", TTL).expect("valid");
        let guard = lock.try_acquire().await.expect("ok").expect("free");
        let key = locks.lock_key(b"ttl-check");
        let fence_key = locks.fence_key(b"ttl-check");
        let pttl = |k: Vec<u8>| {
            server
                .cmd(&[&b"PTTL"[..], k.as_slice()])
                .expect("PTTL")
                .as_int()
                .expect("int")
        };
        let lock_ttl = pttl(key.clone());
        assert!(lock_ttl > 9_000 && lock_ttl <= 10_000, "{lock_ttl}");
        let fence_ttl = pttl(fence_key.clone());
        assert!(fence_ttl > 6 * 24 * 3_600_000, "{fence_ttl}");
        let stored = server.cmd(&[&b"GET"[..], key.as_slice()]).expect("GET");
        let token = stored.as_str().expect("token");
        assert_eq!(token.len(), 32, "128-bit hex token: {token}");
        guard.release().await.expect("release");
        assert_eq!(pttl(key), -2, "the lock key is gone");
    });
}

#[test]
fn fencing_tokens_survive_the_loss_of_the_counter() {
    let server = server();
    run(Duration::from_secs(30), async {
        let locks = redis_locks(&server.url()).await;
        let lock = Lock::new(locks.clone(), "fence", TTL).expect("valid");
        let mut last = 0;
        for _ in 0..3 {
            let g = lock.try_acquire().await.expect("ok").expect("free");
            assert!(g.fence() > last);
            last = g.fence();
            g.release().await.expect("release");
        }
        // The counter expires (or is deleted): the server-time floor keeps tokens growing.
        server
            .cmd(&[&b"DEL"[..], locks.fence_key(b"fence").as_slice()])
            .expect("DEL");
        let g = lock.try_acquire().await.expect("ok").expect("free");
        assert!(g.fence() > last, "{} after {last}", g.fence());
        last = g.fence();
        g.release().await.expect("release");
        // The server restarts empty.
        server.restart().expect("restart");
        let g = lock
            .acquire(Duration::from_secs(5))
            .await
            .expect("after restart");
        assert!(g.fence() > last, "{} after {last}", g.fence());
        g.release().await.expect("release");
        // A corrupted counter is reported, not overwritten, and the lock is not taken: values
        // that are not a number, and numbers past which `counter + 1` is not exact or which
        // the script never writes.
        for corrupt in [
            "garbage",
            "inf",
            "nan",
            "1e400",
            "1e300",
            "1.5",
            "0x10",
            " 12 ",
            "9007199254740991",
            "9007199254740993",
        ] {
            let key = locks.fence_key(b"fence");
            server
                .cmd(&[&b"SET"[..], key.as_slice(), corrupt.as_bytes()])
                .expect("SET");
            let e = lock.try_acquire().await.expect_err(corrupt);
            assert!(
                matches!(e, Error::Redis(ref r) if r.is_corrupted()),
                "{corrupt}: {e}"
            );
            let lock_key = locks.lock_key(b"fence");
            assert_eq!(
                server
                    .cmd(&[&b"EXISTS"[..], lock_key.as_slice()])
                    .expect("EXISTS")
                    .as_int(),
                Some(0),
                "{corrupt}: the lock was taken"
            );
            assert_eq!(
                server
                    .cmd(&[&b"GET"[..], key.as_slice()])
                    .expect("GET")
                    .as_bytes(),
                Some(corrupt.as_bytes()),
                "the counter was overwritten"
            );
        }
    });
}

#[test]
fn try_acquire_does_not_wait_and_acquire_times_out() {
    let server = server();
    run(Duration::from_secs(20), async {
        let locks = redis_locks(&server.url()).await;
        let lock = Lock::new(locks, "busy", TTL).expect("valid");
        let guard = lock.try_acquire().await.expect("ok").expect("free");
        let started = Instant::now();
        assert!(lock.try_acquire().await.expect("ok").is_none());
        assert!(started.elapsed() < Duration::from_millis(500));

        let wait = Duration::from_millis(400);
        let started = Instant::now();
        let e = lock.acquire(wait).await.expect_err("held");
        let took = started.elapsed();
        assert!(e.is_timeout(), "{e}");
        assert!(e.to_string().contains("busy"), "{e}");
        assert!(
            took >= wait && took < wait + Duration::from_millis(400),
            "{took:?}"
        );
        guard.release().await.expect("release");
    });
}

/// An extension to a shorter lease that times out may have run in Redis all the same (here it
/// runs once Redis resumes): the guard does not go on trusting its longer lease past the
/// expiry that extension set.
#[test]
fn fault_an_extension_that_times_out_may_have_shortened_the_lease() {
    let server = server();
    run(Duration::from_secs(20), async {
        let locks = redis_locks_with(&server.url(), Duration::from_millis(100)).await;
        let lock = Lock::new(locks, "unsure-extension", TTL).expect("valid");
        let guard = lock.try_acquire().await.expect("ok").expect("free");
        guard
            .extend_for(Duration::from_secs(60))
            .await
            .expect("extended");
        assert!(guard.remaining() > Duration::from_secs(50));
        server.pause().expect("pause");
        let err = guard
            .extend_for(Duration::from_secs(1))
            .await
            .expect_err("Redis paused");
        server.resume().expect("resume");
        assert!(!err.is_lost(), "{err}");
        // The shorter expiry may be Redis' now (it is: the command ran on resume).
        assert!(
            guard.remaining() <= Duration::from_secs(1),
            "{:?}",
            guard.remaining()
        );
        tokio::time::sleep(Duration::from_millis(1200)).await;
        assert!(guard.is_lost(), "trusted past Redis' expiry");
        let other = redis_locks(&server.url()).await;
        let other = Lock::new(other, "unsure-extension", TTL).expect("valid");
        assert!(
            other.try_acquire().await.expect("ok").is_some(),
            "Redis let the lease expire"
        );
    });
}

/// A release that times out is retried within the lease instead of leaving waiters to wait for
/// the lease to run out. Here Redis is paused past the first attempt's timeout; the retry
/// answers once it resumes. (If the timed-out attempt ran first after all, the retry finds the
/// lock gone: the ambiguous case, reported as lost, on the safe side.)
#[test]
fn fault_a_release_that_times_out_is_retried_within_the_lease() {
    let server = std::sync::Arc::new(server());
    run(Duration::from_secs(20), async {
        let locks = redis_locks_with(&server.url(), Duration::from_millis(100)).await;
        let lock = Lock::new(locks, "flaky-release", TTL).expect("valid");
        let guard = lock.try_acquire().await.expect("ok").expect("free");
        server.pause().expect("pause");
        let resume = tokio::spawn({
            let server = std::sync::Arc::clone(&server);
            async move {
                tokio::time::sleep(Duration::from_millis(160)).await;
                server.resume().expect("resume");
            }
        });
        let released = guard.release().await;
        resume.await.expect("resume task");
        // Released by the retry, or found gone by it (the first attempt ran after all):
        // either way answered by a retry, not a timeout.
        if let Err(e) = released {
            assert!(e.is_lost(), "a retry answered, not a timeout: {e}");
        }
        // The lock is free at once, not after its 10 s lease.
        let other = redis_locks(&server.url()).await;
        let other = Lock::new(other, "flaky-release", TTL).expect("valid");
        let again = other.try_acquire().await.expect("ok").expect("released");
        again.release().await.expect("release");
    });
}

/// `run` returns the critical section's output when only the release fails (the store is
/// unreachable after the work was done under the lease): the lock lapses at the end of its
/// lease, and the caller does not lose what the work produced.
#[test]
fn fault_run_keeps_the_output_when_only_the_release_fails() {
    let server = std::sync::Arc::new(server());
    run(Duration::from_secs(30), async {
        let locks = redis_locks_with(&server.url(), Duration::from_millis(100)).await;
        let lock = Lock::new(locks, "unreleasable", TTL).expect("valid");
        let output = lock
            .run(Duration::from_secs(1), |fence| {
                let server = std::sync::Arc::clone(&server);
                async move {
                    // The store goes away as the work ends, before the release.
                    server.pause().expect("pause");
                    fence
                }
            })
            .await;
        server.resume().expect("resume");
        let fence = output.expect("the output, not the release's timeout");
        assert!(fence > 0);
    });
}

/// Work that ran past its lease is reported lost even when the store cannot be reached to
/// release it: the lease ran out by the guard's own deadline, so another holder may have
/// overlapped with it. (Here the work blocks its thread past the deadline, so the loss cannot
/// cancel it first.)
#[test]
fn fault_run_reports_work_past_its_lease_lost_when_the_release_fails() {
    let server = std::sync::Arc::new(server());
    run(Duration::from_secs(30), async {
        let locks = redis_locks_with(&server.url(), Duration::from_millis(100)).await;
        let lock = Lock::new(locks, "overran", Duration::from_millis(300)).expect("valid");
        let output = lock
            .run(Duration::from_secs(1), |fence| {
                let server = std::sync::Arc::clone(&server);
                async move {
                    // The store goes away, and the work runs on past the lease.
                    server.pause().expect("pause");
                    std::thread::sleep(Duration::from_millis(700));
                    fence
                }
            })
            .await;
        server.resume().expect("resume");
        let err = output.expect_err("work past its lease");
        assert!(err.is_lost(), "{err}");
    });
}

/// A release whose caller gives up before the store answers (a timeout around it, a cancelled
/// task) still releases: the guard's drop does it in the background.
#[test]
fn fault_a_cancelled_release_still_releases() {
    let server = std::sync::Arc::new(server());
    run(Duration::from_secs(20), async {
        let locks = redis_locks(&server.url()).await;
        let lock = Lock::new(locks, "cancelled-release", TTL).expect("valid");
        let guard = lock.try_acquire().await.expect("ok").expect("free");
        // The scripts are loaded (by the acquisition): the release's script runs on resume.
        let scripts_before = scripts_run(&server);
        server.pause().expect("pause");
        let gave_up = tokio::time::timeout(Duration::from_millis(50), guard.release()).await;
        assert!(gave_up.is_err(), "the paused server answered: {gave_up:?}");
        server.resume().expect("resume");
        // The release already sent would free it on its own: the guard's drop sends one of its
        // own all the same, since nobody saw the first answered.
        let started = Instant::now();
        while scripts_run(&server) < scripts_before + 2 {
            assert!(
                started.elapsed() < Duration::from_secs(2),
                "the dropped guard sent no release of its own"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Free well before its 10 s lease runs out.
        let other = redis_locks(&server.url()).await;
        let other = Lock::new(other, "cancelled-release", TTL).expect("valid");
        let started = Instant::now();
        let again = other
            .acquire(Duration::from_secs(3))
            .await
            .expect("released in the background");
        assert!(started.elapsed() < Duration::from_secs(3));
        again.release().await.expect("release");
    });
}

/// A grant that comes back after its lease (less the clock drift allowance) is over may be
/// someone else's lock already: it is given back at once, and reported as a transient
/// `AnsweredTooLate`, not as a lock another owner holds. Acquiring tries again.
#[test]
fn fault_a_grant_answered_after_its_lease_is_given_back_and_said_so() {
    let server = std::sync::Arc::new(server());
    run(Duration::from_secs(20), async {
        let locks = redis_locks(&server.url()).await;
        let key = locks.lock_key(b"late");
        // The scripts are loaded (with a lock of a lease long enough for a busy machine): the
        // paused server runs the acquisition when it wakes.
        let warm = Lock::new(locks.clone(), "late-warm-up", Duration::from_secs(10))
            .expect("valid")
            .try_acquire()
            .await
            .expect("ok")
            .expect("free");
        warm.release().await.expect("release");
        let lock = Lock::new(locks, "late", Duration::from_millis(30)).expect("valid");
        let pause_for = |ms: u64| {
            server.pause().expect("pause");
            let server = std::sync::Arc::clone(&server);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(ms));
                server.resume().expect("resume");
            })
        };

        let waking = pause_for(100);
        let late = lock.try_acquire().await;
        waking.join().expect("resumed");
        match late {
            Err(e @ Error::AnsweredTooLate { .. }) => {
                assert!(e.is_transient() && e.is_store(), "{e}");
                assert!(e.to_string().contains("given back"), "{e}");
            }
            other => panic!("not the late answer it was: {other:?}"),
        }
        // Nobody holds it, though its 30 ms have not run out (given back before the error, as
        // the grant was before; what is new is the error, above).
        let exists = server
            .cmd(&[&b"EXISTS"[..], key.as_slice()])
            .expect("EXISTS")
            .as_int();
        assert_eq!(exists, Some(0));

        // Acquiring rides one late answer out.
        let waking = pause_for(100);
        let guard = lock.acquire(Duration::from_secs(3)).await;
        waking.join().expect("resumed");
        guard
            .expect("acquired on a later attempt")
            .release()
            .await
            .ok();
    });
}

/// An acquisition whose caller gives up while its attempt is in flight may still take the lock
/// when the store gets to it; nobody would know the token, so the lock is given back in the
/// background instead of blocking everyone for its lease.
#[test]
fn fault_a_cancelled_acquisition_leaves_no_unknown_holder() {
    let server = std::sync::Arc::new(server());
    run(Duration::from_secs(30), async {
        // The scripts are loaded first: a cancelled attempt that met NOSCRIPT would never be
        // retried, and the test would prove nothing.
        let warm_up = Lock::new(redis_locks(&server.url()).await, "warm-up", TTL).expect("valid");
        let guard = warm_up.try_acquire().await.expect("ok").expect("free");
        guard.release().await.expect("release");
        for (round, name) in ["cancelled-try-acquire", "cancelled-acquire"]
            .into_iter()
            .enumerate()
        {
            let locks = redis_locks(&server.url()).await;
            let lock = Lock::new(locks, name, TTL).expect("valid");
            server.pause().expect("pause");
            let gave_up = if round == 0 {
                tokio::time::timeout(Duration::from_millis(50), lock.try_acquire())
                    .await
                    .is_err()
            } else {
                tokio::time::timeout(Duration::from_millis(50), lock.acquire(TTL))
                    .await
                    .is_err()
            };
            assert!(gave_up, "{name}: the paused server answered");
            server.resume().expect("resume");
            let other = redis_locks(&server.url()).await;
            let other = Lock::new(other, name, TTL).expect("valid");
            let started = Instant::now();
            let guard = other
                .acquire(Duration::from_secs(3))
                .await
                .unwrap_or_else(|e| panic!("{name}: still held by a forgotten token: {e}"));
            assert!(started.elapsed() < Duration::from_secs(3));
            guard.release().await.expect("release");
        }
    });
}

/// `holder` takes the lock, `waiter` starts waiting for it, and 300 ms later `holder` gives it
/// back: how long until `waiter` has it (then given back too).
async fn timed_hand_off(holder: &Lock<RedisLocks>, waiter: &Lock<RedisLocks>) -> Duration {
    let guard = holder.try_acquire().await.expect("ok").expect("free");
    let waiting = {
        let waiter = waiter.clone();
        tokio::spawn(async move {
            let g = waiter
                .acquire(Duration::from_secs(20))
                .await
                .expect("acquired");
            (Instant::now(), g)
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await; // the waiter is waiting
    let released_at = Instant::now();
    guard.release().await.expect("release");
    let (acquired_at, g) = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("acquired in time")
        .expect("task");
    g.release().await.expect("release");
    acquired_at - released_at
}

/// With a backoff of 5 s, a waiter that acquires within a fraction of it was woken by the
/// release notification, not by a timer.
#[test]
fn hand_off_is_woken_by_the_release_notification() {
    let server = server();
    run(Duration::from_secs(40), async {
        let slow = Backoff::new(Duration::from_secs(5), Duration::from_secs(5)).expect("valid");
        let holder = Lock::new(redis_locks(&server.url()).await, "handoff", TTL).expect("valid");
        let waiter = Lock::new(redis_locks(&server.url()).await, "handoff", TTL)
            .expect("valid")
            .backoff(slow);

        for round in 0..3 {
            let handoff = timed_hand_off(&holder, &waiter).await;
            eprintln!("round {round}: hand-off {handoff:?}");
            assert!(handoff < Duration::from_secs(1), "{handoff:?}");

            if round == 1 {
                // The subscriber's connection drops; it reconnects and subscribes again.
                let killed = server
                    .cmd(&[&b"CLIENT"[..], &b"KILL"[..], &b"TYPE"[..], &b"pubsub"[..]])
                    .expect("CLIENT KILL");
                assert!(killed.as_int().unwrap_or(0) >= 1, "{killed:?}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    });
}

/// The subscriber runs on the runtime of the first waiter. When that runtime shuts down (a
/// `block_on` helper, a test's runtime), the channels it had subscribed must not stay marked
/// subscribed: a waiter on another runtime starts a new subscriber and is woken by the release,
/// not by its backoff.
#[test]
fn hand_off_still_notifies_after_the_first_waiter_s_runtime_is_gone() {
    let server = server();
    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let slow = Backoff::new(Duration::from_secs(5), Duration::from_secs(5)).expect("valid");
    let (holder, waiter) = main.block_on(async {
        let holder = Lock::new(redis_locks(&server.url()).await, "gone", TTL).expect("valid");
        let waiter = Lock::new(redis_locks(&server.url()).await, "gone", TTL)
            .expect("valid")
            .backoff(slow);
        (holder, waiter)
    });
    let hand_off = |rt: &tokio::runtime::Runtime| rt.block_on(timed_hand_off(&holder, &waiter));
    // The first wait, on a runtime of its own, which then shuts down.
    let first = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let took = hand_off(&first);
    assert!(took < Duration::from_secs(1), "first hand-off {took:?}");
    drop(first);
    let took = hand_off(&main);
    assert!(
        took < Duration::from_secs(1),
        "after the first runtime: {took:?}"
    );
}

/// Without notifications the waiter still gets the lock: when the holder's lease ends,
/// or on its jittered backoff.
#[test]
fn without_notifications_waiters_fall_back_to_the_lease_and_backoff() {
    let server = server();
    run(Duration::from_secs(20), async {
        let locks = redis_locks_silent(&server.url()).await;
        assert!(!locks.has_notifications());
        let ttl = Duration::from_millis(800);
        let lock = Lock::new(locks, "silent", ttl).expect("valid");
        let guard = lock.try_acquire().await.expect("ok").expect("free");
        let taken = Instant::now();
        std::mem::forget(guard);
        let g = lock
            .acquire(Duration::from_secs(5))
            .await
            .expect("acquired");
        let waited = taken.elapsed();
        assert!(
            waited >= ttl - Duration::from_millis(50) && waited < ttl + Duration::from_millis(600),
            "{waited:?}"
        );
        g.release().await.expect("release");
    });
}

#[test]
fn memory_and_redis_behave_alike() {
    let server = server();
    run(Duration::from_secs(20), async {
        async fn scenario<S>(store: S)
        where
            S: LockStore + Clone + std::fmt::Debug,
            Error: From<S::Error>,
        {
            let a = Lock::new(store.clone(), "same", TTL).expect("valid");
            let b = Lock::new(store, "same", TTL).expect("valid");
            let ga = a.try_acquire().await.expect("ok").expect("free");
            assert!(b.try_acquire().await.expect("ok").is_none());
            ga.extend().await.expect("extend");
            assert!(ga.verify().await.expect("held") > TTL - Duration::from_secs(1));
            let fa = ga.fence();
            ga.release().await.expect("release");
            let gb = b.try_acquire().await.expect("ok").expect("free");
            assert!(gb.fence() > fa);
            drop(gb); // released in the background
            let ga = a
                .acquire(Duration::from_secs(2))
                .await
                .expect("dropped guard released");
            ga.release().await.expect("release");
        }
        scenario(MemoryLocks::new()).await;
        scenario(redis_locks(&server.url()).await).await;
    });
}

#[test]
fn a_guard_dropped_outside_a_runtime_does_not_panic() {
    let lock = Lock::new(MemoryLocks::new(), "outside", TTL).expect("valid");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let guard = runtime
        .block_on(lock.clone().watchdog(true).try_acquire())
        .expect("ok")
        .expect("free");
    drop(runtime);
    drop(guard); // no runtime: nothing spawned, the lease runs out
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    assert!(runtime.block_on(lock.try_acquire()).expect("ok").is_none());
}

/// `url` as the ACL user `app` (password `pw`): every key and command, no pub/sub channel
/// (what Redis 7 gives a new user unless told otherwise), created on the server at `url`.
async fn user_without_channels(url: &str) -> String {
    let admin = RedisConn::connect(&RedisConfig::new(url).expect("valid URL"))
        .await
        .expect("connect");
    let mut cmd = redis::cmd("ACL");
    cmd.arg("SETUSER")
        .arg("app")
        .arg("on")
        .arg(">pw")
        .arg("~*")
        .arg("+@all")
        .arg("resetchannels");
    let _: () = admin.query(cmd).await.expect("ACL SETUSER");
    url.replacen("redis://", "redis://app:pw@", 1)
}

/// A user without rights on the release channels: the release script's announcement is
/// refused after the lock is deleted, and that is still a release, on one server and on
/// Redlock's quorum (where a failed release used to read as a lost lock).
#[test]
fn a_user_without_channel_rights_releases() {
    let server = server();
    let nodes = servers(3);
    run(Duration::from_secs(60), async {
        let url = user_without_channels(&server.url()).await;
        let lock = Lock::new(redis_locks(&url).await, "acl", TTL).expect("lock");
        let guard = lock.try_acquire().await.expect("ok").expect("free");
        // A waiter, whose notification never comes: it finds the release by backoff.
        let waiter = {
            let lock = lock.clone();
            tokio::spawn(async move { lock.acquire(Duration::from_secs(10)).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        guard.release().await.expect("released");
        let taken = waiter
            .await
            .expect("task")
            .expect("acquired after the release");
        taken.release().await.expect("released");
        let again = lock.try_acquire().await.expect("ok").expect("released");
        again.release().await.expect("released");

        let mut clients = Vec::new();
        for node in nodes.iter() {
            clients.push(redis_locks(&user_without_channels(&node.url()).await).await);
        }
        let redlock = Redlock::new(clients).expect("three nodes");
        let lock = Lock::new(redlock, "acl", TTL).expect("lock");
        let guard = lock.try_acquire().await.expect("ok").expect("free");
        guard.release().await.expect("released on a quorum");
        let again = lock.try_acquire().await.expect("ok").expect("released");
        again.release().await.expect("released");
    });
}

/// `count` waiters of one lock in this process, started one after another while `holder`
/// holds it, each holding it a moment once it has it: returns the order they took it in, and
/// how many scripts the server ran meanwhile (attempts and releases).
async fn queue_of_waiters(
    server: &floodgate_testkit::RedisServer,
    store: RedisLocks,
    count: usize,
) -> (Vec<usize>, u64) {
    // Slow polling (the holder's lease, 10 s, comes first): every attempt after the first of
    // each waiter is one a release caused.
    let slow = Backoff::new(Duration::from_secs(20), Duration::from_secs(20)).expect("valid");
    let lock = Lock::new(store, "queued", TTL)
        .expect("valid")
        .backoff(slow);
    let holder = lock.try_acquire().await.expect("ok").expect("free");
    let before = scripts_run(server);
    let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..count {
        let (waiter, order) = (lock.clone(), std::sync::Arc::clone(&order));
        tasks.push(tokio::spawn(async move {
            let guard = waiter
                .acquire(Duration::from_secs(30))
                .await
                .unwrap_or_else(|e| panic!("waiter {i}: {e}"));
            order.lock().expect("order").push(i);
            tokio::time::sleep(Duration::from_millis(5)).await;
            guard.release().await.expect("release");
        }));
        // Each has tried the lock and lined up before the next comes.
        wait_for_line(&lock, i + 1).await;
    }
    holder.release().await.expect("release");
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(20), task)
            .await
            .expect("every waiter served in time")
            .expect("waiter");
    }
    let order = order.lock().expect("order").clone();
    (order, scripts_run(server) - before)
}

/// Waiters of one lock in a process line up: only the first tries the lock and listens for its
/// release, so each release costs one attempt there, not one per waiter (32 waiters took 600
/// scripts to pass the lock along, each release waking all), and they take it in the order
/// they came.
#[test]
fn waiters_in_one_process_line_up_and_a_release_costs_one_attempt() {
    let server = server();
    run(Duration::from_secs(60), async {
        let waiters = 32;
        let (order, scripts) =
            queue_of_waiters(&server, redis_locks(&server.url()).await, waiters).await;
        eprintln!("{waiters} waiters: {scripts} scripts run");
        assert_eq!(
            order,
            (0..waiters).collect::<Vec<_>>(),
            "first come, first served"
        );
        // Per waiter: its first attempt, one on its turn, the one the release before let
        // through, and its own release (and a little room).
        let bound = u64::try_from(waiters).expect("small") * 5;
        assert!(
            scripts <= bound,
            "{scripts} scripts for {waiters} hand-offs"
        );
    });
}

/// A waiter that leaves the line (its call cancelled, or its deadline passed) hands its turn on:
/// the next takes the lock on the release, not when a poll comes around.
#[test]
fn a_waiter_leaving_the_line_hands_its_turn_on() {
    run(Duration::from_secs(60), async {
        let slow = Backoff::new(Duration::from_secs(20), Duration::from_secs(20)).expect("valid");
        let lock = Lock::new(MemoryLocks::new(), "line", Duration::from_secs(40))
            .expect("valid")
            .backoff(slow);
        let holder = lock.try_acquire().await.expect("ok").expect("free");
        let spawn = |wait: Duration| {
            let lock = lock.clone();
            tokio::spawn(async move { lock.acquire(wait).await.map(|g| (Instant::now(), g)) })
        };
        let first = spawn(Duration::from_secs(30));
        wait_for_line(&lock, 1).await;
        let impatient = spawn(Duration::from_millis(300));
        wait_for_line(&lock, 2).await;
        let last = spawn(Duration::from_secs(30));
        wait_for_line(&lock, 3).await;
        let queues = lock
            .store()
            .wait_queues()
            .expect("the memory store has queues");
        // The second's deadline passes in the line, behind the first; then the first is
        // cancelled.
        let started = Instant::now();
        let timed_out = impatient.await.expect("task");
        assert!(
            matches!(timed_out, Err(Error::Timeout { .. })),
            "{:?}",
            timed_out.map(|(_, g)| g.fence())
        );
        assert!(started.elapsed() < Duration::from_secs(1));
        assert_eq!(queues.waiting(b"line"), 2);
        first.abort();
        assert!(first.await.is_err_and(|e| e.is_cancelled()));
        assert_eq!(queues.waiting(b"line"), 1);
        let released_at = Instant::now();
        holder.release().await.expect("release");
        let (acquired_at, guard) = tokio::time::timeout(Duration::from_secs(5), last)
            .await
            .expect("the last waiter got its turn")
            .expect("task")
            .expect("acquired");
        let handoff = acquired_at - released_at;
        assert!(handoff < Duration::from_secs(1), "{handoff:?}");
        guard.release().await.expect("release");
        assert_eq!(queues.waiting(b"line"), 0, "the line is gone");
    });
}

/// Waits (up to 10 s) until `lock`'s name has `count` waiters in line.
async fn wait_for_line<S>(lock: &Lock<S>, count: usize)
where
    S: LockStore + Clone,
    Error: From<S::Error>,
{
    let queues = lock.store().wait_queues().expect("a store with queues");
    let deadline = Instant::now() + Duration::from_secs(10);
    while queues.waiting(lock.name()) != count {
        assert!(
            Instant::now() < deadline,
            "{} in line, not {count}",
            queues.waiting(lock.name())
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Takes `lock`, lines up behind it a first waiter whose caller then stops polling it (nor
/// drops it), and a task waiting up to `wait` behind that one, and releases the lock: the
/// stalled waiter (to drop at the end) and the task.
async fn release_behind_a_stalled_first_waiter(
    lock: &Lock<MemoryLocks>,
    wait: Duration,
) -> (
    std::pin::Pin<Box<impl Future<Output = Result<LockGuard<MemoryLocks>, Error>> + '_>>,
    tokio::task::JoinHandle<Result<LockGuard<MemoryLocks>, Error>>,
) {
    let holder = lock.try_acquire().await.expect("ok").expect("free");
    let mut stalled = Box::pin(lock.acquire(Duration::from_secs(30)));
    assert!(
        tokio::time::timeout(Duration::from_millis(100), &mut stalled)
            .await
            .is_err()
    );
    wait_for_line(lock, 1).await;
    let behind = {
        let lock = lock.clone();
        tokio::spawn(async move { lock.acquire(wait).await })
    };
    wait_for_line(lock, 2).await;
    holder.release().await.expect("release");
    (stalled, behind)
}

/// A first waiter whose caller stops polling it (its future kept in a `select!` that waits
/// on something else) does not hold up the waiters behind it: they look at the lock on their
/// backoff, and take it once it is free.
#[test]
fn a_first_waiter_nobody_polls_does_not_hold_the_line_up() {
    run(Duration::from_secs(60), async {
        let quick =
            Backoff::new(Duration::from_millis(10), Duration::from_millis(50)).expect("valid");
        let lock = Lock::new(MemoryLocks::new(), "stalled", Duration::from_secs(40))
            .expect("valid")
            .backoff(quick);
        let (stalled, behind) =
            release_behind_a_stalled_first_waiter(&lock, Duration::from_secs(10)).await;
        let guard = tokio::time::timeout(Duration::from_secs(5), behind)
            .await
            .expect("taken on a poll, not at the deadline")
            .expect("task")
            .expect("acquired");
        guard.release().await.expect("release");
        drop(stalled);
    });
}

/// A waiter behind another looks at the lock once more at its deadline: freed in between (and
/// not taken by the first in line, whose caller stopped polling it), it is taken then, not
/// given up on with a timeout.
#[test]
fn a_waiter_in_line_looks_once_more_at_its_deadline() {
    run(Duration::from_secs(60), async {
        // Longer than the wait: the waiter behind sleeps to its deadline.
        let slow = Backoff::new(Duration::from_secs(5), Duration::from_secs(5)).expect("valid");
        let lock = Lock::new(MemoryLocks::new(), "deadline-look", Duration::from_secs(40))
            .expect("valid")
            .backoff(slow);
        let (stalled, behind) =
            release_behind_a_stalled_first_waiter(&lock, Duration::from_millis(600)).await;
        let guard = behind
            .await
            .expect("task")
            .expect("taken at the deadline's last look");
        guard.release().await.expect("release");
        drop(stalled);
    });
}

/// The memory store, which records the tokens of the attempts, and whose first attempt goes
/// wrong: its grant's reply is lost (the lock taken, the caller told the store timed out); or,
/// with `split_first`, it is a Redlock split vote, answered "held" while the give-back of the
/// one node cooling off is still on its way (it arrives 50 ms later).
#[derive(Clone)]
struct LosesFirstGrant {
    inner: MemoryLocks,
    tokens: std::sync::Arc<std::sync::Mutex<Vec<Vec<u8>>>>,
    split_first: bool,
}

impl LosesFirstGrant {
    fn new(split_first: bool) -> Self {
        LosesFirstGrant {
            inner: MemoryLocks::new(),
            tokens: std::sync::Arc::default(),
            split_first,
        }
    }
}

impl LockStore for LosesFirstGrant {
    type Error = floodgate_redis::Error;

    async fn try_lock(
        &self,
        name: &[u8],
        token: &[u8],
        ttl: Duration,
    ) -> Result<LockAttempt, floodgate_redis::Error> {
        let first = {
            let mut tokens = self.tokens.lock().expect("tokens");
            tokens.push(token.to_vec());
            tokens.len() == 1
        };
        if first && self.split_first {
            let (inner, name, token) = (self.inner.clone(), name.to_vec(), token.to_vec());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                let _ = inner.unlock(&name, &token).await;
            });
            return Ok(LockAttempt::Held {
                remaining: Duration::MAX,
            });
        }
        let attempt = self
            .inner
            .try_lock(name, token, ttl)
            .await
            .expect("memory store");
        if first {
            assert!(matches!(attempt, LockAttempt::Acquired { .. }));
            return Err(floodgate_redis::Error::Timeout {
                after: Duration::from_millis(100),
                op: "try_lock (its reply lost)",
            });
        }
        Ok(attempt)
    }

    async fn unlock(&self, name: &[u8], token: &[u8]) -> Result<bool, floodgate_redis::Error> {
        Ok(self.inner.unlock(name, token).await.expect("memory store"))
    }

    async fn extend(
        &self,
        name: &[u8],
        token: &[u8],
        ttl: Duration,
    ) -> Result<bool, floodgate_redis::Error> {
        Ok(self
            .inner
            .extend(name, token, ttl)
            .await
            .expect("memory store"))
    }

    async fn remaining(
        &self,
        name: &[u8],
        token: &[u8],
    ) -> Result<Option<Duration>, floodgate_redis::Error> {
        Ok(self
            .inner
            .remaining(name, token)
            .await
            .expect("memory store"))
    }

    fn released(&self, name: &[u8]) -> floodgate_core::lock::Released {
        self.inner.released(name)
    }
}

/// After an attempt whose outcome is unknown, the next attempts use a new token: a give-back of
/// the old one still on its way (a late grant's, a Redlock short of a quorum) cannot delete
/// what they are granted. The old token's lock is given back, and the new token takes it.
#[test]
fn after_a_failed_attempt_the_next_ones_use_a_new_token() {
    run(Duration::from_secs(20), async {
        let store = LosesFirstGrant::new(false);
        let quick =
            Backoff::new(Duration::from_millis(5), Duration::from_millis(20)).expect("valid");
        let lock = Lock::new(store.clone(), "lost-reply", TTL)
            .expect("valid")
            .backoff(quick);
        let guard = lock
            .acquire(Duration::from_secs(5))
            .await
            .expect("acquired once the lost grant is given back");
        let tokens = store.tokens.lock().expect("tokens").clone();
        assert!(tokens.len() >= 2, "{tokens:?}");
        assert!(
            tokens[1..].iter().all(|t| *t != tokens[0]),
            "an attempt after the failed one reused its token"
        );
        // The old token holds nothing: its give-back cannot take the lock from the guard.
        assert!(
            !store
                .unlock(b"lost-reply", &tokens[0])
                .await
                .expect("unlock")
        );
        assert!(guard.verify().await.expect("verify") > Duration::ZERO);
        guard.release().await.expect("release");
    });
}

/// After a Redlock split vote (answered "held", with a give-back still on its way to a node
/// cooling off), the next attempts use a new token: the late give-back cannot delete what they
/// are granted, and the guard keeps the lock.
#[test]
fn after_a_split_vote_the_next_ones_use_a_new_token() {
    run(Duration::from_secs(20), async {
        let store = LosesFirstGrant::new(true);
        let lock = Lock::new(store.clone(), "split-vote", TTL).expect("valid");
        let guard = lock
            .acquire(Duration::from_secs(5))
            .await
            .expect("acquired after the split vote");
        // The first attempt's give-back arrives.
        tokio::time::sleep(Duration::from_millis(150)).await;
        let tokens = store.tokens.lock().expect("tokens").clone();
        assert!(tokens.len() >= 2, "{tokens:?}");
        assert!(
            tokens[1..].iter().all(|t| *t != tokens[0]),
            "an attempt after the split vote reused its token"
        );
        assert!(guard.verify().await.expect("still ours") > Duration::ZERO);
        guard.release().await.expect("release");
    });
}

/// `verify` goes by the store's figure when it is shorter than the lease this process counted
/// (the lock renewed to a shorter ttl elsewhere, the server's clock running fast): counted from
/// before the question, minus the drift allowance; `remaining()` follows it. A figure within
/// the drift allowance is a lease lost.
#[test]
fn verify_trusts_the_stores_shorter_figure() {
    let server = server();
    run(Duration::from_secs(20), async {
        let locks = redis_locks(&server.url()).await;
        let lock = Lock::new(locks.clone(), "verified", TTL).expect("valid");
        let guard = lock.try_acquire().await.expect("ok").expect("free");
        assert!(guard.remaining() > TTL - Duration::from_secs(1));
        let key = locks.lock_key(b"verified");
        server
            .cmd(&[&b"PEXPIRE"[..], &key, b"3000"])
            .expect("PEXPIRE");
        let left = guard.verify().await.expect("held");
        // 3 s less the drift allowance (1% and 2 ms).
        assert!(
            left <= Duration::from_millis(3000 - 32) && left > Duration::from_millis(2000),
            "{left:?}"
        );
        assert!(guard.remaining() <= left, "{:?}", guard.remaining());
        server.cmd(&[&b"PEXPIRE"[..], &key, b"2"]).expect("PEXPIRE");
        let e = guard
            .verify()
            .await
            .expect_err("within the drift allowance");
        assert!(e.is_lost(), "{e}");
        assert!(guard.is_lost());
    });
}
