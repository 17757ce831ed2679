//! The upstream side of a proxy thread: pooled, pipelined connections to
//! the owning workers, timeouts and backoff, decoding replies, following
//! redirects and fetching newer maps.

use super::client::{get_line, get_prefix, match_key, slot_mut};
use super::*;

impl Engine {
    pub(super) fn upstream(&mut self, owner: Owner) -> usize {
        let router = &self.router;
        self.ups.index_of(
            owner,
            || Self::addr_in(router, owner),
            |addr| UpExtra { addr_s: addr.to_string(), delta: UpDelta::default() },
        )
    }

    pub(super) fn addr_of(&self, owner: Owner) -> SocketAddr {
        Self::addr_in(&self.router, owner)
    }

    fn addr_in(router: &Router, (s, w): Owner) -> SocketAddr {
        if w == BIN {
            router.map().servers()[s as usize].main
        } else {
            router.map().worker_addr(s, w)
        }
    }

    pub(super) fn send_hash(&mut self, hash: u64, inf: Inflight) {
        let owner = self.router.route_hash(hash).1;
        self.send(owner, inf);
    }

    /// Queue a request on the upstream of `owner` (connecting if needed).
    pub(super) fn send(&mut self, owner: Owner, mut inf: Inflight) {
        let known = if owner.1 == BIN {
            (owner.0 as usize) < self.router.map().servers().len()
        } else {
            self.router.map().has_worker(owner)
        };
        if !known {
            return self.fail(inf, "SERVER_ERROR upstream not in the cluster map");
        }
        if self.health.any_down() && self.health.is_down(owner.0, self.now) {
            // A redirect to it from a server behind the map (learned during its backoff) is
            // done with (`Router`'s doc): the next request goes where the map says. Not this
            // one: the map says the redirect's sender, which would redirect it here again.
            self.router.forget_stale_redirects_to(owner.0);
            // the server could not be reached: its keys are answered here during its backoff
            if self.health.refresh_due(self.now) {
                self.refresh_map(owner.0);
            }
            if inf.copy.is_some() {
                self.copy_failed(owner, self.now);
            }
            return self.answer_unreachable(inf, owner.0);
        }
        let ui = self.upstream(owner);
        let now = self.now;
        match self.ups[ui].state {
            State::Up => {}
            State::Down { until } if now < until => {
                self.ups[ui].extra.delta.errors += 1;
                if inf.copy.is_some() {
                    self.copy_failed(owner, now);
                }
                return self.fail(inf, "SERVER_ERROR upstream unavailable");
            }
            State::Down { .. } | State::Idle => {
                if let Err(e) = self.connect(ui) {
                    tracing::debug!("proxy: connect to {}: {e}", self.ups[ui].addr);
                    self.ups[ui].extra.delta.errors += 1;
                    if mbal_cluster::unreachable_kind(e.kind()) {
                        self.unreachable(ui);
                        if inf.copy.is_some() {
                            self.copy_failed(owner, now);
                        }
                        return self.answer_unreachable(inf, owner.0);
                    }
                    self.down(ui);
                    if inf.copy.is_some() {
                        self.copy_failed(owner, now);
                    }
                    return self.fail(inf, "SERVER_ERROR upstream unavailable");
                }
            }
        }
        inf.sent = now;
        let u = &mut self.ups[ui];
        u.extra.delta.requests += 1;
        u.write(&inf.req);
        self.ups.queue(ui, inf);
    }

    pub(super) fn connect(&mut self, ui: usize) -> io::Result<()> {
        let epoch = self.router.map().epoch();
        let owner = self.ups[ui].owner;
        let addr = self.addr_of(owner);
        let u = &mut self.ups[ui];
        if addr != u.addr {
            u.extra.addr_s = addr.to_string();
        }
        self.ups.connect(ui, self.poll.registry(), addr)?;
        self.ups[ui].extra.delta.connects += 1;
        if owner.1 == BIN {
            return Ok(()); // a plain binary connection: no hello
        }
        let hello = mbal_member::pipe::hello_line(epoch, owner.1);
        let inf = Inflight {
            client: usize::MAX,
            cid: 0,
            seq: 0,
            req: Vec::new(),
            what: What::Hello,
            quiet: false,
            sent: self.now,
            hops: 0,
            rd: None,
            copy: None,
            waited_map: false,
        };
        self.ups.send(ui, &hello, inf);
        Ok(())
    }

    /// A connection to a hot key's copy at `owner` failed: every client's
    /// leases there end, and no client reads there for a while.
    fn copy_failed(&mut self, owner: Owner, now: Instant) {
        for (_, c) in self.clients.iter_mut() {
            c.leases.copy_failed(owner, now, mbal_cluster::COPY_RETRY);
        }
    }

    /// Connections dialed by helper threads: into the loop, or the upstream
    /// down (its requests answered `SERVER_ERROR upstream unavailable`).
    pub(super) fn take_dialed(&mut self) {
        while let Some((ui, e)) = self.ups.next_dialed(self.poll.registry()) {
            tracing::debug!("proxy: connect to {}: {e}", self.ups[ui].addr);
            self.ups[ui].extra.delta.errors += 1;
            if mbal_cluster::unreachable_kind(e.kind()) {
                self.unreachable(ui);
            } else {
                // a refused login or handshake: the server is there, and wrong
                self.down_with(ui, "SERVER_ERROR upstream unavailable");
            }
        }
    }

    /// Drop upstream `ui`'s connection and its buffers (a new generation: late events for the
    /// old socket are ignored); what was in flight on it, to be answered, and its owner.
    fn drop_connection(&mut self, ui: usize) -> (VecDeque<Inflight>, Owner) {
        (self.ups.drop_connection(ui, self.poll.registry()), self.ups[ui].owner)
    }

    /// Take the upstream down: drop its connection, fail what is in flight,
    /// and refuse requests to it for the backoff.
    pub(super) fn down(&mut self, ui: usize) {
        // Still dialing: the upstream never became available.
        let msg = if !self.ups[ui].connected() {
            "SERVER_ERROR upstream unavailable"
        } else {
            "SERVER_ERROR upstream failed"
        };
        self.down_with(ui, msg);
    }

    pub(super) fn down_with(&mut self, ui: usize, msg: &'static str) {
        let lost = self.ups.down(ui, self.poll.registry(), self.now);
        let owner = self.ups[ui].owner;
        if lost.iter().any(|i| i.copy.is_some()) {
            self.copy_failed(owner, self.now);
        }
        for inf in lost {
            if inf.cid != 0 {
                self.ups[ui].extra.delta.errors += 1;
            }
            self.fail(inf, msg);
        }
    }

    /// The server of upstream `ui` could not be reached (a connect refused or timed out, the
    /// connection reset or closed, a request unanswered for `--upstream-timeout-ms`): drop the
    /// connection, answer what was in flight on it as [`Engine::answer_unreachable`] does, and
    /// mark the server down for its backoff (`mbal_cluster::Health`: its keys are answered so
    /// without the network meanwhile; after it the next request dials again). The first
    /// failure, and each failed retry, fetch the map from another server.
    pub(super) fn unreachable(&mut self, ui: usize) {
        let (lost, owner) = self.drop_connection(ui);
        // the server's backoff decides when it is dialed again, not this upstream's
        self.ups[ui].state = State::Idle;
        self.counters.unreachable += 1;
        // A redirect to it from a server behind the map is done with (`Router`'s doc).
        self.router.forget_stale_redirects_to(owner.0);
        let f = self.health.failed(owner.0, self.now);
        if lost.iter().any(|i| i.copy.is_some()) {
            self.copy_failed(owner, self.now);
        }
        // The fetch first: what was lost waits for the map it brings (`wait_for_map`).
        if f.refresh {
            self.refresh_map(owner.0);
        }
        for inf in lost {
            if inf.cid != 0 {
                self.ups[ui].extra.delta.errors += 1;
            }
            self.answer_unreachable(inf, owner.0);
        }
    }

    /// What every failed request goes through first: a read at a hot key's copy is resent
    /// home, a map fetch is over, a request of the proxy's own (no client) needs no answer.
    /// `Some`: a client's request, still to be answered.
    fn settle_failed(&mut self, mut inf: Inflight) -> Option<Inflight> {
        if let Some(hash) = inf.copy.take() {
            self.copy_fallback(hash, inf);
            return None;
        }
        if matches!(inf.what, What::Map) {
            self.fetching_map = false;
            // The fetch failed: what waited for it is answered on the map there is.
            self.resume_waiting_map();
        }
        (inf.cid != 0).then_some(inf)
    }

    /// A client's request for a server that could not be reached waits, once, for the map
    /// fetch in flight (the failure started one, or one was under way; it is bounded by the
    /// upstream timeout): the map may be behind the cluster's (a move committed, then its
    /// old owner died before this thread heard of it), and the new map sends the request to
    /// the live owner that holds its data instead of answering it as a miss. `Some`: answer
    /// it here now.
    fn wait_for_map(&mut self, mut inf: Inflight) -> Option<Inflight> {
        if inf.waited_map || !self.fetching_map || !matches!(inf.what, What::Keyed { .. } | What::Get { .. }) {
            return Some(inf);
        }
        // A whole get whose first values are in its reply already is finished as it is.
        if matches!(inf.what, What::Get { positions: None, .. })
            && slot_mut(&mut self.clients, inf.client, inf.cid, inf.seq).is_some_and(|s| !s.buf.is_empty())
        {
            return Some(inf);
        }
        inf.waited_map = true;
        self.counters.unreachable_waits += 1;
        self.waiting_map.push(inf);
        None
    }

    /// The map fetch ended (installed, the same, or failed): what waited for it is routed
    /// again on the map there is now (a server still down answers it as unreachable).
    fn resume_waiting_map(&mut self) {
        if self.waiting_map.is_empty() {
            return;
        }
        for inf in std::mem::take(&mut self.waiting_map) {
            self.reroute(inf);
        }
    }

    /// Split a text get (the whole request, or a part of one: `positions`, the client's
    /// positions of its keys) by owner on the router's map, after learning a redirect if
    /// there is one, and send each part.
    fn resplit_learning(&mut self, inf: Inflight, positions: Option<Vec<u32>>, learn: Option<(Owner, Redirect)>) {
        // the keys of this request, and their positions in the client's
        let Parsed::Req { req: Request::Text(TextCmd::Get { keys, cas, touch, .. }), .. } =
            mbal_proto::parse(Protocol::Text, &inf.req, &self.limits)
        else {
            return self.fail(inf, "SERVER_ERROR proxy lost a request");
        };
        let key_list: Vec<&[u8]> = keys.iter().collect();
        let positions = positions.unwrap_or_else(|| (0..key_list.len() as u32).collect());
        self.hashes.clear();
        self.hashes.extend(key_list.iter().map(|k| key_hash(k)));
        if let Some((from, rd)) = learn {
            match self.router.learn(from, rd, self.hashes.iter().copied()) {
                Ok(l) => self.maybe_fetch_map(l.fetch_map_from),
                Err(_) => return self.fail(inf, "SERVER_ERROR bad redirect"),
            }
        }
        let Some(s) = slot_mut(&mut self.clients, inf.client, inf.cid, inf.seq) else { return };
        if s.multi.is_none() {
            // it was the whole request: from now on, values go by position
            s.multi = Some(Multi::take(&mut self.multis, key_list.len()));
        }
        let mut split = std::mem::take(&mut self.split);
        self.router.split(self.hashes.iter().copied(), true, &mut split);
        s.parts += split.groups().len() as u32 - 1;
        let prefix = get_prefix(cas, touch);
        for g in split.groups() {
            let idx = split.positions(g);
            let (req, cursor) = get_line(Vec::new(), &prefix, idx.iter().map(|&i| key_list[i as usize]));
            let pos: Vec<u32> = idx.iter().map(|&i| positions[i as usize]).collect();
            let mut next =
                self.inflight(inf.client, inf.cid, inf.seq, req, What::Get { positions: Some(pos), cursor }, false);
            next.hops = inf.hops;
            next.waited_map = inf.waited_map;
            self.send(g.owner, next);
        }
        self.split = split;
    }

    /// Send a request again on the router's current map: a keyed one by its hash, a get
    /// split again by owner (its parts answered by position).
    fn reroute(&mut self, mut inf: Inflight) {
        match inf.what {
            What::Keyed { hash, .. } => self.send_hash(hash, inf),
            What::Get { ref mut positions, .. } => {
                let positions = positions.take();
                self.resplit_learning(inf, positions, None);
            }
            _ => self.fail(inf, "SERVER_ERROR proxy lost a request"),
        }
    }

    /// Answer a request for a key of `server`, which could not be reached: a read as a miss
    /// (text `get` family: no VALUE; `mg`: `EN`; binary get family: `KEY_ENOENT`; quiet ones:
    /// nothing), anything else `SERVER_ERROR mbal server <addr> unreachable` (binary: status
    /// 0x86 with that text). A read at a hot key's copy goes home instead.
    pub(super) fn answer_unreachable(&mut self, inf: Inflight, server: u16) {
        use mbal_proto::binary::{opcode as op, status};
        let Some(inf) = self.settle_failed(inf) else { return };
        let Some(inf) = self.wait_for_map(inf) else { return };
        let miss: Option<Vec<u8>> = match inf.what {
            // the whole request: its reply so far (whole VALUE blocks) and the END not received
            What::Get { positions: None, .. } => Some(b"END\r\n".to_vec()),
            // a part of a multi-get: its keys stay misses
            What::Get { positions: Some(_), .. } => Some(Vec::new()),
            What::Keyed { expect: Expect::Meta, .. } if inf.req.starts_with(b"mg ") => {
                Some(if inf.quiet { Vec::new() } else { b"EN\r\n".to_vec() })
            }
            What::Bin if inf.req.len() >= 24 => {
                let opc = inf.req[1];
                let keylen = u16::from_be_bytes([inf.req[2], inf.req[3]]) as usize;
                let key_at = 24 + inf.req[4] as usize;
                let key = inf.req.get(key_at..key_at + keylen).unwrap_or(&[]);
                let opaque = u32::from_be_bytes([inf.req[12], inf.req[13], inf.req[14], inf.req[15]]);
                match opc {
                    op::GETQ | op::GETKQ | op::GATQ | op::GATKQ => Some(Vec::new()),
                    op::GET | op::GETK | op::GAT | op::GATK => {
                        let with_key = matches!(opc, op::GETK | op::GATK);
                        let mut out = Vec::new();
                        let k = if with_key { key } else { &[] };
                        mbal_proto::binary::write_response(
                            &mut out,
                            opc,
                            status::KEY_ENOENT,
                            opaque,
                            0,
                            &[],
                            k,
                            b"Not found",
                        );
                        Some(out)
                    }
                    _ => None,
                }
            }
            _ => None,
        };
        match miss {
            Some(reply) => {
                self.counters.unreachable_misses += 1;
                if let Some(s) = slot_mut(&mut self.clients, inf.client, inf.cid, inf.seq) {
                    s.buf.extend_from_slice(&reply);
                }
                self.part_done(inf.client, inf.cid, inf.seq);
                recycle(&mut self.bufs, inf.req);
            }
            None => {
                self.counters.unreachable_errors += 1;
                let msg = match self.router.map().servers().get(server as usize) {
                    Some(info) => format!("SERVER_ERROR mbal server {} unreachable", info.main),
                    None => format!("SERVER_ERROR mbal server {server} unreachable"),
                };
                self.fail(inf, &msg);
            }
        }
    }

    /// Server `failed` could not be reached: ask another server of the map (one not in its
    /// backoff) for the map (`mbal map`, on that server's worker 0 upstream, so it never
    /// blocks the loop: a dial that needs more than a TCP connect runs on a helper thread),
    /// installed if newer. At most one fetch at a time per thread (shared with the fetches
    /// that redirects ask for).
    pub(super) fn refresh_map(&mut self, failed: u16) {
        if self.fetching_map {
            return;
        }
        // one refresh, whichever source (a coordinator's fallback to a server is the same one)
        if self.coord.is_some() {
            self.counters.map_refreshes += 1;
            self.fetch_from_coordinators(MapFallback::Refresh(failed));
        } else if self.refresh_from_server(failed) {
            self.counters.map_refreshes += 1;
        }
    }

    /// [`Engine::refresh_map`] from a live server other than `failed`: whether one was asked
    /// (none live: no fetch).
    fn refresh_from_server(&mut self, failed: u16) -> bool {
        let Some(src) = self.health.map_source(self.router.map(), failed, self.now) else { return false };
        self.fetching_map = true;
        self.counters.map_fetches += 1;
        let req = mbal_proto::ext::map_request(Some(self.router.map().epoch()));
        let inf = self.inflight(usize::MAX, 0, 0, req, What::Map, false);
        self.send((src, 0), inf);
        true
    }

    /// Ask the coordinators for the map (`crate::coord`): the cluster's newest, which a server
    /// may hear of only at its next heartbeat. If the helper is gone, the fallback now.
    fn fetch_from_coordinators(&mut self, fallback: MapFallback) {
        let have = self.router.map().epoch();
        if self.coord.as_ref().is_some_and(|c| c.ask(have)) {
            self.fetching_map = true;
            self.counters.map_fetches += 1;
            self.counters.map_coordinator_fetches += 1;
            self.coord_fallback = Some(fallback);
        } else {
            self.coord = None;
            self.map_fallback(fallback);
        }
    }

    fn map_fallback(&mut self, fallback: MapFallback) {
        match fallback {
            MapFallback::Refresh(failed) => {
                self.refresh_from_server(failed);
            }
            MapFallback::From(owner) => self.fetch_from_owner(owner),
        }
    }

    /// The coordinators' answers: a map is installed if newer (and what waited for it goes on
    /// it); none answered: the map is fetched from a server instead.
    pub(super) fn take_coordinator_map(&mut self) {
        let Some(c) = &self.coord else { return };
        let answers: Vec<Option<(u64, Vec<u8>)>> = c.answers.try_iter().collect();
        for got in answers {
            self.fetching_map = false;
            let fallback = self.coord_fallback.take();
            match got {
                Some((epoch, json)) => {
                    self.install_map_json(epoch, &json, "the coordinator");
                    self.resume_waiting_map();
                }
                None => {
                    self.counters.map_coordinator_failures += 1;
                    if let Some(f) = fallback {
                        self.map_fallback(f);
                    }
                    if !self.fetching_map {
                        self.resume_waiting_map();
                    }
                }
            }
        }
    }

    /// Install a fetched map's JSON if it is newer than the router's (`from`: for the log).
    /// Empty: the answer to `mbal map <epoch>` when the map there (of `epoch`) is no newer;
    /// if it is the router's epoch, redirects from servers behind it are forgotten, as when
    /// the same map comes again.
    fn install_map_json(&mut self, epoch: u64, json: &[u8], from: &str) {
        if json.is_empty() {
            self.router.confirm_epoch(epoch);
            return;
        }
        match ClusterMap::from_json(&String::from_utf8_lossy(json)) {
            Ok(m) => {
                let old = self.router.map().servers().to_vec();
                match self.router.install_map(m) {
                    Ok(true) => {
                        self.counters.maps_installed += 1;
                        self.health.map_changed(&old, self.router.map().servers());
                    }
                    Ok(false) => {}
                    Err(e) => tracing::warn!("proxy: map from {from}: {e}"),
                }
            }
            Err(e) => tracing::warn!("proxy: bad map from {from}: {e}"),
        }
    }

    /// Answer a request with an error line (its slot's whole reply); a read
    /// at a hot key's copy is resent home instead (the client sees no error).
    pub(super) fn fail(&mut self, inf: Inflight, msg: &str) {
        let Some(inf) = self.settle_failed(inf) else { return };
        if let Some(s) = slot_mut(&mut self.clients, inf.client, inf.cid, inf.seq) {
            if s.err.is_none() {
                let mut e = Vec::new();
                match s.bin {
                    Some((opcode, opaque)) => {
                        let text = msg.strip_prefix("SERVER_ERROR ").unwrap_or(msg);
                        mbal_proto::binary::write_response(
                            &mut e,
                            opcode,
                            BIN_UPSTREAM_FAILED,
                            opaque,
                            0,
                            &[],
                            &[],
                            text.as_bytes(),
                        );
                    }
                    None => {
                        e.extend_from_slice(msg.as_bytes());
                        e.extend_from_slice(b"\r\n");
                    }
                }
                s.err = Some(e);
            }
        }
        self.part_done(inf.client, inf.cid, inf.seq);
    }

    pub(super) fn check_timeouts(&mut self) {
        let now = self.now;
        let t = self.cfg.upstream_timeout;
        for ui in 0..self.ups.len() {
            if self.ups[ui].late(now, t) {
                tracing::debug!("proxy: upstream {} timed out", self.ups[ui].addr);
                self.ups[ui].extra.delta.timeouts += 1;
                self.unreachable(ui);
            }
        }
    }

    pub(super) fn next_deadline(&self) -> Option<Instant> {
        if !self.resume.is_empty() {
            return Some(Instant::now());
        }
        self.ups.next_deadline(self.cfg.upstream_timeout)
    }

    pub(super) fn flush_upstreams(&mut self) {
        while let Some(ui) = self.ups.flush() {
            self.unreachable(ui);
        }
    }

    pub(super) fn read_upstream(&mut self, ui: usize) {
        if !self.ups[ui].connected() {
            return;
        }
        let broken = self.ups[ui].read();
        self.decode_upstream(ui);
        if broken && self.ups[ui].connected() {
            // closed, reset or refused (a non-blocking connect's failure shows here)
            self.unreachable(ui);
        }
    }

    /// Match the upstream's replies to its requests in flight.
    pub(super) fn decode_upstream(&mut self, ui: usize) {
        if self.ups[ui].owner.1 == BIN {
            return self.decode_binary(ui);
        }
        let mut rx = std::mem::take(&mut self.ups[ui].rx);
        let rbuf = rx.unread();
        let mut rpos = 0;
        let now = self.now;
        let owner = self.ups[ui].owner;
        let mut after = std::mem::take(&mut self.after);
        'frames: loop {
            let u = &mut self.ups[ui];
            let Some(front) = u.inflight.front_mut() else {
                if rpos < rbuf.len() {
                    after.push(After::UpstreamBroken("reply to no request"));
                }
                break;
            };
            if let What::Admin = front.what {
                // one line, whatever it says (memcached's admin replies are not all standard)
                let Some(nl) = rbuf[rpos..].iter().position(|&b| b == b'\n') else { break };
                let line = &rbuf[rpos..rpos + nl + 1];
                rpos += nl + 1;
                if let Some(s) = slot_mut(&mut self.clients, front.client, front.cid, front.seq) {
                    s.buf.extend_from_slice(line);
                }
                let inf = u.inflight.pop_front().unwrap();
                u.extra.delta.latencies.push(now.duration_since(inf.sent).as_micros().min(u32::MAX as u128) as u32);
                after.push(After::Done { client: inf.client, cid: inf.cid, seq: inf.seq });
                continue;
            }
            let expect = front.expect();
            let (n, frame) = match u.dec.decode(&rbuf[rpos..], expect) {
                Ok(x) => x,
                Err(e) => {
                    tracing::debug!("proxy: upstream {}: {e}", u.addr);
                    after.push(After::UpstreamBroken("bad reply"));
                    break;
                }
            };
            let bytes = &rbuf[rpos..rpos + n];
            rpos += n;
            let Some(frame) = frame else { break };
            let quiet = front.quiet;
            let mut end = !quiet && frame.ends_reply();
            match frame {
                Frame::Hint(h) => {
                    // never passed on (plain clients must not see it); only a home grants a lease
                    if front.copy.is_none() {
                        if let Some(c) = self.clients.get_mut(front.client).filter(|c| c.id == front.cid) {
                            c.leases.record(self.router.map(), key_hash(h.key), owner, h.replicas, h.lease_ms, now);
                        }
                    }
                }
                Frame::Redirect { .. } | Frame::Error(_) if front.copy.is_some() => {
                    // the copy is gone or cannot answer: resent home (see `redirected`)
                    front.rd = Some(Redirect { epoch: 0, to: owner });
                }
                Frame::Redirect { epoch, server, worker } => {
                    front.rd = Some(Redirect { epoch, to: (server, worker) });
                    u.extra.delta.redirects += 1;
                }
                Frame::Meta { code: [b'M', b'N'], .. } if quiet => end = true,
                Frame::Hello { server, worker, .. } if matches!(front.what, What::Hello) => {
                    if (server, worker) != owner {
                        after.push(After::UpstreamBroken("hello answered by another worker"));
                        break 'frames;
                    }
                    u.backoff = BACKOFF_MIN;
                    self.health.reachable(owner.0);
                }
                Frame::Map { epoch, json } if matches!(front.what, What::Map) => {
                    after.push(After::InstallMap(epoch, json.to_vec()));
                }
                _ if matches!(front.what, What::Hello | What::Map) => {
                    after.push(After::UpstreamBroken("unexpected reply to mbal hello or mbal map"));
                    break 'frames;
                }
                Frame::Value(v) => {
                    self.counters.get_hits += 1;
                    let Some(s) = slot_mut(&mut self.clients, front.client, front.cid, front.seq) else {
                        continue;
                    };
                    match (&mut front.what, s.multi.as_mut()) {
                        (What::Get { positions: Some(pos), cursor }, Some(m)) => {
                            // the next key of this request that is this value's key
                            let Some(p) = match_key(&front.req, pos, cursor, v.key) else {
                                after.push(After::UpstreamBroken("value of a key not asked for"));
                                break 'frames;
                            };
                            m.spans[p as usize] = (m.arena.len() as u32, bytes.len() as u32);
                            m.arena.extend_from_slice(bytes);
                        }
                        _ => s.buf.extend_from_slice(bytes),
                    }
                }
                Frame::End { .. } => {
                    if let (What::Get { positions: None, .. }, Some(s)) =
                        (&front.what, slot_mut(&mut self.clients, front.client, front.cid, front.seq))
                    {
                        s.buf.extend_from_slice(bytes);
                    }
                }
                Frame::Error(line) if matches!(front.what, What::Flush | What::Get { positions: Some(_), .. }) => {
                    if let Some(s) = slot_mut(&mut self.clients, front.client, front.cid, front.seq) {
                        if s.err.is_none() {
                            let mut e = line.to_vec();
                            e.extend_from_slice(b"\r\n");
                            s.err = Some(e);
                        }
                    }
                }
                _ if matches!(front.what, What::Flush | What::FlushSync) => {}
                _ => {
                    if let Some(s) = slot_mut(&mut self.clients, front.client, front.cid, front.seq) {
                        s.buf.extend_from_slice(bytes);
                    }
                }
            }
            if end {
                let inf = u.inflight.pop_front().unwrap();
                u.extra.delta.latencies.push(now.duration_since(inf.sent).as_micros().min(u32::MAX as u128) as u32);
                match inf.rd {
                    Some(_) => after.push(After::Resend(inf)),
                    None if matches!(inf.what, What::Hello | What::Map) => {}
                    None => {
                        self.counters.replica_reads += u64::from(inf.copy.is_some());
                        after.push(After::Done { client: inf.client, cid: inf.cid, seq: inf.seq });
                        recycle(&mut self.bufs, inf.req);
                    }
                }
            }
        }
        rx.consume(rpos);
        let u = &mut self.ups[ui];
        u.rx = rx;
        for a in after.drain(..) {
            match a {
                After::Done { client, cid, seq } => self.part_done(client, cid, seq),
                After::Resend(inf) => self.redirected(owner, inf),
                After::InstallMap(epoch, json) => {
                    self.fetching_map = false;
                    let from = self.ups[ui].extra.addr_s.clone();
                    self.install_map_json(epoch, &json, &from);
                    self.resume_waiting_map();
                }
                After::UpstreamBroken(why) => {
                    tracing::debug!("proxy: upstream {}: {why}", self.ups[ui].addr);
                    if self.ups[ui].connected() {
                        self.down(ui);
                    }
                }
            }
        }
        self.after = after;
    }

    /// Match a binary upstream's responses to its requests in flight.
    pub(super) fn decode_binary(&mut self, ui: usize) {
        use mbal_proto::binary::{opcode as op, BinHeader, HEADER_LEN, MAGIC_RESPONSE};
        let mut rx = std::mem::take(&mut self.ups[ui].rx);
        let rbuf = rx.unread();
        let mut rpos = 0;
        let now = self.now;
        let mut done = Vec::new();
        let mut broken = false;
        loop {
            let u = &mut self.ups[ui];
            let Some(front) = u.inflight.front() else {
                broken = rpos < rbuf.len();
                break;
            };
            if rbuf.len() - rpos < HEADER_LEN {
                break;
            }
            let h = BinHeader::decode(&rbuf[rpos..]);
            if h.magic != MAGIC_RESPONSE {
                broken = true;
                break;
            }
            let total = HEADER_LEN + h.body_len as usize;
            if rbuf.len() - rpos < total {
                break;
            }
            let bytes = &rbuf[rpos..rpos + total];
            rpos += total;
            let status = u16::from_be_bytes([bytes[6], bytes[7]]);
            let ours = front.quiet && h.opcode == op::NOOP;
            if !ours {
                if let Some(s) = slot_mut(&mut self.clients, front.client, front.cid, front.seq) {
                    match front.what {
                        What::BinFlush if status == 0 => {}
                        What::BinFlush => s.err = s.err.take().or_else(|| Some(bytes.to_vec())),
                        _ => s.buf.extend_from_slice(bytes),
                    }
                }
            }
            if ours || !front.quiet {
                let inf = u.inflight.pop_front().unwrap();
                u.extra.delta.latencies.push(now.duration_since(inf.sent).as_micros().min(u32::MAX as u128) as u32);
                done.push((inf.client, inf.cid, inf.seq));
            }
        }
        rx.consume(rpos);
        let u = &mut self.ups[ui];
        u.rx = rx;
        if !done.is_empty() {
            self.health.reachable(u.owner.0);
        }
        for (ci, cid, seq) in done {
            self.part_done(ci, cid, seq);
        }
        if broken && self.ups[ui].connected() {
            tracing::debug!("proxy: binary upstream {}: bad response", self.ups[ui].addr);
            self.down(ui);
        }
    }

    /// A request came back `RD`: learn, then resend it where the router now says.
    pub(super) fn redirected(&mut self, from: Owner, mut inf: Inflight) {
        let rd = inf.rd.take().unwrap();
        if let Some(hash) = inf.copy.take() {
            return self.copy_fallback(hash, inf);
        }
        let follow = u32::from(inf.hops) < u32::from(self.cfg.max_redirects);
        inf.hops += 1;
        if !follow {
            return self.fail(inf, "SERVER_ERROR too many redirects");
        }
        match inf.what {
            What::Keyed { hash, .. } => {
                match self.router.learn(from, rd, [hash]) {
                    Ok(l) => self.maybe_fetch_map(l.fetch_map_from),
                    Err(_) => return self.fail(inf, "SERVER_ERROR bad redirect"),
                }
                self.send_hash(hash, inf);
            }
            What::Get { ref mut positions, .. } => {
                let positions = positions.take();
                self.resplit_learning(inf, positions, Some((from, rd)));
            }
            _ => self.fail(inf, "SERVER_ERROR unexpected redirect"),
        }
    }

    /// A read at a hot key's copy failed (`RD`, an error, or the upstream):
    /// the lease ends and the read goes home.
    fn copy_fallback(&mut self, hash: u64, inf: Inflight) {
        if let Some(c) = self.clients.get_mut(inf.client).filter(|c| c.id == inf.cid) {
            c.leases.end(hash);
        }
        self.counters.replica_fallbacks += 1;
        self.send_hash(hash, inf);
    }

    pub(super) fn maybe_fetch_map(&mut self, from: Option<Owner>) {
        let Some(owner) = from else { return };
        if self.fetching_map {
            return;
        }
        if self.coord.is_some() {
            return self.fetch_from_coordinators(MapFallback::From(owner));
        }
        self.fetch_from_owner(owner);
    }

    /// `mbal map` from the worker `owner` (the one whose redirect named a newer epoch).
    fn fetch_from_owner(&mut self, owner: Owner) {
        self.fetching_map = true;
        self.counters.map_fetches += 1;
        let req = mbal_proto::ext::map_request(Some(self.router.map().epoch()));
        let inf = self.inflight(usize::MAX, 0, 0, req, What::Map, false);
        self.send(owner, inf);
    }
}
