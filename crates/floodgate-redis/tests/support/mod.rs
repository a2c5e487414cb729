//! Shared set-up of the Redis backend's tests: real servers and clusters from the testkit.

#![allow(dead_code, unreachable_pub)]

use std::future::Future;
use std::time::Duration;

use floodgate_redis::{ConnectionKind, RedisConfig, RedisLimiter};
use floodgate_testkit::{RedisCluster, RedisServer};

/// Runs an async test on a two-thread runtime, bounded in time.
pub fn run<F: Future>(limit: Duration, test: F) -> F::Output {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async {
        tokio::time::timeout(limit, test)
            .await
            .expect("the test did not finish within its time limit")
    })
}

pub fn server() -> RedisServer {
    RedisServer::start().unwrap_or_else(|e| panic!("cannot start redis-server: {e}"))
}

pub fn cluster() -> RedisCluster {
    RedisCluster::start().unwrap_or_else(|e| panic!("cannot start a Redis cluster: {e}"))
}

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
