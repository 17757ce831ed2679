//! Routed mode (`mbal bench --routed`): the client does mbal's routing itself.
//!
//! [`RoutedFactory`] holds a [`ClusterMap`] (fetched with `mbal map` from any one server by
//! [`RoutedFactory::connect`], or given by the caller with [`RoutedFactory::with_map`], e.g. an
//! older map to exercise redirects). Each client thread's [`RoutedDriver`] opens, per logical
//! client, one connection to EVERY worker's own port (`map.worker_addr(s, w)`), opts in with
//! `mbal hello <epoch>` and checks the `MBAL <server> <worker> <epoch>` answer.
//!
//! Every op is routed by `key_hash(key)` → cachelet → owning (server, worker), from the map plus
//! the owners this driver learned from redirects. A multiget is split per owning worker (one
//! `get k1 k2 ..` per worker; the op's keys are regrouped by owner so each part is a contiguous
//! range of the op's key list) and counts as one op.
//!
//! A reply `RD <epoch> <server> <worker>` replaces the whole reply of a request:
//! * single-key request: the key's cachelet is now owned by (`server`, `worker`); the driver
//!   records that and resends the request there;
//! * multi-key get: the server names the owner of the *first* key it does not own, which the
//!   client cannot identify, so each key of that part is resent as its own `get` to its current
//!   route; the keys that moved are then redirected one by one and learned exactly.
//!
//! Each request chain follows at most [`MAX_REDIRECTS`] redirects (for a multiget: per key),
//! then the part counts as an error. Per-worker request counts are reported as targets named
//! `s<server>/w<worker>`, and followed redirects in `Totals::redirects`.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream as StdStream};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use mbal_cluster::{key_hash, CacheletId, ClusterMap};
use mio::net::TcpStream;
use mio::{Events, Interest, Poll, Token};

use crate::driver::{value_buffer, write_set, Completion, Driver, OpKind, Request};
use crate::reply::{Expect, Reply, ReplyParser};
use crate::workload::write_key;
use crate::{DriverFactory, DriverSpec};

/// Redirects one request chain may follow before it counts as an error.
pub const MAX_REDIRECTS: u8 = 3;

const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// Read one `\n`-terminated line from a blocking stream (byte by byte: the line is the only
/// thing the server sends, and nothing after it may be consumed).
fn read_line(s: &mut StdStream, max: usize) -> Result<String> {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    loop {
        let n = s.read(&mut b).context("read")?;
        if n == 0 {
            bail!("connection closed (got {:?})", String::from_utf8_lossy(&line));
        }
        line.push(b[0]);
        if b[0] == b'\n' {
            break;
        }
        if line.len() > max {
            bail!("reply line too long");
        }
    }
    Ok(String::from_utf8_lossy(&line).trim_end().to_string())
}

/// Fetch the cluster map from any mbal server with `mbal map`.
pub fn fetch_map(addr: SocketAddr) -> Result<ClusterMap> {
    let mut s = StdStream::connect_timeout(&addr, IO_TIMEOUT).with_context(|| format!("connect to {addr}"))?;
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.write_all(b"mbal map\r\n")?;
    let line = read_line(&mut s, 4096).with_context(|| format!("mbal map from {addr}"))?;
    let mut it = line.split_whitespace();
    let (Some("MAP"), Some(_epoch), Some(n), None) = (it.next(), it.next(), it.next(), it.next()) else {
        bail!("{addr} answered `mbal map` with {line:?}: not an mbal server?");
    };
    let n: usize = n.parse().with_context(|| format!("bad MAP line {line:?}"))?;
    if n > 256 << 20 {
        bail!("map of {n} bytes is implausible");
    }
    let mut body = vec![0; n + 2];
    s.read_exact(&mut body).context("read map body")?;
    if &body[n..] != b"\r\n" {
        bail!("map body not terminated by CRLF");
    }
    let text = std::str::from_utf8(&body[..n]).context("map is not UTF-8")?;
    ClusterMap::from_json(text).map_err(|e| anyhow::anyhow!("bad map from {addr}: {e}"))
}

/// Makes [`RoutedDriver`]s over one cluster map.
pub struct RoutedFactory {
    map: ClusterMap,
}

impl RoutedFactory {
    /// Fetch the map from `server` (any server of the cluster). Every worker address in the map
    /// must be a loopback address unless `allow_non_loopback`.
    pub fn connect(server: SocketAddr, allow_non_loopback: bool) -> Result<RoutedFactory> {
        let map = fetch_map(server)?;
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
        Ok(RoutedFactory { map })
    }

    /// Start from a given map (possibly older than the servers': redirects correct it).
    pub fn with_map(map: ClusterMap) -> RoutedFactory {
        RoutedFactory { map }
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
        Ok(Box::new(RoutedDriver::connect(
            &self.map,
            spec.slots,
            spec.max_in_flight,
            a.key_size,
            a.value_size_max.unwrap_or(a.value_size).max(a.value_size),
        )?))
    }
}

/// One request on the wire, waiting for its reply.
#[derive(Clone, Copy)]
struct Part {
    token: u32,
    expect: Expect,
    /// Range of the op's (owner-grouped) key list this request carries.
    start: u32,
    len: u32,
    /// Redirects this request chain followed so far.
    hops: u8,
}

struct Conn {
    stream: TcpStream,
    target: usize,
    wbuf: Vec<u8>,
    wpos: usize,
    rbuf: Vec<u8>,
    rstart: usize,
    rend: usize,
    parser: ReplyParser,
    pending: VecDeque<Part>,
}

#[derive(Default)]
struct OpState {
    value_size: u32,
    /// The op's keys, grouped by owning worker at submit time.
    keys: Vec<u32>,
    parts: u32,
    hits: u32,
    errors: u32,
}

/// Routed mbal driver: one connection per (logical client, worker), ops routed by the cluster map
/// plus learned redirects. See the module docs.
pub struct RoutedDriver {
    poll: Poll,
    events: Events,
    conns: Vec<Conn>,
    /// (server, worker) of each target, and its address.
    targets: Vec<((u16, u16), SocketAddr)>,
    /// First target index of each server.
    server_base: Vec<usize>,
    map: ClusterMap,
    /// Cachelet -> target index (the map's owner, or what a redirect taught).
    owner: Vec<u32>,
    key_size: usize,
    value: Vec<u8>,
    ops: Vec<OpState>,
    target_reqs: Vec<u64>,
    redirects: u64,
    // scratch
    key_buf: Vec<u8>,
    grouped: Vec<(u32, u32)>,
    ready: Vec<(usize, bool, bool)>,
    resend: Vec<(usize, Part)>,
}

impl RoutedDriver {
    /// Open `slots` connections to every worker of `map`, each opted in with `mbal hello`.
    pub fn connect(
        map: &ClusterMap,
        slots: usize,
        max_in_flight: usize,
        key_size: usize,
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
        let layout = map.layout();
        let owner = (0..layout.cachelet_count())
            .map(|c| {
                let (s, w) = layout.owner(c);
                let t = server_base.get(s as usize).map(|b| b + w as usize).filter(|&t| t < targets.len());
                t.map(|t| t as u32).with_context(|| format!("cachelet {c} owned by unknown worker s{s}/w{w}"))
            })
            .collect::<Result<Vec<u32>>>()?;
        let poll = Poll::new()?;
        let mut conns = Vec::with_capacity(slots * targets.len());
        for _slot in 0..slots {
            for (ti, &((s, w), addr)) in targets.iter().enumerate() {
                let mut std =
                    StdStream::connect_timeout(&addr, IO_TIMEOUT).with_context(|| format!("connect to {addr}"))?;
                std.set_nodelay(true)?;
                std.set_read_timeout(Some(IO_TIMEOUT))?;
                std.write_all(format!("mbal hello {}\r\n", map.epoch()).as_bytes())?;
                let line = read_line(&mut std, 256).with_context(|| format!("mbal hello to {addr}"))?;
                let f: Vec<&str> = line.split_whitespace().collect();
                let ok = f.len() == 4
                    && f[0] == "MBAL"
                    && f[1].parse::<u16>().ok() == Some(s)
                    && f[2].parse::<u16>().ok() == Some(w)
                    && f[3].parse::<u64>().is_ok();
                if !ok {
                    bail!("{addr} (s{s}/w{w} in the map) answered `mbal hello` with {line:?}");
                }
                std.set_read_timeout(None)?;
                std.set_nonblocking(true)?;
                let mut stream = TcpStream::from_std(std);
                let id = conns.len();
                poll.registry().register(&mut stream, Token(id), Interest::READABLE | Interest::WRITABLE)?;
                conns.push(Conn {
                    stream,
                    target: ti,
                    wbuf: Vec::with_capacity(64 * 1024),
                    wpos: 0,
                    rbuf: vec![0; 256 * 1024],
                    rstart: 0,
                    rend: 0,
                    parser: ReplyParser::new(),
                    pending: VecDeque::new(),
                });
            }
        }
        let n = targets.len();
        Ok(RoutedDriver {
            poll,
            events: Events::with_capacity(1024),
            conns,
            targets,
            server_base,
            map: map.clone(),
            owner,
            key_size,
            value: value_buffer(value_size_max),
            ops: (0..max_in_flight).map(|_| OpState::default()).collect(),
            target_reqs: vec![0; n],
            redirects: 0,
            key_buf: Vec::with_capacity(256),
            grouped: Vec::new(),
            ready: Vec::new(),
            resend: Vec::new(),
        })
    }

    fn cachelet_of(&mut self, key: u32) -> CacheletId {
        self.key_buf.clear();
        write_key(&mut self.key_buf, key, self.key_size);
        self.map.layout().cachelet_of_hash(key_hash(&self.key_buf))
    }

    fn route(&mut self, key: u32) -> usize {
        let c = self.cachelet_of(key);
        self.owner[c as usize] as usize
    }

    /// Write request `part` of its op to target `t` on logical client `slot`.
    fn send_part(&mut self, slot: usize, t: usize, part: Part) {
        let op = &self.ops[part.token as usize];
        let c = &mut self.conns[slot * self.targets.len() + t];
        let keys = &op.keys[part.start as usize..(part.start + part.len) as usize];
        match part.expect {
            Expect::Store => {
                self.key_buf.clear();
                write_key(&mut self.key_buf, keys[0], self.key_size);
                write_set(&mut c.wbuf, &self.key_buf, &self.value, op.value_size as usize);
            }
            Expect::Get => {
                c.wbuf.extend_from_slice(b"get");
                for &k in keys {
                    c.wbuf.push(b' ');
                    write_key(&mut c.wbuf, k, self.key_size);
                }
                c.wbuf.extend_from_slice(b"\r\n");
            }
        }
        c.pending.push_back(part);
        self.target_reqs[t] += 1;
    }

    /// Handle a redirect of `part` (received on logical client `slot`). Returns whether the op
    /// is still waiting for this part (resent) or the part is finished (as an error).
    fn on_redirect(&mut self, slot: usize, part: Part, server: u16, worker: u16) -> bool {
        let target = self
            .server_base
            .get(server as usize)
            .map(|b| b + worker as usize)
            .filter(|&t| t < self.targets.len() && self.targets[t].0 == (server, worker));
        let (Some(target), true) = (target, part.hops < MAX_REDIRECTS) else {
            self.ops[part.token as usize].errors += 1;
            return false;
        };
        self.redirects += 1;
        let hops = part.hops + 1;
        if part.len == 1 {
            let key = self.ops[part.token as usize].keys[part.start as usize];
            let c = self.cachelet_of(key);
            self.owner[c as usize] = target as u32;
            self.resend.push((slot, Part { hops, ..part }));
        } else {
            // which key moved is unknown: resend each key alone to its current route
            self.ops[part.token as usize].parts += part.len - 1;
            for i in 0..part.len {
                self.resend.push((slot, Part { start: part.start + i, len: 1, hops, ..part }));
            }
        }
        true
    }

    fn read_conn(&mut self, ci: usize, out: &mut Vec<Completion>) -> Result<()> {
        let nt = self.targets.len();
        loop {
            let c = &mut self.conns[ci];
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
            let addr = self.targets[c.target].1;
            let n = match c.stream.read(&mut c.rbuf[c.rend..]) {
                Ok(0) => bail!("worker {addr} closed the connection"),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e).with_context(|| format!("read from {addr}")),
            };
            c.rend += n;
            loop {
                let c = &mut self.conns[ci];
                let Some(&part) = c.pending.front() else {
                    if c.rstart < c.rend {
                        bail!("worker {addr} sent data with no request pending");
                    }
                    break;
                };
                let (used, reply) = c
                    .parser
                    .parse(&c.rbuf[c.rstart..c.rend], part.expect)
                    .map_err(|e| anyhow::anyhow!("{addr}: {e}"))?;
                c.rstart += used;
                let Some(reply) = reply else { break };
                c.pending.pop_front();
                let token = part.token;
                let finished = match reply {
                    Reply::Get { hits } => {
                        self.ops[token as usize].hits += hits;
                        true
                    }
                    Reply::Stored | Reply::Exists | Reply::NotFound => true,
                    Reply::NotStored | Reply::Error => {
                        self.ops[token as usize].errors += 1;
                        true
                    }
                    Reply::Redirect { server, worker, .. } => !self.on_redirect(ci / nt, part, server, worker),
                };
                if finished {
                    let op = &mut self.ops[token as usize];
                    op.parts -= 1;
                    if op.parts == 0 {
                        out.push(Completion { token, hits: op.hits, errors: op.errors });
                    }
                }
            }
            let c = &mut self.conns[ci];
            if c.rstart == c.rend {
                c.rstart = 0;
                c.rend = 0;
            }
            if n < space {
                return Ok(());
            }
        }
    }

    fn write_conn(&mut self, ci: usize) -> Result<()> {
        let c = &mut self.conns[ci];
        while c.wpos < c.wbuf.len() {
            match c.stream.write(&c.wbuf[c.wpos..]) {
                Ok(0) => bail!("write returned 0"),
                Ok(n) => c.wpos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e).with_context(|| format!("write to {}", self.targets[c.target].1)),
            }
        }
        c.wbuf.clear();
        c.wpos = 0;
        Ok(())
    }
}

impl Driver for RoutedDriver {
    fn target_names(&self) -> Vec<String> {
        self.targets.iter().map(|((s, w), _)| format!("s{s}/w{w}")).collect()
    }

    fn submit(&mut self, slot: usize, req: &Request<'_>) -> Result<()> {
        if req.keys.is_empty() {
            bail!("an op needs a key");
        }
        if req.value_size as usize > self.value.len() {
            bail!("value size {} above the driver's maximum {}", req.value_size, self.value.len());
        }
        let token = req.token;
        let mut keys = std::mem::take(&mut self.ops[token as usize].keys);
        keys.clear();
        let expect = match req.kind {
            OpKind::Set => {
                if req.keys.len() != 1 {
                    bail!("set takes one key");
                }
                Expect::Store
            }
            OpKind::Get => Expect::Get,
        };
        // group the keys by owning worker (stable: request order within a worker)
        let mut grouped = std::mem::take(&mut self.grouped);
        grouped.clear();
        for &k in req.keys {
            let t = self.route(k) as u32;
            grouped.push((t, k));
        }
        if grouped.len() > 1 {
            grouped.sort_by_key(|&(t, _)| t);
        }
        keys.extend(grouped.iter().map(|&(_, k)| k));
        let op = &mut self.ops[token as usize];
        *op = OpState { value_size: req.value_size, keys, parts: 0, hits: 0, errors: 0 };
        let mut i = 0;
        while i < grouped.len() {
            let t = grouped[i].0;
            let mut j = i + 1;
            while j < grouped.len() && grouped[j].0 == t {
                j += 1;
            }
            self.ops[token as usize].parts += 1;
            self.send_part(slot, t as usize, Part { token, expect, start: i as u32, len: (j - i) as u32, hops: 0 });
            i = j;
        }
        self.grouped = grouped;
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        for ci in 0..self.conns.len() {
            if self.conns[ci].wpos < self.conns[ci].wbuf.len() {
                self.write_conn(ci)?;
            }
        }
        Ok(())
    }

    fn poll(&mut self, timeout: Duration, out: &mut Vec<Completion>) -> Result<()> {
        match self.poll.poll(&mut self.events, Some(timeout)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        let mut ready = std::mem::take(&mut self.ready);
        ready.clear();
        ready.extend(self.events.iter().map(|e| (e.token().0, e.is_readable() || e.is_read_closed(), e.is_writable())));
        for &(ci, r, w) in &ready {
            if w && self.conns[ci].wpos < self.conns[ci].wbuf.len() {
                self.write_conn(ci)?;
            }
            if r {
                self.read_conn(ci, out)?;
            }
        }
        self.ready = ready;
        if !self.resend.is_empty() {
            let mut resend = std::mem::take(&mut self.resend);
            for (slot, part) in resend.drain(..) {
                let key = self.ops[part.token as usize].keys[part.start as usize];
                let t = self.route(key);
                self.send_part(slot, t, part);
            }
            self.resend = resend;
            self.flush()?;
        }
        Ok(())
    }

    fn target_requests(&self) -> Vec<u64> {
        self.target_reqs.clone()
    }

    fn redirects(&self) -> u64 {
        self.redirects
    }
}
