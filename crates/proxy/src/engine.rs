//! One proxy thread: its event loop, client connections, upstream
//! connections and router. See the crate docs for the design.

mod client;
mod upstream;

use crate::stats::{Counters, Shared, UpDelta};
use crate::Config;
use mbal_cluster::{key_hash, ClusterMap, Health, Leases, Owner, Redirect, Router, Split};
use mbal_member::pipe::{fill, would_block, InFlight, Pipes, State, BACKOFF_MIN, BIN, BIN_NOOP};
use mbal_proto::client::{Expect, Frame};
use mbal_proto::meta::{meta_key, MetaKind};
use mbal_proto::text::TextCmd;
use mbal_proto::{Limits, Parsed, Protocol, Request};
use mbal_tls::Stream;
use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token, Waker};
use slab::Slab;
use std::collections::VecDeque;
use std::io::{self, Write};
use std::net::{SocketAddr, TcpListener as StdListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

const LISTENER: Token = Token(0);
const WAKER: Token = Token(1);
const CLIENT_BASE: usize = 2;
const UP_BASE: usize = 1 << 30;
/// Spare buffers kept for reuse (see [`Engine::bufs`]): at most this many,
/// each of at most `SPARE_CAP` bytes.
const SPARE_BUFS: usize = 256;
const SPARE_CAP: usize = 4096;
/// Replies of a read batch are held until the whole batch is answered, up to
/// this many bytes (then what is complete is written: a long pipeline's first
/// replies do not wait for all of it).
const EARLY_FLUSH: usize = 32 << 10;
/// Where a map fetch goes when no coordinator answered it: the one a server failure starts
/// (another server than the failed one), or the one a redirect starts (the redirecting worker).
#[derive(Clone, Copy, Debug)]
enum MapFallback {
    Refresh(u16),
    From(Owner),
}

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
    /// The client read this request arrived in ([`Client::batch`]): a read
    /// batch's replies are written together (see `flush_clients`).
    batch: u64,
}

/// The values of a multi-get, put back in request order.
struct Multi {
    /// Per key position: (start, len) of its VALUE block in `arena`; len 0 = miss.
    spans: Vec<(u32, u32)>,
    arena: Vec<u8>,
}

struct Client {
    sock: Stream<TcpStream>,
    id: u64,
    /// Input: `rbuf[rpos..rend]` is unread (see [`fill`]).
    rbuf: Vec<u8>,
    rpos: usize,
    rend: usize,
    /// Bytes of a refused request still to be dropped as they arrive.
    swallow: usize,
    wbuf: Vec<u8>,
    wpos: usize,
    /// `wbuf[..wend]` may be written: it ends at a read batch's last reply
    /// (the rest waits for the other replies of its batch).
    wend: usize,
    /// The current read batch: bumped by every read of the socket (and by
    /// every resumed parse of what is buffered).
    batch: u64,
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
    /// Phase 1 leases learned from `RH hot` hints for this connection's reads (the routing
    /// client's cache, one per client connection as one per routing client: each connection
    /// draws its own copy of a hot key, so a proxy thread's clients spread over the copies).
    leases: Leases,
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
    /// A single-key `get` sent to a hot key's copy (not its home): the
    /// key's hash. On `RD`, an error or a failed upstream it is resent home.
    copy: Option<u64>,
    /// It waited once for a map fetch after its server could not be reached
    /// (`Engine::wait_for_map`); the next time it is answered as unreachable.
    waited_map: bool,
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

impl InFlight for Inflight {
    fn sent(&self) -> Instant {
        self.sent
    }
}

/// What the proxy keeps of each upstream connection beside the connection
/// itself (`mbal_member::pipe`, the server's forwarder's kind too).
struct UpExtra {
    /// The address as text, for the stats.
    addr_s: String,
    delta: UpDelta,
}

/// A thing to do once the current upstream's replies are read.
enum After {
    Resend(Inflight),
    Done {
        client: usize,
        cid: u64,
        seq: u64,
    },
    /// `mbal map <epoch>`'s answer: its epoch and JSON (empty: no newer than the router's).
    InstallMap(u64, Vec<u8>),
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
    /// Seeds each client connection's Phase 1 lease cache ([`Client::leases`]).
    lease_seed: u64,
    clients: Slab<Client>,
    next_cid: u64,
    /// The upstream connections, one per owner (dials that need more than
    /// a TCP connect run on a helper thread; the waker wakes the loop).
    ups: Pipes<Inflight, UpExtra>,
    dirty_clients: Vec<usize>,
    resume: Vec<usize>,
    fetching_map: bool,
    /// Requests for a server that could not be reached, waiting for the map fetch in
    /// flight (`wait_for_map`): sent again on the map it brings, or answered as unreachable.
    waiting_map: Vec<Inflight>,
    /// The coordinators' map fetcher (`--coordinator`, or the cluster file's), and what to
    /// fetch from a server instead if no coordinator answers the fetch in flight.
    coord: Option<crate::coord::Fetcher>,
    coord_fallback: Option<MapFallback>,
    /// Servers that could not be reached, their backoff, and when to refresh the map
    /// (shared with the routing client).
    health: Health,
    counters: Counters,
    split: Split,
    hashes: Vec<u64>,
    after: Vec<After>,
    /// Spare buffers (empty, capacity kept): the request copies of finished
    /// upstream requests and the reply buffers of written slots, handed out
    /// again for the next ones, so that a single-key request allocates nothing
    /// in the steady state.
    bufs: Vec<Vec<u8>>,
    /// Spare multi-get reassemblies (empty, capacity kept), as `bufs`.
    multis: Vec<Multi>,
    /// A multi-get's keys as (offset, length) in its key list: the list is parsed once.
    key_spans: Vec<(u32, u32)>,
    /// The time the last poll returned: request times are taken at round
    /// granularity (one clock read per round).
    now: Instant,
}

/// A seed that differs between proxy threads and processes, so that they
/// spread their leases over a key's copies.
fn lease_seed(thread: usize) -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one((std::process::id(), thread))
}

/// Spare multi-get reassemblies kept for reuse: at most this many, each arena of at most
/// `SPARE_ARENA` bytes.
const SPARE_MULTIS: usize = 64;
const SPARE_ARENA: usize = 256 << 10;

impl Multi {
    /// A reassembly for `keys` keys, from the spares if there is one.
    fn take(spares: &mut Vec<Multi>, keys: usize) -> Box<Multi> {
        let mut m = spares.pop().unwrap_or(Multi { spans: Vec::new(), arena: Vec::new() });
        m.spans.resize(keys, (0, 0));
        Box::new(m)
    }

    /// Keep a finished reassembly for the next multi-get if it is not large.
    fn recycle(spares: &mut Vec<Multi>, mut m: Multi) {
        if m.arena.capacity() <= SPARE_ARENA && spares.len() < SPARE_MULTIS {
            m.spans.clear();
            m.arena.clear();
            spares.push(m);
        }
    }
}

/// Keep `b` in `bufs` for reuse if it is small and there is room.
fn recycle(bufs: &mut Vec<Vec<u8>>, mut b: Vec<u8>) {
    if b.capacity() != 0 && b.capacity() <= SPARE_CAP && bufs.len() < SPARE_BUFS {
        b.clear();
        bufs.push(b);
    }
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
        let coord = match &cfg.coordinators {
            Some(c) if !c.addrs.is_empty() => Some(crate::coord::Fetcher::start(id, c.clone(), waker.clone())?),
            _ => None,
        };
        let wake = waker.clone();
        let ups = Pipes::new(
            cfg.dialer.clone(),
            UP_BASE,
            "mbal-proxy-dial",
            Arc::new(move || {
                let _ = wake.wake();
            }),
        );
        let e = Engine {
            coord,
            coord_fallback: None,
            id,
            poll,
            listener,
            cfg,
            shared,
            stop,
            limits,
            router: Router::new(map),
            lease_seed: lease_seed(id),
            clients: Slab::new(),
            next_cid: 1,
            ups,
            dirty_clients: Vec::new(),
            resume: Vec::new(),
            fetching_map: false,
            waiting_map: Vec::new(),
            health: Health::new(),
            counters: Counters::default(),
            split: Split::new(),
            hashes: Vec::new(),
            after: Vec::new(),
            bufs: Vec::new(),
            multis: Vec::new(),
            key_spans: Vec::new(),
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
                            self.ups.mark(ui);
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
            self.take_dialed();
            self.take_coordinator_map();
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
        let dirty = self.ups.iter().any(|u| !u.extra.delta.is_empty())
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
        for u in self.ups.iter_mut() {
            if !u.extra.delta.is_empty() {
                t.publish(u.owner, &u.extra.addr_s, &mut u.extra.delta);
            }
        }
    }

    // ---- clients ----

    // ---- upstreams ----

    // ---- replies to clients ----
}
