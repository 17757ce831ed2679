//! Stand-alone `mbal-bench` (same as `mbal bench`): parses [`mbal_bench::BenchArgs`] and runs.

use clap::Parser;

#[derive(Parser)]
#[command(name = "mbal-bench", about = "YCSB-style load generator for memcached-protocol servers")]
struct Cli {
    #[command(flatten)]
    args: mbal_bench::BenchArgs,
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = mbal_bench::run(cli.args) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
