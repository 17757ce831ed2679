//! What a bench run reports: the JSON types (`BenchReport` and its parts),
//! latency summaries, the imbalance factor, the text summary, and reading a
//! saved report back.

use super::*;

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
    /// Reads served by a copy of a hot key, under a lease from its home (routed mode, Phase 1).
    pub replica_reads: u64,
    /// Reads sent to a copy that answered `RD` or an error, and were resent home.
    pub replica_fallbacks: u64,
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
    /// Open loop: ops sent in this second more than 1 ms after their intended time (the client
    /// fell behind; their latency counts from the intended time).
    pub late_ops: u64,
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
    /// When this rate's run began, seconds on the run's time axis (its seconds in `timeline`
    /// are numbered from the whole second below it).
    pub from_s: f64,
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
    /// When the measured run began (after the load phase and the wait for the servers' load
    /// history): t = 0 of `timeline` and of `server_load`, in Unix milliseconds, to line the
    /// run up with other records of the machine (`scripts/lib/machine_monitor.py`).
    #[serde(default)]
    pub run_started_unix_ms: u64,
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

pub(crate) fn summarize(h: &Histogram<u64>, unit_ns: f64) -> LatencySummary {
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

fn fmt_lat(name: &str, l: &LatencySummary) -> String {
    format!(
        "  {name:<4} n={:<10} p50={:.1}us p90={:.1}us p99={:.1}us p99.9={:.1}us max={:.1}us",
        l.count, l.p50_us, l.p90_us, l.p99_us, l.p999_us, l.max_us
    )
}

pub(crate) fn print_summary(r: &BenchReport) {
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
    if r.driver == "routed" || t.replica_reads + t.replica_fallbacks > 0 {
        line += &format!(", replica reads {} (fallbacks {})", t.replica_reads, t.replica_fallbacks);
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

pub(crate) fn label_of(p: &Path) -> String {
    p.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "run".into())
}

/// Read a `--json` report.
pub fn load_report(p: &Path) -> Result<BenchReport> {
    let b = std::fs::read(p).with_context(|| format!("read {}", p.display()))?;
    serde_json::from_slice(&b).with_context(|| format!("parse {}", p.display()))
}
