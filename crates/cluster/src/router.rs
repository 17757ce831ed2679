//! The client side of routing, with no I/O: one [`Router`] used by the
//! routing client (`mbal-client`), the bench's routed driver and the proxy.
//!
//! A router holds a [`ClusterMap`] and the owners it learned from redirects
//! since (*overrides*, one per cachelet at most, each with the epoch of the
//! redirect that taught it). It answers three questions:
//!
//! * **Where does a key go?** [`Router::route_hash`]: the key's cachelet
//!   (the map's fixed [`KeySpace`](crate::KeySpace)) and its owner, the
//!   override if there is one, else the map's.
//! * **Where do the keys of a multi-key request go?** [`Router::split`] groups
//!   a key list by destination worker (and, on request, by cachelet) and keeps
//!   each key's position in the list, so the caller sends one request per
//!   group and puts the answers back in request order.
//! * **What does a redirect teach?** [`Router::learn`], given the redirect
//!   `RD <epoch> <server> <worker>` and the keys of the request it replaced:
//!   - the keys are all of one cachelet: that cachelet is now served by
//!     (`server`, `worker`) (an override, used until a newer map says
//!     otherwise);
//!   - the keys span several cachelets (a multi-key `get` that the server
//!     redirects as a whole, naming the owner of the first key it does not
//!     own): nothing can be attributed, nothing is recorded, and the caller
//!     resends those keys split per cachelet ([`Router::split`] with
//!     `per_cachelet`), so that the next redirect is attributable. Every
//!     caller handles a redirected multi-get this way;
//!   - the redirect's epoch is newer than the map's: the caller may fetch the
//!     map from the worker that redirected (`mbal map`) and give it to
//!     [`Router::install_map`], which keeps only the overrides newer than it.
//!
//! **Workers that share a thread.** A server says in its `mbal hello` answer how many threads
//! run its workers (`MBAL <server> <worker> <epoch> <threads>`): worker `w` shares a thread
//! with every worker `v` where `v % threads == w % threads`, and a routed connection to any of
//! them serves the others' keys too, with no hop between threads (docs/protocol.md). A caller
//! that tells the router ([`Router::set_threads`]) gets requests grouped per thread: every
//! key goes to the connection of the first worker of its owner's thread
//! ([`Router::conn_of`]; [`Router::split`] groups by it), so a client holds as many busy
//! connections per server as the server has threads, not workers, and each carries a deeper
//! pipeline. A redirect from that first worker naming the owner the router already had says
//! the threads changed since: the router forgets the count for that server (each key goes
//! to its owner's own connection again) and says so ([`Learned::threads_stale`]), so the
//! caller can ask again with `mbal hello`.
//!
//! Phase 1's leases (which copy of a hot key to read) are the
//! [`Leases`](crate::Leases) next to it, with no clock either: the caller
//! passes the time in. Phase 2's temporary owners need no lease on the
//! client: a moved cachelet answers `RD`, which the router learns.

use crate::{CacheletId, ClusterMap, Owner};
use std::fmt;

/// A redirect reply `RD <epoch> <server> <worker>`: as of map `epoch`, the
/// request's cachelet is served by `to`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Redirect {
    pub epoch: u64,
    pub to: Owner,
}

/// What one redirect taught a [`Router`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Learned {
    /// The cachelet whose owner was recorded; `None` when the redirected
    /// request spanned several cachelets (resend its keys split per
    /// cachelet) or named a worker the map does not have yet (see
    /// `fetch_map_from`).
    pub cachelet: Option<CacheletId>,
    /// The redirect names an epoch newer than the map's: the worker that
    /// sent it has a newer map (fetch it with `mbal map` there and
    /// [`Router::install_map`] it, if the caller fetches maps).
    pub fetch_map_from: Option<Owner>,
    /// The redirect named the owner the router already had, sent by the first worker of the
    /// owner's thread as the router knew it: that server's threads changed. The router now
    /// routes that server's keys per worker; the caller may refresh the count with
    /// `mbal hello` ([`Router::set_threads`]).
    pub threads_stale: Option<u16>,
}

/// A redirect to a worker that neither the map nor a newer map (by the
/// redirect's own epoch) can have: the peer is broken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BadRedirect {
    pub from: Owner,
    pub to: Owner,
}

impl fmt::Display for BadRedirect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "redirect to server {} worker {}, which the map does not have", self.to.0, self.to.1)
    }
}

impl std::error::Error for BadRedirect {}

#[derive(Clone, Copy, Debug)]
struct Override {
    owner: Owner,
    epoch: u64,
}

/// One destination of a [`Split`]: a worker, and the cachelet when the split
/// was per cachelet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Group {
    pub owner: Owner,
    pub cachelet: Option<CacheletId>,
    start: u32,
    end: u32,
}

impl Group {
    /// Keys in the group.
    pub fn len(&self) -> usize {
        (self.end - self.start) as usize
    }

    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }
}

/// A key list split by destination (see [`Router::split`]). Reusable: a
/// split clears it, and keeps its allocations.
#[derive(Clone, Debug, Default)]
pub struct Split {
    /// (sort key: owner and cachelet, position): sorted when the keys are many, left in list
    /// order when `group_few` groups them by counting.
    sorted: Vec<(u64, u32)>,
    /// The distinct sort keys when they are few: (key, count); and per entry, its key's index
    /// there.
    dests: Vec<(u64, u32)>,
    slots: Vec<u8>,
    positions: Vec<u32>,
    groups: Vec<Group>,
}

impl Split {
    pub fn new() -> Split {
        Split::default()
    }

    /// Group `sorted` (unsorted yet) without sorting it when it has at most `FEW` distinct
    /// keys, the usual case (a multi-get split over a handful of servers): find each entry's
    /// key once, count each key's entries, give each key its range (in key order), and place
    /// the positions in list order. False (and nothing grouped) when the keys are more.
    fn group_few(&mut self, per_cachelet: bool) -> bool {
        const FEW: usize = 16;
        self.dests.clear();
        self.slots.clear();
        for e in &self.sorted {
            let j = match self.dests.iter().position(|d| d.0 == e.0) {
                Some(j) => j,
                None if self.dests.len() < FEW => {
                    self.dests.push((e.0, 0));
                    self.dests.len() - 1
                }
                None => return false,
            };
            self.dests[j].1 += 1;
            self.slots.push(j as u8);
        }
        // groups in key order; `at[j]`: the next free place of `dests[j]`'s group
        let mut order: [u8; FEW] = std::array::from_fn(|i| i as u8);
        let order = &mut order[..self.dests.len()];
        order.sort_unstable_by_key(|&j| self.dests[j as usize].0);
        let mut at = [0u32; FEW];
        let mut start = 0;
        for &j in order.iter() {
            let (k, count) = self.dests[j as usize];
            let end = start + count;
            self.groups.push(Group {
                owner: ((k >> 48) as u16, (k >> 32) as u16),
                cachelet: per_cachelet.then_some(k as u32),
                start,
                end,
            });
            at[j as usize] = start;
            start = end;
        }
        self.positions.resize(self.sorted.len(), 0);
        for (&(_, i), &j) in self.sorted.iter().zip(&self.slots) {
            self.positions[at[j as usize] as usize] = i;
            at[j as usize] += 1;
        }
        true
    }

    /// The groups, in (server, worker, cachelet) order.
    pub fn groups(&self) -> &[Group] {
        &self.groups
    }

    /// Positions (in the list given to [`Router::split`]) of a group's keys,
    /// in list order.
    pub fn positions(&self, g: &Group) -> &[u32] {
        &self.positions[g.start as usize..g.end as usize]
    }

    /// Every position, group after group (a permutation of the list).
    pub fn all_positions(&self) -> &[u32] {
        &self.positions
    }
}

/// The routing state of one client. See the module docs.
#[derive(Clone, Debug)]
pub struct Router {
    map: ClusterMap,
    /// Per cachelet: the owner a redirect taught, if any.
    overrides: Vec<Option<Override>>,
    redirects: u64,
    /// Per server: how many threads run its workers (0: not known, route per worker).
    threads: Vec<u16>,
    /// Whether an override may be older than the map (learned from a server behind it): if
    /// not, [`Router::forget_stale_redirects_to`] has nothing to look for (it is asked on
    /// every request to a server in its backoff).
    maybe_stale: bool,
}

impl Router {
    pub fn new(map: ClusterMap) -> Router {
        let n = map.cachelet_count() as usize;
        Router { map, overrides: vec![None; n], redirects: 0, threads: Vec::new(), maybe_stale: false }
    }

    /// The map as last installed (without the overrides).
    pub fn map(&self) -> &ClusterMap {
        &self.map
    }

    /// Redirects learned from so far.
    pub fn redirects(&self) -> u64 {
        self.redirects
    }

    /// The cachelet of a key hash.
    #[inline]
    pub fn cachelet_of(&self, hash: u64) -> CacheletId {
        self.map.keyspace().cachelet_of_hash(hash)
    }

    /// The owner requests for cachelet `c` are sent to now.
    #[inline]
    pub fn owner_of(&self, c: CacheletId) -> Owner {
        match self.overrides[c as usize] {
            Some(o) => o.owner,
            None => self.map.owner(c),
        }
    }

    /// (cachelet, owner) of a key hash.
    #[inline]
    pub fn route_hash(&self, hash: u64) -> (CacheletId, Owner) {
        let c = self.cachelet_of(hash);
        (c, self.owner_of(c))
    }

    /// Server `server` runs its workers on `threads` threads (its `mbal hello` answer; 0: not
    /// known, route to each worker's own connection).
    pub fn set_threads(&mut self, server: u16, threads: u16) {
        let s = server as usize;
        if self.threads.len() <= s {
            self.threads.resize(s + 1, 0);
        }
        self.threads[s] = threads;
    }

    /// How many threads run `server`'s workers, as last told (0: not known).
    pub fn threads(&self, server: u16) -> u16 {
        self.threads.get(server as usize).copied().unwrap_or(0)
    }

    /// The worker whose connection takes requests for `owner`'s keys: the first worker of
    /// the owner's thread, or the owner itself when its server's threads are not known.
    #[inline]
    pub fn conn_of(&self, (s, w): Owner) -> Owner {
        match self.threads(s) {
            0 => (s, w),
            t => (s, w % t),
        }
    }

    /// The overrides in force: (cachelet, owner, epoch of the redirect).
    pub fn overrides(&self) -> impl Iterator<Item = (CacheletId, Owner, u64)> + '_ {
        self.overrides.iter().enumerate().filter_map(|(c, o)| o.map(|o| (c as CacheletId, o.owner, o.epoch)))
    }

    /// Group the keys with these hashes by destination worker ([`Router::conn_of`] their
    /// owner: the owner itself unless its server's threads are known), and by cachelet too
    /// when `per_cachelet`. Positions are indices into `hashes`; within a group they keep list
    /// order.
    pub fn split(&self, hashes: impl IntoIterator<Item = u64>, per_cachelet: bool, out: &mut Split) {
        out.sorted.clear();
        out.positions.clear();
        out.groups.clear();
        for (i, h) in hashes.into_iter().enumerate() {
            let (c, owner) = self.route_hash(h);
            let (s, w) = self.conn_of(owner);
            let sub = if per_cachelet { c as u64 } else { 0 };
            out.sorted.push(((s as u64) << 48 | (w as u64) << 32 | sub, i as u32));
        }
        if out.group_few(per_cachelet) {
            return;
        }
        if out.sorted.len() > 1 {
            // (key, position) pairs are unique: unstable sort keeps positions in order.
            out.sorted.sort_unstable();
        }
        let mut i = 0;
        while i < out.sorted.len() {
            let k = out.sorted[i].0;
            let start = i;
            while i < out.sorted.len() && out.sorted[i].0 == k {
                out.positions.push(out.sorted[i].1);
                i += 1;
            }
            out.groups.push(Group {
                owner: ((k >> 48) as u16, (k >> 32) as u16),
                cachelet: per_cachelet.then_some(k as u32),
                start: start as u32,
                end: i as u32,
            });
        }
    }

    /// Learn from a redirect sent by `from` in place of the reply to a
    /// request for the keys with these hashes. See the module docs.
    pub fn learn(
        &mut self,
        from: Owner,
        rd: Redirect,
        hashes: impl IntoIterator<Item = u64>,
    ) -> Result<Learned, BadRedirect> {
        let newer = rd.epoch > self.map.epoch();
        let fetch_map_from = newer.then_some(from);
        if !self.map.has_worker(rd.to) {
            // A newer map may have that worker: the caller fetches it.
            return if newer {
                Ok(Learned { cachelet: None, fetch_map_from, threads_stale: None })
            } else {
                Err(BadRedirect { from, to: rd.to })
            };
        }
        self.redirects += 1;
        let mut cachelet = None;
        for h in hashes {
            let c = self.cachelet_of(h);
            match cachelet {
                None => cachelet = Some(c),
                Some(x) if x == c => {}
                Some(_) => return Ok(Learned { cachelet: None, fetch_map_from, threads_stale: None }),
            }
        }
        let mut threads_stale = None;
        if let Some(c) = cachelet {
            // Sent to `from` for its thread-mate `rd.to`, which the router already took for
            // the owner: they no longer share a thread.
            if self.owner_of(c) == rd.to && rd.to != from && self.conn_of(rd.to) == from {
                self.set_threads(rd.to.0, 0);
                threads_stale = Some(rd.to.0);
            }
            self.overrides[c as usize] = Some(Override { owner: rd.to, epoch: rd.epoch });
            self.maybe_stale |= rd.epoch < self.map.epoch();
        }
        Ok(Learned { cachelet, fetch_map_from, threads_stale })
    }

    /// A server's map is of epoch `epoch` (its answer to `mbal map <epoch>`, or the same map
    /// again): if that is this map's epoch, the redirects older than it are forgotten (their
    /// senders were behind the map, and the map is current).
    pub fn confirm_epoch(&mut self, epoch: u64) {
        if epoch != self.map.epoch() || !self.maybe_stale {
            return;
        }
        for o in &mut self.overrides {
            if o.is_some_and(|o| o.epoch < epoch) {
                *o = None;
            }
        }
        self.maybe_stale = false;
    }

    /// Server `server` could not be reached: forget the redirects to it that are older than
    /// the map (how many). Such a redirect came from a server whose map was behind this one's
    /// (say the dead server's cachelets were given to it and it had not heard yet): it named
    /// the old owner, and would send the cachelet there until the next map.
    pub fn forget_stale_redirects_to(&mut self, server: u16) -> usize {
        if !self.maybe_stale {
            return 0;
        }
        let e = self.map.epoch();
        let (mut n, mut left) = (0, false);
        for o in &mut self.overrides {
            match *o {
                Some(x) if x.epoch < e && x.owner.0 == server => {
                    *o = None;
                    n += 1;
                }
                Some(x) if x.epoch < e => left = true,
                _ => {}
            }
        }
        self.maybe_stale = left;
        n
    }

    /// Replace the map by a newer one (of the same key space). Overrides
    /// not newer than it are forgotten. Returns whether the map was
    /// replaced (an older or equal map is ignored). The same epoch again (a
    /// refresh) drops the overrides older than the map: they came from
    /// redirects of a server that had not installed it yet (it named the
    /// owner of its older map, e.g. a server since declared dead), and the
    /// map is the better word.
    pub fn install_map(&mut self, map: ClusterMap) -> Result<bool, String> {
        if map.keyspace() != self.map.keyspace() {
            return Err("the new map has another key space (a map of another cluster)".into());
        }
        self.confirm_epoch(map.epoch());
        if map.epoch() <= self.map.epoch() {
            return Ok(false);
        }
        let e = map.epoch();
        self.map = map;
        for o in &mut self.overrides {
            if o.is_some_and(|o| o.epoch <= e || !self.map.has_worker(o.owner)) {
                *o = None;
            }
        }
        self.maybe_stale = false; // (what is left is newer than the map)
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{key_hash, KeySpace, ServerInfo};
    use std::net::SocketAddr;

    /// `servers` servers x `workers` workers x 2 cachelets each, 64 VNs.
    fn map(servers: u16, workers: u16) -> ClusterMap {
        let info = (0..servers)
            .map(|s| ServerInfo {
                main: SocketAddr::from(([127, 0, 0, 1], 1000 + s * 10)),
                workers: (0..workers).map(|w| SocketAddr::from(([127, 0, 0, 1], 1001 + s * 10 + w))).collect(),
            })
            .collect();
        ClusterMap::even(info, 2, 64)
    }

    /// A key (hash) of cachelet `c`.
    fn key_of(ks: &KeySpace, c: CacheletId, nth: usize) -> u64 {
        (0u32..)
            .map(|i| key_hash(format!("key{i}").as_bytes()))
            .filter(|&h| ks.cachelet_of_hash(h) == c)
            .nth(nth)
            .unwrap()
    }

    #[test]
    fn routes_by_the_map_until_a_redirect_teaches_otherwise() {
        let m = map(2, 2);
        let mut r = Router::new(m.clone());
        for i in 0..100u32 {
            let h = key_hash(&i.to_be_bytes());
            let (c, s, w) = m.route(h);
            assert_eq!(r.route_hash(h), (c, (s, w)));
        }
        let h = key_of(m.keyspace(), 3, 0);
        let (c, old) = r.route_hash(h);
        let to = (1 - old.0, old.1);
        let l = r.learn(old, Redirect { epoch: 1, to }, [h]).unwrap();
        assert_eq!(l, Learned { cachelet: Some(c), fetch_map_from: None, threads_stale: None });
        assert_eq!(r.route_hash(h), (c, to));
        assert_eq!(r.route_hash(key_of(m.keyspace(), 3, 5)), (c, to), "every key of the cachelet follows");
        assert_eq!(r.route_hash(key_of(m.keyspace(), 2, 0)).1, m.owner(2), "other cachelets do not");
        assert_eq!(r.redirects(), 1);
        assert_eq!(r.overrides().collect::<Vec<_>>(), vec![(c, to, 1)]);
    }

    #[test]
    fn a_newer_epoch_asks_for_the_map_and_a_newer_map_replaces_overrides() {
        let m = map(1, 2);
        let mut r = Router::new(m.clone());
        let (a, b) = (key_of(m.keyspace(), 0, 0), key_of(m.keyspace(), 1, 0));
        // cachelet 0 moved at epoch 3 (the server says), cachelet 1 at epoch 5
        let l = r.learn((0, 0), Redirect { epoch: 3, to: (0, 1) }, [a]).unwrap();
        assert_eq!(l, Learned { cachelet: Some(0), fetch_map_from: Some((0, 0)), threads_stale: None });
        r.learn((0, 1), Redirect { epoch: 5, to: (0, 0) }, [b]).unwrap();
        assert_eq!((r.owner_of(0), r.owner_of(1)), ((0, 1), (0, 0)));
        // the map of epoch 4 includes the first move only: the second override stays
        let mut newer = m.clone();
        newer.move_cachelet(0, (0, 1));
        newer.move_cachelet(2, (0, 1));
        newer.move_cachelet(2, (0, 0));
        assert_eq!(newer.epoch(), 4);
        assert!(r.install_map(newer.clone()).unwrap());
        assert_eq!(r.map(), &newer);
        assert_eq!(r.overrides().map(|(c, ..)| c).collect::<Vec<_>>(), vec![1]);
        assert_eq!((r.owner_of(0), r.owner_of(1)), ((0, 1), (0, 0)));
        // an older map changes nothing; a map of epoch 5 drops the last override
        assert!(!r.install_map(m.clone()).unwrap());
        let mut e5 = newer.clone();
        e5.move_cachelet(3, (0, 0));
        assert!(r.install_map(e5.clone()).unwrap());
        assert_eq!(r.overrides().count(), 0);
        assert_eq!(r.owner_of(1), e5.owner(1), "the map rules again");
        // a map of another key space is refused
        assert!(r.install_map(map(1, 3)).is_err());
    }

    /// A server behind the map redirects to the owner of its older map (say, a server the
    /// coordinator has since declared dead): followed until the map is fetched again, which
    /// drops that override; a redirect of the map's own epoch stays.
    #[test]
    fn a_refreshed_map_drops_the_overrides_of_servers_behind_it() {
        let mut m = map(2, 1);
        m.move_cachelet(0, (1, 0));
        assert_eq!(m.epoch(), 2);
        let mut r = Router::new(m.clone());
        let (a, b) = (key_of(m.keyspace(), 2, 0), key_of(m.keyspace(), 3, 0));
        let (ca, cb) = (r.cachelet_of(a), r.cachelet_of(b));
        r.learn((0, 0), Redirect { epoch: 1, to: (1, 0) }, [a]).unwrap();
        r.learn((1, 0), Redirect { epoch: 2, to: (0, 0) }, [b]).unwrap();
        assert_eq!((r.owner_of(ca), r.owner_of(cb)), ((1, 0), (0, 0)));
        assert!(!r.install_map(m.clone()).unwrap(), "the same map: not installed");
        assert_eq!(r.owner_of(ca), m.owner(ca), "the older redirect's override is gone");
        assert_eq!(r.overrides().map(|(c, ..)| c).collect::<Vec<_>>(), vec![cb]);
        // an older map changes nothing
        assert!(!r.install_map(map(2, 1)).unwrap());
        assert_eq!(r.overrides().count(), 1);
        // the same epoch confirmed without the map (`mbal map <epoch>`) does as the same map
        r.learn((0, 0), Redirect { epoch: 1, to: (1, 0) }, [a]).unwrap();
        r.confirm_epoch(1);
        assert_eq!(r.owner_of(ca), (1, 0), "an older epoch confirms nothing");
        r.confirm_epoch(2);
        assert_eq!(r.overrides().map(|(c, ..)| c).collect::<Vec<_>>(), vec![cb]);
        // the old owner failed: its redirects older than the map go at once, newer ones stay
        r.learn((0, 0), Redirect { epoch: 1, to: (1, 0) }, [a]).unwrap();
        assert_eq!(r.forget_stale_redirects_to(0), 0);
        assert_eq!(r.forget_stale_redirects_to(1), 1);
        assert_eq!(r.owner_of(ca), m.owner(ca));
        r.learn((0, 0), Redirect { epoch: 2, to: (1, 0) }, [a]).unwrap();
        assert_eq!(r.forget_stale_redirects_to(1), 0, "a redirect of the map's epoch is not stale");
        assert_eq!(r.owner_of(ca), (1, 0));
    }

    #[test]
    fn bad_redirects() {
        let m = map(1, 2);
        let mut r = Router::new(m.clone());
        let h = key_of(m.keyspace(), 0, 0);
        let e = r.learn((0, 0), Redirect { epoch: 1, to: (0, 2) }, [h]).unwrap_err();
        assert_eq!(e, BadRedirect { from: (0, 0), to: (0, 2) });
        assert!(e.to_string().contains("server 0 worker 2"));
        // a newer epoch may know a new worker: nothing learned, fetch the map
        let l = r.learn((0, 0), Redirect { epoch: 2, to: (3, 0) }, [h]).unwrap();
        assert_eq!(l, Learned { cachelet: None, fetch_map_from: Some((0, 0)), threads_stale: None });
        assert_eq!(r.overrides().count(), 0);
        assert_eq!(r.redirects(), 0);
    }

    #[test]
    fn split_groups_by_worker_and_keeps_positions() {
        // 2 x 2: at most 16 destinations, grouped by counting; 4 x 8: more, grouped by sorting
        for (servers, workers) in [(2, 2), (4, 8)] {
            split_checks(servers, workers);
        }
    }

    fn split_checks(servers: u16, workers: u16) {
        let m = map(servers, workers);
        let r = Router::new(m.clone());
        let hashes: Vec<u64> = (0..200u32).map(|i| key_hash(format!("k{i}").as_bytes())).collect();
        let mut sp = Split::new();
        for per_cachelet in [false, true] {
            r.split(hashes.iter().copied(), per_cachelet, &mut sp);
            let mut seen = vec![false; hashes.len()];
            let mut prev = None;
            for g in sp.groups() {
                assert!(!g.is_empty());
                let key = (g.owner, g.cachelet);
                assert!(prev < Some(key), "groups sorted and distinct");
                prev = Some(key);
                let pos = sp.positions(g);
                assert_eq!(pos.len(), g.len());
                assert!(pos.windows(2).all(|p| p[0] < p[1]), "request order within a group");
                for &p in pos {
                    let (c, o) = r.route_hash(hashes[p as usize]);
                    assert_eq!(o, g.owner);
                    assert_eq!(g.cachelet.is_some(), per_cachelet);
                    if let Some(gc) = g.cachelet {
                        assert_eq!(gc, c);
                    }
                    assert!(!std::mem::replace(&mut seen[p as usize], true));
                }
            }
            assert!(seen.iter().all(|&s| s), "every key in exactly one group");
            if (servers, workers) == (2, 2) {
                assert_eq!(sp.groups().len(), if per_cachelet { 8 } else { 4 });
            } else {
                assert!(sp.groups().len() > 16, "{} groups: the sorting path not taken", sp.groups().len());
            }
            // reassembly: answers per group put back by position give the request order
            let mut out = vec![u64::MAX; hashes.len()];
            for g in sp.groups() {
                let answers: Vec<u64> = sp.positions(g).iter().map(|&p| hashes[p as usize]).collect();
                for (&p, a) in sp.positions(g).iter().zip(answers) {
                    out[p as usize] = a;
                }
            }
            assert_eq!(out, hashes);
        }
        r.split(std::iter::empty(), false, &mut sp);
        assert!(sp.groups().is_empty() && sp.all_positions().is_empty());
    }

    #[test]
    fn with_a_thread_count_keys_go_to_the_first_worker_of_their_owners_thread() {
        let m = map(2, 4);
        let mut r = Router::new(m.clone());
        let hashes: Vec<u64> = (0..400u32).map(|i| key_hash(format!("k{i}").as_bytes())).collect();
        assert_eq!(r.threads(1), 0, "not known: per worker");
        // server 1 runs its 4 workers on 2 threads: {0, 2} and {1, 3}
        r.set_threads(1, 2);
        let mut sp = Split::new();
        r.split(hashes.iter().copied(), false, &mut sp);
        // 4 workers of server 0, 2 threads of server 1
        assert_eq!(
            sp.groups().iter().map(|g| g.owner).collect::<Vec<_>>(),
            [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
        );
        for g in sp.groups() {
            for &p in sp.positions(g) {
                let (_, o) = r.route_hash(hashes[p as usize]);
                assert_eq!(r.conn_of(o), g.owner);
                assert_eq!(g.owner, if o.0 == 1 { (1, o.1 % 2) } else { o });
            }
        }
        // a key of worker 3 went to worker 1, which says worker 3 is not on its thread any more
        let c = (0..m.cachelet_count()).find(|&c| m.owner(c) == (1, 3)).unwrap();
        let h = key_of(m.keyspace(), c, 0);
        assert_eq!(r.conn_of(r.route_hash(h).1), (1, 1));
        let l = r.learn((1, 1), Redirect { epoch: 1, to: (1, 3) }, [h]).unwrap();
        assert_eq!(l, Learned { cachelet: Some(c), fetch_map_from: None, threads_stale: Some(1) });
        assert_eq!(r.threads(1), 0);
        assert_eq!(r.conn_of(r.route_hash(h).1), (1, 3), "per worker again");
        // a redirect to a new owner is a move, not a change of threads
        r.set_threads(1, 2);
        let l = r.learn((1, 1), Redirect { epoch: 2, to: (1, 2) }, [h]).unwrap();
        assert_eq!(l.threads_stale, None);
        assert_eq!((r.threads(1), r.route_hash(h).1, r.conn_of((1, 2))), (2, (1, 2), (1, 0)));
    }

    /// The one way every caller handles a multi-get that the server
    /// redirected as a whole: nothing is learned from it, its keys are
    /// resent split per cachelet, and the redirects of those requests are
    /// learned exactly.
    #[test]
    fn redirected_multi_get_is_resent_per_cachelet() {
        let m = map(1, 2);
        let ks = m.keyspace().clone();
        // the "server": cachelets 0 and 2 moved from worker 0 to worker 1
        let mut truth = m.clone();
        truth.move_cachelet(0, (0, 1));
        truth.move_cachelet(2, (0, 1));
        let serve = |owner: Owner, hashes: &[u64]| -> Option<Redirect> {
            // like the server: redirect the whole request to the owner of the first foreign key
            hashes
                .iter()
                .map(|&h| truth.owner(ks.cachelet_of_hash(h)))
                .find(|&o| o != owner)
                .map(|to| Redirect { epoch: 1, to })
        };
        let hashes: Vec<u64> =
            (0..4).flat_map(|c| (0..3).map(move |n| (c, n))).map(|(c, n)| key_of(&ks, c, n)).collect();
        let mut r = Router::new(m);
        let mut sp = Split::new();
        let mut pending: Vec<usize> = (0..hashes.len()).collect();
        let mut answered = vec![false; hashes.len()];
        let mut rounds = 0;
        while !pending.is_empty() {
            rounds += 1;
            assert!(rounds <= 3, "bounded");
            r.split(pending.iter().map(|&i| hashes[i]), rounds > 1, &mut sp);
            let mut next = Vec::new();
            let mut lessons = Vec::new();
            for g in sp.groups() {
                let idx: Vec<usize> = sp.positions(g).iter().map(|&p| pending[p as usize]).collect();
                let hs: Vec<u64> = idx.iter().map(|&i| hashes[i]).collect();
                match serve(g.owner, &hs) {
                    None => idx.iter().for_each(|&i| answered[i] = true),
                    Some(rd) => {
                        lessons.push((g.owner, rd, hs));
                        next.extend(idx);
                    }
                }
            }
            for (from, rd, hs) in lessons {
                let l = r.learn(from, rd, hs.iter().copied()).unwrap();
                // round 1: worker 0's get spans cachelets 0 and 2: nothing to attribute
                assert_eq!(l.cachelet.is_some(), rounds > 1);
            }
            next.sort_unstable();
            pending = next;
        }
        assert!(answered.iter().all(|&a| a));
        assert_eq!(rounds, 3, "one whole redirect, then one per moved cachelet, then served");
        assert_eq!(r.redirects(), 3);
        for c in 0..4 {
            assert_eq!(r.owner_of(c), truth.owner(c));
        }
    }
}
