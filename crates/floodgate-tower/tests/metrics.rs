//! Decisions are counted through the `metrics` facade.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use floodgate_core::{MemoryLimiter, Policy};
use floodgate_tower::key::GlobalKey;
use floodgate_tower::{RateLimitLayer, Rule};
use http::{Request, Response, StatusCode};
use metrics::{
    Counter, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};
use tower::{Layer, Service, ServiceExt};

#[derive(Default)]
struct Recorded {
    counters: Mutex<HashMap<String, Arc<AtomicU64>>>,
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

    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
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
    assert_eq!(
        recorder.counter("floodgate_requests_total{outcome=allowed,policy=counted}"),
        2
    );
    assert_eq!(
        recorder.counter("floodgate_requests_total{outcome=denied,policy=counted}"),
        1
    );
    assert_eq!(
        recorder.counter("floodgate_requests_total{outcome=error,policy=counted}"),
        0
    );
    let histograms = recorder.histograms.lock().expect("lock");
    let samples = histograms
        .get("floodgate_check_duration_seconds{}")
        .expect("histogram");
    assert_eq!(samples.0.lock().expect("lock").len(), 3);
}
