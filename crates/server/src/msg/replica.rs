//! The replicator's jobs (Phase 1's copies on other servers, `crate::replicate` runs
//! them): what a worker or the controller asks of it, and who hears how each ended.

use super::ReplyTo;

/// Where a copy lives: (server, worker).
pub(crate) type Loc = (u16, u16);

pub(crate) enum Op {
    /// Make or replace the copies (`mbal rset`).
    Put { flags: u32, exptime: u32, value: Vec<u8>, ttl_ms: u64 },
    /// Delete them (`mbal rdel`).
    Del,
    /// Extend their life (`mbal rttl`).
    Renew { ttl_ms: u64 },
}

/// Who hears how a job ended.
pub(crate) enum Done {
    Nobody,
    /// The controller: `key`'s copies were made (`created`) or renewed by a
    /// job started at `at_ns`.
    Controller {
        created: bool,
        at_ns: u64,
    },
    /// The home worker: a write of the key with `hash` was copied; in sync
    /// mode, with the write's reply to send once it is.
    Worker {
        worker: usize,
        hash: u64,
        reply: Option<(ReplyTo, u32, Vec<u8>)>,
    },
}

pub(crate) struct Job {
    pub key: Box<[u8]>,
    pub to: Vec<Loc>,
    pub op: Op,
    pub done: Done,
}
