//! The one place that knows the key space.
//!
//! * [`key_hash`] is the single stable 64-bit hash of key bytes used by the
//!   client, the server, the proxy and the simulator.
//! * A key's virtual node (VN) is taken from the *high* 32 bits of that hash
//!   ([`vn_of`]), so the low bits, from which a cachelet's index picks a
//!   key's home bucket, stay independent of the VN (the index's 16-bit tag
//!   is the top 16 bits, above the VN's bits for any power-of-two VN count up
//!   to 65,536). Every key of one cachelet shares a small set of VNs;
//!   deriving the VN from the bits the index uses would crowd those keys
//!   into the same buckets.
//! * VNs map to cachelets and cachelets to (server, worker) through a
//!   [`Layout`]; the initial assignment is deterministic and even.

mod map;

pub use map::{ClusterMap, ClusterSpec, MapDiff, ServerInfo, ServerSpec};
use serde::{Deserialize, Serialize};

/// Default number of virtual nodes for a cluster's life (DESIGN.md §2).
pub const DEFAULT_VN_COUNT: u32 = 16_384;
/// Default cachelets per worker (MBal §4.1).
pub const DEFAULT_CACHELETS_PER_WORKER: u32 = 16;

/// A cluster-wide cachelet id.
pub type CacheletId = u32;

/// The stable 64-bit key hash (XXH3-64, seed 0). Never change this: every
/// client and server of a cluster must agree on it.
#[inline]
pub fn key_hash(key: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(key)
}

/// The virtual node of a key hash: `(hash >> 32) % vn_count`.
#[inline]
pub fn vn_of(hash: u64, vn_count: u32) -> u32 {
    ((hash >> 32) as u32) % vn_count
}

/// Key-space geometry of one server or one cluster: how many VNs exist and
/// which cachelet serves each, and which worker owns each cachelet.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    vn_count: u32,
    /// VN -> cachelet id.
    vn_to_cachelet: Vec<CacheletId>,
    /// cachelet id -> (server index, worker index).
    cachelet_owner: Vec<(u16, u16)>,
}

impl Layout {
    /// The initial, even layout: `servers * workers * cachelets_per_worker`
    /// cachelets; cachelet `c` is served by server `c % servers`, worker
    /// `(c / servers) % workers`; VN `v` belongs to cachelet `v % cachelets`.
    /// Striping cachelets across servers first means consecutive VNs land on
    /// different servers and workers, and every worker gets exactly
    /// `cachelets_per_worker` cachelets.
    pub fn even(servers: u16, workers: u16, cachelets_per_worker: u32, vn_count: u32) -> Layout {
        assert!(servers > 0 && workers > 0 && cachelets_per_worker > 0);
        let cachelets = servers as u32 * workers as u32 * cachelets_per_worker;
        assert!(vn_count >= cachelets, "vn_count ({vn_count}) must be at least the number of cachelets ({cachelets})");
        let vn_to_cachelet = (0..vn_count).map(|v| v % cachelets).collect();
        let cachelet_owner = (0..cachelets)
            .map(|c| {
                let s = c % servers as u32;
                let w = (c / servers as u32) % workers as u32;
                (s as u16, w as u16)
            })
            .collect();
        Layout { vn_count, vn_to_cachelet, cachelet_owner }
    }

    pub fn vn_count(&self) -> u32 {
        self.vn_count
    }

    pub fn cachelet_count(&self) -> u32 {
        self.cachelet_owner.len() as u32
    }

    /// The cachelet that serves a key hash.
    #[inline]
    pub fn cachelet_of_hash(&self, hash: u64) -> CacheletId {
        self.vn_to_cachelet[vn_of(hash, self.vn_count) as usize]
    }

    /// The cachelet that serves a VN.
    #[inline]
    pub fn cachelet_of_vn(&self, vn: u32) -> CacheletId {
        self.vn_to_cachelet[vn as usize]
    }

    /// (server, worker) owning a cachelet.
    #[inline]
    pub fn owner(&self, c: CacheletId) -> (u16, u16) {
        self.cachelet_owner[c as usize]
    }

    /// Reassign a cachelet to another (server, worker).
    pub fn set_owner(&mut self, c: CacheletId, owner: (u16, u16)) {
        self.cachelet_owner[c as usize] = owner;
    }

    /// Cachelets owned by one (server, worker), in id order.
    pub fn cachelets_of(&self, server: u16, worker: u16) -> Vec<CacheletId> {
        (0..self.cachelet_count()).filter(|&c| self.cachelet_owner[c as usize] == (server, worker)).collect()
    }

    /// VNs served by a cachelet.
    pub fn vns_of(&self, c: CacheletId) -> Vec<u32> {
        (0..self.vn_count).filter(|&v| self.vn_to_cachelet[v as usize] == c).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn hash_is_stable() {
        // Pinned values: a change here breaks every deployed client.
        assert_eq!(key_hash(b""), 0x2d06800538d394c2);
        assert_eq!(key_hash(b"foo"), key_hash(b"foo"));
        assert_ne!(key_hash(b"foo"), key_hash(b"fop"));
    }

    #[test]
    fn vn_uses_high_bits() {
        assert_eq!(vn_of(0x0000_0001_ffff_ffff, 16), 1);
        assert_eq!(vn_of(0xffff_ffff, 16), 0);
    }

    proptest! {
        #[test]
        fn even_layout_is_balanced(servers in 1u16..6, workers in 1u16..5, cpw in 1u32..20) {
            let cachelets = servers as u32 * workers as u32 * cpw;
            let vn_count = cachelets * 7 + 3;
            let l = Layout::even(servers, workers, cpw, vn_count);
            prop_assert_eq!(l.cachelet_count(), cachelets);
            for s in 0..servers {
                for w in 0..workers {
                    prop_assert_eq!(l.cachelets_of(s, w).len() as u32, cpw);
                }
            }
            // Every VN has exactly one cachelet, and VN counts differ by at most one.
            let mut per = vec![0u32; cachelets as usize];
            for v in 0..vn_count { per[l.cachelet_of_vn(v) as usize] += 1; }
            let (min, max) = (per.iter().min().unwrap(), per.iter().max().unwrap());
            prop_assert!(max - min <= 1);
        }

        #[test]
        fn keys_route_to_valid_cachelets(key in proptest::collection::vec(any::<u8>(), 0..64)) {
            let l = Layout::even(2, 2, 16, DEFAULT_VN_COUNT);
            let c = l.cachelet_of_hash(key_hash(&key));
            prop_assert!(c < l.cachelet_count());
        }
    }
}
