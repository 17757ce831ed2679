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
//! * Phase 2's figures for `stats balancer` ([`BalancerStatus`]);
//! * Phase 1 ([`phase1`]): the sampled keys into `HotKeys`, its epoch on
//!   the cluster's mean (the other servers' records come in as
//!   [`Event::PeerLoad`]), alarms between epochs, which copies to make,
//!   renew and delete, the leases home workers may grant, pins, and its
//!   figures for `stats hotkeys` ([`HotStatus`]);
//! * the REPL_high slots lent between servers ([`slots`]): what to ask
//!   whom, what to lend, leases, a starting server's question.
//!
//! Deterministic: the same events at the same times give the same
//! commands (time comes in with each event, the planner's budget is
//! counted in nodes). `R` is the adapter's handle of a client waiting for
//! an answer; the core only carries it.

mod peers;
pub mod phase1;
pub mod slots;

pub use peers::{PeerHot, PeerRecords};
pub use phase1::{Grant, HotCommand, HotSettings, HotStatus};

use crate::hot::{HotKeyStat, HotKeys, ReplicaDecision, SlotLedger};
use crate::policy::{Balancer, Decision, Move, Why};
use crate::snapshot::{Baseline, EpochSnapshot, WorkerSample};
use crate::Config;
use mbal_cluster::{CacheletId, ClusterMap, Owner};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

/// A move's token: the adopter names it when the move ends.
pub type Token = u64;

/// A key a worker sampled (`true`: a write).
pub type SampledKey = (Box<[u8]>, bool);

/// What the core is told.
#[derive(Clone, Debug, PartialEq)]
pub enum Event<R> {
    /// The server started: the baseline round, and a starting server's
    /// question to the others (how many of its slots they hold).
    Start,
    /// The epoch timer fired: give back and renew REPL_high slots, and
    /// start a sampling round unless one is open.
    Tick,
    /// A worker's counters for sampling round `seq`, the keys it sampled
    /// since its last sample, and the reads its replicated keys got at home
    /// since then (exact counts).
    Sample { seq: u64, sample: WorkerSample, keys: Vec<SampledKey>, home_reads: Vec<(Box<[u8]>, u64)> },
    /// Move `cachelet` to `to` (`mbal move`): answer `reply` once done.
    MoveAsked { cachelet: CacheletId, to: u16, reply: R },
    /// Move `token` ended: `worker` of this server owns `cachelet` now.
    Moved { token: Token, cachelet: CacheletId, worker: u16 },
    /// `cachelet` arrived from another server at `worker` (its move committed at the
    /// coordinator; the map that shows it may come later): this server's map has it there.
    Arrived { cachelet: CacheletId, worker: u16 },
    /// A key's copies were made (`created`) or renewed by a job started at
    /// `at_ns` (`ok`), or could not be; a renewal brings the reads the
    /// copies served since the last one.
    HotDone { key: Box<[u8]>, created: bool, ok: bool, at_ns: u64, copy_reads: u64 },
    /// A home worker could not replicate `key` (the item is gone, a write
    /// could not be copied).
    HotFailed { key: Box<[u8]> },
    /// A worker ran hot for `secs` seconds between epochs, with the keys it
    /// sampled meanwhile and its replicated keys' reads at home over
    /// `home_secs`.
    HotAlarm { worker: u16, keys: Vec<SampledKey>, secs: f64, home: Vec<(Box<[u8]>, u64)>, home_secs: f64 },
    /// `mbal debug hot <key> <replicas>` (0: `cool`).
    Pin { key: Box<[u8]>, replicas: u32, reply: R },
    /// `mbal slots <borrower> <slots> <lease ms>` from another server.
    Lend { borrower: u16, slots: usize, lease_ms: u64, reply: R },
    /// `mbal slots held <lender>`.
    Held { lender: u16, reply: R },
    /// A starting server's question to `peer` answered (`None`: could not
    /// be asked).
    PeerHolds { peer: u16, held: Option<usize> },
    /// A lender answered an ask sent at `asked_at`.
    SlotsGranted { lender: u16, slots: usize, asked_at: u64, lease_ns: u64 },
    /// `mbal debug slots <keys>`.
    DebugSlots { demand: usize, reply: R },
    /// Another server's epoch record: its mean load per worker and its
    /// Phase 1 figures.
    PeerLoad { server: u16, mean: f64, hot: Option<PeerHot> },
    /// The coordinator's map (`settings.coordinated`). Installed if its epoch is newer than
    /// the last one installed; with `reset` (the coordinator had declared this server dead,
    /// so whatever it held may have been given to others meanwhile) always, and every
    /// cachelet this server held is given up first.
    Map { map: ClusterMap, reset: bool },
}

/// An answer to a waiting client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// A move is done (or there was nothing to do): the map's epoch after it.
    Moved {
        epoch: u64,
    },
    /// The cachelet is not on this server, or there is no such worker.
    NotHere,
    /// The move ended with the cachelet where it was (`Event::Moved` named another worker
    /// than the move's: the owning worker refused it, e.g. while the cachelet migrates to
    /// another server).
    Stayed,
    Ok,
    /// Phase 1 is off.
    HotOff,
    /// The key's home is another server.
    KeyElsewhere,
    /// Its copies could not be made.
    CouldNotReplicate,
    /// Slots granted to a borrower, for this lease.
    Slots {
        granted: usize,
        lease_ms: u64,
    },
    /// Slots of a lender this server holds.
    Held(usize),
    /// This server lends no slots (Phase 1 off or REPL_high set).
    NoSlots,
}

/// What the core asks the adapter to do, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum Command<R> {
    /// Ask every worker for its counters, for round `seq`.
    SampleWorkers { seq: u64 },
    /// Ask worker `from` to hand `cachelet` over to worker `to`.
    Release { cachelet: CacheletId, from: u16, to: u16, token: Token },
    /// Answer a waiting client.
    Reply { to: R, answer: Answer },
    /// The map's epoch advanced to this (a move ended).
    MapEpoch(u64),
    /// An epoch closed.
    Epoch(Box<EpochClosed>),
    /// Phase 2's figures changed.
    Status(BalancerStatus),
    /// Tell a home worker something of Phase 1.
    Hot { worker: u16, cmd: HotCommand },
    /// Renew the copies of `key` at `to` for `ttl_ms`; the job counts as
    /// started at `at_ns` (its answer is [`Event::HotDone`]).
    Renew { key: Box<[u8]>, to: Vec<(u16, u16)>, ttl_ms: u64, at_ns: u64 },
    /// Ask `lender` for `slots` REPL_high slots for `lease_ms`.
    AskLend { lender: u16, slots: usize, lease_ms: u64 },
    /// Ask `peer` how many of this server's slots it holds.
    AskHeld { peer: u16 },
    /// Phase 1's figures changed.
    HotStatus(Box<HotStatus>),
    /// The coordinator's map gives `cachelet` to `owner` (another server, or this one, whose
    /// worker then takes it empty): tell every worker, the new owner first.
    Reassign { cachelet: CacheletId, owner: Owner },
    /// A move between this server's workers ended (`settings.coordinated`): tell the
    /// coordinator, which numbers the map's epochs.
    ReportMove { cachelet: CacheletId, worker: u16 },
}

/// An epoch closed: its snapshot, Phase 2's decision when it decided at
/// this epoch, Phase 1's when it runs, and its hottest keys.
#[derive(Clone, Debug, PartialEq)]
pub struct EpochClosed {
    pub snapshot: Arc<EpochSnapshot>,
    pub balancer: Option<Decision>,
    pub hot: Option<ReplicaDecision>,
    pub hotkeys: Vec<HotKeyStat>,
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
    /// The epoch (ms): slot leases and the window in which peers' records
    /// count are whole epochs.
    pub epoch_ms: u64,
    /// Phase 1, when it runs.
    pub hot: Option<HotSettings>,
    /// A coordinator owns the map and numbers its epochs (`Event::Map`): a move between this
    /// server's workers changes the map here without a new epoch and is reported
    /// (`Command::ReportMove`).
    pub coordinated: bool,
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
    /// Phase 1's policy, when it runs, and the keys it replicates from here.
    hot: Option<HotKeys>,
    hot_meta: BTreeMap<Vec<u8>, phase1::HotMeta<R>>,
    hot_status: HotStatus,
    /// The mean of the cluster Phase 1 took at its last epoch.
    hot_avg: f64,
    /// The other servers' records, as heard.
    peers: PeerRecords,
    /// REPL_high slots lent and held (Phase 1 under the default REPL_high).
    ledger: Option<SlotLedger>,
    last_ask_ns: Option<u64>,
    /// `mbal debug slots`: the demand asked for at least.
    debug_demand: usize,
    /// Since it started, until every other server has said how many of
    /// its slots it still holds: what each said (`None`: not yet).
    starting: Option<Vec<Option<usize>>>,
    /// When the lease from this server's start ends (then it stops asking).
    start_until: u64,
    /// The epoch of the coordinator's map last installed (`Event::Map`).
    coord_epoch: u64,
}

impl<R: Clone> ControlCore<R> {
    /// A core for server `settings.server` of `map`, starting at `now_ns`;
    /// Phase 2's homes are the map's owners now.
    pub fn new(settings: CoreSettings, map: ClusterMap, now_ns: u64) -> ControlCore<R> {
        let balancer = settings.balancer.clone().map(|cfg| {
            let home: Vec<(u32, u16)> = (0..map.cachelet_count())
                .filter_map(|c| {
                    let (s, w) = map.owner(c);
                    (s == settings.server).then_some((c, w))
                })
                .collect();
            Balancer::new(cfg, &home)
        });
        let hot = settings.hot.as_ref().map(|h| HotKeys::new(h.policy.clone(), h.balance.clone()));
        let servers = map.servers().len();
        let mut core = ControlCore {
            settings: CoreSettings { balance_every: settings.balance_every.max(1), ..settings },
            map,
            hot,
            hot_meta: BTreeMap::new(),
            hot_status: HotStatus::default(),
            hot_avg: 0.0,
            peers: PeerRecords::new(servers),
            ledger: None,
            last_ask_ns: None,
            debug_demand: 0,
            starting: None,
            start_until: 0,
            coord_epoch: 0,
            round: 0,
            gathering: None,
            prev: Baseline::default(),
            balance_prev: Baseline::default(),
            balancer,
            status: BalancerStatus::default(),
            next_token: 1,
            moving: HashMap::new(),
            queued: VecDeque::new(),
        };
        core.start_slots(now_ns);
        core
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

    /// Take one event at `now_ns` (the server's one clock); the commands
    /// it gives, in the order to carry them out.
    pub fn step(&mut self, now_ns: u64, event: Event<R>) -> Vec<Command<R>> {
        let now = now_ns;
        let mut out = Vec::new();
        let o = &mut out;
        match event {
            Event::Start => {
                // Round 0 is the baseline the first epoch is measured from.
                self.start_round(o);
                self.ask_held(now, o);
            }
            Event::Tick => {
                // Every tick, whether or not the sample round closes: give
                // back lent slots no longer held, and renew those still needed.
                self.slot_tick(now, o);
                if self.gathering.is_none() {
                    self.start_round(o);
                }
            }
            Event::Sample { seq, sample, keys, home_reads } => {
                self.observe(sample.worker, keys, home_reads);
                self.sampled(now, seq, sample, o)
            }
            Event::MoveAsked { cachelet, to, reply } => self.request_move(cachelet, to, reply, o),
            Event::Moved { token, cachelet, worker } => self.moved(token, cachelet, worker, o),
            Event::Arrived { cachelet, worker } => self.arrived(cachelet, worker),
            Event::HotDone { key, created, ok, at_ns, copy_reads } => {
                if ok && !created {
                    if let Some(hot) = &mut self.hot {
                        hot.copy_reads(&key, copy_reads);
                    }
                }
                self.hot_done(key, created, ok, at_ns, o)
            }
            Event::HotFailed { key } => self.hot_done(key, false, false, 0, o),
            Event::HotAlarm { worker, keys, secs, home, home_secs } => {
                self.hot_alarm(now, worker, &keys, secs, &home, home_secs, o)
            }
            Event::Pin { key, replicas, reply } => self.pin(key, replicas, reply, o),
            Event::Lend { borrower, slots, lease_ms, reply } => {
                let (granted, lease_ms) = self.lend(now, borrower, slots, lease_ms, o);
                o.push(Command::Reply { to: reply, answer: Answer::Slots { granted, lease_ms } });
            }
            Event::Held { lender, reply } => {
                // Keys beyond the cap are retired before every change of it
                // (`apply_cap`), so what is told is all that is in use.
                let n = self.ledger.as_mut().map_or(0, |l| l.tell_held(lender, now));
                o.push(Command::Reply { to: reply, answer: Answer::Held(n) });
            }
            Event::PeerHolds { peer, held } => self.peer_holds(now, peer, held, o),
            Event::SlotsGranted { lender, slots, asked_at, lease_ns } => {
                if let Some(l) = &mut self.ledger {
                    l.granted(lender, slots, asked_at, lease_ns);
                    // A smaller grant lowers the cap: what is beyond it goes
                    // at once, so the keys with copies are within the cap
                    // between any two events.
                    self.apply_cap(now, o);
                }
            }
            Event::DebugSlots { demand, reply } => {
                self.debug_demand = demand;
                let answer = if self.ledger.is_none() {
                    Answer::NoSlots
                } else {
                    self.ask_slots(demand, now, o);
                    Answer::Ok
                };
                o.push(Command::Reply { to: reply, answer });
            }
            Event::PeerLoad { server, mean, hot } => self.peers.heard(server, mean, hot, now),
            Event::Map { map, reset } => self.install_map(map, reset, o),
        }
        out
    }

    /// The coordinator's map (see [`Event::Map`]). It decides which server owns each
    /// cachelet; where this server's own cachelets sit among its workers is this server's to
    /// say (its moves reach the coordinator as `ReportMove`, so a map may be a move behind).
    fn install_map(&mut self, new: ClusterMap, reset: bool, out: &mut Vec<Command<R>>) {
        let me = self.settings.server;
        let fits = new.keyspace() == self.map.keyspace()
            && new
                .servers()
                .get(usize::from(me))
                .is_some_and(|s| s.workers.len() == usize::from(self.settings.workers));
        if !fits || (!reset && new.epoch() <= self.coord_epoch) {
            return;
        }
        let mut merged = new;
        let mut claims = Vec::new();
        let mut others = Vec::new();
        let mut gone = Vec::new();
        for c in 0..merged.cachelet_count() {
            let old = self.map.owner(c);
            let to = merged.owner(c);
            if old.0 == me && to.0 == me && !reset {
                if old != to {
                    merged.set_owner_local(c, old);
                }
            } else if old != to || (reset && old.0 == me) {
                if to.0 == me {
                    claims.push((c, to));
                } else {
                    if old.0 == me {
                        gone.push(c);
                    }
                    others.push((c, to));
                }
            }
        }
        // Gone from here first (their items are dropped), then what arrives (empty).
        for &(cachelet, owner) in others.iter().chain(&claims) {
            out.push(Command::Reassign { cachelet, owner });
        }
        if let Some(b) = &mut self.balancer {
            for &(c, (_, w)) in &claims {
                b.set_home(c, w);
            }
            for &c in &gone {
                b.forget(c);
            }
        }
        self.coord_epoch = merged.epoch();
        self.map = merged;
        out.push(Command::MapEpoch(self.map.epoch()));
    }

    /// Phase 1's policy, when it runs.
    pub fn hot(&self) -> Option<&HotKeys> {
        self.hot.as_ref()
    }

    /// Phase 1's figures now.
    pub fn hot_status(&self) -> &HotStatus {
        &self.hot_status
    }

    /// The cluster's mean load per worker Phase 1 took at its last epoch.
    pub fn hot_avg(&self) -> f64 {
        self.hot_avg
    }

    fn start_round(&mut self, out: &mut Vec<Command<R>>) {
        self.gathering = Some(vec![None; usize::from(self.settings.workers)]);
        out.push(Command::SampleWorkers { seq: self.round });
    }

    fn sampled(&mut self, now: u64, seq: u64, sample: WorkerSample, out: &mut Vec<Command<R>>) {
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
            let hot = self.hot_epoch(now, &snap, out);
            let hotkeys = self.hot_top();
            out.push(Command::Epoch(Box::new(EpochClosed { snapshot: snap, balancer: decision, hot, hotkeys })));
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
        // Phase 1's keys with copies hold their cachelets where they are (`Balancer::hold`).
        let space = self.map.keyspace();
        let held: Vec<u32> = self.hot_meta.keys().map(|k| space.cachelet_of_hash(mbal_cluster::key_hash(k))).collect();
        let balancer = self.balancer.as_mut()?;
        balancer.hold(held);
        let d = balancer.on_epoch(snap);
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
            out.push(Command::Reply { to: reply, answer: Answer::NotHere });
            return;
        }
        let (server, from) = self.map.owner(c);
        if server != self.settings.server {
            out.push(Command::Reply { to: reply, answer: Answer::NotHere });
            return;
        }
        if from == to {
            out.push(Command::Reply { to: reply, answer: Answer::Moved { epoch: self.map.epoch() } });
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

    fn arrived(&mut self, c: CacheletId, worker: u16) {
        let at = (self.settings.server, worker);
        if c >= self.map.cachelet_count() || !self.map.has_worker(at) {
            return;
        }
        self.map.set_owner_local(c, at);
        if let Some(b) = &mut self.balancer {
            b.set_home(c, worker);
        }
    }

    fn moved(&mut self, token: Token, c: CacheletId, worker: u16, out: &mut Vec<Command<R>>) {
        if c >= self.map.cachelet_count() || worker >= self.settings.workers {
            debug_assert!(false, "a move to cachelet {c} worker {worker}, which do not exist");
            return;
        }
        let epoch = if self.settings.coordinated {
            self.map.set_owner_local(c, (self.settings.server, worker));
            out.push(Command::ReportMove { cachelet: c, worker });
            self.map.epoch()
        } else {
            let epoch = self.map.move_cachelet(c, (self.settings.server, worker));
            out.push(Command::MapEpoch(epoch));
            epoch
        };
        match self.moving.remove(&c) {
            Some(m) if m.token == token => {
                let stayed = worker != m.to;
                for r in m.waiters {
                    let answer = if stayed { Answer::Stayed } else { Answer::Moved { epoch } };
                    out.push(Command::Reply { to: r, answer });
                }
                if let Some(bal) = &mut self.balancer {
                    match m.by_balancer {
                        Some(bm) if stayed => {
                            self.status.moves_failed += 1;
                            bal.applied(&bm, false);
                        }
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
