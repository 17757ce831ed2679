//! Making room: allocation with eviction, compaction of mostly dead
//! segments, reclaiming dead room under `-M`, relocation of items read since
//! written, the expiry sweep and shedding pages to the global pool.

use super::*;

impl WorkerStore {
    /// Evict the worker's oldest segment. False if it has none.
    pub(super) fn evict_one(&mut self) -> bool {
        self.evict_segment(true)
    }

    /// The most-dead segment that is at least `compact_bucket()` tenths dead.
    pub(super) fn compaction_candidate(&mut self) -> Option<(u64, u32, u32)> {
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
    pub(super) fn evict_segment(&mut self, retain: bool) -> bool {
        let pick = if retain { self.compaction_candidate() } else { None };
        self.empty_segment(pick, retain)
    }

    /// Make room without dropping a live item (memcached `-M`): compact the
    /// most-dead segment if one is at least a tenth dead,
    /// else compact the oldest segment if it holds an expired or flushed
    /// item (memcached reclaims those at its LRU tail before failing a
    /// store). False if neither frees anything.
    pub(super) fn reclaim_dead(&mut self) -> bool {
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
    pub(super) fn empty_segment(&mut self, pick: Option<(u64, u32, u32)>, retain: bool) -> bool {
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
                self.m.sizes_count(c, s, o, -1);
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
                self.m.sizes_count(c, s, o, -1);
                self.m.st.evictions += 1;
                if !fetched {
                    self.m.st.evicted_unfetched += 1;
                }
                if self.log.wants(super::log::EVICTIONS) {
                    let (b, o) = (&c.seg(s).buf, o as usize);
                    let exp = It::exptime(b, o);
                    let ttl = if exp == 0 { -1 } else { i64::from(exp) - i64::from(now) };
                    let la = now.saturating_sub(It::last_access(b, o));
                    let cls = u32::from(self.m.cfg.worker_id) + 1;
                    self.log.evict(It::key(b, o), fetched, ttl, la, cls, It::vlen(b, o));
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
                self.m.sizes_count_at(&kept_bytes[at..at + sz], 0, c.sized, -1);
                self.m.st.evictions += 1;
                if self.log.wants(super::log::EVICTIONS) {
                    let b = &kept_bytes[at..at + sz];
                    let exp = It::exptime(b, 0);
                    let ttl = if exp == 0 { -1 } else { i64::from(exp) - i64::from(now) };
                    let (fetched, la) = (It::bits(b, 0) & FETCHED != 0, now.saturating_sub(It::last_access(b, 0)));
                    let cls = u32::from(self.m.cfg.worker_id) + 1;
                    self.log.evict(It::key(b, 0), fetched, ttl, la, cls, It::vlen(b, 0));
                }
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
    pub(super) fn alloc(&mut self, cl: u32, size: usize) -> Result<(u32, u32), StoreResult> {
        let large = size > self.m.cfg.page_size;
        if large && size.div_ceil(self.m.cfg.page_size) > self.m.global.total_pages() {
            return Err(StoreResult::OutOfMemory);
        }
        let seq_before = self.m.next_seq;
        // `-M`, once full: an item as large as one refused is refused by every worker, even
        // where its cachelet's open segment still has room for it (memcached keeps refusing
        // an item of a full slab class; what is freed, or a smaller item, may still fit).
        let mut refused = !self.m.cfg.evict && self.m.local_free.is_empty() && self.m.global.refuses(size);
        loop {
            let c = self.cachelets[cl as usize].as_deref_mut().expect("owned");
            let got = if std::mem::take(&mut refused) {
                None
            } else if large {
                self.m.try_large(c, size)
            } else {
                self.m.alloc_small(c, size)
            };
            if let Some(l) = got {
                if !self.m.cfg.evict && self.m.global.refuses(size) {
                    // An item as large as the one refused fits again (a page was freed here).
                    self.m.global.set_refused(None);
                }
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
            if made_room {
                if !self.m.cfg.evict {
                    self.m.global.set_refused(None);
                }
            } else {
                if self.m.cfg.evict {
                    // Nothing of ours to evict: ask the other workers to shed pages.
                    self.m.global.want(self.m.cfg.refill_pages.max(1));
                } else if self.m.global.available_pages() == 0 && self.m.local_free.is_empty() {
                    // Out of pages, not just this item too large for what is left.
                    self.m.global.set_refused(Some(size));
                }
                self.m.st.out_of_memory += 1;
                return Err(StoreResult::OutOfMemory);
            }
        }
    }

    /// Another worker starves (no free page anywhere, nothing of its own to evict): give back
    /// up to one refill's worth of pages, evicting our oldest segments if needed. Never gives
    /// away the segments that hold its own open items beyond the oldest ones.
    pub(super) fn help_starving(&mut self) {
        let n = self.m.global.pages_wanted().min(self.m.cfg.refill_pages.max(1));
        // Only a worker above its fair share gives pages away, and it keeps
        // at least a few segments so that it does not starve in turn.
        if self.m.held() > self.m.fair_share() && self.m.order.len() > n + 2 * self.owned_count() {
            self.shed_pages(n);
        }
    }

    pub(super) fn owned_count(&self) -> usize {
        self.cachelets.iter().filter(|c| c.is_some()).count()
    }

    /// Copy a live item to its cachelet's open segment without evicting. New location or None.
    pub(super) fn relocate(&mut self, cl: u32, s: u32, o: u32) -> Option<(u32, u32)> {
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
            c.sizes_moved(s, o);
            if self.m.mark_dead(c, s, o) {
                self.m.free_seg(c, s);
            }
            (ns, no)
        });
        self.m.scratch = tmp;
        res
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
    pub(super) fn compact(&mut self, cl: u32, s: u32) -> usize {
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
}
