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
