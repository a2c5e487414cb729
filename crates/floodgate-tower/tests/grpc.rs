//! The layer in front of a tonic server, with the in-memory limiter.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::greeter::{self, retry_delay, say_hello};
use floodgate_core::{MemoryLimiter, Policy};
use floodgate_tower::key::{GlobalKey, MetadataKey};
use floodgate_tower::{RateLimitLayer, Rule};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tonic::Code;

fn policy(limit: u64, name: &str) -> Policy {
    Policy::fixed_window(limit, Duration::from_secs(60))
        .expect("policy")
        .named(name)
        .expect("name")
}

/// Two calls per minute, with headers on allowed responses too.
fn two_per_minute() -> RateLimitLayer {
    RateLimitLayer::builder(MemoryLimiter::new())
        .rule(Rule::new(policy(2, "grpc")).key(GlobalKey))
        .headers_on_allowed(true)
        .build()
        .expect("layer")
}

#[tokio::test]
async fn the_call_over_the_limit_is_resource_exhausted() {
    assert_resource_exhausted(greeter::serve(two_per_minute()).await).await;
}

#[cfg(feature = "tonic")]
#[tokio::test]
async fn a_layer_with_tonic_s_own_body_gives_the_same_answers() {
    assert_resource_exhausted(greeter::serve_kind(two_per_minute().native_body()).await).await;
}

/// Two calls to the greeter at `addr` are allowed with `RateLimit` metadata; the third is
/// `RESOURCE_EXHAUSTED` with a `RetryInfo` and the metadata.
async fn assert_resource_exhausted(addr: std::net::SocketAddr) {
    let channel = greeter::channel(addr).await;

    for left in [1, 0] {
        let res = say_hello(channel.clone(), "a", &[]).await.expect("allowed");
        assert_eq!(
            res.get_ref().message,
            format!("hello a (Some({left}) left)")
        );
        let md = res.metadata();
        assert_eq!(
            md.get("ratelimit-policy")
                .expect("policy")
                .to_str()
                .expect("ascii"),
            "\"grpc\";q=2;w=60"
        );
        let rl = md
            .get("ratelimit")
            .expect("ratelimit")
            .to_str()
            .expect("ascii");
        assert!(rl.starts_with(&format!("\"grpc\";r={left};t=")), "{rl}");
    }

    let status = say_hello(channel.clone(), "a", &[])
        .await
        .expect_err("limited");
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert!(status.message().contains("grpc"), "{}", status.message());
    let delay = retry_delay(&status).expect("RetryInfo");
    assert!(
        delay > Duration::from_secs(58) && delay <= Duration::from_secs(60),
        "{delay:?}"
    );
    let secs: u64 = status
        .metadata()
        .get("retry-after")
        .expect("retry-after metadata")
        .to_str()
        .expect("ascii")
        .parse()
        .expect("seconds");
    assert_eq!(secs, delay.as_millis().div_ceil(1000) as u64);
    let rl = status
        .metadata()
        .get("ratelimit")
        .expect("ratelimit")
        .to_str()
        .expect("ascii");
    assert!(rl.starts_with("\"grpc\";r=0;t="), "{rl}");
}

#[tokio::test]
async fn metadata_keys_and_missing_keys() {
    let layer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(Rule::new(policy(1, "tenant")).key(MetadataKey::named("x-tenant").expect("name")))
        .build()
        .expect("layer");
    let channel = greeter::channel(greeter::serve(layer).await).await;
    assert!(
        say_hello(channel.clone(), "a", &[("x-tenant", "acme")])
            .await
            .is_ok()
    );
    assert!(
        say_hello(channel.clone(), "a", &[("x-tenant", "other")])
            .await
            .is_ok()
    );
    let status = say_hello(channel.clone(), "a", &[("x-tenant", "acme")])
        .await
        .expect_err("limited");
    assert_eq!(status.code(), Code::ResourceExhausted);
    let status = say_hello(channel.clone(), "a", &[])
        .await
        .expect_err("no key");
    assert_eq!(status.code(), Code::InvalidArgument);
}

/// gRPC's and gRPC-Web's content types make a gRPC request (gRPC-Web answered in its own
/// content type); others, even those that begin alike, get HTTP errors.
/// The layer decides at once (reject mode), or in the response future (delay mode).
#[tokio::test]
async fn grpc_detection_by_content_type() {
    for delay in [false, true] {
        let builder = RateLimitLayer::builder(MemoryLimiter::new())
            .rule(Rule::new(policy(1, "detect")).key(GlobalKey));
        let builder = if delay {
            builder.delay(Duration::from_millis(1))
        } else {
            builder
        };
        detection_by_content_type(builder.build().expect("layer")).await;
    }
}

async fn detection_by_content_type(layer: RateLimitLayer) {
    let addr = greeter::serve(layer).await;
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let send = |content_type: &'static str| {
        let client = client.clone();
        async move {
            // An empty HelloRequest: flag 0, length 0.
            let req = http::Request::post(format!("http://{addr}/test.Greeter/SayHello"))
                .header("content-type", content_type)
                .header("te", "trailers")
                .body(Full::new(Bytes::from_static(&[0, 0, 0, 0, 0])))
                .expect("request");
            let res = client.request(req).await.expect("response");
            let (parts, body) = res.into_parts();
            let collected = body.collect().await.expect("body");
            (parts, collected)
        }
    };
    let (parts, body) = send("application/grpc+proto").await;
    assert_eq!(parts.status, 200);
    let trailers = body.trailers().cloned().unwrap_or_default();
    assert_eq!(
        trailers.get("grpc-status").map(|v| v.as_bytes()),
        Some(&b"0"[..])
    );

    for ct in [
        "application/grpc+proto",
        "application/grpc",
        "application/grpc+json",
    ] {
        let (parts, body) = send(ct).await;
        assert_eq!(parts.status, 200, "{ct}");
        assert_eq!(parts.headers["content-type"], "application/grpc", "{ct}");
        assert_eq!(parts.headers["grpc-status"], "8", "{ct}");
        let message = parts.headers["grpc-message"].to_str().expect("ascii");
        // Printable ASCII stays as is in grpc-message (only other bytes and `%` are encoded).
        assert!(
            message.starts_with("rate limit \"detect\" exceeded; retry in "),
            "{message}"
        );
        assert!(parts.headers.contains_key("grpc-status-details-bin"));
        assert!(parts.headers.contains_key("retry-after"));
        assert!(body.to_bytes().is_empty(), "trailers-only");
    }
    // gRPC-Web: the same trailers-only rejection, in the content type its clients expect.
    for (ct, answered) in [
        ("application/grpc-web", "application/grpc-web+proto"),
        ("application/grpc-web+proto", "application/grpc-web+proto"),
        (
            "Application/gRPC-Web-Text",
            "application/grpc-web-text+proto",
        ),
        (
            "application/grpc-web-text+proto",
            "application/grpc-web-text+proto",
        ),
        ("application/grpc-web+json", "application/grpc-web+json"),
        (
            "application/grpc-web; charset=utf-8",
            "application/grpc-web+proto",
        ),
    ] {
        let (parts, body) = send(ct).await;
        assert_eq!(parts.status, 200, "{ct}");
        assert_eq!(parts.headers["content-type"], answered, "{ct}");
        assert_eq!(parts.headers["grpc-status"], "8", "{ct}");
        assert!(parts.headers.contains_key("retry-after"), "{ct}");
        assert!(body.to_bytes().is_empty(), "{ct}: trailers-only");
    }
    // Neither gRPC nor gRPC-Web, however they begin: an HTTP 429, which no client mistakes
    // for a success as it could a gRPC answer (HTTP 200).
    for ct in [
        "application/json",
        "application/grpc-webfoo",
        "application/grpcx",
    ] {
        let (parts, body) = send(ct).await;
        assert_eq!(parts.status, 429, "{ct}");
        assert_eq!(
            parts.headers["content-type"], "application/problem+json",
            "{ct}"
        );
        assert!(!parts.headers.contains_key("grpc-status"), "{ct}");
        assert!(!body.to_bytes().is_empty(), "{ct}");
    }
}

#[cfg(feature = "tonic")]
#[tokio::test]
async fn peer_ip_from_tonic_connect_info() {
    let layer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(Rule::new(policy(1, "per-peer")).key(floodgate_tower::key::PeerIp::new()))
        .build()
        .expect("layer");
    let channel = greeter::channel(greeter::serve(layer).await).await;
    assert!(say_hello(channel.clone(), "a", &[]).await.is_ok());
    let status = say_hello(channel, "a", &[]).await.expect_err("limited");
    assert_eq!(status.code(), Code::ResourceExhausted);
}

#[cfg(feature = "tonic")]
#[tokio::test]
async fn peer_ip_when_tonic_terminates_tls() {
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

    let dir = tempfile::tempdir().expect("temporary directory");
    floodgate_testkit::tls_certificates(dir.path()).expect("certificates");
    let read = |name: &str| std::fs::read(dir.path().join(name)).expect("read");
    let identity = Identity::from_pem(read("server.crt"), read("server.key"));
    // tonic puts `TlsConnectInfo<TcpConnectInfo>` on the request, and the `TcpConnectInfo`
    // inside it too: the layer finds the peer without knowing about TLS. Were it missing,
    // every call would be turned away (the default for a missing key).
    let layer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(Rule::new(policy(1, "per-peer")).key(floodgate_tower::key::PeerIp::new()))
        .build()
        .expect("layer");
    let addr = greeter::serve_tls(layer, identity).await;
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read("ca.crt")))
        .domain_name("localhost");
    let channel = Endpoint::from_shared(format!("https://{addr}"))
        .expect("endpoint")
        .tls_config(tls)
        .expect("client TLS")
        .connect()
        .await
        .expect("connect over TLS");
    let first = say_hello(channel.clone(), "a", &[]).await;
    assert!(first.is_ok(), "{first:?}");
    let status = say_hello(channel, "a", &[]).await.expect_err("limited");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
}
