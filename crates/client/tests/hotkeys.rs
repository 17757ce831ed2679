//! The routing client and Phase 1 against REAL servers (3 servers x 2
//! workers, in-process on loopback ports): a key pinned hot with
//! `mbal debug hot` is read from its copies on other servers, the client
//! reads its own writes, and a shadow server killed mid-lease costs the
//! caller nothing (the read falls back home, no error).

use mbal_client::{key_hash, Client, ClusterMap, Config};
use mbal_member::ClusterSpec;
use mbal_server::ServerHandle;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

const WORKERS: u16 = 2;

struct Cluster {
    spec: ClusterSpec,
    servers: Vec<Option<ServerHandle>>,
}

impl Cluster {
    /// `n` servers with Phase 1 on, epochs of 100 ms, leases of
    /// `lease_epochs` epochs, the debug commands, and no balancer moving
    /// cachelets.
    fn start(n: usize, lease_epochs: u32) -> Cluster {
        let spec = mbal_server::testing::loopback_spec(n, WORKERS);
        let servers = (0..n)
            .map(|id| {
                let mut s = mbal_server::testing::hot_member(&spec, id as u16, 100);
                s.hot.policy.lease_epochs = lease_epochs;
                Some(mbal_server::start(s).expect("server starts"))
            })
            .collect();
        Cluster { spec, servers }
    }

    fn map(&self) -> ClusterMap {
        self.spec.initial_map()
    }

    fn addr(&self, s: u16) -> SocketAddr {
        self.spec.servers[s as usize].addr
    }

    /// A key whose home is on server `s`.
    fn key_on(&self, s: u16, prefix: &str) -> String {
        let map = self.map();
        (0..100_000).map(|i| format!("{prefix}{i}")).find(|k| map.route(key_hash(k.as_bytes())).1 == s).unwrap()
    }

    /// Pin `key` hot with `replicas` copies (answered once they exist).
    fn pin(&self, key: &str, replicas: u32) {
        let home = self.map().route(key_hash(key.as_bytes())).1;
        let s = TcpStream::connect(self.addr(home)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut w = s.try_clone().unwrap();
        w.write_all(format!("mbal debug hot {key} {replicas}\r\n").as_bytes()).unwrap();
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line).unwrap();
        assert_eq!(line, "OK\r\n");
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for s in self.servers.iter_mut().filter_map(Option::take) {
            s.shutdown();
        }
    }
}

fn get(c: &mut Client, key: &str) -> Option<String> {
    c.get(key.as_bytes()).unwrap().map(|v| String::from_utf8(v.data).unwrap())
}

/// Read `key` until the client holds a live lease that drew a copy (not the
/// home); bounded by a deadline. Every read must return `want`.
fn until_leased_to_a_copy(c: &mut Client, key: &str, want: &str) -> (u16, u16) {
    // A lease draws the home with probability 1/(γ+1) and keeps it to its
    // end: allow many leases.
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        assert_eq!(get(c, key).as_deref(), Some(want));
        if let Some(l) = c.leases().lease(key_hash(key.as_bytes())) {
            if l.copy != 0 && Instant::now() < l.until {
                return l.at;
            }
        }
        assert!(Instant::now() < deadline, "no lease on a copy of {key}");
        std::thread::yield_now();
    }
}

#[test]
fn a_hot_key_is_read_from_its_copies_and_the_writer_reads_its_writes() {
    // leases of 2 s: a lease found live is still live at the next read
    let cl = Cluster::start(3, 20);
    let mut c = Client::from_map(cl.map(), Config::default());
    let key = cl.key_on(0, "hot");
    let cold = cl.key_on(1, "cold");
    assert!(c.set(key.as_bytes(), b"v0", 0, 0).unwrap());
    assert!(c.set(cold.as_bytes(), b"c", 0, 0).unwrap());
    cl.pin(&key, 2);
    let at = until_leased_to_a_copy(&mut c, &key, "v0");
    assert_ne!(at.0, 0, "the copy lives on another server than the home");
    let before = c.replica_reads();
    assert_eq!(get(&mut c, &key).as_deref(), Some("v0"));
    assert_eq!(c.replica_reads(), before + 1, "read at the copy");
    // gets goes home; get_multi reads the hot key at its copy and the rest at home
    assert_eq!(c.gets(key.as_bytes()).unwrap().unwrap().data, b"v0");
    until_leased_to_a_copy(&mut c, &key, "v0");
    let before = c.replica_reads();
    let got = c.get_multi(&[cold.as_bytes(), key.as_bytes(), b"missing-key"]).unwrap();
    let got: Vec<Option<Vec<u8>>> = got.into_iter().map(|v| v.map(|v| v.data)).collect();
    assert_eq!(got, vec![Some(b"c".to_vec()), Some(b"v0".to_vec()), None]);
    assert_eq!(c.replica_reads(), before + 1);
    // read-your-writes: each write is read back at once, whatever lease the client held
    for i in 1..=30 {
        let v = format!("v{i}");
        assert!(c.set(key.as_bytes(), v.as_bytes(), 0, 0).unwrap());
        assert_eq!(get(&mut c, &key), Some(v.clone()), "write {i} read back");
        // and reads stay monotonic until the next write, copies included
        for _ in 0..5 {
            assert_eq!(get(&mut c, &key), Some(v.clone()));
        }
    }
    // copies serve reads again once the last write has been copied (whether they served any
    // within the loop depends on how fast the replicator copied each write: not asserted)
    until_leased_to_a_copy(&mut c, &key, "v30");
    assert_eq!(get(&mut c, &key).as_deref(), Some("v30"));
    assert!(c.replica_reads() > before + 1, "copies served reads after the writes");
    assert_eq!(c.replica_fallbacks(), 0, "no copy failed");
}

#[test]
fn a_shadow_killed_mid_lease_falls_back_home_without_error() {
    // leases of 3 s: the lease on the dead copy is still live when it is read,
    // and a lease that drew the home ends soon enough for a new draw
    let mut cl = Cluster::start(3, 30);
    let mut c = Client::from_map(cl.map(), Config::default());
    let key = cl.key_on(0, "k");
    assert!(c.set(key.as_bytes(), b"v", 0, 0).unwrap());
    cl.pin(&key, 2);
    let (dead, _) = until_leased_to_a_copy(&mut c, &key, "v");
    cl.servers[dead as usize].take().unwrap().shutdown();
    // the lease still points at the dead server: the read goes home, no error
    let l = *c.leases().lease(key_hash(key.as_bytes())).unwrap();
    assert!(l.at.0 == dead && Instant::now() < l.until, "mid-lease");
    let fallbacks = c.replica_fallbacks();
    assert_eq!(get(&mut c, &key).as_deref(), Some("v"));
    assert!(c.replica_fallbacks() > fallbacks, "the copy failed and the read fell back");
    // and it keeps working, single and multi-key, whatever the home hints next
    for _ in 0..200 {
        assert_eq!(get(&mut c, &key).as_deref(), Some("v"));
        let got = c.get_multi(&[key.as_bytes(), key.as_bytes()]).unwrap();
        assert!(got.iter().all(|v| v.as_ref().is_some_and(|v| v.data == b"v")));
    }
}
