//! `mbal proxy`: a memcached-protocol endpoint (text, meta, binary) for unmodified clients that
//! routes every key to the worker that owns it (DESIGN.md §3, §4; issue 11).
//!
//! # Design
//!
//! * **Thread-per-core.** `-t` threads, each with its own mio event loop,
//!   its own listening socket on the same address (`SO_REUSEPORT`: the
//!   kernel spreads connections over them), its own client connections, its
//!   own upstream connections and its own [`mbal_cluster::Router`]. Threads
//!   share nothing on the data path; only statistics are published, once per
//!   loop round, into a per-thread slot.
//! * **Routing is the router's.** A key goes where
//!   [`Router::route_hash`](mbal_cluster::Router::route_hash) says; a
//!   multi-key `get` is grouped with [`Router::split`](mbal_cluster::Router::split),
//!   one `get` per owning worker, and reassembled in request order; a
//!   redirect (`RD`) is given to [`Router::learn`](mbal_cluster::Router::learn)
//!   and the request resent (a redirected multi-get split per cachelet, the
//!   router's rule); a redirect naming a newer epoch makes the thread fetch
//!   the map (`mbal map`) from the worker that sent it. Replies are read with
//!   the shared reply codec ([`mbal_proto::client::Decoder`]).
//! * **Upstreams.** One connection per (thread, server, worker), opened on
//!   first use with `mbal hello <epoch> <worker>` (the server hands it to
//!   that worker), pipelined: every request of every client of the thread
//!   for that worker is written to it in the order the thread routed them,
//!   and the replies come back in that order (a FIFO of requests in flight).
//!   Requests whose reply the server does not send (text `noreply`, meta `q`)
//!   are followed by `mn`, so that every request in flight has a reply to
//!   wait for; its `MN` is not passed on.
//! * **Order.** Each client connection has a queue of reply slots, one per
//!   request in request order; a reply fills its slot, and the front slots
//!   that are complete are written out, once per loop round, up to the end
//!   of the last client read whose replies are all in (like the server's one
//!   write per read batch: an upstream answering a read's requests in
//!   pieces does not split the client's replies, and with them its next
//!   requests; past 32 KiB waiting, what is complete goes anyway). A request
//!   is never reordered with respect to another of the same connection,
//!   whichever upstreams answer.
//!   The request copies kept for resends and the slots' reply buffers are
//!   reused (a per-thread spare list, at most 256 buffers of at most 4 KiB),
//!   so a single-key request allocates nothing in the steady state.
//! * **Binary protocol.** A binary request goes to the owning server over a
//!   plain binary connection to its main port (the server routes it to the
//!   worker; binary connections do not opt in to redirects), one per thread
//!   and server, pipelined likewise, with a `NOOP` after each quiet request.
//! * **TLS and logins.** With `tls` the listener speaks TLS only (rustls,
//!   `mbal_tls::Stream`: the plain path is one enum match per read or
//!   write). Upstreams are opened by `dialer`: without TLS or a login a
//!   non-blocking connect as before; with them a helper thread does the
//!   blocking connect, handshake and login (ASCII auth on text upstreams,
//!   SASL PLAIN on binary ones), bounded by the dialer's timeout, while the
//!   upstream's requests queue; then the socket joins the event loop.
//! * **A dead server.** An upstream whose connect is refused or times out,
//!   whose connection is reset or closed, or whose oldest request waits
//!   longer than `--upstream-timeout-ms` has a server that cannot be reached:
//!   the connection is dropped, the server is down for a backoff
//!   ([`mbal_cluster::Health`], shared with the routing client: 100 ms
//!   doubling to 1 s), and every request in flight on it or routed to it
//!   meanwhile is answered at once, without the network: reads as misses,
//!   anything else `SERVER_ERROR mbal server <addr> unreachable`. The first
//!   failure and each failed retry fetch the map from another server
//!   (`mbal map`, on its upstream: nothing blocks the loop; one fetch at a
//!   time per thread) and install it if it is newer.
//! * **The coordinator.** With coordinators named ([`Config::coordinators`]),
//!   every map fetch asks them first, on a helper thread per proxy thread
//!   ([`coord`]): a server can be a heartbeat behind the coordinator's epoch
//!   just after a commit. None answering: a server's map, as above.
//! * **Failure.** An upstream that sends a reply the codec rejects, or whose
//!   TLS handshake or login is refused, is dropped: every request in flight
//!   on it is answered `SERVER_ERROR upstream ...`; requests routed to it
//!   during its backoff (starting at 10 ms, doubling up to 1 s) are answered
//!   the same at once, and the first request after the backoff reconnects.

pub mod coord;
mod engine;
pub mod stats;

use mbal_cluster::ClusterMap;
use std::io;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What `version` answers and `stats` shows.
pub const VERSION: &str = concat!("1.6.18-mbal-proxy-", env!("CARGO_PKG_VERSION"));

/// The proxy's settings.
#[derive(Clone, Debug)]
pub struct Config {
    pub listen: SocketAddr,
    pub threads: usize,
    pub max_conns: usize,
    pub max_item_size: usize,
    pub upstream_timeout: Duration,
    /// Redirects followed per request before it fails.
    pub max_redirects: u8,
    /// Unanswered requests per client connection before it is read no more.
    pub max_pending: usize,
    /// `-Z -o ssl_*`: the listener speaks TLS only. `None`: plain TCP.
    pub tls: Option<Arc<mbal_tls::ServerTls>>,
    /// How upstream connections are opened: TLS (the cluster file's
    /// `[tls]`) and the login (`--user`); plain TCP by default. Its timeout
    /// bounds a TLS connect, handshake and login, which block the thread.
    pub dialer: mbal_member::dial::Dialer,
    /// The coordinators the map is fetched from (see [`coord`]); `None`: from the servers.
    pub coordinators: Option<coord::Coordinators>,
}

impl Config {
    pub fn new(listen: SocketAddr) -> Config {
        Config {
            listen,
            threads: 1,
            max_conns: 1024,
            max_item_size: 1 << 20,
            upstream_timeout: Duration::from_millis(1000),
            max_redirects: mbal_cluster::MAX_REDIRECTS,
            max_pending: 1024,
            tls: None,
            dialer: mbal_member::dial::Dialer::plain(Duration::from_millis(1000)),
            coordinators: None,
        }
    }
}

/// A running proxy.
pub struct ProxyHandle {
    /// The address it listens on (the real port when 0 was asked for).
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
    wakers: Vec<Arc<mio::Waker>>,
    threads: Vec<JoinHandle<()>>,
}

impl ProxyHandle {
    /// Stop every thread and wait for them; client and upstream connections are closed.
    pub fn shutdown(mut self) {
        self.stop_threads();
    }

    fn stop_threads(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        for w in &self.wakers {
            let _ = w.wake();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }

    /// Wait until the proxy stops (see [`ProxyHandle::stopper`]).
    pub fn wait(mut self) {
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }

    /// A closure that stops the proxy (for a signal handler).
    pub fn stopper(&self) -> impl Fn() + Send + 'static {
        let (stop, wakers) = (self.stop.clone(), self.wakers.clone());
        move || {
            stop.store(true, std::sync::atomic::Ordering::SeqCst);
            for w in &wakers {
                let _ = w.wake();
            }
        }
    }
}

impl Drop for ProxyHandle {
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            self.stop_threads();
        }
    }
}

fn listener(addr: SocketAddr) -> io::Result<StdListener> {
    use socket2::{Domain, Socket, Type};
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    s.set_reuse_address(true)?;
    s.set_reuse_port(true)?;
    s.set_nonblocking(true)?;
    s.bind(&addr.into()).map_err(|e| io::Error::new(e.kind(), format!("bind {addr}: {e}")))?;
    s.listen(1024)?;
    Ok(s.into())
}

/// Start the proxy: bind, spawn the threads, return at once.
pub fn start(cfg: Config, map: ClusterMap) -> io::Result<ProxyHandle> {
    let first = listener(cfg.listen)?;
    let addr = first.local_addr()?;
    let mut listeners = vec![first];
    for _ in 1..cfg.threads {
        listeners.push(listener(addr)?);
    }
    let settings = vec![
        ("tcpport", addr.port().to_string()),
        ("interface", addr.ip().to_string()),
        ("num_threads", cfg.threads.to_string()),
        ("maxconns", cfg.max_conns.to_string()),
        ("item_size_max", cfg.max_item_size.to_string()),
        ("upstream_timeout_ms", cfg.upstream_timeout.as_millis().to_string()),
        ("max_redirects", cfg.max_redirects.to_string()),
        ("servers", map.servers().len().to_string()),
        ("ssl_enabled", if cfg.tls.is_some() { "yes" } else { "no" }.to_string()),
        ("upstream_tls", if cfg.dialer.tls.is_some() { "yes" } else { "no" }.to_string()),
        ("upstream_login", if cfg.dialer.user.is_some() { "yes" } else { "no" }.to_string()),
    ];
    let shared = Arc::new(stats::Shared {
        started: Instant::now(),
        threads: (0..cfg.threads).map(|_| Mutex::new(stats::ThreadTotals::default())).collect(),
        curr_connections: AtomicU64::new(0),
        settings,
    });
    let stop = Arc::new(AtomicBool::new(false));
    let cfg = Arc::new(cfg);
    let mut wakers = Vec::new();
    let mut threads = Vec::new();
    for (i, l) in listeners.into_iter().enumerate() {
        let (engine, waker) = engine::Engine::new(i, l, cfg.clone(), shared.clone(), map.clone(), stop.clone())?;
        wakers.push(waker);
        threads.push(std::thread::Builder::new().name(format!("mbal-proxy-{i}")).spawn(move || engine.run())?);
    }
    Ok(ProxyHandle { addr, stop, wakers, threads })
}
