//! A local Redis Cluster of real `redis-server` processes.

use std::fmt;
use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use crate::TestkitError;
use crate::binary::{self, Binary};
use crate::resp::Resp;
use crate::server::{RedisServer, RedisServerBuilder, info_field};
use crate::slot::SLOT_COUNT;

/// Timeout for the commands the cluster helpers send to nodes.
const NODE_CMD_TIMEOUT: Duration = Duration::from_secs(2);
/// How often waits poll the nodes.
const POLL_INTERVAL: Duration = Duration::from_millis(100);
/// How often `failover` re-sends `CLUSTER FAILOVER` while the replica is
/// not yet promoted (a master refuses a second vote for the same shard for
/// twice the node timeout).
const FAILOVER_RESEND: Duration = Duration::from_secs(5);

/// How `CLUSTER FAILOVER` is issued; see the Redis documentation of
/// `CLUSTER FAILOVER`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailoverMode {
    /// `CLUSTER FAILOVER`: coordinated with a live master, no data loss.
    Coordinated,
    /// `CLUSTER FAILOVER FORCE`: no handshake with the master (use when it
    /// is dead), but still elected by a majority of masters.
    Force,
    /// `CLUSTER FAILOVER TAKEOVER`: no election at all.
    Takeover,
}

impl fmt::Display for FailoverMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Coordinated => "CLUSTER FAILOVER",
            Self::Force => "CLUSTER FAILOVER FORCE",
            Self::Takeover => "CLUSTER FAILOVER TAKEOVER",
        })
    }
}

/// The replication role of a live node.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Role {
    /// A master.
    Master,
    /// A replica of the master on `master_port`.
    Replica {
        /// The port of its master.
        master_port: u16,
    },
}

/// Options for starting a [`RedisCluster`].
#[derive(Debug, Clone)]
pub struct RedisClusterBuilder {
    server: RedisServerBuilder,
    password: Option<String>,
    cli: Option<PathBuf>,
    masters: usize,
    replicas_per_master: usize,
    create_timeout: Duration,
    ready_timeout: Duration,
    failover_timeout: Duration,
}

impl Default for RedisClusterBuilder {
    fn default() -> Self {
        Self {
            server: RedisServerBuilder::default().cluster_enabled(true),
            password: None,
            cli: None,
            masters: 3,
            replicas_per_master: 1,
            create_timeout: Duration::from_secs(60),
            ready_timeout: Duration::from_secs(30),
            failover_timeout: Duration::from_secs(30),
        }
    }
}

impl RedisClusterBuilder {
    /// Uses this `redis-server` binary for every node.
    #[must_use]
    pub fn binary(mut self, path: impl Into<PathBuf>) -> Self {
        self.server = self.server.binary(path);
        self
    }

    /// Uses this `redis-cli` binary instead of `$FLOODGATE_REDIS_CLI` / `PATH`.
    #[must_use]
    pub fn cli(mut self, path: impl Into<PathBuf>) -> Self {
        self.cli = Some(path.into());
        self
    }

    /// Appends a raw `redis.conf` line to every node's config.
    #[must_use]
    pub fn config(mut self, line: impl Into<String>) -> Self {
        self.server = self.server.config(line);
        self
    }

    /// Sets `requirepass`/`masterauth` on every node.
    #[must_use]
    pub fn password(mut self, password: impl Into<String>) -> Self {
        let password = password.into();
        self.server = self.server.password(password.clone());
        self.password = Some(password);
        self
    }

    /// Number of masters (at least 3; default 3).
    #[must_use]
    pub fn masters(mut self, masters: usize) -> Self {
        self.masters = masters;
        self
    }

    /// Replicas per master (default 1).
    #[must_use]
    pub fn replicas_per_master(mut self, replicas: usize) -> Self {
        self.replicas_per_master = replicas;
        self
    }

    /// `cluster-node-timeout` (default 2000 ms): how soon a dead master is
    /// detected and automatically failed over.
    #[must_use]
    pub fn node_timeout(mut self, timeout: Duration) -> Self {
        self.server = self.server.cluster_node_timeout(timeout);
        self
    }

    /// How long to wait for the cluster to become healthy after creation
    /// (default 30 s).
    #[must_use]
    pub fn ready_timeout(mut self, timeout: Duration) -> Self {
        self.ready_timeout = timeout;
        self
    }

    /// How long [`RedisCluster::failover`] waits for the promotion (default 30 s).
    #[must_use]
    pub fn failover_timeout(mut self, timeout: Duration) -> Self {
        self.failover_timeout = timeout;
        self
    }

    /// Starts the nodes, creates the cluster with `redis-cli --cluster create`
    /// and waits until every node reports `cluster_state:ok` with all slots
    /// covered, every node knows every other, and every replica is in sync.
    ///
    /// # Errors
    /// Missing binaries (with a hint to run `scripts/install-redis`), node
    /// startup failures, [`TestkitError::ClusterCreate`] and
    /// [`TestkitError::ClusterUnhealthy`].
    pub fn start(&self) -> Result<RedisCluster, TestkitError> {
        if self.masters < 3 {
            return Err(TestkitError::InvalidArgument(format!(
                "a Redis Cluster needs at least 3 masters, got {}",
                self.masters
            )));
        }
        let cli = binary::find(Binary::Cli, self.cli.as_deref())?;
        let count = self.masters * (1 + self.replicas_per_master);
        let mut nodes = Vec::with_capacity(count);
        for _ in 0..count {
            nodes.push(self.server.start()?);
        }
        let cluster = RedisCluster {
            nodes,
            failover_timeout: self.failover_timeout,
        };
        cluster.create(
            &cli,
            self.replicas_per_master,
            self.password.as_deref(),
            self.create_timeout,
        )?;
        cluster.wait_until(self.ready_timeout, RedisCluster::check_ready)?;
        Ok(cluster)
    }
}

/// A local Redis Cluster: by default 3 masters with 1 replica each, on
/// loopback, `cluster-node-timeout` 2000 ms. Nodes are addressed by index
/// into [`RedisCluster::nodes`]; roles are always queried live, since they
/// change on failover. Dropping the cluster kills every node.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
    failover_timeout: Duration,
}

impl RedisCluster {
    /// Starts a 6-node cluster (3 masters, 3 replicas) with default options.
    ///
    /// # Errors
    /// See [`RedisClusterBuilder::start`].
    pub fn start() -> Result<Self, TestkitError> {
        Self::builder().start()
    }

    /// Options for starting a cluster.
    pub fn builder() -> RedisClusterBuilder {
        RedisClusterBuilder::default()
    }

    /// All nodes, whatever their role or state.
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// The node at `index`.
    ///
    /// # Panics
    /// If `index` is out of range.
    pub fn node(&self, index: usize) -> &RedisServer {
        &self.nodes[index]
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Always false (a cluster has at least 3 nodes).
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// `redis://127.0.0.1:PORT` for every node (e.g. for redis-rs `ClusterClient`).
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The port of every node.
    pub fn ports(&self) -> Vec<u16> {
        self.nodes.iter().map(RedisServer::port).collect()
    }

    /// The index of the node listening on `port`.
    pub fn index_of_port(&self, port: u16) -> Option<usize> {
        self.nodes.iter().position(|n| n.port() == port)
    }

    /// The slot of `key`, computed locally (same as [`crate::key_slot`]).
    pub fn key_slot(key: &[u8]) -> u16 {
        crate::slot::key_slot(key)
    }

    /// The live role of node `index` (from `ROLE`).
    ///
    /// # Errors
    /// Out-of-range index, or the node does not answer.
    pub fn role(&self, index: usize) -> Result<Role, TestkitError> {
        let node = self.checked(index)?;
        let reply = node.cmd_timeout(&["ROLE"], NODE_CMD_TIMEOUT)?;
        parse_role(node, &reply)
    }

    /// Indices of the nodes that are running, not paused, and masters.
    ///
    /// # Errors
    /// A live node that does not answer `ROLE`.
    pub fn masters(&self) -> Result<Vec<usize>, TestkitError> {
        self.with_role(|r| *r == Role::Master)
    }

    /// Indices of the nodes that are running, not paused, and replicas.
    ///
    /// # Errors
    /// A live node that does not answer `ROLE`.
    pub fn replicas(&self) -> Result<Vec<usize>, TestkitError> {
        self.with_role(|r| matches!(r, Role::Replica { .. }))
    }

    /// Indices of the live replicas whose master is node `master`.
    ///
    /// # Errors
    /// Out-of-range index, or a live node that does not answer `ROLE`.
    pub fn replicas_of(&self, master: usize) -> Result<Vec<usize>, TestkitError> {
        let port = self.checked(master)?.port();
        self.with_role(|r| *r == Role::Replica { master_port: port })
    }

    /// The index of the node that serves `slot` according to `CLUSTER SLOTS`
    /// (asked of the first live node that answers). Right after a master is
    /// killed this is still the dead master, until a failover.
    ///
    /// # Errors
    /// Slot out of range, no live node answering, or a slot served by an
    /// unknown node.
    pub fn node_for_slot(&self, slot: u16) -> Result<usize, TestkitError> {
        if slot >= SLOT_COUNT {
            return Err(TestkitError::InvalidArgument(format!(
                "slot {slot} is out of range 0..{SLOT_COUNT}"
            )));
        }
        let mut last_error = None;
        for (_, node) in self.live() {
            match cluster_slots(node) {
                Ok(ranges) => {
                    let Some(&(_, _, port)) = ranges
                        .iter()
                        .find(|&&(start, end, _)| (start..=end).contains(&slot))
                    else {
                        return Err(TestkitError::UnexpectedReply {
                            addr: node.addr().to_string(),
                            command: "CLUSTER SLOTS".to_owned(),
                            detail: format!("slot {slot} is not assigned to any node"),
                        });
                    };
                    return self.index_of_port(port).ok_or_else(|| {
                        TestkitError::UnexpectedReply {
                            addr: node.addr().to_string(),
                            command: "CLUSTER SLOTS".to_owned(),
                            detail: format!(
                                "slot {slot} is served by port {port}, which is not a node of this cluster"
                            ),
                        }
                    });
                }
                Err(e) => last_error = Some(e),
            }
        }
        Err(last_error.unwrap_or(TestkitError::ClusterUnhealthy {
            waited: Duration::ZERO,
            detail: "no node is running".to_owned(),
        }))
    }

    /// The index of the node that serves `key`'s slot.
    ///
    /// # Errors
    /// As [`RedisCluster::node_for_slot`].
    pub fn node_for_key(&self, key: &[u8]) -> Result<usize, TestkitError> {
        self.node_for_slot(Self::key_slot(key))
    }

    /// Kills (SIGKILL) the master serving `slot` and returns its index.
    ///
    /// # Errors
    /// As [`RedisCluster::node_for_slot`], or the kill failing.
    pub fn kill_master_for_slot(&self, slot: u16) -> Result<usize, TestkitError> {
        let index = self.node_for_slot(slot)?;
        self.nodes[index].kill()?;
        Ok(index)
    }

    /// Promotes replica `replica` to master and waits until `ROLE` says so:
    /// `CLUSTER FAILOVER` if its master is alive, `CLUSTER FAILOVER FORCE`
    /// if the master is killed, paused or unreachable. Returns at once if the
    /// node is already a master (e.g. promoted by an automatic failover).
    ///
    /// # Errors
    /// Out-of-range index, a node not answering, an error reply, or no
    /// promotion within the failover timeout.
    pub fn failover(&self, replica: usize) -> Result<(), TestkitError> {
        let Role::Replica { master_port } = self.role(replica)? else {
            return Ok(());
        };
        let master_alive = match self.index_of_port(master_port) {
            Some(m) => {
                self.nodes[m].is_running() && !self.nodes[m].is_paused() && {
                    let n = &self.nodes[m];
                    n.cmd_timeout(&["PING"], Duration::from_millis(500)).is_ok()
                }
            }
            None => false,
        };
        let mode = if master_alive {
            FailoverMode::Coordinated
        } else {
            FailoverMode::Force
        };
        self.failover_with(replica, mode)
    }

    /// Like [`RedisCluster::failover`], with an explicit mode.
    ///
    /// # Errors
    /// As [`RedisCluster::failover`].
    pub fn failover_with(&self, replica: usize, mode: FailoverMode) -> Result<(), TestkitError> {
        let node = self.checked(replica)?;
        let started = Instant::now();
        let mut sent_at: Option<Instant> = None;
        loop {
            let role = self.role(replica)?;
            if role == Role::Master {
                return Ok(());
            }
            if sent_at.is_none_or(|t| t.elapsed() >= FAILOVER_RESEND) {
                let args: &[&str] = match mode {
                    FailoverMode::Coordinated => &["CLUSTER", "FAILOVER"],
                    FailoverMode::Force => &["CLUSTER", "FAILOVER", "FORCE"],
                    FailoverMode::Takeover => &["CLUSTER", "FAILOVER", "TAKEOVER"],
                };
                let reply = node.cmd_timeout(args, NODE_CMD_TIMEOUT)?;
                if let Resp::Error(message) = reply {
                    // Promoted meanwhile (automatic failover)? Then fine.
                    if self.role(replica)? == Role::Master {
                        return Ok(());
                    }
                    return Err(TestkitError::ServerError {
                        addr: node.addr().to_string(),
                        command: mode.to_string(),
                        message,
                    });
                }
                sent_at = Some(Instant::now());
            }
            if started.elapsed() >= self.failover_timeout {
                return Err(TestkitError::ClusterUnhealthy {
                    waited: started.elapsed(),
                    detail: format!(
                        "node {replica} (port {}) is still {role:?} after {mode}",
                        node.port()
                    ),
                });
            }
            thread::sleep(POLL_INTERVAL);
        }
    }

    /// Waits until every running, unpaused node reports `cluster_state:ok`
    /// with all 16384 slots assigned and ok, all of them agree on which node
    /// serves each slot, and every serving node is a live master.
    ///
    /// # Errors
    /// [`TestkitError::ClusterUnhealthy`] with the last reason, after `timeout`.
    pub fn wait_healthy(&self, timeout: Duration) -> Result<(), TestkitError> {
        self.wait_until(timeout, Self::check_healthy)
    }

    /// Checks health once (see [`RedisCluster::wait_healthy`]); `Err` holds
    /// the reason it is not healthy.
    pub fn check_health(&self) -> Result<(), String> {
        self.check_healthy()
    }

    fn checked(&self, index: usize) -> Result<&RedisServer, TestkitError> {
        self.nodes.get(index).ok_or_else(|| {
            TestkitError::InvalidArgument(format!(
                "node index {index} is out of range (the cluster has {} nodes)",
                self.nodes.len()
            ))
        })
    }

    fn live(&self) -> impl Iterator<Item = (usize, &RedisServer)> {
        self.nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.is_running() && !n.is_paused())
    }

    fn with_role(&self, keep: impl Fn(&Role) -> bool) -> Result<Vec<usize>, TestkitError> {
        let mut out = Vec::new();
        for (i, _) in self.live() {
            if keep(&self.role(i)?) {
                out.push(i);
            }
        }
        Ok(out)
    }

    fn create(
        &self,
        cli: &std::path::Path,
        replicas: usize,
        password: Option<&str>,
        timeout: Duration,
    ) -> Result<(), TestkitError> {
        let mut cmd = Command::new(cli);
        if let Some(pw) = password {
            cmd.args(["-a", pw, "--no-auth-warning"]);
        }
        cmd.args(["--cluster", "create"]);
        for n in &self.nodes {
            cmd.arg(n.addr().to_string());
        }
        cmd.args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"]);

        let file_error = |source| TestkitError::File {
            what: "could not create a temporary file for redis-cli output",
            path: std::env::temp_dir(),
            source,
        };
        let mut out = tempfile::tempfile().map_err(file_error)?;
        let err = out.try_clone().map_err(file_error)?;
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(out.try_clone().map_err(file_error)?)
            .stderr(err)
            .spawn()
            .map_err(|source| TestkitError::Spawn {
                binary: cli.to_path_buf(),
                source,
            })?;
        let started = Instant::now();
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break Some(status),
                Ok(None) if started.elapsed() < timeout => thread::sleep(POLL_INTERVAL),
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    break None;
                }
            }
        };
        let mut output = String::new();
        let _ = out.seek(SeekFrom::Start(0));
        let mut bytes = Vec::new();
        let _ = out.read_to_end(&mut bytes);
        output.push_str(&String::from_utf8_lossy(&bytes));
        match status {
            Some(s) if s.success() && output.contains("All 16384 slots covered") => Ok(()),
            Some(s) => Err(TestkitError::ClusterCreate {
                status: s.to_string(),
                output,
            }),
            None => Err(TestkitError::ClusterCreate {
                status: format!("killed after {timeout:?} timeout"),
                output,
            }),
        }
    }

    fn wait_until(
        &self,
        timeout: Duration,
        check: impl Fn(&Self) -> Result<(), String>,
    ) -> Result<(), TestkitError> {
        let started = Instant::now();
        loop {
            let detail = match check(self) {
                Ok(()) => return Ok(()),
                Err(detail) => detail,
            };
            if started.elapsed() >= timeout {
                return Err(TestkitError::ClusterUnhealthy {
                    waited: started.elapsed(),
                    detail,
                });
            }
            thread::sleep(POLL_INTERVAL);
        }
    }

    /// Healthy, plus (right after creation) every node knows all others and
    /// every replica's link to its master is up.
    fn check_ready(&self) -> Result<(), String> {
        self.check_healthy()?;
        let total = self.nodes.len().to_string();
        for (i, node) in self.nodes.iter().enumerate() {
            let info = text_reply(node, &["CLUSTER", "INFO"])?;
            let known = info_field(&info, "cluster_known_nodes").unwrap_or("?");
            if known != total {
                return Err(format!(
                    "node {i} (port {}) knows {known} nodes, expected {total}",
                    node.port()
                ));
            }
            if let Role::Replica { master_port } = self.role(i).map_err(|e| e.to_string())? {
                let info = text_reply(node, &["INFO", "replication"])?;
                let link = info_field(&info, "master_link_status").unwrap_or("?");
                if link != "up" {
                    return Err(format!(
                        "replica {i} (port {}) has master_link_status:{link} to port {master_port}",
                        node.port()
                    ));
                }
            }
        }
        Ok(())
    }

    fn check_healthy(&self) -> Result<(), String> {
        let mut reference: Option<(usize, Vec<SlotRange>)> = None;
        for (i, node) in self.live() {
            let port = node.port();
            let info = text_reply(node, &["CLUSTER", "INFO"])?;
            for (field, want) in [
                ("cluster_state", "ok"),
                ("cluster_slots_assigned", "16384"),
                ("cluster_slots_ok", "16384"),
            ] {
                let got = info_field(&info, field).unwrap_or("<missing>");
                if got != want {
                    return Err(format!("node {i} (port {port}) reports {field}:{got}"));
                }
            }
            let slots = cluster_slots(node).map_err(|e| e.to_string())?;
            match &reference {
                None => reference = Some((i, slots)),
                Some((j, theirs)) if *theirs != slots => {
                    return Err(format!(
                        "nodes {j} and {i} disagree on slot owners: {theirs:?} vs {slots:?}"
                    ));
                }
                Some(_) => {}
            }
        }
        let Some((_, slots)) = reference else {
            return Err("no node is running".to_owned());
        };
        let covered: u32 = slots
            .iter()
            .map(|&(s, e, _)| u32::from(e) - u32::from(s) + 1)
            .sum();
        if covered != u32::from(SLOT_COUNT) {
            return Err(format!("CLUSTER SLOTS covers {covered} slots, not 16384"));
        }
        let mut owners: Vec<u16> = slots.iter().map(|&(_, _, p)| p).collect();
        owners.sort_unstable();
        owners.dedup();
        for port in owners {
            let Some(index) = self.index_of_port(port) else {
                return Err(format!("slots are served by unknown port {port}"));
            };
            let node = &self.nodes[index];
            if !node.is_running() || node.is_paused() {
                return Err(format!(
                    "slots are served by node {index} (port {port}), which is killed or paused"
                ));
            }
            if self.role(index).map_err(|e| e.to_string())? != Role::Master {
                return Err(format!(
                    "slots are served by node {index} (port {port}), which is not a master"
                ));
            }
        }
        Ok(())
    }
}

fn text_reply(node: &RedisServer, args: &[&str]) -> Result<String, String> {
    let reply = node
        .cmd_timeout(args, NODE_CMD_TIMEOUT)
        .map_err(|e| e.to_string())?;
    match reply.as_str() {
        Some(s) => Ok(s.to_owned()),
        None => Err(format!(
            "node on port {} answered `{}` with {reply:?}",
            node.port(),
            args.join(" ")
        )),
    }
}

fn parse_role(node: &RedisServer, reply: &Resp) -> Result<Role, TestkitError> {
    let bad = |detail: String| TestkitError::UnexpectedReply {
        addr: node.addr().to_string(),
        command: "ROLE".to_owned(),
        detail,
    };
    let items = reply
        .as_array()
        .ok_or_else(|| bad(format!("not an array: {reply:?}")))?;
    match items.first().and_then(Resp::as_str) {
        Some("master") => Ok(Role::Master),
        Some("slave") | Some("replica") => {
            let port = items
                .get(2)
                .and_then(Resp::as_int)
                .and_then(|p| u16::try_from(p).ok())
                .ok_or_else(|| bad(format!("no master port in {reply:?}")))?;
            Ok(Role::Replica { master_port: port })
        }
        _ => Err(bad(format!("unknown role in {reply:?}"))),
    }
}

/// `(first slot, last slot, master port)`.
type SlotRange = (u16, u16, u16);

/// `CLUSTER SLOTS` as sorted ranges.
fn cluster_slots(node: &RedisServer) -> Result<Vec<SlotRange>, TestkitError> {
    let reply = node.cmd_timeout(&["CLUSTER", "SLOTS"], NODE_CMD_TIMEOUT)?;
    let bad = |detail: String| TestkitError::UnexpectedReply {
        addr: node.addr().to_string(),
        command: "CLUSTER SLOTS".to_owned(),
        detail,
    };
    let ranges = reply
        .as_array()
        .ok_or_else(|| bad(format!("not an array: {reply:?}")))?;
    let num = |r: Option<&Resp>| r.and_then(Resp::as_int).and_then(|v| u16::try_from(v).ok());
    let mut out = Vec::with_capacity(ranges.len());
    for range in ranges {
        let fields = range
            .as_array()
            .ok_or_else(|| bad(format!("range is not an array: {range:?}")))?;
        let start = num(fields.first());
        let end = num(fields.get(1));
        let port = num(fields
            .get(2)
            .and_then(Resp::as_array)
            .and_then(|m| m.get(1)));
        match (start, end, port) {
            (Some(s), Some(e), Some(p)) if s <= e => out.push((s, e, p)),
            _ => return Err(bad(format!("malformed range {range:?}"))),
        }
    }
    out.sort_unstable();
    Ok(out)
}
