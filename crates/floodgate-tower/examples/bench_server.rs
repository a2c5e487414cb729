//! A tiny HTTP server for `scripts/bench-http`: `GET /` answers "ok", behind nothing, the
//! floodgate layer (memory or Redis), or tower_governor, with the same policy: 1,000,000
//! requests per second per client IP (GCRA, burst 1,000,000), so that almost everything is
//! allowed and the benchmark measures the limiter's overhead. The layer answers with axum's own
//! body type (`RateLimitLayer::native_body`), as an axum application should have it.
//!
//! `memory-bare` is `memory` without rate-limit headers on allowed responses and without
//! `RateLimitInfo` in the request extensions: the cost of the decision alone.
//!
//! ```text
//! cargo run --release -p floodgate-tower --example bench_server -- \
//!     --mode memory|memory-bare|redis|redis-leasing|governor|none [--addr 127.0.0.1:8080] [--redis-url redis://127.0.0.1:6379]
//! ```

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::routing::get;
use floodgate_core::{MemoryLimiter, Policy};
use floodgate_redis::{RedisConfig, RedisLimiter};
use floodgate_tower::body::Native;
use floodgate_tower::key::PeerIp;
use floodgate_tower::{RateLimitLayer, Rule};

const RATE: u64 = 1_000_000;

struct Args {
    mode: String,
    addr: SocketAddr,
    redis_url: String,
}

fn usage(problem: &str) -> ! {
    eprintln!(
        "{problem}\nusage: bench_server --mode none|memory|memory-bare|redis|redis-leasing|governor [--addr IP:PORT] [--redis-url URL]"
    );
    std::process::exit(2)
}

fn parse_args() -> Args {
    let mut args = Args {
        mode: String::new(),
        addr: SocketAddr::from(([127, 0, 0, 1], 8080)),
        redis_url: "redis://127.0.0.1:6379".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .unwrap_or_else(|| usage(&format!("{flag} needs a value")));
        match flag.as_str() {
            "--mode" => args.mode = value,
            "--addr" => {
                args.addr = value
                    .parse()
                    .unwrap_or_else(|_| usage(&format!("bad address {value:?}")))
            }
            "--redis-url" => args.redis_url = value,
            other => usage(&format!("unknown flag {other}")),
        }
    }
    args
}

fn policy() -> Policy {
    Policy::per_second(RATE)
        .and_then(|p| p.named("bench"))
        .unwrap_or_else(|e| usage(&format!("policy: {e}")))
}

fn floodgate<L>(limiter: L, leasing: bool, bare: bool) -> RateLimitLayer<Native>
where
    L: floodgate_core::Limiter + Clone + 'static,
{
    let builder = RateLimitLayer::builder(limiter).rule(Rule::new(policy()).key(PeerIp::new()));
    let builder = if leasing {
        builder.leasing(floodgate_core::LeasingConfig::default())
    } else {
        builder
    };
    let builder = if bare {
        builder.ietf_headers(false).request_info(false)
    } else {
        builder
    };
    builder
        .build()
        .unwrap_or_else(|e| usage(&format!("layer: {e}")))
        .native_body()
}

#[tokio::main]
async fn main() {
    let args = parse_args();
    let app = Router::new().route("/", get(|| async { "ok" }));
    let app = match args.mode.as_str() {
        "none" => app,
        "memory" | "memory-bare" => app.layer(floodgate(
            MemoryLimiter::new(),
            false,
            args.mode == "memory-bare",
        )),
        "redis" | "redis-leasing" => {
            let config = RedisConfig::new(&args.redis_url)
                .unwrap_or_else(|e| usage(&format!("redis url: {e}")));
            let limiter = RedisLimiter::connect(&config)
                .await
                .unwrap_or_else(|e| usage(&format!("redis: {e}")));
            app.layer(floodgate(limiter, args.mode == "redis-leasing", false))
        }
        "governor" => {
            let config = tower_governor::governor::GovernorConfigBuilder::default()
                .per_nanosecond(1_000_000_000 / RATE)
                .burst_size(RATE as u32)
                .finish()
                .unwrap_or_else(|| usage("governor config"));
            app.layer(tower_governor::GovernorLayer::new(Arc::new(config)))
        }
        other => usage(&format!("unknown mode {other:?}")),
    };
    let listener = tokio::net::TcpListener::bind(args.addr)
        .await
        .unwrap_or_else(|e| usage(&format!("bind {}: {e}", args.addr)));
    eprintln!("bench_server: mode {} on {}", args.mode, args.addr);
    if let Err(e) = axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await
    {
        eprintln!("bench_server: {e}");
        std::process::exit(1);
    }
}
