//! The coordinator's network side: a listener (plain TCP, or TLS when the
//! cluster file's `[tls]` has a certificate), one thread per connection,
//! the text protocol of docs/protocol.md ("Coordinator"), and the failure
//! detector thread.
//!
//! Blocking std I/O with a thread per connection is deliberate: this is the
//! control plane — a few connections per server, a heartbeat every ~100 ms
//! each — not the data path, and threads keep the code plain. Connections
//! are bounded ([`Settings::max_conns`]), lines are bounded
//! ([`MAX_LINE`]) and a silent or trickling peer is dropped after
//! [`Settings::idle_timeout`]. For the same reason the whole state sits
//! behind one `Mutex`: every command holds it for microseconds (a state
//! write, when the map changes, for an fsync or an etcd transaction).
//!
//! With etcd ([`Settings::etcd`]) a leadership thread (`mbal-coord-elect`)
//! holds the etcd lease and tries for the leader key; while this
//! coordinator does not lead, `register`, `beat`, `leave` and `moved` are
//! answered `SERVER_ERROR not the leader[; leader ADDR]`, the failure
//! detector does nothing, and the state shown is etcd's, re-read every tick.

use crate::etcd::{Campaign, Etcd, EtcdSettings};
use crate::state::{Beat, Coord, LeaveError, MemberState, Stored, Timing};
use crate::store::FileStore;
use mbal_cluster::{ClusterMap, ServerInfo};
use mbal_member::peer_auth::{self, Secret};
use std::collections::HashMap;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

mod commands;
mod orchestra;
mod phase3;
use commands::{command, stats};

/// The longest request line (bytes before its `\n`). A longer one is
/// answered `CLIENT_ERROR line too long` and the connection closed.
pub const MAX_LINE: usize = 4096;

/// The default data directory.
pub const DEFAULT_DATA_DIR: &str = "mbal-coordinator-data";

/// How to run a coordinator.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Where to listen (port 0: chosen by the OS; see [`Handle::addr`]).
    pub listen: SocketAddr,
    /// The data directory (`state.json`); not used with [`Settings::etcd`].
    pub data_dir: PathBuf,
    /// Keep the state in etcd instead, and lead only while holding the
    /// etcd leadership (see [`crate::etcd`]).
    pub etcd: Option<EtcdSettings>,
    /// The address a standby names when it answers `not the leader`
    /// (None: the listening address, 127.0.0.1 for an unspecified IP).
    pub advertise: Option<SocketAddr>,
    /// The cluster's initial map (the cluster file's): used when the data
    /// directory holds no state yet; a stored state must have its VN and
    /// cachelet counts.
    pub initial_map: ClusterMap,
    /// The cluster secret: with it, `mbal register`, `beat`, `leave` and
    /// `moved` need the `mbal peer` login first.
    pub secret: Option<Secret>,
    /// TLS for the listener (the cluster file's `[tls]` with its `cert`).
    pub tls: Option<mbal_tls::ServerTlsFiles>,
    /// The cluster's `[tls]` as a client, for the moves this coordinator orders.
    pub client_tls: Option<mbal_tls::ClientTls>,
    /// Phase 3: how often it plans (None: off).
    pub phase3_epoch: Option<Duration>,
    pub timing: Timing,
    /// A connection silent this long, or this slow to send one line, is closed.
    pub idle_timeout: Duration,
    /// Connections served at once; more are answered `SERVER_ERROR` and closed.
    pub max_conns: usize,
}

impl Settings {
    /// Defaults around a map: no secret, no TLS, [`Timing::default`], a
    /// 30 s idle timeout, 1,024 connections.
    pub fn new(initial_map: ClusterMap, listen: SocketAddr, data_dir: PathBuf) -> Settings {
        Settings {
            listen,
            data_dir,
            etcd: None,
            advertise: None,
            initial_map,
            secret: None,
            tls: None,
            client_tls: None,
            phase3_epoch: Some(Duration::from_secs(1)),
            timing: Timing::default(),
            idle_timeout: Duration::from_secs(30),
            max_conns: 1024,
        }
    }

    /// Settings for a cluster file's cluster (its initial map, secret and
    /// `[tls]`), default timing.
    pub fn from_cluster_file(
        file: &mbal_member::ClusterFile,
        listen: SocketAddr,
        data_dir: PathBuf,
    ) -> Result<Settings, String> {
        let tls = match &file.spec.tls {
            Some(t) if t.cert.is_some() => Some(t.server_files(file.dir.as_deref())?),
            _ => None,
        };
        Ok(Settings {
            secret: file.secret.clone(),
            tls,
            client_tls: file.client_tls.clone(),
            ..Settings::new(file.spec.initial_map(), listen, data_dir)
        })
    }
}

/// A running coordinator.
pub struct Handle {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
    detector: Option<JoinHandle<()>>,
    stop_tx: Option<mpsc::Sender<()>>,
    /// The data directory's lock, released when stopped.
    dir_lock: Option<std::fs::File>,
    /// With etcd: the leadership thread and what stops it (true: resign, i.e. revoke the lease).
    elect: Option<(JoinHandle<()>, mpsc::Sender<bool>)>,
}

/// Where the state is kept.
enum Store {
    File(FileStore),
    Etcd(Box<Etcd>),
}

/// With etcd: does this coordinator lead, and until when.
#[derive(Clone, Debug, Default)]
struct Lead {
    /// The leader key's create revision while leading.
    rev: Option<i64>,
    /// The leadership is valid until then (the last acknowledged
    /// keep-alive's send time plus the TTL).
    valid_until: Option<Instant>,
    /// The leader's address, as the leader key names it (when not leading).
    leader: Option<String>,
}

struct Conn {
    sock: TcpStream,
    thread: Option<JoinHandle<()>>,
}

struct Shared {
    coord: Mutex<Coord>,
    store: Store,
    /// Always leading with the file store.
    lead: Mutex<Lead>,
    initial_map: ClusterMap,
    timing: Timing,
    secret: Option<Secret>,
    tls: Option<mbal_tls::ServerTls>,
    idle_timeout: Duration,
    max_conns: usize,
    started: Instant,
    stop: AtomicBool,
    conns: Mutex<HashMap<u64, Conn>>,
    total_conns: AtomicU64,
    conns_refused: AtomicU64,
    /// Each server's last load report (`mbal report`), with when it came: relayed to the others
    /// so that no server polls every other one. Kept in memory only (it is a second old).
    reports: Mutex<HashMap<u16, (Instant, String)>>,
    /// `mbal map`'s answer for one epoch, serialised once.
    map_cache: Mutex<Option<(u64, Arc<Vec<u8>>)>>,
    /// Held while a plan that counts the pending moves as done (a warm join's share, a
    /// drain, a rebalance) is made and queued: two such plans made at once against the same
    /// pending moves would give the same cachelets to both (two servers joining together: 25
    /// and 4 of 128). Taken before the state and the orchestra locks, by those three only.
    plans: Mutex<()>,
    /// The moves this coordinator orders (`orchestra`).
    orchestra: Mutex<orchestra::Orchestra>,
    /// For dialing the servers (their `[tls]` as a client).
    client_tls: Option<mbal_tls::ClientTls>,
    /// Phase 3's core (`--phase3 on`).
    phase3: Option<Mutex<phase3::Driver>>,
}

/// Start a coordinator: load (or create) its state, listen, and run the
/// failure detector. Errors: bad timing, a stored state of another
/// cluster, a data directory or listener that cannot be opened, bad TLS
/// files.
pub fn start(settings: Settings) -> io::Result<Handle> {
    let invalid = |e: String| io::Error::new(io::ErrorKind::InvalidInput, e);
    settings.timing.validate().map_err(invalid)?;
    let (store, dir_lock, coord, lead) = match &settings.etcd {
        None => {
            let (store, lock, stored) = open_file_store(&settings)?;
            let coord = Coord::new(stored, settings.timing, Instant::now()).map_err(invalid)?;
            let lead = Lead { rev: Some(0), valid_until: None, leader: None };
            (Store::File(store), Some(lock), coord, lead)
        }
        Some(e) => {
            let prefix = e.prefix.clone().unwrap_or_else(|| crate::etcd::default_prefix(&settings.initial_map));
            let etcd =
                Etcd::connect(e, prefix, ETCD_TIMEOUT).map_err(|e| io::Error::new(io::ErrorKind::NotConnected, e))?;
            // Until it leads, a coordinator shows what etcd holds (or the cluster file's map). An
            // etcd that is starting too (its own election) may not answer at once: keep asking for
            // a while, as a server keeps asking for its coordinator.
            let until = Instant::now() + ETCD_START_WAIT;
            let loaded = loop {
                match etcd.load() {
                    Err(e) if Instant::now() < until => {
                        tracing::info!("coordinator: etcd not answering yet: {e}");
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    r => break r,
                }
            };
            let stored = match loaded.map_err(invalid)? {
                Some(s) => {
                    same_cluster(&settings.initial_map, &s.map, &etcd.state_key).map_err(invalid)?;
                    s
                }
                None => Stored::initial(settings.initial_map.clone()),
            };
            let coord = Coord::new(stored, settings.timing, Instant::now()).map_err(invalid)?;
            tracing::info!(key = %etcd.state_key, endpoints = %e.endpoints.join(","), "coordinator: state in etcd");
            (Store::Etcd(Box::new(etcd)), None, coord, Lead::default())
        }
    };
    let tls = match settings.tls {
        Some(files) => Some(mbal_tls::ServerTls::new(files).map_err(invalid)?),
        None => None,
    };
    let listener = TcpListener::bind(settings.listen)?;
    let addr = listener.local_addr()?;
    let shared = Arc::new(Shared {
        coord: Mutex::new(coord),
        store,
        lead: Mutex::new(lead),
        initial_map: settings.initial_map.clone(),
        timing: settings.timing,
        secret: settings.secret,
        tls,
        idle_timeout: settings.idle_timeout,
        max_conns: settings.max_conns.max(1),
        started: Instant::now(),
        stop: AtomicBool::new(false),
        conns: Mutex::new(HashMap::new()),
        total_conns: AtomicU64::new(0),
        conns_refused: AtomicU64::new(0),
        reports: Mutex::new(HashMap::new()),
        map_cache: Mutex::new(None),
        orchestra: Mutex::new(Default::default()),
        plans: Mutex::new(()),
        client_tls: settings.client_tls.clone(),
        phase3: settings.phase3_epoch.map(|e| Mutex::new(phase3::Driver::new(e))),
    });
    let elect = match &settings.etcd {
        None => None,
        Some(e) => {
            let mut adv = settings.advertise.unwrap_or(addr);
            if adv.ip().is_unspecified() {
                adv.set_ip(if adv.is_ipv4() { [127, 0, 0, 1].into() } else { std::net::Ipv6Addr::LOCALHOST.into() });
            }
            let (tx, rx) = mpsc::channel();
            let sh = shared.clone();
            let ttl = e.ttl_secs.max(1);
            let t = std::thread::Builder::new()
                .name("mbal-coord-elect".into())
                .spawn(move || elect(&sh, adv.to_string(), ttl, rx))?;
            Some((t, tx))
        }
    };
    let (stop_tx, stop_rx) = mpsc::channel();
    let sh = shared.clone();
    let detector = std::thread::Builder::new()
        .name("mbal-coord-detect".into())
        .spawn(move || detector(&sh, settings.timing, stop_rx))?;
    let sh = shared.clone();
    let accept = std::thread::Builder::new().name("mbal-coord-accept".into()).spawn(move || acceptor(&sh, listener))?;
    tracing::info!(%addr, "coordinator listening");
    Ok(Handle { addr, shared, accept: Some(accept), detector: Some(detector), stop_tx: Some(stop_tx), dir_lock, elect })
}

/// Each etcd request is bounded by this.
const ETCD_TIMEOUT: Duration = Duration::from_millis(500);

/// How long a starting coordinator waits for etcd to answer its first read.
const ETCD_START_WAIT: Duration = Duration::from_secs(10);

/// A stored map must have the cluster file's VN and cachelet counts.
fn same_cluster(want: &ClusterMap, have: &ClusterMap, place: &str) -> Result<(), String> {
    if want.keyspace().vn_count() != have.keyspace().vn_count() || want.cachelet_count() != have.cachelet_count() {
        return Err(format!(
            "{place}: the stored map has {} VNs and {} cachelets, the cluster file {} and {}: another cluster's \
             state (use another --data-dir or etcd prefix)",
            have.keyspace().vn_count(),
            have.cachelet_count(),
            want.keyspace().vn_count(),
            want.cachelet_count()
        ));
    }
    Ok(())
}

fn open_file_store(settings: &Settings) -> io::Result<(FileStore, std::fs::File, Stored)> {
    let invalid = |e: String| io::Error::new(io::ErrorKind::InvalidInput, e);
    let store = FileStore::open(&settings.data_dir)
        .map_err(|e| io::Error::new(e.kind(), format!("data directory {}: {e}", settings.data_dir.display())))?;
    let dir_lock = store.lock()?;
    let stored = match store.load().map_err(invalid)? {
        Some(s) => {
            same_cluster(&settings.initial_map, &s.map, &store.dir().display().to_string()).map_err(invalid)?;
            tracing::info!(epoch = s.map.epoch(), servers = s.members.len(), "coordinator: state loaded");
            s
        }
        None => {
            let s = Stored::initial(settings.initial_map.clone());
            store.save(&s)?;
            tracing::info!(
                epoch = s.map.epoch(),
                servers = s.members.len(),
                "coordinator: new state from the cluster file"
            );
            s
        }
    };
    Ok((store, dir_lock, stored))
}

/// The leadership thread (etcd): keeps this coordinator's etcd lease alive,
/// tries for the leader key while not leading (and meanwhile shows the
/// state etcd holds), and takes over when it wins: the state is loaded
/// from etcd and every Up member gets a grace period. On a stop with
/// `true`, a leader revokes its lease so that a standby takes over at once.
fn elect(sh: &Shared, addr: String, ttl_secs: i64, stop: mpsc::Receiver<bool>) {
    let Store::Etcd(etcd) = &sh.store else { return };
    let tick = Duration::from_millis(100).min(sh.timing.beat);
    // (id, valid until, last keep-alive sent)
    let mut lease: Option<(i64, Instant, Instant)> = None;
    let resign = loop {
        let now = Instant::now();
        match &mut lease {
            None => match etcd.grant(ttl_secs) {
                Ok((id, ttl)) => {
                    if ttl > ttl_secs {
                        tracing::warn!(asked = ttl_secs, granted = ttl, "coordinator: etcd raised the lease TTL");
                    }
                    lease = Some((id, now + Duration::from_secs(ttl as u64), now));
                }
                Err(e) => tracing::warn!("coordinator: no etcd lease: {e}"),
            },
            Some((id, until, last)) => {
                let ttl = until.saturating_duration_since(*last);
                if now.duration_since(*last) >= ttl / 3 {
                    match etcd.keep_alive(*id) {
                        Ok(t) if t > 0 => (*until, *last) = (now + Duration::from_secs(t as u64), now),
                        Ok(_) => {
                            tracing::warn!("coordinator: the etcd lease expired");
                            lease = None;
                        }
                        Err(e) => tracing::warn!("coordinator: etcd keep-alive: {e}"),
                    }
                }
            }
        }
        if lease.is_some_and(|(_, until, _)| Instant::now() >= until) {
            lease = None;
        }
        let leading = sh.lead().rev.is_some();
        match lease {
            None if leading => sh.step_down("the etcd lease is lost"),
            Some((_, until, _)) if leading => sh.lead().valid_until = Some(until),
            Some((id, until, _)) => match etcd.campaign(id, &addr) {
                Ok(Campaign::Won(rev)) => take_over(sh, etcd, rev, until),
                Ok(Campaign::Lost(leader)) => {
                    sh.lead().leader = leader;
                    // Show what etcd holds (`mbal map`, `mbal members`, `stats` of a standby).
                    match etcd.load() {
                        Ok(Some(s)) if s != sh.lock().stored() => {
                            if let Ok(c) = Coord::new(s, sh.timing, Instant::now()) {
                                *sh.lock() = c;
                            }
                        }
                        Ok(_) => {}
                        Err(e) => tracing::debug!("coordinator: {e}"),
                    }
                }
                Err(e) => tracing::warn!("coordinator: etcd leader election: {e}"),
            },
            None => {}
        }
        match stop.recv_timeout(tick) {
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Ok(resign) => break resign,
            Err(mpsc::RecvTimeoutError::Disconnected) => break false,
        }
    };
    if resign {
        sh.step_down("stopping");
        if let Some((id, _, _)) = lease {
            if let Err(e) = etcd.revoke(id) {
                tracing::warn!("coordinator: etcd lease not revoked: {e}");
            }
        }
    }
}

/// Won the leader key: load the state (or write the initial one) and lead.
fn take_over(sh: &Shared, etcd: &Etcd, rev: i64, valid_until: Instant) {
    let stored = match etcd.load() {
        Ok(Some(s)) => match same_cluster(&sh.initial_map, &s.map, &etcd.state_key) {
            Ok(()) => s,
            Err(e) => {
                tracing::error!("coordinator: {e}; not leading");
                return;
            }
        },
        Ok(None) => {
            let s = Stored::initial(sh.initial_map.clone());
            match etcd.save_if_leader(rev, &s) {
                Ok(true) => s,
                Ok(false) => return,
                Err(e) => {
                    tracing::warn!("coordinator: initial state not written: {e}");
                    return;
                }
            }
        }
        Err(e) => {
            tracing::warn!("coordinator: state not loaded: {e}");
            return;
        }
    };
    let epoch = stored.map.epoch();
    // Every Up member's last heartbeat counts as now: the grace period of a restart.
    match Coord::new(stored, sh.timing, Instant::now()) {
        Ok(c) => *sh.lock() = c,
        Err(e) => {
            tracing::error!("coordinator: stored state: {e}; not leading");
            return;
        }
    }
    *sh.lead() = Lead { rev: Some(rev), valid_until: Some(valid_until), leader: None };
    tracing::info!(epoch, "coordinator: leading (etcd)");
}

impl Handle {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.shared.lock().epoch()
    }

    /// Does it lead (always with the file store)?
    pub fn is_leader(&self) -> bool {
        self.shared.leading(Instant::now()).is_ok()
    }

    /// Reads the coordinator's figures from another thread (the metrics endpoint).
    pub fn stats_source(&self) -> StatsSource {
        StatsSource(self.shared.clone())
    }

    /// Stop: no new connections, every connection closed, every thread
    /// joined. The state on disk is already current. With etcd, a leader
    /// resigns (revokes its lease) so that a standby takes over at once.
    pub fn shutdown(mut self) {
        self.stop(true);
    }

    /// Stop as a crash would leave etcd: the lease is not revoked, so a
    /// standby takes over only when it expires (for tests).
    pub fn halt(mut self) {
        self.stop(false);
    }

    fn stop(&mut self, resign: bool) {
        if let Some((t, tx)) = self.elect.take() {
            let _ = tx.send(resign);
            let _ = t.join();
        }
        self.shared.stop.store(true, Ordering::SeqCst);
        // Dropping the sender wakes the detector; a connection of our own wakes the acceptor.
        drop(self.stop_tx.take());
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(if wake.is_ipv4() { [127, 0, 0, 1].into() } else { std::net::Ipv6Addr::LOCALHOST.into() });
        }
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        let conns: Vec<Conn> =
            self.shared.conns.lock().unwrap_or_else(|e| e.into_inner()).drain().map(|(_, c)| c).collect();
        for c in &conns {
            let _ = c.sock.shutdown(Shutdown::Both);
        }
        for c in conns {
            if let Some(t) = c.thread {
                let _ = t.join();
            }
        }
        if let Some(t) = self.detector.take() {
            let _ = t.join();
        }
        drop(self.dir_lock.take());
        tracing::info!(addr = %self.addr, "coordinator stopped");
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        if self.accept.is_some() {
            self.stop(true);
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Coord> {
        self.coord.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lead(&self) -> MutexGuard<'_, Lead> {
        self.lead.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Ok if this coordinator leads at `now`; else the `SERVER_ERROR` text.
    fn leading(&self, now: Instant) -> Result<(), String> {
        let l = self.lead();
        if l.rev.is_some() && l.valid_until.is_none_or(|u| now < u) {
            return Ok(());
        }
        Err(match &l.leader {
            Some(a) => format!("not the leader; leader {a}"),
            None => "not the leader".to_string(),
        })
    }

    fn step_down(&self, why: &str) {
        let mut l = self.lead();
        if l.rev.take().is_some() {
            l.valid_until = None;
            tracing::warn!("coordinator: no longer leading: {why}");
        }
    }

    /// Run a decision on a copy of the state; if the stored state changed,
    /// write it before the copy becomes the state (so no reply reveals an
    /// epoch that a crash could lose). A failed write leaves the state as
    /// it was.
    fn mutate<T>(&self, f: impl FnOnce(&mut Coord) -> T) -> Result<T, String> {
        let mut cur = self.lock();
        let rev = self.lead().rev;
        let Some(rev) = rev else { return Err(self.leading(Instant::now()).unwrap_err()) };
        let mut next = cur.clone();
        let r = f(&mut next);
        if next.take_dirty() {
            let saved = match &self.store {
                Store::File(st) => st.save(&next.stored()).map_err(|e| format!("{}: {e}", st.dir().display())),
                Store::Etcd(etcd) => match etcd.save_if_leader(rev, &next.stored()) {
                    Ok(true) => Ok(()),
                    Ok(false) => {
                        drop(cur);
                        self.step_down("another coordinator holds the leader key");
                        return Err(self.leading(Instant::now()).unwrap_err());
                    }
                    Err(e) => Err(e),
                },
            };
            if let Err(e) = saved {
                cur.counters.state_write_errors += 1;
                tracing::error!("coordinator: state not written: {e}");
                return Err(format!("state not saved: {e}"));
            }
            next.counters.state_writes += 1;
        }
        *cur = next;
        Ok(r)
    }
}

/// Checks the Up members every ~beat/2.
fn detector(sh: &Arc<Shared>, timing: Timing, stop: mpsc::Receiver<()>) {
    let tick = (timing.beat / 2).max(Duration::from_millis(1));
    let mut last = Instant::now();
    loop {
        match stop.recv_timeout(tick) {
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            _ => return,
        }
        let now = Instant::now();
        if sh.leading(now).is_err() {
            // A standby (etcd): the leader checks; a coordinator that takes over
            // gives every Up server a grace period of its own.
            last = now;
            continue;
        }
        if now.duration_since(last) > timing.lease {
            // We were not running (paused, starved): the servers' beats
            // could not be seen; do not take that for their failure.
            tracing::warn!(
                late_ms = now.duration_since(last).as_millis() as u64,
                "coordinator: failure check ran late; every Up server gets a grace period"
            );
            sh.lock().grace(now);
        }
        last = now;
        phase3::tick(sh, now);
        orchestra::tick(sh);
        if !sh.lock().any_overdue(now) {
            continue; // the common case: no copy of the state, no write
        }
        match sh.mutate(|c| c.check(now)) {
            Ok(f) if !f.down.is_empty() => {
                for s in &f.down {
                    tracing::info!(server = s, "coordinator: server down (missed heartbeats)");
                }
                match f.epoch {
                    Some(epoch) => tracing::info!(cachelets = f.reassigned, epoch, "coordinator: reassigned cachelets"),
                    None => tracing::info!("coordinator: no Up server left to take the cachelets; none reassigned"),
                }
            }
            Ok(_) => {}
            Err(e) => tracing::error!("coordinator: failure check not applied: {e}"),
        }
    }
}

fn acceptor(sh: &Arc<Shared>, listener: TcpListener) {
    let mut next_id = 0u64;
    for s in listener.incoming() {
        if sh.stop.load(Ordering::SeqCst) {
            return;
        }
        let sock = match s {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("coordinator: accept: {e}");
                std::thread::sleep(Duration::from_millis(10)); // e.g. out of descriptors: do not spin
                continue;
            }
        };
        let mut conns = sh.conns.lock().unwrap_or_else(|e| e.into_inner());
        if conns.len() >= sh.max_conns {
            sh.conns_refused.fetch_add(1, Ordering::Relaxed);
            let _ = (&sock).write_all(b"SERVER_ERROR too many connections\r\n");
            continue;
        }
        let Ok(clone) = sock.try_clone() else { continue };
        let _ = sock.set_nodelay(true);
        let _ = sock.set_read_timeout(Some(sh.idle_timeout));
        let _ = sock.set_write_timeout(Some(sh.idle_timeout));
        next_id += 1;
        let id = next_id;
        sh.total_conns.fetch_add(1, Ordering::Relaxed);
        let sh2 = sh.clone();
        // Registered under the lock before the thread can remove itself.
        let t = std::thread::Builder::new().name("mbal-coord-conn".into()).spawn(move || {
            connection(&sh2, sock);
            sh2.conns.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
        });
        match t {
            Ok(t) => {
                conns.insert(id, Conn { sock: clone, thread: Some(t) });
            }
            Err(e) => tracing::warn!("coordinator: no thread for a connection: {e}"),
        }
    }
}

fn connection(sh: &Shared, sock: TcpStream) {
    let peer = sock.peer_addr().ok();
    let ctl = sock.try_clone().ok();
    let r = match &sh.tls {
        None => serve(sh, sock),
        Some(tls) => match tls.accept() {
            Ok(conn) => serve(sh, rustls::StreamOwned::new(conn, sock)),
            Err(e) => Err(io::Error::other(e)),
        },
    };
    match r {
        Err(e) => tracing::debug!(?peer, "coordinator: connection closed: {e}"),
        Ok(()) => {
            if let Some(s) = ctl {
                linger_close(s);
            }
        }
    }
}

/// Close after our last reply without losing it: FIN first, then read and
/// drop what the peer still sends (at most 64 KiB, 500 ms), so that unread
/// input (the rest of a line too long) does not turn the close into a reset
/// that could discard the reply before the peer reads it.
fn linger_close(mut s: TcpStream) {
    let _ = s.shutdown(Shutdown::Write);
    let deadline = Instant::now() + Duration::from_millis(500);
    let mut buf = [0u8; 4096];
    let mut total = 0;
    while total < 64 << 10 {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || s.set_read_timeout(Some(left)).is_err() {
            return;
        }
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => total += n,
        }
    }
}

enum Got {
    Line,
    TooLong,
    Eof,
}

/// Read one line (without its `\r\n`) into `line`: at most [`MAX_LINE`]
/// bytes, and within `limit` of its first byte.
fn read_line<R: BufRead>(r: &mut R, line: &mut Vec<u8>, limit: Duration) -> io::Result<Got> {
    line.clear();
    let mut started: Option<Instant> = None;
    loop {
        let buf = r.fill_buf()?;
        if buf.is_empty() {
            return Ok(Got::Eof);
        }
        let t0 = *started.get_or_insert_with(Instant::now);
        match buf.iter().position(|&b| b == b'\n') {
            Some(i) => {
                if line.len() + i > MAX_LINE + 1 {
                    return Ok(Got::TooLong);
                }
                line.extend_from_slice(&buf[..i]);
                r.consume(i + 1);
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                if line.len() > MAX_LINE {
                    return Ok(Got::TooLong);
                }
                return Ok(Got::Line);
            }
            None => {
                let n = buf.len();
                // (+1: room for the `\r` of a line of MAX_LINE bytes)
                if line.len() + n > MAX_LINE + 1 {
                    return Ok(Got::TooLong);
                }
                line.extend_from_slice(buf);
                r.consume(n);
                if t0.elapsed() > limit {
                    return Err(io::Error::new(io::ErrorKind::TimedOut, "a line took too long"));
                }
            }
        }
    }
}

/// Per-connection state.
#[derive(Default)]
struct Session {
    nonce: Option<[u8; peer_auth::NONCE_LEN]>,
    peer_ok: bool,
}

fn serve<S: Read + Write>(sh: &Shared, stream: S) -> io::Result<()> {
    let mut r = BufReader::with_capacity(MAX_LINE + 2, stream);
    let mut line = Vec::with_capacity(256);
    let mut out = Vec::with_capacity(1024);
    let mut session = Session::default();
    while !sh.stop.load(Ordering::Relaxed) {
        match read_line(&mut r, &mut line, sh.idle_timeout)? {
            Got::Eof => return Ok(()),
            Got::TooLong => {
                sh.lock().counters.bad_commands += 1;
                let w = r.get_mut();
                w.write_all(b"CLIENT_ERROR line too long\r\n")?;
                return w.flush();
            }
            Got::Line => {}
        }
        out.clear();
        if out.capacity() > 64 * 1024 {
            // (a map answered: do not keep its size for every connection)
            out.shrink_to(4096);
        }
        if let Some((id, n)) = phase3_head(&line) {
            // `mbal phase3 <id> <bytes>` and its block (a server's epoch report).
            let mut block = vec![0u8; n + 2];
            r.read_exact(&mut block)?;
            block.truncate(n);
            if commands::may_act(sh, &session, &mut out) {
                phase3::report(sh, id, &block, &mut out);
            }
        } else if !command(sh, &mut session, &line, &mut out) {
            return Ok(());
        }
        let w = r.get_mut();
        w.write_all(&out)?;
        w.flush()?;
    }
    Ok(())
}

/// `mbal phase3 <id> <bytes>`: the server and the block's length (at most 16 MiB).
fn phase3_head(line: &[u8]) -> Option<(u16, usize)> {
    let t = std::str::from_utf8(line).ok()?;
    match t.split_ascii_whitespace().collect::<Vec<_>>()[..] {
        ["mbal", "phase3", id, n] => Some((id.parse().ok()?, n.parse().ok().filter(|&n: &usize| n <= 16 << 20)?)),
        _ => None,
    }
}

/// The coordinator's `stats` and members table, read in-process (see [`Handle::stats_source`]).
#[derive(Clone)]
pub struct StatsSource(Arc<Shared>);

impl StatsSource {
    /// `stats`: (name, value) in the order the command answers them.
    pub fn stats(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        stats(&self.0, &mut out);
        String::from_utf8_lossy(&out)
            .lines()
            .filter_map(|l| l.strip_prefix("STAT ")?.split_once(' ').map(|(k, v)| (k.to_string(), v.to_string())))
            .collect()
    }

    /// `mbal members`'s rows.
    pub fn members(&self) -> Vec<crate::state::MemberRow> {
        self.0.lock().member_rows(Instant::now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_bounded_and_split_on_lf() {
        let mut line = Vec::new();
        let lim = Duration::from_secs(5);
        let mut r = io::Cursor::new(b"mbal map\r\nstats\n".to_vec());
        assert!(matches!(read_line(&mut r, &mut line, lim).unwrap(), Got::Line));
        assert_eq!(line, b"mbal map");
        assert!(matches!(read_line(&mut r, &mut line, lim).unwrap(), Got::Line));
        assert_eq!(line, b"stats");
        assert!(matches!(read_line(&mut r, &mut line, lim).unwrap(), Got::Eof));
        // MAX_LINE bytes before the line end: accepted, one more: refused.
        for (len, end, ok) in [(MAX_LINE, "\r\n", true), (MAX_LINE, "\n", true), (MAX_LINE + 1, "\n", false)] {
            let mut input = vec![b'x'; len];
            input.extend_from_slice(end.as_bytes());
            let mut r = BufReader::with_capacity(64, io::Cursor::new(input));
            let got = read_line(&mut r, &mut line, lim).unwrap();
            assert_eq!(matches!(got, Got::Line), ok, "{len} {end:?}");
            assert_eq!(matches!(got, Got::TooLong), !ok);
        }
        let mut r = BufReader::with_capacity(64, io::Cursor::new(vec![b'x'; MAX_LINE + 2]));
        assert!(matches!(read_line(&mut r, &mut line, lim).unwrap(), Got::TooLong), "no line end at all");
    }
}
