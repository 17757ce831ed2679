//! memcached's `watch` log streaming on the workers (docs/protocol.md "watch"): a watching
//! connection is announced to every worker (`CtlCmd::Watch`); each worker's store writes the
//! lines of the events some watcher wants (`mbal_store::log`), and once a round the worker
//! stamps them (`ts=`, `gid=`) and sends each watcher the lines of its categories
//! (`CtlCmd::WatchLog`, or straight to its own connections). A watcher that does not read
//! loses lines past a bound, never holding more than that.

use super::*;
use crate::msg::CtlCmd;

/// Unsent output past which a watcher's new lines are dropped.
const WATCH_BACKLOG: usize = 4 << 20;

/// A watching connection of the server: its worker, slot, generation and categories.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Watcher {
    worker: usize,
    conn: usize,
    gen: u64,
    mask: u8,
}

impl Worker {
    /// Tell every worker (this one at once) that connection `ci` watches `mask` (`None`:
    /// no longer). A new watcher is answered `OK` once every other worker said it logs for
    /// it (`CtlCmd::WatchAck`), as memcached registers a watcher before its `OK`.
    pub(super) fn announce_watch(&mut self, ci: usize, gen: u64, mask: Option<u8>) {
        if mask.is_some() {
            if let Some(c) = self.conns.get_mut(ci) {
                c.watch_pending = self.outbox.len() - 1;
            }
            if self.outbox.len() == 1 {
                self.watch_acked_by_all(ci);
            }
        }
        for w in 0..self.outbox.len() {
            if w != self.id {
                let msg = CtlCmd::Watch { worker: self.id, conn: ci, gen, mask };
                self.outbox[w].push(Envelope::Ctl(msg));
            }
        }
        self.set_watcher(self.id, ci, gen, mask);
    }

    pub(super) fn set_watcher(&mut self, worker: usize, conn: usize, gen: u64, mask: Option<u8>) {
        self.watchers.retain(|w| (w.worker, w.conn, w.gen) != (worker, conn, gen));
        if let Some(mask) = mask {
            self.watchers.push(Watcher { worker, conn, gen, mask });
        }
        let all = self.watchers.iter().fold(0, |m, w| m | w.mask);
        self.shard.store.log().set_mask(all);
    }

    /// Send each watcher this round's lines of its categories.
    pub(super) fn ship_log(&mut self) {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        let mut lines: Vec<(u8, Vec<u8>)> = Vec::new();
        self.shard.store.log().take(|cat, line| lines.push((cat, line.to_vec())));
        if lines.is_empty() || self.watchers.is_empty() {
            return;
        }
        let first = self.shared.log_gid.fetch_add(lines.len() as u64, Ordering::Relaxed) + 1;
        let stamped: Vec<(u8, Vec<u8>)> = lines
            .into_iter()
            .enumerate()
            .map(|(i, (cat, line))| {
                let mut b = Vec::with_capacity(line.len() + 40);
                let _ = write!(b, "ts={}.{:06} gid={} ", now.as_secs(), now.subsec_micros(), first + i as u64);
                b.extend_from_slice(&line);
                (cat, b)
            })
            .collect();
        for w in self.watchers.clone() {
            let bytes: Vec<u8> =
                stamped.iter().filter(|(cat, _)| w.mask & cat != 0).flat_map(|(_, l)| l.iter().copied()).collect();
            if bytes.is_empty() {
                continue;
            }
            if w.worker == self.id {
                self.deliver_log(w.conn, w.gen, &bytes);
            } else {
                self.outbox[w.worker].push(Envelope::Ctl(CtlCmd::WatchLog { conn: w.conn, gen: w.gen, bytes }));
            }
        }
    }

    /// Another worker logs for watching connection `ci` (generation `gen`) of this one.
    pub(super) fn watch_acked(&mut self, ci: usize, gen: u64) {
        let Some(c) = self.conns.get_mut(ci) else { return };
        if c.gen != gen || c.watching.is_none() || c.watch_pending == 0 {
            return;
        }
        c.watch_pending -= 1;
        if c.watch_pending == 0 {
            self.watch_acked_by_all(ci);
        }
    }

    fn watch_acked_by_all(&mut self, ci: usize) {
        if let Some(c) = self.conns.get_mut(ci) {
            c.output.buf().extend_from_slice(mbal_proto::text::OK);
            self.flush(ci);
        }
    }

    /// Log lines for watching connection `ci` of this worker (none before its `OK`).
    pub(super) fn deliver_log(&mut self, ci: usize, gen: u64, bytes: &[u8]) {
        let Some(c) = self.conns.get_mut(ci) else { return };
        if c.gen != gen || c.watching.is_none() || c.watch_pending > 0 || c.output.unsent() > WATCH_BACKLOG {
            return;
        }
        c.output.buf().extend_from_slice(bytes);
        self.flush(ci);
    }
}
