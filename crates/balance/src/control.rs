//! The controller's policy core: one value that takes events and returns
//! commands (DESIGN.md §6, "Where the policy runs"), with no I/O, no
//! threads and no clock. The server's controller thread is an adapter
//! around it (it turns its mailbox's messages into [`Event`]s and the
//! [`Command`]s into messages to workers and replies to clients); the
//! coordinator and `mbal sim` are meant to drive the same core.
//!
//! What it decides today (one server's view):
//! * the sampling rounds: when a round starts ([`Event::Tick`] while none
//!   is open: a round a stalled worker holds open makes the next epoch
//!   longer), and when one is complete, the [`EpochSnapshot`] it closes
//!   (from the previous complete round, [`Baseline`]);
//! * Phase 2's cadence: it decides once per `balance_every` rounds on the
//!   counters since its last decision merged, through the [`Balancer`];
//! * every cachelet move of this server: whether a balancer's move is
//!   still valid (the cachelet is where the policy thought, not already
//!   moving, to a worker that exists), the move tokens, one move per
//!   cachelet at a time with later asks queued in arrival order, the
//!   cluster map's owners and epoch as moves end, and what the balancer is
//!   told of each;
//! * Phase 2's figures for `stats balancer` ([`BalancerStatus`]).
//!
//! Not yet here (still in the server's controller, `crates/server/src/control.rs`):
//! Phase 1's epoch (`HotKeys::on_epoch` with the cluster's mean), its
//! alarms, copies, grants and the REPL_high slots lent between servers.
//! The core hands the adapter each closed epoch ([`Command::Epoch`]) for
//! those.
//!
//! Deterministic: the same events in the same order give the same
//! commands (the planner's budget is counted in nodes, not time).
//! `R` is the adapter's handle of a client waiting for an answer; the core
//! only carries it.

use crate::policy::{Balancer, Decision, Move, Why};
use crate::snapshot::{Baseline, EpochSnapshot, WorkerSample};
use crate::Config;
use mbal_cluster::{CacheletId, ClusterMap};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// A move's token: the adopter names it when the move ends.
pub type Token = u64;

/// What the core is told.
#[derive(Clone, Debug, PartialEq)]
pub enum Event<R> {
    /// The epoch timer fired: start a sampling round unless one is open.
    Tick,
    /// A worker's counters for sampling round `seq`.
    Sample { seq: u64, sample: WorkerSample },
    /// Move `cachelet` to `to` (`mbal move`): answer `reply` once done.
    MoveAsked { cachelet: CacheletId, to: u16, reply: R },
    /// Move `token` ended: `worker` of this server owns `cachelet` now.
    Moved { token: Token, cachelet: CacheletId, worker: u16 },
}

/// An answer to a client that asked for a move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoveAnswer {
    /// Done (or nothing to do): the map's epoch after it.
    Moved { epoch: u64 },
    /// The cachelet is not on this server, or there is no such worker.
    NotHere,
}

/// What the core asks the adapter to do, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum Command<R> {
    /// Ask every worker for its counters, for round `seq`.
    SampleWorkers { seq: u64 },
    /// Ask worker `from` to hand `cachelet` over to worker `to`.
    Release { cachelet: CacheletId, from: u16, to: u16, token: Token },
    /// Answer a client waiting on a move.
    Reply { to: R, answer: MoveAnswer },
    /// The map's epoch advanced to this (a move ended).
    MapEpoch(u64),
    /// An epoch closed: its snapshot, and Phase 2's decision when it
    /// decided at this epoch.
    Epoch { snapshot: Arc<EpochSnapshot>, balancer: Option<Decision> },
    /// Phase 2's figures changed.
    Status(BalancerStatus),
}

/// Phase 2's figures for `stats balancer` (the planner's wall-clock time
/// is the adapter's to measure: the core has no clock).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BalancerStatus {
    pub state: String,
    pub epoch: u64,
    /// Per worker: requests per second (weighted) over Phase 2's last epoch.
    pub loads: Vec<(u16, f64)>,
    pub max_over_avg: f64,
    pub imbalance_factor: f64,
    pub plans: u64,
    pub moves: u64,
    pub moves_home: u64,
    pub moves_failed: u64,
    pub escalations: u64,
    pub leases: usize,
    pub planner_us_last: u64,
    pub planner_us_max: u64,
}

/// The core's settings.
#[derive(Clone, Debug)]
pub struct CoreSettings {
    /// This server's id in the map.
    pub server: u16,
    /// Its workers.
    pub workers: u16,
    /// Phase 2 decides every this many rounds (at least 1).
    pub balance_every: u64,
    /// Phase 2's policy, when it runs (`None`: the balancer is off).
    pub balancer: Option<Config>,
}

/// A move under way.
#[derive(Clone, Debug)]
struct Moving<R> {
    token: Token,
    to: u16,
    waiters: Vec<R>,
    /// The balancer's move, if it decided this one.
    by_balancer: Option<Move>,
}

/// The controller's policy core (see the module's documentation).
#[derive(Debug)]
pub struct ControlCore<R> {
    settings: CoreSettings,
    map: ClusterMap,
    /// Sampling rounds started; the baseline round is 0.
    round: u64,
    /// The round being gathered: a slot per worker.
    gathering: Option<Vec<Option<WorkerSample>>>,
    /// The previous complete round, with the last counts of the cachelets
    /// it missed.
    prev: Baseline,
    /// Phase 2 decides on the load since this round (its last decision).
    balance_prev: Baseline,
    balancer: Option<Balancer>,
    status: BalancerStatus,
    next_token: Token,
    moving: HashMap<CacheletId, Moving<R>>,
    /// Moves asked for while their cachelet was moving, in arrival order.
    queued: VecDeque<(CacheletId, u16, R)>,
}

impl<R: Clone> ControlCore<R> {
    /// A core for server `settings.server` of `map`; Phase 2's homes are
    /// the map's owners now.
    pub fn new(settings: CoreSettings, map: ClusterMap) -> ControlCore<R> {
        let balancer = settings.balancer.clone().map(|cfg| {
            let home: Vec<(u32, u16)> = (0..map.cachelet_count())
                .filter_map(|c| {
                    let (s, w) = map.owner(c);
                    (s == settings.server).then_some((c, w))
                })
                .collect();
            Balancer::new(cfg, &home)
        });
        ControlCore {
            settings: CoreSettings { balance_every: settings.balance_every.max(1), ..settings },
            map,
            round: 0,
            gathering: None,
            prev: Baseline::default(),
            balance_prev: Baseline::default(),
            balancer,
            status: BalancerStatus::default(),
            next_token: 1,
            moving: HashMap::new(),
            queued: VecDeque::new(),
        }
    }

    /// The cluster map as this server knows it.
    pub fn map(&self) -> &ClusterMap {
        &self.map
    }

    /// Phase 2's policy, when it runs.
    pub fn balancer(&self) -> Option<&Balancer> {
        self.balancer.as_ref()
    }

    /// Phase 2's figures now.
    pub fn status(&self) -> &BalancerStatus {
        &self.status
    }

    /// Is a sampling round open (asked for, not every worker answered)?
    pub fn gathering(&self) -> bool {
        self.gathering.is_some()
    }

    /// Take one event; the commands it gives, in the order to carry them out.
    pub fn step(&mut self, event: Event<R>) -> Vec<Command<R>> {
        let mut out = Vec::new();
        match event {
            Event::Tick => {
                if self.gathering.is_none() {
                    self.start_round(&mut out);
                }
            }
            Event::Sample { seq, sample } => self.sampled(seq, sample, &mut out),
            Event::MoveAsked { cachelet, to, reply } => self.request_move(cachelet, to, reply, &mut out),
            Event::Moved { token, cachelet, worker } => self.moved(token, cachelet, worker, &mut out),
        }
        out
    }

    fn start_round(&mut self, out: &mut Vec<Command<R>>) {
        self.gathering = Some(vec![None; usize::from(self.settings.workers)]);
        out.push(Command::SampleWorkers { seq: self.round });
    }

    fn sampled(&mut self, seq: u64, sample: WorkerSample, out: &mut Vec<Command<R>>) {
        if seq != self.round {
            return;
        }
        let Some(slots) = &mut self.gathering else { return };
        if let Some(slot) = slots.get_mut(usize::from(sample.worker)) {
            *slot = Some(sample);
        }
        if slots.iter().any(Option::is_none) {
            return;
        }
        let cur: Vec<WorkerSample> = self.gathering.take().into_iter().flatten().flatten().collect();
        // Phase 2's round: it decides on the load since its last one.
        let every = self.settings.balance_every;
        let phase2 = self.balancer.is_some() && self.round.is_multiple_of(every);
        if self.round > 0 {
            let snap = Arc::new(self.prev.epoch_to(self.round, &cur));
            let decision = match (phase2, every) {
                (false, _) => None,
                (true, 1) => self.balance(&snap, out),
                (true, _) => {
                    let merged = self.balance_prev.epoch_to(self.round, &cur);
                    self.balance(&merged, out)
                }
            };
            out.push(Command::Epoch { snapshot: snap, balancer: decision });
        }
        // With a Phase 2 epoch of one epoch, Phase 2 used the snapshot: no
        // baseline of its own to keep.
        if phase2 && every > 1 {
            self.balance_prev.advance(cur.clone());
        }
        self.prev.advance(cur);
        self.round += 1;
    }

    /// Run Phase 2 over one of its epochs and start the moves it decides.
    fn balance(&mut self, snap: &EpochSnapshot, out: &mut Vec<Command<R>>) -> Option<Decision> {
        let d = self.balancer.as_mut()?.on_epoch(snap);
        let st = &mut self.status;
        st.epoch = snap.seq;
        st.state = format!("{:?}", d.state);
        st.loads = d.loads.clone();
        st.max_over_avg = d.imbalance.max_over_avg;
        st.imbalance_factor = d.imbalance.factor;
        st.plans += u64::from(d.plan.is_some());
        st.escalations += u64::from(d.escalate.is_some());
        st.leases = d.leases;
        for m in &d.moves {
            self.balancer_move(*m, out);
        }
        out.push(Command::Status(self.status.clone()));
        Some(d)
    }

    /// Carry out one of the balancer's moves, unless the cachelet is
    /// already moving or is no longer where the policy thought.
    fn balancer_move(&mut self, m: Move, out: &mut Vec<Command<R>>) {
        let ok = m.cachelet < self.map.cachelet_count() && {
            let (server, from) = self.map.owner(m.cachelet);
            server == self.settings.server
                && from == m.from
                && m.to < self.settings.workers
                && !self.moving.contains_key(&m.cachelet)
        };
        if !ok {
            self.status.moves_failed += 1;
            if let Some(b) = &mut self.balancer {
                b.applied(&m, false);
            }
            return;
        }
        self.send_release(m.cachelet, m.from, m.to, Vec::new(), Some(m), out);
    }

    /// Start a move now, or queue it behind the cachelet's current one.
    fn request_move(&mut self, c: CacheletId, to: u16, reply: R, out: &mut Vec<Command<R>>) {
        if let Some(m) = self.moving.get_mut(&c) {
            if m.to == to {
                // The same move again: one answer when it is done.
                m.waiters.push(reply);
            } else {
                self.queued.push_back((c, to, reply));
            }
            return;
        }
        if c >= self.map.cachelet_count() || to >= self.settings.workers {
            out.push(Command::Reply { to: reply, answer: MoveAnswer::NotHere });
            return;
        }
        let (server, from) = self.map.owner(c);
        if server != self.settings.server {
            out.push(Command::Reply { to: reply, answer: MoveAnswer::NotHere });
            return;
        }
        if from == to {
            out.push(Command::Reply { to: reply, answer: MoveAnswer::Moved { epoch: self.map.epoch() } });
            return;
        }
        self.send_release(c, from, to, vec![reply], None, out);
    }

    fn send_release(
        &mut self,
        c: CacheletId,
        from: u16,
        to: u16,
        waiters: Vec<R>,
        by_balancer: Option<Move>,
        out: &mut Vec<Command<R>>,
    ) {
        let token = self.next_token;
        self.next_token += 1;
        self.moving.insert(c, Moving { token, to, waiters, by_balancer });
        out.push(Command::Release { cachelet: c, from, to, token });
    }

    fn moved(&mut self, token: Token, c: CacheletId, worker: u16, out: &mut Vec<Command<R>>) {
        if c >= self.map.cachelet_count() || worker >= self.settings.workers {
            debug_assert!(false, "a move to cachelet {c} worker {worker}, which do not exist");
            return;
        }
        let epoch = self.map.move_cachelet(c, (self.settings.server, worker));
        out.push(Command::MapEpoch(epoch));
        match self.moving.remove(&c) {
            Some(m) if m.token == token => {
                for r in m.waiters {
                    out.push(Command::Reply { to: r, answer: MoveAnswer::Moved { epoch } });
                }
                if let Some(bal) = &mut self.balancer {
                    match m.by_balancer {
                        Some(bm) => {
                            bal.applied(&bm, true);
                            self.status.moves += 1;
                            self.status.moves_home += u64::from(bm.why == Why::LeaseExpired);
                        }
                        // An operator's move: the cachelet's home is where
                        // they put it.
                        None => bal.set_home(c, worker),
                    }
                    self.status.leases = bal.leases().len();
                    out.push(Command::Status(self.status.clone()));
                }
            }
            Some(m) => {
                // Not the move we are waiting for: cannot happen while all
                // moves start here; keep waiting for ours.
                debug_assert!(false, "move {token} finished while {} was under way", m.token);
                self.moving.insert(c, m);
            }
            None => debug_assert!(false, "a move nobody started"),
        }
        // The next moves asked for this cachelet, until one is under way
        // (a move to where it already is is answered at once).
        while !self.moving.contains_key(&c) {
            let Some(i) = self.queued.iter().position(|q| q.0 == c) else { break };
            let (c, to, reply) = self.queued.remove(i).expect("just found");
            self.request_move(c, to, reply, out);
        }
    }
}

#[cfg(test)]
mod tests;
