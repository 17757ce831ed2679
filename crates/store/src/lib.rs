//! mbal-store: the cachelet store (MBal §2.1–2.4, with segcache-style item memory).
//!
//! # Memory hierarchy
//! * [`GlobalPool`] (one per server, behind an `Arc`) holds the `-m` budget as fixed-size pages
//!   (default 64 KiB). Page buffers are allocated lazily on first use and recycled; at most
//!   `mem_limit / page_size` pages exist (pages charged for large items included). It is the only
//!   lock, a `Mutex` touched once per bulk refill/return, never per operation.
//! * [`WorkerStore`] (one per worker thread) keeps a local free-page pool. When empty it takes
//!   `refill_pages` pages at once; when a page is freed and it holds more than `local_high_pages`
//!   free pages while the global pool has fewer than `global_low_pages` available, it gives the
//!   excess back in bulk (MBal's THR_MEM_HIGH_THRESH / GLOB_MEM_LOW_THRESH).
//! * A [`Cachelet`] owns its pages as append-only *segments* (log-structured, like Pelikan's
//!   segcache) plus its index. So moving a cachelet between workers
//!   ([`WorkerStore::take_cachelet`] / [`WorkerStore::insert_cachelet`]) moves a `Box` and
//!   copies no item.
//!
//! # Items
//! An item is written at the end of its cachelet's open segment: a 40-byte header (key hash,
//! 64-bit CAS, exptime, set time, last access, client flags, value length, key length, bits
//! dead/fetched/stale/win, slack), then key, then value, padded to 8 bytes. Overwrites and deletes
//! mark the old copy dead and count its bytes as dead in its segment; a segment with no live item
//! is freed at once (unless it is the open one), a mostly-dead segment is compacted by
//! [`WorkerStore::sweep`]. Items larger than a page get a dedicated "large" segment sized to
//! the item, charged as `ceil(size / page)` pages against the same budget.
//!
//! # Index
//! Per cachelet an [`index`](crate::index) of its own: bucketized open addressing, one 64-byte
//! line per bucket holding a displacement count and 7 slots of `{16-bit hash tag, segment
//! slot, offset / 8}`, linear probing between buckets, no tombstones. A lookup reads one line
//! of index and then the item (whose header holds the full hash and the key). The caller's
//! hash (computed once per request with `mbal_cluster::key_hash`) picks the bucket from its
//! low bits and the tag from its top 16; the VN uses bits 32.., so they do not correlate.
//! Index memory is outside the page budget: 64 bytes per 7 slots, at most 7/8 full, so
//! ~10–21 bytes per item.
//!
//! # Eviction (approximate LRU, per worker)
//! All segments of the worker's cachelets are ordered by creation sequence. When a worker finds
//! no free page locally nor globally it evicts its oldest segment (FIFO), removing its live items
//! from their index. Before that it compacts instead if some segment is at least 20% dead
//! (the most-dead one: its live items are copied into the open segment, so the dead bytes
//! come back without losing an item). Eviction is CLOCK-like: a GET sets the item's accessed
//! bit (writing the header only if a mark changes); evicting a segment keeps its accessed
//! items (up to half a page, bit cleared) by copying them forward, and drops the rest.
//! With `evict = false` (memcached `-M`) a full store never drops a live item: it compacts a
//! segment at least a tenth dead, or the oldest segment if it holds expired or flushed items,
//! and otherwise answers `OutOfMemory`. A `set` that fails (too large, out of memory) removes
//! the value it was to replace, as memcached does.
//! A worker that finds no page anywhere and owns no segment to evict (e.g. it just got fresh
//! cachelets while other workers filled the budget) answers `OutOfMemory` and records the
//! request in the pool ([`GlobalPool::pages_wanted`]); the other workers notice it the next
//! time they open a segment or run [`WorkerStore::sweep`], and shed a refill's worth of pages
//! (evicting their oldest segments). So the starving worker recovers within one sweep period;
//! the server should call `sweep` on every worker periodically (e.g. every 100 ms).
//!
//! # Time, expiry, flush
//! `now` is whole seconds since process start. Stored exptimes are `now`-based (0 = never);
//! see [`rel_exptime`] for memcached's conversion. Expired items are misses and are reclaimed
//! when looked up; [`WorkerStore::sweep`] walks segments incrementally to drop expired/flushed
//! items and to free/compact mostly-dead segments. `flush_all(at)` follows memcached's
//! `oldest_live`: once `now >= at`, every item set before second `at` is invalid, and so is
//! every item set in second `at` *before the flush call* (the CAS counter at the call is
//! recorded, like memcached's `oldest_cas`), so an immediate `flush_all(now)` spares items
//! stored after it in the same second. Flush state lives in each cachelet and travels with it.
//!
//! # CAS
//! `cas = (per-worker counter << 16) | worker_id`: unique across the workers of a server (and
//! across a cluster if worker ids are made unique). On `insert_cachelet` the worker's counter is
//! raised above every CAS the cachelet has seen, so counters stay monotone per cachelet. With
//! `cas_enabled = false` (memcached `-C`) reported CAS values are 0 and a `cas` operation on an
//! existing item always matches (memcached behaves the same way).
//!
//! # Threads
//! None. A `WorkerStore` is used by one thread; a `Cachelet` is `Send`. Both are aligned to
//! 128 bytes so that the per-op counters of different workers never share a cache line.
//!
//! # Notes for callers
//! * Keys longer than 250 bytes and items whose footprint exceeds `max_item_size` get
//!   `TooLarge`; an item larger than the whole budget gets `OutOfMemory`.
//! * `arith` that must grow the value and cannot allocate (only with `evict = false`) answers
//!   `NotFound` and leaves the item unchanged.
//! * `touch` with a negative/past exptime returns the item's view and removes it.
//! * `update` takes `MetaBits::exptime` as a `now`-based second (use [`rel_exptime`]); it does
//!   not delete on an expired value — the caller deletes.
//! * A dropped `WorkerStore`, and a `Cachelet` dropped after `take_cachelet`, return their
//!   pages to the global pool ([`WorkerStore::discard_cachelet`] returns them to the worker's
//!   local pool instead). A cachelet may only be inserted into stores of the same pool.
//! * The index grows by doubling, re-reading each item's hash from its header: a one-off
//!   pause proportional to the cachelet's item count, bounded by keeping many cachelets per
//!   worker.
//! * `benches/scaling.rs` compares this design with one global lock and striped locks
//!   (MBal Fig. 5, no network).

mod index;

/// Most pages a pool may have (`mem_limit / page_size`): the index addresses a cachelet's
/// segments with 24 bits. 16M pages is 1 TiB at the default 64 KiB page.
pub const MAX_PAGES: usize = index::MAX_SEG as usize + 1;
/// Largest page: item offsets in the index are 24 bits of 8-byte units.
pub const MAX_PAGE_SIZE: usize = index::MAX_OFF as usize + 8;
mod item;
mod pool;
mod store;
pub mod wire;

pub use pool::{GlobalPool, PoolStats};
pub use store::{
    log, memcached_item_size, Cachelet, CacheletStats, DeltaItem, EventLog, ExportedItem, ItemMeta, ItemRef, KeyWatch,
    WorkerStats, WorkerStore, SIZES_BUCKET,
};

/// Memcached's relative/absolute exptime boundary: 30 days.
pub const REALTIME_MAXDELTA: i64 = 60 * 60 * 24 * 30;

/// Per-worker store configuration.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// `-m`: total budget in bytes (the GlobalPool's; kept here for `limit_maxbytes`).
    pub mem_limit: usize,
    /// Page size in bytes (default 64 KiB).
    pub page_size: usize,
    /// `-I`: largest item (header + key + value) accepted.
    pub max_item_size: usize,
    /// false = memcached `-M`: return `OutOfMemory` instead of evicting.
    pub evict: bool,
    /// false = memcached `-C`: CAS values are 0.
    pub cas_enabled: bool,
    /// Pages taken from the global pool per refill.
    pub refill_pages: usize,
    /// THR_MEM_HIGH_THRESH: local free pages above which pages may go back.
    pub local_high_pages: usize,
    /// GLOB_MEM_LOW_THRESH: global available pages below which workers give pages back.
    pub global_low_pages: usize,
    /// Unix time of process start (`now == 0`), to convert absolute exptimes.
    pub start_unix: u64,
    /// Embedded in the low 16 bits of every CAS value.
    pub worker_id: u16,
    /// Workers sharing the global pool: each may hold its fair share
    /// (total / workers) and more only while a reserve stays for the others.
    pub workers: usize,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            mem_limit: 64 << 20,
            page_size: 64 << 10,
            max_item_size: 1 << 20,
            evict: true,
            cas_enabled: true,
            refill_pages: 16,
            local_high_pages: 64,
            global_low_pages: 32,
            start_unix: 0,
            worker_id: 0,
            workers: 1,
        }
    }
}

/// Store mode of [`WorkerStore::store`]. A `cas: Some(_)` argument adds the CAS check
/// ([`WorkerStore::store_with`] takes the meta protocol's CAS options).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Set,
    Add,
    Replace,
    Append,
    Prepend,
}

/// CAS handling of [`WorkerStore::store_with`]: the `cas` command and meta's `C`, `I`, `E`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CasOpts {
    /// Store only if the item exists with this CAS (else `NotFound` / `Exists`).
    pub compare: Option<u64>,
    /// With `compare`: a CAS older than the item's stores the value anyway, marked stale and
    /// keeping the old item's expiry and win token (meta `ms ... I`, memcached's
    /// "set-to-invalid"); only a newer or unknown CAS is `Exists`.
    pub stale_if_older: bool,
    /// The new item's CAS instead of the worker's next one (meta `E`).
    pub new_cas: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreResult {
    Stored { cas: u64 },
    NotStored,
    Exists,
    NotFound,
    TooLarge,
    OutOfMemory,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeleteResult {
    Deleted,
    NotFound,
    Exists,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArithResult {
    Value { value: u64, cas: u64 },
    NotFound,
    NonNumeric,
}

/// A borrowed view of a live item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ItemView<'a> {
    pub key: &'a [u8],
    pub value: &'a [u8],
    pub flags: u32,
    pub cas: u64,
    /// 0 = never, else the `now`-based second at which it expires.
    pub exptime: u32,
    /// The `now` of the previous access (or of the write), not of this one.
    pub last_access: u32,
    /// Whether it had been fetched before this access.
    pub fetched_before: bool,
    pub stale: bool,
    pub win: bool,
}

/// The item bits [`WorkerStore::update`] may change in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaBits {
    /// 0 = never, else `now`-based expiry second (use [`rel_exptime`]).
    pub exptime: u32,
    pub stale: bool,
    pub win: bool,
    pub cas: u64,
}

/// Convert a protocol exptime to a `now`-based one. `None` = already expired; `Some(0)` = never.
/// 1..=30 days: relative seconds; larger: absolute unix time; negative: expired.
pub fn rel_exptime(exptime: i64, now: u32, start_unix: u64) -> Option<u32> {
    if exptime == 0 {
        return Some(0);
    }
    if exptime < 0 {
        return None;
    }
    if exptime <= REALTIME_MAXDELTA {
        return Some((now as u64 + exptime as u64).min(u32::MAX as u64) as u32);
    }
    let abs = exptime as u64;
    if abs <= start_unix {
        return None;
    }
    let rel = abs - start_unix;
    if rel <= now as u64 {
        return None;
    }
    Some(rel.min(u32::MAX as u64) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exptime_conversion() {
        assert_eq!(rel_exptime(0, 100, 1_000_000_000), Some(0));
        assert_eq!(rel_exptime(-1, 100, 1_000_000_000), None);
        assert_eq!(rel_exptime(10, 100, 1_000_000_000), Some(110));
        assert_eq!(rel_exptime(REALTIME_MAXDELTA, 0, 1_000_000_000), Some(2_592_000));
        // absolute: start + 150 while now = 100 -> expires at 150
        assert_eq!(rel_exptime(1_000_000_150, 100, 1_000_000_000), Some(150));
        // absolute in the past
        assert_eq!(rel_exptime(1_000_000_050, 100, 1_000_000_000), None);
        assert_eq!(rel_exptime(REALTIME_MAXDELTA + 1, 100, 1_000_000_000), None);
    }
}
