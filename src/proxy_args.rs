//! `mbal proxy`'s command line: memcached's listening flags, the cluster to
//! route to, and the resolution into the proxy library's plain `Config` and
//! the initial cluster map (clap and anyhow stay in the binary; see
//! docs/design-notes.md).

use anyhow::{bail, Context, Result};
use mbal_cluster::ClusterMap;
use mbal_proxy::Config;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// `mbal proxy` command line (memcached's listening flags).
#[derive(clap::Args, Clone, Debug)]
pub(crate) struct ProxyArgs {
    /// The cluster file (the initial map; redirects and `mbal map` teach later changes)
    #[arg(long, conflicts_with = "server")]
    pub cluster: Option<PathBuf>,
    /// Any server of the cluster: the map is fetched from it with `mbal map`
    #[arg(long)]
    pub server: Option<SocketAddr>,
    /// TCP port to listen on
    #[arg(short = 'p', long = "port", default_value_t = 11211)]
    pub port: u16,
    /// Interface to listen on
    #[arg(short = 'l', long = "listen", default_value = "0.0.0.0")]
    pub listen: String,
    /// Threads (each with its own event loop, listener and upstream connections)
    #[arg(short = 't', long = "threads", default_value_t = 4)]
    pub threads: usize,
    /// Most simultaneous client connections
    #[arg(short = 'c', long = "conn-limit", default_value_t = 1024)]
    pub conns: usize,
    /// Largest value accepted (bytes; k and m suffixes), as the servers' -I
    #[arg(short = 'I', long = "max-item-size", default_value = "1m")]
    pub max_item_size: String,
    /// An upstream request unanswered this long fails (SERVER_ERROR) and drops its connection
    #[arg(long, default_value_t = 1000)]
    pub upstream_timeout_ms: u64,
    /// Print the listening address as JSON on stdout once listening
    #[arg(long)]
    pub print_ports: bool,
}

fn parse_size(s: &str) -> Result<usize> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('k' | 'K') => (&s[..s.len() - 1], 1 << 10),
        Some('m' | 'M') => (&s[..s.len() - 1], 1 << 20),
        _ => (s, 1),
    };
    let n: usize = num.parse().with_context(|| format!("bad size {s:?}"))?;
    Ok(n * mul)
}

impl ProxyArgs {
    /// The settings and the initial map (read from the file or fetched).
    pub(crate) fn resolve(&self) -> Result<(Config, ClusterMap)> {
        let cfg = mbal_client::Config::default();
        let map = match (&self.cluster, &self.server) {
            (Some(p), _) => mbal_client::Client::from_cluster_file(p, cfg)?.map().clone(),
            (None, Some(a)) => mbal_client::Client::connect(*a, cfg)?.map().clone(),
            (None, None) => bail!("give --cluster FILE or --server HOST:PORT"),
        };
        let ip: std::net::IpAddr = self.listen.parse().with_context(|| format!("bad -l address {:?}", self.listen))?;
        if self.threads == 0 || self.threads > 256 {
            bail!("-t must be between 1 and 256");
        }
        if self.upstream_timeout_ms == 0 {
            bail!("--upstream-timeout-ms must be at least 1");
        }
        let max_item_size = parse_size(&self.max_item_size)?;
        if !(1024..=1 << 30).contains(&max_item_size) {
            bail!("-I must be between 1k and 1024m");
        }
        let cfg = Config {
            threads: self.threads,
            max_conns: self.conns.max(1),
            max_item_size,
            upstream_timeout: Duration::from_millis(self.upstream_timeout_ms),
            ..Config::new(SocketAddr::new(ip, self.port))
        };
        Ok((cfg, map))
    }
}
