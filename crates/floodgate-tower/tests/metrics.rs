//! Decisions are counted through the `metrics` facade, and traced in `floodgate.check` spans.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use floodgate_core::{DenyCacheStats, MemoryLimiter, Policy};
use floodgate_redis::{RedisConfig, RedisLimiter};
use floodgate_testkit::RedisServer;
use floodgate_tower::key::{GlobalKey, HeaderKey};
use floodgate_tower::{OnStoreError, RateLimitLayer, Rule};
use http::{Request, Response, StatusCode};
use metrics::{
    Counter, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};
use tower::{Layer, Service, ServiceExt};

#[derive(Default)]
struct Recorded {
    counters: Mutex<HashMap<String, Arc<AtomicU64>>>,
    gauges: Mutex<HashMap<String, Arc<AtomicU64>>>,
    histograms: Mutex<HashMap<String, Arc<Samples>>>,
}

#[derive(Default)]
struct Samples(Mutex<Vec<f64>>);

impl HistogramFn for Samples {
    fn record(&self, value: f64) {
        self.0.lock().expect("lock").push(value);
    }
}

fn name(key: &Key) -> String {
    let mut labels: Vec<String> = key
        .labels()
        .map(|l| format!("{}={}", l.key(), l.value()))
        .collect();
    labels.sort();
    format!("{}{{{}}}", key.name(), labels.join(","))
}

impl Recorder for Recorded {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let c = self
            .counters
            .lock()
            .expect("lock")
            .entry(name(key))
            .or_default()
            .clone();
        Counter::from_arc(c)
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        // The f64's bits, as `metrics` keeps gauges in an `AtomicU64`.
        let g = self
            .gauges
            .lock()
            .expect("lock")
            .entry(name(key))
            .or_default()
            .clone();
        Gauge::from_arc(g)
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        let h = self
            .histograms
            .lock()
            .expect("lock")
            .entry(name(key))
            .or_default()
            .clone();
        Histogram::from_arc(h)
    }
}

impl Recorded {
    fn gauge(&self, name: &str) -> f64 {
        self.gauges
            .lock()
            .expect("lock")
            .get(name)
            .map_or(0.0, |g| f64::from_bits(g.load(Ordering::Relaxed)))
    }

    fn counter(&self, name: &str) -> u64 {
        self.counters
            .lock()
            .expect("lock")
            .get(name)
            .map_or(0, |c| c.load(Ordering::Relaxed))
    }
}

#[tokio::test]
async fn decisions_are_counted() {
    let recorder = Recorded::default();
    let layer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(
            Rule::new(
                Policy::fixed_window(2, Duration::from_secs(60))
                    .expect("policy")
                    .named("counted")
                    .expect("name"),
            )
            .key(GlobalKey),
        )
        .build()
        .expect("layer");
    let mut svc = layer.layer(tower::service_fn(|_: Request<()>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    }));
    let mut statuses = Vec::new();
    for _ in 0..3 {
        svc.ready().await.expect("ready");
        // The in-memory limiter decides inside `call`: the local recorder sees it.
        let fut = metrics::with_local_recorder(&recorder, || svc.call(Request::new(())));
        statuses.push(fut.await.expect("response").status());
    }
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
    assert_eq!(requests(&recorder, "allowed", "store", "counted"), 2);
    assert_eq!(requests(&recorder, "denied", "store", "counted"), 1);
    // Every pair is registered, at zero.
    for (outcome, source) in [
        ("allowed", "fallback"),
        ("denied", "fallback"),
        ("error", "none"),
        ("missing_key", "none"),
    ] {
        assert_eq!(
            registered(&recorder, outcome, source, "counted"),
            Some(0),
            "{outcome}, {source}"
        );
    }
    let histograms = recorder.histograms.lock().expect("lock");
    let samples = histograms
        .get("floodgate_check_duration_seconds{}")
        .expect("histogram");
    let samples = samples.0.lock().expect("lock");
    assert_eq!(samples.len(), 3);
    // Seconds, not the timer's raw ticks: an in-memory check takes well under a second.
    assert!(
        samples.iter().all(|s| (0.0..1.0).contains(s)),
        "{samples:?}"
    );
}

/// `floodgate_requests_total` of `outcome`, `source` and `policy`.
fn requests(recorder: &Recorded, outcome: &str, source: &str, policy: &str) -> u64 {
    registered(recorder, outcome, source, policy).unwrap_or(0)
}

/// `floodgate_requests_total` of `outcome`, `source` and `policy`, if it was registered.
fn registered(recorder: &Recorded, outcome: &str, source: &str, policy: &str) -> Option<u64> {
    let name =
        format!("floodgate_requests_total{{outcome={outcome},policy={policy},source={source}}}");
    recorder
        .counters
        .lock()
        .expect("lock")
        .get(&name)
        .map(|c| c.load(Ordering::Relaxed))
}

/// Calls `svc` and awaits its answer with `recorder` as the metrics recorder and `spans` as the
/// tracing subscriber throughout: a request without a key is counted inside `call`, a
/// Redis-backed layer's decision when its future is polled.
async fn traced<S, R>(
    recorder: &Recorded,
    spans: &tracing::Dispatch,
    svc: &mut S,
    req: R,
) -> Result<S::Response, S::Error>
where
    S: Service<R>,
{
    let within = |f: &mut dyn FnMut()| {
        tracing::dispatcher::with_default(spans, || metrics::with_local_recorder(recorder, f))
    };
    let (mut req, mut fut) = (Some(req), None);
    within(&mut || fut = req.take().map(|req| svc.call(req)));
    let mut fut = std::pin::pin!(fut.expect("called"));
    std::future::poll_fn(|cx| {
        let mut polled = std::task::Poll::Pending;
        within(&mut || polled = fut.as_mut().poll(cx));
        polled
    })
    .await
}

/// A tracing subscriber that keeps the fields of every span, as text, by span.
#[derive(Default)]
struct Spans(Mutex<Vec<(&'static str, HashMap<&'static str, String>)>>);

impl Spans {
    /// The `outcome` and `source` of each span named `name`, in order.
    fn outcomes(&self, name: &str) -> Vec<(String, String)> {
        let field = |f: &HashMap<_, String>, k| f.get(k).cloned().unwrap_or_default();
        let spans = self.0.lock().expect("lock");
        spans
            .iter()
            .filter(|(n, _)| *n == name)
            .map(|(_, f)| (field(f, "outcome"), field(f, "source")))
            .collect()
    }
}

struct Fields<'a>(&'a mut HashMap<&'static str, String>);

impl tracing::field::Visit for Fields<'_> {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.insert(field.name(), value.to_owned());
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name(), format!("{value:?}"));
    }
}

impl tracing::Subscriber for Spans {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }

    fn new_span(&self, span: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        let mut fields = HashMap::new();
        span.record(&mut Fields(&mut fields));
        let mut spans = self.0.lock().expect("lock");
        spans.push((span.metadata().name(), fields));
        tracing::span::Id::from_u64(spans.len() as u64)
    }

    fn record(&self, span: &tracing::span::Id, values: &tracing::span::Record<'_>) {
        let mut spans = self.0.lock().expect("lock");
        if let Some((_, fields)) = usize::try_from(span.into_u64() - 1)
            .ok()
            .and_then(|i| spans.get_mut(i))
        {
            values.record(&mut Fields(fields));
        }
    }

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

    fn event(&self, _: &tracing::Event<'_>) {}

    fn enter(&self, _: &tracing::span::Id) {}

    fn exit(&self, _: &tracing::span::Id) {}
}

/// A fallback decision is counted as allowed or denied with `source=fallback`, a missing key
/// as `missing_key`, and no decision at all (failing open) as `error`: each outcome can be
/// told from the others, in the metric and in the `floodgate.check` span.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fallback_missing_key_and_errors_are_counted_apart() {
    let redis = RedisServer::start().expect("redis-server (run scripts/install-redis)");
    let phone = HeaderKey::named("x-phone").expect("header");
    let build = |on_error: OnStoreError, name: &str| {
        let policy = Policy::per_minute(2)
            .and_then(|p| p.named(name))
            .expect("policy");
        let redis = &redis;
        let phone = phone.clone();
        async move {
            let config = RedisConfig::new(&redis.url())
                .expect("url")
                .timeout(Duration::from_millis(250))
                .connect_timeout(Duration::from_millis(250));
            RateLimitLayer::builder(RedisLimiter::connect(&config).await.expect("connect"))
                .rule(Rule::new(policy).key(phone))
                .on_store_error(on_error)
                .timeout(Duration::from_millis(300))
                .store_retry_interval(Duration::from_secs(60))
                .build()
                .expect("layer")
        }
    };
    let fallback = build(OnStoreError::local_fallback(), "fallback").await;
    let open = build(OnStoreError::FailOpen, "open").await;
    tokio::task::block_in_place(|| redis.kill()).expect("kill");

    let recorder = Recorded::default();
    let spans = Arc::new(Spans::default());
    let dispatch = tracing::Dispatch::from(Arc::clone(&spans));
    let (ok, over, bad) = (
        StatusCode::OK,
        StatusCode::TOO_MANY_REQUESTS,
        StatusCode::BAD_REQUEST,
    );
    for (layer, expected) in [
        (fallback, vec![bad, ok, ok, over]),
        (open, vec![bad, ok, ok]),
    ] {
        let mut svc = layer.layer(tower::service_fn(|_: Request<()>| async {
            Ok::<_, Infallible>(Response::new(String::new()))
        }));
        let mut statuses = Vec::new();
        for i in 0..expected.len() {
            // The first request has no phone: counted before any other registered the
            // policy's counters.
            let mut req = Request::new(());
            if i > 0 {
                req.headers_mut()
                    .insert("x-phone", http::HeaderValue::from_static("+15551234"));
            }
            svc.ready().await.expect("ready");
            let res = traced(&recorder, &dispatch, &mut svc, req).await;
            statuses.push(res.expect("response").status());
        }
        assert_eq!(statuses, expected);
    }
    // The spans say the same (a request without a key has none: it is turned away first).
    let pair = |o: &str, s: &str| (o.to_owned(), s.to_owned());
    assert_eq!(
        spans.outcomes("floodgate.check"),
        [
            pair("allowed", "fallback"),
            pair("allowed", "fallback"),
            pair("denied", "fallback"),
            pair("error", "none"),
            pair("error", "none"),
        ]
    );
    assert_eq!(requests(&recorder, "allowed", "fallback", "fallback"), 2);
    assert_eq!(requests(&recorder, "denied", "fallback", "fallback"), 1);
    assert_eq!(requests(&recorder, "missing_key", "none", "fallback"), 1);
    assert_eq!(requests(&recorder, "error", "none", "open"), 2);
    assert_eq!(requests(&recorder, "missing_key", "none", "open"), 1);
    for (outcome, source, policy) in [
        ("allowed", "store", "fallback"),
        ("denied", "store", "fallback"),
        ("denied", "store", "open"),
        ("allowed", "fallback", "open"),
    ] {
        assert_eq!(
            requests(&recorder, outcome, source, policy),
            0,
            "{outcome}, {source}, {policy}"
        );
    }
}

/// The held-leases gauge follows concurrency leases: up when a response takes one, down when
/// its body is gone.
#[tokio::test]
async fn held_leases_are_a_gauge() {
    let recorder = Recorded::default();
    let layer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(
            Rule::new(
                Policy::concurrency(2, Duration::from_secs(60))
                    .expect("policy")
                    .named("sockets")
                    .expect("name"),
            )
            .key(GlobalKey),
        )
        .build()
        .expect("layer");
    let mut svc = layer.layer(tower::service_fn(|_: Request<()>| async {
        Ok::<_, Infallible>(Response::new(String::from("streamed")))
    }));
    let held = || recorder.gauge("floodgate_leases_held{policy=sockets}");
    let mut responses = Vec::new();
    for n in 1..=3 {
        svc.ready().await.expect("ready");
        let fut = metrics::with_local_recorder(&recorder, || svc.call(Request::new(())));
        let response = fut.await.expect("response");
        if n <= 2 {
            assert_eq!(response.status(), StatusCode::OK);
            responses.push(response);
        } else {
            // Turned away: it holds nothing.
            assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        }
        assert_eq!(held(), f64::from(n.min(2)), "after request {n}");
    }
    drop(responses.pop());
    assert_eq!(held(), 1.0);
    drop(responses);
    assert_eq!(held(), 0.0);
}

/// Sends `n` requests through `svc` and returns their statuses.
async fn send<S>(svc: &mut S, n: usize) -> Vec<StatusCode>
where
    S: Service<Request<()>, Response = Response<floodgate_tower::ResponseBody<String>>>,
    S::Error: std::fmt::Debug,
{
    let mut statuses = Vec::new();
    for _ in 0..n {
        svc.ready().await.expect("ready");
        statuses.push(svc.call(Request::new(())).await.expect("response").status());
    }
    statuses
}

#[tokio::test]
async fn the_deny_cache_is_counted_in_stats_and_metrics() {
    let redis = RedisServer::start().expect("redis-server (run scripts/install-redis)");
    let layer = RateLimitLayer::builder(limiter_of(&redis).await)
        .rule(Rule::new(one_per_minute("one")).key(GlobalKey))
        .build()
        .expect("layer");
    let recorder = Recorded::default();
    // Registers the metrics with this recorder (a service installs its recorder first).
    let stats = metrics::with_local_recorder(&recorder, || layer.stats());
    assert_eq!(
        stats.deny_cache,
        Some(DenyCacheStats::default()),
        "a Redis layer has a deny cache by default"
    );
    assert_eq!(stats.leasing, None);
    let mut svc = layer.layer(tower::service_fn(|_: Request<()>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    }));

    // The allowed request spends the only unit: GCRA knows when the next comes, so the ten
    // after it are denied locally.
    let statuses = send(&mut svc, 11).await;
    assert_eq!(statuses[0], StatusCode::OK);
    assert!(
        statuses[1..]
            .iter()
            .all(|s| *s == StatusCode::TOO_MANY_REQUESTS),
        "{statuses:?}"
    );
    // The first request copied the counters (one store call); the next copy waits a second,
    // so unless the requests took that long, the metrics lag behind.
    assert_eq!(recorder.counter("floodgate_deny_cache_misses_total{}"), 1);
    assert!(recorder.counter("floodgate_deny_cache_hits_total{}") <= 10);

    let stats = layer.stats().deny_cache.expect("deny cache");
    assert_eq!((stats.hits, stats.misses, stats.entries), (10, 1, 1));
    assert_eq!(recorder.counter("floodgate_deny_cache_hits_total{}"), 10);
    assert_eq!(recorder.counter("floodgate_deny_cache_misses_total{}"), 1);
    assert_eq!(recorder.gauge("floodgate_deny_cache_entries{}"), 1.0);

    // A second later, the next request copies them on its way.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(send(&mut svc, 1).await, [StatusCode::TOO_MANY_REQUESTS]);
    assert_eq!(recorder.counter("floodgate_deny_cache_hits_total{}"), 11);
    assert_eq!(recorder.counter("floodgate_deny_cache_misses_total{}"), 1);

    // A second layer with its own cache adds its counts to the same metrics.
    let other = RateLimitLayer::builder(limiter_of(&redis).await)
        .rule(Rule::new(one_per_minute("two")).key(GlobalKey))
        .build()
        .expect("layer");
    metrics::with_local_recorder(&recorder, || other.stats());
    let mut svc = other.layer(tower::service_fn(|_: Request<()>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    }));
    assert_eq!(send(&mut svc, 3).await[2], StatusCode::TOO_MANY_REQUESTS);
    let two = other.stats().deny_cache.expect("deny cache");
    assert_eq!((two.hits, two.misses), (2, 1));
    assert_eq!(recorder.counter("floodgate_deny_cache_hits_total{}"), 13);
    assert_eq!(recorder.counter("floodgate_deny_cache_misses_total{}"), 2);
    assert_eq!(recorder.gauge("floodgate_deny_cache_entries{}"), 2.0);
}

/// While the store is failing and skipped, a denial the deny cache holds still answers, and
/// the cache's counters are still copied into the metrics.
#[tokio::test]
async fn cached_denials_while_the_store_is_skipped_are_counted() {
    let redis = RedisServer::start().expect("redis-server (run scripts/install-redis)");
    let config = RedisConfig::new(&redis.url())
        .expect("url")
        .timeout(Duration::from_millis(250))
        .connect_timeout(Duration::from_millis(250));
    let limiter = RedisLimiter::connect(&config).await.expect("connect");
    let layer = RateLimitLayer::builder(limiter)
        .rule(Rule::new(one_per_minute("skipped")).key(HeaderKey::named("x-client").expect("name")))
        .on_store_error(OnStoreError::FailOpen)
        .store_retry_interval(Duration::from_secs(3600))
        .build()
        .expect("layer");
    let recorder = Recorded::default();
    metrics::with_local_recorder(&recorder, || layer.stats());
    let mut svc = layer.layer(tower::service_fn(|_: Request<()>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    }));
    let mut call = async |client: &str| {
        let req = Request::builder()
            .header("x-client", client)
            .body(())
            .expect("request");
        svc.ready().await.expect("ready");
        svc.call(req).await.expect("response").status()
    };
    assert_eq!(call("a").await, StatusCode::OK);
    assert_eq!(call("a").await, StatusCode::TOO_MANY_REQUESTS);
    redis.kill().expect("kill");
    // Another client finds the store down: it is skipped from now on, and fails open.
    assert_eq!(call("b").await, StatusCode::OK);
    assert_eq!(call("b").await, StatusCode::OK);
    // The first request copied the counters; the next copy is due a second later.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let before = recorder.counter("floodgate_deny_cache_hits_total{}");
    assert_eq!(call("a").await, StatusCode::TOO_MANY_REQUESTS);
    let hits = recorder.counter("floodgate_deny_cache_hits_total{}");
    assert!(hits > before, "not copied: {before} then {hits}");
    let stats = metrics::with_local_recorder(&recorder, || layer.stats());
    assert_eq!(stats.deny_cache.expect("deny cache").hits, hits);
}

async fn limiter_of(redis: &RedisServer) -> RedisLimiter {
    let config = RedisConfig::new(&redis.url()).expect("url");
    RedisLimiter::connect(&config).await.expect("connect")
}

fn one_per_minute(name: &str) -> Policy {
    Policy::per_minute(1)
        .and_then(|p| p.named(name))
        .expect("policy")
}

#[tokio::test]
async fn local_leasing_is_counted_in_stats_and_metrics() {
    let redis = RedisServer::start().expect("redis-server (run scripts/install-redis)");
    let hot = Policy::per_second(1000)
        .and_then(|p| p.named("hot"))
        .expect("policy");
    let layer = RateLimitLayer::builder(limiter_of(&redis).await)
        .rule(Rule::new(hot).key(GlobalKey))
        // Hot after 16 checks within one lease period: 2 s, so that a slow machine's 16
        // checks through Redis fall in one.
        .leasing(floodgate_core::LeasingConfig {
            lease_for: Duration::from_secs(2),
            ..floodgate_core::LeasingConfig::default()
        })
        .build()
        .expect("layer");
    let recorder = Recorded::default();
    metrics::with_local_recorder(&recorder, || layer.stats());
    let mut svc = layer.layer(tower::service_fn(|_: Request<()>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    }));
    let statuses = send(&mut svc, 40).await;
    assert!(
        statuses.iter().all(|s| *s == StatusCode::OK),
        "{statuses:?}"
    );
    let stats = layer.stats();
    let leasing = stats.leasing.expect("leasing");
    // The key turns hot after 16 checks; from then on it spends leases of 10 units.
    assert!(leasing.leases >= 1 && leasing.local >= 10, "{leasing:?}");
    assert!(stats.deny_cache.is_some(), "the deny cache stays in front");
    assert_eq!(
        recorder.counter("floodgate_leasing_local_total{}"),
        leasing.local
    );
    assert_eq!(
        recorder.counter("floodgate_leasing_leases_total{}"),
        leasing.leases
    );
    assert_eq!(
        recorder.counter("floodgate_leasing_store_total{}"),
        leasing.store
    );
}

#[tokio::test]
async fn a_memory_layer_has_no_cache_stats() {
    let layer = RateLimitLayer::builder(MemoryLimiter::new())
        .rule(Rule::new(Policy::per_second(5).expect("policy")).key(GlobalKey))
        .build()
        .expect("layer");
    let stats = layer.stats();
    assert_eq!((stats.deny_cache, stats.leasing), (None, None));
}
