//! One proxy thread: its event loop, client connections, upstream
//! connections and router. See the crate docs for the design.

use crate::stats::{Counters, Shared, UpDelta};
use crate::Config;
use mbal_cluster::{key_hash, ClusterMap, Owner, Redirect, Router, Split};
use mbal_proto::client::{Decoder, Expect, Frame};
use mbal_proto::meta::{meta_key, MetaKind};
use mbal_proto::text::TextCmd;
use mbal_proto::{Limits, Parsed, Protocol, Request};
use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token, Waker};
use slab::Slab;
use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener as StdListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const LISTENER: Token = Token(0);
const WAKER: Token = Token(1);
const CLIENT_BASE: usize = 2;
const UP_BASE: usize = 1 << 30;
const READ_CHUNK: usize = 16 * 1024;
const BACKOFF_MIN: Duration = Duration::from_millis(10);
const BACKOFF_MAX: Duration = Duration::from_secs(1);
/// The "worker" of a server's binary upstream: a plain connection to its
/// main port, where the server passes each request to the owning worker
/// itself (binary connections do not opt in to routing).
const BIN: u16 = u16::MAX;
/// A binary NOOP request, sent after a quiet binary request so that every
/// request in flight has a reply to wait for.
const BIN_NOOP: [u8; 24] = [0x80, 0x0a, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
/// Binary status of a request the proxy could not get answered ("temporary failure").
const BIN_UPSTREAM_FAILED: u16 = 0x86;

/// One slot of a client's reply queue: the reply to one request.
#[derive(Default)]
struct Slot {
    /// Upstream requests still unanswered (0: complete).
    parts: u32,
    /// The reply as received (one-part replies pass through here).
    buf: Vec<u8>,
    /// The first failure: the whole reply becomes this line.
    err: Option<Vec<u8>>,
    /// `noreply`: nothing is written, errors included.
    silent: bool,
    /// A multi-get answered by several upstreams: values by position.
    multi: Option<Box<Multi>>,
    /// `flush_all`: the replies of every server become one `OK`.
    flush: bool,
    /// A binary request: (opcode, opaque), for an error response.
    bin: Option<(u8, u32)>,
}

/// The values of a multi-get, put back in request order.
struct Multi {
    /// Per key position: (start, len) of its VALUE block in `arena`; len 0 = miss.
    spans: Vec<(u32, u32)>,
    arena: Vec<u8>,
}

struct Client {
    sock: TcpStream,
    id: u64,
    /// Input: `rbuf[rpos..rend]` is unread (see [`fill`]).
    rbuf: Vec<u8>,
    rpos: usize,
    rend: usize,
    /// Bytes of a refused request still to be dropped as they arrive.
    swallow: usize,
    wbuf: Vec<u8>,
    wpos: usize,
    slots: VecDeque<Slot>,
    /// Sequence number of `slots[0]`.
    base: u64,
    /// Read no more; close once every reply is written.
    closing: bool,
    /// Too many replies pending: reading stopped until they drain.
    paused: bool,
    /// A `flush_all` is a barrier: it waits for every earlier request of
    /// the connection to be answered, and later ones wait for it (requests
    /// travel to different upstream connections, so nothing else orders
    /// them across workers). Parsing stops while this is set.
    blocked: bool,
    dirty: bool,
    /// Protocol not decided yet (first byte).
    fresh: bool,
    /// Binary protocol (decided by the first byte).
    binary: bool,
}

/// What an upstream request is, which decides how its reply is read.
enum What {
    /// `mbal hello <epoch> <worker>` on a new connection.
    Hello,
    /// `mbal map`.
    Map,
    /// A single-key request (text or meta); the reply passes through.
    Keyed { hash: u64, expect: Expect },
    /// A `get` family request for the keys of one destination. `positions`:
    /// the keys' positions in the client's request (None: this request is
    /// the client's whole request, in order, and the reply passes through).
    /// `cursor`: (byte offset of the next unmatched key in `req`, its index).
    Get { positions: Option<Vec<u32>>, cursor: (u32, u32) },
    /// `flush_all` on one server.
    Flush,
    /// The `stats detail dump` after it: answered once every worker of the
    /// server has applied the flush; its content is not used.
    FlushSync,
    /// An admin command (`slabs`, `lru`, `cache_memlimit`): one line back.
    Admin,
    /// A binary request (to a server's binary upstream); its responses pass through.
    Bin,
    /// A binary flush on one server: its response is folded into one.
    BinFlush,
}

struct Inflight {
    /// Client slab index and id (id 0: no client waits).
    client: usize,
    cid: u64,
    seq: u64,
    req: Vec<u8>,
    what: What,
    /// `mn` follows the request: read until `MN`.
    quiet: bool,
    sent: Instant,
    hops: u8,
    rd: Option<Redirect>,
}

impl Inflight {
    fn expect(&self) -> Expect {
        if self.quiet {
            return Expect::Meta;
        }
        match self.what {
            What::Keyed { expect, .. } => expect,
            What::Get { .. } => Expect::Values,
            What::FlushSync => Expect::Stats,
            _ => Expect::Line,
        }
    }
}

enum UpState {
    Idle,
    Up,
    Down { until: Instant },
}

struct Upstream {
    owner: Owner,
    addr: SocketAddr,
    /// `addr` as text, for the stats.
    addr_s: String,
    sock: Option<TcpStream>,
    state: UpState,
    backoff: Duration,
    wbuf: Vec<u8>,
    wpos: usize,
    rbuf: Vec<u8>,
    rpos: usize,
    rend: usize,
    dec: Decoder,
    inflight: VecDeque<Inflight>,
    dirty: bool,
    delta: UpDelta,
}

/// A thing to do once the current upstream's replies are read.
enum After {
    Resend(Inflight),
    Done { client: usize, cid: u64, seq: u64 },
    InstallMap(Vec<u8>),
    UpstreamBroken(&'static str),
}

pub(crate) struct Engine {
    id: usize,
    poll: Poll,
    listener: TcpListener,
    cfg: Arc<Config>,
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
    limits: Limits,
    router: Router,
    clients: Slab<Client>,
    next_cid: u64,
    ups: Vec<Upstream>,
    up_of: HashMap<Owner, usize>,
    dirty_clients: Vec<usize>,
    dirty_ups: Vec<usize>,
    resume: Vec<usize>,
    fetching_map: bool,
    counters: Counters,
    split: Split,
    hashes: Vec<u64>,
    after: Vec<After>,
    /// The time the last poll returned: request times are taken at round
    /// granularity (one clock read per round).
    now: Instant,
}

fn would_block(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::WouldBlock
}

impl Engine {
    pub(crate) fn new(
        id: usize,
        l: StdListener,
        cfg: Arc<Config>,
        shared: Arc<Shared>,
        map: ClusterMap,
        stop: Arc<AtomicBool>,
    ) -> io::Result<(Engine, Arc<Waker>)> {
        let poll = Poll::new()?;
        let mut listener = TcpListener::from_std(l);
        poll.registry().register(&mut listener, LISTENER, Interest::READABLE)?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        let limits = Limits { max_item_size: cfg.max_item_size, ..Limits::default() };
        let e = Engine {
            id,
            poll,
            listener,
            cfg,
            shared,
            stop,
            limits,
            router: Router::new(map),
            clients: Slab::new(),
            next_cid: 1,
            ups: Vec::new(),
            up_of: HashMap::new(),
            dirty_clients: Vec::new(),
            dirty_ups: Vec::new(),
            resume: Vec::new(),
            fetching_map: false,
            counters: Counters::default(),
            split: Split::new(),
            hashes: Vec::new(),
            after: Vec::new(),
            now: Instant::now(),
        };
        Ok((e, waker))
    }

    pub(crate) fn run(mut self) {
        let mut events = Events::with_capacity(1024);
        loop {
            if self.stop.load(Ordering::Relaxed) {
                break;
            }
            let timeout = self.next_deadline().map(|d| d.saturating_duration_since(Instant::now()));
            let polled = self.poll.poll(&mut events, timeout);
            self.now = Instant::now();
            if let Err(e) = polled {
                if e.kind() != io::ErrorKind::Interrupted {
                    tracing::error!("proxy thread {}: poll: {e}", self.id);
                    break;
                }
            }
            for ev in events.iter() {
                match ev.token() {
                    LISTENER => self.accept(),
                    WAKER => {}
                    Token(t) if t >= UP_BASE => {
                        let ui = t - UP_BASE;
                        if ev.is_writable() {
                            self.mark_up(ui);
                        }
                        if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                            self.read_upstream(ui);
                        }
                    }
                    Token(t) => {
                        let ci = t - CLIENT_BASE;
                        if ev.is_writable() {
                            self.mark_client(ci);
                        }
                        if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                            self.read_client(ci);
                        }
                    }
                }
            }
            self.check_timeouts();
            while let Some(ci) = self.resume.pop() {
                self.read_client(ci);
            }
            self.flush_upstreams();
            self.publish();
            self.flush_clients();
        }
        // closing: count the connections this thread held as gone
        let n = self.clients.len() as u64;
        self.shared.curr_connections.fetch_sub(n, Ordering::Relaxed);
    }

    // ---- statistics ----

    fn publish(&mut self) {
        let dirty = self.ups.iter().any(|u| !u.delta.is_empty())
            || self.counters.bytes_read != 0
            || self.counters.bytes_written != 0
            || self.counters.total_connections != 0;
        if !dirty {
            return;
        }
        let mut t = self.shared.threads[self.id].lock().unwrap();
        t.counters.add(&self.counters);
        t.map_epoch = self.router.map().epoch();
        self.counters = Counters::default();
        for u in &mut self.ups {
            if !u.delta.is_empty() {
                t.publish(u.owner, &u.addr_s, &mut u.delta);
            }
        }
    }

    // ---- clients ----

    fn accept(&mut self) {
        loop {
            let (mut sock, _) = match self.listener.accept() {
                Ok(x) => x,
                Err(e) if would_block(&e) => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::warn!("proxy accept: {e}");
                    return;
                }
            };
            let prev = self.shared.curr_connections.fetch_add(1, Ordering::Relaxed);
            if prev as usize >= self.cfg.max_conns {
                self.shared.curr_connections.fetch_sub(1, Ordering::Relaxed);
                self.counters.rejected_connections += 1;
                let _ = sock.write(b"ERROR Too many open connections\r\n");
                continue;
            }
            let _ = sock.set_nodelay(true);
            let entry = self.clients.vacant_entry();
            let ci = entry.key();
            if self
                .poll
                .registry()
                .register(&mut sock, Token(CLIENT_BASE + ci), Interest::READABLE | Interest::WRITABLE)
                .is_err()
            {
                self.shared.curr_connections.fetch_sub(1, Ordering::Relaxed);
                continue;
            }
            self.counters.total_connections += 1;
            let id = self.next_cid;
            self.next_cid += 1;
            entry.insert(Client {
                sock,
                id,
                rbuf: Vec::new(),
                rpos: 0,
                rend: 0,
                swallow: 0,
                wbuf: Vec::new(),
                wpos: 0,
                slots: VecDeque::new(),
                base: 0,
                closing: false,
                paused: false,
                blocked: false,
                dirty: false,
                fresh: true,
                binary: false,
            });
        }
    }

    fn close_client(&mut self, ci: usize) {
        if let Some(mut c) = self.clients.try_remove(ci) {
            let _ = self.poll.registry().deregister(&mut c.sock);
            self.shared.curr_connections.fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn mark_client(&mut self, ci: usize) {
        if let Some(c) = self.clients.get_mut(ci) {
            if !c.dirty {
                c.dirty = true;
                self.dirty_clients.push(ci);
            }
        }
    }

    /// Read what the client sent and handle every complete request.
    fn read_client(&mut self, ci: usize) {
        loop {
            let Some(c) = self.clients.get_mut(ci) else { return };
            if c.closing || c.paused || c.blocked {
                return;
            }
            let r = fill(&mut c.sock, &mut c.rbuf, &mut c.rpos, &mut c.rend);
            match r {
                Ok(0) => {
                    // the client is gone (or half-closed): its replies can no longer matter
                    self.close_client(ci);
                    return;
                }
                Ok(n) => {
                    self.counters.bytes_read += n as u64;
                    self.handle_input(ci);
                    if n < READ_CHUNK / 2 {
                        // a short read emptied the socket: the next edge says when there is more
                        return;
                    }
                }
                Err(e) if would_block(&e) => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    self.close_client(ci);
                    return;
                }
            }
        }
    }

    fn handle_input(&mut self, ci: usize) {
        let Some(c) = self.clients.get_mut(ci) else { return };
        if c.fresh && c.rend > c.rpos {
            c.fresh = false;
            c.binary = mbal_proto::detect(c.rbuf[c.rpos]) == Protocol::Binary;
        }
        let proto = if c.binary { Protocol::Binary } else { Protocol::Text };
        let rbuf_all = std::mem::take(&mut c.rbuf);
        let rbuf = &rbuf_all[..c.rend];
        let mut rpos = c.rpos;
        loop {
            let Some(c) = self.clients.get_mut(ci) else { return };
            if c.swallow > 0 {
                let n = c.swallow.min(rbuf.len() - rpos);
                c.swallow -= n;
                rpos += n;
            }
            if rpos == rbuf.len() || c.closing {
                break;
            }
            if c.slots.len() >= self.cfg.max_pending {
                c.paused = true;
                break;
            }
            if c.blocked {
                if c.slots.iter().any(|s| s.parts > 0) {
                    break;
                }
                c.blocked = false;
            }
            match mbal_proto::parse(proto, &rbuf[rpos..], &self.limits) {
                Parsed::NeedMore => break,
                Parsed::Err { reply, skip, close } => {
                    let mut out = Vec::new();
                    reply.write(&mut out);
                    // memcached drops the old value of a key whose new one was
                    // refused (the servers' rule, applied at the owner)
                    if proto == Protocol::Text {
                        if let Some(key) = mbal_proto::key_to_unlink_on_too_large(&rbuf[rpos..]) {
                            self.unlink(key);
                        }
                    }
                    let c = self.clients.get_mut(ci).unwrap();
                    push_ready(c, out);
                    let avail = rbuf.len() - rpos;
                    rpos += skip.min(avail);
                    c.swallow = skip.saturating_sub(avail);
                    if close {
                        c.closing = true;
                    }
                    self.mark_client(ci);
                }
                Parsed::Req { req, consumed } => {
                    let flush = matches!(req, Request::Text(TextCmd::FlushAll { .. }));
                    if flush && c.slots.iter().any(|s| s.parts > 0) {
                        c.blocked = true; // earlier requests first
                        break;
                    }
                    let raw = &rbuf[rpos..rpos + consumed];
                    self.dispatch(ci, req, raw);
                    rpos += consumed;
                    if flush {
                        if let Some(c) = self.clients.get_mut(ci) {
                            c.blocked = true; // later requests after it
                        }
                    }
                }
            }
        }
        if let Some(c) = self.clients.get_mut(ci) {
            c.rbuf = rbuf_all;
            c.rpos = rpos;
        }
    }

    /// A `set` refused as too large drops the key's old value at its owner.
    fn unlink(&mut self, key: &[u8]) {
        let hash = key_hash(key);
        let mut req = Vec::with_capacity(key.len() + 24);
        req.extend_from_slice(b"delete ");
        req.extend_from_slice(key);
        req.extend_from_slice(b" noreply\r\nmn\r\n");
        let inf = self.inflight(usize::MAX, 0, 0, req, What::Keyed { hash, expect: Expect::Line }, true);
        self.send_hash(hash, inf);
    }

    fn inflight(&self, client: usize, cid: u64, seq: u64, req: Vec<u8>, what: What, quiet: bool) -> Inflight {
        Inflight { client, cid, seq, req, what, quiet, sent: self.now, hops: 0, rd: None }
    }

    /// Open a reply slot waiting for `parts` upstream replies; its sequence number.
    fn open_slot(&mut self, ci: usize, parts: u32, silent: bool) -> (u64, u64) {
        let c = self.clients.get_mut(ci).unwrap();
        let seq = c.base + c.slots.len() as u64;
        c.slots.push_back(Slot { parts, silent, ..Slot::default() });
        (c.id, seq)
    }

    fn local(&mut self, ci: usize, reply: &[u8]) {
        let c = self.clients.get_mut(ci).unwrap();
        push_ready(c, reply.to_vec());
        self.mark_client(ci);
    }

    /// Handle one request of client `ci` (`raw`: its bytes).
    fn dispatch(&mut self, ci: usize, req: Request, raw: &[u8]) {
        match req {
            Request::Text(cmd) => match cmd {
                TextCmd::Get { keys, cas, touch, .. } => {
                    self.counters.cmd_get += keys.len() as u64;
                    if touch.is_some() {
                        self.counters.cmd_touch += keys.len() as u64;
                    }
                    if keys.is_empty() {
                        return self.local(ci, b"END\r\n");
                    }
                    if keys.len() == 1 {
                        let hash = key_hash(keys.iter().next().unwrap());
                        let (cid, seq) = self.open_slot(ci, 1, false);
                        let what = What::Get { positions: None, cursor: (0, 0) };
                        let inf = self.inflight(ci, cid, seq, raw.to_vec(), what, false);
                        return self.send_hash(hash, inf);
                    }
                    self.hashes.clear();
                    self.hashes.extend(keys.iter().map(key_hash));
                    let mut split = std::mem::take(&mut self.split);
                    self.router.split(self.hashes.iter().copied(), false, &mut split);
                    let groups = split.groups().len() as u32;
                    let (cid, seq) = self.open_slot(ci, groups, false);
                    if groups == 1 {
                        let owner = split.groups()[0].owner;
                        let what = What::Get { positions: None, cursor: (0, 0) };
                        let inf = self.inflight(ci, cid, seq, raw.to_vec(), what, false);
                        self.send(owner, inf);
                    } else {
                        let key_list: Vec<&[u8]> = keys.iter().collect();
                        let prefix = get_prefix(cas, touch);
                        self.clients.get_mut(ci).unwrap().slots.back_mut().unwrap().multi =
                            Some(Box::new(Multi { spans: vec![(0, 0); key_list.len()], arena: Vec::new() }));
                        for g in split.groups() {
                            let positions = split.positions(g).to_vec();
                            let (req, cursor) = get_line(&prefix, positions.iter().map(|&p| key_list[p as usize]));
                            let what = What::Get { positions: Some(positions), cursor };
                            let inf = self.inflight(ci, cid, seq, req, what, false);
                            self.send(g.owner, inf);
                        }
                    }
                    self.split = split;
                }
                TextCmd::Store { key, noreply, .. }
                | TextCmd::Delete { key, noreply }
                | TextCmd::Arith { key, noreply, .. }
                | TextCmd::Touch { key, noreply, .. } => {
                    match cmd {
                        TextCmd::Store { .. } => self.counters.cmd_set += 1,
                        TextCmd::Touch { .. } => self.counters.cmd_touch += 1,
                        _ => {}
                    }
                    let hash = key_hash(key);
                    let (cid, seq) = self.open_slot(ci, 1, noreply);
                    let mut req = raw.to_vec();
                    if noreply {
                        req.extend_from_slice(b"mn\r\n");
                    }
                    let inf = self.inflight(ci, cid, seq, req, What::Keyed { hash, expect: Expect::Line }, noreply);
                    self.send_hash(hash, inf);
                }
                TextCmd::FlushAll { noreply, .. } => {
                    self.counters.cmd_flush += 1;
                    // To worker 0 of each server, which passes it to its other workers
                    // as messages; then `stats detail dump` on the same connection, which
                    // asks every worker of the server over the same FIFO channels and
                    // answers only when all did: once it is answered, every worker has
                    // applied the flush (what the barrier needs).
                    let servers = self.router.map().servers().len() as u16;
                    let (cid, seq) = self.open_slot(ci, 2 * servers as u32, noreply);
                    self.clients.get_mut(ci).unwrap().slots.back_mut().unwrap().flush = true;
                    for s in 0..servers {
                        let mut req = raw.to_vec();
                        if noreply {
                            req.extend_from_slice(b"mn\r\n");
                        }
                        let inf = self.inflight(ci, cid, seq, req, What::Flush, noreply);
                        self.send((s, 0), inf);
                        let sync = b"stats detail dump\r\n".to_vec();
                        let inf = self.inflight(ci, cid, seq, sync, What::FlushSync, false);
                        self.send((s, 0), inf);
                    }
                }
                TextCmd::Version => {
                    let mut out = Vec::new();
                    mbal_proto::text::write_version(&mut out, crate::VERSION);
                    self.local(ci, &out)
                }
                TextCmd::Verbosity { noreply } => self.local(ci, if noreply { b"" } else { b"OK\r\n" }),
                TextCmd::Stats { args } => {
                    self.publish();
                    let mut out = Vec::new();
                    match args {
                        b"" => self.shared.render_general(&mut out),
                        b"proxy" => self.shared.render_proxy(&mut out),
                        b"settings" => self.shared.render_settings(&mut out),
                        b"reset" => {
                            self.shared.reset();
                            out.extend_from_slice(b"RESET\r\n");
                        }
                        _ => out.extend_from_slice(b"ERROR\r\n"),
                    }
                    self.local(ci, &out)
                }
                TextCmd::Quit => {
                    self.clients.get_mut(ci).unwrap().closing = true;
                    self.mark_client(ci);
                }
                TextCmd::Shutdown { .. } => self.local(ci, b"ERROR: shutdown not enabled\r\n"),
                TextCmd::Tune { .. } => {
                    // the servers' answer (memcached's argument checks), from server 0
                    let (cid, seq) = self.open_slot(ci, 1, false);
                    let inf = self.inflight(ci, cid, seq, raw.to_vec(), What::Admin, false);
                    self.send((0, 0), inf);
                }
                // the proxy is not an mbal server: routing clients go to the servers
                TextCmd::Mbal { .. } => self.local(ci, b"ERROR\r\n"),
            },
            Request::Meta(cmd) => {
                self.counters.cmd_meta += 1;
                if cmd.kind == MetaKind::Noop {
                    return self.local(ci, b"MN\r\n");
                }
                let mut scratch = [0u8; 256];
                let hash = match meta_key(&cmd, &mut scratch) {
                    Ok(k) => key_hash(k),
                    Err(e) => {
                        let mut out = Vec::new();
                        e.write(&mut out);
                        return self.local(ci, &out);
                    }
                };
                match cmd.kind {
                    MetaKind::Get => self.counters.cmd_get += 1,
                    MetaKind::Set => self.counters.cmd_set += 1,
                    _ => {}
                }
                let quiet = cmd.flags.has(b'q');
                let (cid, seq) = self.open_slot(ci, 1, false);
                let mut req = raw.to_vec();
                if quiet {
                    req.extend_from_slice(b"mn\r\n");
                }
                let inf = self.inflight(ci, cid, seq, req, What::Keyed { hash, expect: Expect::Meta }, quiet);
                self.send_hash(hash, inf);
            }
            Request::Bin(b) => self.dispatch_bin(ci, b, raw),
        }
    }

    /// Handle one binary request of client `ci`.
    fn dispatch_bin(&mut self, ci: usize, b: mbal_proto::binary::BinReq, raw: &[u8]) {
        use mbal_proto::binary::{is_quiet, opcode as op, write_response};
        let (opcode, opaque) = (b.header.opcode, b.header.opaque);
        let quiet = is_quiet(opcode);
        let ok = |out: &mut Vec<u8>, value: &[u8]| write_response(out, opcode, 0, opaque, 0, &[], &[], value);
        let mut out = Vec::new();
        match opcode {
            op::NOOP => ok(&mut out, b""),
            op::VERSION => ok(&mut out, crate::VERSION.as_bytes()),
            op::VERBOSITY => ok(&mut out, b""),
            // the proxy's statistics are in the text `stats`: an empty list here
            op::STAT => ok(&mut out, b""),
            op::QUIT | op::QUITQ => {
                if opcode == op::QUIT {
                    ok(&mut out, b"");
                    self.local(ci, &out);
                }
                self.clients.get_mut(ci).unwrap().closing = true;
                return self.mark_client(ci);
            }
            op::FLUSH | op::FLUSHQ => {
                self.counters.cmd_flush += 1;
                let servers = self.router.map().servers().len() as u16;
                let (cid, seq) = self.open_slot(ci, servers as u32, false);
                let slot = self.clients.get_mut(ci).unwrap().slots.back_mut().unwrap();
                slot.bin = Some((opcode, opaque));
                if !quiet {
                    ok(&mut slot.buf, b"");
                }
                for s in 0..servers {
                    let mut req = raw.to_vec();
                    if quiet {
                        req.extend_from_slice(&BIN_NOOP);
                    }
                    let inf = self.inflight(ci, cid, seq, req, What::BinFlush, quiet);
                    self.send((s, BIN), inf);
                }
                return;
            }
            _ => {
                match opcode {
                    op::GET | op::GETQ | op::GETK | op::GETKQ => self.counters.cmd_get += 1,
                    op::GAT | op::GATQ | op::GATK | op::GATKQ => self.counters.cmd_touch += 1,
                    op::TOUCH => self.counters.cmd_touch += 1,
                    o if mbal_proto::binary::is_store(o) => self.counters.cmd_set += 1,
                    _ => {}
                }
                let server = self.router.route_hash(key_hash(b.key)).1 .0;
                let (cid, seq) = self.open_slot(ci, 1, false);
                self.clients.get_mut(ci).unwrap().slots.back_mut().unwrap().bin = Some((opcode, opaque));
                let mut req = raw.to_vec();
                if quiet {
                    req.extend_from_slice(&BIN_NOOP);
                }
                let inf = self.inflight(ci, cid, seq, req, What::Bin, quiet);
                return self.send((server, BIN), inf);
            }
        }
        self.local(ci, &out)
    }

    // ---- upstreams ----

    fn upstream(&mut self, owner: Owner) -> usize {
        if let Some(&ui) = self.up_of.get(&owner) {
            return ui;
        }
        let ui = self.ups.len();
        let addr = self.addr_of(owner);
        self.ups.push(Upstream {
            owner,
            addr,
            addr_s: addr.to_string(),
            sock: None,
            state: UpState::Idle,
            backoff: BACKOFF_MIN,
            wbuf: Vec::new(),
            wpos: 0,
            rbuf: Vec::new(),
            rpos: 0,
            rend: 0,
            dec: Decoder::new(),
            inflight: VecDeque::new(),
            dirty: false,
            delta: UpDelta::default(),
        });
        self.up_of.insert(owner, ui);
        ui
    }

    fn addr_of(&self, (s, w): Owner) -> SocketAddr {
        if w == BIN {
            self.router.map().servers()[s as usize].main
        } else {
            self.router.map().worker_addr(s, w)
        }
    }

    fn mark_up(&mut self, ui: usize) {
        let u = &mut self.ups[ui];
        if !u.dirty {
            u.dirty = true;
            self.dirty_ups.push(ui);
        }
    }

    fn send_hash(&mut self, hash: u64, inf: Inflight) {
        let owner = self.router.route_hash(hash).1;
        self.send(owner, inf);
    }

    /// Queue a request on the upstream of `owner` (connecting if needed).
    fn send(&mut self, owner: Owner, mut inf: Inflight) {
        let known = if owner.1 == BIN {
            (owner.0 as usize) < self.router.map().servers().len()
        } else {
            self.router.map().has_worker(owner)
        };
        if !known {
            return self.fail(inf, "SERVER_ERROR upstream not in the cluster map");
        }
        let ui = self.upstream(owner);
        let now = self.now;
        match self.ups[ui].state {
            UpState::Up => {}
            UpState::Down { until } if now < until => {
                self.ups[ui].delta.errors += 1;
                return self.fail(inf, "SERVER_ERROR upstream unavailable");
            }
            UpState::Down { .. } | UpState::Idle => {
                if let Err(e) = self.connect(ui) {
                    tracing::debug!("proxy: connect to {}: {e}", self.ups[ui].addr);
                    self.ups[ui].delta.errors += 1;
                    self.down(ui);
                    return self.fail(inf, "SERVER_ERROR upstream unavailable");
                }
            }
        }
        inf.sent = now;
        let u = &mut self.ups[ui];
        u.delta.requests += 1;
        u.wbuf.extend_from_slice(&inf.req);
        u.inflight.push_back(inf);
        self.mark_up(ui);
    }

    fn connect(&mut self, ui: usize) -> io::Result<()> {
        let epoch = self.router.map().epoch();
        let addr = self.addr_of(self.ups[ui].owner);
        let u = &mut self.ups[ui];
        if addr != u.addr {
            u.addr = addr;
            u.addr_s = addr.to_string();
        }
        let mut sock = TcpStream::connect(u.addr)?;
        let _ = sock.set_nodelay(true);
        self.poll.registry().register(&mut sock, Token(UP_BASE + ui), Interest::READABLE | Interest::WRITABLE)?;
        u.sock = Some(sock);
        u.state = UpState::Up;
        u.wbuf.clear();
        u.wpos = 0;
        u.rpos = 0;
        u.rend = 0;
        u.dec = Decoder::new();
        u.delta.connects += 1;
        if u.owner.1 == BIN {
            return Ok(()); // a plain binary connection: no hello
        }
        let hello = format!("mbal hello {epoch} {}\r\n", u.owner.1).into_bytes();
        u.wbuf.extend_from_slice(&hello);
        u.inflight.push_back(Inflight {
            client: usize::MAX,
            cid: 0,
            seq: 0,
            req: hello,
            what: What::Hello,
            quiet: false,
            sent: self.now,
            hops: 0,
            rd: None,
        });
        Ok(())
    }

    /// Take the upstream down: drop its connection, fail what is in flight,
    /// and refuse requests to it for the backoff.
    fn down(&mut self, ui: usize) {
        let u = &mut self.ups[ui];
        if let Some(mut s) = u.sock.take() {
            let _ = self.poll.registry().deregister(&mut s);
        }
        u.state = UpState::Down { until: self.now + u.backoff };
        u.backoff = (u.backoff * 2).min(BACKOFF_MAX);
        u.wbuf.clear();
        u.wpos = 0;
        u.rpos = 0;
        u.rend = 0;
        u.dec = Decoder::new();
        let lost: Vec<Inflight> = u.inflight.drain(..).collect();
        for inf in lost {
            if inf.cid != 0 {
                self.ups[ui].delta.errors += 1;
            }
            self.fail(inf, "SERVER_ERROR upstream failed");
        }
    }

    /// Answer a request with an error line (its slot's whole reply).
    fn fail(&mut self, inf: Inflight, msg: &'static str) {
        if matches!(inf.what, What::Map) {
            self.fetching_map = false;
        }
        if inf.cid == 0 {
            return;
        }
        if let Some(s) = slot_mut(&mut self.clients, inf.client, inf.cid, inf.seq) {
            if s.err.is_none() {
                let mut e = Vec::new();
                match s.bin {
                    Some((opcode, opaque)) => {
                        let text = msg.strip_prefix("SERVER_ERROR ").unwrap_or(msg);
                        mbal_proto::binary::write_response(
                            &mut e,
                            opcode,
                            BIN_UPSTREAM_FAILED,
                            opaque,
                            0,
                            &[],
                            &[],
                            text.as_bytes(),
                        );
                    }
                    None => {
                        e.extend_from_slice(msg.as_bytes());
                        e.extend_from_slice(b"\r\n");
                    }
                }
                s.err = Some(e);
            }
        }
        self.part_done(inf.client, inf.cid, inf.seq);
    }

    fn part_done(&mut self, ci: usize, cid: u64, seq: u64) {
        if let Some(s) = slot_mut(&mut self.clients, ci, cid, seq) {
            s.parts -= 1;
            if s.parts == 0 {
                self.mark_client(ci);
            }
        }
    }

    fn check_timeouts(&mut self) {
        let now = self.now;
        let t = self.cfg.upstream_timeout;
        for ui in 0..self.ups.len() {
            let late = self.ups[ui].inflight.front().is_some_and(|f| now.duration_since(f.sent) >= t);
            if late {
                tracing::debug!("proxy: upstream {} timed out", self.ups[ui].addr);
                self.ups[ui].delta.timeouts += 1;
                self.down(ui);
            }
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        if !self.resume.is_empty() {
            return Some(Instant::now());
        }
        self.ups.iter().filter_map(|u| u.inflight.front()).map(|f| f.sent + self.cfg.upstream_timeout).min()
    }

    fn flush_upstreams(&mut self) {
        while let Some(ui) = self.dirty_ups.pop() {
            let u = &mut self.ups[ui];
            u.dirty = false;
            let Some(sock) = u.sock.as_mut() else { continue };
            let mut broken = false;
            while u.wpos < u.wbuf.len() {
                match sock.write(&u.wbuf[u.wpos..]) {
                    Ok(n) => u.wpos += n,
                    Err(e) if would_block(&e) || e.kind() == io::ErrorKind::NotConnected => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => {
                        broken = true;
                        break;
                    }
                }
            }
            if u.wpos == u.wbuf.len() {
                u.wbuf.clear();
                u.wpos = 0;
            }
            if broken {
                self.down(ui);
            }
        }
    }

    fn read_upstream(&mut self, ui: usize) {
        let mut broken = false;
        {
            let u = &mut self.ups[ui];
            let Some(sock) = u.sock.as_mut() else { return };
            loop {
                let r = fill(sock, &mut u.rbuf, &mut u.rpos, &mut u.rend);
                match r {
                    Ok(0) => {
                        broken = true;
                        break;
                    }
                    Ok(n) if n < READ_CHUNK / 2 => break,
                    Ok(_) => {}
                    Err(e) if would_block(&e) => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => {
                        broken = true;
                        break;
                    }
                }
            }
        }
        self.decode_upstream(ui);
        if broken && self.ups[ui].sock.is_some() {
            self.down(ui);
        }
    }

    /// Match the upstream's replies to its requests in flight.
    fn decode_upstream(&mut self, ui: usize) {
        if self.ups[ui].owner.1 == BIN {
            return self.decode_binary(ui);
        }
        let rbuf_all = std::mem::take(&mut self.ups[ui].rbuf);
        let rbuf = &rbuf_all[..self.ups[ui].rend];
        let mut rpos = self.ups[ui].rpos;
        let now = self.now;
        let owner = self.ups[ui].owner;
        let mut after = std::mem::take(&mut self.after);
        'frames: loop {
            let u = &mut self.ups[ui];
            let Some(front) = u.inflight.front_mut() else {
                if rpos < rbuf.len() {
                    after.push(After::UpstreamBroken("reply to no request"));
                }
                break;
            };
            if let What::Admin = front.what {
                // one line, whatever it says (memcached's admin replies are not all standard)
                let Some(nl) = rbuf[rpos..].iter().position(|&b| b == b'\n') else { break };
                let line = &rbuf[rpos..rpos + nl + 1];
                rpos += nl + 1;
                if let Some(s) = slot_mut(&mut self.clients, front.client, front.cid, front.seq) {
                    s.buf.extend_from_slice(line);
                }
                let inf = u.inflight.pop_front().unwrap();
                u.delta.latencies.push(now.duration_since(inf.sent).as_micros().min(u32::MAX as u128) as u32);
                after.push(After::Done { client: inf.client, cid: inf.cid, seq: inf.seq });
                continue;
            }
            let expect = front.expect();
            let (n, frame) = match u.dec.decode(&rbuf[rpos..], expect) {
                Ok(x) => x,
                Err(e) => {
                    tracing::debug!("proxy: upstream {}: {e}", u.addr);
                    after.push(After::UpstreamBroken("bad reply"));
                    break;
                }
            };
            let bytes = &rbuf[rpos..rpos + n];
            rpos += n;
            let Some(frame) = frame else { break };
            let quiet = front.quiet;
            let mut end = !quiet && frame.ends_reply();
            match frame {
                Frame::Redirect { epoch, server, worker } => {
                    front.rd = Some(Redirect { epoch, to: (server, worker) });
                    u.delta.redirects += 1;
                }
                Frame::Meta { code: [b'M', b'N'], .. } if quiet => end = true,
                Frame::Hello { server, worker, .. } if matches!(front.what, What::Hello) => {
                    if (server, worker) != owner {
                        after.push(After::UpstreamBroken("hello answered by another worker"));
                        break 'frames;
                    }
                    u.backoff = BACKOFF_MIN;
                }
                Frame::Map { json, .. } if matches!(front.what, What::Map) => {
                    after.push(After::InstallMap(json.to_vec()));
                }
                _ if matches!(front.what, What::Hello | What::Map) => {
                    after.push(After::UpstreamBroken("unexpected reply to mbal hello or mbal map"));
                    break 'frames;
                }
                Frame::Value(v) => {
                    self.counters.get_hits += 1;
                    let Some(s) = slot_mut(&mut self.clients, front.client, front.cid, front.seq) else {
                        continue;
                    };
                    match (&mut front.what, s.multi.as_mut()) {
                        (What::Get { positions: Some(pos), cursor }, Some(m)) => {
                            // the next key of this request that is this value's key
                            let Some(p) = match_key(&front.req, pos, cursor, v.key) else {
                                after.push(After::UpstreamBroken("value of a key not asked for"));
                                break 'frames;
                            };
                            m.spans[p as usize] = (m.arena.len() as u32, bytes.len() as u32);
                            m.arena.extend_from_slice(bytes);
                        }
                        _ => s.buf.extend_from_slice(bytes),
                    }
                }
                Frame::End { .. } => {
                    if let (What::Get { positions: None, .. }, Some(s)) =
                        (&front.what, slot_mut(&mut self.clients, front.client, front.cid, front.seq))
                    {
                        s.buf.extend_from_slice(bytes);
                    }
                }
                Frame::Error(line) if matches!(front.what, What::Flush | What::Get { positions: Some(_), .. }) => {
                    if let Some(s) = slot_mut(&mut self.clients, front.client, front.cid, front.seq) {
                        if s.err.is_none() {
                            let mut e = line.to_vec();
                            e.extend_from_slice(b"\r\n");
                            s.err = Some(e);
                        }
                    }
                }
                _ if matches!(front.what, What::Flush | What::FlushSync) => {}
                _ => {
                    if let Some(s) = slot_mut(&mut self.clients, front.client, front.cid, front.seq) {
                        s.buf.extend_from_slice(bytes);
                    }
                }
            }
            if end {
                let inf = u.inflight.pop_front().unwrap();
                u.delta.latencies.push(now.duration_since(inf.sent).as_micros().min(u32::MAX as u128) as u32);
                match inf.rd {
                    Some(_) => after.push(After::Resend(inf)),
                    None if matches!(inf.what, What::Hello | What::Map) => {}
                    None => after.push(After::Done { client: inf.client, cid: inf.cid, seq: inf.seq }),
                }
            }
        }
        let u = &mut self.ups[ui];
        u.rbuf = rbuf_all;
        u.rpos = rpos;
        for a in after.drain(..) {
            match a {
                After::Done { client, cid, seq } => self.part_done(client, cid, seq),
                After::Resend(inf) => self.redirected(owner, inf),
                After::InstallMap(json) => {
                    self.fetching_map = false;
                    match ClusterMap::from_json(&String::from_utf8_lossy(&json)) {
                        Ok(m) => {
                            if let Err(e) = self.router.install_map(m) {
                                tracing::warn!("proxy: map from {}: {e}", self.ups[ui].addr);
                            }
                        }
                        Err(e) => tracing::warn!("proxy: bad map from {}: {e}", self.ups[ui].addr),
                    }
                }
                After::UpstreamBroken(why) => {
                    tracing::debug!("proxy: upstream {}: {why}", self.ups[ui].addr);
                    if self.ups[ui].sock.is_some() {
                        self.down(ui);
                    }
                }
            }
        }
        self.after = after;
    }

    /// Match a binary upstream's responses to its requests in flight.
    fn decode_binary(&mut self, ui: usize) {
        use mbal_proto::binary::{opcode as op, BinHeader, HEADER_LEN, MAGIC_RESPONSE};
        let rbuf_all = std::mem::take(&mut self.ups[ui].rbuf);
        let rbuf = &rbuf_all[..self.ups[ui].rend];
        let mut rpos = self.ups[ui].rpos;
        let now = self.now;
        let mut done = Vec::new();
        let mut broken = false;
        loop {
            let u = &mut self.ups[ui];
            let Some(front) = u.inflight.front() else {
                broken = rpos < rbuf.len();
                break;
            };
            if rbuf.len() - rpos < HEADER_LEN {
                break;
            }
            let h = BinHeader::decode(&rbuf[rpos..]);
            if h.magic != MAGIC_RESPONSE {
                broken = true;
                break;
            }
            let total = HEADER_LEN + h.body_len as usize;
            if rbuf.len() - rpos < total {
                break;
            }
            let bytes = &rbuf[rpos..rpos + total];
            rpos += total;
            let status = u16::from_be_bytes([bytes[6], bytes[7]]);
            let ours = front.quiet && h.opcode == op::NOOP;
            if !ours {
                if let Some(s) = slot_mut(&mut self.clients, front.client, front.cid, front.seq) {
                    match front.what {
                        What::BinFlush if status == 0 => {}
                        What::BinFlush => s.err = s.err.take().or_else(|| Some(bytes.to_vec())),
                        _ => s.buf.extend_from_slice(bytes),
                    }
                }
            }
            if ours || !front.quiet {
                let inf = u.inflight.pop_front().unwrap();
                u.delta.latencies.push(now.duration_since(inf.sent).as_micros().min(u32::MAX as u128) as u32);
                done.push((inf.client, inf.cid, inf.seq));
            }
        }
        let u = &mut self.ups[ui];
        u.rbuf = rbuf_all;
        u.rpos = rpos;
        for (ci, cid, seq) in done {
            self.part_done(ci, cid, seq);
        }
        if broken && self.ups[ui].sock.is_some() {
            tracing::debug!("proxy: binary upstream {}: bad response", self.ups[ui].addr);
            self.down(ui);
        }
    }

    /// A request came back `RD`: learn, then resend it where the router now says.
    fn redirected(&mut self, from: Owner, mut inf: Inflight) {
        let rd = inf.rd.take().unwrap();
        inf.hops += 1;
        if inf.hops > self.cfg.max_redirects {
            return self.fail(inf, "SERVER_ERROR too many redirects");
        }
        match inf.what {
            What::Keyed { hash, .. } => {
                match self.router.learn(from, rd, [hash]) {
                    Ok(l) => self.maybe_fetch_map(l.fetch_map_from),
                    Err(_) => return self.fail(inf, "SERVER_ERROR bad redirect"),
                }
                self.send_hash(hash, inf);
            }
            What::Get { ref mut positions, .. } => {
                let positions = positions.take();
                // the keys of this request, and their positions in the client's
                let Parsed::Req { req: Request::Text(TextCmd::Get { keys, cas, touch, .. }), .. } =
                    mbal_proto::parse(Protocol::Text, &inf.req, &self.limits)
                else {
                    return self.fail(inf, "SERVER_ERROR proxy lost a request");
                };
                let key_list: Vec<&[u8]> = keys.iter().collect();
                let positions = positions.unwrap_or_else(|| (0..key_list.len() as u32).collect());
                self.hashes.clear();
                self.hashes.extend(key_list.iter().map(|k| key_hash(k)));
                match self.router.learn(from, rd, self.hashes.iter().copied()) {
                    Ok(l) => self.maybe_fetch_map(l.fetch_map_from),
                    Err(_) => return self.fail(inf, "SERVER_ERROR bad redirect"),
                }
                let Some(s) = slot_mut(&mut self.clients, inf.client, inf.cid, inf.seq) else { return };
                if s.multi.is_none() {
                    // it was the whole request: from now on, values go by position
                    s.multi = Some(Box::new(Multi { spans: vec![(0, 0); key_list.len()], arena: Vec::new() }));
                }
                let mut split = std::mem::take(&mut self.split);
                self.router.split(self.hashes.iter().copied(), true, &mut split);
                s.parts += split.groups().len() as u32 - 1;
                let prefix = get_prefix(cas, touch);
                for g in split.groups() {
                    let idx = split.positions(g);
                    let (req, cursor) = get_line(&prefix, idx.iter().map(|&i| key_list[i as usize]));
                    let pos: Vec<u32> = idx.iter().map(|&i| positions[i as usize]).collect();
                    let mut next = self.inflight(
                        inf.client,
                        inf.cid,
                        inf.seq,
                        req,
                        What::Get { positions: Some(pos), cursor },
                        false,
                    );
                    next.hops = inf.hops;
                    self.send(g.owner, next);
                }
                self.split = split;
            }
            _ => self.fail(inf, "SERVER_ERROR unexpected redirect"),
        }
    }

    fn maybe_fetch_map(&mut self, from: Option<Owner>) {
        let Some(owner) = from else { return };
        if self.fetching_map {
            return;
        }
        self.fetching_map = true;
        self.counters.map_fetches += 1;
        let inf = self.inflight(usize::MAX, 0, 0, b"mbal map\r\n".to_vec(), What::Map, false);
        self.send(owner, inf);
    }

    // ---- replies to clients ----

    fn flush_clients(&mut self) {
        while let Some(ci) = self.dirty_clients.pop() {
            let Some(c) = self.clients.get_mut(ci) else { continue };
            c.dirty = false;
            while c.slots.front().is_some_and(|s| s.parts == 0) {
                let s = c.slots.pop_front().unwrap();
                c.base += 1;
                render(s, &mut c.wbuf);
            }
            let mut broken = false;
            while c.wpos < c.wbuf.len() {
                match c.sock.write(&c.wbuf[c.wpos..]) {
                    Ok(n) => {
                        c.wpos += n;
                        self.counters.bytes_written += n as u64;
                    }
                    Err(e) if would_block(&e) => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => {
                        broken = true;
                        break;
                    }
                }
            }
            if c.wpos == c.wbuf.len() {
                c.wbuf.clear();
                c.wpos = 0;
            }
            let done = c.closing && c.slots.is_empty() && c.wbuf.is_empty();
            if broken || done {
                self.close_client(ci);
                continue;
            }
            let unblock = c.blocked && c.slots.iter().all(|s| s.parts == 0);
            if unblock {
                c.blocked = false;
            }
            if unblock || (c.paused && c.slots.len() <= self.cfg.max_pending / 2 && c.wbuf.len() < 4 << 20) {
                c.paused = false;
                // what is buffered first, then the socket
                self.handle_input(ci);
                self.resume.push(ci);
            }
        }
    }
}

/// Read once into `buf[end..]`, first making room: the unread bytes
/// `buf[pos..end]` move to the front when the free tail is short, and the
/// buffer grows only when they fill most of it (so it is zero-filled once,
/// not on every read).
fn fill(sock: &mut TcpStream, buf: &mut Vec<u8>, pos: &mut usize, end: &mut usize) -> io::Result<usize> {
    if *pos == *end {
        *pos = 0;
        *end = 0;
    }
    if buf.len() - *end < READ_CHUNK / 2 {
        if *pos > 0 {
            buf.copy_within(*pos..*end, 0);
            *end -= *pos;
            *pos = 0;
        }
        if buf.len() - *end < READ_CHUNK / 2 {
            let grow = (buf.len() * 2).max(READ_CHUNK);
            buf.resize(grow, 0);
        }
    }
    let n = sock.read(&mut buf[*end..])?;
    *end += n;
    Ok(n)
}

/// The slot of (client, id, seq), if the client is still there.
fn slot_mut(clients: &mut Slab<Client>, ci: usize, cid: u64, seq: u64) -> Option<&mut Slot> {
    if cid == 0 {
        return None;
    }
    let c = clients.get_mut(ci).filter(|c| c.id == cid)?;
    let i = seq.checked_sub(c.base)? as usize;
    c.slots.get_mut(i)
}

/// A reply that needs no upstream.
fn push_ready(c: &mut Client, reply: Vec<u8>) {
    c.slots.push_back(Slot { buf: reply, ..Slot::default() });
}

/// Write a complete slot's reply.
fn render(s: Slot, out: &mut Vec<u8>) {
    if s.silent {
        return;
    }
    if let Some(e) = s.err {
        out.extend_from_slice(&e);
    } else if s.flush {
        out.extend_from_slice(b"OK\r\n");
    } else if let Some(m) = s.multi {
        for &(start, len) in &m.spans {
            out.extend_from_slice(&m.arena[start as usize..(start + len) as usize]);
        }
        out.extend_from_slice(b"END\r\n");
    } else {
        out.extend_from_slice(&s.buf);
    }
}

/// `get `, `gets `, `gat <t> ` or `gats <t> `.
fn get_prefix(cas: bool, touch: Option<i64>) -> Vec<u8> {
    let mut p = Vec::with_capacity(24);
    match touch {
        None => p.extend_from_slice(if cas { b"gets " } else { b"get " }),
        Some(t) => {
            p.extend_from_slice(if cas { b"gats " } else { b"gat " });
            p.extend_from_slice(itoa::Buffer::new().format(t).as_bytes());
            p.push(b' ');
        }
    }
    p
}

/// A get line for these keys, and the cursor at its first key.
fn get_line<'k>(prefix: &[u8], keys: impl Iterator<Item = &'k [u8]>) -> (Vec<u8>, (u32, u32)) {
    let mut req = Vec::with_capacity(prefix.len() + 64);
    req.extend_from_slice(prefix);
    for (i, k) in keys.enumerate() {
        if i > 0 {
            req.push(b' ');
        }
        req.extend_from_slice(k);
    }
    req.extend_from_slice(b"\r\n");
    (req, (prefix.len() as u32, 0))
}

/// The position (in the client's request) of the first key at or after the
/// cursor that equals `key`; moves the cursor past it. Values come back in
/// request order and only for hits, so skipped keys were misses.
fn match_key(req: &[u8], positions: &[u32], cursor: &mut (u32, u32), key: &[u8]) -> Option<u32> {
    let end = req.len() - 2; // before CR LF
    let (mut off, mut idx) = (cursor.0 as usize, cursor.1 as usize);
    while off < end && idx < positions.len() {
        let rest = &req[off..end];
        let len = rest.iter().position(|&b| b == b' ').unwrap_or(rest.len());
        let k = &rest[..len];
        off += len + 1;
        idx += 1;
        if k == key {
            *cursor = (off as u32, idx as u32);
            return Some(positions[idx - 1]);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn get_lines_and_key_matching() {
        let keys: [&[u8]; 4] = [b"a", b"bb", b"a", b"c"];
        let (req, mut cur) = get_line(&get_prefix(false, Some(-5)), keys.iter().copied());
        assert_eq!(req, b"gat -5 a bb a c\r\n");
        let pos = [7, 9, 10, 12];
        // a hit on the second "a" and on "c": "a" at 7 is taken first (same bytes)
        assert_eq!(match_key(&req, &pos, &mut cur, b"a"), Some(7));
        assert_eq!(match_key(&req, &pos, &mut cur, b"a"), Some(10));
        assert_eq!(match_key(&req, &pos, &mut cur, b"c"), Some(12));
        assert_eq!(match_key(&req, &pos, &mut cur, b"c"), None, "no key left");
        let (req, mut cur) = get_line(&get_prefix(true, None), [&b"x"[..]].into_iter());
        assert_eq!(req, b"gets x\r\n");
        assert_eq!(match_key(&req, &[3], &mut cur, b"y"), None);
    }
}
