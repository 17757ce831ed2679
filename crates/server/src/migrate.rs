//! The mover: one thread per cachelet moving from this server to another
//! (docs/design-notes.md, "Cross-server migration"; `mbal migrate`, `mbal cluster move`).
//!
//! 1. The coordinator records the move (`mbal migrate begin`): from now on only this move can
//!    give the cachelet away, and only through its commit.
//! 2. The owning worker starts noting writes in the cachelet; the destination worker gets a
//!    member connection and `mbal import begin` (it checks its free memory and may refuse).
//! 3. The scan: the owner exports batches of items between its other work; they go as
//!    frames (at most the item size limit each) pipelined on the connection, while the
//!    cachelet serves as before.
//! 4. Deltas: the keys written during the scan, with their state now, until few are left;
//!    then the last delta *freezes* the cachelet at the owner (its requests wait there) and
//!    goes as the `final` frame: the destination now holds exactly what the source holds.
//! 5. The commit (`mbal migrate commit`) changes the map at the coordinator, at one epoch;
//!    the destination adopts the cachelet (`mbal import commit`, or the map itself); this
//!    server installs the new map at once (`Report::Committed`): the owner drops the cachelet
//!    and what waited for it goes to the destination (redirects, forwards).
//!
//! Any failure before the commit aborts: the coordinator forgets the move (a commit arriving
//! later is refused), the destination drops what arrived, the owner serves the cachelet
//! again. If the commit's answer is lost, the mover asks again (`mbal migrate abort`, which
//! answers either ABORTED or COMMITTED) while the cachelet stays frozen: it never serves here
//! after a commit, and never stays half-owned.

use crate::beat::Report;
use crate::msg::{Envelope, MigMsg, MigReply, ReplyBatch, ReplyTo, NO_CACHELET};
use crate::shared::Shared;
use crate::worker::EXPORT_BUDGET;
use crossbeam_channel::{bounded, Sender};
use mbal_store::{wire, DeltaItem};
use mbal_tls::BlockingStream;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Frames on the wire before the mover waits for an answer.
const WINDOW: usize = 8;
/// Delta rounds before the last one, at most; fewer when a round finds few keys.
const DELTA_ROUNDS: usize = 8;
/// A delta with at most this many keys is small enough to be the last (the cachelet is
/// frozen while it travels).
const SMALL_DELTA: usize = 256;
/// How long the mover waits for the owning worker or the coordinator.
const STEP_TIMEOUT: Duration = Duration::from_secs(10);

/// A move to carry out.
pub(crate) struct Order {
    pub cachelet: u32,
    /// The worker of this server that owns it.
    pub worker: usize,
    /// Where it goes: server, worker, and that worker's address.
    pub to: (u16, u16),
    pub to_addr: SocketAddr,
    /// Who asked (`mbal migrate`): the answer goes there.
    pub reply: ReplyTo,
}

/// What a move did.
struct Moved {
    items: u64,
    bytes: u64,
}

pub(crate) fn spawn(shared: Arc<Shared>, coord: Sender<Report>, order: Order) {
    let name = format!("mbal-move-{}", order.cachelet);
    let r = std::thread::Builder::new().name(name).spawn(move || {
        let t0 = Instant::now();
        let (c, to) = (order.cachelet, order.to);
        let result = Mover { shared: &shared, coord: &coord, order: &order, id: 0 }.run();
        let ms = t0.elapsed().as_millis() as u64;
        let f = &shared.coord;
        let answer = match result {
            Ok(m) => {
                f.migrations_out.fetch_add(1, Ordering::Relaxed);
                f.migrated_out_bytes.fetch_add(m.bytes, Ordering::Relaxed);
                f.migration_last_ms.store(ms, Ordering::Relaxed);
                tracing::info!(cachelet = c, to = ?to, items = m.items, bytes = m.bytes, ms, "cachelet moved");
                format!("MIGRATED {c} {} {} {ms}\r\n", m.items, m.bytes)
            }
            Err(e) => {
                f.migrations_failed.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(cachelet = c, to = ?to, "cachelet move failed: {e}");
                format!("SERVER_ERROR migration failed: {e}\r\n")
            }
        };
        let mut batch = ReplyBatch::default();
        batch.push(order.reply, NO_CACHELET, |d| d.extend_from_slice(answer.as_bytes()));
        shared.peers().send_one(order.reply.worker, Envelope::Replies(batch), shared.clock_ns());
    });
    if let Err(e) = r {
        tracing::error!("could not start a mover thread: {e}");
    }
}

struct Mover<'a> {
    shared: &'a Arc<Shared>,
    coord: &'a Sender<Report>,
    order: &'a Order,
    /// The coordinator's id for the move (0: not begun).
    id: u64,
}

/// The member connection to the destination worker, with frames in flight.
struct Dest {
    s: BlockingStream,
    buf: Vec<u8>,
    in_flight: usize,
}

impl Dest {
    fn send(&mut self, head: &str, frame: &[u8]) -> Result<(), String> {
        let mut b = Vec::with_capacity(head.len() + frame.len() + 4);
        b.extend_from_slice(head.as_bytes());
        b.extend_from_slice(b"\r\n");
        b.extend_from_slice(frame);
        if head.starts_with("mbal import data") {
            b.extend_from_slice(b"\r\n");
        }
        self.s.write_all(&b).and_then(|_| self.s.flush()).map_err(|e| format!("to the destination: {e}"))?;
        self.in_flight += 1;
        if self.in_flight >= WINDOW {
            self.answer()?;
        }
        Ok(())
    }

    /// One answer (each must be OK).
    fn answer(&mut self) -> Result<(), String> {
        loop {
            if let Some(i) = self.buf.windows(2).position(|w| w == b"\r\n") {
                let line = String::from_utf8_lossy(&self.buf[..i]).into_owned();
                self.buf.drain(..i + 2);
                self.in_flight -= 1;
                return if line == "OK" { Ok(()) } else { Err(format!("the destination: {line}")) };
            }
            let mut chunk = [0u8; 4096];
            match self.s.read(&mut chunk) {
                Ok(0) => return Err("the destination closed the connection".into()),
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) => return Err(format!("from the destination: {e}")),
            }
        }
    }

    fn drain(&mut self) -> Result<(), String> {
        while self.in_flight > 0 {
            self.answer()?;
        }
        Ok(())
    }
}

impl Mover<'_> {
    fn run(&mut self) -> Result<Moved, String> {
        let (c, (to, w)) = (self.order.cachelet, self.order.to);
        let me = self.shared.server_id;
        let answer = self.call(&format!("mbal migrate begin {c} {me} {to} {w}"))?;
        self.id = match answer.split_whitespace().collect::<Vec<_>>()[..] {
            ["OK", id] => id.parse().map_err(|_| format!("the coordinator: {answer}"))?,
            _ => return Err(format!("the coordinator: {answer}")),
        };
        let r = self.copy();
        match r {
            Ok((moved, dest)) => self.commit(moved, dest),
            Err(e) => {
                self.abort(None);
                Err(e)
            }
        }
    }

    /// Steps 2-4: everything up to the commit.
    fn copy(&mut self) -> Result<(Moved, Dest), String> {
        let c = self.order.cachelet;
        let bytes = match self.ask(|reply| MigMsg::Start { cachelet: c, reply })? {
            MigReply::Started { bytes, .. } => bytes,
            MigReply::Failed(e) => return Err(e.into()),
            _ => return Err("the owner answered out of turn".into()),
        };
        let s = self
            .shared
            .settings
            .peer_dialer(STEP_TIMEOUT)
            .dial(self.order.to_addr, mbal_member::dial::Proto::Text)
            .map_err(|e| format!("dialing the destination {}: {e}", self.order.to_addr))?;
        let mut dest = Dest { s, buf: Vec::new(), in_flight: 0 };
        // Onto the destination worker (a server's workers may share its main port).
        let hello = format!("mbal hello 0 {}\r\n", self.order.to.1);
        dest.s.write_all(hello.as_bytes()).map_err(|e| format!("to the destination: {e}"))?;
        dest.in_flight = 1;
        if let Err(e) = dest.answer() {
            if !e.contains("MBAL ") {
                return Err(e);
            }
        }
        dest.send(&format!("mbal import begin {} {c} {bytes}", self.id), &[])?;
        dest.drain()?;
        let max_frame = self.shared.settings.max_item_size;
        let mut moved = Moved { items: 0, bytes: 0 };
        // The scan: the owner encodes each batch as frames; the next batch is asked before
        // this one is sent (the cursor comes with the answer).
        let mut next =
            self.ask_async(|reply| MigMsg::Export { cachelet: c, cursor: 0, budget: EXPORT_BUDGET, reply })?;
        loop {
            let (frames, items, cursor) = match recv(&next)? {
                MigReply::Frames { frames, items, cursor } => (frames, items, cursor),
                MigReply::Failed(e) => return Err(e.into()),
                _ => return Err("the owner answered out of turn".into()),
            };
            if cursor != 0 {
                next = self.ask_async(|reply| MigMsg::Export { cachelet: c, cursor, budget: EXPORT_BUDGET, reply })?;
            }
            moved.items += items;
            for f in frames {
                moved.bytes += f.len() as u64;
                dest.send(&format!("mbal import data {} {}", self.id, f.len()), &f)?;
            }
            if cursor == 0 {
                break;
            }
        }
        // The writes made meanwhile, then the last ones with the cachelet frozen.
        for round in 0..=DELTA_ROUNDS {
            let freeze = round == DELTA_ROUNDS;
            let recs = match self.ask(|reply| MigMsg::Delta { cachelet: c, freeze, reply })? {
                MigReply::Delta(d) => d,
                MigReply::Failed(e) => return Err(e.into()),
                _ => return Err("the owner answered out of turn".into()),
            };
            let small = recs.len() <= SMALL_DELTA;
            if freeze {
                self.send_frames(&mut dest, &recs, Some("final"), max_frame, &mut moved)?;
                break;
            }
            self.send_frames(&mut dest, &recs, Some("delta"), max_frame, &mut moved)?;
            if small {
                // Few keys changed: the next delta is the last.
                let recs = match self.ask(|reply| MigMsg::Delta { cachelet: c, freeze: true, reply })? {
                    MigReply::Delta(d) => d,
                    MigReply::Failed(e) => return Err(e.into()),
                    _ => return Err("the owner answered out of turn".into()),
                };
                self.send_frames(&mut dest, &recs, Some("final"), max_frame, &mut moved)?;
                break;
            }
        }
        dest.drain()?;
        Ok((moved, dest))
    }

    /// Records as frames of at most `max` bytes (a record alone may fill one); the last frame
    /// of a `final` delta says so (an empty one if there are no records).
    fn send_frames(
        &self,
        dest: &mut Dest,
        recs: &[DeltaItem],
        kind: Option<&str>,
        max: usize,
        moved: &mut Moved,
    ) -> Result<(), String> {
        let id = self.id;
        let mut frame = Vec::with_capacity(max.min(1 << 20));
        let mut i = 0;
        loop {
            let fits = |f: &Vec<u8>, r: &DeltaItem| f.is_empty() || f.len() + wire::encoded_len(r) <= max;
            while i < recs.len() && fits(&frame, &recs[i]) {
                wire::encode(&recs[i], &mut frame);
                moved.items += u64::from(matches!(recs[i], DeltaItem::Put(_)));
                i += 1;
            }
            let last = i == recs.len();
            if frame.is_empty() && !(last && kind == Some("final")) {
                return Ok(());
            }
            let word = match kind {
                None => "",
                Some("final") if last => " final",
                Some(_) => " delta",
            };
            moved.bytes += frame.len() as u64;
            dest.send(&format!("mbal import data {id} {}{word}", frame.len()), &frame)?;
            frame.clear();
            if last {
                return Ok(());
            }
        }
    }

    /// Step 5.
    fn commit(&mut self, moved: Moved, mut dest: Dest) -> Result<Moved, String> {
        let line = format!("mbal migrate commit {} {} {}", self.id, moved.items, moved.bytes);
        // The epoch at which the map gives the cachelet to the destination: it keeps the
        // cachelet against any older map that reaches it later.
        // `held`: the beat thread holds new maps back for this commit (its answer came), until
        // `Report::Committed`; a commit whose answer was lost took no hold.
        let mut held = false;
        let epoch = match self.call_as(&line, true) {
            Ok(a) if a.starts_with("OK ") => {
                held = true;
                a[3..].trim().parse::<u64>().unwrap_or(0)
            }
            Ok(a) => {
                self.abort(Some(&mut dest));
                return Err(format!("the coordinator refused the commit: {a}"));
            }
            // Lost: ask until the coordinator says which (the cachelet stays frozen; its
            // requests on the owner's connections are answered with an error meanwhile).
            Err(_) => match self.resolve() {
                Some(Some(epoch)) => epoch,
                Some(None) => {
                    self.abort(Some(&mut dest));
                    return Err("the commit did not reach the coordinator".into());
                }
                // Stopping with the outcome unknown: neither side may serve it (the commit may
                // stand), so it stays frozen here, unanswered, until the process ends, and the
                // destination keeps its copy for the map that may give it the cachelet.
                None => return Err("stopping before the commit's outcome was known: the cachelet stays frozen".into()),
            },
        };
        let adopted = dest.send(&format!("mbal import commit {} {epoch}", self.id), &[]).and_then(|_| dest.drain());
        if let Err(e) = adopted {
            // The map gives it to the destination anyway (it adopts it then).
            tracing::warn!(cachelet = self.order.cachelet, "the destination did not confirm the move: {e}");
        }
        // (Not `Committed` without a hold: it would end another move's hold early.)
        let _ = self.coord.send(if held { Report::Committed } else { Report::BeatNow });
        self.wait_installed(epoch);
        Ok(moved)
    }

    /// The move's answer waits (briefly, bounded) for this server to install the commit's map,
    /// which the beat thread fetches at `Report::Committed`: once `mbal migrate` answers, the
    /// owner has let the cachelet go (its drop is queued to the worker before the epoch is
    /// published), so a move straight back finds it gone here.
    fn wait_installed(&self, epoch: u64) {
        let until = Instant::now() + Duration::from_secs(2);
        while self.shared.epoch.load(Ordering::Relaxed) < epoch && Instant::now() < until {
            if self.shared.shutdown.load(Ordering::Relaxed) {
                return;
            }
            // No signal to wait on: the controller publishes the epoch in an atomic. The
            // install usually takes one round trip to the coordinator.
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The commit's answer was lost: ask the coordinator until it says whether the move
    /// committed (`Some(epoch)`, an epoch at or after the commit's) or is aborted now
    /// (`None`); `None` outside if the server stops first.
    fn resolve(&self) -> Option<Option<u64>> {
        let (c, to) = (self.order.cachelet, self.order.to.0);
        // Meanwhile the owner answers the frozen cachelet's requests with an error.
        self.tell(MigMsg::Unsure { cachelet: c });
        loop {
            match self.call(&format!("mbal migrate abort {} {c} {to}", self.id)) {
                Ok(a) if a.starts_with("COMMITTED") => {
                    return Some(Some(a["COMMITTED".len()..].trim().parse::<u64>().unwrap_or(0)))
                }
                Ok(a) if a.starts_with("ABORTED") => return Some(None),
                _ => {
                    if self.shared.shutdown.load(Ordering::Relaxed) {
                        return None;
                    }
                    // A retry's pause: the coordinator is failing over or restarting.
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }

    /// The move failed before its commit: everyone forgets it.
    fn abort(&self, dest: Option<&mut Dest>) {
        let c = self.order.cachelet;
        if self.id != 0 {
            let _ = self.call(&format!("mbal migrate abort {} {c} {}", self.id, self.order.to.0));
        }
        if let Some(d) = dest {
            let _ = d.send(&format!("mbal import abort {}", self.id), &[]);
        }
        self.tell(MigMsg::Abort { cachelet: c });
    }

    /// One line to the coordinator, through the beat thread's connection.
    fn call(&self, line: &str) -> Result<String, String> {
        self.call_as(line, false)
    }

    /// `commit`: the commit itself (new maps wait for `Report::Committed`).
    fn call_as(&self, line: &str, commit: bool) -> Result<String, String> {
        let (tx, rx) = bounded(1);
        let line = line.to_string();
        let r = if commit { Report::Commit { line, reply: tx } } else { Report::Call { line, reply: tx } };
        self.coord.send(r).map_err(|_| "no coordinator thread")?;
        match rx.recv_timeout(STEP_TIMEOUT) {
            Ok(Ok(a)) => Ok(a),
            Ok(Err(e)) => Err(format!("the coordinator: {e}")),
            Err(_) => Err("the coordinator did not answer".into()),
        }
    }

    fn tell(&self, m: MigMsg) {
        self.shared.peers().send_one(self.order.worker, Envelope::Mig(m), self.shared.clock_ns());
    }

    fn ask_async(
        &self,
        m: impl FnOnce(Sender<MigReply>) -> MigMsg,
    ) -> Result<crossbeam_channel::Receiver<MigReply>, String> {
        let (tx, rx) = bounded(1);
        self.tell(m(tx));
        Ok(rx)
    }

    fn ask(&self, m: impl FnOnce(Sender<MigReply>) -> MigMsg) -> Result<MigReply, String> {
        recv(&self.ask_async(m)?)
    }
}

fn recv(rx: &crossbeam_channel::Receiver<MigReply>) -> Result<MigReply, String> {
    rx.recv_timeout(STEP_TIMEOUT).map_err(|_| "the owning worker did not answer".to_string())
}
