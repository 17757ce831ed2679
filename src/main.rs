//! `mbal`: the one binary. Subcommands: `server`, `bench`, `cluster up`.

mod cluster_up;

use anyhow::Result;
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
    Server(mbal_server::config::ServerArgs),
    /// Generate load against memcached-protocol servers and report throughput and latency
    Bench(mbal_bench::BenchArgs),
    /// Local clusters
    #[command(subcommand)]
    Cluster(ClusterCmd),
}

#[derive(Subcommand)]
enum ClusterCmd {
    /// Start N servers x W workers on loopback, write the cluster file, stop them all on Ctrl-C
    Up(cluster_up::UpArgs),
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Server(args) => {
            let settings = args.resolve()?;
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
            let handle = mbal_server::start(settings)?;
            if args.print_ports {
                let workers: Vec<String> = handle.worker_addrs.iter().map(|a| format!("\"{a}\"")).collect();
                println!("{{\"main\":\"{}\",\"workers\":[{}]}}", handle.main_addr, workers.join(","));
            }
            let stopper = handle_stopper(&handle);
            ctrlc::set_handler(stopper)?;
            handle.wait();
            Ok(())
        }
        Cmd::Bench(args) => {
            mbal_bench::run(args)?;
            Ok(())
        }
        Cmd::Cluster(ClusterCmd::Up(args)) => cluster_up::run(args),
    }
}

/// A closure that asks the server to stop (for SIGINT/SIGTERM).
fn handle_stopper(h: &mbal_server::ServerHandle) -> impl Fn() + Send + 'static {
    let h = h.stop_token();
    move || h.stop()
}
