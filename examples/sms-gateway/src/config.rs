//! Configuration: command-line flags, environment variables, and an optional TOML file.
//!
//! Precedence: a flag or environment variable beats the file, which beats the defaults.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use floodgate::parse::{parse_duration, parse_utc_offset};
use ipnet::IpNet;
use serde::Deserialize;

/// An SMS gateway whose limits hold across every replica.
///
/// With no REDIS_URL it runs alone, with its limits in memory. With REDIS_URL set, every
/// replica pointed at the same Redis shares the per-phone, per-IP and global limits, the
/// opt-out list, idempotency keys and campaigns.
#[derive(Debug, Parser)]
#[command(name = "sms-gateway", version, about, long_about = None)]
pub struct Cli {
    /// A TOML file with any of the settings below (snake_case keys).
    #[arg(long, env = "SMS_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address to listen on.
    #[arg(long, env = "LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Redis (or Redis Cluster seed) URL; unset: everything in memory.
    #[arg(long, env = "REDIS_URL")]
    pub redis_url: Option<String>,
    /// Where the default provider appends one JSON line per message sent.
    #[arg(long, env = "OUTBOX_PATH")]
    pub outbox_path: Option<PathBuf>,
    /// POST every message to this URL instead of appending to the outbox file.
    #[arg(long, env = "WEBHOOK_URL")]
    pub webhook_url: Option<String>,
    /// Per phone: messages at once (the funnel's capacity).
    #[arg(long, env = "PHONE_BURST")]
    pub phone_burst: Option<u64>,
    /// Per phone: time for the funnel to drain (e.g. 30m).
    #[arg(long, env = "PHONE_INTERVAL")]
    pub phone_interval: Option<String>,
    /// Per phone: messages per calendar day.
    #[arg(long, env = "PHONE_DAILY_LIMIT")]
    pub phone_daily_limit: Option<u64>,
    /// UTC offset of the calendar day (e.g. +08:00).
    #[arg(long, env = "UTC_OFFSET", allow_hyphen_values = true)]
    pub utc_offset: Option<String>,
    /// Per client IP: requests per minute.
    #[arg(long, env = "IP_PER_MINUTE")]
    pub ip_per_minute: Option<u64>,
    /// All requests: per second.
    #[arg(long, env = "GLOBAL_PER_SECOND")]
    pub global_per_second: Option<u64>,
    /// Comma-separated CIDRs of proxies whose X-Forwarded-For header is trusted (the client is
    /// its rightmost address not in them; RFC 7239 `Forwarded` is not read).
    #[arg(long, env = "TRUSTED_PROXIES")]
    pub trusted_proxies: Option<String>,
    /// A campaign's dispatch lease (e.g. 10s): how soon another replica resumes a campaign
    /// whose dispatcher died.
    #[arg(long, env = "CAMPAIGN_LEASE")]
    pub campaign_lease: Option<String>,
    /// How long a completed campaign's report is kept (e.g. 7d); its numbers are dropped when
    /// it completes.
    #[arg(long, env = "CAMPAIGN_RETENTION")]
    pub campaign_retention: Option<String>,
    /// This replica's name, in campaign progress and logs.
    #[arg(long, env = "INSTANCE_ID")]
    pub instance_id: Option<String>,
    /// Key prefix in Redis.
    #[arg(long, env = "REDIS_PREFIX")]
    pub redis_prefix: Option<String>,
    /// Without Redis: the most limit states kept in memory (per phone, per client IP). A full
    /// store refuses new numbers (503) rather than forget a phone's limit.
    #[arg(long, env = "MEMORY_MAX_KEYS")]
    pub memory_max_keys: Option<u64>,
    /// The most campaigns pending at once (created, not completed), across replicas: one more
    /// is refused (503) until one completes. Bounds what campaigns hold (up to 100,000 numbers
    /// each).
    #[arg(long, env = "MAX_PENDING_CAMPAIGNS")]
    pub max_pending_campaigns: Option<u64>,
    /// The most campaigns pending at once from one client (its address, as the rate limits
    /// key it), at most MAX_PENDING_CAMPAIGNS: one more is refused (503) until one of its
    /// campaigns completes, so that one client cannot take every pending place.
    #[arg(long, env = "MAX_PENDING_CAMPAIGNS_PER_CLIENT")]
    pub max_pending_campaigns_per_client: Option<u64>,
    /// The most client connections served at once; further ones wait in the listen queue
    /// until one closes. Each holds an open file, as does each webhook call in flight, and 128
    /// more are kept for the rest: at start, the open-file limit (`ulimit -n`) is raised to
    /// fit them, as far as its hard limit allows; past that, the default is lowered to fit, and
    /// a bound given here that cannot fit is refused (as any bound is when not even one
    /// connection fits).
    #[arg(long, env = "MAX_CONNECTIONS")]
    pub max_connections: Option<u64>,
    /// The most connections served at once from one client address (an IPv6 client's /64),
    /// at most MAX_CONNECTIONS; one more is answered 503 and closed (it holds a socket for
    /// 500 ms at most, and 64 of them at most, beyond MAX_CONNECTIONS). Trusted proxies, whose
    /// connections carry many clients, are exempt.
    #[arg(long, env = "MAX_CONNECTIONS_PER_IP")]
    pub max_connections_per_ip: Option<u64>,
    /// Time a client has to send a request's headers, that an idle keep-alive connection stays
    /// open, and that a response may wait for the client to read any of it (e.g. 75s). Behind
    /// a proxy that keeps connections to the gateway, keep it longer than the proxy's idle
    /// timeout (60s for nginx upstream keep-alive and AWS ALB).
    #[arg(long, env = "HEADER_TIMEOUT")]
    pub header_timeout: Option<String>,
    /// Time a client has to send a request's body, from its headers (e.g. 30s): past it the
    /// client gets 408. The timeout does not cut handlers off: what they do has bounds of its
    /// own.
    #[arg(long, env = "BODY_TIMEOUT")]
    pub body_timeout: Option<String>,
    /// On SIGTERM, how long requests in progress may take to finish before their connections
    /// are closed (e.g. 20s).
    #[arg(long, env = "SHUTDOWN_GRACE")]
    pub shutdown_grace: Option<String>,
}

/// The file form of the settings: every key optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<SocketAddr>,
    redis_url: Option<String>,
    outbox_path: Option<PathBuf>,
    webhook_url: Option<String>,
    phone_burst: Option<u64>,
    phone_interval: Option<String>,
    phone_daily_limit: Option<u64>,
    utc_offset: Option<String>,
    ip_per_minute: Option<u64>,
    global_per_second: Option<u64>,
    trusted_proxies: Option<Vec<String>>,
    campaign_lease: Option<String>,
    campaign_retention: Option<String>,
    instance_id: Option<String>,
    redis_prefix: Option<String>,
    memory_max_keys: Option<u64>,
    max_pending_campaigns: Option<u64>,
    max_pending_campaigns_per_client: Option<u64>,
    max_connections: Option<u64>,
    max_connections_per_ip: Option<u64>,
    header_timeout: Option<String>,
    body_timeout: Option<String>,
    shutdown_grace: Option<String>,
}

/// The gateway's settings, validated.
#[derive(Clone, Debug)]
pub struct Config {
    pub listen: SocketAddr,
    pub redis_url: Option<String>,
    pub outbox_path: PathBuf,
    pub webhook_url: Option<String>,
    pub phone_burst: u64,
    pub phone_interval: Duration,
    pub phone_daily_limit: u64,
    pub utc_offset_secs: i32,
    pub ip_per_minute: u64,
    pub global_per_second: u64,
    pub trusted_proxies: Vec<IpNet>,
    pub campaign_lease: Duration,
    pub campaign_retention: Duration,
    pub instance_id: String,
    pub redis_prefix: String,
    /// Without Redis: the most limit states kept in memory.
    pub memory_max_keys: usize,
    /// The most campaigns pending at once.
    pub max_pending_campaigns: usize,
    /// The most campaigns pending at once from one client.
    pub max_pending_campaigns_per_client: usize,
    /// The most client connections served at once.
    pub max_connections: usize,
    /// Whether `max_connections` was given (not the default): a bound given is never lowered
    /// to fit the open-file limit ([`crate::open_files::fit`]).
    pub max_connections_set: bool,
    /// The most connections served at once from one client address (an IPv6 client's /64),
    /// trusted proxies excepted.
    pub max_connections_per_ip: usize,
    /// Time to send a request's headers; an idle keep-alive connection's life; the longest a
    /// response waits for the client to read.
    pub header_timeout: Duration,
    /// Time to send a request's body, from its headers.
    pub body_timeout: Duration,
    /// On SIGTERM, the longest wait for requests in progress.
    pub shutdown_grace: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            redis_url: None,
            outbox_path: PathBuf::from("sms-outbox.jsonl"),
            webhook_url: None,
            phone_burst: 1,
            phone_interval: Duration::from_secs(30 * 60),
            phone_daily_limit: 10,
            utc_offset_secs: 0,
            ip_per_minute: 20,
            global_per_second: 100,
            trusted_proxies: Vec::new(),
            campaign_lease: Duration::from_secs(10),
            campaign_retention: Duration::from_secs(7 * 24 * 3600),
            instance_id: format!("sms-gateway-{}", std::process::id()),
            redis_prefix: "sms".into(),
            memory_max_keys: floodgate::DEFAULT_MAX_KEYS,
            max_pending_campaigns: 100,
            max_pending_campaigns_per_client: 10,
            // Under the common soft limit of 1024 open files, with room for the rest.
            max_connections: 512,
            max_connections_set: false,
            max_connections_per_ip: 64,
            // Longer than the 60 s a proxy in front commonly keeps an idle connection: else
            // it may send a request on a connection the gateway is closing.
            header_timeout: Duration::from_secs(75),
            body_timeout: Duration::from_secs(30),
            // With the 10 s given to sends in progress after it, under the 30 s a container
            // orchestrator commonly waits after SIGTERM before SIGKILL.
            shutdown_grace: Duration::from_secs(15),
        }
    }
}

/// A setting that cannot be used, naming it.
#[derive(Debug, thiserror::Error)]
#[error("invalid setting {name}: {reason}")]
pub struct ConfigError {
    pub name: &'static str,
    pub reason: String,
}

/// A per-client share of a bound (`whole`: its name and value): `value` from 1 to the whole,
/// or `default` lowered to the whole.
fn share_of(
    name: &'static str,
    value: Option<u64>,
    default: usize,
    (whole_name, whole): (&str, usize),
) -> Result<usize, ConfigError> {
    match value {
        None => Ok(default.min(whole)),
        Some(0) => Err(bad(name, "must be at least 1")),
        Some(n) => match usize::try_from(n) {
            Ok(n) if n <= whole => Ok(n),
            _ => Err(bad(
                name,
                format!("{n} is more than {whole_name} ({whole})"),
            )),
        },
    }
}

/// A count from 1 to `most`: `value` when given, else `default`.
fn count(
    name: &'static str,
    value: Option<u64>,
    default: usize,
    most: u64,
) -> Result<usize, ConfigError> {
    match value {
        None => Ok(default),
        Some(0) => Err(bad(name, "must be at least 1")),
        Some(n) if n > most => Err(bad(name, format!("must be at most {most}"))),
        Some(n) => usize::try_from(n).map_err(|_| bad(name, format!("{n} is too large"))),
    }
}

fn bad(name: &'static str, reason: impl std::fmt::Display) -> ConfigError {
    ConfigError {
        name,
        reason: reason.to_string(),
    }
}

impl Config {
    /// Settings from the command line, the environment, and the file they name.
    pub fn load(cli: Cli) -> Result<Config, ConfigError> {
        let file = match &cli.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| bad("config", format!("{}: {e}", path.display())))?;
                toml::from_str::<FileConfig>(&text)
                    .map_err(|e| bad("config", format!("{}: {e}", path.display())))?
            }
            None => FileConfig::default(),
        };
        let d = Config::default();
        let duration = |name, v: Option<String>, default| match v {
            Some(s) => match parse_duration(&s) {
                Ok(d) if d.is_zero() => Err(bad(name, "must be longer than zero")),
                Ok(d) => Ok(d),
                Err(e) => Err(bad(name, e)),
            },
            None => Ok(default),
        };
        let positive = |name, v: Option<u64>, default: u64| match v {
            Some(0) => Err(bad(name, "must be greater than zero")),
            Some(v) => Ok(v),
            None => Ok(default),
        };
        let proxies = match cli.trusted_proxies {
            Some(list) => list
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect(),
            None => file.trusted_proxies.unwrap_or_default(),
        };
        let trusted_proxies = proxies
            .iter()
            .map(|p| {
                p.parse::<IpNet>()
                    .or_else(|_| p.parse::<std::net::IpAddr>().map(IpNet::from))
                    .map_err(|e| bad("trusted_proxies", format!("{p:?}: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let utc_offset_secs = match cli.utc_offset.or(file.utc_offset) {
            Some(s) => parse_utc_offset(&s).map_err(|e| bad("utc_offset", e))?,
            None => d.utc_offset_secs,
        };
        let given_connections = cli.max_connections.or(file.max_connections);
        // Each connection holds a socket: past a million, the process' file limit is hit
        // before the bound.
        let max_connections = count(
            "max_connections",
            given_connections,
            d.max_connections,
            1_000_000,
        )?;
        // Counting the pending campaigns reads them all: a few thousand at most.
        let max_pending_campaigns = count(
            "max_pending_campaigns",
            cli.max_pending_campaigns.or(file.max_pending_campaigns),
            d.max_pending_campaigns,
            10_000,
        )?;
        let config = Config {
            listen: cli.listen.or(file.listen).unwrap_or(d.listen),
            redis_url: cli
                .redis_url
                .or(file.redis_url)
                .filter(|u| !u.trim().is_empty()),
            outbox_path: cli
                .outbox_path
                .or(file.outbox_path)
                .unwrap_or(d.outbox_path),
            webhook_url: cli.webhook_url.or(file.webhook_url),
            phone_burst: positive(
                "phone_burst",
                cli.phone_burst.or(file.phone_burst),
                d.phone_burst,
            )?,
            phone_interval: duration(
                "phone_interval",
                cli.phone_interval.or(file.phone_interval),
                d.phone_interval,
            )?,
            phone_daily_limit: positive(
                "phone_daily_limit",
                cli.phone_daily_limit.or(file.phone_daily_limit),
                d.phone_daily_limit,
            )?,
            utc_offset_secs,
            ip_per_minute: positive(
                "ip_per_minute",
                cli.ip_per_minute.or(file.ip_per_minute),
                d.ip_per_minute,
            )?,
            global_per_second: positive(
                "global_per_second",
                cli.global_per_second.or(file.global_per_second),
                d.global_per_second,
            )?,
            trusted_proxies,
            campaign_lease: duration(
                "campaign_lease",
                cli.campaign_lease.or(file.campaign_lease),
                d.campaign_lease,
            )?,
            campaign_retention: duration(
                "campaign_retention",
                cli.campaign_retention.or(file.campaign_retention),
                d.campaign_retention,
            )?,
            instance_id: cli
                .instance_id
                .or(file.instance_id)
                .unwrap_or(d.instance_id),
            redis_prefix: cli
                .redis_prefix
                .or(file.redis_prefix)
                .unwrap_or(d.redis_prefix),
            memory_max_keys: match cli.memory_max_keys.or(file.memory_max_keys) {
                None => d.memory_max_keys,
                // A store smaller than this would refuse numbers under ordinary traffic.
                Some(n) if n < 1_000 => {
                    return Err(bad("memory_max_keys", "must be at least 1000"));
                }
                Some(n) => usize::try_from(n)
                    .map_err(|_| bad("memory_max_keys", format!("{n} is too large")))?,
            },
            max_pending_campaigns,
            max_pending_campaigns_per_client: share_of(
                "max_pending_campaigns_per_client",
                cli.max_pending_campaigns_per_client
                    .or(file.max_pending_campaigns_per_client),
                d.max_pending_campaigns_per_client,
                ("max_pending_campaigns", max_pending_campaigns),
            )?,
            max_connections,
            max_connections_set: given_connections.is_some(),
            max_connections_per_ip: share_of(
                "max_connections_per_ip",
                cli.max_connections_per_ip.or(file.max_connections_per_ip),
                d.max_connections_per_ip,
                ("max_connections", max_connections),
            )?,
            header_timeout: duration(
                "header_timeout",
                cli.header_timeout.or(file.header_timeout),
                d.header_timeout,
            )?,
            body_timeout: duration(
                "body_timeout",
                cli.body_timeout.or(file.body_timeout),
                d.body_timeout,
            )?,
            shutdown_grace: duration(
                "shutdown_grace",
                cli.shutdown_grace.or(file.shutdown_grace),
                d.shutdown_grace,
            )?,
        };
        // Timers past a day are a mistake (a unit left out), and tokio's timer wheel takes
        // at most about two years.
        for (name, value) in [
            ("header_timeout", config.header_timeout),
            ("body_timeout", config.body_timeout),
            ("shutdown_grace", config.shutdown_grace),
        ] {
            if value > Duration::from_secs(24 * 3600) {
                return Err(bad(name, "must be at most 24h"));
            }
        }
        // Redis takes a TTL of at most 2^63 - 1 ms; a year is plenty for a report.
        if config.campaign_retention > Duration::from_secs(366 * 24 * 3600) {
            return Err(bad("campaign_retention", "must be at most 366d"));
        }
        if config.campaign_lease < Duration::from_millis(300) {
            return Err(bad("campaign_lease", "must be at least 300ms"));
        }
        // A longer lease would be refused by every campaign lock, and no campaign sent.
        if config.campaign_lease > floodgate::lock::MAX_TTL {
            return Err(bad(
                "campaign_lease",
                format!("must be at most {:?}", floodgate::lock::MAX_TTL),
            ));
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cli(args: &[&str]) -> Cli {
        Cli::parse_from(std::iter::once("sms-gateway").chain(args.iter().copied()))
    }

    #[test]
    fn defaults_match_the_brief() {
        let c = Config::load(cli(&[])).expect("defaults");
        assert_eq!(c.phone_burst, 1);
        assert_eq!(c.phone_interval, Duration::from_secs(1800));
        assert_eq!(c.phone_daily_limit, 10);
        assert_eq!(c.ip_per_minute, 20);
        assert_eq!(c.global_per_second, 100);
    }

    #[test]
    fn bad_settings_are_named() {
        let err = Config::load(cli(&["--phone-interval", "soon"])).expect_err("bad");
        assert_eq!(err.name, "phone_interval");
        let err = Config::load(cli(&["--ip-per-minute", "0"])).expect_err("bad");
        assert_eq!(err.name, "ip_per_minute");
        let err = Config::load(cli(&["--trusted-proxies", "10.0.0.0/8,nope"])).expect_err("bad");
        assert_eq!(err.name, "trusted_proxies");
        let err = Config::load(cli(&["--utc-offset", "+25:00"])).expect_err("bad");
        assert_eq!(err.name, "utc_offset");
        // Longer than any lock lease: no campaign would ever be dispatched.
        let err = Config::load(cli(&["--campaign-retention", "400d"])).expect_err("bad");
        assert_eq!(err.name, "campaign_retention");
        let config = Config::load(cli(&["--campaign-retention", "1h"])).expect("valid");
        assert_eq!(config.campaign_retention, Duration::from_secs(3600));
        let err = Config::load(cli(&["--campaign-lease", "60d"])).expect_err("bad");
        assert_eq!(err.name, "campaign_lease");
        assert!(err.reason.contains("at most"), "{}", err.reason);
        let err = Config::load(cli(&["--max-connections", "0"])).expect_err("bad");
        assert_eq!(err.name, "max_connections");
        let err = Config::load(cli(&["--header-timeout", "0s"])).expect_err("bad");
        assert_eq!(err.name, "header_timeout");
        let err = Config::load(cli(&["--body-timeout", "2d"])).expect_err("bad");
        assert_eq!(err.name, "body_timeout");
        let err = Config::load(cli(&["--shutdown-grace", "later"])).expect_err("bad");
        assert_eq!(err.name, "shutdown_grace");
        let config =
            Config::load(cli(&["--max-connections", "10", "--body-timeout", "5s"])).expect("valid");
        assert_eq!(
            (config.max_connections, config.body_timeout),
            (10, Duration::from_secs(5))
        );
        // The per-address bound: 64 by default, never above the bound of all connections.
        assert_eq!(config.max_connections_per_ip, 10);
        let config = Config::load(cli(&[])).expect("defaults");
        assert_eq!(
            (config.max_connections, config.max_connections_per_ip),
            (512, 64)
        );
        // A client's pending campaigns: 10 by default, never above the bound of all of them.
        assert_eq!(config.max_pending_campaigns_per_client, 10);
        let config = Config::load(cli(&["--max-pending-campaigns", "4"])).expect("valid");
        assert_eq!(config.max_pending_campaigns_per_client, 4);
        let err =
            Config::load(cli(&["--max-pending-campaigns-per-client", "101"])).expect_err("bad");
        assert_eq!(err.name, "max_pending_campaigns_per_client");
        let err = Config::load(cli(&["--max-connections-per-ip", "0"])).expect_err("bad");
        assert_eq!(err.name, "max_connections_per_ip");
        let err = Config::load(cli(&[
            "--max-connections",
            "10",
            "--max-connections-per-ip",
            "11",
        ]))
        .expect_err("bad");
        assert_eq!(err.name, "max_connections_per_ip");
    }

    #[test]
    fn file_settings_lose_to_flags() {
        let dir = std::env::temp_dir().join(format!("sms-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("gateway.toml");
        std::fs::write(
            &path,
            "ip_per_minute = 5\nphone_daily_limit = 3\nutc_offset = \"+08:00\"\n",
        )
        .expect("write");
        let c = Config::load(cli(&[
            "--config",
            path.to_str().expect("utf-8"),
            "--ip-per-minute",
            "7",
        ]))
        .expect("valid");
        assert_eq!(
            (c.ip_per_minute, c.phone_daily_limit, c.utc_offset_secs),
            (7, 3, 8 * 3600)
        );
        std::fs::write(&path, "bogus_key = 1\n").expect("write");
        let err = Config::load(cli(&["--config", path.to_str().expect("utf-8")]))
            .expect_err("unknown key");
        assert!(err.reason.contains("bogus_key"), "{err}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
