//! The server-local move protocol, and each worker's view of who owns what.
//!
//! A cachelet changes worker by messages: `Release` at the old owner (it
//! takes the cachelet out of its store and sends it on), `Adopt` at the new
//! one (it puts it in its store and tells every other worker with `Owner`
//! notices, once it really owns it, and tells the controller). Tables are
//! versioned (`ver` counts the cachelet's moves) so a late notice never
//! undoes a newer one. Every move starts at the controller (`control`),
//! whether `mbal move` or the balancer asked for it.
//!
//! Ordering. A connection's requests for one cachelet must execute in the
//! order sent, even when the cachelet moves while some are in flight. So:
//! * every forwarded request carries the version of the cachelet's owner
//!   its origin routed it by (`stamp`); a worker executes it only if it owns
//!   the cachelet at exactly that version, and otherwise does not pass it on
//!   but *bounces* it back to the origin (bytes and all). A worker learns
//!   of an owner only after the owner has the cachelet (the adopter
//!   announces itself; a releaser puts the `Adopt` on the adopter's channel
//!   before it bounces anything), so a request stamped with a version never
//!   reaches the owner before that version's adoption; and an owner at a
//!   newer version (a cachelet that went away and came back) bounces the
//!   stale stamps instead of running them ahead of their bounced elders;
//! * the origin keeps, per cachelet, how many of its requests are in flight
//!   (`Tables::inflight`) and the route it sends them on (`Tables::route`).
//!   A newer owner it learns of becomes the route only when nothing is in
//!   flight for that cachelet; until then bounced requests, and any newer
//!   requests for the cachelet, wait parked in arrival order, and are sent
//!   again, in order, on the new route.
//!
//! Every request of one origin for one cachelet therefore travels one FIFO
//! channel to one worker at a time, and a route changes only between two
//! requests none of which is still travelling.

use crate::msg::OwnMsg;
use crate::msg::{Envelope, FwdKind, Outbox, Peers, ReplyTo};
use mbal_store::WorkerStore;

pub(crate) use mbal_engine::tables::FENCED;

/// A forwarded request waiting for its cachelet's route to settle.
#[derive(Debug)]
pub(crate) struct Parked {
    pub to: ReplyTo,
    pub kind: FwdKind,
    pub bytes: Vec<u8>,
}

/// One worker's ownership tables (`mbal_engine::tables`), holding this server's parked requests.
pub(crate) type Tables = mbal_engine::tables::Tables<Parked>;

/// Hand a cachelet this worker owns to worker `to`: take it out of the
/// store (its items come along; nothing is copied), point our own table at
/// the new owner and send it there; the adopter tells everyone else.
///
/// The `Adopt` goes onto the adopter's channel at once (behind whatever was
/// queued for it, so this worker's messages to it keep their order), not at
/// the end of the round: this worker bounces requests for the cachelet from
/// now on, and an origin that follows a bounce to the adopter must find the
/// cachelet there. Were the `Adopt` still queued, the adopter could bounce
/// one request and execute the next one of the same connection.
///
/// Returns true if the move is already done (the cachelet is at `to`);
/// otherwise the adopting worker tells the controller (move `token`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn release(
    me: usize,
    store: &mut WorkerStore,
    tables: &mut Tables,
    outbox: &mut [Outbox],
    peers: &Peers,
    now_ns: u64,
    c: u32,
    to: usize,
    token: u64,
) -> bool {
    if to == me && store.owns(c) {
        // Already here (the controller's map was behind): nothing moves.
        return true;
    }
    let Some(cachelet) = store.take_cachelet(c) else {
        // Not ours (any more): pass the request on to whoever is.
        let w = tables.owner[c as usize].worker as usize;
        debug_assert_ne!(w, me, "owner table and store disagree");
        outbox[w].push(Envelope::Own(OwnMsg::Release { cachelet: c, to, token }));
        return false;
    };
    let ver = tables.released(c, to as u16);
    outbox[to].push(Envelope::Own(OwnMsg::Adopt { cachelet, ver, token }));
    peers.send_now(to, &mut outbox[to], now_ns);
    false
}

/// The notices an adopter sends: every worker but itself learns the owner.
pub(crate) fn announce(server: u16, me: usize, outbox: &mut [Outbox], c: u32, ver: u32) {
    for (w, ob) in outbox.iter_mut().enumerate() {
        if w != me {
            ob.push(Envelope::Own(OwnMsg::Owner { cachelet: c, server, worker: me, ver }));
        }
    }
}
