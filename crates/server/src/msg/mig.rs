//! The migration plane: a cachelet moving to another server (`crate::migrate`). The mover
//! thread asks the owning worker, which answers on the channel the request carries; nothing
//! else crosses threads.

use crossbeam_channel::Sender;
use mbal_store::DeltaItem;

/// The mover's requests to the worker that owns the moving cachelet.
pub(crate) enum MigMsg {
    /// Note the writes in `cachelet` from now on, and say its size.
    Start { cachelet: u32, reply: Sender<MigReply> },
    /// The next items of the scan, from `cursor` (0: the start), about `budget` bytes.
    Export { cachelet: u32, cursor: u64, budget: usize, reply: Sender<MigReply> },
    /// The keys written since the last delta, with their state now. With `freeze`, the
    /// cachelet serves nothing more here from this point: its requests wait for the end of
    /// the move (then they go where the map says).
    Delta { cachelet: u32, freeze: bool, reply: Sender<MigReply> },
    /// The move failed: stop noting writes, serve the cachelet again.
    Abort { cachelet: u32 },
    /// The commit's answer was lost: until the move ends, the frozen cachelet's requests on
    /// this worker's own connections are answered with an error (`Tables::unsure`).
    Unsure { cachelet: u32 },
}

/// The owning worker's answers.
pub(crate) enum MigReply {
    Started {
        bytes: u64,
    },
    /// Items as frames ready to send (`mbal_store::wire`, each at most the item size limit),
    /// how many, and the next cursor (0: the scan is over).
    Frames {
        frames: Vec<Vec<u8>>,
        items: u64,
        cursor: u64,
    },
    Delta(Vec<DeltaItem>),
    /// The move cannot go on (the cachelet left this worker, or a `flush_all`).
    Failed(&'static str),
}
