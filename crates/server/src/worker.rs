//! A worker: one thread, one mio event loop, its own listening port, its
//! cachelets (in a `WorkerStore`) and its connections.
//!
//! The data path of an owned cachelet is: read -> `mbal_proto::parse` ->
//! route (hash -> VN -> cachelet -> owner, all local tables) -> `exec` ->
//! append the reply to the connection's output -> one write per read batch.
//! No lock, no shared atomic.
//!
//! A request on a connection for a cachelet another worker owns is sent to
//! that worker as a message (`Envelope::Fwd`, batched per destination and per
//! event-loop round, one channel send and one wake-up per destination). The
//! connection reserves a slot in its output queue so the reply is written in
//! pipeline order when it comes back (`Envelope::Reply`). Keyless commands
//! that concern every worker (flush_all, stats) are broadcast or gathered the
//! same way. Messages from one worker to another travel through one FIFO
//! channel, so a connection's requests reach each peer in the order sent.

use crate::config::{Binding, Settings};
use crate::exec::{self, locate, Ctx, Loc};
use crate::stats::{self, BinSink, CacheletInfo, ConnInfo, Counters, ProcessInfo, TextSink, WorkerSnapshot};
use crossbeam_channel::{Receiver, Sender};
use mbal_cluster::{ClusterMap, Layout};
use mbal_proto::binary::{opcode as op, status as st, write_response, BinReq};
use mbal_proto::meta::{meta_key, MetaKind};
use mbal_proto::text::{self, TextCmd};
use mbal_proto::{Limits, Parsed, Protocol, Request};
use mbal_store::Cachelet;
use mbal_store::WorkerStore;
use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token, Waker};
use slab::Slab;
use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const MAIN_LISTENER: Token = Token(0);
const OWN_LISTENER: Token = Token(1);
const WAKER: Token = Token(2);
const FIRST_CONN: usize = 3;

/// Read in chunks of this size; a connection's buffer grows only as far as
/// one request needs (bounded by the parser's limits).
const READ_CHUNK: usize = 16 * 1024;
/// Stop reading from a connection whose unsent output exceeds this, until
/// the client drains it (a client that pipelines but never reads cannot
/// make the server buffer without bound).
const MAX_PENDING_OUTPUT: usize = 4 << 20;

/// State shared by all workers of a process. Nothing here is touched on the
/// GET/SET path: the connection counter and the flags are used on accept,
/// close and shutdown only.
pub(crate) struct Shared {
    pub settings: Settings,
    /// VN -> cachelet (fixed for the cluster's life) and the initial owners.
    pub layout: Layout,
    /// This server's id in the cluster map.
    pub server_id: u16,
    /// The map epoch this server knows (read on redirects only).
    pub epoch: AtomicU64,
    /// The full map, for `mbal map` and ownership changes. Locked only by
    /// admin commands and cachelet moves, never on the data path.
    pub map: Mutex<ClusterMap>,
    pub start: Instant,
    pub start_unix: u64,
    pub curr_conns: AtomicUsize,
    pub shutdown: AtomicBool,
    pub senders: OnceLock<Vec<Sender<Envelope>>>,
    pub wakers: OnceLock<Vec<Arc<Waker>>>,
    pub main_port: u16,
    pub worker_ports: OnceLock<Vec<u16>>,
    pub next_conn_id: std::sync::atomic::AtomicU64,
}

impl Shared {
    pub fn now(&self) -> u32 {
        self.start.elapsed().as_secs() as u32
    }

    pub fn wake_all(&self) {
        if let Some(w) = self.wakers.get() {
            for w in w {
                let _ = w.wake();
            }
        }
    }
}

/// What a forwarded request asks the owner to do.
pub(crate) enum FwdOp {
    /// Re-parse and execute these bytes (one complete request).
    Raw(Protocol, Vec<u8>),
    /// A run of keys of a text multi-get, all of one cachelet: answer VALUE
    /// blocks only (the origin writes END after the last run).
    TextValues { cachelet: u32, keys: Vec<u8>, cas: bool, touch: Option<i64> },
}

/// Messages between workers.
pub(crate) enum Envelope {
    Fwd {
        from: usize,
        conn: usize,
        gen: u64,
        seq: u64,
        op: FwdOp,
    },
    Reply {
        conn: usize,
        gen: u64,
        seq: u64,
        data: Vec<u8>,
    },
    Flush {
        at: u32,
    },
    StatsReq {
        from: usize,
        conn: usize,
        gen: u64,
        seq: u64,
        want_conns: bool,
    },
    StatsResp {
        conn: usize,
        gen: u64,
        seq: u64,
        snap: Box<WorkerSnapshot>,
    },
    ResetStats,
    /// Give cachelet `cachelet` to worker `to` (sent to its current owner).
    Release {
        cachelet: u32,
        to: usize,
        reply: ReplyTo,
    },
    /// Take ownership of a cachelet (its items come along, nothing is copied).
    Adopt {
        cachelet: Box<Cachelet>,
        ver: u32,
        reply: ReplyTo,
    },
    /// Cachelet `cachelet` is now owned by worker `worker` (move number `ver`).
    Owner {
        cachelet: u32,
        worker: usize,
        ver: u32,
    },
}

/// Who owns a cachelet, as one worker knows it. `ver` counts the moves of
/// the cachelet inside this server, so a late notice of an older move
/// never overwrites a newer one.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Own {
    pub server: u16,
    pub worker: u16,
    pub ver: u32,
}

/// Where the answer to an admin request goes: (worker, conn, gen, seq).
#[derive(Clone, Copy)]
pub(crate) struct ReplyTo {
    pub worker: usize,
    pub conn: usize,
    pub gen: u64,
    pub seq: u64,
}

/// How a gathered stats reply is rendered once every worker has answered.
#[derive(Clone)]
enum StatsFormat {
    Text,
    Binary { opaque: u32 },
}

enum Slot {
    Ready(Vec<u8>),
    Wait,
    Gather { group: String, format: StatsFormat, remaining: usize, snaps: Vec<WorkerSnapshot> },
}

/// A connection's ordered output: bytes ready to send, then slots waiting for
/// replies from other workers. Anything produced while a slot waits queues
/// behind it, so replies leave in request order.
#[derive(Default)]
struct Output {
    out: Vec<u8>,
    sent: usize,
    pending: VecDeque<Slot>,
    /// Sequence number of `pending[0]`.
    base_seq: u64,
}

impl Output {
    /// Where the next in-order reply bytes go.
    fn buf(&mut self) -> &mut Vec<u8> {
        if self.pending.is_empty() {
            return &mut self.out;
        }
        if !matches!(self.pending.back(), Some(Slot::Ready(_))) {
            self.pending.push_back(Slot::Ready(Vec::new()));
        }
        match self.pending.back_mut() {
            Some(Slot::Ready(v)) => v,
            _ => unreachable!(),
        }
    }

    fn push(&mut self, slot: Slot) -> u64 {
        self.pending.push_back(slot);
        self.base_seq + self.pending.len() as u64 - 1
    }

    fn slot_mut(&mut self, seq: u64) -> Option<&mut Slot> {
        let i = seq.checked_sub(self.base_seq)?;
        self.pending.get_mut(i as usize)
    }

    /// Move every leading ready slot into `out`.
    fn drain(&mut self) {
        while let Some(Slot::Ready(_)) = self.pending.front() {
            if let Some(Slot::Ready(v)) = self.pending.pop_front() {
                self.out.extend_from_slice(&v);
            }
            self.base_seq += 1;
        }
    }

    fn unsent(&self) -> usize {
        self.out.len() - self.sent
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
    output: Output,
    /// Close once the output is flushed (quit, fatal protocol error).
    closing: bool,
    last_active: u32,
    want_write: bool,
    /// Queued in the worker's ready list (input left to process).
    queued: bool,
    /// Reading paused because too much output is unsent.
    read_blocked: bool,
    /// Opted in with `mbal hello`: gets redirects instead of forwarding.
    routed: bool,
}

pub(crate) struct Worker {
    id: usize,
    shared: Arc<Shared>,
    poll: Poll,
    main_listener: TcpListener,
    own_listener: TcpListener,
    inbox: Receiver<Envelope>,
    store: WorkerStore,
    /// cachelet -> owner. This worker's own copy: it changes only by
    /// message, so reading it needs no synchronisation.
    owner: Vec<Own>,
    conns: Slab<Conn>,
    counters: Counters,
    outbox: Vec<Vec<Envelope>>,
    ready: VecDeque<usize>,
    limits: Limits,
    next_gen: u64,
    now: u32,
    /// Per-cachelet (reads, writes) at the start of the current second.
    rate_base: Vec<(u32, u64, u64)>,
    rates: Vec<(u32, u64, u64)>,
    last_rate_tick: u32,
    self_stats: Vec<(usize, u64, bool)>,
}

pub(crate) fn bind_listener(addr: SocketAddr, reuse_port: bool, backlog: i32) -> io::Result<std::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    s.set_reuse_address(true)?;
    if reuse_port {
        s.set_reuse_port(true)?;
    }
    s.set_nonblocking(true)?;
    s.bind(&addr.into())?;
    s.listen(backlog)?;
    Ok(s.into())
}

impl Worker {
    pub(crate) fn new(
        id: usize,
        shared: Arc<Shared>,
        main_listener: std::net::TcpListener,
        own_listener: std::net::TcpListener,
        inbox: Receiver<Envelope>,
        store: WorkerStore,
    ) -> io::Result<(Worker, Arc<Waker>)> {
        let poll = Poll::new()?;
        let mut main_listener = TcpListener::from_std(main_listener);
        let mut own_listener = TcpListener::from_std(own_listener);
        poll.registry().register(&mut main_listener, MAIN_LISTENER, Interest::READABLE)?;
        poll.registry().register(&mut own_listener, OWN_LISTENER, Interest::READABLE)?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        let owner = (0..shared.layout.cachelet_count())
            .map(|c| {
                let (server, worker) = shared.layout.owner(c);
                Own { server, worker, ver: 0 }
            })
            .collect();
        let workers = shared.settings.threads;
        let limits = Limits { max_item_size: shared.settings.max_item_size, ..Limits::default() };
        Ok((
            Worker {
                id,
                poll,
                main_listener,
                own_listener,
                inbox,
                store,
                owner,
                conns: Slab::with_capacity(64),
                counters: Counters::default(),
                outbox: (0..workers).map(|_| Vec::new()).collect(),
                ready: VecDeque::new(),
                limits,
                next_gen: 1,
                now: 0,
                rate_base: Vec::new(),
                rates: Vec::new(),
                last_rate_tick: 0,
                self_stats: Vec::new(),
                shared,
            },
            waker,
        ))
    }

    pub(crate) fn run(mut self) {
        let mut events = Events::with_capacity(1024);
        let mut last_sweep = Instant::now();
        loop {
            let timeout = if self.ready.is_empty() { Some(Duration::from_millis(100)) } else { Some(Duration::ZERO) };
            if let Err(e) = self.poll.poll(&mut events, timeout) {
                if e.kind() != io::ErrorKind::Interrupted {
                    tracing::error!(worker = self.id, "poll failed: {e}");
                    return;
                }
            }
            self.now = self.shared.now();
            for ev in events.iter() {
                match ev.token() {
                    MAIN_LISTENER | OWN_LISTENER => self.accept(ev.token()),
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
            self.drain_inbox();
            self.run_ready();
            self.send_outbox();
            if self.shared.shutdown.load(Ordering::Relaxed) {
                return;
            }
            if last_sweep.elapsed() >= Duration::from_millis(50) {
                last_sweep = Instant::now();
                self.housekeeping();
            }
        }
    }

    /// Periodic work off the request path: expiry sweep, per-cachelet rates,
    /// idle timeouts.
    fn housekeeping(&mut self) {
        self.store.sweep(self.now, 256);
        if self.now != self.last_rate_tick {
            let cur: Vec<(u32, u64, u64)> = self
                .store
                .cachelet_ids()
                .collect::<Vec<_>>()
                .into_iter()
                .filter_map(|id| self.store.cachelet(id).map(|c| c.stats()).map(|s| (id, s.reads, s.writes)))
                .collect();
            let elapsed = (self.now - self.last_rate_tick).max(1) as u64;
            self.rates = cur
                .iter()
                .map(|&(id, r, w)| {
                    let (br, bw) = self.rate_base.iter().find(|b| b.0 == id).map(|b| (b.1, b.2)).unwrap_or((r, w));
                    (id, r.saturating_sub(br) / elapsed, w.saturating_sub(bw) / elapsed)
                })
                .collect();
            self.rate_base = cur;
            self.last_rate_tick = self.now;
        }
        let idle = self.shared.settings.idle_timeout;
        if idle > 0 {
            let stale: Vec<usize> = self
                .conns
                .iter()
                .filter(|(_, c)| self.now.saturating_sub(c.last_active) > idle)
                .map(|(i, _)| i)
                .collect();
            for ci in stale {
                self.close(ci);
            }
        }
    }

    fn accept(&mut self, which: Token) {
        loop {
            let listener = if which == MAIN_LISTENER { &self.main_listener } else { &self.own_listener };
            let (mut sock, peer) = match listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    tracing::warn!(worker = self.id, "accept: {e}");
                    return;
                }
            };
            let listen_addr = listener.local_addr().unwrap_or(peer);
            let max = self.shared.settings.max_conns;
            if self.shared.curr_conns.fetch_add(1, Ordering::Relaxed) >= max {
                self.shared.curr_conns.fetch_sub(1, Ordering::Relaxed);
                self.counters.rejected_connections += 1;
                // memcached's answer to one connection too many.
                let _ = sock.write(b"ERROR Too many open connections\r\n");
                continue;
            }
            let _ = sock.set_nodelay(true);
            let entry = self.conns.vacant_entry();
            let ci = entry.key();
            if let Err(e) = self.poll.registry().register(&mut sock, Token(ci + FIRST_CONN), Interest::READABLE) {
                tracing::warn!("register: {e}");
                self.shared.curr_conns.fetch_sub(1, Ordering::Relaxed);
                continue;
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
                output: Output::default(),
                closing: false,
                last_active: self.now,
                want_write: false,
                queued: false,
                read_blocked: false,
                routed: false,
            });
            tracing::debug!(worker = self.id, %peer, "accepted");
        }
    }

    fn close(&mut self, ci: usize) {
        if let Some(mut c) = self.conns.try_remove(ci) {
            let _ = self.poll.registry().deregister(&mut c.sock);
            self.shared.curr_conns.fetch_sub(1, Ordering::Relaxed);
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
        let mut eof = false;
        // Whether the socket may still hold data we chose not to read yet.
        let mut more = false;
        loop {
            let len = conn.rbuf.len();
            if conn.rbuf.capacity() - len < READ_CHUNK {
                conn.rbuf.reserve(READ_CHUNK);
            }
            let cap = conn.rbuf.capacity();
            // SAFETY: we read into the spare capacity and only extend the
            // length by what the kernel reports written.
            let spare = unsafe { std::slice::from_raw_parts_mut(conn.rbuf.as_mut_ptr().add(len), cap - len) };
            match conn.sock.read(spare) {
                Ok(0) => {
                    eof = true;
                    break;
                }
                Ok(n) => {
                    unsafe { conn.rbuf.set_len(len + n) };
                    self.counters.bytes_read += n as u64;
                    if n < cap - len {
                        break;
                    }
                    // Do not buffer more than one big request's worth ahead.
                    if conn.rbuf.len() > self.limits.max_item_size + self.limits.max_line + READ_CHUNK {
                        more = true;
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => {
                    eof = true;
                    break;
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

    /// Parse and execute up to `reqs_per_event` requests from the buffer.
    fn process(&mut self, ci: usize) {
        let reqs_per_event = self.shared.settings.reqs_per_event;
        let mut done = 0usize;
        let mut pos = 0usize;
        let worker = self.id;
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
            if done >= reqs_per_event {
                // Fairness (-R): yield to other connections, come back later.
                self.counters.conn_yields += 1;
                self.requeue(ci);
                break;
            }
            let proto = *conn.proto.get_or_insert_with(|| mbal_proto::detect(conn.rbuf[pos]));
            let Conn { rbuf, output, .. } = conn;
            let buf = &rbuf[pos..];
            match mbal_proto::parse(proto, buf, &self.limits) {
                Parsed::NeedMore => break,
                Parsed::Err { reply, skip, close } => {
                    // memcached drops the old value of a key whose new value
                    // was refused as too large; so do we.
                    if let Some(key) = mbal_proto::key_to_unlink_on_too_large(buf) {
                        let mut rt = Route {
                            worker,
                            conn: ci,
                            gen: conn.gen,
                            owner: &mut self.owner,
                            server: self.shared.server_id,
                            routed: conn.routed,
                            outbox: &mut self.outbox,
                            counters: &mut self.counters,
                            self_stats: &mut self.self_stats,
                        };
                        unlink(&self.shared.layout, &mut rt, &mut self.store, self.now, output, key);
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
                    let gen = conn.gen;
                    let mut rt = Route {
                        worker,
                        conn: ci,
                        gen,
                        owner: &mut self.owner,
                        server: self.shared.server_id,
                        routed: conn.routed,
                        outbox: &mut self.outbox,
                        counters: &mut self.counters,
                        self_stats: &mut self.self_stats,
                    };
                    let action = handle(&self.shared, &mut rt, &mut self.store, self.now, output, &req, raw);
                    pos += consumed;
                    done += 1;
                    match action {
                        Action::None => {}
                        Action::Routed => conn.routed = true,
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
        let Some(conn) = self.conns.get_mut(ci) else { return };
        conn.rbuf.drain(..pos.min(conn.rbuf.len()));
        if conn.rbuf.capacity() > 4 * READ_CHUNK && conn.rbuf.len() < READ_CHUNK {
            conn.rbuf.shrink_to(READ_CHUNK);
        }
        self.flush(ci);
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
        if !need_write && conn.output.pending.is_empty() && conn.closing {
            self.close(ci);
            return;
        }
        // Output drained: resume a read that back-pressure paused.
        if !need_write && conn.read_blocked {
            self.requeue(ci);
        }
    }

    fn drain_inbox(&mut self) {
        while let Ok(env) = self.inbox.try_recv() {
            match env {
                Envelope::Fwd { from, conn, gen, seq, op } => {
                    // The cachelet may have moved since the sender looked:
                    // pass the request along our (newer) table.
                    if let Some(c) = self.fwd_cachelet(&op) {
                        let w = self.owner[c as usize].worker as usize;
                        if w != self.id {
                            self.outbox[w].push(Envelope::Fwd { from, conn, gen, seq, op });
                            continue;
                        }
                    }
                    self.counters.forwarded_in += 1;
                    let mut data = Vec::new();
                    self.exec_forwarded(op, &mut data);
                    self.reply_to(ReplyTo { worker: from, conn, gen, seq }, data);
                }
                Envelope::Reply { conn, gen, seq, data } => self.deliver(conn, gen, seq, data),
                Envelope::Release { cachelet, to, reply } => {
                    let epoch = self.shared.epoch.load(Ordering::Relaxed);
                    let done = release(
                        self.id,
                        &mut self.store,
                        &mut self.owner,
                        &mut self.outbox,
                        epoch,
                        cachelet,
                        to,
                        reply,
                    );
                    if let Some((to, data)) = done {
                        self.reply_to(to, data);
                    }
                }
                Envelope::Adopt { cachelet, ver, reply } => {
                    let c = cachelet.id();
                    self.store.insert_cachelet(cachelet);
                    let own = &mut self.owner[c as usize];
                    own.worker = self.id as u16;
                    own.ver = own.ver.max(ver);
                    let epoch = {
                        let mut map = self.shared.map.lock().unwrap_or_else(|p| p.into_inner());
                        map.move_cachelet(c, (self.shared.server_id, self.id as u16))
                    };
                    self.shared.epoch.fetch_max(epoch, Ordering::Relaxed);
                    self.counters.cachelets_adopted += 1;
                    self.reply_to(reply, format!("MOVED {epoch}\r\n").into_bytes());
                }
                Envelope::Owner { cachelet, worker, ver } => {
                    let own = &mut self.owner[cachelet as usize];
                    if ver > own.ver {
                        own.worker = worker as u16;
                        own.ver = ver;
                    }
                }
                Envelope::Flush { at } => self.store.flush_all(at),
                Envelope::StatsReq { from, conn, gen, seq, want_conns } => {
                    let snap = Box::new(self.snapshot(want_conns));
                    self.outbox[from].push(Envelope::StatsResp { conn, gen, seq, snap });
                }
                Envelope::StatsResp { conn, gen, seq, snap } => {
                    if self.conns.get(conn).is_some_and(|c| c.gen == gen) {
                        self.gathered(conn, seq, *snap);
                    }
                }
                Envelope::ResetStats => {
                    self.counters = Counters::default();
                    self.store.reset_stats();
                }
            }
        }
    }

    /// Send reply bytes to a connection slot, on this worker or another.
    fn reply_to(&mut self, to: ReplyTo, data: Vec<u8>) {
        if to.worker == self.id {
            self.deliver(to.conn, to.gen, to.seq, data);
        } else {
            self.outbox[to.worker].push(Envelope::Reply { conn: to.conn, gen: to.gen, seq: to.seq, data });
        }
    }

    /// Fill a waiting output slot of one of our connections.
    fn deliver(&mut self, conn: usize, gen: u64, seq: u64, data: Vec<u8>) {
        let Some(c) = self.conns.get_mut(conn).filter(|c| c.gen == gen) else { return };
        if let Some(slot) = c.output.slot_mut(seq) {
            *slot = Slot::Ready(data);
        }
        self.flush(conn);
    }

    /// The cachelet a forwarded request concerns.
    fn fwd_cachelet(&self, op: &FwdOp) -> Option<u32> {
        let layout = &self.shared.layout;
        match op {
            FwdOp::TextValues { cachelet, .. } => Some(*cachelet),
            FwdOp::Raw(proto, bytes) => match mbal_proto::parse(*proto, bytes, &self.limits) {
                Parsed::Req { req: Request::Text(cmd), .. } => text_key(&cmd).map(|k| locate(layout, k).cachelet),
                Parsed::Req { req: Request::Meta(cmd), .. } => {
                    let mut scratch = [0u8; 256];
                    meta_key(&cmd, &mut scratch).ok().map(|k| locate(layout, k).cachelet)
                }
                Parsed::Req { req: Request::Bin(r), .. } => Some(locate(layout, r.key).cachelet),
                _ => None,
            },
        }
    }

    fn exec_forwarded(&mut self, op: FwdOp, out: &mut Vec<u8>) {
        let mut ctx = Ctx {
            store: &mut self.store,
            layout: &self.shared.layout,
            settings: &self.shared.settings,
            counters: &mut self.counters,
            now: self.now,
        };
        match op {
            FwdOp::TextValues { keys, cas, touch, .. } => {
                for key in keys.split(|&b| b == b' ').filter(|k| !k.is_empty()) {
                    let at = locate(ctx.layout, key);
                    exec::text_get_one(&mut ctx, key, at, cas, touch, out);
                }
            }
            FwdOp::Raw(proto, bytes) => match mbal_proto::parse(proto, &bytes, &self.limits) {
                Parsed::Req { req, .. } => match req {
                    Request::Text(cmd) => {
                        let key = text_key(&cmd).expect("only keyed text commands are forwarded");
                        let at = locate(ctx.layout, key);
                        exec::text_keyed(&mut ctx, &cmd, at, out);
                    }
                    Request::Meta(cmd) => {
                        let mut scratch = [0u8; 256];
                        match meta_key(&cmd, &mut scratch) {
                            Ok(key) => {
                                let at = locate(ctx.layout, key);
                                exec::meta_keyed(&mut ctx, &cmd, key, at, out);
                            }
                            Err(e) => e.write(out),
                        }
                    }
                    Request::Bin(req) => {
                        let at = locate(ctx.layout, req.key);
                        exec::bin_keyed(&mut ctx, &req, at, out);
                    }
                },
                Parsed::Err { reply, .. } => reply.write(out),
                Parsed::NeedMore => out.extend_from_slice(b"SERVER_ERROR internal forwarding error\r\n"),
            },
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
        if let Some(slot) = self.conns[ci].output.slot_mut(seq) {
            *slot = Slot::Ready(data);
        }
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
        let ids: Vec<u32> = self.store.cachelet_ids().collect();
        let cachelets = ids
            .into_iter()
            .filter_map(|id| {
                let stats = self.store.cachelet(id).map(|c| c.stats())?;
                let (r, w) = self.rates.iter().find(|x| x.0 == id).map(|x| (x.1, x.2)).unwrap_or((0, 0));
                Some(CacheletInfo { id, owner: self.id, stats, reads_per_sec: r, writes_per_sec: w })
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

    fn send_outbox(&mut self) {
        let senders = self.shared.senders.get().expect("senders set before workers start");
        let wakers = self.shared.wakers.get().expect("wakers set before workers start");
        for (w, batch) in self.outbox.iter_mut().enumerate() {
            if batch.is_empty() {
                continue;
            }
            if w == self.id {
                // Replies to ourselves cannot happen (we never forward to
                // ourselves); anything else is dropped defensively.
                batch.clear();
                continue;
            }
            for env in batch.drain(..) {
                let _ = senders[w].send(env);
            }
            let _ = wakers[w].wake();
        }
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
    let p = ProcessInfo {
        settings: &shared.settings,
        uptime: shared.now(),
        now_unix,
        main_port: shared.main_port,
        worker_ports: ports,
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

/// What the connection should do after a request.
enum Action {
    None,
    Close,
    Shutdown,
    /// The connection opted in to routing hints (`mbal hello`).
    Routed,
}

/// Routing state for one connection's request.
struct Route<'a> {
    worker: usize,
    conn: usize,
    gen: u64,
    owner: &'a mut [Own],
    server: u16,
    /// The connection opted in to redirects.
    routed: bool,
    outbox: &'a mut Vec<Vec<Envelope>>,
    counters: &'a mut Counters,
    /// Stats gathers that still need this worker's own snapshot.
    self_stats: &'a mut Vec<(usize, u64, bool)>,
}

impl Route<'_> {
    fn dest(&self, at: Loc) -> Dest {
        let Own { server: s, worker: w, .. } = self.owner[at.cachelet as usize];
        if s != self.server {
            Dest::Server(s, w)
        } else if w as usize == self.worker {
            Dest::Here
        } else {
            Dest::Worker(w as usize)
        }
    }

    /// Reserve an output slot and send `op` to worker `to`.
    fn forward(&mut self, output: &mut Output, to: usize, op: FwdOp) {
        let seq = output.push(Slot::Wait);
        self.counters.forwarded_out += 1;
        self.outbox[to].push(Envelope::Fwd { from: self.worker, conn: self.conn, gen: self.gen, seq, op });
    }
}

fn text_key<'a>(cmd: &TextCmd<'a>) -> Option<&'a [u8]> {
    match *cmd {
        TextCmd::Store { key, .. }
        | TextCmd::Delete { key, .. }
        | TextCmd::Arith { key, .. }
        | TextCmd::Touch { key, .. } => Some(key),
        _ => None,
    }
}

/// Where a key's cachelet lives, seen from one worker.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Dest {
    Here,
    Worker(usize),
    Server(u16, u16),
}

/// The one place that routes: decide for each request (or each key of a
/// multi-get) whether this worker executes it, passes it to the owning
/// worker, redirects a routed client, or answers for a key another server
/// holds.
fn handle(
    shared: &Shared,
    rt: &mut Route,
    store: &mut WorkerStore,
    now: u32,
    output: &mut Output,
    req: &Request,
    raw: &[u8],
) -> Action {
    let layout = &shared.layout;
    let settings = &shared.settings;
    macro_rules! ctx {
        () => {
            Ctx { store: &mut *store, layout, settings, counters: &mut *rt.counters, now }
        };
    }
    match req {
        Request::Text(cmd) => match cmd {
            TextCmd::Get { keys, cas, touch } => {
                if rt.routed {
                    // A routed client sends a get only to the owner of its
                    // keys; if its map is stale, redirect the whole request.
                    if let Some(d) = keys.iter().map(|k| rt.dest(locate(layout, k))).find(|d| *d != Dest::Here) {
                        redirect(shared, rt, output, d);
                        return Action::None;
                    }
                }
                // Walk keys in order; local keys are answered at once, runs
                // of consecutive keys of one cachelet another worker owns go
                // to it as one message. END closes the reply after the last
                // run. Keys another server holds are misses here.
                let mut run: Option<(usize, u32, Vec<u8>)> = None;
                for key in keys.iter() {
                    let at = locate(layout, key);
                    match rt.dest(at) {
                        Dest::Here => {
                            if let Some((to, c, ks)) = run.take() {
                                rt.forward(
                                    output,
                                    to,
                                    FwdOp::TextValues { cachelet: c, keys: ks, cas: *cas, touch: *touch },
                                );
                            }
                            exec::text_get_one(&mut ctx!(), key, at, *cas, *touch, output.buf());
                        }
                        Dest::Worker(owner) => match &mut run {
                            Some((_, c, ks)) if *c == at.cachelet => {
                                ks.push(b' ');
                                ks.extend_from_slice(key);
                            }
                            _ => {
                                if let Some((to, c, ks)) = run.take() {
                                    rt.forward(
                                        output,
                                        to,
                                        FwdOp::TextValues { cachelet: c, keys: ks, cas: *cas, touch: *touch },
                                    );
                                }
                                run = Some((owner, at.cachelet, key.to_vec()));
                            }
                        },
                        Dest::Server(..) => rt.counters.foreign_keys += 1,
                    }
                }
                if let Some((to, c, ks)) = run.take() {
                    rt.forward(output, to, FwdOp::TextValues { cachelet: c, keys: ks, cas: *cas, touch: *touch });
                }
                output.buf().extend_from_slice(text::END);
                Action::None
            }
            TextCmd::Store { .. } | TextCmd::Delete { .. } | TextCmd::Arith { .. } | TextCmd::Touch { .. } => {
                let key = text_key(cmd).unwrap();
                let at = locate(layout, key);
                let exec = |ctx: &mut Ctx, out: &mut Vec<u8>| exec::text_keyed(ctx, cmd, at, out);
                route_keyed(shared, rt, store, now, output, at, Protocol::Text, raw, exec, |out| {
                    foreign_text(cmd, out)
                });
                Action::None
            }
            TextCmd::FlushAll { delay, noreply } => {
                if !settings.flush_enabled {
                    output.buf().extend_from_slice(b"CLIENT_ERROR flush_all not allowed\r\n");
                    return Action::None;
                }
                flush_all(shared, rt, store, now, *delay);
                if !noreply {
                    output.buf().extend_from_slice(text::OK);
                }
                Action::None
            }
            TextCmd::Version => {
                mbal_proto::text::write_version(output.buf(), crate::VERSION);
                Action::None
            }
            TextCmd::Verbosity { noreply } => {
                if !noreply {
                    output.buf().extend_from_slice(text::OK);
                }
                Action::None
            }
            TextCmd::Stats { args } => {
                let group = String::from_utf8_lossy(args).trim().to_string();
                match group.as_str() {
                    "reset" => {
                        reset_stats(rt, store);
                        output.buf().extend_from_slice(b"RESET\r\n");
                    }
                    "" | "settings" | "items" | "slabs" | "conns" | "cachelets" | "workers" => {
                        gather_stats(shared, rt, output, group, StatsFormat::Text)
                    }
                    _ => output.buf().extend_from_slice(b"ERROR\r\n"),
                }
                Action::None
            }
            TextCmd::Quit => Action::Close,
            TextCmd::Shutdown => {
                if settings.shutdown_enabled {
                    output.buf().extend_from_slice(text::OK);
                    Action::Shutdown
                } else {
                    output.buf().extend_from_slice(b"ERROR: shutdown not enabled\r\n");
                    Action::None
                }
            }
            TextCmd::Mbal { args } => admin(shared, rt, store, output, args),
        },
        Request::Meta(cmd) => {
            if cmd.kind == MetaKind::Noop {
                output.buf().extend_from_slice(b"MN\r\n");
                return Action::None;
            }
            let mut scratch = [0u8; 256];
            let key = match meta_key(cmd, &mut scratch) {
                Ok(k) => k,
                Err(e) => {
                    e.write(output.buf());
                    return Action::None;
                }
            };
            let at = locate(layout, key);
            let exec = |ctx: &mut Ctx, out: &mut Vec<u8>| exec::meta_keyed(ctx, cmd, key, at, out);
            route_keyed(shared, rt, store, now, output, at, Protocol::Text, raw, exec, |out| foreign_meta(cmd, out));
            Action::None
        }
        Request::Bin(breq) => handle_bin(shared, rt, store, now, output, breq, raw),
    }
}

/// Route one single-key request: execute it here, redirect a routed client,
/// pass it to the owning worker, or answer for a key another server holds.
/// (Binary connections never opt in to routing, so they never redirect.)
#[allow(clippy::too_many_arguments)]
fn route_keyed(
    shared: &Shared,
    rt: &mut Route,
    store: &mut WorkerStore,
    now: u32,
    output: &mut Output,
    at: Loc,
    proto: Protocol,
    raw: &[u8],
    exec: impl FnOnce(&mut Ctx, &mut Vec<u8>),
    foreign: impl FnOnce(&mut Vec<u8>),
) {
    match rt.dest(at) {
        Dest::Here => {
            let mut ctx =
                Ctx { store, layout: &shared.layout, settings: &shared.settings, counters: &mut *rt.counters, now };
            exec(&mut ctx, output.buf())
        }
        d if rt.routed => redirect(shared, rt, output, d),
        Dest::Worker(owner) => rt.forward(output, owner, FwdOp::Raw(proto, raw.to_vec())),
        Dest::Server(..) => {
            rt.counters.foreign_keys += 1;
            foreign(output.buf())
        }
    }
}

/// `RD <epoch> <server> <worker>`: tell a routed client who owns the key.
fn redirect(shared: &Shared, rt: &mut Route, output: &mut Output, d: Dest) {
    let (s, w) = match d {
        Dest::Here => unreachable!("no redirect to ourselves"),
        Dest::Worker(w) => (rt.server, w as u16),
        Dest::Server(s, w) => (s, w),
    };
    rt.counters.redirects += 1;
    let epoch = shared.epoch.load(Ordering::Relaxed);
    let _ = write!(output.buf(), "RD {epoch} {s} {w}\r\n");
}

const FOREIGN: &[u8] = b"SERVER_ERROR key is served by another mbal server\r\n";

/// A plain client asked this server for a key another server of the
/// cluster holds: answer as a memcached that does not hold the key would,
/// and refuse writes rather than store them in the wrong partition.
fn foreign_text(cmd: &TextCmd, out: &mut Vec<u8>) {
    match *cmd {
        TextCmd::Store { .. } => out.extend_from_slice(FOREIGN),
        TextCmd::Delete { noreply: false, .. }
        | TextCmd::Arith { noreply: false, .. }
        | TextCmd::Touch { noreply: false, .. } => out.extend_from_slice(text::NOT_FOUND),
        _ => {}
    }
}

fn foreign_meta(cmd: &mbal_proto::meta::MetaCmd, out: &mut Vec<u8>) {
    let quiet = cmd.flags.has(b'q');
    match cmd.kind {
        MetaKind::Set => out.extend_from_slice(FOREIGN),
        MetaKind::Get | MetaKind::Debug if !quiet => out.extend_from_slice(b"EN\r\n"),
        MetaKind::Delete | MetaKind::Arith if !quiet => out.extend_from_slice(b"NF\r\n"),
        _ => {}
    }
}

/// `mbal <args>`: the extension commands of docs/protocol.md.
fn admin(shared: &Shared, rt: &mut Route, store: &mut WorkerStore, output: &mut Output, args: &[u8]) -> Action {
    let args = String::from_utf8_lossy(args);
    let mut it = args.split_whitespace();
    match (it.next(), it.next(), it.next(), it.next()) {
        (Some("hello"), Some(epoch), None, None) if epoch.parse::<u64>().is_ok() => {
            let e = shared.epoch.load(Ordering::Relaxed);
            let _ = write!(output.buf(), "MBAL {} {} {e}\r\n", rt.server, rt.worker);
            Action::Routed
        }
        (Some("map"), None, ..) => {
            let map = shared.map.lock().unwrap_or_else(|p| p.into_inner());
            let json = map.to_json();
            let buf = output.buf();
            let _ = write!(buf, "MAP {} {}\r\n", map.epoch(), json.len());
            buf.extend_from_slice(json.as_bytes());
            buf.extend_from_slice(b"\r\n");
            Action::None
        }
        (Some("move"), Some(c), Some(w), None) => {
            let (Ok(c), Ok(to)) = (c.parse::<u32>(), w.parse::<usize>()) else {
                output.buf().extend_from_slice(b"CLIENT_ERROR usage: mbal move <cachelet> <worker>\r\n");
                return Action::None;
            };
            if c as usize >= rt.owner.len() || to >= shared.settings.threads {
                output.buf().extend_from_slice(b"CLIENT_ERROR no such cachelet or worker\r\n");
                return Action::None;
            }
            let Own { server: s, worker: from, .. } = rt.owner[c as usize];
            if s != rt.server {
                output.buf().extend_from_slice(b"CLIENT_ERROR cachelet is not on this server\r\n");
                return Action::None;
            }
            if from as usize == to {
                let e = shared.epoch.load(Ordering::Relaxed);
                let _ = write!(output.buf(), "MOVED {e}\r\n");
                return Action::None;
            }
            let seq = output.push(Slot::Wait);
            let reply = ReplyTo { worker: rt.worker, conn: rt.conn, gen: rt.gen, seq };
            if from as usize == rt.worker {
                // `to != from` was checked above, so the adopter answers.
                let epoch = shared.epoch.load(Ordering::Relaxed);
                let done = release(rt.worker, store, rt.owner, rt.outbox, epoch, c, to, reply);
                debug_assert!(done.is_none());
            } else {
                rt.outbox[from as usize].push(Envelope::Release { cachelet: c, to, reply });
            }
            Action::None
        }
        _ => {
            output.buf().extend_from_slice(
                b"CLIENT_ERROR unknown mbal command (hello <epoch> | map | move <cachelet> <worker>)\r\n",
            );
            Action::None
        }
    }
}

/// Hand a cachelet this worker owns to worker `to`: take it out of the
/// store (its items come along; nothing is copied), point our own table at
/// the new owner, send it there, and tell every other worker. The Adopt is
/// queued before the Owner notices, and a worker that still has the old
/// owner passes requests along its table, so every request reaches the
/// cachelet wherever it is.
///
/// Returns the admin reply when it is already known (the cachelet is
/// already at `to`); otherwise the adopting worker answers.
#[allow(clippy::too_many_arguments)]
fn release(
    me: usize,
    store: &mut WorkerStore,
    owner: &mut [Own],
    outbox: &mut [Vec<Envelope>],
    epoch: u64,
    c: u32,
    to: usize,
    reply: ReplyTo,
) -> Option<(ReplyTo, Vec<u8>)> {
    if to == me && store.owns(c) {
        // Already here (the requester's table was behind): nothing moves.
        return Some((reply, format!("MOVED {epoch}\r\n").into_bytes()));
    }
    let Some(cachelet) = store.take_cachelet(c) else {
        // Not ours (any more): pass the request on to whoever is.
        let w = owner[c as usize].worker as usize;
        debug_assert_ne!(w, me, "owner table and store disagree");
        outbox[w].push(Envelope::Release { cachelet: c, to, reply });
        return None;
    };
    let own = &mut owner[c as usize];
    own.worker = to as u16;
    own.ver += 1;
    let ver = own.ver;
    outbox[to].push(Envelope::Adopt { cachelet, ver, reply });
    for (w, ob) in outbox.iter_mut().enumerate() {
        if w != me && w != to {
            ob.push(Envelope::Owner { cachelet: c, worker: to, ver });
        }
    }
    None
}

fn handle_bin(
    shared: &Shared,
    rt: &mut Route,
    store: &mut WorkerStore,
    now: u32,
    output: &mut Output,
    req: &BinReq,
    raw: &[u8],
) -> Action {
    let h = &req.header;
    let layout = &shared.layout;
    let settings = &shared.settings;
    match h.opcode {
        op::NOOP => {
            write_response(output.buf(), op::NOOP, st::NO_ERROR, h.opaque, 0, &[], &[], &[]);
            Action::None
        }
        op::VERSION => {
            write_response(output.buf(), op::VERSION, st::NO_ERROR, h.opaque, 0, &[], &[], crate::VERSION.as_bytes());
            Action::None
        }
        op::VERBOSITY => {
            write_response(output.buf(), op::VERBOSITY, st::NO_ERROR, h.opaque, 0, &[], &[], &[]);
            Action::None
        }
        op::QUIT | op::QUITQ => {
            if h.opcode == op::QUIT {
                write_response(output.buf(), op::QUIT, st::NO_ERROR, h.opaque, 0, &[], &[], &[]);
            }
            Action::Close
        }
        op::FLUSH | op::FLUSHQ => {
            if !settings.flush_enabled {
                write_response(output.buf(), h.opcode, st::EINVAL, h.opaque, 0, &[], &[], b"Flush not allowed");
                return Action::None;
            }
            let delay = match req.flush_delay() {
                Ok(d) => d,
                Err(e) => {
                    e.write(output.buf());
                    return Action::None;
                }
            };
            flush_all(shared, rt, store, now, delay as i64);
            if h.opcode == op::FLUSH {
                write_response(output.buf(), op::FLUSH, st::NO_ERROR, h.opaque, 0, &[], &[], &[]);
            }
            Action::None
        }
        op::STAT => {
            let group = String::from_utf8_lossy(req.key).to_string();
            if group == "reset" {
                reset_stats(rt, store);
                write_response(output.buf(), op::STAT, st::NO_ERROR, h.opaque, 0, &[], &[], &[]);
            } else {
                gather_stats(shared, rt, output, group, StatsFormat::Binary { opaque: h.opaque });
            }
            Action::None
        }
        _ => {
            let at = locate(layout, req.key);
            let exec = |ctx: &mut Ctx, out: &mut Vec<u8>| exec::bin_keyed(ctx, req, at, out);
            route_keyed(shared, rt, store, now, output, at, Protocol::Binary, raw, exec, |out| foreign_bin(req, out));
            Action::None
        }
    }
}

fn foreign_bin(req: &BinReq, out: &mut Vec<u8>) {
    let h = &req.header;
    match h.opcode {
        op::GETQ | op::GETKQ | op::GATQ | op::GATKQ => {}
        o if mbal_proto::binary::is_store(o) => write_response(
            out,
            h.opcode,
            st::NOT_STORED,
            h.opaque,
            0,
            &[],
            &[],
            b"Key is served by another mbal server",
        ),
        _ => write_response(out, h.opcode, st::KEY_ENOENT, h.opaque, 0, &[], &[], b"Not found"),
    }
}

/// `stats reset` on every worker of the server.
fn reset_stats(rt: &mut Route, store: &mut WorkerStore) {
    *rt.counters = Counters::default();
    store.reset_stats();
    for (w, ob) in rt.outbox.iter_mut().enumerate() {
        if w != rt.worker {
            ob.push(Envelope::ResetStats);
        }
    }
}

/// Delete a key wherever it lives in this server (no reply).
fn unlink(layout: &Layout, rt: &mut Route, store: &mut WorkerStore, now: u32, output: &mut Output, key: &[u8]) {
    let at = locate(layout, key);
    match rt.dest(at) {
        Dest::Here => {
            store.delete(at.cachelet, at.hash, key, None, now);
        }
        Dest::Worker(owner) => {
            let mut req = b"delete ".to_vec();
            req.extend_from_slice(key);
            req.extend_from_slice(b" noreply\r\n");
            rt.forward(output, owner, FwdOp::Raw(Protocol::Text, req));
        }
        Dest::Server(..) => {}
    }
}

/// flush_all [delay]: every worker invalidates items set at or before
/// `now + delay`; peers get the order through the same FIFO channel as
/// this connection's forwarded requests, so later requests see it.
fn flush_all(shared: &Shared, rt: &mut Route, store: &mut WorkerStore, now: u32, delay: i64) {
    rt.counters.cmd_flush += 1;
    let at = if delay <= 0 {
        now
    } else {
        mbal_store::rel_exptime(delay, now, shared.start_unix).filter(|&t| t != 0).unwrap_or(now)
    };
    store.flush_all(at);
    for (w, ob) in rt.outbox.iter_mut().enumerate() {
        if w != rt.worker {
            ob.push(Envelope::Flush { at });
        }
    }
}

fn gather_stats(shared: &Shared, rt: &mut Route, output: &mut Output, group: String, format: StatsFormat) {
    let workers = shared.settings.threads;
    let want_conns = group == "conns";
    let seq = output.push(Slot::Gather { group, format, remaining: workers, snaps: Vec::with_capacity(workers) });
    for (w, ob) in rt.outbox.iter_mut().enumerate() {
        if w != rt.worker {
            ob.push(Envelope::StatsReq { from: rt.worker, conn: rt.conn, gen: rt.gen, seq, want_conns });
        }
    }
    // This worker's own snapshot is taken once the request is routed
    // (`finish_self_stats`), when the worker is no longer borrowed.
    rt.self_stats.push((rt.conn, seq, want_conns));
}

impl Worker {
    /// Complete the local part of stats gathers started this round.
    pub(crate) fn finish_self_stats(&mut self) {
        let pending = std::mem::take(&mut self.self_stats);
        for (ci, seq, want_conns) in pending {
            let snap = self.snapshot(want_conns);
            self.gathered(ci, seq, snap);
        }
    }
}
