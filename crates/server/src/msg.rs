//! Messages between the workers of one server, and how they travel.
//!
//! Everything that crosses from one worker to another is an [`Envelope`] on
//! the destination's FIFO channel. The data path's messages are batches:
//! every request a worker forwards to a peer during one event-loop round
//! (from any of its connections, every run of every multi-get) goes in one
//! [`ReqBatch`]: descriptors in one `Vec`, the request bytes back to back in
//! one buffer. The owner executes them in order and answers with one
//! [`ReplyBatch`] per origin, built the same way. So a round costs one
//! channel send per destination, no allocation per request, and at most one
//! wake-up, only when the destination is asleep ([`Mailbox`]).
//!
//! The planes, each in its own module with its payload types: [`data`] (request and reply
//! batches), [`conn`] (connections changing worker), [`own`] (the move protocol) and
//! [`ctl`] (samples, stats, flush_all, Phase 1), [`mig`] (a cachelet moving to another
//! server). Beside them, the other threads' messages:
//! [`controller`] (the controller's mailbox and its asks to the slot thread), [`replica`]
//! (the replicator's jobs), [`forward`] (the forwarder's).
//!
//! Order: [`Outbox::push_req`] and [`Outbox::push_reply`] append to the last
//! batch only if it is the newest envelope for that destination; a control
//! envelope (flush_all, a cachelet move) queued in between starts a new
//! batch after it. A connection's requests therefore reach each peer in the
//! order the connection sent them, control messages included.

pub(crate) mod conn;
pub(crate) mod controller;
pub(crate) mod ctl;
pub(crate) mod data;
pub(crate) mod forward;
pub(crate) mod mig;
pub(crate) mod own;
pub(crate) mod replica;

pub(crate) use conn::{ConnAuth, ConnMsg, HandOff, Peer};
pub(crate) use controller::{Ask, CtlMsg};
pub(crate) use ctl::{CtlCmd, Dump, HotCmd, Want};
pub(crate) use data::*;
pub(crate) use forward::ForwardHandle;
pub(crate) use mig::{MigMsg, MigReply};
pub(crate) use own::{Own, OwnMsg};
pub(crate) use replica::Job as ReplicaJob;

use crossbeam_channel::{Receiver, Sender};
use mio::Waker;
use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::Arc;

/// Messages between workers, by plane. The data plane's batches are top-level variants
/// (the hot path matches them first); the other planes nest.
pub(crate) enum Envelope {
    /// Requests to execute here (or pass along if their cachelet moved on).
    Reqs(ReqBatch),
    /// Replies to requests this worker forwarded.
    Replies(ReplyBatch),
    /// A connection changing worker ([`conn`]).
    Conn(ConnMsg),
    /// The move protocol ([`own`]).
    Own(OwnMsg),
    /// Samples, stats, flush_all, Phase 1 ([`ctl`]).
    Ctl(CtlCmd),
    /// A cachelet moving to another server ([`mig`]).
    Mig(MigMsg),
}

impl Envelope {
    /// Mark a batch with the time it leaves its sender.
    fn stamp(&mut self, now_ns: u64) {
        match self {
            Envelope::Reqs(b) => b.sent_ns = now_ns,
            Envelope::Replies(b) => b.sent_ns = now_ns,
            _ => {}
        }
    }
}

/// Envelopes queued for one destination during a round.
#[derive(Default)]
pub(crate) struct Outbox {
    queue: Vec<Envelope>,
}

impl Outbox {
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Holds nothing but replies (nothing the receiver must run before a later request).
    pub fn only_replies(&self) -> bool {
        self.queue.iter().all(|e| matches!(e, Envelope::Replies(_)))
    }

    pub fn push(&mut self, env: Envelope) {
        self.queue.push(env);
    }

    /// The request batch to append to: the newest envelope if it is one.
    pub fn reqs(&mut self) -> &mut ReqBatch {
        if !matches!(self.queue.last(), Some(Envelope::Reqs(_))) {
            self.queue.push(Envelope::Reqs(ReqBatch::fresh()));
        }
        match self.queue.last_mut() {
            Some(Envelope::Reqs(b)) => b,
            _ => unreachable!("just pushed"),
        }
    }

    /// The reply batch to append to: the newest envelope if it is one.
    pub fn replies(&mut self) -> &mut ReplyBatch {
        if !matches!(self.queue.last(), Some(Envelope::Replies(_))) {
            self.queue.push(Envelope::Replies(ReplyBatch::fresh()));
        }
        match self.queue.last_mut() {
            Some(Envelope::Replies(b)) => b,
            _ => unreachable!("just pushed"),
        }
    }

    pub fn drain(&mut self) -> std::vec::Drain<'_, Envelope> {
        self.queue.drain(..)
    }
}

/// The receiving end of a worker's channel, plus whether it sleeps.
///
/// A worker that is about to block in `epoll_wait` sets `sleeping`, then
/// looks at its channel once more; a sender pushes, then clears `sleeping`
/// and wakes the worker only if it was set. The two SeqCst fences order each
/// side's store before its load (the Dekker pattern), so one of them always
/// sees the other: either the worker finds the message before sleeping, or
/// the sender sees the flag and wakes it. A busy worker costs its senders no
/// system call at all.
pub(crate) struct Mailbox {
    sleeping: AtomicBool,
    waker: Waker,
}

impl Mailbox {
    pub fn new(waker: Waker) -> Mailbox {
        Mailbox { sleeping: AtomicBool::new(false), waker }
    }

    /// Sender side, after its envelopes are on the channel.
    pub fn notify(&self) {
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::Relaxed) && self.sleeping.swap(false, Ordering::AcqRel) {
            let _ = self.waker.wake();
        }
    }

    /// Wake the worker whether or not it sleeps (shutdown, new connection).
    pub fn wake(&self) {
        let _ = self.waker.wake();
    }

    /// Worker side: may it block? Sets the flag, then checks the channel.
    pub fn prepare_sleep<T>(&self, inbox: &Receiver<T>) -> bool {
        self.sleeping.store(true, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        if inbox.is_empty() {
            true
        } else {
            self.sleeping.store(false, Ordering::Relaxed);
            false
        }
    }

    /// Worker side, once awake.
    pub fn awake(&self) {
        self.sleeping.store(false, Ordering::Relaxed);
    }
}

/// Every worker's channel and mailbox, indexed by worker.
pub(crate) struct Peers {
    pub senders: Vec<Sender<Envelope>>,
    pub mailboxes: Vec<Arc<Mailbox>>,
}

impl Peers {
    /// Send what `outboxes` holds, one channel send per envelope (a round
    /// usually leaves one batch per destination), then notify each
    /// destination once. `now_ns` stamps the batches.
    pub fn send_all(&self, me: usize, outboxes: &mut [Outbox], now_ns: u64) {
        for (w, ob) in outboxes.iter_mut().enumerate() {
            if ob.is_empty() {
                continue;
            }
            debug_assert_ne!(w, me, "a worker never queues envelopes for itself");
            self.send_now(w, ob, now_ns);
        }
    }

    /// Send what is queued for worker `w` now, not at the end of the round.
    pub fn send_now(&self, w: usize, ob: &mut Outbox, now_ns: u64) {
        for mut env in ob.drain() {
            env.stamp(now_ns);
            let _ = self.senders[w].send(env);
        }
        self.mailboxes[w].notify();
    }

    /// Send one envelope to worker `w` at once (the controller's messages).
    pub fn send_one(&self, w: usize, mut env: Envelope, now_ns: u64) {
        env.stamp(now_ns);
        let _ = self.senders[w].send(env);
        self.mailboxes[w].notify();
    }

    pub fn wake_all(&self) {
        for m in &self.mailboxes {
            m.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mbal_proto::Protocol;

    fn to(seq: u64) -> ReplyTo {
        ReplyTo { worker: 0, conn: 1, gen: 2, seq }
    }

    #[test]
    fn batches_keep_order_and_bytes() {
        let mut b = ReqBatch::default();
        b.push(to(1), 7, 0, FwdKind::Raw(Protocol::Text, 0), |d| d.extend_from_slice(b"get a\r\n"));
        b.push(to(2), 8, 0, FwdKind::Values { cas: true, touch: None, one: 0 }, |d| d.extend_from_slice(b"k1 k2"));
        b.push(to(3), 9, 0, FwdKind::Raw(Protocol::Text, 0), |_| {});
        let got: Vec<(u64, u32, Vec<u8>)> = b.iter().map(|(r, d)| (r.to.seq, r.cachelet, d.to_vec())).collect();
        assert_eq!(got, vec![(1, 7, b"get a\r\n".to_vec()), (2, 8, b"k1 k2".to_vec()), (3, 9, vec![])]);

        let mut r = ReplyBatch::default();
        r.push(to(5), 1, |d| d.extend_from_slice(b"END\r\n"));
        r.push(to(6), 1, |_| {});
        r.push(to(7), 1, |d| d.extend_from_slice(b"STORED\r\n"));
        let got: Vec<(u64, Vec<u8>)> = r.iter().map(|(i, d)| (i.to.seq, d.to_vec())).collect();
        assert_eq!(got, vec![(5, b"END\r\n".to_vec()), (6, vec![]), (7, b"STORED\r\n".to_vec())]);
    }

    #[test]
    fn a_parsed_store_travels_whole() {
        let f = StoreFields { key: b"key", flags: 0xdead_beef, exptime: -3, cas_unique: u64::MAX - 1, data: b"v\r\nv" };
        let mut d = b"before".to_vec();
        f.encode(&mut d);
        let g = StoreFields::decode(&d[6..], 3);
        assert_eq!(
            (g.key, g.flags, g.exptime, g.cas_unique, g.data),
            (&b"key"[..], 0xdead_beef, -3, u64::MAX - 1, &b"v\r\nv"[..])
        );
        let empty = StoreFields { key: b"k", flags: 0, exptime: 0, cas_unique: 0, data: b"" };
        let mut d = Vec::new();
        empty.encode(&mut d);
        assert_eq!(StoreFields::decode(&d, 1).data, b"");
    }

    #[test]
    fn outbox_coalesces_only_adjacent_batches() {
        let mut ob = Outbox::default();
        ob.reqs().push(to(1), 0, 0, FwdKind::Raw(Protocol::Text, 0), |d| d.push(b'a'));
        ob.reqs().push(to(2), 0, 0, FwdKind::Raw(Protocol::Text, 0), |d| d.push(b'b'));
        ob.push(Envelope::Ctl(CtlCmd::Flush { at: 3 }));
        ob.reqs().push(to(3), 0, 0, FwdKind::Raw(Protocol::Text, 0), |d| d.push(b'c'));
        ob.replies().push(to(4), 0, |d| d.push(b'r'));
        let kinds: Vec<String> = ob
            .drain()
            .map(|e| match e {
                Envelope::Reqs(b) => format!("reqs{}", b.iter().count()),
                Envelope::Replies(b) => format!("replies{}", b.iter().count()),
                Envelope::Ctl(CtlCmd::Flush { .. }) => "flush".into(),
                _ => "other".into(),
            })
            .collect();
        assert_eq!(kinds, ["reqs2", "flush", "reqs1", "replies1"]);
    }

    #[test]
    fn mailbox_wakes_only_a_sleeper() {
        let poll = mio::Poll::new().unwrap();
        let m = Mailbox::new(Waker::new(poll.registry(), mio::Token(0)).unwrap());
        let (tx, rx) = crossbeam_channel::unbounded();
        assert!(m.prepare_sleep(&rx));
        m.notify(); // clears the flag (and wakes)
        assert!(!m.sleeping.load(Ordering::Relaxed));
        m.notify(); // not asleep: nothing to do
        tx.send(Envelope::Ctl(CtlCmd::ResetStats)).unwrap();
        assert!(!m.prepare_sleep(&rx), "a queued message keeps the worker awake");
        assert!(!m.sleeping.load(Ordering::Relaxed));
        m.awake();
    }
}
