//! The one error type of this crate.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// Everything that can go wrong while starting, driving or talking to a test
/// Redis server or cluster.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TestkitError {
    /// A Redis binary (`redis-server` or `redis-cli`) could not be found.
    #[error(
        "{binary} not found: {detail}; install Redis by running `scripts/install-redis` \
         (or set {env_var} to the path of a {binary} binary)"
    )]
    BinaryNotFound {
        /// `redis-server` or `redis-cli`.
        binary: &'static str,
        /// The environment variable that can point at the binary.
        env_var: &'static str,
        /// Where we looked.
        detail: String,
    },

    /// The temporary directory or a file in it could not be created or read.
    #[error("{what} ({path}): {source}")]
    File {
        /// What we were doing.
        what: &'static str,
        /// The path involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },

    /// No free loopback port could be found.
    #[error("could not find a free port on 127.0.0.1: {source}")]
    NoFreePort {
        /// The underlying error.
        #[source]
        source: io::Error,
    },

    /// A command ran and failed.
    #[error("{command} failed: {detail}")]
    CommandFailed {
        /// The command and its arguments.
        command: String,
        /// What it printed on stderr.
        detail: String,
    },

    /// A process could not be spawned.
    #[error("could not run {binary}: {source}")]
    Spawn {
        /// The binary we tried to run.
        binary: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },

    /// `redis-server` exited before it answered `PING`.
    #[error("redis-server on port {port} exited during startup ({status}); log tail:\n{log_tail}")]
    ServerExited {
        /// The port the server was started on.
        port: u16,
        /// The exit status, as text.
        status: String,
        /// The last lines of the server's log and stderr.
        log_tail: String,
    },

    /// `redis-server` kept failing to bind a port that was free a moment
    /// before (another process took it each time).
    #[error(
        "redis-server could not bind a free port after {attempts} attempts; last log tail:\n{log_tail}"
    )]
    PortCollisions {
        /// How many ports were tried.
        attempts: u32,
        /// The last lines of the last attempt's log.
        log_tail: String,
    },

    /// `redis-server` did not answer `PING` in time.
    #[error(
        "redis-server on port {port} did not answer PING within {waited:?} (last error: {last_error}); log tail:\n{log_tail}"
    )]
    StartTimeout {
        /// The port the server was started on.
        port: u16,
        /// How long we waited.
        waited: Duration,
        /// The last error seen while pinging.
        last_error: String,
        /// The last lines of the server's log and stderr.
        log_tail: String,
    },

    /// The server is not running (it was killed), so the operation cannot be done.
    #[error("redis-server on port {port} is not running; cannot {action}")]
    NotRunning {
        /// The server's port.
        port: u16,
        /// What was attempted.
        action: &'static str,
    },

    /// Sending a signal to a process failed.
    #[error("could not send SIG{signal} to pid {pid}: {detail}")]
    Signal {
        /// The process id.
        pid: u32,
        /// The signal name without the `SIG` prefix.
        signal: &'static str,
        /// What went wrong.
        detail: String,
    },

    /// Connecting to a server failed.
    #[error("could not connect to {addr}: {source}")]
    Connect {
        /// The address.
        addr: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },

    /// A read or write on a connection did not complete in time.
    #[error("{op} on {addr} timed out after {timeout:?}")]
    Timeout {
        /// The address.
        addr: String,
        /// `read` or `write` (and for which command).
        op: String,
        /// The timeout that expired.
        timeout: Duration,
    },

    /// Any other I/O error on a connection.
    #[error("{op} on {addr} failed: {source}")]
    Io {
        /// The address.
        addr: String,
        /// What we were doing.
        op: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },

    /// The server sent something that is not valid RESP2.
    #[error("protocol error from {addr}: {detail}")]
    Protocol {
        /// The address.
        addr: String,
        /// What was wrong.
        detail: String,
    },

    /// The server answered a command with an error reply (only returned by
    /// the `*_ok` helpers; plain `cmd` returns `Resp::Error`).
    #[error("{addr} answered `{command}` with error: {message}")]
    ServerError {
        /// The address.
        addr: String,
        /// The command (first argument), lossily decoded.
        command: String,
        /// The error message.
        message: String,
    },

    /// A reply did not have the expected shape.
    #[error("unexpected reply from {addr} to `{command}`: {detail}")]
    UnexpectedReply {
        /// The address.
        addr: String,
        /// The command.
        command: String,
        /// What was wrong.
        detail: String,
    },

    /// `redis-cli --cluster create` failed.
    #[error("`redis-cli --cluster create` failed ({status}); output:\n{output}")]
    ClusterCreate {
        /// The exit status, as text.
        status: String,
        /// Its stdout and stderr.
        output: String,
    },

    /// The cluster did not become healthy in time.
    #[error("cluster not healthy after {waited:?}: {detail}")]
    ClusterUnhealthy {
        /// How long we waited.
        waited: Duration,
        /// The last reason it was not healthy.
        detail: String,
    },

    /// An argument was out of range or inconsistent.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl TestkitError {
    /// True for timeouts: a read/write timeout on a connection, a server that
    /// did not answer `PING` in time, or a cluster that did not become healthy.
    pub fn is_timeout(&self) -> bool {
        matches!(
            self,
            Self::Timeout { .. } | Self::StartTimeout { .. } | Self::ClusterUnhealthy { .. }
        )
    }

    /// True when a connection could not be established (e.g. the server was killed).
    pub fn is_connect(&self) -> bool {
        matches!(self, Self::Connect { .. })
    }

    /// True when `redis-server` or `redis-cli` was not found.
    pub fn is_binary_not_found(&self) -> bool {
        matches!(self, Self::BinaryNotFound { .. })
    }

    /// True when the server answered with an error reply.
    pub fn is_server_error(&self) -> bool {
        matches!(self, Self::ServerError { .. })
    }
}
