//! Test support: real servers on 127.0.0.1:0 and a plain hyper client.
#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// Serves `router` (with `ConnectInfo<SocketAddr>`) on a free port.
pub async fn serve(router: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        axum::serve(
            listener,
            router.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .expect("serve");
    });
    addr
}

#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(name)
            .map(|v| v.to_str().expect("ascii header"))
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("json body")
    }
}

#[derive(Clone)]
pub struct HttpClient {
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
}

impl HttpClient {
    pub fn new(addr: SocketAddr) -> Self {
        HttpClient {
            client: Client::builder(TokioExecutor::new()).build_http(),
            base: format!("http://{addr}"),
        }
    }

    pub async fn get(&self, path: &str) -> Reply {
        self.send(Request::get(path), &[]).await
    }

    pub async fn get_with(&self, path: &str, headers: &[(&str, &[u8])]) -> Reply {
        self.send(Request::get(path), headers).await
    }

    pub async fn send(&self, builder: http::request::Builder, headers: &[(&str, &[u8])]) -> Reply {
        let uri = format!("{}{}", self.base, builder.uri_ref().expect("uri"));
        let mut builder = builder.uri(uri);
        for (k, v) in headers {
            builder = builder.header(*k, http::HeaderValue::from_bytes(v).expect("value"));
        }
        let req = builder.body(Full::new(Bytes::new())).expect("request");
        let res = tokio::time::timeout(Duration::from_secs(20), self.client.request(req))
            .await
            .expect("response in time")
            .expect("response");
        let (parts, body) = res.into_parts();
        let body = body.collect().await.expect("body").to_bytes();
        Reply {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }
}

/// One item of a structured-field list: `"name";a=1;b=2`.
#[derive(Debug, PartialEq, Eq)]
pub struct Item {
    pub name: String,
    pub params: HashMap<String, String>,
}

impl Item {
    pub fn int(&self, p: &str) -> u64 {
        self.params
            .get(p)
            .unwrap_or_else(|| panic!("no {p} in {self:?}"))
            .parse()
            .expect("integer parameter")
    }
}

/// Parses every instance of a structured-field list header (`RateLimit`, `RateLimit-Policy`).
pub fn sf_list(headers: &HeaderMap, name: &str) -> Vec<Item> {
    let mut items = Vec::new();
    for v in headers.get_all(name) {
        for member in v.to_str().expect("ascii").split(',') {
            let mut parts = member.trim().split(';');
            let name = parts.next().expect("item");
            assert!(
                name.starts_with('"') && name.ends_with('"') && name.len() >= 2,
                "item must be an sf-string: {name}"
            );
            let name = name[1..name.len() - 1].to_owned();
            let params = parts
                .map(|p| {
                    let (k, v) = p.split_once('=').expect("param");
                    (k.to_owned(), v.trim_matches('"').to_owned())
                })
                .collect();
            items.push(Item { name, params });
        }
    }
    items
}

/// A handler that answers "ok".
pub async fn ok() -> &'static str {
    "ok"
}

pub fn infallible<T>(t: T) -> Result<T, Infallible> {
    Ok(t)
}

pub mod greeter;

/// A body that sends one chunk, then waits for the test to end it.
pub struct HeldBody {
    pub first: Option<Bytes>,
    pub end: tokio::sync::oneshot::Receiver<()>,
}

impl http_body::Body for HeldBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        use std::future::Future as _;
        if let Some(first) = self.first.take() {
            return std::task::Poll::Ready(Some(Ok(http_body::Frame::data(first))));
        }
        match std::pin::Pin::new(&mut self.end).poll(cx) {
            std::task::Poll::Ready(_) => std::task::Poll::Ready(None),
            std::task::Poll::Pending => std::task::Poll::Pending,
        }
    }
}

/// The senders that end held bodies, in the order the bodies were opened.
pub type Senders = std::sync::Arc<std::sync::Mutex<Vec<tokio::sync::oneshot::Sender<()>>>>;

/// Ends the oldest held body still open.
pub fn end_first(senders: &Senders) {
    senders
        .lock()
        .expect("lock")
        .remove(0)
        .send(())
        .expect("end");
}

/// A rule of `policy`, named `name`, on one global key.
pub fn global(
    policy: Result<floodgate_core::Policy, floodgate_core::PolicyError>,
    name: &str,
) -> floodgate_tower::Rule {
    let policy = policy.and_then(|p| p.named(name)).expect("policy");
    floodgate_tower::Rule::new(policy).key(floodgate_tower::key::GlobalKey)
}

/// The stream `first` (of a server with one slot, its lease renewed) still holds the slot
/// `after` its start, well past the lease's TTL; once its body ends, the slot is back.
pub async fn assert_stream_keeps_its_slot(
    addr: SocketAddr,
    senders: &Senders,
    mut first: tokio::net::TcpStream,
    after: Duration,
) {
    tokio::time::sleep(after).await;
    let (_second, head) = open_stream(addr).await;
    assert!(
        head.starts_with("HTTP/1.1 429"),
        "the lease lapsed mid-stream: {head}"
    );
    end_first(senders);
    read_to_end(&mut first).await;
    let _third = wait_admitted(addr).await;
}

/// A router whose `/stream` answers with a [`HeldBody`], put behind a layer by `layered`; the
/// senders end the bodies in order.
pub fn held_stream_app(layered: impl FnOnce(Router) -> Router) -> (Router, Senders) {
    let senders = Senders::default();
    let held = senders.clone();
    let app = Router::new().route(
        "/stream",
        axum::routing::get(move || {
            let held = held.clone();
            async move {
                let (end_tx, end_rx) = tokio::sync::oneshot::channel();
                held.lock().expect("lock").push(end_tx);
                axum::body::Body::new(HeldBody {
                    first: Some(Bytes::from_static(b"first chunk")),
                    end: end_rx,
                })
            }
        }),
    );
    (layered(app), senders)
}

/// Sends `GET /stream` over raw HTTP/1.1 and returns the stream with what arrived first (the
/// head and the first chunk), so that the test decides when the body is read or dropped.
pub async fn open_stream(addr: SocketAddr) -> (tokio::net::TcpStream, String) {
    send_raw(addr, b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n").await
}

/// Sends `request` on a new connection and returns it with what arrived first.
pub async fn send_raw(addr: SocketAddr, request: &[u8]) -> (tokio::net::TcpStream, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_all(request).await.expect("write");
    let mut buf = vec![0; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .expect("head in time")
        .expect("read");
    (s, String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// Reads a chunked body to its end.
pub async fn read_to_end(s: &mut tokio::net::TcpStream) -> Vec<u8> {
    use tokio::io::AsyncReadExt;
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        let mut buf = [0u8; 1024];
        loop {
            let n = s.read(&mut buf).await.expect("read");
            rest.extend_from_slice(&buf[..n]);
            if n == 0 || rest.ends_with(b"0\r\n\r\n") {
                break;
            }
        }
    })
    .await;
    rest
}

/// Opens streams until one is admitted, or panics after a few seconds.
pub async fn wait_admitted(addr: SocketAddr) -> tokio::net::TcpStream {
    wait_for_head(
        addr,
        b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n",
        "HTTP/1.1 200",
        "lease never released",
    )
    .await
}

/// Sends `request` on new connections until the answer's head starts with `head`, or panics
/// with `why` after a few seconds.
pub async fn wait_for_head(
    addr: SocketAddr,
    request: &[u8],
    head: &str,
    why: &str,
) -> tokio::net::TcpStream {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let (s, got) = send_raw(addr, request).await;
        if got.starts_with(head) {
            return s;
        }
        assert!(std::time::Instant::now() < deadline, "{why}: {got}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The `HeldLease` the last request to [`lease_keeping_app`] was given.
pub type LeaseSlot = std::sync::Arc<std::sync::Mutex<Option<floodgate_tower::HeldLease>>>;

/// An app whose `/` keeps the request's `HeldLease` in the returned slot and answers `101`.
pub fn lease_keeping_app() -> (Router, LeaseSlot) {
    let slot = LeaseSlot::default();
    let kept = slot.clone();
    let app = Router::new().route(
        "/",
        axum::routing::get(
            move |lease: Option<floodgate_tower::HeldLease>| async move {
                *kept.lock().expect("slot") = lease;
                StatusCode::SWITCHING_PROTOCOLS
            },
        ),
    );
    (app, slot)
}

/// Asks `app` (in process) to switch protocols on `/`; the status, once the response (and its
/// body) is gone.
pub async fn ask_upgrade(app: Router) -> StatusCode {
    let request = Request::get("/")
        .header("connection", "upgrade")
        .header("upgrade", "test")
        .body(axum::body::Body::empty())
        .expect("request");
    let response = tower::ServiceExt::oneshot(app, request)
        .await
        .expect("infallible");
    response.status()
}

/// Asks `app` to switch protocols, which it must grant; the `HeldLease` its handler kept.
pub async fn take_held_lease(app: Router, slot: &LeaseSlot) -> floodgate_tower::HeldLease {
    assert_eq!(ask_upgrade(app).await, StatusCode::SWITCHING_PROTOCOLS);
    slot.lock()
        .expect("slot")
        .take()
        .expect("an upgrade that took a concurrency lease has a HeldLease")
}
