//! A worker's part of a cachelet's move between servers (docs/design-notes.md, "Cross-server
//! migration"; the mover thread is `crate::migrate`).
//!
//! At the source, the owning worker answers the mover (`MigMsg`): it notes the writes in
//! the cachelet (`WorkerStore::start_moving`), exports its items batch by batch between its
//! other work, hands over the keys written meanwhile, and at the last delta *freezes* the
//! cachelet: from then on nothing of it runs here. Its own connections that reach a request
//! for it stop there, their input left unread (`frozen_conns`), and other workers' requests
//! for it wait in order (`frozen_reqs`), until the move ends: when the map gives the
//! cachelet to the destination (`reassign`), they run again and go where the map says (a
//! redirect, a forward, or the answer for a key another server holds); when the move fails
//! (`MigMsg::Abort`), they run here.
//!
//! At the destination, the worker named by the move takes `mbal import` requests on a member
//! connection: the items arrive in a cachelet kept out of its store (`staged`) and so out of
//! every table, then, at `mbal import commit` (or when the map gives it the cachelet first),
//! the staged cachelet becomes its own. A staged cachelet whose connection closes before
//! its last frame is dropped; a complete one waits at most `STAGED_TTL_NS` for its commit.

use super::*;
use crate::msg::{MigMsg, MigReply, Own, OwnMsg};
use mbal_store::{wire, StoreResult};

/// Bytes per export batch: about 0.1-0.3 ms of the worker's time, so the requests behind it
/// wait little. (Batches of up to 4 MB in 256 KB steps bounded by 0.2 ms were tried on
/// 2026-12-01: 64 MB of 100 KB values moved at 0.83-1.00 GB/s against 0.92-1.08 with this,
/// within the runs' spread, so this stayed.)
pub(crate) const EXPORT_BUDGET: usize = 256 << 10;

/// How long a complete staged cachelet waits for its commit. A move commits at the
/// coordinator right after its last frame, and the map that says so reaches this server
/// within a beat or two, so a copy that waited longer belongs to a move that was aborted
/// (its `mbal import abort` lost with the connection): adopting it later, when a map gives
/// the cachelet here for another reason, would bring back values older than what the
/// source served after the abort.
const STAGED_TTL_NS: u64 = 3_000_000_000;

/// The cachelet this worker is moving to another server.
pub(crate) struct Outgoing {
    cachelet: u32,
    /// Connections stopped at a request for the frozen cachelet.
    frozen_conns: Vec<usize>,
    /// Other workers' requests for it, in arrival order.
    frozen_reqs: Vec<(FwdReq, Vec<u8>)>,
}

/// A cachelet arriving from another server.
pub(crate) struct Staged {
    id: u64,
    cachelet: Option<Box<mbal_store::Cachelet>>,
    /// Its last frame arrived: it holds everything the source had.
    complete: bool,
    /// When it became complete (`Shared::clock_ns`): kept for `STAGED_TTL` after that, for
    /// a commit whose `mbal import commit` never came (`take_staged`), then dropped.
    complete_ns: u64,
    /// The connection it arrives on.
    conn: (usize, u64),
    pub items: u64,
    pub bytes: u64,
}

impl Outgoing {
    pub fn cachelet(&self) -> u32 {
        self.cachelet
    }
}

impl Worker {
    /// The mover's request (source side).
    pub(super) fn migration_step(&mut self, m: MigMsg) {
        match m {
            MigMsg::Start { cachelet, reply } => {
                let answer = if self.outgoing.is_some() || !self.shard.store.start_moving(cachelet) {
                    MigReply::Failed("the cachelet is not on this worker, or another of its cachelets is moving")
                } else {
                    self.outgoing = Some(Outgoing { cachelet, frozen_conns: Vec::new(), frozen_reqs: Vec::new() });
                    let st = self.shard.store.cachelet(cachelet).map(|c| c.stats()).unwrap_or_default();
                    MigReply::Started { bytes: st.bytes }
                };
                let _ = reply.send(answer);
            }
            MigMsg::Export { cachelet, cursor, budget, reply } => {
                // Encoded here, straight from the items' memory, into frames of at most the
                // item size limit (an item always fits one).
                let max = self.limits.max_item_size;
                let (mut frames, mut items) = (vec![Vec::with_capacity(budget.min(max) + 4096)], 0u64);
                let exported = self.shard.store.export_with(cachelet, cursor, budget, self.now, |r| {
                    let last = frames.last_mut().expect("one frame at least");
                    if !last.is_empty() && last.len() + wire::item_len(r.key.len(), r.value.len()) > max {
                        frames.push(Vec::with_capacity(budget.min(max) + 4096));
                    }
                    wire::encode_ref(wire::Record::Put(r), frames.last_mut().expect("just pushed"));
                    items += 1;
                });
                frames.retain(|f| !f.is_empty());
                let answer = match self.shard.store.moving() == Some(cachelet) {
                    true => match exported {
                        Some(cursor) => MigReply::Frames { frames, items, cursor },
                        None => MigReply::Failed("the cachelet left this worker"),
                    },
                    false => MigReply::Failed("the cachelet left this worker, or a flush_all spoiled the move"),
                };
                let _ = reply.send(answer);
            }
            MigMsg::Delta { cachelet, freeze, reply } => {
                let answer = match (self.shard.store.moving() == Some(cachelet))
                    .then(|| self.shard.store.take_delta(self.now))
                {
                    Some(Some(d)) => {
                        if freeze {
                            self.shard.tables.frozen = Some(cachelet);
                        }
                        MigReply::Delta(d)
                    }
                    Some(None) => MigReply::Failed("a flush_all during the move"),
                    None => MigReply::Failed("the cachelet left this worker"),
                };
                let _ = reply.send(answer);
            }
            MigMsg::Abort { cachelet } => {
                if self.outgoing.as_ref().is_some_and(|o| o.cachelet == cachelet) {
                    self.end_outgoing();
                }
            }
            MigMsg::Unsure { cachelet } => {
                if self.shard.tables.frozen == Some(cachelet) {
                    self.shard.tables.unsure = true;
                    // The connections stopped at it run again: they get the error now.
                    let conns = self.outgoing.as_mut().map(|o| std::mem::take(&mut o.frozen_conns)).unwrap_or_default();
                    for ci in conns {
                        self.requeue(ci);
                    }
                }
            }
        }
    }

    /// The move of this worker's outgoing cachelet ended (failed, or the map gave it away):
    /// what waited for it runs again, wherever the tables now say.
    pub(super) fn end_outgoing(&mut self) {
        let Some(o) = self.outgoing.take() else { return };
        if self.shard.store.moving() == Some(o.cachelet) {
            self.shard.store.stop_moving();
        }
        self.shard.tables.frozen = None;
        self.shard.tables.unsure = false;
        for (req, bytes) in o.frozen_reqs {
            self.exec_forwarded(&req, &bytes);
        }
        for ci in o.frozen_conns {
            self.requeue(ci);
        }
    }

    /// Must a request for `c` wait (its cachelet is frozen here)? If so it is kept.
    pub(super) fn frozen_forwarded(&mut self, req: &FwdReq, bytes: &[u8]) -> bool {
        match &mut self.outgoing {
            Some(o) if self.shard.tables.frozen == Some(req.cachelet) => {
                o.frozen_reqs.push((*req, bytes.to_vec()));
                true
            }
            _ => false,
        }
    }

    /// Connection `ci` stopped at a request for the frozen cachelet.
    pub(super) fn frozen_conn(&mut self, ci: usize) {
        if let Some(o) = &mut self.outgoing {
            if !o.frozen_conns.contains(&ci) {
                o.frozen_conns.push(ci);
            }
        }
    }

    /// The map gives `c` to this worker: the staged copy if it is complete (the move
    /// committed before its `mbal import commit` arrived), else nothing (it starts empty).
    pub(super) fn take_staged(&mut self, c: u32) -> Option<Box<mbal_store::Cachelet>> {
        self.take_staged_as(c, false)
    }

    /// `take_staged`; `committed`: the mover says the move committed (`mbal import commit`),
    /// so a copy past its wait is still this move's (its mover waited for a coordinator).
    fn take_staged_as(&mut self, c: u32, committed: bool) -> Option<Box<mbal_store::Cachelet>> {
        let s = self.staged.remove(&c)?;
        // A reset (this server was declared dead) starts from nothing; a copy past its wait
        // belongs to a move that did not commit (`STAGED_TTL_NS`).
        let fresh = committed || self.shared.clock_ns().saturating_sub(s.complete_ns) <= STAGED_TTL_NS;
        if s.complete && fresh && !self.shared.resetting.load(Ordering::Acquire) {
            self.shard.counters.migrations_in += 1;
            if self.arrived.len() == 16 {
                self.arrived.pop_front();
            }
            self.arrived.push_back(s.id);
            s.cachelet
        } else {
            None
        }
    }

    /// A staged cachelet for `c` that the map gives to another server: never to be ours.
    pub(super) fn drop_staged(&mut self, c: u32) {
        self.staged.remove(&c);
    }

    /// Connection `ci` closed: the incomplete cachelets arriving on it will not complete.
    pub(super) fn staged_conn_closed(&mut self, ci: usize, gen: u64) {
        self.staged.retain(|_, s| s.complete || s.conn != (ci, gen));
    }

    /// Complete staged cachelets whose commit did not come in `STAGED_TTL_NS` (housekeeping):
    /// their moves were aborted; their memory goes back.
    pub(super) fn expire_staged(&mut self) {
        if self.staged.is_empty() {
            return;
        }
        let now = self.shared.clock_ns();
        self.staged.retain(|c, s| {
            let keep = !s.complete || now.saturating_sub(s.complete_ns) <= STAGED_TTL_NS;
            if !keep {
                tracing::info!(cachelet = c, id = s.id, "a moved-in cachelet whose commit never came: dropped");
            }
            keep
        });
    }

    /// `mbal import <...>` (destination side): `begin <id> <cachelet> <bytes>`, `data <id>
    /// <bytes> [final]` with its frame, `commit <id>`, `abort <id>`. One line of answer.
    pub(crate) fn import(&mut self, ci: usize, args: &[&str], data: &[u8], out: &mut Vec<u8>) {
        let gen = self.conns.get(ci).map_or(0, |c| c.gen);
        let r = match args {
            ["begin", id, c, bytes] => match (id.parse::<u64>(), c.parse::<u32>(), bytes.parse::<u64>()) {
                (Ok(id), Ok(c), Ok(bytes)) => self.import_begin(id, c, bytes, (ci, gen)),
                _ => Err("CLIENT_ERROR usage: mbal import begin <id> <cachelet> <bytes>".into()),
            },
            ["data", id, _, rest @ ..] => match id.parse::<u64>() {
                Ok(id) => self.import_data(id, data, rest.first().copied()),
                Err(_) => Err("CLIENT_ERROR usage: mbal import data <id> <bytes> [delta|final]".into()),
            },
            ["commit", id, rest @ ..] if rest.len() <= 1 => {
                // The commit's epoch (sent by movers since it was added; 0: not known).
                match (id.parse::<u64>(), rest.first().map_or(Ok(0), |e| e.parse::<u64>())) {
                    (Ok(id), Ok(epoch)) => self.import_commit(id, epoch),
                    _ => Err("CLIENT_ERROR usage: mbal import commit <id> [<epoch>]".into()),
                }
            }
            ["abort", id] => {
                if let Ok(id) = id.parse::<u64>() {
                    self.staged.retain(|_, s| s.id != id);
                }
                Ok(())
            }
            _ => Err("CLIENT_ERROR usage: mbal import begin|data|commit|abort ...".into()),
        };
        match r {
            Ok(()) => out.extend_from_slice(b"OK\r\n"),
            Err(e) => {
                out.extend_from_slice(e.as_bytes());
                out.extend_from_slice(b"\r\n");
            }
        }
    }

    fn import_begin(&mut self, id: u64, c: u32, bytes: u64, conn: (usize, u64)) -> Result<(), String> {
        if c as usize >= self.shard.tables.len() {
            return Err(format!("CLIENT_ERROR no cachelet {c}"));
        }
        self.expire_staged();
        if self.shard.store.owns(c) || self.staged.contains_key(&c) {
            return Err(format!("SERVER_ERROR cachelet {c} is already here"));
        }
        // Room for its items now, with a margin for the pages they fill part-way.
        let pool = self.shard.store.global();
        let free = pool.available_pages() as u64 * pool.page_size() as u64;
        if bytes + bytes / 8 > free {
            self.shard.counters.migrations_refused += 1;
            return Err(format!("SERVER_ERROR out of memory: the cachelet needs {bytes} bytes, {free} are free"));
        }
        let cachelet = Some(mbal_store::Cachelet::new(c));
        self.staged.insert(c, Staged { id, cachelet, complete: false, complete_ns: 0, conn, items: 0, bytes: 0 });
        Ok(())
    }

    /// A frame: the scan's items (`kind` None: stored unless the key is there), or keys
    /// written during the move (`delta`, and the last one, `final`: stored over what is
    /// there, or deleted).
    fn import_data(&mut self, id: u64, frame: &[u8], kind: Option<&str>) -> Result<(), String> {
        let (delta, last) = (kind.is_some(), kind == Some("final"));
        let Some((&c, _)) = self.staged.iter().find(|(_, s)| s.id == id) else {
            return Err(format!("SERVER_ERROR no move {id} arriving here"));
        };
        let s = self.staged.get_mut(&c).expect("found above");
        let cachelet = s.cachelet.take().expect("a staged cachelet is kept between frames");
        self.shard.store.insert_cachelet(cachelet);
        let mut full = false;
        let mut items = 0u64;
        let (store, now) = (&mut self.shard.store, self.now);
        // Each record straight from the frame into the store (no copy in between).
        let decoded = wire::for_each(frame, self.limits.max_item_size, |r| {
            let res = match r {
                wire::Record::Put(it) if !delta => store.import_ref(c, it, now),
                wire::Record::Put(it) => store.put_ref(c, it, now),
                wire::Record::Gone { hash, key } => store.gone_ref(c, hash, key, now),
            };
            match res {
                StoreResult::OutOfMemory => full = true,
                StoreResult::Stored { .. } => items += 1,
                _ => {}
            }
        });
        let bytes = frame.len() as u64;
        let cachelet = self.shard.store.take_cachelet(c).expect("inserted above");
        if let Err(e) = decoded {
            self.staged.remove(&c);
            return Err(format!("CLIENT_ERROR bad frame: {e}"));
        }
        let s = self.staged.get_mut(&c).expect("found above");
        s.cachelet = Some(cachelet);
        s.items += items;
        s.bytes += bytes;
        self.shard.counters.migrated_in_bytes += frame.len() as u64;
        if full {
            self.staged.remove(&c);
            self.shard.counters.migrations_refused += 1;
            return Err("SERVER_ERROR out of memory storing the moving cachelet".into());
        }
        if last {
            s.complete = true;
            s.complete_ns = self.shared.clock_ns();
        }
        Ok(())
    }

    fn import_commit(&mut self, id: u64, epoch: u64) -> Result<(), String> {
        let Some((&c, s)) = self.staged.iter().find(|(_, s)| s.id == id) else {
            // The map gave it to this worker first (`take_staged`): nothing left to do.
            return match self.arrived.contains(&id) {
                true => Ok(()),
                false => Err(format!("SERVER_ERROR no move {id} arriving here")),
            };
        };
        if !s.complete {
            return Err(format!("SERVER_ERROR move {id} has not sent its last frame"));
        }
        // (None in a reset: this server starts from nothing.)
        let Some(cachelet) = self.take_staged_as(c, true) else {
            return Err(format!("SERVER_ERROR move {id} arrived during a reset: dropped"));
        };
        self.adopt_moved(c, cachelet, epoch);
        Ok(())
    }

    /// The cachelet that arrived is this worker's: into the store, and every worker of this
    /// server follows (the same `Reassign` the controller sends for a new map, so the
    /// versions stay equal everywhere; the map's own `Reassign` later finds it here and keeps
    /// it). `epoch`: the map's at the commit (the controller keeps the cachelet here against
    /// any older map).
    fn adopt_moved(&mut self, c: u32, cachelet: Box<mbal_store::Cachelet>, epoch: u64) {
        let (server, worker) = (self.shared.server_id, self.id as u16);
        if self.shard.store.owns(c) {
            return;
        }
        self.shard.store.insert_cachelet(cachelet);
        let epoch = self.shard.tables.arrived(c, epoch);
        let (ver, q) = self.shard.tables.reassign(c, server, worker);
        let q = self.shard.tables.adopted(c, ver).or(q);
        if let Some(q) = q {
            self.resend(c, q);
        }
        for w in (0..self.outbox.len()).filter(|&w| w != self.id) {
            self.outbox[w].push(Envelope::Own(OwnMsg::Reassign { cachelet: c, server, worker, epoch }));
        }
        let own = Own { server, worker, ver };
        tracing::debug!(cachelet = c, ?own, "a cachelet arrived from another server");
        self.shared.tell_controller(crate::msg::CtlMsg::Arrived { cachelet: c, worker, epoch });
    }
}

impl Worker {
    /// `mbal import ...` read on connection `ci` (`raw`: the whole request): answer it.
    pub(super) fn import_request(&mut self, ci: usize, raw: &[u8]) {
        let Parsed::Req { req: Request::Text(TextCmd::Mbal { args, data }), .. } =
            mbal_proto::parse(Protocol::Text, raw, &self.limits)
        else {
            return;
        };
        let args = String::from_utf8_lossy(args).into_owned();
        let words: Vec<&str> = args.split_whitespace().skip(1).collect();
        let mut out = Vec::new();
        self.import(ci, &words, data, &mut out);
        if let Some(c) = self.conns.get_mut(ci) {
            c.output.buf().extend_from_slice(&out);
            self.flush(ci);
        }
    }
}

impl Worker {
    /// A request of this worker's that waited for a cachelet which moved to another server
    /// meanwhile (`resend`): with `--forward`, it goes to the forwarder, as it would have had
    /// it arrived after the move. False without a forwarder (the caller answers it as a key
    /// another server holds).
    pub(super) fn forward_parked(&mut self, p: &Parked) -> bool {
        use crate::msg::forward::{Job, Kind};
        use mbal_proto::client::Expect;
        if self.shared.forward.is_none() {
            return false;
        }
        let (hash, kind, req) = match p.kind {
            FwdKind::Values { cas, touch, one } => {
                let first = p.bytes.split(|&b| b == b' ').find(|k| !k.is_empty()).unwrap_or_default();
                let hash = if one != 0 { one } else { mbal_cluster::key_hash(first) };
                (hash, Kind::Values { whole: false }, dispatch::get_line(cas, touch, &p.bytes))
            }
            FwdKind::Store { mode, noreply, key_len, hash } => {
                let f = StoreFields::decode(&p.bytes, key_len);
                let cmd: &[u8] = match mode {
                    mbal_proto::text::StoreMode::Set => b"set",
                    mbal_proto::text::StoreMode::Add => b"add",
                    mbal_proto::text::StoreMode::Replace => b"replace",
                    mbal_proto::text::StoreMode::Append => b"append",
                    mbal_proto::text::StoreMode::Prepend => b"prepend",
                    mbal_proto::text::StoreMode::Cas => b"cas",
                };
                let mut req = Vec::with_capacity(f.key.len() + f.data.len() + 64);
                req.extend_from_slice(cmd);
                req.push(b' ');
                req.extend_from_slice(f.key);
                let _ = write!(req, " {} {} {}", f.flags, f.exptime, f.data.len());
                if mode == mbal_proto::text::StoreMode::Cas {
                    let _ = write!(req, " {}", f.cas_unique);
                }
                if noreply {
                    req.extend_from_slice(b" noreply");
                }
                req.extend_from_slice(b"\r\n");
                req.extend_from_slice(f.data);
                req.extend_from_slice(b"\r\n");
                (hash, Kind::Line { expect: Expect::Line, quiet: noreply, silent: noreply }, req)
            }
            FwdKind::Raw(Protocol::Binary, hash) => {
                let quiet = p.bytes.len() > 1 && mbal_proto::binary::is_quiet(p.bytes[1]);
                (hash, Kind::Bin { quiet }, p.bytes.clone())
            }
            FwdKind::Raw(Protocol::Text, hash) => {
                let kind = match mbal_proto::parse(Protocol::Text, &p.bytes, &self.limits) {
                    Parsed::Req { req: Request::Meta(m), .. } => {
                        Kind::Line { expect: Expect::Meta, quiet: m.flags.has(b'q'), silent: false }
                    }
                    Parsed::Req { req: Request::Text(cmd), .. } => {
                        let noreply = match cmd {
                            TextCmd::Store { noreply, .. }
                            | TextCmd::Delete { noreply, .. }
                            | TextCmd::Arith { noreply, .. }
                            | TextCmd::Touch { noreply, .. } => noreply,
                            _ => false,
                        };
                        Kind::Line { expect: Expect::Line, quiet: noreply, silent: noreply }
                    }
                    _ => return false,
                };
                (hash, kind, p.bytes.clone())
            }
        };
        self.shard.counters.forwarded_servers += 1;
        self.fwd.push(Job { to: p.to, hash, kind, req });
        true
    }
}
