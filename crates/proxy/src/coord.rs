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

use mbal_proto::client::{Expect, Reply, ReplyReader};
use std::io::{self, Write};
use std::net::SocketAddr;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::time::Duration;

/// Where the coordinators are and how to reach them.
#[derive(Clone, Debug)]
pub struct Coordinators {
    pub addrs: Vec<SocketAddr>,
    /// The cluster's client TLS (coordinators listen with TLS where the cluster file has it).
    pub tls: Option<mbal_tls::ClientTls>,
    /// Bounds each connect, and each read and write.
    pub timeout: Duration,
}

/// One connection kept to the coordinator that answered last.
struct Link {
    at: usize,
    conn: Option<(mbal_tls::BlockingStream, ReplyReader)>,
}

impl Coordinators {
    /// `mbal map` from the coordinators, starting with `link.at` and trying each once:
    /// the answer's JSON. A connection that fails is dropped and the next one tried.
    fn fetch_with(&self, link: &mut Link) -> io::Result<Vec<u8>> {
        let n = self.addrs.len();
        let mut last = io::Error::new(io::ErrorKind::NotFound, "no coordinator is named");
        for k in 0..n {
            let i = (link.at + k) % n;
            if link.at != i {
                link.conn = None;
            }
            link.at = i;
            match self.ask(link) {
                Ok(json) => return Ok(json),
                Err(e) => {
                    tracing::debug!(coordinator = %self.addrs[i], "proxy: mbal map: {e}");
                    link.conn = None;
                    last = e;
                }
            }
        }
        Err(last)
    }

    fn ask(&self, link: &mut Link) -> io::Result<Vec<u8>> {
        if link.conn.is_none() {
            let s = mbal_tls::dial_timeouts(self.addrs[link.at], self.tls.as_ref(), self.timeout, self.timeout)?;
            link.conn = Some((s, ReplyReader::new()));
        }
        let (s, r) = link.conn.as_mut().expect("connected above");
        s.write_all(b"mbal map\r\n")?;
        s.flush()?;
        match r.read_reply(s, Expect::Line)? {
            Reply::Map { json, .. } => Ok(json),
            other => {
                Err(io::Error::new(io::ErrorKind::InvalidData, format!("unexpected answer to mbal map: {other:?}")))
            }
        }
    }

    /// The map's JSON, once, from the first coordinator that answers (the proxy's start).
    pub fn fetch(&self) -> io::Result<Vec<u8>> {
        self.fetch_with(&mut Link { at: 0, conn: None })
    }
}

/// A proxy thread's helper that fetches the map from the coordinators: one request at a
/// time (the thread has at most one fetch in flight), answered on `answers` (`None`: no
/// coordinator answered), then the event loop's waker.
pub(crate) struct Fetcher {
    asks: Sender<()>,
    pub(crate) answers: Receiver<Option<Vec<u8>>>,
}

impl Fetcher {
    pub(crate) fn start(thread: usize, coords: Coordinators, waker: Arc<mio::Waker>) -> io::Result<Fetcher> {
        let (asks, asked) = std::sync::mpsc::channel::<()>();
        let (answer, answers) = std::sync::mpsc::channel();
        std::thread::Builder::new().name(format!("mbal-proxy-map-{thread}")).spawn(move || {
            let mut link = Link { at: 0, conn: None };
            // Ends when the event loop (the sender) is gone.
            while asked.recv().is_ok() {
                let got = coords.fetch_with(&mut link).ok();
                if answer.send(got).is_err() {
                    return;
                }
                let _ = waker.wake();
            }
        })?;
        Ok(Fetcher { asks, answers })
    }

    /// Ask for the map; false if the helper is gone.
    pub(crate) fn ask(&self) -> bool {
        self.asks.send(()).is_ok()
    }
}
