//! [`Leasing`]: very hot keys spend a local slice of their budget instead of asking the store
//! each time.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use smallvec::SmallVec;

use super::sharded::{NewSlot, OnFull, ShardedMap};
use super::{CacheStats, Check, CheckOptions, Limiter};
use crate::clock::{Clock, SystemClock, duration_micros};
use crate::error::PolicyError;
use crate::policy::Kind;
use crate::{Decision, LeaseId, Policy, Timestamp, Verdict};

/// The longest lease [`LeasingConfig::validate`] accepts: a lease is a slice of a hot key's
/// budget held for a moment (250 ms by default), not for hours.
pub const MAX_LEASE_FOR: Duration = Duration::from_secs(3_600);

/// How [`Leasing`] leases.
#[derive(Clone, Debug, PartialEq)]
pub struct LeasingConfig {
    /// A lease takes this fraction of the policy's limit (default 1%).
    pub fraction: f64,
    /// Keys whose lease would be smaller than this are never leased (default 8).
    pub min_units: u64,
    /// The most units in one lease (default 10,000).
    pub max_units: u64,
    /// How long a lease lasts (default 250 ms); also the period over which a key must see
    /// [`LeasingConfig::hot_after`] checks to be leased.
    pub lease_for: Duration,
    /// Checks within one lease period that make a key hot (default 16).
    pub hot_after: u32,
    /// The most keys tracked at once (default 100,000). When that many are tracked (a flood of
    /// unique keys), new keys go to the store untracked until older ones expire: a key holding
    /// a lease is never evicted to make room, which would strand its units.
    pub max_keys: usize,
}

impl LeasingConfig {
    /// Checks the settings: a fraction in (0, 1], a lease period of at most [`MAX_LEASE_FOR`], a hotness threshold and
    /// room for keys above zero, and `min_units` no more than `max_units`. A lease that could
    /// never be spent (a zero period) would cost each hot check a lease of units for nothing.
    ///
    /// # Errors
    /// [`PolicyError`] naming the bad field.
    pub fn validate(&self) -> Result<(), PolicyError> {
        if !self.fraction.is_finite() || self.fraction <= 0.0 {
            return Err(PolicyError::NotPositive {
                field: "leasing fraction",
                value: self.fraction,
            });
        }
        if self.fraction > 1.0 {
            return Err(PolicyError::TooLarge {
                field: "leasing fraction",
                value: self.fraction.to_string(),
                max: "1".into(),
            });
        }
        if self.lease_for.is_zero() {
            return Err(PolicyError::Zero {
                field: "leasing lease_for",
            });
        }
        if self.lease_for > MAX_LEASE_FOR {
            return Err(PolicyError::TooLarge {
                field: "leasing lease_for",
                value: format!("{:?}", self.lease_for),
                max: format!("{MAX_LEASE_FOR:?}"),
            });
        }
        if self.hot_after == 0 {
            return Err(PolicyError::Zero {
                field: "leasing hot_after",
            });
        }
        if self.max_keys == 0 {
            return Err(PolicyError::Zero {
                field: "leasing max_keys",
            });
        }
        if self.min_units > self.max_units {
            return Err(PolicyError::Invalid {
                field: "leasing min_units",
                reason: format!(
                    "{} is more than max_units ({}): no key would ever be leased",
                    self.min_units, self.max_units
                ),
            });
        }
        Ok(())
    }
}

impl Default for LeasingConfig {
    fn default() -> Self {
        LeasingConfig {
            fraction: 0.01,
            min_units: 8,
            max_units: 10_000,
            lease_for: Duration::from_millis(250),
            hot_after: 16,
            max_keys: 100_000,
        }
    }
}

/// Counters of a [`Leasing`] limiter.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeasingStats {
    /// Checks answered from a lease, without the store.
    pub local: u64,
    /// Checks passed to the store.
    pub store: u64,
    /// Leases taken.
    pub leases: u64,
    /// Units taken in leases that could not be given back: the refund failed, or the lease
    /// had no room to be tracked. (A lease whose key goes quiet is neither spent nor given
    /// back, and not counted: see the "Bounds" of [`Leasing`].)
    pub wasted: u64,
    /// Units of leases offered back to the store unspent, before the key's next lease: the
    /// store takes back what of them it still counts (a window that has ended, or GCRA water
    /// that has drained, takes nothing).
    pub returned: u64,
}

/// One (policy, key)'s local state.
struct Local {
    /// Units left in the current lease.
    units: u64,
    /// When the lease ends (local clock, µs).
    until: u64,
    /// Which lease this is (one more with each lease taken): units taken from a lease go back
    /// to that lease only.
    lease_no: u64,
    /// The decision the lease was taken with (for headers of local answers), and when (local
    /// clock, µs).
    decision: Decision,
    granted: u64,
    /// When the store counted the lease (its verdict's `at`, the store's clock, µs): local
    /// answers carry it, so a refund gives back from what the store counted then.
    store_at: u64,
    /// Checks seen in the current counting period, and when that period started.
    seen: u32,
    period_start: u64,
    /// Until when (local clock, µs) no lease is asked for: the store refused one (the key is
    /// near or over its limit), and asking again at each check would cost a second store call
    /// per check, one at a time behind the key's lease lock.
    no_lease_until: u64,
}

impl Local {
    /// A key seen for the first time at `now`: no lease yet.
    fn blank(now: u64) -> Self {
        Local {
            units: 0,
            until: 0,
            lease_no: 0,
            decision: Decision::from_micros(true, 0, 0, None, 0),
            granted: now,
            store_at: now,
            seen: 0,
            period_start: now,
            no_lease_until: 0,
        }
    }

    /// Replaces the lease by `n` units the store granted with `verdict`, good until `until`;
    /// returns the units the replaced lease left unspent.
    fn take(&mut self, n: u64, until: u64, verdict: &Verdict, now: u64) -> u64 {
        let unspent = std::mem::replace(&mut self.units, n);
        self.until = until;
        self.lease_no = self.lease_no.wrapping_add(1);
        self.decision = verdict.decisions[0];
        self.granted = now;
        self.store_at = verdict.at.as_micros();
        self.no_lease_until = 0;
        unspent
    }
}

/// Locks that serialise lease taking, by key (see `Shared::taking`).
const TAKING_STRIPES: usize = 64;

struct Shared<C> {
    map: ShardedMap<Local>,
    clock: C,
    cfg: LeasingConfig,
    /// Serialises lease taking per key, striped: two tasks never ask for a lease of one key
    /// at once, while leases of keys on different stripes are taken side by side (one lock
    /// for all would let at most one lease per store round trip, for every hot key of the
    /// replica, queue behind each other).
    taking: Box<[Arc<tokio::sync::Mutex<()>>]>,
    local: AtomicU64,
    store: AtomicU64,
    leases: AtomicU64,
    wasted: AtomicU64,
    returned: AtomicU64,
}

/// A [`Limiter`] that leases slices of very hot keys' budgets.
///
/// When one key sees many checks in a short time, this replica takes a *lease*: it checks the
/// store once with a cost of `n` units (a small fraction of the policy's limit) and then admits
/// up to `n` requests locally, without a round trip, until the units run out or the lease ends.
///
/// # Bounds
///
/// Leasing trades a little precision for much less traffic to the shared store:
///
/// - **Never more than the store granted.** Units are taken from the store before they are
///   spent, so across all replicas no more units are admitted than the policy's state allows in
///   total.
/// - **Over a single window, at most `replicas × n` over the limit.** Units taken just before a
///   window of the policy (its period, its calendar day, ...) may be spent just inside it: any
///   window can admit up to `n` extra units per replica (per lease taken before it started).
/// - **Unspent units go back.** The units a lease leaves unspent (it ran out of time, or had
///   fewer than a check's cost) are given back to the store before the key asks for its next
///   lease (a refund, as of when the lease was counted), whether or not the store grants it: a
///   key that stays hot under-uses no more than the lease it holds, however long the policy's
///   window, and a `calendar:100000/day` key is not charged a lease per lease period. That
///   costs the check that asks for the next lease a second store call. A lease whose key goes
///   quiet is not given back: at most `replicas × n` stranded until the policy refills them.
///
/// Leases only apply to checks of cost ≥ 1 against algorithms whose cost simply adds up (GCRA,
/// funnel, token bucket, fixed and sliding windows, sliding log), and only when `n` would be at
/// least [`LeasingConfig::min_units`]: a limit of 20 per minute is never leased. Concurrency
/// limits and shapers always go to the store, as do checks with an injected time.
///
/// A key the store refuses a lease (it has fewer units left than a lease, or none) is not asked
/// for one again until the store says a lease's units may be free, and for at most a lease
/// period: meanwhile its checks go to the store one call each, as without leasing. A key whose
/// lease failed (the store is down or slow) is not asked for one again within a lease period.
///
/// Under a tokio runtime, a lease is taken (and the last one's unspent units given back) in a
/// task of its own: a caller that gives up while it waits (a timeout around `check`) leaves
/// the lease to the replica instead of taking its units with it.
pub struct Leasing<L, C = SystemClock> {
    inner: L,
    shared: Arc<Shared<C>>,
}

impl<L: Clone, C> Clone for Leasing<L, C> {
    fn clone(&self) -> Self {
        Leasing {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<L: std::fmt::Debug, C> std::fmt::Debug for Leasing<L, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leasing")
            .field("inner", &self.inner)
            .field("config", &self.shared.cfg)
            .finish()
    }
}

impl<L> Leasing<L, SystemClock> {
    /// Leasing in front of `inner` with the default settings.
    pub fn new(inner: L) -> Self {
        Leasing::with_config(inner, LeasingConfig::default(), SystemClock::new())
    }
}

impl<L, C: Clock> Leasing<L, C> {
    /// Leasing with explicit settings and clock (check them with [`LeasingConfig::validate`];
    /// the tower layer's builder does).
    pub fn with_config(inner: L, cfg: LeasingConfig, clock: C) -> Self {
        Leasing {
            inner,
            shared: Arc::new(Shared {
                // Refuse rather than evict: evicting the soonest to expire would pick leased
                // keys half-way through their lease before the flood's fresh ones.
                map: ShardedMap::new(cfg.max_keys, 64, OnFull::Reject),
                clock,
                cfg,
                taking: (0..TAKING_STRIPES)
                    .map(|_| Arc::new(tokio::sync::Mutex::new(())))
                    .collect(),
                local: AtomicU64::new(0),
                store: AtomicU64::new(0),
                leases: AtomicU64::new(0),
                wasted: AtomicU64::new(0),
                returned: AtomicU64::new(0),
            }),
        }
    }

    /// The limiter behind.
    pub fn inner(&self) -> &L {
        &self.inner
    }

    /// The counters.
    pub fn stats(&self) -> LeasingStats {
        let s = &self.shared;
        LeasingStats {
            local: s.local.load(Ordering::Relaxed),
            store: s.store.load(Ordering::Relaxed),
            leases: s.leases.load(Ordering::Relaxed),
            wasted: s.wasted.load(Ordering::Relaxed),
            returned: s.returned.load(Ordering::Relaxed),
        }
    }

    /// Units in a lease of `policy`, if it can be leased at all.
    fn lease_size(&self, policy: &Policy) -> Option<u64> {
        let leasable = matches!(
            policy.kind(),
            Kind::Gcra(_)
                | Kind::LeakyBucket(_)
                | Kind::TokenBucket(_)
                | Kind::FixedWindow(_)
                | Kind::SlidingWindow(_)
                | Kind::SlidingLog(_)
        );
        let cfg = &self.shared.cfg;
        let n = (policy.limit() as f64 * cfg.fraction).floor() as u64;
        let n = n.min(cfg.max_units);
        (leasable && n >= cfg.min_units.max(2)).then_some(n)
    }

    /// Spends `cost` units of every check locally, all or nothing; counts the checks towards
    /// hotness either way. Returns the local verdict, or which checks are hot without units:
    /// none when a check without units is not hot, as then leases for the others would not
    /// let the call be answered locally (a hot global limit beside a per-client one of a new
    /// client), and would run out unspent, lease after lease.
    fn spend(&self, checks: &[Check<'_>], now: u64) -> Result<Verdict, SmallVec<[usize; 2]>> {
        let map = &self.shared.map;
        let cfg = &self.shared.cfg;
        let period = duration_micros(cfg.lease_for);
        let mut hot_without_units: SmallVec<[usize; 2]> = SmallVec::new();
        let mut cold_without_units = false;
        let mut enough = true;
        let located: SmallVec<[u64; 2]> = checks
            .iter()
            .map(|c| map.hash(c.policy.ident(), c.key))
            .collect();
        for (i, (c, &hash)) in checks.iter().zip(&located).enumerate() {
            let mut shard = map.lock(map.shard_of(hash));
            let local = match shard.find_mut(hash, c.policy.ident(), c.key) {
                Some(slot) => &mut slot.value,
                None => {
                    let _ = map.insert(
                        &mut shard,
                        NewSlot {
                            hash,
                            ident: c.policy.ident(),
                            key: c.key,
                            value: Local::blank(now),
                            expires_at: now.saturating_add(period.saturating_mul(2)),
                        },
                        now,
                    );
                    enough = false;
                    cold_without_units = true;
                    continue;
                }
            };
            if now >= local.period_start.saturating_add(period) {
                local.period_start = now;
                local.seen = 0;
            }
            local.seen = local.seen.saturating_add(1);
            // A lease that ended keeps its units until the next one replaces it and gives them
            // back; none of them is spent.
            let units = if local.until > now { local.units } else { 0 };
            if units < c.cost {
                enough = false;
                if local.seen >= cfg.hot_after && now >= local.no_lease_until {
                    hot_without_units.push(i);
                } else {
                    cold_without_units = true;
                }
            }
        }
        if !enough {
            if cold_without_units {
                hot_without_units.clear();
            }
            return Err(hot_without_units);
        }
        // Every check has units: take them. Another thread may have spent them in between, so
        // check again under each shard's lock, and put back what was taken if one falls short.
        // (check, the lease its units came from)
        let mut taken: SmallVec<[(usize, u64); 2]> = SmallVec::new();
        let mut decisions = SmallVec::new();
        let mut counted_at = u64::MAX;
        for (i, (c, &hash)) in checks.iter().zip(&located).enumerate() {
            let mut shard = map.lock(map.shard_of(hash));
            match shard.find_mut(hash, c.policy.ident(), c.key) {
                Some(slot) if slot.value.units >= c.cost && slot.value.until > now => {
                    let local = &mut slot.value;
                    local.units -= c.cost;
                    // The lease's decision, aged: its reset time counts from the grant (the
                    // store's state is full again then), which a refund relies on too.
                    let elapsed = Duration::from_micros(now.saturating_sub(local.granted));
                    decisions.push(Decision {
                        remaining: local.decision.remaining.saturating_add(local.units),
                        reset_after: local.decision.reset_after.saturating_sub(elapsed),
                        ..local.decision
                    });
                    taken.push((i, local.lease_no));
                    counted_at = counted_at.min(local.store_at);
                }
                _ => {
                    drop(shard);
                    self.put_back(checks, &located, &taken);
                    return Err(SmallVec::new());
                }
            }
        }
        // The time the store counted the units (the earliest lease's, when several): a refund
        // then gives back from the window that counted them, never from a later one, and the
        // reset times, aged for the headers, make a drain-based refund give back up to the
        // lease's age less, never more.
        let at = if counted_at == u64::MAX {
            now
        } else {
            counted_at
        };
        Ok(Verdict {
            decisions,
            wait: Duration::ZERO,
            lease: None,
            at: Timestamp::from_micros(at),
        })
    }
}

impl<L, C: Clock> Leasing<L, C> {
    /// Gives back the units `taken` by the checks of a call that then fell short: each
    /// `(check, lease number)` to the lease it came from. Units of a lease replaced in the
    /// meantime are not added to the new one, which the store granted without them: they count
    /// as wasted.
    fn put_back(&self, checks: &[Check<'_>], located: &[u64], taken: &[(usize, u64)]) {
        let map = &self.shared.map;
        for &(j, lease_no) in taken {
            let (c, hash) = (&checks[j], located[j]);
            let mut shard = map.lock(map.shard_of(hash));
            match shard.find_mut(hash, c.policy.ident(), c.key) {
                Some(slot) if slot.value.lease_no == lease_no => slot.value.units += c.cost,
                _ => {
                    self.shared.wasted.fetch_add(c.cost, Ordering::Relaxed);
                }
            }
        }
    }
}

impl<L: Limiter + Clone + 'static, C: Clock> Leasing<L, C> {
    /// Takes a lease for each hot check that has a lease size. Denied or failed leases are left
    /// alone: the check then goes to the store as it is.
    async fn take_leases(&self, checks: &[Check<'_>], hot: &[usize]) {
        let map = &self.shared.map;
        for &i in hot {
            let c = &checks[i];
            let Some(n) = self.lease_size(c.policy) else {
                continue;
            };
            let hash = map.hash(c.policy.ident(), c.key);
            // One key's lease at a time: held for this key only, never two at once, so no
            // order of taking can deadlock.
            let stripe = (hash >> 32) as usize % self.shared.taking.len();
            let one_at_a_time = Arc::clone(&self.shared.taking[stripe]).lock_owned().await;
            let now = self.shared.clock.now().as_micros();
            // Someone may have leased it while we waited, or been refused a lease (the checks
            // that queued behind that one do not ask again).
            let settled = map
                .lock(map.shard_of(hash))
                .find(hash, c.policy.ident(), c.key)
                .is_some_and(|s| {
                    (s.value.units >= c.cost && s.value.until > now) || now < s.value.no_lease_until
                });
            if settled {
                continue;
            }
            // The store calls run in a task of their own, holding the key's lock: a caller
            // that gives up half-way (its timeout) would otherwise drop them there, with the
            // last lease's unspent units taken out but never given back, or a lease the store
            // counted never recorded here, its units lost to the key until its window ends.
            let this = self.clone();
            let (key, policy) = (c.key.to_vec(), c.policy.clone());
            let lease = async move {
                this.lease(&key, &policy, hash, n).await;
                drop(one_at_a_time);
            };
            match tokio::runtime::Handle::try_current() {
                // A lease that panicked is no lease: the check goes to the store.
                Ok(runtime) => drop(runtime.spawn(lease).await),
                // No runtime to run it on (another executor): the caller takes it.
                Err(_) => lease.await,
            }
        }
    }

    /// Gives back what `key`'s last lease left unspent, then takes a lease of `n` units.
    async fn lease(&self, key: &[u8], policy: &Policy, hash: u64, n: u64) {
        let map = &self.shared.map;
        // What the key's last lease left unspent (it ended, or holds less than this check's
        // cost) goes back to the store first, whether or not a new lease is granted: the
        // store then has those units for the new lease, or for the key's checks if it is
        // refused one. Taken out under the shard's lock, so no check spends them meanwhile.
        let leftover = map
            .lock(map.shard_of(hash))
            .find_mut(hash, policy.ident(), key)
            .and_then(|slot| {
                let local = &mut slot.value;
                let unspent = std::mem::take(&mut local.units);
                (unspent > 0).then(|| {
                    let lease = Verdict {
                        decisions: smallvec::smallvec![local.decision],
                        wait: Duration::ZERO,
                        lease: None,
                        at: Timestamp::from_micros(local.store_at),
                    };
                    (unspent, lease)
                })
            });
        if let Some((unspent, lease)) = leftover {
            // As a check's refund, as of the lease's time: the units' share of what the
            // store counted for the lease, less what has drained since.
            let back = [Check::new(key, policy).cost(unspent)];
            let counter = match self.inner.refund(&back, &lease).await {
                Ok(()) => &self.shared.returned,
                Err(_) => &self.shared.wasted,
            };
            counter.fetch_add(unspent, Ordering::Relaxed);
        }
        self.shared.store.fetch_add(1, Ordering::Relaxed);
        let lease = [Check::new(key, policy).cost(n)];
        let lease_for = self.shared.cfg.lease_for;
        // Not asked again before `n` units may be free, nor within a lease period: meanwhile
        // the key's checks go to the store as they are. A store that failed (or answered with
        // no decision, granting nothing) is not asked again within a lease period either:
        // otherwise each check queued behind this one would ask in turn, one store call (or
        // timeout) after the other, before making its own.
        let back_off = match self.inner.check(&lease, CheckOptions::default()).await {
            Ok(verdict) if verdict.allowed() && !verdict.decisions.is_empty() => {
                self.keep(key, policy, hash, n, &verdict);
                return;
            }
            Ok(verdict) => verdict
                .decisions
                .first()
                .and_then(|d| d.retry_after)
                .map_or(lease_for, |r| r.min(lease_for)),
            Err(_) => lease_for,
        };
        let now = self.shared.clock.now().as_micros();
        if let Some(slot) = map
            .lock(map.shard_of(hash))
            .find_mut(hash, policy.ident(), key)
        {
            slot.value.no_lease_until = now.saturating_add(duration_micros(back_off));
        }
    }

    /// Records the lease of `n` units the store granted in `verdict`.
    fn keep(&self, key: &[u8], policy: &Policy, hash: u64, n: u64, verdict: &Verdict) {
        let map = &self.shared.map;
        let now = self.shared.clock.now().as_micros();
        let lease_for = duration_micros(self.shared.cfg.lease_for);
        let until = now.saturating_add(lease_for);
        self.shared.leases.fetch_add(1, Ordering::Relaxed);
        let expires_at = until.saturating_add(lease_for);
        let mut shard = map.lock(map.shard_of(hash));
        if let Some(slot) = shard.find_mut(hash, policy.ident(), key) {
            // Given back above; units put back since (by a check that fell short) belong
            // to the lease they came from: wasted.
            let unspent = slot.value.take(n, until, verdict, now);
            if unspent > 0 {
                self.shared.wasted.fetch_add(unspent, Ordering::Relaxed);
            }
            slot.set_expires_at(expires_at);
        } else {
            // Swept while the store answered (its counting period had run out): tracked
            // anew with its lease, or, with no room left, its units are wasted.
            let mut value = Local::blank(now);
            value.take(n, until, verdict, now);
            let slot = NewSlot {
                hash,
                ident: policy.ident(),
                key,
                value,
                expires_at,
            };
            if map.insert(&mut shard, slot, now).is_err() {
                self.shared.wasted.fetch_add(n, Ordering::Relaxed);
            }
        }
    }
}

impl<L: Limiter + Clone + 'static, C: Clock> Limiter for Leasing<L, C> {
    type Error = L::Error;

    fn cache_stats(&self) -> CacheStats {
        CacheStats {
            leasing: Some(self.stats()),
            ..self.inner.cache_stats()
        }
    }

    fn is_unavailable(error: &L::Error) -> bool {
        L::is_unavailable(error)
    }

    async fn check(&self, checks: &[Check<'_>], opts: CheckOptions) -> Result<Verdict, L::Error> {
        // No check at all is the store's to refuse, not an allowed local answer.
        let leasable = !checks.is_empty()
            && opts.now.is_none()
            && opts.max_wait.is_zero()
            && checks
                .iter()
                .all(|c| c.cost > 0 && self.lease_size(c.policy).is_some_and(|n| c.cost <= n));
        if leasable {
            let now = self.shared.clock.now().as_micros();
            match self.spend(checks, now) {
                Ok(verdict) => {
                    self.shared.local.fetch_add(1, Ordering::Relaxed);
                    return Ok(verdict);
                }
                Err(hot) if !hot.is_empty() => {
                    self.take_leases(checks, &hot).await;
                    let now = self.shared.clock.now().as_micros();
                    if let Ok(verdict) = self.spend(checks, now) {
                        self.shared.local.fetch_add(1, Ordering::Relaxed);
                        return Ok(verdict);
                    }
                }
                Err(_) => {}
            }
        }
        self.shared.store.fetch_add(1, Ordering::Relaxed);
        self.inner.check(checks, opts).await
    }

    /// The inner limiter's local answer (a cached denial). Leased units are not spent here:
    /// whether a check is leased is decided on its way to the store.
    fn check_local(&self, checks: &[Check<'_>], opts: &CheckOptions) -> Option<Verdict> {
        self.inner.check_local(checks, opts)
    }

    /// The store's own answer, spending no leased unit.
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

    /// Refunds in the store: the units go back to the shared budget, whether the check took
    /// them from a local lease or from the store. A check answered from a local lease carries
    /// the time the store counted the lease (`Verdict::at`; the earliest lease's when a check
    /// spent several), and is refunded as of then, never giving back more than it took: a
    /// window gives back from the window that counted the lease (nothing when the store's
    /// window has moved on since, nor for a check whose other lease was counted in a later
    /// window); a sliding log takes the cost off the lease's entry; GCRA and the funnel give
    /// back the check's share of what is left of the lease's water, less the lease's age (its
    /// reset time is aged for the headers), so a lease older than its water gives nothing.
    async fn refund(&self, checks: &[Check<'_>], verdict: &Verdict) -> Result<(), L::Error> {
        self.inner.refund(checks, verdict).await
    }

    async fn reset(&self, key: &[u8], policy: &Policy) -> Result<(), L::Error> {
        // Forget the local lease too, so the reset takes effect at once here.
        let map = &self.shared.map;
        let hash = map.hash(policy.ident(), key);
        map.lock(map.shard_of(hash))
            .remove(hash, policy.ident(), key);
        self.inner.reset(key, policy).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MemoryLimiter, Policy};

    /// Sets the lease of `(policy, key)`, creating its entry.
    fn lease(l: &Leasing<MemoryLimiter>, policy: &Policy, key: &[u8], units: u64, lease_no: u64) {
        let map = &l.shared.map;
        let now = l.shared.clock.now().as_micros();
        let hash = map.hash(policy.ident(), key);
        let exists = map
            .lock(map.shard_of(hash))
            .find(hash, policy.ident(), key)
            .is_some();
        if !exists {
            // The first check of a key creates its entry (and has no units).
            let _ = l.spend(&[Check::new(key, policy)], now);
        }
        let mut shard = map.lock(map.shard_of(hash));
        let slot = shard.find_mut(hash, policy.ident(), key).expect("an entry");
        slot.value.units = units;
        // Every lease here ends at the same time: told apart by their numbers only.
        slot.value.until = u64::MAX / 2;
        slot.value.lease_no = lease_no;
    }

    fn units(l: &Leasing<MemoryLimiter>, policy: &Policy, key: &[u8]) -> u64 {
        let map = &l.shared.map;
        let hash = map.hash(policy.ident(), key);
        map.lock(map.shard_of(hash))
            .find(hash, policy.ident(), key)
            .map_or(0, |s| s.value.units)
    }

    #[test]
    fn units_go_back_to_their_own_lease_only() {
        let l = Leasing::new(MemoryLimiter::new());
        let p = Policy::per_second(100_000).expect("valid");
        lease(&l, &p, b"k", 10, 1);
        let checks = [Check::new(b"k", &p).cost(3)];
        let located = [l.shared.map.hash(p.ident(), b"k")];
        // Taken from lease 1, and it is still there: back they go.
        l.put_back(&checks, &located, &[(0, 1)]);
        assert_eq!(units(&l, &p, b"k"), 13);
        assert_eq!(l.stats().wasted, 0);
        // Meanwhile another task took a new lease: its units are its own.
        lease(&l, &p, b"k", 10, 2);
        l.put_back(&checks, &located, &[(0, 1)]);
        assert_eq!(units(&l, &p, b"k"), 10);
        assert_eq!(l.stats().wasted, 3);
    }
}
