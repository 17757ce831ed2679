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
//! its owner): `mbal_member::pipe`'s connections, the proxy's kind, whose
//! mechanics (dialing, buffers, backoff, deadlines) are there; what a reply
//! means is here. Requests are pipelined: written back to back in the order
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
use mbal_member::pipe::{hello_line, InFlight, Pipes, State, BACKOFF_MIN, BIN, BIN_NOOP};
use mbal_proto::binary::{opcode as op, write_response, BinHeader, HEADER_LEN, MAGIC_RESPONSE};
use mbal_proto::client::{Expect, Frame};
use mio::{Events, Poll, Token, Waker};
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

const WAKER: Token = Token(usize::MAX);
/// Binary status "temporary failure".
const BIN_FAILED: u16 = 0x86;

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

impl InFlight for Sent {
    fn sent(&self) -> Instant {
        self.sent
    }
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

pub(crate) struct Forwarder {
    shared: Arc<Shared>,
    poll: Poll,
    jobs: Receiver<Vec<Job>>,
    mailbox: Arc<Mailbox>,
    router: Router,
    timeout: Duration,
    /// One pipelined connection per owner (`mbal_member::pipe`, the proxy's
    /// too); dials that need more than a TCP connect (TLS, the cluster
    /// secret's login) run on a helper thread, which wakes the loop through
    /// the mailbox.
    ups: Pipes<Sent>,
    /// Answers for each worker, sent once per round.
    replies: Vec<ReplyBatch>,
    now: Instant,
}

impl Forwarder {
    pub(crate) fn new(shared: Arc<Shared>, (poll, jobs, mailbox): Parts, map: ClusterMap) -> Forwarder {
        let timeout = Duration::from_millis(shared.settings.forward_timeout_ms.max(1));
        let workers = shared.settings.threads;
        let wake = mailbox.clone();
        let ups = Pipes::new(shared.settings.peer_dialer(timeout), 0, "mbal-fwd-dial", Arc::new(move || wake.wake()));
        Forwarder {
            shared,
            poll,
            jobs,
            mailbox,
            router: Router::new(map),
            timeout,
            ups,
            replies: (0..workers).map(|_| ReplyBatch::default()).collect(),
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
                .next_deadline(self.timeout)
                .map_or(Duration::from_millis(200), |d| d.saturating_duration_since(Instant::now()))
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
                let Some(ui) = self.ups.of_token(ev.token()) else { continue };
                if ev.is_writable() {
                    self.ups.mark(ui);
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

    fn addr_of(router: &Router, (server, worker): Owner) -> SocketAddr {
        if worker == BIN {
            router.map().servers()[server as usize].main
        } else {
            router.map().worker_addr(server, worker)
        }
    }

    fn upstream(&mut self, owner: Owner) -> usize {
        let router = &self.router;
        self.ups.index_of(owner, || Self::addr_of(router, owner), |_| ())
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
        u.write(&s.req);
        match s.kind {
            Kind::Line { quiet: true, .. } => u.write(b"mn\r\n"),
            Kind::Bin { quiet: true } => u.write(&BIN_NOOP),
            _ => {}
        }
        self.ups.queue(ui, s);
    }

    fn connect(&mut self, ui: usize) -> io::Result<()> {
        let owner = self.ups[ui].owner;
        let addr = Self::addr_of(&self.router, owner);
        self.ups.connect(ui, self.poll.registry(), addr)?;
        self.stats().connects.fetch_add(1, Ordering::Relaxed);
        if owner.1 != BIN {
            let hello = hello_line(self.router.map().epoch(), owner.1);
            let sent = Sent {
                to: ReplyTo { worker: 0, conn: 0, gen: 0, seq: 0 },
                hash: 0,
                kind: Kind::Line { expect: Expect::Line, quiet: false, silent: false },
                req: Vec::new(),
                hello: true,
                buf: Vec::new(),
                sent: self.now,
                hops: 0,
                rd: None,
            };
            self.ups.send(ui, &hello, sent);
        }
        Ok(())
    }

    /// Connections dialed by helper threads: into the loop, or the owner
    /// down (its requests answered `owner unavailable`).
    fn take_dialed(&mut self) {
        while let Some((ui, e)) = self.ups.next_dialed(self.poll.registry()) {
            tracing::debug!(owner = ?self.ups[ui].owner, "forwarder: connect: {e}");
            self.down(ui, "owner unavailable");
        }
    }

    /// Drop an upstream's connection, fail what is in flight on it, and
    /// refuse requests to it for its backoff.
    fn down(&mut self, ui: usize, why: &str) {
        // Still dialing: the owner never became available.
        let why = if self.ups[ui].connected() { why } else { "owner unavailable" };
        for s in self.ups.down(ui, self.poll.registry(), self.now) {
            self.fail(s, why);
        }
    }

    fn check_timeouts(&mut self) {
        for ui in 0..self.ups.len() {
            if self.ups[ui].late(self.now, self.timeout) {
                tracing::debug!(owner = ?self.ups[ui].owner, "forwarder: owner timed out");
                self.stats().timeouts.fetch_add(1, Ordering::Relaxed);
                self.down(ui, "owner timed out");
            }
        }
    }

    fn flush(&mut self) {
        while let Some(ui) = self.ups.flush() {
            self.down(ui, "owner connection failed");
        }
    }

    fn read(&mut self, ui: usize) {
        if !self.ups[ui].connected() {
            return;
        }
        let broken = self.ups[ui].read();
        let bad = if self.ups[ui].owner.1 == BIN { self.decode_bin(ui) } else { self.decode_text(ui) };
        if let Some(why) = bad {
            tracing::debug!(owner = ?self.ups[ui].owner, "forwarder: {why}");
            self.down(ui, "bad reply from owner");
        } else if broken && self.ups[ui].connected() {
            self.down(ui, "owner closed the connection");
        }
    }

    /// Match a routed connection's replies to its requests in flight;
    /// `Some(why)` when the stream makes no sense.
    fn decode_text(&mut self, ui: usize) -> Option<&'static str> {
        let owner = self.ups[ui].owner;
        let mut rx = std::mem::take(&mut self.ups[ui].rx);
        let rbuf = rx.unread();
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
        rx.consume(pos);
        self.ups[ui].rx = rx;
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
        let mut rx = std::mem::take(&mut self.ups[ui].rx);
        let rbuf = rx.unread();
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
        rx.consume(pos);
        self.ups[ui].rx = rx;
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
