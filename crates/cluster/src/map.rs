//! The cluster map: the layout (VN -> cachelet -> (server, worker)) plus the
//! servers' addresses and an epoch that only grows. Every change to an owner
//! bumps the epoch; a [`MapDiff`] carries the changes between two epochs.

use crate::{CacheletId, Layout, DEFAULT_CACHELETS_PER_WORKER, DEFAULT_VN_COUNT};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;

/// A cluster as described in its TOML file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSpec {
    /// Virtual nodes in the key space (fixed for the cluster's life).
    #[serde(default = "default_vn_count")]
    pub vn_count: u32,
    /// Cachelets per worker.
    #[serde(default = "default_cpw")]
    pub cachelets_per_worker: u32,
    /// Workers per server.
    pub workers: u16,
    /// The servers, in id order (server id = index).
    pub servers: Vec<ServerSpec>,
}

fn default_vn_count() -> u32 {
    DEFAULT_VN_COUNT
}
fn default_cpw() -> u32 {
    DEFAULT_CACHELETS_PER_WORKER
}

/// One server: its main (memcached) address and its workers' ports.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSpec {
    /// host:port of the main port.
    pub addr: SocketAddr,
    /// First per-worker port, if the server has worker ports (worker i
    /// listens on worker_port_base + i). Without them routed clients reach
    /// worker i through the main port (`mbal hello <epoch> <i>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_port_base: Option<u16>,
}

impl ClusterSpec {
    pub fn from_toml(text: &str) -> Result<ClusterSpec, String> {
        let s: ClusterSpec = toml::from_str(text).map_err(|e| e.to_string())?;
        s.validate()?;
        Ok(s)
    }

    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("spec serialises")
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.servers.is_empty() {
            return Err("a cluster needs at least one server".into());
        }
        if self.servers.len() > u16::MAX as usize {
            return Err("too many servers".into());
        }
        if self.workers == 0 || self.cachelets_per_worker == 0 {
            return Err("workers and cachelets_per_worker must be at least 1".into());
        }
        let cachelets = self.servers.len() as u64 * self.workers as u64 * self.cachelets_per_worker as u64;
        if (self.vn_count as u64) < cachelets {
            return Err(format!("vn_count {} is smaller than the number of cachelets {cachelets}", self.vn_count));
        }
        Ok(())
    }
}

/// Where a server and its workers listen.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerInfo {
    pub main: SocketAddr,
    pub workers: Vec<SocketAddr>,
}

/// The cluster map at one epoch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterMap {
    epoch: u64,
    layout: Layout,
    servers: Vec<ServerInfo>,
}

/// The owner changes between two epochs of one map.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MapDiff {
    pub from_epoch: u64,
    pub to_epoch: u64,
    /// (cachelet, new (server, worker)).
    pub moves: Vec<(CacheletId, (u16, u16))>,
}

impl ClusterMap {
    /// The initial map of a spec (epoch 1): deterministic and even.
    pub fn from_spec(spec: &ClusterSpec) -> ClusterMap {
        let layout = Layout::even(spec.servers.len() as u16, spec.workers, spec.cachelets_per_worker, spec.vn_count);
        let servers = spec
            .servers
            .iter()
            .map(|s| ServerInfo {
                main: s.addr,
                workers: (0..spec.workers)
                    .map(|w| match s.worker_port_base {
                        Some(base) => SocketAddr::new(s.addr.ip(), base + w),
                        None => s.addr,
                    })
                    .collect(),
            })
            .collect();
        ClusterMap { epoch: 1, layout, servers }
    }

    /// A map from parts (e.g. a single server whose worker ports were
    /// chosen by the OS). Epoch 1.
    pub fn new(layout: Layout, servers: Vec<ServerInfo>) -> ClusterMap {
        ClusterMap { epoch: 1, layout, servers }
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn servers(&self) -> &[ServerInfo] {
        &self.servers
    }

    /// Address of a worker's own port.
    pub fn worker_addr(&self, server: u16, worker: u16) -> SocketAddr {
        self.servers[server as usize].workers[worker as usize]
    }

    /// Hash -> (cachelet, server, worker).
    #[inline]
    pub fn route(&self, hash: u64) -> (CacheletId, u16, u16) {
        let c = self.layout.cachelet_of_hash(hash);
        let (s, w) = self.layout.owner(c);
        (c, s, w)
    }

    /// Move a cachelet to a new owner; bumps the epoch. Returns the new epoch.
    pub fn move_cachelet(&mut self, c: CacheletId, to: (u16, u16)) -> u64 {
        assert!((to.0 as usize) < self.servers.len(), "no server {}", to.0);
        assert!((to.1 as usize) < self.servers[to.0 as usize].workers.len(), "no worker {} on server {}", to.1, to.0);
        self.layout.set_owner(c, to);
        self.epoch += 1;
        self.epoch
    }

    /// The moves that turn `self` into `newer` (same geometry, newer epoch).
    pub fn diff(&self, newer: &ClusterMap) -> MapDiff {
        assert_eq!(self.layout.cachelet_count(), newer.layout.cachelet_count(), "maps of different clusters");
        let moves = (0..self.layout.cachelet_count())
            .filter(|&c| self.layout.owner(c) != newer.layout.owner(c))
            .map(|c| (c, newer.layout.owner(c)))
            .collect();
        MapDiff { from_epoch: self.epoch, to_epoch: newer.epoch, moves }
    }

    /// Apply a diff. A diff from another epoch than ours is refused (the
    /// caller fetches the full map instead); an older diff is a no-op.
    pub fn apply(&mut self, d: &MapDiff) -> Result<(), String> {
        if d.to_epoch <= self.epoch {
            return Ok(());
        }
        if d.from_epoch != self.epoch {
            return Err(format!("diff {}->{} does not apply to epoch {}", d.from_epoch, d.to_epoch, self.epoch));
        }
        for &(c, owner) in &d.moves {
            if c >= self.layout.cachelet_count() {
                return Err(format!("diff names cachelet {c}, the map has {}", self.layout.cachelet_count()));
            }
            self.layout.set_owner(c, owner);
        }
        self.epoch = d.to_epoch;
        Ok(())
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("map serialises")
    }

    pub fn from_json(s: &str) -> Result<ClusterMap, String> {
        serde_json::from_str(s).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn spec(n: u16, w: u16, cpw: u32) -> ClusterSpec {
        ClusterSpec {
            vn_count: 4096,
            cachelets_per_worker: cpw,
            workers: w,
            servers: (0..n)
                .map(|i| ServerSpec {
                    addr: format!("127.0.0.1:{}", 20000 + i * 100).parse().unwrap(),
                    worker_port_base: Some(20001 + i * 100),
                })
                .collect(),
        }
    }

    #[test]
    fn toml_round_trip() {
        let s = spec(3, 2, 4);
        let t = s.to_toml();
        assert_eq!(ClusterSpec::from_toml(&t).unwrap(), s);
        assert!(ClusterSpec::from_toml("workers = 2\nservers = []\n").is_err());
        assert!(ClusterSpec::from_toml("workers = 2\nbogus = 1\nservers = []\n").is_err());
    }

    #[test]
    fn same_spec_same_map() {
        let a = ClusterMap::from_spec(&spec(4, 2, 16));
        let b = ClusterMap::from_spec(&spec(4, 2, 16));
        assert_eq!(a, b);
        assert_eq!(a.epoch(), 1);
        assert_eq!(a.worker_addr(1, 1).port(), 20102);
    }

    #[test]
    fn stale_diff_is_refused() {
        let a = ClusterMap::from_spec(&spec(2, 2, 2));
        let mut b = a.clone();
        b.move_cachelet(0, (1, 1));
        let mut c = b.clone();
        c.move_cachelet(1, (0, 0));
        let d = b.diff(&c);
        let mut x = a.clone();
        assert!(x.apply(&d).is_err(), "diff from epoch 2 onto epoch 1");
        let mut y = b.clone();
        y.apply(&d).unwrap();
        assert_eq!(y, c);
        y.apply(&d).unwrap(); // replay is a no-op
        assert_eq!(y, c);
    }

    proptest! {
        #[test]
        fn diffs_apply(moves in proptest::collection::vec((0u32..32, 0u16..4, 0u16..2), 0..20)) {
            let base = ClusterMap::from_spec(&spec(4, 2, 4));
            let mut newer = base.clone();
            for (c, s, w) in moves {
                newer.move_cachelet(c, (s, w));
            }
            prop_assert!(newer.epoch() >= base.epoch());
            let d = base.diff(&newer);
            let mut x = base.clone();
            x.apply(&d).unwrap();
            prop_assert_eq!(x.layout(), newer.layout());
            prop_assert_eq!(x.epoch(), newer.epoch());
            // Every cachelet has exactly one owner, on a real worker.
            for c in 0..x.layout().cachelet_count() {
                let (s, w) = x.layout().owner(c);
                prop_assert!(s < 4 && w < 2);
            }
            // JSON round trip.
            prop_assert_eq!(ClusterMap::from_json(&x.to_json()).unwrap(), x);
        }
    }
}
