//! `mbal sim`'s arguments, and which phases each run runs.

use anyhow::{bail, Result};
use std::path::PathBuf;

use crate::workload::Dist;

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
    /// Phase 1 (hot-key copies) in the runs with the balancer on: on (a real cluster's
    /// default) or off.
    #[arg(long, value_enum, default_value = "on")]
    pub phase1: Runs,
    /// The runs to make, instead of --balancer/--phase1/--phase3: a comma list of `off`,
    /// `all`, and `phase` followed by the phases it runs joined by `+` (`phase1`, `phase2`,
    /// `phase3`, `phase1+2`, ...), e.g. `off,phase1,phase2,phase3,all` (MBal's Fig. 10).
    #[arg(long, value_delimiter = ',')]
    pub runs: Vec<String>,
    /// Keys drawn one by one (Phase 1's head): those whose mass is at least this fraction of
    /// one worker's share of the requests...
    #[arg(long, default_value_t = 0.01)]
    pub head_share: f64,
    /// ...at most this many (hottest first).
    #[arg(long, default_value_t = 2_000_000)]
    pub head_keys: usize,
    /// How long making a key's copies takes (ms), from `Replicate` to `HotDone`.
    #[arg(long, default_value_t = 1.0)]
    pub copy_ms: f64,
    /// Each server hears the epoch records of at most this many others per epoch, chosen
    /// at random each epoch (0: every other server, as a real cluster does).
    #[arg(long, default_value_t = 64)]
    pub peer_reports: usize,
    /// Bytes of one item, for the memory the copies take.
    #[arg(long, default_value_t = 1_000)]
    pub item_bytes: u64,
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

/// Which phases a run runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Phases {
    pub p1: bool,
    pub p2: bool,
    pub p3: bool,
}

impl Phases {
    /// `off`, `all`, or `phase` + the phases joined by `+` (`phase1+2`).
    pub fn parse(name: &str) -> Result<Phases> {
        let none = Phases { p1: false, p2: false, p3: false };
        match name {
            "off" => return Ok(none),
            "all" | "on" => return Ok(Phases { p1: true, p2: true, p3: true }),
            _ => {}
        }
        let Some(list) = name.strip_prefix("phase") else { bail!("a run is off, all or phase<N>[+<N>...]: {name}") };
        let mut p = none;
        for n in list.split('+') {
            match n {
                "1" => p.p1 = true,
                "2" => p.p2 = true,
                "3" => p.p3 = true,
                _ => bail!("a run is off, all or phase<N>[+<N>...] with N 1, 2 or 3: {name}"),
            }
        }
        Ok(p)
    }
}
