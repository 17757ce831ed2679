//! The routing client against REAL servers whose workers share threads (in-process, loopback
//! ports): a key goes to the connection of the first worker of its owner's thread, which serves
//! it on the owner's store (docs/protocol.md, `mbal hello`); the client learns the thread count
//! from `mbal hello`, and when the count changes under it, a redirect tells it and it asks
//! again. Every value read is checked.

use mbal_client::{key_hash, Client, ClusterMap, Config};
use mbal_member::ClusterSpec;
use mbal_server::ServerHandle;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const WORKERS: u16 = 4;

struct Cluster {
    spec: ClusterSpec,
    servers: Vec<ServerHandle>,
}

impl Cluster {
    /// `n` servers of 4 workers on `threads` threads each (fixed: no thread policy), Phase 1
    /// on with the debug commands, no balancer.
    fn start(n: usize, threads: usize) -> Cluster {
        let spec = mbal_server::testing::loopback_spec(n, WORKERS);
        let servers = (0..n)
            .map(|id| {
                let mut s = mbal_server::testing::hot_member(&spec, id as u16, 100);
                s.worker_threads = threads;
                mbal_server::start(s).expect("server starts")
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

    /// One command on a fresh plain connection to server `s`; its first reply line.
    fn cmd(&self, s: u16, cmd: &str) -> String {
        let c = TcpStream::connect(self.addr(s)).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        (&c).write_all(cmd.as_bytes()).unwrap();
        let mut line = String::new();
        BufReader::new(c).read_line(&mut line).unwrap();
        line
    }

    /// `stats` of server `s` as a map.
    fn stats(&self, s: u16) -> HashMap<String, String> {
        let c = TcpStream::connect(self.addr(s)).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        (&c).write_all(b"stats\r\n").unwrap();
        let mut out = HashMap::new();
        for line in BufReader::new(c).lines() {
            let line = line.unwrap();
            if line == "END" {
                break;
            }
            let mut t = line.split_whitespace().skip(1);
            if let (Some(k), Some(v)) = (t.next(), t.next()) {
                out.insert(k.to_string(), v.to_string());
            }
        }
        out
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for s in self.servers.drain(..) {
            s.shutdown();
        }
    }
}

/// Keys with owners on every worker of every server, `per` each.
fn keys_everywhere(map: &ClusterMap, prefix: &str, per: usize) -> Vec<String> {
    let mut seen: HashMap<(u16, u16), usize> = HashMap::new();
    let want = map.servers().len() * WORKERS as usize * per;
    let mut keys = Vec::new();
    for i in 0.. {
        let k = format!("{prefix}{i}");
        let (_, s, w) = map.route(key_hash(k.as_bytes()));
        let n = seen.entry((s, w)).or_default();
        if *n < per {
            *n += 1;
            keys.push(k);
            if keys.len() == want {
                break;
            }
        }
    }
    keys
}

/// A key owned by (s, w).
fn key_of(map: &ClusterMap, prefix: &str, s: u16, w: u16) -> String {
    let owned = |k: &String| {
        let (_, ks, kw) = map.route(key_hash(k.as_bytes()));
        (ks, kw) == (s, w)
    };
    (0..100_000).map(|i| format!("{prefix}{i}")).find(owned).unwrap()
}

/// Before it has talked to a server, the client knows nothing of its threads and sends a key
/// to its owner's own connection; its first request to each server here goes to worker 0.
fn meet(c: &mut Client, map: &ClusterMap) {
    for s in 0..map.servers().len() as u16 {
        assert!(c.set(key_of(map, "meet", s, 0).as_bytes(), b"x", 0, 0).unwrap());
    }
}

#[test]
fn keys_of_every_worker_go_to_the_first_worker_of_their_thread() {
    // 2 servers, each with its 4 workers on one thread
    let cl = Cluster::start(2, 1);
    let map = cl.map();
    let mut c = Client::from_map(map.clone(), Config::default());
    meet(&mut c, &map);
    let keys = keys_everywhere(&map, "k", 25);
    for k in &keys {
        assert!(c.set(k.as_bytes(), k.as_bytes(), 0, 0).unwrap());
    }
    for k in &keys {
        assert_eq!(c.get(k.as_bytes()).unwrap().unwrap().data, k.as_bytes());
    }
    let ask: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).chain([&b"missing"[..]]).collect();
    let got = c.get_multi(&ask).unwrap();
    for (k, v) in ask.iter().zip(&got) {
        assert_eq!(v.as_ref().map(|v| &v.data[..]), (*k != b"missing").then_some(*k));
    }
    let items: Vec<(&[u8], &[u8])> = keys.iter().map(|k| (k.as_bytes(), &b"new"[..])).collect();
    assert!(c.set_multi(&items, 0, 0).unwrap().iter().all(|&b| b));
    for k in keys.iter().step_by(7) {
        assert!(c.delete(k.as_bytes()).unwrap());
        assert_eq!(c.incr(k.as_bytes(), 1).unwrap(), None);
        assert!(c.add(k.as_bytes(), b"5", 0, 0).unwrap());
        assert_eq!(c.incr(k.as_bytes(), 2).unwrap(), Some(7));
    }
    // one connection per server (its thread's first worker), no redirect
    assert_eq!((c.server_threads(0), c.server_threads(1)), (1, 1));
    assert_eq!(c.connected(), vec![(0, 0), (1, 0)]);
    assert_eq!(c.redirects(), 0);
    for s in 0..2 {
        let st = cl.stats(s);
        assert_eq!(st["redirects"], "0", "server {s}");
        let direct: u64 = st["cross_worker_direct"].parse().unwrap();
        assert!(direct > 0, "server {s} ran its neighbours' keys on their stores: {direct}");
    }
}

#[test]
fn a_hot_key_of_a_neighbour_is_hinted_through_its_thread() {
    let cl = Cluster::start(2, 1);
    let map = cl.map();
    let mut c = Client::from_map(map.clone(), Config::default());
    meet(&mut c, &map);
    // a key homed on worker 3 of server 0, read through worker 0's connection
    let key = key_of(&map, "hot", 0, 3);
    assert!(c.set(key.as_bytes(), b"v0", 0, 0).unwrap());
    assert_eq!(cl.cmd(0, &format!("mbal debug hot {key} 3\r\n")), "OK\r\n");
    // read until a lease draws a copy (a lease may draw the home and keep it to its end)
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        assert_eq!(c.get(key.as_bytes()).unwrap().unwrap().data, b"v0");
        if c.replica_reads() > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "no read at a copy");
    }
    let lease = c.leases().lease(key_hash(key.as_bytes())).expect("a lease from the hint");
    assert_ne!(lease.at, (0, 3));
    assert!(c.connected().contains(&(0, 0)) && !c.connected().contains(&(0, 3)), "{:?}", c.connected());
    // the writer reads its write, at home
    assert!(c.set(key.as_bytes(), b"v1", 0, 0).unwrap());
    assert_eq!(c.get(key.as_bytes()).unwrap().unwrap().data, b"v1");
}

#[test]
fn clients_keep_reading_their_writes_while_the_threads_change() {
    // 4 workers on 2 threads, folded and spread by an operator while 3 clients run
    let cl = Arc::new(Cluster::start(1, 2));
    let map = cl.map();
    // the clients meet the server folded (and route by one thread), then it spreads
    assert!(cl.cmd(0, "mbal threads 1\r\n").starts_with("THREADS 1 2"));
    let ops = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let deadline = Instant::now() + Duration::from_secs(20);
    let clients: Vec<_> = (0..3)
        .map(|t| {
            let (map, ops, done) = (map.clone(), ops.clone(), done.clone());
            std::thread::spawn(move || {
                let mut c = Client::from_map(map.clone(), Config::default());
                let keys = keys_everywhere(&map, &format!("c{t}-"), 3);
                let mut last: HashMap<&str, String> = HashMap::new();
                for round in 0..400 {
                    if Instant::now() > deadline {
                        break;
                    }
                    for (i, k) in keys.iter().enumerate() {
                        let v = format!("{t}-{round}-{i}");
                        assert!(c.set(k.as_bytes(), v.as_bytes(), 0, 0).unwrap());
                        assert_eq!(c.get(k.as_bytes()).unwrap().unwrap().data, v.as_bytes(), "{k} after its set");
                        last.insert(k, v);
                    }
                    // two writes of one key in one pipeline: the later one stays
                    let (first, second) = (format!("{t}-{round}-a"), format!("{t}-{round}-b"));
                    let items: Vec<(&[u8], &[u8])> = keys
                        .iter()
                        .map(|k| (k.as_bytes(), first.as_bytes()))
                        .chain(keys.iter().map(|k| (k.as_bytes(), second.as_bytes())))
                        .collect();
                    assert!(c.set_multi(&items, 0, 0).unwrap().iter().all(|&b| b));
                    for k in &keys {
                        last.insert(k, second.clone());
                    }
                    let ask: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
                    for (k, v) in keys.iter().zip(c.get_multi(&ask).unwrap()) {
                        assert_eq!(v.unwrap().data, last[k.as_str()].as_bytes(), "{k} in a multi-get");
                    }
                    ops.fetch_add(1, Ordering::Relaxed);
                }
                done.store(true, Ordering::Relaxed);
                c.redirects()
            })
        })
        .collect();
    // Change the thread count every 5 client rounds (no clock: paced by the clients' work).
    let mut changes = 0;
    let mut seen = 0;
    while !done.load(Ordering::Relaxed) && Instant::now() < deadline + Duration::from_secs(5) {
        let now = ops.load(Ordering::Relaxed);
        if now >= seen + 5 {
            seen = now;
            let n = if changes % 2 == 0 { 2 } else { 1 };
            assert!(cl.cmd(0, &format!("mbal threads {n}\r\n")).starts_with(&format!("THREADS {n} 2")));
            changes += 1;
        } else {
            std::thread::yield_now();
        }
    }
    let redirects: u64 = clients.into_iter().map(|h| h.join().expect("a client failed")).sum();
    assert!(changes >= 6, "the threads changed {changes} times");
    eprintln!("{changes} changes, {redirects} redirects");
}

#[test]
fn a_client_learns_a_new_thread_count_from_a_redirect() {
    let cl = Cluster::start(1, 2);
    let map = cl.map();
    assert!(cl.cmd(0, "mbal threads 1\r\n").starts_with("THREADS 1 2"));
    let k1 = key_of(&map, "one", 0, 1);
    // The workers move between threads after the answer: wait until worker 0 serves worker
    // 1's keys to a connection routed by thread.
    let r = TcpStream::connect(cl.addr(0)).unwrap();
    r.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut lines = BufReader::new(r.try_clone().unwrap()).lines();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        // Hello again each time: a redirect ends a connection's thread-mate keys until it does
        // (docs/protocol.md), and the first set may come before worker 1 has moved.
        (&r).write_all(format!("mbal hello {} 0 threads\r\n", map.epoch()).as_bytes()).unwrap();
        assert!(lines.next().unwrap().unwrap().starts_with("MBAL 0 0 "));
        (&r).write_all(format!("set {k1} 0 0 1\r\na\r\n").as_bytes()).unwrap();
        let got = lines.next().unwrap().unwrap();
        if got == "STORED" {
            break;
        }
        assert!(got.starts_with("RD "), "unexpected {got:?}");
        if Instant::now() >= deadline {
            let st = cl.stats(0);
            let threads: Vec<_> = st.iter().filter(|(k, _)| k.starts_with("worker_thread")).collect();
            panic!("worker 1 never joined worker 0's thread: {got:?}, {threads:?}");
        }
    }
    let mut c = Client::from_map(map.clone(), Config::default());
    meet(&mut c, &map);
    assert_eq!(c.server_threads(0), 1);
    assert!(c.set(k1.as_bytes(), b"a", 0, 0).unwrap());
    assert_eq!(c.connected(), vec![(0, 0)]);
    // Spread: worker 1 leaves worker 0's thread; a request for its key at worker 0 is
    // redirected to it, the client retries there and asks for the thread count again.
    assert!(cl.cmd(0, "mbal threads 2\r\n").starts_with("THREADS 2 2"));
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut i = 0;
    while c.server_threads(0) != 2 {
        assert!(Instant::now() < deadline, "still routing by {} threads", c.server_threads(0));
        let v = format!("v{i}");
        assert!(c.set(k1.as_bytes(), v.as_bytes(), 0, 0).unwrap());
        assert_eq!(c.get(k1.as_bytes()).unwrap().unwrap().data, v.as_bytes());
        i += 1;
    }
    assert!(c.redirects() >= 1);
    assert!(c.connected().contains(&(0, 1)));
    // and routes by two threads: worker 3's keys go to worker 1 (once worker 3 too has
    // reached its new thread; until then a redirect sends them to worker 3 itself)
    let k3 = key_of(&map, "three", 0, 3);
    let mut n = 0;
    loop {
        let before = c.redirects();
        let v = format!("w{n}");
        assert!(c.set(k3.as_bytes(), v.as_bytes(), 0, 0).unwrap());
        assert_eq!(c.get(k3.as_bytes()).unwrap().unwrap().data, v.as_bytes());
        if c.redirects() == before && c.server_threads(0) == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "worker 3's keys still redirected");
        n += 1;
    }
}
