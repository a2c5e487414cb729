//! Automatic batching: checks issued concurrently are grouped into one script call.

use std::collections::HashMap;
use std::time::Duration;

use std::sync::Arc;

use futures_util::future::{join, join_all};
use redis::Value;
use smallvec::SmallVec;
use tokio::sync::{Semaphore, mpsc, oneshot};

use crate::conn::SHORT_BUDGET;
use crate::error::{is_refusal, refusal, strip_script_suffix};
use crate::gcra_batch::GcraBatch;
use crate::limiter::{Group, RELEASE, check_script_for, decode_group};
use crate::{ConnectionKind, Error, RedisConn, display_key};
use floodgate_core::{Timestamp, Verdict};

/// How checks are batched.
///
/// A single task owns the batching. It takes every check waiting in its queue (up to
/// [`BatchConfig::max_batch`]) and sends them as one `EVALSHA` of the check script, in which
/// each check remains its own all-or-nothing group (a batch of plain GCRA checks only: of the
/// GCRA batch script, see [`crate::RedisLimiter`]). Up to [`BatchConfig::max_in_flight`] such
/// batches are pipelined on the connection (a batch is one call, or one per cluster slot, and
/// its checks with little time left go in a call of their own). While a call is in flight, checks queue and go
/// together in the next call (optionally waiting up to [`BatchConfig::window`] for more; zero by
/// default); when nothing is in flight, a check goes out at once, so batching adds no latency to
/// an idle limiter. On a cluster, a batch is split per slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchConfig {
    /// Whether to batch at all.
    pub enabled: bool,
    /// The longest a check waits for others to join its batch, and only while another batch
    /// is in flight (on top of one yield to the scheduler). Default zero: checks that queue
    /// while a batch is in flight join the next one anyway, and on a busy machine a longer wait
    /// costs more CPU than it saves (measured with `floodgate bench`: 140k decisions/s with no
    /// window against 114k with 100 µs).
    pub window: Duration,
    /// The most checks in one script call. Default 128.
    pub max_batch: usize,
    /// The most script calls in flight at once. Default 4. Calls in flight together are sent
    /// from tasks of their own, so checks issued at once (concurrent checks, which have no
    /// order) may be decided in another order than they were issued; with 1, each batch goes
    /// after the one before, in order of issue, at the cost of pipelining.
    pub max_in_flight: usize,
    /// How many checks may queue for the batcher before callers wait. Default 16384.
    pub queue: usize,
}

impl Default for BatchConfig {
    fn default() -> Self {
        BatchConfig {
            enabled: true,
            window: Duration::ZERO,
            max_batch: 128,
            max_in_flight: 4,
            queue: 16_384,
        }
    }
}

impl BatchConfig {
    /// No batching: every check is its own script call.
    pub fn disabled() -> Self {
        BatchConfig {
            enabled: false,
            ..BatchConfig::default()
        }
    }

    /// Checks the settings against the connection's call `timeout`: room in the queue for at
    /// least one check (and no more than a semaphore counts), no more calls in flight than a
    /// semaphore counts, and a window shorter than three quarters of the timeout (checks
    /// waiting longer for company would be sent with too little time left). A `max_batch`
    /// or `max_in_flight` of zero counts as one. Nothing is checked when batching is off.
    ///
    /// # Errors
    /// [`Error::Config`] naming the setting.
    pub fn validate(&self, timeout: Duration) -> Result<(), Error> {
        if !self.enabled {
            return Ok(());
        }
        if self.queue == 0 || self.queue > Semaphore::MAX_PERMITS {
            return Err(Error::Config(format!(
                "the batch queue must have room for 1 to {} checks, not {}",
                Semaphore::MAX_PERMITS,
                self.queue
            )));
        }
        if self.max_in_flight > Semaphore::MAX_PERMITS {
            return Err(Error::Config(format!(
                "max_in_flight {} is more than the {} calls in flight a batcher can count",
                self.max_in_flight,
                Semaphore::MAX_PERMITS
            )));
        }
        // A check that waited past this for company would be sent with too little time left.
        let longest = timeout.saturating_sub(timeout / SHORT_BUDGET);
        if self.window >= longest {
            return Err(Error::Config(format!(
                "the batch window ({:?}) must be shorter than three quarters of the call timeout ({timeout:?}): checks waiting that long for company would be sent with too little time left",
                self.window
            )));
        }
        Ok(())
    }
}

/// A decided check, and the time (µs, server or injected) the script decided it at.
pub(crate) type Checked = (Verdict, u64);

/// What the batcher answers a check: its result and, with an allowed verdict that holds a
/// concurrency lease, that lease to give back if nobody claims it (the caller was gone, or
/// dropped the check before reading the answer).
/// The lease is boxed: few checks take one, and the answer is moved several times on its way.
pub(crate) type Answer = (Result<Checked, Error>, Option<Box<Unclaimed>>);

/// A check waiting for its batch.
pub(crate) struct Job {
    pub(crate) group: Group,
    pub(crate) reply: oneshot::Sender<Answer>,
    /// When the caller's per-call timeout runs out: the check fails then, wherever it is.
    pub(crate) deadline: tokio::time::Instant,
}

fn expired(after: Duration) -> Error {
    Error::Timeout {
        after,
        op: "batched check",
    }
}

/// The check script's arguments, written into one buffer: one allocation per call instead of
/// one per number.
pub(crate) struct EncodedArgs {
    buf: Vec<u8>,
    /// Where each argument ends in `buf`.
    ends: SmallVec<[usize; 32]>,
}

impl EncodedArgs {
    /// Empty, with room for `bytes` of arguments.
    pub(crate) fn with_capacity(bytes: usize) -> Self {
        EncodedArgs {
            buf: Vec::with_capacity(bytes),
            ends: SmallVec::new(),
        }
    }

    pub(crate) fn push_bytes(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
        self.ends.push(self.buf.len());
    }

    /// Appends `bytes` to the last argument.
    fn extend_last(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
        if let Some(end) = self.ends.last_mut() {
            *end = self.buf.len();
        }
    }

    pub(crate) fn push_u64(&mut self, v: u64) {
        self.push_bytes(itoa::Buffer::new().format(v).as_bytes());
    }

    fn push_i64(&mut self, v: i64) {
        self.push_bytes(itoa::Buffer::new().format(v).as_bytes());
    }

    /// The arguments, in order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &[u8]> {
        let mut start = 0;
        self.ends.iter().map(move |&end| {
            let arg = &self.buf[start..end];
            start = end;
            arg
        })
    }
}

/// The check script's arguments for `groups` (see `lua/check.lua`): the injected time (or
/// nothing), the policy table (each distinct policy once: its tag and four parameters), then
/// per group its key count, max wait, lease, dry-run flag, and per check the policy's
/// position in the table (from 1) and the cost; or, for a plain group (one check of cost 1,
/// no wait, no lease, counted: most checks), only the policy's position, negated.
pub(crate) fn encode(groups: &[&Group]) -> EncodedArgs {
    let mut policies: SmallVec<[(&'static str, [i64; 4]); 4]> = SmallVec::new();
    let mut index: SmallVec<[u64; 16]> = SmallVec::new();
    for g in groups {
        for p in &g.policies {
            let i = match policies.iter().position(|q| q == p) {
                Some(i) => i,
                None => {
                    policies.push(*p);
                    policies.len() - 1
                }
            };
            index.push(i as u64 + 1);
        }
    }
    let mut out =
        EncodedArgs::with_capacity(16 + policies.len() * 48 + index.len() * 24 + groups.len() * 32);
    match groups.first().and_then(|g| g.now) {
        Some(t) => out.push_u64(t.as_micros()),
        None => out.push_bytes(b""),
    }
    out.push_u64(policies.len() as u64);
    for (tag, p) in &policies {
        out.push_bytes(tag.as_bytes());
        for &v in p {
            out.push_i64(v);
        }
    }
    out.push_u64(groups.len() as u64);
    let mut index = index.into_iter();
    for g in groups {
        if g.is_plain() {
            // The short form: one argument, the policy's position, negated.
            let i = index.next().unwrap_or(0);
            out.push_bytes(b"-");
            out.extend_last(itoa::Buffer::new().format(i).as_bytes());
            continue;
        }
        out.push_u64(g.keys.len() as u64);
        out.push_u64(g.max_wait);
        out.push_u64(g.lease);
        out.push_u64(u64::from(g.dry_run));
        for &cost in &g.costs {
            out.push_u64(index.next().unwrap_or(0));
            out.push_u64(cost);
        }
    }
    out
}

/// [`encode`], one vector per argument (for [`crate::ScriptArgs`]).
pub(crate) fn encode_args(groups: &[&Group]) -> Vec<Vec<u8>> {
    encode(groups).iter().map(<[u8]>::to_vec).collect()
}

/// Runs `groups` in one script call, bounded by `timeout`. The groups must share a slot on a
/// cluster and an injected time, if any. The outer error fails every group; inner errors are
/// per group.
pub(crate) async fn run_within(
    conn: &RedisConn,
    groups: &[&Group],
    timeout: Duration,
) -> Result<Vec<Result<Checked, Error>>, Error> {
    if let Some(batch) = GcraBatch::of(groups) {
        return batch.run(conn, groups, timeout).await;
    }
    let keys: SmallVec<[&[u8]; 8]> = groups
        .iter()
        .flat_map(|g| g.keys.iter().map(Vec::as_slice))
        .collect();
    let args = encode(groups);
    let arg_refs: SmallVec<[&[u8]; 32]> = args.iter().collect();
    let result = conn
        .invoke_check_within(
            check_script_for(groups),
            &keys,
            &arg_refs,
            timeout,
            refused_reply,
        )
        .await
        .and_then(|reply| decode(&reply, groups, conn.redacted_url()));
    // The call may have run on the server before it failed (a timeout, a connection lost
    // mid-reply): a concurrency lease it granted would be held for nobody until it expires.
    // (The GCRA batch script above takes no leases.)
    if let Err(e) = &result
        && may_have_run(e)
    {
        for group in groups {
            // Given back when dropped unclaimed.
            drop(Unclaimed::of(conn, group));
        }
    }
    result
}

fn decode(
    reply: &Value,
    groups: &[&Group],
    addr: &str,
) -> Result<Vec<Result<Checked, Error>>, Error> {
    let unexpected = || Error::UnexpectedReply {
        expected: "the check script's reply",
        got: format!("{reply:?}").chars().take(200).collect(),
    };
    let Value::Array(items) = reply else {
        return Err(unexpected());
    };
    let now = match items.first() {
        Some(Value::Int(t)) => u64::try_from(*t).map_err(|_| unexpected())?,
        _ => return Err(unexpected()),
    };
    let mut at = 1;
    let mut out = Vec::with_capacity(groups.len());
    for g in groups {
        match items.get(at) {
            Some(Value::Int(1)) => {
                let n = g.keys.len() * 6;
                let ints: Option<SmallVec<[i64; 12]>> =
                    items.get(at + 1..at + 1 + n).and_then(|s| {
                        s.iter()
                            .map(|v| match v {
                                Value::Int(i) => Some(*i),
                                _ => None,
                            })
                            .collect()
                    });
                // A reply cut short or of another shape spoils the whole reply; six integers
                // that make no decision (a negative count) spoil only their own group.
                let ints = ints.ok_or_else(unexpected)?;
                out.push(
                    decode_group(&ints, now)
                        .map(|v| (v, now))
                        .ok_or_else(unexpected),
                );
                at += 1 + n;
            }
            Some(Value::Int(0)) => {
                let message = match items.get(at + 1) {
                    Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
                    Some(Value::SimpleString(s)) => s.clone(),
                    _ => return Err(unexpected()),
                };
                out.push(Err(group_error(&message, &g.keys, addr)));
                at += 2;
            }
            _ => return Err(unexpected()),
        }
    }
    if at != items.len() {
        return Err(unexpected());
    }
    Ok(out)
}

/// Maps the error a group raised (`FLOODGATE_CORRUPT <i> <detail>`, `FLOODGATE_WRONGTYPE <i>`,
/// `WRONGTYPE ...`) to a typed error naming the key, and a server's refusal to write (`OOM`,
/// `READONLY`...) to [`Error::NotServing`] naming `addr`.
pub(crate) fn group_error(message: &str, keys: &[Vec<u8>], addr: &str) -> Error {
    let (code, rest) = message.split_once(' ').unwrap_or((message, ""));
    let key_at = |i: &str| {
        i.parse::<usize>()
            .ok()
            .and_then(|i| keys.get(i))
            .map_or_else(|| "(unknown)".to_owned(), |k| display_key(k))
    };
    match code {
        "FLOODGATE_CORRUPT" => {
            let (i, detail) = rest.split_once(' ').unwrap_or((rest, ""));
            Error::Corrupted {
                key: key_at(i),
                detail: detail.to_owned(),
            }
        }
        "FLOODGATE_WRONGTYPE" => Error::WrongType {
            key: key_at(rest.trim()),
        },
        "WRONGTYPE" => Error::WrongType {
            key: keys
                .first()
                .map_or_else(|| "(no key)".to_owned(), |k| display_key(k)),
        },
        _ if is_refusal(code) => Error::NotServing {
            addr: addr.to_owned(),
            message: strip_script_suffix(message).to_owned(),
        },
        _ => Error::Script {
            message: message.to_owned(),
        },
    }
}

/// The refusal to serve (`OOM`, `READONLY`...) a check script's reply carries, if any,
/// as the error of one of its groups or keys: those are the reply's strings, every other
/// value an integer. The circuit breaker counts such a reply as a failure.
pub(crate) fn refused_reply(reply: &Value) -> Option<&'static str> {
    let Value::Array(items) = reply else {
        return None;
    };
    items.iter().find_map(|item| {
        let text = match item {
            Value::BulkString(b) => b.as_slice(),
            Value::SimpleString(s) => s.as_bytes(),
            _ => return None,
        };
        let code = text.split(|b| *b == b' ').next().unwrap_or_default();
        std::str::from_utf8(code).ok().and_then(refusal)
    })
}

/// The same error again, for every check of a failed batch.
pub(crate) fn duplicate(e: &Error) -> Error {
    match e {
        Error::Config(m) => Error::Config(m.clone()),
        Error::Connect { addr, source } => Error::Connect {
            addr: addr.clone(),
            source: source.clone(),
        },
        Error::Unavailable { addr, retry_in } => Error::Unavailable {
            addr: addr.clone(),
            retry_in: *retry_in,
        },
        Error::NotServing { addr, message } => Error::NotServing {
            addr: addr.clone(),
            message: message.clone(),
        },
        Error::Timeout { after, op } => Error::Timeout { after: *after, op },
        Error::WrongType { key } => Error::WrongType { key: key.clone() },
        Error::Corrupted { key, detail } => Error::Corrupted {
            key: key.clone(),
            detail: detail.clone(),
        },
        Error::CrossSlot { message } => Error::CrossSlot {
            message: message.clone(),
        },
        Error::Migrating { message } => Error::Migrating {
            message: message.clone(),
        },
        Error::Script { message } => Error::Script {
            message: message.clone(),
        },
        Error::UnexpectedReply { expected, got } => Error::UnexpectedReply {
            expected,
            got: got.clone(),
        },
        Error::Redis(r) => Error::Redis(r.clone()),
        #[allow(unreachable_patterns)]
        other => Error::Script {
            message: other.to_string(),
        },
    }
}

/// The batching task: runs until every sender is gone. Each batch runs as its own task, so
/// batches in flight progress while the next one fills; a semaphore bounds how many.
pub(crate) async fn batcher(conn: RedisConn, cfg: BatchConfig, mut rx: mpsc::Receiver<Job>) {
    let max_batch = cfg.max_batch.max(1);
    let max_in_flight = cfg.max_in_flight.max(1);
    let permits = Arc::new(Semaphore::new(max_in_flight));
    let migrating = Arc::new(MigratingSlots::default());
    while let Some(first) = rx.recv().await {
        // Room for what is queued now: jobs are large, and growing the vector one doubling at
        // a time copied each of them about twice more.
        let mut batch = Vec::with_capacity((rx.len() + 1).min(max_batch));
        batch.push(first);
        fill(&mut rx, &mut batch, max_batch);
        // Wait for company only while the pipeline is busy anyway. Always yield once: tasks
        // about to queue a check get to do so, for the price of a reschedule (30% more
        // decisions per second in `floodgate bench` than sending at once). Tokio's timers tick
        // in whole milliseconds, far longer than a window: a longer wait yields in a loop and
        // stops at the deadline by the monotonic clock.
        let busy = permits.available_permits() < max_in_flight;
        if busy && batch.len() < max_batch {
            tokio::task::yield_now().await;
            fill(&mut rx, &mut batch, max_batch);
            // None: a window longer than an `Instant` holds, which only ends with a full batch
            // or an empty pipeline.
            let deadline = std::time::Instant::now().checked_add(cfg.window);
            while !cfg.window.is_zero()
                && batch.len() < max_batch
                && deadline.is_none_or(|d| std::time::Instant::now() < d)
            {
                tokio::task::yield_now().await;
                let before = batch.len();
                fill(&mut rx, &mut batch, max_batch);
                if batch.len() == before && permits.available_permits() == max_in_flight {
                    // The pipeline emptied and nobody else is coming: go now.
                    break;
                }
            }
        }
        // Wait for a slot in the pipeline, but not past the checks' deadlines: a check that
        // cannot be sent in time fails at its deadline.
        let permit = loop {
            let Some(earliest) = batch.iter().map(|j| j.deadline).min() else {
                break None;
            };
            match tokio::time::timeout_at(earliest, Arc::clone(&permits).acquire_owned()).await {
                Ok(Ok(permit)) => break Some(permit),
                Ok(Err(_)) => break None,
                Err(_) => {
                    let now = tokio::time::Instant::now();
                    let (late, on_time): (Vec<Job>, Vec<Job>) =
                        batch.into_iter().partition(|j| j.deadline <= now);
                    for job in late {
                        let _ = job.reply.send((Err(expired(conn.timeout())), None));
                    }
                    batch = on_time;
                }
            }
        };
        let Some(permit) = permit else {
            if batch.is_empty() {
                continue;
            }
            break;
        };
        // Whatever queued while we waited for a slot in the pipeline joins this batch.
        fill(&mut rx, &mut batch, max_batch);
        let conn = conn.clone();
        let migrating = Arc::clone(&migrating);
        // Boxed: the batch's future takes kilobytes (mostly the Redis client's), and tokio
        // copies a task's future several times on the way in and out of its cell.
        tokio::spawn(Box::pin(async move {
            dispatch(conn, batch, migrating).await;
            drop(permit);
        }));
    }
}

fn fill(rx: &mut mpsc::Receiver<Job>, batch: &mut Vec<Job>, max_batch: usize) {
    while batch.len() < max_batch {
        match rx.try_recv() {
            Ok(job) => batch.push(job),
            Err(_) => break,
        }
    }
}

/// Sends one batch: one script call per (slot, injected time), concurrently.
async fn dispatch(conn: RedisConn, jobs: Vec<Job>, migrating: Arc<MigratingSlots>) {
    let cluster = conn.kind() == ConnectionKind::Cluster;
    // Slots are noted only on a cluster: a single node never answers `TRYAGAIN`.
    let migrating = cluster.then_some(&*migrating);
    let set_of = |job: &Job| {
        let slot = if cluster { job.group.slot() } else { 0 };
        (slot, job.group.now.map(|t| t.as_micros()))
    };
    // The usual batch is one set (one server, the server's time): no map, no join.
    let first = jobs.first().map(set_of);
    if jobs.iter().all(|job| Some(set_of(job)) == first) {
        run_set(&conn, jobs, migrating).await;
        return;
    }
    let mut sets: HashMap<(u16, Option<u64>), Vec<Job>> = HashMap::new();
    for job in jobs {
        sets.entry(set_of(&job)).or_default().push(job);
    }
    join_all(sets.into_values().map(|set| run_set(&conn, set, migrating))).await;
}

/// Whether a call that failed with `e` may have run on the server all the same (a timeout, a
/// lost connection, a reply that could not be read, a write that failed after groups had
/// committed): every error but those that prove the script never ran, a breaker that refused
/// the call, a bad configuration, keys in several slots.
fn may_have_run(e: &Error) -> bool {
    !matches!(
        e,
        Error::Unavailable { .. }
            | Error::Config(_)
            | Error::CrossSlot { .. }
            | Error::Migrating { .. }
    )
}

/// A concurrency lease a check's script call granted, or may have, until the caller claims it
/// with its verdict: dropped unclaimed (the caller is gone or dropped the check, the call
/// failed after it may have run), it is given back in the background, instead of holding a
/// place until its TTL. Releasing a lease that is not held changes nothing.
pub(crate) struct Unclaimed {
    conn: RedisConn,
    keys: SmallVec<[Vec<u8>; 1]>,
    lease: u64,
    now: Option<Timestamp>,
}

impl Unclaimed {
    /// The lease `group` asks for; `None` when it takes none (no concurrency policy, a dry run).
    pub(crate) fn of(conn: &RedisConn, group: &Group) -> Option<Self> {
        if group.lease == 0 || group.dry_run {
            return None;
        }
        let keys = group
            .keys
            .iter()
            .zip(&group.policies)
            .filter(|(_, (tag, _))| *tag == "conc")
            .map(|(key, _)| key.clone())
            .collect();
        Some(Unclaimed {
            conn: conn.clone(),
            keys,
            lease: group.lease,
            now: group.now,
        })
    }

    /// The caller has the lease (with its verdict), or the call proved it was not granted.
    pub(crate) fn claim(mut self) {
        self.lease = 0;
    }
}

impl Drop for Unclaimed {
    /// Releases the lease on every key, in a task on the current tokio runtime (outside one, it
    /// lapses after its TTL).
    fn drop(&mut self) {
        if self.lease == 0 {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::debug!("a concurrency lease nobody holds lapses after its TTL: no runtime");
            return;
        };
        let (conn, keys, lease, now) = (
            self.conn.clone(),
            std::mem::take(&mut self.keys),
            self.lease,
            self.now,
        );
        runtime.spawn(async move {
            // The call that failed may be what opened the circuit breaker, which then refuses
            // this release at once: it is tried again while Redis is down or failing fast (a
            // release is idempotent), for up to `RELEASE_PATIENCE`.
            let give_up = tokio::time::Instant::now() + RELEASE_PATIENCE;
            let mut pause = RELEASE_RETRY_MIN;
            loop {
                let e = match release_keys(&conn, &keys, lease, now).await {
                    Ok(_) => return,
                    Err(e) => e,
                };
                let wait = match &e {
                    Error::Unavailable { retry_in, .. } => (*retry_in).max(RELEASE_RETRY_MIN),
                    e if e.is_timeout() || e.is_connection() => pause,
                    _ => Duration::MAX,
                };
                if tokio::time::Instant::now()
                    .checked_add(wait)
                    .is_none_or(|at| at >= give_up)
                {
                    tracing::debug!(
                        error = %e,
                        "giving back a concurrency lease failed; it lapses after its TTL"
                    );
                    return;
                }
                tokio::time::sleep(wait).await;
                pause = (pause * 2).min(RELEASE_RETRY_MAX);
            }
        });
    }
}

/// How long the release of a lease nobody holds is tried again while Redis is down or failing
/// fast; then the lease lapses after its TTL.
const RELEASE_PATIENCE: Duration = Duration::from_secs(30);
/// The first and longest pause between two tries of such a release.
const RELEASE_RETRY_MIN: Duration = Duration::from_millis(50);
const RELEASE_RETRY_MAX: Duration = Duration::from_secs(1);

/// Releases `lease` (at `now`, or the server's time) on each of `keys`, one call per key: they
/// may live in different slots. How many still held it; after trying every key, the first
/// error.
pub(crate) async fn release_keys<K: AsRef<[u8]>>(
    conn: &RedisConn,
    keys: &[K],
    lease: u64,
    now: Option<Timestamp>,
) -> Result<u64, Error> {
    let lease = lease.to_string();
    let now = now.map_or(String::new(), |t| t.as_micros().to_string());
    let mut released = 0;
    let mut first_error = None;
    for key in keys {
        let reply = conn
            .invoke_script(
                &RELEASE,
                &[key.as_ref()],
                &[lease.as_bytes(), now.as_bytes()],
            )
            .await;
        let error = match reply {
            Ok(Value::Int(n)) => {
                released += u64::try_from(n).unwrap_or(0);
                continue;
            }
            Ok(other) => Error::UnexpectedReply {
                expected: "a count from the release script",
                got: format!("{other:?}").chars().take(200).collect(),
            },
            Err(e) => e,
        };
        first_error.get_or_insert(error);
    }
    first_error.map_or(Ok(released), Err)
}

/// Answers the jobs whose deadline has passed (a timeout, nothing sent), and splits the others
/// into those with less than `margin` left and the rest.
fn split_late(
    jobs: Vec<Job>,
    now: tokio::time::Instant,
    margin: Duration,
    timeout: Duration,
) -> (Vec<Job>, Vec<Job>) {
    let left = |j: &Job| j.deadline.saturating_duration_since(now);
    if jobs.iter().all(|j| left(j) >= margin) {
        return (Vec::new(), jobs);
    }
    let mut late = Vec::new();
    let mut on_time = Vec::new();
    for job in jobs {
        match left(&job) {
            Duration::ZERO => {
                let _ = job.reply.send((Err(expired(timeout)), None));
            }
            l if l < margin => late.push(job),
            _ => on_time.push(job),
        }
    }
    (late, on_time)
}

async fn run_set(conn: &RedisConn, mut jobs: Vec<Job>, migrating: Option<&MigratingSlots>) {
    // A check whose caller is gone (a cancelled request) is not sent: nothing would be told of
    // its decision, and an admission, or a concurrency lease, would be counted for nobody.
    jobs.retain(|job| !job.reply.is_closed());
    if jobs.is_empty() {
        return;
    }
    // A call gets what is left of the earliest deadline among its checks. A check with little
    // time left (it waited for a slot in the pipeline) would cut every other check's call
    // short: the server would count them all and each caller would hear of a timeout (and
    // count again in its fallback). Such checks go in a call of their own, at the same time.
    let now = tokio::time::Instant::now();
    let (late, on_time) = split_late(jobs, now, conn.timeout() / SHORT_BUDGET, conn.timeout());
    if late.is_empty() {
        call(conn, on_time, now, migrating).await;
    } else {
        // (A call of no jobs does nothing.) Boxed: this path is rare, and inline it would
        // double the size of every batch's task.
        Box::pin(join(
            call(conn, late, now, migrating),
            call(conn, on_time, now, migrating),
        ))
        .await;
    }
}

/// One script call for `jobs`, bounded by the earliest of their deadlines; each job gets its
/// answer. On a cluster (`migrating` given), jobs of a slot that refused a batch with
/// `TRYAGAIN` lately, or that does now, go one by one.
async fn call(
    conn: &RedisConn,
    mut jobs: Vec<Job>,
    now: tokio::time::Instant,
    migrating: Option<&MigratingSlots>,
) {
    let left = jobs
        .iter()
        .map(|j| j.deadline.saturating_duration_since(now))
        .min()
        .unwrap_or(Duration::ZERO);
    if left.is_zero() {
        for job in jobs {
            let _ = job.reply.send((Err(expired(conn.timeout())), None));
        }
        return;
    }
    // A cluster batch is of one slot (not worked out on a single node, which has none).
    let slot = migrating.and(jobs.first()).map(|j| j.group.slot());
    if let (Some(migrating), Some(slot)) = (migrating, slot)
        && jobs.len() > 1
        && migrating.contains(slot)
    {
        one_by_one(conn, jobs).await;
        return;
    }
    let groups: Vec<&Group> = jobs.iter().map(|j| &j.group).collect();
    match run_within(conn, &groups, left).await {
        Ok(results) => {
            for (job, result) in jobs.into_iter().zip(results) {
                let lease = match &result {
                    Ok((verdict, _)) if verdict.allowed() => {
                        Unclaimed::of(conn, &job.group).map(Box::new)
                    }
                    _ => None,
                };
                // Unsent (the caller is gone), the answer is dropped here, and its lease given
                // back.
                let _ = job.reply.send((result, lease));
            }
        }
        // The batch's keys are split by a slot's migration (the call did not run): a check of
        // one key on its own is served by one node or the other (a check of several keys of
        // one user may be split too, and fails).
        Err(e) if e.is_migrating() && jobs.len() > 1 => {
            if let (Some(migrating), Some(slot)) = (migrating, slot) {
                migrating.note(slot);
            }
            // Checks whose callers left while the batch was refused are not sent.
            jobs.retain(|job| !job.reply.is_closed());
            one_by_one(conn, jobs).await;
        }
        Err(e) => {
            for job in jobs {
                let _ = job.reply.send((Err(duplicate(&e)), None));
            }
        }
    }
}

/// A [`call`] for each of `jobs`, at once. Boxed: this path is rare, and inline it would make
/// every call's future larger.
async fn one_by_one(conn: &RedisConn, jobs: Vec<Job>) {
    let now = tokio::time::Instant::now();
    Box::pin(join_all(
        jobs.into_iter()
            .map(|job| Box::pin(call(conn, vec![job], now, None))),
    ))
    .await;
}

/// How long a slot that refused a batch with `TRYAGAIN` has its batches sent check by check
/// (see [`MigratingSlots`]).
const MIGRATING_FOR: Duration = Duration::from_secs(1);

/// Cluster slots that refused a batch with `TRYAGAIN` (their keys split between two nodes by a
/// migration) in the last [`MIGRATING_FOR`]. For as long as a slot migrates, almost every batch
/// with a key the source no longer holds is refused, after the client has tried it a few times:
/// such a slot's batches go check by check at once instead, and do not hold a place in the
/// pipeline for their retries. A few slots migrate at a time; at most 64 are remembered.
#[derive(Default)]
pub(crate) struct MigratingSlots(std::sync::Mutex<SmallVec<[(u16, std::time::Instant); 4]>>);

impl MigratingSlots {
    fn slots(&self) -> std::sync::MutexGuard<'_, SmallVec<[(u16, std::time::Instant); 4]>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn note(&self, slot: u16) {
        let now = std::time::Instant::now();
        let mut slots = self.slots();
        slots.retain(|(s, at)| *s != slot && now.duration_since(*at) < MIGRATING_FOR);
        if slots.len() < 64 {
            slots.push((slot, now));
        }
    }

    fn contains(&self, slot: u16) -> bool {
        self.slots()
            .iter()
            .any(|&(s, at)| s == slot && at.elapsed() < MIGRATING_FOR)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use smallvec::smallvec;

    #[test]
    fn refusals_inside_the_script_are_unavailable() {
        let keys = [b"fg:x:{k}".to_vec()];
        for message in [
            "READONLY You can't write against a read only replica.",
            "OOM command not allowed when used memory > 'maxmemory'.",
        ] {
            let e = group_error(message, &keys, "redis://h:1");
            assert!(
                matches!(&e, Error::NotServing { addr, message: m } if addr == "redis://h:1" && m == message),
                "{e:?}"
            );
            assert!(e.is_connection());
            let reply = Value::Array(vec![
                Value::Int(1),
                Value::Int(0),
                Value::BulkString(message.as_bytes().to_vec()),
            ]);
            assert!(refused_reply(&reply).is_some(), "{message}");
        }
        // A key's own error is not a refusal, nor is a reply of integers.
        let corrupt = "FLOODGATE_CORRUPT 0 tat is x";
        assert!(matches!(
            group_error(corrupt, &keys, "a"),
            Error::Corrupted { .. }
        ));
        for reply in [
            Value::Array(vec![Value::Int(1), Value::BulkString(corrupt.into())]),
            Value::Array(vec![Value::Int(1), Value::Int(2)]),
            Value::Int(3),
        ] {
            assert!(refused_reply(&reply).is_none(), "{reply:?}");
        }
    }

    fn group(cost: u64, max_wait: u64) -> Group {
        Group {
            keys: smallvec![b"k".to_vec()],
            policies: smallvec![("gcra", [100, 1_000, 10, 0])],
            costs: smallvec![cost],
            max_wait,
            lease: 0,
            now: None,
            dry_run: false,
            gcra: None,
        }
    }

    fn args(groups: &[&Group]) -> Vec<String> {
        encode(groups)
            .iter()
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect()
    }

    #[tokio::test]
    async fn checks_with_little_time_left_are_split_off_and_expired_ones_answered() {
        let now = tokio::time::Instant::now();
        let ms = Duration::from_millis;
        let mut replies = Vec::new();
        let jobs: Vec<Job> = [ms(1), ms(499), ms(500), ms(100), ms(0)]
            .into_iter()
            .map(|left| {
                let (tx, rx) = oneshot::channel();
                replies.push(rx);
                Job {
                    group: group(1, 0),
                    reply: tx,
                    deadline: now + left,
                }
            })
            .collect();
        let (late, on_time) = split_late(jobs, now, ms(100), ms(400));
        let left =
            |jobs: &[Job]| -> Vec<Duration> { jobs.iter().map(|j| j.deadline - now).collect() };
        assert_eq!(left(&late), [ms(1)]);
        assert_eq!(left(&on_time), [ms(499), ms(500), ms(100)]);
        for (i, rx) in replies.iter_mut().enumerate() {
            match rx.try_recv() {
                Ok((Err(Error::Timeout { .. }), None)) => assert_eq!(i, 4),
                Err(oneshot::error::TryRecvError::Empty) => assert!(i < 4, "{i}"),
                Ok((other, _)) => panic!("{i}: {other:?}"),
                Err(e) => panic!("{i}: {e:?}"),
            }
        }
    }

    #[test]
    fn a_group_whose_integers_make_no_decision_fails_alone() {
        let (a, b) = (group(1, 0), group(1, 0));
        let fields = |remaining: i64| {
            [1, 5, remaining, -1, 1_000, 0]
                .into_iter()
                .map(Value::Int)
                .collect::<Vec<_>>()
        };
        let mut items = vec![Value::Int(1_700_000_000_000_000), Value::Int(1)];
        items.extend(fields(-3));
        items.push(Value::Int(1));
        items.extend(fields(4));
        let out = decode(&Value::Array(items.clone()), &[&a, &b], "redis://test")
            .expect("the reply's shape is fine");
        assert!(out[0].is_err(), "{:?}", out[0]);
        let (verdict, _) = out[1].as_ref().expect("the second group decides");
        assert_eq!(verdict.decisions[0].remaining, 4);
        // A reply cut short is wrong as a whole.
        items.pop();
        assert!(decode(&Value::Array(items), &[&a, &b], "redis://test").is_err());
    }

    #[test]
    fn plain_checks_are_one_argument_others_the_long_form() {
        let (plain, costly, waiting) = (group(1, 0), group(3, 0), group(1, 500));
        assert_eq!(
            args(&[&plain, &costly, &waiting, &plain]),
            [
                "", "1", "gcra", "100", "1000", "10", "0",  // the policy table
                "4",  // groups
                "-1", // plain
                "1", "0", "0", "0", "1", "3", // cost 3
                "1", "500", "0", "0", "1", "1", // a max wait
                "-1",
            ]
        );
    }

    /// The size of a batch's future: the future a batch's task runs, without naming its type.
    fn dispatch_future_size<F: FnOnce(RedisConn, Vec<Job>, Arc<MigratingSlots>) -> Fut, Fut>(
        _: F,
    ) -> usize {
        std::mem::size_of::<Fut>()
    }

    #[test]
    fn a_batch_s_future_holds_one_script_call_inline() {
        // One script call's future is about 5 KB, most of it the Redis client's. The rare path
        // that splits off late checks runs two calls at once, and boxes them: inline, they made
        // every batch's future 10.7 KB, copied several times per batch.
        let size = dispatch_future_size(dispatch);
        assert!(size < 8 * 1024, "a batch's future takes {size} bytes");
    }
}
