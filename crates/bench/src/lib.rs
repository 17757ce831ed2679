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

mod args;
mod conns;
pub mod driver;
pub mod engine;
mod plot;
mod report;
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

use args::validate;
pub use args::{parse_sweep, BenchArgs, ServerLoadMode, TlsArgs};
use driver::{Driver, PlainDriver};
use engine::{OpSource, SecAcc, ThreadPlan, ThreadResult};
use mbal_cluster::ClusterMap;
pub use plot::plot;
pub use report::*;
use report::{label_of, print_summary, summarize};
pub use serverload::ServerLoad;
use workload::{DistKind, KeyGen, Phase, WorkloadKind, WorkloadParams};

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
        t.replica_reads += r.replica_reads;
        t.replica_fallbacks += r.replica_fallbacks;
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

/// Run the benchmark described by `args`: optional load phase, the run, the summary on stdout,
/// `--json` and `--plot` files. With `--plot-only`, only plots the given reports and returns the
/// first of them.
pub fn run(args: BenchArgs) -> Result<BenchReport> {
    match (&args.user, &args.password_file) {
        (Some(user), Some(p)) => {
            let text = std::fs::read_to_string(p).with_context(|| format!("--password-file {}", p.display()))?;
            conns::set_login(Some((user, text.trim_end())));
        }
        _ => conns::set_login(None),
    }
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
        let tls = args.tls.load()?;
        let factory = routed::RoutedFactory::connect_tls(servers[0], args.allow_non_loopback, tls)?;
        return run_with(args, &factory);
    }
    let tls = args.tls.load()?;
    if tls.is_some() && args.null_server {
        bail!("--null-server speaks no TLS: drop --tls-ca");
    }
    let stub = if args.null_server { Some(stub::StubServer::start().context("start stub server")?) } else { None };
    let servers = match &stub {
        Some(s) => vec![s.addr],
        None => resolve_targets(&args)?,
    };
    let report = run_with(args, &PlainFactory { servers, tls })?;
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
    /// TLS for the side connections (`mbal load`), as the drivers use it.
    fn tls(&self) -> Option<mbal_tls::ClientTls> {
        None
    }
}

/// Plain memcached text protocol to these servers (keys spread by `key_hash % n`).
pub struct PlainFactory {
    pub servers: Vec<SocketAddr>,
    /// TLS to every server (`--tls-ca`).
    pub tls: Option<mbal_tls::ClientTls>,
}

impl DriverFactory for PlainFactory {
    fn name(&self) -> String {
        "plain".into()
    }
    fn make(&self, spec: &DriverSpec<'_>) -> Result<Box<dyn Driver>> {
        Ok(Box::new(PlainDriver::connect_tls(
            &self.servers,
            self.tls.as_ref(),
            spec.slots,
            spec.max_in_flight,
            spec.args.key_sizes(),
            spec.args.value_size_max.unwrap_or(spec.args.value_size).max(spec.args.value_size),
        )?))
    }
    fn cluster_map(&self) -> Result<Option<ClusterMap>> {
        routed::fetch_map_tls(self.servers[0], self.tls.as_ref()).map(Some)
    }
    fn load_servers(&self) -> Vec<SocketAddr> {
        self.servers.clone()
    }
    fn tls(&self) -> Option<mbal_tls::ClientTls> {
        self.tls.clone()
    }
}

/// The clock now, in Unix milliseconds.
fn unix_ms() -> u64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Like [`run`] (without `--plot-only` and `--null-server` handling, and without resolving or
/// checking `--server`: that is the factory's business) with drivers from `factory`.
pub fn run_with(args: BenchArgs, factory: &dyn DriverFactory) -> Result<BenchReport> {
    validate(&args)?;
    let show = !args.quiet;
    let started_unix_ms = unix_ms();
    let phases = match &args.phases {
        Some(p) => workload::parse_phases(p)?,
        None => vec![Phase { workload: args.workload, secs: args.duration.unwrap_or(10.0), hot_set: 0 }],
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
        Some(Arc::new(workload::hot_partition_keys(map.keyspace(), &hot_cachelets, args.keys, args.key_sizes())))
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
        run_started_unix_ms: 0,
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
        // One permutation per hot set (`NAME@K` phases), shared by every thread.
        let mut perms: BTreeMap<u32, Arc<Vec<u32>>> = BTreeMap::new();
        for p in &phases {
            perms.entry(p.hot_set).or_insert_with(|| {
                Arc::new(workload::scramble_permutation(args.keys, 0x6d62_616c + u64::from(p.hot_set)))
            });
        }
        let make_sources = || -> Result<Vec<OpSource>> {
            let mut sources = Vec::new();
            for _ in 0..args.threads {
                let mut ph = Vec::new();
                let mut end = 0.0;
                for p in &phases {
                    end += p.secs;
                    let mix = workload::mix_of(p.workload, &params);
                    ph.push((end, mix.read_ratio, KeyGen::new(mix.dist, &params, perms[&p.hot_set].clone())?));
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
                    let w = serverload::LoadWatch::start_tls(&servers, factory.tls());
                    w.wait_caught_up(Duration::from_secs(5));
                    w
                })
            }
        };
        let run_start = Instant::now();
        report.run_started_unix_ms = unix_ms();
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
                from_s: from,
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
                late_ops: s.late,
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

#[cfg(test)]
mod tests;
