//! [`DenyCache`]: answers checks that are certain to be denied without asking the store.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;

use super::sharded::{NewSlot, OnFull, ShardedMap};
use super::{CacheStats, Check, CheckOptions, Limiter};
use crate::clock::{Clock, SystemClock, duration_micros};
use crate::policy::Kind;
use crate::{Decision, LeaseId, Policy, Timestamp, Verdict};

/// How long after a cached denial ran out its check keeps probing one caller at a time (a
/// caller waits for the probe ahead of it, so a key that was just at its limit is served one
/// store call at a time for this long, unless a probe finds room for many: see
/// [`CROWD_ROOM`]).
const PROBE_GRACE_US: u64 = 1_000_000;
/// A probe that is allowed with room left for this many more checks like it (or for all the
/// callers waiting for it, if more) ends the probing: the crowd goes to the store at once. A
/// window that rolled over has room for far more than one caller at a time; a key with a unit
/// or two free does not.
const CROWD_ROOM: u64 = 16;
/// The longest a caller waits for another's probe before asking the store itself.
const PROBE_PATIENCE: Duration = Duration::from_secs(1);

/// Counters of a [`DenyCache`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DenyCacheStats {
    /// Checks answered locally.
    pub hits: u64,
    /// Checks passed to the store (of those it caches: not of a concurrency policy, nor of
    /// cost 0, nor decided at an injected time).
    pub misses: u64,
    /// Checks that waited for another caller's probe of the same check.
    pub coalesced: u64,
    /// Denials held now.
    pub entries: usize,
}

struct Entry {
    /// Denied until this time (local clock, µs).
    until: u64,
    /// The cache's count of resets when the check was sent: a reset since makes it stale.
    resets: u32,
    /// When the verdict was cached.
    at: u64,
    verdict: Verdict,
}

struct Shared<C> {
    map: ShardedMap<Entry>,
    clock: C,
    fingerprints: foldhash::fast::RandomState,
    probes: Mutex<HashMap<[u64; 2], Probe>>,
    hits: AtomicU64,
    misses: AtomicU64,
    coalesced: AtomicU64,
    /// Resets (high half, see [`Entry::resets`]) and refunds (low half, see
    /// [`DenyCache::remember`]) made through this cache: one word, read once per check (the
    /// check's future holds it across the store's call, and is boxed per request). A count
    /// that wraps is one more stale answer, never a stale answer kept.
    counts: AtomicU64,
    /// The refund count (low half of `counts`) of the last refund of a (policy, key) in each
    /// stripe: a denial of other keys than those refunded meanwhile is still stored.
    refunded: Box<[AtomicU32]>,
    /// Refunds counted in `counts` whose stripes may not be written yet.
    refunding: AtomicU32,
}

/// Stripes of `Shared::refunded`: keys refunded at once rarely share one.
const REFUND_STRIPES: usize = 256;

/// A [`Limiter`] in front of another that remembers denials.
///
/// Once a check is denied with a retry time, the same check (same policies, keys and costs) is
/// denied locally until that time: an attacker hammering one key costs the shared store almost
/// nothing. When an allowed check spends a key's last unit and the algorithm tells exactly when
/// the next unit comes (GCRA, the funnel, the greedy token bucket, fixed windows), that time is
/// cached as a denial too, so a key held at its limit costs one store call per admitted request.
///
/// When a cached denial runs out, one caller probes the store while the others of the same
/// check wait for its answer instead of all asking at once; after a probe that finds room for
/// them all (a window that rolled over), they all ask at once.
///
/// A local denial can only be wrong in one direction: the cache never admits what the store
/// would deny. Checks only make a key's retry time later; what makes it earlier (a refund or
/// an operator's `reset` made through another replica or cache) is not seen here until the
/// cached denial runs out, so it may deny longer than the store would: up to the whole retry
/// time, or at most [`DenyCache::max_hold`] when set. A refund made through this cache forgets
/// its own check's denial at once, and a reset made through it every cached denial. Concurrency policies, whose leases may be released early,
/// are never cached.
pub struct DenyCache<L, C = SystemClock> {
    inner: L,
    shared: Arc<Shared<C>>,
    /// The longest a denial is answered locally (µs); `u64::MAX`: its whole retry time.
    max_hold_us: u64,
}

impl<L: Clone, C> Clone for DenyCache<L, C> {
    fn clone(&self) -> Self {
        DenyCache {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
            max_hold_us: self.max_hold_us,
        }
    }
}

impl<L: std::fmt::Debug, C> std::fmt::Debug for DenyCache<L, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DenyCache")
            .field("inner", &self.inner)
            .field("max_entries", &self.shared.map.max_keys())
            .finish()
    }
}

impl<L> DenyCache<L, SystemClock> {
    /// Caches up to 100,000 denials in front of `inner`.
    pub fn new(inner: L) -> Self {
        DenyCache::with_clock(inner, SystemClock::new(), 100_000)
    }
}

impl<L, C: Clock> DenyCache<L, C> {
    /// Caches up to `max_entries` denials, timed by `clock`.
    pub fn with_clock(inner: L, clock: C, max_entries: usize) -> Self {
        DenyCache {
            inner,
            shared: Arc::new(Shared {
                map: ShardedMap::new(max_entries, 64, OnFull::EvictSoonest),
                clock,
                fingerprints: foldhash::fast::RandomState::default(),
                probes: Mutex::new(HashMap::new()),
                hits: AtomicU64::new(0),
                misses: AtomicU64::new(0),
                coalesced: AtomicU64::new(0),
                counts: AtomicU64::new(0),
                refunded: (0..REFUND_STRIPES).map(|_| AtomicU32::new(0)).collect(),
                refunding: AtomicU32::new(0),
            }),
            max_hold_us: u64::MAX,
        }
    }

    /// Asks the store again after at most `max_hold`, however long the retry time (answers
    /// given locally meanwhile still report the whole retry time). By default a denial is held
    /// for its whole retry time. Set it when keys may be freed early elsewhere: with refunds
    /// (another replica gives back the unit that denied this one, as the layer's `refund_when`
    /// does), a key one request over its limit gets a store call per `max_hold`, and a refund
    /// made through another replica is seen within `max_hold`. Zero caches nothing: every
    /// check asks the store.
    pub fn max_hold(mut self, max_hold: Duration) -> Self {
        self.max_hold_us = duration_micros(max_hold);
        self
    }

    /// The limiter behind the cache.
    pub fn inner(&self) -> &L {
        &self.inner
    }

    /// The cache's counters.
    pub fn stats(&self) -> DenyCacheStats {
        DenyCacheStats {
            hits: self.shared.hits.load(Ordering::Relaxed),
            misses: self.shared.misses.load(Ordering::Relaxed),
            coalesced: self.shared.coalesced.load(Ordering::Relaxed),
            entries: self.shared.map.stats().keys,
        }
    }

    /// A 128-bit fingerprint of the check: every policy, key and cost, and the max wait.
    fn fingerprint(&self, checks: &[Check<'_>], opts: &CheckOptions) -> [u64; 2] {
        let mut out = [0; 2];
        for (salt, slot) in out.iter_mut().enumerate() {
            let mut h = self.shared.fingerprints.build_hasher();
            salt.hash(&mut h);
            opts.max_wait.hash(&mut h);
            for c in checks {
                c.policy.ident().hash(&mut h);
                c.key.hash(&mut h);
                c.cost.hash(&mut h);
            }
            *slot = h.finish();
        }
        out
    }

    /// Whether the answer to `checks` may be cached: not at a given time, no concurrency
    /// policy (whose lease must be taken), no zero cost (a peek).
    fn cacheable(&self, checks: &[Check<'_>], opts: &CheckOptions) -> bool {
        opts.now.is_none()
            && self.max_hold_us > 0
            && checks
                .iter()
                .all(|c| !matches!(c.policy.kind(), Kind::Concurrency(_)) && c.cost > 0)
    }

    /// A cached denial still in force, adjusted to `now`; or whether one ran out recently.
    fn lookup(&self, fp: &[u64; 2], now: u64) -> Lookup {
        let key = fp_bytes(fp);
        let map = &self.shared.map;
        let hash = map.hash(0, &key);
        let shard = map.lock(map.shard_of(hash));
        let resets = resets_of(self.shared.counts.load(Ordering::Acquire));
        match shard.find(hash, 0, &key) {
            // Cached before a reset: as if absent (the store is asked until the check is
            // cached again; resets are rare).
            Some(slot) if slot.value.resets != resets => Lookup::Miss,
            Some(slot) if slot.value.until > now => {
                Lookup::Denied(Box::new(aged(&slot.value, now)))
            }
            Some(slot) if slot.expires_at() > now => Lookup::Probe,
            _ => Lookup::Miss,
        }
    }

    /// [`DenyCache::lookup`], counting a denial found as a hit.
    fn lookup_counted(&self, fp: &[u64; 2], now: u64) -> Lookup {
        let found = self.lookup(fp, now);
        if matches!(found, Lookup::Denied(_)) {
            self.shared.hits.fetch_add(1, Ordering::Relaxed);
        }
        found
    }

    fn forget(&self, fp: &[u64; 2]) {
        let key = fp_bytes(fp);
        let map = &self.shared.map;
        let hash = map.hash(0, &key);
        map.lock(map.shard_of(hash)).remove(hash, 0, &key);
    }

    /// Forgets the check's denial if it has run out by `now`: a fresher one, cached meanwhile
    /// by a caller that did not wait for the probe, stays.
    fn forget_run_out(&self, fp: &[u64; 2], now: u64) {
        let key = fp_bytes(fp);
        let map = &self.shared.map;
        let hash = map.hash(0, &key);
        let mut shard = map.lock(map.shard_of(hash));
        if shard
            .find(hash, 0, &key)
            .is_some_and(|slot| slot.value.until <= now)
        {
            shard.remove(hash, 0, &key);
        }
    }

    /// The stripe of `Shared::refunded` that counts refunds of `check`'s policy and key.
    fn stripe(&self, check: &Check<'_>) -> &AtomicU32 {
        let h = self
            .shared
            .fingerprints
            .hash_one((check.policy.ident(), check.key));
        // `REFUND_STRIPES` is a power of two: the low bits.
        &self.shared.refunded[(h as usize) & (REFUND_STRIPES - 1)]
    }

    /// Stores `entry`, the denial of `checks` by `verdict`, unless a refund of one of the keys
    /// that deny was made through this cache since the check was sent (`counts`, the counts
    /// read then). Compared under the shard's lock, which a refund's `forget` takes after
    /// counting itself: a denial of the refunded check itself is either not stored or
    /// forgotten.
    fn remember(
        &self,
        fp: &[u64; 2],
        now: u64,
        entry: Entry,
        counts: u64,
        (checks, verdict): (&[Check<'_>], &Verdict),
    ) {
        let key = fp_bytes(fp);
        let map = &self.shared.map;
        let hash = map.hash(0, &key);
        let mut shard = map.lock(map.shard_of(hash));
        let asked = refunds_of(counts);
        let refunded = refunds_of(self.shared.counts.load(Ordering::SeqCst));
        if refunded != asked
            // A refund counted and still writing its stripes: any of them may be ours.
            && (self.shared.refunding.load(Ordering::SeqCst) > 0
                || denying(checks, verdict).any(|(c, _)| {
                    // Refunded since the asking: between it and now (a stripe refunded long
                    // ago, or never, is outside, however the counts wrapped).
                    after_within(self.stripe(c).load(Ordering::SeqCst), asked, refunded)
                }))
        {
            return;
        }
        let expires_at = entry.until + PROBE_GRACE_US;
        if let Some(slot) = shard.find_mut(hash, 0, &key) {
            slot.value = entry;
            slot.set_expires_at(expires_at);
            shard.note_expiry(expires_at);
        } else {
            // A full cache evicts the denials that end soonest: nothing is lost but a store
            // call.
            let _ = map.insert(
                &mut shard,
                NewSlot {
                    hash,
                    ident: 0,
                    key: &key,
                    value: entry,
                    expires_at,
                },
                now,
            );
        }
    }
}

enum Lookup {
    Denied(Box<Verdict>),
    Probe,
    Miss,
}

/// A reset and a refund in `Shared::counts`.
const ONE_RESET: u64 = 1 << 32;
const ONE_REFUND: u64 = 1;

fn resets_of(counts: u64) -> u32 {
    (counts >> 32) as u32
}

fn refunds_of(counts: u64) -> u32 {
    counts as u32
}

/// Whether refund count `x` comes after `from` and no later than `to` (counts that wrap:
/// `to` is at most 2^32 - 1 refunds after `from`).
fn after_within(x: u32, from: u32, to: u32) -> bool {
    x.wrapping_sub(from).wrapping_sub(1) < to.wrapping_sub(from)
}

/// Whether an allowed check left its key without the units for one more like it.
fn spent(c: &Check<'_>, d: &Decision) -> bool {
    d.remaining < c.cost.max(1)
}

/// The checks whose decisions make `verdict` a denial, with them: those denied, or, for an
/// allowed verdict, those it left without a unit ([`spent`]).
fn denying<'a, 'c>(
    checks: &'a [Check<'c>],
    verdict: &'a Verdict,
) -> impl Iterator<Item = (&'a Check<'c>, &'a Decision)> + 'a {
    let allowed = verdict.allowed();
    checks
        .iter()
        .zip(&verdict.decisions)
        .filter(move |(c, d)| if allowed { spent(c, d) } else { !d.allowed })
}

fn fp_bytes(fp: &[u64; 2]) -> [u8; 16] {
    let mut out = [0; 16];
    out[..8].copy_from_slice(&fp[0].to_le_bytes());
    out[8..].copy_from_slice(&fp[1].to_le_bytes());
    out
}

/// The cached verdict as seen `now`: waits shortened by the time passed.
fn aged(entry: &Entry, now: u64) -> Verdict {
    let elapsed = Duration::from_micros(now.saturating_sub(entry.at));
    let decisions = entry
        .verdict
        .decisions
        .iter()
        .map(|d| Decision {
            retry_after: d
                .retry_after
                .map(|r| r.saturating_sub(elapsed).max(Duration::from_millis(1))),
            reset_after: d.reset_after.saturating_sub(elapsed),
            ..*d
        })
        .collect();
    Verdict {
        decisions,
        wait: Duration::ZERO,
        lease: None,
        at: Timestamp::from_micros(now),
    }
}

/// How long a verdict makes the same check certain to be denied, if it does.
fn denial_for(checks: &[Check<'_>], verdict: &Verdict) -> Option<Duration> {
    let allowed = verdict.allowed();
    denying(checks, verdict)
        .filter_map(|(c, d)| {
            if allowed {
                // The check spent a key's last unit: denied until the next one comes, when the
                // algorithm says exactly when. Decisions round durations up to whole
                // milliseconds, so this is never earlier than the store would admit (at most a
                // millisecond later; on a cluster, a check across slots may add the time
                // between its parts).
                next_unit(c.policy, d).filter(|d| !d.is_zero())
            } else {
                d.retry_after
            }
        })
        .max()
}

/// After an allowed check left `d.remaining == 0`: the time until one more unit is admitted.
fn next_unit(policy: &Policy, d: &Decision) -> Option<Duration> {
    let spacing = |per_unit_us: u64, limit: u64| {
        let full = Duration::from_micros(per_unit_us.saturating_mul(limit.saturating_sub(1)));
        Some(d.reset_after.saturating_sub(full))
    };
    match policy.kind() {
        Kind::Gcra(g) => spacing(g.emission_us(), g.limit()),
        Kind::LeakyBucket(f) => spacing(f.unit_us(), f.capacity()),
        Kind::TokenBucket(t) if t.per_step() == 1 => spacing(t.step_us(), t.capacity()),
        Kind::FixedWindow(_) => Some(d.reset_after),
        _ => None,
    }
}

/// What the cache says of a check before the store is asked.
enum Consulted {
    /// Denied until a time still to come: the cached verdict.
    Denied(Box<Verdict>),
    /// Another caller is probing the store for this check: wait for its answer, then look
    /// again.
    Wait(tokio::sync::futures::OwnedNotified),
    /// Ask the store.
    Ask,
}

impl<L: Limiter, C: Clock> DenyCache<L, C> {
    /// Looks the check of fingerprint `fp` up. When its denial just ran out, one caller probes
    /// (and gets `leader`, whose drop hands the probe on) while the others wait.
    fn consult<'a>(&'a self, fp: [u64; 2], leader: &mut Option<Leader<'a>>) -> Consulted {
        let shared = &self.shared;
        let now = shared.clock.now().as_micros();
        match self.lookup_counted(&fp, now) {
            Lookup::Denied(verdict) => return Consulted::Denied(verdict),
            Lookup::Probe => {
                let mut probes = shared.probes.lock().unwrap_or_else(PoisonError::into_inner);
                if let Some(probe) = probes.get_mut(&fp) {
                    shared.coalesced.fetch_add(1, Ordering::Relaxed);
                    probe.waiting = probe.waiting.saturating_add(1);
                    return Consulted::Wait(Arc::clone(&probe.notify).notified_owned());
                }
                let n = Arc::new(Notify::new());
                probes.insert(
                    fp,
                    Probe {
                        notify: Arc::clone(&n),
                        waiting: 0,
                    },
                );
                *leader = Some(Leader {
                    probes: &shared.probes,
                    fp,
                    notify: n,
                });
            }
            Lookup::Miss => {}
        }
        shared.misses.fetch_add(1, Ordering::Relaxed);
        Consulted::Ask
    }
}

impl<L: Limiter, C: Clock> Limiter for DenyCache<L, C> {
    type Error = L::Error;

    fn cache_stats(&self) -> CacheStats {
        CacheStats {
            deny_cache: Some(self.stats()),
            ..self.inner.cache_stats()
        }
    }

    fn is_unavailable(error: &L::Error) -> bool {
        L::is_unavailable(error)
    }

    /// When the inner limiter keeps them: waiting for another caller's probe stops at the
    /// deadline too. (Should the probe's caller stall, a check that waited for it to the
    /// deadline then asks the store itself, within the inner limiter's own bound.)
    fn keeps_deadlines(&self, within: Duration) -> bool {
        self.inner.keeps_deadlines(within)
    }

    /// A cached denial of `checks` still in force (counted as a hit), else the inner
    /// limiter's local answer.
    fn check_local(&self, checks: &[Check<'_>], opts: &CheckOptions) -> Option<Verdict> {
        if self.cacheable(checks, opts) {
            let fp = self.fingerprint(checks, opts);
            let now = self.shared.clock.now().as_micros();
            if let Lookup::Denied(verdict) = self.lookup_counted(&fp, now) {
                return Some(*verdict);
            }
        }
        self.inner.check_local(checks, opts)
    }

    async fn check(&self, checks: &[Check<'_>], opts: CheckOptions) -> Result<Verdict, L::Error> {
        let cacheable = self.cacheable(checks, &opts);
        // One await of the inner check, on every path: limiters' futures are large, and this
        // one is held by layers that box it per request.
        let mut leader = None;
        let fp = cacheable.then(|| self.fingerprint(checks, &opts));
        if let Some(fp) = fp {
            loop {
                let notified = match self.consult(fp, &mut leader) {
                    Consulted::Denied(verdict) => return Ok(*verdict),
                    Consulted::Wait(notified) => notified,
                    Consulted::Ask => break,
                };
                // Not past the caller's deadline: once it has passed, the store (which keeps
                // deadlines, or the caller times the check) answers at once.
                let patience = opts.deadline.map_or(PROBE_PATIENCE, |d| {
                    d.saturating_duration_since(std::time::Instant::now())
                        .min(PROBE_PATIENCE)
                });
                if patience.is_zero() {
                    break;
                }
                // Rare, and boxed so that the usual path's future stays small. Woken, the probe
                // has answered: look again. Out of patience, the probe has stalled: ask the
                // store (looking again would find the probe still pending, and wait as long
                // once more).
                if Box::pin(tokio::time::timeout(patience, notified))
                    .await
                    .is_err()
                {
                    break;
                }
            }
        }
        // Read before the store is asked: a reset made meanwhile makes this answer stale.
        let counts = self.shared.counts.load(Ordering::SeqCst);
        let result = self.inner.check(checks, opts).await;
        if let (Some(fp), Ok(verdict)) = (fp, &result) {
            // Measured from the reply: a denial may outlast the store's by the reply's trip
            // (conservative: never admits what the store would deny). Measured from the asking
            // instead, it would run out up to a round trip early, and the probe sent then is
            // denied once more: about two store calls per retry period instead of one.
            let now = self.shared.clock.now().as_micros();
            let entry = denial_for(checks, verdict).map(|d| Entry {
                until: now.saturating_add(duration_micros(d).min(self.max_hold_us)),
                resets: resets_of(counts),
                at: now,
                verdict: if verdict.allowed() {
                    synthesized_denial(checks, verdict, d)
                } else {
                    verdict.clone()
                },
            });
            // An allowed probe leaves the expired entry in place: for a moment after a
            // denial ran out, callers of this check keep coming one at a time, so a crowd
            // that was waiting does not all reach the store at once for a unit or two. A
            // probe that found room for the crowd ends that: one at a time, a window that
            // rolled over would be served one store round trip per request for a second.
            if let Some(entry) = entry {
                self.remember(&fp, now, entry, counts, (checks, verdict));
            } else if let Some(probe) = &leader
                && verdict.allowed()
                && room_for(checks, verdict, probe.waiting().max(CROWD_ROOM))
            {
                self.forget_run_out(&fp, now);
            }
        }
        // The leader's guard, dropped here (or with this future, if it is cancelled before
        // the store answers), hands the probe on.
        drop(leader);
        result
    }

    /// The store's own answer, past the cache (which it does not change).
    async fn check_store(
        &self,
        checks: &[Check<'_>],
        opts: CheckOptions,
    ) -> Result<Verdict, L::Error> {
        self.inner.check_store(checks, opts).await
    }

    async fn release(&self, checks: &[Check<'_>], lease: LeaseId) -> Result<(), L::Error> {
        self.inner.release(checks, lease).await
    }

    async fn renew(&self, checks: &[Check<'_>], lease: LeaseId) -> Result<bool, L::Error> {
        self.inner.renew(checks, lease).await
    }

    /// Refunds in the store, then forgets the cached denial of the same checks (made without a
    /// wait), which the refund makes wrong: a check that spent a key's last unit leaves one
    /// behind. Cached denials of other checks on the same keys run out at their time. A denial
    /// the store answered before the refund and not yet stored is not stored when one of the
    /// keys that denied it was refunded (by policy and key, in 256 stripes: a key sharing a
    /// stripe with a refunded one costs a store call); denials made by other keys, a global
    /// policy's among the keys refunded or not, are stored.
    async fn refund(&self, checks: &[Check<'_>], verdict: &Verdict) -> Result<(), L::Error> {
        self.inner.refund(checks, verdict).await?;
        if verdict.allowed() {
            // Counted, then its stripes written, while `refunding` says so: a denial stored
            // meanwhile (which sees the count) cannot miss the stripes (see `remember`).
            let shared = &self.shared;
            shared.refunding.fetch_add(1, Ordering::SeqCst);
            let counts = shared.counts.fetch_add(ONE_REFUND, Ordering::SeqCst);
            let refund = refunds_of(counts.wrapping_add(ONE_REFUND));
            for c in checks {
                // The latest refund of the stripe, however refunds race: kept if a later one
                // (counted after this one, up to the count now) wrote it first.
                let _ = self
                    .stripe(c)
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |last| {
                        let now = refunds_of(shared.counts.load(Ordering::SeqCst));
                        (!after_within(last, refund, now)).then_some(refund)
                    });
            }
            shared.refunding.fetch_sub(1, Ordering::SeqCst);
            self.forget(&self.fingerprint(checks, &CheckOptions::default()));
        }
        Ok(())
    }

    /// Resets in the store, then forgets every denial cached so far (of any key: a cached
    /// check is known by a digest of its keys), which the reset may make wrong; those of other
    /// keys cost one store call each.
    async fn reset(&self, key: &[u8], policy: &Policy) -> Result<(), L::Error> {
        self.inner.reset(key, policy).await?;
        // After the store's reset: a check asked before it and cached after it is stale too.
        self.shared.counts.fetch_add(ONE_RESET, Ordering::AcqRel);
        Ok(())
    }
}

/// The caller probing the store for a check whose denial ran out. Dropped, when the probe is
/// answered or when its caller is cancelled (a dropped request, a timeout) or panics, it clears
/// the probe and wakes the callers waiting for it: a cancelled probe never leaves them waiting
/// for an answer that will not come.
/// A probe in flight: its callers' wake-up, and how many began waiting for it (some may have
/// stopped since: an upper bound).
struct Probe {
    notify: Arc<Notify>,
    waiting: u64,
}

struct Leader<'a> {
    probes: &'a Mutex<HashMap<[u64; 2], Probe>>,
    fp: [u64; 2],
    notify: Arc<Notify>,
}

impl Leader<'_> {
    /// How many callers began waiting for this probe.
    fn waiting(&self) -> u64 {
        let probes = self.probes.lock().unwrap_or_else(PoisonError::into_inner);
        probes
            .get(&self.fp)
            .filter(|p| Arc::ptr_eq(&p.notify, &self.notify))
            .map_or(0, |p| p.waiting)
    }
}

impl Drop for Leader<'_> {
    fn drop(&mut self) {
        let mut probes = self.probes.lock().unwrap_or_else(PoisonError::into_inner);
        if probes
            .get(&self.fp)
            .is_some_and(|p| Arc::ptr_eq(&p.notify, &self.notify))
        {
            probes.remove(&self.fp);
        }
        drop(probes);
        self.notify.notify_waiters();
    }
}

/// Whether the allowed `verdict` of `checks` leaves room for `more` checks like it.
fn room_for(checks: &[Check<'_>], verdict: &Verdict, more: u64) -> bool {
    checks
        .iter()
        .zip(&verdict.decisions)
        .all(|(c, d)| d.remaining >= c.cost.saturating_mul(more))
}

/// The denial the next identical check will get after `verdict` spent the last unit.
fn synthesized_denial(checks: &[Check<'_>], verdict: &Verdict, wait: Duration) -> Verdict {
    let decisions = checks
        .iter()
        .zip(&verdict.decisions)
        .map(|(c, d)| {
            if spent(c, d) {
                Decision {
                    allowed: false,
                    retry_after: Some(wait),
                    ..*d
                }
            } else {
                *d
            }
        })
        .collect();
    Verdict {
        decisions,
        wait: Duration::ZERO,
        lease: None,
        at: verdict.at,
    }
}

#[cfg(test)]
mod tests {
    use super::after_within;

    #[test]
    fn refund_counts_compare_within_their_window_across_the_wrap() {
        assert!(after_within(5, 3, 7));
        assert!(after_within(7, 3, 7));
        assert!(
            !after_within(3, 3, 7),
            "the count at the asking is not after it"
        );
        assert!(!after_within(8, 3, 7), "not yet counted");
        // Across the wrap: from u32::MAX - 1, the window holds u32::MAX, 0 and 1.
        assert!(after_within(0, u32::MAX - 1, 1));
        assert!(after_within(u32::MAX, u32::MAX - 1, 1));
        assert!(!after_within(u32::MAX - 1, u32::MAX - 1, 1));
        // A stripe last refunded long ago (or never) is outside the window however far the
        // counts have gone: 2^31 refunds later as well.
        assert!(!after_within(0, (1 << 31) - 1, 1 << 31));
        assert!(after_within(1 << 31, (1 << 31) - 1, 1 << 31));
    }
}
