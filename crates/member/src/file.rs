//! The cluster file: a cluster as its TOML file describes it (servers,
//! workers, key space), its secret and its `[tls]` section, and the initial
//! map it gives. The map itself, with no I/O, is `mbal_cluster::ClusterMap`.

use crate::peer_auth::Secret;
use mbal_cluster::{ClusterMap, ServerInfo, DEFAULT_CACHELETS_PER_WORKER, DEFAULT_VN_COUNT};
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
    pub secret: Option<Secret>,
    /// A file holding the cluster secret (relative to the cluster file's
    /// folder); trailing whitespace is not part of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_file: Option<std::path::PathBuf>,
    /// TLS for the members' listeners and for every connection to them
    /// (docs/operations.md, "TLS"); `None`: plain TCP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsSpec>,
    /// The coordinators that own the map (`mbal coordinator`; several share etcd): a server
    /// started with this file registers with them unless `--coordinator` says otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub coordinators: Vec<SocketAddr>,
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
    pub secret: Option<Secret>,
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
    /// The initial map of a spec (epoch 1): deterministic and even.
    pub fn initial_map(&self) -> ClusterMap {
        let spec = self;
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

    pub fn from_toml(text: &str) -> Result<ClusterSpec, String> {
        let s: ClusterSpec = toml::from_str(text).map_err(|e| e.to_string())?;
        s.validate()?;
        Ok(s)
    }

    /// The cluster secret, if the file names one (`secret`, or `secret_file`
    /// read relative to `dir`, the cluster file's folder).
    pub fn load_secret(&self, dir: Option<&std::path::Path>) -> Result<Option<Secret>, String> {
        match (&self.secret, &self.secret_file) {
            (Some(_), Some(_)) => Err("the cluster file sets both secret and secret_file".into()),
            (Some(s), None) => Secret::new(s.bytes().to_vec()).map(Some),
            (None, Some(f)) => {
                let path = match dir {
                    Some(d) if f.is_relative() => d.join(f),
                    _ => f.clone(),
                };
                Secret::from_file(&path).map(Some)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(n: u16, w: u16, cpw: u32) -> ClusterSpec {
        ClusterSpec {
            coordinators: Vec::new(),
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
        let a = spec(4, 2, 16).initial_map();
        assert_eq!(a, spec(4, 2, 16).initial_map());
        assert_eq!(a.epoch(), 1);
        assert_eq!(a.worker_addr(1, 1).port(), 20102);
        let no_ports = ClusterSpec {
            coordinators: Vec::new(),
            servers: vec![ServerSpec { addr: "127.0.0.1:7".parse().unwrap(), worker_port_base: None }],
            ..spec(1, 2, 1)
        };
        assert_eq!(no_ports.initial_map().worker_addr(0, 1).port(), 7, "no worker ports: the main port");
    }
}
