//! Shared set-up of the Redis backend's tests: real servers and clusters from the testkit.

#![allow(dead_code, unreachable_pub, unused_imports)]

use std::time::Duration;

use floodgate_core::Policy;
use floodgate_redis::keys::key_slot;
use floodgate_redis::{BatchConfig, ConnectionKind, RedisConfig, RedisConn, RedisLimiter};
use floodgate_testkit::RedisCluster;
pub use floodgate_testkit::{cluster, run, server};

pub async fn limiter(url: &str, kind: ConnectionKind) -> RedisLimiter {
    let config = RedisConfig::new(url)
        .expect("valid URL")
        .connection(kind)
        .timeout(Duration::from_secs(2));
    RedisLimiter::connect(&config).await.expect("connect")
}

/// A limiter over `config` with these batching settings.
pub async fn limiter_batching(config: &RedisConfig, batching: BatchConfig) -> RedisLimiter {
    let conn = RedisConn::connect(config).await.expect("connect");
    RedisLimiter::with_batching(conn, config.get_key_prefix(), batching).expect("valid prefix")
}

/// A limiter per batching mode ("batched", then "unbatched") on the server at `url`, each under
/// that name as its key prefix, with this call timeout.
pub async fn limiter_per_batching(
    url: &str,
    timeout: Duration,
) -> Vec<(RedisLimiter, &'static str)> {
    let mut out = Vec::new();
    for (batching, prefix) in [
        (BatchConfig::default(), "batched"),
        (BatchConfig::disabled(), "unbatched"),
    ] {
        let config = RedisConfig::new(url)
            .expect("valid URL")
            .key_prefix(prefix)
            .expect("valid prefix")
            .timeout(timeout);
        out.push((limiter_batching(&config, batching).await, prefix));
    }
    out
}

pub async fn cluster_limiter(cluster: &RedisCluster) -> RedisLimiter {
    let config = RedisConfig::from_urls(cluster.urls())
        .expect("valid URLs")
        .connection(ConnectionKind::Cluster)
        .timeout(Duration::from_secs(2));
    RedisLimiter::connect(&config).await.expect("connect")
}

/// How many times the server has executed `command` (lower case, as `INFO commandstats` names
/// it: "evalsha", "get", "set").
pub fn command_calls(server: &floodgate_testkit::RedisServer, command: &str) -> u64 {
    let reply = server.cmd(&["INFO", "commandstats"]).expect("INFO");
    let info = String::from_utf8_lossy(reply.as_bytes().expect("bulk reply")).into_owned();
    let prefix = format!("cmdstat_{command}:calls=");
    info.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// A phone number under `phone` and an IP under `ip` whose states live on different nodes of
/// `cluster`, the phone's in an earlier slot (the parts of a check across slots run in slot
/// order, so the IP's part runs second), and the index of the IP's node.
pub fn keys_on_two_nodes(
    redis: &RedisLimiter,
    cluster: &RedisCluster,
    phone: &Policy,
    ip: &Policy,
) -> (String, String, usize) {
    let mut nodes = std::collections::HashMap::new();
    let mut node_of = |policy: &Policy, key: &str| {
        let slot = key_slot(&redis.state_key(policy, key.as_bytes()));
        let node = *nodes
            .entry(slot)
            .or_insert_with(|| cluster.node_for_slot(slot).expect("a node"));
        (slot, node)
    };
    for p in (0..100).map(|i| format!("+155501{i:02}")) {
        let (s, n) = node_of(phone, &p);
        for i in 0..10_000 {
            let addr = format!("10.0.{}.{}", i / 256, i % 256);
            let (t, m) = node_of(ip, &addr);
            if s < t && n != m {
                return (p, addr, m);
            }
        }
    }
    panic!("no phone and IP in later slots on different nodes")
}
