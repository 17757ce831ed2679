//! The map from the coordinators.
//!
//! With a coordinator (`mbal coordinator`, named in the cluster file or with `--coordinator`),
//! the cluster's map and its epoch are the coordinator's; a server hears of a new epoch at its
//! next heartbeat, so a server's `mbal map` can be a beat behind just after a commit. A proxy
//! thread that needs the map (an upstream failed, a redirect named a newer epoch) asks the
//! coordinators first, on a helper thread of its own ([`Fetcher`]): the blocking connect and
//! read stay out of the event loop, which is woken when the answer is in. Coordinators
//! sharing etcd all answer `mbal map` (a standby shows what etcd holds); the one that answered
//! last is asked first. If none answers within the upstream timeout, the thread falls back to
//! a server's map, as without a coordinator.

pub use mbal_member::coordinators::Coordinators;
use mbal_member::coordinators::Link;
use std::io;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;

/// A proxy thread's helper that fetches the map from the coordinators: one request at a
/// time (the thread has at most one fetch in flight), answered on `answers` (`None`: no
/// coordinator answered; else the epoch and the JSON, empty if the coordinator's map is no
/// newer than the thread's), then the event loop's waker.
pub(crate) struct Fetcher {
    asks: Sender<u64>,
    pub(crate) answers: Receiver<Option<(u64, Vec<u8>)>>,
}

impl Fetcher {
    pub(crate) fn start(thread: usize, coords: Coordinators, waker: Arc<mio::Waker>) -> io::Result<Fetcher> {
        let (asks, asked) = std::sync::mpsc::channel::<u64>();
        let (answer, answers) = std::sync::mpsc::channel();
        std::thread::Builder::new().name(format!("mbal-proxy-map-{thread}")).spawn(move || {
            let mut link = Link::default();
            // Ends when the event loop (the sender) is gone.
            while let Ok(have) = asked.recv() {
                let got = coords.fetch_with(&mut link, Some(have)).ok();
                if answer.send(got).is_err() {
                    return;
                }
                let _ = waker.wake();
            }
        })?;
        Ok(Fetcher { asks, answers })
    }

    /// Ask for the map if newer than epoch `have` (the thread's); false if the helper is gone.
    pub(crate) fn ask(&self, have: u64) -> bool {
        self.asks.send(have).is_ok()
    }
}
