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
#[error("{0}")]
pub struct ProviderError(pub String);

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
            let mut line = serde_json::to_vec(sms).map_err(|e| ProviderError(e.to_string()))?;
            line.push(b'\n');
            let mut file = self.file.lock().await;
            if file.is_none() {
                let opened = tokio::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&self.path)
                    .await
                    .map_err(|e| ProviderError(format!("{}: {e}", self.path.display())))?;
                *file = Some(opened);
            }
            if let Some(f) = file.as_mut() {
                // One write of the whole line, then to disk: a line is either there or not.
                f.write_all(&line)
                    .await
                    .map_err(|e| ProviderError(format!("{}: {e}", self.path.display())))?;
                f.sync_data()
                    .await
                    .map_err(|e| ProviderError(format!("{}: {e}", self.path.display())))?;
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
            .map_err(|e| ProviderError(format!("webhook_url {url:?}: {e}")))?;
        if url.scheme_str() != Some("http") {
            return Err(ProviderError("webhook_url must be an http:// URL".into()));
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
            let body = serde_json::to_vec(sms).map_err(|e| ProviderError(e.to_string()))?;
            let req = http::Request::post(self.url.clone())
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(Full::new(Bytes::from(body)))
                .map_err(|e| ProviderError(e.to_string()))?;
            let resp = tokio::time::timeout(Duration::from_secs(5), self.client.request(req))
                .await
                .map_err(|_| ProviderError("webhook timed out after 5s".into()))?
                .map_err(|e| ProviderError(format!("webhook: {e}")))?;
            let status = resp.status();
            let _ = resp.into_body().collect().await;
            if !status.is_success() {
                return Err(ProviderError(format!("webhook answered {status}")));
            }
            Ok(())
        })
    }
}
