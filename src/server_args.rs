//! `mbal server`'s options: memcached's command line, mbal's own options,
//! and a TOML file for all of them, resolved into the library's
//! [`Settings`]. Precedence: command line > config file > defaults.
//!
//! The options are declared once, in [`ServerArgs`]: clap reads it from the
//! command line, serde from the config file (the same names, `_` for `-`).
//! Every field is optional, so each source is a *layer* that says only what
//! it sets; the layers are merged key by key ([`ServerArgs::merged`], the
//! command line over the file) and the result is checked and turned into
//! [`Settings`] over [`Settings::default`] in one place ([`ServerArgs::resolve`]).
//!
//! memcached's `-o` options are all recognised (the table in
//! [`extended_option`]): the ones that mean something here are implemented,
//! the ones that only tune memcached's slab allocator, LRU or helper threads
//! are accepted with one log line, and the few mbal cannot honour are refused
//! by name. Every memcached option mbal does not implement is likewise
//! recognised, so that an operator gets a clear "not supported" error instead
//! of clap's generic "unexpected argument" or, worse, a silent ignore.

use anyhow::{bail, Context, Result};
use clap::Args;
use mbal_server::config::{Binding, Settings};
use serde::{Deserialize, Serialize};
use std::net::IpAddr;
use std::path::PathBuf;
use std::str::FromStr;

/// A memcached-style size (`-I`): `1m`, `512k`, `2097152`, `1g` on the
/// command line; a number of bytes or such a string in the config file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "SizeRepr", into = "u64")]
pub struct Size(pub usize);

/// `coordinator` in a config file: one address (the form from before lists) or a list.
fn one_or_many<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<Vec<std::net::SocketAddr>>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Addrs {
        One(std::net::SocketAddr),
        Many(Vec<std::net::SocketAddr>),
    }
    Ok(Option::<Addrs>::deserialize(d)?.map(|a| match a {
        Addrs::One(a) => vec![a],
        Addrs::Many(v) => v,
    }))
}

#[derive(Deserialize)]
#[serde(untagged)]
enum SizeRepr {
    Bytes(u64),
    Text(String),
}

impl TryFrom<SizeRepr> for Size {
    type Error = String;
    fn try_from(r: SizeRepr) -> std::result::Result<Self, String> {
        match r {
            SizeRepr::Bytes(n) => usize::try_from(n).map(Size).map_err(|_| format!("size {n} is too large")),
            SizeRepr::Text(s) => s.parse(),
        }
    }
}

impl From<Size> for u64 {
    fn from(s: Size) -> u64 {
        s.0 as u64
    }
}

impl FromStr for Size {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        parse_size(s).map(Size).map_err(|e| format!("{e:#}"))
    }
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_zero(v: &u8) -> bool {
    *v == 0
}

/// `mbal server`'s options, declared once: the command line (short flags
/// are memcached's) and, with the same names, the TOML config file. Every
/// field is optional (or a flag that is off unless given), so one value of
/// this type is one layer of configuration. Fields marked `serde(skip)` are
/// command-line only.
#[derive(Args, Serialize, Deserialize, Clone, Debug, Default)]
#[serde(deny_unknown_fields)]
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
    /// OS threads that run the workers, fixed; with more workers than that, several share a
    /// thread [default: 0 = one per worker, at most one per CPU the process may run on, and a
    /// thread policy chooses how many of them are in use]
    #[arg(long = "worker-threads")]
    pub worker_threads: Option<usize>,
    /// Item memory in megabytes [default: 64]
    #[arg(short = 'm', long = "memory-limit")]
    pub memory_limit: Option<usize>,
    /// Max simultaneous connections [default: 1024]
    #[arg(short = 'c', long = "conn-limit")]
    pub conn_limit: Option<usize>,
    /// Max item size, e.g. 1m, 512k, 2097152; at most 1g and half of -m [default: 1m]
    #[arg(short = 'I', long = "max-item-size")]
    pub max_item_size: Option<Size>,
    /// Return an error when memory is exhausted instead of evicting
    #[arg(short = 'M', long = "disable-evictions")]
    #[serde(default, skip_serializing_if = "is_false")]
    pub disable_evictions: bool,
    /// Disable CAS (cas values are 0, `cas` always fails)
    #[arg(short = 'C', long = "disable-cas")]
    #[serde(default, skip_serializing_if = "is_false")]
    pub disable_cas: bool,
    /// Disable flush_all
    #[arg(short = 'F', long = "disable-flush-all")]
    #[serde(default, skip_serializing_if = "is_false")]
    pub disable_flush_all: bool,
    /// UDP port; only 0 (off) is supported [default: 0]
    #[arg(short = 'U', long = "udp-port")]
    pub udp_port: Option<u16>,
    /// Binding protocol: ascii, binary or auto [default: auto]
    #[arg(short = 'B', long = "protocol")]
    pub protocol: Option<Binding>,
    /// Max requests processed per connection per event-loop round [default: 20]
    #[arg(short = 'R', long = "max-reqs-per-event")]
    pub max_reqs_per_event: Option<usize>,
    /// Enable the `shutdown` command
    #[arg(short = 'A', long = "enable-shutdown")]
    #[serde(default, skip_serializing_if = "is_false")]
    pub enable_shutdown: bool,
    /// Verbose logging (-v, -vv, -vvv); `verbosity = N` in the config file [default: 0]
    #[arg(short = 'v', action = clap::ArgAction::Count)]
    #[serde(default, skip_serializing_if = "is_zero")]
    pub verbosity: u8,
    /// Listen backlog [default: 1024]
    #[arg(short = 'b', long = "listen-backlog")]
    pub listen_backlog: Option<i32>,
    /// memcached's extended options, comma separated, `name` or `name=value`; may be repeated
    /// (see docs/operations.md for what each does here)
    #[arg(short = 'o', long = "extended")]
    #[serde(default, skip_serializing)]
    pub extended: Vec<String>,
    /// `-o idle_timeout=N`: close connections idle for N seconds [default: 0 = never]
    #[arg(skip)]
    pub idle_timeout: Option<u32>,
    /// `-o maxconns_fast` / `-o no_maxconns_fast`
    #[arg(skip)]
    pub maxconns_fast: Option<bool>,
    /// `-o sock_cookie_id=N`
    #[arg(skip)]
    pub sock_cookie_id: Option<u32>,
    /// `-o track_sizes`
    #[arg(skip)]
    pub track_sizes: Option<bool>,
    /// Speak TLS on every listener, main and worker ports (memcached's -Z; the certificate comes
    /// from `-o ssl_chain_cert=FILE,ssl_key=FILE`, client certificates are checked with
    /// `-o ssl_ca_cert=FILE,ssl_verify_mode=N`; see docs/operations.md "TLS")
    #[arg(short = 'Z', long = "enable-ssl")]
    #[serde(default, skip_serializing_if = "is_false")]
    pub enable_ssl: bool,
    /// `-o ssl_chain_cert=FILE`: PEM certificate chain, leaf first
    #[arg(skip)]
    pub ssl_chain_cert: Option<PathBuf>,
    /// `-o ssl_key=FILE`: PEM private key [default: in ssl_chain_cert]
    #[arg(skip)]
    pub ssl_key: Option<PathBuf>,
    /// `-o ssl_ca_cert=FILE`: PEM CA certificates client certificates must chain to
    #[arg(skip)]
    pub ssl_ca_cert: Option<PathBuf>,
    /// `-o ssl_verify_mode=N`: 0 none, 1 request (optional), 2 require, 3 once (= require)
    #[arg(skip)]
    pub ssl_verify_mode: Option<u8>,
    /// `-o ssl_min_version=N`: 0..2 (TLS 1.0..1.2) mean TLS 1.2 here, 3 TLS 1.3
    #[arg(skip)]
    pub ssl_min_version: Option<u8>,

    /// Give each worker a port of its own too (worker i listens on base+i; 0: ephemeral ports).
    /// Without it, routed clients reach a worker through the main port (`mbal hello <epoch>
    /// <worker>`) [default: no worker ports]
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
    /// Requests a worker may have passed to other workers and not yet had answered; past it, the
    /// worker stops reading its connections until answers come in [default: 16384]
    #[arg(long = "max-inflight")]
    pub max_inflight: Option<usize>,
    /// Milliseconds per epoch: how often the controller samples every worker's counters; Phase 1
    /// (hot keys) decides every epoch [default: 500]
    #[arg(long = "epoch-ms")]
    pub epoch_ms: Option<u64>,
    /// Milliseconds per Phase 2 epoch: the local balancer decides on the last this-many
    /// milliseconds of load, rounded to whole epochs; its persistence and leases count these
    /// [default: 1000]
    #[arg(long = "balance-epoch-ms")]
    pub balance_epoch_ms: Option<u64>,
    /// The local load balancer (Phase 2: cachelet moves between this server's workers), on or
    /// off [default: on in a cluster (--cluster), off for a stand-alone server]
    #[arg(long = "balancer", value_parser = parse_on_off)]
    pub balancer: Option<bool>,
    /// Consecutive imbalanced epochs before the balancer acts [default: 4, MBal §3.1]
    #[arg(long = "balance-persistence")]
    pub balance_persistence: Option<u32>,
    /// Imbalanced when the busiest worker carries more than this times the mean load
    /// [default: 1.2]
    #[arg(long = "balance-trigger")]
    pub balance_trigger: Option<f64>,
    /// T_j: the load a plan may leave on a worker, as a multiple of the mean [default: 1.1]
    #[arg(long = "balance-target")]
    pub balance_target: Option<f64>,
    /// SERVER_LOAD_thresh: past this fraction of saturated workers the server asks for Phase 3
    /// instead of moving locally [default: 0.75, MBal Algorithm 1]
    #[arg(long = "balance-server-load-thresh")]
    pub balance_server_load_thresh: Option<f64>,
    /// Epochs a moved cachelet stays away from home before it may go back [default: 10]
    #[arg(long = "balance-lease-epochs")]
    pub balance_lease_epochs: Option<u32>,
    /// Phase 2 planner: ilp (MILP solver, greedy fallback) or greedy [default: ilp]
    #[arg(long = "balance-planner")]
    pub balance_planner: Option<String>,
    /// Emulated capacity of each worker, requests per second: a worker executes at most this many
    /// (for its own connections and for other workers) and the rest wait, as on a saturated core;
    /// for balancer experiments on a machine with fewer cores than workers [default: 0 = unlimited]
    #[arg(long = "worker-capacity")]
    pub worker_capacity: Option<u64>,
    /// Phase 1, hot-key replication: copies of the hottest keys of an overloaded worker on other
    /// servers, read by routing clients under leases [default: on in a cluster of two or more
    /// servers]
    #[arg(long = "hot-keys", value_parser = parse_on_off)]
    pub hot_keys: Option<bool>,
    /// Fraction of requests sampled into the hot-key tracker: given alone, a fixed rate (no
    /// --hot-sample-target); with a target, the rate until the first epoch [default: 0.03]
    #[arg(long = "hot-sample-rate")]
    pub hot_sample_rate: Option<f64>,
    /// Sampled requests to aim for per worker and epoch: the sampling rate is set each epoch
    /// from the load, between --hot-sample-min and --hot-sample-max; 0: a fixed
    /// --hot-sample-rate [default: 100]
    #[arg(long = "hot-sample-target")]
    pub hot_sample_target: Option<f64>,
    /// Lowest sampling rate the sample target may set [default: 0.0001]
    #[arg(long = "hot-sample-min")]
    pub hot_sample_min: Option<f64>,
    /// Highest sampling rate the sample target may set [default: 0.25]
    #[arg(long = "hot-sample-max")]
    pub hot_sample_max: Option<f64>,
    /// The per-worker max/avg load Phase 1 aims for; picks each key's replica count [default: 1.1]
    #[arg(long = "hot-target")]
    pub hot_target: Option<f64>,
    /// REPL_high: most keys of this server replicated at once [default: this server's share of
    /// floor(2·n·ln n) for the cluster's n workers, split evenly over the servers]
    #[arg(long = "hot-repl-high")]
    pub hot_repl_high: Option<usize>,
    /// Past REPL_high, a key at least twice as hot as this server's coolest replicated key
    /// displaces it, once its measured rate has been quiet for 2 epochs [default: on]
    #[arg(long = "hot-displace", value_parser = parse_on_off)]
    pub hot_displace: Option<bool>,
    /// Epochs a client may read a hot key's copies after a hint [default: 2]
    #[arg(long = "hot-lease-epochs")]
    pub hot_lease_epochs: Option<u32>,
    /// Megabytes of other servers' hot-key copies this server holds at most (never evicts its
    /// own items for them) [default: 64]
    #[arg(long = "replica-memory")]
    pub replica_memory: Option<usize>,
    /// Writes to a replicated key: async (answered at once, copies updated right after), sync
    /// (answered once every copy holds the write), or sync:PREFIX[,PREFIX...] (sync for keys
    /// with one of these prefixes, async for the rest) [default: async]
    #[arg(long = "replica-writes")]
    pub replica_writes: Option<String>,
    /// Milliseconds the replicator waits for a shadow server before giving up on it
    /// [default: 500]
    #[arg(long = "replica-timeout-ms")]
    pub replica_timeout_ms: Option<u64>,
    /// Require authentication (memcached's -Y): FILE holds 'user:password' lines. Text clients
    /// authenticate with memcached's ASCII auth (a first `set` whose data is 'user password'),
    /// binary clients with SASL PLAIN against the same users
    #[arg(short = 'Y', long = "auth-file")]
    pub auth_file: Option<PathBuf>,
    /// memcached's SASL switch: binary clients authenticate with SASL PLAIN against the -Y file
    /// (mbal has no SASL database of its own, so -S needs -Y; with -Y, SASL is on anyway)
    #[arg(short = 'S', long = "enable-sasl")]
    #[serde(default, skip_serializing_if = "is_false")]
    pub enable_sasl: bool,
    /// File holding the control secret (at least 16 bytes; trailing whitespace ignored) of a
    /// server without a cluster file: control commands (mbal move, mbal debug, mbal replica ...)
    /// are accepted only from connections that proved they know it (`mbal peer`). Without any
    /// secret, control commands are accepted only on a loopback listener without -Y
    #[arg(long = "control-secret-file")]
    pub control_secret_file: Option<PathBuf>,
    /// Open connections one client address may hold; one more is answered `ERROR Too many open
    /// connections from this address` and closed [default: 0 = no limit but -c]
    #[arg(long = "max-conns-per-ip")]
    pub max_conns_per_ip: Option<usize>,
    /// Bytes of unparsed input one connection may buffer (1m, 64k, ...); a request that needs
    /// more is answered `SERVER_ERROR request larger than the input buffer limit` and the
    /// connection closed [default: -I plus 80 KiB, one largest request]
    #[arg(long = "max-input-buffer")]
    pub max_input_buffer: Option<Size>,
    /// Close a connection that has sent part of a request and not the rest for this long (slow
    /// senders); text clients get `SERVER_ERROR timed out waiting for the rest of the request`
    /// [default: 30000; 0 = never]
    #[arg(long = "request-timeout-ms")]
    pub request_timeout_ms: Option<u64>,
    /// Pass a plain client's requests for keys another server of the cluster owns to that server
    /// and return its answers in order (so an unmodified client may use any server), instead of
    /// answering them as a server without the key would [default: off]
    #[arg(long = "forward")]
    #[serde(default, skip_serializing_if = "is_false")]
    pub forward: bool,
    /// Milliseconds --forward waits for the owning server's answer before it answers the request
    /// (and every other waiting on that server) with SERVER_ERROR [default: 1000]
    #[arg(long = "forward-timeout-ms")]
    pub forward_timeout_ms: Option<u64>,
    /// The coordinator that owns the cluster map (`mbal coordinator`): with --cluster/--id, the
    /// server registers there, keeps a heartbeat, takes its map from it and serves its cachelets
    /// under its lease (docs/operations.md "Coordinator"). Several, comma-separated (coordinators
    /// sharing etcd): the server talks to the one that leads
    #[arg(long = "coordinator", value_delimiter = ',')]
    #[serde(default, deserialize_with = "one_or_many")]
    pub coordinator: Option<Vec<std::net::SocketAddr>>,
    /// Milliseconds start-up keeps trying to reach the coordinator before it gives up
    /// [default: 10000]
    #[arg(long = "coordinator-wait-ms")]
    pub coordinator_wait_ms: Option<u64>,
    /// With a coordinator, leave the cluster on shutdown (its cachelets go to the other servers at
    /// once, instead of after the failure timeout): on, off [default: on]
    #[arg(long = "leave-on-shutdown", value_parser = parse_on_off)]
    pub leave_on_shutdown: Option<bool>,
    /// A new server joining a coordinator's cluster: warm (its share of the cachelets moves to
    /// it with their items, one move at a time) or cold (it gets its share at once, empty)
    /// [default: warm]
    #[arg(long = "join", value_parser = ["warm", "cold"])]
    pub join: Option<String>,
    /// Serve Prometheus metrics over HTTP at http://ADDR/metrics (HOST:PORT; port 0: chosen by
    /// the OS, see --print-ports); docs/operations.md "Metrics" [default: off]
    #[arg(long = "metrics-listen", value_name = "ADDR")]
    pub metrics_listen: Option<std::net::SocketAddr>,

    /// TOML file with any of the settings above (long names, with '_' for '-')
    #[arg(long = "config")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Cluster description (TOML: vn_count, cachelets_per_worker, workers, [[servers]] addr,
    /// worker_port_base); with --id, this server serves its part of the cluster's key space
    #[arg(long = "cluster")]
    #[serde(skip)]
    pub cluster: Option<PathBuf>,
    /// This server's index in the cluster file's servers list (without it, with --coordinator,
    /// the server joins the cluster: the coordinator gives it an id and a share of the cachelets)
    #[arg(long = "id", requires = "cluster")]
    #[serde(skip)]
    pub id: Option<u16>,
    /// Print the listening addresses as one JSON line on stdout once ready
    #[arg(long = "print-ports")]
    #[serde(skip)]
    pub print_ports: bool,
    /// Print a config file (`--config`) with every option commented out at its default, and exit
    #[arg(long = "print-config")]
    #[serde(skip)]
    pub print_config: bool,
    /// Accept the `mbal debug` test hooks (stall a worker); for tests only
    #[arg(long = "enable-debug-commands", hide = true)]
    #[serde(skip)]
    pub debug_commands: bool,

    // memcached options that mbal recognises but does not implement.
    #[arg(short = 'd', long = "daemon", hide = true)]
    #[serde(skip)]
    pub x_daemon: bool,
    #[arg(short = 'u', long = "user", hide = true)]
    #[serde(skip)]
    pub x_user: Option<String>,
    #[arg(short = 's', long = "unix-socket", hide = true)]
    #[serde(skip)]
    pub x_unix_socket: Option<String>,
    #[arg(short = 'a', long = "unix-mask", hide = true)]
    #[serde(skip)]
    pub x_unix_mask: Option<String>,
    #[arg(short = 'P', long = "pidfile", hide = true)]
    #[serde(skip)]
    pub x_pidfile: Option<String>,
    #[arg(short = 'f', long = "slab-growth-factor", hide = true)]
    #[serde(skip)]
    pub x_factor: Option<String>,
    #[arg(short = 'n', long = "slab-min-size", hide = true)]
    #[serde(skip)]
    pub x_min_size: Option<String>,
    #[arg(short = 'L', long = "enable-largepages", hide = true)]
    #[serde(skip)]
    pub x_large_pages: bool,
    /// Key prefix delimiter for `stats detail` [default: ':']
    #[arg(short = 'D')]
    #[serde(skip)]
    pub x_delimiter: Option<String>,
    #[arg(short = 'k', long = "lock-memory", hide = true)]
    #[serde(skip)]
    pub x_lock_memory: bool,
    #[arg(short = 'e', long = "memory-file", hide = true)]
    #[serde(skip)]
    pub x_memory_file: Option<String>,
    #[arg(short = 'r', long = "enable-coredumps", hide = true)]
    #[serde(skip)]
    pub x_coredumps: bool,
}

/// `on` / `off` (also `true`/`false`, `1`/`0`).
fn parse_on_off(v: &str) -> Result<bool, String> {
    match v {
        "on" | "true" | "1" => Ok(true),
        "off" | "false" | "0" => Ok(false),
        _ => Err(format!("expected on or off, got {v:?}")),
    }
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

mod ext;
pub use ext::extended_option;

impl ServerArgs {
    /// Read a config file as a layer of options.
    pub fn from_file(path: &std::path::Path) -> Result<ServerArgs> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading config file {}", path.display()))?;
        toml::from_str(&text).map_err(|e| anyhow::anyhow!("config file {}: {}", path.display(), e.message()))
    }

    /// Turn this layer's `-o` options into its fields. Returns the lines to log.
    fn expand_extended(&mut self) -> Result<Vec<String>> {
        let mut notes = Vec::new();
        for opt in std::mem::take(&mut self.extended).iter().flat_map(|o| o.split(',')) {
            if opt.trim().is_empty() {
                continue;
            }
            if let (_, Some(note)) = extended_option(self, opt)? {
                notes.push(note);
            }
        }
        Ok(notes)
    }

    /// The listeners' TLS from `-Z` and `-o ssl_*` (None without `-Z`);
    /// shared by the server and the proxy.
    pub fn tls_files(&self) -> Result<Option<mbal_tls::ServerTlsFiles>> {
        let o = self;
        if o.enable_ssl {
            let chain_cert = o.ssl_chain_cert.clone().context("-Z needs -o ssl_chain_cert=FILE (a PEM certificate)")?;
            let verify_mode = mbal_tls::VerifyMode::from_memcached(o.ssl_verify_mode.unwrap_or(0))
                .map_err(|e| anyhow::anyhow!("-o {e}"))?;
            if verify_mode != mbal_tls::VerifyMode::None && o.ssl_ca_cert.is_none() {
                bail!("-o ssl_verify_mode=1..3 needs -o ssl_ca_cert=FILE (the CA of the client certificates)");
            }
            return Ok(Some(mbal_tls::ServerTlsFiles {
                chain_cert,
                key: o.ssl_key.clone(),
                ca_cert: o.ssl_ca_cert.clone(),
                verify_mode,
                tls13_only: o.ssl_min_version == Some(3),
            }));
        } else if o.ssl_chain_cert.is_some() || o.ssl_key.is_some() || o.ssl_ca_cert.is_some() {
            bail!("-o ssl_chain_cert/ssl_key/ssl_ca_cert need -Z (--enable-ssl) to turn TLS on");
        }
        Ok(None)
    }

    /// `-Z` and `-o ssl_*` as `mbal proxy` takes them: the same parsing as
    /// the server's; any other `-o` option is refused. Returns the TLS files
    /// and the lines to log.
    pub fn proxy_tls(enable_ssl: bool, extended: &[String]) -> Result<(Option<mbal_tls::ServerTlsFiles>, Vec<String>)> {
        let mut layer = ServerArgs { enable_ssl, extended: extended.to_vec(), ..ServerArgs::default() };
        for opt in extended.iter().flat_map(|o| o.split(',')) {
            let name = opt.split_once('=').map_or(opt, |(k, _)| k).trim();
            if !name.is_empty() && !name.starts_with("ssl_") {
                bail!("-o {name}: mbal proxy takes only the ssl_* options");
            }
        }
        let notes = layer.expand_extended()?;
        Ok((layer.tls_files()?, notes))
    }

    /// This layer over `lower`, key by key: a value this layer sets wins, the
    /// others come from `lower`. Command-line-only fields are not carried.
    pub fn merged(&self, lower: &ServerArgs) -> Result<ServerArgs> {
        let mut table = toml::Table::try_from(lower).context("serialising options")?;
        table.extend(toml::Table::try_from(self).context("serialising options")?);
        table.try_into().context("merging options")
    }

    /// Resolve command line + config file into settings, rejecting what mbal
    /// does not implement. Also returns the lines to log once logging is up
    /// (memcached options accepted without effect).
    pub fn resolve(&self) -> Result<(Settings, Vec<String>)> {
        self.reject_unsupported()?;
        let mut file = match &self.config {
            Some(p) => ServerArgs::from_file(p)?,
            None => ServerArgs::default(),
        };
        let mut notes = file.expand_extended()?;
        let mut cli = self.clone();
        notes.extend(cli.expand_extended()?);
        let o = cli.merged(&file)?;

        let mut s = Settings::default();
        if let Some(v) = o.port {
            s.port = v;
        }
        if let Some(v) = o.listen {
            s.listen = v;
        }
        if let Some(v) = o.threads {
            if v == 0 || v > 256 {
                bail!("-t must be between 1 and 256 (got {v})");
            }
            s.threads = v;
        }
        if let Some(v) = o.worker_threads {
            if v > 256 {
                bail!("--worker-threads must be at most 256 (got {v})");
            }
            s.worker_threads = v;
        }
        if let Some(v) = o.memory_limit {
            if v == 0 {
                bail!("-m must be at least 1 (megabytes)");
            }
            s.memory_limit = v.checked_mul(1 << 20).context("-m is too large")?;
        }
        if let Some(v) = o.conn_limit {
            if v == 0 {
                bail!("-c must be at least 1");
            }
            s.max_conns = v;
        }
        if let Some(Size(v)) = o.max_item_size {
            s.max_item_size = v;
        }
        // memcached's rules for -I, in its order.
        if s.max_item_size < 1024 {
            bail!("-I must be at least 1k (got {} bytes)", s.max_item_size);
        }
        if s.max_item_size > s.memory_limit / 2 {
            bail!(
                "-I ({} bytes) cannot be larger than half of -m ({} MB), as in memcached",
                s.max_item_size,
                s.memory_limit >> 20
            );
        }
        if s.max_item_size > 1 << 30 {
            bail!("-I cannot be larger than 1g (got {} bytes)", s.max_item_size);
        }
        s.evictions = !o.disable_evictions;
        s.cas_enabled = !o.disable_cas;
        s.flush_enabled = !o.disable_flush_all;
        if o.udp_port.is_some_and(|u| u != 0) {
            bail!("mbal does not serve UDP: use -U 0 (the default)");
        }
        if let Some(b) = o.protocol {
            s.binding = b;
        }
        if let Some(v) = o.max_reqs_per_event {
            if v == 0 {
                bail!("-R must be at least 1");
            }
            s.reqs_per_event = v;
        }
        if let Some(v) = o.max_inflight {
            if v == 0 {
                bail!("--max-inflight must be at least 1");
            }
            s.max_inflight = v;
        }
        let b = &mut s.balance;
        if let Some(v) = o.balance_persistence {
            if v == 0 {
                bail!("--balance-persistence must be at least 1");
            }
            b.persistence = v;
        }
        if let Some(v) = o.balance_trigger {
            if !(v > 1.0 && v.is_finite()) {
                bail!("--balance-trigger must be above 1.0 (a multiple of the mean load)");
            }
            b.trigger_max_over_avg = v;
        }
        if let Some(v) = o.balance_target {
            if !(v >= 1.0 && v.is_finite()) {
                bail!("--balance-target must be at least 1.0 (a multiple of the mean load)");
            }
            b.target_max_over_avg = v;
        }
        if let Some(v) = o.balance_server_load_thresh {
            if !(0.0..=1.0).contains(&v) {
                bail!("--balance-server-load-thresh must be between 0 and 1");
            }
            b.server_load_thresh = v;
        }
        if let Some(v) = o.balance_lease_epochs {
            b.lease_epochs = v;
        }
        if let Some(v) = &o.balance_planner {
            b.planner = match v.as_str() {
                "ilp" => mbal_balance::Planner::Ilp,
                "greedy" => mbal_balance::Planner::Greedy,
                _ => bail!("--balance-planner must be ilp or greedy (got {v:?})"),
            };
        }
        if let Some(v) = o.epoch_ms {
            if v == 0 {
                bail!("--epoch-ms must be at least 1");
            }
            s.epoch_ms = v;
        }
        if let Some(v) = o.balance_epoch_ms {
            if v == 0 {
                bail!("--balance-epoch-ms must be at least 1");
            }
            s.balance_epoch_ms = v;
        }
        if let Some(v) = o.worker_capacity {
            s.worker_capacity = v;
        }
        if let Some(p) = &o.auth_file {
            s.auth = Some(std::sync::Arc::new(mbal_server::auth::Credentials::load(p).map_err(anyhow::Error::msg)?));
        } else if o.enable_sasl {
            bail!("-S needs -Y FILE: mbal's SASL PLAIN checks the users of the -Y file");
        }
        if let Some(p) = &o.control_secret_file {
            let secret = mbal_member::peer_auth::Secret::from_file(p).map_err(anyhow::Error::msg)?;
            s.control_secret = Some(secret);
        }
        if let Some(v) = o.max_conns_per_ip {
            s.max_conns_per_ip = v;
        }
        if let Some(Size(v)) = o.max_input_buffer {
            if v < 4096 {
                bail!("--max-input-buffer must be at least 4k (got {v} bytes)");
            }
            s.max_input_buffer = v;
        }
        if let Some(v) = o.request_timeout_ms {
            s.request_timeout_ms = v;
        }
        s.forward = o.forward;
        if let Some(v) = o.forward_timeout_ms {
            s.forward_timeout_ms = v.max(1);
        }
        s.coordinator = o.coordinator.clone().unwrap_or_default();
        if let Some(v) = o.coordinator_wait_ms {
            s.coordinator_wait_ms = v;
        }
        if let Some(v) = o.leave_on_shutdown {
            s.leave_on_shutdown = v;
        }
        if let Some(j) = &o.join {
            s.join_warm = j == "warm";
        }
        s.metrics_listen = o.metrics_listen;
        s.debug_commands = self.debug_commands;
        if let Some(d) = &self.x_delimiter {
            // memcached takes the first character of -D.
            match d.as_bytes().first() {
                Some(&c) if c.is_ascii_graphic() => s.prefix_delimiter = c,
                _ => bail!("-D must start with a printable ASCII character (got {d:?})"),
            }
        }
        s.shutdown_enabled = o.enable_shutdown;
        s.verbosity = o.verbosity;
        if let Some(v) = o.listen_backlog {
            s.backlog = v;
        }
        if let Some(v) = o.idle_timeout {
            s.idle_timeout = v;
        }
        if let Some(v) = o.maxconns_fast {
            s.maxconns_fast = v;
        }
        if let Some(v) = o.sock_cookie_id {
            s.sock_cookie_id = v;
        }
        if let Some(v) = o.track_sizes {
            s.track_sizes = v;
        }
        s.worker_port_base = o.worker_port_base;
        s.tls = o.tls_files()?;
        if let Some(v) = o.cachelets_per_worker {
            if v == 0 || v > 4096 {
                bail!("--cachelets-per-worker must be between 1 and 4096");
            }
            s.cachelets_per_worker = v;
        }
        if let Some(v) = o.vn_count {
            s.vn_count = v;
        }
        let cachelets = s.threads as u64 * s.cachelets_per_worker as u64;
        if (s.vn_count as u64) < cachelets {
            bail!("--vn-count ({}) must be at least threads x cachelets-per-worker ({cachelets})", s.vn_count);
        }
        if let Some(path) = &self.cluster {
            let file = mbal_member::ClusterFile::load(path).map_err(anyhow::Error::msg)?;
            if s.coordinator.is_empty() {
                // The cluster file names its coordinators; --coordinator overrides them.
                s.coordinator.clone_from(&file.spec.coordinators);
            }
            if self.id.is_none() && s.coordinator.is_empty() {
                bail!("--cluster needs --id (this server's index in the file), or a coordinator (--coordinator, or the file's coordinators) to join the cluster");
            }
            if let Some(secret) = file.secret {
                if s.control_secret.is_some() {
                    bail!("the cluster file has a secret: give the control secret in one place, not also --control-secret-file");
                }
                s.control_secret = Some(secret);
            }
            if let Some(t) = &file.spec.tls {
                // The cluster's TLS: the listeners use the file's certificate unless
                // -Z -o ssl_chain_cert=... names this server's own (the command line wins).
                if s.tls.is_none() {
                    let files = t
                        .server_files(file.dir.as_deref())
                        .map_err(|e| anyhow::anyhow!("cluster file {}: {e}", path.display()))?;
                    s.tls = Some(files);
                }
                s.peer_tls = file.client_tls;
            }
            let spec = file.spec;
            match self.id {
                // Joins through the coordinator: the addresses from -l/-p, the id from the coordinator.
                None => {
                    if self.threads.is_some_and(|t| t != spec.workers as usize) {
                        bail!("-t must be the cluster's worker count ({}) for a server that joins it", spec.workers);
                    }
                    s.apply_cluster_join(spec).map_err(anyhow::Error::msg)?;
                }
                Some(id) => {
                    s.apply_cluster(spec, id).map_err(anyhow::Error::msg)?;
                    if self.threads.is_some_and(|t| t != s.threads) || self.port.is_some_and(|p| p != s.port) {
                        bail!("-t and -p come from the cluster file when --cluster is given");
                    }
                }
            }
        }
        if !s.coordinator.is_empty() && s.cluster.is_none() {
            bail!("--coordinator needs --cluster and --id (the cluster file gives the key space and the secret)");
        }
        s.balancer = o.balancer.unwrap_or(s.cluster.is_some());
        let servers = s.cluster.as_ref().map_or(1, |(spec, _)| spec.servers.len());
        let h = &mut s.hot;
        h.enabled = o.hot_keys.unwrap_or(servers >= 2);
        h.epoch_ms = s.epoch_ms;
        if let Some(v) = o.hot_sample_rate {
            if !(v > 0.0 && v <= 1.0) {
                bail!("--hot-sample-rate must be in (0, 1] (got {v})");
            }
            h.policy.sample_rate = v;
            // A rate given alone is a fixed rate.
            if o.hot_sample_target.is_none() {
                h.policy.sample_target = 0.0;
            }
        }
        if let Some(v) = o.hot_sample_target {
            if !(v >= 0.0 && v.is_finite()) {
                bail!("--hot-sample-target must be 0 or more (got {v})");
            }
            h.policy.sample_target = v;
        }
        for (flag, v, slot) in [
            ("--hot-sample-min", o.hot_sample_min, &mut h.policy.sample_min),
            ("--hot-sample-max", o.hot_sample_max, &mut h.policy.sample_max),
        ] {
            if let Some(v) = v {
                if !(v > 0.0 && v <= 1.0) {
                    bail!("{flag} must be in (0, 1] (got {v})");
                }
                *slot = v;
            }
        }
        if h.policy.sample_min > h.policy.sample_max {
            bail!("--hot-sample-min must not be above --hot-sample-max");
        }
        if let Some(v) = o.hot_target {
            if v < 1.0 {
                bail!("--hot-target must be at least 1.0 (got {v})");
            }
            h.policy.target_imbalance = v;
        }
        if let Some(v) = o.hot_repl_high {
            h.policy.repl_high = Some(v);
        }
        if let Some(v) = o.hot_displace {
            h.policy.displace = v;
        }
        if let Some(v) = o.hot_lease_epochs {
            if v == 0 {
                bail!("--hot-lease-epochs must be at least 1");
            }
            h.policy.lease_epochs = v;
        }
        if let Some(v) = o.replica_memory {
            h.memory = v << 20;
        }
        if let Some(v) = &o.replica_writes {
            (h.sync, h.sync_prefixes) = match v.as_str() {
                "async" => (false, Vec::new()),
                "sync" => (true, Vec::new()),
                p if p.starts_with("sync:") => {
                    let prefixes: Vec<Box<[u8]>> =
                        p["sync:".len()..].split(',').filter(|p| !p.is_empty()).map(|p| p.as_bytes().into()).collect();
                    if prefixes.is_empty() {
                        bail!("--replica-writes sync: needs at least one key prefix (got {v:?})");
                    }
                    (false, prefixes)
                }
                _ => bail!("--replica-writes must be async, sync or sync:PREFIX[,PREFIX...] (got {v:?})"),
            };
        }
        if let Some(v) = o.replica_timeout_ms {
            h.timeout_ms = v.max(1);
        }
        if let Some(v) = o.page_size_kb {
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
        Ok((s, notes))
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
mod tests;

mod config_file;
#[cfg(test)]
use config_file::config_keys;
pub use config_file::default_config_file;
