//! memcached's item size histogram (`stats sizes_enable`, `stats sizes`, `stats sizes_disable`).
//!
//! Off by default. While on, every item written is counted in the bucket of its size rounded up
//! to 32 bytes, and uncounted when it goes (deleted, replaced, evicted, expired and reclaimed),
//! as memcached does: items written before `sizes_enable` are not counted, not even when they
//! go. The size is the one memcached 1.6 gives the same item ([`memcached_item_size`]), so the
//! histogram of a workload is the one memcached would show.
//!
//! One table per enabling, held by the global pool: a row of counters per worker (allocated in
//! chunks as sizes come), written only
//! by its worker (relaxed load + store, no read-modify-write), summed by whoever answers. A
//! counted item carries the `SIZED` bit; a cachelet remembers under which table its bits were
//! set (`Cachelet::sized`), so that a table's marks are forgotten (the cachelet walked once)
//! when another table replaces it. An item counted by one worker and uncounted by another
//! after its cachelet moved leaves +1 and -1 in two rows: the sum is right.
//!
//! Cost when off: a write loads one atomic that only `sizes_enable`/`sizes_disable` write, on a
//! cache line of its own; reads and deletes nothing.

use super::*;
use crate::item::SIZED;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

/// The histogram's bucket width (memcached's).
pub const SIZES_BUCKET: usize = 32;

/// The size memcached 1.6 (64-bit) gives an item: `ITEM_ntotal`, its item header (48 bytes),
/// key + 1, value + 2 (the `\r\n`), the client flags when they are not 0, the CAS when on.
pub fn memcached_item_size(klen: usize, vlen: usize, flags: u32, cas: bool) -> usize {
    48 + klen + 1 + vlen + 2 + if flags != 0 { 4 } else { 0 } + if cas { 8 } else { 0 }
}

/// Buckets per chunk of a row: a chunk (8 KiB) is allocated by its worker when it first counts
/// an item of its sizes, so a row costs memory for the size ranges in use only (with `-I 1g`,
/// a full row would be 256 MiB).
const CHUNK: usize = 1024;

/// One enabling's counters: a row of `buckets` counters per worker, in chunks.
pub(crate) struct SizeHist {
    gen: u64,
    buckets: usize,
    /// `chunks` per row: row `w`'s chunk `c` is `rows[w * chunks + c]`.
    chunks: usize,
    rows: Box<[OnceLock<Box<[AtomicI64]>>]>,
}

impl SizeHist {
    fn new(gen: u64, workers: usize, max_item_size: usize) -> SizeHist {
        // memcached: item_size_max / 32 + 1 buckets.
        let buckets = max_item_size / SIZES_BUCKET + 1;
        let chunks = buckets.div_ceil(CHUNK);
        let rows = (0..workers.max(1) * chunks).map(|_| OnceLock::new()).collect();
        SizeHist { gen, buckets, chunks, rows }
    }

    /// Count (`d` = 1) or uncount (-1) an item of `size` bytes in `worker`'s row. Only that
    /// worker's thread calls this for its row.
    #[inline]
    fn add(&self, worker: usize, size: usize, d: i64) {
        // memcached: bucket = ceil(size / 32); sizes past the last bucket are not counted.
        let b = size.div_ceil(SIZES_BUCKET);
        if b >= self.buckets {
            return;
        }
        if let Some(chunk) = self.rows.get(worker * self.chunks + b / CHUNK) {
            let chunk = chunk.get_or_init(|| (0..CHUNK).map(|_| AtomicI64::new(0)).collect());
            let a = &chunk[b % CHUNK];
            a.store(a.load(Ordering::Relaxed) + d, Ordering::Relaxed);
        }
    }

    /// Every bucket's count summed over the workers' rows, as (bucket, sum); buckets no worker
    /// has counted in are left out.
    fn sums(&self) -> Vec<(usize, i64)> {
        let workers = self.rows.len() / self.chunks;
        let mut out = Vec::new();
        for c in 0..self.chunks {
            let parts: Vec<&[AtomicI64]> =
                (0..workers).filter_map(|w| self.rows[w * self.chunks + c].get().map(|b| &b[..])).collect();
            if parts.is_empty() {
                continue;
            }
            for i in 0..CHUNK.min(self.buckets - c * CHUNK) {
                out.push((c * CHUNK + i, parts.iter().map(|p| p[i].load(Ordering::Relaxed)).sum()));
            }
        }
        out
    }
}

/// The server's switch, in the global pool; on a cache line of its own.
#[repr(align(128))]
#[derive(Default)]
pub(crate) struct SizesSwitch {
    /// Bumped at every enabling and disabling (written under `table`'s lock).
    gen: AtomicU64,
    table: Mutex<Option<Arc<SizeHist>>>,
}

impl SizesSwitch {
    fn current(&self) -> (u64, Option<Arc<SizeHist>>) {
        let t = self.table.lock().unwrap();
        (self.gen.load(Ordering::Relaxed), t.clone())
    }
}

impl GlobalPool {
    /// `stats sizes_enable`: start counting (zeroed) unless already on. Every worker counts
    /// the items it writes from its next write on.
    pub fn sizes_enable(&self, workers: usize, max_item_size: usize) {
        let mut t = self.sizes.table.lock().unwrap();
        if t.is_none() {
            let gen = self.sizes.gen.load(Ordering::Relaxed) + 1;
            *t = Some(Arc::new(SizeHist::new(gen, workers, max_item_size)));
            self.sizes.gen.store(gen, Ordering::Release);
        }
    }

    /// `stats sizes_disable`: stop counting and forget the counts.
    pub fn sizes_disable(&self) {
        let mut t = self.sizes.table.lock().unwrap();
        if t.take().is_some() {
            self.sizes.gen.fetch_add(1, Ordering::Release);
        }
    }

    /// Counting is on.
    pub fn sizes_on(&self) -> bool {
        self.sizes.table.lock().unwrap().is_some()
    }

    /// `stats sizes`: `None` when off, else every non-empty bucket as (its upper bound in
    /// bytes, items), smallest first: the workers' rows summed.
    pub fn sizes(&self) -> Option<Vec<(usize, u64)>> {
        let t = self.sizes.table.lock().unwrap().clone()?;
        Some(t.sums().into_iter().filter(|&(_, n)| n > 0).map(|(b, n)| (b * SIZES_BUCKET, n as u64)).collect())
    }
}

impl Cachelet {
    /// Forget the `SIZED` marks made under a table other than `live` (0: none is live).
    fn sizes_reset(&mut self, live: u64) {
        if self.sized == 0 || self.sized == live {
            return;
        }
        for seg in self.segs.iter_mut().flatten() {
            let mut o = 0;
            while o < seg.used {
                let bits = It::bits(&seg.buf, o);
                It::set_bits(&mut seg.buf, o, bits & !SIZED);
                o += It::size(&seg.buf, o);
            }
        }
        self.sized = 0;
    }

    /// An item that moves inside the store (relocation, compaction) keeps its count: its old
    /// copy, about to be marked dead, is no longer the counted one.
    pub(super) fn sizes_moved(&mut self, s: u32, o: u32) {
        let seg = self.seg_mut(s);
        let bits = It::bits(&seg.buf, o as usize);
        It::set_bits(&mut seg.buf, o as usize, bits & !SIZED);
    }
}

impl Mem {
    /// The item at (`s`, `o`) of `c` goes (or changes size, `d` = -1 then +1): uncount it if it
    /// was counted under this worker's table.
    #[inline]
    pub(super) fn sizes_count(&self, c: &Cachelet, s: u32, o: u32, d: i64) {
        self.sizes_count_at(&c.seg(s).buf, o as usize, c.sized, d)
    }

    /// The same for an item at `o` of `b`, of a cachelet whose marks are `sized`'s.
    #[inline]
    pub(super) fn sizes_count_at(&self, b: &[u8], o: usize, sized: u64, d: i64) {
        if It::bits(b, o) & SIZED == 0 {
            return;
        }
        if let Some(t) = self.sizes.as_deref().filter(|t| t.gen == sized) {
            let size = memcached_item_size(It::klen(b, o), It::vlen(b, o), It::flags(b, o), self.cfg.cas_enabled);
            t.add(usize::from(self.cfg.worker_id), size, d);
        }
    }
}

impl WorkerStore {
    /// Follow the server's switch: the one atomic load of the write path.
    #[inline]
    pub(super) fn sizes_check(&mut self) {
        if self.m.global.sizes.gen.load(Ordering::Relaxed) != self.m.sizes_seen {
            self.sizes_sync();
        }
    }

    #[cold]
    fn sizes_sync(&mut self) {
        let (gen, table) = self.m.global.sizes.current();
        self.m.sizes_seen = gen;
        self.m.sizes = table;
        let live = self.m.sizes.as_ref().map_or(0, |t| t.gen);
        for c in self.cachelets.iter_mut().flatten() {
            c.sizes_reset(live);
        }
    }

    /// A cachelet arriving from another worker: its marks count only under this worker's table.
    pub(super) fn sizes_arrive(&mut self, c: &mut Cachelet) {
        self.sizes_check();
        c.sizes_reset(self.m.sizes.as_ref().map_or(0, |t| t.gen));
    }

    /// Count the item just written at (`s`, `o`) of cachelet `cl` if counting is on: mark it.
    #[inline]
    pub(super) fn sizes_written(&mut self, cl: u32, s: u32, o: u32) {
        let Some(t) = self.m.sizes.as_deref() else { return };
        let c = self.cachelets[cl as usize].as_deref_mut().expect("owned");
        c.sized = t.gen;
        let seg = c.seg_mut(s);
        let o = o as usize;
        let bits = It::bits(&seg.buf, o);
        It::set_bits(&mut seg.buf, o, bits | SIZED);
        let b = &seg.buf;
        let size = memcached_item_size(It::klen(b, o), It::vlen(b, o), It::flags(b, o), self.m.cfg.cas_enabled);
        t.add(usize::from(self.m.cfg.worker_id), size, 1);
    }

    /// Uncount every counted item of a cachelet that is dropped whole.
    pub(super) fn sizes_discard(&self, c: &Cachelet) {
        if c.sized == 0 || self.m.sizes.is_none() {
            return;
        }
        for (s, seg) in c.segs.iter().enumerate() {
            let Some(seg) = seg else { continue };
            let mut o = 0;
            while o < seg.used {
                if It::bits(&seg.buf, o) & DEAD == 0 {
                    self.m.sizes_count(c, s as u32, o as u32, -1);
                }
                o += It::size(&seg.buf, o);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::mk;
    use super::*;
    use mbal_cluster::key_hash;

    fn put(w: &mut WorkerStore, cl: u32, k: &str, v: &[u8], flags: u32) -> bool {
        let r = w.store(cl, key_hash(k.as_bytes()), k.as_bytes(), v, flags, 0, Mode::Set, None, 0);
        matches!(r, StoreResult::Stored { .. })
    }
    fn del(w: &mut WorkerStore, cl: u32, k: &str) {
        w.delete(cl, key_hash(k.as_bytes()), k.as_bytes(), None, 0);
    }
    /// The sum of every counter, checking that no bucket's sum is negative.
    fn total(g: &GlobalPool) -> u64 {
        let t = g.sizes.table.lock().unwrap().clone().expect("on");
        let mut sum = 0;
        for (b, n) in t.sums() {
            assert!(n >= 0, "bucket {b}: {n}");
            sum += n;
        }
        sum as u64
    }

    #[test]
    fn memcached_sizes_of_the_items_written_since_enabled() {
        let mut w = mk(1 << 20, |_| {});
        let g = w.global().clone();
        assert!(put(&mut w, 0, "pre", b"abc", 0));
        assert_eq!(g.sizes(), None);
        g.sizes_enable(4, 1 << 20);
        assert_eq!(g.sizes(), Some(vec![]));
        assert!(put(&mut w, 0, "a", b"ab", 0)); // 48 + 2 + 4 + 8 = 62
        assert!(put(&mut w, 1, "b", b"ab", 5)); // + 4 for the flags: 66
        assert!(put(&mut w, 2, "c", &[b'x'; 100], 0)); // 160
        assert_eq!(g.sizes(), Some(vec![(64, 1), (96, 1), (160, 1)]));
        // An item written before the enabling is not uncounted when it goes; its new copy counts.
        del(&mut w, 0, "pre");
        assert!(put(&mut w, 0, "pre", b"abc", 0)); // 48 + 4 + 5 + 8 = 65
        assert_eq!(g.sizes(), Some(vec![(64, 1), (96, 2), (160, 1)]));
        // Replaced: the old size goes, the new one comes.
        assert!(put(&mut w, 0, "a", &[b'1'; 40], 0)); // 100
        assert_eq!(g.sizes(), Some(vec![(96, 2), (128, 1), (160, 1)]));
        // incr in place: 99 (48 + 3 + 5 + 8 = 64) becomes 100 (65).
        assert!(put(&mut w, 3, "nn", b"999", 0));
        assert_eq!(g.sizes(), Some(vec![(64, 1), (96, 2), (128, 1), (160, 1)]));
        assert!(matches!(
            w.arith(3, key_hash(b"nn"), b"nn", true, 1, 0),
            crate::ArithResult::Value { value: 1000, .. }
        ));
        assert_eq!(g.sizes(), Some(vec![(96, 3), (128, 1), (160, 1)]));
        // A size past the last bucket (item_size_max / 32) is not counted, as in memcached.
        g.sizes_disable();
        assert_eq!(g.sizes(), None);
        g.sizes_enable(4, 100);
        assert!(put(&mut w, 0, "big", &[b'x'; 200], 0));
        assert!(put(&mut w, 0, "s", b"x", 0)); // 61
        assert_eq!(g.sizes(), Some(vec![(64, 1)]));
        // Items counted under an earlier table are not uncounted from a later one.
        for cl in 0..4 {
            for k in ["a", "b", "c", "nn", "pre"] {
                del(&mut w, cl, k);
            }
        }
        assert_eq!(g.sizes(), Some(vec![(64, 1)]));
        del(&mut w, 0, "s");
        assert_eq!(g.sizes(), Some(vec![]));
    }

    #[test]
    fn a_row_holds_memory_for_the_sizes_in_use_only() {
        let mut w = mk(4 << 20, |_| {});
        let g = w.global().clone();
        g.sizes_enable(4, 1 << 30); // -I 1g: 33,554,433 buckets a row
        assert!(put(&mut w, 0, "s", b"x", 0)); // 61
        assert!(put(&mut w, 1, "big", &[b'x'; 40_000], 0)); // 48 + 4 + 40,002 + 8 = 40,062
        assert_eq!(g.sizes(), Some(vec![(64, 1), (40_064, 1)]));
        let t = g.sizes.table.lock().unwrap().clone().unwrap();
        assert_eq!(t.rows.iter().filter(|c| c.get().is_some()).count(), 2, "worker 3's chunks 0 and 1");
    }

    #[test]
    fn churn_with_eviction_and_compaction_keeps_every_live_item_counted_once() {
        // 1 MiB: tens of thousands of writes evict, relocate and compact many times over.
        let mut w = mk(1 << 20, |_| {});
        let g = w.global().clone();
        g.sizes_enable(4, 1 << 20);
        let mut n = 0u64;
        for i in 0..40_000u32 {
            // First rewrites and deletes in a set that fits (compaction), then a larger one
            // (eviction, relocation of the read items).
            let j = if i < 20_000 { i % 3_000 } else { i % 20_000 };
            let (k, cl) = (format!("k{j}"), j % 4);
            let v = vec![b'v'; (i as usize * 7919) % 600];
            if i % 11 == 0 {
                let j = j.saturating_sub(149);
                del(&mut w, j % 4, &format!("k{j}"));
            } else if i % 5 == 0 {
                // read an older key (CLOCK: read items are kept, i.e. relocated, by eviction)
                let j = j.saturating_sub(301);
                let k = format!("k{j}");
                w.get(j % 4, key_hash(k.as_bytes()), k.as_bytes(), 0);
            } else {
                put(&mut w, cl, &k, &v, i % 3);
            }
            if i % 500 == 0 {
                // the worker's background sweep: reclaims and compacts (`relocate`)
                w.sweep(0, 2000);
            }
            n += 1;
        }
        let st = w.stats();
        assert!(
            st.evictions > 0 && st.items_relocated > 0 && st.items_compacted > 0,
            "the churn evicts, relocates, compacts: {st:?}"
        );
        assert_eq!(total(&g), st.curr_items, "after {n} ops");
    }

    #[test]
    fn a_cachelet_moved_between_workers_is_uncounted_where_its_items_go() {
        let g = GlobalPool::new(4 << 20, 64 << 10);
        let cfg = |id| StoreConfig { mem_limit: 4 << 20, worker_id: id, workers: 2, ..Default::default() };
        let mut a = WorkerStore::new(g.clone(), cfg(0), 2);
        let mut b = WorkerStore::new(g.clone(), cfg(1), 2);
        a.insert_cachelet(Cachelet::new(0));
        b.insert_cachelet(Cachelet::new(1));
        g.sizes_enable(2, 1 << 20);
        for i in 0..100 {
            assert!(put(&mut a, 0, &format!("k{i}"), b"v", 0));
        }
        assert_eq!(total(&g), 100);
        let c = a.take_cachelet(0).unwrap();
        b.insert_cachelet(c);
        for i in 0..40 {
            del(&mut b, 0, &format!("k{i}"));
        }
        assert_eq!(total(&g), 60);
        // Dropped whole (its items went to another server): all uncounted.
        assert!(b.discard_cachelet(0));
        assert_eq!(total(&g), 0);
        // Disabled and enabled again while a cachelet travels: its old marks count nowhere.
        b.insert_cachelet(Cachelet::new(0));
        for i in 0..10 {
            assert!(put(&mut b, 0, &format!("k{i}"), b"v", 0));
        }
        let c = b.take_cachelet(0).unwrap();
        g.sizes_disable();
        g.sizes_enable(2, 1 << 20);
        a.insert_cachelet(c);
        for i in 0..10 {
            del(&mut a, 0, &format!("k{i}"));
        }
        assert_eq!(g.sizes(), Some(vec![]));
    }
}
