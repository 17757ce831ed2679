//! The mio connection set both drivers share ([`crate::driver::PlainDriver`] and
//! [`crate::routed::RoutedDriver`]): one `Poll`, its `Events`, and per connection the
//! non-blocking stream, its write buffer, its read buffer with a reply parser, and the queue of
//! requests waiting for a reply (`P`, whatever a driver needs to handle that reply).
//!
//! A driver queues a request with [`Conns::request`] (which returns the write buffer to encode it
//! into), calls [`Conns::flush`], and [`Conns::poll`] with a handler called once per parsed reply.
//! Connection `ci` talks to target `Conns::target(ci)`; the drivers lay connections out as
//! `slot * targets + target`. Nothing here allocates on the hot path: buffers are reused, the
//! read buffer only grows when one reply does not fit.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use mio::net::TcpStream;
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token};

use mbal_proto::client::{Decoder, Expect, Frame};
use mbal_tls::{BlockingStream, ClientTls, Stream};

/// Timeout of a blocking connect (and of the routed driver's handshake reads).
pub(crate) const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// A request waiting for its reply: says how to parse that reply.
pub(crate) trait Pending: Copy {
    fn expect(&self) -> Expect;
}

impl Pending for (u32, Expect) {
    fn expect(&self) -> Expect {
        self.1
    }
}

/// The replies the bench's requests allow: a get (read with [`Expect::Hits`]) ends with `END`,
/// a set with a status line, a routed driver's `mbal hello` with `MBAL ...`; any may be an
/// error or a redirect.
#[inline]
fn fits(expect: Expect, f: &Frame<'_>) -> bool {
    match f {
        Frame::Error(_) | Frame::Redirect { .. } => true,
        Frame::End { .. } => expect == Expect::Hits,
        Frame::Stored | Frame::NotStored | Frame::Exists | Frame::NotFound | Frame::Hello { .. } => {
            expect == Expect::Line
        }
        _ => false,
    }
}

struct Conn<P> {
    /// Plain or TLS (one match per read or write).
    stream: Stream<TcpStream>,
    target: usize,
    wbuf: Vec<u8>,
    wpos: usize,
    rbuf: Vec<u8>,
    rstart: usize,
    rend: usize,
    decoder: Decoder,
    /// In-flight requests on this connection, in send order.
    pending: VecDeque<P>,
}

/// The connections of one driver. See the module docs.
pub(crate) struct Conns<P> {
    poll: Poll,
    events: Events,
    /// Wakes `poll` at a timeout finer than epoll's millisecond (registered as [`TIMER`]).
    timer: Timer,
    conns: Vec<Conn<P>>,
    /// What a target is called in error messages ("server", "worker").
    label: &'static str,
    /// Address of each target.
    addrs: Vec<SocketAddr>,
    // scratch
    ready: Vec<(usize, bool, bool)>,
}

/// The authentication request every new connection sends first (`--user`,
/// `--password-file`: memcached's ASCII auth), set by [`crate::run`].
static LOGIN: std::sync::Mutex<Option<Vec<u8>>> = std::sync::Mutex::new(None);

/// Authenticate every connection opened from now on with `user` and
/// `password` (None: no authentication).
pub fn set_login(login: Option<(&str, &str)>) {
    let req = login.map(|(user, password)| {
        let token = format!("{user} {password}");
        format!("set auth 0 0 {}\r\n{token}\r\n", token.len()).into_bytes()
    });
    *LOGIN.lock().unwrap_or_else(|e| e.into_inner()) = req;
}

/// Blocking connect to `addr` (with [`IO_TIMEOUT`]) and `TCP_NODELAY`; with `tls`, the TLS
/// handshake too (bounded by [`IO_TIMEOUT`]); then authenticated if a login is set
/// ([`set_login`]).
pub(crate) fn connect_std(addr: SocketAddr, tls: Option<&ClientTls>) -> Result<BlockingStream> {
    let mut s = mbal_tls::dial(addr, tls, IO_TIMEOUT).with_context(|| format!("connect to {addr}"))?;
    let login = LOGIN.lock().unwrap_or_else(|e| e.into_inner()).clone();
    if let Some(req) = login {
        s.write_all(&req).with_context(|| format!("login to {addr}"))?;
        // The reply is one line; read it byte by byte so nothing after it is taken.
        let mut line = Vec::new();
        let mut b = [0u8; 1];
        while !line.ends_with(b"\n") && line.len() < 1024 {
            if s.read(&mut b).with_context(|| format!("login to {addr}"))? == 0 {
                bail!("login to {addr}: connection closed");
            }
            line.push(b[0]);
        }
        if line != b"STORED\r\n" {
            bail!("login to {addr} refused: {}", String::from_utf8_lossy(&line).trim_end());
        }
    }
    s.sock().set_read_timeout(None)?;
    s.sock().set_write_timeout(None)?;
    Ok(s)
}

/// The poll token of the timer (connections are numbered from 0).
const TIMER: Token = Token(usize::MAX);

/// A one-shot `timerfd`: `epoll_wait` takes its timeout in whole milliseconds (mio rounds up),
/// so a wait of 300 µs would last 1 ms; armed for the wait, the timer ends it to the
/// microsecond. It is what lets the open-loop client sleep until its next send instead of
/// busy-polling for it (which took a whole core from the servers sharing the machine:
/// docs/benchmarks-journal.md §15, round 6).
struct Timer {
    fd: OwnedFd,
}

impl Timer {
    fn new() -> io::Result<Timer> {
        // SAFETY: plain syscall; the descriptor it returns is owned from here on.
        let fd = unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_NONBLOCK | libc::TFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a new descriptor nothing else owns.
        Ok(Timer { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    /// Fire once, `after` from now (at least 1 ns: a zero value would disarm it). Arming resets
    /// any expiry not yet read, so an old one cannot end the next wait early.
    fn arm(&self, after: Duration) -> io::Result<()> {
        let after = after.max(Duration::from_nanos(1));
        let spec = libc::itimerspec {
            it_interval: libc::timespec { tv_sec: 0, tv_nsec: 0 },
            it_value: libc::timespec { tv_sec: after.as_secs() as libc::time_t, tv_nsec: after.subsec_nanos() as _ },
        };
        // SAFETY: valid descriptor and pointers for the call's duration.
        let r = unsafe { libc::timerfd_settime(self.fd.as_raw_fd(), 0, &spec, std::ptr::null_mut()) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Read the expiry count so the next expiry raises a new (edge-triggered) event.
    fn clear(&self) {
        let mut buf = [0u8; 8];
        // SAFETY: an 8-byte buffer for a non-blocking read of the counter; EAGAIN is fine.
        unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    }
}

impl<P: Pending> Conns<P> {
    /// An empty set over targets at `addrs` (called `label` in errors), with room for `capacity`
    /// connections.
    pub(crate) fn new(label: &'static str, addrs: Vec<SocketAddr>, capacity: usize) -> Result<Conns<P>> {
        let poll = Poll::new()?;
        let timer = Timer::new()?;
        poll.registry().register(&mut SourceFd(&timer.fd.as_raw_fd()), TIMER, Interest::READABLE)?;
        Ok(Conns {
            poll,
            timer,
            events: Events::with_capacity(1024),
            conns: Vec::with_capacity(capacity),
            label,
            addrs,
            ready: Vec::new(),
        })
    }

    /// Add a connected stream (plain, or TLS after its handshake) to target `target`: made
    /// non-blocking and registered with the poll. Its index is the number of connections added
    /// before it.
    pub(crate) fn add(&mut self, std: BlockingStream, target: usize) -> Result<()> {
        std.sock().set_nonblocking(true)?;
        let mut stream = std.into_stream().map_sock(TcpStream::from_std);
        let id = self.conns.len();
        self.poll.registry().register(stream.sock_mut(), Token(id), Interest::READABLE | Interest::WRITABLE)?;
        self.conns.push(Conn {
            stream,
            target,
            wbuf: Vec::with_capacity(64 * 1024),
            wpos: 0,
            rbuf: vec![0; 256 * 1024],
            rstart: 0,
            rend: 0,
            decoder: Decoder::new(),
            pending: VecDeque::new(),
        });
        Ok(())
    }

    /// Queue request `p` on connection `ci`; returns the buffer to encode its bytes into.
    #[inline]
    pub(crate) fn request(&mut self, ci: usize, p: P) -> &mut Vec<u8> {
        let c = &mut self.conns[ci];
        c.pending.push_back(p);
        &mut c.wbuf
    }

    /// Start writing everything buffered (non-blocking; the rest goes out during `poll`).
    pub(crate) fn flush(&mut self) -> Result<()> {
        for ci in 0..self.conns.len() {
            let c = &self.conns[ci];
            if c.wpos < c.wbuf.len() || c.stream.wants_write() {
                self.write_conn(ci)?;
            }
        }
        Ok(())
    }

    /// Wait up to `timeout` for events, write what is pending, and call `on_reply(ci, p, reply)`
    /// for each reply read, in order per connection (`p` is the request it answers, already
    /// removed from the connection's queue; `reply` is the frame that completed it: `End` of a
    /// get, a status line, an error or a redirect — anything else is a protocol error). A hot-key
    /// hint (`Frame::Hint`, routed connections) is passed the same way before the reply it
    /// precedes, with `p` the request it belongs to, which stays queued for its reply.
    ///
    /// The wait ends at `timeout` to the microsecond (a timer), not at epoll's next millisecond.
    /// A whole number of milliseconds (the closed loop's 100 ms) needs no timer: one system call
    /// fewer per wait where the generator's own ceiling is measured.
    pub(crate) fn poll(&mut self, timeout: Duration, mut on_reply: impl FnMut(usize, P, Frame<'_>)) -> Result<()> {
        let epoll_timeout = if timeout.subsec_nanos().is_multiple_of(1_000_000) {
            timeout
        } else {
            self.timer.arm(timeout)?;
            // the timer ends the wait; epoll's own timeout (rounded up to the millisecond) only
            // bounds it should the timer be lost
            timeout + Duration::from_millis(1)
        };
        match self.poll.poll(&mut self.events, Some(epoll_timeout)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        let mut ready = std::mem::take(&mut self.ready);
        ready.clear();
        for e in self.events.iter() {
            if e.token() == TIMER {
                self.timer.clear();
            } else {
                ready.push((e.token().0, e.is_readable() || e.is_read_closed(), e.is_writable()));
            }
        }
        for &(ci, r, w) in &ready {
            let c = &self.conns[ci];
            if w && (c.wpos < c.wbuf.len() || c.stream.wants_write()) {
                self.write_conn(ci)?;
            }
            if r {
                self.read_conn(ci, &mut on_reply)?;
            }
        }
        self.ready = ready;
        Ok(())
    }

    fn read_conn(&mut self, ci: usize, on_reply: &mut impl FnMut(usize, P, Frame<'_>)) -> Result<()> {
        let c = &mut self.conns[ci];
        let addr = self.addrs[c.target];
        let label = self.label;
        loop {
            if c.rend == c.rbuf.len() {
                if c.rstart > 0 {
                    c.rbuf.copy_within(c.rstart..c.rend, 0);
                    c.rend -= c.rstart;
                    c.rstart = 0;
                } else {
                    let n = c.rbuf.len() * 2;
                    c.rbuf.resize(n, 0);
                }
            }
            let space = c.rbuf.len() - c.rend;
            let n = match c.stream.read(&mut c.rbuf[c.rend..]) {
                Ok(0) => bail!("{label} {addr} closed the connection"),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e).with_context(|| format!("read from {addr}")),
            };
            c.rend += n;
            // parse all complete replies
            loop {
                let Some(&p) = c.pending.front() else {
                    if c.rstart < c.rend {
                        bail!("{label} {addr} sent data with no request pending");
                    }
                    break;
                };
                let (used, reply) = c
                    .decoder
                    .decode(&c.rbuf[c.rstart..c.rend], p.expect())
                    .map_err(|e| anyhow::anyhow!("{addr}: {e}"))?;
                c.rstart += used;
                let Some(reply) = reply else { break };
                if let Frame::Hint(_) = reply {
                    on_reply(ci, p, reply);
                    continue;
                }
                if !fits(p.expect(), &reply) {
                    bail!("{label} {addr}: unexpected reply {reply:?} to a {:?} request", p.expect());
                }
                c.pending.pop_front();
                on_reply(ci, p, reply);
            }
            if c.rstart == c.rend {
                c.rstart = 0;
                c.rend = 0;
            }
            // A short read drained the socket: on Linux epoll (edge-triggered, as mio uses it)
            // any later arrival raises a new event, so skip the read that would return EAGAIN.
            if n < space {
                return Ok(());
            }
        }
    }

    fn write_conn(&mut self, ci: usize) -> Result<()> {
        let c = &mut self.conns[ci];
        c.stream.flush_tls().with_context(|| format!("write to {}", self.addrs[c.target]))?;
        while c.wpos < c.wbuf.len() {
            match c.stream.write(&c.wbuf[c.wpos..]) {
                Ok(0) => bail!("write returned 0"),
                Ok(n) => c.wpos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e).with_context(|| format!("write to {}", self.addrs[c.target])),
            }
        }
        c.wbuf.clear();
        c.wpos = 0;
        Ok(())
    }
}
