//! A sharded, bounded map from `(identity, key bytes)` to expiring values: the memory behind
//! every in-memory store.
//!
//! Each value knows when it stops mattering (`expires_at`); past that it can be dropped without
//! changing any decision. A shard sweeps expired values when it reaches its share of the key
//! bound, and when live values alone fill it, it either evicts those that expire soonest or
//! refuses new keys ([`OnFull`]). So a flood of unique keys costs bounded memory and amortised
//! constant time per insert.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

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
    /// Refuse the new key with [`MemoryError::Full`]; existing keys keep their state.
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

/// Key equality without a `memcmp` call for the short keys of the common case.
#[inline]
fn same_key(stored: &[u8], key: &[u8]) -> bool {
    stored.len() == key.len() && stored == key
}

/// Microseconds to whole seconds, rounded up and saturated (the year 2106).
#[inline]
fn secs_up(us: u64) -> u32 {
    u32::try_from(us.div_ceil(1_000_000)).unwrap_or(u32::MAX)
}

pub(crate) struct Shard<V> {
    table: HashTable<Slot<V>>,
    /// No value expires before this: sweeping earlier frees nothing.
    next_expiry: u64,
}

/// Keeps each shard's lock on its own cache lines, so threads working on different shards do
/// not invalidate each other's caches.
#[repr(align(128))]
struct Padded<T>(T);

pub(crate) struct ShardedMap<V> {
    shards: Box<[Padded<Mutex<Shard<V>>>]>,
    mask: usize,
    cap: usize,
    on_full: OnFull,
    hasher: foldhash::fast::RandomState,
    expired: AtomicU64,
    evicted: AtomicU64,
    refused: AtomicU64,
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
                Padded(Mutex::new(Shard {
                    table: HashTable::new(),
                    next_expiry: 0,
                }))
            })
            .collect();
        ShardedMap {
            shards,
            mask: n - 1,
            cap,
            on_full,
            hasher: foldhash::fast::RandomState::default(),
            expired: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        }
    }

    #[inline]
    pub(crate) fn hash(&self, ident: u32, key: &[u8]) -> u64 {
        self.hasher.hash_one((ident, key))
    }

    /// The shard of a hash: bits the table itself does not use for probing.
    #[inline]
    pub(crate) fn shard_of(&self, hash: u64) -> usize {
        (hash >> 40) as usize & self.mask
    }

    #[inline]
    pub(crate) fn lock(&self, shard: usize) -> MutexGuard<'_, Shard<V>> {
        // A panic while holding the lock cannot leave a value half-written in a way that
        // matters more than losing the limiter: keep serving.
        self.shards[shard]
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn max_keys(&self) -> usize {
        self.cap * self.shards.len()
    }

    pub(crate) fn stats(&self) -> StoreStats {
        let keys = (0..self.shards.len())
            .map(|i| self.lock(i).table.len())
            .sum();
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
        shard.next_expiry = shard.next_expiry.min(slot.expires_at);
        Ok(entry.into_mut())
    }

    /// Makes room for `n` new keys in a locked shard: sweeps expired keys, then evicts or
    /// refuses as configured.
    pub(crate) fn ensure_room(
        &self,
        shard: &mut Shard<V>,
        n: usize,
        now: u64,
    ) -> Result<(), MemoryError> {
        if shard.table.len() + n <= self.cap {
            return Ok(());
        }
        if now >= shard.next_expiry {
            let freed = shard.sweep(now);
            self.expired.fetch_add(freed as u64, Ordering::Relaxed);
            if shard.table.len() + n <= self.cap {
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
                let over = shard.table.len() + n - self.cap;
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

    /// Notes that a slot's expiry moved (it may now expire sooner than the shard thought).
    #[inline]
    pub(crate) fn note_expiry(&mut self, expires_at: u64) {
        if expires_at < self.next_expiry {
            self.next_expiry = expires_at;
        }
    }

    /// Drops expired slots; returns how many.
    fn sweep(&mut self, now: u64) -> usize {
        let before = self.table.len();
        let mut next = u64::MAX;
        self.table.retain(|s| {
            let keep = s.expires_at() > now;
            if keep {
                next = next.min(s.expires_at());
            }
            keep
        });
        self.next_expiry = next;
        before - self.table.len()
    }

    /// Evicts about `n` live slots, those that expire soonest; returns how many.
    fn evict_soonest(&mut self, n: usize) -> usize {
        let mut expiries: Vec<u64> = self.table.iter().map(Slot::expires_at).collect();
        if expiries.is_empty() {
            return 0;
        }
        let n = n.min(expiries.len());
        let (_, threshold, _) = expiries.select_nth_unstable(n - 1);
        let threshold = *threshold;
        let before = self.table.len();
        let mut budget = n;
        self.table.retain(|s| {
            if budget > 0 && s.expires_at() <= threshold {
                budget -= 1;
                false
            } else {
                true
            }
        });
        self.next_expiry = self
            .table
            .iter()
            .map(Slot::expires_at)
            .min()
            .unwrap_or(u64::MAX);
        before - self.table.len()
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
            slot.set_expires_at(expires_at);
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
