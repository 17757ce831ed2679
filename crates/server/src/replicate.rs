//! The replicator: the thread that carries Phase 1's copies to the shadow
//! workers of other servers (DESIGN.md §6). Workers and the controller hand
//! it jobs (make or update a copy, delete one, extend its life) on one FIFO
//! channel; it keeps one connection per shadow worker (opened with `mbal
//! hello <epoch> <worker>`, so the copy lands on that worker's table with no
//! hop), writes every job of a round back to back, reads the answers, and
//! reports how each job ended:
//!
//! * to the controller, for a new key's copies and the renewals
//!   (`CtlMsg::HotDone`): the policy's HOT_PENDING → HOT, the leases;
//! * to the home worker, for a write's copies (`HotCmd::Written`): its lease
//!   is withheld until they are done; in sync mode the write's reply itself
//!   waits here, and is sent once every copy holds the write, or, if a copy
//!   could not be reached, once the copies' time to live has run out (no
//!   reader can then see the old value).
//!
//! Jobs for one shadow worker travel one connection in channel order, so a
//! key's copies see its writes in the order the home made them. Blocking
//! I/O with timeouts keeps this simple; it is off every worker's path.

use crate::msg::replica::{Done, Job, Loc, Op};
use crate::msg::CtlCmd;
use crate::msg::CtlMsg;
use crate::msg::{Envelope, ReplyBatch, ReplyTo};
use crate::shared::Shared;
use crossbeam_channel::{Receiver, RecvTimeoutError};
use mbal_member::call::MemberConn;
use mbal_proto::client::Reply;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) struct Replicator {
    shared: Arc<Shared>,
    jobs: Receiver<Job>,
    /// A connection to each shadow worker (plain or TLS).
    peers: HashMap<Loc, MemberConn>,
    /// Shadow servers that could not be reached, and until when not to try.
    down: HashMap<u16, Instant>,
    timeout: Duration,
    /// Sync-mode replies held until the copies' time to live has passed.
    deferred: Vec<(Instant, ReplyTo, u32, Vec<u8>)>,
}

const BATCH: usize = 512;

impl Replicator {
    pub(crate) fn new(shared: Arc<Shared>, jobs: Receiver<Job>) -> Replicator {
        let timeout = Duration::from_millis(shared.settings.hot.timeout_ms.max(1));
        Replicator { shared, jobs, peers: HashMap::new(), down: HashMap::new(), timeout, deferred: Vec::new() }
    }

    pub(crate) fn run(mut self) {
        // Until the stop's drain is over: a drained write may wait for its copies.
        while !self.shared.stopped() {
            let wait = self
                .deferred
                .iter()
                .map(|d| d.0.saturating_duration_since(Instant::now()))
                .min()
                .unwrap_or(Duration::from_millis(200))
                .min(Duration::from_millis(200));
            let first = match self.jobs.recv_timeout(wait) {
                Ok(j) => Some(j),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return,
            };
            if let Some(first) = first {
                let mut batch = vec![first];
                while batch.len() < BATCH {
                    match self.jobs.try_recv() {
                        Ok(j) => batch.push(j),
                        Err(_) => break,
                    }
                }
                self.round(batch);
            }
            self.release_deferred();
        }
    }

    /// Send every job's commands, read the answers, report.
    fn round(&mut self, batch: Vec<Job>) {
        // Commands per shadow worker, in job order, with the job each answers.
        let mut out: HashMap<Loc, (Vec<u8>, Vec<usize>)> = HashMap::new();
        let mut ok = vec![true; batch.len()];
        // Reads the copies served since their last renewal (renewals only).
        let mut reads = vec![0u64; batch.len()];
        for (i, job) in batch.iter().enumerate() {
            for &loc in &job.to {
                let (buf, who) = out.entry(loc).or_default();
                command(buf, &job.key, &job.op);
                who.push(i);
            }
        }
        let mut locs: Vec<Loc> = out.keys().copied().collect();
        locs.sort_unstable();
        for loc in locs {
            let (buf, who) = out.remove(&loc).expect("listed");
            if !self.exchange(loc, &buf, &who, &batch, &mut ok, &mut reads) {
                self.peers.remove(&loc);
                for &i in &who {
                    ok[i] = false;
                }
            }
        }
        for ((job, ok), reads) in batch.into_iter().zip(ok).zip(reads) {
            self.report(job, ok, reads);
        }
    }

    /// Write `buf` to the shadow worker at `loc` and read one answer per
    /// entry of `who` (a renewal's `OK <reads>` adds to `reads`); false on an I/O error or
    /// timeout.
    fn exchange(
        &mut self,
        loc: Loc,
        buf: &[u8],
        who: &[usize],
        batch: &[Job],
        ok: &mut [bool],
        reads: &mut [u64],
    ) -> bool {
        let Some(peer) = self.peer(loc) else { return false };
        if peer.send(buf).is_err() {
            return false;
        }
        for &i in who {
            let Ok(answer) = peer.reply() else { return false };
            let good = match (&batch[i].op, &answer) {
                (Op::Put { .. }, Reply::Stored) => true,
                // A copy already gone is as good as deleted.
                (Op::Del, Reply::Deleted | Reply::NotFound) => true,
                // `OK <reads>`: the reads the copy served since it was made or last renewed.
                (Op::Renew { .. }, Reply::OkCount(n)) => {
                    reads[i] += n;
                    true
                }
                (Op::Renew { .. }, Reply::Ok) => true,
                _ => false,
            };
            if !good {
                tracing::debug!(?loc, ?answer, "replica command refused");
                ok[i] = false;
            }
        }
        true
    }

    /// The connection to a shadow worker, opened on first use.
    fn peer(&mut self, loc: Loc) -> Option<&mut MemberConn> {
        if !self.peers.contains_key(&loc) {
            if self.down.get(&loc.0).is_some_and(|t| Instant::now() < *t) {
                return None;
            }
            match self.connect(loc) {
                Ok(p) => {
                    self.down.remove(&loc.0);
                    self.peers.insert(loc, p);
                }
                Err(e) => {
                    tracing::debug!(server = loc.0, worker = loc.1, "shadow unreachable: {e}");
                    // Do not retry for a while: every job for it fails fast.
                    self.down.insert(loc.0, Instant::now() + self.timeout * 4);
                    return None;
                }
            }
        }
        self.peers.get_mut(&loc)
    }

    fn connect(&self, (server, worker): Loc) -> std::io::Result<MemberConn> {
        let addr = self.shared.member_addr(server).ok_or_else(|| std::io::Error::other("no such server"))?;
        // TLS when the cluster uses it; copies are control commands: the
        // dialer proves this is a cluster member (`mbal peer`) when there is
        // a cluster secret.
        let mut p = MemberConn::dial(&self.shared.settings.peer_dialer(self.timeout), addr)?;
        // Copy upkeep is not client load: exempt from emulated capacity
        // (before the hello, which hands the connection to the shadow worker).
        // (A hand-over must come before other unanswered requests: one at a time.)
        match p.call(b"mbal replicator\r\n")? {
            Reply::Ok => {}
            other => return Err(std::io::Error::other(format!("mbal replicator refused: {other:?}"))),
        }
        match p.call(format!("mbal hello 0 {worker}\r\n").as_bytes())? {
            Reply::Hello { server: s, worker: w, .. } if (s, w) == (server, worker) => Ok(p),
            other => Err(std::io::Error::other(format!("unexpected hello answer {other:?}"))),
        }
    }

    fn report(&mut self, job: Job, ok: bool, copy_reads: u64) {
        match job.done {
            Done::Nobody => {}
            Done::Controller { created, at_ns } => {
                self.shared.tell_controller(CtlMsg::HotDone { key: job.key, created, ok, at_ns, copy_reads });
            }
            Done::Worker { worker, hash, reply } => {
                let now = self.shared.clock_ns();
                let peers = self.shared.peers();
                peers.send_one(worker, Envelope::Ctl(CtlCmd::Hot(crate::msg::HotCmd::Written { hash, ok })), now);
                if let Some((to, cachelet, bytes)) = reply {
                    if ok {
                        send_reply(&self.shared, to, cachelet, &bytes);
                    } else {
                        // A copy may still hold the old value until its
                        // time to live ends: the writer hears back then.
                        let ttl = Duration::from_millis(self.shared.settings.hot.copy_ttl_ms());
                        self.deferred.push((Instant::now() + ttl, to, cachelet, bytes));
                    }
                }
            }
        }
    }

    fn release_deferred(&mut self) {
        let now = Instant::now();
        let (due, wait): (Vec<_>, Vec<_>) = self.deferred.drain(..).partition(|d| d.0 <= now);
        self.deferred = wait;
        for (_, to, cachelet, bytes) in due {
            send_reply(&self.shared, to, cachelet, &bytes);
        }
    }
}

/// A held reply to its connection's worker; `cachelet` is the forwarded
/// request's (its origin counts the answers per cachelet, see `moves`), or
/// `NO_CACHELET` for a request the home worker got itself.
fn send_reply(shared: &Shared, to: ReplyTo, cachelet: u32, bytes: &[u8]) {
    let mut batch = ReplyBatch::default();
    batch.push(to, cachelet, |d| d.extend_from_slice(bytes));
    shared.peers().send_one(to.worker, Envelope::Replies(batch), shared.clock_ns());
}

/// The wire form of one job for one shadow (docs/protocol.md).
fn command(buf: &mut Vec<u8>, key: &[u8], op: &Op) {
    let mut n = itoa::Buffer::new();
    match op {
        Op::Put { flags, exptime, value, ttl_ms } => {
            buf.extend_from_slice(b"mbal rset ");
            buf.extend_from_slice(key);
            for x in [u64::from(*flags), u64::from(*exptime), value.len() as u64, *ttl_ms] {
                buf.push(b' ');
                buf.extend_from_slice(n.format(x).as_bytes());
            }
            buf.extend_from_slice(b"\r\n");
            buf.extend_from_slice(value);
            buf.extend_from_slice(b"\r\n");
        }
        Op::Del => {
            buf.extend_from_slice(b"mbal rdel ");
            buf.extend_from_slice(key);
            buf.extend_from_slice(b"\r\n");
        }
        Op::Renew { ttl_ms } => {
            buf.extend_from_slice(b"mbal rttl ");
            buf.extend_from_slice(key);
            buf.push(b' ');
            buf.extend_from_slice(n.format(*ttl_ms).as_bytes());
            buf.extend_from_slice(b"\r\n");
        }
    }
}
