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
//! * VNs map to cachelets through the fixed [`KeySpace`]; cachelets map to
//!   (server, worker) through the owners of a [`ClusterMap`], which change
//!   and carry the map's epoch. The initial assignment is deterministic and
//!   even.
//! * The [`Router`] is the client side of routing, with no I/O: the map, the
//!   owners learned from redirects, and the split of a multi-key request by
//!   destination. The routing client, the bench and the proxy share it.
//! * [`Leases`] is the client side of Phase 1's hot-key replicas, with no
//!   I/O and no clock: the leases granted by `RH hot` hints and the copy
//!   each one reads. Shared likewise.
//! * [`Health`] is the servers a caller could not reach, with no I/O and no
//!   clock: each one's backoff (its keys are answered as misses or errors
//!   meanwhile) and when to fetch the map from another server. Shared
//!   likewise.
//!
//! No I/O and no TLS here: the cluster file, dialing a member and peer
//! authentication live in `mbal-member`.

mod health;
mod leases;
mod map;
mod owners;
mod replica;
mod router;

pub use health::{closed_kind, unreachable_kind, Failed, Health, UNREACHABLE_BACKOFF_MAX, UNREACHABLE_BACKOFF_MIN};
pub use leases::{Lease, Leases, COPY_RETRY, DEFAULT_MAX_LEASES};
pub use map::{parse_u32_array, ClusterMap, MapDiff, ServerInfo};
pub use owners::{Owners, CHUNK};
pub use replica::{most_replicas, replica_location};
pub use router::{BadRedirect, Group, Learned, Redirect, Router, Split};

/// The one redirect rule of every routing component (the client, the
/// bench, the proxy, the server's forwarder): a request follows at most
/// this many redirects (`RD`) and fails on the next, with the error its
/// caller reports for a redirect it cannot follow. A stale map costs one
/// redirect; a cachelet that moves again while a request travels, one
/// more; four leave room for a Phase 2 move, a Phase 3 move and a stale
/// map at once, and still stop a ping-pong between two confused servers.
pub const MAX_REDIRECTS: u8 = 4;

/// May a request that has followed `followed` redirects follow another?
#[inline]
pub fn may_follow_redirect(followed: u32) -> bool {
    followed < u32::from(MAX_REDIRECTS)
}

/// Default number of virtual nodes for a cluster's life (DESIGN.md §2).
pub const DEFAULT_VN_COUNT: u32 = 16_384;
/// Default cachelets per worker (MBal §4.1).
pub const DEFAULT_CACHELETS_PER_WORKER: u32 = 16;

/// A cluster-wide cachelet id.
pub type CacheletId = u32;

/// (server id, worker index): who serves a cachelet.
pub type Owner = (u16, u16);

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

/// The fixed half of the key space: how many VNs exist and which cachelet
/// serves each. It never changes for a cluster's life, so a component that
/// only needs "which cachelet does this key belong to" holds a `KeySpace`
/// and cannot read an owner that went stale. Who owns each cachelet (which
/// changes) lives in the [`ClusterMap`], with the map's epoch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeySpace {
    vn_count: u32,
    cachelets: u32,
    /// VN -> cachelet id.
    vn_to_cachelet: Vec<CacheletId>,
}

impl KeySpace {
    /// The even key space: VN `v` belongs to cachelet `v % cachelets`.
    pub fn even(cachelets: u32, vn_count: u32) -> KeySpace {
        assert!(cachelets > 0, "a key space needs at least one cachelet");
        assert!(vn_count >= cachelets, "vn_count ({vn_count}) must be at least the number of cachelets ({cachelets})");
        KeySpace { vn_count, cachelets, vn_to_cachelet: (0..vn_count).map(|v| v % cachelets).collect() }
    }

    /// A key space from its VN -> cachelet table (e.g. received in a map).
    /// Every cachelet id must be below `cachelets`.
    pub fn from_table(vn_to_cachelet: Vec<CacheletId>, cachelets: u32) -> Result<KeySpace, String> {
        if vn_to_cachelet.is_empty() || vn_to_cachelet.len() > u32::MAX as usize {
            return Err(format!("a key space of {} VNs", vn_to_cachelet.len()));
        }
        if let Some(c) = vn_to_cachelet.iter().find(|&&c| c >= cachelets) {
            return Err(format!("VN table names cachelet {c}, there are {cachelets}"));
        }
        Ok(KeySpace { vn_count: vn_to_cachelet.len() as u32, cachelets, vn_to_cachelet })
    }

    pub fn vn_count(&self) -> u32 {
        self.vn_count
    }

    pub fn cachelet_count(&self) -> u32 {
        self.cachelets
    }

    /// The cachelet that serves a key hash.
    #[inline]
    pub fn cachelet_of_hash(&self, hash: u64) -> CacheletId {
        self.vn_to_cachelet[vn_of(hash, self.vn_count) as usize]
    }

    /// The cachelet that serves a key.
    #[inline]
    pub fn cachelet_of_key(&self, key: &[u8]) -> CacheletId {
        self.cachelet_of_hash(key_hash(key))
    }

    /// The cachelet that serves a VN.
    #[inline]
    pub fn cachelet_of_vn(&self, vn: u32) -> CacheletId {
        self.vn_to_cachelet[vn as usize]
    }

    /// VNs served by a cachelet.
    pub fn vns_of(&self, c: CacheletId) -> Vec<u32> {
        (0..self.vn_count).filter(|&v| self.vn_to_cachelet[v as usize] == c).collect()
    }

    /// The VN -> cachelet table.
    pub fn table(&self) -> &[CacheletId] {
        &self.vn_to_cachelet
    }
}

/// The initial, even owners of `servers * workers * cachelets_per_worker`
/// cachelets: cachelet `c` is served by server `c % servers`, worker
/// `(c / servers) % workers`. Striping cachelets across servers first means
/// consecutive VNs (see [`KeySpace::even`]) land on different servers and
/// workers, and every worker gets exactly `cachelets_per_worker` cachelets.
pub fn even_owners(servers: u16, workers: u16, cachelets_per_worker: u32) -> Vec<Owner> {
    assert!(servers > 0 && workers > 0 && cachelets_per_worker > 0);
    let cachelets = servers as u32 * workers as u32 * cachelets_per_worker;
    (0..cachelets)
        .map(|c| {
            let s = c % servers as u32;
            let w = (c / servers as u32) % workers as u32;
            (s as u16, w as u16)
        })
        .collect()
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
    fn key_space_from_table_is_checked() {
        let k = KeySpace::even(4, 16);
        assert_eq!(KeySpace::from_table(k.table().to_vec(), 4).unwrap(), k);
        assert!(KeySpace::from_table(vec![0, 1, 4], 4).is_err());
        assert!(KeySpace::from_table(vec![], 4).is_err());
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
            let l = KeySpace::even(cachelets, vn_count);
            let owners = even_owners(servers, workers, cpw);
            prop_assert_eq!(l.cachelet_count(), cachelets);
            prop_assert_eq!(owners.len() as u32, cachelets);
            for s in 0..servers {
                for w in 0..workers {
                    prop_assert_eq!(owners.iter().filter(|&&o| o == (s, w)).count() as u32, cpw);
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
            let l = KeySpace::even(64, DEFAULT_VN_COUNT);
            let c = l.cachelet_of_hash(key_hash(&key));
            prop_assert!(c < l.cachelet_count());
            prop_assert_eq!(c, l.cachelet_of_key(&key));
            prop_assert!(l.vns_of(c).contains(&vn_of(key_hash(&key), l.vn_count())));
        }
    }
}
