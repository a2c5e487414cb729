//! [`MemoryLimiter`]: every algorithm, in this process's memory.

use std::fmt;
use std::sync::Arc;

use smallvec::SmallVec;

use super::sharded::{NewSlot, OnFull, Packable, Packed, Shard, ShardedMap, StoreStats};
use super::{Check, CheckOptions, Limiter};
use crate::algorithm::concurrency::{self, Concurrency};
use crate::algorithm::gcra::{self, Gcra};
use crate::algorithm::{Algorithm, Ctx, Outcome, Undo};
use crate::clock::{Clock, SystemClock, duration_micros};
use crate::error::MemoryError;
use crate::policy::{Kind, State};
use crate::{Decision, LeaseId, Policy, Timestamp, Verdict};

/// The default bound on keys held in memory.
pub const DEFAULT_MAX_KEYS: usize = 1_000_000;

/// An in-memory rate limiter: every algorithm, safe under many threads, with a bound on the
/// number of keys it holds.
///
/// Cloning is cheap and clones share state. The synchronous methods (`check_key`, `check_sync`)
/// never block on I/O; the [`Limiter`] implementation wraps them in ready futures.
///
/// ```
/// use floodgate_core::{MemoryLimiter, Policy};
///
/// let limiter = MemoryLimiter::new();
/// let policy = Policy::per_second(2).unwrap();
/// assert!(limiter.check_key(b"alice", &policy, 1).allowed);
/// assert!(limiter.check_key(b"alice", &policy, 1).allowed);
/// let third = limiter.check_key(b"alice", &policy, 1);
/// assert!(!third.allowed);
/// assert!(third.retry_after.is_some());
/// ```
pub struct MemoryLimiter<C = SystemClock> {
    inner: Arc<Inner<C>>,
}

struct Inner<C> {
    map: ShardedMap<State>,
    clock: C,
}

impl<C> Clone for MemoryLimiter<C> {
    fn clone(&self) -> Self {
        MemoryLimiter {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<C> fmt::Debug for MemoryLimiter<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryLimiter")
            .field("max_keys", &self.inner.map.max_keys())
            .finish_non_exhaustive()
    }
}

impl MemoryLimiter<SystemClock> {
    /// A limiter with the system clock and the default bounds.
    pub fn new() -> Self {
        MemoryLimiter::builder().build()
    }

    /// A builder to set the key bound, shards, eviction and clock.
    pub fn builder() -> MemoryLimiterBuilder<SystemClock> {
        MemoryLimiterBuilder {
            max_keys: DEFAULT_MAX_KEYS,
            // Enough shards that threads rarely meet on one lock, few enough that the locks
            // stay in the L1 cache.
            shards: (std::thread::available_parallelism().map_or(4, |n| n.get()) * 16)
                .clamp(16, 256),
            on_full: OnFull::default(),
            clock: SystemClock::new(),
        }
    }
}

impl Default for MemoryLimiter<SystemClock> {
    fn default() -> Self {
        MemoryLimiter::new()
    }
}

/// Configures a [`MemoryLimiter`].
#[derive(Debug)]
#[must_use]
pub struct MemoryLimiterBuilder<C> {
    max_keys: usize,
    shards: usize,
    on_full: OnFull,
    clock: C,
}

impl<C: Clock> MemoryLimiterBuilder<C> {
    /// At most this many (policy, key) states are kept (default one million).
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys;
        self
    }

    /// About this many independently locked shards (rounded to a power of two, at most 256).
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards;
        self
    }

    /// What to do when the store is full of live keys.
    pub fn on_full(mut self, on_full: OnFull) -> Self {
        self.on_full = on_full;
        self
    }

    /// Another clock (a [`crate::ManualClock`] in tests).
    pub fn clock<C2: Clock>(self, clock: C2) -> MemoryLimiterBuilder<C2> {
        MemoryLimiterBuilder {
            max_keys: self.max_keys,
            shards: self.shards,
            on_full: self.on_full,
            clock,
        }
    }

    /// Builds the limiter.
    pub fn build(self) -> MemoryLimiter<C> {
        MemoryLimiter {
            inner: Arc::new(Inner {
                map: ShardedMap::new(self.max_keys, self.shards, self.on_full).deferring_sweeps(),
                clock: self.clock,
            }),
        }
    }
}

impl<C: Clock> MemoryLimiter<C> {
    /// The limiter's clock.
    pub fn clock(&self) -> &C {
        &self.inner.clock
    }

    /// Memory counters.
    pub fn stats(&self) -> StoreStats {
        self.inner.map.stats()
    }

    /// Drops every expired state now (it is also done as the store fills up).
    pub fn purge_expired(&self) {
        self.inner
            .map
            .purge_expired(self.inner.clock.now().as_micros());
    }

    /// Checks one policy for one key: the fast path.
    ///
    /// A concurrency policy's lease taken here cannot be released (a decision carries no
    /// lease id): it lapses after its TTL. Check those with [`MemoryLimiter::check_sync`],
    /// whose verdict has the lease to release.
    ///
    /// When the store is full and set to [`OnFull::Reject`], or the clock is past the year
    /// 2106, the check is denied with no retry time (see [`MemoryLimiter::check_sync`] for the
    /// errors).
    #[inline]
    pub fn check_key(&self, key: &[u8], policy: &Policy, cost: u64) -> Decision {
        let ctx = Ctx {
            lease: lease_for(policy.kind()),
            ..Ctx::new(self.inner.clock.now().as_micros(), cost)
        };
        match checked_now(ctx.now).and_then(|_| self.check_single(key, policy, &ctx)) {
            Ok(out) => out.decision,
            Err(_) => Decision {
                allowed: false,
                limit: policy.limit(),
                remaining: 0,
                retry_after: None,
                reset_after: std::time::Duration::ZERO,
            },
        }
    }

    fn check_single(&self, key: &[u8], policy: &Policy, ctx: &Ctx) -> Result<Outcome, MemoryError> {
        let map = &self.inner.map;
        let kind = policy.kind();
        let ident = policy.ident();
        let hash = match locate(map, policy, key) {
            Loc::Slot { hash } => hash,
            Loc::Compact { hash, key, gcra } => {
                return self.check_compact(hash, key, gcra, ctx);
            }
        };
        let mut shard = map.lock(map.shard_of(hash));
        if let Some(slot) = shard.find_mut(hash, ident, key) {
            let mut expires_at = 0;
            // GCRA (the default) in line: a key too long for the compact table (an API key, a
            // user name) costs no dispatch through every algorithm either.
            let out = match (kind, &mut slot.value) {
                (Kind::Gcra(gcra), State::Gcra(state)) => {
                    let out = gcra.check(state, ctx);
                    expires_at = state.tat;
                    out
                }
                (kind, value) => kind.check_expiring(value, ctx, &mut expires_at),
            };
            if out.decision.allowed {
                slot.set_expires_at(expires_at);
                let at = slot.expires_at();
                shard.note_expiry(at);
            }
            // Unlock before moving the outcome: the unlock drains the stores that built it, so
            // the move does not stall on store forwarding inside the critical section.
            drop(shard);
            return Ok(out);
        }
        let mut state = kind.fresh();
        let mut expires_at = 0;
        let out = kind.check_expiring(&mut state, ctx, &mut expires_at);
        if out.decision.allowed && ctx.cost > 0 {
            map.insert(
                &mut shard,
                NewSlot {
                    hash,
                    ident,
                    key,
                    value: state,
                    expires_at,
                },
                ctx.now,
            )?;
        }
        Ok(out)
    }

    /// [`MemoryLimiter::check_single`] of a GCRA state in the compact table: a held state is
    /// advanced under the shard's write lock when it is free, else under its read lock (with a
    /// compare-and-swap); a new one is inserted under the write lock.
    #[inline]
    fn check_compact(
        &self,
        hash: u64,
        key: Packed,
        gcra: &Gcra,
        ctx: &Ctx,
    ) -> Result<Outcome, MemoryError> {
        let map = &self.inner.map;
        let shard = map.shard_of(hash);
        let step = |tat| {
            let mut state = gcra::State { tat };
            let out = gcra.check(&mut state, ctx);
            let allowed = out.decision.allowed;
            (out, allowed.then_some(state.tat))
        };
        // Uncontended, the write lock costs one atomic operation less than the read lock and
        // the compare-and-swap; contended, checks of held states share the read lock.
        let mut g = match map.try_lock(shard) {
            Some(g) => g,
            None => {
                let g = map.read(shard);
                if let Some(entry) = g.find_compact(hash, key) {
                    let (out, tat) = entry.advance(step);
                    if let Some(tat) = tat {
                        g.note_expiry(tat);
                    }
                    // Unlock before moving the outcome: the unlock drains the stores that built
                    // it, so the move does not stall on store forwarding inside the critical
                    // section.
                    drop(g);
                    return Ok(out);
                }
                drop(g);
                // A new key: another check may insert it before this one has the lock.
                map.lock(shard)
            }
        };
        if let Some(entry) = g.find_compact_mut(hash, key) {
            let (out, tat) = step(entry.tat());
            if let Some(tat) = tat {
                entry.set_tat(tat);
                g.note_expiry(tat);
            }
            drop(g);
            return Ok(out);
        }
        let (out, tat) = step(0);
        if let Some(tat) = tat
            && ctx.cost > 0
        {
            map.insert_compact(&mut g, hash, key, tat, ctx.now)?;
        }
        Ok(out)
    }

    /// Checks several policies, all-or-nothing, atomically with respect to every other check.
    ///
    /// Errors: [`MemoryError::Full`] when the store refuses new keys, and
    /// [`MemoryError::InvalidCheck`] for a malformed check or a time past the year 2106.
    pub fn check_sync(
        &self,
        checks: &[Check<'_>],
        opts: CheckOptions,
    ) -> Result<Verdict, MemoryError> {
        let now = checked_now(
            opts.now
                .unwrap_or_else(|| self.inner.clock.now())
                .as_micros(),
        )?;
        // A lease only for a concurrency check that takes something: one of cost 0 holds
        // nothing, and there is nothing to release.
        let lease = checks
            .iter()
            .filter(|c| c.cost > 0)
            .map(|c| lease_for(c.policy.kind()))
            .find(|l| *l != 0)
            .unwrap_or(0);
        let base = Ctx {
            now,
            cost: 0,
            max_wait: duration_micros(opts.max_wait),
            lease,
        };
        let verdict_lease = (lease != 0).then_some(LeaseId(lease));
        if let [check] = checks {
            let out = self.check_single(
                check.key,
                check.policy,
                &Ctx {
                    cost: check.cost,
                    ..base
                },
            )?;
            return Ok(Verdict {
                decisions: smallvec::smallvec![out.decision],
                wait: std::time::Duration::from_micros(out.wait),
                lease: verdict_lease.filter(|_| out.decision.allowed),
                at: Timestamp::from_micros(now),
            });
        }
        if checks.is_empty() {
            return Err(MemoryError::InvalidCheck("no policies to check".into()));
        }
        let map = &self.inner.map;
        let located: SmallVec<[(Loc<'_>, usize); 4]> = checks
            .iter()
            .map(|c| {
                let loc = locate(map, c.policy, c.key);
                (loc, map.shard_of(loc.hash()))
            })
            .collect();
        for (i, a) in checks.iter().enumerate() {
            if checks[..i]
                .iter()
                .any(|b| b.policy.ident() == a.policy.ident() && b.key == a.key)
            {
                return Err(MemoryError::InvalidCheck(format!(
                    "policy {} is checked twice for the same key",
                    a.policy.name()
                )));
            }
        }
        // Lock every shard involved, in index order so that concurrent checks cannot deadlock.
        let mut order: SmallVec<[usize; 4]> = located.iter().map(|l| l.1).collect();
        order.sort_unstable();
        order.dedup();
        let mut guards: SmallVec<[_; 4]> = order.iter().map(|&i| map.lock(i)).collect();
        let guard_of = |shard: usize| order.iter().position(|&i| i == shard).unwrap_or(0);

        let outcomes: SmallVec<[Outcome; 4]> = checks
            .iter()
            .zip(&located)
            .map(|(c, &(loc, shard))| {
                let ctx = Ctx {
                    cost: c.cost,
                    ..base
                };
                decide_at(&guards[guard_of(shard)], c, loc, &ctx)
            })
            .collect();
        let allowed = outcomes.iter().all(|o| o.decision.allowed);
        if !allowed {
            // Nothing is counted: report the allowing policies' state as it stands.
            let decisions = checks
                .iter()
                .zip(&located)
                .zip(&outcomes)
                .map(|((c, &(loc, shard)), out)| {
                    if !out.decision.allowed {
                        return out.decision;
                    }
                    decide_at(&guards[guard_of(shard)], c, loc, &base).decision
                })
                .collect();
            return Ok(Verdict {
                decisions,
                wait: std::time::Duration::ZERO,
                lease: None,
                at: Timestamp::from_micros(now),
            });
        }
        // Make room for the new keys first, so that committing cannot fail half-way. A key
        // held but expired is counted in place unless a sweep is needed for the absent ones,
        // which would drop it (it then comes back as new).
        for (gi, &shard) in order.iter().enumerate() {
            let (mut absent, mut expired) = (0, 0);
            for (c, (loc, s)) in checks.iter().zip(&located) {
                if *s != shard || c.cost == 0 {
                    continue;
                }
                match held(&guards[gi], c, *loc) {
                    None => absent += 1,
                    Some(expires_at) if expires_at <= now => expired += 1,
                    Some(_) => {}
                }
            }
            if absent > 0 && !map.has_room(&guards[gi], absent) {
                map.ensure_room(&mut guards[gi], absent + expired, now)?;
            }
        }
        for (c, &(loc, shard)) in checks.iter().zip(&located) {
            if c.cost == 0 {
                // A peek changes no state (as check.lua commits only what costs something).
                continue;
            }
            let ctx = Ctx {
                cost: c.cost,
                ..base
            };
            let kind = c.policy.kind();
            let g = &mut guards[guard_of(shard)];
            let hash = match loc {
                Loc::Slot { hash } => hash,
                Loc::Compact { hash, key, gcra } => {
                    if let Some(entry) = g.find_compact_mut(hash, key) {
                        let mut state = gcra::State { tat: entry.tat() };
                        gcra.commit(&mut state, &ctx);
                        entry.set_tat(state.tat);
                        g.note_expiry(state.tat);
                    } else {
                        let mut state = gcra.fresh();
                        gcra.commit(&mut state, &ctx);
                        // Room was made above: this cannot fail.
                        map.insert_compact(g, hash, key, state.tat, now)?;
                    }
                    continue;
                }
            };
            if let Some(slot) = g.find_mut(hash, c.policy.ident(), c.key) {
                kind.commit(&mut slot.value, &ctx);
                slot.set_expires_at(kind.expires_at(&slot.value));
                let at = slot.expires_at();
                g.note_expiry(at);
            } else {
                let mut state = kind.fresh();
                kind.commit(&mut state, &ctx);
                let expires_at = kind.expires_at(&state);
                let slot = NewSlot {
                    hash,
                    ident: c.policy.ident(),
                    key: c.key,
                    value: state,
                    expires_at,
                };
                // Room was made above: this cannot fail.
                map.insert(g, slot, now)?;
            }
        }
        Ok(Verdict {
            decisions: outcomes.iter().map(|o| o.decision).collect(),
            wait: std::time::Duration::from_micros(
                outcomes.iter().map(|o| o.wait).max().unwrap_or(0),
            ),
            lease: verdict_lease,
            at: Timestamp::from_micros(now),
        })
    }

    /// Releases a concurrency lease (see [`Limiter::release`]); returns whether any policy
    /// still held it.
    pub fn release_sync(&self, checks: &[Check<'_>], lease: LeaseId) -> bool {
        self.release_at(checks, lease, self.inner.clock.now())
    }

    /// [`MemoryLimiter::release_sync`] as of `now` (simulations).
    /// A time past what the store can hold (the year 2106) is taken as that last time: the
    /// lease is still released.
    pub fn release_at(&self, checks: &[Check<'_>], lease: LeaseId, now: Timestamp) -> bool {
        let now = now.as_micros().min(MAX_NOW_US);
        self.each_lease(checks, now, |conc, st| conc.release(st, lease.0, now))
            .contains(&true)
    }

    /// Runs `f` on the state of each concurrency check of `checks` (under its shard's lock),
    /// and says what it answered of each (`false` where there is no state). Each state then
    /// gets its expiry again, and one that holds nothing as of `now` is dropped.
    fn each_lease(
        &self,
        checks: &[Check<'_>],
        now: u64,
        mut f: impl FnMut(&Concurrency, &mut concurrency::State) -> bool,
    ) -> SmallVec<[bool; 2]> {
        let map = &self.inner.map;
        let mut answers = SmallVec::new();
        for c in checks {
            let Kind::Concurrency(conc) = c.policy.kind() else {
                continue;
            };
            let hash = map.hash(c.policy.ident(), c.key);
            let mut shard = map.lock(map.shard_of(hash));
            let (answer, empty) = match shard.find_mut(hash, c.policy.ident(), c.key) {
                Some(slot) => match &mut slot.value {
                    State::Concurrency(st) => {
                        let answer = f(conc, st);
                        // Exact, not the slot's whole seconds: a state that holds nothing
                        // as of now is dropped, as the Redis backend deletes its key.
                        let expires_at = c.policy.kind().expires_at(&slot.value);
                        slot.set_expires_at(expires_at);
                        let at = slot.expires_at();
                        shard.note_expiry(at);
                        (answer, expires_at <= now)
                    }
                    _ => (false, false),
                },
                None => (false, false),
            };
            if empty {
                shard.remove(hash, c.policy.ident(), c.key);
            }
            answers.push(answer);
        }
        answers
    }

    /// Gives back what the allowed `verdict` of `checks` took (see [`Limiter::refund`]).
    ///
    /// Errors: [`MemoryError::InvalidCheck`] when `checks` are not as many as the verdict's
    /// decisions, or the verdict's time is past the year 2106; nothing is given back then. A
    /// refund from before its verdict's time counts as made then.
    pub fn refund_sync(&self, checks: &[Check<'_>], verdict: &Verdict) -> Result<(), MemoryError> {
        self.refund_at(checks, verdict, self.inner.clock.now())
    }

    /// [`MemoryLimiter::refund_sync`] as of `now` (simulations): states that hold nothing
    /// after the refund, as of `now`, are dropped.
    pub fn refund_at(
        &self,
        checks: &[Check<'_>],
        verdict: &Verdict,
        now: Timestamp,
    ) -> Result<(), MemoryError> {
        if !verdict.allowed() {
            return Ok(());
        }
        if checks.len() != verdict.decisions.len() {
            return Err(MemoryError::InvalidCheck(format!(
                "a refund needs the checks its verdict answered: {} checks for {} decisions",
                checks.len(),
                verdict.decisions.len()
            )));
        }
        // A refund from before its verdict (another clock, a step back) counts as made at the
        // verdict's time, as in the Redis backend: the check's units come back as they were
        // taken, and a state that holds nothing by then is dropped.
        let at = checked_now(verdict.at.as_micros())?;
        let now = checked_now(now.as_micros())?.max(at);
        let lease = verdict.lease.map_or(0, |l| l.0);
        let map = &self.inner.map;
        for (c, d) in checks.iter().zip(&verdict.decisions) {
            let undo = Undo {
                at,
                now,
                cost: c.cost,
                lease,
                reset_after: duration_micros(d.reset_after),
            };
            let kind = c.policy.kind();
            let loc = locate(map, c.policy, c.key);
            let mut shard = map.lock(map.shard_of(loc.hash()));
            match loc {
                Loc::Slot { hash } => {
                    // Sooner than it was: a full shard must know when it expires.
                    let mut moved = None;
                    let empty = shard
                        .find_mut(hash, c.policy.ident(), c.key)
                        .is_some_and(|slot| {
                            if !kind.undo(&mut slot.value, &undo) {
                                return false;
                            }
                            // Exact, not the slot's whole seconds (see `each_lease`).
                            let expires_at = kind.expires_at(&slot.value);
                            slot.set_expires_at(expires_at);
                            moved = Some(slot.expires_at());
                            expires_at <= now
                        });
                    // Only for a key that stays: one given back to empty is removed below, and
                    // noting its past expiry would bring a full shard's next sweep forward.
                    if let Some(at) = moved.filter(|_| !empty) {
                        shard.note_expiry(at);
                    }
                    if empty {
                        shard.remove(hash, c.policy.ident(), c.key);
                    }
                }
                Loc::Compact { hash, key, gcra } => {
                    let mut moved = None;
                    let empty = shard.find_compact_mut(hash, key).is_some_and(|entry| {
                        let mut state = gcra::State { tat: entry.tat() };
                        gcra.undo(&mut state, &undo);
                        entry.set_tat(state.tat);
                        moved = Some(entry.tat());
                        state.tat <= now
                    });
                    // Only for a key that stays: one given back to empty is removed below, and
                    // noting its past expiry would bring a full shard's next sweep forward.
                    if let Some(at) = moved.filter(|_| !empty) {
                        shard.note_expiry(at);
                    }
                    if empty {
                        shard.remove_compact(hash, key);
                    }
                }
            }
        }
        Ok(())
    }

    /// Extends lease `lease` of `checks` (see [`Limiter::renew`]).
    pub fn renew_sync(&self, checks: &[Check<'_>], lease: LeaseId) -> bool {
        self.renew_at(checks, lease, self.inner.clock.now())
    }

    /// [`MemoryLimiter::renew_sync`] as of `now` (simulations).
    /// A time past what the store can hold (the year 2106) renews nothing: `false`, as for a
    /// lease that lapsed, rather than an expiry that wraps around to the past.
    pub fn renew_at(&self, checks: &[Check<'_>], lease: LeaseId, now: Timestamp) -> bool {
        let Ok(now) = checked_now(now.as_micros()) else {
            return false;
        };
        !self
            .each_lease(checks, now, |conc, st| conc.renew(st, lease.0, now))
            .contains(&false)
    }

    /// Forgets `policy`'s state for `key`.
    pub fn reset_sync(&self, key: &[u8], policy: &Policy) {
        let map = &self.inner.map;
        let loc = locate(map, policy, key);
        let mut shard = map.lock(map.shard_of(loc.hash()));
        match loc {
            Loc::Slot { hash } => drop(shard.remove(hash, policy.ident(), key)),
            Loc::Compact { hash, key, .. } => drop(shard.remove_compact(hash, key)),
        }
    }

    /// The state held for `policy` and `key`, if any (for inspection and tests).
    pub fn state(&self, key: &[u8], policy: &Policy) -> Option<State> {
        let map = &self.inner.map;
        let loc = locate(map, policy, key);
        let shard = map.lock(map.shard_of(loc.hash()));
        match loc {
            Loc::Slot { hash } => shard
                .find(hash, policy.ident(), key)
                .map(|s| s.value.clone()),
            Loc::Compact { hash, key, .. } => shard
                .find_compact(hash, key)
                .map(|c| State::Gcra(gcra::State { tat: c.tat() })),
        }
    }
}

/// Where the state of a policy for a key lives in the store.
#[derive(Clone, Copy)]
enum Loc<'p> {
    /// In a 64-byte slot.
    Slot { hash: u64 },
    /// In the compact table: GCRA with a key of up to 8 bytes, a dotted-decimal IPv4 address
    /// or a decimal number (see `sharded::Packable`), the commonest state, in 16 bytes.
    Compact {
        hash: u64,
        key: Packed,
        gcra: &'p Gcra,
    },
}

impl Loc<'_> {
    fn hash(&self) -> u64 {
        match *self {
            Loc::Slot { hash } | Loc::Compact { hash, .. } => hash,
        }
    }
}

/// `now` (µs since the epoch), if the store can decide at that time: up to the year 2106, when
/// the slots' expiry times (whole seconds in 32 bits) run out; past it, every state would read
/// as expired, and a full store set to refuse new keys would drop live ones. (States hold times
/// up to `now` plus the longest span a policy may have, which the compact table's 56 bits
/// hold.)
#[inline]
fn checked_now(now: u64) -> Result<u64, MemoryError> {
    if now > MAX_NOW_US {
        return Err(MemoryError::InvalidCheck(format!(
            "the time {now}us since the epoch is beyond what the memory store can hold \
             ({MAX_NOW_US}us)"
        )));
    }
    Ok(now)
}

/// The latest time the memory store decides at (2106-02-07 06:28:14 UTC): the last whole
/// second a slot's expiry holds, less one.
const MAX_NOW_US: u64 = (u32::MAX as u64 - 1) * 1_000_000;

/// Where `policy`'s state for `key` lives: the same answer every time, for every path.
#[inline]
fn locate<'p>(map: &ShardedMap<State>, policy: &'p Policy, key: &[u8]) -> Loc<'p> {
    // A key that cannot be packed must not take one of the fifteen compact indexes.
    if let Kind::Gcra(gcra) = policy.kind()
        && let Some(packable) = Packable::of(key)
        && let Some(index) = map.compact_index(policy.ident())
    {
        let key = packable.pack(index);
        return Loc::Compact {
            hash: map.hash_packed(key),
            key,
            gcra,
        };
    }
    Loc::Slot {
        hash: map.hash(policy.ident(), key),
    }
}

/// What `c` would get from the state at `loc` (fresh when there is none), changing nothing.
fn decide_at(g: &Shard<State>, c: &Check<'_>, loc: Loc<'_>, ctx: &Ctx) -> Outcome {
    let kind = c.policy.kind();
    match loc {
        Loc::Slot { hash } => match g.find(hash, c.policy.ident(), c.key) {
            Some(slot) => kind.decide(&slot.value, ctx),
            None => kind.decide(&kind.fresh(), ctx),
        },
        Loc::Compact { hash, key, gcra } => {
            let tat = g.find_compact(hash, key).map_or(0, |e| e.tat());
            gcra.decide(&gcra::State { tat }, ctx)
        }
    }
}

/// When the state the shard holds for `c` at `loc` expires; `None` when it holds none. An
/// expired state is still updated in place, unless a sweep drops it first.
fn held(g: &Shard<State>, c: &Check<'_>, loc: Loc<'_>) -> Option<u64> {
    match loc {
        Loc::Slot { hash } => g
            .find(hash, c.policy.ident(), c.key)
            .map(|s| s.expires_at()),
        Loc::Compact { hash, key, .. } => g.find_compact(hash, key).map(|e| e.tat()),
    }
}

/// A fresh lease id for concurrency policies (0 for others: no lease).
#[inline]
fn lease_for(kind: &Kind) -> u64 {
    if matches!(kind, Kind::Concurrency(_)) {
        fastrand::u64(1..)
    } else {
        0
    }
}

impl<C: Clock> Limiter for MemoryLimiter<C> {
    type Error = MemoryError;

    /// A full store or a malformed check is never the store being down.
    fn is_unavailable(_: &MemoryError) -> bool {
        false
    }

    /// A check is decided at once, on the caller's thread.
    fn keeps_deadlines(&self, _: std::time::Duration) -> bool {
        true
    }

    async fn check(
        &self,
        checks: &[Check<'_>],
        opts: CheckOptions,
    ) -> Result<Verdict, MemoryError> {
        self.check_sync(checks, opts)
    }

    async fn release(&self, checks: &[Check<'_>], lease: LeaseId) -> Result<(), MemoryError> {
        self.release_sync(checks, lease);
        Ok(())
    }

    async fn renew(&self, checks: &[Check<'_>], lease: LeaseId) -> Result<bool, MemoryError> {
        Ok(self.renew_sync(checks, lease))
    }

    async fn refund(&self, checks: &[Check<'_>], verdict: &Verdict) -> Result<(), MemoryError> {
        self.refund_sync(checks, verdict)
    }

    async fn reset(&self, key: &[u8], policy: &Policy) -> Result<(), MemoryError> {
        self.reset_sync(key, policy);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(name: &str) -> Policy {
        Policy::per_second(2)
            .and_then(|p| p.named(name))
            .expect("valid")
    }

    #[test]
    fn held_states_advance_under_the_read_lock_without_losing_counts() {
        use std::sync::atomic::{AtomicU64, Ordering};
        let limiter = MemoryLimiter::new();
        // A burst of 100 in an hour: no more while the test runs.
        let p = Policy::gcra(99, 1, std::time::Duration::from_secs(3600)).expect("valid");
        assert!(limiter.check_key(b"one", &p, 1).allowed);
        let map = &limiter.inner.map;
        let Loc::Compact { hash, .. } = locate(map, &p, b"one") else {
            panic!("a short GCRA key is compact");
        };
        // A reader holds the shard: no check gets the write lock, every one shares the read
        // lock and advances the state with a compare-and-swap.
        let held = map.read(map.shard_of(hash));
        let admitted = AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..100 {
                        if limiter.check_key(b"one", &p, 1).allowed {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        drop(held);
        assert_eq!(admitted.load(Ordering::Relaxed), 99);
    }

    #[test]
    fn gcra_decides_alike_in_the_compact_table_and_in_slots() {
        use crate::clock::ManualClock;
        use std::time::Duration;
        let clock = ManualClock::new(Timestamp::from_micros(1_700_000_000_000_000));
        let limiter = MemoryLimiter::builder().clock(clock.clone()).build();
        let p = Policy::gcra(4, 10, Duration::from_secs(1)).expect("valid");
        // Compact, a slot compared in two words, a slot compared with `memcmp`. The slots step
        // GCRA in line; the compact table has its own step.
        let keys: [&[u8]; 3] = [b"k", b"client-42", b"an-api-key-of-more-than-16-bytes"];
        let map = &limiter.inner.map;
        assert!(matches!(locate(map, &p, keys[0]), Loc::Compact { .. }));
        assert!(matches!(locate(map, &p, keys[1]), Loc::Slot { .. }));
        assert!(matches!(locate(map, &p, keys[2]), Loc::Slot { .. }));
        let mut rng = fastrand::Rng::with_seed(3);
        let (mut allowed, mut denied) = (0, 0);
        for step in 0..5_000 {
            let cost = rng.u64(0..4);
            let decisions: Vec<Decision> = keys
                .iter()
                .map(|k| limiter.check_key(k, &p, cost))
                .collect();
            assert_eq!(decisions[0], decisions[1], "step {step}");
            assert_eq!(decisions[0], decisions[2], "step {step}");
            let states: Vec<_> = keys.iter().map(|k| limiter.state(k, &p)).collect();
            assert_eq!(states[0], states[1], "step {step}");
            assert_eq!(states[0], states[2], "step {step}");
            if decisions[0].allowed {
                allowed += 1;
            } else {
                denied += 1;
            }
            clock.advance(Duration::from_micros(rng.u64(0..150_000)));
        }
        assert!(allowed > 1_000 && denied > 1_000, "{allowed} {denied}");
        // Each key's expiry follows its state: a sweep while the state is ahead of the clock
        // keeps all three keys (a slot whose expiry was not moved on would go), one after the
        // state's time (rounded up to the second) drops them.
        clock.advance(Duration::from_secs(1));
        for k in keys {
            assert!(limiter.check_key(k, &p, 1).allowed);
        }
        limiter.purge_expired();
        assert_eq!(limiter.stats().keys, 3);
        assert_eq!(limiter.stats().expired, 0);
        clock.advance(Duration::from_millis(1_200));
        limiter.purge_expired();
        assert_eq!(limiter.stats().keys, 0);
        assert_eq!(limiter.stats().expired, 3);
    }

    #[test]
    fn only_keys_that_pack_take_compact_indexes_and_a_sixteenth_policy_uses_slots() {
        let limiter = MemoryLimiter::new();
        let map = &limiter.inner.map;
        // Long keys that are not IPv4 addresses never take an index...
        let unpacked = policy("unpacked");
        assert!(matches!(
            locate(map, &unpacked, b"a-long-api-token"),
            Loc::Slot { .. }
        ));
        // ...so fifteen other policies still get one, and a sixteenth does not.
        for i in 0..15 {
            let p = policy(&format!("p{i}"));
            assert!(
                matches!(locate(map, &p, b"10.0.0.1"), Loc::Compact { .. }),
                "{i}"
            );
        }
        assert!(matches!(
            locate(map, &unpacked, b"12345678"),
            Loc::Slot { .. }
        ));
        // Numbers of up to 19 digits pack; with a leading zero they do not.
        let p = policy("p0");
        assert!(matches!(
            locate(map, &p, b"15551234567"),
            Loc::Compact { .. }
        ));
        assert!(matches!(locate(map, &p, b"05551234567"), Loc::Slot { .. }));
        // Not GCRA: never compact.
        let window = Policy::fixed_window(2, std::time::Duration::from_secs(1)).expect("valid");
        assert!(matches!(locate(map, &window, b"k"), Loc::Slot { .. }));
    }
}
