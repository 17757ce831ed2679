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
//! Order: [`Outbox::push_req`] and [`Outbox::push_reply`] append to the last
//! batch only if it is the newest envelope for that destination; a control
//! envelope (flush_all, a cachelet move) queued in between starts a new
//! batch after it. A connection's requests therefore reach each peer in the
//! order the connection sent them, control messages included.

use crate::moves::Own;
use crate::stats::WorkerSnapshot;
use crossbeam_channel::{Receiver, Sender};
use mbal_proto::Protocol;
use mbal_store::Cachelet;
use mio::Waker;
use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::Arc;

/// What a forwarded request asks the owner to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FwdKind {
    /// Parse and execute these bytes (one complete request for one key),
    /// with the key's hash, which the origin computed to route it: the
    /// owner prefetches and locates by it instead of parsing and hashing
    /// twice more.
    Raw(Protocol, u64),
    /// Keys (space-separated) of a text multi-get, all of one cachelet:
    /// answer VALUE blocks only (the origin writes END after the last run).
    /// `one`: when the bytes are a single key, its hash (else 0), so that
    /// the owner neither splits nor hashes it again.
    Values { cas: bool, touch: Option<i64>, one: u64 },
    /// A text storage command the origin parsed: its bytes are
    /// [`StoreFields::encode`]'s (flags, exptime, cas unique, key, data), so
    /// the owner executes it without parsing the command line again.
    Store { mode: mbal_proto::text::StoreMode, noreply: bool, key_len: u8, hash: u64 },
}

/// The fields of a text storage command that travel in a forwarded
/// request's bytes (`FwdKind::Store`).
pub(crate) struct StoreFields<'a> {
    pub key: &'a [u8],
    pub flags: u32,
    pub exptime: i64,
    pub cas_unique: u64,
    pub data: &'a [u8],
}

/// Bytes before the key: flags (4), exptime (8), cas unique (8), little-endian.
const STORE_HEAD: usize = 20;

impl<'a> StoreFields<'a> {
    pub fn encode(&self, d: &mut Vec<u8>) {
        d.reserve(STORE_HEAD + self.key.len() + self.data.len());
        d.extend_from_slice(&self.flags.to_le_bytes());
        d.extend_from_slice(&self.exptime.to_le_bytes());
        d.extend_from_slice(&self.cas_unique.to_le_bytes());
        d.extend_from_slice(self.key);
        d.extend_from_slice(self.data);
    }

    /// The inverse of `encode` (`key_len` from the request's `FwdKind`).
    pub fn decode(b: &'a [u8], key_len: u8) -> StoreFields<'a> {
        let word = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        let (key, data) = b[STORE_HEAD..].split_at(key_len as usize);
        StoreFields {
            key,
            flags: u32::from_le_bytes(b[..4].try_into().expect("4 bytes")),
            exptime: word(4) as i64,
            cas_unique: word(12),
            data,
        }
    }
}

/// The cachelet of a reply that answers no forwarded request (an admin
/// command's reply from another worker or from the controller).
pub(crate) const NO_CACHELET: u32 = u32::MAX;

/// Where a reply goes: a connection's output slot on the origin worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ReplyTo {
    pub worker: usize,
    pub conn: usize,
    pub gen: u64,
    pub seq: u64,
}

/// One forwarded request: its bytes are `data[prev.end..end]` of its batch.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FwdReq {
    pub to: ReplyTo,
    pub cachelet: u32,
    /// The owner version the origin routed it by (see `moves`).
    pub stamp: u32,
    pub kind: FwdKind,
    end: u32,
}

/// Requests for one destination worker, in the order they were sent.
#[derive(Default, Debug)]
pub(crate) struct ReqBatch {
    reqs: Vec<FwdReq>,
    data: Vec<u8>,
    /// When it was sent ([`Envelope::stamp`]): the receiver measures how
    /// long it waited (the worker's queueing delay, for the balancer).
    pub sent_ns: u64,
}

/// Emptied batches kept for reuse by the worker thread that consumed them
/// (traffic between workers is symmetric, so what a worker takes in is
/// about what it sends out): a round's batch then starts with the
/// capacity an earlier one grew to, instead of allocating and growing.
struct Spare {
    reqs: Vec<ReqBatch>,
    replies: Vec<ReplyBatch>,
}

thread_local! {
    static SPARE: std::cell::RefCell<Spare> = const { std::cell::RefCell::new(Spare { reqs: Vec::new(), replies: Vec::new() }) };
}

/// At most this many spare batches of each kind per thread, none bigger.
const SPARE_MAX: usize = 16;
const SPARE_BYTES: usize = 1 << 20;

impl ReqBatch {
    /// An empty batch, reusing a spare one if this thread has one.
    pub fn fresh() -> ReqBatch {
        SPARE.with(|s| s.borrow_mut().reqs.pop()).unwrap_or_default()
    }

    /// Done with it: keep it for reuse (if it is not too big).
    pub fn recycle(mut self) {
        if self.data.capacity() > SPARE_BYTES {
            return;
        }
        self.reqs.clear();
        self.data.clear();
        SPARE.with(|s| {
            let mut s = s.borrow_mut();
            if s.reqs.len() < SPARE_MAX {
                s.reqs.push(self);
            }
        });
    }

    /// Append a request whose bytes `write` produces.
    pub fn push(&mut self, to: ReplyTo, cachelet: u32, stamp: u32, kind: FwdKind, write: impl FnOnce(&mut Vec<u8>)) {
        write(&mut self.data);
        let end = u32::try_from(self.data.len()).expect("a request batch stays below 4 GiB");
        self.reqs.push(FwdReq { to, cachelet, stamp, kind, end });
    }

    /// How many requests it holds.
    pub fn len(&self) -> usize {
        self.reqs.len()
    }

    /// The requests with their bytes, in order.
    pub fn iter(&self) -> impl Iterator<Item = (&FwdReq, &[u8])> {
        let mut start = 0usize;
        self.reqs.iter().map(move |r| {
            let b = &self.data[start..r.end as usize];
            start = r.end as usize;
            (r, b)
        })
    }
}

/// One reply: its bytes are `data[prev.end..end]` of its batch. A bounce
/// carries the request's own bytes back instead (see `moves`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ReplyItem {
    pub to: ReplyTo,
    pub cachelet: u32,
    pub bounce: Option<Bounce>,
    end: u32,
}

/// A request returned to its origin: the worker it reached does not own
/// its cachelet, and believes `hint` does.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Bounce {
    pub kind: FwdKind,
    pub hint: Own,
}

/// Replies for one origin worker, in the order they were produced.
#[derive(Default, Debug)]
pub(crate) struct ReplyBatch {
    items: Vec<ReplyItem>,
    data: Vec<u8>,
    pub sent_ns: u64,
}

impl ReplyBatch {
    /// An empty batch, reusing a spare one if this thread has one.
    pub fn fresh() -> ReplyBatch {
        SPARE.with(|s| s.borrow_mut().replies.pop()).unwrap_or_default()
    }

    /// Done with it: keep it for reuse (if it is not too big).
    pub fn recycle(mut self) {
        if self.data.capacity() > SPARE_BYTES {
            return;
        }
        self.items.clear();
        self.data.clear();
        SPARE.with(|s| {
            let mut s = s.borrow_mut();
            if s.replies.len() < SPARE_MAX {
                s.replies.push(self);
            }
        });
    }

    /// Append a reply written by `write` straight into the batch buffer.
    pub fn push(&mut self, to: ReplyTo, cachelet: u32, write: impl FnOnce(&mut Vec<u8>)) {
        write(&mut self.data);
        let end = u32::try_from(self.data.len()).expect("a reply batch stays below 4 GiB");
        self.items.push(ReplyItem { to, cachelet, bounce: None, end });
    }

    /// Return a request to its origin.
    pub fn bounce(&mut self, req: &FwdReq, bytes: &[u8], hint: Own) {
        self.data.extend_from_slice(bytes);
        let end = u32::try_from(self.data.len()).expect("a reply batch stays below 4 GiB");
        let bounce = Some(Bounce { kind: req.kind, hint });
        self.items.push(ReplyItem { to: req.to, cachelet: req.cachelet, bounce, end });
    }

    pub fn iter(&self) -> impl Iterator<Item = (&ReplyItem, &[u8])> {
        let mut start = 0usize;
        self.items.iter().map(move |r| {
            let b = &self.data[start..r.end as usize];
            start = r.end as usize;
            (r, b)
        })
    }
}

/// A connection changing worker, with what it had read but not served.
pub(crate) struct HandOff {
    /// The socket with its TLS state, if any (a TLS session moves whole).
    pub sock: mbal_tls::Stream<std::net::TcpStream>,
    pub peer: std::net::SocketAddr,
    pub listen_addr: std::net::SocketAddr,
    pub id: u64,
    pub unread: Vec<u8>,
    pub auth: crate::auth::ConnAuth,
    /// Exempt from the emulated capacity (a peer's replicator), and not yet
    /// past its admin commands (see `Conn::fresh`).
    pub exempt: bool,
    pub fresh: bool,
    /// Asked to be served its worker's thread-mates' keys too (`mbal hello ... threads`).
    pub by_thread: bool,
}

/// A lease reads of a hot key may be told: γ and until when (server
/// clock, ns); `None`: home only.
pub(crate) type Grant = Option<(u32, u64)>;

/// Phase 1's messages to a hot key's home worker (`replica`, `control`,
/// `replicate`).
pub(crate) enum HotCmd {
    /// From the controller: make (or widen to) copies 1..=`replicas` of
    /// `key` with its current value.
    Replicate { key: Box<[u8]>, replicas: u32 },
    /// From the controller, each epoch and when copies are made: the leases
    /// reads of each key may be told, γ and until when (server clock, ns),
    /// or none.
    Grants(Vec<(Box<[u8]>, Grant)>),
    /// From the controller: the key cooled and its leases ended; delete its
    /// copies and stop copying its writes.
    Retire { key: Box<[u8]> },
    /// From the replicator: a write of the key with `hash` reached every
    /// copy (`ok`), or not.
    Written { hash: u64, ok: bool },
    /// From the controller, each epoch: the load (requests/s) above which
    /// this worker raises a hotspot alarm between epochs (`None`: none).
    AlarmLimit(Option<f64>),
    /// From the controller, each epoch: the fraction of requests to sample
    /// for the hot-key tracker from now on (`HotKeys::sample_rate`).
    SampleRate(f64),
}

/// Messages between workers.
pub(crate) enum Envelope {
    /// Requests to execute here (or pass along if their cachelet moved on).
    Reqs(ReqBatch),
    /// Replies to requests this worker forwarded.
    Replies(ReplyBatch),
    /// A connection accepted on the main port, handed to this worker.
    Conn(std::net::TcpStream, std::net::SocketAddr),
    /// A routed connection handed over by the worker that had it (`mbal
    /// hello <epoch> <worker>`): serve it here, answer its hello first.
    HandOff(Box<HandOff>),
    Flush {
        at: u32,
    },
    StatsReq {
        to: ReplyTo,
        want_conns: bool,
    },
    StatsResp {
        to: ReplyTo,
        snap: Box<WorkerSnapshot>,
    },
    ResetStats,
    /// Give cachelet `cachelet` to worker `to` (sent to its current owner
    /// by the controller; `token` names the move in its reply).
    Release {
        cachelet: u32,
        to: usize,
        token: u64,
    },
    /// Take ownership of a cachelet (its items come along, nothing is
    /// copied), then tell the controller.
    Adopt {
        cachelet: Box<Cachelet>,
        ver: u32,
        token: u64,
    },
    /// The controller's epoch tick: send it this worker's counters.
    Sample {
        seq: u64,
    },
    /// Cachelet `cachelet` is now owned by worker `worker` (move number `ver`).
    Owner {
        cachelet: u32,
        worker: usize,
        ver: u32,
    },
    /// Phase 1 (hot-key replication).
    Hot(HotCmd),
    /// Test hook (`--enable-debug`): stop serving for this long.
    Stall {
        ms: u64,
    },
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
        ob.push(Envelope::Flush { at: 3 });
        ob.reqs().push(to(3), 0, 0, FwdKind::Raw(Protocol::Text, 0), |d| d.push(b'c'));
        ob.replies().push(to(4), 0, |d| d.push(b'r'));
        let kinds: Vec<String> = ob
            .drain()
            .map(|e| match e {
                Envelope::Reqs(b) => format!("reqs{}", b.iter().count()),
                Envelope::Replies(b) => format!("replies{}", b.iter().count()),
                Envelope::Flush { .. } => "flush".into(),
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
        tx.send(Envelope::ResetStats).unwrap();
        assert!(!m.prepare_sleep(&rx), "a queued message keeps the worker awake");
        assert!(!m.sleeping.load(Ordering::Relaxed));
        m.awake();
    }
}
