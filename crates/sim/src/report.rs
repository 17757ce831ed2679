//! What a run reports: one JSON line per epoch, a summary over the settled epochs, and
//! `mbal sim`'s table.

use crate::{simulate, SimArgs};
use anyhow::{Context, Result};
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::Write;
use std::time::Instant;

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
    /// Over the servers (each server's workers summed): max/avg, NetKV's Fig. 17 figure.
    pub servers_max_over_avg: f64,
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
    /// Phase 1: keys with copies (made or being made) and their copies at the epoch's end,
    /// the copies' memory (MB, `--item-bytes` each), the keys sent for copies and the keys
    /// taken out of replication in the epoch, and the requests per second the copies served.
    pub hot_keys: u64,
    pub copies: u64,
    pub copy_mb: f64,
    pub replicated: u64,
    pub retired: u64,
    pub copy_served: f64,
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
    pub servers_max_over_avg: f64,
    pub p99_us: f64,
    pub served: f64,
    pub moves: u64,
    /// Phase 3's migrations finished, and their bytes, over the whole run.
    pub migrations: u64,
    pub migrated_bytes: u64,
    /// Phase 1: keys with copies (settled mean, and the most at any epoch end), the most
    /// copies and their memory (MB), and the share of the requests the copies served
    /// (settled).
    pub hot_keys: f64,
    pub hot_keys_max: u64,
    pub copies_max: u64,
    pub copy_mb_max: f64,
    pub copy_share: f64,
    /// From when every later epoch's max/avg stayed <= 1.15 (seconds; null: never).
    pub settle_time: Option<f64>,
    /// Requests simulated: offered by the clients, and issued within their window.
    pub offered_requests: f64,
    pub requests: f64,
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
        servers_max_over_avg: r2(mean(&|r| r.servers_max_over_avg)),
        p99_us: mean(&|r| r.p99_us).round(),
        served: mean(&|r| r.served).round(),
        moves: recs.iter().map(|r| r.moves_done).sum(),
        migrations: recs.iter().map(|r| r.migrations_done).sum(),
        migrated_bytes: recs.iter().map(|r| r.migrated_bytes).sum(),
        hot_keys: (mean(&|r| r.hot_keys as f64) * 10.0).round() / 10.0,
        hot_keys_max: recs.iter().map(|r| r.hot_keys).max().unwrap_or(0),
        copies_max: recs.iter().map(|r| r.copies).max().unwrap_or(0),
        copy_mb_max: recs.iter().map(|r| r.copy_mb).fold(0.0, f64::max),
        copy_share: r2(mean(&|r| if r.served > 0.0 { r.copy_served / r.served } else { 0.0 })),
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
    let w = results.iter().map(|r| r.summary.run.len()).max().unwrap_or(0).max(8);
    println!(
        "{:<w$} {:>8} {:>8} {:>10} {:>8} {:>12} {:>12} {:>7} {:>9} {:>10} {:>9} {:>9} {:>9} {:>7}",
        "balancer",
        "max/avg",
        "factor",
        "srv max/avg",
        "servers",
        "p99 µs",
        "served/s",
        "moves",
        "settle s",
        "migrations",
        "GB moved",
        "hot keys",
        "copies",
        "copied"
    );
    for r in &results {
        let s = &r.summary;
        println!(
            "{:<w$} {:>8.2} {:>8.3} {:>10.2} {:>8.2} {:>12.0} {:>12.0} {:>7} {:>9} {:>10} {:>9.2} {:>9.1} {:>9} {:>6.1}%",
            s.run,
            s.max_over_avg,
            s.factor,
            s.server_max_over_avg,
            s.servers_max_over_avg,
            s.p99_us,
            s.served,
            s.moves,
            s.settle_time.map_or("-".to_string(), |t| format!("{t:.1}")),
            s.migrations,
            s.migrated_bytes as f64 / 1e9,
            s.hot_keys,
            s.copies_max,
            100.0 * s.copy_share
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
