//! The GCRA batch: a batch of plain GCRA checks in one call of `lua/gcra_batch.lua`.
//!
//! Most checks a service makes are plain (one policy, cost 1, no wait, no lease, counted), and
//! GCRA is the default algorithm. For a batch made only of those, the script reads every key
//! with `MGET`, writes each changed key once, and replies with the state each key held before
//! its checks. The decisions are then replayed here with floodgate-core's GCRA, which decides
//! exactly as the script does (integers below 2^53). Against the general check script this
//! takes about 2.7 µs of the server's time per check instead of 4.1 (`redis-benchmark` driving
//! both scripts with 16 checks per call, `INFO commandstats`): the server is what limits a
//! replica's decisions per second. Within the script, formatting the numbers it writes cost
//! more than the rest of a check's Lua: it formats each distinct value once per call (keys
//! checked fresh in one call share their new tat and TTL), and a 64-bit Redis formats a tat
//! with one `'%d'`. That took the server's instructions per check from 29.1k to 23.5k (20 fresh
//! keys per call, under callgrind), and `floodgate bench` from 219k to 241k decisions/s.
//!
//! The script's fixed cost per call is what a batch of a few dozen checks feels most: reading a
//! number (a `strtod`) costs about 1.7k instructions, a Lua table about 600, a closure about as
//! much, and a `redis.call` several thousand. So the script includes only `numbers.lua` of the
//! shared helpers, reads each argument once, builds policy tables only for several policies,
//! and calls no Lua function of its own per check except to format a number not written yet;
//! its reply is the table of its first `MGET`, the time appended. `scripts/bench-redis-cost`
//! measures the server's instructions per decision under `floodgate bench` (about 20 checks per
//! call) against the native module's `CL.THROTTLE`, pipelined 16 deep on as many keys: 26.2k
//! before this cut, 23.5k to 23.9k after, against the module's 25.7k. The last step of the cut
//! (each key's count read once, one policy's parameters kept out of tables) took a call for one
//! hot key with 20 checks from 93.1k to 87.5k.

use std::collections::HashMap;
use std::sync::LazyLock;
use std::time::Duration;

use floodgate_core::algorithm::gcra::{Gcra, State};
use floodgate_core::algorithm::{Algorithm, Ctx};
use floodgate_core::{Timestamp, Verdict};
use redis::{Script, Value};
use smallvec::{SmallVec, smallvec};

use crate::batch::{Checked, EncodedArgs, duplicate, group_error, refused_reply};
use crate::limiter::Group;
use crate::{Error, RedisConn};

/// The GCRA batch script.
pub(crate) static GCRA_BATCH: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        include_str!("lua/numbers.lua"),
        include_str!("lua/gcra_batch.lua"),
    ))
});

/// A batch of plain GCRA checks, as the GCRA batch script takes it.
pub(crate) struct GcraBatch<'a> {
    /// The distinct policies, in order of first use.
    policies: SmallVec<[Gcra; 2]>,
    /// The distinct state keys, in order of first use.
    keys: SmallVec<[&'a [u8]; 16]>,
    /// Per key: its policy's position in `policies`, and how many checks it has.
    per_key: SmallVec<[(u32, u32); 16]>,
    /// Per group: its key's position in `keys`.
    key_of: SmallVec<[u32; 16]>,
    /// The injected time, if any.
    now: Option<u64>,
}

impl<'a> GcraBatch<'a> {
    /// The batch of `groups` when every one is a plain GCRA check; `None` otherwise.
    pub(crate) fn of(groups: &[&'a Group]) -> Option<Self> {
        let mut batch = GcraBatch {
            policies: SmallVec::new(),
            keys: SmallVec::with_capacity(groups.len()),
            per_key: SmallVec::with_capacity(groups.len()),
            key_of: SmallVec::with_capacity(groups.len()),
            now: groups.first()?.now.map(|t| t.as_micros()),
        };
        // Positions of the keys seen so far; only a batch of several needs them.
        // Hashed with foldhash, randomly seeded: SipHash took most of this function's time, and
        // a batch holds at most `max_batch` keys, so even keys made to collide cost little.
        let mut seen: Option<HashMap<&[u8], u32, foldhash::fast::RandomState>> = (groups.len() > 1)
            .then(|| HashMap::with_capacity_and_hasher(groups.len(), Default::default()));
        for g in groups {
            let gcra = g.plain_gcra()?;
            let key = g.keys.first()?.as_slice();
            let known = seen.as_ref().and_then(|s| s.get(key).copied());
            let k = match known {
                // Policies of one algorithm and name share a key's state even when their
                // parameters differ; the script runs all of a key's checks with one policy's,
                // so such a batch takes the general script.
                Some(k) if batch.policies[batch.per_key[k as usize].0 as usize] != gcra => {
                    return None;
                }
                Some(k) => {
                    batch.per_key[k as usize].1 += 1;
                    k
                }
                None => {
                    let p = match batch.policies.iter().position(|q| *q == gcra) {
                        Some(p) => p,
                        None => {
                            batch.policies.push(gcra);
                            batch.policies.len() - 1
                        }
                    };
                    let k = u32::try_from(batch.keys.len()).ok()?;
                    batch.keys.push(key);
                    batch.per_key.push((u32::try_from(p).ok()?, 1));
                    if let Some(seen) = seen.as_mut() {
                        seen.insert(key, k);
                    }
                    k
                }
            };
            batch.key_of.push(k);
        }
        Some(batch)
    }

    /// The keys of the call.
    pub(crate) fn keys(&self) -> &[&'a [u8]] {
        &self.keys
    }

    /// The script's arguments: the time, the policies, then, unless every key has one check
    /// of the first policy, one value per key (`n * P + i`: `n` checks of the policy at
    /// 0-based position `i`).
    pub(crate) fn args(&self) -> EncodedArgs {
        let mut out =
            EncodedArgs::with_capacity(24 + self.policies.len() * 24 + self.keys.len() * 4);
        match self.now {
            Some(t) => out.push_u64(t),
            None => out.push_bytes(b""),
        }
        out.push_u64(self.policies.len() as u64);
        for g in &self.policies {
            out.push_u64(g.emission_us());
            out.push_u64(g.tolerance_us());
        }
        if self.per_key.iter().any(|&(p, n)| p != 0 || n != 1) {
            let np = self.policies.len() as u64;
            for &(p, n) in &self.per_key {
                out.push_u64(u64::from(n) * np + u64::from(p));
            }
        }
        out
    }

    /// Runs the batch in one call, bounded by `timeout`: one result per group, in order.
    pub(crate) async fn run(
        &self,
        conn: &RedisConn,
        groups: &[&Group],
        timeout: Duration,
    ) -> Result<Vec<Result<Checked, Error>>, Error> {
        let args = self.args();
        let arg_refs: SmallVec<[&[u8]; 8]> = args.iter().collect();
        let reply = conn
            .invoke_check_within(&GCRA_BATCH, &self.keys, &arg_refs, timeout, refused_reply)
            .await?;
        self.decode(&reply, groups, conn.redacted_url())
    }

    /// Replays each key's checks on the state the script found, in the batch's order.
    fn decode(
        &self,
        reply: &Value,
        groups: &[&Group],
        addr: &str,
    ) -> Result<Vec<Result<Checked, Error>>, Error> {
        let unexpected = || Error::UnexpectedReply {
            expected: "the GCRA batch script's reply",
            got: format!("{reply:?}").chars().take(200).collect(),
        };
        let Value::Array(items) = reply else {
            return Err(unexpected());
        };
        if items.len() != self.keys.len() + 1 || groups.len() != self.key_of.len() {
            return Err(unexpected());
        }
        let Some((Value::Int(now), per_key)) = items.split_last() else {
            return Err(unexpected());
        };
        let now = u64::try_from(*now).map_err(|_| unexpected())?;
        // Per key: its state as the checks go, or its error.
        let mut states: SmallVec<[Result<State, Error>; 16]> =
            SmallVec::with_capacity(self.keys.len());
        for (item, key) in per_key.iter().zip(&self.keys) {
            let message = match item {
                Value::Int(tat) => {
                    states.push(Ok(State {
                        tat: u64::try_from(*tat).map_err(|_| unexpected())?,
                    }));
                    continue;
                }
                Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                Value::SimpleString(s) => s.clone(),
                _ => return Err(unexpected()),
            };
            states.push(Err(group_error(&message, &[key.to_vec()], addr)));
        }
        let ctx = Ctx::new(now, 1);
        let mut out = Vec::with_capacity(groups.len());
        for &k in &self.key_of {
            let (p, _) = self.per_key[k as usize];
            let result = match &mut states[k as usize] {
                Ok(state) => {
                    let outcome = self.policies[p as usize].check(state, &ctx);
                    Ok((
                        Verdict {
                            decisions: smallvec![outcome.decision],
                            wait: Duration::ZERO,
                            lease: None,
                            at: Timestamp::from_micros(now),
                        },
                        now,
                    ))
                }
                Err(e) => Err(duplicate(e)),
            };
            out.push(result);
        }
        Ok(out)
    }
}
