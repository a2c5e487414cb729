//! Shared set-up of the Redis backend's tests: real servers and clusters from the testkit.

#![allow(dead_code, unreachable_pub, unused_imports)]

use std::time::Duration;

use floodgate_redis::{ConnectionKind, RedisConfig, RedisLimiter};
use floodgate_testkit::RedisCluster;
pub use floodgate_testkit::{cluster, run, server};

pub async fn limiter(url: &str, kind: ConnectionKind) -> RedisLimiter {
    let config = RedisConfig::new(url)
        .expect("valid URL")
        .connection(kind)
        .timeout(Duration::from_secs(2));
    RedisLimiter::connect(&config).await.expect("connect")
}

pub async fn cluster_limiter(cluster: &RedisCluster) -> RedisLimiter {
    let config = RedisConfig::from_urls(cluster.urls())
        .expect("valid URLs")
        .connection(ConnectionKind::Cluster)
        .timeout(Duration::from_secs(2));
    RedisLimiter::connect(&config).await.expect("connect")
}
