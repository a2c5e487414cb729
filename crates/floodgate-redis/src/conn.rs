//! One cheap-to-clone handle to Redis, whichever way it is connected.
//!
//! Every call is bounded by the configured timeout and answers with a typed
//! [`Error`]; scripts run with `EVALSHA` and are loaded again (on the node
//! that answered `NOSCRIPT`) when a server lost them.
//!
//! ```no_run
//! use floodgate_redis::{RedisConfig, RedisConn};
//!
//! # async fn run() -> Result<(), floodgate_redis::Error> {
//! let conn = RedisConn::connect(&RedisConfig::new("redis://127.0.0.1:6379")?).await?;
//! let script = redis::Script::new("return redis.call('INCR', KEYS[1])");
//! let value = conn.invoke_script(&script, &[b"hits"], &[]).await?;
//! assert_eq!(value, redis::Value::Int(1));
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;

use futures_util::FutureExt;
use futures_util::future::{BoxFuture, Shared, join_all};

use crate::breaker::{Admit, Breaker, Breakers};
use redis::aio::{
    ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection,
};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{
    MultipleNodeRoutingInfo, ResponsePolicy, Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr,
};
use redis::{
    AsyncConnectionConfig, Cmd, ErrorKind, FromRedisValue, Pipeline, RedisError, RedisFuture,
    RedisResult, Script, ServerErrorKind, Value,
};
use tokio::sync::OnceCell;

use crate::error::describe_value;
use crate::keys::key_slot;
use crate::{ConnectionKind, Error, RedisConfig};

/// Reconnection backoff of the multiplexed connection: short enough that a
/// restarted server is used again within about half a second.
const RECONNECT_MIN_DELAY: Duration = Duration::from_millis(10);
const RECONNECT_MAX_DELAY: Duration = Duration::from_millis(500);
const RECONNECT_RETRIES: usize = 6;
/// How often the cluster client tries a call again (after a redirect, a lost connection, or
/// `TRYAGAIN`), at most. Its default of 16, with waits of 1.28 s and more between tries, made
/// every `TRYAGAIN` (keys of a call split by a slot's migration) outlast any sensible call
/// timeout. Six tries, with waits of 1 ms up to an eighth of the timeout each (see
/// [`cluster_retry_wait`]), ride out a split of a few milliseconds (the resharding tool moves a
/// slot's keys some at a time) and usually give up in about a quarter of the timeout, leaving
/// time to send a refused batch's checks one by one. Shorter waits fit more tries in a call,
/// and each try at a dead master's slot makes the client refresh its slot map, which holds up
/// calls to every node: with waits up to a 32nd of the timeout, 8% of the calls to the masters
/// that stayed up failed during a failover (`chaos_cluster_failover_leaves_other_masters_keys_alone`).
const CLUSTER_RETRIES: u32 = 6;
/// How often a call loads its script and tries again after `NOSCRIPT`. More
/// than once for a cluster that has just failed over: `SCRIPT LOAD` has no
/// key, so while the client's slot map is stale it can land on another node
/// than the `EVALSHA` (which a `MOVED` redirects).
const NOSCRIPT_ROUNDS: usize = 3;
/// How often the connections to a server that answers `READONLY` are made again, at most.
const LEAVE_DEMOTED_EVERY: Duration = Duration::from_secs(1);
/// Calls timed out with no answer between them after which the multiplexed connection may be
/// taken for dead and made again (see `RedisConn::after_timeout`)...
const SILENT_TIMEOUTS: u32 = 2;
/// ...once it has been silent for this long at least (and two call timeouts).
const SILENT_FOR: Duration = Duration::from_secs(1);
/// The most a call timeout counts toward a silence ([`Silences::timed_out`]).
const LONGEST_CALL_SILENCE: Duration = Duration::from_secs(60);
/// How often, at most, a silent connection is made again: at first...
const REPLACE_SILENT_EVERY: Duration = Duration::from_secs(1);
/// ...then doubling while the silences go on, up to this.
const REPLACE_SILENT_AT_MOST: Duration = Duration::from_secs(30);
/// How often, at most, an answer looks for silences to forget.
const SWEEP_SILENCES_EVERY: Duration = Duration::from_secs(1);
/// A silence that has not grown for this long (no call timed out there, and none was
/// answered: a slot with no calls) is forgotten.
const FORGET_SILENCE_AFTER: Duration = Duration::from_secs(10);

/// One script call for [`RedisConn::pipeline_scripts`].
#[derive(Clone)]
pub struct ScriptCall<'a> {
    /// The script.
    pub script: &'a Script,
    /// `KEYS`; on a cluster they must all be in one slot.
    pub keys: Vec<Vec<u8>>,
    /// `ARGV`.
    pub args: Vec<Vec<u8>>,
}

impl<'a> ScriptCall<'a> {
    /// A call of `script` without keys or arguments yet.
    pub fn new(script: &'a Script) -> Self {
        Self {
            script,
            keys: Vec::new(),
            args: Vec::new(),
        }
    }

    /// Appends a key.
    #[must_use]
    pub fn key(mut self, key: impl Into<Vec<u8>>) -> Self {
        self.keys.push(key.into());
        self
    }

    /// Appends an argument.
    #[must_use]
    pub fn arg(mut self, arg: impl Into<Vec<u8>>) -> Self {
        self.args.push(arg.into());
        self
    }
}

impl fmt::Debug for ScriptCall<'_> {
    // Keys and arguments may identify people (phone numbers): counts only.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ScriptCall")
            .field("script", &self.script.get_hash())
            .field("keys", &self.keys.len())
            .field("args", &self.args.len())
            .finish()
    }
}

/// A connection to Redis (a multiplexed connection, a pool, or a cluster
/// client). Cloning is one reference-count increment; clones share everything.
#[derive(Clone)]
pub struct RedisConn {
    inner: Arc<Inner>,
}

struct Inner {
    /// Set once connected: at once by [`RedisConn::connect`], on first use by
    /// [`RedisConn::connect_lazy`].
    backend: OnceCell<Backend>,
    /// For a lazy connection: what to connect to, and the attempt under way.
    lazy: Option<Lazy>,
    kind: ConnectionKind,
    timeout: Duration,
    /// Redacted, for errors and logs.
    addr: String,
    key_prefix: String,
    redis_cell: OnceCell<bool>,
    breakers: Breakers,
    /// When the connections were last closed for a server that answered `READONLY`.
    left_demoted: std::sync::Mutex<Option<Instant>>,
    /// When a pool's idle connections were last dropped after a connection error.
    dropped_idle: std::sync::Mutex<Option<Instant>>,
}

/// What a lazy connection connects to, and its attempt under way or last made.
struct Lazy {
    config: RedisConfig,
    client: Client,
    attempt: std::sync::Mutex<Option<Attempt>>,
}

/// A connection attempt in a task of its own, awaited by every call that needs it.
type Attempt = Shared<BoxFuture<'static, RedisResult<()>>>;

impl Lazy {
    /// The attempt under way; a new one when there is none or the last one failed.
    fn attempt(&self, conn: &RedisConn) -> Attempt {
        let mut slot = self
            .attempt
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(attempt) = &*slot
            && attempt.peek().is_none_or(Result::is_ok)
        {
            return attempt.clone();
        }
        let (conn, config, client) = (conn.clone(), self.config.clone(), self.client.clone());
        let task = tokio::spawn(async move {
            let addr = &conn.inner.addr;
            match open_within(&config, client).await {
                Ok(backend) => {
                    tracing::info!(%addr, "connected to Redis");
                    // Only this attempt runs: the cell is empty.
                    let _ = conn.inner.backend.set(backend);
                    Ok(())
                }
                Err(Opened::Redis(e)) => {
                    tracing::debug!(%addr, error = %e, "cannot connect to Redis yet");
                    Err(e)
                }
                Err(Opened::Config(e)) => Err(io::Error::other(e.to_string()).into()),
            }
        });
        let attempt = async move {
            task.await
                .unwrap_or_else(|e| Err(io::Error::other(e.to_string()).into()))
        }
        .boxed()
        .shared();
        *slot = Some(attempt.clone());
        attempt
    }
}

// One per connection, set once and never moved: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Backend {
    Multiplexed(Multiplexed),
    Pool(bb8::Pool<PoolManager>),
    Cluster(Clustered),
}

/// The one multiplexed connection (redis-rs' `ConnectionManager`, which connects again after a
/// connection error), and what it takes to make a new one when it goes silent without an error.
struct Multiplexed {
    current: ArcSwap<ConnectionManager>,
    client: redis::Client,
    config: ConnectionManagerConfig,
    connect_timeout: Duration,
    /// Where it was made: a new one is made there too (its I/O task runs there).
    runtime: Option<tokio::runtime::Handle>,
    silences: Silences,
}

impl Multiplexed {
    /// The connection for one call.
    #[inline]
    fn get(&self) -> ConnectionManager {
        ConnectionManager::clone(&self.current.load())
    }
}

/// The cluster client's connection (to every master, connecting again after a connection
/// error or a slot refresh), and what it takes to make a new one when the connection to a
/// node goes silent without an error.
struct Clustered {
    current: ArcSwap<ClusterConnection>,
    client: redis::cluster::ClusterClient,
    connect_timeout: Duration,
    /// Where it was made: a new one is made there too (its tasks run there).
    runtime: Option<tokio::runtime::Handle>,
    /// By slot: the calls to one node may time out while the others answer.
    silences: Silences,
}

impl Clustered {
    /// The connection for one call.
    #[inline]
    fn get(&self) -> ClusterConnection {
        ClusterConnection::clone(&self.current.load())
    }
}

/// Calls timing out with no answer between them (see `RedisConn::after_timeout`): on a
/// cluster, by slot (the calls of a slot go to one node); otherwise one entry, `None`.
#[derive(Default)]
struct Silences {
    /// Whether a call timed out since the last answer (read with every answer).
    any: AtomicBool,
    state: std::sync::Mutex<SilenceState>,
}

#[derive(Default)]
struct SilenceState {
    /// The calls timing out with no answer between them, by slot.
    silent: HashMap<Option<u16>, Silence>,
    /// When the connection was last made again (or tried) for going silent.
    replaced: Option<Instant>,
    /// Connections made again (or tried) since the last time nothing was silent: each one
    /// doubles the wait before the next ([`REPLACE_SILENT_EVERY`] up to
    /// [`REPLACE_SILENT_AT_MOST`]), for a server or node hung for good (a master powered off,
    /// until the cluster fails it over), which a new connection does not help.
    replacements: u32,
    /// When the silences that stopped growing were last forgotten.
    swept: Option<Instant>,
}

/// Calls timing out with no answer between them.
#[derive(Clone, Copy)]
struct Silence {
    /// When the first of them timed out.
    since: Instant,
    /// When the last of them did.
    last: Instant,
    /// How many did.
    timeouts: u32,
}

impl Silences {
    fn state(&self) -> std::sync::MutexGuard<'_, SilenceState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A call to `slot` was answered: it is not silent. Silences that have not grown for
    /// [`FORGET_SILENCE_AFTER`] (a slot timed out once, then saw no call) are forgotten too.
    #[inline]
    fn answered(&self, slot: Option<u16>) {
        if !self.any.load(Ordering::Relaxed) {
            return;
        }
        let mut state = self.state();
        state.silent.remove(&slot);
        let now = Instant::now();
        if state
            .swept
            .is_none_or(|at| now.duration_since(at) >= SWEEP_SILENCES_EVERY)
        {
            state.swept = Some(now);
            state
                .silent
                .retain(|_, s| now.duration_since(s.last) < FORGET_SILENCE_AFTER);
        }
        if state.silent.is_empty() {
            state.replacements = 0;
            self.any.store(false, Ordering::Relaxed);
        }
    }

    /// Forgets every silence: a new connection is up.
    fn end(&self) {
        let mut state = self.state();
        state.silent.clear();
        self.any.store(false, Ordering::Relaxed);
    }

    /// A call to `slot`, given `timeout`, timed out: how long nothing was answered there, when
    /// that is long enough for the connection to be made again now (it is then taken as made
    /// again): [`SILENT_TIMEOUTS`] calls at least, for [`SILENT_FOR`] and two call timeouts
    /// at least, and not since [`REPLACE_SILENT_EVERY`] (doubled with each replacement while
    /// silences go on).
    fn timed_out(&self, slot: Option<u16>, timeout: Duration) -> Option<Duration> {
        let now = Instant::now();
        let mut state = self.state();
        // Set under the lock: an answer clearing it meanwhile would hide this silence.
        self.any.store(true, Ordering::Relaxed);
        let fresh = Silence {
            since: now,
            last: now,
            timeouts: 0,
        };
        let silence = state.silent.entry(slot).or_insert(fresh);
        // A silence that stopped growing long ago (no call since) starts again.
        if now.duration_since(silence.last) >= FORGET_SILENCE_AFTER {
            *silence = fresh;
        }
        silence.timeouts = silence.timeouts.saturating_add(1);
        silence.last = now;
        // The first call that timed out was sent a call timeout before it timed out: nothing
        // has been answered since. A call timeout of a minute or more (for ever) is not what
        // timed it out, but the operating system (a connection's user timeout, a reconnection's
        // connect timeout): counted as a minute.
        let timeout = timeout.min(LONGEST_CALL_SILENCE);
        let silent_for = now.duration_since(silence.since).saturating_add(timeout);
        let timeouts = silence.timeouts;
        // Replacements long ago belong to another silence: the wait starts short again.
        if state
            .replaced
            .is_some_and(|at| now.duration_since(at) >= REPLACE_SILENT_AT_MOST * 2)
        {
            state.replacements = 0;
        }
        let replacements = state.replacements;
        let wait = REPLACE_SILENT_EVERY
            .saturating_mul(1 << replacements.min(8))
            .min(REPLACE_SILENT_AT_MOST);
        if timeouts < SILENT_TIMEOUTS
            || silent_for < SILENT_FOR.max(timeout.saturating_mul(2))
            || state
                .replaced
                .is_some_and(|at| now.duration_since(at) < wait)
        {
            return None;
        }
        state.replaced = Some(now);
        state.replacements = replacements.saturating_add(1);
        Some(silent_for)
    }
}

fn is_ask(e: &RedisError) -> bool {
    e.kind() == ErrorKind::Server(ServerErrorKind::Ask)
}

fn is_redirect(e: &RedisError) -> bool {
    matches!(
        e.kind(),
        ErrorKind::Server(ServerErrorKind::Ask | ServerErrorKind::Moved)
    )
}

/// `cmd` sent on a cluster as `routing` says (by its key when `None`).
async fn send_routed(
    cluster: &mut ClusterConnection,
    cmd: &Cmd,
    routing: Option<RoutingInfo>,
) -> RedisResult<Value> {
    match routing {
        None => cluster.req_packed_command(cmd).await,
        Some(routing) => cluster.route_command(cmd.clone(), routing).await,
    }
}

/// A cluster call's outcome once the cluster client has given up following redirects: an `ASK`
/// is followed here ([`ask`]). A migrating slot's key that the client keeps failing to ask
/// about (see [`ask`]) goes back and forth between `ASK` from the source and `MOVED` back from
/// the target, and the client may give up on either: after a `MOVED`, the call is sent once
/// more as it was (a redirect means it did not run), to meet the `ASK` again.
async fn after_redirects(
    cluster: &mut ClusterConnection,
    cmd: &Cmd,
    routing: Option<RoutingInfo>,
    sent: RedisResult<Value>,
) -> RedisResult<Value> {
    let sent = match sent {
        Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::Moved) => {
            tracing::debug!(error = %e, "sending a call again after MOVED");
            send_routed(cluster, cmd, routing).await
        }
        sent => sent,
    };
    match sent {
        Err(e) if is_ask(&e) => ask(cluster, cmd, e).await,
        sent => sent,
    }
}

/// Sends `cmd` where the `ASK` redirect `redirect` points, behind `ASKING`, in one pipeline.
///
/// The cluster client follows an `ASK` itself, but sends its `ASKING` as a call of its own and
/// `cmd` once that is answered: a call of another task on the same connection to that node can
/// come between them and use up the permission `ASKING` gives (it is good for one command), and
/// `cmd` is then redirected back (`MOVED`). With a few checks of keys of a migrating slot at
/// once, every try could lose that race, and the call failed with `ASK` after all its tries.
/// Nothing else can come between the two commands of a pipeline. An `ASK` means the try that
/// met it did not run the command (an earlier try that lost its connection mid-call might
/// have, as with any of the cluster client's own retries).
async fn ask(
    cluster: &mut ClusterConnection,
    cmd: &Cmd,
    redirect: RedisError,
) -> RedisResult<Value> {
    let node = redirect.redirect_node().and_then(|(addr, _slot)| {
        let (host, port) = addr.rsplit_once(':')?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return None;
        }
        Some((host.to_owned(), port.parse::<u16>().ok()?))
    });
    let Some((host, port)) = node else {
        return Err(redirect);
    };
    tracing::debug!(%host, port, "following an ASK redirect");
    let mut pipe = redis::pipe();
    pipe.cmd("ASKING").add_command(cmd.clone());
    let mut values = cluster
        .route_pipeline(pipe, 1, 1, SingleNodeRoutingInfo::ByAddress { host, port })
        .await?;
    match (values.pop(), values.is_empty()) {
        (Some(value), true) => Ok(value),
        _ => Err(RedisError::from((
            ErrorKind::Client,
            "a redirected call answered with the wrong number of replies",
        ))),
    }
}

/// Where a command goes on a cluster (ignored on a single node).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Target {
    /// redis-rs' routing for the command (by its key).
    Default,
    /// Any master: scripts without keys may write.
    AnyMaster,
    /// The master serving this slot.
    Slot(u16),
    /// Every master (loading a script for keyless calls).
    AllMasters,
}

impl Target {
    fn routing(self) -> Option<RoutingInfo> {
        match self {
            Self::Default => None,
            Self::AnyMaster => Some(RoutingInfo::SingleNode(
                SingleNodeRoutingInfo::RandomPrimary,
            )),
            Self::Slot(slot) => Some(RoutingInfo::SingleNode(
                SingleNodeRoutingInfo::SpecificNode(Route::new(slot, SlotAddr::Master)),
            )),
            Self::AllMasters => Some(RoutingInfo::MultiNode((
                MultipleNodeRoutingInfo::AllMasters,
                Some(ResponsePolicy::AllSucceeded),
            ))),
        }
    }

    /// Where to load a script after this target answered `NOSCRIPT` (`round`: how many
    /// loads were made before). A slot's master first; then every master: while a slot
    /// migrates, a key its master no longer holds is asked about on the importing node
    /// (`ASK`), and that is the node whose cache lacks the script.
    fn for_load(self, round: usize) -> Self {
        match self {
            Self::AnyMaster => Self::AllMasters,
            Self::Slot(_) if round > 0 => Self::AllMasters,
            other => other,
        }
    }
}

impl RedisConn {
    /// Connects as `config` says, within its connect timeout.
    ///
    /// # Errors
    /// [`Error::Config`] for an invalid configuration, [`Error::Connect`]
    /// (naming the redacted address) when the server cannot be reached,
    /// refuses the credentials or does not answer in time.
    pub async fn connect(config: &RedisConfig) -> Result<Self, Error> {
        config.validate()?;
        let addr = config.redacted_url();
        tracing::debug!(%addr, kind = %config.kind(), "connecting to Redis");
        let backend = match async { open_within(config, client(config)?).await }.await {
            Ok(backend) => backend,
            Err(Opened::Config(e)) => return Err(e),
            Err(Opened::Redis(source)) => {
                tracing::debug!(%addr, error = %source, "cannot connect to Redis");
                return Err(Error::Connect { addr, source });
            }
        };
        tracing::debug!(%addr, kind = %config.kind(), "connected to Redis");
        Ok(Self::with_backend(
            config,
            OnceCell::new_with(Some(backend)),
            None,
        ))
    }

    /// A connection made on first use, returned at once: a service can start while Redis is
    /// down (a replica restarted during an outage). Until Redis can be reached, calls fail as
    /// unavailable ([`Error::Connect`], [`Error::Timeout`] while an attempt is under way, or
    /// [`Error::Unavailable`] while the circuit breaker is open), so a layer's failure policy
    /// decides them. Each attempt runs in a task of its own within
    /// the connect timeout, whatever the deadline of the call that started it; calls meanwhile
    /// wait for it within their own. A failed attempt is followed by a new one at the next
    /// call (behind the circuit breaker, once per open period while Redis stays down). Once
    /// connected, it behaves as [`RedisConn::connect`]'s.
    ///
    /// # Errors
    /// [`Error::Config`] for an invalid configuration (a TLS certificate that does not parse
    /// included), at once.
    pub fn connect_lazy(config: &RedisConfig) -> Result<Self, Error> {
        config.validate()?;
        // Any error but reaching the server shows now.
        let client = client(config).map_err(|e| match e {
            Opened::Config(e) => e,
            Opened::Redis(e) => Error::Config(e.to_string()),
        })?;
        Ok(Self::with_backend(
            config,
            OnceCell::new(),
            Some(Lazy {
                config: config.clone(),
                client,
                attempt: std::sync::Mutex::new(None),
            }),
        ))
    }

    fn with_backend(config: &RedisConfig, backend: OnceCell<Backend>, lazy: Option<Lazy>) -> Self {
        let kind = config.kind();
        Self {
            inner: Arc::new(Inner {
                backend,
                lazy,
                kind,
                timeout: config.get_timeout(),
                addr: config.redacted_url(),
                key_prefix: config.get_key_prefix().to_owned(),
                redis_cell: OnceCell::new(),
                breakers: Breakers::new(config.get_breaker(), kind == ConnectionKind::Cluster),
                left_demoted: std::sync::Mutex::new(None),
                dropped_idle: std::sync::Mutex::new(None),
            }),
        }
    }

    /// The connection; for a lazy one not made yet, once the attempt under way (started now if
    /// none is) has made it.
    async fn backend(&self) -> RedisResult<&Backend> {
        if let Some(backend) = self.inner.backend.get() {
            return Ok(backend);
        }
        let no_connection = || io::Error::other("no connection to Redis").into();
        // An eager connection is made before it is returned: always `Some` here.
        let Some(lazy) = &self.inner.lazy else {
            return Err(no_connection());
        };
        lazy.attempt(self).await?;
        self.inner.backend.get().ok_or_else(no_connection)
    }

    /// How this connection talks to Redis.
    pub fn kind(&self) -> ConnectionKind {
        self.inner.kind
    }

    /// The per-call timeout.
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// The configured key prefix.
    pub fn key_prefix(&self) -> &str {
        &self.inner.key_prefix
    }

    /// The server URL(s), passwords replaced by `***`.
    pub fn redacted_url(&self) -> &str {
        &self.inner.addr
    }

    /// Runs `script` with `EVALSHA`; on `NOSCRIPT` loads it on the node that
    /// answered and runs it once more. On a cluster the call goes to the
    /// master of the first key's slot (a random master without keys).
    ///
    /// # Errors
    /// [`Error::Timeout`]; [`Error::Connect`]; [`Error::CrossSlot`] when the
    /// keys are in different cluster slots; [`Error::Migrating`] when a slot's
    /// migration split them between two nodes; [`Error::WrongType`] and
    /// [`Error::Corrupted`] for `WRONGTYPE`, `FLOODGATE_WRONGTYPE <i>` and
    /// `FLOODGATE_CORRUPT <i> <detail>` replies (`i` 0-based into `keys`);
    /// [`Error::Script`] for any other error the script raised.
    pub async fn invoke_script(
        &self,
        script: &Script,
        keys: &[&[u8]],
        args: &[&[u8]],
    ) -> Result<Value, Error> {
        self.invoke_script_within(script, keys, args, self.inner.timeout)
            .await
    }

    /// [`RedisConn::invoke_script`] bounded by `timeout` instead of the configured per-call
    /// timeout (a caller with a deadline of its own, such as a batched check). The timeout of
    /// a call given less than a quarter of the configured one does not count towards the
    /// circuit breaker (unless the call is its probe).
    ///
    /// # Errors
    /// As [`RedisConn::invoke_script`].
    pub async fn invoke_script_within(
        &self,
        script: &Script,
        keys: &[&[u8]],
        args: &[&[u8]],
        timeout: Duration,
    ) -> Result<Value, Error> {
        self.invoke_check_within(script, keys, args, timeout, |_| None)
            .await
    }

    /// [`RedisConn::invoke_script_within`] for a script whose reply may carry a refusal to
    /// serve (`OOM`, `READONLY`...) raised inside it for part of its work, the rest answered:
    /// `refused` tells, and the circuit breaker counts such a reply as a failure, not a
    /// success that would reset it.
    pub(crate) async fn invoke_check_within(
        &self,
        script: &Script,
        keys: &[&[u8]],
        args: &[&[u8]],
        timeout: Duration,
        refused: fn(&Value) -> Option<&'static str>,
    ) -> Result<Value, Error> {
        let target = self.script_target(keys)?;
        let cmd = evalsha(script, keys, args);
        let slot = match target {
            Target::Slot(slot) => Some(slot),
            _ => None,
        };
        self.bounded_for("invoke_script", slot, timeout, refused, async {
            let mut result = self.send(&cmd, target).await;
            for round in 0..NOSCRIPT_ROUNDS {
                match &result {
                    Err(e) if is_noscript(e) => {}
                    _ => break,
                }
                tracing::debug!(sha = script.get_hash(), "NOSCRIPT: loading the script");
                result = match self.load_script(script, target.for_load(round)).await {
                    Ok(()) => self.send(&cmd, target).await,
                    Err(e) => Err(e),
                };
            }
            result.map_err(|e| Error::from_script(e, keys, &self.inner.addr))
        })
        .await
    }

    /// Runs a plain command (on a cluster, routed by its key) and converts
    /// the reply to `T`.
    ///
    /// # Errors
    /// [`Error::Timeout`], [`Error::Connect`], [`Error::WrongType`] (naming
    /// the command's first argument as the key), [`Error::UnexpectedReply`]
    /// when the reply does not convert to `T`, [`Error::Redis`].
    pub async fn query<T: FromRedisValue>(&self, cmd: Cmd) -> Result<T, Error> {
        let slot = first_arg(&cmd).map(key_slot);
        self.bounded_for("query", slot, self.inner.timeout, |_| None, async {
            let value = self
                .send(&cmd, Target::Default)
                .await
                .map_err(|e| Error::from_command(e, first_arg(&cmd), &self.inner.addr))?;
            T::from_redis_value(value).map_err(|e| Error::UnexpectedReply {
                expected: std::any::type_name::<T>(),
                got: e.to_string(),
            })
        })
        .await
    }

    /// Runs several scripts with one round trip: one pipeline on a single
    /// node; on a cluster, the calls of each slot one after another (a
    /// pipeline redirected as a whole would run some calls twice), the slots
    /// at once. The calls of one slot run in their order. Each call gets its own result, so one failing script does not fail
    /// the others. Calls that met `NOSCRIPT` are run again, after the
    /// others of their pipeline, once the script is loaded.
    ///
    /// # Errors
    /// The outer `Err` only when no result came back at all: the whole batch
    /// timed out, or every pipeline failed (e.g. the connection is down).
    /// Otherwise errors are per call, as [`RedisConn::invoke_script`] maps them.
    pub async fn pipeline_scripts(
        &self,
        calls: Vec<ScriptCall<'_>>,
    ) -> Result<Vec<Result<Value, Error>>, Error> {
        let mut results: Vec<Option<Result<Value, Error>>> = Vec::with_capacity(calls.len());
        let mut groups: HashMap<Target, Vec<usize>> = HashMap::new();
        for (i, call) in calls.iter().enumerate() {
            match self.script_target(&call.keys) {
                Ok(target) => {
                    groups.entry(target).or_default().push(i);
                    results.push(None);
                }
                Err(e) => results.push(Some(Err(e))),
            }
        }
        if groups.is_empty() {
            return Ok(results.into_iter().flatten().collect());
        }
        let calls = &calls;
        let outcomes = self
            .bounded("pipeline_scripts", async {
                Ok(join_all(
                    groups
                        .into_iter()
                        .map(|(target, indices)| self.pipeline_group(calls, target, indices)),
                )
                .await)
            })
            .await?;
        let group_count = outcomes.len();
        let mut failed = Vec::new();
        for (indices, outcome) in outcomes {
            match outcome {
                Ok(values) => {
                    for (i, value) in values {
                        results[i] = Some(value);
                    }
                }
                Err(e) => failed.push((indices, e)),
            }
        }
        if failed.len() == group_count {
            if let Some((_, e)) = failed.into_iter().next() {
                return Err(Error::from_redis(e, &self.inner.addr));
            }
        } else {
            for (indices, e) in failed {
                for i in indices {
                    results[i] = Some(Err(Error::from_redis(e.clone(), &self.inner.addr)));
                }
            }
        }
        Ok(results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(Error::UnexpectedReply {
                        expected: "one reply per pipelined call",
                        got: "no reply".to_owned(),
                    })
                })
            })
            .collect())
    }

    /// `PING`.
    ///
    /// # Errors
    /// [`Error::Timeout`], [`Error::Connect`], [`Error::UnexpectedReply`].
    pub async fn ping(&self) -> Result<(), Error> {
        self.bounded("ping", async {
            let value = self
                .send(&redis::cmd("PING"), Target::AnyMaster)
                .await
                .map_err(|e| Error::from_redis(e, &self.inner.addr))?;
            match &value {
                Value::SimpleString(s) if s == "PONG" => Ok(()),
                Value::BulkString(b) if b == b"PONG" => Ok(()),
                other => Err(Error::UnexpectedReply {
                    expected: "PONG",
                    got: describe_value(other),
                }),
            }
        })
        .await
    }

    /// The server's clock (`TIME`), in microseconds since the Unix epoch.
    ///
    /// # Errors
    /// [`Error::Timeout`], [`Error::Connect`], [`Error::UnexpectedReply`].
    pub async fn server_time(&self) -> Result<u64, Error> {
        self.bounded("server_time", async {
            let value = self
                .send(&redis::cmd("TIME"), Target::Default)
                .await
                .map_err(|e| Error::from_redis(e, &self.inner.addr))?;
            parse_time(&value).ok_or_else(|| Error::UnexpectedReply {
                expected: "TIME's [seconds, microseconds]",
                got: describe_value(&value),
            })
        })
        .await
    }

    /// True if the server knows the command `name` (`COMMAND INFO`), e.g.
    /// `CL.THROTTLE` from the redis-cell module.
    ///
    /// # Errors
    /// [`Error::Timeout`], [`Error::Connect`], [`Error::UnexpectedReply`].
    pub async fn has_command(&self, name: &str) -> Result<bool, Error> {
        self.bounded("has_command", async {
            let mut cmd = redis::cmd("COMMAND");
            cmd.arg("INFO").arg(name);
            let value = self
                .send(&cmd, Target::Default)
                .await
                .map_err(|e| Error::from_redis(e, &self.inner.addr))?;
            match &value {
                Value::Array(items) => match items.first() {
                    Some(Value::Nil) | None => Ok(false),
                    Some(_) => Ok(true),
                },
                other => Err(Error::UnexpectedReply {
                    expected: "COMMAND INFO's array",
                    got: describe_value(other),
                }),
            }
        })
        .await
    }

    /// True if the server has the redis-cell module (`CL.THROTTLE`). Asked
    /// once per connection (and its clones); an error is not remembered.
    ///
    /// # Errors
    /// As [`RedisConn::has_command`].
    pub async fn has_redis_cell(&self) -> Result<bool, Error> {
        self.inner
            .redis_cell
            .get_or_try_init(|| self.has_command("CL.THROTTLE"))
            .await
            .copied()
    }

    /// Runs `fut` within the call timeout.
    /// Runs `fut` within the per-call timeout, behind the circuit breaker.
    async fn bounded<T>(
        &self,
        op: &'static str,
        fut: impl Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        self.bounded_for(op, None, self.inner.timeout, |_| None, fut)
            .await
    }

    /// Runs `fut` within `after`, behind the circuit breaker of `slot` (see `Breakers`). A
    /// timeout, a connection error, a refusal to serve or an answer `refused` says is one
    /// counts as a failure; but a timeout of a call given less than a [`SHORT_BUDGET`] share of
    /// the configured timeout (a batched check that waited for the pipeline) counts for
    /// nothing, unless the call was the breaker's probe: a healthy server may well take that
    /// long, and such calls, sent one after the other, would open the breaker on it.
    async fn bounded_for<T>(
        &self,
        op: &'static str,
        slot: Option<u16>,
        after: Duration,
        refused: impl FnOnce(&T) -> Option<&'static str>,
        fut: impl Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        let breaker = self.inner.breakers.get(slot);
        let admit = breaker.admit();
        let probe = admit == Admit::Probe;
        if let Admit::Reject(retry_in) = admit {
            return Err(Error::Unavailable {
                addr: self.inner.addr.clone(),
                retry_in,
            });
        }
        // Dropped before the outcome (the caller was cancelled): a probe is handed back.
        let pending = Pending {
            breaker,
            admit: Some(admit),
        };
        let result = tokio::time::timeout(after, fut)
            .await
            .unwrap_or_else(|_| Err(Error::Timeout { after, op }));
        let (unreachable, demoted) = match &result {
            Ok(answer) => {
                self.answered(slot);
                let code = refused(answer);
                (code.is_some(), code == Some("READONLY"))
            }
            // No outcome (`pending` is dropped). A probe's timeout still counts: the breaker
            // must back off from a server that does not answer its probe, short or not.
            Err(e) if e.is_timeout() && !probe && after < self.inner.timeout / SHORT_BUDGET => {
                return result;
            }
            Err(e) => {
                // Not refused by the breaker nor answered by a server that does not serve: a
                // connection that failed.
                if e.is_connection()
                    && !matches!(e, Error::Unavailable { .. } | Error::NotServing { .. })
                {
                    self.after_connection_error();
                }
                if e.is_timeout() {
                    self.after_timeout(slot);
                }
                (e.is_timeout() || e.is_connection(), e.is_demoted())
            }
        };
        if demoted {
            self.leave_demoted();
        }
        if pending.record(!unreachable) {
            tracing::warn!(addr = %self.inner.addr, "Redis unreachable: failing fast for a while (circuit breaker open)");
        }
        result
    }

    /// The server answered `READONLY`: a failover demoted it to a replica, and it keeps the
    /// connections it had as a primary. Behind an endpoint that now leads to the new primary
    /// (a managed Redis' DNS name, a proxy), only new connections reach that one: the
    /// connections are closed, at most once a second, and made again on their next use (the
    /// multiplexed connection's by redis-rs once the server has closed it on `QUIT`; the
    /// pool's idle ones are dropped and those in use are refused again, then dropped at the
    /// next round). A cluster follows its failovers by itself.
    fn leave_demoted(&self) {
        let Some(backend) = self.inner.backend.get() else {
            return;
        };
        if matches!(backend, Backend::Cluster(_)) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if !due(&self.inner.left_demoted, LEAVE_DEMOTED_EVERY) {
            return;
        }
        tracing::warn!(
            addr = %self.inner.addr,
            "Redis refuses writes (READONLY): a failover demoted this server; connecting again"
        );
        let timeout = self.inner.timeout;
        match backend {
            Backend::Multiplexed(multiplexed) => {
                let mut manager = multiplexed.get();
                runtime.spawn(async move {
                    // The server closes the connection after its reply; the next command finds
                    // it closed, and the manager connects again.
                    let (quit, ping) = (redis::cmd("QUIT"), redis::cmd("PING"));
                    let _ = tokio::time::timeout(timeout, quit.exec_async(&mut manager)).await;
                    let _ = tokio::time::timeout(timeout, ping.exec_async(&mut manager)).await;
                });
            }
            Backend::Pool(pool) => drop_idle(&runtime, pool),
            Backend::Cluster(_) => {}
        }
    }

    /// A pooled connection failed with a connection error: the server may have restarted, and
    /// every idle connection is dead. Each would fail one call (and with the circuit breaker
    /// open after a few, one probe per open period): the idle ones are dropped at once, at most
    /// every [`DROP_IDLE_EVERY`], and bb8 makes new ones.
    fn after_connection_error(&self) {
        let Some(Backend::Pool(pool)) = self.inner.backend.get() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if !due(&self.inner.dropped_idle, DROP_IDLE_EVERY) {
            return;
        }
        tracing::debug!(addr = %self.inner.addr, "a pooled connection failed: dropping the idle ones");
        drop_idle(&runtime, pool);
    }

    /// A call to `slot` was answered: the connection is not silent.
    #[inline]
    fn answered(&self, slot: Option<u16>) {
        match self.inner.backend.get() {
            Some(Backend::Multiplexed(m)) => m.silences.answered(None),
            Some(Backend::Cluster(c)) => c.silences.answered(slot),
            _ => {}
        }
    }

    /// A call to `slot` timed out (one given its whole budget, or the breaker's probe). Calls
    /// timing out with no answer between them may be stuck on a connection gone silent without
    /// an error (a proxy or load balancer lost its backend, a NAT its entry: the kernel still
    /// acknowledges what is sent, so neither redis-rs nor `TCP_USER_TIMEOUT` ever sees it
    /// fail). Once [`SILENT_TIMEOUTS`] have, and nothing was answered for [`SILENT_FOR`] and two
    /// call timeouts at least, a new connection is made, at most every
    /// [`REPLACE_SILENT_EVERY`] (the wait doubling with each one while silences go on, up to
    /// [`REPLACE_SILENT_AT_MOST`]), within the connect timeout, and takes the old one's place
    /// once it is up; calls under way finish (or time out) on the old one.
    ///
    /// On a cluster the silence is a slot's (the calls to one node time out while the other
    /// nodes answer), and the whole cluster connection is made again: the cluster client keeps
    /// a connection to a node until it fails with an error, which a silent one never does.
    ///
    /// A server (or cluster node) that is only slow, or hung as a whole, costs a connection
    /// attempt after a second, two, four... then every 30 s (one that does not come up leaves
    /// the old connection in place). When a slow one answers
    /// again, commands sent on the new connection may have run before those still queued on
    /// the old one: a lock released after its acquisition timed out may then be taken after
    /// all, and held until its lease ends, as when Redis cannot be reached to release it.
    ///
    /// A pool drops a connection whose call timed out by itself.
    fn after_timeout(&self, slot: Option<u16>) {
        match self.inner.backend.get() {
            Some(Backend::Multiplexed(m)) => {
                if let Some(runtime) = self.silent_too_long(&m.silences, &m.runtime, None) {
                    let connect =
                        ConnectionManager::new_with_config(m.client.clone(), m.config.clone());
                    self.replace(runtime, m.connect_timeout, connect, |b| match b {
                        Backend::Multiplexed(m) => Some((&m.current, &m.silences)),
                        _ => None,
                    });
                }
            }
            Some(Backend::Cluster(c)) => {
                if let Some(runtime) = self.silent_too_long(&c.silences, &c.runtime, slot) {
                    let client = c.client.clone();
                    let connect = async move { client.get_async_connection().await };
                    self.replace(runtime, c.connect_timeout, connect, |b| match b {
                        Backend::Cluster(c) => Some((&c.current, &c.silences)),
                        _ => None,
                    });
                }
            }
            _ => {}
        }
    }

    /// Counts a timeout of a call to `slot` in `silences`; when the connection is to be made
    /// again now, the runtime to make it on (logged).
    fn silent_too_long(
        &self,
        silences: &Silences,
        runtime: &Option<tokio::runtime::Handle>,
        slot: Option<u16>,
    ) -> Option<tokio::runtime::Handle> {
        let runtime = runtime
            .clone()
            .or_else(|| tokio::runtime::Handle::try_current().ok())?;
        let silent_for = silences.timed_out(slot, self.inner.timeout)?;
        match slot {
            Some(slot) => tracing::warn!(
                addr = %self.inner.addr,
                "no answer from the node of slot {slot} for {silent_for:?}: connecting again"
            ),
            None => tracing::warn!(
                addr = %self.inner.addr,
                "no answer on the Redis connection for {silent_for:?}: connecting again"
            ),
        }
        Some(runtime)
    }

    /// Makes the connection again on `runtime` with `connect`, within `within`: once it is up,
    /// it takes the place of the one `part` finds in the backend, and the silences end. The
    /// attempt does not keep the connection alive: dropped meanwhile, it needs no new one.
    fn replace<C: Send + Sync + 'static>(
        &self,
        runtime: tokio::runtime::Handle,
        within: Duration,
        connect: impl Future<Output = RedisResult<C>> + Send + 'static,
        part: ReplaceablePart<C>,
    ) {
        let inner = Arc::downgrade(&self.inner);
        runtime.spawn(async move {
            let made = tokio::time::timeout(within, connect).await;
            if let Some(inner) = inner.upgrade()
                && let Some((current, silences)) = inner.backend.get().and_then(part)
                && let Some(new) = made_again(&inner.addr, made)
            {
                current.store(Arc::new(new));
                silences.end();
            }
        });
    }

    /// Whether the circuit breaker is open or probing: Redis was unreachable just now.
    pub fn is_circuit_open(&self) -> bool {
        self.inner.breakers.any_open()
    }

    /// Where a script with these keys runs; on a cluster all keys must share a slot.
    fn script_target<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Target, Error> {
        if self.inner.kind != ConnectionKind::Cluster {
            return Ok(Target::Default);
        }
        let Some(first) = keys.first() else {
            return Ok(Target::AnyMaster);
        };
        let slot = key_slot(first.as_ref());
        if let Some(other) = keys.iter().find(|k| key_slot(k.as_ref()) != slot) {
            return Err(Error::CrossSlot {
                message: format!(
                    "key {} is in slot {slot} but key {} is in slot {}",
                    crate::display_key(first.as_ref()),
                    crate::display_key(other.as_ref()),
                    key_slot(other.as_ref())
                ),
            });
        }
        Ok(Target::Slot(slot))
    }

    /// Sends one command; an error reply comes back as `Err`.
    async fn send(&self, cmd: &Cmd, target: Target) -> RedisResult<Value> {
        let value = match self.backend().await? {
            Backend::Multiplexed(multiplexed) => multiplexed.get().send_packed_command(cmd).await,
            Backend::Pool(pool) => {
                let mut conn = pool.get().await.map_err(pool_error)?;
                let result = conn.begin().send_packed_command(cmd).await;
                conn.finish_reply(result)
            }
            Backend::Cluster(cluster) => {
                let mut cluster = cluster.get();
                let routing = target.routing();
                let sent = send_routed(&mut cluster, cmd, routing.clone()).await;
                after_redirects(&mut cluster, cmd, routing, sent).await
            }
        }?;
        match value {
            Value::ServerError(e) => Err(e.into()),
            value => Ok(value),
        }
    }

    /// Sends a pipeline of `count` commands; error replies stay in place as
    /// `Value::ServerError`.
    async fn send_pipeline(
        &self,
        pipe: &Pipeline,
        count: usize,
        target: Target,
    ) -> RedisResult<Vec<Value>> {
        match self.backend().await? {
            Backend::Multiplexed(multiplexed) => {
                multiplexed.get().send_packed_commands(pipe, 0, count).await
            }
            Backend::Pool(pool) => {
                let mut conn = pool.get().await.map_err(pool_error)?;
                let result = conn.begin().send_packed_commands(pipe, 0, count).await;
                conn.finish(result)
            }
            Backend::Cluster(cluster) => {
                let route = match target {
                    Target::Slot(slot) => {
                        SingleNodeRoutingInfo::SpecificNode(Route::new(slot, SlotAddr::Master))
                    }
                    _ => SingleNodeRoutingInfo::RandomPrimary,
                };
                let mut cluster = cluster.get();
                let sent = cluster
                    .route_pipeline(pipe.clone(), 0, count, route.clone())
                    .await;
                // A cluster pipeline is of one call (see `pipeline_scripts`).
                match (sent, pipe.cmd_iter().next()) {
                    (Err(e), Some(cmd)) if count == 1 && is_redirect(&e) => {
                        let routing = Some(RoutingInfo::SingleNode(route));
                        after_redirects(&mut cluster, cmd, routing, Err(e))
                            .await
                            .map(|value| vec![value])
                    }
                    (sent, _) => sent,
                }
            }
        }
    }

    /// `SCRIPT LOAD` where `target` says (on a single node: that node).
    async fn load_script(&self, script: &Script, target: Target) -> RedisResult<()> {
        match self.backend().await? {
            Backend::Multiplexed(multiplexed) => script.load_async(&mut multiplexed.get()).await,
            Backend::Pool(pool) => {
                let mut conn = pool.get().await.map_err(pool_error)?;
                let result = script.load_async(conn.begin()).await;
                conn.finish(result)
            }
            Backend::Cluster(cluster) => {
                let mut routed = Routed {
                    cluster: cluster.get(),
                    routing: target.routing(),
                };
                script.load_async(&mut routed).await
            }
        }
        .map(drop)
    }

    /// The calls at `indices`, all going to `target`, in their order: one pipeline; on a
    /// cluster, one call after another. When one call of a pipeline is redirected (its slot
    /// migrating or moved), the cluster client sends the whole pipeline again to the other
    /// node: the calls that had run would run twice (and make keys on a node importing the
    /// slot, which the migration then cannot move there).
    async fn pipeline_group(
        &self,
        calls: &[ScriptCall<'_>],
        target: Target,
        indices: Vec<usize>,
    ) -> (Vec<usize>, RedisResult<Vec<(usize, Result<Value, Error>)>>) {
        if self.inner.kind != ConnectionKind::Cluster {
            let outcome = self.run_group(calls, target, &indices).await;
            return (indices, outcome);
        }
        let mut done = Vec::with_capacity(indices.len());
        for (n, &i) in indices.iter().enumerate() {
            match self.run_group(calls, target, &[i]).await {
                Ok(mut one) => done.append(&mut one),
                Err(e) => {
                    let outcome = self.fail_rest(done, &indices[n..], e);
                    return (indices, outcome);
                }
            }
        }
        (indices, Ok(done))
    }

    /// A group's outcome when the calls at `left` failed with `e` after those in `done` ran:
    /// those that ran keep their results (a caller trying them all again would run them
    /// twice), and the failure is the rest's; with none run, the group failed as a whole.
    fn fail_rest(
        &self,
        mut done: Vec<(usize, Result<Value, Error>)>,
        left: &[usize],
        e: RedisError,
    ) -> RedisResult<Vec<(usize, Result<Value, Error>)>> {
        if done.is_empty() {
            return Err(e);
        }
        for &i in left {
            done.push((i, Err(Error::from_redis(e.clone(), &self.inner.addr))));
        }
        Ok(done)
    }

    async fn run_group(
        &self,
        calls: &[ScriptCall<'_>],
        target: Target,
        indices: &[usize],
    ) -> RedisResult<Vec<(usize, Result<Value, Error>)>> {
        let mut done = Vec::with_capacity(indices.len());
        let mut missing = self.run_pipeline(calls, target, indices, &mut done).await?;
        // Once some calls have run (their results are in `done`), a failure is the failure of
        // the calls left (see `fail_rest`).
        let fail = |done, left: &[usize], e| self.fail_rest(done, left, e);
        for round in 0..NOSCRIPT_ROUNDS {
            if missing.is_empty() {
                break;
            }
            let mut loaded: Vec<&str> = Vec::new();
            for &i in &missing {
                let script = calls[i].script;
                if !loaded.contains(&script.get_hash()) {
                    tracing::debug!(sha = script.get_hash(), "NOSCRIPT: loading the script");
                    if let Err(e) = self.load_script(script, target.for_load(round)).await {
                        return fail(done, &missing, e);
                    }
                    loaded.push(script.get_hash());
                }
            }
            let retry = std::mem::take(&mut missing);
            match self.run_pipeline(calls, target, &retry, &mut done).await {
                Ok(left) => missing = left,
                Err(e) => return fail(done, &retry, e),
            }
        }
        for i in missing {
            let e = RedisError::from((
                ErrorKind::Server(ServerErrorKind::NoScript),
                "script still missing after loading it repeatedly",
            ));
            done.push((i, Err(Error::Redis(e))));
        }
        Ok(done)
    }

    /// Sends the calls at `indices` as one pipeline, pushes their results
    /// to `done`, and returns the indices that met `NOSCRIPT`.
    async fn run_pipeline(
        &self,
        calls: &[ScriptCall<'_>],
        target: Target,
        indices: &[usize],
        done: &mut Vec<(usize, Result<Value, Error>)>,
    ) -> RedisResult<Vec<usize>> {
        let mut pipe = redis::pipe();
        for &i in indices {
            let call = &calls[i];
            pipe.add_command(evalsha(call.script, &call.keys, &call.args));
        }
        let values = self.send_pipeline(&pipe, indices.len(), target).await?;
        if values.len() != indices.len() {
            return Err(RedisError::from((
                ErrorKind::Client,
                "pipeline answered with the wrong number of replies",
                format!("{} replies to {} commands", values.len(), indices.len()),
            )));
        }
        let mut missing = Vec::new();
        for (&i, value) in indices.iter().zip(values) {
            match value {
                Value::ServerError(e) => {
                    let e = RedisError::from(e);
                    if is_noscript(&e) {
                        missing.push(i);
                    } else {
                        done.push((
                            i,
                            Err(Error::from_script(e, &calls[i].keys, &self.inner.addr)),
                        ));
                    }
                }
                value => done.push((i, Ok(value))),
            }
        }
        Ok(missing)
    }
}

impl fmt::Debug for RedisConn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConn")
            .field("addr", &self.inner.addr)
            .field("kind", &self.inner.kind)
            .field("timeout", &self.inner.timeout)
            .field("key_prefix", &self.inner.key_prefix)
            .finish_non_exhaustive()
    }
}

/// Why opening failed.
enum Opened {
    Config(Error),
    Redis(RedisError),
}

impl From<RedisError> for Opened {
    fn from(e: RedisError) -> Self {
        Self::Redis(e)
    }
}

/// [`open`] within the connect timeout.
async fn open_within(config: &RedisConfig, client: Client) -> Result<Backend, Opened> {
    let connect_timeout = config.get_connect_timeout();
    match tokio::time::timeout(connect_timeout, open(config, client)).await {
        Ok(opened) => opened,
        Err(_) => Err(Opened::Redis(timed_out("connecting", connect_timeout))),
    }
}

/// What [`open`] connects with, built without reaching the server.
#[derive(Clone)]
enum Client {
    Cluster(redis::cluster::ClusterClient),
    Single(redis::Client),
}

/// The client for `config`: a configuration that cannot work (no URL, a TLS certificate that
/// does not parse) fails here, before any connection is tried.
fn client(config: &RedisConfig) -> Result<Client, Opened> {
    #[cfg(feature = "tls")]
    if config.is_tls() {
        install_crypto_provider();
    }
    let infos = config.connection_infos().map_err(Opened::Config)?;
    if config.kind() == ConnectionKind::Cluster {
        let (min_wait, max_wait) = cluster_retry_wait(config.get_timeout());
        let builder = ClusterClientBuilder::new(infos)
            .connection_timeout(config.get_connect_timeout())
            .response_timeout(config.get_timeout())
            .retries(CLUSTER_RETRIES)
            .min_retry_wait(min_wait)
            .max_retry_wait(max_wait)
            // The nodes' own connection infos are not used for the connections it makes.
            .tcp_settings(crate::config::tcp_settings());
        #[cfg(feature = "tls")]
        let builder = match config.tls_certificates() {
            Some(certs) => builder.certs(certs),
            None => builder,
        };
        return Ok(Client::Cluster(builder.build()?));
    }
    let Some(info) = infos.into_iter().next() else {
        return Err(Opened::Config(Error::Config(
            "no Redis URL given".to_owned(),
        )));
    };
    #[cfg(feature = "tls")]
    let client = match config.tls_certificates() {
        Some(certs) => redis::Client::build_with_tls(info, certs)?,
        None => redis::Client::open(info)?,
    };
    #[cfg(not(feature = "tls"))]
    let client = redis::Client::open(info)?;
    Ok(Client::Single(client))
}

/// The shortest and the longest wait (ms) of the cluster client between two tries of a call:
/// 1 ms, and an eighth of the call timeout (at least 2 ms). The client draws each wait at
/// random between the two, the longest doubling from 20 ms with each try up to its cap.
fn cluster_retry_wait(timeout: Duration) -> (u64, u64) {
    let part = u64::try_from((timeout / 8).as_millis()).unwrap_or(u64::MAX);
    (1, part.max(2))
}

async fn open(config: &RedisConfig, client: Client) -> Result<Backend, Opened> {
    let connect_timeout = config.get_connect_timeout();
    let client = match client {
        Client::Cluster(client) => {
            let connection = client.get_async_connection().await?;
            return Ok(Backend::Cluster(Clustered {
                current: ArcSwap::from_pointee(connection),
                client,
                connect_timeout,
                runtime: tokio::runtime::Handle::try_current().ok(),
                silences: Silences::default(),
            }));
        }
        Client::Single(client) => client,
    };
    match config.kind() {
        ConnectionKind::Pool { size } => {
            let manager = PoolManager {
                client,
                // The call timeout bounds every request; redis-rs' own would
                // only turn a slow reply into an I/O error.
                config: AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(connect_timeout))
                    .set_response_timeout(None),
            };
            let pool = bb8::Pool::builder()
                .max_size(size)
                .min_idle(Some(size))
                // Broken connections are flagged by `PooledConn::run`: no PING per call.
                .test_on_check_out(false)
                // Longer than the call timeout, which is what callers see; it
                // also caps bb8's reconnect backoff at half of it, so a
                // restarted server is used again quickly.
                .connection_timeout(config.get_timeout().saturating_mul(2))
                .build_unchecked(manager);
            // One connection now, so that an unreachable server is an error here.
            let mut first = pool.dedicated_connection().await?;
            redis::cmd("PING").exec_async(&mut first.conn).await?;
            // The pool may already be full of its own connections.
            let _ = pool.add(first);
            Ok(Backend::Pool(pool))
        }
        _ => {
            let manager_config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(connect_timeout))
                .set_response_timeout(None)
                .set_min_delay(RECONNECT_MIN_DELAY)
                .set_max_delay(RECONNECT_MAX_DELAY)
                .set_number_of_retries(RECONNECT_RETRIES);
            let manager =
                ConnectionManager::new_with_config(client.clone(), manager_config.clone()).await?;
            Ok(Backend::Multiplexed(Multiplexed {
                current: ArcSwap::from_pointee(manager),
                client,
                config: manager_config,
                connect_timeout,
                runtime: tokio::runtime::Handle::try_current().ok(),
                silences: Silences::default(),
            }))
        }
    }
}

/// Installs rustls' ring provider as the process default unless the
/// application installed one already (then that one is used).
#[cfg(feature = "tls")]
fn install_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// Whether `every` has passed since `last` (then it is now), for work done at most that often.
fn due(last: &std::sync::Mutex<Option<Instant>>, every: Duration) -> bool {
    let mut last = last
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if last.is_some_and(|t| t.elapsed() < every) {
        return false;
    }
    *last = Some(Instant::now());
    true
}

/// Where a backend keeps a connection made again for going silent, and its silences.
type ReplaceablePart<C> = fn(&Backend) -> Option<(&ArcSwap<C>, &Silences)>;

/// The connection made again for going silent (see `RedisConn::after_timeout`), or `None`
/// (logged) when it did not come up within the connect timeout.
fn made_again<T>(
    addr: &str,
    made: Result<RedisResult<T>, tokio::time::error::Elapsed>,
) -> Option<T> {
    match made {
        Ok(Ok(new)) => {
            tracing::info!(addr, "connected to Redis again");
            Some(new)
        }
        Ok(Err(e)) => {
            tracing::debug!(addr, error = %e, "cannot connect to Redis again yet");
            None
        }
        Err(_) => {
            tracing::debug!(addr, "connecting to Redis again timed out");
            None
        }
    }
}

/// How often, at most, a pool's idle connections are dropped after a connection error.
const DROP_IDLE_EVERY: Duration = Duration::from_millis(200);

/// Drops the idle connections of `pool` (in a task on `runtime`): bb8 makes new ones.
fn drop_idle(runtime: &tokio::runtime::Handle, pool: &bb8::Pool<PoolManager>) {
    let pool = pool.clone();
    runtime.spawn(async move {
        for _ in 0..pool.state().idle_connections {
            let idle = tokio::time::timeout(Duration::from_millis(10), pool.get());
            match idle.await {
                // Dropped as broken: bb8 makes another.
                Ok(Ok(mut conn)) => conn.broken = true,
                _ => break,
            }
        }
    });
}

/// Creates the pool's connections; flags broken ones so bb8 drops them.
struct PoolManager {
    client: redis::Client,
    config: AsyncConnectionConfig,
}

impl fmt::Debug for PoolManager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolManager")
            .field("addr", &self.client.get_connection_info().addr())
            .finish_non_exhaustive()
    }
}

/// A pooled multiplexed connection with a flag that bb8 reads back.
struct PooledConn {
    conn: MultiplexedConnection,
    broken: bool,
}

impl PooledConn {
    /// The connection for one request. The connection counts as broken
    /// until [`PooledConn::finish`]: if the request is cancelled (its call
    /// timed out), bb8 drops it, since it may be half-open and a new one
    /// costs little.
    fn begin(&mut self) -> &mut MultiplexedConnection {
        self.broken = true;
        &mut self.conn
    }

    /// Records whether the request left the connection usable.
    fn finish<T>(&mut self, result: RedisResult<T>) -> RedisResult<T> {
        self.broken = matches!(&result, Err(e) if e.is_io_error() || e.is_unrecoverable_error());
        result
    }

    /// [`PooledConn::finish`] for a reply: a server that answers `READONLY` (a failover demoted
    /// it), to the call or inside a check script's reply, is not used again through this
    /// connection (see `RedisConn::leave_demoted`).
    fn finish_reply(&mut self, result: RedisResult<Value>) -> RedisResult<Value> {
        let result = self.finish(result);
        let demoted = match &result {
            Ok(Value::ServerError(e)) => e.code() == "READONLY",
            Ok(reply) => crate::batch::refused_reply(reply) == Some("READONLY"),
            Err(_) => false,
        };
        if demoted {
            self.broken = true;
        }
        result
    }
}

impl bb8::ManageConnection for PoolManager {
    type Connection = PooledConn;
    type Error = RedisError;

    async fn connect(&self) -> Result<PooledConn, RedisError> {
        let conn = self
            .client
            .get_multiplexed_async_connection_with_config(&self.config)
            .await?;
        Ok(PooledConn {
            conn,
            broken: false,
        })
    }

    async fn is_valid(&self, conn: &mut PooledConn) -> Result<(), RedisError> {
        redis::cmd("PING").exec_async(&mut conn.conn).await
    }

    fn has_broken(&self, conn: &mut PooledConn) -> bool {
        conn.broken
    }
}

/// A cluster connection that sends every command along one routing, so
/// that `Script::load_async` loads on the node that answered `NOSCRIPT`.
struct Routed {
    cluster: ClusterConnection,
    routing: Option<RoutingInfo>,
}

impl ConnectionLike for Routed {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self.routing.clone() {
            Some(routing) => Box::pin(self.cluster.route_command(cmd.clone(), routing)),
            None => self.cluster.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipe: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        self.cluster.req_packed_commands(pipe, offset, count)
    }

    fn get_db(&self) -> i64 {
        0
    }
}

fn evalsha<K: AsRef<[u8]>, A: AsRef<[u8]>>(script: &Script, keys: &[K], args: &[A]) -> Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script.get_hash()).arg(keys.len());
    for key in keys {
        cmd.arg(key.as_ref());
    }
    for arg in args {
        cmd.arg(arg.as_ref());
    }
    cmd
}

fn is_noscript(e: &RedisError) -> bool {
    e.kind() == ErrorKind::Server(ServerErrorKind::NoScript)
}

/// The first argument after the command name: the key of most commands.
fn first_arg(cmd: &Cmd) -> Option<&[u8]> {
    match cmd.args_iter().nth(1)? {
        redis::Arg::Simple(bytes) => Some(bytes),
        _ => None,
    }
}

fn pool_error(e: bb8::RunError<RedisError>) -> RedisError {
    match e {
        bb8::RunError::User(e) => e,
        bb8::RunError::TimedOut => io::Error::new(
            io::ErrorKind::TimedOut,
            "no pooled connection became available in time",
        )
        .into(),
    }
}

fn timed_out(what: &str, after: Duration) -> RedisError {
    io::Error::new(
        io::ErrorKind::TimedOut,
        format!("{what} timed out after {after:?}"),
    )
    .into()
}

/// `[seconds, microseconds]` as microseconds since the epoch.
fn parse_time(value: &Value) -> Option<u64> {
    let Value::Array(parts) = value else {
        return None;
    };
    let [secs, micros] = parts.as_slice() else {
        return None;
    };
    let number = |v: &Value| -> Option<u64> {
        match v {
            Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
            Value::Int(i) => u64::try_from(*i).ok(),
            _ => None,
        }
    };
    number(secs)?
        .checked_mul(1_000_000)?
        .checked_add(number(micros)?)
}

/// A call given less than `1 / SHORT_BUDGET` of the configured timeout is short: its timeout
/// tells nothing of the server's health. Batched checks with less than that left are sent in a
/// call of their own (`batch::run_set`).
pub(crate) const SHORT_BUDGET: u32 = 4;

/// A call let through by a breaker, until its outcome is recorded; dropped without one, it
/// abandons its probe (see `Breaker::abandon`).
struct Pending<'a> {
    breaker: &'a Breaker,
    admit: Option<Admit>,
}

impl Pending<'_> {
    fn record(mut self, reached: bool) -> bool {
        match self.admit.take() {
            Some(admit) => self.breaker.record(&admit, reached),
            None => false,
        }
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if let Some(admit) = self.admit.take() {
            self.breaker.abandon(&admit);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A silence makes the connection again once it is long enough; another slot's answers do
    /// not end it; the next replacement waits twice as long; an answer ends it all.
    #[test]
    fn silences_make_the_connection_again_backing_off() {
        let s = Silences::default();
        // Two call timeouts of 500 ms: a second, SILENT_FOR.
        let t = Duration::from_millis(500);
        assert!(s.timed_out(Some(1), t).is_none(), "one timeout");
        std::thread::sleep(Duration::from_millis(550));
        assert!(s.timed_out(Some(1), t).is_some(), "silent for a second");
        s.answered(Some(2));
        assert!(
            s.any.load(Ordering::Relaxed),
            "another slot's answer ended it"
        );
        std::thread::sleep(Duration::from_millis(1100));
        assert!(
            s.timed_out(Some(1), t).is_none(),
            "replaced again within 2 s"
        );
        std::thread::sleep(Duration::from_millis(1000));
        assert!(s.timed_out(Some(1), t).is_some(), "2 s after the last");
        assert_eq!(s.state().replacements, 2);
        s.answered(Some(1));
        assert!(!s.any.load(Ordering::Relaxed));
        assert_eq!(s.state().replacements, 0);
    }

    /// A call timeout of for ever (`Duration::MAX`) still counts a silence, without overflowing:
    /// the timeouts are then the operating system's (a connection's `TCP_USER_TIMEOUT`, a
    /// reconnection's).
    #[test]
    fn a_timeout_of_for_ever_counts_silences_without_overflowing() {
        let s = Silences::default();
        // Each counted as a minute's: not remade before two minutes of silence, however many
        // timeouts come meanwhile.
        for _ in 0..=SILENT_TIMEOUTS {
            assert!(s.timed_out(Some(3), Duration::MAX).is_none());
        }
        assert_eq!(
            s.state().silent.get(&Some(3)).map(|x| x.timeouts),
            Some(SILENT_TIMEOUTS + 1)
        );
    }

    /// A slot that timed out once and then saw no call does not keep the answers of every
    /// other slot on the lock, nor add to a silence much later.
    #[test]
    fn a_silence_that_stopped_growing_is_forgotten() {
        let s = Silences::default();
        let t = Duration::from_millis(100);
        assert!(s.timed_out(Some(7), t).is_none());
        let long_ago = Instant::now()
            .checked_sub(FORGET_SILENCE_AFTER + Duration::from_secs(1))
            .expect("an instant that long ago");
        if let Some(silence) = s.state().silent.get_mut(&Some(7)) {
            silence.since = long_ago;
            silence.last = long_ago;
        }
        // A timeout now starts a new silence: not two timeouts over a long silence.
        assert!(
            s.timed_out(Some(7), t).is_none(),
            "counted with the old one"
        );
        assert_eq!(s.state().silent.get(&Some(7)).map(|x| x.timeouts), Some(1));
        if let Some(silence) = s.state().silent.get_mut(&Some(7)) {
            silence.last = long_ago;
        }
        s.answered(Some(1));
        assert!(s.state().silent.is_empty());
        assert!(!s.any.load(Ordering::Relaxed));
    }

    #[test]
    fn key_slot_matches_redis_rs() {
        for key in [
            &b""[..],
            b"foo",
            b"123456789",
            b"{user1000}.following",
            b"foo{}{bar}",
            b"foo{{bar}}zap",
            b"{}x",
            &[0xff, 0x00, 0x7b, 0x7d],
        ] {
            assert_eq!(
                Route::new(key_slot(key), SlotAddr::Master),
                Route::with_key(key, SlotAddr::Master),
                "{key:?}"
            );
        }
        assert_eq!(key_slot(b"123456789"), 0x31c3);
    }

    #[test]
    fn time_reply_parses() {
        let v = Value::Array(vec![
            Value::BulkString(b"1700000000".to_vec()),
            Value::BulkString(b"123456".to_vec()),
        ]);
        assert_eq!(parse_time(&v), Some(1_700_000_000_123_456));
        assert_eq!(parse_time(&Value::Nil), None);
        assert_eq!(parse_time(&Value::Array(vec![Value::Nil])), None);
    }
}
