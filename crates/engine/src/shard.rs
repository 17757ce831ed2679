//! [`Shard`]: one worker's state, what `exec` executes against and what moves between
//! workers and servers, without the worker's sockets, thread or messages.

use crate::capacity::Capacity;
use crate::counters::Counters;
use crate::exec::Ctx;
use crate::replica::Replicas;
use crate::tables::Tables;
use mbal_cluster::KeySpace;
use mbal_store::WorkerStore;

/// One worker's state: its cachelets (the store), who owns every other cachelet and the
/// requests waiting for a route to settle (`P`: the server's parked request), Phase 1's
/// tables, its counters and its emulated capacity. Only its worker touches it; the server
/// (`crates/server`, the reactor) owns one per worker and passes its parts where they are
/// needed.
pub struct Shard<P> {
    pub store: WorkerStore,
    pub tables: Tables<P>,
    pub replicas: Replicas,
    pub counters: Counters,
    pub capacity: Capacity,
}

impl<P> Shard<P> {
    pub fn new(store: WorkerStore, tables: Tables<P>, replicas: Replicas, capacity: Capacity) -> Shard<P> {
        Shard { store, tables, replicas, counters: Counters::default(), capacity }
    }

    /// The context `exec` runs a request in: this shard's store and counters, at `now`
    /// (seconds since the process started).
    pub fn ctx<'a>(&'a mut self, layout: &'a KeySpace, cas_enabled: bool, now: u32, detail: Option<u8>) -> Ctx<'a> {
        Ctx { store: &mut self.store, layout, cas_enabled, counters: &mut self.counters, now, detail }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::{locate, text_get_one, text_keyed};
    use mbal_proto::text::TextCmd;
    use mbal_proto::{Limits, Parsed, Protocol, Request};
    use mbal_store::{Cachelet, GlobalPool, StoreConfig};

    /// A one-worker shard owning every cachelet of a small key space.
    fn shard() -> (Shard<u64>, KeySpace) {
        let layout = KeySpace::even(8, 64);
        let cfg = StoreConfig { mem_limit: 8 << 20, ..StoreConfig::default() };
        let mut store = WorkerStore::new(GlobalPool::new(8 << 20, cfg.page_size), cfg, layout.cachelet_count());
        for c in 0..layout.cachelet_count() {
            store.insert_cachelet(Cachelet::new(c));
        }
        let tables = Tables::new(&mbal_cluster::even_owners(1, 1, 8), 0, 0);
        (Shard::new(store, tables, Replicas::default(), Capacity::new(0, 0)), layout)
    }

    /// Execute one text request if the shard's tables say it executes it here (`None`: not).
    fn run(s: &mut Shard<u64>, layout: &KeySpace, raw: &[u8]) -> Option<Vec<u8>> {
        let Parsed::Req { req: Request::Text(cmd), .. } = mbal_proto::parse(Protocol::Text, raw, &Limits::default())
        else {
            panic!("not a text request: {:?}", String::from_utf8_lossy(raw));
        };
        let key = match &cmd {
            TextCmd::Store { key, .. } | TextCmd::Delete { key, .. } => key.to_vec(),
            TextCmd::Get { keys, .. } => keys.iter().next().unwrap().to_vec(),
            _ => panic!("a keyed request"),
        };
        let at = locate(layout, &key);
        if !s.tables.executes(at.cachelet, s.tables.stamp(at.cachelet)) {
            return None;
        }
        let mut out = Vec::new();
        let mut ctx = s.ctx(layout, true, 1, None);
        match &cmd {
            TextCmd::Get { cas, touch, .. } => text_get_one(&mut ctx, &key, at, *cas, *touch, &mut out),
            _ => text_keyed(&mut ctx, &cmd, at, &mut out),
        }
        Some(out)
    }

    #[test]
    fn a_shard_executes_what_it_owns_and_nothing_once_its_cachelet_left() {
        let (mut s, layout) = shard();
        assert_eq!(run(&mut s, &layout, b"set k 5 0 2\r\nhi\r\n").unwrap(), b"STORED\r\n");
        assert_eq!(run(&mut s, &layout, b"get k\r\n").unwrap(), b"VALUE k 5 2\r\nhi\r\n");
        assert_eq!(run(&mut s, &layout, b"delete k\r\n").unwrap(), b"DELETED\r\n");
        assert_eq!(run(&mut s, &layout, b"get k\r\n").unwrap(), b"");
        // The coordinator gives k's cachelet to another server: this shard executes none of it.
        let c = locate(&layout, b"k").cachelet;
        let (ver, parked) = s.tables.reassign(c, 1, 0);
        assert_eq!((ver, parked.map(|q| q.len())), (1, None));
        assert_eq!(s.tables.route(c), (1, 0));
        assert_eq!(run(&mut s, &layout, b"get k\r\n"), None);
        assert!(run(&mut s, &layout, b"get other\r\n").is_some() || locate(&layout, b"other").cachelet == c);
    }
}
