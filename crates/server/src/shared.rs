//! State shared by all workers of a process (and the controller, the acceptor and the
//! server's other threads): read-mostly, never on the GET/SET path. Its field types are
//! the leaves' (`msg`, `config`, `threads`): nothing here names a module that uses it.

use crate::config::Settings;
use crate::life::{Ended, Life};
use crate::msg::{CtlMsg, ForwardHandle, Peers, ReplicaJob};
use crate::threads::Threads;
use crossbeam_channel::{Receiver, Sender};
use mbal_balance::EpochSnapshot;
use mbal_cluster::KeySpace;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// State shared by all workers of a process. Nothing here is touched on the
/// GET/SET path: the connection counters and the flags are used on accept,
/// close and shutdown only.
pub(crate) struct Shared {
    pub settings: Settings,
    /// Each server's main address and worker count, by id, as the newest map has them
    /// (servers join under a coordinator): for the threads that dial other servers (the
    /// replicator, the slot asks), and for where a hot key's copies live (`worker/hot.rs`
    /// `copies`: the rule clients apply to the map). A lock, not a message: those threads
    /// read it once per connection they open, workers once per hot-key replication or write
    /// to a replicated key (never on a plain GET/SET), and the controller writes it when it
    /// installs a map.
    pub members: std::sync::RwLock<Vec<(std::net::SocketAddr, u16)>>,
    /// VN -> cachelet (fixed for the cluster's life). Owners are in `map`
    /// (and each worker's `Tables`).
    pub layout: KeySpace,
    /// This server's id in the cluster map.
    pub server_id: u16,
    /// The map epoch this server knows (read on redirects only; the
    /// controller, which owns the map, raises it as moves finish).
    pub epoch: AtomicU64,
    /// The controller's mailbox (`control`).
    pub control: Sender<CtlMsg>,
    /// The controller's newest epoch snapshot, for `stats cachelets`.
    /// Written once per epoch, read when stats are rendered: never on the
    /// data path.
    pub latest: Mutex<Option<Arc<EpochSnapshot>>>,
    /// The balancer's figures for `stats balancer`, written by the
    /// controller once per epoch and after each move.
    pub balancer: Mutex<Option<mbal_balance::BalancerStatus>>,
    /// Phase 1's figures for `stats hotkeys`, written by the controller
    /// once per epoch.
    pub hotkeys: Mutex<Option<mbal_balance::HotStatus>>,
    pub start: Instant,
    pub start_unix: u64,
    pub curr_conns: AtomicUsize,
    /// Open connections per worker (the acceptor hands a new one to the
    /// worker with the fewest). Written on accept and close only.
    pub worker_conns: Vec<AtomicUsize>,
    /// Connections the acceptor refused (over `-c`).
    pub rejected_conns: AtomicU64,
    /// Open connections per source address (`--max-conns-per-ip`; used
    /// only when that is set, on accept and close), and those refused.
    pub per_ip: Mutex<std::collections::HashMap<std::net::IpAddr, usize>>,
    pub rejected_per_ip: AtomicU64,
    pub shutdown: AtomicBool,
    /// The stop and its drain, and the threads' ends (`life`).
    pub life: Life,
    /// The last `gid` of a `watch` log line (memcached's global line id).
    pub log_gid: AtomicU64,
    /// `stats detail on`: workers count gets, sets and deletes per key prefix.
    pub detail: AtomicBool,
    pub peers: OnceLock<Peers>,
    pub main_addr: SocketAddr,
    pub worker_ports: OnceLock<Vec<u16>>,
    pub next_conn_id: AtomicU64,
    /// With `-o no_maxconns_fast`: the acceptor stopped accepting at `-c`
    /// and waits for a close to wake it (`accept_waker`).
    pub accept_paused: AtomicBool,
    pub accept_waker: OnceLock<Arc<mio::Waker>>,
    /// `-Z`: the TLS configuration new connections take (reloadable).
    pub tls: Option<mbal_tls::ServerTls>,
    /// The replicator's job queue (Phase 1), when it runs.
    pub replicator: Option<Sender<ReplicaJob>>,
    /// The forwarder's job queue and counters (`--forward` in a cluster).
    pub forward: Option<ForwardHandle>,
    /// The threads that run the workers and how many are in use (`worker/group.rs`).
    pub threads: Threads,
    /// Fencing (`--coordinator`): until when (`clock_ns`) this server may serve its
    /// cachelets. The heartbeat thread (`beat.rs`) moves it forward each time the coordinator
    /// answers a heartbeat: to the time that heartbeat was sent plus the lease. Each worker
    /// reads it once per round (one relaxed load) and stops serving past it. `u64::MAX`
    /// without a coordinator.
    pub lease_until_ns: AtomicU64,
    /// The server was declared dead and is installing the map it got when it registered
    /// again: no lease is renewed until every worker has applied it (`beat.rs`).
    pub resetting: AtomicBool,
    /// The heartbeat thread's figures (`stats`).
    pub coord: CoordFigures,
}

/// What the heartbeat thread counts (`stats`: `coordinator_*`).
#[derive(Default)]
pub(crate) struct CoordFigures {
    pub beats: AtomicU64,
    pub beat_failures: AtomicU64,
    pub maps_installed: AtomicU64,
    pub registrations: AtomicU64,
    /// The coordinator said this server was declared dead (`GONE`).
    pub gone: AtomicU64,
    /// Other servers' load reports relayed by the coordinator (`mbal report`).
    pub peer_reports: AtomicU64,
    /// Cachelets moved from this server to others (`crate::migrate`), moves that failed,
    /// the frame bytes sent, and how long the last move took.
    pub migrations_out: AtomicU64,
    pub migrations_failed: AtomicU64,
    pub migrated_out_bytes: AtomicU64,
    pub migration_last_ms: AtomicU64,
}

/// What a [`Shared`] is built from besides the settings: what `start` derives from the
/// cluster map, the registration and the options (a unit test builds them by hand).
pub(crate) struct Parts {
    pub server_id: u16,
    pub control: Sender<CtlMsg>,
    pub main_addr: SocketAddr,
    pub start: Instant,
    pub start_unix: u64,
    pub tls: Option<mbal_tls::ServerTls>,
    pub replicator: Option<Sender<ReplicaJob>>,
    pub forward: Option<ForwardHandle>,
    pub threads: Threads,
    /// `Shared::lease_until_ns` at the start (`u64::MAX` without a coordinator).
    pub lease_until_ns: u64,
}

/// Each server's main address and worker count, by id (`Shared::members`).
pub(crate) fn members_of(map: &mbal_cluster::ClusterMap) -> Vec<(SocketAddr, u16)> {
    map.servers().iter().map(|s| (s.main, s.workers.len() as u16)).collect()
}

impl Shared {
    /// A process's shared state before any thread runs (`peers`, `worker_ports` and the
    /// acceptor's waker are set once those exist), and the receiving end of its threads' ends.
    /// The members, key space and epoch come from `map`.
    pub fn new(settings: Settings, map: &mbal_cluster::ClusterMap, p: Parts) -> (Shared, Receiver<Ended>) {
        let workers = settings.threads;
        let (life, ended) = Life::new(workers);
        let shared = Shared {
            members: std::sync::RwLock::new(members_of(map)),
            layout: map.keyspace().clone(),
            server_id: p.server_id,
            epoch: AtomicU64::new(map.epoch()),
            control: p.control,
            latest: Mutex::new(None),
            balancer: Mutex::new(None),
            hotkeys: Mutex::new(None),
            start: p.start,
            start_unix: p.start_unix,
            curr_conns: AtomicUsize::new(0),
            worker_conns: (0..workers).map(|_| AtomicUsize::new(0)).collect(),
            rejected_conns: AtomicU64::new(0),
            per_ip: Mutex::new(Default::default()),
            rejected_per_ip: AtomicU64::new(0),
            shutdown: AtomicBool::new(false),
            life,
            log_gid: AtomicU64::new(0),
            detail: AtomicBool::new(false),
            peers: OnceLock::new(),
            main_addr: p.main_addr,
            worker_ports: OnceLock::new(),
            next_conn_id: AtomicU64::new(1),
            accept_paused: AtomicBool::new(false),
            accept_waker: OnceLock::new(),
            tls: p.tls,
            replicator: p.replicator,
            forward: p.forward,
            threads: p.threads,
            lease_until_ns: AtomicU64::new(p.lease_until_ns),
            resetting: AtomicBool::new(false),
            coord: Default::default(),
            settings,
        };
        (shared, ended)
    }

    /// Server `id`'s main address in the newest map.
    pub fn member_addr(&self, id: u16) -> Option<std::net::SocketAddr> {
        self.members.read().unwrap_or_else(|p| p.into_inner()).get(usize::from(id)).map(|m| m.0)
    }
}

impl Shared {
    /// Do routed connections serve the keys of every worker of their thread (`near`)? Not
    /// when each worker must pay for its own requests (`--worker-capacity`) or a write may
    /// wait for hot-key copies (`--replica-writes sync`): there a worker's requests go to it.
    pub fn routes_by_thread(&self) -> bool {
        self.settings.worker_capacity == 0 && !self.settings.hot.may_sync()
    }

    /// The thread count a routed client routes by (`MBAL ... <threads>`, docs/protocol.md):
    /// the threads in use, or one per worker when routed connections serve their own keys only.
    pub fn routing_threads(&self) -> u16 {
        let n = if self.routes_by_thread() { self.threads.active() } else { self.settings.threads };
        n.clamp(1, u16::MAX as usize) as u16
    }

    /// The prefix delimiter while `stats detail` is on.
    pub fn detail(&self) -> Option<u8> {
        self.detail.load(Ordering::Relaxed).then_some(self.settings.prefix_delimiter)
    }

    pub fn now(&self) -> u32 {
        self.start.elapsed().as_secs() as u32
    }

    /// Nanoseconds since the server started: the one clock of the
    /// controller's samples and the workers' queueing measures.
    pub fn clock_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    /// Phase 2's figures as last published (default before the first).
    pub fn balancer_status(&self) -> mbal_balance::BalancerStatus {
        self.balancer.lock().unwrap_or_else(|p| p.into_inner()).clone().unwrap_or_default()
    }

    /// Phase 1's figures as last published (default before the first).
    pub fn hot_status(&self) -> mbal_balance::HotStatus {
        self.hotkeys.lock().unwrap_or_else(|p| p.into_inner()).clone().unwrap_or_default()
    }

    /// Send the controller a message.
    pub fn tell_controller(&self, msg: CtlMsg) {
        let _ = self.control.send(msg);
    }

    pub fn peers(&self) -> &Peers {
        self.peers.get().expect("peers are set before workers start")
    }

    /// Stop the server gracefully (`shutdown`, SIGTERM/SIGINT, the handle): see `life`.
    pub fn request_stop(&self) {
        if self.life.ask_stop(self.clock_ns()) {
            tracing::warn!("stopping: answering what was read, then closing the connections");
        }
        // In this order: a thread that sees the flag finds the drain's bound set, and
        // `ServerHandle::wait` sees the flag before the policy's thread ends.
        self.shutdown.store(true, Ordering::SeqCst);
        self.life.policy_stop.lock().unwrap_or_else(|p| p.into_inner()).take();
        self.wake_all();
        if let Some(w) = self.accept_waker.get() {
            let _ = w.wake();
        }
    }

    /// Is the stop's drain over (every worker drained, or its bound passed)? The threads
    /// that serve the workers (the controller, the forwarder, the replicator) run until it is.
    pub fn stopped(&self) -> bool {
        self.shutdown.load(Ordering::Relaxed) && self.life.over(self.clock_ns())
    }

    pub fn wake_all(&self) {
        if let Some(p) = self.peers.get() {
            self.threads.kick_all(p);
        }
        if let Some(f) = &self.forward {
            f.wake();
        }
        self.tell_controller(CtlMsg::Wake);
    }

    /// A connection of `worker` closed. Wakes the acceptor if it stopped
    /// accepting at the connection limit (`-o no_maxconns_fast`); SeqCst
    /// pairs with the acceptor's store of `accept_paused` then load of
    /// `curr_conns`, so one of the two sees the other.
    pub fn conn_closed(&self, worker: usize, peer: std::net::IpAddr) {
        self.release_ip(peer);
        self.worker_conns[worker].fetch_sub(1, Ordering::Relaxed);
        self.curr_conns.fetch_sub(1, Ordering::SeqCst);
        if self.accept_paused.load(Ordering::SeqCst) {
            if let Some(w) = self.accept_waker.get() {
                let _ = w.wake();
            }
        }
    }
}

impl Shared {
    /// Count a new connection from `ip` against `--max-conns-per-ip`;
    /// false (and counted as refused) if it has that many already.
    pub fn admit_ip(&self, ip: std::net::IpAddr) -> bool {
        let max = self.settings.max_conns_per_ip;
        if max == 0 {
            return true;
        }
        let mut m = self.per_ip.lock().unwrap_or_else(|e| e.into_inner());
        let n = m.entry(ip).or_insert(0);
        if *n >= max {
            drop(m);
            self.rejected_per_ip.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        *n += 1;
        true
    }

    pub(crate) fn release_ip(&self, ip: std::net::IpAddr) {
        if self.settings.max_conns_per_ip == 0 {
            return;
        }
        let mut m = self.per_ip.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = m.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                m.remove(&ip);
            }
        }
    }
}
