//! What replicas share: limits, locks, idempotency keys, opt-outs and campaigns — in this
//! process's memory, or in Redis so that every replica sees the same.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use floodgate::lock::{FenceCheck, Lock, RedisLocks};
use floodgate::redis::{RedisBloom, RedisConn, RedisLimiter};
use floodgate::{
    BloomFilter, BloomParams, DenyCache, Limiter, LockStore, MemoryBloom, MemoryLimiter,
    MemoryLocks, OnFull,
};
use serde::Serialize;
use serde_json::json;

/// How long an idempotency key is remembered.
pub const IDEMPOTENCY_TTL: Duration = Duration::from_secs(24 * 3600);
/// How long a key stays "in progress" without an answer recorded (a replica that died
/// mid-send): then the key may be used again.
pub const IN_PROGRESS_TTL: Duration = Duration::from_secs(60);

/// The fencing rule over a campaign's hash (as `floodgate::lock::FenceCheck`): `fenced(key,
/// token)` is false when a dispatcher with a larger token has written; otherwise the token is
/// the campaign's (`fence`) from now on. A stored or given token that is not a number is a
/// script error, never a fence let down. Written before every script that uses it.
const FENCED: &str = r"
local function fenced(key, arg)
  local stored = redis.call('HGET', key, 'fence')
  local held = 0
  if stored then
    held = tonumber(stored)
  end
  local token = tonumber(arg)
  if not held or not token then
    error('campaign fence: not a number (stored ' .. tostring(stored) .. ', given ' .. tostring(arg) .. ')')
  end
  if token < held then
    return false
  end
  if token > held then
    redis.call('HSET', key, 'fence', arg)
  end
  return true
end
";

/// A campaign's progress (KEYS[1]: its hash; ARGV: cursor, dispatcher, fencing token), written
/// only when it moves the cursor forward on a campaign that exists, is not completed, and no
/// newer dispatcher has written to. 1 when written, -1 when superseded, 0 otherwise.
static PROGRESS: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(&format!(
        "{FENCED}{}",
        r"
local c = redis.call('HMGET', KEYS[1], 'status', 'cursor')
if not c[1] or c[1] == 'completed' then
  return 0
end
if not fenced(KEYS[1], ARGV[3]) then
  return -1
end
if tonumber(ARGV[1]) <= (tonumber(c[2] or '0') or 0) then
  return 0
end
redis.call('HSET', KEYS[1], 'cursor', ARGV[1], 'status', 'running', 'dispatcher', ARGV[2])
return 1
"
    ))
});
/// Completes a campaign (KEYS: its hash, its `:done` hash, its `:phones` list; ARGV: now, how
/// long to keep it in ms, the dispatcher's fencing token): marked completed, its numbers
/// dropped, its report and outcomes kept that long. Nothing on a campaign that is gone,
/// completed, or written to by a newer dispatcher. 1 when completed, -1 when superseded, 0
/// when gone or completed already.
static COMPLETE: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(&format!(
        "{FENCED}{}",
        r"
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'completed' then
  return 0
end
if not fenced(KEYS[1], ARGV[3]) then
  return -1
end
redis.call('HSET', KEYS[1], 'status', 'completed', 'completed_ms', ARGV[1])
redis.call('DEL', KEYS[3])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
"
    ))
});
/// Claims a number of a campaign (KEYS: its hash, its `:done` hash; ARGV: the number, the
/// claim `claimed:<instance>`, `0`, the dispatcher's fencing token), or records its outcome
/// (ARGV: the number, the outcome, `1`): only on a campaign that exists, so that a late
/// dispatcher never brings back a campaign that expired, and with the campaign's own expiry.
/// 1 when claimed or recorded; -1 when a newer dispatcher has written (a claim only: an
/// outcome is what happened to a number this dispatcher claimed, and is kept whoever
/// dispatches now).
static DECIDE: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(&format!(
        "{FENCED}{}",
        r"
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
local done
if ARGV[3] == '1' then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
  redis.call('HINCRBY', KEYS[1], ARGV[2], 1)
  done = 1
elseif not fenced(KEYS[1], ARGV[4]) then
  return -1
else
  done = redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2])
end
local ttl = redis.call('PTTL', KEYS[1])
if ttl > 0 and redis.call('PTTL', KEYS[2]) == -1 then
  redis.call('PEXPIRE', KEYS[2], ttl)
end
return done
"
    ))
});
/// Gives back a number a dispatcher claimed and did not send (KEYS: the campaign's hash, its
/// `:done` hash; ARGV: the number, the claim `claimed:<instance>`, the dispatcher's fencing
/// token): only that claim, never an outcome or another replica's claim, and not once a newer
/// dispatcher has written (it may have passed the number already: the claim stays, reported as
/// unknown, rather than the number being neither sent nor reported). 1 when given back.
static UNCLAIM: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(&format!(
        "{FENCED}{}",
        r"
if redis.call('EXISTS', KEYS[1]) == 0 or not fenced(KEYS[1], ARGV[3]) then
  return 0
end
if redis.call('HGET', KEYS[2], ARGV[1]) == ARGV[2] then
  return redis.call('HDEL', KEYS[2], ARGV[1])
end
return 0
"
    ))
});

/// Writes part of a campaign being created (KEYS: its hash, its `:phones` list; ARGV: how long
/// the parts live in ms, the number `n` of hash arguments that follow, `n` field-value
/// arguments of the hash, then numbers to append to the list), and gives both parts that
/// expiry: a creation cut off (the process killed) leaves nothing for good. The hash's status
/// is [`STAGED`] until [`KEEP`]: no dispatcher takes the campaign up, and it is not shown.
static STAGE: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(
        r"
local n = tonumber(ARGV[2])
if n > 0 then
  redis.call('HSET', KEYS[1], unpack(ARGV, 3, 2 + n))
end
if #ARGV > 2 + n then
  redis.call('RPUSH', KEYS[2], unpack(ARGV, 3 + n))
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return 1
",
    )
});
/// Completes a campaign's creation (KEYS: its hash, its `:phones` list): a [`STAGED`] campaign
/// becomes pending, and both parts lose their expiry, together. 1 when kept; 0 when the
/// campaign is not staged (gone: its parts expired or were taken back).
static KEEP: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(&format!(
        r"
if redis.call('HGET', KEYS[1], 'status') ~= '{STAGED}' then
  return 0
end
redis.call('HSET', KEYS[1], 'status', 'pending')
redis.call('PERSIST', KEYS[1])
redis.call('PERSIST', KEYS[2])
return 1
"
    ))
});
/// Settles a creation whose [`KEEP`] went unanswered (KEYS: its hash, its `:phones` list):
/// kept, 1; still [`STAGED`], its parts are deleted (a late `KEEP` then finds nothing to
/// keep), 0; gone, 0.
static SETTLE: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(&format!(
        r"
local status = redis.call('HGET', KEYS[1], 'status')
if status == '{STAGED}' then
  redis.call('DEL', KEYS[1], KEYS[2])
  return 0
end
if status then
  return 1
end
return 0
"
    ))
});
/// The status of a campaign whose creation has not completed: dispatchers leave it, and it is
/// not shown.
pub const STAGED: &str = "staged";
/// How long the parts of a campaign being created live until its creation completes (a
/// creation takes seconds at most): what a failed creation could not take back, or one cut
/// off by the process's death left, is gone after this.
const STAGED_CAMPAIGN_TTL: Duration = Duration::from_secs(600);
/// Numbers appended to a campaign's list per call while it is created: Redis serves other
/// clients between calls.
const STAGE_CHUNK: usize = 1_000;

/// The most idempotency keys kept in memory (the oldest expire first).
const MAX_MEMORY_IDEMPOTENCY_KEYS: usize = 200_000;

/// A campaign's creation failed.
#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    /// Nothing was created (what was written is taken back, or expires unseen).
    #[error("{0}")]
    NotCreated(StoreError),
    /// The store did not confirm the creation's last step, which may have happened: the
    /// campaign may exist.
    #[error("{0}")]
    Unknown(StoreError),
}

/// A store operation failed (Redis down, or a corrupted value).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct StoreError(pub String);

fn err(e: impl std::fmt::Display) -> StoreError {
    StoreError(e.to_string())
}

/// What an idempotency key says about a request.
#[derive(Debug, PartialEq, Eq)]
pub enum Idempotency {
    /// First time: go ahead.
    New,
    /// Done before with the same request: answer this again.
    Replay(String),
    /// Another request with this key is being handled right now.
    InProgress,
    /// The key was used with a different request.
    Mismatch,
}

/// What happened to one number of a campaign.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Sent,
    Limited,
    OptedOut,
    Failed,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Sent => "sent",
            Outcome::Limited => "limited",
            Outcome::OptedOut => "opted_out",
            Outcome::Failed => "failed",
        }
    }

    pub const ALL: [Outcome; 4] = [
        Outcome::Sent,
        Outcome::Limited,
        Outcome::OptedOut,
        Outcome::Failed,
    ];
}

/// What became of a dispatcher's claim on a number of a campaign.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// The number is this dispatcher's to send.
    Claimed,
    /// Another dispatcher claimed it, it has an outcome, or the campaign is gone: skip it.
    Taken,
    /// A dispatcher with a larger fencing token has written to the campaign: this one's lease
    /// ran out (a pause, a partition) and another replica took over. Stop.
    Superseded,
}

/// What became of a dispatcher's progress on a campaign.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// The cursor moved forward.
    Moved,
    /// Nothing written: the cursor was already there or past it (written by a dispatcher that
    /// was still admitted), or the campaign is completed or gone. Carry on: the next read of
    /// its numbers says whether anything is left.
    Behind,
    /// A dispatcher with a larger fencing token has written to the campaign. Stop.
    Superseded,
}

/// What became of a dispatcher's completion of a campaign.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Completion {
    Completed,
    /// Completed already, or gone.
    AlreadyDone,
    /// A dispatcher with a larger fencing token has written to the campaign: it completes it.
    Superseded,
}

/// A campaign's definition and progress.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Campaign {
    pub id: String,
    pub status: String,
    pub total: u64,
    /// Numbers taken by a dispatcher (each exactly once).
    pub claimed: u64,
    pub sent: u64,
    pub limited: u64,
    pub opted_out: u64,
    pub failed: u64,
    /// Numbers claimed by a dispatcher that died before recording what happened (never
    /// retried, so never messaged twice). Known once the campaign completes.
    pub unknown: u64,
    pub dispatcher: Option<String>,
    /// The fencing token of the newest dispatcher that wrote to it (0 before any): the
    /// campaign refuses the claims, progress and completion of any older one.
    pub fence: u64,
    pub created_ms: u64,
    pub completed_ms: Option<u64>,
    #[serde(skip)]
    pub text: String,
    #[serde(skip)]
    pub cursor: u64,
    /// The client that created it (its address, as the rate limits key it): its pending
    /// campaigns are bounded.
    #[serde(skip)]
    pub client: String,
}

/// A duration in whole milliseconds, saturated.
fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The shared state of the gateway.
pub trait Shared: Send + Sync + 'static {
    type Limiter: Limiter + Clone + 'static;
    type Locks: LockStore + Clone;

    fn limiter(&self) -> &Self::Limiter;
    fn locks(&self) -> &Self::Locks;
    /// Whether the shared store answers (for /healthz).
    fn healthy(&self) -> impl Future<Output = Result<&'static str, StoreError>> + Send;

    fn idempotency_begin(
        &self,
        key: &str,
        request: &str,
    ) -> impl Future<Output = Result<Idempotency, StoreError>> + Send;
    fn idempotency_finish(
        &self,
        key: &str,
        request: &str,
        response: &str,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
    fn idempotency_abort(&self, key: &str) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Adds an opt-out; returns whether it is new.
    fn opt_out(&self, phone: &str) -> impl Future<Output = Result<bool, StoreError>> + Send;
    /// Whether a phone opted out: the Bloom filter first, then the exact set.
    fn is_opted_out(&self, phone: &str) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Creates a pending campaign; a failure says whether it may exist.
    fn campaign_create(
        &self,
        campaign: &Campaign,
        phones: &[String],
    ) -> impl Future<Output = Result<(), CreateError>> + Send;
    fn campaign_get(
        &self,
        id: &str,
    ) -> impl Future<Output = Result<Option<Campaign>, StoreError>> + Send;
    fn campaigns_pending(&self) -> impl Future<Output = Result<Vec<String>, StoreError>> + Send;
    /// How many campaigns are pending: [`Shared::campaigns_pending`]'s length, without listing
    /// them (asked on every campaign creation).
    fn campaigns_pending_count(&self) -> impl Future<Output = Result<usize, StoreError>> + Send;
    /// How many campaigns of `client` are pending, exactly when there are `most` or more
    /// (asked on every campaign creation).
    fn campaigns_pending_of(
        &self,
        client: &str,
        most: usize,
    ) -> impl Future<Output = Result<usize, StoreError>> + Send;
    fn campaign_phones(
        &self,
        id: &str,
        from: u64,
        count: u64,
    ) -> impl Future<Output = Result<Vec<String>, StoreError>> + Send;
    /// Takes a number of a campaign for sending, for the dispatcher holding the campaign's
    /// lock with fencing token `fence`.
    fn campaign_claim(
        &self,
        id: &str,
        phone: &str,
        instance: &str,
        fence: u64,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send;
    /// Gives back a number this replica claimed and did not send (the store failed before the
    /// send): whoever dispatches the campaign next sends it. Not once a dispatcher with a
    /// larger fencing token than `fence` has written: it may have passed the number, which
    /// then stays claimed (reported as unknown).
    fn campaign_unclaim(
        &self,
        id: &str,
        phone: &str,
        instance: &str,
        fence: u64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// Records what happened to a number: whoever dispatches the campaign now (not fenced: a
    /// message sent is sent, and its outcome is kept).
    fn campaign_record(
        &self,
        id: &str,
        phone: &str,
        outcome: Outcome,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// Moves the campaign's cursor forward to `cursor`, for the dispatcher with fencing token
    /// `fence`.
    fn campaign_progress(
        &self,
        id: &str,
        cursor: u64,
        dispatcher: &str,
        fence: u64,
    ) -> impl Future<Output = Result<Progress, StoreError>> + Send;
    /// Marks a campaign completed, drops its numbers, and keeps its report (and which numbers
    /// had what outcome, so that a late dispatcher sends none again) for `keep_for`; then it
    /// is gone. Nothing on a campaign that is gone, already completed, or written to by a
    /// dispatcher with a larger fencing token than `fence`.
    fn campaign_complete(
        &self,
        id: &str,
        keep_for: Duration,
        fence: u64,
    ) -> impl Future<Output = Result<Completion, StoreError>> + Send;
}

fn optout_params() -> BloomParams {
    // A million opt-outs at 1% false positives: ~1.2 MB.
    BloomParams::new(1_000_000, 0.01).unwrap_or_else(|e| unreachable!("valid parameters: {e}"))
}

// ---- memory ------------------------------------------------------------------------------

/// (expires at ms, the request, its response once accepted).
type IdempotencyEntry = (u64, String, Option<String>);

/// Everything in this process: a single replica.
pub struct MemoryShared {
    limiter: MemoryLimiter,
    locks: MemoryLocks,
    idempotency: Mutex<HashMap<String, IdempotencyEntry>>,
    bloom: MemoryBloom,
    optouts: Mutex<HashSet<String>>,
    campaigns: Mutex<HashMap<String, MemoryCampaign>>,
}

impl std::fmt::Debug for MemoryShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryShared").finish_non_exhaustive()
    }
}

struct MemoryCampaign {
    campaign: Campaign,
    /// The fencing rule of its dispatchers (`campaign.fence` shows its highest token).
    fence: FenceCheck,
    phones: Vec<String>,
    done: HashMap<String, Option<Outcome>>,
    /// When a completed campaign is gone (ms since the epoch).
    expires_ms: Option<u64>,
}

/// Campaign `id`, unless it is gone: one whose retention ran out is dropped.
fn live_campaign<'a>(
    campaigns: &'a mut HashMap<String, MemoryCampaign>,
    id: &str,
) -> Option<&'a mut MemoryCampaign> {
    let gone = campaigns
        .get(id)?
        .expires_ms
        .is_some_and(|at| at <= now_ms());
    if gone {
        campaigns.remove(id);
        return None;
    }
    campaigns.get_mut(id)
}

/// Why a campaign takes no progress or completion from a dispatcher.
enum Shut {
    /// It is completed, or gone.
    Done,
    /// A dispatcher with a larger fencing token has written to it.
    Superseded,
}

/// Campaign `id`, open to the progress or completion of the dispatcher with token `fence`.
fn open_campaign<'a>(
    campaigns: &'a mut HashMap<String, MemoryCampaign>,
    id: &str,
    fence: u64,
) -> Result<&'a mut MemoryCampaign, Shut> {
    let c = live_campaign(campaigns, id).ok_or(Shut::Done)?;
    if c.completed() {
        return Err(Shut::Done);
    }
    if !c.admit(fence) {
        return Err(Shut::Superseded);
    }
    Ok(c)
}

impl MemoryCampaign {
    fn completed(&self) -> bool {
        self.campaign.status == "completed"
    }

    /// Whether the dispatcher with fencing token `fence` may write (see [`FenceCheck`]).
    fn admit(&mut self, fence: u64) -> bool {
        let admitted = self.fence.admit(fence).is_ok();
        self.campaign.fence = self.fence.highest();
        admitted
    }
}

impl MemoryShared {
    /// A store of the default size ([`floodgate::DEFAULT_MAX_KEYS`] limit states).
    pub fn new() -> Result<Self, StoreError> {
        Self::with_max_keys(floodgate::DEFAULT_MAX_KEYS)
    }

    /// A store keeping at most `max_keys` limit states. Full, it refuses new keys (so their
    /// checks fail, and the gateway fails closed) rather than evict live ones: an evicted
    /// phone would start over, and could be sent a second message inside its interval.
    pub fn with_max_keys(max_keys: usize) -> Result<Self, StoreError> {
        Ok(MemoryShared {
            limiter: MemoryLimiter::builder()
                .max_keys(max_keys)
                .on_full(OnFull::Reject)
                .build(),
            locks: MemoryLocks::new(),
            idempotency: Mutex::new(HashMap::new()),
            bloom: MemoryBloom::create(optout_params()).map_err(err)?,
            optouts: Mutex::new(HashSet::new()),
            campaigns: Mutex::new(HashMap::new()),
        })
    }
}

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared for MemoryShared {
    type Limiter = MemoryLimiter;
    type Locks = MemoryLocks;

    fn limiter(&self) -> &MemoryLimiter {
        &self.limiter
    }

    fn locks(&self) -> &MemoryLocks {
        &self.locks
    }

    async fn healthy(&self) -> Result<&'static str, StoreError> {
        Ok("memory")
    }

    async fn idempotency_begin(&self, key: &str, request: &str) -> Result<Idempotency, StoreError> {
        let now = now_ms();
        let mut map = locked(&self.idempotency);
        if let Some((expires, req, response)) = map.get(key)
            && *expires > now
        {
            return Ok(match (req == request, response) {
                (false, _) => Idempotency::Mismatch,
                (true, Some(r)) => Idempotency::Replay(r.clone()),
                (true, None) => Idempotency::InProgress,
            });
        }
        if map.len() >= MAX_MEMORY_IDEMPOTENCY_KEYS {
            map.retain(|_, (expires, _, _)| *expires > now);
            if map.len() >= MAX_MEMORY_IDEMPOTENCY_KEYS {
                // Forget the oldest tenth of the answered keys rather than refuse requests.
                // Keys still in progress expire soonest but are kept: dropping one would let a
                // retry send its message a second time.
                let mut expiries: Vec<u64> = map
                    .values()
                    .filter(|v| v.2.is_some())
                    .map(|v| v.0)
                    .collect();
                expiries.sort_unstable();
                if let Some(&cut) = expiries.get(expiries.len() / 10) {
                    map.retain(|_, (expires, _, answer)| answer.is_none() || *expires > cut);
                }
            }
        }
        let expires = now + IN_PROGRESS_TTL.as_millis() as u64;
        map.insert(key.to_owned(), (expires, request.to_owned(), None));
        Ok(Idempotency::New)
    }

    async fn idempotency_finish(
        &self,
        key: &str,
        request: &str,
        response: &str,
    ) -> Result<(), StoreError> {
        let mut map = locked(&self.idempotency);
        if let Some(entry) = map.get_mut(key)
            && entry.1 == request
        {
            entry.0 = now_ms() + IDEMPOTENCY_TTL.as_millis() as u64;
            entry.2 = Some(response.to_owned());
        }
        Ok(())
    }

    async fn idempotency_abort(&self, key: &str) -> Result<(), StoreError> {
        locked(&self.idempotency).remove(key);
        Ok(())
    }

    async fn opt_out(&self, phone: &str) -> Result<bool, StoreError> {
        // The filter first, then the exact set: if the second step fails, the filter holds a
        // phone the set does not (a harmless false positive), never the reverse (an opt-out
        // the filter would hide). A check in between raced with the opt-out itself.
        self.bloom.add(phone.as_bytes()).await.map_err(err)?;
        Ok(locked(&self.optouts).insert(phone.to_owned()))
    }

    async fn is_opted_out(&self, phone: &str) -> Result<bool, StoreError> {
        if !self.bloom.contains(phone.as_bytes()).await.map_err(err)? {
            return Ok(false);
        }
        Ok(locked(&self.optouts).contains(phone))
    }

    async fn campaign_create(
        &self,
        campaign: &Campaign,
        phones: &[String],
    ) -> Result<(), CreateError> {
        locked(&self.campaigns).insert(
            campaign.id.clone(),
            MemoryCampaign {
                campaign: campaign.clone(),
                fence: FenceCheck::starting_at(campaign.fence),
                phones: phones.to_vec(),
                done: HashMap::new(),
                expires_ms: None,
            },
        );
        Ok(())
    }

    async fn campaign_get(&self, id: &str) -> Result<Option<Campaign>, StoreError> {
        Ok(live_campaign(&mut locked(&self.campaigns), id).map(|c| c.campaign.clone()))
    }

    async fn campaigns_pending(&self) -> Result<Vec<String>, StoreError> {
        let mut campaigns = locked(&self.campaigns);
        // Sweeps the campaigns whose retention ran out (the dispatcher asks twice a second).
        let now = now_ms();
        campaigns.retain(|_, c| c.expires_ms.is_none_or(|at| at > now));
        Ok(campaigns
            .values()
            .filter(|c| !c.completed())
            .map(|c| c.campaign.id.clone())
            .collect())
    }

    async fn campaigns_pending_count(&self) -> Result<usize, StoreError> {
        Ok(self.campaigns_pending().await?.len())
    }

    async fn campaigns_pending_of(&self, client: &str, _most: usize) -> Result<usize, StoreError> {
        Ok(locked(&self.campaigns)
            .values()
            .filter(|c| c.campaign.client == client && !c.completed())
            .count())
    }

    async fn campaign_phones(
        &self,
        id: &str,
        from: u64,
        count: u64,
    ) -> Result<Vec<String>, StoreError> {
        Ok(live_campaign(&mut locked(&self.campaigns), id)
            .map(|c| {
                c.phones
                    .iter()
                    .skip(from as usize)
                    .take(count as usize)
                    .cloned()
                    .collect()
            })
            .unwrap_or_default())
    }

    async fn campaign_claim(
        &self,
        id: &str,
        phone: &str,
        _instance: &str,
        fence: u64,
    ) -> Result<Claim, StoreError> {
        let mut campaigns = locked(&self.campaigns);
        let Some(c) = live_campaign(&mut campaigns, id) else {
            return Ok(Claim::Taken);
        };
        if !c.admit(fence) {
            return Ok(Claim::Superseded);
        }
        // A completed campaign's outcomes are dropped (see `campaign_complete`): none of its
        // numbers is claimed again.
        if c.completed() || c.done.contains_key(phone) {
            return Ok(Claim::Taken);
        }
        c.done.insert(phone.to_owned(), None);
        c.campaign.claimed += 1;
        Ok(Claim::Claimed)
    }

    async fn campaign_unclaim(
        &self,
        id: &str,
        phone: &str,
        _instance: &str,
        fence: u64,
    ) -> Result<(), StoreError> {
        let mut campaigns = locked(&self.campaigns);
        if let Some(c) = live_campaign(&mut campaigns, id)
            && c.admit(fence)
            && c.done.get(phone) == Some(&None)
        {
            c.done.remove(phone);
            c.campaign.claimed -= 1;
        }
        Ok(())
    }

    async fn campaign_record(
        &self,
        id: &str,
        phone: &str,
        outcome: Outcome,
    ) -> Result<(), StoreError> {
        let mut campaigns = locked(&self.campaigns);
        if let Some(c) = live_campaign(&mut campaigns, id) {
            if !c.completed() {
                c.done.insert(phone.to_owned(), Some(outcome));
            }
            *counter(&mut c.campaign, outcome) += 1;
        }
        Ok(())
    }

    async fn campaign_progress(
        &self,
        id: &str,
        cursor: u64,
        dispatcher: &str,
        fence: u64,
    ) -> Result<Progress, StoreError> {
        // As the Redis store: only forward, never on a completed campaign, never for a
        // superseded dispatcher.
        let mut campaigns = locked(&self.campaigns);
        let c = match open_campaign(&mut campaigns, id, fence) {
            Ok(c) => c,
            Err(Shut::Done) => return Ok(Progress::Behind),
            Err(Shut::Superseded) => return Ok(Progress::Superseded),
        };
        if cursor <= c.campaign.cursor {
            return Ok(Progress::Behind);
        }
        c.campaign.cursor = cursor;
        c.campaign.status = "running".into();
        c.campaign.dispatcher = Some(dispatcher.to_owned());
        Ok(Progress::Moved)
    }

    async fn campaign_complete(
        &self,
        id: &str,
        keep_for: Duration,
        fence: u64,
    ) -> Result<Completion, StoreError> {
        let mut campaigns = locked(&self.campaigns);
        let c = match open_campaign(&mut campaigns, id, fence) {
            Ok(c) => c,
            Err(Shut::Done) => return Ok(Completion::AlreadyDone),
            Err(Shut::Superseded) => return Ok(Completion::Superseded),
        };
        c.phones = Vec::new();
        // Each number's outcome was kept so that no number is claimed twice; claims on a
        // completed campaign are refused outright, so its report's counters are all it keeps
        // (100,000 outcomes a campaign, kept for its retention, would grow without bound).
        c.done = HashMap::new();
        c.expires_ms = Some(now_ms().saturating_add(duration_ms(keep_for)));
        let k = &mut c.campaign;
        k.status = "completed".into();
        k.completed_ms = Some(now_ms());
        k.unknown = k.claimed - (k.sent + k.limited + k.opted_out + k.failed).min(k.claimed);
        Ok(Completion::Completed)
    }
}

fn counter(c: &mut Campaign, outcome: Outcome) -> &mut u64 {
    match outcome {
        Outcome::Sent => &mut c.sent,
        Outcome::Limited => &mut c.limited,
        Outcome::OptedOut => &mut c.opted_out,
        Outcome::Failed => &mut c.failed,
    }
}

// ---- Redis -------------------------------------------------------------------------------

/// Everything in Redis: any number of replicas.
pub struct RedisShared {
    limiter: DenyCache<RedisLimiter>,
    locks: RedisLocks,
    conn: RedisConn,
    optouts: OptOutFilter,
    prefix: String,
}

impl std::fmt::Debug for RedisShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisShared")
            .field("conn", &self.conn)
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// Set in the opt-out filter's first config hash once the filter holds every number of the
/// exact set: a filter without it (just made, being filled, or a fill that stopped half-way)
/// is not trusted to say "no". Kept beside the filter's own fields (which its scripts read by
/// name), so that it goes with the filter: a filter made again has none. Not a member of the
/// filter itself, which a false positive could find there before the fill ends.
const FILTER_COMPLETE: &str = "gateway-complete";

/// The opt-out Bloom filter in front of the exact set, kept trustworthy: made again from the
/// set when it is missing (the first replica, or a key lost to eviction, a failover or an
/// operator) or damaged (a part that lost one of its keys), and trusted to say "no" only once
/// complete. Meanwhile the set answers.
#[derive(Clone)]
struct OptOutFilter {
    bloom: RedisBloom,
    conn: RedisConn,
    /// The exact set's key.
    set: String,
    /// A repair is under way on this replica.
    filling: Arc<AtomicBool>,
    /// One repair at a time across replicas (see [`OptOutFilter::ensure`]).
    locks: RedisLocks,
}

/// The lease of the lock a filter repair holds (renewed while it runs).
const REPAIR_LEASE: Duration = Duration::from_secs(10);

impl OptOutFilter {
    /// Whether `phone` certainly never opted out: the filter is complete and says no. `false`
    /// asks the set; a filter found missing or damaged is repaired in the background.
    async fn certainly_not(&self, phone: &str) -> Result<bool, StoreError> {
        // The mark first: read after the filter, it could be set by a fill that ended in
        // between, after the number was found missing from it.
        if !self.is_complete().await.map_err(err)? {
            self.repair_soon();
            return Ok(false);
        }
        match self.bloom.contains(phone.as_bytes()).await {
            // Still complete after: a repair that began meanwhile clears the mark before it
            // makes a part again, which the number may have been looked up in.
            Ok(false) => self.is_complete().await.map_err(err),
            Ok(true) => Ok(false),
            Err(e) if !damaged(&e) => Err(err(e)),
            Err(e) => {
                tracing::warn!(error = %e, "the opt-out filter is missing or damaged: rebuilding");
                self.repair_soon();
                Ok(false)
            }
        }
    }

    /// Adds `phone` (before the set: a failure in between leaves a false positive, never a
    /// hidden opt-out); `false` when the filter was found missing or damaged, which starts a
    /// repair: the caller adds it again once it is in the set, in case the repair read the
    /// set before.
    async fn add(&self, phone: &str) -> Result<bool, StoreError> {
        match self.bloom.add(phone.as_bytes()).await {
            Ok(_) => Ok(true),
            Err(e) if !damaged(&e) => Err(err(e)),
            Err(_) => {
                self.repair_soon();
                Ok(false)
            }
        }
    }

    /// Starts [`OptOutFilter::ensure`] in the background, unless one runs on this replica.
    fn repair_soon(&self) {
        if self.filling.swap(true, Ordering::AcqRel) {
            return;
        }
        let this = self.clone();
        tokio::spawn(async move {
            if let Err(e) = this.ensure().await {
                tracing::warn!(error = %e, "cannot rebuild the opt-out filter");
            }
            this.filling.store(false, Ordering::Release);
        });
    }

    /// Makes the filter if it is missing and, unless it is complete, fills it from the set and
    /// marks it complete; a damaged filter is dropped and made again. Under a lock: a replica
    /// that drops a damaged filter must not drop another's fill half-way, which would then be
    /// marked complete without the numbers added before. A replica that finds the lock held
    /// leaves the repair to its holder (the set answers meanwhile). A filter with other
    /// parameters is an error, never dropped.
    async fn ensure(&self) -> Result<(), StoreError> {
        let lock = Lock::new(self.locks.clone(), "optouts-filter", REPAIR_LEASE)
            .map_err(err)?
            .watchdog(true);
        let Some(guard) = lock.try_acquire().await.map_err(err)? else {
            return Ok(());
        };
        let repaired = match self.fill().await {
            Err(e) if damaged(&e) => {
                tracing::warn!(error = %e, "dropping a damaged opt-out filter");
                match self.bloom.delete().await {
                    Ok(_) => self.fill().await,
                    Err(e) => Err(e),
                }
            }
            filled => filled,
        };
        if let Err(e) = guard.release().await {
            tracing::warn!(error = %e, "the opt-out filter's repair lock was lost");
        }
        repaired.map_err(err)
    }

    /// The key and field of the filter's completeness (see [`FILTER_COMPLETE`]).
    fn complete_field(&self) -> (&[u8], &str) {
        let config = self
            .bloom
            .keys()
            .next()
            .map_or(&[][..], |(_, config)| config);
        (config, FILTER_COMPLETE)
    }

    /// Whether the filter is marked complete.
    async fn is_complete(&self) -> Result<bool, floodgate::redis::Error> {
        let (key, field) = self.complete_field();
        let mut get = redis::cmd("HEXISTS");
        get.arg(key).arg(field);
        Ok(self.conn.query::<i64>(get).await? == 1)
    }

    async fn fill(&self) -> Result<(), floodgate::redis::Error> {
        // The mark is cleared before any part can be made again (a part made just now holds
        // nothing, whatever the mark says; a call that fails may have made one), and set back
        // at once only when the filter was complete and nothing was made.
        let was_complete = self.is_complete().await?;
        let (key, field) = self.complete_field();
        let mut unmark = redis::cmd("HDEL");
        unmark.arg(key).arg(field);
        let _: i64 = self.conn.query(unmark).await?;
        let created = self.bloom.try_init().await?;
        if was_complete && !created {
            return self.mark_complete().await;
        }
        let mut cursor = 0u64;
        loop {
            let mut scan = redis::cmd("SSCAN");
            scan.arg(&self.set).arg(cursor).arg("COUNT").arg(1_000);
            let (next, phones): (u64, Vec<String>) = self.conn.query(scan).await?;
            if !phones.is_empty() {
                let items: Vec<&[u8]> = phones.iter().map(|p| p.as_bytes()).collect();
                self.bloom.add_many(&items).await?;
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
        self.mark_complete().await
    }

    /// Marks the filter complete. On the filter as it is now: had it been dropped and made
    /// again meanwhile (not by a replica, which holds the repair lock to do it), its config
    /// hash would be new, and a check that finds this field on a filter missing a part fails
    /// as damaged.
    async fn mark_complete(&self) -> Result<(), floodgate::redis::Error> {
        let (key, field) = self.complete_field();
        let mut mark = redis::cmd("HSET");
        mark.arg(key).arg(field).arg(1);
        let _: i64 = self.conn.query(mark).await?;
        Ok(())
    }
}

/// Whether a filter's error means the filter itself is missing or damaged (not Redis being
/// unreachable, nor a filter made with other parameters, which is never dropped).
fn damaged(e: &floodgate::redis::Error) -> bool {
    !(RedisLimiter::is_unavailable(e) || e.is_mismatch())
}

impl RedisShared {
    pub async fn connect(url: &str, prefix: &str) -> Result<Self, StoreError> {
        let config = floodgate::redis::RedisConfig::new(url)
            .and_then(|c| c.key_prefix(prefix))
            .map_err(err)?;
        let conn = RedisConn::connect(&config).await.map_err(err)?;
        // The gateway refunds messages the provider did not take, possibly on another
        // replica than the one that cached a denial: hold denials a second at most.
        let limiter = DenyCache::new(RedisLimiter::new(conn.clone(), prefix).map_err(err)?)
            .max_hold(floodgate::tower::DEFAULT_DENY_CACHE_MAX_HOLD_WITH_REFUNDS);
        let locks = RedisLocks::builder(conn.clone())
            .notifications([url])
            .map_err(err)?
            .build();
        let optouts = OptOutFilter {
            bloom: RedisBloom::new(conn.clone(), "optouts", optout_params()).map_err(err)?,
            conn: conn.clone(),
            set: format!("{prefix}:optouts"),
            filling: Arc::new(AtomicBool::new(false)),
            locks: locks.clone(),
        };
        // A busy or just started Redis may miss a call's timeout: startup tries the filter
        // three times before it gives up.
        let mut tries = 0;
        while let Err(e) = optouts.ensure().await {
            tries += 1;
            if tries == 3 {
                return Err(e);
            }
            tracing::warn!(error = %e, "cannot prepare the opt-out filter yet; trying again");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(RedisShared {
            limiter,
            locks,
            conn,
            optouts,
            prefix: prefix.to_owned(),
        })
    }

    fn key(&self, parts: &[&str]) -> String {
        let mut k = self.prefix.clone();
        for p in parts {
            k.push(':');
            k.push_str(p);
        }
        k
    }

    fn campaign_key(&self, id: &str, suffix: &str) -> String {
        format!("{}:campaign:{{{id}}}{suffix}", self.prefix)
    }

    /// The set of `client`'s pending campaigns.
    fn client_campaigns_key(&self, client: &str) -> String {
        self.key(&["campaigns", "client", client])
    }

    /// Takes campaign `id` off the set at `set` (the pending campaigns, or a client's).
    async fn untrack_campaign(&self, set: &str, id: &str) -> Result<(), StoreError> {
        let mut remove = redis::cmd("SREM");
        remove.arg(set).arg(id);
        self.query::<i64>(remove).await.map(drop)
    }

    /// Writes campaign `c`'s hash and its numbers (`keys`: the hash, the list) with
    /// [`STAGE`]: in chunks, the hash with the first.
    async fn stage_campaign(
        &self,
        keys: &[&[u8]; 2],
        c: &Campaign,
        phones: &[String],
    ) -> Result<(), StoreError> {
        let ttl = STAGED_CAMPAIGN_TTL.as_millis().to_string();
        let (total, created) = (c.total.to_string(), c.created_ms.to_string());
        let hash: [&str; 12] = [
            "text",
            &c.text,
            "client",
            &c.client,
            "total",
            &total,
            "status",
            STAGED,
            "created_ms",
            &created,
            "cursor",
            "0",
        ];
        // The hash goes with the first chunk (alone when there are no numbers).
        let mut chunks = phones.chunks(STAGE_CHUNK);
        let first = (&hash[..], chunks.next().unwrap_or_default());
        for (fields, chunk) in std::iter::once(first).chain(chunks.map(|c| (&[][..], c))) {
            let n = fields.len().to_string();
            let mut args: Vec<&[u8]> = Vec::with_capacity(2 + fields.len() + chunk.len());
            args.extend([ttl.as_bytes(), n.as_bytes()]);
            args.extend(fields.iter().map(|f| f.as_bytes()));
            args.extend(chunk.iter().map(|p| p.as_bytes()));
            self.conn
                .invoke_script(&STAGE, keys, &args)
                .await
                .map_err(err)?;
        }
        Ok(())
    }

    /// Takes back what a failed creation of campaign `c` wrote (`keys`: its hash, its list):
    /// its parts first (a campaign without them can no longer be kept), then its places among
    /// the pending ones and its client's. What cannot be taken back (Redis failing again)
    /// expires with the parts' staging expiry; a dispatcher drops a pending campaign whose
    /// parts are gone, and the count of a client's campaigns drops one that is gone.
    async fn unstage_campaign(&self, keys: &[&[u8]; 2], c: &Campaign) {
        let id = c.id.as_str();
        let mut parts = redis::cmd("DEL");
        parts.arg(keys[0]).arg(keys[1]);
        if let Err(e) = self.query::<i64>(parts).await {
            tracing::warn!(campaign = %id, error = %e, "cannot delete a campaign whose creation failed; its parts expire");
            return;
        }
        let pending = self.key(&["campaigns", "pending"]);
        if let Err(e) = self.untrack_campaign(&pending, id).await {
            tracing::warn!(campaign = %id, error = %e, "cannot take a failed campaign off the pending list; a dispatcher will");
            return;
        }
        let of_client = self.client_campaigns_key(&c.client);
        if let Err(e) = self.untrack_campaign(&of_client, id).await {
            tracing::warn!(campaign = %id, error = %e, "cannot take a failed campaign off its client's list");
        }
    }

    /// Claims a number (`value`: the claim, `fence`: the dispatcher's fencing token) or
    /// records its outcome (`value`: the outcome, no token) with [`DECIDE`]: 1 when claimed
    /// (a record: when the campaign exists), -1 when superseded, 0 otherwise.
    async fn decide(
        &self,
        id: &str,
        phone: &str,
        value: &str,
        claim_with: Option<u64>,
    ) -> Result<i64, StoreError> {
        let keys = [self.campaign_key(id, ""), self.campaign_key(id, ":done")];
        let fence = claim_with.unwrap_or(0).to_string();
        let decided = self
            .conn
            .invoke_script(
                &DECIDE,
                &keys.each_ref().map(|k| k.as_bytes()),
                &[
                    phone.as_bytes(),
                    value.as_bytes(),
                    if claim_with.is_some() { b"0" } else { b"1" },
                    fence.as_bytes(),
                ],
            )
            .await
            .map_err(err)?;
        match decided {
            redis::Value::Int(n) => Ok(n),
            other => Err(StoreError(format!(
                "campaign {id}: unexpected reply to a claim or outcome: {other:?}"
            ))),
        }
    }

    async fn query<T: redis::FromRedisValue>(&self, cmd: redis::Cmd) -> Result<T, StoreError> {
        self.conn.query(cmd).await.map_err(err)
    }
}

impl Shared for RedisShared {
    type Limiter = DenyCache<RedisLimiter>;
    type Locks = RedisLocks;

    fn limiter(&self) -> &Self::Limiter {
        &self.limiter
    }

    fn locks(&self) -> &RedisLocks {
        &self.locks
    }

    async fn healthy(&self) -> Result<&'static str, StoreError> {
        self.conn.ping().await.map_err(err)?;
        Ok("redis")
    }

    async fn idempotency_begin(&self, key: &str, request: &str) -> Result<Idempotency, StoreError> {
        let mut set = redis::cmd("SET");
        set.arg(self.key(&["idem", key]))
            .arg(json!({"request": request}).to_string())
            .arg("NX")
            .arg("PX")
            .arg(IN_PROGRESS_TTL.as_millis() as u64)
            .arg("GET");
        let previous: Option<String> = self.query(set).await?;
        let Some(previous) = previous else {
            return Ok(Idempotency::New);
        };
        let stored: serde_json::Value = serde_json::from_str(&previous)
            .map_err(|e| StoreError(format!("corrupted idempotency record: {e}")))?;
        if stored["request"] != request {
            return Ok(Idempotency::Mismatch);
        }
        Ok(match stored["response"].as_str() {
            Some(response) => Idempotency::Replay(response.to_owned()),
            None => Idempotency::InProgress,
        })
    }

    async fn idempotency_finish(
        &self,
        key: &str,
        request: &str,
        response: &str,
    ) -> Result<(), StoreError> {
        let mut set = redis::cmd("SET");
        set.arg(self.key(&["idem", key]))
            .arg(json!({"request": request, "response": response}).to_string())
            .arg("XX")
            .arg("PX")
            .arg(IDEMPOTENCY_TTL.as_millis() as u64);
        let _: Option<String> = self.query(set).await?;
        Ok(())
    }

    async fn idempotency_abort(&self, key: &str) -> Result<(), StoreError> {
        let mut del = redis::cmd("DEL");
        del.arg(self.key(&["idem", key]));
        let _: i64 = self.query(del).await?;
        Ok(())
    }

    async fn opt_out(&self, phone: &str) -> Result<bool, StoreError> {
        // The filter first (see the memory store): a failure in between leaves a false
        // positive, never a hidden opt-out.
        let in_filter = self.optouts.add(phone).await?;
        let mut add = redis::cmd("SADD");
        add.arg(&self.optouts.set).arg(phone);
        let new: i64 = self.query(add).await?;
        if !in_filter {
            self.optouts.add(phone).await?;
        }
        Ok(new == 1)
    }

    async fn is_opted_out(&self, phone: &str) -> Result<bool, StoreError> {
        if self.optouts.certainly_not(phone).await? {
            return Ok(false);
        }
        let mut member = redis::cmd("SISMEMBER");
        member.arg(&self.optouts.set).arg(phone);
        Ok(self.query::<i64>(member).await? == 1)
    }

    async fn campaign_create(&self, c: &Campaign, phones: &[String]) -> Result<(), CreateError> {
        // The campaign's parts first, staged (with an expiry, and a status no dispatcher takes
        // up); then its place among the pending campaigns; then it is kept, which makes it a
        // pending campaign: the creation's one step that counts. A failure before it takes
        // back what was written; what cannot be taken back expires unseen.
        let keys = [
            self.campaign_key(&c.id, ""),
            self.campaign_key(&c.id, ":phones"),
        ];
        let keys = keys.each_ref().map(|k| k.as_bytes());
        let staged = async {
            self.stage_campaign(&keys, c, phones).await?;
            let mut pending = redis::cmd("SADD");
            pending.arg(self.key(&["campaigns", "pending"])).arg(&c.id);
            self.query::<i64>(pending).await?;
            let mut of_client = redis::cmd("SADD");
            of_client
                .arg(self.client_campaigns_key(&c.client))
                .arg(&c.id);
            self.query::<i64>(of_client).await
        }
        .await;
        let kept = match staged {
            Ok(_) => self.conn.invoke_script(&KEEP, &keys, &[]).await,
            Err(e) => {
                self.unstage_campaign(&keys, c).await;
                return Err(CreateError::NotCreated(e));
            }
        };
        match kept {
            Ok(redis::Value::Int(1)) => Ok(()),
            Ok(other) => {
                self.unstage_campaign(&keys, c).await;
                Err(CreateError::NotCreated(StoreError(format!(
                    "campaign {}: its parts were gone before it was kept ({other:?})",
                    c.id
                ))))
            }
            // Unanswered, it may have been kept, or may still be: settled either way, once
            // more; unanswered again, the campaign may exist.
            Err(e) => match self.conn.invoke_script(&SETTLE, &keys, &[]).await {
                Ok(redis::Value::Int(1)) => Ok(()),
                Ok(_) => {
                    self.unstage_campaign(&keys, c).await;
                    Err(CreateError::NotCreated(err(e)))
                }
                Err(_) => Err(CreateError::Unknown(err(e))),
            },
        }
    }

    async fn campaign_get(&self, id: &str) -> Result<Option<Campaign>, StoreError> {
        let mut get = redis::cmd("HGETALL");
        get.arg(self.campaign_key(id, ""));
        let fields: HashMap<String, String> = self.query(get).await?;
        if fields.is_empty() {
            return Ok(None);
        }
        let num = |k: &str| fields.get(k).and_then(|v| v.parse().ok()).unwrap_or(0);
        let mut claimed = redis::cmd("HLEN");
        claimed.arg(self.campaign_key(id, ":done"));
        let claimed: u64 = self.query(claimed).await?;
        let mut c = Campaign {
            id: id.to_owned(),
            status: fields.get("status").cloned().unwrap_or_default(),
            total: num("total"),
            claimed,
            sent: num("sent"),
            limited: num("limited"),
            opted_out: num("opted_out"),
            failed: num("failed"),
            unknown: 0,
            dispatcher: fields.get("dispatcher").cloned(),
            fence: num("fence"),
            created_ms: num("created_ms"),
            completed_ms: fields.get("completed_ms").and_then(|v| v.parse().ok()),
            text: fields.get("text").cloned().unwrap_or_default(),
            cursor: num("cursor"),
            client: fields.get("client").cloned().unwrap_or_default(),
        };
        if c.status == "completed" {
            c.unknown = c.claimed - (c.sent + c.limited + c.opted_out + c.failed).min(c.claimed);
        }
        Ok(Some(c))
    }

    async fn campaigns_pending(&self) -> Result<Vec<String>, StoreError> {
        let mut members = redis::cmd("SMEMBERS");
        members.arg(self.key(&["campaigns", "pending"]));
        self.query(members).await
    }

    async fn campaigns_pending_of(&self, client: &str, most: usize) -> Result<usize, StoreError> {
        // The client's set is kept by creation and completion; a completion cut off before
        // its removal leaves an id there, which would count for good. Under the bound, the
        // set's size is the answer (it can only overstate); at the bound, the ids of
        // campaigns completed or gone are dropped (their statuses read at once: one round
        // trip for `most` of them or so, pipelined on the connection).
        let set = self.client_campaigns_key(client);
        let mut count = redis::cmd("SCARD");
        count.arg(&set);
        let count: usize = self.query(count).await?;
        if count < most {
            return Ok(count);
        }
        let mut members = redis::cmd("SMEMBERS");
        members.arg(&set);
        let ids: Vec<String> = self.query(members).await?;
        let statuses = futures_util::future::try_join_all(ids.iter().map(|id| {
            let mut status = redis::cmd("HGET");
            status.arg(self.campaign_key(id, "")).arg("status");
            self.query::<Option<String>>(status)
        }))
        .await?;
        let mut pending = 0;
        for (id, status) in ids.iter().zip(statuses) {
            match status.as_deref() {
                None | Some("completed") => self.untrack_campaign(&set, id).await?,
                Some(_) => pending += 1,
            }
        }
        Ok(pending)
    }

    async fn campaigns_pending_count(&self) -> Result<usize, StoreError> {
        let mut count = redis::cmd("SCARD");
        count.arg(self.key(&["campaigns", "pending"]));
        self.query(count).await
    }

    async fn campaign_phones(
        &self,
        id: &str,
        from: u64,
        count: u64,
    ) -> Result<Vec<String>, StoreError> {
        let mut range = redis::cmd("LRANGE");
        range
            .arg(self.campaign_key(id, ":phones"))
            .arg(from)
            .arg(from + count.max(1) - 1);
        self.query(range).await
    }

    async fn campaign_claim(
        &self,
        id: &str,
        phone: &str,
        instance: &str,
        fence: u64,
    ) -> Result<Claim, StoreError> {
        let claim = format!("claimed:{instance}");
        Ok(match self.decide(id, phone, &claim, Some(fence)).await? {
            1 => Claim::Claimed,
            -1 => Claim::Superseded,
            _ => Claim::Taken,
        })
    }

    async fn campaign_unclaim(
        &self,
        id: &str,
        phone: &str,
        instance: &str,
        fence: u64,
    ) -> Result<(), StoreError> {
        let keys = [self.campaign_key(id, ""), self.campaign_key(id, ":done")];
        let (claim, fence) = (format!("claimed:{instance}"), fence.to_string());
        self.conn
            .invoke_script(
                &UNCLAIM,
                &keys.each_ref().map(|k| k.as_bytes()),
                &[phone.as_bytes(), claim.as_bytes(), fence.as_bytes()],
            )
            .await
            .map_err(err)?;
        Ok(())
    }

    async fn campaign_record(
        &self,
        id: &str,
        phone: &str,
        outcome: Outcome,
    ) -> Result<(), StoreError> {
        self.decide(id, phone, outcome.as_str(), None).await?;
        Ok(())
    }

    async fn campaign_progress(
        &self,
        id: &str,
        cursor: u64,
        dispatcher: &str,
        fence: u64,
    ) -> Result<Progress, StoreError> {
        // A dispatcher that lost its lock may still be running: its progress never moves the
        // cursor back nor reopens a completed campaign, and is refused once a newer
        // dispatcher has written.
        let key = self.campaign_key(id, "");
        let (cursor, fence) = (cursor.to_string(), fence.to_string());
        let written = self
            .conn
            .invoke_script(
                &PROGRESS,
                &[key.as_bytes()],
                &[cursor.as_bytes(), dispatcher.as_bytes(), fence.as_bytes()],
            )
            .await
            .map_err(err)?;
        Ok(match written {
            redis::Value::Int(1) => Progress::Moved,
            redis::Value::Int(-1) => Progress::Superseded,
            _ => Progress::Behind,
        })
    }

    async fn campaign_complete(
        &self,
        id: &str,
        keep_for: Duration,
        fence: u64,
    ) -> Result<Completion, StoreError> {
        let keys = [
            self.campaign_key(id, ""),
            self.campaign_key(id, ":done"),
            self.campaign_key(id, ":phones"),
        ];
        let (now, keep, fence) = (
            now_ms().to_string(),
            duration_ms(keep_for).max(1).to_string(),
            fence.to_string(),
        );
        let completed = self
            .conn
            .invoke_script(
                &COMPLETE,
                &keys.each_ref().map(|k| k.as_bytes()),
                &[now.as_bytes(), keep.as_bytes(), fence.as_bytes()],
            )
            .await
            .map_err(err)?;
        let completion = match completed {
            redis::Value::Int(1) => Completion::Completed,
            redis::Value::Int(-1) => return Ok(Completion::Superseded),
            _ => Completion::AlreadyDone,
        };
        // Also when it was done already: a completion whose SREM failed is retried here.
        self.untrack_campaign(&self.key(&["campaigns", "pending"]), id)
            .await?;
        // Its client's list too (the hash is kept for the report). Not the completion's
        // concern when it fails: the count of the client's campaigns drops it.
        let mut client = redis::cmd("HGET");
        client.arg(&keys[0]).arg("client");
        let untracked = match self.query::<Option<String>>(client).await {
            Ok(Some(client)) => {
                self.untrack_campaign(&self.client_campaigns_key(&client), id)
                    .await
            }
            Ok(None) => Ok(()),
            Err(e) => Err(e),
        };
        if let Err(e) = untracked {
            tracing::warn!(campaign = %id, error = %e, "cannot take a completed campaign off its client's list");
        }
        Ok(completion)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether the dispatcher with fencing token 1 claims `phone` (`what`: the call, for a
    /// failure).
    async fn claimed<S: Shared>(
        store: &S,
        id: &str,
        phone: &str,
        instance: &str,
        what: &str,
    ) -> bool {
        store
            .campaign_claim(id, phone, instance, 1)
            .await
            .expect(what)
            == Claim::Claimed
    }

    /// A Redis server of its own, and a store on it whose keys start with `prefix`.
    async fn redis_store(prefix: &str) -> (floodgate_testkit::RedisServer, RedisShared) {
        let server = floodgate_testkit::RedisServer::start().expect("start redis-server");
        let store = RedisShared::connect(&server.url(), prefix)
            .await
            .expect("connect");
        (server, store)
    }

    /// Creates pending campaign `id` of `phones`.
    async fn create<S: Shared>(store: &S, id: &str, phones: &[&str]) {
        let campaign = Campaign {
            id: id.into(),
            status: "pending".into(),
            total: phones.len() as u64,
            text: "hi".into(),
            ..Campaign::default()
        };
        let phones: Vec<String> = phones.iter().map(|p| String::from(*p)).collect();
        let before = store.campaigns_pending_count().await.expect("count");
        store
            .campaign_create(&campaign, &phones)
            .await
            .expect("create");
        // Counted without being listed, and listed.
        let pending = store.campaigns_pending().await.expect("pending");
        assert!(pending.iter().any(|p| p == id), "{pending:?}");
        let count = store.campaigns_pending_count().await.expect("count");
        assert_eq!((count, pending.len()), (before + 1, before + 1));
    }

    /// Creates pending campaign `id` of one number for `client`.
    async fn create_for<S: Shared>(store: &S, id: &str, client: &str) {
        let (mut campaign, phones) = campaign_of(id, 1);
        campaign.client = client.into();
        store
            .campaign_create(&campaign, &phones)
            .await
            .expect("create");
    }

    /// A client's pending campaigns are counted until they complete, and no one else's.
    async fn a_clients_pending_campaigns_are_counted<S: Shared>(store: &S) {
        create_for(store, "c1", "203.0.113.1").await;
        create_for(store, "c2", "203.0.113.1").await;
        create_for(store, "c3", "2001:db8::/64").await;
        // Exact from one campaign on.
        let of = |client: &'static str| store.campaigns_pending_of(client, 1);
        assert_eq!(of("203.0.113.1").await.expect("count"), 2);
        assert_eq!(of("2001:db8::/64").await.expect("count"), 1);
        assert_eq!(of("198.51.100.1").await.expect("count"), 0);
        let done = store
            .campaign_complete("c1", Duration::from_secs(60), 1)
            .await
            .expect("complete");
        assert_eq!(done, Completion::Completed);
        assert_eq!(of("203.0.113.1").await.expect("count"), 1);
    }

    #[tokio::test]
    async fn a_clients_pending_campaigns_are_counted_in_memory() {
        a_clients_pending_campaigns_are_counted(&MemoryShared::new().expect("store")).await;
    }

    #[tokio::test]
    async fn a_clients_pending_campaigns_are_counted_in_redis() {
        let (server, store) = redis_store("per-client").await;
        a_clients_pending_campaigns_are_counted(&store).await;
        // A campaign gone without its completion's last step (its hash expired or deleted):
        // counted while the client is under its bound (the set's size can only overstate),
        // dropped from its list at the bound.
        server
            .cmd_ok(&["DEL", "per-client:campaign:{c2}"])
            .expect("DEL");
        let of = |most| store.campaigns_pending_of("203.0.113.1", most);
        assert_eq!(of(5).await.expect("count"), 1);
        assert_eq!(of(1).await.expect("count"), 0);
        assert_eq!(
            server
                .cmd_ok(&["SCARD", "per-client:campaigns:client:203.0.113.1"])
                .expect("SCARD"),
            floodgate_testkit::Resp::Int(0)
        );
    }

    /// What a dispatcher that lost its lock (and still runs) may write: nothing that moves a
    /// campaign's cursor back or reopens it.
    async fn stale_progress_is_ignored<S: Shared>(store: &S) {
        let progress = |id, cursor, dispatcher| async move {
            store
                .campaign_progress(id, cursor, dispatcher, 1)
                .await
                .expect("progress")
        };
        create(
            store,
            "c1",
            &["+8613800000001", "+8613800000002", "+8613800000003"],
        )
        .await;
        assert_eq!(progress("c1", 2, "b").await, Progress::Moved);
        assert_eq!(progress("c1", 1, "a").await, Progress::Behind);
        let c = store
            .campaign_get("c1")
            .await
            .expect("get")
            .expect("stored");
        assert_eq!(
            (c.cursor, c.status.as_str(), c.dispatcher.as_deref()),
            (2, "running", Some("b"))
        );
        // No campaign: nothing is written.
        assert_eq!(progress("c2", 1, "a").await, Progress::Behind);
        assert!(store.campaign_get("c2").await.expect("get").is_none());
        assert_eq!(
            store
                .campaign_complete("c1", Duration::from_secs(60), 1)
                .await
                .expect("complete"),
            Completion::Completed
        );
        assert_eq!(progress("c1", 3, "a").await, Progress::Behind);
        let c = store
            .campaign_get("c1")
            .await
            .expect("get")
            .expect("stored");
        assert_eq!(c.status, "completed", "{c:?}");
        assert!(store.campaigns_pending().await.expect("pending").is_empty());
    }

    /// A dispatcher whose lease ran out while it kept running (a pause) and a newer one: once
    /// the newer one has written, the older one's claims, progress, completion and give-backs
    /// are refused; the outcome of a number it had claimed before is still recorded. Progress
    /// the older one wrote before that leaves the newer one behind, not superseded.
    async fn a_superseded_dispatcher_writes_nothing<S: Shared>(store: &S) {
        let phones = [
            "+8613800000031",
            "+8613800000032",
            "+8613800000033",
            "+8613800000034",
        ];
        let [a, b, c, d] = phones;
        create(store, "f1", &phones).await;
        let claim = |phone, instance, fence| store.campaign_claim("f1", phone, instance, fence);
        let progress =
            |cursor, instance, fence| store.campaign_progress("f1", cursor, instance, fence);
        let complete = |fence| store.campaign_complete("f1", Duration::from_secs(60), fence);
        let get = || async {
            store
                .campaign_get("f1")
                .await
                .expect("get")
                .expect("stored")
        };
        // The older dispatcher, before the newer one writes anything.
        assert_eq!(claim(a, "old", 5).await.expect("claim"), Claim::Claimed);
        assert_eq!(
            progress(1, "old", 5).await.expect("progress"),
            Progress::Moved
        );
        assert_eq!(claim(b, "old", 5).await.expect("claim"), Claim::Claimed);
        assert_eq!(
            progress(2, "old", 5).await.expect("progress"),
            Progress::Moved
        );
        // The newer one takes over from the cursor it read (1): behind, and it carries on.
        assert_eq!(claim(b, "new", 6).await.expect("claim"), Claim::Taken);
        assert_eq!(
            progress(2, "new", 6).await.expect("progress"),
            Progress::Behind
        );
        // The older one wakes up: refused, and the number it claimed and did not send stays
        // claimed (the newer one has passed it: given back, it would be neither sent nor
        // reported).
        assert_eq!(claim(c, "old", 5).await.expect("claim"), Claim::Superseded);
        assert_eq!(
            progress(3, "old", 5).await.expect("progress"),
            Progress::Superseded
        );
        assert_eq!(complete(5).await.expect("complete"), Completion::Superseded);
        store
            .campaign_unclaim("f1", b, "old", 5)
            .await
            .expect("unclaim");
        // What happened to its number is kept.
        store
            .campaign_record("f1", a, Outcome::Sent)
            .await
            .expect("record");
        let got = get().await;
        let seen = |c: &Campaign| (c.status.clone(), c.cursor, c.claimed, c.sent, c.fence);
        assert_eq!(seen(&got), ("running".into(), 2, 2, 1, 6), "{got:?}");
        // The newer one finishes.
        for phone in [c, d] {
            assert_eq!(claim(phone, "new", 6).await.expect("claim"), Claim::Claimed);
            store
                .campaign_record("f1", phone, Outcome::Sent)
                .await
                .expect("record");
        }
        assert_eq!(
            progress(4, "new", 6).await.expect("progress"),
            Progress::Moved
        );
        assert_eq!(complete(6).await.expect("complete"), Completion::Completed);
        let got = get().await;
        assert_eq!(seen(&got), ("completed".into(), 4, 4, 3, 6), "{got:?}");
        assert_eq!(got.unknown, 1, "{got:?}");
        assert_eq!(
            complete(6).await.expect("complete"),
            Completion::AlreadyDone
        );
        assert!(store.campaigns_pending().await.expect("pending").is_empty());
    }

    #[tokio::test]
    async fn a_superseded_dispatcher_writes_nothing_in_memory() {
        a_superseded_dispatcher_writes_nothing(&MemoryShared::new().expect("store")).await;
    }

    #[tokio::test]
    async fn a_superseded_dispatcher_writes_nothing_in_redis() {
        let (server, store) = redis_store("fenced").await;
        a_superseded_dispatcher_writes_nothing(&store).await;
        // A corrupted token is an error, not a fence let down.
        create(&store, "f2", &["+8613800000035"]).await;
        server
            .cmd_ok(&["HSET", "fenced:campaign:{f2}", "fence", "garbage"])
            .expect("HSET");
        let claimed = store.campaign_claim("f2", "+8613800000035", "x", 1).await;
        assert!(claimed.is_err(), "{claimed:?}");
    }

    /// A campaign of `n` numbers, and the numbers.
    fn campaign_of(id: &str, n: u64) -> (Campaign, Vec<String>) {
        let phones: Vec<String> = (0..n).map(|i| format!("+86138{i:08}")).collect();
        let campaign = Campaign {
            id: id.into(),
            status: "pending".into(),
            total: n,
            text: "hi".into(),
            ..Campaign::default()
        };
        (campaign, phones)
    }

    /// Redis' `PTTL` of `key`.
    fn pttl(server: &floodgate_testkit::RedisServer, key: &str) -> i64 {
        match server.cmd_ok(&["PTTL", key]).expect("PTTL") {
            floodgate_testkit::Resp::Int(ms) => ms,
            other => panic!("PTTL {key}: {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_created_campaign_is_kept_whole_in_redis() {
        let (server, store) = redis_store("kept").await;
        // More numbers than one staging call takes.
        let (campaign, phones) = campaign_of("k1", 2_500);
        store
            .campaign_create(&campaign, &phones)
            .await
            .expect("create");
        assert_eq!(store.campaigns_pending().await.expect("pending"), ["k1"]);
        let got = store
            .campaign_get("k1")
            .await
            .expect("get")
            .expect("created");
        assert_eq!(
            (got.status.as_str(), got.total, got.text.as_str()),
            ("pending", 2_500, "hi"),
            "{got:?}"
        );
        let listed = store.campaign_phones("k1", 0, 3_000).await.expect("phones");
        assert_eq!(listed, phones, "every number, in order");
        // Kept until it completes: the staging expiry is gone from both parts.
        assert_eq!(pttl(&server, "kept:campaign:{k1}"), -1);
        assert_eq!(pttl(&server, "kept:campaign:{k1}:phones"), -1);
    }

    #[tokio::test]
    async fn a_creation_cut_off_leaves_parts_that_expire() {
        // The process dies once the parts are written, before the campaign is pending.
        let (server, store) = redis_store("staged").await;
        let (campaign, phones) = campaign_of("s1", 1_500);
        let keys = ["staged:campaign:{s1}", "staged:campaign:{s1}:phones"];
        store
            .stage_campaign(&keys.map(str::as_bytes), &campaign, &phones)
            .await
            .expect("stage");
        for key in keys {
            let ttl = pttl(&server, key);
            assert!(
                ttl > 0 && ttl <= STAGED_CAMPAIGN_TTL.as_millis() as i64,
                "{key}: {ttl}"
            );
        }
        // Not a campaign yet: no dispatcher takes it up.
        let got = store
            .campaign_get("s1")
            .await
            .expect("get")
            .expect("staged");
        assert_eq!(got.status, STAGED);
        assert!(store.campaigns_pending().await.expect("pending").is_empty());
    }

    /// A creation whose `KEEP` went unanswered is settled: kept, it stands; still staged, it
    /// is deleted, and a `KEEP` arriving late keeps nothing.
    #[tokio::test]
    async fn an_unanswered_keep_is_settled() {
        let (server, store) = redis_store("settle").await;
        let settle = |keys: [&'static str; 2]| {
            let conn = store.conn.clone();
            async move {
                conn.invoke_script(&SETTLE, &keys.map(str::as_bytes), &[])
                    .await
                    .expect("SETTLE")
            }
        };
        let keep = |keys: [&'static str; 2]| {
            let conn = store.conn.clone();
            async move {
                conn.invoke_script(&KEEP, &keys.map(str::as_bytes), &[])
                    .await
                    .expect("KEEP")
            }
        };
        let (campaign, phones) = campaign_of("u1", 3);
        let staged = ["settle:campaign:{u1}", "settle:campaign:{u1}:phones"];
        store
            .stage_campaign(&staged.map(str::as_bytes), &campaign, &phones)
            .await
            .expect("stage");
        assert_eq!(settle(staged).await, redis::Value::Int(0));
        assert_eq!(keep(staged).await, redis::Value::Int(0), "a late KEEP");
        for key in staged {
            assert_eq!(
                server.cmd_ok(&["EXISTS", key]).expect("EXISTS"),
                floodgate_testkit::Resp::Int(0),
                "{key}"
            );
        }
        let (campaign, phones) = campaign_of("u2", 3);
        let kept = ["settle:campaign:{u2}", "settle:campaign:{u2}:phones"];
        store
            .stage_campaign(&kept.map(str::as_bytes), &campaign, &phones)
            .await
            .expect("stage");
        assert_eq!(keep(kept).await, redis::Value::Int(1));
        assert_eq!(settle(kept).await, redis::Value::Int(1));
        assert_eq!(pttl(&server, kept[1]), -1, "kept whole");
    }

    #[tokio::test]
    async fn a_failed_campaign_creation_leaves_nothing_in_redis() {
        // A user who may not add to a set: the campaign's parts are written, and its place
        // among the pending ones is refused.
        let server = floodgate_testkit::RedisServer::start().expect("start redis-server");
        server
            .cmd_ok(&[
                "ACL", "SETUSER", "gw", "on", ">secret", "~*", "&*", "+@all", "-sadd",
            ])
            .expect("ACL SETUSER");
        let url = format!("redis://gw:secret@{}", server.addr());
        let store = RedisShared::connect(&url, "failed").await.expect("connect");
        let (campaign, phones) = campaign_of("f1", 2_500);
        let created = store.campaign_create(&campaign, &phones).await;
        assert!(
            matches!(created, Err(CreateError::NotCreated(_))),
            "{created:?}"
        );
        match server.cmd_ok(&["KEYS", "failed:campaign*"]).expect("KEYS") {
            floodgate_testkit::Resp::Array(Some(keys)) => assert!(keys.is_empty(), "{keys:?}"),
            other => panic!("KEYS: {other:?}"),
        }
        assert!(store.campaigns_pending().await.expect("pending").is_empty());
    }

    #[tokio::test]
    async fn a_stale_dispatcher_cannot_reopen_a_campaign_in_memory() {
        stale_progress_is_ignored(&MemoryShared::new().expect("store")).await;
    }

    /// A number given back can be claimed again, and counts as claimed no more; a number with
    /// an outcome, or another replica's claim, is not given back.
    async fn unclaimed_numbers_are_claimed_again<S: Shared>(store: &S) {
        let (a, b) = ("+8613800000011", "+8613800000012");
        create(store, "u1", &[a, b]).await;
        assert!(claimed(store, "u1", a, "x", "claim").await);
        store
            .campaign_unclaim("u1", a, "x", 1)
            .await
            .expect("unclaim");
        let c = store
            .campaign_get("u1")
            .await
            .expect("get")
            .expect("stored");
        assert_eq!(c.claimed, 0, "{c:?}");
        assert!(claimed(store, "u1", a, "y", "claim again").await);
        store
            .campaign_record("u1", a, Outcome::Sent)
            .await
            .expect("record");
        store
            .campaign_unclaim("u1", a, "y", 1)
            .await
            .expect("unclaim");
        assert!(!claimed(store, "u1", a, "z", "claim").await);
        assert!(claimed(store, "u1", b, "y", "claim").await);
        let c = store
            .campaign_get("u1")
            .await
            .expect("get")
            .expect("stored");
        assert_eq!((c.claimed, c.sent), (2, 1), "{c:?}");
    }

    /// A lost, damaged or half-filled opt-out filter hides no opt-out: the set answers until
    /// the filter is complete again, rebuilt in the background or by a replica that starts.
    #[tokio::test]
    async fn a_lost_or_incomplete_opt_out_filter_hides_no_opt_out() {
        let (server, store) = redis_store("optouts").await;
        let (a, b) = ("+8613800000021", "+8613800000022");
        assert!(store.opt_out(a).await.expect("opt out"));
        let bloom = &store.optouts.bloom;
        let complete = || async {
            let started = std::time::Instant::now();
            // Marked complete, and whole (a part that lost its bitmap keeps its mark until the
            // repair drops it).
            while !(store.optouts.is_complete().await.unwrap_or(false)
                && bloom.contains(b"probe").await.is_ok())
            {
                assert!(started.elapsed() < Duration::from_secs(10), "never rebuilt");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        // Deleted.
        bloom.delete().await.expect("delete the filter");
        assert!(store.is_opted_out(a).await.expect("answered"), "deleted");
        complete().await;
        assert!(bloom.contains(a.as_bytes()).await.expect("rebuilt"));
        // Damaged: one part lost its bits (eviction takes keys one at a time).
        server
            .cmd_ok(&["DEL", "optouts:bloom:optouts:{optouts#0}"])
            .expect("DEL");
        assert!(store.is_opted_out(a).await.expect("answered"), "damaged");
        complete().await;
        // Made and not filled (a replica that died filling it): not trusted to say no.
        bloom.delete().await.expect("delete the filter");
        assert!(bloom.try_init().await.expect("init"));
        assert!(store.is_opted_out(a).await.expect("answered"), "incomplete");
        complete().await;
        // Half filled, with whatever its bits say (the old marker, a member of the filter that
        // a false positive could find there before the fill ended): the set answers.
        bloom.delete().await.expect("delete the filter");
        assert!(bloom.try_init().await.expect("init"));
        assert!(bloom.add(b"\0complete").await.expect("add"));
        assert!(
            store.is_opted_out(a).await.expect("answered"),
            "half filled"
        );
        complete().await;
        // Opting out while the filter is gone; a replica that starts after answers from the
        // set, and the filter is complete again soon (made by that replica, or by the repair
        // the opt-out started if it still held the repair lock).
        bloom.delete().await.expect("delete the filter");
        assert!(
            store
                .opt_out(b)
                .await
                .expect("opt out with the filter gone")
        );
        bloom.delete().await.expect("delete the filter");
        let restarted = RedisShared::connect(&server.url(), "optouts")
            .await
            .expect("connect");
        for phone in [a, b] {
            assert!(
                restarted.is_opted_out(phone).await.expect("answered"),
                "{phone}"
            );
        }
        complete().await;
        for phone in [a, b] {
            assert!(
                bloom.contains(phone.as_bytes()).await.expect("up"),
                "{phone}"
            );
        }
        assert!(
            !restarted
                .is_opted_out("+8613800000023")
                .await
                .expect("answered")
        );
    }

    /// A completed campaign keeps its report and outcomes for its retention, then is gone; a
    /// late dispatcher neither sends a number again meanwhile nor brings the campaign back.
    async fn completed_campaigns_are_kept_for_their_retention<S: Shared>(store: &S) {
        let (a, b) = ("+8613800000021", "+8613800000022");
        create(store, "r1", &[a, b]).await;
        assert!(claimed(store, "r1", a, "x", "claim").await);
        store
            .campaign_record("r1", a, Outcome::Sent)
            .await
            .expect("record");
        let keep = Duration::from_millis(600);
        store
            .campaign_complete("r1", keep, 1)
            .await
            .expect("complete");
        let c = store.campaign_get("r1").await.expect("get").expect("kept");
        assert_eq!((c.status.as_str(), c.sent, c.claimed), ("completed", 1, 1));
        // Its numbers are dropped; its outcomes kept: a late dispatcher sends `a` no more.
        assert!(
            store
                .campaign_phones("r1", 0, 10)
                .await
                .expect("phones")
                .is_empty()
        );
        assert!(!claimed(store, "r1", a, "late", "claim").await);
        // Completing again changes nothing (a second dispatcher does not extend it).
        assert_eq!(
            store
                .campaign_complete("r1", Duration::from_secs(3600), 1)
                .await
                .expect("complete again"),
            Completion::AlreadyDone
        );
        tokio::time::sleep(keep + Duration::from_millis(200)).await;
        assert!(store.campaign_get("r1").await.expect("get").is_none());
        // A late dispatcher's writes do not bring it back.
        assert!(!claimed(store, "r1", b, "late", "claim").await);
        store
            .campaign_record("r1", b, Outcome::Sent)
            .await
            .expect("record");
        store
            .campaign_progress("r1", 2, "late", 1)
            .await
            .expect("progress");
        assert!(store.campaign_get("r1").await.expect("get").is_none());
        assert!(store.campaigns_pending().await.expect("pending").is_empty());
    }

    #[tokio::test]
    async fn completed_campaigns_are_kept_for_their_retention_in_memory() {
        completed_campaigns_are_kept_for_their_retention(&MemoryShared::new().expect("store"))
            .await;
    }

    #[tokio::test]
    async fn completed_campaigns_are_kept_for_their_retention_in_redis() {
        let (_server, store) = redis_store("retention").await;
        completed_campaigns_are_kept_for_their_retention(&store).await;
        // Nothing of it is left in Redis.
        let keys: Vec<String> = store
            .query({
                let mut keys = redis::cmd("KEYS");
                keys.arg("retention:campaign:*");
                keys
            })
            .await
            .expect("keys");
        assert!(keys.is_empty(), "{keys:?}");
    }

    /// A completed campaign keeps its report for its retention, not each number's outcome
    /// (100,000 of them a campaign, in the process' memory); none of its numbers is claimed
    /// again, whoever asks.
    #[tokio::test]
    async fn a_completed_campaign_keeps_its_report_not_its_outcomes_in_memory() {
        let store = MemoryShared::new().expect("store");
        let (campaign, phones) = campaign_of("m1", 3);
        store
            .campaign_create(&campaign, &phones)
            .await
            .expect("create");
        for phone in &phones {
            let claim = store.campaign_claim("m1", phone, "a", 1).await;
            assert_eq!(claim.expect("claim"), Claim::Claimed);
            store
                .campaign_record("m1", phone, Outcome::Sent)
                .await
                .expect("record");
        }
        let done = store
            .campaign_complete("m1", Duration::from_secs(60), 1)
            .await
            .expect("complete");
        assert_eq!(done, Completion::Completed);
        assert!(locked(&store.campaigns)["m1"].done.is_empty());
        let again = store.campaign_claim("m1", &phones[0], "b", 2).await;
        assert_eq!(again.expect("claim"), Claim::Taken);
        let report = store.campaign_get("m1").await.expect("get").expect("kept");
        assert_eq!((report.sent, report.claimed, report.unknown), (3, 3, 0));
    }

    #[tokio::test]
    async fn unclaimed_numbers_are_claimed_again_in_memory() {
        unclaimed_numbers_are_claimed_again(&MemoryShared::new().expect("store")).await;
    }

    #[tokio::test]
    async fn unclaimed_numbers_are_claimed_again_in_redis() {
        let (_server, store) = redis_store("unclaim").await;
        unclaimed_numbers_are_claimed_again(&store).await;
        // Another replica's claim stays.
        assert!(
            store
                .campaign_claim("u1", "+8613800000099", "y", 1)
                .await
                .is_ok()
        );
        let key = store.campaign_key("u1", ":done");
        let _: i64 = store
            .query({
                let mut c = redis::cmd("HSET");
                c.arg(&key).arg("+8613800000013").arg("claimed:other");
                c
            })
            .await
            .expect("HSET");
        store
            .campaign_unclaim("u1", "+8613800000013", "y", 1)
            .await
            .expect("unclaim");
        assert!(!claimed(&store, "u1", "+8613800000013", "y", "claim").await);
    }

    #[tokio::test]
    async fn a_stale_dispatcher_cannot_reopen_a_campaign_in_redis() {
        let (_server, store) = redis_store("stale").await;
        stale_progress_is_ignored(&store).await;
    }

    #[tokio::test]
    async fn a_full_memory_store_keeps_every_phone_s_limit() {
        // A store of 64 limit states, filled by other numbers after the first one's message:
        // the first number must stay limited (an evicted state would start over and allow a
        // second message inside its 30 minutes).
        let store = MemoryShared::with_max_keys(64).expect("store");
        let limits =
            crate::app::Limits::from_config(&crate::config::Config::default()).expect("limits");
        let check = |phone: String| {
            let store = &store;
            let limits = &limits;
            async move {
                let checks = [
                    floodgate::Check::new(phone.as_bytes(), &limits.phone),
                    floodgate::Check::new(phone.as_bytes(), &limits.phone_daily),
                ];
                store
                    .limiter()
                    .check(&checks, floodgate::CheckOptions::default())
                    .await
            }
        };
        let first = "+8613800000000".to_owned();
        let verdict = check(first.clone()).await.expect("the first number");
        assert!(verdict.allowed());
        let mut refused = 0;
        for i in 1..=500 {
            if check(format!("+86138{i:08}")).await.is_err() {
                refused += 1;
            }
        }
        assert!(refused > 0, "the store never filled up");
        let again = check(first).await.expect("a held number is checked");
        assert!(!again.allowed(), "the first number's limit was forgotten");
    }

    #[tokio::test]
    async fn a_full_memory_store_keeps_the_keys_still_being_sent() {
        let store = MemoryShared::new().expect("store");
        for i in 0..MAX_MEMORY_IDEMPOTENCY_KEYS - 1 {
            let key = format!("done-{i}");
            assert!(matches!(
                store.idempotency_begin(&key, "r").await,
                Ok(Idempotency::New)
            ));
            store
                .idempotency_finish(&key, "r", "{}")
                .await
                .expect("finish");
        }
        // In progress: it expires sooner than any answered key.
        assert!(matches!(
            store.idempotency_begin("sending", "r").await,
            Ok(Idempotency::New)
        ));
        // Full: room is made for a new key.
        assert!(matches!(
            store.idempotency_begin("next", "r").await,
            Ok(Idempotency::New)
        ));
        // The key being sent is still in progress: a retry must not send again.
        assert!(matches!(
            store.idempotency_begin("sending", "r").await,
            Ok(Idempotency::InProgress)
        ));
        // Answered keys replay their answer.
        assert!(matches!(
            store.idempotency_begin("done-199998", "r").await,
            Ok(Idempotency::Replay(_))
        ));
    }
}
