//! A worker's inbox: what peers and the controller send it (requests to
//! execute, replies to its forwarded requests, moves, samples, stats), the
//! emulated capacity's hold queue, and the executor of forwarded requests.

use super::*;
use crate::msg::{ConnMsg, CtlCmd, Dump, OwnMsg, Want};

impl Worker {
    /// Handle what peers sent: as many envelopes as were queued when the
    /// round got here (a peer that keeps sending cannot starve our own
    /// connections), then resume connections paused on `max_inflight` if
    /// the answers brought the count under it.
    pub(super) fn drain_inbox(&mut self) {
        let n = self.inbox.len();
        let now_ns = if n > 0 { self.shared.clock_ns() } else { 0 };
        if n > 0 {
            self.refence(Some(now_ns));
        }
        for _ in 0..n {
            let Ok(env) = self.inbox.try_recv() else { break };
            if self.shard.capacity.limited() && self.hold(&env) {
                self.held.push_back(env);
                continue;
            }
            self.take(env, now_ns);
        }
        if self.inflight < self.max_inflight && !self.blocked.is_empty() {
            for ci in std::mem::take(&mut self.blocked) {
                self.requeue(ci);
            }
        }
    }

    /// Handle one envelope from a peer or the controller (taken in at `now_ns`).
    pub(super) fn take(&mut self, env: Envelope, now_ns: u64) {
        match env {
            Envelope::Reqs(batch) => self.exec_batch(batch, 0, now_ns),
            Envelope::Replies(batch) => {
                self.waited(now_ns, batch.sent_ns);
                for (item, bytes) in batch.iter() {
                    let c = item.cachelet;
                    let resend = match item.bounce {
                        None => {
                            self.deliver(item.to, bytes);
                            (c != NO_CACHELET).then(|| self.shard.tables.answered(c)).flatten()
                        }
                        Some(b) => {
                            let p = Parked { to: item.to, kind: b.kind, bytes: bytes.to_vec() };
                            self.shard.tables.bounced(c, b.hint, p)
                        }
                    };
                    if let Some(q) = resend {
                        self.resend(c, q);
                    }
                }
                batch.recycle();
            }
            Envelope::Conn(ConnMsg::Accepted(sock, peer)) => {
                let listen = self.shared.main_addr;
                if let Some(stream) = self.stream(TcpStream::from_std(sock), peer) {
                    self.register(stream, peer, listen);
                }
            }
            Envelope::Conn(ConnMsg::Internal(sock, peer)) => {
                let listen = self.shared.main_addr;
                if let Some(ci) = self.register(ConnStream::Plain(TcpStream::from_std(sock)), peer, listen) {
                    self.conns[ci].auth.authenticated = true;
                }
            }
            Envelope::Conn(ConnMsg::HandOff(h)) => {
                let HandOff { sock, peer, listen_addr, id, unread, auth, exempt, fresh, by_thread } = *h;
                if let Some(ci) = self.register(sock.map_sock(TcpStream::from_std), peer, listen_addr) {
                    // Counted once, by the worker that accepted it.
                    self.shard.counters.total_connections -= 1;
                    let c = &mut self.conns[ci];
                    c.id = id;
                    c.rbuf = ReadBuf::from_vec(unread);
                    (c.routed, c.by_thread) = (true, by_thread);
                    c.auth = auth;
                    (c.exempt, c.fresh) = (exempt, fresh);
                    c.proto = Some(Protocol::Text);
                    dispatch::hello(&self.shared, self.shared.server_id, self.id, by_thread, c.output.buf());
                }
            }
            Envelope::Own(OwnMsg::Release { cachelet, to, token }) => {
                if self.outgoing.as_ref().is_some_and(|o| o.cachelet() == cachelet) {
                    // It is moving to another server (frozen, perhaps, with its commit under
                    // way): handing it to a thread-mate now would serve it in two places and
                    // lose what the thread-mate acknowledged. The local move is over as it
                    // stands; the cachelet stays here until its migration ends.
                    tracing::debug!(worker = self.id, cachelet, "a local move of a migrating cachelet: it stays");
                    self.shared.tell_controller(CtlMsg::Moved { token, cachelet, worker: self.id });
                    return;
                }
                self.drop_hot_of(cachelet);
                let peers = self.shared.peers();
                let now_ns = self.shared.clock_ns();
                let (store, tables, outbox) = (&mut self.shard.store, &mut self.shard.tables, &mut self.outbox);
                if moves::release(self.id, store, tables, outbox, peers, now_ns, cachelet, to, token) {
                    // Already at `to`: the move is done as it stands.
                    self.shared.tell_controller(CtlMsg::Moved { token, cachelet, worker: to });
                }
            }
            Envelope::Own(OwnMsg::Adopt { cachelet, ver, token }) => {
                let c = cachelet.id();
                self.shard.store.insert_cachelet(cachelet);
                moves::announce(self.shared.server_id, self.id, &mut self.outbox, c, ver);
                if let Some(q) = self.shard.tables.adopted(c, ver) {
                    self.resend(c, q);
                }
                self.shard.counters.cachelets_adopted += 1;
                self.shared.tell_controller(CtlMsg::Moved { token, cachelet: c, worker: self.id });
            }
            Envelope::Ctl(CtlCmd::Sample { seq }) => {
                let sample = Box::new(self.sample());
                let keys = self.shard.store.watch().take_samples();
                let home_reads = self.shard.replicas.hot.take_home_reads();
                self.shard.replicas.sampled_ns = self.shared.clock_ns();
                self.shared.tell_controller(CtlMsg::Sample { seq, sample, keys, home_reads });
                self.restart_alarm();
            }
            Envelope::Ctl(CtlCmd::Hot(cmd)) => self.hot(cmd),
            Envelope::Own(OwnMsg::Owner { cachelet, server, worker, ver }) => {
                if let Some(q) = self.shard.tables.learn(cachelet, server, worker as u16, ver) {
                    self.resend(cachelet, q);
                }
            }
            Envelope::Own(OwnMsg::Reassign { cachelet, server, worker, epoch }) => {
                self.reassign(cachelet, (server, worker), epoch)
            }
            Envelope::Own(OwnMsg::Applied { seq }) => self.shared.tell_controller(CtlMsg::Applied { seq }),
            Envelope::Ctl(CtlCmd::Flush { at }) => {
                self.shard.store.flush_all(at);
                hot::flush_hot(&self.shared, self.id, &mut self.shard.store, &mut self.shard.replicas.hot);
            }
            Envelope::Ctl(CtlCmd::StatsReq { to, want }) => {
                let snap = Box::new(self.snapshot(want));
                self.outbox[to.worker].push(Envelope::Ctl(CtlCmd::StatsResp { to, snap }));
            }
            Envelope::Ctl(CtlCmd::StatsResp { to, snap }) => {
                if self.conns.get(to.conn).is_some_and(|c| c.gen == to.gen) {
                    self.gathered(to.conn, to.seq, *snap);
                }
            }
            Envelope::Ctl(CtlCmd::ResetStats) => {
                self.shard.counters = Counters::default();
                self.shard.store.reset_stats();
            }
            Envelope::Ctl(CtlCmd::Watch { worker, conn, gen, mask }) => {
                self.set_watcher(worker, conn, gen, mask);
                if mask.is_some() {
                    self.outbox[worker].push(Envelope::Ctl(CtlCmd::WatchAck { conn, gen }));
                }
            }
            Envelope::Ctl(CtlCmd::WatchAck { conn, gen }) => self.watch_acked(conn, gen),
            Envelope::Mig(m) => self.migration_step(m),
            Envelope::Ctl(CtlCmd::WatchLog { conn, gen, bytes }) => self.deliver_log(conn, gen, &bytes),
            #[cfg(feature = "test-hooks")]
            Envelope::Ctl(CtlCmd::Stall { ms }) => std::thread::sleep(Duration::from_millis(ms)),
        }
    }

    /// Execute a peer's batch from its request `from` on. With a capacity
    /// cap, only as many as the credit pays for: the rest of the batch
    /// waits at the front of `held` (`held_pos` says where it resumes).
    pub(super) fn exec_batch(&mut self, batch: ReqBatch, from: usize, now_ns: u64) {
        // Another worker's connections: `watch` lines show no `cfd` (0).
        self.shard.store.log().cfd = 0;
        if from == 0 {
            self.waited(now_ns, batch.sent_ns);
        }
        let mut n = batch.len() - from;
        if self.shard.capacity.limited() {
            n = n.min(self.shard.capacity.available());
        }
        // Overlap the index misses of the batch's gets and text stores.
        for (req, bytes) in batch.iter().skip(from).take(n) {
            match req.kind {
                FwdKind::Values { one: 0, .. } => {
                    for key in bytes.split(|&b| b == b' ').filter(|k| !k.is_empty()) {
                        self.shard.store.prefetch(req.cachelet, mbal_cluster::key_hash(key));
                    }
                }
                FwdKind::Values { one: hash, .. } => self.shard.store.prefetch(req.cachelet, hash),
                FwdKind::Raw(_, hash) | FwdKind::Store { hash, .. } => self.shard.store.prefetch(req.cachelet, hash),
            }
        }
        for (req, bytes) in batch.iter().skip(from).take(n) {
            self.exec_forwarded(req, bytes);
        }
        self.shard.capacity.spend(n as u64);
        if from + n < batch.len() {
            self.held.push_front(Envelope::Reqs(batch));
            self.held_pos = from + n;
            self.shard.counters.capacity_stalls += 1;
        } else {
            batch.recycle();
        }
    }

    /// With a capacity cap: must `env` wait in `held` instead of being
    /// handled now? A peer's batch waits while the worker is out of credit;
    /// and once anything waits, whatever could be ordered after it does
    /// too (requests, flushes, stats resets, the move protocol), so that a
    /// connection's requests and control messages keep their order
    /// (`msg`). Replies, new connections and the controller's and stats
    /// gathers' questions do not wait: they are no one's requests and are
    /// ordered after nothing here.
    pub(super) fn hold(&mut self, env: &Envelope) -> bool {
        let hold = match env {
            Envelope::Reqs(_) => !self.held.is_empty() || !self.shard.capacity.has_credit(),
            Envelope::Replies(_) | Envelope::Conn(_) | Envelope::Mig(_) => false,
            // The move protocol acts on the tables the held requests route by.
            Envelope::Own(_) => !self.held.is_empty(),
            Envelope::Ctl(c) => c.ordered() && !self.held.is_empty(),
        };
        if hold && self.held.is_empty() {
            self.shard.counters.capacity_stalls += 1;
        }
        hold
    }

    /// Start of a round with a capacity cap: add the credit earned since
    /// the last one, then spend it on the work that waited for it, oldest
    /// first: peers' batches held in arrival order, then the connections.
    pub(super) fn refill(&mut self, now_ns: u64) {
        self.shard.capacity.refill(now_ns);
        while let Some(env) = self.held.front() {
            if matches!(env, Envelope::Reqs(_)) && !self.shard.capacity.has_credit() {
                return;
            }
            match self.held.pop_front().expect("just looked") {
                Envelope::Reqs(batch) => {
                    let from = std::mem::take(&mut self.held_pos);
                    self.exec_batch(batch, from, now_ns);
                }
                env => self.take(env, now_ns),
            }
        }
        if self.shard.capacity.has_credit() {
            // Those that got no credit last time first, then those that spent it.
            let spent = std::mem::take(&mut self.spent);
            for ci in std::mem::take(&mut self.throttled).into_iter().chain(spent) {
                if let Some(c) = self.conns.get_mut(ci) {
                    c.throttled = false;
                    self.requeue(ci);
                }
            }
        }
    }

    /// Connection `ci` waits for capacity (its input stays where it is).
    pub(super) fn throttle(&mut self, ci: usize) {
        let c = &mut self.conns[ci];
        if !c.throttled {
            c.throttled = true;
            self.throttled.push(ci);
            self.shard.counters.capacity_stalls += 1;
        }
    }

    /// A request another worker forwarded: execute it here and queue the
    /// reply in the batch for its origin, or bounce it back to the origin if
    /// its cachelet is not here (it moved on since the sender looked).
    pub(super) fn exec_forwarded(&mut self, req: &FwdReq, bytes: &[u8]) {
        debug_assert_ne!(req.to.worker, self.id, "a worker never forwards to itself");
        if self.shard.tables.frozen.is_some() && self.frozen_forwarded(req, bytes) {
            return;
        }
        if !self.shard.tables.executes(req.cachelet, req.stamp) {
            debug_assert!(
                self.shard.tables.fenced
                    || !self.shard.store.owns(req.cachelet)
                    || self.shard.tables.owner[req.cachelet as usize].ver > req.stamp
            );
            let hint = self.shard.tables.owner[req.cachelet as usize];
            self.outbox[req.to.worker].replies().bounce(req, bytes, hint);
            return;
        }
        self.shard.counters.forwarded_in += 1;
        let mut ctx = exec_ctx(&mut self.shard.store, &self.shared, &mut self.shard.counters, self.now);
        let limits = &self.limits;
        let hot = &self.shared.settings.hot;
        if hot.may_sync() && !self.shard.replicas.hot.is_empty() {
            // A write to a replicated key answers once its copies have it (SE mode, for the
            // server or the key's prefix; otherwise its copy goes at the end of the round).
            let mut out = Vec::new();
            execute(&mut ctx, limits, req.kind, bytes, &mut out);
            if self.shard.store.watch().dirty_keys().any(|k| hot.sync_for(k)) {
                let hold = Some((req.to, req.cachelet, out));
                hot::copy_writes(
                    &self.shared,
                    self.id,
                    &mut self.shard.store,
                    &mut self.shard.replicas.hot,
                    self.now,
                    hold,
                );
            } else {
                self.outbox[req.to.worker].replies().push(req.to, req.cachelet, |d| d.extend_from_slice(&out));
            }
            return;
        }
        let run = |out: &mut Vec<u8>| execute(&mut ctx, limits, req.kind, bytes, out);
        self.outbox[req.to.worker].replies().push(req.to, req.cachelet, run);
    }

    /// The coordinator's map gave cachelet `c` to `(server, worker)`: drop what this worker
    /// holds of it (its items do not travel between servers yet), take it empty if it is
    /// ours now, and follow the new owner.
    fn reassign(&mut self, c: u32, (server, worker): (u16, u16), epoch: u64) {
        let resetting = self.shared.resetting.load(Ordering::Acquire);
        if let Some(q) = self.shard.tables.stale(c, epoch, resetting) {
            tracing::debug!(cachelet = c, epoch, "a reassign older than this worker's knowledge: kept");
            if let Some(q) = q {
                self.resend(c, q);
            }
            return;
        }
        let mine = server == self.shared.server_id && worker as usize == self.id;
        // A cachelet that arrived from another server (`migrate`) stays: the map only says
        // what its move already did. A reset (this server was declared dead) drops it all.
        let own = self.shard.tables.owner[c as usize];
        let arrived = mine && !resetting && (own.server, own.worker) == (server, worker) && self.shard.store.owns(c);
        if !arrived {
            if let Some(old) = self.shard.store.take_cachelet(c) {
                self.drop_hot_of(c);
                self.shard.counters.cachelets_dropped += 1;
                drop(old);
            }
            if mine {
                let cachelet = self.take_staged(c).unwrap_or_else(|| mbal_store::Cachelet::new(c));
                self.shard.store.insert_cachelet(cachelet);
                self.shard.counters.cachelets_claimed += 1;
            } else if server != self.shared.server_id {
                self.drop_staged(c);
            }
        }
        let (ver, q) = self.shard.tables.reassign(c, server, worker);
        let q = if mine { self.shard.tables.adopted(c, ver).or(q) } else { q };
        if let Some(q) = q {
            self.resend(c, q);
        }
        if self.outgoing.as_ref().is_some_and(|o| o.cachelet() == c) {
            // The move's commit reached this server: what waited for the cachelet now goes
            // where the map says.
            self.end_outgoing();
        }
    }

    /// Send requests parked for cachelet `c` again, in order, on its new
    /// route (or execute them here if this worker owns it now). If another
    /// server owns it now (or this one is fenced), they are answered with
    /// an error: they were sent before the cachelet left.
    pub(super) fn resend(&mut self, c: u32, parked: VecDeque<Parked>) {
        let (s, w) = self.shard.tables.route(c);
        for p in parked {
            if s != self.shared.server_id && s != crate::moves::FENCED && self.forward_parked(&p) {
                continue;
            }
            if s != self.shared.server_id {
                self.shard.counters.foreign_keys += 1;
                let mut out = Vec::new();
                left_answer(p.kind, &p.bytes, &mut out);
                self.deliver(p.to, &out);
            } else if w as usize == self.id {
                self.shard.capacity.spend(1);
                let mut out = Vec::new();
                let mut ctx = exec_ctx(&mut self.shard.store, &self.shared, &mut self.shard.counters, self.now);
                execute(&mut ctx, &self.limits, p.kind, &p.bytes, &mut out);
                self.deliver(p.to, &out);
            } else {
                self.shard.tables.sent(c);
                let stamp = self.shard.tables.stamp(c);
                self.outbox[w as usize].reqs().push(p.to, c, stamp, p.kind, |d| d.extend_from_slice(&p.bytes));
            }
        }
    }

    /// A batch sent at `sent_ns` was taken in at `now_ns`.
    pub(super) fn waited(&mut self, now_ns: u64, sent_ns: u64) {
        let w = now_ns.saturating_sub(sent_ns);
        self.inbox_batches += 1;
        self.inbox_wait_ns += w;
        self.inbox_wait_max_ns = self.inbox_wait_max_ns.max(w);
    }

    /// This worker's counters for the controller's epoch tick.
    pub(super) fn sample(&mut self) -> WorkerSample {
        let cachelets = self
            .shard
            .store
            .cachelet_ids()
            .filter_map(|id| {
                let s = self.shard.store.cachelet(id)?.stats();
                Some(CacheletSample {
                    id,
                    reads: s.reads,
                    writes: s.writes,
                    items: s.items,
                    bytes: s.bytes,
                    pages: s.pages,
                })
            })
            .collect();
        WorkerSample {
            worker: self.id as u16,
            at_ns: self.shared.clock_ns(),
            busy_ns: self.busy_ns,
            inbox_batches: self.inbox_batches,
            inbox_wait_ns: self.inbox_wait_ns,
            inbox_wait_max_ns: std::mem::take(&mut self.inbox_wait_max_ns),
            forwarded_out: self.shard.counters.forwarded_out,
            forwarded_in: self.shard.counters.forwarded_in,
            inbox_len: self.inbox.len() as u64,
            ready_conns: self.ready.len() as u64,
            connections: self.conns.len() as u64,
            cachelets,
            replica_reads: self.shard.counters.replica_reads,
        }
    }

    /// Fill a waiting output slot of one of our connections; it is written
    /// at the end of the round (`flush_dirty`). Every reply answers one
    /// `Slot::Wait` reserved here (and counted in `inflight`), whether or
    /// not its connection is still open.
    pub(super) fn deliver(&mut self, to: ReplyTo, data: &[u8]) {
        debug_assert!(self.inflight > 0, "a reply nobody waits for");
        self.inflight = self.inflight.saturating_sub(1);
        let Some(c) = self.conns.get_mut(to.conn).filter(|c| c.gen == to.gen) else { return };
        c.output.fill(to.seq, data);
        if !c.dirty {
            c.dirty = true;
            self.dirty.push(to.conn);
        }
    }

    pub(super) fn gathered(&mut self, ci: usize, seq: u64, snap: WorkerSnapshot) {
        let Some(c) = self.conns.get_mut(ci) else { return };
        let Some(Slot::Gather(g)) = c.output.slot_mut(seq) else { return };
        g.snaps.push(snap);
        g.remaining -= 1;
        if g.remaining > 0 {
            return;
        }
        let Some(Slot::Gather(g)) = c.output.slot_mut(seq).map(|s| std::mem::replace(s, Slot::Wait)) else {
            return;
        };
        let Gather { group, format, mut snaps, .. } = *g;
        let mut data = Vec::new();
        let ports = self.shared.worker_ports.get().cloned().unwrap_or_default();
        render_stats(&self.shared, &ports, &group, &format, &mut snaps, &mut data);
        self.conns[ci].output.fill(seq, &data);
        self.flush(ci);
    }

    pub(super) fn snapshot(&mut self, want: Want) -> WorkerSnapshot {
        let conns = if want.conns {
            self.conns
                .iter()
                .map(|(_, c)| ConnInfo {
                    id: c.id,
                    addr: format!("tcp:{}", c.peer),
                    listen_addr: format!("tcp:{}", c.listen_addr),
                    state: if c.want_write { "conn_mwrite" } else { "conn_parse_cmd" },
                    idle_secs: self.now.saturating_sub(c.last_active),
                })
                .collect()
        } else {
            Vec::new()
        };
        let cachelets = self
            .shard
            .store
            .cachelet_ids()
            .filter_map(|id| {
                let stats = self.shard.store.cachelet(id).map(|c| c.stats())?;
                Some(CacheletInfo { id, owner: self.id, stats, reads_per_sec: 0, writes_per_sec: 0 })
            })
            .collect();
        WorkerSnapshot {
            worker: self.id,
            counters: {
                let mut c = self.shard.counters.clone();
                let sh = self.shard.replicas.shadow.stats();
                (c.replica_items, c.replica_bytes, c.replica_refused) = (sh.items, sh.bytes, sh.refused);
                c
            },
            store: self.shard.store.stats(),
            curr_connections: self.conns.len() as u64,
            conns,
            cachelets,
            dump: want.dump.map(|d| self.dump(&d)).unwrap_or_default(),
        }
    }

    /// This worker's lines of a dump (`lru_crawler metadump`, `stats cachedump`), within its
    /// bounds.
    fn dump(&self, d: &Dump) -> Vec<u8> {
        let mut out = Vec::new();
        let listed = match d.workers {
            None => true,
            Some(m) => self.id < 64 && m & (1 << self.id) != 0,
        };
        if !listed {
            return out;
        }
        let (class, start) = (self.id + 1, self.shared.start_unix);
        let mut line = Vec::with_capacity(512);
        let mut n = 0usize;
        for cl in self.shard.store.cachelet_ids() {
            let more = self.shard.store.scan_meta(cl, self.now, |it| {
                line.clear();
                stats::dump_item(d.meta, &it, class, start, &mut line);
                if out.len() + line.len() > d.max_bytes || (d.limit > 0 && n >= d.limit) {
                    return false;
                }
                out.extend_from_slice(&line);
                n += 1;
                true
            });
            if !more {
                break;
            }
        }
        out
    }

    /// Complete the local part of stats gathers started this round.
    pub(super) fn finish_self_stats(&mut self) {
        let pending = std::mem::take(&mut self.self_stats);
        for (ci, seq, want) in pending {
            let snap = self.snapshot(want);
            self.gathered(ci, seq, snap);
        }
    }
}

/// What `exec` needs, from a worker's parts (borrowed apart so the caller can
/// still use its outbox).
pub(crate) fn exec_ctx<'a>(
    store: &'a mut WorkerStore,
    shared: &'a Shared,
    counters: &'a mut Counters,
    now: u32,
) -> Ctx<'a> {
    let detail = shared.detail();
    Ctx { store, layout: &shared.layout, cas_enabled: shared.settings.cas_enabled, counters, now, detail }
}

/// Prefetch the index lines of a text get's or store's keys that live in this worker's store.
pub(super) fn prefetch_keys(store: &WorkerStore, near: &Near, layout: &KeySpace, req: &Request) {
    let fetch = |key: &[u8]| {
        let at = locate(layout, key);
        if store.owns(at.cachelet) {
            store.prefetch(at.cachelet, at.hash);
        } else {
            // Another worker's on this thread is read there directly (`near`).
            near.prefetch(at.cachelet, at.hash);
        }
    };
    match req {
        Request::Text(TextCmd::Get { keys, .. }) => keys.iter().for_each(fetch),
        Request::Text(TextCmd::Store { key, .. }) => fetch(key),
        _ => {}
    }
}

/// Where a forwarded request's key lives: by the hash its origin computed
/// (0: none was passed; hash the key here).
fn at(layout: &KeySpace, key: &[u8], hash: u64) -> exec::Loc {
    if hash == 0 {
        return locate(layout, key);
    }
    debug_assert_eq!(hash, mbal_cluster::key_hash(key), "the origin's hash is of this key");
    exec::Loc { hash, cachelet: layout.cachelet_of_hash(hash) }
}

/// Execute one forwarded request on its owner, appending the reply to `out`.
/// The cachelet was checked by the caller.
pub(super) fn execute(ctx: &mut Ctx, limits: &Limits, kind: FwdKind, bytes: &[u8], out: &mut Vec<u8>) {
    match kind {
        FwdKind::Values { cas, touch, one } if one != 0 => {
            exec::text_get_one(ctx, bytes, at(ctx.layout, bytes, one), cas, touch, out);
        }
        FwdKind::Values { cas, touch, .. } => {
            for key in bytes.split(|&b| b == b' ').filter(|k| !k.is_empty()) {
                let at = locate(ctx.layout, key);
                exec::text_get_one(ctx, key, at, cas, touch, out);
            }
        }
        FwdKind::Raw(proto, hash) => match mbal_proto::parse(proto, bytes, limits) {
            Parsed::Req { req: Request::Text(cmd), .. } => {
                let key = text_key(&cmd).expect("only keyed text commands are forwarded");
                exec::text_keyed(ctx, &cmd, at(ctx.layout, key, hash), out);
            }
            Parsed::Req { req: Request::Meta(cmd), .. } => {
                let mut scratch = [0u8; 256];
                match meta_key(&cmd, &mut scratch) {
                    Ok(key) => exec::meta_keyed(ctx, &cmd, key, at(ctx.layout, key, hash), out),
                    Err(e) => e.write(out),
                }
            }
            Parsed::Req { req: Request::Bin(req), .. } => {
                exec::bin_keyed(ctx, &req, at(ctx.layout, req.key, hash), out)
            }
            Parsed::Err { reply, .. } => reply.write(out),
            Parsed::NeedMore => out.extend_from_slice(b"SERVER_ERROR internal forwarding error\r\n"),
        },
        FwdKind::Store { mode, noreply, key_len, hash } => {
            let StoreFields { key, flags, exptime, cas_unique, data } = StoreFields::decode(bytes, key_len);
            let cmd = TextCmd::Store { mode, key, flags, exptime, data, cas_unique, noreply };
            exec::text_keyed(ctx, &cmd, at(ctx.layout, key, hash), out);
        }
    }
}

/// Render a completed stats gather into reply bytes.
pub(super) fn render_stats(
    shared: &Shared,
    ports: &[u16],
    group: &str,
    format: &StatsFormat,
    snaps: &mut [WorkerSnapshot],
    out: &mut Vec<u8>,
) {
    if group == "dump" {
        // `lru_crawler metadump`, `stats cachedump`: the workers' lines in worker order.
        snaps.sort_by_key(|s| s.worker);
        for s in snaps.iter() {
            out.extend_from_slice(&s.dump);
        }
        out.extend_from_slice(b"END\r\n");
        return;
    }
    let now_unix = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    if group == "cachelets" {
        // Rates over the controller's last epoch (0 before the first).
        let latest = shared.latest.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(epoch) = latest {
            let rates: std::collections::HashMap<u32, (f64, f64)> = epoch
                .workers
                .iter()
                .flat_map(|w| w.cachelets.iter().map(|c| (c.id, (c.reads_per_sec, c.writes_per_sec))))
                .collect();
            for c in snaps.iter_mut().flat_map(|w| w.cachelets.iter_mut()) {
                let (r, w) = rates.get(&c.id).copied().unwrap_or_default();
                (c.reads_per_sec, c.writes_per_sec) = (r.round() as u64, w.round() as u64);
            }
        }
    }
    let p = ProcessInfo {
        settings: &shared.settings,
        uptime: shared.now(),
        now_unix,
        main_port: shared.main_addr.port(),
        rejected_conns: shared.rejected_conns.load(Ordering::Relaxed),
        rejected_per_ip: shared.rejected_per_ip.load(Ordering::Relaxed),
        worker_ports: ports,
        detail_enabled: shared.detail().is_some(),
        worker_threads: stats::WorkerThreads {
            started: shared.threads.hosts(),
            active: shared.threads.active(),
            auto: shared.threads.auto(),
            changes: shared.threads.changes.load(Ordering::Relaxed),
            trials: shared.threads.trials.load(Ordering::Relaxed),
        },
        coordinator: (!shared.settings.coordinator.is_empty()).then(|| {
            let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
            let c = &shared.coord;
            stats::CoordinatorFigures {
                id: shared.server_id,
                beats: n(&c.beats),
                beat_failures: n(&c.beat_failures),
                maps_installed: n(&c.maps_installed),
                registrations: n(&c.registrations),
                gone: n(&c.gone),
                peer_reports: n(&c.peer_reports),
                migrations_out: n(&c.migrations_out),
                migrations_failed: n(&c.migrations_failed),
                migrated_out_bytes: n(&c.migrated_out_bytes),
                migration_last_ms: n(&c.migration_last_ms),
                lease_left_ms: n(&shared.lease_until_ns).saturating_sub(shared.clock_ns()) / 1_000_000,
            }
        }),
        forward: shared.forward.as_ref().map(|f| {
            let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
            let s = &f.stats;
            stats::ForwardFigures {
                requests: n(&s.requests),
                errors: n(&s.errors),
                timeouts: n(&s.timeouts),
                redirects: n(&s.redirects),
                connects: n(&s.connects),
            }
        }),
    };
    match format {
        StatsFormat::Binary { opaque } if group == "detail dump" => {
            // memcached's binary answer: the text dump as the value of one stat, `detailed`.
            let mut text = Vec::new();
            stats::render(group, &p, snaps, &mut TextSink(&mut text));
            text.extend_from_slice(b"END\r\n");
            write_response(out, op::STAT, st::NO_ERROR, *opaque, 0, &[], b"detailed", &text);
            write_response(out, op::STAT, st::NO_ERROR, *opaque, 0, &[], &[], &[]);
        }
        StatsFormat::Text => {
            if stats::render(group, &p, snaps, &mut TextSink(out)) {
                out.extend_from_slice(b"END\r\n");
            } else {
                out.extend_from_slice(b"ERROR\r\n");
            }
        }
        StatsFormat::Binary { opaque } => {
            let ok = stats::render(group, &p, snaps, &mut BinSink { out, opaque: *opaque });
            if ok {
                write_response(out, op::STAT, st::NO_ERROR, *opaque, 0, &[], &[], &[]);
            } else {
                write_response(out, op::STAT, st::KEY_ENOENT, *opaque, 0, &[], &[], b"Not found");
            }
        }
    }
}

/// The answer to a request that was on its way to a cachelet when the cachelet went to another
/// server (or this server was fenced).
const LEFT_THE_SERVER: &[u8] = b"SERVER_ERROR the key's cachelet left this mbal server; retry\r\n";

/// The answer to a request that was on its way to a cachelet when the cachelet went to another
/// server (or this one was fenced): a read is a miss, a write an error, a quiet one nothing,
/// each in its protocol's form.
fn left_answer(kind: FwdKind, bytes: &[u8], out: &mut Vec<u8>) {
    use mbal_proto::binary::{opcode as op, status as st, write_response};
    let first_line = || {
        let end = bytes.windows(2).position(|w| w == b"\r\n").unwrap_or(bytes.len());
        &bytes[..end]
    };
    match kind {
        // A run of a multi-get: its keys are misses (the origin writes END).
        FwdKind::Values { .. } | FwdKind::Store { noreply: true, .. } => {}
        FwdKind::Store { .. } => out.extend_from_slice(LEFT_THE_SERVER),
        FwdKind::Raw(Protocol::Binary, _) if bytes.len() >= 24 => {
            let opcode = bytes[1];
            let opaque = u32::from_be_bytes([bytes[12], bytes[13], bytes[14], bytes[15]]);
            match opcode {
                op::GETQ | op::GETKQ | op::GATQ | op::GATKQ => {}
                op::GET | op::GETK | op::GAT | op::GATK => {
                    write_response(out, opcode, st::KEY_ENOENT, opaque, 0, &[], &[], b"Not found")
                }
                _ => write_response(out, opcode, st::NOT_STORED, opaque, 0, &[], &[], LEFT_BIN),
            }
        }
        FwdKind::Raw(Protocol::Binary, _) => {}
        FwdKind::Raw(_, _) => {
            let line = first_line();
            let word = line.split(|&b| b == b' ').next().unwrap_or_default();
            match word {
                b"get" | b"gets" | b"gat" | b"gats" => out.extend_from_slice(b"END\r\n"),
                b"mg" => out.extend_from_slice(b"EN\r\n"),
                _ if line.ends_with(b" noreply") => {}
                _ => out.extend_from_slice(LEFT_THE_SERVER),
            }
        }
    }
}

const LEFT_BIN: &[u8] = b"The key's cachelet left this mbal server";
