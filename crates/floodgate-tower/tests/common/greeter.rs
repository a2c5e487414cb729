//! A unary gRPC service and client written by hand (no protoc): `test.Greeter/SayHello`.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use floodgate_tower::{RateLimit, RateLimitInfo, RateLimitLayer};
use http::uri::PathAndQuery;
use tonic::{Request, Response, Status};

#[derive(Clone, PartialEq, prost::Message)]
pub struct HelloRequest {
    #[prost(string, tag = "1")]
    pub name: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HelloReply {
    #[prost(string, tag = "1")]
    pub message: String,
}

/// `google.rpc.Status`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RpcStatus {
    #[prost(int32, tag = "1")]
    pub code: i32,
    #[prost(string, tag = "2")]
    pub message: String,
    #[prost(message, repeated, tag = "3")]
    pub details: Vec<Any>,
}

/// `google.protobuf.Any`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Any {
    #[prost(string, tag = "1")]
    pub type_url: String,
    #[prost(bytes = "vec", tag = "2")]
    pub value: Vec<u8>,
}

/// `google.rpc.RetryInfo`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RetryInfo {
    #[prost(message, optional, tag = "1")]
    pub retry_delay: Option<ProtoDuration>,
}

/// `google.protobuf.Duration`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ProtoDuration {
    #[prost(int64, tag = "1")]
    pub seconds: i64,
    #[prost(int32, tag = "2")]
    pub nanos: i32,
}

/// The retry delay in a status's `google.rpc.RetryInfo`.
pub fn retry_delay(status: &Status) -> Option<std::time::Duration> {
    use prost::Message as _;
    let rpc = RpcStatus::decode(status.details()).expect("google.rpc.Status");
    assert_eq!(rpc.code, status.code() as i32);
    let any = rpc
        .details
        .iter()
        .find(|a| a.type_url == "type.googleapis.com/google.rpc.RetryInfo")?;
    let info = RetryInfo::decode(any.value.as_slice()).expect("RetryInfo");
    let d = info.retry_delay?;
    Some(std::time::Duration::new(d.seconds as u64, d.nanos as u32))
}

#[derive(Clone, Copy, Debug, Default)]
pub struct Greeter;

impl tonic::server::NamedService for Greeter {
    const NAME: &'static str = "test.Greeter";
}

struct SayHello;

impl tonic::server::UnaryService<HelloRequest> for SayHello {
    type Response = HelloReply;
    type Future = std::future::Ready<Result<Response<HelloReply>, Status>>;

    fn call(&mut self, req: Request<HelloRequest>) -> Self::Future {
        let remaining = req
            .extensions()
            .get::<RateLimitInfo>()
            .and_then(|i| i.strictest().map(|(_, d)| d.remaining));
        std::future::ready(Ok(Response::new(HelloReply {
            message: format!("hello {} ({remaining:?} left)", req.get_ref().name),
        })))
    }
}

impl tower::Service<http::Request<tonic::body::Body>> for Greeter {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::default());
            Ok(grpc.unary(SayHello, req).await)
        })
    }
}

/// Serves the greeter behind `layer` on a free port.
pub async fn serve(layer: RateLimitLayer) -> SocketAddr {
    serve_kind(layer).await
}

/// Serves the greeter behind `layer` (of either body kind) on a free port.
pub async fn serve_kind<K, B>(layer: RateLimitLayer<K>) -> SocketAddr
where
    K: 'static,
    RateLimit<tonic::service::Routes, K>: tower::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<B>,
            Error = Infallible,
            Future: Send,
        > + Send,
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .layer(layer)
            .add_service(Greeter)
            .serve_with_incoming(incoming)
            .await
            .expect("serve");
    });
    addr
}

/// Serves the greeter behind `layer` on a free port, over TLS with `identity`.
pub async fn serve_tls(layer: RateLimitLayer, identity: tonic::transport::Identity) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    let server = tonic::transport::Server::builder()
        .tls_config(tonic::transport::ServerTlsConfig::new().identity(identity))
        .expect("TLS config");
    tokio::spawn(async move {
        server
            .layer(layer)
            .add_service(Greeter)
            .serve_with_incoming(incoming)
            .await
            .expect("serve");
    });
    addr
}

pub async fn channel(addr: SocketAddr) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect")
}

pub async fn say_hello(
    channel: tonic::transport::Channel,
    name: &str,
    metadata: &[(&'static str, &'static str)],
) -> Result<Response<HelloReply>, Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let mut req = Request::new(HelloRequest { name: name.into() });
    for (k, v) in metadata {
        req.metadata_mut().insert(*k, v.parse().expect("metadata"));
    }
    grpc.unary(
        req,
        PathAndQuery::from_static("/test.Greeter/SayHello"),
        tonic_prost::ProstCodec::default(),
    )
    .await
}
