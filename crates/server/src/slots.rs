//! Phase 1's REPL_high slots lent between servers, the borrower's side
//! (`mbal_balance::SlotLedger` has the rules; docs/protocol.md `mbal slots`).
//!
//! The controller never waits on the network: it queues an [`Ask`] here,
//! and this thread (one per server, started with Phase 1) sends
//! `mbal slots <me> <slots> <lease ms>` to the lender on a connection it
//! keeps, reads `SLOTS <granted> <lease ms>`, and tells the controller
//! ([`CtlMsg::SlotsGranted`]) with the time it asked, from which the
//! borrower counts the lease the lender named. Asks queued for one lender
//! while another was answering collapse to the newest. A lender that
//! cannot be reached or answers amiss changes nothing: what was held from
//! it is still held until its lease ends (a restarted lender counts its
//! whole share as lent until every other server has told it what it still
//! holds, `mbal slots held`, also asked from here).

use crate::msg::{Ask, CtlMsg};
use crate::shared::Shared;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use mbal_member::call::MemberConn;
use mbal_proto::client::Reply;
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Start the thread; the controller sends it asks.
pub(crate) fn spawn(shared: Arc<Shared>) -> std::io::Result<Sender<Ask>> {
    let (tx, rx) = crossbeam_channel::unbounded();
    std::thread::Builder::new().name("mbal-slots".into()).spawn(move || {
        let _watch = shared.life.watch();
        run(shared.clone(), rx)
    })?;
    Ok(tx)
}

fn run(shared: Arc<Shared>, rx: Receiver<Ask>) {
    // Short: a renewal that waits on one lender delays the others'.
    let timeout = Duration::from_millis((shared.settings.epoch_ms / 4).clamp(50, 1000));
    let mut conns: HashMap<u16, MemberConn> = HashMap::new();
    while !shared.shutdown.load(Ordering::Relaxed) {
        let first = match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(a) => a,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        // Renewals first: a question to a server that is not up yet must
        // not delay them.
        let mut asks: BTreeMap<(bool, u16), Ask> = BTreeMap::new();
        for a in std::iter::once(first).chain(rx.try_iter()) {
            asks.insert((matches!(a, Ask::Held { .. }), a.peer()), a);
        }
        for ask in asks.into_values() {
            let peer = ask.peer();
            let Some(addr) = shared.member_addr(peer) else { continue };
            let asked_at = shared.clock_ns();
            let line = match ask {
                Ask::Lend { slots, lease_ms, .. } => format!("mbal slots {} {slots} {lease_ms}\r\n", shared.server_id),
                Ask::Held { .. } => format!("mbal slots held {}\r\n", shared.server_id),
            };
            let answer = ask_one(&shared, &mut conns, peer, addr, &line, timeout);
            match (ask, answer) {
                (Ask::Lend { .. }, Ok(Reply::Slots { granted, lease_ms })) => {
                    let (slots, lease_ns) = (granted as usize, lease_ms.saturating_mul(1_000_000));
                    shared.tell_controller(CtlMsg::SlotsGranted { lender: peer, slots, asked_at, lease_ns })
                }
                (Ask::Held { .. }, Ok(Reply::Held(n))) => {
                    shared.tell_controller(CtlMsg::PeerHolds { peer, held: Some(n as usize) })
                }
                (ask, answer) => {
                    tracing::debug!(peer, "mbal slots: {answer:?}");
                    conns.remove(&peer);
                    if matches!(ask, Ask::Held { .. }) {
                        shared.tell_controller(CtlMsg::PeerHolds { peer, held: None });
                    }
                }
            }
        }
    }
}

/// Send one line to `peer` and read its answer (the one reply codec).
fn ask_one(
    shared: &Shared,
    conns: &mut HashMap<u16, MemberConn>,
    peer: u16,
    addr: SocketAddr,
    line: &str,
    timeout: Duration,
) -> std::io::Result<Reply> {
    let c = match conns.entry(peer) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        // A control command: TLS and the membership proof as the cluster has them.
        std::collections::hash_map::Entry::Vacant(e) => {
            e.insert(MemberConn::dial(&shared.settings.peer_dialer(timeout), addr)?)
        }
    };
    c.call(line.as_bytes())
}
