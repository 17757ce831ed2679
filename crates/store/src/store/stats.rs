//! Statistics: a cachelet's counters (the balancer's) and a worker's (memcached's names).

use super::*;

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
    /// The item size histogram is on (`stats sizes_enable`; memcached's `track_sizes`).
    pub track_sizes: bool,
}

impl Cachelet {
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
}

impl WorkerStore {
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
        st.track_sizes = self.m.global.sizes_on();
        st
    }
}
