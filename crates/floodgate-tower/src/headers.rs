//! Rate-limit response headers.
//!
//! The IETF fields follow draft-ietf-httpapi-ratelimit-headers-11 (May 2026): both are
//! structured-field lists with one item per policy, named by the policy's name.
//!
//! - `RateLimit-Policy: "<name>";q=<limit>;w=<window secs>` — the quota and its window
//!   (concurrency limits: `;qu="concurrent-requests"` and no window). Rendered once per rule.
//! - `RateLimit: "<name>";r=<remaining>;t=<secs>` — what is left, and for how long: the time
//!   until the key is back to full, or, for a policy that denied, until it admits again
//!   (so that `Retry-After` never points before the end of a denied policy's `t`; a policy
//!   that still allows may show a later `t`, its time to refill, which is not a wait).
//!
//! `q` and `r` count requests, the draft's default unit: under a rule whose requests cost `c`
//! units each ([`crate::Rule::cost`]), they are the policy's units divided by `c`, rounded
//! down, and so are the legacy limit and remaining. A rule with a cost function
//! ([`crate::Rule::cost_fn`]) has no one cost per request: its headers count the policy's
//! units.
//!
//! Legacy `X-RateLimit-Limit`, `X-RateLimit-Remaining` and `X-RateLimit-Reset` (seconds) are
//! optional and describe the strictest policy.
//!
//! Rejections carry them; allowed responses too with
//! [`crate::RateLimitLayerBuilder::headers_on_allowed`] (off by default: rendering and sending
//! them is most of what the layer does for an allowed request).

use std::time::Duration;

use floodgate_core::{Decision, Kind, Policy};
use http::{HeaderMap, HeaderName, HeaderValue};
use smallvec::SmallVec;

/// `RateLimit-Policy`.
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit`.
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
/// `X-RateLimit-Limit`.
pub const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
/// `X-RateLimit-Remaining`.
pub const X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
/// `X-RateLimit-Reset`.
pub const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// Which rate-limit headers responses carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HeaderOptions {
    pub(crate) ietf: bool,
    pub(crate) legacy: bool,
    /// On allowed responses too, not only on rejections.
    pub(crate) allowed: bool,
}

/// One of the rate-limit headers: a byte instead of a [`HeaderName`], so that a
/// [`HeaderBlock`] stays small enough to move cheaply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Field {
    Policy,
    RateLimit,
    Limit,
    Remaining,
    Reset,
}

impl Field {
    pub(crate) fn name(self) -> HeaderName {
        match self {
            Field::Policy => RATELIMIT_POLICY,
            Field::RateLimit => RATELIMIT,
            Field::Limit => X_RATELIMIT_LIMIT,
            Field::Remaining => X_RATELIMIT_REMAINING,
            Field::Reset => X_RATELIMIT_RESET,
        }
    }
}

/// Headers to add to a response (allocated only when there are some: allowed responses carry
/// none by default).
pub(crate) type HeaderBlock = Vec<(Field, HeaderValue)>;

/// Seconds, rounded up (saturating: `Duration::MAX` is `u64::MAX` seconds).
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_secs().saturating_add(u64::from(d.subsec_nanos() > 0))
}

/// The `RateLimit-Policy` item of `policy`, which admits `limit` units at once (its limit, or
/// for a shaper in delay mode what its burst and the longest wait reserve, as its decisions
/// count) to requests of `unit` units each (see the module docs).
pub(crate) fn policy_item(policy: &Policy, limit: u64, unit: u64) -> HeaderValue {
    let mut s = format!("\"{}\";q={}", policy.name(), limit / unit.max(1));
    if matches!(policy.kind(), Kind::Concurrency(_)) {
        s.push_str(";qu=\"concurrent-requests\"");
    } else if let Some(w) = policy.window() {
        s.push_str(";w=");
        s.push_str(itoa::Buffer::new().format(ceil_secs(w).max(1)));
    }
    HeaderValue::from_str(&s).unwrap_or_else(|_| HeaderValue::from_static("\"invalid\";q=0"))
}

/// The `t` of a decision: see the module docs.
pub(crate) fn effective_window(d: &Decision) -> Duration {
    match (d.allowed, d.retry_after) {
        (false, Some(retry)) => retry,
        _ => d.reset_after,
    }
}

/// Appends the headers of `decisions` (with the pre-rendered policy items) to `out`.
pub(crate) fn render<'a>(
    opts: HeaderOptions,
    items: impl Iterator<Item = Item<'a>> + Clone,
    strictest: Option<(&Decision, u64)>,
    out: &mut HeaderBlock,
) {
    if opts.ietf {
        for (_, item, _, _) in items.clone() {
            out.push((Field::Policy, item.clone()));
        }
        // Room for every item: `, "<name>";r=<u64>;t=<u64>`. On the stack when it fits: the
        // one allocation is the header value's own.
        let room: usize = items.clone().map(|(p, ..)| p.name().len() + 50).sum();
        let value = if room <= 128 {
            let mut buf = [0u8; 128];
            let len = write_ratelimit(items, &mut buf);
            HeaderValue::from_bytes(&buf[..len])
        } else {
            let mut buf = vec![0u8; room];
            let len = write_ratelimit(items, &mut buf);
            HeaderValue::from_bytes(&buf[..len])
        };
        if let Ok(v) = value {
            out.push((Field::RateLimit, v));
        }
    }
    if opts.legacy
        && let Some((d, unit)) = strictest
    {
        out.push((Field::Limit, HeaderValue::from(d.limit / unit.max(1))));
        out.push((
            Field::Remaining,
            HeaderValue::from(d.remaining / unit.max(1)),
        ));
        out.push((
            Field::Reset,
            HeaderValue::from(ceil_secs(effective_window(d))),
        ));
    }
}

/// One policy's part of the headers: the policy, its pre-rendered `RateLimit-Policy` item, its
/// decision, and what a request costs (the unit `q` and `r` are counted in).
pub(crate) type Item<'a> = (&'a Policy, &'a HeaderValue, &'a Decision, u64);

/// Writes the `RateLimit` value of `items` into `buf` (large enough), returning its length.
fn write_ratelimit<'a>(items: impl Iterator<Item = Item<'a>>, buf: &mut [u8]) -> usize {
    let mut w = Writer { buf, len: 0 };
    let mut itoa = itoa::Buffer::new();
    for (i, (policy, _, d, unit)) in items.enumerate() {
        if i > 0 {
            w.put(b", ");
        }
        w.put(b"\"");
        w.put(policy.name().as_bytes());
        w.put(b"\";r=");
        w.put(itoa.format(d.remaining / unit.max(1)).as_bytes());
        if !matches!(policy.kind(), Kind::Concurrency(_)) {
            w.put(b";t=");
            w.put(itoa.format(ceil_secs(effective_window(d))).as_bytes());
        }
    }
    w.len
}

/// A cursor over a buffer sized beforehand: cheaper per write than a growable vector.
struct Writer<'a> {
    buf: &'a mut [u8],
    len: usize,
}

impl Writer<'_> {
    fn put(&mut self, bytes: &[u8]) {
        if let Some(dst) = self.buf.get_mut(self.len..self.len + bytes.len()) {
            dst.copy_from_slice(bytes);
            self.len += bytes.len();
        }
    }
}

/// Adds the rate-limit headers the layer sends, describing `verdict` for `policies` (in the same
/// order), to `headers`: the IETF fields, the legacy `X-RateLimit-*` when `legacy`, and
/// `Retry-After` when the verdict is a denial with a retry time. For handlers that check limits
/// themselves (on a key only the body reveals, say) and answer like the layer.
///
/// ```
/// use floodgate_core::{Check, CheckOptions, MemoryLimiter, Policy};
///
/// let limiter = MemoryLimiter::new();
/// let policy = Policy::per_minute(1).unwrap();
/// let check = [Check::new(b"+8613800000000", &policy)];
/// limiter.check_sync(&check, CheckOptions::default()).unwrap();
/// let denied = limiter.check_sync(&check, CheckOptions::default()).unwrap();
/// let mut headers = http::HeaderMap::new();
/// floodgate_tower::headers::insert_headers(&mut headers, &[&policy], &denied, false);
/// assert_eq!(headers["retry-after"], "60");
/// assert_eq!(headers["ratelimit"], "\"gcra-1-per-1m\";r=0;t=60");
/// ```
pub fn insert_headers(
    headers: &mut HeaderMap,
    policies: &[&Policy],
    verdict: &floodgate_core::Verdict,
    legacy: bool,
) {
    let items: SmallVec<[HeaderValue; 4]> = policies
        .iter()
        .map(|p| policy_item(p, p.limit(), 1))
        .collect();
    let mut block = HeaderBlock::new();
    let strictest = verdict.decision();
    render(
        HeaderOptions {
            ietf: true,
            legacy,
            allowed: true,
        },
        policies
            .iter()
            .zip(&items)
            .zip(&verdict.decisions)
            .map(|((p, i), d)| (*p, i, d, 1)),
        strictest.as_ref().map(|d| (d, 1)),
        &mut block,
    );
    apply(block, headers);
    if let Some(retry) = strictest.filter(|d| !d.allowed).and_then(|d| d.retry_after) {
        headers.insert(
            http::header::RETRY_AFTER,
            HeaderValue::from(ceil_secs(retry).max(1)),
        );
    }
}

/// Adds `block` to `headers`: the IETF fields appended (a list field may come in several
/// lines, one per layer). The legacy single-value ones describe one policy, the strictest: they
/// replace those already there (an inner layer's, or the inner service's) only when those
/// leave more remaining, so that neither two `X-RateLimit-Limit` lines nor an outer layer's
/// looser figures over an inner layer's 429 are sent.
pub(crate) fn apply(block: HeaderBlock, headers: &mut HeaderMap) {
    let remaining = |v: &HeaderValue| v.to_str().ok().and_then(|s| s.trim().parse::<u64>().ok());
    let ours = block
        .iter()
        .find(|(f, _)| *f == Field::Remaining)
        .and_then(|(_, v)| remaining(v));
    let theirs = headers.get(X_RATELIMIT_REMAINING).and_then(remaining);
    let legacy = match (ours, theirs) {
        (Some(ours), Some(theirs)) => ours < theirs,
        _ => true,
    };
    for (field, value) in block {
        match field {
            Field::Policy | Field::RateLimit => {
                headers.append(field.name(), value);
            }
            Field::Limit | Field::Remaining | Field::Reset if legacy => {
                headers.insert(field.name(), value);
            }
            Field::Limit | Field::Remaining | Field::Reset => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decision(allowed: bool, remaining: u64, retry_ms: Option<u64>, reset_ms: u64) -> Decision {
        Decision {
            allowed,
            limit: 10,
            remaining,
            retry_after: retry_ms.map(Duration::from_millis),
            reset_after: Duration::from_millis(reset_ms),
        }
    }

    #[test]
    fn retry_after_rounds_up_and_saturates() {
        assert_eq!(ceil_secs(Duration::ZERO), 0);
        assert_eq!(ceil_secs(Duration::from_nanos(1)), 1);
        assert_eq!(ceil_secs(Duration::from_secs(2)), 2);
        assert_eq!(ceil_secs(Duration::from_millis(2_001)), 3);
        assert_eq!(ceil_secs(Duration::MAX), u64::MAX);
    }

    #[test]
    fn renders_ietf_and_legacy() {
        let a = Policy::per_second(10)
            .expect("policy")
            .named("per-ip")
            .expect("name");
        let b = Policy::concurrency(3, Duration::from_secs(30)).expect("policy");
        let c = Policy::fixed_window(100, Duration::from_millis(1500)).expect("policy");
        let items = [
            policy_item(&a, a.limit(), 1),
            policy_item(&b, b.limit(), 1),
            policy_item(&c, c.limit(), 1),
        ];
        assert_eq!(items[0], "\"per-ip\";q=10;w=1");
        assert_eq!(
            items[1],
            "\"concurrency-3-ttl-30s\";q=3;qu=\"concurrent-requests\""
        );
        assert_eq!(items[2], "\"fixed-100-per-1500ms\";q=100;w=2");
        let ds = [
            decision(false, 0, Some(1_200), 900),
            decision(true, 2, None, 0),
            decision(true, 99, None, 1_001),
        ];
        let mut out = HeaderBlock::new();
        let policies = [a, b, c];
        render(
            HeaderOptions {
                ietf: true,
                legacy: true,
                allowed: true,
            },
            policies
                .iter()
                .zip(&items)
                .zip(&ds)
                .map(|((p, i), d)| (p, i, d, 1)),
            Some((&ds[0], 1)),
            &mut out,
        );
        let get = |n: &HeaderName| {
            out.iter()
                .filter(|(k, _)| k.name() == n)
                .map(|(_, v)| v.to_str().expect("ascii"))
                .collect::<Vec<_>>()
        };
        assert_eq!(get(&RATELIMIT_POLICY).len(), 3);
        assert_eq!(
            get(&RATELIMIT),
            [
                "\"per-ip\";r=0;t=2, \"concurrency-3-ttl-30s\";r=2, \"fixed-100-per-1500ms\";r=99;t=2"
            ]
        );
        assert_eq!(get(&X_RATELIMIT_LIMIT), ["10"]);
        assert_eq!(get(&X_RATELIMIT_REMAINING), ["0"]);
        assert_eq!(get(&X_RATELIMIT_RESET), ["2"]);
        assert_eq!(ceil_secs(Duration::ZERO), 0);
        assert_eq!(ceil_secs(Duration::from_millis(1)), 1);
        assert_eq!(ceil_secs(Duration::from_secs(2)), 2);
    }

    #[test]
    fn legacy_fields_keep_the_strictest_and_ietf_fields_are_appended() {
        let legacy = |limit: u64, remaining: u64| {
            vec![
                (Field::RateLimit, HeaderValue::from_static("\"p\";r=1;t=0")),
                (Field::Limit, HeaderValue::from(limit)),
                (Field::Remaining, HeaderValue::from(remaining)),
                (Field::Reset, HeaderValue::from(1)),
            ]
        };
        // An inner layer's looser figures (999 left) are replaced, never doubled.
        let mut headers = HeaderMap::new();
        headers.insert(X_RATELIMIT_LIMIT, HeaderValue::from(1000));
        headers.insert(X_RATELIMIT_REMAINING, HeaderValue::from(999));
        headers.insert(RATELIMIT, HeaderValue::from_static("\"outer\";r=999;t=0"));
        apply(legacy(10, 9), &mut headers);
        let limits: Vec<_> = headers.get_all(X_RATELIMIT_LIMIT).iter().collect();
        assert_eq!(limits, [HeaderValue::from(10)]);
        assert_eq!(headers[X_RATELIMIT_REMAINING], HeaderValue::from(9));
        assert_eq!(headers.get_all(RATELIMIT).iter().count(), 2);
        // Stricter figures already there (an inner layer's 429) stay under looser ones.
        apply(legacy(1000, 999), &mut headers);
        assert_eq!(headers[X_RATELIMIT_LIMIT], HeaderValue::from(10));
        assert_eq!(headers[X_RATELIMIT_REMAINING], HeaderValue::from(9));
        assert_eq!(headers.get_all(X_RATELIMIT_REMAINING).iter().count(), 1);
    }
}
