//! Shared set-up of the lock tests: real servers from the testkit, bounded runtimes, and the
//! checker of a critical-section log.

#![allow(dead_code, unreachable_pub, unused_imports)]

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use floodgate_lock::{Lock, LockStore, RedisLocks};
use floodgate_redis::{ConnectionKind, RedisConfig, RedisConn};
use floodgate_testkit::RedisCluster;
pub use floodgate_testkit::{cluster, run, server, servers};
use tokio::time::Instant;

/// A lock client on `url` with a generous call timeout (the machine is shared) and release
/// notifications.
pub async fn redis_locks(url: &str) -> RedisLocks {
    redis_locks_with(url, Duration::from_secs(1)).await
}

pub async fn redis_locks_with(url: &str, timeout: Duration) -> RedisLocks {
    let config = RedisConfig::new(url)
        .expect("valid URL")
        .connection(ConnectionKind::Multiplexed)
        .timeout(timeout);
    let conn = RedisConn::connect(&config).await.expect("connect");
    RedisLocks::builder(conn)
        .notifications([url])
        .expect("valid URL")
        .build()
}

/// A lock client without release notifications (backoff only).
pub async fn redis_locks_silent(url: &str) -> RedisLocks {
    let config = RedisConfig::new(url)
        .expect("valid URL")
        .timeout(Duration::from_secs(1));
    RedisLocks::builder(RedisConn::connect(&config).await.expect("connect")).build()
}

pub async fn cluster_locks(cluster: &RedisCluster) -> RedisLocks {
    let config = RedisConfig::from_urls(cluster.urls())
        .expect("valid URLs")
        .connection(ConnectionKind::Cluster)
        .timeout(Duration::from_secs(2));
    let conn = RedisConn::connect(&config).await.expect("connect");
    RedisLocks::builder(conn)
        .notifications(cluster.urls())
        .expect("valid URLs")
        .build()
}

/// One critical section: its fencing token and when it began and ended.
#[derive(Debug, Clone, Copy)]
pub struct Section {
    pub fence: u64,
    pub entered: Instant,
    pub left: Instant,
}

pub type Log = Arc<Mutex<Vec<Section>>>;

/// `tasks` tasks spread over `locks` (one `Lock` per client instance) take the lock
/// `total` times in all; each critical section appends to the log, and also calls `inside`
/// (e.g. to write to a Redis list). Returns the log.
pub async fn contend<S, F, Fut>(
    locks: Vec<Lock<S>>,
    tasks: usize,
    total: usize,
    inside: F,
) -> Vec<Section>
where
    S: LockStore + Clone + std::fmt::Debug,
    floodgate_lock::Error: From<S::Error>,
    F: Fn(u64) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send,
{
    let log: Log = Arc::default();
    let taken = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut handles = Vec::new();
    for t in 0..tasks {
        let lock = locks[t % locks.len()].clone();
        let (log, taken, inside) = (Arc::clone(&log), Arc::clone(&taken), inside.clone());
        handles.push(tokio::spawn(async move {
            loop {
                if taken.fetch_add(1, std::sync::atomic::Ordering::SeqCst) >= total {
                    return;
                }
                let guard = lock
                    .acquire(Duration::from_secs(30))
                    .await
                    .unwrap_or_else(|e| panic!("acquire: {e}"));
                let entered = Instant::now();
                inside(guard.fence()).await;
                let left = Instant::now();
                log.lock().expect("log").push(Section {
                    fence: guard.fence(),
                    entered,
                    left,
                });
                guard
                    .release()
                    .await
                    .unwrap_or_else(|e| panic!("release: {e}"));
            }
        }));
    }
    for h in handles {
        h.await.expect("task");
    }
    Arc::try_unwrap(log)
        .expect("every task is done")
        .into_inner()
        .expect("log")
}

/// No two sections overlap, and fencing tokens strictly increase in the order of entry.
pub fn assert_exclusive(log: &[Section], expected: usize) {
    assert_eq!(log.len(), expected, "every acquisition is logged");
    let mut sorted = log.to_vec();
    sorted.sort_by_key(|s| s.entered);
    for pair in sorted.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        assert!(
            b.entered >= a.left,
            "overlapping holders: fence {} held {:?}..{:?}, fence {} entered at {:?}",
            a.fence,
            a.entered,
            a.left,
            b.fence,
            b.entered
        );
        assert!(
            b.fence > a.fence,
            "fencing tokens not increasing: {} then {}",
            a.fence,
            b.fence
        );
    }
}

/// How many scripts `server` has run (`EVALSHA` and `EVAL`).
pub fn scripts_run(server: &floodgate_testkit::RedisServer) -> u64 {
    let info = server.cmd(&["INFO", "commandstats"]).expect("INFO");
    let text = info.as_str().map(str::to_owned).unwrap_or_default();
    text.lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .filter_map(|l| l.split("calls=").nth(1))
        .filter_map(|rest| rest.split(',').next())
        .filter_map(|n| n.parse::<u64>().ok())
        .sum()
}
