//! Server settings: [`Settings`], everything a server needs to start,
//! resolved. How they are read (memcached's command line, mbal's own flags,
//! a TOML file, memcached's `-o` options) is the `mbal` binary's business
//! (`src/server_args.rs`): the library takes only the result.

use serde::{Deserialize, Serialize};
use std::net::IpAddr;
use std::str::FromStr;

/// Binding protocol (`-B`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
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

impl FromStr for Binding {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" | "auto-negotiate" => Ok(Binding::Auto),
            "ascii" => Ok(Binding::Ascii),
            "binary" => Ok(Binding::Binary),
            other => Err(format!("-B must be ascii, binary or auto (got '{other}')")),
        }
    }
}

impl TryFrom<String> for Binding {
    type Error = String;
    fn try_from(s: String) -> std::result::Result<Self, String> {
        s.parse()
    }
}

impl From<Binding> for String {
    fn from(b: Binding) -> String {
        b.name().to_string()
    }
}

/// The resolved settings of one server process.
#[derive(Clone, Debug)]
pub struct Settings {
    pub port: u16,
    pub listen: IpAddr,
    pub threads: usize,
    /// OS threads that run the `threads` workers; 0 = one per worker, but no more than the
    /// CPUs this process may run on (`--worker-threads`; docs/design-notes.md "More
    /// workers than CPUs").
    pub worker_threads: usize,
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
    /// `-o maxconns_fast` (memcached's default): a connection over `-c` gets
    /// `ERROR Too many open connections` and is closed at once. `false`
    /// (`-o no_maxconns_fast`): the main port stops accepting until a
    /// connection closes; new clients wait in the listen backlog.
    pub maxconns_fast: bool,
    /// `-o sock_cookie_id=N`: `SO_MARK` on every listening socket (Linux;
    /// needs CAP_NET_ADMIN), for firewall rules. 0: none.
    pub sock_cookie_id: u32,
    /// `-o track_sizes`: start with the item size histogram on (`stats sizes_enable`).
    pub track_sizes: bool,
    /// First per-worker port; worker `i` listens on `worker_port_base + i`
    /// (`Some(0)`: ephemeral ports). `None`: no worker ports, only the main
    /// port (routed clients are handed to their worker by `mbal hello`).
    pub worker_port_base: Option<u16>,
    pub cachelets_per_worker: u32,
    pub vn_count: u32,
    pub page_size: usize,
    /// Cluster membership: the cluster description and this server's id in
    /// it. `None`: a stand-alone server (a cluster of one).
    pub cluster: Option<(mbal_member::ClusterSpec, u16)>,
    /// The coordinator that owns the cluster map (`--coordinator`, or the cluster file's
    /// `coordinator`): this server registers with it, keeps a heartbeat and serves its
    /// cachelets under its lease (`beat.rs`). `None`: the cluster file's map, fixed.
    /// Several (etcd mode): tried in turn; the one that leads answers (beat.rs).
    /// Empty: none.
    pub coordinator: Vec<std::net::SocketAddr>,
    /// How long start-up keeps trying to reach the coordinator.
    pub coordinator_wait_ms: u64,
    /// On shutdown, leave the cluster (`mbal leave`): the coordinator gives the cachelets to
    /// the other servers at once rather than after the failure timeout.
    pub leave_on_shutdown: bool,
    /// A join's share arrives warm (moved with its items by the coordinator) or cold (`--join`).
    pub join_warm: bool,
    /// The Prometheus endpoint's address (`--metrics-listen`): served by the `mbal` binary
    /// (src/metrics.rs) through [`crate::StatsConnector`], not by the server's threads.
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Requests one worker may have forwarded to others and not yet had
    /// answered; past it the worker stops reading its connections.
    pub max_inflight: usize,
    /// Accept the `mbal debug ...` test hooks (never in production).
    pub debug_commands: bool,
    /// The controller's tick: how often it samples every worker's counters
    /// into an epoch snapshot (DESIGN.md §2's epoch). Phase 1 decides every
    /// epoch.
    pub epoch_ms: u64,
    /// Phase 2's epoch: the local balancer decides on the load of the last
    /// `balance_epoch_ms` (whole epochs merged), once per that many
    /// milliseconds, and counts its persistence, leases and move timeout in
    /// these. Rounded to a whole number of epochs, at least one. Kept at 1 s
    /// when `epoch_ms` is shorter: an epoch right after a plan's moves still
    /// carries the load from before them (docs/design-notes.md).
    pub balance_epoch_ms: u64,
    /// The local balancer (Phase 2) runs in the controller, once per
    /// `balance_epoch_ms`.
    /// Default: on when the server is in a cluster.
    pub balancer: bool,
    /// The balancer policy's knobs (`mbal_balance::Config`).
    pub balance: mbal_balance::Config,
    /// `-D`: the byte that ends a key's prefix for `stats detail` (memcached's default `:`).
    pub prefix_delimiter: u8,
    /// `--worker-capacity`: emulated capacity of each worker, requests per
    /// second (`capacity.rs`); 0: unlimited.
    pub worker_capacity: u64,
    /// `-Z` with `-o ssl_chain_cert=...,ssl_key=...,ssl_ca_cert=...,ssl_verify_mode=N`: every
    /// listener (main and worker ports) speaks TLS only. `None`: plain TCP.
    pub tls: Option<mbal_tls::ServerTlsFiles>,
    /// TLS of this server's own connections to the other members (the
    /// replicator's, the forwarder's): the cluster file's `[tls]` CA, client
    /// certificate and server name. `None`: plain TCP.
    pub peer_tls: Option<mbal_tls::ClientTls>,
    /// `-Y FILE`: every connection must authenticate (text: memcached's
    /// ASCII auth; binary: SASL PLAIN), with these users (`auth`).
    pub auth: Option<std::sync::Arc<crate::credentials::Credentials>>,
    /// The cluster secret (`--control-secret-file`, or `secret` in the
    /// cluster file): control commands need a connection that proved it
    /// knows it (`mbal peer`). None: control commands only on loopback.
    pub control_secret: Option<mbal_member::peer_auth::Secret>,
    /// `--max-conns-per-ip`: open connections one source address may hold;
    /// 0: no limit but `-c`.
    pub max_conns_per_ip: usize,
    /// `--max-input-buffer`: bytes of unparsed input one connection may
    /// hold; a request that needs more is refused and the connection
    /// closed. 0: one largest request (`-I` plus a command line).
    pub max_input_buffer: usize,
    /// `--request-timeout-ms`: a connection that has sent part of a request
    /// and not the rest for this long is closed. 0: never.
    pub request_timeout_ms: u64,
    /// Phase 1, hot-key replication.
    pub hot: HotSettings,
    /// `--forward`: pass a plain client's requests for keys another server
    /// owns to that server (the forwarder), instead of answering for them.
    pub forward: bool,
    /// Milliseconds the forwarder waits for an answer before it gives the
    /// request (and every other in flight to that owner) an error.
    pub forward_timeout_ms: u64,
}

/// Phase 1's settings (`--hot-keys` and friends; DESIGN.md §6).
#[derive(Clone, Debug)]
pub struct HotSettings {
    /// Replicate hot keys to other servers. Default: on in a cluster of
    /// two or more servers.
    pub enabled: bool,
    /// The policy's knobs (sampling rate, tracker, target imbalance,
    /// REPL_high, lease length in epochs...).
    pub policy: mbal_balance::HotConfig,
    /// `--replica-memory`: bytes of copies of other servers' keys this
    /// server holds at most (split evenly between its workers).
    pub memory: usize,
    /// `--replica-writes sync`: a write to a replicated key is answered
    /// once every copy holds it (SE mode); default async (the reply does
    /// not wait; copies lag by the copy time, at most their time to live).
    pub sync: bool,
    /// `--replica-writes sync:<prefix>,...`: SE mode for the keys that start with one of these
    /// prefixes only, async for the rest.
    pub sync_prefixes: Vec<Box<[u8]>>,
    /// `--replica-timeout-ms`: how long the replicator waits for a shadow.
    pub timeout_ms: u64,
    /// Set by `apply`: the epoch length, which leases are counted in.
    pub epoch_ms: u64,
}

impl Default for HotSettings {
    fn default() -> Self {
        HotSettings {
            enabled: false,
            policy: mbal_balance::HotConfig::default(),
            memory: 64 << 20,
            sync: false,
            sync_prefixes: Vec::new(),
            timeout_ms: 500,
            epoch_ms: 500,
        }
    }
}

impl HotSettings {
    /// May a write wait for its copies (`--replica-writes sync`, or `sync:<prefixes>`)?
    pub fn may_sync(&self) -> bool {
        self.sync || !self.sync_prefixes.is_empty()
    }

    /// Is a write to `key` answered only once every copy holds it?
    pub fn sync_for(&self, key: &[u8]) -> bool {
        self.sync || self.sync_prefixes.iter().any(|p| key.starts_with(p))
    }

    /// `--replica-writes` as given: `async`, `sync` or `sync:<prefix>,...`.
    pub fn writes_mode(&self) -> String {
        if self.sync {
            "sync".into()
        } else if self.sync_prefixes.is_empty() {
            "async".into()
        } else {
            let p: Vec<String> = self.sync_prefixes.iter().map(|p| String::from_utf8_lossy(p).into_owned()).collect();
            format!("sync:{}", p.join(","))
        }
    }

    /// How long a client may read from copies after a hint: the policy's
    /// `lease_epochs` epochs.
    pub fn lease_ms(&self) -> u64 {
        u64::from(self.policy.lease_epochs.max(1)) * self.epoch_ms
    }

    /// How long a copy lives without renewal: two epochs beyond a lease, so
    /// that a lease granted just before a renewal is due still ends first.
    pub fn copy_ttl_ms(&self) -> u64 {
        self.lease_ms() + 2 * self.epoch_ms
    }
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            port: 11211,
            listen: "127.0.0.1".parse().unwrap(),
            threads: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            worker_threads: 0,
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
            maxconns_fast: true,
            sock_cookie_id: 0,
            track_sizes: false,
            worker_port_base: None,
            cachelets_per_worker: mbal_cluster::DEFAULT_CACHELETS_PER_WORKER,
            vn_count: mbal_cluster::DEFAULT_VN_COUNT,
            page_size: 64 << 10,
            cluster: None,
            max_inflight: 16384,
            debug_commands: false,
            epoch_ms: 500,
            balance_epoch_ms: 1000,
            balancer: false,
            balance: mbal_balance::Config::default(),
            prefix_delimiter: b':',
            worker_capacity: 0,
            tls: None,
            peer_tls: None,
            auth: None,
            control_secret: None,
            max_conns_per_ip: 0,
            max_input_buffer: 0,
            request_timeout_ms: 30_000,
            hot: HotSettings::default(),
            forward: false,
            forward_timeout_ms: 1000,
            coordinator: Vec::new(),
            coordinator_wait_ms: 10_000,
            leave_on_shutdown: true,
            join_warm: true,
            metrics_listen: None,
        }
    }
}

/// The id of a server that joins through the coordinator, until it has registered.
pub const JOIN: u16 = u16::MAX;

impl Settings {
    /// Epochs per Phase 2 epoch: `balance_epoch_ms` over `epoch_ms`,
    /// rounded, at least one.
    pub fn balance_every(&self) -> u64 {
        let e = self.epoch_ms.max(1);
        (self.balance_epoch_ms.saturating_add(e / 2) / e).max(1)
    }

    /// How this server dials the other members (the replicator and the
    /// forwarder): the cluster's TLS and secret, within `timeout`.
    pub fn peer_dialer(&self, timeout: std::time::Duration) -> mbal_member::dial::Dialer {
        mbal_member::dial::Dialer {
            tls: self.peer_tls.clone(),
            secret: self.control_secret.clone(),
            user: None,
            timeout,
        }
    }

    /// Join a cluster through its coordinator (`--coordinator` without `--id`): the key-space
    /// geometry and the worker count come from the cluster file, the addresses from the
    /// command line, the id from the coordinator when the server registers ([`JOIN`] until then).
    pub fn apply_cluster_join(&mut self, spec: mbal_member::ClusterSpec) -> Result<(), String> {
        spec.validate()?;
        self.threads = spec.workers as usize;
        self.cachelets_per_worker = spec.cachelets_per_worker;
        self.vn_count = spec.vn_count;
        self.cluster = Some((spec, JOIN));
        Ok(())
    }

    /// Take this server's place in a cluster: its address, worker ports,
    /// worker count and key-space geometry come from the cluster file.
    pub fn apply_cluster(&mut self, spec: mbal_member::ClusterSpec, id: u16) -> Result<(), String> {
        spec.validate()?;
        let me = spec
            .servers
            .get(id as usize)
            .ok_or_else(|| format!("--id {id}: the cluster has {} servers", spec.servers.len()))?;
        self.port = me.addr.port();
        self.listen = me.addr.ip();
        self.worker_port_base = me.worker_port_base;
        self.threads = spec.workers as usize;
        self.cachelets_per_worker = spec.cachelets_per_worker;
        self.vn_count = spec.vn_count;
        self.cluster = Some((spec, id));
        Ok(())
    }
}
