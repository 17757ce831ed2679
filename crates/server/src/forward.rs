//! The forwarder (`--forward`): the thread that passes a plain client's
//! requests for keys another server of the cluster owns to that server, and
//! brings each answer back to the asking connection's output slot.
//!
//! Workers hand it [`Job`]s (one request each, batched per worker and loop
//! round, like their messages to each other) on one channel, waking it only
//! when it sleeps ([`Mailbox`]). It has its own mio loop and keeps one
//! routed connection per owning worker of another server (`mbal hello
//! <epoch> <worker>`, so the request lands on the owner with no hop) and
//! one plain binary connection per server for the binary protocol (binary
//! connections do not opt in to routing: the server passes each request to
//! its owner). Requests are pipelined: written back to back in the order
//! the jobs came, the replies read in that order. A request whose reply the
//! server may not send (text `noreply`, meta `q`, a quiet binary opcode) is
//! followed by `mn` (binary: `NOOP`), whose answer is not passed on.
//!
//! Each answer goes back to the asking worker as a reply in a `Replies`
//! batch (one per worker and round), exactly like a peer worker's answer:
//! the worker fills the connection's `Slot::Wait`, so replies leave in
//! request order whatever answered them. Nothing but messages crosses
//! threads, and no worker waits.
//!
//! Routing is the shared [`Router`]'s: a job goes where the router says the
//! key's cachelet lives; an `RD` (the cachelet moved) is learned and the
//! request resent, at most `mbal_cluster::MAX_REDIRECTS` times (the one rule).
//!
//! Failure: a connection that fails, closes, or leaves its oldest request
//! unanswered for `--forward-timeout-ms` is dropped and every request in
//! flight on it is answered with an error; requests for that owner during
//! its backoff (10 ms, doubling up to 1 s) are answered the same at once;
//! the first after the backoff reconnects. A text or meta request gets
//! `SERVER_ERROR forwarding failed: ...` (a text `noreply` one nothing), a
//! binary one status 0x86 (temporary failure); a multi-key `get` whose keys
//! span servers gets the unreachable server's keys as misses.

use crate::msg::forward::{ForwardHandle, ForwardStats, Job, Kind};
use crate::msg::{Envelope, Mailbox, ReplyBatch, ReplyTo, NO_CACHELET};
use crate::shared::Shared;
use crossbeam_channel::Receiver;
use mbal_cluster::{ClusterMap, Owner, Redirect, Router};
use mbal_member::dial::Proto;
use mbal_proto::binary::{opcode as op, write_response, BinHeader, HEADER_LEN, MAGIC_RESPONSE};
use mbal_proto::client::{Decoder, Expect, Frame};
use mio::net::TcpStream;
use mio::{Events, Interest, Poll, Token, Waker};
use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

const WAKER: Token = Token(usize::MAX);
const BACKOFF_MIN: Duration = Duration::from_millis(10);
const BACKOFF_MAX: Duration = Duration::from_secs(1);
/// Redirects followed per request before it fails.
/// The "worker" of a server's binary connection (its main port).
const BIN: u16 = u16::MAX;
const BIN_NOOP: [u8; 24] = [0x80, op::NOOP, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
/// Binary status "temporary failure".
const BIN_FAILED: u16 = 0x86;
const READ_CHUNK: usize = 64 * 1024;

/// The forwarder's end of its channel: its poll, jobs and mailbox.
pub(crate) type Parts = (Poll, Receiver<Vec<Job>>, Arc<Mailbox>);

/// Build the forwarder's channel and poll; the handle goes into `Shared`,
/// the parts into [`Forwarder::new`] once `Shared` exists.
pub(crate) fn channel() -> io::Result<(ForwardHandle, Parts)> {
    let poll = Poll::new()?;
    let mailbox = Arc::new(Mailbox::new(Waker::new(poll.registry(), WAKER)?));
    let (tx, rx) = crossbeam_channel::unbounded();
    let handle = ForwardHandle {
        tx,
        mailbox: mailbox.clone(),
        stats: ForwardStats::default(),
        map: Default::default(),
        has_map: Default::default(),
    };
    Ok((handle, (poll, rx, mailbox)))
}

/// A request on an upstream connection, waiting for its reply.
struct Sent {
    to: ReplyTo,
    hash: u64,
    kind: Kind,
    req: Vec<u8>,
    /// `mbal hello` on a new connection (no client waits).
    hello: bool,
    /// The reply so far.
    buf: Vec<u8>,
    sent: Instant,
    hops: u8,
    rd: Option<Redirect>,
}

impl Sent {
    fn quiet(&self) -> bool {
        matches!(self.kind, Kind::Line { quiet: true, .. } | Kind::Bin { quiet: true })
    }

    fn expect(&self) -> Expect {
        if self.hello {
            return Expect::Line;
        }
        match self.kind {
            Kind::Line { quiet: true, .. } => Expect::Meta,
            Kind::Line { expect, .. } => expect,
            Kind::Values { .. } => Expect::Values,
            Kind::Bin { .. } => Expect::Line,
        }
    }
}

enum State {
    Idle,
    Up,
    Down { until: Instant },
}

struct Upstream {
    owner: Owner,
    sock: Option<mbal_tls::Stream<TcpStream>>,
    state: State,
    backoff: Duration,
    wbuf: Vec<u8>,
    wpos: usize,
    rbuf: Vec<u8>,
    dec: Decoder,
    inflight: VecDeque<Sent>,
    dirty: bool,
    /// Bumped by every connect and every drop: a dial finished by a helper
    /// thread for an older generation is discarded.
    gen: u64,
}

/// A dial done off the loop (TLS handshake, login): (upstream, generation,
/// the connection).
type Dialed = (usize, u64, io::Result<mbal_tls::Stream<std::net::TcpStream>>);

pub(crate) struct Forwarder {
    shared: Arc<Shared>,
    poll: Poll,
    jobs: Receiver<Vec<Job>>,
    mailbox: Arc<Mailbox>,
    router: Router,
    timeout: Duration,
    /// TLS and the cluster secret's login, when the cluster has them.
    dialer: mbal_member::dial::Dialer,
    ups: Vec<Upstream>,
    up_of: HashMap<Owner, usize>,
    dirty: Vec<usize>,
    /// Answers for each worker, sent once per round.
    replies: Vec<ReplyBatch>,
    chunk: Box<[u8]>,
    now: Instant,
    /// Dials that need more than a TCP connect run on a helper thread and
    /// come back here (the mailbox's waker wakes the loop).
    dialed_tx: std::sync::mpsc::Sender<Dialed>,
    dialed_rx: std::sync::mpsc::Receiver<Dialed>,
}

fn would_block(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::WouldBlock
}

impl Forwarder {
    pub(crate) fn new(shared: Arc<Shared>, (poll, jobs, mailbox): Parts, map: ClusterMap) -> Forwarder {
        let timeout = Duration::from_millis(shared.settings.forward_timeout_ms.max(1));
        let workers = shared.settings.threads;
        let (dialed_tx, dialed_rx) = std::sync::mpsc::channel();
        Forwarder {
            dialed_tx,
            dialed_rx,
            dialer: shared.settings.peer_dialer(timeout),
            shared,
            poll,
            jobs,
            mailbox,
            router: Router::new(map),
            timeout,
            ups: Vec::new(),
            up_of: HashMap::new(),
            dirty: Vec::new(),
            replies: (0..workers).map(|_| ReplyBatch::default()).collect(),
            chunk: vec![0u8; READ_CHUNK].into_boxed_slice(),
            now: Instant::now(),
        }
    }

    /// A newer map from the coordinator (`ForwardHandle::new_map`): route by it from now on.
    fn take_map(&mut self) {
        let Some(h) = self.shared.forward.as_ref() else { return };
        if !h.has_map.swap(false, Ordering::Acquire) {
            return;
        }
        if let Some(m) = h.map.lock().unwrap_or_else(|p| p.into_inner()).take() {
            if let Err(e) = self.router.install_map(m) {
                tracing::warn!("forwarder: the coordinator's map: {e}");
            }
        }
    }

    pub(crate) fn run(mut self) {
        let mut events = Events::with_capacity(256);
        loop {
            // Until the stop's drain is over: draining workers wait for its answers.
            if self.shared.stopped() {
                return;
            }
            let mut timeout = self
                .ups
                .iter()
                .filter_map(|u| u.inflight.front())
                .map(|f| (f.sent + self.timeout).saturating_duration_since(Instant::now()))
                .min()
                .unwrap_or(Duration::from_millis(200))
                .min(Duration::from_millis(200));
            if !self.mailbox.prepare_sleep(&self.jobs) {
                timeout = Duration::ZERO;
            }
            let polled = self.poll.poll(&mut events, Some(timeout));
            self.mailbox.awake();
            if let Err(e) = polled {
                if e.kind() != io::ErrorKind::Interrupted {
                    tracing::error!("forwarder: poll: {e}");
                    return;
                }
            }
            self.now = Instant::now();
            for ev in events.iter() {
                let ui = ev.token().0;
                if ev.token() == WAKER || ui >= self.ups.len() {
                    continue;
                }
                if ev.is_writable() {
                    self.mark(ui);
                }
                if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                    self.read(ui);
                }
            }
            self.take_dialed();
            self.take_map();
            while let Ok(jobs) = self.jobs.try_recv() {
                for job in jobs {
                    let sent = Sent {
                        to: job.to,
                        hash: job.hash,
                        kind: job.kind,
                        req: job.req,
                        hello: false,
                        buf: Vec::new(),
                        sent: self.now,
                        hops: 0,
                        rd: None,
                    };
                    self.route(sent);
                }
            }
            self.check_timeouts();
            self.flush();
            self.answer();
        }
    }

    fn stats(&self) -> &ForwardStats {
        &self.shared.forward.as_ref().expect("the forwarder runs only with --forward").stats
    }

    /// Send each worker its answers of this round.
    fn answer(&mut self) {
        let now = self.shared.clock_ns();
        for (w, b) in self.replies.iter_mut().enumerate() {
            if b.iter().next().is_some() {
                self.shared.peers().send_one(w, Envelope::Replies(std::mem::take(b)), now);
            }
        }
    }

    fn done(&mut self, s: Sent) {
        if s.hello {
            return;
        }
        let to = s.to;
        self.replies[to.worker].push(to, NO_CACHELET, |d| d.extend_from_slice(&s.buf));
    }

    /// Answer a request that could not be forwarded.
    fn fail(&mut self, mut s: Sent, why: &str) {
        if s.hello {
            return;
        }
        self.stats().errors.fetch_add(1, Ordering::Relaxed);
        s.buf.clear();
        match s.kind {
            Kind::Line { silent: true, .. } | Kind::Values { whole: false } => {}
            Kind::Line { .. } | Kind::Values { whole: true } => {
                s.buf.extend_from_slice(b"SERVER_ERROR forwarding failed: ");
                s.buf.extend_from_slice(why.as_bytes());
                s.buf.extend_from_slice(b"\r\n");
            }
            Kind::Bin { .. } => {
                let h = BinHeader::decode(&s.req);
                let msg = format!("forwarding failed: {why}");
                write_response(&mut s.buf, h.opcode, BIN_FAILED, h.opaque, 0, &[], &[], msg.as_bytes());
            }
        }
        self.done(s);
    }

    fn route(&mut self, s: Sent) {
        let (_, mut owner) = self.router.route_hash(s.hash);
        if matches!(s.kind, Kind::Bin { .. }) {
            owner.1 = BIN;
        }
        self.send(owner, s);
    }

    fn upstream(&mut self, owner: Owner) -> usize {
        if let Some(&ui) = self.up_of.get(&owner) {
            return ui;
        }
        self.ups.push(Upstream {
            owner,
            sock: None,
            state: State::Idle,
            backoff: BACKOFF_MIN,
            wbuf: Vec::new(),
            wpos: 0,
            rbuf: Vec::new(),
            dec: Decoder::new(),
            inflight: VecDeque::new(),
            dirty: false,
            gen: 0,
        });
        self.up_of.insert(owner, self.ups.len() - 1);
        self.ups.len() - 1
    }

    fn mark(&mut self, ui: usize) {
        if !self.ups[ui].dirty {
            self.ups[ui].dirty = true;
            self.dirty.push(ui);
        }
    }

    fn send(&mut self, owner: Owner, mut s: Sent) {
        let known = if owner.1 == BIN {
            (owner.0 as usize) < self.router.map().servers().len()
        } else {
            self.router.map().has_worker(owner)
        };
        if !known {
            return self.fail(s, "owner not in the cluster map");
        }
        let ui = self.upstream(owner);
        match self.ups[ui].state {
            State::Up => {}
            State::Down { until } if self.now < until => return self.fail(s, "owner unavailable"),
            State::Down { .. } | State::Idle => {
                if let Err(e) = self.connect(ui) {
                    tracing::debug!(server = owner.0, worker = owner.1, "forwarder: connect: {e}");
                    self.down(ui, "owner unavailable");
                    return self.fail(s, "owner unavailable");
                }
            }
        }
        self.stats().requests.fetch_add(1, Ordering::Relaxed);
        s.sent = self.now;
        let u = &mut self.ups[ui];
        u.wbuf.extend_from_slice(&s.req);
        match s.kind {
            Kind::Line { quiet: true, .. } => u.wbuf.extend_from_slice(b"mn\r\n"),
            Kind::Bin { quiet: true } => u.wbuf.extend_from_slice(&BIN_NOOP),
            _ => {}
        }
        u.inflight.push_back(s);
        self.mark(ui);
    }

    fn connect(&mut self, ui: usize) -> io::Result<()> {
        let (server, worker) = self.ups[ui].owner;
        let addr = if worker == BIN {
            self.router.map().servers()[server as usize].main
        } else {
            self.router.map().worker_addr(server, worker)
        };
        let proto = if worker == BIN { Proto::Binary } else { Proto::Text };
        self.ups[ui].gen += 1;
        let sock = if self.dialer.is_plain(proto) {
            let mut sock = mbal_tls::Stream::Plain(TcpStream::connect(addr)?);
            let _ = sock.sock().set_nodelay(true);
            self.poll.registry().register(sock.sock_mut(), Token(ui), Interest::READABLE | Interest::WRITABLE)?;
            Some(sock)
        } else {
            // TLS and/or the cluster secret's login: a helper thread dials
            // (blocking, within the forward timeout) while requests queue
            // here; `take_dialed` hands the connection to the loop.
            let (dialer, gen, tx) = (self.dialer.clone(), self.ups[ui].gen, self.dialed_tx.clone());
            let mailbox = self.mailbox.clone();
            std::thread::Builder::new().name("mbal-fwd-dial".into()).spawn(move || {
                let r = dialer.dial_nonblocking(addr, proto);
                if tx.send((ui, gen, r)).is_ok() {
                    mailbox.wake();
                }
            })?;
            None
        };
        self.stats().connects.fetch_add(1, Ordering::Relaxed);
        let epoch = self.router.map().epoch();
        let u = &mut self.ups[ui];
        u.sock = sock;
        u.state = State::Up;
        u.wbuf.clear();
        u.wpos = 0;
        u.rbuf.clear();
        u.dec = Decoder::new();
        if worker != BIN {
            let hello = format!("mbal hello {epoch} {worker}\r\n").into_bytes();
            u.wbuf.extend_from_slice(&hello);
            u.inflight.push_back(Sent {
                to: ReplyTo { worker: 0, conn: 0, gen: 0, seq: 0 },
                hash: 0,
                kind: Kind::Line { expect: Expect::Line, quiet: false, silent: false },
                req: hello,
                hello: true,
                buf: Vec::new(),
                sent: self.now,
                hops: 0,
                rd: None,
            });
        }
        Ok(())
    }

    /// Connections dialed by helper threads: into the loop, or the owner
    /// down (its requests answered `owner unavailable`).
    fn take_dialed(&mut self) {
        while let Ok((ui, gen, r)) = self.dialed_rx.try_recv() {
            if self.ups[ui].gen != gen {
                continue; // dropped (timed out) meanwhile: the socket closes here
            }
            let registered = r.and_then(|s| {
                let mut s = s.map_sock(TcpStream::from_std);
                self.poll.registry().register(s.sock_mut(), Token(ui), Interest::READABLE | Interest::WRITABLE)?;
                Ok(s)
            });
            match registered {
                Ok(s) => {
                    self.ups[ui].sock = Some(s);
                    self.mark(ui);
                }
                Err(e) => {
                    tracing::debug!(owner = ?self.ups[ui].owner, "forwarder: connect: {e}");
                    self.down(ui, "owner unavailable");
                }
            }
        }
    }

    /// Drop an upstream's connection, fail what is in flight on it, and
    /// refuse requests to it for its backoff.
    fn down(&mut self, ui: usize, why: &str) {
        let u = &mut self.ups[ui];
        // Still dialing: the owner never became available.
        let why = if u.sock.is_none() { "owner unavailable" } else { why };
        u.gen += 1;
        if let Some(mut s) = u.sock.take() {
            let _ = self.poll.registry().deregister(s.sock_mut());
        }
        u.state = State::Down { until: self.now + u.backoff };
        u.backoff = (u.backoff * 2).min(BACKOFF_MAX);
        u.wbuf.clear();
        u.wpos = 0;
        u.rbuf.clear();
        u.dec = Decoder::new();
        let lost: Vec<Sent> = u.inflight.drain(..).collect();
        for s in lost {
            self.fail(s, why);
        }
    }

    fn check_timeouts(&mut self) {
        for ui in 0..self.ups.len() {
            let late = self.ups[ui].inflight.front().is_some_and(|f| self.now.duration_since(f.sent) >= self.timeout);
            if late {
                tracing::debug!(owner = ?self.ups[ui].owner, "forwarder: owner timed out");
                self.stats().timeouts.fetch_add(1, Ordering::Relaxed);
                self.down(ui, "owner timed out");
            }
        }
    }

    fn flush(&mut self) {
        while let Some(ui) = self.dirty.pop() {
            let u = &mut self.ups[ui];
            u.dirty = false;
            let Some(sock) = u.sock.as_mut() else { continue };
            if sock.write_pending(&mut u.wbuf, &mut u.wpos).is_err() {
                self.down(ui, "owner connection failed");
            }
        }
    }

    fn read(&mut self, ui: usize) {
        let mut broken = false;
        {
            let u = &mut self.ups[ui];
            let Some(sock) = u.sock.as_mut() else { return };
            loop {
                match sock.read(&mut self.chunk) {
                    Ok(0) => {
                        broken = true;
                        break;
                    }
                    Ok(n) => u.rbuf.extend_from_slice(&self.chunk[..n]),
                    Err(e) if would_block(&e) => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => {
                        broken = true;
                        break;
                    }
                }
            }
        }
        let bad = if self.ups[ui].owner.1 == BIN { self.decode_bin(ui) } else { self.decode_text(ui) };
        if let Some(why) = bad {
            tracing::debug!(owner = ?self.ups[ui].owner, "forwarder: {why}");
            self.down(ui, "bad reply from owner");
        } else if broken && self.ups[ui].sock.is_some() {
            self.down(ui, "owner closed the connection");
        }
    }

    /// Match a routed connection's replies to its requests in flight;
    /// `Some(why)` when the stream makes no sense.
    fn decode_text(&mut self, ui: usize) -> Option<&'static str> {
        let owner = self.ups[ui].owner;
        let rbuf = std::mem::take(&mut self.ups[ui].rbuf);
        let mut pos = 0;
        let mut finished = Vec::new();
        let mut bad = None;
        loop {
            let u = &mut self.ups[ui];
            let Some(front) = u.inflight.front_mut() else {
                if pos < rbuf.len() {
                    bad = Some("a reply to no request");
                }
                break;
            };
            let quiet = front.quiet();
            let (n, frame) = match u.dec.decode(&rbuf[pos..], front.expect()) {
                Ok(x) => x,
                Err(_) => {
                    bad = Some("an undecodable reply");
                    break;
                }
            };
            let bytes = &rbuf[pos..pos + n];
            pos += n;
            let Some(frame) = frame else { break };
            let mut end = !quiet && frame.ends_reply();
            match frame {
                // hints are for routing clients, never for plain ones
                Frame::Hint(_) => {}
                Frame::Meta { code: [b'M', b'N'], .. } if quiet => end = true,
                Frame::Hello { server, worker, .. } if front.hello => {
                    if (server, worker) != owner {
                        bad = Some("hello answered by another worker");
                        break;
                    }
                    u.backoff = BACKOFF_MIN;
                }
                _ if front.hello => {
                    bad = Some("unexpected answer to mbal hello");
                    break;
                }
                Frame::Redirect { epoch, server, worker } => front.rd = Some(Redirect { epoch, to: (server, worker) }),
                Frame::End { .. } if front.kind == (Kind::Values { whole: false }) => {}
                Frame::Error(_) if front.kind == (Kind::Values { whole: false }) => {
                    // a run of a longer get: its keys are missed
                    if let Some(f) = &self.shared.forward {
                        f.stats.errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
                // text `noreply`: the client reads nothing back
                _ if matches!(front.kind, Kind::Line { silent: true, .. }) => {}
                _ => front.buf.extend_from_slice(bytes),
            }
            if end {
                finished.push(u.inflight.pop_front().expect("the front"));
            }
        }
        let u = &mut self.ups[ui];
        u.rbuf = rbuf;
        u.rbuf.drain(..pos);
        for s in finished {
            if s.rd.is_some() {
                self.redirected(owner, s);
            } else {
                self.done(s);
            }
        }
        bad
    }

    /// Match a binary connection's responses to its requests in flight.
    fn decode_bin(&mut self, ui: usize) -> Option<&'static str> {
        let rbuf = std::mem::take(&mut self.ups[ui].rbuf);
        let mut pos = 0;
        let mut finished = Vec::new();
        let mut bad = None;
        loop {
            let u = &mut self.ups[ui];
            let Some(front) = u.inflight.front_mut() else {
                if pos < rbuf.len() {
                    bad = Some("a response to no request");
                }
                break;
            };
            if rbuf.len() - pos < HEADER_LEN {
                break;
            }
            let h = BinHeader::decode(&rbuf[pos..]);
            if h.magic != MAGIC_RESPONSE {
                bad = Some("not a binary response");
                break;
            }
            let total = HEADER_LEN + h.body_len as usize;
            if rbuf.len() - pos < total {
                break;
            }
            let bytes = &rbuf[pos..pos + total];
            pos += total;
            let quiet = front.quiet();
            let ours = quiet && h.opcode == op::NOOP;
            if !ours {
                front.buf.extend_from_slice(bytes);
            }
            if ours || !quiet {
                u.backoff = BACKOFF_MIN;
                finished.push(u.inflight.pop_front().expect("the front"));
            }
        }
        let u = &mut self.ups[ui];
        u.rbuf = rbuf;
        u.rbuf.drain(..pos);
        for s in finished {
            self.done(s);
        }
        bad
    }

    /// A request came back `RD`: learn where its cachelet went, resend it.
    fn redirected(&mut self, from: Owner, mut s: Sent) {
        let rd = s.rd.take().expect("redirected");
        self.stats().redirects.fetch_add(1, Ordering::Relaxed);
        let follow = mbal_cluster::may_follow_redirect(u32::from(s.hops));
        s.hops += 1;
        s.buf.clear();
        if !follow {
            return self.fail(s, "too many redirects");
        }
        if self.router.learn(from, rd, [s.hash]).is_err() {
            return self.fail(s, "bad redirect");
        }
        self.route(s);
    }
}
