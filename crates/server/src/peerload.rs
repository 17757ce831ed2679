//! Phase 1's view of the cluster's mean load (`ClusterView::avg_load`): one
//! thread per other server long-polls that server's epochs (`mbal load
//! <after>`, docs/protocol.md: answered at once when a newer epoch exists,
//! else at the server's next epoch) and keeps its mean load per worker, in
//! the policy's units ([`mbal_balance::worker_loads`]). The controller
//! averages those it heard lately with its own. Without it each server
//! compares its workers with its own mean only, and a server whose workers
//! are all above the cluster's mean never sees a hotspot.
//!
//! With Phase 1's slots lent between servers (`crate::slots`), the same
//! records tell a borrower which peers have REPL_high slots to spare: each
//! carries its server's `hot` decision, whose `spare` is what it would lend.
//!
//! Off the data path: a peer's epoch record is a few KB once per epoch.

use crate::worker::Shared;
use mbal_balance::{worker_loads, Config, EpochSnapshot, SlotHeat};
use mbal_tls::BlockingStream;
use serde::Deserialize;
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
    /// Each server's last Phase 1 figures (REPL_high slots), when it sent them.
    hot: Vec<Mutex<Option<(PeerHot, Instant)>>>,
}

/// What a peer's epoch record says of its REPL_high slots (the fields of
/// its `hot` decision, `mbal_balance::ReplicaDecision`): what it would
/// lend (0 while it holds a loan itself or lends none).
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
pub(crate) struct PeerHot {
    #[serde(default)]
    pub spare: usize,
    /// The rates of its keys with copies and keys waiting, by which the
    /// servers lend (`mbal_balance::entitlements`).
    #[serde(default)]
    pub heat: SlotHeat,
}

impl PeerLoads {
    pub fn new(servers: usize) -> PeerLoads {
        PeerLoads {
            slots: (0..servers).map(|_| Mutex::new(None)).collect(),
            hot: (0..servers).map(|_| Mutex::new(None)).collect(),
        }
    }

    pub fn set(&self, server: usize, mean: f64, at: Instant) {
        if let Some(s) = self.slots.get(server) {
            *s.lock().unwrap_or_else(|p| p.into_inner()) = Some((mean, at));
        }
    }

    pub fn set_hot(&self, server: usize, hot: PeerHot, at: Instant) {
        if let Some(s) = self.hot.get(server) {
            *s.lock().unwrap_or_else(|p| p.into_inner()) = Some((hot, at));
        }
    }

    /// What each server heard since `since` said of its keys competing for
    /// slots, by server id (`None`: `me`, or not heard lately).
    pub fn heats(&self, me: usize, since: Instant) -> Vec<Option<SlotHeat>> {
        let mut out = Vec::with_capacity(self.hot.len());
        for (i, s) in self.hot.iter().enumerate() {
            let g = s.lock().unwrap_or_else(|p| p.into_inner());
            out.push(g.as_ref().filter(|(_, at)| i != me && *at >= since).map(|(h, _)| h.heat.clone()));
        }
        out
    }

    /// The slots each other server heard since `since` said it would lend:
    /// whom a borrower asks (the lender decides what it grants).
    pub fn spare(&self, me: usize, since: Instant) -> Vec<(u16, usize)> {
        let mut out = Vec::new();
        for (i, s) in self.hot.iter().enumerate() {
            if i == me {
                continue;
            }
            if let Some((h, at)) = &*s.lock().unwrap_or_else(|p| p.into_inner()) {
                if *at >= since && h.spare > 0 {
                    out.push((i as u16, h.spare));
                }
            }
        }
        out
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
            let (seq, rec) = read_load(&mut r)?;
            after = after.max(seq);
            let now = Instant::now();
            shared.peer_loads.set(id, mean_load(&rec.snapshot, &cfg), now);
            if let Some(h) = rec.hot {
                shared.peer_loads.set_hot(id, h, now);
            }
        });
        if let Err(e) = r {
            tracing::debug!(server = id, "peer load: {e}");
            // The peer may have restarted: it numbers its epochs from 1
            // again, so ask from the first.
            after = 0;
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
    let s = shared.settings.peer_dialer(timeout).dial(addr, mbal_member::dial::Proto::Text)?;
    Ok(BufReader::new(s))
}

/// A peer's epoch record (`mbal load`): its snapshot and Phase 1's figures.
#[derive(Deserialize)]
struct PeerRecord {
    #[serde(flatten)]
    snapshot: EpochSnapshot,
    #[serde(default)]
    hot: Option<PeerHot>,
}

/// `LOAD <seq> <len>\r\n<json>\r\n`.
fn read_load(r: &mut BufReader<BlockingStream>) -> std::io::Result<(u64, PeerRecord)> {
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

    #[test]
    fn spare_slots_are_what_peers_heard_lately_left_free() {
        let p = PeerLoads::new(4);
        let t0 = Instant::now();
        let later = t0 + Duration::from_secs(1);
        let heat = |r: f64| SlotHeat { held: vec![r], waiting: vec![] };
        p.set_hot(1, PeerHot { spare: 6, heat: heat(1.0) }, later);
        p.set_hot(2, PeerHot { spare: 0, heat: heat(2.0) }, later);
        p.set_hot(3, PeerHot { spare: 9, heat: heat(3.0) }, t0);
        p.set_hot(0, PeerHot { spare: 9, heat: heat(4.0) }, later);
        let since = t0 + Duration::from_millis(500);
        assert_eq!(p.spare(0, since), vec![(1, 6)], "2 lends none, 3 is stale, 0 is me");
        assert_eq!(p.heats(0, since), vec![None, Some(heat(1.0)), Some(heat(2.0)), None], "0 is me, 3 is stale");
    }

    #[test]
    fn a_record_carries_phase_1s_slots_or_none() {
        let rec: PeerRecord = serde_json::from_str(
            r#"{"seq":3,"end_ns":1,"workers":[],"balancer":null,"hot":{"replicated":4,"cap":9,"spare":2,"epoch":3,"heat":{"held":[9.0,5.5],"waiting":[20.0]}},"hotkeys":[]}"#,
        )
        .unwrap();
        assert_eq!(rec.snapshot.seq, 3);
        let heat = SlotHeat { held: vec![9.0, 5.5], waiting: vec![20.0] };
        assert_eq!(rec.hot, Some(PeerHot { spare: 2, heat }));
        let before: PeerRecord =
            serde_json::from_str(r#"{"seq":3,"end_ns":1,"workers":[],"hot":{"replicated":4,"spare":2,"epoch":3}}"#)
                .unwrap();
        assert_eq!(before.hot, Some(PeerHot { spare: 2, heat: SlotHeat::default() }), "a record from before heat");
        let old: PeerRecord = serde_json::from_str(r#"{"seq":3,"end_ns":1,"workers":[],"hot":null}"#).unwrap();
        assert_eq!(old.hot, None);
    }
}
