//! The chaos suite on Redis Cluster: a master killed under load from the limiter and the lock,
//! its replica promoted by the cluster itself, and both carrying on over the new topology.
//! Prints `FIGURE:` lines for docs/failure-modes.md (see `tests/chaos.rs`).

mod support;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use floodgate::lock::{FencedResource, LeaseLost, Lock, RedisLocks};
use floodgate::redis::{
    BreakerConfig, ConnectionKind, Error, RedisConfig, RedisConn, RedisLimiter,
};
use floodgate::{Limiter, Policy};
use floodgate_testkit::{RedisCluster, Role};
use support::{Latencies, Load, LoadSpec, Sample, cluster, figure, ms, panics, run};
use tokio::time::Instant;

/// floodgate-redis' default call timeout.
const REDIS_TIMEOUT: Duration = floodgate::redis::DEFAULT_TIMEOUT;
/// Scheduling slack on a shared two-core machine.
const MARGIN: Duration = Duration::from_millis(250);
/// How long the cluster may take to promote the replica by itself (node timeout 2 s, then an
/// election) before the test forces it with `CLUSTER FAILOVER FORCE`.
const AUTO_FAILOVER_PATIENCE: Duration = Duration::from_secs(15);
const KEYS: usize = 48;
const TASKS: usize = 16;
const LOCK_TTL: Duration = Duration::from_secs(1);
/// The lock that lives on another master: long enough that renewals have slack.
const BYSTANDER_TTL: Duration = Duration::from_secs(3);
/// Calls may still fail this long after the cluster is healthy again (the client's slot map
/// and the breaker's next probe); none after.
const SETTLED: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, PartialEq, Eq)]
enum Call {
    Ok,
    Failed(String),
    Strange(String),
}

#[derive(Debug, Clone)]
struct Checked {
    key: usize,
    call: Call,
}

fn classify(result: Result<floodgate::Decision, Error>) -> Call {
    match result {
        Ok(_) => Call::Ok,
        Err(e) if e.is_timeout() || e.is_connection() => Call::Failed(e.to_string()),
        Err(e) => Call::Strange(format!("{e:?}")),
    }
}

/// A lock name whose key is served by master `on` (`want == true`) or by another master.
fn lock_name(cluster: &RedisCluster, locks: &RedisLocks, on: usize, want: bool) -> String {
    (0..10_000)
        .map(|i| format!("campaign-{i}"))
        .find(|name| {
            let node = cluster
                .node_for_key(&locks.lock_key(name.as_bytes()))
                .expect("slot owner");
            (node == on) == want
        })
        .expect("a name on that master")
}

/// What a failover did to the keys of the masters that stayed up.
#[derive(Debug)]
struct Measured {
    other_calls: usize,
    other_errors: usize,
    other_error_window: Duration,
    /// Errors that are neither connection errors nor timeouts.
    untyped: Vec<String>,
    /// Whether the lock held on a master that stayed up was lost.
    bystander_lost: bool,
}

/// A master of a 3 x 2 cluster is killed while 16 tasks check 48 keys through one limiter
/// (default settings but `breaker`), a lock on that master is held, and another lock is held
/// on another master; the cluster promotes the replica by itself (forced after 15 s). Checks,
/// and prints figures under `label`:
/// - no panic; every call ends within twice the call timeout (plus slack: batching, see
///   `chaos_batched_checks_fail_within_the_call_timeout`) with a decision or an error that is
///   `is_connection()` or `is_timeout()` (NOSCRIPT tolerated and counted, see below);
/// - the killed master's keys fail, then are decided again on the new master, by the same
///   limiter; no call fails from 2 s after the cluster is healthy on;
/// - the doomed lock's holder learns its lease is lost, a contender takes the lock on the new
///   master with a larger fencing token, and the old holder's late write is refused;
/// - how many calls failed, for how long, on the killed master's keys and on the others, and
///   whether the lock on the other master survived (asserted by the callers).
async fn failover_under_load(
    cluster: Arc<RedisCluster>,
    breaker: BreakerConfig,
    label: &str,
) -> Measured {
    {
        let config = RedisConfig::from_urls(cluster.urls())
            .expect("urls")
            .connection(ConnectionKind::Cluster)
            .circuit_breaker(breaker);
        let limiter = Arc::new(RedisLimiter::connect(&config).await.expect("connect"));
        let policy = Arc::new(
            Policy::per_second(1_000_000)
                .expect("valid")
                .named("cluster-chaos")
                .expect("name"),
        );
        let keys: Arc<Vec<String>> = Arc::new((0..KEYS).map(|i| format!("user-{i}")).collect());
        let victim = cluster
            .node_for_key(&limiter.state_key(&policy, keys[0].as_bytes()))
            .expect("owner of user-0");
        let replica = cluster.replicas_of(victim).expect("replicas")[0];
        let on_victim: HashSet<usize> = (0..KEYS)
            .filter(|&i| {
                cluster
                    .node_for_key(&limiter.state_key(&policy, keys[i].as_bytes()))
                    .expect("owner")
                    == victim
            })
            .collect();
        assert!(
            !on_victim.is_empty() && on_victim.len() < KEYS,
            "keys should spread over the masters: {} of {KEYS} on the victim",
            on_victim.len()
        );
        figure(
            &format!("{label}.keys_on_killed_master"),
            format!("{} of {KEYS}", on_victim.len()),
        );

        // The locks: one on the master that will die, one elsewhere.
        let locks = {
            let conn = RedisConn::connect(&config).await.expect("connect");
            RedisLocks::builder(conn)
                .notifications(cluster.urls())
                .expect("urls")
                .build()
        };
        let doomed_name = lock_name(&cluster, &locks, victim, true);
        let safe_name = lock_name(&cluster, &locks, victim, false);
        let doomed = Lock::new(locks.clone(), &doomed_name, LOCK_TTL)
            .expect("valid")
            .watchdog(true);
        let safe = Lock::new(locks.clone(), &safe_name, BYSTANDER_TTL)
            .expect("valid")
            .watchdog(true);
        let holder = doomed
            .acquire(Duration::from_secs(5))
            .await
            .expect("doomed lock");
        let bystander = safe
            .acquire(Duration::from_secs(5))
            .await
            .expect("safe lock");
        let old_fence = holder.fence();
        let resource = Arc::new(FencedResource::new(0_u64));
        resource.write(old_fence, |n| *n += 1).expect("first write");

        let epoch = Instant::now();
        let load = {
            let (limiter, policy, keys) =
                (Arc::clone(&limiter), Arc::clone(&policy), Arc::clone(&keys));
            Load::start(
                epoch,
                LoadSpec {
                    tasks: TASKS,
                    pace: Duration::from_millis(10),
                    max_duration: Duration::from_secs(90),
                    max_calls_per_task: 10_000,
                },
                move |task, seq| {
                    let (limiter, policy, keys) =
                        (Arc::clone(&limiter), Arc::clone(&policy), Arc::clone(&keys));
                    async move {
                        let key = task + TASKS * (seq as usize % (KEYS / TASKS));
                        let result = limiter.check_one(keys[key].as_bytes(), &policy, 1).await;
                        Checked {
                            key,
                            call: classify(result),
                        }
                    }
                },
            )
        };
        tokio::time::sleep(Duration::from_secs(2)).await;

        let killed_at = epoch.elapsed();
        let holder_lost = {
            let lost = holder.lost();
            tokio::spawn(async move {
                let reason = lost.await;
                (reason, epoch.elapsed())
            })
        };
        {
            let cluster = Arc::clone(&cluster);
            tokio::task::spawn_blocking(move || cluster.node(victim).kill())
                .await
                .expect("join")
                .expect("kill the master");
        }
        // A contender for the doomed lock, from the moment the master is gone.
        let contender = {
            let (doomed, resource) = (doomed.clone(), Arc::clone(&resource));
            tokio::spawn(async move {
                let guard = doomed
                    .acquire(Duration::from_secs(40))
                    .await
                    .expect("the lock is taken again after the failover");
                let acquired = epoch.elapsed();
                resource
                    .write(guard.fence(), |n| *n += 1)
                    .expect("the new holder writes");
                let fence = guard.fence();
                // Released (retried through the topology refresh), found gone by a retry whose
                // earlier attempt ran after all, or still failing in the cluster client's
                // refresh window (the lease then frees the lock): never an untyped failure.
                let released = match guard.release().await {
                    Ok(()) => "released",
                    Err(e) if e.is_lost() => "found gone by a retry",
                    Err(e) if e.is_transient() => "store error (lease frees it)",
                    Err(e) => panic!("release after the failover: {e}"),
                };
                (acquired, fence, released)
            })
        };

        // The cluster promotes the replica by itself; force it if that takes too long.
        let (promoted_at, how) = {
            let cluster = Arc::clone(&cluster);
            let started = std::time::Instant::now();
            let how = tokio::task::spawn_blocking(move || {
                while started.elapsed() < AUTO_FAILOVER_PATIENCE {
                    if cluster.role(replica).ok() == Some(Role::Master) {
                        return "automatic";
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                cluster.failover(replica).expect("CLUSTER FAILOVER FORCE");
                "forced"
            })
            .await
            .expect("join");
            (epoch.elapsed(), how)
        };
        {
            let cluster = Arc::clone(&cluster);
            tokio::task::spawn_blocking(move || cluster.wait_healthy(Duration::from_secs(30)))
                .await
                .expect("join")
                .expect("the cluster is healthy again");
        }
        let healthy_at = epoch.elapsed();
        let (reason, lost_at) = tokio::time::timeout(Duration::from_secs(10), holder_lost)
            .await
            .expect("the doomed lock's holder learns it lost the lease")
            .expect("lost task");
        let (reacquired_at, new_fence, released) =
            tokio::time::timeout(Duration::from_secs(45), contender)
                .await
                .expect("the contender finishes")
                .expect("contender task");
        // Load on for a while after the failover: until 4 s after the cluster is healthy.
        let settle = (epoch + healthy_at + Duration::from_secs(4)).max(Instant::now());
        tokio::time::sleep_until(settle).await;
        let samples = load.stop().await;

        figure(&format!("{label}.failover"), how);
        figure(
            &format!("{label}.promoted_after_kill"),
            ms(promoted_at - killed_at),
        );
        figure(
            &format!("{label}.healthy_after_kill"),
            ms(healthy_at - killed_at),
        );

        // Every call ended in time, with a decision or a connection/timeout error.
        let strange: Vec<_> = samples
            .iter()
            .filter(|s| matches!(s.outcome.call, Call::Strange(_)))
            .collect();
        let untyped: Vec<String> = strange
            .iter()
            .map(|s| {
                format!(
                    "{:?} at {} on {} key",
                    s.outcome.call,
                    ms(s.start),
                    if on_victim.contains(&s.outcome.key) {
                        "a killed master's"
                    } else {
                        "another master's"
                    }
                )
            })
            .collect();
        figure(&format!("{label}.untyped_errors"), untyped.len());
        for e in &untyped {
            figure(&format!("{label}.untyped_error"), e);
        }
        // Known and reported: NOSCRIPT while the slot's master is unreachable (redis-rs sends
        // the call to a random node then). Anything else untyped is a failure.
        assert!(
            untyped.iter().all(|e| e.contains("NoScript")),
            "unexpected errors: {untyped:?}"
        );
        let all = Latencies::of(samples.iter().map(Sample::latency).collect());
        figure(&format!("{label}.calls"), all.count);
        figure(&format!("{label}.max_latency"), ms(all.max));
        let bound = REDIS_TIMEOUT * 2 + MARGIN;

        let (victim_samples, other_samples): (Vec<&Sample<Checked>>, Vec<&Sample<Checked>>) =
            samples
                .iter()
                .partition(|s| on_victim.contains(&s.outcome.key));
        let report = |name: &str, set: &[&Sample<Checked>]| {
            let failed: Vec<_> = set.iter().filter(|s| s.outcome.call != Call::Ok).collect();
            let window = match (failed.first(), failed.iter().map(|s| s.end).max()) {
                (Some(first), Some(last)) => last - first.start,
                _ => Duration::ZERO,
            };
            figure(&format!("{label}.{name}.calls"), set.len());
            figure(&format!("{label}.{name}.errors"), failed.len());
            figure(&format!("{label}.{name}.error_window"), ms(window));
            Latencies::of(set.iter().map(|s| s.latency()).collect())
                .print(&format!("{label}.{name}.latency"));
            if let Some(first) = failed.first() {
                figure(
                    &format!("{label}.{name}.first_error"),
                    format!("{:?}", first.outcome.call),
                );
            }
            (failed.len(), window)
        };
        let (victim_errors, _) = report("killed_master_keys", &victim_samples);
        let (other_errors, other_error_window) = report("other_keys", &other_samples);
        let other_calls = other_samples.len();
        let back = victim_samples
            .iter()
            .filter(|s| s.start >= killed_at && s.outcome.call == Call::Ok)
            .map(|s| s.end)
            .min()
            .expect("keys of the killed master are decided again");
        figure(
            &format!("{label}.killed_master_keys.decided_again_after_kill"),
            ms(back - killed_at),
        );
        figure(
            &format!("{label}.killed_master_keys.decided_again_after_promotion"),
            ms(back.saturating_sub(promoted_at)),
        );
        assert!(victim_errors > 0, "the kill went unnoticed");
        assert!(
            all.max <= bound,
            "a call took {} (bound {})",
            ms(all.max),
            ms(bound)
        );
        let late: Vec<_> = samples
            .iter()
            .filter(|s| s.start >= healthy_at + SETTLED && s.outcome.call != Call::Ok)
            .collect();
        assert!(
            late.is_empty(),
            "{} calls failed more than {SETTLED:?} after the cluster was healthy again: {:?}",
            late.len(),
            late.first()
        );

        // The lock.
        figure(&format!("{label}.lock.lost_reason"), format!("{reason:?}"));
        figure(
            &format!("{label}.lock.lost_after_kill"),
            ms(lost_at.saturating_sub(killed_at)),
        );
        assert!(
            lost_at.saturating_sub(killed_at) <= LOCK_TTL + MARGIN,
            "the doomed lock's holder learned of the loss {} after the kill (ttl {LOCK_TTL:?})",
            ms(lost_at.saturating_sub(killed_at))
        );
        figure(
            &format!("{label}.lock.reacquired_after_kill"),
            ms(reacquired_at - killed_at),
        );
        figure(&format!("{label}.lock.new_holder_release"), released);
        assert!(
            matches!(reason, LeaseLost::Expired | LeaseLost::NotHeld),
            "{reason:?}"
        );
        assert!(
            new_fence > old_fence,
            "fencing token {new_fence} after the failover is not above {old_fence}"
        );
        let stale = resource
            .write(old_fence, |n| *n += 1)
            .expect_err("the old holder's late write is refused");
        assert_eq!(stale.highest, new_fence);
        assert!(holder.release().await.expect_err("lost").is_lost());
        // The lock on a master that stayed up: checked by the callers (see Measured).
        let bystander_lost = bystander.is_lost();
        figure(
            &format!("{label}.lock.other_master_lock_lost"),
            bystander_lost,
        );
        if !bystander_lost {
            bystander
                .verify()
                .await
                .expect("the lock on a healthy master is still held");
        }
        let _ = bystander.release().await;
        assert_eq!(panics(), 0);
        Measured {
            other_calls,
            other_errors,
            other_error_window,
            untyped,
            bystander_lost,
        }
    }
}

/// A master killed under load, default settings: see [`failover_under_load`]. The figures
/// say how many decisions failed during the failover and for how long.
#[test]
fn chaos_cluster_master_killed_under_load_fails_over() {
    let cluster = Arc::new(cluster());
    run(
        Duration::from_secs(180),
        failover_under_load(cluster, BreakerConfig::default(), "cluster"),
    );
}

/// The same failover with the circuit breaker disabled, for comparison (the breakers, one per
/// 128 slots, fail fast only the slots of the master that is down).
#[test]
fn chaos_cluster_master_killed_without_the_breaker() {
    let cluster = Arc::new(cluster());
    let seen = run(
        Duration::from_secs(180),
        failover_under_load(cluster, BreakerConfig::disabled(), "cluster_no_breaker"),
    );
    assert!(
        !seen.bystander_lost,
        "the lock on a master that stayed up was lost: {seen:?}"
    );
}

/// The promise: while one master fails over, the keys of the other masters keep being
/// decided, and every error is typed (`is_connection()` or `is_timeout()`). On a cluster each
/// range of slots has its own circuit breaker, and a NOSCRIPT that survives the reload (the call
/// and the load landed on different nodes mid-failover) is a connection error.
#[test]
fn chaos_cluster_failover_leaves_other_masters_keys_alone() {
    let cluster = Arc::new(cluster());
    let seen = run(
        Duration::from_secs(180),
        failover_under_load(cluster, BreakerConfig::default(), "cluster_promise"),
    );
    assert!(seen.untyped.is_empty(), "untyped errors: {seen:?}");
    assert!(
        !seen.bystander_lost,
        "the lock on a master that stayed up was lost: {seen:?}"
    );
    // The masters that stayed up keep their own breakers closed. What remains is the cluster
    // client (redis-rs) refreshing its slot map when a node stops answering: for about a second
    // a few calls to any node time out. Bounded here, and reported in docs/failure-modes.md.
    assert!(
        seen.other_errors * 20 <= seen.other_calls,
        "{} of {} calls on the masters that stayed up failed, over {}",
        seen.other_errors,
        seen.other_calls,
        ms(seen.other_error_window)
    );
    assert!(
        seen.other_error_window <= Duration::from_secs(2),
        "errors on the masters that stayed up lasted {}",
        ms(seen.other_error_window)
    );
}
