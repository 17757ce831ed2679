//! A worker's connections: accepting, reading, parsing and dispatching
//! requests, writing replies, back-pressure (output, in-flight, emulated
//! capacity), and handing a routed connection to another worker.

use super::inbox::prefetch_keys;
use super::*;
use crate::auth::AsciiStep;
use crate::msg::ConnMsg;

/// The answer to a request larger than `--max-input-buffer` (then the
/// connection closes).
fn input_limit_reply(proto: Protocol, buf: &[u8], out: &mut Vec<u8>) {
    match proto {
        Protocol::Text => out.extend_from_slice(b"SERVER_ERROR request larger than the input buffer limit\r\n"),
        Protocol::Binary if buf.len() >= mbal_proto::binary::HEADER_LEN => {
            let h = mbal_proto::binary::BinHeader::decode(buf);
            write_response(out, h.opcode, st::E2BIG, h.opaque, 0, &[], &[], b"Too large.");
        }
        Protocol::Binary => {}
    }
}

/// A request parsed ahead of its turn (`look_ahead`): where in the read buffer it starts,
/// the line state it was parsed in and the one it leaves. Parsing depends on nothing else,
/// so `process` may use it whenever it reaches that position in that state.
struct Ahead<'r> {
    at: usize,
    before: LineState,
    after: LineState,
    parsed: Parsed<'r>,
}

impl Worker {
    /// Connections on this worker's own port.
    pub(super) fn accept(&mut self) {
        loop {
            let Some(listener) = &self.own_listener else { return };
            let (sock, peer) = match listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    tracing::warn!(worker = self.id, "accept: {e}");
                    return;
                }
            };
            let max = self.shared.settings.max_conns;
            if self.shared.curr_conns.fetch_add(1, Ordering::Relaxed) >= max {
                self.shared.curr_conns.fetch_sub(1, Ordering::Relaxed);
                self.shard.counters.rejected_connections += 1;
                let mut sock = sock;
                // memcached's answer to one connection too many (on a TLS port, only the close).
                if self.shared.tls.is_none() {
                    let _ = sock.write(b"ERROR Too many open connections\r\n");
                }
                continue;
            }
            if !self.shared.admit_ip(peer.ip()) {
                self.shared.curr_conns.fetch_sub(1, Ordering::Relaxed);
                let mut sock = sock;
                if self.shared.tls.is_none() {
                    let _ = sock.write(TOO_MANY_FROM_IP);
                }
                continue;
            }
            self.shared.worker_conns[self.id].fetch_add(1, Ordering::Relaxed);
            let listen_addr = listener.local_addr().unwrap_or(peer);
            if let Some(stream) = self.stream(sock, peer) {
                self.register(stream, peer, listen_addr);
            }
        }
    }

    /// A newly accepted socket as this server serves it: plain, or the
    /// server side of a TLS session (`-Z`) whose handshake runs as the
    /// connection is read. `None` (and the connection uncounted) if TLS
    /// cannot start.
    pub(super) fn stream(&mut self, sock: TcpStream, peer: SocketAddr) -> Option<ConnStream> {
        let Some(tls) = &self.shared.tls else { return Some(ConnStream::Plain(sock)) };
        match tls.accept() {
            Ok(conn) => Some(ConnStream::tls(conn, sock)),
            Err(e) => {
                tracing::warn!(worker = self.id, %peer, "TLS: {e}");
                self.shared.conn_closed(self.id, peer.ip());
                None
            }
        }
    }

    /// Serve a connection here. It is already counted in `curr_conns` and
    /// in this worker's `worker_conns`.
    pub(super) fn register(
        &mut self,
        mut sock: ConnStream,
        peer: SocketAddr,
        listen_addr: SocketAddr,
    ) -> Option<usize> {
        let _ = sock.sock().set_nodelay(true);
        let entry = self.conns.vacant_entry();
        let ci = entry.key();
        if let Err(e) = self.poll.registry().register(sock.sock_mut(), Token(ci + FIRST_CONN), Interest::READABLE) {
            tracing::warn!("register: {e}");
            self.shared.conn_closed(self.id, peer.ip());
            return None;
        }
        self.shard.counters.total_connections += 1;
        let gen = self.next_gen;
        self.next_gen += 1;
        let proto = match self.shared.settings.binding {
            Binding::Auto => None,
            Binding::Ascii => Some(Protocol::Text),
            Binding::Binary => Some(Protocol::Binary),
        };
        entry.insert(Conn {
            sock,
            id: self.shared.next_conn_id.fetch_add(1, Ordering::Relaxed),
            gen,
            peer,
            listen_addr,
            proto,
            rbuf: ReadBuf::default(),
            skip: 0,
            line: LineState::Start,
            output: Output::default(),
            closing: false,
            last_active: self.now,
            want_write: false,
            queued: false,
            read_blocked: false,
            dirty: false,
            routed: false,
            by_thread: false,
            exempt: false,
            fresh: true,
            throttled: false,
            auth: crate::auth::ConnAuth::new(&self.shared.settings),
            partial_since: 0,
            budget: None,
            half_closed: false,
            watching: None,
            watch_pending: 0,
        });
        tracing::debug!(worker = self.id, %peer, "accepted");
        // Bytes may have arrived before the registration.
        self.requeue(ci);
        Some(ci)
    }

    /// Give connection `ci` to worker `to`, with its input from `pos` on
    /// (`mbal hello <epoch> <to>`; its output is empty, `dispatch` checked).
    pub(super) fn hand_off(&mut self, ci: usize, pos: usize, to: usize, by_thread: bool) {
        let Some(mut c) = self.conns.try_remove(ci) else { return };
        let _ = self.poll.registry().deregister(c.sock.sock_mut());
        self.shared.worker_conns[self.id].fetch_sub(1, Ordering::Relaxed);
        self.shared.worker_conns[to].fetch_add(1, Ordering::Relaxed);
        let unread = c.rbuf.split_off(pos.min(c.rbuf.len()));
        let h = HandOff {
            sock: c.sock.map_sock(std::net::TcpStream::from),
            peer: c.peer,
            listen_addr: c.listen_addr,
            id: c.id,
            unread,
            auth: c.auth,
            exempt: c.exempt,
            fresh: c.fresh,
            by_thread,
        };
        self.outbox[to].push(Envelope::Conn(ConnMsg::HandOff(Box::new(h))));
    }

    pub(super) fn close(&mut self, ci: usize) {
        if let Some(c) = self.conns.get(ci) {
            let gen = c.gen;
            if c.watching.is_some() {
                self.announce_watch(ci, gen, None);
            }
            if !self.staged.is_empty() {
                self.staged_conn_closed(ci, gen);
            }
        }
        if let Some(mut c) = self.conns.try_remove(ci) {
            c.sock.close_notify();
            let _ = self.poll.registry().deregister(c.sock.sock_mut());
            self.shared.conn_closed(self.id, c.peer.ip());
        }
    }

    /// A half-closed connection after the stop (`Worker::drain`): read and drop its input
    /// until the client closes.
    pub(super) fn discard(&mut self, ci: usize) {
        let Some(conn) = self.conns.get_mut(ci) else { return };
        let mut scratch = [0u8; 4096];
        loop {
            match conn.sock.read(&mut scratch) {
                Ok(0) => break,
                Ok(_) => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
        }
        self.close(ci);
    }

    /// Read everything available, then process.
    pub(super) fn on_readable(&mut self, ci: usize, near: &mut Near) {
        let Some(conn) = self.conns.get_mut(ci) else { return };
        if conn.half_closed {
            return self.discard(ci);
        }
        if conn.output.unsent() > MAX_PENDING_OUTPUT {
            // Back-pressure: do not read more until the client drains
            // replies; `flush` queues the connection again when it has.
            conn.read_blocked = true;
            return;
        }
        conn.read_blocked = false;
        if !(conn.exempt || conn.fresh || self.shard.capacity.has_credit()) {
            // Out of emulated capacity: the input waits in the socket.
            self.throttle(ci);
            return;
        }
        let mut eof = false;
        // Whether the socket may still hold data we chose not to read yet.
        let mut more = false;
        loop {
            let len = conn.rbuf.len();
            if len >= self.input_cap {
                // Bounded input (`--max-input-buffer`): the rest waits in
                // the socket until the buffer is parsed down.
                more = true;
                break;
            }
            // After the stop: only what had arrived then (`Worker::drain`).
            let chunk = conn.budget.map_or(READ_CHUNK, |b| b.min(READ_CHUNK));
            if chunk == 0 {
                break;
            }
            match conn.rbuf.read_from(&mut conn.sock, chunk) {
                Ok(0) => {
                    eof = true;
                    break;
                }
                Ok(n) => {
                    self.shard.counters.bytes_read += n as u64;
                    if let Some(b) = &mut conn.budget {
                        // A short read drained the socket: all that had arrived is read.
                        *b = if n < chunk { 0 } else { b.saturating_sub(n) };
                    }
                    if n < chunk {
                        break;
                    }
                    // Do not buffer more than one big request's worth ahead.
                    if conn.rbuf.len() > self.limits.max_item_size + self.limits.max_line + READ_CHUNK {
                        more = true;
                        break;
                    }
                }
                Err(e) => {
                    match e.kind() {
                        io::ErrorKind::WouldBlock => {
                            if let Some(b) = &mut conn.budget {
                                *b = 0;
                            }
                            break;
                        }
                        io::ErrorKind::Interrupted => continue,
                        kind => {
                            if kind == io::ErrorKind::InvalidData && conn.sock.is_tls() {
                                // A failed handshake or a bad record: this connection only.
                                self.shard.counters.tls_errors += 1;
                                tracing::debug!(worker = self.id, peer = %conn.peer, "TLS: {e}");
                            }
                            eof = true;
                            break;
                        }
                    }
                }
            }
        }
        conn.last_active = self.now;
        self.refence(None);
        self.process(ci, near);
        if eof {
            // Flush what we have, then close.
            self.flush(ci);
            self.close(ci);
            return;
        }
        // (A connection paused by back-pressure is resumed by whoever
        // lifts it; queueing it now would read past its bound.)
        if more && !self.conns.get(ci).is_some_and(|c| c.read_blocked || c.throttled) {
            self.requeue(ci);
        }
    }

    /// Come back to a connection in this loop turn's ready queue (input
    /// left in the socket or in the buffer after a -R yield).
    pub(super) fn requeue(&mut self, ci: usize) {
        if let Some(c) = self.conns.get_mut(ci) {
            if !c.queued && !c.closing {
                c.queued = true;
                self.ready.push_back(ci);
            }
        }
    }

    pub(super) fn run_ready(&mut self, near: &mut Near) {
        let n = self.ready.len();
        for _ in 0..n {
            let Some(ci) = self.ready.pop_front() else { break };
            if let Some(c) = self.conns.get_mut(ci) {
                c.queued = false;
                self.on_readable(ci, near);
            }
        }
    }

    /// Parse ahead the requests `process` is about to execute, and start loading the index
    /// lines of the keys this worker will look up, so the batch's cache misses overlap (text
    /// gets and stores, `prefetch_keys`; a prefetch is a hint, so a key that turns out to be
    /// elsewhere costs nothing but the hash). `process` executes what was parsed here instead
    /// of parsing it again.
    fn look_ahead<'r>(
        &self,
        proto: Option<Protocol>,
        buf: &'r [u8],
        mut line: LineState,
        near: &Near,
    ) -> Vec<Ahead<'r>> {
        let Some(proto @ Protocol::Text) = proto else { return Vec::new() };
        // One request (a client that does not pipeline: one line, or a store's line and
        // data) has nothing to overlap its miss with.
        if memchr::memchr_iter(b'\n', buf).nth(2).is_none() {
            return Vec::new();
        }
        let n = self.shared.settings.reqs_per_event;
        let mut ahead = Vec::with_capacity(n.min(64));
        let mut at = 0usize;
        for _ in 0..n {
            let before = line;
            let parsed = mbal_proto::parse_stream(&mut line, proto, &buf[at..], &self.limits);
            let Parsed::Req { req, consumed } = &parsed else { break };
            // A get of several keys prefetches its own, a few keys ahead of each lookup, as
            // dispatch serves it (`dispatch::ahead`): hashing them here too would cost more
            // than it hides.
            if !matches!(req, Request::Text(TextCmd::Get { keys, .. }) if keys.len() > 1) {
                prefetch_keys(&self.shard.store, near, &self.shared.layout, req);
            }
            let next = at + consumed;
            ahead.push(Ahead { at, before, after: line, parsed });
            at = next;
        }
        ahead
    }

    /// Parse and execute up to `reqs_per_event` requests from the buffer.
    pub(super) fn process(&mut self, ci: usize, near: &mut Near) {
        // The read buffer leaves the connection while its requests run, so that what was
        // parsed ahead (which borrows it) can be executed while the connection changes; it
        // goes back before anything else can look at it.
        let rbuf = std::mem::take(&mut self.conns[ci].rbuf);
        let conn = &self.conns[ci];
        let ahead = if conn.skip == 0 { self.look_ahead(conn.proto, &rbuf, conn.line, near) } else { Vec::new() };
        let mut next = 0;
        let reqs_per_event = self.shared.settings.reqs_per_event;
        let mut done = 0usize;
        let mut pos = 0usize;
        let worker = self.id;
        let mut hand_off = None;
        let mut watch = None;
        // Stopped at a request for a frozen cachelet (`migrate`), or at an `mbal import`.
        let mut frozen_stop = false;
        let mut import_at = None;
        // Stopped short of a complete request (`--request-timeout-ms`).
        let mut partial = false;
        self.shard.store.log().cfd = self.conns[ci].id;
        loop {
            let conn = &mut self.conns[ci];
            if conn.closing {
                break;
            }
            if conn.watching.is_some() {
                // A log stream: what the client sends is ignored.
                pos = rbuf.len();
                break;
            }
            if conn.skip > 0 {
                let n = conn.skip.min(rbuf.len() - pos);
                conn.skip -= n;
                pos += n;
                if conn.skip > 0 {
                    break;
                }
            }
            if pos >= rbuf.len() {
                break;
            }
            if self.inflight >= self.max_inflight {
                // Bounded queues: wait for replies before taking more.
                self.shard.counters.inflight_stalls += 1;
                conn.read_blocked = true;
                self.blocked.push(ci);
                break;
            }
            if !matches!(conn.line, LineState::Start) && conn.output.unsent() > MAX_PENDING_OUTPUT {
                // Inside a long get line: answer its next piece once the
                // client has read this much (`flush` comes back here).
                conn.read_blocked = true;
                break;
            }
            if !(conn.exempt || conn.fresh || self.shard.capacity.has_credit()) {
                // Out of emulated capacity: the rest waits for a refill.
                if !conn.throttled {
                    conn.throttled = true;
                    // Served this round: behind those that were not (`spent`).
                    if done > 0 {
                        self.spent.push(ci);
                    } else {
                        self.throttled.push(ci);
                    }
                    self.shard.counters.capacity_stalls += 1;
                }
                break;
            }
            if done >= reqs_per_event {
                // Fairness (-R): yield to other connections, come back later.
                self.shard.counters.conn_yields += 1;
                self.requeue(ci);
                break;
            }
            let proto = *conn.proto.get_or_insert_with(|| mbal_proto::detect(rbuf[pos]));
            if !conn.auth.authenticated && proto == Protocol::Text {
                // memcached's ASCII authentication (-Y) comes first.
                let (settings, counters) = (&self.shared.settings, &mut self.shard.counters);
                match crate::auth::ascii_step(settings, counters, &mut conn.auth, &rbuf[pos..], conn.output.buf()) {
                    AsciiStep::NeedMore => {
                        partial = true;
                        break;
                    }
                    AsciiStep::Consumed(n) => {
                        pos += n;
                        done += 1;
                    }
                    AsciiStep::Close => conn.closing = true,
                }
                continue;
            }
            let Conn { output, gen, routed, by_thread, line, auth, exempt, fresh: only_admin, .. } = conn;
            let exempt = *exempt || *only_admin;
            let buf = &rbuf[pos..];
            let mut rt = Route {
                worker,
                conn: ci,
                gen: *gen,
                tables: &mut self.shard.tables,
                server: self.shared.server_id,
                routed: *routed,
                by_thread,
                outbox: &mut self.outbox,
                counters: &mut self.shard.counters,
                inflight: &mut self.inflight,
                self_stats: &mut self.self_stats,
                replicas: &mut self.shard.replicas,
                auth,
                fwd: &mut self.fwd,
                forwarding: self.shared.forward.is_some(),
                near: &mut *near,
            };
            let fresh = matches!(line, LineState::Start);
            let line_before = *line;
            // What was parsed ahead at this position in this state, else parse now. (By
            // reference: a parsed request is large, a meta request's flags are inline.)
            while ahead.get(next).is_some_and(|a| a.at < pos) {
                next += 1;
            }
            let parsed_now;
            let parsed = match ahead.get(next) {
                Some(a) if a.at == pos && a.before == *line => {
                    next += 1;
                    *line = a.after;
                    &a.parsed
                }
                _ => {
                    parsed_now = mbal_proto::parse_stream(line, proto, buf, &self.limits);
                    &parsed_now
                }
            };
            match *parsed {
                Parsed::NeedMore => {
                    if buf.len() >= self.input_cap {
                        // The request needs more than the connection may buffer.
                        rt.counters.input_limit_closes += 1;
                        input_limit_reply(proto, buf, output.buf());
                        pos = rbuf.len();
                        conn.closing = true;
                    }
                    partial = true;
                    break;
                }
                Parsed::Err { ref reply, skip, close } => {
                    if reply.is_too_large() {
                        rt.counters.store_too_large += 1;
                    }
                    // memcached drops the old value of a key whose new value
                    // was refused as too large; so do we (`buf` starts a
                    // request only if no long line was in progress).
                    if let Some(key) = fresh.then(|| mbal_proto::key_to_unlink_on_too_large(buf)).flatten() {
                        dispatch::unlink(&self.shared.layout, &mut rt, &mut self.shard.store, self.now, output, key);
                    }
                    reply.write(output.buf());
                    let avail = buf.len();
                    if skip <= avail {
                        pos += skip;
                    } else {
                        pos += avail;
                        conn.skip = skip - avail;
                    }
                    if close {
                        conn.closing = true;
                    }
                }
                Parsed::Req { ref req, consumed } => {
                    if let Some(c) = rt.tables.frozen.filter(|&c| dispatch::touches(&self.shared.layout, req, c)) {
                        // (Only a whole request: the rest of a long get line, parsed in
                        // pieces, would be answered after the error.)
                        if rt.tables.unsure && fresh && matches!(line, LineState::Start) {
                            // Its move's outcome is not known yet: an error now, not a wait.
                            dispatch::moving_reply(req, c, output.buf());
                            rt.counters.moving_errors += 1;
                            pos += consumed;
                            done += 1;
                            continue;
                        }
                        // Its cachelet is on its way to another server: wait, input unread.
                        *line = line_before;
                        frozen_stop = true;
                        break;
                    }
                    let raw = &buf[..consumed];
                    let forwarded_before = *rt.inflight;
                    let reply_at = output.buf().len();
                    let action =
                        dispatch::handle(&self.shared, &mut rt, &mut self.shard.store, self.now, output, req, raw);
                    if self.shard.store.watch().has_dirty() {
                        // A write to a replicated key: copy it; in sync mode
                        // its reply waits until every copy has it.
                        let mut hold = None;
                        let hot = &self.shared.settings.hot;
                        if hot.may_sync()
                            && output.buf().len() > reply_at
                            && self.shard.store.watch().dirty_keys().any(|k| hot.sync_for(k))
                        {
                            let bytes = output.buf().split_off(reply_at);
                            let seq = output.push(Slot::Wait);
                            *rt.inflight += 1;
                            hold = Some((ReplyTo { worker, conn: ci, gen: *gen, seq }, NO_CACHELET, bytes));
                        }
                        hot::copy_writes(
                            &self.shared,
                            worker,
                            &mut self.shard.store,
                            &mut rt.replicas.hot,
                            self.now,
                            hold,
                        );
                    }
                    // Executed here unless it went to another worker (which pays for it).
                    if !exempt {
                        self.shard.capacity.spend((*rt.inflight == forwarded_before) as u64);
                    }
                    if !matches!(req, Request::Text(TextCmd::Mbal { .. })) {
                        *only_admin = false;
                    }
                    pos += consumed;
                    done += 1;
                    match action {
                        Action::None => {}
                        Action::Pause { at, rest } => {
                            // A get stopped after `at` bytes: the rest of its
                            // line is parsed again once the output drained.
                            pos -= consumed - at;
                            *line = rest;
                        }
                        Action::Routed { by_thread } => (conn.routed, conn.by_thread) = (true, by_thread),
                        Action::Exempt => conn.exempt = true,
                        Action::HandOff(to, by_thread) => {
                            hand_off = Some((to, by_thread));
                            break;
                        }
                        Action::Close => conn.closing = true,
                        Action::Shutdown => {
                            conn.closing = true;
                            self.shared.request_stop();
                        }
                        Action::Watch(mask) => {
                            conn.watching = Some(mask);
                            watch = Some((conn.gen, mask));
                            pos = rbuf.len();
                            break;
                        }
                        Action::Import => {
                            conn.exempt = true;
                            import_at = Some((pos - consumed, consumed));
                            break;
                        }
                    }
                }
            }
        }
        drop(ahead);
        if let Some((at, n)) = import_at {
            self.import_request(ci, &rbuf[at..at + n]);
            self.requeue(ci);
        }
        if frozen_stop {
            self.frozen_conn(ci);
        }
        if let Some(conn) = self.conns.get_mut(ci) {
            conn.rbuf = rbuf;
        }
        self.finish_self_stats();
        self.requests += done as u64;
        if let Some((to, by_thread)) = hand_off {
            self.hand_off(ci, pos, to, by_thread);
            return;
        }
        if let Some((gen, mask)) = watch {
            self.announce_watch(ci, gen, Some(mask));
        }
        let Some(conn) = self.conns.get_mut(ci) else { return };
        if (partial || conn.skip > 0) && self.shared.settings.request_timeout_ms > 0 {
            // The clock runs from the first time the request was found
            // incomplete; a request answered in between restarts it.
            if conn.partial_since == 0 || done > 0 {
                conn.partial_since = self.shared.clock_ns().max(1);
            }
        } else {
            conn.partial_since = 0;
        }
        conn.rbuf.consume(pos);
        if conn.rbuf.capacity() > 4 * READ_CHUNK && conn.rbuf.len() < READ_CHUNK {
            conn.rbuf.shrink_to(READ_CHUNK);
        }
        conn.output.end_batch();
        if conn.write_due() {
            self.flush(ci);
        }
    }

    /// Write as much output as the socket takes.
    pub(super) fn flush(&mut self, ci: usize) {
        let Some(conn) = self.conns.get_mut(ci) else { return };
        if conn.sock.flush_tls().is_err() {
            self.close(ci);
            return;
        }
        conn.output.drain();
        while conn.output.sent < conn.output.out.len() {
            match conn.sock.write(&conn.output.out[conn.output.sent..]) {
                Ok(0) => break,
                Ok(n) => {
                    conn.output.sent += n;
                    self.shard.counters.bytes_written += n as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => {
                    self.close(ci);
                    return;
                }
            }
        }
        if conn.output.sent == conn.output.out.len() {
            conn.output.out.clear();
            conn.output.sent = 0;
            if conn.output.out.capacity() > 1 << 20 {
                conn.output.out.shrink_to(64 << 10);
            }
        }
        let need_write = conn.output.sent < conn.output.out.len() || conn.sock.wants_write();
        if need_write != conn.want_write {
            conn.want_write = need_write;
            let interest = if need_write { Interest::READABLE | Interest::WRITABLE } else { Interest::READABLE };
            let _ = self.poll.registry().reregister(conn.sock.sock_mut(), Token(ci + FIRST_CONN), interest);
        }
        if !need_write && !conn.output.waiting() && conn.closing {
            self.close(ci);
            return;
        }
        // Output drained: resume a read that back-pressure paused.
        if !need_write && conn.read_blocked && self.inflight < self.max_inflight {
            self.requeue(ci);
        }
    }

    /// Write each connection that got replies this round, once, if a read
    /// batch of it is now answered whole (`Output::batch_done`): the other
    /// replies of a batch are on their way, and come back here.
    pub(super) fn flush_dirty(&mut self) {
        let mut dirty = std::mem::take(&mut self.dirty);
        for &ci in &dirty {
            if let Some(c) = self.conns.get_mut(ci) {
                c.dirty = false;
                if c.write_due() {
                    self.flush(ci);
                }
            }
        }
        dirty.clear();
        if self.dirty.is_empty() {
            self.dirty = dirty;
        }
    }
}

impl Conn {
    /// Is a write due: a read batch answered whole (or nothing waiting), a backlog past
    /// `EARLY_FLUSH`, or a connection closing?
    fn write_due(&mut self) -> bool {
        self.output.batch_done() || self.output.unsent() > EARLY_FLUSH || self.closing
    }
}
