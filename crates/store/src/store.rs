//! Cachelets (index + segments) and the per-worker store: lookups and writes here; item memory in `store/mem.rs`, making room (eviction, compaction, sweep) in `store/evict.rs`, the counters in `store/stats.rs`. See the crate docs for the design.

use crate::index::Index;
use crate::item::{footprint, It, ACCESSED, DEAD, FETCHED, MAX_KEY, SIZED, STALE, WIN};
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
    /// The `stats sizes` table its items' `SIZED` marks were made under (0: none).
    sized: u64,
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
            sized: 0,
            pool: None,
        })
    }

    pub fn id(&self) -> u32 {
        self.id
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
    /// This worker's view of the `stats sizes` switch (`store/sizes.rs`).
    sizes: Option<Arc<SizeHist>>,
    sizes_seen: u64,
}

/// One worker's store: the cachelets it owns and its local page pool. Single-threaded.
/// Aligned to 128 bytes so that two workers' stores never share a cache line (its counters
/// are written on every operation).
#[repr(align(128))]
pub struct WorkerStore {
    cachelets: Vec<Option<Box<Cachelet>>>,
    m: Mem,
    /// Phase 1's view of the traffic: key samples and writes to replicated keys.
    watch: KeyWatch,
    /// `watch` log streaming: the lines of the events watchers want.
    log: EventLog,
    /// A cachelet on its way to another server: the keys written in it (`moving`).
    moving: Option<moving::Moving>,
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
                sizes: None,
                sizes_seen: 0,
            },
            watch: KeyWatch::default(),
            log: EventLog::default(),
            moving: None,
        }
    }

    /// The `watch` event lines ([`EventLog`]).
    pub fn log(&mut self) -> &mut EventLog {
        &mut self.log
    }

    /// memcached's slab class id of this store's items in logs and dumps: the worker + 1.
    fn class(&self) -> u32 {
        u32::from(self.m.cfg.worker_id) + 1
    }

    /// Phase 1's sampler and watched keys ([`KeyWatch`]).
    /// Were watched (replicated) keys written since the copies were last sent?
    pub fn has_dirty(&self) -> bool {
        self.watch.has_dirty()
    }

    pub fn watch(&mut self) -> &mut KeyWatch {
        &mut self.watch
    }

    pub fn config(&self) -> &StoreConfig {
        &self.m.cfg
    }

    /// Adopt a cachelet (pointer move; its pages come with it).
    pub fn insert_cachelet(&mut self, mut c: Box<Cachelet>) {
        self.sizes_arrive(&mut c);
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
        self.sizes_check();
        let mut c = self.cachelets.get_mut(id as usize)?.take()?;
        if self.moving() == Some(id) {
            self.stop_moving();
        }
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

    /// Start loading the item a lookup of `hash` in cachelet `cl` will most likely read: the
    /// first item its index line names under the hash's tag (the line should already be in
    /// cache from an earlier `prefetch`; reading it is the only cost). Two lines of the item,
    /// its header and key and the start of its value. Nothing if the cachelet is not here or
    /// no slot matches.
    #[inline]
    pub fn prefetch_item(&self, cl: u32, hash: u64) {
        let Some(Some(c)) = self.cachelets.get(cl as usize) else { return };
        let Some((s, o)) = c.index.guess(hash) else { return };
        let Some(Some(seg)) = c.segs.get(s as usize) else { return };
        let o = o as usize;
        if let Some(line) = seg.buf.get(o..) {
            prefetch_line(line.as_ptr());
            if let Some(next) = line.get(64..) {
                prefetch_line(next.as_ptr());
            }
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
            self.watch.read(key);
        }
        let (s, o) = match r {
            Found::Hit(s, o) => (s, o),
            other => {
                if bump && self.log.wants(log::FETCHERS) {
                    self.log.fetch(key, None);
                }
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
        if bump && self.log.wants(log::FETCHERS) {
            let cls = u32::from(self.m.cfg.worker_id) + 1;
            self.log.fetch(key, Some((cls, It::vlen(&seg.buf, o))));
        }
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
        self.sizes_check();
        let bits = bits & !SIZED;
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
        self.sizes_written(cl, s, o);
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
        let r = self.store_inner(cl, hash, key, value, flags, exptime, mode, opts, now);
        if self.log.wants(log::MUTATIONS) {
            let status = match r {
                StoreResult::Stored { .. } => "stored",
                StoreResult::Exists => "exists",
                StoreResult::NotFound => "not_found",
                StoreResult::TooLarge => "too_large",
                StoreResult::OutOfMemory => "no_memory",
                _ => "not_stored",
            };
            let cmd = match (mode, opts.compare) {
                (_, Some(_)) => "cas",
                (Mode::Set, None) => "set",
                (Mode::Add, None) => "add",
                (Mode::Replace, None) => "replace",
                (Mode::Append, None) => "append",
                (Mode::Prepend, None) => "prepend",
            };
            // As memcached: a stored item's own time to live and size (an append's whole
            // value), else the request's.
            let ttl_of = |e: u32| if e == 0 { 0 } else { i64::from(e) - i64::from(now) };
            let stored = match r {
                StoreResult::Stored { .. } => self.peek(cl, hash, key, now).map(|v| (ttl_of(v.exptime), v.value.len())),
                _ => None,
            };
            let (ttl, size) = stored.unwrap_or_else(|| {
                let e = rel_exptime(exptime, now, self.m.cfg.start_unix);
                (e.map_or(-1, ttl_of), value.len())
            });
            let cls = self.class();
            self.log.store(key, status, cmd, ttl, cls, size);
        }
        r
    }

    #[allow(clippy::too_many_arguments)]
    fn store_inner(
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
        self.watch.write(hash, key);
        self.note_write(cl, hash, key);
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
        self.watch.write(hash, key);
        self.note_write(cl, hash, key);
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
        self.watch.write(hash, key);
        self.note_write(cl, hash, key);
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
            self.m.sizes_count(c, s, o, -1);
            let seg = c.seg_mut(s);
            It::value_mut(&mut seg.buf, ou)[..digits.len()].copy_from_slice(digits);
            It::shrink_value(&mut seg.buf, ou, digits.len());
            It::set_cas(&mut seg.buf, ou, cas);
            self.m.sizes_count(c, s, o, 1);
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
        self.watch.read(key);
        self.note_write(cl, hash, key);
        let c = self.cachelets[cl as usize].as_deref_mut().expect("owned");
        c.st.reads += 1;
        let Found::Hit(s, o) = self.m.find_live(c, hash, key, now) else {
            self.m.st.touch_misses += 1;
            c.st.misses += 1;
            if self.log.wants(log::FETCHERS) {
                self.log.fetch(key, None);
            }
            return None;
        };
        self.m.st.touch_hits += 1;
        c.st.hits += 1;
        let ou = o as usize;
        if self.log.wants(log::FETCHERS) {
            let cls = u32::from(self.m.cfg.worker_id) + 1;
            self.log.fetch(key, Some((cls, It::vlen(&c.seg(s).buf, ou))));
        }
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
        self.note_write(cl, hash, key);
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
        self.note_flush();
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
        self.sizes_discard(&c);
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

mod evict;
mod export;
pub mod log;
mod moving;
mod watch;
pub use export::{ExportedItem, ItemMeta, ItemRef};
pub use log::EventLog;
pub use moving::DeltaItem;
pub use watch::KeyWatch;
mod mem;
mod sizes;
mod stats;
pub use sizes::{memcached_item_size, SIZES_BUCKET};
pub(crate) use sizes::{SizeHist, SizesSwitch};
pub use stats::{CacheletStats, WorkerStats};
#[cfg(test)]
mod tests;

/// A hint to the CPU to load the cache line holding `p`.
#[inline(always)]
fn prefetch_line(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing the program sees and cannot fault; `p` points into a
    // live buffer anyway.
    #[allow(unused_unsafe)]
    unsafe {
        std::arch::x86_64::_mm_prefetch(p as *const i8, std::arch::x86_64::_MM_HINT_T0);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}
