//! The ownership plane: the move protocol of a cachelet between the workers of one server
//! (`crate::moves` runs it; the controller starts it).

use mbal_store::Cachelet;

pub(crate) use mbal_engine::tables::Own;

/// A step of a cachelet's move.
pub(crate) enum OwnMsg {
    /// Give cachelet `cachelet` to worker `to` (sent to its current owner
    /// by the controller; `token` names the move in its reply).
    Release { cachelet: u32, to: usize, token: u64 },
    /// Take ownership of a cachelet (its items come along, nothing is
    /// copied), then tell the controller.
    Adopt { cachelet: Box<Cachelet>, ver: u32, token: u64 },
    /// Cachelet `cachelet` is now owned by worker `worker` of server `server` (move number `ver`).
    Owner { cachelet: u32, server: u16, worker: usize, ver: u32 },
    /// The coordinator's map gives cachelet `cachelet` to `(server, worker)` (the controller
    /// sends it to every worker, the new owner first): a worker holding it drops its items
    /// (nothing moves between servers yet: the new owner starts empty), the new owner puts an
    /// empty cachelet in its store, every table learns the owner. `epoch`: the map's (or a
    /// move's commit); a notice older than the last one a worker followed changes nothing.
    Reassign { cachelet: u32, server: u16, worker: u16, epoch: u64 },
    /// Sent to every worker after a map's `Reassign`s: answer `CtlMsg::Applied`.
    Applied { seq: u64 },
}
