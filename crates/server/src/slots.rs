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
use mbal_tls::BlockingStream;
use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Start the thread; the controller sends it asks.
pub(crate) fn spawn(shared: Arc<Shared>, servers: Vec<SocketAddr>) -> std::io::Result<Sender<Ask>> {
    let (tx, rx) = crossbeam_channel::unbounded();
    std::thread::Builder::new().name("mbal-slots".into()).spawn(move || run(shared, servers, rx))?;
    Ok(tx)
}

fn run(shared: Arc<Shared>, servers: Vec<SocketAddr>, rx: Receiver<Ask>) {
    // Short: a renewal that waits on one lender delays the others'.
    let timeout = Duration::from_millis((shared.settings.epoch_ms / 4).clamp(50, 1000));
    let mut conns: HashMap<u16, BufReader<BlockingStream>> = HashMap::new();
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
            let Some(&addr) = servers.get(usize::from(peer)) else { continue };
            let asked_at = shared.clock_ns();
            let line = match ask {
                Ask::Lend { slots, lease_ms, .. } => format!("mbal slots {} {slots} {lease_ms}\r\n", shared.server_id),
                Ask::Held { .. } => format!("mbal slots held {}\r\n", shared.server_id),
            };
            let answer = ask_one(&shared, &mut conns, peer, addr, &line, timeout);
            match (ask, answer.as_deref().map(parse_answer)) {
                (Ask::Lend { .. }, Ok(Some(Answer::Slots(slots, lease_ms)))) => {
                    let lease_ns = lease_ms.saturating_mul(1_000_000);
                    shared.tell_controller(CtlMsg::SlotsGranted { lender: peer, slots, asked_at, lease_ns })
                }
                (Ask::Held { .. }, Ok(Some(Answer::Held(n)))) => {
                    shared.tell_controller(CtlMsg::PeerHolds { peer, held: Some(n) })
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

/// Send one line to `peer` and read its answer line.
fn ask_one(
    shared: &Shared,
    conns: &mut HashMap<u16, BufReader<BlockingStream>>,
    peer: u16,
    addr: SocketAddr,
    line: &str,
    timeout: Duration,
) -> std::io::Result<String> {
    let r = match conns.entry(peer) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => {
            // A control command: TLS and the membership proof as the cluster has them.
            let s = shared.settings.peer_dialer(timeout).dial(addr, mbal_member::dial::Proto::Text)?;
            e.insert(BufReader::new(s))
        }
    };
    r.get_mut().write_all(line.as_bytes())?;
    r.get_mut().flush()?;
    let mut answer = String::new();
    if r.read_line(&mut answer)? == 0 {
        return Err(std::io::Error::other("closed"));
    }
    Ok(answer)
}

#[derive(Debug, PartialEq)]
enum Answer {
    /// `SLOTS <granted> <lease ms>`.
    Slots(usize, u64),
    /// `HELD <n>`.
    Held(usize),
}

fn parse_answer(line: &str) -> Option<Answer> {
    match line.split_whitespace().collect::<Vec<_>>()[..] {
        ["SLOTS", n, ms] => Some(Answer::Slots(n.parse().ok()?, ms.parse().ok()?)),
        ["HELD", n] => Some(Answer::Held(n.parse().ok()?)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_answer_names_the_slots_and_the_lease() {
        use super::Answer;
        assert_eq!(super::parse_answer("SLOTS 3 3000\r\n"), Some(Answer::Slots(3, 3000)));
        assert_eq!(super::parse_answer("HELD 2\r\n"), Some(Answer::Held(2)));
        assert_eq!(super::parse_answer("SLOTS 3\r\n"), None);
        assert_eq!(super::parse_answer("CLIENT_ERROR control command refused\r\n"), None);
    }
}
