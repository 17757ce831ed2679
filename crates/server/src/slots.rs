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
//! whole share as lent for a lease, `SlotLedger::starting`).

use crate::control::CtlMsg;
use crate::worker::Shared;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use mbal_tls::BlockingStream;
use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Ask `lender` for `slots` (replacing what is held from it) for `lease_ms`.
pub(crate) struct Ask {
    pub lender: u16,
    pub slots: usize,
    pub lease_ms: u64,
}

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
        let mut asks: BTreeMap<u16, Ask> = BTreeMap::new();
        for a in std::iter::once(first).chain(rx.try_iter()) {
            asks.insert(a.lender, a);
        }
        for ask in asks.into_values() {
            let Some(&addr) = servers.get(usize::from(ask.lender)) else { continue };
            let asked_at = shared.clock_ns();
            match ask_one(&shared, &mut conns, ask.lender, addr, &ask, timeout) {
                Ok((slots, lease_ms)) => shared.tell_controller(CtlMsg::SlotsGranted {
                    lender: ask.lender,
                    slots,
                    asked_at,
                    lease_ns: lease_ms.saturating_mul(1_000_000),
                }),
                Err(e) => {
                    tracing::debug!(lender = ask.lender, "mbal slots: {e}");
                    conns.remove(&ask.lender);
                }
            }
        }
    }
}

/// One ask and its answer: (slots granted, lease ms).
fn ask_one(
    shared: &Shared,
    conns: &mut HashMap<u16, BufReader<BlockingStream>>,
    lender: u16,
    addr: SocketAddr,
    ask: &Ask,
    timeout: Duration,
) -> std::io::Result<(usize, u64)> {
    let r = match conns.entry(lender) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => {
            // A control command: TLS and the membership proof as the cluster has them.
            let s = shared.settings.peer_dialer(timeout).dial(addr, mbal_cluster::dial::Proto::Text)?;
            e.insert(BufReader::new(s))
        }
    };
    write!(r.get_mut(), "mbal slots {} {} {}\r\n", shared.server_id, ask.slots, ask.lease_ms)?;
    r.get_mut().flush()?;
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Err(std::io::Error::other("closed"));
    }
    parse_answer(&line).ok_or_else(|| std::io::Error::other(format!("unexpected answer {:?}", line.trim_end())))
}

/// `SLOTS <granted> <lease ms>`.
fn parse_answer(line: &str) -> Option<(usize, u64)> {
    match line.split_whitespace().collect::<Vec<_>>()[..] {
        ["SLOTS", n, ms] => Some((n.parse().ok()?, ms.parse().ok()?)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_answer_names_the_slots_and_the_lease() {
        assert_eq!(super::parse_answer("SLOTS 3 3000\r\n"), Some((3, 3000)));
        assert_eq!(super::parse_answer("SLOTS 3\r\n"), None);
        assert_eq!(super::parse_answer("CLIENT_ERROR control command refused\r\n"), None);
    }
}
