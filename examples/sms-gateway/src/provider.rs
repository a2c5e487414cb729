//! Where messages go: the [`SmsProvider`] trait, an append-only outbox file, and a webhook.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use tokio::io::AsyncWriteExt;
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
}

impl ProviderError {
    /// Whether the message certainly did not go out (and may be given back to the limits).
    pub fn not_sent(&self) -> bool {
        matches!(self, ProviderError::NotSent(_))
    }

    /// The error's text.
    pub fn message(&self) -> &str {
        match self {
            ProviderError::NotSent(m) | ProviderError::Unknown(m) => m,
        }
    }
}

/// Sends messages. Implementations must be safe to call from many tasks at once.
pub trait SmsProvider: Send + Sync + 'static {
    /// Sends one message.
    fn send<'a>(
        &'a self,
        sms: &'a OutboundSms,
    ) -> Pin<Box<dyn Future<Output = Result<(), ProviderError>> + Send + 'a>>;
}

/// Appends every message as one JSON line to a file, and logs it.
#[derive(Debug)]
pub struct FileProvider {
    path: PathBuf,
    file: Mutex<Option<tokio::fs::File>>,
}

impl FileProvider {
    pub fn new(path: impl Into<PathBuf>) -> Arc<Self> {
        Arc::new(FileProvider {
            path: path.into(),
            file: Mutex::new(None),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl SmsProvider for FileProvider {
    fn send<'a>(
        &'a self,
        sms: &'a OutboundSms,
    ) -> Pin<Box<dyn Future<Output = Result<(), ProviderError>> + Send + 'a>> {
        Box::pin(async move {
            let mut line =
                serde_json::to_vec(sms).map_err(|e| ProviderError::NotSent(e.to_string()))?;
            line.push(b'\n');
            let mut file = self.file.lock().await;
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
                // A failed write may have left part of the line: the outcome is unknown.
                f.write_all(&line)
                    .await
                    .map_err(|e| ProviderError::Unknown(format!("{}: {e}", self.path.display())))?;
                f.sync_data()
                    .await
                    .map_err(|e| ProviderError::Unknown(format!("{}: {e}", self.path.display())))?;
            }
            tracing::info!(id = %sms.id, phone = %sms.phone, campaign = ?sms.campaign, "sms sent");
            Ok(())
        })
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
    fn send<'a>(
        &'a self,
        sms: &'a OutboundSms,
    ) -> Pin<Box<dyn Future<Output = Result<(), ProviderError>> + Send + 'a>> {
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
                let _ = resp.into_body().collect().await;
                Ok::<_, hyper_util::client::legacy::Error>(status)
            };
            // A webhook never reached (refused, unroutable) or that answered an error did not
            // take the message; a timeout or a connection lost mid-exchange may have.
            let status = tokio::time::timeout(Duration::from_secs(5), exchange)
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
            // A 4xx refused the message, and a 503 says it was not handled; other errors (a 500,
            // a proxy's 502 or 504) may come after the message went out.
            if status.is_client_error() || status == http::StatusCode::SERVICE_UNAVAILABLE {
                return Err(ProviderError::NotSent(format!("webhook answered {status}")));
            }
            if !status.is_success() {
                return Err(ProviderError::Unknown(format!("webhook answered {status}")));
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

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
