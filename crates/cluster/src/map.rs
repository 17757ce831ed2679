//! The cluster map: the fixed key space (VN -> cachelet), the owners
//! (cachelet -> (server, worker)), the servers' addresses and an epoch that
//! only grows. Every change to an owner bumps the epoch; a [`MapDiff`]
//! carries the changes between two epochs.

use crate::{even_owners, CacheletId, KeySpace, Owner, DEFAULT_CACHELETS_PER_WORKER, DEFAULT_VN_COUNT};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

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
    /// The cluster secret that control commands are authenticated with
    /// (`mbal peer`, [`crate::peer_auth`]); prefer `secret_file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<crate::peer_auth::Secret>,
    /// A file holding the cluster secret (relative to the cluster file's
    /// folder); trailing whitespace is not part of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_file: Option<std::path::PathBuf>,
    /// TLS for the members' listeners and for every connection to them
    /// (docs/operations.md, "TLS"); `None`: plain TCP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsSpec>,
}

/// The cluster file's `[tls]` section. Paths are relative to the cluster
/// file's folder. One CA (`ca_cert`) signs the members' certificates and,
/// with `verify_mode` 1..3, the client certificates they accept.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSpec {
    /// PEM CA certificates: servers' certificates chain to them (clients
    /// trust them) and, with `verify_mode` 1..3, so must client certificates.
    pub ca_cert: PathBuf,
    /// The members' certificate chain (leaf first); needed by a server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert: Option<PathBuf>,
    /// The members' private key [default: in `cert`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<PathBuf>,
    /// memcached's `ssl_verify_mode`: 0 no client certificate, 1 optional,
    /// 2 and 3 required.
    #[serde(default)]
    pub verify_mode: u8,
    /// The certificate (and key) a member, the proxy and the tools present
    /// on their own connections to members (needed with `verify_mode` 2..3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_cert: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_key: Option<PathBuf>,
    /// The name checked in a member's certificate [default: the IP address
    /// connected to].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_name: Option<String>,
}

fn relative_to(dir: Option<&Path>, f: &Path) -> PathBuf {
    match dir {
        Some(d) if f.is_relative() => d.join(f),
        _ => f.to_path_buf(),
    }
}

impl TlsSpec {
    pub fn validate(&self) -> Result<(), String> {
        mbal_tls::VerifyMode::from_memcached(self.verify_mode).map_err(|e| format!("[tls] {e}"))?;
        if self.client_key.is_some() && self.client_cert.is_none() {
            return Err("[tls] client_key needs client_cert".into());
        }
        if self.key.is_some() && self.cert.is_none() {
            return Err("[tls] key needs cert".into());
        }
        Ok(())
    }

    /// A member's listener settings (`-Z -o ssl_*`), paths resolved
    /// against `dir` (the cluster file's folder).
    pub fn server_files(&self, dir: Option<&Path>) -> Result<mbal_tls::ServerTlsFiles, String> {
        let cert = self.cert.as_deref().ok_or("[tls] has no cert: a member needs its certificate")?;
        let verify_mode = mbal_tls::VerifyMode::from_memcached(self.verify_mode).map_err(|e| format!("[tls] {e}"))?;
        Ok(mbal_tls::ServerTlsFiles {
            chain_cert: relative_to(dir, cert),
            key: self.key.as_deref().map(|k| relative_to(dir, k)),
            ca_cert: Some(relative_to(dir, &self.ca_cert)),
            verify_mode,
            tls13_only: false,
        })
    }

    /// The settings of a connection to a member, paths resolved against `dir`.
    pub fn client_files(&self, dir: Option<&Path>) -> mbal_tls::ClientTlsFiles {
        mbal_tls::ClientTlsFiles {
            ca_cert: relative_to(dir, &self.ca_cert),
            cert: self.client_cert.as_deref().map(|c| relative_to(dir, c)),
            key: self.client_key.as_deref().map(|k| relative_to(dir, k)),
            server_name: self.server_name.clone(),
        }
    }
}

/// A cluster file, read: its spec, its folder (relative paths in it are
/// read from there), the secret and the client side of its TLS loaded.
#[derive(Clone, Debug)]
pub struct ClusterFile {
    pub spec: ClusterSpec,
    pub dir: Option<PathBuf>,
    pub secret: Option<crate::peer_auth::Secret>,
    /// For connections to members (`[tls]`'s CA, client certificate, name).
    pub client_tls: Option<mbal_tls::ClientTls>,
}

impl ClusterFile {
    /// Read and check a cluster file, its secret and its TLS files (an
    /// error names the file and what is wrong).
    pub fn load(path: &Path) -> Result<ClusterFile, String> {
        let at = |e: String| format!("cluster file {}: {e}", path.display());
        let text = std::fs::read_to_string(path).map_err(|e| at(e.to_string()))?;
        let spec = ClusterSpec::from_toml(&text).map_err(at)?;
        let dir = path.parent().map(Path::to_path_buf);
        let secret = spec.load_secret(dir.as_deref()).map_err(at)?;
        let client_tls = match &spec.tls {
            Some(t) => Some(mbal_tls::ClientTls::load(&t.client_files(dir.as_deref())).map_err(at)?),
            None => None,
        };
        Ok(ClusterFile { spec, dir, secret, client_tls })
    }
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

    /// The cluster secret, if the file names one (`secret`, or `secret_file`
    /// read relative to `dir`, the cluster file's folder).
    pub fn load_secret(&self, dir: Option<&std::path::Path>) -> Result<Option<crate::peer_auth::Secret>, String> {
        match (&self.secret, &self.secret_file) {
            (Some(_), Some(_)) => Err("the cluster file sets both secret and secret_file".into()),
            (Some(s), None) => crate::peer_auth::Secret::new(s.bytes().to_vec()).map(Some),
            (None, Some(f)) => {
                let path = match dir {
                    Some(d) if f.is_relative() => d.join(f),
                    _ => f.clone(),
                };
                crate::peer_auth::Secret::from_file(&path).map(Some)
            }
            (None, None) => Ok(None),
        }
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
        if let Some(t) = &self.tls {
            t.validate()?;
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
    keyspace: KeySpace,
    /// cachelet id -> (server index, worker index).
    owners: Vec<Owner>,
    servers: Vec<ServerInfo>,
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
    vn_to_cachelet: Vec<CacheletId>,
    cachelet_owner: Vec<Owner>,
}

impl From<ClusterMap> for MapWire {
    fn from(m: ClusterMap) -> MapWire {
        let layout = LayoutWire {
            vn_count: m.keyspace.vn_count(),
            vn_to_cachelet: m.keyspace.table().to_vec(),
            cachelet_owner: m.owners,
        };
        MapWire { epoch: m.epoch, layout, servers: m.servers }
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
    /// The initial map of a spec (epoch 1): deterministic and even.
    pub fn from_spec(spec: &ClusterSpec) -> ClusterMap {
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
        ClusterMap::even(servers, spec.cachelets_per_worker, spec.vn_count)
    }

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
        let m = ClusterMap { epoch, keyspace, owners, servers };
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
        self.owners[c as usize]
    }

    /// Every cachelet's owner, by cachelet id.
    pub fn owners(&self) -> &[Owner] {
        &self.owners
    }

    /// Cachelets owned by one (server, worker), in id order.
    pub fn cachelets_of(&self, server: u16, worker: u16) -> Vec<CacheletId> {
        (0..self.cachelet_count()).filter(|&c| self.owners[c as usize] == (server, worker)).collect()
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
        self.owners[c as usize] = to;
        self.epoch += 1;
        self.epoch
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
            self.owners[c as usize] = owner;
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
            secret: None,
            secret_file: None,
            tls: None,
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
    fn tls_section_round_trips_and_resolves_paths() {
        let text = "workers = 1\n[[servers]]\naddr = \"127.0.0.1:1\"\n[tls]\nca_cert = \"ca.pem\"\n\
                    cert = \"/etc/m/server.pem\"\nverify_mode = 2\nclient_cert = \"c.pem\"\nserver_name = \"mbal\"\n";
        let s = ClusterSpec::from_toml(text).unwrap();
        assert_eq!(ClusterSpec::from_toml(&s.to_toml()).unwrap(), s);
        let t = s.tls.as_ref().unwrap();
        let dir = Path::new("/srv/c");
        let sf = t.server_files(Some(dir)).unwrap();
        assert_eq!(sf.chain_cert, Path::new("/etc/m/server.pem"), "absolute paths stay");
        assert_eq!(sf.ca_cert.as_deref(), Some(Path::new("/srv/c/ca.pem")));
        assert_eq!(sf.verify_mode, mbal_tls::VerifyMode::Required);
        let cf = t.client_files(Some(dir));
        assert_eq!(cf.cert.as_deref(), Some(Path::new("/srv/c/c.pem")));
        assert_eq!(cf.server_name.as_deref(), Some("mbal"));
        let bad = |extra: &str| ClusterSpec::from_toml(&format!("{text}{extra}")).unwrap_err();
        assert!(bad("bogus = 1\n").contains("bogus"));
        let no_cert =
            "workers = 1\n[[servers]]\naddr = \"127.0.0.1:1\"\n[tls]\nca_cert = \"ca.pem\"\nverify_mode = 7\n";
        assert!(ClusterSpec::from_toml(no_cert).unwrap_err().contains("ssl_verify_mode"));
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

    #[test]
    fn json_keeps_the_wire_format_and_is_checked() {
        let m = ClusterMap::from_spec(&spec(2, 2, 2));
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
        let a = ClusterMap::from_spec(&spec(2, 2, 2));
        let d = MapDiff { from_epoch: 1, to_epoch: 2, moves: vec![(0, (1, 0)), (1, (5, 0))] };
        let mut x = a.clone();
        assert!(x.apply(&d).is_err());
        assert_eq!(x, a, "nothing applied");
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
    }
}
