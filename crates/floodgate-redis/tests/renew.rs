//! `Limiter::renew` against real Redis: a renewed lease outlives its TTL, a released or lapsed
//! one is not taken again, and a corrupt lease end is a typed error that changes nothing.

mod support;

use std::time::Duration;

use floodgate_core::{Check, CheckOptions, ConcurrencyLease, Limiter, Policy, Timestamp};
use floodgate_redis::ConnectionKind;

use support::{limiter, run, server};

const LIMIT: Duration = Duration::from_secs(60);
const T0: u64 = 1_709_214_330_000_000;
const MS: u64 = 1_000;

fn at(ms: u64) -> CheckOptions {
    CheckOptions::at(Timestamp::from_micros(T0 + ms * MS))
}

#[test]
fn a_renewed_lease_outlives_its_ttl_and_a_lapsed_one_is_not_taken_again() {
    let server = server();
    run(LIMIT, async {
        let redis = limiter(&server.url(), ConnectionKind::Multiplexed).await;
        let one = Policy::concurrency(1, Duration::from_secs(1)).expect("valid");
        let checks = [Check::new(b"worker".as_slice(), &one)];
        let first = redis.check(&checks, at(0)).await.expect("checks");
        let lease = first.lease.expect("a lease");
        // Renewed at 0.8 s: held until 1.8 s.
        let when = |ms| Some(Timestamp::from_micros(T0 + ms * MS));
        assert!(
            redis
                .renew_at(&checks, lease, when(800))
                .await
                .expect("renews")
        );
        assert!(
            !redis
                .check(&checks, at(1_500))
                .await
                .expect("checks")
                .allowed()
        );
        // Not renewed again: it lapses at 1.8 s, and a late renewal does not bring it back.
        assert!(
            !redis
                .renew_at(&checks, lease, when(1_900))
                .await
                .expect("renews")
        );
        let second = redis.check(&checks, at(1_900)).await.expect("checks");
        assert!(second.allowed());
        // A released lease is not renewed either.
        let lease = second.lease.expect("a lease");
        redis
            .release_at(&checks, lease, when(1_950))
            .await
            .expect("releases");
        assert!(
            !redis
                .renew_at(&checks, lease, when(2_000))
                .await
                .expect("renews")
        );
    });
}

#[test]
fn a_concurrency_lease_handle_renews_through_the_limiter() {
    let server = server();
    run(LIMIT, async {
        let redis = limiter(&server.url(), ConnectionKind::Multiplexed).await;
        let one = Policy::concurrency(1, Duration::from_millis(300)).expect("valid");
        let checks = [Check::new(b"handle".as_slice(), &one)];
        let (verdict, lease) = ConcurrencyLease::check(&redis, &checks, CheckOptions::default())
            .await
            .expect("checks");
        assert!(verdict.allowed());
        let lease = lease.expect("a lease");
        for _ in 0..4 {
            tokio::time::sleep(Duration::from_millis(150)).await;
            assert!(lease.renew().await.expect("renews"));
        }
        // 600 ms in, twice the TTL: still the only holder.
        let other = redis
            .check(&checks, CheckOptions::default())
            .await
            .expect("checks");
        assert!(!other.allowed());
        lease.release().await.expect("releases");
    });
}

/// Renewed in the background, a lease handle outlives its TTL in Redis; when Redis loses the
/// lease (flushed, or failed over to a replica that never had it), the next renewal finds it
/// gone and `lost` resolves, long before the TTL.
#[test]
fn a_lease_renewed_in_the_background_is_lost_when_redis_loses_it() {
    let server = server();
    run(LIMIT, async {
        let redis = limiter(&server.url(), ConnectionKind::Multiplexed).await;
        let one = Policy::concurrency(1, Duration::from_millis(1_500)).expect("valid");
        let checks = [Check::new(b"background".as_slice(), &one)];
        let (_, lease) = ConcurrencyLease::check(&redis, &checks, CheckOptions::default())
            .await
            .expect("checks");
        let lease = lease.expect("a lease").renew_up_to(Duration::from_secs(60));
        // Renewed every 500 ms: held well past its TTL.
        tokio::time::sleep(Duration::from_millis(2_000)).await;
        assert!(!lease.is_lost(), "lost while renewed");
        let other = redis
            .check(&checks, CheckOptions::default())
            .await
            .expect("checks");
        assert!(!other.allowed(), "the lease lapsed in Redis");
        server.cmd_ok(&["FLUSHALL"]).expect("flushall");
        let began = tokio::time::Instant::now();
        tokio::time::timeout(Duration::from_secs(10), lease.lost())
            .await
            .expect("the lease was never lost");
        let took = began.elapsed();
        assert!(
            took < Duration::from_millis(900),
            "lost at its TTL, not at the renewal that found it gone: {took:?}"
        );
        assert!(lease.is_lost());
    });
}

#[test]
fn a_corrupt_lease_end_is_a_typed_error_and_changes_nothing() {
    let server = server();
    run(LIMIT, async {
        let redis = limiter(&server.url(), ConnectionKind::Multiplexed).await;
        let one = Policy::concurrency(2, Duration::from_secs(60)).expect("valid");
        let checks = [Check::new(b"victim".as_slice(), &one)];
        let v = redis
            .check(&checks, CheckOptions::default())
            .await
            .expect("checks");
        let lease = v.lease.expect("a lease");
        let key = redis.state_key(&one, b"victim");
        server
            .cmd(&[b"ZADD".as_slice(), &key, b"inf", b"junk:1"])
            .expect("zadd");
        let before = server
            .cmd(&[b"ZRANGE".as_slice(), &key, b"0", b"-1", b"WITHSCORES"])
            .expect("zrange");
        let err = redis
            .renew(&checks, lease)
            .await
            .expect_err("a corrupt lease end");
        assert!(err.is_corrupted(), "{err:?}");
        let after = server
            .cmd(&[b"ZRANGE".as_slice(), &key, b"0", b"-1", b"WITHSCORES"])
            .expect("zrange");
        assert_eq!(format!("{before:?}"), format!("{after:?}"));
    });
}
