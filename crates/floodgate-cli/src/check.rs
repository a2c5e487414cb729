//! `floodgate check`: one real decision against a Redis server, printed as JSON.

use clap::Args;
use floodgate_core::{Check, CheckOptions, Decision, Limiter};
use floodgate_redis::{RedisLimiter, display_key};
use serde::Serialize;

use crate::error::CliError;
use crate::policy_args::{PolicyArgs, PolicySet, algorithms_help};
use crate::redis_args::{RedisArgs, small_runtime};

const LONG_ABOUT: &str = "\
Make one real rate-limiting decision against Redis and print it as JSON.

This is exactly what a service using floodgate does for one request: one atomic script call
that reads the key's state, decides with the server's clock, and (when allowed) counts the
request. Use --cost 0 to peek without counting anything. Several --policy flags are checked
all-or-nothing: nothing is counted unless every policy allows.";

const AFTER_HELP: &str = concat!(
    algorithms_help!(),
    "
Output (stdout), one JSON object:
  {\"allowed\":true,\"limit\":10,\"remaining\":9,\"retry_after_ms\":null,\"reset_after_ms\":6000,
   \"key\":\"floodgate:gcra:gcra-10-per-1m:{alice}\",\"policy\":\"gcra-10-per-1m\",
   \"server_time_us\":1700000000000000,\"connection\":\"multiplexed\",\"redis_cell\":false}
  key is the Redis key holding the state; redis_cell says whether the server also has the
  redis-cell module (CL.THROTTLE), which floodgate does not use: its own scripts give the same
  GCRA answers on any Redis. A concurrency policy adds \"lease\" (the lease expires after its
  ttl: the CLI never releases it); a shaper adds \"wait_ms\".

Examples:
  floodgate check --policy 10/minute alice
  floodgate check --redis redis://:pw@cache:6379 --algorithm gcra --max-burst 4 --count 1 --period 1s +8613800000000
  floodgate check --policy 5/s --policy 100/hour --cost 2 10.0.0.1

Exit status: 0 when a decision was made (allowed or not), 1 when Redis could not be reached,
did not answer in time or holds a corrupted key, 2 for a bad command line or policy."
);

/// Flags of `floodgate check`.
#[derive(Debug, Args)]
#[command(
    about = "Make one real decision against Redis and print it as JSON",
    long_about = LONG_ABOUT,
    after_help = AFTER_HELP
)]
pub(crate) struct CheckArgs {
    #[command(flatten)]
    redis: RedisArgs,

    #[command(flatten)]
    policy: PolicyArgs,

    /// The units this request takes; 0 only peeks (nothing changes).
    #[arg(long, value_name = "N", default_value_t = 1)]
    cost: u64,

    /// The user key: a phone number, an IP address, a user id... (any text).
    #[arg(value_name = "KEY")]
    key: String,
}

/// One policy's decision as printed.
#[derive(Debug, Serialize)]
pub(crate) struct DecisionJson {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) policy: Option<String>,
    pub(crate) allowed: bool,
    pub(crate) limit: u64,
    pub(crate) remaining: u64,
    pub(crate) retry_after_ms: Option<u64>,
    pub(crate) reset_after_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) key: Option<String>,
}

impl DecisionJson {
    pub(crate) fn new(d: &Decision) -> Self {
        DecisionJson {
            policy: None,
            allowed: d.allowed,
            limit: d.limit,
            remaining: d.remaining,
            retry_after_ms: d.retry_after_ms(),
            reset_after_ms: d.reset_after_ms(),
            key: None,
        }
    }
}

/// The whole output.
#[derive(Debug, Serialize)]
struct CheckJson {
    allowed: bool,
    limit: u64,
    remaining: u64,
    retry_after_ms: Option<u64>,
    reset_after_ms: u64,
    /// The Redis key of the strictest policy (the one whose fields are shown above).
    key: String,
    policy: String,
    server_time_us: u64,
    connection: String,
    /// None when the server would not say (`COMMAND INFO` refused).
    redis_cell: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    wait_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lease: Option<Option<u64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    policies: Option<Vec<DecisionJson>>,
}

/// Runs `floodgate check`.
pub(crate) fn run(args: CheckArgs) -> Result<(), CliError> {
    let set = args.policy.build()?;
    let json = small_runtime()?.block_on(async {
        let limiter = args.redis.connect().await?;
        decide(&limiter, &set, args.key.as_bytes(), args.cost).await
    })?;
    crate::error::print_json(&json)
}

async fn decide(
    limiter: &RedisLimiter,
    set: &PolicySet,
    key: &[u8],
    cost: u64,
) -> Result<CheckJson, CliError> {
    let conn = limiter.conn();
    let url = conn.redacted_url();
    let shown = display_key(key);
    let redis_cell = conn.has_redis_cell().await.ok();
    let server_time_us = conn
        .server_time()
        .await
        .map_err(|e| CliError::redis(format!("cannot read the server's time on {url}"), e))?;
    let checks: Vec<Check<'_>> = set
        .policies
        .iter()
        .map(|p| Check::new(key, p).cost(cost))
        .collect();
    let verdict = limiter
        .check(&checks, CheckOptions::wait(set.max_wait))
        .await
        .map_err(|e| CliError::redis(format!("cannot check key \"{shown}\" on {url}"), e))?;
    let (index, top) = verdict
        .strictest()
        .ok_or_else(|| CliError::Failed("Redis returned no decision".into()))?;
    let redis_key = |i: usize| display_key(&limiter.state_key(&set.policies[i], key));
    let policies = (set.policies.len() > 1).then(|| {
        set.policies
            .iter()
            .zip(&verdict.decisions)
            .enumerate()
            .map(|(i, (p, d))| DecisionJson {
                policy: Some(p.name().to_owned()),
                key: Some(redis_key(i)),
                ..DecisionJson::new(d)
            })
            .collect()
    });
    Ok(CheckJson {
        allowed: verdict.allowed(),
        limit: top.limit,
        remaining: top.remaining,
        retry_after_ms: top.retry_after_ms(),
        reset_after_ms: top.reset_after_ms(),
        key: redis_key(index),
        policy: set.policies[index].name().to_owned(),
        server_time_us,
        connection: conn.kind().to_string(),
        redis_cell,
        wait_ms: set
            .shaping()
            .then(|| u64::try_from(verdict.wait.as_micros().div_ceil(1_000)).unwrap_or(u64::MAX)),
        lease: set
            .concurrency()
            .map(|_| verdict.lease.map(|lease| lease.0)),
        policies,
    })
}
