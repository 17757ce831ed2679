//! The client side of a proxy thread: accepting, reading and parsing
//! client requests, routing each key (one place: `dispatch`), reply slots
//! in request order, and writing replies back.

use super::*;

impl Engine {
    pub(super) fn accept(&mut self) {
        loop {
            let (mut sock, _) = match self.listener.accept() {
                Ok(x) => x,
                Err(e) if would_block(&e) => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::warn!("proxy accept: {e}");
                    return;
                }
            };
            let prev = self.shared.curr_connections.fetch_add(1, Ordering::Relaxed);
            if prev as usize >= self.cfg.max_conns {
                self.shared.curr_connections.fetch_sub(1, Ordering::Relaxed);
                self.counters.rejected_connections += 1;
                if self.cfg.tls.is_none() {
                    // (never plaintext on a TLS port: just the close)
                    let _ = sock.write(b"ERROR Too many open connections\r\n");
                }
                continue;
            }
            let _ = sock.set_nodelay(true);
            let mut sock = match &self.cfg.tls {
                None => Stream::Plain(sock),
                Some(tls) => match tls.accept() {
                    Ok(conn) => Stream::tls(conn, sock),
                    Err(e) => {
                        tracing::warn!("proxy: TLS: {e}");
                        self.shared.curr_connections.fetch_sub(1, Ordering::Relaxed);
                        continue;
                    }
                },
            };
            let entry = self.clients.vacant_entry();
            let ci = entry.key();
            if self
                .poll
                .registry()
                .register(sock.sock_mut(), Token(CLIENT_BASE + ci), Interest::READABLE | Interest::WRITABLE)
                .is_err()
            {
                self.shared.curr_connections.fetch_sub(1, Ordering::Relaxed);
                continue;
            }
            self.counters.total_connections += 1;
            let id = self.next_cid;
            self.next_cid += 1;
            entry.insert(Client {
                sock,
                id,
                rbuf: Vec::new(),
                rpos: 0,
                rend: 0,
                swallow: 0,
                wbuf: Vec::new(),
                wpos: 0,
                wend: 0,
                batch: 0,
                slots: VecDeque::new(),
                base: 0,
                closing: false,
                paused: false,
                blocked: false,
                dirty: false,
                fresh: true,
                binary: false,
                leases: Leases::new(
                    self.lease_seed ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15),
                    mbal_cluster::DEFAULT_MAX_LEASES,
                ),
            });
        }
    }

    pub(super) fn close_client(&mut self, ci: usize) {
        if let Some(mut c) = self.clients.try_remove(ci) {
            c.sock.close_notify();
            let _ = self.poll.registry().deregister(c.sock.sock_mut());
            self.shared.curr_connections.fetch_sub(1, Ordering::Relaxed);
        }
    }

    pub(super) fn mark_client(&mut self, ci: usize) {
        if let Some(c) = self.clients.get_mut(ci) {
            if !c.dirty {
                c.dirty = true;
                self.dirty_clients.push(ci);
            }
        }
    }

    /// Read what the client sent and handle every complete request.
    pub(super) fn read_client(&mut self, ci: usize) {
        if let Some(c) = self.clients.get_mut(ci) {
            c.batch += 1;
        }
        loop {
            let Some(c) = self.clients.get_mut(ci) else { return };
            if c.closing || c.paused || c.blocked {
                return;
            }
            let r = fill(&mut c.sock, &mut c.rbuf, &mut c.rpos, &mut c.rend);
            match r {
                Ok((0, _)) => {
                    // the client is gone (or half-closed): its replies can no longer matter
                    self.close_client(ci);
                    return;
                }
                Ok((n, drained)) => {
                    self.counters.bytes_read += n as u64;
                    self.handle_input(ci);
                    if drained {
                        // a short read emptied the socket: the next edge says when there is more
                        return;
                    }
                }
                Err(e) if would_block(&e) => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    self.close_client(ci);
                    return;
                }
            }
        }
    }

    pub(super) fn handle_input(&mut self, ci: usize) {
        let Some(c) = self.clients.get_mut(ci) else { return };
        if c.fresh && c.rend > c.rpos {
            c.fresh = false;
            c.binary = mbal_proto::detect(c.rbuf[c.rpos]) == Protocol::Binary;
        }
        let proto = if c.binary { Protocol::Binary } else { Protocol::Text };
        let rbuf_all = std::mem::take(&mut c.rbuf);
        let rbuf = &rbuf_all[..c.rend];
        let mut rpos = c.rpos;
        loop {
            let Some(c) = self.clients.get_mut(ci) else { return };
            if c.swallow > 0 {
                let n = c.swallow.min(rbuf.len() - rpos);
                c.swallow -= n;
                rpos += n;
            }
            if rpos == rbuf.len() || c.closing {
                break;
            }
            if c.slots.len() >= self.cfg.max_pending {
                c.paused = true;
                break;
            }
            if c.blocked {
                if c.slots.iter().any(|s| s.parts > 0) {
                    break;
                }
                c.blocked = false;
            }
            match mbal_proto::parse(proto, &rbuf[rpos..], &self.limits) {
                Parsed::NeedMore => break,
                Parsed::Err { reply, skip, close } => {
                    let mut out = Vec::new();
                    reply.write(&mut out);
                    // memcached drops the old value of a key whose new one was
                    // refused (the servers' rule, applied at the owner)
                    if proto == Protocol::Text {
                        if let Some(key) = mbal_proto::key_to_unlink_on_too_large(&rbuf[rpos..]) {
                            self.unlink(key);
                        }
                    }
                    let c = self.clients.get_mut(ci).unwrap();
                    push_ready(c, out);
                    let avail = rbuf.len() - rpos;
                    rpos += skip.min(avail);
                    c.swallow = skip.saturating_sub(avail);
                    if close {
                        c.closing = true;
                    }
                    self.mark_client(ci);
                }
                Parsed::Req { req, consumed } => {
                    let flush = matches!(req, Request::Text(TextCmd::FlushAll { .. }));
                    if flush && c.slots.iter().any(|s| s.parts > 0) {
                        c.blocked = true; // earlier requests first
                        break;
                    }
                    let raw = &rbuf[rpos..rpos + consumed];
                    self.dispatch(ci, req, raw);
                    rpos += consumed;
                    if flush {
                        if let Some(c) = self.clients.get_mut(ci) {
                            c.blocked = true; // later requests after it
                        }
                    }
                }
            }
        }
        if let Some(c) = self.clients.get_mut(ci) {
            c.rbuf = rbuf_all;
            c.rpos = rpos;
        }
    }

    /// A `set` refused as too large drops the key's old value at its owner.
    pub(super) fn unlink(&mut self, key: &[u8]) {
        let hash = key_hash(key);
        let mut req = Vec::with_capacity(key.len() + 24);
        req.extend_from_slice(b"delete ");
        req.extend_from_slice(key);
        req.extend_from_slice(b" noreply\r\nmn\r\n");
        let inf = self.inflight(usize::MAX, 0, 0, req, What::Keyed { hash, expect: Expect::Line }, true);
        self.send_hash(hash, inf);
    }

    pub(super) fn inflight(
        &self,
        client: usize,
        cid: u64,
        seq: u64,
        req: Vec<u8>,
        what: What,
        quiet: bool,
    ) -> Inflight {
        Inflight {
            client,
            cid,
            seq,
            req,
            what,
            quiet,
            sent: self.now,
            hops: 0,
            rd: None,
            copy: None,
            waited_map: false,
        }
    }

    /// Open a reply slot waiting for `parts` upstream replies; its sequence number.
    pub(super) fn open_slot(&mut self, ci: usize, parts: u32, silent: bool) -> (u64, u64) {
        let c = self.clients.get_mut(ci).unwrap();
        let seq = c.base + c.slots.len() as u64;
        let buf = self.bufs.pop().unwrap_or_default();
        c.slots.push_back(Slot { parts, silent, buf, batch: c.batch, ..Slot::default() });
        (c.id, seq)
    }

    pub(super) fn local(&mut self, ci: usize, reply: &[u8]) {
        let c = self.clients.get_mut(ci).unwrap();
        push_ready(c, reply.to_vec());
        self.mark_client(ci);
    }

    /// A spare buffer (empty) with room for `room` bytes.
    pub(super) fn spare(&mut self, room: usize) -> Vec<u8> {
        let mut b = self.bufs.pop().unwrap_or_default();
        b.reserve(room);
        b
    }

    /// A copy of `raw` in a spare buffer if there is one.
    pub(super) fn copy_of(&mut self, raw: &[u8]) -> Vec<u8> {
        let mut b = self.bufs.pop().unwrap_or_default();
        b.extend_from_slice(raw);
        b
    }

    /// Handle one request of client `ci` (`raw`: its bytes).
    pub(super) fn dispatch(&mut self, ci: usize, req: Request, raw: &[u8]) {
        match req {
            Request::Text(cmd) => match cmd {
                TextCmd::Get { keys, cas, touch, .. } => {
                    self.counters.cmd_get += keys.len() as u64;
                    if touch.is_some() {
                        self.counters.cmd_touch += keys.len() as u64;
                    }
                    if keys.is_empty() {
                        return self.local(ci, b"END\r\n");
                    }
                    if keys.len() == 1 {
                        let hash = key_hash(keys.iter().next().unwrap());
                        let (cid, seq) = self.open_slot(ci, 1, false);
                        let what = What::Get { positions: None, cursor: (0, 0) };
                        let req = self.copy_of(raw);
                        let mut inf = self.inflight(ci, cid, seq, req, what, false);
                        // a plain `get` of a key with a live lease on a copy is read there
                        // (`gets`/`gat` go home: a copy has no CAS and no TTL of its own)
                        let leases = &mut self.clients[ci].leases;
                        if !cas && touch.is_none() && !leases.is_empty() {
                            if let Some(copy) = leases.read_target(hash, self.now) {
                                inf.copy = Some(hash);
                                return self.send(copy, inf);
                            }
                        }
                        return self.send_hash(hash, inf);
                    }
                    // one pass over the key list: each key's place in it, and its hash
                    let all = keys.raw();
                    self.hashes.clear();
                    self.key_spans.clear();
                    for k in keys.iter() {
                        let at = k.as_ptr() as usize - all.as_ptr() as usize;
                        self.key_spans.push((at as u32, k.len() as u32));
                        self.hashes.push(key_hash(k));
                    }
                    let mut split = std::mem::take(&mut self.split);
                    self.router.split(self.hashes.iter().copied(), false, &mut split);
                    let groups = split.groups().len() as u32;
                    let (cid, seq) = self.open_slot(ci, groups, false);
                    if groups == 1 {
                        let owner = split.groups()[0].owner;
                        let what = What::Get { positions: None, cursor: (0, 0) };
                        let req = self.copy_of(raw);
                        let inf = self.inflight(ci, cid, seq, req, what, false);
                        self.send(owner, inf);
                    } else {
                        let spans = std::mem::take(&mut self.key_spans);
                        let key = |p: &u32| {
                            let (at, len) = spans[*p as usize];
                            &all[at as usize..(at + len) as usize]
                        };
                        let prefix = get_prefix(cas, touch);
                        let multi = Multi::take(&mut self.multis, spans.len());
                        self.clients.get_mut(ci).unwrap().slots.back_mut().unwrap().multi = Some(multi);
                        for g in split.groups() {
                            let positions = split.positions(g).to_vec();
                            // room for the group's share of the key list (a line grown key by key
                            // reallocates several times)
                            let room = prefix.len() + all.len() * positions.len() / spans.len() + 32;
                            let buf = self.spare(room);
                            let (req, cursor) = get_line(buf, &prefix, positions.iter().map(key));
                            let what = What::Get { positions: Some(positions), cursor };
                            let inf = self.inflight(ci, cid, seq, req, what, false);
                            self.send(g.owner, inf);
                        }
                        self.key_spans = spans;
                    }
                    self.split = split;
                }
                TextCmd::Store { key, noreply, .. }
                | TextCmd::Delete { key, noreply }
                | TextCmd::Arith { key, noreply, .. }
                | TextCmd::Touch { key, noreply, .. } => {
                    match cmd {
                        TextCmd::Store { .. } => self.counters.cmd_set += 1,
                        TextCmd::Touch { .. } => self.counters.cmd_touch += 1,
                        _ => {}
                    }
                    let hash = key_hash(key);
                    // a write ends this connection's lease on the key: it reads its writes
                    self.clients[ci].leases.end(hash);
                    let (cid, seq) = self.open_slot(ci, 1, noreply);
                    let mut req = self.copy_of(raw);
                    if noreply {
                        req.extend_from_slice(b"mn\r\n");
                    }
                    let inf = self.inflight(ci, cid, seq, req, What::Keyed { hash, expect: Expect::Line }, noreply);
                    self.send_hash(hash, inf);
                }
                TextCmd::FlushAll { noreply, .. } => {
                    self.counters.cmd_flush += 1;
                    // To worker 0 of each server, which passes it to its other workers
                    // as messages; then `stats detail dump` on the same connection, which
                    // asks every worker of the server over the same FIFO channels and
                    // answers only when all did: once it is answered, every worker has
                    // applied the flush (what the barrier needs).
                    let servers = self.router.map().servers().len() as u16;
                    let (cid, seq) = self.open_slot(ci, 2 * servers as u32, noreply);
                    self.clients.get_mut(ci).unwrap().slots.back_mut().unwrap().flush = true;
                    for s in 0..servers {
                        let mut req = raw.to_vec();
                        if noreply {
                            req.extend_from_slice(b"mn\r\n");
                        }
                        let inf = self.inflight(ci, cid, seq, req, What::Flush, noreply);
                        self.send((s, 0), inf);
                        let sync = b"stats detail dump\r\n".to_vec();
                        let inf = self.inflight(ci, cid, seq, sync, What::FlushSync, false);
                        self.send((s, 0), inf);
                    }
                }
                TextCmd::Version => {
                    let mut out = Vec::new();
                    mbal_proto::text::write_version(&mut out, crate::VERSION);
                    self.local(ci, &out)
                }
                TextCmd::Verbosity { noreply } => self.local(ci, if noreply { b"" } else { b"OK\r\n" }),
                TextCmd::Stats { args } => {
                    self.publish();
                    let mut out = Vec::new();
                    match args {
                        b"" => self.shared.render_general(&mut out),
                        b"proxy" => self.shared.render_proxy(&mut out),
                        b"settings" => self.shared.render_settings(&mut out),
                        b"reset" => {
                            self.shared.reset();
                            out.extend_from_slice(b"RESET\r\n");
                        }
                        _ => out.extend_from_slice(b"ERROR\r\n"),
                    }
                    self.local(ci, &out)
                }
                TextCmd::Quit => {
                    self.clients.get_mut(ci).unwrap().closing = true;
                    self.mark_client(ci);
                }
                TextCmd::Shutdown { .. } => self.local(ci, b"ERROR: shutdown not enabled\r\n"),
                // the proxy listens without TLS: no certificates to refresh
                TextCmd::RefreshCerts => self.local(ci, b"ERROR TLS is not enabled\r\n"),
                // memcached's item dump and log stream would take over an upstream
                // connection: not through the proxy (ask the servers themselves)
                TextCmd::Tune {
                    cmd: mbal_proto::text::TuneCmd::Watch | mbal_proto::text::TuneCmd::LruCrawler, ..
                } => self.local(ci, b"ERROR\r\n"),
                TextCmd::Tune { .. } => {
                    // the servers' answer (memcached's argument checks), from server 0
                    let (cid, seq) = self.open_slot(ci, 1, false);
                    let inf = self.inflight(ci, cid, seq, raw.to_vec(), What::Admin, false);
                    self.send((0, 0), inf);
                }
                // the proxy is not an mbal server: routing clients go to the servers
                TextCmd::Mbal { .. } => self.local(ci, b"ERROR\r\n"),
            },
            Request::Meta(cmd) => {
                self.counters.cmd_meta += 1;
                if cmd.kind == MetaKind::Noop {
                    return self.local(ci, b"MN\r\n");
                }
                let mut scratch = [0u8; 256];
                let hash = match meta_key(&cmd, &mut scratch) {
                    Ok(k) => key_hash(k),
                    Err(e) => {
                        let mut out = Vec::new();
                        e.write(&mut out);
                        return self.local(ci, &out);
                    }
                };
                if cmd.kind != MetaKind::Get {
                    self.clients[ci].leases.end(hash);
                }
                match cmd.kind {
                    MetaKind::Get => self.counters.cmd_get += 1,
                    MetaKind::Set => self.counters.cmd_set += 1,
                    _ => {}
                }
                let quiet = cmd.flags.has(b'q');
                let (cid, seq) = self.open_slot(ci, 1, false);
                let mut req = self.copy_of(raw);
                if quiet {
                    req.extend_from_slice(b"mn\r\n");
                }
                let inf = self.inflight(ci, cid, seq, req, What::Keyed { hash, expect: Expect::Meta }, quiet);
                self.send_hash(hash, inf);
            }
            Request::Bin(b) => self.dispatch_bin(ci, b, raw),
        }
    }

    /// Handle one binary request of client `ci`.
    pub(super) fn dispatch_bin(&mut self, ci: usize, b: mbal_proto::binary::BinReq, raw: &[u8]) {
        use mbal_proto::binary::{is_quiet, opcode as op, write_response};
        let (opcode, opaque) = (b.header.opcode, b.header.opaque);
        let quiet = is_quiet(opcode);
        let ok = |out: &mut Vec<u8>, value: &[u8]| write_response(out, opcode, 0, opaque, 0, &[], &[], value);
        let mut out = Vec::new();
        match opcode {
            op::NOOP => ok(&mut out, b""),
            op::VERSION => ok(&mut out, crate::VERSION.as_bytes()),
            op::VERBOSITY => ok(&mut out, b""),
            // the proxy's statistics are in the text `stats`: an empty list here
            op::STAT => ok(&mut out, b""),
            op::QUIT | op::QUITQ => {
                if opcode == op::QUIT {
                    ok(&mut out, b"");
                    self.local(ci, &out);
                }
                self.clients.get_mut(ci).unwrap().closing = true;
                return self.mark_client(ci);
            }
            op::FLUSH | op::FLUSHQ => {
                self.counters.cmd_flush += 1;
                let servers = self.router.map().servers().len() as u16;
                let (cid, seq) = self.open_slot(ci, servers as u32, false);
                let slot = self.clients.get_mut(ci).unwrap().slots.back_mut().unwrap();
                slot.bin = Some((opcode, opaque));
                if !quiet {
                    ok(&mut slot.buf, b"");
                }
                for s in 0..servers {
                    let mut req = raw.to_vec();
                    if quiet {
                        req.extend_from_slice(&BIN_NOOP);
                    }
                    let inf = self.inflight(ci, cid, seq, req, What::BinFlush, quiet);
                    self.send((s, BIN), inf);
                }
                return;
            }
            _ => {
                match opcode {
                    op::GET | op::GETQ | op::GETK | op::GETKQ => self.counters.cmd_get += 1,
                    op::GAT | op::GATQ | op::GATK | op::GATKQ => self.counters.cmd_touch += 1,
                    op::TOUCH => self.counters.cmd_touch += 1,
                    o if mbal_proto::binary::is_store(o) => self.counters.cmd_set += 1,
                    _ => {}
                }
                let server = self.router.route_hash(key_hash(b.key)).1 .0;
                let (cid, seq) = self.open_slot(ci, 1, false);
                self.clients.get_mut(ci).unwrap().slots.back_mut().unwrap().bin = Some((opcode, opaque));
                let mut req = raw.to_vec();
                if quiet {
                    req.extend_from_slice(&BIN_NOOP);
                }
                let inf = self.inflight(ci, cid, seq, req, What::Bin, quiet);
                return self.send((server, BIN), inf);
            }
        }
        self.local(ci, &out)
    }

    pub(super) fn part_done(&mut self, ci: usize, cid: u64, seq: u64) {
        if let Some(s) = slot_mut(&mut self.clients, ci, cid, seq) {
            s.parts -= 1;
            if s.parts == 0 {
                self.mark_client(ci);
            }
        }
    }

    /// Write each client that has replies ready, once per round: the
    /// complete replies at the front of its queue, up to the end of the last
    /// read batch answered whole. An upstream answers a batch's requests in
    /// pieces (a server replies per round of its own, memcached every `-R`
    /// requests), and writing each piece as it comes would split the
    /// client's batch: the client then sends its next requests in as many
    /// pieces, and every piece costs a read and a write here from then on.
    /// Like the server (one write per read batch answered), the replies of
    /// one client read go out in one write; a backlog past `EARLY_FLUSH`
    /// goes out anyway.
    pub(super) fn flush_clients(&mut self) {
        while let Some(ci) = self.dirty_clients.pop() {
            let Some(c) = self.clients.get_mut(ci) else { continue };
            c.dirty = false;
            while c.slots.front().is_some_and(|s| s.parts == 0) {
                let s = c.slots.pop_front().unwrap();
                c.base += 1;
                render(&s, &mut c.wbuf);
                if c.slots.front().is_none_or(|next| next.batch != s.batch) {
                    c.wend = c.wbuf.len(); // the batch is answered whole
                }
                recycle(&mut self.bufs, s.buf);
                if let Some(m) = s.multi {
                    Multi::recycle(&mut self.multis, *m);
                }
            }
            if c.wbuf.len() - c.wpos > EARLY_FLUSH {
                c.wend = c.wbuf.len();
            }
            let mut broken = false;
            while c.wpos < c.wend {
                match c.sock.write(&c.wbuf[c.wpos..c.wend]) {
                    Ok(n) => {
                        c.wpos += n;
                        self.counters.bytes_written += n as u64;
                    }
                    Err(e) if would_block(&e) => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => {
                        broken = true;
                        break;
                    }
                }
            }
            if c.wpos == c.wbuf.len() {
                c.wbuf.clear();
                c.wpos = 0;
                c.wend = 0;
            }
            // TLS records the socket did not take yet (plain: nothing).
            if !broken && c.sock.wants_write() {
                broken = c.sock.flush_tls().is_err();
            }
            let done = c.closing && c.slots.is_empty() && c.wbuf.is_empty();
            if broken || done {
                self.close_client(ci);
                continue;
            }
            let unblock = c.blocked && c.slots.iter().all(|s| s.parts == 0);
            if unblock {
                c.blocked = false;
            }
            if unblock || (c.paused && c.slots.len() <= self.cfg.max_pending / 2 && c.wbuf.len() < 4 << 20) {
                c.paused = false;
                c.batch += 1;
                // what is buffered first, then the socket
                self.handle_input(ci);
                self.resume.push(ci);
            }
        }
    }
}

/// The slot of (client, id, seq), if the client is still there.
pub(super) fn slot_mut(clients: &mut Slab<Client>, ci: usize, cid: u64, seq: u64) -> Option<&mut Slot> {
    if cid == 0 {
        return None;
    }
    let c = clients.get_mut(ci).filter(|c| c.id == cid)?;
    let i = seq.checked_sub(c.base)? as usize;
    c.slots.get_mut(i)
}

/// A reply that needs no upstream.
pub(super) fn push_ready(c: &mut Client, reply: Vec<u8>) {
    c.slots.push_back(Slot { buf: reply, batch: c.batch, ..Slot::default() });
}

/// Write a complete slot's reply.
pub(super) fn render(s: &Slot, out: &mut Vec<u8>) {
    if s.silent {
        return;
    }
    if let Some(e) = &s.err {
        out.extend_from_slice(e);
    } else if s.flush {
        out.extend_from_slice(b"OK\r\n");
    } else if let Some(m) = &s.multi {
        for &(start, len) in &m.spans {
            out.extend_from_slice(&m.arena[start as usize..(start + len) as usize]);
        }
        out.extend_from_slice(b"END\r\n");
    } else {
        out.extend_from_slice(&s.buf);
    }
}

/// `get `, `gets `, `gat <t> ` or `gats <t> `.
pub(super) fn get_prefix(cas: bool, touch: Option<i64>) -> Vec<u8> {
    let mut p = Vec::with_capacity(24);
    match touch {
        None => p.extend_from_slice(if cas { b"gets " } else { b"get " }),
        Some(t) => {
            p.extend_from_slice(if cas { b"gats " } else { b"gat " });
            p.extend_from_slice(itoa::Buffer::new().format(t).as_bytes());
            p.push(b' ');
        }
    }
    p
}

/// A get line for these keys (written into `req`, empty), and the cursor at its first key.
pub(super) fn get_line<'k>(
    mut req: Vec<u8>,
    prefix: &[u8],
    keys: impl Iterator<Item = &'k [u8]>,
) -> (Vec<u8>, (u32, u32)) {
    req.extend_from_slice(prefix);
    for (i, k) in keys.enumerate() {
        if i > 0 {
            req.push(b' ');
        }
        req.extend_from_slice(k);
    }
    req.extend_from_slice(b"\r\n");
    (req, (prefix.len() as u32, 0))
}

/// The position (in the client's request) of the first key at or after the
/// cursor that equals `key`; moves the cursor past it. Values come back in
/// request order and only for hits, so skipped keys were misses.
pub(super) fn match_key(req: &[u8], positions: &[u32], cursor: &mut (u32, u32), key: &[u8]) -> Option<u32> {
    let end = req.len() - 2; // before CR LF
    let (mut off, mut idx) = (cursor.0 as usize, cursor.1 as usize);
    while off < end && idx < positions.len() {
        let rest = &req[off..end];
        // Values come back in the order asked, hits only: the key at the cursor is most often
        // the one answered, and that takes one comparison, not a scan for its end.
        if rest.starts_with(key) && rest.get(key.len()).is_none_or(|&b| b == b' ') {
            *cursor = ((off + key.len() + 1) as u32, (idx + 1) as u32);
            return Some(positions[idx]);
        }
        // a miss: skip that key
        off += mbal_proto::text::first_space(rest).unwrap_or(rest.len()) + 1;
        idx += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn get_lines_and_key_matching() {
        let keys: [&[u8]; 4] = [b"a", b"bb", b"a", b"c"];
        let (req, mut cur) = get_line(Vec::new(), &get_prefix(false, Some(-5)), keys.iter().copied());
        assert_eq!(req, b"gat -5 a bb a c\r\n");
        let pos = [7, 9, 10, 12];
        // a hit on the second "a" and on "c": "a" at 7 is taken first (same bytes)
        assert_eq!(match_key(&req, &pos, &mut cur, b"a"), Some(7));
        assert_eq!(match_key(&req, &pos, &mut cur, b"a"), Some(10));
        assert_eq!(match_key(&req, &pos, &mut cur, b"c"), Some(12));
        assert_eq!(match_key(&req, &pos, &mut cur, b"c"), None, "no key left");
        let (req, mut cur) = get_line(Vec::new(), &get_prefix(true, None), [&b"x"[..]].into_iter());
        assert_eq!(req, b"gets x\r\n");
        assert_eq!(match_key(&req, &[3], &mut cur, b"y"), None);
    }

    #[test]
    fn spare_buffers_are_bounded_and_empty() {
        let mut bufs = Vec::new();
        recycle(&mut bufs, Vec::new());
        assert!(bufs.is_empty(), "no capacity: nothing to keep");
        recycle(&mut bufs, vec![0u8; SPARE_CAP + 1]);
        assert!(bufs.is_empty(), "too big to keep");
        recycle(&mut bufs, b"get k\r\n".to_vec());
        assert_eq!(bufs.len(), 1);
        assert!(bufs[0].is_empty() && bufs[0].capacity() >= 7);
        for _ in 0..2 * SPARE_BUFS {
            recycle(&mut bufs, Vec::with_capacity(16));
        }
        assert_eq!(bufs.len(), SPARE_BUFS);
        let s = Slot { buf: b"VALUE k 0 1\r\nv\r\nEND\r\n".to_vec(), ..Slot::default() };
        let mut out = Vec::new();
        render(&s, &mut out);
        assert_eq!(out, s.buf);
    }
}
