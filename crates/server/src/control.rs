//! The controller: the server's control plane (DESIGN.md §6, "Where the
//! policy runs"). One thread beside the workers, with its own mailbox (a
//! channel of [`CtlMsg`]) and a periodic tick, the epoch. It is
//! to mbal what memcached's maintainer thread is to its slab automover: the
//! place that decides, apart from the request path.
//!
//! It owns:
//! * the cluster map. Workers route by their own tables (`moves`); the
//!   controller keeps the map every client may fetch (`mbal map`) and bumps
//!   its epoch as moves finish;
//! * every cachelet move. `mbal move` asks the controller, and the balancer
//!   will too; it sends `Release` to the owner and hears back from the
//!   adopter (`moves` has the protocol). One move per cachelet at a time;
//!   later requests for the same cachelet wait their turn;
//! * the epoch tick: every `--epoch-ms` it asks each worker for a
//!   [`WorkerSample`] (its counters; no client involved) and, once all have
//!   answered, turns two consecutive rounds into an [`EpochSnapshot`], the
//!   policy's input. The last one is published for `stats cachelets`; about
//!   a minute of them ([`history_len`]) are kept for `mbal load` callers, so
//!   one that reads them in turn misses none.
//!
//! * the local balancer (`--balancer on`, DESIGN.md §6): once per Phase 2
//!   epoch (`--balance-epoch-ms`, whole epochs) it hands the snapshot of
//!   that time to `mbal_balance::Balancer` (the policy: MBal's state
//!   machine, Phase 2 plans, leases) and carries out the moves it decides
//!   with the same move protocol as `mbal move`, telling the policy how
//!   each ended. `stats balancer` shows its state; `mbal load` carries its
//!   decision beside the snapshot of the epochs where it decided.
//!
//! It never touches a worker's store or tables: it talks to workers only by
//! message, and they answer by message, so nothing here needs a lock but the
//! published snapshot's (read by stats rendering, written once per epoch).

mod slots;
use slots::{slot_lease_ms, SLOT_ASK_EVERY_MS};

use crate::msg::{Envelope, Grant, HotCmd, ReplyBatch, ReplyTo, NO_CACHELET};
use crate::replicate::{Done, Job, Op};
use crate::worker::Shared;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use mbal_balance::hot::repl_high_share;
use mbal_balance::{
    Access, Balancer, Baseline, ClusterView, Decision, EpochSnapshot, HotKeyStat, HotKeys, KeyState, Move,
    ReplicaDecision, SlotLedger, WorkerSample,
};
use mbal_cluster::ClusterMap;
use mbal_proto::ext;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Messages to the controller.
pub(crate) enum CtlMsg {
    /// A worker's counters for the sampling round `seq`, and the keys it
    /// sampled since the last round (`true`: a write), and the reads its
    /// replicated keys got at home since then (exact counts).
    Sample { seq: u64, sample: Box<WorkerSample>, keys: Vec<(Box<[u8]>, bool)>, home_reads: Vec<(Box<[u8]>, u64)> },
    /// The replicator: a key's copies were made (`created`) or renewed by a
    /// job started at `at_ns` (`ok`), or could not be.
    /// A renewal also brings the reads the copies served since the last one.
    HotDone { key: Box<[u8]>, created: bool, ok: bool, at_ns: u64, copy_reads: u64 },
    /// A home worker: replicating `key` failed (the item is gone, a write
    /// could not be copied).
    HotFailed { key: Box<[u8]> },
    /// A worker ran hot for `secs` seconds (Phase 1's trigger within an
    /// epoch), with the keys it sampled meanwhile (`true` for a write).
    /// With its replicated keys' reads at home (exact) over the `home_secs`
    /// since its last epoch sample.
    HotAlarm { worker: u16, keys: Vec<(Box<[u8]>, bool)>, secs: f64, home: Vec<(Box<[u8]>, u64)>, home_secs: f64 },
    /// `mbal move <cachelet> <worker>`: answer `reply` once it is done.
    Move { cachelet: u32, to: usize, reply: ReplyTo },
    /// Move `token` finished: `worker` owns `cachelet` now.
    Moved { token: u64, cachelet: u32, worker: usize },
    /// `mbal map`: `MAP <epoch> <len>` and the map as JSON.
    Map { reply: ReplyTo },
    /// `mbal load [<after>]`: the oldest epoch snapshot kept that is
    /// numbered above `after` (the next one, for a caller that keeps up),
    /// as JSON, as soon as there is one.
    Load { after: u64, reply: ReplyTo },
    /// `mbal debug hot <key> <replicas>` / `cool <key>` (replicas 0):
    /// pin a key homed here as replicated, or unpin it.
    Pin { key: Box<[u8]>, replicas: u32, reply: ReplyTo },
    /// `mbal slots <borrower> <slots> <lease ms>`: another server asks for
    /// REPL_high slots (`SlotLedger::lend`); answer `SLOTS <granted> <lease ms>`.
    Lend { borrower: u16, slots: usize, lease_ms: u64, reply: ReplyTo },
    /// A lender answered an ask sent at `asked_at` (`crate::slots`): hold
    /// `slots` from it for `lease_ns` from then, in place of what was held
    /// from it.
    SlotsGranted { lender: u16, slots: usize, asked_at: u64, lease_ns: u64 },
    /// `mbal slots held <lender>`: how many of `lender`'s slots this server
    /// holds; answer `HELD <n>`.
    Held { lender: u16, reply: ReplyTo },
    /// A starting server's question to `peer` answered (`None`: could not
    /// be asked; asked again at the next tick).
    PeerHolds { peer: u16, held: Option<usize> },
    /// `mbal debug slots <keys>`: ask for slots as if `demand` keys had or
    /// wanted copies, at once and at every epoch until 0.
    DebugSlots { demand: usize, reply: ReplyTo },
    /// Look at the shutdown flag.
    Wake,
}

/// Epoch snapshots kept for `mbal load`: about a minute's, at least 64 and at
/// most 1024 of them (a reader that falls further behind misses some).
fn history_len(epoch_ms: u64) -> usize {
    (60_000 / epoch_ms.max(1)).clamp(64, 1024) as usize
}

/// A move under way.
struct Moving {
    token: u64,
    to: usize,
    waiters: Vec<ReplyTo>,
    /// The balancer's move, if it decided this one.
    by_balancer: Option<Move>,
}

/// One epoch as `mbal load` reports it: the snapshot's fields, the
/// balancer's decision (null when it is off), Phase 1's decision and its
/// hottest tracked keys (null and empty when it is off).
#[derive(Serialize)]
struct EpochRecord<'a> {
    #[serde(flatten)]
    snapshot: &'a EpochSnapshot,
    balancer: Option<&'a Decision>,
    hot: Option<&'a ReplicaDecision>,
    hotkeys: &'a [HotKeyStat],
}

/// What the controller decided at the end of one epoch.
#[derive(Default)]
struct Decided {
    balancer: Option<Decision>,
    hot: Option<ReplicaDecision>,
    hotkeys: Vec<HotKeyStat>,
}

/// Phase 1's figures for `stats hotkeys` (published once per epoch).
#[derive(Clone, Debug, Default)]
pub(crate) struct HotStatus {
    pub epoch: u64,
    pub threshold: f64,
    pub estimated_max_over_avg: f64,
    pub unreplicated_max_over_avg: f64,
    pub replicated: usize,
    pub escalate: Option<String>,
    pub top: Vec<HotKeyStat>,
    pub copies_made: u64,
    pub copies_failed: u64,
    /// Hotspot alarms heard from this server's workers between epochs.
    pub alarms: u64,
    /// REPL_high for this server now, the keys waiting for a slot at the
    /// last epoch, and the slots lent to and held from other servers.
    pub repl_high: usize,
    pub waiting: usize,
    pub slots_lent: usize,
    pub slots_held: usize,
    /// The fraction of requests sampled now (`HotKeys::sample_rate`; 0
    /// before the first epoch).
    pub sample_rate: f64,
}

/// A key Phase 1 replicates from this server.
struct HotMeta {
    /// Its home worker.
    worker: u16,
    /// Copies 1..=replicas exist or are being made.
    replicas: u32,
    /// When the last job that made or renewed every copy started: the
    /// copies live at least until then plus their time to live.
    alive_since_ns: Option<u64>,
    /// `mbal debug hot` callers waiting for the copies to be made.
    waiters: Vec<ReplyTo>,
}

/// Keys shown by `stats hotkeys` and in `mbal load`.
const HOT_TOP: usize = 16;

/// The balancer's figures for `stats balancer` (published once per Phase 2
/// epoch and when a move ends).
#[derive(Clone, Debug, Default)]
pub(crate) struct BalancerStatus {
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

pub(crate) struct Controller {
    shared: Arc<Shared>,
    inbox: Receiver<CtlMsg>,
    map: ClusterMap,
    epoch_len: Duration,
    next_tick: Instant,
    /// Sampling rounds started; the baseline round is 0.
    round: u64,
    /// The round being gathered: a slot per worker.
    gathering: Option<Vec<Option<WorkerSample>>>,
    /// The previous complete round, with the last counts of the cachelets
    /// it missed.
    prev: Baseline,
    /// Phase 2 decides every `balance_every` rounds, on the load since
    /// `balance_prev` (the round it last decided at).
    balance_every: u64,
    balance_prev: Baseline,
    /// The newest epochs (snapshot and what was decided), oldest first:
    /// at most `history_len`.
    history: VecDeque<(Arc<EpochSnapshot>, Decided)>,
    history_len: usize,
    /// `mbal load` callers waiting for a newer epoch.
    load_waiters: Vec<(u64, ReplyTo)>,
    next_token: u64,
    moving: HashMap<u32, Moving>,
    /// Moves asked for while their cachelet was moving, in arrival order.
    queued: VecDeque<(u32, usize, ReplyTo)>,
    /// The local balancer's policy, when it runs.
    balancer: Option<Balancer>,
    status: BalancerStatus,
    /// Phase 1's policy, when it runs (a cluster of two or more servers).
    hot: Option<HotKeys>,
    hot_meta: BTreeMap<Vec<u8>, HotMeta>,
    hot_status: HotStatus,
    /// REPL_high slots lent and held (Phase 1 with the default REPL_high),
    /// and the thread that asks other servers for them.
    ledger: Option<SlotLedger>,
    slot_asks: Option<Sender<crate::slots::Ask>>,
    last_ask_ns: Option<u64>,
    /// `mbal debug slots`: the demand asked for at least.
    debug_demand: usize,
    /// Since it started, until every other server has said how many of
    /// its slots it still holds: what each said (`None`: not yet).
    starting: Option<Vec<Option<usize>>>,
    /// When the lease from this server's start ends (then it stops asking).
    start_until: u64,
}

impl Controller {
    pub(crate) fn new(
        shared: Arc<Shared>,
        inbox: Receiver<CtlMsg>,
        map: ClusterMap,
        slot_asks: Option<Sender<crate::slots::Ask>>,
    ) -> Controller {
        let epoch_len = Duration::from_millis(shared.settings.epoch_ms.max(1));
        let balancer = shared.settings.balancer.then(|| {
            let me = shared.server_id;
            let home: Vec<(u32, u16)> = (0..map.cachelet_count())
                .filter_map(|c| {
                    let (s, w) = map.owner(c);
                    (s == me).then_some((c, w))
                })
                .collect();
            let mut cfg = shared.settings.balance.clone();
            // With emulated capacity the policy knows each worker's ceiling.
            if shared.settings.worker_capacity > 0 {
                cfg.worker_capacity = Some(shared.settings.worker_capacity as f64);
            }
            Balancer::new(cfg, &home)
        });
        let status = BalancerStatus::default();
        let hot = shared
            .replicator
            .is_some()
            .then(|| HotKeys::new(shared.settings.hot.policy.clone(), hot_balance_config(&shared.settings)));
        // Slots are lent only under the default REPL_high (the cluster's
        // floor(2·n·ln n)); an explicit --hot-repl-high is per server.
        // A server that starts counts its share as lent for a lease: its
        // borrowers may hold slots it lent before a restart.
        let lease_ns = slot_lease_ms(epoch_len) * 1_000_000;
        let ledger =
            (hot.is_some() && shared.settings.hot.policy.repl_high.is_none() && slot_asks.is_some()).then(|| {
                SlotLedger::starting(repl_high_share(&view_of(&shared, &map, None)), shared.clock_ns() + lease_ns)
            });
        // Until the others say how many they still hold (a fresh cluster: none).
        let starting = ledger.as_ref().map(|_| {
            let mut v = vec![None; map.servers().len()];
            v[usize::from(shared.server_id)] = Some(0);
            v
        });
        Controller {
            ledger,
            slot_asks,
            last_ask_ns: None,
            debug_demand: 0,
            starting,
            start_until: shared.clock_ns() + lease_ns,
            balancer,
            status,
            hot,
            hot_meta: BTreeMap::new(),
            hot_status: HotStatus::default(),
            inbox,
            map,
            epoch_len,
            next_tick: Instant::now(),
            round: 0,
            gathering: None,
            prev: Baseline::default(),
            balance_every: shared.settings.balance_every(),
            balance_prev: Baseline::default(),
            history: VecDeque::new(),
            history_len: history_len(shared.settings.epoch_ms),
            load_waiters: Vec::new(),
            next_token: 1,
            moving: HashMap::new(),
            queued: VecDeque::new(),
            shared,
        }
    }

    pub(crate) fn run(mut self) {
        // Round 0 is the baseline the first epoch is measured from.
        self.start_round();
        self.ask_held();
        self.next_tick = Instant::now() + self.epoch_len;
        while !self.shared.shutdown.load(Ordering::Relaxed) {
            let wait = self.next_tick.saturating_duration_since(Instant::now());
            match self.inbox.recv_timeout(wait) {
                Ok(msg) => self.handle(msg),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
            if Instant::now() >= self.next_tick {
                self.next_tick += self.epoch_len;
                // Every tick, whether or not the sample round closes: give
                // back lent slots no longer held, and renew those still needed.
                self.slot_tick();
                // A tick that finds the last round still open (a worker
                // stalled) skips: the next epoch is simply longer.
                if self.gathering.is_none() {
                    self.start_round();
                }
            }
        }
    }

    fn handle(&mut self, msg: CtlMsg) {
        match msg {
            CtlMsg::Sample { seq, sample, keys, home_reads } => {
                if let Some(h) = &mut self.hot {
                    for (k, write) in keys {
                        h.observe(&k, if write { Access::Write } else { Access::Read }, sample.worker);
                    }
                    for (k, n) in home_reads {
                        h.home_reads(&k, n);
                    }
                }
                self.sampled(seq, *sample)
            }
            CtlMsg::HotDone { key, created, ok, at_ns, copy_reads } => {
                if ok && !created {
                    if let Some(hot) = &mut self.hot {
                        hot.copy_reads(&key, copy_reads);
                    }
                }
                self.hot_done(key, created, ok, at_ns)
            }
            CtlMsg::HotFailed { key } => self.hot_done(key, false, false, 0),
            CtlMsg::HotAlarm { worker, keys, secs, home, home_secs } => {
                self.hot_alarm(worker, &keys, secs, &home, home_secs)
            }
            CtlMsg::Move { cachelet, to, reply } => self.request_move(cachelet, to, reply),
            CtlMsg::Moved { token, cachelet, worker } => self.moved(token, cachelet, worker),
            CtlMsg::Map { reply } => {
                let json = self.map.to_json();
                let mut b = Vec::with_capacity(json.len() + 32);
                ext::write_map(&mut b, self.map.epoch(), json.as_bytes());
                self.answer(reply, &b);
            }
            CtlMsg::Load { after, reply } => match self.history.iter().find(|(s, _)| s.seq > after) {
                Some((s, d)) => {
                    let b = load_reply(s, d);
                    self.answer(reply, &b);
                }
                None => self.load_waiters.push((after, reply)),
            },
            CtlMsg::Pin { key, replicas, reply } => self.pin(key, replicas, reply),
            CtlMsg::Lend { borrower, slots, lease_ms, reply } => {
                let (granted, lease_ms) = self.lend(borrower, slots, lease_ms);
                self.answer(reply, format!("SLOTS {granted} {lease_ms}\r\n").as_bytes());
            }
            CtlMsg::Held { lender, reply } => {
                // Keys beyond the cap are retired before every change of it
                // (`apply_cap`), so what is told is all that is in use.
                let now = self.now_ns();
                let n = self.ledger.as_mut().map_or(0, |l| l.tell_held(lender, now));
                self.answer(reply, format!("HELD {n}\r\n").as_bytes());
            }
            CtlMsg::PeerHolds { peer, held } => self.peer_holds(peer, held),
            CtlMsg::SlotsGranted { lender, slots, asked_at, lease_ns } => {
                self.slots_granted(lender, slots, asked_at, lease_ns)
            }
            CtlMsg::DebugSlots { demand, reply } => {
                self.debug_demand = demand;
                if self.ledger.is_none() {
                    return self.answer(
                        reply,
                        b"CLIENT_ERROR no slots are lent here (Phase 1 off or --hot-repl-high set)\r\n",
                    );
                }
                self.ask_slots(demand, self.now_ns());
                self.answer(reply, b"OK\r\n");
            }
            CtlMsg::Wake => {}
        }
    }

    fn now_ns(&self) -> u64 {
        self.shared.clock_ns()
    }

    /// Send reply bytes to a client connection's waiting slot.
    fn answer(&self, to: ReplyTo, bytes: &[u8]) {
        let mut batch = ReplyBatch::default();
        batch.push(to, NO_CACHELET, |d| d.extend_from_slice(bytes));
        self.shared.peers().send_one(to.worker, Envelope::Replies(batch), self.now_ns());
    }

    // ---- the epoch tick --------------------------------------------------

    fn start_round(&mut self) {
        let workers = self.shared.settings.threads;
        self.gathering = Some(vec![None; workers]);
        let now = self.now_ns();
        for w in 0..workers {
            self.shared.peers().send_one(w, Envelope::Sample { seq: self.round }, now);
        }
    }

    fn sampled(&mut self, seq: u64, sample: WorkerSample) {
        if seq != self.round {
            return;
        }
        let Some(slots) = &mut self.gathering else { return };
        let w = sample.worker as usize;
        if let Some(slot) = slots.get_mut(w) {
            *slot = Some(sample);
        }
        if slots.iter().any(Option::is_none) {
            return;
        }
        let cur: Vec<WorkerSample> = self.gathering.take().into_iter().flatten().flatten().collect();
        // Phase 2's round: the policy decides (if it runs) on the load since
        // its last one.
        let phase2 = self.balancer.is_some() && self.round.is_multiple_of(self.balance_every);
        if self.round > 0 {
            let snap = Arc::new(self.prev.epoch_to(self.round, &cur));
            *self.shared.latest.lock().unwrap_or_else(|p| p.into_inner()) = Some(snap.clone());
            let balancer = match (phase2, self.balance_every) {
                (false, _) => None,
                (true, 1) => self.balance(&snap),
                (true, _) => self.balance(&self.balance_prev.epoch_to(self.round, &cur)),
            };
            let decided = Decided { balancer, hot: self.hot_epoch(&snap), hotkeys: self.hot_top() };
            let ready: Vec<ReplyTo> = {
                let (ready, wait): (Vec<_>, Vec<_>) = self.load_waiters.drain(..).partition(|(a, _)| snap.seq > *a);
                self.load_waiters = wait;
                ready.into_iter().map(|(_, r)| r).collect()
            };
            if !ready.is_empty() {
                let b = load_reply(&snap, &decided);
                for r in ready {
                    self.answer(r, &b);
                }
            }
            if self.history.len() >= self.history_len {
                self.history.pop_front();
            }
            self.history.push_back((snap, decided));
        }
        // With a Phase 2 epoch of one epoch, Phase 2 used `snap`: no
        // baseline of its own to keep.
        if phase2 && self.balance_every > 1 {
            self.balance_prev.advance(cur.clone());
        }
        self.prev.advance(cur);
        self.round += 1;
    }

    // ---- the balancer ----------------------------------------------------

    /// Run the policy over one epoch and start the moves it decides.
    fn balance(&mut self, snap: &EpochSnapshot) -> Option<Decision> {
        let b = self.balancer.as_mut()?;
        let t = Instant::now();
        let d = b.on_epoch(snap);
        let us = t.elapsed().as_micros() as u64;
        let st = &mut self.status;
        st.epoch = snap.seq;
        st.state = format!("{:?}", d.state);
        st.loads = d.loads.clone();
        st.max_over_avg = d.imbalance.max_over_avg;
        st.imbalance_factor = d.imbalance.factor;
        st.plans += u64::from(d.plan.is_some());
        st.escalations += u64::from(d.escalate.is_some());
        st.leases = d.leases;
        st.planner_us_last = us;
        st.planner_us_max = st.planner_us_max.max(us);
        if d.transition.is_some() || !d.moves.is_empty() || d.escalate.is_some() {
            tracing::info!(
                epoch = snap.seq,
                state = ?d.state,
                transition = ?d.transition,
                max_over_avg = format!("{:.2}", d.imbalance.max_over_avg),
                moves = ?d.moves.iter().map(|m| (m.cachelet, m.from, m.to, m.why)).collect::<Vec<_>>(),
                escalate = ?d.escalate.as_ref().map(|e| e.why),
                planner_us = us,
                "balancer"
            );
        }
        for m in &d.moves {
            self.balancer_move(*m);
        }
        self.publish_status();
        Some(d)
    }

    /// Carry out one of the balancer's moves, unless the cachelet is
    /// already moving or is no longer where the policy thought.
    fn balancer_move(&mut self, m: Move) {
        let (server, from) = self.map.owner(m.cachelet);
        let ok = server == self.shared.server_id
            && from == m.from
            && (m.to as usize) < self.shared.settings.threads
            && !self.moving.contains_key(&m.cachelet);
        if !ok {
            self.status.moves_failed += 1;
            if let Some(b) = &mut self.balancer {
                b.applied(&m, false);
            }
            return;
        }
        self.send_release(m.cachelet, from, m.to as usize, Vec::new(), Some(m));
    }

    fn publish_status(&self) {
        *self.shared.balancer.lock().unwrap_or_else(|p| p.into_inner()) = Some(self.status.clone());
    }

    // ---- Phase 1: hot-key replication --------------------------------------

    /// Run Phase 1's policy over one epoch: ask home workers to make or
    /// delete copies, renew the copies that exist, and tell every worker
    /// the leases it may grant.
    fn hot_epoch(&mut self, snap: &EpochSnapshot) -> Option<ReplicaDecision> {
        // The cluster's mean: this server's and the others' heard within
        // the last three epochs (else this server's mean stands for it).
        let own = crate::peerload::mean_load(snap, &hot_balance_config(&self.shared.settings));
        let avg = self.shared.peer_loads.cluster_mean(usize::from(self.shared.server_id), own, self.heard_since());
        let view = view_of(&self.shared, &self.map, avg);
        let now = self.now_ns();
        if let Some(l) = &mut self.ledger {
            l.set_base(repl_high_share(&view));
        }
        self.set_cap(now);
        let mut d = self.hot.as_mut()?.on_epoch(snap, &view);
        self.start_copies(&d.replicate);
        // Keys waiting for a slot: ask for more at once (the tick renews).
        let demand = self.demand();
        if d.waiting > 0 {
            self.ask_slots(demand, now);
        }
        // What this server would lend, for the others' asks (`mbal load`).
        let (claim, margin) = self.keeps(demand);
        d.spare = self.ledger.as_ref().map_or(0, |l| l.spare(now, claim, margin));
        let peers = self.shared.peers();
        // The alarm limit for the next epoch, to every worker.
        let limit = self.hot.as_ref().and_then(HotKeys::alarm_limit);
        // And the sampling rate from now on, when it changed.
        let rate = self.hot.as_ref().map_or(0.0, HotKeys::sample_rate);
        let new_rate = (rate != self.hot_status.sample_rate).then_some(rate);
        self.hot_status.sample_rate = rate;
        for w in 0..self.shared.settings.threads {
            peers.send_one(w, Envelope::Hot(HotCmd::AlarmLimit(limit)), now);
            if let Some(r) = new_rate {
                peers.send_one(w, Envelope::Hot(HotCmd::SampleRate(r)), now);
            }
        }
        self.retire_copies(&d.retire);
        // Renew every copy that exists (a key being made renews once made).
        if let (Some(jobs), Some(hot)) = (&self.shared.replicator, &self.hot) {
            let ttl_ms = self.shared.settings.hot.copy_ttl_ms();
            for (key, m) in &self.hot_meta {
                let state = hot.state(key);
                if m.alive_since_ns.is_some() && matches!(state, KeyState::Hot | KeyState::ColdPending) {
                    let to = self.copies(key, m);
                    let done = Done::Controller { created: false, at_ns: now };
                    let _ = jobs.send(Job { key: key.as_slice().into(), to, op: Op::Renew { ttl_ms }, done });
                }
            }
        }
        self.send_grants(None);
        let st = &mut self.hot_status;
        st.epoch = snap.seq;
        st.threshold = d.threshold;
        st.estimated_max_over_avg = d.estimated_max_over_avg;
        st.unreplicated_max_over_avg = d.unreplicated_max_over_avg;
        st.replicated = d.replicated;
        st.waiting = d.waiting;
        st.escalate = d.escalate.as_ref().map(|e| format!("{:?}", e.why));
        st.top = self.hot.as_ref().map(|h| h.top(HOT_TOP)).unwrap_or_default();
        if !d.replicate.is_empty() || !d.retire.is_empty() {
            tracing::info!(
                epoch = snap.seq,
                replicate = ?d.replicate.iter().map(|r| (String::from_utf8_lossy(&r.key).into_owned(), r.replicas)).collect::<Vec<_>>(),
                retire = d.retire.len(),
                replicated = d.replicated,
                threshold = format!("{:.0}", d.threshold),
                "hot keys"
            );
        }
        if tracing::enabled!(tracing::Level::DEBUG) {
            // One line per epoch: what Phase 1 saw and holds (for tracing a
            // reaction epoch by epoch, `RUST_LOG=mbal_server::control=debug`).
            let loads: Vec<String> = mbal_balance::worker_loads(snap, &hot_balance_config(&self.shared.settings))
                .iter()
                .map(|l| format!("{l:.0}"))
                .collect();
            let keys: Vec<String> = st
                .top
                .iter()
                .filter(|k| k.state != KeyState::Cold || !d.hot_workers.is_empty())
                .take(12)
                .map(|k| {
                    format!(
                        "{}@{}:{:?}:{:.0}:{}",
                        String::from_utf8_lossy(&k.key),
                        k.worker,
                        k.state,
                        k.reads_per_sec,
                        k.replicas
                    )
                })
                .collect();
            let press: Vec<String> = (0..self.shared.settings.threads as u16)
                .map(|w| format!("{:.2}", self.hot.as_ref().map_or(1.0, |h| h.press_of(w))))
                .collect();
            tracing::debug!(
                server = self.shared.server_id,
                epoch = snap.seq,
                avg = format!("{:.0}", view.avg_load.unwrap_or(own)),
                loads = loads.join(","),
                hot_workers = ?d.hot_workers,
                t = format!("{:.0}", d.threshold),
                press = press.join(","),
                est = format!("{:.2}", d.estimated_max_over_avg),
                replicated = d.replicated,
                cap = d.cap,
                waiting = d.waiting,
                keys = keys.join(" "),
                "hot epoch"
            );
        }
        self.publish_hot();
        Some(d)
    }

    /// Ask home workers to delete retired keys' copies.
    fn retire_copies(&mut self, retire: &[mbal_balance::Retire]) {
        let now = self.now_ns();
        let peers = self.shared.peers();
        for r in retire {
            self.hot_meta.remove(&r.key);
            peers.send_one(r.worker as usize, Envelope::Hot(HotCmd::Retire { key: r.key.as_slice().into() }), now);
        }
    }

    /// Ask home workers to make (or widen) copies.
    fn start_copies(&mut self, replicate: &[mbal_balance::Replicate]) {
        let now = self.now_ns();
        let peers = self.shared.peers();
        for r in replicate {
            let m = self.hot_meta.entry(r.key.clone()).or_insert(HotMeta {
                worker: r.worker,
                replicas: 0,
                alive_since_ns: None,
                waiters: Vec::new(),
            });
            m.worker = r.worker;
            m.replicas = m.replicas.max(r.replicas);
            let cmd = HotCmd::Replicate { key: r.key.as_slice().into(), replicas: m.replicas };
            peers.send_one(r.worker as usize, Envelope::Hot(cmd), now);
        }
    }

    /// A worker ran hot between epochs: replicate its hottest new keys now.
    fn hot_alarm(
        &mut self,
        worker: u16,
        keys: &[(Box<[u8]>, bool)],
        secs: f64,
        home: &[(Box<[u8]>, u64)],
        home_secs: f64,
    ) {
        let Some(hot) = &mut self.hot else { return };
        let d = hot.on_alarm(worker, keys, secs, home, home_secs);
        let replicate = d.replicate;
        self.hot_status.alarms += 1;
        tracing::debug!(
            server = self.shared.server_id,
            worker,
            samples = keys.len(),
            secs = format!("{secs:.2}"),
            replicate = ?replicate.iter().map(|r| (String::from_utf8_lossy(&r.key).into_owned(), r.replicas)).collect::<Vec<_>>(),
            retire = d.retire.len(),
            "hot alarm"
        );
        self.retire_copies(&d.retire);
        if d.waiting > 0 {
            // Keys wait for a slot now: ask for more without waiting for the epoch.
            let now = self.now_ns();
            let recent = self.last_ask_ns.is_some_and(|t| now.saturating_sub(t) < SLOT_ASK_EVERY_MS * 1_000_000);
            if !recent {
                self.ask_slots(self.demand(), now);
                self.last_ask_ns = Some(now);
            }
        }
        if !replicate.is_empty() || !d.retire.is_empty() {
            self.start_copies(&replicate);
            // A key the alarm displaced grants no more leases from now on.
            self.send_grants(None);
            self.publish_hot();
        }
    }

    fn pin(&mut self, key: Box<[u8]>, replicas: u32, reply: ReplyTo) {
        let c = self.map.keyspace().cachelet_of_hash(mbal_cluster::key_hash(&key));
        let (server, worker) = self.map.owner(c);
        let Some(hot) = &mut self.hot else {
            return self.answer(reply, b"CLIENT_ERROR hot-key replication is off\r\n");
        };
        if server != self.shared.server_id {
            return self.answer(reply, b"CLIENT_ERROR key is served by another mbal server\r\n");
        }
        if replicas == 0 {
            hot.unpin(&key);
            return self.answer(reply, b"OK\r\n");
        }
        match hot.pin(&key, worker, replicas) {
            Some(r) => {
                // The answer comes once the copies are made (`hot_done`).
                let m = HotMeta { worker, replicas: r.replicas, alive_since_ns: None, waiters: vec![reply] };
                self.hot_meta.insert(r.key.clone(), m);
                let cmd = HotCmd::Replicate { key: r.key.as_slice().into(), replicas: r.replicas };
                self.shared.peers().send_one(worker as usize, Envelope::Hot(cmd), self.now_ns());
            }
            None => self.answer(reply, b"OK\r\n"),
        }
    }

    fn hot_top(&self) -> Vec<HotKeyStat> {
        self.hot.as_ref().map(|h| h.top(HOT_TOP)).unwrap_or_default()
    }

    /// Where a key's copies live.
    fn copies(&self, key: &[u8], m: &HotMeta) -> Vec<(u16, u16)> {
        let hash = mbal_cluster::key_hash(key);
        let (servers, workers) = (self.map.servers().len() as u16, self.shared.settings.threads as u16);
        (1..=m.replicas)
            .filter_map(|i| {
                mbal_cluster::replica_location(hash, i, (self.shared.server_id, m.worker), servers, workers)
            })
            .collect()
    }

    /// The lease reads of `key` may be told now, if any: while it is HOT
    /// and its copies are known to live, up to a margin before they end.
    fn grant(&self, key: &[u8], m: &HotMeta) -> Grant {
        let hot = self.hot.as_ref()?;
        let since = m.alive_since_ns?;
        let g = hot.hint(key);
        let ttl_ns = self.shared.settings.hot.copy_ttl_ms() * 1_000_000;
        (g > 0).then_some((g.min(m.replicas), (since + ttl_ns).saturating_sub(50_000_000)))
    }

    /// Tell home workers the leases they may grant: for every replicated
    /// key, or for one.
    fn send_grants(&self, only: Option<&[u8]>) {
        let workers = self.shared.settings.threads;
        let mut per: Vec<Vec<(Box<[u8]>, Grant)>> = vec![Vec::new(); workers];
        for (key, m) in &self.hot_meta {
            if only.is_some_and(|k| k != key.as_slice()) {
                continue;
            }
            if let Some(v) = per.get_mut(m.worker as usize) {
                v.push((key.as_slice().into(), self.grant(key, m)));
            }
        }
        let now = self.now_ns();
        for (w, list) in per.into_iter().enumerate() {
            if !list.is_empty() {
                self.shared.peers().send_one(w, Envelope::Hot(HotCmd::Grants(list)), now);
            }
        }
    }

    /// The replicator (or a home worker) says how making, renewing or
    /// updating a key's copies ended.
    fn hot_done(&mut self, key: Box<[u8]>, created: bool, ok: bool, at_ns: u64) {
        let Some(hot) = &mut self.hot else { return };
        tracing::debug!(
            server = self.shared.server_id,
            key = %String::from_utf8_lossy(&key),
            created,
            ok,
            "hot copies done"
        );
        if ok {
            if let Some(m) = self.hot_meta.get_mut(&*key) {
                m.alive_since_ns = Some(m.alive_since_ns.map_or(at_ns, |t| t.max(at_ns)));
            }
            if created {
                hot.replicas_ready(&key);
                self.hot_status.copies_made += 1;
            }
        } else {
            // No lease from now on; the policy deletes the copies once the
            // leases it gave have ended.
            hot.copies_lost(&key);
            self.hot_status.copies_failed += 1;
            if let Some(m) = self.hot_meta.get_mut(&*key) {
                m.alive_since_ns = None;
            }
        }
        // Stats first, then the leases, then whoever waits: each sees the
        // one before.
        self.publish_hot();
        self.send_grants(Some(&key));
        let waiters = self.hot_meta.get_mut(&*key).map(|m| std::mem::take(&mut m.waiters)).unwrap_or_default();
        let answer: &[u8] = if ok { b"OK\r\n" } else { b"SERVER_ERROR could not replicate\r\n" };
        for r in waiters {
            self.answer(r, answer);
        }
    }

    fn publish_hot(&mut self) {
        self.hot_status.top = self.hot_top();
        *self.shared.hotkeys.lock().unwrap_or_else(|p| p.into_inner()) = Some(self.hot_status.clone());
    }

    // ---- moves -----------------------------------------------------------

    /// Start a move now, or queue it behind the cachelet's current one.
    fn request_move(&mut self, c: u32, to: usize, reply: ReplyTo) {
        if let Some(m) = self.moving.get_mut(&c) {
            if m.to == to {
                // The same move again: one answer when it is done.
                m.waiters.push(reply);
            } else {
                self.queued.push_back((c, to, reply));
            }
            return;
        }
        self.start_move(c, to, vec![reply]);
    }

    fn start_move(&mut self, c: u32, to: usize, waiters: Vec<ReplyTo>) {
        let (server, from) = self.map.owner(c);
        if server != self.shared.server_id || to >= self.shared.settings.threads {
            for r in waiters {
                self.answer(r, b"CLIENT_ERROR cachelet is not on this server\r\n");
            }
            return;
        }
        if from as usize == to {
            let mut b = Vec::new();
            ext::write_moved(&mut b, self.map.epoch());
            for r in waiters {
                self.answer(r, &b);
            }
            return;
        }
        self.send_release(c, from, to, waiters, None);
    }

    fn send_release(&mut self, c: u32, from: u16, to: usize, waiters: Vec<ReplyTo>, by_balancer: Option<Move>) {
        let token = self.next_token;
        self.next_token += 1;
        self.moving.insert(c, Moving { token, to, waiters, by_balancer });
        let now = self.now_ns();
        self.shared.peers().send_one(from as usize, Envelope::Release { cachelet: c, to, token }, now);
    }

    fn moved(&mut self, token: u64, c: u32, worker: usize) {
        let epoch = self.map.move_cachelet(c, (self.shared.server_id, worker as u16));
        self.shared.epoch.fetch_max(epoch, Ordering::Relaxed);
        match self.moving.remove(&c) {
            Some(m) if m.token == token => {
                let mut b = Vec::new();
                ext::write_moved(&mut b, epoch);
                for r in &m.waiters {
                    self.answer(*r, &b);
                }
                if let Some(bal) = &mut self.balancer {
                    match m.by_balancer {
                        Some(bm) => {
                            bal.applied(&bm, true);
                            self.status.moves += 1;
                            self.status.moves_home += u64::from(bm.why == mbal_balance::Why::LeaseExpired);
                        }
                        // An operator's move: the cachelet's home is where
                        // they put it.
                        None => bal.set_home(c, worker as u16),
                    }
                    self.status.leases = bal.leases().len();
                    self.publish_status();
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
            self.request_move(c, to, reply);
        }
    }
}

/// What Phase 1 knows of the cluster: this server, the servers and
/// workers of the map, and the cluster's mean load when heard.
fn view_of(shared: &Shared, map: &ClusterMap, avg_load: Option<f64>) -> ClusterView {
    ClusterView {
        server: shared.server_id,
        servers: map.servers().len() as u16,
        workers: shared.settings.threads as u16,
        avg_load,
    }
}

/// The balancer's knobs as Phase 1 weighs loads with them (with emulated
/// capacity, each worker's ceiling).
pub(crate) fn hot_balance_config(settings: &crate::config::Settings) -> mbal_balance::Config {
    let mut cfg = settings.balance.clone();
    if settings.worker_capacity > 0 {
        cfg.worker_capacity = Some(settings.worker_capacity as f64);
    }
    cfg
}

/// `LOAD <seq> <len>\r\n<json>\r\n`: an epoch snapshot (and what was
/// decided) for `mbal load`.
fn load_reply(s: &EpochSnapshot, d: &Decided) -> Vec<u8> {
    let rec = EpochRecord { snapshot: s, balancer: d.balancer.as_ref(), hot: d.hot.as_ref(), hotkeys: &d.hotkeys };
    let json = serde_json::to_string(&rec).expect("snapshots serialise");
    let mut b = Vec::with_capacity(json.len() + 32);
    ext::write_load(&mut b, s.seq, json.as_bytes());
    b
}
