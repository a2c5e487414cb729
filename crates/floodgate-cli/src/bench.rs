//! `floodgate bench`: decisions per second and their latency against a real Redis, next to
//! baselines measured in the same run on the same server.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use clap::Args;
use floodgate_core::{Check, CheckOptions, Kind, Limiter, Policy};
use floodgate_redis::keys::key_slot;
use floodgate_redis::{BatchConfig, RedisLimiter};
use futures_util::{StreamExt, stream};
use redis::aio::ConnectionLike;
use redis::{ConnectionAddr, Value};
use serde::Serialize;

use crate::args;
use crate::error::CliError;
use crate::histogram::Histogram;
use crate::policy_args::{PolicyArgs, PolicySet, algorithms_help};
use crate::redis_args::{RedisArgs, SlotRange, cluster_slots, masters};

const LONG_ABOUT: &str = "\
Measure floodgate's decisions per second and their latency against a real Redis.

--concurrency tasks each loop: pick one of --keys user keys uniformly at random, make one
decision (Limiter::check, exactly what a service does per request), record its latency. After
--warmup, calls are counted for --duration; a run prints decisions/s, allowed and denied
counts, errors, and latency quantiles (p50, p90, p99, p99.9, max).

Baselines (unless --no-baselines), measured in the same run against the same server, each for
--duration, say how close floodgate gets to what the server can do:
  EVALSHA, pipelined   floodgate's own check script (the one its batches use; for plain GCRA
                       checks, the GCRA batch script) with the keys and arguments floodgate
                       sends for one decision (script_call), --pipeline deep, on
                       ceil(concurrency / pipeline) connections: as many calls in flight as
                       floodgate has; no client logic between calls
  INCR, pipelined      the cheapest write on the same key space, the same way
  redis-benchmark      when the binary is on PATH (not on a cluster, TLS, or a server with a
                       password: it would need the password on its command line): its INCR and
                       EVALSHA figures with -P <pipeline> -c <concurrency> -r <keys>
  redis-cell           when the server has the redis-cell module (CL.THROTTLE) and the policy is
                       one GCRA whose rate is a whole number per whole seconds (up to a day):
                       CL.THROTTLE with the same burst and rate, pipelined as above and with
                       redis-benchmark; the native module is the peer floodgate's Lua path is
                       measured against (scripts/build-redis-cell builds it)
Each baseline row shows floodgate's decisions/s divided by its own rate. Pipelined rows'
latencies are per pipeline. INCR and CL.THROTTLE keys are deleted at the end.

The policy: --algorithm (default gcra) or --policy, as in `check`. Policy flags that are not
given take defaults of about 10 per second: gcra --max-burst 9 --count 10 --period 1s;
fixed_window, sliding_log, sliding_window --limit 10 --window 1s; token_bucket --capacity 10
--refill 10 --interval 1s; leaky_bucket --capacity 10 --drain 1s; shaper --count 10 --period
1s; concurrency --limit 10 --lease-ttl 1s (leases are never released: they expire).";

const AFTER_HELP: &str = concat!(
    algorithms_help!(),
    "
Examples:
  floodgate bench --algorithm gcra --concurrency 64 --keys 100000 --duration 5s
  floodgate bench --redis redis://10.0.0.5:7000 --cluster --policy 100/minute --json
  floodgate bench --algorithm sliding_log --limit 100 --window 1m --no-baselines

Keys are <prefix>:<tag>:<policy>:{bench-000000000042} (the algorithm's tag: gcra, fw, log, sw,
tb, lb, shp, conc; they expire like every floodgate key),
<prefix>:bench-incr:{bench-000000000042} for the INCR baselines (created with a TTL of an hour,
or 20 times the run) and <prefix>:bench-cell:{bench-000000000042} for the redis-cell ones; both
are deleted at the end.
Ctrl-C stops the run and prints what was measured so far.

Exit status: 0 when the benchmark ran, 1 when Redis could not be reached or no decision at all
succeeded, 2 for a bad command line or policy."
);

/// Flags of `floodgate bench`.
#[derive(Debug, Args)]
#[command(
    about = "Measure decisions/s and latency against Redis, next to EVALSHA and INCR baselines",
    long_about = LONG_ABOUT,
    after_help = AFTER_HELP
)]
pub(crate) struct BenchArgs {
    #[command(flatten)]
    redis: RedisArgs,

    #[command(flatten)]
    policy: PolicyArgs,

    /// Tasks making decisions at the same time.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 64,
        help_heading = "Benchmark"
    )]
    concurrency: usize,

    /// User keys; each call picks one uniformly at random.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 100_000,
        help_heading = "Benchmark"
    )]
    keys: usize,

    /// How long each row is measured.
    #[arg(long, value_name = "DUR", default_value = "5s", value_parser = args::duration, help_heading = "Benchmark")]
    duration: Duration,

    /// How long each row runs before it is measured (0s: no warm-up).
    #[arg(long, value_name = "DUR", default_value = "1s", value_parser = args::duration, help_heading = "Benchmark")]
    warmup: Duration,

    /// Worker threads of the async runtime. One by default, as redis-benchmark runs: on a
    /// machine shared with the server, a second worker takes CPU from the server it measures
    /// (on 2 cores: 236k decisions/s with one worker, 205k with two)
    #[arg(
        long,
        value_name = "N",
        default_value_t = 1,
        help_heading = "Benchmark"
    )]
    threads: usize,

    /// The units each decision takes.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 1,
        help_heading = "Benchmark"
    )]
    cost: u64,

    /// Print one JSON object instead of a table.
    #[arg(long, help_heading = "Benchmark")]
    json: bool,

    /// Measure the baselines too [default].
    #[arg(long, overrides_with = "no_baselines", help_heading = "Benchmark")]
    baselines: bool,

    /// Measure floodgate only.
    #[arg(long, overrides_with = "baselines", help_heading = "Benchmark")]
    no_baselines: bool,

    /// Send every check as its own script call (floodgate batches concurrent checks into one
    /// call by default).
    #[arg(long, help_heading = "Benchmark")]
    no_batching: bool,

    /// Batching: the longest a check waits for others while a batch is in flight (e.g. 50us, 0s).
    #[arg(
        long,
        value_name = "DURATION",
        value_parser = crate::args::duration,
        conflicts_with = "no_batching"
    )]
    batch_window: Option<std::time::Duration>,

    /// Batching: the most checks in one script call.
    #[arg(long, value_name = "N", conflicts_with = "no_batching")]
    batch_max: Option<usize>,

    /// Batching: the most script calls in flight at once.
    #[arg(long, value_name = "N", conflicts_with = "no_batching")]
    batch_in_flight: Option<usize>,

    /// Commands per pipeline in the pipelined baselines and redis-benchmark (-P).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 16,
        help_heading = "Benchmark"
    )]
    pipeline: usize,
}

/// Tasks' phases: warming up, measured, stopped.
const WARMUP: u8 = 0;
const MEASURE: u8 = 1;
const STOP: u8 = 2;

/// One row of results.
#[derive(Debug, Serialize)]
struct Row {
    /// What ran.
    name: String,
    /// A stable identifier: floodgate, evalsha_pipelined, incr_pipelined,
    /// redis_benchmark_incr, redis_benchmark_evalsha, cell_pipelined, redis_benchmark_cell.
    id: &'static str,
    /// Commands (or decisions) completed while measured.
    ops: u64,
    ops_per_sec: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    allowed: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    denied: Option<u64>,
    errors: u64,
    elapsed_s: f64,
    /// What one latency sample is: a call, a pipeline of N, or redis-benchmark's own p50.
    latency_of: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    latency_ms: Option<Latency>,
    /// floodgate's decisions/s divided by this row's rate (baselines only).
    #[serde(skip_serializing_if = "Option::is_none")]
    floodgate_ratio: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    first_error: Option<String>,
    /// Why the row did not run.
    #[serde(skip_serializing_if = "Option::is_none")]
    skipped: Option<String>,
}

impl Row {
    fn skipped(name: &str, id: &'static str, why: impl Into<String>) -> Self {
        Row {
            name: name.to_owned(),
            id,
            ops: 0,
            ops_per_sec: 0.0,
            allowed: None,
            denied: None,
            errors: 0,
            elapsed_s: 0.0,
            latency_of: String::new(),
            latency_ms: None,
            floodgate_ratio: None,
            first_error: None,
            skipped: Some(why.into()),
        }
    }
}

/// Latency quantiles in milliseconds.
#[derive(Debug, Serialize)]
struct Latency {
    #[serde(skip_serializing_if = "Option::is_none")]
    p50: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    p90: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    p99: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    p99_9: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    mean: Option<f64>,
}

impl Latency {
    fn of(h: &Histogram) -> Option<Self> {
        if h.len() == 0 {
            return None;
        }
        let ms = |ns: u64| Some(ns as f64 / 1e6);
        Some(Latency {
            p50: ms(h.quantile(0.5)),
            p90: ms(h.quantile(0.9)),
            p99: ms(h.quantile(0.99)),
            p99_9: ms(h.quantile(0.999)),
            max: ms(h.max()),
            mean: Some(h.mean() / 1e6),
        })
    }
}

/// The whole report.
#[derive(Debug, Serialize)]
struct Report {
    policies: Vec<String>,
    algorithm: String,
    cost: u64,
    redis: String,
    connection: String,
    /// floodgate's automatic batching: "off", or its settings.
    batching: String,
    concurrency: usize,
    keys: usize,
    threads: usize,
    duration_s: f64,
    warmup_s: f64,
    pipeline: usize,
    decisions_per_sec: f64,
    floodgate: Row,
    baselines: Vec<Row>,
    /// floodgate's decisions/s over each baseline's rate, by baseline id.
    ratios: serde_json::Map<String, serde_json::Value>,
    /// Ctrl-C stopped the run early.
    interrupted: bool,
}

/// Everything the tasks share.
struct Shared {
    limiter: RedisLimiter,
    policies: Vec<Policy>,
    opts: CheckOptions,
    cost: u64,
    /// How many user keys (`user_key(0..key_count)`).
    key_count: usize,
    /// The user keys, built for the baselines only (floodgate's tasks write each key where
    /// they use it): a run without baselines does not hold `--keys` of them.
    keys: std::sync::OnceLock<Vec<Box<[u8]>>>,
    phase: AtomicU8,
}

impl Shared {
    /// The user keys, built at the first call.
    fn keys(&self) -> &[Box<[u8]>] {
        self.keys.get_or_init(|| {
            (0..self.key_count)
                .map(|i| user_key(i).into_bytes().into_boxed_slice())
                .collect()
        })
    }
}

/// What one task counted.
#[derive(Debug, Default)]
struct Tally {
    hist: Histogram,
    allowed: u64,
    denied: u64,
    errors: u64,
    first_error: Option<String>,
}

impl Tally {
    /// Whether a call that took `took` (and answered, `ok`) counts: it started in phase
    /// `started_in` and ended in `phase`'s, both the measured one. Its latency is recorded if
    /// it answered: an error (a breaker failing fast, a timeout) would pull the percentiles
    /// towards itself. A failed call outside the measure pauses a moment: not in a tight loop
    /// while Redis fails during the warm-up either.
    async fn measured(
        &mut self,
        started_in: u8,
        phase: &AtomicU8,
        took: Duration,
        ok: bool,
    ) -> bool {
        if started_in != MEASURE || phase.load(Ordering::Relaxed) != MEASURE {
            if !ok {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            return false;
        }
        if ok {
            self.hist
                .record(u64::try_from(took.as_nanos()).unwrap_or(u64::MAX));
        }
        true
    }
}

impl Tally {
    fn merge(&mut self, other: Tally) {
        self.hist.merge(&other.hist);
        self.allowed += other.allowed;
        self.denied += other.denied;
        self.errors += other.errors;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
    }
}

/// The user key of index `i`: `bench-` and 12 digits, as redis-benchmark's `__rand_int__`.
fn user_key(i: usize) -> String {
    String::from_utf8_lossy(write_user_key(i, &mut [0; USER_KEY_MAX])).into_owned()
}

/// One call's checks, one per policy.
type ChecksBuf<'a> = smallvec::SmallVec<[Check<'a>; 4]>;

/// The most user keys with baselines, which hold them all (and their Redis keys) in memory:
/// some 6 GB at this bound.
const MAX_BASELINE_KEYS: usize = 50_000_000;

/// The longest user key: `bench-` and the digits of `usize::MAX`.
const USER_KEY_MAX: usize = 26;

/// [`user_key`], written into `buf`: the tasks build each key as they go, as a service finds
/// it in the request it handles, rather than reading it from a table of keys, whose random
/// reads miss the cache twice per check and cost the client more than the check itself does.
fn write_user_key(i: usize, buf: &mut [u8; USER_KEY_MAX]) -> &[u8] {
    buf[..6].copy_from_slice(b"bench-");
    let mut digits = [b'0'; 20];
    let mut at = digits.len();
    let mut n = i;
    while n > 0 || at > digits.len() - 12 {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
    }
    let len = digits.len() - at;
    buf[6..6 + len].copy_from_slice(&digits[at..]);
    &buf[..6 + len]
}

/// Runs `floodgate bench`.
pub(crate) fn run(args: BenchArgs) -> Result<(), CliError> {
    let set = args.policy.build_or_default()?;
    if args.concurrency == 0 || args.keys == 0 || args.threads == 0 || args.pipeline == 0 {
        return Err(CliError::usage(
            "--concurrency, --keys, --threads and --pipeline must be at least 1",
        ));
    }
    if args.duration.is_zero() {
        return Err(CliError::usage("--duration must be longer than 0s"));
    }
    if !args.no_baselines && args.keys > MAX_BASELINE_KEYS {
        return Err(CliError::usage(format!(
            "the baselines hold every key in memory: --keys at most {MAX_BASELINE_KEYS} with \
             them, or add --no-baselines (floodgate's own run takes any number)"
        )));
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads)
        .enable_all()
        .build()
        .map_err(|e| CliError::io("cannot start the async runtime", e))?;
    let report = runtime.block_on(bench(&args, set))?;
    if args.json {
        crate::error::print_json(&report)?;
    } else {
        crate::error::print(&table(&report))?;
    }
    if report.floodgate.ops == 0 && !report.interrupted {
        return Err(CliError::Failed(format!(
            "no decision succeeded{}",
            report
                .floodgate
                .first_error
                .as_deref()
                .map(|e| format!(": {e}"))
                .unwrap_or_default()
        )));
    }
    Ok(())
}

/// Runs the warm-up and the measured phase of `tasks` (which count only while `phase` is
/// `MEASURE`), then collects their tallies: the tally, the measured time, and whether Ctrl-C
/// cut it short.
async fn measure(
    args: &BenchArgs,
    phase: &AtomicU8,
    tasks: Vec<tokio::task::JoinHandle<Tally>>,
) -> (Tally, Duration, bool) {
    let mut interrupted = wait(args.warmup).await;
    phase.store(MEASURE, Ordering::Relaxed);
    let start = Instant::now();
    if !interrupted {
        interrupted = wait(args.duration).await;
    }
    phase.store(STOP, Ordering::Relaxed);
    let elapsed = start.elapsed();
    let mut tally = Tally::default();
    for task in tasks {
        match task.await {
            Ok(t) => tally.merge(t),
            Err(e) => {
                tally.errors += 1;
                tally.first_error.get_or_insert_with(|| e.to_string());
            }
        }
    }
    (tally, elapsed, interrupted)
}

/// Ctrl-C, for the whole run: once `ctrl_c` has been listened to, SIGINT no longer ends the
/// process, and a press while nothing listens (building keys, cleaning up) would be lost.
struct Interrupt {
    pressed: std::sync::atomic::AtomicBool,
    notify: tokio::sync::Notify,
}

static INTERRUPT: Interrupt = Interrupt {
    pressed: std::sync::atomic::AtomicBool::new(false),
    notify: tokio::sync::Notify::const_new(),
};

/// Listens for Ctrl-C from now on: the first press stops the run at its next wait (what was
/// measured is printed); a second one ends the process at once (exit 130).
fn listen_for_ctrl_c() {
    tokio::spawn(async {
        while tokio::signal::ctrl_c().await.is_ok() {
            if INTERRUPT.pressed.swap(true, Ordering::SeqCst) {
                eprintln!("interrupted again: stopping now");
                std::process::exit(130);
            }
            eprintln!("interrupted: stopping (Ctrl-C again to stop at once)");
            INTERRUPT.notify.notify_waiters();
        }
    });
}

/// Waits `d`, or until Ctrl-C (pressed now or before); true if interrupted.
async fn wait(d: Duration) -> bool {
    let pressed = INTERRUPT.notify.notified();
    tokio::pin!(pressed);
    pressed.as_mut().enable();
    if INTERRUPT.pressed.load(Ordering::SeqCst) {
        return true;
    }
    tokio::select! {
        () = tokio::time::sleep(d) => false,
        () = pressed => true,
    }
}

fn progress(args: &BenchArgs, what: &str) {
    if !args.json {
        eprintln!("{what}");
    }
}

async fn bench(args: &BenchArgs, set: PolicySet) -> Result<Report, CliError> {
    listen_for_ctrl_c();
    let batch = if args.no_batching {
        BatchConfig::disabled()
    } else {
        let d = BatchConfig::default();
        BatchConfig {
            window: args.batch_window.unwrap_or(d.window),
            max_batch: args.batch_max.unwrap_or(d.max_batch),
            max_in_flight: args.batch_in_flight.unwrap_or(d.max_in_flight),
            ..d
        }
    };
    // Before connecting, in the flags' own words.
    batch.validate(args.redis.timeout).map_err(|e| {
        let why = match e {
            floodgate_redis::Error::Config(why) => why,
            other => other.to_string(),
        };
        CliError::Usage(format!(
            "--batch-window, --batch-in-flight or --timeout: {why}"
        ))
    })?;
    let limiter = args.redis.connect_with(batch).await?;
    let url = limiter.conn().redacted_url().to_owned();
    let cluster = args.redis.is_cluster()?;
    let shared = Arc::new(Shared {
        limiter: limiter.clone(),
        opts: CheckOptions::wait(set.max_wait),
        policies: set.policies.clone(),
        cost: args.cost,
        key_count: args.keys,
        keys: std::sync::OnceLock::new(),
        phase: AtomicU8::new(WARMUP),
    });
    progress(
        args,
        &format!(
            "floodgate: {} tasks, {} keys, {:?} (+{:?} warm-up)...",
            args.concurrency, args.keys, args.duration, args.warmup
        ),
    );
    let (mut floodgate, mut interrupted) = run_floodgate(args, &shared).await;
    let decisions_per_sec = floodgate.ops_per_sec;
    floodgate.first_error = floodgate.first_error.map(|e| format!("{e} (on {url})"));

    let mut baselines = Vec::new();
    if !args.no_baselines && !interrupted && floodgate.ops > 0 {
        // floodgate's row is measured already: a baseline that cannot start (a cluster whose
        // slots cannot be read) is a row that says so, not the end of the report.
        match run_baselines(args, &shared, cluster, &mut baselines).await {
            Ok(stop) => interrupted = stop,
            Err(e) => baselines.push(Row::skipped(
                "baselines",
                "baselines",
                format!("could not start: {e}"),
            )),
        }
    }
    let mut ratios = serde_json::Map::new();
    for row in &mut baselines {
        if row.ops_per_sec > 0.0 {
            let ratio = decisions_per_sec / row.ops_per_sec;
            row.floodgate_ratio = Some(ratio);
            ratios.insert(format!("floodgate_per_{}", row.id), ratio.into());
        }
    }
    let algorithms: Vec<&str> = set
        .policies
        .iter()
        .map(|p| p.algorithm().as_str())
        .collect();
    Ok(Report {
        policies: set.policies.iter().map(|p| p.name().to_owned()).collect(),
        algorithm: algorithms.join("+"),
        cost: args.cost,
        redis: url,
        connection: limiter.conn().kind().to_string(),
        batching: describe_batching(limiter.batching()),
        concurrency: args.concurrency,
        keys: args.keys,
        threads: args.threads,
        duration_s: args.duration.as_secs_f64(),
        warmup_s: args.warmup.as_secs_f64(),
        pipeline: args.pipeline,
        decisions_per_sec,
        floodgate,
        baselines,
        ratios,
        interrupted,
    })
}

fn describe_batching(b: &BatchConfig) -> String {
    if b.enabled {
        format!(
            "on (window {:?}, at most {} checks per call, {} calls in flight)",
            b.window, b.max_batch, b.max_in_flight
        )
    } else {
        "off".to_owned()
    }
}

/// The floodgate row: `concurrency` tasks looping `Limiter::check`.
async fn run_floodgate(args: &BenchArgs, shared: &Arc<Shared>) -> (Row, bool) {
    shared.phase.store(WARMUP, Ordering::Relaxed);
    let tasks: Vec<_> = (0..args.concurrency)
        .map(|_| {
            let shared = Arc::clone(shared);
            let seed = fastrand::u64(..);
            tokio::spawn(async move { floodgate_task(&shared, seed).await })
        })
        .collect();
    let (tally, elapsed, interrupted) = measure(args, &shared.phase, tasks).await;
    let ops = tally.allowed + tally.denied;
    let row = Row {
        name: "floodgate check".to_owned(),
        id: "floodgate",
        ops,
        ops_per_sec: ops as f64 / elapsed.as_secs_f64(),
        allowed: Some(tally.allowed),
        denied: Some(tally.denied),
        errors: tally.errors,
        elapsed_s: elapsed.as_secs_f64(),
        latency_of: "call".to_owned(),
        latency_ms: Latency::of(&tally.hist),
        floodgate_ratio: None,
        first_error: tally.first_error,
        skipped: None,
    };
    (row, interrupted)
}

async fn floodgate_task(shared: &Shared, seed: u64) -> Tally {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut tally = Tally::default();
    let n = shared.key_count;
    loop {
        let phase = shared.phase.load(Ordering::Relaxed);
        if phase == STOP {
            break;
        }
        let mut key_buf = [0; USER_KEY_MAX];
        let key = write_user_key(rng.usize(..n), &mut key_buf);
        // On the stack for up to four policies: the key lives in this iteration only.
        let checks: ChecksBuf<'_> = shared
            .policies
            .iter()
            .map(|p| Check::new(key, p).cost(shared.cost))
            .collect();
        let started = Instant::now();
        let result = shared.limiter.check(&checks, shared.opts).await;
        let took = started.elapsed();
        // Only calls that started and ended while measured count.
        if !tally
            .measured(phase, &shared.phase, took, result.is_ok())
            .await
        {
            continue;
        }
        match result {
            Ok(v) if v.allowed() => tally.allowed += 1,
            Ok(_) => tally.denied += 1,
            Err(e) => {
                tally.errors += 1;
                if tally.first_error.is_none() {
                    tally.first_error = Some(e.to_string());
                }
                // Do not spin while Redis is failing.
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    }
    tally
}

/// floodgate's check call as sent on the wire, to replay it.
#[derive(Debug, Clone)]
struct Template {
    script: &'static redis::Script,
    /// Everything after the keys.
    args: Vec<Vec<u8>>,
}

/// What the pipelined baselines send.
#[derive(Debug)]
enum Workload {
    /// `EVALSHA sha n key... arg...`, the keys of one user key per call.
    Evalsha {
        template: Template,
        keys: Vec<Vec<Vec<u8>>>,
    },
    /// `INCR key`.
    Incr { keys: Vec<Vec<u8>> },
    /// `CL.THROTTLE key max_burst count period 1`.
    Throttle {
        keys: Vec<Vec<u8>>,
        params: CellParams,
    },
}

impl Workload {
    fn push(&self, pipe: &mut redis::Pipeline, i: usize) {
        match self {
            Workload::Evalsha { template, keys } => {
                let keys = &keys[i];
                let cmd = pipe
                    .cmd("EVALSHA")
                    .arg(template.script.get_hash())
                    .arg(keys.len());
                for k in keys {
                    cmd.arg(k.as_slice());
                }
                for a in &template.args {
                    cmd.arg(a.as_slice());
                }
            }
            Workload::Incr { keys } => {
                pipe.cmd("INCR").arg(keys[i].as_slice());
            }
            Workload::Throttle { keys, params } => {
                pipe.cmd("CL.THROTTLE")
                    .arg(keys[i].as_slice())
                    .arg(params.max_burst)
                    .arg(params.count)
                    .arg(params.period_s)
                    .arg(1);
            }
        }
    }
}

/// Picks the keys of one pipeline: uniformly at random; on a cluster, the first uniformly and
/// the rest from its slot (a pipeline goes to one node), which keeps each key's chance equal.
#[derive(Debug)]
struct Picker {
    n: usize,
    /// Cluster only: each key's slot, and the keys of each slot.
    slots: Option<(Vec<u16>, Vec<Vec<u32>>)>,
}

impl Picker {
    fn new(state_keys: &[Vec<u8>], cluster: bool) -> Self {
        let slots = cluster.then(|| {
            let of: Vec<u16> = state_keys.iter().map(|k| key_slot(k)).collect();
            let mut by_slot = vec![Vec::new(); 16_384];
            for (i, s) in of.iter().enumerate() {
                by_slot[usize::from(*s)].push(u32::try_from(i).unwrap_or(u32::MAX));
            }
            (of, by_slot)
        });
        Picker {
            n: state_keys.len(),
            slots,
        }
    }

    fn fill(&self, rng: &mut fastrand::Rng, out: &mut Vec<usize>, count: usize) {
        out.clear();
        let first = rng.usize(..self.n);
        out.push(first);
        match &self.slots {
            None => out.extend((1..count).map(|_| rng.usize(..self.n))),
            Some((of, by_slot)) => {
                let same = &by_slot[usize::from(of[first])];
                out.extend((1..count).map(|_| same[rng.usize(..same.len())] as usize));
            }
        }
    }
}

/// One pipelined baseline's connection: a node or a cluster.
#[derive(Clone)]
enum BaseConn {
    Node(redis::aio::MultiplexedConnection),
    Cluster(redis::cluster_async::ClusterConnection),
}

impl BaseConn {
    async fn send(
        &mut self,
        pipe: &redis::Pipeline,
        count: usize,
    ) -> redis::RedisResult<Vec<Value>> {
        match self {
            BaseConn::Node(c) => c.req_packed_commands(pipe, 0, count).await,
            BaseConn::Cluster(c) => c.req_packed_commands(pipe, 0, count).await,
        }
    }
}

async fn base_conn(redis: &RedisArgs, cluster: bool) -> Result<BaseConn, String> {
    let fut = async {
        if cluster {
            let client = redis.cluster_client().map_err(|e| e.to_string())?;
            client
                .get_async_connection()
                .await
                .map(BaseConn::Cluster)
                .map_err(|e| e.to_string())
        } else {
            let client = redis.client().map_err(|e| e.to_string())?;
            // Bounded as floodgate's own connection is (the flags' timeouts), not by redis-rs'
            // defaults: a slower baseline would count timeouts as errors and look slower.
            let config = redis::AsyncConnectionConfig::new()
                .set_connection_timeout(Some(redis.connect_timeout))
                .set_response_timeout(Some(redis.timeout));
            client
                .get_multiplexed_async_connection_with_config(&config)
                .await
                .map(BaseConn::Node)
                .map_err(|e| e.to_string())
        }
    };
    match tokio::time::timeout(redis.connect_timeout, fut).await {
        Ok(r) => r,
        Err(_) => Err(format!(
            "connecting timed out after {:?}",
            redis.connect_timeout
        )),
    }
}

async fn run_baselines(
    args: &BenchArgs,
    shared: &Arc<Shared>,
    cluster: bool,
    rows: &mut Vec<Row>,
) -> Result<bool, CliError> {
    let limiter = &shared.limiter;
    let ranges = if cluster {
        Some(cluster_slots(limiter.conn(), &args.redis.seed_host()?).await?)
    } else {
        None
    };
    let first_keys: Vec<Vec<u8>> = shared
        .keys()
        .iter()
        .map(|k| limiter.state_key(&shared.policies[0], k))
        .collect();
    let picker = Arc::new(Picker::new(&first_keys, cluster));
    drop(first_keys);
    let incr_keys: Vec<Vec<u8>> = shared
        .keys()
        .iter()
        .map(|k| incr_key(&args.redis.prefix, k))
        .collect();

    // (a) floodgate's script, pipelined.
    let evalsha = "EVALSHA, pipelined";
    progress(args, &format!("baseline: {evalsha} x{}...", args.pipeline));
    let calls = script_calls(args, shared, ranges.as_deref()).await;
    let mut interrupted = false;
    let mut template = None;
    match calls {
        Ok((t, keys)) => {
            template = Some(t.clone());
            let workload = Workload::Evalsha { template: t, keys };
            let (row, stop) = run_pipelined(
                args,
                cluster,
                workload,
                &picker,
                evalsha,
                "evalsha_pipelined",
            )
            .await;
            rows.push(row);
            interrupted = stop;
        }
        Err(why) => rows.push(Row::skipped(
            evalsha,
            "evalsha_pipelined",
            format!("cannot prepare floodgate's script calls: {why}"),
        )),
    }
    // (b) INCR on the same key space, pipelined.
    let incr = "INCR, pipelined";
    if !interrupted {
        // Created expiring first (redis-benchmark's INCR keys are the same names).
        let ttl = ((args.warmup + args.duration) * 20).max(Duration::from_secs(3600));
        let created = tokio::time::timeout(
            Duration::from_secs(30),
            create_expiring(&args.redis, cluster, &incr_keys, &picker, ttl),
        )
        .await;
        if !matches!(created, Ok(Ok(()))) {
            eprintln!(
                "warning: could not create the INCR baseline's keys with a TTL ({}:bench-incr:*); \
                 they are deleted at the end",
                args.redis.prefix
            );
        }
        progress(args, &format!("baseline: {incr} x{}...", args.pipeline));
        let workload = Workload::Incr {
            keys: incr_keys.clone(),
        };
        let (row, stop) =
            run_pipelined(args, cluster, workload, &picker, incr, "incr_pipelined").await;
        rows.push(row);
        interrupted = stop;
    }
    // (c) redis-benchmark's own figures.
    if !interrupted {
        let incr_rate = rows
            .iter()
            .find(|r| r.id == "incr_pipelined")
            .map(|r| r.ops_per_sec);
        let evalsha_rate = rows
            .iter()
            .find(|r| r.id == "evalsha_pipelined")
            .map(|r| r.ops_per_sec);
        let (mut more, stop) =
            redis_benchmark(args, cluster, template, incr_rate, evalsha_rate, shared).await;
        rows.append(&mut more);
        interrupted = stop;
    }
    // (d) The native redis-cell module, when the server has it.
    let mut cell_keys = Vec::new();
    if !interrupted {
        let (mut more, stop) = cell_baselines(args, shared, cluster, &mut cell_keys, &picker).await;
        rows.append(&mut more);
        interrupted = stop;
    }
    let cleanup = tokio::time::timeout(Duration::from_secs(30), async {
        let incr = delete_keys(&args.redis, cluster, &incr_keys, &picker).await;
        let cell = delete_keys(&args.redis, cluster, &cell_keys, &picker).await;
        incr.and(cell)
    });
    let cleaned = match cleanup.await {
        Ok(r) => r,
        Err(_) => Err("timed out after 30s".to_owned()),
    };
    if let Err(e) = cleaned {
        eprintln!(
            "warning: could not delete the INCR baseline's keys ({}:bench-incr:*): {e}",
            args.redis.prefix
        );
    }
    Ok(interrupted)
}

/// The INCR baseline's key for a user key: same hash tag (slot) as floodgate's keys.
fn incr_key(prefix: &str, user_key: &[u8]) -> Vec<u8> {
    baseline_key(prefix, "bench-incr", user_key)
}

/// A baseline's key `<prefix>:<what>:{<user key>}`: same hash tag (slot) as floodgate's keys.
fn baseline_key(prefix: &str, what: &str, user_key: &[u8]) -> Vec<u8> {
    let mut k = format!("{prefix}:{what}:{{").into_bytes();
    k.extend_from_slice(user_key);
    k.push(b'}');
    k
}

/// `CL.THROTTLE`'s arguments for the same limit as floodgate's policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct CellParams {
    max_burst: u64,
    count: u64,
    period_s: u64,
}

impl CellParams {
    /// The policy as redis-cell's arguments, or why it has none: one GCRA policy, its rate
    /// written as `count` per `period_s` whole seconds (the shortest such period, at most a
    /// day).
    fn of(policies: &[Policy]) -> Result<Self, String> {
        let [policy] = policies else {
            return Err("redis-cell checks one policy at a time".into());
        };
        let Kind::Gcra(g) = policy.kind() else {
            return Err(format!(
                "redis-cell implements GCRA only, not {}",
                policy.algorithm().as_str()
            ));
        };
        let emission = g.emission_us().max(1);
        // period_s * 10^6 must be a multiple of the emission interval.
        let period_s = emission / gcd(emission, 1_000_000);
        if period_s > 86_400 {
            return Err(format!(
                "one request per {emission} us is no whole number per whole seconds up to a day \
                 (redis-cell's period is whole seconds)"
            ));
        }
        Ok(CellParams {
            max_burst: g.limit().saturating_sub(1),
            count: period_s * 1_000_000 / emission,
            period_s,
        })
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// The redis-cell rows: `CL.THROTTLE` pipelined in-process and through redis-benchmark, when
/// the server has the module and the policy maps onto it; else one row saying why not. `keys`
/// gets the keys it used, to delete.
async fn cell_baselines(
    args: &BenchArgs,
    shared: &Shared,
    cluster: bool,
    keys: &mut Vec<Vec<u8>>,
    picker: &Arc<Picker>,
) -> (Vec<Row>, bool) {
    let name = "CL.THROTTLE, pipelined";
    let id = "cell_pipelined";
    let params = match CellParams::of(&shared.policies) {
        Ok(p) => p,
        Err(why) => return (vec![Row::skipped(name, id, why)], false),
    };
    match shared.limiter.conn().has_redis_cell().await {
        Ok(true) => {}
        Ok(false) => {
            let why = "the server has no redis-cell module (CL.THROTTLE; scripts/build-redis-cell)";
            return (vec![Row::skipped(name, id, why)], false);
        }
        Err(e) => {
            let why = format!("cannot ask the server for CL.THROTTLE: {e}");
            return (vec![Row::skipped(name, id, why)], false);
        }
    }
    progress(args, &format!("baseline: {name} x{}...", args.pipeline));
    *keys = shared
        .keys()
        .iter()
        .map(|k| baseline_key(&args.redis.prefix, "bench-cell", k))
        .collect();
    let workload = Workload::Throttle {
        keys: keys.clone(),
        params,
    };
    let (row, stop) = run_pipelined(args, cluster, workload, picker, name, id).await;
    let rate = row.ops_per_sec;
    let mut rows = vec![row];
    if stop {
        return (rows, true);
    }
    let bench_name = format!("redis-benchmark CL.THROTTLE -P {}", args.pipeline);
    let bench_id = "redis_benchmark_cell";
    let (binary, target) = match redis_benchmark_setup(args, cluster) {
        Ok(found) => found,
        Err(why) => {
            rows.push(Row::skipped(&bench_name, bench_id, why));
            return (rows, false);
        }
    };
    progress(args, &format!("baseline: {bench_name}..."));
    let key = baseline_key(&args.redis.prefix, "bench-cell", b"bench-__rand_int__");
    let command = vec![
        "CL.THROTTLE".to_owned(),
        String::from_utf8_lossy(&key).into_owned(),
        params.max_burst.to_string(),
        params.count.to_string(),
        params.period_s.to_string(),
        "1".to_owned(),
    ];
    let (row, stop) = run_redis_benchmark(
        args,
        &binary,
        (&target.0, target.1, target.2),
        benchmark_requests(args, Some(rate)),
        command,
        &bench_name,
        bench_id,
    )
    .await;
    rows.push(row);
    (rows, stop)
}

/// A pipelined baseline: ceil(concurrency / pipeline) connections, one task each, sending
/// pipelines back to back.
async fn run_pipelined(
    args: &BenchArgs,
    cluster: bool,
    workload: Workload,
    picker: &Arc<Picker>,
    name: &str,
    id: &'static str,
) -> (Row, bool) {
    let connections = args.concurrency.div_ceil(args.pipeline).max(1);
    let mut conns = Vec::with_capacity(connections);
    for _ in 0..connections {
        match base_conn(&args.redis, cluster).await {
            Ok(c) => conns.push(c),
            Err(e) => {
                return (
                    Row::skipped(name, id, format!("cannot connect: {e}")),
                    false,
                );
            }
        }
    }
    let workload = Arc::new(workload);
    let phase = Arc::new(AtomicU8::new(WARMUP));
    let depth = args.pipeline;
    let tasks: Vec<_> = conns
        .into_iter()
        .map(|conn| {
            let workload = Arc::clone(&workload);
            let picker = Arc::clone(picker);
            let phase = Arc::clone(&phase);
            let seed = fastrand::u64(..);
            tokio::spawn(async move {
                pipelined_task(conn, &workload, &picker, &phase, depth, seed).await
            })
        })
        .collect();
    let (tally, elapsed, interrupted) = measure(args, &phase, tasks).await;
    let ops = tally.allowed + tally.denied;
    let row = Row {
        name: format!("{name} x{depth}"),
        id,
        ops,
        ops_per_sec: ops as f64 / elapsed.as_secs_f64(),
        allowed: None,
        denied: None,
        errors: tally.errors,
        elapsed_s: elapsed.as_secs_f64(),
        latency_of: format!("pipeline of {depth} (on {connections} connection(s))"),
        latency_ms: Latency::of(&tally.hist),
        floodgate_ratio: None,
        first_error: tally.first_error,
        skipped: None,
    };
    (row, interrupted)
}

async fn pipelined_task(
    mut conn: BaseConn,
    workload: &Workload,
    picker: &Picker,
    phase: &AtomicU8,
    depth: usize,
    seed: u64,
) -> Tally {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut tally = Tally::default();
    let mut picked = Vec::with_capacity(depth);
    let mut pipe = redis::pipe();
    loop {
        let started_in = phase.load(Ordering::Relaxed);
        if started_in == STOP {
            break;
        }
        picker.fill(&mut rng, &mut picked, depth);
        pipe.clear();
        for &i in &picked {
            workload.push(&mut pipe, i);
        }
        let started = Instant::now();
        let result = conn.send(&pipe, depth).await;
        let took = started.elapsed();
        if !tally
            .measured(started_in, phase, took, result.is_ok())
            .await
        {
            continue;
        }
        match result {
            Ok(values) => {
                for v in &values {
                    match v {
                        Value::ServerError(e) => {
                            tally.errors += 1;
                            if tally.first_error.is_none() {
                                tally.first_error = Some(format!("{e:?}"));
                            }
                        }
                        // The reply's layout is floodgate-redis' own: only counted here.
                        _ => tally.allowed += 1,
                    }
                }
            }
            Err(e) => {
                tally.errors += depth as u64;
                if tally.first_error.is_none() {
                    tally.first_error = Some(e.to_string());
                }
                // Do not spin on a broken connection.
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    tally
}

/// floodgate's check script call for each user key (from floodgate-redis' `script_call`: the
/// keys and arguments `EVALSHA` sends for one decision), and the script loaded on every node.
async fn script_calls(
    args: &BenchArgs,
    shared: &Shared,
    ranges: Option<&[SlotRange]>,
) -> Result<(Template, Vec<Vec<Vec<u8>>>), String> {
    let limiter = &shared.limiter;
    let mut template: Option<Template> = None;
    let mut keys = Vec::with_capacity(shared.key_count);
    let mut checks: Vec<Check<'_>> = Vec::with_capacity(shared.policies.len());
    for key in shared.keys() {
        checks.clear();
        checks.extend(
            shared
                .policies
                .iter()
                .map(|p| Check::new(key, p).cost(shared.cost)),
        );
        let call = limiter
            .script_call(&checks, shared.opts)
            .map_err(|e| e.to_string())?;
        if template.is_none() {
            template = Some(Template {
                script: call.script,
                args: call.args,
            });
        }
        keys.push(call.keys);
    }
    let template = template.ok_or("no keys")?;
    // Load the script where the calls go (floodgate itself loads it on NOSCRIPT).
    let clients = match ranges {
        None => vec![args.redis.client().map_err(|e| e.to_string())?],
        Some(ranges) => masters(ranges)
            .into_iter()
            .map(|(host, port)| args.redis.node_client(&host, port))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?,
    };
    for client in clients {
        let load = async {
            let mut conn = client.get_multiplexed_async_connection().await?;
            template.script.load_async(&mut conn).await
        };
        match tokio::time::timeout(args.redis.connect_timeout + args.redis.timeout, load).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(format!("cannot load the check script: {e}")),
            Err(_) => return Err("loading the check script timed out".to_owned()),
        }
    }
    Ok((template, keys))
}

/// Where redis-benchmark can reach the server, if it can: a single node over plain TCP
/// without a password (it would need the password on its command line, visible to `ps`).
fn benchmark_target(redis: &RedisArgs, cluster: bool) -> Result<(String, u16, i64), String> {
    if cluster {
        return Err("not run on a cluster (its --cluster mode needs its own {tag} keys)".into());
    }
    let url = redis.client().map_err(|e| e.to_string())?;
    let info = url.get_connection_info().clone();
    let settings = info.redis_settings();
    if settings.password().is_some() {
        return Err(
            "not run: the server has a password, which redis-benchmark would take on its command \
             line"
                .into(),
        );
    }
    match info.addr() {
        ConnectionAddr::Tcp(host, port) => Ok((host.clone(), *port, settings.db())),
        _ => Err("not run: redis-benchmark is only used over plain TCP".into()),
    }
}

/// The `redis-benchmark` binary on PATH.
fn find_redis_benchmark() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join("redis-benchmark"))
        .find(|p| p.is_file())
}

async fn redis_benchmark(
    args: &BenchArgs,
    cluster: bool,
    template: Option<Template>,
    incr_rate: Option<f64>,
    evalsha_rate: Option<f64>,
    shared: &Shared,
) -> (Vec<Row>, bool) {
    let incr_name = format!("redis-benchmark INCR -P {}", args.pipeline);
    let evalsha_name = format!("redis-benchmark EVALSHA -P {}", args.pipeline);
    let skip_both = |why: String| {
        vec![
            Row::skipped(&incr_name, "redis_benchmark_incr", why.clone()),
            Row::skipped(&evalsha_name, "redis_benchmark_evalsha", why),
        ]
    };
    let (binary, (host, port, db)) = match redis_benchmark_setup(args, cluster) {
        Ok(found) => found,
        Err(why) => return (skip_both(why), false),
    };
    let rand_key = |key: Vec<u8>| String::from_utf8_lossy(&key).into_owned();
    let prefix = &args.redis.prefix;
    let requests = |rate: Option<f64>| benchmark_requests(args, rate);
    let mut rows = Vec::new();
    progress(args, &format!("baseline: {incr_name}..."));
    let incr_cmd = vec![
        "INCR".to_owned(),
        rand_key(incr_key(prefix, b"bench-__rand_int__")),
    ];
    let (row, stop) = run_redis_benchmark(
        args,
        &binary,
        (&host, port, db),
        requests(incr_rate),
        incr_cmd,
        &incr_name,
        "redis_benchmark_incr",
    )
    .await;
    rows.push(row);
    if stop {
        return (rows, true);
    }
    match template {
        None => rows.push(Row::skipped(
            &evalsha_name,
            "redis_benchmark_evalsha",
            "floodgate's script calls could not be prepared",
        )),
        Some(t) => {
            progress(args, &format!("baseline: {evalsha_name}..."));
            let mut cmd = vec![
                "EVALSHA".to_owned(),
                t.script.get_hash().to_owned(),
                shared.policies.len().to_string(),
            ];
            for p in &shared.policies {
                cmd.push(rand_key(shared.limiter.state_key(p, b"bench-__rand_int__")));
            }
            cmd.extend(
                t.args
                    .iter()
                    .map(|a| String::from_utf8_lossy(a).into_owned()),
            );
            let (row, stop) = run_redis_benchmark(
                args,
                &binary,
                (&host, port, db),
                requests(evalsha_rate),
                cmd,
                &evalsha_name,
                "redis_benchmark_evalsha",
            )
            .await;
            rows.push(row);
            if stop {
                return (rows, true);
            }
        }
    }
    (rows, false)
}

/// redis-benchmark's binary and where it can reach the server, or why it cannot run.
fn redis_benchmark_setup(
    args: &BenchArgs,
    cluster: bool,
) -> Result<(PathBuf, (String, u16, i64)), String> {
    let binary = find_redis_benchmark().ok_or("redis-benchmark is not on PATH")?;
    Ok((binary, benchmark_target(&args.redis, cluster)?))
}

/// Enough requests for about --duration at `rate`, the rate the same command reached
/// in-process (100k/s when unknown).
fn benchmark_requests(args: &BenchArgs, rate: Option<f64>) -> u64 {
    let rate = rate.unwrap_or(100_000.0);
    ((rate * args.duration.as_secs_f64()) as u64).max(1_000)
}

/// Reads `from` to its end in a thread of its own.
fn drain(mut from: impl std::io::Read + Send + 'static) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut all = Vec::new();
        let _ = from.read_to_end(&mut all);
        all
    })
}

/// Runs redis-benchmark once (`-q`, the command given), within 3 x --duration + 10 s.
async fn run_redis_benchmark(
    args: &BenchArgs,
    binary: &std::path::Path,
    (host, port, db): (&str, u16, i64),
    requests: u64,
    command: Vec<String>,
    name: &str,
    id: &'static str,
) -> (Row, bool) {
    let mut cmd = Command::new(binary);
    cmd.args(["-h", host])
        .args(["-p", &port.to_string()])
        .args(["--dbnum", &db.to_string()])
        .args(["-P", &args.pipeline.to_string()])
        .args(["-c", &args.concurrency.to_string()])
        .args(["-n", &requests.to_string()])
        .args(["-r", &args.keys.to_string()])
        .arg("-q")
        .args(&command)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            return (
                Row::skipped(name, id, format!("cannot start redis-benchmark: {e}")),
                false,
            );
        }
    };
    // Read while it runs: its progress lines (about 1 KiB a second) would fill a pipe read
    // only at the end (64 KiB), and it would block on them.
    let (stdout, stderr) = (
        child.stdout.take().map(drain),
        child.stderr.take().map(drain),
    );
    let limit = args.duration * 3 + Duration::from_secs(10);
    let started = Instant::now();
    let mut interrupted = false;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if started.elapsed() < limit => {
                if wait(Duration::from_millis(50)).await {
                    interrupted = true;
                    break None;
                }
            }
            _ => break None,
        }
    };
    let elapsed = started.elapsed();
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
        let why = if interrupted {
            "interrupted".to_owned()
        } else {
            format!("redis-benchmark did not finish within {limit:?}")
        };
        return (Row::skipped(name, id, why), interrupted);
    }
    // It has exited: the pipes end.
    let collected = |h: Option<std::thread::JoinHandle<Vec<u8>>>| {
        h.and_then(|h| h.join().ok()).unwrap_or_default()
    };
    let (stdout, stderr) = (collected(stdout), collected(stderr));
    let stdout = String::from_utf8_lossy(&stdout);
    let Some((rate, p50)) = parse_redis_benchmark(&stdout) else {
        let stderr = String::from_utf8_lossy(&stderr);
        let text = format!("{stdout}{stderr}");
        let last = text
            .split(['\r', '\n'])
            .rfind(|l| !l.trim().is_empty())
            .unwrap_or("no output");
        return (
            Row::skipped(
                name,
                id,
                format!("no figures from redis-benchmark: {}", last.trim()),
            ),
            false,
        );
    };
    let row = Row {
        name: name.to_owned(),
        id,
        ops: requests,
        ops_per_sec: rate,
        allowed: None,
        denied: None,
        errors: 0,
        elapsed_s: elapsed.as_secs_f64(),
        latency_of: format!(
            "request (p50 as redis-benchmark reports it; {} clients x {} pipelined)",
            args.concurrency, args.pipeline
        ),
        latency_ms: p50.map(|p50| Latency {
            p50: Some(p50),
            p90: None,
            p99: None,
            p99_9: None,
            max: None,
            mean: None,
        }),
        floodgate_ratio: None,
        first_error: None,
        skipped: None,
    };
    (row, false)
}

/// redis-benchmark -q's `<title>: 123456.78 requests per second, p50=0.123 msec`.
fn parse_redis_benchmark(out: &str) -> Option<(f64, Option<f64>)> {
    let line = out
        .split(['\r', '\n'])
        .rfind(|l| l.contains("requests per second"))?;
    let (before, after) = line.split_once(" requests per second")?;
    let rate = before.split_whitespace().last()?.parse().ok()?;
    let p50 = after
        .split_once("p50=")
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|v| v.parse().ok());
    Some((rate, p50))
}

/// Deletes the INCR baselines' keys: single-node `DEL`s of 1000 keys, or one `DEL` per slot
/// on a cluster.
async fn delete_keys(
    redis: &RedisArgs,
    cluster: bool,
    keys: &[Vec<u8>],
    picker: &Picker,
) -> Result<(), String> {
    on_keys(redis, cluster, keys, picker, |pipe, group| {
        pipe.cmd("DEL").arg(group);
        1
    })
    .await
}

/// Creates the INCR baselines' keys at 0, expiring after `ttl` (`INCR` keeps it): keys left by
/// a run that is killed (and cannot delete them) go away by themselves.
async fn create_expiring(
    redis: &RedisArgs,
    cluster: bool,
    keys: &[Vec<u8>],
    picker: &Picker,
    ttl: Duration,
) -> Result<(), String> {
    let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
    on_keys(redis, cluster, keys, picker, |pipe, group| {
        for k in group {
            pipe.cmd("SET").arg(*k).arg(0).arg("PX").arg(ms);
        }
        group.len()
    })
    .await
}

/// Sends, for each group of `keys` (1000 keys, or one slot's on a cluster), the commands `add`
/// puts in a pipeline (it says how many).
async fn on_keys(
    redis: &RedisArgs,
    cluster: bool,
    keys: &[Vec<u8>],
    picker: &Picker,
    add: impl Fn(&mut redis::Pipeline, &[&[u8]]) -> usize,
) -> Result<(), String> {
    if keys.is_empty() {
        return Ok(());
    }
    let groups: Vec<Vec<&[u8]>> = match &picker.slots {
        Some((_, by_slot)) => by_slot
            .iter()
            .filter(|g| !g.is_empty())
            .map(|g| g.iter().map(|&i| keys[i as usize].as_slice()).collect())
            .collect(),
        None => keys
            .chunks(1000)
            .map(|c| c.iter().map(Vec::as_slice).collect())
            .collect(),
    };
    let conn = base_conn(redis, cluster).await?;
    let results: Vec<Result<(), String>> = stream::iter(groups)
        .map(|group| {
            let mut conn = conn.clone();
            let mut pipe = redis::pipe();
            let count = add(&mut pipe, &group);
            async move {
                conn.send(&pipe, count)
                    .await
                    .map(drop)
                    .map_err(|e| e.to_string())
            }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    results.into_iter().collect()
}

/// The table printed without --json.
fn table(r: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "floodgate bench: {} ({}), cost {}, on {} ({}; batching {})",
        r.policies.join(" + "),
        r.algorithm,
        r.cost,
        r.redis,
        r.connection,
        r.batching
    );
    let _ = writeln!(
        out,
        "{} tasks, {} keys, {} worker thread{}; each row {:.1}s after {:.1}s warm-up{}",
        r.concurrency,
        r.keys,
        r.threads,
        if r.threads == 1 { "" } else { "s" },
        r.duration_s,
        r.warmup_s,
        if r.interrupted { " (interrupted)" } else { "" }
    );
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:<34} {:>12} {:>10} {:>10} {:>7} {:>8} {:>8} {:>8} {:>8} {:>8} {:>11}",
        "",
        "ops/s",
        "allowed",
        "denied",
        "errors",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "p99.9 ms",
        "max ms",
        "floodgate/x"
    );
    let ms = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.3}"));
    let count = |v: Option<u64>| v.map_or_else(|| "-".to_owned(), |v| v.to_string());
    let mut notes = Vec::new();
    for row in std::iter::once(&r.floodgate).chain(&r.baselines) {
        if let Some(why) = &row.skipped {
            let _ = writeln!(out, "{:<34} skipped: {why}", row.name);
            continue;
        }
        let l = row.latency_ms.as_ref();
        let _ = writeln!(
            out,
            "{:<34} {:>12.0} {:>10} {:>10} {:>7} {:>8} {:>8} {:>8} {:>8} {:>8} {:>11}",
            row.name,
            row.ops_per_sec,
            count(row.allowed),
            count(row.denied),
            row.errors,
            ms(l.and_then(|l| l.p50)),
            ms(l.and_then(|l| l.p90)),
            ms(l.and_then(|l| l.p99)),
            ms(l.and_then(|l| l.p99_9)),
            ms(l.and_then(|l| l.max)),
            row.floodgate_ratio
                .map_or_else(|| "-".to_owned(), |x| format!("{x:.2}")),
        );
        if row.id != "floodgate" {
            notes.push(format!("{}: latency per {}", row.name, row.latency_of));
        }
        if let Some(e) = &row.first_error {
            notes.push(format!("{}: first error: {e}", row.name));
        }
    }
    if !r.ratios.is_empty() {
        let _ = writeln!(out);
        let ratio = |id: &str| {
            r.ratios
                .get(&format!("floodgate_per_{id}"))
                .and_then(serde_json::Value::as_f64)
        };
        let mut parts = Vec::new();
        for (label, id) in [
            ("floodgate/evalsha", "evalsha_pipelined"),
            ("floodgate/incr", "incr_pipelined"),
            (
                "floodgate/redis-benchmark evalsha",
                "redis_benchmark_evalsha",
            ),
            ("floodgate/redis-benchmark incr", "redis_benchmark_incr"),
            ("floodgate/redis-cell", "cell_pipelined"),
            (
                "floodgate/redis-benchmark redis-cell",
                "redis_benchmark_cell",
            ),
        ] {
            if let Some(x) = ratio(id) {
                parts.push(format!("{label} = {x:.2}"));
            }
        }
        let _ = writeln!(out, "ratios: {}", parts.join(", "));
    }
    if !notes.is_empty() {
        let _ = writeln!(out);
        for n in notes {
            let _ = writeln!(out, "note: {n}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn cell_params_take_the_same_burst_and_rate_or_say_why_not() {
        let p = |r: Result<Policy, floodgate_core::PolicyError>| r.expect("valid");
        let of = |policies: &[Policy]| CellParams::of(policies);
        assert_eq!(
            of(&[p(Policy::gcra(9, 10, Duration::from_secs(1)))]),
            Ok(CellParams {
                max_burst: 9,
                count: 10,
                period_s: 1
            })
        );
        // redis-cell's README example: 15 burst, 30 per 60 s is one per 2 s.
        assert_eq!(
            of(&[p(Policy::gcra(15, 30, Duration::from_secs(60)))]),
            Ok(CellParams {
                max_burst: 15,
                count: 1,
                period_s: 2
            })
        );
        // 10 per 3 s: one per 300 ms.
        assert_eq!(
            of(&[p(Policy::gcra(4, 10, Duration::from_secs(3)))]),
            Ok(CellParams {
                max_burst: 4,
                count: 10,
                period_s: 3
            })
        );
        let why = of(&[p(Policy::gcra(4, 3, Duration::from_secs(7)))]).expect_err("not whole");
        assert!(why.contains("whole seconds"), "{why}");
        let why = of(&[p(Policy::sliding_log(10, Duration::from_secs(1)))]).expect_err("log");
        assert!(why.contains("GCRA only"), "{why}");
        let two = [
            p(Policy::per_second(10)),
            p(Policy::per(100, Duration::from_secs(60))),
        ];
        assert!(of(&two).is_err());
    }

    #[test]
    fn redis_benchmark_output_parses() {
        let out = "INCR x: rps=0.0 (overall: nan) avg_msec=nan\r\
                   INCR floodgate:bench-incr:{bench-__rand_int__}: 123456.79 requests per second, p50=0.183 msec\n";
        assert_eq!(parse_redis_benchmark(out), Some((123_456.79, Some(0.183))));
        assert_eq!(parse_redis_benchmark("ERR"), None);
    }

    #[test]
    fn user_keys_are_bench_and_at_least_twelve_digits() {
        assert_eq!(user_key(0), "bench-000000000000");
        assert_eq!(user_key(42), "bench-000000000042");
        assert_eq!(user_key(999_999_999_999), "bench-999999999999");
        assert_eq!(user_key(1_000_000_000_000), "bench-1000000000000");
        assert_eq!(user_key(usize::MAX), format!("bench-{}", usize::MAX));
    }

    #[test]
    fn picker_keeps_pipelines_in_one_slot() {
        let keys: Vec<Vec<u8>> = (0..5000)
            .map(|i| format!("fg:gcra:p:{{{}}}", user_key(i)).into_bytes())
            .collect();
        let picker = Picker::new(&keys, true);
        let mut rng = fastrand::Rng::with_seed(7);
        let mut out = Vec::new();
        for _ in 0..100 {
            picker.fill(&mut rng, &mut out, 16);
            assert_eq!(out.len(), 16);
            let slot = key_slot(&keys[out[0]]);
            assert!(out.iter().all(|&i| key_slot(&keys[i]) == slot));
        }
        let plain = Picker::new(&keys, false);
        plain.fill(&mut rng, &mut out, 16);
        assert_eq!(out.len(), 16);
    }
}
