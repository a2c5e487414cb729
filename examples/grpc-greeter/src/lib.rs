//! A gRPC greeter behind floodgate's layer, written without `protoc`: the messages are prost
//! derives and the service a few lines over `tonic::server::Grpc`.
//!
//! Each caller is identified by its `x-api-key` metadata; over its limit a call fails with
//! `RESOURCE_EXHAUSTED`, and the status carries the retry delay as `google.rpc.RetryInfo` (and
//! as `retry-after` metadata).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use floodgate::tower::RateLimitLayer;
use http::uri::PathAndQuery;
use tonic::{Request, Response, Status};

/// `greeter.Greeter/SayHello`'s request.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HelloRequest {
    #[prost(string, tag = "1")]
    pub name: String,
}

/// `greeter.Greeter/SayHello`'s reply.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HelloReply {
    #[prost(string, tag = "1")]
    pub message: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RpcStatus {
    #[prost(int32, tag = "1")]
    code: i32,
    #[prost(string, tag = "2")]
    message: String,
    #[prost(message, repeated, tag = "3")]
    details: Vec<Any>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Any {
    #[prost(string, tag = "1")]
    type_url: String,
    #[prost(bytes = "vec", tag = "2")]
    value: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RetryInfo {
    #[prost(message, optional, tag = "1")]
    retry_delay: Option<ProtoDuration>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ProtoDuration {
    #[prost(int64, tag = "1")]
    seconds: i64,
    #[prost(int32, tag = "2")]
    nanos: i32,
}

/// The retry delay a `RESOURCE_EXHAUSTED` status carries in `google.rpc.RetryInfo`.
pub fn retry_delay(status: &Status) -> Option<Duration> {
    use prost::Message as _;
    let rpc = RpcStatus::decode(status.details()).ok()?;
    let any = rpc
        .details
        .iter()
        .find(|a| a.type_url == "type.googleapis.com/google.rpc.RetryInfo")?;
    let d = RetryInfo::decode(any.value.as_slice()).ok()?.retry_delay?;
    Some(Duration::new(
        u64::try_from(d.seconds).ok()?,
        u32::try_from(d.nanos).ok()?,
    ))
}

/// The service.
#[derive(Clone, Copy, Debug, Default)]
pub struct Greeter;

impl tonic::server::NamedService for Greeter {
    const NAME: &'static str = "greeter.Greeter";
}

struct SayHello;

impl tonic::server::UnaryService<HelloRequest> for SayHello {
    type Response = HelloReply;
    type Future = std::future::Ready<Result<Response<HelloReply>, Status>>;

    fn call(&mut self, req: Request<HelloRequest>) -> Self::Future {
        // The layer tells the handler where the caller stands.
        let left = req
            .extensions()
            .get::<floodgate::tower::RateLimitInfo>()
            .and_then(|i| i.strictest().map(|(_, d)| d.remaining));
        let left = left.map_or_else(String::new, |n| format!(" ({n} calls left)"));
        std::future::ready(Ok(Response::new(HelloReply {
            message: format!("hello, {}{left}", req.get_ref().name),
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
            if req.uri().path() != "/greeter.Greeter/SayHello" {
                return Ok(Status::unimplemented("no such method").into_http());
            }
            let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::default());
            Ok(grpc.unary(SayHello, req).await)
        })
    }
}

/// Serves the greeter behind `layer` on `listener` until the process ends.
pub async fn serve(
    layer: RateLimitLayer,
    listener: tokio::net::TcpListener,
) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        .layer(layer)
        .add_service(Greeter)
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
        .await
}

/// Calls `SayHello` as the caller with API key `api_key`.
pub async fn say_hello(
    channel: tonic::transport::Channel,
    api_key: &str,
    name: &str,
) -> Result<Response<HelloReply>, Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let mut req = Request::new(HelloRequest { name: name.into() });
    let key = api_key
        .parse()
        .map_err(|_| Status::invalid_argument("the API key is not valid metadata"))?;
    req.metadata_mut().insert("x-api-key", key);
    grpc.unary(
        req,
        PathAndQuery::from_static("/greeter.Greeter/SayHello"),
        tonic_prost::ProstCodec::default(),
    )
    .await
}

/// A channel to a greeter at `addr`.
pub async fn connect(
    addr: SocketAddr,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
        .connect()
        .await
}
