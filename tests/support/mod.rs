//! Shared machinery of the chaos suite (`tests/chaos*.rs`): bounded runtimes, a panic counter,
//! a load generator that records every call, latency statistics, and the `FIGURE:` lines that
//! `docs/failure-modes.md` quotes.
//!
//! Every load loop here is bounded three ways: a stop flag, a hard deadline, and a maximum
//! number of calls per task. All traffic goes to servers on 127.0.0.1.

#![allow(dead_code, unreachable_pub, unused_imports)]

pub mod http;

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Once};
use std::time::Duration;

pub use floodgate_testkit::{cluster, server};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Panics seen in this process (any thread, any task) since [`run`] installed the hook.
static PANICS: AtomicUsize = AtomicUsize::new(0);
static HOOK: Once = Once::new();

/// Runs an async test on a two-thread runtime (the machine has two cores), bounded in time,
/// with a panic hook that counts every panic, also those inside spawned tasks.
pub fn run<F: Future>(limit: Duration, test: F) -> F::Output {
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            previous(info);
        }));
    });
    floodgate_testkit::run(limit, test)
}

/// How many panics happened so far (see [`run`]).
pub fn panics() -> usize {
    PANICS.load(Ordering::SeqCst)
}

/// Runs a blocking fault injection (kill, pause, restart...) without stalling the runtime's
/// other worker, and returns when it is done.
pub fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

// ---- figures -------------------------------------------------------------------------------

/// Prints one measured figure as `FIGURE: <name> = <value>`, the form docs/failure-modes.md
/// quotes (`cargo nextest run ... --no-capture | grep FIGURE:`).
pub fn figure(name: &str, value: impl fmt::Display) {
    println!("FIGURE: {name} = {value}");
}

/// Milliseconds with one decimal.
pub fn ms(d: Duration) -> String {
    format!("{:.1}ms", d.as_secs_f64() * 1000.0)
}

/// Latency percentiles of a set of calls.
#[derive(Debug, Clone, Copy, Default)]
pub struct Latencies {
    pub count: usize,
    pub p50: Duration,
    pub p90: Duration,
    pub p99: Duration,
    pub max: Duration,
}

impl Latencies {
    pub fn of(mut latencies: Vec<Duration>) -> Self {
        if latencies.is_empty() {
            return Self::default();
        }
        latencies.sort_unstable();
        let at = |p: f64| {
            let rank = ((latencies.len() as f64) * p).ceil() as usize;
            latencies[rank.clamp(1, latencies.len()) - 1]
        };
        Latencies {
            count: latencies.len(),
            p50: at(0.50),
            p90: at(0.90),
            p99: at(0.99),
            max: latencies[latencies.len() - 1],
        }
    }

    /// Prints `<name>.{count,p50,p99,max}`.
    pub fn print(&self, name: &str) {
        figure(&format!("{name}.count"), self.count);
        figure(&format!("{name}.p50"), ms(self.p50));
        figure(&format!("{name}.p90"), ms(self.p90));
        figure(&format!("{name}.p99"), ms(self.p99));
        figure(&format!("{name}.max"), ms(self.max));
    }
}

impl fmt::Display for Latencies {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "n={} p50={} p90={} p99={} max={}",
            self.count,
            ms(self.p50),
            ms(self.p90),
            ms(self.p99),
            ms(self.max)
        )
    }
}

// ---- load ------------------------------------------------------------------------------------

/// One call made by the load generator: which task, when it started and ended (since the
/// load's epoch), and what it returned.
#[derive(Debug, Clone)]
pub struct Sample<O> {
    pub task: usize,
    pub start: Duration,
    pub end: Duration,
    pub outcome: O,
}

impl<O> Sample<O> {
    pub fn latency(&self) -> Duration {
        self.end.saturating_sub(self.start)
    }

    /// Started at or after `from` and ended at or before `to` (both since the epoch).
    pub fn within(&self, from: Duration, to: Duration) -> bool {
        self.start >= from && self.end <= to
    }
}

/// How a load runs.
#[derive(Debug, Clone, Copy)]
pub struct LoadSpec {
    /// Concurrent tasks.
    pub tasks: usize,
    /// Each task starts a call at most this often (a call that takes longer starts the next
    /// one at once).
    pub pace: Duration,
    /// Hard bound on the load's life, whatever the test does.
    pub max_duration: Duration,
    /// Hard bound on the calls of one task.
    pub max_calls_per_task: usize,
}

/// A running load: `tasks` tasks calling `f(task, seq)` in a paced loop and recording each
/// call, until [`Load::stop`], the deadline, or the call budget.
pub struct Load<O> {
    epoch: Instant,
    stop: Arc<AtomicBool>,
    handles: Vec<JoinHandle<Vec<Sample<O>>>>,
}

impl<O: Send + 'static> Load<O> {
    pub fn start<F, Fut>(epoch: Instant, spec: LoadSpec, f: F) -> Self
    where
        F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = O> + Send + 'static,
    {
        let stop = Arc::new(AtomicBool::new(false));
        let f = Arc::new(f);
        let deadline = Instant::now() + spec.max_duration;
        let handles = (0..spec.tasks)
            .map(|task| {
                let (stop, f) = (Arc::clone(&stop), Arc::clone(&f));
                tokio::spawn(async move {
                    let mut samples = Vec::new();
                    for seq in 0..spec.max_calls_per_task as u64 {
                        let began = Instant::now();
                        if stop.load(Ordering::Relaxed) || began >= deadline {
                            break;
                        }
                        let outcome = f(task, seq).await;
                        let ended = Instant::now();
                        samples.push(Sample {
                            task,
                            start: began - epoch,
                            end: ended - epoch,
                            outcome,
                        });
                        tokio::time::sleep_until((began + spec.pace).min(deadline)).await;
                    }
                    samples
                })
            })
            .collect();
        Load {
            epoch,
            stop,
            handles,
        }
    }

    /// Stops every task after its current call and returns all samples, ordered by start.
    pub async fn stop(self) -> Vec<Sample<O>> {
        self.stop.store(true, Ordering::Relaxed);
        let mut all = Vec::new();
        for handle in self.handles {
            all.extend(handle.await.expect("a load task panicked"));
        }
        all.sort_by_key(|s| s.start);
        all
    }

    /// Time since the load's epoch.
    pub fn now(&self) -> Duration {
        self.epoch.elapsed()
    }
}

impl<O> fmt::Debug for Load<O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Load")
            .field("tasks", &self.handles.len())
            .finish_non_exhaustive()
    }
}

/// Polls `probe` every `every` until it returns true or `limit` passes; returns how long it
/// took, or `None` on timeout.
pub async fn wait_until<F, Fut>(limit: Duration, every: Duration, mut probe: F) -> Option<Duration>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let started = Instant::now();
    let deadline = started + limit;
    loop {
        if probe().await {
            return Some(started.elapsed());
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(every).await;
    }
}
