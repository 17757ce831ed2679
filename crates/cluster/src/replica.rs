//! Where the replicas of a hot key live (Phase 1, DESIGN.md §6): one rule
//! shared by the server that places them and every client that reads them.

/// splitmix64's finaliser: a well-mixed 64-bit function of `x`.
pub(crate) fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Where replica `i` (1..=γ) of the key with hash `key_hash` and home
/// `(server, worker)` lives, in a cluster of `servers` servers where server `s` has
/// `workers_of(s)` workers (servers may differ; the map says: [`crate::ClusterMap`]'s
/// `servers()[s].workers`) (RIKR, SPORE §3.1; NetKV §IV-C): always on another server
/// than the home; replicas 1..=servers−1 on distinct servers (starting at
/// one derived from the hash), further ones on further workers of those
/// servers (round r on its r-th worker from a hash-derived one), so no two replicas share
/// a worker. `None` for i = 0 (the home itself), when there is no other server, and for a
/// round past the workers of the server it falls on (with servers of equal size: every
/// i past (servers−1)·workers). The server that places copies and every client that reads
/// them must pass the same map's sizes.
pub fn replica_location(
    key_hash: u64,
    i: u32,
    home: (u16, u16),
    servers: u16,
    workers_of: impl Fn(u16) -> u16,
) -> Option<(u16, u16)> {
    let others = u32::from(servers.checked_sub(1)?);
    if i == 0 || others == 0 {
        return None;
    }
    let h = mix(key_hash);
    let start = (h % u64::from(others)) as u32;
    let j = (start + (i - 1)) % others;
    let round = (i - 1) / others;
    let server = ((u32::from(home.0) + 1 + j) % u32::from(servers)) as u16;
    let workers = workers_of(server);
    if round >= u32::from(workers) {
        return None;
    }
    let base = mix(h ^ u64::from(server));
    let worker = ((base + u64::from(round)) % u64::from(workers)) as u16;
    Some((server, worker))
}

/// The most replicas a key homed on server `home` can have at distinct workers: one on
/// every worker of every other server.
pub fn most_replicas(home: u16, servers: u16, workers_of: impl Fn(u16) -> u16) -> u32 {
    (0..servers).filter(|&s| s != home).map(|s| u32::from(workers_of(s))).sum()
}
