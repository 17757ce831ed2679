//! Phase 1 in the core (hot-key replication, DESIGN.md §6): the decisions
//! the server's controller made around `HotKeys` — the cluster's mean for
//! its epoch, which copies to make, renew and delete, the leases a home
//! worker may grant, alarms between epochs, pins — as commands.

use super::{Answer, Command, ControlCore, SampledKey};
use crate::hot::{repl_high_share, ClusterView, HotConfig, HotKeyStat, KeyState, ReplicaDecision, Replicate, Retire};
use crate::measure::worker_loads;
use crate::snapshot::EpochSnapshot;
use crate::tracker::Access;
use crate::Config;

/// Keys shown by `stats hotkeys` and in `mbal load`.
pub const HOT_TOP: usize = 16;

/// A lease reads of a hot key may be told: γ and until when (server
/// clock, ns); `None`: home only.
pub type Grant = Option<(u32, u64)>;

/// Phase 1's settings in the core.
#[derive(Clone, Debug)]
pub struct HotSettings {
    pub policy: HotConfig,
    /// The knobs loads are weighed with (with emulated capacity, each
    /// worker's ceiling).
    pub balance: Config,
    /// How long a copy lives unless renewed (ms).
    pub copy_ttl_ms: u64,
    /// REPL_high is shared across the cluster by lending slots (the
    /// default REPL_high in a cluster whose servers can ask each other).
    pub lend_slots: bool,
}

/// What a home worker is told of Phase 1.
#[derive(Clone, Debug, PartialEq)]
pub enum HotCommand {
    /// Make (or widen to) copies 1..=`replicas` of `key`.
    Replicate { key: Box<[u8]>, replicas: u32 },
    /// The leases reads of each key may be told.
    Grants(Vec<(Box<[u8]>, Grant)>),
    /// The key cooled and its leases ended: delete its copies and stop
    /// copying its writes.
    Retire { key: Box<[u8]> },
    /// The load (requests/s) above which the worker raises a hotspot alarm
    /// between epochs (`None`: none).
    AlarmLimit(Option<f64>),
    /// The fraction of requests to sample from now on.
    SampleRate(f64),
}

/// Phase 1's figures for `stats hotkeys` (published once per epoch and as
/// copies are made).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HotStatus {
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
#[derive(Clone, Debug)]
pub(super) struct HotMeta<R> {
    /// Its home worker.
    worker: u16,
    /// Copies 1..=replicas exist or are being made.
    replicas: u32,
    /// When the last job that made or renewed every copy started: the
    /// copies live at least until then plus their time to live.
    alive_since_ns: Option<u64>,
    /// `mbal debug hot` callers waiting for the copies to be made.
    waiters: Vec<R>,
}

/// The mean of a snapshot's worker loads.
pub fn mean_load(snap: &EpochSnapshot, cfg: &Config) -> f64 {
    let l = worker_loads(snap, cfg);
    if l.is_empty() {
        0.0
    } else {
        l.iter().sum::<f64>() / l.len() as f64
    }
}

type Out<R> = Vec<Command<R>>;

impl<R: Clone> ControlCore<R> {
    /// What Phase 1 knows of the cluster: this server, the servers and
    /// workers of the map, and the cluster's mean load when heard.
    pub(super) fn view(&self, avg_load: Option<f64>) -> ClusterView {
        ClusterView {
            server: self.settings.server,
            servers: self.map.servers().len() as u16,
            workers: self.settings.workers,
            cluster_workers: self.map.servers().iter().map(|s| s.workers.len() as u32).sum(),
            avg_load,
        }
    }

    /// A worker's sampled keys and its replicated keys' reads at home.
    pub(super) fn observe(&mut self, worker: u16, keys: Vec<SampledKey>, home_reads: Vec<(Box<[u8]>, u64)>) {
        if let Some(h) = &mut self.hot {
            for (k, write) in keys {
                h.observe(&k, if write { Access::Write } else { Access::Read }, worker);
            }
            for (k, n) in home_reads {
                h.home_reads(&k, n);
            }
        }
    }

    /// Run Phase 1's policy over one epoch: ask home workers to make or
    /// delete copies, renew the copies that exist, and tell every worker
    /// the leases it may grant.
    pub(super) fn hot_epoch(&mut self, now: u64, snap: &EpochSnapshot, out: &mut Out<R>) -> Option<ReplicaDecision> {
        let hs = self.settings.hot.as_ref()?;
        let ttl_ms = hs.copy_ttl_ms;
        // The cluster's mean: this server's and the others' heard within
        // the last three epochs (else this server's mean stands for it).
        let own = mean_load(snap, &hs.balance);
        let since = self.heard_since(now);
        self.peers.forget_before(since);
        let avg = self.peers.cluster_mean(usize::from(self.settings.server), own, since);
        self.hot_avg = avg.unwrap_or(own);
        let view = self.view(avg);
        if let Some(l) = &mut self.ledger {
            l.set_base(repl_high_share(&view));
        }
        self.set_cap(now);
        let mut d = self.hot.as_mut()?.on_epoch(snap, &view);
        self.start_copies(&d.replicate, out);
        // Keys waiting for a slot: ask for more at once (the tick renews).
        let demand = self.demand();
        if d.waiting > 0 {
            self.ask_slots(demand, now, out);
        }
        // What this server would lend, for the others' asks (`mbal load`).
        let (claim, margin) = self.keeps(demand, now);
        d.spare = self.ledger.as_ref().map_or(0, |l| l.spare(now, claim, margin));
        let hot = self.hot.as_ref()?;
        // The alarm limit for the next epoch, to every worker, and the
        // sampling rate from now on when it changed.
        let limit = hot.alarm_limit();
        let rate = hot.sample_rate();
        let new_rate = (rate != self.hot_status.sample_rate).then_some(rate);
        self.hot_status.sample_rate = rate;
        for worker in 0..self.settings.workers {
            out.push(Command::Hot { worker, cmd: HotCommand::AlarmLimit(limit) });
            if let Some(r) = new_rate {
                out.push(Command::Hot { worker, cmd: HotCommand::SampleRate(r) });
            }
        }
        self.retire_copies(&d.retire, out);
        // Renew every copy that exists (a key being made renews once made).
        if let Some(hot) = &self.hot {
            for (key, m) in &self.hot_meta {
                if m.alive_since_ns.is_some() && matches!(hot.state(key), KeyState::Hot | KeyState::ColdPending) {
                    let to = self.copies(key, m);
                    out.push(Command::Renew { key: key.as_slice().into(), to, ttl_ms, at_ns: now });
                }
            }
        }
        self.send_grants(None, out);
        let st = &mut self.hot_status;
        st.epoch = snap.seq;
        st.threshold = d.threshold;
        st.estimated_max_over_avg = d.estimated_max_over_avg;
        st.unreplicated_max_over_avg = d.unreplicated_max_over_avg;
        st.replicated = d.replicated;
        st.waiting = d.waiting;
        st.escalate = d.escalate.as_ref().map(|e| format!("{:?}", e.why));
        self.publish_hot(out);
        Some(d)
    }

    /// Ask home workers to delete retired keys' copies.
    pub(super) fn retire_copies(&mut self, retire: &[Retire], out: &mut Out<R>) {
        for r in retire {
            self.hot_meta.remove(&r.key);
            out.push(Command::Hot { worker: r.worker, cmd: HotCommand::Retire { key: r.key.as_slice().into() } });
        }
    }

    /// Ask home workers to make (or widen) copies.
    fn start_copies(&mut self, replicate: &[Replicate], out: &mut Out<R>) {
        for r in replicate {
            let m = self.hot_meta.entry(r.key.clone()).or_insert(HotMeta {
                worker: r.worker,
                replicas: 0,
                alive_since_ns: None,
                waiters: Vec::new(),
            });
            m.worker = r.worker;
            m.replicas = m.replicas.max(r.replicas);
            let cmd = HotCommand::Replicate { key: r.key.as_slice().into(), replicas: m.replicas };
            out.push(Command::Hot { worker: r.worker, cmd });
        }
    }

    /// A worker ran hot between epochs: replicate its hottest new keys now.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn hot_alarm(
        &mut self,
        now: u64,
        worker: u16,
        keys: &[SampledKey],
        secs: f64,
        home: &[(Box<[u8]>, u64)],
        home_secs: f64,
        out: &mut Out<R>,
    ) {
        let Some(hot) = &mut self.hot else { return };
        let d = hot.on_alarm(worker, keys, secs, home, home_secs);
        self.hot_status.alarms += 1;
        self.retire_copies(&d.retire, out);
        if d.waiting > 0 {
            // Keys wait for a slot now: ask for more without waiting for
            // the epoch (at most every `SLOT_ASK_EVERY_MS`).
            let every = super::slots::SLOT_ASK_EVERY_MS * 1_000_000;
            if self.last_ask_ns.is_none_or(|t| now.saturating_sub(t) >= every) {
                self.ask_slots(self.demand(), now, out);
                self.last_ask_ns = Some(now);
            }
        }
        if !d.replicate.is_empty() || !d.retire.is_empty() {
            self.start_copies(&d.replicate, out);
            // A key the alarm displaced grants no more leases from now on.
            self.send_grants(None, out);
            self.publish_hot(out);
        }
    }

    /// `mbal debug hot|cool`: pin a key homed here as replicated, or unpin it.
    pub(super) fn pin(&mut self, key: Box<[u8]>, replicas: u32, reply: R, out: &mut Out<R>) {
        let c = self.map.keyspace().cachelet_of_hash(mbal_cluster::key_hash(&key));
        let (server, worker) = self.map.owner(c);
        let Some(hot) = &mut self.hot else {
            return out.push(Command::Reply { to: reply, answer: Answer::HotOff });
        };
        if server != self.settings.server {
            return out.push(Command::Reply { to: reply, answer: Answer::KeyElsewhere });
        }
        if replicas == 0 {
            hot.unpin(&key);
            return out.push(Command::Reply { to: reply, answer: Answer::Ok });
        }
        match hot.pin(&key, worker, replicas) {
            Some(r) => {
                // The answer comes once the copies are made (`hot_done`).
                let m = HotMeta { worker, replicas: r.replicas, alive_since_ns: None, waiters: vec![reply] };
                self.hot_meta.insert(r.key.clone(), m);
                let cmd = HotCommand::Replicate { key: r.key.as_slice().into(), replicas: r.replicas };
                out.push(Command::Hot { worker, cmd });
            }
            None => out.push(Command::Reply { to: reply, answer: Answer::Ok }),
        }
    }

    pub(super) fn hot_top(&self) -> Vec<HotKeyStat> {
        self.hot.as_ref().map(|h| h.top(HOT_TOP)).unwrap_or_default()
    }

    /// Where a key's copies live.
    fn copies(&self, key: &[u8], m: &HotMeta<R>) -> Vec<(u16, u16)> {
        let hash = mbal_cluster::key_hash(key);
        let servers = self.map.servers().len() as u16;
        let workers_of = |s: u16| self.map.servers()[usize::from(s)].workers.len() as u16;
        (1..=m.replicas)
            .filter_map(|i| {
                mbal_cluster::replica_location(hash, i, (self.settings.server, m.worker), servers, workers_of)
            })
            .collect()
    }

    /// The lease reads of `key` may be told now, if any: while it is HOT
    /// and its copies are known to live, up to a margin before they end.
    fn grant(&self, key: &[u8], m: &HotMeta<R>) -> Grant {
        let hot = self.hot.as_ref()?;
        let since = m.alive_since_ns?;
        let g = hot.hint(key);
        let ttl_ns = self.settings.hot.as_ref()?.copy_ttl_ms * 1_000_000;
        (g > 0).then_some((g.min(m.replicas), (since + ttl_ns).saturating_sub(50_000_000)))
    }

    /// Tell home workers the leases they may grant: for every replicated
    /// key, or for one.
    pub(super) fn send_grants(&self, only: Option<&[u8]>, out: &mut Out<R>) {
        let mut per: Vec<Vec<(Box<[u8]>, Grant)>> = vec![Vec::new(); usize::from(self.settings.workers)];
        for (key, m) in &self.hot_meta {
            if only.is_some_and(|k| k != key.as_slice()) {
                continue;
            }
            if let Some(v) = per.get_mut(usize::from(m.worker)) {
                v.push((key.as_slice().into(), self.grant(key, m)));
            }
        }
        for (w, list) in per.into_iter().enumerate() {
            if !list.is_empty() {
                out.push(Command::Hot { worker: w as u16, cmd: HotCommand::Grants(list) });
            }
        }
    }

    /// How making, renewing or updating a key's copies ended.
    pub(super) fn hot_done(&mut self, key: Box<[u8]>, created: bool, ok: bool, at_ns: u64, out: &mut Out<R>) {
        let Some(hot) = &mut self.hot else { return };
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
        self.publish_hot(out);
        self.send_grants(Some(&key), out);
        let waiters = self.hot_meta.get_mut(&*key).map(|m| std::mem::take(&mut m.waiters)).unwrap_or_default();
        let answer = if ok { Answer::Ok } else { Answer::CouldNotReplicate };
        for r in waiters {
            out.push(Command::Reply { to: r, answer });
        }
    }

    pub(super) fn publish_hot(&mut self, out: &mut Out<R>) {
        self.hot_status.top = self.hot_top();
        out.push(Command::HotStatus(Box::new(self.hot_status.clone())));
    }
}
