//! The watchdog keeps a lease alive for many ttls, and `lost()` fires when the lease is gone:
//! the server killed, restarted empty, the key deleted or overwritten by someone else; and,
//! without a watchdog, when the lease simply runs out.

mod support;

use std::time::Duration;

use floodgate_lock::{Error, LeaseLost, Lock, MemoryLocks, RedisLocks};
use support::{redis_locks, redis_locks_with, run, server};
use tokio::time::Instant;

const TTL: Duration = Duration::from_millis(600);

async fn held(locks: &RedisLocks, name: &str) -> floodgate_lock::LockGuard<RedisLocks> {
    Lock::new(locks.clone(), name, TTL)
        .expect("valid")
        .watchdog(true)
        .acquire(Duration::from_secs(5))
        .await
        .expect("acquired")
}

#[test]
fn keeps_the_lease_alive_for_many_ttls() {
    let server = server();
    run(Duration::from_secs(30), async {
        let locks = redis_locks(&server.url()).await;
        let guard = held(&locks, "long-job").await;
        let other = Lock::new(redis_locks(&server.url()).await, "long-job", TTL).expect("valid");
        for _ in 0..10 {
            tokio::time::sleep(TTL / 2).await;
            assert!(other.try_acquire().await.expect("ok").is_none());
        }
        // 3 s = 5 ttls later: still ours, on the server too.
        assert!(!guard.is_lost());
        // Renewed every TTL / 3: a third at least, with room for a late renewal.
        assert!(guard.remaining() > TTL / 3, "{:?}", guard.remaining());
        let left = guard.verify().await.expect("still held");
        assert!(left > TTL / 3, "{left:?}");
        guard.release().await.expect("released while held");
        assert!(other.try_acquire().await.expect("ok").is_some());
    });
}

#[test]
fn lost_fires_when_the_server_is_killed() {
    let server = server();
    run(Duration::from_secs(30), async {
        let locks = redis_locks_with(&server.url(), Duration::from_millis(200)).await;
        let guard = held(&locks, "killed").await;
        let lost = guard.lost();
        server.kill().expect("kill");
        let killed_at = Instant::now();
        let reason = lost.await;
        let after = killed_at.elapsed();
        eprintln!("lost ({reason}) {after:?} after the kill");
        assert_eq!(reason, LeaseLost::Expired);
        assert!(after <= TTL + Duration::from_millis(300), "{after:?}");
        assert!(guard.is_lost());
        assert_eq!(guard.remaining(), Duration::ZERO);
        assert!(guard.release().await.is_err());
    });
}

#[test]
fn lost_fires_when_the_server_restarts_empty() {
    let server = server();
    run(Duration::from_secs(30), async {
        let locks = redis_locks(&server.url()).await;
        let guard = held(&locks, "restarted").await;
        let lost = guard.lost();
        server.restart().expect("restart");
        let reason = lost.await;
        // Either a renewal found the key gone, or the server came back too late to renew.
        assert!(
            matches!(reason, LeaseLost::NotHeld | LeaseLost::Expired),
            "{reason:?}"
        );
        let e = guard.extend().await.expect_err("lost for good");
        assert!(e.is_lost(), "{e}");
    });
}

#[test]
fn lost_fires_when_the_key_is_deleted() {
    let server = server();
    run(Duration::from_secs(30), async {
        let locks = redis_locks(&server.url()).await;
        let guard = held(&locks, "deleted").await;
        let key = locks.lock_key(b"deleted");
        let lost = guard.lost();
        server.cmd(&[&b"DEL"[..], &key]).expect("DEL");
        let deleted_at = Instant::now();
        assert_eq!(lost.await, LeaseLost::NotHeld);
        // Noticed at the next renewal, within ttl / 3.
        assert!(deleted_at.elapsed() <= TTL / 3 + Duration::from_millis(300));
        let e = guard.release().await.expect_err("not ours any more");
        assert!(
            matches!(
                e,
                Error::Lost {
                    reason: LeaseLost::NotHeld,
                    ..
                }
            ),
            "{e}"
        );
    });
}

#[test]
fn lost_fires_when_the_key_is_overwritten() {
    let server = server();
    run(Duration::from_secs(30), async {
        let locks = redis_locks(&server.url()).await;
        let guard = held(&locks, "stolen").await;
        let key = locks.lock_key(b"stolen");
        let watch = guard.watch();
        server
            .cmd(&[&b"SET"[..], &key, b"someone-else", b"PX", b"60000"])
            .expect("SET");
        assert_eq!(watch.lost().await, LeaseLost::NotHeld);
        assert!(watch.is_lost());
        // The intruder's value is untouched: we never release someone else's lock.
        let e = guard.release().await.expect_err("not ours");
        assert!(e.is_lost());
        let value = server.cmd(&[&b"GET"[..], &key]).expect("GET");
        assert_eq!(value.as_str(), Some("someone-else"));
    });
}

#[test]
fn without_a_watchdog_lost_fires_when_the_lease_ends() {
    run(Duration::from_secs(30), async {
        let ttl = Duration::from_millis(300);
        let lock = Lock::new(MemoryLocks::new(), "short", ttl).expect("valid");
        let started = Instant::now();
        let guard = lock
            .acquire(Duration::from_secs(1))
            .await
            .expect("acquired");
        assert_eq!(guard.lost().await, LeaseLost::Expired);
        assert!(started.elapsed() >= ttl);
        // Once lost, an extension is refused even if the store would still take it.
        assert!(guard.extend().await.expect_err("expired").is_lost());
    });
}

#[test]
fn run_cancels_the_critical_section_when_the_lease_is_lost() {
    let server = server();
    run(Duration::from_secs(30), async {
        let locks = redis_locks(&server.url()).await;
        let lock = Lock::new(locks.clone(), "cancel", TTL)
            .expect("valid")
            .watchdog(true);
        let key = locks.lock_key(b"cancel");
        let started = Instant::now();
        let outcome = lock
            .run(Duration::from_secs(5), |_fence| async {
                tokio::time::sleep(Duration::from_millis(100)).await;
                server.cmd(&[&b"DEL"[..], &key]).expect("DEL");
                tokio::time::sleep(Duration::from_secs(60)).await;
            })
            .await;
        let e = outcome.expect_err("cancelled");
        assert!(e.is_lost(), "{e}");
        assert!(started.elapsed() < Duration::from_secs(5));
        // And a section that finishes in time returns its output.
        assert!(
            lock.run(Duration::from_secs(5), |fence| async move { fence > 0 })
                .await
                .expect("ran")
        );
    });
}

#[test]
fn a_shorter_extend_for_is_what_the_guard_trusts() {
    let server = server();
    run(Duration::from_secs(30), async {
        let locks = redis_locks(&server.url()).await;
        let guard = Lock::new(locks.clone(), "shortened", Duration::from_secs(60))
            .expect("valid")
            .acquire(Duration::from_secs(5))
            .await
            .expect("acquired");
        guard
            .extend_for(Duration::from_millis(500))
            .await
            .expect("extended");
        // The store now expires the key within half a second: so does the guard.
        assert!(
            guard.remaining() <= Duration::from_millis(500),
            "{:?}",
            guard.remaining()
        );
        tokio::time::sleep(Duration::from_millis(700)).await;
        let other = Lock::new(locks, "shortened", Duration::from_secs(60)).expect("valid");
        assert!(other.try_acquire().await.expect("ok").is_some());
        assert!(
            guard.is_lost(),
            "another holder has it, and the guard says it is ours"
        );
    });
}

#[test]
fn the_watchdog_renews_a_lease_shortened_by_extend_for() {
    let server = server();
    run(Duration::from_secs(30), async {
        let locks = redis_locks(&server.url()).await;
        // Renewed every 2 s by default; shortened to 1 s.
        let guard = Lock::new(locks.clone(), "short-watch", Duration::from_secs(6))
            .expect("valid")
            .watchdog(true)
            .acquire(Duration::from_secs(5))
            .await
            .expect("acquired");
        guard
            .extend_for(Duration::from_secs(1))
            .await
            .expect("extended");
        let other = Lock::new(locks, "short-watch", Duration::from_secs(6)).expect("valid");
        for _ in 0..5 {
            tokio::time::sleep(Duration::from_millis(500)).await;
            assert!(other.try_acquire().await.expect("ok").is_none());
        }
        assert!(!guard.is_lost());
        guard.verify().await.expect("still held");
        guard.release().await.expect("released while held");
    });
}

#[test]
fn the_watchdog_renews_a_lease_shortened_right_after_its_own_renewal() {
    let server = server();
    run(Duration::from_secs(30), async {
        let locks = redis_locks(&server.url()).await;
        // Renewed every 2 s, and at the latest 600 ms before the deadline, but never sooner
        // than 600 ms after its last renewal.
        let guard = Lock::new(locks.clone(), "short-after", Duration::from_secs(6))
            .expect("valid")
            .watchdog(true)
            .acquire(Duration::from_secs(5))
            .await
            .expect("acquired");
        // Just after the watchdog's first renewal (at 2 s), shortened to end before 2.6 s.
        tokio::time::sleep(Duration::from_millis(2_200)).await;
        guard
            .extend_for(Duration::from_millis(300))
            .await
            .expect("extended");
        tokio::time::sleep(Duration::from_millis(700)).await;
        assert!(!guard.is_lost());
        let other = Lock::new(locks, "short-after", Duration::from_secs(6)).expect("valid");
        assert!(other.try_acquire().await.expect("ok").is_none());
        guard.verify().await.expect("still held");
        guard.release().await.expect("released while held");
    });
}
