//! Test set-up shared by every crate's tests: a bounded async runtime, and servers that panic
//! with a clear message (naming `scripts/install-redis` when Redis is missing) instead of
//! returning an error every test would unwrap.

use std::future::Future;
use std::time::Duration;

use crate::{RedisCluster, RedisServer, RedisServers};

/// Runs an async test on a two-thread runtime (the development machine has two cores), and
/// fails it if it has not finished within `limit`.
///
/// # Panics
/// When the runtime cannot be built or the test runs past `limit`.
pub fn run<F: Future>(limit: Duration, test: F) -> F::Output {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async {
        tokio::time::timeout(limit, test)
            .await
            .unwrap_or_else(|_| panic!("the test did not finish within its time limit ({limit:?})"))
    })
}

/// A standalone server, or a panic saying why there is none.
///
/// # Panics
/// When the server cannot start.
pub fn server() -> RedisServer {
    RedisServer::start().unwrap_or_else(|e| panic!("cannot start redis-server: {e}"))
}

/// `n` independent servers (for Redlock), or a panic saying why there are none.
///
/// # Panics
/// When a server cannot start.
pub fn servers(n: usize) -> RedisServers {
    RedisServers::start(n).unwrap_or_else(|e| panic!("cannot start {n} redis-servers: {e}"))
}

/// A local cluster of 3 masters and 3 replicas, or a panic saying why there is none.
///
/// # Panics
/// When the cluster cannot be built.
pub fn cluster() -> RedisCluster {
    RedisCluster::start().unwrap_or_else(|e| panic!("cannot start a Redis cluster: {e}"))
}
