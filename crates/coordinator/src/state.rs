//! The coordinator's decisions, with no sockets and no clock: the map, the
//! members' states and their last heartbeats. Time is passed in (`now`), so
//! every rule (registration, join shares, heartbeats, the failure check,
//! leaves, local moves) is unit-tested here; the network layer
//! ([`crate::server`]) only parses lines, calls these, persists and replies.

use mbal_cluster::{CacheletId, ClusterMap, Owner, ServerInfo};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// A member's state as the coordinator sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemberState {
    /// Registered (or named by the cluster file) and beating in time.
    Up,
    /// Missed its heartbeats for longer than the failure timeout; its
    /// cachelets went to the Up servers. It must register again.
    Down,
    /// Left (`mbal leave`); its cachelets went to the other Up servers.
    Left,
}

impl MemberState {
    pub fn name(self) -> &'static str {
        match self {
            MemberState::Up => "up",
            MemberState::Down => "down",
            MemberState::Left => "left",
        }
    }
}

/// What is kept of a member across restarts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub state: MemberState,
    /// As the server registered it (0 until it registers).
    #[serde(default)]
    pub memory_bytes: u64,
}

/// What the store holds: the map (its JSON as `ClusterMap` serialises) and
/// the members' states, by server id.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stored {
    pub map: ClusterMap,
    pub members: Vec<Member>,
}

impl Stored {
    /// The state of a new cluster: its initial map, every server Up.
    pub fn initial(map: ClusterMap) -> Stored {
        let members = map.servers().iter().map(|_| Member { state: MemberState::Up, memory_bytes: 0 }).collect();
        Stored { map, members }
    }

    /// One member per server of the map.
    pub fn check(&self) -> Result<(), String> {
        if self.members.len() != self.map.servers().len() {
            return Err(format!(
                "{} members for the {} servers of the map",
                self.members.len(),
                self.map.servers().len()
            ));
        }
        Ok(())
    }
}

/// The heartbeat's timing. `beat < lease < failure_timeout`: a server
/// renews its lease every `beat`, stops serving when `lease` passes
/// without a renewal, and the coordinator declares it down only after
/// `failure_timeout`, so it has stopped before its cachelets move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timing {
    pub beat: Duration,
    pub lease: Duration,
    pub failure_timeout: Duration,
}

impl Default for Timing {
    fn default() -> Timing {
        Timing {
            beat: Duration::from_millis(100),
            lease: Duration::from_millis(400),
            failure_timeout: Duration::from_millis(600),
        }
    }
}

impl Timing {
    pub fn validate(&self) -> Result<(), String> {
        if self.beat.is_zero() {
            return Err("the beat interval must be at least 1 ms".into());
        }
        if self.beat >= self.lease {
            return Err(format!(
                "the beat interval ({} ms) must be shorter than the lease ({} ms)",
                self.beat.as_millis(),
                self.lease.as_millis()
            ));
        }
        if self.lease >= self.failure_timeout {
            return Err(format!(
                "the lease ({} ms) must be shorter than the failure timeout ({} ms): a server must stop serving \
                 before its cachelets are given to another",
                self.lease.as_millis(),
                self.failure_timeout.as_millis()
            ));
        }
        Ok(())
    }
}

/// The coordinator's counters (`stats`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub registrations: u64,
    pub joins: u64,
    pub register_refused: u64,
    pub beats: u64,
    pub failures_detected: u64,
    pub leaves: u64,
    pub moves: u64,
    pub auth_refused: u64,
    pub peer_auth_errors: u64,
    pub bad_commands: u64,
    pub state_writes: u64,
    pub state_write_errors: u64,
    pub migrations_begun: u64,
    pub migrations_committed: u64,
    pub migrations_aborted: u64,
}

/// A registration's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Registered {
    pub id: u16,
    pub epoch: u64,
    /// A new server (or one that came back from Down or Left) that was
    /// given a share of the cachelets.
    pub joined: bool,
    /// Cachelets it was given.
    pub given: usize,
}

/// A heartbeat's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Beat {
    /// Up: the current epoch.
    Up {
        epoch: u64,
    },
    /// Down (it must stop serving and register again) or Left (`left`: it must stop serving
    /// and stay out).
    Gone {
        left: bool,
    },
    NoServer,
}

/// What a failure check did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Failures {
    /// Servers found dead (now Down).
    pub down: Vec<u16>,
    /// Cachelets reassigned (0 when no Up server remained).
    pub reassigned: usize,
    /// The new epoch if the map changed.
    pub epoch: Option<u64>,
}

/// One line of `mbal members`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberRow {
    pub id: u16,
    pub main: std::net::SocketAddr,
    pub state: MemberState,
    pub workers: usize,
    pub cachelets: usize,
    /// Milliseconds since its last heartbeat (or registration, or the
    /// coordinator's start for an Up member); None when not known.
    pub ms_since_beat: Option<u64>,
}

/// The coordinator's state and every decision it makes. See the module docs.
#[derive(Clone, Debug)]
pub struct Coord {
    map: ClusterMap,
    members: Vec<Member>,
    last_beat: Vec<Option<Instant>>,
    timing: Timing,
    pub counters: Counters,
    /// Did the stored state change since [`Coord::take_dirty`]?
    dirty: bool,
    /// Cross-server moves (not stored: a restart aborts them).
    migrations: migrations::Migrations,
}

impl Coord {
    /// From a stored (or initial) state at `now`: every Up member gets a
    /// grace period (its last heartbeat counts as `now`).
    pub fn new(stored: Stored, timing: Timing, now: Instant) -> Result<Coord, String> {
        stored.check()?;
        timing.validate()?;
        let last_beat = stored.members.iter().map(|m| (m.state == MemberState::Up).then_some(now)).collect();
        Ok(Coord {
            map: stored.map,
            members: stored.members,
            last_beat,
            timing,
            counters: Counters::default(),
            dirty: false,
            migrations: Default::default(),
        })
    }

    pub fn map(&self) -> &ClusterMap {
        &self.map
    }

    pub fn epoch(&self) -> u64 {
        self.map.epoch()
    }

    pub fn timing(&self) -> Timing {
        self.timing
    }

    pub fn members(&self) -> &[Member] {
        &self.members
    }

    /// What the store keeps.
    pub fn stored(&self) -> Stored {
        Stored { map: self.map.clone(), members: self.members.clone() }
    }

    /// Did the stored state change since the last call? (Then it must be
    /// written before any reply reveals it.)
    pub fn take_dirty(&mut self) -> bool {
        std::mem::take(&mut self.dirty)
    }

    pub fn count(&self, state: MemberState) -> usize {
        self.members.iter().filter(|m| m.state == state).count()
    }

    fn state(&self, id: u16) -> Option<MemberState> {
        self.members.get(id as usize).map(|m| m.state)
    }

    /// Cachelets per (server, worker) of the map.
    fn per_worker(&self) -> BTreeMap<Owner, usize> {
        let mut n = BTreeMap::new();
        for (s, info) in self.map.servers().iter().enumerate() {
            for w in 0..info.workers.len() {
                n.insert((s as u16, w as u16), 0);
            }
        }
        for &o in self.map.owners() {
            *n.entry(o).or_insert(0) += 1;
        }
        n
    }

    fn up_workers(&self, except: Option<u16>) -> Vec<Owner> {
        let mut v = Vec::new();
        for (s, info) in self.map.servers().iter().enumerate() {
            let s = s as u16;
            if self.members[s as usize].state == MemberState::Up && Some(s) != except {
                v.extend((0..info.workers.len() as u16).map(|w| (s, w)));
            }
        }
        v
    }

    /// `cachelets`, spread over `targets`: each to the target worker with
    /// the fewest cachelets (ties: the lighter server, then the lowest
    /// (server, worker)), counting what it was given already. Deterministic.
    fn spread(&self, cachelets: &[CacheletId], targets: &[Owner]) -> Vec<(CacheletId, Owner)> {
        let mut n = self.per_worker();
        let mut total = vec![0usize; self.map.servers().len()];
        for (&(s, _), &k) in &n {
            total[s as usize] += k;
        }
        let mut moves = Vec::with_capacity(cachelets.len());
        for &c in cachelets {
            let Some(&to) = targets.iter().min_by_key(|&&t| (n[&t], total[t.0 as usize], t)) else { break };
            let from = self.map.owner(c);
            *n.get_mut(&from).expect("owner is a worker") -= 1;
            total[from.0 as usize] -= 1;
            *n.get_mut(&to).expect("target is a worker") += 1;
            total[to.0 as usize] += 1;
            moves.push((c, to));
        }
        moves
    }

    /// Cachelets owned by servers in `servers`, in id order.
    fn owned_by(&self, servers: impl Fn(u16) -> bool) -> Vec<CacheletId> {
        (0..self.map.cachelet_count()).filter(|&c| servers(self.map.owner(c).0)).collect()
    }

    /// The moves that give `id` (Up, in the map) its share: first every
    /// cachelet of a server that is not Up (spread over the Up workers,
    /// fewest first), then from the Up workers with the most cachelets
    /// until `id` holds its share (the cachelets times its part of the Up
    /// workers, rounded down). Every moved cachelet arrives empty.
    fn share_moves(&self, id: u16) -> Vec<(CacheletId, Owner)> {
        let targets = self.up_workers(None);
        let orphans = self.owned_by(|s| s != id && self.members[s as usize].state != MemberState::Up);
        let mut moves = self.spread(&orphans, &targets);
        let mut owners = self.map.owners().to_vec();
        for &(c, o) in &moves {
            owners[c as usize] = o;
        }
        let mine: Vec<Owner> = targets.iter().copied().filter(|t| t.0 == id).collect();
        if mine.is_empty() {
            return moves;
        }
        let share = self.map.cachelet_count() as usize * mine.len() / targets.len();
        let mut n: BTreeMap<Owner, Vec<CacheletId>> = targets.iter().map(|&t| (t, Vec::new())).collect();
        for (c, o) in owners.iter().enumerate() {
            if let Some(v) = n.get_mut(o) {
                v.push(c as CacheletId);
            }
        }
        let mut total = vec![0usize; self.map.servers().len()];
        for (&(s, _), v) in &n {
            total[s as usize] += v.len();
        }
        while total[id as usize] < share {
            // The richest other server's richest worker (ties: the lowest
            // ids), its highest cachelet, to our poorest worker.
            let donor = targets
                .iter()
                .filter(|t| t.0 != id)
                .copied()
                .max_by_key(|t| (total[t.0 as usize], n[t].len(), std::cmp::Reverse(*t)));
            let Some(donor) = donor else { break };
            let to = mine.iter().copied().min_by_key(|t| (n[t].len(), *t)).expect("mine is not empty");
            if total[donor.0 as usize] <= total[id as usize] + 1 {
                break; // taking more would only move the imbalance
            }
            total[donor.0 as usize] -= 1;
            total[id as usize] += 1;
            let c = n.get_mut(&donor).and_then(Vec::pop).expect("the donor holds a cachelet");
            n.get_mut(&to).expect("a worker of id").push(c);
            moves.retain(|&(m, _)| m != c);
            moves.push((c, to));
        }
        moves.sort_unstable();
        moves
    }

    /// `mbal register`: `id` None finds the server by its main address or,
    /// if none has it, joins a new one. The reply's error (after
    /// `CLIENT_ERROR `) when refused.
    pub fn register(
        &mut self,
        id: Option<u16>,
        info: ServerInfo,
        memory_bytes: u64,
        now: Instant,
    ) -> Result<Registered, String> {
        let r = self.register_inner(id, info, memory_bytes, now);
        match &r {
            Ok(_) => self.counters.registrations += 1,
            Err(_) => self.counters.register_refused += 1,
        }
        r
    }

    fn register_inner(
        &mut self,
        id: Option<u16>,
        info: ServerInfo,
        memory_bytes: u64,
        now: Instant,
    ) -> Result<Registered, String> {
        if info.workers.is_empty() || info.workers.len() > u16::MAX as usize {
            return Err("a server needs 1 to 65535 workers".into());
        }
        let known = match id {
            Some(id) => {
                let Some(s) = self.map.servers().get(id as usize) else {
                    return Err(format!("no server {id}"));
                };
                if s.main != info.main {
                    return Err(format!("server {id} is {}", s.main));
                }
                Some(id)
            }
            None => self.map.servers().iter().position(|s| s.main == info.main).map(|i| i as u16),
        };
        let Some(id) = known else {
            // A join: a new server, Up, with its share; one epoch bump.
            if self.map.servers().len() >= u16::MAX as usize {
                return Err("the map has the most servers it can have".into());
            }
            let id = self.map.servers().len() as u16;
            let mut with = self.clone();
            with.map.add_server(info.clone());
            with.members.push(Member { state: MemberState::Up, memory_bytes });
            let moves = with.share_moves(id);
            let epoch = self.map.update(&[(id, info)], &moves)?;
            self.members.push(Member { state: MemberState::Up, memory_bytes });
            self.last_beat.push(Some(now));
            self.counters.joins += 1;
            self.dirty = true;
            return Ok(Registered { id, epoch, joined: true, given: moves.len() });
        };
        let have = self.map.servers()[id as usize].workers.len();
        if have != info.workers.len() {
            return Err(format!("server {id} has {have} workers, not {}", info.workers.len()));
        }
        let changed_addrs = self.map.servers()[id as usize] != info;
        let was = self.members[id as usize].state;
        self.members[id as usize].memory_bytes = memory_bytes;
        self.last_beat[id as usize] = Some(now);
        self.dirty = true;
        if was == MemberState::Up {
            // It restarted quickly: it keeps its cachelets.
            if changed_addrs {
                self.map.set_server(id, info)?;
            }
            return Ok(Registered { id, epoch: self.map.epoch(), joined: false, given: 0 });
        }
        // Back from Down or Left: Up again, with its share, as a join.
        let mut with = self.clone();
        with.members[id as usize].state = MemberState::Up;
        let moves = with.share_moves(id);
        let servers = if changed_addrs { vec![(id, info)] } else { Vec::new() };
        let epoch = self.map.update(&servers, &moves)?;
        self.members[id as usize].state = MemberState::Up;
        self.counters.joins += 1;
        Ok(Registered { id, epoch, joined: true, given: moves.len() })
    }

    /// `mbal beat <id>`.
    pub fn beat(&mut self, id: u16, now: Instant) -> Beat {
        self.counters.beats += 1;
        match self.state(id) {
            None => Beat::NoServer,
            Some(MemberState::Up) => {
                self.last_beat[id as usize] = Some(now);
                Beat::Up { epoch: self.map.epoch() }
            }
            Some(state) => Beat::Gone { left: state == MemberState::Left },
        }
    }

    /// `mbal leave <id>`: its cachelets (empty) to the other Up servers, it
    /// becomes Left. Refused when no other server is Up.
    pub fn leave(&mut self, id: u16) -> Result<u64, LeaveError> {
        if self.state(id).is_none() {
            return Err(LeaveError::NoServer);
        }
        let targets = self.up_workers(Some(id));
        if targets.is_empty() {
            return Err(LeaveError::NoOtherServer);
        }
        let moves = self.spread(&self.owned_by(|s| s == id), &targets);
        let epoch = self.map.reassign(&moves).map_err(LeaveError::Map)?;
        self.members[id as usize].state = MemberState::Left;
        self.migrations_lost(&[id], Instant::now());
        self.counters.leaves += 1;
        self.dirty = true;
        Ok(epoch)
    }

    /// `mbal moved <id> <cachelet> <worker>`: a server's local move. The
    /// cachelet must be `id`'s, `id` Up and `worker` one of its workers.
    /// A move to the owner it has already changes nothing (same epoch).
    pub fn moved(&mut self, id: u16, c: CacheletId, worker: u16) -> Result<u64, String> {
        let Some(state) = self.state(id) else { return Err(format!("no server {id}")) };
        if state != MemberState::Up {
            return Err(format!("server {id} is {}", state.name()));
        }
        if c >= self.map.cachelet_count() {
            return Err(format!("no cachelet {c}: the map has {}", self.map.cachelet_count()));
        }
        let (s, w) = self.map.owner(c);
        if s != id {
            return Err(format!("cachelet {c} is server {s}'s, not server {id}'s"));
        }
        if !self.map.has_worker((id, worker)) {
            return Err(format!("server {id} has no worker {worker}"));
        }
        if w == worker {
            return Ok(self.map.epoch());
        }
        let epoch = self.map.reassign(&[(c, (id, worker))])?;
        self.counters.moves += 1;
        self.dirty = true;
        Ok(epoch)
    }

    /// Is `s` Up with its last heartbeat older than the failure timeout?
    fn overdue(&self, s: u16, now: Instant) -> bool {
        self.members[s as usize].state == MemberState::Up
            && self.last_beat[s as usize].is_none_or(|t| now.saturating_duration_since(t) > self.timing.failure_timeout)
    }

    /// Would [`Coord::check`] at `now` find a dead server?
    pub fn any_overdue(&self, now: Instant) -> bool {
        (0..self.members.len() as u16).any(|s| self.overdue(s, now))
    }

    /// The failure check at `now`: every Up member whose last heartbeat is
    /// older than the failure timeout becomes Down, and all their cachelets
    /// go (empty) to the Up servers' workers, fewest first, under ONE epoch
    /// bump. With no Up server left nothing is reassigned.
    pub fn check(&mut self, now: Instant) -> Failures {
        let dead: Vec<u16> = (0..self.members.len() as u16).filter(|&s| self.overdue(s, now)).collect();
        if dead.is_empty() {
            return Failures::default();
        }
        for &s in &dead {
            self.members[s as usize].state = MemberState::Down;
        }
        self.migrations_lost(&dead, now);
        self.counters.failures_detected += dead.len() as u64;
        self.dirty = true;
        let orphans = self.owned_by(|s| dead.contains(&s));
        let targets = self.up_workers(None);
        if targets.is_empty() || orphans.is_empty() {
            return Failures { down: dead, reassigned: 0, epoch: None };
        }
        let moves = self.spread(&orphans, &targets);
        let epoch = self.map.reassign(&moves).expect("moves to Up workers of the map");
        Failures { down: dead, reassigned: moves.len(), epoch: Some(epoch) }
    }

    /// Every Up member's last heartbeat counts as `now` (at start, and when
    /// the coordinator itself was not running for a while).
    pub fn grace(&mut self, now: Instant) {
        for (m, t) in self.members.iter().zip(&mut self.last_beat) {
            if m.state == MemberState::Up {
                *t = Some(now);
            }
        }
    }

    /// The rows of `mbal members`, by id.
    pub fn member_rows(&self, now: Instant) -> Vec<MemberRow> {
        let n = self.per_worker();
        self.map
            .servers()
            .iter()
            .enumerate()
            .map(|(s, info)| MemberRow {
                id: s as u16,
                main: info.main,
                state: self.members[s].state,
                workers: info.workers.len(),
                cachelets: n.range((s as u16, 0)..=(s as u16, u16::MAX)).map(|(_, k)| k).sum(),
                ms_since_beat: self.last_beat[s].map(|t| now.saturating_duration_since(t).as_millis() as u64),
            })
            .collect()
    }
}

/// Why a leave was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaveError {
    NoServer,
    NoOtherServer,
    Map(String),
}

mod migrations;
pub use migrations::{AbortOutcome, Migration, Migrations};

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` servers x 2 workers x 4 cachelets, every server Up at `t0`.
    pub(super) fn coord_with(n: u16, t0: Instant) -> Coord {
        coord(n, 2, 4, t0)
    }

    fn info(i: u16, workers: u16) -> ServerInfo {
        let main: std::net::SocketAddr = format!("127.0.0.1:{}", 20000 + i * 100).parse().unwrap();
        ServerInfo {
            main,
            workers: (0..workers).map(|w| format!("127.0.0.1:{}", 20001 + i * 100 + w).parse().unwrap()).collect(),
        }
    }

    /// `n` servers x `w` workers x `cpw` cachelets, every server Up at `t0`.
    fn coord(n: u16, w: u16, cpw: u32, t0: Instant) -> Coord {
        let map = ClusterMap::even((0..n).map(|i| info(i, w)).collect(), cpw, 4096);
        Coord::new(Stored::initial(map), Timing::default(), t0).unwrap()
    }

    fn per_server(c: &Coord) -> Vec<usize> {
        c.member_rows(Instant::now()).iter().map(|r| r.cachelets).collect()
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn timing_must_put_the_lease_before_the_failure_timeout() {
        assert!(Timing::default().validate().is_ok());
        let t = |b, l, f| Timing { beat: ms(b), lease: ms(l), failure_timeout: ms(f) }.validate();
        assert!(t(100, 600, 600).unwrap_err().contains("lease"));
        assert!(t(400, 400, 600).unwrap_err().contains("beat"));
        assert!(t(0, 400, 600).is_err());
    }

    #[test]
    fn joins_take_an_even_share_with_one_epoch_bump_each() {
        let t0 = Instant::now();
        let mut c = coord(3, 2, 4, t0);
        assert_eq!(per_server(&c), vec![8, 8, 8]);
        for (k, want) in [(3u16, vec![6, 6, 6, 6]), (4, vec![5, 5, 5, 5, 4])] {
            let before = c.map().clone();
            let r = c.register(None, info(k, 2), 1 << 20, t0).unwrap();
            assert_eq!((r.id, r.epoch, r.joined), (k, before.epoch() + 1, true));
            assert_eq!(per_server(&c), want);
            assert!(c.take_dirty());
            // Only the joiner gained; nobody else did.
            let d = before.diff(c.map());
            assert_eq!(d.moves.len(), r.given);
            assert!(d.moves.iter().all(|&(_, (s, _))| s == k));
            // Its workers evenly.
            let mine: Vec<usize> = (0..2).map(|w| c.map().cachelets_of(k, w).len()).collect();
            assert!(mine[0].abs_diff(mine[1]) <= 1, "{mine:?}");
        }
        // One worker servers, one at a time: within one of each other.
        let mut c = coord(2, 1, 3, t0);
        for k in 2..6 {
            c.register(None, info(k, 1), 0, t0).unwrap();
            let p = per_server(&c);
            assert!(p.iter().max().unwrap() - p.iter().min().unwrap() <= 1, "{p:?}");
            assert_eq!(p.iter().sum::<usize>(), 6);
        }
        assert_eq!(c.counters.joins, 4);
    }

    #[test]
    fn registration_checks_ids_and_workers() {
        let t0 = Instant::now();
        let mut c = coord(2, 2, 2, t0);
        let e = c.epoch();
        // Id theft: server 1 claimed from server 0's address.
        assert_eq!(c.register(Some(1), info(0, 2), 0, t0).unwrap_err(), "server 1 is 127.0.0.1:20100");
        assert!(c.register(Some(7), info(0, 2), 0, t0).unwrap_err().contains("no server 7"));
        assert!(c.register(Some(0), info(0, 3), 0, t0).unwrap_err().contains("2 workers"));
        assert!(c.register(None, info(0, 1), 0, t0).unwrap_err().contains("2 workers"), "found by address");
        assert_eq!(c.counters.register_refused, 4);
        assert_eq!(c.epoch(), e, "refusals change nothing");
        assert!(!c.take_dirty());
        // An Up server registering again (a quick restart) keeps its cachelets.
        let r = c.register(Some(1), info(1, 2), 7, t0).unwrap();
        assert_eq!((r.id, r.epoch, r.joined), (1, e, false));
        let r = c.register(None, info(0, 2), 0, t0).unwrap();
        assert_eq!((r.id, r.epoch), (0, e));
        assert_eq!(per_server(&c), vec![4, 4]);
        // New worker ports: the map follows, its cachelets stay.
        let mut moved = info(1, 2);
        moved.workers[1] = "127.0.0.1:29999".parse().unwrap();
        let r = c.register(Some(1), moved, 7, t0).unwrap();
        assert_eq!(r.epoch, e + 1);
        assert_eq!(c.map().worker_addr(1, 1).port(), 29999);
        assert_eq!(per_server(&c), vec![4, 4]);
        assert_eq!(c.members()[1].memory_bytes, 7);
    }

    #[test]
    fn beats_keep_a_server_up_and_the_silent_one_goes_down_with_everything_it_had() {
        let t0 = Instant::now();
        let mut c = coord(3, 2, 4, t0);
        // The grace period: nobody is down before the timeout.
        assert_eq!(c.check(t0 + ms(600)), Failures::default());
        for t in [200, 400, 600, 800] {
            assert_eq!(c.beat(0, t0 + ms(t)), Beat::Up { epoch: 1 });
            assert_eq!(c.beat(2, t0 + ms(t)), Beat::Up { epoch: 1 });
        }
        assert!(!c.any_overdue(t0 + ms(600)));
        assert!(c.any_overdue(t0 + ms(601)));
        let before = c.map().clone();
        let f = c.check(t0 + ms(601));
        assert_eq!(f.down, vec![1]);
        assert_eq!(f.reassigned, 8);
        assert_eq!(f.epoch, Some(2), "one bump for the whole reassignment");
        assert_eq!(c.counters.failures_detected, 1);
        assert!(c.take_dirty());
        // Everything of server 1 moved, nothing else, evenly.
        let d = before.diff(c.map());
        assert_eq!(d.moves.len(), 8);
        assert!(d.moves.iter().all(|&(cl, (s, _))| before.owner(cl).0 == 1 && s != 1));
        assert_eq!(per_server(&c), vec![12, 0, 12]);
        for w in [(0, 0), (0, 1), (2, 0), (2, 1)] {
            assert_eq!(c.map().cachelets_of(w.0, w.1).len(), 6);
        }
        assert_eq!(c.beat(1, t0 + ms(700)), Beat::Gone { left: false });
        assert_eq!(c.beat(9, t0), Beat::NoServer);
        assert_eq!(c.check(t0 + ms(800)), Failures::default(), "nothing more to do");
        // It comes back: Up again, with its share, one bump.
        let r = c.register(Some(1), info(1, 2), 0, t0 + ms(900)).unwrap();
        assert!(r.joined);
        assert_eq!(r.epoch, 3);
        assert_eq!(per_server(&c), vec![8, 8, 8]);
        assert_eq!(c.beat(1, t0 + ms(950)), Beat::Up { epoch: 3 });
    }

    #[test]
    fn with_no_server_left_nothing_is_reassigned_and_a_rejoin_takes_the_orphans() {
        let t0 = Instant::now();
        let mut c = coord(2, 1, 2, t0);
        let f = c.check(t0 + ms(601));
        assert_eq!(f, Failures { down: vec![0, 1], reassigned: 0, epoch: None });
        assert_eq!(c.count(MemberState::Down), 2);
        assert_eq!(c.epoch(), 1);
        // Server 1 comes back first: it takes server 0's cachelets too.
        let r = c.register(Some(1), info(1, 1), 0, t0 + ms(700)).unwrap();
        assert_eq!(r.epoch, 2);
        assert_eq!(per_server(&c), vec![0, 4]);
        let r = c.register(Some(0), info(0, 1), 0, t0 + ms(700)).unwrap();
        assert_eq!(r.epoch, 3);
        assert_eq!(per_server(&c), vec![2, 2]);
    }

    #[test]
    fn leave_hands_over_to_the_others_and_the_last_cannot_leave() {
        let t0 = Instant::now();
        let mut c = coord(3, 2, 2, t0);
        assert_eq!(c.leave(1), Ok(2));
        assert_eq!(per_server(&c), vec![6, 0, 6]);
        assert_eq!(c.members()[1].state, MemberState::Left);
        assert_eq!(c.beat(1, t0), Beat::Gone { left: true });
        assert_eq!(c.leave(0), Ok(3));
        assert_eq!(c.leave(2), Err(LeaveError::NoOtherServer));
        assert_eq!(c.leave(5), Err(LeaveError::NoServer));
        assert_eq!(per_server(&c), vec![0, 0, 12]);
        assert_eq!(c.epoch(), 3);
        assert_eq!(c.counters.leaves, 2);
    }

    #[test]
    fn a_local_move_is_checked() {
        let t0 = Instant::now();
        let mut c = coord(2, 2, 2, t0);
        let mine = c.map().cachelets_of(0, 0)[0];
        let theirs = c.map().cachelets_of(1, 0)[0];
        assert_eq!(c.moved(0, mine, 1), Ok(2));
        assert_eq!(c.map().owner(mine), (0, 1));
        assert_eq!(c.moved(0, mine, 1), Ok(2), "already there: no bump");
        assert!(c.moved(0, theirs, 1).unwrap_err().contains("server 1's"));
        assert!(c.moved(0, mine, 2).unwrap_err().contains("no worker 2"));
        assert!(c.moved(0, 999, 0).unwrap_err().contains("no cachelet"));
        assert!(c.moved(4, mine, 0).unwrap_err().contains("no server 4"));
        c.leave(1).unwrap();
        let now_mine = c.map().cachelets_of(0, 0)[0];
        c.check(t0 + ms(601));
        assert!(c.moved(0, now_mine, 1).unwrap_err().contains("is down"));
        assert_eq!(c.counters.moves, 1);
    }

    #[test]
    fn member_rows_show_state_counts_and_beat_age() {
        let t0 = Instant::now();
        let mut c = coord(2, 2, 2, t0);
        c.beat(0, t0 + ms(100));
        c.leave(1).unwrap();
        let rows = c.member_rows(t0 + ms(150));
        assert_eq!(rows[0].ms_since_beat, Some(50));
        assert_eq!((rows[0].state, rows[0].cachelets, rows[0].workers), (MemberState::Up, 8, 2));
        assert_eq!((rows[1].state, rows[1].cachelets), (MemberState::Left, 0));
        // After a restart a member that is not Up has no known beat.
        let c2 = Coord::new(c.stored(), Timing::default(), t0).unwrap();
        assert_eq!(c2.member_rows(t0)[1].ms_since_beat, None);
        assert_eq!(c2.member_rows(t0)[0].ms_since_beat, Some(0));
    }
}
