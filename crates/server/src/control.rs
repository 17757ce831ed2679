//! The controller: the server's control plane (DESIGN.md §6, "Where the
//! policy runs"). One thread beside the workers, with its own mailbox (a
//! channel of [`CtlMsg`]) and a periodic tick, the epoch. It is
//! to mbal what memcached's maintainer thread is to its slab automover: the
//! place that decides, apart from the request path.
//!
//! Every decision is made by `mbal_balance::ControlCore` (events in,
//! commands out, time passed in): this thread is its adapter. It turns its
//! mailbox's messages into the core's events, stamped with the server's
//! clock, and carries out the core's commands:
//! * the cluster map (the core's): workers route by their own tables
//!   (`moves`); `mbal map` answers with the core's map, whose epoch grows as
//!   moves finish;
//! * every cachelet move. `mbal move` and the balancer ask the core; a
//!   `Release` goes to the owner and the adopter's `Moved` comes back
//!   (`moves` has the protocol). One move per cachelet at a time; later
//!   requests for the same cachelet wait their turn (the core queues them);
//! * the epoch tick: every `--epoch-ms` the core starts a sampling round
//!   (each worker sends its [`WorkerSample`](mbal_balance::WorkerSample); no
//!   client involved) and, once all have answered, closes an
//!   [`EpochSnapshot`], the policy's input. The last one is published for
//!   `stats cachelets`; about a minute of them ([`history_len`]) are kept
//!   for `mbal load` callers, so one that reads them in turn misses none;
//! * the local balancer (`--balancer on`): the core runs Phase 2 once per
//!   its epoch (`--balance-epoch-ms`, whole epochs) and starts the moves
//!   it decides; `stats balancer` shows its state (with the planner's
//!   wall-clock time, measured here);
//! * Phase 1 (`--hot-keys on`): the core decides which keys get copies and
//!   the leases to grant; this thread tells home workers
//!   ([`HotCmd`]), queues the replicator's renewals, and passes the slot
//!   asks to the `mbal-slots` thread (`crate::slots`). The other servers'
//!   records reach the core from the peer-load threads (`crate::peerload`)
//!   as messages. `stats hotkeys` shows its figures.
//!
//! It never touches a worker's store or tables: it talks to workers only by
//! message, and they answer by message, so nothing here needs a lock but the
//! published snapshot's and statuses' (read by stats rendering, written
//! once per epoch).

use crate::msg::replica::{Done, Job, Op};
use crate::msg::{CtlCmd, CtlMsg, OwnMsg};
use crate::msg::{Envelope, HotCmd, ReplyBatch, ReplyTo, NO_CACHELET};
use crate::shared::Shared;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use mbal_balance::{
    Answer, Command, ControlCore, CoreSettings, Decision, EpochSnapshot, Event, HotCommand, HotKeyStat, HotSettings,
    KeyState, ReplicaDecision,
};
use mbal_cluster::ClusterMap;
use mbal_proto::ext;
use serde::Serialize;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[cfg(test)]
mod tests;

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

pub(crate) struct Controller {
    shared: Arc<Shared>,
    inbox: Receiver<CtlMsg>,
    /// The policy's core: every decision, the map.
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
    /// The thread that asks other servers for REPL_high slots.
    slot_asks: Option<Sender<crate::msg::Ask>>,
    /// The heartbeat thread (`--coordinator`): moves to report.
    reports: Option<Sender<crate::beat::Report>>,
    /// Cachelets that arrived from other servers (`mbal import commit`) that no installed map
    /// shows yet, with the map epoch of their commit (the core's map has them here at once:
    /// `Event::Arrived`).
    arrived: std::collections::HashMap<u32, u64>,
    /// Maps from the coordinator applied so far (`OwnMsg::Applied`), and the one a reset
    /// waits for with the workers that have not yet applied it.
    applied_seq: u64,
    reset_wait: Option<(u64, usize)>,
}

impl Controller {
    pub(crate) fn new(
        shared: Arc<Shared>,
        inbox: Receiver<CtlMsg>,
        map: ClusterMap,
        slot_asks: Option<Sender<crate::msg::Ask>>,
        reports: Option<Sender<crate::beat::Report>>,
    ) -> Controller {
        let epoch_len = Duration::from_millis(shared.settings.epoch_ms.max(1));
        let settings = &shared.settings;
        // Phase 1 runs with the replicator (a cluster of two or more servers).
        let hot = shared.replicator.is_some().then(|| HotSettings {
            policy: settings.hot.policy.clone(),
            balance: hot_balance_config(settings),
            copy_ttl_ms: settings.hot.copy_ttl_ms(),
            // Slots are lent only under the default REPL_high (the
            // cluster's floor(2·n·ln n)); an explicit --hot-repl-high is per server.
            lend_slots: settings.hot.policy.repl_high.is_none() && slot_asks.is_some(),
        });
        let core_settings = CoreSettings {
            server: shared.server_id,
            workers: settings.threads as u16,
            balance_every: settings.balance_every(),
            // With emulated capacity the policy knows each worker's ceiling.
            balancer: settings.balancer.then(|| hot_balance_config(settings)),
            epoch_ms: settings.epoch_ms,
            hot,
            coordinated: !settings.coordinator.is_empty(),
        };
        Controller {
            core: ControlCore::new(core_settings, map, shared.clock_ns()),
            inbox,
            epoch_len,
            next_tick: Instant::now(),
            planner_us_last: 0,
            planner_us_max: 0,
            history: VecDeque::new(),
            history_len: history_len(shared.settings.epoch_ms),
            load_waiters: Vec::new(),
            slot_asks,
            reports,
            arrived: Default::default(),
            applied_seq: 0,
            reset_wait: None,
            shared,
        }
    }

    pub(crate) fn run(mut self) {
        self.step(Event::Start);
        self.next_tick = Instant::now() + self.epoch_len;
        // Until the stop's drain is over: draining workers may still need the map or a move.
        while !self.shared.stopped() {
            let wait = self.next_tick.saturating_duration_since(Instant::now());
            match self.inbox.recv_timeout(wait) {
                Ok(msg) => self.handle(msg),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
            if Instant::now() >= self.next_tick {
                self.next_tick += self.epoch_len;
                // The slots' tick, and a new sampling round unless the last
                // is still open (a worker stalled: the next epoch is simply
                // longer). The core's rules.
                self.step(Event::Tick);
            }
        }
    }

    fn handle(&mut self, msg: CtlMsg) {
        let event = match msg {
            CtlMsg::Sample { seq, sample, keys, home_reads } => {
                Event::Sample { seq, sample: *sample, keys, home_reads }
            }
            CtlMsg::HotDone { key, created, ok, at_ns, copy_reads } => {
                tracing::debug!(
                    server = self.shared.server_id,
                    key = %String::from_utf8_lossy(&key),
                    created,
                    ok,
                    "hot copies done"
                );
                Event::HotDone { key, created, ok, at_ns, copy_reads }
            }
            CtlMsg::HotFailed { key } => Event::HotFailed { key },
            CtlMsg::HotAlarm { worker, keys, secs, home, home_secs } => {
                tracing::debug!(
                    server = self.shared.server_id,
                    worker,
                    samples = keys.len(),
                    secs = format!("{secs:.2}"),
                    "hot alarm"
                );
                Event::HotAlarm { worker, keys, secs, home, home_secs }
            }
            // A worker index past u16 is no worker: the core says so.
            CtlMsg::Move { cachelet, to, reply } => {
                Event::MoveAsked { cachelet, to: u16::try_from(to).unwrap_or(u16::MAX), reply }
            }
            CtlMsg::Moved { token, cachelet, worker } => Event::Moved { token, cachelet, worker: worker as u16 },
            CtlMsg::Arrived { cachelet, worker, epoch } => {
                // Until a map at least as new as its commit comes, no older one takes it away.
                self.arrived.insert(cachelet, epoch);
                if let Some(tx) = &self.reports {
                    let _ = tx.send(crate::beat::Report::BeatNow);
                }
                Event::Arrived { cachelet, worker }
            }
            CtlMsg::Migrate { cachelet, server, worker, addr, reply } => {
                return self.migrate(cachelet, (server, worker), addr, reply)
            }
            CtlMsg::Map { have, reply } => {
                let map = self.core.map();
                let mut b = Vec::new();
                ext::write_map_since(&mut b, map.epoch(), have, || map.to_json().into_bytes());
                return self.answer(reply, &b);
            }
            CtlMsg::Load { after, reply } => {
                return match self.history.iter().find(|(s, _)| s.seq > after) {
                    Some((s, d)) => {
                        let b = load_reply(s, d);
                        self.answer(reply, &b);
                    }
                    None => self.load_waiters.push((after, reply)),
                };
            }
            CtlMsg::Pin { key, replicas, reply } => Event::Pin { key, replicas, reply },
            CtlMsg::Lend { borrower, slots, lease_ms, reply } => Event::Lend { borrower, slots, lease_ms, reply },
            CtlMsg::Held { lender, reply } => Event::Held { lender, reply },
            CtlMsg::PeerHolds { peer, held } => Event::PeerHolds { peer, held },
            CtlMsg::SlotsGranted { lender, slots, asked_at, lease_ns } => {
                tracing::debug!(server = self.shared.server_id, lender, slots, "slots granted");
                Event::SlotsGranted { lender, slots, asked_at, lease_ns }
            }
            CtlMsg::DebugSlots { demand, reply } => Event::DebugSlots { demand, reply },
            CtlMsg::PeerLoad { server, mean, hot } => Event::PeerLoad { server, mean, hot },
            CtlMsg::CoordMap { mut map, reset } => {
                // A map older than an arrival's commit (the beat's answer may have left the
                // coordinator before the commit, e.g. the map of this cachelet's previous move
                // away from here) still has the cachelet elsewhere: it stays where it arrived,
                // or this server would drop its items and route it away until the next map.
                let me = self.shared.server_id;
                if reset {
                    self.arrived.clear();
                }
                for (&c, &commit) in &self.arrived {
                    let at = self.core.map().owner(c);
                    if commit > map.epoch() && at.0 == me && c < map.cachelet_count() && map.has_worker(at) {
                        map.set_owner_local(c, at);
                    }
                }
                let epoch = map.epoch();
                self.step(Event::Map { map: *map, reset });
                self.arrived.retain(|_, &mut commit| commit > epoch);
                let addrs = crate::shared::members_of(self.core.map());
                *self.shared.members.write().unwrap_or_else(|p| p.into_inner()) = addrs;
                if let Some(f) = &self.shared.forward {
                    f.new_map(self.core.map().clone());
                }
                // Every worker says when it applied the map's changes (they precede this on
                // its channel); a reset waits for all of them before the lease is renewed.
                self.applied_seq += 1;
                let seq = self.applied_seq;
                let now = self.now_ns();
                for w in 0..self.shared.settings.threads {
                    self.shared.peers().send_one(w, Envelope::Own(OwnMsg::Applied { seq }), now);
                }
                if reset {
                    self.reset_wait = Some((seq, self.shared.settings.threads));
                }
                return;
            }
            CtlMsg::Applied { seq } => {
                if let Some((want, left)) = &mut self.reset_wait {
                    if seq == *want {
                        *left -= 1;
                        if *left == 0 {
                            self.reset_wait = None;
                            self.shared.resetting.store(false, Ordering::Release);
                            tracing::info!(server = self.shared.server_id, "the map after the reset is applied");
                        }
                    }
                }
                return;
            }
            CtlMsg::Wake => return,
        };
        self.step(event);
    }

    fn now_ns(&self) -> u64 {
        self.shared.clock_ns()
    }

    /// Send reply bytes to a client connection's waiting slot.
    /// `mbal migrate <cachelet> <server> <worker>`: move a cachelet of this server to
    /// another one (`crate::migrate`); the answer comes when the move ends.
    fn migrate(&mut self, c: u32, (server, worker): (u16, u16), addr: Option<std::net::SocketAddr>, reply: ReplyTo) {
        let Some(coord) = self.reports.clone() else {
            return self.answer(reply, b"CLIENT_ERROR moving a cachelet to another server needs a coordinator\r\n");
        };
        let map = self.core.map();
        let me = self.shared.server_id;
        let to_addr = match (map.has_worker((server, worker)), addr) {
            (_, Some(a)) => a,
            (true, None) => map.worker_addr(server, worker),
            (false, None) => return self.answer(reply, b"CLIENT_ERROR no such worker on another server\r\n"),
        };
        if c >= map.cachelet_count() || server == me {
            return self.answer(reply, b"CLIENT_ERROR no such cachelet, or the destination is this server\r\n");
        }
        // (A cachelet that arrived is in the core's map at once: `Event::Arrived`.)
        let w = match map.owner(c) {
            (s, w) if s == me => w,
            _ => return self.answer(reply, b"CLIENT_ERROR cachelet is not on this server\r\n"),
        };
        let order = crate::migrate::Order { cachelet: c, worker: usize::from(w), to: (server, worker), to_addr, reply };
        crate::migrate::spawn(self.shared.clone(), coord, order);
    }

    fn answer(&self, to: ReplyTo, bytes: &[u8]) {
        let mut batch = ReplyBatch::default();
        batch.push(to, NO_CACHELET, |d| d.extend_from_slice(bytes));
        self.shared.peers().send_one(to.worker, Envelope::Replies(batch), self.now_ns());
    }

    // ---- the core's commands --------------------------------------------

    /// Give the core one event, at the server's clock now, and carry out
    /// its commands in order.
    fn step(&mut self, event: Event<ReplyTo>) {
        let t = Instant::now();
        let now = self.now_ns();
        let commands = self.core.step(now, event);
        let us = t.elapsed().as_micros() as u64;
        for c in commands {
            match c {
                Command::SampleWorkers { seq } => {
                    for w in 0..self.shared.settings.threads {
                        self.shared.peers().send_one(w, Envelope::Ctl(CtlCmd::Sample { seq }), now);
                    }
                }
                Command::Release { cachelet, from, to, token } => {
                    let msg = Envelope::Own(OwnMsg::Release { cachelet, to: usize::from(to), token });
                    self.shared.peers().send_one(usize::from(from), msg, now);
                }
                Command::Reply { to, answer } => self.answer(to, &answer_bytes(answer)),
                Command::MapEpoch(epoch) => {
                    self.shared.epoch.fetch_max(epoch, Ordering::Relaxed);
                }
                Command::Status(_) => self.publish_status(),
                Command::Hot { worker, cmd } => {
                    let cmd = match cmd {
                        HotCommand::Replicate { key, replicas } => HotCmd::Replicate { key, replicas },
                        HotCommand::Grants(list) => HotCmd::Grants(list),
                        HotCommand::Retire { key } => HotCmd::Retire { key },
                        HotCommand::AlarmLimit(limit) => HotCmd::AlarmLimit(limit),
                        HotCommand::SampleRate(rate) => HotCmd::SampleRate(rate),
                    };
                    self.shared.peers().send_one(usize::from(worker), Envelope::Ctl(CtlCmd::Hot(cmd)), now);
                }
                Command::Renew { key, to, ttl_ms, at_ns } => {
                    if let Some(jobs) = &self.shared.replicator {
                        let done = Done::Controller { created: false, at_ns };
                        let _ = jobs.send(Job { key, to, op: Op::Renew { ttl_ms }, done });
                    }
                }
                Command::AskLend { lender, slots, lease_ms } => {
                    tracing::trace!(server = self.shared.server_id, lender, slots, "slots asked");
                    if let Some(tx) = &self.slot_asks {
                        let _ = tx.send(crate::msg::Ask::Lend { lender, slots, lease_ms });
                    }
                }
                Command::AskHeld { peer } => {
                    if let Some(tx) = &self.slot_asks {
                        let _ = tx.send(crate::msg::Ask::Held { peer });
                    }
                }
                Command::Reassign { cachelet, owner: (server, worker) } => {
                    // The new owner first, so that no request routed by the new owner reaches it
                    // before it has the cachelet (every worker's channel is FIFO).
                    let epoch = self.core.map().epoch();
                    let msg = || Envelope::Own(OwnMsg::Reassign { cachelet, server, worker, epoch });
                    let first = (server == self.shared.server_id).then_some(usize::from(worker));
                    if let Some(f) = first {
                        self.shared.peers().send_one(f, msg(), now);
                    }
                    for w in (0..self.shared.settings.threads).filter(|&w| Some(w) != first) {
                        self.shared.peers().send_one(w, msg(), now);
                    }
                }
                Command::ReportMove { cachelet, worker } => {
                    if let Some(tx) = &self.reports {
                        let _ = tx.send(crate::beat::Report::Moved { cachelet, worker });
                    }
                }
                Command::HotStatus(st) => {
                    *self.shared.hotkeys.lock().unwrap_or_else(|p| p.into_inner()) = Some(*st);
                }
                Command::Epoch(e) => {
                    let mbal_balance::control::EpochClosed { snapshot, balancer, hot, hotkeys } = *e;
                    if let Some(d) = &balancer {
                        // The step that closed a Phase 2 epoch: its plan
                        // and, in the same step, Phase 1's epoch.
                        self.planner_us_last = us;
                        self.planner_us_max = self.planner_us_max.max(us);
                        self.log_decision(snapshot.seq, d, us);
                        self.publish_status();
                    }
                    if let Some(d) = &hot {
                        self.log_hot(&snapshot, d, &hotkeys);
                    }
                    self.epoch_closed(snapshot, Decided { balancer, hot, hotkeys });
                }
            }
        }
    }

    /// An epoch closed: publish it, answer `mbal load` callers waiting for
    /// it and keep it.
    fn epoch_closed(&mut self, snap: Arc<EpochSnapshot>, decided: Decided) {
        if let Some(tx) = &self.reports {
            // With a coordinator, this server's epoch goes to the others through it (the
            // peer-load threads do not run).
            let cfg = hot_balance_config(&self.shared.settings);
            let mean = mbal_balance::control::phase1::mean_load(&snap, &cfg);
            let hot = decided.hot.as_ref().map(|d| mbal_balance::PeerHot { spare: d.spare, heat: d.heat.clone() });
            let _ = tx.send(crate::beat::Report::Load { mean, hot });
            // And, for Phase 3, its cachelets' loads and memory, with Phase 2's escalation.
            let mem_limit = self.shared.settings.memory_limit as u64;
            let report = mbal_balance::ServerReport::from_snapshot(self.shared.server_id, &snap, &cfg, mem_limit);
            let escalation = decided.balancer.as_ref().and_then(|d| d.escalate.clone());
            let local_moves = decided.balancer.as_ref().is_some_and(|d| !d.moves.is_empty());
            let r = mbal_balance::Phase3Report { report, escalation, local_moves };
            let _ = tx.send(crate::beat::Report::Phase3(Box::new(r)));
        }
        *self.shared.latest.lock().unwrap_or_else(|p| p.into_inner()) = Some(snap.clone());
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

    fn log_hot(&self, snap: &EpochSnapshot, d: &ReplicaDecision, top: &[HotKeyStat]) {
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
            let keys: Vec<String> = top
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
                .map(|w| format!("{:.2}", self.core.hot().map_or(1.0, |h| h.press_of(w))))
                .collect();
            tracing::debug!(
                server = self.shared.server_id,
                epoch = snap.seq,
                avg = format!("{:.0}", self.core.hot_avg()),
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
    }

    fn publish_status(&self) {
        let mut st = self.core.status().clone();
        (st.planner_us_last, st.planner_us_max) = (self.planner_us_last, self.planner_us_max);
        *self.shared.balancer.lock().unwrap_or_else(|p| p.into_inner()) = Some(st);
    }
}

/// The bytes of an answer to a waiting client.
fn answer_bytes(answer: Answer) -> Vec<u8> {
    let mut b = Vec::new();
    match answer {
        Answer::Moved { epoch } => ext::write_moved(&mut b, epoch),
        Answer::NotHere => b.extend_from_slice(b"CLIENT_ERROR cachelet is not on this server\r\n"),
        Answer::Stayed => b.extend_from_slice(b"SERVER_ERROR cachelet is moving to another server; it stayed\r\n"),
        Answer::Ok => b.extend_from_slice(b"OK\r\n"),
        Answer::HotOff => b.extend_from_slice(b"CLIENT_ERROR hot-key replication is off\r\n"),
        Answer::KeyElsewhere => b.extend_from_slice(b"CLIENT_ERROR key is served by another mbal server\r\n"),
        Answer::CouldNotReplicate => b.extend_from_slice(b"SERVER_ERROR could not replicate\r\n"),
        Answer::Slots { granted, lease_ms } => ext::write_slots(&mut b, granted as u64, lease_ms),
        Answer::Held(n) => ext::write_held(&mut b, n as u64),
        Answer::NoSlots => {
            b.extend_from_slice(b"CLIENT_ERROR no slots are lent here (Phase 1 off or --hot-repl-high set)\r\n")
        }
    }
    b
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
