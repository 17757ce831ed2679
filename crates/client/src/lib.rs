//! `mbal-client`: the routing client of mbal (MBal §2.3, "on-the-way
//! routing"; DESIGN.md §4).
//!
//! # Design
//!
//! * **Blocking and synchronous.** Every call runs on the caller's thread
//!   over blocking `std::net` sockets with connect and I/O timeouts. No async
//!   API is provided; use one [`Client`] per thread (a `Client` is `Send`).
//! * **Two-level lookup on the client.** `key_hash(key)` → VN → cachelet (the
//!   map's fixed key space) → (server, worker), where the owner comes from an
//!   *override* learned from a redirect if there is one, else from the map.
//!   That routing state is an [`mbal_cluster::Router`], the one the bench and
//!   the proxy use too. The request goes to that worker's **own port**
//!   (`map.worker_addr(s, w)`), so the server never forwards it between
//!   threads.
//! * **Connections.** Per (server, worker) up to `conns_per_worker` pooled
//!   connections, opened lazily. Each opens with `mbal hello <epoch> <worker>
//!   threads`; the reply `MBAL <server> <worker> <epoch> <threads>` must name
//!   the worker the map says lives at that address (a plain memcached answers
//!   `ERROR`: [`Error::NotMbal`]). From then on the connection is *routed*:
//!   the server answers a request for a cachelet that neither its worker nor a
//!   worker on the same thread owns with `RD <epoch> <server> <worker>`
//!   instead of serving it.
//! * **By thread.** `<threads>` says how many threads run the server's
//!   workers (worker `w` on thread `w % threads`); a key owned by worker `o` is
//!   sent to worker `o % threads`, the first of its owner's thread
//!   ([`Router::conn_of`]), which serves it on the owner's store. So the client
//!   keeps one busy connection per server thread, not per worker, and each
//!   carries a deeper pipeline. Before the first hello to a server, and after a
//!   redirect showed its thread count stale (the server spread its workers over
//!   more threads), that server's keys go to their owners' own connections; the
//!   client then asks again with `mbal hello` ([`Client::server_threads`]). A connection that
//!   sees an I/O error, a timeout or a malformed reply is dropped; the next
//!   call reconnects (see "A dead server" for a server that cannot be reached).
//! * **Redirects.** On `RD` the router records an override for the key's
//!   cachelet; when the redirect's epoch is newer than the map's, the client
//!   refetches the whole map (`mbal map`, from the redirecting worker) and
//!   installs it (overrides not newer than it are forgotten). It retries at
//!   the new owner, at most [`Config::max_redirects`] times per request
//!   ([`Error::TooManyRedirects`]). [`Client::redirects`] counts the
//!   redirects followed. Today each server moves cachelets between its own
//!   workers and keeps its own epoch, so epochs of different servers are not
//!   comparable: a redirect whose epoch is not newer than the client's map
//!   still records its override (that is what makes it work), and a refetch
//!   from a server with a newer epoch may forget an override learned from
//!   another server, which then costs one more redirect. A multi-key `get`
//!   that the server redirects as a whole does not say which cachelet moved;
//!   unless all its keys share one cachelet, nothing is recorded and the
//!   retry groups the keys per cachelet, so the next redirect is
//!   attributable (the router's rule, the same in the bench).
//! * **Text protocol, pipelined.** Replies are parsed incrementally by
//!   [`mbal_proto::client::ReplyReader`]. [`Client::get_multi`] splits keys by
//!   owning worker ([`mbal_cluster::Router::split`]), writes one
//!   `get k1 k2 ...` per worker (all workers' requests are written before any
//!   reply is read), reads the replies and reassembles them in request order
//!   by the keys' positions; redirected keys are re-split per cachelet with
//!   the updated routing and retried. [`Client::set_multi`] writes all of a
//!   worker's sets back to back, then reads their replies. To keep both
//!   sides' socket buffers from filling up (a deadlock when both block on
//!   writes), a multi-operation is processed in windows of [`MULTI_WINDOW`]
//!   keys, and a `get` line carries at most [`GET_BATCH`] keys.
//! * **Hot-key replicas (Phase 1).** A read at a key's home may carry a
//!   hint `RH hot <key> <replicas> <lease-ms>` (docs/protocol.md); the
//!   client records it in an [`mbal_cluster::Leases`] (the lease cache the
//!   bench and the proxy use too), which draws one copy per lease. While a
//!   key's lease is live, `get` (and `get_multi`, one `get` per such key)
//!   reads the drawn copy (`gets` always reads at home: a copy has no CAS of
//!   its own); the copies' requests of a `get_multi` go out
//!   and are answered before the rest is sent home. Writes always go home,
//!   and a write (any storage command, `delete`, `incr`/`decr`, `touch`,
//!   `set_multi`) ends this client's lease on the key, so it reads its
//!   writes at home. An `RD`, an error reply, an I/O error or a refused
//!   connection at a copy ends the lease (on an I/O failure, every lease at
//!   that copy, and the copy is not tried again for
//!   [`mbal_cluster::COPY_RETRY`]) and the key is read at home: the caller
//!   sees no error.
//!   [`Client::replica_reads`] and [`Client::replica_fallbacks`] count both.
//! * **A dead server.** A server the client cannot reach (a connect refused or not done
//!   within `connect_timeout`, a connection reset or closed, a reply not read within
//!   `io_timeout`) costs misses, not errors or hangs: a read of its keys (`get`, `gets`, and
//!   its keys of a `get_multi`) is a miss, a write or any other command an
//!   [`Error::Unreachable`] naming it (`set_multi`: the call's error, after the other
//!   servers' items are stored). The server then has a backoff (100 ms, doubling to 1 s on
//!   every failed retry, [`mbal_cluster::Health`], shared with the proxy) during which its
//!   keys are answered that way without touching the network; after it the next request
//!   dials it, and a server that answers is used again. A pooled connection found closed is
//!   not a failure by itself (the server may have restarted): a fresh connection decides,
//!   and a read is resent on it once. The first failure, and each failed retry, also asks
//!   the coordinators (the cluster file's, [`Client::with_coordinators`];
//!   `mbal_member::coordinators`), else another server of the map (one not in its backoff),
//!   for the map (`mbal map`) and installs it if it is newer: when the cluster gave the dead
//!   server's cachelets to others, its keys go there, the failed request included.
//!   [`Client::stats`] counts `unreachable`, `unreachable_misses`, `unreachable_errors`,
//!   `map_refreshes`, `maps_installed`, `map_coordinator_fetches` and
//!   `map_coordinator_failures`.
//! * **Stats.** [`cluster_stats`] reads `stats` and `stats workers` from each
//!   server's main port; [`render_stats_table`] renders a per-server and
//!   per-worker table (ops/s from two samples, hit ratio, items, bytes,
//!   cachelets) for `mbal stats`.
//!
//! Keys are checked client-side as memcached's text protocol requires:
//! 1..=250 bytes, no spaces or control characters ([`Error::InvalidKey`]).

mod conn;
mod down;
mod multi;
mod stats;

pub use mbal_cluster::{key_hash, ClusterMap};
pub use mbal_member::ClusterSpec;
pub use stats::{cluster_stats, cluster_stats_dialed, render_stats_table, ServerStats, WorkerStats};

use conn::Conn;
use mbal_cluster::{Health, Leases, Owner, Redirect, Router};
use mbal_proto::client::{Expect, OwnedValue, Reply};
use std::collections::HashMap;
use std::fmt;
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Most keys in one multi-operation window (see the crate docs).
pub const MULTI_WINDOW: usize = 1024;
/// Most keys on one `get` line.
pub const GET_BATCH: usize = 128;
/// memcached's key length limit.
pub const MAX_KEY_LEN: usize = 250;

/// Client settings.
#[derive(Clone, Debug)]
pub struct Config {
    /// Timeout of one TCP connect (a server that does not accept in time is unreachable).
    pub connect_timeout: Duration,
    /// Timeout of one read or write on a connection.
    pub io_timeout: Duration,
    /// Redirects followed per request before [`Error::TooManyRedirects`].
    pub max_redirects: u32,
    /// Pooled connections per (server, worker).
    pub conns_per_worker: usize,
    /// Talk TLS to every server (`None`: plain TCP). Loaded with
    /// [`mbal_tls::ClientTls::load`]: the CA to trust, an optional client
    /// certificate, the expected server name (default: the address's IP).
    pub tls: Option<mbal_tls::ClientTls>,
    /// Most keys with a hot-key lease held at once (oldest dropped).
    pub max_leases: usize,
    /// Username and password for servers started with `-Y`: each new
    /// connection authenticates first (memcached's ASCII auth).
    pub login: Option<Login>,
}

/// A username and password (memcached's ASCII auth: neither may contain a
/// space). Its `Debug` form shows the user only.
#[derive(Clone, PartialEq, Eq)]
pub struct Login {
    pub user: String,
    pub password: String,
}

impl std::fmt::Debug for Login {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Login({:?}, ..)", self.user)
    }
}

impl Login {
    /// The authentication request: a `set` whose data is `user password`.
    pub fn request(&self) -> Vec<u8> {
        let token = format!("{} {}", self.user, self.password);
        format!("set auth 0 0 {}\r\n{token}\r\n", token.len()).into_bytes()
    }
}

impl Default for Config {
    fn default() -> Config {
        Config {
            connect_timeout: Duration::from_secs(1),
            io_timeout: Duration::from_secs(5),
            max_redirects: u32::from(mbal_cluster::MAX_REDIRECTS),
            conns_per_worker: 1,
            tls: None,
            max_leases: mbal_cluster::DEFAULT_MAX_LEASES,
            login: None,
        }
    }
}

/// A retrieved value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Value {
    pub data: Vec<u8>,
    pub flags: u32,
    /// Set by [`Client::gets`] only (`get` and `get_multi` do not ask for it).
    pub cas: Option<u64>,
}

impl From<OwnedValue> for Value {
    fn from(v: OwnedValue) -> Value {
        Value { data: v.data, flags: v.flags, cas: v.cas }
    }
}

/// Outcome of [`Client::cas`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CasResult {
    Stored,
    /// The item was modified since the cas value was read.
    Exists,
    NotFound,
}

/// Who an error is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peer {
    /// A worker's own port.
    Worker { server: u16, worker: u16 },
    /// A server's main port.
    Server(u16),
    /// An address given by the caller, of a server whose id is not known yet.
    Unknown,
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Peer::Worker { server, worker } => write!(f, "server {server} worker {worker}"),
            Peer::Server(s) => write!(f, "server {s}"),
            Peer::Unknown => write!(f, "server"),
        }
    }
}

/// Everything that can go wrong.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("I/O error talking to {peer} at {addr}: {source}")]
    Io {
        addr: SocketAddr,
        peer: Peer,
        #[source]
        source: std::io::Error,
    },
    #[error("timed out talking to {peer} at {addr}")]
    Timeout { addr: SocketAddr, peer: Peer },
    /// The server could not be reached (a connect refused or timed out, a connection reset
    /// or closed, a request unanswered for `io_timeout`), now or within its backoff: a write
    /// or other command for its keys fails with this (a read is a miss instead). See the
    /// crate docs, "A dead server".
    #[error("mbal {peer} at {addr} unreachable: {reason}")]
    Unreachable { addr: SocketAddr, peer: Peer, reason: String },
    /// `ERROR`, `CLIENT_ERROR ...` or `SERVER_ERROR ...`.
    #[error("{peer} at {addr} refused the request: {line}")]
    Server { addr: SocketAddr, peer: Peer, line: String },
    #[error("protocol error from {peer} at {addr}: {detail}")]
    Protocol { addr: SocketAddr, peer: Peer, detail: String },
    #[error("{addr} is not an mbal server (it answered ERROR to `mbal hello`/`mbal map`)")]
    NotMbal { addr: SocketAddr },
    #[error("key {key:?}: still redirected after {redirects} redirects")]
    TooManyRedirects { key: String, redirects: u32 },
    #[error("invalid key {key:?}: {reason}")]
    InvalidKey { key: String, reason: &'static str },
    #[error("cluster file {path}: {detail}")]
    Config { path: PathBuf, detail: String },
}

pub type Result<T> = std::result::Result<T, Error>;

fn show_key(key: &[u8]) -> String {
    String::from_utf8_lossy(key).into_owned()
}

/// Check a key against memcached's text-protocol rules.
pub fn check_key(key: &[u8]) -> Result<()> {
    let reason = if key.is_empty() {
        "empty"
    } else if key.len() > MAX_KEY_LEN {
        "longer than 250 bytes"
    } else if key.iter().any(|&b| b <= b' ' || b == 0x7f) {
        "contains a space or control character"
    } else {
        return Ok(());
    };
    Err(Error::InvalidKey { key: show_key(key), reason })
}

/// Pooled connections of one worker.
#[derive(Default)]
struct Pool {
    slots: Vec<Option<Conn>>,
    next: usize,
}

/// A redirect seen while reading replies, learned once no replies are
/// pending: who sent it, and the hashes of the keys of the request it
/// replaced.
struct Seen {
    from: Owner,
    rd: Redirect,
    hashes: Vec<u64>,
}

/// The routing client. See the crate docs.
pub struct Client {
    /// Map, overrides, redirect learning (shared with the bench and the proxy).
    router: Router,
    /// Hot-key leases: which copy a read goes to (shared with the bench and the proxy).
    leases: Leases,
    cfg: Config,
    pools: HashMap<Owner, Pool>,
    /// Workers that redirected to another worker of their server (see `refresh_threads`).
    stale_threads: Vec<Owner>,
    /// Servers that could not be reached, their backoff, when to refresh the map (shared
    /// with the proxy).
    health: Health,
    /// Per server: why it was last found unreachable (for the errors of its backoff).
    down_reason: Vec<String>,
    /// A map refresh is running (it dials, and a failed dial asks for another refresh).
    refreshing: bool,
    /// The cluster's coordinators (the cluster file's), asked for the map before any server
    /// (`mbal_member::coordinators`), with the connection kept to the last that answered.
    coordinators: Option<(mbal_member::coordinators::Coordinators, mbal_member::coordinators::Link)>,
    stats: ClientStats,
}

/// The client's counters ([`Client::stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClientStats {
    /// Redirects followed.
    pub redirects: u64,
    /// Reads served by a copy of a hot key (not its home).
    pub replica_reads: u64,
    /// Reads that went to a copy and fell back to the home.
    pub replica_fallbacks: u64,
    /// Times a server could not be reached (each starts or extends its backoff).
    pub unreachable: u64,
    /// Keys read (`get`, `gets`, `get_multi`) of a server that could not be reached,
    /// answered as misses.
    pub unreachable_misses: u64,
    /// Writes and other commands for keys of a server that could not be reached, answered
    /// [`Error::Unreachable`] (per key for `set_multi`).
    pub unreachable_errors: u64,
    /// `mbal map` fetches from another server after one could not be reached.
    pub map_refreshes: u64,
    /// Newer maps installed (from a refresh or a redirect naming a newer epoch).
    pub maps_installed: u64,
    /// Map fetches asked of the coordinators (a refresh or a redirect naming a newer epoch),
    /// and those no coordinator answered (then a server was asked).
    pub map_coordinator_fetches: u64,
    pub map_coordinator_failures: u64,
}

/// A seed that differs between clients (and processes), so that clients
/// spread their leases over a key's copies.
fn lease_seed() -> u64 {
    use std::hash::BuildHasher;
    // randomly keyed per process, and a new key per `RandomState`
    std::collections::hash_map::RandomState::new().hash_one(std::process::id())
}

impl Client {
    /// A client for a known map.
    pub fn from_map(map: ClusterMap, cfg: Config) -> Client {
        let cfg = Config { conns_per_worker: cfg.conns_per_worker.max(1), ..cfg };
        Client {
            router: Router::new(map),
            leases: Leases::new(lease_seed(), cfg.max_leases),
            cfg,
            pools: HashMap::new(),
            stale_threads: Vec::new(),
            health: Health::new(),
            down_reason: Vec::new(),
            refreshing: false,
            coordinators: None,
            stats: ClientStats::default(),
        }
    }

    /// Ask these coordinators for the map first whenever it is needed (a server could not be
    /// reached, a redirect named a newer epoch); the servers only when none answers. Nothing
    /// is fetched here. [`Client::from_cluster_file`] takes the file's coordinators.
    pub fn with_coordinators(mut self, addrs: Vec<SocketAddr>) -> Client {
        self.coordinators = (!addrs.is_empty()).then(|| {
            let c = mbal_member::coordinators::Coordinators {
                addrs,
                tls: self.cfg.tls.clone(),
                // each connect, read and write: the client's connect timeout (1 s by default)
                timeout: self.cfg.connect_timeout,
            };
            (c, mbal_member::coordinators::Link::default())
        });
        self
    }

    /// The map from the coordinators, if the client has them and one answers: installed if
    /// newer. Whether one answered.
    pub(crate) fn map_from_coordinators(&mut self) -> bool {
        let Some((c, link)) = self.coordinators.as_mut() else { return false };
        self.stats.map_coordinator_fetches += 1;
        let have = self.router.map().epoch();
        // An empty answer: the coordinator's map is no newer than this one.
        let fetched = match c.fetch_with(link, Some(have)) {
            Ok((epoch, json)) if json.is_empty() => Ok((epoch, None)),
            Ok((epoch, json)) => ClusterMap::from_json(&String::from_utf8_lossy(&json)).map(|m| (epoch, Some(m))),
            Err(e) => Err(e.to_string()),
        };
        match fetched {
            Ok((epoch, m)) => {
                let _ = self.take_map(epoch, m);
                true
            }
            Err(_) => {
                self.stats.map_coordinator_failures += 1;
                false
            }
        }
    }

    /// A client for the cluster described by a TOML cluster file (the
    /// initial map, epoch 1; redirects teach it later changes). Without
    /// `cfg.tls`, the file's `[tls]` (its CA, client certificate and server
    /// name) is used when it has one.
    pub fn from_cluster_file(path: &Path, mut cfg: Config) -> Result<Client> {
        let file = mbal_member::ClusterFile::load(path)
            .map_err(|detail| Error::Config { path: path.to_path_buf(), detail })?;
        if cfg.tls.is_none() {
            cfg.tls = file.client_tls;
        }
        // With coordinators named, the map is theirs (newer than the file's initial one when
        // the cluster changed since); the file's if none answers.
        let coordinators = file.spec.coordinators.clone();
        let mut c = Client::from_map(file.spec.initial_map(), cfg).with_coordinators(coordinators);
        if c.coordinators.is_some() {
            c.map_from_coordinators();
        }
        Ok(c)
    }

    /// A client for the cluster `any_server` (a main or worker port) belongs
    /// to: the map is fetched with `mbal map`.
    pub fn connect(any_server: SocketAddr, cfg: Config) -> Result<Client> {
        let mut c = Conn::open(any_server, Peer::Unknown, cfg.connect_timeout, cfg.io_timeout, cfg.tls.as_ref())?;
        c.login(cfg.login.as_ref())?;
        let map = fetch_map(&mut c, None)?.1.expect("a whole map is asked for");
        Ok(Client::from_map(map, cfg))
    }

    /// The settings in use (with the cluster file's TLS, if it was taken).
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The cluster map as last fetched (without the overrides learned from
    /// redirects; see [`Client::route`]).
    pub fn map(&self) -> &ClusterMap {
        self.router.map()
    }

    /// Redirects followed so far.
    pub fn redirects(&self) -> u64 {
        self.router.redirects()
    }

    /// Reads served by a copy of a hot key (not its home).
    pub fn replica_reads(&self) -> u64 {
        self.stats.replica_reads
    }

    /// The client's counters.
    pub fn stats(&self) -> ClientStats {
        ClientStats { redirects: self.router.redirects(), ..self.stats }
    }

    /// Is server `s` in its backoff now (its keys answered without the network)?
    pub fn is_down(&self, s: u16) -> bool {
        self.health.is_down(s, Instant::now())
    }

    /// Reads that went to a copy and fell back to the home (the copy
    /// answered `RD` or an error, or its connection failed).
    pub fn replica_fallbacks(&self) -> u64 {
        self.stats.replica_fallbacks
    }

    /// How many threads run server `s`'s workers, as its last `mbal hello` said (0: not
    /// known yet, or a redirect showed it stale: its keys go to their owners' own connections).
    pub fn server_threads(&self, s: u16) -> u16 {
        self.router.threads(s)
    }

    /// The workers this client holds a pooled connection to, sorted.
    pub fn connected(&self) -> Vec<Owner> {
        let mut v: Vec<Owner> =
            self.pools.iter().filter(|(_, p)| p.slots.iter().any(Option::is_some)).map(|(&o, _)| o).collect();
        v.sort_unstable();
        v
    }

    /// The hot-key leases held.
    pub fn leases(&self) -> &Leases {
        &self.leases
    }

    /// Record the hints read on a connection to a key's home or to a worker of its thread
    /// (hints from a copy are dropped). The key's home is its owner as routed.
    fn record_hints(&mut self, conn: &mut Conn, at_home: bool) {
        let hints = conn.take_hints();
        if !at_home {
            return;
        }
        let now = Instant::now();
        for h in hints {
            let hash = key_hash(&h.key);
            let (_, home) = self.router.route_hash(hash);
            self.leases.record(self.router.map(), hash, home, h.replicas, h.lease_ms, now);
        }
    }

    /// Read `key` at the copy its lease drew: `Some(value or miss)`, or
    /// `None` when the copy could not answer it (the lease is ended; the
    /// caller reads at home). `req` is a single-key retrieval of `key`.
    fn read_copy(&mut self, copy: Owner, key: &[u8], req: &[u8]) -> Option<Option<Value>> {
        let hash = key_hash(key);
        let res = self.take_conn(copy.0, copy.1).and_then(|mut c| match c.call(req, Expect::Values) {
            Ok(r) => {
                c.take_hints();
                self.put_conn(c);
                Ok(r)
            }
            Err(e) => Err(e),
        });
        match res {
            Ok(Reply::Values(mut vs)) if vs.len() <= 1 && vs.first().is_none_or(|v| v.key == key) => {
                self.stats.replica_reads += 1;
                Some(vs.pop().map(Value::from))
            }
            Ok(Reply::Redirect { .. } | Reply::Error(_)) => {
                // RD (the copy is gone or not there yet) or an error line
                self.leases.end(hash);
                self.stats.replica_fallbacks += 1;
                None
            }
            Ok(_) | Err(_) => {
                // other keys (not trusted), or the connection failed: every lease at that copy ends
                self.leases.copy_failed(copy, Instant::now(), mbal_cluster::COPY_RETRY);
                self.leases.end(hash);
                self.stats.replica_fallbacks += 1;
                None
            }
        }
    }

    /// (cachelet, server, worker) a key is sent to now.
    pub fn route(&self, key: &[u8]) -> (u32, u16, u16) {
        self.route_hash(key_hash(key))
    }

    fn route_hash(&self, hash: u64) -> (u32, u16, u16) {
        let (c, (s, w)) = self.router.route_hash(hash);
        (c, s, w)
    }

    /// A pooled connection to (s, w), or a new one (after `mbal hello`). A server in its
    /// backoff is not dialed: [`Error::Unreachable`] at once.
    fn take_conn(&mut self, s: u16, w: u16) -> Result<Conn> {
        if self.health.any_down() && self.health.is_down(s, Instant::now()) {
            // A redirect to it from a server behind the map, learned during its backoff, is
            // done with (`Router`'s doc): the next request goes where the map says.
            self.router.forget_stale_redirects_to(s);
            if self.health.refresh_due(Instant::now()) {
                self.refresh_map(s);
            }
            return Err(self.in_backoff(s, w));
        }
        let addr = self.router.map().worker_addr(s, w);
        let n = self.cfg.conns_per_worker;
        let pool = self.pools.entry((s, w)).or_default();
        if pool.slots.len() < n {
            pool.slots.resize_with(n, || None);
        }
        let i = pool.next % n;
        pool.next = pool.next.wrapping_add(1);
        if let Some(mut c) = pool.slots[i].take() {
            if c.addr == addr {
                c.reused = true;
                return Ok(c);
            }
        }
        self.dial(s, w)
    }

    /// A new connection to (s, w) (after `mbal hello`). A server that cannot be reached is
    /// marked down ([`Client::server_failed`]); one that answers is used again.
    fn dial(&mut self, s: u16, w: u16) -> Result<Conn> {
        let addr = self.router.map().worker_addr(s, w);
        let peer = Peer::Worker { server: s, worker: w };
        let opened = Conn::open(addr, peer, self.cfg.connect_timeout, self.cfg.io_timeout, self.cfg.tls.as_ref())
            .and_then(|mut c| c.login(self.cfg.login.as_ref()).map(|()| c))
            .and_then(|c| self.hello(c, s, w));
        match opened {
            Ok(c) => {
                self.health.reachable(s);
                Ok(c)
            }
            Err(e) => Err(self.server_failed(s, w, e)),
        }
    }

    /// `mbal hello` on a connection to (s, w): it becomes routed (or stays so), and the
    /// server's thread count is learned ([`Router::set_threads`]).
    fn hello(&mut self, mut c: Conn, s: u16, w: u16) -> Result<Conn> {
        let (addr, peer) = (c.addr, c.peer);
        let epoch = self.router.map().epoch();
        let mut reply = c.call(format!("mbal hello {epoch} {w} threads\r\n").as_bytes(), Expect::Line)?;
        if matches!(&reply, Reply::Error(l) if l.starts_with("CLIENT_ERROR")) {
            // An older mbal does not know `threads`: routed per worker, as it serves.
            reply = c.call(format!("mbal hello {epoch} {w}\r\n").as_bytes(), Expect::Line)?;
        }
        match reply {
            Reply::Hello { server, worker, threads, .. } if (server, worker) == (s, w) => {
                self.router.set_threads(s, threads);
                Ok(c)
            }
            Reply::Hello { server, worker, .. } => Err(Error::Protocol {
                addr,
                peer,
                detail: format!("the map says {peer} listens here, but it is server {server} worker {worker}"),
            }),
            Reply::Error(l) if l == "ERROR" => Err(Error::NotMbal { addr }),
            r => Err(c.unexpected("mbal hello", &r)),
        }
    }

    /// Return a healthy connection to its pool.
    fn put_conn(&mut self, c: Conn) {
        let Peer::Worker { server, worker } = c.peer else { return };
        let pool = self.pools.entry((server, worker)).or_default();
        if let Some(slot) = pool.slots.iter_mut().find(|s| s.is_none()) {
            *slot = Some(c);
        }
    }

    /// The end of one round of a multi-key operation: report the first
    /// error, or learn the redirects seen (`first_redirected`: a key that
    /// must be retried, if any), bounded by `max_redirects` rounds.
    fn end_round(
        &mut self,
        first_err: Option<Error>,
        first_redirected: Option<&[u8]>,
        seen: Vec<Seen>,
        rounds: &mut u32,
    ) -> Result<()> {
        if let Some(e) = first_err {
            return Err(e);
        }
        if let Some(key) = first_redirected {
            if *rounds == self.cfg.max_redirects {
                return Err(Error::TooManyRedirects { key: show_key(key), redirects: *rounds });
            }
            *rounds += 1;
            self.learn(seen)?;
        }
        Ok(())
    }

    /// Learn from redirects ([`Router::learn`]); when one names a newer
    /// epoch, fetch the map from its sender and install it.
    fn learn(&mut self, seen: Vec<Seen>) -> Result<()> {
        for r in seen {
            let (s, w) = r.from;
            let learned = self.router.learn(r.from, r.rd, r.hashes).map_err(|e| Error::Protocol {
                addr: self.router.map().worker_addr(s, w),
                peer: Peer::Worker { server: s, worker: w },
                detail: e.to_string(),
            })?;
            // A redirect to another worker of the same server ends the sender's serving of its
            // thread-mates' keys (docs/protocol.md): say hello there again once the request is
            // done (`refresh_threads`), which also gives the thread count anew. Until then a
            // stale count (`threads_stale`) routes that server per worker.
            if r.rd.to.0 == s && r.rd.to != r.from && !self.stale_threads.contains(&r.from) {
                self.stale_threads.push(r.from);
            }
            if let Some((s, w)) = learned.fetch_map_from {
                if self.map_from_coordinators() {
                    continue;
                }
                let mut c = self.take_conn(s, w)?;
                let (epoch, map) = match fetch_map(&mut c, Some(self.router.map().epoch())) {
                    Ok(m) => m,
                    Err(e) => return Err(self.conn_failed(c, e)),
                };
                self.put_conn(c);
                self.take_map(epoch, map).map_err(|detail| Error::Protocol {
                    addr: self.router.map().worker_addr(s, w),
                    peer: Peer::Worker { server: s, worker: w },
                    detail,
                })?;
            }
        }
        Ok(())
    }

    /// Say `mbal hello ... threads` again to the workers that redirected to a thread-mate
    /// (a failure leaves that server routed as it was, or per worker if its count was stale).
    fn refresh_threads(&mut self) {
        while let Some((s, w)) = self.stale_threads.pop() {
            if let Ok(c) = self.take_conn(s, w).and_then(|c| self.hello(c, s, w)) {
                self.put_conn(c);
            }
        }
    }

    /// Send a one-key request to the key's owner, following redirects.
    /// Returns the reply and who sent it. `Reply::Error` becomes
    /// [`Error::Server`].
    /// Anything but a retrieval is a write: it ends this client's lease on
    /// the key (read-your-writes).
    ///
    /// A server that cannot be reached gives [`Error::Unreachable`] (counted as an error for
    /// a write; the caller of a read makes it a miss), unless the map refresh it caused moved
    /// the key to another server: then the request goes there (at most `max_redirects`
    /// times). A pooled connection the server closed is replaced and a read resent on the new
    /// one, once.
    fn keyed(&mut self, key: &[u8], req: &[u8], expect: Expect) -> Result<(Reply, SocketAddr, Peer)> {
        let hash = key_hash(key);
        if expect != Expect::Values {
            self.leases.end(hash);
        }
        let mut followed = 0;
        let mut resent = false;
        loop {
            // The owner's thread's connection (the owner's own unless its server's threads
            // are known).
            let (_, owner) = self.router.route_hash(hash);
            let (s, w) = self.router.conn_of(owner);
            let epoch = self.router.map().epoch();
            let called = match self.take_conn(s, w) {
                Ok(mut conn) => match conn.call(req, expect) {
                    Ok(reply) => Ok((conn, reply)),
                    Err(e) => Err(self.conn_failed(conn, e)),
                },
                Err(e) => Err(e),
            };
            let (mut conn, reply) = match called {
                Ok(x) => x,
                Err(e @ Error::Unreachable { .. }) => {
                    // Only a newer map: a stale redirect forgotten sends the key back to the
                    // redirect's sender, which would send it here again (until it hears).
                    let moved = self.router.map().epoch() != epoch
                        && self.router.conn_of(self.router.route_hash(hash).1) != (s, w);
                    if moved && followed < self.cfg.max_redirects {
                        followed += 1; // the refreshed map moved the key: try its new owner
                        continue;
                    }
                    if expect != Expect::Values {
                        self.stats.unreachable_errors += 1;
                    }
                    return Err(e);
                }
                Err(e) if conn::was_closed(&e) && expect == Expect::Values && !resent => {
                    resent = true; // a closed pooled connection, replaced: the read again
                    continue;
                }
                Err(e) => return Err(e),
            };
            let (addr, peer) = (conn.addr, conn.peer);
            self.record_hints(&mut conn, true);
            self.put_conn(conn);
            self.health.reachable(s);
            match reply {
                Reply::Redirect { epoch, server, worker } => {
                    if followed == self.cfg.max_redirects {
                        return Err(Error::TooManyRedirects { key: show_key(key), redirects: followed });
                    }
                    followed += 1;
                    let rd = Redirect { epoch, to: (server, worker) };
                    self.learn(vec![Seen { from: (s, w), rd, hashes: vec![hash] }])?;
                }
                Reply::Error(line) => return Err(Error::Server { addr, peer, line }),
                r => {
                    self.refresh_threads();
                    return Ok((r, addr, peer));
                }
            }
        }
    }

    fn retrieve(&mut self, cmd: &str, key: &[u8]) -> Result<Option<Value>> {
        check_key(key)?;
        let mut req = Vec::with_capacity(key.len() + 8);
        req.extend_from_slice(cmd.as_bytes());
        req.push(b' ');
        req.extend_from_slice(key);
        req.extend_from_slice(b"\r\n");
        let hash = key_hash(key);
        // only `get` reads a copy: a copy has no CAS of its own (`gets` goes home)
        let copy = if cmd == "get" { self.leases.read_target(hash, Instant::now()) } else { None };
        if let Some(copy) = copy {
            if let Some(v) = self.read_copy(copy, key, &req) {
                return Ok(v);
            }
        }
        let answer = match self.keyed(key, &req, Expect::Values) {
            Err(Error::Unreachable { .. }) => {
                // a cache that cannot reach a key's server misses
                self.stats.unreachable_misses += 1;
                return Ok(None);
            }
            r => r?,
        };
        match answer {
            (Reply::Values(mut vs), addr, peer) => {
                if vs.len() > 1 || vs.first().is_some_and(|v| v.key != key) {
                    return Err(Error::Protocol { addr, peer, detail: format!("{cmd} returned other keys") });
                }
                Ok(vs.pop().map(Value::from))
            }
            (r, addr, peer) => Err(unexpected(addr, peer, cmd, &r)),
        }
    }

    /// `get`: the value, or `None` on a miss.
    pub fn get(&mut self, key: &[u8]) -> Result<Option<Value>> {
        self.retrieve("get", key)
    }

    /// `gets`: like [`Client::get`] with the item's CAS value.
    pub fn gets(&mut self, key: &[u8]) -> Result<Option<Value>> {
        self.retrieve("gets", key)
    }

    fn store(
        &mut self,
        cmd: &str,
        key: &[u8],
        data: &[u8],
        flags: u32,
        exptime: u32,
        cas: Option<u64>,
    ) -> Result<Reply> {
        check_key(key)?;
        let mut req = Vec::with_capacity(key.len() + data.len() + 48);
        store_request(&mut req, cmd, key, data, flags, exptime, cas);
        let (r, addr, peer) = self.keyed(key, &req, Expect::Line)?;
        match (&r, cas) {
            (Reply::Stored | Reply::NotStored, None) | (Reply::Stored | Reply::Exists | Reply::NotFound, Some(_)) => {
                Ok(r)
            }
            _ => Err(unexpected(addr, peer, cmd, &r)),
        }
    }

    /// `set`: true when stored.
    pub fn set(&mut self, key: &[u8], data: &[u8], flags: u32, exptime: u32) -> Result<bool> {
        Ok(self.store("set", key, data, flags, exptime, None)? == Reply::Stored)
    }

    /// `add`: false (NOT_STORED) when the key exists.
    pub fn add(&mut self, key: &[u8], data: &[u8], flags: u32, exptime: u32) -> Result<bool> {
        Ok(self.store("add", key, data, flags, exptime, None)? == Reply::Stored)
    }

    /// `replace`: false (NOT_STORED) when the key does not exist.
    pub fn replace(&mut self, key: &[u8], data: &[u8], flags: u32, exptime: u32) -> Result<bool> {
        Ok(self.store("replace", key, data, flags, exptime, None)? == Reply::Stored)
    }

    /// `append` (flags and exptime are sent but ignored by the server).
    pub fn append(&mut self, key: &[u8], data: &[u8], flags: u32, exptime: u32) -> Result<bool> {
        Ok(self.store("append", key, data, flags, exptime, None)? == Reply::Stored)
    }

    /// `prepend` (flags and exptime are sent but ignored by the server).
    pub fn prepend(&mut self, key: &[u8], data: &[u8], flags: u32, exptime: u32) -> Result<bool> {
        Ok(self.store("prepend", key, data, flags, exptime, None)? == Reply::Stored)
    }

    /// `cas`: store only if the item's CAS value is still `cas`.
    pub fn cas(&mut self, key: &[u8], data: &[u8], flags: u32, exptime: u32, cas: u64) -> Result<CasResult> {
        Ok(match self.store("cas", key, data, flags, exptime, Some(cas))? {
            Reply::Stored => CasResult::Stored,
            Reply::Exists => CasResult::Exists,
            _ => CasResult::NotFound,
        })
    }

    /// `delete`: true when the key existed.
    pub fn delete(&mut self, key: &[u8]) -> Result<bool> {
        check_key(key)?;
        let req = [b"delete ", key, b"\r\n"].concat();
        match self.keyed(key, &req, Expect::Line)? {
            (Reply::Deleted, ..) => Ok(true),
            (Reply::NotFound, ..) => Ok(false),
            (r, addr, peer) => Err(unexpected(addr, peer, "delete", &r)),
        }
    }

    fn arith(&mut self, cmd: &str, key: &[u8], delta: u64) -> Result<Option<u64>> {
        check_key(key)?;
        let req = [cmd.as_bytes(), b" ", key, format!(" {delta}\r\n").as_bytes()].concat();
        match self.keyed(key, &req, Expect::Line)? {
            (Reply::Number(n), ..) => Ok(Some(n)),
            (Reply::NotFound, ..) => Ok(None),
            (r, addr, peer) => Err(unexpected(addr, peer, cmd, &r)),
        }
    }

    /// `incr`: the new value, `None` if the key does not exist. A value that
    /// is not a number is [`Error::Server`] (`CLIENT_ERROR`).
    pub fn incr(&mut self, key: &[u8], delta: u64) -> Result<Option<u64>> {
        self.arith("incr", key, delta)
    }

    /// `decr` (stops at 0).
    pub fn decr(&mut self, key: &[u8], delta: u64) -> Result<Option<u64>> {
        self.arith("decr", key, delta)
    }

    /// `touch`: true when the key exists.
    pub fn touch(&mut self, key: &[u8], exptime: u32) -> Result<bool> {
        check_key(key)?;
        let req = [b"touch ", key, format!(" {exptime}\r\n").as_bytes()].concat();
        match self.keyed(key, &req, Expect::Line)? {
            (Reply::Touched, ..) => Ok(true),
            (Reply::NotFound, ..) => Ok(false),
            (r, addr, peer) => Err(unexpected(addr, peer, "touch", &r)),
        }
    }
}

fn unexpected(addr: SocketAddr, peer: Peer, req: &str, r: &Reply) -> Error {
    Error::Protocol { addr, peer, detail: format!("unexpected reply {r:?} to {req}") }
}

fn store_request(req: &mut Vec<u8>, cmd: &str, key: &[u8], data: &[u8], flags: u32, exptime: u32, cas: Option<u64>) {
    req.extend_from_slice(cmd.as_bytes());
    req.push(b' ');
    req.extend_from_slice(key);
    let _ = write!(req, " {flags} {exptime} {}", data.len());
    if let Some(c) = cas {
        let _ = write!(req, " {c}");
    }
    req.extend_from_slice(b"\r\n");
    req.extend_from_slice(data);
    req.extend_from_slice(b"\r\n");
}

/// `mbal map [<have>]`: the server's map's epoch, and the map; `None` if `have` is given and
/// the server's map is no newer (it sends no JSON then).
fn fetch_map(c: &mut Conn, have: Option<u64>) -> Result<(u64, Option<ClusterMap>)> {
    match c.call(&mbal_proto::ext::map_request(have), Expect::Line)? {
        Reply::Map { epoch, json } if have.is_some() && json.is_empty() => Ok((epoch, None)),
        Reply::Map { epoch, json } => {
            let text = String::from_utf8_lossy(&json);
            ClusterMap::from_json(&text).map(|m| (epoch, Some(m))).map_err(|e| Error::Protocol {
                addr: c.addr,
                peer: c.peer,
                detail: format!("bad cluster map: {e}"),
            })
        }
        Reply::Error(l) if l == "ERROR" => Err(Error::NotMbal { addr: c.addr }),
        r => Err(c.unexpected("mbal map", &r)),
    }
}

#[cfg(test)]
mod tests;
