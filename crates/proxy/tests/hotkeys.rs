//! The proxy and Phase 1 against REAL servers (3 servers x 2 workers, in
//! process on loopback): a plain client behind the proxy never sees an
//! `RH hot` hint, its gets of a hot key are served by the key's copies on
//! other servers, it reads its own writes, and a shadow killed mid-lease
//! costs it no error.

use mbal_cluster::key_hash;
use mbal_member::ClusterSpec;
use mbal_proxy::Config;
use mbal_server::ServerHandle;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

const WORKERS: u16 = 2;

struct Conn {
    r: BufReader<TcpStream>,
    w: TcpStream,
}

impl Conn {
    fn open(addr: SocketAddr) -> Conn {
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.set_nodelay(true).unwrap();
        Conn { r: BufReader::new(s.try_clone().unwrap()), w: s }
    }
    fn line(&mut self) -> String {
        let mut l = String::new();
        self.r.read_line(&mut l).unwrap();
        l
    }
    fn cmd(&mut self, c: &str) -> String {
        self.w.write_all(c.as_bytes()).unwrap();
        self.line()
    }
    /// The whole reply to `get <key>`, as text.
    fn get(&mut self, key: &str) -> String {
        let mut out = self.cmd(&format!("get {key}\r\n"));
        if out.starts_with("VALUE ") {
            let n: usize = out.split_whitespace().nth(3).unwrap().parse().unwrap();
            let mut v = vec![0; n + 2];
            self.r.read_exact(&mut v).unwrap();
            out += &String::from_utf8(v).unwrap();
            out += &self.line();
        }
        out
    }
    fn stat(&mut self, name: &str) -> u64 {
        self.w.write_all(b"stats\r\n").unwrap();
        let mut found = None;
        loop {
            let l = self.line();
            assert!(!l.is_empty());
            if l == "END\r\n" {
                return found.unwrap_or_else(|| panic!("no stat {name}"));
            }
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.len() == 3 && f[1] == name {
                found = Some(f[2].parse().unwrap());
            }
        }
    }
}

/// Three servers with Phase 1 on (epochs of 100 ms, leases of 10 s) and the debug commands.
fn cluster() -> (ClusterSpec, Vec<Option<ServerHandle>>) {
    let spec = mbal_server::testing::loopback_spec(3, WORKERS);
    let servers = (0..3)
        .map(|id| {
            let mut s = mbal_server::testing::hot_member(&spec, id, 100);
            s.hot.policy.lease_epochs = 30; // 3 s: a lease that drew the home ends soon enough for another draw
            Some(mbal_server::start(s).expect("server starts"))
        })
        .collect();
    (spec, servers)
}

#[test]
fn plain_clients_read_hot_keys_from_copies_through_the_proxy() {
    let (spec, mut servers) = cluster();
    let map = spec.initial_map();
    let p = mbal_proxy::start(Config::new("127.0.0.1:0".parse().unwrap()), map.clone()).unwrap();
    let key = (0..).map(|i| format!("hot{i}")).find(|k| map.route(key_hash(k.as_bytes())).1 == 0).unwrap();
    let mut c = Conn::open(p.addr);
    assert_eq!(c.cmd(&format!("set {key} 0 0 2\r\nv0\r\n")), "STORED\r\n");
    let mut home = Conn::open(spec.servers[0].addr);
    assert_eq!(home.cmd(&format!("mbal debug hot {key} 2\r\n")), "OK\r\n");
    let want = |v: &str| format!("VALUE {key} 0 {}\r\n{v}\r\nEND\r\n", v.len());
    // gets through one proxy connection: each lease (10 s) drew the home or a copy; new
    // connections land on the proxy's one thread, whose lease decides
    let deadline = Instant::now() + Duration::from_secs(40);
    let mut admin = Conn::open(p.addr);
    while admin.stat("proxy_replica_reads") == 0 {
        // the first get of a lease reads at home and brings the hint; the second reads the copy drawn
        assert_eq!(c.get(&key), want("v0"), "no hint passed on, the value unchanged");
        assert_eq!(c.get(&key), want("v0"));
        // a write through the proxy ends its lease, so the next lease is drawn anew
        if admin.stat("proxy_replica_reads") == 0 {
            assert_eq!(c.cmd(&format!("set {key} 0 0 2\r\nv0\r\n")), "STORED\r\n");
        }
        assert!(Instant::now() < deadline, "no get served by a copy");
    }
    assert_eq!(admin.stat("proxy_replica_fallbacks"), 0);
    // read-your-writes through the proxy
    for i in 1..=20 {
        let v = format!("w{i}");
        assert_eq!(c.cmd(&format!("set {key} 0 0 {}\r\n{v}\r\n", v.len())), "STORED\r\n");
        assert_eq!(c.get(&key), want(&v));
    }
    // a live lease on a copy, then its server dies: gets keep answering, with no error
    let deadline = Instant::now() + Duration::from_secs(40);
    let before = admin.stat("proxy_replica_reads");
    while admin.stat("proxy_replica_reads") == before {
        assert_eq!(c.get(&key), want("w20"));
        assert!(Instant::now() < deadline, "no get served by a copy");
    }
    for s in [1, 2] {
        servers[s].take().unwrap().shutdown();
    }
    for _ in 0..50 {
        assert_eq!(c.get(&key), want("w20"), "falls back home");
    }
    assert!(admin.stat("proxy_replica_fallbacks") >= 1);
    p.shutdown();
    for s in servers.into_iter().flatten() {
        s.shutdown();
    }
}

#[test]
fn each_proxy_connection_draws_its_own_copy() {
    let (spec, servers) = cluster();
    let map = spec.initial_map();
    let p = mbal_proxy::start(Config::new("127.0.0.1:0".parse().unwrap()), map.clone()).unwrap();
    let key = (0..).map(|i| format!("spread{i}")).find(|k| map.route(key_hash(k.as_bytes())).1 == 0).unwrap();
    let mut c = Conn::open(p.addr);
    assert_eq!(c.cmd(&format!("set {key} 0 0 2\r\nv0\r\n")), "STORED\r\n");
    let mut home = Conn::open(spec.servers[0].addr);
    // 4 copies: one on each worker of servers 1 and 2
    assert_eq!(home.cmd(&format!("mbal debug hot {key} 4\r\n")), "OK\r\n");
    let want = format!("VALUE {key} 0 2\r\nv0\r\nEND\r\n");
    // until the home hands out leases
    let deadline = Instant::now() + Duration::from_secs(40);
    while home.stat("hot_hints") == 0 {
        assert_eq!(Conn::open(p.addr).get(&key), want);
        assert!(Instant::now() < deadline, "no hint");
    }
    // 24 connections of the proxy's one thread, each within its first lease: each draws its own
    // copy (one cache per thread would send all of them to one copy)
    let mut conns: Vec<Conn> = (0..24).map(|_| Conn::open(p.addr)).collect();
    for c in &mut conns {
        assert_eq!(c.get(&key), want, "the first read goes home and brings the hint");
        assert_eq!(c.get(&key), want, "the second reads the copy drawn");
    }
    let reads: Vec<u64> = [1, 2].iter().map(|&s| Conn::open(spec.servers[s].addr).stat("replica_reads")).collect();
    assert!(reads.iter().all(|&r| r > 0), "copies on both shadow servers read: {reads:?}");
    p.shutdown();
    for s in servers.into_iter().flatten() {
        s.shutdown();
    }
}
