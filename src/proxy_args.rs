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
    /// The cluster's coordinators (comma-separated or repeated): the map is fetched from them,
    /// at the start and whenever it is needed (a server failed, a redirect named a newer
    /// epoch), and from a server only when none answers [default with --cluster: the
    /// cluster file's coordinators]
    #[arg(long, value_delimiter = ',')]
    pub coordinator: Vec<SocketAddr>,
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
    /// An upstream request unanswered this long drops its connection: its server is
    /// unreachable (reads miss, writes get SERVER_ERROR) for a backoff; also bounds connects
    #[arg(long, default_value_t = 1000)]
    pub upstream_timeout_ms: u64,
    /// Print the listening address as JSON on stdout once listening
    #[arg(long)]
    pub print_ports: bool,
    /// TLS on the listener (memcached's -Z): the certificate and client-certificate policy
    /// come from `-o ssl_chain_cert=FILE,ssl_key=FILE,ssl_ca_cert=FILE,ssl_verify_mode=N`
    #[arg(short = 'Z', long = "enable-ssl")]
    pub enable_ssl: bool,
    /// memcached's -o, the ssl_* options only (comma-separated, repeatable)
    #[arg(short = 'o', long = "extended")]
    pub extended: Vec<String>,
    /// TLS to the servers with --server (`--tls-ca FILE [--tls-cert F --tls-key F]
    /// [--tls-server-name N]`) [default with --cluster: the cluster file's [tls]]
    #[command(flatten)]
    pub tls: mbal_bench::TlsArgs,
    /// The user the proxy logs in as on servers started with -Y (ASCII auth on text
    /// upstreams, SASL PLAIN on binary ones)
    #[arg(long, requires = "password_file")]
    pub user: Option<String>,
    /// The file holding that user's password (trailing line end ignored)
    #[arg(long, requires = "user")]
    pub password_file: Option<PathBuf>,
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
    pub(crate) fn resolve(&self) -> Result<(Config, ClusterMap, Vec<String>)> {
        let user = match (&self.user, &self.password_file) {
            (Some(u), Some(f)) => {
                let p = std::fs::read_to_string(f).with_context(|| format!("--password-file {}", f.display()))?;
                let password = p.trim_end_matches(['\r', '\n']).to_string();
                if u.contains(' ') || password.contains(' ') || u.is_empty() {
                    bail!("--user and the password may not contain spaces (memcached's ASCII auth)");
                }
                Some(mbal_member::dial::UserLogin { user: u.clone(), password })
            }
            _ => None,
        };
        let login = user.as_ref().map(|u| mbal_client::Login { user: u.user.clone(), password: u.password.clone() });
        let cfg = mbal_client::Config { tls: self.tls.load()?, login, ..mbal_client::Config::default() };
        let (map, upstream_tls) = match (&self.cluster, &self.server) {
            (Some(p), _) => {
                // Upstream TLS: --tls-ca if given, else the cluster file's [tls].
                let c = mbal_client::Client::from_cluster_file(p, cfg)?;
                (c.map().clone(), c.config().tls.clone())
            }
            (None, Some(a)) => {
                let tls = cfg.tls.clone();
                (mbal_client::Client::connect(*a, cfg)?.map().clone(), tls)
            }
            (None, None) => bail!("give --cluster FILE or --server HOST:PORT"),
        };
        let (tls_files, mut notes) = crate::server_args::ServerArgs::proxy_tls(self.enable_ssl, &self.extended)?;
        let mut map = map;
        let mut addrs = self.coordinator.clone();
        if addrs.is_empty() {
            if let Some(p) = &self.cluster {
                addrs = mbal_member::ClusterFile::load(p).map_err(anyhow::Error::msg)?.spec.coordinators;
            }
        }
        let coordinators = (!addrs.is_empty()).then(|| mbal_proxy::coord::Coordinators {
            addrs,
            tls: upstream_tls.clone(),
            timeout: Duration::from_millis(self.upstream_timeout_ms.max(1)),
        });
        if let Some(c) = &coordinators {
            // The coordinator's map is the cluster's: newer than the file's initial one.
            let fetched = c
                .fetch()
                .map_err(|e| e.to_string())
                .and_then(|json| ClusterMap::from_json(&String::from_utf8_lossy(&json)));
            match fetched {
                Ok(m) if m.epoch() >= map.epoch() => map = m,
                Ok(_) => {}
                Err(e) => notes.push(format!(
                    "no coordinator answered mbal map ({e}): starting from the {} map",
                    if self.cluster.is_some() { "cluster file's" } else { "server's" }
                )),
            }
        }
        let tls = match tls_files {
            Some(f) => Some(std::sync::Arc::new(mbal_tls::ServerTls::new(f).map_err(|e| anyhow::anyhow!("TLS: {e}"))?)),
            None => None,
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
            tls,
            dialer: mbal_member::dial::Dialer {
                tls: upstream_tls,
                secret: None,
                user,
                timeout: Duration::from_millis(self.upstream_timeout_ms),
            },
            coordinators,
            ..Config::new(SocketAddr::new(ip, self.port))
        };
        Ok((cfg, map, notes))
    }
}
