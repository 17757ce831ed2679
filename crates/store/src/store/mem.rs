//! A worker's item memory: the pages it holds, segments of a cachelet,
//! allocation of small and large items, liveness accounting and CAS
//! numbers (`Mem`).

use super::*;

impl Mem {
    /// Mark an item dead and note its segment as a compaction candidate when
    /// its dead fraction crosses into a higher bucket. True if the (sealed)
    /// segment is now empty.
    pub(super) fn mark_dead(&mut self, c: &mut Cachelet, s: u32, o: u32) -> bool {
        let before = c.seg(s).dead_bytes;
        self.sizes_count(c, s, o, -1);
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
    pub(super) fn compact_bucket(&self) -> usize {
        if self.cfg.evict {
            COMPACT_BUCKET
        } else {
            1
        }
    }

    pub(super) fn held(&self) -> usize {
        self.local_free.len() + self.seg_pages + self.large_pages
    }

    /// This worker's fair share of the budget.
    pub(super) fn fair_share(&self) -> usize {
        self.global.total_pages() / self.cfg.workers.max(1)
    }

    /// Pages a worker at or above its fair share leaves in the global pool,
    /// so a worker that has nothing to evict yet (its traffic just started)
    /// is served at once instead of failing until others shed pages.
    pub(super) fn reserve_for_others(&self) -> usize {
        let others = self.cfg.workers.max(1) - 1;
        let floor = (self.fair_share() / 8).max(2 * self.cfg.refill_pages.max(1));
        (others * floor).min(self.global.total_pages() / 2)
    }

    pub(super) fn get_page(&mut self) -> Option<Page> {
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

    pub(super) fn maybe_return(&mut self) {
        if self.local_free.len() > self.cfg.local_high_pages
            && self.global.available_pages() < self.cfg.global_low_pages
        {
            let keep = self.cfg.refill_pages.min(self.cfg.local_high_pages);
            self.global.give(self.local_free.drain(keep..));
        }
    }

    #[inline]
    pub(super) fn next_cas(&mut self) -> u64 {
        self.cas_ctr += 1;
        (self.cas_ctr << 16) | self.cfg.worker_id as u64
    }

    #[inline]
    pub(super) fn shown_cas(&self, cas: u64) -> u64 {
        if self.cfg.cas_enabled {
            cas
        } else {
            0
        }
    }

    pub(super) fn new_segment(&mut self, c: &mut Cachelet, buf: Box<[u8]>, large_pages: usize) -> u32 {
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

    pub(super) fn free_seg(&mut self, c: &mut Cachelet, s: u32) {
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
    pub(super) fn unlink(&mut self, c: &mut Cachelet, s: u32, o: u32, free_empty: bool) {
        let hash = It::hash(&c.seg(s).buf, o as usize);
        c.remove_index(hash, s, o);
        if self.mark_dead(c, s, o) && free_empty {
            self.free_seg(c, s);
        }
    }

    pub(super) fn count_reclaim(&mut self, c: &Cachelet, s: u32, o: u32) {
        self.st.reclaimed += 1;
        if It::bits(&c.seg(s).buf, o as usize) & FETCHED == 0 {
            self.st.expired_unfetched += 1;
        }
    }

    pub(super) fn find_live(&mut self, c: &mut Cachelet, hash: u64, key: &[u8], now: u32) -> Found {
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
    pub(super) fn alloc_small(&mut self, c: &mut Cachelet, size: usize) -> Option<(u32, u32)> {
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

    pub(super) fn try_large(&mut self, c: &mut Cachelet, size: usize) -> Option<(u32, u32)> {
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
