//! The greeter over a real socket: the call over the limit gets RESOURCE_EXHAUSTED with the
//! retry delay; other API keys are unaffected; a call without a key is refused.

use std::time::Duration;

use floodgate::tower::key::MetadataKey;
use floodgate::tower::{RateLimitLayer, Rule};
use floodgate::{MemoryLimiter, Policy};
use tonic::Code;

#[tokio::test]
async fn the_call_over_the_limit_is_resource_exhausted_with_a_retry_delay() {
    let policy = Policy::per_minute(3)
        .expect("valid")
        .named("per-api-key")
        .expect("name");
    let layer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(Rule::new(policy).key(MetadataKey::named("x-api-key").expect("name")))
        .build()
        .expect("layer");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(grpc_greeter::serve(layer, listener));
    let channel = grpc_greeter::connect(addr).await.expect("connect");

    for left in [2, 1, 0] {
        let reply = grpc_greeter::say_hello(channel.clone(), "key-a", "ada")
            .await
            .expect("within the limit");
        assert_eq!(
            reply.get_ref().message,
            format!("hello, ada ({left} calls left)")
        );
    }
    let status = grpc_greeter::say_hello(channel.clone(), "key-a", "ada")
        .await
        .expect_err("over the limit");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    let delay = grpc_greeter::retry_delay(&status).expect("RetryInfo");
    assert!(
        delay > Duration::from_secs(15) && delay <= Duration::from_secs(20),
        "{delay:?}"
    );
    assert_eq!(
        status.metadata().get("retry-after").expect("retry-after"),
        "20"
    );

    // Another caller has its own budget.
    assert!(
        grpc_greeter::say_hello(channel.clone(), "key-b", "bob")
            .await
            .is_ok()
    );

    // No key: refused as an invalid argument, not an internal error.
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
    let no_key = grpc
        .unary(
            tonic::Request::new(grpc_greeter::HelloRequest { name: "eve".into() }),
            http::uri::PathAndQuery::from_static("/greeter.Greeter/SayHello"),
            tonic_prost::ProstCodec::<grpc_greeter::HelloRequest, grpc_greeter::HelloReply>::default(),
        )
        .await
        .expect_err("no key");
    assert_ne!(no_key.code(), Code::Internal, "{no_key:?}");
    assert_ne!(no_key.code(), Code::Ok);
}
