//! The server's side of the coordinator (`--coordinator`, docs/protocol.md "Coordinator"):
//! registration at start, then the heartbeat thread (`mbal-beat`).
//!
//! * **Registration** (`register`, before the workers start): `mbal register` tells the
//!   coordinator this server's addresses and gets its id, the beat interval and the lease;
//!   `mbal map` gets the map the workers start from.
//! * **Heartbeats**: every beat interval, `mbal beat <id> <epoch>`. `BEAT <epoch> <lease>`
//!   renews the lease (`Shared::lease_until_ns`) to the time the beat was *sent* plus the
//!   lease, so it always ends before the coordinator's failure timeout, counted from when the
//!   beat was *received*, can run out (the coordinator refuses a lease not shorter). A newer
//!   epoch fetches the map, which goes to the controller (`CtlMsg::CoordMap`), which gives
//!   cachelets up and takes new ones empty.
//! * **Fencing**: a worker past `lease_until_ns` serves none of the server's cachelets
//!   (`moves::FENCED`). A server cut off from the coordinator (paused, partitioned) stops
//!   serving before the coordinator may give its cachelets to another server.
//!   One exception, the *clean sweep*: when, in one beat, every listed coordinator either
//!   *refuses* the connection (it is not running) or answers `not the leader` (it runs, but
//!   does not lead at that moment), no one leads, so no one can give anything away; the lease
//!   is renewed to the sweep's start `t0` plus the lease, and the cluster keeps serving with its
//!   last map (a single coordinator that is down, or an etcd failover in progress). Why it is
//!   safe, given that a coordinator that starts to lead (a restart, or a standby winning the
//!   etcd lease) gives every Up server a full failure timeout from that moment before it
//!   declares anyone dead:
//!   - a coordinator that leads after we asked it (>= `t0`) cannot declare this server dead
//!     before `t0 + failure timeout`, after the renewed lease (`t0 + lease`) ran out;
//!   - a coordinator leading when we asked it would have answered `BEAT`; so a leader whose term
//!     covers part of the sweep must have stopped (died, or lost its etcd lease) during it.
//!     That is why the renewal also needs the lease to be still live at `t0` (an expired lease
//!     is never revived: a leader may have declared this server dead after it ran out, then
//!     died) and the sweep to take at most a beat interval (a leader's declaration comes a
//!     failure timeout after our last beat it saw, i.e. more than `failure timeout - lease`,
//!     at least a beat with the default timing, after the lease it gave us was live);
//!   - one coordinator that does not answer at all (a partition, a dead host) spoils the sweep:
//!     it is not told apart from this server being cut off, and the lease runs out.
//! * **Several coordinators** (`--coordinator A,B`, coordinators sharing etcd): registration
//!   and beats go to the one that leads. `SERVER_ERROR not the leader[; leader ADDR]` sends
//!   the request to the named leader if it is listed, else to the next; any other failure
//!   moves on to the next coordinator at once, within the same beat. Only a leader's `BEAT`
//!   renews the lease (a leader answers a beat only while its etcd lease is surely held, so a
//!   deposed leader's `BEAT` cannot outlive its leadership by more than a lease).
//! * **Declared dead** (`GONE`): the server fences at once, registers again and installs the
//!   map it is given with `reset` (everything it held is dropped; what it gets back starts
//!   empty); the lease is renewed only after every worker has applied that map
//!   (`Shared::resetting`, cleared by the controller).
//! * Its own moves between workers go to the coordinator as `mbal moved` (`Report`).

use crate::msg::CtlMsg;
use crate::shared::Shared;
use crossbeam_channel::{Receiver, RecvTimeoutError};
use mbal_cluster::ClusterMap;
use mbal_tls::BlockingStream;
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The coordinator's answers are lines, but a map; no line is longer than this.
const MAX_LINE: usize = 4096;

/// What the controller asks the heartbeat thread to tell the coordinator.
pub(crate) enum Report {
    /// A move between this server's workers ended.
    Moved { cachelet: u32, worker: u16 },
    /// An epoch closed: this server's mean load per worker and Phase 1's slot figures, for the
    /// other servers (`mbal report`; the answer brings theirs, which go to the controller as
    /// `CtlMsg::PeerLoad`: the coordinator relays what each server would otherwise poll from
    /// every other one, `crate::peerload`).
    Load { mean: f64, hot: Option<mbal_balance::PeerHot> },
    /// A cross-server move's request to the coordinator (`crate::migrate`): one line, its
    /// answer line back.
    Call { line: String, reply: crossbeam_channel::Sender<io::Result<String>> },
    /// A move's commit (`crate::migrate`): like `Call`, and if it is answered OK, no new map
    /// is installed until its `Committed` (the destination must have the cachelet before this
    /// server sends it the cachelet's requests), for at most `HOLD_MAPS`.
    Commit { line: String, reply: crossbeam_channel::Sender<io::Result<String>> },
    /// A move that `Commit` held maps for is through (its destination adopted the cachelet, or
    /// will from the map): that hold ends, and a beat goes now.
    Committed,
    /// Beat now (a cachelet arrived here: fetch the map at once rather than at the next beat).
    /// Holds of this server's own commits stay.
    BeatNow,
    /// An epoch's report for Phase 3 at the coordinator (`mbal phase3`).
    Phase3(Box<mbal_balance::Phase3Report>),
}

/// The heartbeat thread looks at the stop at least this often. (It waited at most 10 ms, and
/// not at all once the server had left the cluster: a left server's beat thread spun on a core.)
const STOP_POLL: Duration = Duration::from_millis(50);

/// How long a committed move may hold back new maps (`Report::Commit`).
const HOLD_MAPS: Duration = Duration::from_secs(2);

/// Heat figures sent per list at most (the hottest; a report is one line).
const MAX_HEAT: usize = 64;

/// A load report as one line: `<mean> <spare|-> <held,...|-> <waiting,...|->`.
pub(crate) fn report_line(mean: f64, hot: Option<&mbal_balance::PeerHot>) -> String {
    let list = |v: &[f64]| {
        let mut v: Vec<f64> = v.to_vec();
        v.sort_by(|a, b| b.total_cmp(a));
        v.truncate(MAX_HEAT);
        if v.is_empty() {
            "-".to_string()
        } else {
            v.iter().map(|x| format!("{x:.1}")).collect::<Vec<_>>().join(",")
        }
    };
    match hot {
        None => format!("{mean:.3} - - -"),
        Some(h) => format!("{mean:.3} {} {} {}", h.spare, list(&h.heat.held), list(&h.heat.waiting)),
    }
}

/// A report read back (`report_line`'s form).
pub(crate) fn parse_report(words: &[&str]) -> Option<(f64, Option<mbal_balance::PeerHot>)> {
    let [mean, spare, held, waiting] = words else { return None };
    let mean = mean.parse::<f64>().ok()?;
    if *spare == "-" {
        return Some((mean, None));
    }
    let list = |s: &str| -> Option<Vec<f64>> {
        if s == "-" {
            return Some(Vec::new());
        }
        s.split(',').map(|x| x.parse::<f64>().ok()).collect()
    };
    let heat = mbal_balance::SlotHeat { held: list(held)?, waiting: list(waiting)? };
    Some((mean, Some(mbal_balance::PeerHot { spare: spare.parse().ok()?, heat })))
}

/// A connection to the coordinator: requests and their answers, one at a time.
pub(crate) struct Conn {
    s: BlockingStream,
    buf: Vec<u8>,
}

impl Conn {
    fn dial(settings: &crate::config::Settings, addr: SocketAddr, timeout: Duration) -> io::Result<Conn> {
        let s = settings.peer_dialer(timeout).dial(addr, mbal_member::dial::Proto::Text)?;
        Ok(Conn { s, buf: Vec::new() })
    }

    /// Send one request line and a data block, read one answer line.
    fn call_block(&mut self, line: &str, block: &[u8]) -> io::Result<String> {
        let mut b = Vec::with_capacity(line.len() + block.len() + 4);
        b.extend_from_slice(line.as_bytes());
        b.extend_from_slice(b"\r\n");
        b.extend_from_slice(block);
        b.extend_from_slice(b"\r\n");
        self.s.write_all(&b)?;
        self.s.flush()?;
        self.line()
    }

    /// Send one request line, read one answer line (without CR LF).
    fn call(&mut self, line: &str) -> io::Result<String> {
        self.s.write_all(format!("{line}\r\n").as_bytes())?;
        self.s.flush()?;
        self.line()
    }

    fn fill(&mut self) -> io::Result<()> {
        let mut chunk = [0u8; 16 * 1024];
        let n = self.s.read(&mut chunk)?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the coordinator closed the connection"));
        }
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(())
    }

    fn line(&mut self) -> io::Result<String> {
        loop {
            if let Some(i) = self.buf.windows(2).position(|w| w == b"\r\n") {
                let line = String::from_utf8_lossy(&self.buf[..i]).into_owned();
                self.buf.drain(..i + 2);
                return Ok(line);
            }
            if self.buf.len() > MAX_LINE {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "the coordinator's answer line is too long"));
            }
            self.fill()?;
        }
    }

    /// `mbal map`: `MAP <epoch> <bytes>`, the JSON, CR LF.
    fn map(&mut self) -> io::Result<ClusterMap> {
        let head = self.call("mbal map")?;
        let len = match head.split_whitespace().collect::<Vec<_>>()[..] {
            ["MAP", _, len] => len.parse::<usize>().map_err(|_| bad(&head))?,
            _ => return Err(bad(&head)),
        };
        if len > 256 << 20 {
            return Err(bad(&head));
        }
        while self.buf.len() < len + 2 {
            self.fill()?;
        }
        let json: Vec<u8> = self.buf.drain(..len + 2).take(len).collect();
        let json = std::str::from_utf8(&json).map_err(|_| bad("a map that is not UTF-8"))?;
        ClusterMap::from_json(json).map_err(|e| bad(&format!("the coordinator's map: {e}")))
    }
}

fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("unexpected answer from the coordinator: {what}"))
}

/// `SERVER_ERROR not the leader[; leader ADDR]`: the error an answer of a coordinator that does
/// not lead (etcd mode) becomes, with the leader it names.
#[derive(Debug)]
struct NotLeader(Option<SocketAddr>);

impl std::fmt::Display for NotLeader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(a) => write!(f, "not the leader; leader {a}"),
            None => write!(f, "not the leader"),
        }
    }
}

impl std::error::Error for NotLeader {}

/// An answer that says `not the leader`, as an error.
fn not_leader(answer: &str) -> Option<io::Error> {
    let rest = answer.strip_prefix("SERVER_ERROR not the leader")?;
    let leader = rest.trim_start_matches(';').trim().strip_prefix("leader ").and_then(|a| a.trim().parse().ok());
    Some(io::Error::other(NotLeader(leader)))
}

/// The leader an error names, if it is a `not the leader` answer (`Some(None)`: none named).
fn leader_named(e: &io::Error) -> Option<Option<SocketAddr>> {
    e.get_ref().and_then(|i| i.downcast_ref::<NotLeader>()).map(|n| n.0)
}

/// The coordinator to try after `cur` failed: the leader it named if listed and not yet
/// tried, else the next one not yet tried.
fn next_coordinator(list: &[SocketAddr], tried: &[bool], cur: usize, named: Option<SocketAddr>) -> Option<usize> {
    if let Some(i) = named.and_then(|a| list.iter().position(|&c| c == a)) {
        if !tried[i] {
            return Some(i);
        }
    }
    (1..list.len()).map(|k| (cur + k) % list.len()).find(|&i| !tried[i])
}

/// This server, registered.
pub(crate) struct Registered {
    /// When the registration was sent (the lease runs from then).
    pub sent: Instant,
    pub id: u16,
    pub map: ClusterMap,
    pub beat: Duration,
    pub lease: Duration,
    conn: Conn,
    /// Which of the listed coordinators (the leader).
    at: usize,
}

/// The registration line: `mbal register <id|-> <main> <workers> <worker addrs|-> <memory>`.
fn register_line(
    id: Option<u16>,
    main: SocketAddr,
    workers: usize,
    addrs: &[SocketAddr],
    memory: usize,
    warm: bool,
) -> String {
    let id = id.map_or("-".to_string(), |i| i.to_string());
    let addrs = if addrs.is_empty() {
        "-".to_string()
    } else {
        addrs.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(",")
    };
    let warm = if warm { " warm" } else { "" };
    format!("mbal register {id} {main} {workers} {addrs} {memory}{warm}")
}

/// Register with the coordinator that leads and read the map, trying the listed ones in turn
/// (following a `not the leader` answer's leader), again and again until `wait` has passed
/// (the coordinators may be starting too). A refusal (a wrong id, a bad secret) is not tried
/// again.
pub(crate) fn register(
    settings: &crate::config::Settings,
    main: SocketAddr,
    addrs: &[SocketAddr],
) -> io::Result<Registered> {
    let list = &settings.coordinator;
    let id = settings.cluster.as_ref().map(|(_, id)| *id).filter(|&id| id != crate::config::JOIN);
    let line = register_line(id, main, settings.threads, addrs, settings.memory_limit, settings.join_warm);
    let until = Instant::now() + Duration::from_millis(settings.coordinator_wait_ms);
    let mut pause = Duration::from_millis(50);
    loop {
        let mut tried = vec![false; list.len()];
        let mut cur = Some(0);
        let mut last = None;
        while let Some(i) = cur {
            tried[i] = true;
            match try_register(settings, list[i], &line) {
                Ok(mut r) => {
                    r.at = i;
                    return Ok(r);
                }
                Err(e) if e.kind() == io::ErrorKind::PermissionDenied => return Err(e),
                Err(e) => {
                    tracing::info!(coordinator = %list[i], "coordinator not reached yet: {e}");
                    cur = next_coordinator(list, &tried, i, leader_named(&e).flatten());
                    last = Some((list[i], e));
                }
            }
        }
        let (coordinator, e) = last.expect("at least one coordinator");
        if Instant::now() + pause >= until {
            return Err(io::Error::new(
                e.kind(),
                format!("coordinator {coordinator}: {e} (tried for {} ms)", settings.coordinator_wait_ms),
            ));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(500));
    }
}

fn try_register(settings: &crate::config::Settings, coordinator: SocketAddr, line: &str) -> io::Result<Registered> {
    let mut conn = Conn::dial(settings, coordinator, Duration::from_secs(2))?;
    let sent = Instant::now();
    let (id, beat, lease) = registered(&conn.call(line)?)?;
    let map = conn.map()?;
    Ok(Registered { sent, id, map, beat, lease, conn, at: 0 })
}

/// `REGISTERED <id> <epoch> <beat ms> <lease ms>`.
fn registered(answer: &str) -> io::Result<(u16, Duration, Duration)> {
    match answer.split_whitespace().collect::<Vec<_>>()[..] {
        ["REGISTERED", id, _epoch, beat, lease] => {
            let (Ok(id), Ok(beat), Ok(lease)) = (id.parse::<u16>(), beat.parse::<u64>(), lease.parse::<u64>()) else {
                return Err(bad(answer));
            };
            Ok((id, Duration::from_millis(beat.max(1)), Duration::from_millis(lease)))
        }
        _ if answer.starts_with("SERVER_ERROR not the leader") => Err(not_leader(answer).expect("checked")),
        _ if answer.starts_with("CLIENT_ERROR") => {
            Err(io::Error::new(io::ErrorKind::PermissionDenied, answer.to_string()))
        }
        _ => Err(bad(answer)),
    }
}

/// Ask for a higher scheduling priority (nice -10) for the calling thread, best effort: on a
/// machine loaded far past its cores a heartbeat thread that waits its turn for 300 ms lets
/// the lease lapse (docs/benchmarks.md §18). Needs CAP_SYS_NICE; without it nothing changes.
fn raise_priority() {
    // SAFETY: gettid and setpriority on this thread's own id; no memory is passed.
    let r = unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, -10)
    };
    if r != 0 {
        tracing::debug!("heartbeat thread: priority not raised: {}", io::Error::last_os_error());
    }
}

/// Start the heartbeat thread of a registered server.
pub(crate) fn spawn(
    shared: Arc<Shared>,
    reg: Registered,
    main: SocketAddr,
    addrs: Vec<SocketAddr>,
    reports: Receiver<Report>,
) -> io::Result<std::thread::JoinHandle<()>> {
    let line = register_line(Some(reg.id), main, shared.settings.threads, &addrs, shared.settings.memory_limit, false);
    let mut b = Beat {
        epoch: reg.map.epoch(),
        id: reg.id,
        beat: reg.beat,
        lease: reg.lease,
        conn: Some(reg.conn),
        coordinators: shared.settings.coordinator.clone(),
        cur: reg.at,
        shared,
        register_line: line,
        left: false,
        hold: None,
        reset_pending: false,
    };
    std::thread::Builder::new().name("mbal-beat".into()).spawn(move || {
        // A beat thread that panics leaves the server fenced for good: the process ends
        // instead, with the reason (`life`).
        let _watch = b.shared.life.watch();
        raise_priority();
        b.run(reports)
    })
}

struct Beat {
    shared: Arc<Shared>,
    /// The listed coordinators, and the one `conn` goes to (the leader, as far as known).
    coordinators: Vec<SocketAddr>,
    cur: usize,
    id: u16,
    /// The newest map epoch the controller was given.
    epoch: u64,
    beat: Duration,
    lease: Duration,
    conn: Option<Conn>,
    register_line: String,
    /// Taken out of the cluster: no more beats.
    left: bool,
    /// Commits that hold back new maps (`Report::Commit`): how many are not yet `Committed`,
    /// and until when at most.
    hold: Option<(u32, Instant)>,
    /// Declared dead (`GONE`) and the map to start over from not yet given to the controller
    /// (the registration's answer or the map's fetch failed): the next beat the coordinator
    /// answers installs its map with `reset`, whatever its epoch, or the server would stay
    /// fenced (`Shared::resetting`) and keep what it held before.
    reset_pending: bool,
}

impl Beat {
    fn run(&mut self, reports: Receiver<Report>) {
        let mut next = Instant::now();
        while !self.shared.shutdown.load(Ordering::Relaxed) {
            // Wait for the next beat (a server that left waits for the stop); a report in
            // between goes at once. At most `STOP_POLL`, so that the stop is seen soon.
            let wait = if self.left { STOP_POLL } else { next.saturating_duration_since(Instant::now()) };
            match reports.recv_timeout(wait.min(STOP_POLL)) {
                Ok(r) => {
                    self.report(r);
                    continue;
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            if Instant::now() < next || self.left {
                // (A server that left beats no more; the thread waits for the stop, so that
                // its end is a stop's, `life`.)
                continue;
            }
            // After a reset, beat again as soon as every worker has applied the map: the lease
            // is renewed only by a beat answered after that.
            let soon = self.shared.resetting.load(Ordering::Acquire);
            next = Instant::now() + if soon { Duration::from_millis(10) } else { self.beat };
            self.sweep();
        }
        if self.shared.shutdown.load(Ordering::Relaxed) && !self.left && self.shared.settings.leave_on_shutdown {
            // A server that stops leaves: its cachelets go to the others at once, not after
            // the failure timeout.
            let line = format!("mbal leave {}", self.id);
            match self.connection().and_then(|c| c.call(&line)) {
                Ok(a) => tracing::info!(server = self.id, "left the cluster on shutdown: {a}"),
                Err(e) => tracing::info!(server = self.id, "could not leave the cluster on shutdown: {e}"),
            }
        }
    }

    /// One beat: to the current coordinator, then on a failure to the others in turn (the
    /// named leader first); a clean sweep renews the lease (see the module docs).
    fn sweep(&mut self) {
        let t0 = self.shared.clock_ns();
        let live = self.shared.lease_until_ns.load(Ordering::Relaxed) > t0;
        let mut tried = vec![false; self.coordinators.len()];
        let mut clean = true;
        let mut cur = Some(self.cur);
        while let Some(i) = cur {
            tried[i] = true;
            if self.cur != i {
                self.cur = i;
                self.conn = None;
            }
            let Err(e) = self.beat_once() else { return };
            self.shared.coord.beat_failures.fetch_add(1, Ordering::Relaxed);
            self.conn = None;
            let named = leader_named(&e);
            if named.is_none() && e.kind() != io::ErrorKind::ConnectionRefused {
                clean = false;
            }
            tracing::debug!(coordinator = %self.coordinators[i], "heartbeat: {e}");
            cur = next_coordinator(&self.coordinators, &tried, i, named.flatten());
        }
        let quick = self.shared.clock_ns().saturating_sub(t0) <= self.beat.as_nanos() as u64;
        if clean && live && quick {
            // Every listed coordinator refused or does not lead: no one can give this server's
            // cachelets away (see the module docs).
            self.renew(t0);
        }
    }

    fn connection(&mut self) -> io::Result<&mut Conn> {
        if self.conn.is_none() {
            // Bounded by the beat interval, so a coordinator that does not answer costs a
            // missed beat, not a stalled thread.
            let timeout = self.beat.max(Duration::from_millis(50));
            let c = Conn::dial(&self.shared.settings, self.coordinators[self.cur], timeout)?;
            c.s.sock().set_read_timeout(Some(timeout.max(self.lease)))?;
            self.conn = Some(c);
        }
        Ok(self.conn.as_mut().expect("just set"))
    }

    fn renew(&self, sent_ns: u64) {
        if !self.shared.resetting.load(Ordering::Acquire) {
            self.shared.lease_until_ns.fetch_max(sent_ns + self.lease.as_nanos() as u64, Ordering::Relaxed);
        }
    }

    fn beat_once(&mut self) -> io::Result<()> {
        let sent = self.shared.clock_ns();
        let line = format!("mbal beat {} {}", self.id, self.epoch);
        let answer = self.connection()?.call(&line)?;
        let words: Vec<&str> = answer.split_whitespace().collect();
        match words[..] {
            ["BEAT", epoch, lease] => {
                let (Ok(epoch), Ok(lease)) = (epoch.parse::<u64>(), lease.parse::<u64>()) else {
                    return Err(bad(&answer));
                };
                self.shared.coord.beats.fetch_add(1, Ordering::Relaxed);
                self.lease = Duration::from_millis(lease);
                self.renew(sent);
                if self.reset_pending {
                    // The registration after a GONE went through, but its answer or the map
                    // was lost: start over from the map now.
                    let map = self.connection()?.map()?;
                    self.install(map, true);
                    return Ok(());
                }
                if epoch > self.epoch && self.hold.is_none_or(|(_, until)| Instant::now() >= until) {
                    let map = self.connection()?.map()?;
                    self.install(map, false);
                }
                Ok(())
            }
            ["GONE", _, "left"] => {
                // Taken out of the cluster (`mbal cluster leave`): drop everything, serve
                // nothing, beat no more.
                self.shared.coord.gone.fetch_add(1, Ordering::Relaxed);
                self.shared.lease_until_ns.store(0, Ordering::Relaxed);
                self.shared.resetting.store(true, Ordering::Release);
                let map = self.connection()?.map()?;
                self.install(map, true);
                self.left = true;
                tracing::warn!(server = self.id, "this server left the cluster: it serves nothing now");
                Ok(())
            }
            ["GONE", ..] => {
                // Declared dead: fence now, register again, start over from the map given.
                self.shared.coord.gone.fetch_add(1, Ordering::Relaxed);
                self.shared.resetting.store(true, Ordering::Release);
                self.shared.lease_until_ns.store(0, Ordering::Relaxed);
                self.reset_pending = true;
                tracing::warn!(server = self.id, "the coordinator declared this server dead: registering again");
                let line = self.register_line.clone();
                let (id, beat, lease) = registered(&self.connection()?.call(&line)?)?;
                if id != self.id {
                    // The coordinator keeps a server's id for its address.
                    return Err(bad(&format!("registered again as server {id}, was {}", self.id)));
                }
                self.shared.coord.registrations.fetch_add(1, Ordering::Relaxed);
                (self.beat, self.lease) = (beat, lease);
                let map = self.connection()?.map()?;
                self.install(map, true);
                Ok(())
            }
            _ => Err(not_leader(&answer).unwrap_or_else(|| bad(&answer))),
        }
    }

    fn install(&mut self, map: ClusterMap, reset: bool) {
        if reset {
            self.reset_pending = false;
        }
        self.epoch = self.epoch.max(map.epoch());
        self.shared.coord.maps_installed.fetch_add(1, Ordering::Relaxed);
        tracing::info!(server = self.id, epoch = map.epoch(), reset, "the coordinator's map");
        self.shared.tell_controller(CtlMsg::CoordMap { map: Box::new(map), reset });
    }

    fn report(&mut self, r: Report) {
        let (cachelet, worker) = match r {
            Report::Moved { cachelet, worker } => (cachelet, worker),
            Report::Load { mean, hot } => {
                if let Err(e) = self.load(mean, hot) {
                    self.conn = None;
                    tracing::debug!("load report: {e}");
                }
                return;
            }
            Report::Call { line, reply } => {
                let answer = self.connection().and_then(|c| c.call(&line));
                if answer.is_err() {
                    self.conn = None;
                }
                let _ = reply.send(answer);
                return;
            }
            Report::Commit { line, reply } => {
                let answer = self.connection().and_then(|c| c.call(&line));
                match &answer {
                    Ok(a) if a.starts_with("OK") => {
                        let n = self.hold.map_or(0, |(n, _)| n);
                        self.hold = Some((n + 1, Instant::now() + HOLD_MAPS));
                    }
                    Ok(_) => {}
                    Err(_) => self.conn = None,
                }
                let _ = reply.send(answer);
                return;
            }
            Report::Phase3(r) => {
                let json = serde_json::to_vec(&*r).unwrap_or_default();
                let head = format!("mbal phase3 {} {}", self.id, json.len());
                match self.connection().and_then(|c| c.call_block(&head, &json)) {
                    Ok(a) if a == "OK" => {}
                    Ok(a) => tracing::debug!("phase 3 report: {a}"),
                    Err(e) => {
                        self.conn = None;
                        tracing::debug!("phase 3 report: {e}");
                    }
                }
                return;
            }
            Report::Committed => {
                self.hold = match self.hold {
                    Some((n, until)) if n > 1 => Some((n - 1, until)),
                    _ => None,
                };
                if !self.left {
                    self.sweep();
                }
                return;
            }
            Report::BeatNow => {
                if !self.left {
                    self.sweep();
                }
                return;
            }
        };
        let line = format!("mbal moved {} {cachelet} {worker}", self.id);
        match self.connection().and_then(|c| c.call(&line)) {
            Ok(a) if a.starts_with("OK") => {}
            Ok(a) => tracing::info!(cachelet, worker, "the coordinator refused a move report: {a}"),
            Err(e) => {
                self.conn = None;
                tracing::debug!("move report: {e}");
            }
        }
    }
}

impl Beat {
    /// `mbal report`: this server's epoch for the others, theirs for the controller.
    fn load(&mut self, mean: f64, hot: Option<mbal_balance::PeerHot>) -> io::Result<()> {
        let line = format!("mbal report {} {}", self.id, report_line(mean, hot.as_ref()));
        let c = self.connection()?;
        let mut answer = c.call(&line)?;
        let mut peers = 0;
        while answer != "END" {
            let words: Vec<&str> = answer.split_whitespace().collect();
            match words[..] {
                ["PEER", id, _age, ref rest @ ..] => {
                    if let (Ok(server), Some((mean, hot))) = (id.parse::<u16>(), parse_report(rest)) {
                        self.shared.coord.peer_reports.fetch_add(1, Ordering::Relaxed);
                        self.shared.tell_controller(CtlMsg::PeerLoad { server, mean, hot });
                    }
                }
                _ => return Err(bad(&answer)),
            }
            peers += 1;
            if peers > u16::MAX as usize {
                return Err(bad("too many reports"));
            }
            answer = self.conn.as_mut().expect("connected").line()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_load_report_is_one_bounded_line_and_reads_back() {
        let heat = mbal_balance::SlotHeat { held: vec![1.0, 9.5], waiting: (0..500).map(f64::from).collect() };
        let hot = mbal_balance::PeerHot { spare: 3, heat };
        let line = report_line(12.25, Some(&hot));
        assert!(line.len() < 2048, "{}", line.len());
        let words: Vec<&str> = line.split_whitespace().collect();
        let (mean, back) = parse_report(&words).unwrap();
        assert_eq!(mean, 12.25);
        let back = back.unwrap();
        assert_eq!(back.spare, 3);
        assert_eq!(back.heat.held, vec![9.5, 1.0], "hottest first");
        assert_eq!(back.heat.waiting.len(), MAX_HEAT);
        assert_eq!(back.heat.waiting[0], 499.0);
        let line = report_line(0.5, None);
        assert_eq!(parse_report(&line.split_whitespace().collect::<Vec<_>>()), Some((0.5, None)));
        assert_eq!(parse_report(&["x", "-", "-", "-"]), None);
    }

    #[test]
    fn the_registration_line_and_answer() {
        let main: SocketAddr = "127.0.0.1:11211".parse().unwrap();
        assert_eq!(register_line(Some(2), main, 4, &[], 64, false), "mbal register 2 127.0.0.1:11211 4 - 64");
        let w: Vec<SocketAddr> = vec!["127.0.0.1:7000".parse().unwrap(), "127.0.0.1:7001".parse().unwrap()];
        assert_eq!(
            register_line(None, main, 2, &w, 1, true),
            "mbal register - 127.0.0.1:11211 2 127.0.0.1:7000,127.0.0.1:7001 1 warm"
        );
        let (id, beat, lease) = registered("REGISTERED 3 9 100 400").unwrap();
        assert_eq!((id, beat, lease), (3, Duration::from_millis(100), Duration::from_millis(400)));
        assert_eq!(
            registered("CLIENT_ERROR server 3 is 1.2.3.4:5").unwrap_err().kind(),
            io::ErrorKind::PermissionDenied
        );
        assert_eq!(registered("REGISTERED x").unwrap_err().kind(), io::ErrorKind::InvalidData);
        let e = registered("SERVER_ERROR not the leader; leader 127.0.0.1:7001").unwrap_err();
        assert_eq!(leader_named(&e), Some(Some("127.0.0.1:7001".parse().unwrap())));
        assert_eq!(leader_named(&registered("SERVER_ERROR not the leader").unwrap_err()), Some(None));
        assert_eq!(leader_named(&bad("x")), None);
    }

    #[test]
    fn the_next_coordinator_is_the_named_leader_if_listed_and_untried() {
        let l: Vec<SocketAddr> = (0..3).map(|i| format!("127.0.0.1:{}", 7000 + i).parse().unwrap()).collect();
        let other: SocketAddr = "127.0.0.1:9".parse().unwrap();
        assert_eq!(next_coordinator(&l, &[true, false, false], 0, Some(l[2])), Some(2));
        assert_eq!(next_coordinator(&l, &[true, false, false], 0, None), Some(1));
        assert_eq!(next_coordinator(&l, &[true, false, false], 0, Some(other)), Some(1), "not listed");
        assert_eq!(next_coordinator(&l, &[true, true, false], 1, Some(l[0])), Some(2), "tried already");
        assert_eq!(next_coordinator(&l, &[true, true, true], 2, None), None);
        assert_eq!(next_coordinator(&l[..1], &[true], 0, None), None);
    }
}
