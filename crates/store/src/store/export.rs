//! A cachelet's items as a stream, for moving a cachelet to another process (Phase 3 and
//! elastic scaling; DESIGN.md §3 "export/import of a cachelet's items").
//!
//! [`WorkerStore::export`] reads a batch of a cachelet's live items from a cursor and
//! returns the next cursor: the scan is resumable, bounded per call (at least one home
//! bucket, then until a byte budget is spent), and never holds the cachelet: between two
//! calls the owner keeps serving it, and the index may grow (see `Index::scan` for what the
//! cursor guarantees then). [`WorkerStore::import`] stores one such item into a cachelet of
//! another store, never over an item already there (a write the destination took after the
//! move began is newer than anything the source exports). What a move does about writes at
//! the source during the scan is the migration protocol's business, not this module's.
//!
//! An item travels as its key, value, flags, the seconds it has left to live, and its
//! hash (so the destination needs no hash function of its own). Its CAS does not travel:
//! the destination gives it a fresh one from its own counter (CAS values are opaque to
//! clients, and a `cas` with the old value after a move fails as after any other write).
//! Expired and flushed items are left behind.

use super::{Cachelet, Liveness, WorkerStore};
use crate::item::It;
use crate::{CasOpts, Mode, StoreResult};

/// One item of an exported cachelet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportedItem {
    /// The key's hash, as the store was given it.
    pub hash: u64,
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    pub flags: u32,
    /// Seconds left to live when exported (at least 1), or 0: never expires.
    pub ttl: u32,
}

/// One live item as `lru_crawler metadump` and `stats cachedump` show it
/// ([`WorkerStore::scan_meta`]). Times are the store's (seconds since its start).
#[derive(Clone, Copy, Debug)]
pub struct ItemMeta<'a> {
    pub key: &'a [u8],
    pub vlen: usize,
    /// 0: never expires.
    pub exptime: u32,
    pub last_access: u32,
    pub cas: u64,
    /// Read since it was written.
    pub fetched: bool,
    /// The bytes it takes in its page (header, key, value, padding).
    pub size: usize,
}

impl ExportedItem {
    /// Key and value bytes: what a batch's budget counts.
    pub fn bytes(&self) -> usize {
        self.key.len() + self.value.len()
    }

    pub fn as_ref(&self) -> ItemRef<'_> {
        ItemRef { hash: self.hash, key: &self.key, value: &self.value, flags: self.flags, ttl: self.ttl }
    }
}

/// An exported item lent in place (in the store's memory, or in a frame).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ItemRef<'a> {
    pub hash: u64,
    pub key: &'a [u8],
    pub value: &'a [u8],
    pub flags: u32,
    /// As [`ExportedItem::ttl`].
    pub ttl: u32,
}

/// What an item adds to a batch's byte budget besides its key and value.
const ITEM_WEIGHT: usize = 256;

impl WorkerStore {
    /// Append to `out` the live items of cachelet `cl` from `cursor` (0: the start), home
    /// bucket by home bucket, until at least `max_bytes` of keys and values (and `ITEM_WEIGHT`
    /// per item) were taken or
    /// the scan ended; the next cursor, 0 once every home bucket was visited. `None` if the
    /// cachelet is not owned here.
    pub fn export(&self, cl: u32, cursor: u64, max_bytes: usize, now: u32, out: &mut Vec<ExportedItem>) -> Option<u64> {
        self.export_with(cl, cursor, max_bytes, now, |r| {
            out.push(ExportedItem {
                hash: r.hash,
                key: r.key.to_vec(),
                value: r.value.to_vec(),
                flags: r.flags,
                ttl: r.ttl,
            })
        })
    }

    /// [`export`](Self::export), each item lent to `f` in place (no copy: the mover encodes
    /// it straight into a frame, `crate::wire`).
    pub fn export_with(
        &self,
        cl: u32,
        mut cursor: u64,
        max_bytes: usize,
        now: u32,
        mut f: impl FnMut(ItemRef<'_>),
    ) -> Option<u64> {
        let c: &Cachelet = self.cachelets.get(cl as usize)?.as_deref()?;
        let hash_of = |s: u32, o: u32| It::hash(&c.seg(s).buf, o as usize);
        let mut taken = 0usize;
        loop {
            cursor = c.index.scan(cursor, hash_of, |s, o| {
                if c.liveness(s, o, now) != Liveness::Live {
                    return;
                }
                let (b, o) = (&c.seg(s).buf, o as usize);
                let exp = It::exptime(b, o);
                let r = ItemRef {
                    hash: It::hash(b, o),
                    key: It::key(b, o),
                    value: It::value(b, o),
                    flags: It::flags(b, o),
                    ttl: if exp == 0 { 0 } else { exp.saturating_sub(now).max(1) },
                };
                // An item's cost is per item as much as per byte: small items weigh more than
                // their bytes, so a batch of them holds the owner for no longer than big ones.
                taken += r.key.len() + r.value.len() + ITEM_WEIGHT;
                f(r);
            });
            if cursor == 0 || taken >= max_bytes {
                return Some(cursor);
            }
        }
    }

    /// Visit every live item of cachelet `cl` (`lru_crawler metadump`, `stats cachedump`) until
    /// `f` returns false; false if it did (or the cachelet is not owned here).
    pub fn scan_meta(&self, cl: u32, now: u32, mut f: impl FnMut(ItemMeta<'_>) -> bool) -> bool {
        let Some(c) = self.cachelets.get(cl as usize).and_then(|c| c.as_deref()) else { return false };
        let hash_of = |s: u32, o: u32| It::hash(&c.seg(s).buf, o as usize);
        let mut go = true;
        let mut cursor = 0;
        loop {
            // One pass (nothing can grow the index meanwhile: each entry once).
            cursor = c.index.scan(cursor, hash_of, |s, o| {
                if !go || c.liveness(s, o, now) != Liveness::Live {
                    return;
                }
                let (b, o) = (&c.seg(s).buf, o as usize);
                go = f(ItemMeta {
                    key: It::key(b, o),
                    vlen: It::vlen(b, o),
                    exptime: It::exptime(b, o),
                    last_access: It::last_access(b, o),
                    cas: It::cas(b, o),
                    fetched: It::bits(b, o) & crate::item::FETCHED != 0,
                    size: It::size(b, o),
                });
            });
            if cursor == 0 || !go {
                return go;
            }
        }
    }

    /// Store an exported item in cachelet `cl` unless the key is there already (then
    /// `NotStored`: what is there is newer). Its time to live counts from `now`.
    pub fn import(&mut self, cl: u32, item: &ExportedItem, now: u32) -> StoreResult {
        self.import_ref(cl, item.as_ref(), now)
    }

    /// [`import`](Self::import) of a borrowed item.
    pub fn import_ref(&mut self, cl: u32, item: ItemRef<'_>, now: u32) -> StoreResult {
        let exptime = self.exptime_of(item.ttl, now);
        self.store_with(cl, item.hash, item.key, item.value, item.flags, exptime, Mode::Add, CasOpts::default(), now)
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::mk;
    use super::*;
    use mbal_cluster::key_hash;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    /// Export all of cachelet `cl` in batches of `budget` bytes.
    fn export_all(w: &WorkerStore, cl: u32, budget: usize, now: u32) -> (Vec<ExportedItem>, usize) {
        let (mut items, mut cursor, mut calls) = (Vec::new(), 0u64, 0usize);
        loop {
            cursor = w.export(cl, cursor, budget, now, &mut items).expect("owned");
            calls += 1;
            if cursor == 0 {
                return (items, calls);
            }
        }
    }

    fn contents(w: &mut WorkerStore, cl: u32, keys: &[Vec<u8>], now: u32) -> BTreeMap<Vec<u8>, (Vec<u8>, u32)> {
        keys.iter()
            .filter_map(|k| w.get(cl, key_hash(k), k, now).map(|v| (k.clone(), (v.value.to_vec(), v.flags))))
            .collect()
    }

    #[test]
    fn a_cachelet_of_100_000_tiny_items_moves_whole_in_bounded_batches() {
        let mut src = mk(64 << 20, |_| {});
        let mut dst = mk(64 << 20, |_| {});
        let keys: Vec<Vec<u8>> = (0..100_000).map(|i| format!("k{i}").into_bytes()).collect();
        for (i, k) in keys.iter().enumerate() {
            let v = (i % 251).to_string();
            assert!(matches!(
                src.store(1, key_hash(k), k, v.as_bytes(), i as u32, 0, Mode::Set, None, 0),
                StoreResult::Stored { .. }
            ));
        }
        let (items, calls) = export_all(&src, 1, 64 << 10, 5);
        assert_eq!(items.len(), 100_000, "each item once (nothing grew during the scan)");
        assert!(calls > 10, "in batches: {calls}");
        for it in &items {
            assert!(matches!(dst.import(1, it, 5), StoreResult::Stored { .. }));
        }
        assert_eq!(contents(&mut dst, 1, &keys, 5), contents(&mut src, 1, &keys, 5));
        assert_eq!(dst.stats().curr_items, 100_000);
        assert_eq!(src.export(3 + 1, 0, 1, 0, &mut Vec::new()), None, "not owned");
    }

    #[test]
    fn a_value_of_the_largest_size_moves() {
        let mut src = mk(8 << 20, |_| {});
        let mut dst = mk(8 << 20, |_| {});
        let max = src.config().max_item_size;
        // The largest value that fits: shrink until the store takes it.
        let mut v = vec![0xA5u8; max];
        let k = b"big".to_vec();
        while !matches!(src.store(2, key_hash(&k), &k, &v, 9, 0, Mode::Set, None, 0), StoreResult::Stored { .. }) {
            v.pop();
        }
        assert!(v.len() > max - 100);
        let (items, _) = export_all(&src, 2, 1, 0);
        assert_eq!(items.len(), 1);
        assert_eq!(items[0].value.len(), v.len());
        assert!(matches!(dst.import(2, &items[0], 0), StoreResult::Stored { .. }));
        assert_eq!(dst.get(2, key_hash(&k), &k, 0).unwrap().value, &v[..]);
    }

    #[test]
    fn expiry_travels_and_dead_items_stay_behind() {
        let mut src = mk(1 << 20, |_| {});
        let mut dst = mk(1 << 20, |_| {});
        let put = |w: &mut WorkerStore, k: &str, exp: i64, now: u32| {
            w.store(0, key_hash(k.as_bytes()), k.as_bytes(), b"v", 0, exp, Mode::Set, None, now)
        };
        put(&mut src, "flushed", 0, 100);
        src.flush_all(100);
        put(&mut src, "forever", 0, 101);
        put(&mut src, "soon", 10, 101); // expires at 111
        put(&mut src, "later", 1_000, 101); // at 1,101
        put(&mut src, "gone", 5, 101); // at 106
        put(&mut src, "abs", 1_000_000_000 + 5_000_000, 101); // absolute (> 30 days): at 5,000,000
        let (items, _) = export_all(&src, 0, usize::MAX, 108);
        let ttl: BTreeMap<&[u8], u32> = items.iter().map(|i| (&i.key[..], i.ttl)).collect();
        assert_eq!(ttl.get(&b"gone"[..]), None, "expired: left behind");
        assert_eq!(ttl.get(&b"flushed"[..]), None, "flushed: left behind");
        assert_eq!(ttl[&b"forever"[..]], 0);
        assert_eq!(ttl[&b"soon"[..]], 3);
        assert_eq!(ttl[&b"later"[..]], 993);
        assert_eq!(ttl[&b"abs"[..]], 5_000_000 - 108);
        // The destination counts from its own clock: 3 s after 50 is 53.
        for it in &items {
            dst.import(0, it, 50);
        }
        let live = |w: &mut WorkerStore, k: &str, now| w.get(0, key_hash(k.as_bytes()), k.as_bytes(), now).is_some();
        assert!(live(&mut dst, "soon", 52) && !live(&mut dst, "soon", 53));
        assert!(live(&mut dst, "abs", 4_999_000) && !live(&mut dst, "abs", 50 + 5_000_000 - 108));
        assert!(live(&mut dst, "forever", u32::MAX - 1));
    }

    #[test]
    fn an_item_already_at_the_destination_is_newer_and_stays() {
        let mut src = mk(1 << 20, |_| {});
        let mut dst = mk(1 << 20, |_| {});
        src.store(0, key_hash(b"k"), b"k", b"old", 0, 0, Mode::Set, None, 0);
        dst.store(0, key_hash(b"k"), b"k", b"new", 0, 0, Mode::Set, None, 0);
        let (items, _) = export_all(&src, 0, usize::MAX, 0);
        assert_eq!(dst.import(0, &items[0], 0), StoreResult::NotStored);
        assert_eq!(dst.get(0, key_hash(b"k"), b"k", 0).unwrap().value, b"new");
    }

    proptest! {
        /// The store against a model: random sets and deletes, then a move in random-sized
        /// batches while more sets land between them (the source keeps serving). Every key
        /// untouched during the move arrives with its value; nothing arrives that the source
        /// did not hold at some point.
        #[test]
        fn a_move_against_a_model(
            ops in proptest::collection::vec((0u16..400, proptest::option::of(0u16..1000)), 1..600),
            budget in 1usize..4096,
            during in proptest::collection::vec((400u16..800, 0u16..1000), 0..200),
        ) {
            let mut src = mk(16 << 20, |_| {});
            let mut dst = mk(16 << 20, |_| {});
            let mut model: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
            for (k, v) in &ops {
                let key = format!("key{k}").into_bytes();
                match v {
                    Some(v) => {
                        let v = format!("v{v}").into_bytes();
                        src.store(0, key_hash(&key), &key, &v, 0, 0, Mode::Set, None, 0);
                        model.insert(key, v);
                    }
                    None => {
                        src.delete(0, key_hash(&key), &key, None, 0);
                        model.remove(&key);
                    }
                }
            }
            let (mut cursor, mut items, mut extra) = (0u64, Vec::new(), during.iter());
            let mut ever: BTreeMap<Vec<u8>, Vec<Vec<u8>>> = model.iter().map(|(k, v)| (k.clone(), vec![v.clone()])).collect();
            loop {
                cursor = src.export(0, cursor, budget, 0, &mut items).unwrap();
                // Sets of other keys between batches (the index may grow).
                for (k, v) in extra.by_ref().take(3) {
                    let (key, v) = (format!("key{k}").into_bytes(), format!("w{v}").into_bytes());
                    src.store(0, key_hash(&key), &key, &v, 0, 0, Mode::Set, None, 0);
                    ever.entry(key).or_default().push(v);
                }
                if cursor == 0 { break; }
            }
            for it in &items {
                dst.import(0, it, 0);
                prop_assert!(ever.get(&it.key).is_some_and(|vs| vs.contains(&it.value)), "exported what was never stored");
            }
            for (k, v) in &model {
                prop_assert_eq!(dst.get(0, key_hash(k), k, 0).map(|x| x.value.to_vec()), Some(v.clone()));
            }
        }
    }
}
