//! Requests every worker answers or acts on, gathered or fanned out by the one that read them:
//! `stats` (and its groups), `stats reset`, `flush_all`, `lru_crawler metadump`, `stats cachedump`,
//! and `watch`'s categories.

use super::*;

/// `stats reset` on every worker of the server.
pub(super) fn reset_stats(rt: &mut Route, store: &mut WorkerStore) {
    *rt.counters = Counters::default();
    store.reset_stats();
    for (w, ob) in rt.outbox.iter_mut().enumerate() {
        if w != rt.worker {
            ob.push(Envelope::Ctl(CtlCmd::ResetStats));
        }
    }
}

/// flush_all [delay]: every worker invalidates items set at or before
/// `now + delay`; peers get the order through the same FIFO channel as
/// this connection's forwarded requests, so later requests see it.
pub(super) fn flush_all(shared: &Shared, rt: &mut Route, store: &mut WorkerStore, now: u32, delay: i64) {
    rt.counters.cmd_flush += 1;
    let at = if delay <= 0 {
        now
    } else {
        mbal_store::rel_exptime(delay, now, shared.start_unix).filter(|&t| t != 0).unwrap_or(now)
    };
    store.flush_all(at);
    if !rt.replicas.hot.is_empty() {
        crate::worker::flush_hot(shared, rt.worker, store, &mut rt.replicas.hot);
    }
    for (w, ob) in rt.outbox.iter_mut().enumerate() {
        if w != rt.worker {
            ob.push(Envelope::Ctl(CtlCmd::Flush { at }));
        }
    }
}

pub(super) fn gather_stats(shared: &Shared, rt: &mut Route, output: &mut Output, group: String, format: StatsFormat) {
    let want = Want { conns: group == "conns", dump: None };
    gather(shared, rt, output, group, format, want)
}

/// Ask every worker for its snapshot (with what `want` asks for); the connection's output
/// slot renders them as `group` once all have answered (`worker::render_stats`).
fn gather(shared: &Shared, rt: &mut Route, output: &mut Output, group: String, format: StatsFormat, want: Want) {
    let workers = shared.settings.threads;
    let g = Gather { group, format, remaining: workers, snaps: Vec::with_capacity(workers) };
    let seq = output.push(Slot::Gather(Box::new(g)));
    for (w, ob) in rt.outbox.iter_mut().enumerate() {
        if w != rt.worker {
            let to = ReplyTo { worker: rt.worker, conn: rt.conn, gen: rt.gen, seq };
            ob.push(Envelope::Ctl(CtlCmd::StatsReq { to, want }));
        }
    }
    // This worker's own snapshot is taken once the request is routed
    // (`finish_self_stats`), when the worker is no longer borrowed.
    rt.self_stats.push((rt.conn, seq, want));
}

/// `watch [<category> ...]`'s categories (`mbal_store::log`): `fetchers` (the default),
/// `mutations`, `evictions`; memcached's others are accepted and bring nothing (mbal has no
/// such events); an unknown one is memcached's `ERROR` (`None`).
pub(super) fn watch_mask(args: &[u8]) -> Option<u8> {
    use mbal_store::log::{EVICTIONS, FETCHERS, MUTATIONS};
    let mut mask = 0;
    let mut any = false;
    for t in args.split(|&b| b == b' ').filter(|t| !t.is_empty()) {
        any = true;
        mask |= match t {
            b"fetchers" => FETCHERS,
            b"mutations" => MUTATIONS,
            b"evictions" => EVICTIONS,
            b"rawcmds" | b"connevents" | b"proxyreqs" | b"proxyevents" | b"proxyuser" | b"deletions" => 0,
            _ => return None,
        };
    }
    Some(if any { mask } else { FETCHERS })
}

/// The most `lru_crawler metadump` writes, over all workers (memcached streams its crawl;
/// mbal renders each worker's part at once, so it is bounded).
pub(crate) const METADUMP_MAX: usize = 64 << 20;
/// The most `stats cachedump` writes (memcached's bound).
pub(crate) const CACHEDUMP_MAX: usize = 2 << 20;

/// `lru_crawler metadump all|hash|<class>[,<class>...]`: every live item's metadata, one
/// line each (memcached's format, `stats::dump_item`), then `END`. Classes are workers + 1.
pub(super) fn metadump(shared: &Shared, rt: &mut Route, output: &mut Output, args: &[u8]) {
    let args = String::from_utf8_lossy(args);
    let t: Vec<&str> = args.split(' ').filter(|t| !t.is_empty()).collect();
    let ["metadump", classes] = t[..] else {
        output.buf().extend_from_slice(b"ERROR\r\n");
        return;
    };
    let workers = match crate::tune::crawler_classes(classes, true) {
        Ok(None) => None,
        Ok(Some(ids)) => Some(ids.iter().fold(0u64, |m, &id| m | 1 << (id - 1))),
        Err(()) => {
            output.buf().extend_from_slice(crate::tune::BADCLASS);
            return;
        }
    };
    let max_bytes = METADUMP_MAX / shared.settings.threads.max(1);
    let dump = Dump { meta: true, workers, limit: 0, max_bytes };
    gather(shared, rt, output, "dump".into(), StatsFormat::Text, Want { conns: false, dump: Some(dump) });
}

/// `stats cachedump <class> <limit>`: the keys of class (worker + 1) `class`, at most
/// `limit` of them (0: all), within memcached's 2 MiB.
pub(super) fn cachedump(shared: &Shared, rt: &mut Route, output: &mut Output, group: &str) {
    let t: Vec<&str> = group.split(' ').filter(|t| !t.is_empty()).collect();
    if t.len() < 3 {
        output.buf().extend_from_slice(b"CLIENT_ERROR bad command line\r\n");
        return;
    }
    // memcached's safe_strtoul: decimal, truncated to 32 bits.
    let num = |s: &str| s.parse::<u64>().ok().map(|v| v as u32);
    let (Some(class), Some(limit)) = (num(t[1]), num(t[2])) else {
        output.buf().extend_from_slice(b"CLIENT_ERROR bad command line format\r\n");
        return;
    };
    if class >= 64 {
        output.buf().extend_from_slice(b"CLIENT_ERROR Illegal slab id\r\n");
        return;
    }
    let workers = Some(if class == 0 { 0 } else { 1u64 << (class - 1) });
    let dump = Dump { meta: false, workers, limit: limit as usize, max_bytes: CACHEDUMP_MAX };
    gather(shared, rt, output, "dump".into(), StatsFormat::Text, Want { conns: false, dump: Some(dump) });
}
