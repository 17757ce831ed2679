//! `mbal server`: one process, `-t` worker threads, each owning
//! `cachelets_per_worker` cachelets of the key space.
//!
//! * `config`: memcached's command line, mbal's options and the TOML file.
//! * `worker`: the per-thread event loop and the state workers share;
//!   `worker/conn.rs` its connections (accept, read, parse and dispatch,
//!   write, back-pressure, hand-over); `worker/inbox.rs` what peers and the
//!   controller send it, and the executor of forwarded requests.
//! * `dispatch`: the one place that routes a parsed request (execute here,
//!   forward to the owning worker, redirect, or answer for another server).
//! * `exec`: executes text, meta and binary requests against the store.
//! * `msg`: the messages between workers (batched per destination and round)
//!   and the mailbox that wakes a sleeping worker.
//! * `output`: a connection's ordered output (replies in request order).
//! * `moves`: the server-local move protocol (release, adopt, owner notices).
//! * `control`: the controller thread: the cluster map, every move, and the
//!   epoch tick that samples the workers' counters for the balancer.
//! * `replica`: Phase 1's tables on a worker: its hot keys (leases, writes
//!   being copied) and the shadow table of other servers' copies.
//! * `replicate`: the replicator thread, which carries copies to the shadow
//!   workers of other servers.
//! * `peerload`: Phase 1's view of the cluster's mean load per worker (one
//!   thread per other server follows its epochs with `mbal load`).
//! * `forward`: the forwarder thread (`--forward`), which passes a plain
//!   client's requests for keys other servers own to them.
//! * `stats`: counters and memcached-named stats.
//!
//! Threads and ports: one acceptor thread owns the main port and hands each
//! connection to the worker with the fewest (as memcached's listener hands
//! them out round-robin); each worker also listens on a port of its own
//! (routed clients talk to the owning worker directly, MBal §2.3); one
//! controller thread has no port, only a mailbox and a tick.

pub mod auth;
mod beat;
pub mod config;
// The shard engine's modules, under the names the server's modules use.
pub use mbal_engine::counters;
use mbal_engine::{capacity, exec, replica};
mod control;
pub mod credentials;
mod dispatch;
mod fold;
mod forward;
mod life;
mod migrate;
mod moves;
mod msg;
mod near;
mod output;
mod peerload;
mod readbuf;
mod replicate;
mod shared;
mod slots;
pub mod stats;
#[doc(hidden)]
pub mod testing;
mod threads;
mod tune;
mod worker;

use crate::msg::ConnMsg;
use config::Settings;
use mbal_cluster::{ClusterMap, ServerInfo};
use mbal_store::{GlobalPool, StoreConfig, WorkerStore};
use msg::{Envelope, Mailbox, Peers};
use shared::Shared;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use worker::{bind_listener, Worker};

/// The version string reported by `version` and `stats`.
pub const VERSION: &str = concat!("1.6.18-mbal-", env!("CARGO_PKG_VERSION"));

/// A running server.
pub struct ServerHandle {
    pub main_addr: SocketAddr,
    pub worker_addrs: Vec<SocketAddr>,
    shared: Arc<Shared>,
    acceptor_waker: Arc<mio::Waker>,
    threads: Vec<JoinHandle<()>>,
    /// Every server thread's end (`life::Watch`), for `wait`.
    ended: crossbeam_channel::Receiver<life::Ended>,
}

impl ServerHandle {
    /// Ask every worker to stop and wait for them.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.shared.request_stop();
        let _ = self.acceptor_waker.wake();
        for t in self.threads.drain(..) {
            let name = t.thread().name().unwrap_or("mbal").to_string();
            if let Err(p) = t.join() {
                tracing::error!(thread = %name, "panicked: {}", life::panic_text(&*p));
            }
        }
    }

    /// Block until the server stops (a `shutdown` command with `-A`, or a
    /// [`StopToken`]) and its threads have ended: `Ok` then. `Err` (and the
    /// server told to stop, its threads left to the process's exit) as soon
    /// as a server thread panics or ends on its own before the stop: the
    /// server is no longer whole, and its process should exit with an error
    /// (so that a supervisor restarts it).
    pub fn wait(mut self) -> Result<(), String> {
        let mut left = self.threads.len();
        let failed = loop {
            if left == 0 {
                break None;
            }
            let Ok(end) = self.ended.recv() else { break None };
            if end.panicked || !self.shared.shutdown.load(Ordering::SeqCst) {
                break Some(end);
            }
            if self.threads.iter().any(|t| t.thread().name() == Some(end.name.as_str())) {
                left -= 1;
            }
        };
        let Some(end) = failed else {
            self.stop();
            return Ok(());
        };
        let mut why = if end.panicked { "panicked".to_string() } else { "ended before the server stopped".to_string() };
        if let Some(i) = self.threads.iter().position(|t| t.thread().name() == Some(end.name.as_str())) {
            if let Err(p) = self.threads.swap_remove(i).join() {
                why = format!("panicked: {}", life::panic_text(&*p));
            }
        }
        self.shared.request_stop();
        // Not joined: the process exits with the error.
        self.threads.clear();
        Err(format!("server thread {} {why}", end.name))
    }

    /// Read the TLS certificate files again (SIGHUP, `refresh_certs`): new
    /// connections use them, open ones keep theirs. An error leaves the old
    /// ones in use.
    pub fn reload_tls(&self) -> Result<(), String> {
        reload_tls(&self.shared)
    }

    /// Has the server been asked to stop?
    pub fn is_shutting_down(&self) -> bool {
        self.shared.shutdown.load(Ordering::Relaxed)
    }

    /// Opens admin connections to this server from inside the process (see [`StatsConnector`]).
    pub fn stats_connector(&self) -> StatsConnector {
        StatsConnector(self.shared.clone())
    }

    /// A token that can stop the server from another thread (a signal
    /// handler) without owning the handle.
    pub fn stop_token(&self) -> StopToken {
        StopToken(self.shared.clone(), self.acceptor_waker.clone())
    }
}

/// Opens admin connections to a running server from inside its process (the metrics
/// endpoint gathers `stats` through one, as a client would, without a listener's TLS or login).
#[derive(Clone)]
pub struct StatsConnector(Arc<Shared>);

impl StatsConnector {
    /// A new connection served by worker 0: plain text protocol, logged in. It is a loopback
    /// socket pair, counted as a connection (`curr_connections`, `total_connections`) while open.
    pub fn connect(&self, timeout: std::time::Duration) -> std::io::Result<std::net::TcpStream> {
        let shared = &self.0;
        if shared.shutdown.load(Ordering::SeqCst) {
            return Err(std::io::Error::new(std::io::ErrorKind::NotConnected, "the server is stopping"));
        }
        let listener = std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0))?;
        let client = std::net::TcpStream::connect_timeout(&listener.local_addr()?, timeout)?;
        let (served, _) = listener.accept()?;
        served.set_nonblocking(true)?;
        let peer = client.local_addr()?;
        // As the acceptor counts one (`Shared::conn_closed` undoes it at the close).
        shared.curr_conns.fetch_add(1, Ordering::SeqCst);
        if shared.settings.max_conns_per_ip > 0 {
            *shared.per_ip.lock().unwrap_or_else(|e| e.into_inner()).entry(peer.ip()).or_insert(0) += 1;
        }
        shared.worker_conns[0].fetch_add(1, Ordering::Relaxed);
        let peers = shared.peers();
        if peers.senders[0].send(Envelope::Conn(ConnMsg::Internal(served, peer))).is_err() {
            return Err(std::io::Error::new(std::io::ErrorKind::NotConnected, "the server is stopping"));
        }
        peers.mailboxes[0].wake();
        client.set_read_timeout(Some(timeout))?;
        client.set_write_timeout(Some(timeout))?;
        Ok(client)
    }

    /// The controller's latest epoch snapshot (per-worker load, busy fraction, queue waits and
    /// lengths), as `mbal load` carries it; `None` before the first epoch.
    pub fn latest_epoch(&self) -> Option<Arc<mbal_balance::snapshot::EpochSnapshot>> {
        self.0.latest.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

fn reload_tls(shared: &Shared) -> Result<(), String> {
    match &shared.tls {
        None => Err("TLS is not enabled".into()),
        Some(t) => t.reload(),
    }
}

/// Stops a server from any thread.
#[derive(Clone)]
pub struct StopToken(Arc<Shared>, Arc<mio::Waker>);

impl StopToken {
    /// Stop gracefully (see [`ServerHandle::wait`] and docs/operations.md "Stopping").
    pub fn stop(&self) {
        self.0.request_stop();
        let _ = self.1.wake();
    }

    /// [`ServerHandle::reload_tls`], from any thread (a SIGHUP handler).
    pub fn reload_tls(&self) -> Result<(), String> {
        reload_tls(&self.0)
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Start a server with these settings; returns once every listener is bound.
pub fn start(settings: Settings) -> std::io::Result<ServerHandle> {
    let workers = settings.threads;
    let main_addr = SocketAddr::new(settings.listen, settings.port);
    let main = bind_listener(main_addr, settings.backlog, settings.sock_cookie_id)
        .map_err(|e| std::io::Error::new(e.kind(), format!("binding main port {main_addr}: {e}")))?;
    let main_addr = main.local_addr()?;
    // Worker ports only when asked for (`--worker-port-base`); otherwise
    // routed clients reach their worker through the main port.
    let mut owns = Vec::new();
    for i in 0..workers {
        let Some(base) = settings.worker_port_base else {
            owns.push(None);
            continue;
        };
        let port = if base == 0 {
            0
        } else {
            base.checked_add(i as u16).ok_or_else(|| std::io::Error::other("worker port overflows"))?
        };
        let addr = SocketAddr::new(settings.listen, port);
        owns.push(Some(
            bind_listener(addr, settings.backlog, settings.sock_cookie_id)
                .map_err(|e| std::io::Error::new(e.kind(), format!("binding worker {i} port {addr}: {e}")))?,
        ));
    }
    let worker_addrs: Vec<SocketAddr> =
        owns.iter().flatten().map(|l| l.local_addr()).collect::<std::io::Result<_>>()?;
    let mut registered = None;
    let (map, server_id) = match &settings.cluster {
        Some((_, _)) if !settings.coordinator.is_empty() => {
            let r = beat::register(&settings, main_addr, &worker_addrs)?;
            let out = (r.map.clone(), r.id);
            registered = Some(r);
            out
        }
        Some((spec, id)) => (spec.initial_map(), *id),
        None => {
            // Without worker ports every worker is reached at the main port
            // (`mbal hello <epoch> <worker>` hands the connection over).
            let workers = if worker_addrs.is_empty() { vec![main_addr; workers] } else { worker_addrs.clone() };
            let info = ServerInfo { main: main_addr, workers };
            (ClusterMap::even(vec![info], settings.cachelets_per_worker, settings.vn_count), 0)
        }
    };
    let layout = map.keyspace().clone();
    let initial: Vec<Vec<u32>> = (0..workers).map(|i| map.cachelets_of(server_id, i as u16)).collect();
    let owners = map.owners().to_vec();
    let (control_tx, control_rx) = crossbeam_channel::unbounded();
    // Phase 1 needs another server for its copies.
    let replicating = settings.hot.enabled && map.servers().len() > 1;
    let (rep_tx, rep_rx) = crossbeam_channel::unbounded();

    let tls = match &settings.tls {
        None => None,
        Some(files) => Some(
            mbal_tls::ServerTls::new(files.clone())
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("TLS: {e}")))?,
        ),
    };
    // `--forward` needs another server to forward to.
    let forwarding = settings.forward && map.servers().len() > 1;
    let (forward, forward_parts) = match forwarding {
        true => {
            let (h, parts) = forward::channel()?;
            (Some(h), Some(parts))
        }
        false => (None, None),
    };

    let start_unix = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let pool = GlobalPool::new(settings.memory_limit, settings.page_size);
    if settings.track_sizes {
        pool.sizes_enable(settings.threads, settings.max_item_size);
    }
    let start = Instant::now();
    let parts = shared::Parts {
        server_id,
        control: control_tx,
        main_addr,
        start,
        start_unix,
        tls,
        replicator: replicating.then_some(rep_tx),
        forward,
        threads: threads::Threads::new(worker_threads(&settings), workers, settings.worker_threads == 0)?,
        // Registration counts as a heartbeat: the lease runs from when it was sent.
        lease_until_ns: registered
            .as_ref()
            .map_or(u64::MAX, |r| (r.sent + r.lease).saturating_duration_since(start).as_nanos() as u64),
    };
    let (shared, ended) = Shared::new(settings.clone(), &map, parts);
    let shared = Arc::new(shared);
    let _ = shared.worker_ports.set(worker_addrs.iter().map(|a| a.port()).collect());

    let mut senders = Vec::new();
    let mut mailboxes = Vec::new();
    let mut built = Vec::new();
    for (i, own) in owns.into_iter().enumerate() {
        let (tx, rx) = crossbeam_channel::unbounded::<Envelope>();
        let cfg = StoreConfig {
            mem_limit: settings.memory_limit,
            page_size: settings.page_size,
            max_item_size: settings.max_item_size,
            evict: settings.evictions,
            cas_enabled: settings.cas_enabled,
            start_unix,
            worker_id: i as u16,
            workers,
            ..StoreConfig::default()
        };
        let mut store = WorkerStore::new(pool.clone(), cfg, layout.cachelet_count());
        for &c in &initial[i] {
            store.insert_cachelet(mbal_store::Cachelet::new(c));
        }
        let poll = mio::Poll::new()?;
        let mailbox = Arc::new(Mailbox::new(mio::Waker::new(poll.registry(), worker::WAKER)?));
        built.push(Worker::new(i, shared.clone(), poll, mailbox.clone(), own, rx, store, &owners)?);
        senders.push(tx);
        mailboxes.push(mailbox);
    }
    let _ = shared.peers.set(Peers { senders, mailboxes });
    let mut threads = Vec::new();
    // Worker i runs on host thread i mod (hosts in use); see `worker::run_host`. With more
    // workers than CPUs, several share a thread from the start.
    let hosts = shared.threads.hosts();
    let mut groups: Vec<Vec<Worker>> = (0..hosts).map(|_| Vec::new()).collect();
    for (i, w) in built.into_iter().enumerate() {
        groups[i % hosts].push(w);
    }
    if hosts < workers {
        tracing::info!(workers, threads = hosts, "more workers than CPUs: the workers share {hosts} threads");
    }
    let handoff = Arc::new(worker::Handoff::new(hosts));
    for (t, group) in groups.into_iter().enumerate() {
        let (shared, handoff) = (shared.clone(), handoff.clone());
        threads.push(std::thread::Builder::new().name(format!("mbal-worker-{t}")).spawn(move || {
            let _watch = shared.life.watch();
            worker::run_host(shared, handoff, t, group)
        })?);
    }
    drop(handoff);
    if hosts > 1 {
        let (t, stop) = fold::spawn(shared.clone())?;
        threads.push(t);
        *shared.life.policy_stop.lock().unwrap_or_else(|p| p.into_inner()) = Some(stop);
    }
    let mut slot_asks = None;
    if replicating {
        let r = replicate::Replicator::new(shared.clone(), rep_rx);
        let watch = shared.clone();
        threads.push(std::thread::Builder::new().name("mbal-replicate".into()).spawn(move || {
            let _watch = watch.life.watch();
            r.run()
        })?);
        let servers = map.servers().iter().map(|s| s.main).collect();
        if settings.coordinator.is_empty() {
            // With a coordinator the servers' epochs travel through it (`beat.rs`).
            peerload::spawn(shared.clone(), servers, control::hot_balance_config(&shared.settings))?;
        }
        slot_asks = Some(slots::spawn(shared.clone())?);
    }
    if let Some(parts) = forward_parts {
        let f = forward::Forwarder::new(shared.clone(), parts, map.clone());
        let watch = shared.clone();
        threads.push(std::thread::Builder::new().name("mbal-forward".into()).spawn(move || {
            let _watch = watch.life.watch();
            f.run()
        })?);
    }
    let mut reports = None;
    if let Some(r) = registered {
        shared.coord.registrations.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = crossbeam_channel::unbounded();
        reports = Some(tx);
        threads.push(beat::spawn(shared.clone(), r, main_addr, worker_addrs.clone(), rx)?);
    }
    let controller = control::Controller::new(shared.clone(), control_rx, map, slot_asks, reports);
    let watch = shared.clone();
    threads.push(std::thread::Builder::new().name("mbal-control".into()).spawn(move || {
        let _watch = watch.life.watch();
        controller.run()
    })?);
    let acceptor = Acceptor::new(main, shared.clone())?;
    let acceptor_waker = acceptor.waker.clone();
    let _ = shared.accept_waker.set(acceptor_waker.clone());
    threads.push(std::thread::Builder::new().name("mbal-acceptor".into()).spawn(move || {
        let _watch = acceptor.shared.life.watch();
        acceptor.run()
    })?);
    tracing::info!(%main_addr, ?worker_addrs, workers, "mbal server ready");
    Ok(ServerHandle { main_addr, worker_addrs, shared, acceptor_waker, threads, ended })
}

/// How many host threads run the workers: `--worker-threads` if given, else one per worker
/// but no more than the CPUs this process may run on (its affinity mask and CPU quota, as
/// `available_parallelism` reads them). Without `--worker-threads` the thread policy
/// (`fold`) chooses how many of them are in use.
fn worker_threads(s: &Settings) -> usize {
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let n = if s.worker_threads > 0 { s.worker_threads } else { cpus };
    n.clamp(1, s.threads.max(1))
}

/// The main port's listener thread: accepts connections and hands each to
/// the worker serving the fewest (ties go round-robin), as memcached's
/// listener hands connections to its threads. The kernel's SO_REUSEPORT hash
/// would spread them unevenly.
struct Acceptor {
    poll: mio::Poll,
    listener: mio::net::TcpListener,
    waker: Arc<mio::Waker>,
    shared: Arc<Shared>,
    next: usize,
}

const ACCEPT: mio::Token = mio::Token(0);
const ACCEPT_WAKER: mio::Token = mio::Token(1);

impl Acceptor {
    fn new(listener: std::net::TcpListener, shared: Arc<Shared>) -> std::io::Result<Acceptor> {
        let poll = mio::Poll::new()?;
        let mut listener = mio::net::TcpListener::from_std(listener);
        poll.registry().register(&mut listener, ACCEPT, mio::Interest::READABLE)?;
        let waker = Arc::new(mio::Waker::new(poll.registry(), ACCEPT_WAKER)?);
        Ok(Acceptor { poll, listener, waker, shared, next: 0 })
    }

    fn run(mut self) {
        let mut events = mio::Events::with_capacity(8);
        // Woken by a stop (`Shared::request_stop`); its listener closes as it returns.
        while !self.shared.shutdown.load(Ordering::SeqCst) {
            if let Err(e) = self.poll.poll(&mut events, None) {
                if e.kind() != std::io::ErrorKind::Interrupted {
                    tracing::error!("acceptor poll failed: {e}");
                    return;
                }
            }
            if self.shared.shutdown.load(Ordering::SeqCst) {
                return;
            }
            self.accept_all();
        }
    }

    fn accept_all(&mut self) {
        loop {
            if !self.shared.settings.maxconns_fast && self.at_limit() {
                // memcached without maxconns_fast: stop accepting; clients
                // wait in the listen backlog until a connection closes.
                return;
            }
            let (sock, peer) = match self.listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    // EMFILE and the like: say so, and let the next poll
                    // retry rather than spin.
                    tracing::warn!("accept: {e}");
                    return;
                }
            };
            let shared = &self.shared;
            if shared.curr_conns.fetch_add(1, Ordering::SeqCst) >= shared.settings.max_conns {
                shared.curr_conns.fetch_sub(1, Ordering::Relaxed);
                shared.rejected_conns.fetch_add(1, Ordering::Relaxed);
                let mut sock = sock;
                // memcached's answer to one connection too many (on a TLS port, only the close).
                if shared.tls.is_none() {
                    let _ = std::io::Write::write(&mut sock, b"ERROR Too many open connections\r\n");
                }
                continue;
            }
            if !shared.admit_ip(peer.ip()) {
                shared.curr_conns.fetch_sub(1, Ordering::Relaxed);
                let mut sock = sock;
                if shared.tls.is_none() {
                    let _ = std::io::Write::write(&mut sock, worker::TOO_MANY_FROM_IP);
                }
                continue;
            }
            let n = shared.worker_conns.len();
            let w = (0..n)
                .map(|i| (self.next + i) % n)
                .min_by_key(|&w| shared.worker_conns[w].load(Ordering::Relaxed))
                .unwrap_or(0);
            self.next = (w + 1) % n;
            shared.worker_conns[w].fetch_add(1, Ordering::Relaxed);
            // mio's stream is a plain non-blocking socket: it travels as a
            // std stream and the worker registers it with its own poll.
            let std_sock = std::net::TcpStream::from(sock);
            let peers = shared.peers();
            if peers.senders[w].send(Envelope::Conn(ConnMsg::Accepted(std_sock, peer))).is_ok() {
                peers.mailboxes[w].wake();
            }
        }
    }

    /// At `-c` (the paused flag is raised first, so that a close racing
    /// with this check wakes the acceptor: see `Shared::conn_closed`).
    fn at_limit(&self) -> bool {
        let shared = &self.shared;
        let max = shared.settings.max_conns;
        if shared.curr_conns.load(Ordering::SeqCst) < max {
            if shared.accept_paused.load(Ordering::Relaxed) {
                shared.accept_paused.store(false, Ordering::SeqCst);
            }
            return false;
        }
        shared.accept_paused.store(true, Ordering::SeqCst);
        if shared.curr_conns.load(Ordering::SeqCst) < max {
            shared.accept_paused.store(false, Ordering::SeqCst);
            return false;
        }
        true
    }
}
