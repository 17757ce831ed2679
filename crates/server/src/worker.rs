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

mod conn;
mod group;
mod hot;
mod inbox;
mod migrate;
mod watch;

pub(crate) use group::{run_host, Handoff};
pub(crate) use hot::{copy_writes, flush_hot};
pub(crate) use inbox::exec_ctx;
pub(crate) use migrate::EXPORT_BUDGET;

use crate::capacity::Capacity;
use crate::config::Binding;
use crate::dispatch::{self, text_key, Action, Route};
use crate::exec::{self, locate, Ctx};
use crate::moves::{self, Parked, Tables};
use crate::msg::CtlMsg;
use crate::msg::{Envelope, FwdKind, FwdReq, HandOff, Mailbox, Outbox, ReplyTo, ReqBatch, StoreFields, NO_CACHELET};
use crate::near::{Near, NearWorker};
use crate::output::{Gather, Output, Slot, StatsFormat, MAX_PENDING_OUTPUT};
use crate::readbuf::ReadBuf;
use crate::replica::{Replicas, ShadowTable};
use crate::shared::Shared;
use crate::stats::{self, BinSink, CacheletInfo, ConnInfo, Counters, ProcessInfo, TextSink, WorkerSnapshot};
use crossbeam_channel::Receiver;
use mbal_balance::{CacheletSample, WorkerSample};
use mbal_cluster::{KeySpace, Owner};
use mbal_engine::Shard;
use mbal_proto::binary::{opcode as op, status as st, write_response};
use mbal_proto::meta::meta_key;
use mbal_proto::text::{LineState, TextCmd};
use mbal_proto::{Limits, Parsed, Protocol, Request};
use mbal_store::WorkerStore;
use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token};
use slab::Slab;
use std::collections::VecDeque;
use std::io::{self, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

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

/// The answer to a connection over `--max-conns-per-ip` (then it is closed).
pub(crate) const TOO_MANY_FROM_IP: &[u8] = b"ERROR Too many open connections from this address\r\n";

/// A connection's socket, plain or TLS (`mbal_tls::Stream`: one match per read or write).
pub(crate) type ConnStream = mbal_tls::Stream<TcpStream>;

struct Conn {
    sock: ConnStream,
    id: u64,
    gen: u64,
    peer: SocketAddr,
    listen_addr: SocketAddr,
    proto: Option<Protocol>,
    rbuf: ReadBuf,
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
    /// Opted in with `mbal hello <epoch> <worker> threads`: also served the keys of the
    /// workers on its worker's thread (`dispatch::Route::takes`).
    by_thread: bool,
    /// A cluster peer's replicator (`mbal replicator`): not held back by the
    /// emulated capacity, which models client load.
    exempt: bool,
    /// Has sent nothing but `mbal` extension commands yet (a routing
    /// client's hello, a peer's authentication): not held back by the
    /// emulated capacity either, so a saturated worker still lets a peer in.
    fresh: bool,
    /// Waiting for the worker's emulated capacity (in `Worker::throttled`).
    throttled: bool,
    /// Data-plane authentication and control-plane standing.
    auth: crate::auth::ConnAuth,
    /// When (`Shared::clock_ns`) the connection last stopped short of a
    /// complete request (0: it has none pending), for `--request-timeout-ms`.
    partial_since: u64,
    /// After the stop (`crate::life`): the bytes it may still read, those that had arrived
    /// when the worker saw the stop (`None`: running, or not counted yet).
    budget: Option<usize>,
    /// After the stop, answered in full with input left unread: half-closed, its input
    /// read and dropped until the client closes (a close with input unread would reset the
    /// connection and could lose the replies still in flight).
    half_closed: bool,
    /// `watch`: a log stream of these categories (`mbal_store::log`); its input is ignored.
    watching: Option<u8>,
    /// `watch`: the workers that have not yet said they log for it; its `OK` waits for
    /// them, so that every event after the `OK` reaches it.
    watch_pending: usize,
}

pub(crate) struct Worker {
    id: usize,
    shared: Arc<Shared>,
    poll: Poll,
    /// This worker's own port, if it has one (`--worker-port-base`).
    own_listener: Option<TcpListener>,
    inbox: Receiver<Envelope>,
    mailbox: Arc<Mailbox>,
    /// The store, the ownership tables (cachelet -> owner and route: this worker's own copy,
    /// which changes only by message, so reading it needs no synchronisation), Phase 1's
    /// tables (hot keys homed here and copies of other servers' keys), the counters and the
    /// emulated capacity (`--worker-capacity`: the token bucket).
    shard: Shard<Parked>,
    conns: Slab<Conn>,
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
    self_stats: Vec<(usize, u64, crate::msg::Want)>,
    /// For the controller's samples (`WorkerSample`): time spent working
    /// (outside the poll wait), batches taken in from peers and how long
    /// they waited in the inbox, the longest wait since the last sample.
    busy_ns: u64,
    /// Requests read from this worker's connections (the thread policy's measure).
    requests: u64,
    inbox_batches: u64,
    inbox_wait_ns: u64,
    inbox_wait_max_ns: u64,
    /// Emulated capacity (`--worker-capacity`): the connections waiting for the shard's
    /// token bucket (their input stays in their sockets) and the inbox's envelopes held back
    /// behind a peer's batch that waits for it (in arrival order: see `hold`).
    throttled: Vec<usize>,
    /// Connections that ran out of credit after executing requests this
    /// round: at the next refill they are queued after `throttled` (those
    /// that got none), so that of two backlogged connections the one that
    /// spent the last credit does not go first again (it starved the other).
    spent: Vec<usize>,
    held: VecDeque<Envelope>,
    /// Where the front of `held`, a batch cut short, resumes.
    held_pos: usize,
    /// Bytes of unparsed input a connection may hold (`--max-input-buffer`).
    input_cap: usize,
    /// Requests for keys other servers own, for the forwarder (`--forward`),
    /// handed over at the end of the round.
    fwd: Vec<crate::msg::forward::Job>,
    /// The stop was seen (`drain`), and this worker has drained.
    stopping: bool,
    drained: bool,
    /// Every watching connection of the server (`watch`): where this worker's log lines go.
    watchers: Vec<watch::Watcher>,
    /// The cachelet this worker is moving to another server (`migrate`).
    outgoing: Option<migrate::Outgoing>,
    /// Cachelets arriving from other servers, by id (`migrate`).
    staged: std::collections::HashMap<u32, migrate::Staged>,
    /// The last moves whose cachelet arrived here (their `mbal import commit` is answered OK).
    arrived: VecDeque<u64>,
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
        let tables = Tables::new(owners, shared.server_id, id);
        let workers = shared.settings.threads;
        let limits = Limits { max_item_size: shared.settings.max_item_size, ..Limits::default() };
        let mut store = store;
        let hot = &shared.settings.hot;
        let mut replicas = Replicas::default();
        if shared.replicator.is_some() {
            // Sample for the tracker; hold other servers' copies.
            store.watch().set_sampling(hot.policy.sample_rate, 1 << 16, id as u64 + 1);
            replicas.shadow = ShadowTable::with_cap(hot.memory / workers.max(1));
            replicas.hot.lease_cap_ms = hot.lease_ms();
        }
        Ok(Worker {
            id,
            poll,
            own_listener,
            inbox,
            mailbox,
            shard: Shard::new(
                store,
                tables,
                replicas,
                Capacity::new(shared.settings.worker_capacity, shared.clock_ns()),
            ),
            conns: Slab::with_capacity(64),
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
            requests: 0,
            inbox_batches: 0,
            inbox_wait_ns: 0,
            inbox_wait_max_ns: 0,
            throttled: Vec::new(),
            spent: Vec::new(),
            held: VecDeque::new(),
            held_pos: 0,
            fwd: Vec::new(),
            stopping: false,
            drained: false,
            watchers: Vec::new(),
            outgoing: None,
            staged: Default::default(),
            arrived: VecDeque::new(),
            input_cap: match shared.settings.max_input_buffer {
                0 => limits.max_item_size + limits.max_line + READ_CHUNK,
                n => n,
            },
            shared,
        })
    }

    /// This worker, lent for a round to another worker of its thread (`near`); `None` if its
    /// requests must come by message (emulated capacity, or writes that wait for copies).
    fn lend(&mut self) -> Option<NearWorker<'_>> {
        if self.shard.capacity.limited() || (self.shared.settings.hot.may_sync() && !self.shard.replicas.hot.is_empty())
        {
            return None;
        }
        Some(NearWorker {
            id: self.id,
            store: &mut self.shard.store,
            counters: &mut self.shard.counters,
            hot: &mut self.shard.replicas.hot,
            tables: &self.shard.tables,
            inbox_empty: self.inbox.is_empty(),
        })
    }

    /// How long the worker may block, at most `limit`: out of emulated capacity with work
    /// waiting, it sleeps until the bucket has credit again, no longer (and never spins).
    fn sleep_limit(&self, limit: Duration) -> Duration {
        if !self.throttled.is_empty() || !self.spent.is_empty() || !self.held.is_empty() {
            limit.min(self.shard.capacity.wait())
        } else {
            limit
        }
    }

    /// Fencing judged again after input was read (`on_readable`) or taken from the inbox: the
    /// round's check came before, and a process paused in between (SIGSTOP, a long preemption)
    /// reads bytes that arrived after its lease ran out, when the coordinator may already have
    /// given the cachelets away. What is executed is judged at a time after it was received.
    /// Without a coordinator the lease never ends (`u64::MAX`) and no clock is read.
    pub(super) fn refence(&mut self, now_ns: Option<u64>) {
        let until = self.shared.lease_until_ns.load(Ordering::Relaxed);
        if until != u64::MAX && !self.shard.tables.fenced {
            self.shard.tables.fenced = now_ns.unwrap_or_else(|| self.shared.clock_ns()) >= until;
        }
    }

    /// One round of the event loop: poll for `poll` at most (`None`: do not poll, the
    /// caller knows there are no socket events), handle the events, the connections left
    /// ready, the inbox, write the connections that got replies, send the peers their
    /// batches. Returns whether there was anything to do, `None` once the server stops.
    fn round(
        &mut self,
        events: &mut Events,
        poll: Option<Duration>,
        last_sweep: &mut u64,
        near: &mut Near,
    ) -> Option<bool> {
        match poll {
            Some(timeout) => {
                let polled = self.poll.poll(events, Some(timeout));
                self.mailbox.awake();
                if let Err(e) = polled {
                    if e.kind() != io::ErrorKind::Interrupted {
                        tracing::error!(worker = self.id, "poll failed: {e}");
                        return None;
                    }
                }
            }
            None => events.clear(),
        }
        let worked = !events.is_empty() || !self.ready.is_empty() || !self.inbox.is_empty();
        let round_start = self.shared.clock_ns();
        self.now = (round_start / 1_000_000_000) as u32;
        // Fencing: past the lease from the coordinator, this worker serves none of the
        // server's cachelets until the lease is renewed (checked before anything is read).
        self.shard.tables.fenced = round_start >= self.shared.lease_until_ns.load(Ordering::Relaxed);
        if self.shard.capacity.limited() {
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
                        if !self.conns.contains(ci) {
                            // The write failed and closed it (a client gone with replies
                            // unread).
                            continue;
                        }
                    }
                    if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                        self.on_readable(ci, near);
                    }
                }
            }
        }
        self.run_ready(near);
        // After the connections: what `drain_inbox` sends at once (a released cachelet's
        // `Adopt`) must not reach a neighbour whose inbox this round's `near` saw empty.
        self.drain_inbox();
        if !self.shard.store.log().is_empty() {
            self.ship_log();
        }
        if self.shard.store.watch().has_dirty() {
            let (shared, store, hot) = (&self.shared, &mut self.shard.store, &mut self.shard.replicas.hot);
            hot::copy_writes(shared, self.id, store, hot, self.now, None);
        }
        self.flush_dirty();
        let round_end = self.shared.clock_ns();
        if worked {
            self.busy_ns += round_end.saturating_sub(round_start);
        }
        self.shared.peers().send_all(self.id, &mut self.outbox, round_end);
        if !self.fwd.is_empty() {
            if let Some(f) = &self.shared.forward {
                f.send(std::mem::take(&mut self.fwd));
            }
        }
        if self.shared.shutdown.load(Ordering::Relaxed) && !self.drain() {
            return None;
        }
        if round_end.saturating_sub(*last_sweep) >= 50_000_000 {
            *last_sweep = round_end;
            self.housekeeping();
            self.check_alarm();
        }
        Some(worked)
    }

    /// The stop's drain (`crate::life`), once a round after the stop: each connection reads
    /// what had arrived when this worker first saw the stop, and closes once all of it is
    /// answered and written; false once the drain is over (every worker drained, or its
    /// bound passed).
    fn drain(&mut self) -> bool {
        use std::os::fd::AsRawFd;
        if !self.stopping {
            self.stopping = true;
            if let Some(mut l) = self.own_listener.take() {
                let _ = self.poll.registry().deregister(&mut l);
            }
        }
        let ids: Vec<usize> = self.conns.iter().map(|(ci, _)| ci).collect();
        for ci in ids {
            let c = &mut self.conns[ci];
            let fd = c.sock.sock().as_raw_fd();
            if c.budget.is_none() {
                c.budget = Some(crate::life::unread(fd));
                self.requeue(ci);
                continue;
            }
            let answered = c.budget == Some(0)
                && !c.queued
                && !c.read_blocked
                && !c.throttled
                && !c.output.waiting()
                && c.output.sent == c.output.out.len()
                && !c.sock.wants_write();
            if c.half_closed || !answered {
                continue;
            }
            if crate::life::unread(fd) == 0 {
                self.close(ci);
            } else {
                c.half_closed = true;
                c.sock.close_notify();
                let _ = c.sock.sock().shutdown(std::net::Shutdown::Write);
                self.discard(ci);
            }
        }
        if !self.drained && self.conns.is_empty() && self.inflight == 0 && self.fwd.is_empty() {
            self.drained = true;
            if self.shared.life.drained() {
                self.shared.wake_all();
            }
        }
        if self.shared.life.over(self.shared.clock_ns()) {
            // The last to drain woke the others; at the bound, the first to see it does.
            self.shared.wake_all();
            return false;
        }
        true
    }

    /// Periodic work off the request path: expiry sweep, idle timeouts.
    fn housekeeping(&mut self) {
        self.shard.store.sweep(self.now, 256);
        self.expire_staged();
        if !self.shard.replicas.shadow.is_empty() {
            self.shard.replicas.shadow.sweep(self.shared.clock_ns());
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
                self.shard.counters.idle_kicks += 1;
                self.close(ci);
            }
        }
        let timeout_ns = self.shared.settings.request_timeout_ms.saturating_mul(1_000_000);
        if timeout_ns > 0 {
            let now = self.shared.clock_ns();
            let slow: Vec<usize> = self
                .conns
                .iter()
                .filter(|(_, c)| c.partial_since != 0 && now.saturating_sub(c.partial_since) > timeout_ns)
                .map(|(i, _)| i)
                .collect();
            for ci in slow {
                // A slow sender: say why (text), best effort, and close.
                self.shard.counters.request_timeouts += 1;
                let c = &mut self.conns[ci];
                if c.proto == Some(Protocol::Text) {
                    let _ = c.sock.write(b"SERVER_ERROR timed out waiting for the rest of the request\r\n");
                }
                self.close(ci);
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
