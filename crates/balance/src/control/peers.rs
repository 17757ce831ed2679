//! What the other servers' epoch records said, as the core heard them
//! ([`Event::PeerLoad`](super::Event::PeerLoad)): each one's mean load per
//! worker (Phase 1's cluster mean) and its Phase 1 figures (the REPL_high
//! slots it would lend and the heat of its keys). A record counts while it
//! is recent: heard at or after the `since` its reader names (the last
//! three epochs, `ControlCore::heard_since`).

use crate::hot::SlotHeat;
use serde::Deserialize;
use std::collections::BTreeMap;

/// What a peer's epoch record says of its REPL_high slots (the fields of
/// its `hot` decision, `ReplicaDecision`): what it would lend (0 while it
/// holds a loan itself or lends none).
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
pub struct PeerHot {
    #[serde(default)]
    pub spare: usize,
    /// The rates of its keys with copies and keys waiting, by which the
    /// servers lend (`entitlements`).
    #[serde(default)]
    pub heat: SlotHeat,
}

/// Each server's last record, by server id, with when it was heard (ns).
/// Sparse: a core holds what it heard, not a slot per server of the
/// cluster (two per server made 1 MB a core at 10,000 servers, 10 GB for
/// `mbal sim`'s 10,000 cores); records older than the reader's `since`
/// can be dropped ([`PeerRecords::forget_before`]).
#[derive(Clone, Debug, Default)]
pub struct PeerRecords {
    servers: usize,
    means: BTreeMap<u16, (f64, u64)>,
    hot: BTreeMap<u16, (PeerHot, u64)>,
}

impl PeerRecords {
    pub fn new(servers: usize) -> PeerRecords {
        PeerRecords { servers, means: BTreeMap::new(), hot: BTreeMap::new() }
    }

    /// Server `server`'s record heard at `at`: its mean load and, when it
    /// carries them, its Phase 1 figures.
    pub fn heard(&mut self, server: u16, mean: f64, hot: Option<PeerHot>, at: u64) {
        if usize::from(server) >= self.servers {
            return;
        }
        self.means.insert(server, (mean, at));
        if let Some(h) = hot {
            self.hot.insert(server, (h, at));
        }
    }

    /// Drop every record heard before `since` (none of them counts any more).
    pub fn forget_before(&mut self, since: u64) {
        self.means.retain(|_, (_, at)| *at >= since);
        self.hot.retain(|_, (_, at)| *at >= since);
    }

    /// What each server heard since `since` said of its keys competing for
    /// slots, by server id (`None`: `me`, or not heard lately).
    pub fn heats(&self, me: usize, since: u64) -> Vec<Option<SlotHeat>> {
        let mut v = vec![None; self.servers];
        for (&i, (h, at)) in &self.hot {
            if usize::from(i) != me && *at >= since {
                v[usize::from(i)] = Some(h.heat.clone());
            }
        }
        v
    }

    /// The slots each other server heard since `since` said it would lend:
    /// whom a borrower asks (the lender decides what it grants).
    pub fn spare(&self, me: usize, since: u64) -> Vec<(u16, usize)> {
        (self.hot.iter())
            .filter(|(&i, (h, at))| usize::from(i) != me && *at >= since && h.spare > 0)
            .map(|(&i, (h, _))| (i, h.spare))
            .collect()
    }

    /// The cluster's mean load per worker: this server's (`own`) and every
    /// other server's heard since `since`, all servers having as many
    /// workers. `None` until some other server has been heard.
    pub fn cluster_mean(&self, me: usize, own: f64, since: u64) -> Option<f64> {
        let (mut sum, mut n) = (own, 1usize);
        for (&i, &(mean, at)) in &self.means {
            if usize::from(i) != me && at >= since {
                sum += mean;
                n += 1;
            }
        }
        (n > 1).then(|| sum / n as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn cluster_mean_counts_servers_heard_lately() {
        let mut p = PeerRecords::new(3);
        let t0 = 10 * S;
        assert_eq!(p.cluster_mean(0, 500.0, t0), None, "nobody heard yet");
        p.heard(1, 800.0, None, t0 + S);
        assert_eq!(p.cluster_mean(0, 500.0, t0), Some(650.0));
        p.heard(2, 200.0, None, t0);
        assert_eq!(p.cluster_mean(0, 500.0, t0), Some(500.0));
        assert_eq!(p.cluster_mean(0, 500.0, t0 + S / 2), Some(650.0), "server 2 is stale");
        p.heard(0, 1e9, None, t0 + S);
        assert_eq!(p.cluster_mean(0, 500.0, t0 + S / 2), Some(650.0), "its own slot is not read");
        p.heard(9, 1e9, None, t0 + S);
        assert_eq!(p.cluster_mean(0, 500.0, t0 + S / 2), Some(650.0), "no such server");
        p.forget_before(t0 + S / 2);
        assert_eq!(p.cluster_mean(0, 500.0, t0), Some(650.0), "server 2's stale record is gone");
        assert_eq!((p.means.len(), p.hot.len()), (2, 0));
    }

    #[test]
    fn spare_slots_are_what_peers_heard_lately_left_free() {
        let mut p = PeerRecords::new(4);
        let t0 = 10 * S;
        let later = t0 + S;
        let heat = |r: f64| SlotHeat { held: vec![r], waiting: vec![] };
        p.heard(1, 0.0, Some(PeerHot { spare: 6, heat: heat(1.0) }), later);
        p.heard(2, 0.0, Some(PeerHot { spare: 0, heat: heat(2.0) }), later);
        p.heard(3, 0.0, Some(PeerHot { spare: 9, heat: heat(3.0) }), t0);
        p.heard(0, 0.0, Some(PeerHot { spare: 9, heat: heat(4.0) }), later);
        let since = t0 + S / 2;
        assert_eq!(p.spare(0, since), vec![(1, 6)], "2 lends none, 3 is stale, 0 is me");
        assert_eq!(p.heats(0, since), vec![None, Some(heat(1.0)), Some(heat(2.0)), None], "0 is me, 3 is stale");
        // A record without Phase 1's figures keeps the last ones.
        p.heard(1, 0.0, None, later + S);
        assert_eq!(p.spare(0, since), vec![(1, 6)]);
    }
}
