//! The chaos suite on one Redis server: faults injected into a real `redis-server` while many
//! tasks send load through the rate-limit layer (an axum app over HTTP), the limiter, and the
//! lock. Each test checks what floodgate promises on a bad day and prints what it measured as
//! `FIGURE:` lines, which docs/failure-modes.md quotes:
//!
//! ```text
//! cargo nextest run -p floodgate --test chaos --test chaos_cluster --no-capture 2>&1 | grep FIGURE:
//! ```
//!
//! Every setting is floodgate's default unless a test says otherwise: a Redis call timeout of
//! 250 ms, the circuit breaker (3 failures, open 100 ms doubling to 1 s), the layer's timeout of
//! 500 ms and its store retry interval of 500 ms, batching and the deny cache on.
//!
//! The redis-cluster faults are in `tests/chaos_cluster.rs`.

mod support;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use floodgate::lock::{FencedResource, LeaseLost, Lock, RedisLocks};
use floodgate::redis::{
    BreakerConfig, ConnectionKind, Error, RedisConfig, RedisConn, RedisLimiter,
};
use floodgate::tower::key::HeaderKey;
use floodgate::tower::{OnStoreError, RateLimitLayer, Rule};
use floodgate::{Limiter, MemoryLimiter, Policy};
use floodgate_testkit::RedisServer;
use support::http::{HttpClient, KEY_HEADER, Source, app, serve};
use support::{Latencies, Load, LoadSpec, Sample, blocking, figure, ms, panics, run, server};
use tokio::time::Instant;

/// floodgate-redis' default call timeout.
const REDIS_TIMEOUT: Duration = floodgate::redis::DEFAULT_TIMEOUT;
/// The layer's default decision timeout: what a request may wait for the store at most.
const LAYER_TIMEOUT: Duration = floodgate::tower::DEFAULT_TIMEOUT;
/// Scheduling slack on a shared two-core machine, on top of a configured timeout.
const MARGIN: Duration = Duration::from_millis(250);
/// The promise: decisions come from Redis again within this long of Redis coming back.
const RECOVERY_PROMISE: Duration = Duration::from_secs(2);
/// How long each fault lasts.
const FAULT: Duration = Duration::from_secs(3);
/// Load before the fault.
const WARMUP: Duration = Duration::from_secs(1);
/// Requests that start this soon after a fault may still be answered from decisions made
/// before it (the deny cache keeps a denial until its retry time, here at most 50 ms).
const GRACE: Duration = Duration::from_millis(200);
/// Requests per second per client key that the layer admits.
const PER_CLIENT: u64 = 20;

// ---- the layer over HTTP ---------------------------------------------------------------------

/// The three answers to "Redis failed".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    Open,
    Closed,
    Fallback,
}

impl Failure {
    const ALL: [Failure; 3] = [Failure::Open, Failure::Closed, Failure::Fallback];

    fn name(self) -> &'static str {
        match self {
            Failure::Open => "fail_open",
            Failure::Closed => "fail_closed",
            Failure::Fallback => "fallback",
        }
    }

    fn on_store_error(self) -> OnStoreError {
        match self {
            Failure::Open => OnStoreError::FailOpen,
            Failure::Closed => OnStoreError::FailClosed,
            Failure::Fallback => OnStoreError::Fallback(MemoryLimiter::new()),
        }
    }

    /// What every request decided during the fault may look like.
    fn allowed_during_fault(self, source: Source) -> bool {
        match self {
            Failure::Open => source == Source::Open,
            Failure::Closed => source == Source::Unavailable,
            Failure::Fallback => matches!(source, Source::Fallback | Source::Limited),
        }
    }
}

fn per_client_policy(failure: Failure) -> Policy {
    Policy::per_second(PER_CLIENT)
        .expect("valid policy")
        .named(&format!("per-client-{}", failure.name()))
        .expect("valid name")
}

/// One replica of the app: its own Redis connection, its own layer, its own port.
async fn replica(server: &RedisServer, failure: Failure) -> HttpClient {
    let config = RedisConfig::new(&server.url()).expect("url");
    let limiter = RedisLimiter::connect(&config).await.expect("connect");
    let layer = RateLimitLayer::builder(limiter)
        .rule(
            Rule::new(per_client_policy(failure))
                .key(HeaderKey::named(KEY_HEADER).expect("header name")),
        )
        .on_store_error(failure.on_store_error())
        .build()
        .expect("layer");
    HttpClient::new(serve(app(layer)).await)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// SIGKILL, then a restart on the same port (empty).
    KillRestart,
    /// SIGSTOP, then SIGCONT.
    Pause,
}

impl Fault {
    fn label(self) -> &'static str {
        match self {
            Fault::KillRestart => "restart",
            Fault::Pause => "pause",
        }
    }

    fn inject(self, server: &RedisServer) {
        let result = match self {
            Fault::KillRestart => server.kill(),
            Fault::Pause => server.pause(),
        };
        result.unwrap_or_else(|e| panic!("{}: inject: {e}", self.label()));
    }

    fn heal(self, server: &RedisServer) {
        let result = match self {
            Fault::KillRestart => server.restart(),
            Fault::Pause => server.resume(),
        };
        result.unwrap_or_else(|e| panic!("{}: heal: {e}", self.label()));
    }
}

/// When the fault began and ended, since the load's epoch.
#[derive(Debug, Clone, Copy)]
struct Timeline {
    /// Before the kill / SIGSTOP.
    fault_begin: Duration,
    /// The kill / SIGSTOP is done.
    fault_at: Duration,
    /// Before the restart / SIGCONT.
    heal_begin: Duration,
    /// Redis answers again (restart waited for PING) / SIGCONT delivered.
    healed_at: Duration,
}

/// Runs the three replicas under load, injects `fault` for [`FAULT`], heals it, and checks
/// and prints what each failure policy did.
async fn layer_under_fault(server: &RedisServer, fault: Fault) {
    let label = fault.label();
    let mut replicas = Vec::new();
    for failure in Failure::ALL {
        let client = replica(server, failure).await;
        assert_eq!(client.get("warm-up").await, Source::Store, "{failure:?}");
        replicas.push((failure, client));
    }
    let replicas = Arc::new(replicas);
    let n = replicas.len();
    // 8 client keys per replica, 24 tasks; each key asks twice as often as it may.
    let spec = LoadSpec {
        tasks: 8 * n,
        pace: Duration::from_millis(25),
        max_duration: Duration::from_secs(40),
        max_calls_per_task: 2_000,
    };
    let epoch = Instant::now();
    let load = {
        let replicas = Arc::clone(&replicas);
        Load::start(epoch, spec, move |task, _| {
            let replicas = Arc::clone(&replicas);
            async move {
                let client = &replicas[task % n].1;
                client.get(&format!("client-{}", task / n)).await
            }
        })
    };
    tokio::time::sleep(WARMUP).await;
    let fault_begin = load.now();
    blocking(|| fault.inject(server));
    let fault_at = load.now();
    tokio::time::sleep(FAULT).await;
    let heal_begin = load.now();
    blocking(|| fault.heal(server));
    let healed_at = load.now();
    tokio::time::sleep(RECOVERY_PROMISE + Duration::from_secs(1)).await;
    let samples = load.stop().await;
    let timeline = Timeline {
        fault_begin,
        fault_at,
        heal_begin,
        healed_at,
    };
    figure(
        &format!("{label}.fault_duration"),
        ms(heal_begin - fault_begin),
    );
    figure(&format!("{label}.heal_took"), ms(healed_at - heal_begin));

    for (i, (failure, _)) in replicas.iter().enumerate() {
        let mine: Vec<&Sample<Source>> = samples.iter().filter(|s| s.task % n == i).collect();
        check_replica(label, *failure, &mine, timeline);
    }
    assert_eq!(panics(), 0, "something panicked during the {label} fault");
}

fn tally(samples: &[&Sample<Source>]) -> String {
    let mut counts: HashMap<String, usize> = HashMap::new();
    for s in samples {
        let name = match s.outcome {
            Source::Store => "store".to_owned(),
            Source::Fallback => "fallback".to_owned(),
            Source::Open => "open".to_owned(),
            Source::Limited => "429".to_owned(),
            Source::Unavailable => "503".to_owned(),
            Source::Other(code) => code.to_string(),
            Source::NoResponse => "no_response".to_owned(),
        };
        *counts.entry(name).or_default() += 1;
    }
    let mut parts: Vec<String> = counts.iter().map(|(k, v)| format!("{k}:{v}")).collect();
    parts.sort();
    parts.join(" ")
}

fn check_replica(label: &str, failure: Failure, samples: &[&Sample<Source>], t: Timeline) {
    let name = format!("{label}.{}", failure.name());

    // No request hangs: every one is answered within the layer's timeout (plus slack).
    let all = Latencies::of(samples.iter().map(|s| s.latency()).collect());
    figure(&format!("{name}.requests"), all.count);
    figure(&format!("{name}.max_latency"), ms(all.max));
    let lost: Vec<_> = samples
        .iter()
        .filter(|s| s.outcome == Source::NoResponse || matches!(s.outcome, Source::Other(_)))
        .collect();
    assert!(
        lost.is_empty(),
        "{name}: requests without a proper answer: {lost:?}"
    );
    assert!(
        all.max <= LAYER_TIMEOUT + MARGIN,
        "{name}: a request took {} (layer timeout {LAYER_TIMEOUT:?})",
        ms(all.max)
    );

    // Before the fault: Redis decides.
    let before: Vec<_> = samples
        .iter()
        .filter(|s| s.end <= t.fault_begin)
        .copied()
        .collect();
    assert!(
        before
            .iter()
            .all(|s| matches!(s.outcome, Source::Store | Source::Limited)),
        "{name}: before the fault: {}",
        tally(&before)
    );

    // During the fault: the failure policy, and nothing else.
    let during: Vec<_> = samples
        .iter()
        .filter(|s| s.within(t.fault_at + GRACE, t.heal_begin))
        .copied()
        .collect();
    figure(&format!("{name}.during_fault"), tally(&during));
    let lat = Latencies::of(during.iter().map(|s| s.latency()).collect());
    lat.print(&format!("{name}.fault_latency"));
    assert!(
        during.len() >= 100,
        "{name}: only {} requests during the fault",
        during.len()
    );
    let wrong: Vec<_> = during
        .iter()
        .filter(|s| !failure.allowed_during_fault(s.outcome))
        .collect();
    assert!(
        wrong.is_empty(),
        "{name}: {} of {} requests during the fault were not {failure:?}: first {:?}",
        wrong.len(),
        during.len(),
        wrong.first()
    );
    if failure == Failure::Fallback {
        check_fallback_enforces_the_limit(&name, samples);
    }

    // After the fault: Redis decides again, within the promise, without restarting anything.
    let after: Vec<_> = samples
        .iter()
        .filter(|s| s.start >= t.healed_at)
        .copied()
        .collect();
    let last_not_store = after
        .iter()
        .filter(|s| !matches!(s.outcome, Source::Store | Source::Limited))
        .map(|s| s.end)
        .max();
    let first_store = after
        .iter()
        .find(|s| s.outcome == Source::Store)
        .map(|s| s.end - t.healed_at);
    let recovery = last_not_store.map_or(Duration::ZERO, |end| end - t.healed_at);
    figure(
        &format!("{name}.first_store_decision_after_heal"),
        first_store.map_or_else(|| "never".to_owned(), ms),
    );
    figure(&format!("{name}.recovery"), ms(recovery));
    figure(
        &format!("{name}.not_store_after_heal"),
        after
            .iter()
            .filter(|s| !matches!(s.outcome, Source::Store | Source::Limited))
            .count(),
    );
    assert!(
        first_store.is_some(),
        "{name}: Redis never decided again after the fault: {}",
        tally(&after)
    );
    assert!(
        recovery <= RECOVERY_PROMISE,
        "{name}: decisions came back to Redis only {} after it was back (promise: {RECOVERY_PROMISE:?}); after the heal: {}",
        ms(recovery),
        tally(&after)
    );
}

/// The local fallback enforces the same policy: per key, no more than the GCRA allows over
/// the time it decided (a burst of PER_CLIENT, then PER_CLIENT per second).
fn check_fallback_enforces_the_limit(name: &str, samples: &[&Sample<Source>]) {
    let fallback: Vec<_> = samples
        .iter()
        .filter(|s| s.outcome == Source::Fallback)
        .collect();
    let (Some(first), Some(last)) = (fallback.first(), fallback.last()) else {
        panic!("{name}: the fallback decided nothing");
    };
    let span = last.end - first.start;
    let bound = PER_CLIENT + (PER_CLIENT as f64 * span.as_secs_f64()).ceil() as u64 + 1;
    let mut per_key: HashMap<usize, u64> = HashMap::new();
    for s in &fallback {
        *per_key.entry(s.task).or_default() += 1;
    }
    let most = per_key.values().copied().max().unwrap_or(0);
    figure(
        &format!("{name}.fallback_admitted_per_key_max"),
        format!("{most} (GCRA bound {bound} over {})", ms(span)),
    );
    assert!(
        most <= bound,
        "{name}: the fallback admitted {most} requests of one key in {span:?} (bound {bound})"
    );
    let limited = samples
        .iter()
        .filter(|s| s.outcome == Source::Limited && s.start >= first.start && s.end <= last.end)
        .count();
    assert!(
        limited > 0,
        "{name}: the fallback never said 429, though every key asks twice its limit"
    );
}

/// Redis killed mid-load, then restarted empty on the same port: no panic, no request
/// waits longer than the layer's timeout (plus slack), fail-open lets everything through
/// undecided, fail-closed answers 503, the fallback decides locally with the same limits, and
/// every replica is back on Redis within 2 s of the restart, without being restarted.
#[test]
fn chaos_redis_killed_and_restarted_under_http_load() {
    let server = server();
    run(
        Duration::from_secs(120),
        layer_under_fault(&server, Fault::KillRestart),
    );
}

/// Redis paused with SIGSTOP for 3 s mid-load (connections open, nothing answered), then
/// resumed: the same bounds and policies, and the same connections carry decisions again.
#[test]
fn chaos_redis_paused_under_http_load() {
    let server = server();
    run(
        Duration::from_secs(120),
        layer_under_fault(&server, Fault::Pause),
    );
}

// ---- the circuit breaker ------------------------------------------------------------------

/// How a direct limiter call ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Call {
    Ok,
    /// `Error::Unavailable`: the breaker failed it at once.
    FailedFast,
    Timeout,
    Connection,
    Corrupted(String),
    Other(String),
}

impl Call {
    fn of<T>(result: &Result<T, Error>) -> Call {
        match result {
            Ok(_) => Call::Ok,
            Err(Error::Unavailable { .. }) => Call::FailedFast,
            Err(e) if e.is_timeout() => Call::Timeout,
            Err(e) if e.is_connection() => Call::Connection,
            Err(e) if e.is_corrupted() => Call::Corrupted(e.to_string()),
            Err(e) => Call::Other(format!("{e:?}")),
        }
    }

    fn failed(&self) -> bool {
        *self != Call::Ok
    }
}

async fn limiter_with(server: &RedisServer, breaker: BreakerConfig) -> RedisLimiter {
    let config = RedisConfig::new(&server.url())
        .expect("url")
        .connection(ConnectionKind::Multiplexed)
        .circuit_breaker(breaker);
    RedisLimiter::connect(&config).await.expect("connect")
}

/// While Redis is down (paused, then killed), callers of a limiter with the breaker fail at
/// once (`Error::Unavailable`) instead of each waiting out its timeout, as they do with
/// `BreakerConfig::disabled()`; after Redis is back the breaker probes and closes by itself.
/// Prints the latency distribution of the failing calls with and without the breaker.
#[test]
fn chaos_circuit_breaker_fails_fast_under_load() {
    let server = server();
    run(Duration::from_secs(120), async {
        let limiters = Arc::new([
            limiter_with(&server, BreakerConfig::default()).await,
            limiter_with(&server, BreakerConfig::disabled()).await,
        ]);
        let names = ["breaker", "no_breaker"];
        let policy = Arc::new(
            Policy::per_second(1_000_000)
                .expect("valid")
                .named("breaker-chaos")
                .expect("name"),
        );
        // 8 tasks per limiter, one key each, a call every 10 ms at most.
        let spec = LoadSpec {
            tasks: 16,
            pace: Duration::from_millis(10),
            max_duration: Duration::from_secs(60),
            max_calls_per_task: 5_000,
        };
        let epoch = Instant::now();
        let load = {
            let (limiters, policy) = (Arc::clone(&limiters), Arc::clone(&policy));
            Load::start(epoch, spec, move |task, _| {
                let (limiters, policy) = (Arc::clone(&limiters), Arc::clone(&policy));
                async move {
                    let key = format!("k{task}");
                    Call::of(
                        &limiters[task % 2]
                            .check_one(key.as_bytes(), &policy, 1)
                            .await,
                    )
                }
            })
        };
        tokio::time::sleep(WARMUP).await;
        let mut timelines = Vec::new();
        for fault in [Fault::Pause, Fault::KillRestart] {
            let fault_begin = load.now();
            blocking(|| fault.inject(&server));
            let fault_at = load.now();
            tokio::time::sleep(FAULT / 2).await;
            assert!(
                limiters[0].conn().is_circuit_open(),
                "{}: the breaker is not open while Redis is down",
                fault.label()
            );
            assert!(!limiters[1].conn().is_circuit_open());
            tokio::time::sleep(FAULT / 2).await;
            let heal_begin = load.now();
            blocking(|| fault.heal(&server));
            let healed_at = load.now();
            tokio::time::sleep(RECOVERY_PROMISE + Duration::from_millis(500)).await;
            timelines.push((
                fault,
                Timeline {
                    fault_begin,
                    fault_at,
                    heal_begin,
                    healed_at,
                },
            ));
        }
        let samples = load.stop().await;
        assert!(
            !limiters[0].conn().is_circuit_open(),
            "the breaker stayed open"
        );

        for (which, name) in names.iter().enumerate() {
            let mine: Vec<&Sample<Call>> = samples.iter().filter(|s| s.task % 2 == which).collect();
            let strange: Vec<_> = mine
                .iter()
                .filter(|s| matches!(s.outcome, Call::Corrupted(_) | Call::Other(_)))
                .collect();
            assert!(strange.is_empty(), "{name}: unexpected errors: {strange:?}");
            let all = Latencies::of(mine.iter().map(|s| s.latency()).collect());
            figure(&format!("breaker.{name}.max_latency"), ms(all.max));
            // A bound with room to spare: a batched check carries its deadline through the
            // batcher (chaos_batched_checks_fail_within_the_call_timeout asserts the timeout).
            assert!(
                all.max <= REDIS_TIMEOUT * 2 + MARGIN,
                "{name}: a call took {} (timeout {REDIS_TIMEOUT:?})",
                ms(all.max)
            );
            for (i, (fault, t)) in timelines.iter().enumerate() {
                let label = format!("breaker.{name}.{}", fault.label());
                let next_fault = timelines
                    .get(i + 1)
                    .map_or(Duration::MAX, |(_, next)| next.fault_begin);
                let during: Vec<_> = mine
                    .iter()
                    .filter(|s| s.within(t.fault_at, t.heal_begin))
                    .copied()
                    .collect();
                let failing: Vec<_> = during.iter().filter(|s| s.outcome.failed()).collect();
                let fast = failing
                    .iter()
                    .filter(|s| s.outcome == Call::FailedFast)
                    .count();
                let lat = Latencies::of(failing.iter().map(|s| s.latency()).collect());
                figure(&format!("{label}.calls_during_fault"), during.len());
                figure(&format!("{label}.failed_fast"), fast);
                lat.print(&format!("{label}.failing_call_latency"));
                assert!(
                    during.iter().all(|s| s.outcome.failed()),
                    "{label}: a call succeeded while Redis was down"
                );
                assert!(failing.len() >= 20, "{label}: only {} calls", failing.len());
                if which == 0 {
                    // With the breaker: nearly every failing call fails at once.
                    assert!(
                        fast * 10 >= failing.len() * 9,
                        "{label}: only {fast} of {} failing calls failed fast",
                        failing.len()
                    );
                    assert!(
                        lat.p50 < REDIS_TIMEOUT / 5,
                        "{label}: median failing call took {}",
                        ms(lat.p50)
                    );
                } else {
                    assert_eq!(fast, 0, "{label}: failed fast without a breaker");
                    if *fault == Fault::Pause {
                        // Without it, each call waits out its own timeout.
                        assert!(
                            lat.p50 >= REDIS_TIMEOUT * 9 / 10,
                            "{label}: median failing call took only {}",
                            ms(lat.p50)
                        );
                    }
                }
                // The breaker probes and closes: decisions come back by themselves.
                let first_ok = mine
                    .iter()
                    .filter(|s| s.start >= t.healed_at && s.outcome == Call::Ok)
                    .map(|s| s.end - t.healed_at)
                    .min();
                figure(
                    &format!("{label}.first_success_after_heal"),
                    first_ok.map_or_else(|| "never".to_owned(), ms),
                );
                let first_ok =
                    first_ok.unwrap_or_else(|| panic!("{label}: no call succeeded after the heal"));
                assert!(
                    first_ok <= RECOVERY_PROMISE,
                    "{label}: first success {} after the heal",
                    ms(first_ok)
                );
                let late_failures = mine
                    .iter()
                    .filter(|s| {
                        s.within(t.healed_at + RECOVERY_PROMISE, next_fault) && s.outcome.failed()
                    })
                    .count();
                assert_eq!(
                    late_failures, 0,
                    "{label}: calls still failing {RECOVERY_PROMISE:?} after the heal"
                );
            }
        }
        assert_eq!(panics(), 0);
    });
}

// ---- a corrupted key -------------------------------------------------------------------------

/// Overwrites `key` with a list, atomically (the load keeps writing the key meanwhile).
fn corrupt(server: &RedisServer, key: &[u8]) {
    let reply = server
        .cmd(&[
            &b"EVAL"[..],
            b"redis.call('DEL', KEYS[1]) return redis.call('RPUSH', KEYS[1], 'intruder')",
            b"1",
            key,
        ])
        .expect("corrupt the key");
    assert!(!reply.is_error(), "{reply:?}");
}

/// Another client writes a list where one key's limiter state lives, under load from 16
/// tasks on 16 keys (batched into shared script calls): that key's callers get the typed
/// error (`is_corrupted()`, naming the key), every other key keeps being decided, and the key
/// works again once it is deleted.
#[test]
fn chaos_corrupted_key_fails_only_its_own_callers() {
    let server = server();
    run(Duration::from_secs(60), async {
        let limiter = Arc::new(
            RedisLimiter::connect(&RedisConfig::new(&server.url()).expect("url"))
                .await
                .expect("connect"),
        );
        let policy = Arc::new(
            Policy::per_second(1_000_000)
                .expect("valid")
                .named("corrupt-chaos")
                .expect("name"),
        );
        const VICTIM: usize = 3;
        let victim_key = limiter.state_key(&policy, format!("k{VICTIM}").as_bytes());
        let shown = String::from_utf8_lossy(&victim_key).into_owned();
        let spec = LoadSpec {
            tasks: 16,
            pace: Duration::from_millis(5),
            max_duration: Duration::from_secs(30),
            max_calls_per_task: 5_000,
        };
        let epoch = Instant::now();
        let load = {
            let (limiter, policy) = (Arc::clone(&limiter), Arc::clone(&policy));
            Load::start(epoch, spec, move |task, _| {
                let (limiter, policy) = (Arc::clone(&limiter), Arc::clone(&policy));
                async move {
                    let key = format!("k{task}");
                    Call::of(&limiter.check_one(key.as_bytes(), &policy, 1).await)
                }
            })
        };
        tokio::time::sleep(WARMUP).await;
        blocking(|| corrupt(&server, &victim_key));
        let corrupted_at = load.now();
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let repair_begin = load.now();
        blocking(|| server.cmd(&[&b"DEL"[..], &victim_key]).expect("DEL"));
        let repaired_at = load.now();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let samples = load.stop().await;

        let victim: Vec<_> = samples
            .iter()
            .filter(|s| s.task == VICTIM && s.within(corrupted_at, repair_begin))
            .collect();
        let typed = victim
            .iter()
            .filter(|s| matches!(&s.outcome, Call::Corrupted(m) if m.contains(&shown)))
            .count();
        figure("corrupt.limiter.victim_calls", victim.len());
        figure("corrupt.limiter.victim_typed_errors", typed);
        assert!(victim.len() >= 20, "only {} victim calls", victim.len());
        assert_eq!(
            typed,
            victim.len(),
            "every call on the corrupted key is a typed error naming it: {:?}",
            victim
                .iter()
                .find(|s| !matches!(s.outcome, Call::Corrupted(_)))
        );

        let others: Vec<_> = samples.iter().filter(|s| s.task != VICTIM).collect();
        let failed: Vec<_> = others.iter().filter(|s| s.outcome.failed()).collect();
        let during = Latencies::of(
            others
                .iter()
                .filter(|s| s.within(corrupted_at, repair_begin))
                .map(|s| s.latency())
                .collect(),
        );
        figure("corrupt.limiter.other_calls", others.len());
        figure("corrupt.limiter.other_errors", failed.len());
        during.print("corrupt.limiter.other_latency_during");
        assert!(failed.is_empty(), "other keys failed: {:?}", failed.first());

        let healed: Vec<_> = samples
            .iter()
            .filter(|s| s.task == VICTIM && s.start >= repaired_at)
            .collect();
        assert!(!healed.is_empty());
        assert!(
            healed.iter().all(|s| s.outcome == Call::Ok),
            "the key stays broken after DEL: {:?}",
            healed.iter().find(|s| s.outcome.failed())
        );
        assert_eq!(panics(), 0);
    });
}

/// What the layer did for the other keys while one key was corrupted.
#[derive(Debug)]
struct LayerCorruption {
    victim: String,
    others: String,
    others_total: usize,
    others_not_store: usize,
}

/// The same corruption seen through the layer (local fallback), 8 keys over HTTP.
async fn layer_with_a_corrupted_key(server: &RedisServer) -> LayerCorruption {
    let config = RedisConfig::new(&server.url()).expect("url");
    let limiter = RedisLimiter::connect(&config).await.expect("connect");
    let policy = Policy::per_second(1_000)
        .expect("valid")
        .named("corrupt-layer")
        .expect("name");
    let victim_key = limiter.state_key(&policy, b"client-3");
    let layer = RateLimitLayer::builder(limiter)
        .rule(Rule::new(policy).key(HeaderKey::named(KEY_HEADER).expect("header name")))
        .on_store_error(OnStoreError::local_fallback())
        .build()
        .expect("layer");
    let client = Arc::new(HttpClient::new(serve(app(layer)).await));
    let spec = LoadSpec {
        tasks: 8,
        pace: Duration::from_millis(10),
        max_duration: Duration::from_secs(30),
        max_calls_per_task: 2_000,
    };
    let epoch = Instant::now();
    let load = {
        let client = Arc::clone(&client);
        Load::start(epoch, spec, move |task, _| {
            let client = Arc::clone(&client);
            async move { client.get(&format!("client-{task}")).await }
        })
    };
    tokio::time::sleep(WARMUP).await;
    blocking(|| corrupt(server, &victim_key));
    let corrupted_at = load.now();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let repair_begin = load.now();
    let samples = load.stop().await;
    let during = |victim: bool| -> Vec<&Sample<Source>> {
        samples
            .iter()
            .filter(|s| (s.task == 3) == victim && s.within(corrupted_at, repair_begin))
            .collect()
    };
    let others = during(false);
    let victim = during(true);
    assert!(
        samples.iter().all(|s| s.outcome.admitted()),
        "every request is answered 200 by the store or the fallback: {}",
        tally(&samples.iter().collect::<Vec<_>>())
    );
    assert!(
        victim.iter().all(|s| s.outcome == Source::Fallback),
        "the corrupted key is decided by the fallback: {}",
        tally(&victim)
    );
    LayerCorruption {
        victim: tally(&victim),
        others: tally(&others),
        others_total: others.len(),
        others_not_store: others.iter().filter(|s| s.outcome != Source::Store).count(),
    }
}

/// Through the layer, the corrupted key's requests are decided by the local fallback (the
/// HTTP client cannot get a typed Redis error); prints how the other keys fared.
#[test]
fn chaos_corrupted_key_through_the_layer() {
    let server = server();
    run(Duration::from_secs(60), async {
        let seen = layer_with_a_corrupted_key(&server).await;
        figure("corrupt.layer.victim", &seen.victim);
        figure("corrupt.layer.other_keys", &seen.others);
        figure(
            "corrupt.layer.other_keys_not_from_redis",
            format!(
                "{:.0}%",
                100.0 * seen.others_not_store as f64 / seen.others_total.max(1) as f64
            ),
        );
        assert_eq!(panics(), 0);
    });
}

/// The promise, through the layer: one corrupted key leaves every other key on Redis.
///
/// A corrupted key is that key's problem: the layer's store health only counts unavailability
/// (`Limiter::is_unavailable`), so every other key keeps being decided by Redis.
#[test]
fn chaos_corrupted_key_leaves_other_keys_on_redis_through_the_layer() {
    let server = server();
    run(Duration::from_secs(60), async {
        let seen = layer_with_a_corrupted_key(&server).await;
        assert_eq!(
            seen.others_not_store, 0,
            "other keys were not decided by Redis while one key was corrupted: {seen:?}"
        );
    });
}

// ---- the lock --------------------------------------------------------------------------------

const LOCK_TTL: Duration = Duration::from_secs(1);

async fn redis_locks(server: &RedisServer) -> RedisLocks {
    let url = server.url();
    let config = RedisConfig::new(&url).expect("url");
    let conn = RedisConn::connect(&config).await.expect("connect");
    RedisLocks::builder(conn)
        .notifications([url.as_str()])
        .expect("url")
        .build()
}

/// One critical section of a contender.
#[derive(Debug, Clone, Copy)]
struct Held {
    fence: u64,
    acquired: Duration,
    writes: usize,
}

/// A holder with the watchdog on, 8 contenders waiting for the same lock on another client,
/// and Redis restarted empty under them: the holder's `lost()` fires (its lease is gone), a
/// contender takes the lock with a larger fencing token, and the protected resource refuses
/// the stale holder's late write.
#[test]
fn chaos_lock_holder_loses_its_lease_when_redis_restarts() {
    let server = server();
    run(Duration::from_secs(60), async {
        let holder_locks = redis_locks(&server).await;
        let contender_locks = redis_locks(&server).await;
        let resource = Arc::new(FencedResource::new(Vec::<u64>::new()));
        let epoch = Instant::now();

        let holder = Lock::new(holder_locks, "dispatch:campaign-7", LOCK_TTL)
            .expect("valid")
            .watchdog(true);
        let guard = holder
            .acquire(Duration::from_secs(5))
            .await
            .expect("acquired");
        let old_fence = guard.fence();
        resource
            .write(old_fence, |log| log.push(old_fence))
            .expect("first write");
        // The holder writes every 20 ms until it learns its lease is lost.
        let writer = {
            let (resource, lost) = (Arc::clone(&resource), guard.lost());
            tokio::spawn(async move {
                tokio::pin!(lost);
                // (when, admitted) of every write.
                let mut writes: Vec<(Duration, bool)> = Vec::new();
                for _ in 0..3_000 {
                    tokio::select! {
                        reason = &mut lost => return (reason, epoch.elapsed(), writes),
                        () = tokio::time::sleep(Duration::from_millis(20)) => {}
                    }
                    let admitted = resource.write(old_fence, |log| log.push(old_fence)).is_ok();
                    writes.push((epoch.elapsed(), admitted));
                }
                panic!("the lease was never lost");
            })
        };

        // Contenders: take the lock, write with their token until lost or 50 ms, release.
        let contenders = {
            let lock = Lock::new(contender_locks, "dispatch:campaign-7", LOCK_TTL)
                .expect("valid")
                .watchdog(true);
            let resource = Arc::clone(&resource);
            Load::start(
                epoch,
                LoadSpec {
                    tasks: 8,
                    pace: Duration::from_millis(10),
                    max_duration: Duration::from_secs(30),
                    max_calls_per_task: 200,
                },
                move |_, _| {
                    let (lock, resource) = (lock.clone(), Arc::clone(&resource));
                    async move {
                        let guard = lock.acquire(Duration::from_secs(3)).await.ok()?;
                        let acquired = epoch.elapsed();
                        let fence = guard.fence();
                        let mut writes = 0;
                        let lost = guard.lost();
                        tokio::pin!(lost);
                        for _ in 0..5 {
                            if resource.write(fence, |log| log.push(fence)).is_ok() {
                                writes += 1;
                            }
                            tokio::select! {
                                _ = &mut lost => break,
                                () = tokio::time::sleep(Duration::from_millis(10)) => {}
                            }
                        }
                        let _ = guard.release().await;
                        Some(Held {
                            fence,
                            acquired,
                            writes,
                        })
                    }
                },
            )
        };

        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let restart_begin = epoch.elapsed();
        blocking(|| server.restart()).expect("restart");
        let restarted_at = epoch.elapsed();
        let (reason, lost_at, writes) = writer.await.expect("writer");
        // Let the contenders take turns on the restarted server for a while.
        tokio::time::sleep(Duration::from_secs(2)).await;
        // The old holder wakes up late and writes with its old token: refused.
        let late = resource.write(old_fence, |log| log.push(old_fence));
        let held: Vec<Held> = contenders
            .stop()
            .await
            .into_iter()
            .filter_map(|s| s.outcome)
            .collect();

        let lost_after = lost_at.saturating_sub(restarted_at);
        figure("lock.restart.lost_reason", format!("{reason:?}"));
        figure("lock.restart.lost_after_restart", ms(lost_after));
        assert!(
            matches!(reason, LeaseLost::NotHeld | LeaseLost::Expired),
            "{reason:?}"
        );
        assert!(
            lost_after <= LOCK_TTL + MARGIN,
            "lost() fired {} after the restart (ttl {LOCK_TTL:?})",
            ms(lost_after)
        );
        assert!(
            held.iter().all(|h| h.acquired >= restart_begin),
            "a contender got the lock while the holder's lease was alive: {held:?}"
        );
        let first = held
            .iter()
            .min_by_key(|h| h.acquired)
            .expect("a contender took the lock after the restart");
        let reacquired_after = first.acquired.saturating_sub(restarted_at);
        figure(
            "lock.restart.reacquired_after_restart",
            ms(reacquired_after),
        );
        figure(
            "lock.restart.both_believed_they_held",
            ms(lost_at.saturating_sub(first.acquired)),
        );
        figure("lock.restart.acquisitions_after_restart", held.len());
        figure("lock.restart.stale_holder_writes_after_restart", {
            let after: Vec<_> = writes.iter().filter(|w| w.0 >= restart_begin).collect();
            let admitted = after.iter().filter(|w| w.1).count();
            format!("admitted:{admitted} refused:{}", after.len() - admitted)
        });
        assert!(
            held.iter().all(|h| h.fence > old_fence),
            "a fencing token after the restart is not above the old holder's {old_fence}: {held:?}"
        );
        assert!(held.iter().any(|h| h.writes > 0), "no contender wrote");
        let stale = late.expect_err("the stale holder's late write must be refused");
        assert_eq!(stale.fence, old_fence);
        assert!(stale.highest > old_fence);
        // Every admitted write is in fence order.
        let log = resource.read(Clone::clone);
        assert!(
            log.windows(2).all(|w| w[0] <= w[1]),
            "writes admitted out of fence order"
        );
        let e = guard.release().await.expect_err("the lease is gone");
        assert!(e.is_lost(), "{e}");
        assert_eq!(panics(), 0);
    });
}

// ---- batching under a fault --------------------------------------------------------------

/// `RedisConfig::timeout` "bounds each call". With batching (the default) a check that
/// arrives while `BatchConfig::max_in_flight` batches are stuck on a paused Redis waits for a
/// batch slot, but carries its deadline through the batcher: it fails within the timeout.
async fn batched_checks_on_a_paused_redis(server: &RedisServer) -> Latencies {
    let limiter = Arc::new(limiter_with(server, BreakerConfig::disabled()).await);
    let policy = Arc::new(Policy::per_second(1_000).expect("valid"));
    limiter
        .check_one(b"warm-up", &policy, 1)
        .await
        .expect("Redis is up");
    blocking(|| server.pause()).expect("pause");
    let mut calls = Vec::new();
    for i in 0..32_u64 {
        let (limiter, policy) = (Arc::clone(&limiter), Arc::clone(&policy));
        calls.push(tokio::spawn(async move {
            // Staggered, so that they make separate batches.
            tokio::time::sleep(Duration::from_millis(3 * i)).await;
            let started = Instant::now();
            let result = limiter
                .check_one(format!("k{i}").as_bytes(), &policy, 1)
                .await;
            assert!(
                matches!(&result, Err(e) if e.is_timeout()),
                "a check on a paused Redis: {result:?}"
            );
            started.elapsed()
        }));
    }
    let mut latencies = Vec::new();
    for call in calls {
        latencies.push(call.await.expect("call"));
    }
    blocking(|| server.resume()).expect("resume");
    Latencies::of(latencies)
}

/// Prints how long batched checks wait on a paused Redis, with the breaker off.
#[test]
fn chaos_batched_checks_on_a_paused_redis() {
    let server = server();
    run(Duration::from_secs(60), async {
        let lat = batched_checks_on_a_paused_redis(&server).await;
        lat.print("batching.paused.check_latency");
        assert!(
            lat.max <= REDIS_TIMEOUT * 2 + MARGIN,
            "a batched check took {} (timeout {REDIS_TIMEOUT:?})",
            ms(lat.max)
        );
        assert_eq!(panics(), 0);
    });
}

/// The promise of `RedisConfig::timeout`: every check fails within the call timeout, however
/// long it waited for a batch (each batched check carries its deadline).
#[test]
fn chaos_batched_checks_fail_within_the_call_timeout() {
    let server = server();
    run(Duration::from_secs(60), async {
        let lat = batched_checks_on_a_paused_redis(&server).await;
        assert!(
            // 150 ms for a busy machine's timers and wake-ups, well short of the twice the
            // timeout (500 ms) the bug this guards against took.
            lat.max <= REDIS_TIMEOUT + Duration::from_millis(150),
            "a batched check took {} with a call timeout of {REDIS_TIMEOUT:?}: {lat}",
            ms(lat.max)
        );
    });
}
