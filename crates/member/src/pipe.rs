//! Pipelined connections to cluster members: the one connection type the
//! proxy's threads and the server's forwarder (`--forward`) keep to each
//! owning worker (`mbal hello <epoch> <worker>`, so a request lands on its
//! owner with no hop) and to each server's binary port.
//!
//! A [`Pipe`] carries requests written back to back and replies read in the
//! same order; [`Pipes`] is the set of them one event loop keeps, indexed by
//! owner. What is here is the connection's mechanics, the same for both
//! users: dialing (a TCP connect on the loop, or TLS and the login on a
//! helper thread whose connection comes back through [`Pipes::next_dialed`]),
//! generations (a dial finished for a connection dropped meanwhile is
//! discarded), the write buffer and its flushing, the read buffer and its
//! filling, the backoff after a failure (10 ms, doubling up to 1 s), and the
//! deadline of the oldest request in flight. What a reply means (which
//! request it answers, where the answer goes, redirects, what a failure
//! answers) is the user's: the proxy answers its client connections, the
//! forwarder a worker's connection slot. Both decode replies with
//! `mbal_proto::client::Decoder`, the one codec.

use crate::dial::{Dialer, Proto};
use mbal_cluster::Owner;
use mbal_proto::client::Decoder;
use mbal_tls::Stream;
use mio::net::TcpStream;
use mio::{Interest, Registry, Token};
use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::ops::{Index, IndexMut};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The "worker" of a server's binary connection: a plain connection to its
/// main port, where the server passes each request to the owning worker
/// itself (binary connections do not opt in to routing).
pub const BIN: u16 = u16::MAX;
/// A binary NOOP request, sent after a quiet binary request so that every
/// request in flight has a reply to wait for.
pub const BIN_NOOP: [u8; 24] = [0x80, 0x0a, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
/// The first backoff after a failure, doubled by each failure after it.
pub const BACKOFF_MIN: Duration = Duration::from_millis(10);
pub const BACKOFF_MAX: Duration = Duration::from_secs(1);
/// The read buffer grows by this much, and is refilled when less than half
/// of it is free.
pub const READ_CHUNK: usize = 16 * 1024;

/// A request in flight: when it was written (for the timeout).
pub trait InFlight {
    fn sent(&self) -> Instant;
}

/// Where a connection stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// Never dialed, or dropped without a backoff (its owner's backoff is kept elsewhere).
    Idle,
    /// Connected, or dialing on a helper thread (requests queue meanwhile).
    Up,
    /// Failed: refused until `until`, then dialed again by the next request.
    Down { until: Instant },
}

/// The unread bytes of a connection: `buf[pos..end]`.
#[derive(Default)]
pub struct ReadBuf {
    buf: Vec<u8>,
    pos: usize,
    end: usize,
}

impl ReadBuf {
    /// What has been read and not yet consumed.
    #[inline]
    pub fn unread(&self) -> &[u8] {
        &self.buf[self.pos..self.end]
    }

    /// The first `n` unread bytes are used.
    #[inline]
    pub fn consume(&mut self, n: usize) {
        debug_assert!(self.pos + n <= self.end);
        self.pos += n;
    }

    pub fn clear(&mut self) {
        self.pos = 0;
        self.end = 0;
    }

    /// Read once from `sock` (see [`fill`]).
    pub fn fill(&mut self, sock: &mut Stream<TcpStream>) -> io::Result<(usize, bool)> {
        fill(sock, &mut self.buf, &mut self.pos, &mut self.end)
    }
}

/// Read once into `buf[end..]`, first making room: the unread bytes
/// `buf[pos..end]` move to the front when the free tail is short, and the
/// buffer grows only when they fill most of it (so it is zero-filled once,
/// not on every read). Returns the bytes read and whether that emptied the
/// socket: a read that did not fill the room it was given (for TCP the
/// receive queue is empty; a TLS [`Stream`] reads until the socket would
/// block), so the caller waits for the next readable edge instead of
/// reading again for an EAGAIN.
pub fn fill(
    sock: &mut Stream<TcpStream>,
    buf: &mut Vec<u8>,
    pos: &mut usize,
    end: &mut usize,
) -> io::Result<(usize, bool)> {
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
    let room = buf.len() - *end;
    let n = sock.read(&mut buf[*end..])?;
    *end += n;
    Ok((n, n < room))
}

pub fn would_block(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::WouldBlock
}

/// The `mbal hello` that opens a routed connection to `worker`: the server
/// answers with its `(server, worker)`, which must be the owner dialed.
pub fn hello_line(epoch: u64, worker: u16) -> Vec<u8> {
    format!("mbal hello {epoch} {worker}\r\n").into_bytes()
}

/// One pipelined connection to `owner`, with the requests `T` in flight on
/// it (oldest first) and the user's own per-connection state `X`.
pub struct Pipe<T, X = ()> {
    pub owner: Owner,
    /// The address dialed (the map's, when the connection was made).
    pub addr: SocketAddr,
    pub state: State,
    /// The backoff of the next failure; the user sets it back to
    /// [`BACKOFF_MIN`] when the owner answers.
    pub backoff: Duration,
    /// The reply decoder, whose state spans reads.
    pub dec: Decoder,
    pub inflight: VecDeque<T>,
    /// Read and not yet decoded (the user takes it out while it decodes).
    pub rx: ReadBuf,
    pub extra: X,
    sock: Option<Stream<TcpStream>>,
    wbuf: Vec<u8>,
    wpos: usize,
    dirty: bool,
    /// Bumped by every connect and every drop: a dial finished by a helper
    /// thread for an older generation is discarded.
    gen: u64,
}

impl<T, X> Pipe<T, X> {
    /// Whether there is a socket: false before the first dial, after a drop,
    /// and while a helper thread dials.
    pub fn connected(&self) -> bool {
        self.sock.is_some()
    }

    /// Queue bytes to write (a request, or what follows a quiet one).
    #[inline]
    pub fn write(&mut self, bytes: &[u8]) {
        self.wbuf.extend_from_slice(bytes);
    }

    /// Bytes queued and not yet written.
    pub fn unwritten(&self) -> usize {
        self.wbuf.len() - self.wpos
    }

    /// Read what the socket has into [`Pipe::rx`]; true if the connection is
    /// closed or broken (what was read before that is in `rx` all the same).
    pub fn read(&mut self) -> bool {
        let Some(sock) = self.sock.as_mut() else { return false };
        loop {
            match self.rx.fill(sock) {
                Ok((0, _)) => return true,
                Ok((_, true)) => return false,
                Ok((_, false)) => {}
                Err(e) if would_block(&e) => return false,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return true,
            }
        }
    }
}

impl<T: InFlight, X> Pipe<T, X> {
    /// Whether the oldest request in flight has waited `timeout` by `now`.
    pub fn late(&self, now: Instant, timeout: Duration) -> bool {
        self.inflight.front().is_some_and(|f| now.duration_since(f.sent()) >= timeout)
    }
}

/// A dial done off the loop (TLS handshake, login): (pipe, generation, the connection).
type Dialed = (usize, u64, io::Result<Stream<std::net::TcpStream>>);

/// The pipes one event loop keeps, one per owner, each registered with the
/// loop's poll under `token_base + index`.
pub struct Pipes<T, X = ()> {
    pipes: Vec<Pipe<T, X>>,
    /// A direct table (looked up for every request): `by_owner[server][0]` is
    /// the server's binary pipe, `by_owner[server][1 + w]` worker w's;
    /// `usize::MAX`: none yet.
    by_owner: Vec<Vec<usize>>,
    dirty: Vec<usize>,
    token_base: usize,
    dialer: Dialer,
    /// The helper threads' name.
    dial_thread: &'static str,
    dialed_tx: mpsc::Sender<Dialed>,
    dialed_rx: mpsc::Receiver<Dialed>,
    /// Wakes the loop when a helper thread's dial is done.
    wake: Arc<dyn Fn() + Send + Sync>,
}

impl<T, X> Index<usize> for Pipes<T, X> {
    type Output = Pipe<T, X>;
    #[inline]
    fn index(&self, i: usize) -> &Pipe<T, X> {
        &self.pipes[i]
    }
}

impl<T, X> IndexMut<usize> for Pipes<T, X> {
    #[inline]
    fn index_mut(&mut self, i: usize) -> &mut Pipe<T, X> {
        &mut self.pipes[i]
    }
}

impl<T, X> Pipes<T, X> {
    /// `dialer` dials (plain, or TLS and the login); `wake` wakes the loop
    /// when a helper thread's dial is done.
    pub fn new(
        dialer: Dialer,
        token_base: usize,
        dial_thread: &'static str,
        wake: Arc<dyn Fn() + Send + Sync>,
    ) -> Self {
        let (dialed_tx, dialed_rx) = mpsc::channel();
        Pipes {
            pipes: Vec::new(),
            by_owner: Vec::new(),
            dirty: Vec::new(),
            token_base,
            dialer,
            dial_thread,
            dialed_tx,
            dialed_rx,
            wake,
        }
    }

    pub fn len(&self) -> usize {
        self.pipes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pipes.is_empty()
    }

    pub fn iter(&self) -> std::slice::Iter<'_, Pipe<T, X>> {
        self.pipes.iter()
    }

    pub fn iter_mut(&mut self) -> std::slice::IterMut<'_, Pipe<T, X>> {
        self.pipes.iter_mut()
    }

    /// The pipe a poll token names, if it is one of these.
    #[inline]
    pub fn of_token(&self, t: Token) -> Option<usize> {
        t.0.checked_sub(self.token_base).filter(|&i| i < self.pipes.len())
    }

    fn slot(owner: Owner) -> (usize, usize) {
        (owner.0 as usize, if owner.1 == BIN { 0 } else { owner.1 as usize + 1 })
    }

    /// The pipe of `owner`, made (not dialed) at `addr` if there is none.
    #[inline]
    pub fn index_of(
        &mut self,
        owner: Owner,
        addr: impl FnOnce() -> SocketAddr,
        extra: impl FnOnce(SocketAddr) -> X,
    ) -> usize {
        let (s, w) = Self::slot(owner);
        if let Some(&i) = self.by_owner.get(s).and_then(|row| row.get(w)).filter(|&&i| i != usize::MAX) {
            return i;
        }
        let i = self.pipes.len();
        let addr = addr();
        self.pipes.push(Pipe {
            owner,
            addr,
            state: State::Idle,
            backoff: BACKOFF_MIN,
            dec: Decoder::new(),
            inflight: VecDeque::new(),
            rx: ReadBuf::default(),
            extra: extra(addr),
            sock: None,
            wbuf: Vec::new(),
            wpos: 0,
            dirty: false,
            gen: 0,
        });
        if self.by_owner.len() <= s {
            self.by_owner.resize_with(s + 1, Vec::new);
        }
        let row = &mut self.by_owner[s];
        if row.len() <= w {
            row.resize(w + 1, usize::MAX);
        }
        row[w] = i;
        i
    }

    /// Pipe `i` has bytes to write, or its socket became writable.
    #[inline]
    pub fn mark(&mut self, i: usize) {
        let p = &mut self.pipes[i];
        if !p.dirty {
            p.dirty = true;
            self.dirty.push(i);
        }
    }

    /// Queue a request on pipe `i` (connected or dialing) for the next flush.
    #[inline]
    pub fn send(&mut self, i: usize, req: &[u8], t: T) {
        self.pipes[i].wbuf.extend_from_slice(req);
        self.queue(i, t);
    }

    /// `t` is in flight on pipe `i`, its bytes already written there ([`Pipe::write`]).
    #[inline]
    pub fn queue(&mut self, i: usize, t: T) {
        self.pipes[i].inflight.push_back(t);
        self.mark(i);
    }

    /// Dial pipe `i` at `addr` (the map's address now): a plain connection
    /// at once, registered with `registry`; TLS or a login on a helper
    /// thread (requests queue meanwhile; [`Pipes::next_dialed`] hands it
    /// over). The pipe is `Up` with empty buffers; a routed connection's
    /// hello is the user's to send first. An error: the connect failed (the
    /// pipe has no socket; the user takes it down).
    pub fn connect(&mut self, i: usize, registry: &Registry, addr: SocketAddr) -> io::Result<()> {
        let token = Token(self.token_base + i);
        let p = &mut self.pipes[i];
        p.addr = addr;
        p.gen += 1;
        let proto = if p.owner.1 == BIN { Proto::Binary } else { Proto::Text };
        if self.dialer.is_plain(proto) {
            let mut sock = Stream::Plain(TcpStream::connect(addr)?);
            let _ = sock.sock().set_nodelay(true);
            registry.register(sock.sock_mut(), token, Interest::READABLE | Interest::WRITABLE)?;
            p.sock = Some(sock);
        } else {
            let (dialer, gen, tx, wake) = (self.dialer.clone(), p.gen, self.dialed_tx.clone(), self.wake.clone());
            std::thread::Builder::new().name(self.dial_thread.into()).spawn(move || {
                let r = dialer.dial_nonblocking(addr, proto);
                if tx.send((i, gen, r)).is_ok() {
                    wake();
                }
            })?;
            p.sock = None;
        }
        p.state = State::Up;
        p.wbuf.clear();
        p.wpos = 0;
        p.rx.clear();
        p.dec = Decoder::new();
        Ok(())
    }

    /// The next connection a helper thread dialed: registered and in its
    /// pipe (`None` returned after it), or `Some((pipe, error))` if the dial
    /// or the registration failed (the pipe has no socket: the user takes
    /// it down). Dials for a dropped connection are discarded.
    pub fn next_dialed(&mut self, registry: &Registry) -> Option<(usize, io::Error)> {
        while let Ok((i, gen, r)) = self.dialed_rx.try_recv() {
            if self.pipes[i].gen != gen {
                continue; // dropped (timed out) meanwhile: the socket closes here
            }
            let token = Token(self.token_base + i);
            let registered = r.and_then(|s| {
                let mut s = s.map_sock(TcpStream::from_std);
                registry.register(s.sock_mut(), token, Interest::READABLE | Interest::WRITABLE)?;
                Ok(s)
            });
            match registered {
                Ok(s) => {
                    self.pipes[i].sock = Some(s);
                    self.mark(i);
                }
                Err(e) => return Some((i, e)),
            }
        }
        None
    }

    /// Drop pipe `i`'s connection and its buffers (a new generation: late
    /// events and dials for the old one are ignored); what was in flight on
    /// it, for the user to answer. The state is the user's to set.
    pub fn drop_connection(&mut self, i: usize, registry: &Registry) -> VecDeque<T> {
        let p = &mut self.pipes[i];
        p.gen += 1;
        if let Some(mut s) = p.sock.take() {
            let _ = registry.deregister(s.sock_mut());
        }
        p.wbuf.clear();
        p.wpos = 0;
        p.rx.clear();
        p.dec = Decoder::new();
        std::mem::take(&mut p.inflight)
    }

    /// [`Pipes::drop_connection`], and refuse requests to the pipe for its
    /// backoff from `now` (which doubles for the next failure).
    pub fn down(&mut self, i: usize, registry: &Registry, now: Instant) -> VecDeque<T> {
        let lost = self.drop_connection(i, registry);
        let p = &mut self.pipes[i];
        p.state = State::Down { until: now + p.backoff };
        p.backoff = (p.backoff * 2).min(BACKOFF_MAX);
        lost
    }

    /// Write what the marked pipes have queued; `Some(i)` when pipe `i`'s
    /// write failed (the user takes it down, then calls this again until
    /// `None`: the rest are still marked).
    pub fn flush(&mut self) -> Option<usize> {
        while let Some(i) = self.dirty.pop() {
            let p = &mut self.pipes[i];
            p.dirty = false;
            let Some(sock) = p.sock.as_mut() else { continue };
            if sock.write_pending(&mut p.wbuf, &mut p.wpos).is_err() {
                return Some(i);
            }
        }
        None
    }
}

impl<T: InFlight, X> Pipes<T, X> {
    /// When the oldest request in flight on any pipe times out.
    pub fn next_deadline(&self, timeout: Duration) -> Option<Instant> {
        self.pipes.iter().filter_map(|p| p.inflight.front()).map(|f| f.sent() + timeout).min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mio::{Events, Poll};
    use std::io::{Read, Write};

    struct Req(Instant);
    impl InFlight for Req {
        fn sent(&self) -> Instant {
            self.0
        }
    }

    fn pipes() -> Pipes<Req> {
        Pipes::new(Dialer::plain(Duration::from_secs(1)), 10, "test-dial", Arc::new(|| {}))
    }

    #[test]
    fn a_pipe_per_owner_and_tokens_map_back() {
        let mut p = pipes();
        let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let w0 = p.index_of((0, 0), || a, |_| ());
        let bin = p.index_of((0, BIN), || a, |_| ());
        let w3 = p.index_of((2, 3), || a, |_| ());
        assert_eq!((w0, bin, w3), (0, 1, 2));
        assert_eq!(p.index_of((2, 3), || unreachable!(), |_| ()), 2);
        assert_eq!(p.of_token(Token(12)), Some(2));
        assert_eq!(p.of_token(Token(13)), None);
        assert_eq!(p.of_token(Token(9)), None);
    }

    #[test]
    fn requests_go_out_in_order_and_replies_come_back_into_rx() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut poll = Poll::new().unwrap();
        let mut p = pipes();
        let i = p.index_of((0, 0), || addr, |_| ());
        p.connect(i, poll.registry(), addr).unwrap();
        let t0 = Instant::now();
        p.send(i, b"get a\r\n", Req(t0));
        p.send(i, b"get b\r\n", Req(t0 + Duration::from_millis(5)));
        let (mut server, _) = listener.accept().unwrap();
        let mut events = Events::with_capacity(8);
        // written once the socket is writable (the connect may still be in progress)
        let mut got = Vec::new();
        server.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        for _ in 0..100 {
            poll.poll(&mut events, Some(Duration::from_millis(50))).unwrap();
            for ev in events.iter() {
                if let Some(j) = p.of_token(ev.token()) {
                    p.mark(j);
                }
            }
            assert_eq!(p.flush(), None);
            let mut b = [0u8; 64];
            if let Ok(n) = server.read(&mut b) {
                got.extend_from_slice(&b[..n]);
            }
            if got.len() == 14 {
                break;
            }
        }
        assert_eq!(got, b"get a\r\nget b\r\n");
        assert_eq!(p.next_deadline(Duration::from_millis(100)), Some(t0 + Duration::from_millis(100)));
        assert!(p[i].late(t0 + Duration::from_millis(100), Duration::from_millis(100)));
        server.write_all(b"END\r\nEND\r\n").unwrap();
        let mut read = Vec::new();
        for _ in 0..100 {
            let broken = p[i].read();
            assert!(!broken);
            read.extend_from_slice(p[i].rx.unread());
            let n = p[i].rx.unread().len();
            p[i].rx.consume(n);
            if read.len() == 10 {
                break;
            }
            poll.poll(&mut events, Some(Duration::from_millis(50))).unwrap();
        }
        assert_eq!(read, b"END\r\nEND\r\n");
        drop(server);
        // the close: read says broken once the FIN arrives
        let mut broken = false;
        for _ in 0..100 {
            broken = p[i].read();
            if broken {
                break;
            }
            poll.poll(&mut events, Some(Duration::from_millis(50))).unwrap();
        }
        assert!(broken);
        let now = Instant::now();
        let lost = p.down(i, poll.registry(), now);
        assert_eq!(lost.len(), 2);
        assert!(!p[i].connected());
        assert_eq!(p[i].state, State::Down { until: now + BACKOFF_MIN });
        assert_eq!(p[i].backoff, BACKOFF_MIN * 2);
        assert_eq!(p.next_deadline(Duration::from_millis(100)), None);
    }
}
