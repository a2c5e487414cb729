//! Redlock: one lock over N independent Redis servers, held when a majority granted it.
//!
//! The algorithm (from the Redis documentation, "Distributed Locks with Redis"):
//!
//! 1. Note the time; try `SET NX PX` with the same random token on every node at once, each
//!    call bounded by a per-node timeout much shorter than the lease.
//! 2. The lock is held if at least `N / 2 + 1` nodes granted it and the lease still has time
//!    left: *validity* = `ttl - elapsed - drift`, with `drift = ttl / 100 + 2 ms` for the
//!    nodes' clocks running at different rates. The holder trusts the lease for that long.
//! 3. Otherwise it releases on **every** node (a node that timed out may have granted it), and
//!    tries again after a random delay.
//!
//! A minority of nodes may fail or time out without effect; with a majority down, acquiring
//! returns [`Error::NoQuorum`] (after retrying until the caller's deadline). A node that
//! failed (connection error, timeout) is skipped for [`NODE_COOL_OFF`] and counts as failed
//! meanwhile, so that a dead node costs one node timeout per second rather than one per call.
//!
//! # Fencing tokens
//!
//! Each node issues its own token (`max(counter + 1, node time in µs)`); the acquisition's
//! token is the **maximum over the quorum that granted it**, and that maximum is then written
//! back to those nodes' counters before the lock is reported held. Any later holder's quorum
//! shares at least one node with ours, so its token is larger than ours — *provided that* no
//! node of that intersection lost its counter in between (a restart without persistence, or a
//! failover to a replica that had not received it) while its clock was behind the maximum.
//! So the tokens are strictly increasing in normal operation and best effort otherwise; they
//! are not the output of a consensus protocol.
//!
//! # Limits
//!
//! Redlock's mutual exclusion rests on timing assumptions: bounded clock drift between the
//! nodes (a node whose clock jumps forward expires the key early and lets a second client form
//! a majority), nodes that restart no sooner than one lease later (or persist every write with
//! `appendfsync always`), and holders that finish or check their lease before it ends.
//! Martin Kleppmann ("How to do distributed locking", 2016) showed that a process pause or a
//! network delay after the validity check can let two clients act as holders at once, so a
//! lock used for *correctness* needs fencing tokens checked by the resource, which Redlock in
//! its original form does not provide; antirez's reply ("Is Redlock safe?", 2016) argues that
//! the delays *before* the check are measured by the algorithm, that the ones after it harm
//! every lease-based lock alike, and that a resource able to check tokens can as well use the
//! random owner token with compare-and-set. Both agree that clocks must not jump. Use the
//! fencing token from this crate with [`FencedResource`](crate::FencedResource) or an
//! equivalent conditional write, and prefer a consensus system (etcd, ZooKeeper) when a
//! double grant would be a disaster.

use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use floodgate_core::lock::{Released, WaitQueues};
use floodgate_core::{LockAttempt, LockStore};
use futures_util::StreamExt;
use futures_util::future::join_all;
use futures_util::stream::FuturesUnordered;
use tokio::sync::OnceCell;
use tokio::time::Instant;

use crate::{Error, RedisLocks};

/// Default bound on one node's answer.
pub const DEFAULT_NODE_TIMEOUT: Duration = Duration::from_millis(200);

/// How long a node that failed (connection error, timeout) is skipped before it is tried
/// again: a dead node then costs one node timeout per second instead of one per call. Nodes
/// cooling off are asked all the same when the others are too few for a quorum.
pub const NODE_COOL_OFF: Duration = Duration::from_secs(1);

struct Node {
    /// Redacted, for errors.
    shown: String,
    /// To connect later when the node was down at start.
    url: Option<String>,
    locks: OnceCell<RedisLocks>,
    /// Skipped until then after a failure.
    down_until: Mutex<Option<Instant>>,
}

/// Who a server is, from its `INFO`: its process, and its replication history.
#[derive(Debug, Default, PartialEq, Eq)]
struct Identity {
    run_id: Option<String>,
    replid: Option<String>,
    /// `role:slave`: it copies another server's dataset.
    replica: bool,
}

impl Identity {
    fn of(info: &str) -> Self {
        let field = |name: &str| {
            info.lines()
                .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
                .map(str::trim)
                // Empty, or a placeholder of zeros: unknown, never equal to another.
                .filter(|v| v.bytes().any(|b| b != b'0'))
                .map(str::to_owned)
        };
        Identity {
            run_id: field("run_id"),
            replid: field("master_replid"),
            replica: field("role").as_deref() == Some("slave"),
        }
    }
}

impl Node {
    fn new(shown: String, url: Option<String>, locks: OnceCell<RedisLocks>) -> Self {
        Self {
            shown,
            url,
            locks,
            down_until: Mutex::new(None),
        }
    }

    fn skipped_for(&self) -> Option<Duration> {
        let down_until = *self
            .down_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        down_until
            .map(|t| t.saturating_duration_since(Instant::now()))
            .filter(|left| !left.is_zero())
    }

    fn record<T>(&self, result: &Result<T, Error>) {
        let mut down_until = self
            .down_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match result {
            Err(e) if e.is_transient() => *down_until = Some(Instant::now() + NODE_COOL_OFF),
            _ => *down_until = None,
        }
    }

    /// `op` on this node, bounded by `after`.
    async fn timed<T, F, Fut>(&self, after: Duration, op: F) -> Result<T, Error>
    where
        F: FnOnce(RedisLocks) -> Fut,
        Fut: Future<Output = Result<T, Error>>,
    {
        let call = async { op(self.locks().await?).await };
        tokio::time::timeout(after, call).await.unwrap_or_else(|_| {
            Err(Error::NodeTimeout {
                node: self.shown.clone(),
                after,
            })
        })
    }

    /// The error of a call skipped while this node cools off.
    fn down(&self, retry_in: Duration) -> Error {
        Error::NodeDown {
            node: self.shown.clone(),
            retry_in,
        }
    }

    async fn locks(&self) -> Result<RedisLocks, Error> {
        if let Some(locks) = self.locks.get() {
            return Ok(locks.clone());
        }
        match &self.url {
            Some(url) => Ok(self
                .locks
                .get_or_try_init(|| RedisLocks::connect(url))
                .await?
                .clone()),
            None => Err(Error::Invalid(format!(
                "Redlock node {} has no connection",
                self.shown
            ))),
        }
    }
}

/// A lock store over N independent Redis servers (not replicas of each other, not one
/// cluster), granting a lock when a majority does. See the [module docs](self) for the
/// algorithm, its fencing tokens, and when not to rely on it.
///
/// ```no_run
/// use std::time::Duration;
/// use floodgate_lock::{Lock, Redlock};
///
/// # async fn run() -> Result<(), floodgate_lock::Error> {
/// let nodes = ["redis://10.0.0.1:6379", "redis://10.0.0.2:6379", "redis://10.0.0.3:6379"];
/// let redlock = Redlock::connect(nodes).await?;
/// let lock = Lock::new(redlock, "nightly-report", Duration::from_secs(30))?.watchdog(true);
/// let guard = lock.acquire(Duration::from_secs(10)).await?;
/// // ... write with guard.fence() ...
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Redlock {
    nodes: Arc<[Node]>,
    quorum: usize,
    node_timeout: Duration,
    queues: Arc<WaitQueues>,
}

impl Redlock {
    /// Redlock over these lock clients, one per independent server. Call
    /// [`Redlock::check_independence`] to have them asked who they are.
    ///
    /// # Errors
    /// [`Error::Invalid`] for no node, or a server given twice (the same URL).
    pub fn new(nodes: Vec<RedisLocks>) -> Result<Self, Error> {
        let nodes: Vec<Node> = nodes
            .into_iter()
            .map(|locks| {
                let shown = locks.conn().redacted_url().to_owned();
                Node::new(shown, None, OnceCell::new_with(Some(locks)))
            })
            .collect();
        Self::from_nodes(nodes)
    }

    /// Connects to every URL (each an independent server) with default settings and release
    /// notifications. Nodes that cannot be reached now are connected on later use, as long as
    /// a quorum is reachable now. The nodes reached are asked who they are
    /// ([`Redlock::check_independence`]).
    ///
    /// # Errors
    /// [`Error::Invalid`] for no URL, an invalid URL or one given twice, or two URLs that reach
    /// one server or one replication group; [`Error::NoQuorum`] when fewer than a majority
    /// connect.
    pub async fn connect<I, U>(urls: I) -> Result<Self, Error>
    where
        I: IntoIterator<Item = U>,
        U: AsRef<str>,
    {
        let urls: Vec<String> = urls.into_iter().map(|u| u.as_ref().to_owned()).collect();
        let connected = join_all(urls.iter().map(|url| RedisLocks::connect(url))).await;
        let mut nodes = Vec::with_capacity(urls.len());
        let mut errors = Vec::new();
        // The nodes down now, by position, with their connections made later.
        let mut late = Vec::new();
        for (url, connected) in urls.into_iter().zip(connected) {
            // An unparsable URL is a configuration error, never a node that is merely down.
            let shown = floodgate_redis::RedisConfig::new(&url)
                .map_err(|e| Error::Invalid(format!("Redlock node URL: {e}")))?
                .redacted_url();
            let locks = match connected {
                Ok(locks) => OnceCell::new_with(Some(locks)),
                Err(e) => {
                    tracing::warn!(node = %shown, error = %e, "Redlock node unreachable at start");
                    errors.push(e);
                    // Connected later in a task of its own, within the connect timeout: made
                    // inside a call, it would be cancelled at every node timeout (200 ms by
                    // default), and a node slower than that to connect would never join.
                    late.push((nodes.len(), RedisLocks::connect_lazy(&url)?));
                    OnceCell::new()
                }
            };
            nodes.push(Node::new(shown, Some(url), locks));
        }
        let redlock = Self::from_nodes(nodes)?;
        if errors.len() > redlock.nodes.len() - redlock.quorum {
            return Err(redlock.no_quorum(errors));
        }
        redlock.check_independence().await?;
        // After the check, which asks only the nodes connected now.
        for (i, locks) in late {
            let _ = redlock.nodes[i].locks.set(locks);
        }
        Ok(redlock)
    }

    /// Asks every connected node who it is, and refuses two that are not independent: one
    /// server reached twice (two spellings of its address, such as `localhost` and
    /// `127.0.0.1`, or two of its databases), found by the process id `INFO` reports
    /// (`run_id`); or servers that copy one dataset (a master and its replica, or two replicas
    /// of one master), found by the replication id a replica takes from its master
    /// (`master_replid`, when one of them reports `role:slave`). Either would let fewer servers
    /// than a quorum grant the lock, and a failover of one lose it. Two masters with one
    /// replication id (restored from one snapshot) are only warned about.
    ///
    /// Best effort, not proof of independence. [`Redlock::connect`] runs it; call it after
    /// [`Redlock::new`]. Nodes are skipped, with a warning, when they are not connected yet,
    /// do not answer within the node timeout (at least a second), or refuse `INFO` (renamed,
    /// denied to the user by an ACL, or a cluster connection's map of answers). A replica still
    /// in its first sync, or a replica promoted since (its replication id is new), looks
    /// independent.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the two nodes.
    pub async fn check_independence(&self) -> Result<(), Error> {
        let info = |locks: RedisLocks| async move {
            locks
                .conn()
                .query::<String>(redis::cmd("INFO"))
                .await
                .map_err(Error::from)
        };
        let answers = join_all(self.nodes.iter().map(|node| async move {
            // Not connected yet: asked nothing.
            node.locks.get()?;
            // Once, at start: a slow answer is not a reason to skip the check.
            let within = self.node_timeout.max(Duration::from_secs(1));
            match node.timed(within, info).await {
                Ok(text) => Some((node, Identity::of(&text))),
                Err(e) => {
                    tracing::warn!(
                        node = %node.shown,
                        error = %e,
                        "could not ask a Redlock node who it is (INFO): its independence is \
                         not checked"
                    );
                    None
                }
            }
        }))
        .await;
        let known: Vec<(&Node, Identity)> = answers.into_iter().flatten().collect();
        for (i, (node, id)) in known.iter().enumerate() {
            for (earlier, seen) in &known[..i] {
                let why = if id.run_id.is_some() && id.run_id == seen.run_id {
                    "are one server"
                } else if id.replid.is_none() || id.replid != seen.replid {
                    continue;
                } else if id.replica || seen.replica {
                    "copy one dataset (a master and its replica, or two replicas of one master)"
                } else {
                    tracing::warn!(
                        nodes = %format_args!("{} and {}", earlier.shown, node.shown),
                        "two Redlock masters share a replication id (restored from one \
                         snapshot?): make sure neither replicates the other"
                    );
                    continue;
                };
                return Err(Error::Invalid(format!(
                    "Redlock nodes {} and {} {why}: each node must be an independent server",
                    earlier.shown, node.shown
                )));
            }
        }
        Ok(())
    }

    fn from_nodes(nodes: Vec<Node>) -> Result<Self, Error> {
        if nodes.is_empty() {
            return Err(Error::Invalid("Redlock needs at least one node".to_owned()));
        }
        // One server given twice votes twice: with ["a", "a", "b"], "a" alone is a quorum.
        for (i, node) in nodes.iter().enumerate() {
            if nodes[..i].iter().any(|earlier| earlier.shown == node.shown) {
                return Err(Error::Invalid(format!(
                    "Redlock node {} is given twice: each node must be an independent server",
                    node.shown
                )));
            }
        }
        Ok(Self {
            quorum: nodes.len() / 2 + 1,
            nodes: nodes.into(),
            node_timeout: DEFAULT_NODE_TIMEOUT,
            queues: Arc::new(WaitQueues::new()),
        })
    }

    /// Bounds each node's answer (default [`DEFAULT_NODE_TIMEOUT`]); keep it well under the
    /// lease, since the time spent comes off the lease's validity.
    ///
    /// # Errors
    /// [`Error::Invalid`] for zero.
    pub fn with_node_timeout(mut self, timeout: Duration) -> Result<Self, Error> {
        if timeout.is_zero() {
            return Err(Error::Invalid(
                "the Redlock node timeout must be greater than zero".to_owned(),
            ));
        }
        self.node_timeout = timeout;
        Ok(self)
    }

    /// How many nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Always false (there is at least one node).
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// How many nodes must agree: `N / 2 + 1`.
    pub fn quorum(&self) -> usize {
        self.quorum
    }

    /// Runs `op` on every node at once, each bounded by the node timeout. A node that failed
    /// within the last [`NODE_COOL_OFF`] is skipped (it counts as failed), unless the nodes not
    /// cooling off are too few for a quorum: then every node is asked. Skipped, a node that had
    /// one slow answer, beside one that is down, would fail every call of the next second (and
    /// a lease renewed in that second would be lost) while a quorum could answer. (Asking only
    /// some of the nodes cooling off would have to guess which one is merely slow.) The price,
    /// while a majority is down: a call waits out the node timeout before failing, instead of
    /// failing at once.
    async fn on_all<'a, T, F, Fut>(&'a self, op: F) -> Vec<Result<T, Error>>
    where
        F: Fn(RedisLocks) -> Fut,
        Fut: Future<Output = Result<T, Error>> + 'a,
    {
        self.on_each(op, self.skipped(true)).await
    }

    /// Runs `op` at once on every node not `skipped` (for how long), each bounded by the node
    /// timeout; a skipped node's result is [`Error::NodeDown`].
    async fn on_each<'a, T, F, Fut>(
        &'a self,
        op: F,
        skipped: Vec<Option<Duration>>,
    ) -> Vec<Result<T, Error>>
    where
        F: Fn(RedisLocks) -> Fut,
        Fut: Future<Output = Result<T, Error>> + 'a,
    {
        join_all(self.nodes.iter().zip(skipped).map(|(node, skipped)| {
            let op = &op;
            async move {
                match skipped {
                    Some(left) => Err(node.down(left)),
                    None => self.on_node(node, op).await,
                }
            }
        }))
        .await
    }

    /// For each node, how long it is skipped for: `Some` for a node cooling off, unless
    /// `quorum_needs_them` and the nodes not cooling off are too few for a quorum (then every
    /// node is asked).
    fn skipped(&self, quorum_needs_them: bool) -> Vec<Option<Duration>> {
        let mut cooling: Vec<Option<Duration>> = self.nodes.iter().map(Node::skipped_for).collect();
        if quorum_needs_them && cooling.iter().filter(|c| c.is_none()).count() < self.quorum {
            cooling.fill(None);
        }
        cooling
    }

    /// Runs `op` about a lock we hold on every node not cooling off, then, when their answers
    /// leave open whether a quorum holds it for us (`ours`: as [`Redlock::settle`] decides),
    /// on the nodes cooling off too. The quorum holding the lock may be any of the nodes: a
    /// node that failed a moment ago (one slow answer, perhaps about another lock) may be one
    /// of it, while a node that answers never had the lock (down when it was taken, or
    /// restarted empty); passed over, it would make a renewal `NoQuorum` for its whole
    /// cool-off, and a release's retry "lost". Each node's result, and whether it was left out
    /// (cooling off and not needed: it counts as failed).
    async fn on_all_held<'a, T, F, Fut>(
        &'a self,
        op: F,
        ours: impl Fn(&T) -> bool,
    ) -> (Vec<Result<T, Error>>, Vec<bool>)
    where
        F: Fn(RedisLocks) -> Fut,
        Fut: Future<Output = Result<T, Error>> + 'a,
    {
        let skipped = self.skipped(true);
        let ask = |asked: Vec<bool>| {
            let op = &op;
            join_all(
                self.nodes
                    .iter()
                    .zip(asked)
                    .map(|(node, asked)| async move {
                        match asked {
                            true => Some(self.on_node(node, op).await),
                            false => None,
                        }
                    }),
            )
        };
        let mut results = ask(skipped.iter().map(Option::is_none).collect()).await;
        let said_ours = results
            .iter()
            .filter(|r| matches!(r, Some(Ok(answer)) if ours(answer)))
            .count();
        let failed = results.iter().filter(|r| matches!(r, Some(Err(_)))).count();
        let cooling = results.iter().filter(|r| r.is_none()).count();
        // Open (as `settle` would find it), and the nodes cooling off can close it: all of them
        // saying "ours" would make a quorum, or all of them saying "not ours" would leave none
        // possible. Else asking them would only wait on them.
        let open = said_ours < self.quorum && said_ours + failed + cooling >= self.quorum;
        let closable = said_ours + cooling >= self.quorum || said_ours + failed < self.quorum;
        if cooling > 0 && open && closable {
            let late = ask(skipped.iter().map(Option::is_some).collect()).await;
            for (result, late) in results.iter_mut().zip(late) {
                if late.is_some() {
                    *result = late;
                }
            }
        }
        let left_out = results.iter().map(Option::is_none).collect();
        let results = results
            .into_iter()
            .zip(self.nodes.iter().zip(skipped))
            .map(|(result, (node, skipped))| {
                result.unwrap_or_else(|| Err(node.down(skipped.unwrap_or_default())))
            })
            .collect();
        (results, left_out)
    }

    /// `op` on one node, bounded by the node timeout; the outcome is recorded for its cool-off.
    async fn on_node<'a, T, F, Fut>(&'a self, node: &'a Node, op: &F) -> Result<T, Error>
    where
        F: Fn(RedisLocks) -> Fut,
        Fut: Future<Output = Result<T, Error>> + 'a,
    {
        let result = node.timed(self.node_timeout, op).await;
        node.record(&result);
        result
    }

    /// Unlocks `name` on every node. A node cooling off after a failure may have granted the
    /// lock all the same (it answered too late), and would keep it for nobody for its whole
    /// ttl. When the answer is `reported` (a release), it is asked with the others as in
    /// [`Redlock::on_all_held`] when their answers leave the release open. Otherwise (and
    /// always for a failed attempt's clean-up, whose answer nobody reads) it is sent the unlock
    /// in the background, bounded by the node timeout, and counts as failed, so that nobody
    /// waits on a dead node.
    async fn unlock_all(
        &self,
        name: &[u8],
        token: &[u8],
        reported: bool,
    ) -> Vec<Result<bool, Error>> {
        let unlock = |locks: RedisLocks| async move { locks.unlock(name, token).await };
        let (results, left_out) = if reported {
            self.on_all_held(unlock, |released| *released).await
        } else {
            let skipped = self.skipped(false);
            let left_out = skipped.iter().map(Option::is_some).collect();
            (self.on_each(unlock, skipped).await, left_out)
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            for (i, _) in left_out.iter().enumerate().filter(|(_, out)| **out) {
                let (nodes, after) = (Arc::clone(&self.nodes), self.node_timeout);
                let (name, token) = (name.to_vec(), token.to_vec());
                runtime.spawn(async move {
                    let unlock =
                        |locks: RedisLocks| async move { locks.unlock(&name, &token).await };
                    if let Err(e) = nodes[i].timed(after, unlock).await {
                        tracing::debug!(
                            error = %e,
                            "unlocking a Redlock node that is cooling off failed"
                        );
                    }
                });
            }
        }
        results
    }

    /// Splits results into the answers, each with its node's index, and the errors.
    fn split<T>(results: Vec<Result<T, Error>>) -> (Vec<(usize, T)>, Vec<Error>) {
        let mut ok = Vec::with_capacity(results.len());
        let mut errors = Vec::new();
        for (i, result) in results.into_iter().enumerate() {
            match result {
                Ok(value) => ok.push((i, value)),
                Err(e) => errors.push(e),
            }
        }
        (ok, errors)
    }

    /// The answers; too many errors to leave a quorum is [`Error::NoQuorum`].
    fn tally<T>(&self, results: Vec<Result<T, Error>>) -> Result<Vec<(usize, T)>, Error> {
        let (ok, errors) = Self::split(results);
        if errors.len() > self.nodes.len() - self.quorum {
            return Err(self.no_quorum(errors));
        }
        for e in &errors {
            tracing::debug!(error = %e, "Redlock node failed (tolerated: a minority)");
        }
        Ok(ok)
    }

    /// The answers about a lock we hold, where `ours` says whether a node still holds it for
    /// us. Too few nodes saying so is a definite "not ours" only when the nodes that said
    /// otherwise leave no quorum possible, however many failed (half of an even number of
    /// nodes saying "not ours" is enough). When the nodes that failed could have made one,
    /// nobody can tell, and that is [`Error::NoQuorum`] (transient: a watchdog tries again)
    /// rather than a lock reported lost while a quorum may still hold it.
    fn settle<T>(
        &self,
        results: Vec<Result<T, Error>>,
        ours: impl Fn(&T) -> bool,
    ) -> Result<Vec<(usize, T)>, Error> {
        let (ok, errors) = Self::split(results);
        let said_ours = ok.iter().filter(|(_, answer)| ours(answer)).count();
        if said_ours < self.quorum && said_ours + errors.len() >= self.quorum {
            return Err(self.no_quorum(errors));
        }
        for e in &errors {
            tracing::debug!(error = %e, "Redlock node failed (the others decided)");
        }
        Ok(ok)
    }

    /// [`Error::NoQuorum`] for these node errors (the first is its source).
    fn no_quorum(&self, errors: Vec<Error>) -> Error {
        let failed = errors.len();
        let first = errors
            .into_iter()
            .next()
            .unwrap_or_else(|| Error::Invalid("no node".to_owned()));
        Error::NoQuorum {
            nodes: self.nodes.len(),
            quorum: self.quorum,
            failed,
            source: Box::new(first),
        }
    }

    /// Releases on every node, ignoring errors (a failed acquisition's clean-up).
    async fn release_everywhere(&self, name: &[u8], token: &[u8]) {
        let _ = self.unlock_all(name, token, false).await;
    }
}

impl fmt::Debug for Redlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Redlock")
            .field(
                "nodes",
                &self
                    .nodes
                    .iter()
                    .map(|n| n.shown.as_str())
                    .collect::<Vec<_>>(),
            )
            .field("quorum", &self.quorum)
            .field("node_timeout", &self.node_timeout)
            .finish()
    }
}

impl LockStore for Redlock {
    type Error = Error;

    async fn try_lock(
        &self,
        name: &[u8],
        token: &[u8],
        ttl: Duration,
    ) -> Result<LockAttempt, Error> {
        let started = Instant::now();
        let drift = self.clock_drift(ttl);
        let results = self
            .on_all(|locks| async move { locks.try_lock(name, token, ttl).await })
            .await;
        let answers = match self.tally(results) {
            Ok(answers) => answers,
            Err(e) => {
                self.release_everywhere(name, token).await;
                return Err(e);
            }
        };
        let mut granted = Vec::new();
        let mut busy = Duration::MAX;
        for (i, answer) in answers {
            match answer {
                LockAttempt::Acquired { fence } => granted.push((i, fence)),
                LockAttempt::Held { remaining } => busy = busy.min(remaining),
            }
        }
        if granted.len() >= self.quorum {
            let fence = granted.iter().map(|&(_, f)| f).max().unwrap_or(0);
            // Make the next holder's tokens larger than ours: our quorum overlaps theirs.
            let raised = join_all(granted.iter().map(|&(i, _)| {
                let node = &self.nodes[i];
                async move {
                    let raise = async {
                        node.locks()
                            .await?
                            .raise_fence(name, token, fence, ttl)
                            .await
                    };
                    matches!(
                        tokio::time::timeout(self.node_timeout, raise).await,
                        Ok(Ok(true))
                    )
                }
            }))
            .await
            .into_iter()
            .filter(|raised| *raised)
            .count();
            let took = started.elapsed();
            let late = took + drift >= ttl;
            if raised >= self.quorum && !late {
                return Ok(LockAttempt::Acquired { fence });
            }
            if late {
                // Granted, but too late to be held: not another holder's (a busy lock would
                // make `try_acquire` answer `None`), a store too slow for this lease.
                self.release_everywhere(name, token).await;
                return Err(Error::AnsweredTooLate {
                    name: floodgate_redis::display_key(name),
                    took,
                    ttl,
                });
            }
        }
        self.release_everywhere(name, token).await;
        // `Duration::MAX` when no node named a holder (a split vote, or too slow): the caller
        // retries after its random backoff, as Redlock prescribes.
        Ok(LockAttempt::Held { remaining: busy })
    }

    async fn unlock(&self, name: &[u8], token: &[u8]) -> Result<bool, Error> {
        let results = self.unlock_all(name, token, true).await;
        let released = self
            .settle(results, |r| *r)?
            .iter()
            .filter(|(_, r)| *r)
            .count();
        Ok(released >= self.quorum)
    }

    async fn extend(&self, name: &[u8], token: &[u8], ttl: Duration) -> Result<bool, Error> {
        let started = Instant::now();
        let (results, _) = self
            .on_all_held(
                |locks| async move { locks.extend(name, token, ttl).await },
                |extended| *extended,
            )
            .await;
        let extended = self
            .settle(results, |r| *r)?
            .iter()
            .filter(|(_, r)| *r)
            .count();
        Ok(extended >= self.quorum && started.elapsed() + self.clock_drift(ttl) < ttl)
    }

    async fn remaining(&self, name: &[u8], token: &[u8]) -> Result<Option<Duration>, Error> {
        let (results, _) = self
            .on_all_held(
                |locks| async move { locks.remaining(name, token).await },
                Option::is_some,
            )
            .await;
        let mut left: Vec<Duration> = self
            .settle(results, Option::is_some)?
            .into_iter()
            .filter_map(|(_, r)| r)
            .collect();
        if left.len() < self.quorum {
            return Ok(None);
        }
        // Held on a quorum for at least the quorum-th longest lease (the guard allows for the
        // clock drift, as for every store).
        left.sort_unstable_by(|a, b| b.cmp(a));
        Ok(Some(left[self.quorum - 1]))
    }

    fn released(&self, name: &[u8]) -> Released {
        let mut pending: FuturesUnordered<Released> = self
            .nodes
            .iter()
            .filter_map(|node| node.locks.get())
            .map(|locks| locks.released(name))
            .collect();
        let quorum = self.quorum;
        Box::pin(async move {
            // Free once a quorum of nodes announced the release.
            let mut fired = 0;
            while pending.next().await.is_some() {
                fired += 1;
                if fired >= quorum {
                    return;
                }
            }
            std::future::pending::<()>().await;
        })
    }

    fn clock_drift(&self, ttl: Duration) -> Duration {
        clock_drift(ttl)
    }

    fn wait_queues(&self) -> Option<&WaitQueues> {
        Some(&self.queues)
    }
}

/// How much of a `ttl` lease a holder assumes lost to the difference between its clock and a
/// Redis server's: 1% and 2 ms, as the Redlock algorithm allows.
pub(crate) fn clock_drift(ttl: Duration) -> Duration {
    ttl / 100 + Duration::from_millis(2)
}

#[cfg(test)]
mod tests {
    use super::Identity;

    #[test]
    fn identity_reads_run_id_and_replication_id_from_info() {
        let info = "# Server\r\nredis_version:7.2.4\r\nrun_id:abc123\r\n\r\n# Replication\r\nrole:master\r\nmaster_replid:def456\r\nmaster_replid2:0000\r\n";
        assert_eq!(
            Identity::of(info),
            Identity {
                run_id: Some("abc123".to_owned()),
                replid: Some("def456".to_owned()),
                replica: false,
            }
        );
        // `master_replid2` is not `master_replid`; missing, empty or zero fields are unknown.
        assert_eq!(
            Identity::of("master_replid2:1\r\nrun_id:\r\nmaster_replid:0000\r\n"),
            Identity::default()
        );
        assert!(Identity::of("role:slave\r\n").replica);
    }
}
