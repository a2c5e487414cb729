//! The layer over the Redis backend, on real redis-server processes (floodgate-testkit).
// RouteKey, route rules and the RateLimitInfo extractor need the `axum` feature.
#![cfg(feature = "axum")]

mod common;

use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use common::greeter::{self, retry_delay, say_hello};
use common::{HttpClient, serve, sf_list};
use floodgate_core::{MemoryLimiter, Policy};
use floodgate_redis::{RedisConfig, RedisLimiter};
use floodgate_testkit::RedisServer;
use floodgate_tower::key::{GlobalKey, HeaderKey, PeerIp};
use floodgate_tower::{DecisionSource, OnStoreError, RateLimitInfo, RateLimitLayer, Rule};
use http::StatusCode;
use tonic::Code;

fn policy(limit: u64, name: &str) -> Policy {
    Policy::fixed_window(limit, Duration::from_secs(60))
        .expect("policy")
        .named(name)
        .expect("name")
}

fn start_redis() -> RedisServer {
    RedisServer::start().expect("redis-server (run scripts/install-redis if it is missing)")
}

async fn limiter(server: &RedisServer) -> RedisLimiter {
    let config = RedisConfig::new(&server.url())
        .expect("url")
        .timeout(Duration::from_millis(250))
        .connect_timeout(Duration::from_millis(250));
    RedisLimiter::connect(&config).await.expect("connect")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_limits_hold_across_replicas() {
    let redis = start_redis();
    // Two "replicas" of the app, each with its own layer, sharing Redis.
    let mut clients = Vec::new();
    for _ in 0..2 {
        let layer = RateLimitLayer::builder(limiter(&redis).await)
            .rule(Rule::new(policy(3, "per-ip")).key(PeerIp::new()))
            .rule(Rule::new(policy(100, "global")).key(GlobalKey))
            .legacy_headers(true)
            .headers_on_allowed(true)
            .build()
            .expect("layer");
        let app = Router::new().route("/", get(common::ok)).layer(layer);
        clients.push(HttpClient::new(serve(app).await));
    }
    for (i, remaining) in [2, 1, 0].into_iter().enumerate() {
        let res = clients[i % 2].get("/").await;
        assert_eq!(res.status, StatusCode::OK);
        let items = sf_list(&res.headers, "ratelimit");
        assert_eq!(items[0].name, "per-ip");
        assert_eq!(items[0].int("r"), remaining);
        assert_eq!(items[1].name, "global");
        assert_eq!(items[1].int("r"), 99 - i as u64);
        assert_eq!(
            res.header("x-ratelimit-remaining"),
            Some(remaining.to_string().as_str())
        );
        let policies = sf_list(&res.headers, "ratelimit-policy");
        assert_eq!((policies[0].int("q"), policies[0].int("w")), (3, 60));
    }
    let res = clients[1].get("/").await;
    assert_eq!(res.status, StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = res
        .header("retry-after")
        .expect("retry-after")
        .parse()
        .expect("secs");
    assert!((58..=60).contains(&retry), "{retry}");
    let problem = res.json();
    assert_eq!(problem["policy"], "per-ip");
    assert_eq!(
        problem["retry_after_ms"]
            .as_u64()
            .expect("ms")
            .div_ceil(1000),
        retry
    );
    assert_eq!(sf_list(&res.headers, "ratelimit")[0].int("r"), 0);
    // The denied request counted nowhere: the global policy still has 97 left.
    assert_eq!(sf_list(&res.headers, "ratelimit")[1].int("r"), 97);
    // The state is in Redis.
    let size = redis
        .cmd(&["DBSIZE"])
        .expect("dbsize")
        .as_int()
        .expect("int");
    assert!(size >= 2, "{size} keys");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_calls_over_the_limit_are_resource_exhausted() {
    let redis = start_redis();
    let layer = RateLimitLayer::builder(limiter(&redis).await)
        .rule(Rule::new(policy(2, "grpc")).key(GlobalKey))
        .headers_on_allowed(true)
        .build()
        .expect("layer");
    let channel = greeter::channel(greeter::serve(layer).await).await;
    for left in [1, 0] {
        let res = say_hello(channel.clone(), "r", &[]).await.expect("allowed");
        let rl = res
            .metadata()
            .get("ratelimit")
            .expect("ratelimit")
            .to_str()
            .expect("ascii");
        assert!(rl.starts_with(&format!("\"grpc\";r={left};t=")), "{rl}");
    }
    let status = say_hello(channel, "r", &[]).await.expect_err("limited");
    assert_eq!(status.code(), Code::ResourceExhausted);
    let delay = retry_delay(&status).expect("RetryInfo");
    assert!(
        delay > Duration::from_secs(58) && delay <= Duration::from_secs(60),
        "{delay:?}"
    );
    assert!(status.metadata().get("retry-after").is_some());
}

/// Requests until one is decided by `want`, or panics after a few seconds.
async fn wait_for_source(client: &HttpClient, want: &str) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let res = client.get("/").await;
        if res.status == StatusCode::OK && res.body == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "never decided by {want}: last {} {:?}",
            res.status,
            res.body
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn app(layer: RateLimitLayer) -> Router {
    app_with(Router::new(), layer)
}

/// `router` with `/` answering which source decided, under `layer`.
fn app_with(router: Router, layer: RateLimitLayer) -> Router {
    router
        .route(
            "/",
            get(|info: Option<RateLimitInfo>| async move {
                match info.map(|i| i.source()) {
                    Some(DecisionSource::Store) => "store",
                    Some(DecisionSource::Fallback) => "fallback",
                    Some(DecisionSource::FailOpen) => "open",
                    _ => "?",
                }
            }),
        )
        .layer(layer)
}

/// A replica that starts while Redis is down (restarted during an outage) serves at once on its
/// failure policy, with a lazily connected limiter, and moves to Redis when it comes up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_started_while_redis_is_down_serves_and_moves_to_redis() {
    let redis = start_redis();
    tokio::task::block_in_place(|| redis.kill()).expect("kill");
    let config = RedisConfig::new(&redis.url())
        .expect("url")
        .timeout(Duration::from_millis(250))
        .connect_timeout(Duration::from_millis(250));
    let layer = RateLimitLayer::builder(RedisLimiter::connect_lazy(&config).expect("lazy"))
        .rule(Rule::new(policy(2, "lazy")).key(GlobalKey))
        .store_retry_interval(Duration::from_millis(50))
        .build()
        .expect("layer");
    let client = HttpClient::new(serve(app(layer)).await);
    // The local fallback (the default) enforces the same policy meanwhile.
    for _ in 0..2 {
        let res = client.get("/").await;
        assert_eq!(
            (res.status, res.body.as_ref()),
            (StatusCode::OK, &b"fallback"[..])
        );
    }
    assert_eq!(client.get("/").await.status, StatusCode::TOO_MANY_REQUESTS);

    tokio::task::block_in_place(|| redis.restart()).expect("restart");
    wait_for_source(&client, "store").await;
}

/// A rule that fails closed refuses its requests while Redis is down, whatever the layer's
/// failure policy; requests it does not apply to keep the layer's (here the local fallback).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fail_closed_rule_refuses_its_requests_while_redis_is_down() {
    let redis = start_redis();
    let layer = RateLimitLayer::builder(limiter(&redis).await)
        .rule(Rule::new(policy(100, "per-ip")).key(GlobalKey))
        .rule(
            Rule::new(policy(100, "per-phone"))
                .key(floodgate_tower::key::HeaderKey::named("x-phone").expect("header"))
                .on_missing_key(floodgate_tower::OnMissingKey::Allow)
                .path_prefix("/sms")
                .fail_closed(),
        )
        .timeout(Duration::from_millis(300))
        .store_retry_interval(Duration::from_millis(50))
        .build()
        .expect("layer");
    let router = Router::new().route("/sms", get(|| async { "sent" }));
    let client = HttpClient::new(serve(app_with(router, layer)).await);
    let phone: [(&str, &[u8]); 1] = [("x-phone", b"+15551234")];
    assert_eq!(client.get_with("/sms", &phone).await.status, StatusCode::OK);

    tokio::task::block_in_place(|| redis.kill()).expect("kill");
    for _ in 0..3 {
        let res = client.get_with("/sms", &phone).await;
        assert_eq!(res.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(res.header("content-type"), Some("application/problem+json"));
    }
    // Without a phone the rule is not checked (its missing key is allowed): the request
    // keeps the layer's failure policy.
    let res = client.get("/sms").await;
    assert_eq!(
        (res.status, res.body.as_ref()),
        (StatusCode::OK, &b"sent"[..])
    );
    let res = client.get("/").await;
    assert_eq!(
        (res.status, res.body.as_ref()),
        (StatusCode::OK, &b"fallback"[..])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_policies_with_redis_down_and_back() {
    let redis = start_redis();
    let build = |limiter: RedisLimiter, on_error: OnStoreError, name: &str| {
        RateLimitLayer::builder(limiter)
            .rule(Rule::new(policy(1000, name)).key(GlobalKey))
            .on_store_error(on_error)
            .timeout(Duration::from_millis(300))
            .store_retry_interval(Duration::from_millis(50))
            .headers_on_allowed(true)
            .build()
            .expect("layer")
    };
    let open = HttpClient::new(
        serve(app(build(
            limiter(&redis).await,
            OnStoreError::FailOpen,
            "open",
        )))
        .await,
    );
    let closed = HttpClient::new(
        serve(app(build(
            limiter(&redis).await,
            OnStoreError::FailClosed,
            "closed",
        )))
        .await,
    );
    let local = MemoryLimiter::new();
    let fallback = HttpClient::new(
        serve(app(build(
            limiter(&redis).await,
            OnStoreError::Fallback(local.clone()),
            "fallback",
        )))
        .await,
    );
    for client in [&open, &closed, &fallback] {
        let res = client.get("/").await;
        assert_eq!(
            (res.status, res.body.as_ref()),
            (StatusCode::OK, &b"store"[..])
        );
    }

    tokio::task::block_in_place(|| redis.kill()).expect("kill");

    let res = open.get("/").await;
    assert_eq!(
        (res.status, res.body.as_ref()),
        (StatusCode::OK, &b"open"[..])
    );
    assert!(res.headers.get("ratelimit").is_none());

    let res = closed.get("/").await;
    assert_eq!(res.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.header("content-type"), Some("application/problem+json"));
    assert!(res.header("retry-after").is_some());

    let res = fallback.get("/").await;
    assert_eq!(
        (res.status, res.body.as_ref()),
        (StatusCode::OK, &b"fallback"[..])
    );
    // The fallback enforces the same policy, with its own counters.
    let items = sf_list(&res.headers, "ratelimit");
    assert_eq!(
        (items[0].name.as_str(), items[0].int("r")),
        ("fallback", 999)
    );

    // Redis comes back (empty): decisions go back to it.
    tokio::task::block_in_place(|| redis.restart()).expect("restart");
    wait_for_source(&open, "store").await;
    wait_for_source(&closed, "store").await;
    wait_for_source(&fallback, "store").await;
    let size = redis
        .cmd(&["DBSIZE"])
        .expect("dbsize")
        .as_int()
        .expect("int");
    assert!(size >= 1, "{size} keys after restart");
}

/// While Redis is down, a client the deny cache holds as denied stays denied: failing open
/// lets the other clients through, not one Redis had refused until later (it was let through).
/// Also with no retry interval, where every request tries the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_denial_stands_while_redis_is_down() {
    let redis = start_redis();
    for (round, retry) in [Duration::from_millis(50), Duration::ZERO]
        .into_iter()
        .enumerate()
    {
        let layer = RateLimitLayer::builder(limiter(&redis).await)
            .rule(
                Rule::new(policy(2, &format!("per-client-{round}")))
                    .key(HeaderKey::named("x-client").expect("header")),
            )
            .on_store_error(OnStoreError::FailOpen)
            .timeout(Duration::from_millis(300))
            .store_retry_interval(retry)
            .build()
            .expect("layer");
        let client = HttpClient::new(serve(app(layer)).await);
        let attacker: [(&str, &[u8]); 1] = [("x-client", b"attacker")];
        let other: [(&str, &[u8]); 1] = [("x-client", b"other")];
        for _ in 0..2 {
            let res = client.get_with("/", &attacker).await;
            assert_eq!(
                (res.status, res.body.as_ref()),
                (StatusCode::OK, &b"store"[..])
            );
        }
        let denied = client.get_with("/", &attacker).await;
        assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);

        tokio::task::block_in_place(|| redis.kill()).expect("kill");
        for _ in 0..3 {
            let res = client.get_with("/", &other).await;
            assert_eq!(
                (res.status, res.body.as_ref()),
                (StatusCode::OK, &b"open"[..]),
                "retry {retry:?}"
            );
            // The first after the retry interval probes the store (and fails); the next is
            // skipped (the store is failing): both denied.
            tokio::time::sleep(retry * 2).await;
            for _ in 0..2 {
                let res = client.get_with("/", &attacker).await;
                assert_eq!(res.status, StatusCode::TOO_MANY_REQUESTS, "retry {retry:?}");
                assert!(res.header("retry-after").is_some());
            }
        }
        tokio::task::block_in_place(|| redis.restart()).expect("restart");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_redis_hits_the_layer_timeout() {
    let redis = start_redis();
    let config = RedisConfig::new(&redis.url())
        .expect("url")
        .timeout(Duration::from_secs(5));
    let layer = RateLimitLayer::builder(RedisLimiter::connect(&config).await.expect("connect"))
        .rule(Rule::new(policy(10, "paused")).key(GlobalKey))
        .on_store_error(OnStoreError::FailOpen)
        .timeout(Duration::from_millis(100))
        .store_retry_interval(Duration::from_millis(50))
        .build()
        .expect("layer");
    let client = HttpClient::new(serve(app(layer)).await);
    assert_eq!(client.get("/").await.body, "store");
    tokio::task::block_in_place(|| redis.pause()).expect("pause");
    let started = Instant::now();
    let res = client.get("/").await;
    let took = started.elapsed();
    assert_eq!(res.body, "open");
    assert!(
        took < Duration::from_secs(2),
        "{took:?}: the layer's timeout must apply"
    );
    tokio::task::block_in_place(|| redis.resume()).expect("resume");
    wait_for_source(&client, "store").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrency_lease_in_redis_lasts_until_the_body_ends() {
    let redis = start_redis();
    let layer = RateLimitLayer::builder(limiter(&redis).await)
        .rule(common::global(
            Policy::concurrency(1, Duration::from_secs(60)),
            "redis-one",
        ))
        .build()
        .expect("layer");
    let (app, senders) = common::held_stream_app(|app| app.layer(layer));
    let addr = serve(app).await;
    let (mut first, head) = common::open_stream(addr).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let (_second, head) = common::open_stream(addr).await;
    assert!(head.starts_with("HTTP/1.1 429"), "{head}");
    common::end_first(&senders);
    common::read_to_end(&mut first).await;
    // The release is an EVALSHA sent in the background.
    let third = common::wait_admitted(addr).await;
    drop(third);
    let _fourth = common::wait_admitted(addr).await;
}

/// A response body holding a Redis concurrency lease, dropped after its runtime shut down (a
/// response kept past the server's life): nothing can be sent, the lease lapses after its TTL,
/// and nothing panics. The in-memory limiter still releases at once.
#[test]
fn a_lease_dropped_after_its_runtime_shut_down_does_not_panic() {
    let redis = start_redis();
    let one = || {
        Policy::concurrency(1, Duration::from_secs(60))
            .expect("policy")
            .named("one")
            .expect("name")
    };
    let request = || {
        http::Request::get("/")
            .body(axum::body::Body::empty())
            .expect("request")
    };
    let memory = MemoryLimiter::new();
    for redis_backed in [true, false] {
        let runtime = tokio::runtime::Runtime::new().expect("runtime");
        let response = runtime.block_on(async {
            let rule = Rule::new(one()).key(GlobalKey);
            let layer = if redis_backed {
                RateLimitLayer::builder(limiter(&redis).await)
                    .rule(rule)
                    .build()
            } else {
                RateLimitLayer::builder(memory.clone()).rule(rule).build()
            }
            .expect("layer");
            let app = Router::new().route("/", get(common::ok)).layer(layer);
            tower::ServiceExt::oneshot(app, request())
                .await
                .expect("infallible")
        });
        assert_eq!(response.status(), StatusCode::OK);
        drop(runtime);
        drop(response);
    }
    // The in-memory lease came back without a runtime.
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let status = runtime.block_on(async {
        let layer = RateLimitLayer::builder(memory)
            .rule(Rule::new(one()).key(GlobalKey))
            .build()
            .expect("layer");
        let app = Router::new().route("/", get(common::ok)).layer(layer);
        tower::ServiceExt::oneshot(app, request())
            .await
            .expect("infallible")
            .status()
    });
    assert_eq!(status, StatusCode::OK);
}

/// `refund_when` over Redis, behind the deny cache: a failed request's unit comes back (in the
/// background, so the test waits for it), including the last one, whose denial the deny cache
/// had already remembered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refunds_reach_redis_through_the_deny_cache() {
    async fn fail() -> StatusCode {
        StatusCode::SERVICE_UNAVAILABLE
    }
    let server = start_redis();
    let layer = RateLimitLayer::builder(limiter(&server).await)
        .rule(Rule::new(policy(1, "per-ip")).key(PeerIp::new()))
        .refund_when(|status, _| status.is_server_error())
        .build()
        .expect("layer");
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route("/fail", get(fail))
        .layer(layer);
    let client = HttpClient::new(serve(app).await);
    // Spends the only unit (the deny cache remembers that the next one is denied), fails, and
    // is refunded.
    assert_eq!(client.get("/fail").await.status, 503);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let r = client.get("/").await;
        if r.status == 200 {
            break;
        }
        assert_eq!(r.status, 429);
        assert!(
            Instant::now() < deadline,
            "the failed request was never refunded"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // That success counts: the next request is over the limit.
    assert_eq!(client.get("/").await.status, 429);
}

/// A refund made through one replica frees a key that another replica's deny cache holds
/// denied: a layer that refunds holds a denial locally for at most a second, then asks Redis
/// again. (A user's double submit: the first request goes to replica X, the second to Y and
/// is denied; X's SMS provider fails and refunds; the user's retry on Y must not be refused
/// for the rest of the window.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_on_one_replica_frees_the_key_another_replica_cached_as_denied() {
    use std::sync::Arc;
    use tokio::sync::{Notify, oneshot};
    let server = start_redis();
    let (entered_tx, entered_rx) = oneshot::channel::<()>();
    let entered = Arc::new(std::sync::Mutex::new(Some(entered_tx)));
    let fail_now = Arc::new(Notify::new());
    let replica = |limiter: RedisLimiter| {
        let (entered, fail_now) = (Arc::clone(&entered), Arc::clone(&fail_now));
        let layer = RateLimitLayer::builder(limiter)
            .rule(Rule::new(policy(1, "per-phone")).key(GlobalKey))
            .refund_when(|status, _| status.is_server_error())
            .build()
            .expect("layer");
        Router::new()
            .route("/", get(|| async { "ok" }))
            .route(
                "/fail",
                get(move || async move {
                    if let Some(tx) = entered.lock().expect("lock").take() {
                        let _ = tx.send(());
                    }
                    fail_now.notified().await;
                    StatusCode::BAD_GATEWAY
                }),
            )
            .layer(layer)
    };
    let x = HttpClient::new(serve(replica(limiter(&server).await)).await);
    let y = HttpClient::new(serve(replica(limiter(&server).await)).await);

    let failing = tokio::spawn(async move { x.get("/fail").await.status });
    entered_rx.await.expect("X admitted its request");
    // Y is denied for the rest of the 60 s window, and caches that.
    assert_eq!(y.get("/").await.status, 429);
    fail_now.notify_one();
    assert_eq!(failing.await.expect("task"), 502);
    let refunded = Instant::now();
    loop {
        let r = y.get("/").await;
        if r.status == 200 {
            break;
        }
        assert_eq!(r.status, 429);
        assert!(
            refunded.elapsed() < Duration::from_secs(5),
            "Y still denies {:?} after X's refund",
            refunded.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Within its hold (1 s), and one more should its first probe beat the refund (made in
    // the background) to Redis: far inside the 60 s window it would otherwise be denied for.
    assert!(
        refunded.elapsed() < Duration::from_millis(2_500),
        "{:?}",
        refunded.elapsed()
    );
}

/// Over Redis too, a stream that outlasts its lease's TTL keeps its slot (the layer renews the
/// lease while the body lives). A TTL of a second: with 400 ms, a renewal delayed on a busy
/// machine (three crates' tests at once) once let the lease lapse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_longer_than_its_lease_ttl_keeps_its_slot_in_redis() {
    let redis = start_redis();
    let layer = RateLimitLayer::builder(limiter(&redis).await)
        .rule(common::global(
            Policy::concurrency(1, Duration::from_secs(1)),
            "redis-stream",
        ))
        .renew_leases_up_to(Duration::from_secs(60))
        .build()
        .expect("layer");
    let (app, senders) = common::held_stream_app(|app| app.layer(layer));
    let addr = serve(app).await;
    let (first, head) = common::open_stream(addr).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    common::assert_stream_keeps_its_slot(addr, &senders, first, Duration::from_millis(2_500)).await;
}

/// A held lease the store no longer has (flushed, or failed over to a replica that never had
/// it) is lost at the first renewal that finds it gone, long before its TTL; the slot it held
/// is free in the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_lease_the_store_lost_is_lost_at_the_next_renewal() {
    const TTL: Duration = Duration::from_secs(6);
    let redis = start_redis();
    let layer = RateLimitLayer::builder(limiter(&redis).await)
        .rule(common::global(Policy::concurrency(1, TTL), "redis-held"))
        .renew_leases_up_to(Duration::from_secs(60))
        .build()
        .expect("layer");
    let (app, slot) = common::lease_keeping_app();
    let app = app.layer(layer);
    let began = Instant::now();
    let lease = common::take_held_lease(app.clone(), &slot).await;
    assert_eq!(
        common::ask_upgrade(app.clone()).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    redis.cmd_ok(&["FLUSHALL"]).expect("flushall");
    // Renewals every 2 s: the first after the flush finds the lease gone.
    tokio::time::timeout(Duration::from_secs(15), lease.lost())
        .await
        .expect("the lease was never lost");
    let took = began.elapsed();
    assert!(lease.is_lost());
    assert!(
        took < Duration::from_secs(4),
        "lost at its TTL, not at the renewal that found it gone: {took:?}"
    );
    assert_eq!(
        common::ask_upgrade(app).await,
        StatusCode::SWITCHING_PROTOCOLS
    );
}

/// A credential keyed with `HeaderKey::hashed_with` limits its holder across replicas, and
/// neither the credential nor the secret appears in any Redis key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hashed_credential_key_limits_its_holder_and_never_reaches_redis() {
    let redis = start_redis();
    let mut clients = Vec::new();
    for _ in 0..2 {
        let key = HeaderKey::named("x-api-key")
            .expect("name")
            .hashed_with(b"replica-secret");
        let layer = RateLimitLayer::builder(limiter(&redis).await)
            .rule(Rule::new(policy(2, "per-key")).key(key))
            .build()
            .expect("layer");
        let app = Router::new().route("/", get(common::ok)).layer(layer);
        clients.push(HttpClient::new(serve(app).await));
    }
    let alice: &[u8] = b"sk_live_ALICE0123456789";
    let bob: &[u8] = b"sk_live_BOB0123456789";
    let statuses = |key: &'static [u8]| {
        let clients = &clients;
        async move {
            let mut out = Vec::new();
            for i in 0..3 {
                let res = clients[i % 2].get_with("/", &[("x-api-key", key)]).await;
                out.push(res.status);
            }
            out
        }
    };
    let (a, b) = (statuses(alice).await, statuses(bob).await);
    let limited = [
        StatusCode::OK,
        StatusCode::OK,
        StatusCode::TOO_MANY_REQUESTS,
    ];
    assert_eq!(a, limited, "alice across both replicas");
    assert_eq!(b, limited, "bob has counts of his own");
    let keys = redis.cmd(&["KEYS", "*"]).expect("keys");
    let names: Vec<&[u8]> = keys
        .as_array()
        .expect("array")
        .iter()
        .map(|k| k.as_bytes().expect("name"))
        .collect();
    assert_eq!(names.len(), 2, "one state per credential: {names:?}");
    for name in &names {
        for secret in [alice, bob, &b"sk_live"[..], b"replica-secret"] {
            assert!(
                !name.windows(secret.len()).any(|w| w == secret),
                "{:?} holds {:?}",
                String::from_utf8_lossy(name),
                String::from_utf8_lossy(secret)
            );
        }
    }
}
