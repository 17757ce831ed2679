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
//! Each record goes to the controller ([`CtlMsg::PeerLoad`]), whose core
//! keeps it with the time it was heard (`mbal_balance::control::PeerRecords`).
//!
//! Off the data path: a peer's epoch record is a few KB once per epoch.

use crate::msg::CtlMsg;
use crate::shared::Shared;
use mbal_balance::control::phase1::mean_load;
use mbal_balance::{Config, EpochSnapshot, PeerHot};
use mbal_member::call::MemberConn;
use mbal_proto::client::Reply;
use serde::Deserialize;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Start one polling thread per other server (detached: each ends within a
/// read timeout of shutdown).
pub(crate) fn spawn(shared: Arc<Shared>, servers: Vec<SocketAddr>, cfg: Config) -> std::io::Result<()> {
    for (id, addr) in servers.into_iter().enumerate() {
        if id == usize::from(shared.server_id) {
            continue;
        }
        let (shared, cfg) = (shared.clone(), cfg.clone());
        std::thread::Builder::new().name(format!("mbal-peerload-{id}")).spawn(move || {
            let _watch = shared.life.watch();
            poll(shared.clone(), id, addr, cfg)
        })?;
    }
    Ok(())
}

fn poll(shared: Arc<Shared>, id: usize, addr: SocketAddr, cfg: Config) {
    let epoch = Duration::from_millis(shared.settings.epoch_ms.max(1));
    let timeout = epoch * 2 + Duration::from_secs(1);
    let mut after = 0u64;
    while !shared.shutdown.load(Ordering::Relaxed) {
        let r = connect(&shared, addr, timeout).and_then(|mut c| loop {
            if shared.shutdown.load(Ordering::Relaxed) {
                return Ok(());
            }
            let (seq, rec) = read_load(c.call(format!("mbal load {after}\r\n").as_bytes())?)?;
            after = after.max(seq);
            let mean = mean_load(&rec.snapshot, &cfg);
            shared.tell_controller(CtlMsg::PeerLoad { server: id as u16, mean, hot: rec.hot });
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

fn connect(shared: &Shared, addr: SocketAddr, timeout: Duration) -> std::io::Result<MemberConn> {
    // `mbal load` is a control command: the peer dialer speaks TLS when the
    // cluster does and proves membership (`mbal peer`) when there is a secret.
    MemberConn::dial(&shared.settings.peer_dialer(timeout), addr)
}

/// A peer's epoch record (`mbal load`): its snapshot and Phase 1's figures.
#[derive(Deserialize)]
struct PeerRecord {
    #[serde(flatten)]
    snapshot: EpochSnapshot,
    #[serde(default)]
    hot: Option<PeerHot>,
}

/// The answer to `mbal load` (`LOAD <seq> <len>` and the JSON, read by the
/// one reply codec): its sequence number and record.
fn read_load(answer: Reply) -> std::io::Result<(u64, PeerRecord)> {
    match answer {
        Reply::Load { seq, json } => Ok((seq, serde_json::from_slice(&json).map_err(std::io::Error::other)?)),
        other => Err(std::io::Error::other(format!("unexpected answer to mbal load: {other:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mbal_balance::SlotHeat;

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
