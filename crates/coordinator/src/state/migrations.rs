//! Cross-server moves of a cachelet as the coordinator sees them (docs/design-notes.md,
//! "Cross-server migration"). The source server runs the move; the coordinator is the one
//! place where it ends: `begin` records it, then exactly one of `commit` (the map gives the
//! cachelet to the destination, one epoch bump) and `abort` happens. A commit needs the
//! record, so once `abort` answered (or the coordinator restarted and forgot the record, or a
//! server of the move was found dead) no late commit can give the cachelet away: the source
//! may serve it again. The records are not stored: losing them only aborts moves.

use super::{Coord, MemberState};
use mbal_cluster::CacheletId;
use std::collections::VecDeque;
use std::time::Instant;

/// Finished moves kept for `mbal migrations`.
const KEPT: usize = 64;

/// One move.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Migration {
    pub id: u64,
    pub cachelet: CacheletId,
    pub from: u16,
    pub to: (u16, u16),
    pub started: Instant,
    /// How it ended (`None`: in flight): "committed", "aborted", "source down", ...
    pub outcome: Option<&'static str>,
    pub ended: Option<Instant>,
    /// Items and frame bytes the source sent (given with the commit).
    pub items: u64,
    pub bytes: u64,
}

/// The moves in flight and the last ones that ended.
#[derive(Clone, Debug, Default)]
pub struct Migrations {
    next_id: u64,
    live: Vec<Migration>,
    done: VecDeque<Migration>,
}

/// What `abort` found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AbortOutcome {
    Aborted,
    /// It had been committed, at this epoch or before.
    Committed(u64),
}

impl Migrations {
    fn end(&mut self, i: usize, outcome: &'static str, now: Instant) {
        let mut m = self.live.swap_remove(i);
        m.outcome = Some(outcome);
        m.ended = Some(now);
        if self.done.len() == KEPT {
            self.done.pop_front();
        }
        self.done.push_back(m);
    }

    /// Every move, in flight first.
    pub fn rows(&self) -> impl Iterator<Item = &Migration> {
        self.live.iter().chain(self.done.iter().rev())
    }

    pub fn in_flight(&self) -> usize {
        self.live.len()
    }
}

impl Coord {
    /// `mbal migrate begin <cachelet> <from> <to> <worker>`: record a move of `c` from server
    /// `from` (which must own it, Up) to worker `w` of server `to` (Up, another server); one
    /// move per cachelet at a time. Returns its id.
    pub fn migrate_begin(&mut self, c: CacheletId, from: u16, to: (u16, u16), now: Instant) -> Result<u64, String> {
        for s in [from, to.0] {
            match self.state(s) {
                Some(MemberState::Up) => {}
                Some(st) => return Err(format!("server {s} is {}", st.name())),
                None => return Err(format!("no server {s}")),
            }
        }
        if from == to.0 {
            return Err("a move between the workers of one server is that server's (mbal move)".into());
        }
        if c >= self.map.cachelet_count() {
            return Err(format!("no cachelet {c}: the map has {}", self.map.cachelet_count()));
        }
        if self.map.owner(c).0 != from {
            return Err(format!("cachelet {c} is server {}'s, not server {from}'s", self.map.owner(c).0));
        }
        if !self.map.has_worker(to) {
            return Err(format!("server {} has no worker {}", to.0, to.1));
        }
        if self.migrations.live.iter().any(|m| m.cachelet == c) {
            return Err(format!("cachelet {c} is already moving"));
        }
        self.migrations.next_id += 1;
        let id = self.migrations.next_id;
        let m = Migration { id, cachelet: c, from, to, started: now, outcome: None, ended: None, items: 0, bytes: 0 };
        self.migrations.live.push(m);
        self.counters.migrations_begun += 1;
        Ok(id)
    }

    /// `mbal migrate commit <id>`: the destination has every item; the map gives it the
    /// cachelet (one epoch bump). Refused without the record (aborted, or forgotten).
    pub fn migrate_commit(&mut self, id: u64, (items, bytes): (u64, u64), now: Instant) -> Result<u64, String> {
        let Some(i) = self.migrations.live.iter().position(|m| m.id == id) else {
            return Err(format!("no move {id} in flight (it was aborted)"));
        };
        (self.migrations.live[i].items, self.migrations.live[i].bytes) = (items, bytes);
        let m = self.migrations.live[i].clone();
        if self.map.owner(m.cachelet).0 != m.from {
            self.migrations.end(i, "aborted: the owner changed", now);
            self.counters.migrations_aborted += 1;
            return Err(format!("cachelet {} changed owner during the move", m.cachelet));
        }
        let epoch = self.map.reassign(&[(m.cachelet, m.to)])?;
        self.migrations.end(i, "committed", now);
        self.counters.migrations_committed += 1;
        self.dirty = true;
        Ok(epoch)
    }

    /// `mbal migrate abort <id> <cachelet> <to>`: end a move that did not commit. If it did
    /// (or, the record forgotten, the map gives `c` to server `to`), says so instead.
    pub fn migrate_abort(&mut self, id: u64, c: CacheletId, to: u16, now: Instant) -> AbortOutcome {
        if let Some(i) = self.migrations.live.iter().position(|m| m.id == id) {
            self.migrations.end(i, "aborted", now);
            self.counters.migrations_aborted += 1;
            return AbortOutcome::Aborted;
        }
        let committed = self.migrations.done.iter().any(|m| m.id == id && m.outcome == Some("committed"));
        if committed || (c < self.map.cachelet_count() && self.map.owner(c).0 == to) {
            return AbortOutcome::Committed(self.map.epoch());
        }
        AbortOutcome::Aborted
    }

    /// Servers `dead` were found dead or left: their moves end (aborted).
    pub(super) fn migrations_lost(&mut self, dead: &[u16], now: Instant) {
        while let Some(i) = self.migrations.live.iter().position(|m| dead.contains(&m.from) || dead.contains(&m.to.0)) {
            self.migrations.end(i, "aborted: a server of the move is gone", now);
            self.counters.migrations_aborted += 1;
        }
    }

    pub fn migrations(&self) -> &Migrations {
        &self.migrations
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::coord_with;
    use super::*;

    #[test]
    fn a_move_ends_once_commit_or_abort_and_a_late_commit_is_refused() {
        let now = Instant::now();
        let mut c = coord_with(2, now);
        let cl = c.map().cachelets_of(0, 0)[0];
        let e0 = c.epoch();
        assert!(c.migrate_begin(cl, 1, (0, 0), now).is_err(), "not the owner");
        assert!(c.migrate_begin(cl, 0, (0, 1), now).is_err(), "same server");
        let id = c.migrate_begin(cl, 0, (1, 1), now).unwrap();
        assert!(c.migrate_begin(cl, 0, (1, 0), now).is_err(), "one move per cachelet");
        let epoch = c.migrate_commit(id, (1, 2), now).unwrap();
        assert_eq!(epoch, e0 + 1);
        assert_eq!(c.map().owner(cl), (1, 1));
        assert_eq!(c.migrate_abort(id, cl, 1, now), AbortOutcome::Committed(epoch));
        assert!(c.migrate_commit(id, (0, 0), now).is_err());

        let id = c.migrate_begin(cl, 1, (0, 0), now).unwrap();
        assert_eq!(c.migrate_abort(id, cl, 0, now), AbortOutcome::Aborted);
        assert!(c.migrate_commit(id, (0, 0), now).is_err(), "no commit after an abort");
        assert_eq!(c.map().owner(cl), (1, 1));
        // A forgotten move (a restarted coordinator) aborts unless the map says otherwise.
        assert_eq!(c.migrate_abort(999, cl, 0, now), AbortOutcome::Aborted);
        assert_eq!(c.migrations().rows().count(), 2);
    }

    #[test]
    fn a_dead_server_ends_its_moves() {
        let now = Instant::now();
        let mut c = coord_with(3, now);
        let cl = c.map().cachelets_of(2, 0)[0];
        let id = c.migrate_begin(cl, 2, (0, 0), now).unwrap();
        c.migrations_lost(&[0], now);
        assert_eq!(c.migrations().in_flight(), 0);
        assert!(c.migrate_commit(id, (0, 0), now).is_err());
    }
}

/// Plans of warm moves (`crate::server::orchestra` carries them out, one `mbal migrate` each).
impl Coord {
    /// `mbal register ... warm` of a new server: it joins Up with no cachelet (one epoch bump),
    /// and the moves that give it its share come back to be run warm. A server the map knows
    /// registers as with [`Coord::register`] (no plan).
    /// `pending`: the moves already queued or running (another join's share), planned as done.
    pub fn register_warm(
        &mut self,
        id: Option<u16>,
        info: mbal_cluster::ServerInfo,
        memory_bytes: u64,
        now: Instant,
        pending: &[(CacheletId, mbal_cluster::Owner)],
    ) -> Result<(super::Registered, Vec<(CacheletId, mbal_cluster::Owner)>), String> {
        let known = id.is_some() || self.map.servers().iter().any(|s| s.main == info.main);
        if known || info.workers.is_empty() || self.map.servers().len() >= u16::MAX as usize {
            return self.register(id, info, memory_bytes, now).map(|r| (r, Vec::new()));
        }
        let id = self.map.servers().len() as u16;
        let epoch = self.map.update(&[(id, info)], &[])?;
        self.members.push(super::Member { state: MemberState::Up, memory_bytes });
        self.last_beat.push(Some(now));
        self.counters.registrations += 1;
        self.counters.joins += 1;
        self.dirty = true;
        let plan = self.with_pending(pending).share_moves(id);
        Ok((super::Registered { id, epoch, joined: true, given: 0 }, plan))
    }

    /// This state as if the `pending` moves were done (those still possible).
    fn with_pending(&self, pending: &[(CacheletId, mbal_cluster::Owner)]) -> Coord {
        let mut sim = self.clone();
        let ok: Vec<_> =
            pending.iter().copied().filter(|&(c, o)| c < sim.map.cachelet_count() && sim.map.has_worker(o)).collect();
        let _ = sim.map.reassign(&ok);
        sim
    }

    /// `mbal drain <id>`: the moves that take every cachelet of `id` to the other Up servers'
    /// workers (fewest first), none to a server being drained too (`draining`), counting the
    /// `pending` moves as done.
    pub fn drain_plan(
        &self,
        id: u16,
        draining: &[u16],
        pending: &[(CacheletId, mbal_cluster::Owner)],
    ) -> Result<Vec<(CacheletId, mbal_cluster::Owner)>, String> {
        match self.state(id) {
            Some(MemberState::Up) => {}
            Some(st) => return Err(format!("server {id} is {}", st.name())),
            None => return Err(format!("no server {id}")),
        }
        let mut targets = self.up_workers(Some(id));
        targets.retain(|t| !draining.contains(&t.0));
        if targets.is_empty() {
            return Err("no other Up server (not being drained) to take its cachelets".into());
        }
        let sim = self.with_pending(pending);
        Ok(sim.spread(&sim.owned_by(|s| s == id), &targets))
    }

    /// `mbal rebalance`: the moves that give every Up server its share of the cachelets.
    pub fn rebalance_plan(
        &self,
        pending: &[(CacheletId, mbal_cluster::Owner)],
    ) -> Vec<(CacheletId, mbal_cluster::Owner)> {
        let mut sim = self.with_pending(pending);
        let mut plan: Vec<(CacheletId, mbal_cluster::Owner)> = Vec::new();
        let up: Vec<u16> = (0..self.members.len() as u16).filter(|&s| self.state(s) == Some(MemberState::Up)).collect();
        for id in up {
            let moves = sim.share_moves(id);
            if moves.is_empty() || sim.map.reassign(&moves).is_err() {
                continue;
            }
            for m in moves {
                plan.retain(|p| p.0 != m.0);
                plan.push(m);
            }
        }
        plan.retain(|&(c, o)| self.map.owner(c) != o);
        plan
    }
}

#[cfg(test)]
mod plan_tests {
    use super::super::tests::coord_with;
    use super::*;

    #[test]
    fn a_warm_join_gets_no_cachelet_at_once_and_a_plan_for_its_share() {
        let now = Instant::now();
        let mut c = coord_with(2, now);
        let info = mbal_cluster::ServerInfo {
            main: "127.0.0.1:29999".parse().unwrap(),
            workers: vec!["127.0.0.1:29999".parse().unwrap(); 2],
        };
        let e0 = c.epoch();
        let (r, plan) = c.register_warm(None, info.clone(), 0, now, &[]).unwrap();
        assert_eq!((r.id, r.given, r.epoch), (2, 0, e0 + 1));
        assert!((0..c.map().cachelet_count()).all(|cl| c.map().owner(cl).0 != 2));
        // 3 servers x 2 workers, 16 cachelets.
        assert_eq!(plan.len(), 16 * 2 / 6, "its workers' part of 16 cachelets: {plan:?}");
        assert!(plan.iter().all(|&(_, (s, _))| s == 2));
        assert!(c.rebalance_plan(&[]).len() == plan.len());
        assert!(c.rebalance_plan(&plan).is_empty(), "the pending moves count as done");
        let drain = c.drain_plan(0, &[], &[]).unwrap();
        assert_eq!(drain.len(), 8);
        assert!(drain.iter().all(|&(cl, (s, _))| s != 0 && c.map().owner(cl).0 == 0));
        assert!(c.drain_plan(0, &[1], &[]).unwrap().iter().all(|&(_, (s, _))| s == 2), "not to a draining server");
        // A second join while the first one's share is still pending gets a share of its own.
        let info2 = mbal_cluster::ServerInfo {
            main: "127.0.0.1:29998".parse().unwrap(),
            workers: vec!["127.0.0.1:29998".parse().unwrap(); 2],
        };
        let (_, plan2) = c.register_warm(None, info2, 0, now, &plan).unwrap();
        let fresh = plan2.iter().filter(|m| !plan.iter().any(|p| p.0 == m.0)).count();
        assert!(fresh >= 3, "its own share, not the first join's cachelets: {plan:?} {plan2:?}");
    }

    /// Two servers join at once (the second while the first one's share is still queued):
    /// with the later plan's destination winning for a queued cachelet (`Orchestra::add`),
    /// every server ends with an even share (the 2026-11-27 scale-out gave 25 and 2 of 128).
    #[test]
    fn two_joins_at_once_end_with_even_shares() {
        let now = Instant::now();
        for (servers, workers) in [(2u16, 2usize), (4, 2), (3, 1)] {
            let mut c = coord_with(servers, now);
            let mut queued: Vec<(CacheletId, mbal_cluster::Owner)> = Vec::new();
            for j in 0..2u16 {
                let a: std::net::SocketAddr = format!("127.0.0.1:{}", 29990 + j).parse().unwrap();
                let info = mbal_cluster::ServerInfo { main: a, workers: vec![a; workers.max(2)] };
                let (_, plan) = c.register_warm(None, info, 0, now, &queued).unwrap();
                for m in plan {
                    match queued.iter_mut().find(|q| q.0 == m.0) {
                        Some(q) => *q = m,
                        None => queued.push(m),
                    }
                }
            }
            c.map.reassign(&queued).unwrap();
            let n = c.map().servers().len();
            let mut per = vec![0usize; n];
            for cl in 0..c.map().cachelet_count() {
                per[usize::from(c.map().owner(cl).0)] += 1;
            }
            let (lo, hi) = (*per.iter().min().unwrap(), *per.iter().max().unwrap());
            // every server's share within its workers' part, give or take one per worker
            assert!(hi - lo <= 2, "{servers} servers + 2 joins: cachelets per server {per:?}");
            assert!(per[n - 1] > 0 && per[n - 2] > 0, "both joiners got cachelets: {per:?}");
        }
    }
}
