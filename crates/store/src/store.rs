//! Cachelets (index + segments) and the per-worker store. See the crate docs for the design.

use crate::index::Index;
use crate::item::{footprint, It, ACCESSED, DEAD, FETCHED, MAX_KEY, STALE, WIN};
use crate::pool::{GlobalPool, Page};
use crate::{rel_exptime, ArithResult, CasOpts, DeleteResult, ItemView, MetaBits, Mode, StoreConfig, StoreResult};
use std::collections::BTreeSet;
use std::ops::Bound;
use std::sync::Arc;

/// Pending flush_all calls remembered per cachelet (see `Cachelet::flushes`).
const MAX_FLUSHES: usize = 8;
/// Dead-fraction buckets for compaction candidates (tenths).
const DEAD_BUCKETS: usize = 10;
/// A segment at least this many tenths dead is compacted (its live items
/// kept) in preference to evicting live items from the oldest one.
const COMPACT_BUCKET: usize = 2;

/// An append-only segment: one page, or one dedicated buffer for a large item.
struct Segment {
    buf: Box<[u8]>,
    used: usize,
    live_items: u32,
    live_bytes: usize,
    dead_bytes: usize,
    /// Creation sequence (eviction order).
    seq: u64,
    /// 0 for a normal page; else the pages charged for this large item.
    large_pages: usize,
}

impl Segment {
    /// Offsets of the items not marked dead, in order.
    fn live_offsets(&self, out: &mut Vec<u32>) {
        let mut o = 0;
        while o < self.used {
            if It::bits(&self.buf, o) & DEAD == 0 {
                out.push(o as u32);
            }
            o += It::size(&self.buf, o);
        }
    }
}

/// Per-cachelet counters (plain integers; the balancer reads them via [`Cachelet::stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheletStats {
    pub items: u64,
    /// Live item bytes (item footprints: header + key + value + padding).
    pub bytes: u64,
    /// Pages held (segments, large items counted by their charge).
    pub pages: u64,
    pub reads: u64,
    pub writes: u64,
    pub hits: u64,
    pub misses: u64,
}

/// A partition of the key space: its index, its segments (pages) and its counters.
/// Aligned to 128 bytes: cachelets of different workers never share a cache line.
#[repr(align(128))]
pub struct Cachelet {
    id: u32,
    index: Index,
    segs: Vec<Option<Segment>>,
    free_slots: Vec<u32>,
    open: Option<u32>,
    st: CacheletStats,
    /// Pending/active flush_all calls `(at, CAS counter at the call)`, oldest first. An item is
    /// flushed if any of them applies (a later delayed flush never resurrects items); a flush
    /// is dropped once a later one that covers it is in effect. At most `MAX_FLUSHES`.
    flushes: Vec<(u32, u64)>,
    /// CAS counter of the worker it was taken from.
    cas_floor: u64,
    /// The pool its pages belong to (set on first insert); used if it is dropped on its own.
    pool: Option<Arc<GlobalPool>>,
}

impl Drop for Cachelet {
    /// A cachelet dropped outside a `WorkerStore` gives its pages back to the global pool.
    fn drop(&mut self) {
        let Some(pool) = self.pool.take() else {
            return;
        };
        let mut pages = Vec::new();
        for seg in self.segs.iter_mut().filter_map(|s| s.take()) {
            if seg.large_pages > 0 {
                pool.release_large(seg.large_pages);
            } else {
                pages.push(seg.buf);
            }
        }
        pool.give(pages.into_iter());
    }
}

impl Cachelet {
    pub fn new(id: u32) -> Box<Self> {
        Box::new(Cachelet {
            id,
            index: Index::new(),
            segs: Vec::new(),
            free_slots: Vec::new(),
            open: None,
            st: CacheletStats::default(),
            flushes: Vec::new(),
            cas_floor: 0,
            pool: None,
        })
    }

    pub fn id(&self) -> u32 {
        self.id
    }

    pub fn stats(&self) -> CacheletStats {
        self.st
    }

    /// Reset the read/write/hit/miss counters (e.g. at a balancer epoch), keeping gauges.
    pub fn reset_counters(&mut self) {
        self.st.reads = 0;
        self.st.writes = 0;
        self.st.hits = 0;
        self.st.misses = 0;
    }

    #[inline]
    fn seg(&self, s: u32) -> &Segment {
        self.segs[s as usize].as_ref().expect("live segment slot")
    }

    #[inline]
    fn seg_mut(&mut self, s: u32) -> &mut Segment {
        self.segs[s as usize].as_mut().expect("live segment slot")
    }

    #[inline]
    fn lookup(&self, hash: u64, key: &[u8]) -> Option<(u32, u32)> {
        let segs = &self.segs;
        self.index.find(hash, |s, o| {
            let b = &segs[s as usize].as_ref().expect("indexed segment").buf;
            It::hash(b, o as usize) == hash && It::key(b, o as usize) == key
        })
    }

    fn liveness(&self, s: u32, o: u32, now: u32) -> Liveness {
        let b = &self.seg(s).buf;
        let o = o as usize;
        let e = It::exptime(b, o);
        if e != 0 && e <= now {
            return Liveness::Expired;
        }
        for &(at, ctr) in &self.flushes {
            if now >= at && {
                let t = It::set_time(b, o);
                t < at || (t == at && (It::cas(b, o) >> 16) <= ctr)
            } {
                return Liveness::Flushed;
            }
        }
        Liveness::Live
    }

    fn remove_index(&mut self, hash: u64, s: u32, o: u32) {
        let removed = self.index.remove(hash, s, o);
        debug_assert!(removed, "item not in index");
    }

    fn relink_index(&mut self, hash: u64, from: (u32, u32), to: (u32, u32)) {
        let moved = self.index.relink(hash, from, to);
        assert!(moved, "item not in index");
    }

    /// Index an item the index does not hold yet.
    fn insert_index(&mut self, hash: u64, s: u32, o: u32) {
        let segs = &self.segs;
        self.index
            .insert(hash, s, o, |s, o| It::hash(&segs[s as usize].as_ref().expect("indexed segment").buf, o as usize));
    }

    /// Account a freshly written item.
    fn commit(&mut self, s: u32, sz: usize) {
        let seg = self.seg_mut(s);
        seg.live_items += 1;
        seg.live_bytes += sz;
        self.st.items += 1;
        self.st.bytes += sz as u64;
    }

    /// Mark an item dead (index untouched). Returns true if its sealed segment is now empty.
    fn mark_dead(&mut self, s: u32, o: u32) -> bool {
        let open = self.open;
        let seg = self.seg_mut(s);
        let o = o as usize;
        let bits = It::bits(&seg.buf, o);
        debug_assert_eq!(bits & DEAD, 0);
        It::set_bits(&mut seg.buf, o, bits | DEAD);
        let sz = It::size(&seg.buf, o);
        seg.live_items -= 1;
        seg.live_bytes -= sz;
        seg.dead_bytes += sz;
        let empty = seg.live_items == 0 && open != Some(s);
        self.st.items -= 1;
        self.st.bytes -= sz as u64;
        empty
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Liveness {
    Live,
    Expired,
    Flushed,
}

enum Found {
    Hit(u32, u32),
    Miss,
    Expired,
    Flushed,
}

/// Worker-level statistics (memcached names where one exists).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WorkerStats {
    pub curr_items: u64,
    pub total_items: u64,
    pub bytes: u64,
    pub limit_maxbytes: u64,
    pub cmd_get: u64,
    pub cmd_set: u64,
    pub cmd_touch: u64,
    pub get_hits: u64,
    pub get_misses: u64,
    pub get_expired: u64,
    pub get_flushed: u64,
    pub delete_hits: u64,
    pub delete_misses: u64,
    pub incr_hits: u64,
    pub incr_misses: u64,
    pub decr_hits: u64,
    pub decr_misses: u64,
    pub cas_hits: u64,
    pub cas_misses: u64,
    pub cas_badval: u64,
    pub touch_hits: u64,
    pub touch_misses: u64,
    pub evictions: u64,
    pub evicted_unfetched: u64,
    pub reclaimed: u64,
    pub expired_unfetched: u64,
    pub out_of_memory: u64,
    /// Items an eviction kept because they were read since written (CLOCK
    /// second chance) and re-appended to their cachelet's open segment.
    pub items_relocated: u64,
    /// Items moved by compaction.
    pub items_compacted: u64,
    pub segments_compacted: u64,
    /// Pages held by this worker: local free + normal segment pages + large-item charges.
    pub pages_held: u64,
    pub local_free_pages: u64,
    pub segments: u64,
    pub owned_cachelets: u64,
    /// Bytes of the owned cachelets' hash indexes (outside the page budget; memcached's
    /// `hash_bytes`).
    pub hash_bytes: u64,
}

/// Memory-side state of a worker (split from the cachelet table for borrowing).
struct Mem {
    cfg: StoreConfig,
    global: Arc<GlobalPool>,
    local_free: Vec<Page>,
    /// All segments of owned cachelets: (seq, cachelet, slot).
    order: BTreeSet<(u64, u32, u32)>,
    next_seq: u64,
    /// Set once the global pool ran low or the worker had to evict: enables second chance.
    pressure: bool,
    evict_gen: u64,
    seg_pages: usize,
    large_pages: usize,
    cas_ctr: u64,
    last_now: u32,
    sweep_cursor: Option<(u64, u32, u32)>,
    scratch: Vec<u8>,
    offs: Vec<u32>,
    /// Items kept by the eviction in progress: (hash, offset in scratch, size).
    kept: Vec<(u64, u32, u32)>,
    /// Compaction candidates by dead fraction: `dead[b]` holds (seq, cachelet,
    /// slot) of segments that became at least `b`/DEAD_BUCKETS dead. Entries
    /// go stale (segment freed, compacted, moved away) and are checked when
    /// taken.
    dead: [Vec<(u64, u32, u32)>; DEAD_BUCKETS],
    st: WorkerStats,
}

impl Mem {
    /// Mark an item dead and note its segment as a compaction candidate when
    /// its dead fraction crosses into a higher bucket. True if the (sealed)
    /// segment is now empty.
    fn mark_dead(&mut self, c: &mut Cachelet, s: u32, o: u32) -> bool {
        let before = c.seg(s).dead_bytes;
        let empty = c.mark_dead(s, o);
        let seg = c.seg(s);
        if !empty && seg.large_pages == 0 {
            let len = seg.buf.len();
            let (b, a) = (before * DEAD_BUCKETS / len, (seg.dead_bytes * DEAD_BUCKETS / len).min(DEAD_BUCKETS - 1));
            if a > b && a >= self.compact_bucket() {
                let list = &mut self.dead[a];
                list.push((seg.seq, c.id, s));
                if list.len() > 4 * (self.seg_pages + 16) {
                    // Mostly stale entries: forget the oldest half.
                    list.drain(..list.len() / 2);
                }
            }
        }
        empty
    }

    /// Dead tenths from which a segment is worth compacting: `COMPACT_BUCKET`,
    /// or one tenth with `-M`, where compaction is the only way to reuse the
    /// room of overwritten and deleted items.
    fn compact_bucket(&self) -> usize {
        if self.cfg.evict {
            COMPACT_BUCKET
        } else {
            1
        }
    }

    fn held(&self) -> usize {
        self.local_free.len() + self.seg_pages + self.large_pages
    }

    /// This worker's fair share of the budget.
    fn fair_share(&self) -> usize {
        self.global.total_pages() / self.cfg.workers.max(1)
    }

    /// Pages a worker at or above its fair share leaves in the global pool,
    /// so a worker that has nothing to evict yet (its traffic just started)
    /// is served at once instead of failing until others shed pages.
    fn reserve_for_others(&self) -> usize {
        let others = self.cfg.workers.max(1) - 1;
        let floor = (self.fair_share() / 8).max(2 * self.cfg.refill_pages.max(1));
        (others * floor).min(self.global.total_pages() / 2)
    }

    fn get_page(&mut self) -> Option<Page> {
        if let Some(p) = self.local_free.pop() {
            return Some(p);
        }
        if self.held() >= self.fair_share() && self.global.available_pages() <= self.reserve_for_others() {
            // Past our share and only the others' reserve is left: evict our own.
            self.pressure = true;
            return None;
        }
        let n = self.cfg.refill_pages.max(1);
        self.global.take(n, &mut self.local_free);
        // Memory is about to run out: start giving read items a second chance.
        if self.global.available_pages() <= self.cfg.global_low_pages.max(n) {
            self.pressure = true;
        }
        self.local_free.pop()
    }

    fn maybe_return(&mut self) {
        if self.local_free.len() > self.cfg.local_high_pages
            && self.global.available_pages() < self.cfg.global_low_pages
        {
            let keep = self.cfg.refill_pages.min(self.cfg.local_high_pages);
            self.global.give(self.local_free.drain(keep..));
        }
    }

    #[inline]
    fn next_cas(&mut self) -> u64 {
        self.cas_ctr += 1;
        (self.cas_ctr << 16) | self.cfg.worker_id as u64
    }

    #[inline]
    fn shown_cas(&self, cas: u64) -> u64 {
        if self.cfg.cas_enabled {
            cas
        } else {
            0
        }
    }

    fn new_segment(&mut self, c: &mut Cachelet, buf: Box<[u8]>, large_pages: usize) -> u32 {
        let seq = self.next_seq;
        self.next_seq += 1;
        let slot = match c.free_slots.pop() {
            Some(s) => s,
            None => {
                c.segs.push(None);
                (c.segs.len() - 1) as u32
            }
        };
        c.segs[slot as usize] =
            Some(Segment { buf, used: 0, live_items: 0, live_bytes: 0, dead_bytes: 0, seq, large_pages });
        self.order.insert((seq, c.id, slot));
        if large_pages > 0 {
            self.large_pages += large_pages;
            c.st.pages += large_pages as u64;
        } else {
            self.seg_pages += 1;
            c.st.pages += 1;
        }
        slot
    }

    fn free_seg(&mut self, c: &mut Cachelet, s: u32) {
        let seg = c.segs[s as usize].take().expect("live segment");
        c.free_slots.push(s);
        if c.open == Some(s) {
            c.open = None;
        }
        self.order.remove(&(seg.seq, c.id, s));
        if seg.large_pages > 0 {
            self.global.release_large(seg.large_pages);
            self.large_pages -= seg.large_pages;
            c.st.pages -= seg.large_pages as u64;
        } else {
            self.seg_pages -= 1;
            c.st.pages -= 1;
            self.local_free.push(seg.buf);
            self.maybe_return();
        }
    }

    /// Remove a live item from index and segment; free its segment if now empty and allowed.
    fn unlink(&mut self, c: &mut Cachelet, s: u32, o: u32, free_empty: bool) {
        let hash = It::hash(&c.seg(s).buf, o as usize);
        c.remove_index(hash, s, o);
        if self.mark_dead(c, s, o) && free_empty {
            self.free_seg(c, s);
        }
    }

    fn count_reclaim(&mut self, c: &Cachelet, s: u32, o: u32) {
        self.st.reclaimed += 1;
        if It::bits(&c.seg(s).buf, o as usize) & FETCHED == 0 {
            self.st.expired_unfetched += 1;
        }
    }

    fn find_live(&mut self, c: &mut Cachelet, hash: u64, key: &[u8], now: u32) -> Found {
        match c.lookup(hash, key) {
            None => Found::Miss,
            Some((s, o)) => match c.liveness(s, o, now) {
                Liveness::Live => Found::Hit(s, o),
                l => {
                    self.count_reclaim(c, s, o);
                    self.unlink(c, s, o, true);
                    if l == Liveness::Expired {
                        Found::Expired
                    } else {
                        Found::Flushed
                    }
                }
            },
        }
    }

    /// Bump-allocate `size` bytes in `c`'s open segment, opening a new page if one is at hand
    /// (local pool or a global refill). Never evicts.
    fn alloc_small(&mut self, c: &mut Cachelet, size: usize) -> Option<(u32, u32)> {
        if let Some(s) = c.open {
            let seg = c.seg_mut(s);
            if seg.used + size <= seg.buf.len() {
                let off = seg.used;
                seg.used += size;
                return Some((s, off as u32));
            }
        }
        // An open segment whose items all died gives its page back first, so
        // that a full store (memcached -M) can reuse it.
        if let Some(old) = c.open.filter(|&old| c.seg(old).live_items == 0) {
            self.free_seg(c, old); // (clears c.open)
        }
        let page = self.get_page()?;
        c.open = None;
        let s = self.new_segment(c, page, 0);
        c.open = Some(s);
        let seg = c.seg_mut(s);
        seg.used = size;
        Some((s, 0))
    }

    fn try_large(&mut self, c: &mut Cachelet, size: usize) -> Option<(u32, u32)> {
        let n = size.div_ceil(self.cfg.page_size);
        if !self.global.charge_large(n) {
            if self.local_free.is_empty() {
                return None;
            }
            self.global.give(self.local_free.drain(..));
            if !self.global.charge_large(n) {
                return None;
            }
        }
        let s = self.new_segment(c, vec![0u8; size].into_boxed_slice(), n);
        c.seg_mut(s).used = size;
        Some((s, 0))
    }
}

/// One worker's store: the cachelets it owns and its local page pool. Single-threaded.
/// Aligned to 128 bytes so that two workers' stores never share a cache line (its counters
/// are written on every operation).
#[repr(align(128))]
pub struct WorkerStore {
    cachelets: Vec<Option<Box<Cachelet>>>,
    m: Mem,
}

/// `bits_before` and `last_before` are the marks as they were before this access: `mg`'s `h`
/// and `l` flags report the previous fetch, as memcached's do.
fn view<'a>(b: &'a [u8], o: usize, cas: u64, bits_before: u8, last_before: u32) -> ItemView<'a> {
    let bits = It::bits(b, o);
    ItemView {
        key: It::key(b, o),
        value: It::value(b, o),
        flags: It::flags(b, o),
        cas,
        exptime: It::exptime(b, o),
        last_access: last_before,
        fetched_before: bits_before & FETCHED != 0,
        stale: bits & STALE != 0,
        win: bits & WIN != 0,
    }
}

fn parse_u64(v: &[u8]) -> Option<u64> {
    let mut end = v.len();
    while end > 0 && matches!(v[end - 1], b' ' | b'\r' | b'\n' | b'\t') {
        end -= 1;
    }
    let d = &v[..end];
    if d.is_empty() {
        return None;
    }
    let mut x: u64 = 0;
    for &ch in d {
        if !ch.is_ascii_digit() {
            return None;
        }
        x = x.checked_mul(10)?.checked_add((ch - b'0') as u64)?;
    }
    Some(x)
}

impl WorkerStore {
    pub fn new(global: Arc<GlobalPool>, cfg: StoreConfig, cachelet_count: u32) -> Self {
        assert_eq!(cfg.page_size, global.page_size(), "config page_size != pool page_size");
        let mut cachelets = Vec::new();
        cachelets.resize_with(cachelet_count as usize, || None);
        let st = WorkerStats { limit_maxbytes: cfg.mem_limit as u64, ..Default::default() };
        WorkerStore {
            cachelets,
            m: Mem {
                cfg,
                global,
                local_free: Vec::new(),
                order: BTreeSet::new(),
                next_seq: 1,
                pressure: false,
                evict_gen: 0,
                seg_pages: 0,
                large_pages: 0,
                cas_ctr: 0,
                last_now: 0,
                sweep_cursor: None,
                scratch: Vec::new(),
                offs: Vec::new(),
                kept: Vec::new(),
                dead: Default::default(),
                st,
            },
        }
    }

    pub fn config(&self) -> &StoreConfig {
        &self.m.cfg
    }

    /// Adopt a cachelet (pointer move; its pages come with it).
    pub fn insert_cachelet(&mut self, mut c: Box<Cachelet>) {
        let id = c.id as usize;
        assert!(id < self.cachelets.len(), "cachelet id {id} out of range");
        assert!(self.cachelets[id].is_none(), "cachelet {id} already owned");
        self.m.cas_ctr = self.m.cas_ctr.max(c.cas_floor);
        for (slot, seg) in c.segs.iter().enumerate() {
            if let Some(seg) = seg {
                self.m.order.insert((seg.seq, c.id, slot as u32));
                self.m.next_seq = self.m.next_seq.max(seg.seq + 1);
                if seg.large_pages > 0 {
                    self.m.large_pages += seg.large_pages;
                } else {
                    self.m.seg_pages += 1;
                }
            }
        }
        c.cas_floor = 0;
        if let Some(p) = &c.pool {
            assert!(Arc::ptr_eq(p, &self.m.global), "cachelet {id} belongs to another GlobalPool");
        } else {
            c.pool = Some(self.m.global.clone());
        }
        self.cachelets[id] = Some(c);
    }

    /// Give up a cachelet (pointer move; its pages leave with it).
    pub fn take_cachelet(&mut self, id: u32) -> Option<Box<Cachelet>> {
        let mut c = self.cachelets.get_mut(id as usize)?.take()?;
        for (slot, seg) in c.segs.iter().enumerate() {
            if let Some(seg) = seg {
                self.m.order.remove(&(seg.seq, c.id, slot as u32));
                if seg.large_pages > 0 {
                    self.m.large_pages -= seg.large_pages;
                } else {
                    self.m.seg_pages -= 1;
                }
            }
        }
        c.cas_floor = self.m.cas_ctr;
        Some(c)
    }

    /// Start loading the index line a lookup of `hash` in cachelet `cl` will read (see
    /// `Index::prefetch`); nothing if the cachelet is not here.
    #[inline]
    pub fn prefetch(&self, cl: u32, hash: u64) {
        if let Some(Some(c)) = self.cachelets.get(cl as usize) {
            c.index.prefetch(hash);
        }
    }

    pub fn owns(&self, id: u32) -> bool {
        matches!(self.cachelets.get(id as usize), Some(Some(_)))
    }

    pub fn cachelet_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.cachelets.iter().enumerate().filter(|(_, c)| c.is_some()).map(|(i, _)| i as u32)
    }

    /// Read access to an owned cachelet (its stats).
    pub fn cachelet(&self, id: u32) -> Option<&Cachelet> {
        self.cachelets.get(id as usize)?.as_deref()
    }

    /// Mutable access to an owned cachelet (e.g. to reset its counters).
    pub fn cachelet_mut(&mut self, id: u32) -> Option<&mut Cachelet> {
        self.cachelets.get_mut(id as usize)?.as_deref_mut()
    }

    #[inline]
    fn check_owned(&self, cl: u32) -> bool {
        let ok = self.owns(cl);
        debug_assert!(ok, "cachelet {cl} not owned by this worker");
        ok
    }

    /// Evict the worker's oldest segment. False if it has none.
    fn evict_one(&mut self) -> bool {
        self.evict_segment(true)
    }

    /// The most-dead segment that is at least `compact_bucket()` tenths dead.
    fn compaction_candidate(&mut self) -> Option<(u64, u32, u32)> {
        for b in (self.m.compact_bucket()..DEAD_BUCKETS).rev() {
            while let Some((seq, cl, s)) = self.m.dead[b].pop() {
                let Some(c) = self.cachelets.get(cl as usize).and_then(|c| c.as_deref()) else { continue };
                let Some(seg) = c.segs.get(s as usize).and_then(|x| x.as_ref()) else { continue };
                if seg.seq == seq && c.open != Some(s) && seg.dead_bytes * DEAD_BUCKETS / seg.buf.len() >= b {
                    return Some((seq, cl, s));
                }
            }
        }
        None
    }

    /// Make room by emptying one segment. The victim is the most-dead segment
    /// of the worker if one is at least `COMPACT_BUCKET` tenths dead
    /// (compaction: its live items are kept), else the oldest segment (CLOCK:
    /// live items read since they were written or last kept survive, up to
    /// half a page, and lose their mark). Kept items are copied aside, the
    /// page is freed, and they are re-appended to their cachelet's open
    /// segment, which can use the page just freed. Overwrite-heavy loads
    /// thus give their dead space back instead of evicting live items, and
    /// hot items stay however old their page is. False if there is nothing
    /// to evict.
    fn evict_segment(&mut self, retain: bool) -> bool {
        let pick = if retain { self.compaction_candidate() } else { None };
        self.empty_segment(pick, retain)
    }

    /// Make room without dropping a live item (memcached `-M`): compact the
    /// most-dead segment if one is at least a tenth dead,
    /// else compact the oldest segment if it holds an expired or flushed
    /// item (memcached reclaims those at its LRU tail before failing a
    /// store). False if neither frees anything.
    fn reclaim_dead(&mut self) -> bool {
        if let Some(pick) = self.compaction_candidate() {
            return self.empty_segment(Some(pick), true);
        }
        let Some(&(seq, cl, s)) = self.m.order.first() else { return false };
        let c = self.cachelets[cl as usize].as_deref().expect("segment of owned cachelet");
        let (seg, now) = (c.seg(s), self.m.last_now);
        if c.open == Some(s) || seg.large_pages > 0 {
            return false;
        }
        let mut offs = std::mem::take(&mut self.m.offs);
        offs.clear();
        seg.live_offsets(&mut offs);
        let reclaimable = offs.iter().any(|&o| c.liveness(s, o, now) != Liveness::Live);
        self.m.offs = offs;
        reclaimable && self.empty_segment(Some((seq, cl, s)), true)
    }

    /// Empty `pick` keeping all its live items (compaction), or with `None`
    /// the oldest segment keeping the items read since written (CLOCK) if
    /// `retain`, else none.
    fn empty_segment(&mut self, pick: Option<(u64, u32, u32)>, retain: bool) -> bool {
        let compacting = pick.is_some();
        let Some((_, cl, s)) = pick.or_else(|| self.m.order.first().copied()) else {
            return false;
        };
        let c = self.cachelets[cl as usize].as_deref_mut().expect("segment of owned cachelet");
        let now = self.m.last_now;
        let mut offs = std::mem::take(&mut self.m.offs);
        let mut kept_bytes = std::mem::take(&mut self.m.scratch);
        let mut kept = std::mem::take(&mut self.m.kept);
        offs.clear();
        kept_bytes.clear();
        kept.clear();
        let cap = {
            let seg = c.seg(s);
            seg.live_offsets(&mut offs);
            match (retain, seg.large_pages > 0, compacting) {
                (false, _, _) | (_, true, _) => 0,
                (true, false, true) => seg.buf.len(),
                (true, false, false) => seg.buf.len() / 2,
            }
        };
        for &o in &offs {
            let (hash, bits, sz) = {
                let b = &c.seg(s).buf;
                let o = o as usize;
                (It::hash(b, o), It::bits(b, o), It::size(b, o))
            };
            let fetched = bits & FETCHED != 0;
            if c.liveness(s, o, now) != Liveness::Live {
                self.m.st.reclaimed += 1;
                if !fetched {
                    self.m.st.expired_unfetched += 1;
                }
            } else if (compacting || bits & ACCESSED != 0) && kept_bytes.len() + sz <= cap {
                let at = kept_bytes.len();
                kept_bytes.extend_from_slice(&c.seg(s).buf[o as usize..o as usize + sz]);
                if !compacting {
                    It::set_bits(&mut kept_bytes, at, bits & !ACCESSED);
                }
                kept.push((hash, at as u32, sz as u32));
            } else {
                self.m.st.evictions += 1;
                if !fetched {
                    self.m.st.evicted_unfetched += 1;
                }
            }
            c.remove_index(hash, s, o);
            c.st.items -= 1;
            c.st.bytes -= sz as u64;
        }
        self.m.free_seg(c, s);
        for &(hash, at, sz) in &kept {
            let (at, sz) = (at as usize, sz as usize);
            let Some((ns, no)) = self.m.alloc_small(c, sz) else {
                // No room after all (the freed page went back to the pool).
                self.m.st.evictions += 1;
                continue;
            };
            c.seg_mut(ns).buf[no as usize..no as usize + sz].copy_from_slice(&kept_bytes[at..at + sz]);
            c.commit(ns, sz);
            c.insert_index(hash, ns, no);
            if compacting {
                self.m.st.items_compacted += 1;
            } else {
                self.m.st.items_relocated += 1;
            }
        }
        if compacting {
            self.m.st.segments_compacted += 1;
        }
        self.m.offs = offs;
        self.m.scratch = kept_bytes;
        self.m.kept = kept;
        self.m.pressure = true;
        self.m.evict_gen += 1;
        true
    }

    /// Allocate `size` bytes for an item of cachelet `cl`, evicting if allowed and needed.
    fn alloc(&mut self, cl: u32, size: usize) -> Result<(u32, u32), StoreResult> {
        let large = size > self.m.cfg.page_size;
        if large && size.div_ceil(self.m.cfg.page_size) > self.m.global.total_pages() {
            return Err(StoreResult::OutOfMemory);
        }
        let seq_before = self.m.next_seq;
        loop {
            let c = self.cachelets[cl as usize].as_deref_mut().expect("owned");
            let got = if large { self.m.try_large(c, size) } else { self.m.alloc_small(c, size) };
            if let Some(l) = got {
                // A segment was opened: the (rare) moment to help a starving worker.
                if self.m.next_seq != seq_before && self.m.global.pages_wanted() > 0 {
                    self.help_starving();
                }
                return Ok(l);
            }
            if self.m.cfg.evict && self.m.held() < self.m.fair_share() * 3 / 4 && self.m.global.available_pages() == 0 {
                // Evicting while below our share: ask workers above theirs to shed.
                self.m.global.want(self.m.cfg.refill_pages.max(1));
            }
            let made_room = if self.m.cfg.evict { self.evict_one() } else { self.reclaim_dead() };
            if !made_room {
                if self.m.cfg.evict {
                    // Nothing of ours to evict: ask the other workers to shed pages.
                    self.m.global.want(self.m.cfg.refill_pages.max(1));
                }
                self.m.st.out_of_memory += 1;
                return Err(StoreResult::OutOfMemory);
            }
        }
    }

    /// Another worker starves (no free page anywhere, nothing of its own to evict): give back
    /// up to one refill's worth of pages, evicting our oldest segments if needed. Never gives
    /// away the segments that hold its own open items beyond the oldest ones.
    fn help_starving(&mut self) {
        let n = self.m.global.pages_wanted().min(self.m.cfg.refill_pages.max(1));
        // Only a worker above its fair share gives pages away, and it keeps
        // at least a few segments so that it does not starve in turn.
        if self.m.held() > self.m.fair_share() && self.m.order.len() > n + 2 * self.owned_count() {
            self.shed_pages(n);
        }
    }

    fn owned_count(&self) -> usize {
        self.cachelets.iter().filter(|c| c.is_some()).count()
    }

    /// Copy a live item to its cachelet's open segment without evicting. New location or None.
    fn relocate(&mut self, cl: u32, s: u32, o: u32) -> Option<(u32, u32)> {
        let c = self.cachelets[cl as usize].as_deref_mut().expect("owned");
        let (sz, hash) = {
            let b = &c.seg(s).buf;
            (It::size(b, o as usize), It::hash(b, o as usize))
        };
        let mut tmp = std::mem::take(&mut self.m.scratch);
        tmp.clear();
        tmp.extend_from_slice(&c.seg(s).buf[o as usize..o as usize + sz]);
        let got = self.m.alloc_small(c, sz);
        let res = got.map(|(ns, no)| {
            c.seg_mut(ns).buf[no as usize..no as usize + sz].copy_from_slice(&tmp);
            c.commit(ns, sz);
            c.relink_index(hash, (s, o), (ns, no));
            if self.m.mark_dead(c, s, o) {
                self.m.free_seg(c, s);
            }
            (ns, no)
        });
        self.m.scratch = tmp;
        res
    }

    fn get_inner(&mut self, cl: u32, hash: u64, key: &[u8], now: u32, bump: bool) -> Option<ItemView<'_>> {
        self.m.last_now = now;
        if !self.check_owned(cl) {
            return None;
        }
        let c = self.cachelets[cl as usize].as_deref_mut().expect("owned");
        let r = self.m.find_live(c, hash, key, now);
        if bump {
            c.st.reads += 1;
            self.m.st.cmd_get += 1;
        }
        let (s, o) = match r {
            Found::Hit(s, o) => (s, o),
            other => {
                if bump {
                    c.st.misses += 1;
                    self.m.st.get_misses += 1;
                    match other {
                        Found::Expired => self.m.st.get_expired += 1,
                        Found::Flushed => self.m.st.get_flushed += 1,
                        _ => {}
                    }
                }
                return None;
            }
        };
        if bump {
            c.st.hits += 1;
            self.m.st.get_hits += 1;
        }
        let c = self.cachelets[cl as usize].as_deref_mut().expect("owned");
        let seg = c.seg_mut(s);
        let o = o as usize;
        let bits = It::bits(&seg.buf, o);
        let last = It::last_access(&seg.buf, o);
        // Write the header only when a mark changes: a GET of an item already fetched this
        // second leaves its cache line clean, so repeated reads of hot items cost no
        // write-back traffic (memcached bumps its item time at most once a minute for the
        // same reason; mbal keeps one-second precision for `mg ... l`).
        if bump && (bits & (FETCHED | ACCESSED) != FETCHED | ACCESSED || last != now) {
            It::set_bits(&mut seg.buf, o, bits | FETCHED | ACCESSED);
            It::set_last_access(&mut seg.buf, o, now);
        }
        let cas = self.m.shown_cas(It::cas(&seg.buf, o));
        Some(view(&seg.buf, o, cas, bits, last))
    }

    /// Lookup; counts a read; marks fetched, accessed (the CLOCK bit) and last_access.
    /// None on miss/expired/flushed.
    pub fn get(&mut self, cl: u32, hash: u64, key: &[u8], now: u32) -> Option<ItemView<'_>> {
        self.get_inner(cl, hash, key, now, true)
    }

    /// Lookup without stats or marks.
    pub fn peek(&mut self, cl: u32, hash: u64, key: &[u8], now: u32) -> Option<ItemView<'_>> {
        self.get_inner(cl, hash, key, now, false)
    }

    /// Write a new item (value = `a ++ b`, header `bits`, CAS `cas` or the worker's next one)
    /// and replace `old` (if any) in the index.
    #[allow(clippy::too_many_arguments)]
    fn write_new(
        &mut self,
        cl: u32,
        hash: u64,
        key: &[u8],
        old: Option<(u32, u32)>,
        flags: u32,
        exp: u32,
        a: &[u8],
        b: &[u8],
        now: u32,
        (bits, cas): (u8, Option<u64>),
    ) -> Result<u64, StoreResult> {
        let vlen = a.len() + b.len();
        let size = footprint(key.len(), vlen);
        if size > self.m.cfg.max_item_size {
            return Err(StoreResult::TooLarge);
        }
        let gen = self.m.evict_gen;
        let (s, o) = self.alloc(cl, size)?;
        let c = self.cachelets[cl as usize].as_deref_mut().expect("owned");
        // The old copy may have been evicted while making room.
        let old = if gen != self.m.evict_gen { c.lookup(hash, key) } else { old };
        let cas = cas.unwrap_or_else(|| self.m.next_cas());
        {
            let seg = c.seg_mut(s);
            let v = It::write(&mut seg.buf, o as usize, hash, cas, exp, now, flags, key, vlen, bits);
            v[..a.len()].copy_from_slice(a);
            v[a.len()..].copy_from_slice(b);
        }
        c.commit(s, size);
        match old {
            Some((os, oo)) => {
                c.relink_index(hash, (os, oo), (s, o));
                if self.m.mark_dead(c, os, oo) {
                    self.m.free_seg(c, os);
                }
            }
            None => {
                c.insert_index(hash, s, o);
            }
        }
        self.m.st.total_items += 1;
        Ok(cas)
    }

    /// set/add/replace/append/prepend, with an optional CAS check (the `cas` command).
    #[allow(clippy::too_many_arguments)]
    pub fn store(
        &mut self,
        cl: u32,
        hash: u64,
        key: &[u8],
        value: &[u8],
        flags: u32,
        exptime: i64,
        mode: Mode,
        cas: Option<u64>,
        now: u32,
    ) -> StoreResult {
        let opts = CasOpts { compare: cas, ..CasOpts::default() };
        self.store_with(cl, hash, key, value, flags, exptime, mode, opts, now)
    }

    /// [`store`](Self::store) with the meta protocol's CAS options.
    #[allow(clippy::too_many_arguments)]
    pub fn store_with(
        &mut self,
        cl: u32,
        hash: u64,
        key: &[u8],
        value: &[u8],
        flags: u32,
        exptime: i64,
        mode: Mode,
        opts: CasOpts,
        now: u32,
    ) -> StoreResult {
        self.m.last_now = now;
        if !self.check_owned(cl) {
            return StoreResult::NotStored;
        }
        if key.len() > MAX_KEY {
            return StoreResult::TooLarge;
        }
        if footprint(key.len(), value.len()) > self.m.cfg.max_item_size {
            if mode == Mode::Set && opts.compare.is_none() {
                self.forget_after_failed_set(cl, hash, key, now);
            }
            return StoreResult::TooLarge;
        }
        self.m.st.cmd_set += 1;
        let c = self.cachelets[cl as usize].as_deref_mut().expect("owned");
        c.st.writes += 1;
        let found = match self.m.find_live(c, hash, key, now) {
            Found::Hit(s, o) => Some((s, o)),
            _ => None,
        };
        // (expiry, win bit) of the item a stale write replaces
        let mut stale_of = None;
        if let Some(want) = opts.compare {
            match found {
                None => {
                    self.m.st.cas_misses += 1;
                    return StoreResult::NotFound;
                }
                Some((s, o)) => {
                    let (b, o) = (&c.seg(s).buf, o as usize);
                    let have = It::cas(b, o);
                    if self.m.cfg.cas_enabled && have != want {
                        if !(opts.stale_if_older && want < have) {
                            self.m.st.cas_badval += 1;
                            return StoreResult::Exists;
                        }
                        stale_of = Some((It::exptime(b, o), It::bits(b, o) & WIN));
                    }
                    self.m.st.cas_hits += 1;
                }
            }
        }
        let fresh = (stale_of.map_or(0, |(_, win)| STALE | win), opts.new_cas);
        match (mode, found) {
            (Mode::Add, Some(_)) => return StoreResult::NotStored,
            (Mode::Replace | Mode::Append | Mode::Prepend, None) => return StoreResult::NotStored,
            _ => {}
        }
        let res = match mode {
            Mode::Append | Mode::Prepend => {
                let (s, o) = found.expect("checked");
                let mut tmp = std::mem::take(&mut self.m.scratch);
                tmp.clear();
                let (fl, exp) = {
                    let b = &c.seg(s).buf;
                    tmp.extend_from_slice(It::value(b, o as usize));
                    (It::flags(b, o as usize), It::exptime(b, o as usize))
                };
                let r = if mode == Mode::Append {
                    self.write_new(cl, hash, key, found, fl, exp, &tmp, value, now, fresh)
                } else {
                    self.write_new(cl, hash, key, found, fl, exp, value, &tmp, now, fresh)
                };
                self.m.scratch = tmp;
                r
            }
            _ => match stale_of.map(|(exp, _)| exp).or_else(|| rel_exptime(exptime, now, self.m.cfg.start_unix)) {
                Some(exp) => self.write_new(cl, hash, key, found, flags, exp, value, &[], now, fresh),
                None => {
                    // Stored already expired: equivalent to removing the old copy.
                    if let Some((s, o)) = found {
                        self.m.unlink(c, s, o, true);
                    }
                    Ok(self.m.next_cas())
                }
            },
        };
        match res {
            Ok(cas) => StoreResult::Stored { cas: self.m.shown_cas(cas) },
            Err(e) => {
                if mode == Mode::Set && opts.compare.is_none() {
                    self.forget_after_failed_set(cl, hash, key, now);
                }
                e
            }
        }
    }

    /// A `set` that could not be stored (too large, out of memory) removes
    /// the old value, as memcached does ("avoid stale data persisting in
    /// cache because we failed alloc"): a reader never gets the value the
    /// client meant to replace.
    fn forget_after_failed_set(&mut self, cl: u32, hash: u64, key: &[u8], now: u32) {
        let c = self.cachelets[cl as usize].as_deref_mut().expect("owned");
        if let Found::Hit(s, o) = self.m.find_live(c, hash, key, now) {
            self.m.unlink(c, s, o, true);
        }
    }

    pub fn delete(&mut self, cl: u32, hash: u64, key: &[u8], cas: Option<u64>, now: u32) -> DeleteResult {
        self.m.last_now = now;
        if !self.check_owned(cl) {
            return DeleteResult::NotFound;
        }
        let c = self.cachelets[cl as usize].as_deref_mut().expect("owned");
        c.st.writes += 1;
        let Found::Hit(s, o) = self.m.find_live(c, hash, key, now) else {
            self.m.st.delete_misses += 1;
            return DeleteResult::NotFound;
        };
        if let Some(want) = cas {
            if self.m.cfg.cas_enabled && It::cas(&c.seg(s).buf, o as usize) != want {
                return DeleteResult::Exists;
            }
        }
        self.m.unlink(c, s, o, true);
        self.m.st.delete_hits += 1;
        DeleteResult::Deleted
    }

    /// incr/decr: incr wraps at 2^64, decr floors at 0; in place when the digits fit.
    pub fn arith(&mut self, cl: u32, hash: u64, key: &[u8], incr: bool, delta: u64, now: u32) -> ArithResult {
        self.m.last_now = now;
        if !self.check_owned(cl) {
            return ArithResult::NotFound;
        }
        let c = self.cachelets[cl as usize].as_deref_mut().expect("owned");
        c.st.writes += 1;
        let Found::Hit(s, o) = self.m.find_live(c, hash, key, now) else {
            if incr {
                self.m.st.incr_misses += 1;
            } else {
                self.m.st.decr_misses += 1;
            }
            return ArithResult::NotFound;
        };
        let ou = o as usize;
        let (cur, vlen, slack, fl, exp) = {
            let b = &c.seg(s).buf;
            (parse_u64(It::value(b, ou)), It::vlen(b, ou), It::slack(b, ou), It::flags(b, ou), It::exptime(b, ou))
        };
        let Some(cur) = cur else {
            return ArithResult::NonNumeric;
        };
        if incr {
            self.m.st.incr_hits += 1;
        } else {
            self.m.st.decr_hits += 1;
        }
        let new = if incr { cur.wrapping_add(delta) } else { cur.saturating_sub(delta) };
        let mut nb = itoa::Buffer::new();
        let digits = nb.format(new).as_bytes();
        if digits.len() <= vlen && slack + (vlen - digits.len()) <= u16::MAX as usize {
            let cas = self.m.next_cas();
            let seg = c.seg_mut(s);
            It::value_mut(&mut seg.buf, ou)[..digits.len()].copy_from_slice(digits);
            It::shrink_value(&mut seg.buf, ou, digits.len());
            It::set_cas(&mut seg.buf, ou, cas);
            return ArithResult::Value { value: new, cas: self.m.shown_cas(cas) };
        }
        let digits = digits.to_vec();
        match self.write_new(cl, hash, key, Some((s, o)), fl, exp, &digits, &[], now, (0, None)) {
            Ok(cas) => ArithResult::Value { value: new, cas: self.m.shown_cas(cas) },
            // Could not reallocate: memcached answers an error; the item is unchanged.
            Err(_) => ArithResult::NotFound,
        }
    }

    /// Set a new exptime; returns the item. A negative/past exptime expires it (the view is
    /// still returned, the item is gone afterwards).
    pub fn touch(&mut self, cl: u32, hash: u64, key: &[u8], exptime: i64, now: u32) -> Option<ItemView<'_>> {
        self.m.last_now = now;
        if !self.check_owned(cl) {
            return None;
        }
        self.m.st.cmd_touch += 1;
        let c = self.cachelets[cl as usize].as_deref_mut().expect("owned");
        c.st.reads += 1;
        let Found::Hit(s, o) = self.m.find_live(c, hash, key, now) else {
            self.m.st.touch_misses += 1;
            c.st.misses += 1;
            return None;
        };
        self.m.st.touch_hits += 1;
        c.st.hits += 1;
        let ou = o as usize;
        let exp = rel_exptime(exptime, now, self.m.cfg.start_unix);
        let bits = It::bits(&c.seg(s).buf, ou);
        let last = It::last_access(&c.seg(s).buf, ou);
        {
            let seg = c.seg_mut(s);
            It::set_exptime(&mut seg.buf, ou, exp.unwrap_or(now));
            It::set_last_access(&mut seg.buf, ou, now);
            It::set_bits(&mut seg.buf, ou, bits | FETCHED);
        }
        if exp.is_none() {
            // Remove now but keep the segment (it is freed by sweep or eviction) for the view.
            self.m.unlink(c, s, o, false);
        }
        let seg = c.seg(s);
        let cas = self.m.shown_cas(It::cas(&seg.buf, ou));
        let mut v = view(&seg.buf, ou, cas, bits, last);
        v.stale = bits & STALE != 0;
        Some(v)
    }

    /// Change item bits in place (meta protocol: invalidate/stale, win token, ttl).
    /// Returns false if the item is missing.
    pub fn update(&mut self, cl: u32, hash: u64, key: &[u8], now: u32, f: impl FnOnce(&mut MetaBits)) -> bool {
        self.m.last_now = now;
        if !self.check_owned(cl) {
            return false;
        }
        let c = self.cachelets[cl as usize].as_deref_mut().expect("owned");
        let Found::Hit(s, o) = self.m.find_live(c, hash, key, now) else {
            return false;
        };
        let ou = o as usize;
        let seg = c.seg_mut(s);
        let b = &mut seg.buf;
        let bits = It::bits(b, ou);
        let shown = if self.m.cfg.cas_enabled { It::cas(b, ou) } else { 0 };
        let mut mb =
            MetaBits { exptime: It::exptime(b, ou), stale: bits & STALE != 0, win: bits & WIN != 0, cas: shown };
        f(&mut mb);
        It::set_exptime(b, ou, mb.exptime);
        let mut nbits = bits & !(STALE | WIN);
        if mb.stale {
            nbits |= STALE;
        }
        if mb.win {
            nbits |= WIN;
        }
        It::set_bits(b, ou, nbits);
        if mb.cas != shown {
            It::set_cas(b, ou, mb.cas);
        }
        true
    }

    /// A fresh CAS value from this worker's counter (e.g. for `md ... I`, which bumps the CAS
    /// of the item it invalidates). 0 with CAS disabled.
    pub fn new_cas(&mut self) -> u64 {
        let c = self.m.next_cas();
        self.m.shown_cas(c)
    }

    /// memcached flush_all: once `now >= at`, every item set before second `at`, or in second
    /// `at` before this call, is invalid (so an immediate `flush_all(now)` spares items stored
    /// after it in the same second, like memcached's oldest_cas).
    pub fn flush_all(&mut self, at: u32) {
        let ctr = self.m.cas_ctr;
        let now = self.m.last_now;
        for c in self.cachelets.iter_mut().flatten() {
            c.flushes.push((at, ctr));
            let f = std::mem::take(&mut c.flushes);
            // X is covered by a later Y with X.at <= Y.at once Y is in effect (Y.at <= now).
            c.flushes = f
                .iter()
                .enumerate()
                .filter(|&(i, x)| !f[i + 1..].iter().any(|y| x.0 <= y.0 && y.0 <= now))
                .map(|(_, x)| *x)
                .collect();
            if c.flushes.len() > MAX_FLUSHES {
                c.flushes.remove(0);
            }
        }
    }

    /// Incremental maintenance: walk up to ~`budget` segments+items from a cursor, drop
    /// expired/flushed items, free empty segments and compact mostly-dead ones.
    /// Returns the number of segments and items examined.
    pub fn sweep(&mut self, now: u32, budget: usize) -> usize {
        self.m.last_now = now;
        if self.m.global.pages_wanted() > 0 {
            self.help_starving();
        }
        let mut examined = 0;
        let mut wrapped = false;
        while examined < budget {
            let next = match self.m.sweep_cursor {
                Some(k) => self.m.order.range((Bound::Excluded(k), Bound::Unbounded)).next().copied(),
                None => self.m.order.first().copied(),
            };
            let Some(key) = next else {
                if wrapped || self.m.order.is_empty() {
                    break;
                }
                wrapped = true;
                self.m.sweep_cursor = None;
                continue;
            };
            self.m.sweep_cursor = Some(key);
            examined += 1;
            let (_, cl, s) = key;
            let c = self.cachelets[cl as usize].as_deref_mut().expect("owned");
            let mut offs = std::mem::take(&mut self.m.offs);
            offs.clear();
            {
                let seg = c.seg(s);
                let mut o = 0;
                while o < seg.used {
                    if It::bits(&seg.buf, o) & DEAD == 0 {
                        examined += 1;
                        if c.liveness(s, o as u32, now) != Liveness::Live {
                            offs.push(o as u32);
                        }
                    }
                    o += It::size(&seg.buf, o);
                }
            }
            for &o in &offs {
                self.m.count_reclaim(c, s, o);
                self.m.unlink(c, s, o, false);
            }
            self.m.offs = offs;
            if c.open == Some(s) {
                continue;
            }
            let (live, dead, used, large) = {
                let seg = c.seg(s);
                (seg.live_items, seg.dead_bytes, seg.used, seg.large_pages)
            };
            if live == 0 {
                self.m.free_seg(c, s);
            } else if large == 0 && dead * 4 >= used * 3 {
                examined += self.compact(cl, s);
            }
        }
        examined
    }

    /// Move the live items of a mostly-dead segment to the open segment; frees it if done.
    fn compact(&mut self, cl: u32, s: u32) -> usize {
        let c = self.cachelets[cl as usize].as_deref_mut().expect("owned");
        let mut offs = std::mem::take(&mut self.m.offs);
        offs.clear();
        {
            let seg = c.seg(s);
            seg.live_offsets(&mut offs);
        }
        let n = offs.len();
        let mut moved = 0;
        for &o in &offs {
            if self.relocate(cl, s, o).is_none() {
                break;
            }
            moved += 1;
        }
        self.m.offs = offs;
        self.m.st.items_compacted += moved as u64;
        if moved == n {
            self.m.st.segments_compacted += 1;
        }
        moved
    }

    /// Give at least `n` pages back to the global pool: local free pages first, then by
    /// evicting the oldest segments. Returns pages given back.
    pub fn shed_pages(&mut self, n: usize) -> usize {
        let mut given = 0;
        while given < n {
            if !self.m.local_free.is_empty() {
                let k = self.m.local_free.len().min(n - given);
                let at = self.m.local_free.len() - k;
                self.m.global.give(self.m.local_free.drain(at..));
                given += k;
                continue;
            }
            if !self.evict_segment(false) {
                break;
            }
        }
        given
    }

    /// `stats reset`: zero the command and eviction counters (what memcached
    /// resets); item counts, bytes and pages are state, not counters.
    pub fn reset_stats(&mut self) {
        let keep = WorkerStats { limit_maxbytes: self.m.st.limit_maxbytes, ..WorkerStats::default() };
        self.m.st = keep;
        // Per-cachelet counters are the balancer's, not memcached's: kept.
    }

    pub fn stats(&self) -> WorkerStats {
        let mut st = self.m.st;
        st.curr_items = 0;
        st.bytes = 0;
        st.owned_cachelets = 0;
        st.hash_bytes = 0;
        for c in self.cachelets.iter().flatten() {
            st.curr_items += c.st.items;
            st.bytes += c.st.bytes;
            st.owned_cachelets += 1;
            st.hash_bytes += c.index.heap_bytes() as u64;
            debug_assert_eq!(c.index.len() as u64, c.st.items, "index and item count agree");
        }
        st.local_free_pages = self.m.local_free.len() as u64;
        st.pages_held = (self.m.local_free.len() + self.m.seg_pages + self.m.large_pages) as u64;
        st.segments = self.m.order.len() as u64;
        st
    }

    /// The shared global pool.
    pub fn global(&self) -> &Arc<GlobalPool> {
        &self.m.global
    }

    /// Drop an owned cachelet and all its items, returning its pages to this worker's pool
    /// (e.g. after its items were migrated to another server). False if not owned.
    pub fn discard_cachelet(&mut self, id: u32) -> bool {
        let Some(mut c) = self.cachelets.get_mut(id as usize).and_then(|c| c.take()) else {
            return false;
        };
        for s in 0..c.segs.len() as u32 {
            if c.segs[s as usize].is_some() {
                self.m.free_seg(&mut c, s);
            }
        }
        true
    }
}

impl Drop for WorkerStore {
    /// Give every page (local free, segments, large-item charges) back to the global pool so
    /// that its accounting stays exact when a worker goes away.
    fn drop(&mut self) {
        for c in self.cachelets.iter_mut().flatten() {
            for seg in c.segs.iter_mut().filter_map(|s| s.take()) {
                if seg.large_pages > 0 {
                    self.m.global.release_large(seg.large_pages);
                } else {
                    self.m.local_free.push(seg.buf);
                }
            }
        }
        self.m.global.give(self.m.local_free.drain(..));
    }
}

#[cfg(test)]
mod tests;
