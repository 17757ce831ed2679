//! Multi-key operations of the routing client: `get_multi` and `set_multi`, split by
//! destination worker ([`mbal_cluster::Router::split`]), every destination's requests written
//! before any reply is read, processed in windows of [`MULTI_WINDOW`] keys (see the crate docs).

use crate::conn::{self, Conn};
use crate::{check_key, show_key, store_request, Client, Error, Peer, Result, Seen, Value, GET_BATCH, MULTI_WINDOW};
use mbal_cluster::{key_hash, Owner, Redirect, Split};
use mbal_proto::client::{Expect, OwnedValue, Reply};
use std::time::Instant;

impl Client {
    /// Multi-get: one `get` per owning worker (or per thread of a server's workers),
    /// pipelined across workers;
    /// results in the order of `keys` (duplicates allowed).
    pub fn get_multi(&mut self, keys: &[&[u8]]) -> Result<Vec<Option<Value>>> {
        for k in keys {
            check_key(k)?;
        }
        let mut out: Vec<Option<Value>> = vec![None; keys.len()];
        let hashes: Vec<u64> = keys.iter().map(|k| key_hash(k)).collect();
        for start in (0..keys.len()).step_by(MULTI_WINDOW) {
            let end = (start + MULTI_WINDOW).min(keys.len());
            self.get_window(keys, &hashes, start..end, &mut out)?;
        }
        self.refresh_threads();
        Ok(out)
    }

    fn get_window(
        &mut self,
        keys: &[&[u8]],
        hashes: &[u64],
        range: std::ops::Range<usize>,
        out: &mut [Option<Value>],
    ) -> Result<()> {
        let mut pending: Vec<usize> = range.collect();
        if !self.leases.is_empty() {
            pending = self.get_at_copies(keys, hashes, pending, out);
        }
        let mut split = Split::new();
        let mut rounds = 0;
        while !pending.is_empty() {
            // The first round groups keys per worker; a retry groups them per
            // cachelet, so each redirect names one cachelet (see `Router`).
            self.router.split(pending.iter().map(|&i| hashes[i]), rounds > 0, &mut split);
            // (server, worker) -> batches of key indices, one `get` each.
            let mut groups: Vec<(Owner, Vec<Vec<usize>>)> = Vec::new();
            for g in split.groups() {
                let idx: Vec<usize> = split.positions(g).iter().map(|&p| pending[p as usize]).collect();
                let batches = idx.chunks(GET_BATCH).map(<[usize]>::to_vec);
                match groups.last_mut() {
                    Some((o, b)) if *o == g.owner => b.extend(batches),
                    _ => groups.push((g.owner, batches.collect())),
                }
            }
            let mut first_err: Option<Error> = None;
            let epoch = self.router.map().epoch();
            // Keys to read again (redirected, or sent on a pooled connection the server had
            // closed), and keys of servers that could not be reached.
            let mut next = Vec::new();
            let mut lost: Vec<usize> = Vec::new();
            let mut lost_err = None;
            // Write phase: every worker's requests before any reply is read.
            let mut sent: Vec<(Conn, Vec<Vec<usize>>)> = Vec::new();
            for ((s, w), batches) in groups {
                let mut req = Vec::new();
                for b in &batches {
                    req.extend_from_slice(b"get");
                    for &i in b {
                        req.push(b' ');
                        req.extend_from_slice(keys[i]);
                    }
                    req.extend_from_slice(b"\r\n");
                }
                let res = match self.take_conn(s, w) {
                    Ok(mut c) => match c.send(&req) {
                        Ok(()) => Ok(c),
                        Err(e) => Err(self.conn_failed(c, e)),
                    },
                    Err(e) => Err(e),
                };
                match res {
                    Ok(c) => sent.push((c, batches)),
                    Err(e) => failed_keys(e, batches.concat(), &mut next, &mut lost, &mut lost_err, &mut first_err),
                }
            }
            // Read phase.
            let mut seen = Vec::new();
            for (mut conn, batches) in sent {
                let Peer::Worker { server: s, worker: w } = conn.peer else { unreachable!() };
                let mut failed = None;
                for (bi, b) in batches.iter().enumerate() {
                    let reply = conn.read_reply(Expect::Values);
                    self.record_hints(&mut conn, true);
                    match reply {
                        Ok(Reply::Values(vs)) => {
                            if let Err(detail) = assign(keys, b, vs, out) {
                                first_err.get_or_insert(Error::Protocol { addr: conn.addr, peer: conn.peer, detail });
                            }
                        }
                        Ok(Reply::Redirect { epoch, server, worker }) => {
                            let rd = Redirect { epoch, to: (server, worker) };
                            seen.push(Seen { from: (s, w), rd, hashes: b.iter().map(|&i| hashes[i]).collect() });
                            next.extend_from_slice(b);
                        }
                        Ok(Reply::Error(line)) => {
                            first_err.get_or_insert(Error::Server { addr: conn.addr, peer: conn.peer, line });
                        }
                        other => {
                            // The connection is in an unknown state: not reused.
                            failed = Some((conn.failure("get", other), bi));
                            break;
                        }
                    }
                }
                match failed {
                    None => {
                        self.put_conn(conn);
                        self.health.reachable(s);
                    }
                    Some((e, bi)) => {
                        let e = self.conn_failed(conn, e);
                        failed_keys(e, batches[bi..].concat(), &mut next, &mut lost, &mut lost_err, &mut first_err);
                    }
                }
            }
            if !lost.is_empty() {
                if self.router.map().epoch() != epoch {
                    // a refreshed map may have given them to live servers: once more
                    next.append(&mut lost);
                } else {
                    // a cache that cannot reach a key's server misses
                    self.stats.unreachable_misses += lost.len() as u64;
                }
            }
            next.sort_unstable();
            let first = next.first().map(|&i| keys[i]);
            self.end_round(first_err, first, seen, &mut rounds)?;
            pending = next;
        }
        Ok(())
    }

    /// The keys of `pending` whose live lease drew a copy are read there
    /// (one single-key `get` each, pipelined per copy, every copy's requests
    /// written before any reply is read); returns the keys left to read at
    /// home: those without such a lease and those a copy could not answer.
    fn get_at_copies(
        &mut self,
        keys: &[&[u8]],
        hashes: &[u64],
        pending: Vec<usize>,
        out: &mut [Option<Value>],
    ) -> Vec<usize> {
        let now = Instant::now();
        let mut home = Vec::with_capacity(pending.len());
        let mut at: Vec<(Owner, Vec<usize>)> = Vec::new();
        for i in pending {
            match self.leases.read_target(hashes[i], now) {
                Some(c) => match at.iter_mut().find(|(o, _)| *o == c) {
                    Some((_, v)) => v.push(i),
                    None => at.push((c, vec![i])),
                },
                None => home.push(i),
            }
        }
        let mut sent = Vec::new();
        for (copy, idx) in at {
            let mut req = Vec::new();
            for &i in &idx {
                req.extend_from_slice(b"get ");
                req.extend_from_slice(keys[i]);
                req.extend_from_slice(b"\r\n");
            }
            match self.take_conn(copy.0, copy.1).and_then(|mut c| c.send(&req).map(|()| c)) {
                Ok(c) => sent.push((c, copy, idx)),
                Err(_) => {
                    self.leases.copy_failed(copy, Instant::now(), mbal_cluster::COPY_RETRY);
                    self.stats.replica_fallbacks += idx.len() as u64;
                    home.extend(idx);
                }
            }
        }
        for (mut conn, copy, idx) in sent {
            let mut healthy = true;
            for (n, &i) in idx.iter().enumerate() {
                match conn.read_reply(Expect::Values) {
                    Ok(Reply::Values(vs)) if vs.len() <= 1 && vs.first().is_none_or(|v| v.key == keys[i]) => {
                        self.stats.replica_reads += 1;
                        out[i] = vs.into_iter().next().map(Value::from);
                    }
                    Ok(Reply::Redirect { .. } | Reply::Error(_)) => {
                        self.leases.end(hashes[i]);
                        self.stats.replica_fallbacks += 1;
                        home.push(i);
                    }
                    _ => {
                        // a broken stream or a dead copy: everything still unread goes home
                        self.leases.copy_failed(copy, Instant::now(), mbal_cluster::COPY_RETRY);
                        self.stats.replica_fallbacks += (idx.len() - n) as u64;
                        home.extend_from_slice(&idx[n..]);
                        healthy = false;
                        break;
                    }
                }
            }
            conn.take_hints();
            if healthy {
                self.put_conn(conn);
            }
        }
        home.sort_unstable();
        home
    }

    /// Multi-set: all of a worker's sets written back to back, pipelined
    /// across workers; one bool (stored) per item, in order.
    pub fn set_multi(&mut self, items: &[(&[u8], &[u8])], flags: u32, exptime: u32) -> Result<Vec<bool>> {
        for (k, _) in items {
            check_key(k)?;
        }
        for (k, _) in items {
            self.leases.end(key_hash(k));
        }
        let mut out = vec![false; items.len()];
        for start in (0..items.len()).step_by(MULTI_WINDOW) {
            let end = (start + MULTI_WINDOW).min(items.len());
            self.set_window(items, start..end, flags, exptime, &mut out)?;
        }
        self.refresh_threads();
        Ok(out)
    }

    fn set_window(
        &mut self,
        items: &[(&[u8], &[u8])],
        range: std::ops::Range<usize>,
        flags: u32,
        exptime: u32,
        out: &mut [bool],
    ) -> Result<()> {
        let base = range.start;
        let hashes: Vec<u64> = range.map(|i| key_hash(items[i].0)).collect();
        let hash_of = |i: usize| hashes[i - base];
        let mut pending: Vec<usize> = (base..base + hashes.len()).collect();
        let mut split = Split::new();
        let mut rounds = 0;
        while !pending.is_empty() {
            self.router.split(pending.iter().map(|&i| hash_of(i)), false, &mut split);
            let groups: Vec<(Owner, Vec<usize>)> = split
                .groups()
                .iter()
                .map(|g| (g.owner, split.positions(g).iter().map(|&p| pending[p as usize]).collect()))
                .collect();
            let mut first_err: Option<Error> = None;
            // Items to send again (redirected, or sent on a pooled connection the server had
            // closed: `set` may be repeated), and items of servers that could not be reached.
            let epoch = self.router.map().epoch();
            let mut next = Vec::new();
            let mut lost = Vec::new();
            let mut lost_err = None;
            let mut sent: Vec<(Conn, Vec<usize>)> = Vec::new();
            for ((s, w), group) in groups {
                let mut req = Vec::new();
                for &i in &group {
                    store_request(&mut req, "set", items[i].0, items[i].1, flags, exptime, None);
                }
                let res = match self.take_conn(s, w) {
                    Ok(mut c) => match c.send(&req) {
                        Ok(()) => Ok(c),
                        Err(e) => Err(self.conn_failed(c, e)),
                    },
                    Err(e) => Err(e),
                };
                match res {
                    Ok(c) => sent.push((c, group)),
                    Err(e) => failed_keys(e, group, &mut next, &mut lost, &mut lost_err, &mut first_err),
                }
            }
            let mut seen = Vec::new();
            for (mut conn, group) in sent {
                let Peer::Worker { server: s, worker: w } = conn.peer else { unreachable!() };
                let mut failed = None;
                for (n, &i) in group.iter().enumerate() {
                    match conn.read_reply(Expect::Line) {
                        Ok(Reply::Stored) => out[i] = true,
                        Ok(Reply::NotStored) => out[i] = false,
                        Ok(Reply::Redirect { epoch, server, worker }) => {
                            let rd = Redirect { epoch, to: (server, worker) };
                            seen.push(Seen { from: (s, w), rd, hashes: vec![hash_of(i)] });
                            next.push(i);
                        }
                        Ok(Reply::Error(line)) => {
                            first_err.get_or_insert(Error::Server { addr: conn.addr, peer: conn.peer, line });
                        }
                        other => {
                            // The connection is in an unknown state: not reused.
                            failed = Some((conn.failure("set", other), n));
                            break;
                        }
                    }
                }
                match failed {
                    None => {
                        self.put_conn(conn);
                        self.health.reachable(s);
                    }
                    Some((e, n)) => {
                        let e = self.conn_failed(conn, e);
                        failed_keys(e, group[n..].to_vec(), &mut next, &mut lost, &mut lost_err, &mut first_err);
                    }
                }
            }
            if !lost.is_empty() {
                if self.router.map().epoch() != epoch {
                    // a refreshed map may have given them to live servers: once more
                    next.append(&mut lost);
                } else if let Some(e) = lost_err {
                    // a write to a server that cannot be reached fails (the call's error names it)
                    self.stats.unreachable_errors += lost.len() as u64;
                    first_err.get_or_insert(e);
                }
            }
            next.sort_unstable();
            let first = next.first().map(|&i| items[i].0);
            self.end_round(first_err, first, seen, &mut rounds)?;
            pending = next;
        }
        Ok(())
    }
}

/// Where the keys of a request that failed with `e` go: to be sent again when their pooled
/// connection had been closed by the server (a fresh one is pooled), to `lost` when their
/// server could not be reached (its error kept in `lost_err`), else the error is the round's.
fn failed_keys(
    e: Error,
    keys: Vec<usize>,
    next: &mut Vec<usize>,
    lost: &mut Vec<usize>,
    lost_err: &mut Option<Error>,
    first_err: &mut Option<Error>,
) {
    if matches!(e, Error::Unreachable { .. }) {
        lost.extend(keys);
        lost_err.get_or_insert(e);
    } else if conn::was_closed(&e) {
        next.extend(keys);
    } else {
        first_err.get_or_insert(e);
    }
}

/// Put the values of one `get` reply into `out`, matching them to the
/// batch's keys in order (the server returns hits in request order).
pub(crate) fn assign(
    keys: &[&[u8]],
    batch: &[usize],
    vs: Vec<OwnedValue>,
    out: &mut [Option<Value>],
) -> std::result::Result<(), String> {
    let mut j = 0;
    for v in vs {
        while j < batch.len() && keys[batch[j]] != v.key.as_slice() {
            j += 1;
        }
        if j == batch.len() {
            return Err(format!("get returned key {:?} out of order or not asked for", show_key(&v.key)));
        }
        out[batch[j]] = Some(v.into());
        j += 1;
    }
    Ok(())
}
