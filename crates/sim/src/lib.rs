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
//! Phase 1 (hot-key copies, `--phase1 on`, the default in runs with the
//! balancer on, as on a real cluster of two or more servers): the cores
//! run with the servers' Phase 1 settings. The head of the key law is
//! drawn key by key ([`hot`]); a home worker samples the requests it serves
//! at the rate its core set and hands the samples over with its epoch
//! sample, with its replicated keys' exact reads at home; a `Replicate`
//! makes the copies at `replica_location` `--copy-ms` later (`HotDone`), a
//! renewal is answered at once with the reads the copies served since the
//! last one; the grants are what the clients read under: while a key's
//! lease lives its reads spread evenly over its home and its γ copies (the
//! lease cache's uniform draw, over many clients), its writes go home and
//! are applied at every copy. A cachelet that leaves its worker takes its
//! keys out of replication (`HotFailed`, as the server's worker says).
//! The servers' records reach each other after every epoch (`PeerLoad`,
//! from at most `--peer-reports` others, chosen at random each epoch), and
//! REPL_high slots are asked for and lent between the cores
//! (`AskLend`/`Lend`, `AskHeld`/`Held`). Not simulated: the hotspot alarms
//! between epochs (copies start at epochs only).
//!
//! Deterministic: one seeded generator per epoch, every collection walked
//! in index order; the same arguments give the same JSON, byte for byte.

mod args;
pub mod hot;
mod phase3;
pub mod queue;
mod report;
pub mod workload;

pub use args::{Phases, Runs, SimArgs};
pub use report::{run, summarize, EpochRecord, RunResult, Summary};

use anyhow::{bail, Result};
use mbal_balance::control::phase1::mean_load;
use mbal_balance::{
    Answer, CacheletSample, Command, Config, ControlCore, CoreSettings, Event, HotConfig, HotSettings, Imbalance,
    PeerHot, Phase3, Phase3Config, Phase3Event, ServerReport, WorkerSample,
};
use mbal_cluster::{ClusterMap, ServerInfo};
use queue::Part;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Binomial, Distribution, Poisson};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};
use std::io::Write;
use std::net::SocketAddr;
pub use workload::Dist;

/// The initial even map of `servers` x `workers` (addresses are placeholders: nothing is
/// dialled).
pub fn even_map(servers: u16, workers: u16, cpw: u32, vn_count: u32) -> ClusterMap {
    let addr = |s: u16, p: u16| SocketAddr::from(([127, 1, (s >> 8) as u8, s as u8], p));
    let infos = (0..servers)
        .map(|s| ServerInfo { main: addr(s, 11211), workers: (0..workers).map(|w| addr(s, 20000 + w)).collect() })
        .collect();
    ClusterMap::even(infos, cpw, vn_count)
}

/// A move under way: when it ends, and what the core is told then. A Phase 3 migration
/// (`to_server` another server) has no token. A key's copies being made (`copies`) are
/// `key` at worker `to` of `server`, their job started at `token` (ns).
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
    copies: bool,
    key: u32,
}

impl Pending {
    fn migration(&self) -> bool {
        !self.copies && self.to_server != self.server
    }

    /// A move of a cachelet (between workers or servers), not copies being made.
    fn moves(&self, c: u32) -> bool {
        !self.copies && self.cachelet == c
    }
}

/// What a waiting "client" of a core is, in the sim: another core that asked it for slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Asker {
    /// `AskLend` from `borrower`, at `asked_at`.
    Lend { borrower: u16, asked_at: u64 },
    /// `AskHeld` from `asker`.
    Held { asker: u16 },
}

/// The workload, resolved.
struct Load {
    params: workload::Params,
    rate: f64,
    read_ratio: f64,
    cachelet_of: Vec<u32>,
    /// Every cachelet's keys, for naming the tail's samples (runs with Phase 1 only), and
    /// the size of a key's name.
    keys_of: Option<hot::KeysOf>,
    key_size: usize,
}

impl Load {
    /// The workload `a` asks for over `map0` (with what Phase 1 needs when `phase1`).
    fn of(a: &SimArgs, map0: &ClusterMap, phase1: bool) -> Result<Load> {
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
        let params = workload::Params {
            dist: a.workload,
            keys: a.keys,
            zipf: a.zipf,
            hot_fraction: a.hot_fraction,
            hot_ops: a.hot_ops.unwrap_or(hot_default),
            hot_cachelets: a.hot_cachelets,
        };
        let cachelet_of = workload::key_cachelets(map0.keyspace(), params.keys);
        let keys_of = phase1.then(|| hot::KeysOf::new(&cachelet_of, map0.cachelet_count()));
        let key_size = mbal_bench::workload::min_key_size(params.keys).max(10);
        Ok(Load { params, rate, read_ratio, cachelet_of, keys_of, key_size })
    }
}

/// A count drawn from Poisson(`lam`) (0 for `lam` <= 0).
fn poisson(lam: f64, rng: &mut SmallRng) -> f64 {
    if lam > 0.0 {
        Poisson::new(lam).map(|p| p.sample(rng)).unwrap_or(0.0)
    } else {
        0.0
    }
}

/// `x` (>= 0) as a whole number, rounded up with probability its fraction (the fluid
/// model's expected counts become counts with the same mean: a home that serves a key 0.2
/// times an epoch counts it once in five epochs, not never).
fn whole(x: f64, rng: &mut SmallRng) -> u64 {
    if x.is_nan() || x <= 0.0 {
        return 0;
    }
    x.floor() as u64 + u64::from(rng.gen::<f64>() < x.fract())
}

/// How many of `n` requests (rounded at random to a whole number) are drawn with
/// probability `p`.
fn thin(n: f64, p: f64, rng: &mut SmallRng) -> u64 {
    if !(n > 0.0 && p > 0.0) {
        return 0;
    }
    let whole = whole(n, rng);
    if p >= 1.0 {
        return whole;
    }
    Binomial::new(whole, p).map(|b| b.sample(rng)).unwrap_or(0)
}

/// One run: the cores and the simulated workers and clients.
struct Sim<'a> {
    a: &'a SimArgs,
    run: &'static str,
    load: &'a Load,
    map0: ClusterMap,
    cores: Vec<ControlCore<Asker>>,
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
    /// Each cachelet's share of the requests, and that share less its head keys' (Phase 1
    /// draws those one by one; without Phase 1 the two are the same).
    mass: Vec<f64>,
    tail_mass: Vec<f64>,
    hot_set: u32,
    /// Phase 1, when it runs: the head keys, the keys with copies, each worker's sample
    /// rate and samples since its last epoch sample, and the copies' requests each worker
    /// has waiting and the clients hold back.
    p1: bool,
    head: hot::Head,
    repl: hot::Replicas,
    sample_rate: Vec<f64>,
    samples: Vec<hot::Samples>,
    copy_backlog: Vec<f64>,
    copy_deferred: Vec<f64>,
    copy_served: f64,
    replicated: u64,
    retired: u64,
    /// The servers' epoch records of this epoch, for the others (`PeerLoad`).
    records: Vec<(u16, f64, Option<PeerHot>)>,
    /// What Phase 1's commands led to at once, for the cores.
    hot_events: VecDeque<(u16, Event<Asker>)>,
    /// Draws that make counts whole (home and copy reads), apart from the epochs' draws.
    counts: SmallRng,
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
    fn new(a: &'a SimArgs, load: &'a Load, map0: &ClusterMap, run: &'static str, phases: Phases) -> Result<Sim<'a>> {
        let phase3 = phases.p3;
        // Phase 1 runs where a server has others to hold its copies (as the server: with the
        // replicator, in a cluster of two or more).
        let p1 = phases.p1 && a.servers >= 2;
        if p1 && load.keys_of.is_none() {
            bail!("a run with Phase 1 needs the load built for it");
        }
        let cfg = Config { worker_capacity: Some(a.worker_capacity), ..Config::default() };
        let cachelet_bytes = (a.cachelet_mb * 1e6).round() as u64;
        let mem_limit = if a.server_memory_mb > 0.0 {
            (a.server_memory_mb * 1e6).round() as u64
        } else {
            2 * cachelet_bytes * u64::from(a.workers) * u64::from(a.cachelets_per_worker)
        };
        let e = a.epoch_ms.max(1);
        let every = (a.balance_epoch_ms.saturating_add(e / 2) / e).max(1);
        let policy = HotConfig::default();
        let lease_ms = u64::from(policy.lease_epochs.max(1)) * a.epoch_ms;
        let hot = p1.then(|| HotSettings {
            policy: policy.clone(),
            balance: cfg.clone(),
            // The server's `copy_ttl_ms`: a lease and two epochs.
            copy_ttl_ms: lease_ms + 2 * a.epoch_ms,
            lend_slots: true,
        });
        let cores = (0..a.servers)
            .map(|s| {
                let settings = CoreSettings {
                    server: s,
                    workers: a.workers,
                    balance_every: every,
                    balancer: phases.p2.then(|| cfg.clone()),
                    epoch_ms: a.epoch_ms,
                    hot: hot.clone(),
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
            tail_mass: Vec::new(),
            hot_set: 0,
            p1,
            head: hot::Head::default(),
            repl: hot::Replicas::default(),
            sample_rate: vec![policy.sample_rate; workers],
            samples: vec![Vec::new(); workers],
            copy_backlog: vec![0.0; workers],
            copy_deferred: vec![0.0; workers],
            copy_served: 0.0,
            replicated: 0,
            retired: 0,
            records: Vec::new(),
            hot_events: VecDeque::new(),
            counts: SmallRng::seed_from_u64(a.seed ^ 0x636f_756e_7473),
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
        if self.p1 {
            let workers = f64::from(self.a.servers) * f64::from(self.a.workers);
            self.head = hot::Head::of(&km, &self.load.cachelet_of, self.a.head_share / workers, self.a.head_keys);
            self.tail_mass = self.head.tail_masses(&self.mass);
        } else {
            self.tail_mass = self.mass.clone();
        }
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
        let wps = usize::from(self.a.workers);
        let gw = |(s, w): (u16, u16)| usize::from(s) * wps + usize::from(w);
        let mut w_arr = vec![0.0f64; workers];
        let mut w_back = vec![0.0f64; workers];
        let mut offered = 0.0;
        // Phase 1's head, key by key: the reads of a key under a lease spread evenly over
        // its home and its γ copies, its writes go home and to every copy.
        let h = self.head.len();
        let mut home_r = vec![0.0f64; h];
        let mut home_w = vec![0.0f64; h];
        let mut copy_arr = vec![0.0f64; if self.p1 { workers } else { 0 }];
        let mut prop = vec![0.0f64; copy_arr.len()];
        let mut at_copies: Vec<(usize, usize, f64)> = Vec::new();
        for i in 0..h {
            let k = poisson(self.load.rate * self.head.mass[i] * secs, rng);
            if k <= 0.0 {
                continue;
            }
            let w = if self.load.read_ratio < 1.0 {
                Binomial::new(k as u64, 1.0 - self.load.read_ratio).expect("a probability").sample(rng) as f64
            } else {
                0.0
            };
            offered += k;
            let c = self.head.cachelet[i] as usize;
            let mut at_home = k - w;
            if let Some(r) = self.repl.by_home.get(&(self.owner[c].0, self.owner[c].1, self.head.key[i])) {
                if let Some((g, _)) = r.grant.filter(|&(g, until)| g > 0 && from < until) {
                    let g = (g as usize).min(r.copies.len());
                    let share = (k - w) / (g as f64 + 1.0);
                    at_home = share;
                    for &o in &r.copies[..g] {
                        copy_arr[gw(o)] += share;
                        at_copies.push((i, gw(o), share));
                    }
                }
                for &o in &r.copies {
                    prop[gw(o)] += w;
                }
            }
            home_r[i] = at_home;
            home_w[i] = w;
            arr[c] += at_home + w;
            wr[c] += w;
        }
        for c in 0..n {
            let lam = self.load.rate * self.tail_mass[c] * secs;
            if lam > 0.0 {
                let k = Poisson::new(lam).map(|p| p.sample(rng)).unwrap_or(0.0);
                offered += k;
                arr[c] += k;
                if self.load.read_ratio < 1.0 && k >= 1.0 {
                    let b = Binomial::new(k as u64, 1.0 - self.load.read_ratio).expect("a probability");
                    wr[c] += b.sample(rng) as f64;
                }
            }
            // What the clients hold back (their window was full) goes first.
            arr[c] += self.deferred[c];
            wr[c] += self.deferred_w[c];
            let g = gw(self.owner[c]);
            w_arr[g] += arr[c];
            w_back[g] += self.backlog[c];
        }
        for g in 0..copy_arr.len() {
            copy_arr[g] += self.copy_deferred[g];
            w_arr[g] += copy_arr[g];
            w_back[g] += self.copy_backlog[g];
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
        let held_before: f64 = self.deferred.iter().sum::<f64>() + self.copy_deferred.iter().sum::<f64>();
        for c in 0..n {
            self.deferred[c] = arr[c] * (1.0 - alpha);
            self.deferred_w[c] = wr[c] * (1.0 - alpha);
            arr[c] *= alpha;
            wr[c] *= alpha;
        }
        for (held, x) in self.copy_deferred.iter_mut().zip(copy_arr.iter_mut()) {
            *held = *x * (1.0 - alpha);
            *x *= alpha;
        }
        w_arr.iter_mut().for_each(|x| *x *= alpha);
        // A write's copies are the home's to send, not held by the clients.
        for (g, p) in prop.iter().enumerate() {
            w_arr[g] += p;
        }
        let issued: f64 = arr.iter().sum::<f64>() + copy_arr.iter().sum::<f64>();
        let held_after: f64 = self.deferred.iter().sum::<f64>() + self.copy_deferred.iter().sum::<f64>();
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
        for g in 0..copy_arr.len() {
            let total = self.copy_backlog[g] + copy_arr[g] + prop[g];
            let served = total * frac[g];
            self.copy_backlog[g] = total - served;
            self.copy_served += served;
        }
        // What each home served of its head keys: its samples, its replicated keys' reads.
        let mut head_in = vec![0.0f64; if self.p1 { n } else { 0 }];
        for i in 0..h {
            let c = self.head.cachelet[i] as usize;
            let home = self.owner[c];
            let g = gw(home);
            let f = alpha * frac[g];
            let (r, w) = (home_r[i] * f, home_w[i] * f);
            head_in[c] += r + w;
            let key = self.head.key[i];
            let rate = self.sample_rate[g];
            for (n, write) in [(thin(r, rate, rng), false), (thin(w, rate, rng), true)] {
                for _ in 0..n {
                    self.samples[g].push((hot::name(key, self.load.key_size), write));
                }
            }
            if let Some(e) = self.repl.get_mut(home, key) {
                e.home_reads += r;
            }
        }
        for (i, g, reads) in at_copies {
            let home = self.owner[self.head.cachelet[i] as usize];
            if let Some(e) = self.repl.get_mut(home, self.head.key[i]) {
                e.copy_reads += reads * alpha * frac[g];
            }
        }
        for c in 0..n {
            let g = gw(self.owner[c]);
            let total = self.backlog[c] + arr[c];
            let served = total * frac[g];
            self.backlog[c] = total - served;
            let wshare = if arr[c] > 0.0 { wr[c] / arr[c] } else { 1.0 - self.load.read_ratio };
            self.reads[c] += served * (1.0 - wshare);
            self.writes[c] += served * wshare;
            // The tail's samples name keys of the cachelet outside the head.
            if let Some(keys_of) = self.load.keys_of.as_ref().filter(|_| self.p1) {
                let keys = keys_of.of(c as u32);
                let m = thin((served - head_in[c]).max(0.0), self.sample_rate[g], rng);
                for _ in 0..if keys.is_empty() { 0 } else { m } {
                    let k = keys[rng.gen_range(0..keys.len())];
                    let write = rng.gen::<f64>() < 1.0 - self.load.read_ratio;
                    if !self.head.pos.contains_key(&k) {
                        self.samples[g].push((hot::name(k, self.load.key_size), write));
                    }
                }
            }
        }
        self.issued += issued;
        self.arrived += offered;
        self.total_requests += issued;
        self.total_offered += offered;
    }

    /// Give server `s`'s core an event at `t` and carry out its commands (and those of the
    /// events they lead to, on any core) in order.
    fn step(&mut self, s: u16, t: u64, first: Event<Asker>, by_worker: &[Vec<u32>]) {
        self.deliver(t, VecDeque::from([(s, first)]), by_worker);
    }

    /// Deliver events to the cores, in order, with the events their commands lead to.
    fn deliver(&mut self, t: u64, mut events: VecDeque<(u16, Event<Asker>)>, by_worker: &[Vec<u32>]) {
        while let Some((s, ev)) = events.pop_front() {
            let cmds = self.cores[usize::from(s)].step(t, ev);
            for cmd in cmds {
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
                            let g = self.gw((s, w));
                            let keys = std::mem::take(&mut self.samples[g]);
                            let home_reads = if self.p1 {
                                let rng = &mut self.counts;
                                self.repl.take_home_reads(s, w, self.load.key_size, |x| whole(x, rng))
                            } else {
                                Vec::new()
                            };
                            events.push_back((s, Event::Sample { seq, sample, keys, home_reads }));
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
                            copies: false,
                            key: 0,
                        };
                        self.pending.push(Reverse(p));
                        self.moves_started += 1;
                    }
                    Command::Epoch(e) => {
                        if self.phase3.is_some() {
                            let r = ServerReport::from_snapshot(s, &e.snapshot, &self.cfg, self.mem_limit);
                            self.p3_events.push(Phase3Event::Report(r));
                        }
                        if self.p1 {
                            // The record the others hear (`mbal load` / `mbal report`).
                            let mean = mean_load(&e.snapshot, &self.cfg);
                            let hot = e.hot.as_ref().map(|d| PeerHot { spare: d.spare, heat: d.heat.clone() });
                            self.records.push((s, mean, hot));
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
                    Command::Hot { worker, cmd } => self.hot_command(s, worker, cmd, t),
                    Command::Renew { key, at_ns, .. } => {
                        // The copies' reads since the last renewal come back with it.
                        let home = hot::parse(&key)
                            .and_then(|k| self.load.cachelet_of.get(k as usize).map(|&c| (k, self.owner[c as usize])));
                        let e = home.and_then(|(k, o)| self.repl.get_mut(o, k).filter(|_| o.0 == s));
                        let (ok, copy_reads) = match e {
                            Some(e) => (true, whole(std::mem::take(&mut e.copy_reads), &mut self.counts)),
                            None => (false, 0),
                        };
                        events.push_back((s, Event::HotDone { key, created: false, ok, at_ns, copy_reads }));
                    }
                    Command::AskLend { lender, slots, lease_ms } => {
                        let reply = Asker::Lend { borrower: s, asked_at: t };
                        events.push_back((lender, Event::Lend { borrower: s, slots, lease_ms, reply }));
                    }
                    Command::AskHeld { peer } => {
                        events.push_back((peer, Event::Held { lender: s, reply: Asker::Held { asker: s } }));
                    }
                    Command::Reply { to, answer } => match (to, answer) {
                        (Asker::Lend { borrower, asked_at }, Answer::Slots { granted, lease_ms }) => {
                            let lease_ns = lease_ms.saturating_mul(1_000_000);
                            events.push_back((
                                borrower,
                                Event::SlotsGranted { lender: s, slots: granted, asked_at, lease_ns },
                            ));
                        }
                        (Asker::Held { asker }, answer) => {
                            let held = match answer {
                                Answer::Held(n) => Some(n),
                                _ => None,
                            };
                            events.push_back((asker, Event::PeerHolds { peer: s, held }));
                        }
                        // A lender that lends nothing: the borrower hears nothing (as the
                        // server's slot thread).
                        _ => {}
                    },
                    // No client waits for an answer; the map is the core's.
                    _ => {}
                }
            }
            // Phase 1's commands may have failed at once (the key is not at its home).
            events.extend(std::mem::take(&mut self.hot_events));
        }
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
                if p.copies {
                    self.copies_made(p, t);
                    continue;
                }
                self.owner[p.cachelet as usize] = (p.server, p.to);
                self.moves_done += 1;
                let mut events = self.drop_hot_of(p.cachelet);
                events.push_back((p.server, Event::Moved { token: p.token, cachelet: p.cachelet, worker: p.to }));
                self.deliver(t, events, &[]);
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
            // Phase 1: every server's record of this epoch to (some of) the others.
            if self.p1 {
                let events = self.peer_reports(&mut rng);
                self.deliver(t1, events, &[]);
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
        let per_server: Vec<f64> = loads.chunks(wps.max(1)).map(|l| l.iter().sum()).collect();
        let servers_max_over_avg = Imbalance::of(&per_server).max_over_avg;
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
            servers_max_over_avg: r2(servers_max_over_avg),
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
            hot_keys: self.repl.len() as u64,
            copies: self.repl.copies() as u64,
            copy_mb: r2(self.repl.copies() as f64 * self.a.item_bytes as f64 / 1e6),
            replicated: std::mem::take(&mut self.replicated),
            retired: std::mem::take(&mut self.retired),
            copy_served: (std::mem::take(&mut self.copy_served) / secs).round(),
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
    // (name, phases) of each run.
    let mut runs: Vec<(&'static str, Phases)> = Vec::new();
    if !a.runs.is_empty() {
        for name in &a.runs {
            let phases = Phases::parse(name)?;
            runs.push((Box::leak(name.clone().into_boxed_str()), phases));
        }
    } else {
        if a.phase1 == Runs::Both {
            bail!("--phase1 is on or off (--runs names runs with and without it)");
        }
        let p1 = a.phase1 == Runs::On;
        if matches!(a.balancer, Runs::Off | Runs::Both) {
            runs.push(("off", Phases { p1: false, p2: false, p3: false }));
        }
        if matches!(a.balancer, Runs::On | Runs::Both) {
            match a.phase3 {
                Runs::On => runs.push(("on", Phases { p1, p2: true, p3: true })),
                Runs::Off => runs.push(("on", Phases { p1, p2: true, p3: false })),
                Runs::Both => runs.extend([
                    ("phase2", Phases { p1, p2: true, p3: false }),
                    ("on", Phases { p1, p2: true, p3: true }),
                ]),
            }
        }
    }
    if !(a.head_share.is_finite() && a.head_share >= 0.0 && a.copy_ms.is_finite() && a.copy_ms >= 0.0) {
        bail!("--head-share and --copy-ms must be >= 0");
    }
    let phase1 = a.servers >= 2 && runs.iter().any(|r| r.1.p1);
    let load = Load::of(a, &map0, phase1)?;
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

#[cfg(test)]
mod tests;
