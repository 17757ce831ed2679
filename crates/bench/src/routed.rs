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

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream as StdStream};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use mbal_cluster::{key_hash, CacheletId, ClusterMap};

use crate::conns::{connect_std, Conns, Pending, IO_TIMEOUT};
use crate::driver::{value_buffer, write_get, write_set, Completion, Driver, OpKind, Request};
use crate::reply::{Expect, Reply};
use crate::workload::write_key;
use crate::{DriverFactory, DriverSpec};

/// Redirects one request chain may follow before it counts as an error.
pub const MAX_REDIRECTS: u8 = 3;

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

impl Pending for Part {
    fn expect(&self) -> Expect {
        self.expect
    }
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

/// Routed mbal driver: one connection per worker, shared by the logical clients, ops routed by
/// the cluster map plus learned redirects. See the module docs.
pub struct RoutedDriver {
    /// Connection `target`.
    conns: Conns<Part>,
    /// Everything but the connections (borrowed apart from them while replies are handled).
    r: Router,
}

/// The routing state of a [`RoutedDriver`].
struct Router {
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
    resend: Vec<Part>,
}

impl RoutedDriver {
    /// Open a connection to every worker of `map`, each opted in with `mbal hello`.
    pub fn connect(
        map: &ClusterMap,
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
        let owner = (0..map.cachelet_count())
            .map(|c| {
                let (s, w) = map.owner(c);
                let t = server_base.get(s as usize).map(|b| b + w as usize).filter(|&t| t < targets.len());
                t.map(|t| t as u32).with_context(|| format!("cachelet {c} owned by unknown worker s{s}/w{w}"))
            })
            .collect::<Result<Vec<u32>>>()?;
        let addrs = targets.iter().map(|&(_, a)| a).collect();
        let mut conns = Conns::new("worker", addrs, targets.len())?;
        for (ti, &((s, w), addr)) in targets.iter().enumerate() {
            let mut std = connect_std(addr)?;
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
            conns.add(std, ti)?;
        }
        let n = targets.len();
        let r = Router {
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
            resend: Vec::new(),
        };
        Ok(RoutedDriver { conns, r })
    }
}

impl Router {
    fn cachelet_of(&mut self, key: u32) -> CacheletId {
        self.key_buf.clear();
        write_key(&mut self.key_buf, key, self.key_size);
        self.map.keyspace().cachelet_of_hash(key_hash(&self.key_buf))
    }

    fn route(&mut self, key: u32) -> usize {
        let c = self.cachelet_of(key);
        self.owner[c as usize] as usize
    }

    /// Write request `part` of its op to target `t`.
    fn send_part(&mut self, conns: &mut Conns<Part>, t: usize, part: Part) {
        let op = &self.ops[part.token as usize];
        let wbuf = conns.request(t, part);
        let keys = &op.keys[part.start as usize..(part.start + part.len) as usize];
        match part.expect {
            Expect::Store => {
                self.key_buf.clear();
                write_key(&mut self.key_buf, keys[0], self.key_size);
                write_set(wbuf, &self.key_buf, &self.value, op.value_size as usize);
            }
            Expect::Get => write_get(wbuf, keys.iter().copied(), self.key_size),
        }
        self.target_reqs[t] += 1;
    }

    /// Handle a redirect of `part`. Returns whether the op is still waiting for this part
    /// (resent) or the part is finished (as an error).
    fn on_redirect(&mut self, part: Part, server: u16, worker: u16) -> bool {
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
            self.resend.push(Part { hops, ..part });
        } else {
            // which key moved is unknown: resend each key alone to its current route
            self.ops[part.token as usize].parts += part.len - 1;
            for i in 0..part.len {
                self.resend.push(Part { start: part.start + i, len: 1, hops, ..part });
            }
        }
        true
    }

    /// Handle the reply to `part`.
    fn on_reply(&mut self, part: Part, reply: Reply, out: &mut Vec<Completion>) {
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
            Reply::Redirect { server, worker, .. } => !self.on_redirect(part, server, worker),
        };
        if finished {
            let op = &mut self.ops[token as usize];
            op.parts -= 1;
            if op.parts == 0 {
                out.push(Completion { token, hits: op.hits, errors: op.errors });
            }
        }
    }

    fn submit(&mut self, conns: &mut Conns<Part>, req: &Request<'_>) -> Result<()> {
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
            self.send_part(conns, t as usize, Part { token, expect, start: i as u32, len: (j - i) as u32, hops: 0 });
            i = j;
        }
        self.grouped = grouped;
        Ok(())
    }
}

impl Driver for RoutedDriver {
    fn target_names(&self) -> Vec<String> {
        self.r.targets.iter().map(|((s, w), _)| format!("s{s}/w{w}")).collect()
    }

    fn submit(&mut self, _slot: usize, req: &Request<'_>) -> Result<()> {
        self.r.submit(&mut self.conns, req)
    }

    fn flush(&mut self) -> Result<()> {
        self.conns.flush()
    }

    fn poll(&mut self, timeout: Duration, out: &mut Vec<Completion>) -> Result<()> {
        let r = &mut self.r;
        self.conns.poll(timeout, |_, part, reply| r.on_reply(part, reply, out))?;
        if !self.r.resend.is_empty() {
            let mut resend = std::mem::take(&mut self.r.resend);
            for part in resend.drain(..) {
                let key = self.r.ops[part.token as usize].keys[part.start as usize];
                let t = self.r.route(key);
                self.r.send_part(&mut self.conns, t, part);
            }
            self.r.resend = resend;
            self.conns.flush()?;
        }
        Ok(())
    }

    fn target_requests(&self) -> Vec<u64> {
        self.r.target_reqs.clone()
    }

    fn redirects(&self) -> u64 {
        self.r.redirects
    }
}
