//! Lock throughput and hand-off latency, against a local redis-server started by
//! floodgate-testkit, side by side with the seed article's design (try `SET NX PX`, sleep a
//! fixed 500 ms, try again).
//!
//! `cargo bench -p floodgate-lock`
//!
//! - uncontended: one task taking and releasing one lock in a loop (pairs per second), and
//!   16 tasks on 16 different locks (aggregate pairs per second);
//! - hand-off: 8 tasks over 4 clients contend for one lock; each holds it 5 ms, releases, and
//!   competes again 1 ms after another task took it (no barging; it always finds the lock
//!   held, so every acquisition is by a waiter). A sample is the time from the holder calling
//!   `release` to the next holder's `acquire` returning.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use floodgate_core::{LockAttempt, LockStore};
use floodgate_lock::{Backoff, Lock, MemoryLocks, RedisLocks};
use floodgate_redis::{RedisConfig, RedisConn};
use floodgate_testkit::RedisServer;

const TTL: Duration = Duration::from_secs(10);
const CONTENDERS: usize = 8;
const CLIENTS: usize = 4;
const HOLD: Duration = Duration::from_millis(5);
const OUTSIDE: Duration = Duration::from_millis(1);

fn main() {
    let server = RedisServer::start().expect("start redis-server (run scripts/install-redis)");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(bench(&server));
}

async fn bench(server: &RedisServer) {
    let url = server.url();
    println!("floodgate-lock bench: redis-server on {url}, 2 tokio workers");
    println!("{}", load());

    println!("\n## uncontended acquire + release pairs per second");
    println!("{:<44} {:>12}", "store", "pairs/s");
    let memory = MemoryLocks::new();
    let redis = clients(&url, 1, true).await.remove(0);
    report_pairs(
        "memory, 1 task",
        pairs(std::slice::from_ref(&memory), 1, 2.0).await,
    );
    report_pairs(
        "memory, 16 tasks x own lock",
        pairs(std::slice::from_ref(&memory), 16, 2.0).await,
    );
    report_pairs(
        "redis, 1 task",
        pairs(std::slice::from_ref(&redis), 1, 3.0).await,
    );
    report_pairs(
        "redis, 16 tasks x own lock",
        pairs(std::slice::from_ref(&redis), 16, 3.0).await,
    );

    println!(
        "\n## hand-off latency: {CONTENDERS} tasks over {CLIENTS} clients, hold {HOLD:?}, outside {OUTSIDE:?}"
    );
    println!(
        "{:<44} {:>7} {:>10} {:>10} {:>10}",
        "waiting by", "samples", "p50", "p99", "max"
    );
    let memory_locks = vec![MemoryLocks::new(); CLIENTS];
    report(
        "memory: Notify",
        handoff(&memory_locks, Waiting::Lock(Backoff::DEFAULT), 1_000).await,
    );
    let notified = clients(&url, CLIENTS, true).await;
    report(
        "redis: pub/sub release notification",
        handoff(&notified, Waiting::Lock(Backoff::DEFAULT), 1_000).await,
    );
    let silent = clients(&url, CLIENTS, false).await;
    report(
        "redis: jittered backoff only (5-250 ms)",
        handoff(&silent, Waiting::Lock(Backoff::DEFAULT), 150).await,
    );
    report(
        "redis: fixed 500 ms polling (seed article)",
        handoff(&silent, Waiting::Poll(Duration::from_millis(500)), 60).await,
    );
    println!("\none waiter only:");
    report(
        "redis: pub/sub release notification, 1 waiter",
        handoff_pair(&notified, Waiting::Lock(Backoff::DEFAULT), 300).await,
    );
    report(
        "redis: fixed 500 ms polling, 1 waiter",
        handoff_pair(&silent, Waiting::Poll(Duration::from_millis(500)), 16).await,
    );
    println!("\n{}", load());
}

async fn clients(url: &str, n: usize, notifications: bool) -> Vec<RedisLocks> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let config = RedisConfig::new(url)
            .expect("URL")
            .timeout(Duration::from_secs(2));
        let conn = RedisConn::connect(&config).await.expect("connect");
        let builder = RedisLocks::builder(conn);
        let builder = if notifications {
            builder.notifications([url]).expect("URL")
        } else {
            builder
        };
        out.push(builder.build());
    }
    out
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg").map_or_else(
        |_| "load: unknown".to_owned(),
        |l| {
            format!(
                "load average (1/5/15 min): {}",
                l.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
            )
        },
    )
}

fn report_pairs(label: &str, per_second: f64) {
    println!("{label:<44} {per_second:>12.0}");
}

/// `tasks` tasks, each on its own lock name, acquire and release for `secs` seconds.
async fn pairs<S>(stores: &[S], tasks: usize, secs: f64) -> f64
where
    S: LockStore + Clone + std::fmt::Debug,
    floodgate_lock::Error: From<S::Error>,
{
    let done = Arc::new(AtomicUsize::new(0));
    let until = Instant::now() + Duration::from_secs_f64(secs);
    let started = Instant::now();
    let mut handles = Vec::new();
    for t in 0..tasks {
        let lock =
            Lock::new(stores[t % stores.len()].clone(), format!("pairs-{t}"), TTL).expect("valid");
        let done = Arc::clone(&done);
        handles.push(tokio::spawn(async move {
            while Instant::now() < until {
                let guard = lock
                    .try_acquire()
                    .await
                    .expect("store")
                    .expect("uncontended");
                guard.release().await.expect("release");
                done.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for h in handles {
        h.await.expect("task");
    }
    done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
}

#[derive(Clone, Copy)]
enum Waiting {
    /// `Lock::acquire`: release notification + jittered backoff.
    Lock(Backoff),
    /// Try, sleep a fixed interval, try again.
    Poll(Duration),
}

type Held = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Takes the lock `name` by `waiting`; returns its release.
async fn take<S>(store: &S, name: &str, waiting: Waiting) -> Held
where
    S: LockStore + Clone + std::fmt::Debug,
    floodgate_lock::Error: From<S::Error>,
{
    match waiting {
        Waiting::Lock(backoff) => {
            let lock = Lock::new(store.clone(), name, TTL)
                .expect("valid")
                .backoff(backoff);
            let guard = lock
                .acquire(Duration::from_secs(60))
                .await
                .expect("acquired");
            Box::pin(async move { guard.release().await.expect("release") })
        }
        Waiting::Poll(every) => {
            let token = format!("{:032x}", fastrand::u128(..));
            loop {
                match store.try_lock(name.as_bytes(), token.as_bytes(), TTL).await {
                    Ok(LockAttempt::Acquired { .. }) => break,
                    Ok(LockAttempt::Held { .. }) => tokio::time::sleep(every).await,
                    Err(e) => panic!("store: {e}"),
                }
            }
            let (store, name) = (store.clone(), name.to_owned());
            Box::pin(async move {
                store
                    .unlock(name.as_bytes(), token.as_bytes())
                    .await
                    .expect("unlock");
            })
        }
    }
}

/// Hand-off latencies, in the order observed. A task that released waits until another task
/// has taken the lock before it competes again (no barging), so each sample is a real hand-off
/// to a task that was waiting.
async fn handoff<S>(stores: &[S], waiting: Waiting, samples: usize) -> Vec<Duration>
where
    S: LockStore + Clone + std::fmt::Debug,
    floodgate_lock::Error: From<S::Error>,
{
    let name = format!("handoff-{}", fastrand::u64(..));
    // When the last holder called release.
    let last: Arc<Mutex<Option<Instant>>> = Arc::default();
    let out: Arc<Mutex<Vec<Duration>>> = Arc::default();
    // (acquisitions so far, finished)
    let (progress, _) = tokio::sync::watch::channel((0_u64, false));
    let progress = Arc::new(progress);
    let mut handles = Vec::new();
    for t in 0..CONTENDERS {
        let store = stores[t % stores.len()].clone();
        let (last, out, name, progress) = (
            Arc::clone(&last),
            Arc::clone(&out),
            name.clone(),
            Arc::clone(&progress),
        );
        handles.push(tokio::spawn(async move {
            loop {
                if progress.borrow().1 {
                    return;
                }
                let release = take(&store, &name, waiting).await;
                let now = Instant::now();
                let mut mine = 0;
                progress.send_modify(|(n, _)| {
                    *n += 1;
                    mine = *n;
                });
                let released_at = last.lock().unwrap_or_else(PoisonError::into_inner).take();
                let enough = {
                    let mut out = out.lock().unwrap_or_else(PoisonError::into_inner);
                    if let Some(at) = released_at {
                        out.push(now - at);
                    }
                    out.len() >= samples
                };
                if enough {
                    progress.send_modify(|(_, done)| *done = true);
                    release.await;
                    return;
                }
                tokio::time::sleep(HOLD).await;
                *last.lock().unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
                release.await;
                let mut rx = progress.subscribe();
                let _ = rx.wait_for(|&(n, done)| n > mine || done).await;
                tokio::time::sleep(OUTSIDE).await;
            }
        }));
    }
    for h in handles {
        h.await.expect("task");
    }
    Arc::try_unwrap(out)
        .expect("every task is done")
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner)
}

/// One holder, one waiter: the holder takes the lock, the waiter starts waiting, the holder
/// releases after a random 20-60 ms.
async fn handoff_pair<S>(stores: &[S], waiting: Waiting, samples: usize) -> Vec<Duration>
where
    S: LockStore + Clone + std::fmt::Debug,
    floodgate_lock::Error: From<S::Error>,
{
    let name = format!("pair-{}", fastrand::u64(..));
    let mut out = Vec::with_capacity(samples);
    for _ in 0..samples {
        let release = take(&stores[0], &name, waiting).await;
        let store = stores[1 % stores.len()].clone();
        let n = name.clone();
        let waiter = tokio::spawn(async move {
            let release = take(&store, &n, waiting).await;
            (Instant::now(), release)
        });
        tokio::time::sleep(Duration::from_millis(fastrand::u64(20..60))).await;
        let released_at = Instant::now();
        release.await;
        let (acquired_at, release) = waiter.await.expect("waiter");
        out.push(acquired_at - released_at);
        release.await;
    }
    out
}

fn report(label: &str, mut samples: Vec<Duration>) {
    samples.sort_unstable();
    let at = |q: f64| -> Duration {
        let i = ((samples.len() as f64 * q).ceil() as usize).clamp(1, samples.len()) - 1;
        samples[i]
    };
    println!(
        "{label:<44} {:>7} {:>10} {:>10} {:>10}",
        samples.len(),
        fmt(at(0.50)),
        fmt(at(0.99)),
        fmt(at(1.0))
    );
}

fn fmt(d: Duration) -> String {
    if d < Duration::from_millis(10) {
        format!("{:.3} ms", d.as_secs_f64() * 1e3)
    } else {
        format!("{:.1} ms", d.as_secs_f64() * 1e3)
    }
}
