//! The global page pool: the `-m` budget cut into fixed-size pages.
//!
//! Page buffers are allocated lazily on first use and recycled; at most
//! `mem_limit / page_size` pages (normal pages plus pages charged for large items) exist at
//! any time. Workers take pages in bulk and give them back in bulk, so the one `Mutex` here is
//! touched once per refill, never per operation.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// One page buffer.
pub(crate) type Page = Box<[u8]>;

/// Snapshot of the global pool's accounting (all counts in pages).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolStats {
    pub page_size: usize,
    /// `mem_limit / page_size`: the budget.
    pub total_pages: usize,
    /// Page buffers in existence (in the global free list or held by workers).
    pub created_pages: usize,
    /// Page buffers sitting in the global free list.
    pub free_pages: usize,
    /// Pages charged for large (bigger than one page) items.
    pub large_pages: usize,
    /// Pages currently held by workers (local free pools and segments).
    pub outstanding_pages: usize,
    /// Pages a worker could still obtain: free list + never-created budget.
    pub available_pages: usize,
    /// Pages requested by workers that found no memory and had nothing to evict.
    pub wanted_pages: usize,
}

struct Inner {
    free: Vec<Page>,
    created: usize,
    large: usize,
    outstanding: usize,
}

/// The server-wide memory budget, shared by all workers through an `Arc`.
pub struct GlobalPool {
    page_size: usize,
    total_pages: usize,
    inner: Mutex<Inner>,
    /// Mirror of `available_pages`, readable without the lock (written only under it).
    available: AtomicUsize,
    /// Pages asked for by workers that could neither refill nor evict (they own no segment).
    /// Other workers read it only when they open a segment or sweep, and shed pages.
    wanted: AtomicUsize,
    /// `-M`: the smallest item refused for memory since the pool ran out of pages
    /// (`usize::MAX`: none). Every worker refuses items this large or larger at once until
    /// room is made (memcached keeps refusing once full; see `WorkerStore::alloc`).
    refused: AtomicUsize,
    /// `stats sizes_enable`: the item size histogram (`store/sizes.rs`).
    pub(crate) sizes: crate::store::SizesSwitch,
}

impl GlobalPool {
    /// A pool of `mem_limit / page_size` pages (at least one). No memory is allocated yet.
    pub fn new(mem_limit: usize, page_size: usize) -> Arc<Self> {
        assert!(page_size >= 1024, "page_size must be at least 1 KiB");
        assert!(page_size <= crate::MAX_PAGE_SIZE, "page_size must be at most {} bytes", crate::MAX_PAGE_SIZE);
        let total_pages = (mem_limit / page_size).max(1);
        // A cachelet's index addresses at most MAX_PAGES segments (a segment holds >= 1 page).
        assert!(total_pages <= crate::MAX_PAGES, "more than {} pages: use larger pages", crate::MAX_PAGES);
        Arc::new(GlobalPool {
            page_size,
            total_pages,
            inner: Mutex::new(Inner { free: Vec::new(), created: 0, large: 0, outstanding: 0 }),
            available: AtomicUsize::new(total_pages),
            wanted: AtomicUsize::new(0),
            refused: AtomicUsize::new(usize::MAX),
            sizes: Default::default(),
        })
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    pub fn total_pages(&self) -> usize {
        self.total_pages
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn avail_of(&self, g: &Inner) -> usize {
        self.total_pages - g.created - g.large + g.free.len()
    }

    fn publish(&self, g: &Inner) {
        self.available.store(self.avail_of(g), Ordering::Relaxed);
    }

    /// Pages a worker could still obtain (free list + never-created budget); lock-free read.
    pub fn available_pages(&self) -> usize {
        self.available.load(Ordering::Relaxed)
    }

    /// Take up to `n` pages (recycled first, then freshly allocated within the budget).
    pub(crate) fn take(&self, n: usize, out: &mut Vec<Page>) -> usize {
        let mut g = self.lock();
        let mut got = 0;
        while got < n {
            if let Some(p) = g.free.pop() {
                out.push(p);
            } else if g.created + g.large < self.total_pages {
                g.created += 1;
                out.push(vec![0u8; self.page_size].into_boxed_slice());
            } else {
                break;
            }
            got += 1;
        }
        g.outstanding += got;
        self.publish(&g);
        got
    }

    /// Give pages back to the global free list.
    pub(crate) fn give(&self, pages: impl Iterator<Item = Page>) {
        let mut g = self.lock();
        let mut n = 0;
        for p in pages {
            debug_assert_eq!(p.len(), self.page_size);
            g.free.push(p);
            g.outstanding -= 1;
            n += 1;
        }
        self.publish(&g);
        drop(g);
        if n > 0 && self.wanted.load(Ordering::Relaxed) > 0 {
            let _ = self.wanted.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| Some(w.saturating_sub(n)));
        }
    }

    /// Pages requested by starving workers (see [`crate::WorkerStore::shed_pages`]).
    pub fn pages_wanted(&self) -> usize {
        self.wanted.load(Ordering::Relaxed)
    }

    /// Record that a worker needs `n` pages it cannot get (capped at the whole budget).
    /// `-M`: is an item of `size` bytes refused at once (one this large was refused and no
    /// page came free since)? Clears the mark when a page did.
    pub(crate) fn refuses(&self, size: usize) -> bool {
        let r = self.refused.load(Ordering::Relaxed);
        if r == usize::MAX {
            return false;
        }
        if self.available_pages() > 0 {
            self.refused.store(usize::MAX, Ordering::Relaxed);
            return false;
        }
        size >= r
    }

    /// `-M`: an item of `size` bytes was refused with no page left (`None`: room was made).
    pub(crate) fn set_refused(&self, size: Option<usize>) {
        match size {
            Some(s) => {
                self.refused.fetch_min(s, Ordering::Relaxed);
            }
            None => {
                if self.refused.load(Ordering::Relaxed) != usize::MAX {
                    self.refused.store(usize::MAX, Ordering::Relaxed);
                }
            }
        }
    }

    pub(crate) fn want(&self, n: usize) {
        let cap = self.total_pages;
        let _ = self.wanted.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| Some((w + n).min(cap)));
    }

    /// Charge `n` pages of budget for one large item. Recycled page buffers are dropped
    /// as needed so that the memory in existence never exceeds the budget.
    pub(crate) fn charge_large(&self, n: usize) -> bool {
        let mut g = self.lock();
        if self.avail_of(&g) < n {
            return false;
        }
        let uncreated = self.total_pages - g.created - g.large;
        let mut need = n.saturating_sub(uncreated);
        while need > 0 {
            drop(g.free.pop());
            g.created -= 1;
            need -= 1;
        }
        g.large += n;
        self.publish(&g);
        true
    }

    /// Return the budget of a freed large item.
    pub(crate) fn release_large(&self, n: usize) {
        let mut g = self.lock();
        g.large -= n;
        self.publish(&g);
    }

    pub fn stats(&self) -> PoolStats {
        let g = self.lock();
        PoolStats {
            page_size: self.page_size,
            total_pages: self.total_pages,
            created_pages: g.created,
            free_pages: g.free.len(),
            large_pages: g.large,
            outstanding_pages: g.outstanding,
            available_pages: self.avail_of(&g),
            wanted_pages: self.wanted.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lazy_and_bounded() {
        let p = GlobalPool::new(10 * 4096, 4096);
        assert_eq!(p.stats().created_pages, 0);
        let mut v = Vec::new();
        assert_eq!(p.take(4, &mut v), 4);
        assert_eq!(p.stats().created_pages, 4);
        assert_eq!(p.take(100, &mut v), 6);
        assert_eq!(p.take(1, &mut v), 0);
        assert_eq!(p.available_pages(), 0);
        p.give(v.drain(..3));
        assert_eq!(p.available_pages(), 3);
        assert!(!p.charge_large(4));
        assert!(p.charge_large(2));
        let s = p.stats();
        assert_eq!(s.created_pages, 8);
        assert_eq!(s.large_pages, 2);
        assert_eq!(s.free_pages, 1);
        assert!(s.created_pages + s.large_pages <= s.total_pages);
        p.release_large(2);
        assert_eq!(p.available_pages(), 3);
        assert_eq!(p.take(3, &mut v), 3);
        assert_eq!(p.stats().created_pages, 10);
    }
}
