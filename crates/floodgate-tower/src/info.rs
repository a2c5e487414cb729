//! [`RateLimitInfo`]: the decision, for handlers and rejection handlers.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use floodgate_core::{Decision, Policy};
use smallvec::SmallVec;

use crate::rule::RuleEntry;

/// The rules of one request, by position in the layer's table; sized for the usual one or two.
pub(crate) type RuleIds = SmallVec<[usize; 2]>;

/// Where a decision came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DecisionSource {
    /// The layer's limiter (memory, Redis, ...).
    Store,
    /// The local in-memory fallback, because the store failed or timed out.
    Fallback,
    /// Nobody: the store failed and the layer fails open. There are no decisions.
    FailOpen,
    /// Nobody: no rule applied to the request (none matched its path or method, or each one
    /// that did found no key and lets such requests through). There are no policies.
    NotLimited,
}

/// The rate-limit decision of a request: inserted into the request's extensions before the
/// inner service is called (an axum extractor with feature `axum`), and given to rejection
/// handlers.
///
/// ```
/// # #[cfg(feature = "axum")]
/// async fn handler(info: floodgate_tower::RateLimitInfo) -> String {
///     match info.strictest() {
///         Some((policy, d)) => format!("{} left under {}", d.remaining, policy.name()),
///         None => "not limited".into(),
///     }
/// }
/// ```
#[derive(Clone)]
pub struct RateLimitInfo {
    pub(crate) table: Arc<[RuleEntry]>,
    pub(crate) rules: RuleIds,
    pub(crate) decisions: SmallVec<[Decision; 2]>,
    pub(crate) strictest: Option<usize>,
    pub(crate) source: DecisionSource,
    pub(crate) waited: Duration,
}

impl RateLimitInfo {
    /// Puts this info into a request's extensions; one of a layer that limited nothing
    /// ([`DecisionSource::NotLimited`]) does not replace the info of another layer in front.
    pub(crate) fn insert_into(self, extensions: &mut http::Extensions) {
        if self.source == DecisionSource::NotLimited && extensions.get::<RateLimitInfo>().is_some()
        {
            return;
        }
        extensions.insert(self);
    }

    /// The policies that applied to the request, in the layer's rule order.
    pub fn policies(&self) -> impl ExactSizeIterator<Item = &Policy> + '_ {
        self.rules.iter().map(|&i| self.table[i].rule.policy())
    }

    /// Each applied policy with its decision (empty when the layer failed open or no rule
    /// applied).
    pub fn iter(&self) -> impl Iterator<Item = (&Policy, &Decision)> + '_ {
        self.policies().zip(self.decisions.iter())
    }

    /// The decisions, in the order of [`RateLimitInfo::policies`].
    pub fn decisions(&self) -> &[Decision] {
        &self.decisions
    }

    /// The decision of the policy named `name`.
    pub fn decision(&self, name: &str) -> Option<&Decision> {
        self.iter().find(|(p, _)| p.name() == name).map(|(_, d)| d)
    }

    /// The most constraining policy and its decision: the one that denied (with the longest
    /// wait), or the one with the least remaining.
    pub fn strictest(&self) -> Option<(&Policy, &Decision)> {
        let i = self.strictest?;
        Some((self.table[self.rules[i]].rule.policy(), &self.decisions[i]))
    }

    /// Whether every policy allowed (true when the layer failed open).
    pub fn allowed(&self) -> bool {
        self.decisions.iter().all(|d| d.allowed)
    }

    /// Where the decision came from.
    pub fn source(&self) -> DecisionSource {
        self.source
    }

    /// Whether the local fallback decided, because the store failed.
    pub fn is_fallback(&self) -> bool {
        self.source == DecisionSource::Fallback
    }

    /// Whether the store failed and the layer let the request through undecided.
    pub fn is_fail_open(&self) -> bool {
        self.source == DecisionSource::FailOpen
    }

    /// How long the request waited in delay mode.
    pub fn waited(&self) -> Duration {
        self.waited
    }

    /// The time until the strictest policy admits the request again, when it denied.
    pub fn retry_after(&self) -> Option<Duration> {
        self.strictest()
            .filter(|(_, d)| !d.allowed)
            .and_then(|(_, d)| d.retry_after)
    }
}

impl fmt::Debug for RateLimitInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        struct Decisions<'a>(&'a RateLimitInfo);
        impl fmt::Debug for Decisions<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_map()
                    .entries(self.0.iter().map(|(p, d)| (p.name(), d)))
                    .finish()
            }
        }
        f.debug_struct("RateLimitInfo")
            .field("decisions", &Decisions(self))
            .field("strictest", &self.strictest().map(|(p, _)| p.name()))
            .field("source", &self.source)
            .field("waited", &self.waited)
            .finish()
    }
}

#[cfg(feature = "axum")]
mod axum_impl {
    use std::convert::Infallible;

    use axum::extract::{FromRequestParts, OptionalFromRequestParts};
    use axum::response::{IntoResponse, Response};
    use http::StatusCode;
    use http::request::Parts;

    use super::RateLimitInfo;

    /// The rejection of the [`RateLimitInfo`] extractor when no rate-limit layer ran: a
    /// server configuration error (500). Use `Option<RateLimitInfo>` where that is expected.
    #[derive(Clone, Copy, Debug, Default)]
    #[non_exhaustive]
    pub struct MissingRateLimitInfo;

    impl IntoResponse for MissingRateLimitInfo {
        fn into_response(self) -> Response {
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "RateLimitInfo is missing: is the RateLimitLayer in front of this handler?",
            )
                .into_response()
        }
    }

    impl std::fmt::Display for MissingRateLimitInfo {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("no RateLimitInfo in the request extensions")
        }
    }

    impl std::error::Error for MissingRateLimitInfo {}

    impl<S: Send + Sync> FromRequestParts<S> for RateLimitInfo {
        type Rejection = MissingRateLimitInfo;

        async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
            parts
                .extensions
                .get::<RateLimitInfo>()
                .cloned()
                .ok_or(MissingRateLimitInfo)
        }
    }

    impl<S: Send + Sync> OptionalFromRequestParts<S> for RateLimitInfo {
        type Rejection = Infallible;

        async fn from_request_parts(
            parts: &mut Parts,
            _: &S,
        ) -> Result<Option<Self>, Self::Rejection> {
            Ok(parts.extensions.get::<RateLimitInfo>().cloned())
        }
    }
}

#[cfg(feature = "axum")]
pub use axum_impl::MissingRateLimitInfo;
