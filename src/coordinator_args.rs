//! `mbal coordinator` and `mbal cluster members`: the command lines of the
//! coordinator (crates/coordinator) and of its members table.

use anyhow::{Context, Result};
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

#[derive(clap::Args)]
pub struct CoordinatorArgs {
    /// The cluster file: the initial map, the cluster secret (control commands need the
    /// `mbal peer` login with it) and `[tls]` (with a `cert`, the coordinator listens with TLS)
    #[arg(long)]
    pub cluster: PathBuf,
    /// Address to listen on (HOST:PORT; port 0: chosen by the OS, see --print-ports)
    #[arg(long)]
    pub listen: SocketAddr,
    /// Where the map and the members' states are kept (`state.json`, written crash-safely)
    #[arg(long, default_value = mbal_coordinator::server::DEFAULT_DATA_DIR)]
    pub data_dir: PathBuf,
    /// Keep the state in etcd instead of --data-dir: `etcd://HOST:PORT[,HOST:PORT...]`. Several
    /// coordinators may share it: one leads (an etcd lease), the others stand by and take over
    /// when it dies
    #[arg(long)]
    pub store: Option<String>,
    /// With --store etcd://: the keys' prefix [default: /mbal/<hash of the cluster file's map>]
    #[arg(long)]
    pub etcd_prefix: Option<String>,
    /// With --store etcd://: the leadership lease's TTL in seconds (a standby takes over about
    /// this long after the leader dies; etcd may raise it to its minimum)
    #[arg(long, default_value_t = 1)]
    pub etcd_lease_ttl: i64,
    /// With --store etcd://: the address a standby names as the leader's
    /// [default: --listen's, 127.0.0.1 for an unspecified address]
    #[arg(long)]
    pub advertise: Option<SocketAddr>,
    /// Heartbeat interval given to the servers (ms)
    #[arg(long, default_value_t = 100)]
    pub beat_ms: u64,
    /// Lease: a server that has not renewed it this long stops serving (ms; > --beat-ms)
    #[arg(long, default_value_t = 400)]
    pub lease_ms: u64,
    /// A server silent this long is declared down and its cachelets reassigned (ms; > --lease-ms)
    #[arg(long, default_value_t = 600)]
    pub failure_timeout_ms: u64,
    /// Phase 3: move cachelets between servers by load (MBal Algorithm 2) every this many ms,
    /// from the servers' epoch reports; 0: off
    #[arg(long, default_value_t = 1000)]
    pub phase3_epoch_ms: u64,
    /// Print the listening address as JSON (`{"main": "HOST:PORT"}`) on stdout once it listens
    #[arg(long)]
    pub print_ports: bool,
    /// Serve Prometheus metrics over HTTP at http://ADDR/metrics (HOST:PORT; port 0: chosen by
    /// the OS, `"metrics"` in --print-ports); docs/operations.md "Metrics" [default: off]
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<SocketAddr>,
}

pub fn run(a: CoordinatorArgs) -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let file = mbal_member::ClusterFile::load(&a.cluster).map_err(anyhow::Error::msg)?;
    let mut settings = mbal_coordinator::Settings::from_cluster_file(&file, a.listen, a.data_dir.clone())
        .map_err(anyhow::Error::msg)?;
    settings.timing = mbal_coordinator::Timing {
        beat: Duration::from_millis(a.beat_ms),
        lease: Duration::from_millis(a.lease_ms),
        failure_timeout: Duration::from_millis(a.failure_timeout_ms),
    };
    settings.phase3_epoch = (a.phase3_epoch_ms > 0).then(|| Duration::from_millis(a.phase3_epoch_ms));
    settings.timing.validate().map_err(|e| anyhow::anyhow!("{e} (--beat-ms < --lease-ms < --failure-timeout-ms)"))?;
    if let Some(url) = &a.store {
        let mut e = mbal_coordinator::EtcdSettings::from_url(url).map_err(|e| anyhow::anyhow!("--store {e}"))?;
        e.prefix = a.etcd_prefix.clone();
        if a.etcd_lease_ttl < 1 {
            anyhow::bail!("--etcd-lease-ttl must be at least 1 (seconds)");
        }
        e.ttl_secs = a.etcd_lease_ttl;
        settings.etcd = Some(e);
        settings.advertise = a.advertise;
    }
    let handle = mbal_coordinator::start(settings).context("mbal coordinator")?;
    let metrics = match a.metrics_listen {
        Some(addr) => Some(crate::metrics::serve_coordinator(addr, handle.stats_source())?),
        None => None,
    };
    if a.print_ports {
        let mut ports = serde_json::json!({ "main": handle.addr() });
        if let Some(m) = metrics {
            ports["metrics"] = serde_json::json!(m);
        }
        println!("{ports}");
        std::io::stdout().flush()?;
    }
    let (tx, rx) = std::sync::mpsc::channel();
    ctrlc::set_handler(move || {
        let _ = tx.send(());
    })?;
    // Under systemd (Type=notify): ready once it listens.
    crate::notify(&[sd_notify::NotifyState::Ready]);
    let _ = rx.recv();
    crate::notify(&[sd_notify::NotifyState::Stopping]);
    handle.shutdown();
    Ok(())
}

#[derive(clap::Args)]
pub struct MembersArgs {
    /// The coordinator (HOST:PORT)
    #[arg(long)]
    pub coordinator: SocketAddr,
    /// The cluster file, for its `[tls]` (the coordinator's listener speaks TLS when it has one)
    #[arg(long)]
    pub cluster: Option<PathBuf>,
}

/// `mbal cluster members`: the coordinator's members table.
pub fn members(a: MembersArgs) -> Result<()> {
    let mut dialer = mbal_member::dial::Dialer::plain(Duration::from_secs(5));
    if let Some(p) = &a.cluster {
        dialer.tls = mbal_member::ClusterFile::load(p).map_err(anyhow::Error::msg)?.client_tls;
    }
    let s = dialer
        .dial(a.coordinator, mbal_member::dial::Proto::Text)
        .with_context(|| format!("coordinator {}", a.coordinator))?;
    let mut r = BufReader::new(s);
    let mut ask = |req: &str| -> Result<Vec<String>> {
        r.get_mut().write_all(req.as_bytes())?;
        r.get_mut().flush()?;
        let mut lines = Vec::new();
        for _ in 0..100_000 {
            let mut l = String::new();
            if r.read_line(&mut l)? == 0 {
                anyhow::bail!("the coordinator closed the connection");
            }
            let l = l.trim_end().to_string();
            if l == "END" {
                return Ok(lines);
            }
            if l.starts_with("ERROR") || l.contains("_ERROR") {
                anyhow::bail!("coordinator: {l}");
            }
            lines.push(l);
        }
        anyhow::bail!("no END from the coordinator")
    };
    let stats = ask("stats\r\n")?;
    let members = ask("mbal members\r\n")?;
    let stat = |n: &str| stats.iter().find_map(|l| l.strip_prefix(&format!("STAT {n} "))).unwrap_or("?").to_string();
    println!(
        "epoch {}  servers up {}  down {}  left {}",
        stat("epoch"),
        stat("servers_up"),
        stat("servers_down"),
        stat("servers_left")
    );
    println!(
        "{:>4}  {:<22} {:<5} {:>7} {:>9} {:>14}",
        "id", "address", "state", "workers", "cachelets", "ms_since_beat"
    );
    for l in members {
        let f: Vec<&str> = l.split_whitespace().collect();
        match f.as_slice() {
            ["MEMBER", id, addr, state, workers, cachelets, age] => {
                println!("{id:>4}  {addr:<22} {state:<5} {workers:>7} {cachelets:>9} {age:>14}")
            }
            _ => anyhow::bail!("coordinator: unexpected line {l:?}"),
        }
    }
    Ok(())
}
