//! One worker's view of who owns what: the ownership tables of the server-local move protocol
//! (the protocol itself, its messages and its ordering rules, are the server's `moves`).
//!
//! A cachelet changes worker by messages; tables are versioned (`ver` counts the cachelet's
//! moves) so a late notice never undoes a newer one. Every forwarded request carries the
//! version of the cachelet's owner its origin routed it by ([`Tables::stamp`]); a worker
//! executes it only if it owns the cachelet at exactly that version ([`Tables::executes`]),
//! and otherwise bounces it back. The origin keeps, per cachelet, how many of its requests
//! are in flight and the route it sends them on; a newer owner becomes the route only when
//! nothing is in flight for that cachelet, and until then bounced and newer requests (`P`,
//! the server's parked request) wait in arrival order.

use mbal_cluster::Owner;
use std::collections::{HashMap, VecDeque};

/// The server a fenced worker routes its own server's cachelets to: none. A server whose lease
/// from the coordinator ran out serves none of its cachelets (docs/design-notes.md, "Fencing"):
/// [`Tables::route`] names this server for them, so requests get the answer for a key another
/// server holds (a miss, or an error for a write) until the lease is renewed.
pub const FENCED: u16 = u16::MAX;

/// Who serves a cachelet, as a worker's tables know it: a worker of this
/// server or another server, and the version of that knowledge (moves of
/// one cachelet are numbered).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Own {
    pub server: u16,
    pub worker: u16,
    pub ver: u32,
}

/// One worker's ownership tables. Only that worker touches them.
pub struct Tables<P> {
    me: u16,
    /// This worker's server.
    server: u16,
    /// This server's lease from the coordinator ran out (`FENCED`); set by the worker at the
    /// start of each round.
    pub fenced: bool,
    /// A cachelet of this worker in the last step of a move to another server
    /// (`worker/migrate.rs`): its requests wait, nobody executes them here.
    pub frozen: Option<u32>,
    /// The frozen cachelet's commit was sent and its answer lost (the coordinator away): the
    /// move may or may not stand, which may take a while to learn. Meanwhile this worker's
    /// own connections get an error for it at once instead of waiting (a client's timeout
    /// would take the whole server for down; a miss would read older than a write it saw).
    pub unsure: bool,
    /// The newest owner this worker knows of, per cachelet.
    pub owner: Vec<Own>,
    /// The server and worker this worker sends a cachelet's requests to
    /// (itself: it executes them) and the owner's version they are stamped
    /// with. Follows `owner` when nothing is in flight.
    route: Vec<(u16, u16, u32)>,
    /// This worker's forwarded requests in flight, per cachelet.
    inflight: Vec<u32>,
    /// Requests waiting for a route change, per cachelet (only while a
    /// cachelet that moved still has requests in flight: rare): those that
    /// bounced, in the order they come back (the order they were sent, as
    /// all of them took one route), and newer ones that were never sent.
    parked: HashMap<u32, (VecDeque<P>, VecDeque<P>)>,
    /// The map epoch of the newest [`Tables::reassign`] followed, per cachelet.
    epochs: Vec<u64>,
}

impl<P> Tables<P> {
    /// Tables from the cluster map's owners (by cachelet id).
    pub fn new(owners: &[Owner], server: u16, me: usize) -> Tables<P> {
        let owner: Vec<Own> = owners.iter().map(|&(server, worker)| Own { server, worker, ver: 0 }).collect();
        let route = owner.iter().map(|o| (o.server, o.worker, o.ver)).collect();
        let n = owner.len();
        Tables {
            me: me as u16,
            server,
            fenced: false,
            frozen: None,
            unsure: false,
            owner,
            route,
            inflight: vec![0; n],
            parked: HashMap::new(),
            epochs: vec![0; n],
        }
    }

    pub fn len(&self) -> usize {
        self.owner.len()
    }

    pub fn is_empty(&self) -> bool {
        self.owner.is_empty()
    }

    /// The server owning cachelet `c` and the worker to send its requests
    /// to now.
    pub fn route(&self, c: u32) -> (u16, u16) {
        let (s, w, _) = self.route[c as usize];
        if self.fenced && s == self.server {
            return (FENCED, w);
        }
        (s, w)
    }

    /// The owner version requests for `c` are stamped with now.
    pub fn stamp(&self, c: u32) -> u32 {
        self.route[c as usize].2
    }

    /// May this worker execute a request for `c` stamped `stamp`? (It owns
    /// `c`, at that version, and its server is not fenced.)
    pub fn executes(&self, c: u32, stamp: u32) -> bool {
        let own = self.owner[c as usize];
        own.server == self.server && own.worker == self.me && own.ver == stamp && !self.fenced && self.frozen != Some(c)
    }

    /// Must a new request for `c` wait behind parked ones?
    pub fn is_parked(&self, c: u32) -> bool {
        self.parked.contains_key(&c)
    }

    /// Nothing of this worker's for `c` is in flight or parked: a request for it may run
    /// wherever `c` is now without overtaking one sent before (`near`).
    pub fn quiet(&self, c: u32) -> bool {
        self.inflight[c as usize] == 0 && (self.parked.is_empty() || !self.parked.contains_key(&c))
    }

    /// Queue a new request for `c` behind the ones waiting (`is_parked`).
    pub fn park(&mut self, c: u32, p: P) {
        self.parked.entry(c).or_default().1.push_back(p);
    }

    /// A request for `c` left for another worker.
    pub fn sent(&mut self, c: u32) {
        self.inflight[c as usize] += 1;
    }

    /// A newer owner (a notice, an adoption, a release, a bounce's hint).
    /// Returns the parked requests to send again if the route changed.
    /// A claim that this worker owns `c` is ignored: only `adopted` makes it
    /// so, once the cachelet is in its store.
    pub fn learn(&mut self, c: u32, server: u16, worker: u16, ver: u32) -> Option<VecDeque<P>> {
        let own = &mut self.owner[c as usize];
        if ver > own.ver && (server, worker) != (self.server, self.me) {
            *own = Own { server, worker, ver };
        }
        self.settle(c)
    }

    /// The coordinator gave `c` to `(server, worker)` (`OwnMsg::Reassign`, sent to every
    /// worker in the same order, so their versions stay equal). Returns the new version and
    /// the parked requests to send again if the route changed. The caller puts an empty
    /// cachelet in its store first when `(server, worker)` is this worker (then it owns it).
    pub fn reassign(&mut self, c: u32, server: u16, worker: u16) -> (u32, Option<VecDeque<P>>) {
        let own = &mut self.owner[c as usize];
        *own = Own { server, worker, ver: own.ver + 1 };
        let ver = own.ver;
        (ver, self.settle(c))
    }

    /// `c` arrived at this worker from another server, its move committed at map `epoch` (0:
    /// not known): every older map's notice of `c` is stale from now on. Returns the epoch the
    /// adoption's notice to the other workers carries (the newer of `epoch` and the last one
    /// this worker followed).
    pub fn arrived(&mut self, c: u32, epoch: u64) -> u64 {
        let last = &mut self.epochs[c as usize];
        *last = (*last).max(epoch);
        *last
    }

    /// Before a [`Tables::reassign`] from map `epoch`: `Some` if this worker already followed
    /// a newer map for `c` (a late notice: the controller's answer to a map older than the
    /// commit of a move that brought `c` here), which must change no owner, or this server
    /// would drop the items that arrived. It still counts as a change (the `Some` holds the
    /// parked requests to send again, as `reassign`'s), so that every worker, whichever order
    /// its two notices came in, numbers `c`'s owner alike. `None`: follow it. `reset`: the
    /// map of a reset (this server was declared dead) is followed whatever its epoch, and every
    /// cachelet's number starts again from it (a coordinator that lost its state numbers from
    /// 1 again).
    pub fn stale(&mut self, c: u32, epoch: u64, reset: bool) -> Option<Option<VecDeque<P>>> {
        if reset {
            // Numbers from the reset's map on, for every cachelet (once per reset in effect).
            self.epochs.iter_mut().filter(|e| **e > epoch).for_each(|e| *e = 0);
        }
        let last = &mut self.epochs[c as usize];
        if epoch < *last {
            self.owner[c as usize].ver += 1;
            return Some(self.settle(c));
        }
        *last = epoch;
        None
    }

    /// The answer to a request for `c` came back.
    pub fn answered(&mut self, c: u32) -> Option<VecDeque<P>> {
        let n = &mut self.inflight[c as usize];
        debug_assert!(*n > 0, "an answer nobody waits for");
        *n = n.saturating_sub(1);
        self.settle(c)
    }

    /// A request for `c` bounced (the worker it reached does not own `c`;
    /// it believes `hint` does): park it and follow the hint.
    pub fn bounced(&mut self, c: u32, hint: Own, p: P) -> Option<VecDeque<P>> {
        // Sent before anything parked as new: it goes ahead of those.
        self.parked.entry(c).or_default().0.push_back(p);
        let n = &mut self.inflight[c as usize];
        debug_assert!(*n > 0, "a bounce nobody waits for");
        *n = n.saturating_sub(1);
        self.learn(c, hint.server, hint.worker, hint.ver)
    }

    /// Nothing in flight for `c`: the route follows the newest owner, and
    /// what was parked goes out on it.
    fn settle(&mut self, c: u32) -> Option<VecDeque<P>> {
        if self.inflight[c as usize] != 0 {
            return None;
        }
        let own = self.owner[c as usize];
        self.route[c as usize] = (own.server, own.worker, own.ver);
        if self.parked.is_empty() {
            // The common case, on every answered forward: no hashing.
            return None;
        }
        let (mut bounced, newer) = self.parked.remove(&c)?;
        bounced.extend(newer);
        Some(bounced)
    }

    /// This worker takes `c` into its store: it owns it from now on.
    pub fn adopted(&mut self, c: u32, ver: u32) -> Option<VecDeque<P>> {
        let own = &mut self.owner[c as usize];
        debug_assert!(ver >= own.ver, "an adoption is the newest move of its cachelet");
        *own = Own { server: self.server, worker: self.me, ver };
        self.settle(c)
    }

    /// This worker gave `c` to `to`; returns the move's version.
    pub fn released(&mut self, c: u32, to: u16) -> u32 {
        let own = &mut self.owner[c as usize];
        own.worker = to;
        own.ver += 1;
        let ver = own.ver;
        // Usually nothing is in flight (this worker executed its requests
        // for `c` itself) and the route follows at once; but if it adopted
        // `c` while its own requests for it still travelled the old route,
        // those come back first, as everywhere else.
        let parked = self.settle(c);
        debug_assert!(parked.is_none(), "parked requests imply requests in flight");
        ver
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A parked request, as the tests see it: its sequence number.
    type Parked = u64;

    fn tables(me: usize) -> Tables<Parked> {
        // One server, 2 workers x 2 cachelets, dealt round-robin: 0 and 2 on
        // worker 0, 1 and 3 on worker 1.
        Tables::new(&mbal_cluster::even_owners(1, 2, 2), 0, me)
    }

    fn p(seq: u64) -> Parked {
        seq
    }

    fn seqs(q: Option<VecDeque<Parked>>) -> Vec<u64> {
        q.map(|q| q.into_iter().collect()).unwrap_or_default()
    }

    #[test]
    fn route_follows_a_notice_at_once_when_nothing_is_in_flight() {
        let mut t = tables(0);
        let c = 1;
        assert_eq!(t.route(c), (0, 1));
        // Worker 1 moved c to worker 2 (of a larger server, in this table).
        assert!(t.learn(c, 0, 5, 1).is_none());
        assert_eq!(t.route(c), (0, 5), "sent to the new owner at once");
        // A stale notice (older move) changes nothing.
        assert!(t.learn(c, 0, 1, 0).is_none());
        assert_eq!(t.route(c), (0, 5));
        // Nor does a claim that this worker owns it: only an adoption does.
        assert!(t.learn(c, 0, 0, 7).is_none());
        assert_eq!(t.route(c), (0, 5));
        assert!(!t.executes(c, 7));
        assert!(t.adopted(c, 7).is_none());
        assert_eq!(t.route(c), (0, 0), "worker 0 now executes it itself");
        assert_eq!(t.stamp(c), 7);
        assert!(t.executes(c, 7));
        assert!(!t.executes(c, 5), "a request stamped with an older owner bounces");
        assert_eq!(t.owner[c as usize], Own { server: 0, worker: 0, ver: 7 });
    }

    #[test]
    fn route_waits_for_requests_in_flight_and_parked_ones_keep_their_order() {
        let mut t = tables(0);
        let c = 3;
        t.sent(c);
        t.sent(c);
        // Worker 1 gave c to worker 0 while two requests travel to it.
        assert!(t.adopted(c, 1).is_none());
        assert_eq!(t.route(c), (0, 1), "still the old route: requests are in flight");
        // The first bounces; the second is still out: nothing moves yet.
        assert!(t.bounced(c, Own { server: 0, worker: 0, ver: 1 }, p(10)).is_none());
        assert!(t.is_parked(c));
        // A newer request of the same connection queues behind it.
        t.park(c, p(12));
        // The second bounces too: nothing in flight, the route switches and
        // everything parked comes back in order.
        assert_eq!(seqs(t.bounced(c, Own { server: 0, worker: 0, ver: 1 }, p(11))), vec![10, 11, 12]);
        assert_eq!(t.route(c), (0, 0));
        assert!(!t.is_parked(c));
    }

    #[test]
    fn an_answer_that_empties_the_flight_switches_the_route() {
        let mut t = tables(0);
        let c = 1;
        t.sent(c);
        assert!(t.learn(c, 0, 4, 3).is_none());
        assert_eq!(t.route(c), (0, 1));
        assert!(t.answered(c).is_none(), "nothing parked");
        assert_eq!(t.route(c), (0, 4));
    }

    #[test]
    fn release_then_adopt_round_trip() {
        let mut t0 = tables(0);
        let mut t1 = tables(1);
        let v = t0.released(0, 1);
        assert_eq!(v, 1);
        assert_eq!(t0.route(0), (0, 1));
        assert!(t1.adopted(0, v).is_none());
        assert_eq!(t1.route(0), (0, 1));
        assert_eq!(t1.owner[0].ver, 1);
        // And back: versions keep growing.
        let v2 = t1.released(0, 0);
        assert_eq!(v2, 2);
        assert!(t0.adopted(0, v2).is_none());
        assert_eq!(t0.route(0), (0, 0));
    }

    #[test]
    fn a_fenced_worker_routes_its_servers_cachelets_nowhere_and_executes_none() {
        let mut t = tables(0);
        assert_eq!(t.route(0), (0, 0));
        assert!(t.executes(0, 0));
        t.fenced = true;
        assert_eq!(t.route(0), (FENCED, 0), "its own");
        assert_eq!(t.route(1), (FENCED, 1), "a neighbour's, of the same server");
        assert!(!t.executes(0, 0));
        // Another server's cachelet is routed there as before.
        let (ver, q) = t.reassign(1, 3, 1);
        assert!(q.is_none());
        assert_eq!(ver, 1);
        assert_eq!(t.route(1), (3, 1));
        t.fenced = false;
        assert!(t.executes(0, 0));
        assert_eq!(t.route(1), (3, 1));
    }

    #[test]
    fn a_reassigned_cachelet_comes_back_empty_at_a_newer_version() {
        let mut t0 = tables(0);
        let mut t1 = tables(1);
        // The coordinator gives cachelet 0 (worker 0's) to server 2 ...
        for t in [&mut t0, &mut t1] {
            let (v, _) = t.reassign(0, 2, 0);
            assert_eq!(v, 1);
            assert_eq!(t.route(0), (2, 0));
        }
        assert!(!t0.executes(0, 0) && !t0.executes(0, 1));
        // ... and back to this server's worker 1, which takes it (adopted) at version 2.
        let (v, _) = t1.reassign(0, 0, 1);
        assert!(t1.adopted(0, v).is_none());
        assert!(t1.executes(0, 2));
        let (v0, _) = t0.reassign(0, 0, 1);
        assert_eq!(v0, 2, "every worker numbers the changes alike");
        assert_eq!(t0.route(0), (0, 1));
        // A request worker 0 stamped before the cachelet left bounces at worker 1 ...
        assert!(!t1.executes(0, 0));
        // ... and a bounce's hint naming another server is followed.
        let mut t = tables(1);
        t.sent(2);
        assert!(t.bounced(2, Own { server: 4, worker: 0, ver: 3 }, p(1)).is_some());
        assert_eq!(t.route(2), (4, 0));
    }

    #[test]
    fn a_late_notice_from_an_older_map_changes_no_owner_but_every_worker_counts_it() {
        // Cachelet 0 arrives at this server's worker 1 from a move committed at epoch 7; the
        // answer to an older map (epoch 5, the cachelet on server 2) reaches worker 0 before
        // the adoption's notice and worker 1 after it.
        let (mut t0, mut t1) = (tables(0), tables(1));
        assert_eq!(t1.arrived(0, 7), 7, "as adopt_moved records it");
        let (v1, _) = t1.reassign(0, 0, 1);
        assert!(t1.stale(0, 5, false).is_some(), "older than what worker 1 followed");
        assert!(t0.stale(0, 5, false).is_none());
        t0.reassign(0, 2, 0);
        assert!(t0.stale(0, 7, false).is_none());
        let (v0, _) = t0.reassign(0, 0, 1);
        assert_eq!(t1.owner[0], Own { server: 0, worker: 1, ver: v1 + 1 });
        assert_eq!(t0.owner[0], Own { server: 0, worker: 1, ver: v0 });
        assert_eq!(v0, v1 + 1, "the same version at both");
        // A later map of the same epoch or newer is followed.
        assert!(t1.stale(0, 7, false).is_none() && t1.stale(0, 9, false).is_none());
        assert!(t1.executes(0, v0) && !t1.executes(0, v1));
        // A reset's map is followed even if older, and numbers every cachelet from there.
        assert!(t1.stale(1, 9, false).is_none());
        assert!(t1.stale(0, 2, false).is_some() && t1.stale(0, 2, true).is_none());
        assert!(t1.stale(0, 3, false).is_none() && t1.stale(1, 3, false).is_none());
    }
}
