//! The data plane: forwarded requests and their replies, in batches (see the parent
//! module for how they travel and keep order).

use super::own::Own;
use mbal_proto::Protocol;

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
