//! [`Rule`]: a policy, the key it counts, its cost, and the requests it applies to.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use floodgate_core::Policy;
use http::{HeaderValue, Method};

use crate::key::{
    AnyExtractor, AsyncKeyExtractor, Key, KeyExtractor, PeerIp, RequestView, canonical_path,
};
use crate::layer::OnMissingKey;
use crate::telemetry::PolicyMetrics;

/// One policy of a layer: what is counted (the key), how much a request costs, and which
/// requests it applies to (all by default).
///
/// ```
/// use floodgate_core::Policy;
/// use floodgate_tower::Rule;
/// use floodgate_tower::key::{GlobalKey, HeaderKey};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// // 5 logins per minute per client, on POST /login only.
/// let login = Rule::new(Policy::per_minute(5)?.named("login")?)
///     .path_prefix("/login")
///     .methods([http::Method::POST]);
/// // 1000 per second for the whole service, uploads cost 10.
/// let global = Rule::new(Policy::per_second(1000)?.named("global")?)
///     .key(GlobalKey)
///     .cost_fn(|req| if req.method() == http::Method::PUT { 10 } else { 1 });
/// // Per API key.
/// let api = Rule::new(Policy::per_hour(10_000)?.named("api-key")?).key(HeaderKey::named("x-api-key")?);
/// # let _ = (login, global, api);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Rule {
    policy: Policy,
    pub(crate) key: AnyExtractor,
    cost: Cost,
    prefixes: Vec<Arc<str>>,
    /// Each of `prefixes` in canonical form ([`canonical_path`]).
    canonical_prefixes: Vec<Arc<[u8]>>,
    /// Whether a prefix was given in other than its canonical form (with escapes, `//`).
    escaped_prefix: bool,
    routes: Vec<Arc<str>>,
    methods: Vec<Method>,
    predicate: Option<Predicate>,
    pub(crate) on_missing_key: Option<OnMissingKey>,
    pub(crate) fail_closed: bool,
}

type Predicate = Arc<dyn Fn(&RequestView<'_>) -> bool + Send + Sync>;

/// Whether `path` is `prefix` or under it, segment-wise (`/api` holds `/api/x`, not `/apix`).
fn under(path: &[u8], prefix: &[u8]) -> bool {
    prefix.is_empty()
        || path
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with(b"/"))
}

#[derive(Clone)]
enum Cost {
    Fixed(u64),
    Dynamic(Arc<dyn Fn(&RequestView<'_>) -> u64 + Send + Sync>),
}

impl Rule {
    /// A rule for `policy`, keyed on the peer IP ([`PeerIp`]; behind proxies use
    /// [`crate::key::ClientIp`]), costing 1, applying to every request.
    pub fn new(policy: Policy) -> Self {
        Rule {
            policy,
            key: AnyExtractor::sync(PeerIp::new()),
            cost: Cost::Fixed(1),
            prefixes: Vec::new(),
            canonical_prefixes: Vec::new(),
            escaped_prefix: false,
            routes: Vec::new(),
            methods: Vec::new(),
            predicate: None,
            on_missing_key: None,
            fail_closed: false,
        }
    }

    /// Keys requests with `key`.
    #[must_use]
    pub fn key(mut self, key: impl KeyExtractor) -> Self {
        self.key = AnyExtractor::sync(key);
        self
    }

    /// Keys requests with a closure (the same as [`Rule::key`], with the closure's argument
    /// type spelled out for you).
    #[must_use]
    pub fn key_fn<F>(self, key: F) -> Self
    where
        F: Fn(&RequestView<'_>) -> Option<Key> + Send + Sync + 'static,
    {
        self.key(key)
    }

    /// Keys requests with an asynchronous extractor.
    #[must_use]
    pub fn key_async(mut self, key: impl AsyncKeyExtractor) -> Self {
        self.key = AnyExtractor::asynchronous(key);
        self
    }

    /// Each request costs `cost` units (0 only peeks). A cost above what the policy admits at
    /// once makes [`build`](crate::RateLimitLayerBuilder::build) fail with
    /// [`ConfigError::CostAboveLimit`](crate::ConfigError::CostAboveLimit). The rate-limit
    /// headers count requests: their quota and remaining are the policy's units divided by
    /// `cost`.
    #[must_use]
    pub fn cost(mut self, cost: u64) -> Self {
        self.cost = Cost::Fixed(cost);
        self
    }

    /// Each request costs what `cost` says. The rate-limit headers then count the policy's
    /// units, not requests.
    #[must_use]
    pub fn cost_fn(
        mut self,
        cost: impl Fn(&RequestView<'_>) -> u64 + Send + Sync + 'static,
    ) -> Self {
        self.cost = Cost::Dynamic(Arc::new(cost));
        self
    }

    /// Applies to paths under `prefix` (segment-wise: `/api` matches `/api` and `/api/x`,
    /// not `/apix`). With several prefixes and routes, any one matching is enough.
    ///
    /// A path matches as it is sent or in its canonical form: percent-escapes decoded (`%2F` to
    /// `/`, as a file server reads it), empty and `.` segments dropped, `..` segments taking the
    /// one before them away. Some handlers decode paths before they act on them (axum's path
    /// parameters, `ServeDir`, a proxy in front that normalises), so `/v1/%73ms/send`,
    /// `/v1/./sms//send` and `/v1%2Fsms%2Fsend` count under `/v1/sms` too, whether or not the
    /// router sends them to the same handler. A prefix given with escapes (`/%7Euser`) matches
    /// either spelling of the path (`/~user`) as well.
    #[must_use]
    pub fn path_prefix(mut self, prefix: &str) -> Self {
        let trimmed = prefix.trim_end_matches('/');
        let canonical = canonical_path(trimmed);
        let canonical = canonical.strip_suffix(b"/").unwrap_or(&canonical);
        self.prefixes.push(trimmed.into());
        self.escaped_prefix |= canonical != trimmed.as_bytes();
        self.canonical_prefixes.push(canonical.into());
        self
    }

    /// Applies to the axum route pattern `route` (`/users/{id}`), as in `MatchedPath`.
    #[cfg(feature = "axum")]
    #[must_use]
    pub fn route(mut self, route: &str) -> Self {
        self.routes.push(route.into());
        self
    }

    /// Applies only to these methods. `GET` covers `HEAD` too: a `HEAD` request is a `GET`
    /// without the body, and routers answer it with the `GET` handler (axum does), which does
    /// the work all the same.
    #[must_use]
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods.extend(methods);
        self
    }

    /// Applies only to requests for which `predicate` holds (on top of paths and methods).
    #[must_use]
    pub fn when(
        mut self,
        predicate: impl Fn(&RequestView<'_>) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.predicate = Some(Arc::new(predicate));
        self
    }

    /// What to do when this rule finds no key (overrides the layer's setting).
    #[must_use]
    pub fn on_missing_key(mut self, on_missing_key: OnMissingKey) -> Self {
        self.on_missing_key = Some(on_missing_key);
        self
    }

    /// Refuses the requests this rule applies to when the store cannot decide (503, gRPC
    /// `UNAVAILABLE`), whatever the layer's [`crate::OnStoreError`]: for a limit that must hold
    /// across replicas even while Redis is down ("one SMS per phone per 30 minutes"), which the
    /// local fallback would multiply by the number of replicas and failing open would lift.
    /// Requests that no such rule applies to keep the layer's failure policy, so one layer can
    /// fail closed on `/v1/sms` and fall back on everything else.
    #[must_use]
    pub fn fail_closed(mut self) -> Self {
        self.fail_closed = true;
        self
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Whether the rule applies to `req`.
    pub fn applies_to(&self, req: &RequestView<'_>) -> bool {
        if !self.methods.is_empty() && !self.applies_to_method(req.method()) {
            return false;
        }
        let scoped = !self.prefixes.is_empty() || !self.routes.is_empty();
        if scoped && !self.matches_prefix(req.path()) && !self.matches_route(req) {
            return false;
        }
        self.predicate.as_ref().is_none_or(|p| p(req))
    }

    /// Whether some request could have both rules apply. `false` only when both list methods
    /// and none meets (`GET` covering `HEAD`), or both are scoped to path prefixes alone and
    /// none is under another (as written or in canonical form), or to routes alone and share
    /// none; predicates are taken to hold.
    pub(crate) fn may_overlap(&self, other: &Rule) -> bool {
        let meets = |m: &Method| {
            other.applies_to_method(m)
                || (*m == Method::GET && other.methods.contains(&Method::HEAD))
        };
        if !self.methods.is_empty() && !other.methods.is_empty() && !self.methods.iter().any(meets)
        {
            return false;
        }
        let by_prefix = |r: &Rule| !r.prefixes.is_empty() && r.routes.is_empty();
        let by_route = |r: &Rule| r.prefixes.is_empty() && !r.routes.is_empty();
        if by_prefix(self) && by_prefix(other) {
            let prefixes = |r: &Rule| -> Vec<Vec<u8>> {
                let raw = r.prefixes.iter().map(|p| p.as_bytes().to_vec());
                raw.chain(r.canonical_prefixes.iter().map(|p| p.to_vec()))
                    .collect()
            };
            let (mine, theirs) = (prefixes(self), prefixes(other));
            return mine
                .iter()
                .any(|a| theirs.iter().any(|b| under(a, b) || under(b, a)));
        }
        if by_route(self) && by_route(other) {
            return self.routes.iter().any(|r| other.routes.contains(r));
        }
        true
    }

    fn applies_to_method(&self, method: &Method) -> bool {
        self.methods.contains(method)
            || (*method == Method::HEAD && self.methods.contains(&Method::GET))
    }

    /// Whether `path`, as sent or in canonical form, is under one of the prefixes.
    fn matches_prefix(&self, path: &str) -> bool {
        if self.prefixes.is_empty() {
            return false;
        }
        if self
            .prefixes
            .iter()
            .any(|p| under(path.as_bytes(), p.as_bytes()))
        {
            return true;
        }
        // A path canonical already was matched above, unless a prefix was given with escapes
        // (`/%7Euser`): its canonical form is one the path may be sent in.
        let canonical = canonical_path(path);
        (self.escaped_prefix || !matches!(canonical, Cow::Borrowed(_)))
            && self.canonical_prefixes.iter().any(|p| under(&canonical, p))
    }

    #[cfg(feature = "axum")]
    fn matches_route(&self, req: &RequestView<'_>) -> bool {
        !self.routes.is_empty()
            && req
                .matched_path()
                .is_some_and(|m| self.routes.iter().any(|r| **r == *m))
    }

    #[cfg(not(feature = "axum"))]
    fn matches_route(&self, _: &RequestView<'_>) -> bool {
        false
    }

    /// The cost of every request, when it is fixed ([`Rule::cost`]); `None` for
    /// [`Rule::cost_fn`].
    pub(crate) fn fixed_cost(&self) -> Option<u64> {
        match &self.cost {
            Cost::Fixed(c) => Some(*c),
            Cost::Dynamic(_) => None,
        }
    }

    /// The cost of `req`.
    pub fn cost_of(&self, req: &RequestView<'_>) -> u64 {
        match &self.cost {
            Cost::Fixed(c) => *c,
            Cost::Dynamic(f) => f(req),
        }
    }
}

impl fmt::Debug for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Rule");
        d.field("policy", &self.policy.name())
            .field("key", &self.key);
        match &self.cost {
            Cost::Fixed(c) => d.field("cost", c),
            Cost::Dynamic(_) => d.field("cost", &"dynamic"),
        };
        d.field("path_prefixes", &self.prefixes)
            .field("routes", &self.routes)
            .field("methods", &self.methods)
            .field("predicate", &self.predicate.is_some())
            .field("fail_closed", &self.fail_closed)
            .finish()
    }
}

/// A rule as the layer holds it: with its pre-rendered header item and its counters.
#[derive(Debug)]
pub(crate) struct RuleEntry {
    pub(crate) rule: Rule,
    pub(crate) policy_item: HeaderValue,
    /// What a request costs, when every one costs the same and more than 1 (else 1): the unit
    /// the headers count in.
    pub(crate) unit: u64,
    pub(crate) metrics: PolicyMetrics,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_matching() {
        let p = Policy::per_second(1).expect("policy");
        let rule = Rule::new(p.clone())
            .path_prefix("/api/")
            .path_prefix("/login")
            .methods([Method::POST]);
        let check = |method: Method, path: &str| {
            let req = http::Request::builder()
                .method(method)
                .uri(path)
                .body(())
                .expect("request");
            rule.applies_to(&RequestView::from_request(&req))
        };
        assert!(check(Method::POST, "/api"));
        assert!(check(Method::POST, "/api/x/y"));
        assert!(check(Method::POST, "/login"));
        assert!(!check(Method::POST, "/loginx"));
        assert!(!check(Method::GET, "/login"));
        assert!(!check(Method::POST, "/"));
        // HEAD is a GET without its body.
        assert!(!check(Method::HEAD, "/login"));
        let reads = Rule::new(p.clone()).methods([Method::GET]);
        let req = http::Request::head("/x").body(()).expect("request");
        assert!(reads.applies_to(&RequestView::from_request(&req)));
        let req = http::Request::post("/x").body(()).expect("request");
        assert!(!reads.applies_to(&RequestView::from_request(&req)));
        // Spellings of a path under the prefix, and of paths that are not.
        for (path, under) in [
            ("/api%2fx", true),
            ("/login%2Fx", true),
            ("/login%2F.%2Fx", true),
            ("/%61pi/x", true),
            ("/%61pi", true),
            ("/api/../login", true),
            ("//login", true),
            ("/./login/", true),
            ("/x/../../login", true),
            ("/login/..", true),
            // As sent, it is under the prefix.
            ("/login/../x", true),
            ("/x/../loginx", false),
            ("/%2e%2e/login", true),
            ("/log%69nx", false),
            ("/logi%6e%2Fx", true),
            ("/login%252Fx", false),
            ("/.", false),
            ("/login%", false),
        ] {
            assert_eq!(check(Method::POST, path), under, "{path}");
        }
        let all = Rule::new(p).path_prefix("/");
        let req = http::Request::get("/anything").body(()).expect("request");
        assert!(all.applies_to(&RequestView::from_request(&req)));
    }

    #[test]
    fn a_prefix_configured_with_escapes_matches_the_plain_spelling_too() {
        let p = Policy::per_second(1).expect("policy");
        let rule = Rule::new(p)
            .path_prefix("/v1/items%3AbatchGet")
            .path_prefix("/%7Euser");
        let check = |path: &str| {
            let req = http::Request::get(path).body(()).expect("request");
            rule.applies_to(&RequestView::from_request(&req))
        };
        for (path, under) in [
            ("/v1/items%3AbatchGet", true),
            ("/v1/items:batchGet", true),
            ("/v1/items:batchGet/x", true),
            ("/~user/x", true),
            ("/%7euser", true),
            ("/~users", false),
            ("/v1/items", false),
        ] {
            assert_eq!(check(path), under, "{path}");
        }
    }
}
