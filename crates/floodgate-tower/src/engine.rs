//! The decision engine: keys to checks, checks to a verdict (with delay mode and the failure
//! policy), the verdict to headers, a rejection, or a lease. Generic over the limiter, and
//! type-erased behind [`DynEngine`] so that the layer and service are not.

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use floodgate_core::{Check, CheckOptions, Kind, LeaseId, Limiter, MemoryLimiter, Verdict};
use http::{HeaderValue, Response};
use smallvec::SmallVec;
use tracing::Instrument as _;

use crate::headers::{self, HeaderBlock, HeaderOptions, ceil_secs};
use crate::health::StoreHealth;
use crate::info::{DecisionSource, RateLimitInfo};
use crate::key::{Extracted, Key, KeyError, KeyFuture, RequestView};
use crate::layer::{MAX_DELAY_ATTEMPTS, Mode, OnMissingKey};
use crate::rejection::{Rejection, RejectionHandler, RejectionKind};
use crate::rule::RuleEntry;
use crate::telemetry::{Escaped, LayerMetrics, Outcome};

pub(crate) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The layer's configuration, shared by every service and clone.
pub(crate) struct Shared {
    pub(crate) table: Arc<[RuleEntry]>,
    pub(crate) mode: Mode,
    pub(crate) on_missing_key: OnMissingKey,
    pub(crate) fallback: Option<MemoryLimiter>,
    pub(crate) fail_closed: bool,
    pub(crate) timeout: Duration,
    pub(crate) headers: HeaderOptions,
    pub(crate) handler: Arc<dyn RejectionHandler>,
    pub(crate) request_info: bool,
    pub(crate) max_key_len: usize,
    pub(crate) health: StoreHealth,
    pub(crate) metrics: LayerMetrics,
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared")
            .field(
                "rules",
                &self.table.iter().map(|e| &e.rule).collect::<Vec<_>>(),
            )
            .field("mode", &self.mode)
            .field("on_missing_key", &self.on_missing_key)
            .field("fallback", &self.fallback.is_some())
            .field("fail_closed", &self.fail_closed)
            .field("timeout", &self.timeout)
            .field("headers", &self.headers)
            .field("request_info", &self.request_info)
            .field("max_key_len", &self.max_key_len)
            .field("health", &self.health)
            .finish()
    }
}

/// One request's work for the engine.
#[derive(Default)]
pub(crate) struct Job {
    checks: Checks,
    /// Keys still being found, by position in `checks.rules`.
    pending: SmallVec<[(usize, KeyFuture); 1]>,
}

/// The checks of one request.
#[derive(Default)]
struct Checks {
    rules: SmallVec<[usize; 4]>,
    keys: SmallVec<[Key; 4]>,
    costs: SmallVec<[u64; 4]>,
    grpc: bool,
}

impl Checks {
    fn push(&mut self, rule: usize, key: Key, cost: u64) {
        self.rules.push(rule);
        self.keys.push(key);
        self.costs.push(cost);
    }

    fn remove(&mut self, pos: usize) {
        self.rules.remove(pos);
        self.keys.remove(pos);
        self.costs.remove(pos);
    }
}

/// What `call` found before asking the limiter.
// Moved once per request; boxing the big variant would cost an allocation instead.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Prepared {
    /// No rule applies.
    Skip,
    /// Turned away already (no key).
    Reject(Response<Bytes>),
    /// Ask the limiter.
    Decide(Job),
}

/// The engine's answer.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Decided {
    Allow(Allowed),
    Reject(Response<Bytes>),
}

/// What an allowed request carries on.
#[derive(Default)]
pub(crate) struct Allowed {
    pub(crate) info: Option<RateLimitInfo>,
    pub(crate) headers: HeaderBlock,
    pub(crate) lease: Option<LeaseGuard>,
}

/// A concurrency lease to give back.
pub(crate) struct LeaseJob {
    rules: SmallVec<[usize; 2]>,
    keys: SmallVec<[Key; 2]>,
    lease: LeaseId,
    fallback: bool,
}

/// Releases its lease when dropped: at the end of the response body, or when the response (or
/// the request, on error) is dropped.
pub(crate) struct LeaseGuard {
    engine: Arc<dyn DynEngine>,
    job: Option<LeaseJob>,
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        if let Some(job) = self.job.take() {
            Arc::clone(&self.engine).release(job);
        }
    }
}

impl fmt::Debug for LeaseGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseGuard")
            .field("lease", &self.job.as_ref().map(|j| j.lease))
            .finish()
    }
}

/// The engine, with its limiter type erased.
pub(crate) trait DynEngine: Send + Sync + 'static {
    fn shared(&self) -> &Shared;
    fn decide(self: Arc<Self>, job: Job) -> BoxFuture<Decided>;
    /// Decides without a future when the limiter allows it; gives the job back otherwise.
    // Both variants move once per request; boxing would cost the allocation this avoids.
    #[allow(clippy::result_large_err)]
    fn decide_now(&self, this: &Arc<dyn DynEngine>, job: Job) -> Result<Decided, Job>;
    fn release(self: Arc<Self>, job: LeaseJob);
}

pub(crate) struct Engine<L> {
    limiter: L,
    shared: Shared,
}

impl<L> Engine<L> {
    pub(crate) fn new(limiter: L, shared: Shared) -> Self {
        Engine { limiter, shared }
    }
}

/// Finds the rules that apply to `req` and their keys.
pub(crate) fn prepare(sh: &Shared, req: &RequestView<'_>) -> Prepared {
    let mut job = Job::default();
    for (i, entry) in sh.table.iter().enumerate() {
        let rule = &entry.rule;
        if !rule.applies_to(req) {
            continue;
        }
        let cost = rule.cost_of(req);
        match rule.key.extract(req) {
            Extracted::Ready(key) => match key.and_then(|k| sh.check_len(k)) {
                Ok(key) => job.checks.push(i, key, cost),
                Err(e) => match sh.missing_key(entry, &e) {
                    Some(OnMissingKey::UseKey(key)) => job.checks.push(i, key.clone(), cost),
                    Some(_) => {
                        return Prepared::Reject(sh.reject_missing(entry, &e, req.is_grpc()));
                    }
                    None => {}
                },
            },
            Extracted::Pending(fut) => {
                job.pending.push((job.checks.rules.len(), fut));
                job.checks.push(i, Key::default(), cost);
            }
        }
    }
    if job.checks.rules.is_empty() {
        return Prepared::Skip;
    }
    job.checks.grpc = req.is_grpc();
    Prepared::Decide(job)
}

impl Shared {
    fn check_len(&self, key: Key) -> Result<Key, KeyError> {
        if key.len() > self.max_key_len {
            return Err(KeyError::TooLong {
                len: key.len(),
                max: self.max_key_len,
            });
        }
        Ok(key)
    }

    /// `None`: let the request through this rule; `Some(UseKey)`: count under that key;
    /// `Some(Reject)`: turn it away.
    fn missing_key<'a>(&'a self, entry: &'a RuleEntry, e: &KeyError) -> Option<&'a OnMissingKey> {
        let action = entry
            .rule
            .on_missing_key
            .as_ref()
            .unwrap_or(&self.on_missing_key);
        tracing::debug!(
            target: "floodgate",
            policy = entry.rule.policy().name(),
            error = %e,
            "no rate-limit key"
        );
        match action {
            OnMissingKey::Allow => None,
            other => Some(other),
        }
    }

    fn reject_missing(&self, entry: &RuleEntry, e: &KeyError, grpc: bool) -> Response<Bytes> {
        entry
            .metrics
            .count(entry.rule.policy().name(), Outcome::Denied);
        self.handler.rejection(&Rejection {
            kind: RejectionKind::MissingKey,
            grpc,
            info: None,
            key_error: Some(e),
            policy: Some(entry.rule.policy()),
            retry_after: None,
        })
    }

    fn render(&self, info: &RateLimitInfo, out: &mut HeaderBlock) {
        if !(self.headers.ietf || self.headers.legacy) || info.decisions.is_empty() {
            return;
        }
        let items = info
            .rules
            .iter()
            .zip(&info.decisions)
            .map(|(&i, d)| (self.table[i].rule.policy(), &self.table[i].policy_item, d));
        headers::render(self.headers, items, info.strictest().map(|(_, d)| d), out);
    }

    fn reject_limited(&self, info: &RateLimitInfo, grpc: bool) -> Response<Bytes> {
        let strictest = info.strictest();
        let retry_after = strictest.and_then(|(_, d)| d.retry_after);
        let mut res = self.handler.rejection(&Rejection {
            kind: RejectionKind::Limited,
            grpc,
            info: Some(info),
            key_error: None,
            policy: strictest.map(|(p, _)| p),
            retry_after,
        });
        if let Some(retry) = retry_after {
            res.headers_mut()
                .entry(http::header::RETRY_AFTER)
                .or_insert_with(|| HeaderValue::from(ceil_secs(retry)));
        }
        let mut block = HeaderBlock::new();
        self.render(info, &mut block);
        headers::apply(block, res.headers_mut());
        res
    }

    fn reject_unavailable(&self, grpc: bool) -> Response<Bytes> {
        let retry = self.health.retry_interval().max(Duration::from_secs(1));
        let mut res = self.handler.rejection(&Rejection {
            kind: RejectionKind::StoreUnavailable,
            grpc,
            info: None,
            key_error: None,
            policy: None,
            retry_after: Some(retry),
        });
        res.headers_mut()
            .entry(http::header::RETRY_AFTER)
            .or_insert_with(|| HeaderValue::from(ceil_secs(retry)));
        res
    }
}

/// A verdict and where it came from.
struct Verdicted {
    verdict: Verdict,
    source: DecisionSource,
    waited: Duration,
}

impl<L> Engine<L>
where
    L: Limiter + Clone + 'static,
{
    async fn run(self: Arc<Self>, job: Job) -> Decided {
        let sh = &self.shared;
        let Job {
            checks: mut job,
            pending,
        } = job;
        if !pending.is_empty() {
            let mut skipped: SmallVec<[usize; 2]> = SmallVec::new();
            for (pos, fut) in pending {
                match fut.await.and_then(|k| sh.check_len(k)) {
                    Ok(key) => job.keys[pos] = key,
                    Err(e) => {
                        let entry = &sh.table[job.rules[pos]];
                        match sh.missing_key(entry, &e) {
                            Some(OnMissingKey::UseKey(key)) => job.keys[pos] = key.clone(),
                            Some(_) => {
                                return Decided::Reject(sh.reject_missing(entry, &e, job.grpc));
                            }
                            None => skipped.push(pos),
                        }
                    }
                }
            }
            for &pos in skipped.iter().rev() {
                job.remove(pos);
            }
            if job.rules.is_empty() {
                return Decided::Allow(Allowed::default());
            }
        }

        let span = self.span(&job);
        let result = self.verdict(&job).instrument(span.clone()).await;
        let this = Arc::clone(&self) as Arc<dyn DynEngine>;
        self.conclude(&this, job, result, &span)
    }

    /// The `floodgate.check` span of `job` (fields filled only when it is enabled).
    fn span(&self, job: &Checks) -> tracing::Span {
        let span = tracing::debug_span!(
            target: "floodgate",
            "floodgate.check",
            key = tracing::field::Empty,
            policy = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        if !span.is_disabled() {
            span.record(
                "key",
                tracing::field::display(Escaped::new(job.keys[0].as_bytes())),
            );
            span.record(
                "policy",
                self.shared.table[job.rules[0]].rule.policy().name(),
            );
        }
        span
    }

    /// Turns a verdict (or its absence) into the answer: metrics, info, headers, lease,
    /// rejection.
    fn conclude(
        &self,
        this: &Arc<dyn DynEngine>,
        mut job: Checks,
        result: Option<Verdicted>,
        span: &tracing::Span,
    ) -> Decided {
        let sh = &self.shared;
        let Some(Verdicted {
            verdict,
            source,
            waited,
        }) = result
        else {
            let entry = &sh.table[job.rules[0]];
            entry
                .metrics
                .count(entry.rule.policy().name(), Outcome::Error);
            span.record("outcome", "error");
            if sh.fail_closed {
                return Decided::Reject(sh.reject_unavailable(job.grpc));
            }
            let info = RateLimitInfo {
                table: Arc::clone(&sh.table),
                rules: job.rules,
                decisions: SmallVec::new(),
                strictest: None,
                source: DecisionSource::FailOpen,
                waited: Duration::ZERO,
            };
            return Decided::Allow(Allowed {
                info: sh.request_info.then_some(info),
                headers: HeaderBlock::new(),
                lease: None,
            });
        };

        let allowed = verdict.allowed();
        let strictest = verdict.strictest().map(|(i, _)| i);
        let lease = verdict.lease;
        let outcome = match (source, allowed) {
            (DecisionSource::Fallback, _) => Outcome::Fallback,
            (_, true) => Outcome::Allowed,
            (_, false) => Outcome::Denied,
        };
        let counted = &sh.table[job.rules[strictest.unwrap_or(0)]];
        counted.metrics.count(counted.rule.policy().name(), outcome);
        span.record("outcome", if allowed { "allowed" } else { "denied" });

        let lease = lease.filter(|_| allowed).map(|lease| {
            let mut rules = SmallVec::new();
            let mut keys = SmallVec::new();
            for (pos, &i) in job.rules.iter().enumerate() {
                if matches!(sh.table[i].rule.policy().kind(), Kind::Concurrency(_)) {
                    rules.push(i);
                    keys.push(std::mem::take(&mut job.keys[pos]));
                }
            }
            LeaseGuard {
                engine: Arc::clone(this),
                job: Some(LeaseJob {
                    rules,
                    keys,
                    lease,
                    fallback: source == DecisionSource::Fallback,
                }),
            }
        });
        let info = RateLimitInfo {
            table: Arc::clone(&sh.table),
            rules: job.rules,
            decisions: verdict.decisions,
            strictest,
            source,
            waited,
        };
        if !allowed {
            return Decided::Reject(sh.reject_limited(&info, job.grpc));
        }
        let mut headers = HeaderBlock::new();
        sh.render(&info, &mut headers);
        Decided::Allow(Allowed {
            info: sh.request_info.then_some(info),
            headers,
            lease,
        })
    }

    /// The verdict of `job`, waiting in delay mode; `None` when neither the store nor a
    /// fallback could decide.
    async fn verdict(&self, job: &Checks) -> Option<Verdicted> {
        let sh = &self.shared;
        let checks = sh.checks(job);
        let max_wait = match sh.mode {
            Mode::Reject => Duration::ZERO,
            Mode::Delay { max_wait } => max_wait,
        };
        let shaper = checks
            .iter()
            .any(|c| matches!(c.policy.kind(), Kind::Shaper(_)));
        let started = (!max_wait.is_zero()).then(Instant::now);
        let mut attempts = 0;
        loop {
            let budget = started.map_or(Duration::ZERO, |s| max_wait.saturating_sub(s.elapsed()));
            let opts = if shaper {
                CheckOptions::wait(budget)
            } else {
                CheckOptions::default()
            };
            let (verdict, source) = self.check_once(&checks, opts).await?;
            let waited = || started.map_or(Duration::ZERO, |s| s.elapsed());
            if verdict.allowed() {
                if !verdict.wait.is_zero() {
                    tokio::time::sleep(verdict.wait).await;
                }
                return Some(Verdicted {
                    verdict,
                    source,
                    waited: waited(),
                });
            }
            attempts += 1;
            let retry = verdict.strictest().and_then(|(_, d)| d.retry_after);
            match retry {
                Some(retry) if attempts < MAX_DELAY_ATTEMPTS && retry <= budget => {
                    tokio::time::sleep(retry).await;
                }
                _ => {
                    return Some(Verdicted {
                        verdict,
                        source,
                        waited: waited(),
                    });
                }
            }
        }
    }

    /// One decision: the store, unless it is failing; then the fallback.
    async fn check_once(
        &self,
        checks: &[Check<'_>],
        opts: CheckOptions,
    ) -> Option<(Verdict, DecisionSource)> {
        let sh = &self.shared;
        if !sh.health.skip_store() {
            let started = Instant::now();
            let result = timeout_unless_ready(sh.timeout, self.limiter.check(checks, opts)).await;
            sh.metrics.check_duration(started.elapsed().as_secs_f64());
            match result {
                Some(Ok(verdict)) => {
                    sh.health.succeeded();
                    return Some((verdict, DecisionSource::Store));
                }
                Some(Err(e)) => {
                    sh.metrics.store_error(false);
                    if L::is_unavailable(&e) {
                        sh.health.failed(&e);
                    } else {
                        // One key's problem (a corrupted value): this request gets the failure
                        // policy; every other key keeps asking the store.
                        tracing::warn!(error = %e, "rate-limit check failed for this request");
                    }
                }
                None => {
                    sh.metrics.store_error(true);
                    sh.health.failed(&format_args!(
                        "no decision within the layer's timeout of {:?}",
                        sh.timeout
                    ));
                }
            }
        }
        sh.fallback_check(checks, opts)
    }

    /// The in-memory limiter decides synchronously: no future, no box, no clone of the inner
    /// service. `None` for any other limiter, in delay mode, or with keys still pending.
    #[allow(clippy::result_large_err)]
    fn decide_sync(&self, this: &Arc<dyn DynEngine>, job: Job) -> Result<Decided, Job> {
        if !job.pending.is_empty() || self.shared.mode != Mode::Reject {
            return Err(job);
        }
        let Some(memory) = (&self.limiter as &dyn Any).downcast_ref::<MemoryLimiter>() else {
            return Err(job);
        };
        let sh = &self.shared;
        let job = job.checks;
        let span = self.span(&job);
        let result = span.in_scope(|| {
            let checks = sh.checks(&job);
            if !sh.health.skip_store() {
                let started = Instant::now();
                let result = memory.check_sync(&checks, CheckOptions::default());
                sh.metrics.check_duration(started.elapsed().as_secs_f64());
                match result {
                    Ok(verdict) => {
                        sh.health.succeeded();
                        return Some((verdict, DecisionSource::Store));
                    }
                    Err(e) => {
                        // The memory store is never down: its errors are this request's.
                        sh.metrics.store_error(false);
                        tracing::warn!(error = %e, "rate-limit check failed for this request");
                    }
                }
            }
            sh.fallback_check(&checks, CheckOptions::default())
        });
        let result = result.map(|(verdict, source)| Verdicted {
            verdict,
            source,
            waited: Duration::ZERO,
        });
        Ok(self.conclude(this, job, result, &span))
    }
}

impl Shared {
    fn checks<'a>(&'a self, job: &'a Checks) -> SmallVec<[Check<'a>; 4]> {
        job.rules
            .iter()
            .zip(&job.keys)
            .zip(&job.costs)
            .map(|((&i, key), &cost)| {
                Check::new(key.as_bytes(), self.table[i].rule.policy()).cost(cost)
            })
            .collect()
    }

    fn fallback_check(
        &self,
        checks: &[Check<'_>],
        opts: CheckOptions,
    ) -> Option<(Verdict, DecisionSource)> {
        let fallback = self.fallback.as_ref()?;
        match fallback.check_sync(checks, opts) {
            Ok(verdict) => Some((verdict, DecisionSource::Fallback)),
            Err(e) => {
                tracing::debug!(target: "floodgate", error = %e, "the local fallback failed too");
                None
            }
        }
    }
}

impl<L> DynEngine for Engine<L>
where
    L: Limiter + Clone + 'static,
{
    fn shared(&self) -> &Shared {
        &self.shared
    }

    fn decide(self: Arc<Self>, job: Job) -> BoxFuture<Decided> {
        Box::pin(self.run(job))
    }

    #[allow(clippy::result_large_err)]
    fn decide_now(&self, this: &Arc<dyn DynEngine>, job: Job) -> Result<Decided, Job> {
        self.decide_sync(this, job)
    }

    fn release(self: Arc<Self>, job: LeaseJob) {
        if job.fallback {
            if let Some(fallback) = &self.shared.fallback {
                let checks = lease_checks(&self.shared, &job);
                fallback.release_sync(&checks, job.lease);
            }
            return;
        }
        let mut fut: BoxFuture<()> = Box::pin(async move {
            let sh = &self.shared;
            let checks = lease_checks(sh, &job);
            match timeout_unless_ready(sh.timeout, self.limiter.release(&checks, job.lease)).await {
                Some(Ok(())) => {}
                Some(Err(e)) => tracing::debug!(
                    target: "floodgate",
                    error = %e,
                    "could not release a concurrency lease; it lapses after its TTL"
                ),
                None => tracing::debug!(
                    target: "floodgate",
                    "releasing a concurrency lease timed out; it lapses after its TTL"
                ),
            }
        });
        // In-memory releases finish at once; only a store that does I/O needs a task.
        if fut
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
            .is_ready()
        {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn(fut);
            }
            Err(_) => tracing::debug!(
                target: "floodgate",
                "no Tokio runtime to release a concurrency lease; it lapses after its TTL"
            ),
        }
    }
}

fn lease_checks<'a>(sh: &'a Shared, job: &'a LeaseJob) -> SmallVec<[Check<'a>; 2]> {
    job.rules
        .iter()
        .zip(&job.keys)
        .map(|(&i, key)| Check::new(key.as_bytes(), sh.table[i].rule.policy()))
        .collect()
}

/// Awaits `fut` for at most `timeout`; a future that is ready at once (the in-memory limiter)
/// does not touch the timer.
async fn timeout_unless_ready<F: Future>(timeout: Duration, fut: F) -> Option<F::Output> {
    let mut fut = pin!(fut);
    let first = std::future::poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await;
    match first {
        Poll::Ready(out) => Some(out),
        Poll::Pending => tokio::time::timeout(timeout, fut).await.ok(),
    }
}
