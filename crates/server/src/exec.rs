//! The one place that executes a request against a worker's cachelets.
//!
//! Routing (which worker owns a key) happens before this, in `worker.rs`;
//! parsing happens in `mbal-proto`. Every function here runs on the worker
//! that owns the key's cachelet, touches only that worker's `WorkerStore` and
//! counters, and appends the reply bytes to `out`.

use crate::config::Settings;
use crate::stats::Counters;
use mbal_cluster::KeySpace;
use mbal_proto::binary::{opcode as op, status as st, write_response, BinReq};
use mbal_proto::meta::{MetaCmd, MetaFlags, MetaKind, MetaReply};
use mbal_proto::text::{self, StoreMode, TextCmd};
use mbal_store::{ArithResult, CasOpts, DeleteResult, ItemView, Mode, StoreResult, WorkerStore};

/// What a worker needs to execute a request.
pub(crate) struct Ctx<'a> {
    pub store: &'a mut WorkerStore,
    pub layout: &'a KeySpace,
    pub settings: &'a Settings,
    pub counters: &'a mut Counters,
    /// Seconds since process start (the coarse clock).
    pub now: u32,
}

/// A key located in the key space: its hash (computed once) and cachelet.
#[derive(Clone, Copy)]
pub(crate) struct Loc {
    pub hash: u64,
    pub cachelet: u32,
}

pub(crate) fn locate(layout: &KeySpace, key: &[u8]) -> Loc {
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
pub(crate) fn text_get_one(ctx: &mut Ctx, key: &[u8], at: Loc, cas: bool, touch: Option<i64>, out: &mut Vec<u8>) {
    let item = match touch {
        Some(exp) => ctx.store.touch(at.cachelet, at.hash, key, exp, ctx.now),
        None => ctx.store.get(at.cachelet, at.hash, key, ctx.now),
    };
    if let Some(it) = item {
        text::write_value(out, key, it.flags, it.value, cas.then_some(it.cas));
    }
}

/// A single-key text command (everything but get, which is per key above,
/// and the keyless commands, which the worker handles).
pub(crate) fn text_keyed(ctx: &mut Ctx, cmd: &TextCmd, at: Loc, out: &mut Vec<u8>) {
    match *cmd {
        TextCmd::Store { mode, key, flags, exptime, data, cas_unique, noreply } => {
            let cas = (mode == StoreMode::Cas).then_some(cas_unique);
            if cas.is_some() && !ctx.settings.cas_enabled {
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
            // memcached sends SERVER_ERRORs even with noreply.
            if !noreply || line.starts_with(b"SERVER_ERROR") {
                out.extend_from_slice(line);
            }
        }
        TextCmd::Delete { key, noreply } => {
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
pub(crate) fn meta_keyed(ctx: &mut Ctx, cmd: &MetaCmd, key: &[u8], at: Loc, out: &mut Vec<u8>) {
    ctx.counters.cmd_meta += 1;
    let f = &cmd.flags;
    let quiet = f.has(b'q');
    match cmd.kind {
        MetaKind::Get => {
            let ttl_update = match f.num::<i64>(b'T') {
                Ok(v) => v,
                Err(()) => return bad_flag(out),
            };
            let vivify = match f.num::<i64>(b'N') {
                Ok(v) => v,
                Err(()) => return bad_flag(out),
            };
            let recache = match f.num::<u32>(b'R') {
                Ok(v) => v,
                Err(()) => return bad_flag(out),
            };
            let Ok(explicit) = explicit_cas(f, ctx.settings) else {
                return bad_flag(out);
            };
            if let Some(exp) = ttl_update {
                ctx.store.touch(at.cachelet, at.hash, key, exp, ctx.now);
            }
            let now = ctx.now;
            let hit = ctx.store.get(at.cachelet, at.hash, key, now).is_some();
            if !hit {
                if let Some(ttl) = vivify {
                    // Vivify: create an empty placeholder and hand this
                    // client the win token; others see Z until it is set.
                    ctx.store.store(at.cachelet, at.hash, key, b"", 0, ttl, Mode::Add, None, now);
                    ctx.store.update(at.cachelet, at.hash, key, now, |m| {
                        m.win = true;
                        if let Some(e) = explicit {
                            m.cas = e; // E: the vivified item's CAS
                        }
                    });
                    if let Some(it) = ctx.store.peek(at.cachelet, at.hash, key, now) {
                        write_mg_hit(out, cmd, key, &it, now, Some(b'W'));
                        return;
                    }
                }
                if !quiet {
                    MetaReply::begin(out, b"EN").finish(None);
                }
                return;
            }
            // Win-token logic: a stale item, or one about to expire (R), gives
            // the win to the first client to see it; later ones see Z.
            let (stale, win, exptime) = {
                let it = ctx.store.peek(at.cachelet, at.hash, key, now).expect("hit above");
                (it.stale, it.win, it.exptime)
            };
            let ttl_left = if exptime == 0 { None } else { Some(exptime.saturating_sub(now)) };
            let wants_win = stale || matches!((recache, ttl_left), (Some(r), Some(left)) if left < r);
            let token = if win {
                Some(b'Z')
            } else if wants_win {
                ctx.store.update(at.cachelet, at.hash, key, now, |m| m.win = true);
                Some(b'W')
            } else {
                None
            };
            let it = ctx.store.peek(at.cachelet, at.hash, key, now).expect("hit above");
            write_mg_hit(out, cmd, key, &it, now, token);
        }
        MetaKind::Set => {
            let (flags, ttl, cas) = match (f.num::<u32>(b'F'), f.num::<i64>(b'T'), f.num::<u64>(b'C')) {
                (Ok(a), Ok(b), Ok(c)) => (a.unwrap_or(0), b.unwrap_or(0), c),
                _ => return bad_flag(out),
            };
            let mode = match f.token(b'M') {
                None => Mode::Set,
                Some(m) => match m.first().map(|c| c.to_ascii_uppercase()) {
                    Some(b'S') => Mode::Set,
                    Some(b'E') => Mode::Add,
                    Some(b'A') => Mode::Append,
                    Some(b'P') => Mode::Prepend,
                    Some(b'R') => Mode::Replace,
                    _ => return out.extend_from_slice(b"CLIENT_ERROR invalid mode for ms\r\n"),
                },
            };
            let Ok(new_cas) = explicit_cas(f, ctx.settings) else {
                return bad_flag(out);
            };
            if cas.is_some() && !ctx.settings.cas_enabled {
                MetaReply::begin(out, b"EX").finish(None);
                return;
            }
            // I with an older C stores a stale value (memcached's "set-to-invalid").
            let opts = CasOpts { compare: cas, stale_if_older: f.has(b'I'), new_cas };
            let mut r = ctx.store.store_with(at.cachelet, at.hash, key, cmd.data, flags, ttl, mode, opts, ctx.now);
            if matches!(r, StoreResult::NotStored) && f.has(b'N') && matches!(mode, Mode::Append | Mode::Prepend) {
                // Append/prepend with N: vivify the missing item first.
                let ttl = f.num::<i64>(b'N').ok().flatten().unwrap_or(0);
                let opts = CasOpts { new_cas, ..CasOpts::default() };
                r = ctx.store.store_with(at.cachelet, at.hash, key, cmd.data, flags, ttl, Mode::Add, opts, ctx.now);
            }
            let (code, cas_out): (&[u8; 2], u64) = match r {
                StoreResult::Stored { cas } => (b"HD", cas),
                StoreResult::NotStored => (b"NS", 0),
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
                    b'k' => w.flag_bytes(b'k', cmd.key),
                    b'b' if f.has(b'k') => w.flag(b'b'),
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
            let Ok(explicit) = explicit_cas(f, ctx.settings) else {
                return bad_flag(out);
            };
            let code: &[u8; 2] = if f.has(b'I') {
                // Invalidate: keep the item but mark it stale, with a new CAS (E's, if given);
                // the next mg hands out a win token so one client recaches it.
                let ttl = f.num::<i64>(b'T').ok().flatten();
                let start = ctx.settings_start_unix();
                let now = ctx.now;
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
                match ctx.store.delete(at.cachelet, at.hash, key, cas, ctx.now) {
                    DeleteResult::Deleted => b"HD",
                    DeleteResult::NotFound => b"NF",
                    DeleteResult::Exists => b"EX",
                }
            };
            if quiet && (code == b"HD" || code == b"NF") {
                return;
            }
            let mut w = MetaReply::begin(out, code);
            echo_flags(&mut w, cmd);
            w.finish(None);
        }
        MetaKind::Arith => {
            let parsed = (f.num::<u64>(b'D'), f.num::<u64>(b'J'), f.num::<i64>(b'N'), f.num::<i64>(b'T'));
            let (delta, initial, vivify, ttl) = match parsed {
                (Ok(d), Ok(j), Ok(n), Ok(t)) => (d.unwrap_or(1), j.unwrap_or(0), n, t),
                _ => return bad_flag(out),
            };
            let incr = match f.token(b'M').and_then(|m| m.first().copied()) {
                None | Some(b'I' | b'i' | b'+') => true,
                Some(b'D' | b'd' | b'-') => false,
                Some(_) => return out.extend_from_slice(b"CLIENT_ERROR invalid mode for ma\r\n"),
            };
            let Ok(explicit) = explicit_cas(f, ctx.settings) else {
                return bad_flag(out);
            };
            let now = ctx.now;
            let mut result = ctx.store.arith(at.cachelet, at.hash, key, incr, delta, now);
            if matches!(result, ArithResult::NotFound) {
                if let Some(t) = vivify {
                    let mut buf = itoa::Buffer::new();
                    let s = buf.format(initial).as_bytes().to_vec();
                    if let StoreResult::Stored { cas } =
                        ctx.store.store(at.cachelet, at.hash, key, &s, 0, t, Mode::Add, None, now)
                    {
                        result = ArithResult::Value { value: initial, cas };
                    }
                }
            }
            match result {
                ArithResult::Value { value, mut cas } => {
                    if let Some(t) = ttl {
                        ctx.store.touch(at.cachelet, at.hash, key, t, now);
                    }
                    if let Some(e) = explicit {
                        ctx.store.update(at.cachelet, at.hash, key, now, |m| m.cas = e);
                        cas = e;
                    }
                    if quiet && !f.has(b'v') {
                        return;
                    }
                    let mut num = itoa::Buffer::new();
                    let num = num.format(value).as_bytes();
                    let mut w = MetaReply::begin(out, if f.has(b'v') { b"VA" } else { b"HD" });
                    if f.has(b'v') {
                        w.value_len(num.len());
                    }
                    for (fl, tok) in f.iter() {
                        match fl {
                            b'c' => w.flag_num(b'c', cas),
                            b't' => {
                                let left = ctx
                                    .store
                                    .peek(at.cachelet, at.hash, key, now)
                                    .map(|it| ttl_of(&it, now))
                                    .unwrap_or(-1);
                                w.flag_signed(b't', left)
                            }
                            b'O' => w.flag_bytes(b'O', tok),
                            b'k' => w.flag_bytes(b'k', cmd.key),
                            b'b' if f.has(b'k') => w.flag(b'b'),
                            _ => {}
                        }
                    }
                    w.finish(f.has(b'v').then_some(num));
                }
                ArithResult::NotFound => {
                    if !quiet {
                        let mut w = MetaReply::begin(out, b"NF");
                        echo_flags(&mut w, cmd);
                        w.finish(None);
                    }
                }
                ArithResult::NonNumeric => {
                    out.extend_from_slice(b"CLIENT_ERROR cannot increment or decrement non-numeric value\r\n");
                }
            }
        }
        MetaKind::Debug => match ctx.store.peek(at.cachelet, at.hash, key, ctx.now) {
            Some(it) => {
                out.extend_from_slice(b"ME ");
                out.extend_from_slice(cmd.key);
                let line = format!(
                    " exp={} la={} cas={} fetch={} cls=1 size={}\r\n",
                    ttl_of(&it, ctx.now),
                    ctx.now.saturating_sub(it.last_access),
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

impl Ctx<'_> {
    fn settings_start_unix(&self) -> u64 {
        self.store.config().start_unix
    }
}

/// Meta `E<cas>`: the CAS the client chooses for the item it writes (ignored under `-C`).
fn explicit_cas(f: &MetaFlags, settings: &Settings) -> Result<Option<u64>, ()> {
    Ok(f.num::<u64>(b'E')?.filter(|_| settings.cas_enabled))
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

fn echo_flags(w: &mut MetaReply, cmd: &MetaCmd) {
    for (fl, tok) in cmd.flags.iter() {
        match fl {
            b'O' => w.flag_bytes(b'O', tok),
            b'k' => w.flag_bytes(b'k', cmd.key),
            b'b' if cmd.flags.has(b'k') => w.flag(b'b'),
            _ => {}
        }
    }
}

fn write_mg_hit(out: &mut Vec<u8>, cmd: &MetaCmd, _key: &[u8], it: &ItemView, now: u32, token: Option<u8>) {
    let f = &cmd.flags;
    let with_value = f.has(b'v');
    let mut w = MetaReply::begin(out, if with_value { b"VA" } else { b"HD" });
    if with_value {
        w.value_len(it.value.len());
    }
    for (fl, tok) in f.iter() {
        match fl {
            b'c' => w.flag_num(b'c', it.cas),
            b'f' => w.flag_num(b'f', it.flags as u64),
            b'h' => w.flag_num(b'h', it.fetched_before as u64),
            b'l' => w.flag_num(b'l', now.saturating_sub(it.last_access) as u64),
            b's' => w.flag_num(b's', it.value.len() as u64),
            b't' => w.flag_signed(b't', ttl_of(it, now)),
            b'O' => w.flag_bytes(b'O', tok),
            b'k' => w.flag_bytes(b'k', cmd.key),
            b'b' if f.has(b'k') => w.flag(b'b'),
            _ => {}
        }
    }
    // memcached's order: Z (win already handed out), X (stale), W (you win)
    if token == Some(b'Z') {
        w.flag(b'Z');
    }
    if it.stale {
        w.flag(b'X');
    }
    if token == Some(b'W') {
        w.flag(b'W');
    }
    w.finish(with_value.then_some(it.value));
}

// -------------------------------------------------------------- binary ----

/// Execute a keyed binary request.
pub(crate) fn bin_keyed(ctx: &mut Ctx, req: &BinReq, at: Loc, out: &mut Vec<u8>) {
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
        }
        o if mbal_proto::binary::is_store(o) => {
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
            if cas.is_some() && !ctx.settings.cas_enabled {
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
