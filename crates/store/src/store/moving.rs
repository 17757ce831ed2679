//! A cachelet on its way to another server (cross-server migration, docs/design-notes.md
//! "Cross-server migration"): while [`WorkerStore::export`] streams its items, the store
//! notes every key written in it (set, add, append, cas, delete, incr/decr, touch, meta
//! changes) so that the mover can send their state again ([`WorkerStore::take_delta`]) after
//! the scan: an item exported before a write is overwritten at the destination by the
//! delta, a deleted one is deleted there. A `flush_all` during the move spoils it (the
//! destination's copy cannot be flushed the same way): the next delta says so and the move
//! is abandoned.
//!
//! Costs one branch per write while no cachelet of the worker moves.

use super::export::{ExportedItem, ItemRef};
use super::WorkerStore;
use crate::{CasOpts, DeleteResult, Mode, StoreResult, REALTIME_MAXDELTA};
use std::collections::HashMap;

/// The cachelet being moved and the keys written in it since the move began.
#[derive(Debug, Default)]
pub(crate) struct Moving {
    cl: u32,
    dirty: HashMap<Box<[u8]>, u64>,
    flushed: bool,
}

/// The state of a key written during a move, for the destination.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeltaItem {
    /// It is this item now (stored over whatever the destination has).
    Put(ExportedItem),
    /// It is gone (deleted, expired, or evicted): deleted at the destination too.
    Gone { hash: u64, key: Vec<u8> },
}

impl DeltaItem {
    pub fn key(&self) -> &[u8] {
        match self {
            DeltaItem::Put(it) => &it.key,
            DeltaItem::Gone { key, .. } => key,
        }
    }
}

impl WorkerStore {
    /// Note the writes in cachelet `cl` from now on (one cachelet at a time per store); false
    /// if it is not owned here or another one is moving.
    pub fn start_moving(&mut self, cl: u32) -> bool {
        if !self.owns(cl) || self.moving.as_ref().is_some_and(|m| m.cl != cl) {
            return false;
        }
        self.moving = Some(Moving { cl, ..Moving::default() });
        true
    }

    /// The cachelet whose writes are noted, if any.
    pub fn moving(&self) -> Option<u32> {
        self.moving.as_ref().map(|m| m.cl)
    }

    /// Stop noting writes (the move ended, either way).
    pub fn stop_moving(&mut self) {
        self.moving = None;
    }

    #[inline]
    pub(crate) fn note_write(&mut self, cl: u32, hash: u64, key: &[u8]) {
        if let Some(m) = &mut self.moving {
            if m.cl == cl && !m.dirty.contains_key(key) {
                m.dirty.insert(key.into(), hash);
            }
        }
    }

    /// A `flush_all`: a move in progress cannot follow it.
    pub(crate) fn note_flush(&mut self) {
        if let Some(m) = &mut self.moving {
            m.flushed = true;
        }
    }

    /// The keys written in the moving cachelet since the last call, each with its state now,
    /// and forget them. `None` if nothing moves or a `flush_all` spoiled the move.
    pub fn take_delta(&mut self, now: u32) -> Option<Vec<DeltaItem>> {
        let m = self.moving.as_mut()?;
        if m.flushed {
            return None;
        }
        let cl = m.cl;
        let dirty = std::mem::take(&mut m.dirty);
        let mut out = Vec::with_capacity(dirty.len());
        for (key, hash) in dirty {
            let item = self.peek(cl, hash, &key, now).map(|v| ExportedItem {
                hash,
                key: key.to_vec(),
                value: v.value.to_vec(),
                flags: v.flags,
                ttl: if v.exptime == 0 { 0 } else { v.exptime.saturating_sub(now).max(1) },
            });
            out.push(match item {
                Some(it) => DeltaItem::Put(it),
                None => DeltaItem::Gone { hash, key: key.into_vec() },
            });
        }
        Some(out)
    }

    /// How many keys were written in the moving cachelet since the last delta.
    pub fn dirty_count(&self) -> usize {
        self.moving.as_ref().map_or(0, |m| m.dirty.len())
    }

    /// Apply a delta item to cachelet `cl` here (the destination): store it over what is
    /// there, or delete the key.
    pub fn apply_delta(&mut self, cl: u32, d: &DeltaItem, now: u32) -> StoreResult {
        match d {
            DeltaItem::Put(it) => self.put_ref(cl, it.as_ref(), now),
            DeltaItem::Gone { hash, key } => self.gone_ref(cl, *hash, key, now),
        }
    }

    /// A delta's item (borrowed): stored over what is there.
    pub fn put_ref(&mut self, cl: u32, it: ItemRef<'_>, now: u32) -> StoreResult {
        let exptime = self.exptime_of(it.ttl, now);
        self.store_with(cl, it.hash, it.key, it.value, it.flags, exptime, Mode::Set, CasOpts::default(), now)
    }

    /// A delta's key that is gone: deleted here.
    pub fn gone_ref(&mut self, cl: u32, hash: u64, key: &[u8], now: u32) -> StoreResult {
        match self.delete(cl, hash, key, None, now) {
            DeleteResult::Deleted => StoreResult::Stored { cas: 0 },
            _ => StoreResult::NotFound,
        }
    }

    /// An exported item's seconds to live as an exptime for this store's `store`.
    pub(crate) fn exptime_of(&self, ttl: u32, now: u32) -> i64 {
        match i64::from(ttl) {
            0 => 0,
            t if t <= REALTIME_MAXDELTA => t,
            // Longer than memcached's relative limit: as an absolute time.
            t => self.m.cfg.start_unix as i64 + i64::from(now) + t,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::mk;
    use super::*;
    use mbal_cluster::key_hash;

    fn set(w: &mut WorkerStore, cl: u32, k: &str, v: &str) {
        let r = w.store(cl, key_hash(k.as_bytes()), k.as_bytes(), v.as_bytes(), 0, 0, Mode::Set, None, 0);
        assert!(matches!(r, StoreResult::Stored { .. }));
    }

    fn get(w: &mut WorkerStore, cl: u32, k: &str) -> Option<Vec<u8>> {
        w.peek(cl, key_hash(k.as_bytes()), k.as_bytes(), 0).map(|v| v.value.to_vec())
    }

    #[test]
    fn a_move_copies_the_scan_then_the_writes_made_during_it() {
        let (mut src, mut dst) = (mk(1 << 20, |_| {}), mk(1 << 20, |_| {}));
        for i in 0..50 {
            set(&mut src, 1, &format!("k{i}"), "old");
        }
        assert!(src.start_moving(1));
        assert!(!src.start_moving(2), "one cachelet at a time");
        let mut items = Vec::new();
        let mut cursor = src.export(1, 0, 100, 0, &mut items).unwrap();
        // Writes during the scan: an overwrite, a delete, a new key, an incr.
        set(&mut src, 1, "k0", "new");
        src.delete(1, key_hash(b"k1"), b"k1", None, 0);
        set(&mut src, 1, "fresh", "x");
        set(&mut src, 1, "n", "5");
        src.arith(1, key_hash(b"n"), b"n", true, 2, 0);
        while cursor != 0 {
            cursor = src.export(1, cursor, 100, 0, &mut items).unwrap();
        }
        for it in &items {
            dst.import(1, it, 0);
        }
        assert_eq!(src.dirty_count(), 4);
        let delta = src.take_delta(0).unwrap();
        assert_eq!(src.dirty_count(), 0);
        for d in &delta {
            dst.apply_delta(1, d, 0);
        }
        for i in 0..50 {
            let k = format!("k{i}");
            assert_eq!(get(&mut dst, 1, &k), get(&mut src, 1, &k), "{k}");
        }
        assert_eq!(get(&mut dst, 1, "k0").as_deref(), Some(&b"new"[..]));
        assert_eq!(get(&mut dst, 1, "k1"), None);
        assert_eq!(get(&mut dst, 1, "fresh").as_deref(), Some(&b"x"[..]));
        assert_eq!(get(&mut dst, 1, "n").as_deref(), Some(&b"7"[..]));
        src.stop_moving();
        set(&mut src, 1, "k2", "after");
        assert_eq!(src.dirty_count(), 0, "nothing noted once the move ended");
    }

    #[test]
    fn a_flush_spoils_the_move_and_other_cachelets_are_not_noted() {
        let mut src = mk(1 << 20, |_| {});
        assert!(src.start_moving(1));
        set(&mut src, 2, "other", "x");
        assert_eq!(src.dirty_count(), 0);
        set(&mut src, 1, "mine", "x");
        assert_eq!(src.dirty_count(), 1);
        src.flush_all(0);
        assert_eq!(src.take_delta(0), None);
    }
}
