//! [`RedisBloom`]: a Bloom filter in Redis bitmaps, on one node or split over a cluster.

use std::fmt;
use std::ops::Range;
use std::sync::{Arc, LazyLock};

use floodgate_core::bloom::{BloomError, BloomFilter, BloomParams, MAX_PARTS};
use redis::{Script, Value};

use crate::error::describe_value;
use crate::{Error, RedisConn, ScriptCall, display_key};

/// Items per script call unless [`RedisBloom::max_items_per_call`] says otherwise: about 10 ms
/// of work for Redis at k = 7, so other clients are not held up long.
pub const DEFAULT_MAX_ITEMS_PER_CALL: usize = 10_000;
/// The longest filter name, in bytes.
pub const MAX_FILTER_NAME_LEN: usize = 200;

/// The config fields, in the order of the scripts' `ARGV[1..7]`.
const FIELDS: [&str; 7] = ["scheme", "n", "p", "m", "k", "parts", "part"];

macro_rules! bloom_script {
    ($file:literal) => {
        LazyLock::new(|| {
            Script::new(concat!(
                include_str!("lua/errors.lua"),
                include_str!("lua/bloom_prelude.lua"),
                include_str!($file)
            ))
        })
    };
}

static INIT: LazyLock<Script> = bloom_script!("lua/bloom_init.lua");
static ADD: LazyLock<Script> = bloom_script!("lua/bloom_add.lua");
static CONTAINS: LazyLock<Script> = bloom_script!("lua/bloom_contains.lua");
static COUNT: LazyLock<Script> = bloom_script!("lua/bloom_count.lua");
static DELETE: LazyLock<Script> = bloom_script!("lua/bloom_delete.lua");

/// A handle on a Bloom filter stored in Redis: a name, parameters and a connection. Cloning is
/// cheap; clones share everything.
///
/// The operations are [`BloomFilter`]'s.
///
/// ```no_run
/// use floodgate_core::bloom::{BloomFilter, BloomParams};
/// use floodgate_redis::{RedisBloom, RedisConfig, RedisConn};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let conn = RedisConn::connect(&RedisConfig::new("redis://127.0.0.1:6379")?).await?;
/// let opted_out = RedisBloom::new(conn, "sms-optout", BloomParams::new(1_000_000, 0.01)?)?;
/// opted_out.try_init().await?; // Ok(false) if it exists already with these parameters
/// opted_out.add(b"+8613800000000").await?;
/// let maybe = opted_out.contains_many(&[b"+8613800000000", b"+8613900000000"]).await?;
/// assert_eq!(maybe, [true, false]); // a `true` is then confirmed against the exact list
/// # Ok(()) }
/// ```
///
/// # Storage
///
/// Part `i` of filter `name` is two keys in one cluster slot:
///
/// - `<prefix>:bloom:<name>:{<name>#<i>}`: the bitmap, a string of exactly
///   `⌈part_bits / 8⌉` bytes, allocated zeroed by `try_init` (bit `j` is `GETBIT key j`);
/// - `<prefix>:bloom:<name>:{<name>#<i>}:cfg`: a hash of the parameters (`scheme`, `n`, `p`,
///   `m`, `k`, `parts`, `part`).
///
/// Every operation on a part is one script that first compares the stored parameters with the
/// handle's, then reads or writes the bits (`SETBIT`, `GETBIT` stopping at an item's first 0
/// bit, `BITCOUNT`), atomically. The client computes the bit offsets (see
/// [`floodgate_core::bloom`] for the scheme). A batch is grouped by part, split into calls of
/// at most [`RedisBloom::max_items_per_call`] items, and sent as one pipeline per node (nodes
/// concurrently). Keys have no TTL: a filter lives until [`BloomFilter::delete`].
#[derive(Clone)]
pub struct RedisBloom {
    conn: RedisConn,
    name: Arc<str>,
    params: BloomParams,
    parts: Arc<[Part]>,
    max_items_per_call: usize,
}

/// The keys of one part and the arguments that identify the handle's parameters to it.
struct Part {
    bits: Vec<u8>,
    cfg: Vec<u8>,
    args: Vec<Vec<u8>>,
}

impl RedisBloom {
    /// A handle on the filter `name` (under the connection's key prefix) with `params`. Nothing
    /// is sent to Redis: create the filter with [`BloomFilter::try_init`], or use a filter
    /// created by another handle with the same parameters.
    ///
    /// # Errors
    /// [`BloomError::Invalid`] naming `name` when it is empty, longer than
    /// [`MAX_FILTER_NAME_LEN`] bytes, or holds a brace (which would move the cluster hash tag).
    pub fn new(conn: RedisConn, name: &str, params: BloomParams) -> Result<Self, BloomError> {
        validate_name(name)?;
        let prefix = conn.key_prefix();
        let parts = (0..params.parts())
            .map(|i| {
                let (bits, cfg) = part_keys(prefix, name, i);
                Part {
                    bits,
                    cfg,
                    args: config_args(&params, i),
                }
            })
            .collect();
        Ok(RedisBloom {
            conn,
            name: name.into(),
            params,
            parts,
            max_items_per_call: DEFAULT_MAX_ITEMS_PER_CALL,
        })
    }

    /// A handle on the existing filter `name`, with the parameters it was created with (read
    /// from its first part): for readers that do not size the filter themselves.
    ///
    /// # Errors
    /// [`BloomError::NotInitialized`] when it does not exist; [`Error::Corrupted`] when its
    /// stored parameters do not parse; [`BloomError::Mismatch`] when they were written by
    /// another hashing scheme or formula; Redis errors.
    pub async fn open(conn: RedisConn, name: &str) -> Result<Self, Error> {
        validate_name(name)?;
        let (_, cfg) = part_keys(conn.key_prefix(), name, 0);
        let mut cmd = redis::cmd("HMGET");
        cmd.arg(&cfg).arg(&FIELDS[..]);
        let stored: Vec<Option<String>> = conn.query(cmd).await?;
        if stored.iter().all(Option::is_none) {
            return Err(BloomError::NotInitialized {
                filter: name.to_owned(),
            }
            .into());
        }
        let field = |i: usize| stored.get(i).and_then(Option::as_deref).unwrap_or("");
        let corrupted = |detail: String| Error::Corrupted {
            key: display_key(&cfg),
            detail,
        };
        let n = field(1).parse::<u64>();
        let p = field(2).parse::<f64>();
        let parts = field(5).parse::<u32>();
        let (Ok(n), Ok(p), Ok(parts)) = (n, p, parts) else {
            return Err(corrupted(format!(
                "stored parameters do not parse: {}",
                describe_stored(&stored)
            )));
        };
        let params = BloomParams::new(n, p)
            .and_then(|params| params.with_parts(parts))
            .map_err(|e| corrupted(format!("stored parameters are invalid: {e}")))?;
        let filter = RedisBloom::new(conn, name, params)?;
        let expected = &filter.parts[0].args[..FIELDS.len()];
        if stored
            .iter()
            .zip(expected)
            .any(|(s, e)| s.as_deref().map(str::as_bytes) != Some(e.as_slice()))
        {
            return Err(BloomError::Mismatch {
                filter: filter.describe_part(0),
                stored: describe_stored(&stored),
                requested: params.to_string(),
            }
            .into());
        }
        Ok(filter)
    }

    /// The same handle, sending at most `items` items per script call (at least 1; default
    /// [`DEFAULT_MAX_ITEMS_PER_CALL`]). Smaller calls hold Redis up for less time; the calls
    /// of one batch still go in one pipeline per node.
    #[must_use]
    pub fn max_items_per_call(mut self, items: usize) -> Self {
        self.max_items_per_call = items.max(1);
        self
    }

    /// The filter's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The connection.
    pub fn conn(&self) -> &RedisConn {
        &self.conn
    }

    /// The keys of every part, `(bitmap, config)`, in part order.
    pub fn keys(&self) -> impl ExactSizeIterator<Item = (&[u8], &[u8])> {
        self.parts
            .iter()
            .map(|part| (part.bits.as_slice(), part.cfg.as_slice()))
    }

    /// `name`, or `name (part i of N, key K)` for a split filter.
    fn describe_part(&self, part: u32) -> String {
        if self.params.parts() == 1 {
            return self.name.to_string();
        }
        let key = self.parts.get(part as usize).map(|p| display_key(&p.bits));
        format!(
            "{} (part {part} of {}, key {})",
            self.name,
            self.params.parts(),
            key.unwrap_or_default()
        )
    }

    /// One call of `script` on `part` with the part's config arguments.
    fn call<'s>(&self, script: &'s Script, part: u32) -> ScriptCall<'s> {
        let part = &self.parts[part as usize];
        ScriptCall {
            script,
            keys: vec![part.bits.clone(), part.cfg.clone()],
            args: part.args.clone(),
        }
    }

    /// The `{0, ...}` reply's payload, or the error its status stands for.
    fn payload(&self, reply: Result<Value, Error>, part: u32) -> Result<Vec<Value>, Error> {
        let unexpected = |got: &Value| Error::UnexpectedReply {
            expected: "a Bloom filter script reply {status, ...}",
            got: describe_value(got),
        };
        let value = reply?;
        let Value::Array(mut items) = value else {
            return Err(unexpected(&value));
        };
        match items.first() {
            Some(Value::Int(0)) => Ok(items.split_off(1)),
            Some(Value::Int(1)) => {
                let stored: Vec<Option<String>> = items[1..]
                    .iter()
                    .map(|v| match v {
                        Value::BulkString(b) if !b.is_empty() => {
                            Some(String::from_utf8_lossy(b).into_owned())
                        }
                        _ => None,
                    })
                    .collect();
                Err(BloomError::Mismatch {
                    filter: self.describe_part(part),
                    stored: describe_stored(&stored),
                    requested: self.params.to_string(),
                }
                .into())
            }
            Some(Value::Int(2)) => Err(BloomError::NotInitialized {
                filter: self.describe_part(part),
            }
            .into()),
            _ => Err(unexpected(&Value::Array(items))),
        }
    }

    /// Runs one call of `script` per part in `parts` and returns their payloads, in order.
    async fn per_part(&self, script: &Script, parts: Range<u32>) -> Result<Vec<Vec<Value>>, Error> {
        if parts.is_empty() {
            return Ok(Vec::new());
        }
        let calls = parts.clone().map(|part| self.call(script, part)).collect();
        let replies = self.conn.pipeline_scripts(calls).await?;
        parts
            .zip(replies)
            .map(|(part, reply)| self.payload(reply, part))
            .collect()
    }

    /// Creates the parts in `parts`: true if any was created.
    async fn init_parts(&self, parts: Range<u32>) -> Result<bool, Error> {
        let payloads = self.per_part(&INIT, parts).await?;
        Ok(payloads
            .iter()
            .any(|payload| matches!(payload.first(), Some(Value::Int(1)))))
    }

    /// Runs `script` (add or contains) on `items`: grouped by part, in calls of at most
    /// `max_items_per_call` items, one pipeline per node. Returns one flag per item.
    async fn per_item(&self, script: &Script, items: &[&[u8]]) -> Result<Vec<bool>, Error> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let k = self.params.hashes() as usize;
        let mut offsets = Vec::with_capacity(items.len() * k);
        let mut located: Vec<(u32, usize)> = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let (part, indexes) = self.params.locate(item);
            located.push((part, i));
            offsets.extend(indexes);
        }
        // By part, and within a part in the callers' order (add's answers depend on it).
        located.sort_unstable();
        let mut calls = Vec::new();
        let mut members: Vec<&[(u32, usize)]> = Vec::new();
        for group in located.chunk_by(|a, b| a.0 == b.0) {
            for chunk in group.chunks(self.max_items_per_call) {
                let mut call = self.call(script, chunk[0].0);
                call.args.reserve(chunk.len() * k);
                for &(_, i) in chunk {
                    call.args.extend(
                        offsets[i * k..(i + 1) * k]
                            .iter()
                            .map(|o| o.to_string().into_bytes()),
                    );
                }
                calls.push(call);
                members.push(chunk);
            }
        }
        let replies = self.conn.pipeline_scripts(calls).await?;
        let mut out = vec![false; items.len()];
        for (chunk, reply) in members.into_iter().zip(replies) {
            let payload = self.payload(reply, chunk[0].0)?;
            let flags = match payload.first() {
                Some(Value::BulkString(flags)) if flags.len() == chunk.len() => flags,
                _ => {
                    return Err(Error::UnexpectedReply {
                        expected: "one flag per item",
                        got: describe_value(&Value::Array(payload)),
                    });
                }
            };
            for (&(_, i), flag) in chunk.iter().zip(flags) {
                out[i] = *flag == b'1';
            }
        }
        Ok(out)
    }

    /// Deletes parts `from..to`: (keys deleted, most parts any of their configs recorded).
    async fn delete_parts(&self, from: u32, to: u32) -> Result<(i64, u32), Error> {
        let prefix = self.conn.key_prefix();
        let calls = (from..to)
            .map(|part| {
                let (bits, cfg) = part_keys(prefix, &self.name, part);
                ScriptCall::new(&DELETE).key(bits).key(cfg)
            })
            .collect();
        let mut deleted = 0;
        let mut recorded = 0;
        for reply in self.conn.pipeline_scripts(calls).await? {
            match reply? {
                Value::Array(v) => match v.as_slice() {
                    [Value::Int(d), Value::Int(p)] => {
                        deleted += d;
                        // A filter never has more than MAX_PARTS parts: a larger count is
                        // corrupt, and would have the caller delete billions of keys.
                        let parts = u32::try_from(*p).unwrap_or(0).min(MAX_PARTS);
                        recorded = recorded.max(parts);
                    }
                    _ => {
                        return Err(Error::UnexpectedReply {
                            expected: "{deleted, parts}",
                            got: describe_value(&Value::Array(v)),
                        });
                    }
                },
                other => {
                    return Err(Error::UnexpectedReply {
                        expected: "{deleted, parts}",
                        got: describe_value(&other),
                    });
                }
            }
        }
        Ok((deleted, recorded))
    }
}

impl BloomFilter for RedisBloom {
    type Error = Error;

    fn params(&self) -> &BloomParams {
        &self.params
    }

    async fn try_init(&self) -> Result<bool, Error> {
        // Part 0 first: every part's config holds the part count, so a filter stored with
        // other parameters is refused there, before any other part is created.
        let mut created = self.init_parts(0..1).await?;
        // Then the others, concurrently. A part that failed (its node was down, say) is
        // created by the next try_init, and the others answer "already there".
        created |= self.init_parts(1..self.params.parts()).await?;
        Ok(created)
    }

    async fn add(&self, item: &[u8]) -> Result<bool, Error> {
        Ok(self.per_item(&ADD, &[item]).await?[0])
    }

    async fn contains(&self, item: &[u8]) -> Result<bool, Error> {
        Ok(self.per_item(&CONTAINS, &[item]).await?[0])
    }

    /// On an error some items (those of other calls) may have been added; adding them again is
    /// harmless.
    async fn add_many(&self, items: &[&[u8]]) -> Result<Vec<bool>, Error> {
        self.per_item(&ADD, items).await
    }

    async fn contains_many(&self, items: &[&[u8]]) -> Result<Vec<bool>, Error> {
        self.per_item(&CONTAINS, items).await
    }

    async fn count(&self) -> Result<u64, Error> {
        let mut set_bits = Vec::with_capacity(self.params.parts() as usize);
        for payload in self.per_part(&COUNT, 0..self.params.parts()).await? {
            match payload.first() {
                Some(Value::Int(n)) if *n >= 0 => set_bits.push(n.unsigned_abs()),
                _ => {
                    return Err(Error::UnexpectedReply {
                        expected: "a bit count",
                        got: describe_value(&Value::Array(payload)),
                    });
                }
            }
        }
        Ok(self.params.estimate_count(set_bits))
    }

    /// Deletes every part the handle knows of, and any further parts the stored filter has
    /// (a filter created with more parts than this handle's).
    async fn delete(&self) -> Result<bool, Error> {
        let known = self.params.parts();
        let (mut deleted, recorded) = self.delete_parts(0, known).await?;
        if recorded > known {
            deleted += self.delete_parts(known, recorded).await?.0;
        }
        Ok(deleted > 0)
    }
}

impl fmt::Debug for RedisBloom {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBloom")
            .field("name", &self.name)
            .field("params", &self.params)
            .field("max_items_per_call", &self.max_items_per_call)
            .field("conn", &self.conn)
            .finish()
    }
}

fn validate_name(name: &str) -> Result<(), BloomError> {
    let reason = if name.is_empty() {
        "must not be empty".to_owned()
    } else if name.len() > MAX_FILTER_NAME_LEN {
        format!("is {} bytes; the most is {MAX_FILTER_NAME_LEN}", name.len())
    } else if name.contains(['{', '}']) {
        "must not hold `{` or `}` (they would move the cluster hash tag)".to_owned()
    } else {
        return Ok(());
    };
    Err(BloomError::Invalid {
        field: "name",
        value: format!("{:?}", display_key(name.as_bytes())),
        reason,
    })
}

/// `(bitmap, config)` keys of part `part`.
fn part_keys(prefix: &str, name: &str, part: u32) -> (Vec<u8>, Vec<u8>) {
    let bits = format!("{prefix}:bloom:{name}:{{{name}#{part}}}").into_bytes();
    let mut cfg = bits.clone();
    cfg.extend_from_slice(b":cfg");
    (bits, cfg)
}

/// `ARGV[1..8]` of every script on `part`: the config as stored, then the bitmap's bytes.
fn config_args(params: &BloomParams, part: u32) -> Vec<Vec<u8>> {
    [
        params.scheme().to_string(),
        params.expected_insertions().to_string(),
        // Rust prints the shortest text that parses back to the same f64, on every platform.
        params.false_probability().to_string(),
        params.bits().to_string(),
        params.hashes().to_string(),
        params.parts().to_string(),
        part.to_string(),
        params.part_bytes().to_string(),
    ]
    .into_iter()
    .map(String::into_bytes)
    .collect()
}

/// Stored config fields (in [`FIELDS`] order) in the form of [`BloomParams`]' `Display`.
fn describe_stored(stored: &[Option<String>]) -> String {
    let field = |i: usize| stored.get(i).and_then(Option::as_deref).unwrap_or("?");
    let parts = field(5);
    format!(
        "n={} p={} (m={} bits, k={}, {parts} part{}, scheme {})",
        field(1),
        field(2),
        field(3),
        field(4),
        if parts == "1" { "" } else { "s" },
        field(0)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_share_a_slot_per_part() {
        let (bits, cfg) = part_keys("fg", "sms-optout", 3);
        assert_eq!(bits, b"fg:bloom:sms-optout:{sms-optout#3}");
        assert_eq!(cfg, b"fg:bloom:sms-optout:{sms-optout#3}:cfg");
    }

    #[test]
    fn names_are_validated() {
        for bad in ["", "a{b", "}", &"x".repeat(MAX_FILTER_NAME_LEN + 1)] {
            let err = validate_name(bad).expect_err("refused");
            assert_eq!(err.field(), Some("name"), "{err}");
        }
        assert!(validate_name("sms-optout:v2").is_ok());
    }

    #[test]
    fn stored_params_read_like_params() {
        let params = BloomParams::new(1_000_000, 0.01).expect("valid");
        let stored: Vec<Option<String>> = config_args(&params, 0)[..FIELDS.len()]
            .iter()
            .map(|a| Some(String::from_utf8_lossy(a).into_owned()))
            .collect();
        assert_eq!(describe_stored(&stored), params.to_string());
    }
}
