//! Phase 1's view of the cluster's mean load (`ClusterView::avg_load`): one
//! thread per other server long-polls that server's epochs (`mbal load
//! <after>`, docs/protocol.md: answered at once when a newer epoch exists,
//! else at the server's next epoch) and keeps its mean load per worker, in
//! the policy's units ([`mbal_balance::worker_loads`]). The controller
//! averages those it heard lately with its own. Without it each server
//! compares its workers with its own mean only, and a server whose workers
//! are all above the cluster's mean never sees a hotspot.
//!
//! Off the data path: a peer's epoch record is a few KB once per epoch.

use crate::worker::Shared;
use mbal_balance::{worker_loads, Config, EpochSnapshot};
use mbal_tls::BlockingStream;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Each server's last heard mean load per worker, by server id.
///
/// Shared by a mutex per slot: written by that peer's polling thread and read
/// by the controller once per epoch; no worker touches it, so no lock is on
/// the data path (DESIGN.md principle 1 is about the workers' state).
#[derive(Debug, Default)]
pub(crate) struct PeerLoads {
    slots: Vec<Mutex<Option<(f64, Instant)>>>,
}

impl PeerLoads {
    pub fn new(servers: usize) -> PeerLoads {
        PeerLoads { slots: (0..servers).map(|_| Mutex::new(None)).collect() }
    }

    pub fn set(&self, server: usize, mean: f64, at: Instant) {
        if let Some(s) = self.slots.get(server) {
            *s.lock().unwrap_or_else(|p| p.into_inner()) = Some((mean, at));
        }
    }

    /// The cluster's mean load per worker: this server's (`own`) and every
    /// other server's heard since `since`, all servers having as many
    /// workers. `None` until some other server has been heard.
    pub fn cluster_mean(&self, me: usize, own: f64, since: Instant) -> Option<f64> {
        let mut sum = own;
        let mut n = 1usize;
        for (i, s) in self.slots.iter().enumerate() {
            if i == me {
                continue;
            }
            if let Some((mean, at)) = *s.lock().unwrap_or_else(|p| p.into_inner()) {
                if at >= since {
                    sum += mean;
                    n += 1;
                }
            }
        }
        (n > 1).then(|| sum / n as f64)
    }
}

/// The mean of a snapshot's worker loads.
pub(crate) fn mean_load(snap: &EpochSnapshot, cfg: &Config) -> f64 {
    let l = worker_loads(snap, cfg);
    if l.is_empty() {
        0.0
    } else {
        l.iter().sum::<f64>() / l.len() as f64
    }
}

/// Start one polling thread per other server (detached: each ends within a
/// read timeout of shutdown).
pub(crate) fn spawn(shared: Arc<Shared>, servers: Vec<SocketAddr>, cfg: Config) -> std::io::Result<()> {
    for (id, addr) in servers.into_iter().enumerate() {
        if id == usize::from(shared.server_id) {
            continue;
        }
        let (shared, cfg) = (shared.clone(), cfg.clone());
        std::thread::Builder::new().name(format!("mbal-peerload-{id}")).spawn(move || poll(shared, id, addr, cfg))?;
    }
    Ok(())
}

fn poll(shared: Arc<Shared>, id: usize, addr: SocketAddr, cfg: Config) {
    let epoch = Duration::from_millis(shared.settings.epoch_ms.max(1));
    let timeout = epoch * 2 + Duration::from_secs(1);
    let mut after = 0u64;
    while !shared.shutdown.load(Ordering::Relaxed) {
        let r = connect(&shared, addr, timeout).and_then(|mut r| loop {
            if shared.shutdown.load(Ordering::Relaxed) {
                return Ok(());
            }
            write!(r.get_mut(), "mbal load {after}\r\n")?;
            r.get_mut().flush()?;
            let (seq, snap) = read_load(&mut r)?;
            after = after.max(seq);
            shared.peer_loads.set(id, mean_load(&snap, &cfg), Instant::now());
        });
        if let Err(e) = r {
            tracing::debug!(server = id, "peer load: {e}");
        }
        // Retry after an epoch (checking for shutdown meanwhile).
        let until = Instant::now() + epoch;
        while Instant::now() < until && !shared.shutdown.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn connect(shared: &Shared, addr: SocketAddr, timeout: Duration) -> std::io::Result<BufReader<BlockingStream>> {
    // `mbal load` is a control command: the peer dialer speaks TLS when the
    // cluster does and proves membership (`mbal peer`) when there is a secret.
    let s = shared.settings.peer_dialer(timeout).dial(addr, mbal_cluster::dial::Proto::Text)?;
    Ok(BufReader::new(s))
}

/// `LOAD <seq> <len>\r\n<json>\r\n`.
fn read_load(r: &mut BufReader<BlockingStream>) -> std::io::Result<(u64, EpochSnapshot)> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Err(std::io::Error::other("closed"));
    }
    let bad = || std::io::Error::other(format!("unexpected answer {:?}", line.trim_end()));
    let mut it = line.split_whitespace();
    if it.next() != Some("LOAD") {
        return Err(bad());
    }
    let seq: u64 = it.next().and_then(|s| s.parse().ok()).ok_or_else(bad)?;
    let len: usize = it.next().and_then(|s| s.parse().ok()).filter(|l| *l < 64 << 20).ok_or_else(bad)?;
    let mut body = vec![0; len + 2];
    r.read_exact(&mut body)?;
    body.truncate(len);
    let snap = serde_json::from_slice(&body).map_err(std::io::Error::other)?;
    Ok((seq, snap))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_mean_counts_servers_heard_lately() {
        let p = PeerLoads::new(3);
        let t0 = Instant::now();
        assert_eq!(p.cluster_mean(0, 500.0, t0), None, "nobody heard yet");
        p.set(1, 800.0, t0 + Duration::from_secs(1));
        assert_eq!(p.cluster_mean(0, 500.0, t0), Some(650.0));
        p.set(2, 200.0, t0);
        assert_eq!(p.cluster_mean(0, 500.0, t0), Some(500.0));
        assert_eq!(p.cluster_mean(0, 500.0, t0 + Duration::from_millis(500)), Some(650.0), "server 2 is stale");
        p.set(0, 1e9, t0 + Duration::from_secs(1));
        assert_eq!(p.cluster_mean(0, 500.0, t0 + Duration::from_millis(500)), Some(650.0), "its own slot is not read");
    }
}
