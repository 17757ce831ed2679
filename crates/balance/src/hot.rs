//! Phase 1 policy: hot-key replication (DESIGN.md §6; MBal §3.2, SPORE §3,
//! NetKV §IV). Pure: the caller samples requests, feeds them to
//! [`HotKeys::observe`], calls [`HotKeys::on_epoch`] once per balancer
//! epoch with the server's [`EpochSnapshot`], carries out the
//! [`ReplicaDecision`] and reports back ([`HotKeys::replicas_ready`],
//! [`HotKeys::replication_failed`], [`HotKeys::write_propagating`]).
//!
//! * Hotspot triggering (SPORE §3.5): only a key whose worker is past its
//!   load threshold starts being replicated, or one that alone would put
//!   any worker past the target (f − f/n > (target − 1) × the mean).
//! * Replica count (NetKV §IV-B): r = ceil(f/T) copies (home included), T
//!   chosen each epoch as the largest threshold whose estimated max/avg
//!   worker load meets `target_imbalance` ([`choose_threshold`]).
//! * REPL_high (MBal §3.2) caps the keys replicated at once; a hotspot it
//!   cannot fix (cap reached, write-heavy, or no single hot key) is
//!   reported as a [`HotEscalation`] for Phase 2/3.
//! * Per key, SPORE's five states ([`KeyState`]) with named transitions
//!   ([`step`]).
//! * [`replica_location`]: where replica i of a key lives, computable by a
//!   client from the key hash, its home and the replica count alone.

use crate::config::Config;
use crate::measure::worker_loads;
use crate::snapshot::EpochSnapshot;
use crate::tracker::{self, Access, Counted, Tracker, TrackerKind};
pub use mbal_cluster::replica_location;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

mod alarm;
pub use alarm::AlarmDecision;
mod cap;
mod estimate;
mod press;
pub use press::{PRESS_FLOOR, PRESS_MIN_SHARE, PRESS_STEP};
mod slots;
mod states;
pub use estimate::{choose_threshold, copies, estimate_max_over_avg, expected_max_normal, sample_rate_for};
pub use slots::{cedable, entitlements, SlotHeat, SlotLedger, CLAIM_FACTOR};
pub use states::{step, KeyEvent, KeyState, KeyTransition};

/// Phase 1's knobs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HotConfig {
    /// The fraction of requests the caller samples into the tracker when
    /// `sample_target` is 0 (default 0.03, SPORE's 3%), and the rate
    /// until the first epoch's loads are known otherwise; rates are
    /// samples ÷ the rate in force ([`HotKeys::sample_rate`]) ÷ epoch.
    pub sample_rate: f64,
    /// Sampled requests to aim for per worker and epoch (default 100; 0:
    /// a fixed `sample_rate`). Each epoch the rate for the next is this ÷
    /// (this server's mean requests per worker in an epoch), within
    /// `sample_min`..=`sample_max`: what tells a key worth a copy from
    /// noise is its share of its worker's load (a key at share p gets
    /// about target × p samples, and `min_samples` of them), so the count
    /// per worker is what must hold, whatever the load: 14% at 700
    /// requests/s per worker, 0.01% at 1M.
    pub sample_target: f64,
    /// Bounds of the rate set from `sample_target` (default 0.0001 and
    /// 0.25).
    pub sample_min: f64,
    pub sample_max: f64,
    /// The tracker (default lossy counting, chosen by measurement:
    /// docs/design-notes.md "Phase 1: which hot-key tracker").
    pub tracker: TrackerKind,
    /// Keys the tracker holds (the lossy counter's epsilon is 1/capacity;
    /// default 1024) and the most keys the policy considers per epoch.
    pub capacity: usize,
    /// Weight of the past at each epoch end for the EWMA and Space-Saving
    /// trackers (default 0.5; the lossy counter restarts each epoch).
    pub decay: f64,
    /// The max/avg worker load to reach (default 1.1); also the hotspot
    /// trigger: a worker above `target_imbalance` × the mean load (or
    /// above `saturated_util` × its capacity, when known) replicates.
    pub target_imbalance: f64,
    /// REPL_high: at most this many keys of this server replicated at
    /// once. `None`: this server's share of floor(2·n·ln n) for the
    /// cluster's n workers, split evenly over the servers (the first
    /// `total % servers` servers get one more), so that the cluster as a
    /// whole stays within floor(2·n·ln n), with slots lent between
    /// servers on top ([`SlotLedger`], [`HotKeys::set_repl_high`]).
    pub repl_high: Option<usize>,
    /// When REPL_high is reached (default on), a waiting key makes room:
    /// first a key already retiring (COLD_PENDING) is retired at once,
    /// then a key at least twice as hot as the coolest displaceable HOT
    /// key of this server (see `displace_quiet`) displaces it, retired at
    /// once too; the new key is replicated in the same epoch. Retired at
    /// once: its copies are deleted now, not after the leases it gave (a
    /// client still holding one is redirected home by the copy's worker,
    /// docs/protocol.md), so REPL_high bounds the keys with copies (HOT,
    /// HOT_PENDING, COLD_PENDING) at every epoch and alarm. Off: a new key
    /// waits until an old one has cooled and retired after its leases.
    /// See docs/benchmarks-journal.md §15 for what it does to the copies made and
    /// the reaction time.
    pub displace: bool,
    /// With `displace`: a HOT key may be displaced only after this many
    /// consecutive epochs (default 1) in which its rate as measured (not
    /// smoothed) was at most `cool_fraction` × T, or under the rate below
    /// which a key is sampling noise; it is judged by that rate. When its
    /// home reports its reads exactly ([`HotKeys::home_reads`]) the rate
    /// measured is those reads × (γ + 1), this epoch's: a key whose
    /// readers left is seen in the first epoch after (its copies' reads
    /// come with the renewals, an epoch late), and an exact count has no
    /// sampling noise to wait out (with sampled home reads, 2 epochs).
    pub displace_quiet: u32,
    /// SPORE's read-up/write-down weights: a key is replicable when
    /// `read_up` × reads − `write_down` × writes > 0 (default 1 and 9:
    /// at least 9 reads per write).
    pub read_up: f64,
    pub write_down: f64,
    /// A client lease on a replica, in epochs (default 2); COLD_PENDING
    /// waits this long (plus one epoch) before replicas are deleted.
    pub lease_epochs: u32,
    /// A HOT key cools when, for `cool_epochs` consecutive epochs (default
    /// 3), its rate is at most `cool_fraction` × T (well below the T at
    /// which a key needs a copy: hysteresis against keys that hover near
    /// T) or it turned write-heavy.
    pub cool_epochs: u32,
    /// See `cool_epochs` (default 0.5).
    pub cool_fraction: f64,
    /// A key whose rate stands for fewer sampled requests per epoch than
    /// this (default 3) is sampling noise: left out of T's estimate and
    /// never replicated. (At 3% sampling, 1 sample is 33 requests/s: with
    /// every such key in the estimate, T fell to its floor and every noise
    /// key got the most copies.)
    pub min_samples: f64,
    /// A tracked key's estimated rate falls by at most this fraction per
    /// epoch (default 0.5: at most halved), so one quiet epoch (sampling
    /// noise, a lease turnover) does not make a hot key look cold.
    pub max_fall: f64,
    /// Epochs HOT_PENDING may wait for [`HotKeys::replicas_ready`]
    /// (default 3).
    pub pending_timeout_epochs: u32,
}

impl Default for HotConfig {
    fn default() -> Self {
        HotConfig {
            sample_rate: 0.03,
            sample_target: 100.0,
            sample_min: 0.0001,
            sample_max: 0.25,
            tracker: TrackerKind::Lossy,
            capacity: 1024,
            decay: 0.5,
            target_imbalance: 1.1,
            repl_high: None,
            displace: true,
            displace_quiet: 1,
            read_up: 1.0,
            write_down: 9.0,
            lease_epochs: 2,
            cool_epochs: 3,
            cool_fraction: 0.5,
            min_samples: 3.0,
            max_fall: 0.5,
            pending_timeout_epochs: 3,
        }
    }
}

/// What the policy knows of the cluster beyond this server.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterView {
    /// This server's index.
    pub server: u16,
    pub servers: u16,
    /// This server's workers.
    pub workers: u16,
    /// Every server's workers together (servers may differ in size).
    pub cluster_workers: u32,
    /// The cluster's mean load per worker (requests/s), when known (the
    /// server follows the other servers' epochs); else this server's mean
    /// stands for it.
    pub avg_load: Option<f64>,
}

impl ClusterView {
    /// A cluster of `servers` servers of `workers` workers each.
    pub const fn uniform(server: u16, servers: u16, workers: u16, avg_load: Option<f64>) -> ClusterView {
        ClusterView { server, servers, workers, cluster_workers: servers as u32 * workers as u32, avg_load }
    }

    /// n, the cluster's workers.
    pub fn n(&self) -> usize {
        self.cluster_workers as usize
    }

    /// The most copies a key can have: home plus one on every worker of
    /// every other server.
    pub fn max_copies(&self) -> u32 {
        1 + self.cluster_workers.saturating_sub(u32::from(self.workers))
    }
}

/// Replicate a key now (new, or more replicas than before).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Replicate {
    pub key: Vec<u8>,
    /// The worker that is its home.
    pub worker: u16,
    /// γ: replicas 1..=γ (home not counted) at [`replica_location`].
    pub replicas: u32,
    /// The lease clients get, in epochs.
    pub lease_epochs: u32,
}

/// Delete a key's replicas 1..=`replicas`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Retire {
    pub key: Vec<u8>,
    pub worker: u16,
    pub replicas: u32,
}

/// Why Phase 1 cannot fix a hotspot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum HotEscalateWhy {
    /// More keys call for replicas than REPL_high allows.
    ReplHigh { wanted: usize, cap: usize },
    /// Most of a hot worker's hot-key load is write-heavy.
    WriteHeavy,
    /// A worker is hot but no single key of it is hot enough to copy
    /// (a hot partition: Phase 2's case).
    NoHotKeys,
    /// A single server: there is no other server for shadows.
    NoShadows,
}

/// A hotspot Phase 1 leaves to Phase 2/3.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HotEscalation {
    pub why: HotEscalateWhy,
    /// The hot workers concerned.
    pub workers: Vec<u16>,
}

/// A tracked key as `stats hotkeys` shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HotKeyStat {
    pub key: Vec<u8>,
    pub worker: u16,
    /// Estimated requests per second over all copies.
    pub reads_per_sec: f64,
    pub writes_per_sec: f64,
    pub state: KeyState,
    pub replicas: u32,
}

/// One epoch's Phase 1 decision.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReplicaDecision {
    pub epoch: u64,
    /// T (requests/s): r = ceil(f/T).
    pub threshold: f64,
    /// The estimated max/avg worker load with every replicable key at its
    /// r (balls and bins), and without replication.
    pub estimated_max_over_avg: f64,
    pub unreplicated_max_over_avg: f64,
    /// Workers past their load threshold.
    pub hot_workers: Vec<u16>,
    pub replicate: Vec<Replicate>,
    pub retire: Vec<Retire>,
    /// Keys whose reads get a replica count and lease now (HOT), with γ.
    pub hints: Vec<(Vec<u8>, u32)>,
    pub escalate: Option<HotEscalation>,
    /// Keys with replicas (HOT_PENDING, HOT, COLD_PENDING) after this.
    pub replicated: usize,
    /// REPL_high for this server at this epoch (its share, less the slots
    /// it lent, plus those it holds).
    #[serde(default)]
    pub cap: usize,
    /// Keys that wanted copies and found no slot under it.
    #[serde(default)]
    pub waiting: usize,
    /// The slots this server would lend another now (set by the caller
    /// that lends them, `SlotLedger::spare`; 0 here).
    #[serde(default)]
    pub spare: usize,
    /// The rates of this server's keys with copies and keys waiting, by
    /// which the servers lend slots ([`HotKeys::slot_heat`]).
    #[serde(default)]
    pub heat: SlotHeat,
    /// State changes this epoch, in key order.
    pub transitions: Vec<(Vec<u8>, KeyTransition)>,
}

#[derive(Clone, Debug)]
struct Entry {
    state: KeyState,
    worker: u16,
    replicas: u32,
    /// The epoch the current state was entered.
    since: u64,
    cool: u32,
    /// Copies 1..=`ready` exist (0 until the first are made).
    ready: u32,
    reads: f64,
    writes: f64,
    /// Replicated by an operator ([`HotKeys::pin`]): never cools or drops.
    pinned: bool,
    /// It retires once its leases end and is not re-heated before: its
    /// copies were lost ([`HotKeys::copies_lost`]), or their replication
    /// failed or timed out.
    broken: bool,
    /// This epoch's rate as measured (requests/s over all copies), before
    /// the smoothing of `reads`/`writes`; 0 when not seen. Displacement
    /// judges a HOT key by it: a key whose readers left (a shifted hot
    /// set) shows it at once, where the smoothed rate takes epochs to fall.
    raw: f64,
    /// The rate displacement judges a HOT key by: its home's exact reads
    /// this epoch × (γ + 1) when the home reported them, else `raw`.
    recent: f64,
    /// Consecutive epochs its `recent` rate was at most `cool_fraction` × T
    /// (or under the noise floor).
    quiet: u32,
    /// The lowest T it was replicated or grew at, since it last went COLD,
    /// while its worker's T was pressed down ([`HotKeys::press`]), as a
    /// share of the mean load per worker then; infinite when never. It
    /// cools at `cool_fraction` × that share of the mean at the highest, so
    /// a key its worker needed is not retired (its reads sent home again)
    /// because the worker, relieved by it, relaxed; nor at once when the
    /// server's own T needs no copies at all.
    pressed_share: f64,
}

/// One server's Phase 1 policy.
pub struct HotKeys {
    cfg: HotConfig,
    balance: Config,
    tracker: Box<dyn Tracker + Send>,
    keys: BTreeMap<Vec<u8>, Entry>,
    now: u64,
    /// The last epoch's cluster view, mean load per worker and the rate
    /// below which a key is sampling noise, for [`HotKeys::on_alarm`]
    /// between epochs.
    last: Option<(ClusterView, f64, f64)>,
    /// The last epoch's `cool_fraction` × T (infinite when no key needs a
    /// copy), for displacement by an alarm.
    last_cool_below: f64,
    /// The sampling rate in force (see [`HotConfig::sample_target`]).
    rate: f64,
    /// Reads served by each HOT key's copies since the last epoch, as the shadows reported
    /// them with the renewals ([`HotKeys::copy_reads`]).
    copy_reads: BTreeMap<Vec<u8>, u64>,
    /// Reads each replicated key got at its home this epoch, counted
    /// exactly ([`HotKeys::home_reads`]).
    home_reads: BTreeMap<Vec<u8>, u64>,
    /// REPL_high as the caller sets it from the slots lent and held
    /// ([`HotKeys::set_repl_high`]); `None`: the even share.
    cap: Option<usize>,
    /// Keys that wanted copies at the last epoch or alarm and found no slot.
    waiting: usize,
    /// Their rates, hottest first (as many as `waiting`).
    waiting_heat: Vec<(f64, Vec<u8>)>,
    /// Each of this server's workers' multiplier of T (at most 1): lowered
    /// each epoch the worker is hot, raised back each epoch it is under
    /// the mean ([`HotKeys::press`]).
    press: BTreeMap<u16, f64>,
}

/// REPL_high for the whole cluster: floor(2·n·ln n) for its n workers
/// (MBal §3.2).
pub fn repl_high_total(n: usize) -> usize {
    let n = n.max(2) as f64;
    (2.0 * n * n.ln()).floor() as usize
}

/// This server's share of [`repl_high_total`]: split evenly over the
/// servers, the first `total % servers` getting one more, so the shares
/// add up to the total.
pub fn repl_high_share(view: &ClusterView) -> usize {
    let total = repl_high_total(view.n());
    let servers = usize::from(view.servers.max(1));
    total / servers + usize::from(usize::from(view.server) < total % servers)
}

impl HotKeys {
    /// Phase 1 with its knobs and the balancer's (load weights, worker
    /// capacity, saturation, minimum load).
    pub fn new(cfg: HotConfig, balance: Config) -> HotKeys {
        let tracker = tracker::build(cfg.tracker, cfg.capacity, cfg.decay);
        let rate = cfg.sample_rate.clamp(1e-9, 1.0);
        HotKeys {
            cfg,
            balance,
            tracker,
            keys: BTreeMap::new(),
            now: 0,
            last: None,
            rate,
            copy_reads: BTreeMap::new(),
            home_reads: BTreeMap::new(),
            last_cool_below: f64::INFINITY,
            cap: None,
            waiting: 0,
            waiting_heat: Vec::new(),
            press: BTreeMap::new(),
        }
    }

    /// The reads `key`'s copies served since they were last renewed, as the shadows count
    /// them. A HOT key's rate at the next epoch is then its home's sampled reads plus these
    /// (measured), instead of the home's reads times (γ + 1) (inferred from the uniform lease
    /// draw), so a key whose readers left is seen to cool at once.
    pub fn copy_reads(&mut self, key: &[u8], reads: u64) {
        *self.copy_reads.entry(key.to_vec()).or_insert(0) += reads;
    }

    /// The reads of a replicated `key` its home served this epoch, counted
    /// exactly (every routed read of it asks for its hint there). Clients
    /// spread a HOT key's reads evenly over its γ + 1 copies, home
    /// included, so these × (γ + 1) are its rate now: what displacement
    /// judges a HOT key by (its copies' own counts arrive with the
    /// renewals, an epoch late, and the home's samples are too few to
    /// tell a key whose readers left from noise).
    pub fn home_reads(&mut self, key: &[u8], reads: u64) {
        *self.home_reads.entry(key.to_vec()).or_insert(0) += reads;
    }

    /// The fraction of requests to sample from now on: fixed, or set each
    /// epoch from [`HotConfig::sample_target`]. [`HotKeys::on_epoch`] and
    /// [`HotKeys::on_alarm`] take the samples they see as taken at it, so
    /// the caller should apply a new rate as soon as an epoch is decided.
    pub fn sample_rate(&self) -> f64 {
        self.rate
    }

    pub fn config(&self) -> &HotConfig {
        &self.cfg
    }

    /// One sampled request, served by `worker`.
    pub fn observe(&mut self, key: &[u8], kind: Access, worker: u16) {
        self.tracker.observe(key, kind, worker);
    }

    /// A key's state (INVALID when not tracked).
    pub fn state(&self, key: &[u8]) -> KeyState {
        self.keys.get(key).map_or(KeyState::Invalid, |e| e.state)
    }

    /// γ to piggyback on a reply for `key`: its replicas when HOT; while
    /// more copies are being made for a HOT key (HOT_PENDING after
    /// AddReplicas), the copies that exist already; else 0 (SPORE: no new
    /// leases while a key's first copies are made or once it cools). Were
    /// growth to withhold leases, every client would drop its lease and
    /// read at home until the new copies exist: the load the copies took
    /// would come back to the home for an epoch at each growth.
    pub fn hint(&self, key: &[u8]) -> u32 {
        match self.keys.get(key) {
            Some(e) if e.state == KeyState::Hot => e.replicas,
            Some(e) if e.state == KeyState::HotPending => e.ready,
            _ => 0,
        }
    }

    /// Keys with replicas now (HOT_PENDING, HOT, COLD_PENDING).
    pub fn replicated(&self) -> usize {
        self.keys.values().filter(|e| e.replicas > 0).count()
    }

    /// The tracked keys, hottest first (for `stats hotkeys`).
    pub fn top(&self, k: usize) -> Vec<HotKeyStat> {
        let mut v: Vec<HotKeyStat> = self
            .keys
            .iter()
            .map(|(key, e)| HotKeyStat {
                key: key.clone(),
                worker: e.worker,
                reads_per_sec: e.reads,
                writes_per_sec: e.writes,
                state: e.state,
                replicas: e.replicas,
            })
            .collect();
        v.sort_by(|a, b| (b.reads_per_sec + b.writes_per_sec).total_cmp(&(a.reads_per_sec + a.writes_per_sec)));
        v.truncate(k);
        v
    }

    fn apply(&mut self, key: &[u8], e: KeyEvent, log: &mut Vec<(Vec<u8>, KeyTransition)>) -> bool {
        let Some(entry) = self.keys.get_mut(key) else {
            return false;
        };
        let Some((next, t)) = step(entry.state, e) else {
            return false;
        };
        entry.state = next;
        entry.since = self.now;
        entry.cool = 0;
        // Entering HOT, every copy exists (made, or kept while it cooled);
        // while a write is copied, none may be read.
        match (next, t) {
            (KeyState::Hot, _) => entry.ready = entry.replicas,
            // Back to COLD, it starts over at its worker's T of the day.
            (KeyState::Cold, _) => (entry.ready, entry.pressed_share) = (0, f64::INFINITY),
            (KeyState::ColdPending, _) | (_, KeyTransition::PropagateWrite) => entry.ready = 0,
            _ => {}
        }
        log.push((key.to_vec(), t));
        true
    }

    /// The mechanism created or updated every replica of `key`
    /// (HOT_PENDING → HOT).
    pub fn replicas_ready(&mut self, key: &[u8]) -> Option<KeyTransition> {
        let mut log = Vec::new();
        self.apply(key, KeyEvent::Ready, &mut log);
        log.pop().map(|l| l.1)
    }

    /// The mechanism could not (HOT_PENDING → COLD_PENDING; the replicas
    /// that exist are deleted once the leases are over).
    pub fn replication_failed(&mut self, key: &[u8]) -> Option<KeyTransition> {
        let mut log = Vec::new();
        if self.apply(key, KeyEvent::Failed, &mut log) {
            // Retired before it may be replicated again: its copies are in
            // an unknown state, and a re-heat would grant leases to them.
            self.keys.get_mut(key).expect("present").broken = true;
        }
        log.pop().map(|l| l.1)
    }

    /// The mechanism lost `key`'s copies (a shadow unreachable, a renewal
    /// refused, the home gave the key up): no more leases (HOT_PENDING or
    /// HOT → COLD_PENDING); the copies that exist are deleted once the
    /// leases handed out have ended, and the key is not re-heated before.
    pub fn copies_lost(&mut self, key: &[u8]) -> Option<KeyTransition> {
        let e = self.keys.get_mut(key)?;
        e.pinned = false;
        let event = match e.state {
            KeyState::HotPending => KeyEvent::Failed,
            KeyState::Hot => KeyEvent::Cooled,
            KeyState::ColdPending => {
                e.broken = true;
                return None;
            }
            _ => return None,
        };
        e.broken = true;
        let mut log = Vec::new();
        self.apply(key, event, &mut log);
        log.pop().map(|l| l.1)
    }

    /// A write to a HOT key is being propagated (HOT → HOT_PENDING until
    /// [`HotKeys::replicas_ready`]).
    pub fn write_propagating(&mut self, key: &[u8]) -> Option<KeyTransition> {
        let mut log = Vec::new();
        self.apply(key, KeyEvent::WriteStarted, &mut log);
        log.pop().map(|l| l.1)
    }

    /// Replicate `key` (homed on `worker`) with `replicas` copies now,
    /// whatever its rate, and keep it replicated until [`HotKeys::unpin`]:
    /// an operator's (or a test's) override. `None` when it already has
    /// replicas or `replicas` is 0.
    pub fn pin(&mut self, key: &[u8], worker: u16, replicas: u32) -> Option<Replicate> {
        if replicas == 0 {
            return None;
        }
        let now = self.now;
        let e = self.keys.entry(key.to_vec()).or_insert(Entry {
            state: KeyState::Cold,
            worker,
            replicas: 0,
            since: now,
            cool: 0,
            ready: 0,
            reads: 0.0,
            writes: 0.0,
            pinned: true,
            broken: false,
            raw: 0.0,
            recent: 0.0,
            quiet: 0,
            pressed_share: f64::INFINITY,
        });
        e.pinned = true;
        if e.state != KeyState::Cold {
            return None;
        }
        e.worker = worker;
        e.replicas = replicas;
        let mut log = Vec::new();
        self.apply(key, KeyEvent::Heated, &mut log);
        Some(Replicate { key: key.to_vec(), worker, replicas, lease_epochs: self.cfg.lease_epochs })
    }

    /// Let a pinned key cool like any other.
    pub fn unpin(&mut self, key: &[u8]) {
        if let Some(e) = self.keys.get_mut(key) {
            e.pinned = false;
        }
    }

    /// The load (requests/s) above which a worker is hot when the
    /// cluster's mean per worker is `avg`: `target_imbalance` × `avg`, or
    /// `saturated_util` × its capacity when that is lower.
    fn hot_limit(&self, avg: f64) -> f64 {
        let mut limit = self.cfg.target_imbalance * avg;
        if let Some(cap) = self.balance.worker_capacity.filter(|c| *c > 0.0) {
            limit = limit.min(cap * self.balance.saturated_util);
        }
        limit
    }

    /// Start tracking `key` (INVALID → COLD) at the given rates, unless it is tracked.
    fn track(&mut self, key: &[u8], worker: u16, reads: f64, writes: f64, log: &mut Vec<(Vec<u8>, KeyTransition)>) {
        if self.keys.contains_key(key) {
            return;
        }
        let e = Entry {
            state: KeyState::Invalid,
            worker,
            replicas: 0,
            since: self.now,
            cool: 0,
            ready: 0,
            reads,
            writes,
            pinned: false,
            broken: false,
            raw: reads + writes,
            recent: reads + writes,
            quiet: 0,
            pressed_share: f64::INFINITY,
        };
        self.keys.insert(key.to_vec(), e);
        self.apply(key, KeyEvent::Tracked, log);
    }

    /// One epoch.
    pub fn on_epoch(&mut self, snap: &EpochSnapshot, view: &ClusterView) -> ReplicaDecision {
        self.now += 1;
        let now = self.now;
        let mut log = Vec::new();
        let counted: Vec<Counted> = self.tracker.end_epoch();

        // Loads and the hotspot trigger.
        let loads = worker_loads(snap, &self.balance);
        let local_avg = if loads.is_empty() { 0.0 } else { loads.iter().sum::<f64>() / loads.len() as f64 };
        let avg = view.avg_load.unwrap_or(local_avg);
        let limit = self.hot_limit(avg);
        let hot_workers: Vec<u16> = snap
            .workers
            .iter()
            .zip(&loads)
            .filter(|(_, &l)| avg >= self.balance.min_load && l > limit)
            .map(|(w, _)| w.worker)
            .collect();
        self.press(snap, &loads, avg, limit);

        // Rates: samples ÷ sampling rate ÷ epoch length; a HOT key's home
        // sees 1/(γ+1) of its reads.
        let secs = {
            let s: Vec<f64> = snap.workers.iter().map(|w| w.secs).filter(|s| *s > 0.0).collect();
            if s.is_empty() {
                1.0
            } else {
                s.iter().sum::<f64>() / s.len() as f64
            }
        };
        let scale = 1.0 / (self.rate * secs);
        if self.cfg.sample_target > 0.0 {
            // The next epoch's rate, from this one's requests per worker.
            let (lo, hi) = (self.cfg.sample_min, self.cfg.sample_max);
            self.rate = sample_rate_for(self.cfg.sample_target, local_avg * secs, lo, hi);
        }
        let mut seen: BTreeMap<Vec<u8>, (u16, f64, f64)> = BTreeMap::new();
        let mut copy_reads = std::mem::take(&mut self.copy_reads);
        let home_reads = std::mem::take(&mut self.home_reads);
        for c in counted.iter().take(self.cfg.capacity).filter(|c| c.total() >= 0.5) {
            let mut reads = (c.reads + c.error) * scale;
            if let Some(e) = self.keys.get(&c.key) {
                if e.state == KeyState::Hot {
                    // Measured when the copies reported, else inferred.
                    match copy_reads.remove(&c.key) {
                        Some(n) => reads += n as f64 / secs,
                        None => reads *= f64::from(e.replicas + 1),
                    }
                }
            }
            seen.insert(c.key.clone(), (c.worker, reads, c.writes * scale));
        }
        // A HOT key the home did not sample this epoch, read from its copies.
        for (k, n) in copy_reads {
            if let Some(e) = self.keys.get(&k).filter(|e| e.state == KeyState::Hot && n > 0) {
                seen.insert(k, (e.worker, n as f64 / secs, 0.0));
            }
        }

        // INVALID ↔ COLD; every entry's rate.
        for (k, &(worker, reads, writes)) in &seen {
            self.track(k, worker, reads, writes, &mut log);
            let keep = 1.0 - self.cfg.max_fall.clamp(0.0, 1.0);
            let e = self.keys.get_mut(k).expect("inserted");
            e.worker = worker;
            e.raw = reads + writes;
            e.recent = e.raw;
            (e.reads, e.writes) = (reads.max(keep * e.reads), writes.max(keep * e.writes));
        }
        let dropped: Vec<Vec<u8>> =
            self.keys.iter().filter(|(k, e)| !e.pinned && !seen.contains_key(*k)).map(|(k, _)| k.clone()).collect();
        for k in dropped {
            if !self.apply(&k, KeyEvent::Dropped, &mut log) {
                let keep = 1.0 - self.cfg.max_fall.clamp(0.0, 1.0);
                let e = self.keys.get_mut(&k).expect("present");
                (e.reads, e.writes, e.raw, e.recent) = (keep * e.reads, keep * e.writes, 0.0, 0.0);
            }
        }
        self.keys.retain(|_, e| e.state != KeyState::Invalid);

        // T from the balls-and-bins estimate.
        let (up, down) = (self.cfg.read_up, self.cfg.write_down);
        let replicable = |e: &Entry| up * e.reads - down * e.writes > 0.0;
        // Keys seen fewer than `min_samples` times' worth this epoch are
        // sampling noise (one sample stands for 1/sample_rate requests/s):
        // left out of the estimate (NetKV's cold keys, spread evenly) and
        // never heated. A HOT key's rate counts its copies' reads.
        let min_rate = self.cfg.min_samples * scale;
        self.last = Some((*view, avg, min_rate));
        let significant = |e: &Entry| e.reads + e.writes >= min_rate;
        let keys: Vec<(f64, bool)> =
            self.keys.values().filter(|e| significant(e)).map(|e| (e.reads + e.writes, replicable(e))).collect();
        let n = view.n();
        let max_copies = view.max_copies();
        let spread = f64::from(view.servers.max(1));
        let target = self.cfg.target_imbalance;
        let (t, est) = choose_threshold(&keys, avg, n, spread, max_copies, target);
        let unreplicated = estimate_max_over_avg(&keys.iter().map(|k| (k.0, 1)).collect::<Vec<_>>(), avg, n, spread);

        // The threshold below which a HOT key counts as cool: none needs a
        // copy when the estimate meets the target without any (T is then
        // the hottest rate, which would keep that key HOT for ever).
        let cool_below = self.cfg.cool_fraction * if unreplicated <= target { f64::INFINITY } else { t };
        self.last_cool_below = cool_below;

        // A key whose load alone, on one worker, puts that worker past the
        // target once the rest is spread (the estimate's largest single
        // copy, f − f/n, above (target − 1) × the mean) is a hotspot
        // wherever it is, whether or not its worker is hot this epoch:
        // right after a shift a worker's load does not yet hold the reads
        // of the copies of other servers' new keys that it is about to
        // get, and such a key waited an epoch for its worker to look hot.
        let nf = n.max(1) as f64;
        let busy = avg >= self.balance.min_load;
        let too_hot_alone = |f: f64| busy && f * (1.0 - 1.0 / nf) > (target - 1.0).max(0.0) * avg;
        let mut replicate = Vec::new();
        let mut retire = Vec::new();
        let lease = self.cfg.lease_epochs;
        let names: Vec<Vec<u8>> = self.keys.keys().cloned().collect();
        let mut heat: Vec<(f64, Vec<u8>)> = Vec::new();
        for k in &names {
            let e = self.keys.get_mut(k).expect("present");
            if let (KeyState::Hot, Some(&n)) = (e.state, home_reads.get(k)) {
                e.recent = n as f64 / secs * f64::from(e.replicas + 1);
            }
            let (worker, pressed_share) = (e.worker, e.pressed_share);
            let tw = self.t_of(worker, t, avg);
            // Its cooling line: the server's, lowered by its worker's press
            // now, and by the T it was replicated at under an earlier press.
            let now_line = cool_below * if tw < t { tw / t } else { 1.0 };
            let cool_line = now_line.min(self.cfg.cool_fraction * pressed_share * avg);
            let e = self.keys.get_mut(k).expect("present");
            let quiet = e.state == KeyState::Hot && (e.recent <= cool_line || e.recent < min_rate);
            e.quiet = if quiet { e.quiet + 1 } else { 0 };
            let e = &self.keys[k];
            let f = e.reads + e.writes;
            let ok = replicable(e);
            let want = if ok { copies(f, tw, max_copies) - 1 } else { 0 };
            match e.state {
                KeyState::Cold
                    if want > 0
                        && significant(e)
                        && (hot_workers.contains(&e.worker) || too_hot_alone(f))
                        && max_copies > 1 =>
                {
                    heat.push((f, k.clone()));
                }
                KeyState::Hot if e.pinned => {}
                KeyState::Hot => {
                    let cool = !ok || f <= cool_line;
                    if cool {
                        let e = self.keys.get_mut(k).expect("present");
                        e.cool += 1;
                        if e.cool >= self.cfg.cool_epochs.max(1) {
                            self.apply(k, KeyEvent::Cooled, &mut log);
                        }
                    } else if want > e.replicas && !e.broken {
                        let worker = e.worker;
                        let pressed_share = self.pressed_share(worker, tw, avg, e.pressed_share);
                        let e = self.keys.get_mut(k).expect("present");
                        (e.replicas, e.pressed_share) = (want, pressed_share);
                        self.apply(k, KeyEvent::Grew, &mut log);
                        replicate.push(Replicate { key: k.clone(), worker, replicas: want, lease_epochs: lease });
                    } else {
                        self.keys.get_mut(k).expect("present").cool = 0;
                    }
                }
                KeyState::HotPending if now - e.since >= u64::from(self.cfg.pending_timeout_epochs.max(1)) => {
                    self.keys.get_mut(k).expect("present").broken = true;
                    self.apply(k, KeyEvent::Failed, &mut log);
                }
                KeyState::ColdPending if want > 0 && !e.broken => {
                    self.apply(k, KeyEvent::Heated, &mut log);
                }
                KeyState::ColdPending if now - e.since > u64::from(lease) => {
                    let (worker, replicas) = (e.worker, e.replicas);
                    self.apply(k, KeyEvent::LeasesEnded, &mut log);
                    let e = self.keys.get_mut(k).expect("present");
                    (e.replicas, e.broken) = (0, false);
                    retire.push(Retire { key: k.clone(), worker, replicas });
                }
                _ => {}
            }
        }

        // COLD → HOT_PENDING, hottest first, up to REPL_high (first giving
        // back the slots of a loan that ended).
        let cap = self.repl_high(view);
        self.trim(cap, &mut log, &mut retire);
        heat.sort_by(|a, b| b.0.total_cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
        let mut escalate = None;
        let mut room = cap.saturating_sub(self.counted());
        if heat.len() > room {
            escalate = Some(HotEscalation {
                why: HotEscalateWhy::ReplHigh { wanted: self.replicated() + heat.len(), cap },
                workers: hot_workers.clone(),
            });
        }
        if self.cfg.displace && heat.len() > room {
            // Displacement: the keys already retiring (COLD_PENDING), then
            // the coolest HOT keys (not pinned), each for a waiting key at
            // least twice as hot, are retired at once (their copies
            // deleted now, not after their leases: REPL_high bounds the
            // keys with copies), and the waiting keys replicated now.
            // A HOT key is judged by its rate as measured this epoch (the
            // home's exact reads × (γ+1) when reported, else its samples
            // and its copies' last counts), and only once it has been at
            // most cool_fraction × T (or under the noise floor) for
            // `displace_quiet` epochs running: a key whose readers left (a
            // shifted hot set) frees its slot at the end of the first epoch
            // after, where cooling takes its smoothed rate's fall plus
            // `cool_epochs`.
            let quiet = self.cfg.displace_quiet.max(1);
            let mut coolest: Vec<(f64, Vec<u8>)> = self
                .keys
                .iter()
                .filter(|(_, e)| e.state == KeyState::Hot && !e.pinned && e.quiet >= quiet)
                .map(|(k, e)| (e.recent.min(e.reads + e.writes), k.clone()))
                .collect();
            coolest.sort_by(|a, b| a.0.total_cmp(&b.0).then_with(|| a.1.cmp(&b.1)));
            room += self.make_room(&heat, room, &coolest, 0.0, &mut log, &mut retire);
        }
        self.waiting = heat.len().saturating_sub(room);
        self.waiting_heat = heat.iter().skip(room).cloned().collect();
        for (f, k) in heat.into_iter().take(room) {
            let worker = self.keys[&k].worker;
            let tw = self.t_of(worker, t, avg);
            let want = copies(f, tw, max_copies) - 1;
            let pressed_share = self.pressed_share(worker, tw, avg, f64::INFINITY);
            let e = self.keys.get_mut(&k).expect("present");
            (e.replicas, e.pressed_share) = (want, pressed_share);
            let worker = e.worker;
            self.apply(&k, KeyEvent::Heated, &mut log);
            replicate.push(Replicate { key: k, worker, replicas: want, lease_epochs: lease });
        }

        // Hotspots replication cannot fix.
        if escalate.is_none() && !hot_workers.is_empty() {
            let why = if max_copies <= 1 {
                Some(HotEscalateWhy::NoShadows)
            } else {
                let mut write_heavy = false;
                let mut none_hot = true;
                for w in &hot_workers {
                    let (mut good, mut bad) = (0.0, 0.0);
                    // (T is infinite when no significant key is replicable.)
                    let t = if t.is_finite() { t } else { min_rate };
                    for e in self.keys.values().filter(|e| e.worker == *w && e.reads + e.writes > t) {
                        if replicable(e) {
                            good += e.reads + e.writes;
                        } else {
                            bad += e.reads + e.writes;
                        }
                    }
                    let replicated = self.keys.values().any(|e| e.worker == *w && e.replicas > 0);
                    write_heavy |= bad > good;
                    none_hot &= good + bad == 0.0 && !replicated;
                }
                if write_heavy {
                    Some(HotEscalateWhy::WriteHeavy)
                } else if none_hot {
                    Some(HotEscalateWhy::NoHotKeys)
                } else {
                    None
                }
            };
            escalate = why.map(|why| HotEscalation { why, workers: hot_workers.clone() });
        }

        let hints =
            self.keys.iter().filter(|(_, e)| e.state == KeyState::Hot).map(|(k, e)| (k.clone(), e.replicas)).collect();
        log.sort_by(|a, b| a.0.cmp(&b.0));
        ReplicaDecision {
            epoch: snap.seq,
            threshold: t,
            estimated_max_over_avg: est,
            unreplicated_max_over_avg: unreplicated,
            hot_workers,
            replicate,
            retire,
            hints,
            escalate,
            replicated: self.replicated(),
            cap,
            waiting: self.waiting,
            spare: 0,
            heat: self.slot_heat(),
            transitions: log,
        }
    }
}

#[cfg(test)]
mod tests;
