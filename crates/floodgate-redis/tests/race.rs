//! Concurrency: 4 independent store instances x 250 tasks racing on one key with limit 100
//! admit exactly 100, for every algorithm, on a single node and on a cluster. Afterwards every
//! key written has a TTL.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use floodgate_core::{Check, CheckOptions, Limiter, Policy};
use floodgate_redis::{ConnectionKind, RedisLimiter};
use support::{cluster, cluster_limiter, limiter, run, server};

const HOUR: Duration = Duration::from_secs(3_600);

/// Every algorithm configured so that exactly 100 pass and nothing refills during the race,
/// with the max wait each needs (the shaper admits 100 by queueing them).
fn policies() -> Vec<(Policy, Duration)> {
    let p = |r: Result<Policy, floodgate_core::PolicyError>| r.expect("valid");
    vec![
        (p(Policy::fixed_window(100, HOUR)), Duration::ZERO),
        (p(Policy::sliding_log(100, HOUR)), Duration::ZERO),
        (p(Policy::sliding_window(100, HOUR)), Duration::ZERO),
        (p(Policy::token_bucket(100, 1, HOUR)), Duration::ZERO),
        (p(Policy::funnel(100, 100 * HOUR)), Duration::ZERO),
        (p(Policy::gcra(99, 1, HOUR)), Duration::ZERO),
        // Burst 1, one per hour, waiting up to 99 hours: 100 reservations.
        (p(Policy::shaper(1, HOUR)), 99 * HOUR),
        (p(Policy::concurrency(100, HOUR)), Duration::ZERO),
    ]
}

async fn race(stores: &[RedisLimiter], label: &str) {
    for (policy, max_wait) in policies() {
        let policy = Arc::new(policy);
        let admitted = Arc::new(AtomicU64::new(0));
        let errors = Arc::new(AtomicU64::new(0));
        let key = format!("race-{label}-{}", policy.name());
        let mut tasks = Vec::new();
        for store in stores {
            for _ in 0..250 {
                let (store, policy, admitted, errors, key) = (
                    store.clone(),
                    Arc::clone(&policy),
                    Arc::clone(&admitted),
                    Arc::clone(&errors),
                    key.clone(),
                );
                tasks.push(tokio::spawn(async move {
                    let checks = [Check::new(key.as_bytes(), &policy)];
                    match store.check(&checks, CheckOptions::wait(max_wait)).await {
                        Ok(v) if v.allowed() => {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(_) => {}
                        Err(e) => {
                            eprintln!("{e}");
                            errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }));
            }
        }
        for t in tasks {
            t.await.expect("task");
        }
        assert_eq!(errors.load(Ordering::Relaxed), 0, "{}", policy.name());
        assert_eq!(
            admitted.load(Ordering::Relaxed),
            100,
            "{label}: {} admitted the wrong number",
            policy.name()
        );
    }
}

/// Every key under the test's prefix has a TTL (`PTTL` is never -1).
fn assert_every_key_expires(nodes: &[&floodgate_testkit::RedisServer]) {
    let mut seen = 0;
    for node in nodes {
        let keys = node.cmd(&["KEYS", "floodgate:*"]).expect("KEYS");
        for key in keys.as_array().expect("array") {
            let key = key.as_bytes().expect("bytes");
            let ttl = node
                .cmd(&[b"PTTL".as_slice(), key])
                .expect("PTTL")
                .as_int()
                .expect("int");
            assert!(
                ttl > 0,
                "{} has no TTL ({ttl})",
                String::from_utf8_lossy(key)
            );
            seen += 1;
        }
    }
    assert!(seen >= 8, "only {seen} keys found");
}

#[test]
fn race_single_node() {
    let server = server();
    run(Duration::from_secs(120), async {
        let mut stores = Vec::new();
        for kind in [
            ConnectionKind::Multiplexed,
            ConnectionKind::Multiplexed,
            ConnectionKind::Pool { size: 8 },
            ConnectionKind::Pool { size: 8 },
        ] {
            stores.push(limiter(&server.url(), kind).await);
        }
        race(&stores, "single").await;
    });
    assert_every_key_expires(&[&server]);
}

#[test]
fn race_cluster() {
    let cluster = cluster();
    run(Duration::from_secs(120), async {
        let mut stores = Vec::new();
        for _ in 0..4 {
            stores.push(cluster_limiter(&cluster).await);
        }
        race(&stores, "cluster").await;
    });
    let masters = cluster.masters().expect("masters");
    let nodes: Vec<_> = masters.iter().map(|&i| cluster.node(i)).collect();
    assert_every_key_expires(&nodes);
}
