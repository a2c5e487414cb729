//! The layer in an axum app over real sockets, with the in-memory limiter.
// RouteKey, route rules and the RateLimitInfo extractor need the `axum` feature.
#![cfg(feature = "axum")]

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::{get, post};
use bytes::Bytes;
use common::{HttpClient, ok, serve, sf_list};
use floodgate_core::{
    Check, CheckOptions, LeaseId, Limiter, MemoryError, MemoryLimiter, Policy, Verdict,
};
use floodgate_tower::key::{
    ClientIp, GlobalKey, HeaderKey, Key, PeerIp, RequestView, RouteKey, TrustedProxies,
};
use floodgate_tower::{
    HeldLease, OnMissingKey, OnStoreError, RateLimitInfo, RateLimitLayer, Rejection, RejectionKind,
    Rule,
};
use http::{Method, Response, StatusCode};

fn policy(limit: u64, window_secs: u64, name: &str) -> Policy {
    Policy::fixed_window(limit, Duration::from_secs(window_secs))
        .expect("policy")
        .named(name)
        .expect("name")
}

/// 3 per 10 s per peer IP, with headers on allowed responses too.
fn three_per_ten_seconds() -> RateLimitLayer {
    RateLimitLayer::builder(MemoryLimiter::new())
        .rule(Rule::new(policy(3, 10, "per-ip")).key(PeerIp::new()))
        .headers_on_allowed(true)
        .build()
        .expect("layer")
}

#[tokio::test]
async fn the_request_over_the_limit_gets_429_with_headers() {
    let layer = three_per_ten_seconds();
    assert_429_with_headers(Router::new().route("/", get(ok)).layer(layer)).await;
}

#[tokio::test]
async fn a_layer_with_axum_s_own_body_gives_the_same_answers() {
    let layer = three_per_ten_seconds().native_body();
    assert_429_with_headers(Router::new().route("/", get(ok)).layer(layer)).await;
}

/// Three requests to `/` of `app` are allowed with `RateLimit` headers, the fourth gets a 429
/// with `Retry-After`, the headers and a problem+json body.
async fn assert_429_with_headers(app: Router) {
    let client = HttpClient::new(serve(app).await);

    for expected_remaining in [2, 1, 0] {
        let res = client.get("/").await;
        assert_eq!(res.status, StatusCode::OK);
        assert_eq!(res.body, "ok");
        let policies = sf_list(&res.headers, "ratelimit-policy");
        assert_eq!(policies.len(), 1);
        assert_eq!(policies[0].name, "per-ip");
        assert_eq!(policies[0].int("q"), 3);
        assert_eq!(policies[0].int("w"), 10);
        let limits = sf_list(&res.headers, "ratelimit");
        assert_eq!(limits.len(), 1);
        assert_eq!(limits[0].name, "per-ip");
        assert_eq!(limits[0].int("r"), expected_remaining);
        let t = limits[0].int("t");
        assert!((9..=10).contains(&t), "t={t}");
        assert!(res.header("retry-after").is_none());
    }

    let res = client.get("/").await;
    assert_eq!(res.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(res.header("content-type"), Some("application/problem+json"));
    let retry_after: u64 = res
        .header("retry-after")
        .expect("retry-after")
        .parse()
        .expect("secs");
    assert!((9..=10).contains(&retry_after), "retry-after={retry_after}");
    let limits = sf_list(&res.headers, "ratelimit");
    assert_eq!(limits[0].int("r"), 0);
    // Retry-After never points before the end of the effective window.
    assert!(limits[0].int("t") <= retry_after);
    assert_eq!(sf_list(&res.headers, "ratelimit-policy")[0].int("q"), 3);

    let problem = res.json();
    assert_eq!(
        problem["type"],
        "https://iana.org/assignments/http-problem-types#quota-exceeded"
    );
    assert_eq!(problem["title"], "Quota Exceeded");
    assert_eq!(problem["status"], 429);
    assert_eq!(problem["policy"], "per-ip");
    assert_eq!(problem["violated-policies"], serde_json::json!(["per-ip"]));
    let retry_ms = problem["retry_after_ms"].as_u64().expect("retry_after_ms");
    assert_eq!(retry_ms.div_ceil(1000), retry_after);
    assert!(
        problem["detail"]
            .as_str()
            .expect("detail")
            .contains("per-ip")
    );
}

#[tokio::test]
async fn by_default_only_rejections_carry_the_headers() {
    let layer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(Rule::new(policy(1, 10, "per-ip")).key(PeerIp::new()))
        .legacy_headers(true)
        .build()
        .expect("layer");
    let addr = serve(Router::new().route("/", get(ok)).layer(layer)).await;
    let client = HttpClient::new(addr);

    let res = client.get("/").await;
    assert_eq!(res.status, StatusCode::OK);
    for name in ["ratelimit", "ratelimit-policy", "x-ratelimit-remaining"] {
        assert!(res.headers.get(name).is_none(), "{name}");
    }
    let res = client.get("/").await;
    assert_eq!(res.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(res.header("retry-after").is_some());
    assert_eq!(sf_list(&res.headers, "ratelimit")[0].int("r"), 0);
    assert_eq!(sf_list(&res.headers, "ratelimit-policy")[0].int("q"), 1);
    assert_eq!(res.header("x-ratelimit-remaining"), Some("0"));
}

#[tokio::test]
async fn headers_count_requests_under_a_rule_whose_requests_cost_more_than_one() {
    // 100 units per 10 s, at 30 a request: 3 requests. A client pacing itself by the headers
    // must read 3, not 100 (the draft's quota unit is the request).
    // Beside it, 5 per 10 s at 1 a request: fewer units left, more requests left. The legacy
    // headers describe the policy with the fewest requests left.
    let layer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(
            Rule::new(policy(100, 10, "uploads"))
                .key(PeerIp::new())
                .cost(30),
        )
        .rule(Rule::new(policy(5, 10, "per-ip")).key(PeerIp::new()))
        .headers_on_allowed(true)
        .legacy_headers(true)
        .build()
        .expect("layer");
    let client = HttpClient::new(serve(Router::new().route("/", get(ok)).layer(layer)).await);
    for expected_remaining in [2, 1, 0] {
        let res = client.get("/").await;
        assert_eq!(res.status, StatusCode::OK);
        assert_eq!(sf_list(&res.headers, "ratelimit-policy")[0].int("q"), 3);
        let limits = sf_list(&res.headers, "ratelimit");
        assert_eq!(limits[0].int("r"), expected_remaining);
        assert_eq!(limits[1].int("r"), expected_remaining + 2);
        assert_eq!(res.header("x-ratelimit-limit"), Some("3"));
        let remaining = expected_remaining.to_string();
        assert_eq!(
            res.header("x-ratelimit-remaining"),
            Some(remaining.as_str())
        );
    }
    // 10 units are left, too few for a request: the headers said 0, and it is refused.
    let res = client.get("/").await;
    assert_eq!(res.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(sf_list(&res.headers, "ratelimit")[0].int("r"), 0);
    assert_eq!(sf_list(&res.headers, "ratelimit-policy")[0].int("q"), 3);
}

#[tokio::test]
async fn several_policies_are_all_or_nothing() {
    let layer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(Rule::new(policy(2, 60, "per-user")).key(HeaderKey::named("x-user").expect("name")))
        .rule(Rule::new(policy(3, 60, "global")).key(GlobalKey))
        .legacy_headers(true)
        .headers_on_allowed(true)
        .build()
        .expect("layer");
    let addr = serve(Router::new().route("/", get(ok)).layer(layer)).await;
    let client = HttpClient::new(addr);
    let as_user = |u: &'static str| {
        let client = client.clone();
        async move { client.get_with("/", &[("x-user", u.as_bytes())]).await }
    };

    assert_eq!(as_user("a").await.status, StatusCode::OK);
    let second = as_user("a").await;
    assert_eq!(second.status, StatusCode::OK);
    let items = sf_list(&second.headers, "ratelimit");
    assert_eq!(
        items
            .iter()
            .map(|i| (i.name.as_str(), i.int("r")))
            .collect::<Vec<_>>(),
        [("per-user", 0), ("global", 1)]
    );
    assert_eq!(sf_list(&second.headers, "ratelimit-policy").len(), 2);
    // Legacy headers describe the strictest policy.
    assert_eq!(second.header("x-ratelimit-limit"), Some("2"));
    assert_eq!(second.header("x-ratelimit-remaining"), Some("0"));

    // Denied by per-user: nothing is counted, so the global quota still has room for b.
    let denied = as_user("a").await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(denied.json()["policy"], "per-user");
    assert_eq!(as_user("b").await.status, StatusCode::OK);
    let global = as_user("b").await;
    assert_eq!(global.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(global.json()["policy"], "global");
    assert_eq!(
        global.json()["violated-policies"],
        serde_json::json!(["global"])
    );
}

#[tokio::test]
async fn missing_keys_follow_the_configured_behaviour() {
    let app = |on_missing: OnMissingKey| {
        let layer = RateLimitLayer::builder(MemoryLimiter::new())
            .rule(
                Rule::new(policy(2, 60, "api-key"))
                    .key(HeaderKey::named("x-api-key").expect("name")),
            )
            .on_missing_key(on_missing)
            .build()
            .expect("layer");
        Router::new().route("/", get(ok)).layer(layer)
    };

    // Reject: 400 problem+json, for absent, empty and too long keys.
    let client = HttpClient::new(serve(app(OnMissingKey::Reject)).await);
    let huge = vec![b'k'; 2048];
    for headers in [
        vec![],
        vec![("x-api-key", &b""[..])],
        vec![("x-api-key", &huge[..])],
    ] {
        let res = client.get_with("/", &headers).await;
        assert_eq!(res.status, StatusCode::BAD_REQUEST, "{headers:?}");
        assert_eq!(res.header("content-type"), Some("application/problem+json"));
        assert_eq!(res.json()["status"], 400);
        assert_eq!(res.json()["policy"], "api-key");
    }
    // Hostile but acceptable keys: opaque bytes, never a 500.
    let binary = b"\xff\xfe\x80key\x90";
    for _ in 0..2 {
        assert_eq!(
            client.get_with("/", &[("x-api-key", binary)]).await.status,
            StatusCode::OK
        );
    }
    assert_eq!(
        client.get_with("/", &[("x-api-key", binary)]).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    let kib = vec![b'k'; 1024];
    assert_eq!(
        client.get_with("/", &[("x-api-key", &kib)]).await.status,
        StatusCode::OK
    );

    // Allow: the rule does not apply; no headers.
    let client = HttpClient::new(serve(app(OnMissingKey::Allow)).await);
    for _ in 0..5 {
        let res = client.get("/").await;
        assert_eq!(res.status, StatusCode::OK);
        assert!(res.headers.get("ratelimit").is_none());
    }
    // But a key that is there and too long is turned away: padded with blanks the application
    // trims, a client's own key would otherwise skip the rule.
    let mut padded = b"k1".to_vec();
    padded.resize(2048, b' ');
    padded.extend_from_slice(b"x");
    let res = client.get_with("/", &[("x-api-key", &padded[..])]).await;
    assert_eq!(res.status, StatusCode::BAD_REQUEST);
    assert_eq!(res.json()["policy"], "api-key");
    // But a key header sent twice is turned away, whatever the setting: the application may
    // read the first instance while a proxy appended the last.
    let twice = [("x-api-key", &b"k1"[..]), ("x-api-key", &b"k2"[..])];
    let res = client.get_with("/", &twice).await;
    assert_eq!(res.status, StatusCode::BAD_REQUEST);
    assert_eq!(res.json()["policy"], "api-key");

    // A fallback key: every keyless request shares one bucket.
    let client = HttpClient::new(serve(app(OnMissingKey::UseKey(Key::from("anonymous")))).await);
    assert_eq!(client.get("/").await.status, StatusCode::OK);
    assert_eq!(
        client
            .get_with("/", &[("x-api-key", &huge[..])])
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(client.get("/").await.status, StatusCode::TOO_MANY_REQUESTS);
    // A keyed request is unaffected.
    assert_eq!(
        client.get_with("/", &[("x-api-key", b"k1")]).await.status,
        StatusCode::OK
    );
}

#[tokio::test]
async fn rules_apply_per_route_and_method() {
    let layer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(
            Rule::new(policy(1, 60, "login"))
                .path_prefix("/login")
                .methods([Method::POST]),
        )
        .rule(
            Rule::new(policy(2, 60, "per-user-route"))
                .route("/users/{id}")
                .key(RouteKey),
        )
        .headers_on_allowed(true)
        .build()
        .expect("layer");
    let app = Router::new()
        .route("/login", post(ok).get(ok))
        .route("/users/{id}", get(ok))
        .route("/", get(ok))
        .layer(layer);
    let client = HttpClient::new(serve(app).await);

    assert_eq!(
        client.send(http::Request::post("/login"), &[]).await.status,
        StatusCode::OK
    );
    assert_eq!(
        client.send(http::Request::post("/login"), &[]).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // GET /login and / are not limited, and carry no headers.
    for path in ["/login", "/", "/login", "/"] {
        let res = client.get(path).await;
        assert_eq!(res.status, StatusCode::OK);
        assert!(res.headers.get("ratelimit").is_none());
    }
    // Keyed by the route pattern: different ids share the quota.
    assert_eq!(client.get("/users/1").await.status, StatusCode::OK);
    let res = client.get("/users/2").await;
    assert_eq!(res.status, StatusCode::OK);
    assert_eq!(sf_list(&res.headers, "ratelimit")[0].name, "per-user-route");
    assert_eq!(
        client.get("/users/3").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// Keyed by route, the requests the router's fallback serves (no route matched) share one key:
/// they get their 404, not a 400 for want of a route, and made-up paths do not get a bucket
/// each. Outside a router there is no route at all: the key is missing.
#[tokio::test]
async fn route_keys_give_the_router_s_fallback_one_key() {
    let layer = || {
        RateLimitLayer::builder(MemoryLimiter::new())
            .rule(Rule::new(policy(2, 60, "per-route")).key(RouteKey))
            .build()
            .expect("layer")
    };
    let app = Router::new().route("/a", get(ok)).layer(layer());
    let client = HttpClient::new(serve(app).await);
    assert_eq!(client.get("/nowhere-1").await.status, StatusCode::NOT_FOUND);
    assert_eq!(client.get("/nowhere-2").await.status, StatusCode::NOT_FOUND);
    assert_eq!(
        client.get("/nowhere-3").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // A matched route has a bucket of its own.
    assert_eq!(client.get("/a").await.status, StatusCode::OK);

    // The layer around the router, not in it: no route, a missing key (400 by default).
    use tower::ServiceExt as _;
    let outside = tower::ServiceBuilder::new()
        .layer(layer().native_body())
        .service(Router::new().route("/a", get(ok)));
    let req = http::Request::get("/a")
        .body(axum::body::Body::empty())
        .expect("request");
    let res = outside.oneshot(req).await.expect("infallible");
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
}

/// A handler behind the layer that takes `RateLimitInfo` finds one on every request, those no
/// rule applies to included (there it has no policies), not the extractor's 500.
#[tokio::test]
async fn requests_no_rule_applies_to_have_their_info_too() {
    let layer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(Rule::new(policy(5, 60, "only-a")).path_prefix("/a"))
        .rule(
            Rule::new(policy(5, 60, "by-tenant"))
                .path_prefix("/b")
                .key(HeaderKey::named("x-tenant").expect("name"))
                .on_missing_key(OnMissingKey::Allow),
        )
        .build()
        .expect("layer");
    let handler = |info: RateLimitInfo| async move {
        match info.strictest() {
            Some((policy, _)) => format!("limited by {}", policy.name()),
            None => format!("not limited {:?} {}", info.source(), info.policies().len()),
        }
    };
    let app = Router::new()
        .route("/a", get(handler))
        .route("/b", get(handler))
        .route("/c", get(handler))
        .layer(layer);
    let client = HttpClient::new(serve(app).await);
    assert_eq!(client.get("/a").await.body, "limited by only-a");
    for path in ["/b", "/c"] {
        let res = client.get(path).await;
        assert_eq!(res.status, StatusCode::OK, "{path}");
        assert_eq!(res.body, "not limited NotLimited 0", "{path}");
    }

    // Behind another layer that did limit the request, the inner one's "not limited" does not
    // replace that layer's info.
    let inner = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(Rule::new(policy(5, 60, "only-a")).path_prefix("/a"))
        .build()
        .expect("layer");
    let outer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(Rule::new(policy(5, 60, "everything")))
        .build()
        .expect("layer");
    let app = Router::new()
        .route("/c", get(handler))
        .layer(inner)
        .layer(outer);
    let client = HttpClient::new(serve(app).await);
    assert_eq!(client.get("/c").await.body, "limited by everything");
}

/// HEAD is answered by the GET handler, and a percent-escaped or dotted path by the handler
/// of its decoded form: both count under the rule of what the handler does.
#[tokio::test]
async fn head_requests_and_other_spellings_of_a_path_count_under_its_rule() {
    let layer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(
            Rule::new(policy(1, 60, "export"))
                .path_prefix("/export")
                .methods([Method::GET]),
        )
        .rule(Rule::new(policy(1, 60, "sms")).path_prefix("/v1/sms"))
        .build()
        .expect("layer");
    let exports = Arc::new(Mutex::new(0));
    let channels = Arc::new(Mutex::new(Vec::new()));
    let app = Router::new()
        .route(
            "/export",
            get({
                let exports = Arc::clone(&exports);
                move || async move {
                    *exports.lock().expect("lock") += 1;
                    "data"
                }
            }),
        )
        .route(
            "/v1/{channel}/send",
            post({
                let channels = Arc::clone(&channels);
                move |axum::extract::Path(channel): axum::extract::Path<String>| async move {
                    channels.lock().expect("lock").push(channel);
                    "sent"
                }
            }),
        )
        .layer(layer);
    let client = HttpClient::new(serve(app).await);

    assert_eq!(client.get("/export").await.status, StatusCode::OK);
    let head = client.send(http::Request::head("/export"), &[]).await;
    assert_eq!(head.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        *exports.lock().expect("lock"),
        1,
        "HEAD ran the GET handler"
    );

    let send = |path: &'static str| client.send(http::Request::post(path), &[]);
    assert_eq!(send("/v1/sms/send").await.status, StatusCode::OK);
    assert_eq!(
        send("/v1/%73ms/send").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        send("/v1/%73%4d%53/send").await.status,
        StatusCode::OK,
        "sMS is another"
    );
    assert_eq!(
        *channels.lock().expect("lock"),
        ["sms", "sMS"],
        "the escaped path reached the handler of the rule's path"
    );
}

/// A file server (`ServeDir`) decodes the whole path, `%2F` too, and serves
/// `/downloads%2Fbig.iso` as `/downloads/big.iso`, which the router sends to its fallback: the
/// request counts under the `/downloads` rule all the same.
#[tokio::test]
async fn an_escaped_slash_counts_under_the_prefix_it_spells() {
    let layer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(Rule::new(policy(1, 60, "downloads")).path_prefix("/downloads"))
        .build()
        .expect("layer");
    // As a file server reads the path: every escape decoded, empty and `.` segments dropped.
    let files = |uri: http::Uri| async move {
        let decoded = percent_decoded(uri.path());
        let file: Vec<&str> = decoded
            .split('/')
            .filter(|s| !s.is_empty() && *s != ".")
            .collect();
        file.join("/")
    };
    let client = HttpClient::new(serve(Router::new().fallback(files).layer(layer)).await);
    let first = client.get("/downloads/big.iso").await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.body, "downloads/big.iso");
    for spelled in ["/downloads%2Fbig.iso", "/downloads%2F.%2F%2Fbig.iso"] {
        assert_eq!(
            client.get(spelled).await.status,
            StatusCode::TOO_MANY_REQUESTS,
            "{spelled}"
        );
    }
}

/// `path` with every percent-escape decoded.
fn percent_decoded(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        let escaped = bytes
            .get(i + 1..i + 3)
            .filter(|_| b == b'%')
            .and_then(|hex| std::str::from_utf8(hex).ok())
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match escaped {
            Some(c) => {
                out.push(c);
                i += 3;
            }
            None => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn a_grpc_content_type_on_a_get_is_answered_as_http() {
    let layer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(Rule::new(policy(1, 60, "per-ip")).key(PeerIp::new()))
        .build()
        .expect("layer");
    let client = HttpClient::new(serve(Router::new().route("/app.js", get(ok)).layer(layer)).await);
    let grpc: &[(&str, &[u8])] = &[("content-type", b"application/grpc")];
    assert_eq!(
        client.get_with("/app.js", grpc).await.status,
        StatusCode::OK
    );
    // Not gRPC's trailers-only 200 with an empty body, which a cache could keep for /app.js.
    let res = client.get_with("/app.js", grpc).await;
    assert_eq!(res.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(res.headers.get("grpc-status").is_none());
    assert_eq!(
        res.headers.get("content-type").map(|v| v.as_bytes()),
        Some(&b"application/problem+json"[..])
    );
}

#[tokio::test]
async fn spoofed_forwarding_headers_do_not_change_the_key() {
    // The test client connects from 127.0.0.1: make it a trusted proxy.
    let trusted = TrustedProxies::parse("127.0.0.0/8").expect("nets");
    let app = |client_ip: ClientIp| {
        let layer = RateLimitLayer::builder(MemoryLimiter::new())
            .rule(Rule::new(policy(2, 60, "per-client")).key(client_ip))
            .build()
            .expect("layer");
        Router::new().route("/", get(ok)).layer(layer)
    };

    let client = HttpClient::new(serve(app(ClientIp::new(trusted.clone()))).await);
    let xff = |v: &'static str| {
        let client = client.clone();
        async move {
            client
                .get_with("/", &[("x-forwarded-for", v.as_bytes())])
                .await
                .status
        }
    };
    assert_eq!(xff("203.0.113.9").await, StatusCode::OK);
    assert_eq!(xff("6.6.6.6, 203.0.113.9").await, StatusCode::OK);
    // Forged entries on the left, or a forged first header instance, change nothing.
    assert_eq!(
        xff("1.1.1.1, 2.2.2.2, 203.0.113.9").await,
        StatusCode::TOO_MANY_REQUESTS
    );
    let res = client
        .get_with(
            "/",
            &[
                ("x-forwarded-for", b"7.7.7.7"),
                ("x-forwarded-for", b"203.0.113.9"),
            ],
        )
        .await;
    assert_eq!(res.status, StatusCode::TOO_MANY_REQUESTS);
    // Another client behind the same proxy has its own quota.
    assert_eq!(xff("198.51.100.1").await, StatusCode::OK);

    // RFC 7239 Forwarded, IPv6 grouped by /64.
    let client = HttpClient::new(serve(app(ClientIp::new(trusted).forwarded())).await);
    let fwd = |v: &'static str| {
        let client = client.clone();
        async move {
            client
                .get_with("/", &[("forwarded", v.as_bytes())])
                .await
                .status
        }
    };
    assert_eq!(
        fwd("for=\"[2001:db8:1:2::1]:4711\";proto=https").await,
        StatusCode::OK
    );
    assert_eq!(
        fwd("for=6.6.6.6, for=\"[2001:db8:1:2::99]\"").await,
        StatusCode::OK
    );
    assert_eq!(
        fwd("for=\"[2001:db8:1:2::5]\"").await,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(fwd("for=\"[2001:db8:1:3::1]\"").await, StatusCode::OK);
    // X-Forwarded-For is not read when Forwarded is configured.
    let res = client
        .get_with(
            "/",
            &[
                ("x-forwarded-for", b"9.9.9.9"),
                ("forwarded", b"for=\"[2001:db8:1:2::7]\""),
            ],
        )
        .await;
    assert_eq!(res.status, StatusCode::TOO_MANY_REQUESTS);

    // An untrusted peer: headers are ignored, the key is the peer address.
    let untrusted = ClientIp::new(TrustedProxies::parse("10.0.0.0/8").expect("nets"));
    let client = HttpClient::new(serve(app(untrusted)).await);
    for (i, forged) in ["1.1.1.1", "2.2.2.2", "3.3.3.3"].iter().enumerate() {
        let status = client
            .get_with("/", &[("x-forwarded-for", forged.as_bytes())])
            .await
            .status;
        let expected = if i < 2 {
            StatusCode::OK
        } else {
            StatusCode::TOO_MANY_REQUESTS
        };
        assert_eq!(status, expected, "{forged}");
    }
}

#[tokio::test]
async fn handlers_see_the_decision() {
    async fn show(info: RateLimitInfo) -> String {
        let (policy, decision) = info.strictest().expect("a decision");
        format!(
            "{} {} {} {:?}",
            policy.name(),
            decision.remaining,
            info.policies().count(),
            info.source()
        )
    }
    async fn maybe(info: Option<RateLimitInfo>) -> String {
        format!("{}", info.is_some())
    }
    let layer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(Rule::new(policy(5, 60, "loose")).key(GlobalKey))
        .rule(Rule::new(policy(3, 60, "tight")).key(GlobalKey))
        .build()
        .expect("layer");
    let app = Router::new()
        .route("/info", get(show))
        .route_layer(layer)
        .route("/open", get(maybe));
    let client = HttpClient::new(serve(app).await);
    assert_eq!(client.get("/info").await.body, "tight 2 2 Store");
    assert_eq!(client.get("/open").await.body, "false");
}

/// When a store's answer comes: at once, after one yield, or after another task wakes it (as
/// a store doing I/O).
#[derive(Clone, Copy, Debug)]
enum Answer {
    AtOnce,
    AfterYield,
    AfterWake,
    /// Decides after this long (a slow store: the lease it grants starts then).
    After(Duration),
}

/// A store that is not the in-memory limiter (so the layer awaits its future), backed by one;
/// it can be taken down (every check fails), and counts its checks.
#[derive(Clone)]
struct RemoteStore {
    memory: MemoryLimiter,
    answer: Answer,
    down: Arc<std::sync::atomic::AtomicBool>,
    checks: Arc<std::sync::atomic::AtomicU64>,
}

impl RemoteStore {
    fn new(answer: Answer) -> Self {
        RemoteStore {
            memory: MemoryLimiter::new(),
            answer,
            down: Arc::default(),
            checks: Arc::default(),
        }
    }
}

impl Limiter for RemoteStore {
    type Error = MemoryError;

    async fn check(
        &self,
        checks: &[Check<'_>],
        opts: CheckOptions,
    ) -> Result<Verdict, MemoryError> {
        self.checks
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if self.down.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(MemoryError::InvalidCheck("the store is down".into()));
        }
        match self.answer {
            Answer::AtOnce => {}
            Answer::AfterYield => tokio::task::yield_now().await,
            Answer::AfterWake => {
                let (tx, rx) = tokio::sync::oneshot::channel();
                tokio::spawn(async move { tx.send(()) });
                let _ = rx.await;
            }
            Answer::After(delay) => tokio::time::sleep(delay).await,
        }
        self.memory.check(checks, opts).await
    }

    async fn release(&self, checks: &[Check<'_>], lease: LeaseId) -> Result<(), MemoryError> {
        self.memory.release(checks, lease).await
    }

    async fn renew(&self, checks: &[Check<'_>], lease: LeaseId) -> Result<bool, MemoryError> {
        self.memory.renew(checks, lease).await
    }

    async fn refund(&self, checks: &[Check<'_>], verdict: &Verdict) -> Result<(), MemoryError> {
        self.memory.refund(checks, verdict).await
    }

    async fn reset(&self, key: &[u8], policy: &Policy) -> Result<(), MemoryError> {
        self.memory.reset(key, policy).await
    }
}

/// Over a store that is not `MemoryLimiter` (with its deny cache, with and without leasing),
/// answering at once or later: handlers see the decision, allowed responses carry the headers,
/// rejections their retry time, no more than the limit passes, and a concurrency lease taken
/// with the decision is given back when the response ends.
#[tokio::test]
async fn a_remote_store_answering_at_once_or_later_keeps_the_limit_and_gives_leases_back() {
    async fn show(info: RateLimitInfo) -> String {
        let (policy, decision) = info.strictest().expect("a decision");
        format!("{} {}", policy.name(), decision.limit)
    }
    for answer in [Answer::AtOnce, Answer::AfterYield, Answer::AfterWake] {
        for leasing in [false, true] {
            let store = RemoteStore::new(answer);
            let builder = RateLimitLayer::builder(store)
                .rule(Rule::new(policy(100, 60, "remote")).key(GlobalKey))
                .headers_on_allowed(true);
            let builder = if leasing {
                builder.leasing(floodgate_core::LeasingConfig {
                    fraction: 0.1,
                    min_units: 2,
                    hot_after: 2,
                    ..floodgate_core::LeasingConfig::default()
                })
            } else {
                builder
            };
            let layer = builder.build().expect("layer");
            let client =
                HttpClient::new(serve(Router::new().route("/", get(show)).layer(layer)).await);
            let mut allowed = 0;
            for _ in 0..130 {
                let res = client.get("/").await;
                if res.status == StatusCode::OK {
                    allowed += 1;
                    assert_eq!(res.body, "remote 100");
                    assert_eq!(sf_list(&res.headers, "ratelimit").len(), 1);
                } else {
                    assert_eq!(res.status, StatusCode::TOO_MANY_REQUESTS);
                    assert!(res.header("retry-after").is_some());
                }
            }
            let case = format!("{answer:?}, leasing {leasing}");
            if leasing {
                // Units left in the last lease may go unused.
                assert!((90..=100).contains(&allowed), "{case}: {allowed} allowed");
            } else {
                assert_eq!(allowed, 100, "{case}");
            }
        }
        // One request at a time: each lease is back before the next request.
        let store = RemoteStore::new(answer);
        let one_at_a_time = Policy::concurrency(1, Duration::from_secs(60)).expect("policy");
        let layer = RateLimitLayer::builder(store)
            .rule(Rule::new(one_at_a_time).key(GlobalKey))
            .build()
            .expect("layer");
        let client = HttpClient::new(serve(Router::new().route("/", get(ok)).layer(layer)).await);
        for i in 0..5 {
            assert_eq!(
                client.get("/").await.status,
                StatusCode::OK,
                "{answer:?} #{i}"
            );
        }
    }
}

#[tokio::test]
async fn a_custom_rejection_handler_shapes_the_response() {
    let layer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(Rule::new(policy(1, 60, "one")).key(GlobalKey))
        .rejection_handler(|r: &Rejection<'_>| {
            assert_eq!(r.kind(), RejectionKind::Limited);
            let mut res = Response::new(Bytes::from(format!(
                "slow down: {}",
                r.policy().expect("policy").name()
            )));
            *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            res
        })
        .build()
        .expect("layer");
    let client = HttpClient::new(serve(Router::new().route("/", get(ok)).layer(layer)).await);
    assert_eq!(client.get("/").await.status, StatusCode::OK);
    let res = client.get("/").await;
    assert_eq!(res.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.body, "slow down: one");
    assert!(res.header("retry-after").is_some());
    assert_eq!(sf_list(&res.headers, "ratelimit")[0].int("r"), 0);
}

/// Arrival times at the handler.
type Arrivals = Arc<Mutex<Vec<Instant>>>;

fn recording_app(layer: RateLimitLayer, arrivals: Arrivals) -> Router {
    Router::new()
        .route(
            "/",
            get(move || {
                let arrivals = arrivals.clone();
                async move {
                    arrivals.lock().expect("lock").push(Instant::now());
                    "ok"
                }
            }),
        )
        .layer(layer)
}

async fn burst(client: &HttpClient, n: usize) -> Vec<StatusCode> {
    let mut tasks = Vec::new();
    for _ in 0..n {
        let client = client.clone();
        tasks.push(tokio::spawn(async move { client.get("/").await.status }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("task"));
    }
    out
}

/// The k-th request (from 0) reached the handler no sooner than `k * step` after `started`:
/// its turn. A request the scheduler wakes late only arrives later than its turn, so the gap
/// after it may be short; what is checked is that none arrived before its turn, and that the
/// arrivals spread over at least half of their turns (not held and let go together).
fn assert_spaced(arrivals: &Arrivals, started: Instant, step: Duration) {
    let mut times = arrivals.lock().expect("lock").clone();
    times.sort();
    if let (Some(first), Some(last)) = (times.first(), times.last()) {
        let turns = step * u32::try_from(times.len() - 1).expect("few requests");
        assert!(
            *last - *first >= turns / 2,
            "arrivals spread over {:?}, expected about {turns:?}",
            *last - *first
        );
    }
    for (k, at) in times.iter().enumerate() {
        let turn = step * u32::try_from(k).expect("few requests");
        let after = *at - started;
        assert!(
            after >= turn,
            "request {k} arrived {after:?} after the burst began, before its turn at {turn:?} \
             (arrivals: {:?})",
            times.iter().map(|t| *t - started).collect::<Vec<_>>()
        );
    }
}

#[tokio::test]
async fn delay_mode_spaces_requests_out() {
    // A shaper: one every 100 ms; requests reserve their turn and wait for it.
    let arrivals = Arrivals::default();
    let layer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(common::global(
            Policy::shaper(10, Duration::from_secs(1)),
            "shaper",
        ))
        .delay(Duration::from_secs(2))
        .build()
        .expect("layer");
    let client = HttpClient::new(serve(recording_app(layer, arrivals.clone())).await);
    let started = Instant::now();
    let statuses = burst(&client, 5).await;
    assert!(
        statuses.iter().all(|s| *s == StatusCode::OK),
        "{statuses:?}"
    );
    assert_spaced(&arrivals, started, Duration::from_millis(90));
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(380), "{took:?}");

    // GCRA without burst: denied requests sleep their retry_after and try again.
    let arrivals = Arrivals::default();
    let layer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(common::global(
            Policy::gcra(0, 10, Duration::from_secs(1)),
            "gcra",
        ))
        .delay(Duration::from_secs(2))
        .build()
        .expect("layer");
    let client = HttpClient::new(serve(recording_app(layer, arrivals.clone())).await);
    let started = Instant::now();
    let statuses = burst(&client, 4).await;
    assert!(
        statuses.iter().all(|s| *s == StatusCode::OK),
        "{statuses:?}"
    );
    assert_spaced(&arrivals, started, Duration::from_millis(90));

    // Past the maximum wait, requests are turned away.
    let arrivals = Arrivals::default();
    let layer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(common::global(
            Policy::shaper(4, Duration::from_secs(1)),
            "slow",
        ))
        .delay(Duration::from_millis(300))
        .build()
        .expect("layer");
    let client = HttpClient::new(serve(recording_app(layer, arrivals.clone())).await);
    let statuses = burst(&client, 5).await;
    let ok = statuses.iter().filter(|s| **s == StatusCode::OK).count();
    let limited = statuses
        .iter()
        .filter(|s| **s == StatusCode::TOO_MANY_REQUESTS)
        .count();
    assert_eq!((ok, limited), (2, 3), "{statuses:?}");
}

/// In delay mode, a request whose turn is past the longest wait is turned away at once: a
/// turn only moves later while the request sleeps, so sleeping cannot make it fit. Its 429
/// says when a request would fit, and its `RateLimit-Policy` counts what its `RateLimit`
/// counts (the burst and the turns the longest wait reserves).
#[tokio::test]
async fn a_turn_past_the_longest_wait_is_refused_at_once() {
    // One a second, burst 1, waits of up to 2.5 s: three requests at once (now, in 1 s and in
    // 2 s); a fourth's turn is 3 s away.
    let layer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(one_turn_a_second())
        .delay(Duration::from_millis(2_500))
        .build()
        .expect("layer");
    let app = Router::new().route("/", get(ok)).layer(layer);
    let get = || {
        http::Request::get("/")
            .body(axum::body::Body::empty())
            .expect("request")
    };
    let waiting: Vec<_> = (0..3)
        .map(|_| tokio::spawn(tower::ServiceExt::oneshot(app.clone(), get())))
        .collect();
    // The three have their turns before the fourth asks.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let asked = Instant::now();
    let fourth = tower::ServiceExt::oneshot(app.clone(), get())
        .await
        .expect("infallible");
    let took = asked.elapsed();
    assert_eq!(fourth.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(took < Duration::from_millis(400), "refused after {took:?}");
    let header = |name: &str| {
        fourth
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    // Its turn (2.9 s away) fits in 2.5 s in 0.4 s: a retry in 1 s, rounded up.
    assert_eq!(header("retry-after"), "1");
    assert_eq!(header("ratelimit-policy"), "\"turns\";q=3;w=1");
    assert!(
        header("ratelimit").starts_with("\"turns\";r=0;"),
        "{}",
        header("ratelimit")
    );
    for w in waiting {
        let response = w.await.expect("task").expect("infallible");
        assert_eq!(response.status(), StatusCode::OK);
    }
}

#[tokio::test]
async fn a_request_dropped_while_it_waits_its_turn_gives_its_concurrency_lease_back() {
    // Delay mode over a shaper (one a second on /shaped) and a concurrency limit of one on
    // every path: a request that waits its turn holds the concurrency slot meanwhile.
    let layer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(
            Rule::new(policy_named(
                Policy::shaper(1, Duration::from_secs(1)),
                "turns",
            ))
            .path_prefix("/shaped")
            .key(GlobalKey),
        )
        .rule(one_in_flight("one-at-a-time"))
        .delay(Duration::from_secs(5))
        .build()
        .expect("layer");
    let app = Router::new()
        .route("/shaped", get(ok))
        .route("/", get(ok))
        .layer(layer);
    let get = |path: &str| {
        http::Request::get(path)
            .body(axum::body::Body::empty())
            .expect("request")
    };
    let first = tower::ServiceExt::oneshot(app.clone(), get("/shaped"))
        .await
        .expect("infallible");
    assert_eq!(first.status(), StatusCode::OK);
    drop(first);
    // The next turn is a second away: the client gives up after 100 ms.
    let waiting = tokio::time::timeout(
        Duration::from_millis(100),
        tower::ServiceExt::oneshot(app.clone(), get("/shaped")),
    )
    .await;
    assert!(waiting.is_err(), "it should still be waiting for its turn");
    // Its concurrency slot came back with it.
    let other = tower::ServiceExt::oneshot(app, get("/"))
        .await
        .expect("infallible");
    assert_eq!(other.status(), StatusCode::OK);
}

/// A request dropped while it waits its turn takes nothing: its turn goes back to the shaper
/// and the units it took of another rate policy (2 a day) come back, so the next request is
/// not pushed back by the one that left, nor is the daily quota spent on it.
#[tokio::test]
async fn a_request_dropped_while_it_waits_its_turn_gives_its_turn_and_units_back() {
    let layer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(one_turn_a_second())
        .rule(Rule::new(policy(2, 86_400, "two-a-day")).key(GlobalKey))
        .delay(Duration::from_secs(5))
        .build()
        .expect("layer");
    let app = Router::new().route("/", get(ok)).layer(layer);
    let get = || {
        http::Request::get("/")
            .body(axum::body::Body::empty())
            .expect("request")
    };
    let first = tower::ServiceExt::oneshot(app.clone(), get())
        .await
        .expect("infallible");
    assert_eq!(first.status(), StatusCode::OK);
    // The next turn is a second away: the client gives up after 100 ms.
    let waiting = tokio::time::timeout(
        Duration::from_millis(100),
        tower::ServiceExt::oneshot(app.clone(), get()),
    )
    .await;
    assert!(waiting.is_err(), "it should still be waiting for its turn");
    // The second of the day, in the turn the dropped request had: about a second after the
    // first, not two.
    let started = Instant::now();
    let second = tower::ServiceExt::oneshot(app.clone(), get())
        .await
        .expect("infallible");
    assert_eq!(
        second.status(),
        StatusCode::OK,
        "the day's second unit came back"
    );
    let waited = started.elapsed();
    assert!(waited < Duration::from_millis(1_800), "waited {waited:?}");
    // And the day's units are spent now.
    let third = tower::ServiceExt::oneshot(app, get())
        .await
        .expect("infallible");
    assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
}

/// A shaper of one turn a second for every request, named "turns".
fn one_turn_a_second() -> Rule {
    Rule::new(policy_named(
        Policy::shaper(1, Duration::from_secs(1)),
        "turns",
    ))
    .key(GlobalKey)
}

fn policy_named(p: Result<Policy, floodgate_core::PolicyError>, name: &str) -> Policy {
    p.and_then(|p| p.named(name)).expect("policy")
}

/// One request at a time, with headers on allowed responses too.
fn one_at_a_time() -> RateLimitLayer {
    RateLimitLayer::builder(MemoryLimiter::new())
        .rule(one_in_flight("one-at-a-time"))
        .headers_on_allowed(true)
        .build()
        .expect("layer")
}

#[tokio::test]
async fn a_concurrency_lease_lasts_until_the_body_ends() {
    let layer = one_at_a_time();
    assert_lease_lasts_until_the_body_ends(common::held_stream_app(|app| app.layer(layer))).await;
}

#[tokio::test]
async fn a_concurrency_lease_lasts_until_the_end_of_axum_s_own_body() {
    // The body is passed through as it is, except when a lease must ride with it.
    let layer = one_at_a_time().native_body();
    assert_lease_lasts_until_the_body_ends(common::held_stream_app(|app| app.layer(layer))).await;
}

/// The first `/stream` of `app` holds the only lease until its body ends or is dropped.
async fn assert_lease_lasts_until_the_body_ends(
    (app, senders): (Router, Arc<Mutex<Vec<tokio::sync::oneshot::Sender<()>>>>),
) {
    let addr = serve(app).await;

    let (mut first, head) = common::open_stream(addr).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("first chunk"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("ratelimit: \"one-at-a-time\";r=0"),
        "{head}"
    );
    assert!(
        head.to_ascii_lowercase()
            .contains("ratelimit-policy: \"one-at-a-time\";q=1;qu=\"concurrent-requests\""),
        "{head}"
    );

    // The body is still streaming: the lease is held.
    let (_second, head) = common::open_stream(addr).await;
    assert!(head.starts_with("HTTP/1.1 429"), "{head}");

    // End the first body and read it to the end: the lease is back.
    common::end_first(&senders);
    let rest = common::read_to_end(&mut first).await;
    assert!(
        rest.ends_with(b"0\r\n\r\n"),
        "{:?}",
        String::from_utf8_lossy(&rest)
    );
    let third = common::wait_admitted(addr).await;

    // Dropping the connection mid-body drops the body: the lease is released too.
    drop(third);
    let _fourth = common::wait_admitted(addr).await;
}

/// A store that never answers, and one that always fails.
#[derive(Clone)]
struct BrokenStore {
    hang: bool,
}

impl Limiter for BrokenStore {
    type Error = MemoryError;

    async fn check(&self, _: &[Check<'_>], _: CheckOptions) -> Result<Verdict, MemoryError> {
        if self.hang {
            std::future::pending::<()>().await;
        }
        Err(MemoryError::InvalidCheck("the store is broken".into()))
    }

    async fn release(&self, _: &[Check<'_>], _: LeaseId) -> Result<(), MemoryError> {
        Ok(())
    }

    async fn renew(&self, _: &[Check<'_>], _: LeaseId) -> Result<bool, MemoryError> {
        Err(MemoryError::InvalidCheck("the store is broken".into()))
    }

    async fn refund(&self, _: &[Check<'_>], _: &Verdict) -> Result<(), MemoryError> {
        Err(MemoryError::InvalidCheck("the store is broken".into()))
    }

    async fn reset(&self, _: &[u8], _: &Policy) -> Result<(), MemoryError> {
        Ok(())
    }
}

/// The layer's probe of a failing store is answered by the store: a denial the deny cache
/// holds (an attacker's key, say) does not tell the layer the store is back, which would send
/// every request to the down store until it failed again.
#[tokio::test]
async fn a_cached_denial_does_not_pass_for_the_store_answering_again() {
    use std::sync::atomic::Ordering::SeqCst;
    let store = RemoteStore::new(Answer::AtOnce);
    let layer = RateLimitLayer::builder(store.clone())
        .rule(Rule::new(policy(1, 600, "per-user")).key(HeaderKey::named("x-user").expect("name")))
        .on_store_error(OnStoreError::FailOpen)
        .store_retry_interval(Duration::from_secs(1))
        .build()
        .expect("layer");
    let client = HttpClient::new(serve(Router::new().route("/", get(ok)).layer(layer)).await);
    let user = |name: &'static [u8]| [("x-user", name)];
    assert_eq!(
        client.get_with("/", &user(b"attacker")).await.status,
        StatusCode::OK
    );
    // Denied by the store, and cached.
    let denied = client.get_with("/", &user(b"attacker")).await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);

    store.down.store(true, SeqCst);
    // Another key reaches the store, which fails: the layer stops asking it for a while.
    assert_eq!(
        client.get_with("/", &user(b"first")).await.status,
        StatusCode::OK
    );
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    // The probe, on the key whose denial is cached: the store is asked, and still fails; the
    // cached denial stands (failing open would let the attacker through).
    let before = store.checks.load(SeqCst);
    let probe = client.get_with("/", &user(b"attacker")).await;
    assert_eq!(
        probe.status,
        StatusCode::TOO_MANY_REQUESTS,
        "the cached denial"
    );
    assert_eq!(
        store.checks.load(SeqCst),
        before + 1,
        "the probe asked the store"
    );
    // So the layer still skips it.
    let before = store.checks.load(SeqCst);
    for name in [&b"a"[..], b"b", b"c", b"d", b"e"] {
        let res = client.get_with("/", &[("x-user", name)]).await;
        assert_eq!(res.status, StatusCode::OK);
    }
    assert_eq!(
        store.checks.load(SeqCst),
        before,
        "the down store was asked again"
    );
}

#[tokio::test]
async fn store_failures_follow_the_failure_policy() {
    for hang in [true, false] {
        let app = |on_error: OnStoreError| {
            let layer = RateLimitLayer::builder(BrokenStore { hang })
                .rule(Rule::new(policy(2, 60, "per-ip")))
                .on_store_error(on_error)
                .timeout(Duration::from_millis(50))
                .headers_on_allowed(true)
                .build()
                .expect("layer");
            Router::new()
                .route(
                    "/",
                    get(|info: Option<RateLimitInfo>| async move {
                        format!("{:?}", info.map(|i| i.source()))
                    }),
                )
                .layer(layer)
        };

        let client = HttpClient::new(serve(app(OnStoreError::FailOpen)).await);
        for _ in 0..4 {
            let res = client.get("/").await;
            assert_eq!(res.status, StatusCode::OK);
            assert_eq!(res.body, "Some(FailOpen)");
            assert!(res.headers.get("ratelimit").is_none());
        }

        let client = HttpClient::new(serve(app(OnStoreError::FailClosed)).await);
        let res = client.get("/").await;
        assert_eq!(res.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(res.header("content-type"), Some("application/problem+json"));
        assert_eq!(res.json()["status"], 503);
        assert!(res.header("retry-after").is_some());

        let client = HttpClient::new(serve(app(OnStoreError::local_fallback())).await);
        for _ in 0..2 {
            let res = client.get("/").await;
            assert_eq!(res.status, StatusCode::OK);
            assert_eq!(res.body, "Some(Fallback)");
            assert!(res.headers.get("ratelimit").is_some());
        }
        assert_eq!(client.get("/").await.status, StatusCode::TOO_MANY_REQUESTS);
    }
}

#[tokio::test]
async fn async_key_extractors() {
    let layer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(
            Rule::new(policy(1, 60, "account")).key_async(|req: &RequestView<'_>| {
                let token = req.header("authorization").map(|v| v.as_bytes().to_vec());
                async move {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    token.map(|t| Key::from(format!("account-{}", t.len())))
                }
            }),
        )
        .build()
        .expect("layer");
    let client = HttpClient::new(serve(Router::new().route("/", get(ok)).layer(layer)).await);
    assert_eq!(
        client
            .get_with("/", &[("authorization", b"abc")])
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(
        client
            .get_with("/", &[("authorization", b"xyz")])
            .await
            .status,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        client
            .get_with("/", &[("authorization", b"abcd")])
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(client.get("/").await.status, StatusCode::BAD_REQUEST);
}

/// An app whose `/fail` answers 500 and `/` answers 200, behind 2 per minute per peer IP.
fn failing_app(refund: bool) -> Router {
    async fn fail() -> StatusCode {
        StatusCode::INTERNAL_SERVER_ERROR
    }
    let builder = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(Rule::new(policy(2, 60, "per-ip")).key(PeerIp::new()));
    let builder = if refund {
        builder.refund_when(|status, _| status.is_server_error())
    } else {
        builder
    };
    Router::new()
        .route("/", get(ok))
        .route("/fail", get(fail))
        .layer(builder.build().expect("layer"))
}

/// `refund_when`: requests that fail on the server's side do not count against the client;
/// the others still do, and without it failures count like anything else.
#[tokio::test]
async fn responses_matching_refund_when_do_not_count() {
    let client = HttpClient::new(serve(failing_app(true)).await);
    for _ in 0..5 {
        assert_eq!(client.get("/fail").await.status, 500);
    }
    assert_eq!(client.get("/").await.status, 200);
    assert_eq!(client.get("/").await.status, 200);
    assert_eq!(client.get("/").await.status, 429);

    let client = HttpClient::new(serve(failing_app(false)).await);
    assert_eq!(client.get("/fail").await.status, 500);
    assert_eq!(client.get("/fail").await.status, 500);
    assert_eq!(client.get("/fail").await.status, 429);
}

/// A server with one slot (a concurrency lease of 300 ms, renewed for up to `renew_for`), and
/// the stream that took it.
async fn one_renewed_stream(
    renew_for: Duration,
) -> (std::net::SocketAddr, common::Senders, tokio::net::TcpStream) {
    let layer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(common::global(
            Policy::concurrency(1, Duration::from_millis(300)),
            "one-stream",
        ))
        .renew_leases_up_to(renew_for)
        .build()
        .expect("layer");
    let (app, senders) = common::held_stream_app(|app| app.layer(layer));
    let addr = serve(app).await;
    let (first, head) = common::open_stream(addr).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    (addr, senders, first)
}

/// A body that outlasts its lease's TTL keeps the lease: the layer renews it while the body
/// lives, and gives it back when the body ends.
#[tokio::test]
async fn a_stream_longer_than_its_lease_ttl_keeps_its_slot() {
    let (addr, senders, first) = one_renewed_stream(Duration::from_secs(60)).await;
    // Three TTLs later, the stream still holds the only slot.
    common::assert_stream_keeps_its_slot(addr, &senders, first, Duration::from_millis(900)).await;
}

/// A store slow to answer leaves a lease little of its TTL (counted from when the check was
/// sent): its first renewal must come at once, not a third of the TTL after the answer, when
/// the lease would already count as lost and never be renewed.
#[tokio::test]
async fn a_lease_granted_late_in_its_ttl_is_renewed_at_once() {
    // The store answers 650 ms into a 900 ms TTL: a first renewal a third of the TTL later
    // (950 ms) would come after the lease counts as lost.
    let store = RemoteStore::new(Answer::After(Duration::from_millis(650)));
    let layer = RateLimitLayer::builder(store)
        .rule(common::global(
            Policy::concurrency(1, Duration::from_millis(900)),
            "slow-store-stream",
        ))
        .timeout(Duration::from_secs(2))
        .renew_leases_up_to(Duration::from_secs(60))
        .build()
        .expect("layer");
    let (app, _senders) = common::held_stream_app(|app| app.layer(layer));
    let addr = serve(app).await;
    let (_first, head) = common::open_stream(addr).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    // Long past the first lease's TTL (the store's expiry at about 1,550 ms after the check):
    // the stream still holds the only slot.
    tokio::time::sleep(Duration::from_millis(1_700)).await;
    let (_second, head) = common::open_stream(addr).await;
    assert!(
        head.starts_with("HTTP/1.1 429"),
        "the lease was not renewed: {head}"
    );
}

/// Renewal has a bound: a response that holds its lease longer than `renew_leases_up_to` (a
/// hung handler, a client that stopped reading) loses it one TTL after the last renewal.
#[tokio::test]
async fn a_lease_is_renewed_for_at_most_its_bound() {
    let (addr, _senders, _first) = one_renewed_stream(Duration::from_millis(400)).await;
    // Renewed at 100, 200, 300 and 400 ms: held until 700 ms, not after (until 600 ms if the
    // 400 ms renewal came late and was skipped). At 450 ms, past the 300 ms TTL, it is held
    // only thanks to a renewal.
    tokio::time::sleep(Duration::from_millis(450)).await;
    let (_second, head) = common::open_stream(addr).await;
    assert!(
        head.starts_with("HTTP/1.1 429"),
        "renewed too little: {head}"
    );
    tokio::time::sleep(Duration::from_millis(650)).await;
    let (_third, head) = common::open_stream(addr).await;
    assert!(
        head.starts_with("HTTP/1.1 200"),
        "renewed past its bound: {head}"
    );
}

/// One in flight, as `name`.
fn one_in_flight(name: &str) -> Rule {
    common::global(Policy::concurrency(1, Duration::from_secs(60)), name)
}

/// An app whose `/ws` switches protocols: the upgraded connection is served until the client
/// hangs up, holding the request's [`HeldLease`] when `keep` (else the handler drops it).
/// `/plain` says whether a request that asks for no upgrade got a `HeldLease`.
fn upgrade_app(keep: bool) -> Router {
    use tokio::io::AsyncReadExt;
    Router::new()
        .route(
            "/ws",
            get(
                move |lease: Option<HeldLease>, mut req: axum::extract::Request| async move {
                    let lease = lease.filter(|_| keep);
                    let on_upgrade = hyper::upgrade::on(&mut req);
                    tokio::spawn(async move {
                        let _lease = lease;
                        if let Ok(upgraded) = on_upgrade.await {
                            let mut io = hyper_util::rt::TokioIo::new(upgraded);
                            let mut buf = [0u8; 64];
                            while matches!(io.read(&mut buf).await, Ok(n) if n > 0) {}
                        }
                    });
                    Response::builder()
                        .status(StatusCode::SWITCHING_PROTOCOLS)
                        .header("connection", "upgrade")
                        .header("upgrade", "echo")
                        .body(axum::body::Body::empty())
                        .expect("response")
                },
            ),
        )
        .route(
            "/plain",
            get(|lease: Option<HeldLease>| async move {
                if lease.is_some() { "held" } else { "none" }
            }),
        )
}

/// The request that asks `/ws` to switch protocols.
const UPGRADE: &[u8] =
    b"GET /ws HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: echo\r\n\r\n";

/// Asks `/ws` to switch protocols over raw HTTP/1.1; returns the connection and the head.
async fn open_upgrade(addr: std::net::SocketAddr) -> (tokio::net::TcpStream, String) {
    common::send_raw(addr, UPGRADE).await
}

/// Opens upgrades until one is switched, or panics after a few seconds.
async fn wait_switched(addr: std::net::SocketAddr, why: &str) -> tokio::net::TcpStream {
    common::wait_for_head(addr, UPGRADE, "HTTP/1.1 101", why).await
}

/// With one slot, an upgraded connection that keeps its lease holds the slot: long after the
/// handshake's (empty) body ended, a second one is turned away; the slot is back when the
/// first closes.
async fn assert_one_socket_at_a_time(addr: std::net::SocketAddr, case: &str) {
    let (first, head) = open_upgrade(addr).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{case}: {head}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (_second, head) = open_upgrade(addr).await;
    assert!(
        head.starts_with("HTTP/1.1 429"),
        "{case}: the lease ended with the handshake: {head}"
    );
    drop(first);
    let _third = wait_switched(addr, &format!("{case}: the lease outlived its connection")).await;
}

/// A handler that keeps the request's `HeldLease` in the upgraded connection's task holds the
/// slot for the connection's life, not just the handshake; whether the layer decides at once
/// (in memory) or awaits its store.
#[tokio::test]
async fn an_upgraded_connection_that_keeps_its_lease_holds_the_slot() {
    let layer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(one_in_flight("one-socket"))
        .build()
        .expect("layer");
    assert_one_socket_at_a_time(serve(upgrade_app(true).layer(layer)).await, "memory").await;
    let awaited = RemoteStore::new(Answer::AfterWake);
    let layer = RateLimitLayer::builder(awaited)
        .rule(one_in_flight("one-socket"))
        .build()
        .expect("layer");
    assert_one_socket_at_a_time(serve(upgrade_app(true).layer(layer)).await, "awaited").await;
}

/// Behind two layers, the inner layer's `HeldLease` holds the outer layer's lease too: the
/// outer policy (one socket in all) still counts open connections.
#[tokio::test]
async fn a_held_lease_holds_the_leases_of_outer_layers_too() {
    let outer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(one_in_flight("one-socket-in-all"))
        .build()
        .expect("layer");
    let inner = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(common::global(
            Policy::concurrency(5, Duration::from_secs(60)),
            "five-sockets",
        ))
        .build()
        .expect("layer");
    let app = upgrade_app(true).route_layer(inner).layer(outer);
    assert_one_socket_at_a_time(serve(app).await, "stacked").await;
}

/// Without the `HeldLease` kept, an upgrade's lease ends with the handshake, as any response's
/// does with its body; a plain request gets no `HeldLease`.
#[tokio::test]
async fn an_upgrade_that_drops_its_lease_frees_the_slot_after_the_handshake() {
    let layer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(one_in_flight("one-socket"))
        .build()
        .expect("layer");
    let addr = serve(upgrade_app(false).layer(layer)).await;
    let (first, head) = open_upgrade(addr).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    let second = wait_switched(addr, "the dropped lease was still held").await;
    drop((first, second));
    let client = HttpClient::new(addr);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let res = client.get("/plain").await;
        if res.status == StatusCode::OK {
            assert_eq!(res.body, "none");
            break;
        }
        assert!(Instant::now() < deadline, "{:?}", res.status);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A layer with one concurrency rule: one slot, a lease of `ttl`, renewed for up to
/// `renew_for` when given.
fn one_slot(ttl: Duration, renew_for: Option<Duration>, name: &str) -> RateLimitLayer {
    let builder = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(common::global(Policy::concurrency(1, ttl), name));
    match renew_for {
        Some(bound) => builder.renew_leases_up_to(bound),
        None => builder,
    }
    .build()
    .expect("layer")
}

/// Awaits `lease.lost()` (for at most 5 s); how long it took since `began`.
async fn time_to_loss(lease: &HeldLease, began: Instant) -> Duration {
    tokio::time::timeout(Duration::from_secs(5), lease.lost())
        .await
        .expect("the lease was never lost");
    assert!(lease.is_lost());
    began.elapsed()
}

/// After `lost()`, the store gives the slot to another upgrade at once (within the time a
/// renewal takes to reach it): `lost()` was not early.
async fn assert_slot_free_soon(app: Router) {
    let deadline = Instant::now() + Duration::from_millis(200);
    while common::ask_upgrade(app.clone()).await != StatusCode::SWITCHING_PROTOCOLS {
        assert!(
            Instant::now() < deadline,
            "the store still held a lease `lost` gave up"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Unrenewed, a held lease is lost at its TTL: `lost()` waits that long, not less, and then
/// the slot is free again.
#[tokio::test]
async fn a_held_lease_is_lost_at_its_ttl() {
    let (app, slot) = common::lease_keeping_app();
    let app = app.layer(one_slot(Duration::from_millis(400), None, "ttl"));
    let began = Instant::now();
    let lease = common::take_held_lease(app.clone(), &slot).await;
    assert!(!lease.is_lost());
    // Still held: a second upgrade is turned away.
    assert_eq!(
        common::ask_upgrade(app.clone()).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    let took = time_to_loss(&lease, began).await;
    assert!(took >= Duration::from_millis(400), "lost early: {took:?}");
    assert_slot_free_soon(app).await;
}

/// Renewed, a held lease is not lost while its renewals go on (well past its TTL), and is lost
/// one TTL after the last, when the renewal bound stops them.
#[tokio::test]
async fn a_renewed_held_lease_is_lost_a_ttl_after_its_last_renewal() {
    let (app, slot) = common::lease_keeping_app();
    let layer = one_slot(
        Duration::from_millis(300),
        Some(Duration::from_millis(600)),
        "renewed",
    );
    let app = app.layer(layer);
    let began = Instant::now();
    let lease = common::take_held_lease(app.clone(), &slot).await;
    // Renewed every 100 ms up to 600 ms: held until about 900 ms.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!lease.is_lost(), "lost while renewed");
    assert!(
        tokio::time::timeout(Duration::ZERO, lease.lost())
            .await
            .is_err(),
        "lost() resolved while renewed"
    );
    // The last renewal at 500 ms or later (600 ms unless a tick came late): lost from 800 ms.
    let took = time_to_loss(&lease, began).await;
    assert!(
        took >= Duration::from_millis(700),
        "lost before its last renewal's TTL: {took:?}"
    );
    assert_slot_free_soon(app).await;
}

/// Behind stacked layers, a held lease is lost when the first of its leases is: here the outer
/// layer's, whose TTL is the shorter.
#[tokio::test]
async fn a_held_lease_is_lost_with_an_outer_layers_lease() {
    let (app, slot) = common::lease_keeping_app();
    let inner = one_slot(Duration::from_secs(60), None, "inner");
    let outer = one_slot(Duration::from_millis(300), None, "outer");
    let began = Instant::now();
    let lease = common::take_held_lease(app.route_layer(inner).layer(outer), &slot).await;
    assert!(!lease.is_lost());
    let took = time_to_loss(&lease, began).await;
    assert!(took >= Duration::from_millis(300), "lost early: {took:?}");
}

/// In delay mode, a lease taken with a shaper's turn is renewed from its grant, through the
/// wait for the turn: a wait longer than its TTL does not leave it lost on arrival.
#[tokio::test]
async fn a_held_lease_that_waited_its_turn_is_renewed_through_the_wait() {
    let (app, slot) = common::lease_keeping_app();
    let layer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(common::global(
            Policy::shaper(1, Duration::from_millis(1200)),
            "turns",
        ))
        // Renewed every 200 ms: a stall of the machine under 400 ms does not lose it.
        .rule(common::global(
            Policy::concurrency(5, Duration::from_millis(600)),
            "five",
        ))
        .renew_leases_up_to(Duration::from_secs(60))
        .delay(Duration::from_secs(3))
        .build()
        .expect("layer");
    let app = app.layer(layer);
    let _first = common::take_held_lease(app.clone(), &slot).await;
    let began = Instant::now();
    let second = common::take_held_lease(app, &slot).await;
    assert!(
        began.elapsed() >= Duration::from_millis(800),
        "the second upgrade did not wait its turn"
    );
    assert!(!second.is_lost(), "lost on arrival");
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(!second.is_lost(), "lost while renewed");
}
