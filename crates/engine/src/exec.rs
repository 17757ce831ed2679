//! The one place that executes a request against a worker's cachelets.
//!
//! Routing (which worker owns a key) happens before this, in the server;
//! parsing happens in `mbal-proto`. Every function here runs on the worker
//! that owns the key's cachelet, touches only that worker's `WorkerStore` and
//! counters, and appends the reply bytes to `out`.

use crate::counters::Counters;
use mbal_cluster::KeySpace;
use mbal_proto::binary::{opcode as op, status as st, write_response, BinReq};
use mbal_proto::meta::{MetaCmd, MetaFlags, MetaKind, MetaReply};
use mbal_proto::text::{self, StoreMode, TextCmd};
use mbal_store::{ArithResult, CasOpts, DeleteResult, ItemView, Mode, StoreResult, WorkerStore};

/// What a worker needs to execute a request.
pub struct Ctx<'a> {
    pub store: &'a mut WorkerStore,
    pub layout: &'a KeySpace,
    /// memcached's `-C` off: CAS is kept (else every `cas` fails as if the item changed).
    pub cas_enabled: bool,
    pub counters: &'a mut Counters,
    /// Seconds since process start (the coarse clock).
    pub now: u32,
    /// `stats detail on`: the key prefix delimiter (count this request per prefix).
    pub detail: Option<u8>,
}

impl Ctx<'_> {
    /// `stats detail`: count a get (and whether it hit), set or delete of `key`'s prefix.
    fn detail(&mut self, key: &[u8], what: crate::counters::PrefixOp) {
        if let Some(d) = self.detail {
            self.counters.prefixes.record(key, d, what);
        }
    }
}

/// A key located in the key space: its hash (computed once) and cachelet.
#[derive(Clone, Copy)]
pub struct Loc {
    pub hash: u64,
    pub cachelet: u32,
}

pub fn locate(layout: &KeySpace, key: &[u8]) -> Loc {
    let hash = mbal_cluster::key_hash(key);
    Loc { hash, cachelet: layout.cachelet_of_hash(hash) }
}

fn store_mode(m: StoreMode) -> Mode {
    match m {
        StoreMode::Set | StoreMode::Cas => Mode::Set,
        StoreMode::Add => Mode::Add,
        StoreMode::Replace => Mode::Replace,
        StoreMode::Append => Mode::Append,
        StoreMode::Prepend => Mode::Prepend,
    }
}

// ---------------------------------------------------------------- text ----

/// One key of a text `get`/`gets`/`gat`/`gats`: appends a VALUE block on a
/// hit, nothing on a miss. The caller writes the closing `END`.
pub fn text_get_one(ctx: &mut Ctx, key: &[u8], at: Loc, cas: bool, touch: Option<i64>, out: &mut Vec<u8>) {
    let item = match touch {
        Some(exp) => ctx.store.touch(at.cachelet, at.hash, key, exp, ctx.now),
        None => ctx.store.get(at.cachelet, at.hash, key, ctx.now),
    };
    let hit = item.is_some();
    if let Some(it) = item {
        text::write_value(out, key, it.flags, it.value, cas.then_some(it.cas));
    }
    ctx.detail(key, crate::counters::PrefixOp::Get { hit });
}

/// A single-key text command (everything but get, which is per key above,
/// and the keyless commands, which the worker handles).
pub fn text_keyed(ctx: &mut Ctx, cmd: &TextCmd, at: Loc, out: &mut Vec<u8>) {
    match *cmd {
        TextCmd::Store { mode, key, flags, exptime, data, cas_unique, noreply } => {
            ctx.detail(key, crate::counters::PrefixOp::Set);
            let cas = (mode == StoreMode::Cas).then_some(cas_unique);
            if cas.is_some() && !ctx.cas_enabled {
                // memcached -C: every cas fails as if the item changed.
                reply(out, noreply, text::EXISTS);
                return;
            }
            let r = ctx.store.store(at.cachelet, at.hash, key, data, flags, exptime, store_mode(mode), cas, ctx.now);
            let line: &[u8] = match r {
                StoreResult::Stored { .. } => text::STORED,
                StoreResult::NotStored => text::NOT_STORED,
                StoreResult::Exists => text::EXISTS,
                StoreResult::NotFound => text::NOT_FOUND,
                StoreResult::TooLarge => b"SERVER_ERROR object too large for cache\r\n",
                StoreResult::OutOfMemory => b"SERVER_ERROR out of memory storing object\r\n",
            };
            // noreply hides the SERVER_ERRORs too, as in memcached 1.6 (out_string
            // skips every reply of a noreply command).
            reply(out, noreply, line);
        }
        TextCmd::Delete { key, noreply } => {
            ctx.detail(key, crate::counters::PrefixOp::Delete);
            let line = match ctx.store.delete(at.cachelet, at.hash, key, None, ctx.now) {
                DeleteResult::Deleted => text::DELETED,
                _ => text::NOT_FOUND,
            };
            reply(out, noreply, line);
        }
        TextCmd::Arith { incr, key, delta, noreply } => {
            match ctx.store.arith(at.cachelet, at.hash, key, incr, delta, ctx.now) {
                ArithResult::Value { value, .. } => {
                    if !noreply {
                        text::write_number(out, value);
                    }
                }
                ArithResult::NotFound => {
                    reply(out, noreply, text::NOT_FOUND);
                }
                ArithResult::NonNumeric => {
                    reply(out, noreply, b"CLIENT_ERROR cannot increment or decrement non-numeric value\r\n");
                }
            }
        }
        TextCmd::Touch { key, exptime, noreply } => {
            let hit = ctx.store.touch(at.cachelet, at.hash, key, exptime, ctx.now).is_some();
            reply(out, noreply, if hit { text::TOUCHED } else { text::NOT_FOUND });
        }
        _ => unreachable!("text_keyed called with a keyless or multi-key command"),
    }
}

fn reply(out: &mut Vec<u8>, noreply: bool, line: &[u8]) {
    if !noreply {
        out.extend_from_slice(line);
    }
}

// ---------------------------------------------------------------- meta ----

/// Execute a keyed meta command (mg, ms, md, ma, me) whose key is `key`
/// (already base64-decoded when the b flag was given).
///
/// Replies follow memcached 1.6.18 byte for byte (`tests/vs_memcached.rs` compares them):
/// flags are answered in request order; `k` is followed by ` b` when the key came in
/// base64; `q` hides only the nominal reply (`HD` of ms/md, `EN` of mg, `HD`/`VA` of an
/// ma that changed an existing item); `t` shows the TTL as of its place among the flags, so
/// `t` before `T`/`N` shows the old one.
pub fn meta_keyed(ctx: &mut Ctx, cmd: &MetaCmd, key: &[u8], at: Loc, out: &mut Vec<u8>) {
    ctx.counters.cmd_meta += 1;
    let f = &cmd.flags;
    let quiet = f.has(b'q');
    let now = ctx.now;
    match cmd.kind {
        MetaKind::Get => {
            let (Ok(ttl_update), Ok(vivify), Ok(recache), Ok(explicit)) =
                (f.num::<i64>(b'T'), f.num::<i64>(b'N'), f.num::<i64>(b'R'), explicit_cas(f, ctx.cas_enabled))
            else {
                return bad_flag(out);
            };
            // The item as it was before this request: h, l and a `t` ahead of `T` show it.
            let before = ctx.store.peek(at.cachelet, at.hash, key, now).map(|it| Before::of(&it, now));
            let hit = match (ttl_update, before.is_some()) {
                (Some(exp), _) => ctx.store.touch(at.cachelet, at.hash, key, exp, now).is_some(),
                (None, true) if f.has(b'u') => true, // no bump, no marks
                (None, _) => ctx.store.get(at.cachelet, at.hash, key, now).is_some(),
            };
            let created = !hit && vivify.is_some() && {
                // Vivify: an empty placeholder; this client wins the recache, later ones see Z.
                let ttl = vivify.unwrap_or(0);
                ctx.store.store(at.cachelet, at.hash, key, b"", 0, ttl, Mode::Add, None, now);
                ctx.store.update(at.cachelet, at.hash, key, now, |m| {
                    m.win = true;
                    if let Some(e) = explicit {
                        m.cas = e; // E: the vivified item's CAS
                    }
                })
            };
            let Some(it) = ctx.store.peek(at.cachelet, at.hash, key, now) else {
                if !quiet {
                    let mut w = MetaReply::begin(out, b"EN");
                    echo_flags(&mut w, cmd);
                    w.finish(None);
                }
                return;
            };
            // A new item: never fetched, no TTL until its N is reached among the flags.
            let before = if created {
                Before { fetched: false, last_access: now, ttl: -1 }
            } else {
                before.unwrap_or(Before::of(&it, now))
            };
            let (stale, token_sent, after_ttl) = (it.stale, it.win && !created, ttl_of(&it, now));
            // R wins when the TTL left, as of R's place among the flags, is under its token.
            let mut ttl = before.ttl;
            let mut won = created || (stale && !token_sent);
            for (fl, _) in f.iter() {
                match fl {
                    b'T' => ttl = after_ttl,
                    b'N' if created => ttl = after_ttl,
                    b'R' if !token_sent && !created && ttl >= 0 => won |= recache.is_some_and(|r| ttl < r),
                    _ => {}
                }
            }
            if won && !created {
                ctx.store.update(at.cachelet, at.hash, key, now, |m| m.win = true);
            }
            let it = ctx.store.peek(at.cachelet, at.hash, key, now).expect("hit above");
            let with_value = f.has(b'v');
            let mut w = MetaReply::begin(out, if with_value { b"VA" } else { b"HD" });
            if with_value {
                w.value_len(it.value.len());
            }
            let mut ttl = before.ttl;
            for (fl, tok) in f.iter() {
                match fl {
                    b'T' => ttl = after_ttl,
                    b'N' if created => ttl = after_ttl,
                    b'c' => w.flag_num(b'c', it.cas),
                    b'f' => w.flag_num(b'f', it.flags as u64),
                    b'h' => w.flag_num(b'h', before.fetched as u64),
                    b'l' => w.flag_num(b'l', now.saturating_sub(before.last_access) as u64),
                    b's' => w.flag_num(b's', it.value.len() as u64),
                    b't' => w.flag_signed(b't', ttl),
                    b'O' => w.flag_bytes(b'O', tok),
                    b'k' => echo_key(&mut w, cmd),
                    _ => {}
                }
            }
            // memcached's order: Z (win already handed out), X (stale), W (you win)
            if token_sent {
                w.flag(b'Z');
            }
            if stale {
                w.flag(b'X');
            }
            if won {
                w.flag(b'W');
            }
            w.finish(with_value.then_some(it.value));
        }
        MetaKind::Set => {
            let (flags, ttl, cas) = match (f.num::<u64>(b'F'), f.num::<i64>(b'T'), f.num::<u64>(b'C')) {
                // memcached keeps the low 32 bits of F.
                (Ok(a), Ok(b), Ok(c)) => (a.unwrap_or(0) as u32, b.unwrap_or(0), c),
                _ => return bad_flag(out),
            };
            let mode = match f.token(b'M') {
                None | Some(b"S") => Mode::Set,
                Some(b"E") => Mode::Add,
                Some(b"A") => Mode::Append,
                Some(b"P") => Mode::Prepend,
                Some(b"R") => Mode::Replace,
                Some(_) => return out.extend_from_slice(b"CLIENT_ERROR invalid mode for ms M token\r\n"),
            };
            let Ok(new_cas) = explicit_cas(f, ctx.cas_enabled) else {
                return bad_flag(out);
            };
            // memcached: add with a CAS works as a plain add.
            let cas = cas.filter(|_| mode != Mode::Add);
            if cas.is_some() && !ctx.cas_enabled {
                MetaReply::begin(out, b"EX").finish(None);
                return;
            }
            // I with an older C stores a stale value (memcached's "set-to-invalid").
            let opts = CasOpts { compare: cas, stale_if_older: f.has(b'I'), new_cas };
            let mut r = ctx.store.store_with(at.cachelet, at.hash, key, cmd.data, flags, ttl, mode, opts, now);
            if matches!(r, StoreResult::NotStored) && f.has(b'N') && matches!(mode, Mode::Append | Mode::Prepend) {
                // Append/prepend with N (newer memcached): vivify the missing item first.
                let ttl = f.num::<i64>(b'N').ok().flatten().unwrap_or(0);
                let opts = CasOpts { new_cas, ..CasOpts::default() };
                r = ctx.store.store_with(at.cachelet, at.hash, key, cmd.data, flags, ttl, Mode::Add, opts, now);
            }
            let (code, cas_out): (&[u8; 2], u64) = match r {
                StoreResult::Stored { cas } => (b"HD", cas),
                StoreResult::NotStored => (b"NS", 0),
                // memcached: append/prepend with a CAS to a missing item is not stored.
                StoreResult::NotFound if matches!(mode, Mode::Append | Mode::Prepend) => (b"NS", 0),
                StoreResult::Exists => (b"EX", 0),
                StoreResult::NotFound => (b"NF", 0),
                StoreResult::TooLarge => return out.extend_from_slice(b"SERVER_ERROR object too large for cache\r\n"),
                StoreResult::OutOfMemory => {
                    return out.extend_from_slice(b"SERVER_ERROR out of memory storing object\r\n")
                }
            };
            if quiet && code == b"HD" {
                return;
            }
            let mut w = MetaReply::begin(out, code);
            for (fl, tok) in f.iter() {
                match fl {
                    b'O' => w.flag_bytes(b'O', tok),
                    b'k' => echo_key(&mut w, cmd),
                    b'c' => w.flag_num(b'c', cas_out), // memcached answers `EX c0`, `NS c0`
                    _ => {}
                }
            }
            w.finish(None);
        }
        MetaKind::Delete => {
            let cas = match f.num::<u64>(b'C') {
                Ok(v) => v,
                Err(()) => return bad_flag(out),
            };
            let Ok(explicit) = explicit_cas(f, ctx.cas_enabled) else {
                return bad_flag(out);
            };
            let code: &[u8; 2] = if f.has(b'I') {
                // Invalidate: keep the item but mark it stale, with a new CAS (E's, if given);
                // the next mg hands out a win token so one client recaches it.
                let ttl = f.num::<i64>(b'T').ok().flatten();
                let start = ctx.settings_start_unix();
                let fresh = match explicit {
                    Some(e) => e,
                    None => ctx.store.new_cas(),
                };
                let mut matched = false;
                let found = ctx.store.update(at.cachelet, at.hash, key, now, |m| {
                    if cas.is_none_or(|c| c == m.cas) {
                        matched = true;
                        (m.stale, m.win, m.cas) = (true, false, fresh);
                        if let Some(t) = ttl {
                            m.exptime = mbal_store::rel_exptime(t, now, start).unwrap_or(now);
                        }
                    }
                });
                match (found, matched) {
                    (false, _) => b"NF",
                    (true, false) => b"EX",
                    (true, true) => b"HD",
                }
            } else {
                match ctx.store.delete(at.cachelet, at.hash, key, cas, now) {
                    DeleteResult::Deleted => b"HD",
                    DeleteResult::NotFound => b"NF",
                    DeleteResult::Exists => b"EX",
                }
            };
            // q hides only HD (memcached still says NF and EX).
            if quiet && code == b"HD" {
                return;
            }
            let mut w = MetaReply::begin(out, code);
            echo_flags(&mut w, cmd);
            w.finish(None);
        }
        MetaKind::Arith => meta_arith(ctx, cmd, key, at, out),
        MetaKind::Debug => match ctx.store.peek(at.cachelet, at.hash, key, now) {
            Some(it) => {
                out.extend_from_slice(b"ME ");
                out.extend_from_slice(cmd.key);
                let line = format!(
                    " exp={} la={} cas={} fetch={} cls=1 size={}\r\n",
                    ttl_of(&it, now),
                    now.saturating_sub(it.last_access),
                    it.cas,
                    if it.fetched_before { "yes" } else { "no" },
                    it.key.len() + it.value.len(),
                );
                out.extend_from_slice(line.as_bytes());
            }
            None => out.extend_from_slice(b"EN\r\n"),
        },
        MetaKind::Noop => out.extend_from_slice(b"MN\r\n"),
    }
}

/// What `mg`'s `h`, `l` and an early `t` report: the item before this request.
#[derive(Clone, Copy)]
struct Before {
    fetched: bool,
    last_access: u32,
    ttl: i64,
}

impl Before {
    fn of(it: &ItemView, now: u32) -> Before {
        Before { fetched: it.fetched_before, last_access: it.last_access, ttl: ttl_of(it, now) }
    }
}

/// `ma`: incr/decr with memcached's flags (`D` delta, `J` initial, `N` vivify, `M` mode,
/// `C` compare CAS, `T` new TTL, `E` explicit CAS; `v`, `c`, `t`, `O`, `k` in the reply).
fn meta_arith(ctx: &mut Ctx, cmd: &MetaCmd, key: &[u8], at: Loc, out: &mut Vec<u8>) {
    let f = &cmd.flags;
    let quiet = f.has(b'q');
    let now = ctx.now;
    let parsed = (f.num::<u64>(b'D'), f.num::<u64>(b'J'), f.num::<i64>(b'N'), f.num::<i64>(b'T'), f.num::<u64>(b'C'));
    let (delta, initial, vivify, ttl, compare) = match parsed {
        (Ok(d), Ok(j), Ok(n), Ok(t), Ok(c)) => (d.unwrap_or(1), j.unwrap_or(0), n, t, c),
        _ => return bad_flag(out),
    };
    let incr = match f.token(b'M') {
        None | Some(b"I" | b"+") => true,
        Some(b"D" | b"-") => false,
        Some(_) => return out.extend_from_slice(b"CLIENT_ERROR invalid mode for ma M token\r\n"),
    };
    let Ok(explicit) = explicit_cas(f, ctx.cas_enabled) else {
        return bad_flag(out);
    };
    let before = ctx.store.peek(at.cachelet, at.hash, key, now).map(|it| (it.cas, ttl_of(&it, now)));
    let mut result = match (compare, before) {
        // C: change the value only if the item's CAS is the one given.
        (Some(c), Some((have, _))) if c != have || !ctx.cas_enabled => None,
        _ => Some(ctx.store.arith(at.cachelet, at.hash, key, incr, delta, now)),
    };
    let mut created = false;
    if matches!(result, Some(ArithResult::NotFound)) {
        if let Some(t) = vivify {
            let mut buf = itoa::Buffer::new();
            let s = buf.format(initial).as_bytes().to_vec();
            match ctx.store.store(at.cachelet, at.hash, key, &s, 0, t, Mode::Add, None, now) {
                StoreResult::Stored { cas } => {
                    result = Some(ArithResult::Value { value: initial, cas });
                    created = true;
                }
                StoreResult::OutOfMemory | StoreResult::TooLarge => {
                    return out.extend_from_slice(b"SERVER_ERROR Out of memory allocating new item\r\n")
                }
                _ => {
                    let mut w = MetaReply::begin(out, b"NS");
                    echo_flags(&mut w, cmd);
                    return w.finish(None);
                }
            }
        }
    }
    let (value, mut cas) = match result {
        None => {
            let mut w = MetaReply::begin(out, b"EX");
            echo_flags(&mut w, cmd);
            return w.finish(None);
        }
        Some(ArithResult::NotFound) => {
            let mut w = MetaReply::begin(out, b"NF");
            echo_flags(&mut w, cmd);
            return w.finish(None);
        }
        Some(ArithResult::NonNumeric) => {
            return out.extend_from_slice(b"CLIENT_ERROR cannot increment or decrement non-numeric value\r\n")
        }
        Some(ArithResult::Value { value, cas }) => (value, cas),
    };
    if let Some(t) = ttl {
        ctx.store.touch(at.cachelet, at.hash, key, t, now);
    }
    if let Some(e) = explicit {
        ctx.store.update(at.cachelet, at.hash, key, now, |m| m.cas = e);
        cas = e;
    }
    // memcached hides a quiet success, but not the reply of an item it just created.
    if quiet && !created {
        return;
    }
    let after_ttl = ctx.store.peek(at.cachelet, at.hash, key, now).map(|it| ttl_of(&it, now)).unwrap_or(-1);
    // `t` shows the TTL as of its place: a created item has none until its N.
    let mut shown_ttl = if created { -1 } else { before.map_or(-1, |(_, t)| t) };
    let mut num = itoa::Buffer::new();
    let num = num.format(value).as_bytes();
    let mut w = MetaReply::begin(out, if f.has(b'v') { b"VA" } else { b"HD" });
    if f.has(b'v') {
        w.value_len(num.len());
    }
    for (fl, tok) in f.iter() {
        match fl {
            b'T' => shown_ttl = after_ttl,
            b'N' if created => shown_ttl = after_ttl,
            b'c' => w.flag_num(b'c', cas),
            b't' => w.flag_signed(b't', shown_ttl),
            b'O' => w.flag_bytes(b'O', tok),
            b'k' => echo_key(&mut w, cmd),
            _ => {}
        }
    }
    w.finish(f.has(b'v').then_some(num));
}

impl Ctx<'_> {
    fn settings_start_unix(&self) -> u64 {
        self.store.config().start_unix
    }
}

/// Meta `E<cas>`: the CAS the client chooses for the item it writes (ignored under `-C`).
fn explicit_cas(f: &MetaFlags, cas_enabled: bool) -> Result<Option<u64>, ()> {
    Ok(f.num::<u64>(b'E')?.filter(|_| cas_enabled))
}

fn bad_flag(out: &mut Vec<u8>) {
    out.extend_from_slice(b"CLIENT_ERROR bad token in command line format\r\n");
}

/// Remaining TTL in seconds, -1 for "never expires" (meta `t` flag).
fn ttl_of(it: &ItemView, now: u32) -> i64 {
    if it.exptime == 0 {
        -1
    } else {
        it.exptime.saturating_sub(now) as i64
    }
}

/// `k<key>`, and ` b` right after it when the key came base64-encoded (memcached's META_KEY).
fn echo_key(w: &mut MetaReply, cmd: &MetaCmd) {
    w.flag_bytes(b'k', cmd.key);
    if cmd.flags.has(b'b') {
        w.flag(b'b');
    }
}

/// The `O` and `k` flags of a reply that carries nothing else (`EN`, `NF`, `EX`, `NS`, md's `HD`).
fn echo_flags(w: &mut MetaReply, cmd: &MetaCmd) {
    for (fl, tok) in cmd.flags.iter() {
        match fl {
            b'O' => w.flag_bytes(b'O', tok),
            b'k' => echo_key(w, cmd),
            _ => {}
        }
    }
}

// -------------------------------------------------------------- binary ----

/// Execute a keyed binary request.
pub fn bin_keyed(ctx: &mut Ctx, req: &BinReq, at: Loc, out: &mut Vec<u8>) {
    let h = &req.header;
    let key = req.key;
    let quiet = req.is_quiet();
    let opc = h.opcode;
    let err = |out: &mut Vec<u8>, status: u16, msg: &[u8]| write_response(out, opc, status, h.opaque, 0, &[], &[], msg);
    match opc {
        op::GET | op::GETQ | op::GETK | op::GETKQ | op::GAT | op::GATQ | op::GATK | op::GATKQ => {
            let touch = matches!(opc, op::GAT | op::GATQ | op::GATK | op::GATKQ);
            let item = if touch {
                let exp = match req.exptime_extra() {
                    Ok(e) => e,
                    Err(e) => return e.write(out),
                };
                ctx.store.touch(at.cachelet, at.hash, key, exp as i64, ctx.now)
            } else {
                ctx.store.get(at.cachelet, at.hash, key, ctx.now)
            };
            let with_key = matches!(opc, op::GETK | op::GETKQ | op::GATK | op::GATKQ);
            let hit = item.is_some();
            match item {
                Some(it) => {
                    let flags = it.flags.to_be_bytes();
                    write_response(
                        out,
                        opc,
                        st::NO_ERROR,
                        h.opaque,
                        it.cas,
                        &flags,
                        if with_key { key } else { &[] },
                        it.value,
                    );
                }
                None => {
                    if !quiet {
                        write_response(
                            out,
                            opc,
                            st::KEY_ENOENT,
                            h.opaque,
                            0,
                            &[],
                            if with_key { key } else { &[] },
                            b"Not found",
                        );
                    }
                }
            }
            ctx.detail(key, crate::counters::PrefixOp::Get { hit });
        }
        o if mbal_proto::binary::is_store(o) => {
            ctx.detail(key, crate::counters::PrefixOp::Set);
            let mode = match opc {
                op::SET | op::SETQ => Mode::Set,
                op::ADD | op::ADDQ => Mode::Add,
                op::REPLACE | op::REPLACEQ => Mode::Replace,
                op::APPEND | op::APPENDQ => Mode::Append,
                _ => Mode::Prepend,
            };
            let extras = match mode {
                Mode::Append | Mode::Prepend => Ok((0, 0)),
                _ => req.store_extras(),
            };
            let (flags, exptime) = match extras {
                Ok(v) => v,
                Err(e) => return e.write(out),
            };
            let cas = (h.cas != 0).then_some(h.cas);
            if cas.is_some() && !ctx.cas_enabled {
                return err(out, st::KEY_EEXISTS, b"Data exists for key.");
            }
            let cas = if matches!(mode, Mode::Add) { None } else { cas };
            match ctx.store.store(at.cachelet, at.hash, key, req.value, flags, exptime as i64, mode, cas, ctx.now) {
                StoreResult::Stored { cas } => {
                    if !quiet {
                        write_response(out, opc, st::NO_ERROR, h.opaque, cas, &[], &[], &[]);
                    }
                }
                StoreResult::NotStored => match mode {
                    Mode::Add => err(out, st::KEY_EEXISTS, b"Data exists for key."),
                    Mode::Replace => err(out, st::KEY_ENOENT, b"Not found"),
                    _ => err(out, st::NOT_STORED, b"Not stored."),
                },
                StoreResult::Exists => err(out, st::KEY_EEXISTS, b"Data exists for key."),
                StoreResult::NotFound => err(out, st::KEY_ENOENT, b"Not found"),
                StoreResult::TooLarge => err(out, st::E2BIG, b"Too large."),
                StoreResult::OutOfMemory => err(out, st::ENOMEM, b"Out of memory"),
            }
        }
        op::DELETE | op::DELETEQ => {
            ctx.detail(key, crate::counters::PrefixOp::Delete);
            let cas = (h.cas != 0).then_some(h.cas);
            match ctx.store.delete(at.cachelet, at.hash, key, cas, ctx.now) {
                DeleteResult::Deleted => {
                    if !quiet {
                        write_response(out, opc, st::NO_ERROR, h.opaque, 0, &[], &[], &[]);
                    }
                }
                DeleteResult::NotFound => err(out, st::KEY_ENOENT, b"Not found"),
                DeleteResult::Exists => err(out, st::KEY_EEXISTS, b"Data exists for key."),
            }
        }
        op::INCREMENT | op::INCREMENTQ | op::DECREMENT | op::DECREMENTQ => {
            let incr = matches!(opc, op::INCREMENT | op::INCREMENTQ);
            let (delta, initial, exptime) = match req.arith_extras() {
                Ok(v) => v,
                Err(e) => return e.write(out),
            };
            let now = ctx.now;
            let mut r = ctx.store.arith(at.cachelet, at.hash, key, incr, delta, now);
            if matches!(r, ArithResult::NotFound) && exptime != u32::MAX {
                let mut buf = itoa::Buffer::new();
                let s = buf.format(initial).as_bytes().to_vec();
                if let StoreResult::Stored { cas } =
                    ctx.store.store(at.cachelet, at.hash, key, &s, 0, exptime as i64, Mode::Add, None, now)
                {
                    r = ArithResult::Value { value: initial, cas };
                }
            }
            match r {
                ArithResult::Value { value, cas } => {
                    if !quiet {
                        write_response(out, opc, st::NO_ERROR, h.opaque, cas, &[], &[], &value.to_be_bytes());
                    }
                }
                ArithResult::NotFound => err(out, st::KEY_ENOENT, b"Not found"),
                ArithResult::NonNumeric => {
                    err(out, st::DELTA_BADVAL, b"Non-numeric server-side value for incr or decr")
                }
            }
        }
        op::TOUCH => {
            let exp = match req.exptime_extra() {
                Ok(e) => e,
                Err(e) => return e.write(out),
            };
            match ctx.store.touch(at.cachelet, at.hash, key, exp as i64, ctx.now) {
                Some(it) => {
                    let cas = it.cas;
                    write_response(out, opc, st::NO_ERROR, h.opaque, cas, &[], &[], &[]);
                }
                None => err(out, st::KEY_ENOENT, b"Not found"),
            }
        }
        _ => err(out, st::UNKNOWN_COMMAND, b"Unknown command"),
    }
}

/// Execution alone, with no socket, no thread and no `Shared`: a store that
/// owns every cachelet of a small key space, requests parsed by `mbal-proto`
/// and run through this module's entry points, and the reply bytes checked.
#[cfg(test)]
mod tests {
    use super::*;
    use mbal_proto::{Limits, Parsed, Protocol, Request};
    use mbal_store::{Cachelet, GlobalPool, StoreConfig};

    struct Worker {
        store: WorkerStore,
        layout: KeySpace,
        cas_enabled: bool,
        counters: Counters,
        now: u32,
    }

    fn worker(cas_enabled: bool) -> Worker {
        let layout = KeySpace::even(8, 64);
        let cfg = StoreConfig { mem_limit: 8 << 20, cas_enabled, ..StoreConfig::default() };
        let mut store = WorkerStore::new(GlobalPool::new(8 << 20, cfg.page_size), cfg, layout.cachelet_count());
        for c in 0..layout.cachelet_count() {
            store.insert_cachelet(Cachelet::new(c));
        }
        Worker { store, layout, cas_enabled, counters: Counters::default(), now: 0 }
    }

    impl Worker {
        /// Run one request (text, meta or binary bytes) and return its reply.
        fn run(&mut self, proto: Protocol, bytes: &[u8]) -> Vec<u8> {
            let Parsed::Req { req, .. } = mbal_proto::parse(proto, bytes, &Limits::default()) else {
                panic!("not a whole request: {:?}", String::from_utf8_lossy(bytes))
            };
            let layout = self.layout.clone();
            let mut ctx = Ctx {
                store: &mut self.store,
                layout: &self.layout,
                cas_enabled: self.cas_enabled,
                counters: &mut self.counters,
                now: self.now,
                detail: Some(b':'),
            };
            let mut out = Vec::new();
            match req {
                Request::Text(TextCmd::Get { keys, cas, touch, .. }) => {
                    for k in keys.iter() {
                        text_get_one(&mut ctx, k, locate(&layout, k), cas, touch, &mut out);
                    }
                    out.extend_from_slice(b"END\r\n");
                }
                Request::Text(cmd) => {
                    let key = match cmd {
                        TextCmd::Store { key, .. }
                        | TextCmd::Delete { key, .. }
                        | TextCmd::Arith { key, .. }
                        | TextCmd::Touch { key, .. } => key,
                        other => panic!("not a keyed command: {other:?}"),
                    };
                    text_keyed(&mut ctx, &cmd, locate(&layout, key), &mut out);
                }
                Request::Meta(cmd) => meta_keyed(&mut ctx, &cmd, cmd.key, locate(&layout, cmd.key), &mut out),
                Request::Bin(b) => bin_keyed(&mut ctx, &b, locate(&layout, b.key), &mut out),
            }
            out
        }

        fn text(&mut self, line: &str) -> String {
            String::from_utf8(self.run(Protocol::Text, line.as_bytes())).unwrap()
        }
    }

    #[test]
    fn text_commands_run_against_the_store() {
        let mut w = worker(true);
        assert_eq!(w.text("set a:1 5 0 2\r\nhi\r\n"), "STORED\r\n");
        assert_eq!(w.text("get a:1\r\n"), "VALUE a:1 5 2\r\nhi\r\nEND\r\n");
        assert_eq!(w.text("add a:1 0 0 1\r\nx\r\n"), "NOT_STORED\r\n");
        assert_eq!(w.text("append a:1 0 0 1\r\n!\r\n"), "STORED\r\n");
        assert_eq!(w.text("get a:1 nope\r\n"), "VALUE a:1 5 3\r\nhi!\r\nEND\r\n");
        assert_eq!(w.text("set n 0 0 2\r\n41\r\n"), "STORED\r\n");
        assert_eq!(w.text("incr n 1\r\n"), "42\r\n");
        assert_eq!(w.text("decr n 50\r\n"), "0\r\n");
        assert_eq!(w.text("incr a:1 1\r\n"), "CLIENT_ERROR cannot increment or decrement non-numeric value\r\n");
        assert_eq!(w.text("delete a:1\r\n"), "DELETED\r\n");
        assert_eq!(w.text("delete a:1\r\n"), "NOT_FOUND\r\n");
        assert_eq!(w.text("set q 0 0 1 noreply\r\nq\r\n"), "", "noreply: nothing");
        // The counters this worker keeps: its prefixes under `stats detail`.
        struct Lines(String);
        impl crate::counters::StatSink for Lines {
            fn stat(&mut self, _: &str, _: &dyn std::fmt::Display) {}
            fn line(&mut self, line: &str) {
                self.0.push_str(line);
                self.0.push('\n');
            }
        }
        let mut lines = Lines(String::new());
        w.counters.prefixes.dump(&mut lines);
        let dump = lines.0;
        assert!(dump.contains("PREFIX a get 2 hit 2 set 3 del 2"), "{dump}");
    }

    #[test]
    fn cas_and_expiry_follow_memcached() {
        let mut w = worker(true);
        w.text("set k 0 10 1\r\nv\r\n");
        let gets = w.text("gets k\r\n");
        let cas: u64 = gets.split_whitespace().nth(4).unwrap().parse().unwrap();
        assert_eq!(w.text(&format!("cas k 0 0 1 {}\r\nw\r\n", cas + 1)), "EXISTS\r\n");
        assert_eq!(w.text(&format!("cas k 0 0 1 {cas}\r\nw\r\n")), "STORED\r\n");
        assert_eq!(w.text("cas nope 0 0 1 1\r\nw\r\n"), "NOT_FOUND\r\n");
        w.text("set t 0 10 1\r\nv\r\n");
        w.now = 10;
        assert_eq!(w.text("get t\r\n"), "END\r\n", "expired at 10 s");
        assert_eq!(w.text("touch k 5\r\n"), "TOUCHED\r\n");
        // -C: every cas fails as if the item changed.
        let mut c = worker(false);
        c.text("set k 0 0 1\r\nv\r\n");
        assert_eq!(c.text("cas k 0 0 1 1\r\nw\r\n"), "EXISTS\r\n");
    }

    #[test]
    fn meta_and_binary_requests_run_against_the_same_store() {
        let mut w = worker(true);
        assert_eq!(w.text("ms mk 2 F7\r\nhi\r\n"), "HD\r\n");
        assert_eq!(w.text("mg mk v f\r\n"), "VA 2 f7\r\nhi\r\n");
        assert_eq!(w.text("mg missing v\r\n"), "EN\r\n");
        assert_eq!(w.text("md mk q\r\n"), "", "quiet success");
        assert_eq!(w.text("mg mk v\r\n"), "EN\r\n");
        // A binary SET, then the text GET sees it.
        let mut set = Vec::new();
        mbal_proto::binary::write_request(&mut set, op::SET, 0, 0, 0, &[0, 0, 0, 9, 0, 0, 0, 0], b"bk", b"bv");
        let reply = w.run(Protocol::Binary, &set);
        assert_eq!(reply[0], mbal_proto::binary::MAGIC_RESPONSE);
        assert_eq!(u16::from_be_bytes([reply[6], reply[7]]), st::NO_ERROR);
        assert_eq!(w.text("get bk\r\n"), "VALUE bk 9 2\r\nbv\r\nEND\r\n");
    }
}
