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
/// `(server, worker)` lives, in a cluster of `servers` servers of `workers`
/// workers each (RIKR, SPORE §3.1; NetKV §IV-C): always on another server
/// than the home; replicas 1..=servers−1 on distinct servers (starting at
/// one derived from the hash), further ones on further workers of those
/// servers, so the first (servers−1)·workers replicas are all distinct.
/// `None` for i = 0 (the home itself), for i past that, or when there is
/// no other server.
pub fn replica_location(key_hash: u64, i: u32, home: (u16, u16), servers: u16, workers: u16) -> Option<(u16, u16)> {
    let others = u32::from(servers.checked_sub(1)?);
    if i == 0 || others == 0 || workers == 0 || i > others * u32::from(workers) {
        return None;
    }
    let h = mix(key_hash);
    let start = (h % u64::from(others)) as u32;
    let j = (start + (i - 1)) % others;
    let round = (i - 1) / others;
    let server = ((u32::from(home.0) + 1 + j) % u32::from(servers)) as u16;
    let base = mix(h ^ u64::from(server));
    let worker = ((base + u64::from(round)) % u64::from(workers)) as u16;
    Some((server, worker))
}
