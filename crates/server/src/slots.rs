//! Phase 1's REPL_high slots lent between servers, the borrower's side
//! (`mbal_balance::SlotLedger` has the rules; docs/protocol.md `mbal slots`).
//!
//! The controller never waits on the network: it queues an [`Ask`] here,
//! and this thread (one per server, started with Phase 1) sends
//! `mbal slots <me> <slots> <lease ms>` to the lender on a connection it
//! keeps, reads `SLOTS <granted>`, and tells the controller
//! ([`CtlMsg::SlotsGranted`]) with the time it asked, from which the
//! borrower counts the lease. A lender that cannot be reached grants 0:
//! the borrower gives back what it held from it (it may still count as lent
//! at the lender until the lease ends there; never the other way round).

use crate::control::CtlMsg;
use crate::worker::Shared;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use mbal_tls::BlockingStream;
use std::collections::HashMap;
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
    let timeout = Duration::from_millis(shared.settings.epoch_ms.clamp(100, 5000));
    let mut conns: HashMap<u16, BufReader<BlockingStream>> = HashMap::new();
    while !shared.shutdown.load(Ordering::Relaxed) {
        let ask = match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(a) => a,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        let Some(&addr) = servers.get(usize::from(ask.lender)) else { continue };
        let asked_at = shared.clock_ns();
        let granted = match ask_one(&shared, &mut conns, ask.lender, addr, &ask, timeout) {
            Ok(g) => g,
            Err(e) => {
                tracing::debug!(lender = ask.lender, "mbal slots: {e}");
                conns.remove(&ask.lender);
                0
            }
        };
        let lease_ns = ask.lease_ms.saturating_mul(1_000_000);
        shared.tell_controller(CtlMsg::SlotsGranted { lender: ask.lender, slots: granted, asked_at, lease_ns });
    }
}

fn ask_one(
    shared: &Shared,
    conns: &mut HashMap<u16, BufReader<BlockingStream>>,
    lender: u16,
    addr: SocketAddr,
    ask: &Ask,
    timeout: Duration,
) -> std::io::Result<usize> {
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
    match line.split_whitespace().collect::<Vec<_>>()[..] {
        ["SLOTS", n] => n.parse().map_err(|_| std::io::Error::other(format!("bad answer {:?}", line.trim_end()))),
        _ => Err(std::io::Error::other(format!("unexpected answer {:?}", line.trim_end()))),
    }
}
