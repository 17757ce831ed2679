//! mbal-bench: the `mbal bench` load generator (DESIGN.md §8).
//!
//! # Design
//!
//! * [`workload`]: what to send. MBal Table 4 mixes (A = 100% read Zipfian, B = 95/5 hotspot,
//!   C = 50/50 Zipfian), uniform and custom mixes, a phase timeline (`--phases a:10,b:10`).
//!   Zipfian ranks come from `rand_distr::Zipf` and are mapped to keys through a fixed seeded
//!   permutation (YCSB's "scrambled zipfian"), so hot keys are spread over the key space and
//!   over servers. Keys are `k` + zero-padded index, exactly `--key-size` bytes.
//! * [`engine`]: when to send. One OS thread per `--threads`, each running one event loop over
//!   its share of the `--conns` logical clients. Closed loop keeps `--pipeline` ops in flight per
//!   logical client; open loop (`--rate`) sends at intended times and measures latency from the
//!   intended time (no coordinated omission). Every run is bounded by `--duration` and
//!   `--max-ops`, and in-flight replies are drained for at most `--drain` seconds.
//! * [`driver`]: where and how. The [`driver::Driver`] trait is "a set of connections that
//!   can send ops and receive their results"; [`driver::PlainDriver`] speaks the memcached text
//!   protocol over mio non-blocking sockets, one connection per (logical client, server), keys
//!   spread with `mbal_cluster::key_hash(key) % servers` (a multiget is split per server).
//! * [`routed`]: `--routed`, mbal's routing client mode, as a second `Driver`
//!   ([`routed::RoutedDriver`], made per client thread by [`routed::RoutedFactory`], run with
//!   [`run_with`]): the cluster map from `mbal map`, one connection per (logical client, worker)
//!   opted in with `mbal hello`, ops routed by key hash → cachelet → worker, `RD` redirects
//!   learned and followed (at most [`routed::MAX_REDIRECTS`] per request chain). Everything else
//!   (workloads, pacing, statistics, reports) is shared: targets are then the workers
//!   (`s<server>/w<worker>`) and `Totals::redirects` counts redirects followed.
//! * `conns` (private): the mio connection set both drivers are built on (poll, events, per
//!   connection write/read buffers, reply parser and queue of requests awaiting replies; write,
//!   read and poll loops). A driver keeps only its routing, request encoding and reply handling.
//! * Replies are decoded by `mbal_proto::client::Decoder` (the client-side codec shared with
//!   the routing client), reading gets with `Expect::Hits`: values' data is skipped as it
//!   arrives, only hits are counted, nothing is allocated.
//! * SET values are `--value-size` bytes, or uniform in `[--value-size, --value-size-max]`
//!   drawn per op from the thread's seeded generator (deterministic for a seed).
//! * Results: HdrHistograms per op type (ns) and per second (µs), per-target request counts with
//!   max/avg and NetKV's imbalance factor (Eq. 6), client CPU per op (the generator's own cost),
//!   all in a serde [`BenchReport`] (`--json`) and an SVG plot ([`plot()`], `--plot`,
//!   `--plot-only a.json b.json -o x.svg`).
//! * Balancer experiments (with `mbal server --worker-capacity`): `--workload hotpart` (a hot
//!   partition: `--hot-ops` of ops on the keys of `--hot-cachelets` cachelets of one worker,
//!   found through the cluster map and `KeySpace`), `--rate-sweep FROM:TO:STEP` with
//!   `--p99-target-us` (one open-loop run per rate; the highest throughput meeting the target:
//!   [`Sweep`]), per-second per-target counts in the timeline, and [`serverload`]: the servers'
//!   own per-worker load per epoch (`mbal load`, side threads) with the balancer's decisions
//!   (moves, requests for Phase 3) as events, in the JSON ([`ServerLoad`]) and as a third plot
//!   panel; `--settle SECS`: throughput and latency after a settle period ([`Settled`]).
//!   `scripts/bench-balance.sh` runs them.
//! * [`stub`]: a tiny in-process memcached-text server for `--null-server` (measures the
//!   generator's ceiling) and for tests.
//!
//! Load is only sent to loopback addresses unless `--allow-non-loopback` is given.

mod conns;
pub mod driver;
pub mod engine;
mod plot;
pub mod routed;
pub mod serverload;
pub mod stub;
pub mod workload;

use std::collections::BTreeMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context, Result};
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use driver::{Driver, PlainDriver};
use engine::{OpSource, SecAcc, ThreadPlan, ThreadResult};
use mbal_cluster::ClusterMap;
pub use plot::plot;
pub use serverload::ServerLoad;
use workload::{DistKind, KeyGen, Phase, WorkloadKind, WorkloadParams};

/// `mbal bench`: drive a memcached-protocol server (or several) with a YCSB-style workload.
#[derive(clap::Args, Clone, Debug, Serialize, Deserialize)]
pub struct BenchArgs {
    /// Target HOST:PORT (repeatable). Keys go to server `key_hash(key) % n` (mbal's xxh3 key
    /// hash; no ketama). Only loopback (127.0.0.0/8, ::1) unless --allow-non-loopback.
    #[arg(long = "server", default_value = "127.0.0.1:11211")]
    pub server: Vec<String>,
    /// Allow targets outside 127.0.0.0/8.
    #[arg(long)]
    pub allow_non_loopback: bool,
    /// Ignore --server and run against an in-process stub server (measures the generator's own
    /// ceiling; see also `client.ops_per_cpu_sec` in every report).
    #[arg(long)]
    pub null_server: bool,
    /// mbal routed mode: fetch the cluster map from the one --server (any server of an mbal
    /// cluster, or a single mbal server), connect to every worker's own port (`mbal hello`),
    /// route each op to its owning worker and follow `RD` redirects. Targets are the workers.
    #[arg(long, conflicts_with = "plain")]
    pub routed: bool,
    /// Plain mode (the default): an ordinary memcached text client against each --server, so
    /// stock memcached is measured by the same tool. Keys go to server key_hash(key) % n.
    #[arg(long)]
    #[serde(default)]
    pub plain: bool,

    /// Workload: a = 100% read Zipfian, b = 95/5 read/update hotspot, c = 50/50 Zipfian,
    /// uniform = uniform keys with --read-ratio, custom = --dist keys with --read-ratio.
    #[arg(long, value_enum, default_value = "a")]
    pub workload: WorkloadKind,
    /// Fraction of ops that are reads (uniform and custom workloads).
    #[arg(long, default_value_t = 0.95)]
    pub read_ratio: f64,
    /// Key distribution of the custom workload.
    #[arg(long, value_enum, default_value = "zipf")]
    pub dist: DistKind,
    /// Zipfian constant.
    #[arg(long, default_value_t = 0.99)]
    pub zipf: f64,
    /// Number of distinct keys.
    #[arg(long, default_value_t = 100_000)]
    pub keys: u32,
    /// Key length in bytes (`k` + zero-padded index).
    #[arg(long, default_value_t = 10)]
    pub key_size: usize,
    /// Value length in bytes for SETs (the minimum when --value-size-max is given).
    #[arg(long, default_value_t = 20)]
    pub value_size: usize,
    /// Variable value sizes: each SET's value length is uniform in
    /// [--value-size, --value-size-max] (deterministic per op for a given --seed).
    #[arg(long)]
    pub value_size_max: Option<usize>,
    /// Hotspot: fraction of keys that are hot.
    #[arg(long, default_value_t = 0.05)]
    pub hot_fraction: f64,
    /// Hotspot and hot partition: fraction of ops that go to hot keys.
    #[arg(long, default_value_t = 0.95)]
    pub hot_ops: f64,
    /// Hot partition: how many cachelets are hot: the first K (by id) that the cluster map gives
    /// the worker owning cachelet 0 (a hot shard on one worker). The map comes from the (first)
    /// --server with `mbal map`, so the workload needs an mbal server.
    #[arg(long, default_value_t = 4)]
    #[serde(default)]
    pub hot_cachelets: u32,
    /// Hot partition: the hot cachelets by id instead (comma separated).
    #[arg(long, value_delimiter = ',')]
    #[serde(default)]
    pub hot_cachelet_ids: Vec<u32>,

    /// SET every key once (pipelined, closed loop) before the run.
    #[arg(long)]
    pub load: bool,
    /// Only do the load phase.
    #[arg(long)]
    pub load_only: bool,
    /// Upper bound on the load phase, seconds.
    #[arg(long, default_value_t = 300.0)]
    pub load_timeout: f64,

    /// Timeline of workloads, e.g. "a:10,b:10,c:10" (NAME:SECONDS,...). Sets the default duration
    /// to the sum of the phases.
    #[arg(long)]
    pub phases: Option<String>,

    /// Logical clients (connections per server), divided among threads.
    #[arg(long, default_value_t = 8)]
    pub conns: usize,
    /// Requests in flight per logical client.
    #[arg(long, default_value_t = 16)]
    pub pipeline: usize,
    /// Client threads.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Open loop: total target ops/s (latency measured from the intended send time). The
    /// client busy-polls for the last millisecond before each send, so it uses its whole core.
    /// Without it: closed loop.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Open-loop rate sweep FROM:TO:STEP (ops/s): one run of --duration at each rate in turn
    /// (at most 100), reporting each rate's throughput and latency and, with --p99-target-us,
    /// the highest throughput whose p99 met the target. Stops after two rates in a row miss it
    /// with a throughput under 90% of the rate offered (saturated).
    #[arg(long, conflicts_with = "rate")]
    #[serde(default)]
    pub rate_sweep: Option<String>,
    /// p99 latency target in µs (with --rate-sweep).
    #[arg(long)]
    #[serde(default)]
    pub p99_target_us: Option<f64>,
    /// Record the servers' per-worker load (`mbal load`, one side thread per server) during the
    /// run: auto = in routed mode (the servers are mbal servers), on = also in plain mode (the
    /// --server targets must be mbal servers), off.
    #[arg(long, value_enum, default_value = "auto")]
    #[serde(default)]
    pub server_load: ServerLoadMode,
    /// Keys per GET (multiget) for reads.
    #[arg(long, default_value_t = 1)]
    pub multiget: usize,

    /// Run time in seconds (default 10, or the sum of --phases).
    #[arg(long)]
    pub duration: Option<f64>,
    /// Seconds at the start of the run to leave out of the report's `settled` figures
    /// (throughput and latency of the ops completed after them): a balancer's settle period.
    #[arg(long)]
    #[serde(default)]
    pub settle: Option<f64>,
    /// Stop after this many ops (whichever of --duration and --max-ops comes first).
    #[arg(long)]
    pub max_ops: Option<u64>,
    /// Seconds to wait for in-flight replies at the end.
    #[arg(long, default_value_t = 5.0)]
    pub drain: f64,
    /// Random seed (key choice, op mix). The key permutation is fixed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,

    /// Write the report as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write an SVG plot (throughput and p90/p99 latency per second).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Do not run: plot these JSON reports (one line per run) into -o/--output.
    #[arg(long, num_args = 1..)]
    pub plot_only: Vec<PathBuf>,
    /// Output file for --plot-only.
    #[arg(short = 'o', long)]
    pub output: Option<PathBuf>,
    /// Do not print the summary.
    #[arg(long)]
    pub quiet: bool,
}

impl Default for BenchArgs {
    fn default() -> Self {
        #[derive(clap::Parser)]
        struct P {
            #[command(flatten)]
            a: BenchArgs,
        }
        <P as clap::Parser>::parse_from(["bench"]).a
    }
}

/// `--server-load`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ServerLoadMode {
    #[default]
    Auto,
    On,
    Off,
}

/// Latency percentiles of one op type, in microseconds.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct LatencySummary {
    pub count: u64,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
}

/// Totals of one phase (the load phase or the run).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct Totals {
    pub elapsed_s: f64,
    /// Ops completed (a multiget is one op).
    pub ops: u64,
    pub gets: u64,
    pub sets: u64,
    /// Keys asked for by gets.
    pub get_keys: u64,
    pub hits: u64,
    pub misses: u64,
    /// Error replies (ERROR, CLIENT_ERROR, SERVER_ERROR, NOT_STORED).
    pub errors: u64,
    /// Ops sent but not answered within --drain.
    pub unfinished: u64,
    /// Redirects (`RD`) followed (routed mode).
    pub redirects: u64,
    /// Protocol requests on the wire (a multiget split over servers counts once per server).
    pub requests: u64,
    pub ops_per_sec: f64,
    pub requests_per_sec: f64,
    /// Keys per second: get keys + set keys.
    pub keys_per_sec: f64,
    pub hit_ratio: f64,
    /// --rate, if open loop.
    pub target_rate: Option<f64>,
    /// Open loop: ops sent more than 1 ms after their intended time (all slots were full or the
    /// client was busy). Their latency still counts from the intended time.
    pub late_ops: u64,
}

/// One second of the run.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct SecondStats {
    /// Seconds since the start of the run.
    pub t: u32,
    pub phase: String,
    pub ops: u64,
    pub gets: u64,
    pub sets: u64,
    pub keys: u64,
    pub hits: u64,
    pub errors: u64,
    pub ops_per_sec: f64,
    pub keys_per_sec: f64,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    /// Requests the client sent to each target in this second (the order of `balance.targets`).
    pub targets: Vec<u64>,
}

/// The run after its first `from_s` seconds (`--settle`): ops completed in the whole seconds
/// from `from_s` on.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct Settled {
    pub from_s: f64,
    /// Seconds counted (to the end of the run).
    pub secs: f64,
    pub ops: u64,
    pub ops_per_sec: f64,
    /// Latency (µs) of those ops, all op types.
    pub latency: LatencySummary,
}

/// One rate of a `--rate-sweep`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct SweepStep {
    pub offered_ops_per_sec: f64,
    pub ops_per_sec: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub late_ops: u64,
    pub unfinished: u64,
    pub errors: u64,
    /// Client's per-target max/avg at this rate.
    pub max_over_avg: f64,
    /// The servers' per-worker max/avg at this rate (their own counters), if they reported it.
    pub server_max_over_avg: Option<f64>,
    /// p99 within --p99-target-us, nothing unfinished, no errors.
    pub meets_target: bool,
}

/// A `--rate-sweep`: every rate run, and the best one at the p99 target.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct Sweep {
    pub p99_target_us: Option<f64>,
    pub steps: Vec<SweepStep>,
    /// The highest throughput of a step that met the target, and the rate offered there.
    pub max_ops_per_sec_at_target: Option<f64>,
    pub offered_at_target: Option<f64>,
}

/// Requests received by one target (a server in plain mode; a worker in routed mode later).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct TargetStats {
    pub name: String,
    pub requests: u64,
}

/// Load balance over targets.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct Balance {
    pub targets: Vec<TargetStats>,
    pub max_requests: u64,
    pub avg_requests: f64,
    /// max / avg (1.0 = perfectly even).
    pub max_over_avg: f64,
    /// NetKV Eq. 6: sum |r_i - avg| / (avg * n) (0 = perfectly even).
    pub imbalance_factor: f64,
}

/// The generator's own cost: CPU time of the client threads.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct ClientCost {
    pub threads: usize,
    pub cpu_secs: f64,
    /// Ops per client-CPU-second: the generator's ceiling per core for this workload.
    pub ops_per_cpu_sec: f64,
}

/// Everything a run measured, with every setting (`--json`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BenchReport {
    pub tool: String,
    pub driver: String,
    pub settings: BenchArgs,
    pub phases: Vec<Phase>,
    pub started_unix_ms: u64,
    pub load: Option<Totals>,
    pub totals: Totals,
    /// Keyed by op type: "get", "set", "all".
    pub latency: BTreeMap<String, LatencySummary>,
    pub timeline: Vec<SecondStats>,
    pub balance: Balance,
    pub client: ClientCost,
    /// Hot partition: the hot cachelets.
    #[serde(default)]
    pub hot_cachelets: Vec<u32>,
    /// `--settle`: throughput and latency after the settle period (a sweep: the last rate's).
    #[serde(default)]
    pub settled: Option<Settled>,
    /// `--rate-sweep`: each rate's results (the fields above are the last rate's).
    #[serde(default)]
    pub sweep: Option<Sweep>,
    /// Per-worker load from the servers' own counters (`mbal load`), with balancer events.
    #[serde(default)]
    pub server_load: Option<ServerLoad>,
}

/// NetKV's imbalance factor (Eq. 6) of per-target rates: `sum |r_i - avg| / (avg * n)`.
pub fn imbalance_factor(rates: &[f64]) -> f64 {
    let n = rates.len() as f64;
    if rates.is_empty() {
        return 0.0;
    }
    let avg = rates.iter().sum::<f64>() / n;
    if avg <= 0.0 {
        return 0.0;
    }
    rates.iter().map(|r| (r - avg).abs()).sum::<f64>() / (avg * n)
}

fn summarize(h: &Histogram<u64>, unit_ns: f64) -> LatencySummary {
    if h.is_empty() {
        return LatencySummary::default();
    }
    let us = |v: u64| v as f64 * unit_ns / 1000.0;
    LatencySummary {
        count: h.len(),
        mean_us: h.mean() * unit_ns / 1000.0,
        p50_us: us(h.value_at_quantile(0.50)),
        p90_us: us(h.value_at_quantile(0.90)),
        p99_us: us(h.value_at_quantile(0.99)),
        p999_us: us(h.value_at_quantile(0.999)),
        max_us: us(h.max()),
    }
}

fn resolve_targets(args: &BenchArgs) -> Result<Vec<SocketAddr>> {
    let mut out = Vec::new();
    for s in &args.server {
        let addr = s
            .to_socket_addrs()
            .with_context(|| format!("bad --server {s:?} (expected HOST:PORT)"))?
            .next()
            .with_context(|| format!("--server {s:?} resolves to nothing"))?;
        if !addr.ip().is_loopback() && !args.allow_non_loopback {
            bail!(
                "refusing to send load to {s} ({addr}): not a loopback address (127.0.0.0/8 or ::1); \
                 pass --allow-non-loopback if you really mean it"
            );
        }
        out.push(addr);
    }
    if out.is_empty() {
        bail!("no --server given");
    }
    Ok(out)
}

fn validate(args: &BenchArgs) -> Result<()> {
    if args.threads == 0 || args.conns == 0 || args.pipeline == 0 {
        bail!("--threads, --conns and --pipeline must be >= 1");
    }
    if args.conns < args.threads {
        bail!("--conns ({}) must be >= --threads ({})", args.conns, args.threads);
    }
    if args.keys == 0 {
        bail!("--keys must be >= 1");
    }
    let min = workload::min_key_size(args.keys);
    if args.key_size < min || args.key_size > 250 {
        bail!("--key-size must be in {min}..=250 for {} keys", args.keys);
    }
    if let Some(m) = args.value_size_max {
        if m < args.value_size {
            bail!("--value-size-max ({m}) must be >= --value-size ({})", args.value_size);
        }
    }
    if args.value_size_max.unwrap_or(args.value_size) > 64 << 20 {
        bail!("values above 64 MiB are not supported");
    }
    if args.multiget == 0 || args.multiget > 10_000 {
        bail!("--multiget must be in 1..=10000");
    }
    if !(0.0..=1.0).contains(&args.read_ratio) {
        bail!("--read-ratio must be in [0, 1]");
    }
    if let Some(r) = args.rate {
        if !(r.is_finite() && r > 0.0) {
            bail!("--rate must be > 0");
        }
    }
    if let Some(d) = args.duration {
        if !(d.is_finite() && d > 0.0) {
            bail!("--duration must be > 0");
        }
    }
    if let Some(s) = &args.rate_sweep {
        parse_sweep(s)?;
    }
    if let Some(t) = args.p99_target_us {
        if !(t.is_finite() && t > 0.0) {
            bail!("--p99-target-us must be > 0");
        }
    }
    let ok = args.drain.is_finite() && args.drain >= 0.0 && args.load_timeout.is_finite() && args.load_timeout > 0.0;
    if !ok {
        bail!("--drain and --load-timeout must be >= 0");
    }
    Ok(())
}

/// `FROM:TO:STEP` (ops/s) into the rates FROM, FROM+STEP, ... up to TO (at most 100).
pub fn parse_sweep(s: &str) -> Result<Vec<f64>> {
    let parts: Vec<f64> = s
        .split(':')
        .map(|p| p.trim().parse::<f64>())
        .collect::<std::result::Result<_, _>>()
        .with_context(|| format!("--rate-sweep {s:?} must be FROM:TO:STEP (ops/s)"))?;
    let [from, to, step] = parts[..] else { bail!("--rate-sweep {s:?} must be FROM:TO:STEP (ops/s)") };
    if !(from.is_finite() && to.is_finite() && step.is_finite() && from > 0.0 && to >= from && step > 0.0) {
        bail!("--rate-sweep {s:?}: need 0 < FROM <= TO and STEP > 0");
    }
    let n = ((to - from) / step + 1e-9).floor() as u64 + 1;
    if n > 100 {
        bail!("--rate-sweep {s:?} has {n} rates; at most 100");
    }
    Ok((0..n).map(|i| from + step * i as f64).collect())
}

fn split(total: u64, parts: usize, i: usize) -> u64 {
    total / parts as u64 + u64::from((i as u64) < total % parts as u64)
}

struct PhaseOutcome {
    results: Vec<ThreadResult>,
    target_names: Vec<String>,
}

/// Run `sources` (one per thread) against `addrs` and gather thread results.
#[allow(clippy::too_many_arguments)]
fn run_threads(
    args: &BenchArgs,
    factory: &dyn DriverFactory,
    sources: Vec<OpSource>,
    duration: Duration,
    quota: Option<u64>,
    rate: Option<f64>,
    label: &str,
    show_progress: bool,
) -> Result<PhaseOutcome> {
    let threads = sources.len();
    let start = Instant::now();
    let abort = Arc::new(AtomicBool::new(false));
    let progress: Vec<Arc<AtomicU64>> = (0..threads).map(|_| Arc::default()).collect();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let bar = if show_progress {
        let b = indicatif::ProgressBar::with_draw_target(
            Some(duration.as_millis() as u64),
            indicatif::ProgressDrawTarget::stdout(),
        );
        b.set_style(
            indicatif::ProgressStyle::with_template("{prefix} [{bar:40}] {elapsed}/{duration} {msg}")
                .expect("template")
                .progress_chars("=> "),
        );
        b.set_prefix(label.to_string());
        b
    } else {
        indicatif::ProgressBar::hidden()
    };
    let outcome = std::thread::scope(|scope| -> Result<PhaseOutcome> {
        let mut handles = Vec::new();
        for (t, source) in sources.into_iter().enumerate() {
            let plan = ThreadPlan {
                slots: split(args.conns as u64, threads, t) as usize,
                pipeline: args.pipeline,
                multiget: args.multiget,
                value_size: (args.value_size, args.value_size_max.unwrap_or(args.value_size).max(args.value_size)),
                quota: quota.map(|q| split(q, threads, t)).unwrap_or(u64::MAX),
                rate: rate.map(|r| r / threads as f64),
                start,
                duration,
                drain: Duration::from_secs_f64(args.drain),
                source,
                seed: args.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(t as u64 * 7919 + 1),
                phase_offset_ns: rate.map(|r| (1e9 / r * t as f64) as u64).unwrap_or(0),
                progress: progress[t].clone(),
                abort: abort.clone(),
            };
            let (tx, abort) = (tx.clone(), abort.clone());
            let h = std::thread::Builder::new()
                .name(format!("bench-{t}"))
                .spawn_scoped(scope, move || -> Result<(ThreadResult, Vec<String>)> {
                    let r = (|| {
                        let spec = DriverSpec {
                            thread: t,
                            slots: plan.slots,
                            max_in_flight: plan.slots * plan.pipeline,
                            args,
                        };
                        let mut d = factory.make(&spec)?;
                        let names = d.target_names();
                        let res = engine::run_thread(d.as_mut(), plan)?;
                        Ok((res, names))
                    })();
                    if r.is_err() {
                        abort.store(true, Ordering::Relaxed);
                    }
                    let _ = tx.send(());
                    r
                })
                .context("spawn client thread")?;
            handles.push(h);
        }
        drop(tx);
        let mut finished = 0;
        while finished < threads {
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(()) => finished += 1,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            }
            let el = start.elapsed();
            let ops: u64 = progress.iter().map(|p| p.load(Ordering::Relaxed)).sum();
            bar.set_position(el.as_millis() as u64);
            bar.set_message(format!("{ops} ops, {:.0} ops/s", ops as f64 / el.as_secs_f64().max(1e-9)));
        }
        bar.finish_and_clear();
        let mut results = Vec::new();
        let mut target_names = Vec::new();
        for h in handles {
            let (r, names) = h.join().map_err(|_| anyhow::anyhow!("client thread panicked"))??;
            results.push(r);
            target_names = names;
        }
        Ok(PhaseOutcome { results, target_names })
    })?;
    Ok(outcome)
}

fn totals_of(results: &[ThreadResult], rate: Option<f64>) -> Totals {
    let mut t = Totals { target_rate: rate, ..Default::default() };
    let mut elapsed = Duration::ZERO;
    for r in results {
        t.ops += r.ops;
        t.gets += r.gets;
        t.sets += r.sets;
        t.get_keys += r.get_keys;
        t.hits += r.hits;
        t.errors += r.errors;
        t.unfinished += r.unfinished;
        t.redirects += r.redirects;
        t.late_ops += r.late;
        t.requests += r.target_requests.iter().sum::<u64>();
        elapsed = elapsed.max(r.elapsed);
    }
    t.misses = t.get_keys.saturating_sub(t.hits);
    let secs = elapsed.as_secs_f64().max(1e-9);
    t.elapsed_s = elapsed.as_secs_f64();
    t.ops_per_sec = t.ops as f64 / secs;
    t.requests_per_sec = t.requests as f64 / secs;
    t.keys_per_sec = (t.get_keys + t.sets) as f64 / secs;
    t.hit_ratio = if t.get_keys > 0 { t.hits as f64 / t.get_keys as f64 } else { 0.0 };
    t
}

fn fmt_lat(name: &str, l: &LatencySummary) -> String {
    format!(
        "  {name:<4} n={:<10} p50={:.1}us p90={:.1}us p99={:.1}us p99.9={:.1}us max={:.1}us",
        l.count, l.p50_us, l.p90_us, l.p99_us, l.p999_us, l.max_us
    )
}

/// Run the benchmark described by `args`: optional load phase, the run, the summary on stdout,
/// `--json` and `--plot` files. With `--plot-only`, only plots the given reports and returns the
/// first of them.
pub fn run(args: BenchArgs) -> Result<BenchReport> {
    if !args.plot_only.is_empty() {
        let out = args.output.clone().context("--plot-only needs -o/--output FILE.svg")?;
        let mut reports = Vec::new();
        for p in &args.plot_only {
            reports.push((label_of(p), load_report(p)?));
        }
        plot(&reports, &out)?;
        if !args.quiet {
            println!("wrote {}", out.display());
        }
        return Ok(reports.swap_remove(0).1);
    }
    validate(&args)?;
    if args.routed {
        if args.null_server {
            bail!("--routed needs an mbal server, not --null-server");
        }
        let servers = resolve_targets(&args)?;
        if servers.len() != 1 {
            bail!("--routed takes exactly one --server (any server of the cluster; the map names the rest)");
        }
        let factory = routed::RoutedFactory::connect(servers[0], args.allow_non_loopback)?;
        return run_with(args, &factory);
    }
    let stub = if args.null_server { Some(stub::StubServer::start().context("start stub server")?) } else { None };
    let servers = match &stub {
        Some(s) => vec![s.addr],
        None => resolve_targets(&args)?,
    };
    let report = run_with(args, &PlainFactory { servers })?;
    drop(stub);
    Ok(report)
}

/// What a [`DriverFactory`] is asked for: the driver of one client thread.
pub struct DriverSpec<'a> {
    /// Client thread index (0..threads).
    pub thread: usize,
    /// Logical clients this thread drives (submit's `slot` is below this).
    pub slots: usize,
    /// Op tokens are below this.
    pub max_in_flight: usize,
    pub args: &'a BenchArgs,
}

/// Makes one [`Driver`] per client thread (inside that thread). The plain mode uses
/// [`PlainFactory`]; the routed mode supplies its own and calls [`run_with`].
pub trait DriverFactory: Sync {
    /// Name recorded in the report (`"plain"`, `"routed"`).
    fn name(&self) -> String;
    fn make(&self, spec: &DriverSpec<'_>) -> Result<Box<dyn Driver>>;
    /// The cluster map, for workloads defined by it (the hot partition). None: not an mbal
    /// server.
    fn cluster_map(&self) -> Result<Option<ClusterMap>> {
        Ok(None)
    }
    /// The main addresses of the mbal servers whose per-worker load to record (`mbal load`).
    fn load_servers(&self) -> Vec<SocketAddr> {
        Vec::new()
    }
}

/// Plain memcached text protocol to these servers (keys spread by `key_hash % n`).
pub struct PlainFactory {
    pub servers: Vec<SocketAddr>,
}

impl DriverFactory for PlainFactory {
    fn name(&self) -> String {
        "plain".into()
    }
    fn make(&self, spec: &DriverSpec<'_>) -> Result<Box<dyn Driver>> {
        Ok(Box::new(PlainDriver::connect(
            &self.servers,
            spec.slots,
            spec.max_in_flight,
            spec.args.key_size,
            spec.args.value_size_max.unwrap_or(spec.args.value_size).max(spec.args.value_size),
        )?))
    }
    fn cluster_map(&self) -> Result<Option<ClusterMap>> {
        routed::fetch_map(self.servers[0]).map(Some)
    }
    fn load_servers(&self) -> Vec<SocketAddr> {
        self.servers.clone()
    }
}

/// Like [`run`] (without `--plot-only` and `--null-server` handling, and without resolving or
/// checking `--server`: that is the factory's business) with drivers from `factory`.
pub fn run_with(args: BenchArgs, factory: &dyn DriverFactory) -> Result<BenchReport> {
    validate(&args)?;
    let show = !args.quiet;
    let started_unix_ms =
        SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
    let phases = match &args.phases {
        Some(p) => workload::parse_phases(p)?,
        None => vec![Phase { workload: args.workload, secs: args.duration.unwrap_or(10.0) }],
    };
    let hot_partition = phases.iter().any(|p| {
        p.workload == WorkloadKind::Hotpart || (p.workload == WorkloadKind::Custom && args.dist == DistKind::Hotpart)
    });
    let mut hot_cachelets = Vec::new();
    let hot_keys = if hot_partition {
        let map = factory
            .cluster_map()
            .context("the hot-partition workload needs the cluster map of an mbal server")?
            .context("the hot-partition workload needs an mbal server (its cluster map)")?;
        hot_cachelets = choose_hot(&map, &args)?;
        Some(Arc::new(workload::hot_partition_keys(map.keyspace(), &hot_cachelets, args.keys, args.key_size)))
    } else {
        None
    };
    let params = WorkloadParams {
        keys: args.keys,
        zipf: args.zipf,
        hot_fraction: args.hot_fraction,
        hot_ops: args.hot_ops,
        read_ratio: args.read_ratio,
        dist: args.dist,
        hot_keys,
    };
    let duration = args.duration.unwrap_or_else(|| phases.iter().map(|p| p.secs).sum());

    // load phase
    let mut load = None;
    if args.load || args.load_only {
        let threads = args.threads as u32;
        let sources = (0..threads).map(|t| OpSource::Load { next: t, step: threads, end: args.keys }).collect();
        let o =
            run_threads(&args, factory, sources, Duration::from_secs_f64(args.load_timeout), None, None, "load", show)?;
        let t = totals_of(&o.results, None);
        if show {
            println!(
                "load: {} keys in {:.2}s ({:.0} sets/s), errors {}, unfinished {}, redirects {}",
                t.sets, t.elapsed_s, t.ops_per_sec, t.errors, t.unfinished, t.redirects
            );
        }
        if t.sets < args.keys as u64 {
            eprintln!("warning: load phase stored only {} of {} keys (--load-timeout)", t.sets, args.keys);
        }
        load = Some(t);
    }

    let mut report = BenchReport {
        tool: format!("mbal-bench {}", env!("CARGO_PKG_VERSION")),
        driver: factory.name(),
        settings: args.clone(),
        phases: phases.clone(),
        started_unix_ms,
        load,
        totals: Totals::default(),
        latency: BTreeMap::new(),
        timeline: Vec::new(),
        balance: Balance::default(),
        client: ClientCost { threads: args.threads, ..Default::default() },
        hot_cachelets,
        sweep: None,
        settled: None,
        server_load: None,
    };

    if !args.load_only {
        let perm = Arc::new(workload::scramble_permutation(args.keys, 0x6d62_616c));
        let make_sources = || -> Result<Vec<OpSource>> {
            let mut sources = Vec::new();
            for _ in 0..args.threads {
                let mut ph = Vec::new();
                let mut end = 0.0;
                for p in &phases {
                    end += p.secs;
                    let mix = workload::mix_of(p.workload, &params);
                    ph.push((end, mix.read_ratio, KeyGen::new(mix.dist, &params, perm.clone())?));
                }
                sources.push(OpSource::Mix { phases: ph });
            }
            Ok(sources)
        };
        let rates: Vec<Option<f64>> = match &args.rate_sweep {
            Some(s) => parse_sweep(s)?.into_iter().map(Some).collect(),
            None => vec![args.rate],
        };
        // The servers' own per-worker load, read in side threads (bounded wait to catch up
        // with their history: at most one epoch in practice).
        let wanted = match args.server_load {
            ServerLoadMode::Auto => factory.name() == "routed",
            ServerLoadMode::On => true,
            ServerLoadMode::Off => false,
        };
        let watch = match !wanted {
            true => None,
            false => {
                let servers = factory.load_servers();
                (!servers.is_empty()).then(|| {
                    let w = serverload::LoadWatch::start(&servers);
                    w.wait_caught_up(Duration::from_secs(5));
                    w
                })
            }
        };
        let run_start = Instant::now();
        let mut sweep =
            args.rate_sweep.as_ref().map(|_| Sweep { p99_target_us: args.p99_target_us, ..Sweep::default() });
        let mut timeline = Vec::new();
        let mut windows = Vec::new();
        let mut misses = 0;
        for (i, rate) in rates.iter().enumerate() {
            let label = match rate {
                Some(r) if sweep.is_some() => format!("run {}/{} at {r:.0}/s", i + 1, rates.len()),
                _ => "run".to_string(),
            };
            let from = run_start.elapsed().as_secs_f64();
            let o = run_threads(
                &args,
                factory,
                make_sources()?,
                Duration::from_secs_f64(duration),
                args.max_ops,
                *rate,
                &label,
                show,
            )?;
            windows.push((from, run_start.elapsed().as_secs_f64()));
            fill_report(&mut report, &o, &phases, *rate);
            let Some(sw) = &mut sweep else { continue };
            // This rate's seconds, on the run's time axis.
            let offset = from.floor() as u32;
            for mut sec in std::mem::take(&mut report.timeline) {
                sec.t = (offset + sec.t).max(timeline.last().map(|l: &SecondStats| l.t + 1).unwrap_or(0));
                sec.phase = format!("{}@{:.0}", sec.phase, rate.unwrap_or(0.0));
                timeline.push(sec);
            }
            let all = report.latency.get("all").cloned().unwrap_or_default();
            let t = &report.totals;
            let ok = t.unfinished == 0 && t.errors == 0;
            let meets = ok && args.p99_target_us.is_some_and(|target| all.p99_us <= target);
            sw.steps.push(SweepStep {
                offered_ops_per_sec: rate.unwrap_or(0.0),
                ops_per_sec: t.ops_per_sec,
                p50_us: all.p50_us,
                p99_us: all.p99_us,
                p999_us: all.p999_us,
                late_ops: t.late_ops,
                unfinished: t.unfinished,
                errors: t.errors,
                max_over_avg: report.balance.max_over_avg,
                server_max_over_avg: None,
                meets_target: meets,
            });
            if meets && sw.max_ops_per_sec_at_target.is_none_or(|m| t.ops_per_sec > m) {
                sw.max_ops_per_sec_at_target = Some(t.ops_per_sec);
                sw.offered_at_target = *rate;
            }
            // Saturated: the target missed and the throughput fell behind the offered rate.
            let saturated = !meets && t.ops_per_sec < 0.9 * rate.unwrap_or(0.0);
            misses = if args.p99_target_us.is_some() && saturated { misses + 1 } else { 0 };
            if misses >= 2 {
                break;
            }
        }
        if let Some(w) = watch {
            let load = w.finish(run_start);
            if let Some(sw) = &mut sweep {
                // Each rate's epochs: those wholly inside its run (50 ms of slack each side).
                for (step, &(from, to)) in sw.steps.iter_mut().zip(&windows) {
                    let inside: Vec<serverload::ServerEpoch> = load
                        .epochs
                        .iter()
                        .filter(|e| e.t_end - e.secs >= from - 0.05 && e.t_end <= to + 0.05)
                        .cloned()
                        .collect();
                    if !inside.is_empty() {
                        step.server_max_over_avg = Some(serverload::worker_means(&inside).1);
                    }
                }
            }
            report.server_load = Some(load);
        }
        if let Some(sw) = sweep {
            report.timeline = timeline;
            report.sweep = Some(sw);
        }
    }
    if show {
        print_summary(&report);
    }
    if let Some(p) = &args.json {
        std::fs::write(p, serde_json::to_vec_pretty(&report)?).with_context(|| format!("write {}", p.display()))?;
    }
    if let Some(p) = &args.plot {
        plot(&[(label_of(args.json.as_deref().unwrap_or(Path::new("run"))), report.clone())], p)?;
    }
    Ok(report)
}

/// The hot partition's cachelets: `--hot-cachelet-ids`, or the first `--hot-cachelets` of the
/// worker that owns cachelet 0.
fn choose_hot(map: &ClusterMap, args: &BenchArgs) -> Result<Vec<u32>> {
    let n = map.cachelet_count();
    if !args.hot_cachelet_ids.is_empty() {
        let mut ids = args.hot_cachelet_ids.clone();
        if let Some(bad) = ids.iter().find(|&&c| c >= n) {
            bail!("--hot-cachelet-ids: cachelet {bad} does not exist (the map has {n})");
        }
        ids.sort_unstable();
        ids.dedup();
        return Ok(ids);
    }
    let k = args.hot_cachelets as usize;
    let (s, w) = map.owner(0);
    let mine = map.cachelets_of(s, w);
    if k == 0 || k > mine.len() {
        bail!("--hot-cachelets must be between 1 and {} (the cachelets of server {s} worker {w})", mine.len());
    }
    Ok(mine[..k].to_vec())
}

/// The seconds from `from` on (rounded up to a whole second) merged: throughput and latency.
fn settled_after(secs: &[SecAcc], from: f64, elapsed: f64) -> Settled {
    let first = from.ceil() as usize;
    let mut acc = SecAcc::new();
    for s in secs.iter().skip(first) {
        acc.merge(s);
    }
    let span = (elapsed - first as f64).max(0.0);
    Settled {
        from_s: first as f64,
        secs: span,
        ops: acc.ops,
        ops_per_sec: if span > 0.0 { acc.ops as f64 / span } else { 0.0 },
        latency: if acc.hist.is_empty() { LatencySummary::default() } else { summarize(&acc.hist, 1000.0) },
    }
}

fn fill_report(report: &mut BenchReport, o: &PhaseOutcome, phases: &[Phase], rate: Option<f64>) {
    let rs = &o.results;
    report.totals = totals_of(rs, rate);
    let mut get = engine::ns_histogram();
    let mut set = engine::ns_histogram();
    let mut secs: Vec<SecAcc> = Vec::new();
    let mut targets = vec![0u64; o.target_names.len()];
    let mut cpu = 0.0;
    for r in rs {
        get.add(&r.get_hist).expect("same bounds");
        set.add(&r.set_hist).expect("same bounds");
        if secs.len() < r.seconds.len() {
            secs.resize_with(r.seconds.len(), SecAcc::new);
        }
        for (a, b) in secs.iter_mut().zip(&r.seconds) {
            a.merge(b);
        }
        for (a, b) in targets.iter_mut().zip(&r.target_requests) {
            *a += b;
        }
        cpu += r.cpu_secs;
    }
    // a trailing sliver (< 0.25 s: replies drained after the end) joins the previous second
    if secs.len() >= 2 && report.totals.elapsed_s - ((secs.len() - 1) as f64) < 0.25 {
        let last = secs.pop().expect("len >= 2");
        secs.last_mut().expect("len >= 1").merge(&last);
    }
    let mut all = get.clone();
    all.add(&set).expect("same bounds");
    for (name, h) in [("get", &get), ("set", &set), ("all", &all)] {
        if !h.is_empty() {
            report.latency.insert(name.into(), summarize(h, 1.0));
        }
    }
    let elapsed = report.totals.elapsed_s;
    report.settled = report.settings.settle.map(|from| settled_after(&secs, from.max(0.0), elapsed));
    let n_secs = secs.len();
    report.timeline = secs
        .iter()
        .enumerate()
        .map(|(t, s)| {
            let span = if t + 1 == n_secs { (elapsed - t as f64).clamp(0.25, 1.25) } else { 1.0 };
            let l = summarize(&s.hist, 1000.0);
            // Requests per target in second t: the change of each thread's counts over it
            // (the last second runs to the end: the trailing sliver was merged into it).
            let mut per_target = vec![0u64; targets.len()];
            for r in rs {
                let at = |i: usize| r.target_seconds.get(i).unwrap_or(&r.target_requests);
                let end = if t + 1 == n_secs { &r.target_requests } else { at(t) };
                let start = if t == 0 { None } else { Some(at(t - 1)) };
                for (j, acc) in per_target.iter_mut().enumerate() {
                    let e = end.get(j).copied().unwrap_or(0);
                    let s0 = start.and_then(|s| s.get(j).copied()).unwrap_or(0);
                    *acc += e.saturating_sub(s0);
                }
            }
            SecondStats {
                t: t as u32,
                phase: phases[workload::phase_at(phases, t as f64 + 0.5)].workload.name().into(),
                ops: s.ops,
                gets: s.gets,
                sets: s.sets,
                keys: s.keys,
                hits: s.hits,
                errors: s.errors,
                ops_per_sec: s.ops as f64 / span,
                keys_per_sec: s.keys as f64 / span,
                p50_us: l.p50_us,
                p90_us: l.p90_us,
                p99_us: l.p99_us,
                max_us: l.max_us,
                targets: per_target,
            }
        })
        .collect();
    let n = targets.len().max(1) as f64;
    let avg = targets.iter().sum::<u64>() as f64 / n;
    let max = targets.iter().copied().max().unwrap_or(0);
    report.balance = Balance {
        targets: o
            .target_names
            .iter()
            .zip(&targets)
            .map(|(name, &requests)| TargetStats { name: name.clone(), requests })
            .collect(),
        max_requests: max,
        avg_requests: avg,
        max_over_avg: if avg > 0.0 { max as f64 / avg } else { 0.0 },
        imbalance_factor: imbalance_factor(&targets.iter().map(|&x| x as f64).collect::<Vec<_>>()),
    };
    report.client = ClientCost {
        threads: rs.len(),
        cpu_secs: cpu,
        ops_per_cpu_sec: if cpu > 0.0 { report.totals.ops as f64 / cpu } else { 0.0 },
    };
}

fn print_summary(r: &BenchReport) {
    if r.settings.load_only {
        return;
    }
    let t = &r.totals;
    let mut line =
        format!("run: {:.2}s ops={} {:.0} ops/s, {:.0} req/s", t.elapsed_s, t.ops, t.ops_per_sec, t.requests_per_sec);
    if r.settings.multiget > 1 {
        line += &format!(", {:.0} keys/s", t.keys_per_sec);
    }
    if let Some(rate) = t.target_rate {
        line += &format!(" (target {rate:.0} ops/s, {} sent late)", t.late_ops);
    }
    line += &format!(", hit ratio {:.4}, errors {}", t.hit_ratio, t.errors);
    if r.driver == "routed" || t.redirects > 0 {
        line += &format!(", redirects {}", t.redirects);
    }
    if t.unfinished > 0 {
        line += &format!(", UNFINISHED {}", t.unfinished);
    }
    println!("{line}");
    for (name, l) in &r.latency {
        if name != "all" {
            println!("{}", fmt_lat(name, l));
        }
    }
    if r.balance.targets.len() > 1 {
        println!(
            "  targets: max/avg {:.3}, imbalance factor {:.4}",
            r.balance.max_over_avg, r.balance.imbalance_factor
        );
    }
    println!(
        "  client: {} thread(s), {:.2} CPU-s, {:.0} ops per client-CPU-second",
        r.client.threads, r.client.cpu_secs, r.client.ops_per_cpu_sec
    );
    if !r.hot_cachelets.is_empty() {
        println!("  hot partition: cachelets {:?}, {:.0}% of ops", r.hot_cachelets, r.settings.hot_ops * 100.0);
    }
    if let Some(l) = &r.server_load {
        if !l.workers.is_empty() {
            let avg = l.workers.iter().map(|w| w.1).sum::<f64>() / l.workers.len() as f64;
            let (name, max) = l.workers.iter().fold(("", 0.0f64), |m, w| if w.1 > m.1 { (&w.0, w.1) } else { m });
            println!(
                "  server workers ({} epochs): max {max:.0} req/s ({name}), avg {avg:.0} req/s, max/avg {:.3}, moves {}, escalations {}",
                l.epochs.len(),
                l.max_over_avg,
                l.events.iter().filter(|e| e.kind == "move").count(),
                l.events.iter().filter(|e| e.kind == "escalate").count()
            );
        }
    }
    if let Some(st) = &r.settled {
        println!(
            "  after {:.0} s (settle): {} ops in {:.1} s, {:.0} ops/s, p50 {:.0} us, p99 {:.0} us, p99.9 {:.0} us",
            st.from_s, st.ops, st.secs, st.ops_per_sec, st.latency.p50_us, st.latency.p99_us, st.latency.p999_us
        );
    }
    if let Some(sw) = &r.sweep {
        println!(
            "  sweep: offered ops/s -> ops/s, p50/p99/p99.9 us, late, unfinished, targets max/avg, server max/avg"
        );
        for st in &sw.steps {
            let server = st.server_max_over_avg.map(|m| format!("{m:.3}")).unwrap_or_else(|| "-".into());
            println!(
                "  {:>10.0} -> {:>10.0}  {:>9.1} {:>9.1} {:>9.1}  {:>8} {:>6}  {:.3}  {server}{}",
                st.offered_ops_per_sec,
                st.ops_per_sec,
                st.p50_us,
                st.p99_us,
                st.p999_us,
                st.late_ops,
                st.unfinished,
                st.max_over_avg,
                if st.meets_target { "  ok" } else { "" }
            );
        }
        match (sw.p99_target_us, sw.max_ops_per_sec_at_target) {
            (Some(t), Some(m)) => println!(
                "  max throughput at p99 <= {t:.0}us: {m:.0} ops/s (offered {:.0})",
                sw.offered_at_target.unwrap_or(0.0)
            ),
            (Some(t), None) => println!("  max throughput at p99 <= {t:.0}us: none of the rates met it"),
            (None, _) => {}
        }
    }
}

fn label_of(p: &Path) -> String {
    p.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "run".into())
}

/// Read a `--json` report.
pub fn load_report(p: &Path) -> Result<BenchReport> {
    let b = std::fs::read(p).with_context(|| format!("read {}", p.display()))?;
    serde_json::from_slice(&b).with_context(|| format!("parse {}", p.display()))
}

#[cfg(test)]
mod tests;
