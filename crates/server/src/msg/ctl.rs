//! The control plane between the controller (and admin commands) and a worker: epoch
//! samples, stats, flush_all, Phase 1's commands.

use super::ReplyTo;
use crate::counters::WorkerSnapshot;

/// What a stats request wants beside the counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Want {
    /// `stats conns`: the worker's connections.
    pub conns: bool,
    /// `lru_crawler metadump` / `stats cachedump`: its items.
    pub dump: Option<Dump>,
}

/// A dump of items: which, how many, in which format (`stats::dump_item`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Dump {
    /// `metadump`'s lines (else `cachedump`'s).
    pub meta: bool,
    /// Only these workers' items (bit `w`: worker `w`, memcached's slab class `w + 1`);
    /// `None`: every worker's.
    pub workers: Option<u64>,
    /// At most this many items (0: no limit but the size bound).
    pub limit: usize,
    /// At most this many bytes of lines from one worker.
    pub max_bytes: usize,
}

/// A control message to a worker.
pub(crate) enum CtlCmd {
    /// `flush_all` at this time.
    Flush { at: u32 },
    /// Send this worker's stats (and what else `want` asks for) to `to`.
    StatsReq { to: ReplyTo, want: Want },
    /// A worker's stats, for the connection at `to`.
    StatsResp { to: ReplyTo, snap: Box<WorkerSnapshot> },
    /// `stats reset`.
    ResetStats,
    /// The controller's epoch tick: send it this worker's counters.
    Sample { seq: u64 },
    /// Phase 1 (hot-key replication).
    Hot(HotCmd),
    /// `watch`: connection `conn` (generation `gen`) of `worker` wants the log lines of the
    /// categories in `mask` (`mbal_store::log`); `None`: it stopped watching.
    Watch { worker: usize, conn: usize, gen: u64, mask: Option<u8> },
    /// The sender now logs for the watching connection `conn` (generation `gen`) of this
    /// worker: the answer to a `Watch` with a mask.
    WatchAck { conn: usize, gen: u64 },
    /// Log lines for the watching connection `conn` (generation `gen`) of this worker.
    WatchLog { conn: usize, gen: u64, bytes: Vec<u8> },
    /// Test hook (`--enable-debug-commands`, only in a build with the
    /// `test-hooks` feature): stop serving for this long.
    #[cfg(feature = "test-hooks")]
    Stall { ms: u64 },
}

impl CtlCmd {
    /// Must wait behind a worker's held requests (it acts on what they
    /// read: flush_all, a stats reset); the others are no one's requests.
    pub fn ordered(&self) -> bool {
        match self {
            CtlCmd::Flush { .. } | CtlCmd::ResetStats => true,
            #[cfg(feature = "test-hooks")]
            CtlCmd::Stall { .. } => true,
            CtlCmd::StatsReq { .. }
            | CtlCmd::StatsResp { .. }
            | CtlCmd::Sample { .. }
            | CtlCmd::Hot(_)
            | CtlCmd::Watch { .. }
            | CtlCmd::WatchAck { .. }
            | CtlCmd::WatchLog { .. } => false,
        }
    }
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
