//! Mutual exclusion under contention: 16 tasks over 4 client instances take one lock
//! 2,000 times (fewer on a cluster and on Redlock); no two critical sections overlap and the
//! fencing tokens strictly increase, in memory, on one Redis node, on a cluster and on
//! Redlock. Holders that overrun their lease are refused by the fencing check.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use floodgate_lock::{FencedResource, Lock, MemoryLocks, RedisLocks, Redlock};
use floodgate_redis::RedisConn;
use redis::Script;
use support::{
    assert_exclusive, cluster, cluster_locks, contend, redis_locks, run, server, servers,
};

const TASKS: usize = 16;
const CLIENTS: usize = 4;
const TTL: Duration = Duration::from_secs(10);

fn redis_locks_of(clients: &[RedisLocks], name: &str) -> Vec<Lock<RedisLocks>> {
    clients
        .iter()
        .map(|c| Lock::new(c.clone(), name, TTL).expect("valid lock"))
        .collect()
}

/// Each critical section appends its fence to the Redis list `key`.
fn push_to(
    conn: RedisConn,
    key: &'static str,
) -> impl Fn(u64) -> futures_util::future::BoxFuture<'static, ()> + Clone {
    move |fence: u64| {
        let conn = conn.clone();
        Box::pin(async move {
            let mut cmd = redis::cmd("RPUSH");
            cmd.arg(key).arg(fence);
            let _: i64 = conn.query(cmd).await.expect("RPUSH");
        })
    }
}

async fn redis_list(conn: &RedisConn, key: &str) -> Vec<u64> {
    let mut cmd = redis::cmd("LRANGE");
    cmd.arg(key).arg(0).arg(-1);
    conn.query(cmd).await.expect("LRANGE")
}

fn assert_strictly_increasing(fences: &[u64], expected: usize) {
    assert_eq!(fences.len(), expected);
    assert!(
        fences.windows(2).all(|w| w[1] > w[0]),
        "the Redis log is not strictly increasing"
    );
}

#[test]
fn memory_locks_exclude() {
    run(Duration::from_secs(60), async {
        let store = MemoryLocks::new();
        let locks: Vec<_> = (0..CLIENTS)
            .map(|_| Lock::new(store.clone(), "campaign", TTL).expect("valid"))
            .collect();
        let log = contend(locks, TASKS, 2_000, |_| async {
            tokio::task::yield_now().await;
        })
        .await;
        assert_exclusive(&log, 2_000);
    });
}

#[test]
fn single_node_locks_exclude() {
    let server = server();
    run(Duration::from_secs(120), async {
        let mut clients = Vec::new();
        for _ in 0..CLIENTS {
            clients.push(redis_locks(&server.url()).await);
        }
        let conn = clients[0].conn().clone();
        let log = contend(
            redis_locks_of(&clients, "campaign"),
            TASKS,
            2_000,
            push_to(conn.clone(), "exclusion-log"),
        )
        .await;
        assert_exclusive(&log, 2_000);
        assert_strictly_increasing(&redis_list(&conn, "exclusion-log").await, 2_000);
        // Released: no lock key is left, only the fencing counter, with a TTL.
        let lock_key = clients[0].lock_key(b"campaign");
        let fence_key = clients[0].fence_key(b"campaign");
        let exists: i64 = conn
            .query(redis::cmd("EXISTS").arg(&lock_key).clone())
            .await
            .expect("EXISTS");
        assert_eq!(exists, 0);
        let pttl: i64 = conn
            .query(redis::cmd("PTTL").arg(&fence_key).clone())
            .await
            .expect("PTTL");
        assert!(pttl > 0, "the fencing counter has a TTL: {pttl}");
    });
}

#[test]
fn cluster_locks_exclude() {
    let cluster = cluster();
    run(Duration::from_secs(180), async {
        let mut clients = Vec::new();
        for _ in 0..CLIENTS {
            clients.push(cluster_locks(&cluster).await);
        }
        let log = contend(
            redis_locks_of(&clients, "campaign-on-cluster"),
            TASKS,
            500,
            |_| async {},
        )
        .await;
        assert_exclusive(&log, 500);
    });
}

#[test]
fn redlock_excludes() {
    let servers = servers(5);
    run(Duration::from_secs(180), async {
        let mut clients = Vec::new();
        for _ in 0..CLIENTS {
            let mut nodes = Vec::new();
            for s in servers.iter() {
                nodes.push(redis_locks(&s.url()).await);
            }
            clients.push(Redlock::new(nodes).expect("nodes"));
        }
        let locks = clients
            .iter()
            .map(|c| Lock::new(c.clone(), "report", TTL).expect("valid"))
            .collect();
        let log = contend(locks, TASKS, 300, |_| async {}).await;
        assert_exclusive(&log, 300);
    });
}

/// Leases of 60 ms; every third critical section sleeps 150 ms between its writes, so its
/// lease lapses and another holder takes over. Returns (writes accepted in order, writes
/// refused, holders whose release found the lease gone).
async fn overrun<S>(
    locks: Vec<Lock<S>>,
    write: impl Fn(u64) -> futures_util::future::BoxFuture<'static, bool>
    + Clone
    + Send
    + Sync
    + 'static,
) -> (usize, usize)
where
    S: floodgate_lock::LockStore + Clone + std::fmt::Debug,
    floodgate_lock::Error: From<S::Error>,
{
    let refused = Arc::new(AtomicUsize::new(0));
    let late = Arc::new(AtomicUsize::new(0));
    let round = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for t in 0..8 {
        let lock = locks[t % locks.len()].clone();
        let (refused, late, round, write) = (
            Arc::clone(&refused),
            Arc::clone(&late),
            Arc::clone(&round),
            write.clone(),
        );
        tasks.push(tokio::spawn(async move {
            while round.fetch_add(1, Ordering::SeqCst) < 60 {
                let guard = lock
                    .acquire(Duration::from_secs(30))
                    .await
                    .expect("acquire");
                let slow = fastrand::usize(..3) == 0;
                for _ in 0..3 {
                    if !write(guard.fence()).await {
                        refused.fetch_add(1, Ordering::SeqCst);
                    }
                    let pause = if slow { 150 } else { 2 };
                    tokio::time::sleep(Duration::from_millis(pause)).await;
                }
                if let Err(e) = guard.release().await {
                    assert!(e.is_lost(), "{e}");
                    late.fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    (refused.load(Ordering::SeqCst), late.load(Ordering::SeqCst))
}

#[test]
fn overrunning_holders_are_fenced_off_in_memory() {
    run(Duration::from_secs(120), async {
        let store = MemoryLocks::new();
        let ttl = Duration::from_millis(60);
        let locks = (0..CLIENTS)
            .map(|_| Lock::new(store.clone(), "overrun", ttl).expect("valid"))
            .collect();
        let resource = Arc::new(FencedResource::new(Vec::<u64>::new()));
        let r = Arc::clone(&resource);
        let (refused, late) = overrun(locks, move |fence| {
            let r = Arc::clone(&r);
            Box::pin(async move { r.write(fence, |log| log.push(fence)).is_ok() })
        })
        .await;
        let accepted = resource.read(Clone::clone);
        assert!(
            accepted.windows(2).all(|w| w[1] >= w[0]),
            "a stale write got through: {accepted:?}"
        );
        assert!(late > 0, "no holder overran its lease");
        assert!(refused > 0, "no stale write was refused");
        eprintln!(
            "memory: {} writes accepted, {refused} refused, {late} late holders",
            accepted.len()
        );
    });
}

/// The protected resource is in Redis: a write is admitted only if its fence is at least the
/// highest admitted (one script, so check and write are atomic).
const FENCED_APPEND: &str = r"
local highest = tonumber(redis.call('GET', KEYS[1]) or '0')
local fence = tonumber(ARGV[1])
if fence < highest then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('RPUSH', KEYS[2], ARGV[1])
return 1
";

#[test]
fn overrunning_holders_are_fenced_off_on_redis() {
    let server = server();
    run(Duration::from_secs(120), async {
        let mut clients = Vec::new();
        for _ in 0..CLIENTS {
            clients.push(redis_locks(&server.url()).await);
        }
        let conn = clients[0].conn().clone();
        let ttl = Duration::from_millis(60);
        let locks = clients
            .iter()
            .map(|c| Lock::new(c.clone(), "overrun", ttl).expect("valid"))
            .collect();
        let script = Arc::new(Script::new(FENCED_APPEND));
        let c = conn.clone();
        let (refused, late) = overrun(locks, move |fence| {
            let (c, script) = (c.clone(), Arc::clone(&script));
            Box::pin(async move {
                let fence = fence.to_string();
                let admitted = c
                    .invoke_script(
                        &script,
                        &[b"resource:{r}:highest", b"resource:{r}:log"],
                        &[fence.as_bytes()],
                    )
                    .await
                    .expect("fenced append");
                admitted == redis::Value::Int(1)
            })
        })
        .await;
        let accepted = redis_list(&conn, "resource:{r}:log").await;
        assert!(
            accepted.windows(2).all(|w| w[1] >= w[0]),
            "a stale write got through: {accepted:?}"
        );
        assert!(late > 0, "no holder overran its lease");
        assert!(refused > 0, "no stale write was refused");
        eprintln!(
            "redis: {} writes accepted, {refused} refused, {late} late holders",
            accepted.len()
        );
    });
}
