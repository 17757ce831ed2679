//! Routed mode (`mbal bench --routed`): the client does mbal's routing itself.
//!
//! [`RoutedFactory`] holds a [`ClusterMap`] (fetched with `mbal map` from any one server by
//! [`RoutedFactory::connect`], or given by the caller with [`RoutedFactory::with_map`], e.g. an
//! older map to exercise redirects). Each client thread's [`RoutedDriver`] opens one connection
//! to EVERY worker's own port (`map.worker_addr(s, w)`), shared by all its logical clients (a
//! routing client's connection pool), opts in with `mbal hello <epoch>` and checks the
//! `MBAL <server> <worker> <epoch>` answer. Sharing is what keeps the cost per request flat as
//! workers are added: with a connection per (logical client, worker), a logical client's
//! pipeline would be spread over one socket per worker, and each write would carry
//! `pipeline / workers` requests.
//!
//! Routing is an [`mbal_cluster::Router`], the one the routing client uses: every op is routed
//! by `key_hash(key)` → cachelet → owning (server, worker), from the map plus the owners learned
//! from redirects, and sent to the first worker of the owner's thread (the hello is
//! `mbal hello <epoch> <worker> threads`, whose answer gives the server's thread count;
//! docs/protocol.md): where workers share threads, only those connections are busy. A redirect
//! to another worker of the same server sends `mbal hello ... threads` again on the connection
//! that redirected (the server serves no thread-mate's keys there until then), and one that
//! shows the count stale ([`mbal_cluster::Learned::threads_stale`]) routes that server per
//! worker until the answer. A multiget is split per destination worker ([`Router::split`]:
//! one `get k1 k2 ..` per owner, or per owner's thread; the op's keys are regrouped so each
//! part is a contiguous range of the op's key list) and counts as one op.
//!
//! A reply `RD <epoch> <server> <worker>` replaces the whole reply of a request; what it teaches
//! is the router's rule ([`Router::learn`]), the same as the client's:
//! * a request whose keys are all of one cachelet (any single-key request): the cachelet is now
//!   owned by (`server`, `worker`); the driver records that and resends the request there;
//! * a multi-key get spanning several cachelets: the server names the owner of the *first* key
//!   it does not own, which cannot be attributed, so nothing is recorded and the part's keys are
//!   resent split per cachelet; the next redirects are then learned exactly.
//!
//! The bench does not refetch the map when a redirect names a newer epoch (the client does):
//! overrides are enough for a run, and a redirect to a worker its map does not have counts as
//! an error.
//!
//! Hot keys (Phase 1) as in the routing client, with the same [`Leases`], one cache per logical
//! client (each logical client stands for one routing client, so each draws its own copy of a
//! hot key; a cache shared by a thread's clients sent all of them to the same copy): a hint
//! `RH hot <key> <replicas> <lease-ms>` read from a key's home grants that client a lease that
//! draws one copy; while it is live, the client's get of that key is one single-key `get` to the
//! copy's connection (the op's other keys go home as usual). A set ends the client's lease on
//! its key. An `RD` or
//! an error line from a copy ends the lease and the key is resent home; that counts as a
//! fallback, a copy's answer as a replica read (`Totals::replica_reads`,
//! `Totals::replica_fallbacks`). A copy whose connection fails stops the run, as any broken
//! connection does in the bench.
//!
//! Each request chain follows at most [`MAX_REDIRECTS`] redirects, then the part counts as an
//! error. Per-worker request counts are reported as targets named `s<server>/w<worker>`, and
//! followed redirects in `Totals::redirects`.

use std::io::Write;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use mbal_cluster::{key_hash, ClusterMap, Leases, Redirect, Router, Split};
use mbal_proto::client::{Expect, Frame, Reply, ReplyReader};

use crate::conns::{connect_std, Conns, Pending, IO_TIMEOUT};
use crate::driver::{value_buffer, write_get, write_set, Completion, Driver, OpKind, Request};
use crate::workload::{write_key, KeySize};
use crate::{DriverFactory, DriverSpec};
use mbal_tls::{BlockingStream, ClientTls};

/// Redirects one request chain may follow before it counts as an error.
pub use mbal_cluster::MAX_REDIRECTS;

/// Send `req` on a blocking stream and read its one reply (the server sends nothing else on
/// this connection until asked, so reading ahead is safe).
fn call(s: &mut BlockingStream, req: &[u8]) -> Result<Reply> {
    s.write_all(req).context("write")?;
    let mut r = ReplyReader::new();
    loop {
        if let Some(reply) = r.next(Expect::Line)? {
            if r.buffered() > 0 {
                bail!("unexpected bytes after the reply");
            }
            return Ok(reply);
        }
        if r.read_from(s).context("read")? == 0 {
            bail!("connection closed");
        }
    }
}

/// Fetch the cluster map from any mbal server with `mbal map`.
pub fn fetch_map(addr: SocketAddr) -> Result<ClusterMap> {
    fetch_map_tls(addr, None)
}

/// [`fetch_map`] over TLS with `tls`.
pub fn fetch_map_tls(addr: SocketAddr, tls: Option<&ClientTls>) -> Result<ClusterMap> {
    let mut s = connect_std(addr, tls)?;
    s.sock().set_read_timeout(Some(IO_TIMEOUT))?;
    match call(&mut s, b"mbal map\r\n").with_context(|| format!("mbal map from {addr}"))? {
        Reply::Map { json, .. } => {
            let text = std::str::from_utf8(&json).context("map is not UTF-8")?;
            ClusterMap::from_json(text).map_err(|e| anyhow::anyhow!("bad map from {addr}: {e}"))
        }
        r => bail!("{addr} answered `mbal map` with {r:?}: not an mbal server?"),
    }
}

/// Makes [`RoutedDriver`]s over one cluster map.
pub struct RoutedFactory {
    map: ClusterMap,
    tls: Option<ClientTls>,
}

impl RoutedFactory {
    /// Fetch the map from `server` (any server of the cluster). Every worker address in the map
    /// must be a loopback address unless `allow_non_loopback`.
    pub fn connect(server: SocketAddr, allow_non_loopback: bool) -> Result<RoutedFactory> {
        RoutedFactory::connect_tls(server, allow_non_loopback, None)
    }

    /// [`RoutedFactory::connect`], every connection TLS with `tls`.
    pub fn connect_tls(server: SocketAddr, allow_non_loopback: bool, tls: Option<ClientTls>) -> Result<RoutedFactory> {
        let map = fetch_map_tls(server, tls.as_ref())?;
        if !allow_non_loopback {
            for (s, info) in map.servers().iter().enumerate() {
                for a in &info.workers {
                    if !a.ip().is_loopback() {
                        bail!(
                            "the map of {server} names worker {a} of server {s}: not a loopback address; \
                             pass --allow-non-loopback if you really mean it"
                        );
                    }
                }
            }
        }
        Ok(RoutedFactory { map, tls })
    }

    /// Start from a given map (possibly older than the servers': redirects correct it).
    pub fn with_map(map: ClusterMap) -> RoutedFactory {
        RoutedFactory { map, tls: None }
    }

    /// Talk TLS to every worker.
    pub fn with_tls(self, tls: Option<ClientTls>) -> RoutedFactory {
        RoutedFactory { tls, ..self }
    }

    pub fn map(&self) -> &ClusterMap {
        &self.map
    }
}

impl DriverFactory for RoutedFactory {
    fn name(&self) -> String {
        "routed".into()
    }
    fn make(&self, spec: &DriverSpec<'_>) -> Result<Box<dyn Driver>> {
        let a = spec.args;
        Ok(Box::new(RoutedDriver::connect_tls(
            &self.map,
            self.tls.as_ref(),
            spec.slots,
            spec.max_in_flight,
            a.key_sizes(),
            a.value_size_max.unwrap_or(a.value_size).max(a.value_size),
        )?))
    }
    fn cluster_map(&self) -> Result<Option<ClusterMap>> {
        Ok(Some(self.map.clone()))
    }
    fn load_servers(&self) -> Vec<SocketAddr> {
        self.map.servers().iter().map(|s| s.main).collect()
    }
    fn tls(&self) -> Option<ClientTls> {
        self.tls.clone()
    }
}

/// One request on the wire, waiting for its reply (a get is read with [`Expect::Hits`], a set
/// with [`Expect::Line`]).
#[derive(Clone, Copy)]
struct Part {
    token: u32,
    expect: Expect,
    /// Range of the op's (owner-grouped) key list this request carries.
    start: u32,
    len: u32,
    /// Redirects this request chain followed so far.
    hops: u8,
    /// A single-key get to a hot key's copy (not its home).
    copy: bool,
    /// `mbal hello` again, to learn the server's thread count (no op behind it).
    hello: bool,
}

impl Pending for Part {
    fn expect(&self) -> Expect {
        self.expect
    }
}

#[derive(Default)]
struct OpState {
    /// The logical client that submitted it (its lease cache).
    slot: u32,
    value_size: u32,
    /// The op's keys, grouped by owning worker at submit time, and their hashes.
    keys: Vec<u32>,
    hashes: Vec<u64>,
    parts: u32,
    hits: u32,
    errors: u32,
}

/// Routed mbal driver: one connection per worker, shared by the logical clients, ops routed by
/// the cluster map plus learned redirects. See the module docs.
pub struct RoutedDriver {
    /// Connection `target`.
    conns: Conns<Part>,
    /// Everything but the connections (borrowed apart from them while replies are handled).
    r: State,
}

/// The state of a [`RoutedDriver`] besides its connections.
struct State {
    /// (server, worker) of each target (= connection), and its address.
    targets: Vec<((u16, u16), SocketAddr)>,
    /// First target index of each server.
    server_base: Vec<usize>,
    router: Router,
    /// One lease cache per logical client: each draws its own copy of a hot key, as separate
    /// routing clients would (one cache per thread sent every client to the same copy).
    leases: Vec<Leases>,
    /// The time as of the last poll (leases are timed with it).
    now: Instant,
    replica_reads: u64,
    replica_fallbacks: u64,
    key_size: KeySize,
    value: Vec<u8>,
    ops: Vec<OpState>,
    target_reqs: Vec<u64>,
    // scratch
    key_buf: Vec<u8>,
    hashes: Vec<u64>,
    /// Scratch of `submit`: positions of the op's keys read at home, and (key, hash, target)
    /// of those read at a copy.
    home_pos: Vec<u32>,
    at_copy: Vec<(u32, u64, usize)>,
    split: Split,
    regroup: Vec<(u32, u64)>,
    resend: Vec<Part>,
    /// Targets to send `mbal hello` again (a redirect showed their server's threads changed).
    hellos: Vec<usize>,
}

impl RoutedDriver {
    /// Open a connection to every worker of `map`, each opted in with `mbal hello`.
    pub fn connect(
        map: &ClusterMap,
        slots: usize,
        max_in_flight: usize,
        key_size: KeySize,
        value_size_max: usize,
    ) -> Result<RoutedDriver> {
        RoutedDriver::connect_tls(map, None, slots, max_in_flight, key_size, value_size_max)
    }

    /// [`RoutedDriver::connect`], over TLS with `tls`.
    pub fn connect_tls(
        map: &ClusterMap,
        tls: Option<&ClientTls>,
        slots: usize,
        max_in_flight: usize,
        key_size: KeySize,
        value_size_max: usize,
    ) -> Result<RoutedDriver> {
        let mut targets = Vec::new();
        let mut server_base = Vec::new();
        for (s, info) in map.servers().iter().enumerate() {
            server_base.push(targets.len());
            for w in 0..info.workers.len() {
                targets.push(((s as u16, w as u16), map.worker_addr(s as u16, w as u16)));
            }
        }
        if targets.is_empty() {
            bail!("the map has no workers");
        }
        let addrs = targets.iter().map(|&(_, a)| a).collect();
        let mut conns = Conns::new("worker", addrs, targets.len())?;
        let mut router = Router::new(map.clone());
        for (ti, &((s, w), addr)) in targets.iter().enumerate() {
            let mut std = connect_std(addr, tls)?;
            std.sock().set_read_timeout(Some(IO_TIMEOUT))?;
            let hello = format!("mbal hello {} {w} threads\r\n", map.epoch());
            let mut reply = call(&mut std, hello.as_bytes()).with_context(|| format!("mbal hello to {addr}"))?;
            if matches!(&reply, Reply::Error(l) if l.starts_with("CLIENT_ERROR")) {
                // An older mbal does not know `threads`: routed per worker, as it serves.
                let hello = format!("mbal hello {} {w}\r\n", map.epoch());
                reply = call(&mut std, hello.as_bytes()).with_context(|| format!("mbal hello to {addr}"))?;
            }
            match reply {
                Reply::Hello { server, worker, threads, .. } if (server, worker) == (s, w) => {
                    router.set_threads(s, threads)
                }
                _ => bail!("{addr} (s{s}/w{w} in the map) answered `mbal hello` with {reply:?}"),
            }
            std.sock().set_read_timeout(None)?;
            conns.add(std, ti)?;
        }
        let n = targets.len();
        let r = State {
            targets,
            server_base,
            router,
            leases: slot_leases(slots),
            now: Instant::now(),
            replica_reads: 0,
            replica_fallbacks: 0,
            key_size,
            value: value_buffer(value_size_max),
            ops: (0..max_in_flight).map(|_| OpState::default()).collect(),
            target_reqs: vec![0; n],
            key_buf: Vec::with_capacity(256),
            hashes: Vec::new(),
            home_pos: Vec::new(),
            at_copy: Vec::new(),
            split: Split::new(),
            regroup: Vec::new(),
            resend: Vec::new(),
            hellos: Vec::new(),
        };
        Ok(RoutedDriver { conns, r })
    }
}

/// A seed that differs between drivers (threads) and runs, so that they spread their leases
/// over a key's copies.
fn lease_seed() -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(std::process::id())
}

/// One lease cache per logical client (at least one), each with its own seed.
fn slot_leases(slots: usize) -> Vec<Leases> {
    let base = lease_seed();
    (0..slots.max(1) as u64)
        .map(|s| Leases::new(base ^ s.wrapping_mul(0x9E37_79B9_7F4A_7C15), mbal_cluster::DEFAULT_MAX_LEASES))
        .collect()
}

/// The target (connection) of a (server, worker), if the map has it.
fn target_of(server_base: &[usize], targets: &[((u16, u16), SocketAddr)], (s, w): (u16, u16)) -> Option<usize> {
    server_base.get(s as usize).map(|b| b + w as usize).filter(|&t| t < targets.len() && targets[t].0 == (s, w))
}

impl State {
    fn hash_of(&mut self, key: u32) -> u64 {
        self.key_buf.clear();
        write_key(&mut self.key_buf, key, self.key_size);
        key_hash(&self.key_buf)
    }

    /// The target (connection) of a (server, worker), if the map has it.
    fn target_of(&self, owner: (u16, u16)) -> Option<usize> {
        target_of(&self.server_base, &self.targets, owner)
    }

    /// The target a key hash is sent to now: its owner's thread's connection (the owner's own
    /// unless its server's threads are known).
    fn route(&self, hash: u64) -> usize {
        let (_, owner) = self.router.route_hash(hash);
        self.target_of(self.router.conn_of(owner)).expect("the router's owners are workers of the map")
    }

    /// Write request `part` of its op to target `t`.
    fn send_part(&mut self, conns: &mut Conns<Part>, t: usize, part: Part) {
        let op = &self.ops[part.token as usize];
        let wbuf = conns.request(t, part);
        let keys = &op.keys[part.start as usize..(part.start + part.len) as usize];
        match part.expect {
            Expect::Line => {
                self.key_buf.clear();
                write_key(&mut self.key_buf, keys[0], self.key_size);
                write_set(wbuf, &self.key_buf, &self.value, op.value_size as usize);
            }
            _ => write_get(wbuf, keys.iter().copied(), self.key_size),
        }
        self.target_reqs[t] += 1;
    }

    /// Handle a redirect of `part`, sent by target `from`. Returns whether the op is still
    /// waiting for this part (resent) or the part is finished (as an error).
    fn on_redirect(&mut self, from: usize, part: Part, epoch: u64, to: (u16, u16)) -> bool {
        let token = part.token as usize;
        let range = part.start as usize..(part.start + part.len) as usize;
        if self.target_of(to).is_none() || !mbal_cluster::may_follow_redirect(u32::from(part.hops)) {
            self.ops[token].errors += 1;
            return false;
        }
        let rd = Redirect { epoch, to };
        let learned =
            self.router.learn(self.targets[from].0, rd, self.ops[token].hashes[range.clone()].iter().copied());
        let Ok(learned) = learned else {
            self.ops[token].errors += 1;
            return false;
        };
        // A redirect to another worker of the same server ends the sender's serving of its
        // thread-mates' keys (docs/protocol.md): `mbal hello ... threads` there again, which
        // also gives the thread count anew (until then a stale count, `threads_stale`, routes
        // that server per worker).
        let sender = self.targets[from].0;
        if to.0 == sender.0 && to != sender && !self.hellos.contains(&from) {
            self.hellos.push(from);
        }
        let hops = part.hops + 1;
        if learned.cachelet.is_some() {
            self.resend.push(Part { hops, ..part });
            return true;
        }
        // Not attributable: resend the part's keys split per cachelet (the router's rule).
        let op = &mut self.ops[token];
        self.router.split(op.hashes[range.clone()].iter().copied(), true, &mut self.split);
        self.regroup.clear();
        self.regroup.extend(
            self.split
                .all_positions()
                .iter()
                .map(|&p| (op.keys[range.start + p as usize], op.hashes[range.start + p as usize])),
        );
        for (i, &(k, h)) in self.regroup.iter().enumerate() {
            op.keys[range.start + i] = k;
            op.hashes[range.start + i] = h;
        }
        op.parts += self.split.groups().len() as u32 - 1;
        let mut start = part.start;
        for g in self.split.groups() {
            self.resend.push(Part { start, len: g.len() as u32, hops, ..part });
            start += g.len() as u32;
        }
        true
    }

    /// Handle the reply (from target `from`) to `part`.
    fn on_reply(&mut self, from: usize, part: Part, reply: Frame<'_>, out: &mut Vec<Completion>) {
        let token = part.token;
        let finished = match reply {
            Frame::Hello { server, threads, .. } if part.hello => {
                self.router.set_threads(server, threads);
                return;
            }
            _ if part.hello => return, // not an answer to learn from: stay as routed
            Frame::Hint(h) => {
                // only a home grants leases; a hint on a copy's reply is ignored (the home is
                // the key's owner as routed: the reply may come from a worker of its thread)
                if !part.copy {
                    let home = self.router.route_hash(key_hash(h.key)).1;
                    let slot = self.ops[token as usize].slot as usize;
                    self.leases[slot].record(
                        self.router.map(),
                        key_hash(h.key),
                        home,
                        h.replicas,
                        h.lease_ms,
                        self.now,
                    );
                }
                return;
            }
            Frame::End { items } if part.copy => {
                self.replica_reads += 1;
                self.ops[token as usize].hits += items;
                true
            }
            Frame::Redirect { .. } | Frame::Error(_) if part.copy => {
                // the copy is gone (or not there yet): read at home
                let op = &self.ops[token as usize];
                self.leases[op.slot as usize].end(op.hashes[part.start as usize]);
                self.replica_fallbacks += 1;
                self.resend.push(Part { copy: false, ..part });
                false
            }
            Frame::End { items } => {
                self.ops[token as usize].hits += items;
                true
            }
            Frame::Stored | Frame::Exists | Frame::NotFound => true,
            Frame::Redirect { epoch, server, worker } => !self.on_redirect(from, part, epoch, (server, worker)),
            _ => {
                self.ops[token as usize].errors += 1;
                true
            }
        };
        if finished {
            let op = &mut self.ops[token as usize];
            op.parts -= 1;
            if op.parts == 0 {
                out.push(Completion { token, hits: op.hits, errors: op.errors });
            }
        }
    }

    fn submit(&mut self, conns: &mut Conns<Part>, slot: usize, req: &Request<'_>) -> Result<()> {
        if req.keys.is_empty() {
            bail!("an op needs a key");
        }
        if req.value_size as usize > self.value.len() {
            bail!("value size {} above the driver's maximum {}", req.value_size, self.value.len());
        }
        let token = req.token;
        let slot = slot.min(self.leases.len() - 1);
        let expect = match req.kind {
            OpKind::Set => {
                if req.keys.len() != 1 {
                    bail!("set takes one key");
                }
                Expect::Line
            }
            OpKind::Get => Expect::Hits,
        };
        let mut hashes = std::mem::take(&mut self.hashes);
        hashes.clear();
        for &k in req.keys {
            hashes.push(self.hash_of(k));
        }
        // keys with a live lease on a copy are read there; a write ends the writer's lease
        let leases = &mut self.leases[slot];
        self.home_pos.clear();
        self.at_copy.clear();
        for (i, &h) in hashes.iter().enumerate() {
            let copy = match req.kind {
                OpKind::Set => {
                    leases.end(h);
                    None
                }
                OpKind::Get if leases.is_empty() => None,
                OpKind::Get => leases.read_target(h, self.now),
            };
            match copy.and_then(|c| target_of(&self.server_base, &self.targets, c)) {
                Some(t) => self.at_copy.push((req.keys[i], h, t)),
                None => self.home_pos.push(i as u32),
            }
        }
        // group the other keys by owning worker (request order within a worker)
        self.router.split(self.home_pos.iter().map(|&i| hashes[i as usize]), false, &mut self.split);
        let op = &mut self.ops[token as usize];
        op.keys.clear();
        op.hashes.clear();
        for &p in self.split.all_positions() {
            let i = self.home_pos[p as usize] as usize;
            op.keys.push(req.keys[i]);
            op.hashes.push(hashes[i]);
        }
        for &(k, h, _) in &self.at_copy {
            op.keys.push(k);
            op.hashes.push(h);
        }
        op.slot = slot as u32;
        op.value_size = req.value_size;
        op.parts = (self.split.groups().len() + self.at_copy.len()) as u32;
        op.hits = 0;
        op.errors = 0;
        let mut start = 0;
        for gi in 0..self.split.groups().len() {
            let g = self.split.groups()[gi];
            let t = self.target_of(g.owner).expect("the router's owners are workers of the map");
            let len = g.len() as u32;
            self.send_part(conns, t, Part { token, expect, start, len, hops: 0, copy: false, hello: false });
            start += len;
        }
        for ci in 0..self.at_copy.len() {
            let t = self.at_copy[ci].2;
            self.send_part(conns, t, Part { token, expect, start, len: 1, hops: 0, copy: true, hello: false });
            start += 1;
        }
        self.hashes = hashes;
        Ok(())
    }
}

impl Driver for RoutedDriver {
    fn target_names(&self) -> Vec<String> {
        self.r.targets.iter().map(|((s, w), _)| format!("s{s}/w{w}")).collect()
    }

    fn submit(&mut self, slot: usize, req: &Request<'_>) -> Result<()> {
        self.r.submit(&mut self.conns, slot, req)
    }

    fn flush(&mut self) -> Result<()> {
        self.conns.flush()
    }

    fn poll(&mut self, timeout: Duration, out: &mut Vec<Completion>) -> Result<()> {
        let r = &mut self.r;
        r.now = Instant::now();
        self.conns.poll(timeout, |ci, part, reply| r.on_reply(ci, part, reply, out))?;
        let hellos = !self.r.hellos.is_empty();
        while let Some(t) = self.r.hellos.pop() {
            let hello = Part { token: 0, expect: Expect::Line, start: 0, len: 0, hops: 0, copy: false, hello: true };
            let epoch = self.r.router.map().epoch();
            let w = self.r.targets[t].0 .1;
            let _ = write!(self.conns.request(t, hello), "mbal hello {epoch} {w} threads\r\n");
        }
        if !self.r.resend.is_empty() {
            let mut resend = std::mem::take(&mut self.r.resend);
            for part in resend.drain(..) {
                let hash = self.r.ops[part.token as usize].hashes[part.start as usize];
                let t = self.r.route(hash);
                self.r.send_part(&mut self.conns, t, part);
            }
            self.r.resend = resend;
            self.conns.flush()?;
        } else if hellos {
            self.conns.flush()?;
        }
        Ok(())
    }

    fn target_requests(&self) -> Vec<u64> {
        self.r.target_reqs.clone()
    }

    fn redirects(&self) -> u64 {
        self.r.router.redirects()
    }

    fn replica_reads(&self) -> u64 {
        self.r.replica_reads
    }

    fn replica_fallbacks(&self) -> u64 {
        self.r.replica_fallbacks
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mbal_cluster::ServerInfo;

    #[test]
    fn each_logical_client_draws_its_own_copy() {
        // 8 servers x 2 workers: a hot key can have up to 14 copies besides its home
        let addr: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let map = ClusterMap::even((0..8).map(|_| ServerInfo { main: addr, workers: vec![addr; 2] }).collect(), 2, 64);
        let hash = key_hash(b"hot");
        let (_, s, w) = map.route(hash);
        let home = (s, w);
        let now = Instant::now();
        let mut leases = slot_leases(64);
        assert_eq!(leases.len(), 64);
        let drawn: std::collections::BTreeSet<u32> =
            leases.iter_mut().map(|l| l.record(&map, hash, home, 14, 60_000, now).expect("a lease").copy).collect();
        // 64 clients over 15 copies: all but a few copies are drawn (one shared cache draws one)
        assert!(drawn.len() >= 10, "{drawn:?}");
        let reads: std::collections::BTreeSet<Option<(u16, u16)>> =
            leases.iter_mut().map(|l| l.read_target(hash, now)).collect();
        assert!(reads.len() >= 10, "the reads go to different workers: {reads:?}");
        assert_eq!(slot_leases(0).len(), 1, "at least one cache");
    }
}
