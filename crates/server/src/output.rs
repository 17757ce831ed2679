//! A connection's ordered output.
//!
//! Replies leave in request order. A request executed here appends its reply
//! to `out` at once, unless an earlier request still waits for another
//! worker: then a slot marks the wait, and everything produced after it is
//! staged behind it until the answer comes. Staged bytes live in one arena
//! per connection (`stage`, slots hold ranges into it), so a forwarded
//! request costs a slot in a `VecDeque`, not a buffer of its own.
//!
//! Replies are written once per read batch, as memcached does: the
//! requests read together are answered together. While a batch still waits
//! for another worker, a reply for its earlier requests is held (`marks`,
//! [`Output::batch_done`]) instead of being written as soon as it is in
//! order, which at `-t N` would cost up to N writes per batch (and as many
//! reads and refills on the client's side). A reply is held at most until
//! the other replies of its own batch arrive.

use crate::counters::WorkerSnapshot;
use std::collections::VecDeque;

/// How a gathered stats reply is rendered once every worker has answered.
#[derive(Clone)]
pub(crate) enum StatsFormat {
    Text,
    Binary { opaque: u32 },
}

pub(crate) enum Slot {
    /// Ready bytes, `stage[start..end]`.
    Bytes { start: usize, end: usize },
    /// A reply another worker will send.
    Wait,
    /// A stats reply gathered from every worker (boxed: the slots of every
    /// forwarded request move through a `VecDeque`, and stay small).
    Gather(Box<Gather>),
}

pub(crate) struct Gather {
    pub group: String,
    pub format: StatsFormat,
    pub remaining: usize,
    pub snaps: Vec<WorkerSnapshot>,
}

#[derive(Default)]
pub(crate) struct Output {
    /// Bytes in order, ready to send; `out[..sent]` are sent.
    pub out: Vec<u8>,
    pub sent: usize,
    /// Slots behind the first wait, oldest first.
    pending: VecDeque<Slot>,
    /// Sequence number of `pending[0]`.
    base_seq: u64,
    stage: Vec<u8>,
    /// Bytes of `stage` still referenced by a slot.
    staged: usize,
    /// The newest slot is `Bytes` and still growing (its `end` is stale
    /// until `close_open`).
    open: bool,
    /// The end (one past its last slot's sequence number) of each read
    /// batch that still waits, oldest first.
    marks: VecDeque<u64>,
}

/// Stop reading from a connection whose unsent output exceeds this, until
/// the client drains it (a client that pipelines but never reads cannot
/// make the server buffer without bound); a get line stops between two keys
/// past it, and goes on from there once the client has read.
pub(crate) const MAX_PENDING_OUTPUT: usize = 4 << 20;

/// Compact the arena when it is mostly dead and larger than this.
const STAGE_COMPACT_MIN: usize = 64 << 10;

impl Output {
    /// Where the next in-order reply bytes go.
    pub fn buf(&mut self) -> &mut Vec<u8> {
        if self.pending.is_empty() {
            return &mut self.out;
        }
        if !self.open {
            let start = self.stage.len();
            self.pending.push_back(Slot::Bytes { start, end: start });
            self.open = true;
        }
        &mut self.stage
    }

    fn close_open(&mut self) {
        if self.open {
            self.open = false;
            let len = self.stage.len();
            if let Some(Slot::Bytes { start, end }) = self.pending.back_mut() {
                *end = len;
                self.staged += len - *start;
            }
        }
    }

    /// Reserve a slot; returns its sequence number.
    pub fn push(&mut self, slot: Slot) -> u64 {
        self.close_open();
        self.pending.push_back(slot);
        self.base_seq + self.pending.len() as u64 - 1
    }

    pub fn slot_mut(&mut self, seq: u64) -> Option<&mut Slot> {
        let i = seq.checked_sub(self.base_seq)?;
        self.pending.get_mut(i as usize)
    }

    /// Fill a reserved slot with its reply bytes. Returns false if there is
    /// no such slot (a stale reply).
    pub fn fill(&mut self, seq: u64, data: &[u8]) -> bool {
        let Some(i) = seq.checked_sub(self.base_seq) else { return false };
        let i = i as usize;
        if i >= self.pending.len() || matches!(self.pending[i], Slot::Bytes { .. }) {
            return false;
        }
        if i == 0 {
            // The oldest wait: straight to the ready bytes.
            self.out.extend_from_slice(data);
            self.pending.pop_front();
            self.base_seq += 1;
            self.drain();
            return true;
        }
        self.close_open();
        let start = self.stage.len();
        self.stage.extend_from_slice(data);
        self.staged += data.len();
        self.pending[i] = Slot::Bytes { start, end: start + data.len() };
        true
    }

    /// Move every leading ready slot into `out`.
    pub fn drain(&mut self) {
        self.close_open();
        while let Some(&Slot::Bytes { start, end }) = self.pending.front() {
            self.out.extend_from_slice(&self.stage[start..end]);
            self.staged -= end - start;
            self.pending.pop_front();
            self.base_seq += 1;
        }
        if self.pending.is_empty() {
            self.stage.clear();
            self.staged = 0;
        } else if self.stage.len() > STAGE_COMPACT_MIN && self.stage.len() > 2 * self.staged {
            self.compact();
        }
    }

    /// Copy the live ranges into a fresh arena (amortised: at least half of
    /// the old one was dead).
    fn compact(&mut self) {
        let mut stage = Vec::with_capacity(self.staged.max(1024));
        for slot in self.pending.iter_mut() {
            if let Slot::Bytes { start, end } = slot {
                let s = stage.len();
                stage.extend_from_slice(&self.stage[*start..*end]);
                *start = s;
                *end = stage.len();
            }
        }
        self.stage = stage;
    }

    /// A read batch ends: its requests' replies are written together, once
    /// every one of them is in (`batch_done`).
    pub fn end_batch(&mut self) {
        self.close_open();
        if self.pending.is_empty() {
            return;
        }
        let end = self.base_seq + self.pending.len() as u64;
        if self.marks.back() != Some(&end) {
            self.marks.push_back(end);
        }
    }

    /// Has a read batch been answered whole since the last call (or is
    /// nothing waiting)? Then what is in order should be written now.
    pub fn batch_done(&mut self) -> bool {
        self.drain();
        let mut done = self.pending.is_empty();
        while self.marks.front().is_some_and(|&m| m <= self.base_seq) {
            self.marks.pop_front();
            done = true;
        }
        done
    }

    /// Does an earlier reply still wait for another worker?
    pub fn waiting(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Bytes buffered for this client, sent or not yet in order.
    pub fn unsent(&self) -> usize {
        self.out.len() - self.sent + self.staged + if self.open { self.stage.len() } else { 0 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ready(o: &mut Output) -> Vec<u8> {
        o.drain();
        let v = o.out[o.sent..].to_vec();
        o.sent = o.out.len();
        v
    }

    #[test]
    fn replies_leave_in_order() {
        let mut o = Output::default();
        o.buf().extend_from_slice(b"a");
        let s1 = o.push(Slot::Wait);
        o.buf().extend_from_slice(b"b");
        o.buf().extend_from_slice(b"c");
        let s2 = o.push(Slot::Wait);
        o.buf().extend_from_slice(b"d");
        assert_eq!(ready(&mut o), b"a");
        assert!(o.fill(s2, b"S2"));
        assert_eq!(ready(&mut o), b"");
        assert!(!o.fill(s2, b"again"), "a slot is filled once");
        assert!(o.fill(s1, b"S1"));
        assert_eq!(ready(&mut o), b"S1bcS2d");
        assert!(!o.waiting());
        assert_eq!(o.unsent(), 0);
        o.buf().extend_from_slice(b"e");
        assert_eq!(ready(&mut o), b"e");
    }

    #[test]
    fn a_batch_is_written_once_all_its_replies_are_in() {
        let mut o = Output::default();
        // batch 1: local, wait (w1), local, wait (w2)
        o.buf().extend_from_slice(b"a");
        let w1 = o.push(Slot::Wait);
        o.buf().extend_from_slice(b"b");
        let w2 = o.push(Slot::Wait);
        o.end_batch();
        assert!(!o.batch_done());
        // w1 answers: "a S1 b" is in order, but the batch still waits for w2
        assert!(o.fill(w1, b"S1"));
        assert!(!o.batch_done());
        // batch 2 read meanwhile: local, wait (w3)
        o.buf().extend_from_slice(b"c");
        let w3 = o.push(Slot::Wait);
        o.end_batch();
        assert!(!o.batch_done());
        assert!(o.fill(w2, b"S2"));
        assert!(o.batch_done(), "batch 1 is whole");
        assert_eq!(ready(&mut o), b"aS1bS2c");
        assert!(!o.batch_done(), "batch 2 still waits");
        assert!(o.fill(w3, b"S3"));
        assert!(o.batch_done());
        assert_eq!(ready(&mut o), b"S3");
        assert!(o.marks.is_empty());
        // nothing waiting: always done
        o.buf().extend_from_slice(b"d");
        o.end_batch();
        assert!(o.batch_done());
    }

    #[test]
    fn arena_is_compacted_under_a_steady_stream_of_waits() {
        // A pipelining client that always has a forwarded request
        // outstanding never lets the queue empty; the arena must not grow
        // with the bytes that passed through it.
        let mut o = Output::default();
        let mut expect = Vec::new();
        let mut got = Vec::new();
        let mut waiting = o.push(Slot::Wait);
        for i in 0..20_000u32 {
            let local = format!("local{i};");
            o.buf().extend_from_slice(local.as_bytes());
            let next = o.push(Slot::Wait);
            let remote = format!("remote{i};");
            assert!(o.fill(waiting, remote.as_bytes()));
            expect.extend_from_slice(remote.as_bytes());
            expect.extend_from_slice(local.as_bytes());
            waiting = next;
            got.extend(ready(&mut o));
            assert!(o.stage.len() <= STAGE_COMPACT_MIN * 2 + 64, "arena grew to {}", o.stage.len());
        }
        assert!(o.fill(waiting, b"last"));
        expect.extend_from_slice(b"last");
        got.extend(ready(&mut o));
        assert_eq!(got, expect);
    }

    #[test]
    fn gather_slots_are_filled_like_waits() {
        let mut o = Output::default();
        let g = Gather { group: String::new(), format: StatsFormat::Text, remaining: 2, snaps: vec![] };
        let s = o.push(Slot::Gather(Box::new(g)));
        o.buf().extend_from_slice(b"after");
        assert!(matches!(o.slot_mut(s), Some(Slot::Gather(_))));
        assert!(o.fill(s, b"STAT x 1\r\nEND\r\n"));
        assert_eq!(ready(&mut o), b"STAT x 1\r\nEND\r\nafter");
    }
}
