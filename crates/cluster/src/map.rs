//! The cluster map: the fixed key space (VN -> cachelet), the owners
//! (cachelet -> (server, worker)), the servers' addresses and an epoch that
//! only grows. Every change to an owner bumps the epoch; a [`MapDiff`]
//! carries the changes between two epochs.

use crate::{even_owners, CacheletId, KeySpace, Owner, Owners};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::sync::Arc;

/// Where a server and its workers listen.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerInfo {
    pub main: SocketAddr,
    pub workers: Vec<SocketAddr>,
}

/// The cluster map at one epoch: the fixed [`KeySpace`] plus the owners,
/// which change (each change bumps the epoch).
///
/// On the wire (`mbal map`) it is JSON: `epoch`, `layout` with `vn_count`,
/// `vn_to_cachelet` and `cachelet_owner` (`[server, worker]` pairs), and
/// `servers`. A map read from JSON is checked: every owner names a worker
/// of the map, every VN a cachelet.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "MapWire", into = "MapWire")]
pub struct ClusterMap {
    epoch: u64,
    /// The key space, the owners and the servers are shared between the copies of a map
    /// until one changes (a map is copied into every holder: [`Owners`] says why).
    keyspace: Arc<KeySpace>,
    /// cachelet id -> (server index, worker index).
    owners: Owners,
    servers: Arc<Vec<ServerInfo>>,
}

/// The JSON form of a [`ClusterMap`] (see there).
#[derive(Clone, Serialize, Deserialize)]
struct MapWire {
    epoch: u64,
    layout: LayoutWire,
    servers: Vec<ServerInfo>,
}

#[derive(Clone, Serialize, Deserialize)]
struct LayoutWire {
    vn_count: u32,
    #[serde(deserialize_with = "vn_table")]
    vn_to_cachelet: Vec<CacheletId>,
    cachelet_owner: Vec<Owner>,
}

/// The VN table: most of a map's JSON (16,384 numbers at 4 x 2, 65,536 at 100 x 16), and
/// nearly all of its parse time through serde's generic sequence path (0.46 ms of 0.48 at 4 x
/// 2: ~30 ns a number), paid by every server, client and proxy thread that takes a new map,
/// all at once when a server dies. The plain form the map writes (digits, commas, white space)
/// is read by [`parse_u32_array`]; anything else by serde_json as before, with its errors.
fn vn_table<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<CacheletId>, D::Error> {
    let raw = <Box<serde_json::value::RawValue>>::deserialize(d)?;
    match parse_u32_array(raw.get()) {
        Some(v) => Ok(v),
        None => serde_json::from_str(raw.get()).map_err(serde::de::Error::custom),
    }
}

/// A JSON array of unsigned 32-bit integers in plain form (`[1, 22,333]`: decimal digits
/// without a sign, exponent or leading zero, JSON white space between), or `None` for any
/// other text (which may still be JSON that serde_json reads: the caller falls back to it).
/// Where it answers `Some`, serde_json reads the same numbers (the fuzz target `fuzz_map`).
pub fn parse_u32_array(s: &str) -> Option<Vec<u32>> {
    let b = s.as_bytes();
    let ws = |i: &mut usize| {
        while *i < b.len() && matches!(b[*i], b' ' | b'\t' | b'\n' | b'\r') {
            *i += 1;
        }
    };
    let mut i = 0;
    ws(&mut i);
    if b.get(i) != Some(&b'[') {
        return None;
    }
    i += 1;
    // a number takes at least two bytes with its comma: a bound, not a guess
    let mut out = Vec::with_capacity(b.len() / 2);
    ws(&mut i);
    if b.get(i) == Some(&b']') {
        i += 1;
    } else {
        loop {
            let start = i;
            let mut n: u64 = 0;
            while i < b.len() && b[i].is_ascii_digit() && i - start < 11 {
                n = n * 10 + u64::from(b[i] - b'0');
                i += 1;
            }
            let len = i - start;
            if len == 0 || len > 10 || (len > 1 && b[start] == b'0') || n > u64::from(u32::MAX) {
                return None;
            }
            out.push(n as u32);
            ws(&mut i);
            match b.get(i) {
                Some(b',') => i += 1,
                Some(b']') => {
                    i += 1;
                    break;
                }
                _ => return None,
            }
            ws(&mut i);
        }
    }
    ws(&mut i);
    (i == b.len()).then_some(out)
}

impl From<ClusterMap> for MapWire {
    fn from(m: ClusterMap) -> MapWire {
        let layout = LayoutWire {
            vn_count: m.keyspace.vn_count(),
            vn_to_cachelet: m.keyspace.table().to_vec(),
            cachelet_owner: m.owners.to_vec(),
        };
        MapWire { epoch: m.epoch, layout, servers: m.servers.to_vec() }
    }
}

impl TryFrom<MapWire> for ClusterMap {
    type Error = String;
    fn try_from(w: MapWire) -> Result<ClusterMap, String> {
        let l = w.layout;
        if l.vn_to_cachelet.len() != l.vn_count as usize {
            return Err(format!("vn_count {} but {} VNs in the table", l.vn_count, l.vn_to_cachelet.len()));
        }
        let keyspace = KeySpace::from_table(l.vn_to_cachelet, l.cachelet_owner.len() as u32)?;
        ClusterMap::checked(w.epoch, keyspace, l.cachelet_owner, w.servers)
    }
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
    /// The initial, even map (epoch 1) of servers that all have the same
    /// number of workers (e.g. a single server whose worker ports were
    /// chosen by the OS): see [`KeySpace::even`] and [`even_owners`].
    pub fn even(servers: Vec<ServerInfo>, cachelets_per_worker: u32, vn_count: u32) -> ClusterMap {
        let workers = servers.first().map_or(0, |s| s.workers.len());
        assert!(servers.iter().all(|s| s.workers.len() == workers), "servers with different worker counts");
        assert!(servers.len() <= u16::MAX as usize && workers <= u16::MAX as usize);
        let owners = even_owners(servers.len() as u16, workers as u16, cachelets_per_worker);
        ClusterMap::new(KeySpace::even(owners.len() as u32, vn_count), owners, servers)
    }

    /// A map from parts, epoch 1. Panics unless there is one owner per
    /// cachelet and every owner is a worker of `servers`.
    pub fn new(keyspace: KeySpace, owners: Vec<Owner>, servers: Vec<ServerInfo>) -> ClusterMap {
        ClusterMap::checked(1, keyspace, owners, servers).unwrap_or_else(|e| panic!("{e}"))
    }

    fn checked(
        epoch: u64,
        keyspace: KeySpace,
        owners: Vec<Owner>,
        servers: Vec<ServerInfo>,
    ) -> Result<ClusterMap, String> {
        if owners.len() != keyspace.cachelet_count() as usize {
            return Err(format!("{} owners for {} cachelets", owners.len(), keyspace.cachelet_count()));
        }
        let m = ClusterMap { epoch, keyspace: Arc::new(keyspace), owners: owners.into(), servers: Arc::new(servers) };
        if let Some((c, &(s, w))) = m.owners.iter().enumerate().find(|(_, &o)| !m.has_worker(o)) {
            return Err(format!("cachelet {c} is owned by server {s} worker {w}, which the map does not have"));
        }
        Ok(m)
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The fixed key space (VN -> cachelet).
    pub fn keyspace(&self) -> &KeySpace {
        &self.keyspace
    }

    pub fn cachelet_count(&self) -> u32 {
        self.keyspace.cachelet_count()
    }

    /// (server, worker) owning a cachelet at this epoch.
    #[inline]
    pub fn owner(&self, c: CacheletId) -> Owner {
        self.owners.get(c as usize)
    }

    /// Every cachelet's owner, by cachelet id.
    pub fn owners(&self) -> &Owners {
        &self.owners
    }

    /// Cachelets owned by one (server, worker), in id order.
    pub fn cachelets_of(&self, server: u16, worker: u16) -> Vec<CacheletId> {
        (self.owners.iter().enumerate()).filter(|(_, &o)| o == (server, worker)).map(|(c, _)| c as CacheletId).collect()
    }

    /// Is (server, worker) a worker of this map?
    pub fn has_worker(&self, (s, w): Owner) -> bool {
        self.servers.get(s as usize).is_some_and(|i| (w as usize) < i.workers.len())
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
        let c = self.keyspace.cachelet_of_hash(hash);
        let (s, w) = self.owner(c);
        (c, s, w)
    }

    /// Move a cachelet to a new owner; bumps the epoch. Returns the new epoch.
    pub fn move_cachelet(&mut self, c: CacheletId, to: (u16, u16)) -> u64 {
        assert!(self.has_worker(to), "no worker {} on server {}", to.1, to.0);
        self.owners.set(c as usize, to);
        self.epoch += 1;
        self.epoch
    }

    /// Change a cachelet's owner without bumping the epoch: a server's own
    /// view of where its cachelets are, between two epochs of a map whose
    /// epochs another process (the coordinator) numbers.
    pub fn set_owner_local(&mut self, c: CacheletId, to: (u16, u16)) {
        assert!(self.has_worker(to), "no worker {} on server {}", to.1, to.0);
        self.owners.set(c as usize, to);
    }

    /// Append a server (id = the next index); bumps the epoch. Returns its id.
    /// It owns nothing until a [`ClusterMap::reassign`] gives it cachelets.
    pub fn add_server(&mut self, info: ServerInfo) -> u16 {
        assert!(self.servers.len() < u16::MAX as usize, "too many servers");
        let id = self.servers.len() as u16;
        self.update(&[(id, info)], &[]).expect("appending a server keeps the map valid");
        id
    }

    /// Replace a server's addresses (e.g. it came back on new worker ports);
    /// bumps the epoch. Refused if it would leave a cachelet on a worker the
    /// server no longer has.
    pub fn set_server(&mut self, id: u16, info: ServerInfo) -> Result<u64, String> {
        if id as usize >= self.servers.len() {
            return Err(format!("no server {id}"));
        }
        self.update(&[(id, info)], &[])
    }

    /// Many owner changes under ONE epoch bump. Checked first: every
    /// cachelet exists and every new owner is a worker of the map;
    /// nothing changes on an error.
    pub fn reassign(&mut self, moves: &[(CacheletId, Owner)]) -> Result<u64, String> {
        self.update(&[], moves)
    }

    /// Server changes (`(id, info)`: id < the server count replaces that
    /// server, id == the count appends one) and owner changes, all checked
    /// first, under one epoch bump. Nothing changes on an error.
    pub fn update(&mut self, servers: &[(u16, ServerInfo)], moves: &[(CacheletId, Owner)]) -> Result<u64, String> {
        let mut next = self.servers.to_vec();
        for (id, info) in servers {
            match (*id as usize).cmp(&next.len()) {
                std::cmp::Ordering::Less => next[*id as usize] = info.clone(),
                std::cmp::Ordering::Equal if next.len() < u16::MAX as usize => next.push(info.clone()),
                _ => return Err(format!("server {id} is neither in the map nor the next one")),
            }
        }
        let has = |(s, w): Owner| next.get(s as usize).is_some_and(|i| (w as usize) < i.workers.len());
        let mut owners = self.owners.clone();
        for &(c, to) in moves {
            if c >= self.cachelet_count() {
                return Err(format!("no cachelet {c}: the map has {}", self.cachelet_count()));
            }
            if !has(to) {
                return Err(format!("cachelet {c} to server {} worker {}, which the map does not have", to.0, to.1));
            }
            owners.set(c as usize, to);
        }
        if let Some((c, &(s, w))) = owners.iter().enumerate().find(|(_, &o)| !has(o)) {
            return Err(format!("cachelet {c} would stay on server {s} worker {w}, which the map would not have"));
        }
        if *self.servers != next {
            self.servers = Arc::new(next);
        }
        self.owners = owners;
        self.epoch += 1;
        Ok(self.epoch)
    }

    /// The moves that turn `self` into `newer` (same geometry, newer epoch).
    pub fn diff(&self, newer: &ClusterMap) -> MapDiff {
        assert_eq!(self.keyspace, newer.keyspace, "maps of different clusters");
        let moves = (0..self.cachelet_count())
            .filter(|&c| self.owner(c) != newer.owner(c))
            .map(|c| (c, newer.owner(c)))
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
            if c >= self.cachelet_count() {
                return Err(format!("diff names cachelet {c}, the map has {}", self.cachelet_count()));
            }
            if !self.has_worker(owner) {
                return Err(format!(
                    "diff moves cachelet {c} to server {} worker {}, not in the map",
                    owner.0, owner.1
                ));
            }
        }
        for &(c, owner) in &d.moves {
            self.owners.set(c as usize, owner);
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

    /// The even map of `n` servers x `w` workers with `cpw` cachelets per
    /// worker and 4,096 VNs; server i's worker j listens on 20001 + 100 i + j.
    fn map(n: u16, w: u16, cpw: u32) -> ClusterMap {
        let servers = (0..n)
            .map(|i| ServerInfo {
                main: format!("127.0.0.1:{}", 20000 + i * 100).parse().unwrap(),
                workers: (0..w).map(|j| format!("127.0.0.1:{}", 20001 + i * 100 + j).parse().unwrap()).collect(),
            })
            .collect();
        ClusterMap::even(servers, cpw, 4096)
    }

    #[test]
    fn same_servers_same_map() {
        let a = map(4, 2, 16);
        let b = map(4, 2, 16);
        assert_eq!(a, b);
        assert_eq!(a.epoch(), 1);
        assert_eq!(a.worker_addr(1, 1).port(), 20102);
    }

    #[test]
    fn stale_diff_is_refused() {
        let a = map(2, 2, 2);
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

    #[test]
    fn json_keeps_the_wire_format_and_is_checked() {
        let m = map(2, 2, 2);
        let v: serde_json::Value = serde_json::from_str(&m.to_json()).unwrap();
        assert_eq!(v["layout"]["vn_count"], 4096);
        assert_eq!(v["layout"]["cachelet_owner"][1], serde_json::json!([1, 0]));
        assert_eq!(v["layout"]["vn_to_cachelet"][9], 1);
        assert_eq!(ClusterMap::from_json(&m.to_json()).unwrap(), m);
        // an owner on a worker the map does not have, a VN of no cachelet, a short table
        let mut bad = v.clone();
        bad["layout"]["cachelet_owner"][3] = serde_json::json!([0, 2]);
        assert!(ClusterMap::from_json(&bad.to_string()).unwrap_err().contains("does not have"));
        let mut bad = v.clone();
        bad["layout"]["vn_to_cachelet"][0] = serde_json::json!(8);
        assert!(ClusterMap::from_json(&bad.to_string()).is_err());
        let mut bad = v;
        bad["layout"]["vn_count"] = serde_json::json!(4095);
        assert!(ClusterMap::from_json(&bad.to_string()).is_err());
    }

    #[test]
    fn diff_to_an_unknown_worker_is_refused() {
        let a = map(2, 2, 2);
        let d = MapDiff { from_epoch: 1, to_epoch: 2, moves: vec![(0, (1, 0)), (1, (5, 0))] };
        let mut x = a.clone();
        assert!(x.apply(&d).is_err());
        assert_eq!(x, a, "nothing applied");
    }

    #[test]
    fn membership_changes_bump_the_epoch_once_and_are_checked() {
        let mut m = map(2, 2, 2);
        let info = |p: u16| ServerInfo {
            main: format!("127.0.0.1:{p}").parse().unwrap(),
            workers: vec![format!("127.0.0.1:{}", p + 1).parse().unwrap(); 2],
        };
        assert_eq!(m.add_server(info(30000)), 2);
        assert_eq!(m.epoch(), 2);
        assert!(m.cachelets_of(2, 0).is_empty());
        assert_eq!(m.reassign(&[(0, (2, 0)), (1, (2, 1)), (7, (2, 0))]).unwrap(), 3, "one bump for three moves");
        assert_eq!(m.cachelets_of(2, 0), vec![0, 7]);
        let before = m.clone();
        assert!(m.reassign(&[(2, (2, 0)), (3, (2, 2))]).is_err(), "no worker 2");
        assert!(m.reassign(&[(99, (0, 0))]).is_err(), "no cachelet 99");
        assert!(m.reassign(&[(0, (3, 0))]).is_err(), "no server 3");
        assert_eq!(m, before, "nothing changed by a refused reassign");
        // New worker ports: fine; fewer workers while one still owns cachelets: refused.
        let mut moved = info(31000);
        assert_eq!(m.set_server(2, moved.clone()).unwrap(), 4);
        assert_eq!(m.worker_addr(2, 1).port(), 31001);
        moved.workers.pop();
        assert!(m.set_server(2, moved).is_err());
        assert!(m.set_server(9, info(1)).is_err());
        assert!(m.update(&[(5, info(1))], &[]).is_err(), "a gap in the ids");
        assert_eq!(m.epoch(), 4);
        assert_eq!(ClusterMap::from_json(&m.to_json()).unwrap(), m);
    }

    proptest! {
        #[test]
        fn diffs_apply(moves in proptest::collection::vec((0u32..32, 0u16..4, 0u16..2), 0..20)) {
            let base = map(4, 2, 4);
            let mut newer = base.clone();
            for (c, s, w) in moves {
                newer.move_cachelet(c, (s, w));
            }
            prop_assert!(newer.epoch() >= base.epoch());
            let d = base.diff(&newer);
            let mut x = base.clone();
            x.apply(&d).unwrap();
            prop_assert_eq!(x.owners(), newer.owners());
            prop_assert_eq!(x.keyspace(), newer.keyspace());
            prop_assert_eq!(x.epoch(), newer.epoch());
            // Every cachelet has exactly one owner, on a real worker.
            for c in 0..x.cachelet_count() {
                let (s, w) = x.owner(c);
                prop_assert!(s < 4 && w < 2);
            }
            // JSON round trip.
            prop_assert_eq!(ClusterMap::from_json(&x.to_json()).unwrap(), x);
        }

        /// The VN table's plain-form reader reads what serde_json reads, whatever the white
        /// space; a number that is not plain it leaves to serde_json.
        #[test]
        fn the_vn_table_reader_agrees_with_serde_json(
            xs in proptest::collection::vec(any::<u32>(), 0..50),
            pads in proptest::collection::vec(proptest::sample::select(vec!["", " ", "\n", "\t ", "\r\n"]), 0..120),
        ) {
            let pad = |i: usize| pads.get(i).copied().unwrap_or("");
            let mut text = format!("{}[{}", pad(0), pad(1));
            for (i, x) in xs.iter().enumerate() {
                if i > 0 {
                    text.push_str(&format!("{},{}", pad(2 * i), pad(2 * i + 1)));
                }
                text.push_str(&x.to_string());
            }
            text.push_str(&format!("{}]{}", pad(118), pad(119)));
            let serde: Vec<u32> = serde_json::from_str(&text).unwrap();
            prop_assert_eq!(&serde, &xs);
            prop_assert_eq!(parse_u32_array(&text), Some(xs));
        }
    }

    #[test]
    fn the_vn_table_reader_leaves_all_but_plain_numbers_to_serde_json() {
        for bad in [
            "",
            "[",
            "]",
            "[,]",
            "[1,]",
            "[1 2]",
            "[01]",
            "[-1]",
            "[1.0]",
            "[1e2]",
            "[4294967296]",
            "[99999999999]",
            "[1]x",
            "{}",
            "[\"1\"]",
            "[1,,2]",
            "[ 1 , 2 ",
            "[1]\u{a0}",
        ] {
            assert_eq!(parse_u32_array(bad), None, "{bad:?}");
        }
        assert_eq!(parse_u32_array("[]"), Some(vec![]));
        assert_eq!(parse_u32_array(" [ 0 ,4294967295 ] "), Some(vec![0, u32::MAX]));
        // A table serde_json reads that is not in plain form still parses; a bad one fails
        // with serde_json's error, inside the map's.
        let m = map(2, 1, 2);
        let j = m.to_json();
        let n = m.keyspace().vn_count();
        let table: Vec<String> = (0..n).map(|v| m.keyspace().cachelet_of_vn(v).to_string()).collect();
        let plain = format!("\"vn_to_cachelet\":[{}]", table.join(","));
        assert!(j.contains(&plain), "the map writes the plain form");
        let odd = j.replace(&plain, &format!("\"vn_to_cachelet\":[{}]", table.join(".0,") + ".0"));
        assert!(ClusterMap::from_json(&odd).is_err(), "1.0 is not a u32 to serde_json either");
        let neg = j.replace(&plain, &format!("\"vn_to_cachelet\":[-1{}]", ",0".repeat(n as usize - 1)));
        assert!(ClusterMap::from_json(&neg).is_err());
    }
}
