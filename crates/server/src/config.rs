//! Server settings: memcached's command line, mbal's own options, and a TOML
//! file for all of them. Precedence: command line > config file > defaults.
//!
//! Every memcached option mbal does not implement is still recognised, so that
//! an operator gets a clear "not supported" error instead of clap's generic
//! "unexpected argument" or, worse, a silent ignore.

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Deserialize;
use std::net::IpAddr;
use std::path::PathBuf;

/// Binding protocol (`-B`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Binding {
    Auto,
    Ascii,
    Binary,
}

impl Binding {
    pub fn name(self) -> &'static str {
        match self {
            Binding::Auto => "auto-negotiate",
            Binding::Ascii => "ascii",
            Binding::Binary => "binary",
        }
    }
}

/// The resolved settings of one server process.
#[derive(Clone, Debug)]
pub struct Settings {
    pub port: u16,
    pub listen: IpAddr,
    pub threads: usize,
    pub memory_limit: usize,
    pub max_conns: usize,
    pub max_item_size: usize,
    pub evictions: bool,
    pub cas_enabled: bool,
    pub flush_enabled: bool,
    pub binding: Binding,
    pub reqs_per_event: usize,
    pub shutdown_enabled: bool,
    pub verbosity: u8,
    pub idle_timeout: u32,
    pub backlog: i32,
    /// First per-worker port; worker `i` listens on `worker_port_base + i`.
    /// `None`: `port + 1` (or ephemeral ports when `port` is 0).
    pub worker_port_base: Option<u16>,
    pub cachelets_per_worker: u32,
    pub vn_count: u32,
    pub page_size: usize,
    /// Cluster membership: the cluster description and this server's id in
    /// it. `None`: a stand-alone server (a cluster of one).
    pub cluster: Option<(mbal_cluster::ClusterSpec, u16)>,
    /// Requests one worker may have forwarded to others and not yet had
    /// answered; past it the worker stops reading its connections.
    pub max_inflight: usize,
    /// Accept the `mbal debug ...` test hooks (never in production).
    pub debug_commands: bool,
    /// `-D`: the byte that ends a key's prefix for `stats detail` (memcached's default `:`).
    pub prefix_delimiter: u8,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            port: 11211,
            listen: "127.0.0.1".parse().unwrap(),
            threads: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            memory_limit: 64 << 20,
            max_conns: 1024,
            max_item_size: 1 << 20,
            evictions: true,
            cas_enabled: true,
            flush_enabled: true,
            binding: Binding::Auto,
            reqs_per_event: 20,
            shutdown_enabled: false,
            verbosity: 0,
            idle_timeout: 0,
            backlog: 1024,
            worker_port_base: None,
            cachelets_per_worker: mbal_cluster::DEFAULT_CACHELETS_PER_WORKER,
            vn_count: mbal_cluster::DEFAULT_VN_COUNT,
            page_size: 64 << 10,
            cluster: None,
            max_inflight: 16384,
            debug_commands: false,
            prefix_delimiter: b':',
        }
    }
}

impl Settings {
    /// Take this server's place in a cluster: its address, worker ports,
    /// worker count and key-space geometry come from the cluster file.
    pub fn apply_cluster(&mut self, spec: mbal_cluster::ClusterSpec, id: u16) -> Result<()> {
        spec.validate().map_err(|e| anyhow::anyhow!(e))?;
        let me = spec
            .servers
            .get(id as usize)
            .with_context(|| format!("--id {id}: the cluster has {} servers", spec.servers.len()))?;
        self.port = me.addr.port();
        self.listen = me.addr.ip();
        self.worker_port_base = Some(me.worker_port_base);
        self.threads = spec.workers as usize;
        self.cachelets_per_worker = spec.cachelets_per_worker;
        self.vn_count = spec.vn_count;
        self.cluster = Some((spec, id));
        Ok(())
    }
}

/// `mbal server` command line. Short flags are memcached's.
#[derive(Args, Clone, Debug, Default)]
pub struct ServerArgs {
    /// TCP port of the main (memcached-compatible) listener [default: 11211; 0 = pick one]
    #[arg(short = 'p', long = "port")]
    pub port: Option<u16>,
    /// Interface to listen on [default: 127.0.0.1]
    #[arg(short = 'l', long = "listen")]
    pub listen: Option<IpAddr>,
    /// Number of worker threads [default: number of cores]
    #[arg(short = 't', long = "threads")]
    pub threads: Option<usize>,
    /// Item memory in megabytes [default: 64]
    #[arg(short = 'm', long = "memory-limit")]
    pub memory_limit: Option<usize>,
    /// Max simultaneous connections [default: 1024]
    #[arg(short = 'c', long = "conn-limit")]
    pub conn_limit: Option<usize>,
    /// Max item size, e.g. 1m, 512k, 2097152 [default: 1m]
    #[arg(short = 'I', long = "max-item-size")]
    pub max_item_size: Option<String>,
    /// Return an error when memory is exhausted instead of evicting
    #[arg(short = 'M', long = "disable-evictions")]
    pub disable_evictions: bool,
    /// Disable CAS (cas values are 0, `cas` always fails)
    #[arg(short = 'C', long = "disable-cas")]
    pub disable_cas: bool,
    /// Disable flush_all
    #[arg(short = 'F', long = "disable-flush-all")]
    pub disable_flush_all: bool,
    /// UDP port; only 0 (off) is supported
    #[arg(short = 'U', long = "udp-port")]
    pub udp_port: Option<u16>,
    /// Binding protocol: ascii, binary or auto
    #[arg(short = 'B', long = "protocol")]
    pub protocol: Option<String>,
    /// Max requests processed per connection per event-loop round [default: 20]
    #[arg(short = 'R', long = "max-reqs-per-event")]
    pub reqs_per_event: Option<usize>,
    /// Enable the `shutdown` command
    #[arg(short = 'A', long = "enable-shutdown")]
    pub enable_shutdown: bool,
    /// Verbose logging (-v, -vv, -vvv)
    #[arg(short = 'v', action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// Listen backlog [default: 1024]
    #[arg(short = 'b', long = "listen-backlog")]
    pub backlog: Option<i32>,
    /// Extended options, comma separated; supported: idle_timeout=N
    #[arg(short = 'o', long = "extended")]
    pub extended: Vec<String>,

    /// First per-worker port (worker i listens on base+i) [default: port+1]
    #[arg(long = "worker-port-base")]
    pub worker_port_base: Option<u16>,
    /// Cachelets per worker [default: 16]
    #[arg(long = "cachelets-per-worker")]
    pub cachelets_per_worker: Option<u32>,
    /// Number of virtual nodes in the key space [default: 16384]
    #[arg(long = "vn-count")]
    pub vn_count: Option<u32>,
    /// Item memory page size in KiB [default: 64]
    #[arg(long = "page-size-kb")]
    pub page_size_kb: Option<usize>,
    /// TOML file with any of the settings above (long names, with '_' for '-')
    #[arg(long = "config")]
    pub config: Option<PathBuf>,
    /// Cluster description (TOML: vn_count, cachelets_per_worker, workers, [[servers]] addr,
    /// worker_port_base); with --id, this server serves its part of the cluster's key space
    #[arg(long = "cluster", requires = "id")]
    pub cluster: Option<PathBuf>,
    /// This server's index in the cluster file's servers list
    #[arg(long = "id", requires = "cluster")]
    pub id: Option<u16>,
    /// Print the listening addresses as one JSON line on stdout once ready
    #[arg(long = "print-ports")]
    pub print_ports: bool,
    /// Requests a worker may have passed to other workers and not yet had answered; past it, the
    /// worker stops reading its connections until answers come in [default: 16384]
    #[arg(long = "max-inflight")]
    pub max_inflight: Option<usize>,
    /// Accept the `mbal debug` test hooks (stall a worker); for tests only
    #[arg(long = "enable-debug-commands", hide = true)]
    pub debug_commands: bool,

    // memcached options that mbal recognises but does not implement.
    #[arg(short = 'd', long = "daemon", hide = true)]
    pub x_daemon: bool,
    #[arg(short = 'u', long = "user", hide = true)]
    pub x_user: Option<String>,
    #[arg(short = 's', long = "unix-socket", hide = true)]
    pub x_unix_socket: Option<String>,
    #[arg(short = 'a', long = "unix-mask", hide = true)]
    pub x_unix_mask: Option<String>,
    #[arg(short = 'S', long = "enable-sasl", hide = true)]
    pub x_sasl: bool,
    #[arg(short = 'P', long = "pidfile", hide = true)]
    pub x_pidfile: Option<String>,
    #[arg(short = 'f', long = "slab-growth-factor", hide = true)]
    pub x_factor: Option<String>,
    #[arg(short = 'n', long = "slab-min-size", hide = true)]
    pub x_min_size: Option<String>,
    #[arg(short = 'L', long = "enable-largepages", hide = true)]
    pub x_large_pages: bool,
    /// Key prefix delimiter for `stats detail` [default: ':']
    #[arg(short = 'D')]
    pub x_delimiter: Option<String>,
    #[arg(short = 'k', long = "lock-memory", hide = true)]
    pub x_lock_memory: bool,
    #[arg(short = 'e', long = "memory-file", hide = true)]
    pub x_memory_file: Option<String>,
    #[arg(short = 'r', long = "enable-coredumps", hide = true)]
    pub x_coredumps: bool,
    #[arg(short = 'Y', long = "auth-file", hide = true)]
    pub x_auth_file: Option<String>,
    #[arg(short = 'Z', long = "enable-ssl", hide = true)]
    pub x_ssl: bool,
}

/// The TOML config file: every field optional, names as the long flags.
#[derive(Deserialize, Default, Debug)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub port: Option<u16>,
    pub listen: Option<IpAddr>,
    pub threads: Option<usize>,
    pub memory_limit: Option<usize>,
    pub conn_limit: Option<usize>,
    pub max_item_size: Option<toml::Value>,
    pub disable_evictions: Option<bool>,
    pub disable_cas: Option<bool>,
    pub disable_flush_all: Option<bool>,
    pub udp_port: Option<u16>,
    pub protocol: Option<String>,
    pub max_reqs_per_event: Option<usize>,
    pub enable_shutdown: Option<bool>,
    pub verbosity: Option<u8>,
    pub listen_backlog: Option<i32>,
    pub idle_timeout: Option<u32>,
    pub worker_port_base: Option<u16>,
    pub cachelets_per_worker: Option<u32>,
    pub vn_count: Option<u32>,
    pub page_size_kb: Option<usize>,
    pub max_inflight: Option<usize>,
}

/// Parse a memcached-style size: `1m`, `512k`, `2097152`, `1g`.
pub fn parse_size(s: &str) -> Result<usize> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('k' | 'K') => (&s[..s.len() - 1], 1usize << 10),
        Some('m' | 'M') => (&s[..s.len() - 1], 1 << 20),
        Some('g' | 'G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let n: usize = num.parse().with_context(|| format!("bad size '{s}'"))?;
    n.checked_mul(mult).with_context(|| format!("size '{s}' overflows"))
}

impl ServerArgs {
    /// Resolve command line + config file into settings, rejecting what mbal
    /// does not implement.
    pub fn resolve(&self) -> Result<Settings> {
        self.reject_unsupported()?;
        let file: FileConfig = match &self.config {
            Some(p) => {
                let text =
                    std::fs::read_to_string(p).with_context(|| format!("reading config file {}", p.display()))?;
                toml::from_str(&text).with_context(|| format!("parsing {}", p.display()))?
            }
            None => FileConfig::default(),
        };
        let mut s = Settings::default();
        if let Some(v) = self.port.or(file.port) {
            s.port = v;
        }
        if let Some(v) = self.listen.or(file.listen) {
            s.listen = v;
        }
        if let Some(v) = self.threads.or(file.threads) {
            if v == 0 || v > 256 {
                bail!("-t must be between 1 and 256 (got {v})");
            }
            s.threads = v;
        }
        if let Some(v) = self.memory_limit.or(file.memory_limit) {
            if v == 0 {
                bail!("-m must be at least 1 (megabytes)");
            }
            s.memory_limit = v.checked_mul(1 << 20).context("-m is too large")?;
        }
        if let Some(v) = self.conn_limit.or(file.conn_limit) {
            if v == 0 {
                bail!("-c must be at least 1");
            }
            s.max_conns = v;
        }
        let item = match (&self.max_item_size, &file.max_item_size) {
            (Some(v), _) => Some(parse_size(v)?),
            (None, Some(toml::Value::Integer(n))) => Some(*n as usize),
            (None, Some(toml::Value::String(v))) => Some(parse_size(v)?),
            (None, Some(other)) => bail!("max_item_size: expected a number or a size string, got {other}"),
            (None, None) => None,
        };
        if let Some(v) = item {
            if v < 1024 {
                bail!("-I must be at least 1k (got {v} bytes)");
            }
            if v > 1 << 30 {
                bail!("-I cannot be larger than 1g (got {v} bytes)");
            }
            s.max_item_size = v;
        }
        if self.disable_evictions || file.disable_evictions == Some(true) {
            s.evictions = false;
        }
        if self.disable_cas || file.disable_cas == Some(true) {
            s.cas_enabled = false;
        }
        if self.disable_flush_all || file.disable_flush_all == Some(true) {
            s.flush_enabled = false;
        }
        if let Some(u) = self.udp_port.or(file.udp_port) {
            if u != 0 {
                bail!("mbal does not serve UDP: use -U 0 (the default)");
            }
        }
        if let Some(b) = self.protocol.as_deref().or(file.protocol.as_deref()) {
            s.binding = match b {
                "auto" | "auto-negotiate" => Binding::Auto,
                "ascii" => Binding::Ascii,
                "binary" => Binding::Binary,
                other => bail!("-B must be ascii, binary or auto (got '{other}')"),
            };
        }
        if let Some(v) = self.reqs_per_event.or(file.max_reqs_per_event) {
            if v == 0 {
                bail!("-R must be at least 1");
            }
            s.reqs_per_event = v;
        }
        if let Some(v) = self.max_inflight.or(file.max_inflight) {
            if v == 0 {
                bail!("--max-inflight must be at least 1");
            }
            s.max_inflight = v;
        }
        s.debug_commands = self.debug_commands;
        if let Some(d) = &self.x_delimiter {
            // memcached takes the first character of -D.
            match d.as_bytes().first() {
                Some(&c) if c.is_ascii_graphic() => s.prefix_delimiter = c,
                _ => bail!("-D must start with a printable ASCII character (got {d:?})"),
            }
        }
        s.shutdown_enabled = self.enable_shutdown || file.enable_shutdown == Some(true);
        s.verbosity = if self.verbose > 0 { self.verbose } else { file.verbosity.unwrap_or(0) };
        if let Some(v) = self.backlog.or(file.listen_backlog) {
            s.backlog = v;
        }
        if let Some(v) = file.idle_timeout {
            s.idle_timeout = v;
        }
        for opt in self.extended.iter().flat_map(|o| o.split(',')) {
            let opt = opt.trim();
            if opt.is_empty() {
                continue;
            }
            let (k, v) = opt.split_once('=').unwrap_or((opt, ""));
            match k {
                "idle_timeout" => {
                    s.idle_timeout = v.parse().with_context(|| format!("-o idle_timeout: bad value '{v}'"))?
                }
                _ => bail!("-o {k}: not supported by mbal (supported: idle_timeout=N)"),
            }
        }
        s.worker_port_base = self.worker_port_base.or(file.worker_port_base);
        if let Some(v) = self.cachelets_per_worker.or(file.cachelets_per_worker) {
            if v == 0 || v > 4096 {
                bail!("--cachelets-per-worker must be between 1 and 4096");
            }
            s.cachelets_per_worker = v;
        }
        if let Some(v) = self.vn_count.or(file.vn_count) {
            s.vn_count = v;
        }
        let cachelets = s.threads as u64 * s.cachelets_per_worker as u64;
        if (s.vn_count as u64) < cachelets {
            bail!("--vn-count ({}) must be at least threads x cachelets-per-worker ({cachelets})", s.vn_count);
        }
        if let (Some(path), Some(id)) = (&self.cluster, self.id) {
            let text =
                std::fs::read_to_string(path).with_context(|| format!("reading cluster file {}", path.display()))?;
            let spec = mbal_cluster::ClusterSpec::from_toml(&text)
                .map_err(|e| anyhow::anyhow!("cluster file {}: {e}", path.display()))?;
            s.apply_cluster(spec, id)?;
            if self.threads.is_some_and(|t| t != s.threads) || self.port.is_some_and(|p| p != s.port) {
                bail!("-t and -p come from the cluster file when --cluster is given");
            }
        }
        if let Some(v) = self.page_size_kb.or(file.page_size_kb) {
            if !(4..=65536).contains(&v) {
                bail!("--page-size-kb must be between 4 and 65536");
            }
            s.page_size = v << 10;
        }
        if s.memory_limit / s.page_size > mbal_store::MAX_PAGES {
            bail!(
                "-m {} MB in {} KiB pages is more than {} pages; raise --page-size-kb",
                s.memory_limit >> 20,
                s.page_size >> 10,
                mbal_store::MAX_PAGES
            );
        }
        Ok(s)
    }

    fn reject_unsupported(&self) -> Result<()> {
        let no = |flag: &str, what: &str| -> Result<()> {
            bail!("memcached option {flag} ({what}) is not supported by mbal")
        };
        if self.x_daemon {
            no("-d", "daemonize; run mbal under a process supervisor")?;
        }
        if self.x_user.is_some() {
            no("-u", "switch user; start mbal as the user it should run as")?;
        }
        if self.x_unix_socket.is_some() || self.x_unix_mask.is_some() {
            no("-s/-a", "unix sockets; mbal listens on TCP only")?;
        }
        if self.x_sasl || self.x_auth_file.is_some() {
            no("-S/-Y", "authentication")?;
        }
        if self.x_ssl {
            no("-Z", "TLS")?;
        }
        if self.x_pidfile.is_some() {
            no("-P", "pid file")?;
        }
        if self.x_factor.is_some() || self.x_min_size.is_some() {
            no("-f/-n", "slab class sizing; mbal stores items in segments, see --page-size-kb")?;
        }
        if self.x_large_pages || self.x_lock_memory || self.x_memory_file.is_some() || self.x_coredumps {
            no("-L/-k/-e/-r", "memory placement options")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: ServerArgs,
    }

    fn parse(args: &[&str]) -> Result<Settings> {
        let mut v = vec!["mbal"];
        v.extend_from_slice(args);
        Cli::try_parse_from(v).map_err(anyhow::Error::from)?.a.resolve()
    }

    #[test]
    fn memcached_flags() {
        let s = parse(&[
            "-p",
            "12000",
            "-t",
            "2",
            "-m",
            "128",
            "-c",
            "10",
            "-I",
            "2m",
            "-M",
            "-C",
            "-F",
            "-U",
            "0",
            "-B",
            "ascii",
            "-R",
            "5",
            "-A",
            "-vv",
            "-o",
            "idle_timeout=30",
        ])
        .unwrap();
        assert_eq!(s.port, 12000);
        assert_eq!(s.threads, 2);
        assert_eq!(s.memory_limit, 128 << 20);
        assert_eq!(s.max_conns, 10);
        assert_eq!(s.max_item_size, 2 << 20);
        assert!(!s.evictions && !s.cas_enabled && !s.flush_enabled && s.shutdown_enabled);
        assert_eq!(s.binding, Binding::Ascii);
        assert_eq!(s.reqs_per_event, 5);
        assert_eq!(s.verbosity, 2);
        assert_eq!(s.idle_timeout, 30);
    }

    #[test]
    fn defaults() {
        let s = parse(&[]).unwrap();
        assert_eq!(s.port, 11211);
        assert_eq!(s.listen.to_string(), "127.0.0.1");
        assert_eq!(s.memory_limit, 64 << 20);
        assert_eq!(s.max_item_size, 1 << 20);
        assert_eq!(s.max_conns, 1024);
        assert!(s.evictions && s.cas_enabled && s.flush_enabled);
    }

    #[test]
    fn too_many_pages_is_an_error() {
        // 2 TiB in 64 KiB pages is 32M pages: more than a cachelet's index can address
        let e = parse(&["-m", "2097152"]).unwrap_err().to_string();
        assert!(e.contains("--page-size-kb"), "{e}");
        assert!(parse(&["-m", "2097152", "--page-size-kb", "1024"]).is_ok());
    }

    #[test]
    fn unsupported_is_an_error() {
        for bad in [&["-d"][..], &["-U", "11211"], &["-o", "modern"], &["-f", "1.25"], &["-B", "udp"], &["-S"]] {
            let e = parse(bad).unwrap_err().to_string();
            assert!(e.contains("not supported") || e.contains("must be") || e.contains("UDP"), "{bad:?}: {e}");
        }
        assert!(parse(&["--no-such-flag"]).is_err());
    }

    #[test]
    fn config_file_and_precedence() {
        let dir = std::env::temp_dir().join(format!("mbal-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("c.toml");
        std::fs::write(&f, "port = 13000\nmemory_limit = 32\nmax_item_size = \"512k\"\ncachelets_per_worker = 8\n")
            .unwrap();
        let s = parse(&["--config", f.to_str().unwrap(), "-p", "14000"]).unwrap();
        assert_eq!(s.port, 14000, "command line wins");
        assert_eq!(s.memory_limit, 32 << 20);
        assert_eq!(s.max_item_size, 512 << 10);
        assert_eq!(s.cachelets_per_worker, 8);
        std::fs::write(&f, "bogus = 1\n").unwrap();
        assert!(parse(&["--config", f.to_str().unwrap()]).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1m").unwrap(), 1 << 20);
        assert_eq!(parse_size("512k").unwrap(), 512 << 10);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("x").is_err());
    }
}
