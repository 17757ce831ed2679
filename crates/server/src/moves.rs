//! The server-local move protocol: a cachelet changes worker by messages
//! (release at the old owner, adopt at the new one, owner notices to the
//! rest), each ownership table versioned so a late notice never undoes a
//! newer move. Driven by `mbal move` (`dispatch::admin`).

use crate::msg::{Envelope, Outbox, ReplyTo};
use crate::worker::Own;
use mbal_store::WorkerStore;

/// Hand a cachelet this worker owns to worker `to`: take it out of the
/// store (its items come along; nothing is copied), point our own table at
/// the new owner, send it there, and tell every other worker. The Adopt is
/// queued before the Owner notices, and a worker that still has the old
/// owner passes requests along its table, so every request reaches the
/// cachelet wherever it is.
///
/// Returns the admin reply when it is already known (the cachelet is
/// already at `to`); otherwise the adopting worker answers.
#[allow(clippy::too_many_arguments)]
pub(crate) fn release(
    me: usize,
    store: &mut WorkerStore,
    owner: &mut [Own],
    outbox: &mut [Outbox],
    epoch: u64,
    c: u32,
    to: usize,
    reply: ReplyTo,
) -> Option<(ReplyTo, Vec<u8>)> {
    if to == me && store.owns(c) {
        // Already here (the requester's table was behind): nothing moves.
        return Some((reply, format!("MOVED {epoch}\r\n").into_bytes()));
    }
    let Some(cachelet) = store.take_cachelet(c) else {
        // Not ours (any more): pass the request on to whoever is.
        let w = owner[c as usize].worker as usize;
        debug_assert_ne!(w, me, "owner table and store disagree");
        outbox[w].push(Envelope::Release { cachelet: c, to, reply });
        return None;
    };
    let own = &mut owner[c as usize];
    own.worker = to as u16;
    own.ver += 1;
    let ver = own.ver;
    outbox[to].push(Envelope::Adopt { cachelet, ver, reply });
    for (w, ob) in outbox.iter_mut().enumerate() {
        if w != me && w != to {
            ob.push(Envelope::Owner { cachelet: c, worker: to, ver });
        }
    }
    None
}
