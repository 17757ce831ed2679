//! `mbal bench`'s command line (`BenchArgs`, declared once with clap and
//! serde: see docs/design-notes.md "clap and anyhow stay in the binaries")
//! and its checks.

use super::*;

/// A client's TLS flags (`mbal bench`, `mbal stats`): given `--tls-ca`, every connection is TLS.
#[derive(clap::Args, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TlsArgs {
    /// Talk TLS, trusting the CA certificates in this PEM file
    #[arg(long = "tls-ca", value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// Client certificate (PEM chain) for servers that require one (`ssl_verify_mode` 1..3)
    #[arg(long = "tls-cert", value_name = "FILE", requires = "tls_ca")]
    pub tls_cert: Option<PathBuf>,
    /// The client certificate's private key [default: in --tls-cert]
    #[arg(long = "tls-key", value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// The name the servers' certificates must carry [default: the IP address connected to]
    #[arg(long = "tls-server-name", value_name = "NAME", requires = "tls_ca")]
    pub tls_server_name: Option<String>,
}

impl TlsArgs {
    /// The TLS configuration the flags describe; `None` without `--tls-ca`.
    pub fn load(&self) -> Result<Option<mbal_tls::ClientTls>> {
        let Some(ca) = &self.tls_ca else {
            if self.tls_cert.is_some() || self.tls_key.is_some() || self.tls_server_name.is_some() {
                bail!("--tls-cert, --tls-key and --tls-server-name need --tls-ca");
            }
            return Ok(None);
        };
        let files = mbal_tls::ClientTlsFiles {
            ca_cert: ca.clone(),
            cert: self.tls_cert.clone(),
            key: self.tls_key.clone(),
            server_name: self.tls_server_name.clone(),
        };
        Ok(Some(mbal_tls::ClientTls::load(&files).map_err(|e| anyhow::anyhow!("TLS: {e}"))?))
    }
}

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
    /// TLS to every server (`--tls-ca FILE [--tls-cert F --tls-key F] [--tls-server-name N]`).
    #[command(flatten)]
    #[serde(default)]
    pub tls: TlsArgs,
    /// Username for servers started with -Y: every connection authenticates first with
    /// memcached's ASCII auth (needs --password-file)
    #[arg(long, requires = "password_file")]
    pub user: Option<String>,
    /// File holding the password of --user (trailing whitespace ignored)
    #[arg(long, requires = "user")]
    pub password_file: Option<std::path::PathBuf>,
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
    /// Variable key lengths: each key's length is in [--key-size, --key-size-max], fixed per
    /// key (a hash of its index), so loads and reads agree.
    #[arg(long)]
    pub key_size_max: Option<usize>,
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
    /// client sleeps until an op is due (to the microsecond, a timer) and sends what is due
    /// within 50 µs in one batch. Without it: closed loop.
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

pub(crate) fn validate(args: &BenchArgs) -> Result<()> {
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
    if let Some(m) = args.key_size_max {
        if m < args.key_size || m > 250 {
            bail!("--key-size-max ({m}) must be in --key-size ({})..=250", args.key_size);
        }
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

impl BenchArgs {
    /// The key lengths `--key-size` and `--key-size-max` ask for.
    pub fn key_sizes(&self) -> crate::workload::KeySize {
        crate::workload::KeySize { min: self.key_size, max: self.key_size_max.unwrap_or(self.key_size) }
    }
}
