//! A sharded, bounded map from `(identity, key bytes)` to expiring values, with a compact side
//! table for GCRA states of short keys: the memory behind every in-memory store.
//!
//! Each value knows when it stops mattering (`expires_at`); past that it can be dropped without
//! changing any decision. A shard sweeps expired values when it reaches its share of the key
//! bound, and when live values alone fill it, it either evicts those that expire soonest or
//! refuses new keys ([`OnFull`]). So a flood of unique keys costs bounded memory and amortised
//! constant time per insert.
//!
//! A shard holds two tables under one lock: 64-byte [`Slot`]s for any value, and 16-byte
//! [`Compact`] entries for the commonest state of all, a GCRA timestamp under a key of up to
//! 8 bytes, an IPv4 address in dotted decimal (the layer's per-IP key) or a decimal number (a
//! user id, a phone number), of one of the first fifteen GCRA policies to store such a key.
//! The key bound, sweeps and evictions cover both. Only the memory limiter uses the compact
//! table; elsewhere it stays empty and allocates nothing. At scale, bytes per key decide
//! whether a lookup hits the cache.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use hashbrown::HashTable;
use smallvec::SmallVec;

use crate::error::MemoryError;

/// What a full store does with a new key when none of its keys has expired.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnFull {
    /// Evict the live keys that expire soonest (an eighth of the shard). Their state is lost,
    /// so those keys start over: under a flood of unique keys, a limit may admit more than it
    /// should for the evicted keys. Memory stays bounded.
    #[default]
    EvictSoonest,
    /// Refuse the new key with [`MemoryError::Full`]; existing keys keep their state. Expired
    /// keys are dropped to make room a batch at a time (an eighth of the shard), not one by
    /// one: a full store may refuse new keys while fewer than a batch of old ones have expired.
    Reject,
}

/// Counters of a store's memory management.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Keys held now.
    pub keys: usize,
    /// Keys dropped because their state had expired (no effect on decisions).
    pub expired: u64,
    /// Live keys evicted to make room (their state was lost).
    pub evicted: u64,
    /// New keys refused because the store was full.
    pub refused: u64,
}

/// Keys up to this long are stored inline in the slot: no pointer to chase on lookup.
const INLINE_KEY: usize = 16;

/// One key's value. Aligned to a cache line: for the limiter's states a slot is exactly one
/// line (4 + 4 + 24 + 32 bytes), so a lookup touches the table's control bytes and one line.
#[repr(align(64))]
pub(crate) struct Slot<V> {
    ident: u32,
    /// When the value stops mattering, in whole seconds since the epoch, rounded up: a sweep
    /// can come up to a second late, never early.
    expires_s: u32,
    key: SmallVec<[u8; INLINE_KEY]>,
    pub(crate) value: V,
}

impl<V> Slot<V> {
    /// When the value stops mattering (µs since the epoch, rounded up to a whole second).
    #[inline]
    pub(crate) fn expires_at(&self) -> u64 {
        u64::from(self.expires_s) * 1_000_000
    }

    #[inline]
    pub(crate) fn set_expires_at(&mut self, us: u64) {
        self.expires_s = secs_up(us);
    }
}

/// Key equality without a `memcmp` call for keys of up to 16 bytes (the common case): two
/// overlapping 8-byte reads cover 9 to 16 bytes, [`load`] up to 8.
#[inline]
fn same_key(stored: &[u8], key: &[u8]) -> bool {
    let n = key.len();
    if stored.len() != n {
        return false;
    }
    match n {
        0..=8 => load(stored) == load(key),
        9..=16 => le8(stored) == le8(key) && le8(&stored[n - 8..]) == le8(&key[n - 8..]),
        _ => stored == key,
    }
}

/// Microseconds to whole seconds, rounded up and saturated (the year 2106).
#[inline]
fn secs_up(us: u64) -> u32 {
    u32::try_from(us.div_ceil(1_000_000)).unwrap_or(u32::MAX)
}

/// Keys up to this long fit a [`Compact`] entry. Longer keys fit when they are IPv4 addresses
/// in canonical dotted decimal or decimal numbers (see [`Packable`]).
pub(crate) const COMPACT_KEY: usize = 8;

/// How many policies the compact table serves (its index takes four bits, 0 is none).
const COMPACT_POLICIES: usize = 15;

/// The length code of a packed IPv4 address: no raw key that fits has it.
const IPV4: u8 = 0xf;

/// The length code of a packed decimal number of 9 to 19 digits (see [`decimal`]).
const DECIMAL: u8 = 0xe;

/// The largest tat a compact entry holds: 56 bits of microseconds, the year 4253. Never reached:
/// the memory limiter refuses times past 2^55 µs, and a tat is at most a policy's longest span
/// (2^51 µs) later than its check. A later one would be stored as this.
const MAX_TAT: u64 = (1 << 56) - 1;

/// A key as the compact table holds it: up to eight bytes as a word, and a tag of the policy's
/// compact index and the key's length. The length makes it one-to-one (`b"a"` and `b"a\0"`
/// differ).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Packed {
    key: u64,
    tag: u8,
}

/// A GCRA state in 16 bytes: the packed key, and in one word the tag (top eight bits) and the
/// theoretical arrival time, which is also when the state stops mattering.
///
/// The word is atomic: a check that finds the shard taken shares the read lock and advances the
/// tat with a compare-and-swap, so checks of held states do not wait for each other (as
/// governor's keyed limiter does). Uncontended, a check takes the write lock, one atomic
/// operation fewer. Inserting, sweeping and all-or-nothing checks take the write lock.
pub(crate) struct Compact {
    key: u64,
    word: AtomicU64,
}

impl Compact {
    fn new(key: Packed, tat: u64) -> Self {
        Compact {
            key: key.key,
            word: AtomicU64::new(with_tat(u64::from(key.tag) << 56, tat)),
        }
    }

    #[inline]
    fn is(&self, key: Packed) -> bool {
        // The tag never changes: a relaxed read of the word is enough.
        self.key == key.key && (self.word.load(Ordering::Relaxed) >> 56) as u8 == key.tag
    }

    fn packed(&self) -> Packed {
        Packed {
            key: self.key,
            tag: (self.word.load(Ordering::Relaxed) >> 56) as u8,
        }
    }

    /// The theoretical arrival time.
    #[inline]
    pub(crate) fn tat(&self) -> u64 {
        self.word.load(Ordering::Relaxed) & MAX_TAT
    }

    /// Sets the tat, under the write lock.
    #[inline]
    pub(crate) fn set_tat(&mut self, tat: u64) {
        let word = self.word.get_mut();
        *word = with_tat(*word, tat);
    }

    /// Advances the tat under the read lock: `step` maps the tat to an outcome and, when the
    /// check is admitted, the new tat. Retried (with the tat another check wrote) until the
    /// swap succeeds; `step` is pure, so the outcome is the one of the tat it replaced.
    #[inline]
    pub(crate) fn advance<T>(
        &self,
        mut step: impl FnMut(u64) -> (T, Option<u64>),
    ) -> (T, Option<u64>) {
        let mut word = self.word.load(Ordering::Relaxed);
        loop {
            let (out, tat) = step(word & MAX_TAT);
            let Some(tat) = tat else {
                return (out, None);
            };
            let new = with_tat(word, tat);
            match self
                .word
                .compare_exchange_weak(word, new, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return (out, Some(tat)),
                Err(now_held) => word = now_held,
            }
        }
    }
}

/// `word` (a compact entry's tag and tat) with its tat replaced by `tat`, saturated.
#[inline]
fn with_tat(word: u64, tat: u64) -> u64 {
    word & !MAX_TAT | tat.min(MAX_TAT)
}

/// A key the compact table can hold, before it is tagged with its policy's compact index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Packable {
    key: u64,
    len: u8,
}

impl Packable {
    /// Up to [`COMPACT_KEY`] bytes as a word with their length. A longer key when it is an
    /// IPv4 address in canonical dotted decimal (the layer's per-IP key, such as
    /// `203.113.100.200`), as its four bytes, or a number of up to 19 digits with no leading
    /// zero (a user id, a phone number), as its value: each with a length code no raw key has.
    /// Canonical text and value match one to one, so the packing stays one-to-one. `None` for
    /// any other key.
    #[inline]
    pub(crate) fn of(key: &[u8]) -> Option<Self> {
        let len = key.len();
        if len > COMPACT_KEY {
            if let Some(ip) = canonical_ipv4(key) {
                return Some(Packable {
                    key: u64::from(ip),
                    len: IPV4,
                });
            }
            return decimal(key).map(|n| Packable {
                key: n,
                len: DECIMAL,
            });
        }
        Some(Packable {
            key: load(key),
            // At most 8: fits the four bits.
            len: len as u8,
        })
    }

    /// The key of the policy with compact index `index` (1 to 15, see
    /// [`ShardedMap::compact_index`]).
    #[inline]
    pub(crate) fn pack(self, index: u8) -> Packed {
        Packed {
            key: self.key,
            tag: index << 4 | self.len,
        }
    }
}

/// `key` of the policy with compact index `index`, packed (see [`Packable`]).
#[cfg(test)]
fn pack(index: u8, key: &[u8]) -> Option<Packed> {
    Packable::of(key).map(|p| p.pack(index))
}

/// The address of `a.b.c.d` in canonical form: four decimal numbers up to 255, with no sign,
/// no leading zero and no other character. Anything else is `None`. It runs on every check of a
/// per-IP key, so it reads an octet at a time (one to three digits, then a dot) rather than
/// testing every byte for every case.
#[inline]
fn canonical_ipv4(text: &[u8]) -> Option<u32> {
    if !(7..=15).contains(&text.len()) {
        return None;
    }
    let digit = |i: usize| {
        let d = text.get(i)?.wrapping_sub(b'0');
        (d <= 9).then_some(u32::from(d))
    };
    let (mut ip, mut i) = (0u32, 0usize);
    for part in 0..4 {
        if part > 0 {
            if text.get(i) != Some(&b'.') {
                return None;
            }
            i += 1;
        }
        let mut octet = digit(i)?;
        i += 1;
        // A leading zero is the whole octet: a digit after it fails the dot test.
        if octet != 0
            && let Some(d) = digit(i)
        {
            octet = octet * 10 + d;
            i += 1;
            if let Some(d) = digit(i) {
                octet = octet * 10 + d;
                i += 1;
                if octet > 255 {
                    return None;
                }
            }
        }
        ip = ip << 8 | octet;
    }
    (i == text.len()).then_some(ip)
}

/// The value of a decimal number of 9 to 19 digits with no leading zero (every such number
/// fits a `u64`); `None` for anything else.
#[inline]
fn decimal(text: &[u8]) -> Option<u64> {
    if !(9..=19).contains(&text.len()) || text[0] == b'0' {
        return None;
    }
    let mut n = 0u64;
    for &b in text {
        let d = b.wrapping_sub(b'0');
        if d > 9 {
            return None;
        }
        n = n * 10 + u64::from(d);
    }
    Some(n)
}

/// Up to eight bytes as a little-endian word, zero-padded, without a `memcpy` call: two
/// overlapping fixed-size reads cover every length (the overlap ORs a byte with itself).
#[inline]
fn load(b: &[u8]) -> u64 {
    fn le<const N: usize>(b: &[u8]) -> u64 {
        let mut w = [0u8; 8];
        w[..N].copy_from_slice(&b[..N]);
        u64::from_le_bytes(w)
    }
    let n = b.len();
    match n {
        0 => 0,
        1..=3 => {
            u64::from(b[0])
                | u64::from(b[n / 2]) << (8 * (n / 2))
                | u64::from(b[n - 1]) << (8 * (n - 1))
        }
        4..=7 => le::<4>(b) | le::<4>(&b[n - 4..]) << (8 * (n - 4)),
        _ => le::<8>(b),
    }
}

/// The first eight bytes of `b` (at least eight long) as a little-endian word.
#[inline]
fn le8(b: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[..8]);
    u64::from_le_bytes(w)
}

pub(crate) struct Shard<V> {
    table: HashTable<Slot<V>>,
    compact: HashTable<Compact>,
    /// No sweep before this: no value expires before it, or (after a sweep that freed little)
    /// too few to be worth a sweep. Atomic for checks under the read lock (their tats only
    /// grow, so they rarely write it).
    next_expiry: AtomicU64,
}

/// Keeps each shard's lock on its own cache lines, so threads working on different shards do
/// not invalidate each other's caches.
#[repr(align(128))]
struct Padded<T>(T);

pub(crate) struct ShardedMap<V> {
    shards: Box<[Padded<RwLock<Shard<V>>>]>,
    /// The policy identities the compact table serves, by compact index minus one (0: free).
    compact_ids: [AtomicU32; COMPACT_POLICIES],
    mask: usize,
    cap: usize,
    on_full: OnFull,
    hasher: foldhash::fast::RandomState,
    expired: AtomicU64,
    evicted: AtomicU64,
    refused: AtomicU64,
    /// Whether a refusing map puts sweeps off (see [`ShardedMap::deferring_sweeps`]).
    defer_sweeps: bool,
    /// Sweeps made to find room (tests count them).
    #[cfg(test)]
    sweeps: AtomicU64,
}

impl<V> ShardedMap<V> {
    /// A map of at most `max_keys` keys over about `shards` shards (a power of two, reduced so
    /// each shard holds at least 16 keys).
    pub(crate) fn new(max_keys: usize, shards: usize, on_full: OnFull) -> Self {
        let max_keys = max_keys.max(1);
        let mut n = shards.clamp(1, 256).next_power_of_two();
        while n > 1 && max_keys / n < 16 {
            n /= 2;
        }
        let cap = (max_keys / n).max(1);
        let shards = (0..n)
            .map(|_| {
                Padded(RwLock::new(Shard {
                    table: HashTable::new(),
                    compact: HashTable::new(),
                    next_expiry: AtomicU64::new(0),
                }))
            })
            .collect();
        ShardedMap {
            shards,
            compact_ids: Default::default(),
            mask: n - 1,
            cap,
            on_full,
            hasher: foldhash::fast::RandomState::default(),
            expired: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            defer_sweeps: false,
            #[cfg(test)]
            sweeps: AtomicU64::new(0),
        }
    }

    /// A refusing map whose sweeps that free less than a batch put the next one off until a
    /// batch more has expired: bounded work under a steady flood, for refusing new keys while
    /// up to a batch of old ones have expired (a rate-limit store's trade, not a lock table's).
    pub(crate) fn deferring_sweeps(mut self) -> Self {
        self.defer_sweeps = true;
        self
    }

    #[inline]
    pub(crate) fn hash(&self, ident: u32, key: &[u8]) -> u64 {
        self.hasher.hash_one((ident, key))
    }

    /// The hash of a packed key (see [`Packable`]).
    #[inline]
    pub(crate) fn hash_packed(&self, key: Packed) -> u64 {
        self.hasher.hash_one([key.key, u64::from(key.tag)])
    }

    /// The compact index (1 to 15) of the policy identified by `ident` (never 0), given on
    /// first use to the first fifteen policies that ask; `None` for any other. An identity's
    /// answer never changes: an index, once taken, is kept, and an identity refused found every
    /// index taken, as it always will.
    #[inline]
    pub(crate) fn compact_index(&self, ident: u32) -> Option<u8> {
        for (i, id) in (1u8..).zip(&self.compact_ids) {
            match id.load(Ordering::Relaxed) {
                held if held == ident => return Some(i),
                0 => match id.compare_exchange(0, ident, Ordering::Relaxed, Ordering::Relaxed) {
                    Ok(_) => return Some(i),
                    Err(held) if held == ident => return Some(i),
                    Err(_) => {}
                },
                _ => {}
            }
        }
        None
    }

    /// The shard of a hash: bits the table itself does not use for probing.
    #[inline]
    pub(crate) fn shard_of(&self, hash: u64) -> usize {
        (hash >> 40) as usize & self.mask
    }

    /// The shard, exclusively.
    #[inline]
    pub(crate) fn lock(&self, shard: usize) -> RwLockWriteGuard<'_, Shard<V>> {
        // A panic while holding the lock cannot leave a value half-written in a way that
        // matters more than losing the limiter: keep serving.
        self.shards[shard]
            .0
            .write()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The shard, exclusively, if no other thread holds it now.
    #[inline]
    pub(crate) fn try_lock(&self, shard: usize) -> Option<RwLockWriteGuard<'_, Shard<V>>> {
        match self.shards[shard].0.try_write() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// The shard, shared: to find a compact entry and advance its tat.
    #[inline]
    pub(crate) fn read(&self, shard: usize) -> RwLockReadGuard<'_, Shard<V>> {
        self.shards[shard]
            .0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn max_keys(&self) -> usize {
        self.cap * self.shards.len()
    }

    pub(crate) fn stats(&self) -> StoreStats {
        let keys = (0..self.shards.len()).map(|i| self.lock(i).len()).sum();
        StoreStats {
            keys,
            expired: self.expired.load(Ordering::Relaxed),
            evicted: self.evicted.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
        }
    }

    /// Drops every expired value now.
    pub(crate) fn purge_expired(&self, now: u64) {
        for i in 0..self.shards.len() {
            let mut shard = self.lock(i);
            let freed = shard.sweep(now);
            self.expired.fetch_add(freed as u64, Ordering::Relaxed);
        }
    }

    /// Inserts a new key into a locked shard, making room first.
    pub(crate) fn insert<'s>(
        &self,
        shard: &'s mut Shard<V>,
        slot: NewSlot<'_, V>,
        now: u64,
    ) -> Result<&'s mut Slot<V>, MemoryError> {
        self.ensure_room(shard, 1, now)?;
        let entry = shard.table.insert_unique(
            slot.hash,
            Slot {
                ident: slot.ident,
                expires_s: secs_up(slot.expires_at),
                key: SmallVec::from_slice(slot.key),
                value: slot.value,
            },
            // Not stored in the slot (memory is what limits speed at scale): recomputed when
            // the table grows.
            |s| self.hasher.hash_one((s.ident, &s.key[..])),
        );
        let next = shard.next_expiry.get_mut();
        *next = (*next).min(slot.expires_at);
        Ok(entry.into_mut())
    }

    /// Inserts a new compact entry into a locked shard, making room first.
    pub(crate) fn insert_compact(
        &self,
        shard: &mut Shard<V>,
        hash: u64,
        key: Packed,
        tat: u64,
        now: u64,
    ) -> Result<(), MemoryError> {
        self.ensure_room(shard, 1, now)?;
        shard
            .compact
            .insert_unique(hash, Compact::new(key, tat), |c| {
                self.hash_packed(c.packed())
            });
        shard.note_expiry(tat);
        Ok(())
    }

    /// Whether a locked shard takes `n` new keys without a sweep.
    pub(crate) fn has_room(&self, shard: &Shard<V>, n: usize) -> bool {
        shard.len() + n <= self.cap
    }

    /// Makes room for `n` new keys in a locked shard: sweeps expired keys, then evicts or
    /// refuses as configured.
    pub(crate) fn ensure_room(
        &self,
        shard: &mut Shard<V>,
        n: usize,
        now: u64,
    ) -> Result<(), MemoryError> {
        if shard.len() + n <= self.cap {
            return Ok(());
        }
        if now >= *shard.next_expiry.get_mut() {
            #[cfg(test)]
            self.sweeps.fetch_add(1, Ordering::Relaxed);
            let freed = shard.sweep(now);
            self.expired.fetch_add(freed as u64, Ordering::Relaxed);
            // A sweep costs the whole shard. Refusing, one that freed less than a batch is not
            // made again until a batch more has expired (else a flood of new keys that expire
            // at the rate they come, the store just full, would pay a whole sweep for every
            // key), at the price of refusing new keys while up to a batch of old ones have
            // expired. Evicting is left as it was: deferred, the eviction that follows would
            // drop live keys with the expired ones.
            let batch = (self.cap / 8).max(n);
            if freed < batch && self.defer_sweeps && self.on_full == OnFull::Reject {
                shard.defer_sweep(batch - freed);
            }
            if shard.len() + n <= self.cap {
                return Ok(());
            }
        }
        match self.on_full {
            OnFull::Reject => {
                self.refused.fetch_add(1, Ordering::Relaxed);
                Err(MemoryError::Full {
                    max_keys: self.max_keys(),
                })
            }
            OnFull::EvictSoonest => {
                let over = shard.len() + n - self.cap;
                let evicted = shard.evict_soonest((self.cap / 8).max(over));
                self.evicted.fetch_add(evicted as u64, Ordering::Relaxed);
                Ok(())
            }
        }
    }
}

/// The parts of a slot to insert.
pub(crate) struct NewSlot<'a, V> {
    pub(crate) hash: u64,
    pub(crate) ident: u32,
    pub(crate) key: &'a [u8],
    pub(crate) value: V,
    pub(crate) expires_at: u64,
}

impl<V> Shard<V> {
    /// Keys held, in both tables.
    fn len(&self) -> usize {
        self.table.len() + self.compact.len()
    }

    #[inline]
    pub(crate) fn find_compact(&self, hash: u64, key: Packed) -> Option<&Compact> {
        self.compact.find(hash, |c| c.is(key))
    }

    #[inline]
    pub(crate) fn find_compact_mut(&mut self, hash: u64, key: Packed) -> Option<&mut Compact> {
        self.compact.find_mut(hash, |c| c.is(key))
    }

    pub(crate) fn remove_compact(&mut self, hash: u64, key: Packed) -> Option<u64> {
        self.compact
            .find_entry(hash, |c| c.is(key))
            .ok()
            .map(|e| e.remove().0.tat())
    }

    #[inline]
    pub(crate) fn find(&self, hash: u64, ident: u32, key: &[u8]) -> Option<&Slot<V>> {
        self.table
            .find(hash, |s| s.ident == ident && same_key(&s.key, key))
    }

    #[inline]
    pub(crate) fn find_mut(&mut self, hash: u64, ident: u32, key: &[u8]) -> Option<&mut Slot<V>> {
        self.table
            .find_mut(hash, |s| s.ident == ident && same_key(&s.key, key))
    }

    pub(crate) fn remove(&mut self, hash: u64, ident: u32, key: &[u8]) -> Option<V> {
        self.table
            .find_entry(hash, |s| s.ident == ident && *s.key == *key)
            .ok()
            .map(|e| e.remove().0.value)
    }

    /// Notes that a slot's or entry's expiry moved (it may now expire sooner than the shard
    /// thought).
    #[inline]
    pub(crate) fn note_expiry(&self, expires_at: u64) {
        if expires_at < self.next_expiry.load(Ordering::Relaxed) {
            self.next_expiry.fetch_min(expires_at, Ordering::Relaxed);
        }
    }

    /// Drops expired slots and entries; returns how many.
    fn sweep(&mut self, now: u64) -> usize {
        let before = self.len();
        let mut next = u64::MAX;
        self.table.retain(|s| {
            let keep = s.expires_at() > now;
            if keep {
                next = next.min(s.expires_at());
            }
            keep
        });
        self.compact.retain(|c| {
            let keep = c.tat() > now;
            if keep {
                next = next.min(c.tat());
            }
            keep
        });
        *self.next_expiry.get_mut() = next;
        before - self.len()
    }

    /// Every held value's expiry.
    fn expiries(&self) -> impl Iterator<Item = u64> + '_ {
        self.table
            .iter()
            .map(Slot::expires_at)
            .chain(self.compact.iter().map(Compact::tat))
    }

    /// The `n`-th soonest expiry (`n` from 1, at most the values held); `None` without values.
    fn nth_expiry(&self, n: usize) -> Option<u64> {
        let mut expiries: Vec<u64> = self.expiries().collect();
        let n = n.min(expiries.len()).checked_sub(1)?;
        Some(*expiries.select_nth_unstable(n).1)
    }

    /// Puts the next sweep off until `n` more values have expired (all that are left, if
    /// fewer).
    fn defer_sweep(&mut self, n: usize) {
        *self.next_expiry.get_mut() = self.nth_expiry(n).unwrap_or(u64::MAX);
    }

    /// Evicts about `n` live slots and entries, those that expire soonest; returns how many.
    fn evict_soonest(&mut self, n: usize) -> usize {
        let Some(threshold) = self.nth_expiry(n) else {
            return 0;
        };
        let before = self.len();
        let mut budget = n.min(before);
        let mut evict = |expires_at: u64| {
            let gone = budget > 0 && expires_at <= threshold;
            budget -= usize::from(gone);
            !gone
        };
        self.table.retain(|s| evict(s.expires_at()));
        self.compact.retain(|c| evict(c.tat()));
        *self.next_expiry.get_mut() = self.expiries().min().unwrap_or(u64::MAX);
        before - self.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(
        map: &ShardedMap<u32>,
        key: &[u8],
        expires_at: u64,
        now: u64,
    ) -> Result<(), MemoryError> {
        let hash = map.hash(1, key);
        let mut shard = map.lock(map.shard_of(hash));
        if let Some(slot) = shard.find_mut(hash, 1, key) {
            // As every store does: a value's new expiry is noted.
            slot.set_expires_at(expires_at);
            let at = slot.expires_at();
            shard.note_expiry(at);
            return Ok(());
        }
        map.insert(
            &mut shard,
            NewSlot {
                hash,
                ident: 1,
                key,
                value: 7,
                expires_at,
            },
            now,
        )
        .map(|_| ())
    }

    /// The plain packing `pack` must equal: the key bytes zero-padded, and the index and
    /// length.
    fn reference(index: u8, key: &[u8]) -> Packed {
        let mut word = [0u8; 8];
        word[..key.len()].copy_from_slice(key);
        Packed {
            key: u64::from_le_bytes(word),
            tag: index << 4 | key.len() as u8,
        }
    }

    /// New keys coming as fast as old ones expire, the store just full: refusing, a sweep that
    /// frees a key or two is not made again for every new key (and no live key is dropped);
    /// evicting, no live key is evicted while expired ones make room.
    #[test]
    fn a_full_store_under_a_steady_flood_does_not_sweep_for_every_key() {
        for on_full in [OnFull::EvictSoonest, OnFull::Reject] {
            let map: ShardedMap<u32> = ShardedMap::new(1_024, 1, on_full).deferring_sweeps();
            // Each key lives 1,024 s; one comes every second (slots keep whole seconds).
            let mut refused = 0;
            for i in 0..20_000u64 {
                let key = i.to_le_bytes();
                if put(&map, &key, (i + 1_024) * 1_000_000, i * 1_000_000).is_err() {
                    refused += 1;
                }
            }
            let sweeps = map.sweeps.load(Ordering::Relaxed);
            let stats = map.stats();
            assert!(stats.keys <= 1_024, "{on_full:?}: {stats:?}");
            match on_full {
                // Sweeps as it did (one per key, each freeing the one expired), evicting none
                // of the live keys.
                OnFull::EvictSoonest => assert_eq!((refused, stats.evicted), (0, 0), "{stats:?}"),
                // Refused only while fewer than a batch (an eighth) had expired.
                OnFull::Reject => {
                    assert!(sweeps < 400, "{sweeps} sweeps for 20,000 keys");
                    assert!(refused < 20_000 / 8 + 1_024, "{refused} refused");
                }
            }
        }
    }

    #[test]
    fn pack_is_one_to_one_up_to_eight_bytes_and_refuses_longer_keys() {
        let mut rng = fastrand::Rng::with_seed(7);
        let mut seen = std::collections::HashMap::new();
        for len in 0..=COMPACT_KEY {
            for round in 0..200 {
                let key: Vec<u8> = match round {
                    0 => vec![0; len],
                    1 => vec![0xff; len],
                    _ => (0..len).map(|_| rng.u8(..)).collect(),
                };
                for index in [1, 2, 15] {
                    let packed = pack(index, &key).expect("short key");
                    assert_eq!(packed, reference(index, &key), "{index} {key:?}");
                    if let Some(other) = seen.insert(packed, (index, key.clone())) {
                        assert_eq!(other, (index, key.clone()), "two keys, one packing");
                    }
                }
            }
        }
        // A trailing zero byte is a different key.
        assert_ne!(pack(1, b"a"), pack(1, b"a\0"));
        assert_eq!(pack(1, &[7; COMPACT_KEY + 1]), None);
    }

    #[test]
    fn long_ipv4_keys_pack_one_to_one_and_other_long_keys_do_not_pack() {
        let mut rng = fastrand::Rng::with_seed(11);
        let mut seen = std::collections::HashMap::new();
        for _ in 0..20_000 {
            let ip = std::net::Ipv4Addr::from(rng.u32(..));
            let text = ip.to_string();
            // The parser reads every canonical address back.
            assert_eq!(
                canonical_ipv4(text.as_bytes()),
                Some(u32::from(ip)),
                "{text}"
            );
            let packed = pack(9, text.as_bytes());
            if text.len() > COMPACT_KEY {
                let ip = Packed {
                    key: u64::from(u32::from(ip)),
                    tag: 9 << 4 | IPV4,
                };
                assert_eq!(packed, Some(ip));
            } else {
                assert_eq!(packed, Some(reference(9, text.as_bytes())));
            }
            if let Some(other) = seen.insert(packed, text.clone()) {
                assert_eq!(other, text, "two keys, one packing");
            }
        }
        // Whatever parses is the canonical text of its address: no two texts share a packing.
        // Bytes next to the digits and the dot, and some with the high bit set: none may pass
        // as either.
        let hostile = b"0123456789.-/:\x00\x1e\xae\xb0\xb9\xff";
        for i in 0..400_000 {
            let len = rng.usize(7..=16);
            let alphabet: &[u8] = if i % 2 == 0 { b"0123456789." } else { hostile };
            let text: Vec<u8> = (0..len)
                .map(|_| *rng.choice(alphabet).unwrap_or(&b'.'))
                .collect();
            if let Some(ip) = canonical_ipv4(&text) {
                assert_eq!(
                    std::net::Ipv4Addr::from(ip).to_string().as_bytes(),
                    &text[..]
                );
            }
        }
        for text in [
            "100.100.100.010",
            "100.100.100.256",
            "100.100.100.1.1",
            "100.100.100100",
            "100.100..100.10",
            "+100.100.100.10",
            "100.100.100.10 ",
            "1000.100.100.10",
            "a-longer-key-12",
        ] {
            assert_eq!(pack(1, text.as_bytes()), None, "{text}");
        }
    }

    #[test]
    fn keys_are_the_same_only_when_every_byte_is() {
        let mut rng = fastrand::Rng::with_seed(5);
        for n in 0..=40 {
            let key: Vec<u8> = (0..n).map(|_| rng.u8(..)).collect();
            assert!(same_key(&key, &key.clone()), "{n}");
            for i in 0..n {
                let mut other = key.clone();
                other[i] ^= 1 << rng.u32(0..8);
                assert!(!same_key(&key, &other), "{n} bytes, byte {i}");
                assert!(!same_key(&other, &key), "{n} bytes, byte {i}");
            }
            // A zero byte more or less is another key, though the words read alike.
            let mut longer = key.clone();
            longer.push(0);
            assert!(!same_key(&key, &longer), "{n}");
            assert!(!same_key(&longer, &key), "{n}");
        }
    }

    #[test]
    fn long_decimal_keys_pack_one_to_one_and_other_long_keys_do_not_pack() {
        let mut rng = fastrand::Rng::with_seed(13);
        let mut seen = std::collections::HashMap::new();
        for digits in 9..=19u32 {
            for round in 0..2_000 {
                let low = 10u64.pow(digits - 1);
                let n = match round {
                    0 => low,
                    1 if digits == 19 => 9_999_999_999_999_999_999,
                    1 => 10u64.pow(digits) - 1,
                    _ if digits == 19 => rng.u64(low..=9_999_999_999_999_999_999),
                    _ => rng.u64(low..10u64.pow(digits)),
                };
                let text = n.to_string();
                let packed = pack(3, text.as_bytes()).expect("packs");
                assert_eq!(
                    packed,
                    Packed {
                        key: n,
                        tag: 3 << 4 | DECIMAL
                    }
                );
                if let Some(other) = seen.insert(packed, text.clone()) {
                    assert_eq!(other, text, "two keys, one packing");
                }
            }
        }
        // Whatever packs as a number is the canonical text of its value.
        for _ in 0..100_000 {
            let len = rng.usize(9..=20);
            let text: Vec<u8> = (0..len)
                .map(|_| *rng.choice(b"0123456789a").unwrap_or(&b'a'))
                .collect();
            if let Some(n) = decimal(&text) {
                assert_eq!(n.to_string().as_bytes(), &text[..]);
            }
        }
        for text in [
            "012345678",
            "+15551234567",
            "1234 56789",
            "12345678901234567890",
            "123456789a",
            "-123456789",
        ] {
            assert_eq!(pack(1, text.as_bytes()), None, "{text}");
        }
    }

    #[test]
    fn the_first_fifteen_policies_get_compact_indexes_for_good() {
        let map = ShardedMap::<u32>::new(1_000, 8, OnFull::EvictSoonest);
        let idents = [7, 3, 900, u32::MAX, 12, 5, 6, 8, 9, 10, 11, 13, 14, 15, 16];
        for (i, ident) in (1u8..).zip(idents) {
            assert_eq!(map.compact_index(ident), Some(i), "{ident}");
        }
        // Every index is taken: a sixteenth policy never gets one, the others keep theirs.
        assert_eq!(map.compact_index(17), None);
        assert_eq!(map.compact_index(17), None);
        assert_eq!(map.compact_index(900), Some(3));
        assert_eq!(map.compact_index(16), Some(15));

        // Threads racing for the indexes: each identity gets one, and no two share one.
        let map = std::sync::Arc::new(ShardedMap::<u32>::new(1_000, 8, OnFull::EvictSoonest));
        let handles: Vec<_> = (0..4)
            .map(|t| {
                let map = std::sync::Arc::clone(&map);
                std::thread::spawn(move || {
                    (0..20u32)
                        .map(|k| {
                            (
                                1 + (k + t * 5) % 20,
                                map.compact_index(1 + (k + t * 5) % 20),
                            )
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut of = std::collections::HashMap::new();
        for h in handles {
            for (ident, index) in h.join().expect("thread") {
                assert_eq!(*of.entry(ident).or_insert(index), index, "{ident}");
            }
        }
        let given: Vec<u8> = of.values().filter_map(|i| *i).collect();
        assert_eq!(given.len(), 15);
        let distinct: std::collections::HashSet<_> = given.iter().collect();
        assert_eq!(distinct.len(), 15);
    }

    #[test]
    fn a_compact_entry_keeps_its_tag_and_saturates_its_tat() {
        let key = pack(15, b"12345678").expect("packs");
        let mut c = Compact::new(key, 42);
        assert!(c.is(key) && c.tat() == 42);
        c.set_tat(MAX_TAT - 1);
        assert!(c.is(key) && c.tat() == MAX_TAT - 1);
        c.set_tat(u64::MAX);
        assert!(c.is(key) && c.tat() == MAX_TAT);
        c.set_tat(0);
        assert!(c.is(key) && c.tat() == 0);
        assert!(!c.is(pack(14, b"12345678").expect("packs")));
        assert!(!c.is(pack(15, b"1234567").expect("packs")));
        assert_eq!(std::mem::size_of::<Compact>(), 16);
    }

    /// A check of more new keys than an eviction's batch makes room for all of them.
    #[test]
    fn room_for_more_new_keys_than_a_batch() {
        let map: ShardedMap<u32> = ShardedMap::new(16, 1, OnFull::EvictSoonest);
        for i in 0..16u64 {
            put(&map, &i.to_le_bytes(), 1_000 + i, 0).expect("room");
        }
        let mut shard = map.lock(0);
        map.ensure_room(&mut shard, 7, 1).expect("evicts");
        assert!(shard.len() <= 9, "{}", shard.len());
        drop(shard);
        assert_eq!(map.stats().evicted, 7);
    }

    #[test]
    fn bound_holds_under_a_flood_of_unique_keys() {
        let map = ShardedMap::<u32>::new(1_000, 8, OnFull::EvictSoonest);
        for i in 0..100_000u64 {
            put(&map, &i.to_le_bytes(), 1_000_000 + i, 0).expect("evicts");
        }
        let stats = map.stats();
        assert!(stats.keys <= map.max_keys(), "{stats:?}");
        assert!(stats.evicted > 0);
        // The keys that expire last survive.
        let last = 99_999u64.to_le_bytes();
        let hash = map.hash(1, &last);
        assert!(map.lock(map.shard_of(hash)).find(hash, 1, &last).is_some());
    }

    #[test]
    fn expired_keys_are_swept_before_anything_is_evicted() {
        const S: u64 = 1_000_000;
        let map = ShardedMap::<u32>::new(64, 1, OnFull::Reject);
        for i in 0..64u64 {
            put(&map, &i.to_le_bytes(), 10 * S, 0).expect("room");
        }
        assert!(matches!(
            put(&map, b"new", 100 * S, 5 * S),
            Err(MemoryError::Full { .. })
        ));
        put(&map, b"new", 100 * S, 10 * S).expect("expired keys make room");
        let stats = map.stats();
        assert_eq!(
            (stats.keys, stats.expired, stats.evicted, stats.refused),
            (1, 64, 0, 1)
        );
    }
}
