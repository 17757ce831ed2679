//! Dispatch: the one place that routes a parsed request. For each request
//! (or each key of a multi-get) it decides whether this worker executes it
//! (`exec`), passes it to the worker that owns the key's cachelet (a
//! request in this round's batch for that worker, `msg`), redirects a
//! routed client, or answers for a key another server holds. Keyless
//! commands (stats, flush_all, `mbal ...`) are handled or broadcast here.

mod admin;
mod ahead;
mod fanout;
use crate::counters::Counters;
use crate::exec::{self, locate, Ctx, Loc};
use crate::moves::{Parked, Tables, FENCED};
use crate::msg::forward::{Job, Kind};
use crate::msg::CtlMsg;
use crate::msg::{CtlCmd, Dump, Want};
use crate::msg::{Envelope, FwdKind, Outbox, ReplyTo, StoreFields};
use crate::near::{Near, NearWorker};
use crate::output::{Gather, Output, Slot, StatsFormat, MAX_PENDING_OUTPUT};
use crate::replica::Replicas;
use crate::shared::Shared;
use crate::worker::exec_ctx;
use admin::admin;
use ahead::{Ahead, Fetch};
use fanout::{cachedump, flush_all, gather_stats, metadump, reset_stats, watch_mask};
use mbal_cluster::KeySpace;
use mbal_proto::binary::{opcode as op, status as st, write_response, BinReq};
use mbal_proto::client::Expect;
use mbal_proto::meta::{meta_key, MetaKind};
use mbal_proto::text::{self, Line, LineState, TextCmd, TuneCmd};
use mbal_proto::{Protocol, Request};
use mbal_store::WorkerStore;
use std::sync::atomic::Ordering;

/// What the connection should do after a request.
pub(crate) enum Action {
    None,
    Close,
    Shutdown,
    /// The connection opted in to routing hints (`mbal hello`), and to being served the keys
    /// of its worker's thread-mates (`threads`).
    Routed {
        by_thread: bool,
    },
    /// `mbal replicator`: a peer's replicator; exempt from the emulated
    /// capacity (`--worker-capacity` models client load, not copy upkeep).
    Exempt,
    /// `mbal hello <epoch> <worker> [threads]`: serve this connection on that worker
    /// from now on (it opts in to routing there, by thread with `threads`).
    HandOff(usize, bool),
    /// A get stopped after the key that ends `at` bytes into its request,
    /// its output being full: parse the rest of the line from there, in
    /// state `rest`, once the client has read.
    Pause {
        at: usize,
        rest: LineState,
    },
    /// `watch`: the connection becomes a log stream of these categories (`mbal_store::log`).
    Watch(u8),
    /// `mbal import ...`: a cachelet arriving from another server, for the worker
    /// (`worker/migrate.rs`); the connection is a member's, exempt from the capacity.
    Import,
}

/// Does `req` name a key of cachelet `c`? (A frozen cachelet's requests wait: `worker/migrate.rs`.)
pub(crate) fn touches(layout: &KeySpace, req: &Request, c: u32) -> bool {
    let hit = |k: &[u8]| locate(layout, k).cachelet == c;
    match req {
        Request::Text(TextCmd::Get { keys, .. }) => keys.iter().any(hit),
        Request::Text(cmd) => text_key(cmd).is_some_and(hit),
        Request::Meta(m) => {
            let mut scratch = [0u8; 256];
            meta_key(m, &mut scratch).is_ok_and(hit)
        }
        Request::Bin(b) => !b.key.is_empty() && hit(b.key),
    }
}

/// Routing state for one connection's request.
pub(crate) struct Route<'a, 'n> {
    pub worker: usize,
    pub conn: usize,
    pub gen: u64,
    pub tables: &'a mut Tables,
    pub server: u16,
    /// The connection opted in to redirects.
    pub routed: bool,
    /// ... and to being served the keys of the workers on its worker's thread (cleared by a
    /// redirect to another worker, see `redirect`).
    pub by_thread: &'a mut bool,
    pub outbox: &'a mut [Outbox],
    pub counters: &'a mut Counters,
    /// Requests this worker forwarded and has no reply for yet.
    pub inflight: &'a mut usize,
    /// Stats gathers that still need this worker's own snapshot.
    pub self_stats: &'a mut Vec<(usize, u64, Want)>,
    /// Phase 1: hot keys homed here (hints) and copies of others' (reads).
    pub replicas: &'a mut Replicas,
    /// The connection's authentication (data and control plane).
    pub auth: &'a mut crate::auth::ConnAuth,
    /// This round's requests for the forwarder, and whether it runs
    /// (`--forward`): keys other servers own are passed to them.
    pub fwd: &'a mut Vec<Job>,
    pub forwarding: bool,
    /// The other workers of this worker's thread, whose stores it may use directly (`near`).
    pub near: &'a mut Near<'n>,
}

/// Where cachelet `c`'s requests go, seen from worker `worker` of server `server` with its
/// ownership tables: here, another worker of this server, or another server (`FENCED`: this
/// server while its lease is out).
fn dest_of(tables: &Tables, server: u16, worker: usize, c: u32) -> Dest {
    let (s, w) = tables.route(c);
    if s != server {
        Dest::Server(s, w)
    } else if w as usize == worker {
        Dest::Here
    } else {
        Dest::Worker(w as usize)
    }
}

/// Does a routed connection take a request for `d` rather than redirect it? Its own keys,
/// and when the server routes by thread (`by_thread`: the connection asked to; `hosts`: the
/// owner shares this worker's thread; `routes_by_thread`: the server allows it), the keys of
/// the workers on its thread (docs/protocol.md, `mbal hello`): those run on the owner's store
/// here (`near`), or go to it as a message when they may not now.
fn routed_takes(
    d: Dest,
    by_thread: bool,
    hosts: impl FnOnce(usize) -> bool,
    routes_by_thread: impl FnOnce() -> bool,
) -> bool {
    match d {
        Dest::Here => true,
        Dest::Worker(w) => by_thread && hosts(w) && routes_by_thread(),
        // A fenced server answers for its own keys as for another server's (no redirect:
        // it does not know who owns them now).
        Dest::Server(s, _) => s == FENCED,
    }
}

impl<'n> Route<'_, 'n> {
    fn dest(&self, at: Loc) -> Dest {
        dest_of(self.tables, self.server, self.worker, at.cachelet)
    }

    /// Does this routed connection take a request for `d` rather than redirect it?
    /// (`routed_takes`.)
    fn takes(&self, shared: &Shared, d: Dest) -> bool {
        routed_takes(d, *self.by_thread, |w| self.near.hosts(w), || shared.routes_by_thread())
    }

    /// Where worker `to`, sharing this worker's thread, is in `near`, if a request for
    /// cachelet `c` may run on its store now (`near`).
    fn near_index(&self, to: usize, c: u32) -> Option<usize> {
        self.near.find(to, c, self.tables, &self.outbox[to])
    }

    /// The worker `near_index` found, to run a request on its store; counted as forwarded at
    /// both ends.
    fn near_at(&mut self, i: usize) -> &mut NearWorker<'n> {
        self.counters.forwarded_out += 1;
        self.counters.forwarded_direct += 1;
        let w = self.near.at(i);
        w.counters.forwarded_in += 1;
        w
    }

    /// Reserve an output slot and append a request for worker `to` to this
    /// round's batch; `write` puts its bytes straight into the batch.
    fn forward(
        &mut self,
        output: &mut Output,
        to: usize,
        cachelet: u32,
        kind: FwdKind,
        write: impl FnOnce(&mut Vec<u8>),
    ) {
        let seq = output.push(Slot::Wait);
        self.counters.forwarded_out += 1;
        *self.inflight += 1;
        let reply = ReplyTo { worker: self.worker, conn: self.conn, gen: self.gen, seq };
        if self.tables.is_parked(cachelet) {
            // Earlier requests for this cachelet wait for its route to
            // settle after a move: queue behind them (see `moves`).
            let mut bytes = Vec::new();
            write(&mut bytes);
            self.tables.park(cachelet, Parked { to: reply, kind, bytes });
        } else {
            self.tables.sent(cachelet);
            let stamp = self.tables.stamp(cachelet);
            self.outbox[to].reqs().push(reply, cachelet, stamp, kind, write);
        }
    }

    /// Reserve an output slot and hand the request to the forwarder, for
    /// the server that owns the key with `hash`.
    fn forward_server(&mut self, output: &mut Output, hash: u64, kind: Kind, req: Vec<u8>) {
        let seq = output.push(Slot::Wait);
        self.counters.forwarded_servers += 1;
        *self.inflight += 1;
        let to = self.reply_to(seq);
        self.fwd.push(Job { to, hash, kind, req });
    }

    fn reply_to(&self, seq: u64) -> ReplyTo {
        ReplyTo { worker: self.worker, conn: self.conn, gen: self.gen, seq }
    }

    /// Reserve an output slot for the controller's answer and ask it.
    fn ask_controller(&mut self, shared: &Shared, output: &mut Output, ask: impl FnOnce(ReplyTo) -> CtlMsg) {
        let reply = self.reply_to(output.push(Slot::Wait));
        *self.inflight += 1;
        shared.tell_controller(ask(reply));
    }
}

/// Start loading what the lookup of a get's key at `at` will read, in this worker's store or,
/// when a worker of its thread owns the key, in that one's (`ahead`). A hint: nothing if the
/// key is elsewhere.
#[inline]
fn prefetch(store: &WorkerStore, near: &Near, at: Loc, f: Fetch) {
    match (f, store.owns(at.cachelet)) {
        (Fetch::Bucket, true) => store.prefetch(at.cachelet, at.hash),
        (Fetch::Item, true) => store.prefetch_item(at.cachelet, at.hash),
        (Fetch::Bucket, false) => near.prefetch(at.cachelet, at.hash),
        (Fetch::Item, false) => near.prefetch_item(at.cachelet, at.hash),
    }
}

/// The bytes of `all` from the start of `first` to the end of `last`, two
/// keys that `all` (a get line's key list) contains, `first` not after `last`.
fn span<'a>(all: &'a [u8], first: &[u8], last: &[u8]) -> &'a [u8] {
    let start = first.as_ptr() as usize - all.as_ptr() as usize;
    let end = last.as_ptr() as usize - all.as_ptr() as usize + last.len();
    &all[start..end]
}

pub(crate) fn text_key<'a>(cmd: &TextCmd<'a>) -> Option<&'a [u8]> {
    match *cmd {
        TextCmd::Store { key, .. }
        | TextCmd::Delete { key, .. }
        | TextCmd::Arith { key, .. }
        | TextCmd::Touch { key, .. } => Some(key),
        _ => None,
    }
}

/// Where a key's cachelet lives, seen from one worker.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Dest {
    Here,
    Worker(usize),
    Server(u16, u16),
}

/// The one place that routes: decide for each request (or each key of a
/// multi-get) whether this worker executes it, passes it to the owning
/// worker, redirects a routed client, or answers for a key another server
/// holds.
pub(crate) fn handle(
    shared: &Shared,
    rt: &mut Route,
    store: &mut WorkerStore,
    now: u32,
    output: &mut Output,
    req: &Request,
    raw: &[u8],
) -> Action {
    let layout = &shared.layout;
    let settings = &shared.settings;
    macro_rules! ctx {
        () => {
            exec_ctx(&mut *store, shared, &mut *rt.counters, now)
        };
    }
    match req {
        Request::Text(cmd) => match cmd {
            TextCmd::Get { keys, cas, touch, line } => {
                if rt.routed && *line == Line::Whole {
                    // A routed client sends a get only to the owner of its
                    // keys (or to a worker of the owner's thread); if its map is stale,
                    // redirect the whole request. (A long line comes in pieces and is
                    // redirected per key.)
                    if let Some(d) = keys.iter().map(|k| rt.dest(locate(layout, k))).find(|&d| !rt.takes(shared, d)) {
                        // Or it reads a hot key's copy here, under a lease.
                        if !rt.replicas.shadow.is_empty() && keys.len() == 1 && !*cas && touch.is_none() {
                            if let Some(key) = keys.iter().next() {
                                if replica_read(shared, rt, output.buf(), key) {
                                    return Action::None;
                                }
                            }
                        }
                        redirect(shared, rt, output, d, None);
                        return Action::None;
                    }
                }
                if rt.forwarding && *line == Line::Whole && whole_remote(rt, layout, keys.iter()) {
                    // One cachelet of another server (a one-key get, most
                    // often): the owner's whole reply passes through.
                    let hash = locate(layout, keys.iter().next().unwrap_or_default()).hash;
                    let req = get_line(*cas, *touch, keys.raw());
                    rt.forward_server(output, hash, Kind::Values { whole: true }, req);
                    return Action::None;
                }
                // Walk keys in order; local keys are answered at once, runs
                // of consecutive keys of one cachelet another worker owns go
                // to it as one message (with `--forward`, runs of another
                // server's cachelet go to the forwarder). END closes the
                // reply after the last run (of the last piece of a long
                // line). Keys another server holds are misses otherwise.
                // A run is (owner, cachelet, its first key, its last key,
                // the first key's hash); its bytes are the stretch of the
                // key list between them, copied into the batch once the run
                // ends.
                type Run<'k> = Option<(Dest, u32, &'k [u8], &'k [u8], u64)>;
                let all = keys.raw();
                let send = |rt: &mut Route, output: &mut Output, run: Run| match run {
                    Some((Dest::Worker(to), c, first, last, hash)) => {
                        let one = if std::ptr::eq(first, last) { hash } else { 0 };
                        let kind = FwdKind::Values { cas: *cas, touch: *touch, one };
                        rt.forward(output, to, c, kind, |d| d.extend_from_slice(span(all, first, last)))
                    }
                    Some((_, _, first, last, hash)) => {
                        let req = get_line(*cas, *touch, span(all, first, last));
                        rt.forward_server(output, hash, Kind::Values { whole: false }, req)
                    }
                    None => {}
                };
                let mut run: Run = None;
                // Each key is located once, a few keys ahead of the one served, and what its
                // lookup will read starts loading then (`ahead`).
                let mut ahead = Ahead::new(keys.iter());
                loop {
                    let near = &*rt.near;
                    let fetch = |at: Loc, f| prefetch(store, near, at, f);
                    let Some((key, at)) = ahead.next(layout, fetch) else { break };
                    match rt.dest(at) {
                        Dest::Here => {
                            send(rt, output, run.take());
                            if rt.routed && !rt.replicas.hot.is_empty() {
                                hot_hint(shared, rt, output.buf(), key, at);
                            }
                            exec::text_get_one(&mut ctx!(), key, at, *cas, *touch, output.buf());
                            if output.unsent() > MAX_PENDING_OUTPUT {
                                let at = key.as_ptr() as usize + key.len() - raw.as_ptr() as usize;
                                let rest = LineState::Keys { cas: *cas, touch: *touch, any: true };
                                return Action::Pause { at, rest };
                            }
                        }
                        // A piece of a long line on a routed connection.
                        d if rt.routed && !rt.takes(shared, d) => redirect(shared, rt, output, d, Some(key)),
                        // Another worker's, on this worker's thread: read it there now.
                        Dest::Worker(to) if let Some(i) = rt.near_index(to, at.cachelet) => {
                            // (The keys of a run sent now to the same worker are read after
                            // this one: a get's reads are not ordered among themselves.)
                            send(rt, output, run.take());
                            let routed = rt.routed;
                            let w = rt.near_at(i);
                            if routed && !w.hot.is_empty() {
                                near_hint(shared, w, output.buf(), key, at);
                            }
                            let mut ctx = exec_ctx(&mut *w.store, shared, &mut *w.counters, now);
                            exec::text_get_one(&mut ctx, key, at, *cas, *touch, output.buf());
                            after_near(shared, w, now);
                            if output.unsent() > MAX_PENDING_OUTPUT {
                                let at = key.as_ptr() as usize + key.len() - raw.as_ptr() as usize;
                                let rest = LineState::Keys { cas: *cas, touch: *touch, any: true };
                                return Action::Pause { at, rest };
                            }
                        }
                        Dest::Server(FENCED, _) => {
                            send(rt, output, run.take());
                            rt.counters.fenced_keys += 1
                        }
                        Dest::Server(..) if !rt.forwarding => {
                            send(rt, output, run.take());
                            rt.counters.foreign_keys += 1
                        }
                        // Another worker's, or (forwarding) another server's.
                        d => match &mut run {
                            Some((_, c, _, last, _)) if *c == at.cachelet => *last = key,
                            _ => {
                                send(rt, output, run.take());
                                run = Some((d, at.cachelet, key, key, at.hash));
                            }
                        },
                    }
                }
                send(rt, output, run.take());
                if *line != Line::Part {
                    output.buf().extend_from_slice(text::END);
                }
                Action::None
            }
            TextCmd::Store { .. } | TextCmd::Delete { .. } | TextCmd::Arith { .. } | TextCmd::Touch { .. } => {
                let key = text_key(cmd).unwrap();
                let at = locate(layout, key);
                let exec = |ctx: &mut Ctx, out: &mut Vec<u8>| exec::text_keyed(ctx, cmd, at, out);
                let noreply = match *cmd {
                    TextCmd::Store { noreply, .. }
                    | TextCmd::Delete { noreply, .. }
                    | TextCmd::Arith { noreply, .. }
                    | TextCmd::Touch { noreply, .. } => noreply,
                    _ => false,
                };
                let remote = Kind::Line { expect: Expect::Line, quiet: noreply, silent: noreply };
                let travel = Travel::text(cmd, at);
                route_keyed(shared, rt, store, now, output, at, travel, raw, None, exec, remote, |o| {
                    foreign_text(cmd, o)
                });
                Action::None
            }
            TextCmd::FlushAll { delay, noreply } => {
                if !settings.flush_enabled {
                    output.buf().extend_from_slice(b"CLIENT_ERROR flush_all not allowed\r\n");
                    return Action::None;
                }
                flush_all(shared, rt, store, now, *delay);
                if !noreply {
                    output.buf().extend_from_slice(text::OK);
                }
                Action::None
            }
            TextCmd::Version => {
                mbal_proto::text::write_version(output.buf(), crate::VERSION);
                Action::None
            }
            TextCmd::Verbosity { noreply } => {
                if !noreply {
                    output.buf().extend_from_slice(text::OK);
                }
                Action::None
            }
            TextCmd::Stats { args } => {
                let group = String::from_utf8_lossy(args).trim().to_string();
                match group.as_str() {
                    "reset" => {
                        reset_stats(rt, store);
                        output.buf().extend_from_slice(b"RESET\r\n");
                    }
                    "" | "settings" | "items" | "slabs" | "conns" | "cachelets" | "workers" | "detail dump" => {
                        gather_stats(shared, rt, output, group, StatsFormat::Text)
                    }
                    "balancer" => {
                        crate::stats::render_balancer(
                            &shared.settings,
                            &shared.balancer_status(),
                            &mut crate::stats::TextSink(output.buf()),
                        );
                        output.buf().extend_from_slice(text::END);
                    }
                    "hotkeys" => {
                        crate::stats::render_hotkeys(
                            &shared.settings,
                            &shared.hot_status(),
                            shared.replicator.is_some(),
                            &mut crate::stats::TextSink(output.buf()),
                        );
                        output.buf().extend_from_slice(text::END);
                    }
                    "detail on" | "detail off" => {
                        shared.detail.store(group == "detail on", Ordering::Relaxed);
                        output.buf().extend_from_slice(text::OK);
                    }
                    g if g == "cachedump" || g.starts_with("cachedump ") => cachedump(shared, rt, output, g),
                    g if matches!(g.split(' ').next(), Some("sizes" | "sizes_enable" | "sizes_disable")) => {
                        let end = crate::stats::render_sizes(
                            &shared.settings,
                            store.global(),
                            g,
                            &mut crate::stats::TextSink(output.buf()),
                        );
                        if end {
                            output.buf().extend_from_slice(text::END);
                        }
                    }
                    g if g == "detail" || g.starts_with("detail ") => {
                        output.buf().extend_from_slice(b"CLIENT_ERROR usage: stats detail on|off|dump\r\n")
                    }
                    _ => output.buf().extend_from_slice(b"ERROR\r\n"),
                }
                Action::None
            }
            TextCmd::Quit => Action::Close,
            TextCmd::RefreshCerts => {
                // memcached's answer: OK, or ERROR and why (the old certificate stays in use).
                let line = match &shared.tls {
                    None => "ERROR TLS is not enabled\r\n".to_string(),
                    Some(tls) => match tls.reload() {
                        Ok(()) => "OK\r\n".to_string(),
                        Err(e) => format!("ERROR {}\r\n", e.replace(['\r', '\n'], " ")),
                    },
                };
                output.buf().extend_from_slice(line.as_bytes());
                Action::None
            }
            TextCmd::Shutdown { args } => {
                // memcached hangs up on the asker, writing nothing, as it shuts down.
                if !settings.shutdown_enabled {
                    output.buf().extend_from_slice(b"ERROR: shutdown not enabled\r\n");
                    Action::None
                } else if args.is_empty() || *args == b"graceful" {
                    Action::Shutdown
                } else {
                    output.buf().extend_from_slice(b"CLIENT_ERROR invalid shutdown mode\r\n");
                    Action::None
                }
            }
            TextCmd::Tune { cmd: TuneCmd::LruCrawler, args } if args.starts_with(b"metadump") => {
                metadump(shared, rt, output, args);
                Action::None
            }
            TextCmd::Tune { cmd: TuneCmd::Watch, args } => match watch_mask(args) {
                // The worker answers OK once every worker logs for it (`Worker::announce_watch`).
                Some(mask) => Action::Watch(mask),
                None => {
                    output.buf().extend_from_slice(b"ERROR\r\n");
                    Action::None
                }
            },
            TextCmd::Tune { cmd, args } => {
                crate::tune::tune(*cmd, args, output.buf());
                Action::None
            }
            TextCmd::Mbal { args, data } => admin(shared, rt, output, args, data),
        },
        Request::Meta(cmd) => {
            if cmd.kind == MetaKind::Noop {
                output.buf().extend_from_slice(b"MN\r\n");
                return Action::None;
            }
            let mut scratch = [0u8; 256];
            let key = match meta_key(cmd, &mut scratch) {
                Ok(k) => k,
                Err(e) => {
                    e.write(output.buf());
                    return Action::None;
                }
            };
            let at = locate(layout, key);
            // A routed read may carry a hot-key hint from the key's home (here or on this thread).
            let hint = (rt.routed && cmd.kind == MetaKind::Get).then_some(key);
            let exec = |ctx: &mut Ctx, out: &mut Vec<u8>| exec::meta_keyed(ctx, cmd, key, at, out);
            let remote = Kind::Line { expect: Expect::Meta, quiet: cmd.flags.has(b'q'), silent: false };
            let travel = Travel::Raw(Protocol::Text);
            route_keyed(shared, rt, store, now, output, at, travel, raw, hint, exec, remote, |out| {
                foreign_meta(cmd, out)
            });
            Action::None
        }
        Request::Bin(breq) => handle_bin(shared, rt, store, now, output, breq, raw),
    }
}

/// How a single-key request travels to another worker of this server.
enum Travel<'r> {
    /// Its bytes, in this protocol (the owner parses them).
    Raw(Protocol),
    /// A text storage command as the origin parsed it (the owner does not parse it again).
    Store(FwdKind, StoreFields<'r>),
}

impl<'r> Travel<'r> {
    fn text(cmd: &TextCmd<'r>, at: Loc) -> Travel<'r> {
        match *cmd {
            TextCmd::Store { mode, key, flags, exptime, data, cas_unique, noreply } => match u8::try_from(key.len()) {
                Ok(key_len) => Travel::Store(
                    FwdKind::Store { mode, noreply, key_len, hash: at.hash },
                    StoreFields { key, flags, exptime, cas_unique, data },
                ),
                Err(_) => Travel::Raw(Protocol::Text),
            },
            _ => Travel::Raw(Protocol::Text),
        }
    }
}

/// Route one single-key request: execute it here, redirect a routed client,
/// pass it to the owning worker, or answer for a key another server holds.
/// (Binary connections never opt in to routing, so they never redirect.)
/// `hint`: the key of a routed read, which carries a hot-key hint when it runs at the key's
/// home (here or on a neighbour's store).
#[allow(clippy::too_many_arguments)]
fn route_keyed(
    shared: &Shared,
    rt: &mut Route,
    store: &mut WorkerStore,
    now: u32,
    output: &mut Output,
    at: Loc,
    travel: Travel,
    raw: &[u8],
    hint: Option<&[u8]>,
    exec: impl FnOnce(&mut Ctx, &mut Vec<u8>),
    remote: Kind,
    foreign: impl FnOnce(&mut Vec<u8>),
) {
    match rt.dest(at) {
        Dest::Here => {
            if let Some(key) = hint.filter(|_| !rt.replicas.hot.is_empty()) {
                hot_hint(shared, rt, output.buf(), key, at);
            }
            exec(&mut exec_ctx(store, shared, &mut *rt.counters, now), output.buf())
        }
        d if rt.routed && !rt.takes(shared, d) => redirect(shared, rt, output, d, None),
        Dest::Worker(owner) => {
            if let Some(i) = rt.near_index(owner, at.cachelet) {
                let w = rt.near_at(i);
                if let Some(key) = hint.filter(|_| !w.hot.is_empty()) {
                    near_hint(shared, w, output.buf(), key, at);
                }
                exec(&mut exec_ctx(&mut *w.store, shared, &mut *w.counters, now), output.buf());
                return after_near(shared, w, now);
            }
            match travel {
                Travel::Raw(proto) => {
                    rt.forward(output, owner, at.cachelet, FwdKind::Raw(proto, at.hash), |d| d.extend_from_slice(raw))
                }
                Travel::Store(kind, f) => rt.forward(output, owner, at.cachelet, kind, |d| f.encode(d)),
            }
        }
        Dest::Server(FENCED, _) => {
            rt.counters.fenced_keys += 1;
            foreign(output.buf())
        }
        Dest::Server(..) if rt.forwarding => rt.forward_server(output, at.hash, remote, raw.to_vec()),
        Dest::Server(..) => {
            rt.counters.foreign_keys += 1;
            foreign(output.buf())
        }
    }
}

/// After a request ran directly on a neighbour's store (`near`): a write to one of its hot
/// keys goes to the replicator now, as the owner's own writes do, before the reply can leave.
fn after_near(shared: &Shared, w: &mut NearWorker, now: u32) {
    if w.store.has_dirty() {
        crate::worker::copy_writes(shared, w.id, w.store, w.hot, now, None);
    }
}

/// Are all of a get's keys of one cachelet that another server owns?
fn whole_remote<'k>(rt: &Route, layout: &KeySpace, mut keys: impl Iterator<Item = &'k [u8]>) -> bool {
    let Some(first) = keys.next() else { return false };
    let c = locate(layout, first).cachelet;
    matches!(rt.dest(Loc { hash: 0, cachelet: c }), Dest::Server(s, _) if s != FENCED)
        && keys.all(|k| locate(layout, k).cachelet == c)
}

/// `get`/`gets`/`gat <exptime>`/`gats <exptime>` with these keys, as a request line.
pub(crate) fn get_line(cas: bool, touch: Option<i64>, keys: &[u8]) -> Vec<u8> {
    let mut req = Vec::with_capacity(keys.len() + 24);
    match (touch, cas) {
        (None, false) => req.extend_from_slice(b"get "),
        (None, true) => req.extend_from_slice(b"gets "),
        (Some(t), cas) => {
            req.extend_from_slice(if cas { b"gats " } else { b"gat " });
            req.extend_from_slice(itoa::Buffer::new().format(t).as_bytes());
            req.push(b' ');
        }
    }
    req.extend_from_slice(keys);
    req.extend_from_slice(b"\r\n");
    req
}

/// `RH hot <key> <replicas> <lease-ms>` before the reply to a routed read
/// of a key this worker replicates (docs/protocol.md).
fn hot_hint(shared: &Shared, rt: &mut Route, out: &mut Vec<u8>, key: &[u8], at: Loc) {
    if let Some(h) = rt.replicas.hot.hint(at.hash, key, shared.clock_ns()) {
        rt.counters.hot_hints += 1;
        mbal_proto::ext::write_hot_hint(out, key, h.replicas, h.lease_ms);
    }
}

/// [`hot_hint`] for a key of a neighbour on this thread (`near`), from its hot table.
fn near_hint(shared: &Shared, w: &mut NearWorker, out: &mut Vec<u8>, key: &[u8], at: Loc) {
    if let Some(h) = w.hot.hint(at.hash, key, shared.clock_ns()) {
        w.counters.hot_hints += 1;
        mbal_proto::ext::write_hot_hint(out, key, h.replicas, h.lease_ms);
    }
}

/// A routed `get` of one key another server owns: answer it from this
/// worker's copy if it holds a live one (the client has a lease).
fn replica_read(shared: &Shared, rt: &mut Route, out: &mut Vec<u8>, key: &[u8]) -> bool {
    match rt.replicas.shadow.get(key, shared.clock_ns()) {
        Some(c) => {
            text::write_value(out, key, c.flags, &c.value, None);
            out.extend_from_slice(text::END);
            rt.counters.replica_reads += 1;
            true
        }
        None => {
            rt.counters.replica_redirects += 1;
            false
        }
    }
}

/// `mbal rset|rdel|rttl`: the shadow side of Phase 1 (a home server's
/// replicator keeping its copies on this worker).
fn shadow_cmd(shared: &Shared, rt: &mut Route, out: &mut Vec<u8>, args: &str, data: &[u8]) {
    let now = shared.clock_ns();
    let t: Vec<&str> = args.split_whitespace().collect();
    let sh = &mut rt.replicas.shadow;
    match t.as_slice() {
        ["rset", key, flags, exptime, _bytes, ttl] => {
            let (Ok(flags), Ok(exptime), Ok(ttl)) = (flags.parse::<u32>(), exptime.parse::<u64>(), ttl.parse::<u64>())
            else {
                return out
                    .extend_from_slice(b"CLIENT_ERROR usage: mbal rset <key> <flags> <exptime> <bytes> <ttl-ms>\r\n");
            };
            let expires = (exptime > 0).then(|| now + exptime * 1_000_000_000);
            if sh.put(key.as_bytes(), flags, data, ttl, expires, now) {
                out.extend_from_slice(text::STORED);
            } else {
                out.extend_from_slice(b"SERVER_ERROR replica memory full\r\n");
            }
        }
        ["rdel", key] => {
            let line: &[u8] = if sh.del(key.as_bytes()) { text::DELETED } else { text::NOT_FOUND };
            out.extend_from_slice(line);
        }
        ["rttl", key, ttl] => match ttl.parse::<u64>().map(|ttl| sh.renew(key.as_bytes(), ttl, now)) {
            // The reads the copy served since the last renewal go back to the home.
            Ok(Some(reads)) => mbal_proto::ext::write_ok_count(out, reads),
            Ok(None) => out.extend_from_slice(text::NOT_FOUND),
            Err(_) => out.extend_from_slice(b"CLIENT_ERROR usage: mbal rttl <key> <ttl-ms>\r\n"),
        },
        _ => out.extend_from_slice(b"CLIENT_ERROR bad mbal replica command\r\n"),
    }
}

/// The answer to `mbal hello`: `MBAL <server> <worker> <epoch>`, and `<threads>` to a client
/// that routes by thread.
pub(crate) fn hello(shared: &Shared, server: u16, worker: usize, by_thread: bool, out: &mut Vec<u8>) {
    let epoch = shared.epoch.load(Ordering::Relaxed);
    let threads = by_thread.then(|| shared.routing_threads());
    mbal_proto::ext::write_hello(out, server, worker as u16, epoch, threads);
}

/// `RD <epoch> <server> <worker>`: tell a routed client who owns the key;
/// with the key appended when it stands for one key of a long get line.
fn redirect(shared: &Shared, rt: &mut Route, output: &mut Output, d: Dest, key: Option<&[u8]>) {
    let (s, w) = match d {
        Dest::Here => unreachable!("no redirect to ourselves"),
        Dest::Worker(w) => {
            // A connection routed by thread is served no thread-mate's keys after this until
            // it says `mbal hello ... threads` again: a later request of its pipeline for the
            // same key must not run here before the client resends this one to the owner (the
            // threads may change back in between).
            *rt.by_thread = false;
            (rt.server, w as u16)
        }
        Dest::Server(s, w) => (s, w),
    };
    rt.counters.redirects += 1;
    mbal_proto::ext::write_redirect_key(output.buf(), shared.epoch.load(Ordering::Relaxed), s, w, key);
}

const FOREIGN: &[u8] = b"SERVER_ERROR key is served by another mbal server\r\n";

/// The answer to a request for cachelet `c` while its move to another server waits to learn
/// whether its commit stood (`Tables::unsure`): an error naming the cause, for reads too (a
/// miss would read older than what the client may have written), nothing for `noreply`;
/// binary: status 0x86 (temporary failure), as the proxy answers for a server it cannot reach.
pub(crate) fn moving_reply(req: &Request, c: u32, out: &mut Vec<u8>) {
    let text = format!("cachelet {c} is moving to another server; try again");
    match req {
        Request::Text(
            TextCmd::Store { noreply: true, .. }
            | TextCmd::Delete { noreply: true, .. }
            | TextCmd::Arith { noreply: true, .. }
            | TextCmd::Touch { noreply: true, .. },
        ) => {}
        Request::Text(_) | Request::Meta(_) => {
            out.extend_from_slice(b"SERVER_ERROR ");
            out.extend_from_slice(text.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        Request::Bin(b) => {
            write_response(out, b.header.opcode, TEMPORARY_FAILURE, b.header.opaque, 0, &[], &[], text.as_bytes())
        }
    }
}

/// Binary status "temporary failure" (memcached's `PROTOCOL_BINARY_RESPONSE_ETMPFAIL`).
const TEMPORARY_FAILURE: u16 = 0x86;

/// A plain client asked this server for a key another server of the
/// cluster holds: answer as a memcached that does not hold the key would,
/// and refuse writes rather than store them in the wrong partition.
fn foreign_text(cmd: &TextCmd, out: &mut Vec<u8>) {
    match *cmd {
        TextCmd::Store { .. } => out.extend_from_slice(FOREIGN),
        TextCmd::Delete { noreply: false, .. }
        | TextCmd::Arith { noreply: false, .. }
        | TextCmd::Touch { noreply: false, .. } => out.extend_from_slice(text::NOT_FOUND),
        _ => {}
    }
}

fn foreign_meta(cmd: &mbal_proto::meta::MetaCmd, out: &mut Vec<u8>) {
    let quiet = cmd.flags.has(b'q');
    match cmd.kind {
        MetaKind::Set => out.extend_from_slice(FOREIGN),
        MetaKind::Get | MetaKind::Debug if !quiet => out.extend_from_slice(b"EN\r\n"),
        MetaKind::Delete | MetaKind::Arith if !quiet => out.extend_from_slice(b"NF\r\n"),
        _ => {}
    }
}

pub(crate) fn handle_bin(
    shared: &Shared,
    rt: &mut Route,
    store: &mut WorkerStore,
    now: u32,
    output: &mut Output,
    req: &BinReq,
    raw: &[u8],
) -> Action {
    let h = &req.header;
    let layout = &shared.layout;
    let settings = &shared.settings;
    if !rt.auth.authenticated && !crate::auth::bin_allowed_before_auth(h.opcode) {
        crate::auth::bin_unauthenticated(req, output.buf());
        return Action::Close;
    }
    match h.opcode {
        op::SASL_LIST_MECHS | op::SASL_AUTH | op::SASL_STEP => {
            crate::auth::sasl(settings, rt.counters, rt.auth, req, output.buf());
            Action::None
        }
        op::NOOP => {
            write_response(output.buf(), op::NOOP, st::NO_ERROR, h.opaque, 0, &[], &[], &[]);
            Action::None
        }
        op::VERSION => {
            write_response(output.buf(), op::VERSION, st::NO_ERROR, h.opaque, 0, &[], &[], crate::VERSION.as_bytes());
            Action::None
        }
        op::VERBOSITY => {
            write_response(output.buf(), op::VERBOSITY, st::NO_ERROR, h.opaque, 0, &[], &[], &[]);
            Action::None
        }
        op::QUIT | op::QUITQ => {
            if h.opcode == op::QUIT {
                write_response(output.buf(), op::QUIT, st::NO_ERROR, h.opaque, 0, &[], &[], &[]);
            }
            Action::Close
        }
        op::FLUSH | op::FLUSHQ => {
            if !settings.flush_enabled {
                write_response(output.buf(), h.opcode, st::EINVAL, h.opaque, 0, &[], &[], b"Flush not allowed");
                return Action::None;
            }
            let delay = match req.flush_delay() {
                Ok(d) => d,
                Err(e) => {
                    e.write(output.buf());
                    return Action::None;
                }
            };
            flush_all(shared, rt, store, now, delay as i64);
            if h.opcode == op::FLUSH {
                write_response(output.buf(), op::FLUSH, st::NO_ERROR, h.opaque, 0, &[], &[], &[]);
            }
            Action::None
        }
        op::STAT => {
            let group = String::from_utf8_lossy(req.key).to_string();
            if group == "reset" {
                reset_stats(rt, store);
                write_response(output.buf(), op::STAT, st::NO_ERROR, h.opaque, 0, &[], &[], &[]);
            } else if group == "detail on" || group == "detail off" {
                // memcached: the end packet alone.
                shared.detail.store(group == "detail on", Ordering::Relaxed);
                write_response(output.buf(), op::STAT, st::NO_ERROR, h.opaque, 0, &[], &[], &[]);
            } else if matches!(group.split(' ').next(), Some("sizes" | "sizes_enable" | "sizes_disable")) {
                let out = output.buf();
                let sink = &mut crate::stats::BinSink { out: &mut *out, opaque: h.opaque };
                // As in text: no end packet after `sizes_enable`/`sizes_disable` (memcached's).
                if crate::stats::render_sizes(&shared.settings, store.global(), &group, sink) {
                    write_response(out, op::STAT, st::NO_ERROR, h.opaque, 0, &[], &[], &[]);
                }
            } else if group == "balancer" {
                let out = output.buf();
                crate::stats::render_balancer(
                    &shared.settings,
                    &shared.balancer_status(),
                    &mut crate::stats::BinSink { out: &mut *out, opaque: h.opaque },
                );
                write_response(out, op::STAT, st::NO_ERROR, h.opaque, 0, &[], &[], &[]);
            } else {
                gather_stats(shared, rt, output, group, StatsFormat::Binary { opaque: h.opaque });
            }
            Action::None
        }
        _ => {
            let at = locate(layout, req.key);
            let exec = |ctx: &mut Ctx, out: &mut Vec<u8>| exec::bin_keyed(ctx, req, at, out);
            let remote = Kind::Bin { quiet: mbal_proto::binary::is_quiet(h.opcode) };
            let travel = Travel::Raw(Protocol::Binary);
            route_keyed(shared, rt, store, now, output, at, travel, raw, None, exec, remote, |o| foreign_bin(req, o));
            Action::None
        }
    }
}

fn foreign_bin(req: &BinReq, out: &mut Vec<u8>) {
    let h = &req.header;
    match h.opcode {
        op::GETQ | op::GETKQ | op::GATQ | op::GATKQ => {}
        o if mbal_proto::binary::is_store(o) => write_response(
            out,
            h.opcode,
            st::NOT_STORED,
            h.opaque,
            0,
            &[],
            &[],
            b"Key is served by another mbal server",
        ),
        _ => write_response(out, h.opcode, st::KEY_ENOENT, h.opaque, 0, &[], &[], b"Not found"),
    }
}

/// Delete a key wherever it lives in this server (no reply).
pub(crate) fn unlink(
    layout: &KeySpace,
    rt: &mut Route,
    store: &mut WorkerStore,
    now: u32,
    output: &mut Output,
    key: &[u8],
) {
    let at = locate(layout, key);
    match rt.dest(at) {
        Dest::Here => {
            store.delete(at.cachelet, at.hash, key, None, now);
        }
        Dest::Worker(owner) => {
            rt.forward(output, owner, at.cachelet, FwdKind::Raw(Protocol::Text, at.hash), |d| {
                d.extend_from_slice(b"delete ");
                d.extend_from_slice(key);
                d.extend_from_slice(b" noreply\r\n");
            });
        }
        Dest::Server(..) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Worker `me` of server 0 (2 workers x 2 cachelets: 0 and 2 on worker 0, 1 and 3 on 1).
    fn tables(me: usize) -> Tables {
        Tables::new(&mbal_cluster::even_owners(1, 2, 2), 0, me)
    }

    #[test]
    fn a_key_goes_here_to_a_neighbour_or_to_another_server() {
        let mut t = tables(0);
        assert_eq!(dest_of(&t, 0, 0, 0), Dest::Here);
        assert_eq!(dest_of(&t, 0, 0, 1), Dest::Worker(1));
        // The coordinator gave cachelet 2 to server 3's worker 1.
        t.reassign(2, 3, 1);
        assert_eq!(dest_of(&t, 0, 0, 2), Dest::Server(3, 1));
        // Fenced: this server's own cachelets go nowhere, another server's still go there.
        t.fenced = true;
        assert_eq!(dest_of(&t, 0, 0, 0), Dest::Server(FENCED, 0));
        assert_eq!(dest_of(&t, 0, 0, 1), Dest::Server(FENCED, 1));
        assert_eq!(dest_of(&t, 0, 0, 2), Dest::Server(3, 1));
    }

    #[test]
    fn a_routed_connection_takes_its_own_keys_and_its_threads_only_when_asked_and_allowed() {
        let on_thread = |w: usize| w == 1;
        assert!(routed_takes(Dest::Here, false, on_thread, || false));
        assert!(!routed_takes(Dest::Worker(1), false, on_thread, || true), "the connection did not ask");
        assert!(!routed_takes(Dest::Worker(1), true, on_thread, || false), "the server does not allow it");
        assert!(routed_takes(Dest::Worker(1), true, on_thread, || true));
        assert!(!routed_takes(Dest::Worker(2), true, on_thread, || true), "another thread's worker");
        assert!(!routed_takes(Dest::Server(3, 0), true, on_thread, || true), "another server: a redirect");
        assert!(routed_takes(Dest::Server(FENCED, 0), false, on_thread, || false), "fenced: answered here");
    }
}
