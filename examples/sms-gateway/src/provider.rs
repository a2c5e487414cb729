//! Where messages go: the [`SmsProvider`] trait, an append-only outbox file, and a webhook.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};
use tokio::sync::Mutex;

/// One message to send.
#[derive(Clone, Debug, Serialize)]
pub struct OutboundSms {
    pub id: String,
    pub phone: String,
    pub text: String,
    /// The campaign it belongs to, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub campaign: Option<String>,
    /// Which replica sent it.
    pub instance: String,
    /// Unix time in milliseconds.
    pub sent_at_ms: u64,
}

/// A provider failed to take a message.
#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    /// The message certainly did not go out (the provider refused it, or was never reached).
    #[error("{0}")]
    NotSent(String),
    /// The outcome is unknown (a timeout, a connection lost after the message was handed
    /// over): it may have gone out.
    #[error("{0}")]
    Unknown(String),
    /// The provider is busy (`429`, or `503`): the message did not go out, and the provider
    /// asks for a pause, of `retry_after` when it said how long.
    #[error("{message}")]
    Throttled {
        message: String,
        retry_after: Option<Duration>,
    },
    /// Not handed to the provider: it asked for a pause ([`ProviderError::Throttled`]) that
    /// has this long to run ([`PauseWhenBusy`]).
    #[error("the provider asked for a pause; {} ms to go", .0.as_millis())]
    Paused(Duration),
}

impl ProviderError {
    /// Whether the message certainly did not go out (and may be given back to the limits).
    pub fn not_sent(&self) -> bool {
        matches!(
            self,
            ProviderError::NotSent(_) | ProviderError::Throttled { .. } | ProviderError::Paused(_)
        )
    }

    /// How long to pause before the next message when the provider is busy (`None`
    /// otherwise): what it asked for, from 100 ms to a minute, or a second when it did not say;
    /// for a message held back, what is left of the pause.
    pub fn pause(&self) -> Option<Duration> {
        match self {
            ProviderError::Throttled { retry_after, .. } => Some(
                retry_after
                    .unwrap_or(Duration::from_secs(1))
                    .clamp(Duration::from_millis(100), Duration::from_secs(60)),
            ),
            ProviderError::Paused(left) => Some(*left),
            _ => None,
        }
    }

    /// Whether the provider was asked, and used capacity to answer: every error but a message
    /// held back for a pause.
    pub fn reached_provider(&self) -> bool {
        !matches!(self, ProviderError::Paused(_))
    }

    /// The error's text.
    pub fn message(&self) -> &str {
        match self {
            ProviderError::NotSent(m)
            | ProviderError::Unknown(m)
            | ProviderError::Throttled { message: m, .. } => m,
            ProviderError::Paused(_) => "the provider asked for a pause",
        }
    }
}

/// What [`SmsProvider::send`] returns: the send, to await.
pub type Sending<'a> = Pin<Box<dyn Future<Output = Result<(), ProviderError>> + Send + 'a>>;

/// Sends messages. Implementations must be safe to call from many tasks at once.
pub trait SmsProvider: Send + Sync + 'static {
    /// Sends one message.
    fn send<'a>(&'a self, sms: &'a OutboundSms) -> Sending<'a>;
}

/// A provider that honours its busy answers: after a [`ProviderError::Throttled`], messages
/// are held back ([`ProviderError::Paused`], without calling it) until the pause it asked for
/// has passed, rather than sent to a provider that turns them away. In this process: each
/// replica keeps the pauses it was asked for.
pub struct PauseWhenBusy {
    inner: Arc<dyn SmsProvider>,
    epoch: Instant,
    /// Milliseconds since `epoch` until which messages are held back.
    until_ms: AtomicU64,
}

impl PauseWhenBusy {
    pub fn new(inner: Arc<dyn SmsProvider>) -> Arc<Self> {
        Arc::new(PauseWhenBusy {
            inner,
            epoch: Instant::now(),
            until_ms: AtomicU64::new(0),
        })
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

impl std::fmt::Debug for PauseWhenBusy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PauseWhenBusy")
            .field("until_ms", &self.until_ms)
            .finish_non_exhaustive()
    }
}

impl SmsProvider for PauseWhenBusy {
    fn send<'a>(&'a self, sms: &'a OutboundSms) -> Sending<'a> {
        Box::pin(async move {
            let now = self.now_ms();
            let until = self.until_ms.load(Ordering::Relaxed);
            if now < until {
                return Err(ProviderError::Paused(Duration::from_millis(until - now)));
            }
            let sent = self.inner.send(sms).await;
            if let Some(pause) = sent.as_ref().err().and_then(ProviderError::pause) {
                let until = self
                    .now_ms()
                    .saturating_add(u64::try_from(pause.as_millis()).unwrap_or(u64::MAX));
                self.until_ms.fetch_max(until, Ordering::Relaxed);
            }
            sent
        })
    }
}

/// Appends every message as one JSON line to a file, and logs it.
#[derive(Debug)]
pub struct FileProvider {
    path: PathBuf,
    file: Mutex<Option<tokio::fs::File>>,
    /// Whether the last write failed, and may have left part of its line.
    torn: AtomicBool,
}

impl FileProvider {
    pub fn new(path: impl Into<PathBuf>) -> Arc<Self> {
        Arc::new(FileProvider {
            path: path.into(),
            file: Mutex::new(None),
            torn: AtomicBool::new(false),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl SmsProvider for FileProvider {
    fn send<'a>(&'a self, sms: &'a OutboundSms) -> Sending<'a> {
        Box::pin(async move {
            let mut line =
                serde_json::to_vec(sms).map_err(|e| ProviderError::NotSent(e.to_string()))?;
            line.push(b'\n');
            let mut file = self.file.lock().await;
            // Cleared once a line is written: a reopening that fails keeps it for the next.
            if self.torn.load(Ordering::Relaxed) && ends_mid_line(&self.path).await {
                line.insert(0, b'\n');
            }
            if file.is_none() {
                let opened = tokio::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&self.path)
                    .await
                    .map_err(|e| ProviderError::NotSent(format!("{}: {e}", self.path.display())))?;
                *file = Some(opened);
            }
            if let Some(f) = file.as_mut() {
                // One write of the whole line, then to disk: a line is either there or not.
                // `write_all` on a tokio file only hands the write to a blocking thread: its
                // error (a full disk) comes from `flush`, which waits for it (`sync_data` would
                // keep it for the next write, and report this line sent).
                let written = async {
                    f.write_all(&line).await?;
                    f.flush().await?;
                    f.sync_data().await
                }
                .await;
                if let Err(e) = written {
                    // A failed write may have left part of the line: the outcome is unknown.
                    // The file is opened again for the next line, which starts on a line of
                    // its own.
                    *file = None;
                    self.torn.store(true, Ordering::Relaxed);
                    return Err(ProviderError::Unknown(format!(
                        "{}: {e}",
                        self.path.display()
                    )));
                }
                self.torn.store(false, Ordering::Relaxed);
            }
            tracing::info!(id = %sms.id, phone = %sms.phone, campaign = ?sms.campaign, "sms sent");
            Ok(())
        })
    }
}

/// Whether the file at `path` ends with part of a line (a write that failed half-way).
async fn ends_mid_line(path: &Path) -> bool {
    let last = async {
        let mut f = tokio::fs::File::open(path).await?;
        f.seek(std::io::SeekFrom::End(-1)).await?;
        f.read_u8().await
    };
    // Empty (seeking before its start is refused) or gone: nothing to end. Otherwise
    // unreadable: taken as torn (an empty line is better than two lines joined).
    match last.await {
        Ok(b) => b != b'\n',
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::InvalidInput | std::io::ErrorKind::NotFound
        ),
    }
}

/// POSTs every message as JSON to a URL (plain HTTP).
#[derive(Debug)]
pub struct WebhookProvider {
    url: http::Uri,
    client: Client<HttpConnector, Full<Bytes>>,
}

impl WebhookProvider {
    pub fn new(url: &str) -> Result<Arc<Self>, ProviderError> {
        let url: http::Uri = url
            .parse()
            .map_err(|e| ProviderError::NotSent(format!("webhook_url {url:?}: {e}")))?;
        if url.scheme_str() != Some("http") {
            return Err(ProviderError::NotSent(
                "webhook_url must be an http:// URL".into(),
            ));
        }
        let client = Client::builder(TokioExecutor::new()).build_http();
        Ok(Arc::new(WebhookProvider { url, client }))
    }
}

impl SmsProvider for WebhookProvider {
    fn send<'a>(&'a self, sms: &'a OutboundSms) -> Sending<'a> {
        Box::pin(async move {
            let body =
                serde_json::to_vec(sms).map_err(|e| ProviderError::NotSent(e.to_string()))?;
            let req = http::Request::post(self.url.clone())
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(Full::new(Bytes::from(body)))
                .map_err(|e| ProviderError::NotSent(e.to_string()))?;
            // The whole exchange, body included, within the timeout: a webhook that answers
            // its headers and then stalls must not hold the dispatcher (or shutdown) for good.
            let exchange = async {
                let resp = self.client.request(req).await?;
                let status = resp.status();
                let retry_after = retry_after(resp.headers());
                let _ = resp.into_body().collect().await;
                Ok::<_, hyper_util::client::legacy::Error>((status, retry_after))
            };
            // A webhook never reached (refused, unroutable) or that answered an error did not
            // take the message; a timeout or a connection lost mid-exchange may have.
            let (status, retry_after) = tokio::time::timeout(Duration::from_secs(5), exchange)
                .await
                .map_err(|_| ProviderError::Unknown("webhook timed out after 5s".into()))?
                .map_err(|e| {
                    let message = format!("webhook: {e}");
                    if e.is_connect() {
                        ProviderError::NotSent(message)
                    } else {
                        ProviderError::Unknown(message)
                    }
                })?;
            // A 429 or a 503 says the message was not handled, and asks for a pause; another
            // 4xx refused it; other errors (a 500, a proxy's 502 or 504) may come after the
            // message went out.
            if status == http::StatusCode::TOO_MANY_REQUESTS
                || status == http::StatusCode::SERVICE_UNAVAILABLE
            {
                return Err(ProviderError::Throttled {
                    message: format!("webhook answered {status}"),
                    retry_after,
                });
            }
            if status.is_client_error() {
                return Err(ProviderError::NotSent(format!("webhook answered {status}")));
            }
            if !status.is_success() {
                return Err(ProviderError::Unknown(format!("webhook answered {status}")));
            }
            Ok(())
        })
    }
}

/// A `Retry-After`: seconds, or an HTTP date (a date past is no pause).
fn retry_after(headers: &http::HeaderMap) -> Option<Duration> {
    let value = headers
        .get(http::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(
        at.duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A provider busy once (a pause of 0 s asked: 100 ms), then taking messages; counts
    /// its calls.
    #[derive(Debug, Default)]
    struct BusyOnce(AtomicU64);

    impl SmsProvider for BusyOnce {
        fn send<'a>(&'a self, _: &'a OutboundSms) -> Sending<'a> {
            Box::pin(async move {
                if self.0.fetch_add(1, Ordering::SeqCst) == 0 {
                    return Err(ProviderError::Throttled {
                        message: "busy".into(),
                        retry_after: Some(Duration::ZERO),
                    });
                }
                Ok(())
            })
        }
    }

    #[tokio::test]
    async fn a_busy_providers_pause_holds_every_message_back() {
        let inner = Arc::new(BusyOnce::default());
        let provider = PauseWhenBusy::new(Arc::clone(&inner) as Arc<dyn SmsProvider>);
        let first = provider.send(&sms("a")).await;
        assert!(
            matches!(first, Err(ProviderError::Throttled { .. })),
            "{first:?}"
        );
        // Held back, the provider not asked: what is left of the pause.
        let held = provider.send(&sms("b")).await;
        match &held {
            Err(e @ ProviderError::Paused(left)) => {
                assert!(*left <= Duration::from_millis(100), "{left:?}");
                assert!(e.not_sent() && !e.reached_provider());
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(inner.0.load(Ordering::SeqCst), 1);
        tokio::time::sleep(Duration::from_millis(150)).await;
        provider
            .send(&sms("c"))
            .await
            .expect("sent after the pause");
        assert_eq!(inner.0.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_busy_providers_pause_is_bounded() {
        let busy = |secs: Option<u64>| ProviderError::Throttled {
            message: "busy".into(),
            retry_after: secs.map(Duration::from_secs),
        };
        assert_eq!(busy(Some(3)).pause(), Some(Duration::from_secs(3)));
        assert_eq!(busy(None).pause(), Some(Duration::from_secs(1)));
        assert_eq!(busy(Some(0)).pause(), Some(Duration::from_millis(100)));
        assert_eq!(busy(Some(86_400)).pause(), Some(Duration::from_secs(60)));
        assert!(busy(None).not_sent());
        assert_eq!(ProviderError::NotSent("no".into()).pause(), None);
        let mut headers = http::HeaderMap::new();
        headers.insert(
            http::header::RETRY_AFTER,
            http::HeaderValue::from_static(" 7 "),
        );
        assert_eq!(retry_after(&headers), Some(Duration::from_secs(7)));
        // A date: the time until it, none when it has passed; anything else is no answer.
        let soon = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(30));
        headers.insert(
            http::header::RETRY_AFTER,
            http::HeaderValue::from_str(&soon).expect("header"),
        );
        let pause = retry_after(&headers).expect("a date");
        assert!(
            pause > Duration::from_secs(27) && pause <= Duration::from_secs(30),
            "{pause:?}"
        );
        headers.insert(
            http::header::RETRY_AFTER,
            http::HeaderValue::from_static("Wed, 21 Oct 2015 07:28:00 GMT"),
        );
        assert_eq!(retry_after(&headers), Some(Duration::ZERO));
        headers.insert(
            http::header::RETRY_AFTER,
            http::HeaderValue::from_static("soon"),
        );
        assert_eq!(retry_after(&headers), None);
    }

    fn sms(id: &str) -> OutboundSms {
        OutboundSms {
            id: id.into(),
            phone: "+8613800000000".into(),
            text: "hi".into(),
            campaign: None,
            instance: "test".into(),
            sent_at_ms: 1,
        }
    }

    #[tokio::test]
    async fn a_failed_outbox_write_is_not_reported_sent() {
        // Every write to /dev/full fails (ENOSPC), as on a full disk.
        let provider = FileProvider::new("/dev/full");
        for id in ["a", "b"] {
            match provider.send(&sms(id)).await {
                Err(ProviderError::Unknown(e)) => assert!(e.contains("/dev/full"), "{e}"),
                other => panic!("{id}: {other:?}"),
            }
            assert!(provider.torn.load(Ordering::Relaxed), "{id}");
        }
    }

    #[tokio::test]
    async fn the_line_after_a_torn_write_starts_a_line_of_its_own() {
        let path = std::env::temp_dir().join(format!("outbox-torn-{}", std::process::id()));
        // What a write that failed half-way leaves.
        std::fs::write(&path, b"{\"id\":\"x\"}\n{\"id\":\"half").expect("write");
        let provider = FileProvider::new(&path);
        provider.torn.store(true, Ordering::Relaxed);
        provider.send(&sms("whole")).await.expect("sent");
        // A write that did not fail adds nothing before the next line.
        provider.send(&sms("next")).await.expect("sent");
        let text = std::fs::read_to_string(&path).expect("read");
        let _ = std::fs::remove_file(&path);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text:?}");
        assert_eq!(lines[1], "{\"id\":\"half");
        for (line, id) in [(lines[2], "whole"), (lines[3], "next")] {
            let value: serde_json::Value = serde_json::from_str(line).expect("a line of JSON");
            assert_eq!(value["id"], id);
        }
    }

    #[tokio::test]
    async fn a_webhook_that_stalls_mid_body_times_out() {
        // Answers its headers, promises ten bytes of body and never sends them.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server = tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.expect("accept");
            let mut buf = [0u8; 4096];
            let _ = conn.read(&mut buf).await;
            let _ = conn
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n")
                .await;
            tokio::time::sleep(Duration::from_secs(30)).await;
            drop(conn);
        });
        let provider = WebhookProvider::new(&format!("http://{addr}/sms")).expect("url");
        let sms = OutboundSms {
            id: "1".into(),
            phone: "+8613700000001".into(),
            text: "x".into(),
            campaign: None,
            instance: "test".into(),
            sent_at_ms: 0,
        };
        let started = tokio::time::Instant::now();
        let sent = tokio::time::timeout(Duration::from_secs(20), provider.send(&sms))
            .await
            .expect("the send must end by itself");
        let err = sent.expect_err("a stalled body is a failure");
        assert!(err.message().contains("timed out"), "{err}");
        assert!(!err.not_sent(), "a timeout may have sent the message");
        assert!(
            started.elapsed() < Duration::from_secs(8),
            "{:?}",
            started.elapsed()
        );
        server.abort();
    }
}
