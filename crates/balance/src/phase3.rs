//! Phase 3, coordinated cachelet migration (MBal §3.4, Algorithm 2,
//! equations 8–13): the coordinator's policy, pure. [`Phase3`] takes events
//! (each server's epoch report, escalations from the servers' Phase 2,
//! "this server moved cachelets locally", migrations finished or failed,
//! and the coordinator's epoch) and returns [`Migrate`] commands. It has no
//! clock and no I/O: its time is the count of [`Phase3Event::Epoch`]s, its
//! planner's budget is counted in branch-and-bound nodes.
//!
//! **When it acts.** At each coordinator epoch, on the servers' latest
//! reports: L_avg is the cluster's mean load per worker and a server's T is
//! `(1 + margin) × L_avg ×` its workers. A server above T for `persistence`
//! consecutive reports, or one whose Phase 2 escalated
//! ([`Escalation`]), is a source. An escalated server that is not above T
//! (Phase 2 found no local plan, e.g. one worker with a hot cachelet beside
//! busy workers) has its escalated workers as sources instead, each against
//! `(1 + margin) × L_avg`. A server that reported local (Phase 2) moves is
//! left alone, as a source or a destination, at that epoch and the next
//! `after_local_epochs` (its loads are about to change; the epoch right
//! after a local plan is the one whose drained backlog looks like an
//! escalation). A cachelet that just moved, or failed to, stays put for
//! `cooldown_epochs`.
//!
//! **Planning (Algorithm 2).** Sources most over their limit first; for
//! each, up to `max_iter` iterations, each with the least-loaded server
//! (per worker) that is not a source, not left alone, under its T and with
//! memory for at least one of the source's cachelets as the destination
//! S_dest, and the ILP over S' = {source, S_dest}:
//! * binary x_c per cachelet c of the source (eq. 12; one destination per
//!   iteration, so each cachelet moves at most once, eq. 13);
//! * the destination's load after the moves at or under its T (eq. 9), and
//!   with known worker capacities also under `saturated_util` × its summed
//!   capacity;
//! * the destination's memory after the moves within its limit (eq. 11;
//!   the source only loses memory, eq. 10 holds by itself);
//! * objective: eq. 8, the absolute deviation of the source's and the
//!   destination's loads per worker from L_avg, plus a tie-break penalty
//!   far below any load difference: a cachelet's bytes over the largest
//!   candidate's, halved for a write-only cachelet (among plans of equal
//!   deviation the one moving the least data wins, and write-heavy
//!   cachelets, which Phase 1's copies cannot help, are preferred).
//!   Eq. 9 is not imposed on the source within one iteration: the paper's
//!   loop relieves it over several destinations, and bringing it under T
//!   with one would make most iterations infeasible.
//!
//! The ILP is solved by `good_lp` + `microlp` within a node budget, as
//! Phase 2's ([`crate::plan`]); when it has no solution (or the budget is
//! 0, or the planner is `Greedy`) the greedy fallback moves, one at a time,
//! the source's cachelet with the most load per byte (ties: the more
//! write-heavy, then the lower id) that fits the destination and lowers the
//! pair's deviation. Each moved cachelet goes to the destination's least
//! loaded worker at that point (Phase 2 there evens its workers later).
//!
//! **Ordering.** A plan's moves are issued biggest load first, at most
//! `max_inflight` at a time cluster-wide and one per source server at a
//! time; the rest wait in the plan's queue and start as migrations end. At
//! the next epoch the queue is dropped and the cluster planned again on
//! fresh reports, counting the migrations in flight as done. A migration
//! whose end is not heard within `migrate_timeout_epochs` counts as failed.

use crate::config::{Config, Phase3Config, Planner};
use crate::measure::{load_of, worker_loads};
use crate::policy::Escalation;
use crate::snapshot::EpochSnapshot;
use good_lp::{constraint, variable, variables, Expression, SolverModel, Variable};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// A worker of a server: `(server, worker)`.
pub type Endpoint = (u16, u16);

/// One worker in a server's report.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerReport {
    pub worker: u16,
    /// Requests per second, weighted as [`load_of`] (with Phase 1's copy reads).
    pub load: f64,
    /// Its capacity in requests per second, when known.
    pub capacity: Option<f64>,
}

/// One cachelet in a server's report.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct CacheletReport {
    pub id: u32,
    /// The worker that owns it.
    pub worker: u16,
    /// Its load, weighted as [`load_of`].
    pub load: f64,
    pub reads_per_sec: f64,
    pub writes_per_sec: f64,
    /// The memory it holds (bytes).
    pub bytes: u64,
}

impl CacheletReport {
    /// Writes over requests (0 when idle).
    pub fn write_fraction(&self) -> f64 {
        let all = self.reads_per_sec + self.writes_per_sec;
        if all > 0.0 {
            self.writes_per_sec / all
        } else {
            0.0
        }
    }
}

/// A server's epoch report to the coordinator.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ServerReport {
    pub server: u16,
    pub workers: Vec<WorkerReport>,
    pub cachelets: Vec<CacheletReport>,
    /// Its memory limit (`-m`, bytes; 0: unknown, no memory constraint).
    pub mem_limit: u64,
    /// Memory in use (bytes).
    pub mem_used: u64,
}

impl ServerReport {
    /// The report of server `server` from one of its epochs: loads weighted
    /// with `cfg.write_weight`, capacities `cfg.worker_capacity`, memory in
    /// use the cachelets' bytes.
    pub fn from_snapshot(server: u16, snap: &EpochSnapshot, cfg: &Config, mem_limit: u64) -> ServerReport {
        let loads = worker_loads(snap, cfg);
        let workers = snap
            .workers
            .iter()
            .zip(&loads)
            .map(|(w, &load)| WorkerReport { worker: w.worker, load, capacity: cfg.worker_capacity })
            .collect();
        let cachelets: Vec<CacheletReport> = snap
            .workers
            .iter()
            .flat_map(|w| {
                w.cachelets.iter().map(move |c| CacheletReport {
                    id: c.id,
                    worker: w.worker,
                    load: load_of(c, cfg),
                    reads_per_sec: c.reads_per_sec,
                    writes_per_sec: c.writes_per_sec,
                    bytes: c.bytes,
                })
            })
            .collect();
        let mem_used = cachelets.iter().map(|c| c.bytes).sum();
        ServerReport { server, workers, cachelets, mem_limit, mem_used }
    }

    /// Its load: the sum of its workers'.
    pub fn load(&self) -> f64 {
        self.workers.iter().map(|w| w.load).sum()
    }

    fn capacity(&self) -> Option<f64> {
        self.workers.iter().map(|w| w.capacity).sum()
    }

    fn free_mem(&self) -> Option<u64> {
        (self.mem_limit > 0).then(|| self.mem_limit.saturating_sub(self.mem_used))
    }

    fn n(&self) -> f64 {
        self.workers.len().max(1) as f64
    }

    fn least_loaded_worker(&self) -> Option<u16> {
        self.workers.iter().min_by(|a, b| a.load.total_cmp(&b.load).then(a.worker.cmp(&b.worker))).map(|w| w.worker)
    }

    /// Move `c` out of this report (it was here).
    fn take(&mut self, id: u32) -> Option<CacheletReport> {
        let i = self.cachelets.iter().position(|c| c.id == id)?;
        let c = self.cachelets.remove(i);
        if let Some(w) = self.workers.iter_mut().find(|w| w.worker == c.worker) {
            w.load -= c.load;
        }
        self.mem_used = self.mem_used.saturating_sub(c.bytes);
        Some(c)
    }

    /// Add `c` to worker `worker` of this report.
    fn put(&mut self, mut c: CacheletReport, worker: u16) {
        c.worker = worker;
        if let Some(w) = self.workers.iter_mut().find(|w| w.worker == worker) {
            w.load += c.load;
        }
        self.mem_used += c.bytes;
        self.cachelets.push(c);
    }
}

/// What a server sends the coordinator at the end of each of its epochs (`mbal phase3`, as
/// JSON): its report, its Phase 2's escalation if it escalated, and whether Phase 2 made local
/// moves this epoch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Phase3Report {
    pub report: ServerReport,
    pub escalation: Option<Escalation>,
    pub local_moves: bool,
}

impl Phase3Report {
    /// The events it stands for, in order.
    pub fn events(self) -> Vec<Phase3Event> {
        let server = self.report.server;
        let mut ev = vec![Phase3Event::Report(self.report)];
        if let Some(escalation) = self.escalation {
            ev.push(Phase3Event::Escalated { server, escalation });
        }
        if self.local_moves {
            ev.push(Phase3Event::LocalMoves { server });
        }
        ev
    }
}

/// What the core is told.
#[derive(Clone, Debug, PartialEq)]
pub enum Phase3Event {
    /// A server's latest epoch (replaces its previous report).
    Report(ServerReport),
    /// A server's Phase 2 escalated (entered Coordinated).
    Escalated { server: u16, escalation: Escalation },
    /// A server's Phase 2 decided local moves this epoch.
    LocalMoves { server: u16 },
    /// A migration ended: `cachelet` is at its destination now.
    Finished { cachelet: u32, bytes: u64 },
    /// A migration could not be carried out (the cachelet stays at its source).
    Failed { cachelet: u32 },
    /// The servers that are members now (Up): the reports of any other (dead, left) are
    /// forgotten, with its streak, its escalation and the queued moves to or from it, so it
    /// is neither a source nor a destination. A migration in flight to or from it ends with
    /// its own `Finished` or `Failed`.
    Members { up: Vec<u16> },
    /// The coordinator's epoch: plan on the reports heard.
    Epoch,
}

/// Move `cachelet` from `from` to `to` (another server), `bytes` of data
/// carrying `load` requests per second.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Migrate {
    pub cachelet: u32,
    pub from: Endpoint,
    pub to: Endpoint,
    pub bytes: u64,
    pub load: f64,
}

/// How an iteration's moves were found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Method3 {
    Ilp,
    /// The solver's best solution when its node budget ran out.
    IlpBudgetSpent,
    Greedy,
}

/// What a source is: a whole server, or one worker of an escalated server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Source {
    Server(u16),
    Worker(u16, u16),
}

impl Source {
    fn server(self) -> u16 {
        match self {
            Source::Server(s) | Source::Worker(s, _) => s,
        }
    }
}

/// One iteration of Algorithm 2.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Iteration3 {
    pub source: Source,
    pub destination: u16,
    pub method: Method3,
    pub moves: Vec<Migrate>,
}

/// One epoch's plan.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Plan3 {
    /// The coordinator's epoch.
    pub epoch: u64,
    /// L_avg: the mean load per worker.
    pub mean: f64,
    pub sources: Vec<Source>,
    pub iterations: Vec<Iteration3>,
    /// Every move, biggest load first.
    pub moves: Vec<Migrate>,
}

/// Phase 3's figures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Phase3Stats {
    pub epochs: u64,
    /// Epochs whose plan had moves.
    pub plans: u64,
    pub started: u64,
    pub finished: u64,
    pub failed: u64,
    /// Of those failed: no end heard within `migrate_timeout_epochs`.
    pub timed_out: u64,
    pub bytes_moved: u64,
    pub escalations: u64,
}

/// Phase 3's core (see the module's documentation).
#[derive(Clone, Debug)]
pub struct Phase3 {
    cfg: Phase3Config,
    /// Epochs planned.
    epoch: u64,
    reports: BTreeMap<u16, ServerReport>,
    /// Servers that reported since the last epoch.
    fresh: BTreeSet<u16>,
    streak: BTreeMap<u16, u32>,
    escalated: BTreeMap<u16, Escalation>,
    /// The first epoch at which a server that reported local moves is left alone.
    local_at: BTreeMap<u16, u64>,
    /// A cachelet stays put through this epoch.
    cooldown: BTreeMap<u32, u64>,
    inflight: BTreeMap<u32, Migrate>,
    /// The epoch each migration in flight started in.
    started_at: BTreeMap<u32, u64>,
    /// Migrations finished since their destination's last report: the
    /// destination and the load the cachelet carried at its source.
    arrived: BTreeMap<u32, (u16, f64)>,
    queue: Vec<Migrate>,
    stats: Phase3Stats,
    last_plan: Option<Plan3>,
}

/// The tie-break penalty's scale against the deviation (which is in units
/// of L_avg): a whole cachelet's worth of it is far below any load
/// difference the balancer cares about.
pub const BYTE_PENALTY: f64 = 1e-4;

impl Phase3 {
    pub fn new(cfg: Phase3Config) -> Phase3 {
        Phase3 {
            cfg,
            epoch: 0,
            reports: BTreeMap::new(),
            fresh: BTreeSet::new(),
            streak: BTreeMap::new(),
            escalated: BTreeMap::new(),
            local_at: BTreeMap::new(),
            cooldown: BTreeMap::new(),
            inflight: BTreeMap::new(),
            started_at: BTreeMap::new(),
            arrived: BTreeMap::new(),
            queue: Vec::new(),
            stats: Phase3Stats::default(),
            last_plan: None,
        }
    }

    pub fn config(&self) -> &Phase3Config {
        &self.cfg
    }

    pub fn stats(&self) -> Phase3Stats {
        self.stats
    }

    /// Migrations started and not yet finished or failed.
    pub fn inflight(&self) -> impl Iterator<Item = &Migrate> {
        self.inflight.values()
    }

    /// The last epoch's plan (also when it had no move).
    pub fn last_plan(&self) -> Option<&Plan3> {
        self.last_plan.as_ref()
    }

    /// Take one event; the migrations to start now, in order.
    pub fn step(&mut self, event: Phase3Event) -> Vec<Migrate> {
        let mut out = Vec::new();
        match event {
            Phase3Event::Report(mut r) => {
                self.arrivals(&mut r);
                self.fresh.insert(r.server);
                self.reports.insert(r.server, r);
            }
            Phase3Event::Escalated { server, escalation } => {
                self.stats.escalations += 1;
                self.escalated.insert(server, escalation);
            }
            Phase3Event::Members { up } => {
                let up: BTreeSet<u16> = up.into_iter().collect();
                self.reports.retain(|s, _| up.contains(s));
                self.fresh.retain(|s| up.contains(s));
                self.streak.retain(|s, _| up.contains(s));
                self.escalated.retain(|s, _| up.contains(s));
                self.local_at.retain(|s, _| up.contains(s));
                self.queue.retain(|m| up.contains(&m.from.0) && up.contains(&m.to.0));
            }
            Phase3Event::LocalMoves { server } => {
                self.local_at.insert(server, self.epoch + 1);
                self.queue.retain(|m| m.from.0 != server && m.to.0 != server);
            }
            Phase3Event::Finished { cachelet, bytes } => {
                if let Some(m) = self.inflight.remove(&cachelet) {
                    self.started_at.remove(&cachelet);
                    self.stats.finished += 1;
                    self.stats.bytes_moved += bytes;
                    patch(&mut self.reports, &m);
                    self.arrived.insert(cachelet, (m.to.0, m.load));
                    self.cooldown.insert(cachelet, self.epoch + u64::from(self.cfg.cooldown_epochs));
                    self.start(&mut out);
                }
            }
            Phase3Event::Failed { cachelet } => {
                if self.inflight.remove(&cachelet).is_some() {
                    self.started_at.remove(&cachelet);
                    self.stats.failed += 1;
                    self.cooldown.insert(cachelet, self.epoch + u64::from(self.cfg.cooldown_epochs));
                    self.start(&mut out);
                }
            }
            Phase3Event::Epoch => {
                self.epoch += 1;
                self.stats.epochs += 1;
                self.expire();
                let plan = self.plan();
                self.stats.plans += u64::from(!plan.moves.is_empty());
                self.queue = plan.moves.clone();
                self.last_plan = Some(plan);
                self.start(&mut out);
            }
        }
        out
    }

    /// A destination's first report after a migration ended counts the
    /// cachelet only from its arrival, over the whole epoch: its load there
    /// is taken as at least what it carried at the source.
    fn arrivals(&mut self, r: &mut ServerReport) {
        let here: Vec<(u32, f64)> =
            self.arrived.iter().filter(|(_, a)| a.0 == r.server).map(|(&c, a)| (c, a.1)).collect();
        for (id, load) in here {
            self.arrived.remove(&id);
            let Some(c) = r.cachelets.iter_mut().find(|c| c.id == id) else { continue };
            if c.load >= load {
                continue;
            }
            let add = load - c.load;
            let k = if c.load > 0.0 { load / c.load } else { 0.0 };
            c.reads_per_sec *= k;
            c.writes_per_sec *= k;
            c.load = load;
            let w = c.worker;
            if let Some(w) = r.workers.iter_mut().find(|x| x.worker == w) {
                w.load += add;
            }
        }
    }

    /// A migration in flight for `migrate_timeout_epochs` without an end
    /// heard is taken as failed: its slot is freed (the next reports say
    /// where the cachelet is).
    fn expire(&mut self) {
        let limit = u64::from(self.cfg.migrate_timeout_epochs);
        if limit == 0 {
            return;
        }
        let e = self.epoch;
        let old: Vec<u32> = self.started_at.iter().filter(|(_, &at)| e - at >= limit).map(|(&c, _)| c).collect();
        for c in old {
            self.started_at.remove(&c);
            self.inflight.remove(&c);
            self.stats.failed += 1;
            self.stats.timed_out += 1;
            self.cooldown.insert(c, e + u64::from(self.cfg.cooldown_epochs));
        }
    }

    /// Is server `s` left alone at epoch `e` (local moves just made)?
    fn quiet(&self, s: u16, e: u64) -> bool {
        self.local_at.get(&s).is_some_and(|&l| e >= l && e <= l + u64::from(self.cfg.after_local_epochs))
    }

    fn cooling(&self, c: u32, e: u64) -> bool {
        self.cooldown.get(&c).is_some_and(|&until| e <= until)
    }

    /// Start queued moves while the limits allow (one per source server,
    /// `max_inflight` in all); a queued move no longer valid is dropped.
    fn start(&mut self, out: &mut Vec<Migrate>) {
        let e = self.epoch;
        let mut i = 0;
        while self.inflight.len() < self.cfg.max_inflight && i < self.queue.len() {
            let m = self.queue[i];
            if self.inflight.values().any(|f| f.from.0 == m.from.0) {
                i += 1;
                continue;
            }
            self.queue.remove(i);
            let here = self
                .reports
                .get(&m.from.0)
                .is_some_and(|r| r.cachelets.iter().any(|c| c.id == m.cachelet && c.worker == m.from.1));
            if !here || self.inflight.contains_key(&m.cachelet) || self.cooling(m.cachelet, e) {
                continue;
            }
            if self.quiet(m.from.0, e + 1) || self.quiet(m.to.0, e + 1) {
                continue;
            }
            self.inflight.insert(m.cachelet, m);
            self.started_at.insert(m.cachelet, e);
            self.stats.started += 1;
            out.push(m);
        }
    }

    /// Algorithm 2 over the reports (see the module's documentation).
    fn plan(&mut self) -> Plan3 {
        let e = self.epoch;
        let cfg = self.cfg.clone();
        let mut view = self.reports.clone();
        for m in self.inflight.values() {
            patch(&mut view, m);
        }
        let escalated = std::mem::take(&mut self.escalated);
        let fresh = std::mem::take(&mut self.fresh);
        let workers: f64 = view.values().map(|r| r.workers.len() as f64).sum();
        let mean = if workers > 0.0 { view.values().map(|r| r.load()).sum::<f64>() / workers } else { 0.0 };
        let mut plan = Plan3 { epoch: e, mean, ..Plan3::default() };
        let t_of = |r: &ServerReport| (1.0 + cfg.margin) * mean * r.n();
        for (&s, r) in &view {
            if fresh.contains(&s) {
                let k = self.streak.entry(s).or_default();
                *k = if r.load() > t_of(r) { *k + 1 } else { 0 };
            }
        }
        if view.len() < 2 || mean < cfg.min_load || mean <= 0.0 {
            return plan;
        }
        // Cachelets reported by two servers (a report older than a move)
        // are not candidates.
        let mut seen = BTreeSet::new();
        let mut dup = BTreeSet::new();
        for r in view.values() {
            for c in &r.cachelets {
                if !seen.insert(c.id) {
                    dup.insert(c.id);
                }
            }
        }
        // The sources, most over their limit (relative to L_avg) first.
        let mut sources: Vec<(f64, Source)> = Vec::new();
        for (&s, r) in &view {
            if self.quiet(s, e) {
                continue;
            }
            let over = r.load() - t_of(r);
            let esc = escalated.get(&s);
            if over > 0.0 && (self.streak.get(&s).copied().unwrap_or(0) >= cfg.persistence.max(1) || esc.is_some()) {
                sources.push((over / mean, Source::Server(s)));
            } else if let Some(esc) = esc {
                for &w in &esc.sources {
                    if let Some(wr) = r.workers.iter().find(|x| x.worker == w) {
                        let over = wr.load - (1.0 + cfg.margin) * mean;
                        if over > 0.0 {
                            sources.push((over / mean, Source::Worker(s, w)));
                        }
                    }
                }
            }
        }
        sources.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        plan.sources = sources.iter().map(|x| x.1).collect();
        let src_servers: BTreeSet<u16> = plan.sources.iter().map(|s| s.server()).collect();
        let solves = (u64::from(cfg.max_iter.max(1)) * plan.sources.len().max(1) as u64).max(1);
        let per_solve = cfg.ilp_node_limit / solves;
        let mut planned: BTreeSet<u32> = BTreeSet::new();
        for &src in &plan.sources {
            let mut tried: BTreeSet<u16> = BTreeSet::new();
            for _ in 0..cfg.max_iter {
                let Some(sr) = view.get(&src.server()) else { break };
                let (src_load, src_n, src_limit) = match src {
                    Source::Server(_) => (sr.load(), sr.n(), t_of(sr)),
                    Source::Worker(_, w) => {
                        let l = sr.workers.iter().find(|x| x.worker == w).map_or(0.0, |x| x.load);
                        (l, 1.0, (1.0 + cfg.margin) * mean)
                    }
                };
                if src_load <= src_limit {
                    break;
                }
                let cands: Vec<CacheletReport> = sr
                    .cachelets
                    .iter()
                    .filter(|c| match src {
                        Source::Server(_) => true,
                        Source::Worker(_, w) => c.worker == w,
                    })
                    .filter(|c| {
                        c.load > 0.0
                            && !dup.contains(&c.id)
                            && !planned.contains(&c.id)
                            && !self.inflight.contains_key(&c.id)
                            && !self.cooling(c.id, e)
                    })
                    .copied()
                    .collect();
                let Some(smallest) = cands.iter().map(|c| c.bytes).min() else { break };
                // S_dest: the least loaded server per worker that can take something.
                let dest = view
                    .iter()
                    .filter(|(&d, r)| {
                        !src_servers.contains(&d)
                            && !tried.contains(&d)
                            && !self.quiet(d, e)
                            && r.load() < dest_limit(r, t_of(r), &cfg)
                            && r.free_mem().is_none_or(|f| f >= smallest)
                    })
                    .min_by(|a, b| (a.1.load() / a.1.n()).total_cmp(&(b.1.load() / b.1.n())).then(a.0.cmp(b.0)))
                    .map(|(&d, _)| d);
                let Some(d) = dest else { break };
                tried.insert(d);
                let dr = &view[&d];
                let pair = Pair {
                    src_load,
                    src_n,
                    dst_load: dr.load(),
                    dst_n: dr.n(),
                    dst_limit: dest_limit(dr, t_of(dr), &cfg),
                    dst_free: dr.free_mem(),
                    mean,
                };
                let ilp = match cfg.planner {
                    Planner::Ilp if per_solve > 0 => solve(&pair, &cands, per_solve).ok(),
                    _ => None,
                };
                let (chosen, method) = match ilp {
                    Some(found) => found,
                    None => (greedy(&pair, &cands), Method3::Greedy),
                };
                if chosen.is_empty() {
                    continue;
                }
                // Biggest first, each to the destination's least loaded worker.
                let mut chosen: Vec<CacheletReport> =
                    cands.iter().filter(|c| chosen.contains(&c.id)).copied().collect();
                chosen.sort_by(|a, b| b.load.total_cmp(&a.load).then(a.id.cmp(&b.id)));
                let mut moves = Vec::new();
                for c in chosen {
                    let to_w = view[&d].least_loaded_worker().unwrap_or(0);
                    let m = Migrate {
                        cachelet: c.id,
                        from: (src.server(), c.worker),
                        to: (d, to_w),
                        bytes: c.bytes,
                        load: c.load,
                    };
                    patch(&mut view, &m);
                    planned.insert(c.id);
                    moves.push(m);
                }
                plan.iterations.push(Iteration3 { source: src, destination: d, method, moves });
            }
        }
        let mut all: Vec<Migrate> = plan.iterations.iter().flat_map(|it| it.moves.iter().copied()).collect();
        all.sort_by(|a, b| b.load.total_cmp(&a.load).then(a.cachelet.cmp(&b.cachelet)));
        plan.moves = all;
        plan
    }
}

/// How full a destination may get: its T, and with known capacities
/// `saturated_util` × their sum.
fn dest_limit(r: &ServerReport, t: f64, cfg: &Phase3Config) -> f64 {
    match r.capacity() {
        Some(cap) if cap > 0.0 => t.min(cfg.saturated_util * cap),
        _ => t,
    }
}

/// Carry out `m` in the reports: out of its source's, into its destination's.
fn patch(reports: &mut BTreeMap<u16, ServerReport>, m: &Migrate) {
    let c = reports.get_mut(&m.from.0).and_then(|r| r.take(m.cachelet));
    let c = c.unwrap_or(CacheletReport {
        id: m.cachelet,
        worker: m.to.1,
        load: m.load,
        reads_per_sec: 0.0,
        writes_per_sec: 0.0,
        bytes: m.bytes,
    });
    if let Some(r) = reports.get_mut(&m.to.0) {
        if !r.cachelets.iter().any(|x| x.id == m.cachelet) {
            r.put(c, m.to.1);
        }
    }
}

/// One iteration's source and destination.
#[derive(Clone, Copy, Debug)]
struct Pair {
    src_load: f64,
    src_n: f64,
    dst_load: f64,
    dst_n: f64,
    dst_limit: f64,
    dst_free: Option<u64>,
    mean: f64,
}

impl Pair {
    /// Eq. 8 for a load `x` moved from the source to the destination, in
    /// units of L_avg.
    fn deviation(&self, x: f64) -> f64 {
        (((self.src_load - x) / self.src_n - self.mean).abs() + ((self.dst_load + x) / self.dst_n - self.mean).abs())
            / self.mean
    }
}

fn penalty(c: &CacheletReport, max_bytes: f64) -> f64 {
    BYTE_PENALTY * (c.bytes as f64 / max_bytes) * (1.0 - 0.5 * c.write_fraction())
}

/// The ILP of eqs. 8–13 for one source and one destination; the chosen
/// cachelets. `Err` when infeasible or no solution within the budget.
fn solve(p: &Pair, cands: &[CacheletReport], node_limit: u64) -> Result<(Vec<u32>, Method3), String> {
    let m = p.mean;
    let max_bytes = cands.iter().map(|c| c.bytes).max().unwrap_or(1).max(1) as f64;
    let mut vars = variables!();
    let x: Vec<Variable> = cands.iter().map(|_| vars.add(variable().binary())).collect();
    let t_src = vars.add(variable().min(0.0));
    let t_dst = vars.add(variable().min(0.0));
    // Loads in units of L_avg.
    let moved: Expression = cands.iter().zip(&x).map(|(c, v)| (c.load / m) * *v).sum();
    let src_after = p.src_load / m / p.src_n - moved.clone() / p.src_n;
    let dst_after = p.dst_load / m / p.dst_n + moved.clone() / p.dst_n;
    let pen: Expression = cands.iter().zip(&x).map(|(c, v)| penalty(c, max_bytes) * *v).sum();
    let mut model = vars.minimise(t_src + t_dst + pen).using(good_lp::microlp);
    // Eq. 8's absolute values.
    model.add_constraint(constraint!(t_src >= src_after.clone() - 1.0));
    model.add_constraint(constraint!(t_src >= 1.0 - src_after));
    model.add_constraint(constraint!(t_dst >= dst_after.clone() - 1.0));
    model.add_constraint(constraint!(t_dst >= 1.0 - dst_after));
    // Eq. 9 at the destination.
    model.add_constraint(constraint!(p.dst_load / m + moved <= p.dst_limit / m));
    // Eq. 11: the destination's memory (in units of the largest cachelet).
    if let Some(free) = p.dst_free {
        let mem: Expression = cands.iter().zip(&x).map(|(c, v)| (c.bytes as f64 / max_bytes) * *v).sum();
        model.add_constraint(constraint!(mem <= free as f64 / max_bytes));
    }
    let mut opts = microlp::SolveOptions::default();
    opts.node_limit = Some(node_limit);
    opts.mip_gap = f64::from(crate::plan::MIP_GAP);
    let sol = match model.as_inner().solve_with(opts) {
        Ok(outcome) => outcome.into_solution().map_err(|_| "no solution within the budget".to_string())?,
        Err(e) => return Err(e.to_string()),
    };
    let method = match sol.termination_reason() {
        microlp::TerminationReason::NodeLimit | microlp::TerminationReason::TimeLimit => Method3::IlpBudgetSpent,
        _ => Method3::Ilp,
    };
    let values: Vec<f64> = sol.iter().map(|(_, v)| v).collect();
    let chosen: Vec<u32> = cands.iter().zip(&values).filter(|(_, v)| **v > 0.5).map(|(c, _)| c.id).collect();
    // The solver's tolerance: never hand back a plan that breaks eq. 9 or 11.
    let load: f64 = cands.iter().filter(|c| chosen.contains(&c.id)).map(|c| c.load).sum();
    let bytes: u64 = cands.iter().filter(|c| chosen.contains(&c.id)).map(|c| c.bytes).sum();
    if p.dst_load + load > p.dst_limit * (1.0 + 1e-9) || p.dst_free.is_some_and(|f| bytes > f) {
        return Err("the solution breaks a constraint".to_string());
    }
    Ok((chosen, method))
}

/// The greedy fallback: while one fits and lowers the pair's deviation,
/// move the cachelet with the most load per byte (ties: more write-heavy,
/// then lower id).
fn greedy(p: &Pair, cands: &[CacheletReport]) -> Vec<u32> {
    let mut order: Vec<&CacheletReport> = cands.iter().collect();
    let per_byte = |c: &CacheletReport| c.load / c.bytes.max(1) as f64;
    order.sort_by(|a, b| {
        per_byte(b)
            .total_cmp(&per_byte(a))
            .then(b.write_fraction().total_cmp(&a.write_fraction()))
            .then(a.id.cmp(&b.id))
    });
    let mut moved = 0.0;
    let mut bytes = 0u64;
    let mut chosen = Vec::new();
    loop {
        let pick = order.iter().position(|c| {
            !chosen.contains(&c.id)
                && p.dst_load + moved + c.load <= p.dst_limit
                && p.dst_free.is_none_or(|f| bytes + c.bytes <= f)
                && p.deviation(moved + c.load) < p.deviation(moved) - 1e-12
        });
        let Some(i) = pick else { break };
        let c = order[i];
        moved += c.load;
        bytes += c.bytes;
        chosen.push(c.id);
    }
    chosen
}

#[cfg(test)]
mod tests;
