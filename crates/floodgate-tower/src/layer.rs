//! [`RateLimitLayer`] and its builder.

use std::collections::HashSet;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use floodgate_core::{
    CacheStats, DenyCache, Kind, Leasing, LeasingConfig, Limiter, MemoryLimiter, Policy,
    SystemClock,
};
use http::{HeaderMap, StatusCode};
use tower::Layer;

use crate::body::{Native, Wrapped};
use crate::engine::{DynEngine, Engine, RefundWhen, Shared};
use crate::error::ConfigError;
use crate::headers::{HeaderOptions, policy_item};
use crate::health::StoreHealth;
use crate::key::{DEFAULT_MAX_KEY_LEN, Key, KeyExtractor};
use crate::rejection::{DefaultRejection, RejectionHandler};
use crate::rule::{Rule, RuleEntry};
use crate::service::RateLimit;
use crate::telemetry::{LayerMetrics, PolicyMetrics};

/// The default decision timeout (see [`RateLimitLayerBuilder::timeout`]).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(500);
/// The default time a failing store is left alone (see
/// [`RateLimitLayerBuilder::store_retry_interval`]).
pub const DEFAULT_STORE_RETRY_INTERVAL: Duration = Duration::from_millis(500);

/// The longest the deny cache answers a denial locally in a layer that refunds
/// ([`RateLimitLayerBuilder::refund_when`]): a refund made through another replica can free a
/// key before its retry time, and is seen within this.
pub const DEFAULT_DENY_CACHE_MAX_HOLD_WITH_REFUNDS: Duration = Duration::from_secs(1);
/// Delay mode checks at most this many times per request.
pub(crate) const MAX_DELAY_ATTEMPTS: u32 = 8;

/// What to do with a request over the limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Mode {
    /// Turn it away at once (429).
    #[default]
    Reject,
    /// Make it wait its turn, up to `max_wait`, then turn it away: shaper policies reserve a
    /// slot and the request sleeps until it; other policies are checked again after their
    /// `retry_after`, if that fits in what is left of `max_wait`.
    ///
    /// A request waiting its shaper turn holds the concurrency lease taken with it: the
    /// builder refuses ([`ConfigError::LeaseShorterThanWait`]) a concurrency rule checked
    /// beside a shaper rule whose lease could lapse meanwhile.
    ///
    /// A waiting request also holds the inner service it was called on, made ready: behind a
    /// service whose readiness is a permit (tower's `ConcurrencyLimit`, `Buffer`), waiting
    /// requests hold permits. Put such layers outside this one, or keep `max_wait` short.
    Delay {
        /// The longest a request waits for its turn; the store's answer to its last check
        /// (within the layer's timeout) comes on top.
        max_wait: Duration,
    },
}

/// What to do with a request that has no key (no peer address, no API key header, a key longer
/// than the maximum, ...).
///
/// An ambiguous key ([`KeyError::Ambiguous`](crate::key::KeyError::Ambiguous), such as a key
/// header sent twice) is always turned away, whatever this says. So is a key longer than the
/// maximum under [`OnMissingKey::Allow`]: the client sent one, and letting it through would let
/// any client skip the rule by padding its key (with blanks an application trims, say).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnMissingKey {
    /// Turn it away: 400 with a problem+json body (gRPC `INVALID_ARGUMENT`).
    #[default]
    Reject,
    /// Let it through: the rule does not apply to it. A key that is there but too long is
    /// turned away all the same.
    Allow,
    /// Count it under this key, shared by every keyless request. Choose a key no client can
    /// send (one the rule's extractor never returns): a client whose own key it is would share
    /// the keyless requests' bucket.
    UseKey(Key),
}

/// What to do when the store fails or does not decide within the timeout.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum OnStoreError {
    /// Let requests through undecided (no rate-limit headers).
    FailOpen,
    /// Turn requests away: 503 with a problem+json body (gRPC `UNAVAILABLE`).
    FailClosed,
    /// Decide with this in-memory limiter and the same policies: each replica enforces the
    /// limits on its own until the store is back. The default.
    Fallback(MemoryLimiter),
}

impl Default for OnStoreError {
    fn default() -> Self {
        OnStoreError::local_fallback()
    }
}

impl OnStoreError {
    /// [`OnStoreError::Fallback`] to a new in-memory limiter.
    pub fn local_fallback() -> Self {
        OnStoreError::Fallback(MemoryLimiter::new())
    }

    pub(crate) fn name(&self) -> &'static str {
        match self {
            OnStoreError::FailOpen => "fail_open",
            OnStoreError::FailClosed => "fail_closed",
            OnStoreError::Fallback(_) => "fallback",
        }
    }
}

/// A tower layer that rate-limits requests with the policies of its [`Rule`]s.
///
/// Cheap to clone; every service it makes shares the limiter, the rules and the store's health.
/// See the [crate docs](crate) for an example.
///
/// `K` is the body kind of its services' responses: [`Wrapped`] (the default) or, after
/// [`RateLimitLayer::native_body`], [`Native`].
pub struct RateLimitLayer<K = Wrapped> {
    engine: Arc<dyn DynEngine>,
    kind: PhantomData<fn() -> K>,
}

impl<K> Clone for RateLimitLayer<K> {
    fn clone(&self) -> Self {
        RateLimitLayer {
            engine: Arc::clone(&self.engine),
            kind: PhantomData,
        }
    }
}

impl RateLimitLayer {
    /// Starts a layer deciding with `limiter` (a [`MemoryLimiter`], a Redis limiter, ...).
    pub fn builder<L>(limiter: L) -> RateLimitLayerBuilder<L>
    where
        L: Limiter + Clone + 'static,
    {
        RateLimitLayerBuilder {
            limiter,
            rules: Vec::new(),
            mode: Mode::Reject,
            on_missing_key: OnMissingKey::Reject,
            on_store_error: None,
            timeout: DEFAULT_TIMEOUT,
            store_retry_interval: DEFAULT_STORE_RETRY_INTERVAL,
            headers: HeaderOptions {
                ietf: true,
                legacy: false,
                allowed: false,
            },
            handler: Arc::new(DefaultRejection),
            request_info: true,
            max_key_len: DEFAULT_MAX_KEY_LEN,
            deny_cache: true,
            deny_cache_max_hold: None,
            leasing: None,
            refund_when: None,
            renew_leases: None,
        }
    }

    /// A layer with one policy keyed by `key`, and every other setting at its default.
    pub fn new<L>(limiter: L, policy: Policy, key: impl KeyExtractor) -> Result<Self, ConfigError>
    where
        L: Limiter + Clone + 'static,
    {
        RateLimitLayer::builder(limiter)
            .rule(Rule::new(policy).key(key))
            .build()
    }

    /// Makes services that answer with the inner service's own body type instead of a
    /// [`crate::ResponseBody`] around it.
    ///
    /// Behind axum this saves a box per request: axum's `IntoResponse` boxes every body that
    /// is not its own `Body`, while an allowed response's body now passes through as it is.
    /// The inner service's body type `B` must implement `From<ResponseBody<B>>` (axum's and
    /// tonic's `Body` do, with features `axum` and `tonic`), for rejections and for bodies that
    /// carry a concurrency lease to their end.
    ///
    /// ```
    /// # #[cfg(feature = "axum")]
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use floodgate_core::{MemoryLimiter, Policy};
    /// use floodgate_tower::{RateLimitLayer, key::PeerIp};
    ///
    /// let layer = RateLimitLayer::new(MemoryLimiter::new(), Policy::per_second(20)?, PeerIp::new())?
    ///     .native_body();
    /// let app: axum::Router = axum::Router::new()
    ///     .route("/", axum::routing::get(|| async { "hello" }))
    ///     .layer(layer);
    /// # Ok(())
    /// # }
    /// # #[cfg(not(feature = "axum"))]
    /// # fn main() {}
    /// ```
    pub fn native_body(self) -> RateLimitLayer<Native> {
        RateLimitLayer {
            engine: self.engine,
            kind: PhantomData,
        }
    }
}

impl<K> RateLimitLayer<K> {
    /// The counters of the layer's deny cache and local leasing
    /// ([`RateLimitLayerBuilder::deny_cache`], [`RateLimitLayerBuilder::leasing`]): how many
    /// checks they answered without the store. `None` for one the layer does not have (a
    /// [`MemoryLimiter`] has neither).
    ///
    /// The same counters are metrics (`floodgate_deny_cache_*`, `floodgate_leasing_*`, see
    /// [`crate::telemetry`]), copied at most once a second while requests flow and at each
    /// call of this method: call it before rendering metrics to have them exact.
    pub fn stats(&self) -> CacheStats {
        self.engine.cache_stats()
    }
}

impl<K> fmt::Debug for RateLimitLayer<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("config", self.engine.shared())
            .finish()
    }
}

impl<S, K> Layer<S> for RateLimitLayer<K> {
    type Service = RateLimit<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::from_engine(inner, Arc::clone(&self.engine))
    }
}

/// Configures a [`RateLimitLayer`].
#[must_use]
pub struct RateLimitLayerBuilder<L> {
    limiter: L,
    rules: Vec<Rule>,
    mode: Mode,
    on_missing_key: OnMissingKey,
    on_store_error: Option<OnStoreError>,
    timeout: Duration,
    store_retry_interval: Duration,
    headers: HeaderOptions,
    handler: Arc<dyn RejectionHandler>,
    request_info: bool,
    max_key_len: usize,
    deny_cache: bool,
    deny_cache_max_hold: Option<Duration>,
    leasing: Option<LeasingConfig>,
    refund_when: Option<RefundWhen>,
    renew_leases: Option<Duration>,
}

impl<L> fmt::Debug for RateLimitLayerBuilder<L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayerBuilder")
            .field("rules", &self.rules)
            .field("mode", &self.mode)
            .field("on_missing_key", &self.on_missing_key)
            .field("on_store_error", &self.on_store_error)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl<L> RateLimitLayerBuilder<L>
where
    L: Limiter + Clone + 'static,
{
    /// Adds a rule. All rules that apply to a request are checked together, all-or-nothing,
    /// in one call to the limiter (see the crate docs for where that holds only for the final
    /// state).
    pub fn rule(mut self, rule: Rule) -> Self {
        self.rules.push(rule);
        self
    }

    /// Adds a rule for `policy`, keyed by `key`, on every request.
    pub fn policy(self, policy: Policy, key: impl KeyExtractor) -> Self {
        self.rule(Rule::new(policy).key(key))
    }

    /// Rejects (the default) or delays requests over the limit.
    pub fn mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// Delays requests over the limit up to `max_wait` (see [`Mode::Delay`]).
    pub fn delay(self, max_wait: Duration) -> Self {
        self.mode(Mode::Delay { max_wait })
    }

    /// What to do with requests without a key (default: 400).
    pub fn on_missing_key(mut self, on_missing_key: OnMissingKey) -> Self {
        self.on_missing_key = on_missing_key;
        self
    }

    /// What to do when the store fails or times out (default: a local in-memory fallback).
    pub fn on_store_error(mut self, on_store_error: OnStoreError) -> Self {
        self.on_store_error = Some(on_store_error);
        self
    }

    /// The longest the layer waits for the store to decide (default 500 ms), on top of the
    /// store's own timeouts; after that the failure policy applies. Behind a limiter that keeps
    /// a deadline this far away ([`floodgate_core::Limiter::keeps_deadlines`]: Redis, when this
    /// is at least its connection's timeout) it is the check's deadline, and the layer keeps
    /// no timer per request; otherwise the layer times each check.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// After the store is found unavailable (a timeout, a connection or not-serving error, or
    /// the layer's own timeout), requests skip the store for this long (default 500 ms); then
    /// one request tries it again. Zero tries the store on every request. One key's error (a
    /// corrupted value) gives that request the failure policy and skips nothing. While the
    /// store is failing, denials the deny cache holds still answer until they run out; the
    /// failure policy decides the rest. Only the store's own answer to a try (never a local
    /// one: a cached denial, a leased unit) says it is back.
    pub fn store_retry_interval(mut self, interval: Duration) -> Self {
        self.store_retry_interval = interval;
        self
    }

    /// Adds `RateLimit-Policy` and `RateLimit` to rejections (default on), and to allowed
    /// responses with [`RateLimitLayerBuilder::headers_on_allowed`].
    pub fn ietf_headers(mut self, on: bool) -> Self {
        self.headers.ietf = on;
        self
    }

    /// Adds `X-RateLimit-Limit`, `X-RateLimit-Remaining` and `X-RateLimit-Reset` for the
    /// strictest policy to rejections, and to allowed responses with
    /// [`RateLimitLayerBuilder::headers_on_allowed`] (default off).
    pub fn legacy_headers(mut self, on: bool) -> Self {
        self.headers.legacy = on;
        self
    }

    /// Adds the rate-limit headers (those of [`RateLimitLayerBuilder::ietf_headers`] and
    /// [`RateLimitLayerBuilder::legacy_headers`]) to allowed responses too, not only to
    /// rejections (default off). They tell well-behaved clients to slow down before they are
    /// turned away, at a cost: rendering and sending them is most of what the layer does for
    /// an allowed request.
    pub fn headers_on_allowed(mut self, on: bool) -> Self {
        self.headers.allowed = on;
        self
    }

    /// Builds rejection responses with `handler` instead of [`DefaultRejection`].
    pub fn rejection_handler(mut self, handler: impl RejectionHandler) -> Self {
        self.handler = Arc::new(handler);
        self
    }

    /// Inserts a [`crate::RateLimitInfo`] into the extensions of allowed requests (default on).
    pub fn request_info(mut self, on: bool) -> Self {
        self.request_info = on;
        self
    }

    /// Answers requests that are certain to be denied without asking the store, until their
    /// retry time ([`floodgate_core::DenyCache`]); default on. An attacker hammering one key
    /// then costs the shared store about one call per admitted request, and stays denied while
    /// the store is failing, whatever the failure policy. Has no effect with a
    /// [`MemoryLimiter`], which is local already.
    ///
    /// Another replica's refund ([`RateLimitLayerBuilder::refund_when`]) can free a key before
    /// the retry time this replica cached: a layer that refunds holds a denial locally for at
    /// most [`DEFAULT_DENY_CACHE_MAX_HOLD_WITH_REFUNDS`] (1 s), then asks the store again;
    /// [`RateLimitLayerBuilder::deny_cache_max_hold`] sets another bound.
    pub fn deny_cache(mut self, on: bool) -> Self {
        self.deny_cache = on;
        self
    }

    /// The longest the deny cache answers a denial locally before asking the store again
    /// ([`floodgate_core::DenyCache::max_hold`]); rejections keep reporting the whole retry
    /// time. Default: the whole retry time, or 1 s when the layer refunds. A key hammered past
    /// its limit costs the store one call per `max_hold` per replica.
    pub fn deny_cache_max_hold(mut self, max_hold: Duration) -> Self {
        self.deny_cache_max_hold = Some(max_hold);
        self
    }

    /// Lets very hot keys spend a local slice of their budget instead of asking the store for
    /// each request ([`floodgate_core::Leasing`]); off by default. Read the bounds in its docs:
    /// a window can admit up to `replicas × lease` more than its limit; the units a lease
    /// leaves unspent go back to the store before its key's next lease (those of a key gone
    /// quiet stay spent until the policy refills them). Has no effect with a
    /// [`MemoryLimiter`].
    pub fn leasing(mut self, config: LeasingConfig) -> Self {
        self.leasing = Some(config);
        self
    }

    /// Gives an allowed request's units back when `when` holds for the inner service's
    /// response (its status and headers), as if the request had not been made
    /// ([`Limiter::refund`]): for instance `|status, _| status.is_server_error()`, so that
    /// requests failing on the server's side do not count against the client. gRPC answers
    /// `200` and usually sends its status in the trailers, which the predicate does not see:
    /// only an error answered at once (a "trailers-only" response, as tonic sends for a
    /// handler's `Err(Status)`) carries `grpc-status` in the headers it is given.
    ///
    /// The refund happens when the response's head is ready, in the background for stores
    /// other than in memory (failures are logged: the units come back when their windows
    /// pass). Concurrency leases are released at the end of the body, as always; a request
    /// whose inner service fails with an error or is cancelled is not refunded. Off by
    /// default.
    pub fn refund_when(
        mut self,
        when: impl Fn(StatusCode, &HeaderMap) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.refund_when = Some(Arc::new(when));
        self
    }

    /// Renews a response's concurrency lease every third of its TTL while the response lives
    /// (its handler runs, its body streams), for at most `max` in all; off by default, when
    /// a lease lapses at its TTL whatever the response is doing. For streams longer than the
    /// TTL (server-sent events, downloads, gRPC streams): the slot stays taken while the body
    /// lives, yet a replica that dies gives it back within one TTL, and a hung handler or a
    /// stalled client holds it for at most `max` and a TTL. Costs a task and a timer per
    /// leased response; needs a Tokio runtime with timers. A store that is down is tried again
    /// at the next period; a lease found lapsed, or a key the store refuses, stops the renewal.
    /// A [`crate::HeldLease`] kept by an upgraded connection's task is renewed the same way,
    /// and [`crate::HeldLease::lost`] tells that task when the lease stops counting: a TTL
    /// after renewal stops, or at a renewal that finds it gone.
    pub fn renew_leases_up_to(mut self, max: Duration) -> Self {
        self.renew_leases = Some(max).filter(|m| !m.is_zero());
        self
    }

    /// Keys longer than this many bytes count as missing (default 1 KiB), except under
    /// [`OnMissingKey::Allow`], which turns them away (see [`OnMissingKey`]).
    pub fn max_key_len(mut self, max: usize) -> Self {
        self.max_key_len = max;
        self
    }

    /// Builds the layer, or says which setting cannot work ([`ConfigError`]).
    pub fn build(self) -> Result<RateLimitLayer, ConfigError> {
        if self.rules.is_empty() {
            return Err(ConfigError::NoRules);
        }
        if self.timeout.is_zero() {
            return Err(ConfigError::Zero { field: "timeout" });
        }
        if let Some(Err(e)) = self.leasing.as_ref().map(LeasingConfig::validate) {
            return Err(ConfigError::Leasing {
                message: e.to_string(),
            });
        }
        let mut names = HashSet::new();
        for rule in &self.rules {
            if !names.insert(rule.policy().name()) {
                return Err(ConfigError::DuplicatePolicy {
                    name: rule.policy().name().to_owned(),
                });
            }
            let limit = most_at_once(rule.policy(), self.mode);
            if let Some(cost) = rule.fixed_cost().filter(|&c| c > limit) {
                return Err(ConfigError::CostAboveLimit {
                    policy: rule.policy().name().to_owned(),
                    cost,
                    limit,
                });
            }
        }
        if let Some(e) =
            lease_lapses_in_wait(&self.rules, self.mode, self.renew_leases, self.timeout)
        {
            return Err(e);
        }
        let on_store_error = self.on_store_error.unwrap_or_default();
        let table: Arc<[RuleEntry]> = self
            .rules
            .into_iter()
            .map(|rule| {
                let unit = rule.fixed_cost().filter(|&c| c > 1).unwrap_or(1);
                RuleEntry {
                    policy_item: policy_item(
                        rule.policy(),
                        most_at_once(rule.policy(), self.mode),
                        unit,
                    ),
                    unit,
                    metrics: PolicyMetrics::default(),
                    rule,
                }
            })
            .collect();
        let shared = Shared {
            table,
            mode: self.mode,
            on_missing_key: self.on_missing_key,
            health: StoreHealth::new(self.store_retry_interval, on_store_error.name()),
            fallback: match &on_store_error {
                OnStoreError::Fallback(m) => Some(m.clone()),
                _ => None,
            },
            fail_closed: matches!(on_store_error, OnStoreError::FailClosed),
            timeout: self.timeout,
            headers: self.headers,
            handler: self.handler,
            request_info: self.request_info,
            max_key_len: self.max_key_len,
            metrics: LayerMetrics::default(),
            refund_when: self.refund_when,
            renew_leases: self.renew_leases,
        };
        // By default a denial is held its whole retry time; with refunds, another replica's
        // refund can free a key early.
        let max_hold = self
            .deny_cache_max_hold
            .unwrap_or(if shared.refund_when.is_some() {
                DEFAULT_DENY_CACHE_MAX_HOLD_WITH_REFUNDS
            } else {
                Duration::MAX
            });
        let local = (&self.limiter as &dyn std::any::Any).is::<MemoryLimiter>();
        let leasing = self.leasing.filter(|_| !local);
        let engine: Arc<dyn DynEngine> = match (self.deny_cache && !local, leasing) {
            (true, Some(cfg)) => Arc::new(Engine::new(
                DenyCache::new(Leasing::with_config(self.limiter, cfg, SystemClock::new()))
                    .max_hold(max_hold),
                shared,
            )),
            (true, None) => Arc::new(Engine::new(
                DenyCache::new(self.limiter).max_hold(max_hold),
                shared,
            )),
            (false, Some(cfg)) => Arc::new(Engine::new(
                Leasing::with_config(self.limiter, cfg, SystemClock::new()),
                shared,
            )),
            (false, None) => Arc::new(Engine::new(self.limiter, shared)),
        };
        Ok(RateLimitLayer {
            engine,
            kind: PhantomData,
        })
    }
}

/// In delay mode, a request whose check holds a shaper and a concurrency policy keeps the
/// lease taken with its turn while it waits. The lease's time runs from when the check was
/// sent, and the wait starts when the store answers (within `timeout`): a lease sure to last
/// no longer than `max_wait` and `timeout` together could lapse before the handler runs.
/// Renewed, it lasts at least `max` and two thirds of a TTL (the last renewal comes up to a
/// third of a TTL before `max`).
fn lease_lapses_in_wait(
    rules: &[Rule],
    mode: Mode,
    renew_leases: Option<Duration>,
    timeout: Duration,
) -> Option<ConfigError> {
    let Mode::Delay { max_wait } = mode else {
        return None;
    };
    let needed = max_wait.saturating_add(timeout);
    rules.iter().find_map(|r| {
        let Kind::Concurrency(c) = r.policy().kind() else {
            return None;
        };
        let shaped = rules
            .iter()
            .any(|s| matches!(s.policy().kind(), Kind::Shaper(_)) && s.may_overlap(r));
        let ttl = Duration::from_micros(c.lease_ttl_us());
        let lasts = renew_leases.map_or(ttl, |max| max.saturating_add(ttl * 2 / 3).max(ttl));
        (shaped && lasts <= needed).then(|| ConfigError::LeaseShorterThanWait {
            policy: r.policy().name().to_owned(),
            lasts,
            needed,
        })
    })
}

/// The most units `policy` admits to one request in `mode`: its limit, and for a shaper in
/// delay mode, what its burst and the longest wait can reserve.
fn most_at_once(policy: &Policy, mode: Mode) -> u64 {
    match (policy.kind(), mode) {
        (Kind::Shaper(s), Mode::Delay { max_wait }) => {
            s.limit(u64::try_from(max_wait.as_micros()).unwrap_or(u64::MAX))
        }
        _ => policy.limit(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn build(rules: Vec<Rule>, mode: Mode) -> Result<RateLimitLayer, ConfigError> {
        rules
            .into_iter()
            .fold(RateLimitLayer::builder(MemoryLimiter::new()), |b, r| {
                b.rule(r)
            })
            .mode(mode)
            .build()
    }

    fn policy(p: Result<Policy, floodgate_core::PolicyError>, name: &str) -> Policy {
        p.and_then(|p| p.named(name)).expect("valid policy")
    }

    #[test]
    fn a_layer_needs_rules_with_distinct_names() {
        assert_eq!(
            build(vec![], Mode::Reject).err(),
            Some(ConfigError::NoRules)
        );
        let rules = vec![
            Rule::new(policy(Policy::per_second(5), "a")),
            Rule::new(policy(Policy::per_minute(50), "a")),
        ];
        assert_eq!(
            build(rules, Mode::Reject).err(),
            Some(ConfigError::DuplicatePolicy { name: "a".into() })
        );
    }

    #[test]
    fn a_lease_that_could_lapse_in_a_delay_is_refused() {
        let layer = |ttl_s: u64, max_wait_s: u64, renew_s: Option<u64>| {
            let rules = vec![
                Rule::new(policy(Policy::shaper(1, Duration::from_secs(1)), "turns")),
                Rule::new(policy(
                    Policy::concurrency(2, Duration::from_secs(ttl_s)),
                    "slots",
                )),
            ];
            let builder = rules
                .into_iter()
                .fold(RateLimitLayer::builder(MemoryLimiter::new()), |b, r| {
                    b.rule(r)
                })
                .delay(Duration::from_secs(max_wait_s));
            match renew_s {
                Some(s) => builder.renew_leases_up_to(Duration::from_secs(s)).build(),
                None => builder.build(),
            }
        };
        // The wait may start up to the layer's timeout (500 ms) after the lease was asked for.
        assert_eq!(
            layer(30, 30, None).err(),
            Some(ConfigError::LeaseShorterThanWait {
                policy: "slots".into(),
                lasts: Duration::from_secs(30),
                needed: Duration::from_millis(30_500),
            })
        );
        let message = layer(10, 30, None).expect_err("refused").to_string();
        assert!(
            message.contains("\"slots\"") && message.contains("30.5s"),
            "{message}"
        );
        assert!(layer(31, 30, None).is_ok());
        assert!(
            layer(10, 30, Some(3600)).is_ok(),
            "renewed leases do not lapse"
        );
        // Renewal stops after `max`: 25 s and two thirds of a 3 s TTL fall short of 30.5 s.
        assert!(layer(3, 30, Some(25)).is_err());
        assert!(layer(3, 30, Some(29)).is_ok());
        // Without a shaper checked beside it, no request waits holding a lease.
        let delay = Mode::Delay {
            max_wait: Duration::from_secs(30),
        };
        let slots = || {
            Rule::new(policy(
                Policy::concurrency(2, Duration::from_secs(1)),
                "slots",
            ))
        };
        let turns = || Rule::new(policy(Policy::shaper(1, Duration::from_secs(1)), "turns"));
        assert!(build(vec![slots()], delay).is_ok());
        for (shaped, slotted, apart) in [
            (
                turns().path_prefix("/shaped"),
                slots().path_prefix("/other"),
                true,
            ),
            (
                turns().path_prefix("/api"),
                slots().path_prefix("/api/x"),
                false,
            ),
            (
                turns().path_prefix("/api"),
                slots().path_prefix("/apix"),
                true,
            ),
            (turns().path_prefix("/api"), slots(), false),
            (
                turns().methods([http::Method::POST]),
                slots().methods([http::Method::GET]),
                true,
            ),
            (
                turns().methods([http::Method::GET]),
                slots().methods([http::Method::HEAD]),
                false,
            ),
        ] {
            let built = build(vec![shaped.clone(), slotted.clone()], delay);
            assert_eq!(built.is_ok(), apart, "{shaped:?} {slotted:?}");
        }
    }

    #[test]
    fn invalid_leasing_settings_are_refused_naming_the_setting() {
        let layer = |cfg: LeasingConfig| {
            RateLimitLayer::builder(MemoryLimiter::new())
                .rule(Rule::new(policy(Policy::per_second(5), "five")))
                .leasing(cfg)
                .build()
        };
        assert!(layer(LeasingConfig::default()).is_ok());
        for (cfg, field) in [
            (
                LeasingConfig {
                    fraction: f64::NAN,
                    ..LeasingConfig::default()
                },
                "leasing fraction",
            ),
            (
                LeasingConfig {
                    fraction: 1.5,
                    ..LeasingConfig::default()
                },
                "leasing fraction",
            ),
            (
                LeasingConfig {
                    lease_for: Duration::ZERO,
                    ..LeasingConfig::default()
                },
                "leasing lease_for",
            ),
            (
                LeasingConfig {
                    hot_after: 0,
                    ..LeasingConfig::default()
                },
                "leasing hot_after",
            ),
            (
                LeasingConfig {
                    min_units: 20_000,
                    ..LeasingConfig::default()
                },
                "leasing min_units",
            ),
        ] {
            match layer(cfg) {
                Err(ConfigError::Leasing { message }) => {
                    assert!(message.contains(field), "{message}");
                }
                other => panic!("{field}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_fixed_cost_above_what_the_policy_admits_at_once_is_refused() {
        let five = || policy(Policy::per_second(5), "five");
        assert!(build(vec![Rule::new(five()).cost(5)], Mode::Reject).is_ok());
        let err = build(vec![Rule::new(five()).cost(6)], Mode::Reject).err();
        assert_eq!(
            err,
            Some(ConfigError::CostAboveLimit {
                policy: "five".into(),
                cost: 6,
                limit: 5
            })
        );
        let message = err.map(|e| e.to_string()).unwrap_or_default();
        assert!(
            message.contains("\"five\" costs 6") && message.contains("(5)"),
            "{message}"
        );
        // A cost known only per request is not checked here: it may fit.
        assert!(build(vec![Rule::new(five()).cost_fn(|_| 6)], Mode::Reject).is_ok());
    }

    #[test]
    fn a_shaper_in_delay_mode_admits_what_its_wait_can_reserve() {
        // 10 per second, burst 1: one every 100 ms; waiting up to 1 s reserves 10 more.
        let shaper = || policy(Policy::shaper(10, Duration::from_secs(1)), "shaper");
        let delay = Mode::Delay {
            max_wait: Duration::from_secs(1),
        };
        assert!(build(vec![Rule::new(shaper()).cost(11)], delay).is_ok());
        assert_eq!(
            build(vec![Rule::new(shaper()).cost(12)], delay).err(),
            Some(ConfigError::CostAboveLimit {
                policy: "shaper".into(),
                cost: 12,
                limit: 11
            })
        );
        // Without waiting, only its burst.
        assert!(matches!(
            build(vec![Rule::new(shaper()).cost(2)], Mode::Reject),
            Err(ConfigError::CostAboveLimit { limit: 1, .. })
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn the_largest_cost_a_delayed_shaper_accepts_is_admitted() {
        use tower::{Service, ServiceExt};
        let shaper = policy(Policy::shaper(10, Duration::from_secs(1)), "shaper");
        let delay = Mode::Delay {
            max_wait: Duration::from_secs(1),
        };
        let rule = Rule::new(shaper).key(crate::key::GlobalKey).cost(11);
        let layer = build(vec![rule], delay).expect("the largest cost that fits");
        let mut svc = layer.layer(tower::service_fn(|_: http::Request<()>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
        }));
        let started = tokio::time::Instant::now();
        let response = svc
            .ready()
            .await
            .expect("ready")
            .call(http::Request::new(()))
            .await
            .expect("response");
        assert_eq!(response.status(), http::StatusCode::OK);
        // It waited its whole turn: one burst now, ten more at 100 ms each.
        assert!(
            started.elapsed() >= Duration::from_millis(999),
            "{:?}",
            started.elapsed()
        );
    }
}
