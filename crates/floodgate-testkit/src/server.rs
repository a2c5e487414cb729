//! One real `redis-server` process in a temporary directory.

use std::fmt::Write as _;
use std::fs::OpenOptions;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::TestkitError;
use crate::binary::{self, Binary};
use crate::resp::{Connection, DEFAULT_CONNECT_TIMEOUT, DEFAULT_IO_TIMEOUT, Resp};

/// How long `start`/`restart` wait for `PING` by default.
pub const DEFAULT_STARTUP_TIMEOUT: Duration = Duration::from_secs(5);
/// `cluster-node-timeout` used by default in cluster mode.
pub const DEFAULT_CLUSTER_NODE_TIMEOUT: Duration = Duration::from_millis(2000);

/// How many fresh ports `start` tries when redis cannot bind the chosen one.
const PORT_ATTEMPTS: u32 = 8;
/// How long `pause`/`resume` wait for the kernel to report the new state.
const SIGNAL_SETTLE_TIMEOUT: Duration = Duration::from_secs(2);
/// Lines of each log file included in error messages.
const LOG_TAIL_LINES: usize = 30;

/// Options for starting a [`RedisServer`]. Reusable: [`RedisServerBuilder::start`]
/// takes `&self`.
#[derive(Debug, Clone)]
pub struct RedisServerBuilder {
    binary: Option<PathBuf>,
    config: Vec<String>,
    password: Option<String>,
    cluster: bool,
    cluster_node_timeout: Duration,
    startup_timeout: Duration,
}

impl Default for RedisServerBuilder {
    fn default() -> Self {
        Self {
            binary: None,
            config: Vec::new(),
            password: None,
            cluster: false,
            cluster_node_timeout: DEFAULT_CLUSTER_NODE_TIMEOUT,
            startup_timeout: DEFAULT_STARTUP_TIMEOUT,
        }
    }
}

impl RedisServerBuilder {
    /// Uses this `redis-server` binary (a path, or a bare name looked up on
    /// `PATH`) instead of `$FLOODGATE_REDIS_SERVER` / `PATH`.
    #[must_use]
    pub fn binary(mut self, path: impl Into<PathBuf>) -> Self {
        self.binary = Some(path.into());
        self
    }

    /// Appends a raw `redis.conf` line, e.g. `"notify-keyspace-events KEA"`.
    /// Later lines override earlier ones (and the testkit's defaults).
    #[must_use]
    pub fn config(mut self, line: impl Into<String>) -> Self {
        self.config.push(line.into());
        self
    }

    /// Sets `requirepass` (and `masterauth`); [`RedisServer::url`] and
    /// [`RedisServer::cmd`] then authenticate.
    #[must_use]
    pub fn password(mut self, password: impl Into<String>) -> Self {
        self.password = Some(password.into());
        self
    }

    /// Runs with `cluster-enabled yes` (used by [`crate::RedisCluster`]).
    #[must_use]
    pub fn cluster_enabled(mut self, enabled: bool) -> Self {
        self.cluster = enabled;
        self
    }

    /// `cluster-node-timeout` in cluster mode (default 2000 ms).
    #[must_use]
    pub fn cluster_node_timeout(mut self, timeout: Duration) -> Self {
        self.cluster_node_timeout = timeout;
        self
    }

    /// How long to wait for the server to answer `PING` (default 5 s).
    #[must_use]
    pub fn startup_timeout(mut self, timeout: Duration) -> Self {
        self.startup_timeout = timeout;
        self
    }

    /// Starts the server on a free loopback port and waits until it answers `PING`.
    ///
    /// # Errors
    /// [`TestkitError::BinaryNotFound`] (with a hint to run
    /// `scripts/install-redis`), startup failures and timeouts.
    pub fn start(&self) -> Result<RedisServer, TestkitError> {
        if self.startup_timeout.is_zero() {
            return Err(TestkitError::InvalidArgument(
                "startup timeout must be greater than zero".to_owned(),
            ));
        }
        let binary = binary::find(Binary::Server, self.binary.as_deref())?;
        let dir = tempfile::Builder::new()
            .prefix("floodgate-redis-")
            .tempdir()
            .map_err(|source| TestkitError::File {
                what: "could not create a temporary directory",
                path: std::env::temp_dir(),
                source,
            })?;
        let mut server = RedisServer {
            binary,
            port: 0,
            cluster_port: None,
            password: self.password.clone(),
            startup_timeout: self.startup_timeout,
            config_path: dir.path().join("redis.conf"),
            log_path: dir.path().join("redis.log"),
            output_path: dir.path().join("output.log"),
            state: Mutex::new(State::default()),
            dir,
        };
        let mut last_tail = String::new();
        for _ in 0..PORT_ATTEMPTS {
            let (port, cluster_port) = free_ports(self.cluster)?;
            server.port = port;
            server.cluster_port = cluster_port;
            let config = self.render_config(server.dir(), &server.log_path, port);
            std::fs::write(&server.config_path, config).map_err(|source| TestkitError::File {
                what: "could not write redis.conf",
                path: server.config_path.clone(),
                source,
            })?;
            match server.spawn_and_wait() {
                Ok(()) => return Ok(server),
                Err(TestkitError::ServerExited { log_tail, .. }) if is_bind_failure(&log_tail) => {
                    // Someone took the port between our probe and redis' bind:
                    // try another one.
                    last_tail = log_tail;
                    let _ = std::fs::remove_file(&server.log_path);
                    let _ = std::fs::remove_file(&server.output_path);
                    let _ = std::fs::remove_file(server.dir().join("nodes.conf"));
                }
                Err(e) => return Err(e),
            }
        }
        Err(TestkitError::PortCollisions {
            attempts: PORT_ATTEMPTS,
            log_tail: last_tail,
        })
    }

    fn render_config(&self, dir: &Path, log_path: &Path, port: u16) -> String {
        let mut c = String::new();
        let mut line = |s: &str| {
            c.push_str(s);
            c.push('\n');
        };
        line("# written by floodgate-testkit");
        line(&format!("port {port}"));
        line("bind 127.0.0.1");
        line("daemonize no");
        line(&format!("dir {}", quote(&dir.to_string_lossy())));
        line(&format!("logfile {}", quote(&log_path.to_string_lossy())));
        line("loglevel notice");
        line("save \"\"");
        line("appendonly no");
        match &self.password {
            Some(pw) => {
                line(&format!("requirepass {}", quote(pw)));
                line(&format!("masterauth {}", quote(pw)));
            }
            None => line("protected-mode no"),
        }
        if self.cluster {
            line("cluster-enabled yes");
            let nodes_conf = dir.join("nodes.conf");
            line(&format!(
                "cluster-config-file {}",
                quote(&nodes_conf.to_string_lossy())
            ));
            line(&format!(
                "cluster-node-timeout {}",
                self.cluster_node_timeout.as_millis().max(1)
            ));
            // Replicas may always fail over, however long they were cut off.
            line("cluster-replica-validity-factor 0");
        }
        for extra in &self.config {
            line(extra);
        }
        c
    }
}

/// Quotes a value for `redis.conf` (double quotes, backslash escapes).
fn quote(value: &str) -> String {
    let mut out = String::with_capacity(value.len() + 2);
    out.push('"');
    for ch in value.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn is_bind_failure(log_tail: &str) -> bool {
    log_tail.contains("Address already in use")
        || log_tail.contains("Could not create server TCP listening socket")
        || log_tail.contains("Failed listening on port")
}

/// Offset of the cluster bus port from the client port (Redis' default,
/// which works on every Redis version, unlike the 7.0+ `cluster-port`).
const CLUSTER_BUS_OFFSET: u16 = 10000;

/// Picks a free loopback port; in cluster mode one whose bus port
/// (`port + 10000`) is free too.
fn free_ports(cluster: bool) -> Result<(u16, Option<u16>), TestkitError> {
    let bind = |port: u16| -> Result<(TcpListener, u16), std::io::Error> {
        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, port))?;
        let port = l.local_addr()?.port();
        Ok((l, port))
    };
    let mut last_error = None;
    for _ in 0..64 {
        let (_l1, port) = bind(0).map_err(|source| TestkitError::NoFreePort { source })?;
        if !cluster {
            return Ok((port, None));
        }
        let Some(bus) = port.checked_add(CLUSTER_BUS_OFFSET) else {
            continue;
        };
        match bind(bus) {
            Ok(_) => return Ok((port, Some(bus))),
            Err(e) => last_error = Some(e),
        }
    }
    Err(TestkitError::NoFreePort {
        source: last_error.unwrap_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::AddrNotAvailable,
                "no free port below 55536 with a free cluster bus port (port + 10000)",
            )
        }),
    })
}

#[derive(Debug, Default)]
struct State {
    child: Option<Child>,
    paused: bool,
}

/// A running `redis-server` on `127.0.0.1`, in its own temporary directory,
/// without persistence. Dropping it kills the process (SIGKILL) and removes
/// the directory.
///
/// All methods take `&self` (the process handle is behind a mutex), so a
/// server can be shared between threads and killed from any of them.
#[derive(Debug)]
pub struct RedisServer {
    binary: PathBuf,
    port: u16,
    cluster_port: Option<u16>,
    password: Option<String>,
    startup_timeout: Duration,
    config_path: PathBuf,
    log_path: PathBuf,
    output_path: PathBuf,
    state: Mutex<State>,
    dir: TempDir,
}

impl RedisServer {
    /// Starts a server with default options.
    ///
    /// # Errors
    /// See [`RedisServerBuilder::start`].
    pub fn start() -> Result<Self, TestkitError> {
        Self::builder().start()
    }

    /// Options for starting a server.
    pub fn builder() -> RedisServerBuilder {
        RedisServerBuilder::default()
    }

    /// The TCP port (the same across [`RedisServer::restart`]).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The cluster bus port (`port + 10000`), in cluster mode.
    pub fn cluster_port(&self) -> Option<u16> {
        self.cluster_port
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, self.port))
    }

    /// `redis://127.0.0.1:PORT`, or `redis://:PASSWORD@127.0.0.1:PORT` with a password.
    pub fn url(&self) -> String {
        match &self.password {
            Some(pw) => format!("redis://:{}@127.0.0.1:{}", percent_encode(pw), self.port),
            None => format!("redis://127.0.0.1:{}", self.port),
        }
    }

    /// The password, if one was set.
    pub fn password(&self) -> Option<&str> {
        self.password.as_deref()
    }

    /// The process id, or `None` after [`RedisServer::kill`].
    pub fn pid(&self) -> Option<u32> {
        self.lock().child.as_ref().map(Child::id)
    }

    /// The server's working directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The server's log file.
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// The last lines of the server's log file and of its stdout/stderr.
    pub fn log_tail(&self) -> String {
        log_tail(&self.log_path, &self.output_path)
    }

    /// True while the process exists (also while paused).
    pub fn is_running(&self) -> bool {
        let mut state = self.lock();
        let exited = match state.child.as_mut() {
            None => return false,
            Some(child) => !matches!(child.try_wait(), Ok(None)),
        };
        if exited {
            // It died on its own (or the wait failed): reap it.
            if let Some(mut child) = state.child.take() {
                let _ = child.wait();
            }
            state.paused = false;
        }
        !exited
    }

    /// True between [`RedisServer::pause`] and [`RedisServer::resume`].
    pub fn is_paused(&self) -> bool {
        self.lock().paused
    }

    /// Kills the process with SIGKILL and waits for it to exit. Does nothing
    /// if it is not running.
    ///
    /// # Errors
    /// [`TestkitError::Signal`] if the process cannot be killed or reaped.
    pub fn kill(&self) -> Result<(), TestkitError> {
        let mut state = self.lock();
        kill_child(&mut state)
    }

    /// Freezes the process with SIGSTOP: connections are accepted by the
    /// kernel but nothing is answered. Returns once the kernel reports the
    /// process stopped.
    ///
    /// # Errors
    /// [`TestkitError::NotRunning`] after a kill, or [`TestkitError::Signal`].
    pub fn pause(&self) -> Result<(), TestkitError> {
        let mut state = self.lock();
        let pid = self.running_pid(&mut state, "pause")?;
        send_signal(pid, "STOP")?;
        wait_proc_state(pid, "STOP", |s| s == 'T' || s == 't')?;
        state.paused = true;
        Ok(())
    }

    /// Thaws a paused process with SIGCONT.
    ///
    /// # Errors
    /// [`TestkitError::NotRunning`] after a kill, or [`TestkitError::Signal`].
    pub fn resume(&self) -> Result<(), TestkitError> {
        let mut state = self.lock();
        let pid = self.running_pid(&mut state, "resume")?;
        send_signal(pid, "CONT")?;
        wait_proc_state(pid, "CONT", |s| s != 'T' && s != 't')?;
        state.paused = false;
        Ok(())
    }

    /// Starts the server again on the same port, with the same directory and
    /// config (killing it first if it is running), and waits for `PING`.
    /// Data is lost (there is no persistence); a cluster node keeps its
    /// identity (`nodes.conf`) and rejoins.
    ///
    /// # Errors
    /// Startup failures and timeouts (e.g. if another process took the port).
    pub fn restart(&self) -> Result<(), TestkitError> {
        self.kill()?;
        self.spawn_and_wait()
    }

    /// Opens an authenticated [`Connection`] with default timeouts.
    ///
    /// # Errors
    /// Connection errors, or a failed `AUTH`.
    pub fn connect(&self) -> Result<Connection, TestkitError> {
        self.connect_with(DEFAULT_CONNECT_TIMEOUT, DEFAULT_IO_TIMEOUT)
    }

    /// Opens an authenticated [`Connection`] with the given timeouts.
    ///
    /// # Errors
    /// Connection errors, or a failed `AUTH`.
    pub fn connect_with(
        &self,
        connect_timeout: Duration,
        io_timeout: Duration,
    ) -> Result<Connection, TestkitError> {
        let mut conn = Connection::connect_with(self.addr(), connect_timeout, io_timeout)?;
        if let Some(pw) = &self.password {
            conn.cmd_ok(&["AUTH", pw.as_str()])?;
        }
        Ok(conn)
    }

    /// Runs one command on a fresh connection (read/write timeout 5 s).
    /// Error replies come back as `Ok(Resp::Error(..))`.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), floodgate_testkit::TestkitError> {
    /// let server = floodgate_testkit::RedisServer::start()?;
    /// server.cmd(&["SET", "k", "v"])?;
    /// assert_eq!(server.cmd(&["GET", "k"])?.as_str(), Some("v"));
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// Connection, timeout, I/O and protocol errors.
    pub fn cmd<A: AsRef<[u8]>>(&self, args: &[A]) -> Result<Resp, TestkitError> {
        self.connect()?.cmd(args)
    }

    /// Like [`RedisServer::cmd`] with the given connect and read/write timeout.
    ///
    /// # Errors
    /// Connection, timeout ([`TestkitError::is_timeout`]), I/O and protocol errors.
    pub fn cmd_timeout<A: AsRef<[u8]>>(
        &self,
        args: &[A],
        timeout: Duration,
    ) -> Result<Resp, TestkitError> {
        self.connect_with(timeout, timeout)?.cmd(args)
    }

    /// Like [`RedisServer::cmd`], but an error reply is an `Err`
    /// ([`TestkitError::ServerError`]).
    ///
    /// # Errors
    /// As [`RedisServer::cmd`], plus [`TestkitError::ServerError`].
    pub fn cmd_ok<A: AsRef<[u8]>>(&self, args: &[A]) -> Result<Resp, TestkitError> {
        self.connect()?.cmd_ok(args)
    }

    /// The value of `field` in `INFO <section>` (`None` when the reply has no such field).
    ///
    /// # Errors
    /// As [`RedisServer::cmd_ok`].
    pub fn info(&self, section: &str, field: &str) -> Result<Option<String>, TestkitError> {
        let reply = self.cmd_ok(&["INFO", section])?;
        let text = String::from_utf8_lossy(reply.as_bytes().unwrap_or_default()).into_owned();
        Ok(info_field(&text, field).map(str::to_owned))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn running_pid(&self, state: &mut State, action: &'static str) -> Result<u32, TestkitError> {
        let alive = match state.child.as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        };
        match state.child.as_ref() {
            Some(child) if alive => Ok(child.id()),
            _ => Err(TestkitError::NotRunning {
                port: self.port,
                action,
            }),
        }
    }

    /// Spawns `redis-server redis.conf` and waits until it answers `PING`
    /// (checking it is our process that answers).
    fn spawn_and_wait(&self) -> Result<(), TestkitError> {
        let mut state = self.lock();
        kill_child(&mut state)?;
        let output = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.output_path)
            .map_err(|source| TestkitError::File {
                what: "could not open the server's output file",
                path: self.output_path.clone(),
                source,
            })?;
        let output_err = output.try_clone().map_err(|source| TestkitError::File {
            what: "could not open the server's output file",
            path: self.output_path.clone(),
            source,
        })?;
        let child = Command::new(&self.binary)
            .arg(&self.config_path)
            .current_dir(self.dir())
            .stdin(Stdio::null())
            .stdout(output)
            .stderr(output_err)
            .spawn()
            .map_err(|source| TestkitError::Spawn {
                binary: self.binary.clone(),
                source,
            })?;
        let pid = child.id();
        state.child = Some(child);
        state.paused = false;

        let started = Instant::now();
        let deadline = started + self.startup_timeout;
        loop {
            if let Some(child) = state.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                state.child = None;
                return Err(TestkitError::ServerExited {
                    port: self.port,
                    status: status.to_string(),
                    log_tail: self.log_tail(),
                });
            }
            let last_error = match self.probe(pid) {
                Ok(()) => return Ok(()),
                Err(e) => e,
            };
            if Instant::now() >= deadline {
                kill_child(&mut state)?;
                return Err(TestkitError::StartTimeout {
                    port: self.port,
                    waited: started.elapsed(),
                    last_error,
                    log_tail: self.log_tail(),
                });
            }
            thread::sleep(Duration::from_millis(10));
        }
    }

    /// PINGs the server and checks that the answering process is `pid`.
    fn probe(&self, pid: u32) -> Result<(), String> {
        let short = Duration::from_millis(500);
        let mut conn = self.connect_with(short, short).map_err(|e| e.to_string())?;
        let pong = conn.cmd(&["PING"]).map_err(|e| e.to_string())?;
        if pong.as_str() != Some("PONG") {
            return Err(format!("PING answered {pong:?}"));
        }
        let info = conn
            .cmd_ok(&["INFO", "server"])
            .map_err(|e| e.to_string())?;
        let info = info.as_str().unwrap_or_default();
        let answering = info_field(info, "process_id");
        if answering != Some(&*pid.to_string()) {
            return Err(format!(
                "port {} is answered by process {answering:?}, not by our redis-server (pid {pid})",
                self.port
            ));
        }
        Ok(())
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let mut state = self.lock();
        let _ = kill_child(&mut state);
    }
}

/// The value of `field:value` in an `INFO` or `CLUSTER INFO` reply.
pub(crate) fn info_field<'a>(info: &'a str, field: &str) -> Option<&'a str> {
    info.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k == field).then(|| v.trim())
    })
}

fn kill_child(state: &mut State) -> Result<(), TestkitError> {
    state.paused = false;
    let Some(mut child) = state.child.take() else {
        return Ok(());
    };
    let pid = child.id();
    // SIGKILL also ends a stopped process; no SIGCONT needed.
    if let Err(e) = child.kill() {
        // Put it back so Drop can try again.
        state.child = Some(child);
        return Err(TestkitError::Signal {
            pid,
            signal: "KILL",
            detail: e.to_string(),
        });
    }
    child.wait().map_err(|e| TestkitError::Signal {
        pid,
        signal: "KILL",
        detail: format!("killed but could not reap it: {e}"),
    })?;
    Ok(())
}

/// Sends a signal with the `kill` program (no `unsafe` libc call).
fn send_signal(pid: u32, signal: &'static str) -> Result<(), TestkitError> {
    let pid_text = pid.to_string();
    let run = |program: &str, args: &[&str]| {
        Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
    };
    let flag = format!("-{signal}");
    let output = match run("kill", &[&flag, &pid_text]) {
        // No `kill` binary: use the shell's builtin.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => run(
            "sh",
            &["-c", "kill -s \"$1\" \"$2\"", "sh", signal, &pid_text],
        ),
        other => other,
    };
    match output {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => Err(TestkitError::Signal {
            pid,
            signal,
            detail: format!(
                "kill exited with {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        }),
        Err(e) => Err(TestkitError::Signal {
            pid,
            signal,
            detail: format!("could not run kill: {e}"),
        }),
    }
}

/// Waits until `/proc/PID/stat` shows a state accepted by `done` (Linux);
/// without `/proc` it returns at once.
fn wait_proc_state(
    pid: u32,
    signal: &'static str,
    done: impl Fn(char) -> bool,
) -> Result<(), TestkitError> {
    let path = PathBuf::from(format!("/proc/{pid}/stat"));
    if !Path::new("/proc/self/stat").exists() {
        return Ok(());
    }
    let deadline = Instant::now() + SIGNAL_SETTLE_TIMEOUT;
    let mut last = String::new();
    loop {
        match std::fs::read_to_string(&path) {
            Ok(stat) => {
                // Format: "pid (comm) S ...": the state follows the last ')'.
                let state = stat
                    .rsplit_once(')')
                    .and_then(|(_, rest)| rest.trim_start().chars().next());
                if let Some(s) = state {
                    if done(s) {
                        return Ok(());
                    }
                    last = format!("process state is still {s:?}");
                }
            }
            Err(e) => last = format!("cannot read {}: {e}", path.display()),
        }
        if Instant::now() >= deadline {
            return Err(TestkitError::Signal {
                pid,
                signal,
                detail: format!("no effect after {SIGNAL_SETTLE_TIMEOUT:?}: {last}"),
            });
        }
        thread::sleep(Duration::from_millis(2));
    }
}

fn log_tail(log_path: &Path, output_path: &Path) -> String {
    let mut out = String::new();
    for (name, path) in [("log", log_path), ("stdout/stderr", output_path)] {
        match std::fs::read(path) {
            Ok(bytes) if !bytes.is_empty() => {
                let text = String::from_utf8_lossy(&bytes);
                let lines: Vec<&str> = text.lines().collect();
                let from = lines.len().saturating_sub(LOG_TAIL_LINES);
                let _ = writeln!(out, "--- {name} ({}) ---", path.display());
                for l in &lines[from..] {
                    let _ = writeln!(out, "{l}");
                }
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                let _ = writeln!(out, "--- {name}: cannot read {}: {e} ---", path.display());
            }
        }
    }
    if out.is_empty() {
        out.push_str("(no log output)");
    }
    out
}

/// Percent-encodes everything but RFC 3986 unreserved characters.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_and_encoding() {
        assert_eq!(quote(r#"a "b" \c"#), r#""a \"b\" \\c""#);
        assert_eq!(percent_encode("p@ss w/rd"), "p%40ss%20w%2Frd");
    }

    #[test]
    fn info_fields() {
        let info = "# Server\r\nredis_version:7.0.15\r\nprocess_id:42\r\n";
        assert_eq!(info_field(info, "process_id"), Some("42"));
        assert_eq!(info_field(info, "missing"), None);
    }

    #[test]
    fn config_has_no_persistence_and_loopback_only() {
        let b = RedisServer::builder()
            .cluster_enabled(true)
            .config("notify-keyspace-events KEA");
        let c = b.render_config(Path::new("/tmp/x"), Path::new("/tmp/x/redis.log"), 7000);
        for expected in [
            "port 7000\n",
            "bind 127.0.0.1\n",
            "save \"\"\n",
            "appendonly no\n",
            "protected-mode no\n",
            "daemonize no\n",
            "cluster-enabled yes\n",
            "cluster-node-timeout 2000\n",
            "cluster-config-file \"/tmp/x/nodes.conf\"\n",
            "notify-keyspace-events KEA\n",
        ] {
            assert!(c.contains(expected), "missing {expected:?} in\n{c}");
        }
        let c = RedisServer::builder().password("pw").render_config(
            Path::new("/d"),
            Path::new("/d/l"),
            1,
        );
        assert!(c.contains("requirepass \"pw\"\n"), "{c}");
        assert!(!c.contains("protected-mode"), "{c}");
        assert!(!c.contains("cluster"), "{c}");
    }
}
