//! Real `redis-server` processes for tests: standalone, several, or a local cluster, with kill/pause/restart.
//!
//! Every server runs on a free `127.0.0.1` port in its own temporary
//! directory, without persistence, and is killed (SIGKILL) when dropped, also
//! when a test panics. Redis is never mocked. If `redis-server` (or, for
//! clusters, `redis-cli`) is missing, starting fails with an error that says
//! to run `scripts/install-redis`; `FLOODGATE_REDIS_SERVER` and
//! `FLOODGATE_REDIS_CLI` can point at other binaries.
//!
//! ```no_run
//! use std::time::Duration;
//! use floodgate_testkit::{RedisCluster, RedisServer, TestkitError};
//!
//! # fn main() -> Result<(), TestkitError> {
//! let server = RedisServer::builder()
//!     .config("notify-keyspace-events KEA")
//!     .start()?;
//! server.cmd(&["SET", "k", "v"])?;
//! assert_eq!(server.cmd(&["GET", "k"])?.as_str(), Some("v"));
//! println!("connect your client to {}", server.url());
//!
//! server.pause()?; // SIGSTOP: commands now time out
//! assert!(server.cmd_timeout(&["PING"], Duration::from_millis(100)).is_err());
//! server.resume()?;
//! server.kill()?; // SIGKILL
//! server.restart()?; // same port, empty data
//!
//! let cluster = RedisCluster::start()?; // 3 masters + 3 replicas
//! let slot = RedisCluster::key_slot(b"{user}:1");
//! let dead = cluster.kill_master_for_slot(slot)?;
//! let replica = cluster.replicas_of(dead)?[0];
//! cluster.failover(replica)?;
//! cluster.wait_healthy(Duration::from_secs(30))?;
//! # Ok(()) }
//! ```

mod binary;
mod cluster;
mod error;
mod harness;
mod proxy;
mod resp;
mod server;
mod servers;
mod slot;
mod tls;

pub use binary::{REDIS_CLI_ENV, REDIS_SERVER_ENV, redis_cli_binary, redis_server_binary};
pub use cluster::{FailoverMode, RedisCluster, RedisClusterBuilder, Role};
pub use error::TestkitError;
pub use harness::{cluster, run, server, servers};
pub use proxy::TcpProxy;
pub use resp::{Connection, DEFAULT_CONNECT_TIMEOUT, DEFAULT_IO_TIMEOUT, Resp, encode_command};
pub use server::{
    DEFAULT_CLUSTER_NODE_TIMEOUT, DEFAULT_STARTUP_TIMEOUT, RedisServer, RedisServerBuilder,
};
pub use servers::RedisServers;
pub use slot::{SLOT_COUNT, crc16, hash_tag, key_slot};
pub use tls::tls_certificates;
