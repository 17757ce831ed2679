//! `mbal`: the one binary. Subcommands: `server`, `coordinator`, `proxy`, `bench`, `cluster up`,
//! `cluster members`, `sim`, `stats`, `top`.

mod cluster_moves;
mod cluster_up;
mod coordinator_args;
mod metrics;
mod proxy_args;
mod server_args;
mod top;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "mbal", version, about = "memcached-compatible cache with per-core cachelets and load balancing")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a cache server (memcached's flags work: -p -l -t -m -c -I -M -C -F -U 0 -B -R -A -v -o)
    Server(Box<server_args::ServerArgs>),
    /// Route unmodified memcached clients (text, meta, binary) to an mbal cluster (memcached's -p -l -t -c -I)
    Proxy(Box<proxy_args::ProxyArgs>),
    /// Own the cluster map: servers register and beat; a silent server's cachelets are reassigned
    Coordinator(coordinator_args::CoordinatorArgs),
    /// Generate load against memcached-protocol servers and report throughput and latency
    Bench(Box<mbal_bench::BenchArgs>),
    /// Simulate S servers x W workers, each running the servers' own policy core, and report
    /// per-epoch load, imbalance and delay, balancer off and on
    Sim(Box<mbal_sim::SimArgs>),
    /// Local clusters
    #[command(subcommand)]
    Cluster(ClusterCmd),
    /// Cluster-wide table, per server and per worker: ops/s, hit ratio, items, bytes, cachelets
    Stats(StatsArgs),
    /// Live view of a cluster, every epoch: per-worker load, hot keys and their replicas, balancer events
    Top(top::TopArgs),
}

#[derive(clap::Args)]
struct StatsArgs {
    /// Any server of the cluster (the map is fetched from it)
    #[arg(long, conflicts_with = "cluster")]
    server: Option<std::net::SocketAddr>,
    /// The cluster file
    #[arg(long)]
    cluster: Option<std::path::PathBuf>,
    /// Seconds between the two samples that ops/s is computed from
    #[arg(long, default_value_t = 1.0)]
    interval: f64,
    /// Print a new table every interval, this many times (0: once)
    #[arg(long, default_value_t = 0)]
    watch: u32,
    /// TLS to the servers (`--tls-ca FILE [--tls-cert F --tls-key F] [--tls-server-name N]`)
    #[command(flatten)]
    tls: mbal_bench::TlsArgs,
}

#[derive(Subcommand)]
enum ClusterCmd {
    /// Start N servers x W workers on loopback, write the cluster file, stop them all on Ctrl-C
    Up(Box<cluster_up::UpArgs>),
    /// The members table of a cluster's coordinator (id, address, up/down/left, cachelets, last beat)
    Members(coordinator_args::MembersArgs),
    /// Take a server out of the cluster: the coordinator gives its cachelets to the others
    /// (empty; the server drops them and serves nothing)
    Leave(cluster_up::LeaveArgs),
    /// Move a cachelet to another server with its items (SERVER:WORKER), and wait for the end
    Move(cluster_moves::MoveArgs),
    /// The moves the coordinator runs or queued, and the last ones (in flight, done, failed)
    Moves(cluster_moves::Target),
    /// Move every cachelet of a server to the others with their items, then take it out
    RemoveServer(cluster_moves::RemoveArgs),
    /// Give every server its share of the cachelets, moved with their items (after adding servers)
    Rebalance(cluster_moves::RebalanceArgs),
    /// Start a server on this host that joins the cluster warm (its share moves to it with the items)
    AddServer(cluster_moves::AddArgs),
}

/// An error that stops the program is one line on stderr (`mbal: ...`, the
/// causes joined with `: `) and exit status 1 — never a backtrace, whatever
/// RUST_BACKTRACE says; so is a command-line error (clap's usage text stays
/// for `--help`). A panic, which is a bug, keeps Rust's default report.
fn main() {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => e.exit(), // --help, --version: stdout, status 0
        Err(e) => {
            let text = e.to_string();
            let first = text.lines().next().unwrap_or("bad command line");
            let first = first.strip_prefix("error: ").unwrap_or(first);
            eprintln!("mbal: {first} (see --help)");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(cli) {
        eprintln!("mbal: {}", one_line(&e));
        std::process::exit(1);
    }
}

/// An error and its causes on one line.
fn one_line(e: &anyhow::Error) -> String {
    let text = format!("{e:#}");
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Server(args) => {
            if args.print_config {
                print!("{}", server_args::default_config_file());
                return Ok(());
            }
            let (settings, notes) = args.resolve()?;
            let level = match settings.verbosity {
                0 => "warn",
                1 => "info",
                2 => "debug",
                _ => "trace",
            };
            tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| level.into()))
                .with_writer(std::io::stderr)
                .init();
            for note in notes {
                tracing::warn!("{note}");
            }
            // With TLS, SIGHUP reloads the certificates: block it in every thread (the mask is
            // inherited, so start no thread before this) and take it in one of our own.
            let sighup = if settings.tls.is_some() { Some(block_sighup()?) } else { None };
            let metrics_listen = settings.metrics_listen;
            let handle = mbal_server::start(settings)?;
            let metrics = match metrics_listen {
                Some(addr) => Some(metrics::Metrics::serve(addr, handle.stats_connector())?),
                None => None,
            };
            if let Some(set) = sighup {
                let token = handle.stop_token();
                std::thread::Builder::new().name("mbal-sighup".into()).spawn(move || loop {
                    let mut sig = 0;
                    // SAFETY: `set` is an initialised signal set; `sig` is a valid out pointer.
                    if unsafe { libc::sigwait(&set, &mut sig) } != 0 {
                        return;
                    }
                    match token.reload_tls() {
                        Ok(()) => tracing::warn!("SIGHUP: TLS certificates reloaded"),
                        Err(e) => tracing::error!("SIGHUP: TLS certificates not reloaded (the old ones stay): {e}"),
                    }
                })?;
            }
            if args.print_ports {
                let mut ports = serde_json::json!({ "main": handle.main_addr, "workers": handle.worker_addrs });
                if let Some(m) = metrics {
                    ports["metrics"] = serde_json::json!(m);
                }
                println!("{ports}");
                std::io::Write::flush(&mut std::io::stdout())?;
            }
            let stopper = handle_stopper(&handle);
            ctrlc::set_handler(stopper)?;
            // Under systemd (Type=notify): ready once every listener is bound.
            notify(&[sd_notify::NotifyState::Ready]);
            // A server thread that panicked (or ended on its own): exit non-zero, so that a
            // supervisor (systemd's Restart=on-failure) starts a whole server again.
            handle.wait().map_err(anyhow::Error::msg)
        }
        Cmd::Proxy(args) => {
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
                )
                .with_writer(std::io::stderr)
                .init();
            let (cfg, map, notes) = args.resolve()?;
            for note in notes {
                tracing::warn!("{note}");
            }
            // With TLS, SIGHUP reloads the listener's certificate (as the server's does).
            let reload = match &cfg.tls {
                Some(tls) => Some((block_sighup()?, tls.clone())),
                None => None,
            };
            let handle = mbal_proxy::start(cfg, map).context("mbal proxy")?;
            if let Some((set, tls)) = reload {
                std::thread::Builder::new().name("mbal-sighup".into()).spawn(move || loop {
                    let mut sig = 0;
                    // SAFETY: `set` is an initialised signal set; `sig` is a valid out pointer.
                    if unsafe { libc::sigwait(&set, &mut sig) } != 0 {
                        return;
                    }
                    match tls.reload() {
                        Ok(()) => tracing::warn!("SIGHUP: TLS certificates reloaded"),
                        Err(e) => tracing::error!("SIGHUP: TLS certificates not reloaded (the old ones stay): {e}"),
                    }
                })?;
            }
            if args.print_ports {
                println!("{}", serde_json::json!({ "main": handle.addr }));
            }
            ctrlc::set_handler(handle.stopper())?;
            handle.wait();
            Ok(())
        }
        Cmd::Bench(args) => {
            mbal_bench::run(*args)?;
            Ok(())
        }
        Cmd::Sim(args) => mbal_sim::run(*args),
        Cmd::Coordinator(args) => coordinator_args::run(args),
        Cmd::Cluster(ClusterCmd::Up(args)) => cluster_up::run(*args),
        Cmd::Cluster(ClusterCmd::Members(args)) => coordinator_args::members(args),
        Cmd::Cluster(ClusterCmd::Leave(args)) => cluster_up::leave(args),
        Cmd::Cluster(ClusterCmd::Move(args)) => cluster_moves::move_one(args),
        Cmd::Cluster(ClusterCmd::Moves(args)) => cluster_moves::moves(args),
        Cmd::Cluster(ClusterCmd::RemoveServer(args)) => cluster_moves::remove_server(args),
        Cmd::Cluster(ClusterCmd::Rebalance(args)) => cluster_moves::rebalance(args),
        Cmd::Cluster(ClusterCmd::AddServer(args)) => cluster_moves::add_server(args),
        Cmd::Stats(a) => stats(a),
        Cmd::Top(a) => top::run(a),
    }
}

/// Tell systemd (`Type=notify`) about the service's state; only when started by it
/// (`NOTIFY_SOCKET` set), and an error is only logged.
fn notify(state: &[sd_notify::NotifyState]) {
    if std::env::var_os("NOTIFY_SOCKET").is_some() {
        if let Err(e) = sd_notify::notify(state) {
            tracing::warn!("sd_notify: {e}");
        }
    }
}

/// Block SIGHUP in this thread and in every thread it starts after this;
/// returns the set to `sigwait` on.
fn block_sighup() -> Result<libc::sigset_t> {
    // SAFETY: plain libc calls on a local, zero-initialised signal set.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGHUP);
        let rc = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        if rc != 0 {
            anyhow::bail!("blocking SIGHUP: {}", std::io::Error::from_raw_os_error(rc));
        }
        Ok(set)
    }
}

/// A closure that asks the server to stop (for SIGINT/SIGTERM): the first signal stops it
/// gracefully (docs/operations.md "Stopping"), a second one exits at once (status 1).
fn handle_stopper(h: &mbal_server::ServerHandle) -> impl Fn() + Send + 'static {
    let h = h.stop_token();
    let signals = std::sync::atomic::AtomicUsize::new(0);
    move || {
        if signals.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            tracing::warn!("signal: stopping (a second signal exits at once)");
            notify(&[sd_notify::NotifyState::Stopping]);
            h.stop();
        } else {
            eprintln!("mbal: a second signal: exiting at once");
            std::process::exit(1);
        }
    }
}

fn stats(a: StatsArgs) -> Result<()> {
    use std::time::{Duration, Instant};
    let timeout = Duration::from_secs(5);
    let tls = a.tls.load()?;
    let mut dialer = mbal_member::dial::Dialer::plain(timeout);
    let map = match (&a.server, &a.cluster) {
        (Some(addr), _) => {
            dialer.tls = tls.clone();
            let cfg = mbal_client::Config { tls, ..mbal_client::Config::default() };
            mbal_client::Client::connect(*addr, cfg)?.map().clone()
        }
        (None, Some(p)) => {
            // Without --tls-ca, the cluster file's [tls]; with its secret, the
            // connections log in as a member (servers with -Y require a login).
            let file = mbal_member::ClusterFile::load(p).map_err(anyhow::Error::msg)?;
            dialer.tls = tls.or(file.client_tls);
            dialer.secret = file.secret;
            file.spec.initial_map()
        }
        (None, None) => anyhow::bail!("give --server HOST:PORT or --cluster FILE"),
    };
    if !(0.05..=3600.0).contains(&a.interval) {
        anyhow::bail!("--interval must be between 0.05 and 3600 seconds");
    }
    let mut prev = mbal_client::cluster_stats_dialed(&map, &dialer)?;
    let mut t0 = Instant::now();
    for round in 0..=a.watch {
        std::thread::sleep(Duration::from_secs_f64(a.interval));
        let cur = mbal_client::cluster_stats_dialed(&map, &dialer)?;
        let secs = t0.elapsed().as_secs_f64();
        if round > 0 {
            println!();
        }
        print!("{}", mbal_client::render_stats_table(Some(&prev), &cur, secs));
        prev = cur;
        t0 = Instant::now();
    }
    Ok(())
}
