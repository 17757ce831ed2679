//! Drivers: how ops reach servers. The load loop ([`crate::engine`]) decides *when* to send and
//! measures; a [`Driver`] decides *where* and does the I/O. [`PlainDriver`] is a plain memcached
//! text-protocol client; [`crate::routed::RoutedDriver`] (mbal's routed mode: one connection
//! per worker, redirects followed) is a second implementation of the same trait.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Result};

use crate::conns::{connect_std, Conns};
use crate::workload::{write_key, KeySize};
use mbal_proto::client::{Expect, Frame};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    /// `get k1 [k2 ...]` (a multiget when it has several keys).
    Get,
    /// `set k 0 0 <value_size>`.
    Set,
}

/// One op handed to a driver. `token` is unique among the ops in flight on this driver
/// (it is below the `max_in_flight` given to the driver's constructor).
pub struct Request<'a> {
    pub kind: OpKind,
    pub keys: &'a [u32],
    pub token: u32,
    /// Value length of a SET (at most the `value_size_max` the driver was made for).
    pub value_size: u32,
}

/// A finished op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    pub token: u32,
    /// Keys found (gets only).
    pub hits: u32,
    /// Error replies (`ERROR`, `CLIENT_ERROR`, `SERVER_ERROR`, `NOT_STORED`).
    pub errors: u32,
}

/// A set of connections owned by one load thread, able to send ops and receive their results.
///
/// The load loop calls `submit` for each op (on a logical client `slot`), `flush` once per batch,
/// then `poll` to wait for results. Results of one slot need not arrive in submit order across
/// targets, but each op completes exactly once.
pub trait Driver {
    /// Names of the targets this driver counts requests for (servers, or workers later).
    fn target_names(&self) -> Vec<String>;
    /// Buffer one op on logical client `slot`.
    fn submit(&mut self, slot: usize, req: &Request<'_>) -> Result<()>;
    /// Start writing everything buffered (non-blocking; the rest goes out during `poll`).
    fn flush(&mut self) -> Result<()>;
    /// Wait up to `timeout` for replies, appending finished ops to `out`.
    fn poll(&mut self, timeout: Duration, out: &mut Vec<Completion>) -> Result<()>;
    /// Requests sent to each target so far (same order as `target_names`).
    fn target_requests(&self) -> Vec<u64>;
    /// Redirects followed so far (routed drivers; 0 for the others).
    fn redirects(&self) -> u64 {
        0
    }
    /// Reads served by a copy of a hot key (routed drivers; 0 for the others).
    fn replica_reads(&self) -> u64 {
        0
    }
    /// Reads sent to a copy that fell back to the home (routed drivers).
    fn replica_fallbacks(&self) -> u64 {
        0
    }
}

/// The bytes SET values are cut from: `max` `x`s (a value of length n is its first n bytes).
pub(crate) fn value_buffer(max: usize) -> Vec<u8> {
    vec![b'x'; max]
}

/// Append `set <key> 0 0 <n>\r\n<n bytes>\r\n` to `out`.
#[inline]
pub(crate) fn write_set(out: &mut Vec<u8>, key: &[u8], value: &[u8], n: usize) {
    out.extend_from_slice(b"set ");
    out.extend_from_slice(key);
    out.extend_from_slice(b" 0 0 ");
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(&value[..n]);
    out.extend_from_slice(b"\r\n");
}

/// Append `get <k1> <k2> ..\r\n` to `out`.
#[inline]
pub(crate) fn write_get(out: &mut Vec<u8>, keys: impl Iterator<Item = u32>, key_size: KeySize) {
    out.extend_from_slice(b"get");
    for k in keys {
        out.push(b' ');
        write_key(out, k, key_size);
    }
    out.extend_from_slice(b"\r\n");
}

/// Which server a key goes to in plain mode: `mbal_cluster::key_hash(key) % servers`.
pub fn server_of(key: &[u8], servers: usize) -> usize {
    if servers <= 1 {
        0
    } else {
        (mbal_cluster::key_hash(key) % servers as u64) as usize
    }
}

#[derive(Clone, Copy, Default)]
struct OpState {
    parts: u32,
    hits: u32,
    errors: u32,
}

/// Plain memcached text-protocol driver: for each logical client slot, one connection to each
/// server; a key goes to server `key_hash(key) % n` ([`server_of`]); a multiget is split per
/// server and completes when every part has answered.
pub struct PlainDriver {
    /// Connection `slot * servers + server`; each request waits as (op token, reply kind).
    conns: Conns<(u32, Expect)>,
    servers: Vec<SocketAddr>,
    key_size: KeySize,
    value: Vec<u8>,
    ops: Vec<OpState>,
    target_reqs: Vec<u64>,
    // scratch
    key_buf: Vec<u8>,
    key_server: Vec<u16>,
}

impl PlainDriver {
    /// Connect `slots` connections to each server. SET values are at most `value_size_max` bytes.
    pub fn connect(
        servers: &[SocketAddr],
        slots: usize,
        max_in_flight: usize,
        key_size: KeySize,
        value_size_max: usize,
    ) -> Result<PlainDriver> {
        PlainDriver::connect_tls(servers, None, slots, max_in_flight, key_size, value_size_max)
    }

    /// [`PlainDriver::connect`], over TLS with `tls`.
    pub fn connect_tls(
        servers: &[SocketAddr],
        tls: Option<&mbal_tls::ClientTls>,
        slots: usize,
        max_in_flight: usize,
        key_size: KeySize,
        value_size_max: usize,
    ) -> Result<PlainDriver> {
        if servers.is_empty() || servers.len() > u16::MAX as usize {
            bail!("need 1..65535 servers");
        }
        let mut conns = Conns::new("server", servers.to_vec(), slots * servers.len())?;
        for _slot in 0..slots {
            for (si, &addr) in servers.iter().enumerate() {
                conns.add(connect_std(addr, tls)?, si)?;
            }
        }
        Ok(PlainDriver {
            conns,
            servers: servers.to_vec(),
            key_size,
            value: value_buffer(value_size_max),
            ops: vec![OpState::default(); max_in_flight],
            target_reqs: vec![0; servers.len()],
            key_buf: Vec::with_capacity(256),
            key_server: Vec::new(),
        })
    }
}

impl Driver for PlainDriver {
    fn target_names(&self) -> Vec<String> {
        self.servers.iter().map(|s| s.to_string()).collect()
    }

    fn submit(&mut self, slot: usize, req: &Request<'_>) -> Result<()> {
        let n = self.servers.len();
        let op = &mut self.ops[req.token as usize];
        *op = OpState::default();
        match req.kind {
            OpKind::Set => {
                let &[key] = req.keys else { bail!("set takes one key") };
                self.key_buf.clear();
                write_key(&mut self.key_buf, key, self.key_size);
                let s = server_of(&self.key_buf, n);
                let ci = slot * n + s;
                let n = req.value_size as usize;
                if n > self.value.len() {
                    bail!("value size {n} above the driver's maximum {}", self.value.len());
                }
                let wbuf = self.conns.request(ci, (req.token, Expect::Line));
                write_set(wbuf, &self.key_buf, &self.value, n);
                op.parts = 1;
                self.target_reqs[s] += 1;
            }
            OpKind::Get => {
                if req.keys.is_empty() {
                    bail!("get needs a key");
                }
                if n == 1 {
                    let wbuf = self.conns.request(slot, (req.token, Expect::Hits));
                    write_get(wbuf, req.keys.iter().copied(), self.key_size);
                    op.parts = 1;
                    self.target_reqs[0] += 1;
                } else {
                    self.key_server.clear();
                    for &k in req.keys {
                        self.key_buf.clear();
                        write_key(&mut self.key_buf, k, self.key_size);
                        self.key_server.push(server_of(&self.key_buf, n) as u16);
                    }
                    let mut parts = 0;
                    for s in 0..n {
                        if !self.key_server.contains(&(s as u16)) {
                            continue;
                        }
                        let wbuf = self.conns.request(slot * n + s, (req.token, Expect::Hits));
                        let key_server = &self.key_server;
                        let keys = req.keys.iter().enumerate().filter(|&(i, _)| key_server[i] as usize == s);
                        write_get(wbuf, keys.map(|(_, &k)| k), self.key_size);
                        parts += 1;
                        self.target_reqs[s] += 1;
                    }
                    self.ops[req.token as usize].parts = parts;
                }
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        self.conns.flush()
    }

    fn poll(&mut self, timeout: Duration, out: &mut Vec<Completion>) -> Result<()> {
        let ops = &mut self.ops;
        self.conns.poll(timeout, |_, (token, _), reply| {
            let op = &mut ops[token as usize];
            match reply {
                // a plain connection never opted in to hints; one would be advice to ignore
                Frame::Hint(_) => return,
                Frame::End { items } => op.hits += items,
                Frame::Stored | Frame::Exists | Frame::NotFound => {}
                // a plain connection never opted in to redirects: count one as an error
                _ => op.errors += 1,
            }
            op.parts -= 1;
            if op.parts == 0 {
                out.push(Completion { token, hits: op.hits, errors: op.errors });
            }
        })
    }

    fn target_requests(&self) -> Vec<u64> {
        self.target_reqs.clone()
    }
}
