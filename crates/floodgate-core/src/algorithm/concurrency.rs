//! Concurrency limit: at most `limit` units in flight at once.
//!
//! An admitted request holds a *lease* until it is released (when the work, or the response
//! body, ends). A lease also expires after `lease_ttl`, so a holder that crashed without
//! releasing blocks others for no longer than that.

use std::time::Duration;

use smallvec::SmallVec;

use super::{Algorithm, Ctx, MAX_LIMIT, MAX_SPAN_US, Outcome, Undo};
use crate::clock::duration_micros;
use crate::error::PolicyError;

/// Concurrency limit parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Concurrency {
    limit: u64,
    lease_ttl: u64,
}

/// One lease: who holds it, until when, for how many units.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    /// The lease id.
    pub id: u64,
    /// When the lease lapses unless released or renewed, microseconds since the epoch.
    pub expires_at: u64,
    /// Units it holds.
    pub cost: u64,
}

/// Leases held on one key. May include lapsed leases, which count for nothing.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct State {
    /// Leases, in no particular order.
    pub leases: Vec<Lease>,
}

impl Concurrency {
    /// At most `limit` in flight; a lease lapses after `lease_ttl` unless released or renewed.
    pub fn new(limit: u64, lease_ttl: Duration) -> Result<Self, PolicyError> {
        if limit == 0 {
            return Err(PolicyError::Zero { field: "limit" });
        }
        if limit > MAX_LIMIT {
            return Err(PolicyError::TooLarge {
                field: "limit",
                value: limit.to_string(),
                max: MAX_LIMIT.to_string(),
            });
        }
        let ttl = duration_micros(lease_ttl);
        if ttl == 0 {
            return Err(PolicyError::Zero { field: "lease_ttl" });
        }
        if ttl > MAX_SPAN_US {
            return Err(PolicyError::TooLarge {
                field: "lease_ttl",
                value: format!("{lease_ttl:?}"),
                max: format!("{MAX_SPAN_US}us"),
            });
        }
        Ok(Concurrency {
            limit,
            lease_ttl: ttl,
        })
    }

    /// The limit.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The lease time-to-live, microseconds.
    pub fn lease_ttl_us(&self) -> u64 {
        self.lease_ttl
    }

    /// Releases lease `id`; returns whether it was held (and not lapsed) at `now`.
    pub fn release(&self, state: &mut State, id: u64, now: u64) -> bool {
        let before = state.leases.len();
        let mut live = false;
        state.leases.retain(|l| {
            if l.id == id {
                live = l.expires_at > now;
                false
            } else {
                true
            }
        });
        before != state.leases.len() && live
    }

    /// Extends lease `id` to `now + lease_ttl`; returns whether it was still held.
    pub fn renew(&self, state: &mut State, id: u64, now: u64) -> bool {
        match state
            .leases
            .iter_mut()
            .find(|l| l.id == id && l.expires_at > now)
        {
            Some(l) => {
                l.expires_at = now + self.lease_ttl;
                true
            }
            None => false,
        }
    }
}

impl Algorithm for Concurrency {
    type State = State;

    fn fresh(&self) -> State {
        State::default()
    }

    fn decide(&self, state: &State, ctx: &Ctx) -> Outcome {
        let now = ctx.now;
        let mut live: SmallVec<[(u64, u64); 8]> = state
            .leases
            .iter()
            .filter(|l| l.expires_at > now)
            .map(|l| (l.expires_at, l.cost))
            .collect();
        let used: u64 = live.iter().map(|l| l.1).sum();
        let latest = live.iter().map(|l| l.0).max().unwrap_or(now);
        // Checked: a cost near u64::MAX must not wrap around to "fits".
        if used.checked_add(ctx.cost).is_some_and(|t| t <= self.limit) {
            let end = if ctx.cost > 0 {
                latest.max(now + self.lease_ttl)
            } else {
                latest
            };
            return Outcome::new(
                true,
                self.limit,
                self.limit - used - ctx.cost,
                None,
                end - now,
            );
        }
        let retry = (ctx.cost <= self.limit).then(|| {
            // At the latest, when enough leases lapse (a release usually comes sooner).
            live.sort_unstable();
            let mut to_free = used + ctx.cost - self.limit;
            let mut at = now;
            for (expires, cost) in &live {
                at = *expires;
                if *cost >= to_free {
                    break;
                }
                to_free -= cost;
            }
            at - now
        });
        Outcome::new(
            false,
            self.limit,
            self.limit - used.min(self.limit),
            retry,
            latest - now,
        )
    }

    fn commit(&self, state: &mut State, ctx: &Ctx) {
        state.leases.retain(|l| l.expires_at > ctx.now);
        if ctx.cost > 0 {
            state.leases.push(Lease {
                id: ctx.lease,
                expires_at: ctx.now + self.lease_ttl,
                cost: ctx.cost,
            });
        }
    }

    fn undo(&self, state: &mut State, undo: &Undo) -> bool {
        state.leases.retain(|l| l.id != undo.lease);
        // Only a set left empty goes (Redis deletes an empty sorted set); other leases stay
        // until they expire, in both backends.
        state.leases.is_empty()
    }

    fn expires_at(&self, state: &State) -> u64 {
        state.leases.iter().map(|l| l.expires_at).max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_cost_near_u64_max_is_denied_and_takes_no_lease() {
        let c = Concurrency::new(5, Duration::from_secs(30)).expect("valid");
        let mut st = c.fresh();
        let t0 = 1_700_000_000_000_000;
        let ctx = |cost, lease| Ctx {
            lease,
            ..Ctx::new(t0, cost)
        };
        assert!(c.check(&mut st, &ctx(1, 1)).decision.allowed);
        let d = c.check(&mut st, &ctx(u64::MAX, 2)).decision;
        assert!(!d.allowed);
        assert_eq!(d.retry_after, None);
        assert_eq!(st.leases.len(), 1);
        for lease in 3..7 {
            assert!(c.check(&mut st, &ctx(1, lease)).decision.allowed);
        }
        assert!(!c.check(&mut st, &ctx(1, 7)).decision.allowed);
    }
    use super::*;

    const T0: u64 = 1_700_000_000_000_000;

    #[test]
    fn leases_are_released_or_lapse() {
        let c = Concurrency::new(2, Duration::from_secs(30)).expect("valid");
        let mut st = c.fresh();
        let at = |lease| Ctx {
            lease,
            ..Ctx::new(T0, 1)
        };
        assert!(c.check(&mut st, &at(1)).decision.allowed);
        assert!(c.check(&mut st, &at(2)).decision.allowed);
        let d = c.check(&mut st, &at(3)).decision;
        assert!(!d.allowed);
        assert_eq!(d.retry_after, Some(Duration::from_secs(30)));
        assert!(c.release(&mut st, 1, T0 + 1));
        assert!(!c.release(&mut st, 1, T0 + 1), "released twice");
        assert!(c.check(&mut st, &at(3)).decision.allowed);
        // A crashed holder's lease lapses after the ttl.
        let later = Ctx {
            lease: 4,
            ..Ctx::new(T0 + 30_000_000, 2)
        };
        assert!(c.check(&mut st, &later).decision.allowed);
        assert!(!c.renew(&mut st, 2, T0 + 30_000_000));
        assert!(c.renew(&mut st, 4, T0 + 31_000_000));
    }
}
