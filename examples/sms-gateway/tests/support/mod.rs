//! Runs the real `sms-gateway` binary for tests, and talks HTTP to it.

#![allow(dead_code, unreachable_pub)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// A running gateway; killed on drop.
pub struct Gateway {
    child: Option<Child>,
    pub port: u16,
    pub outbox: PathBuf,
    pub instance: String,
}

/// The `instance` that `/healthz` on `port` names, if something there answers it.
fn healthz_instance(port: u16) -> Option<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    stream
        .write_all(b"GET /healthz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .ok()?;
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply).ok()?;
    let at = reply.windows(4).position(|w| w == b"\r\n\r\n")?;
    let body: Value = serde_json::from_slice(&reply[at + 4..]).ok()?;
    body["instance"].as_str().map(str::to_owned)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

impl Gateway {
    /// Starts the binary with `env` on a free port, its outbox in `dir`. A port taken between
    /// finding it free and the gateway binding it (by another test's process) makes the
    /// gateway exit: it is started again on another port, up to five times.
    pub fn start(dir: &Path, instance: &str, env: &[(&str, &str)]) -> Gateway {
        Gateway::start_with(dir, instance, env, None)
    }

    /// [`Gateway::start`] with an open-file limit: `(soft, hard)`.
    pub fn start_with(
        dir: &Path,
        instance: &str,
        env: &[(&str, &str)],
        open_files: Option<(u64, u64)>,
    ) -> Gateway {
        let outbox = dir.join(format!("outbox-{instance}.jsonl"));
        let mut last = String::new();
        for _ in 0..5 {
            let port = free_port();
            let mut cmd = command(&outbox, instance, env, open_files);
            cmd.env("LISTEN", format!("127.0.0.1:{port}"))
                .stdout(Stdio::null())
                .stderr(Stdio::inherit());
            let child = cmd.spawn().expect("start sms-gateway");
            let mut gw = Gateway {
                child: Some(child),
                port,
                outbox: outbox.clone(),
                instance: instance.to_owned(),
            };
            match gw.wait_ready() {
                Ok(()) => return gw,
                // Dropped: killed if still running.
                Err(why) => last = why,
            }
        }
        panic!("sms-gateway {instance} did not start: {last}");
    }

    /// Waits until this process answers `/healthz` as this instance (not another test's
    /// gateway on the same port); an error if it exits first or takes too long.
    fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                self.child = None;
                return Err(format!(
                    "exited ({status}) before listening on {}",
                    self.port
                ));
            }
            if healthz_instance(self.port).as_deref() == Some(self.instance.as_str()) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(format!("did not answer on {} in time", self.port))
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// Kills the process at once (a crash: no graceful shutdown, no lock release).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends SIGTERM and waits for a clean exit.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let child = self.child.as_mut().expect("running");
        let pid = child.id().to_string();
        // The `kill` program (procps) may be missing from slim images: the shell's builtin.
        let sent = match Command::new("kill").args(["-TERM", &pid]).status() {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Command::new("sh")
                .args(["-c", "kill -s TERM \"$1\"", "sh", &pid])
                .status(),
            other => other,
        };
        assert!(
            sent.as_ref().is_ok_and(std::process::ExitStatus::success),
            "could not send SIGTERM to {pid}: {sent:?}"
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return status;
            }
            assert!(Instant::now() < deadline, "no exit after SIGTERM");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The JSON lines of this replica's outbox.
    pub fn outbox_lines(&self) -> Vec<Value> {
        match std::fs::read_to_string(&self.outbox) {
            Ok(text) => text
                .lines()
                .map(|l| serde_json::from_str(l).expect("outbox lines are JSON"))
                .collect(),
            Err(_) => Vec::new(),
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The gateway's command with `env`, its outbox `outbox`, under an open-file limit
/// `(soft, hard)` when given (set by the shell that then runs it).
fn command(
    outbox: &Path,
    instance: &str,
    env: &[(&str, &str)],
    open_files: Option<(u64, u64)>,
) -> Command {
    let bin = env!("CARGO_BIN_EXE_sms-gateway");
    let mut cmd = match open_files {
        None => Command::new(bin),
        Some((soft, hard)) => {
            let mut sh = Command::new("sh");
            sh.args([
                "-c",
                r#"ulimit -S -n "$2" && ulimit -H -n "$1" && exec "$0""#,
                bin,
                &hard.to_string(),
                &soft.to_string(),
            ]);
            sh
        }
    };
    cmd.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("RUST_LOG", "warn")
        .env("OUTBOX_PATH", outbox)
        .env("INSTANCE_ID", instance);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// Runs the gateway with `env` under an open-file limit `(soft, hard)`, expecting it to refuse
/// to start: its exit status and what it wrote to stderr. A panic if it is still running after
/// 15 s.
pub fn start_refused(
    dir: &Path,
    env: &[(&str, &str)],
    open_files: (u64, u64),
) -> (std::process::ExitStatus, String) {
    use std::io::Read;
    let outbox = dir.join("outbox-refused.jsonl");
    let mut cmd = command(&outbox, "refused", env, Some(open_files));
    cmd.env("LISTEN", format!("127.0.0.1:{}", free_port()))
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("start sms-gateway");
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the gateway started with {env:?} under {open_files:?} open files");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    if let Some(mut err) = child.stderr.take() {
        let _ = err.read_to_string(&mut stderr);
    }
    (status, stderr)
}

/// The open-file limit of `gw`'s process: `(soft, hard)`, from /proc.
pub fn open_file_limit(gw: &Gateway) -> (u64, u64) {
    let pid = gw.child.as_ref().expect("running").id();
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("/proc limits");
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("an open-file limit");
    let mut numbers = line
        .split_whitespace()
        .filter_map(|w| w.parse::<u64>().ok());
    (
        numbers.next().expect("a soft limit"),
        numbers.next().expect("a hard limit"),
    )
}

/// A minimal HTTP client.
#[derive(Clone)]
pub struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
}

pub struct Reply {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Value,
}

impl Http {
    pub fn new() -> Http {
        Http {
            client: Client::builder(TokioExecutor::new()).build_http(),
        }
    }

    pub async fn send(
        &self,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Reply {
        let mut req = http::Request::builder().method(method).uri(url);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req
            .body(Full::new(Bytes::from(body.to_owned())))
            .expect("request");
        let resp = tokio::time::timeout(Duration::from_secs(20), self.client.request(req))
            .await
            .expect("no reply in 20 s")
            .expect("HTTP request");
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let bytes = resp.into_body().collect().await.expect("body").to_bytes();
        let body = serde_json::from_slice(&bytes)
            .unwrap_or(Value::String(String::from_utf8_lossy(&bytes).into_owned()));
        Reply {
            status,
            headers,
            body,
        }
    }

    pub async fn post(&self, url: &str, body: &str) -> Reply {
        self.send("POST", url, &[("content-type", "application/json")], body)
            .await
    }

    pub async fn get(&self, url: &str) -> Reply {
        self.send("GET", url, &[], "").await
    }
}

pub fn sms(phone: &str, text: &str) -> String {
    serde_json::json!({"phone": phone, "text": text}).to_string()
}

pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "sms-gateway-{name}-{}-{}",
        std::process::id(),
        fastrand::u64(..)
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// Waits for campaign `id` to complete, polling `gw`; returns its progress.
pub async fn wait_campaign(http: &Http, gateways: &[&Gateway], id: &str, limit: Duration) -> Value {
    let deadline = Instant::now() + limit;
    loop {
        for gw in gateways {
            let r = http.get(&gw.url(&format!("/v1/campaigns/{id}"))).await;
            if r.status == 200 && r.body["status"] == "completed" {
                return r.body;
            }
        }
        assert!(
            Instant::now() < deadline,
            "campaign {id} not completed within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// How the test webhook answers.
pub const TAKE: u8 = 0;
pub const REFUSE: u8 = 1;
pub const STALL: u8 = 2;
/// Refuses (422) after two seconds: the gateway has counted the message meanwhile.
pub const SLOW_REFUSE: u8 = 3;
/// Busy: `429` with `Retry-After: 1`.
pub const THROTTLE: u8 = 4;

/// A webhook on loopback that takes messages (200), refuses them (422), is busy (429) or never
/// answers, as `mode` says; returns its address and the count of messages it took.
pub async fn webhook(
    mode: std::sync::Arc<std::sync::atomic::AtomicU8>,
) -> (String, std::sync::Arc<std::sync::atomic::AtomicU64>) {
    use std::sync::atomic::Ordering;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let taken = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let count = std::sync::Arc::clone(&taken);
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let (mode, count) = (std::sync::Arc::clone(&mode), std::sync::Arc::clone(&count));
            tokio::spawn(async move {
                // One request per connection: read to the end of the body, answer, close.
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    let Ok(n) = stream.read(&mut chunk).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    let text = String::from_utf8_lossy(&buf).to_ascii_lowercase();
                    if let Some(end) = text.find("\r\n\r\n") {
                        let len = text[..end]
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse::<usize>().ok())
                            .unwrap_or(0);
                        if buf.len() >= end + 4 + len {
                            break;
                        }
                    }
                }
                let status = match mode.load(Ordering::SeqCst) {
                    REFUSE => "422 Unprocessable Entity",
                    THROTTLE => "429 Too Many Requests\r\nretry-after: 1",
                    SLOW_REFUSE => {
                        tokio::time::sleep(Duration::from_secs(2)).await;
                        "422 Unprocessable Entity"
                    }
                    STALL => {
                        tokio::time::sleep(Duration::from_secs(30)).await;
                        return;
                    }
                    _ => {
                        count.fetch_add(1, Ordering::SeqCst);
                        "200 OK"
                    }
                };
                let reply =
                    format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
                let _ = stream.write_all(reply.as_bytes()).await;
            });
        }
    });
    (format!("http://{addr}/hook"), taken)
}
