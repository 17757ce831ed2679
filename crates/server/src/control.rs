//! The controller: the server's control plane (DESIGN.md §6, "Where the
//! policy runs"). One thread beside the workers, with its own mailbox (a
//! channel of [`CtlMsg`]) and a periodic tick, the epoch. It is
//! to mbal what memcached's maintainer thread is to its slab automover: the
//! place that decides, apart from the request path.
//!
//! The decisions of the epoch tick, Phase 2 and the moves are made by
//! `mbal_balance::ControlCore` (events in, commands out, no clock); this
//! thread is its adapter. It turns its mailbox's messages into the core's
//! events and carries out the core's commands:
//! * the cluster map (the core's): workers route by their own tables
//!   (`moves`); `mbal map` answers with the core's map, whose epoch grows as
//!   moves finish;
//! * every cachelet move. `mbal move` and the balancer ask the core; a
//!   `Release` goes to the owner and the adopter's `Moved` comes back
//!   (`moves` has the protocol). One move per cachelet at a time; later
//!   requests for the same cachelet wait their turn (the core queues them);
//! * the epoch tick: every `--epoch-ms` the core starts a sampling round
//!   (each worker sends its [`WorkerSample`]; no client involved) and, once
//!   all have answered, closes an [`EpochSnapshot`], the policy's input.
//!   The last one is published for `stats cachelets`; about a minute of
//!   them ([`history_len`]) are kept for `mbal load` callers, so one that
//!   reads them in turn misses none;
//! * the local balancer (`--balancer on`, DESIGN.md §6): the core runs
//!   Phase 2 once per its epoch (`--balance-epoch-ms`, whole epochs) and
//!   starts the moves it decides. `stats balancer` shows its state (with
//!   the planner's wall-clock time, measured here); `mbal load` carries its
//!   decision beside the snapshot of the epochs where it decided.
//!
//! Phase 1 (hot keys, copies, grants, REPL_high slots) is still decided
//! here, on each epoch the core closes: the next step of moving the policy
//! into the core (docs/design-notes.md, "The controller's policy core").
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
    Access, ClusterView, Command, ControlCore, CoreSettings, Decision, EpochSnapshot, Event, HotKeyStat, HotKeys,
    KeyState, MoveAnswer, ReplicaDecision, SlotLedger, WorkerSample,
};
use mbal_cluster::ClusterMap;
use mbal_proto::ext;
use serde::Serialize;
use std::collections::{BTreeMap, VecDeque};
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
/// epoch and when a move ends): the core's, with the planner's time.
pub(crate) use mbal_balance::BalancerStatus;

pub(crate) struct Controller {
    shared: Arc<Shared>,
    inbox: Receiver<CtlMsg>,
    /// The policy's core: sampling rounds, Phase 2, moves, the map.
    core: ControlCore<ReplyTo>,
    epoch_len: Duration,
    next_tick: Instant,
    /// The planner's wall-clock time (the core has no clock).
    planner_us_last: u64,
    planner_us_max: u64,
    /// The newest epochs (snapshot and what was decided), oldest first:
    /// at most `history_len`.
    history: VecDeque<(Arc<EpochSnapshot>, Decided)>,
    history_len: usize,
    /// `mbal load` callers waiting for a newer epoch.
    load_waiters: Vec<(u64, ReplyTo)>,
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
        let core_settings = CoreSettings {
            server: shared.server_id,
            workers: shared.settings.threads as u16,
            balance_every: shared.settings.balance_every(),
            // With emulated capacity the policy knows each worker's ceiling.
            balancer: shared.settings.balancer.then(|| hot_balance_config(&shared.settings)),
        };
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
            hot,
            hot_meta: BTreeMap::new(),
            hot_status: HotStatus::default(),
            inbox,
            core: ControlCore::new(core_settings, map),
            epoch_len,
            next_tick: Instant::now(),
            planner_us_last: 0,
            planner_us_max: 0,
            history: VecDeque::new(),
            history_len: history_len(shared.settings.epoch_ms),
            load_waiters: Vec::new(),
            shared,
        }
    }

    pub(crate) fn run(mut self) {
        // Round 0 is the baseline the first epoch is measured from.
        self.step(Event::Tick);
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
                // stalled) skips (the core's rule): the next epoch is
                // simply longer.
                self.step(Event::Tick);
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
                self.step(Event::Sample { seq, sample: *sample })
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
            CtlMsg::Move { cachelet, to, reply } => {
                // A worker index past u16 is no worker: the core says so.
                let to = u16::try_from(to).unwrap_or(u16::MAX);
                self.step(Event::MoveAsked { cachelet, to, reply })
            }
            CtlMsg::Moved { token, cachelet, worker } => {
                self.step(Event::Moved { token, cachelet, worker: worker as u16 })
            }
            CtlMsg::Map { reply } => {
                let map = self.core.map();
                let json = map.to_json();
                let mut b = Vec::with_capacity(json.len() + 32);
                ext::write_map(&mut b, map.epoch(), json.as_bytes());
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

    // ---- the core's commands --------------------------------------------

    /// Give the core one event and carry out its commands.
    fn step(&mut self, event: Event<ReplyTo>) {
        let t = Instant::now();
        let commands = self.core.step(event);
        let us = t.elapsed().as_micros() as u64;
        let now = self.now_ns();
        for c in commands {
            match c {
                Command::SampleWorkers { seq } => {
                    for w in 0..self.shared.settings.threads {
                        self.shared.peers().send_one(w, Envelope::Sample { seq }, now);
                    }
                }
                Command::Release { cachelet, from, to, token } => {
                    let msg = Envelope::Release { cachelet, to: usize::from(to), token };
                    self.shared.peers().send_one(usize::from(from), msg, now);
                }
                Command::Reply { to, answer } => {
                    let mut b = Vec::new();
                    match answer {
                        MoveAnswer::Moved { epoch } => ext::write_moved(&mut b, epoch),
                        MoveAnswer::NotHere => b.extend_from_slice(b"CLIENT_ERROR cachelet is not on this server\r\n"),
                    }
                    self.answer(to, &b);
                }
                Command::MapEpoch(epoch) => {
                    self.shared.epoch.fetch_max(epoch, Ordering::Relaxed);
                }
                Command::Status(_) => self.publish_status(),
                Command::Epoch { snapshot, balancer } => {
                    if let Some(d) = &balancer {
                        // The step that closed a Phase 2 epoch is, to
                        // within a few microseconds, the planner's time.
                        self.planner_us_last = us;
                        self.planner_us_max = self.planner_us_max.max(us);
                        self.log_decision(snapshot.seq, d, us);
                        self.publish_status();
                    }
                    self.epoch_closed(snapshot, balancer);
                }
            }
        }
    }

    /// An epoch closed: publish it, run Phase 1 on it, answer `mbal load`
    /// callers waiting for it and keep it.
    fn epoch_closed(&mut self, snap: Arc<EpochSnapshot>, balancer: Option<Decision>) {
        *self.shared.latest.lock().unwrap_or_else(|p| p.into_inner()) = Some(snap.clone());
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

    fn log_decision(&self, epoch: u64, d: &Decision, us: u64) {
        if d.transition.is_some() || !d.moves.is_empty() || d.escalate.is_some() {
            tracing::info!(
                epoch,
                state = ?d.state,
                transition = ?d.transition,
                max_over_avg = format!("{:.2}", d.imbalance.max_over_avg),
                moves = ?d.moves.iter().map(|m| (m.cachelet, m.from, m.to, m.why)).collect::<Vec<_>>(),
                escalate = ?d.escalate.as_ref().map(|e| e.why),
                planner_us = us,
                "balancer"
            );
        }
    }

    fn publish_status(&self) {
        let mut st = self.core.status().clone();
        (st.planner_us_last, st.planner_us_max) = (self.planner_us_last, self.planner_us_max);
        *self.shared.balancer.lock().unwrap_or_else(|p| p.into_inner()) = Some(st);
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
        let view = view_of(&self.shared, self.core.map(), avg);
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
        let map = self.core.map();
        let c = map.keyspace().cachelet_of_hash(mbal_cluster::key_hash(&key));
        let (server, worker) = map.owner(c);
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
        let (servers, workers) = (self.core.map().servers().len() as u16, self.shared.settings.threads as u16);
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
