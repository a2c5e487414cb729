//! The decision engine: keys to checks, checks to a verdict (with delay mode and the failure
//! policy), the verdict to headers, a rejection, or a lease. Generic over the limiter, and
//! type-erased behind [`DynEngine`] so that the layer and service are not.

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use floodgate_core::{
    CacheStats, Check, CheckOptions, Decision, Kind, LeaseClock, LeaseId, Limiter, MemoryLimiter,
    Verdict,
};
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use smallvec::SmallVec;
use tracing::Instrument as _;

use crate::headers::{self, HeaderBlock, HeaderOptions, ceil_secs};
use crate::health::{Admit, StoreHealth};
use crate::info::{DecisionSource, RateLimitInfo, RuleIds};
use crate::key::{Extracted, Key, KeyError, KeyFuture, RequestView};
use crate::layer::{MAX_DELAY_ATTEMPTS, Mode, OnMissingKey};
use crate::lease::Lapse;
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
    /// When an allowed request's response is given its units back (`refund_when`).
    pub(crate) refund_when: Option<RefundWhen>,
    /// How long a response's concurrency lease is renewed at most (`renew_leases_up_to`).
    pub(crate) renew_leases: Option<Duration>,
}

/// The layer's `refund_when` predicate, on the inner service's response status and headers.
pub(crate) type RefundWhen = Arc<dyn Fn(StatusCode, &HeaderMap) -> bool + Send + Sync>;

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
            .field("refund_when", &self.refund_when.is_some())
            .field("renew_leases", &self.renew_leases)
            .finish()
    }
}

/// One request's work for the engine.
#[derive(Default)]
pub(crate) struct Job {
    checks: Checks,
    /// Keys still being found (asynchronous extractors), by position in `checks.items`.
    pending: Vec<(usize, KeyFuture)>,
}

/// The checks of one request (inline room for the usual one or two rules).
#[derive(Default)]
struct Checks {
    items: SmallVec<[Item; 2]>,
    grpc: bool,
}

/// One rule's check: the rule (by position in the table), its key and its cost.
struct Item {
    rule: usize,
    key: Key,
    cost: u64,
}

impl Checks {
    fn push(&mut self, rule: usize, key: Key, cost: u64) {
        self.items.push(Item { rule, key, cost });
    }

    fn rules(&self) -> RuleIds {
        // Pushes, not `collect`: the generic `extend` costs more than the one or two items.
        let mut rules = RuleIds::new();
        for item in &self.items {
            rules.push(item.rule);
        }
        rules
    }
}

/// What `call` makes of a request. What an allowed request carries on is written into an
/// [`Allowed`] of the caller's: it is large, and moving it costs more than deciding.
pub(crate) enum Called {
    /// Let it through (no rule applies, or the limiter allowed it at once).
    Allow,
    /// Turned away (by the limiter, or for want of a key).
    Reject(Response<Bytes>),
    /// The limiter must be awaited: the job is in the caller's [`Job`].
    Deciding,
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
    pub(crate) refund: Option<Refund>,
}

/// What an allowed request took from its rate policies (concurrency leases have their guard).
pub(crate) struct RefundJob {
    rules: SmallVec<[usize; 2]>,
    keys: SmallVec<[Key; 2]>,
    costs: SmallVec<[u64; 2]>,
    verdict: Verdict,
    fallback: bool,
}

/// Gives an allowed request's units back if its response says so (the layer's
/// `refund_when`). Dropped unsettled (the inner service failed, the request was cancelled), it
/// gives nothing back.
pub(crate) struct Refund {
    engine: Arc<dyn DynEngine>,
    job: Box<RefundJob>,
}

impl Refund {
    /// Refunds when the layer's predicate holds for the inner service's response.
    pub(crate) fn settle(self, status: StatusCode, headers: &HeaderMap) {
        let when = self.engine.shared().refund_when.as_ref();
        if when.is_some_and(|when| when(status, headers)) {
            self.engine.refund(*self.job);
        }
    }
}

/// Gives back what a request that waits its turn took, should it be dropped before its turn
/// comes; disarmed when it does.
struct Unwait {
    engine: Arc<dyn DynEngine>,
    job: Option<RefundJob>,
}

impl Unwait {
    fn disarm(mut self) {
        self.job = None;
    }
}

impl Drop for Unwait {
    fn drop(&mut self) {
        if let Some(job) = self.job.take() {
            Arc::clone(&self.engine).refund(job);
        }
    }
}

impl fmt::Debug for Refund {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Refund")
            .field("rules", &self.job.rules)
            .finish_non_exhaustive()
    }
}

/// A concurrency lease to give back (boxed in its guard: leases are rare, futures moved often).
#[derive(Clone)]
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
    job: Option<Box<LeaseJob>>,
    /// The task renewing the lease while the guard lives (see [`keep_alive`]).
    renewing: Option<tokio::task::AbortHandle>,
    /// When the lease stops counting ([`crate::HeldLease::lost`]).
    lapse: Lapse,
}

impl LeaseGuard {
    /// A guard over `lease` for `items` (rule index, key): the concurrency rules of a check
    /// sent to the store at `asked`.
    fn new(
        engine: Arc<dyn DynEngine>,
        items: impl Iterator<Item = (usize, Key)>,
        lease: LeaseId,
        fallback: bool,
        asked: tokio::time::Instant,
    ) -> Self {
        let (rules, keys) = items.unzip();
        let job = LeaseJob {
            rules,
            keys,
            lease,
            fallback,
        };
        count_held(engine.shared(), &job.rules, 1.0);
        let ttl = lease_ttl(engine.shared(), &job.rules);
        let (renewing, lapse) = match keep_alive(&engine, &job, ttl, asked) {
            Some((task, clock)) => (Some(task), Lapse::Clock(clock)),
            None => (
                None,
                Lapse::Fixed(ttl.and_then(|ttl| asked.checked_add(ttl))),
            ),
        };
        LeaseGuard {
            engine,
            job: Some(Box::new(job)),
            renewing,
            lapse,
        }
    }

    /// When the lease stops counting.
    pub(crate) fn lapse(&self) -> &Lapse {
        &self.lapse
    }
}

/// Renews the lease of `job` every third of its (shortest) TTL, for at most the layer's
/// `renew_leases_up_to` since the grant, until aborted (the guard dropped), so that a body that
/// outlasts the TTL (a long stream) keeps its slot. Stops when the lease is found lapsed or the
/// store refuses the key for good; a store that is down or slow is tried again next period.
/// Needs a Tokio runtime with timers; without a runtime the lease lapses after its TTL.
///
/// `ttl` is the lease's, granted by a check sent at `asked`; the task tells what it learns to
/// the [`LeaseClock`] it returns.
fn keep_alive(
    engine: &Arc<dyn DynEngine>,
    job: &LeaseJob,
    ttl: Option<Duration>,
    asked: tokio::time::Instant,
) -> Option<(tokio::task::AbortHandle, Arc<LeaseClock>)> {
    let max_hold = engine.shared().renew_leases?;
    let ttl = ttl?;
    let handle = tokio::runtime::Handle::try_current().ok()?;
    let period = (ttl / 3).max(Duration::from_millis(1));
    let engine = Arc::clone(engine);
    let job = Arc::new(job.clone());
    let clock = Arc::new(LeaseClock::new(asked, Some(ttl)));
    let told = Arc::clone(&clock);
    // floodgate-core's `ConcurrencyLease::renew_up_to` renews with a loop of the same shape:
    // keep the two alike.
    let task = handle.spawn(async move {
        let start = tokio::time::Instant::now();
        let mut ticks = tokio::time::interval_at(told.first_renewal(start, period), period);
        // A slow renewal does not make the next ones bunch up against the same slow store.
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let tick = ticks.tick().await;
            // Lost (its deadline passed unrenewed): a renewal the store still accepts would
            // hold a slot its holder was told is gone.
            if tick.duration_since(start) > max_hold || told.is_lost() {
                break;
            }
            let sent = tokio::time::Instant::now();
            match Arc::clone(&engine).renew(Arc::clone(&job), period).await {
                Renewed::Held => told.renewed(sent, ttl),
                Renewed::Unknown => {}
                Renewed::Gone => {
                    told.lose();
                    break;
                }
            }
        }
    });
    Some((task.abort_handle(), clock))
}

/// `asked`, on Tokio's clock (which tests may pause or move ahead): what has passed since.
fn on_tokio_clock(asked: Instant) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    now.checked_sub(asked.elapsed()).unwrap_or(now)
}

/// The TTL of a lease over `rules` (the shortest of their concurrency policies').
fn lease_ttl(sh: &Shared, rules: &[usize]) -> Option<Duration> {
    rules
        .iter()
        .filter_map(|&r| match sh.table[r].rule.policy().kind() {
            Kind::Concurrency(c) => Some(c.lease_ttl_us()),
            _ => None,
        })
        .min()
        .map(Duration::from_micros)
}

/// What a renewal found.
pub(crate) enum Renewed {
    /// The lease is held for another TTL.
    Held,
    /// No answer (the store down or slow): the lease may still be held; tried again next
    /// period.
    Unknown,
    /// The lease lapsed or was released, or the store refuses its key for good.
    Gone,
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        if let Some(renewing) = self.renewing.take() {
            renewing.abort();
        }
        if let Some(job) = self.job.take() {
            count_held(self.engine.shared(), &job.rules, -1.0);
            Arc::clone(&self.engine).release(*job);
        }
    }
}

/// Moves the held-leases gauge of each of `rules` by `change`.
fn count_held(sh: &Shared, rules: &[usize], change: f64) {
    for &r in rules {
        let entry = &sh.table[r];
        entry.metrics.lease_held(entry.rule.policy().name(), change);
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
    /// Finds the rules and keys of `req`, and decides at once when the limiter can (the
    /// in-memory limiter in reject mode); `this` is `self`, for concurrency leases.
    fn call(
        &self,
        this: &Arc<dyn DynEngine>,
        req: &RequestView<'_>,
        job: &mut Job,
        allowed: &mut Allowed,
    ) -> Called;
    fn decide(self: Arc<Self>, job: Job) -> BoxFuture<Decided>;
    fn release(self: Arc<Self>, job: LeaseJob);
    /// Renews a lease, waiting at most `within` for the store.
    fn renew(self: Arc<Self>, job: Arc<LeaseJob>, within: Duration) -> BoxFuture<Renewed>;
    /// Gives back what an allowed request took (see [`Refund`]).
    fn refund(self: Arc<Self>, job: RefundJob);
    /// The limiter's deny cache and leasing counters (also copied into their metrics).
    fn cache_stats(&self) -> CacheStats;
}

pub(crate) struct Engine<L> {
    limiter: L,
    shared: Shared,
    /// Whether the limiter keeps a deadline the layer's timeout away
    /// ([`Limiter::keeps_deadlines`]): the layer's timeout needs no timer of its own then.
    keeps_deadlines: bool,
}

impl<L: Limiter> Engine<L> {
    pub(crate) fn new(limiter: L, shared: Shared) -> Self {
        let keeps_deadlines = limiter.keeps_deadlines(shared.timeout);
        Engine {
            limiter,
            shared,
            keeps_deadlines,
        }
    }
}

/// Finds the rules that apply to `req` and their keys; a response when a missing key turns
/// the request away.
fn prepare(sh: &Shared, req: &RequestView<'_>, job: &mut Job) -> Option<Response<Bytes>> {
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
                    Some(_) => return Some(sh.reject_missing(entry, &e, req.is_grpc())),
                    None => {}
                },
            },
            Extracted::Pending(fut) => {
                job.pending.push((job.checks.items.len(), fut));
                job.checks.push(i, Key::default(), cost);
            }
        }
    }
    None
}

impl Shared {
    /// What giving back the rate policies of `job` (allowed with `verdict`) takes: their rules,
    /// keys, costs and decisions (a concurrency policy's lease is its guard's). `None` without
    /// any.
    fn refund_job(&self, job: &Checks, verdict: &Verdict, fallback: bool) -> Option<RefundJob> {
        let mut refund = RefundJob {
            rules: SmallVec::new(),
            keys: SmallVec::new(),
            costs: SmallVec::new(),
            verdict: Verdict {
                decisions: SmallVec::new(),
                wait: verdict.wait,
                lease: None,
                at: verdict.at,
            },
            fallback,
        };
        for (i, d) in job.items.iter().zip(&verdict.decisions) {
            if !self.is_concurrency(i.rule) {
                refund.rules.push(i.rule);
                refund.keys.push(i.key.clone());
                refund.costs.push(i.cost);
                refund.verdict.decisions.push(*d);
            }
        }
        (!refund.rules.is_empty()).then_some(refund)
    }

    /// The info of a request no rule applied to, when handlers get one: so that a handler
    /// taking [`RateLimitInfo`] behind the layer always finds one.
    fn not_limited(&self) -> Option<RateLimitInfo> {
        self.request_info.then(|| RateLimitInfo {
            table: Arc::clone(&self.table),
            rules: SmallVec::new(),
            decisions: SmallVec::new(),
            strictest: None,
            source: DecisionSource::NotLimited,
            waited: Duration::ZERO,
        })
    }

    fn is_concurrency(&self, rule: usize) -> bool {
        matches!(self.table[rule].rule.policy().kind(), Kind::Concurrency(_))
    }

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
        static REJECT: OnMissingKey = OnMissingKey::Reject;
        if matches!(e, KeyError::Ambiguous { .. }) {
            return Some(&REJECT);
        }
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
        match (action, e) {
            // A key that is there but too long is the client's doing: letting it through would
            // let a padded key (an API key the application trims, say) skip the rule.
            (OnMissingKey::Allow, KeyError::TooLong { .. }) => Some(&REJECT),
            (OnMissingKey::Allow, _) => None,
            (other, _) => Some(other),
        }
    }

    fn reject_missing(&self, entry: &RuleEntry, e: &KeyError, grpc: bool) -> Response<Bytes> {
        entry
            .metrics
            .count(entry.rule.policy().name(), Outcome::MissingKey);
        self.handler.rejection(&Rejection {
            kind: RejectionKind::MissingKey,
            grpc,
            info: None,
            key_error: Some(e),
            policy: Some(entry.rule.policy()),
            retry_after: None,
        })
    }

    /// The headers of `decisions` (of `rules`, in order).
    fn render(
        &self,
        rules: impl Iterator<Item = usize> + Clone,
        decisions: &[Decision],
        strictest: Option<usize>,
        out: &mut HeaderBlock,
    ) {
        if !(self.headers.ietf || self.headers.legacy) || decisions.is_empty() {
            return;
        }
        // The legacy headers' policy, in requests: a denying one, else the one with the fewest
        // requests left (units compare only within one cost: 40 units at 30 a request are
        // fewer requests than 3 at 1).
        let strictest = if self.headers.legacy && decisions.iter().all(|d| d.allowed) {
            rules
                .clone()
                .zip(decisions)
                .map(|(r, d)| (d, self.table[r].unit))
                .min_by_key(|(d, unit)| d.remaining / unit)
        } else {
            strictest.and_then(|i| {
                let unit = self.table[rules.clone().nth(i)?].unit;
                Some((decisions.get(i)?, unit))
            })
        };
        let items = rules.zip(decisions).map(|(i, d)| {
            let entry = &self.table[i];
            (entry.rule.policy(), &entry.policy_item, d, entry.unit)
        });
        headers::render(self.headers, items, strictest, out);
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
                .or_insert_with(|| HeaderValue::from(ceil_secs(retry).max(1)));
        }
        let mut block = HeaderBlock::new();
        self.render(
            info.rules.iter().copied(),
            &info.decisions,
            info.strictest,
            &mut block,
        );
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
            .or_insert_with(|| HeaderValue::from(ceil_secs(retry).max(1)));
        res
    }
}

/// A verdict and where it came from.
struct Verdicted {
    verdict: Verdict,
    source: DecisionSource,
    waited: Duration,
    /// When the check that decided was sent (a lease's TTL runs from then).
    asked: Instant,
    /// The guard of a lease held through a shaper's wait, for the response to keep.
    guard: Option<LeaseGuard>,
}

impl<L> Engine<L>
where
    L: Limiter + Clone + 'static,
{
    async fn run(self: Arc<Self>, job: Job) -> Decided {
        let Job {
            checks: mut job,
            pending,
        } = job;
        // Keys from asynchronous extractors, awaited in a future of their own: most layers
        // have none, and this one is boxed per request.
        if !pending.is_empty()
            && let Some(decided) = Box::pin(self.resolve(&mut job, pending)).await
        {
            return decided;
        }
        let span = self.span(&job);
        // Limiters' futures are large, and this one is boxed per request: awaited here
        // without the span's wrapper unless something listens (then boxed apart).
        let mut result = match &span {
            Some(span) => Box::pin(self.verdict(&job).instrument(span.clone())).await,
            None => self.verdict(&job).await,
        };
        let mut allowed = Allowed {
            lease: result.as_mut().and_then(|r| r.guard.take()),
            ..Allowed::default()
        };
        let this = Arc::clone(&self) as Arc<dyn DynEngine>;
        let grpc = job.grpc;
        let (result, waited) = match &result {
            Some(r) => (Some((&r.verdict, r.source, Some(r.asked))), r.waited),
            None => (None, Duration::ZERO),
        };
        match self.conclude(
            &this,
            &mut job,
            result,
            waited,
            span.as_ref(),
            || grpc,
            &mut allowed,
        ) {
            None => Decided::Allow(allowed),
            Some(response) => Decided::Reject(response),
        }
    }

    /// Awaits the keys of asynchronous extractors into `job`; `Some` when that decides the
    /// request (a missing key rejected, or every rule skipped).
    async fn resolve(&self, job: &mut Checks, pending: Vec<(usize, KeyFuture)>) -> Option<Decided> {
        let sh = &self.shared;
        let mut skipped: SmallVec<[usize; 2]> = SmallVec::new();
        for (pos, fut) in pending {
            match fut.await.and_then(|k| sh.check_len(k)) {
                Ok(key) => job.items[pos].key = key,
                Err(e) => {
                    let entry = &sh.table[job.items[pos].rule];
                    match sh.missing_key(entry, &e) {
                        Some(OnMissingKey::UseKey(key)) => job.items[pos].key = key.clone(),
                        Some(_) => {
                            return Some(Decided::Reject(sh.reject_missing(entry, &e, job.grpc)));
                        }
                        None => skipped.push(pos),
                    }
                }
            }
        }
        for &pos in skipped.iter().rev() {
            job.items.remove(pos);
        }
        job.items.is_empty().then(|| {
            Decided::Allow(Allowed {
                info: self.shared.not_limited(),
                ..Allowed::default()
            })
        })
    }

    /// The `floodgate.check` span of `job`, when something listens at debug level: otherwise
    /// none at all, since even a disabled span costs its bookkeeping on every request.
    fn span(&self, job: &Checks) -> Option<tracing::Span> {
        if !tracing::span_enabled!(target: "floodgate", tracing::Level::DEBUG) {
            return None;
        }
        let span = tracing::debug_span!(
            target: "floodgate",
            "floodgate.check",
            key = tracing::field::Empty,
            policy = tracing::field::Empty,
            outcome = tracing::field::Empty,
            source = tracing::field::Empty,
        );
        if !span.is_disabled() {
            span.record(
                "key",
                tracing::field::display(Escaped::new(job.items[0].key.as_bytes())),
            );
            span.record(
                "policy",
                self.shared.table[job.items[0].rule].rule.policy().name(),
            );
        }
        Some(span)
    }

    /// Turns a verdict (or its absence) into the answer: metrics, then a rejection, or the
    /// info, headers and lease of an allowed request written into `out`. `grpc` says whether
    /// the request is a gRPC one (asked only to reject it).
    #[allow(clippy::too_many_arguments)]
    fn conclude(
        &self,
        this: &Arc<dyn DynEngine>,
        job: &mut Checks,
        result: Option<(&Verdict, DecisionSource, Option<Instant>)>,
        waited: Duration,
        span: Option<&tracing::Span>,
        grpc: impl FnOnce() -> bool,
        out: &mut Allowed,
    ) -> Option<Response<Bytes>> {
        let sh = &self.shared;
        let Some((verdict, source, asked)) = result else {
            let entry = &sh.table[job.items[0].rule];
            entry
                .metrics
                .count(entry.rule.policy().name(), Outcome::Error);
            record_outcome(span, Outcome::Error);
            if sh.fail_closed || sh.fails_closed(job) {
                return Some(sh.reject_unavailable(grpc()));
            }
            if sh.request_info {
                out.info = Some(RateLimitInfo {
                    table: Arc::clone(&sh.table),
                    rules: job.rules(),
                    decisions: SmallVec::new(),
                    strictest: None,
                    source: DecisionSource::FailOpen,
                    waited: Duration::ZERO,
                });
            }
            return None;
        };

        // A denial is stricter than any allowance: the strictest decision says it all.
        let strictest = verdict.strictest();
        let allowed = strictest.is_none_or(|(_, d)| d.allowed);
        let strictest = strictest.map(|(i, _)| i);
        let outcome = match (source, allowed) {
            (DecisionSource::Fallback, true) => Outcome::FallbackAllowed,
            (DecisionSource::Fallback, false) => Outcome::FallbackDenied,
            (_, true) => Outcome::Allowed,
            (_, false) => Outcome::Denied,
        };
        let counted = &sh.table[job.items[strictest.unwrap_or(0)].rule];
        counted.metrics.count(counted.rule.policy().name(), outcome);
        record_outcome(span, outcome);

        if !allowed {
            let info = RateLimitInfo {
                table: Arc::clone(&sh.table),
                rules: job.rules(),
                decisions: SmallVec::from_slice(&verdict.decisions),
                strictest,
                source,
                waited,
            };
            return Some(sh.reject_limited(&info, grpc()));
        }
        if sh.refund_when.is_some() && source != DecisionSource::FailOpen {
            // Leases are released by their guard, at the end of the body: the refund gives back
            // the rate policies' units, with their decisions.
            out.refund = sh
                .refund_job(job, verdict, source == DecisionSource::Fallback)
                .map(|refund| Refund {
                    engine: Arc::clone(this),
                    job: Box::new(refund),
                });
        }
        // A lease held through a shaper's wait has its guard already.
        if let Some(lease) = verdict.lease.filter(|_| out.lease.is_none()) {
            // A check of cost 0 holds no lease: it is not released nor renewed.
            let items = job
                .items
                .iter_mut()
                .filter(|i| sh.is_concurrency(i.rule) && i.cost > 0);
            out.lease = Some(LeaseGuard::new(
                Arc::clone(this),
                items.map(|i| (i.rule, std::mem::take(&mut i.key))),
                lease,
                source == DecisionSource::Fallback,
                // Every path that can take a lease knows when it asked (the in-memory one reads
                // the time for concurrency policies only). Now would be later than the store's
                // grant, and overstate the lease: it is never used.
                {
                    debug_assert!(asked.is_some(), "a lease without the time it was asked");
                    asked.map_or_else(tokio::time::Instant::now, on_tokio_clock)
                },
            ));
        }
        if sh.headers.allowed {
            let rules = job.items.iter().map(|c| c.rule);
            sh.render(rules, &verdict.decisions, strictest, &mut out.headers);
        }
        if sh.request_info {
            out.info = Some(RateLimitInfo {
                table: Arc::clone(&sh.table),
                rules: job.rules(),
                decisions: SmallVec::from_slice(&verdict.decisions),
                strictest,
                source,
                waited,
            });
        }
        None
    }

    /// The verdict of `job`, waiting in delay mode; `None` when neither the store nor a
    /// fallback could decide.
    async fn verdict(self: &Arc<Self>, job: &Checks) -> Option<Verdicted> {
        let sh = &self.shared;
        let checks = sh.checks(job);
        match sh.mode {
            // One check, which reserves nothing ahead (no wait): the future the layer boxes per
            // request holds the limiter's future and little else.
            Mode::Reject => {
                let (verdict, source, asked) = self
                    .check_once(job, &checks, CheckOptions::default())
                    .await?;
                Some(Verdicted {
                    verdict,
                    source,
                    waited: Duration::ZERO,
                    asked,
                    guard: None,
                })
            }
            // Sleeps, retries: boxed apart.
            Mode::Delay { max_wait } => Box::pin(self.delay(job, &checks, max_wait)).await,
        }
    }

    /// Delay mode: checks until allowed, sleeping each retry time while it fits in `max_wait`
    /// (a shaper reserves its turn and the check sleeps until it).
    async fn delay(
        self: &Arc<Self>,
        job: &Checks,
        checks: &[Check<'_>],
        max_wait: Duration,
    ) -> Option<Verdicted> {
        let shaper = checks
            .iter()
            .any(|c| matches!(c.policy.kind(), Kind::Shaper(_)));
        let started = (!max_wait.is_zero()).then(Instant::now);
        let mut attempts = 0;
        // What is left of `max_wait`.
        let left = || started.map_or(Duration::ZERO, |s| max_wait.saturating_sub(s.elapsed()));
        loop {
            // The first attempt waits up to `max_wait` itself: time measured since `started`
            // would cut the last microsecond off, and the largest turn that fits with it.
            let opts = if shaper {
                CheckOptions::wait(if attempts == 0 { max_wait } else { left() })
            } else {
                CheckOptions::default()
            };
            let (verdict, source, asked) = self.check_once(job, checks, opts).await?;
            let waited = || started.map_or(Duration::ZERO, |s| s.elapsed());
            if verdict.allowed() {
                if !verdict.wait.is_zero() {
                    // A concurrency lease taken with the shaper's turn is held through the
                    // wait: should the request be dropped meanwhile, this gives it back. Then
                    // it is the response's (renewed since the grant, if renewal is on).
                    let guard = verdict.lease.map(|lease| {
                        let sh = &self.shared;
                        let items = job
                            .items
                            .iter()
                            .filter(|i| sh.is_concurrency(i.rule) && i.cost > 0);
                        LeaseGuard::new(
                            Arc::clone(self) as Arc<dyn DynEngine>,
                            items.map(|i| (i.rule, i.key.clone())),
                            lease,
                            source == DecisionSource::Fallback,
                            on_tokio_clock(asked),
                        )
                    });
                    // Dropped while it waits its turn (the client went away, a timeout in
                    // front), the request takes nothing: its turn and the other rate
                    // policies' units are given back (its lease, by the guard above).
                    let unwait = Unwait {
                        engine: Arc::clone(self) as Arc<dyn DynEngine>,
                        job: self.shared.refund_job(
                            job,
                            &verdict,
                            source == DecisionSource::Fallback,
                        ),
                    };
                    tokio::time::sleep(verdict.wait).await;
                    unwait.disarm();
                    return Some(Verdicted {
                        verdict,
                        source,
                        waited: waited(),
                        asked,
                        guard,
                    });
                }
                return Some(Verdicted {
                    verdict,
                    source,
                    waited: waited(),
                    asked,
                    guard: None,
                });
            }
            attempts += 1;
            let retry = verdict.strictest().and_then(|(_, d)| d.retry_after);
            // A shaper that refused a turn within what was left of `max_wait` refuses it again
            // after any sleep: its queue only grows as others take their turns (a turn with
            // others behind it is never given back), while what is left of `max_wait` shrinks.
            // Its retry time says when the request, made again, would fit in what it was
            // asked with (a whole `max_wait` on the first attempt): the client's to take, not
            // this request's to sleep.
            let shaper_refused = shaper
                && checks
                    .iter()
                    .zip(&verdict.decisions)
                    .any(|(c, d)| !d.allowed && matches!(c.policy.kind(), Kind::Shaper(_)));
            // The retry must fit in what is left after the check itself, which may have taken
            // a while.
            match retry {
                Some(retry)
                    if !shaper_refused && attempts < MAX_DELAY_ATTEMPTS && retry <= left() =>
                {
                    tokio::time::sleep(retry).await;
                }
                _ => {
                    return Some(Verdicted {
                        verdict,
                        source,
                        waited: waited(),
                        asked,
                        guard: None,
                    });
                }
            }
        }
    }

    /// One decision: the store, unless it is failing; then the fallback, unless a rule of the
    /// check fails closed.
    async fn check_once(
        &self,
        job: &Checks,
        checks: &[Check<'_>],
        mut opts: CheckOptions,
    ) -> Option<(Verdict, DecisionSource, Instant)> {
        let sh = &self.shared;
        let admit = sh.health.admit();
        // The store is failing: a denial a cache holds still stands, where the failure policy
        // would decide (failing open, let the key through). Not in place of the interval's
        // one probe: a client hammering a denied key would take every probe, and the store
        // would never be found answering again.
        let local_first =
            admit == Admit::Skip || admit == Admit::Probe && sh.health.retry_interval().is_zero();
        if local_first {
            let now = Instant::now();
            let local = self.limiter.check_local(checks, &opts);
            // Copied while the store is skipped too: the cache's counters go on.
            sh.metrics
                .copy_caches_soon(now, || self.limiter.cache_stats());
            if let Some(verdict) = local {
                return Some((verdict, DecisionSource::Store, now));
            }
        }
        if admit != Admit::Skip {
            let started = Instant::now();
            // Behind a limiter that keeps deadlines the layer's timeout away, the timeout is the
            // check's deadline: the check is over by then (with the limiter's timeout error,
            // which counts as the layer's timeout below), and is not timed here, since a timer
            // per request costs more than the rest of this function. Others are timed, and get
            // no deadline: one sooner than their own timeout could cut other checks short.
            if self.keeps_deadlines {
                opts.deadline = started.checked_add(sh.timeout);
            }
            let result = if admit == Admit::Probe {
                // The probe of a failing store (one request per retry interval): answered by
                // the store itself, not by a deny cache or a lease, whose local answer would
                // say it is back. Rare: boxed, so the usual path's future stays as it is.
                let fresh = Box::pin(self.limiter.check_store(checks, opts));
                timeout_unless_ready(Some(sh.timeout), fresh).await
            } else {
                // One await of the limiter's future, timed or not: two would each take its
                // room in this future, which the layer boxes per request.
                let timeout = opts.deadline.is_none().then_some(sh.timeout);
                timeout_unless_ready(timeout, self.limiter.check(checks, opts)).await
            };
            // The store's failure to answer by the deadline is the layer's timeout.
            let result = match result {
                Some(Err(e)) if L::is_unavailable(&e) && started.elapsed() >= sh.timeout => None,
                result => result,
            };
            sh.metrics.check_duration(started.elapsed().as_secs_f64());
            sh.metrics
                .copy_caches_soon(started, || self.limiter.cache_stats());
            match result {
                Some(Ok(verdict)) => {
                    // Only a probe's answer comes from the store for sure (a usual check may
                    // be answered by a cache or a lease): it alone says the store is back.
                    if admit == Admit::Probe {
                        sh.health.succeeded();
                    }
                    return Some((verdict, DecisionSource::Store, started));
                }
                Some(Err(e)) => {
                    sh.metrics.store_error(false);
                    if L::is_unavailable(&e) {
                        sh.health.failed(&e);
                    } else {
                        // One key's problem (a corrupted value): this request gets the failure
                        // policy; every other key keeps asking the store.
                        sh.metrics.request_error(&e);
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
            // A probe that failed went past the cache: a denial it holds still stands (looked
            // up above already when every request probes).
            if admit == Admit::Probe
                && !local_first
                && let Some(verdict) = self.limiter.check_local(checks, &opts)
            {
                return Some((verdict, DecisionSource::Store, Instant::now()));
            }
        }
        sh.fallback_check(job, checks, opts)
    }

    /// The in-memory limiter decides synchronously: no future, no box, no clone of the inner
    /// service. Concluded like [`Engine::conclude`].
    fn decide_sync(
        &self,
        this: &Arc<dyn DynEngine>,
        memory: &MemoryLimiter,
        job: &mut Checks,
        req: &RequestView<'_>,
        out: &mut Allowed,
    ) -> Option<Response<Bytes>> {
        let sh = &self.shared;
        let span = self.span(job);
        let entered = span.as_ref().map(tracing::Span::enter);
        let checks = sh.checks(job);
        let grpc = || req.is_grpc();
        if !sh.health.skip_store() {
            // Timed with `quanta` (the CPU's counter where it is invariant), not two `Instant`
            // reads, which cost more than the check; the `Instant` a lease's TTL runs from is
            // read only for a concurrency policy.
            let started = sh.metrics.timer();
            let asked = job
                .items
                .iter()
                .any(|i| sh.is_concurrency(i.rule))
                .then(Instant::now);
            let checked = memory.check_sync(&checks, CheckOptions::default());
            sh.metrics.check_duration_since(started);
            // Verdicts are large: concluded by reference, where they were returned.
            match &checked {
                Ok(verdict) => {
                    sh.health.succeeded();
                    drop((checks, entered));
                    let result = Some((verdict, DecisionSource::Store, asked));
                    return self.conclude(
                        this,
                        job,
                        result,
                        Duration::ZERO,
                        span.as_ref(),
                        grpc,
                        out,
                    );
                }
                Err(e) => {
                    // The memory store is never down: its errors are this request's.
                    sh.metrics.store_error(false);
                    sh.metrics.request_error(&e);
                }
            }
        }
        let fallback = sh.fallback_check(job, &checks, CheckOptions::default());
        drop((checks, entered));
        let result = fallback
            .as_ref()
            .map(|(verdict, source, asked)| (verdict, *source, Some(*asked)));
        self.conclude(this, job, result, Duration::ZERO, span.as_ref(), grpc, out)
    }
}

impl Shared {
    /// Whether a rule that is checked (not one skipped for want of a key) fails closed when
    /// the store cannot decide ([`crate::Rule::fail_closed`]).
    fn fails_closed(&self, job: &Checks) -> bool {
        job.items
            .iter()
            .any(|i| self.table[i.rule].rule.fail_closed)
    }

    fn checks<'a>(&'a self, job: &'a Checks) -> SmallVec<[Check<'a>; 2]> {
        // A plain loop: `collect` into a SmallVec costs several times more for one or two.
        let mut checks = SmallVec::new();
        for c in &job.items {
            checks
                .push(Check::new(c.key.as_bytes(), self.table[c.rule].rule.policy()).cost(c.cost));
        }
        checks
    }

    /// The local fallback's decision; `None` without one, or for checks that fail closed.
    fn fallback_check(
        &self,
        job: &Checks,
        checks: &[Check<'_>],
        opts: CheckOptions,
    ) -> Option<(Verdict, DecisionSource, Instant)> {
        let fallback = self.fallback.as_ref().filter(|_| !self.fails_closed(job))?;
        let asked = Instant::now();
        match fallback.check_sync(checks, opts) {
            Ok(verdict) => Some((verdict, DecisionSource::Fallback, asked)),
            Err(e) => {
                tracing::debug!(target: "floodgate", error = %e, "the local fallback failed too");
                None
            }
        }
    }
}

/// Records `outcome` in the `floodgate.check` span: the `outcome` and `source` labels of
/// `floodgate_requests_total`, so that a trace tells a fallback's decision from the store's.
fn record_outcome(span: Option<&tracing::Span>, outcome: Outcome) {
    if let Some(span) = span {
        let (outcome, source) = outcome.labels();
        span.record("outcome", outcome);
        span.record("source", source);
    }
}

impl<L> DynEngine for Engine<L>
where
    L: Limiter + Clone + 'static,
{
    fn shared(&self) -> &Shared {
        &self.shared
    }

    fn call(
        &self,
        this: &Arc<dyn DynEngine>,
        req: &RequestView<'_>,
        job: &mut Job,
        allowed: &mut Allowed,
    ) -> Called {
        let sh = &self.shared;
        if let Some(response) = prepare(sh, req, job) {
            return Called::Reject(response);
        }
        if job.checks.items.is_empty() {
            allowed.info = sh.not_limited();
            return Called::Allow;
        }
        if job.pending.is_empty()
            && sh.mode == Mode::Reject
            && let Some(memory) = (&self.limiter as &dyn Any).downcast_ref::<MemoryLimiter>()
        {
            return match self.decide_sync(this, memory, &mut job.checks, req, allowed) {
                None => Called::Allow,
                Some(response) => Called::Reject(response),
            };
        }
        job.checks.grpc = req.is_grpc();
        Called::Deciding
    }

    fn decide(self: Arc<Self>, job: Job) -> BoxFuture<Decided> {
        Box::pin(self.run(job))
    }

    fn cache_stats(&self) -> CacheStats {
        self.shared
            .metrics
            .copy_caches(|| self.limiter.cache_stats())
    }

    fn release(self: Arc<Self>, job: LeaseJob) {
        // A lease of the fallback, or of the in-memory limiter: released at once, runtime or
        // not.
        if let Some(memory) = self.local(job.fallback) {
            memory.release_sync(&lease_checks(&self.shared, &job), job.lease);
            return;
        }
        soon(Box::pin(async move {
            let sh = &self.shared;
            let checks = lease_checks(sh, &job);
            match timeout_unless_ready(Some(sh.timeout), self.limiter.release(&checks, job.lease))
                .await
            {
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
        }));
    }

    fn renew(self: Arc<Self>, job: Arc<LeaseJob>, within: Duration) -> BoxFuture<Renewed> {
        Box::pin(async move {
            let sh = &self.shared;
            let checks = lease_checks(sh, &job);
            let held = |held| if held { Renewed::Held } else { Renewed::Gone };
            if let Some(memory) = self.local(job.fallback) {
                return held(memory.renew_sync(&checks, job.lease));
            }
            let within = within.min(sh.timeout);
            match timeout_unless_ready(Some(within), self.limiter.renew(&checks, job.lease)).await {
                Some(Ok(still)) => {
                    if !still {
                        tracing::debug!(
                            target: "floodgate",
                            "a concurrency lease lapsed before it could be renewed"
                        );
                    }
                    held(still)
                }
                // The store down or slow: try again next period. A key it refuses for good (a
                // corrupt state, another type) will not get better.
                Some(Err(e)) => {
                    let transient = L::is_unavailable(&e);
                    tracing::debug!(
                        target: "floodgate",
                        error = %e,
                        transient,
                        "could not renew a concurrency lease"
                    );
                    if transient {
                        Renewed::Unknown
                    } else {
                        Renewed::Gone
                    }
                }
                None => Renewed::Unknown,
            }
        })
    }

    fn refund(self: Arc<Self>, job: RefundJob) {
        if let Some(memory) = self.local(job.fallback) {
            if let Err(e) = memory.refund_sync(&refund_checks(&self.shared, &job), &job.verdict) {
                tracing::warn!(target: "floodgate", error = %e, "could not refund a request");
            }
            return;
        }
        soon(Box::pin(async move {
            let sh = &self.shared;
            let checks = refund_checks(sh, &job);
            match timeout_unless_ready(Some(sh.timeout), self.limiter.refund(&checks, &job.verdict))
                .await
            {
                Some(Ok(())) => {}
                Some(Err(e)) => tracing::warn!(
                    target: "floodgate",
                    error = %e,
                    "could not refund a request; its units come back when its windows pass"
                ),
                None => tracing::warn!(
                    target: "floodgate",
                    "refunding a request timed out; its units come back when its windows pass"
                ),
            }
        }));
    }
}

impl<L: 'static> Engine<L> {
    /// The in-memory limiter that holds a lease or a refund's units, if it is one: the
    /// fallback's, or the layer's own when it is a [`MemoryLimiter`]. Those are given back at
    /// once, runtime or not.
    fn local(&self, fallback: bool) -> Option<&MemoryLimiter> {
        if fallback {
            self.shared.fallback.as_ref()
        } else {
            (&self.limiter as &dyn Any).downcast_ref::<MemoryLimiter>()
        }
    }
}

/// Runs `fut` now if it finishes at once, else as a task. Other stores' futures may need a
/// runtime even to be polled once (timers, I/O): without one (a body dropped after its runtime
/// shut down), nothing runs, and what it would have given back comes back on its own (a lease
/// lapses, units age out).
fn soon(mut fut: BoxFuture<()>) {
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        tracing::debug!(
            target: "floodgate",
            "no Tokio runtime to give back a lease or a refund; it comes back on its own"
        );
        return;
    };
    if fut
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
        .is_ready()
    {
        return;
    }
    handle.spawn(fut);
}

fn refund_checks<'a>(sh: &'a Shared, job: &'a RefundJob) -> SmallVec<[Check<'a>; 2]> {
    job.rules
        .iter()
        .zip(&job.keys)
        .zip(&job.costs)
        .map(|((&i, key), &cost)| Check::new(key.as_bytes(), sh.table[i].rule.policy()).cost(cost))
        .collect()
}

fn lease_checks<'a>(sh: &'a Shared, job: &'a LeaseJob) -> SmallVec<[Check<'a>; 2]> {
    job.rules
        .iter()
        .zip(&job.keys)
        .map(|(&i, key)| Check::new(key.as_bytes(), sh.table[i].rule.policy()))
        .collect()
}

pin_project_lite::pin_project! {
    /// Awaits `fut` for at most `timeout` (`None`: as long as it takes, for a limiter that
    /// keeps its deadline); a future that is ready at once (the in-memory limiter) does not
    /// touch the timer. Written out rather than `async`: an `async fn` would
    /// hold the limiter's future twice (argument and pinned local), and limiters' futures are
    /// large. The timer is boxed when it is needed: held in line, it took the future the layer
    /// boxes per Redis check to 1,096 bytes, past the sizes glibc's allocator serves from its
    /// per-thread cache (1,032), and that allocation and its free cost more than the timer's
    /// own box (a test keeps that future within 1,032 bytes).
    struct TimeoutUnlessReady<F> {
        #[pin]
        fut: F,
        sleep: Option<Pin<Box<tokio::time::Sleep>>>,
        timeout: Option<Duration>,
    }
}

fn timeout_unless_ready<F: Future>(timeout: Option<Duration>, fut: F) -> TimeoutUnlessReady<F> {
    TimeoutUnlessReady {
        fut,
        sleep: None,
        timeout,
    }
}

impl<F: Future> Future for TimeoutUnlessReady<F> {
    type Output = Option<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(out) = this.fut.poll(cx) {
            return Poll::Ready(Some(out));
        }
        let Some(timeout) = *this.timeout else {
            return Poll::Pending;
        };
        let sleep = this
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use floodgate_core::DenyCache;
    use floodgate_redis::RedisLimiter;

    /// The size of what `f` returns.
    fn returned<E, R>(_: &impl Fn(Arc<E>, Job) -> R) -> usize {
        std::mem::size_of::<R>()
    }

    #[test]
    fn the_future_boxed_per_request_is_small() {
        // Boxed on every request the store decides asynchronously. Keys of asynchronous
        // extractors, delay mode and spans are boxed apart, so it holds the request's checks and
        // the limiter's future (the Redis limiter behind the deny cache, as the layer builds it).
        // At most 1,032 bytes, the largest allocation glibc's allocator serves from its
        // per-thread cache (larger ones take its slow path, on every request): 1,000 when last
        // measured (1,096 with the timeout's timer in line; 2,664 before it was made small).
        let run = |e: Arc<Engine<DenyCache<RedisLimiter>>>, job: Job| e.run(job);
        assert!(returned(&run) <= 1_032, "{} bytes", returned(&run));
    }
}
