//! What the controller's mailbox takes (`crate::control`): from the workers, the
//! replicator, the peer-load and slot threads.

use super::ReplyTo;
use mbal_balance::{PeerHot, WorkerSample};

/// Messages to the controller.
pub(crate) enum CtlMsg {
    /// A worker's counters for the sampling round `seq`, and the keys it
    /// sampled since the last round (`true`: a write), and the reads its
    /// replicated keys got at home since then (exact counts).
    Sample { seq: u64, sample: Box<WorkerSample>, keys: Vec<(Box<[u8]>, bool)>, home_reads: Vec<(Box<[u8]>, u64)> },
    /// The replicator: a key's copies were made (`created`) or renewed by a
    /// job started at `at_ns` (`ok`), or could not be.
    /// A renewal also brings the reads the copies served since the last one.
    HotDone { key: Box<[u8]>, created: bool, ok: bool, at_ns: u64, copy_reads: u64 },
    /// A home worker: replicating `key` failed (the item is gone, a write
    /// could not be copied).
    HotFailed { key: Box<[u8]> },
    /// A worker ran hot for `secs` seconds (Phase 1's trigger within an
    /// epoch), with the keys it sampled meanwhile (`true` for a write).
    /// With its replicated keys' reads at home (exact) over the `home_secs`
    /// since its last epoch sample.
    HotAlarm { worker: u16, keys: Vec<(Box<[u8]>, bool)>, secs: f64, home: Vec<(Box<[u8]>, u64)>, home_secs: f64 },
    /// `mbal move <cachelet> <worker>`: answer `reply` once it is done.
    Move { cachelet: u32, to: usize, reply: ReplyTo },
    /// A cachelet arrived from another server at `worker` (`mbal import commit`), committed
    /// at map `epoch` (0: not known): this server's map shows it at the next install, which
    /// this hastens, and no map older than `epoch` takes it away.
    Arrived { cachelet: u32, worker: u16, epoch: u64 },
    /// `mbal migrate`: move a cachelet to worker `worker` of server `server`.
    Migrate { cachelet: u32, server: u16, worker: u16, addr: Option<std::net::SocketAddr>, reply: ReplyTo },
    /// Move `token` finished: `worker` owns `cachelet` now.
    Moved { token: u64, cachelet: u32, worker: usize },
    /// `mbal map [<have>]`: `MAP <epoch> <len>` and the map as JSON (with `have`, only if
    /// the map is newer than that epoch: else `MAP <epoch> 0`).
    Map { have: Option<u64>, reply: ReplyTo },
    /// `mbal load [<after>]`: the oldest epoch snapshot kept that is
    /// numbered above `after` (the next one, for a caller that keeps up),
    /// as JSON, as soon as there is one.
    Load { after: u64, reply: ReplyTo },
    /// `mbal debug hot <key> <replicas>` / `cool <key>` (replicas 0):
    /// pin a key homed here as replicated, or unpin it.
    Pin { key: Box<[u8]>, replicas: u32, reply: ReplyTo },
    /// `mbal slots <borrower> <slots> <lease ms>`: another server asks for
    /// REPL_high slots (`SlotLedger::lend`); answer `SLOTS <granted> <lease ms>`.
    Lend { borrower: u16, slots: usize, lease_ms: u64, reply: ReplyTo },
    /// A lender answered an ask sent at `asked_at` (`crate::slots`): hold
    /// `slots` from it for `lease_ns` from then, in place of what was held
    /// from it.
    SlotsGranted { lender: u16, slots: usize, asked_at: u64, lease_ns: u64 },
    /// `mbal slots held <lender>`: how many of `lender`'s slots this server
    /// holds; answer `HELD <n>`.
    Held { lender: u16, reply: ReplyTo },
    /// A starting server's question to `peer` answered (`None`: could not
    /// be asked; asked again at the next tick).
    PeerHolds { peer: u16, held: Option<usize> },
    /// `mbal debug slots <keys>`: ask for slots as if `demand` keys had or
    /// wanted copies, at once and at every epoch until 0.
    DebugSlots { demand: usize, reply: ReplyTo },
    /// Another server's epoch record (`crate::peerload`): its mean load
    /// per worker and its Phase 1 figures.
    PeerLoad { server: u16, mean: f64, hot: Option<PeerHot> },
    /// The coordinator's map (`crate::beat`); with `reset` after this server was declared
    /// dead (`Event::Map`).
    CoordMap { map: Box<mbal_cluster::ClusterMap>, reset: bool },
    /// A worker applied every `Reassign` sent before `OwnMsg::Applied` (`seq`).
    Applied { seq: u64 },
    /// Look at the shutdown flag.
    Wake,
}

/// The controller's asks to the `mbal-slots` thread (`crate::slots`).
pub(crate) enum Ask {
    /// Ask `lender` for `slots` (replacing what is held from it) for `lease_ms`.
    Lend { lender: u16, slots: usize, lease_ms: u64 },
    /// Ask `peer` how many of this server's slots it holds (a server that
    /// started: `SlotLedger::started`).
    Held { peer: u16 },
}

impl Ask {
    pub(crate) fn peer(&self) -> u16 {
        match *self {
            Ask::Lend { lender, .. } => lender,
            Ask::Held { peer } => peer,
        }
    }
}
