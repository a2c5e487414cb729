//! `floodgate inspect`: the raw state of a key in Redis for operators, with a peek at the next
//! decision; or, with `--pattern`, every key under the prefix with its TTL.

use std::sync::LazyLock;
use std::time::Duration;

use clap::Args;
use floodgate_core::{Check, CheckOptions, Limiter, Policy};
use floodgate_redis::{RedisLimiter, display_key};
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Script, Value};
use serde::Serialize;

use crate::check::DecisionJson;
use crate::error::CliError;
use crate::policy_args::{PolicyArgs, algorithms_help};
use crate::redis_args::{RedisArgs, cluster_slots, masters, small_runtime};

const LONG_ABOUT: &str = "\
Show the raw state floodgate keeps in Redis for a key, for operators.

For each policy: the Redis key, its type, its TTL (PTTL, in milliseconds) and its content
decoded (a string's value, a hash's fields, a sorted set's members with their scores), read
atomically together with the server's time; then a peek at what the next request would get
(a check of cost 0, which changes nothing).

With --pattern, lists the keys matching a pattern (SCAN, never KEYS; every master of a
cluster) with their type and TTL, and flags any key without a TTL: floodgate gives every key
one, so such a key was written by something else (or by a bug).";

const AFTER_HELP: &str = concat!(
    algorithms_help!(),
    "
Examples:
  floodgate inspect --policy 10/minute alice
  floodgate inspect --algorithm sliding_log --limit 5 --window 1m +8613800000000
  floodgate inspect --pattern                 # every key under --prefix (floodgate:*)
  floodgate inspect --pattern --name sms-per-phone  # every key of that policy
  floodgate inspect --pattern 'floodgate:gcra:*' --count 1000

Exit status: 0 when the state was shown, 1 when Redis could not be reached or the key's state
is unusable (the raw content is still printed), 2 for a bad command line or policy."
);

/// The most sorted-set members shown.
const MAX_MEMBERS: usize = 1000;
/// `--pattern` lists at most this many keys unless `--count` says otherwise.
const DEFAULT_LIST: u64 = 100;

/// Flags of `floodgate inspect`.
#[derive(Debug, Args)]
#[command(
    about = "Show a key's raw state in Redis and what the next request would get",
    long_about = LONG_ABOUT,
    after_help = AFTER_HELP,
    mut_arg("count", |a| a.help(
        "gcra, shaper: requests per --period; with --pattern: list at most N keys [default: 100]"
    ))
)]
pub(crate) struct InspectArgs {
    #[command(flatten)]
    redis: RedisArgs,

    #[command(flatten)]
    policy: PolicyArgs,

    /// List the keys matching PATTERN (glob, as SCAN MATCH) instead of one key's state;
    /// without a value, every key under --prefix (with --name, every key of that policy:
    /// `<prefix>:*:<name>:{*`, which a longer prefix under this one, or a Bloom filter of the
    /// same name, matches too).
    #[arg(
        long,
        value_name = "PATTERN",
        num_args = 0..=1,
        default_missing_value = "",
        conflicts_with = "key"
    )]
    pattern: Option<String>,

    /// The user key: a phone number, an IP address, a user id... (any text).
    #[arg(value_name = "KEY", required_unless_present = "pattern")]
    key: Option<String>,
}

/// Reads a key's type, PTTL and content atomically, with the server's time.
static READ_STATE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local key = KEYS[1]
local t = redis.call('TYPE', key)['ok']
local pttl = redis.call('PTTL', key)
local n = 0
local content = {}
if t == 'string' then
  content = { redis.call('GET', key) }
elseif t == 'hash' then
  content = redis.call('HGETALL', key)
elseif t == 'zset' then
  n = redis.call('ZCARD', key)
  content = redis.call('ZRANGE', key, 0, tonumber(ARGV[1]) - 1, 'WITHSCORES')
elseif t == 'list' then
  n = redis.call('LLEN', key)
  content = redis.call('LRANGE', key, 0, tonumber(ARGV[1]) - 1)
elseif t == 'set' then
  n = redis.call('SCARD', key)
  content = redis.call('SRANDMEMBER', key, tonumber(ARGV[1]))
end
local now = redis.call('TIME')
return { t, pttl, n, content, now[1] * 1000000 + now[2] }
",
    )
});

/// A sorted-set member and its score.
#[derive(Debug, Serialize)]
pub(crate) struct Member {
    member: String,
    score: serde_json::Value,
}

/// One key's raw state.
#[derive(Debug, Serialize)]
pub(crate) struct StateJson {
    pub(crate) key: String,
    pub(crate) policy: String,
    pub(crate) exists: bool,
    #[serde(rename = "type")]
    pub(crate) kind: String,
    /// Milliseconds until the key expires; null when it does not exist or has no TTL.
    pub(crate) pttl_ms: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    value: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    fields: Option<serde_json::Map<String, serde_json::Value>>,
    /// Sorted sets, lists and sets: how many members (only the first 1000 are shown).
    #[serde(skip_serializing_if = "Option::is_none")]
    size: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    members: Option<Vec<Member>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    items: Option<Vec<String>>,
    pub(crate) server_time_us: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    note: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) decision: Option<DecisionJson>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) decision_error: Option<String>,
}

/// Several policies: the combined peek and each policy's state.
#[derive(Debug, Serialize)]
struct ManyJson {
    allowed: Option<bool>,
    policies: Vec<StateJson>,
}

/// Runs `floodgate inspect`.
pub(crate) fn run(args: InspectArgs) -> Result<(), CliError> {
    if let Some(pattern) = &args.pattern {
        return list(&args, pattern);
    }
    let set = args.policy.build()?;
    let key = args.key.as_deref().unwrap_or_default().as_bytes();
    let (text, failure) = small_runtime()?.block_on(async {
        let limiter = args.redis.connect().await?;
        let mut states = Vec::with_capacity(set.policies.len());
        for policy in &set.policies {
            states.push(read_state(&limiter, policy, key).await?);
        }
        // The peek: a check of cost 0 changes nothing.
        let checks: Vec<Check<'_>> = set
            .policies
            .iter()
            .map(|p| Check::new(key, p).cost(0))
            .collect();
        let url = limiter.conn().redacted_url().to_owned();
        let (allowed, failure) = match limiter
            .check(&checks, CheckOptions::wait(set.max_wait))
            .await
        {
            Ok(verdict) => {
                for (state, d) in states.iter_mut().zip(&verdict.decisions) {
                    state.decision = Some(DecisionJson::new(d));
                }
                (Some(verdict.allowed()), None)
            }
            Err(e) => {
                for state in &mut states {
                    state.decision_error = Some(e.to_string());
                }
                let shown = display_key(key);
                let context = format!("the state of key \"{shown}\" on {url} is unusable");
                (None, Some(CliError::redis(context, e)))
            }
        };
        let text = if states.len() == 1 {
            serde_json::to_string(&states[0])
        } else {
            serde_json::to_string(&ManyJson {
                allowed,
                policies: states,
            })
        }
        .map_err(|e| CliError::Failed(e.to_string()))?;
        Ok::<_, CliError>((text, failure))
    })?;
    crate::error::print(&format!("{text}\n"))?;
    failure.map_or(Ok(()), Err)
}

/// The raw state of `policy`'s key for `key`, read atomically.
pub(crate) async fn read_state(
    limiter: &RedisLimiter,
    policy: &Policy,
    key: &[u8],
) -> Result<StateJson, CliError> {
    let redis_key = limiter.state_key(policy, key);
    let shown = display_key(&redis_key);
    let conn = limiter.conn();
    let limit = MAX_MEMBERS.to_string();
    let reply = conn
        .invoke_script(&READ_STATE, &[&redis_key], &[limit.as_bytes()])
        .await
        .map_err(|e| {
            CliError::redis(
                format!("cannot read key {shown} on {}", conn.redacted_url()),
                e,
            )
        })?;
    let bad = || CliError::Failed(format!("unexpected reply reading key {shown}: {reply:?}"));
    let Value::Array(parts) = &reply else {
        return Err(bad());
    };
    let [kind, pttl, size, content, now] = parts.as_slice() else {
        return Err(bad());
    };
    let kind = text(kind).ok_or_else(bad)?;
    let (Value::Int(pttl), Value::Int(size), Value::Array(content), Value::Int(now)) =
        (pttl, size, content, now)
    else {
        return Err(bad());
    };
    let mut state = StateJson {
        key: shown,
        policy: policy.name().to_owned(),
        exists: kind != "none",
        kind,
        pttl_ms: (*pttl >= 0).then_some(*pttl),
        value: None,
        fields: None,
        size: None,
        members: None,
        items: None,
        server_time_us: u64::try_from(*now).unwrap_or(0),
        note: None,
        decision: None,
        decision_error: None,
    };
    match state.kind.as_str() {
        "none" => {
            state.note = Some(
                "no state: the key does not exist (never used, expired or reset); the next \
                 request starts afresh",
            );
        }
        "string" => state.value = content.first().and_then(text),
        "hash" => {
            let mut fields = serde_json::Map::new();
            for pair in content.chunks(2) {
                if let [name, value] = pair {
                    let value = text(value).unwrap_or_default();
                    fields.insert(text(name).unwrap_or_default(), number_or_text(&value));
                }
            }
            state.fields = Some(fields);
        }
        "zset" => {
            state.size = u64::try_from(*size).ok();
            state.members = Some(
                content
                    .chunks(2)
                    .filter_map(|pair| match pair {
                        [member, score] => Some(Member {
                            member: text(member).unwrap_or_default(),
                            score: number_or_text(&text(score).unwrap_or_default()),
                        }),
                        _ => None,
                    })
                    .collect(),
            );
        }
        "list" | "set" => {
            state.size = u64::try_from(*size).ok();
            state.items = Some(content.iter().filter_map(text).collect());
        }
        _ => {}
    }
    if state.exists && state.pttl_ms.is_none() {
        state.note = Some(
            "no TTL: floodgate gives every key one, so something else wrote this key (it never \
             expires)",
        );
    } else if state.exists && !matches!(state.kind.as_str(), "string" | "hash" | "zset") {
        state.note = Some("floodgate keeps no state of this type: something else wrote this key");
    }
    Ok(state)
}

/// A reply's text: UTF-8 as it is, other bytes escaped like keys in error messages.
fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(match std::str::from_utf8(b) {
            Ok(s) if !s.chars().any(char::is_control) => s.to_owned(),
            _ => display_key(b),
        }),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Okay => Some("OK".to_owned()),
        Value::Int(i) => Some(i.to_string()),
        Value::Double(d) => Some(d.to_string()),
        _ => None,
    }
}

/// An integer as a JSON number (the states hold microsecond timestamps and counts), anything
/// else as text.
fn number_or_text(s: &str) -> serde_json::Value {
    s.parse::<i64>()
        .map_or_else(|_| serde_json::Value::String(s.to_owned()), Into::into)
}

/// One listed key.
#[derive(Debug, Serialize)]
struct ListedKey {
    key: String,
    #[serde(rename = "type")]
    kind: String,
    /// Null when the key has no TTL (it never expires).
    pttl_ms: Option<i64>,
}

/// `--pattern`'s output.
#[derive(Debug, Serialize)]
struct ListJson {
    pattern: String,
    nodes: usize,
    /// Whether every matching key was seen (false when --count stopped the scan).
    complete: bool,
    listed: usize,
    keys: Vec<ListedKey>,
    /// Keys that never expire: there should be none.
    without_ttl: Vec<String>,
}

/// `text` as a SCAN pattern that matches it alone.
fn escape_glob(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len() + 2);
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

/// `floodgate inspect --pattern`.
fn list(args: &InspectArgs, pattern: &str) -> Result<(), CliError> {
    // `--name` narrows the default pattern to that policy's keys
    // (`<prefix>:<algorithm>:<name>:{<key>}`); a pattern of one's own says it all.
    let name = match args.policy.name.as_slice() {
        [] => None,
        [name] if pattern.is_empty() => Some(name),
        [_] => {
            return Err(CliError::usage(
                "--name narrows the default pattern (every key of that policy under --prefix); \
                 with a pattern of your own, write the name into it",
            ));
        }
        _ => {
            return Err(CliError::usage(
                "--pattern lists the keys of one --name at most",
            ));
        }
    };
    let pattern = if pattern.is_empty() {
        // The prefix and the name as they are: they may hold the pattern's own
        // metacharacters.
        let escaped = escape_glob(&args.redis.prefix);
        match name {
            Some(name) => escaped + ":*:" + &escape_glob(name) + ":{*",
            None => escaped + ":*",
        }
    } else {
        pattern.to_owned()
    };
    let policy_flags = PolicyArgs {
        count: None,
        ..args.policy.clone()
    };
    if policy_flags.any_given() {
        return Err(CliError::usage(
            "--pattern lists keys: it takes no policy flags (give a KEY and the policy to \
             inspect one key's state)",
        ));
    }
    let max = args.policy.count.unwrap_or(DEFAULT_LIST);
    let max = usize::try_from(max).unwrap_or(usize::MAX);
    let redis = &args.redis;
    let out = small_runtime()?.block_on(async {
        // The limiter's connection says whether this is a cluster and, if so, where its masters are.
        let limiter = redis.connect().await?;
        let url = limiter.conn().redacted_url().to_owned();
        let clients = if redis.is_cluster()? {
            let ranges = cluster_slots(limiter.conn(), &redis.seed_host()?).await?;
            masters(&ranges)
                .into_iter()
                .map(|(host, port)| redis.node_client(&host, port))
                .collect::<Result<Vec<_>, _>>()?
        } else {
            vec![redis.client()?]
        };
        let mut out = ListJson {
            pattern: pattern.clone(),
            nodes: clients.len(),
            complete: true,
            listed: 0,
            keys: Vec::new(),
            without_ttl: Vec::new(),
        };
        for client in &clients {
            let mut conn = node_conn(client, redis, &url).await?;
            let finished = scan_node(&mut conn, &pattern, max, &mut out.keys, redis.timeout)
                .await
                .map_err(|e| CliError::Failed(format!("cannot list keys on {url}: {e}")))?;
            if !finished {
                out.complete = false;
                break;
            }
        }
        out.listed = out.keys.len();
        out.without_ttl = out
            .keys
            .iter()
            .filter(|k| k.pttl_ms.is_none())
            .map(|k| k.key.clone())
            .collect();
        Ok::<_, CliError>(out)
    })?;
    if !out.without_ttl.is_empty() {
        eprintln!(
            "warning: {} key(s) without a TTL (they never expire): {}",
            out.without_ttl.len(),
            out.without_ttl.join(", ")
        );
    }
    crate::error::print_json(&out)
}

/// A plain connection to one node, bounded like floodgate's own.
pub(crate) async fn node_conn(
    client: &redis::Client,
    redis: &RedisArgs,
    url: &str,
) -> Result<MultiplexedConnection, CliError> {
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(redis.connect_timeout))
        .set_response_timeout(Some(redis.timeout));
    client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .map_err(|e| CliError::Failed(format!("cannot reach Redis at {url}: {e}")))
}

/// Scans one node, appending matching keys with their type and TTL, until `max` keys are listed
/// in all. Returns whether the node's scan finished.
async fn scan_node(
    conn: &mut MultiplexedConnection,
    pattern: &str,
    max: usize,
    keys: &mut Vec<ListedKey>,
    timeout: Duration,
) -> Result<bool, String> {
    let mut cursor: u64 = 0;
    loop {
        if keys.len() >= max {
            return Ok(false);
        }
        let mut scan = redis::cmd("SCAN");
        scan.arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000);
        let (next, batch): (u64, Vec<Vec<u8>>) = bounded(timeout, scan.query_async(conn)).await?;
        let room = max - keys.len();
        let cut = batch.len() > room;
        let batch = &batch[..batch.len().min(room)];
        if !batch.is_empty() {
            let mut pipe = redis::pipe();
            for key in batch {
                pipe.cmd("TYPE").arg(key).cmd("PTTL").arg(key);
            }
            let replies: Vec<Value> = bounded(timeout, pipe.query_async(conn)).await?;
            for (key, pair) in batch.iter().zip(replies.chunks(2)) {
                let kind = pair.first().and_then(text).unwrap_or_default();
                if kind == "none" {
                    continue; // expired between SCAN and TYPE
                }
                let pttl = match pair.get(1) {
                    Some(Value::Int(ms)) if *ms >= 0 => Some(*ms),
                    // Expired between TYPE and PTTL: gone, not a key without a TTL.
                    Some(Value::Int(-2)) => continue,
                    _ => None,
                };
                keys.push(ListedKey {
                    key: display_key(key),
                    kind,
                    pttl_ms: pttl,
                });
            }
        }
        if cut {
            return Ok(false);
        }
        if next == 0 {
            return Ok(true);
        }
        cursor = next;
    }
}

async fn bounded<T>(
    timeout: Duration,
    fut: impl Future<Output = redis::RedisResult<T>>,
) -> Result<T, String> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {timeout:?}")),
    }
}
