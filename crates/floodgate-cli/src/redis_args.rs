//! The Redis flags every subcommand that talks to Redis shares (`--redis`, `--cluster`,
//! `--prefix`, ...), how they become a [`RedisLimiter`], and plain redis-rs clients for what
//! floodgate-redis does not do (per-node `SCAN`, `MONITOR`, the benchmark's baselines).

use std::time::Duration;

use clap::Args;
use floodgate_redis::{BatchConfig, ConnectionKind, RedisConfig, RedisConn, RedisLimiter};
use redis::{ConnectionAddr, IntoConnectionInfo, Value};

use crate::args;
use crate::error::CliError;

/// Where Redis is and how to talk to it.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Redis")]
pub(crate) struct RedisArgs {
    /// The server: redis://[user][:password@]host[:port][/db], rediss:// for TLS (the password
    /// is never printed).
    #[arg(
        long = "redis",
        value_name = "URL",
        env = "REDIS_URL",
        hide_env_values = true,
        default_value = "redis://127.0.0.1:6379"
    )]
    pub(crate) url: String,

    /// The URL is a seed node of a Redis Cluster (same as ?cluster=true in the URL).
    #[arg(long)]
    pub(crate) cluster: bool,

    /// Connect with a pool of N connections instead of one multiplexed connection.
    #[arg(long, value_name = "N", conflicts_with = "cluster")]
    pub(crate) pool: Option<u32>,

    /// The prefix of every key floodgate reads and writes.
    #[arg(long, value_name = "PREFIX", default_value = floodgate_redis::DEFAULT_KEY_PREFIX)]
    pub(crate) prefix: String,

    /// The bound on each call to Redis.
    #[arg(long, value_name = "DUR", default_value = "1s", value_parser = args::duration)]
    pub(crate) timeout: Duration,

    /// The bound on connecting.
    #[arg(long, value_name = "DUR", default_value = "2s", value_parser = args::duration)]
    pub(crate) connect_timeout: Duration,
}

impl RedisArgs {
    /// floodgate-redis' configuration for these flags.
    pub(crate) fn config(&self) -> Result<RedisConfig, CliError> {
        let mut config = RedisConfig::new(&self.url)
            .and_then(|c| c.key_prefix(&self.prefix))
            .map_err(|e| CliError::usage(e.to_string()))?
            .timeout(self.timeout)
            .connect_timeout(self.connect_timeout);
        if self.cluster {
            config = config.cluster(true);
        }
        if let Some(size) = self.pool {
            config = config.connection(ConnectionKind::Pool { size });
        }
        config
            .validate()
            .map_err(|e| CliError::usage(e.to_string()))?;
        Ok(config)
    }

    /// Connects a limiter. The error names the server (password redacted).
    pub(crate) async fn connect(&self) -> Result<RedisLimiter, CliError> {
        let config = self.config()?;
        RedisLimiter::connect(&config)
            .await
            .map_err(CliError::Connect)
    }

    /// Connects a limiter with explicit batching settings.
    pub(crate) async fn connect_with(&self, batch: BatchConfig) -> Result<RedisLimiter, CliError> {
        let config = self.config()?;
        let conn = RedisConn::connect(&config)
            .await
            .map_err(CliError::Connect)?;
        RedisLimiter::with_batching(conn, &self.prefix, batch)
            .map_err(|e| CliError::usage(e.to_string()))
    }

    /// Whether the connection is to a cluster.
    pub(crate) fn is_cluster(&self) -> Result<bool, CliError> {
        Ok(self.config()?.kind() == ConnectionKind::Cluster)
    }

    /// The URL for redis-rs itself: without floodgate's `?cluster=` parameter.
    fn plain_url(&self) -> &str {
        match self.url.rfind('?') {
            Some(i) if self.url[i + 1..].starts_with("cluster=") => &self.url[..i],
            _ => &self.url,
        }
    }

    /// The host of the URL: where a cluster node whose endpoint is unknown is reached.
    pub(crate) fn seed_host(&self) -> Result<String, CliError> {
        let info = self
            .plain_url()
            .into_connection_info()
            .map_err(|e| self.client_error(&e))?;
        match info.addr() {
            ConnectionAddr::Tcp(host, _) | ConnectionAddr::TcpTls { host, .. } => Ok(host.clone()),
            _ => Err(CliError::usage(format!(
                "a cluster is reached over TCP, not at {}",
                info.addr()
            ))),
        }
    }

    /// A plain redis-rs client for the URL's node.
    pub(crate) fn client(&self) -> Result<redis::Client, CliError> {
        redis::Client::open(self.plain_url()).map_err(|e| self.client_error(&e))
    }

    /// A plain redis-rs client for another node of the same deployment (a cluster master): the
    /// URL's credentials, database and TLS settings, `host:port` replaced.
    pub(crate) fn node_client(&self, host: &str, port: u16) -> Result<redis::Client, CliError> {
        let info = self
            .plain_url()
            .into_connection_info()
            .map_err(|e| self.client_error(&e))?;
        let addr = match info.addr().clone() {
            ConnectionAddr::TcpTls {
                insecure,
                tls_params,
                ..
            } => ConnectionAddr::TcpTls {
                host: host.to_owned(),
                port,
                insecure,
                tls_params,
            },
            _ => ConnectionAddr::Tcp(host.to_owned(), port),
        };
        redis::Client::open(info.set_addr(addr)).map_err(|e| self.client_error(&e))
    }

    /// A plain redis-rs cluster client.
    pub(crate) fn cluster_client(&self) -> Result<redis::cluster::ClusterClient, CliError> {
        redis::cluster::ClusterClientBuilder::new([self.plain_url()])
            .connection_timeout(self.connect_timeout)
            .response_timeout(self.timeout)
            .build()
            .map_err(|e| self.client_error(&e))
    }

    fn client_error(&self, e: &redis::RedisError) -> CliError {
        // redis-rs' parse errors do not echo the URL; say which one, redacted.
        CliError::Failed(format!(
            "cannot use Redis URL {}: {e}",
            self.config()
                .map(|c| c.redacted_url())
                .unwrap_or_else(|_| "(invalid)".to_owned())
        ))
    }
}

/// One slot range of a cluster and the master serving it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SlotRange {
    pub(crate) start: u16,
    pub(crate) end: u16,
    pub(crate) host: String,
    pub(crate) port: u16,
}

/// The cluster's masters and their slots (`CLUSTER SLOTS`). A node whose endpoint is unknown
/// (NULL, or empty) is reached at `seed_host`, the host of the URL the command was sent through,
/// as the command's documentation asks: nodes behind a load balancer, or a cluster of one node.
pub(crate) async fn cluster_slots(
    conn: &RedisConn,
    seed_host: &str,
) -> Result<Vec<SlotRange>, CliError> {
    let mut cmd = redis::cmd("CLUSTER");
    cmd.arg("SLOTS");
    let reply: Value = conn.query(cmd).await.map_err(|e| {
        CliError::redis(
            format!("cannot list the cluster's nodes on {}", conn.redacted_url()),
            e,
        )
    })?;
    parse_slots(&reply, seed_host)
}

/// [`cluster_slots`]'s reply read.
fn parse_slots(reply: &Value, seed_host: &str) -> Result<Vec<SlotRange>, CliError> {
    let bad = || CliError::Failed(format!("unexpected CLUSTER SLOTS reply: {reply:?}"));
    let Value::Array(ranges) = reply else {
        return Err(bad());
    };
    let mut out = Vec::with_capacity(ranges.len());
    for range in ranges {
        let Value::Array(fields) = range else {
            return Err(bad());
        };
        let (Some(start), Some(end), Some(Value::Array(master))) =
            (fields.first(), fields.get(1), fields.get(2))
        else {
            return Err(bad());
        };
        let host = match master.first() {
            Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
            Some(Value::SimpleString(s)) => s.clone(),
            Some(Value::Nil) => String::new(),
            _ => return Err(bad()),
        };
        let int = |v: &Value| match v {
            Value::Int(i) => u16::try_from(*i).ok(),
            _ => None,
        };
        let (Some(start), Some(end), Some(port)) =
            (int(start), int(end), master.get(1).and_then(int))
        else {
            return Err(bad());
        };
        let host = match host.as_str() {
            "" => seed_host.to_owned(),
            // A hostname asked for (`cluster-preferred-endpoint-type hostname`) that the node
            // was never given: nothing to connect to.
            "?" => {
                return Err(CliError::Failed(format!(
                    "the cluster's master of slots {start}-{end} (port {port}) has no usable \
                     endpoint (\"?\"): set its cluster-announce-hostname, or set \
                     cluster-preferred-endpoint-type to ip"
                )));
            }
            _ => host,
        };
        out.push(SlotRange {
            start,
            end,
            host,
            port,
        });
    }
    out.sort_by_key(|r| r.start);
    Ok(out)
}

/// The distinct masters of `ranges`, as `(host, port)`.
pub(crate) fn masters(ranges: &[SlotRange]) -> Vec<(String, u16)> {
    let mut out: Vec<(String, u16)> = Vec::new();
    for r in ranges {
        if !out.iter().any(|(h, p)| *h == r.host && *p == r.port) {
            out.push((r.host.clone(), r.port));
        }
    }
    out
}

/// A runtime for a subcommand that makes a few calls.
pub(crate) fn small_runtime() -> Result<tokio::runtime::Runtime, CliError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| CliError::io("cannot start the async runtime", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn redis_args(url: &str) -> RedisArgs {
        RedisArgs {
            url: url.to_owned(),
            cluster: false,
            pool: None,
            prefix: "floodgate".to_owned(),
            timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(1),
        }
    }

    #[test]
    fn plain_url_drops_the_cluster_flag_only() {
        assert_eq!(
            redis_args("redis://h:1?cluster=true").plain_url(),
            "redis://h:1"
        );
        assert_eq!(redis_args("redis://h:1/2").plain_url(), "redis://h:1/2");
    }

    #[test]
    fn node_clients_keep_the_credentials() {
        let client = redis_args("redis://u:pw@h:1/0")
            .node_client("10.0.0.2", 7001)
            .expect("valid");
        let info = client.get_connection_info();
        assert_eq!(
            info.addr(),
            &ConnectionAddr::Tcp("10.0.0.2".to_owned(), 7001)
        );
        assert_eq!(info.redis_settings().password(), Some("pw"));
    }

    #[test]
    fn bad_urls_are_usage_errors_without_the_password() {
        let err = redis_args("http://u:hunter2@h:1")
            .config()
            .expect_err("bad scheme")
            .to_string();
        assert!(!err.contains("hunter2"), "{err}");
        assert!(err.contains("***"), "{err}");
    }

    fn range(start: i64, end: i64, host: Value, port: i64) -> Value {
        Value::Array(vec![
            Value::Int(start),
            Value::Int(end),
            Value::Array(vec![
                host,
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
            ]),
        ])
    }

    #[test]
    fn cluster_slots_reach_an_unknown_endpoint_at_the_seed_host() {
        let reply = Value::Array(vec![
            range(8192, 16383, Value::Nil, 7002),
            range(0, 8191, Value::BulkString(b"10.0.0.1".to_vec()), 7001),
            range(16384, 16384, Value::BulkString(Vec::new()), 7003),
        ]);
        let got = parse_slots(&reply, "lb.example").expect("parsed");
        let seen: Vec<_> = got
            .iter()
            .map(|r| (r.start, r.end, r.host.as_str(), r.port))
            .collect();
        assert_eq!(
            seen,
            [
                (0, 8191, "10.0.0.1", 7001),
                (8192, 16383, "lb.example", 7002),
                (16384, 16384, "lb.example", 7003),
            ]
        );
        assert_eq!(
            masters(&got),
            [
                ("10.0.0.1".to_owned(), 7001),
                ("lb.example".to_owned(), 7002),
                ("lb.example".to_owned(), 7003),
            ]
        );
    }

    #[test]
    fn cluster_slots_refuse_a_node_without_a_usable_endpoint() {
        let reply = Value::Array(vec![range(
            0,
            16383,
            Value::BulkString(b"?".to_vec()),
            7001,
        )]);
        let err = parse_slots(&reply, "h")
            .expect_err("no endpoint")
            .to_string();
        assert!(err.contains("0-16383") && err.contains("7001"), "{err}");
        // Malformed replies are an error, not a panic.
        for reply in [
            Value::Nil,
            Value::Array(vec![Value::Int(1)]),
            Value::Array(vec![range(0, 70000, Value::Nil, 1)]),
            Value::Array(vec![range(0, 1, Value::Int(3), 1)]),
        ] {
            let err = parse_slots(&reply, "h").expect_err("malformed").to_string();
            assert!(err.contains("unexpected CLUSTER SLOTS reply"), "{err}");
        }
    }

    #[test]
    fn the_seed_host_is_the_urls() {
        assert_eq!(
            redis_args("redis://u:pw@10.1.2.3:7000?cluster=true")
                .seed_host()
                .expect("tcp"),
            "10.1.2.3"
        );
        assert!(redis_args("redis+unix:///tmp/r.sock").seed_host().is_err());
    }
}
