//! Workers on one thread: a request for a key another worker on the same host thread owns is
//! executed on that worker's store at once, by the worker that read it, instead of travelling
//! there and back as two messages.
//!
//! Why it is safe: a host thread (`worker/group.rs`) runs its workers' rounds one after the
//! other, so while one of them runs, the others are idle on the same thread and nothing else
//! touches their stores (a worker's store is only ever used by the thread that hosts it; a
//! worker changes thread only whole, between rounds). The host lends the running worker
//! `&mut` borrows of the others' stores and counters for one round (`Near`); the borrow checker
//! holds the rest.
//!
//! Why it keeps a connection's order: a request goes the direct way only when nothing this
//! worker sent the owner is still unprocessed, so everything the connection sent it before
//! (forwarded requests, a `flush_all`'s order) has already run there:
//! * this worker has no forwarded request for the cachelet in flight and none parked
//!   (`Tables`: the move protocol's per-cachelet FIFO is empty);
//! * nothing for the owner waits in this worker's outbox except replies, and the owner's inbox
//!   is empty (it has taken in everything sent to it);
//! * the owner owns the cachelet at the version this worker routes by (`Tables::executes`), so
//!   a cachelet on its way out or in goes by message and the move protocol decides.
//!
//! Not taken when the workers have an emulated capacity (`--worker-capacity`: each worker
//! must pay for its own requests, by message) or when a write must wait for hot-key copies
//! (`--replica-writes sync` with replicated keys at the owner). In async mode a direct write to
//! a replicated key is handed to the replicator right after it runs, before its reply can
//! leave, as the owner does with its own writes (`dispatch::after_near`). A direct request
//! counts as forwarded at both ends (`forwarded_out`, `forwarded_in`, `cross_worker_requests`)
//! and in `cross_worker_direct` (a direct multi-get once per key; a message once per run of
//! keys). The time it takes is the reader's busy time, not the owner's.

use crate::counters::Counters;
use crate::moves::Tables;
use crate::msg::Outbox;
use crate::replica::HotTable;
use mbal_store::WorkerStore;

/// Another worker of this host thread, lent for one round.
pub(crate) struct NearWorker<'a> {
    pub id: usize,
    pub store: &'a mut WorkerStore,
    pub counters: &'a mut Counters,
    /// Its hot keys (Phase 1): a direct write to one is copied at once, before its reply
    /// leaves, as the owner does for its own writes (`copy_writes`), so that the owner grants
    /// no new lease before the copy is on its way.
    pub hot: &'a mut HotTable,
    pub tables: &'a Tables,
    /// Its inbox was empty when it was lent: it had taken in everything this worker sent it.
    /// (Nothing this worker does in its round reaches that inbox before the round ends, but
    /// a cachelet it releases, whose `Adopt` the tables check covers; others' messages to it
    /// are not ordered with this worker's connections.)
    pub inbox_empty: bool,
}

/// The other workers of this host thread that may be used directly this round.
#[derive(Default)]
pub(crate) struct Near<'a> {
    workers: Vec<NearWorker<'a>>,
}

impl<'a> Near<'a> {
    pub fn new(workers: Vec<NearWorker<'a>>) -> Near<'a> {
        Near { workers }
    }

    /// Worker `to`'s place here, if it is on this thread and may execute a request for
    /// cachelet `c` now for a worker with tables `mine` and outbox `outbox` for `to` (see the
    /// module's rules).
    pub fn find(&self, to: usize, c: u32, mine: &Tables, outbox: &Outbox) -> Option<usize> {
        let i = self.workers.iter().position(|w| w.id == to)?;
        let w = &self.workers[i];
        let ok = w.tables.executes(c, mine.stamp(c)) && mine.quiet(c) && outbox.only_replies() && w.inbox_empty;
        ok.then_some(i)
    }

    /// Is worker `to` on this thread (lent this round)?
    pub fn hosts(&self, to: usize) -> bool {
        self.workers.iter().any(|w| w.id == to)
    }

    /// The worker `find` found at `i`.
    pub fn at(&mut self, i: usize) -> &mut NearWorker<'a> {
        &mut self.workers[i]
    }

    /// Start loading the index line of a key of cachelet `c` if a worker here owns it (a
    /// hint: the request may still go by message).
    pub fn prefetch(&self, c: u32, hash: u64) {
        for w in &self.workers {
            if w.store.owns(c) {
                w.store.prefetch(c, hash);
                return;
            }
        }
    }

    /// Start loading the item of a key of cachelet `c` that its index line names, if a worker
    /// here owns it (`WorkerStore::prefetch_item`; a hint, like `prefetch`).
    pub fn prefetch_item(&self, c: u32, hash: u64) {
        for w in &self.workers {
            if w.store.owns(c) {
                w.store.prefetch_item(c, hash);
                return;
            }
        }
    }
}
