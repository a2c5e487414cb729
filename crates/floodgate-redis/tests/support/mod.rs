//! Shared set-up of the Redis backend's tests: real servers and clusters from the testkit.

#![allow(dead_code, unreachable_pub, unused_imports)]

use std::time::Duration;

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
