//! The ownership plane: the move protocol of a cachelet between the workers of one server
//! (`crate::moves` runs it; the controller starts it).

use mbal_store::Cachelet;

/// Who serves a cachelet, as a worker's tables know it: a worker of this
/// server or another server, and the version of that knowledge (moves of
/// one cachelet are numbered).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Own {
    pub server: u16,
    pub worker: u16,
    pub ver: u32,
}

/// A step of a cachelet's move.
pub(crate) enum OwnMsg {
    /// Give cachelet `cachelet` to worker `to` (sent to its current owner
    /// by the controller; `token` names the move in its reply).
    Release { cachelet: u32, to: usize, token: u64 },
    /// Take ownership of a cachelet (its items come along, nothing is
    /// copied), then tell the controller.
    Adopt { cachelet: Box<Cachelet>, ver: u32, token: u64 },
    /// Cachelet `cachelet` is now owned by worker `worker` (move number `ver`).
    Owner { cachelet: u32, worker: usize, ver: u32 },
}
