//! `cargo run -p grpc-greeter` serves; `cargo run -p grpc-greeter -- --demo` also calls it until
//! the limit answers RESOURCE_EXHAUSTED.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use floodgate::tower::key::MetadataKey;
use floodgate::tower::{OnMissingKey, RateLimitLayer, Rule};
use floodgate::{MemoryLimiter, Policy};

/// A gRPC greeter limited per `x-api-key` metadata value.
#[derive(Debug, Parser)]
#[command(name = "grpc-greeter", version, about)]
struct Cli {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:50051")]
    listen: std::net::SocketAddr,
    /// The limit per API key (any floodgate policy string).
    #[arg(long, default_value = "5/minute")]
    limit: String,
    /// Share the limit through this Redis instead of memory.
    #[arg(long, env = "REDIS_URL")]
    redis_url: Option<String>,
    /// Call the service until it answers RESOURCE_EXHAUSTED, then exit.
    #[arg(long)]
    demo: bool,
}

#[tokio::main]
async fn main() -> ExitCode {
    match run(Cli::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("grpc-greeter: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<(), String> {
    let policy: Policy = cli.limit.parse().map_err(|e| format!("--limit: {e}"))?;
    let policy = policy.named("per-api-key").map_err(|e| e.to_string())?;
    let key = MetadataKey::named("x-api-key").map_err(|e| e.to_string())?;
    let rule = Rule::new(policy).key(key);
    let layer = match &cli.redis_url {
        Some(url) => {
            let config = floodgate::redis::RedisConfig::new(url).map_err(|e| e.to_string())?;
            let limiter = floodgate::redis::RedisLimiter::connect(&config)
                .await
                .map_err(|e| e.to_string())?;
            RateLimitLayer::builder(limiter)
                .rule(rule)
                .on_missing_key(OnMissingKey::Reject)
                .build()
        }
        None => RateLimitLayer::builder(MemoryLimiter::new())
            .rule(rule)
            .on_missing_key(OnMissingKey::Reject)
            .build(),
    }
    .map_err(|e| e.to_string())?;
    let listener = tokio::net::TcpListener::bind(cli.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", cli.listen))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    println!(
        "greeter listening on {addr} (limit {} per x-api-key)",
        cli.limit
    );
    let server = tokio::spawn(grpc_greeter::serve(layer, listener));
    if !cli.demo {
        return server
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string());
    }
    let channel = grpc_greeter::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    for i in 1..=100 {
        match grpc_greeter::say_hello(channel.clone(), "demo-key", "world").await {
            Ok(reply) => println!("call {i}: {}", reply.get_ref().message),
            Err(status) => {
                println!(
                    "call {i}: {:?}: {} (retry in {:?})",
                    status.code(),
                    status.message(),
                    grpc_greeter::retry_delay(&status).unwrap_or(Duration::ZERO)
                );
                return Ok(());
            }
        }
    }
    Err("the limit never answered".into())
}
