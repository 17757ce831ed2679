//! A worker: one thread, one mio event loop, its own listening port, its
//! cachelets (in a `WorkerStore`), its connections and its inbox.
//!
//! The data path of an owned cachelet is: read -> `mbal_proto::parse` ->
//! `dispatch::handle` (hash -> VN -> cachelet -> owner, all local tables) ->
//! `exec` -> append the reply to the connection's output -> one write per
//! read batch. No lock, no shared atomic.
//!
//! A request for a cachelet another worker owns joins this round's batch
//! for that worker (`msg`); the connection reserves an output slot so the
//! reply is written in pipeline order when the owner's reply batch comes
//! back. One round of the loop is: poll -> read and dispatch the ready
//! connections -> execute the inbox (requests from peers, replies to ours)
//! -> write every connection that got replies, once -> send each peer its
//! batch, waking it only if it sleeps.
//!
//! Connections on the main port are accepted by the server's acceptor
//! thread (`lib.rs`) and handed to the worker with the fewest; each worker
//! accepts its own port's connections itself.
//!
//! Bounded: a worker forwards at most `max_inflight` requests that have not
//! been answered; past that it stops reading its connections (TCP pushes
//! back on their clients) until replies come in, so a slow owner cannot make
//! its peers' queues, or its own inbox, grow without bound. A connection
//! holds at most about one request (a data block, or `max_line` of a
//! command line): a longer `get` line is parsed and dispatched in pieces,
//! the connection keeping only its `LineState` between them, and a get
//! stops between keys once `MAX_PENDING_OUTPUT` of replies are unsent.

use crate::capacity::Capacity;
use crate::config::{Binding, Settings};
use crate::control::CtlMsg;
use crate::dispatch::{self, text_key, Action, Route};
use crate::exec::{self, locate, Ctx};
use crate::moves::{self, Parked, Tables};
use crate::msg::{Envelope, FwdKind, FwdReq, HandOff, Mailbox, Outbox, Peers, ReplyTo, ReqBatch, NO_CACHELET};
use crate::output::{Output, Slot, StatsFormat, MAX_PENDING_OUTPUT};
use crate::stats::{self, BinSink, CacheletInfo, ConnInfo, Counters, ProcessInfo, TextSink, WorkerSnapshot};
use crossbeam_channel::{Receiver, Sender};
use mbal_balance::{CacheletSample, EpochSnapshot, WorkerSample};
use mbal_cluster::{KeySpace, Owner};
use mbal_proto::binary::{opcode as op, status as st, write_response};
use mbal_proto::meta::meta_key;
use mbal_proto::text::{LineState, TextCmd};
use mbal_proto::{Limits, Parsed, Protocol, Request};
use mbal_store::WorkerStore;
use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token};
use slab::Slab;
use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const OWN_LISTENER: Token = Token(0);
pub(crate) const WAKER: Token = Token(1);
const FIRST_CONN: usize = 2;

/// Read in chunks of this size; a connection's buffer grows only as far as
/// one request needs (bounded by the parser's limits).
const READ_CHUNK: usize = 16 * 1024;
/// A connection waiting on another worker's reply writes what is ready
/// before it only once this much has piled up (else the reply's arrival
/// writes everything at once: one write per read batch, not two).
const EARLY_FLUSH: usize = 32 << 10;

/// State shared by all workers of a process. Nothing here is touched on the
/// GET/SET path: the connection counters and the flags are used on accept,
/// close and shutdown only.
pub(crate) struct Shared {
    pub settings: Settings,
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
    pub balancer: Mutex<Option<crate::control::BalancerStatus>>,
    pub start: Instant,
    pub start_unix: u64,
    pub curr_conns: AtomicUsize,
    /// Open connections per worker (the acceptor hands a new one to the
    /// worker with the fewest). Written on accept and close only.
    pub worker_conns: Vec<AtomicUsize>,
    /// Connections the acceptor refused (over `-c`).
    pub rejected_conns: AtomicU64,
    pub shutdown: AtomicBool,
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
}

impl Shared {
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

    /// Send the controller a message.
    pub fn tell_controller(&self, msg: CtlMsg) {
        let _ = self.control.send(msg);
    }

    pub fn peers(&self) -> &Peers {
        self.peers.get().expect("peers are set before workers start")
    }

    pub fn wake_all(&self) {
        if let Some(p) = self.peers.get() {
            p.wake_all();
        }
        self.tell_controller(CtlMsg::Wake);
    }

    /// A connection of `worker` closed. Wakes the acceptor if it stopped
    /// accepting at the connection limit (`-o no_maxconns_fast`); SeqCst
    /// pairs with the acceptor's store of `accept_paused` then load of
    /// `curr_conns`, so one of the two sees the other.
    pub fn conn_closed(&self, worker: usize) {
        self.worker_conns[worker].fetch_sub(1, Ordering::Relaxed);
        self.curr_conns.fetch_sub(1, Ordering::SeqCst);
        if self.accept_paused.load(Ordering::SeqCst) {
            if let Some(w) = self.accept_waker.get() {
                let _ = w.wake();
            }
        }
    }
}

struct Conn {
    sock: TcpStream,
    id: u64,
    gen: u64,
    peer: SocketAddr,
    listen_addr: SocketAddr,
    proto: Option<Protocol>,
    rbuf: Vec<u8>,
    /// Bytes still to discard from the stream (a rejected data block).
    skip: usize,
    /// The parser's place in a long get line (answered piece by piece).
    line: LineState,
    output: Output,
    /// Close once the output is flushed (quit, fatal protocol error).
    closing: bool,
    last_active: u32,
    want_write: bool,
    /// Queued in the worker's ready list (input left to process).
    queued: bool,
    /// Reading paused because too much output is unsent, or because the
    /// worker has too many forwarded requests in flight.
    read_blocked: bool,
    /// Got replies from other workers this round: write once at its end.
    dirty: bool,
    /// Opted in with `mbal hello`: gets redirects instead of forwarding.
    routed: bool,
    /// Waiting for the worker's emulated capacity (in `Worker::throttled`).
    throttled: bool,
}

pub(crate) struct Worker {
    id: usize,
    shared: Arc<Shared>,
    poll: Poll,
    /// This worker's own port, if it has one (`--worker-port-base`).
    own_listener: Option<TcpListener>,
    inbox: Receiver<Envelope>,
    mailbox: Arc<Mailbox>,
    store: WorkerStore,
    /// cachelet -> owner and route. This worker's own copy: it changes only
    /// by message, so reading it needs no synchronisation.
    tables: Tables,
    conns: Slab<Conn>,
    counters: Counters,
    /// Envelopes for each peer, sent at the end of the round.
    outbox: Vec<Outbox>,
    ready: VecDeque<usize>,
    /// Connections that got replies this round.
    dirty: Vec<usize>,
    /// Forwarded requests not answered yet, and the bound on them.
    inflight: usize,
    max_inflight: usize,
    /// Connections paused because `inflight` reached its bound.
    blocked: Vec<usize>,
    limits: Limits,
    next_gen: u64,
    now: u32,
    self_stats: Vec<(usize, u64, bool)>,
    /// For the controller's samples (`WorkerSample`): time spent working
    /// (outside the poll wait), batches taken in from peers and how long
    /// they waited in the inbox, the longest wait since the last sample.
    busy_ns: u64,
    inbox_batches: u64,
    inbox_wait_ns: u64,
    inbox_wait_max_ns: u64,
    /// Emulated capacity (`--worker-capacity`): the token bucket, the
    /// connections waiting for it (their input stays in their sockets) and
    /// the inbox's envelopes held back behind a peer's batch that waits for
    /// it (in arrival order: see `hold`).
    capacity: Capacity,
    throttled: Vec<usize>,
    held: VecDeque<Envelope>,
    /// Where the front of `held`, a batch cut short, resumes.
    held_pos: usize,
}

/// A listening socket; `mark` (`-o sock_cookie_id`, 0: none) is set as its
/// `SO_MARK`, as memcached does, for firewall rules.
pub(crate) fn bind_listener(addr: SocketAddr, backlog: i32, mark: u32) -> io::Result<std::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    if mark != 0 {
        s.set_mark(mark).map_err(|e| io::Error::new(e.kind(), format!("-o sock_cookie_id={mark} (SO_MARK): {e}")))?;
    }
    s.set_reuse_address(true)?;
    s.set_nonblocking(true)?;
    s.bind(&addr.into())?;
    s.listen(backlog)?;
    Ok(s.into())
}

impl Worker {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        id: usize,
        shared: Arc<Shared>,
        poll: Poll,
        mailbox: Arc<Mailbox>,
        own_listener: Option<std::net::TcpListener>,
        inbox: Receiver<Envelope>,
        store: WorkerStore,
        owners: &[Owner],
    ) -> io::Result<Worker> {
        let mut own_listener = own_listener.map(TcpListener::from_std);
        if let Some(l) = &mut own_listener {
            poll.registry().register(l, OWN_LISTENER, Interest::READABLE)?;
        }
        let tables = Tables::new(owners, id);
        let workers = shared.settings.threads;
        let limits = Limits { max_item_size: shared.settings.max_item_size, ..Limits::default() };
        Ok(Worker {
            id,
            poll,
            own_listener,
            inbox,
            mailbox,
            store,
            tables,
            conns: Slab::with_capacity(64),
            counters: Counters::default(),
            outbox: (0..workers).map(|_| Outbox::default()).collect(),
            ready: VecDeque::new(),
            dirty: Vec::new(),
            inflight: 0,
            max_inflight: shared.settings.max_inflight.max(1),
            blocked: Vec::new(),
            limits,
            next_gen: 1,
            now: 0,
            self_stats: Vec::new(),
            busy_ns: 0,
            inbox_batches: 0,
            inbox_wait_ns: 0,
            inbox_wait_max_ns: 0,
            capacity: Capacity::new(shared.settings.worker_capacity, shared.clock_ns()),
            throttled: Vec::new(),
            held: VecDeque::new(),
            held_pos: 0,
            shared,
        })
    }

    pub(crate) fn run(mut self) {
        let mut events = Events::with_capacity(1024);
        let mut last_sweep = Instant::now();
        loop {
            let mut timeout = if !self.ready.is_empty() || !self.mailbox.prepare_sleep(&self.inbox) {
                Duration::ZERO
            } else {
                Duration::from_millis(100)
            };
            if !self.throttled.is_empty() || !self.held.is_empty() {
                // Out of emulated capacity with work waiting: sleep until
                // the bucket has credit again, no longer (and never spin).
                timeout = timeout.min(self.capacity.wait());
            }
            let polled = self.poll.poll(&mut events, Some(timeout));
            self.mailbox.awake();
            if let Err(e) = polled {
                if e.kind() != io::ErrorKind::Interrupted {
                    tracing::error!(worker = self.id, "poll failed: {e}");
                    return;
                }
            }
            let round_start = self.shared.clock_ns();
            self.now = (round_start / 1_000_000_000) as u32;
            if self.capacity.limited() {
                self.refill(round_start);
            }
            for ev in events.iter() {
                match ev.token() {
                    OWN_LISTENER => self.accept(),
                    WAKER => {}
                    Token(t) => {
                        let ci = t - FIRST_CONN;
                        if !self.conns.contains(ci) {
                            continue;
                        }
                        if ev.is_writable() {
                            self.flush(ci);
                        }
                        if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                            self.on_readable(ci);
                        }
                    }
                }
            }
            self.run_ready();
            self.drain_inbox();
            self.flush_dirty();
            let round_end = self.shared.clock_ns();
            self.busy_ns += round_end.saturating_sub(round_start);
            self.shared.peers().send_all(self.id, &mut self.outbox, round_end);
            if self.shared.shutdown.load(Ordering::Relaxed) {
                return;
            }
            if last_sweep.elapsed() >= Duration::from_millis(50) {
                last_sweep = Instant::now();
                self.housekeeping();
            }
        }
    }

    /// Periodic work off the request path: expiry sweep, idle timeouts.
    fn housekeeping(&mut self) {
        self.store.sweep(self.now, 256);
        let idle = self.shared.settings.idle_timeout;
        if idle > 0 {
            let stale: Vec<usize> = self
                .conns
                .iter()
                .filter(|(_, c)| self.now.saturating_sub(c.last_active) > idle)
                .map(|(i, _)| i)
                .collect();
            for ci in stale {
                self.counters.idle_kicks += 1;
                self.close(ci);
            }
        }
    }

    /// Connections on this worker's own port.
    fn accept(&mut self) {
        loop {
            let Some(listener) = &self.own_listener else { return };
            let (sock, peer) = match listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    tracing::warn!(worker = self.id, "accept: {e}");
                    return;
                }
            };
            let max = self.shared.settings.max_conns;
            if self.shared.curr_conns.fetch_add(1, Ordering::Relaxed) >= max {
                self.shared.curr_conns.fetch_sub(1, Ordering::Relaxed);
                self.counters.rejected_connections += 1;
                let mut sock = sock;
                // memcached's answer to one connection too many.
                let _ = sock.write(b"ERROR Too many open connections\r\n");
                continue;
            }
            self.shared.worker_conns[self.id].fetch_add(1, Ordering::Relaxed);
            let listen_addr = listener.local_addr().unwrap_or(peer);
            self.register(sock, peer, listen_addr);
        }
    }

    /// Serve a connection here. It is already counted in `curr_conns` and
    /// in this worker's `worker_conns`.
    fn register(&mut self, mut sock: TcpStream, peer: SocketAddr, listen_addr: SocketAddr) -> Option<usize> {
        let _ = sock.set_nodelay(true);
        let entry = self.conns.vacant_entry();
        let ci = entry.key();
        if let Err(e) = self.poll.registry().register(&mut sock, Token(ci + FIRST_CONN), Interest::READABLE) {
            tracing::warn!("register: {e}");
            self.shared.conn_closed(self.id);
            return None;
        }
        self.counters.total_connections += 1;
        let gen = self.next_gen;
        self.next_gen += 1;
        let proto = match self.shared.settings.binding {
            Binding::Auto => None,
            Binding::Ascii => Some(Protocol::Text),
            Binding::Binary => Some(Protocol::Binary),
        };
        entry.insert(Conn {
            sock,
            id: self.shared.next_conn_id.fetch_add(1, Ordering::Relaxed),
            gen,
            peer,
            listen_addr,
            proto,
            rbuf: Vec::new(),
            skip: 0,
            line: LineState::Start,
            output: Output::default(),
            closing: false,
            last_active: self.now,
            want_write: false,
            queued: false,
            read_blocked: false,
            dirty: false,
            routed: false,
            throttled: false,
        });
        tracing::debug!(worker = self.id, %peer, "accepted");
        // Bytes may have arrived before the registration.
        self.requeue(ci);
        Some(ci)
    }

    /// Give connection `ci` to worker `to`, with its input from `pos` on
    /// (`mbal hello <epoch> <to>`; its output is empty, `dispatch` checked).
    fn hand_off(&mut self, ci: usize, pos: usize, to: usize) {
        let Some(mut c) = self.conns.try_remove(ci) else { return };
        let _ = self.poll.registry().deregister(&mut c.sock);
        self.shared.worker_conns[self.id].fetch_sub(1, Ordering::Relaxed);
        self.shared.worker_conns[to].fetch_add(1, Ordering::Relaxed);
        let unread = c.rbuf.split_off(pos.min(c.rbuf.len()));
        let h = HandOff {
            sock: std::net::TcpStream::from(c.sock),
            peer: c.peer,
            listen_addr: c.listen_addr,
            id: c.id,
            unread,
        };
        self.outbox[to].push(Envelope::HandOff(Box::new(h)));
    }

    fn close(&mut self, ci: usize) {
        if let Some(mut c) = self.conns.try_remove(ci) {
            let _ = self.poll.registry().deregister(&mut c.sock);
            self.shared.conn_closed(self.id);
        }
    }

    /// Read everything available, then process.
    fn on_readable(&mut self, ci: usize) {
        let conn = &mut self.conns[ci];
        if conn.output.unsent() > MAX_PENDING_OUTPUT {
            // Back-pressure: do not read more until the client drains
            // replies; `flush` queues the connection again when it has.
            conn.read_blocked = true;
            return;
        }
        conn.read_blocked = false;
        if !self.capacity.has_credit() {
            // Out of emulated capacity: the input waits in the socket.
            self.throttle(ci);
            return;
        }
        let mut eof = false;
        // Whether the socket may still hold data we chose not to read yet.
        let mut more = false;
        loop {
            let len = conn.rbuf.len();
            // Zero-filled, so the read target is always initialised memory
            // (the fill is a memset of what the last read did not use).
            conn.rbuf.resize(len + READ_CHUNK, 0);
            match conn.sock.read(&mut conn.rbuf[len..]) {
                Ok(0) => {
                    conn.rbuf.truncate(len);
                    eof = true;
                    break;
                }
                Ok(n) => {
                    conn.rbuf.truncate(len + n);
                    self.counters.bytes_read += n as u64;
                    if n < READ_CHUNK {
                        break;
                    }
                    // Do not buffer more than one big request's worth ahead.
                    if conn.rbuf.len() > self.limits.max_item_size + self.limits.max_line + READ_CHUNK {
                        more = true;
                        break;
                    }
                }
                Err(e) => {
                    conn.rbuf.truncate(len);
                    match e.kind() {
                        io::ErrorKind::WouldBlock => break,
                        io::ErrorKind::Interrupted => continue,
                        _ => {
                            eof = true;
                            break;
                        }
                    }
                }
            }
        }
        conn.last_active = self.now;
        self.process(ci);
        if eof {
            // Flush what we have, then close.
            self.flush(ci);
            self.close(ci);
            return;
        }
        if more {
            self.requeue(ci);
        }
    }

    /// Come back to a connection in this loop turn's ready queue (input
    /// left in the socket or in the buffer after a -R yield).
    fn requeue(&mut self, ci: usize) {
        if let Some(c) = self.conns.get_mut(ci) {
            if !c.queued && !c.closing {
                c.queued = true;
                self.ready.push_back(ci);
            }
        }
    }

    fn run_ready(&mut self) {
        let n = self.ready.len();
        for _ in 0..n {
            let Some(ci) = self.ready.pop_front() else { break };
            if let Some(c) = self.conns.get_mut(ci) {
                c.queued = false;
                self.on_readable(ci);
            }
        }
    }

    /// Look ahead over the requests `process` is about to execute and start loading the index
    /// lines of the keys this worker will look up, so the batch's cache misses overlap. Text
    /// gets and stores (`prefetch_keys`); a prefetch is a hint, so a key that turns out to be
    /// elsewhere costs nothing but the hash.
    fn prefetch_batch(&self, ci: usize) {
        let conn = &self.conns[ci];
        let Some(proto @ Protocol::Text) = conn.proto else { return };
        let (mut pos, buf, mut line) = (0usize, &conn.rbuf[..], conn.line);
        for _ in 0..self.shared.settings.reqs_per_event {
            let Parsed::Req { req, consumed } = mbal_proto::parse_stream(&mut line, proto, &buf[pos..], &self.limits)
            else {
                break;
            };
            prefetch_keys(&self.store, &self.shared.layout, &req);
            pos += consumed;
        }
    }

    /// Parse and execute up to `reqs_per_event` requests from the buffer.
    fn process(&mut self, ci: usize) {
        if self.conns[ci].skip == 0 {
            self.prefetch_batch(ci);
        }
        let reqs_per_event = self.shared.settings.reqs_per_event;
        let mut done = 0usize;
        let mut pos = 0usize;
        let worker = self.id;
        let mut hand_off = None;
        loop {
            let conn = &mut self.conns[ci];
            if conn.closing {
                break;
            }
            if conn.skip > 0 {
                let n = conn.skip.min(conn.rbuf.len() - pos);
                conn.skip -= n;
                pos += n;
                if conn.skip > 0 {
                    break;
                }
            }
            if pos >= conn.rbuf.len() {
                break;
            }
            if self.inflight >= self.max_inflight {
                // Bounded queues: wait for replies before taking more.
                self.counters.inflight_stalls += 1;
                conn.read_blocked = true;
                self.blocked.push(ci);
                break;
            }
            if !matches!(conn.line, LineState::Start) && conn.output.unsent() > MAX_PENDING_OUTPUT {
                // Inside a long get line: answer its next piece once the
                // client has read this much (`flush` comes back here).
                conn.read_blocked = true;
                break;
            }
            if !self.capacity.has_credit() {
                // Out of emulated capacity: the rest waits for a refill.
                if !conn.throttled {
                    conn.throttled = true;
                    self.throttled.push(ci);
                    self.counters.capacity_stalls += 1;
                }
                break;
            }
            if done >= reqs_per_event {
                // Fairness (-R): yield to other connections, come back later.
                self.counters.conn_yields += 1;
                self.requeue(ci);
                break;
            }
            let proto = *conn.proto.get_or_insert_with(|| mbal_proto::detect(conn.rbuf[pos]));
            let Conn { rbuf, output, gen, routed, line, .. } = conn;
            let buf = &rbuf[pos..];
            let mut rt = Route {
                worker,
                conn: ci,
                gen: *gen,
                tables: &mut self.tables,
                server: self.shared.server_id,
                routed: *routed,
                outbox: &mut self.outbox,
                counters: &mut self.counters,
                inflight: &mut self.inflight,
                self_stats: &mut self.self_stats,
            };
            let fresh = matches!(line, LineState::Start);
            match mbal_proto::parse_stream(line, proto, buf, &self.limits) {
                Parsed::NeedMore => break,
                Parsed::Err { reply, skip, close } => {
                    if reply.is_too_large() {
                        rt.counters.store_too_large += 1;
                    }
                    // memcached drops the old value of a key whose new value
                    // was refused as too large; so do we (`buf` starts a
                    // request only if no long line was in progress).
                    if let Some(key) = fresh.then(|| mbal_proto::key_to_unlink_on_too_large(buf)).flatten() {
                        dispatch::unlink(&self.shared.layout, &mut rt, &mut self.store, self.now, output, key);
                    }
                    reply.write(output.buf());
                    let avail = buf.len();
                    if skip <= avail {
                        pos += skip;
                    } else {
                        pos += avail;
                        conn.skip = skip - avail;
                    }
                    if close {
                        conn.closing = true;
                    }
                }
                Parsed::Req { req, consumed } => {
                    let raw = &buf[..consumed];
                    let forwarded_before = *rt.inflight;
                    let action = dispatch::handle(&self.shared, &mut rt, &mut self.store, self.now, output, &req, raw);
                    // Executed here unless it went to another worker (which pays for it).
                    self.capacity.spend((*rt.inflight == forwarded_before) as u64);
                    pos += consumed;
                    done += 1;
                    match action {
                        Action::None => {}
                        Action::Pause { at, rest } => {
                            // A get stopped after `at` bytes: the rest of its
                            // line is parsed again once the output drained.
                            pos -= consumed - at;
                            *line = rest;
                        }
                        Action::Routed => conn.routed = true,
                        Action::HandOff(to) => {
                            hand_off = Some(to);
                            break;
                        }
                        Action::Close => conn.closing = true,
                        Action::Shutdown => {
                            conn.closing = true;
                            self.shared.shutdown.store(true, Ordering::Relaxed);
                            self.shared.wake_all();
                        }
                    }
                }
            }
        }
        self.finish_self_stats();
        if let Some(to) = hand_off {
            self.hand_off(ci, pos, to);
            return;
        }
        let Some(conn) = self.conns.get_mut(ci) else { return };
        conn.rbuf.drain(..pos.min(conn.rbuf.len()));
        if conn.rbuf.capacity() > 4 * READ_CHUNK && conn.rbuf.len() < READ_CHUNK {
            conn.rbuf.shrink_to(READ_CHUNK);
        }
        if !conn.output.waiting() || conn.output.unsent() > EARLY_FLUSH || conn.closing {
            self.flush(ci);
        }
    }

    /// Write as much output as the socket takes.
    fn flush(&mut self, ci: usize) {
        let Some(conn) = self.conns.get_mut(ci) else { return };
        conn.output.drain();
        while conn.output.sent < conn.output.out.len() {
            match conn.sock.write(&conn.output.out[conn.output.sent..]) {
                Ok(0) => break,
                Ok(n) => {
                    conn.output.sent += n;
                    self.counters.bytes_written += n as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => {
                    self.close(ci);
                    return;
                }
            }
        }
        if conn.output.sent == conn.output.out.len() {
            conn.output.out.clear();
            conn.output.sent = 0;
            if conn.output.out.capacity() > 1 << 20 {
                conn.output.out.shrink_to(64 << 10);
            }
        }
        let need_write = conn.output.sent < conn.output.out.len();
        if need_write != conn.want_write {
            conn.want_write = need_write;
            let interest = if need_write { Interest::READABLE | Interest::WRITABLE } else { Interest::READABLE };
            let _ = self.poll.registry().reregister(&mut conn.sock, Token(ci + FIRST_CONN), interest);
        }
        if !need_write && !conn.output.waiting() && conn.closing {
            self.close(ci);
            return;
        }
        // Output drained: resume a read that back-pressure paused.
        if !need_write && conn.read_blocked && self.inflight < self.max_inflight {
            self.requeue(ci);
        }
    }

    /// Write each connection that got replies this round, once.
    fn flush_dirty(&mut self) {
        for ci in std::mem::take(&mut self.dirty) {
            if let Some(c) = self.conns.get_mut(ci) {
                c.dirty = false;
                self.flush(ci);
            }
        }
    }

    /// Handle what peers sent: as many envelopes as were queued when the
    /// round got here (a peer that keeps sending cannot starve our own
    /// connections), then resume connections paused on `max_inflight` if
    /// the answers brought the count under it.
    fn drain_inbox(&mut self) {
        let n = self.inbox.len();
        let now_ns = if n > 0 { self.shared.clock_ns() } else { 0 };
        for _ in 0..n {
            let Ok(env) = self.inbox.try_recv() else { break };
            if self.capacity.limited() && self.hold(&env) {
                self.held.push_back(env);
                continue;
            }
            self.take(env, now_ns);
        }
        if self.inflight < self.max_inflight && !self.blocked.is_empty() {
            for ci in std::mem::take(&mut self.blocked) {
                self.requeue(ci);
            }
        }
    }

    /// Handle one envelope from a peer or the controller (taken in at `now_ns`).
    fn take(&mut self, env: Envelope, now_ns: u64) {
        match env {
            Envelope::Reqs(batch) => self.exec_batch(batch, 0, now_ns),
            Envelope::Replies(batch) => {
                self.waited(now_ns, batch.sent_ns);
                for (item, bytes) in batch.iter() {
                    let c = item.cachelet;
                    let resend = match item.bounce {
                        None => {
                            self.deliver(item.to, bytes);
                            (c != NO_CACHELET).then(|| self.tables.answered(c)).flatten()
                        }
                        Some(b) => {
                            let p = Parked { to: item.to, kind: b.kind, bytes: bytes.to_vec() };
                            self.tables.bounced(c, b.hint, p)
                        }
                    };
                    if let Some(q) = resend {
                        self.resend(c, q);
                    }
                }
            }
            Envelope::Conn(sock, peer) => {
                let listen = self.shared.main_addr;
                self.register(TcpStream::from_std(sock), peer, listen);
            }
            Envelope::HandOff(h) => {
                let HandOff { sock, peer, listen_addr, id, unread } = *h;
                if let Some(ci) = self.register(TcpStream::from_std(sock), peer, listen_addr) {
                    // Counted once, by the worker that accepted it.
                    self.counters.total_connections -= 1;
                    let c = &mut self.conns[ci];
                    c.id = id;
                    c.rbuf = unread;
                    c.routed = true;
                    c.proto = Some(Protocol::Text);
                    dispatch::hello(&self.shared, self.shared.server_id, self.id, c.output.buf());
                }
            }
            Envelope::Release { cachelet, to, token } => {
                let peers = self.shared.peers();
                let now_ns = self.shared.clock_ns();
                let (store, tables, outbox) = (&mut self.store, &mut self.tables, &mut self.outbox);
                if moves::release(self.id, store, tables, outbox, peers, now_ns, cachelet, to, token) {
                    // Already at `to`: the move is done as it stands.
                    self.shared.tell_controller(CtlMsg::Moved { token, cachelet, worker: to });
                }
            }
            Envelope::Adopt { cachelet, ver, token } => {
                let c = cachelet.id();
                self.store.insert_cachelet(cachelet);
                moves::announce(self.id, &mut self.outbox, c, ver);
                if let Some(q) = self.tables.adopted(c, ver) {
                    self.resend(c, q);
                }
                self.counters.cachelets_adopted += 1;
                self.shared.tell_controller(CtlMsg::Moved { token, cachelet: c, worker: self.id });
            }
            Envelope::Sample { seq } => {
                let sample = Box::new(self.sample());
                self.shared.tell_controller(CtlMsg::Sample { seq, sample });
            }
            Envelope::Owner { cachelet, worker, ver } => {
                if let Some(q) = self.tables.learn(cachelet, worker as u16, ver) {
                    self.resend(cachelet, q);
                }
            }
            Envelope::Flush { at } => self.store.flush_all(at),
            Envelope::StatsReq { to, want_conns } => {
                let snap = Box::new(self.snapshot(want_conns));
                self.outbox[to.worker].push(Envelope::StatsResp { to, snap });
            }
            Envelope::StatsResp { to, snap } => {
                if self.conns.get(to.conn).is_some_and(|c| c.gen == to.gen) {
                    self.gathered(to.conn, to.seq, *snap);
                }
            }
            Envelope::ResetStats => {
                self.counters = Counters::default();
                self.store.reset_stats();
            }
            Envelope::Stall { ms } => std::thread::sleep(Duration::from_millis(ms)),
        }
    }

    /// Execute a peer's batch from its request `from` on. With a capacity
    /// cap, only as many as the credit pays for: the rest of the batch
    /// waits at the front of `held` (`held_pos` says where it resumes).
    fn exec_batch(&mut self, batch: ReqBatch, from: usize, now_ns: u64) {
        if from == 0 {
            self.waited(now_ns, batch.sent_ns);
        }
        let mut n = batch.len() - from;
        if self.capacity.limited() {
            n = n.min(self.capacity.available());
        }
        // Overlap the index misses of the batch's gets and text stores.
        for (req, bytes) in batch.iter().skip(from).take(n) {
            match req.kind {
                FwdKind::Values { .. } => {
                    for key in bytes.split(|&b| b == b' ').filter(|k| !k.is_empty()) {
                        self.store.prefetch(req.cachelet, mbal_cluster::key_hash(key));
                    }
                }
                FwdKind::Raw(proto) => {
                    if let Parsed::Req { req, .. } = mbal_proto::parse(proto, bytes, &self.limits) {
                        prefetch_keys(&self.store, &self.shared.layout, &req);
                    }
                }
            }
        }
        for (req, bytes) in batch.iter().skip(from).take(n) {
            self.exec_forwarded(req, bytes);
        }
        self.capacity.spend(n as u64);
        if from + n < batch.len() {
            self.held.push_front(Envelope::Reqs(batch));
            self.held_pos = from + n;
            self.counters.capacity_stalls += 1;
        }
    }

    /// With a capacity cap: must `env` wait in `held` instead of being
    /// handled now? A peer's batch waits while the worker is out of credit;
    /// and once anything waits, whatever could be ordered after it does
    /// too (requests, flushes, stats resets, the move protocol), so that a
    /// connection's requests and control messages keep their order
    /// (`msg`). Replies, new connections and the controller's and stats
    /// gathers' questions do not wait: they are no one's requests and are
    /// ordered after nothing here.
    fn hold(&mut self, env: &Envelope) -> bool {
        let hold = match env {
            Envelope::Reqs(_) => !self.held.is_empty() || !self.capacity.has_credit(),
            Envelope::Replies(_)
            | Envelope::Conn(..)
            | Envelope::HandOff(_)
            | Envelope::Sample { .. }
            | Envelope::StatsReq { .. }
            | Envelope::StatsResp { .. } => false,
            Envelope::Flush { .. }
            | Envelope::ResetStats
            | Envelope::Release { .. }
            | Envelope::Adopt { .. }
            | Envelope::Owner { .. }
            | Envelope::Stall { .. } => !self.held.is_empty(),
        };
        if hold && self.held.is_empty() {
            self.counters.capacity_stalls += 1;
        }
        hold
    }

    /// Start of a round with a capacity cap: add the credit earned since
    /// the last one, then spend it on the work that waited for it, oldest
    /// first: peers' batches held in arrival order, then the connections.
    fn refill(&mut self, now_ns: u64) {
        self.capacity.refill(now_ns);
        while let Some(env) = self.held.front() {
            if matches!(env, Envelope::Reqs(_)) && !self.capacity.has_credit() {
                return;
            }
            match self.held.pop_front().expect("just looked") {
                Envelope::Reqs(batch) => {
                    let from = std::mem::take(&mut self.held_pos);
                    self.exec_batch(batch, from, now_ns);
                }
                env => self.take(env, now_ns),
            }
        }
        if self.capacity.has_credit() {
            for ci in std::mem::take(&mut self.throttled) {
                if let Some(c) = self.conns.get_mut(ci) {
                    c.throttled = false;
                    self.requeue(ci);
                }
            }
        }
    }

    /// Connection `ci` waits for capacity (its input stays where it is).
    fn throttle(&mut self, ci: usize) {
        let c = &mut self.conns[ci];
        if !c.throttled {
            c.throttled = true;
            self.throttled.push(ci);
            self.counters.capacity_stalls += 1;
        }
    }

    /// A request another worker forwarded: execute it here and queue the
    /// reply in the batch for its origin, or bounce it back to the origin if
    /// its cachelet is not here (it moved on since the sender looked).
    fn exec_forwarded(&mut self, req: &FwdReq, bytes: &[u8]) {
        debug_assert_ne!(req.to.worker, self.id, "a worker never forwards to itself");
        if !self.tables.executes(req.cachelet, req.stamp) {
            debug_assert!(!self.store.owns(req.cachelet) || self.tables.owner[req.cachelet as usize].ver > req.stamp);
            let hint = self.tables.owner[req.cachelet as usize];
            self.outbox[req.to.worker].replies().bounce(req, bytes, hint);
            return;
        }
        self.counters.forwarded_in += 1;
        let mut ctx = exec_ctx(&mut self.store, &self.shared, &mut self.counters, self.now);
        let limits = &self.limits;
        let run = |out: &mut Vec<u8>| execute(&mut ctx, limits, req.kind, bytes, out);
        self.outbox[req.to.worker].replies().push(req.to, req.cachelet, run);
    }

    /// Send requests parked for cachelet `c` again, in order, on its new
    /// route (or execute them here if this worker owns it now).
    fn resend(&mut self, c: u32, parked: VecDeque<Parked>) {
        let (_, w) = self.tables.route(c);
        for p in parked {
            if w as usize == self.id {
                self.capacity.spend(1);
                let mut out = Vec::new();
                let mut ctx = exec_ctx(&mut self.store, &self.shared, &mut self.counters, self.now);
                execute(&mut ctx, &self.limits, p.kind, &p.bytes, &mut out);
                self.deliver(p.to, &out);
            } else {
                self.tables.sent(c);
                let stamp = self.tables.stamp(c);
                self.outbox[w as usize].reqs().push(p.to, c, stamp, p.kind, |d| d.extend_from_slice(&p.bytes));
            }
        }
    }

    /// A batch sent at `sent_ns` was taken in at `now_ns`.
    fn waited(&mut self, now_ns: u64, sent_ns: u64) {
        let w = now_ns.saturating_sub(sent_ns);
        self.inbox_batches += 1;
        self.inbox_wait_ns += w;
        self.inbox_wait_max_ns = self.inbox_wait_max_ns.max(w);
    }

    /// This worker's counters for the controller's epoch tick.
    fn sample(&mut self) -> WorkerSample {
        let cachelets = self
            .store
            .cachelet_ids()
            .filter_map(|id| {
                let s = self.store.cachelet(id)?.stats();
                Some(CacheletSample {
                    id,
                    reads: s.reads,
                    writes: s.writes,
                    items: s.items,
                    bytes: s.bytes,
                    pages: s.pages,
                })
            })
            .collect();
        WorkerSample {
            worker: self.id as u16,
            at_ns: self.shared.clock_ns(),
            busy_ns: self.busy_ns,
            inbox_batches: self.inbox_batches,
            inbox_wait_ns: self.inbox_wait_ns,
            inbox_wait_max_ns: std::mem::take(&mut self.inbox_wait_max_ns),
            forwarded_out: self.counters.forwarded_out,
            forwarded_in: self.counters.forwarded_in,
            inbox_len: self.inbox.len() as u64,
            ready_conns: self.ready.len() as u64,
            connections: self.conns.len() as u64,
            cachelets,
        }
    }

    /// Fill a waiting output slot of one of our connections; it is written
    /// at the end of the round (`flush_dirty`). Every reply answers one
    /// `Slot::Wait` reserved here (and counted in `inflight`), whether or
    /// not its connection is still open.
    fn deliver(&mut self, to: ReplyTo, data: &[u8]) {
        debug_assert!(self.inflight > 0, "a reply nobody waits for");
        self.inflight = self.inflight.saturating_sub(1);
        let Some(c) = self.conns.get_mut(to.conn).filter(|c| c.gen == to.gen) else { return };
        c.output.fill(to.seq, data);
        if !c.dirty {
            c.dirty = true;
            self.dirty.push(to.conn);
        }
    }

    fn gathered(&mut self, ci: usize, seq: u64, snap: WorkerSnapshot) {
        let Some(c) = self.conns.get_mut(ci) else { return };
        let Some(Slot::Gather { remaining, snaps, .. }) = c.output.slot_mut(seq) else { return };
        snaps.push(snap);
        *remaining -= 1;
        if *remaining > 0 {
            return;
        }
        let Some(Slot::Gather { group, format, mut snaps, .. }) =
            c.output.slot_mut(seq).map(|s| std::mem::replace(s, Slot::Wait))
        else {
            return;
        };
        let mut data = Vec::new();
        let ports = self.shared.worker_ports.get().cloned().unwrap_or_default();
        render_stats(&self.shared, &ports, &group, &format, &mut snaps, &mut data);
        self.conns[ci].output.fill(seq, &data);
        self.flush(ci);
    }

    fn snapshot(&mut self, want_conns: bool) -> WorkerSnapshot {
        let conns = if want_conns {
            self.conns
                .iter()
                .map(|(_, c)| ConnInfo {
                    id: c.id,
                    addr: format!("tcp:{}", c.peer),
                    listen_addr: format!("tcp:{}", c.listen_addr),
                    state: if c.want_write { "conn_mwrite" } else { "conn_parse_cmd" },
                    idle_secs: self.now.saturating_sub(c.last_active),
                })
                .collect()
        } else {
            Vec::new()
        };
        let cachelets = self
            .store
            .cachelet_ids()
            .filter_map(|id| {
                let stats = self.store.cachelet(id).map(|c| c.stats())?;
                Some(CacheletInfo { id, owner: self.id, stats, reads_per_sec: 0, writes_per_sec: 0 })
            })
            .collect();
        WorkerSnapshot {
            worker: self.id,
            counters: self.counters.clone(),
            store: self.store.stats(),
            curr_connections: self.conns.len() as u64,
            conns,
            cachelets,
        }
    }

    /// Complete the local part of stats gathers started this round.
    fn finish_self_stats(&mut self) {
        let pending = std::mem::take(&mut self.self_stats);
        for (ci, seq, want_conns) in pending {
            let snap = self.snapshot(want_conns);
            self.gathered(ci, seq, snap);
        }
    }
}

/// What `exec` needs, from a worker's parts (borrowed apart so the caller can
/// still use its outbox).
fn exec_ctx<'a>(store: &'a mut WorkerStore, shared: &'a Shared, counters: &'a mut Counters, now: u32) -> Ctx<'a> {
    let detail = shared.detail();
    Ctx { store, layout: &shared.layout, settings: &shared.settings, counters, now, detail }
}

/// Prefetch the index lines of a text get's or store's keys that live in this worker's store.
fn prefetch_keys(store: &WorkerStore, layout: &KeySpace, req: &Request) {
    match req {
        Request::Text(TextCmd::Get { keys, .. }) => {
            for key in keys.iter() {
                let at = locate(layout, key);
                store.prefetch(at.cachelet, at.hash);
            }
        }
        Request::Text(TextCmd::Store { key, .. }) => {
            let at = locate(layout, key);
            store.prefetch(at.cachelet, at.hash);
        }
        _ => {}
    }
}

/// Execute one forwarded request on its owner, appending the reply to `out`.
/// The cachelet was checked by the caller.
fn execute(ctx: &mut Ctx, limits: &Limits, kind: FwdKind, bytes: &[u8], out: &mut Vec<u8>) {
    match kind {
        FwdKind::Values { cas, touch } => {
            for key in bytes.split(|&b| b == b' ').filter(|k| !k.is_empty()) {
                let at = locate(ctx.layout, key);
                exec::text_get_one(ctx, key, at, cas, touch, out);
            }
        }
        FwdKind::Raw(proto) => match mbal_proto::parse(proto, bytes, limits) {
            Parsed::Req { req: Request::Text(cmd), .. } => {
                let key = text_key(&cmd).expect("only keyed text commands are forwarded");
                let at = locate(ctx.layout, key);
                exec::text_keyed(ctx, &cmd, at, out);
            }
            Parsed::Req { req: Request::Meta(cmd), .. } => {
                let mut scratch = [0u8; 256];
                match meta_key(&cmd, &mut scratch) {
                    Ok(key) => {
                        let at = locate(ctx.layout, key);
                        exec::meta_keyed(ctx, &cmd, key, at, out);
                    }
                    Err(e) => e.write(out),
                }
            }
            Parsed::Req { req: Request::Bin(req), .. } => {
                let at = locate(ctx.layout, req.key);
                exec::bin_keyed(ctx, &req, at, out);
            }
            Parsed::Err { reply, .. } => reply.write(out),
            Parsed::NeedMore => out.extend_from_slice(b"SERVER_ERROR internal forwarding error\r\n"),
        },
    }
}

/// Render a completed stats gather into reply bytes.
fn render_stats(
    shared: &Shared,
    ports: &[u16],
    group: &str,
    format: &StatsFormat,
    snaps: &mut [WorkerSnapshot],
    out: &mut Vec<u8>,
) {
    let now_unix = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    if group == "cachelets" {
        // Rates over the controller's last epoch (0 before the first).
        let latest = shared.latest.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(epoch) = latest {
            let rates: std::collections::HashMap<u32, (f64, f64)> = epoch
                .workers
                .iter()
                .flat_map(|w| w.cachelets.iter().map(|c| (c.id, (c.reads_per_sec, c.writes_per_sec))))
                .collect();
            for c in snaps.iter_mut().flat_map(|w| w.cachelets.iter_mut()) {
                let (r, w) = rates.get(&c.id).copied().unwrap_or_default();
                (c.reads_per_sec, c.writes_per_sec) = (r.round() as u64, w.round() as u64);
            }
        }
    }
    let p = ProcessInfo {
        settings: &shared.settings,
        uptime: shared.now(),
        now_unix,
        main_port: shared.main_addr.port(),
        rejected_conns: shared.rejected_conns.load(Ordering::Relaxed),
        worker_ports: ports,
        detail_enabled: shared.detail().is_some(),
    };
    match format {
        StatsFormat::Text => {
            if stats::render(group, &p, snaps, &mut TextSink(out)) {
                out.extend_from_slice(b"END\r\n");
            } else {
                out.extend_from_slice(b"ERROR\r\n");
            }
        }
        StatsFormat::Binary { opaque } => {
            let ok = stats::render(group, &p, snaps, &mut BinSink { out, opaque: *opaque });
            if ok {
                write_response(out, op::STAT, st::NO_ERROR, *opaque, 0, &[], &[], &[]);
            } else {
                write_response(out, op::STAT, st::KEY_ENOENT, *opaque, 0, &[], &[], b"Not found");
            }
        }
    }
}

#[cfg(test)]
mod listener_tests {
    /// `-o sock_cookie_id=N` marks the listening sockets (SO_MARK needs CAP_NET_ADMIN; without
    /// it, the start fails with a line naming the option).
    #[test]
    fn sock_cookie_id_marks_listeners() {
        let addr: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
        match super::bind_listener(addr, 16, 42) {
            Ok(l) => assert_eq!(socket2::SockRef::from(&l).mark().unwrap(), 42),
            Err(e) => {
                assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
                assert!(e.to_string().contains("-o sock_cookie_id=42"), "{e}");
            }
        }
        let l = super::bind_listener(addr, 16, 0).unwrap();
        assert_eq!(socket2::SockRef::from(&l).mark().unwrap(), 0, "no mark unless asked");
    }
}
