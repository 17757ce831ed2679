//! `mbal sim`: S servers x W workers in simulated time, each server driven
//! by its own [`mbal_balance::ControlCore`], the very core the servers run
//! (no copy of the policy here). This crate is the core's adapter, as the
//! server's controller is: it turns the core's commands into simulated
//! mechanisms and feeds it events stamped with simulated time.
//!
//! * `SampleWorkers`: every worker's [`WorkerSample`] from the simulated
//!   counters (cumulative reads and writes per cachelet, which travel with
//!   the cachelet, and busy time), at the instant of the tick.
//! * `Release`: the cachelet keeps being served by its owner for
//!   `--move-ms`, then belongs to the adopter, and the core gets
//!   `Event::Moved` at that time.
//! * `Epoch`: the decision is recorded for the report.
//!
//! Time is epoch-stepped with requests aggregated: every server ticks at
//! the same instants (`--epoch-ms` apart), and between two instants (or a
//! move ending) each cachelet gets a Poisson number of requests with mean
//! offered rate x its share of the key distribution's mass x the length of
//! the stretch. The policy only ever sees per-cachelet counters per
//! epoch, so drawing requests one by one would change nothing it sees and
//! cost a thousand times more: the cost of an epoch is O(cachelets), not
//! O(requests), which is what lets a fleet of thousands of servers run on
//! one core. Each worker then serves at most `--worker-capacity` x the
//! stretch's length; the rest waits (a fluid backlog), and delays are
//! estimated from it and M/M/1 ([`queue`]).
//!
//! Phase 3: with `--phase3 on` (the default, in runs with the balancer on)
//! the sim is also the coordinator. It runs [`mbal_balance::Phase3`]
//! unchanged: each server's epoch snapshot goes to it as a report (with the
//! server's memory limit and its cachelets' bytes, `--cachelet-mb` each),
//! as do Phase 2's escalations and local moves; each coordinator epoch is
//! one sampling round. A `Migrate` keeps the cachelet served by its source
//! for bytes / `--migrate-gbps`, then it belongs to the destination: the
//! sim's coordinator map gives it there (a new epoch, sent as
//! `Event::Map` to both servers' cores, which run `coordinated`), its
//! counters start from zero there (an imported cachelet's do) and its
//! load goes with it. A migration whose cachelet is being moved between
//! its source's workers when it ends fails (`Failed`).
//!
//! Phase 1 (hot-key copies) is not simulated yet: the cores run with it off.
//!
//! Deterministic: one seeded generator per epoch, every collection walked
//! in index order; the same arguments give the same JSON, byte for byte.

pub mod queue;
pub mod workload;

use anyhow::{bail, Context, Result};
use mbal_balance::{
    CacheletSample, Command, Config, ControlCore, CoreSettings, Event, Imbalance, Migrate, Phase3, Phase3Config,
    Phase3Event, ServerReport, WorkerSample,
};
use mbal_cluster::{ClusterMap, ServerInfo};
use queue::Part;
use rand::rngs::SmallRng;
use rand::SeedableRng;
use rand_distr::{Binomial, Distribution, Poisson};
use serde::Serialize;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Instant;
pub use workload::Dist;

/// Which runs to make.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Runs {
    On,
    Off,
    /// Off, then on, on the same seed.
    Both,
}

/// `mbal sim`'s arguments.
#[derive(clap::Args, Clone, Debug)]
pub struct SimArgs {
    /// Servers.
    #[arg(long, default_value_t = 8)]
    pub servers: u16,
    /// Workers per server.
    #[arg(long, default_value_t = 2)]
    pub workers: u16,
    /// Cachelets per worker in the initial (even) map.
    #[arg(long, default_value_t = mbal_cluster::DEFAULT_CACHELETS_PER_WORKER)]
    pub cachelets_per_worker: u32,
    /// Virtual nodes of the key space (0: the servers' default, or the next power of two at
    /// or above the number of cachelets when that is more).
    #[arg(long, default_value_t = 0)]
    pub vn_count: u32,
    /// Key distribution.
    #[arg(long, value_enum, default_value = "zipf")]
    pub workload: Dist,
    /// Zipf exponent.
    #[arg(long, default_value_t = 0.99)]
    pub zipf: f64,
    /// Distinct keys (`k` + zero-padded index, routed by the real key hash).
    #[arg(long, default_value_t = 50_000)]
    pub keys: u32,
    /// Hotspot: the fraction of keys that are hot.
    #[arg(long, default_value_t = 0.05)]
    pub hot_fraction: f64,
    /// Hotspot and hot partition: the fraction of requests on hot keys (default 0.95 for
    /// hotspot, 0.5 for hotpart, as the testbed's scripts/bench-balance.sh).
    #[arg(long)]
    pub hot_ops: Option<f64>,
    /// Hot partition: the first K cachelets of one worker are hot.
    #[arg(long, default_value_t = 4)]
    pub hot_cachelets: u32,
    /// Fraction of reads (default: 1.0 for zipf and uniform, 0.95 otherwise).
    #[arg(long)]
    pub read_ratio: Option<f64>,
    /// Each worker's capacity, requests per second (as the servers' `--worker-capacity`).
    #[arg(long, default_value_t = 2_000.0)]
    pub worker_capacity: f64,
    /// Offered load, open loop, as a fraction of the cluster's capacity.
    #[arg(long, default_value_t = 0.6)]
    pub load: f64,
    /// Offered load in requests per second (instead of --load).
    #[arg(long)]
    pub rate: Option<f64>,
    /// The clients' window: at most this many requests per server outstanding (issued, not
    /// yet served); beyond it the clients issue only as requests complete, as the testbed's
    /// `mbal bench` does with 8 connections x 64 in flight. 0: no window (purely open loop).
    #[arg(long, default_value_t = 512)]
    pub window: u64,
    /// Epochs to simulate.
    #[arg(long, default_value_t = 60)]
    pub epochs: u64,
    /// The servers' `--epoch-ms`.
    #[arg(long, default_value_t = 500)]
    pub epoch_ms: u64,
    /// The servers' `--balance-epoch-ms`.
    #[arg(long, default_value_t = 1_000)]
    pub balance_epoch_ms: u64,
    /// How long a cachelet move takes (ms) from the core's Release to its Moved.
    #[arg(long, default_value_t = 5.0)]
    pub move_ms: f64,
    /// Seconds at which the hot set changes (comma separated): the n-th shift makes hot
    /// set n hot (another Zipf or hotspot permutation, another worker's hot partition).
    #[arg(long, value_delimiter = ',')]
    pub shift_at: Vec<f64>,
    /// The balancer (Phase 2) on, off, or both runs one after the other.
    #[arg(long, value_enum, default_value = "both")]
    pub balancer: Runs,
    /// Phase 3 (the sim as the coordinator) in the runs with the balancer on: on, off, or
    /// both (a run with Phase 2 alone, named `phase2`, then one with both phases).
    #[arg(long, value_enum, default_value = "on")]
    pub phase3: Runs,
    /// Each cachelet's data (MB), what a Phase 3 migration moves.
    #[arg(long, default_value_t = 64.0)]
    pub cachelet_mb: f64,
    /// Each server's memory limit (MB; 0: twice its initial cachelets' data).
    #[arg(long, default_value_t = 0.0)]
    pub server_memory_mb: f64,
    /// Phase 3's migration rate (GB/s, 10^9 bytes): a migration takes bytes / rate.
    #[arg(long, default_value_t = 1.0)]
    pub migrate_gbps: f64,
    /// The random seed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Settled from this many seconds on (default: the second half of the run).
    #[arg(long)]
    pub settle: Option<f64>,
    /// Write one JSON line per epoch (and one summary line per run) to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

impl SimArgs {
    /// The defaults, as `mbal sim` with no flags.
    pub fn defaults() -> SimArgs {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct P {
            #[command(flatten)]
            a: SimArgs,
        }
        P::parse_from(["sim"]).a
    }
}

/// The initial even map of `servers` x `workers` (addresses are placeholders: nothing is
/// dialled).
pub fn even_map(servers: u16, workers: u16, cpw: u32, vn_count: u32) -> ClusterMap {
    let addr = |s: u16, p: u16| SocketAddr::from(([127, 1, (s >> 8) as u8, s as u8], p));
    let infos = (0..servers)
        .map(|s| ServerInfo { main: addr(s, 11211), workers: (0..workers).map(|w| addr(s, 20000 + w)).collect() })
        .collect();
    ClusterMap::even(infos, cpw, vn_count)
}

/// One epoch of one run, as a JSON line.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct EpochRecord {
    pub run: &'static str,
    pub epoch: u64,
    /// Seconds since the start, at the epoch's end.
    pub t: f64,
    pub hot_set: u32,
    /// Requests per second offered, issued (within the clients' window) and served.
    pub offered: f64,
    pub issued: f64,
    pub served: f64,
    /// Over every worker of the cluster: max/avg and NetKV's imbalance factor (eq. 6,
    /// mean |L_i - avg| / avg), of the requests served per second.
    pub max_over_avg: f64,
    pub factor: f64,
    /// The worst server's own max/avg (what Phase 2 can fix).
    pub server_max_over_avg: f64,
    /// Estimated delay percentiles of the requests served in the epoch (µs).
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    /// Requests waiting at the workers, and held back by the clients, at the epoch's end.
    pub backlog: f64,
    pub held: f64,
    /// Moves the cores started and that ended in the epoch.
    pub moves_started: u64,
    pub moves_done: u64,
    /// Phase 3's migrations started, finished and failed in the epoch, and the bytes of
    /// those finished.
    pub migrations_started: u64,
    pub migrations_done: u64,
    pub migrations_failed: u64,
    pub migrated_bytes: u64,
    /// Phase 2 decisions this epoch: servers per state, and each state change
    /// `(server, transition)`.
    pub states: BTreeMap<String, u64>,
    pub transitions: Vec<(u16, String)>,
    /// Requests per second served by each worker (servers in order, then workers).
    pub loads: Vec<u64>,
}

/// A run's figures over its settled epochs.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Summary {
    pub run: &'static str,
    pub settled_from: f64,
    pub max_over_avg: f64,
    pub factor: f64,
    pub server_max_over_avg: f64,
    pub p99_us: f64,
    pub served: f64,
    pub moves: u64,
    /// Phase 3's migrations finished, and their bytes, over the whole run.
    pub migrations: u64,
    pub migrated_bytes: u64,
    /// From when every later epoch's max/avg stayed <= 1.15 (seconds; null: never).
    pub settle_time: Option<f64>,
    /// Requests simulated: offered by the clients, and issued within their window.
    pub offered_requests: f64,
    pub requests: f64,
}

/// A move under way: when it ends, and what the core is told then. A Phase 3 migration
/// (`to_server` another server) has no token.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Pending {
    at_ns: u64,
    seq: u64,
    server: u16,
    token: u64,
    cachelet: u32,
    to: u16,
    to_server: u16,
    bytes: u64,
}

impl Pending {
    fn migration(&self) -> bool {
        self.to_server != self.server
    }
}

/// The workload, resolved.
struct Load {
    params: workload::Params,
    rate: f64,
    read_ratio: f64,
    cachelet_of: Vec<u32>,
}

/// One run: the cores and the simulated workers and clients.
struct Sim<'a> {
    a: &'a SimArgs,
    run: &'static str,
    load: &'a Load,
    map0: ClusterMap,
    cores: Vec<ControlCore<()>>,
    /// Phase 3, when it runs, and the coordinator's map (the cores run `coordinated`).
    phase3: Option<Phase3>,
    cmap: ClusterMap,
    /// What the cores said this epoch, for Phase 3 once every server ticked.
    p3_events: Vec<Phase3Event>,
    cfg: Config,
    mem_limit: u64,
    cachelet_bytes: u64,
    migrations_started: u64,
    migrations_done: u64,
    migrations_failed: u64,
    migrated_bytes: u64,
    total_migrations: u64,
    total_migrated: u64,
    /// Where each cachelet is served now (the workers' truth).
    owner: Vec<(u16, u16)>,
    /// Per cachelet: cumulative reads and writes served, requests waiting.
    reads: Vec<f64>,
    writes: Vec<f64>,
    backlog: Vec<f64>,
    /// Per cachelet: requests (and writes among them) the clients hold back, their window
    /// being full.
    deferred: Vec<f64>,
    deferred_w: Vec<f64>,
    /// Per worker (global index): cumulative busy ns.
    busy_ns: Vec<f64>,
    mass: Vec<f64>,
    hot_set: u32,
    pending: BinaryHeap<Reverse<Pending>>,
    next_seq: u64,
    mu: f64,
    // The epoch being gathered: requests the clients would have issued, and did.
    arrived: f64,
    issued: f64,
    served_w: Vec<f64>,
    parts: Vec<Part>,
    moves_started: u64,
    moves_done: u64,
    states: BTreeMap<String, u64>,
    transitions: Vec<(u16, String)>,
    total_requests: f64,
    total_offered: f64,
}

fn ns(ms: f64) -> u64 {
    (ms * 1e6).round() as u64
}

impl<'a> Sim<'a> {
    fn new(
        a: &'a SimArgs,
        load: &'a Load,
        map0: &ClusterMap,
        run: &'static str,
        phases: (bool, bool),
    ) -> Result<Sim<'a>> {
        let (balancer, phase3) = phases;
        let phase3 = balancer && phase3;
        let cfg = Config { worker_capacity: Some(a.worker_capacity), ..Config::default() };
        let cachelet_bytes = (a.cachelet_mb * 1e6).round() as u64;
        let mem_limit = if a.server_memory_mb > 0.0 {
            (a.server_memory_mb * 1e6).round() as u64
        } else {
            2 * cachelet_bytes * u64::from(a.workers) * u64::from(a.cachelets_per_worker)
        };
        let e = a.epoch_ms.max(1);
        let every = (a.balance_epoch_ms.saturating_add(e / 2) / e).max(1);
        let cores = (0..a.servers)
            .map(|s| {
                let settings = CoreSettings {
                    server: s,
                    workers: a.workers,
                    balance_every: every,
                    balancer: balancer.then(|| cfg.clone()),
                    epoch_ms: a.epoch_ms,
                    hot: None,
                    coordinated: phase3,
                };
                ControlCore::new(settings, map0.clone(), 0)
            })
            .collect();
        let n = map0.cachelet_count() as usize;
        let workers = usize::from(a.servers) * usize::from(a.workers);
        let mut sim = Sim {
            a,
            run,
            load,
            phase3: phase3.then(|| Phase3::new(Phase3Config::default())),
            cmap: map0.clone(),
            p3_events: Vec::new(),
            cfg,
            mem_limit,
            cachelet_bytes,
            migrations_started: 0,
            migrations_done: 0,
            migrations_failed: 0,
            migrated_bytes: 0,
            total_migrations: 0,
            total_migrated: 0,
            map0: map0.clone(),
            cores,
            owner: map0.owners().to_vec(),
            reads: vec![0.0; n],
            writes: vec![0.0; n],
            backlog: vec![0.0; n],
            deferred: vec![0.0; n],
            deferred_w: vec![0.0; n],
            busy_ns: vec![0.0; workers],
            mass: Vec::new(),
            hot_set: 0,
            pending: BinaryHeap::new(),
            next_seq: 0,
            mu: a.worker_capacity,
            arrived: 0.0,
            issued: 0.0,
            served_w: vec![0.0; workers],
            parts: Vec::new(),
            moves_started: 0,
            moves_done: 0,
            states: BTreeMap::new(),
            transitions: Vec::new(),
            total_requests: 0.0,
            total_offered: 0.0,
        };
        sim.set_hot_set(0)?;
        Ok(sim)
    }

    fn set_hot_set(&mut self, h: u32) -> Result<()> {
        let km = workload::key_masses(&self.load.params, &self.map0, &self.load.cachelet_of, h)?;
        self.mass = workload::cachelet_masses(&km, &self.load.cachelet_of, self.map0.cachelet_count());
        self.hot_set = h;
        Ok(())
    }

    fn gw(&self, (s, w): (u16, u16)) -> usize {
        usize::from(s) * usize::from(self.a.workers) + usize::from(w)
    }

    /// Requests arrive and are served over `[from, to)`.
    fn stretch(&mut self, rng: &mut SmallRng, from: u64, to: u64) {
        if to <= from {
            return;
        }
        let secs = (to - from) as f64 / 1e9;
        let n = self.owner.len();
        let mut arr = vec![0.0f64; n];
        let mut wr = vec![0.0f64; n];
        let workers = self.busy_ns.len();
        let mut w_arr = vec![0.0f64; workers];
        let mut w_back = vec![0.0f64; workers];
        let mut offered = 0.0;
        for c in 0..n {
            let lam = self.load.rate * self.mass[c] * secs;
            if lam > 0.0 {
                let k = Poisson::new(lam).map(|p| p.sample(rng)).unwrap_or(0.0);
                offered += k;
                arr[c] = k;
                if self.load.read_ratio < 1.0 && k >= 1.0 {
                    let b = Binomial::new(k as u64, 1.0 - self.load.read_ratio).expect("a probability");
                    wr[c] = b.sample(rng) as f64;
                }
            }
            // What the clients hold back (their window was full) goes first.
            arr[c] += self.deferred[c];
            wr[c] += self.deferred_w[c];
            let g = self.gw(self.owner[c]);
            w_arr[g] += arr[c];
            w_back[g] += self.backlog[c];
        }
        // The clients' window: issue a fraction `alpha` of what they hold (the same keys'
        // law), the most that leaves at most the window outstanding; the rest waits at the
        // clients (latency counts from the intended send time, as `mbal bench` counts it).
        let budget = self.mu * secs;
        let outstanding =
            |alpha: f64| -> f64 { (0..workers).map(|g| (w_back[g] + alpha * w_arr[g] - budget).max(0.0)).sum() };
        let window = self.a.window as f64 * f64::from(self.a.servers);
        let mut alpha = 1.0;
        if self.a.window > 0 && outstanding(1.0) > window {
            let (mut lo, mut hi) = (0.0, 1.0);
            for _ in 0..40 {
                let mid = (lo + hi) / 2.0;
                if outstanding(mid) > window {
                    hi = mid;
                } else {
                    lo = mid;
                }
            }
            alpha = lo;
        }
        let held_before: f64 = self.deferred.iter().sum();
        for c in 0..n {
            self.deferred[c] = arr[c] * (1.0 - alpha);
            self.deferred_w[c] = wr[c] * (1.0 - alpha);
            arr[c] *= alpha;
            wr[c] *= alpha;
        }
        w_arr.iter_mut().for_each(|x| *x *= alpha);
        let issued: f64 = arr.iter().sum();
        let held_after: f64 = self.deferred.iter().sum();
        // Time an issued request spent held at the clients (FIFO at the issue rate).
        let held_wait = if issued > 0.0 { (held_before + held_after) / 2.0 / (issued / secs) } else { 0.0 };
        let mut frac = vec![0.0f64; workers];
        for g in 0..workers {
            let (served, _after, mut part) = queue::serve(w_back[g], w_arr[g], self.mu, secs);
            let total = w_back[g] + w_arr[g];
            frac[g] = if total > 0.0 { served / total } else { 0.0 };
            self.served_w[g] += served;
            self.busy_ns[g] += served / self.mu * 1e9;
            if served > 0.0 {
                part.shift += held_wait;
                self.parts.push(part);
            }
        }
        for c in 0..n {
            let g = self.gw(self.owner[c]);
            let total = self.backlog[c] + arr[c];
            let served = total * frac[g];
            self.backlog[c] = total - served;
            let wshare = if arr[c] > 0.0 { wr[c] / arr[c] } else { 1.0 - self.load.read_ratio };
            self.reads[c] += served * (1.0 - wshare);
            self.writes[c] += served * wshare;
        }
        self.issued += issued;
        self.arrived += offered;
        self.total_requests += issued;
        self.total_offered += offered;
    }

    /// Give server `s`'s core an event at `t` and carry out its commands (and those of the
    /// events they lead to) in order.
    fn step(&mut self, s: u16, t: u64, first: Event<()>, by_worker: &[Vec<u32>]) {
        let mut events = VecDeque::from([first]);
        while let Some(ev) = events.pop_front() {
            for cmd in self.cores[usize::from(s)].step(t, ev) {
                match cmd {
                    Command::SampleWorkers { seq } => {
                        // Owners grouped by worker: the caller's at a tick, else now's.
                        let now;
                        let by_worker = if by_worker.is_empty() {
                            now = self.by_worker();
                            &now[..]
                        } else {
                            by_worker
                        };
                        for w in 0..self.a.workers {
                            let sample = self.sample(s, w, t, by_worker);
                            events.push_back(Event::Sample { seq, sample, keys: Vec::new(), home_reads: Vec::new() });
                        }
                    }
                    Command::Release { cachelet, from, to, token } => {
                        debug_assert_eq!(self.owner[cachelet as usize], (s, from), "released by its owner");
                        self.next_seq += 1;
                        let p = Pending {
                            at_ns: t + ns(self.a.move_ms),
                            seq: self.next_seq,
                            server: s,
                            token,
                            cachelet,
                            to,
                            to_server: s,
                            bytes: 0,
                        };
                        self.pending.push(Reverse(p));
                        self.moves_started += 1;
                    }
                    Command::Epoch(e) => {
                        if self.phase3.is_some() {
                            let r = ServerReport::from_snapshot(s, &e.snapshot, &self.cfg, self.mem_limit);
                            self.p3_events.push(Phase3Event::Report(r));
                        }
                        if let Some(d) = &e.balancer {
                            let name = format!("{:?}", d.state);
                            let name = name.split([' ', '{']).next().unwrap_or("").to_string();
                            *self.states.entry(name).or_default() += 1;
                            if let Some(tr) = &d.transition {
                                self.transitions.push((s, format!("{tr:?}")));
                            }
                            if self.phase3.is_some() {
                                if !d.moves.is_empty() {
                                    self.p3_events.push(Phase3Event::LocalMoves { server: s });
                                }
                                if let Some(esc) = &d.escalate {
                                    let ev = Phase3Event::Escalated { server: s, escalation: esc.clone() };
                                    self.p3_events.push(ev);
                                }
                            }
                        }
                    }
                    // A move between this server's workers, told to the coordinator.
                    Command::ReportMove { cachelet, worker } => self.cmap.set_owner_local(cachelet, (s, worker)),
                    // Phase 1 is off, no client waits for an answer, the map is the core's.
                    _ => {}
                }
            }
        }
    }

    /// Give Phase 3 an event at `t` and start the migrations it asks for (a migration that
    /// cannot start, its cachelet not at its source or moving already, fails at once).
    fn phase3_step(&mut self, ev: Phase3Event, t: u64) {
        let Some(p3) = self.phase3.as_mut() else { return };
        let mut todo: VecDeque<Migrate> = p3.step(ev).into();
        while let Some(m) = todo.pop_front() {
            let c = m.cachelet as usize;
            let moving = self.pending.iter().any(|p| p.0.cachelet == m.cachelet);
            if c >= self.owner.len() || self.owner[c] != m.from || moving || m.to.0 == m.from.0 {
                self.migrations_failed += 1;
                if let Some(p3) = self.phase3.as_mut() {
                    todo.extend(p3.step(Phase3Event::Failed { cachelet: m.cachelet }));
                }
                continue;
            }
            let secs = m.bytes as f64 / (self.a.migrate_gbps * 1e9);
            self.next_seq += 1;
            self.pending.push(Reverse(Pending {
                at_ns: t + (secs * 1e9).round() as u64,
                seq: self.next_seq,
                server: m.from.0,
                token: 0,
                cachelet: m.cachelet,
                to: m.to.1,
                to_server: m.to.0,
                bytes: m.bytes,
            }));
            self.migrations_started += 1;
        }
    }

    /// A migration's data has arrived: the destination owns the cachelet (the coordinator's
    /// map says so, both servers' cores are given it), unless the source's workers were moving
    /// it meanwhile (then it failed).
    fn migration_ends(&mut self, p: Pending, t: u64) {
        let c = p.cachelet as usize;
        let local = self.pending.iter().any(|q| q.0.cachelet == p.cachelet);
        let ev = if self.owner[c].0 != p.server || local {
            self.migrations_failed += 1;
            Phase3Event::Failed { cachelet: p.cachelet }
        } else {
            self.owner[c] = (p.to_server, p.to);
            // An imported cachelet's counters start from zero.
            self.reads[c] = 0.0;
            self.writes[c] = 0.0;
            self.cmap.move_cachelet(p.cachelet, (p.to_server, p.to));
            for s in [p.server, p.to_server] {
                let map = self.cmap.clone();
                self.step(s, t, Event::Map { map, reset: false }, &[]);
            }
            self.migrations_done += 1;
            self.migrated_bytes += p.bytes;
            self.total_migrations += 1;
            self.total_migrated += p.bytes;
            Phase3Event::Finished { cachelet: p.cachelet, bytes: p.bytes }
        };
        self.phase3_step(ev, t);
    }

    fn sample(&self, s: u16, w: u16, t: u64, by_worker: &[Vec<u32>]) -> WorkerSample {
        let g = self.gw((s, w));
        let cachelets = by_worker[g]
            .iter()
            .map(|&c| CacheletSample {
                id: c,
                reads: self.reads[c as usize] as u64,
                writes: self.writes[c as usize] as u64,
                bytes: self.cachelet_bytes,
                ..CacheletSample::default()
            })
            .collect();
        WorkerSample { worker: w, at_ns: t, busy_ns: self.busy_ns[g] as u64, cachelets, ..WorkerSample::default() }
    }

    fn by_worker(&self) -> Vec<Vec<u32>> {
        let mut v = vec![Vec::new(); self.busy_ns.len()];
        for (c, &o) in self.owner.iter().enumerate() {
            v[self.gw(o)].push(c as u32);
        }
        v
    }

    /// Run every epoch; each one's record.
    fn run(&mut self, mut each: impl FnMut(&EpochRecord) -> Result<()>) -> Result<Vec<EpochRecord>> {
        let e_ns = ns(self.a.epoch_ms as f64);
        let bw = self.by_worker();
        for s in 0..self.a.servers {
            self.step(s, 0, Event::Start, &bw);
        }
        let mut out = Vec::new();
        for e in 1..=self.a.epochs {
            let (t0, t1) = ((e - 1) * e_ns, e * e_ns);
            let h = self.a.shift_at.iter().filter(|&&x| x * 1e9 <= t0 as f64).count() as u32;
            if h != self.hot_set {
                self.set_hot_set(h)?;
            }
            let mut rng = SmallRng::seed_from_u64(self.a.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ e);
            let mut t = t0;
            while let Some(Reverse(p)) = self.pending.peek().copied() {
                if p.at_ns >= t1 {
                    break;
                }
                self.pending.pop();
                self.stretch(&mut rng, t, p.at_ns.max(t));
                t = t.max(p.at_ns);
                if p.migration() {
                    self.migration_ends(p, t);
                    continue;
                }
                self.owner[p.cachelet as usize] = (p.server, p.to);
                self.moves_done += 1;
                let ev = Event::Moved { token: p.token, cachelet: p.cachelet, worker: p.to };
                self.step(p.server, t, ev, &[]);
            }
            self.stretch(&mut rng, t, t1);
            let bw = self.by_worker();
            for s in 0..self.a.servers {
                self.step(s, t1, Event::Tick, &bw);
            }
            // Phase 3: every server's report (and its Phase 2's news), then its epoch.
            if self.phase3.is_some() {
                let mut events = std::mem::take(&mut self.p3_events);
                events.push(Phase3Event::Epoch);
                for ev in events {
                    self.phase3_step(ev, t1);
                }
            }
            let rec = self.record(e, t1, e_ns);
            each(&rec)?;
            out.push(rec);
        }
        Ok(out)
    }

    /// The epoch's record; the epoch's accumulators start again.
    fn record(&mut self, e: u64, t1: u64, e_ns: u64) -> EpochRecord {
        let secs = e_ns as f64 / 1e9;
        let loads: Vec<f64> = self.served_w.iter().map(|x| x / secs).collect();
        let all = Imbalance::of(&loads);
        let wps = usize::from(self.a.workers);
        let server_worst = loads.chunks(wps.max(1)).map(|l| Imbalance::of(l).max_over_avg).fold(1.0, f64::max);
        let q = queue::quantiles(&self.parts, &[0.5, 0.99, 0.999]);
        let us = |x: f64| (x * 1e7).round() / 10.0;
        let r2 = |x: f64| (x * 1e4).round() / 1e4;
        let rec = EpochRecord {
            run: self.run,
            epoch: e,
            t: t1 as f64 / 1e9,
            hot_set: self.hot_set,
            offered: (self.arrived / secs).round(),
            issued: (self.issued / secs).round(),
            served: (self.served_w.iter().sum::<f64>() / secs).round(),
            max_over_avg: r2(all.max_over_avg),
            factor: r2(all.factor),
            server_max_over_avg: r2(server_worst),
            p50_us: us(q[0]),
            p99_us: us(q[1]),
            p999_us: us(q[2]),
            backlog: self.backlog.iter().sum::<f64>().round(),
            held: self.deferred.iter().sum::<f64>().round(),
            moves_started: std::mem::take(&mut self.moves_started),
            moves_done: std::mem::take(&mut self.moves_done),
            migrations_started: std::mem::take(&mut self.migrations_started),
            migrations_done: std::mem::take(&mut self.migrations_done),
            migrations_failed: std::mem::take(&mut self.migrations_failed),
            migrated_bytes: std::mem::take(&mut self.migrated_bytes),
            states: std::mem::take(&mut self.states),
            transitions: std::mem::take(&mut self.transitions),
            loads: loads.iter().map(|l| l.round() as u64).collect(),
        };
        self.arrived = 0.0;
        self.issued = 0.0;
        self.served_w.iter_mut().for_each(|x| *x = 0.0);
        self.parts.clear();
        rec
    }
}

/// A run's summary over the epochs from `from` seconds on.
pub fn summarize(run: &'static str, recs: &[EpochRecord], from: f64, offered: f64, requests: f64) -> Summary {
    let settled: Vec<&EpochRecord> = recs.iter().filter(|r| r.t > from + 1e-9).collect();
    let n = settled.len().max(1) as f64;
    let mean = |f: &dyn Fn(&EpochRecord) -> f64| settled.iter().map(|r| f(r)).sum::<f64>() / n;
    let r2 = |x: f64| (x * 1e4).round() / 1e4;
    let settle_time = match recs.iter().rposition(|r| r.max_over_avg > 1.15) {
        None => Some(0.0),
        Some(i) if i + 1 < recs.len() => Some(recs[i].t),
        Some(_) => None,
    };
    Summary {
        run,
        settled_from: from,
        max_over_avg: r2(mean(&|r| r.max_over_avg)),
        factor: r2(mean(&|r| r.factor)),
        server_max_over_avg: r2(mean(&|r| r.server_max_over_avg)),
        p99_us: mean(&|r| r.p99_us).round(),
        served: mean(&|r| r.served).round(),
        moves: recs.iter().map(|r| r.moves_done).sum(),
        migrations: recs.iter().map(|r| r.migrations_done).sum(),
        migrated_bytes: recs.iter().map(|r| r.migrated_bytes).sum(),
        settle_time,
        offered_requests: offered.round(),
        requests: requests.round(),
    }
}

/// What a run gives: its epochs and summary.
pub struct RunResult {
    pub epochs: Vec<EpochRecord>,
    pub summary: Summary,
}

/// Simulate the runs `a` asks for, writing each epoch's JSON line to `json` as it closes.
pub fn simulate(a: &SimArgs, mut json: Option<&mut dyn Write>) -> Result<Vec<RunResult>> {
    if a.servers == 0 || a.workers == 0 || a.cachelets_per_worker == 0 {
        bail!("--servers, --workers and --cachelets-per-worker must be > 0");
    }
    if !(a.worker_capacity.is_finite() && a.worker_capacity > 0.0) {
        bail!("--worker-capacity must be > 0");
    }
    if a.epoch_ms == 0 || a.epochs == 0 {
        bail!("--epoch-ms and --epochs must be > 0");
    }
    if !(a.move_ms.is_finite() && a.move_ms >= 0.0) {
        bail!("--move-ms must be >= 0");
    }
    if !(a.migrate_gbps.is_finite() && a.migrate_gbps > 0.0) {
        bail!("--migrate-gbps must be > 0");
    }
    if !(a.cachelet_mb.is_finite()
        && a.cachelet_mb >= 0.0
        && a.server_memory_mb.is_finite()
        && a.server_memory_mb >= 0.0)
    {
        bail!("--cachelet-mb and --server-memory-mb must be >= 0");
    }
    let cachelets = u32::from(a.servers) * u32::from(a.workers) * a.cachelets_per_worker;
    let vn = match a.vn_count {
        0 => mbal_cluster::DEFAULT_VN_COUNT.max(cachelets.next_power_of_two()),
        v if v < cachelets => bail!("--vn-count must be at least the number of cachelets ({cachelets})"),
        v => v,
    };
    let map0 = even_map(a.servers, a.workers, a.cachelets_per_worker, vn);
    let hot_default = if matches!(a.workload, Dist::Hotpart | Dist::Hotserver) { 0.5 } else { 0.95 };
    let read_default = if matches!(a.workload, Dist::Zipf | Dist::Uniform) { 1.0 } else { 0.95 };
    let read_ratio = a.read_ratio.unwrap_or(read_default);
    if !(0.0..=1.0).contains(&read_ratio) {
        bail!("--read-ratio must be in [0, 1]");
    }
    let capacity = f64::from(a.servers) * f64::from(a.workers) * a.worker_capacity;
    let rate = a.rate.unwrap_or(a.load * capacity);
    if !(rate.is_finite() && rate >= 0.0) {
        bail!("the offered rate must be >= 0");
    }
    let load = Load {
        params: workload::Params {
            dist: a.workload,
            keys: a.keys,
            zipf: a.zipf,
            hot_fraction: a.hot_fraction,
            hot_ops: a.hot_ops.unwrap_or(hot_default),
            hot_cachelets: a.hot_cachelets,
        },
        rate,
        read_ratio,
        cachelet_of: workload::key_cachelets(map0.keyspace(), a.keys),
    };
    // (name, (balancer, Phase 3)) of each run.
    let mut runs: Vec<(&'static str, (bool, bool))> = Vec::new();
    if matches!(a.balancer, Runs::Off | Runs::Both) {
        runs.push(("off", (false, false)));
    }
    if matches!(a.balancer, Runs::On | Runs::Both) {
        match a.phase3 {
            Runs::On => runs.push(("on", (true, true))),
            Runs::Off => runs.push(("on", (true, false))),
            Runs::Both => runs.extend([("phase2", (true, false)), ("on", (true, true))]),
        }
    }
    let from = a.settle.unwrap_or(a.epochs as f64 * a.epoch_ms as f64 / 1e3 / 2.0);
    let mut out = Vec::new();
    for (name, phases) in runs {
        let mut sim = Sim::new(a, &load, &map0, name, phases)?;
        let epochs = sim.run(|r| {
            if let Some(w) = json.as_mut() {
                serde_json::to_writer(&mut **w, r)?;
                w.write_all(b"\n")?;
            }
            Ok(())
        })?;
        let summary = summarize(sim.run, &epochs, from, sim.total_offered, sim.total_requests);
        if let Some(w) = json.as_mut() {
            serde_json::to_writer(&mut **w, &serde_json::json!({ "summary": &summary }))?;
            w.write_all(b"\n")?;
        }
        out.push(RunResult { epochs, summary });
    }
    Ok(out)
}

/// `mbal sim`: simulate, write the JSON lines, print the summary table (and the simulator's
/// speed on stderr).
pub fn run(a: SimArgs) -> Result<()> {
    let started = Instant::now();
    let mut file = match &a.json {
        Some(p) => Some(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("cannot create {}", p.display()))?,
        )),
        None => None,
    };
    let results = simulate(&a, file.as_mut().map(|f| f as &mut dyn Write))?;
    if let Some(mut f) = file {
        f.flush()?;
    }
    let wall = started.elapsed().as_secs_f64();
    println!(
        "{} servers x {} workers, {:?} (keys {}), capacity {}/s per worker, {} epochs of {} ms; settled from {:.1} s",
        a.servers,
        a.workers,
        a.workload,
        a.keys,
        a.worker_capacity,
        a.epochs,
        a.epoch_ms,
        results.first().map_or(0.0, |r| r.summary.settled_from)
    );
    println!(
        "{:<9} {:>8} {:>8} {:>10} {:>12} {:>12} {:>7} {:>9} {:>10} {:>9}",
        "balancer",
        "max/avg",
        "factor",
        "srv max/avg",
        "p99 µs",
        "served/s",
        "moves",
        "settle s",
        "migrations",
        "GB moved"
    );
    for r in &results {
        let s = &r.summary;
        println!(
            "{:<9} {:>8.2} {:>8.3} {:>10.2} {:>12.0} {:>12.0} {:>7} {:>9} {:>10} {:>9.2}",
            s.run,
            s.max_over_avg,
            s.factor,
            s.server_max_over_avg,
            s.p99_us,
            s.served,
            s.moves,
            s.settle_time.map_or("-".to_string(), |t| format!("{t:.1}")),
            s.migrations,
            s.migrated_bytes as f64 / 1e9
        );
    }
    let requests: f64 = results.iter().map(|r| r.summary.requests).sum();
    let offered: f64 = results.iter().map(|r| r.summary.offered_requests).sum();
    let w = wall.max(1e-9);
    eprintln!(
        "sim: {offered:.0} requests offered ({requests:.0} issued) in {wall:.2} s: {:.3e} offered/s, {:.3e} issued/s, {:.0} server-epochs/s",
        offered / w,
        requests / w,
        (results.len() as u64 * a.epochs * u64::from(a.servers)) as f64 / w
    );
    Ok(())
}

#[cfg(test)]
mod tests;
